"""Developer tool: what a fused depthwise layer pays for applying the activation before it to its input
as it loads it (docs/decisions.md, "The expansion's activation applied by the depthwise layer after
it"), layer by layer, timed in one run beside a device copy (bench.Timer's CUDA events after warm-up,
L2 flushed):

    cuDNN            F.conv2d with groups=C, bias, no activation: stock's convolution alone
    dwconv           dwconv's forward with the output's activation (the input as it is)
    dwconv in-act    the same applying the input's activation as it loads (what a fused model runs)
    in-act exact     the same with SiLU as exp and a division (bfloat16's tanh.approx form replaced here)
    act pass+dwconv  PyTorch's activation of the input, then dwconv's forward (the alternative)

and, with --blocks, the input-activated forward under other tile shapes of its family ("nhwc_pixels"),
to show how the activation's recomputation on each tile's halo weighs. bfloat16 channels_last at batch
256 (EfficientNet-B0's depthwise layers, SiLU); each output checked against float64's, its error
printed as a share of the largest output.

    python benchmarks/input_activation_ab.py [--iters 50] [--activation silu] [--blocks] [--out FILE]
    python benchmarks/input_activation_ab.py --smoke     # no GPU: tiny layers on the CPU, the checks alone
    PYTHONPATH=.triton36:src python benchmarks/input_activation_ab.py --blocks --compile-only DIR
        # no GPU: the kernels compiled for sm_90 into a Triton cache for the device (device_triton_cache.py)
"""

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from dwconv.activations import FUNCTIONS  # noqa: E402

# (channels, size, kernel, stride, layers of EfficientNet-B0 with this shape)
LAYERS = [(32, 112, 3, 1, 1), (96, 112, 3, 2, 1), (144, 56, 3, 1, 1), (144, 56, 5, 2, 1), (240, 28, 5, 1, 1),
          (240, 28, 3, 2, 1), (480, 14, 3, 1, 2), (480, 14, 5, 1, 1), (672, 14, 5, 1, 2), (672, 14, 5, 2, 1),
          (1152, 7, 5, 1, 3), (1152, 7, 3, 1, 1)]
# (channels, size, kernel, stride) -> other (block_h, block_w) of "nhwc_pixels" to time with --blocks
BLOCKS = {(32, 112, 3, 1): [(4, 8)], (96, 112, 3, 2): [(2, 8), (1, 8)], (144, 56, 3, 1): [(4, 8)],
          (144, 56, 5, 2): [(4, 7), (2, 4)], (240, 28, 5, 1): [(4, 7), (7, 7)], (240, 28, 3, 2): [(1, 7), (4, 7)],
          (480, 14, 3, 1): [(4, 7), (7, 7)], (480, 14, 5, 1): [(4, 7), (7, 7)], (672, 14, 5, 1): [(7, 7)],
          (672, 14, 5, 2): [(1, 7), (4, 7)], (1152, 7, 5, 1): [(7, 7)], (1152, 7, 3, 1): [(7, 7)]}


@contextlib.contextmanager
def exact_silu(exact: bool):
    """The tile kernels' input SiLU as _activate computes it (exp and a division), not FAST_SILU, inside
    the block where exact (the cached launch plans and recorded layers dropped on entry and exit:
    tuning.override)."""
    from dwconv import tuning
    from dwconv.kernels import tile

    chosen = tile.input_activation_code
    if exact:
        tile.input_activation_code = lambda code, x: code
    try:
        with tuning.override():
            yield
    finally:
        tile.input_activation_code = chosen


def run(batch: int, layers, activation: str, blocks: bool, timer, compile_only: bool = False) -> tuple:
    from dwconv import functional
    from dwconv._geometry import conv_geometry, forward_activation_code
    from dwconv.bench import checked_and_timed
    from dwconv.dispatch import conv_forward, forward_config
    from dwconv.kernels._launch import ForwardConfig

    device = "cuda" if timer is not None else "cpu"
    copy_gbps = None
    if timer is not None:
        from dwconv.bench import measure_copy

        copy_gbps = measure_copy(timer)
    act = FUNCTIONS[activation]
    rows = []
    for channels, size, kernel, stride, count in layers:
        torch.manual_seed(0)
        make = torch.empty if compile_only else torch.randn  # (compiles only: nothing computed)
        x = make(batch, channels, size, size, device=device).to(torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last)
        weight = (make(channels, 1, kernel, kernel, device=device) / kernel).to(torch.bfloat16)
        bias = make(channels, device=device).to(torch.bfloat16)
        pad = kernel // 2
        if not compile_only:
            exact = act(F.conv2d(act(x.double()), weight.double(), bias.double(), stride, pad, groups=channels))
        geom = conv_geometry(x, weight, bias, stride, pad, 1)
        code = forward_activation_code((activation, activation))
        default = forward_config(geom, x)

        calls = {
            "cuDNN": (lambda: F.conv2d(x, weight, bias, stride, pad, groups=channels), False),
            "dwconv": (lambda: functional._forward(x, weight, bias, stride, pad, 1, activation), False),
            "dwconv in-act": (lambda: functional._forward(x, weight, bias, stride, pad, 1, (activation, activation)),
                              True),
            "in-act exact": (lambda: functional._forward(x, weight, bias, stride, pad, 1, (activation, activation)),
                             True),
            "act pass+dwconv": (lambda: functional._forward(act(x), weight, bias, stride, pad, 1, activation), True),
        }
        if blocks:
            for block_h, block_w in BLOCKS.get((channels, size, kernel, stride), []):
                config = ForwardConfig(default.kernel, block_h, block_w, default.num_warps, block_c=default.block_c)
                calls[f"in-act {block_h}x{block_w}"] = (
                    lambda config=config: conv_forward(x, weight, bias, geom, config, activation=code), True)
        layer = f"{batch}x{channels}x{size}x{size} k{kernel} s{stride}"
        for label, (call, checked) in calls.items():
            if compile_only:
                if label not in ("cuDNN", "act pass+dwconv"):  # (the same kernel as "dwconv")
                    started = time.perf_counter()
                    with exact_silu(label == "in-act exact"):
                        call()
                    print(f"{layer} {label}: {time.perf_counter() - started:.0f} s", flush=True)
                continue
            with torch.no_grad(), exact_silu(label == "in-act exact"):
                out, ms, error = checked_and_timed(call, exact if checked else None, timer, f"{layer} {label}")
            floor = x.numel() * x.element_size() + out.numel() * out.element_size()
            tiles = f"{default.block_h}x{default.block_w}" if label in ("dwconv", "dwconv in-act", "in-act exact") else ""
            rows.append(dict(layer=layer, count=count, path=label, tiles=tiles, ms=ms, error=error,
                             pct_copy=100 * floor / ms / 1e6 / copy_gbps if copy_gbps else float("nan")))
    return rows, copy_gbps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--activation", default="silu")
    p.add_argument("--blocks", action="store_true", help="also other tile shapes of the input-activated forward")
    p.add_argument("--smoke", action="store_true", help="no GPU: tiny layers on the CPU, the checks alone")
    p.add_argument("--out", help="also write the table to this file")
    p.add_argument("--compile-only", metavar="DIR", help="no GPU: compile the kernels for sm_90 into this Triton cache")
    args = p.parse_args(argv)
    if args.compile_only:
        return compile_kernels(args)
    if args.smoke:
        # (at most 32 channels: the interpreter's time is by programs, and each path's checks are the same)
        rows, copy_gbps = run(2, [(min(c, 32), max(s // 8, 7), k, st, n) for c, s, k, st, n in LAYERS[:4]],
                              args.activation, False, None)
        header = "CPU smoke run (times are not measurements)"
    else:
        from dwconv.bench import Timer, environment

        rows, copy_gbps = run(256, LAYERS, args.activation, args.blocks, Timer(5, args.iters))
        header = f"{environment()}; copy {copy_gbps:.0f} GB/s in the run; input and output activation {args.activation}"
    lines = [header, f"{'layer':<28}{'path':<18}{'tiles':>6}{'ms':>9}{'% copy':>8}{'error':>10}"]
    lines += [f"{r['layer']:<28}{r['path']:<18}{r['tiles']:>6}{r['ms']:9.4f}{r['pct_copy']:8.1f}{r['error']:10.2e}"
              for r in rows]
    totals = {}
    for r in rows:
        if r["path"] in ("cuDNN", "dwconv", "dwconv in-act", "in-act exact", "act pass+dwconv"):
            totals[r["path"]] = totals.get(r["path"], 0.0) + r["ms"] * r["count"]
    lines.append("EfficientNet-B0's 16 depthwise layers, summed: "
                 + ", ".join(f"{path} {ms:.3f} ms" for path, ms in totals.items()))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def compile_kernels(args) -> int:
    """The GPU run's kernels, compiled for sm_90 on this machine into args.compile_only (the device's
    cache key: device_triton_cache.py), launching nothing."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = os.path.abspath(args.compile_only)
    sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"),
                    os.path.dirname(os.path.abspath(__file__))]
    import compile_check  # noqa: F401  (compile-only sm_90 driver, GPU plans; before dwconv's kernels)
    import device_triton_cache

    device_triton_cache.use_device_key(device_triton_cache.DEVICE_LIBTRITON_SHA256)
    from dwconv import functional

    functional.uses_triton = lambda x: True  # CPU tensors take the Triton path (kernels compile only)
    run(256, LAYERS, args.activation, args.blocks, None, compile_only=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
