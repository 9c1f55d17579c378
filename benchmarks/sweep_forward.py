"""Developer sweep: time forward kernel variants (ForwardConfig) on the GPU, beside PyTorch.

    python benchmarks/sweep_forward.py [--quick] [--csv FILE]

Each variant is checked against F.conv2d before it is timed. Times are means over 20 calls
with the L2 flushed between calls (dwconv.bench.Timer); the device copy is timed in the same run.
"""

import argparse
import csv
import statistics
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

from dwconv._geometry import conv_geometry
from dwconv.bench import FORWARD_SHAPES, KB84, Timer, make_inputs, measure_copy
from dwconv.dispatch import ForwardConfig, conv_forward, forward_config
from dwconv.tuning import tuned


def variants(geom, full, vecs):
    """Block shapes by elements (tile, rows with vec 1) or vectors (rows with vec > 1) per thread:
    registers decide occupancy (see docs/decisions.md)."""
    import triton

    bw_full = min(512, triton.next_power_of_2(geom.out_w))
    widths = sorted({bw_full, max(16, bw_full // 2), max(16, bw_full // 4)}, reverse=True) if full else [bw_full]
    out = []
    if not (full and geom.stride_h == 1):  # tiles never came near rows on the big stride-1 shape
        for bw in widths:
            for bh in (1, 2, 4, 8, 16, 32):
                for warps in (1, 2, 4, 8, 16):
                    # (a tile program's band of bh rows is unrolled: at most max_band_taps rows x taps)
                    if bh * bw // (32 * warps) in (1, 2) and bh <= 2 * geom.out_h \
                            and bh * geom.kernel_h * geom.kernel_w <= tuned().max_band_taps:
                        out.append(ForwardConfig("tile", bh, bw, warps))
    if geom.stride_h == 1:
        for vec in vecs if geom.stride_w == 1 else (1,):
            for bw in widths:
                for warps in (1, 2, 4, 8, 16):
                    per_thread = bw // (vec * 32 * warps)
                    if per_thread not in (1, 2) and not (per_thread == 0 and warps == 1):  # narrow planes: one warp
                        continue
                    for rows in (64, 128, 256) if full else (32, 128):
                        if rows <= 2 * geom.out_h:
                            out.append(ForwardConfig("rows", rows, bw, warps, vec))
    return out


def sweep_setup(quick, warmup, iters):
    """The timer, the device copy rate measured with it, and the layers to sweep (kb84 only if quick)."""
    timer = Timer(warmup=warmup, iters=iters)
    copy_gbps = measure_copy(timer)
    print(f"copy {copy_gbps:.0f} GB/s", flush=True)
    cases = [replace(KB84, dtype=d) for d in ("float32", "bfloat16")]
    if not quick:
        cases += [replace(c, dtype=d) for c in FORWARD_SHAPES for d in ("float32", "bfloat16")]
    return timer, copy_gbps, cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only kb84")
    ap.add_argument("--csv")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    timer, copy_gbps, cases = sweep_setup(args.quick, warmup=3, iters=args.iters)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in cases:
        x, w, b = make_inputs(case, gen)
        geom = conv_geometry(x, w, b, case.stride, case.padding, case.dilation)
        ref = F.conv2d(x[:2].float(), w.float(), None, case.stride, case.padding, case.dilation, groups=case.c)
        nbytes = x.numel() * x.element_size() * (1 + geom.out_h * geom.out_w / (case.h * case.w))
        eager = statistics.fmean(timer(lambda: F.conv2d(x, w, None, case.stride, case.padding, case.dilation,
                                                        groups=case.c)))
        default = forward_config(geom, x)
        results = []
        vecs = (1, 16 // x.element_size()) if x.element_size() == 4 else (1, 4, 8)
        for cfg in variants(geom, case.n * case.c * case.h * case.w >= 2**30, vecs):
            out = torch.full(geom.output_shape, float("nan"), device="cuda", dtype=x.dtype)
            try:
                conv_forward(x, w, None, geom, cfg, out=out)
            except Exception as e:  # a variant that does not compile is reported, not fatal
                print(f"  {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            err = (out[:2].float() - ref).abs().max().item()
            tol = 1e-4 if case.dtype == "float32" else 5e-2
            if not err <= tol:
                print(f"  {cfg}: WRONG max err {err}", flush=True)
                continue
            ms = statistics.fmean(timer(lambda: conv_forward(x, w, None, geom, cfg, out=out)))
            results.append((ms, cfg))
            rows.append(dict(layer=case.label, kernel=cfg.kernel, block_h=cfg.block_h, block_w=cfg.block_w,
                             warps=cfg.num_warps, vec=cfg.vec, ms=ms, pct_copy=100 * nbytes / ms / 1e6 / copy_gbps,
                             eager_ms=eager, default=cfg == default))
        results.sort(key=lambda r: r[0])
        print(f"{case.label}: eager {eager:.4f} ms; best 5:", flush=True)
        for ms, cfg in results[:5]:
            print(f"    {ms:.4f} ms {100 * nbytes / ms / 1e6 / copy_gbps:5.1f}% copy  x{eager / ms:5.2f} eager  {cfg}")
        d = [r for r in results if r[1] == default]
        if d:
            print(f"    default {d[0][0]:.4f} ms {d[0][1]}")
        del x, out
        torch.cuda.empty_cache()
    write_csv(args.csv, rows)


def write_csv(path, rows):
    if path and rows:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
