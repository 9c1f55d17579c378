"""Developer probe (GPU): the backward of channels_last tensors (grad_input + grad_weight, no bias),
as two kernels (conv_grad_weight's choice: since session 9 the unrolled pixels up to 7x7, then
grad_input on the forward's kernel) against the fused pass (depthwise_grad_nhwc_pixels_kernel with
GRAD_INPUT) and cuDNN on channels_last tensors,
on #84 and issue #4's stride-1 layers. Gradients checked against cuDNN's (float32 math) first.
--fused BLOCK_H BLOCK_W BLOCK_C WARPS [RUNS]: more fused blocks (the default's come first; RUNS:
programs a column of tiles, across the images).
Bytes counted: grad_out and x read, grad_input written (the floor of either path).

    PYTHONPATH=src python benchmarks/probe_nhwc_backward.py [--fused BH BW BC WARPS [RUNS]]... [--layers 0 1]
"""

import argparse

import torch
import torch.nn.functional as F

from dwconv.ops.backward import conv_grad_input, conv_grad_input_and_weight_nhwc, conv_grad_weight
from dwconv.ops.forward import ForwardConfig
from probe_nhwc import channels_last_layers, copy_rate  # (benchmarks/ is on the path as a script)
from profile_model import events_ms as time_ms



def rel_err(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def compare_backward(label, x, w, g, pad, dil, runs):
    """Each run (name, fn returning grad_input and grad_weight): its gradients against cuDNN's on
    the same tensors (float32 math), its time beside cuDNN's backward, a line each."""
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = F.conv2d(xr, wr, None, 1, pad, dil, groups=x.shape[1])
    ref_x, ref_w = torch.autograd.grad(out, (xr, wr), g, retain_graph=True)
    cudnn = time_ms(lambda: torch.autograd.grad(out, (xr, wr), g, retain_graph=True))
    bytes_moved = (2 * x.numel() + g.numel()) * x.element_size()
    for name, fn in runs:
        got_x, got_w = fn()
        ms = time_ms(fn)
        print(f"{label} {name:22s}: {ms:.3f} ms ({bytes_moved / ms / 1e6:.0f} GB/s), cuDNN backward "
              f"{cudnn:.3f} ms, x{cudnn / ms:.2f}; rel err grad_input {rel_err(got_x, ref_x):.1e} "
              f"(cuDNN's own rounding included), grad_weight {rel_err(got_w, ref_w):.1e}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fused", nargs="+", type=int, action="append", metavar="N",
                   help="BLOCK_H BLOCK_W BLOCK_C WARPS [RUNS]")
    p.add_argument("--layers", type=int, nargs="+", help="indices into probe_nhwc.LAYERS (default: all)")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    args = p.parse_args()
    print(f"copy {copy_rate():.0f} GB/s", flush=True)
    for dtype_name, shape, k, pad, dil, x, w, geom in channels_last_layers(args.dtype, args.layers):
        g = torch.randn(geom.output_shape, device="cuda", dtype=x.dtype).contiguous(memory_format=torch.channels_last)

        def two_kernels():
            return conv_grad_input(g, w, geom, x), conv_grad_weight(g, x, geom, w.dtype, False)[0]

        runs = [("two kernels", two_kernels)]
        for blocks in [None] + (args.fused or []):
            config = blocks and ForwardConfig("nhwc_pixels", blocks[0], blocks[1], blocks[3], block_c=blocks[2])
            run_count = blocks[4] if blocks and len(blocks) > 4 else None
            name = "fused " + ("default" if blocks is None else "x".join(map(str, blocks)))
            runs.append((name, lambda c=config, r=run_count: conv_grad_input_and_weight_nhwc(g, x, w, geom, c, r)))
        compare_backward(f"{dtype_name:8s} {str(shape):20s} k{k} p{pad} d{dil} CL", x, w, g, pad, dil, runs)


if __name__ == "__main__":
    main()
