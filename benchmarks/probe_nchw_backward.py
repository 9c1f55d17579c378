"""Developer probe (GPU): the NCHW fused backward (grad_input + grad_weight from one read of grad_out
and x) on the rows kernel (the default) against the "nchw_pixels" kernel with WEIGHT_GRAD (session
11, unmeasured: ~half the rows kernel's sm_90 instructions an output), and cuDNN, on #84 and the
stride-1 NCHW layers. Gradients checked against cuDNN's first.
--pixels BLOCK_H BLOCK_W WARPS [RUNS]: the "nchw_pixels" blocks to try (RUNS: runs a column of
tiles; default backward.nchw_pixels_runs). Bytes counted: grad_out and x read, grad_input written.

    PYTHONPATH=src python benchmarks/probe_nchw_backward.py --pixels 4 128 1 --pixels 8 128 1 [--layers 0]
"""

import argparse

import torch
import torch.nn.functional as F

from dwconv._geometry import conv_geometry
from dwconv.ops.backward import conv_grad_input_and_weight
from dwconv.ops.forward import ForwardConfig
from probe_nchw_pixels import LAYERS  # (benchmarks/ is on the path when run as a script)
from probe_nhwc import copy_rate
from profile_model import events_ms as time_ms


def rel_err(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pixels", nargs="+", type=int, action="append", metavar="N", required=True,
                   help="BLOCK_H BLOCK_W WARPS [RUNS]")
    p.add_argument("--layers", type=int, nargs="+", help="indices into probe_nchw_pixels.LAYERS (default: all)")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    args = p.parse_args()
    print(f"copy {copy_rate():.0f} GB/s", flush=True)
    for dtype_name in args.dtype:
        for shape, k, pad, dil in [LAYERS[i] for i in args.layers] if args.layers else LAYERS:
            x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype_name))
            w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=x.dtype)
            geom = conv_geometry(x, w, None, 1, pad, dil)
            g = torch.randn(geom.output_shape, device="cuda", dtype=x.dtype)
            xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
            out = F.conv2d(xr, wr, None, 1, pad, dil, groups=shape[1])
            ref_x, ref_w = torch.autograd.grad(out, (xr, wr), g, retain_graph=True)
            cudnn = time_ms(lambda: torch.autograd.grad(out, (xr, wr), g, retain_graph=True))
            bytes_moved = (2 * x.numel() + g.numel()) * x.element_size()
            label = f"{dtype_name:8s} {str(shape):20s} k{k} p{pad} d{dil}"
            runs = [("rows (default)", None, None)] + [
                ("pixels " + "x".join(map(str, b)), ForwardConfig("nchw_pixels", b[0], b[1], b[2]),
                 b[3] if len(b) > 3 else None) for b in args.pixels]
            for name, config, run_count in runs:
                def fused(c=config, r=run_count):
                    return conv_grad_input_and_weight(g, x, w, geom, c, r)
                got_x, got_w = fused()
                ms = time_ms(fused)
                print(f"{label} {name:20s}: {ms:.3f} ms ({bytes_moved / ms / 1e6:.0f} GB/s), cuDNN backward "
                      f"{cudnn:.3f} ms, x{cudnn / ms:.2f}; rel err grad_input {rel_err(got_x, ref_x):.1e}, "
                      f"grad_weight {rel_err(got_w, ref_w):.1e}", flush=True)


if __name__ == "__main__":
    main()
