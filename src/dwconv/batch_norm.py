"""BatchNorm2d in training mode with the activation after it, as one autograd Function on dwconv's
kernels (kernels/batch_norm.py): what a fused depthwise block computes after its convolution while
its BatchNorm trains. In reading order: the reference (the stock modules), the Function, the call
that stands for `activation(norm(y))`.

Forward: two passes over y (the statistics; the normalisation and activation), the running
statistics and num_batches_tracked updated as nn.BatchNorm2d updates them. Only y and the batch's
statistics are saved (stock keeps the normalised tensor as well, for the activation's backward).
Backward: two passes (the sums BatchNorm's gradient needs; grad_y), the activation's derivative
recomputed from y; under create_graph=True, PyTorch's own ops recompute the block and autograd
differentiates them, so gradients of any order are PyTorch's. Where the C++ replayer is on, the
block's BatchNorm is its C++ Function instead (replay.native.batch_norm: the same kernels' passes as
recorded programs, no Python in the backward), and the Python Function's passes go through the
replayer (replay.native.replayed) where it still runs.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .activations import FUNCTIONS, activation_code
from .replay import native
from .replay.native import replayed


def reference(y: Tensor, norm: nn.BatchNorm2d, activation_module: Optional[nn.Module]) -> Tensor:
    """The stock modules' computation (their own classes' forward, without the fused block's
    pass-through): what the Function replaces, and what runs where its kernels cannot."""
    y = _own_class(norm).forward(norm, y)
    return y if activation_module is None else _own_class(activation_module).forward(activation_module, y)


def _own_class(module: nn.Module) -> type:
    """The class a fused block's module had before (fuse.folded_class made a subclass of it)."""
    cls = type(module)
    return cls.__mro__[2] if hasattr(cls, "dwconv_role") else cls


class BatchNormActivationFunction(torch.autograd.Function):
    """activation(batch_norm(y, training=True)) on the kernels; the running statistics, where given,
    updated in place."""

    @staticmethod
    def forward(ctx, y, weight, bias, running_mean, running_var, momentum: float, eps: float, activation: str,
                replay: bool = True):
        from .kernels.batch_norm import batch_norm_forward

        # (replay: the passes' launches from C++ where the replayer is on; off for a momentum that
        # changes each call, the cumulative average, whose every call would be a new program)
        inputs, arguments = [y, weight, bias, running_mean, running_var], (momentum, eps, activation_code(activation))
        out, mean, invstd = (replayed(batch_norm_forward, inputs, *arguments, writes=(3, 4)) if replay
                             else batch_norm_forward(*inputs, *arguments))
        ctx.save_for_backward(y, weight, bias, mean, invstd)
        ctx.eps, ctx.activation = eps, activation
        return out

    @staticmethod
    def backward(ctx, grad):
        y, weight, bias, mean, invstd = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # (create_graph=True: PyTorch's ops, which autograd differentiates again)
            return (*_differentiable_backward(grad, y, weight, bias, ctx.eps, ctx.activation, wanted),
                    None, None, None, None, None, None)
        from .kernels.batch_norm import batch_norm_backward

        grad_y, grad_weight, grad_bias = replayed(batch_norm_backward, [grad, y, weight, bias, mean, invstd], ctx.eps,
                                                  activation_code(ctx.activation))
        return (grad_y if wanted[0] else None, grad_weight if wanted[1] else None, grad_bias if wanted[2] else None,
                None, None, None, None, None, None)


def _differentiable_backward(grad, y, weight, bias, eps, activation, wanted):
    """The gradients as PyTorch computes them, through ops autograd records (the block recomputed
    from the saved y: the batch's statistics are functions of it)."""
    inputs = [t for t, w in zip((y, weight, bias), wanted) if w]
    with torch.enable_grad():
        out = FUNCTIONS[activation](torch.nn.functional.batch_norm(y, None, None, weight, bias, True, 0.0, eps))
        grads = iter(torch.autograd.grad(out, inputs, grad, create_graph=True, allow_unused=True))
    return tuple(next(grads) if w else None for w in wanted)


# ---- the registered ops: what torch.compile's graphs hold ------------------------------------------
# Opaque to Inductor, which would otherwise decompose BatchNorm into its own reduction and pointwise
# kernels: slower than these on channels_last tensors (docs/decisions.md, "Compiled, the trained
# BatchNorms are dwconv's ops").

@torch.library.custom_op("dwconv::batch_norm_statistics", mutates_args=("running_mean", "running_var"))
def batch_norm_statistics_op(y: Tensor, running_mean: Tensor, running_var: Tensor, momentum: float, eps: float
                             ) -> Tuple[Tensor, Tensor]:
    """(the batch's mean, 1 / sqrt(var + eps)) per channel, the running statistics updated in place
    (momentum: the batch's weight); y NCHW or dense channels_last. Not differentiated: the normalising
    op's backward below is BatchNorm's whole backward, through these statistics too."""
    from .kernels.batch_norm import batch_norm_statistics

    return batch_norm_statistics(_dense(y), running_mean, running_var, momentum, eps)


@batch_norm_statistics_op.register_fake
def _(y, running_mean, running_var, momentum, eps):
    statistics = y.new_empty((y.shape[1],), dtype=_statistics_dtype(y))
    return statistics, torch.empty_like(statistics)


@torch.library.custom_op("dwconv::batch_norm_activation", mutates_args=())
def batch_norm_activation_op(y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                             invstd: Tensor, eps: float, activation: str) -> Tensor:
    """activation(batch_norm(y, training=True)) from the batch's statistics (batch_norm_statistics of
    this y); y NCHW or dense channels_last."""
    from .kernels.batch_norm import batch_norm_normalize

    return batch_norm_normalize(_dense(y), weight, bias, mean, invstd, eps, activation_code(activation))


@batch_norm_activation_op.register_fake
def _(y, weight, bias, mean, invstd, eps, activation):
    activation_code(activation)
    return torch.empty_like(_dense(y))


@torch.library.custom_op("dwconv::batch_norm_activation_backward", mutates_args=())
def batch_norm_activation_backward_op(grad: Tensor, y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                                      mean: Tensor, invstd: Tensor, eps: float, activation: str) -> List[Tensor]:
    """[grad_y] (y's strides), or [grad_y, grad_weight, grad_bias] with weight, of the op above."""
    from .kernels.batch_norm import batch_norm_backward

    grads = batch_norm_backward(grad, y, weight, bias, mean, invstd, eps, activation_code(activation))
    return list(grads) if weight is not None else [grads[0]]


@batch_norm_activation_backward_op.register_fake
def _(grad, y, weight, bias, mean, invstd, eps, activation):
    return [torch.empty_like(y)] + ([torch.empty_like(weight), torch.empty_like(bias)] if weight is not None else [])


def _op_setup(ctx, inputs, output):
    y, weight, bias, mean, invstd, eps, activation = inputs
    ctx.save_for_backward(y, weight, bias, mean, invstd)
    ctx.eps, ctx.activation = eps, activation


def _op_backward(ctx, grad):
    y, weight, bias, mean, invstd = ctx.saved_tensors
    wanted = ctx.needs_input_grad[:3]
    if torch.is_grad_enabled():  # (create_graph=True: PyTorch's ops, which autograd differentiates again)
        grads = _differentiable_backward(grad, y, weight, bias, ctx.eps, ctx.activation, wanted)
    else:
        grads = torch.ops.dwconv.batch_norm_activation_backward(grad, y, weight, bias, mean, invstd, ctx.eps,
                                                                ctx.activation)
        grads = list(grads) + [None, None]
    return (*(g if w else None for g, w in zip(grads, wanted)), None, None, None, None)


batch_norm_activation_op.register_autograd(_op_backward, setup_context=_op_setup)


def _dense(y: Tensor) -> Tensor:
    """y as the kernels read it: NCHW or dense channels_last (what the convolutions give)."""
    return y if y.is_contiguous() or y.is_contiguous(memory_format=torch.channels_last) else y.contiguous()


def _statistics_dtype(y: Tensor) -> torch.dtype:
    return torch.float64 if y.dtype == torch.float64 else torch.float32


def _check(y: Tensor) -> None:
    """nn.BatchNorm2d's checks of its input in training, with its messages."""
    if y.dim() != 4:
        raise ValueError(f"expected 4D input (got {y.dim()}D input)")
    if y.numel() // y.shape[1] <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {y.size()}")


def compiled_batch_norm_activation(y: Tensor, norm: nn.BatchNorm2d, activation: str) -> Tensor:
    """batch_norm_activation's call as torch.compile traces it: the registered op (a momentum, not
    the cumulative average, whose weight would be read back from the count)."""
    _check(y)
    tracked = norm._buffers.get("num_batches_tracked")
    if tracked is not None:
        tracked.add_(1)
    ops = torch.ops.dwconv
    mean, invstd = ops.batch_norm_statistics(y.detach(), norm.running_mean, norm.running_var, norm.momentum, norm.eps)
    return ops.batch_norm_activation(y, norm.weight, norm.bias, mean, invstd, norm.eps, activation)


@functools.lru_cache(maxsize=None)
def _passes(activation: str, eps: float) -> tuple:
    """The C++ Function's passes (replay.native.batch_norm) for an activation and eps: one tuple
    each, part of its layers' keys."""
    from .kernels.batch_norm import batch_norm_backward, batch_norm_forward

    def python_backward(mask, grad, y, weight, bias, mean, invstd):
        wanted = tuple(bool(mask >> i & 1) for i in range(3))
        if torch.is_grad_enabled():  # (create_graph=True)
            return list(_differentiable_backward(grad, y, weight, bias, eps, activation, wanted))
        grads = batch_norm_backward(grad, y, weight, bias, mean, invstd, eps, activation_code(activation))
        return [g if w else None for g, w in zip(grads, wanted)]
    return batch_norm_forward, batch_norm_backward, python_backward


def batch_norm_activation(y: Tensor, norm: nn.BatchNorm2d, activation: str) -> Tensor:
    """FUNCTIONS[activation](norm(y)) for norm in training mode with running statistics, on the
    kernels: the call of nn.BatchNorm2d.forward (num_batches_tracked, momentum or its cumulative
    average, the check that a channel has more than one value)."""
    _check(y)
    momentum = 0.0 if norm.momentum is None else norm.momentum
    buffers, parameters = norm._buffers, norm._parameters  # (Module.__getattr__ costs at every call)
    tracked = buffers.get("num_batches_tracked")
    if tracked is not None:
        tracked.add_(1)
        if norm.momentum is None:  # (a cumulative average: PyTorch reads the count back too)
            momentum = 1.0 / float(tracked)
    if not (y.is_contiguous() or y.is_contiguous(memory_format=torch.channels_last)):
        y = y.contiguous()  # (the kernels read NCHW or dense channels_last; the convolution gives those)
    tensors = (parameters.get("weight"), parameters.get("bias"), buffers.get("running_mean"),
               buffers.get("running_var"))
    if "weight" not in parameters or "bias" not in parameters:  # (parametrized: computed at each access)
        tensors = (norm.weight, norm.bias, *tensors[2:])
    if norm.momentum is not None and tensors[0] is not None and tensors[1] is not None and native.enabled(y):
        out = native.batch_norm(y, *tensors, (momentum, norm.eps, activation_code(activation)),
                                _passes(activation, norm.eps))
        if out is not None:
            return out
    return BatchNormActivationFunction.apply(y, *tensors, momentum, norm.eps, activation, norm.momentum is not None)
