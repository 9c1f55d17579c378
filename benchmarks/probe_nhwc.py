"""Developer probe (GPU): the channels_last (NHWC) forward kernel against cuDNN with channels_last
tensors, on #84 and issue #4's layers; values checked against cuDNN first. --config: the band tile
kernel ("nhwc") with those blocks; --pixels: the same kernel with its columns unrolled
("nhwc_pixels", session 7), which also runs with `nhwc_pixels_config`'s blocks on every layer.

    PYTHONPATH=src python benchmarks/probe_nhwc.py [--config|--pixels BLOCK_H BLOCK_W BLOCK_C WARPS]...
"""

import argparse

import torch
import torch.nn.functional as F

from dwconv._geometry import conv_geometry
from dwconv.ops.forward import (MAX_PIXEL_TAPS, ForwardConfig, band_rows, conv_forward, forward_config,
                                nhwc_pixels_config)
from profile_model import events_ms as time_ms  # (benchmarks/ is on the path when run as a script)

LAYERS = [((64, 128, 256, 512), 3, 0, 1), ((64, 96, 56, 56), 7, 3, 1), ((64, 144, 56, 56), 3, 1, 1),
          ((32, 256, 64, 64), 3, 2, 2), ((64, 240, 28, 28), 5, 2, 1), ((64, 384, 14, 14), 7, 3, 1)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", nargs=4, type=int, action="append", metavar=("BH", "BW", "BC", "WARPS"))
    p.add_argument("--pixels", nargs=4, type=int, action="append", metavar=("BH", "BW", "BC", "WARPS"))
    p.add_argument("--layers", type=int, nargs="+", help="indices into LAYERS (default: all)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = p.parse_args()
    src = torch.empty(2**28, device="cuda")
    copy_ms = time_ms(lambda: src.clone())
    print(f"copy {2 * src.numel() * 4 / copy_ms / 1e6:.0f} GB/s", flush=True)
    del src
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for shape, k, pad, dil in [LAYERS[i] for i in args.layers] if args.layers else LAYERS:
            x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
            w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype)
            geom = conv_geometry(x, w, None, 1, pad, dil)
            ref = F.conv2d(x, w, None, 1, pad, dil, groups=shape[1])
            bytes_moved = (x.numel() + ref.numel()) * x.element_size()
            cudnn = time_ms(lambda: F.conv2d(x, w, None, 1, pad, dil, groups=shape[1]))
            configs = [None] + [ForwardConfig("nhwc", band_rows(geom, bh, x.device), bw, warps, block_c=bc)
                                for bh, bw, bc, warps in args.config or []]
            configs += [nhwc_pixels_config(geom)] + [ForwardConfig("nhwc_pixels", min(bh, max(1, MAX_PIXEL_TAPS // (bw * k * k))), bw, warps,
                                      block_c=min(bc, shape[1] & -shape[1]))
                        for bh, bw, bc, warps in args.pixels or []]
            for config in configs:
                out = conv_forward(x, w, None, geom, config)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                ms = time_ms(lambda: conv_forward(x, w, None, geom, config))
                shown = config or forward_config(geom, x)
                print(f"{dtype_name:8s} {str(shape):20s} k{k} p{pad} d{dil} {shown.kernel} {shown.block_h}x{shown.block_w}x"
                      f"{shown.block_c} w{shown.num_warps}: dwconv {ms:.3f} ms ({bytes_moved / ms / 1e6:.0f} GB/s), "
                      f"cuDNN CL {cudnn:.3f} ms, x{cudnn / ms:.2f}, rel err {err:.1e}", flush=True)
            del x, ref, out


if __name__ == "__main__":
    main()
