"""Developer probe (session 3): #84's forward with and without aligned stores on odd output rows
(`dwconv.ops.forward.ODD_OUT_ALIGN`): its output rows are 510 elements, so odd rows start 8 bytes
past a 16-byte boundary. Also the same convolution with 512-wide output rows (padding (0, 1)), whose
stores are all aligned, as the bound to compare with; streaming cache hints (ForwardConfig.stream);
one program per plane strip (block_h 254: no halo rows read twice).
--half (session 7): float16 / bfloat16 only, aligned odd-row stores on and off
(`forward.ODD_OUT_ALIGN_HALF`) by warps and rows a program.

    PYTHONPATH=src python benchmarks/probe_odd_out.py [--half]
"""

import dataclasses
import statistics
import sys

import torch

import dwconv.ops.forward as forward
from dwconv._geometry import conv_geometry
from dwconv.bench import Timer, measure_copy
from dwconv.ops.forward import ForwardConfig, conv_forward, forward_config

timer = Timer(warmup=2, iters=20)
copy = measure_copy(timer)
print(f"copy {copy:.0f} GB/s")

if "--half" in sys.argv:
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(64, 128, 256, 512, device="cuda", dtype=dtype)
        w = torch.randn(128, 1, 3, 3, device="cuda", dtype=dtype)
        geom = conv_geometry(x, w, None, 1, 0, 1)
        out = torch.empty(geom.output_shape, device="cuda", dtype=dtype)
        ref = torch.nn.functional.conv2d(x[:2].double(), w.double(), None, 1, 0, 1, groups=128)
        nbytes = (x.numel() + out.numel()) * x.element_size()
        for aligned in (False, True):
            forward.ODD_OUT_ALIGN_HALF = aligned
            for rows, warps in ((128, 2), (128, 4), (64, 4), (128, 8), (254, 4)):
                cfg = ForwardConfig("rows", rows, 512, warps, 4)
                out.fill_(float("nan"))
                conv_forward(x, w, None, geom, cfg, out=out)
                err = ((out[:2].double() - ref).abs().max() / ref.abs().max()).item()
                ms = statistics.fmean(timer(lambda: conv_forward(x, w, None, geom, cfg, out=out)))
                print(f"{str(dtype)[6:]} odd-row stores aligned {aligned!s:5} rows {rows} warps {warps}: "
                      f"{ms:.3f} ms {100 * nbytes / ms / 1e6 / copy:5.1f}% (rel err {err:.2g})", flush=True)
        forward.ODD_OUT_ALIGN_HALF = False
        del x, out
    sys.exit()

for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(64, 128, 256, 512, device="cuda", dtype=dtype)
    w = torch.randn(128, 1, 3, 3, device="cuda", dtype=dtype)
    for pad in (0, (0, 1)):
        geom = conv_geometry(x, w, None, 1, pad, 1)
        out = torch.empty(geom.output_shape, device="cuda", dtype=dtype)
        ref = torch.nn.functional.conv2d(x[:2].float(), w.float(), None, 1, pad, 1, groups=128)
        nbytes = (x.numel() + out.numel()) * x.element_size()
        for aligned in ((True, False) if pad == 0 else (True,)):
            forward.ODD_OUT_ALIGN = aligned
            default = forward_config(geom, x)
            for cfg in (default, ForwardConfig("rows", 128, 512, 4, 4), dataclasses.replace(default, stream=True),
                        ForwardConfig("rows", 254, 512, 2, 4)):
                out.fill_(float("nan"))
                conv_forward(x, w, None, geom, cfg, out=out)
                err = (out[:2].float() - ref).abs().max().item()
                ms = statistics.fmean(timer(lambda: conv_forward(x, w, None, geom, cfg, out=out)))
                print(f"{str(dtype)[6:]} pad {pad} odd-row stores aligned {aligned!s:5}: {ms:.3f} ms "
                      f"{100 * nbytes / ms / 1e6 / copy:5.1f}% (err {err:.2g})  {cfg}", flush=True)
        del out
    forward.ODD_OUT_ALIGN = True
