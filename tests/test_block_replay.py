"""A fused inverted-residual block's eval forward as one replayed program (dwconv.block_replay):
bitwise the Python path's values, and every change to the block seen at the next call."""

import copy

import pytest
import torch
import torch.nn as nn

import dwconv
from dwconv import block_replay
from dwconv.bench_models import module_by_module, replays_bitwise
from dwconv.replay import native
from dwconv.replay.program import NotRecordable, record
from helpers import DEVICE, assert_close, randn


@pytest.fixture(autouse=True)
def on_the_cpp_path(monkeypatch):
    """Blocks replay only on the C++ path; each test counts its own programs."""
    monkeypatch.setenv("DWCONV_NATIVE", "1")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    block_replay._PROGRAMS.clear()


def _bn(channels):
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():  # (statistics and affine parameters away from the identity)
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _conv_norm_act(inp, out, kernel=1, stride=1, groups=1, activation=nn.ReLU6):
    return nn.Sequential(nn.Conv2d(inp, out, kernel, stride, kernel // 2, groups=groups, bias=False), _bn(out),
                         activation())


class InvertedResidual(nn.Module):
    """torchvision.models.mobilenetv2.InvertedResidual's code."""

    def __init__(self, inp, oup, stride, expand_ratio):
        super().__init__()
        hidden = inp * expand_ratio
        self.use_res_connect = stride == 1 and inp == oup
        layers = [_conv_norm_act(inp, hidden)] if expand_ratio != 1 else []
        layers += [_conv_norm_act(hidden, hidden, 3, stride, hidden), nn.Conv2d(hidden, oup, 1, bias=False), _bn(oup)]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x):
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


InvertedResidual.__module__ = "torchvision.models.mobilenetv2"


class ConvNormAct(nn.Module):
    """timm's ConvNormAct, its BatchNorm and activation as two modules."""

    def __init__(self, inp, out, kernel=1, stride=1, groups=1, activation=nn.ReLU):
        super().__init__()
        self.conv = nn.Conv2d(inp, out, kernel, stride, kernel // 2, groups=groups, bias=False)
        self.bn = _bn(out)
        self.act = activation()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class UniversalInvertedResidual(nn.Module):
    """timm.models._efficientnet_blocks.UniversalInvertedResidual's code (no squeeze, no layer scale)."""

    def __init__(self, inp, out, start_kernel, mid_kernel, stride=1):
        super().__init__()
        hidden = 2 * inp
        self.has_skip = inp == out and stride == 1
        self.dw_start = (ConvNormAct(inp, inp, start_kernel, stride if not mid_kernel else 1, inp, nn.Identity)
                         if start_kernel else nn.Identity())
        self.pw_exp = ConvNormAct(inp, hidden)
        self.dw_mid = ConvNormAct(hidden, hidden, mid_kernel, stride, hidden) if mid_kernel else nn.Identity()
        self.se = nn.Identity()
        self.pw_proj = ConvNormAct(hidden, out, activation=nn.Identity)
        self.dw_end = nn.Identity()
        self.layer_scale = nn.Identity()
        self.drop_path = nn.Identity()

    def forward(self, x):
        shortcut = x
        x = self.dw_start(x)
        x = self.pw_exp(x)
        x = self.dw_mid(x)
        x = self.se(x)
        x = self.pw_proj(x)
        x = self.dw_end(x)
        x = self.layer_scale(x)
        if self.has_skip:
            x = self.drop_path(x) + shortcut
        return x


UniversalInvertedResidual.__module__ = "timm.models._efficientnet_blocks"
ConvNormAct.__module__ = "timm.layers.conv_bn_act"


class EdgeResidual(nn.Module):
    """timm.models._efficientnet_blocks.EdgeResidual's code (no squeeze, no anti-aliasing): no
    depthwise layer, its two BatchNorms folded into their convolutions in eval mode."""

    def __init__(self, channels):
        super().__init__()
        self.has_skip = True
        self.conv_exp = nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False)
        self.bn1 = nn.Sequential(_bn(2 * channels), nn.ReLU())
        self.aa = nn.Identity()
        self.se = nn.Identity()
        self.conv_pwl = nn.Conv2d(2 * channels, channels, 1, bias=False)
        self.bn2 = _bn(channels)
        self.drop_path = nn.Identity()

    def forward(self, x):
        shortcut = x
        x = self.conv_exp(x)
        x = self.bn1(x)
        x = self.aa(x)
        x = self.se(x)
        x = self.conv_pwl(x)
        x = self.bn2(x)
        if self.has_skip:
            x = self.drop_path(x) + shortcut
        return x


EdgeResidual.__module__ = "timm.models._efficientnet_blocks"


class Clamped(nn.Module):
    """A user's module whose forward reads state no snapshot sees (its class's list)."""
    limit = [1e9]

    def forward(self, x):
        return x.clamp(max=self.limit[0])


def _model():
    """A stem into a block without expansion (the stem's activation linked into its depthwise layer:
    not replayed), then five blocks that are: two of torchvision's, three of timm's (the last
    without a depthwise layer)."""
    return nn.Sequential(_conv_norm_act(3, 4, 3, 2), InvertedResidual(4, 5, 1, 1), InvertedResidual(5, 6, 2, 3),
                         InvertedResidual(6, 6, 1, 2), UniversalInvertedResidual(6, 6, 3, 5),
                         UniversalInvertedResidual(6, 8, 0, 3, stride=2), EdgeResidual(8)).to(DEVICE).eval()


@pytest.fixture
def replays(monkeypatch):
    """How many block programs replayed (not the other programs of the C++ path)."""
    count = [0]
    replay = native.NativeProgram.replay

    def counted(self, *inputs):
        count[0] += any(self is program for program in block_replay._PROGRAMS.values())
        return replay(self, *inputs)
    monkeypatch.setattr(native.NativeProgram, "replay", counted)
    return count


def _input(layout, channels=3):
    x = randn(1, channels, 19, 23)
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


@pytest.mark.parametrize("layout, autocast", [("nchw", False), ("channels_last", True)])
def test_blocks_replay_bitwise_theirmodule_by_module(layout, autocast, replays, capsys):
    stock = _model()
    if layout == "channels_last":
        stock = stock.to(memory_format=torch.channels_last)
    fused = dwconv.convert(stock, fuse=True, precompile=False)
    assert "5 inverted-residual block(s) one replayed program each in eager eval" in capsys.readouterr().out
    assert [type(m).__name__ for m in fused[1:]] == ["InvertedResidual"] + ["ReplayedInvertedResidual"] * 2 + \
        ["ReplayedUniversalInvertedResidual"] * 2 + ["ReplayedEdgeResidual"]
    python = module_by_module(fused)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        for call in range(3):  # (a first sight runs the Python path, the second records, the third replays)
            x = _input(layout)
            out = fused(x)
            assert torch.equal(out, python(x)), f"call {call}: {(out - python(x)).abs().max()}"
            if not autocast:
                assert_close(out, stock.double()(x.double()), torch.float32, f"call {call} against float64")
                stock.float()
    assert replays[0] == 5
    assert sum(isinstance(p, native.NativeProgram) for p in block_replay._PROGRAMS.values()) == 5


def _recorded(fused, layout="nchw"):
    with torch.no_grad():
        for _ in range(3):
            fused(_input(layout))


def _assert_as_stock(fused, stock, what, replayed=None, replays=None):
    replays_before = replays[0] if replays is not None else 0
    with torch.no_grad():
        for call in range(3):
            x = _input("nchw")
            assert_close(fused(x), stock.double()(x.double()), torch.float32, f"{what}, call {call}")
            stock.float()
    if replayed is not None:
        assert (replays[0] > replays_before) == replayed, what


def test_replayed_blocks_see_every_change(replays):
    """Each change after the programs were recorded: the values stock's model gives after it."""
    stock = _model()
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    _recorded(fused)
    assert replays[0] == 5
    for model in (stock, fused):
        model[2].conv[1][1].eps = 0.25  # (a folded BatchNorm's eps: the folding reads it)
        model[6].bn2.eps = 0.3  # (one folded into a 1x1 convolution's product)
    _assert_as_stock(fused, stock, "a BatchNorm's eps", True, replays)
    with torch.no_grad():
        for model in (stock, fused):
            model[3].conv[1][1].running_var.mul_(3)  # (in place: the tensors are the program's inputs)
            model[4].pw_proj.bn.weight.neg_()
    _assert_as_stock(fused, stock, "statistics and weights in place", True, replays)
    for model in (stock, fused):
        model[4].pw_exp.act = nn.Hardswish()  # (a new module: its block is no longer fused)
        model[4].has_skip = False
    _assert_as_stock(fused, stock, "a swapped activation, the residual off", True, replays)
    calls = []
    fused[5].dw_mid.conv.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    _assert_as_stock(fused, stock, "a hook inside", None, replays)
    assert len(calls) == 3
    stock.double(), fused.double()  # (through .data: the same tensors in another dtype)
    with torch.no_grad():
        x = _input("nchw").double()
        assert_close(fused(x), stock(x), torch.float64, "in float64")
        assert_close(fused(x), stock(x), torch.float64, "in float64 again")
    stock.float(), fused.float()
    stock.train(), fused.train()
    with torch.no_grad():
        x = _input("nchw")
        assert_close(fused(x), stock.double()(x.double()), torch.float32, "training mode")
        stock.float()
    stock.eval(), fused.eval()
    _assert_as_stock(fused, stock, "eval mode again (running statistics updated by the training call)")


def test_gradients_take_themodule_by_module(replays):
    stock = _model()
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    _recorded(fused)
    count = replays[0]
    x = _input("nchw").requires_grad_()
    out = fused(x)
    assert replays[0] == count
    reference = stock.double()(x.detach().double().requires_grad_())
    assert_close(out, reference, torch.float32, "with gradients")
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_copies_record_their_own(replays):
    """A deep copy (as pickling, through the block's __reduce_ex__) starts without a snapshot: its
    changes are its own."""
    stock = _model()
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    _recorded(fused)
    twin = copy.deepcopy(fused)
    assert type(twin[2]).__name__ == "ReplayedInvertedResidual" and twin[2].dwconv_programs.token is None
    twin[2].conv[1][1].eps = 0.5
    stock_changed = copy.deepcopy(stock)
    stock_changed[2].conv[1][1].eps = 0.5
    _assert_as_stock(twin, stock_changed, "the copy, changed", True, replays)
    _assert_as_stock(fused, stock, "the original, unchanged", True, replays)


def test_a_launch_inside_a_recorded_op_refuses_the_recording(monkeypatch):
    """A registered op's own launches belong to its step: logged beside it, a replay would run them twice."""
    monkeypatch.setenv("DWCONV_NATIVE", "0")
    x, weight = randn(1, 4, 6, 6), randn(4, 1, 3, 3)
    with pytest.raises(NotRecordable, match="a launch inside a recorded op"):
        record(lambda x, w: torch.ops.dwconv.conv2d.default(x, w, None, [1, 1], [1, 1, 1, 1], [1, 1]), [x, weight])


def test_models_bench_checks_replays_bitwise(replays):
    """The models bench's check (bench_models.replays_bitwise): true for the fused model and its
    module-by-module copy, false where they differ."""
    fused = dwconv.convert(_model(), fuse=True, precompile=False, verbose=False)
    python = module_by_module(fused)
    x = _input("nchw")
    assert replays_bitwise(fused, python, x) and replays[0] == 5
    python[6].bn2.eps = 0.5  # (the last block's: a change upstream can vanish behind ReLUs that all read negative)
    assert not replays_bitwise(fused, python, x)


def test_threads_replay_their_own_inputs(replays):
    """Two threads calling one fused model at once: each gets its input's values (the Python path's)."""
    import threading

    fused = dwconv.convert(_model(), fuse=True, precompile=False, verbose=False)
    python = module_by_module(fused)
    _recorded(fused)
    inputs = [[_input("nchw") for _ in range(2)] for _ in range(2)]
    with torch.no_grad():
        expected = [[python(x) for x in xs] for xs in inputs]
    results = [[], []]

    def run(i):
        with torch.no_grad():
            results[i] = [fused(x) for x in inputs[i]]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert replays[0] >= 5 + 20
    for got, want in zip(results, expected):
        assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))


def test_compiled_and_traced_models_run_their_modules(replays):
    """torch.compile (fullgraph: no graph break), torch.jit.trace and torch.fx see the blocks'
    modules, not a replay; the eager model replays beside them."""
    from test_integration import BACKEND

    fused = dwconv.convert(_model(), fuse=True, precompile=False, verbose=False)
    python = module_by_module(fused)
    _recorded(fused)
    count = replays[0]
    x = _input("nchw")
    with torch.no_grad():
        expected = python(x)
        compiled = torch.compile(fused, fullgraph=True, backend=BACKEND)
        assert_close(compiled(x), expected, torch.float32, "compiled")
        traced = torch.jit.trace(fused, x, check_trace=False)
        assert_close(traced(x), expected, torch.float32, "jit.trace")
        graph = torch.fx.symbolic_trace(fused)
        assert_close(graph(x), expected, torch.float32, "fx")
        assert replays[0] == count
        assert torch.equal(fused(x), expected) and replays[0] == count + 5


def test_a_users_module_keeps_its_block_module_by_module(replays):
    """A block holding a module of none of the known libraries is not replayed, whether it was there
    at convert or swapped in after: its forward may read state a snapshot cannot see."""
    stock = _model()
    stock[4].se = Clamped()
    fused = dwconv.convert(stock, fuse=True, precompile=False, verbose=False)
    assert type(fused[4]).__name__ == "UniversalInvertedResidual"
    _recorded(fused)
    assert replays[0] == 4
    for model in (stock, fused):
        model[5].se = Clamped().eval()
    Clamped.limit[0] = 0.5
    try:
        _assert_as_stock(fused, stock, "a user's module swapped in, its state changed", None, replays)
        Clamped.limit[0] = -0.25
        _assert_as_stock(fused, stock, "its state changed again", None, replays)
    finally:
        Clamped.limit[0] = 1e9
