"""Developer probe: host (Python) time of dwconv's own code per call, with every kernel launch
stubbed out (ops._launch.launch replaced in each ops module), on small CPU tensors under
TRITON_INTERPRET=1 (so that dwconv takes its kernel path; no GPU needed). What it measures:
argument checks, geometry, plan lookups, allocations and the small torch ops around the kernels,
and the autograd Function; not Triton's launcher (see host_overhead_gpu.py for that, on a GPU).
Small shapes keep the torch ops around the kernels (partial sums' sum) from costing real work.

    python benchmarks/host_overhead.py [--profile]
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # (before dwconv imports Triton)

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import dwconv  # noqa: E402
import dwconv.ops.backward as backward  # noqa: E402
import dwconv.ops.forward as forward  # noqa: E402
import dwconv.ops.large_fma as large_fma  # noqa: E402
import dwconv.ops.toeplitz as toeplitz  # noqa: E402
from dwconv._geometry import conv_geometry  # noqa: E402


def _no_launch(kernel, plan, *tensors):
    return None


class PassThrough(torch.autograd.Function):
    """A Function that computes nothing: what any Python Function's forward+backward costs."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad, torch.empty_like(w)


def per_call_us(fn, calls):
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def rows(layout, calls, kernel=3, size=12):
    pad = kernel // 2
    x = torch.randn(2, 144, size, size).contiguous(memory_format=layout)
    weight = torch.randn(144, 1, kernel, kernel)
    geom = conv_geometry(x, weight, None, 1, pad, 1)
    grad_out = torch.randn(geom.output_shape).contiguous(memory_format=layout)
    xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
    fused = backward.fused_backward_applies(geom, x)

    def forward_backward():
        torch.autograd.grad(dwconv.depthwise_conv2d(xg, wg, None, 1, pad), (xg, wg), grad_out)

    yield "conv_geometry", lambda: conv_geometry(x, weight, None, 1, pad, 1), calls
    yield "conv_forward", lambda: forward.conv_forward(x, weight, None, geom), calls
    yield "conv_grad_weight", lambda: backward.conv_grad_weight(grad_out, x, geom, weight.dtype, False), calls
    yield "conv_grad_input", lambda: backward.conv_grad_input(grad_out, weight, geom, x), calls
    if fused:
        yield "conv_grad_input_and_weight", lambda: backward.conv_grad_input_and_weight(grad_out, x, weight, geom), calls
    yield "depthwise_conv2d (no grad)", lambda: dwconv.depthwise_conv2d(x, weight, None, 1, pad), calls
    yield "forward+backward (autograd)", forward_backward, calls // 2
    # (grad_out has the input's shape: 'same' padding)
    yield "empty Function f+b (autograd)", lambda: torch.autograd.grad(PassThrough.apply(xg, wg), (xg, wg), grad_out), \
        calls // 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--profile", action="store_true", help="cProfile the autograd forward+backward")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--kernel", type=int, default=3, help="kernel size ('same' padding)")
    p.add_argument("--size", type=int, default=12, help="image height and width (16 and --kernel 7: large_fma in NCHW)")
    args = p.parse_args()
    for module in (forward, backward, toeplitz, large_fma):
        module.launch = _no_launch
    for layout, name in ((torch.contiguous_format, "NCHW"), (torch.channels_last, "channels_last")):
        print(f"2x144x{args.size}x{args.size} k{args.kernel} p{args.kernel // 2} float32 {name}, CPU tensors, "
              "kernels not launched; "
              "microseconds per call:")
        for label, fn, calls in rows(layout, args.calls, args.kernel, args.size):
            print(f"  {label:30s} {per_call_us(fn, calls):7.1f}", flush=True)
            if args.profile and label.startswith("forward+backward"):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(500):
                    fn()
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
