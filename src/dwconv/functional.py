"""User-facing functional API: `depthwise_conv2d`."""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F

from ._geometry import IntOrPair, Padding, conv_geometry


_INTERPRET: Optional[bool] = None


def triton_interpreter_enabled() -> bool:
    """True when Triton runs kernels on CPU tensors: TRITON_INTERPRET=1, read from the environment
    as Triton reads it (importing Triton or torch._dynamo here would fix its mode before a caller
    such as the no-GPU demo sets the variable), once, so that torch.compile traces a constant."""
    global _INTERPRET
    if _INTERPRET is None:
        _INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return _INTERPRET


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
    accumulates in float64. Under torch.autocast the inputs are cast as F.conv2d casts them.
    CPU tensors fall back to PyTorch unless TRITON_INTERPRET=1. Differentiable in input, weight
    and bias, to any order (create_graph=True), and in forward mode (torch.autograd.forward_ad).
    Under torch.func transforms, and for tensor subclasses that dispatch in Python, F.conv2d
    computes it. Under torch.compile it is the custom op torch.ops.dwconv.conv2d (no graph break).
    """
    if isinstance(input, torch.Tensor) and torch.is_autocast_enabled(input.device.type):
        input, weight, bias = _autocast(input, weight, bias)
    if _EAGER is not None and isinstance(input, torch.Tensor) and not torch.compiler.is_compiling() \
            and _EAGER[2].enabled(input) and forward_ad._current_level < 0:
        out = _EAGER[2].conv_known(input, weight, bias, stride, padding, dilation)  # (seen before: no checks)
        if out is not None:
            return out
    geom = conv_geometry(input, weight, bias, stride, padding, dilation)
    if not uses_triton(input):
        return F.conv2d(input, weight, bias, stride, padding, dilation, groups=geom.in_channels)
    if torch.compiler.is_compiling():  # one custom op in the graph, with its registered backward
        from ._library import conv_arguments

        return torch.ops.dwconv.conv2d(input, weight, bias, *conv_arguments(geom))
    if _pytorch_must_run(input, weight, bias):
        return F.conv2d(input, weight, bias, stride, padding, dilation, groups=geom.in_channels)
    if input.is_neg() or weight.is_neg() or (bias is not None and bias.is_neg()):
        input, weight, bias = (None if t is None else t.resolve_neg() for t in (input, weight, bias))
    function, conv_forward, native = _eager_path()
    # (forward-mode AD: the Python Function, whose jvp gives the tangent; the C++ one has none)
    dual = forward_ad._current_level >= 0
    if not dual and native.enabled(input):
        out = native.conv(input, weight, bias, geom, (stride, padding, dilation))
        if out is not None:
            return out
    if dual or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias))):
        return function.apply(input, weight, bias, geom)
    return conv_forward(input, weight, bias, geom)


def _pytorch_must_run(*tensors: Optional[torch.Tensor]) -> bool:
    """Tensors without memory of their own for the kernels to read: torch.func's wrappers (grad,
    vmap, jacrev, ...) and tensor subclasses that dispatch in Python. F.conv2d computes these, with
    every transform PyTorch supports."""
    if torch._C._functorch.peek_interpreter_stack() is not None:  # (a transform is running)
        return any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)
    return any(t is not None and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter
               and torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python) for t in tensors)


_EAGER = None


def _eager_path():
    """(DepthwiseConv2dFunction, conv_forward, ops.native), imported on first use (importing them imports Triton,
    which must come after a caller such as the no-GPU demo sets TRITON_INTERPRET) and kept: an
    import statement costs ~2 us a call."""
    global _EAGER
    if _EAGER is None:
        from ._library import DepthwiseConv2dFunction
        from .ops import native
        from .ops.forward import conv_forward

        _EAGER = (DepthwiseConv2dFunction, conv_forward, native)
    return _EAGER


def _autocast(input, weight, bias):
    """As autocast treats F.conv2d: floating tensors other than float64 go to the autocast dtype."""
    dtype = torch.get_autocast_dtype(input.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in (input, weight, bias))
