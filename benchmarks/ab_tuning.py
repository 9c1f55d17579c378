"""A/B of tuning-table overrides on the GPU: the layers of a bench suite timed under the default
table and under each variant, in alternation (ROUNDS rounds, so that drift hits every variant
alike), forward or forward+backward, with the bench's timer (CUDA events, L2 flushed) or as CUDA
graph replays (GPU time alone).

    python benchmarks/ab_tuning.py --suite models --dtype bfloat16 --cases 0 2 \\
        --variant toeplitz_min_taps=81 --variant pixel_kernel_taps=25,fused_nhwc_taps=25 [--backward] [--graphs] \\
        [--precompile]

Each variant is a comma-separated list of Tuning fields (dwconv/tuning.py) and values. Prints a
row per layer and variant: median ms over rounds and the ratio to the default's.
"""

import argparse
import statistics

import torch

import dwconv
from dwconv import bench, replay, tuning


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", default="models", choices=sorted(bench.SUITES))
    parser.add_argument("--dtype")
    parser.add_argument("--cases", type=int, nargs="*", help="indices into the suite's layers (after --dtype)")
    parser.add_argument("--variant", action="append", default=[], help="name=value[,name=value...]")
    parser.add_argument("--backward", action="store_true", help="forward+backward instead of the forward")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--graphs", action="store_true", help="CUDA graph replays: GPU time alone")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--precompile", action="store_true",
                        help="first compile every variant's kernels in dwconv.warmup's worker pool")
    args = parser.parse_args()
    cases = [c for c in bench.SUITES[args.suite] if not args.dtype or c.dtype == args.dtype]
    if args.cases:
        cases = [cases[i] for i in args.cases]
    variants = [("default", {})] + [(text, tuning.from_text(text)) for text in args.variant]
    # (eager calls on the C++ path from the first, as bench's: on a fresh machine the replayer would build
    # in the background meanwhile, and the Python path's host time read 0.45-0.64 ms for small layers alike)
    print("dwconv's eager path:", "C++ replayer" if replay.prepare() else "Python autograd Function", flush=True)
    if args.precompile:
        precompile(cases, variants, args)
    timer = bench.Timer(10, args.iters)
    generator = torch.Generator(device="cuda").manual_seed(0)
    times = {}
    for case in cases:
        x, weight, bias = bench.make_inputs(case, generator)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        conv = dict(stride=case.stride, padding=case.padding, dilation=case.dilation)
        for _ in range(args.rounds):
            for name, changes in variants:
                with tuning.override(**changes):
                    def call(x=x, weight=weight, bias=bias):
                        return dwconv.depthwise_conv2d(x, weight, bias, **conv)
                    fn = call
                    if args.backward:
                        grad_out = torch.randn_like(call(), memory_format=torch.preserve_format)
                        fn = bench.forward_backward(lambda *a: dwconv.depthwise_conv2d(*a, **conv), (x, weight, bias),
                                                    grad_out)
                    fn = bench.graphed(fn) if args.graphs else fn
                    times.setdefault((case.label, name), []).append(statistics.fmean(timer(fn)))
    print(f"{'layer':<64} {'variant':<40} {'ms':>8} {'vs default':>10}")
    for case in cases:
        base = statistics.median(times[(case.label, "default")])
        for name, _ in variants:
            ms = statistics.median(times[(case.label, name)])
            print(f"{case.label:<64} {name:<40} {ms:8.4f} {ms / base:9.3f}x")


def precompile(cases, variants, args):
    from dwconv.precompile import LayerCall, compile_calls

    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    calls = [LayerCall.of(*bench.meta_inputs(case, fmt), (case.stride, case.padding, case.dilation),
                          (args.backward, args.backward, args.backward and case.bias)) for case in cases]
    major, minor = torch.cuda.get_device_capability()
    for name, changes in variants:
        with tuning.override(**changes):
            report = compile_calls(calls, 10 * major + minor, verbose=False)
        print(f"precompiled {name}: {report.launches} launches in {report.seconds:.1f} s, {len(report.errors)} errors",
              flush=True)


if __name__ == "__main__":
    main()
