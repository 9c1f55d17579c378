"""BatchNorm2d in training mode with the activation after it, for the fused depthwise block in
training: the batch's statistics, the normalisation and the activation in two passes over the
convolution's output (stock: BatchNorm's two or three and the activation's two), and the backward's
activation and BatchNorm gradients in two (stock: the activation's three, BatchNorm's five).

Forward:  statistics_kernel      per program, (mean, M2) of its chunk of each channel (sums of
                                 the values less a shift near their mean: no cancellation)
          statistics_sums_kernel the chunks combined in a fixed order (deterministic): mean,
                                 1 / sqrt(var + eps), the running statistics updated as
                                 nn.BatchNorm2d updates them (unbiased variance)
          normalize_kernel       out = act(y * scale + shift), scale = gamma / sqrt(var + eps)
Backward: gradient_sums_kernel   per program, sums of g = grad * act'(z) and of g * xhat
          gradient_totals_kernel the chunks added in a fixed order: grad_weight, grad_bias
          grad_input_kernel      grad_y = scale * (g - mean(g) - xhat * mean(g * xhat))
Eval:     fold_kernel            a convolution's weight and bias with the BatchNorm after it folded
                                 in (running statistics), in the dtype the convolution computes in:
                                 at every call, so that no change of a parameter or statistic, seen
                                 by autograd's version counters or not (`.data`), is missed

z = y * scale + shift is recomputed from y (the only activation saved, with the statistics), in
the same arithmetic as the forward's. Each tensor is read as [outer, channels, inner]: NCHW
(outer = N, inner = H*W, unit steps along inner) or channels_last (outer = 1, inner = N*H*W, unit
steps along channels); a program takes `chunk` inner positions of BLOCK_C channels, a tile of
BLOCK_S x BLOCK_C at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .._geometry import cdiv, next_power_of_2
from ..tuning import tuned
from ._launch import LaunchPlan, cached_plan, gpu_plan, launch, layout_key, plan_cache
from ._shared import _activate, _activation_slope

# (the chunk and the counts change with the batch and image size: runtime values, never
# specialised, so one binary serves every batch and image size of a layer; the sizes and strides the
# offsets are made of are specialised, as Triton does by default (a multiple of 16 or not: at most
# two binaries), so that the tiles' loads and stores are vectors: unspecialised, every one was a
# 2-byte load in bfloat16 on sm_90)
_RUNTIME = ["chunk", "chunks"]


@triton.jit
def _this_program(channels, chunk, chunks, inner, outer_stride, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's part (its row of partial sums), channels, first inner position, end, and the
    offset of its image. The channel blocks of a part are neighbours in the launch order: in
    channels_last they share rows, which the GPU then fetches once for all of them."""
    channel_blocks = tl.cdiv(channels, BLOCK_C)
    part = tl.program_id(0) // channel_blocks
    chunk = chunk // BLOCK_S * BLOCK_S  # (it is a whole number of tiles: the compiler then knows so)
    start = (part % chunks) * chunk
    stop = tl.minimum(start + chunk, inner)
    c = tl.program_id(0) % channel_blocks * BLOCK_C + tl.arange(0, BLOCK_C)
    return part, c, start, stop, (part // chunks).to(tl.int64) * outer_stride


@triton.jit
def _tile(base, s, stop, c, channels, inner_stride, channel_stride):
    """A [BLOCK_S, BLOCK_C] tile's offsets and mask (every tensor of a launch has the same strides)."""
    mask = (s < stop)[:, None] & (c < channels)[None, :]
    return base + s[:, None].to(tl.int64) * inner_stride + c[None, :].to(tl.int64) * channel_stride, mask


@triton.jit
def _scale_shift(c, channels, mean_ptr, invstd_ptr, weight_ptr, bias_ptr, AFFINE: tl.constexpr):
    """Per channel: mean, invstd, and the normalisation as one multiply-add, z = y * scale + shift
    (the forward and the backward compute z alike)."""
    c_ok = c < channels
    mean = tl.load(mean_ptr + c, mask=c_ok, other=0.0)
    invstd = tl.load(invstd_ptr + c, mask=c_ok, other=0.0)
    scale = invstd
    shift = -mean * invstd
    if AFFINE:
        weight = tl.load(weight_ptr + c, mask=c_ok, other=0.0).to(mean.dtype)
        scale = invstd * weight
        shift = tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(mean.dtype) - mean * scale
    return mean, invstd, scale, shift


@triton.jit(do_not_specialize=_RUNTIME)
def statistics_kernel(y_ptr, partial_ptr, channels, inner, chunk, chunks, outer_stride, inner_stride, channel_stride,
                      BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    part, c, start, stop, base = _this_program(channels, chunk, chunks, inner, outer_stride, BLOCK_S, BLOCK_C)
    acc: tl.constexpr = partial_ptr.dtype.element_ty
    # Sums of y - shift and of its square, each thread its own lanes (one reduction at the end); the
    # shift, the first tile's mean, keeps M2 = sum(d^2) - sum(d)^2 / n from cancelling.
    s = start + tl.arange(0, BLOCK_S)
    offsets, mask = _tile(base, s, stop, c, channels, inner_stride, channel_stride)
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(acc)
    shift = tl.sum(y, axis=0) / tl.minimum(stop - start, BLOCK_S).to(acc)
    d = tl.where(mask, y - shift[None, :], 0.0)
    sums, squares = d, d * d
    for first in range(start + BLOCK_S, stop, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        offsets, mask = _tile(base, s, stop, c, channels, inner_stride, channel_stride)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(acc)
        d = tl.where(mask, y - shift[None, :], 0.0)
        sums += d
        squares += d * d
    count = (stop - start).to(acc)
    total = tl.sum(sums, axis=0)
    c_ok = c < channels
    tl.store(partial_ptr + part * 2 * channels + c, shift + total / count, mask=c_ok)
    tl.store(partial_ptr + (part * 2 + 1) * channels + c, tl.sum(squares, axis=0) - total * total / count, mask=c_ok)


@triton.jit(do_not_specialize=_RUNTIME[:3] + ["parts", "momentum", "eps"])
def statistics_sums_kernel(partial_ptr, mean_ptr, invstd_ptr, running_mean_ptr, running_var_ptr,
                           channels, inner, chunk, chunks, parts, momentum: tl.float64, eps: tl.float64,
                           UPDATE_RUNNING: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    acc: tl.constexpr = partial_ptr.dtype.element_ty
    momentum = tl.full([], momentum, acc)
    eps = tl.full([], eps, acc)
    count = tl.zeros([], dtype=acc)
    mean = tl.zeros([BLOCK_C], dtype=acc)
    m2 = tl.zeros([BLOCK_C], dtype=acc)
    for first in range(0, parts, BLOCK_P):
        p = first + tl.arange(0, BLOCK_P)
        p_ok = p < parts
        start = (p % chunks) * chunk
        part_count = tl.where(p_ok, tl.minimum(inner - start, chunk), 0).to(acc)
        mask = p_ok[:, None] & c_ok[None, :]
        offsets = (p * 2 * channels)[:, None] + c[None, :]
        part_mean = tl.load(partial_ptr + offsets, mask=mask, other=0.0)
        part_m2 = tl.load(partial_ptr + offsets + channels, mask=mask, other=0.0)
        # (BLOCK_P parts at once: their mean, and M2 about it, exactly; then Chan's update)
        tile_count = tl.sum(part_count, axis=0)
        tile_mean = tl.sum(part_count[:, None] * part_mean, axis=0) / tile_count
        spread = part_mean - tile_mean[None, :]
        tile_m2 = tl.sum(part_m2 + part_count[:, None] * spread * spread, axis=0)
        total = count + tile_count
        delta = tile_mean - mean
        mean += delta * (tile_count / total)
        m2 += tile_m2 + delta * delta * (count * tile_count / total)
        count = total
    if acc == tl.float64:
        invstd = 1.0 / tl.sqrt(m2 / count + eps)  # (float64's are correctly rounded)
    else:
        invstd = tl.math.div_rn(1.0, tl.sqrt_rn(m2 / count + eps))
    tl.store(mean_ptr + c, mean, mask=c_ok)
    tl.store(invstd_ptr + c, invstd, mask=c_ok)
    if UPDATE_RUNNING:
        running_mean = tl.load(running_mean_ptr + c, mask=c_ok).to(acc)
        running_var = tl.load(running_var_ptr + c, mask=c_ok).to(acc)
        running_mean = momentum * mean + (1.0 - momentum) * running_mean
        running_var = momentum * (m2 / (count - 1.0)) + (1.0 - momentum) * running_var
        tl.store(running_mean_ptr + c, running_mean.to(running_mean_ptr.dtype.element_ty), mask=c_ok)
        tl.store(running_var_ptr + c, running_var.to(running_var_ptr.dtype.element_ty), mask=c_ok)


@triton.jit(do_not_specialize=_RUNTIME)
def normalize_kernel(y_ptr, out_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                     channels, inner, chunk, chunks, outer_stride, inner_stride, channel_stride,
                     AFFINE: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    part, c, start, stop, base = _this_program(channels, chunk, chunks, inner, outer_stride, BLOCK_S, BLOCK_C)
    _, _, scale, shift = _scale_shift(c, channels, mean_ptr, invstd_ptr, weight_ptr, bias_ptr, AFFINE)
    for first in range(start, stop, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        offsets, mask = _tile(base, s, stop, c, channels, inner_stride, channel_stride)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(scale.dtype)
        out = _activate(y * scale[None, :] + shift[None, :], ACTIVATION)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _slope_and_xhat(grad_ptr, y_ptr, offsets, mask, mean, invstd, scale, shift, ACTIVATION: tl.constexpr):
    """g = grad * act'(z) and xhat = (y - mean) * invstd of a tile."""
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(mean.dtype)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(mean.dtype)
    g = grad
    if ACTIVATION != 0:
        g = grad * _activation_slope(y * scale[None, :] + shift[None, :], ACTIVATION)
    return g, (y - mean[None, :]) * invstd[None, :]


@triton.jit(do_not_specialize=_RUNTIME)
def gradient_sums_kernel(grad_ptr, y_ptr, partial_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                         channels, inner, chunk, chunks, outer_stride, inner_stride, channel_stride,
                         AFFINE: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    part, c, start, stop, base = _this_program(channels, chunk, chunks, inner, outer_stride, BLOCK_S, BLOCK_C)
    mean, invstd, scale, shift = _scale_shift(c, channels, mean_ptr, invstd_ptr, weight_ptr, bias_ptr, AFFINE)
    sum_g = tl.zeros([BLOCK_S, BLOCK_C], dtype=partial_ptr.dtype.element_ty)
    sum_g_xhat = tl.zeros([BLOCK_S, BLOCK_C], dtype=partial_ptr.dtype.element_ty)
    for first in range(start, stop, BLOCK_S):  # (each thread its own lanes: one reduction at the end)
        s = first + tl.arange(0, BLOCK_S)
        offsets, mask = _tile(base, s, stop, c, channels, inner_stride, channel_stride)
        g, xhat = _slope_and_xhat(grad_ptr, y_ptr, offsets, mask, mean, invstd, scale, shift, ACTIVATION)
        g = tl.where(mask, g, 0.0)
        sum_g += g
        sum_g_xhat += g * xhat
    c_ok = c < channels
    tl.store(partial_ptr + part * 2 * channels + c, tl.sum(sum_g, axis=0), mask=c_ok)
    tl.store(partial_ptr + (part * 2 + 1) * channels + c, tl.sum(sum_g_xhat, axis=0), mask=c_ok)


@triton.jit(do_not_specialize=["parts"])
def gradient_totals_kernel(partial_ptr, totals_ptr, grad_weight_ptr, grad_bias_ptr, channels, parts,
                           AFFINE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    sum_g = tl.zeros([BLOCK_P, BLOCK_C], dtype=partial_ptr.dtype.element_ty)
    sum_g_xhat = tl.zeros([BLOCK_P, BLOCK_C], dtype=partial_ptr.dtype.element_ty)
    for first in range(0, parts, BLOCK_P):
        p = first + tl.arange(0, BLOCK_P)
        mask = (p < parts)[:, None] & c_ok[None, :]
        offsets = (p * 2 * channels)[:, None] + c[None, :]
        sum_g += tl.load(partial_ptr + offsets, mask=mask, other=0.0)
        sum_g_xhat += tl.load(partial_ptr + offsets + channels, mask=mask, other=0.0)
    sum_g = tl.sum(sum_g, axis=0)
    sum_g_xhat = tl.sum(sum_g_xhat, axis=0)
    tl.store(totals_ptr + c, sum_g, mask=c_ok)
    tl.store(totals_ptr + channels + c, sum_g_xhat, mask=c_ok)
    if AFFINE:
        tl.store(grad_weight_ptr + c, sum_g_xhat.to(grad_weight_ptr.dtype.element_ty), mask=c_ok)
        tl.store(grad_bias_ptr + c, sum_g.to(grad_bias_ptr.dtype.element_ty), mask=c_ok)


@triton.jit(do_not_specialize=_RUNTIME + ["count"])
def grad_input_kernel(grad_ptr, y_ptr, grad_y_ptr, totals_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                      channels, inner, chunk, chunks, outer_stride, inner_stride, channel_stride, count,
                      AFFINE: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    part, c, start, stop, base = _this_program(channels, chunk, chunks, inner, outer_stride, BLOCK_S, BLOCK_C)
    mean, invstd, scale, shift = _scale_shift(c, channels, mean_ptr, invstd_ptr, weight_ptr, bias_ptr, AFFINE)
    c_ok = c < channels
    mean_g = tl.load(totals_ptr + c, mask=c_ok, other=0.0) / count
    mean_g_xhat = tl.load(totals_ptr + channels + c, mask=c_ok, other=0.0) / count
    for first in range(start, stop, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        offsets, mask = _tile(base, s, stop, c, channels, inner_stride, channel_stride)
        g, xhat = _slope_and_xhat(grad_ptr, y_ptr, offsets, mask, mean, invstd, scale, shift, ACTIVATION)
        grad_y = scale[None, :] * (g - mean_g[None, :] - xhat * mean_g_xhat[None, :])
        tl.store(grad_y_ptr + offsets, grad_y.to(grad_y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _eval_norm(c, c_ok, norm_weight_ptr, norm_bias_ptr, mean_ptr, var_ptr, eps, bias_ptr, AFFINE: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """A BatchNorm in eval mode per channel c (any shape) as x * scale + shift, after a convolution's
    bias where HAS_BIAS: scale = gamma / sqrt(var + eps), shift = (bias - mean) * scale + beta, in
    float32 (float64 for float64 statistics): fold_kernel's, and the tile kernels' input norm's (the
    values scale_shift writes)."""
    var = tl.load(var_ptr + c, mask=c_ok, other=1.0)
    acc = tl.float64 if var.dtype == tl.float64 else tl.float32
    eps = tl.full([], eps, acc)
    if acc == tl.float64:
        scale = 1.0 / tl.sqrt(var.to(acc) + eps)
    else:
        scale = tl.math.div_rn(1.0, tl.sqrt_rn(var.to(acc) + eps))
    if AFFINE:
        scale *= tl.load(norm_weight_ptr + c, mask=c_ok, other=0.0).to(acc)
    shift = -tl.load(mean_ptr + c, mask=c_ok, other=0.0).to(acc)
    if HAS_BIAS:
        shift += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(acc)
    shift *= scale
    if AFFINE:
        shift += tl.load(norm_bias_ptr + c, mask=c_ok, other=0.0).to(acc)
    return scale, shift


@triton.jit(do_not_specialize=["channels", "taps", "eps"])  # (one binary for every layer: the kernel is tiny)
def fold_kernel(weight_ptr, bias_ptr, norm_weight_ptr, norm_bias_ptr, mean_ptr, var_ptr, out_weight_ptr, out_bias_ptr,
                channels, taps, eps: tl.float64, HAS_BIAS: tl.constexpr, AFFINE: tl.constexpr, BLOCK_C: tl.constexpr,
                BLOCK_T: tl.constexpr, HAS_WEIGHT: tl.constexpr = True):
    """weight [channels, taps] * scale and (bias - mean) * scale + beta, scale = gamma / sqrt(var + eps),
    per output channel, computed in float32 (float64 for float64 statistics). Without HAS_WEIGHT:
    scale, then shift, into out_weight_ptr's (2, channels) (the BatchNorm as x * scale + shift:
    scale_shift; one tensor, where two views of it would be two ops more at each replayed call)."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    scale, shift = _eval_norm(c, c_ok, norm_weight_ptr, norm_bias_ptr, mean_ptr, var_ptr, eps, bias_ptr, AFFINE, HAS_BIAS)
    if not HAS_WEIGHT:
        tl.store(out_weight_ptr + c, scale.to(out_weight_ptr.dtype.element_ty), mask=c_ok)
        tl.store(out_weight_ptr + channels + c, shift.to(out_weight_ptr.dtype.element_ty), mask=c_ok)
        return
    tl.store(out_bias_ptr + c, shift.to(out_bias_ptr.dtype.element_ty), mask=c_ok)
    acc = scale.dtype
    for first in range(0, taps, BLOCK_T):
        t = first + tl.arange(0, BLOCK_T)
        offsets = c[:, None].to(tl.int64) * taps + t[None, :]
        mask = c_ok[:, None] & (t < taps)[None, :]
        w = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(acc) * scale[:, None]
        tl.store(out_weight_ptr + offsets, w.to(out_weight_ptr.dtype.element_ty), mask=mask)


# ---- launchers -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Split:
    """How a [outer, channels, inner] tensor is split among programs (one a layout)."""
    channels: int
    inner: int
    chunk: int
    chunks: int
    parts: int  # programs along the tensor: outer x chunks (the partial sums' rows)
    strides: Tuple[int, int, int]  # outer, inner, channel
    block_s: int
    block_c: int
    gpu: bool

    @property
    def grid(self) -> Tuple[int]:
        return (self.parts * cdiv(self.channels, self.block_c),)

    @property
    def scalars(self) -> tuple:
        return (self.channels, self.inner, self.chunk, self.chunks, *self.strides)

    def tiles(self, name: str, extra: tuple = (), **constants) -> LaunchPlan:
        """A launch over the tensor's tiles; extra: runtime arguments after the split's own."""
        return LaunchPlan(name, self.grid, self.scalars + extra, dict(
            constants, BLOCK_S=self.block_s, BLOCK_C=self.block_c, num_warps=4 if self.gpu else 1))

    def reduction(self, name: str, scalars: tuple, **constants) -> LaunchPlan:
        """A launch over the channels that combines the parts' partial sums."""
        table = tuned()
        block_c = table.batch_norm_reduce_channels if self.gpu else next_power_of_2(min(self.channels, 256))
        block_p = table.batch_norm_reduce_rows if self.gpu else next_power_of_2(min(self.parts, 64))
        return LaunchPlan(name, (cdiv(self.channels, block_c),), scalars,
                          dict(constants, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=8 if self.gpu else 1))


def _channel_block(channels: int, widths: Tuple[int, ...]) -> int:
    """The channels a channels_last tile covers: of widths, the one whose blocks take the fewest
    lanes (masked ones included), the widest of those; a power of two over all channels where they are
    fewer than the narrowest. Wide rows of contiguous channels are what the loads need."""
    if channels <= min(widths):
        return next_power_of_2(channels)
    return min(widths, key=lambda width: (cdiv(channels, width) * width, -width))


def _split(y: torch.Tensor, summing: bool) -> _Split:
    """summing: for the passes that sum over the tensor (statistics, gradient sums), whose
    channels_last tiles are narrower than the others' (tuning table)."""
    n, channels, h, w = y.shape
    gpu = gpu_plan(y.device)
    table = tuned()
    tile = table.batch_norm_tile if gpu else 512
    if channels_last(y):  # [1, C, N*H*W]: a row of channels each position
        outer, inner, strides = 1, n * h * w, (0, channels, 1)
        widths = (table.batch_norm_summing_channels if summing else table.batch_norm_channels) if gpu else (64,)
        block_c = _channel_block(channels, widths)
        block_s = max(1, tile // block_c)
    else:
        outer, inner, strides = n, h * w, (channels * h * w, 1, h * w)
        block_s = min(tile // 2, next_power_of_2(inner))
        block_c = max(1, min(next_power_of_2(channels), tile // 2 // block_s))
    # enough programs to fill the GPU, each a whole number of tiles
    wanted = cdiv(table.batch_norm_programs if gpu else 4, cdiv(channels, block_c) * outer)
    chunk = max(block_s, cdiv(cdiv(inner, wanted), block_s) * block_s)
    chunks = cdiv(inner, chunk)
    return _Split(channels, inner, chunk, chunks, outer * chunks, strides, block_s, block_c, gpu)


def channels_last(y: torch.Tensor) -> bool:
    """Whether the kernels read y as channels_last (unit steps along channels), else as NCHW."""
    return y.stride(1) == 1 and y.shape[1] > 1


@dataclass(frozen=True)
class _Plans:
    split: _Split  # the summing passes' (their partial sums' rows: split.parts)
    statistics: LaunchPlan
    statistics_sums: LaunchPlan
    normalize: LaunchPlan
    gradient_sums: LaunchPlan
    gradient_totals: LaunchPlan
    grad_input: LaunchPlan


def _plans(y: torch.Tensor, affine: bool, update: bool, momentum: float, eps: float, activation: int) -> _Plans:
    split, elementwise = _split(y, summing=True), _split(y, summing=False)
    tiles = dict(AFFINE=affine, ACTIVATION=activation)
    return _Plans(
        split,
        split.tiles("batch_norm_statistics"),
        split.reduction("batch_norm_statistics_sums", (split.channels, split.inner, split.chunk, split.chunks,
                                                       split.parts, momentum, eps), UPDATE_RUNNING=update),
        elementwise.tiles("batch_norm_normalize", **tiles),
        split.tiles("batch_norm_gradient_sums", **tiles),
        split.reduction("batch_norm_gradient_totals", (split.channels, split.parts), AFFINE=affine),
        elementwise.tiles("batch_norm_grad_input", (y.numel() // split.channels,), **tiles))


_PLANS = plan_cache()


def plans(y: torch.Tensor, affine: bool, update: bool, momentum: float, eps: float, activation: int) -> _Plans:
    """The six launches' plans for a tensor's layout and the BatchNorm's options."""
    key = (layout_key(y), affine, update, momentum, eps, activation)
    return cached_plan(_PLANS, key, lambda: _plans(y, affine, update, momentum, eps, activation))


def _like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t with like's strides (the kernels index both alike): itself where it has them, else a copy."""
    if t.stride() == like.stride():
        return t
    return t.contiguous(memory_format=torch.channels_last if channels_last(like) else torch.contiguous_format)


def _new(like: torch.Tensor, shape: Optional[tuple] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """empty_like(like), or an empty tensor of shape on like's device; NaN-filled under
    tuned().poison_partials (the tests: a value no program wrote then shows)."""
    t = torch.empty_like(like, dtype=dtype) if shape is None else torch.empty(shape, device=like.device, dtype=dtype)
    return t.fill_(float("nan")) if tuned().poison_partials else t


def batch_norm_forward(y: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                       running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                       momentum: float, eps: float, activation: int
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(act(batch_norm(y)) in y's dtype and strides, the batch's mean, 1 / sqrt(var + eps)) for y
    NCHW or dense channels_last (_like); the running statistics, where given, updated in place
    (momentum: the weight of the batch's). Statistics in float32 (float64 for float64 y)."""
    mean, invstd = batch_norm_statistics(y, running_mean, running_var, momentum, eps)
    return batch_norm_normalize(y, weight, bias, mean, invstd, eps, activation), mean, invstd


def batch_norm_statistics(y: torch.Tensor, running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                          momentum: float, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """batch_norm_forward's first two passes: (the batch's mean, 1 / sqrt(var + eps)), the running
    statistics, where given, updated in place."""
    update = running_mean is not None
    plan = plans(y, False, update, momentum, eps, 0)  # (the summing passes' plans take neither option)
    channels = y.shape[1]
    statistics = torch.float64 if y.dtype == torch.float64 else torch.float32
    partial = _new(y, (plan.split.parts, 2, channels), statistics)
    launch(statistics_kernel, plan.statistics, y, partial)
    mean, invstd = _new(y, (channels,), statistics), _new(y, (channels,), statistics)
    launch(statistics_sums_kernel, plan.statistics_sums, partial, mean, invstd,
           running_mean if update else mean, running_var if update else invstd)
    return mean, invstd


def batch_norm_normalize(y: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                         mean: torch.Tensor, invstd: torch.Tensor, eps: float, activation: int) -> torch.Tensor:
    """batch_norm_forward's last pass: act(batch_norm(y)) from the batch's statistics, y's strides."""
    affine = weight is not None
    out = _new(y)
    launch(normalize_kernel, plans(y, affine, False, 0.0, eps, activation).normalize, y, out, mean, invstd,
           *((weight, bias) if affine else (mean, mean)))
    return out


def batch_norm_backward(grad: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor],
                        bias: Optional[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor, eps: float,
                        activation: int) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(grad_y, grad_weight, grad_bias) of batch_norm_forward's output (the latter two None
    without weight); grad_y in y's strides (NCHW where y is in neither layout the kernels read: a
    saved-tensor hook may hand the saved y back in any)."""
    if not (y.is_contiguous() or y.is_contiguous(memory_format=torch.channels_last)):
        y = y.contiguous()
    grad = _like(grad, y)
    totals, grad_weight, grad_bias = batch_norm_grad_sums(grad, y, weight, bias, mean, invstd, eps, activation)
    return batch_norm_grad_input(grad, y, weight, bias, mean, invstd, totals, eps, activation), grad_weight, grad_bias


def batch_norm_grad_input(grad: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor],
                          bias: Optional[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor, totals: torch.Tensor,
                          eps: float, activation: int) -> torch.Tensor:
    """grad_y (y's strides) from batch_norm_grad_sums' totals: the backward's last pass."""
    grad_y = _new(y)
    launch(grad_input_kernel, plans(y, weight is not None, False, 0.0, eps, activation).grad_input, _like(grad, y), y,
           grad_y, totals, mean, invstd, *((weight, bias) if weight is not None else (mean, mean)))
    return grad_y


def batch_norm_grad_sums(grad: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor],
                         bias: Optional[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor, eps: float,
                         activation: int) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The backward's first two passes: (totals [2, C]: the sums of g = grad * act'(z) and of g * xhat,
    grad_weight, grad_bias); grad in y's strides (_like). grad_y then takes one more pass over grad
    and y: batch_norm_backward's, or the convolution's backward as it loads them (tile.NormGrad)."""
    affine = weight is not None
    plan = plans(y, affine, False, 0.0, eps, activation)
    parameters = (weight, bias) if affine else (mean, mean)
    partial = _new(y, (plan.split.parts, 2, y.shape[1]), mean.dtype)
    launch(gradient_sums_kernel, plan.gradient_sums, grad, y, partial, mean, invstd, *parameters)
    totals = _new(y, (2, y.shape[1]), mean.dtype)
    grad_weight = _new(weight) if affine else None
    grad_bias = _new(bias) if affine else None
    launch(gradient_totals_kernel, plan.gradient_totals, partial, totals,
           *((grad_weight, grad_bias) if affine else (totals, totals)))
    return totals, grad_weight, grad_bias


_FOLD_PLANS = plan_cache()


def _fold_plan(channels: int, taps: int, eps: float, has_bias: bool, affine: bool, gpu: bool,
               has_weight: bool = True) -> LaunchPlan:
    block_t = min(next_power_of_2(taps), 128)
    block_c = max(1, min(next_power_of_2(channels), (2048 if gpu else 8192) // block_t))
    return LaunchPlan("batch_norm_fold", (cdiv(channels, block_c),), (channels, taps, eps),
                      dict(HAS_BIAS=has_bias, AFFINE=affine, BLOCK_C=block_c, BLOCK_T=block_t, HAS_WEIGHT=has_weight,
                           num_warps=4 if gpu else 1))


def fold(weight: torch.Tensor, bias: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
         norm_bias: Optional[torch.Tensor], running_mean: torch.Tensor, running_var: torch.Tensor, eps: float,
         dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) in dtype of a convolution (weight contiguous, [out_channels, ...]) followed by a
    BatchNorm in eval mode: one launch."""
    channels = weight.shape[0]
    taps = weight.numel() // channels
    affine, gpu = norm_weight is not None, gpu_plan(weight.device)
    key = (channels, taps, eps, bias is not None, affine, weight.device.type)
    plan = cached_plan(_FOLD_PLANS, key, lambda: _fold_plan(channels, taps, eps, bias is not None, affine, gpu))
    # (Triton's interpreter truncates float32 to bfloat16 where the GPU rounds to nearest, cvt.rn.bf16.f32
    # in the PTX: off the GPU's plans the kernel writes float32 and PyTorch rounds, as the GPU does)
    written = dtype if gpu or dtype.itemsize >= 4 else torch.float32
    out_weight = torch.empty_like(weight, dtype=written)
    out_bias = torch.empty((channels,), dtype=written, device=weight.device)
    if tuned().poison_partials:  # (the tests: an element no program wrote then shows)
        out_weight.fill_(float("nan")), out_bias.fill_(float("nan"))
    launch(fold_kernel, plan, weight, bias if bias is not None else running_mean, norm_weight if affine else running_mean,
           norm_bias if affine else running_mean, running_mean, running_var, out_weight, out_bias)
    if written == dtype:  # (no `.to` at all: a recorded program replays each call, a no-op's too)
        return out_weight, out_bias
    return out_weight.to(dtype), out_bias.to(dtype)


class EvalNorm(NamedTuple):
    """A BatchNorm in eval mode as a convolution applies it to its input (the tile kernels compute
    its scale and shift themselves): weight and bias (both or neither), running mean and variance,
    contiguous floating vectors of the input's channels, and eps."""
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    mean: torch.Tensor
    var: torch.Tensor
    eps: float


def scale_shift(norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor], running_mean: torch.Tensor,
                running_var: torch.Tensor, eps: float) -> torch.Tensor:
    """A BatchNorm in eval mode as x * scale + shift per channel: (2, channels), scale then shift,
    float32 (float64 for float64 statistics), as fold computes them: one launch."""
    channels = running_mean.shape[0]
    affine, gpu = norm_weight is not None, gpu_plan(running_mean.device)
    key = (channels, eps, affine, running_mean.device.type, "scale_shift")
    plan = cached_plan(_FOLD_PLANS, key, lambda: _fold_plan(channels, 1, eps, False, affine, gpu, has_weight=False))
    dtype = torch.float64 if running_var.dtype == torch.float64 else torch.float32
    out = torch.empty((2, channels), dtype=dtype, device=running_mean.device)
    if tuned().poison_partials:
        out.fill_(float("nan"))
    launch(fold_kernel, plan, running_mean, running_mean, norm_weight if affine else running_mean,
           norm_bias if affine else running_mean, running_mean, running_var, out, out)
    return out
