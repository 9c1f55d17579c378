"""User-facing functional API: `depthwise_conv2d`."""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from ._geometry import IntOrPair, Padding, conv_geometry


def triton_interpreter_enabled() -> bool:
    """True when Triton runs kernels on CPU tensors (TRITON_INTERPRET=1, read at import as Triton does)."""
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older Triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def uses_triton(x: torch.Tensor) -> bool:
    """Whether dwconv's kernels handle this tensor (CUDA, or CPU under the interpreter)."""
    return x.is_cuda or (x.device.type == "cpu" and triton_interpreter_enabled())


def depthwise_conv2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    stride: IntOrPair = 1,
    padding: Padding = 0,
    dilation: IntOrPair = 1,
) -> torch.Tensor:
    """Depthwise 2-D convolution: F.conv2d(input, weight, bias, stride, padding, dilation,
    groups=input.shape[1]), computed by dwconv's Triton kernels.

    weight has shape (C * multiplier, 1, kH, kW). padding is an int, a pair, 'valid' or
    'same'. float32, float16 and bfloat16 accumulate in float32; float64 runs and
    accumulates in float64. CPU tensors fall back to PyTorch unless TRITON_INTERPRET=1.
    """
    geom = conv_geometry(input, weight, bias, stride, padding, dilation)
    if not uses_triton(input):
        return F.conv2d(input, weight, bias, stride, padding, dilation, groups=geom.in_channels)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        return _DepthwiseConv2dFunction.apply(input, weight, bias, geom)
    from .ops.forward import conv_forward

    return conv_forward(input, weight, bias, geom)


class _DepthwiseConv2dFunction(torch.autograd.Function):
    """Forward and backward on dwconv's kernels; saves only input and weight."""

    @staticmethod
    def forward(ctx, input, weight, bias, geom):
        from .ops.forward import conv_forward

        ctx.geom = geom
        ctx.has_bias = bias is not None
        ctx.save_for_backward(input, weight)
        return conv_forward(input, weight, bias, geom)

    @staticmethod
    def backward(ctx, grad_out):
        from .ops import backward as ops

        input, weight = ctx.saved_tensors
        geom = ctx.geom
        grad_input = grad_weight = grad_bias = None
        want_bias = ctx.has_bias and ctx.needs_input_grad[2]
        # The fused pass does not sum grad_out for the bias; a separate sum would read grad_out
        # again, about what the fused pass saves, so with a bias gradient the two kernels run.
        if ops.FUSED_BACKWARD and ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and not want_bias:
            fused = ops.fused_backward_launch(geom, input, grad_out)
            if fused is not None:
                return (*ops.conv_grad_input_and_weight(grad_out, input, weight, geom, fused), None, None)
        # grad_weight first: its partial sums are freed before grad_input is allocated, so the
        # peak stays at PyTorch's (grad_input + grad_weight beside the saved tensors).
        if ctx.needs_input_grad[1] or want_bias:
            grad_weight, grad_bias = ops.conv_grad_weight(grad_out, input, geom, weight.dtype, want_bias)
            if not ctx.needs_input_grad[1]:
                grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_input = ops.conv_grad_input(grad_out, weight, geom, input)
        return grad_input, grad_weight, grad_bias, None
