"""Developer probe (GPU): the Toeplitz forward's tiles of several output rows (toeplitz_out_rows),
against one row a tile, on issue #6's half-precision layers. Forward (dwconv, CUDA-graph replays)
and forward+backward (grad_input of stride 1 is the same kernel, flipped; the weight gradient is
unchanged), errors of dwconv and of PyTorch against float64, PyTorch eager in the same run.

    PYTHONPATH=src python benchmarks/probe_toeplitz_rows.py [--dtype bfloat16 float16] [--layers 0 1 2]
        [--variant ROWS M WARPS ...] [--gw-variant KH_ROWS M WARPS ...] [--rounds 2]

device_triton_cache.py --toeplitz ROWS M WARPS compiles the same kernels on a machine without a GPU.
"""

import argparse

import torch
import torch.nn.functional as F

import dwconv
from dwconv.bench import forward_backward, graphed
from dwconv.ops import toeplitz
from profile_model import events_ms  # (benchmarks/ is on the path when run as a script)

LAYERS = [((32, 128, 56, 56), 31, 15), ((32, 256, 28, 28), 13, 6), ((32, 128, 56, 56), 51, 25)]
VARIANTS = [(1, 128, 4), (2, 128, 8), (4, 128, 8), (4, 64, 4), (8, 64, 8)]


def use_variant(out_rows, block_m, warps):
    """The forward's tiles for every later call (the module's defaults replaced; plans rebuilt)."""
    toeplitz.toeplitz_out_rows = lambda geom, x: out_rows
    toeplitz.toeplitz_block_m = lambda x: block_m
    toeplitz.toeplitz_num_warps = lambda rows, m: warps
    toeplitz._PLANS.clear()


def time_grad_weight(name, x, g, ref_gw, pad, variants):
    """The weight gradient alone (toeplitz_grad_weight), each (kernel rows a pass, rows a block, warps)."""
    from dwconv._geometry import conv_geometry

    k = ref_gw.shape[-1]
    geom = conv_geometry(x, torch.empty(x.shape[1], 1, k, k, device=x.device, dtype=x.dtype), None, 1, pad, 1)
    for kh_rows, block_m, warps in variants:
        def run():
            return toeplitz.toeplitz_grad_weight(g, x, geom, x.dtype, False, block_m=block_m, num_warps=warps,
                                                 kh_rows=kh_rows)
        err = rel_err(run()[0], ref_gw)
        ms = events_ms(graphed(run), 20)
        print(f"{name} grad_weight kh_rows {kh_rows} M {block_m} warps {warps}: {ms:.3f} ms "
              f"({flops(x.shape, k) / ms / 1e9:.0f} TFLOP/s); err {err:.1e}", flush=True)


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def flops(shape, k):
    return 2 * shape[0] * shape[1] * shape[2] * shape[3] * k * k


def probe_layer(shape, k, pad, dtype, variants, gw_variants, rounds):
    c = shape[1]
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(c, 1, k, k, device="cuda", dtype=dtype) / k
    g = torch.randn(shape, device="cuda", dtype=dtype)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    ref = F.conv2d(xd, wd, None, 1, pad, 1, groups=c)
    ref_gx, ref_gw = torch.autograd.grad(ref, (xd, wd), g.double())

    def torch_conv(*args):
        return F.conv2d(*args, None, 1, pad, 1, groups=c)

    def ours(*args):
        return dwconv.depthwise_conv2d(*args, None, 1, pad)

    name = f"{str(dtype)[6:]} {tuple(shape)} k{k}"
    out = torch_conv(x, w)
    gx, gw = torch.autograd.grad(torch_conv(x.requires_grad_(), w.requires_grad_()), (x, w), g)
    x, w = x.detach(), w.detach()
    print(f"{name}: torch err fwd {rel_err(out, ref):.1e} gx {rel_err(gx, ref_gx):.1e} gw {rel_err(gw, ref_gw):.1e}",
          flush=True)
    eager_fwd = events_ms(graphed(lambda: torch_conv(x, w)), 20)
    eager_fb = events_ms(graphed(forward_backward(torch_conv, (x, w), g)), 5)
    print(f"{name}: eager forward {eager_fwd:.3f} ms, forward+backward {eager_fb:.3f} ms", flush=True)
    for round_ in range(rounds):
        time_grad_weight(name, x, g, ref_gw, pad, gw_variants)
        for variant in variants:
            use_variant(*variant)
            out = ours(x, w)
            errs = rel_err(out, ref)
            gx, gw = torch.autograd.grad(ours(x.requires_grad_(), w.requires_grad_()), (x, w), g)
            x, w = x.detach(), w.detach()
            fwd = events_ms(graphed(lambda: ours(x, w)), 50)
            fb = events_ms(graphed(forward_backward(ours, (x, w), g)), 20)
            print(f"{name} round {round_} rows {variant[0]} M {variant[1]} warps {variant[2]}: forward {fwd:.3f} ms "
                  f"({flops(shape, k) / fwd / 1e9:.0f} TFLOP/s, x{eager_fwd / fwd:.2f} eager), forward+backward "
                  f"{fb:.3f} ms (x{eager_fb / fb:.2f}); err fwd {errs:.1e} gx {rel_err(gx, ref_gx):.1e} "
                  f"gw {rel_err(gw, ref_gw):.1e}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"])
    p.add_argument("--layers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variant", type=int, nargs=3, action="append", metavar=("ROWS", "M", "WARPS"))
    p.add_argument("--gw-variant", type=int, nargs=3, action="append", metavar=("KH_ROWS", "M", "WARPS"),
                   help="the weight gradient alone at these kernel rows a pass, rows a block, warps")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for dtype in args.dtype:
        for index in args.layers:
            probe_layer(*LAYERS[index], getattr(torch, dtype), [tuple(v) for v in args.variant or VARIANTS],
                        [tuple(v) for v in args.gw_variant or ()], args.rounds)


if __name__ == "__main__":
    main()
