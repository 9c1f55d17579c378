"""The squeeze-and-excitation block as one op (dwconv::squeeze_excite, kernels/channel_scale) against
PyTorch's ops in float64, and dwconv.fuse's use of it: where it computes, and where the module's own
forward must run instead."""

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dwconv
from dwconv._geometry import ACTIVATION_CODES, ACTIVATION_FUNCTIONS
from dwconv._library import GATE_NAMES
from helpers import DEVICE, TOLERANCES, assert_close, randn, relative_error, reversed_strides


@pytest.fixture(autouse=True)
def float32_convolutions_without_tf32(monkeypatch):
    """The gate's 1x1 convolutions are PyTorch's, against float64 within float32's error: on the GPU
    cuDNN computes them in TF32 by torch's default (errors of 1e-4 relative, seen failing these
    tests on the H100)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


GATE_CODES = {name: code for code, name in GATE_NAMES.items()}
GATE_FUNCTIONS = {"sigmoid": torch.sigmoid, "hardsigmoid": F.hardsigmoid}


def reference(x, reduce_weight, reduce_bias, expand_weight, expand_bias, activation, gate):
    """The block in float64, as torchvision's SqueezeExcitation computes it."""
    d = lambda t: None if t is None else t.double().cpu()  # noqa: E731
    x64 = d(x)
    squeezed = x64.mean((2, 3), keepdim=True)
    hidden = ACTIVATION_FUNCTIONS[activation](F.conv2d(squeezed, d(reduce_weight), d(reduce_bias)))
    return x64 * GATE_FUNCTIONS[gate](F.conv2d(hidden, d(expand_weight), d(expand_bias)))


def parameters(channels, hidden, bias=True, dtype=torch.float32):
    return (randn(hidden, channels, 1, 1, dtype=dtype), randn(hidden, dtype=dtype) if bias else None,
            randn(channels, hidden, 1, 1, dtype=dtype), randn(channels, dtype=dtype) if bias else None)


def run_op(x, tensors, activation, gate):
    return torch.ops.dwconv.squeeze_excite.default(x, *tensors, ACTIVATION_CODES[activation], GATE_CODES[gate])


# (batch, channels, height, width, hidden): odd and prime sizes; one channel and pixel; an image of
# more elements than one program takes (the interpreter's 4096, the GPU's 2048)
SHAPES = [(3, 13, 5, 7, 5), (1, 1, 1, 1, 1), (2, 40, 11, 13, 6)]


@pytest.mark.parametrize("layout", ["channels_last", "nchw", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_op_against_float64(shape, dtype, layout):
    """Every dtype and both layouts (and a strided view, which PyTorch's multiply takes); the output
    in the input's dtype and memory format; the parameters float32 under a half-precision input, as
    autocast leaves them."""
    batch, channels, height, width, hidden = shape
    x = (2 * randn(batch, channels, height, 2 * width)).to(dtype)
    x = x[..., ::2] if layout == "strided" else x[..., :width].contiguous()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    tensors = parameters(channels, hidden, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    out = run_op(x, tensors, "silu", "sigmoid")
    assert out.dtype == dtype and (layout == "strided" or out.stride() == x.stride())
    assert_close(out, reference(x, *tensors, "silu", "sigmoid"), dtype)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation,gate", [("relu", "hardsigmoid"), ("hardswish", "sigmoid"), ("gelu", "sigmoid"),
                                             ("identity", "hardsigmoid")])
def test_op_activations_and_gates(activation, gate, bias):
    """Each gate, activations of both kinds (in place or not), with and without the biases; the
    parameters bfloat16 (a model cast to it) under a bfloat16 input."""
    x = (3 * randn(2, 24, 6, 9)).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    tensors = parameters(24, 7, bias, dtype=torch.bfloat16)
    assert_close(run_op(x, tensors, activation, gate), reference(x, *tensors, activation, gate), torch.bfloat16)


def test_op_reads_the_weights_by_their_strides():
    """Weights that are views (a transposed copy's, a channels_last one's): read as they lie."""
    x = randn(2, 10, 4, 3).contiguous(memory_format=torch.channels_last)
    reduce_weight = randn(10, 4, 1, 1).transpose(0, 1)  # ([4, 10, 1, 1] with strides (1, 4, 1, 1))
    expand_weight = randn(10, 4, 1, 1).contiguous(memory_format=torch.channels_last)[:, :, :, :]
    tensors = (reduce_weight, randn(4), randn(20, 4, 1, 1)[::2], randn(10))
    assert not tensors[2].is_contiguous() and not reduce_weight.is_contiguous()
    assert_close(run_op(x, tensors, "silu", "sigmoid"), reference(x, *tensors, "silu", "sigmoid"), torch.float32)
    tensors = (reduce_weight, randn(4), expand_weight, randn(10))
    assert_close(run_op(x, tensors, "relu", "hardsigmoid"), reference(x, *tensors, "relu", "hardsigmoid"),
                 torch.float32)


def test_op_refuses_what_it_cannot_compute():
    """An error naming the argument, never a crash or a silent answer."""
    x = randn(2, 8, 5, 5)
    good = parameters(8, 3)
    cases = [((randn(2, 8, 5), *good), "input"), ((x.int(), *good), "input"),
             ((x, randn(3, 7, 1, 1), *good[1:]), "reduce_weight"),
             ((x, randn(3, 8, 3, 3), *good[1:]), "reduce_weight"),
             ((x, good[0], randn(4), *good[2:]), "reduce_bias"),
             ((x, *good[:2], randn(8, 4, 1, 1), good[3]), "expand_weight"),
             ((x, *good[:3], randn(3)), "expand_bias"),
             ((x, randn(1025, 8, 1, 1), randn(1025), randn(8, 1025, 1, 1), good[3]), "reduce_weight may have at most"),
             ((x, randn(0, 8, 1, 1), randn(0), randn(8, 0, 1, 1), good[3]), "reduce_weight"),
             ((x, good[0].int(), *good[1:]), "reduce_weight")]
    for arguments, name in cases:
        with pytest.raises(ValueError, match=name):
            torch.ops.dwconv.squeeze_excite.default(*arguments, ACTIVATION_CODES["relu"], 0)
    with pytest.raises(ValueError, match="activation"):
        torch.ops.dwconv.squeeze_excite.default(x, *good, 99, 0)
    with pytest.raises(ValueError, match="gate"):
        torch.ops.dwconv.squeeze_excite.default(x, *good, ACTIVATION_CODES["relu"], 2)


def test_opcheck():
    x = randn(2, 8, 5, 3).contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(torch.ops.dwconv.squeeze_excite.default,
                          (x, *parameters(8, 3), ACTIVATION_CODES["silu"], GATE_CODES["sigmoid"]))


# ---- the modules, as torchvision and timm write them (their classes' module and name are what
# dwconv.fuse knows them by; neither library is a dependency) ---------------------------------------

class SqueezeExcitation(nn.Module):
    """torchvision.ops.misc.SqueezeExcitation's code."""

    def __init__(self, input_channels, squeeze_channels, activation=nn.ReLU, scale_activation=nn.Sigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def _scale(self, input):
        scale = self.avgpool(input)
        scale = self.fc1(scale)
        scale = self.activation(scale)
        scale = self.fc2(scale)
        return self.scale_activation(scale)

    def forward(self, input):
        scale = self._scale(input)
        return scale * input


SqueezeExcitation.__module__ = "torchvision.ops.misc"


class SqueezeExcite(nn.Module):
    """timm.models._efficientnet_blocks.SqueezeExcite's code (its default arguments)."""

    def __init__(self, in_chs, rd_channels, act_layer=nn.ReLU, gate_layer=nn.Sigmoid):
        super().__init__()
        self.conv_reduce = nn.Conv2d(in_chs, rd_channels, 1, bias=True)
        self.act1 = act_layer(inplace=True)
        self.conv_expand = nn.Conv2d(rd_channels, in_chs, 1, bias=True)
        self.gate = gate_layer()

    def forward(self, x):
        x_se = x.mean((2, 3), keepdim=True)
        x_se = self.conv_reduce(x_se)
        x_se = self.act1(x_se)
        x_se = self.conv_expand(x_se)
        return x * self.gate(x_se)


SqueezeExcite.__module__ = "timm.models._efficientnet_blocks"


def model_with(block: nn.Module) -> nn.Module:
    """A depthwise layer (so that convert has a layer to convert), then the block."""
    return nn.Sequential(nn.Conv2d(12, 12, 3, padding=1, groups=12), block).to(DEVICE).eval()


def op_calls(model, x) -> int:
    """The model's output's calls of dwconv::squeeze_excite (two calls before: the C++ replayer, where
    on, serves from the first and records at the second)."""
    for _ in range(2):
        model(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(x)
    return sum(e.count for e in profile.key_averages() if e.key == "dwconv::squeeze_excite")


BLOCKS = {"torchvision": lambda: SqueezeExcitation(12, 4, nn.SiLU),
          "timm": lambda: SqueezeExcite(12, 5, nn.ReLU, nn.Hardsigmoid)}


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_fused_module_is_one_op_with_stock_values(kind):
    stock = model_with(BLOCKS[kind]())
    fused = dwconv.convert(stock, fuse=True, precompile=False)
    assert type(fused[1]).__name__.startswith("Fused") and set(fused.state_dict()) == set(stock.state_dict())
    x = randn(2, 12, 7, 6).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert op_calls(fused, x) == 1
        assert_close(fused(x), stock.double()(x.double()), torch.float32)
    # (bfloat16 autocast: the op computes from the float32 parameters, stock from their casts; the
    # input in bfloat16, as the layer before gives it)
    half = x.bfloat16()
    with torch.no_grad(), torch.autocast(DEVICE, torch.bfloat16):
        assert op_calls(fused, half) == 1
        out = fused(half)
    assert out.dtype == torch.bfloat16 and out.stride() == half.stride()
    assert_close(out, stock.double()(half.double()), torch.bfloat16)


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_fused_module_runs_as_its_class_where_the_op_cannot(kind):
    """A hook on a member, a member replaced: the module's own forward, with stock's values (with
    gradients wanted: test_trained_module_as_stock)."""
    stock = model_with(BLOCKS[kind]())
    fused = dwconv.convert(stock, fuse=True, precompile=False)
    x = randn(2, 12, 5, 5).contiguous(memory_format=torch.channels_last)
    assert op_calls(fused, x.clone().requires_grad_()) == 0
    # a hook on the reduce convolution sees its output
    members = list(fused[1].children())
    reduce = next(m for m in members if isinstance(m, nn.Conv2d))
    seen = []
    handle = reduce.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    with torch.no_grad():
        assert op_calls(fused, x) == 0 and seen
        handle.remove()
        assert op_calls(fused, x) == 1
        # a member replaced: the new one computes
        name = next(n for n, m in fused[1].named_children() if m is reduce)
        setattr(fused[1], name, nn.Conv2d(12, reduce.out_channels, 1).to(DEVICE))
        setattr(stock[1], name, copy.deepcopy(getattr(fused[1], name)))
        assert op_calls(fused, x) == 0
        assert_close(fused(x), stock.double()(x.double()), torch.float32)


def test_blocks_the_op_does_not_compute_are_left_alone():
    """A gate or activation of no code, a pool that is not to 1x1, a reduce convolution of 3x3, a
    subclass (its forward may differ): the class stays."""
    blocks = [SqueezeExcitation(12, 4, nn.ReLU, nn.Tanh), SqueezeExcitation(12, 4, nn.Tanh)]
    pooled = SqueezeExcitation(12, 4)
    pooled.avgpool = nn.AdaptiveAvgPool2d(2)
    wide = SqueezeExcitation(12, 4)
    wide.fc1 = nn.Conv2d(12, 4, 3, padding=1)
    sub = type("SqueezeExcitation", (SqueezeExcitation,), {"__module__": "mine"})(12, 4)
    for block in blocks + [pooled, wide, sub]:
        fused = dwconv.convert(model_with(block), fuse=True, precompile=False, verbose=False)
        assert not type(fused[1]).__name__.startswith("Fused"), block


def test_fused_module_copies():
    """(Pickled as the other roles are, by role and class: this file's stand-in classes do not import
    under their libraries' names.)"""
    fused = dwconv.convert(model_with(BLOCKS["torchvision"]()), fuse=True, precompile=False)
    x = randn(1, 12, 4, 4)
    for twin in (copy.deepcopy(fused),):
        assert type(twin[1]) is type(fused[1])
        with torch.no_grad():
            assert op_calls(twin, x) == 1
            assert_close(twin(x), fused(x).double(), torch.float32)


def test_warmup_compiles_the_op(tmp_path, monkeypatch):
    """A fused model's warmup in eval (its fake run) records the block's op call, one for any batch
    size, and its pool compiles both kernels for sm_90 into an empty cache."""
    from dwconv.precompile import compile_calls, layer_calls

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fused = dwconv.convert(model_with(BLOCKS["torchvision"]()), fuse=True, precompile=False, verbose=False)
    x = randn(2, 12, 9, 11).contiguous(memory_format=torch.channels_last)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        calls = [call for call in layer_calls(fused, x) if call.squeeze]
        assert [call.without_batch() for call in calls] == \
            [call.without_batch() for call in layer_calls(fused, torch.cat([x, x, x])) if call.squeeze]
    assert len(calls) == 1 and calls[0].tensors[0][2] == "bfloat16" and calls[0].passes() == ["forward"]
    report = compile_calls(calls, 90, workers=1, verbose=False)
    assert report.errors == [] and report.launches == 2


# ---- in training: the gate's multiply and its backward on the kernels (dwconv.squeeze_excite) ------

@pytest.fixture(params=["python-function", "cpp-nodes"])
def path(request, monkeypatch):
    """The block in training through SqueezeExciteFunction (DWCONV_NATIVE=0) or through the C++
    replayer's nodes around the gate's ops (=1; under the interpreter, its launches called back)."""
    monkeypatch.setenv("DWCONV_NATIVE", "0" if request.param == "python-function" else "1")
    return request.param


def on_the_path(out, path) -> bool:
    """Whether out is the block's multiply on the path asked for."""
    if path == "python-function":
        return type(out.grad_fn).__name__ == "SqueezeExciteFunctionBackward"
    return out.grad_fn is not None and "ScaleFunction" in out.grad_fn.name()


def excited(x, weight, bias):
    """The block with a small gate of its own: sigmoid(1x1 convolution of the input's mean)."""
    from dwconv.squeeze_excite import block

    return block(x, lambda s: torch.sigmoid(F.conv2d(s, weight, bias)), None, [weight, bias])


def excited_reference(x, weight, bias):
    return x * torch.sigmoid(F.conv2d(x.mean((2, 3), keepdim=True), weight, bias))


# (batch, channels, height, width): odd and prime sizes; one element; an image the interpreter's
# gate gradient splits among programs (more pixels than its block of them); more channels than one
# program's block
SCALE_SHAPES = [(3, 13, 5, 7), (1, 1, 1, 1), (2, 13, 19, 23), (2, 70, 3, 5), (1, 3, 40, 41)]


@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", SCALE_SHAPES, ids=str)
def test_function_against_float64(shape, dtype, layout, path):
    """The block's output and its gradients (the input's and the gate's parameters') against
    float64 autograd of the block, in the input's dtype and memory format (outputs NaN-poisoned
    first: the tests' tuning)."""
    check_function(shape, dtype, layout, "both", path)


@pytest.mark.parametrize("wanted", ["input", "parameters"])
@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
@pytest.mark.parametrize("shape", SCALE_SHAPES[2:4], ids=str)
def test_function_computes_the_gradients_wanted(shape, layout, wanted, path):
    """Either gradient alone (the other side's tensors not requiring one)."""
    check_function(shape, torch.float32, layout, wanted, path)


def check_function(shape, dtype, layout, wanted, path):
    batch, channels, height, width = shape
    x = (2 * randn(batch, channels, height, width)).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight, bias = randn(channels, channels, 1, 1).to(dtype) / channels ** 0.5, randn(channels).to(dtype)
    x.requires_grad_(wanted in ("both", "input"))
    for t in (weight, bias):
        t.requires_grad_(wanted in ("both", "parameters"))
    out = excited(x, weight, bias)
    assert on_the_path(out, path)
    assert out.dtype == dtype and out.stride() == x.stride()
    tensors = [t.detach().double().cpu().requires_grad_(t.requires_grad) for t in (x, weight, bias)]
    ref = excited_reference(*tensors)
    assert_close(out, ref, dtype)
    grad = randn(*shape).to(dtype)
    sources = [(name, t, t64) for name, t, t64 in zip(("input", "weight", "bias"), (x, weight, bias), tensors)
               if t.requires_grad]
    grads = torch.autograd.grad(out, [t for _, t, _ in sources], grad)
    refs = torch.autograd.grad(ref, [t64 for _, _, t64 in sources], grad.double().cpu())
    # (stock's own half-precision gradients: the gate's parameters' sum over the batch cancels, and
    # against float64 they may miss half precision's tolerance by as much as stock's do)
    stock_grads = torch.autograd.grad(excited_reference(x, weight, bias), [t for _, t, _ in sources], grad)
    bound = 3.0 if DEVICE == "cpu" else 1.5  # (the interpreter truncates to half precision: test_trained_module_as_stock)
    for (name, t, _), got, expected, stock in zip(sources, grads, refs, stock_grads):
        assert got.dtype == dtype, name
        if name == "input":
            assert got.stride() == x.stride()
        if name == "input" or dtype in (torch.float32, torch.float64):
            assert_close(got, expected, dtype, f"grad of {name}")
        else:
            error, stock_error = relative_error(got, expected), relative_error(stock, expected)
            assert error <= bound * stock_error + 2 ** -8, f"grad of {name}: {error:.3g} against stock's {stock_error:.3g}"


def test_function_gradients_of_any_order(path):
    """create_graph=True: PyTorch's differentiable ops (the Function's block recomputed; the nodes'
    own formulas, which autograd adds), so a second derivative is PyTorch's (gradcheck and
    gradgradcheck in float64); a second backward through a retained graph."""
    # (two images of three channels: each Jacobian entry a pass under the interpreter)
    x = randn(2, 3, 3, 2, dtype=torch.float64).contiguous(memory_format=torch.channels_last).requires_grad_()
    weight, bias = randn(3, 3, 1, 1, dtype=torch.float64).requires_grad_(), randn(3, dtype=torch.float64).requires_grad_()
    assert on_the_path(excited(x, weight, bias), path)
    assert torch.autograd.gradcheck(excited, (x, weight, bias))
    assert torch.autograd.gradgradcheck(excited, (x, weight, bias))
    out = excited(x, weight, bias).sum()
    first = torch.autograd.grad(out, (x, weight), retain_graph=True)
    for a, b in zip(first, torch.autograd.grad(out, (x, weight))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("unpack", ["as-packed", "reversed-strides"])
def test_function_saved_tensors_hooks(path, unpack):
    """The block saves through saved-tensor hooks (the input, and the gate's parameters or the gate),
    and its gradients are the same as without them, also where the hook hands a tensor back in
    another layout (the passes read the input as the layout of grad they make)."""
    x = randn(2, 6, 5, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
    weight, bias = randn(6, 6, 1, 1).requires_grad_(), randn(6).requires_grad_()
    grad = randn(2, 6, 5, 4)
    expected = torch.autograd.grad(excited(x, weight, bias), (x, weight, bias), grad)
    packed = []
    unpacked = (lambda t: t) if unpack == "as-packed" else reversed_strides
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t.clone(), unpacked):
        out = excited(x, weight, bias)
    assert on_the_path(out, path)
    assert x.shape in packed and weight.shape in packed
    for name, got, want in zip(("input", "weight", "bias"), torch.autograd.grad(out, (x, weight, bias), grad), expected):
        if unpack == "as-packed":
            assert torch.equal(got, want), name
        else:  # (the passes then read NCHW copies: on the GPU other programs, other summation orders)
            assert_close(got, want, torch.float32, name)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_function_under_activation_checkpointing(path, reentrant):
    """The block under torch.utils.checkpoint (its forward recomputed in the backward, the saved
    tensors the recomputation's): the output and every gradient bitwise as without it."""
    from torch.utils.checkpoint import checkpoint

    x = randn(2, 6, 5, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
    weight, bias = randn(6, 6, 1, 1).requires_grad_(), randn(6).requires_grad_()
    grad = randn(2, 6, 5, 4)
    plain_out = excited(x, weight, bias)
    assert on_the_path(plain_out, path)
    expected = torch.autograd.grad(plain_out, (x, weight, bias), grad)
    out = checkpoint(excited, x, weight, bias, use_reentrant=reentrant)
    assert torch.equal(out, plain_out)
    got = torch.autograd.grad(out, (x, weight, bias), grad) if not reentrant else None
    if reentrant:  # (the reentrant form differentiates by backward() alone)
        for t in (x, weight, bias):
            t.grad = None
        out.backward(grad)
        got = (x.grad, weight.grad, bias.grad)
    for name, g, e in zip(("input", "weight", "bias"), got, expected):
        assert torch.equal(g, e), name


def _step(model, x, grad, autocast: bool):
    """(output, input's gradient, the parameters' gradients) of one backward of grad."""
    leaf = x.clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        out = model(leaf)
    out.backward(grad.to(out.dtype))
    return out, leaf.grad, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_trained_module_as_stock(kind, path):
    """In training (gradients wanted), the module's gate as its own members compute it, then the
    Function: the output and every gradient (input, the convolutions' weights and biases) as
    stock's in float32, each within 1e-5 of its largest value, over three steps of SGD; under
    bfloat16 autocast, each within 1.5 times stock's own error against float64 on a GPU (3 times
    under the interpreter), plus a bfloat16 rounding's worth of the largest value."""
    # (the blocks alone: the same input to both, so that a depthwise layer's rounding before them
    # cannot move a value across the activation's or the gate's kink)
    converted = dwconv.convert(model_with(BLOCKS[kind]()).train(), fuse=True, precompile=False, verbose=False)
    fused = converted[1]
    stock = copy.deepcopy(fused)
    stock.__class__ = type(fused).__mro__[2]
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (stock, fused)]
    names = ["output", "grad of input"] + [f"grad of {name}" for name, _ in stock.named_parameters()]

    def flat(result):
        return [result[0], result[1], *result[2]]

    for _ in range(3):
        x = randn(3, 12, 9, 7).contiguous(memory_format=torch.channels_last)
        grad = randn(3, 12, 9, 7)
        stock_result, result = (_step(m, x, grad, False) for m in (stock, fused))
        assert on_the_path(result[0], path)
        assert result[0].stride() == stock_result[0].stride()
        for name, expected, got in zip(names, flat(stock_result), flat(result)):
            assert relative_error(got, expected.double()) <= 1e-5, name
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    x = randn(3, 12, 9, 7).contiguous(memory_format=torch.channels_last)
    grad = randn(3, 12, 9, 7)
    x = x.bfloat16()  # (as the layer before gives it under autocast)
    reference = _step(copy.deepcopy(stock).double(), x.double(), grad.double(), False)
    half = [_step(m, x, grad, True) for m in (stock, fused)]
    assert half[1][0].dtype == half[0][0].dtype == torch.bfloat16
    assert on_the_path(half[1][0], path)
    # (Triton's interpreter truncates float32 to bfloat16 where the GPU rounds to nearest: twice the
    # error a rounding, all of one sign, which the weights' gradients sum)
    bound = 3.0 if DEVICE == "cpu" else 1.5
    for name, expected, got_stock, got in zip(names, flat(reference), flat(half[0]), flat(half[1])):
        stock_error, error = relative_error(got_stock, expected), relative_error(got, expected)
        # (the gate's biases' gradients are sums over the batch that cancel: against their own largest
        # value a few bfloat16 roundings either way, and stock's error may be small by chance; a floor
        # of 4 roundings: at 1, a clean CI run failed on conv_reduce.bias, 0.0157 against stock's 0.0026)
        floor = 2 ** -6 if name.endswith(".bias") else 2 ** -8
        assert error <= bound * stock_error + floor, f"{name}: {error:.3g} against stock's {stock_error:.3g}"


class _Marked(torch.Tensor):
    """A tensor subclass (as a wrapped parameter's ops may return): not what the launches read."""


def test_function_leaves_a_gate_the_kernels_cannot_read_to_pytorch(monkeypatch, path):
    """A gate that is a tensor subclass: the multiply and the backward are PyTorch's ops (the
    Function: no launch; the C++ nodes: Python's multiply, the squeeze's node differentiated as the
    mean); the output and every gradient as the block's own."""
    from dwconv.kernels import squeeze_excite as kernels
    from dwconv.squeeze_excite import block

    def refused(*args):
        raise AssertionError("a launch for a gate the kernels cannot read")
    if path == "python-function":
        monkeypatch.setattr(kernels, "channel_scale", refused)
        monkeypatch.setattr(kernels, "gate_gradient", refused)
    x, weight, bias = randn(2, 5, 3, 4).requires_grad_(), randn(5, 5, 1, 1).requires_grad_(), randn(5)
    out = block(x, lambda s: torch.sigmoid(F.conv2d(s, weight, bias)).as_subclass(_Marked), None, [weight, bias])
    assert not on_the_path(out, "cpp-nodes")
    grad = randn(*out.shape)
    got = torch.autograd.grad(out, (x, weight), grad)
    x64, weight64 = (t.detach().double().requires_grad_() for t in (x, weight))
    ref = excited_reference(x64, weight64, bias.double())
    assert_close(out.as_subclass(torch.Tensor), ref, torch.float32)
    for name, g, r in zip(("input", "weight"), got, torch.autograd.grad(ref, (x64, weight64), grad.double())):
        assert_close(g.as_subclass(torch.Tensor), r, torch.float32, f"grad of {name}")


def test_cpp_nodes_give_the_functions_values(monkeypatch):
    """The C++ nodes launch the Function's kernels on the same tensors: output and every gradient
    bitwise equal, both layouts, float32 and bfloat16, with the input's gradient alone and with all."""
    for layout, dtype, sources in [("channels_last", torch.float32, "all"), ("nchw", torch.bfloat16, "all"),
                                   ("channels_last", torch.bfloat16, "input")]:
        x = randn(3, 7, 5, 6).to(dtype)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        weight, bias = (randn(7, 7, 1, 1) / 7 ** 0.5).to(dtype), randn(7).to(dtype)
        leaves = [t.requires_grad_() for t in ([x, weight, bias] if sources == "all" else [x])]
        grad = randn(3, 7, 5, 6).to(dtype)
        results = []
        for native in ("0", "1"):
            monkeypatch.setenv("DWCONV_NATIVE", native)
            out = excited(x, weight, bias)
            results.append([out, *torch.autograd.grad(out, leaves, grad)])
        for name, a, b in zip(["output", "grad of input", "grad of weight", "grad of bias"], *results):
            assert torch.equal(a, b) and a.stride() == b.stride(), f"{layout} {dtype} {sources}: {name}"


def test_cpp_nodes_hand_over_by_graph_task(monkeypatch):
    """One retained graph differentiated by four threads at once, each with its own grad: each
    gets its own input gradient (the multiply's node hands grad to the squeeze's node by graph
    task; handed by node alone, a thread could read another's)."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    x = randn(2, 6, 9, 8).contiguous(memory_format=torch.channels_last).requires_grad_()
    weight, bias = randn(6, 6, 1, 1) / 6 ** 0.5, randn(6)
    out = excited(x, weight, bias)
    assert on_the_path(out, "cpp-nodes")
    grads = [randn(2, 6, 9, 8) for _ in range(4)]
    expected = [torch.autograd.grad(out, x, g, retain_graph=True)[0] for g in grads]
    got, errors = {}, []
    start = threading.Barrier(len(grads))

    def work(i):
        try:
            start.wait()
            for _ in range(8):
                got.setdefault(i, []).append(torch.autograd.grad(out, x, grads[i], retain_graph=True)[0])
        except Exception as error:  # (reported below, with its thread)
            errors.append((i, repr(error)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(grads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, results in got.items():
        assert all(torch.equal(r, expected[i]) for r in results), f"thread {i}"


def test_trained_module_runs_as_its_class_where_the_kernels_cannot():
    """Under forward-mode AD or torch.func, the module's own forward: stock's values and gradients."""
    stock = model_with(BLOCKS["timm"]()).train()
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False).train()
    x = randn(2, 12, 5, 6).contiguous(memory_format=torch.channels_last)
    tangent = randn(2, 12, 5, 6)
    import torch.autograd.forward_ad as fwAD

    results = []
    for model in (stock, fused):
        with fwAD.dual_level():
            out = model(fwAD.make_dual(x, tangent))
            results.append(fwAD.unpack_dual(out))
    assert_close(results[1].primal, results[0].primal, torch.float32)
    assert_close(results[1].tangent, results[0].tangent, torch.float32, "tangent")
    grads = [torch.func.grad(lambda t, m=m: m(t).sum())(x) for m in (stock, fused)]
    assert_close(grads[1], grads[0], torch.float32, "torch.func.grad")


def test_warmup_compiles_the_trained_multiply(tmp_path, monkeypatch):
    """A fused model's warmup in training records the block's kernels' call, one for any batch size,
    with its backward, and its pool compiles their three launches for sm_90 into an empty cache."""
    from dwconv.precompile import compile_calls, layer_calls

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fused = dwconv.convert(model_with(BLOCKS["timm"]()), fuse=True, precompile=False, verbose=False).train()
    x = randn(2, 12, 9, 11).contiguous(memory_format=torch.channels_last)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        calls = [call for call in layer_calls(fused, x) if call.channel_scale]
        assert [call.without_batch() for call in calls] == \
            [call.without_batch() for call in layer_calls(fused, torch.cat([x, x, x])) if call.channel_scale]
    assert len(calls) == 1 and calls[0].tensors[0][2] == "bfloat16" and calls[0].passes() == ["backward", "forward"]
    report = compile_calls(calls, 90, workers=1, verbose=False)
    assert report.errors == [] and report.launches == 3  # (forward: the multiply; backward: the gate's gradient, grad_input's)
