"""Developer probe (GPU, under Nsight Compute): runs one kernel of issue #6's layers twice (the
first compiles), so that ncu can read the second's counters. what: forward / grad_weight (the
Toeplitz kernels, half precision's path from k13 on) or fma_forward / fma_grad_weight (large_fma,
float32's path); blocks: the Toeplitz kernels' block_m, block_w, num_warps.

    ncu --clock-control none --kernel-name regex:toeplitz --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python benchmarks/ncu_large.py k31 bfloat16 forward
    ncu --clock-control none --kernel-name regex:large_fma --launch-skip 1 --launch-count 1 ... \
        python benchmarks/ncu_large.py k31 float32 fma_forward
"""

import sys

import torch

from dwconv._geometry import conv_geometry
from dwconv.ops.large_fma import large_fma_forward, large_fma_grad_weight
from dwconv.ops.toeplitz import toeplitz_forward, toeplitz_grad_weight

LAYERS = {"k31": ((32, 128, 56, 56), 31, 15), "k13": ((32, 256, 28, 28), 13, 6), "k51": ((32, 128, 56, 56), 51, 25)}


def main(layer, dtype_name, what, *blocks):
    shape, k, pad = LAYERS[layer]
    dtype = getattr(torch, dtype_name)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype) / k
    geom = conv_geometry(x, w, None, 1, pad, 1)
    kwargs = dict(zip(("block_m", "block_w", "num_warps"), map(int, blocks)))
    for _ in range(2):
        if what == "forward":
            toeplitz_forward(x, w, None, geom, torch.empty_like(x), **kwargs)
        elif what == "grad_weight":
            toeplitz_grad_weight(torch.randn_like(x), x, geom, dtype, False, **kwargs)
        elif what == "fma_forward":
            large_fma_forward(x, w, None, geom, torch.empty_like(x))
        elif what == "fma_grad_weight":
            large_fma_grad_weight(torch.randn_like(x), x, geom, dtype, False)
        else:
            raise ValueError(f"what: forward, grad_weight, fma_forward or fma_grad_weight, not {what!r}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(*sys.argv[1:])
