"""Developer probe (GPU): Toeplitz blocks (rows, strip width, warps, stages) per layer and dtype, and
the session-11 switches (float32 split in the kernel or by Triton; the weight gradient's product
transposed or not), each against the other in the same process.

    PYTHONPATH=src python benchmarks/probe_large_blocks.py [--runs I ...]

Each configuration compiles its own kernels (~10-20 s each, 30 of them): warm the Triton cache
first with one process a layer, e.g. `for i in 0 1 2 3 4 5; do python3 probe_large_blocks.py --runs
$i >/dev/null & done; wait` (or `bash benchmarks/gpu_check.sh blocks`), then time them alone.
"""

import argparse

import torch

from dwconv._geometry import conv_geometry
from dwconv.ops import toeplitz
from profile_model import events_ms  # (benchmarks/ is on the path when run as a script)

# forward: (block_m, block_w, warps, num_stages); the first of each list is the launcher's choice
# since session 11 (k31: 32-column strips, 16-byte loads; before: bfloat16 128 x 64, float32 64 x 32
# in 8-byte loads)
RUNS = [((32, 128, 56, 56), 31, torch.bfloat16, [(128, 32, 4, 1), (256, 32, 8, 1), (256, 32, 4, 1), (128, 64, 4, 1),
                                                 (128, 32, 4, 3), (128, 16, 4, 1)]),
        ((32, 128, 56, 56), 31, torch.float32, [(64, 32, 4, 1), (128, 32, 4, 1), (128, 32, 8, 1), (64, 16, 4, 1)]),
        ((32, 128, 56, 56), 51, torch.bfloat16, [(128, 64, 4, 1), (256, 64, 8, 1), (128, 32, 4, 1)]),
        ((32, 128, 56, 56), 51, torch.float32, [(64, 64, 4, 1), (64, 32, 4, 1)]),
        ((32, 256, 28, 28), 13, torch.bfloat16, [(128, 16, 4, 1), (256, 16, 8, 1), (64, 16, 4, 1)]),
        ((32, 256, 28, 28), 13, torch.float32, [(64, 16, 4, 1), (128, 16, 4, 1)])]
# grad_weight on k31: (block_m, block_w, rows_per_split, warps, num_stages)
GRAD_WEIGHT = [(64, 32, 896, 4, 1), (64, 64, 1024, 4, 1), (128, 32, 1024, 4, 1), (64, 32, 512, 4, 1),
               (64, 16, 1024, 4, 1)]


def switched(name, value, fn):
    """fn() with toeplitz.<name> = value (launch plans rebuilt: they hold the constexprs)."""
    before = getattr(toeplitz, name)
    setattr(toeplitz, name, value)
    toeplitz._PLANS.clear()
    try:
        return fn()
    finally:
        setattr(toeplitz, name, before)
        toeplitz._PLANS.clear()


parser = argparse.ArgumentParser()
parser.add_argument("--runs", type=int, nargs="+", help="indices into RUNS (default: all)")
selected = parser.parse_args().runs
for shape, k, dtype, configs in [RUNS[i] for i in selected] if selected else RUNS:
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype) / k
    geom = conv_geometry(x, w, None, 1, k // 2, 1)
    out = torch.empty_like(x)
    for i, (block_m, block_w, warps, stages) in enumerate(configs):
        def forward():
            return events_ms(lambda: toeplitz.toeplitz_forward(x, w, None, geom, out, block_m, block_w, warps, stages),
                             10)
        line = (f"fwd {str(dtype)[6:]:8s} {shape} k{k} M{block_m} W{block_w} warps{warps} stages{stages}: "
                f"{forward():.3f} ms")
        if i == 0 and dtype == torch.float32:
            line += f"; Triton's tf32x3 split {switched('SPLIT_TF32', False, forward):.3f} ms"
        print(line, flush=True)
    if k == 13:  # 16-column strips (32-column windows: mma.sync) against 32 (64: warpgroup MMA, transposed)
        g = torch.randn_like(x)
        for block_w in (16, 32):
            ms = events_ms(lambda: toeplitz.toeplitz_grad_weight(g, x, geom, dtype, False, block_w=block_w), 5)
            print(f"gw  {str(dtype)[6:]:8s} {shape} k{k} W{block_w}: {ms:.3f} ms", flush=True)
    if k == 51 and dtype == torch.bfloat16:  # rows a program: 448 (512 programs) since session 11, 1024 before
        g = torch.randn_like(x)
        for rows in (448, 1024, 224):
            ms = events_ms(lambda: toeplitz.toeplitz_grad_weight(g, x, geom, dtype, False, rows_per_split=rows), 5)
            print(f"gw  {str(dtype)[6:]:8s} {shape} k{k} rows{rows}: {ms:.3f} ms", flush=True)
    if k == 31:
        g = torch.randn_like(x)
        for i, (block_m, block_w, rows, warps, stages) in enumerate(GRAD_WEIGHT):
            def grad_weight():
                return events_ms(lambda: toeplitz.toeplitz_grad_weight(g, x, geom, dtype, False, block_m, block_w, rows,
                                                                       warps, stages), 5)
            line = (f"gw  {str(dtype)[6:]:8s} {shape} k{k} M{block_m} W{block_w} rows{rows} warps{warps} "
                    f"stages{stages}: {grad_weight():.3f} ms")
            if i == 0:
                line += f"; not transposed {switched('TRANSPOSED_GRAD_WEIGHT', False, grad_weight):.3f} ms"
            print(line, flush=True)
