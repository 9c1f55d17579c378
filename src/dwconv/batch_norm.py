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
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

# (importing _library also registers the ops compiled graphs call)
from ._library import batch_norm_input, differentiable_batch_norm_backward
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
            return (*differentiable_batch_norm_backward(grad, y, weight, bias, ctx.eps, ctx.activation, wanted),
                    None, None, None, None, None, None)
        from .kernels.batch_norm import batch_norm_backward

        grad_y, grad_weight, grad_bias = replayed(batch_norm_backward, [grad, y, weight, bias, mean, invstd], ctx.eps,
                                                  activation_code(ctx.activation))
        return (grad_y if wanted[0] else None, grad_weight if wanted[1] else None, grad_bias if wanted[2] else None,
                None, None, None, None, None, None)


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
    y = batch_norm_input(y)  # (once: the ops and the backward's saved input then read it as it is)
    tracked = norm._buffers.get("num_batches_tracked")
    if tracked is not None:
        tracked.add_(1)
    ops, code = torch.ops.dwconv, activation_code(activation)
    mean, invstd = ops.batch_norm_statistics(y.detach(), norm.running_mean, norm.running_var, norm.momentum, norm.eps)
    return ops.batch_norm_activation(y, norm.weight, norm.bias, mean, invstd, norm.eps, code)


@functools.lru_cache(maxsize=None)
def _passes(activation: str, eps: float) -> tuple:
    """The C++ Function's passes (replay.native.batch_norm) for an activation and eps: one tuple
    each, part of its layers' keys."""
    from .kernels.batch_norm import batch_norm_backward, batch_norm_forward

    def python_backward(mask, grad, y, weight, bias, mean, invstd):
        wanted = tuple(bool(mask >> i & 1) for i in range(3))
        if torch.is_grad_enabled():  # (create_graph=True)
            return list(differentiable_batch_norm_backward(grad, y, weight, bias, eps, activation, wanted))
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
    y = batch_norm_input(y)
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
