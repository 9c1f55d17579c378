"""Developer probe (GPU, under Nsight Compute): #84's forward through dwconv twice (the first
compiles) and twice a kernel that reads the input and writes a tensor of its size (x * 1: a copy
as a kernel; torch's clone is a cudaMemcpy, which ncu does not profile), so that ncu can set the
forward's memory counters beside a copy's.

    ncu --clock-control none --kernel-name regex:"nchw_pixels|rows_kernel|vectorized_elementwise" --launch-skip 1 \
        --launch-count 3 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python benchmarks/ncu_84.py float32
"""

import sys

import torch

from dwconv._geometry import conv_geometry
from dwconv.ops.forward import conv_forward


def main(dtype_name="float32"):
    dtype = getattr(torch, dtype_name)
    x = torch.randn(64, 128, 256, 512, device="cuda", dtype=dtype)
    w = torch.randn(128, 1, 3, 3, device="cuda", dtype=dtype)
    geom = conv_geometry(x, w, None, 1, 0, 1)
    for _ in range(2):
        conv_forward(x, w, None, geom)
    for _ in range(2):  # as many bytes as the forward moves, near enough (512 against 510 columns)
        torch.mul(x, 1.0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(*sys.argv[1:])
