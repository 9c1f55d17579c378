"""Developer probe (CPU or GPU): host time of a forward+backward through dwconv's Python autograd
Function against the C++ one of DWCONV_NATIVE=1 (ops/native.py), on the same tensors. On the CPU
(TRITON_INTERPRET=1) the launches are stubbed (the interpreter would run the kernels); on a GPU they
run. Rounds alternate the two paths; the minimum a path is printed.

    TRITON_INTERPRET=1 python benchmarks/probe_native_host.py          # CPU, 2x144x12x12 3x3
    python benchmarks/probe_native_host.py --shape 64 144 56 56       # GPU
"""

import argparse
import os
import time

import torch

import dwconv
from dwconv.ops import _launch


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start  # (host time: no synchronisation inside the loop)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, default=[2, 144, 12, 12])
    p.add_argument("--kernel", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    for layout in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(args.shape, device=device, dtype=dtype).contiguous(memory_format=layout).requires_grad_()
        w = torch.randn(args.shape[1], 1, args.kernel, args.kernel, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(args.shape, device=device, dtype=dtype).contiguous(memory_format=layout)
        pad = args.kernel // 2

        def forward_backward():
            return torch.autograd.grad(dwconv.depthwise_conv2d(x, w, None, 1, pad), (x, w), g)

        for native in ("1", "0"):  # (records the native programs and warms both paths)
            os.environ["DWCONV_NATIVE"] = native
            forward_backward()
        if device == "cpu":
            stub = lambda *a, **k: None  # noqa: E731
            _launch.launch_now = stub
            for module in ("forward", "backward", "large_fma", "toeplitz"):
                setattr(__import__(f"dwconv.ops.{module}", fromlist=["launch"]), "launch", stub)
        times = {"1": [], "0": []}
        for _ in range(args.rounds):
            for native in ("1", "0"):
                os.environ["DWCONV_NATIVE"] = native
                times[native].append(per_call_us(forward_backward, args.calls))
        name = "NCHW" if layout == torch.contiguous_format else "channels_last"
        print(f"{tuple(args.shape)} k{args.kernel} {args.dtype} {name}: forward+backward host us a call, "
              f"Python Function {min(times['0']):.1f}, C++ (DWCONV_NATIVE=1) {min(times['1']):.1f}")


if __name__ == "__main__":
    main()
