"""Lanes of the per-thread vectors that the unrolled-pixel kernels hold (forward.py, large_fma.py):
register moves only, no shared memory."""

import triton
import triton.language as tl


@triton.jit
def _lane(v, i: tl.constexpr, VEC: tl.constexpr):
    """Lane i of each thread's vector: v [R, G, VEC] -> [R, G], VEC 4 or 8 (register moves only)."""
    if VEC == 8:  # lane k = 2q + c: keep the half with c = i % 2, then lane q = i // 2 of it
        even, odd = tl.split(tl.reshape(v, [v.shape[0], v.shape[1], 4, 2]))
        v = even
        if i % 2 == 1:
            v = odd
        i = i // 2
    # 4 lanes: lane k = 2a + b
    even, odd = tl.split(tl.reshape(v, [v.shape[0], v.shape[1], 2, 2]))
    pair = even
    if i % 2 == 1:
        pair = odd
    low, high = tl.split(pair)
    lane = low
    if i >= 2:
        lane = high
    return lane


@triton.jit
def _pack4(a, b, c, d):
    """Four [R, G] lanes -> one [R, G, 4] vector (a, b, c, d)."""
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), [a.shape[0], a.shape[1], 4])
