"""Developer tool: a whole model's training step timed two ways in one process, stock and converted
with fuse=True, on the GPU: one step from an idle GPU (a synchronised step before it: what the
models bench's samples were before commit 2aa83fc) and steps that overlap (three after one, none
waiting on the GPU: a loop's steady state, each step's host time over the last one's kernels).
Where a step's forward is bound by the host and its backward by the GPU, the two differ.

    python benchmarks/step_overlap.py --model efficientnet_b0 [--batch 256] [--rounds 5] [--csv FILE]

bfloat16 autocast, channels_last, SGD with momentum; the variants timed in turns, medians printed and
(--csv) written as the models bench's rows (bench.CSV_FIELDS; passes "train step, from an idle GPU"
and "train step, overlapping"), which benchmarks/tables.py draws.
"""

import argparse
import copy
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

import dwconv  # noqa: E402
from dwconv import replay  # noqa: E402
from dwconv.bench import write_csv  # noqa: E402
from dwconv.bench_models import build_model, time_ms, training_step  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="efficientnet_b0")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--csv", help="write the medians to this results CSV")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    replay.prepare()
    stock = build_model(args.model).cuda().to(memory_format=torch.channels_last)
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, verbose=False)
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", generator=generator)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), device="cuda", generator=generator)
    steps = {}
    for name, model in (("stock", stock), ("fused", fused)):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        steps[name] = training_step(model.train(), x, y, optimizer, torch.bfloat16)
        time_ms(steps[name], 3, 1)  # (warm-up: the first call's warmup compiles, cuDNN's benchmark)
    idle = {name: [] for name in steps}
    overlapping = {name: [] for name in steps}
    for _ in range(args.rounds):  # (turns: the host's speed drifts)
        for name, step in steps.items():
            idle[name] += time_ms(step, 1, 1)
            overlapping[name] += time_ms(step, 1, 4)[1:]
    ms = {name: (statistics.median(idle[name]), statistics.median(overlapping[name])) for name in steps}
    rows = []
    for name, path in (("stock", "stock eager"), ("fused", "dwconv fused eager")):
        for column, (step, samples) in enumerate((("train step, from an idle GPU", idle[name]),
                                                  ("train step, overlapping", overlapping[name]))):
            rows.append(dict(suite="model", layer=args.model, dtype="bf16 autocast CL",
                             layout="channels_last", path=path, ms=ms[name][column], std=statistics.pstdev(samples),
                             dwconv_speedup=ms["stock"][column] / ms[name][column], **{"pass": step}))
    write_csv(args.csv, rows)
    for name, (alone, overlapped) in ms.items():
        print(f"{args.model} b{args.batch} train step {name}: {alone:.2f} ms from an idle GPU, "
              f"{overlapped:.2f} ms overlapping")
    print(f"fused against stock: {ms['stock'][0] / ms['fused'][0]:.2f}x from an idle GPU, "
          f"{ms['stock'][1] / ms['fused'][1]:.2f}x overlapping")


if __name__ == "__main__":
    main()
