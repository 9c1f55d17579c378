"""The launch fast path (dwconv.kernels._launch.launch with tuned().fast_launch): its bookkeeping here with a
stand-in kernel (no GPU needed), and on the GPU the gradients and outputs it gives against Triton's
own launch path."""

import pytest
import torch

import dwconv
from dwconv.kernels._launch import LaunchPlan, launch
from helpers import DEVICE, assert_close, randn, reference_conv


class FakeTensor:
    is_cuda = True

    def __init__(self, address, dtype=torch.float32, device=0):
        self.address, self.dtype, self.device_index = address, dtype, device

    def data_ptr(self):
        return self.address

    def get_device(self):
        return self.device_index

    @property
    def device(self):
        return torch.device("cuda", self.device_index)


class FakeCompiled:
    """What a JITFunction launch returns: indexing by a 3-dimensional grid gives its launcher."""

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("compiled", grid, args))


class FakeKernel:
    arg_names = ["x", "y", "size", "stride", "BLOCK", "FLAG"]

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return FakeCompiled(self.calls)
        return run


def test_fast_launch_reuses_the_compiled_kernel_only_for_the_same_pointer_kinds(retune, monkeypatch):
    retune(fast_launch=True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = FakeKernel()
    plan = LaunchPlan("fake", (7,), (100, 3), dict(FLAG=True, BLOCK=64, num_warps=4))
    x, y = FakeTensor(1024), FakeTensor(2048)
    launch(kernel, plan, x, y)
    assert kernel.calls[-1] == ("triton", (7,), (x, y, 100, 3), dict(FLAG=True, BLOCK=64, num_warps=4))
    launch(kernel, plan, FakeTensor(4096), y)  # another 16-byte aligned x: the compiled kernel, arguments in order
    assert kernel.calls[-1][:2] == ("compiled", (7, 1, 1))
    assert kernel.calls[-1][2][2:] == (100, 3, 64, True), "scalars, then constexprs in the kernel's order"
    launch(kernel, plan, FakeTensor(4100), y)  # not 16-byte aligned: Triton specialises again
    assert kernel.calls[-1][0] == "triton"
    launch(kernel, plan, x, FakeTensor(2048, torch.bfloat16))  # another dtype: Triton again
    assert kernel.calls[-1][0] == "triton"
    assert len(kernel.calls) == 4


def test_no_fast_launch_when_off_or_on_the_cpu(retune, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = FakeKernel()
    plan = LaunchPlan("fake", (2,), (5, 6), dict(FLAG=False, BLOCK=8))
    retune(fast_launch=False)
    for _ in range(2):
        launch(kernel, plan, FakeTensor(0), FakeTensor(0))
    assert [c[0] for c in kernel.calls] == ["triton", "triton"] and not plan.compiled


def test_launch_runs_on_the_tensors_gpu(retune, monkeypatch):
    """A tensor on a GPU other than the current one: the launch happens with its GPU made current
    (Triton launches on the current device), and not otherwise."""
    current = [0]
    entered = []

    class DeviceContext:
        def __init__(self, device):
            self.index = device.index

        def __enter__(self):
            entered.append(self.index)
            current[0], self.previous = self.index, current[0]

        def __exit__(self, *exc):
            current[0] = self.previous

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", DeviceContext)
    for fast in (False, True):
        retune(fast_launch=fast)
        kernel = FakeKernel()
        plan = LaunchPlan("fake", (3,), (1, 2), dict(FLAG=True, BLOCK=16))
        launched_on = []
        kernel.calls = type("Recorder", (list,), {"append": lambda self, call: launched_on.append(current[0])})()
        launch(kernel, plan, FakeTensor(0, device=1), FakeTensor(0, device=1))
        launch(kernel, plan, FakeTensor(0, device=0), FakeTensor(0, device=0))
        assert launched_on == [1, 0] and current[0] == 0
    assert entered == [1, 1], "the guard only where the tensor's GPU is not the current one"


@pytest.mark.skipif(DEVICE != "cuda", reason="launches compiled kernels")
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
def test_fast_launch_on_the_gpu(retune, layout):
    """Forward and gradients, three calls each with fresh tensors, through the fast path: the same
    values as Triton's path, right against a float64 reference."""
    retune(fast_launch=True)
    for _ in range(3):
        x = randn(4, 32, 19, 23).contiguous(memory_format=layout).requires_grad_()
        weight = randn(32, 1, 3, 3).requires_grad_()
        bias = randn(32).requires_grad_()
        out = dwconv.depthwise_conv2d(x, weight, bias, 1, 1)
        assert_close(out, reference_conv(x, weight, bias, 1, 1, 1), torch.float32)
        grads = torch.autograd.grad(out, (x, weight, bias), torch.ones_like(out))
        retune(fast_launch=False)
        slow = torch.autograd.grad(dwconv.depthwise_conv2d(x, weight, bias, 1, 1), (x, weight, bias),
                                   torch.ones_like(out))
        retune(fast_launch=True)
        for got, ref in zip(grads, slow):
            assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("kernel,stride", [(3, 1), (3, 2), (7, 1), (31, 1)])
def test_plans_from_fake_tensors_with_a_symbolic_batch(retune, monkeypatch, kernel, stride, channels_last, dtype):
    """The GPU's launch plans of a forward and a backward built from fake tensors whose batch is
    symbolic (as torch.compile's dynamic=True traces shapes), without a data pointer
    (alignment from the storage offset) or a cache (symbolic keys do not hash): every launch's
    constexprs concrete (a kernel binary cannot depend on the batch), the batch only in its grid and
    runtime arguments."""
    import sys
    import warnings

    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from dwconv import _library, dispatch
    from dwconv._geometry import conv_geometry

    retune(plan_as_gpu=True)
    launches = []
    for module in [m for name, m in sys.modules.items() if name.startswith("dwconv.kernels.")]:
        if hasattr(module, "launch"):
            monkeypatch.setattr(module, "launch", lambda kernel, plan, *tensors: launches.append((kernel, plan)))
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t, dynamic_batch=False):
        sizes = [DimDynamic.DYNAMIC if dynamic_batch and d == 0 else DimDynamic.STATIC for d in range(t.dim())]
        return mode.from_tensor(t, source=ConstantSource(f"t{len(sizes)}{dynamic_batch}"),
                                symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    x = randn(64, 16, 20, 20, dtype=dtype, device="cpu")  # (a batch past the small-batch blocks)
    x = fake(x.contiguous(memory_format=torch.channels_last) if channels_last else x, dynamic_batch=True)
    weight, bias = fake(randn(16, 1, kernel, kernel, dtype=dtype, device="cpu")), fake(randn(16, dtype=dtype, device="cpu"))
    assert isinstance(x.shape[0], torch.SymInt)
    with mode, warnings.catch_warnings():
        warnings.simplefilter("error")  # (a fake tensor's data_ptr() warns: no plan may read it)
        geom = conv_geometry(x, weight, bias, stride, kernel // 2, 1)
        out = dispatch.conv_forward(x, weight, bias, geom)
        forward_launches = len(launches)
        grads = _library._backward_formula(torch.empty_like(out), x, weight, geom, True, True, True, traced=False)
    assert forward_launches and len(launches) > forward_launches
    assert isinstance(out.shape[0], torch.SymInt) and isinstance(grads[0].shape[0], torch.SymInt)
    assert tuple(grads[1].shape) == (16, 1, kernel, kernel) and tuple(grads[2].shape) == (16,)
    for launched, plan in launches:
        symbolic = {name: value for name, value in plan.constants.items() if isinstance(value, torch.SymInt)}
        assert not symbolic, f"{launched.__name__}: constexprs that follow the batch: {symbolic}"


@pytest.mark.parametrize("kernel,stride,channels_last,dtype,channels", [
    (3, 1, True, torch.bfloat16, 128),  # (bfloat16 channel pairs: an aligned base)
    (3, 1, False, torch.float32, 16),  # (rows of 18: 2 mod 4, aligned odd rows)
    (3, 2, False, torch.float32, 16), (7, 1, True, torch.float32, 16), (31, 1, False, torch.bfloat16, 16)])
def test_traced_launches_are_the_eager_ones(retune, monkeypatch, kernel, stride, channels_last, dtype, channels):
    """The launches a trace on fake tensors records are the ones the same call makes on real tensors:
    kernels, grids, runtime arguments and constexprs, forward and backward (the GPU's plans; launches
    recorded, not run): a plan reads metadata only, which the replayer's keys rely on."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensorMode

    from dwconv import _library, dispatch
    from dwconv._geometry import conv_geometry

    retune(plan_as_gpu=True)
    launches = []
    for module in [m for name, m in sys.modules.items() if name.startswith("dwconv.kernels.")]:
        if hasattr(module, "launch"):
            monkeypatch.setattr(module, "launch", lambda kernel, plan, *tensors: launches.append(
                (kernel.__name__, tuple(plan.grid), tuple(plan.scalars), tuple(sorted(plan.constants.items())))))

    def passes(x, weight, bias):
        launches.clear()
        geom = conv_geometry(x, weight, bias, stride, kernel // 2, 1)
        out = dispatch.conv_forward(x, weight, bias, geom)
        _library._backward_formula(torch.empty_like(out), x, weight, geom, True, True, True, traced=False)
        return list(launches)

    x = randn(4, channels, 18, 18, dtype=dtype, device="cpu")
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    tensors = (x, randn(channels, 1, kernel, kernel, dtype=dtype, device="cpu"),
               randn(channels, dtype=dtype, device="cpu"))
    eager = passes(*tensors)
    with FakeTensorMode() as mode:
        traced = passes(*(mode.from_tensor(t) for t in tensors))
    assert eager and traced == eager
