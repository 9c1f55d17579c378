"""The fused depthwise block: activations in the forward kernels' epilogue, against F.conv2d and
PyTorch's activation in float64."""

import copy

import pytest
import torch
import torch.nn.functional as F

import dwconv
from dwconv._geometry import ACTIVATION_CODES, ACTIVATION_FUNCTIONS, INPUT_ACTIVATIONS, conv_geometry, forward_activation_code
from dwconv._library import conv_arguments
from dwconv.activations import FUNCTIONS, activation_code
from dwconv.dispatch import ForwardConfig, conv_forward
from dwconv.kernels import batch_norm as batch_norm_kernels
from dwconv.kernels import large_fma, tile
from dwconv.kernels.batch_norm import EvalNorm
from dwconv.kernels._shared import output_memory_format
from helpers import DEVICE, TOLERANCES, assert_close, poisoned, randn, reference_conv, relative_error

ACTIVATIONS = sorted(FUNCTIONS)


@pytest.fixture(autouse=True)
def float32_convolutions_without_tf32(monkeypatch):
    """Stock's float32 convolutions (and a fused model's cuDNN ones) against float64 within float32's
    error: on the GPU cuDNN computes them in TF32 by torch's default (up to 6e-4 relative, seen
    failing these tests' 1e-4 on the H100)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)

# every forward family, with blocks the interpreter runs: (config or None for large_fma's own,
# layout, kernel, stride, padding)
FAMILIES = {
    "tile": (ForwardConfig("tile", 4, 8, 1), "nchw", 3, 1, 1),
    "rows": (ForwardConfig("rows", 8, 16, 1), "nchw", 3, 1, 1),
    "rows-vec4": (ForwardConfig("rows", 8, 16, 1, 4), "nchw", 3, 1, 1),
    "nchw_pixels": (ForwardConfig("nchw_pixels", 4, 8, 1), "nchw", 3, 1, 1),
    "pairs": (ForwardConfig("pairs", 4, 8, 1), "nchw", 3, 2, 1),
    "nhwc_pixels": (ForwardConfig("nhwc_pixels", 2, 4, 1, block_c=8), "channels_last", 3, 1, 1),
    "nhwc": (ForwardConfig("nhwc", 4, 4, 1, block_c=8), "channels_last", 5, 2, 2),
    "large_fma": (None, "nchw", 5, 1, 2),
    "toeplitz": (ForwardConfig("toeplitz", 16, 16, 4), "nchw", 11, 1, 5),
}
# the tile kernel's rolled loop over kernel rows (one output row a program: kernels of more taps than
# max_band_taps), on a 5x5 kernel with the limit lowered below its 25 taps (ROLLED): a 17x17 one's
# 289 taps a program took the interpreter 33 s of CI's time
TILE_PATHS = dict(FAMILIES, **{"tile-rolled": (ForwardConfig("tile", 1, 8, 1), "nchw", 5, 2, 2)})
ROLLED = {"max_band_taps": 16}


def _eval_norm(dtype, affine=True):
    """A BatchNorm in eval mode over 8 channels (EvalNorm) with scales of both signs and shifts of 1
    to 3 (activated, never near 0); its statistics float32 (float64 for a float64 model)."""
    scale = randn(8) + 0.5 * torch.ones(8, device=DEVICE).copysign(randn(8))
    shift = (1 + 2 * torch.rand(8, device=DEVICE)) * torch.ones(8, device=DEVICE).copysign(randn(8))
    mean, var, eps = randn(8), 0.5 + 1.5 * torch.rand(8, device=DEVICE), 1e-3
    weight_bias = (scale * (var + eps).sqrt(), shift + mean * scale) if affine else (None, None)
    statistics_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return EvalNorm(*(None if t is None else t.to(statistics_dtype) for t in (*weight_bias, mean, var)), eps)


def _reference_eval_norm(y, norm):
    """F.batch_norm in eval mode of float64 y (norm: an EvalNorm)."""
    view = lambda t: t.double().view(1, -1, 1, 1)  # noqa: E731
    y = (y - view(norm.mean)) / (view(norm.var) + norm.eps).sqrt()
    return y if norm.weight is None else y * view(norm.weight) + view(norm.bias)


def activated_forward(family, activation, dtype, has_bias=True, input_activation=None, input_norm=False,
                      output_norm=False):
    """The family's forward through activation (and of input_activation's values of the input, where
    given; input_norm: of each input channel scaled and shifted before, a BatchNorm's, whose shifts
    would show in any padded output that read them; output_norm: of a BatchNorm of each output
    channel's sums before the activation, "plain": without weight and bias), and its reference."""
    config, layout, kernel, stride, padding = TILE_PATHS[family]
    # values around the activations' corners (relu6's 6, hardswish's -3 and 3): a 3x3 of these
    # spans about -15 .. 15
    x = (3 * randn(2, 8, 13, 16)).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight = randn(8, 1, kernel, kernel, dtype=dtype)
    bias = randn(8, dtype=dtype) if has_bias else None
    geom = conv_geometry(x, weight, bias, stride, padding, 1)
    if family == "large_fma":
        config = ForwardConfig("large_fma", *large_fma.large_fma_blocks(geom))
    out = poisoned(geom.output_shape, dtype, memory_format=output_memory_format(x))
    code = forward_activation_code(activation if input_activation is None else (input_activation, activation))
    norm = _eval_norm(dtype, input_norm != "plain") if input_norm else None
    after = _eval_norm(dtype, output_norm != "plain") if output_norm else None
    out = conv_forward(x, weight, bias, geom, config=config, out=out, activation=code, input_norm=norm,
                       output_norm=after)
    activated_input = x.double() if norm is None else _reference_eval_norm(x.double(), norm)
    if input_activation is not None:
        activated_input = FUNCTIONS[input_activation](activated_input)
    ref = reference_conv(activated_input, weight, bias, stride, padding, 1)
    return out, FUNCTIONS[activation](ref if after is None else _reference_eval_norm(ref, after))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_applies_the_activation(family):
    """Each family's epilogue (the activation's arithmetic is one helper: one activation here)."""
    out, ref = activated_forward(family, "hardswish", torch.float32)
    assert_close(out, ref, torch.float32, family)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("family", ["tile", "nhwc_pixels"])
def test_every_activation(family, activation):
    out, ref = activated_forward(family, activation, torch.float32)
    assert_close(out, ref, torch.float32, f"{family} {activation}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_half_precision_activates_before_rounding(activation, dtype):
    """Half precision: one rounding, after the activation (the channels_last pixel tiles, bfloat16 pairs)."""
    out, ref = activated_forward("nhwc_pixels", activation, dtype)
    assert_close(out, ref, dtype, activation)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_activates_its_input(family):
    """An input activation (the layer before's): the tile kernels apply it as they load, the other
    families read PyTorch's; the padding stays zeros."""
    out, ref = activated_forward(family, "relu6", torch.float32, input_activation="silu")
    assert_close(out, ref, torch.float32, family)


@pytest.mark.parametrize("input_activation", INPUT_ACTIVATIONS)
@pytest.mark.parametrize("family", ["tile", "nhwc_pixels", "nhwc"])
def test_every_input_activation(family, input_activation):
    out, ref = activated_forward(family, "identity", torch.float32, input_activation=input_activation)
    assert_close(out, ref, torch.float32, f"{family} {input_activation}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("input_activation", ["gelu", "silu"])
def test_half_precision_input_activation(input_activation, dtype):
    """The bfloat16 pairs' widened values are activated (the pixel tiles); on the GPU bfloat16's SiLU
    through tanh.approx, within bfloat16's tolerance of float64's."""
    out, ref = activated_forward("nhwc_pixels", "hardswish", dtype, input_activation=input_activation)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_normalizes_its_input(family):
    """The BatchNorm before an input activation (input_norm: scale and shift per channel): the tile
    kernels apply both as they load, with the padding zero after (the shifts would leak into every
    padded output otherwise); the other families read PyTorch's normalised, activated input."""
    out, ref = activated_forward(family, "relu6", torch.float32, input_activation="hardswish", input_norm=True)
    assert_close(out, ref, torch.float32, family)


@pytest.mark.parametrize("family, input_activation", [
    (family, activation) for family in ("tile", "nhwc_pixels", "nhwc") for activation in ("identity", "relu", "silu")]
    + [("tile-rolled", "silu")])
def test_input_norm_with_each_tile_path(family, input_activation, retune, monkeypatch):
    """Each tile path's input loads (the band's unrolled and rolled loops, the pixel rows, masked and
    interior), the BatchNorm alone (identity) or before an activation; before ReLU a BatchNorm
    without weight and bias."""
    launched = []
    if family == "tile-rolled":
        retune(**ROLLED)
        launch = tile.launch
        monkeypatch.setattr(tile, "launch", lambda kernel, plan, *tensors: launched.append(plan.constants)
                            or launch(kernel, plan, *tensors))
    out, ref = activated_forward(family, "identity", torch.float32, input_activation=input_activation,
                                 input_norm="plain" if input_activation == "relu" else True)
    assert_close(out, ref, torch.float32, f"{family} {input_activation}")
    if family == "tile-rolled":
        assert [constants["UNROLL"] for constants in launched] == [False], launched


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_applies_a_batch_norm_after(family):
    """The BatchNorm after the convolution (eval mode, conv_forward's output_norm), before the
    activation: each tile path applies it to its sums (the band's and the pixel rows' epilogues,
    masked and interior; the rolled loop's sums take the band's epilogue, and its 26 s under the
    interpreter are CI's: not here; the bias in its shift), with a BatchNorm and activation of the
    input too; the other families convolve with it folded by a launch first. Without weight and
    bias, and without the convolution's bias, on the pixel rows."""
    tiled = family in ("tile", "nhwc", "nhwc_pixels")
    out, ref = activated_forward(family, "silu", torch.float32, input_activation="relu" if tiled else None,
                                 input_norm=tiled, output_norm=True)
    assert_close(out, ref, torch.float32, family)
    if family == "nhwc_pixels":
        out, ref = activated_forward(family, "identity", torch.float32, has_bias=False, output_norm="plain")
        assert_close(out, ref, torch.float32, f"{family} plain")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_input_norm(dtype):
    """bfloat16 pairs' and float16's widened values normalised in float32, then activated (on the GPU
    bfloat16's SiLU through tanh.approx)."""
    out, ref = activated_forward("nhwc_pixels", "silu", dtype, input_activation="silu", input_norm=True)
    assert_close(out, ref, dtype)


def test_bfloat16_input_silu_through_tanh_on_the_gpu_only(monkeypatch):
    """FAST_SILU (inline PTX) for SiLU of bfloat16 inputs where kernels compile for the GPU; never under
    the interpreter, for other dtypes or activations."""
    from dwconv.kernels import tile

    silu, relu = activation_code("silu"), activation_code("relu")
    bf16, f16, f32 = (torch.empty(1, dtype=dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32))
    assert tile.input_activation_code(silu, bf16) == (silu if DEVICE == "cpu" else tile.FAST_SILU)
    monkeypatch.setattr(tile, "triton_interpreter_enabled", lambda: False)
    assert tile.input_activation_code(silu, bf16) == tile.FAST_SILU
    assert [tile.input_activation_code(silu, t) for t in (f16, f32)] == [silu, silu]
    assert tile.input_activation_code(relu, bf16) == relu


def test_input_activation_codes():
    """Only activations that map 0 to 0 apply to an input (the padding's zeros); bad codes raise."""
    from dwconv._geometry import split_activation_code

    code = forward_activation_code(("relu6", "silu"))
    assert split_activation_code(code) == (activation_code("relu6"), activation_code("silu"))
    with pytest.raises(ValueError, match="an input activation must be one of"):
        forward_activation_code(("hardsigmoid", "relu"))
    with pytest.raises(ValueError, match="activation must be one of"):  # (the public calls take names only)
        dwconv.depthwise_conv2d(randn(1, 3, 6, 6), randn(3, 1, 3, 3), activation=("relu", "relu"))
    x, weight = randn(1, 3, 6, 6), randn(3, 1, 3, 3)
    conv = conv_arguments(conv_geometry(x, weight, None, 1, 1, 1))
    for bad in (activation_code("hardsigmoid") * 16, 16 * 16, -1, 8):
        with pytest.raises(ValueError, match="activation must be a code"):
            torch.ops.dwconv.conv2d_activated(x, weight, None, *conv, bad)


@pytest.mark.parametrize("family", ["tile", "rows", "nhwc"])
def test_float64_activations(family):
    for activation in ("silu", "gelu", "gelu_tanh"):  # (exp and erf in float64)
        out, ref = activated_forward(family, activation, torch.float64, has_bias=False)
        assert_close(out, ref, torch.float64, f"{family} {activation}")


@pytest.mark.parametrize("family", ["tile", "nhwc_pixels"])
def test_float64_input_norm(family):
    """A float64 BatchNorm before the input activation: its scale and shift computed in float64 (in
    float32 they would be off by float32's rounding, far outside float64's tolerance)."""
    out, ref = activated_forward(family, "identity", torch.float64, input_activation="silu", input_norm=True)
    assert_close(out, ref, torch.float64, family)


# ---- the functional and the module ----------------------------------------------------------------

@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("activation", ["relu6", "silu", "hardswish"])
def test_functional_activation_without_and_with_gradients(activation, layout):
    """No gradient wanted: the fused epilogue; wanted: the same values, and gradients of input,
    weight and bias as PyTorch's conv + activation give (float64 reference)."""
    x = 3 * randn(2, 6, 9, 11)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight, bias = randn(6, 1, 3, 3), randn(6)
    ref = FUNCTIONS[activation](reference_conv(x, weight, bias, 1, 1, 1))
    with torch.no_grad():
        assert_close(dwconv.depthwise_conv2d(x, weight, bias, 1, 1, 1, activation), ref, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    out = dwconv.depthwise_conv2d(*leaves, 1, 1, 1, activation=activation)
    assert_close(out, ref, torch.float32)
    grad_out = randn(*out.shape)
    out.backward(grad_out)
    leaves64 = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    FUNCTIONS[activation](F.conv2d(*leaves64, 1, 1, 1, groups=6)).backward(grad_out.double())
    for leaf, leaf64, name in zip(leaves, leaves64, ("input", "weight", "bias")):
        assert_close(leaf.grad, leaf64.grad, torch.float32, f"grad of {name}")


def test_module_activation_and_bad_names():
    layer = dwconv.DepthwiseConv2d(4, 8, 3, padding=1, activation="gelu").to(DEVICE)
    assert "activation='gelu'" in repr(layer)
    x = randn(1, 4, 7, 5)
    with torch.no_grad():
        ref = F.gelu(reference_conv(x, layer.weight, layer.bias, 1, 1, 1))
        assert_close(layer(x), ref, torch.float32)
    assert set(layer.state_dict()) == {"weight", "bias"}
    for bad in ("swish", 1, F.relu):
        with pytest.raises(ValueError, match="activation must be one of"):
            dwconv.DepthwiseConv2d(4, 4, 3, activation=bad)
        with pytest.raises(ValueError, match="activation must be one of"):
            dwconv.depthwise_conv2d(x, randn(4, 1, 3, 3), activation=bad)


def test_activation_under_forward_mode_ad():
    """A tangent through the activated call: PyTorch's activation after dwconv's convolution."""
    import torch.autograd.forward_ad as fwAD

    x, weight, tangent = randn(1, 3, 6, 6), randn(3, 1, 3, 3), randn(1, 3, 6, 6)
    with fwAD.dual_level():
        out = dwconv.depthwise_conv2d(fwAD.make_dual(x, tangent), weight, None, 1, 1, 1, "silu")
        jvp = fwAD.unpack_dual(out).tangent
    x64 = x.double()
    _, ref = torch.func.jvp(lambda t: F.silu(F.conv2d(t, weight.double(), None, 1, 1, 1, groups=3)), (x64,),
                            (tangent.double(),))
    assert_close(jvp, ref, torch.float32, "tangent")


def test_warmup_compiles_the_activated_forward(tmp_path, monkeypatch):
    """A warmup's recorded call keeps the activation, and its pool compiles that forward (another
    binary than the plain one's), for sm_90 into an empty cache."""
    from dwconv.precompile import compile_calls, layer_calls

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    model = torch.nn.Sequential(dwconv.DepthwiseConv2d(4, 4, 3, padding=1, activation="relu6")).eval().to(DEVICE)
    with torch.no_grad():
        calls = layer_calls(model, randn(2, 4, 8, 8))
    assert [call.arguments for call in calls] == [((1, 1), (1, 1), (1, 1), "relu6")]
    report = compile_calls(calls, 90, workers=1, verbose=False)
    assert report.errors == [] and report.launches == 1


# ---- convert(fuse=True): BatchNorm folded, activation fused ---------------------------------------

def _bn(channels):
    """A BatchNorm2d with non-trivial statistics and affine parameters."""
    bn = torch.nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.running_mean.copy_(randn(channels))
        bn.running_var.copy_(torch.rand(channels) + 0.5)
        bn.weight.copy_(randn(channels))
        bn.bias.copy_(randn(channels))
    return bn


def _block(activation=torch.nn.ReLU6, channels=8, kernel=3, stride=1, bias=False):
    return torch.nn.Sequential(torch.nn.Conv2d(channels, channels, kernel, stride, kernel // 2, groups=channels,
                                               bias=bias), _bn(channels), activation())


class Residual(torch.nn.Module):
    """timm's kind of block: named children called in its forward, a residual around them."""

    def __init__(self):
        super().__init__()
        # (no bias, as before any BatchNorm: in training its gradient is zero, computed as rounding noise)
        self.conv_dw = torch.nn.Conv2d(8, 8, 5, padding=2, groups=8, bias=False)
        self.bn1 = _bn(8)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return self.act(self.bn1(self.conv_dw(x))) + x


def _assert_same_model(stock, fused, x, what):
    with torch.no_grad():
        ref = stock.double()(x.double())
        stock.float()
        assert_close(fused(x), ref, torch.float32, what)


@pytest.mark.parametrize("activation", [torch.nn.ReLU6, torch.nn.SiLU, torch.nn.Hardswish, torch.nn.Identity])
def test_fused_block_in_eval_mode(activation, capsys):
    stock = torch.nn.Sequential(_block(activation, bias=True), _block(activation, stride=2)).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False)
    printed = capsys.readouterr().out
    activations = 0 if activation is torch.nn.Identity else 2
    assert (f"fused 2 depthwise block(s) (2 BatchNorm2d folded in eval mode, on dwconv's kernels in training; "
            f"{activations} activation(s) fused)") in printed
    assert type(fused[0][0]).__name__ == "FusedDepthwiseConv2d" and type(fused[0][1]).__name__ == "FoldedBatchNorm2d"
    assert isinstance(fused[0][1], torch.nn.BatchNorm2d) and isinstance(fused[0][2], activation)
    assert list(fused.state_dict()) == list(stock.state_dict())
    x = randn(2, 8, 9, 11)
    _assert_same_model(stock, fused, x, "eval")
    # the running statistics change in place: the folded weights follow
    with torch.no_grad():
        fused[1][1].running_var.mul_(3)
        stock[1][1].running_var.mul_(3)
    _assert_same_model(stock, fused, x, "eval after a change of statistics")


def _trains_as_stock(stock, fused, x, steps=2):
    """Training steps of both models on x: outputs, then every parameter's gradient and every buffer
    (running statistics, num_batches_tracked) as stock's; then both in eval mode on the statistics.
    Each gradient's error against a float64 copy of stock is at most 4 times stock float32's own
    (with a floor of 1e-4 of the gradient's largest element): an element that is a sum of terms
    that cancel (a bias before a BatchNorm in training) is rounding at the terms' scale in both."""
    exact = copy.deepcopy(stock).double()
    for step in range(steps):
        out, ref, ref64 = fused(x), stock(x), exact(x.double())
        assert_close(out, ref, torch.float32, f"training output, step {step}")
        grad_out = randn(*out.shape)
        for y in (out, ref, ref64):
            y.backward(grad_out.to(y.dtype))
    for (name, p), p_ref, p64 in zip(fused.named_parameters(), stock.parameters(), exact.parameters()):
        error, stock_error = ((g.double() - p64.grad).abs().max().item() for g in (p.grad, p_ref.grad))
        allowed = 4 * stock_error + 1e-4 * max(1.0, p64.grad.abs().max().item())
        assert error <= allowed, f"grad of {name}: {error:.3g} from float64's (stock float32's {stock_error:.3g})"
    for (name, b), b_ref in zip(fused.named_buffers(), stock.buffers()):
        assert_close(b, b_ref, torch.float32, name)
    fused.eval(), stock.eval()
    _assert_same_model(stock, fused, x, "eval after training")


def test_fused_block_trains_as_the_stock_block():
    """Training mode: BatchNorm on the batch's statistics, running statistics updated, gradients
    of every parameter as stock's; then eval on the updated statistics."""
    stock = torch.nn.Sequential(_block(), Residual()).train().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    assert type(fused[1].conv_dw).__name__ == "FusedDepthwiseConv2d"  # (the traced residual block)
    _trains_as_stock(stock, fused, randn(4, 8, 9, 11))


def test_fused_block_in_eval_mode_with_gradients():
    """Eval mode with gradients (frozen statistics, fine-tuning): the folding is differentiated,
    parameters of the layer and of the BatchNorm get stock's gradients."""
    stock = _block(torch.nn.SiLU, bias=True).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    x = randn(2, 8, 9, 11).requires_grad_()
    out, ref = fused(x), stock(x)
    assert_close(out, ref, torch.float32)
    grad_out = randn(*out.shape)
    out.backward(grad_out)
    grad_x = x.grad.clone()
    x.grad = None
    ref.backward(grad_out)
    assert_close(grad_x, x.grad, torch.float32, "grad of the input")
    for (name, p), p_ref in zip(fused.named_parameters(), stock.parameters()):
        assert_close(p.grad, p_ref.grad, torch.float32, f"grad of {name}")


class BatchNormAct2d(torch.nn.BatchNorm2d):
    """As timm's: BatchNorm, then drop (Identity), then its activation (here through super())."""

    def __init__(self, channels):
        super().__init__(channels)
        self.drop = torch.nn.Identity()
        self.act = torch.nn.Hardswish()

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


def test_timm_batch_norm_act_folds_with_its_activation():
    norm = BatchNormAct2d(8)
    norm.load_state_dict(_bn(8).state_dict())  # (then moved with the model)
    stock = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), norm).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    assert fused[0].dwconv_activation == "hardswish"
    _assert_same_model(stock, fused, randn(2, 8, 7, 9), "eval")
    fused.train(), stock.train()
    x = randn(2, 8, 7, 9)
    assert_close(fused(x), stock(x), torch.float32, "training")


class Shared(torch.nn.Module):
    """Blocks that must not fuse: a BatchNorm used twice, a layer whose output also feeds a residual."""

    def __init__(self):
        super().__init__()
        # (conv_b without a bias: only a BatchNorm takes its output, so in training that bias's gradient is
        # zero, computed as rounding noise)
        self.conv_a = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.conv_b = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn = _bn(8)

    def forward(self, x):
        y = self.conv_a(x)
        return self.bn(y) + y + self.bn(self.conv_b(x))


class Branching(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _block()
        # (no bias before the BatchNorm: in training its gradient is zero, computed as rounding noise)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn = _bn(8)

    def forward(self, x):
        if x.sum() > 0:  # (control flow on a value: torch.fx cannot trace it)
            x = -x
        return self.bn(self.conv(self.block(x)))


def test_what_cannot_be_proven_is_left_alone(capsys):
    hooked = _block()
    hooked[1].register_forward_hook(lambda module, args, out: out * 2)
    functional_act = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1, groups=8))
    reflect = torch.nn.Sequential(dwconv.DepthwiseConv2d(8, 8, 3, padding=1, padding_mode="reflect"), _bn(8))
    stock = torch.nn.Sequential(Shared(), Branching(), hooked, functional_act, reflect).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False)
    printed = capsys.readouterr().out
    # only Branching's inner Sequential block fuses; its own conv -> bn is not proven
    assert "fused 1 depthwise block(s)" in printed, printed
    assert "not fused (its module's forward does not trace with torch.fx)" in printed
    assert "not fused (followed by neither a BatchNorm2d nor an activation module)" in printed
    assert "1 not fused (used twice, hooked, already activated or padding other than zeros)" in printed
    assert [type(m).__name__ for m in fused.modules()].count("FusedDepthwiseConv2d") == 1
    _assert_same_model(stock, fused, randn(2, 8, 9, 11), "eval")


def test_fused_model_saves_copies_and_loads(tmp_path):
    import copy
    import io

    stock = torch.nn.Sequential(_block(torch.nn.ReLU), Residual()).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    x = randn(2, 8, 9, 11)
    with torch.no_grad():
        expected = fused(x)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(fused)):
        assert other[0][0].dwconv_norm is other[0][1]  # (its own BatchNorm, not the original's)
        assert fused_now_all(other)  # (its blocks found where their own modules are, still fused)
        with torch.no_grad():
            assert_close(other(x), expected, torch.float32)
    # the fused model's state_dict loads into the stock model
    plain = torch.nn.Sequential(_block(torch.nn.ReLU), Residual()).eval().to(DEVICE)
    plain.load_state_dict(fused.state_dict())
    _assert_same_model(plain, fused, x, "stock with the fused model's state")


def test_eval_block_runs_one_activated_kernel(monkeypatch):
    """Eval mode without gradients: one forward launch with the activation in its epilogue, after
    one launch that folds the BatchNorm into the weights, at every call (the Python path's launches:
    the C++ path's replays of the recorded call are test_native's)."""
    from dwconv import _library
    from dwconv.kernels import batch_norm as batch_norm_kernels

    monkeypatch.setenv("DWCONV_NATIVE", "0")

    stock = _block(torch.nn.Hardswish).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    activations, folds = [], []
    forward, fold = _library.conv_forward, batch_norm_kernels.fold
    monkeypatch.setattr(_library, "conv_forward", lambda *a, **k: activations.append(k.get("activation")) or
                        forward(*a, **k))
    monkeypatch.setattr(batch_norm_kernels, "fold", lambda *a: folds.append(1) or fold(*a))
    with torch.no_grad():
        for _ in range(3):
            fused(randn(2, 8, 9, 11))
    assert activations == [6, 6, 6] and len(folds) == 3


@pytest.mark.parametrize("native", ["0", "1"], ids=["python-path", "cpp-path"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_eval_folding_sees_changes_made_through_data(autocast, native, monkeypatch):
    """A parameter or statistic changed in place through `.data` (no version counter moves, as in an
    old EMA's update) between two eval calls: the next call folds the new values, in a depthwise
    block and in a pointwise convolution's block, and the activation-only block's autocast cast
    follows its weight too; on the Python path and replayed from C++."""
    monkeypatch.setenv("DWCONV_NATIVE", native)
    stock = torch.nn.Sequential(InvertedResidual(), _block(torch.nn.SiLU)[0], torch.nn.SiLU()).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    assert [type(m).__name__ for m in (fused[0].expand, fused[0].dw, fused[1])] == \
        ["FoldingConv2d", "FusedDepthwiseConv2d", "FusedDepthwiseConv2d"]
    x = randn(2, 8, 7, 9)
    changes = [lambda m: m[0].bn1.running_var.data.mul_(3), lambda m: m[0].bn2.weight.data.mul_(-2),
               lambda m: m[0].expand.weight.data.add_(1), lambda m: m[0].dw.weight.data.mul_(0.5),
               lambda m: m[0].bn3.running_mean.data.add_(1), lambda m: m[1].weight.data.mul_(-1)]
    # (an autocast region a call: within one, PyTorch's autocast keeps its casts of the weights, so that
    # stock would not see the changes)
    def run(model):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            return model(x).float()

    with torch.no_grad():
        run(fused)
        for change in changes:
            change(fused), change(stock)
            out, ref = run(fused).double(), run(stock).double()
            exact = copy.deepcopy(stock).double()(x.double())
            # (within 4 times stock's own error against float64: a stale folding is off by the output's scale)
            error, stock_error = (out - exact).abs().max().item(), (ref - exact).abs().max().item()
            floor = (1e-3 if autocast else 1e-5) * exact.abs().max().item()
            assert error <= 4 * stock_error + floor, f"{error:.3g} from float64's after a change (stock {stock_error:.3g})"


@pytest.mark.parametrize("member", ["expand", "dw", "bn1", "bn2"])
def test_a_parametrized_module_runs_its_block_as_stock(member):
    """A parametrization added after convert (torch.nn.utils.parametrize: weight_norm on a
    convolution, or any on a BatchNorm's weight) computes the parameter at each access: that block
    runs its modules as before (in eval and training, with and without gradients), the others stay
    fused; stock's outputs and gradients either way."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    class Doubled(torch.nn.Module):
        def forward(self, weight):
            return 2 * weight

    stock = InvertedResidual().to(DEVICE)
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    for model in (stock, fused):
        module = getattr(model, member)
        weight_norm(module) if member in ("expand", "dw") else parametrize.register_parametrization(
            module, "weight", Doubled())
    x = randn(4, 8, 7, 9)
    for mode in ("train", "eval"):
        fused.train(mode == "train"), stock.train(mode == "train")
        with torch.no_grad():
            assert_close(fused(x), stock(x), torch.float32, f"{mode} output, no gradient")
        out, ref = fused(x), stock(x)
        assert_close(out, ref, torch.float32, f"{mode} output")
        grad = randn(*out.shape)
        grads = [torch.autograd.grad(y, list(model.parameters()), grad) for y, model in ((out, fused), (ref, stock))]
        for (name, _), g, g_ref in zip(fused.named_parameters(), *grads):
            scale = max(1.0, g_ref.abs().max().item())
            assert_close(g / scale, g_ref / scale, torch.float32, f"{mode} grad of {name} over {scale:.3g}")
    from dwconv.fuse import fused_now

    blocks = {id(m.dwconv_block): m.dwconv_block for m in fused.modules() if hasattr(m, "dwconv_block")}
    assert sorted(fused_now(block) for block in blocks.values()) == [False, True, True]


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_fused_model_under_torch_compile(mode):
    """fullgraph=True: the foldings (into the depthwise layers and into the pointwise convolutions) and
    the activation traced (no graph break), the same values as eager."""
    from test_integration import BACKEND

    stock = torch.nn.Sequential(_block(), Residual(), InvertedResidual()).train(mode == "train").to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    compiled = torch.compile(fused, fullgraph=True, backend=BACKEND)
    x = randn(2, 8, 9, 11)
    with torch.no_grad():
        assert_close(compiled(x), fused(x), torch.float32, "compiled")


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_compiled_fused_eval_model_against_stock(layout):
    """Compiled in eval mode: one block op a depthwise layer (the expansion's BatchNorm and ReLU6
    applied by the one after it), the projection's BatchNorm left to Inductor, nothing folded in the
    graph; stock's values in float64."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    stock = torch.nn.Sequential(_block(), InvertedResidual()).eval().to(DEVICE)
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    backend = EagerAndRecordGraphs()
    compiled = torch.compile(fused, fullgraph=True, backend=backend)
    _assert_same_model(stock, compiled, randn(2, 8, 9, 11).contiguous(memory_format=memory_format), "compiled")
    (graph,) = backend.graphs
    code = graph.code
    assert code.count("dwconv.conv2d_block") == 2 and code.count("batch_norm(") == 1 and "rsqrt" not in code, code


def test_traced_and_exported_fused_eval_model():
    """torch.jit.trace and torch.export of a fused model in eval mode without gradients hold one block
    op a depthwise layer, and compute stock's values on a fresh input."""
    stock = torch.nn.Sequential(_block(), InvertedResidual()).eval().to(DEVICE)
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    x, fresh = (randn(2, 8, 9, 11).contiguous(memory_format=torch.channels_last) for _ in range(2))
    with torch.no_grad():
        traced = torch.jit.trace(fused, x)
        exported = torch.export.export(fused, (x,))
        assert [n.kind() for n in traced.inlined_graph.nodes() if "dwconv" in n.kind()] == ["dwconv::conv2d_block"] * 2
        assert [str(n.target) for n in exported.graph.nodes if "dwconv" in str(n.target)] == \
            ["dwconv.conv2d_block.default"] * 2
        _assert_same_model(stock, traced, fresh, "traced")
        _assert_same_model(stock, exported.module(), fresh, "exported")


def test_fx_trace_of_a_fused_model_decides_when_it_runs():
    """torch.fx records each module of a fused block as one call: the GraphModule folds in eval
    mode and trains as the stock block in training mode, whichever mode it was traced in."""
    stock = torch.nn.Sequential(_block(), Residual()).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    traced = torch.fx.symbolic_trace(fused)
    calls = [node.target for node in traced.graph.nodes if node.op == "call_module"]
    assert calls[:3] == ["0.0", "0.1", "0.2"], calls
    x = randn(2, 8, 9, 11)
    _assert_same_model(stock, traced, x, "traced, eval")
    traced.train(), stock.train()
    assert_close(traced(x), stock(x), torch.float32, "traced, training")


def test_opcheck_activated_op():
    """The forward op with an activation (what a compiled graph holds where no gradient is wanted)."""

    x, weight, bias = randn(1, 3, 6, 11), randn(6, 1, 3, 3), randn(6)
    conv = conv_arguments(conv_geometry(x, weight, bias, 2, 1, 1))
    for code in (2, 3):
        torch.library.opcheck(torch.ops.dwconv.conv2d_activated.default, (x, weight, bias, *conv, code),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
        out = torch.ops.dwconv.conv2d_activated(x, weight, bias, *conv, code)
        ref = FUNCTIONS[["relu6", "silu"][code - 2]](reference_conv(x, weight, bias, 2, 1, 1))
        assert_close(out, ref, torch.float32)
    with pytest.raises(ValueError, match="activation must be a code"):
        torch.ops.dwconv.conv2d_activated(x, weight, bias, *conv, 8)


def _norm_tensors(channels, affine=True):
    """A BatchNorm's (weight, bias, running mean, running variance) with values that matter (scales of
    0.5 to 2: half precision's tolerance is relative to each value, and larger ones cancel)."""
    weight = 0.5 + torch.rand(channels, device=DEVICE)
    weight, bias = (weight, randn(channels)) if affine else (None, None)
    return weight, bias, randn(channels), torch.rand(channels, device=DEVICE) + 0.5


def _reference_norm(y, norm, eps):
    """F.batch_norm in eval mode of y in float64 on the CPU (norm: _norm_tensors')."""
    weight, bias, mean, var = (None if t is None else t.double().cpu() for t in norm)
    return F.batch_norm(y.double().cpu(), mean, var, weight, bias, False, 0.0, eps)


@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
@pytest.mark.parametrize("case", ["both", "after", "before", "neither", "no affine"])
def test_block_op(case, layout, monkeypatch):
    """The fused block's eval op: the BatchNorm after applied to the sums by the tile kernels
    (channels_last here: no folding launch) or folded by a launch for the other families (NCHW 3x3
    here: large_fma), the one before and its activation applied to the input as it loads; opcheck,
    and values against F.conv2d and F.batch_norm in float64."""
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x, weight, bias = randn(2, 6, 9, 11).contiguous(memory_format=memory_format), randn(6, 1, 3, 3), randn(6)
    after = _norm_tensors(6, case != "no affine") if case in ("both", "after", "no affine") else (None,) * 4
    before = _norm_tensors(6, case != "no affine") if case in ("both", "before", "no affine") else (None,) * 4
    conv = conv_arguments(conv_geometry(x, weight, bias, 1, 1, 1))
    code = forward_activation_code(("silu", "relu6") if before[2] is not None else "relu6")
    args = (x, weight, bias, *after, 1e-3, *before, 1e-5, *conv, code)
    folds = []
    fold = batch_norm_kernels.fold
    monkeypatch.setattr(batch_norm_kernels, "fold", lambda *a: folds.append(1) or fold(*a))
    torch.library.opcheck(torch.ops.dwconv.conv2d_block.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    out = torch.ops.dwconv.conv2d_block(*args)
    assert bool(folds) == (after[2] is not None and layout == "nchw"), folds
    ref = x if before[2] is None else F.silu(_reference_norm(x, before, 1e-5))
    ref = reference_conv(ref, weight, bias, 1, 1, 1)
    if after[2] is not None:
        ref = _reference_norm(ref, after, 1e-3)
    assert_close(out, F.relu6(ref), torch.float32, case)


@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
def test_block_op_computes_in_the_input_dtype(layout):
    """float32 weight and BatchNorm (autocast's parameters) with a bfloat16 input: a bfloat16 output.
    The tile kernels (channels_last) read the float32 weight as it is and apply the BatchNorm to
    their float32 sums; the other families (NCHW here) convolve with the weight and bias folded and
    rounded to bfloat16, as autocast's convolution rounds its weight, and read PyTorch's normalised
    input in bfloat16."""
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = randn(2, 8, 7, 9).to(torch.bfloat16).contiguous(memory_format=memory_format)
    weight, norm = randn(8, 1, 3, 3), _norm_tensors(8)
    conv = conv_arguments(conv_geometry(x, weight.to(torch.bfloat16), None, 1, 1, 1))
    out = torch.ops.dwconv.conv2d_block(x, weight, None, *norm, 1e-5, *norm, 1e-5, *conv,
                                        forward_activation_code(("relu", "identity")))
    assert out.dtype == torch.bfloat16
    from dwconv.fuse import fold_parameters

    folded = fold_parameters(weight.double(), None, *(t.double() for t in norm), 1e-5)
    activated = F.relu(_reference_norm(x, norm, 1e-5))
    if layout == "nchw":  # (and its input normalised by PyTorch, in bfloat16)
        folded, activated = tuple(t.to(torch.bfloat16) for t in folded), activated.to(torch.bfloat16)
    ref = reference_conv(activated, *folded, 1, 1, 1)
    assert_close(out, ref, torch.bfloat16)


def test_block_op_refuses_bad_norms():
    x, weight = randn(1, 4, 6, 6), randn(4, 1, 3, 3)
    conv = conv_arguments(conv_geometry(x, weight, None, 1, 1, 1))
    good = _norm_tensors(4)
    with pytest.raises(ValueError, match="norm_var must be given with norm_mean|norm_weight and norm_bias"):
        torch.ops.dwconv.conv2d_block(x, weight, None, *good[:3], None, 1e-5, *(None,) * 4, 0.0, *conv, 0)
    with pytest.raises(ValueError, match="input_mean must be a contiguous floating vector of 4 channels"):
        torch.ops.dwconv.conv2d_block(x, weight, None, *(None,) * 4, 0.0, *good[:2], randn(5), good[3], 1e-5,
                                      *conv, 0)
    with pytest.raises(ValueError, match="norm_weight and norm_bias must be given together"):
        torch.ops.dwconv.conv2d_block(x, weight, None, good[0], None, *good[2:], 1e-5, *(None,) * 4, 0.0, *conv, 0)
    with pytest.raises(ValueError, match="input_mean must be given with input_var"):  # (never silently ignored)
        torch.ops.dwconv.conv2d_block(x, weight, None, *(None,) * 4, 0.0, None, None, None, good[3], 1e-5, *conv, 0)
    with pytest.raises(ValueError, match="norm_mean must be given with norm_var"):
        torch.ops.dwconv.conv2d_block(x, weight, None, *good[:2], None, good[3], 1e-5, *(None,) * 4, 0.0, *conv, 0)


@pytest.mark.parametrize("affine,bias,activation", [(True, True, "relu"), (False, False, "identity"),
                                                     (True, False, "relu6"), (False, True, "silu"),
                                                     (True, True, "gelu"), (True, True, "hardsigmoid"),
                                                     (None, False, "identity"), (None, True, "relu"),
                                                     (None, False, "relu")])
def test_pointwise_folded_op(affine, bias, activation):
    """A trained block's eval 1x1 convolution as one op: the BatchNorm folded (affine None: no
    BatchNorm), then the product and the activation (ReLU in the product's epilogue,
    `_addmm_activation`, where there is a bias; the others after it); opcheck, values against F.conv2d,
    F.batch_norm and the activation in float64, a channels_last output. The weight channels_last (a
    model's .to(memory_format) makes it so), or strided where nothing is folded (read as it lies)."""
    x = randn(2, 6, 5, 7).contiguous(memory_format=torch.channels_last)
    weight = randn(9, 12, 1, 1)[:, ::2] if affine is None else randn(9, 6, 1, 1).contiguous(
        memory_format=torch.channels_last)
    conv_bias = randn(9) if bias else None
    norm = (None,) * 4 if affine is None else _norm_tensors(9, affine)
    args = (x, weight, conv_bias, *norm, 1e-3, ACTIVATION_CODES[activation])
    torch.library.opcheck(torch.ops.dwconv.pointwise_folded.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = torch.ops.dwconv.pointwise_folded(*args)  # (also where the C++ replayer serves it)
    epilogues = [e.count for e in profile.key_averages() if e.key == "aten::_addmm_activation"]
    assert epilogues == ([1] if activation == "relu" and (affine is not None or bias) else []), epilogues
    assert out.is_contiguous(memory_format=torch.channels_last)
    ref = F.conv2d(x.double(), weight.double(), None if conv_bias is None else conv_bias.double())
    ref = ref if affine is None else _reference_norm(ref, norm, 1e-3)
    assert_close(out, ACTIVATION_FUNCTIONS[activation](ref), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (3, 70, 5, 7, 67), (2, 16, 1, 13, 130), (1, 3, 11, 1, 2)])
def test_pointwise_folded_sizes_and_dtypes(shape, dtype):
    """The op over odd, prime and one-element sizes, every dtype, the weight, bias and BatchNorm in
    float32 (autocast's parameters; float64 for a float64 input, as a float64 model's); against
    float64 (the folded weight rounds in half precision: judged against the size of the sum's terms)."""
    batch, in_channels, height, width, out_channels = shape
    parameters = torch.float64 if dtype == torch.float64 else torch.float32
    x = randn(batch, in_channels, height, width, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight, bias = randn(out_channels, in_channels, 1, 1, dtype=parameters), randn(out_channels, dtype=parameters)
    norm = tuple(t.to(parameters) for t in _norm_tensors(out_channels))
    out = torch.ops.dwconv.pointwise_folded(x, weight, bias, *norm, 1e-5, ACTIVATION_CODES["silu"])
    assert out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last)
    x64, weight_cast, bias64 = x.double().cpu(), weight.to(dtype).double().cpu(), bias.double().cpu()
    ref = F.silu(_reference_norm(F.conv2d(x64, weight_cast, bias64), norm, 1e-5))
    # (a sum of in_channels products: judged against the size of its terms, as the weight gradient's
    # tests are, the BatchNorm's scale applied to them; SiLU's slope is under 1.1)
    scale = (norm[0].double() / (norm[3].double() + 1e-5).sqrt()).abs().cpu()
    terms = F.conv2d(x64.abs(), weight_cast.abs(), bias64.abs()) * scale[:, None, None]
    atol, rtol = TOLERANCES[dtype]
    out = out.double().cpu()
    excess = (out - ref).abs() - (atol + rtol * (ref.abs() + 1.1 * terms))
    worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    assert not out.isnan().any() and excess.max() <= 0, \
        f"{int((excess > 0).sum())} of {out.numel()} beyond tolerance, worst at {worst}: got {out[worst].item():.6g}, " \
        f"expected {ref[worst].item():.6g}"


def test_pointwise_folded_op_refuses_bad_arguments():
    x, weight, norm = randn(1, 4, 3, 3).contiguous(memory_format=torch.channels_last), randn(5, 4, 1, 1), _norm_tensors(5)
    with pytest.raises(ValueError, match="input must be a channels_last 4-D tensor"):
        torch.ops.dwconv.pointwise_folded(randn(1, 4, 3, 5), weight, None, *norm, 1e-5, 0)
    with pytest.raises(ValueError, match=r"weight must be of shape \(out_channels, 4, 1, 1\)"):
        torch.ops.dwconv.pointwise_folded(x, randn(5, 4, 3, 3), None, *norm, 1e-5, 0)
    with pytest.raises(ValueError, match="norm_mean must be a contiguous floating vector of 5 channels"):
        torch.ops.dwconv.pointwise_folded(x, weight, None, *norm[:2], randn(4), norm[3], 1e-5, 0)
    with pytest.raises(ValueError, match="activation must be a code of"):
        torch.ops.dwconv.pointwise_folded(x, weight, None, *norm, 1e-5, 99)
    with pytest.raises(ValueError, match="norm_mean must be given with norm_var"):  # (never silently ignored)
        torch.ops.dwconv.pointwise_folded(x, weight, None, *norm[:2], None, norm[3], 1e-5, 0)


def test_compiled_eval_graph_holds_the_activated_op():
    """Compiled without gradients, a fused block is one dwconv op with its activation (no separate
    activation pass); with gradients, conv2d and the activation after it."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    stock = _block(torch.nn.SiLU).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    backend = EagerAndRecordGraphs()
    compiled = torch.compile(fused, fullgraph=True, backend=backend)
    x = randn(2, 8, 9, 11)
    with torch.no_grad():
        out = compiled(x)
    _assert_same_model(stock, fused, x, "eager")
    assert_close(out, fused(x).detach(), torch.float32, "compiled")
    code = backend.graphs[0].code
    assert "dwconv.conv2d_block" in code and "silu" not in code and "batch_norm" not in code, code


@pytest.mark.parametrize("family", ["tile", "nhwc_pixels"])
def test_activations_keep_nan(family):
    """A NaN input reaches the outputs it feeds through every activation, as PyTorch's do (relu's and
    clamp's NaN-propagating min and max)."""
    config, layout, kernel, stride, padding = FAMILIES[family]
    x = randn(1, 8, 7, 9)
    x[0, 3, 2, 4] = float("nan")
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight = randn(8, 1, kernel, kernel)
    geom = conv_geometry(x, weight, None, stride, padding, 1)
    for activation in ACTIVATIONS:
        out = poisoned(geom.output_shape, x.dtype, memory_format=output_memory_format(x)).zero_()
        out = conv_forward(x, weight, None, geom, config=config, out=out, activation=activation_code(activation))
        ref = FUNCTIONS[activation](reference_conv(x, weight, None, stride, padding, 1))
        assert torch.equal(out.isnan().cpu(), ref.isnan()), f"{family} {activation}: NaN positions differ"
        assert ref.isnan().sum() == 9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_input_silu_of_special_values(dtype):
    """The input's SiLU as the pixel tiles apply it (bfloat16 on the GPU: through tanh.approx) keeps
    PyTorch's NaN, infinities (silu(-inf) is NaN there) and signed large values."""
    config, _, kernel, stride, padding = FAMILIES["nhwc_pixels"]
    x = randn(1, 8, 9, 11)
    for (c, h, w), value in zip([(0, 1, 1), (2, 4, 8), (3, 7, 2), (5, 2, 5), (6, 6, 9), (7, 0, 0)],
                                [float("nan"), float("inf"), -float("inf"), 1e30, -1e30, -90.0]):
        x[0, c, h, w] = value
    x = x.to(dtype).contiguous(memory_format=torch.channels_last)
    weight = randn(8, 1, kernel, kernel, dtype=dtype)
    geom = conv_geometry(x, weight, None, stride, padding, 1)
    out = poisoned(geom.output_shape, dtype, memory_format=output_memory_format(x))
    out = conv_forward(x, weight, None, geom, config=config, out=out,
                       activation=forward_activation_code(("silu", "identity"))).double().cpu()
    ref = reference_conv(F.silu(x.double()), weight, None, stride, padding, 1).cpu()
    assert torch.equal(out.isnan(), ref.isnan()) and ref.isnan().sum() == 18, "NaN positions differ"
    infinite = ref.isinf()
    assert torch.equal(out.isinf(), infinite) and torch.equal(out[infinite], ref[infinite]) and infinite.sum() == 9
    finite = ref.isfinite()
    assert_close(out[finite] / 1e30, ref[finite] / 1e30, dtype, "values scaled by 1e-30")
    small = finite & (ref.abs() < 1e3)
    assert_close(out[small], ref[small], dtype, "values away from the large inputs")


def test_eval_calls_follow_shapes_autocast_and_dtypes():
    """The eval block's prepared call (folded weights, geometry) is redone for another input
    layout, autocast's dtype, or the model in another dtype."""
    stock = _block(torch.nn.Hardswish, bias=True).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    small, large = randn(2, 8, 9, 11), randn(3, 8, 12, 7).contiguous(memory_format=torch.channels_last)
    for x in (small, large, small):
        _assert_same_model(stock, fused, x, f"input {tuple(x.shape)}")
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        out, stock_out = fused(small), stock(small)
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        # (against stock's own error under the same autocast, plus a bfloat16 step of the largest value:
        # an element-wise 1e-2 failed on one draw, 0.578 against 0.595 where a sum cancels)
        ref = stock.double()(small.double())
        error, stock_error = ((t.double() - ref).abs().max().item() for t in (out, stock_out))
        assert error <= 2 * stock_error + 2**-8 * ref.abs().max().item(), \
            f"bfloat16 autocast: largest error {error:.3g}, stock's {stock_error:.3g}"
        fused.double()
        # (against the CPU's float64: stock's on the GPU is 3e-8 off it on the H100, torch 2.11)
        assert_close(fused(small.double()), stock.cpu()(small.double().cpu()), torch.float64, "float64 model")


def test_warmup_of_a_fused_model_records_the_fused_forward():
    """A fused model's warmup (its fake run) records the block's calls as they will run in eval
    mode without gradients: one block op call (its foldings inside), with the layer's weight shape,
    the BatchNorm after it and, where the input is linked, the one before."""
    from dwconv.precompile import layer_calls

    fused = dwconv.convert(_block(torch.nn.SiLU).eval().to(DEVICE), fuse=True, precompile=False, verbose=False)
    with torch.no_grad():
        calls = layer_calls(fused, randn(2, 8, 9, 11))
    (block,) = calls
    assert block.block and not block.fold and block.grads == (False, False, False)
    assert block.arguments == ("block", (1, 1), (1, 1, 1, 1), (1, 1), activation_code("silu"), (True, "float32"), None)
    assert block.tensors[1][0] == (8, 1, 3, 3) and block.tensors[2] is None and block.passes() == ["forward"]
    # a pointwise convolution's folded BatchNorm: recorded in the fake run, nothing launched there
    from dwconv.kernels import batch_norm as batch_norm_kernels

    folding = dwconv.convert(InvertedResidual().eval().to(DEVICE), fuse=True, precompile=False, verbose=False)
    launched, real_fold = [], batch_norm_kernels.fold
    batch_norm_kernels.fold = lambda *args: launched.append(1) or real_fold(*args)
    try:
        with torch.no_grad():
            calls = layer_calls(folding, randn(2, 8, 9, 11))
    finally:
        batch_norm_kernels.fold = real_fold
    # (the expansion's BatchNorm and ReLU6 applied by the depthwise layer: no folding of its own)
    assert [call.tensors[0][0] for call in calls if call.fold] == [(8, 16, 1, 1)]
    assert not launched
    (block,) = [call for call in calls if call.block]
    assert block.arguments[4:] == (forward_activation_code(("relu6", "relu6")), (True, "float32"), (True, "float32"))
    fused.train()
    calls = layer_calls(fused, randn(2, 8, 9, 11))  # (training: the plain layer's passes, then BatchNorm's)
    assert [call.grads for call in calls] == [(False, True, False), (True, True, True)]
    assert calls[0].arguments[3:] == () and calls[1].arguments == ("batch_norm", "silu", "float32")
    assert calls[1].batch_norm and not calls[0].batch_norm
    assert calls[1].tensors[0][0] == (2, 8, 9, 11) and calls[1].tensors[1][0] == (8,)


def test_warmup_compiles_the_training_blocks_batch_norm(tmp_path, monkeypatch):
    """A fused model's warmup in training compiles BatchNorm's kernels (forward and backward) for
    sm_90 into an empty cache, besides the convolution's."""
    from dwconv.precompile import compile_calls, layer_calls

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fused = dwconv.convert(_block(torch.nn.ReLU6).train().to(DEVICE), fuse=True, precompile=False, verbose=False)
    x = randn(2, 8, 9, 11).contiguous(memory_format=torch.channels_last)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        calls = [call for call in layer_calls(fused, x) if call.batch_norm]
    assert len(calls) == 1 and calls[0].tensors[0][2] == "bfloat16" and calls[0].passes() == ["backward", "forward"]
    report = compile_calls(calls, 90, workers=1, verbose=False)
    assert report.errors == [] and report.launches == 6


@pytest.mark.skipif(DEVICE != "cuda", reason="real sizes on the GPU")
@pytest.mark.parametrize("activation", [torch.nn.ReLU6, torch.nn.SiLU, torch.nn.Hardswish])
@pytest.mark.parametrize("stride", [1, 2])
def test_fused_mobilenet_blocks_at_real_sizes(activation, stride):
    """MobileNetV2's and EfficientNet's block sizes, bfloat16 autocast, channels_last, eval: the fused
    block's largest error against the stock block in float64 within twice stock's own under the same
    autocast (the input and the folded weight rounded to bfloat16, scaled by the BatchNorm, reach
    several bfloat16 steps of the output on a few of 29 million values, as stock's do)."""
    stock = _block(activation, channels=144, stride=stride).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    x = randn(64, 144, 56, 56).contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out, stock_out = fused(x), stock(x)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    with torch.no_grad():
        ref = stock.double()(x.double())
    error, stock_error = ((t.double() - ref).abs().max().item() for t in (out, stock_out))
    assert error <= 2 * stock_error, f"fused block: largest error {error:.3g}, stock's bfloat16 autocast {stock_error:.3g}"


@pytest.mark.skipif(DEVICE != "cuda", reason="real sizes on the GPU")
@pytest.mark.parametrize("activation", [torch.nn.ReLU6, torch.nn.SiLU, torch.nn.Hardswish])
def test_fused_inverted_residual_trains_at_real_sizes(activation):
    """A MobileNetV2 block at its 56x56 stage's sizes (24 -> 144 channels, batch 32), bfloat16 autocast,
    channels_last, two training steps: the output, the input's and every parameter's gradient within
    twice stock's own error against float64 under the same autocast (relative to each one's largest
    value), plus a bfloat16 rounding; the running statistics within bfloat16's error."""
    block = InvertedResidual(channels=24, hidden=144)
    block.act1, block.act2 = activation(), activation()
    stock = block.train().to(DEVICE).to(memory_format=torch.channels_last)
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    exact = copy.deepcopy(stock).double()
    for step in range(2):
        x = randn(32, 24, 56, 56).contiguous(memory_format=torch.channels_last)
        grad = randn(32, 24, 56, 56).contiguous(memory_format=torch.channels_last)
        leaves = [x.clone().requires_grad_() for _ in range(2)]
        outs = []
        for model, leaf in zip((stock, fused), leaves):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(leaf)
            out.backward(grad.to(out.dtype))
            outs.append(out)
        x64 = x.double().requires_grad_()
        ref = exact(x64)
        ref.backward(grad.double())
        names = ["output", "grad of input"] + [f"grad of {name}" for name, _ in stock.named_parameters()]
        for name, got_stock, got, expected in zip(
                names, [outs[0], leaves[0].grad, *(p.grad for p in stock.parameters())],
                [outs[1], leaves[1].grad, *(p.grad for p in fused.parameters())],
                [ref, x64.grad, *(p.grad for p in exact.parameters())]):
            stock_error, error = relative_error(got_stock, expected), relative_error(got, expected)
            assert error <= 2 * stock_error + 2 ** -8, \
                f"step {step}, {name}: {error:.3g} against stock's {stock_error:.3g}"
    for (name, b), b64 in zip(fused.named_buffers(), exact.buffers()):
        assert_close(b, b64, torch.bfloat16, name)


@pytest.mark.parametrize("options", [dict(affine=False), dict(eps=1e-3, momentum=None), dict(momentum=0.3)],
                         ids=["no-affine", "eps-cumulative", "momentum"])
def test_batch_norm_options(options):
    """BatchNorm2d's options: eval folds them all; training keeps stock's running statistics and
    num_batches_tracked over several steps (cumulative averages included)."""
    def model():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),
                                   torch.nn.BatchNorm2d(8, **options), torch.nn.SiLU()).to(DEVICE)

    stock, fused = model(), dwconv.convert(model(), fuse=True, precompile=False, verbose=False)
    assert type(fused[1]).__name__ == "FoldedBatchNorm2d"
    for step in range(3):
        x = randn(4, 8, 7, 9)
        assert_close(fused(x), stock(x), torch.float32, f"training step {step}")
    for (name, b), b_ref in zip(fused.named_buffers(), stock.buffers()):
        if b.is_floating_point():
            assert_close(b, b_ref, torch.float32, name)
        else:
            assert torch.equal(b, b_ref) and int(b) == 3, name  # (num_batches_tracked)
    fused.eval(), stock.eval()
    _assert_same_model(stock, fused, randn(2, 8, 7, 9), "eval")


def test_batch_norm_without_running_statistics_is_not_folded(capsys):
    """track_running_stats=False: eval uses the batch's statistics, which no weight can hold."""
    stock = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1, groups=8),
                                torch.nn.BatchNorm2d(8, track_running_stats=False)).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False)
    assert "fused 0 depthwise block(s)" in capsys.readouterr().out
    assert type(fused[1]) is torch.nn.BatchNorm2d


def test_hooks_see_the_stock_blocks_values():
    """A hook registered on a fused block's module after convert (an activation recorder, a
    calibration observer, Grad-CAM), or on every module, sees the values stock's would: the block
    then runs unfused while the hook is there, and fused again once it is removed."""
    stock = _block(torch.nn.SiLU).eval().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    x = randn(2, 8, 9, 11)
    for where in ("conv", "norm", "global"):
        seen = {}
        hook = lambda name: lambda module, args, out: seen.setdefault(name, []).append(out.detach())  # noqa: E731
        if where == "global":
            handles = [torch.nn.modules.module.register_module_forward_hook(hook("any"))]
        else:
            index = 0 if where == "conv" else 1
            handles = [model[index].register_forward_hook(hook(name)) for model, name in ((fused, "fused"),
                                                                                         (stock, "stock"))]
        with torch.no_grad():
            out, ref = fused(x), stock(x)
        for handle in handles:
            handle.remove()
        assert_close(out, ref.double(), torch.float32, f"output, {where} hook")
        if where == "global":
            assert len(seen["any"]) == 8  # (each model and each of its three modules, once)
            for got, want in zip(seen["any"][:4], seen["any"][4:]):
                assert_close(got, want.double(), torch.float32, "a global hook's value")
        else:
            assert_close(seen["fused"][0], seen["stock"][0].double(), torch.float32, f"the {where}'s output")
    assert fused_now_all(fused)


def fused_now_all(model):
    from dwconv.fuse import fused_now

    return all(fused_now(m.dwconv_block) for m in model.modules() if hasattr(m, "dwconv_block"))


@pytest.mark.parametrize("replaced", ["norm", "activation", "timm act"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_module_swapped_after_convert_unfuses_its_block(replaced, mode):
    """A tool that swaps a block's module for another after convert (convert_sync_batchnorm,
    timm's freeze_batch_norm_2d, a user's assignment) leaves the old one in the fused block: the
    block then runs as the modules now in the model compute it, never the old one's BatchNorm or
    activation on top of the new's."""
    if replaced == "timm act":
        norm = BatchNormAct2d(8)
        norm.load_state_dict(_bn(8).state_dict())
        model = lambda: torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),  # noqa: E731
                                            copy.deepcopy(norm)).to(DEVICE)
    else:
        model = lambda: _block(torch.nn.ReLU6).to(DEVICE)  # noqa: E731
    stock = model()
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    stock.train(mode == "train"), fused.train(mode == "train")
    for net in (stock, fused):  # (the same swap in both: a new module of another kind, or the activation's)
        if replaced == "norm":
            new = torch.nn.BatchNorm2d(8, eps=0.1).to(DEVICE).train(mode == "train")
            new.load_state_dict(net[1].state_dict())
            net[1] = new
        elif replaced == "activation":
            net[2] = torch.nn.Tanh()
        else:
            net[1].act = torch.nn.Tanh()
    x = randn(2, 8, 7, 9)
    assert_close(fused(x), stock(x), torch.float32, f"{replaced} replaced, {mode}")


class InvertedResidual(torch.nn.Module):
    """MobileNetV2's block: a pointwise expansion, BatchNorm and ReLU6; the depthwise block; a
    pointwise projection and a BatchNorm with no activation, added to the input."""

    def __init__(self, channels=8, hidden=16):
        super().__init__()
        self.expand = torch.nn.Conv2d(channels, hidden, 1, bias=False)
        self.bn1 = _bn(hidden)
        self.act1 = torch.nn.ReLU6(inplace=True)
        self.dw = torch.nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False)
        self.bn2 = _bn(hidden)
        self.act2 = torch.nn.ReLU6(inplace=True)
        self.project = torch.nn.Conv2d(hidden, channels, 1, bias=False)
        self.bn3 = _bn(channels)

    def forward(self, x):
        y = self.act1(self.bn1(self.expand(x)))
        return x + self.bn3(self.project(self.act2(self.bn2(self.dw(y)))))


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_other_batch_norms_train_on_the_kernels(layout, monkeypatch, capsys):
    """fuse=True: a BatchNorm2d outside any depthwise block (after a pointwise convolution) computes
    itself and the activation module after it on dwconv's kernels in training, the activation module
    passing its input through; in eval mode it is folded into the convolution before it. Outputs, every
    gradient and the running statistics as stock's over steps; then eval, with and without gradients."""
    import io

    from dwconv import fuse

    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    stock = InvertedResidual().train().to(DEVICE).to(memory_format=memory_format)
    fused = dwconv.convert(stock, fuse=True, precompile=False)
    assert ("fused 1 depthwise block(s) (1 BatchNorm2d folded in eval mode, on dwconv's kernels in training; "
            "1 activation(s) fused); 2 other BatchNorm2d on dwconv's kernels in training (1 with their activation, "
            "1 folded into their convolution in eager eval, 1 applied with their activation by the depthwise layer "
            "after them in eval mode)") in capsys.readouterr().out
    assert [type(getattr(fused, name)).__name__ for name in ("expand", "bn1", "act1", "project", "bn3")] == \
        ["FoldingConv2d", "TrainedBatchNorm2d", "TrainedReLU6", "FoldingConv2d", "TrainedBatchNorm2d"]
    assert list(fused.state_dict()) == list(stock.state_dict())
    calls = []
    original = fuse.batch_norm_activation
    monkeypatch.setattr(fuse, "batch_norm_activation", lambda y, norm, activation: calls.append(activation)
                        or original(y, norm, activation))
    x = randn(4, 8, 7, 9).contiguous(memory_format=memory_format)
    _trains_as_stock(stock, fused, x)
    assert calls == ["relu6", "relu6", "identity"] * 2, calls  # (none in eval mode)
    # eval mode: no BatchNorm computes (each folded into its convolution; in bfloat16 a 1x1 one of a
    # channels_last input as a matrix product, whose epilogue adds the bias), the folded parameters
    # follow an in-place change of the statistics, and with gradients every parameter's is stock's
    norms, batch_norm = [], F.batch_norm
    monkeypatch.setattr(F, "batch_norm", lambda *a, **k: norms.append(1) or batch_norm(*a, **k))
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = fused(x)
    assert not [e for e in profile.key_averages() if e.key in _PRODUCT_OPS], "a float32 product"
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        for _ in range(2):  # (the C++ replayer serves the ops from a first call, records at the next: each
            fused(x)        # op twice under the profiler then)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            out16 = fused(x)
    monkeypatch.setattr(F, "batch_norm", batch_norm)
    assert not norms, "a BatchNorm computed in eval mode"
    products = [e.count for e in profile.key_averages() if e.key in _PRODUCT_OPS]
    assert sum(products) == (2 if layout == "channels_last" else 0), products
    assert out.is_contiguous(memory_format=memory_format) and out16.is_contiguous(memory_format=memory_format)
    with torch.no_grad():
        fused.bn3.running_var.mul_(3), stock.bn3.running_var.mul_(3)
    _assert_same_model(stock, fused, x, "eval after a change of statistics")
    grad_out = randn(*x.shape)
    for model in (fused, stock):
        model.zero_grad()
        model(x).backward(grad_out)
    for (name, p), p_ref in zip(fused.named_parameters(), stock.parameters()):
        scale = max(1.0, p_ref.grad.abs().max().item())
        assert_close(p.grad / scale, p_ref.grad / scale, torch.float32, f"eval-mode grad of {name} over {scale:.3g}")
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(fused)):
        assert type(other.bn1).__name__ == "TrainedBatchNorm2d" and other.bn1.dwconv_block[1] is other.bn1
        assert fused_now_all(other)
        with torch.no_grad():
            assert_close(other(x), fused(x), torch.float32, "a copy's eval output")


@pytest.mark.parametrize("shape, options", [
    ((2, 5, 7, 3), {}), ((1, 1, 1, 1), dict(bias=True)), ((3, 6, 1, 1), dict(padding="same")),
    ((2, 4, 5, 1), dict(padding_mode="reflect", bias=True)), ((1, 3, 2, 9), dict(out_channels=1)),
    ((2, 4, 6, 5), dict(stride=2)), ((2, 4, 6, 5), dict(padding=1))])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_folding_pointwise_convolution_in_eval(shape, options, layout, autocast):
    """A 1x1 convolution with its BatchNorm folded in eval mode, tiny and odd sizes, a bias, string and
    non-zero paddings and modes, a stride: stock's output in stock's memory format (float64's within
    the dtype's error), as a matrix product exactly where it is one in 16 bits (a channels_last input,
    stride 1, no padding; float32 keeps the convolution, which computes in TF32 by torch's defaults)."""
    out_channels = options.pop("out_channels", 7)
    conv = torch.nn.Conv2d(shape[1], out_channels, 1, bias=options.pop("bias", False), **options)
    stock = torch.nn.Sequential(conv, torch.nn.BatchNorm2d(out_channels), torch.nn.SiLU()).to(DEVICE)
    with torch.no_grad():
        stock[1].running_mean.normal_(), stock[1].running_var.uniform_(0.5, 2), stock[1].weight.normal_()
    stock.eval()
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    assert type(fused[0]).__name__ == "FoldingConv2d"
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = randn(*shape).contiguous(memory_format=memory_format)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        for _ in range(2):  # (the C++ replayer serves the ops from a first call, records at the next: each
            fused(x)        # op twice under the profiler then)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            out = fused(x)  # (also where the C++ replayer serves the op)
        ref = stock(x)
    products = [e.count for e in profile.key_averages() if e.key in _PRODUCT_OPS]
    assert out.dtype == ref.dtype
    assert_close(out, stock.double()(x.double()), out.dtype, "folded output")
    assert out.shape == ref.shape and out.is_contiguous(memory_format=memory_format) == \
        ref.is_contiguous(memory_format=memory_format)
    # (a 1x1 image is channels_last in either layout)
    # (another padding mode's F.pad copies the input, on CUDA into NCHW: stock's path, and its layout)
    expected = autocast and x.is_contiguous(memory_format=torch.channels_last) and conv.stride == (1, 1) \
        and conv.padding in ((0, 0), "same") and conv.padding_mode == "zeros"
    assert sum(products) == expected, (products, expected)


_PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::_addmm_activation")  # (a matrix product's, at any depth)


@pytest.mark.parametrize("activation", [torch.nn.ReLU, torch.nn.ReLU6, torch.nn.SiLU, "timm"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_folding_convolution_applies_the_activation_in_eval(activation, autocast, monkeypatch):
    """A trained pointwise block in eval mode: the folding convolution applies the activation after
    its BatchNorm too (ReLU in the product's epilogue, a bfloat16 channels_last input), the BatchNorm
    and the activation module passing their input through; stock's values (float32's within its
    error of float64's, bfloat16's within 3x stock's own), with gradients too (float32); a hook on
    the activation module sees stock's value."""
    from dwconv import fuse

    if activation == "timm":  # (BatchNormAct2d: its own Hardswish)
        norm = BatchNormAct2d(7)
        norm.load_state_dict(_bn(7).state_dict())
        stock = torch.nn.Sequential(torch.nn.Conv2d(6, 7, 1, bias=False), norm)
    else:
        stock = torch.nn.Sequential(torch.nn.Conv2d(6, 7, 1, bias=False), _bn(7), activation())
    stock = stock.eval().to(DEVICE)
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    assert type(fused[0]).__name__ == "FoldingConv2d"
    x = randn(2, 6, 5, 3).contiguous(memory_format=torch.channels_last)
    activated, functions = [], dict(fuse.FUNCTIONS)
    for name, function in functions.items():
        monkeypatch.setitem(fuse.FUNCTIONS, name,
                            lambda t, name=name, function=function: activated.append(name) or function(t))
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast), \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = fused(x)
    epilogues = sum(e.count for e in profile.key_averages() if e.key == "aten::_addmm_activation")
    name = fused[0].dwconv_block[1].dwconv_activation
    assert name == {torch.nn.ReLU: "relu", torch.nn.ReLU6: "relu6", torch.nn.SiLU: "silu"}.get(activation, "hardswish")
    # (in one op where it computes: ReLU in its epilogue, the others in place on its output)
    assert (epilogues, activated) == ((1, []) if autocast and name == "relu" else
                                      (0, [] if autocast else [name])), (epilogues, activated)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        stock_out = stock(x)
    ref = stock.double()(x.double())
    if autocast:  # (within 3x stock's own bfloat16 error: the folded weight rounds where stock's output
        # does; over 150 draws a SiLU block's largest error reached 2.01x stock's)
        error, own = ((t.double() - ref).abs().max().item() for t in (out, stock_out))
        assert error <= 3 * own + 1e-3, f"eval output: error {error:.3g} against stock's own {own:.3g}"
    else:
        assert_close(out, ref, torch.float32, "eval output")
    if not autocast:  # (in bfloat16 a value near an activation's kink may round to its other side)
        grad_x = torch.autograd.grad(fused(x.requires_grad_()).sum(), x)[0]
        ref_x = x.detach().double().requires_grad_()
        assert_close(grad_x, torch.autograd.grad(stock.double()(ref_x).sum(), ref_x)[0], torch.float32,
                     "input gradient")
    stock.float()
    seen = []
    module = fused[1].act if activation == "timm" else fused[2]
    handle = module.register_forward_hook(lambda m, args, output: seen.append(args[0].detach().clone()))
    with torch.no_grad():
        fused(x.detach())
    handle.remove()
    with torch.no_grad():
        before = stock[1](stock[0](x.detach())) if activation != "timm" else None
    if before is not None:
        assert_close(seen[0], before, torch.float32, "what the activation's hook sees")


@pytest.mark.parametrize("how", ["gradients", "compiled"])
def test_folding_pointwise_convolution_as_product_wherever_folded_in_the_graph(how):
    """Where the folding is computed in the graph (gradients wanted) the folded weight stays float32
    and autocast casts it at the call: the 1x1 convolution is still the matrix product it is in eager
    without gradients (it computes in bfloat16), with stock's values and gradients. Under
    torch.compile nothing is folded (Inductor fuses the BatchNorm into the activation's kernel, as
    stock's), and the convolution is the product too."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    stock = torch.nn.Sequential(torch.nn.Conv2d(6, 5, 1), torch.nn.BatchNorm2d(5), torch.nn.SiLU()).to(DEVICE)
    with torch.no_grad():
        stock[1].running_mean.normal_(), stock[1].running_var.uniform_(0.5, 2), stock[1].weight.normal_()
    stock.eval()
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    x = randn(2, 6, 5, 3).contiguous(memory_format=torch.channels_last)
    backend = EagerAndRecordGraphs()
    run = torch.compile(fused, fullgraph=True, backend=backend) if how == "compiled" else fused
    with torch.set_grad_enabled(how == "gradients"), torch.autocast(DEVICE, dtype=torch.bfloat16):
        out, ref = run(x), stock(x)
    assert out.dtype == ref.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, stock.double()(x.double()), out.dtype, "folded output")
    if how == "compiled":
        code = backend.graphs[0].code
        assert "linear" in code and "conv2d" not in code and "batch_norm" in code, code
    else:
        # (against float64's: PyTorch's CPU BatchNorm has no backward for a bfloat16 input)
        reference = copy.deepcopy(stock).double()
        out.float().sum().backward()
        reference(x.double()).sum().backward()
        for (name, p), p_ref in zip(fused.named_parameters(), reference.parameters()):
            scale = max(1.0, p_ref.grad.abs().max().item())
            assert_close(p.grad / scale, (p_ref.grad / scale).float(), torch.bfloat16, f"gradient of {name}")


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_fused_eval_model_under_torch_func(layout):
    """torch.func's vmap and jacrev over a fused model in eval mode: stock's values (the foldings
    in the graph, the pointwise convolutions as convolutions: vmap cannot ask a memory format), or
    stock's own error where stock raises."""
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    stock = InvertedResidual().eval().to(DEVICE)
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    xs = torch.stack([randn(2, 8, 5, 7).contiguous(memory_format=memory_format) for _ in range(3)])
    runs = {"vmap": lambda m, t: torch.func.vmap(m)(t),
            "jacrev": lambda m, t: torch.func.jacrev(lambda u: m(u).square().sum())(t[0])}
    for name, run in runs.items():
        try:
            expected = run(stock, xs)
        except RuntimeError as error:
            # (stock's own modules raise for a channels_last input under torch.func on the GPU (its
            # wrappers cannot answer is_contiguous(channels_last)): the fused model raises the same, or
            # computes the values stock computes in NCHW)
            if layout != "channels_last" or "inside of vmap" not in str(error):
                raise
            try:
                out = run(fused, xs)
            except RuntimeError as fused_error:
                assert "inside of vmap" in str(fused_error), fused_error
                continue
            expected = run(stock, xs.contiguous())
        else:
            out = run(fused, xs)
        assert_close(out, expected, torch.float32, name)


def test_a_hooked_batch_norm_trains_as_stock():
    """A hook on a trained block's module (its convolution, BatchNorm or activation) sees stock's
    values, in training and in eval mode: that block runs its modules as before while the hook is
    there; the others stay on the kernels (folded in eval mode)."""
    stock = InvertedResidual().train().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    x = randn(4, 8, 7, 9)
    for mode in ("train", "eval"):
        fused.train(mode == "train"), stock.train(mode == "train")
        for name in ("expand", "bn1", "act1"):
            seen = {}
            handles = [getattr(model, name).register_forward_hook(
                lambda module, args, out, label=label: seen.setdefault(label, out.detach().clone()))
                for model, label in ((fused, "fused"), (stock, "stock"))]
            out, ref = fused(x), stock(x)
            for handle in handles:
                handle.remove()
            assert_close(seen["fused"], seen["stock"], torch.float32, f"what a hook on {name} sees, {mode}")
            assert_close(out, ref, torch.float32, f"output with a hook on {name}, {mode}")
    assert fused_now_all(fused)


def test_batch_norms_no_block_holds_train_alone():
    """A BatchNorm2d whose module does not trace (Branching), one called twice (Shared) and timm's
    BatchNormAct2d after a pointwise convolution: each trains on dwconv's kernels by itself (the
    last with its own activation), as stock's over steps; then eval."""
    from dwconv import fuse

    pointwise = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 1, bias=False), BatchNormAct2d(8))
    pointwise[1].load_state_dict(_bn(8).state_dict())
    stock = torch.nn.Sequential(Branching(), Shared(), pointwise).train().to(DEVICE)
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    assert [type(m).__name__ for m in (fused[0].bn, fused[1].bn, fused[2][1])] == \
        ["TrainedBatchNorm2d", "TrainedBatchNorm2d", "TrainedBatchNormAct2d"]
    calls = []
    original = fuse.batch_norm_activation
    fuse.batch_norm_activation = lambda y, norm, activation: calls.append(activation) or original(y, norm, activation)
    try:
        _trains_as_stock(stock, fused, randn(2, 8, 7, 9))
    finally:
        fuse.batch_norm_activation = original
    # (Branching's own block and its BatchNorm, Shared's BatchNorm twice, BatchNormAct2d's hardswish; none in eval)
    assert calls == ["relu6", "identity", "identity", "identity", "hardswish"] * 2, calls


class NestedInvertedResidual(torch.nn.Module):
    """torchvision's MobileNetV2 block: conv-norm-activation Sequentials inside a Sequential, the
    expansion's activation the last module of one and the depthwise layer the first of the next;
    expand=False: the depthwise layer first (the block after the stem)."""

    def __init__(self, activation=torch.nn.ReLU6, channels=8, hidden=16, residual=True, expand=True):
        super().__init__()
        self.residual = residual
        expansion = [torch.nn.Sequential(torch.nn.Conv2d(channels, hidden, 1, bias=False), _bn(hidden), activation())]
        width = hidden if expand else channels
        self.conv = torch.nn.Sequential(
            *(expansion if expand else []),
            torch.nn.Sequential(torch.nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False), _bn(width),
                                activation()),
            torch.nn.Conv2d(width, channels, 1, bias=False), _bn(channels))

    def forward(self, x):
        return x + self.conv(x) if self.residual else self.conv(x)


def _expanding_model(activation):
    """A stem (conv, BatchNorm, activation) into a block without expansion (linked two levels down), a
    nested block without a residual, one with (its input also feeds the add: the stem's activation is
    not linked there), the flat InvertedResidual (ReLU6)."""
    stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, 2, 1, bias=False), _bn(8), activation())
    return torch.nn.Sequential(stem, NestedInvertedResidual(activation, residual=False, expand=False),
                               NestedInvertedResidual(activation, residual=False), NestedInvertedResidual(activation),
                               InvertedResidual())


@pytest.mark.parametrize("activation, layout", [(torch.nn.ReLU6, "nchw"), (torch.nn.SiLU, "channels_last"),
                                                (torch.nn.Hardswish, "channels_last"), (torch.nn.GELU, "channels_last")])
def test_expansion_activation_applied_by_the_depthwise_layer(activation, layout, capsys):
    """fuse=True: where a trained block's activation feeds a fused depthwise layer alone (through
    nested Sequentials), in eval mode the layer applies it to its input as it loads and the
    activation module passes through: stock's values without and with gradients (float64's, and
    under bfloat16 autocast within its error); in training mode the activation runs as before."""
    from dwconv.fuse import input_activation_now

    stock = _expanding_model(activation).to(DEVICE).eval()
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False)
    assert "4 applied with their activation by the depthwise layer after them" in capsys.readouterr().out
    depthwise = [m for m in fused.modules() if type(m).__name__ == "FusedDepthwiseConv2d"]
    name = dwconv.activations.activation_of(activation())
    assert [input_activation_now(m) for m in depthwise] == [name, name, name, "relu6"]
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = randn(2, 3, 10, 9).contiguous(memory_format=memory_format)
    _assert_same_model(stock, fused, x, "eval")
    leaf = x.clone().requires_grad_()
    out, ref = fused(leaf), stock(x.clone().requires_grad_())
    assert_close(out, ref, torch.float32, "eval, gradients wanted")
    out.sum().backward()
    ref_leaf = x.clone().requires_grad_()
    stock(ref_leaf).sum().backward()
    assert_close(leaf.grad, ref_leaf.grad, torch.float32, "grad of the input")
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            half = fused(x)
        stock_half = stock(x)
        exact = stock.double()(x.double())
    stock.float()
    # every 1x1 convolution one op in channels_last (the expansions, whose BatchNorm the depthwise layer
    # applies, without a folding), none through F.linear's Python
    ops = {e.key: e.count for e in profile.key_averages()}
    pointwise = sum(type(m).__name__ == "FoldingConv2d" and m.kernel_size == (1, 1) for m in fused.modules())
    assert (ops.get("dwconv::pointwise_folded", 0), ops.get("aten::linear", 0)) == \
        ((pointwise, 0) if layout == "channels_last" else (0, 0)), ops
    # (five layers in bfloat16: the error against float64 is stock's own, not one rounding's; the
    # largest of 100 draws (Hardswish, NCHW) 1.86x stock's, one on CI 2.06x; Hardswish since runs
    # channels_last, which the interpreter computes in a third of the time: 8 of 8 draws passed)
    error, stock_error = ((y.double() - exact).abs().max().item() for y in (half, stock_half))
    assert error <= 3 * stock_error, f"bfloat16 autocast: {error:.3g} from float64's (stock's {stock_error:.3g})"
    fused.train(), stock.train()
    assert [input_activation_now(m) for m in depthwise] == [None] * 4
    _trains_as_stock(stock, fused, x, steps=1)


def test_input_activation_only_where_proven(capsys):
    """No link for an activation that does not map 0 to 0 (Hardsigmoid), an activation that also feeds
    a residual add, a module used twice; a hook on a module between unlinks at the call (it sees
    stock's activated value), as does a module swapped for another."""
    from dwconv.fuse import input_activation_now

    hard = dwconv.convert(_expanding_model(torch.nn.Hardsigmoid).to(DEVICE).eval(), fuse=True, precompile=False)
    assert "1 applied with their activation" in capsys.readouterr().out  # (the flat InvertedResidual's ReLU6 alone)
    assert [input_activation_now(m) for m in hard.modules() if type(m).__name__ == "FusedDepthwiseConv2d"] == \
        [None, None, None, "relu6"]
    stock = _expanding_model(torch.nn.ReLU6).to(DEVICE).eval()
    fused = dwconv.convert(copy.deepcopy(stock), fuse=True, precompile=False, verbose=False)
    x = randn(2, 3, 10, 9)
    import io

    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(fused), torch.load(buffer, weights_only=False)):  # (links to its own modules)
        assert input_activation_now(other[2].conv[1][0]) == "relu6"
        assert other[2].conv[1][0].dwconv_input[0][1] is other[2].conv[0][1]
        _assert_same_model(stock, other, x, "a copy")
    seen = []
    handle = fused[2].conv[0].register_forward_hook(lambda module, args, out: seen.append(out.detach().clone()))
    linked = fused[2].conv[1][0]
    assert input_activation_now(linked) is None
    _assert_same_model(stock, fused, x, "hooked between")
    assert seen[0].min() >= 0 and seen[0].max() <= 6, "the hook saw the value before its activation"
    handle.remove()
    assert input_activation_now(linked) == "relu6"
    fused[2].conv[0][2] = torch.nn.ReLU6()  # (swapped: the old module's link no longer holds)
    stock[2].conv[0][2] = torch.nn.ReLU6()
    assert input_activation_now(linked) is None
    _assert_same_model(stock, fused, x, "swapped between")
    twice = torch.nn.Sequential(stock[0], stock[1], stock[1])  # (a module used twice is never linked)
    dwconv.convert(twice, fuse=True, precompile=False)
    assert "0 applied with their activation" in capsys.readouterr().out
    residual = torch.nn.Sequential(stock[0], NestedInvertedResidual(expand=False))  # (the add reads it too)
    dwconv.convert(residual, fuse=True, precompile=False)
    assert "0 applied with their activation" in capsys.readouterr().out
