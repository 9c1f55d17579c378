"""`DepthwiseConv2d`: a drop-in nn.Conv2d whose forward runs dwconv's kernels."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .activations import activation_code
from .functional import depthwise_conv2d


class DepthwiseConv2d(nn.Conv2d):
    """nn.Conv2d with groups == in_channels, computed by dwconv.

    Same constructor, parameters, initialisation and state_dict keys as nn.Conv2d, so
    pretrained weights load and isinstance(m, nn.Conv2d) holds. `groups` may be omitted;
    if given it must equal in_channels. padding_mode 'reflect', 'replicate' and 'circular'
    pad explicitly (as nn.Conv2d does) and then run the kernel without padding.

    activation: an activation applied to the output (`depthwise_conv2d`'s: "relu", "relu6",
    "silu", "gelu", "gelu_tanh", "hardswish", "hardsigmoid"), in the kernel's epilogue where no
    gradient is wanted; None (default) for none.
    """

    activation: Optional[str] = None  # (a converted nn.Conv2d, whose class changed, reads this)

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: Optional[int] = None, bias: bool = True,
                 padding_mode: str = "zeros", device=None, dtype=None, activation: Optional[str] = None) -> None:
        if groups is not None and groups != in_channels:
            raise ValueError(f"groups must equal in_channels ({in_channels}) for DepthwiseConv2d, got {groups}")
        if not isinstance(in_channels, int) or in_channels < 1:
            raise ValueError(f"in_channels must be a positive int, got {in_channels!r}")
        activation_code(activation)  # (checked here, not at the first call)
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                         dilation=dilation, groups=in_channels, bias=bias, padding_mode=padding_mode,
                         device=device, dtype=dtype)
        self.activation = activation

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", activation={self.activation!r}" if self.activation is not None else "")

    def __prepare_scriptable__(self):
        # (torch.jit.script asks each submodule first: refused here, before it compiles anything)
        raise RuntimeError(
            "torch.jit.script cannot compile dwconv.DepthwiseConv2d (its forward launches Triton kernels "
            "from Python). torch.jit.trace and torch.export record dwconv's op, torch.ops.dwconv.conv2d; or "
            "script the stock model: a converted model's state_dict loads into it unchanged")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.padding_mode != "zeros":
            padded = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return depthwise_conv2d(padded, self.weight, self.bias, self.stride, 0, self.dilation, self.activation)
        return depthwise_conv2d(input, self.weight, self.bias, self.stride, self.padding, self.dilation,
                                self.activation)
