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
