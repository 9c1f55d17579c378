"""Developer tool: a convolution followed by a BatchNorm2d in eval mode and its activation, each way
dwconv's fused model could compute it, timed in one run beside a device copy (bench.Timer's CUDA
events after warm-up, L2 flushed), so that one short device call decides the eval-mode folding's
choices (docs/decisions.md, "In eval mode the other BatchNorms fold"):

    stock        the modules: cuDNN's convolution, BatchNorm's pass, the activation's
    fold+conv    the BatchNorm folded into the convolution's weight and bias: cuDNN's convolution,
                 which adds the bias in a pass of its own, then the activation
    fold+product a 1x1 convolution of a channels_last input as the matrix product with the bias in
                 cuBLAS's epilogue (_library._rows_product, as dwconv::pointwise_folded runs it), then
                 the activation
    fold+product+relu   the same with ReLU in the epilogue too (torch._addmm_activation)
    converted    the block as convert(fuse=True) runs it (its folding at each call included)

Every path under bfloat16 autocast on a channels_last input, as the models bench runs; each output
checked against float64's (stock's modules in float64). Prints milliseconds, GB/s of the floor
(the input read and the output written once) and its share of the copy's bandwidth, and each path
against stock.

    python benchmarks/fold_ab.py [--iters 50] [--out FILE]
    python benchmarks/fold_ab.py --smoke      # no GPU: tiny layers on the CPU, the checks alone

Layers (batch 256, 224 x 224 images): MobileNetV2's stem (3x3 stride 2, 3 -> 32, ReLU6), its widest
expansion (24 -> 144 at 56 x 56, ReLU6), a projection (144 -> 24 at 56 x 56, none), its last 1x1
(320 -> 1280 at 7 x 7, ReLU6), and a ReLU expansion as MobileNetV4's (80 -> 480 at 28 x 28).
"""

import argparse
import copy
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import dwconv  # noqa: E402
from dwconv.activations import FUNCTIONS, activation_of  # noqa: E402
from dwconv.bench import checked_and_timed  # noqa: E402
from dwconv._library import _rows_product  # noqa: E402
from dwconv.fuse import _pointwise_rows, fold_batch_norm  # noqa: E402

# (name, batch, in channels, height, width, out channels, kernel, stride, activation module)
LAYERS = [("stem", 256, 3, 224, 224, 32, 3, 2, nn.ReLU6), ("expansion", 256, 24, 56, 56, 144, 1, 1, nn.ReLU6),
          ("projection", 256, 144, 56, 56, 24, 1, 1, nn.Identity), ("last", 256, 320, 7, 7, 1280, 1, 1, nn.ReLU6),
          ("relu expansion", 256, 80, 28, 28, 480, 1, 1, nn.ReLU)]


def block(in_channels: int, out_channels: int, kernel: int, stride: int, activation: type, device: str) -> nn.Module:
    """conv, BatchNorm2d (random statistics and affine), activation, in eval mode."""
    stock = nn.Sequential(nn.Conv2d(in_channels, out_channels, kernel, stride, kernel // 2, bias=False),
                          nn.BatchNorm2d(out_channels), activation()).to(device)
    with torch.no_grad():
        stock[1].running_mean.normal_(), stock[1].running_var.uniform_(0.5, 2)
        stock[1].weight.normal_(), stock[1].bias.normal_()
    return stock.eval()


def paths(stock: nn.Module, x: torch.Tensor) -> dict:
    """name -> a no-argument call of the block on x, as the module docstring lists them."""
    device = x.device.type
    conv, norm, act = stock
    name = activation_of(act)
    activate = FUNCTIONS[name]
    with torch.no_grad():
        weight, bias = (t.to(torch.bfloat16) for t in fold_batch_norm(conv.weight, conv.bias, norm))
    converted = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)

    def under_autocast(fn):
        def call():
            with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
                return fn()
        return call

    calls = {"stock": lambda: stock(x), "converted": lambda: converted(x),
             "fold+conv": lambda: activate(conv._conv_forward(x, weight, bias))}
    if _pointwise_rows(conv, x):
        calls["fold+product"] = lambda: activate(_rows_product(x, weight, bias, relu=False))
        if name == "relu":
            calls["fold+product+relu"] = lambda: _rows_product(x, weight, bias, relu=True)
    return {label: under_autocast(fn) for label, fn in calls.items()}


def run(layers, timer) -> tuple:
    rows = []
    copy_gbps = None
    if timer is not None:
        from dwconv.bench import measure_copy

        copy_gbps = measure_copy(timer)
    device = "cuda" if timer is not None else "cpu"
    for name, batch, in_channels, height, width, out_channels, kernel, stride, activation in layers:
        torch.manual_seed(0)
        stock = block(in_channels, out_channels, kernel, stride, activation, device)
        x = torch.randn(batch, in_channels, height, width, device=device).to(torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            exact = copy.deepcopy(stock).double()(x.double())
        for label, call in paths(stock, x).items():
            out, ms, error = checked_and_timed(call, exact, timer, f"{name} {label}")
            floor = x.numel() * x.element_size() + out.numel() * out.element_size()
            rows.append(dict(layer=name, path=label, ms=ms, gbps=floor / ms / 1e6, error=error,
                             pct_copy=100 * floor / ms / 1e6 / copy_gbps if copy_gbps else float("nan")))
    for row in rows:
        stock_ms = next(r["ms"] for r in rows if r["layer"] == row["layer"] and r["path"] == "stock")
        row["vs_stock"] = stock_ms / row["ms"]
    return rows, copy_gbps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="no GPU: tiny layers on the CPU, the checks alone")
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    if args.smoke:
        layers = [(name, 2, c_in, max(h // 16, 5), max(w // 16, 5), c_out, k, s, act)
                  for name, _, c_in, h, w, c_out, k, s, act in LAYERS]
        rows, copy_gbps = run(layers, None)
    else:
        from dwconv.bench import Timer, environment

        rows, copy_gbps = run(LAYERS, Timer(5, args.iters))
    lines = [environment() if not args.smoke else "CPU smoke run (times are not measurements)",
             f"copy bandwidth {copy_gbps:.0f} GB/s" if copy_gbps else "",
             f"{'layer':<16}{'path':<20}{'ms':>9}{'GB/s':>9}{'% copy':>8}{'vs stock':>10}{'error':>10}"]
    lines += [f"{r['layer']:<16}{r['path']:<20}{r['ms']:9.4f}{r['gbps']:9.0f}{r['pct_copy']:8.1f}"
              f"{r['vs_stock']:9.2f}x{r['error']:10.2e}" for r in rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
