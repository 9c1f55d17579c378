"""Developer probe (GPU): Toeplitz forward blocks (rows, strip width, warps) per layer and dtype.

    PYTHONPATH=src python benchmarks/probe_large_blocks.py
"""

import torch

from dwconv._geometry import conv_geometry
from dwconv.ops import toeplitz
from profile_model import events_ms  # (benchmarks/ is on the path when run as a script)

RUNS = [((32, 128, 56, 56), 51, torch.float32, [(64, 16, 4), (64, 32, 4), (64, 64, 4), (32, 16, 4)]),
        ((32, 128, 56, 56), 51, torch.bfloat16, [(128, 16, 4), (128, 32, 4), (128, 64, 4), (64, 64, 4)]),
        ((32, 256, 28, 28), 13, torch.bfloat16, [(128, 16, 4), (64, 16, 4), (32, 16, 4), (64, 32, 4)]),
        ((32, 256, 28, 28), 13, torch.float32, [(128, 16, 4), (64, 16, 4), (64, 32, 4)])]

for shape, k, dtype, configs in RUNS:
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype) / k
    geom = conv_geometry(x, w, None, 1, k // 2, 1)
    out = torch.empty_like(x)
    for block_m, block_w, warps in configs:
        ms = events_ms(lambda: toeplitz.toeplitz_forward(x, w, None, geom, out, block_m, block_w, warps), 10)
        print(f"{str(dtype)[6:]:8s} {shape} k{k} M{block_m} W{block_w} warps{warps}: {ms:.3f} ms", flush=True)
