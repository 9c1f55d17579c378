"""Developer probe (GPU, session 15): the strided layers' backward kernels alone, grad_input and the
weight gradient, as CUDA-graph replays (the GPU's time), with bytes against a copy timed the same
way. Issue #3's stride-2 layer (64x96x112x112 3x3) spent 0.77 ms in its backward, 21% of the
copy rate. Run it under two trees to compare (gpu_check.sh ab with AB_PROBE).

--shared-taps N / --values N: the phase kernel's switches (session 24: grad_out tiles shared by the
phases, values a thread). --gw-pixels BH BW BC WARPS [RUNS] (channels_last) and --gw-rows BLOCK_W
WARPS VEC SPLITS [ROWS] (NCHW): more weight-gradient blocks to time beside the default, each checked
(session 24: the 5x5 stride-2 weight gradients ran at 10-27% of copy); --gw-maxnreg N: the
channels_last weight gradient's register cap.

    PYTHONPATH=src python benchmarks/probe_strided_backward.py [--dtype float32 bfloat16] [--layers 0 1]
"""

import argparse

import torch
import torch.nn.functional as F

from dwconv._geometry import conv_geometry
from dwconv.bench import graphed
from dwconv.ops import backward
from dwconv.ops.backward import GradWeightConfig, _launch_nhwc_pixels_grad, conv_grad_input, conv_grad_weight
from dwconv.ops.forward import ForwardConfig
from profile_model import events_ms  # (benchmarks/ is on the path when run as a script)

# (N, C, H, W, kernel, padding, stride): issue #3's stride-2 layer, then the models suite's
LAYERS = [(64, 96, 112, 112, 3, 1, 2), (64, 144, 56, 56, 3, 1, 2), (64, 144, 56, 56, 5, 2, 2),
          (64, 240, 28, 28, 3, 1, 2), (64, 672, 14, 14, 5, 2, 2), (32, 128, 64, 64, 3, 1, 3)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--layers", type=int, nargs="+", help="indices into LAYERS")
    p.add_argument("--channels-last", action="store_true", help="also channels_last tensors")
    p.add_argument("--shared-taps", type=int, help="backward.SHARED_LOAD_TAPS (0: a phase at a time, as before "
                   "session 24)")
    p.add_argument("--values", type=int, help="backward.PHASE_VALUES_A_THREAD (the phase kernel's warps)")
    p.add_argument("--gw-pixels", nargs="+", type=int, action="append", default=[], metavar="N",
                   help="channels_last weight-gradient tiles: BLOCK_H BLOCK_W BLOCK_C WARPS [RUNS]")
    p.add_argument("--gw-rows", nargs="+", type=int, action="append", default=[], metavar="N",
                   help="NCHW weight-gradient blocks: BLOCK_W WARPS VEC SPLITS [ROWS]")
    p.add_argument("--gw-maxnreg", type=int, help="register cap of the channels_last weight gradient, every dtype "
                   "(backward.NHWC_WEIGHT_GRAD_MAXNREG)")
    args = p.parse_args()
    if args.shared_taps is not None:
        backward.SHARED_LOAD_TAPS = args.shared_taps
    if args.values:
        backward.PHASE_VALUES_A_THREAD = args.values
    if args.gw_maxnreg:
        backward.NHWC_WEIGHT_GRAD_MAXNREG = {2: args.gw_maxnreg, 4: args.gw_maxnreg}
    src = torch.empty(2**28, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / events_ms(graphed(lambda: dst.copy_(src)), 20) / 1e6
    print(f"copy {copy_gbs:.0f} GB/s", flush=True)
    layouts = [torch.contiguous_format] + ([torch.channels_last] if args.channels_last else [])
    for i in args.layers if args.layers is not None else range(len(LAYERS)):
        n, c, h, w, k, pad, stride = LAYERS[i]
        for dtype in (getattr(torch, d) for d in args.dtype):
            for layout in layouts:
                x = torch.randn(n, c, h, w, device="cuda", dtype=dtype).contiguous(memory_format=layout)
                weight = torch.randn(c, 1, k, k, device="cuda", dtype=dtype) / k
                geom = conv_geometry(x, weight, None, stride, pad, 1)
                g = torch.randn(geom.output_shape, device="cuda", dtype=dtype).contiguous(memory_format=layout)
                xr, wr = x.double().requires_grad_(), weight.double().requires_grad_()
                F.conv2d(xr, wr, None, stride, pad, 1, c).backward(g.double())
                gi, gw = conv_grad_input(g, weight, geom, x), conv_grad_weight(g, x, geom, dtype, False)[0]
                errs = [((a.double() - r).abs().max() / r.abs().max()).item() for a, r in ((gi, xr.grad), (gw, wr.grad))]
                gi_ms = events_ms(graphed(lambda: conv_grad_input(g, weight, geom, x)), 20)
                gw_ms = events_ms(graphed(lambda: conv_grad_weight(g, x, geom, dtype, False)), 20)
                gi_pct = 100 * (g.numel() + 2 * x.numel()) * x.element_size() / gi_ms / 1e6 / copy_gbs
                gw_pct = 100 * (g.numel() + x.numel()) * x.element_size() / gw_ms / 1e6 / copy_gbs
                name = "channels_last" if layout is torch.channels_last else "nchw"
                print(f"{str(dtype)[6:]:8s} {name:13s} {(n, c, h, w)} k{k} s{stride}: grad_input {gi_ms:.3f} ms "
                      f"({gi_pct:.0f}% copy), grad_weight {gw_ms:.3f} ms ({gw_pct:.0f}%); errors {errs[0]:.1e} / "
                      f"{errs[1]:.1e}", flush=True)
                for blocks in args.gw_pixels if layout is torch.channels_last else args.gw_rows:
                    time_weight_grad(g, x, geom, dtype, blocks, layout is torch.channels_last, wr.grad, copy_gbs)


def time_weight_grad(g, x, geom, dtype, blocks, channels_last, reference, copy_gbs):
    """The weight gradient alone at the given blocks (see --gw-pixels / --gw-rows), checked."""
    if channels_last:
        config = ForwardConfig("nhwc_pixels", blocks[0], blocks[1], blocks[3], block_c=blocks[2])
        runs = blocks[4] if len(blocks) > 4 else None

        def run():
            return _launch_nhwc_pixels_grad(geom, g, x, None, None, config, runs, False, dtype)[0]
    else:
        config = GradWeightConfig(*blocks)

        def run():
            return conv_grad_weight(g, x, geom, dtype, False, config)[0]
    err = ((run().double().view_as(reference) - reference).abs().max() / reference.abs().max()).item()
    ms = events_ms(graphed(run), 20)
    pct = 100 * (g.numel() + x.numel()) * x.element_size() / ms / 1e6 / copy_gbs
    print(f"    grad_weight at {'x'.join(map(str, blocks))}: {ms:.3f} ms ({pct:.0f}%); error {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
