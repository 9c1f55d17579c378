"""PyTorch integration: the registered custom ops (opcheck, fake tensors), torch.compile without
graph breaks, autocast, CUDA graphs (GPU only) and dwconv.convert.

On a machine without CUDA the ops run the Triton kernels under TRITON_INTERPRET=1 and
torch.compile uses the aot_eager backend (no Inductor code generation for CPU Triton kernels);
with CUDA the compile tests use the default (Inductor) backend and CUDA graphs.
"""

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import dwconv
from dwconv import _library  # noqa: F401  (registers torch.ops.dwconv)
from dwconv._geometry import conv_geometry
from dwconv._library import conv_arguments
from helpers import DEVICE, assert_close, randn

GPU = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"


def op_arguments(x, weight, bias, stride=1, padding=0, dilation=1):
    return (x, weight, bias, *conv_arguments(conv_geometry(x, weight, bias, stride, padding, dilation)))


CASES = [  # (shape, kernel, multiplier, stride, padding, dilation, channels_last)
    ((2, 3, 9, 10), (3, 3), 1, 1, 1, 1, False),
    ((1, 2, 8, 11), (2, 4), 2, 1, "same", 1, False),  # asymmetric padding, multiplier 2
    ((2, 3, 9, 9), (3, 3), 1, 2, 1, 1, True),  # stride 2, channels_last
    ((1, 2, 8, 9), (11, 11), 1, 1, 5, 1, True),  # a large kernel, channels_last: one grad_out copy traced
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_opcheck(case):
    """Schema, fake tensors, autograd registration and AOT dispatch of the forward op."""
    shape, kernel, multiplier, stride, padding, dilation, channels_last = case
    x = randn(*shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = randn(shape[1] * multiplier, 1, *kernel)
    args = op_arguments(x.requires_grad_(), weight.requires_grad_(), randn(shape[1] * multiplier).requires_grad_(),
                        stride, padding, dilation)
    torch.library.opcheck(torch.ops.dwconv.conv2d.default, args)


def test_opcheck_backward_ops():
    x, weight = randn(1, 2, 6, 11), randn(2, 1, 3, 3)  # (small: opcheck runs each op several times)
    stride, padding, dilation = conv_arguments(conv_geometry(x, weight, None, 1, 1, 1))
    grad_out = randn(1, 2, 6, 11)
    for op, extra in ((torch.ops.dwconv.conv2d_grad_input.default, ()),
                      (torch.ops.dwconv.conv2d_grad_weight.default, (True,)),
                      (torch.ops.dwconv.conv2d_grad_weight.default, (False,)),
                      (torch.ops.dwconv.conv2d_grad_input_weight.default, ())):
        torch.library.opcheck(op, (grad_out, x, weight, stride, padding, dilation, *extra),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("kernel,dtype,channels_last", [
    (3, torch.float32, False), (3, torch.float32, True),  # row sliding; channels_last (pixels on the GPU)
    (5, torch.float32, False), (13, torch.bfloat16, False),  # large_fma; Toeplitz
], ids=str)
def test_grad_weight_outputs_do_not_alias(kernel, dtype, channels_last):
    """A custom op's outputs must not share storage (AOT dispatch refuses them): the weight and bias
    gradients come from one buffer of sums on several paths (an opcheck failure on the H200 once)."""
    x, grad_out = randn(1, 2, 16, 16, dtype=dtype), randn(1, 2, 16, 16, dtype=dtype)
    if channels_last:
        x, grad_out = (t.contiguous(memory_format=torch.channels_last) for t in (x, grad_out))
    weight = randn(2, 1, kernel, kernel, dtype=dtype)
    args = conv_arguments(conv_geometry(x, weight, None, 1, kernel // 2, 1))
    grad_weight, grad_bias = torch.ops.dwconv.conv2d_grad_weight(grad_out, x, weight, *args, True)
    assert grad_weight.untyped_storage().data_ptr() != grad_bias.untyped_storage().data_ptr()
    assert grad_weight.is_contiguous() and grad_bias.is_contiguous()  # (as the fake tensors are)
    # (and the copy is the bias gradient: the sum of grad_out over each channel)
    assert_close(grad_bias, grad_out.double().sum((0, 2, 3)), dtype, "grad_bias")


@pytest.mark.parametrize("stride,multiplier", [(2, 1), (1, 2)], ids=str)
def test_fused_backward_op_outside_the_fused_geometry(stride, multiplier):
    """conv2d_grad_input_weight takes any geometry: where one pass does not apply (stride 2,
    multiplier 2; on the GPU also rows narrower than 32) it runs the separate kernels."""
    x, weight = randn(1, 2, 7, 9), randn(2 * multiplier, 1, 3, 3)
    geom = conv_geometry(x, weight, None, stride, 1, 1)
    grad_out = randn(*geom.output_shape)
    grad_input, grad_weight = torch.ops.dwconv.conv2d_grad_input_weight(grad_out, x, weight,
                                                                        *conv_arguments(geom))
    xd, wd = x.double().requires_grad_(), weight.double().requires_grad_()
    F.conv2d(xd, wd, None, stride, 1, 1, groups=2).backward(grad_out.double())
    assert_close(grad_input, xd.grad, torch.float32, "grad_input")
    assert_close(grad_weight, wd.grad, torch.float32, "grad_weight")


def test_backward_ops_on_an_empty_batch():
    x, weight = randn(0, 3, 9, 34), randn(3, 1, 3, 3)
    args = conv_arguments(conv_geometry(x, weight, None, 1, 1, 1))
    grad_out = randn(0, 3, 9, 34)
    grad_input, grad_weight = torch.ops.dwconv.conv2d_grad_input_weight(grad_out, x, weight, *args)
    assert grad_input.shape == x.shape and torch.equal(grad_weight, torch.zeros_like(weight))
    (grad_weight,) = torch.ops.dwconv.conv2d_grad_weight(grad_out, x, weight, *args, False)
    assert torch.equal(grad_weight, torch.zeros_like(weight))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fake_tensor_shapes_and_strides(case):
    """The fake implementations give the real outputs' shapes, strides and dtypes."""
    shape, kernel, multiplier, stride, padding, dilation, channels_last = case
    x = randn(*shape, dtype=torch.float16)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = randn(shape[1] * multiplier, 1, *kernel, dtype=torch.float16)
    args = op_arguments(x, weight, None, stride, padding, dilation)
    real = torch.ops.dwconv.conv2d(*args)
    grad_out = torch.randn_like(real)
    real_grads = [torch.ops.dwconv.conv2d_grad_input(grad_out, x, weight, *args[3:]),
                  *torch.ops.dwconv.conv2d_grad_weight(grad_out, x, weight, *args[3:], True)]
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fx, fw, fg = (mode.from_tensor(t) for t in (x, weight, grad_out))
        fake = torch.ops.dwconv.conv2d(fx, fw, None, *args[3:])
        fake_grads = [torch.ops.dwconv.conv2d_grad_input(fg, fx, fw, *args[3:]),
                      *torch.ops.dwconv.conv2d_grad_weight(fg, fx, fw, *args[3:], True)]
    for name, r, f in zip(("output", "grad_input", "grad_weight", "grad_bias"), [real, *real_grads], [fake, *fake_grads]):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype), name


class DepthwiseNet(nn.Module):
    """Two depthwise layers around a pointwise one, as in a MobileNet block."""

    def __init__(self, channels=4, kernel=3):
        super().__init__()
        self.dw1 = nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=channels, bias=False)
        self.pw = nn.Conv2d(channels, 2 * channels, 1)
        self.dw2 = nn.Conv2d(2 * channels, 2 * channels, (5, 3), stride=(1, 2), padding=(2, 1),
                             groups=2 * channels)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.dw2(self.act(self.pw(self.act(self.dw1(x))))).mean(dim=(2, 3))


def test_compile_fullgraph_forward_and_backward(monkeypatch):
    """No graph break (fullgraph=True); the same values and gradients as eager. The C++ path's
    registry of known layers is never traced (a graph break there if it were: torch 2.11's Dynamo
    could not trace its bool(dict) and broke the graph at every layer)."""
    from dwconv import replay

    monkeypatch.setattr(replay.native, "has_known_layers", lambda: torch._dynamo.graph_break() or False)
    torch.manual_seed(0)
    model = dwconv.convert(DepthwiseNet().to(DEVICE), verbose=False)
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True, backend=BACKEND)
    x = randn(2, 4, 12, 12)
    eager_out = model(x)
    eager_out.square().sum().backward()
    out = compiled(x)
    out.square().sum().backward()
    assert_close(out, eager_out.double(), torch.float32, "compiled output")
    for (name, p), q in zip(model.named_parameters(), compiled.parameters()):
        assert_close(q.grad, p.grad.double(), torch.float32, f"compiled grad of {name}")


def test_compile_dynamic_batch():
    """torch.compile(dynamic=True) of a converted model: one graph for every batch size, the same
    values and gradients as eager at each."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    model = dwconv.convert(DepthwiseNet().to(DEVICE), verbose=False)
    counter = CompileCounterWithBackend(BACKEND)
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True, backend=counter, dynamic=True)
    for batch in (2, 3, 5):
        x = randn(batch, 4, 12, 12)
        model.zero_grad(), compiled.zero_grad()
        eager_out = model(x)
        eager_out.square().sum().backward()
        out = compiled(x)
        out.square().sum().backward()
        assert_close(out, eager_out.double(), torch.float32, f"compiled output, batch {batch}")
        for (name, p), q in zip(model.named_parameters(), compiled.parameters()):
            assert_close(q.grad, p.grad.double(), torch.float32, f"compiled grad of {name}, batch {batch}")
    assert counter.frame_count == 1


def test_compile_channels_last_large_kernel():
    """A channels_last large kernel compiled: its traced backward copies grad_out to NCHW once in the
    graph (both gradients' kernels index unit-stride rows); values and gradients as eager's."""
    torch.manual_seed(0)
    layer = dwconv.DepthwiseConv2d(3, 3, 11, padding=5).to(DEVICE)
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, backend=BACKEND)
    x = randn(2, 3, 12, 14).contiguous(memory_format=torch.channels_last)
    results = []
    for module in (layer, compiled):
        leaf = x.detach().requires_grad_()
        out = module(leaf)
        grad_out = torch.ones_like(out).contiguous(memory_format=torch.channels_last) * 0.5
        results.append((out, *torch.autograd.grad(out, (leaf, *module.parameters()), grad_out)))
    for name, got, want in zip(("output", "grad_input", "grad_weight", "grad_bias"), results[1], results[0]):
        assert_close(got, want.double(), torch.float32, f"compiled {name}")
    assert results[1][1].is_contiguous(memory_format=torch.channels_last)


def test_compiled_graph_holds_the_custom_ops():
    """The compiled forward graph calls dwconv::conv2d (not F.conv2d), and the backward its grad ops."""
    seen = []

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(graph, _):
            seen.extend(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
            return make_boxed_func(graph.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    layer = dwconv.DepthwiseConv2d(3, 3, 3, padding=1, bias=False).to(DEVICE)
    torch.compile(layer, fullgraph=True, backend=backend)(randn(1, 3, 8, 34)).sum().backward()
    assert any("dwconv.conv2d.default" in s for s in seen), seen
    assert any("dwconv.conv2d_grad" in s for s in seen), seen
    assert not any("convolution" in s for s in seen), seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_casts_like_conv2d(dtype):
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    x, weight, bias = randn(2, 3, 9, 10), randn(3, 1, 3, 3), randn(3)
    with torch.autocast(device_type, dtype=dtype):
        out = dwconv.depthwise_conv2d(x, weight, bias, 1, 1)
        ref = F.conv2d(x, weight, bias, 1, 1, 1, 3)
    assert out.dtype == ref.dtype == dtype
    assert_close(out, F.conv2d(x.to(dtype).double(), weight.to(dtype).double(), bias.to(dtype).double(), 1, 1, 1, 3),
                 dtype)


@GPU
@pytest.mark.parametrize("kernel,dtype", [(3, torch.float32), (11, torch.float32), (13, torch.bfloat16)],
                         ids=["k3", "k11-large_fma", "k13-bfloat16-toeplitz"])
def test_cuda_graph_training_step(kernel, dtype):
    """A whole training step (forward, backward, optimizer) captured in a CUDA graph and replayed;
    k11 float32: the large-kernel FMA path; k13 bfloat16: the Toeplitz path, whose band rows are
    rebuilt from the updated weight each replay (a launch)."""
    torch.manual_seed(0)
    model = dwconv.convert(DepthwiseNet(kernel=kernel).cuda().to(dtype), verbose=False)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    static_x = randn(2, 4, 12, 12, dtype=dtype)

    def step(m, o, x):
        o.zero_grad(set_to_none=False)
        loss = m(x).square().sum()
        loss.backward()
        o.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: compile the kernels, fill the allocator's pools
            step(model, opt, static_x)
            step(reference, ref_opt, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, static_x)
    for _ in range(3):
        static_x.copy_(randn(2, 4, 12, 12, dtype=dtype))
        graph.replay()
        ref_loss = step(reference, ref_opt, static_x)
        assert_close(static_loss, ref_loss.double(), dtype, "replayed loss")
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p, q.double(), dtype, "parameters after replays")


class ConvNeXtBlocks(nn.Module):
    """ConvNeXt's block (7x7 depthwise with a bias, LayerNorm over channels, MLP, residual), twice."""

    def __init__(self, channels: int):
        super().__init__()
        self.depthwise = nn.ModuleList(nn.Conv2d(channels, channels, 7, padding=3, groups=channels) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(channels) for _ in range(2))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(channels, 4 * channels), nn.GELU(),
                                                nn.Linear(4 * channels, channels)) for _ in range(2))

    def forward(self, x):
        for depthwise, norm, mlp in zip(self.depthwise, self.norms, self.mlps):
            x = x + mlp(norm(depthwise(x).permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        return x.mean(dim=(2, 3))


@GPU
def test_a_graphed_step_holds_what_its_graph_reads():
    """A captured training step whose model and optimizer only its closure holds: the replay keeps
    them (the graph reads and writes their memory, made outside its pool), and replays right after
    another capture, whose empty_cache hands freed memory back to the driver. (Without, the replay
    faulted with an illegal memory access after any other capture: docs/decisions.md, "Whole models".)"""
    import gc
    import weakref

    from dwconv.bench_models import graphed, training_step

    torch.manual_seed(0)
    x = randn(4, 32, 12, 12).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 32, (4,), device="cuda")

    def step_held_by_its_closure():
        model = dwconv.convert(ConvNeXtBlocks(32), verbose=False).cuda().to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        return training_step(model, x, y, optimizer, torch.bfloat16), weakref.ref(model), weakref.ref(optimizer)

    fn, model, optimizer = step_held_by_its_closure()
    replay = graphed(fn)
    del fn
    gc.collect()
    assert model() is not None and optimizer() is not None, "the replay let go of what its graph reads"
    scratch = torch.empty(1 << 20, device="cuda")
    graphed(lambda: scratch.mul_(2))  # (a second capture: torch.cuda.graph empties the cache first)
    before = [p.detach().clone() for p in model().parameters()]
    replay()
    torch.cuda.synchronize()
    assert any(not torch.equal(b, p) for b, p in zip(before, model().parameters())), "the replay stepped nothing"


@GPU
@pytest.mark.parametrize("shape", [(2, 32, 12, 12), (64, 96, 56, 56)], ids=["small", "convnext_t_stage1"])
def test_eager_steps_beside_captured_graphs(shape):
    """bench --model's sequence on ConvNeXt's block: a stock copy's training step captured in a CUDA
    graph (bench_models.graphed), then a converted copy's step and another's inference, then eager
    training steps (C++ path, then the Python path) in turns with every graph's replays. Each
    captured copy ends as an eager copy stepped alike, the eager converted copy as a stock one."""
    from dwconv.bench_models import graphed

    torch.manual_seed(0)
    stock = ConvNeXtBlocks(shape[1]).cuda().to(memory_format=torch.channels_last)
    converted = dwconv.convert(copy.deepcopy(stock), verbose=False)
    models = {"stock": stock, "stock captured": copy.deepcopy(stock), "stock beside": copy.deepcopy(stock),
              **{name: copy.deepcopy(converted) for name in ("eager", "captured", "beside")}}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for name, m in models.items()}
    copy_for_inference = copy.deepcopy(converted).eval()
    x = randn(*shape).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, shape[1], (shape[0],), device="cuda")

    def step(name):
        optimizers[name].zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(models[name](x), y)
        loss.backward()
        optimizers[name].step()

    def inference():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return copy_for_inference(x)

    replays = []
    for captured, beside in (("stock captured", "stock beside"), ("captured", "beside")):
        replays.append(graphed(lambda name=captured: step(name)))  # (three warm-up steps, then the capture)
        for _ in range(3):
            step(beside)
    replays.append(graphed(inference))
    for _ in range(3):
        step("stock"), step("eager")
    torch.cuda.synchronize()
    for round in range(3):
        for native in ("1", "0"):
            with pytest.MonkeyPatch.context() as env:
                env.setenv("DWCONV_NATIVE", native)
                step("eager")
                torch.cuda.synchronize()
            step("stock")
        for replay in replays:
            replay()
            torch.cuda.synchronize()
        step("stock beside"), step("beside")
        torch.cuda.synchronize()
    for pair in (("eager", "stock"), ("captured", "beside"), ("stock captured", "stock beside")):
        for (name, p), q in zip(models[pair[1]].named_parameters(), models[pair[0]].parameters()):
            torch.testing.assert_close(q, p, rtol=5e-2, atol=5e-3, msg=lambda m: f"{pair[0]} {name}: {m}")


@GPU
def test_compile_reduce_overhead():
    torch.manual_seed(0)
    model = dwconv.convert(DepthwiseNet().cuda(), verbose=False)
    compiled = torch.compile(copy.deepcopy(model), mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        x = randn(2, 4, 12, 12)
        assert_close(compiled(x), model(x).double(), torch.float32, "reduce-overhead output")


# ---- dwconv.convert -----------------------------------------------------------------------------

class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)  # not depthwise: left alone
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),
            nn.BatchNorm2d(8),
            nn.Conv2d(8, 16, (5, 3), stride=2, padding="valid", dilation=(1, 2), groups=8),  # multiplier 2
        )
        self.reflect = nn.Conv2d(16, 16, 3, padding=1, groups=16, padding_mode="reflect")  # left alone
        self.grouped = nn.Conv2d(16, 16, 3, padding=1, groups=4)  # grouped, not depthwise: left alone
        self.head = nn.Conv2d(16, 16, 7, padding="same", groups=16)

    def forward(self, x):
        return self.head(self.grouped(self.reflect(self.block(self.stem(x)))))


def test_convert_replaces_only_depthwise_layers(capsys):
    model = Mixed().to(DEVICE)
    converted = dwconv.convert(model)
    assert capsys.readouterr().out == ("dwconv.convert: replaced 3 depthwise Conv2d layer(s); 1 depthwise left as is "
                                       "(padding_mode='reflect'); 2 other Conv2d left as is\n")
    assert converted.dwconv_converted == 3
    kinds = {name: type(m).__name__ for name, m in converted.named_modules() if isinstance(m, nn.Conv2d)}
    assert kinds == {"stem": "Conv2d", "block.0": "DepthwiseConv2d", "block.2": "DepthwiseConv2d",
                     "reflect": "Conv2d", "grouped": "Conv2d", "head": "DepthwiseConv2d"}
    assert all(type(m) is nn.Conv2d for m in model.modules() if isinstance(m, nn.Conv2d)), "not in place: untouched"
    x = randn(2, 3, 17, 19)
    assert_close(converted(x), model(x).double(), torch.float32, "converted model")


def test_convert_says_which_depthwise_layers_it_left(capsys):
    """Subclasses of nn.Conv2d (timm's Conv2dSame: TF-style padding in its own forward) are left
    alone, and convert says how many and why."""

    class Conv2dSame(nn.Conv2d):
        pass

    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=4), Conv2dSame(4, 4, 3, groups=4), Conv2dSame(4, 8, 3, groups=4))
    converted = dwconv.convert(model, precompile=False)
    assert capsys.readouterr().out == ("dwconv.convert: replaced 1 depthwise Conv2d layer(s); 2 depthwise left as is "
                                       "(Conv2dSame: a subclass of nn.Conv2d, whose forward may differ); 0 other Conv2d "
                                       "left as is\n")
    assert [type(m).__name__ for m in converted] == ["DepthwiseConv2d", "Conv2dSame", "Conv2dSame"]


def test_convert_keeps_weights_device_dtype_layout_and_mode():
    model = Mixed().to(DEVICE, torch.float64).to(memory_format=torch.channels_last).eval()
    converted = dwconv.convert(model, verbose=False)
    for (name, p), (name2, q) in zip(model.named_parameters(), converted.named_parameters()):
        assert name == name2 and torch.equal(p, q) and p.data_ptr() != q.data_ptr()
        assert (q.dtype, q.device, q.stride(), q.requires_grad) == (p.dtype, p.device, p.stride(), p.requires_grad)
    assert not any(m.training for m in converted.modules())
    same = dwconv.convert(model, inplace=True, verbose=False)
    assert same is model and isinstance(model.head, dwconv.DepthwiseConv2d)


def test_convert_state_dict_round_trip():
    stock = Mixed().to(DEVICE)
    converted = dwconv.convert(stock, verbose=False)
    assert list(stock.state_dict()) == list(converted.state_dict())
    fresh = Mixed().to(DEVICE)
    fresh.load_state_dict(converted.state_dict())  # converted -> stock
    x = randn(1, 3, 11, 13)
    assert_close(fresh(x), converted(x).double(), torch.float32, "stock model with converted weights")
    again = dwconv.convert(Mixed().to(DEVICE), verbose=False)
    again.load_state_dict(fresh.state_dict())  # stock -> converted
    assert_close(again(x), fresh(x).double(), torch.float32, "converted model with stock weights")


def test_convert_a_single_layer_and_bad_input():
    layer = nn.Conv2d(4, 4, 3, groups=4)
    assert isinstance(dwconv.convert(layer, verbose=False), dwconv.DepthwiseConv2d)
    with pytest.raises(TypeError, match="model"):
        dwconv.convert("not a model")


def test_convert_a_layer_used_twice():
    """One nn.Conv2d in two places (weights tied): converted in both, still one layer (before: only
    where it first appeared, which broke the tie)."""
    shared = nn.Conv2d(4, 4, 3, padding=1, groups=4)
    model = nn.Sequential(shared, nn.ReLU(), nn.Sequential(shared)).to(DEVICE)
    converted = dwconv.convert(model, verbose=False)
    assert converted.dwconv_converted == 1
    assert isinstance(converted[0], dwconv.DepthwiseConv2d) and converted[0] is converted[2][0]
    x = randn(2, 4, 6, 7)
    assert_close(converted(x), model(x).double(), torch.float32, "tied model")


def test_convert_keeps_hooks_and_parametrizations():
    """weight_norm and spectral_norm (torch.nn.utils.parametrizations), the older hook-based
    weight_norm and pruning: every such layer converted, in place, with the same outputs and
    gradients as the stock model (before: the first hook-based layer raised midway, the model left
    half-converted; parametrized layers were left alone)."""
    from torch.nn.utils import parametrizations, prune

    def model():
        torch.manual_seed(0)
        layers = [nn.Conv2d(4, 4, 3, padding=1, groups=4) for _ in range(5)]
        parametrizations.weight_norm(layers[1])
        with pytest.warns(FutureWarning):
            torch.nn.utils.weight_norm(layers[2])
        prune.l1_unstructured(layers[3], "weight", amount=0.4)
        parametrizations.spectral_norm(layers[4])
        return nn.Sequential(*layers).to(DEVICE)

    stock, converted = model(), model()
    same = dwconv.convert(converted, inplace=True, verbose=False)
    assert same is converted and converted.dwconv_converted == 5
    assert all(isinstance(m, dwconv.DepthwiseConv2d) for m in converted)
    assert torch.nn.utils.parametrize.type_before_parametrizations(converted[1]) is dwconv.DepthwiseConv2d
    assert list(stock.state_dict()) == list(converted.state_dict())
    x = randn(2, 4, 7, 6)
    outs = [m(x) for m in (stock, converted)]
    assert_close(outs[1], outs[0].double(), torch.float32, "output")
    for m, out in zip((stock, converted), outs):
        out.square().sum().backward()
    for (name, p), (_, q) in zip(stock.named_parameters(), converted.named_parameters()):
        assert_close(q.grad, p.grad.double(), torch.float32, f"gradient of {name}")


# ---- exporting: torch.export, torch.jit.trace --------------------------------------------------

EXPORTED_SHAPE = (2, 3, 9, 11)


def exported_pair():
    """A stock model with every depthwise form (multiplier 2, 'valid', 'same', dilation, a layer
    left alone) and its conversion, already called once (so that the C++ path knows its layers)."""
    torch.manual_seed(0)
    stock = Mixed().to(DEVICE).eval()
    converted = dwconv.convert(stock, verbose=False)
    with torch.no_grad():
        converted(randn(*EXPORTED_SHAPE))
    return stock, converted


def check_exported(run, stock, what):
    """run's output and input gradient on a fresh input (not the example): stock's in float64."""
    x = randn(*EXPORTED_SHAPE).requires_grad_()
    out = run(x)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    x64 = x.detach().double().requires_grad_()
    want = copy.deepcopy(stock).double()(x64)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x64)
    assert_close(out, want, torch.float32, f"{what} output")
    assert_close(grad, want_grad, torch.float32, f"{what} input gradient")


@pytest.mark.parametrize("native", ["0", "1"])
def test_jit_trace_records_the_registered_op(monkeypatch, native):
    """torch.jit.trace records operators, not kernel launches: a traced converted model holds one
    dwconv::conv2d a depthwise layer and computes fresh inputs (not the example's output frozen in,
    nor an empty tensor), with gradients, before and after a save and load. With the C++ path on,
    a known layer's call records its replayed aten ops alone unless traced through the op."""
    import io

    monkeypatch.setenv("DWCONV_NATIVE", native)
    stock, converted = exported_pair()
    traced = torch.jit.trace(converted, (randn(*EXPORTED_SHAPE),), check_trace=False)
    kinds = [node.kind() for node in traced.inlined_graph.nodes()]
    assert kinds.count("dwconv::conv2d") == converted.dwconv_converted == 3, kinds
    check_exported(traced, stock, "traced")
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    check_exported(torch.jit.load(buffer, map_location=DEVICE), stock, "traced, saved and loaded")


def test_fx_symbolic_trace_records_one_call_a_layer():
    """torch.fx's symbolic trace (torchvision's feature extraction, FX quantization and rewrites
    use it) records each depthwise layer as one call of dwconv's function, as F.conv2d's, instead of
    tracing into its checks (which raised on the proxies): the GraphModule computes fresh inputs."""
    stock, converted = exported_pair()
    graph_module = torch.fx.symbolic_trace(converted)
    targets = [node.target for node in graph_module.graph.nodes if node.op == "call_function"]
    assert targets.count(dwconv.depthwise_conv2d) == 3, targets
    check_exported(graph_module, stock, "FX graph module")

    class Direct(nn.Module):  # (a user's module calling the function itself)
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(randn(3, 1, 3, 3))

        def forward(self, x):
            return dwconv.depthwise_conv2d(x, self.weight, None, 1, 1, 1).relu()

    direct = Direct()
    graph_module = torch.fx.symbolic_trace(direct)
    assert [n.target for n in graph_module.graph.nodes if n.op == "call_function"] == [dwconv.depthwise_conv2d]
    x = randn(*EXPORTED_SHAPE)
    assert_close(graph_module(x), direct(x).double(), torch.float32, "FX graph of a direct call")


def test_jit_script_refuses_with_a_clear_error():
    """torch.jit.script cannot compile the Python forward: it says so at once, naming what works,
    and leaves the model as it was."""
    stock, converted = exported_pair()
    with pytest.raises(RuntimeError, match="torch.jit.script cannot compile dwconv.DepthwiseConv2d"):
        torch.jit.script(converted)
    assert sum(isinstance(m, dwconv.DepthwiseConv2d) for m in converted.modules()) == 3
    x = randn(*EXPORTED_SHAPE)
    assert_close(converted(x), stock.double()(x.double()), torch.float32, "after the refusal")


def test_torch_export_holds_the_registered_op():
    """torch.export: one dwconv::conv2d a depthwise layer in the exported program, which computes
    fresh inputs with gradients."""
    stock, converted = exported_pair()
    program = torch.export.export(converted, (randn(*EXPORTED_SHAPE),))
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.dwconv.conv2d.default) == 3, targets
    check_exported(program.module(), stock, "exported")


def test_aot_inductor_package_calls_the_op(tmp_path):
    """An exported converted model compiled by AOTInductor and loaded back: its generated code calls
    dwconv's op through the dispatcher, with stock's values on fresh inputs."""
    stock, converted = exported_pair()
    program = torch.export.export(converted, (randn(*EXPORTED_SHAPE),))
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "model.pt2"))
    runner = torch._inductor.aoti_load_package(package)
    x = randn(*EXPORTED_SHAPE)
    with torch.no_grad():
        assert_close(runner(x), copy.deepcopy(stock).double()(x.double()), torch.float32, "AOTInductor output")


def test_model_bench_helpers():
    """`bench --model`'s building blocks on the tiny model (the timing itself needs a GPU)."""
    from dwconv.bench_models import build_model, compare_gradients, compare_outputs

    torch.manual_seed(0)
    stock = build_model("tiny").to(DEVICE)
    converted = dwconv.convert(stock, verbose=False)
    assert converted.dwconv_converted == 2
    x = randn(2, 3, 16, 16)
    assert compare_outputs(stock, converted, x) < 1e-5
    # compare_gradients on stock layers (the interpreter takes minutes for this model's backward;
    # the GPU test below runs it on converted models): a copy matches, a changed weight shows
    twin = copy.deepcopy(stock)
    assert compare_gradients(stock, twin, x) == 0
    with torch.no_grad():
        twin.features[2].weight[0, 0, 1, 1] += 0.5
    assert compare_gradients(stock, twin, x) > 1e-3


@GPU
@pytest.mark.parametrize("name", ["mobilenet_v2", "efficientnet_b0", "convnext_tiny"])
def test_real_models_match_stock(name):
    """Converted torchvision / timm models (random weights) give the stock model's outputs
    and parameter gradients, float32 without TF32 (so only the depthwise layers differ)."""
    pytest.importorskip("torchvision")
    from dwconv.bench_models import build_model, compare_gradients, compare_outputs

    torch.manual_seed(0)
    stock = build_model(name).to(DEVICE)
    converted = dwconv.convert(stock, verbose=False)
    assert converted.dwconv_converted > 0
    x = randn(2, 3, 96, 96)
    assert compare_outputs(stock, converted, x) < 1e-4  # (both without TF32)
    assert compare_gradients(stock, converted, x) < 1e-3
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    try:
        compare_outputs(stock, converted, x)
        assert torch.backends.cudnn.allow_tf32, "the comparison restores TF32 as it found it"
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def test_model_cold_start_harness(monkeypatch):
    """`bench --model`'s cold start on the tiny model: fresh processes (stock, dwconv without and with
    its warmup, a second process on the warmed cache, the model converted with fuse=True from an empty
    cache and then warm, and an image's build without the GPU and a process on its cache), each row
    in the results schema. Here
    the processes run without the interpreter (CPU tensors take F.conv2d) and warmup compiles for
    sm_90: the harness is what is tested, the GPU times it."""
    from dwconv.bench import CSV_FIELDS
    from dwconv.bench_models import COLD_START_RUNS, FROM_IMAGE, FUSED_RUNS, cold_start

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = cold_start("tiny", 2, 8, "float32", timeout=300, without_warmup=True, from_image=True, fuse=True)
    assert {r["path"] for r in rows} == ({label for label, _, _ in COLD_START_RUNS + FUSED_RUNS + FROM_IMAGE}
                                         | {"dwconv no warmup"})
    assert {(r["path"], r["pass"]) for r in rows} >= {("dwconv", "warmup"), ("stock", "first train step"),
                                                     ("dwconv warm", "second train step"), ("dwconv", "process"),
                                                     ("dwconv warm", "warmup"), ("dwconv image build", "warmup"),
                                                     ("dwconv from image", "first train step"),
                                                     ("dwconv fused", "warmup"), ("dwconv fused warm", "first train step")}
    assert not {("stock", "warmup"), ("dwconv no warmup", "warmup")} & {(r["path"], r["pass"]) for r in rows}
    assert all(r["ms"] > 0 and set(r) <= set(CSV_FIELDS) for r in rows)


@GPU
def test_bench_model_times_every_path():
    """bench --model's steady state on the small network: a row for every path and step (the CUDA
    graph paths captured one at a time after the others), and each step from an idle GPU for the
    paths not replayed from a graph, each with a time and a ratio to stock."""
    from dwconv.bench_models import COMPILE_MODES, CUDA_GRAPH, bench_model, model_paths

    rows = bench_model("tiny", 2, 32, warmup=1, iters=2, compile_modes="no", precisions="bf16", rounds=2, fuse=True)
    timed = {(r["path"], r["mode"]): r for r in rows if r["suite"] == "model"}
    paths = model_paths(COMPILE_MODES["no"], fuse=True)
    assert set(timed) == ({(label, step) for label, *_ in paths for step in ("train step", "inference")}
                          | {(label, f"{step}, from an idle GPU") for label, _, mode, _ in paths if mode != CUDA_GRAPH
                             for step in ("train step", "inference")})
    assert all(r["ms"] > 0 and r["vs_stock"] > 0 for r in timed.values())


def test_model_paths_compare_with_stock_of_the_same_compilation():
    from dwconv.bench_models import COMPILE_MODES, model_paths, stock_path

    paths = model_paths(COMPILE_MODES["all"])
    labels = [label for label, _, _, _ in paths]
    assert len(labels) == len(set(labels)) == 11
    for label, variant, mode, native in paths:
        base = next(p for p in paths if p[0] == stock_path(label))
        assert base[1] == "stock" and base[2] == mode and (native is None or variant == "dwconv")
    assert [label for label, *_ in model_paths(COMPILE_MODES["no"])] == [
        "stock eager", "dwconv eager", "dwconv eager, Python path", "stock eager, CUDA graph",
        "dwconv eager, CUDA graph"]
    assert [label for label, *_ in model_paths(COMPILE_MODES["all"], eager=False)] == [
        "stock compiled", "dwconv compiled", "stock compiled max-autotune-no-cudagraphs",
        "dwconv compiled max-autotune-no-cudagraphs", "stock compiled reduce-overhead",
        "dwconv compiled reduce-overhead"]
    fused = model_paths(COMPILE_MODES["default"], fuse=True)
    assert [label for label, variant, *_ in fused if variant.startswith("fused")] == [
        "dwconv fused eager", "dwconv fused eager, blocks module by module", "dwconv fused eager, CUDA graph",
        "dwconv fused compiled"]
    for label, variant, mode, native in fused:
        base = next(p for p in fused if p[0] == stock_path(label))
        assert base[1] == "stock" and base[2] == mode
    assert [label for label, *_ in model_paths(COMPILE_MODES["default"], fuse=True, unfused=False)] == [
        "stock eager", "stock eager, CUDA graph", "dwconv fused eager", "dwconv fused eager, blocks module by module",
        "dwconv fused eager, CUDA graph", "stock compiled", "dwconv fused compiled"]


def test_launched_kernels_from_profiler_events():
    """The profiler's kernels: device events but the GPU spans of record_function ranges; under a
    range, those whose host launch (the runtime or driver call of the kernel's id) sits under it
    or ran while it was open, those linked to an operator under it, and dwconv's kernels by name.
    The H200's torch 2.11 links no kernel to an operator: only the launches' ids lead there."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from dwconv.bench_models import dwconv_kernel_names, launched_kernels

    def event(id, name, start, end, device=DeviceType.CPU, annotation=False, linked=0, parent=None):
        made = FunctionEvent(id=id, name=name, thread=0, start_us=start, end_us=end, device_type=device,
                             is_user_annotation=annotation, linked_correlation_id=linked)
        if parent is not None:
            made.set_cpu_parent(parent)
        return made

    depthwise = event(1, "depthwise", 0, 50, annotation=True)
    conv, other = event(2, "aten::conv", 1, 9, parent=depthwise), event(3, "aten::add", 60, 70)
    to = event(31, "aten::to", 10, 12, parent=depthwise)  # (an operator's id equal to a launch's: another sequence)
    cpu = [depthwise, conv, other, to,
           event(2, "cudaLaunchKernel", 62, 63, linked=2, parent=other),  # (a launch's id equal to an operator's)
           event(2, "cudaStreamIsCapturing", 80, 81),  # (a runtime call outside any operator: linked to none)
           event(30, "cuLaunchKernel", 4, 5, linked=2, parent=conv),
           event(31, "cudaLaunchKernel", 65, 66, linked=3, parent=other),
           event(20, "cuLaunchKernelEx", 40, 41),  # (launches tied to no operator: by time)
           event(21, "cuLaunchKernelEx", 61, 62)]
    gpu = [event(10, "dgrad_kernel", 100, 104, DeviceType.CUDA, linked=2),  # (no launch, linked: torch >= 2.13)
           event(11, "depthwise_fwd_tile_kernel", 104, 110, DeviceType.CUDA),
           event(12, "add_kernel", 110, 111, DeviceType.CUDA, linked=3),
           event(13, "depthwise", 100, 110, DeviceType.CUDA, annotation=True),
           event(30, "cudnn_dgrad_kernel", 111, 112, DeviceType.CUDA),
           event(31, "copy_kernel", 112, 113, DeviceType.CUDA),
           event(20, "cudnn_depthwise_kernel", 113, 115, DeviceType.CUDA),
           event(21, "cudnn_add_kernel", 115, 118, DeviceType.CUDA)]
    assert launched_kernels(cpu + gpu) == [(e.name, e.time_range.elapsed_us()) for e in gpu if e.name != "depthwise"]
    assert launched_kernels(cpu + gpu, "depthwise") == [("dgrad_kernel", 4), ("cudnn_dgrad_kernel", 1),
                                                        ("cudnn_depthwise_kernel", 2)]
    assert launched_kernels(cpu + gpu, "depthwise", dwconv_kernel_names()) == [
        ("dgrad_kernel", 4), ("depthwise_fwd_tile_kernel", 6), ("cudnn_dgrad_kernel", 1), ("cudnn_depthwise_kernel", 2)]


@GPU
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
def test_depthwise_share_of_stock_layers(memory_format):
    """The profiler's depthwise share of a stock model (cuDNN's kernels, linked to their operators
    under the layers' ranges) is its layers' kernels, not 0: bench --model wrote 0 for stock
    MobileNetV2 and ConvNeXt-T (bfloat16 autocast, channels_last). On a mismatch, the device
    events, their links and the operators they lead to are printed."""
    from dwconv.bench_models import depthwise_share, training_step

    torch.manual_seed(0)
    # (a layer first: a depthwise layer on an input that needs no gradient closes its backward range
    # at once, before its own backward runs)
    model = nn.Sequential(nn.Conv2d(64, 64, 1), nn.Conv2d(64, 64, 7, padding=3, groups=64), nn.ReLU(),
                          nn.Conv2d(64, 64, 1)).cuda()
    model = model.to(memory_format=memory_format)
    x = randn(8, 64, 56, 56).contiguous(memory_format=memory_format)
    y = torch.randint(0, 64, (8,), device="cuda")
    head = nn.Sequential(model, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    step = training_step(head, x, y, torch.optim.SGD(head.parameters(), lr=1e-3), torch.bfloat16)
    events = []
    share = depthwise_share(model, step, events=events)
    if not share["depthwise_ms"] > 0:
        def linked(event):
            return getattr(event, "linked_correlation_id", 0)
        frontend = {e.id: e for e in events if e.device_type.name == "CPU" and not linked(e)}

        def chain(event):
            names = []
            while event is not None:
                names.append(event.name)
                event = event.cpu_parent
            return " < ".join(names)
        launches = {e.id: e for e in events if e.device_type.name == "CPU" and linked(e)}
        spans = [(e.time_range.start, e.time_range.end) for e in frontend.values() if e.name == "depthwise"]

        def launch(event):
            found = launches.get(event.id)
            return "no launch" if found is None else f"launch {found.name} at {found.time_range.start:.0f} us"
        lines = [f"depthwise ranges (us): {spans[:8]}"] + [
            f"{e.name[:60]}: id {e.id}, linked {linked(e)} -> {chain(frontend.get(linked(e)))}; {launch(e)}"
            for e in events if e.device_type.name != "CPU"][:40]
        pytest.fail(f"stock depthwise share {share}; device events:\n" + "\n".join(lines))
    assert share["depthwise_ms"] < share["gpu_ms"]


def test_model_profile_ranges():
    """bench --model's profiler ranges: every depthwise layer's forward and backward is one range a
    step (2 layers: 4 in training, 2 in inference); their GPU time needs a GPU."""
    from dwconv.bench_models import build_model, depthwise_share, inference, training_step

    torch.manual_seed(0)
    model = build_model("tiny")  # (stock layers on the CPU: the hooks, not the kernels, are tested)
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
    step = training_step(model.train(), x, y, torch.optim.SGD(model.parameters(), lr=1e-3), None, "cpu")
    assert depthwise_share(model, step)["ranges"] == 4
    assert depthwise_share(model.eval(), inference(model, x, None))["ranges"] == 2


def test_host_time_by_layer_from_hooks():
    """benchmarks/model_profile.py's host time inside each kind of layer: the depthwise layers one
    kind, forward and backward seen each step, and inside the step's own time (on the CPU, the
    step's time); the hooks removed after."""
    import importlib.util

    from dwconv.bench_models import build_model, training_step

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("model_profile", os.path.join(root, "benchmarks", "model_profile.py"))
    model_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model_profile)
    torch.manual_seed(0)
    model = build_model("tiny")
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
    step = training_step(model.train(), x, y, torch.optim.SGD(model.parameters(), lr=1e-3), None, "cpu")
    inside = model_profile.host_by_layer(model, step, repeats=3)
    assert inside[("depthwise", "forward")] > 0 and inside[("depthwise", "backward")] > 0, inside
    assert inside[("Conv2d", "forward")] > 0 and inside[("ReLU", "forward")] > 0  # (the other layers by class)
    assert sum(ms for key, ms in inside.items() if key != "step" and key[1] == "forward") < inside["step"]
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())
