"""Developer probe (CPU or GPU): host time of a forward+backward through dwconv's Python autograd
Function, the C++ one of DWCONV_NATIVE=1 (ops/native.py) and PyTorch's F.conv2d, on the same
tensors. On the CPU (TRITON_INTERPRET=1) dwconv's launches are stubbed (the interpreter would run
the kernels) and PyTorch's path is left out; on a GPU they run. Calls go in chunks of 10 with a
synchronisation between chunks, so the GPU's launch queue never fills and blocks the host (session
21: 300 calls in a row measured some paths' GPU time instead). Rounds alternate the paths; the
minimum and the median of the rounds are printed. --profile: then the C++ path's host time by
aten op (torch.profiler) and by Python function (cProfile).

    TRITON_INTERPRET=1 python benchmarks/probe_native_host.py          # CPU, 2x144x12x12 3x3
    python benchmarks/probe_native_host.py --shape 64 144 56 56       # GPU
"""

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import dwconv
from dwconv.ops import _launch, native


def per_call_us(fn, calls, chunk=10):
    for _ in range(20):
        fn()
    elapsed = 0.0
    for _ in range(0, calls, chunk):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(chunk):
            fn()
        elapsed += time.perf_counter() - start  # (host time: no synchronisation inside a chunk)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def profile(fn, calls=200):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
    stats = cProfile.Profile()
    stats.enable()
    for _ in range(calls):
        fn()
    stats.disable()
    pstats.Stats(stats).sort_stats("tottime").print_stats(18)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, default=[2, 144, 12, 12])
    p.add_argument("--kernel", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layouts", nargs="+", default=["nchw", "channels_last"])
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        native.prepare()
    dtype = getattr(torch, args.dtype)
    for name in args.layouts:
        layout = torch.channels_last if name == "channels_last" else torch.contiguous_format
        x = torch.randn(args.shape, device=device, dtype=dtype).contiguous(memory_format=layout).requires_grad_()
        w = torch.randn(args.shape[1], 1, args.kernel, args.kernel, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(args.shape, device=device, dtype=dtype).contiguous(memory_format=layout)
        pad = args.kernel // 2

        def forward_backward():
            return torch.autograd.grad(dwconv.depthwise_conv2d(x, w, None, 1, pad), (x, w), g)

        def torch_forward_backward():
            return torch.autograd.grad(F.conv2d(x, w, None, 1, pad, 1, args.shape[1]), (x, w), g)

        paths = {"1": forward_backward, "0": forward_backward}
        if device == "cuda":
            paths["torch"] = torch_forward_backward
        for setting in ("1", "0"):  # (records the native programs and warms both paths)
            os.environ["DWCONV_NATIVE"] = setting
            forward_backward()
        if device == "cpu":
            stub = lambda *a, **k: None  # noqa: E731
            _launch.launch_now = stub
            for module in ("forward", "backward", "large_fma", "toeplitz"):
                setattr(__import__(f"dwconv.ops.{module}", fromlist=["launch"]), "launch", stub)
        times = {path: [] for path in paths}
        for _ in range(args.rounds):
            for path, fn in paths.items():
                os.environ["DWCONV_NATIVE"] = "1" if path == "torch" else path
                times[path].append(per_call_us(fn, args.calls))
        shown = {"0": "Python Function", "1": "C++ (DWCONV_NATIVE=1)", "torch": "F.conv2d"}
        print(f"{tuple(args.shape)} k{args.kernel} {args.dtype} {name}: forward+backward host us a call (min / median "
              f"of {args.rounds} rounds): " + ", ".join(f"{shown[path]} {min(t):.1f} / {statistics.median(t):.1f}"
                                                         for path, t in times.items()), flush=True)
        if args.profile:
            os.environ["DWCONV_NATIVE"] = "1"
            profile(forward_backward)


if __name__ == "__main__":
    main()
