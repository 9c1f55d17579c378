"""Static sm_90 code of the Toeplitz kernels, compiled here without a GPU: shared
memory and the instructions of the innermost loop of products (global loads by width, shared-memory traffic,
tensor-core instructions), for the launchers' choice of blocks against a given alternative.

A CPU-side proxy for what the device time measures (the loop body runs kernel_h times a program):

    python benchmarks/sass_stats.py                  # k13 / k31 / k51 layers of issue #6
    python benchmarks/sass_stats.py --worst-shift    # as before session 11: windows sized for any shift
    python benchmarks/sass_stats.py --fma            # float32 on the CUDA cores (large_fma.py) instead
    python benchmarks/sass_stats.py --fused-backward --dtype bfloat16  # #84's 3x3 fused backward
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import compile_check  # noqa: E402  (Triton set up to compile for sm_90 instead of launching)
import torch  # noqa: E402
import triton  # noqa: E402

from dwconv.ops import toeplitz  # noqa: E402

# issue #6's layers (batch 32: the row blocks' height depends on it)
LAYERS = {"k31": ((32, 128, 56, 56), 31, 15), "k13": ((32, 256, 28, 28), 13, 6), "k51": ((32, 128, 56, 56), 51, 25)}
NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
CUOBJDUMP = os.path.join(os.path.dirname(NVDISASM), "cuobjdump")


def loop_body(sass: str, marker: str = "MMA"):
    """The instructions of the innermost loop holding the products (instructions with `marker` in
    their name: tensor-core MMAs, or FFMA): from a label to the last branch back to it."""
    lines = [ln for ln in sass.splitlines() if ln.strip()]
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"\s*\.?(L_x_\d+):", ln))}
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s.*`\(\.(L_x_\d+)\)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append([x for x in lines[labels[m.group(1)]:i + 1] if re.search(r"/\*[0-9a-f]{4,}\*/", x)])
    with_products = [body for body in loops if any(marker in x for x in body)]
    return min(with_products, key=len) if with_products else max(loops, key=len, default=[])


def classify(instructions):
    counts = collections.Counter()
    for ln in instructions:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln)
        if not m:
            continue
        op = m.group(1)
        base = op.split(".")[0]
        if base in ("LDG", "STG", "LDS", "STS", "LDSM", "LDGSTS"):
            width = re.search(r"\.(128|64|U16|16|U8)", op)
            counts[f"{base}.{width.group(1) if width else 32}"] += 1
        elif base in ("HMMA", "HGMMA", "IMMA", "FFMA"):
            counts[base] += 1
        counts["total"] += 1
    return counts


def stats(compiled, marker: str = "MMA"):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return dict(shared=compiled.metadata.shared, loop=classify(loop_body(sass, marker)),
                registers=int(registers.group(1)) if registers else None, stack=int(stack.group(1)) if stack else None)


def fma_stats(names, given=None):
    """The float32 CUDA-core kernel (large_fma.py) at its default blocks (or the given ones: block_h,
    block_w, warps, outputs a thread): registers, stack, and its kernel-row loop (FFMA against
    everything else)."""
    from dwconv.ops.forward import ForwardConfig
    from dwconv.ops.large_fma import large_fma_blocks, large_fma_grad_weight

    for name in names:
        shape, k, pad = LAYERS[name]
        x, _, geom, grad_out = compile_check.tensors(shape, (k, k), torch.float32, padding=pad)
        blocks = tuple(given) if given else large_fma_blocks(geom)
        for what in ("forward", "grad_weight"):
            before = len(compile_check.COMPILED)
            if what == "forward":
                compile_check.forward(shape, (k, k), torch.float32,
                                      ForwardConfig("large_fma", *blocks[:3], vec=blocks[3]), padding=pad)
            else:
                large_fma_grad_weight(grad_out, x, geom, torch.float32, True, blocks)
            for kernel, compiled in compile_check.COMPILED[before:]:
                s = stats(compiled, "FFMA")
                other = " ".join(f"{op} {n}" for op, n in sorted(s["loop"].items()) if op not in ("total", "FFMA"))
                print(f"{name} float32 large_fma {what:11s} blocks {blocks}: {s['registers']} registers, stack "
                      f"{s['stack']} B; inner loop {s['loop']['total']} instructions, FFMA {s['loop']['FFMA']} ({other})",
                      flush=True)


def fused_backward_stats(dtype_name, blocks=((4, 4, 128, 2),), rows_blocks=()):
    """The 3x3 fused backward of #84's channels (128, 2 warps: its channels_last blocks, 4 x 4 x 128)
    against the NCHW fused pass, on a small image (the code is #84's but for integer
    specialisations): registers bound the resident warps (64 threads a program on channels_last).
    blocks: the channels_last pass's (BLOCK_H, BLOCK_W, BLOCK_C, WARPS) to compile; rows_blocks:
    the row-sliding pass's (BLOCK_W, BLOCK_C, WARPS)."""
    from dwconv.ops.backward import conv_grad_input_and_weight, conv_grad_input_and_weight_nhwc
    from dwconv.ops.forward import ForwardConfig

    dtype = getattr(torch, dtype_name)
    runs = [("channels_last " + "x".join(map(str, b)), torch.channels_last, b) for b in blocks]
    runs += [("channels_last rows " + "x".join(map(str, b)), torch.channels_last, b) for b in rows_blocks]
    for name, layout, block in runs + [("NCHW", torch.contiguous_format, None)]:
        x, weight, geom, grad_out = compile_check.tensors((2, 128, 64, 512), (3, 3), dtype, layout=layout)
        before = len(compile_check.COMPILED)
        if layout is torch.channels_last and len(block) == 3:
            for prefetch in (False, True):
                conv_grad_input_and_weight_nhwc(grad_out, x, weight, geom,
                                                ForwardConfig("nhwc_rows", 64, block[0], block[2], block_c=block[1],
                                                              prefetch=prefetch))
        elif layout is torch.channels_last:
            conv_grad_input_and_weight_nhwc(grad_out, x, weight, geom,
                                            ForwardConfig("nhwc_pixels", block[0], block[1], block[3],
                                                          block_c=block[2]), 64)
        else:
            conv_grad_input_and_weight(grad_out, x, weight, geom)
        for kernel, compiled in compile_check.COMPILED[before:]:
            s = stats(compiled, "FFMA")
            other = " ".join(f"{op} {n}" for op, n in sorted(s["loop"].items()) if op not in ("total", "FFMA"))
            print(f"#84 {dtype_name} {name} {kernel}: {s['registers']} registers, "
                  f"{compiled.metadata.num_warps} warps, stack {s['stack']} B; loop {s['loop']['total']} "
                  f"instructions, FFMA {s['loop']['FFMA']} ({other})", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worst-shift", action="store_true", help="size windows for any shift (before session 11)")
    ap.add_argument("--layers", nargs="+", default=list(LAYERS))
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--fma", action="store_true", help="the float32 CUDA-core kernel (large_fma.py)")
    ap.add_argument("--fma-blocks", type=int, nargs=4, metavar=("H", "W", "WARPS", "VEC"),
                    help="--fma at these blocks instead of the launcher's")
    ap.add_argument("--out-rows", type=int, nargs=3, action="append", metavar=("ROWS", "M", "WARPS"),
                    help="the Toeplitz forward's tiles: output rows a tile, tiles a program, warps (and as many kernel "
                    "rows a weight-gradient pass)")
    ap.add_argument("--prefetch", choices=["on", "off"],
                    help="the forward's next-row prefetch at every kernel size or at none (default: "
                    "toeplitz.PREFETCH_MIN_KERNEL_H)")
    ap.add_argument("--fused-backward", action="store_true",
                    help="the 3x3 fused backward at #84's blocks, channels_last against NCHW (--dtype)")
    ap.add_argument("--fused-blocks", type=int, nargs=4, action="append", metavar=("H", "W", "C", "WARPS"),
                    help="--fused-backward: the channels_last pass at these blocks instead of 4 4 128 2")
    ap.add_argument("--rows-blocks", type=int, nargs=3, action="append", metavar=("W", "C", "WARPS"),
                    help="--fused-backward: also the row-sliding pass at these blocks")
    args = ap.parse_args()
    if args.fused_backward:
        print(f"triton {triton.__version__}, sm_90")
        for dtype in args.dtype:
            fused_backward_stats(dtype, args.fused_blocks or ((4, 4, 128, 2),), args.rows_blocks or ())
        return
    if args.fma or args.fma_blocks:
        print(f"triton {triton.__version__}, sm_90")
        return fma_stats(args.layers, args.fma_blocks)
    if args.worst_shift:
        toeplitz.window_shift = lambda geom, block_w, unit: unit - 1
    if args.prefetch:
        toeplitz.PREFETCH_MIN_KERNEL_H = 1 if args.prefetch == "on" else 1 << 30
    print(f"triton {triton.__version__}, sm_90{', worst-case shift' if args.worst_shift else ''}")
    for out_rows, block_m, warps in args.out_rows or [(None, None, None)]:
        if out_rows:  # (the forward's tiles of several output rows: toeplitz_out_rows)
            toeplitz._PLANS = {}
            toeplitz.toeplitz_out_rows = lambda geom, x, out_rows=out_rows: out_rows
            toeplitz.toeplitz_grad_weight_kh_rows = lambda geom, x, block_w=None, out_rows=out_rows, warps=warps: (out_rows, warps)
            toeplitz.toeplitz_block_m = lambda x, block_m=block_m: block_m
            toeplitz.toeplitz_num_warps = lambda out_rows, block_m, warps=warps: warps
            print(f"out_rows {out_rows}, block_m {block_m}, {warps} warps (forward)")
        layer_stats(args)


def layer_stats(args):
    for name in args.layers:
        shape, k, pad = LAYERS[name]
        for dtype in args.dtype:
            for what in ("forward", "grad_weight"):
                before = len(compile_check.COMPILED)
                run = compile_check.forward if what == "forward" else compile_check.grad_weight
                run(shape, (k, k), getattr(torch, dtype), None, padding=pad)
                plan = [p for p in toeplitz._PLANS.values() if "BLOCK_M" in p.constants][-1].constants
                blocks = f"M{plan['BLOCK_M']} W{plan['BLOCK_W']} K{plan['BLOCK_K']} unit {plan['UNIT']}"
                for kernel, compiled in compile_check.COMPILED[before:]:
                    if kernel == "_band_rows_kernel":  # (the launcher's weight rows, no products)
                        continue
                    s = stats(compiled)
                    mem = " ".join(f"{op} {n}" for op, n in sorted(s["loop"].items()) if op != "total")
                    print(f"{name} {dtype:8s} {what:11s} {blocks}: {s['registers']} registers, shared {s['shared']} B, loop "
                          f"{s['loop']['total']} instructions ({mem})", flush=True)

if __name__ == "__main__":
    main()
