"""Developer probe (GPU): the NCHW forward with each output one FMA chain ("nchw_pixels", session 8)
against the default (the rows kernel on #84) and cuDNN, on #84 and the stride-1 NCHW layers.
Values checked against cuDNN first. --blocks BLOCK_H BLOCK_W WARPS: "nchw_pixels" blocks to try;
--rows: also the kernel nchw_config picks (rows or tile; float32 3x3 defaults to "nchw_pixels");
--graphs: CUDA-graph replays (the GPU's time); --odd-out-half: forward.ODD_OUT_ALIGN_HALF on.

    PYTHONPATH=src python benchmarks/probe_nchw_pixels.py --blocks 16 128 1 --blocks 8 256 2 [--layers 0] [--dtype ...]
"""

import argparse

import torch

from dwconv._geometry import conv_geometry
from dwconv.ops import forward
from dwconv.ops.forward import ForwardConfig, nchw_config
from probe_nhwc import copy_rate, time_configs  # (benchmarks/ is on the path when run as a script)

LAYERS = [((64, 128, 256, 512), 3, 0, 1), ((64, 144, 56, 56), 3, 1, 1), ((32, 256, 64, 64), 3, 2, 2),
          ((64, 240, 28, 28), 5, 2, 1), ((64, 96, 56, 56), 7, 3, 1)]


def nchw_layers(dtype_names, layer_indices=None):
    """(dtype name, shape, kernel, padding, dilation, x, w, geometry) for each dtype and layer, x
    NCHW on the GPU, fresh random values."""
    for dtype_name in dtype_names:
        for shape, k, pad, dil in [LAYERS[i] for i in layer_indices] if layer_indices else LAYERS:
            x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype_name))
            w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=x.dtype)
            yield dtype_name, shape, k, pad, dil, x, w, conv_geometry(x, w, None, 1, pad, dil)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", nargs=3, type=int, action="append", default=[], metavar=("BH", "BW", "WARPS"))
    p.add_argument("--rows", action="store_true", help="also nchw_config's kernel (rows or tile)")
    p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (no host time)")
    p.add_argument("--odd-out-half", action="store_true", help="set forward.ODD_OUT_ALIGN_HALF")
    p.add_argument("--layers", type=int, nargs="+", help="indices into LAYERS (default: all)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = p.parse_args()
    forward.ODD_OUT_ALIGN_HALF = forward.ODD_OUT_ALIGN_HALF or args.odd_out_half
    print(f"copy {copy_rate():.0f} GB/s", flush=True)
    for dtype_name, shape, k, pad, dil, x, w, geom in nchw_layers(args.dtype, args.layers):
        configs = [None] + [ForwardConfig("nchw_pixels", bh, bw, warps) for bh, bw, warps in args.blocks]
        configs += [nchw_config(geom, x)] if args.rows else []
        time_configs(f"{dtype_name:8s} {str(shape):20s} k{k} p{pad} d{dil}", x, w, geom, configs, "eager", args.graphs)

if __name__ == "__main__":
    main()
