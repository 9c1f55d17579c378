"""Developer probe (GPU): why the suite's forward+backward of small channels_last layers takes
0.6-0.8 ms (session 9) when forward and backward alone take 0.03 and 0.2: the same call timed
with the bench's Timer (L2 flush + events), without the flush, with gc off, as host time alone,
and its forward with requires_grad alone; then a cProfile of the forward+backward.

    PYTHONPATH=src python benchmarks/probe_fwd_bwd_host.py
"""

import cProfile
import gc
import pstats

import torch
import torch.nn.functional as F

import dwconv
from dwconv.bench import Timer
from host_overhead_gpu import per_call_us  # (benchmarks/ is on the path when run as a script)


def host_us(fn):
    return per_call_us(fn, 100)[0]


def main():
    flushed, plain = Timer(3, 100), Timer(3, 100)
    plain.flush_buffer = torch.empty(1, dtype=torch.uint8, device="cuda")
    for shape, k in [((64, 384, 14, 14), 3), ((64, 768, 7, 7), 7), ((64, 144, 56, 56), 3)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=torch.bfloat16)
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        g = torch.randn_like(F.conv2d(x, w, None, 1, k // 2, 1, shape[1]))
        for name, conv in [("dwconv", lambda a, b: dwconv.depthwise_conv2d(a, b, None, 1, k // 2)),
                           ("cuDNN", lambda a, b: F.conv2d(a, b, None, 1, k // 2, 1, shape[1]))]:
            fb = lambda: torch.autograd.grad(conv(xl, wl), (xl, wl), g)
            fwd_graph = lambda: conv(xl, wl)
            rows = {"f+b flushed": sum(flushed(fb)) / 100 * 1e3, "f+b no flush": sum(plain(fb)) / 100 * 1e3}
            gc.disable()
            rows["f+b flushed, gc off"] = sum(flushed(fb)) / 100 * 1e3
            gc.enable()
            rows["fwd (graph) flushed"] = sum(flushed(fwd_graph)) / 100 * 1e3
            rows["f+b host"] = host_us(fb)
            rows["fwd (graph) host"] = host_us(fwd_graph)
            print(f"{shape} k{k} {name}: " + ", ".join(f"{key} {v:.0f} us" for key, v in rows.items()), flush=True)
        if k == 7:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                torch.autograd.grad(dwconv.depthwise_conv2d(xl, wl, None, 1, 3), (xl, wl), g)
            torch.cuda.synchronize()
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
