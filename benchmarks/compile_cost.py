"""What a cold start compiles (no GPU needed): the kernels of a bench suite's layers compiled for
sm_90 into an empty, temporary Triton cache by dwconv.warmup's worker pool, as a training step
(forward and backward of every tensor) or inference. Prints the calls, the kernel binaries (cache
entries), the pool's wall time, the sum and the longest of the calls' compile times.

    python benchmarks/compile_cost.py --match MobileNetV2 --dtype bfloat16 --layout channels_last --workers 2
    python benchmarks/compile_cost.py --match MobileNetV2 --keys-at 0.857   # what 192 x 192 adds to 224's, and why
    python benchmarks/compile_cost.py --match MobileNetV2 --keys-at-batch 8  # what batch 8 adds to the suite's 64
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--suite", default="models")
    p.add_argument("--match", default="", help="only the layers whose label contains this")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", default="channels_last", choices=["nchw", "channels_last"])
    p.add_argument("--batch", type=int, help="instead of the suite's")
    p.add_argument("--scale", type=float, default=1.0, help="image sizes times this (e.g. 192/224)")
    p.add_argument("--inference", action="store_true", help="forward only")
    p.add_argument("--workers", type=int)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--cache", help="this Triton cache directory instead of an empty temporary one (kernel "
                                   "binaries then counts the new entries: what another batch size adds)")
    p.add_argument("--tune", action="append", default=[], metavar="NAME=VALUE",
                   help="a tuning-table change (dwconv/tuning.py), in this process and the workers")
    p.add_argument("--kernels", action="store_true",
                   help="instead of the pool: each call in this process, one kernel at a time, with its compile time "
                        "and the share of it in the TritonGPU stage (ttgir: its coalescing pass, superlinear in a "
                        "kernel's memory operations, took 87-93%% of a 7x7 pixel tile's: Triton 3.9 and 3.6)")
    p.add_argument("--keys-at", type=float, metavar="SCALE",
                   help="instead of compiling: the kernel binaries (Triton's specialisation keys) that image sizes "
                        "times SCALE add over --scale's, and for each what differs from the same layer's nearest "
                        "key (a size's divisibility by 16, a block, a branch): what a new image size compiles")
    p.add_argument("--keys-at-batch", type=int, metavar="BATCH",
                   help="as --keys-at, for another batch size instead of another image size")
    args = p.parse_args()
    if args.kernels or args.keys_at or args.keys_at_batch:
        os.environ.pop("TRITON_INTERPRET", None)

    import torch

    from dwconv import bench, tuning
    from dwconv.precompile import LayerCall, compile_calls

    tuning.override(**tuning.from_text(",".join(args.tune)))

    def layer_calls(scale, batch=None):
        calls = []
        for case in bench.SUITES[args.suite]:
            if case.dtype != args.dtype or args.match not in case.label:
                continue
            n = batch or args.batch or case.n
            shape = (n, case.c, max(1, round(case.h * scale)), max(1, round(case.w * scale)))
            fmt = torch.channels_last if args.layout == "channels_last" else torch.contiguous_format
            grads = (False, False, False) if args.inference else (True, True, case.bias)
            calls.append((case.label, LayerCall.of(*bench.meta_inputs(case, fmt, shape),
                                                   (case.stride, case.padding, case.dilation), grads)))
        return calls

    if args.keys_at or args.keys_at_batch:
        after, what = ((layer_calls(args.keys_at), f"image sizes x {args.keys_at} add") if args.keys_at else
                       (layer_calls(args.scale, args.keys_at_batch), f"batch {args.keys_at_batch} adds"))
        compare_keys(layer_calls(args.scale), after, args.arch, what)
        return
    calls = [call for _, call in layer_calls(args.scale)]
    if args.kernels:
        compile_one_by_one(calls, args.arch)
        return
    with tempfile.TemporaryDirectory() as temporary:
        cache = args.cache or temporary
        os.makedirs(cache, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = cache
        def binaries_in(cache):  # (warmup's markers are no binaries)
            return len([name for name in os.listdir(cache) if name != "dwconv-warmup"])

        before = binaries_in(cache)
        started = time.perf_counter()
        report = compile_calls(calls, args.arch, args.workers)
        wall = time.perf_counter() - started
        binaries = binaries_in(cache) - before
    for call, seconds in zip(calls, report.call_seconds):
        print(f"{seconds:7.1f} s  {call.tensors[0][0]} k{call.tensors[1][0][2]} stride {call.arguments[0]}")
    print(f"{args.suite} '{args.match}' {args.dtype} {args.layout} {'inference' if args.inference else 'training'}: "
          f"{len(calls)} calls, {binaries} kernel binaries, {wall:.1f} s on {report.workers} processes; "
          f"compiles {sum(report.call_seconds):.1f} s in all, the longest launch {report.longest_launch:.1f} s; "
          f"{len(report.errors)} errors")
    for error in report.errors:
        print(error)


def compile_one_by_one(calls, arch):
    import json

    from dwconv import tuning
    from dwconv._compile_worker import compile_call
    from dwconv._triton_compat import compile_only

    stages = time_backend_stages()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache

        def report(name, compiled, seconds):
            ttgir = stages.pop("make_ttgir", 0.0)
            print(f"    {seconds:6.1f} s  {name}  {compiled.metadata.num_warps} warps  (ttgir {ttgir:.1f} s)", flush=True)
            stages.clear()
        compile_only(arch, report)
        tuning.override(plan_as_gpu=True)
        for call in calls:
            print(f"{call.tensors[0][0]} k{call.tensors[1][0][2]} stride {call.arguments[0]}", flush=True)
            for pass_ in call.passes():
                compile_call(json.loads(call.to_json(pass_)))


def launch_keys(labelled_calls, arch):
    """[(layer label, pass, kernel name, specialisation)]: each launch's key for a GPU of compute
    capability `arch`, from the GPU's launch plans, nothing compiled."""
    import json

    from dwconv import tuning
    from dwconv._compile_worker import compile_call
    from dwconv._triton_compat import intercept_launches, specialisation

    launched = []
    intercept_launches(arch, lambda kernel, grid, args, kwargs: launched.append(
        (kernel.__name__, specialisation(kernel, args, kwargs))))
    tuning.override(plan_as_gpu=True)
    keys = []
    for label, call in labelled_calls:
        for pass_ in call.passes():
            launched.clear()
            compile_call(json.loads(call.to_json(pass_)))
            keys += [(label, pass_, name, spec) for name, spec in launched]
    return keys


def compare_keys(before_calls, after_calls, arch, what):
    before, after = launch_keys(before_calls, arch), launch_keys(after_calls, arch)
    known = {(name, spec) for _, _, name, spec in before}
    new = [(label, pass_, name, spec) for label, pass_, name, spec in after if (name, spec) not in known]
    print(f"{len(known)} kernel binaries; {what} {len({(n, s) for _, _, n, s in new})}:")
    for label, pass_, name, spec in new:
        same_layer = [s for l, p, n, s in before if (l, p, n) == (label, pass_, name)]
        nearest = min(same_layer or [s for n, s in known if n == name] or [spec],
                      key=lambda old: sum(a != b for a, b in zip(old, spec)))
        changes = ", ".join(f"{a[0]} {a[1]} -> {b[1]}" for a, b in zip(nearest, spec) if a != b)
        print(f"  {label} {pass_} {name}: {changes}")


def time_backend_stages():
    """Seconds spent in each stage of Triton's CUDA backend (make_ttir, make_ttgir, ...) since last cleared."""
    import collections

    from triton.backends.nvidia import compiler

    seconds = collections.defaultdict(float)

    def timed(name, stage):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return stage(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - started
        return run

    for name in ("make_ttir", "make_ttgir", "make_llir", "make_ptx", "make_cubin"):
        stage = compiler.CUDABackend.__dict__[name]  # (some static methods, some not)
        wrapped = staticmethod(timed(name, stage.__func__)) if isinstance(stage, staticmethod) else timed(name, stage)
        setattr(compiler.CUDABackend, name, wrapped)
    return seconds


if __name__ == "__main__":
    main()
