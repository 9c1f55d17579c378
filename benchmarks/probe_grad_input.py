"""Developer probe (session 2; session 3 added the aligned-output row): why grad_input (the forward kernel on grad_out with the flipped weight) of
#84 takes twice the forward's time. Times the forward kernel on inputs that differ from #84
only in row width (510: rows 8-byte aligned; 512: 16-byte aligned) and padding (0 / 2), and the
grad_weight kernel with more programs per channel on a narrow layer."""

import statistics

import torch

from dwconv._geometry import conv_geometry
from dwconv.bench import Timer, measure_copy
from dwconv.ops.backward import GradWeightConfig, conv_grad_weight, grad_weight_config
from dwconv.ops.forward import ForwardConfig, conv_forward, forward_config

timer = Timer(warmup=2, iters=10)
copy = measure_copy(timer)
print(f"copy {copy:.0f} GB/s")
w = torch.randn(128, 1, 3, 3, device="cuda")
# (256, 512, (0, 1)): #84 with 512-wide output rows, so every store is 16-byte aligned
for h, width, pad in [(256, 512, 0), (256, 512, (0, 1)), (254, 510, 2), (256, 510, 0)]:
    x = torch.randn(64, 128, h, width, device="cuda")
    geom = conv_geometry(x, w, None, 1, pad, 1)
    out = torch.empty(geom.output_shape, device="cuda")
    default = forward_config(geom, x)
    nbytes = (x.numel() + out.numel()) * 4
    for cfg in [default, ForwardConfig("rows", 128, 512, 4, 4), ForwardConfig("rows", 64, 512, 2, 4)]:
        ms = statistics.fmean(timer(lambda: conv_forward(x, w, None, geom, cfg, out=out)))
        print(f"in {h}x{width} pad {pad}: {ms:.3f} ms {100 * nbytes / ms / 1e6 / copy:5.1f}%  {cfg}", flush=True)
    del x, out
x = torch.randn(64, 144, 56, 56, device="cuda")
w = torch.randn(144, 1, 3, 3, device="cuda")
geom = conv_geometry(x, w, None, 1, 1, 1)
g = torch.randn(geom.output_shape, device="cuda")
for programs in (8192, 16384, 32768, 65536):
    for bw, warps in ((64, 1), (32, 1)):
        cfg = GradWeightConfig(bw, warps, 1, max(1, programs // 144))
        ms = statistics.fmean(timer(lambda: conv_grad_weight(g, x, geom, w.dtype, True, cfg)))
        print(f"grad_weight 64x144x56x56: {ms:.4f} ms {cfg}", flush=True)
print("default", grad_weight_config(geom, x))
