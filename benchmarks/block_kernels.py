"""Where the depthwise block's training step goes on the GPU, kernel by kernel: the convolution,
BatchNorm2d in training and the activation, forward and the gradients of the input, the
convolution's weight and the BatchNorm's weight and bias, stock's kernels against dwconv's (the
fused block's: dwconv's convolution, then BatchNormActivationFunction), per layout. GPU time from
torch's profiler (the kernels alone: no host time, unlike bench --block's rows, which a slow host
can hold up).

    python benchmarks/block_kernels.py [--dtype bfloat16] [--activation relu6] [--layouts cl,nchw]
        [--only-dwconv] [--out FILE]

Shapes: MobileNetV2's and EfficientNet-B0's widest 3x3 layers at batch 64, one at batch 256, a 7x7
plane of 960 channels. Beside dwconv's fused block as models run it, the same step with the
BatchNorm's grad_y computed in the convolution's backward as it loads it where that applies
(dispatch.conv_grad_through_batch_norm, called directly: no autograd), else written as before. Each kernel's microseconds a step (mean of 10 steps after 5), and the sum;
beside it the time two floors take at the bandwidth of a device copy of the input timed the same
way in the run: the bench's (3 in + 2 out: the input read and the output written forward, as much
again backward) and the fewest bytes of an exact BatchNorm in training (min(5 in + 3 out, 3 in + 7
out): its statistics cost passes of their own, docs/decisions.md).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import dwconv  # noqa: E402
from dwconv.batch_norm import BatchNormActivationFunction  # noqa: E402
from dwconv._geometry import conv_geometry  # noqa: E402
from dwconv.activations import FUNCTIONS, activation_code  # noqa: E402
from dwconv.dispatch import batch_norm_grad_in_convolution_applies, conv_grad_through_batch_norm  # noqa: E402
from dwconv.kernels.batch_norm import batch_norm_forward, batch_norm_grad_sums  # noqa: E402
from dwconv.kernels.tile import NormGrad  # noqa: E402

SHAPES = [((64, 32, 112, 112), 1), ((64, 96, 112, 112), 2), ((256, 144, 56, 56), 1), ((256, 960, 7, 7), 1)]
LAYOUTS = {"cl": torch.channels_last, "nchw": torch.contiguous_format}


def kernel_times(step, steps: int = 10) -> dict:
    """{kernel name: (us a step, launches a step)} of step() on the GPU."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return {e.key: (e.self_device_time_total / steps, e.count // steps) for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0}


def block(shape, stride: int, layout, dtype, activation: str, only_dwconv: bool) -> list:
    n, c, h, w = shape
    x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=layout).requires_grad_()
    weight = torch.randn(c, 1, 3, 3, device="cuda", dtype=dtype, requires_grad=True)
    gamma = torch.ones(c, device="cuda", requires_grad=True)
    beta = torch.zeros(c, device="cuda", requires_grad=True)
    running = [torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")]

    def fused():
        y = dwconv.depthwise_conv2d(x, weight, None, stride=stride, padding=1)
        return BatchNormActivationFunction.apply(y, gamma, beta, *running, 0.1, 1e-5, activation)

    def stock():
        y = F.conv2d(x, weight, None, stride=stride, padding=1, groups=c)
        return FUNCTIONS[activation](F.batch_norm(y, *running, gamma, beta, True, 0.1, 1e-5))

    def through():  # (the backward's grad_y computed in the convolution's backward where it applies)
        with torch.no_grad():
            y = dwconv.depthwise_conv2d(x, weight, None, stride=stride, padding=1)
            out, mean, invstd = batch_norm_forward(y, gamma, beta, *running, 0.1, 1e-5, code)
            totals, _, _ = batch_norm_grad_sums(grad, y, gamma, beta, mean, invstd, 1e-5, code)
            norm = NormGrad(y, mean, invstd, gamma, beta, totals, code)
            return conv_grad_through_batch_norm(grad, x.detach(), weight.detach(), geom, norm, 1e-5)

    code = activation_code(activation)
    geom = conv_geometry(x, weight, None, stride, 1, 1)
    grad = torch.randn_like(fused())
    copy = torch.empty_like(x)
    copy_us = sum(us for us, _ in kernel_times(lambda: copy.copy_(x.detach())).values())
    in_bytes, out_bytes = x.numel() * x.element_size(), grad.numel() * grad.element_size()
    us_per_byte = copy_us / (2 * in_bytes)
    floors = {"bench's floor": (3 * in_bytes + 2 * out_bytes) * us_per_byte,
              "exact floor": min(5 * in_bytes + 3 * out_bytes, 3 * in_bytes + 7 * out_bytes) * us_per_byte}
    lines = [f"=== {'x'.join(map(str, shape))} stride {stride} "
             f"{'channels_last' if layout == torch.channels_last else 'NCHW'} {str(dtype)[6:]} +bn+{activation}, "
             f"input {in_bytes / 1e6:.1f} MB; copy {2 * in_bytes / copy_us / 1e6:.2f} TB/s; "
             + ", ".join(f"{name} {us:.0f} us" for name, us in floors.items())]
    applies = "in the convolution's backward" if batch_norm_grad_in_convolution_applies(geom, x) else "written"
    steps = {"dwconv": lambda: torch.autograd.grad(fused(), [x, weight, gamma, beta], grad),
             f"dwconv, grad_y {applies}": through,
             "stock": lambda: torch.autograd.grad(stock(), [x, weight, gamma, beta], grad)}
    for name, step in list(steps.items())[:2 if only_dwconv else 3]:
        times = kernel_times(step)
        total = sum(us for us, _ in times.values())
        lines.append(f"-- {name}: kernels {total:.0f} us a step ("
                     + ", ".join(f"{100 * us / total:.0f}% of the {name_}" for name_, us in floors.items()) + ")")
        for kernel, (us, count) in sorted(times.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"   {us:8.1f} us  x{count}  {kernel[:100]}")
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--activation", default="relu6", choices=sorted(FUNCTIONS))
    parser.add_argument("--layouts", default="cl,nchw")
    parser.add_argument("--only-dwconv", action="store_true", help="dwconv's kernels alone (A/B of its tables)")
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}"]
    print(lines[0], flush=True)
    for shape, stride in SHAPES:
        for layout in args.layouts.split(","):
            table = block(shape, stride, LAYOUTS[layout], getattr(torch, args.dtype), args.activation,
                          args.only_dwconv)
            print("\n".join(table), flush=True)
            lines += table
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
