"""Developer tool: a model's trained 1x1 convolutions (each before a BatchNorm that convert(fuse=True)
trains on dwconv's kernels) in a training step's forward and backward, as cuDNN's convolution (stock's)
against the matrix product (`_library.pointwise_product`, cuBLAS), each layer alone, on the GPU.

    python benchmarks/pointwise_ab.py --model mobilenetv4_conv_medium [--batch 256]

bfloat16 autocast, channels_last, cudnn.benchmark as the models bench sets it. Per layer: the GPU's
time of forward + backward (CUDA events around 20 calls, kernels only: a CUDA graph's replay) and the
host's (wall time of issuing 20 calls back to back, the GPU behind, divided by 20). Summed over the
model's layers: what one training step would save or lose.
"""

import argparse
import copy
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dwconv  # noqa: E402
from dwconv._library import pointwise_product  # noqa: E402
from dwconv.bench_models import build_model  # noqa: E402


def layer_inputs(model_name: str, batch: int):
    """(conv, input shape) of each trained 1x1 convolution (the stock model's, found by convert) that
    the model's forward calls."""
    stock = build_model(model_name)
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    names = {name for name, module in fused.named_modules()
             if type(module).__name__ == "FoldingConv2d" and module.kernel_size == (1, 1) and module.groups == 1}
    stock = stock.cuda().to(memory_format=torch.channels_last)
    found = []
    for name, module in stock.named_modules():
        if name in names:
            module.register_forward_hook(lambda m, args, out: found.append((m, tuple(args[0].shape))))
    x = torch.randn(2, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        stock(x)
    return [(conv, (batch,) + shape[1:]) for conv, shape in found]


def timed(fn, iters=20):
    """(GPU ms a call from a CUDA graph of `iters` calls, host ms a call issuing them eagerly)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    gpu = start.elapsed_time(end) / iters
    torch.cuda._sleep(int(2e8))  # (the GPU busy: the host's issuing is timed alone)
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - began) * 1e3 / iters
    torch.cuda.synchronize()
    return gpu, host


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mobilenetv4_conv_medium")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    rows = []
    for conv, shape in layer_inputs(args.model, args.batch):
        weight = copy.deepcopy(conv.weight)
        bias = None if conv.bias is None else copy.deepcopy(conv.bias)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        out_shape = (shape[0], weight.shape[0], shape[2], shape[3])
        grad = torch.randn(out_shape, device="cuda", dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last)

        def step(compute):
            def run():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = compute(x, weight, bias)
                torch.autograd.backward(out, grad, inputs=[x, weight] + ([bias] if bias is not None else []))
            return run

        stock = timed(step(lambda x, w, b: F.conv2d(x, w, b)))
        product = timed(step(pointwise_product))
        x.grad = weight.grad = None
        rows.append((shape, weight.shape[0], stock, product))
        print(f"{str(shape):>22} -> {weight.shape[0]:>4}: GPU cuDNN {stock[0]:.3f} product {product[0]:.3f} ms"
              f" ({stock[0] / product[0]:.2f}x); host cuDNN {stock[1] * 1e3:.0f} product {product[1] * 1e3:.0f} us",
              flush=True)
    gpu = [sum(r[i][0] for r in rows) for i in (2, 3)]
    host = [sum(r[i][1] for r in rows) for i in (2, 3)]
    print(f"{args.model} b{args.batch}, {len(rows)} trained 1x1 convolutions, forward + backward, per step: "
          f"GPU cuDNN {gpu[0]:.2f} ms, product {gpu[1]:.2f} ms; host cuDNN {host[0]:.2f} ms, product {host[1]:.2f} ms")


if __name__ == "__main__":
    main()
