"""Developer probe (GPU): where dwconv's forward+backward loses ~250 us of host time when the
backward runs on the autograd engine's CUDA device thread (session 10: 450-750 us a call, against
210-570 us with the backward on the calling thread and ~35 us more for a Function that launches
nothing). For each layer and each mode (device thread / calling thread), microseconds a call of:
  before   torch.autograd.grad called -> the backward formula entered (the hand-off to the thread)
  inside   the backward formula (saved tensors, plans, allocations, launches)
  after    the backward formula left -> torch.autograd.grad returned (the hand-back)
  total    the whole forward+backward, host time (no synchronisation inside the loop)
If `inside` is the same in both modes, the cost is the engine's hand-offs, not dwconv's code.

--profile: also cProfile the backward formula where it runs (on the device thread: a profiler
enabled on the calling thread does not see it), for the first layer in NCHW, top functions.

    PYTHONPATH=src python benchmarks/probe_device_thread.py [--profile]
"""

import cProfile
import pstats
import sys
import time

import torch

import dwconv
import dwconv._library as library

LAYERS = [((64, 144, 56, 56), 3, 1), ((32, 256, 28, 28), 13, 6), ((64, 384, 14, 14), 7, 3), ((64, 960, 7, 7), 3, 1)]
_formula = library._backward_formula
STAMPS = []  # (entered, left) of each backward formula call
PROFILER = []  # a cProfile.Profile while one is wanted


def timed_formula(*args, **kwargs):
    entered = time.perf_counter()
    if PROFILER:
        PROFILER[0].enable()
    grads = _formula(*args, **kwargs)
    if PROFILER:
        PROFILER[0].disable()
    STAMPS.append((entered, time.perf_counter()))
    return grads


def measure(x, w, g, pad, one_thread, calls=200):
    def call():
        out = dwconv.depthwise_conv2d(x, w, None, 1, pad)
        start = time.perf_counter()
        if one_thread:
            with torch.autograd.set_multithreading_enabled(False):
                torch.autograd.grad(out, (x, w), g)
        else:
            torch.autograd.grad(out, (x, w), g)
        return start, time.perf_counter()

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    STAMPS.clear()
    spans = []
    begin = time.perf_counter()
    for _ in range(calls):
        spans.append(call())
    total = (time.perf_counter() - begin) / calls * 1e6
    torch.cuda.synchronize()
    before = sum(s[0] - c[0] for s, c in zip(STAMPS, spans)) / calls * 1e6
    inside = sum(s[1] - s[0] for s in STAMPS) / calls * 1e6
    after = sum(c[1] - s[1] for s, c in zip(STAMPS, spans)) / calls * 1e6
    return before, inside, after, total


def main():
    library._backward_formula = timed_formula
    print(torch.__version__, torch.cuda.get_device_name())
    if "--profile" in sys.argv:
        for shape, k, pad in LAYERS[:2]:
            x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
            w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
            g = torch.randn_like(dwconv.depthwise_conv2d(x, w, None, 1, pad))
            measure(x, w, g, pad, False, calls=5)
            PROFILER.append(cProfile.Profile())
            measure(x, w, g, pad, False, calls=100)
            print(f"{shape} k{k} NCHW, the backward formula on the device thread, 100 calls:")
            pstats.Stats(PROFILER.pop()).sort_stats("tottime").print_stats(18)
    for shape, k, pad in LAYERS:
        for layout in (torch.contiguous_format, torch.channels_last):
            x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=layout).requires_grad_()
            w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
            g = torch.randn_like(dwconv.depthwise_conv2d(x, w, None, 1, pad))
            for one_thread in (False, True):
                before, inside, after, total = measure(x, w, g, pad, one_thread)
                mode = "calling thread" if one_thread else "device thread "
                fmt = "channels_last" if layout is torch.channels_last else "NCHW"
                print(f"{shape} k{k} {fmt:13s} {mode}: before {before:6.1f}  inside {inside:6.1f}  "
                      f"after {after:6.1f}  total f+b {total:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
