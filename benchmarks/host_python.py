"""Developer tool (no GPU needed): the host's Python time of one eager call of a converted layer
around dwconv's C++ known-call lookup, which is stubbed (it returns a preallocated output), so that
only the Python the call runs is timed: the module call, the autocast casts, the lookup's checks.
The eager gap to stock on whole models is host time; this times the part of it that is dwconv's
Python, one piece at a time, without a GPU.

    python benchmarks/host_python.py [--calls 20000]

Prints microseconds a call (the best of 7 rounds) for each piece.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # (CPU tensors take dwconv's path; nothing is launched here)
os.environ["DWCONV_NATIVE"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

import dwconv  # noqa: E402
from dwconv import functional, replay  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    for _ in range(max(1, calls // 20)):
        fn()
    best = float("inf")
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def pieces(calls: int) -> list:
    x = torch.randn(2, 8, 6, 6).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    out = torch.empty_like(x)
    layer = dwconv.DepthwiseConv2d(8, 8, 3, padding=1, bias=False)
    weight = layer.weight
    half_weight = weight.detach().to(torch.bfloat16)
    # (the lookup answers at once: what is left is the Python around it)
    replay.native._DEFAULT_MODULE[:] = [type("StubbedLookup", (), {"conv_known": staticmethod(lambda *a: out)})()]
    replay.native.has_known_layers = lambda: True
    rows = []
    with torch.no_grad():
        identity = torch.nn.Identity()
        rows.append(("a no-op module's call", per_call_us(lambda: identity(x), calls)))
        rows.append(("depthwise_conv2d, bfloat16 weight", per_call_us(
            lambda: dwconv.depthwise_conv2d(x, half_weight, None, 1, 1, 1), calls)))
        rows.append(("  of which the lookup's checks (_known_layer)", per_call_us(
            lambda: functional._known_layer(x, half_weight, None, 1, 1, 1), calls)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rows.append(("the converted layer's call under bfloat16 autocast", per_call_us(lambda: layer(x), calls)))
            rows.append(("depthwise_conv2d under autocast, float32 weight", per_call_us(
                lambda: dwconv.depthwise_conv2d(x, weight, None, 1, 1, 1), calls)))
            rows.append(("  of which the casts (_autocast)", per_call_us(
                lambda: functional._autocast(x, weight, None), calls)))
            rows.append(("    of which the weight's cast", per_call_us(lambda: weight.to(torch.bfloat16), calls)))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    for name, us in pieces(args.calls):
        print(f"{name:<55} {us:7.2f} us")


if __name__ == "__main__":
    main()
