"""Developer probe (CPU or GPU): resident memory and recorded layers of the C++ eager path as a model
meets many input sizes (DWCONV_NATIVE=1). Each size is a new layer: recorded once, then evicted
past ops.native.LAYER_CAPACITY.

    TRITON_INTERPRET=1 python benchmarks/probe_layer_registry.py --sizes 400 --every 50 --capacity 64
"""

import argparse
import os
import resource

os.environ.setdefault("DWCONV_NATIVE", "1")

import torch  # noqa: E402

import dwconv  # noqa: E402
from dwconv.ops import native  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, default=4000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--capacity", type=int, default=native.LAYER_CAPACITY)
    args = parser.parse_args()
    native.LAYER_CAPACITY = args.capacity
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight = torch.randn(2, 1, 3, 3, device=device, requires_grad=True)
    start = None
    for size in range(args.sizes + 1):
        x = torch.randn(1 + size % 8, 2, 3, 3 + size // 8, device=device, requires_grad=True)  # (small: the interpreter)
        dwconv.depthwise_conv2d(x, weight, None, 1, 1).sum().backward()
        if size % args.every == 0:
            start = start if start is not None else rss_mb()
            print(f"{size:5d} sizes: RSS {rss_mb() - start:+7.1f} MB, layers {len(native._LAYERS)} (C++ "
                  f"{native.extension().layer_count()}), capacity {native.LAYER_CAPACITY}", flush=True)


if __name__ == "__main__":
    main()
