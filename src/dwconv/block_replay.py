"""A fused inverted-residual block's eval forward as one replayed program (`convert(fuse=True)`).

A fused MobileNet's eager eval forward is bound by its host: each inverted-residual block makes
three registered-op calls (the expansion, the depthwise block, the projection), a residual add and
a dozen module calls, each module asking whether its block computes (dwconv.fuse). Here a block of
a known class (BLOCK_CLASSES: their forwards read only their children and public attributes) is
recorded once at a call (replay.program.record: the ops and launches its fused forward makes) and
replayed from C++ at later calls: one call from Python a block.

A recording is replayed only where the block would compute the same: its tensors' layouts (the
parameters and buffers are the program's inputs, read as they are at each call) and the autocast
state are the recording's key; nothing is differentiated; eager (not compiling, tracing, under a
functorch transform or a dispatch mode, nor a warmup's fake run); every module of the block in eval
mode, without hooks, no global module hook; and the block's modules as they were recorded
(`BlockPrograms.holds`, by identity: each module's class, public attributes, parameters, buffers and
children, and how many entries each holds). A change (a BatchNorm's eps, a swapped child, a new
parameter, train()) makes a new snapshot, and the block records again. Only for blocks whose fused
modules depend on no module outside them and that no fused module outside depends on
(`find_replayed_blocks`: not the block after a stem whose activation its depthwise layer applies),
and whose modules all come from torch.nn, timm, torchvision or dwconv (LIBRARIES: a user's module
may keep state the snapshot cannot see).
"""

from __future__ import annotations

import itertools
import warnings
from operator import getitem, is_
from typing import List, NamedTuple, Optional

import torch
import torch.nn as nn

from . import precompile
from .functional import _gradient_wanted, uses_triton
from .replay import native
from .replay.program import NotRecordable, record
from .tuning import on_change

# the classes whose forward is known, by module and name (neither library need be installed)
BLOCK_CLASSES = {
    ("torchvision.models.mobilenetv2", "InvertedResidual"),
    ("torchvision.models.mobilenetv3", "InvertedResidual"),
    ("torchvision.models.efficientnet", "MBConv"),
    ("torchvision.models.efficientnet", "FusedMBConv"),
    ("timm.models._efficientnet_blocks", "DepthwiseSeparableConv"),
    ("timm.models._efficientnet_blocks", "EdgeResidual"),
    ("timm.models._efficientnet_blocks", "InvertedResidual"),
    ("timm.models._efficientnet_blocks", "UniversalInvertedResidual"),
}

# the packages a module of a replayed block must come from: their forwards read the module's children and
# attributes (which the snapshot sees), not state of their own elsewhere (a user's module may: its block
# keeps its modules' calls)
LIBRARIES = ("torch.nn.modules.", "timm.", "torchvision.", "dwconv.")
_STRUCTURE = ("_parameters", "_buffers", "_modules")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_MODULE_GLOBALS = vars(nn.modules.module)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_TOKENS = itertools.count()

# (a snapshot's token, the key of the tensors' layouts, the autocast state) -> a NativeProgram, None
# (the Python path, always), or how many times it was seen without a program
_PROGRAMS: dict = {}
_PROGRAM_LIMIT = 4096
_TRIES = 3  # (a recording that meets a launch inside an op not yet served tries again at the next call)
on_change(_PROGRAMS.clear)


class BlockPrograms:
    """A block's snapshot of its modules (taken at a call) and the token of the programs recorded
    under it, as one value (`snapshot`: threads that take and check at once each see a whole one).
    Copies and pickles start without one."""

    def __init__(self):
        self.snapshot = None

    def __reduce__(self):
        return BlockPrograms, ()

    @property
    def token(self):
        snapshot = self.snapshot
        return None if snapshot is None else snapshot.token

    def take(self, block: nn.Module) -> Optional["_Snapshot"]:
        """A new snapshot of block's modules as they are; None where one of them is training or hooked,
        or not of LIBRARIES' classes."""
        self.snapshot = None
        modules = list(block.modules())
        dicts = [m.__dict__ for m in modules]
        hooks = [d[h] for d in dicts for h in _HOOKS]
        if any(m.training for m in modules) or not _from_libraries(modules) or any(hooks):
            return None
        # (each public attribute and each parameter, buffer and child, by identity)
        owners = [d for d in dicts for name in d if not name.startswith("_")]
        owners += [d[s] for d in dicts for s in _STRUCTURE for _ in d[s]]
        keys = [name for d in dicts for name in d if not name.startswith("_")]
        keys += [name for d in dicts for s in _STRUCTURE for name in d[s]]
        containers = dicts + [d[s] for d in dicts for s in _STRUCTURE]
        tensors = {}
        for m in modules:
            for t in (*m._parameters.values(), *m._buffers.values()):
                if t is not None:
                    tensors.setdefault(id(t), t)
        snapshot = _Snapshot(next(_TOKENS), list(tensors.values()), modules, [type(m) for m in modules],
                             containers, tuple(map(len, containers)), owners, keys,
                             [getitem(d, name) for d, name in zip(owners, keys)], hooks)
        self.snapshot = snapshot
        return snapshot

    def holds(self) -> Optional["_Snapshot"]:
        """The snapshot, where the block's modules are as it saw them, none of them hooked; else None."""
        s = self.snapshot
        if (s is not None and all(map(is_, map(type, s.modules), s.classes))
                and tuple(map(len, s.containers)) == s.sizes
                and all(map(is_, map(getitem, s.owners, s.keys), s.values)) and not any(s.hooks)):
            return s
        return None


class _Snapshot(NamedTuple):
    token: int  # (the key's first part of the programs recorded under it)
    tensors: list  # (the parameters and buffers: the programs' inputs after the block's input)
    modules: list
    classes: list
    containers: list  # (each module's __dict__, parameters, buffers and children ...)
    sizes: tuple  # (... and how many entries each held)
    owners: list
    keys: list
    values: list
    hooks: list


class ReplayedBlock:
    """A known block class (BLOCK_CLASSES) whose eval forward, where it replays (module docstring),
    is one program replayed from C++; otherwise it runs as its own class does."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # (asked first: Dynamo traces nothing of the replay, guards none of it)
            return super().forward(input)
        state = self.__dict__.get("dwconv_programs")
        if state is None or self.training or not _replays_now(input):
            return super().forward(input)
        snapshot = state.holds()
        if snapshot is not None:
            inputs = [input, *snapshot.tensors]
            key = _key(snapshot.token, inputs)
            program = _PROGRAMS.get(key, 0) if key is not None else None
            if isinstance(program, native.NativeProgram):
                return program.replay(*inputs)
            if program is None:
                return super().forward(input)
            if program > 0:
                return self._recorded(key, program, inputs)
        # (a first sight runs the Python path: its registered ops record their own programs first, which
        # they cannot while the block records, and its modules make what they make at a first call;
        # then the snapshot)
        out = super().forward(input)
        snapshot = state.holds() or state.take(self)
        if snapshot is not None:
            key = _key(snapshot.token, [input, *snapshot.tensors])
            if key is not None and key not in _PROGRAMS:
                if len(_PROGRAMS) >= _PROGRAM_LIMIT:
                    _PROGRAMS.clear()
                _PROGRAMS[key] = 1
        return out

    def _recorded(self, key: tuple, tries: int, inputs: List[torch.Tensor]) -> torch.Tensor:
        """The block's forward, recorded as a program for calls like this one."""
        forward = super().forward
        versions = [t._version for t in inputs]
        # (autocast's casts made as ops of the pass: a weight's cast cached by an earlier call in the same
        # autocast region is a tensor from before the recording, which a program cannot take)
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            out, program = record(lambda input, *tensors: forward(input), inputs)
            if [t._version for t in inputs] != versions:  # (a replay would write them a second time)
                _PROGRAMS[key] = None
                return out
            _PROGRAMS[key] = native.NativeProgram(program, python_launches=not inputs[0].is_cuda)
            return out
        except NotRecordable:
            _PROGRAMS[key] = tries + 1 if tries < _TRIES else None
        except Exception as error:  # (the Python path then raises again if the forward itself failed)
            _PROGRAMS[key] = None
            warnings.warn(f"dwconv: a {type(self).__mro__[2].__name__} block could not be recorded for the C++ path "
                          f"({error!r}); it keeps the Python path", RuntimeWarning)
        finally:
            torch.set_autocast_cache_enabled(cache)
        return forward(inputs[0])

    def extra_repr(self) -> str:
        return "eval forward one replayed program" + (", " + super().extra_repr() if super().extra_repr() else "")


def _key(token: int, inputs: List[torch.Tensor]):
    """The programs' key of a call of these inputs (the block's input, then its tensors) under a
    snapshot's token: the token, the tensors' layouts and the autocast state; None where it runs in
    Python: autograd would differentiate it, or a tensor is a subclass."""
    if _gradient_wanted(*inputs):
        return None
    layouts = native.extension().layouts_key(inputs)
    if layouts is None:
        return None
    device = inputs[0].device.type
    return token, layouts, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)


def _replays_now(input: torch.Tensor) -> bool:
    """The call's conditions outside the block (module docstring)."""
    hooks = _MODULE_GLOBALS
    return (type(input) is torch.Tensor and not torch._C._is_tracing()
            and torch._C._functorch.peek_interpreter_stack() is None
            and not precompile._TRACING.__dict__.get("active") and uses_triton(input) and native.enabled(input)
            and not any(hooks.get(name) for name in _GLOBAL_HOOKS))


def find_replayed_blocks(model: nn.Module) -> List[nn.Module]:
    """The outermost modules of BLOCK_CLASSES holding a fused module (one with dwconv's block
    attributes), all their modules of LIBRARIES' classes, where each fused module inside refers to
    modules inside alone and none outside refers to one inside."""
    references = {}
    for module in model.modules():
        found = [m for name, value in module.__dict__.items() if name.startswith("dwconv_")
                 for m in _modules_in(value)]
        if found:
            references[id(module)] = {id(m) for m in found}
    chosen, inside_chosen = [], set()
    for block in model.modules():
        if id(block) in inside_chosen or (type(block).__module__, type(block).__name__) not in BLOCK_CLASSES:
            continue
        inside = {id(m) for m in block.modules()}
        if not inside & references.keys() or not _from_libraries(block.modules()):
            continue
        if all(refs <= inside if holder in inside else not refs & inside for holder, refs in references.items()):
            chosen.append(block)
            inside_chosen |= inside
    return chosen


def _from_libraries(modules) -> bool:
    return all(type(m).__module__.startswith(LIBRARIES) for m in modules)


def _modules_in(value, depth: int = 0) -> list:
    if isinstance(value, nn.Module):
        return [value]
    if isinstance(value, (tuple, list)) and depth < 4:
        return [m for item in value for m in _modules_in(item, depth + 1)]
    return []
