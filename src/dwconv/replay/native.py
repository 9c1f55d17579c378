"""Programs (program.py) handed to the C++ replayer (replay.cpp), built at first use.

`native_program(program)` converts a recorded program: each aten op becomes a boxed call with its
arguments laid out in schema order once, each launch a cuLaunchKernel of the cubin Triton compiled
for it (on the GPU: the function handle, grid, threads, shared memory and parameters read off the
compiled kernel; checked bitwise against Triton's own launches on the H200),
or, with python_launches (CPU tests under the interpreter), a call back into `_launch.launch_now`.
`conv` (below) is dwconv's eager path through an autograd Function written in C++ whose forward and
backward are such programs: eager calls on CUDA tensors take it once the replayer is built
(`enabled`); DWCONV_NATIVE=0 turns it off, DWCONV_NATIVE=1 forces it (also on CPU tensors).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import sys
import threading
import warnings
from typing import List, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._env import switch, write_whole
from .._triton_compat import arg_names, launch_parameters, libcuda_dirs
from ..kernels import _launch
from ..tuning import on_change, tuned
from .program import LaunchStep, NotRecordable, OpStep, Program, Ref, program_key, record

SOURCE = os.path.join(os.path.dirname(__file__), "replay.cpp")


def _build_arguments(cuda_launches: bool) -> dict:
    """torch.utils.cpp_extension.load's keyword arguments for the replayer (plain data: the build
    runs in another process)."""
    # (the CPU build, whose launches call back into Python, serves the tests under the interpreter: -O0
    # built it in 30 s on the CPU machine, -O1 in 39, -O2 in 59, in every clean test run)
    flags, includes, ldflags = ["-O2" if cuda_launches else "-O0"], [], []
    if cuda_launches:
        import triton

        flags.append("-DDWCONV_CUDA_LAUNCH")
        includes.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include"))
        torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        ldflags = [f"-L{d}" for d in libcuda_dirs()] + ["-lcuda", f"-L{torch_lib}", "-lc10_cuda"]
    name = "dwconv_replay" + ("_cuda" if cuda_launches else "_cpu")
    return dict(name=name, sources=[SOURCE], extra_cflags=flags, extra_include_paths=includes,
                extra_ldflags=ldflags, build_directory=_build_directory(name), verbose=False)


def _build_directory(name: str) -> str:
    """Where the replayer is built: torch's extension root (TORCH_EXTENSIONS_DIR or its default), one
    folder per Python and torch version, so that a build is never loaded into another torch."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return os.path.join(root, "dwconv", re.sub(r"[^A-Za-z0-9_.-]", "_", tag), name)


# A build that takes longer is given up (the first build of the CUDA replayer takes about a minute);
# a build lock older than this was left by a build that was killed, and is removed.

# Runs in a process of its own: torch's build takes a lock file that a process killed mid-build
# leaves behind, and needs ninja on PATH, which is set for that process alone.
_BUILD_SCRIPT = ("import json, sys; from torch.utils.cpp_extension import load; "
                 "print(load(**json.loads(sys.argv[1])).__file__)")


class BuildFailed(RuntimeError):
    """The replayer could not be built or loaded."""


_STAMP = "dwconv-built.json"  # (in the build directory: the key and module of its last build)


def _stamp_key(arguments: dict) -> Optional[str]:
    """A build's key: its sources' bytes and its arguments (the build directory already names the
    Python and torch versions). None without sources, or where one cannot be read."""
    if not arguments.get("sources"):
        return None
    digest = hashlib.sha256(json.dumps(arguments, sort_keys=True).encode())
    try:
        for source in arguments["sources"]:
            with open(source, "rb") as f:
                digest.update(f.read())
    except OSError:
        return None
    return digest.hexdigest()


def _built_before(arguments: dict) -> Optional[str]:
    """The module a finished build of these sources and arguments left, or None. Checking it here
    takes milliseconds; torch's build process, even when it has nothing to do, took 1.7 s on the
    CPU machine (its own import of torch, then ninja)."""
    try:
        with open(os.path.join(arguments["build_directory"], _STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return None
    key = _stamp_key(arguments)
    module = stamp.get("module") if isinstance(stamp, dict) else None
    return module if key is not None and stamp.get("key") == key and module and os.path.exists(module) else None


def _stamp(arguments: dict, key: Optional[str], module: str) -> None:
    """Records that `module` was built from sources and arguments of this key (taken before the
    build: a source edited meanwhile then mismatches)."""
    if key is None:
        return
    try:
        write_whole(os.path.join(arguments["build_directory"], _STAMP), json.dumps({"key": key, "module": module}))
    except OSError:  # (no stamp: the next process asks torch's build again, as before stamps)
        pass


def _build(arguments: dict) -> str:
    """Builds the replayer in a subprocess (a no-op where it is built already) and returns the path
    of the module, stamped. Never waits past tuned().replay_build_timeout_s; removes a stale lock first."""
    import signal
    import subprocess
    import time

    key = _stamp_key(arguments)
    directory = arguments["build_directory"]
    os.makedirs(directory, exist_ok=True)
    lock = os.path.join(directory, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > tuned().replay_build_timeout_s:
            os.remove(lock)
            warnings.warn(f"dwconv: removed the C++ replayer's build lock {lock}, left by a build that did not "
                          "finish", RuntimeWarning)
    except FileNotFoundError:
        pass
    env = dict(os.environ)
    if shutil.which("ninja") is None:  # (pip's ninja sits beside the interpreter, maybe not on PATH)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    ours = not os.path.exists(lock)  # (a lock there now is another build's: never removed below)
    try:
        child = subprocess.Popen([sys.executable, "-c", _BUILD_SCRIPT, json.dumps(arguments)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as error:
        raise BuildFailed(repr(error)) from None
    try:
        out, err = child.communicate(timeout=tuned().replay_build_timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # (the compiler too: the build's process group)
        child.communicate()
        if ours and os.path.exists(lock):  # (our killed build's own lock)
            os.remove(lock)
        raise BuildFailed(f"the build took more than {tuned().replay_build_timeout_s:.0f} s (another build holding {lock}?)") \
            from None
    lines = out.strip().splitlines()
    if child.returncode or not lines or not os.path.exists(lines[-1]):
        raise BuildFailed((err.strip().splitlines() or ["no message"])[-1])
    _stamp(arguments, key, lines[-1])
    return lines[-1]


_MODULES: dict = {}  # cuda_launches -> the loaded replayer
_FAILURES: dict = {}  # cuda_launches -> why it could not be built (warned once)
_DEFAULT_MODULE: list = []  # the one of this machine (CUDA launches where CUDA is available), once loaded
_BUILD_LOCK = threading.Lock()


def extension(cuda_launches: Optional[bool] = None):
    """The compiled replayer, built first if it must be (see `_build`).
    cuda_launches: with cuLaunchKernel (needs CUDA's driver library; default: where CUDA is available).
    Raises BuildFailed, the same each time, where it cannot be built."""
    if cuda_launches is None:
        if _DEFAULT_MODULE:
            return _DEFAULT_MODULE[0]
        cuda_launches = torch.cuda.is_available()
    module = _MODULES.get(cuda_launches)
    if module is not None:
        return module
    with _BUILD_LOCK:
        if cuda_launches in _FAILURES:
            raise BuildFailed(_FAILURES[cuda_launches])
        if cuda_launches not in _MODULES:
            arguments = _build_arguments(cuda_launches)
            try:
                _MODULES[cuda_launches] = _load(arguments)
                if cuda_launches == torch.cuda.is_available():
                    _DEFAULT_MODULE.append(_MODULES[cuda_launches])
            except Exception as error:
                _FAILURES[cuda_launches] = str(error) if isinstance(error, BuildFailed) else repr(error)
                raise BuildFailed(_FAILURES[cuda_launches]) from None
    return _MODULES[cuda_launches]


def _load(arguments: dict):
    """The replayer's module: the stamped build's where there is one that imports, else torch's build's."""
    built = _built_before(arguments)
    if built is not None:
        try:
            return _import(arguments["name"], built)
        except Exception:  # (a stamped module that no longer loads: torch's build decides)
            pass
    return _import(arguments["name"], _build(arguments))


def _import(name: str, path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- when eager calls take this path ----------------------------------------------------------

def enabled(input: torch.Tensor) -> bool:
    """Whether dwconv's eager call on `input` goes through `conv` (below). DWCONV_NATIVE=0 (false,
    off, no): never; =1 (true, on, yes): always, the replayer built now if it must be (where it
    cannot be, one warning and the Python path). Unset: CUDA tensors, once the replayer is built:
    the first call starts the build in the background and calls keep the Python path, which
    launches the same kernels, until it is done. Never under a TorchDispatchMode (a mode would see
    the recorded ops but not the launches the Python path makes, and a recording would log its ops)."""
    setting = switch("DWCONV_NATIVE")
    if setting is False or torch._C._len_torch_dispatch_stack():
        return False
    if setting:
        return _forced()
    return input.is_cuda and _built_in_background()


def _forced() -> bool:
    if _DEFAULT_MODULE:
        return True
    return _load_or_warn("DWCONV_NATIVE=1")


def _load_or_warn(why: str) -> bool:
    failed = torch.cuda.is_available() in _FAILURES
    try:
        extension()
        return True
    except BuildFailed as error:
        if not failed:
            warnings.warn(f"dwconv: the C++ replayer could not be built ({error}); {why}: eager calls keep the "
                          "Python path (README, 'Launches on the GPU')", RuntimeWarning)
        return False


def prepare() -> bool:
    """Build or load the CUDA replayer now, unless DWCONV_NATIVE=0: eager calls on CUDA tensors then
    take the C++ path from the first (benchmarks, warm-up). False where it cannot be built (warned)."""
    if switch("DWCONV_NATIVE") is False:
        return False
    if not _load_or_warn("prepare()"):
        return False
    _BACKGROUND["built"] = True
    return True


_BACKGROUND: dict = {}  # "thread": the build's watcher; "built": the build finished and succeeded


def _built_in_background() -> bool:
    """True once the CUDA replayer is built; the first call starts building it in a thread that
    waits on the build's process (its first build on a machine takes about a minute, later ones
    find it on disk in seconds)."""
    if _BACKGROUND.get("built"):
        return True
    if "thread" not in _BACKGROUND:
        _BACKGROUND["thread"] = threading.Thread(target=_build_in_background, name="dwconv-native-build", daemon=True)
        _BACKGROUND["thread"].start()
    return False


def _build_in_background() -> None:
    if _load_or_warn("built in the background"):
        _BACKGROUND["built"] = True


class NativeProgram:
    """A Program replayed by C++; replay(*inputs) returns what Program.replay returns."""

    def __init__(self, program: Program, python_launches: bool = False):
        self.native = extension().Program(program.n_inputs)
        leaves, self.spec = tree_flatten(program.outputs)
        self.flat_tuple = type(program.outputs) is tuple and self.spec.num_leaves == len(program.outputs)
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
        results = self.native.replay(list(inputs))
        if self.flat_tuple:  # (a tuple of tensors: what the passes return; tree_unflatten took 7 us a call)
            return tuple(results)
        return tree_unflatten(results, self.spec)

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
        parameters = launch_parameters(compiled)
        if parameters is None:
            raise NotRecordable("a launch that needs scratch memory or clusters")
        function, threads, shared, signature, ptx = parameters
        # (the fast launch's arguments after the tensors: the plan's scalars, then its constants
        # that are not constexpr in the signature)
        args = dict(zip(arg_names(step.kernel), [None] * len(tensors) + list(scalars)))
        kinds, values = "", []
        for position, (name, kind) in enumerate(signature):
            if kind == "constexpr":
                continue
            if kind.startswith("*"):  # (the tensors are the kernel's first arguments)
                assert position < len(tensors), (step.kernel, name)
                kinds, values = kinds + "p", values + [position]
            else:
                code, value = _scalar_parameter(kind, args[name])
                kinds, values = kinds + code, values + [value]
        entry_params = _ptx_params(ptx)
        extra = entry_params - len(kinds)
        if not 0 <= extra <= 2:
            raise NotRecordable(f"{extra} kernel parameters past the signature's")
        self.native.add_native_launch(function, list(grid), threads, shared, tensors,
                                      kinds + "s" * extra, values + [0] * extra)


def _scalar_parameter(kind: str, value) -> tuple:
    """A scalar kernel parameter as the replayer passes it: ('i', 32 bits) or ('l', 64 bits), a
    float as its bit pattern (a float scalar once went as int(value): eps 1e-5 launched as 0)."""
    if kind in ("i32", "u32", "i64", "u64"):
        return ("l" if "64" in kind else "i"), int(value)
    if kind == "fp32":
        return "i", struct.unpack("<i", struct.pack("<f", value))[0]
    if kind == "fp64":
        return "l", struct.unpack("<q", struct.pack("<d", value))[0]
    raise NotRecordable(f"a kernel parameter of type {kind}")


def _ptx_params(ptx: str) -> int:
    """How many parameters the kernel's .entry takes (Triton appends its scratch pointers)."""
    entry = ptx[ptx.index(".entry"):]
    return len(re.findall(r"\.param\s", entry[:entry.index(")")]))


def native_program(program: Program, python_launches: bool = False) -> NativeProgram:
    return NativeProgram(program, python_launches)




# ---- the eager path from C++ ----------------------------------------------------------------------

# dwconv's eager calls where `enabled` says so go through `conv`, an autograd Function written in
# C++ whose passes are recorded programs (host time of a small layer's forward+backward on the H200
# machine about half the Python Function's: docs/decisions.md).
#
# The recorded layers: (program_key of the tensors, geometry) -> [the extension's layer number (None:
# not recordable, the Python path), the `_KNOWN` keys naming it, and for a None its last use on the
# extension's use clock (a recorded layer's is kept in C++, where its calls land)].
# Bounded: past tuned().replay_layer_capacity the least recently used layer is released here and in C++ (a model
# fed many input sizes kept every layer it ever saw: +57.6 MB after 4000 sizes). An autograd graph
# holds its layer, so a backward after the eviction still finds its programs.
_LAYERS: dict = {}
# (program_key of the tensors, repr of (stride, padding, dilation) as the caller gave them) ->
# (layer key, layer number): calls that passed the argument checks before and were recorded, each
# also remembered in C++ (`conv_known`). The repr, not the values: 1, True and 1.0 are equal keys, and
# the checks accept only the first.
_KNOWN: dict = {}
_SPELLINGS_PER_LAYER = 16  # (more spellings of one layer's arguments take the full path)
_LAYERS_LOCK = threading.Lock()  # (insertions and evictions; lookups run without it)


def has_known_layers() -> bool:
    return bool(_KNOWN)


def conv_known(input, weight, bias, stride, padding, dilation, *activation) -> Optional[torch.Tensor]:
    """The C++ path for a call whose tensors (shapes, strides, dtypes, devices, alignment) and
    arguments are those of an earlier call that passed the checks and was recorded: no checks or
    geometry again, and the lookup itself in C++ (the tensors' key in Python cost 5 of a small
    layer's 14.5 us of host time on the CPU machine). Under autocast the tensors are cast first, in
    C++, as F.conv2d's autocast casts them. None for any other call, and for tensor subclasses that
    dispatch in Python: the caller takes the full path. activation: the name of an activated call's
    (spelled in its arguments, as `conv` was given them)."""
    try:
        return _DEFAULT_MODULE[0].conv_known(input, weight, bias, repr((stride, padding, dilation, *activation)))
    except TypeError:  # (not tensors: the full path decides)
        return None


def conv(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geom, passes,
         arguments: tuple = ()) -> Optional[torch.Tensor]:
    """depthwise_conv2d for a checked geometry, differentiable, run by the C++ replayer; None where
    this layer's passes cannot be recorded (the caller keeps its Python path). A layer's first call
    records its forward (running it once more); each backward combination is recorded at its first
    backward, from C++ calling back into Python. arguments: (stride, padding, dilation) as the caller
    gave them, under which `conv_known` will find this layer. passes: the Python passes recorded and
    called back (forward(x, w, b, geom), backward(grad_out, x, w, geom, want_input, want_weight,
    want_bias), differentiable_backward(same)), given by the autograd layer (dwconv._library)."""
    tensors_key = program_key((input, weight, bias))
    key = (tensors_key, geom, passes)  # (another set of passes, such as an activated forward's: another layer)
    entry = _layer(key, lambda: _register(input, weight, bias, geom, passes), "a layer")
    number, spellings, _ = entry
    if number is None:
        return None
    if arguments and len(spellings) < _SPELLINGS_PER_LAYER:
        known = (tensors_key, repr(arguments))
        if known not in _KNOWN:
            spellings.append(known)
            _KNOWN[known] = (key, number)
            extension().remember_call(input, weight, bias, known[1], number)
    return extension().conv(input, weight, bias, number)


def _layer(key, register, what: str) -> list:
    """The registry's entry of a layer key, [number (None: the Python path), spellings, last use],
    registered first where it is new (register(): its forward recorded, the layer's number)."""
    entry = _LAYERS.get(key)
    if entry is None:
        try:
            number = register()
        except NotRecordable:
            number = None
        except Exception as error:  # (the replayer refused a step: as not recordable, said once)
            warnings.warn(f"dwconv: {what}'s forward could not be recorded for the C++ path ({error!r}); it "
                          "keeps the Python path", RuntimeWarning)
            number = None
        entry = _remember(key, number)
    if entry[0] is None:
        entry[2] = extension().tick()
    return entry


def _recency(entry: list) -> int:
    return entry[2] if entry[0] is None else extension().last_used(entry[0])


def _remember(key, number: Optional[int]) -> list:
    with _LAYERS_LOCK:
        entry = _LAYERS.setdefault(key, [number, [], extension().tick()])
        if entry[0] != number and number is not None:  # (another thread registered it first)
            extension().release_layer(number)
        while len(_LAYERS) > tuned().replay_layer_capacity:
            oldest = min((k for k in _LAYERS if k != key), key=lambda k: _recency(_LAYERS[k]))
            old, spellings, _ = _LAYERS.pop(oldest)
            for known in spellings:
                _KNOWN.pop(known, None)
            if old is not None:
                extension().release_layer(old)  # (and its calls remembered in C++)
    return entry


def forget_layers() -> None:
    """Releases every recorded layer (on a change of the tuning table: its programs were recorded
    under the old one; and in tests)."""
    with _LAYERS_LOCK:
        numbers = [entry[0] for entry in _LAYERS.values() if entry[0] is not None]
        _LAYERS.clear()
        _KNOWN.clear()
        for number in numbers:
            extension().release_layer(number)
    _stop_serving_ops()


def _register(input, weight, bias, geom, passes) -> int:
    conv_forward, backward, differentiable_backward = passes
    python_launches = not input.is_cuda  # (CPU tensors: the interpreter, called back from C++)
    _, forward = record(lambda x, w, b: conv_forward(x, w, b, geom), [input, weight, bias])

    def record_backward(mask: int, grad_out: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
        """This backward's program, or None: then it runs python_backward (below), always."""
        def grads(grad_out, x, w):
            return backward(grad_out, x, w, geom, bool(mask & 1), bool(mask & 2), bool(mask & 4))
        try:
            return NativeProgram(record(grads, [grad_out, x, w])[1], python_launches).native
        except NotRecordable:
            return None
        except Exception as error:  # (the Python path then raises again if the pass itself failed)
            warnings.warn(f"dwconv: a layer's backward could not be recorded for the C++ path ({error!r}); it "
                          "keeps the Python path", RuntimeWarning)
            return None

    def python_backward(mask: int, grad_out: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
        """The Python Function's backward: differentiable again under create_graph=True."""
        return list(differentiable_backward(grad_out, x, w, geom, bool(mask & 1), bool(mask & 2), bool(mask & 4)))

    return extension().register_layer(NativeProgram(forward, python_launches).native, record_backward,
                                      python_backward)


def batch_norm(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, running_mean: torch.Tensor,
               running_var: torch.Tensor, arguments: tuple, passes) -> Optional[torch.Tensor]:
    """The fused block's BatchNorm in training with its activation (dwconv.batch_norm's Function) as
    an autograd Function written in C++, its passes recorded programs: a layer of its own, keyed and
    evicted as the convolutions' are. None where its forward cannot be recorded (the caller keeps
    the Python Function). arguments: (momentum, eps, activation code), fixed for the layer; passes:
    (forward(y, weight, bias, running_mean, running_var, *arguments), backward(grad, y, weight,
    bias, mean, invstd, eps, code), python_backward(mask, grad, y, weight, bias, mean, invstd))."""
    layouts = extension().layouts_key([y, weight, bias, running_mean, running_var])
    if layouts is None:  # (a tensor the replayer must not take: a subclass, one without storage)
        return None
    number = _layer(("batch_norm", layouts, arguments, passes),
                    lambda: _register_norm(y, weight, bias, running_mean, running_var, arguments, passes),
                    "a BatchNorm")[0]
    if number is None:
        return None
    return extension().norm(y, weight, bias, running_mean, running_var, number)


def _register_norm(y, weight, bias, running_mean, running_var, arguments: tuple, passes) -> int:
    forward, backward, python_backward = passes
    # (recorded on copies of the running statistics: the layer's first call then runs the program on
    # them, so that they are updated once)
    program = _record_pass(forward, [y, weight, bias, running_mean, running_var], arguments, (3, 4),
                           "a BatchNorm's forward")
    if program is None:
        raise NotRecordable("a BatchNorm's forward")

    def record_backward(mask: int, *tensors: torch.Tensor):
        recorded = _record_pass(backward, list(tensors), arguments[1:], (), "a BatchNorm's backward")
        return None if recorded is None else recorded.native

    return extension().register_layer(program.native, record_backward, python_backward)


def squeeze_excite(input: torch.Tensor, gate_of, pool: bool, passes) -> Optional[torch.Tensor]:
    """The squeeze-and-excitation block in training (dwconv.squeeze_excite) as autograd nodes
    written in C++ around the gate's own ops (gate_of: the members' calls on the squeeze; pool:
    torchvision's average pool rather than the mean), its multiply and backward passes recorded
    programs: a layer of its own for the input's layout, keyed and evicted as the convolutions' are.
    None where the multiply cannot be recorded (the caller keeps the Python Function). passes:
    (forward(input, gate rows), backward(mask, *tensors): mask 1 the input's gradient, 2 the gate's)."""
    layouts = extension().layouts_key([input])
    if layouts is None:
        return None
    number = _layer(("squeeze_excite", layouts, passes), lambda: _register_squeeze_excite(input, passes),
                    "a squeeze-and-excitation block")[0]
    if number is None:
        return None
    return extension().squeeze_excite(input, gate_of, pool, number)


def _register_squeeze_excite(input, passes) -> int:
    forward, backward = passes
    # (recorded on a gate of ones: the block's own gate is not computed yet; the program's rows are
    # [N, C] contiguous and aligned, as the C++ node hands them)
    gate_rows = torch.ones(input.shape[:2], dtype=input.dtype, device=input.device)
    program = _record_pass(forward, [input, gate_rows], (), (), "a squeeze-and-excitation block's forward")
    if program is None:
        raise NotRecordable("a squeeze-and-excitation block's forward")

    def record_backward(mask: int, *tensors: torch.Tensor):
        recorded = _record_pass(lambda *t: backward(mask, *t), list(tensors), (), (),
                                "a squeeze-and-excitation block's backward")
        return None if recorded is None else recorded.native

    return extension().register_layer(program.native, record_backward, backward)


on_change(forget_layers)


# ---- other passes from C++ -------------------------------------------------------------------------

# Passes outside the convolution's autograd Function (the fused block's BatchNorm): their Python
# callers keep the autograd, the replayer takes the launches. (function, program_key) -> the pass's
# NativeProgram, None where it could not be recorded (the Python path, always). Bounded as the plans
# are: past the limit it starts over.
_PASSES: dict = {}
_PASS_LIMIT = 4096


def replayed(fn, inputs: list, *args, writes: tuple = ()):
    """fn(*inputs, *args), its launches and allocations by the C++ replayer where `enabled` says
    so: recorded at the first call for these tensors' layouts and args, replayed from C++ after (one
    call from Python for the whole pass). writes: positions of the inputs that fn updates in place;
    the recording runs on copies of those, then the program runs on the inputs, so that a pass that
    cannot be recorded (it then runs in Python) never updates them twice."""
    if not enabled(inputs[0]):
        return fn(*inputs, *args)
    layouts = extension().layouts_key(inputs)
    if layouts is None:  # (a tensor the replayer must not take)
        return fn(*inputs, *args)
    key = (fn, layouts, args)
    try:
        program = _PASSES.get(key, _MISSING)
    except TypeError:  # (an argument that does not hash)
        return fn(*inputs, *args)
    if program is _MISSING:
        program = _record_pass(fn, inputs, args, writes, "a pass")
        if len(_PASSES) >= _PASS_LIMIT:
            _PASSES.clear()
        _PASSES[key] = program
    if program is None:
        return fn(*inputs, *args)
    return program.replay(*inputs)


_MISSING = object()


def _record_pass(fn, inputs: list, args: tuple, writes: tuple, what: str) -> Optional[NativeProgram]:
    """fn(*inputs, *args) recorded (on copies of the inputs at positions `writes`, which fn updates
    in place) as a NativeProgram, or None where it cannot be (said once where the replayer refused)."""
    scratch = [t.clone() if i in writes and t is not None else t for i, t in enumerate(inputs)]
    try:
        _, program = record(fn, scratch, *args)
        return NativeProgram(program, python_launches=not inputs[0].is_cuda)
    except NotRecordable:
        return None
    except Exception as error:  # (the Python path then raises again if the pass itself failed)
        warnings.warn(f"dwconv: {what} could not be recorded for the C++ path ({error!r}); it keeps the Python path",
                      RuntimeWarning)
        return None


on_change(_PASSES.clear)


# ---- the registered ops from C++ ----------------------------------------------------------------

# torch.compile's graphs call dwconv's registered ops (dwconv._library) once a pass, through the
# dispatcher: once the replayer is built, their implementation on a device type is the replayer's
# `served_op`, which replays the program recorded at a call's first sight of its tensors' layouts and
# arguments, and calls `_served_miss` for any other (docs/decisions.md, "torch.compile").
_SERVED: dict = {}  # namespace -> {"implementations": name -> the op's Python implementation, "keys": set}


def serve_ops(namespace: str, implementations: dict, device_type: str, autograd: Optional[dict] = None) -> None:
    """Calls of the ops namespace::name (implementations: name -> its Python implementation, the
    function the op was registered from) on tensors of device_type ("cuda", "cpu") taken by the
    replayer from now on, until `forget_layers`. autograd: name -> the op's Python autograd kernel
    (keyset, *args), which differentiable calls still take; the replayer's takes the others. Call
    only where `enabled` said yes."""
    served = _SERVED.setdefault(namespace, {"implementations": dict(implementations), "keys": set(),
                                            "autograd": dict(autograd or {})})
    key = device_type.upper()
    if key in served["keys"]:
        return
    with _LAYERS_LOCK:
        if key not in served["keys"]:
            autograd_kernel = _served_autograd if set(served["autograd"]) == set(implementations) else None
            extension().serve_ops(namespace, list(implementations), [key], _served_miss, autograd_kernel,
                                  tuned().replay_layer_capacity)
            served["keys"].add(key)


def serving_ops(namespace: str, device_type: str) -> bool:
    return device_type.upper() in _SERVED.get(namespace, {}).get("keys", ())


def _served_miss(name: str, args: list, record_it: bool):
    """An op call the replayer has no program for: (its result, the program recorded for calls like
    it, or None: such calls keep running here). An error of the call itself (bad arguments) is raised."""
    namespace, _, op_name = name.partition("::")
    implementation = _SERVED[namespace]["implementations"][op_name]
    if not record_it:
        return implementation(*args), None
    schema = getattr(getattr(torch.ops, namespace), op_name).default._schema
    positions = [i for i, argument in enumerate(schema.arguments) if _is_tensor_type(argument.type)]

    def call(*tensors):
        full = list(args)
        for position, tensor in zip(positions, tensors):
            full[position] = tensor
        return implementation(*full)

    tensors = [args[p] for p in positions]
    # (an op that updates inputs in place records on copies of them, then its program runs on them:
    # a call that cannot be recorded then runs once, in Python, and never updates them twice)
    written = {i for i, p in enumerate(positions) if _written(schema.arguments[p])}
    scratch = [t.clone() if i in written and t is not None else t for i, t in enumerate(tensors)]
    try:
        result, program = record(call, scratch)
    except NotRecordable:
        return implementation(*args), None
    try:
        on_cpu = not any(t is not None and t.is_cuda for t in tensors)
        native_program = NativeProgram(program, python_launches=on_cpu)
    except Exception as error:
        if not isinstance(error, NotRecordable):  # (the replayer refused a step: as not recordable, said once)
            warnings.warn(f"dwconv: {name} could not be recorded for the C++ path ({error!r}); such calls keep the "
                          "Python path", RuntimeWarning)
        return (implementation(*args) if written else result), None
    return (native_program.replay(*tensors) if written else result), native_program.native


def _written(argument) -> bool:
    """Whether an op's schema says it writes this argument (Tensor(a!))."""
    return argument.alias_info is not None and argument.alias_info.is_write


def _served_autograd(name: str, raw_keyset: int, args: list):
    namespace, _, op_name = name.partition("::")
    return _SERVED[namespace]["autograd"][op_name](torch._C.DispatchKeySet.from_raw_repr(raw_keyset), *args)


def _is_tensor_type(t) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def _stop_serving_ops() -> None:
    if any(served["keys"] for served in _SERVED.values()):
        extension().stop_serving_ops()
    _SERVED.clear()
