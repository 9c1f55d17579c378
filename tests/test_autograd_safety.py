"""The eager path under PyTorch's other features, on both doors (the Python autograd Function,
DWCONV_NATIVE=0, and the C++ replayer, DWCONV_NATIVE=1): saved-tensor hooks, activation
checkpointing, double backward,
forward-mode AD, torch.func, negative-bit views, threads meeting new layers at once, the bounded
layer registry, the replayer's build, the environment switches. Each result against float64
F.conv2d, or a clear error.
"""

import copy
import os
import threading
import time
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import dwconv
from dwconv import _env, tuning
from dwconv.replay import native, program
from helpers import DEVICE, assert_close, randn, reversed_strides

PATHS = {"python": "0", "native": "1"}
GPU = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    monkeypatch.setenv("DWCONV_NATIVE", PATHS[request.param])
    return request.param


def grad_fn_name(path):
    return "CppFunction" if path == "native" else "DepthwiseConv2dFunctionBackward"


def reference_grads(tensors, grad_out, **options):
    """F.conv2d in float64: output and the gradients of every tensor."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in tensors]
    out = F.conv2d(*leaves, groups=tensors[0].shape[1], **options)
    grads = torch.autograd.grad(out, [t for t in leaves if t is not None], grad_out.double())
    return out, grads


def leaves_of(tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


# ---- saved-tensor hooks ---------------------------------------------------------------------------

def _misaligned_copy(t):
    """t's values at t's strides, one element into a fresh buffer (16-byte alignment lost)."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return storage[1:].as_strided(t.shape, t.stride()).copy_(t)


HOOKS = {
    # what activation-offloading wrappers unpack: NCHW-contiguous copies
    "contiguous": (lambda t: t, lambda t: t.contiguous()),
    "misaligned": (_misaligned_copy, lambda t: t),
    "save_on_cpu": None,
}


@pytest.mark.parametrize("hook", list(HOOKS))
def test_saved_tensor_hooks(path, hook):
    """Two calls of one channels_last layer, the second under a saved-tensor hook that hands the
    saved input back in another layout or offset: the second backward is recorded (or taken) for
    the tensors it reads. (Before: the C++ path replayed the first backward on them, grad_weight
    relative error 1.3-32.)"""
    x, weight = randn(2, 4, 7, 8).contiguous(memory_format=torch.channels_last), randn(4, 1, 3, 3)
    grad_out = randn(2, 4, 7, 8).contiguous(memory_format=torch.channels_last)
    ref, ref_grads = reference_grads([x, weight], grad_out, padding=1)
    first = leaves_of([x, weight])
    dwconv.depthwise_conv2d(*first, None, 1, 1).backward(grad_out)
    if hook == "save_on_cpu":
        context = torch.autograd.graph.save_on_cpu(pin_memory=DEVICE == "cuda")
    else:
        context = torch.autograd.graph.saved_tensors_hooks(*HOOKS[hook])
    leaves = leaves_of([x, weight])
    with context:
        out = dwconv.depthwise_conv2d(*leaves, None, 1, 1)
    assert type(out.grad_fn).__name__ == grad_fn_name(path)
    out.backward(grad_out)
    for name, got, want in [("first grad_input", first[0].grad, ref_grads[0]),
                            ("first grad_weight", first[1].grad, ref_grads[1]),
                            ("grad_input", leaves[0].grad, ref_grads[0]),
                            ("grad_weight", leaves[1].grad, ref_grads[1])]:
        assert_close(got, want, torch.float32, f"{hook}: {name}")


@pytest.mark.parametrize("hook", ["contiguous", "misaligned", "reversed-strides"])
def test_saved_tensor_hooks_on_a_trained_fused_block(path, hook):
    """A fused block in training (the depthwise layer, its BatchNorm and ReLU6 on dwconv's kernels,
    then a 1x1 convolution and a BatchNorm of stock's layers trained on dwconv's) under a hook that
    hands each saved tensor back in another layout or offset: the input's and every parameter's
    gradient against float64 stock's. (Before: a saved y in neither layout the BatchNorm kernels
    read gave gradients off by 4 relative, with no error.)"""
    from torch import nn

    stock = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False), nn.BatchNorm2d(6), nn.ReLU6(),
                          nn.Conv2d(6, 5, 1, bias=False), nn.BatchNorm2d(5)).to(DEVICE).train()
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    x = randn(2, 6, 7, 5).contiguous(memory_format=torch.channels_last)
    grad = randn(2, 5, 7, 5)
    x64 = x.double().requires_grad_()
    reference = stock.double()
    expected = torch.autograd.grad(reference(x64), [x64, *reference.parameters()], grad.double())
    unpack = reversed_strides if hook == "reversed-strides" else HOOKS[hook][1]
    pack = HOOKS[hook][0] if hook == "misaligned" else (lambda t: t)
    leaf = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fused(leaf)
    got = torch.autograd.grad(out, [leaf, *fused.parameters()], grad)
    names = ["input"] + [name for name, _ in fused.named_parameters()]
    for name, g, e in zip(names, got, expected):
        assert_close(g, e, torch.float32, f"{hook}: grad of {name}")


# ---- activation checkpointing ----------------------------------------------------------------------

@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing(path, reentrant):
    """A block of depthwise layers under torch.utils.checkpoint (large-kernel nets and timm's
    ConvNeXt train this way): the forward runs again inside the backward (reentrant: under its own
    backward; non-reentrant: through saved-tensor hooks), a layer's second call in a step. Outputs
    and every gradient against the same block of nn.Conv2d in float64."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    stock = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1, groups=4), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU(), torch.nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=4)).to(DEVICE)
    block = dwconv.convert(stock, verbose=False).float()
    stock = stock.double()
    x = randn(2, 4, 9, 11).contiguous(memory_format=torch.channels_last)
    grad_out = randn(2, 8, 5, 6)
    want_x = x.double().requires_grad_()
    want = stock(want_x)
    want.backward(grad_out.double())
    for step in range(2):  # (the second step: every layer's calls recorded or known)
        block.zero_grad()
        leaf = x.clone().requires_grad_()
        out = checkpoint(block, leaf, use_reentrant=reentrant)
        out.backward(grad_out)
        assert_close(out, want, torch.float32, f"step {step}: output")
        assert_close(leaf.grad, want_x.grad, torch.float32, f"step {step}: grad_input")
        for (name, got), reference in zip(block.named_parameters(), stock.parameters()):
            assert_close(got.grad, reference.grad, torch.float32, f"step {step}: {name} gradient")


# ---- compiled autograd -----------------------------------------------------------------------------

def test_compiled_autograd(path, monkeypatch):
    """A fused model's training steps under compiled autograd (torch._dynamo.compiled_autograd, as
    torch._dynamo.config.compiled_autograd turns it on inside a compiled step), which traces the
    backward with fake tensors: the forward takes the registered ops, whose backward it can trace
    (before: "unhashable type: 'Capsule'" from the C++ nodes, a fake-tensor error from the Python
    Function). Every gradient and the running statistics against float64 stock, two steps (the
    second: each call known to the C++ path)."""
    from torch import nn
    from torch._dynamo import compiled_autograd

    from test_squeeze_excite import SqueezeExcitation

    # (the 1x1 convolutions are cuDNN's: in TF32 by torch's default on the GPU, 1e-3 off float64's)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    stock = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False), nn.BatchNorm2d(6), nn.SiLU(),
                          SqueezeExcitation(6, 4, nn.SiLU), nn.Conv2d(6, 5, 1, bias=False),
                          nn.BatchNorm2d(5)).to(DEVICE).train()
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    reference = stock.double()
    names = ["input"] + [name for name, _ in fused.named_parameters()]
    for step in range(2):
        x = randn(2, 6, 7, 5).contiguous(memory_format=torch.channels_last)
        grad = randn(2, 5, 7, 5)
        x64 = x.double().requires_grad_()
        expected = torch.autograd.grad(reference(x64), [x64, *reference.parameters()], grad.double())
        leaf = x.clone().requires_grad_()
        with compiled_autograd._enable(torch.compile(backend="eager")):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                out = fused(leaf)
            got = torch.autograd.grad(out, [leaf, *fused.parameters()], grad)
        assert any(e.key == "dwconv::conv2d" for e in profile.key_averages()), "the registered op"
        for name, g, e in zip(names, got, expected):
            assert_close(g, e, torch.float32, f"step {step}: grad of {name}")
    for (name, buffer), want in zip(fused.named_buffers(), reference.buffers()):
        if buffer.is_floating_point():
            assert_close(buffer, want, torch.float32, name)
        else:
            assert torch.equal(buffer, want), name


# ---- double backward -------------------------------------------------------------------------------

DOUBLE_CASES = [  # (shape, kernel, multiplier, stride, padding, dilation, channels_last)
    ((2, 3, 6, 7), 3, 1, 1, 1, 1, False),
    ((1, 2, 7, 6), 3, 2, 2, 1, 1, True),
]


@pytest.mark.parametrize("case", DOUBLE_CASES, ids=["k3", "multiplier2-stride2-channels_last"])
def test_gradient_penalty(path, case):
    """A gradient penalty (WGAN-GP, R1): the gradients of a loss on the first-order gradients, taken
    with create_graph=True, against F.conv2d's. (Before: the second-order terms through dwconv were
    dropped or raised.)"""
    shape, kernel, multiplier, stride, padding, dilation, channels_last = case
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    x = randn(*shape).contiguous(memory_format=memory_format)
    tensors = [x, randn(shape[1] * multiplier, 1, kernel, kernel), randn(shape[1] * multiplier)]
    options = dict(stride=stride, padding=padding, dilation=dilation)

    def penalty(conv, leaves):
        out = conv(*leaves)
        grads = torch.autograd.grad((out.tanh() * out).sum(), leaves, create_graph=True)
        return out.square().mean() + sum(g.square().sum() for g in grads)

    ref_leaves = [t.double().requires_grad_() for t in tensors]
    ref = torch.autograd.grad(penalty(lambda *t: F.conv2d(*t, groups=shape[1], **options), ref_leaves), ref_leaves)
    leaves = leaves_of(tensors)
    got = torch.autograd.grad(penalty(lambda *t: dwconv.depthwise_conv2d(*t, **options), leaves), leaves)
    for name, g, want in zip(["input", "weight", "bias"], got, ref):
        scale = want.abs().max()
        assert_close(g.double() / scale, want / scale, torch.float32, f"penalty gradient of {name}")


def test_gradgradcheck_float64():
    """Numerical second derivatives in float64, stride 2 and a multiplier of 2 (the C++ path hands
    create_graph backwards to this same Python one: test_gradient_penalty)."""
    x = torch.randn(1, 2, 4, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    weight = torch.randn(4, 1, 3, 2, dtype=torch.float64, device=DEVICE, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, device=DEVICE, requires_grad=True)

    def fn(x, weight, bias):
        return dwconv.depthwise_conv2d(x, weight, bias, 2, 1)

    assert torch.autograd.gradgradcheck(fn, (x, weight, bias), fast_mode=True)


def test_double_backward_of_the_registered_ops():
    """torch.ops.dwconv's backward ops have their own backward: a gradient penalty through them."""
    from dwconv._library import conv_arguments
    from dwconv._geometry import conv_geometry

    x, weight = randn(1, 3, 6, 7), randn(3, 1, 3, 3)
    arguments = conv_arguments(conv_geometry(x, weight, None, 1, 1, 1))
    leaves = leaves_of([x, weight])
    out = torch.ops.dwconv.conv2d(*leaves, None, *arguments)
    grads = torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
    got = torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (x, weight)]
    ref_out = F.conv2d(*ref_leaves, padding=1, groups=3)
    ref_grads = torch.autograd.grad(ref_out.square().sum(), ref_leaves, create_graph=True)
    ref = torch.autograd.grad(sum(g.square().sum() for g in ref_grads), ref_leaves)
    for name, g, want in zip(["input", "weight"], got, ref):
        scale = want.abs().max()
        assert_close(g.double() / scale, want / scale, torch.float32, f"penalty gradient of {name}")


# ---- forward AD, torch.func, layouts PyTorch has and dwconv's kernels do not --------------------

def test_forward_ad(path):
    """torch.autograd.forward_ad: the output's tangent (before: None on the Python path, an error on
    the C++ one)."""
    tensors = [randn(2, 3, 6, 7), randn(3, 1, 3, 3), randn(3)]
    tangents = [randn(*t.shape) for t in tensors]
    with fwAD.dual_level():
        out = dwconv.depthwise_conv2d(*(fwAD.make_dual(t, d) for t, d in zip(tensors, tangents)), padding=1)
        tangent = fwAD.unpack_dual(out).tangent
    with fwAD.dual_level():
        ref = F.conv2d(*(fwAD.make_dual(t.double(), d.double()) for t, d in zip(tensors, tangents)), padding=1,
                       groups=3)
        ref_tangent = fwAD.unpack_dual(ref).tangent
    assert tangent is not None, "no tangent"
    assert_close(fwAD.unpack_dual(out).primal, fwAD.unpack_dual(ref).primal, torch.float32, "primal")
    assert_close(tangent, ref_tangent, torch.float32, "tangent")


def test_torch_func_transforms(path):
    """torch.func's grad, vmap and jacrev (before: 'Cannot access data pointer of Tensor that doesn't
    have storage'): F.conv2d's results."""
    x, weight = randn(2, 3, 5, 6), randn(3, 1, 3, 3)

    def loss(w, x):
        return dwconv.depthwise_conv2d(x, w, None, 1, 1).square().sum()

    def ref_loss(w, x):
        return F.conv2d(x, w, None, 1, 1, 1, 3).square().sum()

    assert_close(torch.func.grad(loss)(weight, x), torch.func.grad(ref_loss)(weight.double(), x.double()),
                 torch.float32, "torch.func.grad")
    batched = randn(4, 2, 3, 5, 6)
    assert_close(torch.func.vmap(lambda x: dwconv.depthwise_conv2d(x, weight, None, 1, 1))(batched),
                 torch.func.vmap(lambda x: F.conv2d(x, weight.double(), None, 1, 1, 1, 3))(batched.double()),
                 torch.float32, "torch.func.vmap")
    small, point = randn(1, 2, 3, 3), randn(2, 1, 2, 2)
    assert_close(torch.func.jacrev(lambda w: dwconv.depthwise_conv2d(small, w, None, 1, 1))(point),
                 torch.func.jacrev(lambda w: F.conv2d(small.double(), w, None, 1, 1, 1, 2))(point.double()),
                 torch.float32, "torch.func.jacrev")


def test_sparse_input_is_refused():
    x = randn(1, 2, 4, 4).to_sparse()
    with pytest.raises(TypeError, match="input must be a dense"):
        dwconv.depthwise_conv2d(x, randn(2, 1, 3, 3))


def test_negative_bit_views(path):
    """torch._neg_view tensors (input, weight, bias, and grad_out) read as their values: before, the
    kernels read their raw memory (output = -F.conv2d). A plain tensor of the same layout after a
    negative view is not taken for it."""
    x, weight, bias = randn(2, 3, 6, 7), randn(3, 1, 3, 3), randn(3)
    grad_out = randn(2, 3, 6, 7)
    negated = [torch._neg_view(t) for t in (x, weight, bias)]
    assert all(t.is_neg() for t in negated)
    ref, ref_grads = reference_grads([-x, -weight, -bias], -grad_out, padding=1)
    for call in range(2):
        leaves = [torch._neg_view(t.detach().clone().requires_grad_()) for t in (x, weight, bias)]
        out = dwconv.depthwise_conv2d(*leaves, padding=1)
        assert_close(out, ref, torch.float32, f"call {call}: output")
        grads = torch.autograd.grad(out, leaves, torch._neg_view(grad_out))
        for name, got, want in zip(["input", "weight", "bias"], grads, ref_grads):
            assert_close(got, want, torch.float32, f"call {call}: grad of {name}")
    plain = dwconv.depthwise_conv2d(x, weight, bias, padding=1)
    assert_close(plain, F.conv2d(x.double(), weight.double(), bias.double(), padding=1, groups=3), torch.float32,
                 "plain tensors after negative views")


# ---- threads --------------------------------------------------------------------------------------

def test_concurrent_first_calls(monkeypatch):
    """Threads meeting new layers at once (DataParallel's replicas, a serving pool): each records
    its own passes. Before, the one process-wide recorder raised 'already recording' / 'made before
    recording' and pinned layers to the Python path for good."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    errors, results = [], {}
    shapes = [(1, 2 + i % 3, 5 + i, 6 + i % 2) for i in range(4)]
    start = threading.Barrier(len(shapes))

    def work(i, shape):
        try:
            gen = torch.Generator().manual_seed(i)
            x = randn(*shape, generator=gen)
            weight, grad_out = randn(shape[1], 1, 3, 3, generator=gen), randn(*shape, generator=gen)
            start.wait()
            for _ in range(2):
                leaves = leaves_of([x, weight])
                out = dwconv.depthwise_conv2d(*leaves, None, 1, 1)
                out.backward(grad_out)
                results.setdefault(i, []).append((type(out.grad_fn).__name__, out, leaves[0].grad,
                                                  leaves[1].grad, (x, weight, grad_out)))
        except Exception as error:  # (reported below, with its thread)
            errors.append((i, repr(error)))

    threads = [threading.Thread(target=work, args=(i, s)) for i, s in enumerate(shapes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, runs in results.items():
        for name, out, grad_input, grad_weight, (x, weight, grad_out) in runs:
            assert name == "CppFunction", f"thread {i}: a layer left on the Python path ({name})"
            ref, (ref_gi, ref_gw) = reference_grads([x, weight], grad_out, padding=1)
            assert_close(out, ref, torch.float32, f"thread {i}: output")
            assert_close(grad_input, ref_gi, torch.float32, f"thread {i}: grad_input")
            assert_close(grad_weight, ref_gw, torch.float32, f"thread {i}: grad_weight")
    assert all(number is not None for number, *_ in native._LAYERS.values())


def test_backward_that_cannot_be_recorded_falls_back(monkeypatch):
    """A backward the recorder refuses runs the Python backward from C++ (before: the error escaped
    from loss.backward())."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    real_record = program.record
    calls = []

    def refuse_backward(fn, inputs, *args):
        calls.append(len(inputs))
        if len(calls) > 1:  # (the forward is the first recording)
            raise program.NotRecordable("refused for the test")
        return real_record(fn, inputs, *args)

    monkeypatch.setattr(native, "record", refuse_backward)
    x, weight, grad_out = randn(1, 3, 6, 5), randn(3, 1, 3, 3), randn(1, 3, 6, 5)
    ref, ref_grads = reference_grads([x, weight], grad_out, padding=1)
    for _ in range(2):
        leaves = leaves_of([x, weight])
        out = dwconv.depthwise_conv2d(*leaves, None, 1, 1)
        assert type(out.grad_fn).__name__ == "CppFunction"
        out.backward(grad_out)
        assert_close(leaves[0].grad, ref_grads[0], torch.float32, "grad_input")
        assert_close(leaves[1].grad, ref_grads[1], torch.float32, "grad_weight")
    assert len(calls) == 2, "a refused backward is asked for once, then kept on the Python path"


# ---- the layer registry ---------------------------------------------------------------------------

def test_layer_registry_is_bounded(retune, monkeypatch):
    """Many input sizes: the recorded layers stay at replay_layer_capacity here and in C++ (before: the C++
    registry grew by every size, +57.6 MB after 4000), least recently used out first, and a graph
    recorded before its layer's eviction still runs its backward."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    retune(replay_layer_capacity=3)
    weight = randn(2, 1, 3, 3)
    kept = leaves_of([randn(1, 2, 4, 4), weight])
    kept_out = dwconv.depthwise_conv2d(*kept, None, 1, 1)
    hot = randn(1, 2, 5, 5)
    for width in range(6, 12):
        dwconv.depthwise_conv2d(randn(1, 2, 4, width), weight, None, 1, 1)
        dwconv.depthwise_conv2d(hot, weight, None, 1, 1)  # (used every time: never evicted)
    assert len(native._LAYERS) == 3 and native.extension().layer_count() == 3
    live = {number for number, *_ in native._LAYERS.values()}
    assert all(number in live for _, number in native._KNOWN.values()), "a known call names an evicted layer"
    assert any(geom.in_w == 5 for (_, geom, _) in native._LAYERS)
    grad_out = randn(*kept_out.shape)
    kept_out.backward(grad_out)
    _, ref_grads = reference_grads([kept[0], weight], grad_out, padding=1)
    assert_close(kept[0].grad, ref_grads[0], torch.float32, "grad_input after the layer's eviction")


# ---- the replayer's build -------------------------------------------------------------------------

# torch's build protocol without a compiler: the lock it takes (torch.utils.file_baton), a module written
FAKE_BUILD = """
import json, os, sys
from torch.utils.file_baton import FileBaton
arguments = json.loads(sys.argv[1])
baton = FileBaton(os.path.join(arguments["build_directory"], "lock"))
if baton.try_acquire():
    path = os.path.join(arguments["build_directory"], arguments["name"] + ".py")
    open(path, "w").write("BUILT = True")
    baton.release()
else:
    baton.wait()
print(path)
"""


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_BUILD_SCRIPT", FAKE_BUILD)
    monkeypatch.setattr(native, "_build_arguments", lambda cuda: dict(name="fake", build_directory=str(tmp_path)))
    monkeypatch.setattr(native, "_MODULES", {})
    monkeypatch.setattr(native, "_FAILURES", {})
    monkeypatch.setattr(native, "_DEFAULT_MODULE", [])
    return tmp_path / "lock"


def test_build_removes_a_stale_lock(fake_build):
    """A lock left by a killed build (older than the build timeout) is removed, with a warning;
    before, every later build waited on it forever."""
    fake_build.write_text("")
    old = time.time() - 2 * tuning.tuned().replay_build_timeout_s
    os.utime(fake_build, (old, old))
    with pytest.warns(RuntimeWarning, match="removed the C\\+\\+ replayer's build lock"):
        module = native.extension(False)
    assert module.BUILT and not fake_build.exists()


def test_build_never_waits_past_its_timeout(retune, fake_build):
    """A lock held by a live build: the build gives up after replay_build_timeout_s, and the caller gets the
    same error each time, not a hang."""
    retune(replay_build_timeout_s=4.0)
    fake_build.write_text("")
    started = time.time()
    with pytest.raises(native.BuildFailed, match="took more than 4 s"):
        native.extension(False)
    assert time.time() - started < 60
    with pytest.raises(native.BuildFailed, match="took more than 4 s"):
        native.extension(False)
    assert fake_build.exists(), "another process's live lock is left alone"


def test_forced_native_without_a_build_warns_once(fake_build, monkeypatch):
    """DWCONV_NATIVE=1 where the replayer cannot be built: one warning, the Python path, right
    values (before: a different error on each call)."""
    monkeypatch.setattr(native, "_BUILD_SCRIPT", "import sys; sys.exit('no compiler here')")
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    path_before = os.environ.get("PATH")
    x, weight = randn(1, 2, 5, 6), randn(2, 1, 3, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [dwconv.depthwise_conv2d(x.requires_grad_(), weight, None, 1, 1) for _ in range(3)]
    messages = [str(w.message) for w in caught if "could not be built" in str(w.message)]
    assert len(messages) == 1 and "no compiler here" in messages[0], messages
    for out in outs:
        assert type(out.grad_fn).__name__ == "DepthwiseConv2dFunctionBackward"
        assert_close(out, F.conv2d(x.double(), weight.double(), None, 1, 1, 1, 2), torch.float32)
    assert os.environ.get("PATH") == path_before, "the build changed the process's PATH"


# ---- environment switches -------------------------------------------------------------------------

@pytest.mark.parametrize("value,expected", [("0", False), ("false", False), ("Off", False), ("no", False),
                                            ("1", True), ("TRUE", True), ("on", True), (" yes ", True),
                                            ("", None), (None, None)])
def test_switches_parse_one_way(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("DWCONV_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("DWCONV_TEST_SWITCH", value)
    assert _env.switch("DWCONV_TEST_SWITCH") is expected


def test_a_switch_that_is_not_one_raises(monkeypatch):
    monkeypatch.setenv("DWCONV_NATIVE", "fasle")
    with pytest.raises(ValueError, match="DWCONV_NATIVE='fasle' is not a switch"):
        dwconv.depthwise_conv2d(randn(1, 2, 5, 6), randn(2, 1, 3, 3))


@pytest.mark.parametrize("value", ["false", "off", "no"])
def test_native_off_spelled_any_way(monkeypatch, value):
    """Before, only DWCONV_NATIVE=0 turned the C++ path off."""
    monkeypatch.setenv("DWCONV_NATIVE", value)
    out = dwconv.depthwise_conv2d(randn(1, 2, 5, 6).requires_grad_(), randn(2, 1, 3, 3), None, 1, 1)
    assert type(out.grad_fn).__name__ == "DepthwiseConv2dFunctionBackward"


@pytest.mark.parametrize("value,expected", [("yes", True), ("true", True), ("off", False)])
def test_fast_launch_switch(value, expected):
    """DWCONV_FAST_LAUNCH, read once at import (a fresh process): before, 'true' and 'yes' turned it off."""
    import subprocess
    import sys

    env = dict(os.environ, DWCONV_FAST_LAUNCH=value)
    shown = subprocess.run([sys.executable, "-c", "from dwconv.tuning import tuned; print(tuned().fast_launch)"],
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert shown == str(expected)


# ---- on the GPU: alignment and streams -------------------------------------------------------------

@GPU
@pytest.mark.parametrize("hook", ["save_on_cpu", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_tensor_hooks_at_model_sizes(monkeypatch, hook, dtype):
    """The ConvNeXt stage that showed the wrong gradient: two channels_last 7x7 blocks of one shape,
    the second under activation offloading (pinned, non-blocking copies) or a misaligned unpack,
    through the C++ path: kernels compiled for 16-byte alignment are not replayed on a misaligned view."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    x = randn(8, 96, 28, 28, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = randn(96, 1, 7, 7, dtype=dtype) / 7
    grad_out = randn(8, 96, 28, 28, dtype=dtype).contiguous(memory_format=torch.channels_last)
    _, ref_grads = reference_grads([x, weight], grad_out, padding=3)
    for step in range(3):
        context = (torch.autograd.graph.save_on_cpu(pin_memory=True) if hook == "save_on_cpu"
                   else torch.autograd.graph.saved_tensors_hooks(*HOOKS[hook]))
        first, second = leaves_of([x, weight]), leaves_of([x, weight])
        dwconv.depthwise_conv2d(*first, None, 1, 3).backward(grad_out)
        with context:
            out = dwconv.depthwise_conv2d(*second, None, 1, 3)
        out.backward(grad_out)
        torch.cuda.synchronize()
        for leaves in (first, second):
            assert_close(leaves[0].grad, ref_grads[0], dtype, f"step {step}: grad_input")
            scale = ref_grads[1].abs().max()
            assert_close(leaves[1].grad.double() / scale, ref_grads[1] / scale, dtype, f"step {step}: grad_weight")


@GPU
def test_side_stream(monkeypatch, path):
    """Forward and backward issued on a side stream (the replayer launches on the current stream)."""
    x = randn(4, 32, 30, 30).contiguous(memory_format=torch.channels_last)
    weight, grad_out = randn(32, 1, 5, 5), randn(4, 32, 30, 30)
    _, ref_grads = reference_grads([x, weight], grad_out, padding=2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(2):
        leaves = leaves_of([x, weight])
        with torch.cuda.stream(side):
            out = dwconv.depthwise_conv2d(*leaves, None, 1, 2)
            out.backward(grad_out)
        side.synchronize()
        assert_close(leaves[0].grad, ref_grads[0], torch.float32, "grad_input")
        assert_close(leaves[1].grad, ref_grads[1], torch.float32, "grad_weight")
