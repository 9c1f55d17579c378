"""Developer tool (no GPU needed): a Triton cache for the GPU machine, compiled on this one.

Compiles take minutes of a device call on a fresh machine (every layer's kernels). This runs dwconv's public forward and forward+backward of benchmark suites' layers
on CPU tensors, with the kernels compiled for sm_90 and never launched (tests/compile_check.py's
harness, the launchers' GPU plans), into a cache directory that the device call copies to
~/.triton/cache before it starts.

The cache key: Triton hashes its own files, libtriton.so among them. The GPU machine runs CPython
3.12 and this one 3.11; the two Triton 3.6.0 wheels differ only in their .so files (every Python
file, ptxas and libdevice are the same: `diff -r` of the wheels), so triton_key() is
patched to hash the 3.12 wheel's libtriton.so instead of the local one (its SHA-256 below, or
--libtriton FILE). Group files name their members by absolute path; they are rewritten to the
device's /root/.triton/cache in the packed copy (--pack; the directory itself keeps local paths,
so later runs here, several at once included, find what is already compiled). Whether the device
then finds the kernels: `gpu_check.sh` prints "Triton cache: N new entries" after its steps.

    PYTHONPATH=.triton36:src python benchmarks/device_triton_cache.py --suite models --dtype bfloat16 --out /tmp/kbuild
    python benchmarks/device_triton_cache.py --out /tmp/kbuild --pack .tcache/triton_cache.tar.xz

Whole models' kernels as their first calls compile them (`--model`: convert's warmup, converted and with
fuse=True, training and eval, bfloat16 autocast channels_last, 224 x 224 images; torchvision or timm
importable; MobileNetV2, EfficientNet-B0 and MobileNetV4-conv-medium at batch 256: about 4 minutes).
The models' code only is needed here, beside the venv's torch: `pip install --no-deps --target
/tmp/tv_pkgs torchvision==0.28.0 pillow` and `--target /tmp/timm_pkgs timm huggingface_hub safetensors
pyyaml`, with both on PYTHONPATH (torchvision's C operators do not load against this torch: their
schemas are defined here first, `_torchvision_without_its_operators`):

    PYTHONPATH=.triton36:src python benchmarks/device_triton_cache.py --model mobilenet_v2 efficientnet_b0 \
        mobilenetv4_conv_medium --batch 256 --out /tmp/kbuild256

The blocks' cache (`gpu_check.sh blocks` with BLOCK_ACTIVATIONS=relu6 DTYPES=bfloat16: the fused eval
call and the trained block's kernels of each layer, both layouts; about 10 minutes, 199 entries):

    PYTHONPATH=.triton36:src python benchmarks/device_triton_cache.py --suite models --dtype bfloat16 \
        --block relu6 --out /tmp/kblocks

The layers' cache for the whole-model runs (about 8 minutes on 2 cores): the models suite in bfloat16 channels_last
and float32 nchw, ConvNeXt-T's 7x7 layers at batch 64, and the large-kernel net's (ConvNeXt-T with
kernels 31, 29, 27, 13) in bfloat16 channels_last and float32 nchw:

    --suite models --dtype bfloat16 --layouts channels_last
    --suite models --dtype float32 --layouts nchw
    --layer 64 96 56 56 7 3 --layer 64 192 28 28 7 3 --layer 64 384 14 14 7 3 --layer 64 768 7 7 7 3
        --dtype bfloat16 --layouts channels_last
    --layer 64 96 56 56 31 15 --layer 64 192 28 28 29 14 --layer 64 384 14 14 27 13 --layer 64 768 7 7 13 6
        --dtype bfloat16 --layouts channels_last   (and --dtype float32 --layouts nchw)
"""

import argparse
import hashlib
import json
import os
import sys
import time

# the GPU machine's Triton 3.6.0 (triton-3.6.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl)
DEVICE_LIBTRITON_SHA256 = "28daaa70a904e4f8add754e518533e8a69b94ab8b16431ce77d45f1f25282b87"
DEVICE_CACHE_DIR = "/root/.triton/cache"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--suite", nargs="+", default=["models"], help="bench suites (models, large, forward, 84)")
    p.add_argument("--dtype", nargs="+", default=["float32", "float16", "bfloat16"])
    p.add_argument("--cases", nargs="+", type=int, help="indices among the suite's rows of each dtype")
    p.add_argument("--layouts", nargs="+", default=["nchw", "channels_last"])
    p.add_argument("--layer", nargs=6, type=int, action="append", metavar="N C H W K PAD".split(),
                   help="instead of suites: these layers (stride 1, with a bias), as compile_case does a suite's "
                        "(e.g. the depthwise layers of ConvNeXt-T at batch 2 on 96 x 96 images, the GPU test's)")
    p.add_argument("--model", nargs="+", help="instead of suites: whole models' kernels (bench --model's names), "
                   "by dwconv.warmup as a first call would (fake run, a pool of compiles), converted and with "
                   "fuse=True, training and eval, bfloat16 autocast channels_last")
    p.add_argument("--sweep-blocks", nargs="+", metavar="MODEL",
                   help="instead of suites: benchmarks/sweep_blocks.py's variants of these models' blocks (--batch)")
    p.add_argument("--block", metavar="ACTIVATION", help="the layers' kernels as `bench --block ACTIVATION` runs "
                   "them (gpu_check.sh blocks): the fused eval call and the trained block's convolution, BatchNorm "
                   "and activation, instead of the plain forward and backward")
    p.add_argument("--batch", type=int, default=256, help="--model, --sweep-blocks: the batch (224 x 224 images)")
    p.add_argument("--out", required=True, help="the cache directory to fill (created)")
    p.add_argument("--libtriton", help="the device's libtriton.so, to hash instead of the constant")
    p.add_argument("--pack", metavar="FILE.tar.xz", help="only pack --out for the device (no compiles)")
    return p.parse_args()


def main():
    args = parse_args()
    if args.pack:
        pack(args.out, args.pack)
        return
    os.environ["TRITON_CACHE_DIR"] = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    device_lib = DEVICE_LIBTRITON_SHA256
    if args.libtriton:
        device_lib = hashlib.sha256(open(args.libtriton, "rb").read()).hexdigest()
    if args.model:
        compile_models(args.model, args.batch, args.out, device_lib)
        return
    import compile_check  # noqa: F401  (compile-only sm_90 driver, GPU plans; before dwconv's kernels)
    import torch

    use_device_key(device_lib)
    if args.sweep_blocks:
        compile_sweep(args.sweep_blocks, args.batch, args.out)
        return

    import dwconv
    from dwconv import bench, functional

    functional.uses_triton = lambda x: True  # CPU tensors take the Triton path (kernels compile only)
    started = time.time()
    def compile_one(case):
        if args.block:
            compile_block(case, args.layouts, args.block, torch, dwconv, bench)
        else:
            compile_case(case, args.layouts, torch, dwconv, bench)

    if args.layer:
        for dtype_name in args.dtype:
            for n, c, h, w, k, pad in args.layer:
                compile_one(bench.Case(n, c, h, w, k, padding=pad, bias=True, dtype=dtype_name))
        args.suite = []
    for suite in args.suite:
        for dtype_name in args.dtype:
            rows = [c for c in bench.SUITES[suite] if c.dtype == dtype_name]
            for index in args.cases or range(len(rows)):
                if index < len(rows):
                    compile_one(rows[index])
    print(f"{len(os.listdir(args.out))} cache entries in {args.out} ({time.time() - started:.0f} s)")


def use_device_key(device_lib: str) -> None:
    """Triton's cache key in this process as the device's Triton 3.6.0 computes it (its libtriton.so's
    hash in place of the local one's)."""
    import triton
    from triton.runtime import cache

    assert triton.__version__ == "3.6.0", f"the device runs Triton 3.6.0, this is {triton.__version__}"
    local_lib = os.path.join(os.path.dirname(triton.__file__), "_C", "libtriton.so")
    local_key = cache.triton_key()
    device_key = local_key.replace(hashlib.sha256(open(local_lib, "rb").read()).hexdigest(), device_lib)
    assert device_key != local_key or device_lib in local_key, "libtriton's hash not found in triton_key()"
    cache.triton_key = lambda: device_key  # (get_cache_key reads the module's global at each call)


def _torchvision_without_its_operators() -> None:
    """Makes torchvision importable where its C library does not load against this torch (a CPU
    wheel of another build): its meta registrations need the schemas of two operators, defined here;
    the models never call them."""
    import torch

    try:
        import torchvision  # noqa: F401
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
        for name in [m for m in list(sys.modules) if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        library = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _torchvision_without_its_operators.library = library  # (kept: the schemas live while it does)
    except ImportError:
        pass  # (timm's models alone)


def compile_models(names, batch, out, device_lib):
    """Each model's kernels as its first calls on the device compile them (convert's warmup): the
    model converted, and converted with fuse=True, in training and in eval mode, under bfloat16
    autocast with channels_last inputs, for sm_90. The warmup's compile workers are processes of
    their own: a sitecustomize on their path gives them the device's cache key too."""
    import tempfile

    import torch

    import dwconv
    from dwconv import precompile
    from dwconv.bench_models import build_model

    _torchvision_without_its_operators()
    with tempfile.TemporaryDirectory() as site:
        with open(os.path.join(site, "sitecustomize.py"), "w") as hook:
            hook.write(f"import sys\nsys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
                       f"import device_triton_cache\ndevice_triton_cache.use_device_key({device_lib!r})\n")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
        use_device_key(device_lib)
        started = time.time()
        for name in names:
            for fuse in (False, True):
                torch.manual_seed(0)
                model = dwconv.convert(build_model(name), fuse=fuse, precompile=False, verbose=False)
                model = model.to(memory_format=torch.channels_last)
                x = torch.randn(batch, 3, 224, 224).contiguous(memory_format=torch.channels_last)
                for train in (True, False):
                    model.train(train)
                    report = precompile.warmup(model, x, arch=90, autocast=torch.bfloat16, verbose=False)
                    print(f"{name} fuse={fuse} train={train}: {report.seconds:.0f} s, {len(report.errors)} errors",
                          flush=True)
        print(f"{len(os.listdir(out))} cache entries in {out} ({time.time() - started:.0f} s)")


def compile_sweep(names, batch, out):
    """benchmarks/sweep_blocks.py's variants of each model's blocks at the batch, as its GPU run
    launches them (here on CPU tensors, for sm_90), one after another in this process."""
    import sweep_blocks

    _torchvision_without_its_operators()
    sweep_blocks.DEVICE = "cpu"
    started = time.time()
    for name in names:
        tasks = sweep_blocks.compile_tasks(sweep_blocks.sweep_layers(name, batch, 224, 6), "cpu")
        failed = sweep_blocks.compile_all(tasks, 1, float("inf"))
        print(f"{name}: {len(tasks)} variants, {len(failed)} not compiled {sorted(failed.values())[:3]} "
              f"({time.time() - started:.0f} s)", flush=True)
    print(f"{len(os.listdir(out))} cache entries in {out} ({time.time() - started:.0f} s)")


def compile_case(case, layouts, torch, dwconv, bench):
    """The kernels of the bench's dwconv calls on this layer: forward and forward+backward with
    every tensor requiring grad, NCHW, and channels_last with the weight contiguous (the values
    check) and channels_last (the timed calls), each also on the first 4 images (the bench's
    gradient check: Triton specialises integer arguments by divisibility by 16, so a batch of 4
    compiles other kernels).
    Tensors are never written: torch.empty."""
    dtype = bench.DTYPES[case.dtype]
    conv = dict(stride=case.stride, padding=case.padding, dilation=case.dilation)
    started = time.time()
    for layout in layouts:
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        x = torch.empty(case.n, case.c, case.h, case.w, dtype=dtype, memory_format=fmt)
        weight = torch.empty(case.c * case.multiplier, 1, case.kernel, case.kernel, dtype=dtype)
        bias = torch.empty(case.c * case.multiplier, dtype=dtype) if case.bias else None
        weights = [weight] + ([weight.contiguous(memory_format=fmt)] if layout == "channels_last" else [])
        for w in weights:
            for images in (x, x[:4].clone()):
                leaves = [t.detach().requires_grad_() for t in (images, w, bias) if t is not None]
                out = dwconv.depthwise_conv2d(*leaves[:2], leaves[2] if bias is not None else None, **conv)
                torch.autograd.grad(out, leaves, torch.empty_like(out))
                del out, leaves
    print(f"{case.label}: {time.time() - started:.1f} s", flush=True)


def compile_block(case, layouts, activation, torch, dwconv, bench):
    """The kernels of `bench --block ACTIVATION`'s dwconv calls on this layer (bench.measure_block):
    in each layout the fused eval call (the folded weight and bias, the activation in the epilogue),
    the convolution without a gradient, then BatchNorm and the activation in training with the
    gradient of their input (the values check), and the timed training step: the convolution and
    BatchNorm with the gradients of the input, the weight and BatchNorm's weight and bias.
    Tensors are never written: torch.empty."""
    from dwconv.batch_norm import batch_norm_activation

    dtype = bench.DTYPES[case.dtype]
    conv = dict(stride=case.stride, padding=case.padding, dilation=case.dilation)
    channels = case.c * case.multiplier
    started = time.time()
    weight = torch.empty(channels, 1, case.kernel, case.kernel, dtype=dtype)
    bias = torch.empty(channels, dtype=dtype) if case.bias else None
    folded = (torch.empty_like(weight), torch.empty(channels, dtype=dtype))
    norm = torch.nn.BatchNorm2d(channels).train()
    trained_weight = weight.detach().clone().requires_grad_()
    for layout in layouts:
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        x = torch.empty(case.n, case.c, case.h, case.w, dtype=dtype, memory_format=fmt)
        with torch.no_grad():
            dwconv.depthwise_conv2d(x, *folded, activation=activation, **conv)
            y = dwconv.depthwise_conv2d(x, trained_weight, bias, **conv).requires_grad_()
        out = batch_norm_activation(y, norm, activation)
        torch.autograd.grad(out, [y], torch.empty_like(out))
        leaf = x.detach().requires_grad_()
        out = batch_norm_activation(dwconv.depthwise_conv2d(leaf, trained_weight, bias, **conv), norm, activation)
        torch.autograd.grad(out, [leaf, trained_weight, norm.weight, norm.bias],
                            torch.empty_like(out).contiguous(memory_format=fmt))
        del out, y, leaf
    print(f"{case.label} +bn+{activation}: {time.time() - started:.1f} s", flush=True)


def pack(directory, archive):
    """A copy of the cache whose group files name their members under the device's cache, as
    archive (tar.xz: what gpu_check.sh unpacks into ~/.triton/cache)."""
    import shutil
    import subprocess
    import tempfile

    here = os.path.abspath(directory)
    with tempfile.TemporaryDirectory() as staging:
        copy = os.path.join(staging, "cache")
        shutil.copytree(here, copy)
        for entry in os.listdir(copy):
            for name in os.listdir(os.path.join(copy, entry)):
                if name.startswith("__grp__") and name.endswith(".json"):
                    path = os.path.join(copy, entry, name)
                    group = json.load(open(path))
                    group["child_paths"] = {k: v.replace(here, DEVICE_CACHE_DIR, 1)
                                            for k, v in group["child_paths"].items()}
                    json.dump(group, open(path, "w"))
        os.makedirs(os.path.dirname(os.path.abspath(archive)), exist_ok=True)
        subprocess.run(["tar", "-cJf", os.path.abspath(archive), "-C", copy, "."], check=True)
    print(f"{archive}: {len(os.listdir(here))} entries, {os.path.getsize(archive) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
