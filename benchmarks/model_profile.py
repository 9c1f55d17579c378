"""Where a whole model's step goes, stock against dwconv.convert (its C++ and its Python eager
path), on the GPU: for each, the step's wall time (CUDA events), the host's time to issue one step
(a step queued behind a GPU sleep, so that the host never waits for the GPU), both timed in turns
with the other variants' (the host's speed drifts), with their range; the host's time inside each
kind of layer (forward and backward, module hooks); the GPU kernels' time per step from the
profiler, and the kernels and host operations that take the most, per step.

    python benchmarks/model_profile.py --model mobilenet_v2 [--precision bf16|float32] [--batch 64]
        [--mode train|inference] [--rounds 5] [--fuse] [--out DIR]

--fuse adds the model converted with fuse=True (the depthwise blocks' BatchNorm and activation on
dwconv's kernels) as a fourth variant.

A step whose wall time is near its host time and well above its kernels' time is bound by the host;
near its kernels' time, by the GPU. Tables go to stdout and DIR/profile_MODEL_PRECISION_MODE.txt.
"""

import argparse
import copy
import os
import statistics
import time

import torch
from torch import nn

from dwconv import convert, replay
from dwconv.bench_models import (PRECISIONS, build_model, depthwise_layers, hook_layers, inference,
                                 launched_kernels, native_setting, time_ms, training_step)


def host_ms(fn, repeats: int = 10) -> float:
    """Milliseconds the host takes to issue one step while the GPU is busy with a sleep queued first
    (about 0.1 s, longer than any step here): the host never waits on the GPU, so this is its own
    time. One step a sleep, median of repeats: more steps queued would fill the driver's queue of
    pending launches (about a thousand), and the host would wait on the sleeping GPU. (Without a GPU:
    the step's time.)"""
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e8))
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(times)


def host_by_layer(model: nn.Module, fn, repeats: int = 5) -> dict:
    """The host's milliseconds a step inside each kind of layer (every module without children, by
    class, the depthwise layers, stock or dwconv's, as one kind "depthwise"), forward and backward
    (module hooks; the backward from the gradient reaching a layer's output to its input's), with
    the GPU kept busy as in host_ms; beside the step's own host time with the hooks on. Medians over
    repeats: {"step": ms, (kind, pass): ms}. Where the eager gap to stock sits: in which layers, or
    around them."""
    depthwise = set(depthwise_layers(model))
    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    kinds = {m: "depthwise" if m in depthwise else type(m).__name__ for m in leaves}
    spent: dict = {}
    opened = {}

    def enter(module, pass_):
        opened[(module, pass_)] = time.perf_counter()

    def leave(module, pass_):
        started = opened.pop((module, pass_), None)
        if started is not None:
            key = (kinds[module], pass_)
            spent[key] = spent.get(key, 0.0) + (time.perf_counter() - started) * 1e3

    handles = hook_layers(leaves, enter, leave)
    samples: dict = {}
    try:
        fn()  # (the hooks' own first-call costs)
        for _ in range(repeats):
            spent.clear()
            step = host_ms(fn, repeats=1)
            for key, ms in [("step", step), *spent.items()]:
                samples.setdefault(key, []).append(ms)
    finally:
        for handle in handles:
            handle.remove()
    return {key: statistics.median(values + [0.0] * (repeats - len(values))) for key, values in samples.items()}


def profile(fn, steps: int = 5):
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels, host_ops = {}, {}
    for name, duration in launched_kernels(prof.events()):
        count, total = kernels.get(name, (0, 0.0))
        kernels[name] = (count + 1, total + duration)
    for event in prof.events():
        if event.device_type.name != "CPU":
            continue
        count, total = host_ops.get(event.name, (0, 0.0))
        host_ops[event.name] = (count + 1, total + event.self_cpu_time_total)
    per_step = lambda table: sorted(((name, count / steps, total / steps / 1e3) for name, (count, total)
                                     in table.items()), key=lambda row: -row[2])
    return per_step(kernels), per_step(host_ops)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mobilenet_v2")
    parser.add_argument("--precision", default="bf16", choices=sorted(PRECISIONS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--mode", default="train", choices=["train", "inference"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=5, help="turns over the variants, for wall and host times")
    parser.add_argument("--fuse", action="store_true", help="also the model converted with fuse=True")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    dtype, memory_format = PRECISIONS[args.precision]
    torch.manual_seed(0)
    stock = build_model(args.model).cuda().to(memory_format=memory_format)
    x = torch.randn(args.batch, 3, args.image, args.image, device="cuda").contiguous(memory_format=memory_format)
    y = torch.randint(0, 10, (args.batch,), device="cuda")
    lines = []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    native = replay.prepare()
    converted = convert(copy.deepcopy(stock), verbose=False)
    variants = [("stock", stock, None), ("dwconv, C++ replayer", converted, "1" if native else None),
                ("dwconv, Python path", converted, "0")]
    if args.fuse:
        variants.append(("dwconv fused, C++ replayer", convert(copy.deepcopy(stock), fuse=True, verbose=False),
                         "1" if native else None))
    models = {variant: model for variant, model, _ in variants}
    steps = []  # (variant, native setting, fn): warmed first, then timed in turns (the host drifts)
    for variant, model, setting in variants:
        model.train(args.mode == "train")
        if args.mode == "train":
            fn = training_step(model, x, y, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), dtype)
        else:
            fn = inference(model, x, dtype)
        with native_setting(setting):
            time_ms(fn, 10, 1)
        steps.append((variant, setting, fn))
    walls, hosts = {v: [] for v, _, _ in steps}, {v: [] for v, _, _ in steps}
    for _ in range(args.rounds):
        for variant, setting, fn in steps:
            with native_setting(setting):
                walls[variant] += time_ms(fn, 2, 4)
                hosts[variant].append(host_ms(fn, repeats=3))
    inside = {}
    for variant, setting, fn in steps:
        if "fused" in variant:  # (a hook on a block's module makes the block compute unfused)
            inside[variant] = {"error": "a hook on a fused block's module unfuses it"}
            continue
        with native_setting(setting):
            try:
                inside[variant] = host_by_layer(models[variant], fn)
            except RuntimeError as error:  # (full backward hooks refuse an in-place activation's input on
                inside[variant] = {"error": str(error).split(".")[0]}  # some models and torch versions)
    for variant, setting, fn in steps:
        with native_setting(setting):
            kernels, host_ops = profile(fn)
        gpu = sum(ms for _, _, ms in kernels)
        say(f"{args.model} {args.precision} {args.mode} batch {args.batch} {variant}: wall "
            f"{statistics.median(walls[variant]):.3f} ms a step ({min(walls[variant]):.3f}-{max(walls[variant]):.3f}), "
            f"host {statistics.median(hosts[variant]):.3f} ms ({min(hosts[variant]):.3f}-{max(hosts[variant]):.3f}), "
            f"GPU kernels {gpu:.3f} ms ({sum(n for _, n, _ in kernels):.0f} kernels)")
        layers = inside[variant]
        if "error" in layers:
            say(f"  host inside each kind of layer: not measured under module hooks ({layers['error']})")
            layers = {"step": 0.0}
        else:
            say(f"  host inside each kind of layer, ms a step (of {layers['step']:.3f} ms host with the hooks on):")
        for (kind, pass_), ms in sorted(((k, v) for k, v in layers.items() if k != "step"), key=lambda kv: -kv[1]):
            say(f"    {kind + ' ' + pass_:<40} {ms:8.3f}")
        say(f"  {'kernel (per step)':<100} {'count':>6} {'ms':>8}")
        for name, count, ms in kernels[:args.top]:
            say(f"  {name[:100]:<100} {count:6.1f} {ms:8.3f}")
        say(f"  {'host operation, self time (per step)':<100} {'count':>6} {'ms':>8}")
        for name, count, ms in host_ops[:args.top]:
            say(f"  {name[:100]:<100} {count:6.1f} {ms:8.3f}")
        say()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_{args.model}_{args.precision}_{args.mode}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
