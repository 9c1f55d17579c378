"""Developer probe (GPU): the channels_last <-> NCHW copies of the large-kernel paths (ops/layout.py's
batched transposes) against PyTorch's copies, on the large suite's layers; CUDA-graph replays.

    PYTHONPATH=src python benchmarks/probe_layout.py [--dtype bfloat16 float32]
"""

import argparse

import torch

from dwconv.bench import graphed
from dwconv.ops import layout
from profile_model import events_ms  # (benchmarks/ is on the path when run as a script)

SHAPES = [(32, 128, 56, 56), (32, 256, 28, 28), (64, 96, 56, 56)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    args = p.parse_args()
    src = torch.empty(2**28, device="cuda")
    copy_gbps = 2 * src.numel() * 4 / events_ms(graphed(lambda: src.clone())) / 1e6
    print(f"copy {copy_gbps:.0f} GB/s")
    for dtype_name in args.dtype:
        for shape in SHAPES:
            x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype_name))
            x_cl = x.contiguous(memory_format=torch.channels_last)
            out_cl = torch.empty_like(x_cl)
            assert torch.equal(layout.nchw_copy(x_cl), x)
            layout.copy_into(out_cl, x)
            assert torch.equal(out_cl, x)
            nbytes = 2 * x.numel() * x.element_size()
            for name, fn in [("torch CL->NCHW", lambda: x_cl.contiguous()),
                             ("dwconv CL->NCHW", lambda: layout.nchw_copy(x_cl)),
                             ("torch NCHW->CL", lambda: out_cl.copy_(x)),
                             ("dwconv NCHW->CL", lambda: layout.copy_into(out_cl, x))]:
                ms = events_ms(graphed(fn))
                print(f"{dtype_name:8s} {str(shape):18s} {name:16s} {ms * 1000:7.1f} us "
                      f"({100 * nbytes / ms / 1e6 / copy_gbps:.0f}% of copy)", flush=True)


if __name__ == "__main__":
    main()
