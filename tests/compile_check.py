"""Compiles dwconv's kernels for an H100/H200 (sm_90) on a machine without a GPU, with the GPU
configurations the launchers pick there, and launches nothing.

The Triton interpreter, which runs the tests on CPU tensors, never compiles a kernel: a kernel that
interprets fine can still fail to compile, or compile under one Triton and not another (once:
a str default of a constexpr parameter compiled under Triton 3.9 and not 3.6, and every GPU backward
raised). tests/test_compile.py runs this script in a fresh process (no TRITON_INTERPRET) under the
installed Triton and, when scripts/setup.sh has put it there, under the GPU machine's Triton 3.6.

    python tests/compile_check.py      # prints each kernel and configuration; exit status 1 on a failure
"""

import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # (must be unset before the kernels are decorated)

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from dwconv._triton_compat import compile_only  # noqa: E402

COMPILED = []  # (kernel name, CompiledKernel: .asm["ptx"] etc.) of every launch
H100_SHARED_MEMORY = 232448  # bytes a block may use on sm_90 (the H200's limit too)
compile_only(90, lambda name, compiled, seconds: COMPILED.append((name, compiled)))

from dwconv import tuning  # noqa: E402

tuning.override(plan_as_gpu=True)  # the launchers' GPU choices for these CPU tensors (what the GPU compiles)

from dwconv._geometry import conv_geometry, forward_activation_code  # noqa: E402
from dwconv.kernels.batch_norm import EvalNorm  # noqa: E402
from dwconv.dispatch import (ForwardConfig, GradWeightConfig, conv_forward, conv_grad_input,  # noqa: E402
                             conv_grad_input_and_weight, conv_grad_weight, launch_forward)

CL = torch.channels_last


def tensors(shape, kernel, dtype, stride=1, padding=0, dilation=1, multiplier=1, layout=torch.contiguous_format):
    x = torch.randn(shape).to(dtype).contiguous(memory_format=layout)
    weight = torch.randn(shape[1] * multiplier, 1, *kernel).to(dtype)
    geom = conv_geometry(x, weight, None, stride, padding, dilation)
    grad_out = torch.randn(geom.output_shape).to(dtype).contiguous(memory_format=layout)
    return x, weight, geom, grad_out


def forward(shape, kernel, dtype, config, activation=0, input_norm=False, **conv):
    """input_norm: each input channel scaled and shifted as it loads (a fused block's BatchNorm before)."""
    x, weight, geom, _ = tensors(shape, kernel, dtype, **conv)
    channels = shape[1]
    norm = EvalNorm(torch.randn(channels), torch.randn(channels), torch.randn(channels), torch.rand(channels) + 1,
                    1e-5) if input_norm else None
    conv_forward(x, weight, torch.randn(weight.shape[0]).to(dtype), geom, config, activation=activation,
                 input_norm=norm)


def fused_backward(shape, kernel, dtype, config, **conv):
    x, weight, geom, grad_out = tensors(shape, kernel, dtype, **conv)
    conv_grad_input_and_weight(grad_out, x, weight, geom, config)


def capped_fused_backward(shape, kernel, dtype, config, **conv):
    """The fused channels_last pass, whose half-precision default cap (tuning: nhwc_fused_half_maxnreg)
    must reach ptxas."""
    before = len(COMPILED)
    fused_backward(shape, kernel, dtype, config, **conv)
    capped = {k: c.metadata.maxnreg for k, c in COMPILED[before:]}
    assert capped.get("depthwise_grad_nhwc_pixels_kernel") == 128, capped


def grad_weight(shape, kernel, dtype, config, **conv):
    x, weight, geom, grad_out = tensors(shape, kernel, dtype, **conv)
    conv_grad_weight(grad_out, x, geom, dtype, True, config)


def large_fma_grad_weight(shape, kernel, dtype, config, **conv):
    from dwconv.kernels.large_fma import large_fma_grad_weight as grad_weight_fma

    x, weight, geom, grad_out = tensors(shape, kernel, dtype, **conv)
    grad_weight_fma(grad_out, x, geom, dtype, True)


def forward_weight_vectors(shape, kernel, dtype, config, **conv):
    with tuning.override(weight_vectors_min_taps=0):
        flipped_forward(shape, kernel, dtype, config, **conv)


def flipped_forward(shape, kernel, dtype, config, **conv):
    x, weight, geom, _ = tensors(shape, kernel, dtype, **conv)
    launch_forward(x, weight, None, geom, config, flip_weight=True)


def grad_input(shape, kernel, dtype, **conv):
    x, weight, geom, grad_out = tensors(shape, kernel, dtype, **conv)
    conv_grad_input(grad_out, weight, geom, x)


f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
# The GPU's choices (forward_config, fused_backward_config, grad_weight_config) at small sizes that
# keep the same constexprs: kb84-like rows of 510 outputs, narrow rows, strides, dilation, NHWC.
CASES = [
    ("rows, 4-vectors, odd output rows aligned", forward, ((1, 2, 18, 512), (3, 3), f32, ForwardConfig("rows", 128, 512, 2, 4)), {}),
    ("rows, 4-vectors, bfloat16", forward, ((1, 2, 18, 512), (3, 3), bf16, ForwardConfig("rows", 128, 512, 2, 4)), {}),
    ("rows, 1 column a lane, dilation", forward, ((1, 2, 40, 64), (3, 3), f32, ForwardConfig("rows", 32, 64, 1)),
     dict(padding=2, dilation=2)),
    ("nchw pixels, kb84's rows (pair stores)", forward, ((1, 2, 18, 512), (3, 3), f32,
                                                       ForwardConfig("nchw_pixels", 4, 128, 1)), {}),
    ("nchw pixels, whole 510-column rows (the GPU's float32 kb84 choice)", forward, ((1, 2, 18, 512), (3, 3), f32,
                                                                          ForwardConfig("nchw_pixels", 8, 512, 4)), {}),
    ("nchw pixels, bfloat16 whole rows (the GPU's half-precision kb84 choice)", forward,
     ((1, 2, 18, 512), (3, 3), bf16, None), {}),
    ("nchw pixels, flipped taps (grad_input)", flipped_forward, ((1, 2, 18, 512), (3, 3), f32,
                                                                ForwardConfig("nchw_pixels", 4, 128, 1)), {}),
    ("tile, stride 2, multiplier 2", forward, ((1, 2, 20, 20), (3, 3), f32, ForwardConfig("tile", 4, 64, 2)),
     dict(stride=2, padding=1, multiplier=2)),
    ("pairs, float32, MobileNet's stride 2 (the GPU's choice)", forward, ((1, 2, 40, 112), (3, 3), f32, None),
     dict(stride=2, padding=1)),
    ("pairs, bfloat16, k3, row dilation 2, odd rows, multiplier 2", forward, ((1, 2, 20, 61), (3, 3), bf16, None),
     dict(stride=2, padding=2, dilation=(2, 1), multiplier=2)),
    ("tile, float64", forward, ((1, 2, 20, 20), (5, 5), f64, ForwardConfig("tile", 8, 16, 2)), dict(padding=2)),
    ("nhwc, float32", forward, ((1, 64, 12, 12), (3, 3), f32, ForwardConfig("nhwc", 8, 8, 4, block_c=64)),
     dict(padding=1, layout=CL)),
    ("nhwc, bfloat16, band of 16", forward, ((1, 64, 20, 12), (3, 3), bf16, ForwardConfig("nhwc", 16, 8, 4, block_c=32)),
     dict(padding=1, layout=CL)),
    ("nhwc, bfloat16, k7", forward, ((1, 96, 12, 12), (7, 7), bf16, ForwardConfig("nhwc", 5, 8, 4, block_c=32)),
     dict(padding=3, layout=CL)),
    ("nhwc pixels, float32", forward, ((1, 128, 12, 20), (3, 3), f32, ForwardConfig("nhwc_pixels", 2, 8, 1, block_c=128)),
     dict(padding=1, layout=CL)),
    # (the GPU's blocks are larger: 4 x 8 and 4 x 4 outputs; these smaller ones build the same code
    # paths and compile in seconds, where 4 x 4 k7 took ~50 s a Triton version)
    ("nhwc pixels, bfloat16, 2 warps of pairs", forward, ((1, 128, 12, 20), (3, 3), bf16,
                                                          ForwardConfig("nhwc_pixels", 2, 4, 2, block_c=128)),
     dict(padding=1, layout=CL)),
    ("nhwc pixels, bfloat16, k7 stride 2", forward, ((1, 96, 16, 20), (7, 7), bf16,
                                                    ForwardConfig("nhwc_pixels", 2, 2, 1, block_c=32)),
     dict(stride=2, padding=3, layout=CL)),
    ("nhwc pixels, bfloat16 pairs, ReLU6 of the input as it loads and of the output (a fused eval block)", forward,
     ((1, 128, 12, 20), (3, 3), bf16, ForwardConfig("nhwc_pixels", 2, 4, 2, block_c=128)),
     dict(padding=1, layout=CL, activation=forward_activation_code(("relu6", "relu6")))),
    ("nhwc pixels, bfloat16 pairs, k5 stride 2, SiLU of the input through tanh.approx (EfficientNet's eval blocks)",
     forward, ((1, 128, 14, 14), (5, 5), bf16, ForwardConfig("nhwc_pixels", 2, 7, 2, block_c=128)),
     dict(stride=2, padding=2, layout=CL, activation=forward_activation_code(("silu", "silu")))),
    ("nhwc, bfloat16, k7, SiLU of the input as it loads", forward,
     ((1, 96, 12, 12), (7, 7), bf16, ForwardConfig("nhwc", 5, 8, 4, block_c=32)),
     dict(padding=3, layout=CL, activation=forward_activation_code(("silu", "identity")))),
    ("nhwc pixels, bfloat16 pairs, k3, the BatchNorm and SiLU before applied as the input loads (EfficientNet's)",
     forward, ((1, 128, 12, 20), (3, 3), bf16, ForwardConfig("nhwc_pixels", 2, 4, 2, block_c=128)),
     dict(padding=1, layout=CL, activation=forward_activation_code(("silu", "silu")), input_norm=True)),
    ("nhwc, bfloat16, k5 stride 2, the BatchNorm and ReLU6 before applied as the input loads", forward,
     ((1, 96, 12, 12), (5, 5), bf16, ForwardConfig("nhwc", 4, 8, 4, block_c=32)),
     dict(stride=2, padding=2, layout=CL, activation=forward_activation_code(("relu6", "relu6")), input_norm=True)),
    ("nhwc, k17 (kernel-row loop)", forward, ((1, 32, 20, 20), (17, 17), f32, ForwardConfig("nhwc", 1, 8, 4, block_c=32)),
     dict(padding=8, layout=CL)),
    # (the GPU's blocks for the large suite's layers, at a small batch: 28 outputs a thread, one warp)
    ("large_fma, float32 k31 (the CUDA-core large kernel)", forward, ((1, 2, 56, 56), (31, 31), f32,
                                                                     ForwardConfig("large_fma", 16, 56, 1, 28)),
     dict(padding=15)),
    ("large_fma, weight vectors, flipped taps, whole 56-wide rows a thread (k31's default)", forward_weight_vectors,
     ((1, 2, 56, 56), (31, 31), f32, ForwardConfig("large_fma", 32, 56, 1, 56)), dict(padding=15)),
    ("large_fma, bfloat16 k3 stride 2 (column steps)", forward, ((1, 2, 28, 28), (3, 3), bf16,
                                                                 ForwardConfig("large_fma", 32, 16, 1, 16)),
     dict(stride=2, padding=1)),
    ("large_fma grad_weight, float32 k3 stride 2, dilation 2", large_fma_grad_weight,
     ((1, 2, 28, 28), (3, 3), f32, None), dict(stride=2, padding=2, dilation=2)),
    ("large_fma, flipped taps, odd rows (grad_input)", flipped_forward, ((1, 2, 13, 29), (13, 13), f32,
                                                                       ForwardConfig("large_fma", 16, 32, 1, 8)),
     dict(padding=6)),
    ("large_fma grad_weight, float32 k31", large_fma_grad_weight, ((1, 2, 56, 56), (31, 31), f32, None),
     dict(padding=15)),
    ("large_fma, bfloat16 k7 (mid-sized kernels in half precision)", forward,
     ((1, 2, 28, 28), (7, 7), bf16, ForwardConfig("large_fma", 32, 32, 2, 16)), dict(padding=3)),
    ("large_fma grad_weight, bfloat16 k5", large_fma_grad_weight, ((1, 2, 28, 28), (5, 5), bf16, None),
     dict(padding=2)),
    ("fused backward, float32", fused_backward, ((1, 2, 18, 512), (3, 3), f32, ForwardConfig("rows", 128, 512, 2, 4)), {}),
    ("fused backward, bfloat16", fused_backward, ((1, 2, 18, 512), (3, 3), bf16, ForwardConfig("rows", 128, 128, 1, 4)), {}),
    ("fused backward nchw pixels, float32 (kb84's grad_input rows)", fused_backward,
     ((1, 2, 18, 512), (3, 3), f32, ForwardConfig("nchw_pixels", 4, 256, 2)), {}),
    ("fused backward nchw pixels, bfloat16 (narrow rows)", fused_backward,
     ((1, 2, 18, 56), (3, 3), bf16, ForwardConfig("nchw_pixels", 4, 128, 1)), dict(padding=1)),
    ("fused backward nchw pixels, bfloat16", fused_backward,
     ((1, 2, 18, 512), (3, 3), bf16, ForwardConfig("nchw_pixels", 4, 128, 1)), {}),
    ("fused backward nhwc, bfloat16 pairs, 128 registers", capped_fused_backward,
     ((1, 128, 12, 20), (3, 3), bf16, ForwardConfig("nhwc_pixels", 2, 4, 2, block_c=128)), dict(padding=1, layout=CL)),
    ("fused backward nhwc rows, bfloat16 pairs", fused_backward,
     ((1, 128, 12, 20), (3, 3), bf16, ForwardConfig("nhwc_rows", 12, 4, 2, block_c=128)), dict(layout=CL)),
    ("fused backward nhwc rows, 8 wide, prefetch (the GPU's 56-wide default)", fused_backward,
     ((1, 64, 12, 56), (3, 3), f32, ForwardConfig("nhwc_rows", 6, 8, 1, block_c=32, prefetch=True)),
     dict(padding=1, layout=CL)),
    ("grad_weight, 4-vectors, 4 rows a step", grad_weight, ((1, 2, 18, 512), (3, 3), f32, GradWeightConfig(512, 4, 4, 64, 4)), {}),
    ("grad_weight, bfloat16", grad_weight, ((1, 2, 18, 512), (3, 3), bf16, GradWeightConfig(512, 2, 4, 64, 4)), {}),
    ("grad_weight, k7, 1 column a lane", grad_weight, ((2, 2, 20, 20), (7, 7), f32, GradWeightConfig(32, 1, 1, 8, 1)),
     dict(padding=3)),
    ("grad_weight, nhwc, float32", grad_weight, ((1, 64, 12, 12), (3, 3), f32, GradWeightConfig(16, 4, 1, 64, block_c=64)),
     dict(padding=1, layout=CL)),
    ("grad_weight, nhwc, bfloat16, k7", grad_weight, ((1, 96, 12, 12), (7, 7), bf16,
                                                     GradWeightConfig(16, 4, 1, 64, block_c=64)), dict(padding=3, layout=CL)),
    ("grad_weight nhwc pixels, bfloat16 pairs, bias", grad_weight, ((1, 128, 12, 20), (3, 3), bf16,
                                                                  ForwardConfig("nhwc_pixels", 2, 4, 2, block_c=128)),
     dict(padding=1, layout=CL)),
    ("grad_weight nhwc pixels, k5, stride 2, multiplier 2", grad_weight, ((1, 16, 16, 20), (5, 5), f32,
                                                                         ForwardConfig("nhwc_pixels", 2, 2, 1, block_c=32)),
     dict(stride=2, padding=2, multiplier=2, layout=CL)),
    ("toeplitz, float32 (tf32x3), k31", forward, ((1, 2, 40, 40), (31, 31), f32, None), dict(padding=15)),
    ("toeplitz, bfloat16, k13, bias", forward, ((2, 2, 20, 20), (13, 13), bf16, None), dict(padding=6)),
    ("toeplitz, float16, k51, nhwc through the layout transposes", forward, ((1, 8, 60, 60), (51, 51), f16, None), dict(padding=25, layout=CL)),
    ("toeplitz, float32, k51, 128-row products", forward, ((3, 2, 60, 60), (51, 51), f32, None), dict(padding=25)),
    ("toeplitz, stride 2, dilation 2, multiplier 2", forward, ((1, 2, 40, 40), (11, 11), bf16, None),
     dict(stride=2, padding=10, dilation=2, multiplier=2)),
    ("grad_weight toeplitz, float32, k31", grad_weight, ((1, 2, 40, 40), (31, 31), f32, None), dict(padding=15)),
    ("grad_weight toeplitz, bfloat16, k13", grad_weight, ((2, 2, 20, 20), (13, 13), bf16, None), dict(padding=6)),
    ("grad_input phases, stride 2", grad_input, ((1, 2, 20, 20), (3, 3), f32), dict(stride=2, padding=1)),
    ("grad_input phases, nhwc, stride 2", grad_input, ((1, 64, 20, 20), (3, 3), bf16), dict(stride=2, padding=1, layout=CL)),
    ("grad_input phases, nhwc, k5 stride 2 (shared loads)", grad_input, ((1, 64, 20, 20), (5, 5), bf16),
     dict(stride=2, padding=2, layout=CL)),
    ("grad_input phases, stride (2, 3) on 6-group rows (a phase at a time)", grad_input, ((1, 2, 19, 18), (9, 12), f32),
     dict(stride=(2, 3), padding=(3, 5))),
    ("grad_input phases, stride (3, 2), dilation 2, multiplier 2", grad_input, ((1, 2, 20, 21), (3, 5), f32),
     dict(stride=(3, 2), padding=(2, 3), dilation=2, multiplier=2)),
]


def batch_norm(shape, dtype, activation, layout=torch.contiguous_format, affine=True, vectors=False):
    """BatchNorm's training kernels with the activation, forward and backward (dwconv.batch_norm).
    vectors: the tile passes' loads and stores of the tensor must be 16-byte vectors (sizes and
    strides multiples of 16 elements): scalar 2-byte ones read about 1 TB/s on the H100."""
    import re

    from dwconv.kernels.batch_norm import batch_norm_backward, batch_norm_forward

    before = len(COMPILED)
    y = torch.randn(shape).to(dtype).contiguous(memory_format=layout)
    channels = shape[1]
    weight, bias = (torch.randn(channels), torch.randn(channels)) if affine else (None, None)
    out, mean, invstd = batch_norm_forward(y, weight, bias, torch.zeros(channels), torch.ones(channels), 0.1, 1e-5,
                                           activation)
    batch_norm_backward(torch.randn_like(out), y, weight, bias, mean, invstd, 1e-5, activation)
    for kernel, compiled in COMPILED[before:] if vectors else ():
        narrow = re.findall(r"(?:ld|st)\.global\.b16", compiled.asm["ptx"])
        assert not narrow, f"{kernel}: {len(narrow)} 2-byte loads or stores of the tensor"


def backward_through_batch_norm(shape, kernel, dtype, config, activation, **conv):
    """The rows pass computing a BatchNorm's gradient as it loads grad_out (dispatch.conv_grad_through_batch_norm)."""
    from dwconv.dispatch import conv_grad_through_batch_norm
    from dwconv.kernels.batch_norm import batch_norm_forward, batch_norm_grad_sums
    from dwconv.kernels.tile import NormGrad

    x, weight, geom, grad = tensors(shape, kernel, dtype, **conv)
    y = torch.randn(geom.output_shape).to(dtype).contiguous(memory_format=CL)
    gamma, beta = torch.randn(shape[1]), torch.randn(shape[1])
    _, mean, invstd = batch_norm_forward(y, gamma, beta, None, None, 0.1, 1e-5, activation)
    totals, _, _ = batch_norm_grad_sums(grad, y, gamma, beta, mean, invstd, 1e-5, activation)
    conv_grad_through_batch_norm(grad, x, weight, geom, NormGrad(y, mean, invstd, gamma, beta, totals, activation),
                                 1e-5, config)


def batch_norm_fold(weight_shape, dtype, bias=True, affine=True, layout=torch.contiguous_format):
    """A BatchNorm folded into the convolution before it in eval mode (kernels.batch_norm.fold), and
    as the scale and shift the depthwise layer after it applies (kernels.batch_norm.scale_shift)."""
    from dwconv.kernels.batch_norm import fold, scale_shift

    channels = weight_shape[0]
    weight = torch.randn(weight_shape).contiguous(memory_format=layout)
    gamma, beta = (torch.randn(channels), torch.randn(channels)) if affine else (None, None)
    fold(weight, torch.randn(channels) if bias else None, gamma, beta, torch.randn(channels), torch.rand(channels) + 1,
         1e-5, dtype)
    scale_shift(gamma, beta, torch.randn(channels), torch.rand(channels) + 1, 1e-5)


def squeeze_excite(shape, hidden, dtype, activation, gate, layout=torch.contiguous_format):
    """A squeeze-and-excitation block's kernels (dwconv::squeeze_excite): the gate from the mean, then
    the gate applied."""
    from dwconv._library import squeeze_excite as op

    x = torch.randn(shape, dtype=dtype).contiguous(memory_format=layout)
    channels = shape[1]
    op(x, torch.randn(hidden, channels, 1, 1), torch.randn(hidden), torch.randn(channels, hidden, 1, 1),
       torch.randn(channels), activation, gate)


CASES += [
    ("squeeze_excite, bfloat16 channels_last, silu, sigmoid (EfficientNet-B0's widest)", squeeze_excite,
     ((2, 1152, 7, 7), 48, bf16, 3, 0), dict(layout=CL)),
    ("squeeze_excite, float32 NCHW, relu, hard sigmoid (MobileNetV3's)", squeeze_excite,
     ((2, 72, 28, 28), 24, f32, 1, 1), {}),
    ("batch_norm fold into a pointwise convolution, bfloat16", batch_norm_fold, ((960, 160, 1, 1), bf16), {}),
    ("batch_norm fold into a depthwise 3x3, float32, no bias, no affine", batch_norm_fold, ((144, 1, 3, 3), f32),
     dict(bias=False, affine=False)),
    ("batch_norm fold into a dense 3x3 channels_last, float16", batch_norm_fold, ((32, 3, 3, 3), f16),
     dict(layout=CL)),
    ("fused backward nhwc rows through a BatchNorm and ReLU6, bfloat16 (the GPU's 56-wide blocks)",
     backward_through_batch_norm, ((2, 96, 12, 56), (3, 3), bf16, ForwardConfig("nhwc_rows", 6, 8, 1, block_c=32,
                                                                                prefetch=True), 2),
     dict(padding=1, layout=CL)),
    ("batch_norm training, bfloat16 channels_last, relu6", batch_norm, ((4, 96, 14, 14), bf16, 2),
     dict(layout=CL, vectors=True)),
    ("batch_norm training, bfloat16 channels_last 144 channels (wide tiles), relu6", batch_norm,
     ((4, 144, 14, 14), bf16, 2), dict(layout=CL, vectors=True)),
    ("batch_norm training, bfloat16 NCHW 56x56, silu", batch_norm, ((2, 32, 56, 56), bf16, 3), dict(vectors=True)),
    ("batch_norm training, float32 NCHW, silu", batch_norm, ((4, 96, 14, 14), f32, 3), {}),
    ("batch_norm training, float16 NCHW 7x7, gelu, no affine", batch_norm, ((4, 36, 7, 7), f16, 4), dict(affine=False)),
    *[(f"batch_norm training, float32 channels_last, activation {code}", batch_norm, ((2, 40, 5, 5), f32, code),
       dict(layout=CL)) for code in (0, 1, 5, 6, 7)],
]

def main():
    failed = 0
    for name, run, args, conv in CASES:
        before = len(COMPILED)
        try:
            run(*args, **conv)
            for kernel, compiled in COMPILED[before:]:  # (a launch would raise OutOfResources)
                assert compiled.metadata.shared <= H100_SHARED_MEMORY, f"{kernel}: {compiled.metadata.shared} B shared"
            print(f"ok    {name}: {', '.join(kernel for kernel, _ in COMPILED[before:])}", flush=True)
        except Exception:  # report every case, then fail
            failed += 1
            print(f"FAIL  {name}\n{traceback.format_exc()}", flush=True)
    print(f"triton {triton.__version__}: {len(CASES) - failed}/{len(CASES)} cases compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
