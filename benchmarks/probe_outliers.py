"""Developer probe (GPU): the spread of the benchmark's forward+backward times on one small layer.
Session 20's suite rows of small channels_last layers had std as large as their mean (64x384x14x14
k3 bfloat16: 0.384 +- 0.263 ms, forward 0.029 and backward 0.103 alone): this prints each path's
per-call distribution under bench.Timer's protocol (L2 flushed before each call), with Python's
garbage collector on and off, and the host time a call (no flush; synchronised every 10 calls, as
session 21's first version, which ran 300 calls in a row, measured the GPU once the launch queue
filled). --parts: first the passes apart, as the bench times them. --profile DIR: then 20 calls of
each path under torch.profiler with CUDA activity: a table of GPU and CPU time by op and kernel,
and a Chrome trace per path in DIR (where the GPU idles between a call's kernels).

    python benchmarks/probe_outliers.py --shape 64 384 14 14 --kernel 3 --dtype bfloat16
"""

import argparse
import gc
import os
import statistics

import torch
import torch.nn.functional as F

import dwconv
from dwconv.bench import Timer, backward_only, forward_backward
from dwconv.ops import native
from probe_native_host import per_call_us  # (host time: synchronised every 10 calls)


def summary(times):
    times = sorted(times)
    median = statistics.median(times)
    slow = [t for t in times if t > 2 * median]
    return (f"mean {statistics.fmean(times):.4f} median {median:.4f} min {times[0]:.4f} "
            f"p95 {times[int(0.95 * len(times))]:.4f} max {times[-1]:.4f} ms; {len(slow)} of {len(times)} "
            f"over 2x median (sum of their excess {sum(t - median for t in slow):.3f} ms)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, default=[64, 384, 14, 14])
    p.add_argument("--kernel", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--layouts", nargs="+", default=["nchw", "channels_last"])
    p.add_argument("--profile", metavar="DIR")
    p.add_argument("--parts", action="store_true",
                   help="first the forward+backward as the bench times it (3 warm-up calls), then the "
                        "forward with and without an autograd graph and the backward alone")
    args = p.parse_args()
    native.prepare()
    dtype = getattr(torch, args.dtype)
    n, c, h, w = args.shape
    pad = args.kernel // 2
    timer = Timer(3, args.iters)
    for layout_name in args.layouts:
        layout = torch.channels_last if layout_name == "channels_last" else torch.contiguous_format
        x = torch.randn(args.shape, device="cuda", dtype=dtype).contiguous(memory_format=layout)
        weight = torch.randn(c, 1, args.kernel, args.kernel, device="cuda", dtype=dtype).contiguous(memory_format=layout)
        grad_out = torch.randn_like(x)
        paths = {"dwconv": lambda x, w, b: dwconv.depthwise_conv2d(x, w, b, padding=pad),
                 "torch": lambda x, w, b: F.conv2d(x, w, b, padding=pad, groups=c)}
        for name, conv in paths.items():
            fn = forward_backward(conv, (x, weight, None), grad_out)
            label = f"{'channels_last' if layout is torch.channels_last else 'NCHW'} {name}"
            if args.parts:  # the bench's order: forward+backward timed after 3 warm-up calls only
                print(f"{label} fwd+bwd, 3 warm-up calls: {summary(timer(fn))}", flush=True)
                leaves = [t.detach().requires_grad_() for t in (x, weight)]
                parts = {"forward": lambda: conv(x, weight, None),
                         "forward with autograd graph": lambda: conv(*leaves, None),
                         "backward only": backward_only(conv, (x, weight, None), grad_out)}
                for part, part_fn in parts.items():
                    print(f"{label} {part}: {summary(timer(part_fn))}", flush=True)
            print(f"{label}: host {per_call_us(fn, 200):.1f} us a forward+backward", flush=True)
            for collect in (True, False):
                if not collect:
                    gc.disable()
                print(f"{label} gc {'on ' if collect else 'off'}: {summary(timer(fn))}", flush=True)
                gc.enable()
            if args.profile:
                profile(fn, timer, os.path.join(args.profile, f"trace_{label.replace(' ', '_')}.json"))


def profile(fn, timer, trace_path):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    os.makedirs(os.path.dirname(trace_path) or ".", exist_ok=True)
    short = Timer(0, 20)
    short.flush_buffer = timer.flush_buffer
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        short(fn)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15), flush=True)
    prof.export_chrome_trace(trace_path)


if __name__ == "__main__":
    main()
