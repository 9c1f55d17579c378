"""Launch plans and the one place every kernel launch goes through.

A plan is everything a launch needs besides the tensors, computed once per geometry and tensor
layout and then looked up: small layers are bound by host time per call (~600 us of CPU for a
forward+backward whose kernels take ~0.26 ms, before plans), so the launchers do their arithmetic
(kernel choice, block sizes, 64-bit indexing, alignment units, grid, argument lists) once. A plan depends
only on what `layout_key` captures: shapes, strides, dtype, device type and the 16-byte alignment
of the data pointer, which are also what Triton specialises a kernel on.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, Optional, Tuple, TypeVar

import torch

from .._triton_compat import arg_names, float64_parameters, launch_compiled
from ..tuning import on_change, tuned

T = TypeVar("T")
_PLAN_LIMIT = 4096  # distinct (geometry, layout) pairs kept; past it the cache starts over


@dataclass(frozen=True)
class ForwardConfig:
    """A forward launch's family and blocks (dispatch.forward_config), or a probe's choice."""
    # "tile", "rows", "nchw_pixels", "pairs", "nhwc", "nhwc_pixels", "nhwc_rows", "toeplitz", "large_fma"
    kernel: str
    block_h: int  # tile rows ("tile", "nhwc", ...) or output rows per program ("rows")
    block_w: int
    num_warps: int
    vec: int = 1  # output columns a thread owns: "rows" 4 (window loads, stride_w 1 only), "large_fma" 4-56
    block_c: int = 1  # the channels_last tiles: channels a program covers
    prefetch: bool = False  # "nhwc_rows" (the row-sliding fused backward): the next row's loads issued first


@dataclass(frozen=True)
class GradWeightConfig:
    """Blocks of the NCHW and channels_last weight-gradient kernels (grad_weight.py, tile.py)."""
    block_w: int  # output columns a program covers per row
    num_warps: int
    vec: int  # output columns a thread owns (4: window loads; stride_w 1 only)
    splits: int  # programs per output channel
    rows: int = 1  # grad_out rows a loop step handles (more loads in flight on narrow planes)
    block_c: int = 1  # channels a program covers (channels_last kernel)


@dataclass(frozen=True)
class LaunchPlan:
    kernel: str  # which kernel the plan launches (forward: "tile", "rows" or "nhwc")
    grid: Tuple[int, ...]
    scalars: Tuple[int, ...]  # runtime arguments after the tensors
    constants: Dict[str, object] = field(default_factory=dict)  # constexpr arguments, num_warps
    partial_shape: Optional[Tuple[int, ...]] = None  # float32 partial sums the launch writes, if any
    partial_dtype: torch.dtype = torch.float32
    # launch(): per (kernel, device), the compiled kernel and the arguments it takes after the tensors
    compiled: Dict[Hashable, tuple] = field(default_factory=dict, compare=False, repr=False)


def alignment(t: torch.Tensor) -> int:
    """t's data pointer mod 16. A tensor without data (a fake tensor, traced) has its storage
    offset's: its storage is taken to start 16-byte aligned, as PyTorch's allocators and
    torch.compile's buffers do (Inductor copies a graph input that is not)."""
    # (fake tensors' data_ptr() only warns, then answers; they dispatch in Python, as a Parameter
    # does not: the check that is cheap for a Parameter first, 1.6 us each)
    if type(t) is not torch.Tensor and torch._C._dispatch_keys(t).has(_PYTHON_KEY) and _is_fake(t):
        return t.storage_offset() * t.element_size() % 16
    return t.data_ptr() % 16


_PYTHON_KEY = torch._C.DispatchKey.Python
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # (types whose data the kernels read as it is)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def layout_key(t: torch.Tensor) -> Hashable:
    return (t.shape, t.stride(), t.dtype, t.device.type, alignment(t))


_MISSING = object()
_CACHES: list = []


def plan_cache() -> dict:
    """A new cache of plans, emptied whenever the tuning table changes."""
    cache: dict = {}
    _CACHES.append(cache)
    return cache


on_change(lambda: [cache.clear() for cache in _CACHES])


def cached_plan(cache: dict, key: Hashable, build: Callable[[], T]) -> T:
    """cache[key], built on first use (a plan, or any value that depends only on the key); built
    each time for a key of symbolic sizes (fake tensors traced with a dynamic batch), which do not
    hash."""
    try:
        plan = cache.get(key, _MISSING)
    except TypeError:
        return build()
    if plan is _MISSING:
        if len(cache) >= _PLAN_LIMIT:
            cache.clear()
        plan = cache[key] = build()
    return plan


def new_partial(plan: LaunchPlan, device: torch.device) -> torch.Tensor:
    """The float32 partial sums a launch writes; NaN-filled under tuned().poison_partials (the tests:
    a partial sum no program wrote then poisons the result instead of passing silently; off in
    use, where the fill would be a launch and a pass over up to tens of MB)."""
    if tuned().poison_partials:
        return torch.full(plan.partial_shape, float("nan"), device=device, dtype=plan.partial_dtype)
    return torch.empty(plan.partial_shape, device=device, dtype=plan.partial_dtype)


def on_device_of(t: torch.Tensor):
    """A context that makes t's GPU the current device where it is not (Triton launches on the
    current device: a tensor on another GPU would otherwise be read through a foreign pointer)."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


# replay/program.py's recorder while it records a pass on this thread (`recorder`, None otherwise): it
# logs each launch, then launches through launch_now with its dispatch mode off. One a thread, as
# TorchDispatchMode's stack is: threads meeting new layers at once (DataParallel's replicas, the
# autograd engine's device threads, a serving pool) each record their own pass.
RECORDING = threading.local()
RECORDING.recorder = None


def recorder():
    """This thread's recorder, or None."""
    return getattr(RECORDING, "recorder", None)


# Triton's interpreter keeps the running program's grid index in one process-wide object, so two
# threads' launches under it must not overlap (CPU tests only; compiled launches need no lock).
_INTERPRETER_LOCK = threading.Lock()


def launch(kernel, plan: LaunchPlan, *tensors: torch.Tensor) -> None:
    """Every kernel launch of dwconv goes through here (launch_now), or to this thread's recorder."""
    active = getattr(RECORDING, "recorder", None)
    if active is not None:
        active.launch(kernel, plan, tensors)
        return
    launch_now(kernel, plan, *tensors)


def launch_now(kernel, plan: LaunchPlan, *tensors: torch.Tensor) -> None:
    """kernel[plan.grid](*tensors, *plan.scalars, **plan.constants). With tuned().fast_launch, later
    launches of a plan on a device go straight to the compiled kernel that the first one returned,
    skipping Triton's per-call specialisation and cache lookup (~70 us of each launch's host time). Sound because a plan fixes every scalar
    and constexpr argument, and each launch checks that the tensors' dtypes and 16-byte alignments,
    what Triton specialises pointers on, are the first launch's; otherwise it takes Triton's path.
    Runs on the first tensor's GPU (on_device_of)."""
    if tensors[0].is_cuda and tensors[0].get_device() != torch.cuda.current_device():
        with torch.cuda.device(tensors[0].device):
            launch_now(kernel, plan, *tensors)
        return
    if not tensors[0].is_cuda:
        _check_float_scalars(kernel, plan, len(tensors))
        with _INTERPRETER_LOCK:
            kernel[plan.grid](*tensors, *plan.scalars, **plan.constants)
        return
    if not tuned().fast_launch:
        kernel[plan.grid](*tensors, *plan.scalars, **plan.constants)
        return
    key = (kernel, torch.cuda.current_device())  # (Triton compiles and caches per current device)
    pointers = tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors)
    entry = plan.compiled.get(key)
    if entry is not None and entry[0] == pointers:
        launch_compiled(entry[1], entry[2], *tensors, *entry[3])
        return
    compiled = kernel[plan.grid](*tensors, *plan.scalars, **plan.constants)
    names = arg_names(kernel)[len(tensors) + len(plan.scalars):]
    if compiled is not None and all(name in plan.constants for name in names):
        grid = tuple(plan.grid) + (1,) * (3 - len(plan.grid))
        plan.compiled[key] = (pointers, compiled, grid, plan.scalars + tuple(plan.constants[n] for n in names))


def _check_float_scalars(kernel, plan: LaunchPlan, tensors: int) -> None:
    """Refuses a float scalar for a parameter not annotated tl.float64. Triton's launcher passes such
    a float as float32 (a float64 model's eps 1e-3 off by 5e-11, its momentum 0.1 by 1.5e-9), but its
    interpreter keeps Python's float64, so no CPU test of values sees the difference: checked here,
    under the interpreter, every launch of every test."""
    names = arg_names(kernel)[tensors:tensors + len(plan.scalars)]
    wrong = [name for name, value in zip(names, plan.scalars)
             if isinstance(value, float) and name not in float64_parameters(kernel)]
    if wrong:
        raise TypeError(f"{kernel.fn.__name__}: float arguments {wrong} need a tl.float64 annotation")


def gpu_plan(device: torch.device) -> bool:
    """Whether launch plans on this device are the GPU's (else the interpreter's: few, large
    programs). tuned().plan_as_gpu gives CPU tensors the GPU's plans, so that the GPU's constexprs
    compile (or fail to) on a machine without one (tests/compile_check.py)."""
    return device.type == "cuda" or tuned().plan_as_gpu
