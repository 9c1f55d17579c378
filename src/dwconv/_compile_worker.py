"""The compile workers of `dwconv.warmup`:
`python -m dwconv._compile_worker ARCH TUNING_CHANGES_JSON IN_FD,OUT_FD [IN_FD,OUT_FD ...]`.

A worker reads one task a line from its IN_FD (JSON, `precompile.LayerCall.to_json`: a layer
call, a pass, a launch number) and runs dwconv's eager forward or backward for it on CPU tensors
that are never written, with the GPU's launch plans, in a process that compiles a launch for
compute capability ARCH instead of running it (`_triton_compat.compile_only`). The kernels (and,
under Triton 3.6, their C launchers) land in Triton's disk cache, where the process that trains
finds them. It answers one line a task on OUT_FD: `ok SECONDS LAUNCHES KEYS` (the pass's launches,
counted; where the task was to count them (launch -1), KEYS lists their binaries' keys, comma-
separated) or `error MESSAGE`. One process imports torch, Triton and dwconv once and forks a worker
for each further pair of descriptors (16 processes importing torch at once took ~4.6 s to a first
answer on the GPU machine's host). A process of its own (not multiprocessing), so that a user's
script without a __main__ guard is never imported again.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # (before the kernels are decorated: they must compile)
os.environ["DWCONV_NATIVE"] = "0"  # (the C++ path launches the same kernels; nothing to build here)


def compile_call(call: dict) -> None:
    """call["pass"]: "forward", or "backward" (the gradients call["grads"] asks for, from a grad_out in
    the output's layout, as autograd's would be). The pass runs whole; which of its launches compile
    is the worker's `select` (call["launch"]): the kernels of one pass compile in several workers."""
    import torch

    from ._geometry import conv_geometry
    from ._library import backward_for_autograd, eager_conv
    from .kernels._shared import output_memory_format

    def tensor(spec):
        if spec is None:
            return None
        shape, strides, dtype = spec
        return torch.empty_strided(shape, strides, dtype=getattr(torch, dtype))

    x, weight, bias = (tensor(spec) for spec in call["tensors"])
    arguments = tuple(tuple(a) if isinstance(a, list) else a for a in call["arguments"])
    if arguments[0] == "batch_norm":  # (precompile.BATCH_NORM: a fused block's BatchNorm in training)
        compile_batch_norm(call["pass"], x, weight, bias, *arguments[1:])
        return
    if arguments[0] == "fold":  # (precompile.FOLD: a BatchNorm folded into its convolution in eval mode)
        compile_fold(x, weight, bias, *arguments[1:])
        return
    if arguments[0] == "block":  # (precompile.BLOCK: a fused block's eval call)
        compile_block(x, weight, bias, *arguments[1:])
        return
    if arguments[0] == "squeeze_excite":  # (precompile.SQUEEZE: a squeeze-and-excitation block's eval call)
        compile_squeeze(x, weight, bias, *arguments[1:])
        return
    if arguments[0] == "channel_scale":  # (precompile.CHANNEL_SCALE: a squeeze-and-excitation's gate in training)
        compile_channel_scale(call["pass"], x, call["grads"][0])
        return
    geom = conv_geometry(x, weight, bias, *arguments[:3])  # (an activation may follow: eager_conv's)
    with torch.no_grad():
        if call["pass"] == "forward":
            eager_conv(x, weight, bias, geom, arguments)
        else:
            grad_out = torch.empty(geom.output_shape, dtype=x.dtype, memory_format=output_memory_format(x))
            backward_for_autograd(grad_out, x, weight, geom, *call["grads"])


def compile_batch_norm(pass_: str, y, weight, bias, activation: str, running_dtype: str) -> None:
    """dwconv.batch_norm's kernels for y: the forward's, or the backward's."""
    import torch

    from .activations import activation_code
    from .kernels.batch_norm import batch_norm_backward, batch_norm_forward

    code, channels = activation_code(activation), y.shape[1]
    if pass_ == "forward":
        running = [torch.empty(channels, dtype=getattr(torch, running_dtype)) for _ in range(2)]
        batch_norm_forward(y, weight, bias, *running, 0.1, 1e-5, code)
    else:
        statistics = torch.empty(channels, dtype=torch.float64 if y.dtype == torch.float64 else torch.float32)
        batch_norm_backward(torch.empty_like(y), y, weight, bias, statistics, statistics, 1e-5, code)


def compile_fold(weight, bias, norm_weight, dtype: str, running_dtype: str, eps: float) -> None:
    """kernels.batch_norm.fold's kernel for a convolution's weight (and bias) and a BatchNorm."""
    import torch

    from .kernels.batch_norm import fold

    running = [torch.empty(weight.shape[0], dtype=getattr(torch, running_dtype)) for _ in range(2)]
    norm_bias = None if norm_weight is None else torch.empty_like(norm_weight)
    fold(weight, bias, norm_weight, norm_bias, *running, eps, getattr(torch, dtype))


def compile_block(x, weight, bias, stride, padding, dilation, activation: int, norm, input_norm) -> None:
    """The registered op conv2d_block's kernels: its foldings and its convolution."""
    import torch

    def tensors(spec, channels):  # (weight, bias, running mean, running variance) and eps of a BatchNorm
        if spec is None:
            return (None,) * 4 + (0.0,)
        affine, dtype = spec
        made = [torch.empty(channels, dtype=getattr(torch, dtype)) for _ in range(4)]
        return (*(made[:2] if affine else (None, None)), *made[2:], 1e-5)

    with torch.no_grad():
        torch.ops.dwconv.conv2d_block(x, weight, bias, *tensors(norm, weight.shape[0]), *tensors(input_norm, x.shape[1]),
                                      list(stride), list(padding), list(dilation), activation)


def compile_squeeze(x, reduce_weight, expand_weight, reduce_bias, expand_bias, activation: int, gate: int) -> None:
    """The registered op squeeze_excite's kernels (the biases given as specs, or None)."""
    import torch

    def tensor(spec):
        return None if spec is None else torch.empty_strided(spec[0], spec[1], dtype=getattr(torch, spec[2]))

    with torch.no_grad():
        torch.ops.dwconv.squeeze_excite(x, reduce_weight, tensor(reduce_bias), expand_weight, tensor(expand_bias),
                                        activation, gate)


def compile_channel_scale(pass_: str, x, input_grad: bool) -> None:
    """kernels.squeeze_excite's kernels of a squeeze-and-excitation block in training for x: the gate's
    multiply (forward), or the gate's gradient and grad_input's multiply with its shift (backward)."""
    import torch

    from .kernels.squeeze_excite import channel_scale, gate_gradient

    gate = torch.empty(x.shape[:2], dtype=x.dtype)
    if pass_ == "forward":
        channel_scale(x, gate)
        return
    gate_gradient(torch.empty_like(x), x, x.dtype)
    if input_grad:  # (the squeeze's gradient in the input's dtype, as autograd gives it)
        channel_scale(torch.empty_like(x), gate, torch.empty(x.shape[:2], dtype=x.dtype))


class LaunchSelector:
    """Which launch of the running pass compiles: the one numbered `wanted` (None: all; -1: none, the
    launches' binary keys are only listed); counts them."""

    def __init__(self):
        self.wanted, self.keys = None, []

    def start(self, wanted):
        self.wanted, self.keys = wanted, []

    def __call__(self, kernel, args, kwargs) -> bool:
        from ._triton_compat import binary_key

        self.keys.append(binary_key(kernel, args, kwargs) if self.wanted == -1 else "")
        return self.wanted is None or len(self.keys) - 1 == self.wanted


def main(arch: int, tuning_changes: str, channels: list) -> None:
    import torch  # noqa: F401  (imported before the forks, once for all workers)

    from . import _library, _triton_compat, tuning  # noqa: F401

    os.dup2(2, 1)  # (anything else printed, by Python or a compiler, goes to stderr)
    children = []
    for tasks_fd, answers_fd in channels[1:]:
        child = os.fork()
        if child == 0:
            for other in channels:  # (a worker keeps its own pair only: its pipes then close with it)
                if other != (tasks_fd, answers_fd):
                    os.close(other[0]), os.close(other[1])
            serve(arch, tuning_changes, tasks_fd, answers_fd)
            os._exit(0)
        children.append(child)
    for tasks_fd, answers_fd in channels[1:]:
        os.close(tasks_fd), os.close(answers_fd)
    serve(arch, tuning_changes, *channels[0])
    for child in children:
        os.waitpid(child, 0)


def serve(arch: int, tuning_changes: str, tasks_fd: int, answers_fd: int) -> None:
    import ast

    from . import tuning
    from ._triton_compat import build_launcher, compile_only

    answers = os.fdopen(answers_fd, "w")
    selector = LaunchSelector()
    can_build_launchers = True  # (False once one could not be: no libcuda on this machine)

    def with_launcher(name, compiled, seconds):
        nonlocal can_build_launchers
        if can_build_launchers:
            can_build_launchers = build_launcher(compiled)

    compile_only(arch, on_compile=with_launcher, select=selector)
    # the caller's tuning table (its changes as repr()s), and the GPU's kernels and blocks for CPU tensors
    changes = {name: ast.literal_eval(value) for name, value in json.loads(tuning_changes).items()}
    tuning.override(**dict(changes, plan_as_gpu=True))
    for line in os.fdopen(tasks_fd):
        started = time.perf_counter()
        call = json.loads(line)
        selector.start(call.get("launch"))
        try:
            compile_call(call)
            answer = f"ok {time.perf_counter() - started:.3f} {len(selector.keys)} {','.join(selector.keys)}"
        except Exception as e:  # (reported; the layer then compiles at its first call)
            answer = "error " + " | ".join(traceback.format_exception_only(type(e), e)).replace("\n", " ")
        print(answer, file=answers, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], [tuple(int(fd) for fd in pair.split(",")) for pair in sys.argv[3:]])
