"""Developer probe (GPU): the backward of channels_last tensors (grad_input + grad_weight, no bias),
as two kernels (conv_grad_weight's choice: since session 9 the unrolled pixels up to 7x7, then
grad_input on the forward's kernel) against the fused pass (depthwise_grad_nhwc_pixels_kernel with
GRAD_INPUT) and cuDNN on channels_last tensors,
on #84 and issue #4's stride-1 layers. Gradients checked against cuDNN's (float32 math) first.
--fused BLOCK_H BLOCK_W BLOCK_C WARPS [RUNS]: more fused blocks (the default's come first; RUNS:
programs a column of tiles, across the images). --shape N C H W K PAD: layers of your own instead of
LAYERS (stride 1, dilation 1). --graphs: each timed as replays of a CUDA graph (the GPU's time: the
small layers' backward is otherwise host-bound). --sums BLOCK_E BLOCK_R WARPS: then the weight
gradient's second pass (ops/weight_sums.py) alone on the default fused pass's partial sums, with
those blocks (session 22: 23 us of a 65 us backward on 64x384x14x14). --maxnreg N: the fused
passes' register cap in every dtype, 0 for none (default: backward.NHWC_FUSED_MAXNREG's, session 24).
--rows BLOCK_W BLOCK_C WARPS PREFETCH [ROWS]: the row-sliding fused pass (depthwise_grad_nhwc_rows_kernel)
at these blocks (BLOCK_C 0: nhwc_rows_grad_config's channels and warps; ROWS: rows a program, default
the config's, which session 28's first two calls took from the 4-wide config), PREFETCH 1 with the
next row's loads issued first; --rows-maxnreg N: their register cap. "fused default" is the
launcher's choice (the rows pass where nhwc_rows_apply). --no-two-kernels: skip the two-kernel
backward (fewer compiles). Bytes counted: grad_out and x read, grad_input written (the floor of
either path).

    PYTHONPATH=src python benchmarks/probe_nhwc_backward.py [--fused BH BW BC WARPS [RUNS]]... [--layers 0 1]
"""

import argparse

import torch
import torch.nn.functional as F

import triton

from dwconv.bench import backward_only, graphed
from dwconv.ops import backward
from dwconv.ops.backward import conv_grad_input, conv_grad_input_and_weight_nhwc, conv_grad_weight
from dwconv.ops.forward import ForwardConfig
from dwconv.ops.weight_sums import depthwise_weight_grad_sums_kernel
from probe_nhwc import channels_last_layers, copy_rate, shape_layers  # (benchmarks/ is on the path as a script)
from profile_model import events_ms as time_ms



def rows_config(spec, geom, x):
    """The row-sliding pass's ForwardConfig for a --rows spec (BLOCK_W BLOCK_C WARPS PREFETCH [ROWS])."""
    block_w, block_c, warps, prefetch, *rows = spec
    default = backward.nhwc_rows_grad_config(geom, x, block_w, bool(prefetch))
    if block_c == 0:
        block_c, warps = default.block_c, default.num_warps
    return ForwardConfig("nhwc_rows", rows[0] if rows else default.block_h, block_w, warps, block_c=block_c,
                         prefetch=bool(prefetch))


def rel_err(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def compare_backward(label, x, w, g, pad, dil, runs, timed=time_ms):
    """Each run (name, fn returning grad_input and grad_weight): its gradients against cuDNN's on
    the same tensors (float32 math), its time beside cuDNN's backward, a line each."""
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = F.conv2d(xr, wr, None, 1, pad, dil, groups=x.shape[1])
    ref_x, ref_w = torch.autograd.grad(out, (xr, wr), g, retain_graph=True)
    # (backward_only makes its forward in the first call: under --graphs on the capture's stream)
    cudnn = timed(backward_only(lambda x_, w_: F.conv2d(x_, w_, None, 1, pad, dil, groups=x.shape[1]), (x, w), g))
    bytes_moved = (2 * x.numel() + g.numel()) * x.element_size()
    for name, fn in runs:
        got_x, got_w = fn()
        ms = timed(fn)
        print(f"{label} {name:22s}: {ms:.3f} ms ({bytes_moved / ms / 1e6:.0f} GB/s), cuDNN backward "
              f"{cudnn:.3f} ms, x{cudnn / ms:.2f}; rel err grad_input {rel_err(got_x, ref_x):.1e} "
              f"(cuDNN's own rounding included), grad_weight {rel_err(got_w, ref_w):.1e}", flush=True)


def time_sums(label, x, w, g, geom, sums_blocks, timed):
    """The second pass alone on the default fused pass's partial sums [slot, channel, tap], with
    each (BLOCK_E, BLOCK_R, WARPS), checked against torch's sum."""
    config, runs = backward.nhwc_pixels_grad_config(geom, x, True)
    plan = backward._nhwc_pixels_grad_plan(geom, g, x, torch.empty_like(x), config, runs, False)
    partial = torch.randn(plan.partial_shape, device="cuda")
    slots, channels, taps = partial.shape
    ref = partial.sum(0)
    grad_w = torch.empty(channels, taps, device="cuda")
    for block_e, block_r, warps in sums_blocks:
        def run():
            depthwise_weight_grad_sums_kernel[(triton.cdiv(channels * taps, block_e),)](
                partial, grad_w, grad_w, channels * taps, 1, slots, 0, partial.stride(0), partial.stride(1),
                TAPS=taps, BIAS_GRAD=False, BLOCK_E=block_e, BLOCK_R=block_r, num_warps=warps)
        grad_w.fill_(float("nan"))
        run()
        err = ((grad_w - ref).abs().max() / ref.abs().max()).item()
        ms = timed(run)
        print(f"{label} sums {slots} parts x {channels * taps} ({partial.numel() * 4 / 1e6:.1f} MB) "
              f"{block_e}x{block_r} w{warps}: {ms * 1e3:.1f} us ({partial.numel() * 4 / ms / 1e6:.0f} GB/s), "
              f"rel err {err:.1e}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fused", nargs="+", type=int, action="append", metavar="N",
                   help="BLOCK_H BLOCK_W BLOCK_C WARPS [RUNS]")
    p.add_argument("--layers", type=int, nargs="+", help="indices into probe_nhwc.LAYERS (default: all)")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--shape", nargs=6, type=int, action="append", metavar="N C H W K PAD".split())
    p.add_argument("--graphs", action="store_true")
    p.add_argument("--maxnreg", type=int, help="the fused passes' register cap in every dtype (0: none; "
                   "default: backward.NHWC_FUSED_MAXNREG's)")
    p.add_argument("--rows", nargs="+", type=int, action="append", metavar="N",
                   help="BLOCK_W BLOCK_C WARPS PREFETCH [ROWS]")
    p.add_argument("--no-two-kernels", action="store_true")
    p.add_argument("--rows-maxnreg", type=int, help="the row-sliding pass's register cap in every dtype")
    p.add_argument("--sums", nargs=3, type=int, action="append", metavar=("BLOCK_E", "BLOCK_R", "WARPS"))
    args = p.parse_args()
    if args.maxnreg is not None:
        backward.NHWC_FUSED_MAXNREG = {2: args.maxnreg, 4: args.maxnreg} if args.maxnreg else {}
    if args.rows_maxnreg:
        backward.NHWC_ROWS_MAXNREG = {2: args.rows_maxnreg, 4: args.rows_maxnreg}
    timed = (lambda fn: time_ms(graphed(fn), 50)) if args.graphs else time_ms
    print(f"copy {copy_rate():.0f} GB/s", flush=True)
    layers = shape_layers(args.dtype, args.shape) if args.shape else channels_last_layers(args.dtype, args.layers)
    for dtype_name, shape, k, pad, dil, x, w, geom in layers:
        g = torch.randn(geom.output_shape, device="cuda", dtype=x.dtype).contiguous(memory_format=torch.channels_last)

        def two_kernels():
            return conv_grad_input(g, w, geom, x), conv_grad_weight(g, x, geom, w.dtype, False)[0]

        runs = [] if args.no_two_kernels else [("two kernels", two_kernels)]
        for blocks in [None] + (args.fused or []):
            config = blocks and ForwardConfig("nhwc_pixels", blocks[0], blocks[1], blocks[3], block_c=blocks[2])
            run_count = blocks[4] if blocks and len(blocks) > 4 else None
            name = "fused " + ("default" if blocks is None else "x".join(map(str, blocks)))
            runs.append((name, lambda c=config, r=run_count: conv_grad_input_and_weight_nhwc(g, x, w, geom, c, r)))
        for spec in args.rows or []:
            config = rows_config(spec, geom, x)
            name = f"rows {config.block_w}x{config.block_c}x{config.num_warps} r{config.block_h}" + \
                (" pf" if config.prefetch else "") + (f" cap{args.rows_maxnreg}" if args.rows_maxnreg else "")
            runs.append((name, lambda c=config: conv_grad_input_and_weight_nhwc(g, x, w, geom, c)))
        label = f"{dtype_name:8s} {str(shape):20s} k{k} p{pad} d{dil} CL"
        compare_backward(label, x, w, g, pad, dil, runs, timed)
        if args.sums:
            time_sums(label, x, w, g, geom, args.sums, timed)


if __name__ == "__main__":
    main()
