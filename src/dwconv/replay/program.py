"""Recorded passes ("programs"): what one forward or backward did, as steps to do again.

The first stage of the C++ path: a small layer's forward+backward costs
450-750 us of host time on the H200's machine, mostly the Python autograd Function and the
backward's Python on the engine's device thread, against 110-194 us for cuDNN's whole call. A
program is recorded by running dwconv's own Python path once (`record`): a TorchDispatchMode logs
every aten op it runs (allocations, views, the partial sums' sum and cast, pads) and
`_launch.launch` hands each kernel launch to the recorder, so no launcher logic is written twice.
Replaying the program on new tensors with the same `program_key` (shapes, strides, dtypes, device,
16-byte alignment: all a launcher's choices depend on) runs the same ops and launches in order.
`Program.replay` does it in Python, which is what tests on the CPU can check against the normal
path; a C++ replayer (next) takes the same steps without Python.

A program refuses what it could not replay faithfully: an op whose result is not a tensor (a value
read back to the host), or a tensor argument that came from nowhere in the log (a tensor made
before recording and not one of the inputs).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..kernels import _launch


class NotRecordable(RuntimeError):
    """The pass did something a program cannot replay."""


@dataclass(frozen=True)
class Ref:
    """A tensor of the program: inputs first (0 ..), then each op's tensor results in order."""
    index: int


@dataclass(frozen=True)
class OpStep:
    op: torch._ops.OpOverload
    args: tuple  # with Refs in place of tensors
    kwargs: dict
    results: Tuple[Optional[int], ...]  # the value index of each flattened result (None: not a tensor)


@dataclass(frozen=True)
class LaunchStep:
    kernel: Any  # a Triton JITFunction
    plan: _launch.LaunchPlan
    tensors: Tuple[Ref, ...]
    # on a GPU: the fast launch's entry for this launch (pointers, compiled kernel, grid, arguments)
    compiled: Optional[tuple] = None


def program_key(tensors: Sequence[Optional[torch.Tensor]], *extra) -> tuple:
    """What a recorded pass depends on: each tensor's layout (shape, strides, dtype, device, data
    pointer mod 16: `_launch.layout_key`'s facts) and negative bit (dwconv resolves a
    torch._neg_view before recording, so a program of a plain tensor must never be taken for one),
    or None, and the other arguments as given."""
    return tuple(None if t is None else _tensor_key(t) for t in tensors) + extra


def _tensor_key(t: torch.Tensor) -> tuple:
    # (a plain tensor's alignment read inline: the fused BatchNorm's passes key five or six tensors
    # at every call, 7.6 us through layout_key on the CPU machine, 3.2 us so)
    aligned = t.data_ptr() % 16 if type(t) in _launch.PLAIN_TENSORS else _launch.alignment(t)
    return (t.shape, t.stride(), t.dtype, t.device, aligned, t.is_neg())


class Program:
    """Steps over numbered tensor values; outputs: the pass's results (a pytree of Refs and Nones)."""

    def __init__(self, n_inputs: int, steps: List, outputs):
        self.n_inputs, self.steps, self.outputs = n_inputs, steps, outputs

    def replay(self, *inputs: Optional[torch.Tensor], poison: bool = False):
        """The pass again on inputs of the recorded key. poison: every fresh float tensor (empty)
        filled with NaN first, so that a value the launches should write and did not shows (tests)."""
        if len(inputs) != self.n_inputs:
            raise ValueError(f"program takes {self.n_inputs} inputs, got {len(inputs)}")
        values: List[Optional[torch.Tensor]] = list(inputs)

        def value(a):
            return values[a.index] if isinstance(a, Ref) else a

        for step in self.steps:
            if isinstance(step, LaunchStep):
                _launch.launch_now(step.kernel, step.plan, *(values[r.index] for r in step.tensors))
                continue
            out = step.op(*tree_map(value, step.args), **tree_map(value, step.kwargs))
            if poison and step.op.overloadpacket in _FRESH and out.is_floating_point():
                out.fill_(math.nan)
            # (an op's tensor results take the next value numbers, in order)
            values.extend(result for index, result in zip(step.results, tree_flatten(out)[0]) if index is not None)
        return tree_map(value, self.outputs)


_FRESH = (torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like)


class _Recorder(TorchDispatchMode):
    def __init__(self, inputs: Sequence[Optional[torch.Tensor]]):
        super().__init__()
        # id(tensor) -> value index: inputs are values 0 .. len - 1 (an absent one keeps its number).
        # A tensor the pass lets go leaves the map as it dies, so a later tensor reusing its id is not
        # taken for it; the recording pass frees what it frees (holding every
        # intermediate to the end put the first call's peak memory a weight gradient's partial sums
        # above PyTorch's).
        self.index: Dict[int, int] = {}
        self.count = len(inputs)
        self.steps: List = []
        self.inside_op = 0  # (ops of the pass being run: a launch inside one is part of that op's step)
        self.finalizers: List[weakref.finalize] = []
        for number, t in enumerate(inputs):
            if t is not None:
                self.number(t, number)

    def number(self, tensor: torch.Tensor, number: int) -> None:
        self.index[id(tensor)] = number
        self.finalizers.append(weakref.finalize(tensor, self.index.pop, id(tensor), None))

    def ref(self, a):
        if not isinstance(a, torch.Tensor):
            return a
        number = self.index.get(id(a))
        if number is None:
            raise NotRecordable(f"a tensor argument ({tuple(a.shape)}, {a.dtype}) made before recording")
        return Ref(number)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        step_args, step_kwargs = tree_map(self.ref, args), tree_map(self.ref, kwargs)
        self.inside_op += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.inside_op -= 1
        results = []
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.number(leaf, self.count)
                results.append(self.count)
                self.count += 1
            elif leaf is None:
                results.append(None)
            else:
                raise NotRecordable(f"{func} returned a {type(leaf).__name__} to the host")
        self.steps.append(OpStep(func, step_args, step_kwargs, tuple(results)))
        return out

    def launch(self, kernel, plan, tensors):
        if self.inside_op:  # (a registered op's own launch: its step would run it a second time)
            raise NotRecordable("a launch inside a recorded op")
        refs = tuple(self.ref(t) for t in tensors)
        with _disable_current_modes():  # (the interpreter's own tensor ops are not the pass's)
            _launch.launch_now(kernel, plan, *tensors)
        compiled = None
        if tensors[0].is_cuda:  # (what launch_now just compiled or reused for these tensors' pointers)
            compiled = plan.compiled.get((kernel, tensors[0].get_device()))
            if compiled is not None and compiled[0] != tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors):
                compiled = None
        self.steps.append(LaunchStep(kernel, plan, refs, compiled))


def record(fn: Callable, inputs: Sequence[Optional[torch.Tensor]], *args) -> Tuple[Any, Program]:
    """fn(*inputs, *args) run once (its results returned) and recorded as a program over inputs.
    Records this thread's ops and launches only (other threads run theirs as usual meanwhile)."""
    if _launch.recorder() is not None:
        raise NotRecordable("already recording on this thread")
    recorder = _Recorder(inputs)
    _launch.RECORDING.recorder = recorder
    try:
        with torch.no_grad(), recorder:
            out = fn(*inputs, *args)
    finally:
        _launch.RECORDING.recorder = None
    leaves, spec = tree_flatten(out)
    outputs = tree_unflatten([recorder.ref(t) if isinstance(t, torch.Tensor) else t for t in leaves], spec)
    for finalizer in recorder.finalizers:  # (the map is done with: no callbacks when these tensors die)
        finalizer.detach()
    return out, Program(len(inputs), recorder.steps, outputs)
