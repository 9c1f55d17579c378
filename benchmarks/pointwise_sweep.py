"""Developer sweep: the eval 1x1 product's blocks (dwconv::pointwise_folded, kernels/pointwise.py) on
the GPU, beside the form it replaced (the BatchNorm folded beforehand, then cuBLAS's product with
the bias, and ReLU, in its epilogue: `fold_ab.rows_product`; another activation a pass of its own),
on the fused models' 1x1 layers in bfloat16 channels_last at batch 256, the device copy timed in the
same run (bench.Timer: CUDA events, L2 flushed, mean of the calls). Every variant is checked against
float64 first. The op's time includes its host time only where that exceeds the GPU's.

    python benchmarks/pointwise_sweep.py [--iters 30] [--quick] [--out FILE]
"""

import argparse
import itertools
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dwconv import tuning  # noqa: E402
from dwconv._geometry import ACTIVATION_CODES, ACTIVATION_FUNCTIONS  # noqa: E402
from dwconv.bench import Timer, environment, measure_copy  # noqa: E402
from fold_ab import rows_product  # noqa: E402

# (name, in channels, out channels, height = width, activation, BatchNorm): batch 256 of 224 x 224
# images; MobileNetV2's and EfficientNet-B0's expansions without one (the depthwise layer after applies it)
LAYERS = [("v2 expansion 112", 16, 96, 112, "identity", False), ("v2 expansion 56", 24, 144, 56, "identity", False),
          ("v2 projection 56", 144, 24, 56, "identity", True), ("v2 projection 14", 576, 96, 14, "identity", True),
          ("v4 expansion 56", 48, 192, 56, "relu", True), ("v4 projection 56", 128, 48, 56, "identity", True),
          ("v4 expansion 14", 160, 640, 14, "relu", True), ("v4 projection 14", 640, 160, 14, "identity", True),
          ("v4 expansion 7", 256, 1024, 7, "relu", True), ("v4 projection 7", 1024, 256, 7, "identity", True),
          ("b0 projection 28", 240, 40, 28, "identity", True), ("b0 projection 7", 1152, 192, 7, "identity", True),
          ("b0 last 7", 320, 1280, 7, "silu", True)]
BLOCKS_M, BLOCKS_N, BLOCKS_K, STAGES = (64, 128), (64, 128, 256), (32, 64, 128), (1, 2, 3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="the table's blocks and a few neighbours only")
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    timer = Timer(3, args.iters)
    copy_gbps = measure_copy(timer)
    lines = [environment(), f"copy bandwidth {copy_gbps:.0f} GB/s, batch 256, bfloat16 channels_last",
             f"{'layer':<18}{'path':<26}{'ms':>9}{'% copy':>8}{'vs cuBLAS':>10}"]
    print("\n".join(lines), flush=True)
    default = tuning.tuned()
    grid = list(itertools.product(BLOCKS_M, BLOCKS_N, BLOCKS_K, STAGES))
    if args.quick:
        grid = [g for g in grid if sum(a != b for a, b in zip(g, (default.pointwise_block_m, default.pointwise_block_n,
                                                                     default.pointwise_block_k,
                                                                     default.pointwise_stages))) <= 1]
    wins = {}
    for name, in_channels, out_channels, size, activation, with_norm in LAYERS:
        torch.manual_seed(0)
        x = torch.randn(256, in_channels, size, size, device="cuda").to(torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last)
        weight = torch.randn(out_channels, in_channels, 1, 1, device="cuda") / in_channels ** 0.5
        norm = (torch.rand(out_channels, device="cuda") + 0.5, torch.randn(out_channels, device="cuda"),
                torch.randn(out_channels, device="cuda"), torch.rand(out_channels, device="cuda") + 0.5)
        if not with_norm:  # (a product alone: a bias of zeros stands in for cuBLAS's epilogue)
            norm = (torch.ones(out_channels, device="cuda"), torch.zeros(out_channels, device="cuda"),
                    torch.zeros(out_channels, device="cuda"), torch.full((out_channels,), 1 - 1e-5, device="cuda"))
        scale = norm[0] / (norm[3] + 1e-5).sqrt()
        folded_weight = (weight * scale[:, None, None, None]).to(torch.bfloat16)
        folded_bias = (norm[1] - norm[2] * scale).to(torch.bfloat16)
        exact = ACTIVATION_FUNCTIONS[activation](F.batch_norm(
            F.conv2d(x.double(), weight.to(torch.bfloat16).double()), norm[2].double(), norm[3].double(),
            norm[0].double(), norm[1].double(), False, 0.0, 1e-5))
        op_norm = norm if with_norm else (None,) * 4
        floor = (x.numel() + exact.numel()) * 2
        relu = activation == "relu"

        def cublas():
            out = rows_product(x, folded_weight, folded_bias, relu)
            return out if relu or activation == "identity" else ACTIVATION_FUNCTIONS[activation](out)

        def op():
            return torch.ops.dwconv.pointwise_folded(x, weight, None, *op_norm, 1e-5, ACTIVATION_CODES[activation])

        rows = []
        for label, call, changes in [("cuBLAS, folded before", cublas, None)] + [
                (f"op m{m} n{n} k{k} s{s}", op, dict(pointwise_block_m=m, pointwise_block_n=n, pointwise_block_k=k,
                                                     pointwise_stages=s)) for m, n, k, s in grid]:
            try:
                with tuning.override(**(changes or {})):
                    out = call()
                    error = (out.double() - exact).abs().max().item() / exact.abs().max().item()
                    assert error < 0.02, f"{name} {label}: {error:.3g} off float64's"
                    ms = statistics.fmean(timer(call))
            except Exception as e:  # (a block that does not fit: named, the sweep goes on)
                print(f"{name:<18}{label:<26} failed: {str(e).splitlines()[0][:80]}", flush=True)
                continue
            rows.append((label, ms, changes))
        cublas_ms = rows[0][1]
        for label, ms, _ in rows:
            line = f"{name:<18}{label:<26}{ms:9.4f}{100 * floor / ms / 1e6 / copy_gbps:8.1f}{cublas_ms / ms:9.2f}x"
            lines.append(line)
            print(line, flush=True)
        best = min(rows[1:], key=lambda r: r[1]) if len(rows) > 1 else None
        if best:
            wins[name] = (best[0], cublas_ms / best[1])
            for label, ms, changes in rows[1:]:
                if changes == dict(pointwise_block_m=default.pointwise_block_m,
                                   pointwise_block_n=default.pointwise_block_n,
                                   pointwise_block_k=default.pointwise_block_k, pointwise_stages=default.pointwise_stages):
                    wins[name] += (cublas_ms / ms,)
    lines.append("best per layer (vs cuBLAS), then the table's blocks (vs cuBLAS):")
    lines += [f"  {name:<18}{best[0]:<26}{best[1]:6.2f}x" + (f"  table {best[2]:.2f}x" if len(best) > 2 else "")
              for name, best in wins.items()]
    print("\n".join(lines[-len(wins) - 1:]))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
