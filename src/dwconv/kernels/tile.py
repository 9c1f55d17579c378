"""The tile family: tiles of output pixels, for any geometry and layout, and the channels_last backward
built on the same unrolled pixel code.

- `depthwise_fwd_tile_kernel`: one program = BLOCK_H output rows of a BLOCK_W x BLOCK_C strip
  (columns x channels) of one image. NCHW ("tile"): one channel a program, rows as [cols] vectors.
  channels_last ("nhwc"): a run of channels along the contiguous axis, a band of rows. "nhwc_pixels":
  the strip's columns unrolled too, each input pixel (a channel vector) loaded and converted once
  and fed to every output that reads it, with the pixel strides known to the compiler; compiled a
  second way for these, `depthwise_fwd_pixels_kernel`, with the image's sizes as runtime values.
- The channels_last backward: `depthwise_grad_nhwc_pixels_kernel` (the fused grad_input + weight
  gradient, or the weight gradient alone, on the same pixel tiles), `depthwise_grad_nhwc_rows_kernel`
  (the fused pass sliding down rows), `depthwise_grad_weight_nhwc_kernel` (any kernel size).
Tiles that read only inside the image skip every bounds test. Weight gradients are float32
partial sums per program, added in a fixed order by weight_sums.py: deterministic.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .._env import triton_interpreter_enabled
from .._geometry import ACTIVATION_CODES, ConvGeometry, cdiv, input_grad_geometry, next_power_of_2
from ..tuning import tuned
from ._launch import (ForwardConfig, GradWeightConfig, LaunchPlan, alignment, cached_plan, gpu_plan, launch, layout_key,
                      new_partial, plan_cache)
from ._shared import (_activate, _activation_slope, _load_weights, _tap_weights, acc_dtype,
                      channels_last_kernel_applies, forward_constants, needs_int64, partial_dtype)
from .batch_norm import EvalNorm, _eval_norm, _scale_shift
from .weight_sums import sum_partials, weight_grad_sums


@triton.jit
def _branch_weights(program_weights, w_taps, w_stride_tap, c_ok, TAPS: tl.constexpr, ACC_DTYPE: tl.constexpr,
                    MASKED: tl.constexpr, BRANCH_WEIGHT_TAPS: tl.constexpr):
    """The weights a "nhwc_pixels" branch convolves with: its own up to BRANCH_WEIGHT_TAPS taps (the
    interior's unmasked), else program_weights (loaded once before the branch)."""
    weights = program_weights
    if TAPS <= BRANCH_WEIGHT_TAPS:
        weights = _tap_weights(w_taps, w_stride_tap, c_ok, TAPS, ACC_DTYPE, MASKED)
    return weights


# _activate_input's code of SiLU through the GPU's tanh.approx.f32 (relative error about 2^-11, an absolute
# one of |v| 2^-12 at most: 16 times below a bfloat16 input's own rounding step): the input activation of
# bfloat16 tiles only, where the special-function unit bounds the kernel (each input value is
# activated once per tile that reads it); never under the interpreter (no PTX)
FAST_SILU = 8


@triton.jit
def _activate_input(v, INPUT_ACTIVATION: tl.constexpr, in_scale, in_shift, INPUT_NORM: tl.constexpr):
    """_activate of a loaded input value, or FAST_SILU's: silu as v/2 (1 + tanh(v/2)), one special-function
    instruction where exp and the division take two; INPUT_NORM: of v * in_scale + in_shift (the
    BatchNorm before, in eval mode: the caller zeroes the padding's values after, which no longer
    stay zero)."""
    if INPUT_NORM:
        v = tl.fma(v, in_scale, in_shift)
    if INPUT_ACTIVATION == 8:  # FAST_SILU
        half = 0.5 * v
        v = half + half * tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [half], dtype=tl.float32,
                                                    is_pure=True, pack=1)
    else:
        v = _activate(v, INPUT_ACTIVATION)
    return v


@triton.jit
def _channel_norm(c, c_ok, weight_ptr, bias_ptr, mean_ptr, var_ptr, eps, conv_bias_ptr, NORM: tl.constexpr,
                  HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """A BatchNorm's (eval mode) scale and shift per channel c, in ACC_DTYPE: _eval_norm's (NORM 1 with
    a weight and bias, 2 without; HAS_BIAS: the convolution's bias at conv_bias_ptr in the shift)."""
    scale, shift = _eval_norm(c, c_ok, weight_ptr, bias_ptr, mean_ptr, var_ptr, eps, conv_bias_ptr, NORM == 1,
                              HAS_BIAS)
    return scale.to(ACC_DTYPE), shift.to(ACC_DTYPE)


@triton.jit
def _conv_band(x_base, w_taps, b_ptrs, y_base, w_stride_tap, first_row, out_cols, out_c, c_ok,
               in_h, in_w, out_h, out_w, x_stride_h, x_stride_w, y_stride_h, y_stride_w,
               stride_w, pad_top, pad_left, dilation_w, KH: tl.constexpr, KW: tl.constexpr,
               STRIDE_H: tl.constexpr, DILATION_H: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
               UNROLL: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
               BLOCK_C: tl.constexpr, MASKED: tl.constexpr, INPUT_ACTIVATION: tl.constexpr, in_scale, in_shift,
               INPUT_NORM: tl.constexpr, out_scale, out_shift, OUTPUT_NORM: tl.constexpr):
    """Computes and stores output rows first_row .. first_row + BLOCK_H - 1 of a [cols, channels]
    strip (of INPUT_ACTIVATION's values of the input: _activate's code, one that maps 0 to 0, so that
    the zeros of masked loads stay the padding's; INPUT_NORM: of the input times in_scale plus
    in_shift first, the padding zeroed after; OUTPUT_NORM: each sum times out_scale plus out_shift,
    which holds the bias, before the activation). UNROLL: the loops are unrolled over the band's
    input rows, and each input row's shifted pixels are loaded (and converted) once for all the
    output rows that use them, not once a tap;
    otherwise (large kernels, BLOCK_H 1) a loop over the kernel rows bounds the code size. MASKED=False
    for strips that read only inside the image and write only inside the output: no bounds tests."""
    col_c_ok = (out_cols < out_w) & c_ok
    in_cols0 = out_cols * stride_w - pad_left
    first_in_row = first_row * STRIDE_H - pad_top
    accs = ()
    for j in tl.static_range(BLOCK_H):
        accs = accs + (tl.zeros([BLOCK_W, BLOCK_C], dtype=ACC_DTYPE),)
    # The inner loops call no @triton.jit helper: the interpreter (CI) pays ~0.3 ms a call.
    if UNROLL:
        # Per kernel column, computed once a band: the pixel pointers (less the row) and which
        # columns exist (few tensor operations a row keep the interpreter fast too).
        col_ptrs = ()
        col_oks = ()
        for kw in tl.static_range(KW):
            in_cols = in_cols0 + kw * dilation_w
            col_ptrs = col_ptrs + (x_base + in_cols * x_stride_w,)
            col_oks = col_oks + (col_c_ok & (in_cols >= 0) & (in_cols < in_w),)
        weights = ()
        for tap in tl.static_range(KH * KW):
            weights = weights + (_load_weights(w_taps + tap * w_stride_tap, c_ok, ACC_DTYPE, MASKED),)
        # (a strided, dilated band may load rows no output reads; the compiler drops those loads)
        for r in tl.static_range((BLOCK_H - 1) * STRIDE_H + (KH - 1) * DILATION_H + 1):
            in_row = first_in_row + r
            row_ok = (in_row >= 0) & (in_row < in_h)
            for kw in tl.static_range(KW):
                if MASKED:  # (tl.where, not &: the interpreter makes a scalar bool & a bool tensor int32)
                    x_ok = tl.where(row_ok, col_oks[kw], False)
                    x = tl.load(col_ptrs[kw] + in_row * x_stride_h, mask=x_ok, other=0.0).to(ACC_DTYPE)
                else:
                    x = tl.load(col_ptrs[kw] + in_row * x_stride_h).to(ACC_DTYPE)
                if INPUT_ACTIVATION != 0 or INPUT_NORM:  # (tested here: the interpreter pays for every helper call)
                    x = _activate_input(x, INPUT_ACTIVATION, in_scale, in_shift, INPUT_NORM)
                    if INPUT_NORM and MASKED:
                        x = tl.where(x_ok, x, 0.0)
                for kh in tl.static_range(KH):
                    for j in tl.static_range(BLOCK_H):
                        if j * STRIDE_H + kh * DILATION_H == r:  # output row j reads this row through kh
                            accs = accs[:j] + (tl.fma(x, weights[kh * KW + kw], accs[j]),) + accs[j + 1:]
    else:  # one output row (BLOCK_H 1), a rolled loop over the kernel rows
        acc = accs[0]
        for kh in range(KH):
            in_row = first_in_row + kh * DILATION_H
            row_ok = (in_row >= 0) & (in_row < in_h)
            for kw in tl.static_range(KW):
                in_cols = in_cols0 + kw * dilation_w
                ptrs = x_base + in_row * x_stride_h + in_cols * x_stride_w
                if MASKED:
                    x_ok = tl.where(row_ok, col_c_ok & (in_cols >= 0) & (in_cols < in_w), False)
                    x = tl.load(ptrs, mask=x_ok, other=0.0).to(ACC_DTYPE)
                else:
                    x = tl.load(ptrs).to(ACC_DTYPE)
                if INPUT_ACTIVATION != 0 or INPUT_NORM:
                    x = _activate_input(x, INPUT_ACTIVATION, in_scale, in_shift, INPUT_NORM)
                    if INPUT_NORM and MASKED:
                        x = tl.where(x_ok, x, 0.0)
                w = _load_weights(w_taps + (kh * KW + kw) * w_stride_tap, c_ok, ACC_DTYPE, MASKED)
                acc = tl.fma(x, w, acc)
        accs = (acc,)
    if HAS_BIAS and not OUTPUT_NORM:
        bias = _load_weights(b_ptrs, c_ok, ACC_DTYPE, MASKED)
    for j in tl.static_range(BLOCK_H):
        value = accs[j]
        if OUTPUT_NORM:
            value = tl.fma(value, out_scale, out_shift)
        elif HAS_BIAS:
            value += bias
        value = _activate(value, ACTIVATION)
        ptrs = y_base + (first_row + j) * y_stride_h + out_cols * y_stride_w
        if MASKED:
            tl.store(ptrs, value.to(y_base.dtype.element_ty), mask=tl.where(first_row + j < out_h, col_c_ok, False))
        else:
            tl.store(ptrs, value.to(y_base.dtype.element_ty))


@triton.jit
def _pairs_ok(c_ok, BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr):
    """The channel tests of _row_pixels' bfloat16 pair loads (the even channels' stand for their pairs)."""
    pairs_ok = c_ok
    if BF16_PAIRS:
        pairs_ok = tl.split(tl.reshape(c_ok, [1, BLOCK_C // 2, 2]))[0]
    return pairs_ok


@triton.jit
def _row_pixels(row_ptr, row_ok, first_in_col, in_w, c_ok, pairs_ok, COUNT: tl.constexpr, x_stride_w,
                ACC_DTYPE: tl.constexpr, BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr, MASKED: tl.constexpr,
                ROW_MASKED: tl.constexpr, WIDEN: tl.constexpr = True, INPUT_ACTIVATION: tl.constexpr = 0,
                in_scale=None, in_shift=None, INPUT_NORM: tl.constexpr = False):
    """COUNT pixels of an input row from row_ptr (pixel p at p * x_stride_w; [1, BLOCK_C] channel
    vectors in ACC_DTYPE) as a tuple. MASKED: zero outside the row's columns, the channels or the
    image's rows (row_ok); ROW_MASKED: only the row and channel tests (columns inside).
    BF16_PAIRS: bfloat16 channel pairs load as one 32-bit word (the launcher checks alignment).
    WIDEN False: the loaded values as they are, for _widen_pixels later (a load in flight), else
    widened through INPUT_ACTIVATION and INPUT_NORM (_conv_band's: the masked pixels zeroed after)."""
    if BF16_PAIRS:
        row_pairs = tl.split(tl.reshape(row_ptr, [1, BLOCK_C // 2, 2]))[0].to(tl.pointer_type(tl.int32))
    pixels = ()  # (one no output reads is dropped by the compiler)
    for p in tl.static_range(COUNT):
        if MASKED:  # (tl.where, not &, in the masks: the interpreter makes a scalar bool & a bool tensor int32)
            pixel_ok = row_ok & (first_in_col + p >= 0) & (first_in_col + p < in_w)
        if BF16_PAIRS:
            if MASKED:
                x = tl.load(row_pairs + p * (x_stride_w // 2), mask=tl.where(pixel_ok, pairs_ok, False), other=0)
            elif ROW_MASKED:
                x = tl.load(row_pairs + p * (x_stride_w // 2), mask=tl.where(row_ok, pairs_ok, False), other=0)
            else:
                x = tl.load(row_pairs + p * (x_stride_w // 2))
        else:
            if MASKED:
                x = tl.load(row_ptr + p * x_stride_w, mask=tl.where(pixel_ok, c_ok, False), other=0.0)
            elif ROW_MASKED:
                x = tl.load(row_ptr + p * x_stride_w, mask=tl.where(row_ok, c_ok, False), other=0.0)
            else:
                x = tl.load(row_ptr + p * x_stride_w)
        pixels = pixels + (x,)
    if WIDEN:
        pixels = _widen_pixels(pixels, ACC_DTYPE, BLOCK_C, BF16_PAIRS, INPUT_ACTIVATION, in_scale, in_shift,
                               INPUT_NORM)
        if INPUT_NORM and (MASKED or ROW_MASKED):
            widened = pixels
            pixels = ()
            for p in tl.static_range(COUNT):
                if MASKED:
                    pixel_ok = row_ok & (first_in_col + p >= 0) & (first_in_col + p < in_w)
                else:
                    pixel_ok = row_ok
                pixels = pixels + (tl.where(pixel_ok, widened[p], 0.0),)
    return pixels


@triton.jit
def _widen_pixels(loaded, ACC_DTYPE: tl.constexpr, BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr,
                  INPUT_ACTIVATION: tl.constexpr = 0, in_scale=None, in_shift=None, INPUT_NORM: tl.constexpr = False):
    """_row_pixels' loaded values in ACC_DTYPE (through INPUT_NORM and INPUT_ACTIVATION: _conv_band's). bfloat16
    pairs (32-bit words) widen by a shift and a mask (the compiler's conversion takes three
    instructions a pair)."""
    pixels = ()
    for p in tl.static_range(len(loaded)):
        if BF16_PAIRS:
            pair = loaded[p]
            pixel = tl.reshape(tl.join((pair << 16).to(tl.float32, bitcast=True),
                                       (pair & -65536).to(tl.float32, bitcast=True)), [1, BLOCK_C])
        else:
            pixel = loaded[p].to(ACC_DTYPE)
        if INPUT_ACTIVATION != 0 or INPUT_NORM:
            pixel = _activate_input(pixel, INPUT_ACTIVATION, in_scale, in_shift, INPUT_NORM)
        pixels = pixels + (pixel,)
    return pixels


@triton.jit
def _norm_constants(c, channels, mean_ptr, invstd_ptr, weight_ptr, bias_ptr, totals_ptr, count, AFFINE: tl.constexpr):
    """Per channel ([1, BLOCK_C] each), what the gradient of a BatchNorm in training takes (as
    kernels/batch_norm.py's grad_input_kernel computes it): z = y * scale + shift, and
    grad_y = scale * (g - mean_g - (y - mean) * invstd * mean_g_xhat) with g = grad * act'(z);
    totals: [2, channels], the sums of g and of g * (y - mean) * invstd over the count positions."""
    mean, invstd, scale, shift = _scale_shift(c, channels, mean_ptr, invstd_ptr, weight_ptr, bias_ptr, AFFINE)
    c_ok = c < channels
    mean_g = tl.load(totals_ptr + c, mask=c_ok, other=0.0) / count
    mean_g_xhat = tl.load(totals_ptr + channels + c, mask=c_ok, other=0.0) / count
    return scale, shift, mean, invstd, mean_g, mean_g_xhat


@triton.jit
def _norm_grad_pixels(grads, ys, norm, row_ok, first_in_col, in_w, MASKED: tl.constexpr, ROW_MASKED: tl.constexpr,
                      ACTIVATION: tl.constexpr):
    """grad_y at a row's pixels (widened, as _row_pixels gives them) from the BatchNorm's incoming
    gradient (grads) and its input (ys): the convolution's backward then reads what BatchNorm's
    grad_input pass would have written. Zero outside the image, as a loaded grad_y pixel is there."""
    scale, shift, mean, invstd, mean_g, mean_g_xhat = norm
    pixels = ()
    for p in tl.static_range(len(grads)):
        g = grads[p]
        if ACTIVATION != 0:
            g = g * _activation_slope(ys[p] * scale + shift, ACTIVATION)
        value = scale * (g - mean_g - (ys[p] - mean) * invstd * mean_g_xhat)
        if MASKED:
            value = tl.where(row_ok & (first_in_col + p >= 0) & (first_in_col + p < in_w), value, 0.0)
        elif ROW_MASKED:
            value = tl.where(row_ok, value, 0.0)
        pixels = pixels + (value,)
    return pixels


@triton.jit
def _row_taps(pixels, r: tl.constexpr, weights, accs, weight_grads, inputs_at_outputs,
              KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, DILATION_H: tl.constexpr,
              STRIDE_W: tl.constexpr, DILATION_W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
              OUTPUTS: tl.constexpr, WEIGHT_GRAD: tl.constexpr):
    """Every product of input row r of a tile (pixels: _row_pixels) into the outputs (accs, row-major
    BLOCK_H x BLOCK_W) and, WEIGHT_GRAD, into the taps' gradients (times inputs_at_outputs, one
    value an output). Output (j, i) reads row r through kernel row kh where j * STRIDE_H + kh *
    DILATION_H == r, and pixel i * STRIDE_W + kw * DILATION_W through tap (kh, kw): the loops visit
    only those (the tests are on constants, no code; and no local variable for an index, which
    Triton would make a tensor). Each output takes its taps in (kh, kw) order."""
    for kh in tl.static_range(KH):
        for j in tl.static_range(BLOCK_H):
            if j * STRIDE_H + kh * DILATION_H == r:
                for kw in tl.static_range(KW):
                    for i in tl.static_range(BLOCK_W):
                        if OUTPUTS:
                            accs = accs[:j * BLOCK_W + i] + (
                                tl.fma(pixels[i * STRIDE_W + kw * DILATION_W], weights[kh * KW + kw],
                                       accs[j * BLOCK_W + i]),) + accs[j * BLOCK_W + i + 1:]
                        if WEIGHT_GRAD:
                            weight_grads = weight_grads[:kh * KW + kw] + (
                                tl.fma(pixels[i * STRIDE_W + kw * DILATION_W], inputs_at_outputs[j * BLOCK_W + i],
                                       weight_grads[kh * KW + kw]),) + weight_grads[kh * KW + kw + 1:]
    return accs, weight_grads


@triton.jit
def _store_pixels(y_strip, accs, first_row, first_col, c_ok, out_h, out_w, y_stride_h, y_stride_w,
                  BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, MASKED: tl.constexpr, ACTIVATION: tl.constexpr,
                  out_scale=None, out_shift=None, OUTPUT_NORM: tl.constexpr = False):
    """Stores a tile's outputs (accs, row-major) from y_strip, its first column's pointer, through
    OUTPUT_NORM's out_scale and out_shift (_conv_band's) and the activation."""
    for j in tl.static_range(BLOCK_H):
        for i in tl.static_range(BLOCK_W):
            value = accs[j * BLOCK_W + i]
            if OUTPUT_NORM:
                value = tl.fma(value, out_scale, out_shift)
            value = _activate(value, ACTIVATION)
            ptrs = y_strip + (first_row + j) * y_stride_h + i * y_stride_w
            if MASKED:
                out_ok = (first_row + j < out_h) & (first_col + i < out_w)
                tl.store(ptrs, value.to(y_strip.dtype.element_ty), mask=tl.where(out_ok, c_ok, False))
            else:
                tl.store(ptrs, value.to(y_strip.dtype.element_ty))


@triton.jit
def _conv_pixels(x_base, weights, b_ptrs, y_base, first_row, first_col, c_ok,
                 in_h, in_w, out_h, out_w, x_stride_h, x_stride_w, y_stride_h, y_stride_w,
                 pad_top, pad_left,
                 KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, DILATION_H: tl.constexpr,
                 STRIDE_W: tl.constexpr, DILATION_W: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ACTIVATION: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
                 BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr, MASKED: tl.constexpr, OUTPUTS: tl.constexpr,
                 WEIGHT_GRAD: tl.constexpr, weight_grads, inputs_at_outputs, INPUT_ACTIVATION: tl.constexpr = 0,
                 in_scale=None, in_shift=None, INPUT_NORM: tl.constexpr = False, out_scale=None, out_shift=None,
                 OUTPUT_NORM: tl.constexpr = False):
    """_conv_band for channels_last with the columns unrolled (weights: the taps' [1, BLOCK_C]
    values, _tap_weights; loaded once by the caller): each pixel of a row (a [1, BLOCK_C]
    channel vector; a thread holds the same channels of every pixel) is loaded and converted once
    and feeds every output of the band that reads it, where _conv_band's [cols, channels] tiles
    load a row once a kernel column. Bounds tests are per pixel and uniform (a scalar each).
    BF16_PAIRS: bfloat16 channel pairs load as one 32-bit word and widen by a shift and a mask
    (the compiler's conversion takes three instructions a pair); the launcher checks alignment.
    WEIGHT_GRAD: also adds, per tap, this tile's pixels times inputs_at_outputs (one [1, BLOCK_C]
    value an output, _tile_pixels; zero outside) into weight_grads and returns them: every pair of
    that tap's weight gradient meets in exactly one FMA of one tile. The fused channels_last
    backward: x is grad_out, w the flipped weight, y grad_input, inputs_at_outputs the forward's
    input. The channels_last weight gradient: OUTPUTS False (no outputs computed or stored), x the
    forward's input, inputs_at_outputs grad_out. Else returns weight_grads as given.
    INPUT_ACTIVATION, INPUT_NORM, OUTPUT_NORM: _conv_band's."""
    first_in_row = first_row * STRIDE_H - pad_top
    first_in_col = first_col * STRIDE_W - pad_left
    start = tl.zeros([1, BLOCK_C], dtype=ACC_DTYPE)
    if HAS_BIAS and not OUTPUT_NORM:  # (accumulating onto the bias saves an add an output)
        start += _load_weights(b_ptrs, c_ok, ACC_DTYPE, MASKED)
    accs = ()
    for i in tl.static_range(BLOCK_H * BLOCK_W):
        accs = accs + (start,)
    # pointers to the strip's first pixel, and pixels at fixed offsets from them (immediate offsets of
    # the loads and stores on the GPU where the pixel strides are constants)
    x_strip = x_base + first_in_col * x_stride_w
    y_strip = y_base + first_col * y_stride_w
    pairs_ok = _pairs_ok(c_ok, BLOCK_C, BF16_PAIRS)
    for r in tl.static_range((BLOCK_H - 1) * STRIDE_H + (KH - 1) * DILATION_H + 1):
        in_row = first_in_row + r
        row_ptr = x_strip + in_row * x_stride_h
        row_ok = (in_row >= 0) & (in_row < in_h)
        pixels = _row_pixels(row_ptr, row_ok, first_in_col, in_w, c_ok, pairs_ok,
                             (BLOCK_W - 1) * STRIDE_W + (KW - 1) * DILATION_W + 1, x_stride_w, ACC_DTYPE, BLOCK_C,
                             BF16_PAIRS, MASKED, False, INPUT_ACTIVATION=INPUT_ACTIVATION, in_scale=in_scale,
                             in_shift=in_shift, INPUT_NORM=INPUT_NORM)
        accs, weight_grads = _row_taps(pixels, r, weights, accs, weight_grads, inputs_at_outputs, KH, KW, STRIDE_H,
                                       DILATION_H, STRIDE_W, DILATION_W, BLOCK_H, BLOCK_W, OUTPUTS, WEIGHT_GRAD)
    if OUTPUTS:
        _store_pixels(y_strip, accs, first_row, first_col, c_ok, out_h, out_w, y_stride_h, y_stride_w, BLOCK_H,
                      BLOCK_W, MASKED, ACTIVATION, out_scale, out_shift, OUTPUT_NORM)
    return weight_grads


@triton.jit
def _tile_pixels(base, first_row, first_col, c_ok, rows, cols, stride_h, stride_w,
                 ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, MASKED: tl.constexpr):
    """A tile's BLOCK_H x BLOCK_W pixels ([1, channels] each, zero outside rows x cols or the
    channels), as a tuple in row-major order."""
    pixels = ()
    for j in tl.static_range(BLOCK_H):
        for i in tl.static_range(BLOCK_W):
            ptrs = base + (first_row + j) * stride_h + (first_col + i) * stride_w
            if MASKED:
                inside = (first_row + j < rows) & (first_col + i < cols)
                pixel = tl.load(ptrs, mask=tl.where(inside, c_ok, False), other=0.0)
            else:
                pixel = tl.load(ptrs)
            pixels = pixels + (pixel.to(ACC_DTYPE),)
    return pixels


def depthwise_fwd_tile_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, in_weight_ptr, in_bias_ptr, in_mean_ptr, in_var_ptr,
    out_weight_ptr, out_bias_ptr, out_mean_ptr, out_var_ptr,
    out_channels, in_h, in_w, out_h, out_w,
    x_stride_n, x_stride_c, x_stride_h, x_stride_w,
    y_stride_n, y_stride_c, y_stride_h, y_stride_w,
    w_stride_c, w_stride_tap, w_first_tap,
    stride_w, pad_top, pad_left, dilation_w, in_eps: tl.float64, out_eps: tl.float64,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr,
    DILATION_H: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_ACTIVATION: tl.constexpr,
    INPUT_NORM: tl.constexpr, OUTPUT_NORM: tl.constexpr, UNROLL: tl.constexpr, INDEX_64: tl.constexpr,
    ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
    PIXELS: tl.constexpr, PIXEL_STRIDE_W: tl.constexpr, PIXEL_DILATION_W: tl.constexpr,
    PIXEL_X_STRIDE_W: tl.constexpr, PIXEL_Y_STRIDE_W: tl.constexpr, BF16_PAIRS: tl.constexpr,
    INTERIOR_TILES: tl.constexpr, BRANCH_WEIGHT_TAPS: tl.constexpr,
):
    """One program = BLOCK_H output rows (any number, not only powers of 2) of a BLOCK_W x BLOCK_C
    strip (columns, output channels) of one image; any stride/padding/dilation. BLOCK_C = 1 for NCHW
    (a strip of one plane); for channels_last a run of channels along the contiguous axis, with the
    weight taps-major for large inputs (w_stride_c 1: each tap's weights are one vector load; "nhwc"
    loads them once a band row, "nhwc_pixels" once a program), as given for small ones
    (NHWC_TAPS_MAJOR_MIN_BYTES).
    PIXELS (channels_last, "nhwc_pixels"): the strip's columns unrolled (_conv_pixels), with the
    column stride and dilation PIXEL_STRIDE_W / PIXEL_DILATION_W and the pixel strides of x and y
    PIXEL_X_STRIDE_W / PIXEL_Y_STRIDE_W known to the compiler (pixel addresses become immediate
    offsets from a row's: a binary per channel count; taken at run time they cost 4-19% of GPU
    time, docs/decisions.md, "Cold start").
    INPUT_ACTIVATION: an activation's code (_activate's) applied to each input value as it loads,
    one that maps 0 to 0 (the masked loads' zeros stay the padding's): the activation of the layer
    before, fused (no pass of its own over that layer's output).
    INPUT_NORM (1 with a weight and bias, 2 without): each input value first goes through the
    BatchNorm in eval mode before that activation (in_weight_ptr, in_bias_ptr, in_mean_ptr,
    in_var_ptr, in_eps: its own tensors, as x * scale + shift, computed here as fold_kernel computes
    them: no launch of its own), so that the layer before's convolution needs no folding of its own;
    the padding's values zeroed after both.
    OUTPUT_NORM (1 with a weight and bias, 2 without): the BatchNorm after the convolution, in eval
    mode, applied to each sum as x * scale + shift before the activation (out_weight_ptr .. out_var_ptr,
    out_eps; the bias folded into the shift), scale and shift computed here as fold_kernel computes
    them: no folding launch, and the weight read as it is (float32 under autocast: not rounded).
    INTERIOR_TILES: whether any tile can be interior (ConvGeometry.has_interior_tile); if not, only
    the masked branch is compiled (Triton's coalescing pass takes time superlinear in the code: a
    7x7 channels_last tile compiled in 29 s with both branches, 10 s with one, on the CPU machine)."""
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(out_w, BLOCK_W)
    tiles_per_plane = tl.cdiv(out_h, BLOCK_H) * tiles_w
    channel_blocks = tl.cdiv(out_channels, BLOCK_C)
    plane = pid // tiles_per_plane
    tile = pid % tiles_per_plane
    n = plane // channel_blocks
    first_c = (plane % channel_blocks) * BLOCK_C
    out_c = first_c + tl.arange(0, BLOCK_C)[None, :]
    in_c = out_c // MULTIPLIER
    x_base = x_ptr + n.to(tl.int64) * x_stride_n + in_c.to(tl.int64) * x_stride_c
    y_base = y_ptr + n.to(tl.int64) * y_stride_n + out_c.to(tl.int64) * y_stride_c
    first_row = (tile // tiles_w) * BLOCK_H
    first_col = (tile % tiles_w) * BLOCK_W
    if INDEX_64:
        first_row = first_row.to(tl.int64)
        first_col = first_col.to(tl.int64)
    c_ok = out_c < out_channels
    in_scale = None
    in_shift = None
    if INPUT_NORM:
        in_scale, in_shift = _channel_norm(in_c, c_ok, in_weight_ptr, in_bias_ptr, in_mean_ptr, in_var_ptr, in_eps,
                                           in_mean_ptr, INPUT_NORM, False, ACC_DTYPE)
    out_scale = None
    out_shift = None
    if OUTPUT_NORM:
        out_scale, out_shift = _channel_norm(out_c, c_ok, out_weight_ptr, out_bias_ptr, out_mean_ptr, out_var_ptr,
                                             out_eps, b_ptr, OUTPUT_NORM, HAS_BIAS, ACC_DTYPE)
    w_taps = w_ptr + w_first_tap + out_c * w_stride_c  # (tap t at + t * w_stride_tap: negative when flipped)
    # Most strips of a large image read only inside it: those skip every bounds test (the masked
    # loads' tests and zero fills were half the instructions of a 3x3 tile).
    if INTERIOR_TILES:
        interior = ((first_row + BLOCK_H <= out_h) & (first_col + BLOCK_W <= out_w)
                    & (first_c + BLOCK_C <= out_channels)
                    & (first_row * STRIDE_H - pad_top >= 0) & (first_col * stride_w - pad_left >= 0)
                    & ((first_row + BLOCK_H - 1) * STRIDE_H - pad_top + (KH - 1) * DILATION_H < in_h)
                    & ((first_col + BLOCK_W - 1) * stride_w - pad_left + (KW - 1) * dilation_w < in_w))
    else:
        interior = False
    if PIXELS:
        x_stride_w, y_stride_w = PIXEL_X_STRIDE_W, PIXEL_Y_STRIDE_W
        program_weights = ()
        if KH * KW > BRANCH_WEIGHT_TAPS:
            program_weights = _tap_weights(w_taps, w_stride_tap, c_ok, KH * KW, ACC_DTYPE, True)
        if interior:
            weights = _branch_weights(program_weights, w_taps, w_stride_tap, c_ok, KH * KW, ACC_DTYPE, False,
                                      BRANCH_WEIGHT_TAPS)
            _conv_pixels(x_base, weights, b_ptr + out_c, y_base, first_row, first_col, c_ok, in_h, in_w,
                         out_h, out_w, x_stride_h, x_stride_w, y_stride_h, y_stride_w, pad_top, pad_left,
                         KH, KW, STRIDE_H, DILATION_H, PIXEL_STRIDE_W, PIXEL_DILATION_W, HAS_BIAS, ACTIVATION,
                         ACC_DTYPE, BLOCK_H, BLOCK_W, BLOCK_C, BF16_PAIRS, False, True, False, (), (), INPUT_ACTIVATION,
                         in_scale, in_shift, INPUT_NORM, out_scale, out_shift, OUTPUT_NORM)
        else:
            weights = _branch_weights(program_weights, w_taps, w_stride_tap, c_ok, KH * KW, ACC_DTYPE, True,
                                      BRANCH_WEIGHT_TAPS)
            _conv_pixels(x_base, weights, b_ptr + out_c, y_base, first_row, first_col, c_ok, in_h, in_w,
                         out_h, out_w, x_stride_h, x_stride_w, y_stride_h, y_stride_w, pad_top, pad_left,
                         KH, KW, STRIDE_H, DILATION_H, PIXEL_STRIDE_W, PIXEL_DILATION_W, HAS_BIAS, ACTIVATION,
                         ACC_DTYPE, BLOCK_H, BLOCK_W, BLOCK_C, BF16_PAIRS, True, True, False, (), (), INPUT_ACTIVATION,
                         in_scale, in_shift, INPUT_NORM, out_scale, out_shift, OUTPUT_NORM)
    else:  # (BLOCK_W a power of 2 here; "nhwc_pixels" takes any)
        out_cols = first_col + tl.arange(0, BLOCK_W)[:, None]
        if interior:
            _conv_band(x_base, w_taps, b_ptr + out_c, y_base, w_stride_tap, first_row, out_cols, out_c, c_ok,
                       in_h, in_w, out_h, out_w, x_stride_h, x_stride_w, y_stride_h, y_stride_w, stride_w, pad_top,
                       pad_left, dilation_w, KH, KW, STRIDE_H, DILATION_H, HAS_BIAS, ACTIVATION, UNROLL, ACC_DTYPE,
                       BLOCK_H, BLOCK_W, BLOCK_C, False, INPUT_ACTIVATION, in_scale, in_shift, INPUT_NORM, out_scale,
                       out_shift, OUTPUT_NORM)
        else:
            _conv_band(x_base, w_taps, b_ptr + out_c, y_base, w_stride_tap, first_row, out_cols, out_c, c_ok,
                       in_h, in_w, out_h, out_w, x_stride_h, x_stride_w, y_stride_h, y_stride_w, stride_w, pad_top,
                       pad_left, dilation_w, KH, KW, STRIDE_H, DILATION_H, HAS_BIAS, ACTIVATION, UNROLL, ACC_DTYPE,
                       BLOCK_H, BLOCK_W, BLOCK_C, True, INPUT_ACTIVATION, in_scale, in_shift, INPUT_NORM, out_scale,
                       out_shift, OUTPUT_NORM)



# Two compilations of one kernel. pad_left is never specialised: were it known to be 0 (a multiple of
# 16), the unshifted load would get a 4-wide register layout while the shifted loads and the row stores
# (rows of odd length) get 1-wide ones, and Triton would convert between them through shared memory on
# every row. The sizes stay specialised for NCHW strips (columns the vector axis: masks whole over vectors)
# and the "nhwc" band (not examined); the pixel tiles ("nhwc_pixels") test them in scalar masks only (the
# same PTX either way, sm_90), so there they are runtime values: one binary for every image size.
_fwd_tile_source = depthwise_fwd_tile_kernel
depthwise_fwd_tile_kernel = triton.jit(do_not_specialize=["pad_left"])(_fwd_tile_source)
depthwise_fwd_pixels_kernel = triton.jit(do_not_specialize=["pad_left", "in_h", "in_w", "out_h", "out_w"])(
    _fwd_tile_source)


@triton.jit
def depthwise_grad_weight_nhwc_kernel(
    g_ptr, x_ptr, partial_ptr,
    channels, in_h, in_w, out_h, out_w, tiles, splits,
    x_stride_n, x_stride_h, x_stride_w,
    g_stride_n, g_stride_h, g_stride_w,
    stride_h, stride_w, pad_top, pad_left, dilation_h, dilation_w,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, BIAS_GRAD: tl.constexpr,
    INDEX_64: tl.constexpr, ACC_DTYPE: tl.constexpr, TAPS: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """grad_weight (and grad_bias) of channels_last tensors (unit channel strides). Program (split,
    channel block) walks the tiles split, split + splits, ... (a tile: BLOCK_W pixels of one grad_out
    row by BLOCK_C channels, loaded along the contiguous channel axis), multiplies each tap's shifted
    input pixels into it and sums over the pixels into a [TAPS, BLOCK_C] accumulator (slot KH*KW:
    grad_out alone, for grad_bias). Writes partial[out_c, split, TAPS], as the NCHW kernel does."""
    split = tl.program_id(0)
    out_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = out_c < channels
    in_c = out_c // MULTIPLIER
    taps = tl.arange(0, TAPS)[:, None]
    acc = tl.zeros([TAPS, BLOCK_C], dtype=ACC_DTYPE)
    tiles_w = tl.cdiv(out_w, BLOCK_W)
    for tile in range(split, tiles, splits):
        row = tile // tiles_w  # of the flattened (n, out row) axis
        n = row // out_h
        out_row = row % out_h
        out_cols = (tile % tiles_w) * BLOCK_W + tl.arange(0, BLOCK_W)
        if INDEX_64:
            out_row = out_row.to(tl.int64)
            out_cols = out_cols.to(tl.int64)
        col_ok = out_cols < out_w
        g_row = g_ptr + n.to(tl.int64) * g_stride_n + out_row * g_stride_h
        g = tl.load(g_row + (out_cols * g_stride_w)[:, None] + out_c[None, :], mask=col_ok[:, None] & c_ok[None, :],
                    other=0.0).to(ACC_DTYPE)
        x_image = x_ptr + n.to(tl.int64) * x_stride_n
        for kh in tl.static_range(KH):
            # the input row as a block like the columns (the interpreter makes a scalar & block mask int32)
            in_rows = out_row * stride_h - pad_top + kh * dilation_h + tl.zeros_like(out_cols)
            row_ok = (in_rows >= 0) & (in_rows < in_h)
            for kw in tl.static_range(KW):
                in_cols = out_cols * stride_w - pad_left + kw * dilation_w
                ok = (row_ok & col_ok & (in_cols >= 0) & (in_cols < in_w))[:, None] & c_ok[None, :]
                x = tl.load(x_image + (in_rows * x_stride_h + in_cols * x_stride_w)[:, None] + in_c[None, :], mask=ok,
                            other=0.0)
                acc = tl.where(taps == kh * KW + kw, acc + tl.sum(g * x.to(ACC_DTYPE), axis=0)[None, :], acc)
        if BIAS_GRAD:
            acc = tl.where(taps == KH * KW, acc + tl.sum(g, axis=0)[None, :], acc)
    offsets = out_c[None, :].to(tl.int64) * (splits * TAPS) + split * TAPS + taps
    tl.store(partial_ptr + offsets, acc, mask=c_ok[None, :])


@triton.jit
def _grad_tile(src_base, weights, w_ptr, q_base, dx_base, weight_grads, first_row, first_col, c_ok, src_h, src_w,
               tile_h, tile_w, src_stride_h, src_stride_w, q_stride_h, q_stride_w, dx_stride_h, dx_stride_w,
               pad_top, pad_left, KH: tl.constexpr, KW: tl.constexpr,
               STRIDE_H: tl.constexpr, DILATION_H: tl.constexpr, STRIDE_W: tl.constexpr, DILATION_W: tl.constexpr,
               ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
               BF16_PAIRS: tl.constexpr, GRAD_INPUT: tl.constexpr, BIAS_GRAD: tl.constexpr, MASKED: tl.constexpr):
    """One tile of depthwise_grad_nhwc_pixels_kernel: its grad_input (GRAD_INPUT) and its terms of the
    weight gradient (and the bias's: its grad_out pixels) added to weight_grads, which it returns."""
    q = _tile_pixels(q_base, first_row, first_col, c_ok, tile_h, tile_w, q_stride_h, q_stride_w, ACC_DTYPE,
                     BLOCK_H, BLOCK_W, MASKED)
    weight_grads = _conv_pixels(src_base, weights, w_ptr, dx_base, first_row, first_col, c_ok, src_h, src_w, tile_h,
                                tile_w, src_stride_h, src_stride_w, dx_stride_h, dx_stride_w, pad_top, pad_left, KH,
                                KW, STRIDE_H, DILATION_H, STRIDE_W, DILATION_W, False, 0, ACC_DTYPE, BLOCK_H, BLOCK_W,
                                BLOCK_C, BF16_PAIRS, MASKED, GRAD_INPUT, True, weight_grads, q)
    if BIAS_GRAD:
        bias_grad = weight_grads[KH * KW]
        for p in tl.static_range(BLOCK_H * BLOCK_W):
            bias_grad += q[p]
        weight_grads = weight_grads[:KH * KW] + (bias_grad,)
    return weight_grads


# (loop counts and the image's size, which bound loops and pixel masks, never the channel vectors: one
# binary for every batch and image size; the row strides stay specialised, for the vectors' alignment)
@triton.jit(do_not_specialize=["batch", "runs", "src_h", "src_w", "tile_h", "tile_w", "row_tiles"])
def depthwise_grad_nhwc_pixels_kernel(
    src_ptr, w_ptr, q_ptr, dx_ptr, partial_ptr,
    channels, batch, src_h, src_w, tile_h, tile_w, row_tiles, runs,
    src_stride_n, src_stride_h, q_stride_n, q_stride_h, dx_stride_n, dx_stride_h, pad_top, pad_left,
    GRAD_INPUT: tl.constexpr, MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, DILATION_H: tl.constexpr, DILATION_W: tl.constexpr,
    BIAS_GRAD: tl.constexpr, SRC_STRIDE_W: tl.constexpr, Q_STRIDE_W: tl.constexpr, DX_STRIDE_W: tl.constexpr,
    INDEX_64: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr, INTERIOR_TILES: tl.constexpr,
):
    """The channels_last backward on the unrolled pixels of the "nhwc_pixels" forward (_conv_pixels),
    tiles of BLOCK_H x BLOCK_W positions by BLOCK_C channels:
    - GRAD_INPUT (stride 1, multiplier 1): the fused pass. Tiles of grad_input (dx), computed as the
      forward on grad_out (src) with the flipped weight (w_ptr, [channels, taps]); in the same loop each
      (flipped) tap's weight gradient adds grad_out times the input x (q) at the tile's positions.
    - else the weight gradient alone (any stride, dilation, multiplier): tiles of grad_out (q), each
      tap's gradient adding the input x (src) under that tap times grad_out; BIAS_GRAD: grad_out's sum too.
    One read of grad_out and x either way. The tiles of a column (channel block, BLOCK_W columns)
    over every image, in (image, row) order, are cut into `runs` runs; program (column, run) walks
    its run (within an image, tile after tile down the rows) and writes one partial sum per tap
    (then the bias) and channel: partial[(column of tiles, run), channel, tap] in the weight's tap
    order, added in a fixed order by the launcher. Runs across images keep the partial sums small
    where the images are (kernels of many taps on small images). Programs of one run are
    consecutive (all columns of the same rows at once, measured faster on kb84: whole rows of
    the image read together, each tile's halo columns shared with its neighbours through L2).
    INTERIOR_TILES: as the forward's (depthwise_fwd_tile_kernel): without, only the masked branch.
    SRC_STRIDE_W, Q_STRIDE_W, DX_STRIDE_W: the pixel strides as constants (as the forward's)."""
    src_stride_w, q_stride_w, dx_stride_w = SRC_STRIDE_W, Q_STRIDE_W, DX_STRIDE_W
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(tile_w, BLOCK_W)
    columns = tl.cdiv(channels, BLOCK_C) * tiles_w
    run = pid // columns
    column = pid % columns
    first_col = (column % tiles_w) * BLOCK_W
    first_c = (column // tiles_w) * BLOCK_C
    c = first_c + tl.arange(0, BLOCK_C)[None, :]
    c_ok = c < channels
    tiles = batch * row_tiles
    run_length = tl.cdiv(tiles, runs)
    if INDEX_64:
        first_col = first_col.to(tl.int64)
    weight_grads = ()
    for tap in tl.static_range(KH * KW + BIAS_GRAD):
        weight_grads = weight_grads + (tl.zeros([1, BLOCK_C], dtype=ACC_DTYPE),)
    weights = ()
    if GRAD_INPUT:  # the weight [channels, taps] read from its last tap back (flipped)
        weights = _tap_weights(w_ptr + c * (KH * KW) + (KH * KW - 1), -1, c_ok, KH * KW, ACC_DTYPE, True)
    if INTERIOR_TILES:
        cols_inside = ((first_col + BLOCK_W <= tile_w) & (first_c + BLOCK_C <= channels)
                       & (first_col * STRIDE_W - pad_left >= 0)
                       & ((first_col + BLOCK_W - 1) * STRIDE_W - pad_left + (KW - 1) * DILATION_W < src_w))
    for tile in range(run * run_length, tl.minimum((run + 1) * run_length, tiles)):
        n = (tile // row_tiles).to(tl.int64)
        first_row = (tile % row_tiles) * BLOCK_H
        if INDEX_64:
            first_row = first_row.to(tl.int64)
        src_base = src_ptr + n * src_stride_n + c // MULTIPLIER
        q_base = q_ptr + n * q_stride_n + c
        dx_base = dx_ptr + n * dx_stride_n + c
        if INTERIOR_TILES:
            interior = cols_inside & (first_row + BLOCK_H <= tile_h) & (first_row * STRIDE_H - pad_top >= 0) \
                & ((first_row + BLOCK_H - 1) * STRIDE_H - pad_top + (KH - 1) * DILATION_H < src_h)
        else:
            interior = False
        if interior:
            weight_grads = _grad_tile(src_base, weights, w_ptr, q_base, dx_base, weight_grads, first_row, first_col,
                                      c_ok, src_h, src_w, tile_h, tile_w, src_stride_h, src_stride_w, q_stride_h,
                                      q_stride_w, dx_stride_h, dx_stride_w, pad_top, pad_left, KH, KW, STRIDE_H,
                                      DILATION_H, STRIDE_W, DILATION_W, ACC_DTYPE, BLOCK_H, BLOCK_W, BLOCK_C,
                                      BF16_PAIRS, GRAD_INPUT, BIAS_GRAD, False)
        else:
            weight_grads = _grad_tile(src_base, weights, w_ptr, q_base, dx_base, weight_grads, first_row, first_col,
                                      c_ok, src_h, src_w, tile_h, tile_w, src_stride_h, src_stride_w, q_stride_h,
                                      q_stride_w, dx_stride_h, dx_stride_w, pad_top, pad_left, KH, KW, STRIDE_H,
                                      DILATION_H, STRIDE_W, DILATION_W, ACC_DTYPE, BLOCK_H, BLOCK_W, BLOCK_C,
                                      BF16_PAIRS, GRAD_INPUT, BIAS_GRAD, True)
    slot = (column % tiles_w) * runs + run  # (channel blocks share a slot)
    partial = partial_ptr + (slot.to(tl.int64) * channels + c) * (KH * KW + BIAS_GRAD)
    for tap in tl.static_range(KH * KW + BIAS_GRAD):
        if GRAD_INPUT:  # (tap of the flipped weight: stored at the weight's own)
            tl.store(partial + (KH * KW - 1 - tap), weight_grads[tap], mask=c_ok)
        else:
            tl.store(partial + tap, weight_grads[tap], mask=c_ok)


@triton.jit
def _strip_row_loads(src_strip, norm_y_strip, q_base, row, first_in_col, first_col, c_ok, pairs_ok, src_h, src_w,
                     tile_h, tile_w, src_stride_h, src_stride_w, q_stride_h, q_stride_w, pad_top,
                     RING: tl.constexpr, PIXELS: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_W: tl.constexpr,
                     BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr, MASKED: tl.constexpr, NORM: tl.constexpr):
    """What _slide_rows' step for grad_input row `row` loads, as loaded (widened where used): the
    newest grad_out row of the strip (zero outside grad_out's rows), x's row, and with NORM the
    BatchNorm input's row under the grad_out row (else ())."""
    in_row = row - pad_top + RING
    row_ok = (in_row >= 0) & (in_row < src_h)
    src = _row_pixels(src_strip + in_row * src_stride_h, row_ok, first_in_col, src_w, c_ok, pairs_ok, PIXELS,
                      src_stride_w, ACC_DTYPE, BLOCK_C, BF16_PAIRS, MASKED, not MASKED, False)
    q = _tile_pixels(q_base, row, first_col, c_ok, tile_h, tile_w, q_stride_h, q_stride_w, q_base.dtype.element_ty,
                     1, BLOCK_W, MASKED)
    norm_y = ()
    if NORM:
        norm_y = _row_pixels(norm_y_strip + in_row * src_stride_h, row_ok, first_in_col, src_w, c_ok, pairs_ok,
                             PIXELS, src_stride_w, ACC_DTYPE, BLOCK_C, BF16_PAIRS, MASKED, not MASKED, False)
    return src, q, norm_y


@triton.jit
def _grad_out_row(loaded, norm_y_loaded, norm, in_row, src_h, first_in_col, src_w, ACC_DTYPE: tl.constexpr,
                  BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr, MASKED: tl.constexpr, NORM: tl.constexpr,
                  NORM_ACTIVATION: tl.constexpr):
    """A grad_out row of the strip as its loads gave it, widened; with NORM, grad_y of the BatchNorm
    after the convolution, from its incoming gradient (loaded) and its input (norm_y_loaded)."""
    pixels = _widen_pixels(loaded, ACC_DTYPE, BLOCK_C, BF16_PAIRS)
    if NORM:
        pixels = _norm_grad_pixels(pixels, _widen_pixels(norm_y_loaded, ACC_DTYPE, BLOCK_C, BF16_PAIRS), norm,
                                   (in_row >= 0) & (in_row < src_h), first_in_col, src_w, MASKED, not MASKED,
                                   NORM_ACTIVATION)
    return pixels


@triton.jit
def _slide_rows(src_base, norm_y_base, norm, weights, q_base, dx_base, first_row, last_row, first_col, c_ok, src_h,
                src_w, tile_h, tile_w, src_stride_h, src_stride_w, q_stride_h, q_stride_w, dx_stride_h, dx_stride_w,
                pad_top, pad_left, KH: tl.constexpr, KW: tl.constexpr,
                DILATION_H: tl.constexpr, DILATION_W: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr, PREFETCH: tl.constexpr, MASKED: tl.constexpr,
                NORM: tl.constexpr, NORM_ACTIVATION: tl.constexpr):
    """The fused pass down grad_input rows first_row..last_row-1 of one BLOCK_W x BLOCK_C strip:
    each step loads one grad_out row of the strip (with its KW-1 halo columns) and keeps the last
    (KH-1) * DILATION_H in registers (a ring, rotated by renaming), so a grad_out pixel is loaded
    (BLOCK_W + KW - 1) / BLOCK_W times, where 4 x 4 tiles load it 2.25 times at 3x3 (faster on
    56-wide small layers, slower on kb84, whose tiles issue 52 loads before their products).
    MASKED: column and channel tests (strips at the image's sides); else only the row test of
    grad_out. PREFETCH: each step issues the next row's loads before its products (the
    last step reloads its own row). NORM: grad_out's rows are grad_y computed from the BatchNorm's
    incoming gradient (src) and input (norm_y_base, src's strides) with norm (_norm_constants).
    Returns the taps' weight gradients (flipped taps, as weights)."""
    RING: tl.constexpr = (KH - 1) * DILATION_H
    PIXELS: tl.constexpr = BLOCK_W + (KW - 1) * DILATION_W
    first_in_col = first_col - pad_left
    src_strip = src_base + first_in_col * src_stride_w
    norm_y_strip = norm_y_base + first_in_col * src_stride_w
    dx_strip = dx_base + first_col * dx_stride_w
    pairs_ok = _pairs_ok(c_ok, BLOCK_C, BF16_PAIRS)
    ring = ()
    for k in tl.static_range(RING):
        in_row = first_row - pad_top + k
        row_ok = (in_row >= 0) & (in_row < src_h)
        loaded = _row_pixels(src_strip + in_row * src_stride_h, row_ok, first_in_col, src_w, c_ok, pairs_ok, PIXELS,
                             src_stride_w, ACC_DTYPE, BLOCK_C, BF16_PAIRS, MASKED, not MASKED, False)
        norm_y = ()
        if NORM:
            norm_y = _row_pixels(norm_y_strip + in_row * src_stride_h, row_ok, first_in_col, src_w, c_ok, pairs_ok,
                                 PIXELS, src_stride_w, ACC_DTYPE, BLOCK_C, BF16_PAIRS, MASKED, not MASKED, False)
        ring = ring + _grad_out_row(loaded, norm_y, norm, in_row, src_h, first_in_col, src_w, ACC_DTYPE, BLOCK_C,
                                    BF16_PAIRS, MASKED, NORM, NORM_ACTIVATION)
    weight_grads = ()
    for tap in tl.static_range(KH * KW):
        weight_grads = weight_grads + (tl.zeros([1, BLOCK_C], dtype=ACC_DTYPE),)
    if PREFETCH:
        src_next, q_next, norm_y_next = _strip_row_loads(
            src_strip, norm_y_strip, q_base, first_row, first_in_col, first_col, c_ok, pairs_ok, src_h, src_w, tile_h,
            tile_w, src_stride_h, src_stride_w, q_stride_h, q_stride_w, pad_top, RING, PIXELS, ACC_DTYPE, BLOCK_W,
            BLOCK_C, BF16_PAIRS, MASKED, NORM)
    for row in range(first_row, last_row):
        if PREFETCH:  # the next row's loads in flight while this row's products run
            src_loaded, q_loaded, norm_y_loaded = src_next, q_next, norm_y_next
            src_next, q_next, norm_y_next = _strip_row_loads(
                src_strip, norm_y_strip, q_base, tl.minimum(row + 1, last_row - 1), first_in_col, first_col, c_ok,
                pairs_ok, src_h, src_w, tile_h, tile_w, src_stride_h, src_stride_w, q_stride_h, q_stride_w, pad_top,
                RING, PIXELS, ACC_DTYPE, BLOCK_W, BLOCK_C, BF16_PAIRS, MASKED, NORM)
        else:
            src_loaded, q_loaded, norm_y_loaded = _strip_row_loads(
                src_strip, norm_y_strip, q_base, row, first_in_col, first_col, c_ok, pairs_ok, src_h, src_w, tile_h,
                tile_w, src_stride_h, src_stride_w, q_stride_h, q_stride_w, pad_top, RING, PIXELS, ACC_DTYPE, BLOCK_W,
                BLOCK_C, BF16_PAIRS, MASKED, NORM)
        window = ring + _grad_out_row(src_loaded, norm_y_loaded, norm, row - pad_top + RING, src_h, first_in_col,
                                      src_w, ACC_DTYPE, BLOCK_C, BF16_PAIRS, MASKED, NORM, NORM_ACTIVATION)
        q = _widen_pixels(q_loaded, ACC_DTYPE, BLOCK_C, False)
        accs = ()
        for i in tl.static_range(BLOCK_W):
            accs = accs + (tl.zeros([1, BLOCK_C], dtype=ACC_DTYPE),)
        for kh in tl.static_range(KH):
            accs, weight_grads = _row_taps(window[kh * DILATION_H * PIXELS:(kh * DILATION_H + 1) * PIXELS],
                                           kh * DILATION_H, weights, accs, weight_grads, q, KH, KW, 1, DILATION_H,
                                           1, DILATION_W, 1, BLOCK_W, True, True)
        _store_pixels(dx_strip, accs, row, first_col, c_ok, tile_h, tile_w, dx_stride_h, dx_stride_w, 1, BLOCK_W,
                      MASKED, 0)
        ring = window[PIXELS:]
    return weight_grads


@triton.jit(do_not_specialize=["batch", "segments", "src_h", "src_w", "tile_h", "tile_w", "segment_rows",
                               "norm_count"])
def depthwise_grad_nhwc_rows_kernel(
    src_ptr, w_ptr, q_ptr, dx_ptr, partial_ptr,
    norm_y_ptr, norm_mean_ptr, norm_invstd_ptr, norm_weight_ptr, norm_bias_ptr, norm_totals_ptr,
    channels, batch, src_h, src_w, tile_h, tile_w, segments, segment_rows,
    src_stride_n, src_stride_h, q_stride_n, q_stride_h, dx_stride_n, dx_stride_h, pad_top, pad_left, norm_count,
    KH: tl.constexpr, KW: tl.constexpr, DILATION_H: tl.constexpr, DILATION_W: tl.constexpr,
    SRC_STRIDE_W: tl.constexpr, Q_STRIDE_W: tl.constexpr, DX_STRIDE_W: tl.constexpr, INDEX_64: tl.constexpr,
    ACC_DTYPE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr,
    PREFETCH: tl.constexpr, NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, NORM_ACTIVATION: tl.constexpr,
):
    """The channels_last fused backward (stride 1, multiplier 1) sliding down the rows: program
    (image, segment of segment_rows rows, column strip) walks its rows one at a time (_slide_rows),
    writing grad_input (dx) as the forward of grad_out (src) with the flipped weight, and one
    partial weight gradient per tap and channel: partial[slot, channel, tap], slot = (strip
    column, image, segment), in the weight's tap order. Programs of the same rows are consecutive
    (neighbouring strips share their halo columns through L2). SRC_STRIDE_W, Q_STRIDE_W,
    DX_STRIDE_W: as depthwise_grad_nhwc_pixels_kernel's.
    NORM: the convolution is followed by a BatchNorm in training (and its activation,
    NORM_ACTIVATION): src is the gradient of the activation's output, norm_y the BatchNorm's input
    (the convolution's output, src's strides), and grad_out is computed from them as it is loaded
    (mean, invstd, the affine weight and bias, totals: kernels/batch_norm.py's), never stored."""
    src_stride_w, q_stride_w, dx_stride_w = SRC_STRIDE_W, Q_STRIDE_W, DX_STRIDE_W
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(tile_w, BLOCK_W)
    columns = tl.cdiv(channels, BLOCK_C) * tiles_w
    rows_block = pid // columns  # (image, segment)
    column = pid % columns
    n = (rows_block // segments).to(tl.int64)
    first_row = (rows_block % segments) * segment_rows
    last_row = tl.minimum(first_row + segment_rows, tile_h)
    first_col = (column % tiles_w) * BLOCK_W
    first_c = (column // tiles_w) * BLOCK_C
    if INDEX_64:
        first_row = first_row.to(tl.int64)
        first_col = first_col.to(tl.int64)
    c = first_c + tl.arange(0, BLOCK_C)[None, :]
    c_ok = c < channels
    weights = _tap_weights(w_ptr + c * (KH * KW) + (KH * KW - 1), -1, c_ok, KH * KW, ACC_DTYPE, True)  # flipped
    src_base = src_ptr + n * src_stride_n + c
    norm_y_base = norm_y_ptr + n * src_stride_n + c
    q_base = q_ptr + n * q_stride_n + c
    dx_base = dx_ptr + n * dx_stride_n + c
    norm = ()
    if NORM:
        norm = _norm_constants(c, channels, norm_mean_ptr, norm_invstd_ptr, norm_weight_ptr, norm_bias_ptr,
                               norm_totals_ptr, norm_count, NORM_AFFINE)
    cols_inside = ((first_col + BLOCK_W <= tile_w) & (first_c + BLOCK_C <= channels) & (first_col - pad_left >= 0)
                   & (first_col + BLOCK_W - 1 - pad_left + (KW - 1) * DILATION_W < src_w))
    if cols_inside:
        weight_grads = _slide_rows(src_base, norm_y_base, norm, weights, q_base, dx_base, first_row, last_row,
                                   first_col, c_ok, src_h, src_w, tile_h, tile_w, src_stride_h, src_stride_w,
                                   q_stride_h, q_stride_w, dx_stride_h, dx_stride_w, pad_top, pad_left, KH, KW,
                                   DILATION_H, DILATION_W, ACC_DTYPE, BLOCK_W, BLOCK_C, BF16_PAIRS, PREFETCH, False,
                                   NORM, NORM_ACTIVATION)
    else:
        weight_grads = _slide_rows(src_base, norm_y_base, norm, weights, q_base, dx_base, first_row, last_row,
                                   first_col, c_ok, src_h, src_w, tile_h, tile_w, src_stride_h, src_stride_w,
                                   q_stride_h, q_stride_w, dx_stride_h, dx_stride_w, pad_top, pad_left, KH, KW,
                                   DILATION_H, DILATION_W, ACC_DTYPE, BLOCK_W, BLOCK_C, BF16_PAIRS, PREFETCH, True,
                                   NORM, NORM_ACTIVATION)
    slot = (column % tiles_w) * (batch * segments) + rows_block  # (channel blocks share a slot)
    partial = partial_ptr + (slot.to(tl.int64) * channels + c) * (KH * KW)
    for tap in tl.static_range(KH * KW):  # (tap of the flipped weight: stored at the weight's own)
        tl.store(partial + (KH * KW - 1 - tap), weight_grads[tap], mask=c_ok)


# ---- blocks and launch plans ------------------------------------------------------------------

NHWC_KERNELS = ("nhwc", "nhwc_pixels")
TILE_KERNELS = ("tile",) + NHWC_KERNELS  # (the forwards of depthwise_fwd_tile_kernel)


def band_rows(geom: ConvGeometry, wanted: int, device: torch.device) -> int:
    """Output rows of a tile program: `wanted`, fewer where the unrolled band would pass the band
    limit (code size on the GPU, tensor operations under the interpreter), one for kernels of more
    than max_band_taps taps (those loop over their rows on every device)."""
    taps = geom.kernel_h * geom.kernel_w
    if taps > tuned().max_band_taps:
        return 1
    return max(1, min(wanted, geom.out_h, _band_limit(device) // taps))


def _band_limit(device: torch.device) -> int:
    return tuned().max_band_taps if gpu_plan(device) else tuned().interpreter_band_taps


def nchw_blocks(geom: ConvGeometry, x: torch.Tensor) -> ForwardConfig:
    """The NCHW tile kernel: bands of 4 rows of 64 columns on the GPU; under the interpreter few,
    wide programs (each costs about the same there)."""
    if not gpu_plan(x.device):
        return ForwardConfig("tile", band_rows(geom, 64, x.device), min(32, next_power_of_2(geom.out_w)), 4,
                             block_c=min(16, next_power_of_2(geom.out_channels)))
    block_w = min(64, next_power_of_2(geom.out_w))
    return ForwardConfig("tile", band_rows(geom, 4, x.device), block_w, max(1, block_w // 32))


def nhwc_blocks(geom: ConvGeometry, x: torch.Tensor) -> ForwardConfig:
    """The channels_last band kernel "nhwc": 8 rows of 8 x 64 in float32, 16 of 8 x 32 in half
    precision; under the interpreter few, large programs."""
    half = x.element_size() == 2
    lowest_bit = geom.out_channels & -geom.out_channels
    # a run that divides the channels keeps every strip on the unmasked path
    block_c = min(32 if half else 64, lowest_bit) if lowest_bit >= 8 else min(64, next_power_of_2(geom.out_channels))
    if not gpu_plan(x.device):
        return ForwardConfig("nhwc", band_rows(geom, 64, x.device), min(32, next_power_of_2(geom.out_w)), 1,
                             block_c=block_c)
    per_thread = 2 if half else 4
    block_w = max(1, min(next_power_of_2(geom.out_w), per_thread * 128 // block_c))
    return ForwardConfig("nhwc", band_rows(geom, 16 if half else 8, x.device), block_w, 4, block_c=block_c)


def nhwc_pixels_blocks(geom: ConvGeometry, x: torch.Tensor, whole_tiles: bool = True) -> ForwardConfig:
    """Blocks of "nhwc_pixels", a channel pair a thread: 3x3 takes 4 x 8 outputs (2 x 8 on inputs up to
    short_pixel_tile_max_bytes) by 128 channels on 2 warps where the channels come in runs of 128,
    else 64 or 32 on one warp; larger kernels 4 x 4
    outputs by 32 channels (16 in float32 where the channels come in runs of 16 only).
    whole_tiles: 7 columns where they divide the output's width and the default's do not (28, 14
    and 7 wide: a last tile partly outside does every masked output's work), whole_tile_rows rows
    of them for the kernels without an interior branch (7x7: 4 took 23-26 s to compile)."""
    taps = geom.kernel_h * geom.kernel_w
    channels = geom.out_channels
    if taps <= 9:
        short = x.numel() * x.element_size() <= tuned().short_pixel_tile_max_bytes
        block_h, block_w = (tuned().short_pixel_tile_rows if short else 4), 8
        block_c = next(c for c in (128, 64, 32) if channels % c == 0 or c == 32)
    else:
        block_h, block_w = 4, 4
        runs_of_16 = channels % 32 != 0 and channels % 16 == 0
        block_c = 16 if runs_of_16 and x.element_size() >= 4 else 32
    if whole_tiles and geom.out_w % block_w and geom.out_w % 7 == 0:
        block_w = 7
        block_h = tuned().whole_tile_rows if taps > tuned().interior_branch_max_taps else block_h
    block_h = max(1, min(block_h, tuned().max_pixel_taps // (block_w * taps)))
    return ForwardConfig("nhwc_pixels", block_h, block_w, max(1, block_c // 64), block_c=block_c)


def bf16_pairs_apply(x: torch.Tensor, geom: ConvGeometry, block_c: int, num_warps: int) -> bool:
    """Whether "nhwc_pixels" loads bfloat16 channel pairs as 32-bit words: where a thread holds one
    pair (other spreads cost shuffles), every pair starts on 4 bytes (even channel counts and
    strides, an aligned base) and lies in one input channel pair (multiplier 1)."""
    return (x.dtype == torch.bfloat16 and geom.multiplier == 1 and x.stride(1) == 1 and block_c == 64 * num_warps
            and geom.in_channels % 2 == 0 and all(s % 2 == 0 for s in (x.stride(0), x.stride(2), x.stride(3)))
            and alignment(x) % 4 == 0)


def weight_taps_major(kernel: str, x: torch.Tensor) -> bool:
    """Whether the channels_last tiles read the weight taps-major ([taps, C]: a tap's weights for a run
    of channels are one vector load), a copy made each call: only for large inputs, where the strided
    loads of the weight as given cost more than the copy's host time."""
    return kernel in NHWC_KERNELS and x.numel() * x.element_size() >= tuned().nhwc_taps_major_min_bytes


def _weight_strides(kernel: str, geom: ConvGeometry, flipped: bool, x: torch.Tensor) -> Tuple[int, int, int]:
    """(channel stride, tap stride, first tap's offset) of the weight depthwise_fwd_tile_kernel reads:
    [C, taps] as given, or [taps, C] (weight_taps_major); flipped: the taps from the last one back."""
    taps = geom.kernel_h * geom.kernel_w
    channel, tap = (1, geom.out_channels) if weight_taps_major(kernel, x) else (taps, 1)
    return (channel, -tap, (taps - 1) * tap) if flipped else (channel, tap, 0)


def input_activation_code(code: int, x: torch.Tensor) -> int:
    """The INPUT_ACTIVATION a tile kernel takes for an input activation's code: FAST_SILU for SiLU of
    bfloat16 inputs on the GPU (docs/decisions.md, "SiLU of bfloat16 inputs through tanh.approx")."""
    if code == ACTIVATION_CODES["silu"] and x.dtype == torch.bfloat16 and not triton_interpreter_enabled():
        return FAST_SILU
    return code


def forward_plan(geom: ConvGeometry, config: ForwardConfig, x: torch.Tensor, out: torch.Tensor, has_bias: bool,
                 flip_weight: bool = False, activation: int = 0, input_activation: int = 0,
                 input_norm: Optional[Tuple[bool, float]] = None,
                 output_norm: Optional[Tuple[bool, float]] = None) -> LaunchPlan:
    """The tile kernel, one channel a program (NCHW) or a block of channels ("nhwc", "nhwc_pixels":
    unit channel strides). input_activation: the code of one applied to the input's values as they
    load (one that maps 0 to 0: _geometry.INPUT_ACTIVATIONS); input_norm: (affine, eps) of a
    BatchNorm in eval mode applied to each input channel before it (forward's input_norm);
    output_norm: (affine, eps) of one applied to each output channel's sums (forward's output_norm)."""
    nhwc = config.kernel in NHWC_KERNELS
    assert not nhwc or channels_last_kernel_applies(x, out), "the NHWC tiles need unit channel strides"
    taps = geom.kernel_h * geom.kernel_w
    pixels = config.kernel == "nhwc_pixels"
    assert not pixels or (taps <= tuned().max_band_taps and config.block_h * config.block_w * taps
                          <= tuned().max_pixel_taps), "too many outputs x taps to unroll"
    block_c = config.block_c  # >1 on NCHW too under the interpreter (any channel stride works)
    tiles = cdiv(geom.out_h, config.block_h) * cdiv(geom.out_w, config.block_w)
    scalars = (geom.out_channels, geom.in_h, geom.in_w, geom.out_h, geom.out_w, *x.stride(), *out.stride(),
               *_weight_strides(config.kernel, geom, flip_weight, x), geom.stride_w, geom.pad_top, geom.pad_left,
               geom.dilation_w, 0.0 if input_norm is None else input_norm[1],
               0.0 if output_norm is None else output_norm[1])
    unroll = taps <= tuned().max_band_taps
    assert config.block_h * taps <= _band_limit(x.device) or config.block_h == 1, "band too long to unroll"
    assert unroll or config.block_h == 1, "large kernels take one output row a program"
    constants = dict(
        forward_constants(geom, config, x, out, has_bias, activation),
        INPUT_ACTIVATION=input_activation_code(input_activation, x),
        INPUT_NORM=0 if input_norm is None else 1 if input_norm[0] else 2,
        OUTPUT_NORM=0 if output_norm is None else 1 if output_norm[0] else 2,
        # offsets inside one image (not one plane) for the channels_last tiles
        INDEX_64=needs_int64(x, out, first_dim=1 if nhwc else 2), STRIDE_H=geom.stride_h,
        DILATION_H=geom.dilation_h, UNROLL=unroll, BLOCK_H=config.block_h, BLOCK_C=block_c, PIXELS=pixels,
        PIXEL_STRIDE_W=geom.stride_w if pixels else 1, PIXEL_DILATION_W=geom.dilation_w if pixels else 1,
        **dict(zip(("PIXEL_X_STRIDE_W", "PIXEL_Y_STRIDE_W"),
                   (x.stride(3), out.stride(3)) if pixels else (1, 1))),
        BF16_PAIRS=pixels and bf16_pairs_apply(x, geom, block_c, config.num_warps),
        INTERIOR_TILES=taps <= tuned().interior_branch_max_taps and geom.has_interior_tile(config.block_h, config.block_w,
                                                                                            block_c),
        BRANCH_WEIGHT_TAPS=tuned().per_branch_weight_taps,
        num_stages=1)  # (bands are unrolled: no loop loads to software-pipeline)
    return LaunchPlan(config.kernel, (geom.batch * cdiv(geom.out_channels, block_c) * tiles,), scalars, constants)


def forward(plan: LaunchPlan, geom: ConvGeometry, x: torch.Tensor, weight: torch.Tensor,
            bias: Optional[torch.Tensor], out: torch.Tensor, input_norm: Optional[EvalNorm] = None,
            output_norm: Optional[EvalNorm] = None) -> None:
    """input_norm, output_norm: with a plan of them, the BatchNorms' tensors (batch_norm.EvalNorm)."""
    if weight_taps_major(plan.kernel, x):
        weight = weight.reshape(geom.out_channels, -1).t()
    weight = weight.contiguous()
    kernel = depthwise_fwd_pixels_kernel if plan.constants["PIXELS"] else depthwise_fwd_tile_kernel
    launch(kernel, plan, x, weight, bias.contiguous() if bias is not None else weight, out,
           *_norm_pointers(input_norm, weight), *_norm_pointers(output_norm, weight))


def _norm_pointers(norm: Optional[EvalNorm], other: torch.Tensor) -> tuple:
    """An EvalNorm's four tensors as the kernel takes them (absent ones: any pointer)."""
    if norm is None:
        return (other,) * 4
    return tuple(norm.mean if t is None else t for t in norm[:4])


# ---- the channels_last backward ---------------------------------------------------------------------

def pixels_grad_blocks(geom: ConvGeometry, x: torch.Tensor, grad_input: bool, bias_grad: bool = False
                       ) -> Tuple[ForwardConfig, int]:
    """Blocks and runs (programs a column of tiles) of depthwise_grad_nhwc_pixels_kernel, whose tiles
    cover grad_input for the fused pass and grad_out for the weight gradient alone: the forward's
    blocks; the fused pass 4 x 4 outputs in half precision, 2 x 4 in float32, 32 channels on small
    inputs. Programs: as many as image columns of tiles and at least 4096, but fewer where the
    partial sums would pass 1/partial_share of grad_out and x (each program writes its sums for
    every tap, and the second pass reads them all), and never under min_pixel_grad_programs.
    Under the interpreter one program a column."""
    tile_geom = input_grad_geometry(geom) if grad_input else geom
    config = nhwc_pixels_blocks(tile_geom, x, whole_tiles=False)
    if grad_input:
        block_h = min(config.block_h, 4 if x.element_size() < 4 else 2)
        block_c = 32 if x.numel() * x.element_size() < tuned().small_fused_bytes else config.block_c
        config = ForwardConfig("nhwc_pixels", block_h, 4, max(1, block_c // 64), block_c=block_c)
    columns = cdiv(geom.out_channels, config.block_c) * cdiv(tile_geom.out_w, config.block_w)
    tiles = geom.batch * cdiv(tile_geom.out_h, config.block_h)
    if not gpu_plan(x.device):
        return config, 1
    tensor_bytes = (x.numel() + geom.batch * geom.out_channels * geom.out_h * geom.out_w) * x.element_size()
    sums_a_program = config.block_c * (geom.kernel_h * geom.kernel_w + int(bias_grad)) * 4
    programs = min(max(4096, geom.batch * columns),
                   max(tuned().min_pixel_grad_programs, tensor_bytes // tuned().partial_share // sums_a_program))
    return config, max(1, min(tiles, cdiv(programs, columns)))


def rows_grad_blocks(geom: ConvGeometry, x: torch.Tensor, block_w: int = 8, prefetch: bool = True) -> ForwardConfig:
    """Blocks of the row-sliding fused pass: strips of block_w columns and the tile pass's channels;
    block_h is the rows a program walks, the whole image unless that leaves fewer than
    nhwc_rows_programs programs (under the interpreter: the whole image, one strip)."""
    tile_geom = input_grad_geometry(geom)
    tile_config, _ = pixels_grad_blocks(geom, x, True)
    if not gpu_plan(x.device):
        return ForwardConfig("nhwc_rows", tile_geom.out_h, tile_geom.out_w, tile_config.num_warps,
                             block_c=tile_config.block_c, prefetch=prefetch)
    strips = geom.batch * cdiv(tile_geom.out_w, block_w) * cdiv(geom.out_channels, tile_config.block_c)
    segments = min(tile_geom.out_h, cdiv(tuned().nhwc_rows_programs, strips))
    return ForwardConfig("nhwc_rows", cdiv(tile_geom.out_h, segments), block_w, tile_config.num_warps,
                         block_c=tile_config.block_c, prefetch=prefetch)


class NormGrad(NamedTuple):
    """A BatchNorm in training after the convolution, whose gradient the row-sliding backward computes
    as it loads grad_out (kernels/batch_norm.py's tensors: its input y, mean, invstd, the affine
    weight and bias or None, the totals of batch_norm_grad_sums; the activation's code)."""
    y: torch.Tensor
    mean: torch.Tensor
    invstd: torch.Tensor
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    totals: torch.Tensor
    activation: int

    def tensors(self) -> tuple:
        affine = (self.weight, self.bias) if self.weight is not None else (self.mean, self.mean)
        return (self.y, self.mean, self.invstd, *affine, self.totals)


def grad_input_and_weight(geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          config: ForwardConfig, runs: Optional[int], norm: Optional[NormGrad] = None
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fused backward of channels_last x: grad_input and grad_weight from one read of grad_out
    and x (depthwise_grad_nhwc_pixels_kernel with GRAD_INPUT, or the row-sliding pass). norm: grad_out
    is the gradient of a BatchNorm's output after the convolution (the row-sliding pass only), whose
    grad_y the pass computes as it loads it."""
    assert geom.stride_h == geom.stride_w == 1 and geom.multiplier == 1 and channels_last_kernel_applies(x), \
        "the channels_last fused backward needs stride 1, multiplier 1 and unit channel strides"
    assert norm is None or config.kernel == "nhwc_rows", "a BatchNorm's gradient is computed by the rows pass only"
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    grad_w, _ = _pixels_grad(geom, grad_out, x, dx, weight.contiguous(), config, runs, False, weight.dtype, norm)
    return dx, grad_w


def grad_weight_pixels(geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor, config: Optional[ForwardConfig],
                       bias_grad: bool, weight_dtype: torch.dtype) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The channels_last weight gradient on the unrolled pixel tiles."""
    return _pixels_grad(geom, grad_out, x, None, None, config, None, bias_grad, weight_dtype)


def _pixels_grad(geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor, dx: Optional[torch.Tensor],
                 weight: Optional[torch.Tensor], config: Optional[ForwardConfig], runs: Optional[int],
                 bias_grad: bool, weight_dtype: torch.dtype, norm: Optional[NormGrad] = None
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Launches the fused pass (dx given) or the weight gradient alone and returns grad_weight and
    grad_bias (or None) from its partial sums."""
    if grad_out.stride(1) != 1:  # (autograd hands the output's layout back; this is the odd case)
        grad_out = grad_out.contiguous(memory_format=torch.channels_last)
    if norm is not None and norm.y.stride() != grad_out.stride():  # (the pass reads both with grad_out's strides)
        grad_out = grad_out.contiguous(memory_format=torch.channels_last)
        norm = norm._replace(y=norm.y.contiguous(memory_format=torch.channels_last))
    norm_key = norm and (norm.weight is not None, norm.activation, layout_key(norm.y))
    key = (geom, layout_key(grad_out), layout_key(x), dx is not None and layout_key(dx), config, runs, bias_grad,
           norm_key)
    plan = cached_plan(_GRAD_PLANS, key, lambda: _pixels_grad_plan(geom, grad_out, x, dx, config, runs, bias_grad,
                                                                   norm))
    partial = new_partial(plan, x.device)
    if dx is None:  # the weight gradient: rows of x under the taps, grad_out at the tiles
        launch(depthwise_grad_nhwc_pixels_kernel, plan, x, x, grad_out, x, partial)
    elif plan.kernel == "grad_nhwc_rows":
        norm_tensors = norm.tensors() if norm is not None else (grad_out,) * 6  # (unread without NORM)
        launch(depthwise_grad_nhwc_rows_kernel, plan, grad_out, weight, x, dx, partial, *norm_tensors)
    else:
        launch(depthwise_grad_nhwc_pixels_kernel, plan, grad_out, weight, x, dx, partial)
    # partial[slot, channel, tap]
    return weight_grad_sums(partial, geom, weight_dtype, bias_grad, partial.stride(1),
                            (partial.shape[0], partial.stride(0)))


_GRAD_PLANS = plan_cache()


def _image_row_strides(t: torch.Tensor) -> Tuple[int, int]:
    return t.stride(0), t.stride(2)


def _pixels_grad_plan(geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor, dx: Optional[torch.Tensor],
                      config: ForwardConfig, runs: Optional[int], bias_grad: bool,
                      norm: Optional[NormGrad] = None) -> LaunchPlan:
    grad_input = dx is not None
    assert not (grad_input and bias_grad), "the fused pass has no bias gradient"
    tile_geom = input_grad_geometry(geom) if grad_input else geom
    default_config, default_runs = pixels_grad_blocks(geom, x, grad_input, bias_grad)
    config = config or default_config
    if config.kernel == "nhwc_rows":
        assert grad_input, "the row-sliding pass is the fused backward's"
        return _rows_grad_plan(geom, tile_geom, grad_out, x, dx, config, norm)
    assert norm is None, "a BatchNorm's gradient is computed by the rows pass only"
    row_tiles = cdiv(tile_geom.out_h, config.block_h)
    runs = max(1, min(geom.batch * row_tiles, runs or default_runs))
    taps = geom.kernel_h * geom.kernel_w
    assert config.kernel == "nhwc_pixels" and config.block_h * config.block_w * taps <= tuned().max_pixel_taps, \
        "too many outputs x taps to unroll"
    # the swept tensor (src: grad_out for the fused pass, x for the weight gradient) and the one
    # read at the tiles' positions (q)
    src, q = (grad_out, x) if grad_input else (x, grad_out)
    scalars = (geom.out_channels, geom.batch, tile_geom.in_h, tile_geom.in_w, tile_geom.out_h, tile_geom.out_w,
               row_tiles, runs, *_image_row_strides(src), *_image_row_strides(q),
               *(_image_row_strides(dx) if grad_input else (0, 0)), tile_geom.pad_top, tile_geom.pad_left)
    src_pixel, q_pixel, dx_pixel = src.stride(3), q.stride(3), dx.stride(3) if grad_input else 1
    constants = dict(GRAD_INPUT=grad_input, MULTIPLIER=geom.multiplier, KH=geom.kernel_h, KW=geom.kernel_w,
                     STRIDE_H=tile_geom.stride_h, STRIDE_W=tile_geom.stride_w, DILATION_H=geom.dilation_h,
                     DILATION_W=geom.dilation_w, BIAS_GRAD=bias_grad, SRC_STRIDE_W=src_pixel, Q_STRIDE_W=q_pixel,
                     DX_STRIDE_W=dx_pixel,
                     INDEX_64=needs_int64(grad_out, x, *([dx] if grad_input else []), first_dim=1),
                     ACC_DTYPE=acc_dtype(x.dtype), BLOCK_H=config.block_h,
                     BLOCK_W=config.block_w, BLOCK_C=config.block_c,
                     BF16_PAIRS=bf16_pairs_apply(src, tile_geom, config.block_c, config.num_warps),
                     INTERIOR_TILES=(taps <= tuned().interior_branch_max_taps
                                     and tile_geom.has_interior_tile(config.block_h, config.block_w, config.block_c)),
                     num_warps=config.num_warps, num_stages=1)
    # a register cap lets 8 programs of 2 warps share an SM (spills past it; dilated layers lost)
    if (grad_input and x.element_size() == 2 and geom.dilation_h == geom.dilation_w == 1
            and tuned().nhwc_fused_half_maxnreg and gpu_plan(x.device)):
        constants["maxnreg"] = tuned().nhwc_fused_half_maxnreg
    tiles_w = cdiv(tile_geom.out_w, config.block_w)
    channel_blocks = cdiv(geom.out_channels, config.block_c)
    slots = tiles_w * runs  # (channel blocks share a slot)
    return LaunchPlan("grad_nhwc_pixels", (slots * channel_blocks,), scalars, constants,
                      (slots, geom.out_channels, taps + int(bias_grad)), partial_dtype(x.dtype))


def _rows_grad_plan(geom: ConvGeometry, tile_geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor,
                    dx: torch.Tensor, config: ForwardConfig, norm: Optional[NormGrad] = None) -> LaunchPlan:
    """depthwise_grad_nhwc_rows_kernel's launch: config.block_h rows a program (a segment of an image),
    strips of block_w columns by block_c channels; norm: grad_out computed from a BatchNorm's (NORM)."""
    assert config.block_w * geom.kernel_h * geom.kernel_w <= tuned().max_pixel_taps, \
        "too many outputs x taps to unroll"
    segments = cdiv(tile_geom.out_h, config.block_h)
    count = grad_out.numel() // geom.out_channels  # (the positions BatchNorm's statistics are over)
    scalars = (geom.out_channels, geom.batch, tile_geom.in_h, tile_geom.in_w, tile_geom.out_h, tile_geom.out_w,
               segments, config.block_h, *_image_row_strides(grad_out), *_image_row_strides(x),
               *_image_row_strides(dx), tile_geom.pad_top, tile_geom.pad_left, count if norm is not None else 1)
    src_pixel, q_pixel, dx_pixel = grad_out.stride(3), x.stride(3), dx.stride(3)
    constants = dict(KH=geom.kernel_h, KW=geom.kernel_w, DILATION_H=geom.dilation_h, DILATION_W=geom.dilation_w,
                     SRC_STRIDE_W=src_pixel, Q_STRIDE_W=q_pixel, DX_STRIDE_W=dx_pixel,
                     INDEX_64=needs_int64(grad_out, x, dx, first_dim=1), ACC_DTYPE=acc_dtype(x.dtype),
                     BLOCK_W=config.block_w, BLOCK_C=config.block_c,
                     # (the BatchNorm's gradient takes widened pixels of two tensors: no pair loads)
                     BF16_PAIRS=norm is None and bf16_pairs_apply(grad_out, tile_geom, config.block_c,
                                                                  config.num_warps),
                     PREFETCH=config.prefetch, NORM=norm is not None, NORM_AFFINE=norm is not None and norm.weight
                     is not None, NORM_ACTIVATION=0 if norm is None else norm.activation,
                     num_warps=config.num_warps, num_stages=1)
    slots = cdiv(tile_geom.out_w, config.block_w) * geom.batch * segments  # (channel blocks share a slot)
    return LaunchPlan("grad_nhwc_rows", (slots * cdiv(geom.out_channels, config.block_c),), scalars, constants,
                      (slots, geom.out_channels, geom.kernel_h * geom.kernel_w), partial_dtype(x.dtype))


def grad_weight_blocks(geom: ConvGeometry, x: torch.Tensor) -> GradWeightConfig:
    """depthwise_grad_weight_nhwc_kernel: tiles of 16 pixels by up to 64 channels; about 1024
    programs in all (each writes TAPS partial sums per channel: more programs, a larger second pass)."""
    block_c = min(64, next_power_of_2(geom.out_channels))
    block_w = min(16, next_power_of_2(geom.out_w))
    tiles = geom.batch * geom.out_h * cdiv(geom.out_w, block_w)
    programs = 1024 if gpu_plan(x.device) else 4  # (interpreter: the work is the same however it is split)
    splits = min(tiles, cdiv(programs, cdiv(geom.out_channels, block_c)))
    return GradWeightConfig(block_w, 4, 1, splits, block_c=block_c)


def grad_weight(geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor, config: Optional[GradWeightConfig],
                bias_grad: bool, weight_dtype: torch.dtype) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The channels_last weight gradient on depthwise_grad_weight_nhwc_kernel (kernels past the unrolled
    pixels' reach, and the interpreter)."""
    plan = cached_plan(_GRAD_PLANS, ("weight", geom, config, layout_key(grad_out), layout_key(x), bias_grad),
                       lambda: _grad_weight_plan(geom, config, grad_out, x, bias_grad))
    partial = new_partial(plan, x.device)
    launch(depthwise_grad_weight_nhwc_kernel, plan, grad_out, x, partial)
    return sum_partials(partial, geom, weight_dtype, bias_grad)  # (partial[out_c, split, padded taps])


def _grad_weight_plan(geom: ConvGeometry, config: Optional[GradWeightConfig], grad_out: torch.Tensor,
                      x: torch.Tensor, bias_grad: bool) -> LaunchPlan:
    if config is None:
        config = grad_weight_blocks(geom, x)
    tiles = geom.batch * geom.out_h * cdiv(geom.out_w, config.block_w)
    splits = max(1, min(config.splits, tiles))
    padded_taps = next_power_of_2(geom.kernel_h * geom.kernel_w + int(bias_grad))
    scalars = (geom.out_channels, geom.in_h, geom.in_w, geom.out_h, geom.out_w, tiles, splits,
               x.stride(0), x.stride(2), x.stride(3), grad_out.stride(0), grad_out.stride(2), grad_out.stride(3),
               geom.stride_h, geom.stride_w, geom.pad_top, geom.pad_left, geom.dilation_h, geom.dilation_w)
    constants = dict(MULTIPLIER=geom.multiplier, KH=geom.kernel_h, KW=geom.kernel_w, BIAS_GRAD=bias_grad,
                     INDEX_64=needs_int64(x, grad_out, first_dim=1), ACC_DTYPE=acc_dtype(x.dtype), TAPS=padded_taps,
                     BLOCK_W=config.block_w, BLOCK_C=config.block_c, num_warps=config.num_warps)
    return LaunchPlan("grad_weight_nhwc", (splits, cdiv(geom.out_channels, config.block_c)), scalars, constants,
                      (geom.out_channels, splits, padded_taps), partial_dtype(x.dtype))
