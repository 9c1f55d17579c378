"""Argument checking and shape arithmetic for depthwise convolutions, in one place.

Every entry point (functional, module, benchmark) goes through `conv_geometry`, which
validates the arguments with PyTorch's rules and returns a `ConvGeometry` holding the
numbers the kernels need. Errors name the argument that is wrong.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

IntOrPair = Union[int, Sequence[int]]
Padding = Union[int, Sequence[int], str]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# The activations a forward's epilogue can apply (its ACTIVATION constexpr): name -> code.
ACTIVATION_CODES = {"identity": 0, "relu": 1, "relu6": 2, "silu": 3, "gelu": 4, "gelu_tanh": 5, "hardswish": 6,
                    "hardsigmoid": 7}


# PyTorch's function of each (the reference, what computes them where a gradient is wanted, and the
# input activation of the families that do not apply one as they load)
ACTIVATION_FUNCTIONS = {
    "identity": lambda t: t,
    "relu": F.relu,
    "relu6": F.relu6,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
}
assert ACTIVATION_FUNCTIONS.keys() == ACTIVATION_CODES.keys()
# The activations a forward can also apply to its input's values as they load (the layer before's,
# fused into this one): those that map 0 to 0, so that the zeros of the padding stay zeros.
INPUT_ACTIVATIONS = ("identity", "relu", "relu6", "silu", "gelu", "gelu_tanh", "hardswish")
# a forward's code: the output's activation + INPUT_ACTIVATION_UNIT * the input's
INPUT_ACTIVATION_UNIT = 16
_INPUT_CODES = frozenset(ACTIVATION_CODES[name] for name in INPUT_ACTIVATIONS)
# code -> PyTorch's function, of the input activations
INPUT_FUNCTIONS = {ACTIVATION_CODES[name]: ACTIVATION_FUNCTIONS[name] for name in INPUT_ACTIVATIONS}


def activation_code(name: Optional[str]) -> int:
    """The kernels' code of an activation name (None: identity); a clear error for any other value."""
    if name is None:
        return 0
    if not isinstance(name, str) or name not in ACTIVATION_CODES:
        raise ValueError(f"activation must be one of {sorted(ACTIVATION_CODES)} or None, got {name!r}")
    return ACTIVATION_CODES[name]


def forward_activation_code(activation) -> int:
    """A forward's code: activation_code of a name, or of a pair (the input's activation, one of
    INPUT_ACTIVATIONS; the output's: a fused block's, dwconv.fuse); a clear error for any other value."""
    if isinstance(activation, tuple):
        if len(activation) != 2 or activation[0] not in INPUT_ACTIVATIONS:
            raise ValueError(f"an input activation must be one of {INPUT_ACTIVATIONS} (each maps 0 to 0), "
                             f"in a pair with the output's, got {activation!r}")
        return ACTIVATION_CODES[activation[0]] * INPUT_ACTIVATION_UNIT + activation_code(activation[1])
    return activation_code(activation)


def split_activation_code(code: int) -> Tuple[int, int]:
    """(the input's activation code, the output's) of a forward's code (activation_code); a clear
    error for a code that is none."""
    input_code, output_code = divmod(code, INPUT_ACTIVATION_UNIT) if isinstance(code, int) else (-1, -1)
    if output_code not in ACTIVATION_CODES.values() or input_code not in _INPUT_CODES:
        raise ValueError(f"activation must be a code of {ACTIVATION_CODES}, plus {INPUT_ACTIVATION_UNIT} times "
                         f"that of an input activation of {INPUT_ACTIVATIONS}, got {code!r}")
    return input_code, output_code


# Host-side integer helpers. triton.cdiv / triton.next_power_of_2 are jit functions: calling them
# from Python costs ~9 us each, more than the rest of a launcher's arithmetic.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    n = int(n)  # (a SymInt while torch.compile traces the backward formula)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class ConvGeometry:
    """Sizes of one depthwise convolution. Padding is explicit per side (top, bottom, left, right)."""

    batch: int
    in_channels: int
    multiplier: int  # output channels per input channel
    in_h: int
    in_w: int
    kernel_h: int
    kernel_w: int
    stride_h: int
    stride_w: int
    pad_top: int
    pad_bottom: int
    pad_left: int
    pad_right: int
    dilation_h: int
    dilation_w: int
    out_h: int
    out_w: int

    @property
    def out_channels(self) -> int:
        return self.in_channels * self.multiplier

    @property
    def output_shape(self) -> Tuple[int, int, int, int]:
        return (self.batch, self.out_channels, self.out_h, self.out_w)

    @property
    def symmetric_padding(self) -> Optional[Tuple[int, int]]:
        """(pad_h, pad_w) when both sides agree, as F.conv2d takes it; else None."""
        if self.pad_top == self.pad_bottom and self.pad_left == self.pad_right:
            return (self.pad_top, self.pad_left)
        return None

    def has_interior_tile(self, block_h: int, block_w: int, block_c: int = 1) -> bool:
        """Whether some tile of block_h x block_w outputs by block_c channels, tiles starting at
        multiples of the block, reads its whole window inside the input (the kernels' unmasked
        branch). The first tile past the top (left) padding is the one to test: later ones end lower."""
        def fits(outputs, inputs, block, stride, pad, kernel, dilation):
            first = block * cdiv(cdiv(pad, stride), block)
            return first + block <= outputs and (first + block - 1) * stride - pad + (kernel - 1) * dilation < inputs
        return (block_c <= self.out_channels
                and fits(self.out_h, self.in_h, block_h, self.stride_h, self.pad_top, self.kernel_h, self.dilation_h)
                and fits(self.out_w, self.in_w, block_w, self.stride_w, self.pad_left, self.kernel_w, self.dilation_w))


def _pair(value: IntOrPair, name: str) -> Tuple[int, int]:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, (tuple, list, torch.Size)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return (int(value[0]), int(value[1]))
    raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")


def _resolve_padding(
    padding: Padding, kernel: Tuple[int, int], stride: Tuple[int, int], dilation: Tuple[int, int]
) -> Tuple[int, int, int, int]:
    """Returns (top, bottom, left, right) with PyTorch's rules for 'valid' and 'same'."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding == "same":
            if stride != (1, 1):
                raise ValueError(
                    f"padding='same' is not supported for strided convolutions (stride={stride}), as in PyTorch"
                )
            # PyTorch puts the odd pixel of an even total on the bottom/right.
            total_h = dilation[0] * (kernel[0] - 1)
            total_w = dilation[1] * (kernel[1] - 1)
            return (total_h // 2, total_h - total_h // 2, total_w // 2, total_w - total_w // 2)
        raise ValueError(f"padding must be 'valid', 'same', an int or a pair of ints, got {padding!r}")
    pad_h, pad_w = _pair(padding, "padding")
    if pad_h < 0 or pad_w < 0:
        raise ValueError(f"padding must be non-negative, got {padding!r}")
    return (pad_h, pad_h, pad_w, pad_w)


def op_arguments(kernel: Tuple[int, int], stride: IntOrPair, padding: Padding, dilation: IntOrPair
                 ) -> Tuple[List[int], List[int], List[int]]:
    """stride, padding [top, bottom, left, right] and dilation as the registered ops take them, from a
    layer's own (no input needed: 'same' resolves from the kernel and dilation alone)."""
    stride_hw, dilation_hw = _pair(stride, "stride"), _pair(dilation, "dilation")
    return list(stride_hw), list(_resolve_padding(padding, tuple(kernel), stride_hw, dilation_hw)), list(dilation_hw)


def conv_geometry(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: IntOrPair = 1,
    padding: Padding = 0,
    dilation: IntOrPair = 1,
    sides: Optional[Sequence[int]] = None,
    any_parameter_dtype: bool = False,
) -> ConvGeometry:
    """Checks a depthwise conv2d call (groups == input channels) and returns its geometry.
    sides: explicit (top, bottom, left, right) padding in place of `padding` (the registered ops
    take padding resolved this way, since 'same' may be asymmetric). any_parameter_dtype: weight and
    bias may be of any floating dtype (a fused block's op, whose kernels read them as they are)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor; dwconv does not take layout {t.layout}")
    if input.dim() != 4:
        raise ValueError(f"input must be 4-D (N, C, H, W), got shape {tuple(input.shape)}")
    if weight.dim() != 4:
        raise ValueError(f"weight must be 4-D (C*multiplier, 1, kH, kW), got shape {tuple(weight.shape)}")
    batch, channels, in_h, in_w = input.shape
    out_channels, weight_in, kernel_h, kernel_w = weight.shape
    if channels < 1:
        raise ValueError(f"input must have at least one channel, got shape {tuple(input.shape)}")
    if in_h == 0 or in_w == 0:
        raise ValueError(
            f"input has an empty spatial size {tuple(input.shape)}; as in PyTorch only the batch may be empty"
        )
    if weight_in != 1:
        raise ValueError(
            f"weight.shape[1] must be 1 for a depthwise convolution, got weight shape {tuple(weight.shape)}"
        )
    if out_channels < 1 or out_channels % channels != 0:
        raise ValueError(
            f"weight.shape[0] ({out_channels}) must be a positive multiple of the input's channels ({channels})"
        )
    if kernel_h < 1 or kernel_w < 1:
        raise ValueError(f"weight must have a kernel of at least 1x1, got weight shape {tuple(weight.shape)}")

    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"input dtype must be float32, float16, bfloat16 or float64, got {input.dtype}")
    if weight.dtype != input.dtype and not (any_parameter_dtype and weight.is_floating_point()):
        raise TypeError(f"weight dtype ({weight.dtype}) must match input dtype ({input.dtype})")
    if weight.device != input.device:
        raise ValueError(f"weight is on {weight.device} but input is on {input.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dtype != input.dtype and not (any_parameter_dtype and bias.is_floating_point()):
            raise TypeError(f"bias dtype ({bias.dtype}) must match input dtype ({input.dtype})")
        if bias.device != input.device:
            raise ValueError(f"bias is on {bias.device} but input is on {input.device}")
        if tuple(bias.shape) != (out_channels,):
            raise ValueError(f"bias must have shape ({out_channels},), got {tuple(bias.shape)}")

    stride_hw = _pair(stride, "stride")
    dilation_hw = _pair(dilation, "dilation")
    if min(stride_hw) < 1:
        raise ValueError(f"stride must be >= 1, got {stride!r}")
    if min(dilation_hw) < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation!r}")
    kernel = (kernel_h, kernel_w)
    if sides is None:
        top, bottom, left, right = _resolve_padding(padding, kernel, stride_hw, dilation_hw)
    else:
        top, bottom, left, right = (int(v) for v in sides)
        if min(top, bottom, left, right) < 0:
            raise ValueError(f"padding must be non-negative, got {tuple(sides)}")

    span_h = dilation_hw[0] * (kernel_h - 1) + 1
    span_w = dilation_hw[1] * (kernel_w - 1) + 1
    padded_h = in_h + top + bottom
    padded_w = in_w + left + right
    if span_h > padded_h or span_w > padded_w:
        raise ValueError(
            f"kernel (dilated extent {span_h}x{span_w}) is larger than the padded input "
            f"({padded_h}x{padded_w}); check weight's kernel size, dilation and padding"
        )
    return ConvGeometry(
        batch=batch,
        in_channels=channels,
        multiplier=out_channels // channels,
        in_h=in_h,
        in_w=in_w,
        kernel_h=kernel_h,
        kernel_w=kernel_w,
        stride_h=stride_hw[0],
        stride_w=stride_hw[1],
        pad_top=top,
        pad_bottom=bottom,
        pad_left=left,
        pad_right=right,
        dilation_h=dilation_hw[0],
        dilation_w=dilation_hw[1],
        out_h=(padded_h - span_h) // stride_hw[0] + 1,
        out_w=(padded_w - span_w) // stride_hw[1] + 1,
    )


def grad_input_as_forward(geom: ConvGeometry) -> ConvGeometry:
    """For stride 1 and multiplier 1: grad_input is a forward convolution of grad_out (out_h x out_w)
    with the flipped weight, padded by (K-1)*dilation - pad before (negative: cropped), giving
    in_h x in_w. This is its geometry (not cached: traced shapes may be SymInts, unhashable)."""
    assert geom.stride_h == 1 and geom.stride_w == 1 and geom.multiplier == 1
    pad_top = (geom.kernel_h - 1) * geom.dilation_h - geom.pad_top
    pad_left = (geom.kernel_w - 1) * geom.dilation_w - geom.pad_left
    return dataclasses.replace(
        geom, in_h=geom.out_h, in_w=geom.out_w, out_h=geom.in_h, out_w=geom.in_w,
        pad_top=pad_top, pad_left=pad_left,
        pad_bottom=geom.in_h - geom.out_h - pad_top + (geom.kernel_h - 1) * geom.dilation_h,
        pad_right=geom.in_w - geom.out_w - pad_left + (geom.kernel_w - 1) * geom.dilation_w,
    )


_cached_grad_input_geometry = functools.lru_cache(maxsize=1024)(grad_input_as_forward)


def input_grad_geometry(geom: ConvGeometry) -> ConvGeometry:
    """grad_input_as_forward, cached (dataclasses.replace costs ~6 us, on every eager backward); a
    geometry of symbolic sizes (traced with a dynamic batch), which does not hash, is built each time."""
    try:
        return _cached_grad_input_geometry(geom)
    except TypeError:
        return grad_input_as_forward(geom)
