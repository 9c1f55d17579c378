"""Developer probe (GPU): where the CUDA-core large_fma kernels beat the default kernels, by kernel
size, dtype and layer (issue #6's crossover, and the suite's mid-sized kernels). For each layer and
dtype: forward and forward+backward through dwconv with large_fma off (LARGE_FMA_MIN_TAPS beyond any
kernel) and on (every kernel size, dtype and width), each as CUDA-graph replays (the GPU's time)
and as plain calls (CUDA events, host included), beside PyTorch eager.

    PYTHONPATH=src python benchmarks/probe_fma_crossover.py [--dtype float32 bfloat16]
"""

import argparse

import torch
import torch.nn.functional as F

import dwconv
from dwconv.bench import forward_backward, graphed
from dwconv.ops import large_fma
from profile_model import events_ms  # (benchmarks/ is on the path when run as a script)

# (N, C, H, W, kernel, padding): one image size by kernel size, then the suite's layers
LAYERS = [(32, 128, 56, 56, k, k // 2) for k in (3, 5, 7, 9, 11)] + [
    (64, 240, 28, 28, 5, 2), (64, 96, 56, 56, 7, 3), (64, 384, 14, 14, 7, 3), (64, 144, 56, 56, 3, 1),
    (32, 256, 28, 28, 13, 6), (64, 128, 256, 512, 3, 0),
    # (session 14) 7-wide planes, and the models suite's stride-1 3x3 layers (half
    # precision 3x3 won on 56x56 planes, lost on #84)
    (64, 1152, 7, 7, 5, 2), (64, 768, 7, 7, 7, 3), (64, 480, 14, 14, 5, 2), (64, 32, 112, 112, 3, 1),
    (64, 192, 28, 28, 3, 1), (64, 384, 14, 14, 3, 1), (64, 960, 7, 7, 3, 1),
    # (session 14, after the device time) the models suite's stride-2 layers: large_fma takes column
    # strides (LARGE_FMA_MAX_STRIDE_W since session 15); the 7th field is the stride
    (64, 96, 112, 112, 3, 1, 2), (64, 144, 56, 56, 3, 1, 2), (64, 192, 28, 28, 3, 1, 2),
    (64, 240, 28, 28, 3, 1, 2), (64, 576, 14, 14, 3, 1, 2), (64, 144, 56, 56, 5, 2, 2), (64, 672, 14, 14, 5, 2, 2)]


_DEFAULTS = {name: getattr(large_fma, name) for name in (
    "LARGE_FMA_MIN_TAPS", "LARGE_FMA_WIDE_MIN_TAPS", "LARGE_FMA_HALF_MAX_TAPS", "LARGE_FMA_MAX_STRIDE_W",
    "LARGE_FMA_SMALL_KERNEL_MAX_WIDTH")}


def switch(on: bool):
    """large_fma for every kernel size, dtype, width and column stride (on), or for none (off)."""
    for name, value in _DEFAULTS.items():
        setattr(large_fma, name, value)
    if on:
        large_fma.LARGE_FMA_MIN_TAPS = large_fma.LARGE_FMA_WIDE_MIN_TAPS = 1
        large_fma.LARGE_FMA_HALF_MAX_TAPS = large_fma.LARGE_FMA_MAX_STRIDE_W = 10**9
        large_fma.LARGE_FMA_SMALL_KERNEL_MAX_WIDTH = 10**9
    else:
        large_fma.LARGE_FMA_MIN_TAPS = 10**9


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int, nargs="+", help="indices into LAYERS")
    args = p.parse_args()
    for i in args.layers if args.layers is not None else range(len(LAYERS)):
        n, c, h, w, k, pad, stride = (*LAYERS[i], 1)[:7]
        for dtype in (getattr(torch, d) for d in args.dtype):
            x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
            weight = torch.randn(c, 1, k, k, device="cuda", dtype=dtype) / k
            ref = F.conv2d(x.double(), weight.double(), None, stride, pad, 1, c)
            g = torch.randn(ref.shape, device="cuda", dtype=dtype)
            eager_fwd = events_ms(lambda: F.conv2d(x, weight, None, stride, pad, 1, c), 10)
            eager_fb = events_ms(forward_backward(lambda a, b: F.conv2d(a, b, None, stride, pad, 1, c), (x, weight), g),
                                 5)
            cells = []
            for on in (False, True):
                switch(on)
                fwd = lambda: dwconv.depthwise_conv2d(x, weight, None, stride, pad)
                err = ((fwd().double() - ref).abs().max() / ref.abs().max()).item()
                fb = forward_backward(lambda a, b: dwconv.depthwise_conv2d(a, b, None, stride, pad), (x, weight), g)
                cells.append(f"{'fma' if on else 'default'}: fwd {events_ms(graphed(fwd), 20):.3f} graph "
                             f"{events_ms(fwd, 20):.3f} events, f+b {events_ms(graphed(fb), 10):.3f} graph "
                             f"{events_ms(fb, 10):.3f} events, err {err:.1e}")
            switch(False)
            print(f"{str(dtype)[6:]:8s} {(n, c, h, w)} k{k} s{stride}: eager fwd {eager_fwd:.3f} f+b {eager_fb:.3f}; "
                  + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
