"""Developer sweep: time the backward kernels' variants on the GPU, beside PyTorch's backward.

    python benchmarks/sweep_backward.py [--quick] [--csv FILE]

grad_input runs with its default launch (for stride 1 it is the forward kernel); grad_weight
(with grad_bias) is timed over GradWeightConfig variants, each checked against PyTorch first.
"""

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from dwconv._geometry import conv_geometry
from dwconv.bench import make_inputs
from dwconv._geometry import input_grad_geometry
from dwconv.dispatch import (ForwardConfig, GradWeightConfig, conv_forward, conv_grad_input, conv_grad_input_and_weight,
                             conv_grad_weight, forward_config, fused_backward_applies, fused_backward_config)
from dwconv.kernels.grad_weight import blocks as grad_weight_config
from sweep_forward import sweep_setup, variants as forward_variants, write_csv


def variants(geom, x):
    import triton

    out = []
    vecs = (1, 4) if geom.stride_w == 1 else (1,)
    for vec in vecs:
        for bw in sorted({min(512, triton.next_power_of_2(geom.out_w)), min(128, triton.next_power_of_2(geom.out_w))}):
            for per_thread in (1, 2):
                warps = bw // (vec * 32 * per_thread)
                if warps < 1 or warps > 8:
                    continue
                for programs in (2048, 8192, 16384):
                    for rows in (1, 2, 4):
                        out.append(GradWeightConfig(bw, warps, vec, max(1, programs // geom.out_channels), rows))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only kb84")
    ap.add_argument("--csv")
    args = ap.parse_args()
    timer, copy_gbps, cases = sweep_setup(args.quick, warmup=2, iters=10)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in cases:
        x, w, _ = make_inputs(case, gen)
        conv = (case.stride, case.padding, case.dilation)
        geom = conv_geometry(x, w, None, *conv)
        grad_out = torch.randn(geom.output_shape, device="cuda", dtype=x.dtype, generator=gen)
        xr, wr = x[:2].double().requires_grad_(), w.double().requires_grad_()
        ref_gx, ref_gw = torch.autograd.grad(F.conv2d(xr, wr, None, *conv, groups=case.c), (xr, wr), grad_out[:2].double())
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = F.conv2d(xg, wg, None, *conv, groups=case.c)
        eager = statistics.fmean(timer(lambda: torch.autograd.grad(y, (xg, wg), grad_out, retain_graph=True)))
        gin = statistics.fmean(timer(lambda: conv_grad_input(grad_out, w, geom, x)))
        gx = conv_grad_input(grad_out[:2], w, conv_geometry(x[:2], w, None, *conv), x[:2])
        gx_err = (gx.double() - ref_gx).abs().max().item() / max(1.0, ref_gx.abs().max().item())
        nbytes = (x.numel() + grad_out.numel()) * x.element_size()
        print(f"{case.label}: eager backward {eager:.4f} ms; grad_input {gin:.4f} ms "
              f"({100 * (nbytes / gin / 1e6) / copy_gbps:.1f}% copy, err {gx_err:.2g})", flush=True)
        if geom.stride_h == geom.stride_w == 1 and geom.multiplier == 1:  # grad_input = the forward kernel
            flipped, gi_geom = w.flip(2, 3).contiguous(), input_grad_geometry(geom)
            dx = torch.empty_like(x)
            timed = []
            for cfg in forward_variants(gi_geom, x.numel() >= 2**30, (1, 4)):
                try:
                    conv_forward(grad_out, flipped, None, gi_geom, cfg, out=dx)
                except Exception as e:
                    print(f"  grad_input {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                timed.append((statistics.fmean(timer(lambda: conv_forward(grad_out, flipped, None, gi_geom, cfg, out=dx))), cfg))
            timed.sort(key=lambda r: r[0])
            for ms, cfg in timed[:4]:
                print(f"    grad_input {ms:.4f} ms {100 * nbytes / ms / 1e6 / copy_gbps:5.1f}% copy  {cfg}")
            print(f"    grad_input default {forward_config(gi_geom, grad_out)}", flush=True)
        geom2 = conv_geometry(x[:2], w, None, *conv)
        results = []
        for cfg in variants(geom, x):
            try:
                gw, _ = conv_grad_weight(grad_out[:2], x[:2], geom2, w.dtype, False, cfg)
            except Exception as e:  # a variant that does not compile is reported, not fatal
                print(f"  {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            err = (gw.double() - ref_gw).abs().max().item() / max(1.0, ref_gw.abs().max().item())
            if not err <= (1e-4 if case.dtype == "float32" else 2e-2):
                print(f"  {cfg}: WRONG rel err {err}", flush=True)
                continue
            ms = statistics.fmean(timer(lambda: conv_grad_weight(grad_out, x, geom, w.dtype, False, cfg)))
            results.append((ms, cfg))
            rows.append(dict(layer=case.label, eager_bwd_ms=eager, grad_input_ms=gin, block_w=cfg.block_w,
                             warps=cfg.num_warps, vec=cfg.vec, splits=cfg.splits, rows=cfg.rows, grad_weight_ms=ms,
                             pct_copy=100 * nbytes / ms / 1e6 / copy_gbps))
        results.sort(key=lambda r: r[0])
        default = grad_weight_config(geom, x)
        for ms, cfg in results[:4]:
            print(f"    grad_weight {ms:.4f} ms {100 * nbytes / ms / 1e6 / copy_gbps:5.1f}% copy  {cfg}")
        d = [r for r in results if r[1] == default]
        print(f"    default {d[0][0]:.4f} ms {default}" if d else f"    default {default} not in sweep", flush=True)
        if fused_backward_applies(geom, x):  # one pass for grad_input and grad_weight
            gi_geom = input_grad_geometry(geom)
            fused_configs = {fused_backward_config(geom, x, grad_out)[0]}
            for bw, warps, vec in ((256, 2, 4), (256, 1, 4), (128, 1, 4), (128, 2, 1), (64, 1, 1)):
                if bw <= 2 * geom.in_w and (vec == 1 or x.shape[3] % 2 == 0):
                    fused_configs.add(ForwardConfig("rows", 128 if geom.in_h >= 128 else 32, bw, warps, vec))
            for cfg in sorted(fused_configs, key=str):
                try:
                    fx, fw = conv_grad_input_and_weight(grad_out[:2], x[:2], w, geom2, cfg)
                    err = max((fx.double() - ref_gx).abs().max().item() / max(1.0, ref_gx.abs().max().item()),
                              (fw.double() - ref_gw).abs().max().item() / max(1.0, ref_gw.abs().max().item()))
                    ms = statistics.fmean(timer(lambda: conv_grad_input_and_weight(grad_out, x, w, geom, cfg)))
                except Exception as e:
                    print(f"    fused {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                print(f"    fused grad_input+grad_weight {ms:.4f} ms (rel err {err:.2g})  {cfg}", flush=True)
        del x, grad_out, y, xg, wg
        torch.cuda.empty_cache()
    write_csv(args.csv, rows)


if __name__ == "__main__":
    sys.exit(main())
