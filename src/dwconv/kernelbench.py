"""KernelBench level 1 problem 84: depthwise 3x3 convolution, asymmetric input, square kernel.

`Model` is the problem's reference, `ModelNew` the dwconv version with the same constructor,
parameters and RNG draws (a KernelBench harness loads `ModelNew` from this module).
"""

import torch
import torch.nn as nn

from .modules import DepthwiseConv2d

batch_size = 64
in_channels = 128
out_channels = 128
kernel_size = 3
width_in = 512
height_in = 256
stride = 1
padding = 0


class Model(nn.Module):
    """Reference: nn.Conv2d with groups=in_channels."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 padding: int = 0, bias: bool = False):
        super().__init__()
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size=(kernel_size, kernel_size),
                                stride=stride, padding=padding, groups=in_channels, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2d(x)


class ModelNew(nn.Module):
    """dwconv: same constructor, same parameters drawn in the same order as `Model`."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 padding: int = 0, bias: bool = False):
        super().__init__()
        self.conv2d = DepthwiseConv2d(in_channels, out_channels, kernel_size=(kernel_size, kernel_size),
                                      stride=stride, padding=padding, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2d(x)


def get_inputs():
    x = torch.rand(batch_size, in_channels, height_in, width_in)
    return [x]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, padding]
