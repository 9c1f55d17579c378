"""Developer tool (no GPU needed): sm_90 PTX instruction counts of the forward kernels of a set of
layers (each family at least once), compiled with the launchers' GPU plans and never launched, with
an activation in the epilogue or none; --src compares another tree's kernels (a git worktree).

    PYTHONPATH=.triton36 python benchmarks/forward_ptx.py --activation relu6
    PYTHONPATH=.triton36 python benchmarks/forward_ptx.py --src /tmp/old/src --out /tmp/ptx_old   # then diff -r
"""

import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # (before the kernels are decorated: they must compile)

# (N, C, H, W, kernel, stride, dtype, channels_last): the channels_last pixel tiles (3x3 stride 1 and 2,
# 5x5, 7x7), NCHW pixels, pairs, large_fma, the Toeplitz products
LAYERS = [(64, 144, 56, 56, 3, 1, "bfloat16", True), (64, 144, 56, 56, 3, 2, "bfloat16", True),
          (64, 240, 28, 28, 5, 1, "bfloat16", True), (64, 96, 56, 56, 7, 1, "bfloat16", True),
          (64, 32, 112, 112, 3, 1, "float32", False), (64, 96, 112, 112, 3, 2, "float32", False),
          (64, 192, 28, 28, 3, 1, "float32", False), (32, 128, 56, 56, 31, 1, "bfloat16", False)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--activation", help="a name of dwconv.activations.FUNCTIONS (default: none; omitted for --src "
                                        "trees older than the activations)")
    p.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    p.add_argument("--out", help="write each launch's instructions here (one file a launch)")
    args = p.parse_args()
    sys.path.insert(0, args.src)
    import torch

    from dwconv import tuning
    from dwconv._geometry import conv_geometry
    from dwconv._triton_compat import compile_only
    from dwconv.dispatch import conv_forward

    compiled = []
    compile_only(90, lambda name, kernel, seconds: compiled.append((name, kernel)))
    tuning.override(plan_as_gpu=True)
    options = {}
    if args.activation:
        from dwconv._geometry import activation_code

        options["activation"] = activation_code(args.activation)
    for n, c, h, w, k, stride, dtype, channels_last in LAYERS:
        layout = torch.channels_last if channels_last else torch.contiguous_format
        x = torch.empty(n, c, h, w, dtype=getattr(torch, dtype)).contiguous(memory_format=layout)
        weight = torch.empty(c, 1, k, k, dtype=x.dtype)
        compiled.clear()
        conv_forward(x, weight, None, conv_geometry(x, weight, None, stride, k // 2, 1), **options)
        for name, kernel in compiled:
            if "band_rows" in name:  # (the Toeplitz weight rows' preparation)
                continue
            lines = [line for line in kernel.asm["ptx"].splitlines()
                     if re.match(r"\s+[a-z@]", line) and not line.strip().startswith((".", "//"))]
            label = f"{n}x{c}x{h}x{w} k{k} s{stride} {dtype} {'channels_last' if channels_last else 'nchw'}"
            print(f"{label:<44} {name:<36} {len(lines)} instructions")
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, label.replace(" ", "_") + ".ptx"), "w") as f:
                    f.write("\n".join(lines))


if __name__ == "__main__":
    main()
