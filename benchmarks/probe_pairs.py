"""Developer probe (GPU): the column-stride-2 forward ("pairs", session 16) against the tile kernel
it replaced there, on the strided layers of MobileNetV2 / EfficientNet-B0 and issue #3, at the
default blocks and a few others; errors against float64 and PyTorch eager in the same run. GPU times:
CUDA events over 50 back-to-back calls after warm-ups (no L2 flush).

    PYTHONPATH=src python benchmarks/probe_pairs.py [--dtype float32 bfloat16]
"""

import argparse

import torch
import torch.nn.functional as F

from dwconv._geometry import conv_geometry, next_power_of_2
from dwconv.ops.forward import ForwardConfig, band_rows, conv_forward, forward_config
from profile_model import events_ms  # (benchmarks/ is on the path when run as a script)

# (N, C, H, W), kernel, padding: stride 2
LAYERS = [((64, 96, 112, 112), 3, 1), ((64, 144, 56, 56), 3, 1), ((64, 144, 56, 56), 5, 2)]
BLOCKS = [(4, 64, 1), (8, 64, 2), (16, 64, 2), (8, 64, 4), (16, 64, 4), (4, 32, 1), (8, 32, 1)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--layers", type=int, nargs="+", help="indices into LAYERS (default: all)")
    args = p.parse_args()
    for dtype in [getattr(torch, name) for name in args.dtype]:
        for shape, k, pad in [LAYERS[i] for i in args.layers] if args.layers else LAYERS:
            x = torch.randn(shape, device="cuda", dtype=dtype)
            w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype)
            geom = conv_geometry(x, w, None, 2, pad, 1)
            ref = F.conv2d(x.double(), w.double(), None, 2, pad, 1, groups=shape[1])
            scale = ref.abs().max().item()
            bytes_moved = (x.numel() + ref.numel()) * x.element_size()
            tile = ForwardConfig("tile", band_rows(geom, 4, x.device), min(64, next_power_of_2(geom.out_w)),
                                 max(1, min(64, next_power_of_2(geom.out_w)) // 32))
            chosen = forward_config(geom, x)
            default = f"default ({chosen.kernel} {chosen.block_h} x {chosen.block_w}, {chosen.num_warps} warps)"
            configs = {"tile (before)": tile, default: None}
            configs.update({f"pairs {b}": ForwardConfig("pairs", *b) for b in BLOCKS})
            eager = events_ms(lambda: F.conv2d(x, w, None, 2, pad, 1, groups=shape[1]), 50)
            for name, config in configs.items():
                out = conv_forward(x, w, None, geom, config)
                err = (out.double() - ref).abs().max().item() / scale
                ms = events_ms(lambda: conv_forward(x, w, None, geom, config), 50)
                print(f"{str(dtype)[6:]:8s} {str(shape):18s} k{k} s2 {name:58s} {ms:.4f} ms "
                      f"{bytes_moved / ms / 1e6:7.0f} GB/s, eager {eager:.4f} (x{eager / ms:.2f}), err {err:.1e}",
                      flush=True)


if __name__ == "__main__":
    main()
