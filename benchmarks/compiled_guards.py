"""Developer tool: what torch.compile's guards cost a fused model against stock's on the host (no GPU
needed): Dynamo's guards by kind and by the shape of their sources, and the time of one check of
all of them (the compiled frame's guard manager, as each call runs it before the compiled code).

    python benchmarks/compiled_guards.py --model efficientnet_b0 [--sources 6]

Eval forward, bfloat16 autocast, channels_last, 1x3x32x32 on the CPU, dwconv's launches stubbed
(benchmarks/host_model.py's stub_launches). Sources are printed with their keys and indices
abstracted ([k], [i]): the paths by which a guarded value is reached.
"""

import argparse
import collections
import copy
import inspect
import os
import re
import sys
import timeit

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

import dwconv  # noqa: E402
from dwconv.bench_models import build_model  # noqa: E402


def source_shape(name: str) -> str:
    """A guard's source with its dict keys and indices abstracted."""
    return re.sub(r"\[\d+\]", "[i]", re.sub(r"\['[^']*'\]", "[k]", name))


def guard_check(model, x, repeats: int = 7, number: int = 200):
    """(ms of one check of the compiled forward's guards, the guards) of model(x)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    names = list(inspect.signature(type(model).forward).parameters)[:2]
    frame_locals = {names[0]: model, names[1]: x}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):  # (a global first read at the first call recompiles once on the CPU)
            compiled(x)
        manager = next(entry.guard_manager for entry in _debug_get_cache_entry_list(type(model).forward.__code__)
                       if entry.guard_manager.check(frame_locals))
        ms = min(timeit.repeat(lambda: manager.check(frame_locals), number=number, repeat=repeats)) / number * 1e3
        torch._dynamo.reset()
        guards = torch._dynamo.explain(model)(x).out_guards
    return ms, guards


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="efficientnet_b0")
    parser.add_argument("--sources", type=int, default=6, help="the most common source shapes shown a kind")
    args = parser.parse_args()
    from host_model import stub_launches

    stub_launches()
    torch.set_num_threads(1)
    stock = build_model(args.model).eval().to(memory_format=torch.channels_last)
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, verbose=False, precompile=False).eval()
    x = torch.randn(1, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    kinds = {}
    for label, model in (("stock", stock), ("fused", fused)):
        ms, guards = guard_check(model, x)
        kinds[label] = collections.defaultdict(list)
        for guard in guards:
            kinds[label][guard.create_fn_name()].append(guard.name)
        print(f"{args.model} {label}: {len(guards)} guards, checked in {ms:.3f} ms a call", flush=True)
    print("\nguards by kind, stock / fused, and the fused model's most common sources of the kinds it adds:")
    for kind in sorted(kinds["fused"], key=lambda k: len(kinds["stock"].get(k, [])) - len(kinds["fused"][k])):
        stock_count, fused_count = len(kinds["stock"].get(kind, [])), len(kinds["fused"][kind])
        print(f"  {kind:<34} {stock_count:6d} / {fused_count:6d}")
        if fused_count > stock_count:
            for shape, count in collections.Counter(map(source_shape, kinds["fused"][kind])).most_common(args.sources):
                print(f"      {count:5d}  ...{shape[-110:]}")


if __name__ == "__main__":
    main()
