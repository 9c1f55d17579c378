"""What several kernel families share: small @triton.jit helpers (lanes of register vectors,
plane pointers, weight loads, the aligned row windows of the NCHW row kernels) and the host-side
arithmetic their launch plans use (accumulator dtype, alignment units, window layouts, 64-bit tests).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._geometry import ConvGeometry, cdiv, next_power_of_2
from ._launch import alignment


@triton.jit
def _activate(v, ACTIVATION: tl.constexpr):
    """A forward epilogue's activation (its code: _geometry.ACTIVATION_CODES) of accumulator values,
    before their cast to the output's dtype.
    NaN stays NaN, as in PyTorch's (the NaN-propagating min and max: one instruction each on sm_90,
    where a compare and select took two)."""
    if ACTIVATION == 1:  # relu
        v = tl.maximum(v, 0.0, propagate_nan=tl.PropagateNan.ALL)
    elif ACTIVATION == 2:  # relu6
        v = tl.clamp(v, 0.0, 6.0, propagate_nan=tl.PropagateNan.ALL)
    elif ACTIVATION == 3:  # silu
        v = v / (1.0 + tl.exp(-v))
    elif ACTIVATION == 4:  # gelu, erf form
        v = 0.5 * v * (1.0 + tl.erf(v * 0.7071067811865476))
    elif ACTIVATION == 5:  # gelu, tanh form: 0.5 v (1 + tanh(u)) = v sigmoid(2u)
        u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        v = v / (1.0 + tl.exp(-2.0 * u))
    elif ACTIVATION == 6:  # hardswish
        v = v * tl.clamp(v + 3.0, 0.0, 6.0, propagate_nan=tl.PropagateNan.ALL) / 6.0
    elif ACTIVATION == 7:  # hardsigmoid
        v = tl.clamp(v + 3.0, 0.0, 6.0, propagate_nan=tl.PropagateNan.ALL) / 6.0
    return v


@triton.jit
def _activation_slope(z, ACTIVATION: tl.constexpr):
    """The derivative of _activate at z, with PyTorch's conventions at the kinks and for NaN (its
    backward formulas: relu and relu6 pass a NaN's gradient, as `z <= 0 ? 0 : g` does)."""
    slope = tl.full(z.shape, 1.0, z.dtype)
    if ACTIVATION == 1:  # relu
        slope = tl.where(z <= 0.0, 0.0, slope)
    elif ACTIVATION == 2:  # relu6
        slope = tl.where((z <= 0.0) | (z >= 6.0), 0.0, slope)
    elif ACTIVATION == 3:  # silu
        sigmoid = 1.0 / (1.0 + tl.exp(-z))
        slope = sigmoid * (1.0 + z * (1.0 - sigmoid))
    elif ACTIVATION == 4:  # gelu, erf form
        slope = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    elif ACTIVATION == 5:  # gelu, tanh form
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        tanh_u = 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0
        slope = 0.5 * (1.0 + tanh_u) + 0.5 * z * (1.0 - tanh_u * tanh_u) * 0.7978845608028654 * (
            1.0 + 3.0 * 0.044715 * z * z)
    elif ACTIVATION == 6:  # hardswish
        slope = tl.where(z < -3.0, 0.0, tl.where(z <= 3.0, z / 3.0 + 0.5, slope))
    elif ACTIVATION == 7:  # hardsigmoid
        slope = tl.where((z > -3.0) & (z < 3.0), 1.0 / 6.0, 0.0)
    return slope


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


@triton.jit
def _plane_pointers(x_ptr, y_ptr, plane, out_channels, MULTIPLIER: tl.constexpr,
                    x_stride_n, x_stride_c, y_stride_n, y_stride_c):
    """Base pointers of the input plane read and the output plane written by `plane`."""
    n = plane // out_channels
    out_c = plane % out_channels
    in_c = out_c // MULTIPLIER
    x_base = x_ptr + n.to(tl.int64) * x_stride_n + in_c.to(tl.int64) * x_stride_c
    y_base = y_ptr + n.to(tl.int64) * y_stride_n + out_c.to(tl.int64) * y_stride_c
    return x_base, y_base, out_c


@triton.jit
def _load_weights(ptrs, c_ok, ACC_DTYPE: tl.constexpr, MASKED: tl.constexpr):
    """One tap's (or the bias') [1, channels] values."""
    if MASKED:
        return tl.load(ptrs, mask=c_ok, other=0.0).to(ACC_DTYPE)
    return tl.load(ptrs).to(ACC_DTYPE)


@triton.jit
def _tap_weights(w_taps, w_stride_tap, c_ok, TAPS: tl.constexpr, ACC_DTYPE: tl.constexpr, MASKED: tl.constexpr):
    """Every tap's [1, channels] weights, as a tuple (MASKED: channels past the end give 0)."""
    weights = ()
    for tap in tl.static_range(TAPS):
        weights = weights + (_load_weights(w_taps + tap * w_stride_tap, c_ok, ACC_DTYPE, MASKED),)
    return weights


@triton.jit
def _window_lane(w0, w1, w2, w3, i: tl.constexpr, VEC: tl.constexpr):
    """Lane i of the window w0|w1|w2|w3 (consecutive VEC-vectors a thread holds)."""
    v = w0
    if i // VEC == 1:
        v = w1
    if i // VEC == 2:
        v = w2
    if i // VEC == 3:
        v = w3
    return _lane(v, i % VEC, VEC)


@triton.jit
def _window_view(w0, w1, w2, w3, start: tl.constexpr, VEC: tl.constexpr):
    """Lanes start .. start+VEC-1 of the window as one [R, G, VEC] vector: a shifted view of
    the input row built in registers."""
    if VEC == 4:
        view = _pack4(_window_lane(w0, w1, w2, w3, start, VEC), _window_lane(w0, w1, w2, w3, start + 1, VEC),
                      _window_lane(w0, w1, w2, w3, start + 2, VEC), _window_lane(w0, w1, w2, w3, start + 3, VEC))
    else:  # 8 lanes: lane 2q + c
        even = _pack4(_window_lane(w0, w1, w2, w3, start, VEC), _window_lane(w0, w1, w2, w3, start + 2, VEC),
                      _window_lane(w0, w1, w2, w3, start + 4, VEC), _window_lane(w0, w1, w2, w3, start + 6, VEC))
        odd = _pack4(_window_lane(w0, w1, w2, w3, start + 1, VEC), _window_lane(w0, w1, w2, w3, start + 3, VEC),
                     _window_lane(w0, w1, w2, w3, start + 5, VEC), _window_lane(w0, w1, w2, w3, start + 7, VEC))
        view = tl.reshape(tl.join(even, odd), [even.shape[0], even.shape[1], 8])
    return view


@triton.jit
def _widen_bf16(v):
    """bfloat16 -> float32 by integer operations, which the compiler turns into one shift or mask of
    each 32-bit register holding two elements (a conversion costs the upper element two, sm_90:
    PRMT + SHF)."""
    return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _load_window_vector(x_row, first_cols, lanes, row_ok, in_w, SHIFT: tl.constexpr, WHOLE: tl.constexpr,
                        VEC: tl.constexpr, MASKED: tl.constexpr, WIDEN_BF16: tl.constexpr):
    """One aligned vector of an input row per thread: elements x_row + first_cols + lanes, which are
    row columns first_cols - SHIFT + lanes (SHIFT > 0: x_row is the row start moved back to a vector
    boundary). WHOLE: the vector is loaded whole when it overlaps the row (a mask uniform over the
    vector keeps the load vectorised when the row length is not a multiple of VEC), and the lanes
    outside the row are zeroed after. MASKED False: the caller knows the vector inside the row.
    WIDEN_BF16 (bfloat16 rows): returned in float32, widened by _widen_bf16."""
    cols = first_cols + lanes
    if not MASKED:
        vector = tl.load(x_row + cols)
    elif WHOLE:
        first = first_cols - SHIFT
        vector = tl.load(x_row + cols, mask=row_ok & (first + VEC > 0) & (first < in_w), other=0.0,)
        vector = tl.where((cols - SHIFT >= 0) & (cols - SHIFT < in_w), vector, 0.0)
    else:
        vector = tl.load(x_row + cols, mask=row_ok & (cols >= 0) & (cols < in_w), other=0.0)
    if WIDEN_BF16:
        vector = _widen_bf16(vector)
    return vector


@triton.jit
def _load_row_window(x_row, group_cols, lanes, row_ok, in_w, WINDOW_OFF: tl.constexpr, WINDOW_VECS: tl.constexpr,
                     VEC: tl.constexpr, SHIFT: tl.constexpr, WHOLE: tl.constexpr,
                     MASKED: tl.constexpr, WIDEN_BF16: tl.constexpr):
    """The WINDOW_VECS aligned vectors (from column group_cols - WINDOW_OFF - SHIFT) holding every
    input column a thread's VEC outputs read from this row; unused ones repeat the first. VEC == 1:
    no window (placeholders; `_row_under_tap` loads each tap itself). MASKED False: the caller
    knows the window inside the row (no bounds tests). WIDEN_BF16: the window comes back in float32
    (_widen_bf16). No defaults: Triton 3.6 hands
    a jit helper's str default over as a plain str and fails to compile."""
    if VEC == 1:  # (a compile-time branch: one return, whose types may differ between VECs)
        w0 = lanes
    else:
        w0 = _load_window_vector(x_row, group_cols - WINDOW_OFF, lanes, row_ok, in_w, SHIFT, WHOLE, VEC,
                                 MASKED, WIDEN_BF16)
    w1 = w0
    w2 = w0
    w3 = w0
    if VEC > 1 and WINDOW_VECS > 1:
        w1 = _load_window_vector(x_row, group_cols - WINDOW_OFF + VEC, lanes, row_ok, in_w, SHIFT, WHOLE, VEC,
                                 MASKED, WIDEN_BF16)
    if VEC > 1 and WINDOW_VECS > 2:
        w2 = _load_window_vector(x_row, group_cols - WINDOW_OFF + 2 * VEC, lanes, row_ok, in_w, SHIFT, WHOLE, VEC,
                                 MASKED, WIDEN_BF16)
    if VEC > 1 and WINDOW_VECS > 3:
        w3 = _load_window_vector(x_row, group_cols - WINDOW_OFF + 3 * VEC, lanes, row_ok, in_w, SHIFT, WHOLE, VEC,
                                 MASKED, WIDEN_BF16)
    return w0, w1, w2, w3


@triton.jit
def _row_under_tap(x_row, w0, w1, w2, w3, out_cols, row_ok, in_w, stride_w, pad_left, x_stride_w,
                   kw: tl.constexpr, DILATION_W: tl.constexpr, WINDOW_LANE0: tl.constexpr, VEC: tl.constexpr):
    """The input value kernel column kw meets at each output column [1, G, VEC] of this row: a
    shifted view of the window (VEC > 1), or its own load (VEC == 1, any stride_w)."""
    if VEC > 1:
        x = _window_view(w0, w1, w2, w3, WINDOW_LANE0 + kw * DILATION_W, VEC)
    else:
        in_cols = out_cols * stride_w - pad_left + kw * DILATION_W
        x = tl.load(x_row + in_cols * x_stride_w, mask=row_ok & (in_cols >= 0) & (in_cols < in_w), other=0.0)
    return x


@triton.jit
def _store_aligned_rows(ptrs, values, first, lanes, rows_ok, out_w, VEC: tl.constexpr):
    """Stores VEC-vectors whose lane 0 is row column `first` (ptrs: from the vector boundary at or
    below each row's start, so every vector is aligned): whole where the vector lies inside the
    row, else as the pairs inside it (rows of even width; the odd-row alignments' row ends)."""
    tl.store(ptrs, values, mask=rows_ok & (first >= 0) & (first + VEC <= out_w))
    pair_first = first + (lanes // 2) * 2
    ends = rows_ok & ((first < 0) | (first + VEC > out_w)) & (pair_first >= 0) & (pair_first + 2 <= out_w)
    tl.store(ptrs, values, mask=ends)


# ---- host side ----------------------------------------------------------------------------------

def acc_dtype(dtype: torch.dtype):
    """The kernels' accumulator type: float64 for float64, float32 for the rest."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the weight gradients' partial sums (the accumulator's)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dividing_unit(limit: int, values) -> int:
    """The largest power of two up to limit that divides every value: how many elements an access
    can take at once and still be aligned (the compiler sees the alignment through it)."""
    unit = limit
    while unit > 1 and any(v % unit for v in values):
        unit //= 2
    return unit


def output_memory_format(x: torch.Tensor) -> torch.memory_format:
    """The output keeps a channels_last input's layout, as PyTorch's convolutions do."""
    if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def stride_unit(t: torch.Tensor, vec: int, width: int) -> int:
    """dividing_unit of the width and the row, channel and batch strides, up to vec (1 unless
    columns are unit-stride): the alignment a row kernel passes on to the compiler."""
    return dividing_unit(vec if t.stride(3) == 1 else 1, (width, *t.stride()[:3]))


def ring_size(geom: ConvGeometry) -> int:
    """Rows of the row kernel's ring: the smallest power of two holding every row a column of taps spans."""
    return next_power_of_2(geom.dilation_h * (geom.kernel_h - 1) + 1)


def window_layout(geom: ConvGeometry, vec: int, max_shift: int = 0, left_shift: int = 0):
    """(window_off, window_lane0, window_vecs) of the rows kernels' VEC-wide windows: a window starts
    at the aligned column group_start - window_off (- a row's shift, up to max_shift) and covers lanes
    window_lane0 (+ shift) .. + (KW-1)*dilation_w + vec - 1 in window_vecs vectors (at most four).
    left_shift: views may also start that many lanes left of window_lane0 (odd output rows)."""
    if vec == 1:
        return 0, 0, 1
    layout = _row_window(geom, vec, max_shift, left_shift)
    assert layout[2] <= 4, "the window holds at most four vectors"
    return layout


def window_fits(geom: ConvGeometry, vec: int, max_shift: int = 0, left_shift: int = 0) -> bool:
    """Whether window_layout's window for these shifts holds at most four vectors (the odd-row
    alignments widen it: wide or dilated kernels go without them)."""
    return vec == 1 or _row_window(geom, vec, max_shift, left_shift)[2] <= 4


def _row_window(geom: ConvGeometry, vec: int, max_shift: int, left_shift: int):
    window_off = cdiv(geom.pad_left + left_shift, vec) * vec
    window_lane0 = window_off - geom.pad_left
    return window_off, window_lane0, cdiv(window_lane0 + max_shift + (geom.kernel_w - 1) * geom.dilation_w + vec, vec)


def odd_rows_alignable(x: torch.Tensor, geom: ConvGeometry) -> bool:
    """Contiguous NCHW rows of 2 mod 4 elements in planes of whole 4-vectors (even height), read by
    the rows kernel with an even ring: odd rows are 2 elements off a vector boundary, statically."""
    return (x.is_contiguous() and geom.in_w % 4 == 2 and geom.in_h % 2 == 0 and ring_size(geom) % 2 == 0
            and geom.stride_w == 1 and alignment(x) == 0)


def odd_out_rows_alignable(out: torch.Tensor, geom: ConvGeometry) -> bool:
    """Contiguous NCHW output rows of 2 mod 4 elements in planes of whole 4-vectors (even height):
    odd rows are 2 elements off a vector boundary (the rows kernel also needs an even ring, so that
    a slot's rows have one parity)."""
    return (out.is_contiguous() and geom.out_w % 4 == 2 and geom.out_h % 2 == 0 and alignment(out) == 0)


def needs_int64(*tensors: torch.Tensor, first_dim: int = 2) -> bool:
    """True when an offset inside one plane (first_dim 2: the NCHW kernels) or one image (first_dim
    1: the channels_last kernels, whose programs span channels) of a tensor can reach 2**31."""
    return any(sum((size - 1) * abs(st) for size, st in zip(t.shape[first_dim:], t.stride()[first_dim:]))
               >= 2**31 - 1 for t in tensors)


def channels_last_kernel_applies(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> bool:
    """Whether the input (and the output, when given) have unit channel strides and are not also
    NCHW-contiguous (one channel, or 1 x 1 images, are both): the NHWC kernel's layout."""
    return (x.dim() == 4 and x.shape[1] > 1 and x.stride(1) == 1 and not x.is_contiguous()
            and (out is None or (out.stride(1) == 1 and out.shape[1] > 1)))


def forward_constants(geom: ConvGeometry, config, x: torch.Tensor, out: torch.Tensor, has_bias: bool,
                      activation: int = 0) -> dict:
    """The constexprs every forward-shaped kernel takes (and num_warps); activation: the code of one
    applied to the outputs (_geometry.ACTIVATION_CODES)."""
    return dict(MULTIPLIER=geom.multiplier, KH=geom.kernel_h, KW=geom.kernel_w, HAS_BIAS=has_bias,
                ACTIVATION=activation,
                INDEX_64=needs_int64(x, out), ACC_DTYPE=acc_dtype(x.dtype), BLOCK_W=config.block_w,
                num_warps=config.num_warps)
