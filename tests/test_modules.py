"""DepthwiseConv2d and kernelbench.ModelNew against nn.Conv2d built from the same seed."""

import pytest
import torch
import torch.nn as nn

import dwconv
from dwconv import kernelbench
from helpers import DEVICE, assert_close


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(in_channels=3, out_channels=3, kernel_size=3, padding=1),
        dict(in_channels=4, out_channels=8, kernel_size=(5, 3), stride=2, padding=(2, 1), bias=False),
        dict(in_channels=2, out_channels=2, kernel_size=4, padding="same", dilation=2),
        dict(in_channels=3, out_channels=6, kernel_size=3, padding=1, padding_mode="reflect"),
        dict(in_channels=3, out_channels=3, kernel_size=3, padding=2, padding_mode="circular"),
        dict(in_channels=3, out_channels=3, kernel_size=2, padding="same", padding_mode="replicate"),
    ],
    ids=str,
)
def test_module_matches_conv2d(kwargs):
    torch.manual_seed(1234)
    stock = nn.Conv2d(groups=kwargs["in_channels"], **kwargs).to(DEVICE)
    torch.manual_seed(1234)
    ours = dwconv.DepthwiseConv2d(**kwargs).to(DEVICE)
    assert isinstance(ours, nn.Conv2d)
    assert ours.groups == kwargs["in_channels"]
    assert ours.state_dict().keys() == stock.state_dict().keys()
    for key, value in stock.state_dict().items():  # same RNG draws
        assert torch.equal(ours.state_dict()[key], value), key
    x = torch.randn(2, kwargs["in_channels"], 11, 9, device=DEVICE)
    with torch.no_grad():
        assert_close(ours(x), stock.double()(x.double()), torch.float32)


def test_state_dict_round_trip():
    stock = nn.Conv2d(4, 8, 3, groups=4, bias=True)
    ours = dwconv.DepthwiseConv2d(4, 8, 3)
    ours.load_state_dict(stock.state_dict())
    stock.load_state_dict(ours.state_dict())
    assert torch.equal(ours.weight, stock.weight) and torch.equal(ours.bias, stock.bias)


def test_kernelbench_model_new_matches_model():
    small = [8, 8, 3, 1, 0]  # the KernelBench 84 constructor arguments, at a size the interpreter can run
    torch.manual_seed(42)
    model = kernelbench.Model(*small).to(DEVICE)
    torch.manual_seed(42)
    model_new = kernelbench.ModelNew(*small).to(DEVICE)
    assert torch.equal(model.conv2d.weight, model_new.conv2d.weight)
    assert model_new.conv2d.bias is None
    x = torch.rand(2, 8, 16, 32, device=DEVICE)
    with torch.no_grad():
        assert_close(model_new(x), model.double()(x.double()), torch.float32)


def test_kernelbench_inputs():
    assert kernelbench.get_init_inputs() == [128, 128, 3, 1, 0]
