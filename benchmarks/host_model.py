"""Developer tool: the host's time of one eager eval forward of a whole model, stock and converted
with fuse=True, and where the fused one's Python goes (cProfile, by function). At batch 256 a fused
model's GPU time is well under stock's (its CUDA-graph replay), so its eager forward is as fast as
its host: this says how much host time a forward takes and which functions hold it.

    python benchmarks/host_model.py --cuda --model mobilenet_v2 [--batch 256]   # on a GPU
    python benchmarks/host_model.py --model mobilenet_v2                        # no GPU
    python benchmarks/host_model.py [--cuda] --train ...                         # a training step

With --cuda every call is real, timed while the GPU sleeps on a queued wait (one call a round: a
whole model's forward launches a few hundred kernels, and once the driver's queue of about a
thousand pending launches is full the next launch waits for the GPU, which four forwards of stock
MobileNetV2 or of a fused EfficientNet-B0 reached). Without it the input is
1x3x32x32 on the CPU and dwconv's launches are stubbed (they return preallocated outputs), so the
fused forward's time is its Python and PyTorch's CPU ops; stock's includes its CPU kernels.
--train times a training step instead (forward, backward of the output's sum; no optimizer). A step
launches more kernels than the driver's queue holds (EfficientNet-B0: about 1400), so on a GPU it
is timed without the queued sleep, at a batch small enough (--batch, default 16 with --train) that
the GPU keeps ahead of the host: the steps' wall time, three a round and the GPU drained after them,
is the host's (with the GPU's kernel time of one step, from torch.profiler after every other
measurement, printed at the end to show it is).
Prints ms a call (best and median of the rounds), then the profile's top functions. --after profile
compile: times again after torch.profiler has run in the process (CUPTI then stays attached), then
after both models were compiled and run (does a compiled model slow the eager calls beside it?).
"""

import argparse
import copy
import cProfile
import os
import pstats
import statistics
import sys
import time

CUDA = "--cuda" in sys.argv
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["DWCONV_NATIVE"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

import dwconv  # noqa: E402
from dwconv import _library, block_replay, fuse, functional, replay  # noqa: E402
from dwconv.bench_models import build_model  # noqa: E402
from dwconv.kernels import _launch, batch_norm as batch_norm_kernels  # noqa: E402


def stub_launches() -> None:
    """dwconv's launches answer at once with a preallocated output (the CPU: its Python alone)."""
    outputs = {}

    def conv_forward(input, weight, bias, geometry, *args, **kwargs):
        key = (tuple(geometry.output_shape), input.dtype)
        if key not in outputs:
            outputs[key] = torch.empty(key[0], dtype=input.dtype).contiguous(memory_format=torch.channels_last)
        return outputs[key]

    replay.native.has_known_layers = lambda: False
    _library.conv_forward = conv_forward
    fuse.replayed = lambda fn, inputs, *args, **kwargs: fn(*inputs, *args)
    batch_norm_kernels.launch = lambda *args: None
    _launch.launch_now = lambda *args, **kwargs: None


# rounds whose calls outlasted the queued sleep: their time is not the host's alone (a step whose
# launches fill the driver's queue waits on the sleeping GPU; a whole training step can)
WAITED = set()


def call_ms(call, forwards: int, rounds: int, name: str = "", queued_sleep: bool = True) -> list:
    """ms a call in each round (`forwards` calls a round, behind a queued sleep on a GPU; without
    queued_sleep, the GPU drained before the round ends: the wall time)."""
    times = []
    for _ in range(rounds):
        if CUDA:
            torch.cuda.synchronize()
            if queued_sleep:
                torch.cuda._sleep(int(4e8))
            slept = torch.cuda.Event()
            slept.record()
        started = time.perf_counter()
        for _ in range(forwards):
            call()
        if CUDA and not queued_sleep:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) / forwards * 1e3)
        if CUDA and queued_sleep and slept.query():
            WAITED.add(name)
    if CUDA:
        torch.cuda.synchronize()
    return times


def kernel_ms(call) -> float:
    """The GPU's kernel time of one call: the sum of its kernels' durations (torch.profiler; CUPTI
    then stays attached to the process, pytorch/pytorch#144455, so this runs after all timing)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def print_block_ops(fused, forward) -> None:
    """Each fused block's op call (fuse._block_op, where its inverted-residual block is not one
    replayed program) and each replayed block's call (block_replay.ReplayedBlock) in one eval forward
    behind a queued sleep: ms of host time, the layer or block and its input's shape, slowest first."""
    calls, blocks = [], []
    block_op, block_forward = fuse._block_op, block_replay.ReplayedBlock.forward

    def timed(conv, norm, link, input, tensors):
        started = time.perf_counter()
        out = block_op(conv, norm, link, input, tensors)
        calls.append(((time.perf_counter() - started) * 1e3, conv, tuple(input.shape), link is not None))
        return out

    def timed_block(module, input):
        started = time.perf_counter()
        out = block_forward(module, input)
        blocks.append(((time.perf_counter() - started) * 1e3, type(module).__name__, tuple(input.shape)))
        return out

    fuse._block_op, block_replay.ReplayedBlock.forward = timed, timed_block
    try:
        forward()  # (a first call with the wrapper: nothing timed is new to the caches)
        calls.clear(), blocks.clear()
        if CUDA:
            torch.cuda.synchronize()
            torch.cuda._sleep(int(4e8))
        forward()
        if CUDA:
            torch.cuda.synchronize()
    finally:
        fuse._block_op, block_replay.ReplayedBlock.forward = block_op, block_forward
    print(f"\nthe replayed blocks' calls in one eval forward, {sum(ms for ms, *_ in blocks):.3f} ms in all, "
          "slowest first (ms of host time):")
    for ms, name, shape in sorted(blocks, key=lambda c: -c[0]):
        print(f"  {ms:8.3f}  {name:<36} input {shape}")
    print("\nthe fused blocks' op calls outside them, slowest first (ms of host time):")
    for ms, conv, shape, linked in sorted(calls, key=lambda c: -c[0]):
        print(f"  {ms:8.3f}  {conv.kernel_size} stride {conv.stride} {conv.dwconv_activation:<10} "
              f"input {shape}{', input normalized' if linked else ''}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--model", default="mobilenet_v2")
    parser.add_argument("--batch", type=int, default=None, help="default 256, 16 with --train")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--train", action="store_true", help="a training step instead of an eval forward")
    parser.add_argument("--after", nargs="*", default=[], choices=("profile", "compile"),
                        help="then, in turn, run torch.profiler over one call of each model, or compile both "
                             "(torch.compile, default mode) and run them, and time the eager calls again after each")
    parser.add_argument("--block-ops", action="store_true",
                        help="then the host time of each fused block's op call in one eval forward, slowest first "
                             "(one that waits on the GPU stands out by the queued wait's length)")
    parser.add_argument("--rows", type=int, default=30, help="functions of the profile shown")
    args = parser.parse_args()
    args.batch = args.batch or (16 if args.train else 256)
    device = "cuda" if CUDA else "cpu"
    torch.backends.cudnn.benchmark = True  # (as conv nets run, and as bench_models times them)
    if CUDA:
        replay.prepare()
    else:
        stub_launches()
    stock = build_model(args.model).to(device).train(args.train).to(memory_format=torch.channels_last)
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, verbose=False, precompile=CUDA)
    shape = (args.batch, 3, 224, 224) if CUDA else (2, 3, 32, 32)
    x = torch.randn(shape, device=device).contiguous(memory_format=torch.channels_last)
    # (a GPU round stays under the driver's queue of about a thousand pending launches; a training
    # step, which does not, is timed without the queued sleep)
    calls = (3 if args.train else 1) if CUDA else (4 if args.train else 20)
    queued_sleep = not args.train
    what = "training step" if args.train else "eval forward"

    def call_of(model):
        def step():
            with torch.autocast(device, dtype=torch.bfloat16):
                out = model(x)
            out.float().sum().backward()

        def forward():
            with torch.autocast(device, dtype=torch.bfloat16):
                model(x)
        return step if args.train else forward

    with torch.set_grad_enabled(args.train):
        for _ in range(3):  # (warm-up)
            for model in (stock, fused):
                call_ms(call_of(model), 2, 1)
        for when in [""] + args.after:
            if when == "profile":  # (CUPTI stays attached after a profile: pytorch/pytorch#144455)
                with torch.profiler.profile():
                    for model in (stock, fused):
                        call_of(model)()
            elif when == "compile":
                for model in (stock, fused):
                    compiled = call_of(torch.compile(model))
                    for _ in range(3):
                        compiled()
            when = f" after {' and '.join(args.after[:args.after.index(when) + 1])}" if when else ""
            times = {"stock": [], "fused": []}
            for _ in range(3):  # (turns: the host drifts)
                for name, model in (("stock", stock), ("fused", fused)):
                    times[name] += call_ms(call_of(model), calls, max(1, args.rounds // 3), name, queued_sleep)
            for name, ms in times.items():
                print(f"{args.model} b{shape[0]} {name:<6} {what} host time{when}: best {min(ms):.3f} ms, "
                      f"median {statistics.median(ms):.3f} ms ({len(ms)} rounds of {calls})"
                      + ("; NOT the host's alone: a round outlasted the queued GPU sleep" if name in WAITED else ""))
            WAITED.clear()
        profile = cProfile.Profile()
        if CUDA:
            torch.cuda.synchronize()
            if queued_sleep:
                torch.cuda._sleep(int(4e8))
        fused_call = call_of(fused)
        profile.enable()
        for _ in range(calls):
            fused_call()
        profile.disable()
        if CUDA:
            torch.cuda.synchronize()
        if CUDA and not queued_sleep:  # (the wall time above is the host's where the GPU's is below it)
            print(f"{args.model} b{shape[0]} the GPU's kernel time of one {what}: "
                  + ", ".join(f"{name} {kernel_ms(call_of(model)):.3f} ms" for name, model in
                              (("stock", stock), ("fused", fused))))
    if args.block_ops and not args.train:
        with torch.no_grad():
            print_block_ops(fused, call_of(fused))
    print(f"\nthe fused {what}'s Python, {calls} calls (cProfile adds its own time to every call):")
    stats = pstats.Stats(profile, stream=sys.stdout)
    print_by_file(stats, calls)
    stats.sort_stats("tottime").print_stats(args.rows)


def print_by_file(stats: pstats.Stats, calls: int) -> None:
    """Own time a call by source file (built-in methods by name), largest first: how much is
    dwconv.fuse's checks, how much the modules' calls (torch.nn's _call_impl), the ops themselves."""
    totals = {}
    for (path, _, function), (_, _, own, _, _) in stats.stats.items():
        where = function if path == "~" else os.path.relpath(path, os.path.dirname(os.path.dirname(path)))
        totals[where] = totals.get(where, 0.0) + own
    print("own time a call by file, ms:")
    for where, own in sorted(totals.items(), key=lambda item: -item[1])[:12]:
        print(f"  {own / calls * 1e3:8.3f}  {where}")


if __name__ == "__main__":
    main()
