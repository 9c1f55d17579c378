"""`dwconv.warmup`: compile every kernel a model's depthwise layers will need, in parallel, before
the first step.

Each layer shape compiles its own Triton kernels at its first call, one after another on the
calling thread (a converted MobileNetV2's first training step waited ~114 s on a fresh machine).
warmup finds every depthwise call one step makes without running a kernel (the model runs once on
fake tensors, which carry shapes, strides and dtypes only), then compiles each call's forward and,
when training, backward kernels in a pool of worker processes (`_compile_worker.py`) into Triton's
disk cache. The model's first real call then loads them from disk. A marker file a call and pass
(under the cache directory, keyed by everything its kernels depend on) tells a later warmup, in
this process or another, that they are there: a warm start starts no worker.

`convert` attaches `warm_up_on_first_call` to the converted model: its first call with each new
input signature warms up first, under the caller's autocast and grad mode.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.nn as nn

from . import functional, tuning
from ._env import switch, write_whole


@dataclass(frozen=True)
class LayerCall:
    """One depthwise call as the kernels see it (after autocast's casts)."""
    tensors: tuple  # input, weight, bias: (shape, strides, dtype name), or None for no bias
    grads: tuple  # whether input, weight and bias require a gradient
    arguments: tuple  # (stride, padding, dilation) as passed

    @classmethod
    def of(cls, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], arguments: tuple,
           grads: tuple = (False, False, False)) -> "LayerCall":
        """The call depthwise_conv2d(input, weight, bias, *arguments) makes (meta tensors will do),
        with the gradients grads (input, weight, bias) wanted."""
        return cls(tuple(_spec(t) for t in (input, weight, bias)), tuple(bool(g) for g in grads),
                   tuple(_plain(a) for a in arguments))

    @property
    def batch_norm(self) -> bool:
        """Whether this is a fused block's BatchNorm in training (dwconv.batch_norm's kernels on the
        convolution's output: tensors y, weight, bias; arguments BATCH_NORM, the activation, the
        running statistics' dtype), not a convolution."""
        return self.arguments[0] == BATCH_NORM

    @property
    def fold(self) -> bool:
        """Whether this is a BatchNorm folded into the convolution before it in eval mode
        (kernels.batch_norm.fold: tensors the convolution's weight and bias and the BatchNorm's weight;
        arguments FOLD, the folded dtype, the running statistics' dtype, eps), not a convolution."""
        return self.arguments[0] == FOLD

    @property
    def block(self) -> bool:
        """Whether this is a fused block's eval call (the registered op conv2d_block: tensors the
        input, the weight and bias; arguments BLOCK, stride, padding, dilation as the ops take them,
        the activation's code, then for the BatchNorm after and the one before (None: none) whether it
        is affine and its running statistics' dtype), not a plain convolution."""
        return self.arguments[0] == BLOCK

    @property
    def squeeze(self) -> bool:
        """Whether this is a squeeze-and-excitation block's eval call (the registered op squeeze_excite:
        tensors the input, the reduce and the expand convolutions' weights; arguments SQUEEZE, each
        bias's spec or None, the activation's and the gate's codes), not a convolution."""
        return self.arguments[0] == SQUEEZE

    @property
    def channel_scale(self) -> bool:
        """Whether this is a squeeze-and-excitation block's gate applied in training
        (the kernels of squeeze_excite.block, either path: tensors the input alone, the gate [N, C] of
        its dtype; arguments CHANNEL_SCALE; grads the input's and the gate's), not a convolution."""
        return self.arguments[0] == CHANNEL_SCALE

    def without_batch(self) -> "LayerCall":
        """The call as the batch sizes that share its kernel binaries see it: the input's batch size
        (and its stride) replaced by what the launch plans choose by it (dispatch.batch_choices;
        BatchNorm's kernels choose nothing by it)."""
        from .dispatch import batch_choices

        if self.fold:  # (no batch: a weight's)
            return self
        (shape, strides, dtype), weight = self.tensors[:2]
        # (BatchNorm's kernels and the squeeze-and-excitation's choose nothing by it)
        batch = ("any batch", *(() if self.batch_norm or self.squeeze or self.channel_scale
                                else batch_choices(shape, getattr(torch, dtype), weight[0])))
        return LayerCall((((batch, *shape[1:]), (0, *strides[1:]), dtype), *self.tensors[1:]), self.grads,
                         self.arguments)

    def passes(self) -> List[str]:
        return ["backward", "forward"] if any(self.grads) else ["forward"]

    def to_json(self, pass_: str, launch: Optional[int] = None) -> str:
        """The worker's task: this call's pass, compiling its launch number `launch` (-1: none, only
        counting them; None: all)."""
        return json.dumps({"tensors": self.tensors, "grads": self.grads, "arguments": self.arguments,
                           "pass": pass_, "launch": launch})

    def cost(self, pass_: str) -> tuple:
        """Larger first: a pool's wall time is bounded by the task that starts last. Backward passes,
        channels_last, strides, then kernel size (the unrolled channels_last tiles compile longest)."""
        if self.batch_norm or self.fold or self.squeeze or self.channel_scale:
            return (pass_ == "backward", not self.fold and self.tensors[0][1][1] == 1, 0, 0)
        (_, _, k_h, k_w) = self.tensors[1][0]
        stride = self.arguments[1 if self.block else 0]
        stride = stride if isinstance(stride, int) else max(stride)
        return (pass_ == "backward", self.tensors[0][1][1] == 1, stride, k_h * k_w)


BATCH_NORM = "batch_norm"  # (a LayerCall's first argument: a fused block's BatchNorm in training)
FOLD = "fold"  # (a LayerCall's first argument: a BatchNorm folded into its convolution in eval mode)
BLOCK = "block"  # (a LayerCall's first argument: a fused block's eval call, the op conv2d_block)
SQUEEZE = "squeeze_excite"  # (a LayerCall's first argument: a squeeze-and-excitation block's eval call)
CHANNEL_SCALE = "channel_scale"  # (a LayerCall's first argument: a squeeze-and-excitation's gate in training)


def record_batch_norm(y: torch.Tensor, norm: nn.Module, activation: str) -> None:
    """Under layer_calls' fake run, a fused block's BatchNorm in training (fuse.py calls it where
    its kernels would run): a call of its own, whose forward and backward compile BatchNorm's."""
    calls, train = getattr(_TRACING, "calls", None), getattr(_TRACING, "train", False)
    if calls is None:
        return
    grads = tuple(bool(train and t is not None and t.requires_grad) for t in (y, norm.weight, norm.bias))
    arguments = (BATCH_NORM, activation, str(norm.running_mean.dtype).replace("torch.", ""))
    calls.setdefault(LayerCall.of(y, norm.weight, norm.bias, arguments, grads), None)


def record_fold(weight: torch.Tensor, bias: Optional[torch.Tensor], norm: nn.Module, dtype: torch.dtype) -> None:
    """Under layer_calls' fake run, a BatchNorm folded into the convolution before it in eval mode
    (fuse.py calls it where the fold's kernel would run): a call of its own, which compiles it."""
    calls = getattr(_TRACING, "calls", None)
    if calls is None:
        return
    arguments = (FOLD, *(str(t).replace("torch.", "") for t in (dtype, norm.running_var.dtype)), norm.eps)
    calls.setdefault(LayerCall.of(weight, bias, norm.weight, arguments), None)


def record_block(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 norm: Optional[nn.Module], input_norm: Optional[nn.Module], op_arguments: tuple,
                 activation: int) -> None:
    """Under layer_calls' fake run, a fused block's eval call (fuse.py calls it where the op would
    run; input as autocast casts it): a call of its own, which compiles the op's kernels (its
    foldings and its convolution)."""
    calls = getattr(_TRACING, "calls", None)
    if calls is None:
        return

    def norm_spec(module):
        return None if module is None else (module.weight is not None, str(module.running_var.dtype).replace("torch.", ""))

    arguments = (BLOCK, *op_arguments, activation, norm_spec(norm), norm_spec(input_norm))
    calls.setdefault(LayerCall.of(input, weight, bias, arguments), None)


def record_squeeze(input: torch.Tensor, reduce_weight: torch.Tensor, reduce_bias: Optional[torch.Tensor],
                   expand_weight: torch.Tensor, expand_bias: Optional[torch.Tensor], activation: int,
                   gate: int) -> None:
    """Under layer_calls' fake run, a squeeze-and-excitation block's eval call (fuse.py calls it where
    the op would run): a call of its own, which compiles the op's kernels."""
    calls = getattr(_TRACING, "calls", None)
    if calls is None:
        return
    arguments = (SQUEEZE, _spec(reduce_bias), _spec(expand_bias), activation, gate)
    calls.setdefault(LayerCall.of(input, reduce_weight, expand_weight, arguments), None)


def record_channel_scale(input: torch.Tensor, gate: torch.Tensor) -> None:
    """Under layer_calls' fake run, a squeeze-and-excitation block's gate applied in training
    (squeeze_excite.trained calls it where its block would run): a call of its own, whose forward
    and backward compile the gate's multiply and its backward."""
    calls, train = getattr(_TRACING, "calls", None), getattr(_TRACING, "train", False)
    if calls is None:
        return
    grads = (train and input.requires_grad, train and gate.requires_grad, False)
    calls.setdefault(LayerCall.of(input, None, None, (CHANNEL_SCALE,), grads), None)


def _spec(t: Optional[torch.Tensor]):
    if t is None:
        return None
    return (tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""))


def _plain(argument):
    return tuple(argument) if isinstance(argument, (list, tuple)) else argument


class ModelNotTraceable(RuntimeError):
    """The model's forward failed on fake tensors (a value read on the host, such as .item() or a
    branch on a tensor): `calls` holds the depthwise calls recorded before the failure."""

    def __init__(self, message: str, calls: List[LayerCall]):
        super().__init__(message)
        self.calls = calls


_TRACING = threading.local()  # (set while layer_calls runs the model: its own first-call hook stays out)


def layer_calls(model: nn.Module, *example_inputs, example_kwargs: Optional[dict] = None,
                train: Optional[bool] = None) -> List[LayerCall]:
    """The distinct depthwise calls one call of model(*example_inputs) makes through dwconv, and
    whether their backward runs (train, default model.training: the gradients its tensors
    require). Runs the model once on fake tensors (torch's FakeTensorMode: no kernel, no memory,
    parameters and buffers left as they are; the model's forward hooks are not called, but for torch's
    own weight-computing pre-hooks), under the caller's autocast state, so call it as the model will
    be called (inside the same torch.autocast)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    model = getattr(model, "_orig_mod", model)  # (torch.compile's wrapper: the module it compiles)
    train = model.training if train is None else train
    calls: dict = {}
    pytorch_door = functional._DOORS["pytorch"]

    def recording_door(input, weight, bias, geom, arguments):
        # fake tensors dispatch in Python, so every dwconv call of the fake run takes this door
        if isinstance(input, FakeTensor):
            grads = tuple(bool(train and t is not None and t.requires_grad) for t in (input, weight, bias))
            calls.setdefault(LayerCall.of(input, weight, bias, arguments, grads), None)
        return pytorch_door(input, weight, bias, geom, arguments)

    flags = {module: module.training for module in model.modules()}  # (each its own: put back as found)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # (the fake run's saved tensors never reach the caller's saved-tensor hooks: a warmup at the first
    # call inside torch.utils.checkpoint made its forward save 18 tensors where its recomputation
    # saved 9, and the backward raised CheckpointError)
    own_saved_tensors = (contextlib.nullcontext() if _saved_tensor_hooks_disabled()
                         else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    functional._DOORS["pytorch"] = recording_door
    _TRACING.active, _TRACING.calls, _TRACING.train = True, calls, train
    hooks = _keep_torch_hooks_only(model)
    try:
        model.train(train)
        with own_saved_tensors, mode, torch.set_grad_enabled(train):
            fakes = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs)
            fake_kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                           for k, v in (example_kwargs or {}).items()}
            # (the model's own tensors replaced by fakes for the call: in-place updates such as BatchNorm's
            # num_batches_tracked then change the fakes)
            state = {name: mode.from_tensor(t) for name, t in (*model.named_parameters(), *model.named_buffers())}
            try:
                torch.func.functional_call(model, state, fakes, fake_kwargs)
            except Exception as e:
                raise ModelNotTraceable(f"the model's forward failed on fake tensors after {len(calls)} depthwise "
                                        f"call(s): {type(e).__name__}: {e}", list(calls)) from e
    finally:
        functional._DOORS["pytorch"] = pytorch_door
        _TRACING.active, _TRACING.calls = False, None
        for module, (forward_hooks, pre_hooks) in hooks.items():
            module._forward_hooks, module._forward_pre_hooks = forward_hooks, pre_hooks
        for module, training in flags.items():
            module.training = training
    return list(calls)


def _saved_tensor_hooks_disabled() -> bool:
    """Whether saved-tensor hooks are disabled here (torch.autograd.graph.disable_saved_tensors_hooks:
    pushing one would raise; none of the caller's then runs either)."""
    message = getattr(torch._C._autograd, "_saved_tensors_hooks_get_disabled_error_message", lambda: None)()
    return message is not None


def _keep_torch_hooks_only(model: nn.Module) -> dict:
    """Takes the model's forward hooks away for the fake run, but for the forward pre-hooks that
    compute a weight (the older weight_norm, spectral_norm, pruning): a user's hook may keep what it
    sees (activations, statistics, counters), and must never see fake tensors or be called for a run
    that is not one. Returns what to put back: {module: (forward hooks, forward pre-hooks)}."""
    from collections import OrderedDict

    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    weights = (BasePruningMethod, SpectralNorm, WeightNorm)
    taken = {}
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            taken[module] = (module._forward_hooks, module._forward_pre_hooks)
            module._forward_hooks = OrderedDict()
            module._forward_pre_hooks = OrderedDict((k, hook) for k, hook in taken[module][1].items()
                                                    if isinstance(hook, weights))
    return taken


@dataclass
class WarmupReport:
    layers: int  # distinct depthwise calls found
    seconds: float
    workers: int  # compile processes started (0: everything was warm already)
    errors: List[str] = field(default_factory=list)  # calls whose kernels then compile at first use
    call_seconds: List[float] = field(default_factory=list)  # each call's passes' time in workers, in call order
    longest_launch: float = 0.0  # the longest compile of one launch (the wall time's floor, however many workers)
    launches: int = 0  # kernel launches compiled (or found in Triton's cache by a worker), one a binary key
    launches_shared: int = 0  # launches whose binary another launch of the warmup compiles (not compiled again)
    passes_warm: int = 0  # (call, pass) pairs whose marker said their kernels were on disk already
    trace_seconds: float = 0.0  # finding the calls on fake tensors
    first_answer_seconds: float = 0.0  # from the pool's start to a worker's first answer (its imports)


last_report: Optional[WarmupReport] = None  # (the latest warmup's, for benchmarks)


def warmup(model: nn.Module, *example_inputs, example_kwargs: Optional[dict] = None, train: Optional[bool] = None,
           workers: Optional[int] = None, arch: Optional[int] = None, autocast: Optional[torch.dtype] = None,
           verbose: bool = True) -> WarmupReport:
    """Compiles, ahead of use and in parallel, every dwconv kernel that model(*example_inputs) and,
    when training (train, default model.training), its backward will launch, into Triton's disk
    cache (TRITON_CACHE_DIR, default ~/.triton/cache). Call it as the model will be called (same
    batch and image size, dtype, memory format, inside the same torch.autocast); a second process
    finds the kernels on disk. workers: compile processes (default: one a CPU core); arch: the
    GPU's compute capability as 90 for sm_90 (default: the model's GPU). Prints progress to
    stderr when verbose. A call whose compile fails is reported and compiles at its first use; a
    model whose forward cannot run on fake tensors (it reads a value on the host) is reported and
    the calls made before that point are compiled. example_kwargs: the model's keyword arguments.
    autocast: the dtype of the torch.autocast("cuda", dtype=...) the model will run under, for a
    warmup where there is no GPU (a container image's build: torch turns CUDA autocast off there),
    with the model and inputs on the CPU; the depthwise layers' casts are the same on either device."""
    global last_report
    started = time.perf_counter()
    if autocast is not None:
        if autocast not in (torch.float16, torch.bfloat16):
            raise ValueError(f"autocast must be torch.float16 or torch.bfloat16 (the dtype of the torch.autocast "
                             f"the model will run under), got {autocast!r}")
        device = next((t.device.type for t in (*example_inputs, *(example_kwargs or {}).values())
                       if isinstance(t, torch.Tensor)), "cpu")
        with torch.autocast(device, dtype=autocast):
            return warmup(model, *example_inputs, example_kwargs=example_kwargs, train=train, workers=workers,
                          arch=arch, verbose=verbose)
    if arch is None:
        if not torch.cuda.is_available():
            raise ValueError("arch must be given without a GPU (e.g. arch=90 for sm_90)")
        device = next((p.device for p in model.parameters() if p.is_cuda), torch.device("cuda"))
        major, minor = torch.cuda.get_device_capability(device)
        arch = 10 * major + minor
    train = getattr(model, "_orig_mod", model).training if train is None else train
    # (a warm process skips the fake run, whose first use also imports torch._dynamo: ~2 s on the CPU machine)
    model_marker = _model_marker(model, example_inputs, example_kwargs, train, arch)
    found = _read_marker(model_marker)
    if found:
        last_report = WarmupReport(found["layers"], time.perf_counter() - started, 0, passes_warm=found["passes"])
        return last_report
    try:
        calls = layer_calls(model, *example_inputs, example_kwargs=example_kwargs, train=train)
        traceable = True
    except ModelNotTraceable as e:  # (what was found still compiles; the rest at first use)
        warnings.warn(f"dwconv.warmup: {e}; compiling the calls found before it", stacklevel=2)
        calls, traceable = e.calls, False
    traced = time.perf_counter() - started
    report = compile_calls(calls, arch, workers, verbose)
    report.seconds, report.trace_seconds = time.perf_counter() - started, traced
    for error in report.errors:
        warnings.warn(f"dwconv.warmup: {error}", stacklevel=2)
    if traceable and not report.errors:
        _mark(model_marker, json.dumps({"layers": len(calls), "passes": sum(len(c.passes()) for c in calls)}))
    last_report = report
    return report


def warm_up_on_first_call(model: nn.Module) -> nn.Module:
    """Makes model's first call with each new input signature (tensor shapes, strides and dtypes,
    training and grad mode, autocast dtype) run `warmup` first, under the same autocast and grad
    mode, on CUDA inputs, outside torch.compile and unless DWCONV_WARMUP=0; a later call with that
    signature costs a set lookup. What a warmup cannot do is a warning, never an error of the call.
    `convert` attaches it (a forward pre-hook, kept by deepcopy and pickling)."""
    if _first_call_hook not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_first_call_hook, with_kwargs=True)
    return model


_WARM_UP_ON = ("cuda",)  # (the devices whose inputs start a warmup: dwconv's kernels run on CUDA tensors)


def _first_call_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling() or getattr(_TRACING, "active", False) or switch("DWCONV_WARMUP") is False:
        return None
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if not any(t.device.type in _WARM_UP_ON for t in tensors):
        return None
    train = module.training and torch.is_grad_enabled()
    autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    signature = (train, autocast, tuple((_spec(t), t.requires_grad) for t in tensors))
    seen = module.__dict__.setdefault("_dwconv_warmed_up", set())
    if signature in seen:
        return None
    seen.add(signature)
    try:
        with functional.trace_suspended():  # (under torch.jit.trace: its fake run is no part of the trace)
            warmup(module, *args, example_kwargs=kwargs, train=train)
    except Exception as e:  # (the kernels then compile at their first use, as without a warmup)
        warnings.warn(f"dwconv.warmup at the model's first call failed ({type(e).__name__}: {e}); the kernels "
                      "compile at their first use", RuntimeWarning, stacklevel=2)
    return None


def default_workers() -> int:
    """One compile process a CPU core this process may use (or tuned().warmup_workers), shared among
    the local ranks of a distributed run (LOCAL_WORLD_SIZE), which warm up at once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = tuning.tuned().warmup_workers or cores
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


# (launches a pass makes: up to 4 for the small kernels' backward (weight tiles, sums, grad_input), up to 7
# for the large kernels' channels_last backward, some of them the same binary: counted over the suites)
LAUNCHES_A_PASS = 4

@functools.lru_cache(maxsize=None)
def _fingerprint() -> str:
    """What every compiled kernel depends on besides its call: Triton's and torch's versions and
    dwconv's sources (read once a process)."""
    import triton

    digest = hashlib.sha256(f"{triton.__version__} {torch.__version__}".encode())
    package = os.path.dirname(os.path.abspath(__file__))
    for folder, _, names in sorted(os.walk(package)):
        for name in sorted(n for n in names if n.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as source:
                digest.update(name.encode() + source.read())
    return digest.hexdigest()


def _marker(call: LayerCall, pass_: str, arch: int, changes: str) -> str:
    """The file that says this call's pass has its kernels in the Triton cache (for arch and the
    tuning changes in force)."""
    from ._triton_compat import cache_dir

    key = hashlib.sha256(f"{_fingerprint()} {arch} {changes} {call.to_json(pass_)}".encode()).hexdigest()
    return os.path.join(cache_dir(), "dwconv-warmup", key[:32])


def _mark(path: str, content: str = "") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_whole(path, content)


def _read_marker(path: str) -> Optional[dict]:
    try:
        with open(path) as marker:
            found = json.load(marker)
        return found if isinstance(found, dict) and {"layers", "passes"} <= found.keys() else None
    except (OSError, ValueError):
        return None


def _model_marker(model: nn.Module, example_inputs: tuple, example_kwargs: Optional[dict], train: bool,
                  arch: int) -> str:
    """The file that says a warmup of this model for this call found every kernel compiled: keyed by
    what its depthwise calls follow from (each module's class, its forward's code, its plain
    attributes and training flag; the parameters' and buffers' shapes, strides, dtypes and
    requires_grad; the arguments, tensors by the same, others by repr; train and autocast), dwconv's
    fingerprint, arch and the tuning changes. What it misses (a forward that reads state it does
    not cover) costs compiles at first use, never a value."""
    from ._triton_compat import cache_dir

    def spec(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", value.device.type, _spec(value), value.requires_grad)
        if isinstance(value, (list, tuple)):
            return type(value).__name__, tuple(map(spec, value))
        if isinstance(value, dict):
            return "dict", tuple((k, spec(v)) for k, v in value.items())
        try:
            return repr(value)
        except Exception:  # (then never the same: no marker found)
            return object()

    def plain(value) -> bool:
        return value is None or isinstance(value, (bool, int, float, str)) or (
            isinstance(value, (tuple, list)) and all(map(plain, value)))

    model = getattr(model, "_orig_mod", model)
    digest = hashlib.sha256(f"{_fingerprint()} {arch} {_tuning_changes()} {train}".encode())
    for device in ("cuda", "cpu"):
        digest.update(repr((torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))).encode())
    codes: dict = {}
    for name, module in model.named_modules():
        kind = type(module)
        if kind not in codes:
            code = getattr(kind.forward, "__code__", None)
            codes[kind] = code and (code.co_code, repr(code.co_consts), code.co_names)
        attributes = sorted((k, v) for k, v in vars(module).items() if not k.startswith("_") and plain(v))
        digest.update(repr((name, kind.__module__, kind.__qualname__, codes[kind], module.training,
                            attributes)).encode())
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        digest.update(repr((name, spec(tensor))).encode())
    digest.update(repr((spec(tuple(example_inputs)), spec(example_kwargs or {}))).encode())
    return os.path.join(cache_dir(), "dwconv-warmup", "model-" + digest.hexdigest()[:32])


def _tuning_changes() -> str:
    """The tuning table's changes in force, as the compile workers get them."""
    return json.dumps({name: repr(value) for name, value in tuning.changes().items()})


def compile_calls(calls: Sequence[LayerCall], arch: int, workers: Optional[int] = None,
                  verbose: bool = True) -> WarmupReport:
    """Compiles the kernels of these calls for compute capability arch in a pool of worker
    processes (default: `default_workers()`) into Triton's disk cache. Each call's passes (forward;
    backward when a gradient is wanted) are counted first (the launches each makes and their binary
    keys), then every launch of a new key is a task of its own, the costliest passes' first: the
    slowest single kernel, not the slowest layer, bounds the wall time, and a binary two layers
    share compiles once. Passes a marker says are compiled already are skipped."""
    started = time.perf_counter()
    changes = _tuning_changes()
    # (the call's own marker, and its batch-free one: the kernels take the batch as a runtime value, so a
    # layer compiled for one batch size has them all; tests/test_precompile.py counts what another compiles)
    markers = {(i, pass_): (_marker(call, pass_, arch, changes), _marker(call.without_batch(), pass_, arch, changes))
               for i, call in enumerate(calls) for pass_ in call.passes()}
    passes = sorted((task for task, paths in markers.items() if not any(map(os.path.exists, paths))),
                    key=lambda task: calls[task[0]].cost(task[1]), reverse=True)
    # (each launch is a task of its own: fewer workers than launches would queue the
    # slow compiles one behind another, as ConvNeXt-T's 16 launches on 8 workers did on the H200's host:
    # a 61.2 s warmup whose longest compile took 41.2 s; forked workers cost little)
    count = max(1, min(workers or default_workers(), LAUNCHES_A_PASS * len(passes)))
    report = WarmupReport(len(calls), 0.0, count if passes else 0, call_seconds=[0.0] * len(calls),
                          passes_warm=len(markers) - len(passes))
    if passes:
        _compile_in_pool(calls, passes, [markers[task] for task in passes], arch, count, changes, report, started,
                         verbose)
    report.seconds = time.perf_counter() - started
    return report


def _drained(tasks: queue.Queue):
    while True:
        try:
            yield tasks.get_nowait()
        except queue.Empty:
            return


def _compile_in_pool(calls: Sequence[LayerCall], passes: List[tuple], markers: List[tuple], arch: int, count: int,
                     changes: str, report: WarmupReport, started: float, verbose: bool) -> None:
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    # (phase, rank of the pass, launch number), lowest first: phase 0 counts a pass's launches (launch -1,
    # milliseconds), phase 1 compiles one; every count goes before any compile
    tasks: queue.PriorityQueue = queue.PriorityQueue()
    for rank in range(len(passes)):
        tasks.put((0, rank, -1))
    state = dict(outstanding=len(passes), done=0, total=0)
    left = [None] * len(passes)  # each pass's launches not compiled yet (None: not counted yet)
    failed = [False] * len(passes)
    # launches of one binary key (the same kernel binary, in this pass or another) compile once: the first
    # counted is the task, the others' passes wait on it
    waiting: dict = {}  # {key: ranks of the passes waiting on it}, while it compiles
    compiled: dict = {}  # {key: whether its compile succeeded}, once done
    key_of: dict = {}  # {(rank, launch number): key} of the tasks
    lock = threading.Lock()

    live = verbose and sys.stderr.isatty()  # (a log gets one line, at the end)

    def show(end: str = ""):
        if live or (verbose and end):
            line = (f"dwconv.warmup: {state['done']}/{state['total'] or '?'} kernels of {len(calls)} "
                    f"depthwise calls compiled on {count} processes, {time.perf_counter() - started:.0f} s")
            print(("\r" if live else "") + line, end=end, file=sys.stderr, flush=True)

    def finished(rank: int) -> None:  # (under the lock)
        if left[rank] == 0 and not failed[rank]:
            for path in markers[rank]:
                _mark(path)

    def serve(channel: tuple):
        to_worker, from_worker = channel
        while True:
            try:
                _, rank, launch = tasks.get(timeout=0.05)
            except queue.Empty:
                with lock:
                    if state["outstanding"] == 0:
                        break
                continue
            index, pass_ = passes[rank]
            try:
                to_worker.write(calls[index].to_json(pass_, launch) + "\n")
                to_worker.flush()
                answer = from_worker.readline().strip() or "error the compile worker exited"
            except OSError:
                answer = "error the compile worker exited"
            with lock:
                report.first_answer_seconds = report.first_answer_seconds or time.perf_counter() - started
                if answer.startswith("ok ") and launch == -1:
                    _, _, _, *keys = answer.split()
                    left[rank] = 0
                    for number, key in enumerate(keys[0].split(",") if keys else []):
                        if key in compiled or key in waiting:
                            report.launches_shared += 1
                        else:
                            tasks.put((1, rank, number))
                            state["outstanding"] += 1
                            state["total"] += 1
                            waiting[key], key_of[rank, number] = [], key
                        if key in compiled:
                            failed[rank] |= not compiled[key]
                        else:
                            waiting[key].append(rank)
                            left[rank] += 1
                    finished(rank)
                elif answer.startswith("ok "):
                    seconds = float(answer.split()[1])
                    report.call_seconds[index] += seconds
                    report.longest_launch = max(report.longest_launch, seconds)
                    report.launches += 1
                    state["done"] += 1
                    key = key_of[rank, launch]
                    compiled[key] = True
                    for waiter in waiting.pop(key):
                        left[waiter] -= 1
                        finished(waiter)
                else:
                    failed[rank] = True
                    if launch != -1:
                        key = key_of[rank, launch]
                        compiled[key] = False
                        for waiter in waiting.pop(key):
                            failed[waiter] = True
                    report.errors.append(f"{calls[index]} {pass_}: {answer[len('error '):]}")
                state["outstanding"] -= 1
                show()
            if answer == "error the compile worker exited":  # (its tasks go to the others)
                break
        try:
            to_worker.close()  # (the worker's end of the pipe closes: it exits)
        except OSError:
            pass

    show()
    # one process imports once and forks the others (_compile_worker.main); a pair of pipes a worker
    pipes = [(os.pipe(), os.pipe()) for _ in range(count)]  # ((tasks read, write), (answers read, write))
    theirs = [(task_pipe[0], answer_pipe[1]) for task_pipe, answer_pipe in pipes]
    try:
        process = subprocess.Popen([sys.executable, "-m", "dwconv._compile_worker", str(arch), changes,
                                    *(f"{r},{w}" for r, w in theirs)], pass_fds=[fd for pair in theirs for fd in pair],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env=env)
    except BaseException:
        for task_pipe, answer_pipe in pipes:
            os.close(task_pipe[1]), os.close(answer_pipe[0])
        raise
    finally:
        for r, w in theirs:
            os.close(r), os.close(w)
    channels = [(os.fdopen(task_pipe[1], "w"), os.fdopen(answer_pipe[0])) for task_pipe, answer_pipe in pipes]
    threads = [threading.Thread(target=serve, args=(channel,), daemon=True) for channel in channels]
    if torch.cuda.is_available():  # (Triton's CUDA utilities, a C compile at a process's first launch: built meanwhile)
        from ._triton_compat import build_driver_utils

        threads.append(threading.Thread(target=build_driver_utils, daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for _, from_worker in channels:
        from_worker.close()
    process.wait()
    unreported = {rank for _, rank, _ in _drained(tasks) if not failed[rank]}  # (every worker exited first)
    report.errors += [f"{calls[passes[rank][0]]} {passes[rank][1]}: no compile worker left" for rank in sorted(unreported)]
    show(end="\n")
