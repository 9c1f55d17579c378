"""The C++ replayer (replay/replay.cpp through replay/native.py): recorded programs replayed from C++
give bitwise what dwconv's Python path gives, forward and backward, both layouts. On the CPU the
launches call back into Python (the interpreter); on a GPU they are cuLaunchKernel of Triton's cubins."""

import contextlib

import pytest
import torch
import torch.utils._python_dispatch

import dwconv
from dwconv._geometry import conv_geometry
from dwconv._library import _backward_formula
from dwconv.replay import native, program
from dwconv.dispatch import conv_forward
from helpers import DEVICE, assert_close, randn
from test_program import LAYOUTS, assert_same

# (shape, kernel, stride, padding, dilation): 3x3 (the fused backward), strided, and a 7x7 on a
# narrow plane (large_fma in NCHW)
CASES = [((2, 3, 7, 9), 3, 1, 1, 1), ((1, 4, 9, 8), 3, 2, 1, 1), ((1, 2, 9, 10), 7, 1, 3, 1)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape,kernel,stride,padding,dilation", CASES, ids=["k3", "k3-stride2", "k7"])
def test_native_replay(shape, kernel, stride, padding, dilation, layout):
    memory_format = LAYOUTS[layout]

    def tensors():
        x = randn(*shape).contiguous(memory_format=memory_format)
        return x, randn(shape[1], 1, kernel, kernel), randn(shape[1])

    x, weight, bias = tensors()
    geom = conv_geometry(x, weight, bias, stride, padding, dilation)

    def grads(grad_out, x, weight):
        return _backward_formula(grad_out, x, weight, geom, True, True, True, traced=False)

    grad_out = randn(*geom.output_shape).contiguous(memory_format=memory_format)
    _, forward = program.record(lambda x, w, b: conv_forward(x, w, b, geom), [x, weight, bias])
    _, backward = program.record(grads, [grad_out, x, weight])
    python_launches = DEVICE == "cpu"
    forward, backward = (native.native_program(p, python_launches) for p in (forward, backward))
    fresh = tensors()
    out = forward.replay(*fresh)
    out_again = forward.replay(*fresh)
    assert_same([out, out_again], [conv_forward(*fresh, geom)] * 2, "output")
    fresh_grad = randn(*geom.output_shape).contiguous(memory_format=memory_format)
    assert_same(backward.replay(fresh_grad, *fresh[:2]), grads(fresh_grad, *fresh[:2]), "gradients")


def test_native_program_elides_detach_and_alias():
    """A detach or alias of a value the program made is replayed as that value (one dispatcher call
    fewer each); of an input, or of an output, it stays."""
    def fn(x):
        doubled = x + x
        again = torch.ops.aten.alias(torch.ops.aten.detach(doubled))
        tripled = again + x
        return tripled, torch.ops.aten.detach(x), torch.ops.aten.detach(tripled)

    x = randn(3, 5)
    _, prog = program.record(fn, [x])
    assert [s.op.__name__ for s in prog.steps] == ["add.Tensor", "detach.default", "alias.default", "add.Tensor",
                                                   "detach.default", "detach.default"]
    replay = native.native_program(prog, python_launches=DEVICE == "cpu")
    assert replay.native.steps() == 4  # (the first detach and the alias went)
    fresh = randn(3, 5)
    tripled, detached, detached_output = replay.replay(fresh)
    assert_same([tripled, detached, detached_output], [fresh + fresh + fresh, fresh, fresh + fresh + fresh], "results")
    assert detached is not fresh and detached_output is not tripled


def test_native_program_releases_values_after_their_last_use(monkeypatch):
    """A value the program made is let go after the last step that reads it, not at the end of the
    replay (a weight gradient's partial sums held to the end sat beside grad_input, above PyTorch's
    peak memory); outputs are kept."""
    import weakref

    from dwconv.kernels import _launch

    seen = {}

    def fake_launch(kernel, plan, *tensors):  # (the launches are Python callbacks, as on the CPU)
        if kernel == "first":
            seen["partial"] = weakref.ref(tensors[0])
        else:
            seen["partial alive"] = seen["partial"]() is not None

    def fn(x):
        partial = torch.empty(8)
        _launch.launch("first", None, partial)
        out = torch.empty(8)
        _launch.launch("second", None, out)
        return out + x

    monkeypatch.setattr(_launch, "launch_now", fake_launch)
    _, prog = program.record(fn, [randn(8, device="cpu")])
    replay = native.native_program(prog, python_launches=True)
    seen.clear()
    result = replay.replay(randn(8, device="cpu"))
    assert seen == {"partial": seen["partial"], "partial alive": False}, seen
    assert seen["partial"]() is None and result.shape == (8,)


def test_native_program_checks_its_inputs():
    x, weight = randn(1, 2, 5, 5), randn(2, 1, 3, 3)
    geom = conv_geometry(x, weight, None, 1, 1, 1)
    _, prog = program.record(lambda x, w: conv_forward(x, w, None, geom), [x, weight])
    replay = native.native_program(prog, python_launches=DEVICE == "cpu")
    with pytest.raises(RuntimeError, match="program takes 2 inputs"):
        replay.replay(x)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("wanted,bias", [((True, True, True), True), ((True, True), False), ((False, True, False), True),
                                         ((True, False), False)], ids=["all", "no-bias", "weight-only", "input-only"])
def test_native_eager_path(monkeypatch, layout, wanted, bias):
    """DWCONV_NATIVE=1: dwconv's eager calls through the C++ autograd Function: output and the wanted
    gradients against float64 F.conv2d, a second call (replayed, not recorded) bitwise the first,
    and a grad_out of other strides (y.sum()'s expanded ones: a second backward program)."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    memory_format = LAYOUTS[layout]
    x = randn(2, 3, 8, 9).contiguous(memory_format=memory_format)
    tensors = [x, randn(3, 1, 3, 3)] + ([randn(3)] if bias else [])
    leaves = [t.clone().requires_grad_(want) for t, want in zip(tensors, wanted)]
    ref_leaves = [t.detach().double().requires_grad_(want) for t, want in zip(tensors, wanted)]
    ref = torch.nn.functional.conv2d(*ref_leaves, stride=1, padding=1, groups=3)
    grad_out = randn(*ref.shape).contiguous(memory_format=memory_format)
    ref_grads = torch.autograd.grad(ref, [t for t in ref_leaves if t.requires_grad], grad_out.double(),
                                    retain_graph=True)
    results = []
    for _ in range(2):
        out = dwconv.depthwise_conv2d(*leaves, stride=1, padding=1)
        assert type(out.grad_fn).__name__ == "CppFunction" and out.is_contiguous(memory_format=memory_format)
        grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad_out)
        results.append((out, *grads))
        assert_close(out, ref, torch.float32, "output")
        for got, want, name in zip(grads, ref_grads, ["first", "second", "third"]):
            assert_close(got, want, torch.float32, f"{name} wanted gradient")
    assert_same(results[1], results[0], "second call")
    summed = torch.autograd.grad(dwconv.depthwise_conv2d(*leaves, stride=1, padding=1).sum(),
                                 [t for t in leaves if t.requires_grad])
    ref_summed = torch.autograd.grad(ref.sum(), [t for t in ref_leaves if t.requires_grad])
    for got, want in zip(summed, ref_summed):
        assert_close(got, want, torch.float32, "gradient of a sum")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_eager_path_large_kernels(monkeypatch, dtype):
    """Half precision large kernels (the Toeplitz path: weight bands gathered by a launch, grad_input
    on the flipped bands) through the C++ Function, output and gradients against float64. Session
    25: on the GPU their first call crashed in the recording ("Unable to cast 38 to Tensor": a
    Python number in a tensor argument of the band index's torch ops)."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    x, weight = randn(2, 3, 16, 16, dtype=dtype), randn(3, 1, 13, 13, dtype=dtype) / 13
    leaves = [t.clone().requires_grad_() for t in (x, weight)]
    out = dwconv.depthwise_conv2d(*leaves, padding=6)
    assert type(out.grad_fn).__name__ == "CppFunction"
    grad_out = randn(*out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref_leaves = [t.double().requires_grad_() for t in (x, weight)]
    ref = torch.nn.functional.conv2d(*ref_leaves, padding=6, groups=3)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out.double())
    assert_close(out, ref, dtype, "output")
    assert_close(grads[0], ref_grads[0], dtype, "grad_input")
    scale = ref_grads[1].abs().max()
    assert_close(grads[1].double() / scale, ref_grads[1] / scale, dtype, "grad_weight (relative to its largest)")


def test_native_program_refuses_numbers_in_tensor_arguments():
    """An op recorded with a Python number where its schema takes a tensor (`x - 3` dispatches to
    sub.Tensor with a wrapped number) is not replayable: NotRecordable, so the layer keeps the
    Python path, not a RuntimeError from the replayer."""
    _, prog = program.record(lambda x: x - 3, [randn(4)])
    with pytest.raises(program.NotRecordable, match="tensor argument other"):
        native.native_program(prog, python_launches=DEVICE == "cpu")


def test_native_eager_path_falls_back(monkeypatch):
    """A layer whose passes cannot be recorded keeps the Python autograd Function."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")

    def refuse(*args, **kwargs):
        raise program.NotRecordable("refused for the test")

    monkeypatch.setattr(native, "_register", refuse)
    x, weight = randn(1, 2, 5, 7).requires_grad_(), randn(2, 1, 3, 3)
    out = dwconv.depthwise_conv2d(x, weight, None, 1, 1)
    assert type(out.grad_fn).__name__ != "CppFunction"
    assert_close(out, torch.nn.functional.conv2d(x.double(), weight.double(), None, 1, 1, 1, 2), torch.float32)


class _PassThroughMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("setting", ["0", "1", "unset", "1-under-a-mode"])
def test_native_path_selection(monkeypatch, setting):
    """DWCONV_NATIVE=0: the Python Function; =1: the C++ one; unset: the C++ one on CUDA tensors once
    built (CPU tensors: the Python one); never under a TorchDispatchMode. Right values every way."""
    if setting == "unset":
        monkeypatch.delenv("DWCONV_NATIVE", raising=False)
    else:
        monkeypatch.setenv("DWCONV_NATIVE", setting.split("-")[0])
    monkeypatch.setattr(native, "_BACKGROUND", {"built": True})  # (as after the background build)
    x, weight = randn(2, 3, 6, 7).requires_grad_(), randn(3, 1, 3, 3)
    if setting == "1-under-a-mode":
        with _PassThroughMode():
            out = dwconv.depthwise_conv2d(x, weight, None, 1, 1)
    else:
        out = dwconv.depthwise_conv2d(x, weight, None, 1, 1)
    through_cpp = setting == "1" or (setting == "unset" and DEVICE == "cuda")
    assert (type(out.grad_fn).__name__ == "CppFunction") == through_cpp, type(out.grad_fn).__name__
    assert_close(out, torch.nn.functional.conv2d(x.double(), weight.double(), None, 1, 1, 1, 3), torch.float32)


@pytest.mark.parametrize("outcome", ["built", "fails"])
def test_native_background_build(monkeypatch, outcome):
    """The background build runs in a process of its own and reports success, or warns and leaves
    the Python path on (here: the CPU build, and a build of a source that is not there)."""
    build_arguments = native._build_arguments
    if outcome == "built":
        monkeypatch.setattr(native, "_build_arguments", lambda cuda_launches: build_arguments(False))
    else:
        monkeypatch.setattr(native, "_build_arguments",
                            lambda cuda_launches: dict(build_arguments(False), name="dwconv_missing",
                                                       sources=["/nonexistent/replay.cpp"]))
    monkeypatch.setattr(native, "_BACKGROUND", {})
    for loaded in ("_MODULES", "_FAILURES"):  # (as in a fresh process: nothing built or refused yet)
        monkeypatch.setattr(native, loaded, {})
    monkeypatch.setattr(native, "_DEFAULT_MODULE", [])
    assert not native._built_in_background()  # (the first call only starts it)
    with pytest.warns(RuntimeWarning, match="could not be built") if outcome == "fails" else contextlib.nullcontext():
        native._BACKGROUND["thread"].join(timeout=900)
    assert not native._BACKGROUND["thread"].is_alive(), "the build did not finish in 15 minutes"
    assert native._built_in_background() == (outcome == "built")


def test_native_stamped_build_loads_without_the_build_process(monkeypatch, tmp_path):
    """A finished build leaves a stamp (its sources' bytes and arguments): a later process imports
    its module without starting torch's build process (1.7 s even when it has nothing to do);
    another source, or a stamped module that does not import, goes through the build."""
    import subprocess

    arguments = native._build_arguments(False)
    native._build(arguments)  # (built and stamped; a no-op build where it was built already)
    assert native._built_before(arguments) is not None
    started = []
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *args, **kwargs: started.append(args) or popen(*args, **kwargs))
    module = native._load(arguments)
    assert hasattr(module, "conv_known") and started == []
    edited = tmp_path / "replay.cpp"
    edited.write_text(open(native.SOURCE).read() + "\n// edited\n")
    assert native._built_before(dict(arguments, sources=[str(edited)])) is None
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not a module")
    monkeypatch.setattr(native, "_built_before", lambda arguments: str(broken))
    assert hasattr(native._load(arguments), "conv_known") and len(started) == 1


def test_native_known_calls_skip_the_checks_and_only_those(monkeypatch):
    """A call whose tensors and arguments repeat an earlier recorded one goes straight to C++ (no
    argument checks: conv_geometry is not called again); any other argument, even one equal to an
    accepted one (True, 1.0 for 1), takes the full path: its checks raise, or it is a layer of its own."""
    from dwconv import functional

    monkeypatch.setenv("DWCONV_NATIVE", "1")
    checks = []
    real = functional.conv_geometry
    monkeypatch.setattr(functional, "conv_geometry", lambda *args: checks.append(args) or real(*args))
    x, weight = randn(2, 3, 7, 8).requires_grad_(), randn(3, 1, 3, 3)
    ref = {stride: torch.nn.functional.conv2d(x.double(), weight.double(), None, stride, 1, 1, 3) for stride in (1, 2)}
    for stride, padding, checked in [(1, 1, True), (1, 1, False), ((1, 1), (1, 1), True), ((1, 1), (1, 1), False),
                                     (2, 1, True), (2, 1, False), (1, 1, False)]:
        checks.clear()
        out = dwconv.depthwise_conv2d(x, weight, None, stride, padding)
        assert bool(checks) == checked, (stride, padding, checks)
        assert type(out.grad_fn).__name__ == "CppFunction"
        assert_close(out, ref[stride if isinstance(stride, int) else stride[0]], torch.float32, f"stride {stride}")
    for stride, padding in [(True, 1), (1, 1.0), (0, 1), ((1, 1.0), 1)]:
        with pytest.raises((TypeError, ValueError)) as raised:
            real(x, weight, None, stride, padding, 1)
        with pytest.raises(type(raised.value), match=str(raised.value)[:20]):
            dwconv.depthwise_conv2d(x, weight, None, stride, padding)


class _StorageLogging(torch.Tensor):
    """A subclass over real storage (so its layout is a plain tensor's) that dispatches in Python."""
    ops: list = []

    @staticmethod
    def __new__(cls, elem):
        tensor = torch.Tensor._make_subclass(cls, elem)
        tensor.elem = elem
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.ops.append(func)
        unwrap = lambda t: t.elem if isinstance(t, _StorageLogging) else t  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def test_known_calls_leave_python_dispatch_subclasses_to_their_dispatch(monkeypatch):
    """A tensor subclass that dispatches in Python, laid out as a call the C++ path knows, still reaches
    its __torch_dispatch__ (F.conv2d computes it), never the replayer's raw reads."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    x, weight = randn(1, 2, 5, 7), randn(2, 1, 3, 3)
    for _ in range(2):  # (recorded, then known)
        dwconv.depthwise_conv2d(x, weight, None, 1, 1)
    subclass = _StorageLogging(x.clone())
    _StorageLogging.ops.clear()
    out = dwconv.depthwise_conv2d(subclass, weight, None, 1, 1)
    assert torch.ops.aten.convolution.default in _StorageLogging.ops, _StorageLogging.ops
    assert_close(out, torch.nn.functional.conv2d(x.double(), weight.double(), None, 1, 1, 1, 2), torch.float32)


def test_known_calls_under_autocast_cast_as_conv2d(monkeypatch):
    """Under autocast a known call's casts are made in C++ by autocast's own function, as F.conv2d's:
    the same dtype and values, and the same cache (a float32 leaf weight is cast once in an autocast
    region: two calls share one cast node), with gradients reaching the float32 parameters."""
    from dwconv import functional

    monkeypatch.setenv("DWCONV_NATIVE", "1")
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    checks = []
    real = functional.conv_geometry
    monkeypatch.setattr(functional, "conv_geometry", lambda *args: checks.append(args) or real(*args))
    layer = dwconv.DepthwiseConv2d(3, 3, 3, padding=1).to(DEVICE)
    stock = torch.nn.Conv2d(3, 3, 3, padding=1, groups=3).to(DEVICE)
    stock.load_state_dict(layer.state_dict())
    x = randn(2, 3, 7, 8)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        layer(x)  # (recorded)
        checks.clear()
        outs, stock_outs = [layer(x) for _ in range(2)], [stock(x) for _ in range(2)]
    assert not checks, "the calls after the first took the full path"
    cast = lambda out: out.grad_fn.next_functions[1][0]  # noqa: E731  (the weight's cast)
    assert cast(stock_outs[0]) is cast(stock_outs[1]), "autocast's cache: one cast of the weight"
    assert cast(outs[0]) is cast(outs[1]), "dwconv's known calls cast the weight other than autocast does"
    ref = torch.nn.functional.conv2d(*(t.to(torch.bfloat16).double() for t in (x, stock.weight, stock.bias)),
                                     1, 1, 1, 3)
    for out in outs:
        assert out.dtype == torch.bfloat16 and type(out.grad_fn).__name__ == "CppFunction"
        assert_close(out, ref, torch.bfloat16)
    (2 * outs[0].float().sum() + outs[1].float().sum()).backward()
    (2 * stock_outs[0].float().sum() + stock_outs[1].float().sum()).backward()
    weight, bias = (t.detach().to(torch.bfloat16).double().requires_grad_() for t in (stock.weight, stock.bias))
    (3 * torch.nn.functional.conv2d(x.to(torch.bfloat16).double(), weight, bias, 1, 1, 1, 3).sum()).backward()
    for name, ref_grad in (("weight", weight.grad), ("bias", bias.grad)):
        grad, stock_grad = getattr(layer, name).grad, getattr(stock, name).grad
        assert grad.dtype == stock_grad.dtype == torch.float32
        assert_close(stock_grad, ref_grad, torch.bfloat16, f"stock's {name} gradient")
        assert_close(grad, ref_grad, torch.bfloat16, f"{name} gradient")


def test_known_calls_under_autocast_leave_subclasses_uncast(monkeypatch):
    """A tensor subclass that dispatches in Python is refused by the C++ lookup before any cast: its
    __torch_dispatch__ sees autocast's cast once (the full path's), as under F.conv2d."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    x, weight = randn(1, 2, 5, 7), randn(2, 1, 3, 3)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        for _ in range(2):  # (recorded, then known)
            dwconv.depthwise_conv2d(x, weight, None, 1, 1)
        subclass = _StorageLogging(x.clone())
        _StorageLogging.ops.clear()
        out = dwconv.depthwise_conv2d(subclass, weight, None, 1, 1)
    casts = [op for op in _StorageLogging.ops if op is torch.ops.aten._to_copy.default]
    assert len(casts) == 1, _StorageLogging.ops
    assert out.dtype == torch.bfloat16


def test_registered_ops_served_from_cpp(monkeypatch):
    """Once the replayer serves the registered ops (torch.compile's graphs call them), a call of tensors
    and arguments seen before replays its recorded program: the same values as the ops' Python, every
    op and output kind (a tensor, a list, a pair); bad arguments still raise the checks' own error;
    a differentiable call keeps the ops' Python autograd kernel; forget_layers gives every call back
    to Python. The activated forward's activation is part of a call's key."""
    from dwconv import replay
    from dwconv._library import conv_arguments

    device_key = "CUDA" if DEVICE == "cuda" else "CPU"
    x = randn(2, 3, 7, 9).contiguous(memory_format=torch.channels_last)
    weight, bias = randn(3, 1, 3, 3), randn(3)
    args = conv_arguments(conv_geometry(x, weight, bias, 1, 1, 1))
    ops = torch.ops.dwconv
    calls = [(ops.conv2d.default, (x, weight, bias)), (ops.conv2d.default, (x, weight, None))]
    grad_out = randn(2, 3, 7, 9).contiguous(memory_format=torch.channels_last)
    calls += [(ops.conv2d_grad_input.default, (grad_out, x, weight)),
              (ops.conv2d_grad_weight.default, (grad_out, x, weight)),
              (ops.conv2d_grad_input_weight.default, (grad_out, x, weight))]
    # (the activated forward: the same tensors with two activations, two programs)
    calls += [(ops.conv2d_activated.default, (x, weight, bias, 2)), (ops.conv2d_activated.default, (x, weight, bias, 3))]

    def run(op, tensors):
        extra = (True,) if op is ops.conv2d_grad_weight.default else ()
        if op is ops.conv2d_activated.default:
            tensors, extra = tensors[:3], tensors[3:]
        out = op(*tensors, *args, *extra)
        return [out] if isinstance(out, torch.Tensor) else list(out)

    monkeypatch.setenv("DWCONV_NATIVE", "0")
    python = [run(op, tensors) for op, tensors in calls]
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("dwconv::conv2d", device_key)
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    for turn in range(3):  # (the first call serves the ops, the next calls record, then replays)
        for (op, tensors), want in zip(calls, python):
            assert_same(run(op, tensors), want, f"{op} turn {turn}")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dwconv::conv2d", device_key)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dwconv::conv2d", "Autograd" + device_key)
    assert native.extension().served_programs() == len(calls)
    import threading  # (a thread that never touched CUDA replays a program recorded on this one)

    got = []
    thread = threading.Thread(target=lambda: got.append(run(*calls[4])))
    thread.start()
    thread.join()
    assert got and len(got[0]) == 2, "the call from a fresh thread raised"
    assert_same(got[0], python[4], "a call from a fresh thread")
    leaf = x.detach().requires_grad_()
    out = ops.conv2d.default(leaf, weight, bias, *args)  # (differentiable: the Python autograd kernel's)
    (grad,) = torch.autograd.grad(out, leaf, grad_out)
    assert_same([out, grad], python[0] + python[2], "a differentiable call and its gradient")
    assert_close(python[0][0], torch.nn.functional.conv2d(x.double(), weight.double(), bias.double(), 1, 1, 1, 3),
                 torch.float32, "served output")
    with pytest.raises(ValueError, match="stride"):
        ops.conv2d.default(x, weight, bias, [0, 1], *args[1:])
    replay.forget_layers()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("dwconv::conv2d", device_key)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("dwconv::conv2d", "Autograd" + device_key)
    monkeypatch.setenv("DWCONV_NATIVE", "0")
    assert_same(run(*calls[0]), python[0], "Python path again")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("dwconv::conv2d", device_key)


COMPILE_SETTINGS = {"fullgraph": dict(fullgraph=True), "dynamic batch": dict(fullgraph=True, dynamic=True),
                    "reduce-overhead": dict(mode="reduce-overhead"),
                    "max-autotune-no-cudagraphs": dict(fullgraph=True, mode="max-autotune-no-cudagraphs")}


@pytest.mark.parametrize("setting", COMPILE_SETTINGS)
def test_compiled_graph_calls_served_ops(monkeypatch, setting):
    """torch.compile's graph of a converted layer, forward and backward, calls the ops the replayer
    serves: the values and gradients of eager dwconv's, with a static batch, a dynamic one (each
    batch size its own recorded programs), under CUDA graphs and max-autotune (GPU only)."""
    import copy

    if setting.startswith(("reduce-overhead", "max-autotune")) and DEVICE != "cuda":
        pytest.skip("Inductor's GPU modes (the CPU runs aot_eager)")
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    layer = dwconv.DepthwiseConv2d(4, 4, 3, padding=1).to(DEVICE)
    compiled = torch.compile(copy.deepcopy(layer), backend=backend, **COMPILE_SETTINGS[setting])
    batches = (2, 3, 2, 3, 5) if setting == "dynamic batch" else (2, 2, 2, 2)
    programs, served_batches = [], set()  # (served programs after each turn; batches called once served)
    for turn, batch in enumerate(batches):
        x = randn(batch, 4, 9, 11).contiguous(memory_format=torch.channels_last)
        results = []
        for module in (layer, compiled):
            leaf = x.detach().requires_grad_()
            out = module(leaf)
            results.append((out.clone(), *torch.autograd.grad(out.square().sum(), (leaf, *module.parameters()))))
        for name, got, want in zip(("output", "grad_input", "grad_weight", "grad_bias"), results[1], results[0]):
            assert_close(got, want.double(), torch.float32, f"compiled {name}, turn {turn}, batch {batch}")
        programs.append(native.extension().served_programs())
        if batch in served_batches:  # (a compiled call seen before replays: nothing recorded again)
            assert programs[-1] == programs[-2], f"turn {turn}, batch {batch}: calls seen before recorded again"
        if turn:  # (turn 0 starts serving mid-graph: its calls may be recorded at the next turn)
            served_batches.add(batch)
    assert programs[-1] >= 2 * len(set(batches))  # (a forward and a backward op a batch)


@pytest.mark.parametrize("recordable", [True, False], ids=["recorded", "not-recordable"])
def test_served_op_that_updates_its_inputs_updates_them_once(monkeypatch, recordable):
    """An op that updates inputs in place (batch_norm_statistics: the running statistics), served
    from C++: recorded on copies of them and its program then run on them, or, where it cannot be
    recorded, run once in Python. Each call moves the running statistics by one update, as
    F.batch_norm's, and returns the batch's statistics."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    if not recordable:
        def refused(*args, **kwargs):
            raise program.NotRecordable("refused for the test")

        monkeypatch.setattr(native, "NativeProgram", refused)
    y = (2 * randn(3, 5, 4, 6) + 1).contiguous(memory_format=torch.channels_last)
    running_mean, running_var = randn(5), randn(5).abs() + 0.5
    ref_mean, ref_var = running_mean.double().cpu(), running_var.double().cpu()
    exact = y.double().cpu()
    for call in range(3):  # (the first call starts serving; the second is recorded; the third replays)
        mean, invstd = torch.ops.dwconv.batch_norm_statistics(y, running_mean, running_var, 0.1, 1e-5)
        torch.nn.functional.batch_norm(exact, ref_mean, ref_var, None, None, True, 0.1, 1e-5)
        assert_close(mean, exact.mean((0, 2, 3)), torch.float32, f"mean, call {call}")
        exact_invstd = (exact.var((0, 2, 3), unbiased=False) + 1e-5).rsqrt()
        assert_close(invstd, exact_invstd, torch.float32, f"invstd, call {call}")
        assert_close(running_mean, ref_mean, torch.float32, f"running mean after call {call}")
        assert_close(running_var, ref_var, torch.float32, f"running variance after call {call}")
    assert native.extension().served_programs() == (1 if recordable else 0)


def test_native_activated_calls_are_layers_of_their_own(monkeypatch):
    """An activated call (no gradient wanted) is recorded and then known to the C++ path like any
    other, under its activation: the same tensors with another activation, or none, are other
    layers (never one's program for the other's); a call that wants a gradient takes the plain
    layer and PyTorch's activation."""
    from dwconv import functional

    monkeypatch.setenv("DWCONV_NATIVE", "1")
    checks = []
    real = functional.conv_geometry
    monkeypatch.setattr(functional, "conv_geometry", lambda *args: checks.append(args) or real(*args))
    x, weight, bias = 3 * randn(2, 3, 7, 8), randn(3, 1, 3, 3), randn(3)
    plain = torch.nn.functional.conv2d(x.double(), weight.double(), bias.double(), 1, 1, 1, 3)
    functions = {None: lambda t: t, "relu6": torch.nn.functional.relu6, "silu": torch.nn.functional.silu}
    with torch.no_grad():
        for turn in range(3):
            for activation, fn in functions.items():
                checks.clear()
                out = dwconv.depthwise_conv2d(x, weight, bias, 1, 1, 1, activation)
                assert_close(out, fn(plain), torch.float32, f"{activation}, turn {turn}")
                assert bool(checks) == (turn == 0), (activation, turn)  # (known from the second call on)
    leaf = x.clone().requires_grad_()
    out = dwconv.depthwise_conv2d(leaf, weight, bias, 1, 1, 1, "silu")
    (grad,) = torch.autograd.grad(out.sum(), leaf)
    leaf64 = x.double().requires_grad_()
    (ref,) = torch.autograd.grad(functions["silu"](torch.nn.functional.conv2d(leaf64, weight.double(), bias.double(),
                                                                              1, 1, 1, 3)).sum(), leaf64)
    assert_close(grad, ref, torch.float32, "gradient through an activated call")


def test_native_launch_passes_float_scalars_as_their_bits():
    """A kernel's float scalar (BatchNorm's eps, momentum) reaches cuLaunchKernel as its fp32 or fp64
    bit pattern, an integer as itself; a parameter type it cannot pass is not recordable (a float
    once went as int(value): eps 1e-5 launched as 0, the momentum as 0)."""
    import struct

    code, bits = native._scalar_parameter("fp32", 1e-5)
    assert code == "i" and struct.unpack("<f", struct.pack("<i", bits))[0] == struct.unpack("<f", struct.pack("<f", 1e-5))[0]
    code, bits = native._scalar_parameter("fp64", 0.1)
    assert code == "l" and struct.unpack("<d", struct.pack("<q", bits))[0] == 0.1
    assert native._scalar_parameter("i32", -7) == ("i", -7) and native._scalar_parameter("u64", 2**40) == ("l", 2**40)
    for kind in ("fp16", "bf16", "i1"):
        with pytest.raises(program.NotRecordable, match=kind):
            native._scalar_parameter(kind, 1)
