"""User-facing functional API: `depthwise_conv2d`."""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch.fx import Proxy

from . import replay
from ._env import triton_interpreter_enabled
from ._geometry import IntOrPair, Padding, conv_geometry, forward_activation_code
from .activations import FUNCTIONS, activation_code


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
    activation: Optional[str] = None,
) -> torch.Tensor:
    """Depthwise 2-D convolution: F.conv2d(input, weight, bias, stride, padding, dilation,
    groups=input.shape[1]), computed by dwconv's Triton kernels.

    weight has shape (C * multiplier, 1, kH, kW). padding is an int, a pair, 'valid' or
    'same'. float32, float16 and bfloat16 accumulate in float32; float64 runs and
    accumulates in float64. Under torch.autocast the inputs are cast as F.conv2d casts them.
    CPU tensors fall back to PyTorch unless TRITON_INTERPRET=1. Differentiable in input, weight
    and bias, to any order (create_graph=True), and in forward mode (torch.autograd.forward_ad).
    Under torch.func transforms, and for tensor subclasses that dispatch in Python, F.conv2d
    computes it. Under torch.compile, torch.export and torch.jit.trace it is the custom op
    torch.ops.dwconv.conv2d (no graph break; a traced or exported graph holds the op).

    activation: one of dwconv.activations.FUNCTIONS ("relu", "relu6", "silu", "gelu", "gelu_tanh",
    "hardswish", "hardsigmoid", "identity") or None, applied to the output: where no gradient is
    wanted, in the kernel's epilogue (each output activated before its one rounding, and stored
    once); where one is (or under forward-mode AD), by PyTorch's function after the convolution,
    which autograd differentiates.
    """
    if isinstance(input, Proxy):  # (torch.fx's symbolic trace: one node, as F.conv2d's, not its checks)
        return input.tracer.create_proxy("call_function", depthwise_conv2d,
                                         (input, weight, bias, stride, padding, dilation),
                                         {"activation": activation} if activation is not None else {})
    fused = activation_code(activation) > 0
    if fused and _gradient_wanted(input, weight, bias):
        return FUNCTIONS[activation](depthwise_conv2d(input, weight, bias, stride, padding, dilation))
    return _forward(input, weight, bias, stride, padding, dilation, *((activation,) if fused else ()))


def _forward(input, weight, bias, stride, padding, dilation, *activation) -> torch.Tensor:
    """depthwise_conv2d's call, with an activation (a name, or a pair: the input's and the output's,
    a fused block's, dwconv.fuse) only where no gradient is wanted of it."""
    # (seen before: no checks again, and autocast's casts made in C++)
    out = _known_layer(input, weight, bias, stride, padding, dilation, *activation)
    if out is None:
        if isinstance(input, torch.Tensor) and torch.is_autocast_enabled(input.device.type):
            input, weight, bias = _autocast(input, weight, bias)
        geom = _geometry(input, weight, bias, stride, padding, dilation)
        # (the arguments as passed, and an activation after them: what a warmup's recording keeps)
        out = _DOORS[_door(input, weight, bias)](input, weight, bias, geom, (stride, padding, dilation, *activation))
    return out


def _gradient_wanted(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd (reverse or forward mode) will differentiate the call's output."""
    return forward_ad._current_level >= 0 or (torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors))


def _geometry(input, weight, bias, stride, padding, dilation):
    """conv_geometry; under torch.jit.trace with the trace suspended, where sizes read as tensors:
    the op's arguments must be ints, and each check would warn that it is traced as a constant."""
    if torch.compiler.is_compiling() or not torch._C._is_tracing():  # (is_compiling first: Dynamo cannot trace it)
        return conv_geometry(input, weight, bias, stride, padding, dilation)
    with trace_suspended():
        return conv_geometry(input, weight, bias, stride, padding, dilation)


@contextlib.contextmanager
def trace_suspended():
    """Nothing inside is recorded by a running torch.jit.trace (sizes read as ints again)."""
    tracing = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(tracing)


def _known_layer(input, weight, bias, stride, padding, dilation, *activation) -> Optional[torch.Tensor]:
    """The C++ path's answer for a call whose tensors (after autocast's casts) and arguments (an
    activation after them: a call that no gradient is wanted of) were recorded before, or None."""
    # (is_compiling first: Dynamo must not trace into the registry; torch 2.11's cannot trace bool(dict))
    if not torch.compiler.is_compiling() and replay.native.has_known_layers() and isinstance(input, torch.Tensor) \
            and forward_ad._current_level < 0 and not torch._C._is_tracing() and replay.enabled(input) \
            and not compiled_autograd_on():
        return replay.conv_known(input, weight, bias, stride, padding, dilation, *activation)
    return None


def _door(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> str:
    """Who computes a checked call: PyTorch for tensors the kernels cannot read (CPU without the
    interpreter, torch.func's wrappers, Python-dispatch subclasses), the registered op under
    torch.compile and torch.jit.trace (one op in the graph, with its registered backward; a trace
    records operators, never the eager path's kernel launches, and would hold only their outputs'
    allocations) and under compiled autograd, else the eager path."""
    if not uses_triton(input):
        return "pytorch"
    if torch.compiler.is_compiling():
        return "op"
    if _pytorch_must_run(input, weight, bias):
        return "pytorch"
    return "op" if torch._C._is_tracing() or compiled_autograd_on() else "eager"


def compiled_autograd_on() -> bool:
    """Whether compiled autograd is on (torch._dynamo.compiled_autograd._enable; inside a compiled
    call where torch._dynamo.config.compiled_autograd is set): it traces the backward of what is
    recorded now with fake tensors, which the registered ops' backward allows and the eager path's
    autograd nodes, whose kernels read real memory, do not."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and getattr(module, "compiled_autograd_enabled", False)


def _pytorch(input, weight, bias, geom, arguments):
    activation = arguments[3] if len(arguments) > 3 else "identity"
    if isinstance(activation, tuple):  # (an input activation too: a fused block's)
        input, activation = FUNCTIONS[activation[0]](input), activation[1]
    return FUNCTIONS[activation](F.conv2d(input, weight, bias, *arguments[:3], groups=geom.in_channels))


def _registered_op(input, weight, bias, geom, arguments):
    from ._library import conv_arguments

    if len(arguments) > 3:  # (an activation: no gradient is wanted)
        return torch.ops.dwconv.conv2d_activated(input, weight, bias, *conv_arguments(geom),
                                                 forward_activation_code(arguments[3]))
    return torch.ops.dwconv.conv2d(input, weight, bias, *conv_arguments(geom))


def _eager(input, weight, bias, geom, arguments):
    # imported at the first call (it imports Triton, which must come after a caller such as the
    # no-GPU demo sets TRITON_INTERPRET), then called directly (an import statement costs ~2 us)
    from ._library import eager_conv

    _DOORS["eager"] = eager_conv
    return eager_conv(input, weight, bias, geom, arguments)


_DOORS = {"pytorch": _pytorch, "op": _registered_op, "eager": _eager}


def _pytorch_must_run(*tensors: Optional[torch.Tensor]) -> bool:
    """Tensors without memory of their own for the kernels to read: torch.func's wrappers (grad,
    vmap, jacrev, ...) and tensor subclasses that dispatch in Python. F.conv2d computes these, with
    every transform PyTorch supports."""
    if torch._C._functorch.peek_interpreter_stack() is not None:  # (a transform is running)
        return any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)
    return any(t is not None and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter
               and torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python) for t in tensors)


def _autocast(input, weight, bias):
    """As autocast treats F.conv2d: floating tensors other than float64 go to the autocast dtype."""
    dtype = torch.get_autocast_dtype(input.device.type)
    # (a tensor already in the dtype is not cast: a call each saved, the input's usually)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype != dtype and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in (input, weight, bias))
