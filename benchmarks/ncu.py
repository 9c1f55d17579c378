"""Developer probe (GPU, under Nsight Compute): kb84's forward through dwconv on NCHW and on
channels_last tensors, a kernel that reads the input and writes a tensor of its size (x * 1: a
copy as a kernel; torch's clone is a cudaMemcpy, which ncu does not profile) and a copy of the
input's interior into a 254 x 510 output (the forward's output rows: 2040 bytes, so row starts
fall inside 32-byte sectors), each twice (the first compiles), so that ncu can set the forward's
memory counters beside a copy's. With --time: each one's mean time (CUDA events, 20 calls after
warm-up, L2 not flushed) and bandwidth, no ncu. With --backward: the fused backward (grad_input and
grad_weight in one pass, `dwconv::conv2d_grad_input_weight`) on NCHW and channels_last tensors
instead (channels_last ran at 82% of copy, NCHW at 92%). With
--layer N C H W K PAD STRIDE: that layer's channels_last forward, dwconv's beside cuDNN's
(float32 64x144x56x56 and 64x96x112x112 stride 2 lose to cuDNN with every tile tried).

    ncu --clock-control none --kernel-name regex:"depthwise|elementwise_kernel" \
        --launch-count 8 --section SpeedOfLight ... python benchmarks/ncu_84.py float32
"""

import sys

import torch
import torch.nn.functional as F

from dwconv._geometry import conv_geometry
from dwconv._library import conv_arguments
from dwconv.dispatch import conv_forward


def cases(dtype):
    x = torch.randn(64, 128, 256, 512, device="cuda", dtype=dtype)
    x_cl = torch.randn(64, 256, 512, 128, device="cuda", dtype=dtype).permute(0, 3, 1, 2)
    w = torch.randn(128, 1, 3, 3, device="cuda", dtype=dtype)
    geom = conv_geometry(x, w, None, 1, 0, 1)
    interior = torch.empty(64, 128, 254, 510, device="cuda", dtype=dtype)
    moved = x.numel() * x.element_size() + interior.numel() * interior.element_size()
    return {
        "dwconv NCHW": (lambda: conv_forward(x, w, None, geom), moved),
        "dwconv channels_last": (lambda: conv_forward(x_cl, w, None, geom), moved),
        "x * 1": (lambda: torch.mul(x, 1.0), 2 * x.numel() * x.element_size()),
        "copy to 254 x 510": (lambda: interior.copy_(x[:, :, 1:255, 1:511]), 2 * interior.numel() * x.element_size()),
    }


def backward_cases(dtype, shape=(64, 128, 256, 512), device="cuda"):
    """The fused backward of kb84's layer in both layouts (grad_out and x read, grad_input written),
    beside x * 1."""
    n, c, h, w = shape
    weight = torch.randn(c, 1, 3, 3, device=device, dtype=dtype)
    runs = {}
    for layout in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(shape, device=device, dtype=dtype).contiguous(memory_format=layout)
        geom = conv_geometry(x, weight, None, 1, 0, 1)
        grad_out = torch.randn(geom.output_shape, device=device, dtype=dtype).contiguous(memory_format=layout)
        moved = (2 * x.numel() + grad_out.numel()) * x.element_size()
        name = "dwconv backward " + ("channels_last" if layout is torch.channels_last else "NCHW")
        runs[name] = (lambda g=grad_out, x=x, a=conv_arguments(geom):
                      torch.ops.dwconv.conv2d_grad_input_weight(g, x, weight, *a), moved)
    x = torch.randn(shape, device=device, dtype=dtype)
    runs["x * 1"] = (lambda: torch.mul(x, 1.0), 2 * x.numel() * x.element_size())
    return runs


def layer_cases(dtype, layer):
    """One layer's channels_last forward: dwconv's and cuDNN's, and x * 1."""
    n, c, h, w, k, pad, stride = layer
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(c, 1, k, k, device="cuda", dtype=dtype)
    geom = conv_geometry(x, weight, None, stride, pad, 1)
    moved = (x.numel() + n * c * geom.out_h * geom.out_w) * x.element_size()
    return {
        "dwconv channels_last": (lambda: conv_forward(x, weight, None, geom), moved),
        "cuDNN channels_last": (lambda: F.conv2d(x, weight, None, stride, pad, 1, c), moved),
        "x * 1": (lambda: torch.mul(x, 1.0), 2 * x.numel() * x.element_size()),
    }


def main(dtype_name="float32", time=False, backward=False, layer=None):
    dtype = getattr(torch, dtype_name)
    runs = layer_cases(dtype, layer) if layer else (backward_cases if backward else cases)(dtype)
    for name, (run, moved) in runs.items():
        for _ in range(2):
            run()
        if time:
            for _ in range(3):
                run()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                run()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 20
            print(f"{dtype_name:8} {name:22} {ms:7.3f} ms {moved / ms / 1e6:7.0f} GB/s")
    torch.cuda.synchronize()


if __name__ == "__main__":
    args = sys.argv[1:]
    layer = None
    if "--layer" in args:
        at = args.index("--layer")
        layer, args = [int(v) for v in args[at + 1:at + 8]], args[:at] + args[at + 8:]
    main(*[a for a in args if not a.startswith("--")], time="--time" in args, backward="--backward" in args,
         layer=layer)
