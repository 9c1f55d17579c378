"""A squeeze-and-excitation block in training (dwconv.fuse's modules, in eager where a gradient is
wanted): `input * gate(squeeze(input))` on kernels/squeeze_excite.py, the gate computed by the
module's own members. In reading order: the autograd Function (the path without the C++ replayer),
the call that stands for the module's forward, and `block`, which picks the path.

Forward: the squeeze (the module's own mean or pool), the gate from it by the members' calls
(PyTorch's ops on [N, C, 1, 1]), then the gate's multiply in one pass (PyTorch's broadcast multiply
computes each element's broadcast index). Backward: one pass over grad and the input for the gate's
gradient (the sums over H and W of grad * input); autograd differentiates the members' graph from it
(their parameters' gradients and the squeeze's); then one pass for grad_input = grad * gate + the
squeeze's gradient / (H * W). Stock's backward takes two broadcast multiplies, a reduction, the
squeeze's backward and an addition of the input's two gradients over the whole tensor.

Where the C++ replayer is on (replay.native.enabled: CUDA tensors once it is built), the block is two
autograd nodes written in C++ around the members' ops, which stay in the caller's graph
(replay.cpp's SqueezeFunction and ScaleFunction): no Python Function and no nested backward, whose
host cost made the block slower than stock on a slow host (docs/decisions.md). Elsewhere (and
where the nodes' multiply cannot be recorded) the Function keeps the members' small graph and
differentiates it in its backward. Under create_graph=True (or for a gate of another
dtype than the input's) either path's gradients are PyTorch's differentiable ops, so gradients of
any order are PyTorch's. Eval calls with nothing differentiated are the registered op
dwconv::squeeze_excite instead (dwconv._library).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.autograd import forward_ad

from . import precompile
from .functional import uses_triton
from .kernels import squeeze_excite as kernels
from .replay import native
from .replay.native import replayed


class SqueezeExciteFunction(torch.autograd.Function):
    """input * gate_of(squeeze(input)), squeeze the pool (None: the mean over H and W), gate_of the
    members' calls on it, parameters every tensor of theirs that may want a gradient."""

    @staticmethod
    def forward(ctx, input: Tensor, gate_of: Callable, pool: Optional[Callable], *parameters: Tensor) -> Tensor:
        squeezed = _squeeze(pool, input)
        with torch.enable_grad():  # (the members' graph, which the backward differentiates)
            leaf = squeezed.detach().requires_grad_()
            gate = gate_of(leaf)
        ctx.save_for_backward(input, *parameters)
        ctx.gate_of, ctx.pool, ctx.leaf, ctx.gate = gate_of, pool, leaf, gate
        device = input.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        # (a plain tensor of the input's dtype and device, [N, C, 1, 1]: what the launches read; else
        # PyTorch's ops, forward and backward)
        ctx.on_kernels = (type(gate) is Tensor and gate.dtype == input.dtype and gate.device == input.device
                          and tuple(gate.shape) == (*input.shape[:2], 1, 1))
        if not ctx.on_kernels:
            return input * gate.detach()
        return replayed(kernels.channel_scale, [input, _rows(gate.detach())])

    @staticmethod
    def backward(ctx, grad: Tensor):
        input, *parameters = ctx.saved_tensors
        wanted = ctx.needs_input_grad
        if torch.is_grad_enabled() or not ctx.on_kernels:
            return _recomputed_backward(ctx, grad, input, parameters)
        # (grad and the input in one layout the kernels read: channels_last wherever the input is so;
        # a saved-tensor hook may hand the input back in any)
        layout = torch.channels_last if input.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
        grad, input = grad.contiguous(memory_format=layout), input.contiguous(memory_format=layout)
        gate = ctx.gate
        gate_grad = replayed(kernels.gate_gradient, [grad, input], gate.dtype)
        sources = [ctx.leaf] + [p for p, w in zip(parameters, wanted[3:]) if w]
        # (retain_graph: a caller may run the outer backward again, as stock's allows with retain_graph)
        grads = torch.autograd.grad(gate, sources, gate_grad.reshape(gate.shape), retain_graph=True,
                                    allow_unused=True)
        grad_input = None
        if wanted[0]:  # (the squeeze's gradient spread over the pixels by the multiply's launch itself)
            grad_input = replayed(kernels.channel_scale, [grad, _rows(gate.detach()), _rows(grads[0])])
        parameter_grads = iter(grads[1:])
        return (grad_input, None, None, *(next(parameter_grads) if w else None for w in wanted[3:]))


def _squeeze(pool: Optional[Callable], input: Tensor) -> Tensor:
    """The block's squeeze of the input as the module takes it: its pool (torchvision's), else the
    mean over H and W (timm's)."""
    return pool(input) if pool is not None else input.mean((2, 3), keepdim=True)


def _rows(gate: Tensor) -> Tensor:
    """The gate [N, C, 1, 1] as the kernels read it: [N, C], contiguous."""
    return gate.reshape(gate.shape[:2]).contiguous()


def _recomputed_backward(ctx, grad: Tensor, input: Tensor, parameters: list) -> tuple:
    """The Function's gradients by PyTorch's ops: the block recomputed (under the forward's autocast
    state) and differentiated by autograd, differentiably where create_graph=True."""
    wanted = ctx.needs_input_grad
    device, dtype, enabled = ctx.autocast
    with torch.enable_grad():
        source = input if wanted[0] else input.detach()
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            squeezed = _squeeze(ctx.pool, source)
            out = source * ctx.gate_of(squeezed)
        sources = ([input] if wanted[0] else []) + [p for p, w in zip(parameters, wanted[3:]) if w]
        grads = iter(torch.autograd.grad(out, sources, grad, create_graph=torch.is_grad_enabled(), allow_unused=True)
                     if sources else ())
    return (next(grads) if wanted[0] else None, None, None, *(next(grads) if w else None for w in wanted[3:]))


def trained(members: tuple, parameters: tuple, input: Tensor) -> Optional[Tensor]:
    """The forward of a found squeeze-and-excitation module (fuse._SqueezeExcite) whose members
    (reduce, activation, expand, gate, and torchvision's pool or None) are as they were found and
    without hooks, parameters their tensors (the convolutions' weights and biases; None for an
    absent bias): `block` where the kernels take the input (a plain tensor on their device,
    channels_last or contiguous, no transform, trace or forward-mode AD). None where they do not:
    the caller runs the module's own forward."""
    if not _scale_computes(input):
        return None
    reduce, activation, expand, gate_module, pool = members

    def gate_of(squeezed: Tensor) -> Tensor:
        return gate_module(expand(activation(reduce(squeezed))))

    if precompile._TRACING.__dict__.get("active"):  # (a warmup's fake run: the kernels compile)
        gate = gate_of(_squeeze(pool, input))
        precompile.record_channel_scale(input, gate)
        return input * gate
    return block(input, gate_of, pool, [t for t in parameters if t is not None])


def block(input: Tensor, gate_of: Callable, pool: Optional[Callable], parameters: list) -> Tensor:
    """input * gate_of(squeeze(input)) for an input the kernels take: the C++ replayer's nodes
    around the gate's own ops where the replayer is on (replay.native.enabled), else
    SqueezeExciteFunction (parameters: every tensor of the gate's that may want a gradient)."""
    if native.enabled(input):
        out = native.squeeze_excite(input, gate_of, pool is not None, _passes())
        if out is not None:
            return out
    return SqueezeExciteFunction.apply(input, gate_of, pool, *parameters)


@functools.lru_cache(maxsize=None)
def _passes() -> tuple:
    """The C++ nodes' passes (replay.native.squeeze_excite), one tuple, part of their layers' keys:
    the multiply (input, gate rows), and by mask 1 the input's gradient (grad, gate rows, the
    squeeze's gradient rows), 2 the gate's (grad, input)."""
    def backward(mask: int, *tensors: Tensor) -> Tensor:
        if mask == 1:
            return kernels.channel_scale(*tensors)
        return kernels.gate_gradient(*tensors, tensors[1].dtype)
    return kernels.channel_scale, backward


def _scale_computes(input: Tensor) -> bool:
    """Whether the input is one the Function's kernels take (the gate is checked in its forward)."""
    if precompile._TRACING.__dict__.get("active"):
        return input.dim() == 4  # (fake tensors: the warmup records the call)
    return (type(input) is Tensor and uses_triton(input) and not torch._C._is_tracing()
            and forward_ad._current_level < 0 and torch._C._functorch.peek_interpreter_stack() is None
            and input.is_floating_point() and kernels.scalable(input))


def gate_members(places: tuple) -> tuple:
    """(reduce, activation, expand, gate, pool or None) from a found module's places."""
    members = tuple(member for _, _, member in places)
    return members if len(members) == 5 else members + (None,)
