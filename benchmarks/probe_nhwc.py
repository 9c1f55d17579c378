"""Developer probe (GPU): the channels_last (NHWC) forward kernel against cuDNN with channels_last
tensors, on #84 and issue #4's layers; values checked against cuDNN first. --config: the band tile
kernel ("nhwc") with those blocks; --pixels: the same kernel with its columns unrolled
("nhwc_pixels", session 7; the default for kernels up to 7x7 since session 8). --shape N C H W K PAD
STRIDE: layers of your own instead (e.g. the models suite's stride-2 rows, which float32 loses to
cuDNN channels_last by 4-10%, session 23).

    PYTHONPATH=src python benchmarks/probe_nhwc.py [--config|--pixels BLOCK_H BLOCK_W BLOCK_C WARPS]...

--pixels with BLOCK_C or WARPS 0: the default config's.
--maxnreg N...: each block under each register cap of the forward (0: none; session 27).
"""

import argparse

import torch
import torch.nn.functional as F

from dwconv._geometry import conv_geometry
from dwconv.bench import graphed
from dwconv.ops import forward
from dwconv.ops.forward import MAX_PIXEL_TAPS, ForwardConfig, band_rows, conv_forward, forward_config
from profile_model import events_ms as time_ms  # (benchmarks/ is on the path when run as a script)

LAYERS = [((64, 128, 256, 512), 3, 0, 1), ((64, 96, 56, 56), 7, 3, 1), ((64, 144, 56, 56), 3, 1, 1),
          ((32, 256, 64, 64), 3, 2, 2), ((64, 240, 28, 28), 5, 2, 1), ((64, 384, 14, 14), 7, 3, 1)]


def copy_rate():
    """GB/s of a device copy (read + write), timed as the kernels are."""
    src = torch.empty(2**28, device="cuda")
    return 2 * src.numel() * 4 / time_ms(lambda: src.clone()) / 1e6


def channels_last_layers(dtype_names, layer_indices=None):
    """(dtype name, shape, kernel, padding, dilation, x, w, geometry) for each dtype and layer,
    x channels_last on the GPU, fresh random values."""
    for dtype_name in dtype_names:
        dtype = getattr(torch, dtype_name)
        for shape, k, pad, dil in [LAYERS[i] for i in layer_indices] if layer_indices else LAYERS:
            x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
            w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype)
            yield dtype_name, shape, k, pad, dil, x, w, conv_geometry(x, w, None, 1, pad, dil)


def shape_layers(dtype_names, shapes):
    """channels_last_layers' tuples (dilation 1) for --shape N C H W K PAD [STRIDE] (stride 1 if not given)."""
    for dtype_name in dtype_names:
        for n, c, h, w_, k, pad, *stride in shapes:
            x = torch.randn(n, c, h, w_, device="cuda", dtype=getattr(torch, dtype_name)
                            ).contiguous(memory_format=torch.channels_last)
            w = torch.randn(c, 1, k, k, device="cuda", dtype=x.dtype)
            geom = conv_geometry(x, w, None, stride[0] if stride else 1, pad, 1)
            yield dtype_name, (n, c, h, w_), k, pad, 1, x, w, geom


def time_configs(label, x, w, geom, configs, baseline_name, graphs=False):
    """Times conv_forward with each config (None: forward_config's choice) against PyTorch on the same
    tensors (symmetric padding), after checking its values against PyTorch's; prints a line each.
    graphs: each timed as replays of a CUDA graph (the GPU's time, no host time per call)."""
    timed = (lambda fn: time_ms(graphed(fn))) if graphs else time_ms
    pad, dil = (geom.pad_top, geom.pad_left), (geom.dilation_h, geom.dilation_w)
    stride = (geom.stride_h, geom.stride_w)
    ref = F.conv2d(x, w, None, stride, pad, dil, groups=x.shape[1])
    bytes_moved = (x.numel() + ref.numel()) * x.element_size()
    baseline = timed(lambda: F.conv2d(x, w, None, stride, pad, dil, groups=x.shape[1]))
    for config in configs:
        out = conv_forward(x, w, None, geom, config)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        ms = timed(lambda: conv_forward(x, w, None, geom, config))
        shown = config or forward_config(geom, x)
        print(f"{label} {shown.kernel} {shown.block_h}x{shown.block_w}x{shown.block_c} w{shown.num_warps}: dwconv "
              f"{ms:.3f} ms ({bytes_moved / ms / 1e6:.0f} GB/s), {baseline_name} {baseline:.3f} ms, "
              f"x{baseline / ms:.2f}, rel err {err:.1e}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", nargs=4, type=int, action="append", metavar=("BH", "BW", "BC", "WARPS"))
    p.add_argument("--pixels", nargs=4, type=int, action="append", metavar=("BH", "BW", "BC", "WARPS"))
    p.add_argument("--layers", type=int, nargs="+", help="indices into LAYERS (default: all)")
    p.add_argument("--shape", nargs=7, type=int, action="append", metavar="N C H W K PAD STRIDE".split(),
                   help="layers of your own instead of LAYERS")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (GPU time alone)")
    p.add_argument("--masked-channels", action="store_true",
                   help="--pixels channel blocks as given, the last one masked (else at most the largest "
                        "power of two dividing the channels)")
    p.add_argument("--maxnreg", type=int, nargs="+", metavar="N",
                   help="time the blocks under each register cap (forward.NHWC_PIXELS_MAXNREG; 0: none)")
    args = p.parse_args()
    print(f"copy {copy_rate():.0f} GB/s", flush=True)
    layers = shape_layers(args.dtype, args.shape) if args.shape else channels_last_layers(args.dtype, args.layers)
    for dtype_name, shape, k, pad, dil, x, w, geom in layers:
        # the default (forward_config: "nhwc_pixels" up to 7x7 since session 8), then the blocks asked for
        configs = [None] + [ForwardConfig("nhwc", band_rows(geom, bh, x.device), bw, warps, block_c=bc)
                            for bh, bw, bc, warps in args.config or []]
        default = forward_config(geom, x)
        configs += [ForwardConfig("nhwc_pixels", min(bh, max(1, MAX_PIXEL_TAPS // (bw * k * k))), bw,
                                  warps or default.num_warps,
                                  block_c=(bc if args.masked_channels else min(bc, shape[1] & -shape[1]))
                                  or default.block_c)
                    for bh, bw, bc, warps in args.pixels or []]
        label = f"{dtype_name:8s} {str(shape):20s} k{k} p{pad} d{dil} s{geom.stride_h}"
        for cap in args.maxnreg or [None]:
            if cap is not None:  # (plans hold their constants: dropped for the new cap)
                forward.NHWC_PIXELS_MAXNREG = {2: cap, 4: cap} if cap else {}
                forward._FORWARD_PLANS.clear()
            time_configs(label + ("" if cap is None else f" cap {cap:3d}"), x, w, geom, configs, "cuDNN CL",
                         args.graphs)


if __name__ == "__main__":
    main()
