"""dwconv's kernels as PyTorch custom ops (torch.library) and as an autograd Function.

Two doors to the same launchers and the same backward formula:
- under torch.compile, `torch.ops.dwconv.*` custom ops with fake implementations (shapes, strides,
  dtypes from the geometry alone) and the backward attached by register_autograd: the compiled
  graph holds one opaque op per pass and no graph break;
- in eager mode, `DepthwiseConv2dFunction`, because a custom op's Python dispatch costs ~50 us a
  call on the host (forward 32 -> 88 us, forward+backward 175 -> 390 us on the CPU machine with the
  kernels stubbed), which small layers cannot afford.

Reading order: the pass implementations (taking a checked geometry), the ops and their fake
implementations, the backward formula, the autograd Function. Padding reaches the ops resolved to
[top, bottom, left, right] ('same' may be asymmetric); each op checks its arguments again through
conv_geometry, so a direct call with bad ones raises as well.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ._geometry import ConvGeometry, conv_geometry
from .ops import backward as _backward
from .ops.forward import conv_forward, output_memory_format
from .ops.layout import nchw_copy


def _geometry(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int], padding: List[int],
              dilation: List[int]) -> ConvGeometry:
    return conv_geometry(input, weight, bias, stride, 0, dilation, sides=padding)


def conv_arguments(geom: ConvGeometry) -> Tuple[List[int], List[int], List[int]]:
    """stride, padding [top, bottom, left, right] and dilation of a geometry, as the ops take them."""
    return ([geom.stride_h, geom.stride_w], [geom.pad_top, geom.pad_bottom, geom.pad_left, geom.pad_right],
            [geom.dilation_h, geom.dilation_w])


def _like(t: Tensor, shape=None) -> Tensor:
    """An empty tensor of t's dtype and device, in the memory format the kernels give t's gradients."""
    return torch.empty(t.shape if shape is None else shape, dtype=t.dtype, device=t.device,
                       memory_format=output_memory_format(t))


# ---- the registered ops -------------------------------------------------------------------------

@torch.library.custom_op("dwconv::conv2d", mutates_args=())
def conv2d(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int], padding: List[int],
           dilation: List[int]) -> Tensor:
    """The depthwise convolution (groups = input channels); output in the input's memory format."""
    return conv_forward(input, weight, bias, _geometry(input, weight, bias, stride, padding, dilation))


@conv2d.register_fake
def _(input, weight, bias, stride, padding, dilation):
    return _like(input, _geometry(input, weight, bias, stride, padding, dilation).output_shape)


def _grad_input(grad_out: Tensor, input: Tensor, weight: Tensor, geom: ConvGeometry) -> Tensor:
    return _backward.conv_grad_input(grad_out, weight, geom, input)


@torch.library.custom_op("dwconv::conv2d_grad_input", mutates_args=())
def conv2d_grad_input(grad_out: Tensor, input: Tensor, weight: Tensor, stride: List[int], padding: List[int],
                      dilation: List[int]) -> Tensor:
    """grad of the input (input gives its shape, dtype and memory format)."""
    return _grad_input(grad_out, input, weight, _geometry(input, weight, None, stride, padding, dilation))


@conv2d_grad_input.register_fake
def _(grad_out, input, weight, stride, padding, dilation):
    return _like(input)


def _grad_weight(grad_out: Tensor, input: Tensor, weight: Tensor, geom: ConvGeometry, bias_grad: bool) -> List[Tensor]:
    grad_weight, grad_bias = _backward.conv_grad_weight(grad_out, input, geom, weight.dtype, bias_grad)
    return [grad_weight, grad_bias] if bias_grad else [grad_weight]


@torch.library.custom_op("dwconv::conv2d_grad_weight", mutates_args=())
def conv2d_grad_weight(grad_out: Tensor, input: Tensor, weight: Tensor, stride: List[int], padding: List[int],
                       dilation: List[int], bias_grad: bool) -> List[Tensor]:
    """[grad_weight] or, with bias_grad, [grad_weight, grad_bias], from one pass over grad_out and input."""
    return _grad_weight(grad_out, input, weight, _geometry(input, weight, None, stride, padding, dilation), bias_grad)


@conv2d_grad_weight.register_fake
def _(grad_out, input, weight, stride, padding, dilation, bias_grad):
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return [grad_weight, weight.new_empty(weight.shape[0])] if bias_grad else [grad_weight]


def _grad_input_weight(grad_out: Tensor, input: Tensor, weight: Tensor, geom: ConvGeometry) -> Tuple[Tensor, Tensor]:
    return _backward.conv_grad_input_and_weight(grad_out, input, weight, geom)


@torch.library.custom_op("dwconv::conv2d_grad_input_weight", mutates_args=())
def conv2d_grad_input_weight(grad_out: Tensor, input: Tensor, weight: Tensor, stride: List[int],
                             padding: List[int], dilation: List[int]) -> Tuple[Tensor, Tensor]:
    """grad_input and grad_weight from one read of grad_out and input where
    `ops.backward.fused_backward_applies` (stride 1, multiplier 1, ...), else from the two kernels:
    the op takes any geometry (the backward formula asks before it calls)."""
    geom = _geometry(input, weight, None, stride, padding, dilation)
    if not _backward.fused_backward_applies(geom, input):
        return _grad_input(grad_out, input, weight, geom), _grad_weight(grad_out, input, weight, geom, False)[0]
    return _grad_input_weight(grad_out, input, weight, geom)


@conv2d_grad_input_weight.register_fake
def _(grad_out, input, weight, stride, padding, dilation):
    return _like(input), torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


# ---- the backward formula, for both doors -------------------------------------------------------

def _backward_formula(grad_out: Tensor, input: Tensor, weight: Tensor, geom: ConvGeometry, want_input: bool,
                      want_weight: bool, want_bias: bool, traced: bool):
    """Gradients of input, weight and bias (None where not wanted). traced: through the registered
    ops (torch.compile's graphs); else straight to the launchers (eager)."""
    ops, conv = torch.ops.dwconv, conv_arguments(geom) if traced else None
    grad_input = grad_weight = grad_bias = None
    # The fused pass does not sum grad_out for the bias; a separate sum would read grad_out again,
    # about what fusing saves, so with a bias gradient the two kernels run.
    if (_backward.FUSED_BACKWARD and want_input and want_weight and not want_bias and input.numel() > 0
            and _backward.fused_backward_applies(geom, input)):
        if traced:
            grad_input, grad_weight = ops.conv2d_grad_input_weight(grad_out, input, weight, *conv)
        else:
            grad_input, grad_weight = _grad_input_weight(grad_out, input, weight, geom)
        return grad_input, grad_weight, None
    if want_input and (want_weight or want_bias) and _backward.gradients_read_grad_out_as_nchw(geom, input, grad_out):
        grad_out = grad_out.contiguous() if traced else nchw_copy(grad_out)  # (one copy for both)
    # grad_weight first: its partial sums are freed before grad_input is allocated, so the peak
    # stays at PyTorch's (grad_input + grad_weight beside the saved tensors).
    if want_weight or want_bias:
        if traced:
            grads = ops.conv2d_grad_weight(grad_out, input, weight, *conv, want_bias)
        else:
            grads = _grad_weight(grad_out, input, weight, geom, want_bias)
        grad_weight = grads[0] if want_weight else None
        grad_bias = grads[1] if want_bias else None
    if want_input:
        if traced:
            grad_input = ops.conv2d_grad_input(grad_out, input, weight, *conv)
        else:
            grad_input = _grad_input(grad_out, input, weight, geom)
    return grad_input, grad_weight, grad_bias


def _setup_context(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation = inputs
    ctx.save_for_backward(input, weight)  # only these: neither the output nor grad_out is kept
    ctx.conv = (stride, padding, dilation)
    ctx.has_bias = bias is not None


def _wanted(ctx) -> Tuple[bool, bool, bool]:
    """Which of input, weight and bias need a gradient."""
    return ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]


def _op_backward(ctx, grad_out):
    input, weight = ctx.saved_tensors
    geom = _geometry(input, weight, None, *ctx.conv)
    return (*_backward_formula(grad_out, input, weight, geom, *_wanted(ctx), traced=True), None, None, None)


conv2d.register_autograd(_op_backward, setup_context=_setup_context)


class DepthwiseConv2dFunction(torch.autograd.Function):
    """The eager door: the same forward and backward without the custom-op dispatch."""

    @staticmethod
    def forward(ctx, input, weight, bias, geom):
        ctx.save_for_backward(input, weight)
        ctx.geom, ctx.has_bias = geom, bias is not None
        return conv_forward(input, weight, bias, geom)

    @staticmethod
    def backward(ctx, grad_out):
        input, weight = ctx.saved_tensors
        return (*_backward_formula(grad_out, input, weight, ctx.geom, *_wanted(ctx), traced=False), None)


__all__ = ["conv2d", "conv2d_grad_input", "conv2d_grad_weight", "conv2d_grad_input_weight", "conv_arguments",
           "DepthwiseConv2dFunction"]
