"""Fingerprints of dwconv on a suite: hashes of every output and gradient, and every kernel launch
(kernel, grid, arguments), so that two source trees can be compared bitwise on the GPU.

    python benchmarks/fingerprint.py --src SRC --suite models --out a.json [--shard 0/4]
    python benchmarks/fingerprint.py --compare a.json b.json

The kernels are deterministic: a reorganisation that changes nothing gives identical files. Runs
with DWCONV_NATIVE=0 so that every launch passes through Python (the C++ path replays the same ones).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys


def _digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def run(args) -> None:
    os.environ["DWCONV_NATIVE"] = "0"
    sys.path.insert(0, args.src)
    import torch

    import dwconv
    from dwconv import bench

    launch_module = None
    for name in ("dwconv.kernels._launch", "dwconv.ops._launch"):
        try:
            launch_module = importlib.import_module(name)
            break
        except ImportError:
            pass
    launches = []
    original = launch_module.launch_now

    def recording(kernel, plan, *tensors):
        constants = {k: str(v) for k, v in plan.constants.items()}
        launches.append([getattr(kernel, "__name__", None) or kernel.fn.__name__, list(plan.grid),
                         [int(s) for s in plan.scalars], constants, [list(t.shape) for t in tensors]])
        return original(kernel, plan, *tensors)

    launch_module.launch_now = recording
    from dataclasses import replace

    cases = [replace(c, n=max(1, c.n // args.shrink), c=max(2, c.c // args.shrink))
             for suite in args.suite.split(",") for c in bench.SUITES[suite]]
    index, count = (int(v) for v in args.shard.split("/"))
    rows = {}
    done = set(json.load(open(args.skip))) if args.skip else set()
    todo = [(number, case) for number, case in enumerate(cases) if f"{case.label} channels_last" not in done
            and (not args.dtype or case.dtype == args.dtype)]
    for position, (number, case) in enumerate(todo):
        if position % count != index:
            continue
        dtype = getattr(torch, case.dtype)
        for layout in ("nchw", "channels_last"):
            generator = torch.Generator(device=args.device).manual_seed(number)
            x = torch.randn(case.n, case.c, case.h, case.w, device=args.device, dtype=dtype, generator=generator)
            if layout == "channels_last":
                x = x.contiguous(memory_format=torch.channels_last)
            weight = torch.randn(case.c * case.multiplier, 1, case.kernel, case.kernel, device=args.device, dtype=dtype,
                                 generator=generator)
            x.requires_grad_(True)
            weight.requires_grad_(True)
            del launches[:]
            out = dwconv.depthwise_conv2d(x, weight, None, case.stride, case.padding, case.dilation)
            grad_out = torch.randn(out.shape, device=args.device, dtype=dtype, generator=generator)
            if layout == "channels_last":
                grad_out = grad_out.contiguous(memory_format=torch.channels_last)
            grad_x, grad_w = torch.autograd.grad(out, (x, weight), grad_out)
            # the weight gradient alone (the fused backward's other branch) and with a bias
            (grad_w_only,) = torch.autograd.grad(dwconv.depthwise_conv2d(x.detach(), weight, None, case.stride,
                                                                         case.padding, case.dilation),
                                                 (weight,), grad_out)
            rows[f"{case.label} {layout}"] = dict(
                out=_digest(out), grad_input=_digest(grad_x), grad_weight=_digest(grad_w),
                grad_weight_only=_digest(grad_w_only), launches=list(launches))
            print(case.label, layout, rows[f"{case.label} {layout}"]["out"], flush=True)
            with open(args.out, "w") as f:  # (after each case: a run cut short keeps what it did)
                json.dump(rows, f, indent=0, sort_keys=True)


def compare(a_path: str, b_path: str, ignore=("EVICT", "STORE_CACHE", "BRANCH_WEIGHT_TAPS")) -> int:
    rows = []
    for path in (a_path, b_path):
        merged = {}
        for part in path.split(","):
            with open(part) as f:
                merged.update(json.load(f))
        rows.append(merged)
    a, b = rows
    bad = 0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print("missing in one:", key)
            bad += 1
            continue
        for field in ("out", "grad_input", "grad_weight", "grad_weight_only"):
            if a[key][field] != b[key][field]:
                print("DIFFERENT", field, key)
                bad += 1

        def plain(launches):
            return [[name, grid, scalars, {k: v for k, v in c.items() if k not in ignore}, shapes]
                    for name, grid, scalars, c, shapes in launches]
        if plain(a[key]["launches"]) != plain(b[key]["launches"]):
            print("LAUNCHES DIFFER", key, json.dumps(a[key]["launches"])[:600], json.dumps(b[key]["launches"])[:600])
            bad += 1
    print(f"{len(a)} rows compared, {bad} differences")
    return bad


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--src")
    parser.add_argument("--suite", default="models")
    parser.add_argument("--dtype")
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--out")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--skip", help="a fingerprint file whose layers are not run again")
    parser.add_argument("--shrink", type=int, default=1, help="divide batch and channels (CPU checks)")
    parser.add_argument("--compare", nargs=2)
    arguments = parser.parse_args()
    if arguments.compare:
        sys.exit(1 if compare(*arguments.compare) else 0)
    run(arguments)
