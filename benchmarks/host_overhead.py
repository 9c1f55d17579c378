"""Developer probe: host (Python) time of dwconv's launchers per call, with the Triton launches
stubbed out, on CPU tensors (no GPU needed). It measures only dwconv's own wrapper code: argument
checks, configuration, allocation and the small torch ops around the kernels, not Triton's launcher.

    python benchmarks/host_overhead.py
"""

import time

import torch

import dwconv.ops.backward as backward
import dwconv.ops.forward as forward
from dwconv._geometry import conv_geometry


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def per_call_us(fn, calls):
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    for name in ("depthwise_fwd_rows_kernel", "depthwise_fwd_tile_kernel"):
        setattr(forward, name, _NoLaunch())
    for name in ("depthwise_grad_weight_kernel", "depthwise_grad_input_tile_kernel"):
        setattr(backward, name, _NoLaunch())
    x = torch.randn(64, 144, 56, 56)
    weight = torch.randn(144, 1, 3, 3)
    geom = conv_geometry(x, weight, None, 1, 1, 1)
    grad_out = torch.randn(geom.output_shape)
    print("64x144x56x56 k3 p1, float32, CPU tensors, kernels not launched; microseconds per call:")
    print(f"  conv_geometry     {per_call_us(lambda: conv_geometry(x, weight, None, 1, 1, 1), 2000):6.1f}")
    print(f"  conv_forward      {per_call_us(lambda: forward.conv_forward(x, weight, None, geom), 2000):6.1f}")
    print(f"  conv_grad_weight  {per_call_us(lambda: backward.conv_grad_weight(grad_out, x, geom, weight.dtype, False), 500):6.1f}")
    print(f"  conv_grad_input   {per_call_us(lambda: backward.conv_grad_input(grad_out, weight, geom, x), 500):6.1f}")


if __name__ == "__main__":
    main()
