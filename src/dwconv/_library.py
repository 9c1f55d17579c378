"""dwconv's kernels as PyTorch custom ops (torch.library) and as an autograd Function.

Two doors to the same launchers and the same backward formula:
- under torch.compile, `torch.ops.dwconv.*` custom ops with fake implementations (shapes, strides,
  dtypes from the geometry alone) and the backward attached by register_autograd: the compiled
  graph holds one opaque op per pass and no graph break; once the C++ replayer is built it serves
  the ops' calls (`replay.serve_ops`: a seen call replays its recorded program, no Python);
- in eager mode, `DepthwiseConv2dFunction`, because a custom op's Python dispatch costs ~50 us a
  call on the host (forward 32 -> 88 us, forward+backward 175 -> 390 us on the CPU machine with the
  kernels stubbed), which small layers cannot afford.

Reading order: the pass implementations (taking a checked geometry), the ops and their fake
implementations, the trained BatchNorm's ops (dwconv.batch_norm's kernels, the fused blocks' under
torch.compile), the backward formula, the autograd Function. Padding reaches the ops resolved to
[top, bottom, left, right] ('same' may be asymmetric); each op checks its arguments again through
conv_geometry, so a direct call with bad ones raises as well.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor

from . import dispatch as _dispatch
from . import replay
from ._geometry import (ACTIVATION_CODES, ACTIVATION_FUNCTIONS, ConvGeometry, conv_geometry, forward_activation_code,
                        split_activation_code)
from .dispatch import conv_forward
from .kernels import batch_norm as _batch_norm_kernels
from .kernels import squeeze_excite as _squeeze_excite
from .kernels._shared import output_memory_format
from .kernels.layout import nchw_copy


ACTIVATION_NAMES = {code: name for name, code in ACTIVATION_CODES.items()}


def _geometry(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int], padding: List[int],
              dilation: List[int], any_parameter_dtype: bool = False) -> ConvGeometry:
    return conv_geometry(input, weight, bias, stride, 0, dilation, sides=padding,
                         any_parameter_dtype=any_parameter_dtype)


def conv_arguments(geom: ConvGeometry) -> Tuple[List[int], List[int], List[int]]:
    """stride, padding [top, bottom, left, right] and dilation of a geometry, as the ops take them."""
    return ([geom.stride_h, geom.stride_w], [geom.pad_top, geom.pad_bottom, geom.pad_left, geom.pad_right],
            [geom.dilation_h, geom.dilation_w])


def plain(t: Optional[Tensor]) -> Optional[Tensor]:
    """t as the kernels may read it: a negative-bit view (torch._neg_view, what some ops return
    lazily) resolved, since the launches read raw memory; any other tensor as it is. Each door
    resolves once, where it takes its tensors: the ops' bodies, the eager Functions."""
    return t.resolve_neg() if t is not None and t.is_neg() else t


def _like(t: Tensor, shape=None) -> Tensor:
    """An empty tensor of t's dtype and device, in the memory format the kernels give t's gradients."""
    return torch.empty(t.shape if shape is None else shape, dtype=t.dtype, device=t.device,
                       memory_format=output_memory_format(t))


# ---- the registered ops -------------------------------------------------------------------------

# Custom ops, one opaque call a pass, with the fakes registered below; once the C++ replayer is built it
# serves them (no Python a call). As torch.library.triton_ops, whose kernels Inductor launched from its
# own code, compiled MobileNetV2 was no faster (docs/decisions.md, "torch.compile"): not kept.
_IMPLEMENTATIONS: dict = {}  # op name -> the function it was registered from
_OPS: dict = {}  # op name -> the op (torch.library's CustomOpDef)


def _op(name: str, mutates_args: tuple = ()):
    def register(fn):
        short = name.partition("::")[2]
        _IMPLEMENTATIONS[short] = fn
        _OPS[short] = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        return _OPS[short]
    return register


def _served_from_cpp(t: Tensor) -> None:
    """Once the C++ replayer is built (replay.enabled), later calls of the ops on t's device type run
    there (replay.serve_ops): a compiled graph's call then costs no Python. This call runs here."""
    if not replay.serving_ops("dwconv", t.device.type) and replay.enabled(t):
        replay.serve_ops("dwconv", _IMPLEMENTATIONS, t.device.type, _autograd_kernels())


def _autograd_kernels() -> dict:
    """Each op's Python autograd kernel, as torch.library registers it (its private maker: where this
    torch lacks it, the replayer leaves the ops' autograd key alone)."""
    try:
        from torch._library.autograd import make_autograd_impl
    except ImportError:
        return {}
    return {name: make_autograd_impl(op._opoverload, op) for name, op in _OPS.items()}


@_op("dwconv::conv2d")
def conv2d(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int], padding: List[int],
           dilation: List[int]) -> Tensor:
    """The depthwise convolution (groups = input channels); output in the input's memory format."""
    _served_from_cpp(input)
    return conv_forward(plain(input), plain(weight), plain(bias),
                        _geometry(input, weight, bias, stride, padding, dilation))


@conv2d.register_fake
def _(input, weight, bias, stride, padding, dilation):
    return _like(input, _geometry(input, weight, bias, stride, padding, dilation).output_shape)


@_op("dwconv::conv2d_activated")
def conv2d_activated(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int], padding: List[int],
                     dilation: List[int], activation: int) -> Tensor:
    """conv2d through an activation (its code in _geometry.ACTIVATION_CODES) in the kernel's
    epilogue, and of the input through one as it loads where the code says so
    (_geometry.forward_activation_code of a pair: the layer before's activation, fused). Forward only:
    depthwise_conv2d calls it where no gradient is wanted (it has no backward; where one is wanted,
    conv2d and PyTorch's activation run)."""
    _served_from_cpp(input)
    geom = _geometry(input, weight, bias, stride, padding, dilation)
    return conv_forward(plain(input), plain(weight), plain(bias), geom, activation=_checked_code(activation))


@conv2d_activated.register_fake
def _(input, weight, bias, stride, padding, dilation, activation):
    _checked_code(activation)
    return _like(input, _geometry(input, weight, bias, stride, padding, dilation).output_shape)


def _checked_code(activation: int) -> int:
    split_activation_code(activation)  # (raises for a code that is none)
    return activation


@_op("dwconv::conv2d_block")
def conv2d_block(input: Tensor, weight: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor],
                 norm_bias: Optional[Tensor], norm_mean: Optional[Tensor], norm_var: Optional[Tensor],
                 norm_eps: float, input_weight: Optional[Tensor], input_bias: Optional[Tensor],
                 input_mean: Optional[Tensor], input_var: Optional[Tensor], input_eps: float, stride: List[int],
                 padding: List[int], dilation: List[int], activation: int) -> Tensor:
    """A fused block's eval forward (dwconv.fuse), nothing differentiated: conv2d_activated of the
    input, with the BatchNorm after the convolution (norm_*, running statistics; norm_mean None:
    none) applied to its sums (the tile kernels: their scale and shift computed in the kernel, the
    weight and bias read as they are) or folded into its weight and bias in the input's dtype (the
    other families: a launch first), and the one before the input's activation (input_*; None:
    none; the layer before's, which then needs no folding) applied to each input value as it loads.
    Computes in the input's dtype (autocast's: the caller casts the input); weight, bias and the
    BatchNorms' tensors may be of any floating dtype. Every launch is of this op's own program (once
    the C++ replayer serves it, no Python a call): a compiled graph holds one op a block, not the
    folding's kernels besides it."""
    _served_from_cpp(input)
    output_norm = _output_norm(input, weight, norm_weight, norm_bias, norm_mean, norm_var, norm_eps)
    if output_norm is None:  # (no BatchNorm after: the kernels read the weight and bias in the input's dtype)
        weight, bias = weight.to(input.dtype), None if bias is None else bias.to(input.dtype)
    geom = _geometry(input, weight, bias, stride, padding, dilation, any_parameter_dtype=output_norm is not None)
    input_norm = None
    _checked_norm_given("input", input_weight, input_bias, input_mean, input_var)
    if input_mean is not None:
        _checked_norm("input", input, geom.in_channels, input_weight, input_bias, input_mean, input_var)
        input_norm = _batch_norm_kernels.EvalNorm(input_weight, input_bias, input_mean, input_var, input_eps)
    return conv_forward(plain(input), plain(weight), plain(bias), geom, activation=_checked_code(activation),
                        input_norm=input_norm, output_norm=output_norm)


def _output_norm(input: Tensor, weight: Tensor, norm_weight: Optional[Tensor], norm_bias: Optional[Tensor],
                 norm_mean: Optional[Tensor], norm_var: Optional[Tensor],
                 eps: float) -> Optional[_batch_norm_kernels.EvalNorm]:
    """conv2d_block's BatchNorm after the convolution (checked), or None. (The weight's and bias'
    dtypes, floating, are conv_geometry's to check.)"""
    if not (isinstance(weight, Tensor) and weight.is_floating_point()):
        raise TypeError(f"weight must be a floating tensor, got {weight!r:.60}")
    _checked_norm_given("norm", norm_weight, norm_bias, norm_mean, norm_var)
    if norm_mean is None:
        return None
    _checked_norm("norm", input, weight.shape[0], norm_weight, norm_bias, norm_mean, norm_var)
    return _batch_norm_kernels.EvalNorm(norm_weight, norm_bias, norm_mean, norm_var, eps)


@conv2d_block.register_fake
def _(input, weight, bias, norm_weight, norm_bias, norm_mean, norm_var, norm_eps, input_weight, input_bias,
      input_mean, input_var, input_eps, stride, padding, dilation, activation):
    _checked_code(activation)
    weight, bias = (None if t is None else t.to(input.dtype) for t in (weight, bias))
    geom = _geometry(input, weight, bias, stride, padding, dilation)
    _checked_norm_given("norm", norm_weight, norm_bias, norm_mean, norm_var)
    _checked_norm_given("input", input_weight, input_bias, input_mean, input_var)
    if norm_mean is not None:
        _checked_norm("norm", input, geom.out_channels, norm_weight, norm_bias, norm_mean, norm_var)
    if input_mean is not None:
        _checked_norm("input", input, geom.in_channels, input_weight, input_bias, input_mean, input_var)
    return _like(input, geom.output_shape)


@_op("dwconv::pointwise_folded")
def pointwise_folded(input: Tensor, weight: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor],
                     norm_bias: Optional[Tensor], norm_mean: Optional[Tensor], norm_var: Optional[Tensor],
                     norm_eps: float, activation: int) -> Tensor:
    """A 1x1 convolution (stride 1, no padding, one group) of a channels_last input followed by a
    BatchNorm in eval mode (norm_mean None: none) and an activation (its code in
    _geometry.ACTIVATION_CODES; dwconv.fuse's trained blocks), nothing differentiated: the BatchNorm
    folded into the weight and bias (one launch), then (N*H*W, C_in) @ (C_in, C_out) + bias, cuBLAS
    adding the bias in its product's epilogue, and ReLU there too (`_addmm_activation`); another
    activation in place on the output. Computes in the input's dtype (autocast's: the caller casts
    the input); channels_last output. One op, so that once the C++ replayer serves it the folding and
    the product are one call with no Python (an eager eval forward is bound by its host)."""
    _served_from_cpp(input)
    _checked_pointwise(input, weight)
    weight, bias = _block_parameters(input, weight, bias, norm_weight, norm_bias, norm_mean, norm_var, norm_eps)
    relu = _checked_activation(activation) == ACTIVATION_CODES["relu"] and bias is not None
    out = _rows_product(input, weight, bias, relu)
    return out if relu else _ACTIVATIONS_IN_PLACE[ACTIVATION_NAMES[activation]](out)


def _rows_product(input: Tensor, weight: Tensor, bias: Optional[Tensor], relu: bool) -> Tensor:
    """pointwise_product for the op (nothing differentiated), each operand one strided view: a
    recorded program replays every view step at each call, and permute, reshape and t are two to
    three steps each where as_strided is one. input: channels_last (its rows of channels one
    (N*H*W, C_in) matrix, _checked_pointwise); weight: any strides. relu (with a bias): ReLU in
    cuBLASLt's epilogue too (`torch._addmm_activation`, which has no derivative)."""
    batch, in_channels, height, width = input.shape
    out_channels = weight.shape[0]
    rows = input.as_strided((batch * height * width, in_channels), (in_channels, 1))
    columns = weight.as_strided((in_channels, out_channels), (weight.stride(1), weight.stride(0)))
    if bias is None:
        out = torch.mm(rows, columns)
    elif relu:
        out = torch._addmm_activation(bias, rows, columns)
    else:
        out = torch.addmm(bias, rows, columns)
    return out.as_strided((batch, out_channels, height, width),
                          (height * width * out_channels, 1, width * out_channels, out_channels))


# (each on the op's own fresh output; ReLU is the product's epilogue; GELU has no in-place form)
_ACTIVATIONS_IN_PLACE = dict(
    ACTIVATION_FUNCTIONS, relu6=functools.partial(torch.nn.functional.relu6, inplace=True),
    silu=functools.partial(torch.nn.functional.silu, inplace=True),
    hardswish=functools.partial(torch.nn.functional.hardswish, inplace=True),
    hardsigmoid=functools.partial(torch.nn.functional.hardsigmoid, inplace=True))


def _checked_pointwise(input: Tensor, weight: Tensor) -> None:
    """A clear error where pointwise_folded's input is not a channels_last 4-D tensor, or its weight
    not a 1x1 convolution's of the input's channels."""
    if input.dim() != 4 or not input.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"input must be a channels_last 4-D tensor, got shape {tuple(input.shape)}")
    if not (isinstance(weight, Tensor) and weight.dim() == 4 and weight.shape[1:] == (input.shape[1], 1, 1)):
        raise ValueError(f"weight must be of shape (out_channels, {input.shape[1]}, 1, 1) for this input, got "
                         f"{getattr(weight, 'shape', weight)!r:.60}")


def pointwise_product(input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """A 1x1 convolution (stride 1, no padding, one group) of a channels_last input as (N*H*W, C_in)
    @ (C_in, C_out) plus the bias, the output channels_last: cuBLAS adds the bias in its product's
    epilogue, where cuDNN's convolution adds it in a pass of its own over the output
    (docs/decisions.md, "In eval mode the other BatchNorms fold"). Differentiable, and what
    torch.compile traces; the op computes the same by _rows_product."""
    # (the NHWC view is contiguous: one (N*H*W, C_in) matrix, no copy)
    rows, weight = input.permute(0, 2, 3, 1), weight.reshape(weight.shape[0], weight.shape[1])
    return torch.nn.functional.linear(rows, weight, bias).permute(0, 3, 1, 2)


@pointwise_folded.register_fake
def _(input, weight, bias, norm_weight, norm_bias, norm_mean, norm_var, norm_eps, activation):
    _checked_activation(activation)
    _checked_pointwise(input, weight)
    _checked_norm_given("norm", norm_weight, norm_bias, norm_mean, norm_var)
    if norm_mean is not None:
        _checked_norm("norm", input, weight.shape[0], norm_weight, norm_bias, norm_mean, norm_var)
    return torch.empty((input.shape[0], weight.shape[0], input.shape[2], input.shape[3]), dtype=input.dtype,
                       device=input.device, memory_format=torch.channels_last)


GATE_NAMES = {0: "sigmoid", 1: "hardsigmoid"}  # squeeze_excite's gates by code


@_op("dwconv::squeeze_excite")
def squeeze_excite(input: Tensor, reduce_weight: Tensor, reduce_bias: Optional[Tensor], expand_weight: Tensor,
                   expand_bias: Optional[Tensor], activation: int, gate: int) -> Tensor:
    """A squeeze-and-excitation block's forward (torchvision's SqueezeExcitation, timm's SqueezeExcite;
    dwconv.fuse's, in eager), nothing differentiated: input * gate(expand(act(reduce(the input's
    mean over H and W)))), reduce and expand 1x1 convolutions (weight [out, in, 1, 1], bias or None),
    act an activation's code (_geometry.ACTIVATION_CODES), gate one of GATE_NAMES. The mean
    (PyTorch's), then both products and the activations in one launch, in float32 (float64 for a
    float64 input) from the parameters as they are, of any floating dtype and strides (stock under
    autocast casts all four, and rounds the gate to the input's dtype), then the gate applied in one
    pass (kernels/squeeze_excite); the output in the input's dtype and memory format. One op, so
    that once the C++ replayer serves it the block is one call with no Python: stock's is five
    modules, a dozen ops and, under autocast, four casts."""
    _served_from_cpp(input)
    _checked_squeeze(input, reduce_weight, reduce_bias, expand_weight, expand_bias, activation, gate)
    squeezed = torch.mean(input, (2, 3), dtype=torch.float64 if input.dtype == torch.float64 else torch.float32)
    scale = _squeeze_excite.excite(squeezed, reduce_weight, reduce_bias, expand_weight, expand_bias, activation, gate)
    if _squeeze_excite.scalable(input):
        return _squeeze_excite.channel_scale(input, scale)
    return (input * scale[:, :, None, None]).to(input.dtype)


def _checked_squeeze(input: Tensor, reduce_weight: Tensor, reduce_bias: Optional[Tensor], expand_weight: Tensor,
                     expand_bias: Optional[Tensor], activation: int, gate: int) -> None:
    """A clear error, naming the argument, for what squeeze_excite cannot compute."""
    if not isinstance(input, Tensor) or input.dim() != 4 or not input.is_floating_point():
        raise ValueError(f"input must be a floating 4-D tensor, got {getattr(input, 'shape', input)!r:.60}")
    channels = input.shape[1]
    hidden = reduce_weight.shape[0] if isinstance(reduce_weight, Tensor) and reduce_weight.dim() == 4 else -1
    if hidden > _squeeze_excite.MAX_HIDDEN:
        raise ValueError(f"reduce_weight may have at most {_squeeze_excite.MAX_HIDDEN} output channels (the hidden "
                         f"ones), got {hidden}")
    for name, t, shape in (("reduce_weight", reduce_weight, (hidden, channels, 1, 1)),
                           ("reduce_bias", reduce_bias, (hidden,)),
                           ("expand_weight", expand_weight, (channels, hidden, 1, 1)),
                           ("expand_bias", expand_bias, (channels,))):
        if t is None and name.endswith("bias"):
            continue
        if not isinstance(t, Tensor) or tuple(t.shape) != shape or hidden < 1:
            raise ValueError(f"{name} must be of shape {shape} for an input of {channels} channels, got "
                             f"{getattr(t, 'shape', t)!r:.60}")
        if not t.is_floating_point() or t.device != input.device:
            raise ValueError(f"{name} must be floating and on the input's device ({input.device}), got {t.dtype} "
                             f"on {t.device}")
    _checked_activation(activation)
    if gate not in GATE_NAMES:
        raise ValueError(f"gate must be one of the codes {GATE_NAMES}, got {gate!r}")


@squeeze_excite.register_fake
def _(input, reduce_weight, reduce_bias, expand_weight, expand_bias, activation, gate):
    _checked_squeeze(input, reduce_weight, reduce_bias, expand_weight, expand_bias, activation, gate)
    return torch.empty_like(input)


def _block_parameters(input: Tensor, weight: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor],
                      norm_bias: Optional[Tensor], norm_mean: Optional[Tensor], norm_var: Optional[Tensor],
                      eps: float) -> Tuple[Tensor, Optional[Tensor]]:
    """pointwise_folded's weight and bias in the input's dtype, the BatchNorm folded in where it has one."""
    if not (isinstance(weight, Tensor) and weight.is_floating_point()):
        raise TypeError(f"weight must be a floating tensor, got {weight!r:.60}")
    _checked_norm_given("norm", norm_weight, norm_bias, norm_mean, norm_var)
    if norm_mean is None:
        return weight.to(input.dtype), None if bias is None else bias.to(input.dtype)
    _checked_norm("norm", input, weight.shape[0], norm_weight, norm_bias, norm_mean, norm_var)
    if bias is not None and bias.device != weight.device:
        raise ValueError(f"bias is on {bias.device} but weight is on {weight.device}")
    return _batch_norm_kernels.fold(plain(weight).contiguous(), plain(bias), norm_weight, norm_bias, norm_mean,
                                    norm_var, eps, input.dtype)


def _checked_norm_given(name: str, *tensors: Optional[Tensor]) -> None:
    """A clear error where a BatchNorm's weight, bias or variance is given without its mean (none of
    them is read then: a silently ignored argument)."""
    if tensors[2] is None and any(t is not None for t in tensors):
        raise ValueError(f"{name}_mean must be given with {name}_var, {name}_weight and {name}_bias")


def _checked_norm(name: str, input: Tensor, channels: int, *tensors: Optional[Tensor]) -> None:
    """A clear error where a BatchNorm's tensors (weight, bias: both or neither; mean, variance) are
    not floating vectors of `channels` on the input's device."""
    labels = ("weight", "bias", "mean", "var")
    if (tensors[0] is None) != (tensors[1] is None) or tensors[3] is None:
        raise ValueError(f"{name}_weight and {name}_bias must be given together, and {name}_var with {name}_mean")
    for label, t in zip(labels, tensors):
        if t is None:
            continue
        if not t.is_floating_point() or t.dim() != 1 or t.shape[0] != channels or t.stride(0) != 1:
            raise ValueError(f"{name}_{label} must be a contiguous floating vector of {channels} channels, got "
                             f"{t.dtype} of shape {tuple(t.shape)}")
        if t.device != input.device:
            raise ValueError(f"{name}_{label} is on {t.device} but input is on {input.device}")


def _grad_input(grad_out: Tensor, input: Tensor, weight: Tensor, geom: ConvGeometry) -> Tensor:
    return _dispatch.conv_grad_input(grad_out, weight, geom, input)


@_op("dwconv::conv2d_grad_input")
def conv2d_grad_input(grad_out: Tensor, input: Tensor, weight: Tensor, stride: List[int], padding: List[int],
                      dilation: List[int]) -> Tensor:
    """grad of the input (input gives its shape, dtype and memory format)."""
    _served_from_cpp(input)
    return _grad_input(plain(grad_out), input, plain(weight), _geometry(input, weight, None, stride, padding, dilation))


@conv2d_grad_input.register_fake
def _(grad_out, input, weight, stride, padding, dilation):
    return _like(input)


def _grad_weight(grad_out: Tensor, input: Tensor, weight: Tensor, geom: ConvGeometry, bias_grad: bool) -> List[Tensor]:
    grad_weight, grad_bias = _dispatch.conv_grad_weight(grad_out, input, geom, weight.dtype, bias_grad)
    return [grad_weight, grad_bias] if bias_grad else [grad_weight]


@_op("dwconv::conv2d_grad_weight")
def conv2d_grad_weight(grad_out: Tensor, input: Tensor, weight: Tensor, stride: List[int], padding: List[int],
                       dilation: List[int], bias_grad: bool) -> List[Tensor]:
    """[grad_weight] or, with bias_grad, [grad_weight, grad_bias], from one pass over grad_out and input."""
    _served_from_cpp(input)
    geom = _geometry(input, weight, None, stride, padding, dilation)
    return _grad_weight(plain(grad_out), plain(input), weight, geom, bias_grad)


@conv2d_grad_weight.register_fake
def _(grad_out, input, weight, stride, padding, dilation, bias_grad):
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return [grad_weight, weight.new_empty(weight.shape[0])] if bias_grad else [grad_weight]


def _grad_input_weight(grad_out: Tensor, input: Tensor, weight: Tensor, geom: ConvGeometry) -> Tuple[Tensor, Tensor]:
    return _dispatch.conv_grad_input_and_weight(grad_out, input, weight, geom)


@_op("dwconv::conv2d_grad_input_weight")
def conv2d_grad_input_weight(grad_out: Tensor, input: Tensor, weight: Tensor, stride: List[int],
                             padding: List[int], dilation: List[int]) -> Tuple[Tensor, Tensor]:
    """grad_input and grad_weight from one read of grad_out and input where
    `dispatch.fused_backward_applies` (stride 1, multiplier 1, ...), else from the two kernels:
    the op takes any geometry (the backward formula asks before it calls)."""
    _served_from_cpp(input)
    geom = _geometry(input, weight, None, stride, padding, dilation)
    grad_out, input, weight = plain(grad_out), plain(input), plain(weight)
    if not _dispatch.fused_backward_applies(geom, input):
        return _grad_input(grad_out, input, weight, geom), _grad_weight(grad_out, input, weight, geom, False)[0]
    return _grad_input_weight(grad_out, input, weight, geom)


@conv2d_grad_input_weight.register_fake
def _(grad_out, input, weight, stride, padding, dilation):
    return _like(input), torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


# ---- BatchNorm in training with its activation (dwconv.batch_norm): the fused blocks' under torch.compile

# Opaque to Inductor, which would otherwise decompose BatchNorm into reductions and pointwise kernels
# of its own, slower than these on channels_last tensors (docs/decisions.md, "Compiled, the trained
# BatchNorms are dwconv's ops"). Two ops forward: the statistics (which update the running ones in
# place, so have no autograd formula, and take a detached input) and the normalisation, whose
# backward is BatchNorm's whole backward, the statistics' share included.

@_op("dwconv::batch_norm_statistics", mutates_args=("running_mean", "running_var"))
def batch_norm_statistics(y: Tensor, running_mean: Tensor, running_var: Tensor, momentum: float, eps: float
                          ) -> Tuple[Tensor, Tensor]:
    """(the batch's mean, 1 / sqrt(var + eps)) per channel of y (NCHW or dense channels_last), the
    running statistics updated in place (momentum: the batch's weight)."""
    _served_from_cpp(y)
    return _batch_norm_kernels.batch_norm_statistics(batch_norm_input(y), running_mean, running_var, momentum, eps)


@batch_norm_statistics.register_fake
def _(y, running_mean, running_var, momentum, eps):
    statistics = y.new_empty((y.shape[1],), dtype=torch.float64 if y.dtype == torch.float64 else torch.float32)
    return statistics, torch.empty_like(statistics)


@_op("dwconv::batch_norm_activation")
def batch_norm_activation(y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor, invstd: Tensor,
                          eps: float, activation: int) -> Tensor:
    """activation(batch_norm(y, training=True)) from batch_norm_statistics of this y (the activation's
    code: _geometry.ACTIVATION_CODES)."""
    _served_from_cpp(y)
    return _batch_norm_kernels.batch_norm_normalize(batch_norm_input(y), weight, bias, mean, invstd, eps,
                                                    _checked_activation(activation))


@batch_norm_activation.register_fake
def _(y, weight, bias, mean, invstd, eps, activation):
    _checked_activation(activation)
    return torch.empty_like(batch_norm_input(y))


@_op("dwconv::batch_norm_activation_backward")
def batch_norm_activation_backward(grad: Tensor, y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                                   mean: Tensor, invstd: Tensor, eps: float, activation: int) -> List[Tensor]:
    """[grad_y] (the strides of y as the kernels read it), or [grad_y, grad_weight, grad_bias] with a
    weight, of batch_norm_activation."""
    _served_from_cpp(y)
    grads = _batch_norm_kernels.batch_norm_backward(grad, batch_norm_input(y), weight, bias, mean, invstd, eps,
                                                    _checked_activation(activation))
    return list(grads) if weight is not None else [grads[0]]


@batch_norm_activation_backward.register_fake
def _(grad, y, weight, bias, mean, invstd, eps, activation):
    grad_y = torch.empty_like(batch_norm_input(y))
    return [grad_y] + ([torch.empty_like(weight), torch.empty_like(bias)] if weight is not None else [])


def _normalize_setup(ctx, inputs, output):
    y, weight, bias, mean, invstd, eps, activation = inputs
    ctx.save_for_backward(y, weight, bias, mean, invstd)
    ctx.eps, ctx.activation = eps, activation


def _normalize_backward(ctx, grad):
    y, weight, bias, mean, invstd = ctx.saved_tensors
    wanted = ctx.needs_input_grad[:3]
    if torch.is_grad_enabled():  # (create_graph=True: PyTorch's ops, which autograd differentiates again)
        grads = differentiable_batch_norm_backward(grad, y, weight, bias, ctx.eps, ACTIVATION_NAMES[ctx.activation],
                                                   wanted)
    else:
        grads = list(torch.ops.dwconv.batch_norm_activation_backward(grad, y, weight, bias, mean, invstd, ctx.eps,
                                                                     ctx.activation)) + [None, None]
    return (*(g if w else None for g, w in zip(grads, wanted)), None, None, None, None)


batch_norm_activation.register_autograd(_normalize_backward, setup_context=_normalize_setup)


def differentiable_batch_norm_backward(grad, y, weight, bias, eps, activation, wanted):
    """The trained BatchNorm's gradients (of y, weight, bias where wanted) as PyTorch computes them,
    through ops autograd records (create_graph=True: the block recomputed from the saved y, since the
    batch's statistics are functions of it; the activation by name)."""
    inputs = [t for t, w in zip((y, weight, bias), wanted) if w]
    with torch.enable_grad():
        normalized = torch.nn.functional.batch_norm(y, None, None, weight, bias, True, 0.0, eps)
        out = ACTIVATION_FUNCTIONS[activation](normalized)
        grads = iter(torch.autograd.grad(out, inputs, grad, create_graph=True, allow_unused=True))
    return tuple(next(grads) if w else None for w in wanted)


def batch_norm_input(y: Tensor) -> Tensor:
    """y as the BatchNorm kernels read it: NCHW or dense channels_last (what the convolutions give)."""
    return y if y.is_contiguous() or y.is_contiguous(memory_format=torch.channels_last) else y.contiguous()


def _checked_activation(code: int) -> int:
    if code not in ACTIVATION_NAMES:
        raise ValueError(f"activation must be a code of {ACTIVATION_CODES}, got {code!r}")
    return code


# ---- the backward formula, for both doors -------------------------------------------------------

def _backward_formula(grad_out: Tensor, input: Tensor, weight: Tensor, geom: ConvGeometry, want_input: bool,
                      want_weight: bool, want_bias: bool, traced: bool):
    """Gradients of input, weight and bias (None where not wanted). traced: through the registered
    ops (torch.compile's graphs); else straight to the launchers (eager)."""
    ops, conv = torch.ops.dwconv, conv_arguments(geom) if traced else None
    grad_input = grad_weight = grad_bias = None
    # The fused pass does not sum grad_out for the bias; a separate sum would read grad_out again,
    # about what fusing saves, so with a bias gradient the two kernels run.
    if want_input and want_weight and not want_bias and input.numel() > 0 \
            and _dispatch.fused_backward_applies(geom, input):
        if traced:
            grad_input, grad_weight = ops.conv2d_grad_input_weight(grad_out, input, weight, *conv)
        else:
            grad_input, grad_weight = _grad_input_weight(grad_out, input, weight, geom)
        return grad_input, grad_weight, None
    if want_input and (want_weight or want_bias) and _dispatch.gradients_read_grad_out_as_nchw(geom, input, grad_out):
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


def _second_order(grad_out: Tensor, input: Tensor, weight: Tensor, geom: ConvGeometry, needs: Tuple[bool, bool, bool],
                  g_input: Optional[Tensor], g_weight: Optional[Tensor], g_bias: Optional[Tensor], traced: bool):
    """The backward's own gradients (create_graph=True: gradient penalties, Hessian-vector products):
    given g_input, g_weight, g_bias flowing into grad_input, grad_weight and grad_bias, the gradients
    of grad_out, input and weight (those `needs` asks for). grad_input is linear in grad_out and in
    weight, grad_weight in grad_out and in input, grad_bias in grad_out, so each term is one of
    dwconv's passes again, itself differentiable: any order works."""
    if traced:
        ops, conv = torch.ops.dwconv, conv_arguments(geom)

        def forward(x, w, b):
            return ops.conv2d(x, w, b, *conv)

        def grad_input(go, x, w):
            return ops.conv2d_grad_input(go, x, w, *conv)

        def grad_weight(go, x, w):
            return ops.conv2d_grad_weight(go, x, w, *conv, False)[0]
    else:
        def forward(x, w, b):
            return _differentiable_forward(x, w, b, geom)

        def grad_input(go, x, w):
            return backward_for_autograd(go, x, w, geom, True, False, False)[0]

        def grad_weight(go, x, w):
            return backward_for_autograd(go, x, w, geom, False, True, False)[1]

    d_grad_out = d_input = d_weight = None
    if needs[0]:
        terms = []
        if g_input is not None:
            terms.append(forward(g_input, weight, None))
        if g_weight is not None:
            terms.append(forward(input, g_weight, g_bias))
        elif g_bias is not None:
            terms.append(g_bias.view(1, -1, 1, 1).expand(geom.output_shape))
        for term in terms:
            d_grad_out = term if d_grad_out is None else d_grad_out + term
    if needs[1] and g_weight is not None:
        d_input = grad_input(grad_out, input, g_weight)
    if needs[2] and g_input is not None:
        d_weight = grad_weight(grad_out, g_input, weight)
    return d_grad_out, d_input, d_weight


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


def _setup_backward_op(ctx, inputs, output):
    grad_out, input, weight, stride, padding, dilation = inputs[:6]
    ctx.save_for_backward(grad_out, input, weight)
    ctx.conv = (stride, padding, dilation)
    ctx.bias_grad = len(inputs) > 6 and inputs[6]


def _backward_op_gradients(ctx, g_input, g_weight, g_bias):
    grad_out, input, weight = ctx.saved_tensors
    geom = _geometry(input, weight, None, *ctx.conv)
    return (*_second_order(grad_out, input, weight, geom, ctx.needs_input_grad[:3], g_input, g_weight, g_bias,
                           traced=True), None, None, None)


conv2d_grad_input.register_autograd(lambda ctx, g: _backward_op_gradients(ctx, g, None, None),
                                    setup_context=_setup_backward_op)
conv2d_grad_weight.register_autograd(
    lambda ctx, grads: (*_backward_op_gradients(ctx, None, grads[0], grads[1] if ctx.bias_grad else None), None),
    setup_context=_setup_backward_op)
conv2d_grad_input_weight.register_autograd(
    lambda ctx, g_input, g_weight: _backward_op_gradients(ctx, g_input, g_weight, None),
    setup_context=_setup_backward_op)


# ---- the eager door -----------------------------------------------------------------------------

def backward_for_autograd(grad_out: Tensor, input: Tensor, weight: Tensor, geom: ConvGeometry, want_input: bool,
                          want_weight: bool, want_bias: bool):
    """The eager backward (the Python Function's, and the C++ one's where it calls back): straight to
    the launchers, or under create_graph=True through DepthwiseConv2dBackward, which autograd can
    differentiate again."""
    if torch.is_grad_enabled():
        return DepthwiseConv2dBackward.apply(grad_out, input, weight, geom, want_input, want_weight, want_bias)
    return _backward_formula(plain(grad_out), plain(input), plain(weight), geom, want_input, want_weight,
                             want_bias, traced=False)


def _differentiable_forward(input: Tensor, weight: Tensor, bias: Optional[Tensor], geom: ConvGeometry) -> Tensor:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        return DepthwiseConv2dFunction.apply(input, weight, bias, geom)
    return conv_forward(plain(input), plain(weight), plain(bias), geom)


class DepthwiseConv2dFunction(torch.autograd.Function):
    """The eager door: the same forward and backward without the custom-op dispatch. Forward-mode AD
    (torch.autograd.forward_ad) through `jvp`."""

    @staticmethod
    def forward(ctx, input, weight, bias, geom):
        ctx.save_for_backward(input, weight)
        ctx.save_for_forward(input, weight)
        ctx.geom, ctx.has_bias = geom, bias is not None
        return conv_forward(plain(input), plain(weight), plain(bias), geom)

    @staticmethod
    def backward(ctx, grad_out):
        input, weight = ctx.saved_tensors
        return (*backward_for_autograd(grad_out, input, weight, ctx.geom, *_wanted(ctx)), None)

    @staticmethod
    def jvp(ctx, input_tangent, weight_tangent, bias_tangent, _):
        """The output's tangent: the convolution is linear in input and in (weight, bias)."""
        input, weight = ctx.saved_tensors
        tangent = None
        if input_tangent is not None:
            tangent = _differentiable_forward(input_tangent, weight, None, ctx.geom)
        if weight_tangent is not None:
            term = _differentiable_forward(input, weight_tangent, bias_tangent, ctx.geom)
            tangent = term if tangent is None else tangent + term
        elif bias_tangent is not None:
            term = bias_tangent.view(1, -1, 1, 1).expand(ctx.geom.output_shape)
            tangent = term.contiguous() if tangent is None else tangent + term
        return tangent


class DepthwiseConv2dBackward(torch.autograd.Function):
    """The eager backward as a Function of its own, taken under create_graph=True: its backward
    (`_second_order`) is made of dwconv's passes again."""

    @staticmethod
    def forward(ctx, grad_out, input, weight, geom, want_input, want_weight, want_bias):
        ctx.save_for_backward(grad_out, input, weight)
        ctx.geom = geom
        ctx.set_materialize_grads(False)  # (an unused gradient stays None: no pass over zeros)
        return _backward_formula(plain(grad_out), plain(input), plain(weight), geom, want_input, want_weight,
                                 want_bias, traced=False)

    @staticmethod
    def backward(ctx, g_input, g_weight, g_bias):
        grad_out, input, weight = ctx.saved_tensors
        return (*_second_order(grad_out, input, weight, ctx.geom, ctx.needs_input_grad[:3], g_input, g_weight,
                               g_bias, traced=False), None, None, None, None)


def _eager_backward(grad_out: Tensor, input: Tensor, weight: Tensor, geom: ConvGeometry, want_input: bool,
                    want_weight: bool, want_bias: bool):
    return _backward_formula(grad_out, input, weight, geom, want_input, want_weight, want_bias, traced=False)


# What the C++ path records and calls back: the forward, the backward, the differentiable backward.
REPLAY_PASSES = (conv_forward, _eager_backward, backward_for_autograd)


@functools.lru_cache(maxsize=None)
def _activated_passes(code: int) -> tuple:
    """REPLAY_PASSES of a forward with an activation in its epilogue (one set a code: a layer of its
    own to the C++ path). Recorded only where no gradient is wanted; a backward through it would
    lack the activation's derivative, so it raises."""
    def forward(input: Tensor, weight: Tensor, bias: Optional[Tensor], geom: ConvGeometry) -> Tensor:
        return conv_forward(input, weight, bias, geom, activation=code)

    def no_backward(*args):
        raise RuntimeError("dwconv: a forward with a fused activation has no backward (depthwise_conv2d runs "
                           "the activation after the convolution where a gradient is wanted)")

    return forward, no_backward, no_backward


def eager_conv(input: Tensor, weight: Tensor, bias: Optional[Tensor], geom: ConvGeometry,
               arguments: tuple) -> Tensor:
    """An eager call on tensors the kernels read: under forward-mode AD the Python Function (its jvp
    gives the tangent; the C++ Function has none); else the C++ path where it is on and the layer
    records, else the Python Function, or the bare forward where nothing needs a gradient. An
    activation after the arguments (depthwise_conv2d passes one only where no gradient is wanted):
    the forward with the activation in its epilogue."""
    input, weight, bias = plain(input), plain(weight), plain(bias)
    if len(arguments) > 3:
        code = forward_activation_code(arguments[3])
        out = replay.conv(input, weight, bias, geom, _activated_passes(code), arguments) if replay.enabled(input) \
            else None
        return conv_forward(input, weight, bias, geom, activation=code) if out is None else out
    if forward_ad._current_level >= 0:
        return DepthwiseConv2dFunction.apply(input, weight, bias, geom)
    out = replay.conv(input, weight, bias, geom, REPLAY_PASSES, arguments) if replay.enabled(input) else None
    return _differentiable_forward(input, weight, bias, geom) if out is None else out


__all__ = ["conv2d", "conv2d_grad_input", "conv2d_grad_weight", "conv2d_grad_input_weight", "conv2d_activated",
           "conv2d_block",
           "batch_norm_statistics", "batch_norm_activation", "batch_norm_activation_backward", "conv_arguments",
           "DepthwiseConv2dFunction", "eager_conv"]
