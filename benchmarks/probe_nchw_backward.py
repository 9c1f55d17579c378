"""Developer probe (GPU): the NCHW fused backward (grad_input + grad_weight from one read of grad_out
and x) on the rows kernel (the default) against the "nchw_pixels" kernel with WEIGHT_GRAD (session
11, unmeasured: ~half the rows kernel's sm_90 instructions an output), and cuDNN, on #84 and the
stride-1 NCHW layers. Gradients checked against cuDNN's first.
--pixels BLOCK_H BLOCK_W WARPS [RUNS]: the "nchw_pixels" blocks to try (RUNS: runs a column of
tiles; default forward.nchw_pixels_runs). Bytes counted: grad_out and x read, grad_input written.

    PYTHONPATH=src python benchmarks/probe_nchw_backward.py --pixels 4 128 1 --pixels 8 128 1 [--layers 0]
"""

import argparse

import torch

from dwconv.ops.backward import conv_grad_input_and_weight
from dwconv.ops.forward import ForwardConfig
from probe_nchw_pixels import nchw_layers  # (benchmarks/ is on the path when run as a script)
from probe_nhwc import copy_rate
from probe_nhwc_backward import compare_backward


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pixels", nargs="+", type=int, action="append", metavar="N", required=True,
                   help="BLOCK_H BLOCK_W WARPS [RUNS]")
    p.add_argument("--layers", type=int, nargs="+", help="indices into probe_nchw_pixels.LAYERS (default: all)")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    args = p.parse_args()
    print(f"copy {copy_rate():.0f} GB/s", flush=True)
    for dtype_name, shape, k, pad, dil, x, w, geom in nchw_layers(args.dtype, args.layers):
        g = torch.randn(geom.output_shape, device="cuda", dtype=x.dtype)
        runs = []
        for blocks in [None] + args.pixels:
            config = blocks and ForwardConfig("nchw_pixels", blocks[0], blocks[1], blocks[2])
            run_count = blocks[3] if blocks and len(blocks) > 3 else None
            name = "rows (default)" if blocks is None else "pixels " + "x".join(map(str, blocks))
            runs.append((name, lambda c=config, r=run_count: conv_grad_input_and_weight(g, x, w, geom, c, r)))
        compare_backward(f"{dtype_name:8s} {str(shape):20s} k{k} p{pad} d{dil}", x, w, g, pad, dil, runs)


if __name__ == "__main__":
    main()
