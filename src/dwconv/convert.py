"""`dwconv.convert`: swap the depthwise nn.Conv2d layers of an existing model for DepthwiseConv2d."""

from __future__ import annotations

import collections
import copy

import torch.nn as nn
from torch.nn.utils.parametrize import type_before_parametrizations

from .modules import DepthwiseConv2d


def is_convertible(module: nn.Module) -> bool:
    """A plain nn.Conv2d (not a subclass, whose forward may differ), parametrized or not
    (torch.nn.utils.parametrize: weight_norm, spectral_norm, ...), with groups == in_channels > 1
    and zero padding: any kernel, stride, padding, dilation, channel multiplier and bias."""
    return (type_before_parametrizations(module) is nn.Conv2d and module.groups == module.in_channels > 1
            and module.out_channels % module.in_channels == 0 and module.padding_mode == "zeros")


def _why_left(module: nn.Conv2d) -> str:
    """Why a depthwise-shaped layer is not convertible, for the user."""
    cls = type_before_parametrizations(module)
    if cls is not nn.Conv2d:
        return f"{cls.__name__}: a subclass of nn.Conv2d, whose forward may differ"
    return f"padding_mode={module.padding_mode!r}"


def _depthwise_class(cls: type) -> type:
    """DepthwiseConv2d for nn.Conv2d; for a parametrized nn.Conv2d (its class is one parametrize
    made for that module, holding the parametrized tensors' properties), the same class over
    DepthwiseConv2d, so that parametrize still finds DepthwiseConv2d beneath it."""
    if cls is nn.Conv2d:
        return DepthwiseConv2d
    members = {name: value for name, value in vars(cls).items() if name not in ("__dict__", "__weakref__")}
    return type(cls.__name__.replace("Conv2d", "DepthwiseConv2d"), (DepthwiseConv2d,), members)


def convert(model: nn.Module, inplace: bool = False, verbose: bool = True, example_inputs=None,
            precompile: bool = True, fuse: bool = False) -> nn.Module:
    """Makes every convertible nn.Conv2d in model (see `is_convertible`) a DepthwiseConv2d; every
    other layer is left alone. Each layer stays the same object, only its class changes: its
    parameters (device, dtype, memory format, requires_grad), buffers, training mode, hooks (the
    older weight_norm and pruning are hooks) and parametrizations stay as they are, and a layer
    used in several places is converted everywhere. The layers are all found before any changes.
    Returns the model (a deep copy unless inplace); the number converted is printed when verbose
    and kept as `model.dwconv_converted`. state_dict keys do not change, so a converted model's
    state_dict loads into the stock model and back.

    Kernels compile ahead of use, in parallel (`dwconv.warmup`): with precompile, at the model's
    first call with each new input signature (`precompile.warm_up_on_first_call`: the whole model's
    depthwise kernels before its first step runs); with example_inputs (a tensor or a tuple of the
    model's arguments, as it will be called), now.

    fuse: each converted layer followed by a BatchNorm2d and/or an activation (ReLU, ReLU6, SiLU,
    GELU, Hardswish, Hardsigmoid; timm's BatchNormAct2d) computes them itself: in eval mode the
    BatchNorm folded into its weight and bias, the activation in the kernel's epilogue; in training
    the BatchNorm and activation on dwconv's BatchNorm kernels (dwconv.fuse). Every other
    BatchNorm2d (after a pointwise convolution, say) computes itself and the activation module
    after it on those kernels in training, and in eval mode is folded into the nn.Conv2d whose
    output it alone takes (where there is one; else it runs as before), and where such a block's
    activation feeds a fused depthwise layer alone (an inverted residual's expansion), that layer
    applies the activation to its input as it loads it. Each squeeze-and-excitation module
    (torchvision's SqueezeExcitation, timm's SqueezeExcite) computes as one op in eager where
    nothing is differentiated, and each inverted-residual block of torchvision's and timm's
    MobileNets and EfficientNets as one program replayed from C++ in eager eval (dwconv.block_replay). A block one of whose modules
    has a hook (or while a global module hook is registered) runs every module as before, so hooks
    see stock's values. Parameters, buffers and state_dict keys stay the same; the blocks fused and
    the layers left are printed when verbose."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not inplace:
        model = copy.deepcopy(model)
    layers = [module for module in model.modules() if is_convertible(module)]  # (each module once)
    classes = [_depthwise_class(type(layer)) for layer in layers]
    for layer, cls in zip(layers, classes):
        layer.__class__ = cls
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    model.dwconv_converted = len(layers)
    if verbose:
        left = collections.Counter(_why_left(m) for m in model.modules()
                                   if isinstance(m, nn.Conv2d) and not isinstance(m, DepthwiseConv2d)
                                   and m.groups == m.in_channels > 1)
        why = "".join(f"; {count} depthwise left as is ({reason})" for reason, count in sorted(left.items()))
        print(f"dwconv.convert: replaced {len(layers)} depthwise Conv2d layer(s){why}; "
              f"{convs - len(layers) - sum(left.values())} other Conv2d left as is")
    if fuse:
        from .fuse import fuse_blocks

        blocks, not_fused, input_activations, squeeze_excites, replayed = fuse_blocks(model)
        if verbose:
            depthwise = [block for block in blocks if isinstance(block[0], DepthwiseConv2d)]
            trained = [block for block in blocks if not isinstance(block[0], DepthwiseConv2d)]
            norms = sum(norm is not None for _, norm, *_ in depthwise)
            activations = sum(activation != "identity" for *_, activation, _ in depthwise)
            why = "".join(f"; {count} not fused ({reason})" for reason, count in sorted(not_fused.items()))
            print(f"dwconv.convert: fused {len(depthwise)} depthwise block(s) ({norms} BatchNorm2d folded in eval "
                  f"mode, on dwconv's kernels in training; {activations} activation(s) fused){why}; "
                  f"{len(trained)} other BatchNorm2d on dwconv's kernels in training "
                  f"({sum(activation != 'identity' for *_, activation, _ in trained)} with their activation, "
                  f"{sum(conv is not None for conv, *_ in trained) - input_activations} folded into their "
                  f"convolution in eager eval, {input_activations} applied with their activation by the depthwise "
                  f"layer after them in eval mode); {squeeze_excites} squeeze-and-excitation block(s) one op each "
                  f"in eager where nothing is differentiated; {replayed} inverted-residual block(s) one replayed program "
                  f"each in eager eval")
    from .precompile import warm_up_on_first_call, warmup

    if precompile and layers:
        warm_up_on_first_call(model)
    if example_inputs is not None:
        inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        warmup(model, *inputs, verbose=verbose)
    return model
