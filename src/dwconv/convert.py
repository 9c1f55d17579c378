"""`dwconv.convert`: swap the depthwise nn.Conv2d layers of an existing model for DepthwiseConv2d."""

from __future__ import annotations

import copy

import torch.nn as nn

from .modules import DepthwiseConv2d


def is_convertible(module: nn.Module) -> bool:
    """A plain nn.Conv2d (not a subclass, whose forward may differ) with groups == in_channels > 1
    and zero padding: any kernel, stride, padding, dilation, channel multiplier and bias."""
    return (type(module) is nn.Conv2d and module.groups == module.in_channels > 1
            and module.out_channels % module.in_channels == 0 and module.padding_mode == "zeros")


def to_depthwise(conv: nn.Conv2d) -> DepthwiseConv2d:
    """A DepthwiseConv2d holding conv's own parameters (same tensors: device, dtype, memory format,
    requires_grad) and training mode. Hooks registered on conv are not carried over."""
    weight = conv.weight
    layer = DepthwiseConv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                            conv.dilation, bias=conv.bias is not None, padding_mode=conv.padding_mode,
                            device="meta", dtype=weight.dtype)
    layer.weight = weight
    layer.bias = conv.bias
    layer.train(conv.training)
    return layer


def convert(model: nn.Module, inplace: bool = False, verbose: bool = True) -> nn.Module:
    """Replaces every convertible nn.Conv2d in model (see `is_convertible`) by a DepthwiseConv2d with
    the same weights, device, dtype, memory format and training mode; every other layer is left
    alone. Returns the model (a deep copy unless inplace); the number replaced is printed when
    verbose and kept as `model.dwconv_converted`. state_dict keys do not change, so a converted
    model's state_dict loads into the stock model and back."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not inplace:
        model = copy.deepcopy(model)
    replaced = 0
    if is_convertible(model):  # the model itself is one depthwise layer
        model, replaced = to_depthwise(model), 1
    else:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if is_convertible(child):
                    setattr(parent, name, to_depthwise(child))
                    replaced += 1
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    model.dwconv_converted = replaced
    if verbose:
        print(f"dwconv.convert: replaced {replaced} depthwise Conv2d layer(s); {convs - replaced} other Conv2d left as is")
    return model
