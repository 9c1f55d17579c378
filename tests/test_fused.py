"""The fused depthwise block: activations in the forward kernels' epilogue, against F.conv2d and
PyTorch's activation in float64."""

import pytest
import torch

from dwconv._geometry import conv_geometry
from dwconv.activations import FUNCTIONS, activation_code
from dwconv.dispatch import ForwardConfig, conv_forward
from dwconv.kernels import large_fma
from dwconv.kernels._shared import output_memory_format
from helpers import assert_close, poisoned, randn, reference_conv

ACTIVATIONS = sorted(FUNCTIONS)

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


def activated_forward(family, activation, dtype, has_bias=True):
    config, layout, kernel, stride, padding = FAMILIES[family]
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
    out = conv_forward(x, weight, bias, geom, config=config, out=out, activation=activation_code(activation))
    return out, FUNCTIONS[activation](reference_conv(x, weight, bias, stride, padding, 1))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_applies_every_activation(family, activation):
    out, ref = activated_forward(family, activation, torch.float32)
    assert_close(out, ref, torch.float32, f"{family} {activation}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_half_precision_activates_before_rounding(activation):
    """bfloat16: one rounding, after the activation (the channels_last pixel tiles, bfloat16 pairs)."""
    out, ref = activated_forward("nhwc_pixels", activation, torch.bfloat16)
    assert_close(out, ref, torch.bfloat16, activation)


@pytest.mark.parametrize("family", ["tile", "rows", "nhwc"])
def test_float64_activations(family):
    for activation in ("silu", "gelu", "gelu_tanh"):  # (exp and erf in float64)
        out, ref = activated_forward(family, activation, torch.float64, has_bias=False)
        assert_close(out, ref, torch.float64, f"{family} {activation}")
