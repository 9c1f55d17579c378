"""Where a compiled model's inference goes, stock against dwconv.convert, on the GPU: torch.compile
(default mode), bfloat16 autocast, channels_last, batch 64; the profiler's operators and kernels
over 5 calls after warm-up, by GPU time, by calls and by host time; the wall time of a call
unprofiled (20 calls, both models timed before either is profiled); and the host's Python by function (cProfile over 5 calls: Inductor's wrapper
code and what it calls, which the operator profile counts as the wrapper's own time).

    python benchmarks/compiled_profile.py --model mobilenet_v2 [--train] [--fuse] [--batch 256]

--fuse: the dwconv model converted with fuse=True (its blocks; in training, its BatchNorms as
dwconv's registered ops).
"""

import argparse
import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

import dwconv  # noqa: E402
from dwconv import replay  # noqa: E402
from dwconv.bench_models import build_model, inference, training_step  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mobilenet_v2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--train", action="store_true")
    p.add_argument("--rows", type=int, default=18)
    p.add_argument("--fuse", action="store_true")
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    replay.prepare()
    stock = build_model(args.model).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), device="cuda")
    fns = {}
    for label, model in (("stock", stock), ("dwconv", dwconv.convert(stock, fuse=args.fuse, verbose=False))):
        compiled = torch.compile(model)
        model.train(args.train)
        fns[label] = (training_step(compiled, x, y, torch.optim.SGD(model.parameters(), lr=1e-3), torch.bfloat16)
                      if args.train else inference(compiled, x, torch.bfloat16))
        for _ in range(3):
            fns[label]()
    # both timed before either is profiled: after a profile CUPTI stays attached to the process and
    # every launch costs more host time (pytorch/pytorch#144455, docs/decisions.md)
    unprofiled_ms = {}
    for label, fn in fns.items():
        torch.cuda.synchronize()
        unprofiled = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        unprofiled[0].record()
        for _ in range(20):
            fn()
        unprofiled[1].record()
        torch.cuda.synchronize()
        unprofiled_ms[label] = unprofiled[0].elapsed_time(unprofiled[1]) / 20
    for label, fn in fns.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                fn()
            end.record()
            torch.cuda.synchronize()
        events = prof.key_averages()
        print(f"\n=== {args.model} {label}: {start.elapsed_time(end) / 5:.3f} ms a call (wall, profiled), "
              f"{unprofiled_ms[label]:.3f} unprofiled")
        print(f"\n=== {args.model} {label} {'train' if args.train else 'inference'}: by GPU time")
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
        print(f"=== {label}: by calls")
        print(events.table(sort_by="count", row_limit=args.rows, max_name_column_width=70))
        print(f"=== {label}: by host time")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
        python = cProfile.Profile()
        python.enable()
        for _ in range(5):
            fn()
        python.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(args.rows)
        print(f"=== {label}: host Python by function, 5 calls (cProfile)")
        print(text.getvalue())


if __name__ == "__main__":
    main()
