"""Developer probe (GPU): where the small layers' forward+backward time goes. For each layer,
microseconds per call of the host (Python + launches; the GPU queue is not full) and of the wall
(host and GPU, back to back, no L2 flush), for dwconv and PyTorch eager, and for a Python autograd
Function that launches nothing (what any Python Function's backward costs); then a cProfile of
dwconv's forward+backward on the first layer (64x144x56x56, the fused backward).

    PYTHONPATH=src python benchmarks/host_overhead_gpu.py
"""

import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import dwconv
from dwconv._geometry import conv_geometry
from dwconv.ops.backward import conv_grad_input, conv_grad_input_and_weight, conv_grad_weight, fused_backward_applies
from dwconv.ops.forward import conv_forward

LAYERS = [((64, 144, 56, 56), 3, 1, 1), ((32, 256, 64, 64), 3, 2, 2), ((64, 384, 14, 14), 7, 3, 1), ((64, 960, 7, 7), 3, 1, 1)]


def per_call_us(fn, calls=50):  # (few enough that the launch queue never fills)
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return host / calls * 1e6, wall / calls * 1e6


def single_threaded_grad(out, inputs, grad):
    """Backward on the calling thread (CUDA backward normally runs on the engine's device thread)."""
    with torch.autograd.set_multithreading_enabled(False):
        return torch.autograd.grad(out, inputs, grad)


class PassThrough(torch.autograd.Function):
    """A Python autograd Function that launches nothing: the host cost of any Python Function's node
    (on the CUDA engine's device thread, or on one thread), with no dwconv code in it."""

    @staticmethod
    def forward(ctx, x, w):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def make_runs(x, w, g, pad, dil):
    geom = conv_geometry(x, w, None, 1, pad, dil)
    xd, wd = x.detach(), w.detach()
    fused = fused_backward_applies(geom, xd)
    return {
        "dwconv forward": lambda: dwconv.depthwise_conv2d(xd, wd, None, 1, pad, dil),
        "dwconv fwd+bwd": lambda: torch.autograd.grad(dwconv.depthwise_conv2d(x, w, None, 1, pad, dil), (x, w), g),
        # the same kernels without the autograd engine, and with it on one thread
        "dwconv launchers": lambda: (conv_forward(xd, wd, None, geom),
                                     conv_grad_input_and_weight(g, xd, wd, geom) if fused else
                                     (conv_grad_weight(g, xd, geom, wd.dtype, False), conv_grad_input(g, wd, geom, xd))),
        "dwconv 1-thread": lambda: single_threaded_grad(dwconv.depthwise_conv2d(x, w, None, 1, pad, dil), (x, w), g),
        "empty Function": lambda: torch.autograd.grad(PassThrough.apply(x, w), (x,), x),
        "empty 1-thread": lambda: single_threaded_grad(PassThrough.apply(x, w), (x,), x),
        "eager fwd+bwd": lambda: torch.autograd.grad(F.conv2d(x, w, None, 1, pad, dil, groups=x.shape[1]), (x, w), g),
        "eager 1-thread": lambda: single_threaded_grad(F.conv2d(x, w, None, 1, pad, dil, groups=x.shape[1]), (x, w), g),
    }


def main():
    profiled = None
    for shape, k, pad, dil in LAYERS:
        x = torch.randn(shape, device="cuda").requires_grad_()
        w = torch.randn(shape[1], 1, k, k, device="cuda").requires_grad_()
        g = torch.randn_like(F.conv2d(x, w, None, 1, pad, dil, groups=shape[1]))
        runs = make_runs(x, w, g, pad, dil)
        for name, fn in runs.items():
            host, wall = per_call_us(fn)
            print(f"{shape} k{k} p{pad} d{dil} {name:16s} host {host:7.1f} us  wall {wall:7.1f} us", flush=True)
        if profiled is None:
            profiled = runs["dwconv fwd+bwd"]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        profiled()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
