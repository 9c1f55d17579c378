"""`python -m dwconv bench`: times dwconv against PyTorch on the GPU, checking values first.

Protocol (KernelBench's): CUDA events around each call, 3 warm-up calls, 100 timed calls,
the L2 cache flushed (a 256 MB buffer rewritten) between calls, mean and std reported. A
device-to-device copy is timed the same way in the same run; GB/s counts the bytes a pass
must move (input read once, output written once, weights), and % copy compares with that copy.
With --backward it times forward+backward (grads of input and weight, and bias when present)
and backward alone; the bytes counted are x and y for the forward, grad_out and x read and
grad_input written for the backward; peak_mb is torch.cuda.max_memory_allocated during one
forward+backward, above what was allocated before it.
--suite models: the depthwise layers of MobileNetV2, EfficientNet-B0 and ConvNeXt-T, a dilated layer
and KernelBench 84, each in float32 / float16 / bfloat16, forward and forward+backward, NCHW and channels_last
(dwconv against eager NCHW and cuDNN channels_last); --plot FILE.png draws it. --suite large: the
same for large kernels (13, 31, 51), whose TFLOP/s column matters more than their GB/s.
Without a GPU it says so and runs a small correctness demo under the Triton interpreter.
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .bench_models import graphed

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    n: int
    c: int
    h: int
    w: int
    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    multiplier: int = 1
    bias: bool = False
    dtype: str = "float32"
    model: str = ""  # the network the layer comes from (suite "models")

    def flops(self, backward: bool = False) -> int:
        """Multiply-adds x 2 of the forward (each output: kernel^2 taps); the backward's grad_input
        and grad_weight are as many each. (The output size from dwconv's geometry, on meta tensors.)"""
        from ._geometry import conv_geometry

        x = torch.empty(self.n, self.c, self.h, self.w, device="meta")
        weight = torch.empty(self.c * self.multiplier, 1, self.kernel, self.kernel, device="meta")
        outputs = math.prod(conv_geometry(x, weight, None, self.stride, self.padding, self.dilation).output_shape)
        return 2 * outputs * self.kernel ** 2 * (2 if backward else 1)

    @property
    def label(self) -> str:
        return (f"{self.model + ' ' if self.model else ''}"
                f"{self.n}x{self.c}x{self.h}x{self.w} k{self.kernel} s{self.stride} p{self.padding} "
                f"d{self.dilation}{' m%d' % self.multiplier if self.multiplier > 1 else ''}"
                f"{' +b' if self.bias else ''} {self.dtype}")


KB84 = Case(64, 128, 256, 512, 3)
# Forward shapes of real layers: (N, C, H, W, k, stride, padding, dilation).
FORWARD_SHAPES = [
    Case(64, 144, 56, 56, 3, 1, 1, 1),
    Case(64, 96, 112, 112, 3, 2, 1, 1),
    Case(64, 240, 28, 28, 5, 1, 2, 1),
    Case(64, 96, 56, 56, 7, 1, 3, 1),
    Case(64, 384, 14, 14, 7, 1, 3, 1),
    Case(32, 256, 64, 64, 3, 1, 2, 2),
]
# Depthwise layers of real networks at batch 64, 224 x 224 (the shapes the models feed them; each
# distinct layer once), a dilated layer and KernelBench 84: the models suite, in both layouts and every dtype.
MODEL_LAYERS = [
    Case(64, 32, 112, 112, 3, 1, 1, model="MobileNetV2/EfficientNet-B0"),
    Case(64, 96, 112, 112, 3, 2, 1, model="MobileNetV2/EfficientNet-B0"),
    Case(64, 144, 56, 56, 3, 1, 1, model="MobileNetV2/EfficientNet-B0"),
    Case(64, 144, 56, 56, 3, 2, 1, model="MobileNetV2"),
    Case(64, 192, 28, 28, 3, 1, 1, model="MobileNetV2"),
    Case(64, 192, 28, 28, 3, 2, 1, model="MobileNetV2"),
    Case(64, 384, 14, 14, 3, 1, 1, model="MobileNetV2"),
    Case(64, 576, 14, 14, 3, 1, 1, model="MobileNetV2"),
    Case(64, 576, 14, 14, 3, 2, 1, model="MobileNetV2"),
    Case(64, 960, 7, 7, 3, 1, 1, model="MobileNetV2"),
    Case(64, 144, 56, 56, 5, 2, 2, model="EfficientNet-B0"),
    Case(64, 240, 28, 28, 5, 1, 2, model="EfficientNet-B0"),
    Case(64, 240, 28, 28, 3, 2, 1, model="EfficientNet-B0"),
    Case(64, 480, 14, 14, 3, 1, 1, model="EfficientNet-B0"),
    Case(64, 480, 14, 14, 5, 1, 2, model="EfficientNet-B0"),
    Case(64, 672, 14, 14, 5, 1, 2, model="EfficientNet-B0"),
    Case(64, 672, 14, 14, 5, 2, 2, model="EfficientNet-B0"),
    Case(64, 1152, 7, 7, 5, 1, 2, model="EfficientNet-B0"),
    Case(64, 1152, 7, 7, 3, 1, 1, model="EfficientNet-B0"),
    Case(64, 96, 56, 56, 7, 1, 3, model="ConvNeXt-T"),
    Case(64, 192, 28, 28, 7, 1, 3, model="ConvNeXt-T"),
    Case(64, 384, 14, 14, 7, 1, 3, model="ConvNeXt-T"),
    Case(64, 768, 7, 7, 7, 1, 3, model="ConvNeXt-T"),
    Case(32, 256, 64, 64, 3, 1, 2, 2, model="dilated"),
    replace(KB84, model="KernelBench 84"),
]
# Large kernels ('same' padding, RepLKNet and SLaK style), where arithmetic, not memory, sets the time.
LARGE_LAYERS = [Case(32, 128, 56, 56, 31, 1, 15, model="RepLKNet-style"),
                Case(32, 256, 28, 28, 13, 1, 6, model="RepLKNet-style"),
                Case(32, 128, 56, 56, 51, 1, 25, model="SLaK-style")]
# Datasheet peaks of the H200 SXM, dense (TFLOP/s): the ceilings the TFLOP/s column is read against.
PEAK_TFLOPS = {"float32 FMA": 67, "TF32 tensor": 495, "float16/bfloat16 tensor": 989}
SUITES = {
    "84": [replace(KB84, dtype=d) for d in DTYPES],
    "forward": [replace(KB84, dtype=d) for d in DTYPES]
    + [replace(c, dtype=d) for c in FORWARD_SHAPES for d in ("float32", "bfloat16")],
    # forward and forward+backward, NCHW and channels_last, all three dtypes (see main)
    "models": [replace(c, dtype=d) for c in MODEL_LAYERS for d in DTYPES],
    "large": [replace(c, dtype=d) for c in LARGE_LAYERS for d in DTYPES],
}
# suites timed in both layouts and both passes in one run
FULL_SUITES = ("models", "large")


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dwconv bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), help="a preset list of layers (overrides the shape flags)")
    p.add_argument("--cases", type=int, nargs="+", metavar="I",
                   help="only these rows of the suite (indices after the --dtype filter, from 0)")
    p.add_argument("-N", "--batch", type=int, default=KB84.n)
    p.add_argument("-C", "--channels", type=int, default=KB84.c)
    p.add_argument("-H", "--height", type=int, default=KB84.h)
    p.add_argument("-W", "--width", type=int, default=KB84.w)
    p.add_argument("-k", "--kernel", type=int, default=KB84.kernel)
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--padding", type=int, default=0)
    p.add_argument("--dilation", type=int, default=1)
    p.add_argument("--multiplier", type=int, default=1)
    p.add_argument("--bias", action="store_true")
    p.add_argument("--dtype", choices=sorted(DTYPES) + ["all"],
                   help="float32 unless --suite (then the suite's own dtypes; a dtype here keeps only its rows)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile(F.conv2d)")
    p.add_argument("--no-cudnn-cl", action="store_true", help="skip cuDNN with channels_last tensors")
    p.add_argument("--channels-last", action="store_true",
                   help="also time dwconv on channels_last tensors (path dwconv_cl; compare with cudnn_cl)")
    p.add_argument("--backward", action="store_true", help="time forward+backward and backward instead of forward")
    p.add_argument("--block", metavar="ACTIVATION",
                   help="time the depthwise block instead of the convolution: stock's convolution, BatchNorm2d "
                        "and this activation (a name of dwconv.activations.FUNCTIONS) against dwconv's, as "
                        "convert(fuse=True) runs it: eval mode (one fused call, the BatchNorm folded) and a "
                        "training step (the convolution, then BatchNorm and the activation on dwconv's kernels)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="time each call replayed from a CUDA graph (no host time: the kernels' own)")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--csv", metavar="FILE", help="write the rows to a CSV file (rewritten after each layer)")
    p.add_argument("--resume", action="store_true",
                   help="with --csv: keep the rows already in FILE and time only the layers it lacks "
                        "(a suite split over several runs, or one cut short)")
    p.add_argument("--plot", metavar="FILE.png", help="draw speedups and bandwidth per layer (needs matplotlib)")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="time a whole model (torchvision or timm name, or 'tiny'), stock against dwconv.convert: "
                        "training step and inference, eager and compiled, float32 and bf16 autocast channels_last "
                        "(repeatable; overrides the layer flags)")
    p.add_argument("--model-batch", type=int, default=64)
    p.add_argument("--fuse", action="store_true",
                   help="--model: also the model converted with fuse=True (BatchNorm folded, activation fused in "
                        "eval mode: the inference rows; BatchNorm on dwconv's kernels in training), its cold "
                        "start too")
    p.add_argument("--model-precision", choices=["float32", "bf16", "all"], default="all",
                   help="--model: float32 NCHW, bf16 autocast channels_last, or both")
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--cold-start", choices=["yes", "no", "only"], default="yes",
                   help="--model: also (or only) the first training steps in fresh processes with an empty Triton "
                        "cache, stock and dwconv (its first call warms up), and a second process on the warmed cache")
    p.add_argument("--model-compile", choices=["no", "default", "reduce-overhead", "all"], default="default",
                   help="--model: also time both models under torch.compile: its default mode, reduce-overhead "
                        "(CUDA graphs) alone, or all three with max-autotune-no-cudagraphs")
    p.add_argument("--model-eager", choices=["yes", "no"], default="yes",
                   help="--model: no: the torch.compile paths alone (no eager, CUDA-graph or profiler rows)")
    p.add_argument("--model-unfused", choices=["yes", "no"], default="yes",
                   help="--model with --fuse: no: stock's and the fused model's paths alone (not the model "
                        "converted without fuse)")
    p.add_argument("--cold-start-unwarmed", action="store_true",
                   help="--cold-start: also the converted model without its first-call warmup (each layer then "
                        "compiles at its first call, one after another)")
    p.add_argument("--cold-start-image", action="store_true",
                   help="--cold-start: also a container image's build (a process that sees no GPU compiles the "
                        "kernels, dwconv.warmup(..., arch, autocast)) and a fresh process's first step from its cache")
    return p.parse_args(argv)


def cases_from_args(args: argparse.Namespace) -> List[Case]:
    if args.suite:
        cases = [c for c in SUITES[args.suite] if args.dtype in (None, "all", c.dtype)]
        return [cases[i] for i in args.cases] if args.cases else cases
    dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype or "float32"]
    base = Case(args.batch, args.channels, args.height, args.width, args.kernel, args.stride, args.padding,
                args.dilation, args.multiplier, args.bias)
    return [replace(base, dtype=d) for d in dtypes]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def progress_bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


class Timer:
    """KernelBench's protocol: events around each call, L2 flushed between calls."""

    def __init__(self, warmup: int, iters: int):
        self.warmup, self.iters = warmup, iters
        self.flush_buffer = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[[], object]) -> List[float]:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for start, end in zip(starts, ends):
            self.flush_buffer.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _leaves(args: tuple):
    """Fresh leaves of the tensor arguments (None stays None), and the list of those to differentiate."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in args]
    return leaves, [t for t in leaves if t is not None]


def forward_backward(conv_fn: Callable, args: tuple, grad_out: torch.Tensor) -> Callable[[], object]:
    """The forward and the gradients of every tensor argument, on leaves of its own."""
    leaves, wrt = _leaves(args)
    return lambda: torch.autograd.grad(conv_fn(*leaves), wrt, grad_out)


def backward_only(conv_fn: Callable, args: tuple, grad_out: torch.Tensor) -> Callable[[], object]:
    """The gradients alone, through one forward kept alive. The forward runs at the first call (so
    on the stream that graphed() warms up and captures on, where the backward then runs too)."""
    leaves, wrt = _leaves(args)
    forward = []

    def run():
        if not forward:
            forward.append(conv_fn(*leaves))
        return torch.autograd.grad(forward[0], wrt, grad_out, retain_graph=True)
    return run


def make_inputs(case: Case, generator: torch.Generator):
    dtype = DTYPES[case.dtype]
    x = torch.randn(case.n, case.c, case.h, case.w, device="cuda", dtype=dtype, generator=generator)
    weight = torch.randn(case.c * case.multiplier, 1, case.kernel, case.kernel, device="cuda", dtype=dtype,
                         generator=generator) / case.kernel
    bias = torch.randn(case.c * case.multiplier, device="cuda", dtype=dtype, generator=generator) if case.bias else None
    return x, weight, bias


def meta_inputs(case: Case, memory_format=torch.contiguous_format, shape=None):
    """make_inputs' tensors on the meta device (shapes, strides, dtypes only: what a compile needs);
    shape: the input's, where it is not the case's."""
    dtype = DTYPES[case.dtype]
    x = torch.empty(shape or (case.n, case.c, case.h, case.w), device="meta", dtype=dtype, memory_format=memory_format)
    out_c = case.c * case.multiplier
    weight = torch.empty(out_c, 1, case.kernel, case.kernel, device="meta", dtype=dtype)
    return x, weight, torch.empty(out_c, device="meta", dtype=dtype) if case.bias else None


def check_values(out: torch.Tensor, x, weight, bias, case: Case) -> float:
    """Max abs error of dwconv against PyTorch in float32 (float64 for float32 inputs); raises past tolerance."""
    ref_dtype = torch.float64 if case.dtype == "float32" else torch.float32
    errors, scale = [], 0.0
    for i in range(0, case.n, 8):  # in batch slices, so the reference fits beside the big tensors
        sl = slice(i, i + 8)
        ref = F.conv2d(x[sl].to(ref_dtype), weight.to(ref_dtype), None if bias is None else bias.to(ref_dtype),
                       case.stride, case.padding, case.dilation, groups=case.c)
        errors.append((out[sl].to(ref_dtype) - ref).abs().max().item())
        scale = max(scale, ref.abs().max().item())
    max_err = max(errors)
    tol = 1e-4 if case.dtype == "float32" else 2 * torch.finfo(DTYPES[case.dtype]).eps * max(scale, 1.0)
    if not max_err <= tol:  # also catches NaN
        raise SystemExit(f"FAILED: {case.label}: max abs error {max_err:.3g} exceeds {tol:.3g}")
    return max_err


def measure_case(case: Case, args: argparse.Namespace, timer: Timer, copy_gbps: float) -> List[Dict]:
    import dwconv

    if args.block:
        return measure_block(case, args, timer, copy_gbps)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, weight, bias = make_inputs(case, gen)
    conv = dict(stride=case.stride, padding=case.padding, dilation=case.dilation)
    out = dwconv.depthwise_conv2d(x, weight, bias, **conv)
    max_err = check_values(out, x, weight, bias, case)
    if args.channels_last:
        out = dwconv.depthwise_conv2d(x.contiguous(memory_format=torch.channels_last), weight, bias, **conv)
        max_err = max(max_err, check_values(out, x, weight, bias, case))
    if args.backward:
        max_err = max(max_err, check_gradients(x, weight, bias, case))
        if args.channels_last:
            max_err = max(max_err, check_gradients(x.contiguous(memory_format=torch.channels_last), weight, bias, case))
    nbytes = x.numel() * x.element_size() + out.numel() * out.element_size() + weight.numel() * weight.element_size()
    backward_bytes = 2 * x.numel() * x.element_size() + out.numel() * out.element_size()
    del out

    convs: Dict[str, Callable] = {
        "dwconv": lambda x, w, b: dwconv.depthwise_conv2d(x, w, b, **conv),
        "eager": lambda x, w, b: F.conv2d(x, w, b, groups=case.c, **conv),
    }
    if args.channels_last:
        convs["dwconv_cl"] = convs["dwconv"]
    if not args.no_cudnn_cl:
        convs["cudnn_cl"] = convs["eager"]
    if args.compile:
        compiled = torch.compile(F.conv2d)
        convs["compile"] = lambda x, w, b: compiled(x, w, b, groups=case.c, **conv)

    rows = []
    for name, conv_fn in convs.items():
        if name in ("cudnn_cl", "dwconv_cl"):
            args_ = (x.contiguous(memory_format=torch.channels_last),
                     weight.contiguous(memory_format=torch.channels_last), bias)
        else:
            args_ = (x, weight, bias)
        if not args.backward:
            passes = {"forward": (lambda: conv_fn(*args_), nbytes)}
        else:
            grad_out = torch.randn_like(conv_fn(*args_), memory_format=torch.preserve_format)
            passes = {"fwd+bwd": (forward_backward(conv_fn, args_, grad_out), nbytes + backward_bytes),
                      "backward": (backward_only(conv_fn, args_, grad_out), backward_bytes)}
        for pass_name, (fn, pass_bytes) in passes.items():
            progress(f"{case.label}: timing {name} {pass_name}")
            peak_mb = float("nan")
            if pass_name == "fwd+bwd":
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn()
                torch.cuda.synchronize()
                peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
            times = timer(graphed(fn) if args.cuda_graphs else fn)
            mean = statistics.fmean(times)
            gbps = pass_bytes / mean / 1e6
            flops = case.flops(backward=pass_name == "backward") + (case.flops(True) if pass_name == "fwd+bwd" else 0)
            rows.append(dict(layer=case.label, dtype=case.dtype, path=name, **{"pass": pass_name}, ms=mean, std=statistics.pstdev(times),
                             median=statistics.median(times),
                             gbps=gbps, pct_copy=100 * gbps / copy_gbps, tflops=flops / mean / 1e9, peak_mb=peak_mb,
                             max_err=max_err if name.startswith("dwconv") else float("nan"),
                             cuda_graph=bool(args.cuda_graphs)))
        if args.backward:
            del grad_out, passes
    for row in rows:
        ours = next(r["ms"] for r in rows if r["path"] == "dwconv" and r["pass"] == row["pass"])
        row["dwconv_speedup"] = row["ms"] / ours
    return rows


def measure_block(case: Case, args: argparse.Namespace, timer: Timer, copy_gbps: float) -> List[Dict]:
    """The depthwise block (convolution, BatchNorm2d, activation), stock's kernels (NCHW and
    channels_last, and torch.compile of them with --compile) against dwconv's, as a model converted
    with fuse=True runs it: in eval mode ("block forward") stock's three kernels against one call,
    the BatchNorm folded into the weight and bias and the activation in the kernel's epilogue; in
    training ("block train step": forward, then the gradients of the input, the convolution's weight
    and the BatchNorm's weight and bias) stock's against the convolution and dwconv.batch_norm's
    passes. The bytes, the block's floor: eval the input read and the output written once; training
    as much again backward (the output's gradient read, the input read again, its gradient written)."""
    import dwconv

    from .activations import FUNCTIONS
    from .batch_norm import batch_norm_activation
    from .fuse import fold_batch_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x, weight, bias = make_inputs(case, gen)
    channels = weight.shape[0]
    norm = torch.nn.BatchNorm2d(channels).cuda().eval()
    with torch.no_grad():
        norm.running_mean.normal_(0, 0.1, generator=gen)
        norm.running_var.uniform_(0.5, 1.5, generator=gen)
        norm.weight.normal_(generator=gen)
        norm.bias.normal_(generator=gen)
        folded = [t.to(x.dtype) for t in fold_batch_norm(weight.float(), None if bias is None else bias.float(), norm)]
    activation, conv = FUNCTIONS[args.block], dict(stride=case.stride, padding=case.padding, dilation=case.dilation)
    train_norm = torch.nn.BatchNorm2d(channels).cuda().train()  # (training updates its own statistics)
    train_norm.load_state_dict(norm.state_dict())
    gamma, beta = train_norm.weight, train_norm.bias
    trained_weight = weight.detach().clone().requires_grad_()

    def stock(x):
        out = F.conv2d(x, weight, bias, groups=case.c, **conv)
        return activation(F.batch_norm(out, norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0,
                                       norm.eps))

    def fused(x):
        return dwconv.depthwise_conv2d(x, *folded, activation=args.block, **conv)

    def stock_train(x):
        return activation(train_norm(F.conv2d(x, trained_weight, bias, groups=case.c, **conv)))

    def fused_train(x):  # (as a fused block in training calls it: the C++ Function where the replayer is on)
        return batch_norm_activation(dwconv.depthwise_conv2d(x, trained_weight, bias, **conv), train_norm, args.block)

    layer = f"{case.label} +bn+{args.block}"
    max_err = {"block forward": 0.0, "block train step": 0.0}
    tol_scale = 1e-4 if case.dtype == "float32" else 4 * torch.finfo(DTYPES[case.dtype]).eps
    for layout in (torch.contiguous_format, torch.channels_last):
        xl = x.contiguous(memory_format=layout)
        x64, w64, b64 = xl.double(), weight.double(), None if bias is None else bias.double()
        with torch.no_grad():
            out = fused(xl)
            ref = activation(F.batch_norm(F.conv2d(x64, w64, b64, groups=case.c, **conv),
                                          *[t.double() for t in (norm.running_mean, norm.running_var, norm.weight,
                                                                 norm.bias)], False, 0.0, norm.eps))
        checks = [("block forward", out, ref)]
        # (training: BatchNorm and the activation checked from the convolution's own output, so that a
        # ReLU6 kink falls alike; the convolution's gradients are checked by --backward)
        with torch.no_grad():
            y = dwconv.depthwise_conv2d(xl, trained_weight, bias, **conv).requires_grad_()
        out = batch_norm_activation(y, train_norm, args.block)
        grad = torch.randn(out.shape, device="cuda", generator=gen, dtype=out.dtype)
        (grad_y,) = torch.autograd.grad(out, [y], grad)
        y64 = y.detach().double().requires_grad_()
        ref = activation(F.batch_norm(y64, None, None, gamma.double(), beta.double(), True, 0.0, norm.eps))
        (ref_grad_y,) = torch.autograd.grad(ref, [y64], grad.double())
        checks += [("block train step", out, ref), ("block train step", grad_y, ref_grad_y)]
        for what, got, expected in checks:
            err = (got.double() - expected).abs().max().item()
            tol = tol_scale * max(expected.abs().max().item(), 1.0)
            if not err <= tol:
                raise SystemExit(f"FAILED: {layer} ({what}): max abs error {err:.3g} exceeds {tol:.3g}")
            max_err[what] = max(max_err[what], err)
    in_bytes, out_bytes = x.numel() * x.element_size(), out.numel() * out.element_size()
    del out, ref, grad_y, ref_grad_y, y, y64
    rows = []
    for step, nbytes, paths in (
            ("block forward", in_bytes + out_bytes, {"dwconv": (fused, 0), "eager": (stock, 0),
                                                     "dwconv_cl": (fused, 1), "cudnn_cl": (stock, 1)}),
            ("block train step", 3 * in_bytes + 2 * out_bytes, {"dwconv": (fused_train, 0), "eager": (stock_train, 0),
                                                                "dwconv_cl": (fused_train, 1),
                                                                "cudnn_cl": (stock_train, 1)})):
        if args.compile:
            paths["compile"] = (torch.compile(stock if step == "block forward" else stock_train), 1)
        training = step != "block forward"
        for name, (fn, channels_last) in paths.items():
            xl = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
            xl.requires_grad_(training)
            grad = torch.randn(fn(xl).shape, device="cuda", dtype=x.dtype).contiguous(
                memory_format=torch.channels_last if channels_last else torch.contiguous_format)

            def call(fn=fn, xl=xl, grad=grad):
                if training:
                    torch.autograd.grad(fn(xl), [xl, trained_weight, gamma, beta], grad)
                else:
                    with torch.no_grad():
                        fn(xl)

            progress(f"{layer}: timing {step} {name}")
            try:
                times = timer(graphed(call) if args.cuda_graphs else call)
            except RuntimeError as error:  # (a capture that fails is reported, the other rows still come, and
                FAILED_PATHS.append(f"{layer} {step} {name}: {type(error).__name__}: "  # the run exits 1)
                                    f"{str(error).splitlines()[0]}")
                print(f"FAILED: {FAILED_PATHS[-1]}", flush=True)
                continue
            mean = statistics.fmean(times)
            gbps = nbytes / mean / 1e6
            rows.append(dict(layer=layer, dtype=case.dtype, path=name, **{"pass": step}, ms=mean,
                             std=statistics.pstdev(times), median=statistics.median(times), gbps=gbps,
                             pct_copy=100 * gbps / copy_gbps,
                             tflops=case.flops(backward=training) / mean / 1e9, peak_mb=float("nan"),
                             max_err=max_err[step] if name.startswith("dwconv") else float("nan"),
                             cuda_graph=bool(args.cuda_graphs)))
    for row in rows:
        row["dwconv_speedup"] = row["ms"] / next((r["ms"] for r in rows if r["path"] == "dwconv"
                                                  and r["pass"] == row["pass"]), float("nan"))
    return rows


def check_gradients(x, weight, bias, case: Case) -> float:
    """Max error of dwconv's gradients against PyTorch's in float64, on the first 4 images
    (relative to the largest gradient for 16-bit dtypes); raises past tolerance."""
    import dwconv

    conv = dict(stride=case.stride, padding=case.padding, dilation=case.dilation)
    xs = x[:4].detach().clone()
    leaves = [t.detach().clone().requires_grad_() for t in (xs, weight, bias) if t is not None]
    out = dwconv.depthwise_conv2d(*leaves[:2], leaves[2] if bias is not None else None, **conv)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_out = F.conv2d(*ref_leaves[:2], ref_leaves[2] if bias is not None else None, groups=case.c, **conv)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, grad_out.double())
    worst = 0.0
    for got, ref in zip(grads, ref_grads):
        scale = max(ref.abs().max().item(), 1.0)
        err = (got.double() - ref).abs().max().item() / scale
        tol = 1e-5 if case.dtype == "float32" else 4 * torch.finfo(DTYPES[case.dtype]).eps
        if not err <= tol:
            raise SystemExit(f"FAILED: {case.label}: gradient error {err:.3g} (relative) exceeds {tol:.3g}")
        worst = max(worst, err)
    return worst


def checked_and_timed(call: Callable[[], torch.Tensor], exact: Optional[torch.Tensor], timer: Optional[Timer],
                      what: str, tolerance: float = 0.05) -> Tuple[torch.Tensor, float, float]:
    """A developer tool's path (benchmarks/fold_ab.py, input_activation_ab.py): (its output, ms, error).
    error: the largest deviation from exact (float64; None: not checked, NaN) over exact's largest
    magnitude (at least 1), raising past tolerance; ms: the mean of timer's calls, or without a timer
    (a CPU smoke run, no measurement) one call's wall time."""
    out = call()
    error = float("nan")
    if exact is not None:
        error = (out.double() - exact).abs().max().item() / max(1.0, exact.abs().max().item())
        assert error < tolerance, f"{what}: {error:.3g} of the largest output off float64's"
    if timer is not None:
        return out, statistics.fmean(timer(call)), error
    started = time.perf_counter()
    call()
    return out, (time.perf_counter() - started) * 1e3, error


def measure_copy(timer: Timer) -> float:
    """Device-to-device copy bandwidth (bytes read + written) of a 2 GiB tensor, GB/s."""
    src = torch.empty(2**31, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    times = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / statistics.fmean(times) / 1e6


def print_table(rows: List[Dict], copy_gbps: float) -> None:
    print(f"\ndevice copy: {copy_gbps:.0f} GB/s (read + write), measured in this run")
    if rows and rows[0].get("cuda_graph"):
        print("every call replayed from a CUDA graph: GPU time alone, no host time")
    width = max([44] + [len(r["layer"]) for r in rows])
    header = (f"{'layer':<{width}} {'path':<9} {'pass':<8} {'ms':>9} {'std':>7} {'GB/s':>7} {'%copy':>6} "
              f"{'TFLOP/s':>7} {'peak MB':>8} {'dwconv x':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        peak = "" if r["peak_mb"] != r["peak_mb"] else f"{r['peak_mb']:.0f}"
        tflops = r.get("tflops", float("nan"))  # (rows of a CSV from before the column: NaN)
        print(f"{r['layer']:<{width}} {r['path']:<9} {r['pass']:<8} {r['ms']:9.4f} {r['std']:7.4f} {r['gbps']:7.0f} "
              f"{r['pct_copy']:6.1f} {tflops:7.1f} {peak:>8} {r['dwconv_speedup']:8.2f}")
    print("TFLOP/s: 2 x multiply-adds (the backward's grad_input and grad_weight as many as the forward) over "
          "the time; H200 datasheet peaks: " + ", ".join(f"{k} {v}" for k, v in PEAK_TFLOPS.items()))


def environment() -> str:
    import triton

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no GPU)"
    return f"{name}, torch {torch.__version__}, triton {triton.__version__}"


def demo_without_gpu() -> int:
    """No GPU: run the kernels under the Triton interpreter on small CPU tensors and compare."""
    print("No CUDA GPU found: nothing to time. Running a small correctness demo of dwconv's Triton kernels "
          "under the Triton interpreter (TRITON_INTERPRET=1) on the CPU instead.")
    os.environ["TRITON_INTERPRET"] = "1"  # before dwconv's kernels are decorated
    import dwconv
    from dwconv.functional import triton_interpreter_enabled

    if not triton_interpreter_enabled():
        print("Triton was already imported without TRITON_INTERPRET=1; run `TRITON_INTERPRET=1 python -m dwconv bench`.")
        return 1
    torch.manual_seed(0)
    demos = [Case(2, 4, 16, 32, 3), Case(2, 3, 13, 17, 5, 2, 2, 1, 2, True), Case(1, 4, 15, 15, 3, 1, 2, 2)]
    worst = 0.0
    for case in demos:
        x = torch.randn(case.n, case.c, case.h, case.w, requires_grad=True)
        weight = torch.randn(case.c * case.multiplier, 1, case.kernel, case.kernel, requires_grad=True)
        bias = torch.randn(case.c * case.multiplier, requires_grad=True) if case.bias else None
        leaves = [t for t in (x, weight, bias) if t is not None]
        conv = dict(stride=case.stride, padding=case.padding, dilation=case.dilation)
        start = time.perf_counter()
        out = dwconv.depthwise_conv2d(x, weight, bias, **conv)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, grad_out)
        seconds = time.perf_counter() - start
        refs = [t.detach().double().requires_grad_() for t in leaves]
        ref = F.conv2d(refs[0], refs[1], refs[2] if bias is not None else None, groups=case.c, **conv)
        ref_grads = torch.autograd.grad(ref, refs, grad_out.double())
        err = (out.double() - ref).abs().max().item()
        grad_err = max((g.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
                       for g, r in zip(grads, ref_grads))
        worst = max(worst, err, grad_err)
        print(f"  {case.label:<44} out {tuple(out.shape)}  max error vs float64: output {err:.2e}, "
              f"gradients {grad_err:.2e} (relative)  ({seconds:.2f} s interpreted, forward + backward)")
    ok = worst <= 1e-4
    print("demo passed" if ok else f"demo FAILED: max abs error {worst:.3g}")
    return 0 if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        return demo_without_gpu()
    print(environment())
    from . import replay

    # (built before timing, so that every timed call takes the eager path it will keep)
    print("dwconv's eager path:", "C++ replayer" if replay.prepare() else "Python autograd Function")
    if args.model:
        from .bench_models import bench_model, print_model_table

        rows = []
        if args.cold_start != "no":
            from .bench_models import cold_start

            rows += [r for name in args.model for r in cold_start(name, args.model_batch, args.image,
                                                                  args.model_precision,
                                                                  without_warmup=args.cold_start_unwarmed,
                                                                  from_image=args.cold_start_image,
                                                                  fuse=args.fuse)]
        if args.cold_start != "only":
            steady = [r for name in args.model for r in bench_model(name, args.model_batch, args.image, args.warmup,
                                                                    min(args.iters, 20),
                                                                    compile_modes=args.model_compile,
                                                                    precisions=args.model_precision,
                                                                    eager=args.model_eager == "yes",
                                                                    fuse=args.fuse,
                                                                    unfused=args.model_unfused == "yes")]
            print_model_table(steady)
            rows += steady
        write_csv(args.csv, rows)
        return 0
    timer = Timer(args.warmup, args.iters)
    progress("timing the device copy")
    copy_gbps = measure_copy(timer)
    rows: List[Dict] = read_csv_rows(args.csv) if args.resume and args.csv and os.path.exists(args.csv) else []
    done = {row["layer"] for row in rows}
    cases = [case for case in cases_from_args(args) if case.label not in done]
    # the models suite: both layouts and both passes in one run
    runs = ([argparse.Namespace(**{**vars(args), "channels_last": True, "backward": b}) for b in (False, True)]
            if args.suite in FULL_SUITES and not args.block else [args])
    for i, case in enumerate(cases):
        progress(f"{progress_bar(i, len(cases))} {case.label}")
        for run_args in runs:
            rows += measure_case(case, run_args, timer, copy_gbps)
            torch.cuda.empty_cache()
        # the rows so far, after each case: a run cut short (a device call's time limit) keeps them
        write_csv(args.csv, [{"copy_gbps": copy_gbps, **row} for row in rows], quiet=True, suite=args.suite or "")
    progress(progress_bar(len(cases), len(cases)))
    print_table(rows, copy_gbps)
    write_csv(args.csv, [{"copy_gbps": copy_gbps, **row} for row in rows], suite=args.suite or "")  # (resumed rows keep their run's copy)
    if args.plot:
        from .bench_plot import plot_rows

        plot_rows(rows, copy_gbps, args.plot, environment())
        print(f"wrote {args.plot}")
    for failure in FAILED_PATHS:
        print(f"FAILED: {failure}")
    return 1 if FAILED_PATHS else 0


FAILED_PATHS: List[str] = []  # (paths of --block whose timing raised: named again at the end, exit status 1)

# The results CSVs' one schema (docs/data, docs/performance.md): a row a (layer, pass, path).
CSV_FIELDS = ("suite", "layer", "dtype", "layout", "pass", "path", "ms", "std", "gbps", "pct_copy", "tflops",
              "gpu", "torch", "triton", "commit", "date", "median", "peak_mb", "max_err", "cuda_graph",
              "copy_gbps", "dwconv_speedup")
_NUMBERS = ("ms", "std", "median", "gbps", "pct_copy", "tflops", "peak_mb", "max_err", "dwconv_speedup", "copy_gbps")


def read_csv_rows(path: str) -> List[Dict]:
    """The rows of an earlier run's --csv file, with their numbers as numbers (for --resume)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in _NUMBERS:
            if row.get(key, "") != "":
                row[key] = float(row[key])
        if "cuda_graph" in row:
            row["cuda_graph"] = row["cuda_graph"] == "True"
    return rows


@functools.lru_cache(maxsize=1)
def run_stamp() -> Dict[str, str]:
    """GPU, versions, commit (DWCONV_COMMIT, else git's where the tree has one) and date of this run
    (once a run: the CSV is rewritten after each layer)."""
    import datetime
    import subprocess

    import triton

    commit = os.environ.get("DWCONV_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return dict(gpu=gpu, torch=torch.__version__.split("+")[0], triton=triton.__version__, commit=commit,
                date=datetime.date.today().isoformat())


def schema_row(row: Dict, stamp: Dict[str, str], suite: str = "") -> Dict:
    """A row in CSV_FIELDS: dtype from the layer's label, layout from the path (_cl: channels_last)."""
    row = {**stamp, **{k: v for k, v in row.items() if v != ""}}
    row.setdefault("suite", suite or "custom")
    row.setdefault("dtype", str(row.get("layer", "")).rsplit(" ", 1)[-1])
    row.setdefault("layout", "channels_last" if str(row.get("path", "")).endswith("_cl") else "nchw")
    return {field: row.get(field, "") for field in CSV_FIELDS}


def write_csv(path: Optional[str], rows: List[Dict], quiet: bool = False, suite: str = "") -> None:
    if not path or not rows:
        return
    stamp = dict(run_stamp())
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(schema_row(row, stamp, suite))
    if not quiet:
        print(f"wrote {path}")
