"""A squeeze-and-excitation block in training (dwconv.fuse's modules, in eager where a gradient is
wanted): the gate from the module's own members, then `input * gate` as one autograd Function on
kernels/squeeze_excite.py. In reading order: the reference (the module's own class), the Function,
the call that stands for the module's forward.

Forward: the gate's multiply in one pass (PyTorch's broadcast multiply computes each element's
broadcast index). Backward: grad_input = grad * gate and the gate's gradient (the sums over H and W
of grad * input) in one pass over grad and the input, where PyTorch's backward of the multiply
takes two broadcast multiplies and a reduction; the gate's own small graph (the mean, the two 1x1
convolutions and activations) stays PyTorch's, which autograd differentiates. Both passes go
through the C++ replayer (replay.native.replayed) where it is on. Under create_graph=True the
backward is PyTorch's ops, so gradients of any order are PyTorch's. Eval calls with nothing
differentiated are the registered op dwconv::squeeze_excite instead (dwconv._library).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd import forward_ad

from . import precompile
from .functional import uses_triton
from .kernels import squeeze_excite as kernels
from .replay.native import replayed


class ChannelScaleFunction(torch.autograd.Function):
    """input * gate, gate [N, C, 1, 1] of the input's dtype, on the kernels."""

    @staticmethod
    def forward(ctx, input: Tensor, gate: Tensor) -> Tensor:
        ctx.save_for_backward(input, gate)  # (the inputs themselves: a double backward differentiates them)
        return replayed(kernels.channel_scale, [input, _rows(gate)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        input, gate = ctx.saved_tensors
        want_input, want_gate = ctx.needs_input_grad
        if torch.is_grad_enabled():  # (create_graph=True: PyTorch's ops, which autograd differentiates again)
            return (grad * gate if want_input else None,
                    (grad * input).sum((2, 3), keepdim=True).to(gate.dtype) if want_gate else None)
        # (grad laid out as the kernel reads the input: channels_last wherever the input is so)
        channels_last = input.is_contiguous(memory_format=torch.channels_last)
        grad = grad.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        grad_input, grad_gate = replayed(kernels.channel_scale_backward, [grad, input, _rows(gate)], want_input)
        return grad_input, grad_gate.reshape(gate.shape) if want_gate else None


def _rows(gate: Tensor) -> Tensor:
    """The gate [N, C, 1, 1] as the kernels read it: [N, C], contiguous."""
    return gate.reshape(gate.shape[:2]).contiguous()


def trained(members: tuple, input: Tensor) -> Optional[Tensor]:
    """The forward of a found squeeze-and-excitation module (fuse._SqueezeExcite) whose members
    (reduce, activation, expand, gate, and torchvision's pool or None) are as they were found and
    without hooks: the gate as the module computes it, by the members' own calls (timm's module
    takes the mean itself), then ChannelScaleFunction where the kernels take the call (plain tensors
    of one dtype on their device, the input channels_last or contiguous, no transform, trace or
    forward-mode AD; else PyTorch's multiply, as the module's). None where the input is not one the
    kernels take: the caller runs the module's own forward."""
    if not _scale_computes(input):
        return None
    reduce, activation, expand, gate_module, pool = members
    squeezed = pool(input) if pool is not None else input.mean((2, 3), keepdim=True)
    gate = gate_module(expand(activation(reduce(squeezed))))
    if precompile._TRACING.__dict__.get("active"):  # (a warmup's fake run: the kernels compile)
        precompile.record_channel_scale(input, gate)
        return input * gate
    if type(gate) is not Tensor or gate.dtype != input.dtype or gate.device != input.device \
            or tuple(gate.shape) != (*input.shape[:2], 1, 1):
        return input * gate
    return ChannelScaleFunction.apply(input, gate)


def _scale_computes(input: Tensor) -> bool:
    """Whether the input is one the Function takes (the gate is checked once computed)."""
    if precompile._TRACING.__dict__.get("active"):
        return input.dim() == 4  # (fake tensors: the warmup records the call)
    return (type(input) is Tensor and uses_triton(input) and not torch._C._is_tracing()
            and forward_ad._current_level < 0 and torch._C._functorch.peek_interpreter_stack() is None
            and input.is_floating_point() and kernels.scalable(input))


def gate_members(places: tuple) -> tuple:
    """(reduce, activation, expand, gate, pool or None) from a found module's places."""
    members = tuple(member for _, _, member in places)
    return members if len(members) == 5 else members + (None,)
