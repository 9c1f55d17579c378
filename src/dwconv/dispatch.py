"""Which kernel family runs, with which blocks, for a geometry and tensor layout: the one place that
decides, for the forward, grad_input, the weight gradient and the fused backward. Each rule says
why in a line; docs/decisions.md gives the measurement behind it, and tuning.py the thresholds.

Families (kernels/): tile (any geometry and layout; channels_last tiles and their backward), rows
(NCHW row sliding, stride_h 1), nchw_pixels (NCHW 3x3 stride 1), pairs (NCHW column stride 2),
large_fma (5x5 up, and 3x3 on narrow planes, on the CUDA cores), toeplitz (10x10 up on the tensor
cores), grad_input (any strided grad_input), grad_weight (the NCHW weight gradient).

Every answer depends on shapes, strides, dtypes and alignment only (the fake tensors torch.compile
traces with get the same answers), and is computed once per layout: launch plans are cached.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._geometry import (INPUT_ACTIVATION_UNIT, INPUT_FUNCTIONS, ConvGeometry, grad_input_as_forward,
                        input_grad_geometry, next_power_of_2)
from .kernels import grad_input as grad_input_family
from .kernels import grad_weight as grad_weight_family
from .kernels import batch_norm, large_fma, nchw_pixels, pairs, rows, tile, toeplitz
from .kernels._launch import ForwardConfig, GradWeightConfig, cached_plan, gpu_plan, layout_key, plan_cache
from .kernels._shared import channels_last_kernel_applies, output_memory_format, ring_size
from .kernels.batch_norm import EvalNorm
from .kernels.weight_sums import weight_grad_sums
from .tuning import tuned


# ---- which family ------------------------------------------------------------------------------

def large_fma_applies(geom: ConvGeometry, x: torch.Tensor, backward: bool = False) -> bool:
    """large_fma for a forward, or with backward for a gradient (grad_input's flipped forward, the
    weight gradient)."""
    taps, t = geom.kernel_h * geom.kernel_w, tuned()
    if taps < t.large_fma_min_taps or x.dtype not in large_fma.DTYPES or geom.dilation_w > 1:
        return False  # (column dilations: the other kernels take them as fast)
    if x.dtype != torch.float32 and taps >= t.large_fma_half_max_taps:
        return False  # half precision from 13x13: the Toeplitz products win
    unit_step = geom.stride_w == 1
    if taps >= t.toeplitz_min_taps:
        return unit_step  # float32 large kernels: FMA chains beat three TF32 products
    if geom.stride_w > t.large_fma_max_stride_w:
        return False
    # below the Toeplitz sizes channels_last keeps its native kernels (large_fma reads an NCHW copy)
    max_width = t.large_fma_small_kernel_max_width
    if not backward and x.dtype != torch.float32 and not (geom.stride_w == 2 and geom.kernel_w <= 3):
        max_width = max(max_width, t.large_fma_half_forward_max_width)  # (the backward keeps its fused pass)
    return not channels_last_kernel_applies(x) and ((unit_step and taps >= t.large_fma_wide_min_taps)
                                                    or geom.in_w <= max_width)


def toeplitz_applies(geom: ConvGeometry, dtype: torch.dtype) -> bool:
    """Large kernels in float32 / float16 / bfloat16 where large_fma does not take them (float64 stays
    on the CUDA-core kernels)."""
    return geom.kernel_h * geom.kernel_w >= tuned().toeplitz_min_taps and dtype != torch.float64


def forward_config(geom: ConvGeometry, x: torch.Tensor, out: Optional[torch.Tensor] = None,
                   backward: bool = False) -> ForwardConfig:
    """The forward's family and blocks (backward: grad_input's flipped forward), first rule that holds."""
    if large_fma_applies(geom, x, backward):  # FMA chains, inputs reused from registers
        block_h, block_w, num_warps, out_vec = large_fma.large_fma_forward_blocks(geom, x)
        return ForwardConfig("large_fma", block_h, block_w, num_warps, out_vec)
    if toeplitz_applies(geom, x.dtype):  # large kernels as band-matrix products on the tensor cores
        block_m = toeplitz.toeplitz_block_m(x)
        return ForwardConfig("toeplitz", block_m, toeplitz.toeplitz_block_w(geom, x),
                             toeplitz.toeplitz_num_warps(toeplitz.toeplitz_out_rows(geom, x), block_m))
    if channels_last_kernel_applies(x, out):  # channel runs along the contiguous axis
        if gpu_plan(x.device) and geom.kernel_h * geom.kernel_w <= tuned().pixel_kernel_taps:
            return tile.nhwc_pixels_blocks(geom, x)  # columns unrolled: each input pixel loaded once
        return tile.nhwc_blocks(geom, x)  # (larger kernels compile too slowly unrolled)
    if nchw_pixels_wins(geom, x, out):  # 3x3 stride 1: one FMA chain an output, no ring
        return nchw_pixels.blocks(geom, x)
    return nchw_config(geom, x)


def nchw_pixels_wins(geom: ConvGeometry, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> bool:
    """Where "nchw_pixels" beats the rows kernel in the forward: 3x3, stride and dilation 1, unit
    column steps; float32, and half precision on rows over 256 wide (its aligned odd-row stores)."""
    half_wide = x.dtype in (torch.float16, torch.bfloat16) and geom.out_w > 256
    return (gpu_plan(x.device) and (x.dtype == torch.float32 or half_wide) and geom.kernel_h == geom.kernel_w == 3
            and geom.stride_h == geom.stride_w == 1 and geom.dilation_h == geom.dilation_w == 1
            and x.stride(3) == 1 and (out is None or out.stride(3) == 1))


def rows_fit(geom: ConvGeometry) -> bool:
    """Where the GPU can run the row-sliding kernel: stride_h 1, a ring of up to 4 register rows, or
    8 of up to 25 taps (k5, or k3 with dilation 2); k7's 8 x 49 weights a phase lose to the tiles."""
    ring_fits = ring_size(geom) <= 4 or (ring_size(geom) <= 8 and geom.kernel_h * geom.kernel_w <= 25)
    return geom.stride_h == 1 and ring_fits and geom.out_w >= 32


def nchw_config(geom: ConvGeometry, x: torch.Tensor) -> ForwardConfig:
    """NCHW (or any strides) outside the rules above."""
    if pairs.applies(geom, x) and geom.kernel_w <= 3:  # column stride 2: split loaded pairs (5x5 lost)
        return pairs.blocks(geom, x)
    if not gpu_plan(x.device):  # the interpreter: the tile kernel in few, wide programs
        return tile.nchw_blocks(geom, x)
    if rows_fit(geom):  # stride_h 1, small ring: each input row loaded once
        return rows.blocks(geom, x)
    return tile.nchw_blocks(geom, x)


def fused_backward_applies(geom: ConvGeometry, x: torch.Tensor) -> bool:
    """Whether grad_input and grad_weight come from one pass over grad_out and x: stride 1,
    multiplier 1; channels_last up to fused_nhwc_taps taps (the unrolled pixels); NCHW with unit
    column steps where the rows kernel takes grad_input's flipped forward (padding within the
    kernel's reach: every grad_out row is visited), except the large kernels (their own two passes).
    The interpreter runs every NCHW case on rows."""
    if channels_last_kernel_applies(x):
        return (geom.stride_h == geom.stride_w == 1 and geom.multiplier == 1
                and geom.kernel_h * geom.kernel_w <= tuned().fused_nhwc_taps)
    if not (geom.stride_h == geom.stride_w == 1 and geom.multiplier == 1 and x.stride(3) == 1) \
            or toeplitz_applies(geom, x.dtype) or large_fma_applies(geom, x, backward=True):
        return False
    gi_geom = input_grad_geometry(geom)
    if min(gi_geom.pad_top, gi_geom.pad_bottom, gi_geom.pad_left, gi_geom.pad_right) < 0:
        return False
    return rows_fit(gi_geom) or not gpu_plan(x.device)


def gradients_read_grad_out_as_nchw(geom: ConvGeometry, x: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """Whether both gradients' kernels read grad_out through an NCHW copy (the large kernels, for the
    weight gradient and grad_input's flipped forward): the backward then makes that copy once."""
    if geom.stride_h != 1 or geom.stride_w != 1 or geom.multiplier != 1:
        return False  # (grad_input's phase kernel reads grad_out as it is)
    if not (toeplitz_applies(geom, x.dtype) or large_fma_applies(geom, x, backward=True)):
        return False
    gi_geom = grad_input_as_forward(geom)  # (not the cached one: traced shapes may be SymInts)
    return toeplitz_applies(gi_geom, grad_out.dtype) or large_fma_applies(gi_geom, grad_out, backward=True)


def fused_backward_config(geom: ConvGeometry, x: torch.Tensor, grad_out: torch.Tensor
                          ) -> Tuple[ForwardConfig, Optional[int]]:
    """The fused pass's family and blocks (and runs, for the channels_last pixel tiles)."""
    if channels_last_kernel_applies(x):
        if nhwc_rows_apply(geom, x):
            return tile.rows_grad_blocks(geom, x), None
        return tile.pixels_grad_blocks(geom, x, True)
    gi_geom = input_grad_geometry(geom)
    if not gpu_plan(grad_out.device):  # the interpreter: one 32 x 32 block a plane
        return ForwardConfig("rows", min(32, next_power_of_2(gi_geom.out_h)),
                             min(32, next_power_of_2(gi_geom.out_w)), 1), None
    if grad_out.stride(3) == 1 and gi_geom.kernel_h == gi_geom.kernel_w == 3 \
            and gi_geom.dilation_h == gi_geom.dilation_w == 1:  # 3x3: half the rows kernel's instructions
        return nchw_pixels.fused_blocks(gi_geom), None
    config = nchw_config(gi_geom, grad_out)  # (a channels_last grad_out too: the rows kernel takes strides)
    if config.vec > 1 and grad_out.element_size() < 4:  # half precision: one 4-vector a thread
        config = ForwardConfig(config.kernel, config.block_h, min(config.block_w, 128), 1, config.vec)
    return config, None


def nhwc_rows_apply(geom: ConvGeometry, x: torch.Tensor) -> bool:
    """The channels_last fused pass slides down rows (else pixel tiles) on 48-64 wide images in whole
    strips of 8, in 32-channel blocks (small layers), dilation 1: there it moves less through L2."""
    return (gpu_plan(x.device) and geom.dilation_h == geom.dilation_w == 1 and geom.in_w % 8 == 0
            and tuned().nhwc_rows_widths[0] <= geom.in_w <= tuned().nhwc_rows_widths[1]
            and tile.pixels_grad_blocks(geom, x, True)[0].block_c == 32)


def grad_weight_pixels_applies(geom: ConvGeometry, x: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """The channels_last weight gradient on the unrolled pixel tiles: on the GPU, kernels the forward
    unrolls too (the per-tile kernel's sums cross threads)."""
    return (gpu_plan(x.device) and channels_last_kernel_applies(x, grad_out)
            and geom.kernel_h * geom.kernel_w <= tuned().pixel_kernel_taps)


# ---- launching ----------------------------------------------------------------------------------

_FORWARD_PLANS = plan_cache()
_FUSED_CONFIGS = plan_cache()


def conv_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geom: ConvGeometry,
                 config: Optional[ForwardConfig] = None, out: Optional[torch.Tensor] = None,
                 activation: int = 0, input_norm: Optional[EvalNorm] = None,
                 output_norm: Optional[EvalNorm] = None) -> torch.Tensor:
    """The forward convolution of checked arguments (out: written into when given), through an
    activation (a code of _geometry.activation_code, applied before the outputs' rounding; with an
    input activation, that of the input too). input_norm: a BatchNorm in eval mode over the input's
    channels (kernels.batch_norm.EvalNorm), applied to the input before its activation; output_norm:
    one over the output's channels, applied before the activation (the tile kernels apply it to
    their sums; for the other families it is folded into the weight and bias, in x's dtype, by a
    launch first). Without output_norm the weight and bias are read in their own dtype."""
    return launch_forward(x, weight, bias, geom, config, out, activation=activation, input_norm=input_norm,
                          output_norm=output_norm)[0]


def launch_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geom: ConvGeometry,
                   config: Optional[ForwardConfig] = None, out: Optional[torch.Tensor] = None,
                   weight_grad_from: Optional[torch.Tensor] = None, flip_weight: bool = False,
                   runs: Optional[int] = None, activation: int = 0, input_norm: Optional[EvalNorm] = None,
                   output_norm: Optional[EvalNorm] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """conv_forward, and the NCHW fused backward: with weight_grad_from (the forward's input; rows or
    "nchw_pixels", stride 1, multiplier 1) this call is grad_input (x = grad_out, weight flipped) and
    also returns partial[program, tap], the weight gradient's partial sums in the weight's tap order.
    flip_weight: convolve with weight.flip(2, 3) (the kernels read the taps in reverse). activation:
    conv_forward's: the tile family applies an input activation (and input_norm) as it loads the
    input, the others read PyTorch's activation of it."""
    input_activation, activation = divmod(activation, INPUT_ACTIVATION_UNIT)
    normalized = input_activation or input_norm is not None or output_norm is not None
    if normalized and not _takes_input_activation(geom, x, config, flip_weight):
        x = _normalized(x, input_norm) if input_norm is not None else x
        x = INPUT_FUNCTIONS[input_activation](x) if input_activation else x
        if output_norm is not None:
            weight, bias = batch_norm.fold(weight.contiguous(), bias, *output_norm, x.dtype)
        input_activation, input_norm, output_norm = 0, None, None
    if out is None:
        out = torch.empty(geom.output_shape, device=x.device, dtype=x.dtype, memory_format=output_memory_format(x))
    if out.numel() == 0:
        return out, None
    fused = weight_grad_from is not None
    if config is None and not fused:  # (the large kernels choose their blocks in their own cached plans)
        if large_fma_applies(geom, x, backward=flip_weight):
            return large_fma.large_fma_forward(x, weight, bias, geom, out, flip_weight, activation=activation), None
        if toeplitz_applies(geom, x.dtype):
            return toeplitz.toeplitz_forward(x, weight, bias, geom, out, flip_weight=flip_weight,
                                             activation=activation), None
    if config is not None and config.kernel == "toeplitz":
        return toeplitz.toeplitz_forward(x, weight, bias, geom, out, config.block_h, config.block_w,
                                         config.num_warps, flip_weight=flip_weight, activation=activation), None
    if config is not None and config.kernel == "large_fma":
        return large_fma.large_fma_forward(x, weight, bias, geom, out, flip_weight,
                                           (config.block_h, config.block_w, config.num_warps, config.vec),
                                           activation), None
    key = (geom, config, layout_key(x), layout_key(out), bias is not None,
           layout_key(weight_grad_from) if fused else None, flip_weight, runs, activation, input_activation)
    norm_keys = tuple(None if norm is None else (norm.weight is not None, norm.eps)
                      for norm in (input_norm, output_norm))
    plan = cached_plan(_FORWARD_PLANS, key + norm_keys,
                       lambda: _forward_plan(geom, config, x, out, bias is not None, weight_grad_from, flip_weight,
                                             runs, activation, input_activation, *norm_keys))
    if plan.kernel == "nchw_pixels":
        return out, nchw_pixels.launch_nchw_pixels(plan, x, weight, bias, out, weight_grad_from)
    if plan.kernel == "rows":
        return out, rows.launch_rows(plan, x, weight, bias, out, weight_grad_from)
    if plan.kernel == "pairs":
        pairs.launch_pairs(plan, x, weight, bias, out)
    else:
        tile.forward(plan, geom, x, weight, bias, out, input_norm, output_norm)
    return out, None


def _forward_plan(geom: ConvGeometry, config: Optional[ForwardConfig], x: torch.Tensor, out: torch.Tensor,
                  has_bias: bool, features: Optional[torch.Tensor], flip_weight: bool = False,
                  runs: Optional[int] = None, activation: int = 0, input_activation: int = 0,
                  input_norm: Optional[Tuple[bool, float]] = None, output_norm: Optional[Tuple[bool, float]] = None):
    if config is None:
        config = forward_config(geom, x, out, backward=flip_weight)
    assert not (input_activation or input_norm or output_norm) or config.kernel in tile.TILE_KERNELS, \
        "only the tile kernels normalise and activate their input, or normalise their sums"
    if config.kernel == "nchw_pixels":
        return nchw_pixels.plan(geom, config, x, out, has_bias, features, flip_weight, runs, activation)
    if config.kernel == "rows":
        return rows.plan(geom, config, x, out, has_bias, features, flip_weight, activation)
    assert features is None, "the NCHW fused backward runs on the rows or nchw_pixels kernel"
    if config.kernel == "pairs":
        return pairs.plan(geom, config, x, out, has_bias, flip_weight, activation)
    return tile.forward_plan(geom, config, x, out, has_bias, flip_weight, activation, input_activation, input_norm,
                             output_norm)


def _takes_input_activation(geom: ConvGeometry, x: torch.Tensor, config: Optional[ForwardConfig],
                            flip_weight: bool) -> bool:
    """Whether the forward's family applies an input activation as it loads, and BatchNorms to its
    input and sums (the tile kernels)."""
    if config is None:
        config = cached_plan(_INPUT_ACTIVATED_CONFIGS, (geom, layout_key(x), flip_weight),
                             lambda: forward_config(geom, x, backward=flip_weight))
    return config.kernel in tile.TILE_KERNELS


_INPUT_ACTIVATED_CONFIGS = plan_cache()


def _normalized(x: torch.Tensor, input_norm: EvalNorm) -> torch.Tensor:
    """x * scale + shift per channel (input_norm: conv_forward's, its scale and shift by one launch,
    batch_norm.scale_shift), computed in their dtype and rounded to x's once, as the tile kernels
    compute it before their input activation (the other families read this)."""
    scale_shift = batch_norm.scale_shift(*input_norm)
    # (two selects, not an unbind: the C++ replayer's programs take ops of one result)
    scale, shift = scale_shift[0].view(1, -1, 1, 1), scale_shift[1].view(1, -1, 1, 1)
    return torch.addcmul(shift, x.to(scale_shift.dtype), scale).to(x.dtype)


def conv_grad_input(grad_out: torch.Tensor, weight: torch.Tensor, geom: ConvGeometry, input_like: torch.Tensor,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """grad of the input: same shape, dtype and memory format as the input (written into out if given)."""
    dx = out
    if dx is None:
        dx = torch.empty((geom.batch, geom.in_channels, geom.in_h, geom.in_w), device=grad_out.device,
                         dtype=input_like.dtype, memory_format=output_memory_format(input_like))
    if dx.numel() == 0:
        return dx
    if grad_out.numel() == 0:
        return dx.zero_()
    if geom.stride_h == 1 and geom.stride_w == 1 and geom.multiplier == 1:  # a forward of grad_out, flipped
        return launch_forward(grad_out, weight, None, input_grad_geometry(geom), out=dx, flip_weight=True)[0]
    return grad_input_family.grad_input(geom, grad_out, weight, dx)  # strided: a gather by phase


def conv_grad_weight(grad_out: torch.Tensor, x: torch.Tensor, geom: ConvGeometry, weight_dtype: torch.dtype,
                     bias_grad: bool, config=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """grad of the weight (C*m, 1, kH, kW) and, when bias_grad, of the bias (C*m,). config: a
    GradWeightConfig, or for channels_last tensors an "nhwc_pixels" ForwardConfig (the pixel tiles)."""
    bias_grad = bool(bias_grad)
    if grad_out.numel() == 0:
        grad_w = torch.zeros((geom.out_channels, 1, geom.kernel_h, geom.kernel_w), device=x.device, dtype=weight_dtype)
        return grad_w, (torch.zeros(geom.out_channels, device=x.device, dtype=weight_dtype) if bias_grad else None)
    if config is None and large_fma_applies(geom, x, backward=True):
        return large_fma.large_fma_grad_weight(grad_out, x, geom, weight_dtype, bias_grad)
    if config is None and toeplitz_applies(geom, x.dtype):
        return toeplitz.toeplitz_grad_weight(grad_out, x, geom, weight_dtype, bias_grad)
    if isinstance(config, ForwardConfig) or (config is None and grad_weight_pixels_applies(geom, x, grad_out)):
        return tile.grad_weight_pixels(geom, grad_out, x, config, bias_grad, weight_dtype)
    if channels_last_kernel_applies(x, grad_out):
        return tile.grad_weight(geom, grad_out, x, config, bias_grad, weight_dtype)
    return grad_weight_family.grad_weight(geom, grad_out, x, config, bias_grad, weight_dtype)


def conv_grad_input_and_weight(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geom: ConvGeometry,
                               config: Optional[ForwardConfig] = None, runs: Optional[int] = None
                               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fused backward (where fused_backward_applies): grad_input and grad_weight from one read of
    grad_out and x, the weight gradient's partial sums added per channel in a fixed order. runs: the
    pixel tiles' programs a column of tiles (channels_last and "nchw_pixels")."""
    if x.numel() == 0 or grad_out.numel() == 0:  # nothing to launch: the separate paths give the zeros
        return conv_grad_input(grad_out, weight, geom, x), conv_grad_weight(grad_out, x, geom, weight.dtype, False)[0]
    if config is None:  # once per layout, like the launch plans: this is on every eager backward
        config, default_runs = cached_plan(_FUSED_CONFIGS, (geom, layout_key(x), layout_key(grad_out)),
                                           lambda: fused_backward_config(geom, x, grad_out))
        runs = runs or default_runs
    if channels_last_kernel_applies(x):
        return tile.grad_input_and_weight(geom, grad_out, x, weight, config, runs)
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype, memory_format=output_memory_format(x))
    dx, partial = launch_forward(grad_out, weight, None, input_grad_geometry(geom), config, out=dx,
                                 weight_grad_from=x, flip_weight=True, runs=runs)
    # partial[(image, channel, program of the plane), tap]
    programs = partial.shape[0] // (geom.batch * geom.out_channels)
    row = partial.stride(0)
    grad_w, _ = weight_grad_sums(partial, geom, weight.dtype, False, programs * row, (programs, row),
                                 (geom.batch, geom.out_channels * programs * row))
    return dx, grad_w


def batch_norm_grad_in_convolution_applies(geom: ConvGeometry, x: torch.Tensor) -> bool:
    """Whether the convolution's backward computes the gradient of a BatchNorm after it as it loads
    grad_out (tile.NormGrad): where the channels_last fused pass slides down rows."""
    return channels_last_kernel_applies(x) and fused_backward_applies(geom, x) and nhwc_rows_apply(geom, x)


def conv_grad_through_batch_norm(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geom: ConvGeometry,
                                 norm: tile.NormGrad, eps: float, config: Optional[ForwardConfig] = None
                                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """grad_input and grad_weight of a convolution followed by a BatchNorm in training (and its
    activation): grad the gradient of the BatchNorm's (activation's) output, norm its tensors with
    the totals of kernels.batch_norm.batch_norm_grad_sums. Where
    batch_norm_grad_in_convolution_applies (or config is the rows pass's), grad_y is computed in the
    convolution's backward as it loads it, never written; else BatchNorm's grad_input pass writes it
    and the convolution's backward reads it."""
    from .kernels.batch_norm import batch_norm_grad_input

    if config is None and batch_norm_grad_in_convolution_applies(geom, x):
        config = tile.rows_grad_blocks(geom, x)
    if config is not None and config.kernel == "nhwc_rows":
        return tile.grad_input_and_weight(geom, grad, x, weight, config, None, norm)
    grad_y = batch_norm_grad_input(grad, norm.y, norm.weight, norm.bias, norm.mean, norm.invstd, norm.totals, eps,
                                   norm.activation)
    if fused_backward_applies(geom, x):
        return conv_grad_input_and_weight(grad_y, x, weight, geom, config)
    return conv_grad_input(grad_y, weight, geom, x), conv_grad_weight(grad_y, x, geom, weight.dtype, False)[0]


# ---- what the batch size decides (a warmup's markers shared by batch sizes) ----------------------

def batch_choices(input_shape: tuple, dtype: torch.dtype, weight_shape: tuple) -> tuple:
    """What a layer's kernel binaries follow of the batch size, for layers of these shapes: the
    channels_last tiles' size thresholds, and for the Toeplitz products the batch itself (their
    small-batch blocks, and counts whose divisibility their loops' masks rest on). Every other count
    that follows the batch is a runtime argument Triton does not specialise."""
    t = tuned()
    size = math.prod(input_shape) * dtype.itemsize
    choices = (size >= t.nhwc_taps_major_min_bytes, size < t.small_fused_bytes, size <= t.short_pixel_tile_max_bytes)
    if weight_shape[2] * weight_shape[3] >= t.toeplitz_min_taps and dtype != torch.float64:
        choices += (input_shape[0],)
    return choices


__all__ = ["ForwardConfig", "GradWeightConfig", "batch_choices", "batch_norm_grad_in_convolution_applies",
           "conv_forward", "conv_grad_input", "conv_grad_input_and_weight", "conv_grad_through_batch_norm",
           "conv_grad_weight", "forward_config", "fused_backward_applies", "gradients_read_grad_out_as_nchw",
           "launch_forward"]
