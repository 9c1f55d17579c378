"""Developer probe (GPU): Toeplitz forward blocks (rows, strip width, warps) per layer and dtype.

    PYTHONPATH=src python benchmarks/probe_large_blocks.py
"""

import torch

from dwconv._geometry import conv_geometry
from dwconv.ops import toeplitz
from profile_model import events_ms  # (benchmarks/ is on the path when run as a script)

# (block_m, block_w, warps, num_stages)
RUNS = [((32, 128, 56, 56), 31, torch.bfloat16, [(128, 64, 4, 1), (64, 64, 4, 1), (128, 64, 8, 1), (128, 16, 4, 1)]),
        ((32, 128, 56, 56), 31, torch.float32, [(128, 16, 4, 1), (64, 16, 4, 1), (128, 32, 4, 1), (64, 32, 4, 1),
                                                (64, 64, 4, 1)]),
        ((32, 128, 56, 56), 51, torch.float32, [(64, 32, 4, 1), (64, 64, 4, 1), (32, 64, 4, 1)]),
        ((32, 128, 56, 56), 51, torch.bfloat16, [(128, 64, 4, 1), (64, 64, 4, 1), (128, 64, 4, 3)]),
        ((32, 256, 28, 28), 13, torch.bfloat16, [(128, 16, 4, 1), (64, 16, 4, 1)]),
        ((32, 256, 28, 28), 13, torch.float32, [(128, 16, 4, 1), (64, 16, 4, 1)])]
# grad_weight on k31: (block_m, block_w, rows_per_split, warps, num_stages)
GRAD_WEIGHT = [(64, 16, 1024, 4, 1), (64, 32, 1024, 4, 1), (64, 64, 1024, 4, 1), (64, 16, 256, 4, 1)]

for shape, k, dtype, configs in RUNS:
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype) / k
    geom = conv_geometry(x, w, None, 1, k // 2, 1)
    out = torch.empty_like(x)
    for block_m, block_w, warps, stages in configs:
        ms = events_ms(lambda: toeplitz.toeplitz_forward(x, w, None, geom, out, block_m, block_w, warps, stages), 10)
        print(f"fwd {str(dtype)[6:]:8s} {shape} k{k} M{block_m} W{block_w} warps{warps} stages{stages}: {ms:.3f} ms",
              flush=True)
    if k == 31:
        g = torch.randn_like(x)
        for block_m, block_w, rows, warps, stages in GRAD_WEIGHT:
            ms = events_ms(lambda: toeplitz.toeplitz_grad_weight(g, x, geom, dtype, False, block_m, block_w, rows,
                                                                 warps, stages), 5)
            print(f"gw  {str(dtype)[6:]:8s} {shape} k{k} M{block_m} W{block_w} rows{rows} warps{warps} "
                  f"stages{stages}: {ms:.3f} ms", flush=True)
