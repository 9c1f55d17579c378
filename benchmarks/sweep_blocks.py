"""Developer sweep (GPU): a fused model's depthwise blocks in eval mode at the model's batch, each on
tiles of other shapes beside the dispatcher's choice, against a device copy measured in the run.

    python benchmarks/sweep_blocks.py --model mobilenet_v2 [--batch 256] [--top 6] [--csv FILE]

The layers: the model's depthwise convolutions at 224 x 224 (`--image`; hooks on torchvision's or timm's
model), with the fused model's activations (the input's BatchNorm and activation applied as it
loads where the layer before is linked, the output's in the epilogue: what `dwconv::conv2d_block`
launches), bfloat16 channels_last; the `--top` largest by bytes moved (input and output). The
variants: the dispatcher's config and, one at a time, its channels (block_c), warps, tile rows
(block_h) or columns (block_w) halved or doubled. Every variant compiles first, in parallel worker
processes, within --compile-s seconds together (`benchmarks/device_triton_cache.py --sweep-blocks`
compiles them on the CPU machine beforehand, into the cache a device call carries); then each is
checked against PyTorch's computation of the block in float32 on two images (its output poisoned
with NaN first) and timed (dwconv.bench.Timer: the L2 flushed between calls).
"""

import argparse
import concurrent.futures
import copy
import csv
import multiprocessing
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from dwconv.kernels.batch_norm import EvalNorm  # noqa: E402

DEVICE = "cuda"


def model_layers(name: str, image: int = 224):
    """[(module name, input shape at batch 1, stride, padding, dilation, kernel, activation code,
    input normalized)] of the model's depthwise layers, as the fused model in eval mode computes them."""
    import dwconv
    from dwconv import fuse
    from dwconv.bench_models import build_model

    stock = build_model(name).eval()
    shapes = {}

    def record(name):
        def hook(module, args, out):
            shapes.setdefault(name, tuple(args[0].shape))  # (returns None: the output stays the module's)
        return hook

    handles = [module.register_forward_hook(record(module_name)) for module_name, module in stock.named_modules()
               if isinstance(module, torch.nn.Conv2d) and module.groups == module.in_channels > 1]
    with torch.no_grad():
        stock(torch.randn(1, 3, image, image))
    for handle in handles:  # (a hooked module is never fused)
        handle.remove()
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, verbose=False, precompile=False).eval()
    layers = []
    for module_name, shape in shapes.items():
        conv = fused.get_submodule(module_name)
        if not isinstance(conv, fuse.FusedDepthwiseConv2d):
            continue
        link = fuse._input_link(conv)
        layers.append((module_name, shape, conv.stride, conv.padding, conv.dilation, conv.kernel_size,
                       fuse._op_activation_code(conv, link), link is not None))
    return layers


def block_tensors(shape, kernel, input_norm: bool, device: str, seed: int = 0):
    """Input (bfloat16 channels_last), weight, bias, and the input's scale and shift (or None); on the
    CPU (device_triton_cache's compiles, which launch nothing) left unwritten."""
    if device == "cpu":
        x = torch.empty(shape, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        channels = shape[1]
        norm = EvalNorm(*(torch.empty(channels) for _ in range(4)), 1e-5) if input_norm else None
        return x, torch.empty(channels, 1, *kernel, dtype=torch.bfloat16), torch.empty(channels, dtype=torch.bfloat16), norm
    gen = torch.Generator(device=device).manual_seed(seed)
    channels = shape[1]
    x = torch.randn(shape, device=device, generator=gen).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(channels, 1, *kernel, device=device, generator=gen) / kernel[0]).to(torch.bfloat16)
    bias = torch.randn(channels, device=device, generator=gen).to(torch.bfloat16)
    norm = None
    if input_norm:  # (scales 0.5 to 1.5, shifts about 0.1)
        var = torch.rand(channels, device=device, generator=gen) + 0.5
        norm = EvalNorm((0.5 + torch.rand(channels, device=device, generator=gen)) * var.sqrt(),
                        0.1 * torch.randn(channels, device=device, generator=gen),
                        torch.zeros(channels, device=device), var, 0.0)
    return x, weight, bias, norm


def reference(x, weight, bias, norm, geom, code):
    """PyTorch's block in float32: the input's scale and shift and activation, the convolution, the
    output's activation."""
    import torch.nn.functional as F

    from dwconv._geometry import ACTIVATION_FUNCTIONS, INPUT_FUNCTIONS, split_activation_code
    from dwconv._library import ACTIVATION_NAMES

    input_code, output_code = split_activation_code(code)
    x = x.float()
    if norm is not None:  # (F.batch_norm in eval mode)
        x = F.batch_norm(x, norm.mean, norm.var, norm.weight, norm.bias, False, 0.0, norm.eps)
    x = INPUT_FUNCTIONS[input_code](x) if input_code else x
    x = F.pad(x, (geom.pad_left, geom.pad_right, geom.pad_top, geom.pad_bottom))  # (any, also uneven, padding)
    out = F.conv2d(x, weight.float(), bias.float(), (geom.stride_h, geom.stride_w), 0,
                   (geom.dilation_h, geom.dilation_w), groups=geom.in_channels)
    return ACTIVATION_FUNCTIONS[ACTIVATION_NAMES[output_code]](out)


def variants(default):
    """The dispatcher's config, then each of its blocks halved or doubled alone."""
    out = [default]
    for field, low, high in (("block_c", 8, 256), ("num_warps", 1, 8), ("block_h", 1, 16), ("block_w", 1, 32)):
        value = getattr(default, field)
        for changed in (value // 2, value * 2):
            if low <= changed <= high and changed != value:
                out.append(replace(default, **{field: changed}))
    return out


def _compile(task) -> str:
    """(in a worker) one variant's launch on the layer's input: its kernel compiles into the disk cache
    (at the timed batch: Triton specialises integer arguments by their divisibility by 16)."""
    shape, stride, padding, dilation, kernel, code, input_norm, config = task
    try:
        from dwconv._geometry import conv_geometry
        from dwconv.dispatch import conv_forward

        x, weight, bias, norm = block_tensors(shape, kernel, input_norm, DEVICE)
        geom = conv_geometry(x, weight, bias, stride, padding, dilation)
        conv_forward(x, weight, bias, geom, config, activation=code, input_norm=norm)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return ""
    except Exception as error:  # (a variant that does not compile is reported, not fatal)
        return f"{type(error).__name__}: {str(error)[:200]}"


def sweep_layers(model: str, batch: int, image: int, top: int) -> list:
    """[(bytes moved, layer (model_layers' tuple), input shape at the batch, geometry)] of the model's
    top distinct depthwise layers by bytes moved (input and output, bfloat16)."""
    from dwconv._geometry import conv_geometry

    layers, seen = [], set()
    for layer in model_layers(model, image):
        key = layer[1:]
        if key not in seen:
            seen.add(key)
            shape = (batch,) + layer[1][1:]
            x = torch.empty(shape, dtype=torch.bfloat16, device="meta").contiguous(memory_format=torch.channels_last)
            geom = conv_geometry(x, torch.empty(shape[1], 1, *layer[5], dtype=torch.bfloat16, device="meta"), None,
                                 *layer[2:5])
            nbytes = 2 * (x.numel() + batch * geom.out_channels * geom.out_h * geom.out_w)
            layers.append((nbytes, layer, shape, geom))
    return sorted(layers, key=lambda entry: -entry[0])[:top]


def compile_tasks(layers, device: str) -> list:
    """_compile's tasks: each layer's variants (the dispatcher's config as it chooses on device)."""
    from dwconv.dispatch import forward_config

    tasks = []
    for nbytes, layer, shape, geom in layers:
        x = torch.empty(shape, dtype=torch.bfloat16, device=device).contiguous(memory_format=torch.channels_last)
        for config in variants(forward_config(geom, x)):
            tasks.append((shape, *layer[2:6], layer[6], layer[7], config))
    return tasks


def compile_all(tasks, workers: int, seconds: float) -> dict:
    """{(shape, config): why} of the tasks that did not compile within seconds (all of them together),
    compiled in parallel worker processes, each reported as it ends (a run cut by its time limit
    still says which compiled and how long each took)."""
    import time

    started, failed = time.time(), {}
    if workers <= 1:
        for task in tasks:
            error = _compile(task)
            if error:
                failed[task[0], task[-1]] = error
        return failed
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    futures = {pool.submit(_compile, task): task for task in tasks}
    try:
        for future in concurrent.futures.as_completed(futures, timeout=seconds):
            task, error = futures[future], future.result()
            print(f"  compiled in {time.time() - started:5.0f} s: {task[0]} {task[-1]}{' ' + error if error else ''}",
                  flush=True)
            if error:
                failed[task[0], task[-1]] = error
    except concurrent.futures.TimeoutError:
        for future, task in futures.items():
            if not future.done():
                failed[task[0], task[-1]] = f"not compiled within {seconds:.0f} s"
        for process in list(getattr(pool, "_processes", {}).values()):  # (a compile does not stop on cancel)
            process.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    return failed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mobilenet_v2")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--top", type=int, default=6, help="the layers moving the most bytes (distinct shapes)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                        help="processes compiling the variants first (1: none, each compiles at its first call)")
    parser.add_argument("--compile-s", type=float, default=240,
                        help="the compiles' time together; a variant not compiled by then is skipped")
    parser.add_argument("--csv")
    args = parser.parse_args()
    from dwconv._geometry import split_activation_code
    from dwconv._library import ACTIVATION_NAMES
    from dwconv.bench import Timer, measure_copy
    from dwconv.dispatch import conv_forward, forward_config

    layers = sweep_layers(args.model, args.batch, args.image, args.top)
    failed = compile_all(compile_tasks(layers, DEVICE), args.workers, args.compile_s)
    timer = Timer(warmup=3, iters=args.iters)
    copy_gbps = measure_copy(timer)
    print(f"{args.model} batch {args.batch}, bfloat16 channels_last; device copy {copy_gbps:.0f} GB/s", flush=True)
    rows = []
    for nbytes, layer, shape, geom in layers:
        x, weight, bias, norm = block_tensors(shape, layer[5], layer[7], DEVICE)
        code = layer[6]
        ref = reference(x[:2], weight, bias, norm, geom, code)
        default = forward_config(geom, x)
        input_code, output_code = split_activation_code(code)
        print(f"{layer[0]} {shape} k{layer[5][0]} s{layer[2][0]}: input "
              f"{'normalized, ' if layer[7] else ''}{ACTIVATION_NAMES[input_code]}, output "
              f"{ACTIVATION_NAMES[output_code]}; {nbytes / 1e9:.3f} GB", flush=True)
        for config in variants(default):
            if (shape, config) in failed:
                print(f"    {config}: does not compile: {failed[shape, config]}", flush=True)
                continue
            out = torch.full(geom.output_shape, float("nan"), device=DEVICE, dtype=x.dtype).contiguous(
                memory_format=torch.channels_last)
            conv_forward(x, weight, bias, geom, config, out=out, activation=code, input_norm=norm)
            error = ((out[:2].float() - ref).abs().max() / ref.abs().max()).item()
            if not error <= 2e-2:
                print(f"    {config}: WRONG, relative error {error:.3g}", flush=True)
                continue
            ms = statistics.fmean(timer(lambda: conv_forward(x, weight, bias, geom, config, out=out, activation=code,
                                                             input_norm=norm)))
            pct = 100 * nbytes / ms / 1e6 / copy_gbps
            print(f"    {ms:8.4f} ms {pct:5.1f}% copy{'  (the dispatcher)' if config == default else ''}  {config}",
                  flush=True)
            rows.append(dict(model=args.model, layer=layer[0], shape="x".join(map(str, shape)), kernel=layer[5][0],
                             stride=layer[2][0], code=code, input_norm=layer[7], config=config.kernel,
                             block_h=config.block_h, block_w=config.block_w, block_c=config.block_c,
                             warps=config.num_warps, ms=ms, pct_copy=pct, dispatcher=config == default))
        del x, out
        torch.cuda.empty_cache()
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
