"""Programs (ops/program.py) handed to the C++ replayer (csrc/replay.cpp), built at first use.

`native_program(program)` converts a recorded program: each aten op becomes a boxed call with its
arguments laid out in schema order once, each launch a cuLaunchKernel of the cubin Triton compiled
for it (on the GPU: the function handle, grid, threads, shared memory and parameters read off the
compiled kernel, as benchmarks/probe_native_launch.py checked bitwise on the H200 in session 19),
or, with python_launches (CPU tests under the interpreter), a call back into `_launch.launch_now`.
`conv` (below) is dwconv's eager path through an autograd Function written in C++ whose forward and
backward are such programs: eager calls on CUDA tensors take it once the replayer is built
(`enabled`); DWCONV_NATIVE=0 turns it off, DWCONV_NATIVE=1 forces it (also on CPU tensors).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import sys
import threading
import warnings
from typing import List, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _launch
from .program import LaunchStep, NotRecordable, OpStep, Program, Ref, program_key, record

SOURCE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc", "replay.cpp")


def _build_arguments(cuda_launches: bool) -> dict:
    """torch.utils.cpp_extension.load's keyword arguments for the replayer (plain data: the
    background build passes them to another process)."""
    flags, includes, ldflags = ["-O2"], [], []
    if cuda_launches:
        import triton
        from triton.backends.nvidia.driver import libcuda_dirs

        flags.append("-DDWCONV_CUDA_LAUNCH")
        includes.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include"))
        torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        ldflags = [f"-L{d}" for d in libcuda_dirs()] + ["-lcuda", f"-L{torch_lib}", "-lc10_cuda"]
    return dict(name="dwconv_replay" + ("_cuda" if cuda_launches else "_cpu"), sources=[SOURCE],
                extra_cflags=flags, extra_include_paths=includes, extra_ldflags=ldflags, verbose=False)


def _ninja_on_path() -> None:
    if shutil.which("ninja") is None:  # (pip's ninja puts it beside the interpreter, maybe not on PATH)
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


@functools.lru_cache(maxsize=None)
def extension(cuda_launches: Optional[bool] = None):
    """The compiled replayer (torch.utils.cpp_extension.load: cached on disk between processes).
    cuda_launches: with cuLaunchKernel (needs CUDA's driver library; default: where CUDA is available)."""
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    return load(**_build_arguments(torch.cuda.is_available() if cuda_launches is None else cuda_launches))


# ---- when eager calls take this path ----------------------------------------------------------

def enabled(input: torch.Tensor) -> bool:
    """Whether dwconv's eager call on `input` goes through `conv` (below). DWCONV_NATIVE=0: never;
    =1: always (the replayer is built now if it must be). Unset: CUDA tensors, once the replayer is
    built: the first call starts the build in the background and calls keep the Python path, which
    launches the same kernels, until it is done. Never under a TorchDispatchMode (a mode would see
    the recorded ops but not the launches the Python path makes, and a recording would log its ops)."""
    setting = os.environ.get("DWCONV_NATIVE")
    if setting == "0" or torch._C._len_torch_dispatch_stack():
        return False
    return setting == "1" or (input.is_cuda and _built_in_background())


_BACKGROUND: dict = {}  # "thread": the build's watcher; "built": the build finished and succeeded


def prepare() -> bool:
    """Build or load the CUDA replayer now, unless DWCONV_NATIVE=0: eager calls on CUDA tensors then
    take the C++ path from the first (benchmarks, warm-up). False where it cannot be built (warned)."""
    if os.environ.get("DWCONV_NATIVE") == "0":
        return False
    try:
        extension(True)
    except Exception as error:
        warnings.warn(f"dwconv: the C++ replayer could not be built ({error!r}); eager calls keep the "
                      "Python path", RuntimeWarning)
        return False
    _BACKGROUND["built"] = True
    return True


def _built_in_background() -> bool:
    """True once the CUDA replayer is built; the first call starts building it in a detached process
    (its first build on a machine takes about a minute, later ones find it on disk in seconds). A
    process of its own, not a thread doing the build: torch's build holds a lock file that a process
    ending mid-build would leave behind, and every later build would wait on it."""
    if _BACKGROUND.get("built"):
        return True
    if "thread" not in _BACKGROUND:
        _BACKGROUND["thread"] = threading.Thread(target=_build_detached, name="dwconv-native-build", daemon=True)
        _BACKGROUND["thread"].start()
    return False


def _build_detached() -> None:
    import json
    import subprocess

    _ninja_on_path()
    script = "import json, sys; from torch.utils.cpp_extension import load; load(**json.loads(sys.argv[1]))"
    try:
        build = subprocess.run([sys.executable, "-c", script, json.dumps(_build_arguments(True))],
                               capture_output=True, text=True, start_new_session=True)
        failure = build.returncode and (build.stderr.strip().splitlines() or ["no message"])[-1]
    except Exception as error:  # (no CUDA driver library, no interpreter to run)
        failure = repr(error)
    if failure:
        warnings.warn(f"dwconv: the C++ replayer could not be built ({failure}); eager calls keep the "
                      "Python path (docs: README, 'Launches on the GPU')", RuntimeWarning)
    else:
        _BACKGROUND["built"] = True  # (loaded by the next call: torch's loader finds it built)


class NativeProgram:
    """A Program replayed by C++; replay(*inputs) returns what Program.replay returns."""

    def __init__(self, program: Program, python_launches: bool = False):
        self.native = extension().Program(program.n_inputs)
        leaves, self.spec = tree_flatten(program.outputs)
        if not all(leaf is None or isinstance(leaf, Ref) for leaf in leaves):
            raise NotRecordable("a program output that is not a tensor")
        outputs = {leaf.index for leaf in leaves if leaf is not None}
        # the recorded value number -> the replayer's (values an elided op made are their source's)
        self.number = {index: index for index in range(program.n_inputs)}
        self.count = program.n_inputs
        for step in program.steps:
            if isinstance(step, OpStep):
                if not self._elide(step, program.n_inputs, outputs):
                    self._add_op(step)
            elif python_launches:
                self.native.add_python_launch(
                    lambda tensors, kernel=step.kernel, plan=step.plan: _launch.launch_now(kernel, plan, *tensors),
                    [self.number[r.index] for r in step.tensors])
            else:
                self._add_launch(step)
        self.native.set_outputs([-1 if leaf is None else self.number[leaf.index] for leaf in leaves])

    # Ops whose result is their argument as far as a replay can tell: under no_grad a detach or
    # alias only makes another tensor object over the same storage (each `torch.empty` in a
    # recording comes with one). Each costs a dispatcher call on every replay, so a later step
    # reads their source instead; not where the source is an input or an output (a program must
    # not hand back its input, or one tensor twice).
    _ELIDED = ("aten::detach", "aten::alias")

    def _elide(self, step: OpStep, n_inputs: int, outputs: set) -> bool:
        source = step.args[0] if step.args else None
        if (step.op._schema.name not in self._ELIDED or not isinstance(source, Ref) or source.index < n_inputs
                or source.index in outputs or len(step.results) != 1):
            return False
        self.number[step.results[0]] = self.number[source.index]
        return True

    def replay(self, *inputs: Optional[torch.Tensor]):
        return tree_unflatten(self.native.replay(list(inputs)), self.spec)

    def _add_op(self, step: OpStep):
        schema = step.op._schema
        names = [a.name for a in schema.arguments]
        unknown = set(step.kwargs) - set(names)
        if unknown:
            raise NotRecordable(f"{step.op}: keyword arguments {unknown} not in its schema")
        args: List[object] = []
        tensor_args = []
        for position, argument in enumerate(schema.arguments):
            if position < len(step.args):
                value = step.args[position]
            elif argument.name in step.kwargs:
                value = step.kwargs[argument.name]
            elif argument.has_default_value():
                value = argument.default_value
            else:
                raise NotRecordable(f"{step.op}: no value for {argument.name}")
            if isinstance(value, Ref):
                tensor_args.append((position, self.number[value.index]))
                value = None
            elif any(isinstance(v, Ref) for v in tree_flatten(value)[0]):
                raise NotRecordable(f"{step.op}: a list of tensors ({argument.name})")
            elif value is not None and str(argument.type) in ("Tensor", "Tensor?"):
                # (a Python number the dispatcher wrapped, as in `index - 18`: the replayer would
                # need the wrapped-number tensor's type promotion)
                raise NotRecordable(f"{step.op}: {value!r} for the tensor argument {argument.name}")
            args.append(value)
        results = []
        for index in step.results:
            if index is not None:
                self.number[index] = self.count
                self.count += 1
            results.append(-1 if index is None else self.number[index])
        self.native.add_op(schema.name, schema.overload_name, args, tensor_args, results)

    def _add_launch(self, step: LaunchStep):
        tensors = [self.number[r.index] for r in step.tensors]
        entry = step.compiled
        if entry is None:
            raise NotRecordable("a launch without a compiled kernel (recorded without the fast launch)")
        compiled, grid, scalars = entry[1], entry[2], entry[3]
        compiled._init_handles()
        meta = compiled.metadata
        if getattr(meta, "global_scratch_size", 0) or getattr(meta, "num_ctas", 1) != 1:
            raise NotRecordable("a launch that needs scratch memory or clusters")
        # (the fast launch's arguments after the tensors: the plan's scalars, then its constants
        # that are not constexpr in the signature)
        args = dict(zip(step.kernel.arg_names, [None] * len(tensors) + list(scalars)))
        kinds, values = "", []
        for position, (name, kind) in enumerate(compiled.src.signature.items()):
            if kind == "constexpr":
                continue
            if kind.startswith("*"):  # (the tensors are the kernel's first arguments)
                assert position < len(tensors), (step.kernel, name)
                kinds, values = kinds + "p", values + [position]
            else:
                kinds, values = kinds + ("l" if "64" in kind else "i"), values + [int(args[name])]
        entry_params = _ptx_params(compiled.asm["ptx"])
        extra = entry_params - len(kinds)
        if not 0 <= extra <= 2:
            raise NotRecordable(f"{extra} kernel parameters past the signature's")
        self.native.add_native_launch(compiled.function, list(grid), 32 * meta.num_warps, meta.shared, tensors,
                                      kinds + "s" * extra, values + [0] * extra)


def _ptx_params(ptx: str) -> int:
    """How many parameters the kernel's .entry takes (Triton appends its scratch pointers)."""
    entry = ptx[ptx.index(".entry"):]
    return len(re.findall(r"\.param\s", entry[:entry.index(")")]))


def native_program(program: Program, python_launches: bool = False) -> NativeProgram:
    return NativeProgram(program, python_launches)




# ---- the eager path from C++ ----------------------------------------------------------------------

# dwconv's eager calls where `enabled` says so go through `conv`, an autograd Function written in
# C++ whose passes are recorded programs (host time of a small layer's forward+backward on the H200
# machine about half the Python Function's: docs/notes.md, session 20).
_LAYERS: dict = {}  # (program_key of the tensors, geometry) -> the extension's layer number, or None
# (program_key of the tensors, repr of (stride, padding, dilation) as the caller gave them) -> layer
# number: calls that passed the argument checks before and were recorded (`conv_known`). The repr,
# not the values: 1, True and 1.0 are equal keys, and the checks accept only the first.
_KNOWN: dict = {}


def conv_known(input, weight, bias, stride, padding, dilation) -> Optional[torch.Tensor]:
    """The C++ path for a call whose tensors (shapes, strides, dtypes, devices, alignment) and
    arguments are those of an earlier call that passed the checks and was recorded: no checks or
    geometry again (about half of the Python host time of a small layer's forward on the CPU
    machine). None for any other call: the caller takes the full path."""
    try:
        layer = _KNOWN.get((program_key((input, weight, bias)), repr((stride, padding, dilation))))
    except (AttributeError, TypeError, RuntimeError):  # (not tensors, no storage: the full path decides)
        return None
    return None if layer is None else extension().conv(input, weight, bias, layer)


def conv(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geom,
         arguments: tuple = ()) -> Optional[torch.Tensor]:
    """depthwise_conv2d for a checked geometry, differentiable, run by the C++ replayer; None where
    this layer's passes cannot be recorded (the caller keeps its Python path). A layer's first call
    records its forward (running it once more); each backward combination is recorded at its first
    backward, from C++ calling back into Python. arguments: (stride, padding, dilation) as the caller
    gave them, under which `conv_known` will find this layer."""
    tensors_key = program_key((input, weight, bias))
    key = (tensors_key, geom)
    layer = _LAYERS.get(key, _NEW)
    if layer is _NEW:
        if len(_LAYERS) >= 4096:  # (as the launch plans' caches)
            _LAYERS.clear()
            _KNOWN.clear()
        try:
            layer = _register(input, weight, bias, geom)
        except NotRecordable:
            layer = None
        _LAYERS[key] = layer
    if layer is None:
        return None
    if arguments:
        if len(_KNOWN) >= 4096:  # (many spellings of the same arguments can name one layer)
            _KNOWN.clear()
        _KNOWN[(tensors_key, repr(arguments))] = layer
    return extension().conv(input, weight, bias, layer)


_NEW = object()


def _register(input, weight, bias, geom) -> int:
    from .._library import _backward_formula
    from .forward import conv_forward

    python_launches = not input.is_cuda  # (CPU tensors: the interpreter, called back from C++)
    _, forward = record(lambda x, w, b: conv_forward(x, w, b, geom), [input, weight, bias])

    def record_backward(mask: int, grad_out: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
        def grads(grad_out, x, w):
            return _backward_formula(grad_out, x, w, geom, bool(mask & 1), bool(mask & 2), bool(mask & 4),
                                     traced=False)
        return NativeProgram(record(grads, [grad_out, x, w])[1], python_launches).native

    return extension().register_layer(NativeProgram(forward, python_launches).native, record_backward)
