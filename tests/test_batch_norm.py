"""BatchNorm2d in training mode with its activation on dwconv's kernels (dwconv.batch_norm, the
fused depthwise block in training): the kernels against float64 F.batch_norm and PyTorch's
activations (outputs, running statistics, every gradient), the Function under autograd's features
(double backward, saved-tensor hooks, threads), and the fused block in training against stock."""

import copy
import threading

import pytest
import torch
import torch.nn.functional as F

import dwconv
from dwconv.activations import ACTIVATION_CODES, FUNCTIONS
from dwconv.batch_norm import BatchNormActivationFunction
from dwconv.kernels.batch_norm import batch_norm_backward, batch_norm_forward
from helpers import DEVICE, assert_close, randn

LAYOUTS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}
# odd and prime sizes; channels past one block and not a multiple of it; 1x1 images; many programs
SHAPES = [(3, 5, 7, 9), (2, 67, 5, 3), (5, 16, 1, 1), (2, 3, 2, 1), (4, 24, 13, 11)]


def _inputs(shape, dtype, layout, offset=1.5, spread=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = (torch.randn(shape, generator=gen) * spread + offset).to(DEVICE, dtype)
    channels = shape[1]
    weight = randn(channels, generator=gen).to(dtype if dtype == torch.float64 else torch.float32)
    bias = randn(channels, generator=gen).to(weight.dtype)
    return y.contiguous(memory_format=LAYOUTS[layout]), weight, bias


def _reference(y, weight, bias, running_mean, running_var, momentum, eps, activation, grad):
    """float64 F.batch_norm + PyTorch's activation on the same values: output, running statistics
    after the update, gradients of y, weight and bias."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (y, weight, bias)]
    mean, var = running_mean.double().cpu(), running_var.double().cpu()
    out = FUNCTIONS[activation](F.batch_norm(leaves[0], mean, var, leaves[1], leaves[2], True, momentum, eps))
    grads = torch.autograd.grad(out, leaves, grad.double().cpu())
    return out, mean, var, grads


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernels_against_float64(shape, dtype, layout):
    """Every value the kernels give (into NaN-poisoned buffers: conftest) against float64."""
    y, weight, bias = _inputs(shape, dtype, layout)
    running_mean, running_var = randn(shape[1]), randn(shape[1]).abs() + 0.5
    grad = randn(*shape, dtype=dtype).contiguous(memory_format=LAYOUTS[layout])
    ref, ref_mean, ref_var, ref_grads = _reference(y, weight, bias, running_mean, running_var, 0.1, 1e-5, "relu6",
                                                   grad)
    out, mean, invstd = batch_norm_forward(y, weight, bias, running_mean, running_var, 0.1, 1e-5,
                                           ACTIVATION_CODES["relu6"])
    assert out.dtype == dtype and out.stride() == y.stride()
    assert_close(out, ref, dtype, "output")
    stats_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert_close(running_mean, ref_mean, torch.float32, "running_mean")  # (float32 buffers)
    assert_close(running_var, ref_var, torch.float32, "running_var")
    grads = batch_norm_backward(grad, y, weight, bias, mean, invstd, 1e-5, ACTIVATION_CODES["relu6"])
    assert grads[0].stride() == y.stride()
    for name, got, expected in zip(("grad_y", "grad_weight", "grad_bias"), grads, ref_grads):
        assert_close(got, expected, dtype if name == "grad_y" else stats_dtype, name)


@pytest.mark.parametrize("shape", [(2, 144, 5, 3), (3, 67, 4, 5), (2, 96, 3, 7)], ids=lambda s: "x".join(map(str, s)))
def test_gpu_blocks_against_float64(shape):
    """The GPU's blocks (channels_last: the summing passes' narrow tiles, the others' wide ones with
    masked channels; 2048 programs' chunks) under the interpreter, bfloat16 against float64."""
    from dwconv import tuning

    with tuning.override(plan_as_gpu=True):
        test_kernels_against_float64(shape, torch.bfloat16, "channels_last")


@pytest.mark.parametrize("activation", list(ACTIVATION_CODES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_activation_and_its_derivative(activation, layout):
    shape = (3, 20, 5, 7)
    y, weight, bias = _inputs(shape, torch.float32, layout)
    running_mean, running_var = randn(20), randn(20).abs() + 0.5
    grad = randn(*shape)
    ref, ref_mean, _, ref_grads = _reference(y, weight, bias, running_mean, running_var, 0.1, 1e-5, activation, grad)
    code = ACTIVATION_CODES[activation]
    out, mean, invstd = batch_norm_forward(y, weight, bias, running_mean, running_var, 0.1, 1e-5, code)
    assert_close(out, ref, torch.float32, activation)
    grads = batch_norm_backward(grad, y, weight, bias, mean, invstd, 1e-5, code)
    for name, got, expected in zip(("grad_y", "grad_weight", "grad_bias"), grads, ref_grads):
        assert_close(got, expected, torch.float32, f"{activation}: {name}")


def test_statistics_keep_their_precision_far_from_zero():
    """Values of mean 1000 and spread 1 in float32: the variance from sums of squares would lose
    about 2 of its digits to cancellation; Chan's updates keep float32's."""
    y, weight, bias = _inputs((8, 16, 9, 7), torch.float32, "channels_last", offset=1000.0, spread=1.0)
    running_mean, running_var = torch.zeros(16, device=DEVICE), torch.ones(16, device=DEVICE)
    out, mean, invstd = batch_norm_forward(y, weight, bias, running_mean, running_var, 1.0, 1e-5, 0)
    y64 = y.double()
    var = y64.var(dim=(0, 2, 3), unbiased=False)
    assert_close(mean, y64.mean(dim=(0, 2, 3)), torch.float32, "mean")
    assert ((invstd.double() - (var + 1e-5).rsqrt()).abs() / (var + 1e-5).rsqrt()).max() < 1e-5
    assert_close(running_var, y64.var(dim=(0, 2, 3)), torch.float32, "running_var")


def test_without_affine_and_running_statistics():
    y, _, _ = _inputs((4, 6, 5, 5), torch.float32, "nchw")
    grad = randn(4, 6, 5, 5)
    leaf = y.double().cpu().requires_grad_()
    ref = F.silu(F.batch_norm(leaf, None, None, None, None, True, 0.1, 1e-3))
    ref.backward(grad.double().cpu())
    out, mean, invstd = batch_norm_forward(y, None, None, None, None, 0.1, 1e-3, ACTIVATION_CODES["silu"])
    assert_close(out, ref, torch.float32)
    grad_y, grad_weight, grad_bias = batch_norm_backward(grad, y, None, None, mean, invstd, 1e-3,
                                                         ACTIVATION_CODES["silu"])
    assert grad_weight is None and grad_bias is None
    assert_close(grad_y, leaf.grad, torch.float32, "grad_y")


# (out channels, in channels a group, kernel): a depthwise 3x3, pointwise layers past one block of
# taps, a 1x1 of one tap, a dense 3x3 (its channels_last weight too)
FOLD_WEIGHTS = [(67, 1, 3), (40, 131, 1), (5, 1, 1), (24, 7, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("options", ["bias-affine", "affine", "bias", "plain"])
@pytest.mark.parametrize("weight_shape", FOLD_WEIGHTS, ids=lambda s: "x".join(map(str, s)))
def test_fold_kernel_against_float64(weight_shape, options, dtype):
    """kernels.batch_norm.fold (a convolution followed by a BatchNorm in eval mode): the folded weight
    and bias in the dtype asked for, against fold_batch_norm in float64 (outputs poisoned first)."""
    from dwconv.fuse import fold_batch_norm
    from dwconv.kernels.batch_norm import fold

    out_channels, in_channels, kernel = weight_shape
    gen = torch.Generator().manual_seed(out_channels * 31 + kernel)
    params = torch.float64 if dtype == torch.float64 else torch.float32
    weight = randn(out_channels, in_channels, kernel, kernel, generator=gen).to(params)
    if in_channels > 1 and kernel > 1:
        weight = weight.contiguous(memory_format=torch.channels_last)
    bias = randn(out_channels, generator=gen).to(params) if "bias" in options else None
    norm = torch.nn.BatchNorm2d(out_channels, eps=1e-3, affine="affine" in options).to(DEVICE, params)
    with torch.no_grad():
        norm.running_mean.copy_(randn(out_channels, generator=gen))
        norm.running_var.copy_(torch.rand(out_channels, generator=gen) * 3 + 0.1)
        if norm.affine:
            norm.weight.copy_(randn(out_channels, generator=gen))
            norm.bias.copy_(randn(out_channels, generator=gen))
    folded_weight, folded_bias = fold(weight, bias, norm.weight, norm.bias, norm.running_mean, norm.running_var,
                                      norm.eps, dtype)
    assert folded_weight.dtype == folded_bias.dtype == dtype and folded_weight.stride() == weight.stride()
    norm64 = copy.deepcopy(norm).double()
    ref_weight, ref_bias = fold_batch_norm(weight.double(), None if bias is None else bias.double(), norm64)
    assert_close(folded_weight, ref_weight, dtype, "folded weight")
    assert_close(folded_bias, ref_bias, dtype, "folded bias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("channels", [1, 7, 131])
def test_scale_shift_against_float64(channels, affine, dtype):
    """kernels.batch_norm.scale_shift (a BatchNorm in eval mode as x * scale + shift): one (2, channels)
    tensor, scale then shift, each row written whole (poisoned first), against float64's."""
    from dwconv.kernels.batch_norm import scale_shift

    gen = torch.Generator().manual_seed(channels)
    norm = torch.nn.BatchNorm2d(channels, eps=1e-3, affine=affine).to(DEVICE, dtype)
    with torch.no_grad():
        norm.running_mean.copy_(randn(channels, generator=gen))
        norm.running_var.copy_(torch.rand(channels, generator=gen) * 3 + 0.1)
        if affine:
            norm.weight.copy_(randn(channels, generator=gen))
            norm.bias.copy_(randn(channels, generator=gen))
    out = scale_shift(norm.weight, norm.bias, norm.running_mean, norm.running_var, norm.eps)
    assert out.shape == (2, channels) and out.dtype == dtype and out.is_contiguous()
    scale = 1 / (norm.running_var.double() + norm.eps).sqrt()
    if affine:
        scale = scale * norm.weight.double()
    shift = -norm.running_mean.double() * scale + (norm.bias.double() if affine else 0)
    assert_close(out[0], scale, dtype, "scale")
    assert_close(out[1], shift, dtype, "shift")


def test_gradient_of_another_layout_and_expanded():
    """A gradient whose strides are not y's (NCHW for a channels_last y; expanded, as sum() gives)."""
    y, weight, bias = _inputs((2, 8, 4, 5), torch.float32, "channels_last")
    for grad in (randn(2, 8, 4, 5), torch.ones(1, device=DEVICE).expand(2, 8, 4, 5)):
        ref_grads = _reference(y, weight, bias, torch.zeros(8), torch.ones(8), 0.1, 1e-5, "silu", grad)[3]
        out, mean, invstd = batch_norm_forward(y, weight, bias, None, None, 0.1, 1e-5, ACTIVATION_CODES["silu"])
        grads = batch_norm_backward(grad, y, weight, bias, mean, invstd, 1e-5, ACTIVATION_CODES["silu"])
        for name, got, expected in zip(("grad_y", "grad_weight", "grad_bias"), grads, ref_grads):
            assert_close(got, expected, torch.float32, name)


# ---- the Function under autograd's features ----------------------------------------------------------

def _leaves(shape=(2, 2, 3, 3), dtype=torch.float64):
    y, weight, bias = _inputs(shape, dtype, "channels_last")
    return [t.detach().clone().requires_grad_() for t in (y, weight, bias)]


def _function(activation):
    return lambda y, w, b: BatchNormActivationFunction.apply(y, w, b, None, None, 0.1, 1e-5, activation)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gradcheck_and_gradgradcheck(activation):
    """First derivatives from the kernels, second (create_graph=True) from PyTorch's ops: both
    against finite differences in float64."""
    leaves = _leaves()
    assert torch.autograd.gradcheck(_function(activation), leaves)
    assert torch.autograd.gradgradcheck(_function(activation), leaves)


def test_gradient_penalty_reaches_the_convolution():
    """Double backward through the whole fused block (convolution, BatchNorm, activation): the
    penalty's gradient of the convolution's weight equals stock's."""
    def model():
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False),
                                   torch.nn.BatchNorm2d(4), torch.nn.SiLU()).to(DEVICE).double()

    stock, fused = model(), dwconv.convert(model(), fuse=True, precompile=False, verbose=False)
    x = randn(2, 4, 5, 6, dtype=torch.float64)
    results = []
    for net in (stock, fused):
        xx = x.clone().requires_grad_()
        out = net(xx)
        (grad_x,) = torch.autograd.grad(out.square().sum(), xx, create_graph=True)
        penalty = grad_x.square().sum()
        results.append(torch.autograd.grad(penalty, [net[0].weight, net[1].weight]))
    for got, expected in zip(results[1], results[0]):
        assert_close(got, expected, torch.float64, "penalty gradient")


def test_saved_tensor_hooks_see_and_restore_the_saved_tensors():
    """What the Function saves goes through the hooks (offloading wrappers), and the gradients
    computed from the unpacked copies are the same."""
    leaves = _leaves(dtype=torch.float32)
    grad = randn(*leaves[0].shape)
    expected = torch.autograd.grad(_function("relu6")(*leaves), leaves, grad)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.detach().cpu().clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.to(DEVICE)):
        out = _function("relu6")(*leaves)
    assert tuple(leaves[0].shape) in [tuple(s) for s in packed]
    for got, want in zip(torch.autograd.grad(out, leaves, grad), expected):
        assert torch.equal(got, want)


def test_threads_train_their_own_blocks():
    """Blocks trained on several threads at once give what each gives alone."""
    def model(seed):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False),
                                  torch.nn.BatchNorm2d(6), torch.nn.ReLU6())
        return dwconv.convert(net.to(DEVICE), fuse=True, precompile=False, verbose=False)

    def step(net, x):
        out = net(x)
        out.backward(torch.ones_like(out))
        return out.detach(), net[0].weight.grad.clone(), net[1].running_var.clone()

    inputs = [randn(2, 6, 7, 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    alone = [step(model(i), inputs[i]) for i in range(3)]
    results, models = [None] * 3, [model(i) for i in range(3)]  # (built here: manual_seed is process-wide)

    def run(i):
        results[i] = step(models[i], inputs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(3):
        for got, want in zip(results[i], alone[i]):
            assert torch.equal(got, want), f"thread {i}"


# ---- the fused block in training -------------------------------------------------------------------

def _stock_and_fused(activation, channels=8, layout="nchw", options=None):
    def model():
        torch.manual_seed(3)
        net = torch.nn.Sequential(torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False),
                                  torch.nn.BatchNorm2d(channels, **(options or {})), activation())
        return net.to(DEVICE).to(memory_format=LAYOUTS[layout])

    return model(), dwconv.convert(model(), fuse=True, precompile=False, verbose=False)


@pytest.mark.parametrize("native", ["0", "1"], ids=["python-function", "cpp-function"])
def test_training_block_runs_on_the_kernels(monkeypatch, native):
    """In training the fused block runs BatchNorm on the kernels (no stock BatchNorm): the Python
    Function (DWCONV_NATIVE=0), or the C++ one whose passes are recorded programs (=1; the first
    step records them); its gradients, running statistics and num_batches_tracked are stock's over
    several steps."""
    from dwconv.replay import native as replayer

    monkeypatch.setenv("DWCONV_NATIVE", native)
    stock, fused = _stock_and_fused(torch.nn.Hardswish, layout="channels_last")
    calls, recorded = [], []
    original = BatchNormActivationFunction.forward

    def counted(ctx, *args):
        calls.append(args[7])  # (the activation)
        return original(ctx, *args)

    monkeypatch.setattr(BatchNormActivationFunction, "forward", staticmethod(counted))
    register = replayer._register_norm
    monkeypatch.setattr(replayer, "_register_norm", lambda *a: recorded.append(1) or register(*a))
    stock_calls = []
    batch_norm = F.batch_norm
    monkeypatch.setattr(F, "batch_norm", lambda *a, **k: stock_calls.append(1) or batch_norm(*a, **k))
    for step in range(3):
        x = randn(4, 8, 6, 5).contiguous(memory_format=torch.channels_last)
        out = fused(x)
        assert not stock_calls, "stock BatchNorm ran"
        assert type(out.grad_fn).__name__ == ("CppFunction" if native == "1" else "BatchNormActivationFunctionBackward")
        ref = stock(x)
        stock_calls.clear()
        assert_close(out, ref, torch.float32, f"step {step}")
        grad = randn(*out.shape)
        out.backward(grad)
        ref.backward(grad)
    assert (calls, recorded) == (([], [1]) if native == "1" else (["hardswish"] * 3, []))
    for (name, p), p_ref in zip(fused.named_parameters(), stock.parameters()):
        assert_close(p.grad, p_ref.grad, torch.float32, f"grad of {name}")
    for (name, b), b_ref in zip(fused.named_buffers(), stock.buffers()):
        assert torch.equal(b, b_ref) if not b.is_floating_point() else True, name
        if b.is_floating_point():
            assert_close(b, b_ref, torch.float32, name)


def test_cpp_function_is_the_python_functions_bitwise(monkeypatch):
    """DWCONV_NATIVE=1: the fused block's BatchNorm through the C++ Function gives bitwise the Python
    Function's outputs, every gradient and running statistics over three steps; a backward that
    builds a graph (create_graph=True: a gradient penalty) takes PyTorch's ops as the Python
    Function's does; saved-tensor hooks see and hand back its saved tensors."""
    def run(native, penalty=False):
        monkeypatch.setenv("DWCONV_NATIVE", native)
        torch.manual_seed(5)
        _, fused = _stock_and_fused(torch.nn.SiLU, layout="nchw")
        results = []
        packed = []
        for step in range(3):
            x = randn(3, 8, 5, 7, generator=torch.Generator().manual_seed(step)).requires_grad_()
            with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t.clone(), lambda t: t):
                out = fused(x)
            grad = randn(*out.shape, generator=torch.Generator().manual_seed(10 + step))
            if penalty:
                (g,) = torch.autograd.grad(out, x, grad, create_graph=True)
                g.square().sum().backward()
            else:
                out.backward(grad)
            results += [out.detach(), x.grad] + [p.grad.clone() for p in fused.parameters()]
            fused.zero_grad()
        return results + [b.clone() for b in fused.buffers()], packed, type(out.grad_fn).__name__

    for penalty in (False, True):
        python, python_packed, python_node = run("0", penalty)
        cpp, cpp_packed, cpp_node = run("1", penalty)
        assert (python_node, cpp_node) == ("BatchNormActivationFunctionBackward", "CppFunction")
        assert len(cpp_packed) >= 3 * 5 and len(python) == len(cpp)
        for index, (got, expected) in enumerate(zip(cpp, python)):
            assert torch.equal(got, expected), f"value {index} (penalty {penalty})"


@pytest.mark.parametrize("how", ["eager", "compiled"])
def test_training_block_in_bfloat16_autocast(how):
    """Under bfloat16 autocast (the convolution's output bfloat16, BatchNorm's parameters float32),
    eager and compiled (the registered ops): output and the weights' gradients within half
    precision's error of float64 stock."""
    from test_integration import BACKEND

    stock, fused = _stock_and_fused(torch.nn.ReLU6, layout="channels_last")
    run = torch.compile(fused, fullgraph=True, backend=BACKEND) if how == "compiled" else fused
    x = randn(4, 8, 9, 7).contiguous(memory_format=torch.channels_last)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = run(x)
    ref = stock.double()(x.double())
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, torch.bfloat16, "output")
    grad = randn(*out.shape)
    out.backward(grad.to(out.dtype))
    ref.backward(grad.double())
    for (name, p), p_ref in zip(fused.named_parameters(), stock.parameters()):
        scale = max(1.0, p_ref.grad.abs().max().item())
        assert_close(p.grad / scale, p_ref.grad / scale, torch.bfloat16, f"grad of {name} over {scale:.3g}")


def test_training_block_with_one_value_a_channel_raises():
    _, fused = _stock_and_fused(torch.nn.SiLU)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        fused(randn(1, 8, 1, 1))


def test_training_block_under_forward_mode_ad_runs_stock():
    """Forward-mode AD sees PyTorch's ops (the Function has no jvp): tangents as stock's."""
    import torch.autograd.forward_ad as fwAD

    stock, fused = _stock_and_fused(torch.nn.SiLU)
    x, tangent = randn(2, 8, 5, 5), randn(2, 8, 5, 5)
    results = []
    for net in (stock, fused):
        with fwAD.dual_level():
            results.append(fwAD.unpack_dual(net(fwAD.make_dual(x, tangent))).tangent)
    assert_close(results[1], results[0], torch.float32, "tangent")


def test_opcheck_training_ops():
    """The ops a compiled training graph holds (the statistics, updating the running ones; the
    normalisation with its activation, whose backward op is BatchNorm's whole backward): opcheck,
    and their values against float64 F.batch_norm."""
    ops = torch.ops.dwconv
    y, weight, bias = _inputs((2, 5, 3, 7), torch.float32, "channels_last")
    running_mean, running_var = randn(5), randn(5).abs() + 0.5
    torch.library.opcheck(ops.batch_norm_statistics.default, (y, running_mean.clone(), running_var.clone(), 0.1, 1e-5),
                          test_utils=("test_schema", "test_faketensor"))
    for affine in ((weight, bias), (None, None)):
        mean, invstd = ops.batch_norm_statistics(y, running_mean.clone(), running_var.clone(), 0.1, 1e-5)
        arguments = (y.clone().requires_grad_(), *affine, mean, invstd, 1e-5, ACTIVATION_CODES["silu"])
        torch.library.opcheck(ops.batch_norm_activation.default, arguments)
        grad = randn(*y.shape)
        torch.library.opcheck(ops.batch_norm_activation_backward.default,
                              (grad, y, *affine, mean, invstd, 1e-5, ACTIVATION_CODES["silu"]),
                              test_utils=("test_schema", "test_faketensor"))
    updated_mean, updated_var = running_mean.clone(), running_var.clone()
    mean, invstd = ops.batch_norm_statistics(y, updated_mean, updated_var, 0.1, 1e-5)
    leaves = [t.detach().clone().requires_grad_() for t in (y, weight, bias)]
    out = ops.batch_norm_activation(*leaves, mean, invstd, 1e-5, ACTIVATION_CODES["silu"])
    grads = torch.autograd.grad(out, leaves, grad)
    ref, ref_mean, ref_var, ref_grads = _reference(y, weight, bias, running_mean, running_var, 0.1, 1e-5, "silu", grad)
    assert_close(out, ref, torch.float32, "output")
    assert_close(updated_mean, ref_mean, torch.float32, "running mean")
    assert_close(updated_var, ref_var, torch.float32, "running variance")
    for name, g, g_ref in zip(("y", "weight", "bias"), grads, ref_grads):
        assert_close(g, g_ref, torch.float32, f"grad of {name}")
    with pytest.raises(ValueError, match="activation must be a code"):
        ops.batch_norm_activation(y, weight, bias, mean, invstd, 1e-5, 8)
    # (an input that is neither NCHW nor dense channels_last: read as a copy, forward and backward)
    wide, _, _ = _inputs((2, 5, 3, 9), torch.float32, "nchw", seed=1)
    sliced = wide[..., 1:8].detach().requires_grad_()
    mean, invstd = ops.batch_norm_statistics(sliced.detach(), running_mean.clone(), running_var.clone(), 0.1, 1e-5)
    out = ops.batch_norm_activation(sliced, weight, bias, mean, invstd, 1e-5, ACTIVATION_CODES["relu6"])
    (grad_sliced,) = torch.autograd.grad(out, sliced, grad)
    ref, _, _, ref_grads = _reference(sliced, weight, bias, running_mean, running_var, 0.1, 1e-5, "relu6", grad)
    assert_close(out, ref, torch.float32, "output of a sliced input")
    assert_close(grad_sliced, ref_grads[0], torch.float32, "grad of a sliced input")


@pytest.mark.parametrize("momentum,native,layout", [(0.1, "0", "channels_last"), (0.1, "1", "channels_last"),
                                                    (0.1, "0", "nchw-without-affine"),
                                                    (None, "0", "channels_last"),
                                                    (0.1, "1", "channels_last-reduce-overhead")],
                         ids=["momentum", "momentum-served-from-cpp", "nchw-without-affine", "cumulative-average",
                              "cuda-graphs"])
def test_compiled_training_block_runs_the_registered_ops(momentum, native, layout, monkeypatch):
    """Under torch.compile (fullgraph) the fused model's BatchNorms in training are dwconv's ops
    (not Inductor's decomposition of F.batch_norm), in one graph with the convolutions; with a
    cumulative average (momentum None, whose weight reads the count back) the stock modules. Over
    three steps: outputs, each step's gradients, running statistics and num_batches_tracked as
    float64 stock's; with the C++ replayer serving the ops (DWCONV_NATIVE=1), the statistics op
    updating the running ones once a call, and each call recorded once; and replayed from CUDA
    graphs (mode="reduce-overhead", GPU only: the running statistics updated by each replay)."""
    from dwconv._env import triton_interpreter_enabled
    from test_fused import InvertedResidual
    from test_integration import BACKEND

    from dwconv.replay import native as replayer

    cuda_graphs = layout.endswith("reduce-overhead")
    if cuda_graphs and DEVICE != "cuda":
        pytest.skip("CUDA graphs")
    monkeypatch.setenv("DWCONV_NATIVE", native)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # (the 1x1 convolutions: float32's error alone)
    torch.manual_seed(0)
    stock = torch.nn.Sequential(_stock_and_fused(torch.nn.SiLU)[0], InvertedResidual()).to(DEVICE)
    for module in stock.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = momentum
            if layout == "nchw-without-affine":
                module.weight = module.bias = None
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    stock.double()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return torch._dynamo.lookup_backend(BACKEND)(gm, example_inputs)

    # (stock's BatchNorm itself breaks the graph with a cumulative average: it reads the count back)
    compiled = (torch.compile(fused, fullgraph=True, mode="reduce-overhead") if cuda_graphs
                else torch.compile(fused, fullgraph=momentum is not None, backend=backend))
    triton_interpreter_enabled()  # (read once before tracing: read first inside it, the CPU would recompile once)
    programs = []
    for step in range(3):
        x = randn(3, 8, 7, 5)
        x = x.contiguous(memory_format=torch.channels_last) if layout.startswith("channels_last") else x
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        out, ref = compiled(x), stock(x.double())
        assert_close(out, ref, torch.float32, f"step {step}")
        grad = randn(*out.shape)
        # (each step's gradients: a CUDA graph's outputs are its memory, which the next replay overwrites)
        grads = torch.autograd.grad(out, list(fused.parameters()), grad)
        ref_grads = torch.autograd.grad(ref, list(stock.parameters()), grad.double())
        for (name, _), g, g_ref in zip(fused.named_parameters(), grads, ref_grads):
            scale = max(1.0, g_ref.abs().max().item())
            assert_close(g / scale, g_ref / scale, torch.float32, f"step {step}: grad of {name} over {scale:.3g}")
        if native == "1":
            programs.append(replayer.extension().served_programs())
    if native == "1":  # (step 0 starts serving mid-graph; from step 1 on every call is known)
        assert programs[2] == programs[1] >= 12, programs  # (4 BatchNorms' 3 ops, the convolutions' more)
    code = "".join(graphs)
    if cuda_graphs:  # (Inductor's own backend: no graph to read)
        pass
    elif momentum is not None:
        assert len(graphs) == 1 and code.count("dwconv.batch_norm_statistics") == 4 and "batch_norm(" not in code, code
    else:  # (the modules' forwards, run by Dynamo's graph breaks)
        assert "dwconv.batch_norm" not in code, code
    for (name, b), b_ref in zip(fused.named_buffers(), stock.buffers()):
        if b.is_floating_point():
            assert_close(b, b_ref, torch.float32, name)
        else:
            assert torch.equal(b, b_ref.to(b.device)), name


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_training_block_under_activation_checkpointing(reentrant):
    """torch.utils.checkpoint recomputes the block in the backward (its saved tensors through
    checkpoint's hooks): the gradients and running statistics are stock's under the same
    checkpointing (which updates them again at the recomputation, as stock's BatchNorm does)."""
    from torch.utils.checkpoint import checkpoint

    stock, fused = _stock_and_fused(torch.nn.ReLU6, layout="channels_last")
    x = randn(3, 8, 7, 6).contiguous(memory_format=torch.channels_last)
    grad = randn(3, 8, 7, 6)
    for net in (stock, fused):
        xx = x.clone().requires_grad_()
        checkpoint(net, xx, use_reentrant=reentrant).backward(grad)
        net.input_grad = xx.grad
    assert_close(fused.input_grad, stock.input_grad, torch.float32, "input gradient")
    for (name, p), p_ref in zip(fused.named_parameters(), stock.parameters()):
        assert_close(p.grad, p_ref.grad, torch.float32, f"grad of {name}")
    for (name, b), b_ref in zip(fused.named_buffers(), stock.buffers()):
        assert_close(b, b_ref, torch.float32, name)


def _function_steps(steps, layout, momentum=0.1, replay=True):
    """`steps` forwards and backwards of the Function on fresh inputs of one layout, from fixed
    running statistics: [(output, grad_y, grad_weight, grad_bias)], running mean and variance."""
    running_mean, running_var = torch.zeros(5, device=DEVICE), torch.ones(5, device=DEVICE)
    results = []
    for step in range(steps):
        y, weight, bias = _inputs((3, 5, 4, 7), torch.float32, layout, seed=step)
        leaves = [t.clone().requires_grad_() for t in (y, weight, bias)]
        out = BatchNormActivationFunction.apply(*leaves, running_mean, running_var, momentum, 1e-5, "silu", replay)
        grad = randn(*out.shape, generator=torch.Generator().manual_seed(step)).contiguous(
            memory_format=LAYOUTS[layout])
        grads = torch.autograd.grad(out, leaves, grad)
        results.append((out, *grads))
    return results, running_mean, running_var


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_function_passes_replayed_from_cpp(monkeypatch, layout):
    """DWCONV_NATIVE=1: the Function's forward and backward passes recorded once for a layout
    (the forward's recording on copies of the running statistics), replayed after: outputs,
    gradients and running statistics after three steps bitwise the Python path's (each step's update
    applied once, the first step's too)."""
    from dwconv.replay import native

    recorded = []
    record_pass = native._record_pass
    monkeypatch.setattr(native, "_record_pass", lambda fn, *a: recorded.append(fn.__name__) or record_pass(fn, *a))
    monkeypatch.setattr(native, "_PASSES", {})
    monkeypatch.setenv("DWCONV_NATIVE", "0")
    expected = _function_steps(3, layout)
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    got = _function_steps(3, layout)
    assert recorded == ["batch_norm_forward", "batch_norm_backward"]
    assert all(program is not None for program in native._PASSES.values())
    for step, (values, expected_values) in enumerate(zip(got[0], expected[0])):
        for name, value, expected_value in zip(["output", "grad_y", "grad_weight", "grad_bias"], values,
                                               expected_values):
            assert torch.equal(value, expected_value), f"step {step}: {name}"
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2]), "running statistics"
    recorded.clear()
    passes = len(native._PASSES)
    _function_steps(2, layout, momentum=0.5, replay=False)  # (the cumulative average's: a momentum each call)
    assert not recorded and len(native._PASSES) == passes  # (its backward's pass is the one recorded above)


def test_function_pass_that_cannot_be_recorded_updates_once(monkeypatch):
    """A forward whose recording fails part way (after its running statistics' update) runs in
    Python, and the running statistics are updated once, as the Python path updates them."""
    from dwconv.replay import native, program

    def record_then_refuse(fn, inputs, *args):
        program.record(fn, inputs, *args)
        raise program.NotRecordable("refused for the test")

    monkeypatch.setattr(native, "_PASSES", {})
    monkeypatch.setenv("DWCONV_NATIVE", "0")
    expected = _function_steps(2, "channels_last")
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    monkeypatch.setattr(native, "record", record_then_refuse)
    got = _function_steps(2, "channels_last")
    assert list(native._PASSES.values()) == [None, None]
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2]), "running statistics"
    assert torch.equal(got[0][1][0], expected[0][1][0]), "output"


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("layout,shape,dtype", [
    ("channels_last", (4, 8, 6, 5), torch.float32), ("nchw", (4, 8, 6, 5), torch.float32),
    # (bench --block's first training row: its capture raised cudaErrorStreamCaptureImplicit on an
    # H100 where the small ones passed)
    ("nchw", (64, 32, 112, 112), torch.bfloat16), ("channels_last", (64, 32, 112, 112), torch.bfloat16)],
    ids=["cl-small", "nchw-small", "nchw-64x32x112x112-bf16", "cl-64x32x112x112-bf16"])
def test_training_block_captured_in_a_cuda_graph(layout, shape, dtype):
    """A fused block's training step captured in a CUDA graph after eager steps (which record its
    passes; the first on the default stream, the others and the capture on a side stream, as
    bench_models.graphed does) and replayed on new inputs: the output, the gradients and the running
    statistics of a twin stepped in eager on the same inputs."""
    import copy

    _, fused = _stock_and_fused(torch.nn.ReLU6, channels=shape[1], layout=layout)
    fused[0].to(dtype)  # (the convolution in the input's dtype, BatchNorm's parameters float32: as bench --block)
    twin = copy.deepcopy(fused)
    static_x = randn(*shape).to(dtype).contiguous(memory_format=LAYOUTS[layout]).requires_grad_()
    static_grad = randn(*shape).to(dtype).contiguous(memory_format=LAYOUTS[layout])

    def step(model, x):
        out = model(x)
        return (out, *torch.autograd.grad(out, [x, *model.parameters()], static_grad))

    step(fused, static_x), step(twin, static_x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(fused, static_x), step(twin, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured = step(fused, static_x)
    for replay in range(2):
        with torch.no_grad():
            static_x.copy_(randn(*shape))
        graph.replay()
        expected = step(twin, static_x.detach().clone().requires_grad_())
        for name, got, want in zip(["output", "grad_x", "grad_conv", "grad_gamma", "grad_beta"], captured, expected):
            assert_close(got, want, dtype, f"replay {replay}: {name}")
        for (name, got), want in zip(fused.named_buffers(), twin.buffers()):
            assert torch.equal(got, want), f"replay {replay}: {name}"
