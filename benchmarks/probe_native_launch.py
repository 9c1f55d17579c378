"""Developer probe (GPU): how much of a small layer's forward host time a C++ launch removes
(issues #3 and #4 are bound by host time there). Session 19 ran it with its own small C++ op
(commit 3ee838c and before); it now times the production replayer instead: the forward that dwconv
would run, recorded (ops/program.py) and replayed from C++ (ops/native.py, csrc/replay.cpp: aten
ops as boxed calls, the launch as cuLaunchKernel of Triton's cubin). Per layer, host time per call
(host_overhead_gpu.per_call_us: back-to-back calls that do not fill the launch queue) of:
  dwconv.depthwise_conv2d (the user's call), ops.forward.conv_forward (the launcher alone),
  the C++ replay, and F.conv2d (cuDNN) -- and the replay's output against dwconv's (bitwise).

    python benchmarks/probe_native_launch.py [--calls 50] [--layers 0 1 2 3]
"""

import argparse

import torch
import torch.nn.functional as F

import dwconv
from dwconv._geometry import conv_geometry
from dwconv.ops import forward as fwd
from dwconv.ops import native, program
from host_overhead_gpu import per_call_us  # (benchmarks/ is on the path when run as a script)

# (N, C, H, W), kernel, padding: issue #3's small layers and #84 (float32, NCHW)
LAYERS = [((64, 144, 56, 56), 3, 1), ((64, 384, 14, 14), 7, 3), ((64, 240, 28, 28), 5, 2),
          ((64, 128, 256, 512), 3, 0)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--layers", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args()
    for shape, k, pad in [LAYERS[i] for i in args.layers]:
        x = torch.randn(shape, device="cuda")
        w = torch.randn(shape[1], 1, k, k, device="cuda")
        geom = conv_geometry(x, w, None, 1, pad, 1)
        _, recorded = program.record(lambda x, w: fwd.conv_forward(x, w, None, geom), [x, w])
        replay = native.native_program(recorded)
        expected = dwconv.depthwise_conv2d(x, w, None, 1, pad)
        error = (replay.replay(x, w) - expected).abs().max().item()
        calls = {
            "dwconv.depthwise_conv2d": lambda: dwconv.depthwise_conv2d(x, w, None, 1, pad),
            "conv_forward (launcher)": lambda: fwd.conv_forward(x, w, None, geom),
            "C++ replay": lambda: replay.replay(x, w),
            "F.conv2d (cuDNN)": lambda: F.conv2d(x, w, None, 1, pad, 1, shape[1]),
        }
        times = {name: per_call_us(fn, args.calls)[0] for name, fn in calls.items()}
        print(f"{shape} k{k} p{pad} float32 ({len(recorded.steps)} steps): C++ replay against dwconv "
              f"max abs diff {error:.1e}")
        for name, us in times.items():
            print(f"  {name:26s} {us:7.1f} us a call (host)")


if __name__ == "__main__":
    main()
