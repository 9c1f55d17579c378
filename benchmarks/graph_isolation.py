"""Which captured CUDA graph faults, and after which other capture (GPU only).

`bench --model convnext_tiny` (bfloat16 autocast, channels_last, batch 64) faults on the H200
(torch 2.11, triton 3.6): the stock model's training step, captured whole in a CUDA graph, gives an
illegal memory access (or a segmentation fault in the host's graph launch) at its next replay once a
graph of the converted model has been captured after it, be it the converted model's training step
or its inference, its layers run by the C++ replayer or the Python path, with or without the
first-call warmup. Stock graphs alone (training step, then inference) replay fine, as do the
converted model's graphs without a stock one, and eager steps of either model between replays.

Each variant below runs in a process of its own (a fault ends the CUDA context): it builds the
models, warms each up eagerly (compiles, cuDNN's benchmark), captures graphs in the order given
(bench_models.graphed: as `bench --model` does) and replays every one, synchronising after each,
and prints one line: `variant: ok` or `variant: fault at replay of NAME: ERROR`.

    python benchmarks/graph_isolation.py [--model convnext_tiny] [--batch 64] [VARIANT ...]
    python benchmarks/graph_isolation.py --one VARIANT   # (one variant in this process)

A variant is a list of captures (or, with eager_only, of passes run eagerly), each `MODEL:PASS`: MODEL stock, dwconv (the converted model),
stock_nodrop (stochastic depth and dropout off), layer (one depthwise layer of the model's first
shape, dwconv's forward alone), triton (a copy kernel of Triton's, no dwconv); PASS train or infer.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import triton
import triton.language as tl

# name: (captures in order, options: "env" set in the variant's process, "cudnn_benchmark",
# "clear_in_backward": cuBLAS's workspaces also dropped on the autograd engine's thread before
# each capture (the backward's matrix products run there, with workspaces of that thread's own)
VARIANTS = {
    # (known: faults) the stock step, then the converted model's inference
    "stock_then_dwconv": (["stock:train", "dwconv:infer"], {}),
    # no graph: the converted model's passes eagerly (under compute-sanitizer: any access of dwconv's
    # kernels out of their tensors' bounds at the model's sizes)
    "dwconv_eager": (["dwconv:train", "dwconv:infer"], {"eager_only": True}),
    # the stock inference first (no backward: none of the autograd thread's matrix products)
    "stock_infer_then_dwconv": (["stock:infer", "dwconv:infer"], {}),
    # three stock captures: is a third capture enough, dwconv or not?
    "stock_three": (["stock:train", "stock:infer", "stock:infer"], {}),
    # a Triton kernel that is not dwconv's, captured after the stock step
    "stock_then_triton": (["stock:train", "triton:infer"], {}),
    # one dwconv layer's forward alone, captured after the stock step
    "stock_then_layer": (["stock:train", "layer:infer"], {}),
    # without stochastic depth and dropout (the graph's random-number state)
    "nodrop_then_dwconv": (["stock_nodrop:train", "dwconv:infer"], {}),
    # the other order: the converted model's step first
    "dwconv_then_stock": (["dwconv:train", "stock:infer"], {}),
    # cuDNN's benchmark mode off
    "stock_then_dwconv_nobenchmark": (["stock:train", "dwconv:infer"], {"cudnn_benchmark": False}),
    # no cuBLAS workspaces at all (pytorch/pytorch#193402: graphs faulting on a freed workspace)
    "stock_then_dwconv_noworkspace": (["stock:train", "dwconv:infer"],
                                      {"env": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}}),
    # the workspaces of the autograd thread dropped too before each capture
    "stock_then_dwconv_clear_in_backward": (["stock:train", "dwconv:infer"], {"clear_in_backward": True}),
}


@triton.jit
def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n), mask=offsets < n)


def run_variant(name: str, model_name: str, batch: int) -> str:
    import torch
    import torch.nn as nn

    import dwconv
    from dwconv import bench_models as bm

    captures, options = VARIANTS[name]
    torch.backends.cudnn.benchmark = options.get("cudnn_benchmark", True)
    torch.manual_seed(0)
    stock = bm.build_model(model_name).cuda().to(memory_format=torch.channels_last)
    converted = dwconv.convert(stock, verbose=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, device="cuda", generator=gen).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device="cuda", generator=gen)

    def without_drop(model: nn.Module) -> nn.Module:
        """model with its dropout and stochastic-depth modules replaced by identities (no random numbers)."""
        for parent in list(model.modules()):
            for child_name, child in parent.named_children():
                if isinstance(child, nn.Dropout) or type(child).__name__ in ("StochasticDepth", "DropPath"):
                    setattr(parent, child_name, nn.Identity())
        return model

    def pass_fn(what: str):
        model_kind, step = what.split(":")
        if model_kind == "triton":
            src = torch.randn(1 << 20, device="cuda")
            dst = torch.empty_like(src)
            return lambda: copy_kernel[(src.numel() // 1024,)](src, dst, src.numel(), BLOCK=1024)
        if model_kind == "layer":
            layer = next(m for m in converted.modules() if isinstance(m, dwconv.DepthwiseConv2d))
            layer = copy.deepcopy(layer)
            shape = (batch, layer.in_channels, 56, 56)
            inputs = torch.randn(shape, device="cuda").contiguous(memory_format=torch.channels_last)

            def forward():
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    layer(inputs)
            return forward
        base = {"stock": stock, "dwconv": converted, "stock_nodrop": without_drop(copy.deepcopy(stock))}[model_kind]
        model = copy.deepcopy(base)
        model.train(step == "train")
        if step == "train":
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
            return bm.training_step(model, x, y, optimizer, torch.bfloat16)
        return bm.inference(model, x, torch.bfloat16)

    # (bm.graphed drops cuBLAS's workspaces on this thread before and after each capture: with
    # clear_in_backward, each drop also runs a backward that drops them on the autograd engine's thread)
    clear_here = torch._C._cuda_clearCublasWorkspaces

    class ClearInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            clear_here()
            return grad

    def clear_everywhere():
        clear_here()
        ClearInBackward.apply(torch.ones(1, device="cuda", requires_grad=True)).sum().backward()

    if options.get("clear_in_backward"):
        torch._C._cuda_clearCublasWorkspaces = clear_everywhere

    replays = []
    for what in captures:
        fn = pass_fn(what)
        for _ in range(3):  # (compiles, cuDNN's benchmark)
            fn()
        torch.cuda.synchronize()
        if options.get("eager_only"):
            continue
        replays.append((what, bm.graphed(fn)))
        torch.cuda.synchronize()
    for what, replay in replays:
        try:
            replay()
            torch.cuda.synchronize()
        except Exception as error:
            return f"{name}: fault at replay of {what}: {type(error).__name__}: {str(error).splitlines()[0]}"
    return f"{name}: ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help=f"default: all of {', '.join(VARIANTS)}")
    parser.add_argument("--one", help="run this variant in this process")
    parser.add_argument("--model", default="convnext_tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds a variant may take")
    parser.add_argument("--parallel", type=int, default=1,
                        help="variants run at once (each its own process and CUDA context: a fault stays in its own)")
    args = parser.parse_args()
    if args.one:
        print(run_variant(args.one, args.model, args.batch), flush=True)
        return
    names = args.variants or list(VARIANTS)
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}: one of {', '.join(VARIANTS)}")

    def run_in_process(name: str) -> None:
        started = time.perf_counter()
        command = [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--one", name,
                   "--model", args.model, "--batch", str(args.batch)]
        env = dict(os.environ, **VARIANTS[name][1].get("env", {}))
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
            lines = [line for line in done.stdout.splitlines() if line.startswith(f"{name}: ")]
            result = lines[-1] if lines else f"{name}: process ended ({done.returncode}) with no answer: " \
                                             f"{(done.stderr.strip().splitlines() or [''])[-1][:200]}"
        except subprocess.TimeoutExpired:
            result = f"{name}: no answer within {args.timeout:.0f} s"
        print(f"{result}  ({time.perf_counter() - started:.0f} s)", flush=True)

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(run_in_process, names))


if __name__ == "__main__":
    main()
