"""Developer probe (GPU): where a large-kernel call's time goes (issue #6). For each layer: the call
through dwconv, through conv_forward and through toeplitz_forward (events, back to back: host-bound
where the host is slower), the host time a call (perf_counter, no sync inside), the same call
replayed from a CUDA graph (the GPU's time alone), and the kernels one call runs (profiler).

    PYTHONPATH=src python benchmarks/probe_large_host.py
"""

import torch
import torch.nn.functional as F

import dwconv
from dwconv._geometry import conv_geometry
from dwconv.bench import graphed
from dwconv.ops.forward import conv_forward
from dwconv.ops.toeplitz import toeplitz_forward
from host_overhead_gpu import per_call_us  # (benchmarks/ is on the path when run as a script)
from profile_model import events_ms

LAYERS = [((32, 256, 28, 28), 13, 6), ((32, 128, 56, 56), 31, 15)]


def host_us(fn, calls=50):
    return per_call_us(fn, calls)[0]


def graph_ms(fn, iters=20):
    return events_ms(graphed(fn), iters)


def backward_host(shape, k, pad, dtype):
    """Host time a call of each backward part and of forward+backward through autograd (which runs
    the backward on the engine's device thread), against a few plain torch ops for scale."""
    from dwconv.ops.backward import conv_grad_input, conv_grad_weight
    from dwconv.ops.toeplitz import padded_weight_rows

    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype) / k
    g = torch.randn(shape, device="cuda", dtype=dtype)
    geom = conv_geometry(x, w, None, 1, pad, 1)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    calls = dict(empty=lambda: torch.empty_like(x), band_rows=lambda: padded_weight_rows(w, geom, 32, 64, 8, 8),
                 forward=lambda: conv_forward(x, w, None, geom),
                 grad_input=lambda: conv_grad_input(g, w, geom, x),
                 grad_weight=lambda: conv_grad_weight(g, x, geom, dtype, False),
                 autograd_fwd_bwd=lambda: torch.autograd.grad(dwconv.depthwise_conv2d(xl, wl, None, 1, pad), (xl, wl), g))
    for name, fn in calls.items():
        fn()
        print(f"{str(dtype)[6:]:8s} k{k} {name:16s}: host {host_us(fn, 30):.0f} us, events {events_ms(fn, 20):.3f} ms",
              flush=True)


def main():
    for dtype in (torch.bfloat16, torch.float32):
        backward_host(*LAYERS[0], dtype)
    for shape, k, pad in LAYERS:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(shape, device="cuda", dtype=dtype)
            w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype) / k
            geom = conv_geometry(x, w, None, 1, pad, 1)
            out = torch.empty_like(x)
            calls = dict(dwconv=lambda: dwconv.depthwise_conv2d(x, w, None, 1, pad),
                         conv_forward=lambda: conv_forward(x, w, None, geom),
                         toeplitz=lambda: toeplitz_forward(x, w, None, geom, out),
                         eager=lambda: F.conv2d(x, w, None, 1, pad, 1, shape[1]))
            for name, fn in calls.items():
                print(f"{str(dtype)[6:]:8s} k{k} {name:12s}: events {events_ms(fn, 20):.3f} ms, host {host_us(fn):.0f} us, "
                      f"graph {graph_ms(fn):.3f} ms", flush=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                calls["dwconv"]()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6), flush=True)


if __name__ == "__main__":
    main()
