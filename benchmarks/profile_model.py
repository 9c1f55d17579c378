"""Where a converted model's time goes (GPU only): its depthwise layers one by one, dwconv against
PyTorch at the shapes the model feeds them, and a profiler summary of one training step, stock and
converted, with the host time a step takes to launch against the time it takes to finish.

    python benchmarks/profile_model.py --model mobilenet_v2 [--batch 64] [--precision float32 bf16]
"""

import argparse
import copy
import time
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

import dwconv
from dwconv.bench_models import build_model, training_step


def events_ms(fn, iters=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def depthwise_layers(model, x):
    """(input shape, conv arguments) of every depthwise nn.Conv2d the model runs on x, with counts."""
    seen = Counter()
    hooks = [m.register_forward_hook(lambda m, args, out: seen.update(
        [(tuple(args[0].shape), m.kernel_size, m.stride, m.padding, m.dilation, m.out_channels, m.bias is not None)]))
        for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups == m.in_channels > 1]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def layer_table(layers, dtype, memory_format):
    print(f"\n{'layer (N,C,H,W) k s p':<40} {'n':>2} {'torch fwd':>9} {'dwconv':>8} {'torch f+b':>9} {'dwconv':>8}")
    totals = [0.0] * 4
    for (shape, kernel, stride, padding, dilation, out_c, has_bias), count in sorted(layers.items()):
        x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=memory_format).requires_grad_()
        w = torch.randn(out_c, 1, *kernel, device="cuda", dtype=dtype, requires_grad=True)
        b = torch.randn(out_c, device="cuda", dtype=dtype, requires_grad=True) if has_bias else None
        g = torch.randn_like(F.conv2d(x, w, b, stride, padding, dilation, shape[1]))
        fns = [lambda: F.conv2d(x, w, b, stride, padding, dilation, shape[1]),
               lambda: dwconv.depthwise_conv2d(x, w, b, stride, padding, dilation)]
        fwd = [events_ms(lambda: f().detach()) for f in fns]
        both = [events_ms(lambda: f().backward(g)) for f in fns]
        row = [fwd[0], fwd[1], both[0], both[1]]
        totals = [t + count * r for t, r in zip(totals, row)]
        print(f"{str(shape) + f' k{kernel[0]} s{stride[0]} p{padding[0]}':<40} {count:>2} "
              + " ".join(f"{v:>8.3f}" for v in row))
    print(f"{'sum over the model (ms)':<43} " + " ".join(f"{v:>8.3f}" for v in totals))


def step_profile(name, model, x, y, dtype, memory_format):
    model = copy.deepcopy(model).to(memory_format=memory_format).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    step = training_step(model, x.contiguous(memory_format=memory_format), y, optimizer, dtype)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(20):
        step()
    launched = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(f"\n{name}: host {1e3 * (launched - begin) / 20:.2f} ms a step to launch, "
          f"{1e3 * (done - begin) / 20:.2f} ms a step to finish")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mobilenet_v2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--precision", nargs="+", default=["float32", "bf16"], choices=["float32", "bf16"])
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    stock = build_model(args.model).cuda()
    converted = dwconv.convert(stock, verbose=False)
    x = torch.randn(args.batch, 3, args.image, args.image, device="cuda")
    y = torch.randint(0, 10, (args.batch,), device="cuda")
    layers = depthwise_layers(stock, x)
    for precision in args.precision:
        dtype = torch.bfloat16 if precision == "bf16" else None
        memory_format = torch.channels_last if dtype else torch.contiguous_format
        print(f"\n=== {args.model} batch {args.batch} {precision} {'channels_last' if dtype else 'NCHW'} ===")
        layer_table(layers, dtype or torch.float32, memory_format)
        if not args.no_profile:
            for name, model in (("stock", stock), ("dwconv", converted)):
                step_profile(name, model, x, y, dtype, memory_format)


if __name__ == "__main__":
    main()
