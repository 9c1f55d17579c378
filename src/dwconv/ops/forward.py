"""Forward depthwise conv2d: Triton kernels and their launcher.

Reading order: the kernels (a tile kernel for any geometry and layout: one channel a program for
NCHW, runs of channels along the contiguous axis for channels_last; a row-sliding kernel for
stride-1 NCHW rows), then `forward_config` (which kernel and block sizes), then `conv_forward`
(allocate, launch). Argument checking lives in dwconv._geometry; this layer trusts it.

Both kernels read the input through its four strides, so any strided input gives the right answer;
channels_last tensors (unit channel strides in and out) take the tile kernel's channel-run
configuration ("nhwc"). On
unit-stride rows the rows kernel loads 16-byte vectors and builds the shifted views in registers;
rows of 2 mod 4 elements are read and written from the vector boundary below their start
(docs/notes.md). A rows program computes output of one (n, out_channel) plane.
Offsets of a plane's base are 64-bit; offsets inside a plane (an image, for "nhwc") are 32-bit
unless the launcher sees that they can pass 2**31 (INDEX_64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._geometry import ConvGeometry, cdiv, next_power_of_2
from ._launch import (LaunchPlan, cached_plan, channels_last_kernel_applies, gpu_plan, launch, layout_key,
                      new_partial, plane_needs_int64)
from ._lanes import _lane, _pack4
from .large_fma import large_fma_applies, large_fma_forward, large_fma_forward_blocks
from .toeplitz import (toeplitz_applies, toeplitz_block_m, toeplitz_block_w, toeplitz_forward, toeplitz_num_warps,
                       toeplitz_out_rows)


@triton.jit
def _plane_pointers(x_ptr, y_ptr, plane, out_channels, MULTIPLIER: tl.constexpr,
                    x_stride_n, x_stride_c, y_stride_n, y_stride_c):
    """Base pointers of the input plane read and the output plane written by `plane`."""
    n = plane // out_channels
    out_c = plane % out_channels
    in_c = out_c // MULTIPLIER
    x_base = x_ptr + n.to(tl.int64) * x_stride_n + in_c.to(tl.int64) * x_stride_c
    y_base = y_ptr + n.to(tl.int64) * y_stride_n + out_c.to(tl.int64) * y_stride_c
    return x_base, y_base, out_c


@triton.jit
def _load_weights(ptrs, c_ok, ACC_DTYPE: tl.constexpr, MASKED: tl.constexpr):
    """One tap's (or the bias') [1, channels] values."""
    if MASKED:
        return tl.load(ptrs, mask=c_ok, other=0.0).to(ACC_DTYPE)
    return tl.load(ptrs).to(ACC_DTYPE)


@triton.jit
def _tap_weights(w_taps, w_stride_tap, c_ok, TAPS: tl.constexpr, ACC_DTYPE: tl.constexpr, MASKED: tl.constexpr):
    """Every tap's [1, channels] weights, as a tuple (MASKED: channels past the end give 0)."""
    weights = ()
    for tap in tl.static_range(TAPS):
        weights = weights + (_load_weights(w_taps + tap * w_stride_tap, c_ok, ACC_DTYPE, MASKED),)
    return weights


# Up to this many taps each "nhwc_pixels" branch (interior or edge tile) loads its own weights, the
# interior's unmasked: #84 bfloat16 1.19 -> 1.09 ms; past it the program loads them once before the
# branch: a 7x7 56x56 bfloat16 layer took 0.125 ms with per-branch loads against 0.115 (H200,
# docs/notes.md, session 10).
PER_BRANCH_WEIGHT_TAPS = tl.constexpr(9)


@triton.jit
def _branch_weights(program_weights, w_taps, w_stride_tap, c_ok, TAPS: tl.constexpr, ACC_DTYPE: tl.constexpr,
                    MASKED: tl.constexpr):
    """The weights a "nhwc_pixels" branch convolves with: its own up to PER_BRANCH_WEIGHT_TAPS taps,
    else program_weights (loaded before the branch)."""
    weights = program_weights
    if TAPS <= PER_BRANCH_WEIGHT_TAPS:
        weights = _tap_weights(w_taps, w_stride_tap, c_ok, TAPS, ACC_DTYPE, MASKED)
    return weights


@triton.jit
def _conv_band(x_base, w_taps, b_ptrs, y_base, w_stride_tap, first_row, out_cols, out_c, c_ok,
               in_h, in_w, out_h, out_w, x_stride_h, x_stride_w, y_stride_h, y_stride_w,
               stride_w, pad_top, pad_left, dilation_w, KH: tl.constexpr, KW: tl.constexpr,
               STRIDE_H: tl.constexpr, DILATION_H: tl.constexpr, HAS_BIAS: tl.constexpr, UNROLL: tl.constexpr,
               ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
               MASKED: tl.constexpr):
    """Computes and stores output rows first_row .. first_row + BLOCK_H - 1 of a [cols, channels]
    strip. UNROLL: the loops are unrolled over the band's input rows, and each input row's shifted
    pixels are loaded (and converted) once for all the output rows that use them, not once a tap;
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
                    x = tl.load(col_ptrs[kw] + in_row * x_stride_h, mask=tl.where(row_ok, col_oks[kw], False),
                                other=0.0).to(ACC_DTYPE)
                else:
                    x = tl.load(col_ptrs[kw] + in_row * x_stride_h).to(ACC_DTYPE)
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
                    col_ok = col_c_ok & (in_cols >= 0) & (in_cols < in_w)
                    x = tl.load(ptrs, mask=tl.where(row_ok, col_ok, False), other=0.0).to(ACC_DTYPE)
                else:
                    x = tl.load(ptrs).to(ACC_DTYPE)
                w = _load_weights(w_taps + (kh * KW + kw) * w_stride_tap, c_ok, ACC_DTYPE, MASKED)
                acc = tl.fma(x, w, acc)
        accs = (acc,)
    if HAS_BIAS:
        bias = _load_weights(b_ptrs, c_ok, ACC_DTYPE, MASKED)
    for j in tl.static_range(BLOCK_H):
        value = accs[j]
        if HAS_BIAS:
            value += bias
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
def _row_pixels(row_ptr, row_ok, first_in_col, in_w, c_ok, pairs_ok, COUNT: tl.constexpr, X_STRIDE_W: tl.constexpr,
                ACC_DTYPE: tl.constexpr, BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr, MASKED: tl.constexpr,
                ROW_MASKED: tl.constexpr, WIDEN: tl.constexpr = True):
    """COUNT pixels of an input row from row_ptr (pixel p at p * X_STRIDE_W; [1, BLOCK_C] channel
    vectors in ACC_DTYPE) as a tuple. MASKED: zero outside the row's columns, the channels or the
    image's rows (row_ok); ROW_MASKED: only the row and channel tests (columns inside).
    BF16_PAIRS: bfloat16 channel pairs load as one 32-bit word (the launcher checks alignment).
    WIDEN False: the loaded values as they are, for _widen_pixels later (a load in flight)."""
    if BF16_PAIRS:
        row_pairs = tl.split(tl.reshape(row_ptr, [1, BLOCK_C // 2, 2]))[0].to(tl.pointer_type(tl.int32))
    pixels = ()  # (one no output reads is dropped by the compiler)
    for p in tl.static_range(COUNT):
        if MASKED:  # (tl.where, not &, in the masks: the interpreter makes a scalar bool & a bool tensor int32)
            pixel_ok = row_ok & (first_in_col + p >= 0) & (first_in_col + p < in_w)
        if BF16_PAIRS:
            if MASKED:
                x = tl.load(row_pairs + p * (X_STRIDE_W // 2), mask=tl.where(pixel_ok, pairs_ok, False), other=0)
            elif ROW_MASKED:
                x = tl.load(row_pairs + p * (X_STRIDE_W // 2), mask=tl.where(row_ok, pairs_ok, False), other=0)
            else:
                x = tl.load(row_pairs + p * (X_STRIDE_W // 2))
        else:
            if MASKED:
                x = tl.load(row_ptr + p * X_STRIDE_W, mask=tl.where(pixel_ok, c_ok, False), other=0.0)
            elif ROW_MASKED:
                x = tl.load(row_ptr + p * X_STRIDE_W, mask=tl.where(row_ok, c_ok, False), other=0.0)
            else:
                x = tl.load(row_ptr + p * X_STRIDE_W)
        pixels = pixels + (x,)
    if WIDEN:
        pixels = _widen_pixels(pixels, ACC_DTYPE, BLOCK_C, BF16_PAIRS)
    return pixels


@triton.jit
def _widen_pixels(loaded, ACC_DTYPE: tl.constexpr, BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr):
    """_row_pixels' loaded values in ACC_DTYPE. bfloat16 pairs (32-bit words) widen by a shift and a
    mask (the compiler's conversion takes three instructions a pair)."""
    pixels = ()
    for p in tl.static_range(len(loaded)):
        if BF16_PAIRS:
            pair = loaded[p]
            pixels = pixels + (tl.reshape(tl.join((pair << 16).to(tl.float32, bitcast=True),
                                                  (pair & -65536).to(tl.float32, bitcast=True)), [1, BLOCK_C]),)
        else:
            pixels = pixels + (loaded[p].to(ACC_DTYPE),)
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
def _store_pixels(y_strip, accs, first_row, first_col, c_ok, out_h, out_w, y_stride_h, Y_STRIDE_W: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, MASKED: tl.constexpr):
    """Stores a tile's outputs (accs, row-major) from y_strip, its first column's pointer."""
    for j in tl.static_range(BLOCK_H):
        for i in tl.static_range(BLOCK_W):
            value = accs[j * BLOCK_W + i]
            ptrs = y_strip + (first_row + j) * y_stride_h + i * Y_STRIDE_W
            if MASKED:
                out_ok = (first_row + j < out_h) & (first_col + i < out_w)
                tl.store(ptrs, value.to(y_strip.dtype.element_ty), mask=tl.where(out_ok, c_ok, False))
            else:
                tl.store(ptrs, value.to(y_strip.dtype.element_ty))


@triton.jit
def _conv_pixels(x_base, weights, b_ptrs, y_base, first_row, first_col, c_ok,
                 in_h, in_w, out_h, out_w, x_stride_h, X_STRIDE_W: tl.constexpr, y_stride_h, Y_STRIDE_W: tl.constexpr,
                 pad_top, pad_left,
                 KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, DILATION_H: tl.constexpr,
                 STRIDE_W: tl.constexpr, DILATION_W: tl.constexpr, HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr,
                 MASKED: tl.constexpr, OUTPUTS: tl.constexpr, WEIGHT_GRAD: tl.constexpr, weight_grads,
                 inputs_at_outputs):
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
    forward's input, inputs_at_outputs grad_out. Else returns weight_grads as given."""
    first_in_row = first_row * STRIDE_H - pad_top
    first_in_col = first_col * STRIDE_W - pad_left
    start = tl.zeros([1, BLOCK_C], dtype=ACC_DTYPE)
    if HAS_BIAS:  # (accumulating onto the bias saves an add an output)
        start += _load_weights(b_ptrs, c_ok, ACC_DTYPE, MASKED)
    accs = ()
    for i in tl.static_range(BLOCK_H * BLOCK_W):
        accs = accs + (start,)
    # pointers to the strip's first pixel, and pixels at constant offsets from them (immediate
    # offsets of the loads and stores on the GPU)
    x_strip = x_base + first_in_col * X_STRIDE_W
    y_strip = y_base + first_col * Y_STRIDE_W
    pairs_ok = _pairs_ok(c_ok, BLOCK_C, BF16_PAIRS)
    for r in tl.static_range((BLOCK_H - 1) * STRIDE_H + (KH - 1) * DILATION_H + 1):
        in_row = first_in_row + r
        row_ptr = x_strip + in_row * x_stride_h
        row_ok = (in_row >= 0) & (in_row < in_h)
        pixels = _row_pixels(row_ptr, row_ok, first_in_col, in_w, c_ok, pairs_ok,
                             (BLOCK_W - 1) * STRIDE_W + (KW - 1) * DILATION_W + 1, X_STRIDE_W, ACC_DTYPE, BLOCK_C,
                             BF16_PAIRS, MASKED, False)
        accs, weight_grads = _row_taps(pixels, r, weights, accs, weight_grads, inputs_at_outputs, KH, KW, STRIDE_H,
                                       DILATION_H, STRIDE_W, DILATION_W, BLOCK_H, BLOCK_W, OUTPUTS, WEIGHT_GRAD)
    if OUTPUTS:
        _store_pixels(y_strip, accs, first_row, first_col, c_ok, out_h, out_w, y_stride_h, Y_STRIDE_W, BLOCK_H,
                      BLOCK_W, MASKED)
    return weight_grads


@triton.jit
def _tile_pixels(base, first_row, first_col, c_ok, rows, cols, stride_h, STRIDE_W: tl.constexpr,
                 ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, MASKED: tl.constexpr):
    """A tile's BLOCK_H x BLOCK_W pixels ([1, channels] each, zero outside rows x cols or the
    channels), as a tuple in row-major order."""
    pixels = ()
    for j in tl.static_range(BLOCK_H):
        for i in tl.static_range(BLOCK_W):
            ptrs = base + (first_row + j) * stride_h + (first_col + i) * STRIDE_W
            if MASKED:
                inside = (first_row + j < rows) & (first_col + i < cols)
                pixel = tl.load(ptrs, mask=tl.where(inside, c_ok, False), other=0.0)
            else:
                pixel = tl.load(ptrs)
            pixels = pixels + (pixel.to(ACC_DTYPE),)
    return pixels


# pad_left is not specialised: were it known to be 0 (a multiple of 16), the unshifted load would get
# a 4-wide register layout while the shifted loads and the row stores (rows of odd length) get 1-wide
# ones, and Triton would convert between them through shared memory on every row.
@triton.jit(do_not_specialize=["pad_left"])
def depthwise_fwd_tile_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    out_channels, in_h, in_w, out_h, out_w,
    x_stride_n, x_stride_c, x_stride_h, x_stride_w,
    y_stride_n, y_stride_c, y_stride_h, y_stride_w,
    w_stride_c, w_stride_tap, w_first_tap,
    stride_w, pad_top, pad_left, dilation_w,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr,
    DILATION_H: tl.constexpr, HAS_BIAS: tl.constexpr, UNROLL: tl.constexpr, INDEX_64: tl.constexpr,
    ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
    PIXELS: tl.constexpr, PIXEL_STRIDE_W: tl.constexpr, PIXEL_DILATION_W: tl.constexpr,
    PIXEL_X_STRIDE_W: tl.constexpr, PIXEL_Y_STRIDE_W: tl.constexpr, BF16_PAIRS: tl.constexpr,
    INTERIOR_TILES: tl.constexpr,
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
    offsets from a row's).
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
        program_weights = ()
        if KH * KW > PER_BRANCH_WEIGHT_TAPS:
            program_weights = _tap_weights(w_taps, w_stride_tap, c_ok, KH * KW, ACC_DTYPE, True)
        if interior:
            weights = _branch_weights(program_weights, w_taps, w_stride_tap, c_ok, KH * KW, ACC_DTYPE, False)
            _conv_pixels(x_base, weights, b_ptr + out_c, y_base, first_row, first_col, c_ok, in_h, in_w,
                         out_h, out_w, x_stride_h, PIXEL_X_STRIDE_W, y_stride_h, PIXEL_Y_STRIDE_W, pad_top, pad_left,
                         KH, KW, STRIDE_H, DILATION_H, PIXEL_STRIDE_W, PIXEL_DILATION_W, HAS_BIAS, ACC_DTYPE, BLOCK_H,
                         BLOCK_W, BLOCK_C, BF16_PAIRS, False, True, False, (), ())
        else:
            weights = _branch_weights(program_weights, w_taps, w_stride_tap, c_ok, KH * KW, ACC_DTYPE, True)
            _conv_pixels(x_base, weights, b_ptr + out_c, y_base, first_row, first_col, c_ok, in_h, in_w,
                         out_h, out_w, x_stride_h, PIXEL_X_STRIDE_W, y_stride_h, PIXEL_Y_STRIDE_W, pad_top, pad_left,
                         KH, KW, STRIDE_H, DILATION_H, PIXEL_STRIDE_W, PIXEL_DILATION_W, HAS_BIAS, ACC_DTYPE, BLOCK_H,
                         BLOCK_W, BLOCK_C, BF16_PAIRS, True, True, False, (), ())
    else:  # (BLOCK_W a power of 2 here; "nhwc_pixels" takes any)
        out_cols = first_col + tl.arange(0, BLOCK_W)[:, None]
        if interior:
            _conv_band(x_base, w_taps, b_ptr + out_c, y_base, w_stride_tap, first_row, out_cols, out_c, c_ok,
                       in_h, in_w, out_h, out_w, x_stride_h, x_stride_w, y_stride_h, y_stride_w, stride_w, pad_top,
                       pad_left, dilation_w, KH, KW, STRIDE_H, DILATION_H, HAS_BIAS, UNROLL, ACC_DTYPE, BLOCK_H,
                       BLOCK_W, BLOCK_C, False)
        else:
            _conv_band(x_base, w_taps, b_ptr + out_c, y_base, w_stride_tap, first_row, out_cols, out_c, c_ok,
                       in_h, in_w, out_h, out_w, x_stride_h, x_stride_w, y_stride_h, y_stride_w, stride_w, pad_top,
                       pad_left, dilation_w, KH, KW, STRIDE_H, DILATION_H, HAS_BIAS, UNROLL, ACC_DTYPE, BLOCK_H,
                       BLOCK_W, BLOCK_C, True)


@triton.jit
def _window_lane(w0, w1, w2, w3, i: tl.constexpr, VEC: tl.constexpr):
    """Lane i of the window w0|w1|w2|w3 (consecutive VEC-vectors a thread holds)."""
    v = w0
    if i // VEC == 1:
        v = w1
    if i // VEC == 2:
        v = w2
    if i // VEC == 3:
        v = w3
    return _lane(v, i % VEC, VEC)


@triton.jit
def _window_view(w0, w1, w2, w3, start: tl.constexpr, VEC: tl.constexpr):
    """Lanes start .. start+VEC-1 of the window as one [R, G, VEC] vector: a shifted view of
    the input row built in registers."""
    if VEC == 4:
        view = _pack4(_window_lane(w0, w1, w2, w3, start, VEC), _window_lane(w0, w1, w2, w3, start + 1, VEC),
                      _window_lane(w0, w1, w2, w3, start + 2, VEC), _window_lane(w0, w1, w2, w3, start + 3, VEC))
    else:  # 8 lanes: lane 2q + c
        even = _pack4(_window_lane(w0, w1, w2, w3, start, VEC), _window_lane(w0, w1, w2, w3, start + 2, VEC),
                      _window_lane(w0, w1, w2, w3, start + 4, VEC), _window_lane(w0, w1, w2, w3, start + 6, VEC))
        odd = _pack4(_window_lane(w0, w1, w2, w3, start + 1, VEC), _window_lane(w0, w1, w2, w3, start + 3, VEC),
                     _window_lane(w0, w1, w2, w3, start + 5, VEC), _window_lane(w0, w1, w2, w3, start + 7, VEC))
        view = tl.reshape(tl.join(even, odd), [even.shape[0], even.shape[1], 8])
    return view


@triton.jit
def _widen_bf16(v):
    """bfloat16 -> float32 by integer operations, which the compiler turns into one shift or mask of
    each 32-bit register holding two elements (a conversion costs the upper element two, sm_90:
    PRMT + SHF; #84's rows kernel loop 656 -> 623 instructions)."""
    return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _load_window_vector(x_row, first_cols, lanes, row_ok, in_w, SHIFT: tl.constexpr, WHOLE: tl.constexpr,
                        VEC: tl.constexpr, EVICT: tl.constexpr, MASKED: tl.constexpr, WIDEN_BF16: tl.constexpr):
    """One aligned vector of an input row per thread: elements x_row + first_cols + lanes, which are
    row columns first_cols - SHIFT + lanes (SHIFT > 0: x_row is the row start moved back to a vector
    boundary). WHOLE: the vector is loaded whole when it overlaps the row (a mask uniform over the
    vector keeps the load vectorised when the row length is not a multiple of VEC), and the lanes
    outside the row are zeroed after. MASKED False: the caller knows the vector inside the row.
    WIDEN_BF16 (bfloat16 rows): returned in float32, widened by _widen_bf16."""
    cols = first_cols + lanes
    if not MASKED:
        vector = tl.load(x_row + cols, eviction_policy=EVICT)
    elif WHOLE:
        first = first_cols - SHIFT
        vector = tl.load(x_row + cols, mask=row_ok & (first + VEC > 0) & (first < in_w), other=0.0,
                         eviction_policy=EVICT)
        vector = tl.where((cols - SHIFT >= 0) & (cols - SHIFT < in_w), vector, 0.0)
    else:
        vector = tl.load(x_row + cols, mask=row_ok & (cols >= 0) & (cols < in_w), other=0.0, eviction_policy=EVICT)
    if WIDEN_BF16:
        vector = _widen_bf16(vector)
    return vector


@triton.jit
def _load_row_window(x_row, group_cols, lanes, row_ok, in_w, WINDOW_OFF: tl.constexpr, WINDOW_VECS: tl.constexpr,
                     VEC: tl.constexpr, SHIFT: tl.constexpr, WHOLE: tl.constexpr, EVICT: tl.constexpr,
                     MASKED: tl.constexpr, WIDEN_BF16: tl.constexpr):
    """The WINDOW_VECS aligned vectors (from column group_cols - WINDOW_OFF - SHIFT) holding every
    input column a thread's VEC outputs read from this row; unused ones repeat the first. VEC == 1:
    no window (placeholders; `_row_under_tap` loads each tap itself). MASKED False: the caller
    knows the window inside the row (no bounds tests). WIDEN_BF16: the window comes back in float32
    (_widen_bf16). No defaults: Triton 3.6 hands
    a jit helper's str default over as a plain str and fails to compile (session 4)."""
    if VEC == 1:  # (a compile-time branch: one return, whose types may differ between VECs)
        w0 = lanes
    else:
        w0 = _load_window_vector(x_row, group_cols - WINDOW_OFF, lanes, row_ok, in_w, SHIFT, WHOLE, VEC, EVICT,
                                 MASKED, WIDEN_BF16)
    w1 = w0
    w2 = w0
    w3 = w0
    if VEC > 1 and WINDOW_VECS > 1:
        w1 = _load_window_vector(x_row, group_cols - WINDOW_OFF + VEC, lanes, row_ok, in_w, SHIFT, WHOLE, VEC, EVICT,
                                 MASKED, WIDEN_BF16)
    if VEC > 1 and WINDOW_VECS > 2:
        w2 = _load_window_vector(x_row, group_cols - WINDOW_OFF + 2 * VEC, lanes, row_ok, in_w, SHIFT, WHOLE, VEC,
                                 EVICT, MASKED, WIDEN_BF16)
    if VEC > 1 and WINDOW_VECS > 3:
        w3 = _load_window_vector(x_row, group_cols - WINDOW_OFF + 3 * VEC, lanes, row_ok, in_w, SHIFT, WHOLE, VEC,
                                 EVICT, MASKED, WIDEN_BF16)
    return w0, w1, w2, w3


@triton.jit
def _row_under_tap(x_row, w0, w1, w2, w3, out_cols, row_ok, in_w, stride_w, pad_left, x_stride_w,
                   kw: tl.constexpr, DILATION_W: tl.constexpr, WINDOW_LANE0: tl.constexpr, VEC: tl.constexpr):
    """The input value kernel column kw meets at each output column [1, G, VEC] of this row: a
    shifted view of the window (VEC > 1), or its own load (VEC == 1, any stride_w)."""
    if VEC > 1:
        x = _window_view(w0, w1, w2, w3, WINDOW_LANE0 + kw * DILATION_W, VEC)
    else:
        in_cols = out_cols * stride_w - pad_left + kw * DILATION_W
        x = tl.load(x_row + in_cols * x_stride_w, mask=row_ok & (in_cols >= 0) & (in_cols < in_w), other=0.0)
    return x


@triton.jit
def _store_aligned_rows(ptrs, values, first, lanes, rows_ok, out_w, VEC: tl.constexpr, STORE_CACHE: tl.constexpr):
    """Stores VEC-vectors whose lane 0 is row column `first` (ptrs: from the vector boundary at or
    below each row's start, so every vector is aligned): whole where the vector lies inside the
    row, else as the pairs inside it (rows of even width; the odd-row alignments' row ends)."""
    tl.store(ptrs, values, mask=rows_ok & (first >= 0) & (first + VEC <= out_w), cache_modifier=STORE_CACHE)
    pair_first = first + (lanes // 2) * 2
    ends = rows_ok & ((first < 0) | (first + VEC > out_w)) & (pair_first >= 0) & (pair_first + 2 <= out_w)
    tl.store(ptrs, values, mask=ends, cache_modifier=STORE_CACHE)


@triton.jit(do_not_specialize=["pad_left"])
def depthwise_fwd_rows_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, f_ptr, partial_ptr,
    out_channels, in_h, in_w, out_h, out_w,
    x_stride_n, x_stride_c, x_stride_h, x_stride_w,
    y_stride_n, y_stride_c, y_stride_h, y_stride_w,
    f_stride_n, f_stride_c, f_stride_h,
    stride_w, pad_top, pad_left, rows_per_program,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    DILATION_H: tl.constexpr, DILATION_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, INDEX_64: tl.constexpr, ACC_DTYPE: tl.constexpr,
    SLOTS: tl.constexpr, TAPS: tl.constexpr, BLOCK_W: tl.constexpr,
    VEC: tl.constexpr, WINDOW_OFF: tl.constexpr, WINDOW_LANE0: tl.constexpr, WINDOW_VECS: tl.constexpr,
    X_UNIT: tl.constexpr, Y_UNIT: tl.constexpr, ODD_ROW_ALIGN: tl.constexpr, PAD_TOP_ODD: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, F_UNIT: tl.constexpr, FLIP_TAPS: tl.constexpr, ODD_OUT_ALIGN: tl.constexpr = 0,
    EVICT: tl.constexpr = "", STORE_CACHE: tl.constexpr = "", WIDEN_BF16: tl.constexpr = False,
):
    """Row sliding for stride_h == 1: a program walks down a column strip of one plane,
    loading each input row once and adding it into the partial sums of every output row it
    touches. Partial rows live in a ring of SLOTS register rows (SLOTS >= DILATION_H*(KH-1)+1,
    a power of two); output row r lives in slot r % SLOTS. The row loop is unrolled SLOTS times
    from a multiple of SLOTS, so which slot gets which tap, and which slot is finished, are
    compile-time constants: the ring costs no indexing.

    Columns are [groups, VEC]: a thread owns VEC adjacent output columns. With VEC == 1 each
    of the KW shifted views of an input row is its own (4-byte) load. With VEC == 4 (stride_w
    1) a thread loads WINDOW_VECS aligned 4-vectors covering every input column its outputs
    read (from column group_start - WINDOW_OFF) and builds the KW shifted views from them in
    registers: 16-byte loads instead of VEC * KW scalar ones.
    Widths and strides of x (y) arrive divided by X_UNIT (Y_UNIT), the largest power of two up
    to VEC dividing all of them, so that the compiler can prove the alignment of vector accesses.

    FLIP_TAPS: convolve with the weight's taps in reverse (grad_input: the flipped weight, read in
    place instead of copied).

    WEIGHT_GRAD (the fused backward, stride 1, multiplier 1): this launch is grad_input, i.e. x is
    grad_out and the weight is flipped (FLIP_TAPS); f is the forward's input, of y's shape. Padded grad_out row
    j also meets f rows j - reach + kh*DILATION_H (the rows the ring holds), and the view for the
    flipped tap KW-1-kw pairs with f at the program's own columns, so the program adds those
    products into per-tap registers: grad_weight[kh, kw] partial sums, stored per program in
    partial[pid, TAPS]. Each grad_out row is counted by one chunk only.

    ODD_OUT_ALIGN (VEC 4; output rows of 2 mod 4 elements in planes of whole vectors, even SLOTS):
    odd output rows start 2 elements past a vector boundary, so on odd rows (odd slots) group g
    holds columns 4g-2 .. 4g+1 instead of 4g .. 4g+3 (views 2 lanes to the left in a window one
    vector wider) and stores them as one aligned vector; the 2-column pieces at the row ends go
    out as pairs.

    EVICT / STORE_CACHE: cache hints for the input loads and output stores ("evict_first" / ".cs":
    each row is read and written once), chosen by ForwardConfig.stream.

    WIDEN_BF16 (bfloat16 windows): widened to float32 by integer operations (_widen_bf16).
    """
    in_w = in_w * X_UNIT
    out_w = out_w * Y_UNIT
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(out_w, BLOCK_W)
    chunks = tl.cdiv(out_h, rows_per_program)
    plane = pid // (chunks * tiles_w)
    strip = pid % (chunks * tiles_w)
    x_base, y_base, out_c = _plane_pointers(x_ptr, y_ptr, plane, out_channels, MULTIPLIER,
                                            x_stride_n * X_UNIT, x_stride_c * X_UNIT,
                                            y_stride_n * Y_UNIT, y_stride_c * Y_UNIT)
    first_row = (strip // tiles_w) * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, out_h)  # exclusive

    # Every tensor is 3-D ([1, GROUPS, VEC] rows, [SLOTS, 1, 1] weights) so that all share one
    # register layout: rows broadcast into the ring from another rank cost a shared-memory
    # layout conversion per load.
    GROUPS: tl.constexpr = BLOCK_W // VEC
    group_cols = (strip % tiles_w) * BLOCK_W + VEC * tl.arange(0, GROUPS)[None, :, None]
    lanes = tl.arange(0, VEC)[None, None, :]
    if INDEX_64:
        group_cols = group_cols.to(tl.int64)
    out_cols = group_cols + lanes
    col_ok = out_cols < out_w
    slots = tl.arange(0, SLOTS)[:, None, None]
    taps = tl.arange(0, TAPS)[None, None, :]
    weight_taps = taps
    if FLIP_TAPS:
        weight_taps = KH * KW - 1 - taps
    weights = tl.load(w_ptr + out_c * (KH * KW) + weight_taps, mask=taps < KH * KW, other=0.0).to(ACC_DTYPE)
    reach: tl.constexpr = DILATION_H * (KH - 1)  # out row r is complete once padded row r + reach is in
    ODD_SHIFT: tl.constexpr = 2 * (ODD_ROW_ALIGN > 0)  # elements odd rows start past a vector boundary
    if ODD_ROW_ALIGN > 0:  # element offset of the plane: a multiple of 4 (written so the compiler sees it)
        x_plane_offset = (((plane // out_channels).to(tl.int64) * x_stride_n
                           + ((plane % out_channels) // MULTIPLIER).to(tl.int64) * x_stride_c) * X_UNIT // 4) * 4

    if ODD_OUT_ALIGN > 0:
        odd_slots = (slots % 2) == 1  # slot parity is output row parity (SLOTS is even)
        y_plane_offset = (((plane // out_channels).to(tl.int64) * y_stride_n
                           + (plane % out_channels).to(tl.int64) * y_stride_c) * Y_UNIT // 4) * 4

    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + out_c).to(ACC_DTYPE)
    # Each ring slot starts at the bias: no add at the store (adding 0.0 is not a no-op to the compiler).
    acc = tl.zeros([SLOTS, GROUPS, VEC], dtype=ACC_DTYPE) + bias
    finished = tl.zeros([SLOTS, GROUPS, VEC], dtype=ACC_DTYPE)
    if WEIGHT_GRAD:
        weight_taps = tl.arange(0, TAPS)[:, None, None]  # the tap axis each thread holds whole
        weight_grad = tl.zeros([TAPS, GROUPS, VEC], dtype=ACC_DTYPE)
        f_plane = f_ptr + (plane // out_channels).to(tl.int64) * (f_stride_n * F_UNIT) \
            + (plane % out_channels).to(tl.int64) * (f_stride_c * F_UNIT)
    # Row indices are [1, 1, 1] tensors so that masks stay tensors (the interpreter mishandles
    # scalar & tensor); the body has no branch, so the loads of all SLOTS rows can be in flight.
    if INDEX_64:
        zero = tl.zeros([1, 1, 1], dtype=tl.int64)
    else:
        zero = tl.zeros([1, 1, 1], dtype=tl.int32)
    if WEIGHT_GRAD:
        last_chunk = (zero + last_row) >= out_h
    # j is the input row in padded coordinates: out row r reads padded rows r + kh*DILATION_H.
    for j0 in range(first_row - first_row % SLOTS, last_row + reach, SLOTS):
        for phase in tl.static_range(SLOTS):
            j = zero + (j0 + phase)
            in_row = j - pad_top
            row_ok = (in_row >= 0) & (in_row < in_h)  # padding rows add nothing
            # slot s holds out row j - delta, delta = (phase - s) % SLOTS; a tap applies where
            # delta = kh*DILATION_H. Loop-invariant: hoisted out of the loop by the compiler.
            delta = (phase - slots + SLOTS) % SLOTS
            kh = delta // DILATION_H
            tap_ok = (delta % DILATION_H == 0) & (kh < KH)
            x_row = x_base + in_row * (x_stride_h * X_UNIT)
            # ODD_ROW_ALIGN (1: on): rows of 2 mod 4 elements in planes of whole vectors, so odd rows
            # start 2 elements past a vector boundary; their window starts 2 elements earlier,
            # aligned. The row parity is static: j0 is even (SLOTS is).
            if ODD_ROW_ALIGN > 0:  # the row start rounded down to a vector (a no-op on even rows)
                x_row = x_ptr + ((x_plane_offset + in_row * (x_stride_h * X_UNIT)) // 4) * 4
            w0, w1, w2, w3 = _load_row_window(x_row, group_cols, lanes, row_ok, in_w, WINDOW_OFF, WINDOW_VECS, VEC,
                                              ODD_SHIFT * ((phase + PAD_TOP_ODD) % 2), ODD_ROW_ALIGN > 0, EVICT, True,
                                              WIDEN_BF16)
            for kw in tl.static_range(KW):
                x = _row_under_tap(x_row, w0, w1, w2, w3, out_cols, row_ok, in_w, stride_w, pad_left, x_stride_w,
                                   kw, DILATION_W, WINDOW_LANE0 + ODD_SHIFT * ((phase + PAD_TOP_ODD) % 2), VEC)
                if ODD_OUT_ALIGN > 0:  # odd output rows: the view 2 columns to the left
                    x = tl.where(odd_slots, _window_view(w0, w1, w2, w3, WINDOW_LANE0 - 2 + kw * DILATION_W, VEC), x)
                tap_weight = tl.sum(tl.where(taps == kh * KW + kw, weights, 0.0), axis=2, keep_dims=True)
                # Select the sum, not the weight: tap_ok is constant per register, so the slots it
                # leaves out cost nothing (a zero weight was still an FMA: 0 * x may be NaN, so
                # the compiler keeps it; a quarter of #84's FMAs, sm_90).
                acc = tl.where(tap_ok, acc + tap_weight * x.to(ACC_DTYPE), acc)
            if WEIGHT_GRAD:  # this chunk counts padded rows [first_row, last_row), the last one the rest
                counted = (j >= first_row) & ((j < last_row) | last_chunk)
                for f_kh in tl.static_range(KH):
                    f_row = j - reach + f_kh * DILATION_H
                    f_ok = counted & (f_row >= 0) & (f_row < out_h) & col_ok
                    f = tl.load(f_plane + f_row * (f_stride_h * F_UNIT) + out_cols, mask=f_ok, other=0.0)
                    for kw in tl.static_range(KW):
                        g = _row_under_tap(x_row, w0, w1, w2, w3, out_cols, row_ok, in_w, stride_w, pad_left,
                                           x_stride_w, KW - 1 - kw, DILATION_W,
                                           WINDOW_LANE0 + ODD_SHIFT * ((phase + PAD_TOP_ODD) % 2), VEC)
                        weight_grad = tl.where(weight_taps == f_kh * KW + kw,
                                               weight_grad + g.to(ACC_DTYPE) * f.to(ACC_DTYPE), weight_grad)
            # park the finished row; the ring slot starts the row SLOTS further down
            done_slot = slots == (phase - reach % SLOTS + SLOTS) % SLOTS
            finished = tl.where(done_slot, acc, finished)
            acc = tl.where(done_slot, bias, acc)
        # One store per step, after all its loads: a store between rows would keep the compiler
        # from issuing the next row's loads early (x and y might alias), one row in flight at a time.
        # Slot s finished out row j0 - reach + ((s + reach) % SLOTS), as j0 is a multiple of SLOTS.
        done = zero + (j0 - reach) + (slots + reach) % SLOTS  # 64-bit when INDEX_64
        if ODD_OUT_ALIGN > 0:  # rows addressed from the vector boundary at or below their start
            y_row = y_ptr + ((y_plane_offset + done * (y_stride_h * Y_UNIT)) // 4) * 4
            first = group_cols - 2 * odd_slots  # the row column of the group's lane 0
            _store_aligned_rows(y_row + out_cols, finished.to(y_ptr.dtype.element_ty), first, lanes,
                                (done >= first_row) & (done < last_row), out_w, VEC, STORE_CACHE)
        else:
            store_ok = col_ok & (done >= first_row) & (done < last_row)
            tl.store(y_base + done * (y_stride_h * Y_UNIT) + out_cols * y_stride_w,
                     finished.to(y_ptr.dtype.element_ty), mask=store_ok, cache_modifier=STORE_CACHE)
    if WEIGHT_GRAD:
        tap_ids = tl.arange(0, TAPS)
        tl.store(partial_ptr + pid.to(tl.int64) * TAPS + tap_ids, tl.sum(tl.sum(weight_grad, axis=2), axis=1),
                 mask=tap_ids < KH * KW)


@triton.jit
def depthwise_fwd_pairs_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    out_channels, in_h, in_w, out_h, out_w,
    x_stride_n, x_stride_c, x_stride_h, y_stride_n, y_stride_c, y_stride_h,
    stride_h, pad_top, dilation_h,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, PAD_LEFT: tl.constexpr,
    HAS_BIAS: tl.constexpr, FLIP_TAPS: tl.constexpr, INDEX_64: tl.constexpr,
    ACC_DTYPE: tl.constexpr, X_UNIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Column stride 2, column dilation 1, unit column steps in x and y (NCHW): one program =
    BLOCK_H x BLOCK_W outputs of one plane. Output column c reads input column 2c + o through tap kw,
    o = kw - PAD_LEFT: the pair (2(c + o // 2), +1) holds it, even or odd by o's parity, and
    neighbouring taps share pairs. So each kernel row loads the pairs its taps fall in, as rows of
    2 x BLOCK_W contiguous columns (3x3 with padding 1: two loads for three taps), and splits them,
    where strided loads read every other element (half of each load instruction's bytes). x's widths
    and strides in X_UNITs (up to 4: the rows then load as aligned 16-byte vectors in float32)."""
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(out_w, BLOCK_W)
    tiles = tl.cdiv(out_h, BLOCK_H) * tiles_w
    plane = pid // tiles
    tile = pid % tiles
    n = (plane // out_channels).to(tl.int64)
    out_c = plane % out_channels
    x_base = x_ptr + (n * x_stride_n + (out_c // MULTIPLIER).to(tl.int64) * x_stride_c) * X_UNIT
    y_base = y_ptr + n * y_stride_n + out_c.to(tl.int64) * y_stride_c
    out_rows = (tile // tiles_w) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    out_cols = (tile % tiles_w) * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
    if INDEX_64:
        out_rows = out_rows.to(tl.int64)
        out_cols = out_cols.to(tl.int64)
    in_w = in_w * X_UNIT
    row_cols = 2 * (tile % tiles_w) * BLOCK_W + tl.arange(0, 2 * BLOCK_W)[None, :]  # (the pairs' columns, in a row)
    acc = tl.zeros([BLOCK_H, BLOCK_W], dtype=ACC_DTYPE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + out_c).to(ACC_DTYPE)
    w_plane = w_ptr + out_c * (KH * KW)
    for kh in tl.static_range(KH):
        in_rows = out_rows * stride_h - pad_top + kh * dilation_h
        x_row = x_base + in_rows * (x_stride_h * X_UNIT)
        row_ok = (in_rows >= 0) & (in_rows < in_h) & (out_rows < out_h)
        for kw in tl.static_range(KW):
            # tap kw's pair (floor division of constexprs); a load where it differs from tap kw - 1's
            if kw == 0 or (kw - PAD_LEFT) // 2 != (kw - 1 - PAD_LEFT) // 2:
                # (loaded as rows, contiguous along them, then split: a [rows, columns, 2] load takes a
                # layout with threads across rows)
                cols = row_cols + 2 * ((kw - PAD_LEFT) // 2)
                pairs = tl.load(x_row + cols, mask=row_ok & (cols >= 0) & (cols < in_w), other=0.0)
                even, odd = tl.split(tl.reshape(pairs, [BLOCK_H, BLOCK_W, 2]))
            tap = KH * KW - 1 - (kh * KW + kw) if FLIP_TAPS else kh * KW + kw
            weight = tl.load(w_plane + tap).to(ACC_DTYPE)
            if (kw - PAD_LEFT) % 2 == 0:
                acc += weight * even.to(ACC_DTYPE)
            else:
                acc += weight * odd.to(ACC_DTYPE)
    tl.store(y_base + out_rows * y_stride_h + out_cols, acc.to(y_ptr.dtype.element_ty),
             mask=(out_rows < out_h) & (out_cols < out_w))


# ---- choosing and launching -------------------------------------------------------------------

@triton.jit
def _conv_nchw_pixels(x_base, y_base, weights, start, first_row, group_cols, lanes, zero, in_h, in_w, out_h, out_w,
                      x_stride_h, y_stride_h, pad_top, KH: tl.constexpr, KW: tl.constexpr,
                      DILATION_H: tl.constexpr, DILATION_W: tl.constexpr, ACC_DTYPE: tl.constexpr,
                      BLOCK_H: tl.constexpr, WINDOW_OFF: tl.constexpr, WINDOW_LANE0: tl.constexpr,
                      WINDOW_VECS: tl.constexpr, Y_UNIT: tl.constexpr, ODD_OUT_ALIGN: tl.constexpr,
                      WIDEN_BF16: tl.constexpr, MASKED: tl.constexpr, WEIGHT_GRAD: tl.constexpr, weight_grads,
                      features):
    """The tile of depthwise_fwd_nchw_pixels_kernel; MASKED: bounds tests on rows and columns (edge
    tiles), else none. WEIGHT_GRAD: also adds each tap's input lane times the feature at the output
    it feeds (features: _tile_lanes, zero outside) into weight_grads, and returns them.
    ODD_OUT_ALIGN (first_row even, y_base a whole vector): odd output rows start 2 elements past a
    vector boundary; there a thread holds the columns 2 to the left of its even rows' (window views
    2 lanes left) and stores them as one aligned vector from the boundary below the row's start,
    the 2-column pieces at the row ends as pairs. WIDEN_BF16: bfloat16 windows widened by
    _widen_bf16."""
    ODD_SHIFT: tl.constexpr = 2 * ODD_OUT_ALIGN
    accs = ()
    for i in tl.static_range(BLOCK_H * 4):
        accs = accs + (start,)
    for r in tl.static_range(BLOCK_H + (KH - 1) * DILATION_H):
        in_row = zero + (first_row - pad_top + r)
        x_row = x_base + in_row * x_stride_h
        w0, w1, w2, w3 = _load_row_window(x_row, group_cols, lanes, (in_row >= 0) & (in_row < in_h), in_w,
                                          WINDOW_OFF, WINDOW_VECS, 4, 0, False, "", MASKED, WIDEN_BF16)
        # output row j reads this row through kernel row kh where j + kh * DILATION_H == r; its lane
        # i through tap (kh, kw) reads window lane WINDOW_LANE0 + i + kw * DILATION_W
        for kh in tl.static_range(KH):
            for j in tl.static_range(BLOCK_H):
                if j + kh * DILATION_H == r:
                    for kw in tl.static_range(KW):
                        for i in tl.static_range(4):
                            pixel = _window_lane(w0, w1, w2, w3, WINDOW_LANE0 - ODD_SHIFT * (j % 2) + i
                                                 + kw * DILATION_W, 4).to(ACC_DTYPE)
                            accs = accs[:j * 4 + i] + (tl.fma(pixel, weights[kh * KW + kw], accs[j * 4 + i]),) \
                                + accs[j * 4 + i + 1:]
                            if WEIGHT_GRAD:
                                weight_grads = weight_grads[:kh * KW + kw] + (
                                    tl.fma(pixel, features[j * 4 + i], weight_grads[kh * KW + kw]),) \
                                    + weight_grads[kh * KW + kw + 1:]
    pairs = tl.arange(0, 2)[None, None, :]
    for j in tl.static_range(BLOCK_H):
        out_row = zero + (first_row + j)
        y_row = y_base + out_row * y_stride_h
        if ODD_OUT_ALIGN:  # from the vector boundary at or below the row's start (a no-op on even rows)
            y_row = y_base + ((out_row * y_stride_h) // 4) * 4
            value = _pack4(accs[j * 4], accs[j * 4 + 1], accs[j * 4 + 2], accs[j * 4 + 3]).to(y_base.dtype.element_ty)
            _store_aligned_rows(y_row + group_cols + lanes, value, group_cols - ODD_SHIFT * (j % 2), lanes,
                                out_row < out_h, out_w, 4, "")
        elif Y_UNIT == 4:  # rows of whole vectors: one 16-byte store
            value = _pack4(accs[j * 4], accs[j * 4 + 1], accs[j * 4 + 2], accs[j * 4 + 3]).to(y_base.dtype.element_ty)
            if MASKED:
                tl.store(y_row + group_cols + lanes, value, mask=(out_row < out_h) & (group_cols + lanes < out_w))
            else:
                tl.store(y_row + group_cols + lanes, value)
        else:  # two pairs, each stored as it is held (a 4-vector would cross alignment and take shared memory)
            for half in tl.static_range(2):
                value = tl.join(accs[j * 4 + 2 * half], accs[j * 4 + 2 * half + 1]).to(y_base.dtype.element_ty)
                cols = group_cols + 2 * half + pairs
                if MASKED:
                    tl.store(y_row + cols, value, mask=(out_row < out_h) & (cols < out_w))
                else:
                    tl.store(y_row + cols, value)
    return weight_grads


@triton.jit
def _tile_lanes(f_base, first_row, group_cols, lanes, zero, out_h, out_w, f_stride_h, ACC_DTYPE: tl.constexpr,
                BLOCK_H: tl.constexpr, LOAD: tl.constexpr, MASKED: tl.constexpr):
    """The values of f at a tile's outputs, as _conv_nchw_pixels holds its accumulators: a tuple
    of [1, GROUPS] lanes, row by row (zero outside the plane); LOAD False: none."""
    values = ()
    for j in tl.static_range(BLOCK_H if LOAD else 0):
        out_row = zero + (first_row + j)
        ptrs = f_base + out_row * f_stride_h + group_cols + lanes
        if MASKED:
            vector = tl.load(ptrs, mask=(out_row < out_h) & (group_cols + lanes < out_w), other=0.0)
        else:
            vector = tl.load(ptrs)
        for i in tl.static_range(4):
            values = values + (_lane(vector, i, 4).to(ACC_DTYPE),)
    return values


@triton.jit
def _nchw_pixels_tile(x_base, y_base, f_base, weights, start, first_row, first_col, group_cols, lanes, zero,
                      in_h, in_w, out_h, out_w, x_stride_h, y_stride_h, f_stride_h, pad_top,
                      KH: tl.constexpr, KW: tl.constexpr, DILATION_H: tl.constexpr, DILATION_W: tl.constexpr,
                      ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
                      WINDOW_OFF: tl.constexpr, WINDOW_LANE0: tl.constexpr, WINDOW_VECS: tl.constexpr,
                      Y_UNIT: tl.constexpr, ODD_OUT_ALIGN: tl.constexpr, WIDEN_BF16: tl.constexpr,
                      WEIGHT_GRAD: tl.constexpr, weight_grads):
    """One tile of depthwise_fwd_nchw_pixels_kernel, without bounds tests where every window vector
    and output lies inside the image."""
    interior = ((first_row - pad_top >= 0) & (first_row + BLOCK_H - 1 - pad_top + (KH - 1) * DILATION_H < in_h)
                & (first_row + BLOCK_H <= out_h) & (first_col + BLOCK_W <= out_w)
                & (first_col - WINDOW_OFF >= 0) & (first_col + BLOCK_W - 4 - WINDOW_OFF + 4 * WINDOW_VECS <= in_w))
    if interior:
        weight_grads = _conv_nchw_pixels(
            x_base, y_base, weights, start, first_row, group_cols, lanes, zero, in_h, in_w, out_h, out_w,
            x_stride_h, y_stride_h, pad_top, KH, KW, DILATION_H, DILATION_W, ACC_DTYPE, BLOCK_H, WINDOW_OFF,
            WINDOW_LANE0, WINDOW_VECS, Y_UNIT, ODD_OUT_ALIGN, WIDEN_BF16, False, WEIGHT_GRAD, weight_grads,
            _tile_lanes(f_base, first_row, group_cols, lanes, zero, out_h, out_w, f_stride_h, ACC_DTYPE, BLOCK_H,
                        WEIGHT_GRAD, False))
    else:
        weight_grads = _conv_nchw_pixels(
            x_base, y_base, weights, start, first_row, group_cols, lanes, zero, in_h, in_w, out_h, out_w,
            x_stride_h, y_stride_h, pad_top, KH, KW, DILATION_H, DILATION_W, ACC_DTYPE, BLOCK_H, WINDOW_OFF,
            WINDOW_LANE0, WINDOW_VECS, Y_UNIT, ODD_OUT_ALIGN, WIDEN_BF16, True, WEIGHT_GRAD, weight_grads,
            _tile_lanes(f_base, first_row, group_cols, lanes, zero, out_h, out_w, f_stride_h, ACC_DTYPE, BLOCK_H,
                        WEIGHT_GRAD, True))
    return weight_grads


@triton.jit
def depthwise_fwd_nchw_pixels_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, f_ptr, partial_ptr,
    out_channels, in_h, in_w, out_h, out_w,
    x_stride_n, x_stride_c, x_stride_h, y_stride_n, y_stride_c, y_stride_h, f_stride_n, f_stride_c, f_stride_h,
    pad_top, pad_left, runs,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, DILATION_H: tl.constexpr,
    DILATION_W: tl.constexpr, HAS_BIAS: tl.constexpr, INDEX_64: tl.constexpr, ACC_DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, WINDOW_OFF: tl.constexpr, WINDOW_LANE0: tl.constexpr,
    WINDOW_VECS: tl.constexpr, X_UNIT: tl.constexpr, Y_UNIT: tl.constexpr, F_UNIT: tl.constexpr,
    FLIP_TAPS: tl.constexpr, WEIGHT_GRAD: tl.constexpr, ODD_OUT_ALIGN: tl.constexpr, WIDEN_BF16: tl.constexpr,
):
    """NCHW, stride 1, unit column steps ("nchw_pixels"; float32 3x3's default since session 9): one program =
    BLOCK_H output rows x BLOCK_W columns of one plane, a thread 4 adjacent columns of each row.
    Per input row a thread loads the aligned 4-vectors covering its outputs' columns (the rows
    kernel's window) and takes each output's input as a lane of them: every output is one FMA chain
    over its taps (from the bias), with no ring of partial rows and no zero-weight FMAs. Widths and
    strides arrive divided by X_UNIT / Y_UNIT (as in the rows kernel) so that the compiler can
    prove the vectors aligned; tiles inside the image skip every bounds test. FLIP_TAPS: the
    weight's taps in reverse (grad_input).
    WEIGHT_GRAD (stride 1, multiplier 1; the fused backward): x is grad_out, the weight flipped, y
    grad_input and f the forward's input (f_*: its strides in F_UNITs). A program walks a run of
    the plane's row tiles down one column of tiles (`runs` runs a column; the forward passes one
    run a row tile), adds each tap's grad_out lane times f at the output it feeds, and writes
    partial[program, tap] in the weight's tap order, to be summed by the launcher.
    ODD_OUT_ALIGN (the forward; output rows of 2 mod 4 elements in planes of whole vectors, even
    BLOCK_H): aligned vector stores on odd rows too (see _conv_nchw_pixels). WIDEN_BF16: as the rows
    kernel's."""
    in_w = in_w * X_UNIT
    out_w = out_w * Y_UNIT
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(out_w, BLOCK_W)
    if WEIGHT_GRAD:  # programs of a run consecutive: a whole row of tiles at a time
        plane = pid // (runs * tiles_w)
        tile = pid % (runs * tiles_w)  # (run, column of tiles)
    else:  # (one row tile a run)
        tiles = tl.cdiv(out_h, BLOCK_H) * tiles_w
        plane = pid // tiles
        tile = pid % tiles
    run = tile // tiles_w
    x_base, y_base, out_c = _plane_pointers(x_ptr, y_ptr, plane, out_channels, MULTIPLIER,
                                            x_stride_n * X_UNIT, x_stride_c * X_UNIT,
                                            y_stride_n * Y_UNIT, y_stride_c * Y_UNIT)
    if ODD_OUT_ALIGN:  # the same plane start, written so that the compiler sees a whole vector
        y_base = y_ptr + (((plane // out_channels).to(tl.int64) * y_stride_n
                           + (plane % out_channels).to(tl.int64) * y_stride_c) * Y_UNIT // 4) * 4
    GROUPS: tl.constexpr = BLOCK_W // 4
    first_col = (tile % tiles_w) * BLOCK_W
    group_cols = first_col + 4 * tl.arange(0, GROUPS)[None, :, None]
    lanes = tl.arange(0, 4)[None, None, :]
    if INDEX_64:
        group_cols = group_cols.to(tl.int64)
    start = tl.zeros([1, GROUPS], dtype=ACC_DTYPE)
    if HAS_BIAS:  # (accumulating onto the bias saves an add an output)
        start += tl.load(b_ptr + out_c).to(ACC_DTYPE)
    weights = ()
    for tap in tl.static_range(KH * KW):
        weights = weights + (tl.load(w_ptr + out_c * (KH * KW) + (KH * KW - 1 - tap if FLIP_TAPS else tap)
                                     ).to(ACC_DTYPE),)
    if WEIGHT_GRAD:
        weight_grads = ()
        for tap in tl.static_range(KH * KW):
            weight_grads = weight_grads + (tl.zeros([1, GROUPS], dtype=ACC_DTYPE),)
        n = (plane // out_channels).to(tl.int64)
        f_base = f_ptr + (n * f_stride_n + out_c.to(tl.int64) * f_stride_c) * F_UNIT
        row_tiles = tl.cdiv(out_h, BLOCK_H)
        run_length = tl.cdiv(row_tiles, runs)
        for row_tile in range(run * run_length, tl.minimum(run * run_length + run_length, row_tiles)):
            first_row = row_tile * BLOCK_H
            if INDEX_64:
                first_row = first_row.to(tl.int64)
            zero = tl.zeros([1, 1, 1], dtype=first_row.dtype)  # (row masks as tensors: the interpreter's scalar & tensor)
            weight_grads = _nchw_pixels_tile(x_base, y_base, f_base, weights, start, first_row, first_col, group_cols,
                                             lanes, zero, in_h, in_w, out_h, out_w, x_stride_h * X_UNIT,
                                             y_stride_h * Y_UNIT, f_stride_h * F_UNIT, pad_top, KH, KW, DILATION_H,
                                             DILATION_W, ACC_DTYPE, BLOCK_H, BLOCK_W, WINDOW_OFF, WINDOW_LANE0,
                                             WINDOW_VECS, Y_UNIT, False, WIDEN_BF16, True, weight_grads)
        for tap in tl.static_range(KH * KW):  # (a flipped tap stored at the weight's own)
            tl.store(partial_ptr + pid.to(tl.int64) * (KH * KW) + (KH * KW - 1 - tap if FLIP_TAPS else tap),
                     tl.sum(weight_grads[tap]))
    else:
        first_row = run * BLOCK_H
        if INDEX_64:
            first_row = first_row.to(tl.int64)
        zero = tl.zeros([1, 1, 1], dtype=first_row.dtype)
        # (a placeholder for the weight gradients: an empty tuple cannot pass the tile's runtime branch)
        _nchw_pixels_tile(x_base, y_base, y_base, weights, start, first_row, first_col, group_cols, lanes, zero,
                          in_h, in_w, out_h, out_w, x_stride_h * X_UNIT, y_stride_h * Y_UNIT, 0, pad_top, KH, KW,
                          DILATION_H, DILATION_W, ACC_DTYPE, BLOCK_H, BLOCK_W, WINDOW_OFF, WINDOW_LANE0, WINDOW_VECS,
                          Y_UNIT, ODD_OUT_ALIGN, WIDEN_BF16, False, (start,))


@dataclass(frozen=True)
class ForwardConfig:
    # "tile", "rows", "nchw_pixels", "pairs", "nhwc", "nhwc_pixels", "toeplitz" or "large_fma" (block_h: its tile rows)
    kernel: str
    block_h: int  # tile rows ("tile", "nhwc") or output rows per program ("rows")
    block_w: int
    num_warps: int
    vec: int = 1  # output columns a thread owns: "rows" 4 or 8 (window loads, stride_w 1 only), "large_fma" 4-32
    stream: bool = False  # "rows": streaming cache hints (evict_first loads, .cs stores); not yet timed
    block_c: int = 1  # "nhwc" (the tile kernel on channels_last tensors): channels a program covers
    prefetch: bool = False  # "nhwc_rows" (the row-sliding fused backward): the next row's loads issued first


_ACC_DTYPES = {torch.float64: tl.float64}


def ring_size(geom: ConvGeometry) -> int:
    """Rows of the row kernel's ring: the smallest power of two holding every row a column of taps spans."""
    return next_power_of_2(geom.dilation_h * (geom.kernel_h - 1) + 1)


def rows_kernel_fits(geom: ConvGeometry) -> bool:
    """Where the GPU runs the row-sliding kernel. Rows need a ring of register rows: fine up to 8
    rows of 25 taps (k5, or k3 with dilation 2); beyond that (k7: 8 x 49 weights a phase) the tile
    kernel is faster (session 2 sweep)."""
    ring_fits = ring_size(geom) <= 4 or (ring_size(geom) <= 8 and geom.kernel_h * geom.kernel_w <= 25)
    return geom.stride_h == 1 and ring_fits and geom.out_w >= 32


# Output rows a tile program computes at most times kernel taps: the unrolled band's code size on
# the GPU. Larger kernels take one row a program and loop over the kernel rows. The interpreter
# (CI) pays per tensor operation, not per instruction: there a band is as long as the image.
MAX_BAND_TAPS = 256
INTERPRETER_BAND_TAPS = 4096


# "nhwc_pixels" unrolls outputs (rows x columns) x taps: its code size.
MAX_PIXEL_TAPS = 2048
# Kernels up to 7x7 take "nhwc_pixels" on the GPU: measured faster there up to 7x7 (session 8), and
# larger ones compile slowly (sm_90, Triton 3.6, one core of this 2-core machine: 3x3 12-18 s, 7x7
# 58 s, 9x9 178 s, against 33 s for the band kernel's 9x9).
PIXEL_KERNEL_TAPS = 49
NHWC_KERNELS = ("nhwc", "nhwc_pixels")


def band_limit(device: torch.device) -> int:
    return MAX_BAND_TAPS if gpu_plan(device) else INTERPRETER_BAND_TAPS


def band_rows(geom: ConvGeometry, wanted: int, device: torch.device) -> int:
    """Output rows of a tile program: `wanted`, fewer where the unrolled band would be too long,
    one for kernels of more than MAX_BAND_TAPS taps (those loop over their rows on every device)."""
    taps = geom.kernel_h * geom.kernel_w
    if taps > MAX_BAND_TAPS:
        return 1
    return max(1, min(wanted, geom.out_h, band_limit(device) // taps))


def nhwc_config(geom: ConvGeometry, x: torch.Tensor) -> ForwardConfig:
    """Blocks of the channels_last kernels. On the GPU, "nhwc_pixels" for kernels up to 7x7 (session 8
    probe: faster than the band kernel on every layer it ran, e.g. #84 float32 2.08 ms against 2.44,
    bfloat16 1.10 against 1.50); for larger kernels, and under the interpreter, the band
    kernel "nhwc": a band of output rows of a strip of channels by a few columns (session 5 probe:
    #84 float32 best at 8 rows of 8 x 64, 4 values a thread a row; bfloat16 at 16 rows of 8 x 32)."""
    half = x.element_size() == 2
    lowest_bit = geom.out_channels & -geom.out_channels
    # a run that divides the channels keeps every strip on the unmasked path
    block_c = min(32 if half else 64, lowest_bit) if lowest_bit >= 8 else min(64, next_power_of_2(geom.out_channels))
    if not gpu_plan(x.device):  # interpreter: few, large programs
        return ForwardConfig("nhwc", band_rows(geom, 64, x.device), min(32, next_power_of_2(geom.out_w)), 1,
                             block_c=block_c)
    if geom.kernel_h * geom.kernel_w <= PIXEL_KERNEL_TAPS:
        return nhwc_pixels_config(geom, x)
    per_thread = 2 if half else 4
    block_w = max(1, min(next_power_of_2(geom.out_w), per_thread * 128 // block_c))
    return ForwardConfig("nhwc", band_rows(geom, 16 if half else 8, x.device), block_w, 4, block_c=block_c)


def nhwc_pixels_config(geom: ConvGeometry, x: torch.Tensor, whole_tiles: bool = True) -> ForwardConfig:
    """Blocks of "nhwc_pixels", from the session 8 probe on the H200 (docs/notes.md): a channel pair
    a thread; 3x3 kernels take 4 x 8 outputs by 128 channels on 2 warps where the channels come in
    runs of 128 (#84: 2.08 ms float32, 1.10 bfloat16, against 2.12 and 1.11 with 64 on 1 warp),
    else 64 or 32 on 1 warp; larger kernels 4 x 4 outputs by 32 channels (7x7 at 14x14 x 384:
    0.069 ms with 32, 0.080 with 64). float32 takes 16 where the channels come in runs of 16 (5x5 at
    28x28 x 240: 0.075 ms with 4 x 4 x 16, 0.107 with 4 x 8 x 32); half precision 32, the last block
    masked (session 23 probe, same layer, GPU time: bfloat16 0.039 ms against 0.067 with 16, float16
    0.037 against 0.064; cuDNN 0.054 and 0.039). Blocks of 64 channels a warp load bfloat16 channel
    pairs as 32-bit words (bf16_pairs_apply).
    whole_tiles: 7 columns where they divide the output's width and the default's do not (MobileNet's
    and EfficientNet's 28, 14 and 7: a last tile partly outside does every masked output's work).
    Session 26 probe, H200, CUDA-graph replays, against the default (benchmarks/probe_nhwc.py
    --graphs --pixels 4 7 0 0): 3x3 float32 64x192x28x28 stride 2 0.011 ms against 0.015,
    64x576x14x14 stride 2 0.008 / 0.010-0.011, 64x1152x7x7 0.008 / 0.009; bfloat16 64x384x14x14
    0.009 / 0.009 (1.54x / 1.38x cuDNN); 5x5 64x1152x7x7 float32 0.014 / 0.017, bfloat16 0.015 /
    0.018; 7x7 64x384x14x14 0.032 / 0.041 float32, 0.030 / 0.039 bfloat16. Within 2% of the
    default elsewhere, but for 64x240x28x28 3x3 stride 2 float32 1-2% slower; width 56 keeps 4
    (7x7 64x96x56x56 4 x 7: 0.146 / 0.095 ms). Not measured for the weight gradient's tiles."""
    taps = geom.kernel_h * geom.kernel_w
    channels = geom.out_channels
    if taps <= 9:
        block_h, block_w = 4, 8
        block_c = next(c for c in (128, 64, 32) if channels % c == 0 or c == 32)
    else:
        block_h, block_w = 4, 4
        runs_of_16 = channels % 32 != 0 and channels % 16 == 0
        block_c = 16 if runs_of_16 and x.element_size() >= 4 else 32
    if whole_tiles and geom.out_w % block_w and geom.out_w % 7 == 0:
        block_w = 7
    block_h = max(1, min(block_h, MAX_PIXEL_TAPS // (block_w * taps)))
    return ForwardConfig("nhwc_pixels", block_h, block_w, max(1, block_c // 64), block_c=block_c)


def forward_config(geom: ConvGeometry, x: torch.Tensor, out: Optional[torch.Tensor] = None,
                   backward: bool = False) -> ForwardConfig:
    """Picks the kernel and block sizes for a geometry, input and output (measured choices:
    docs/notes.md): the large_fma kernel where large_fma_applies (5x5 up, and 3x3 up on narrow
    planes), else Toeplitz products on the tensor cores for large kernels, the NHWC kernel for
    channels_last tensors, else by the geometry. backward: the config of grad_input's flipped forward."""
    if large_fma_applies(geom, x, backward):  # (the launcher takes its blocks: large_fma_forward_blocks)
        block_h, block_w, num_warps, out_vec = large_fma_forward_blocks(geom, x)
        return ForwardConfig("large_fma", block_h, block_w, num_warps, out_vec)
    if toeplitz_applies(geom, x.dtype):
        block_m = toeplitz_block_m(x)
        return ForwardConfig("toeplitz", block_m, toeplitz_block_w(geom, x),
                             toeplitz_num_warps(toeplitz_out_rows(geom, x), block_m))
    if channels_last_kernel_applies(x, out):
        return nhwc_config(geom, x)
    if nchw_pixels_wins(geom, x, out):
        # Rows wider than 256 in whole-row tiles: a 32-byte sector of an output row is then never
        # written half by one program and half by another (#84 float32, H200, session 12, one run:
        # 8 x 512 outputs a program, 4 warps, 2.192 ms against 2.235 at 8 x 128, one warp); half
        # precision 16 rows (session 18 probe: #84 float16 1.086 ms against 1.155 at 8 rows)
        if geom.out_w > 256:
            return ForwardConfig("nchw_pixels", 8 if x.element_size() >= 4 else 16, 512, 4)
        return ForwardConfig("nchw_pixels", 8, 128, 1)
    return nchw_config(geom, x)


def nchw_pixels_wins(geom: ConvGeometry, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> bool:
    """Where "nchw_pixels" beat the rows kernel (session 9 probe, H200, float32 3x3 stride 1 at 8 x 128
    outputs a program: #84 2.258 ms against 2.272, 64x144x56x56 0.069 against 0.081; bfloat16 was a
    tie or a loss: #84 1.186 against 1.181); half precision on rows over 256 wide since its aligned
    odd-row stores (session 18 probe, #84 at 16 x 512: float16 1.086 against the rows kernel's
    1.140, bfloat16 1.131 against 1.142). Not nchw_config's answer: the NCHW fused backward needs
    the rows kernel there."""
    half_wide = x.dtype in (torch.float16, torch.bfloat16) and geom.out_w > 256
    return (gpu_plan(x.device) and (x.dtype == torch.float32 or half_wide) and geom.kernel_h == geom.kernel_w == 3
            and geom.stride_h == geom.stride_w == 1 and geom.dilation_h == geom.dilation_w == 1
            and x.stride(3) == 1 and (out is None or out.stride(3) == 1))


def pairs_apply(geom: ConvGeometry, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> bool:
    """What depthwise_fwd_pairs_kernel takes: column stride 2, column dilation 1 (with a dilation the
    taps fall in different pairs), unit column steps (NCHW)."""
    return geom.stride_w == 2 and geom.dilation_w == 1 and x.stride(3) == 1 and (out is None or out.stride(3) == 1)


def nchw_config(geom: ConvGeometry, x: torch.Tensor) -> ForwardConfig:
    """The tile or rows kernel (any strides; fast on NCHW), or "pairs" for column stride 2."""
    # Column stride 2, kernels 1 to 3 columns wide: the pairs, 256 outputs a program on one warp. H200,
    # session 16, `benchmarks/probe_pairs.py` against the tile kernel: 64x96x112x112 k3 s2 float32
    # 0.128 -> 0.092 ms (4 x 64), bfloat16 0.111 -> 0.073; 64x144x56x56 k3 s2 0.043 -> 0.043 / 0.035
    # (8 x 32; bfloat16 from large_fma's 0.042); k5 s2 lost (0.065 -> 0.070 float32).
    if pairs_apply(geom, x) and geom.kernel_w <= 3:
        block_w = min(64, next_power_of_2(geom.out_w))
        block_h = min(next_power_of_2(geom.out_h), max(1, (256 if gpu_plan(x.device) else 2048) // block_w))
        return ForwardConfig("pairs", block_h, block_w, 1)
    if not gpu_plan(x.device):  # interpreter: each program costs ~the same, so few, wide ones
        return ForwardConfig("tile", band_rows(geom, 64, x.device), min(32, next_power_of_2(geom.out_w)), 4,
                             block_c=min(16, next_power_of_2(geom.out_channels)))
    if rows_kernel_fits(geom):
        rows = 128 if geom.out_h >= 128 else 32
        # Wide rows: 4-column windows, two a thread, whatever the dtype (session 2 sweep: #84 fp32
        # 2.34 ms, bf16 1.19 ms; VEC 8 was slower for bf16). Narrow rows leave threads idle there,
        # and rows not 16-byte aligned (510 floats: 4.7 ms against 2.9 ms with VEC 1) split each
        # vector in two loads.
        if geom.stride_w == 1 and (_stride_unit(x, 4, geom.in_w) == 4 or odd_rows_alignable(x, geom)) \
                and geom.out_w > 128:
            block_w = min(512, next_power_of_2(geom.out_w))
            return ForwardConfig("rows", rows, block_w, max(1, block_w // 256), vec=4)
        # Two output columns a thread keeps registers low and occupancy high (sweeps 2-4 in the notes).
        block_w = min(128, next_power_of_2(geom.out_w))
        return ForwardConfig("rows", rows, block_w, max(1, block_w // 64))
    block_w = min(64, next_power_of_2(geom.out_w))
    return ForwardConfig("tile", band_rows(geom, 4, x.device), block_w, max(1, block_w // 32))


def output_memory_format(x: torch.Tensor) -> torch.memory_format:
    """The output keeps a channels_last input's layout, as PyTorch's convolutions do."""
    if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def image_needs_int64(*tensors: torch.Tensor) -> bool:
    """True when an offset inside one image (all channels: the channels_last kernels) can reach 2**31."""
    return any(sum((size - 1) * abs(st) for size, st in zip(t.shape[1:], t.stride()[1:])) >= 2**31 - 1
               for t in tensors)


def window_layout(geom: ConvGeometry, vec: int, max_shift: int = 0, left_shift: int = 0):
    """(window_off, window_lane0, window_vecs) of the rows kernels' VEC-wide windows: a window starts
    at the aligned column group_start - window_off (- a row's shift, up to max_shift) and covers lanes
    window_lane0 (+ shift) .. + (KW-1)*dilation_w + vec - 1 in window_vecs vectors (at most four).
    left_shift: views may also start that many lanes left of window_lane0 (odd output rows)."""
    if vec == 1:
        return 0, 0, 1
    layout = _window(geom, vec, max_shift, left_shift)
    assert layout[2] <= 4, "the window holds at most four vectors"
    return layout


def window_fits(geom: ConvGeometry, vec: int, max_shift: int = 0, left_shift: int = 0) -> bool:
    """Whether window_layout's window for these shifts holds at most four vectors (the odd-row
    alignments widen it: wide or dilated kernels go without them)."""
    return vec == 1 or _window(geom, vec, max_shift, left_shift)[2] <= 4


def _window(geom: ConvGeometry, vec: int, max_shift: int, left_shift: int):
    window_off = cdiv(geom.pad_left + left_shift, vec) * vec
    window_lane0 = window_off - geom.pad_left
    return window_off, window_lane0, cdiv(window_lane0 + max_shift + (geom.kernel_w - 1) * geom.dilation_w + vec, vec)


def odd_rows_alignable(x: torch.Tensor, geom: ConvGeometry) -> bool:
    """Contiguous NCHW rows of 2 mod 4 elements in planes of whole 4-vectors (even height), read by
    the rows kernel with an even ring: odd rows are 2 elements off a vector boundary, statically."""
    return (x.is_contiguous() and geom.in_w % 4 == 2 and geom.in_h % 2 == 0 and ring_size(geom) % 2 == 0
            and geom.stride_w == 1 and x.data_ptr() % 16 == 0)


def odd_out_rows_alignable(out: torch.Tensor, geom: ConvGeometry) -> bool:
    """Contiguous NCHW output rows of 2 mod 4 elements in planes of whole 4-vectors (even height):
    odd rows are 2 elements off a vector boundary (the rows kernel also needs an even ring, so that
    a slot's rows have one parity)."""
    return (out.is_contiguous() and geom.out_w % 4 == 2 and geom.out_h % 2 == 0 and out.data_ptr() % 16 == 0)


# Aligned stores on odd output rows (the kernel's ODD_OUT_ALIGN); switches so the probes can time both,
# for float32 and for half precision. Half precision on since session 17 (#84, H200, `bench`: bfloat16
# 1.181 -> 1.153 ms, float16 1.166 -> 1.144, with the ring's idle slots skipped; without the aligned
# stores that change alone took 1.33 / 1.26, whose odd rows' stores go through shared memory).
ODD_OUT_ALIGN = True
ODD_OUT_ALIGN_HALF = True
# The same in "nchw_pixels" (#84 float32's kernel, whose odd rows went out as two 8-byte stores a
# thread, each half of a 32-byte sector: 27% more L2 write sectors than the output's); a switch
# for the probes.
NCHW_PIXELS_ODD_OUT_ALIGN = True
# bfloat16 windows of the rows kernel widened by bit operations (the kernel's WIDEN_BF16); a switch
# for the probes.
WIDEN_BF16 = True


def _stride_unit(t: torch.Tensor, vec: int, width: int) -> int:
    """The largest power of two up to vec that divides the width and the row and plane strides
    (1 unless columns are unit-stride): the alignment the rows kernel can pass on to the compiler."""
    unit = vec if t.stride(3) == 1 else 1
    while unit > 1 and (width % unit or any(s % unit for s in t.stride()[:3])):
        unit //= 2
    return unit


def conv_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    geom: ConvGeometry,
    config: Optional[ForwardConfig] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launches the forward kernel. x, weight, bias are already checked against geom."""
    return launch_forward(x, weight, bias, geom, config, out)[0]


def launch_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    geom: ConvGeometry,
    config: Optional[ForwardConfig] = None,
    out: Optional[torch.Tensor] = None,
    weight_grad_from: Optional[torch.Tensor] = None,
    flip_weight: bool = False,
    runs: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """conv_forward, and the fused backward: with weight_grad_from (the forward's input; rows or
    "nchw_pixels" kernel, stride 1, multiplier 1) this call is grad_input (x = grad_out, weight
    flipped) and also returns partial[program, tap], grad_weight partial sums in the original tap
    order, programs plane by plane (runs: "nchw_pixels"' runs a column of tiles).
    flip_weight: convolve with weight.flip(2, 3) (grad_input); the kernels read the taps in reverse
    (the Toeplitz path gathers its band rows in reverse)."""
    if out is None:
        out = torch.empty(geom.output_shape, device=x.device, dtype=x.dtype,
                          memory_format=output_memory_format(x))
    if out.numel() == 0:
        return out, None
    fused = weight_grad_from is not None
    if config is None and not fused:  # (large kernels' blocks are chosen in their cached plans)
        if large_fma_applies(geom, x, backward=flip_weight):
            return large_fma_forward(x, weight, bias, geom, out, flip_weight), None
        if toeplitz_applies(geom, x.dtype):
            return toeplitz_forward(x, weight, bias, geom, out, flip_weight=flip_weight), None
    if config is not None and config.kernel == "toeplitz":
        return toeplitz_forward(x, weight, bias, geom, out, config.block_h, config.block_w, config.num_warps,
                                flip_weight=flip_weight), None
    if config is not None and config.kernel == "large_fma":
        return large_fma_forward(x, weight, bias, geom, out, flip_weight,
                                 (config.block_h, config.block_w, config.num_warps, config.vec)), None
    key = (geom, config, layout_key(x), layout_key(out), bias is not None,
           layout_key(weight_grad_from) if fused else None, flip_weight, runs, ODD_OUT_ALIGN, ODD_OUT_ALIGN_HALF,
           NCHW_PIXELS_ODD_OUT_ALIGN, WIDEN_BF16, NHWC_TAPS_MAJOR_MIN_BYTES)
    plan = cached_plan(_FORWARD_PLANS, key, lambda: _forward_plan(geom, config, x, out, bias is not None,
                                                                  weight_grad_from, flip_weight, runs))
    if plan.kernel in NHWC_KERNELS and nhwc_weight_taps_major(x):
        weight = weight.reshape(geom.out_channels, -1).t()
    weight = weight.contiguous()
    bias_arg = bias.contiguous() if bias is not None else weight  # unused when HAS_BIAS is False
    if plan.kernel == "nchw_pixels":
        partial = new_partial(plan, x.device) if fused else None
        launch(depthwise_fwd_nchw_pixels_kernel, plan, x, weight, bias_arg, out, weight_grad_from if fused else out,
               partial if fused else out)
        return out, partial
    if plan.kernel == "pairs":
        launch(depthwise_fwd_pairs_kernel, plan, x, weight, bias_arg, out)
        return out, None
    if plan.kernel != "rows":
        launch(depthwise_fwd_tile_kernel, plan, x, weight, bias_arg, out)
        return out, None
    partial = new_partial(plan, x.device) if fused else None
    launch(depthwise_fwd_rows_kernel, plan, x, weight, bias_arg, out, weight_grad_from if fused else out,
           partial if fused else out)
    return out, partial


_FORWARD_PLANS: dict = {}


def _forward_plan(geom: ConvGeometry, config: Optional[ForwardConfig], x: torch.Tensor, out: torch.Tensor,
                  has_bias: bool, features: Optional[torch.Tensor], flip_weight: bool = False,
                  runs: Optional[int] = None) -> LaunchPlan:
    """Grid and arguments of one forward launch (see launch_forward); features: the fused
    backward's input, whose weight gradient the kernel also accumulates; flip_weight: the
    kernels read the taps in reverse (no flipped copy)."""
    if config is None:
        config = forward_config(geom, x, out, backward=flip_weight)
    index_64 = plane_needs_int64(x, (geom.in_h, geom.in_w)) or plane_needs_int64(out, (geom.out_h, geom.out_w))
    planes = geom.batch * geom.out_channels
    tiles_w = cdiv(geom.out_w, config.block_w)
    common = dict(
        MULTIPLIER=geom.multiplier, KH=geom.kernel_h, KW=geom.kernel_w, HAS_BIAS=has_bias,
        INDEX_64=index_64, ACC_DTYPE=_ACC_DTYPES.get(x.dtype, tl.float32), BLOCK_W=config.block_w,
        num_warps=config.num_warps,
    )
    if config.kernel == "nchw_pixels":
        return _nchw_pixels_plan(geom, config, x, out, dict(common, FLIP_TAPS=flip_weight), features, runs)
    if config.kernel == "pairs":
        assert features is None and pairs_apply(geom, x, out), "pairs: column stride 2, unit column steps"
        return _pairs_plan(geom, config, x, out, dict(common, FLIP_TAPS=flip_weight))
    if config.kernel != "rows":
        assert features is None, "the fused backward runs on the rows or nchw_pixels kernel"
        return _tile_plan(geom, config, x, out, common, flip_weight)
    assert geom.stride_h == 1, "the row-sliding kernel needs stride_h == 1"
    chunks = cdiv(geom.out_h, config.block_h)
    vec = config.vec
    assert vec == 1 or (vec in (4, 8) and geom.stride_w == 1 and x.stride(3) == 1), "vec 4 needs unit column steps"
    x_unit = _stride_unit(x, vec, geom.in_w)
    odd_row_align = int(vec == 4 and x_unit == 2 and odd_rows_alignable(x, geom) and window_fits(geom, vec, 2))
    y_unit = _stride_unit(out, vec, geom.out_w)
    odd_out_align = int(ODD_OUT_ALIGN and vec == 4 and x_unit == 4 and y_unit == 2 and features is None
                        and (out.element_size() >= 4 or ODD_OUT_ALIGN_HALF) and ring_size(geom) % 2 == 0
                        and odd_out_rows_alignable(out, geom) and window_fits(geom, vec, 2 * odd_row_align, 2))
    window_off, window_lane0, window_vecs = window_layout(geom, vec, 2 if odd_row_align else 0, 2 * odd_out_align)
    programs = planes * chunks * tiles_w
    taps = next_power_of_2(geom.kernel_h * geom.kernel_w)
    f_strides, f_unit, partial_shape = out.stride(), 1, None  # placeholders when WEIGHT_GRAD is off
    if features is not None:
        assert geom.multiplier == 1 and geom.stride_w == 1 and features.shape == out.shape
        assert features.stride(3) == 1, "the fused backward reads the input with unit column steps"
        f_strides, f_unit, partial_shape = features.stride(), _stride_unit(features, vec, geom.out_w), (programs, taps)
    scalars = (geom.out_channels, geom.in_h, geom.in_w // x_unit, geom.out_h, geom.out_w // y_unit,
               *[s // x_unit for s in x.stride()[:3]], x.stride(3), *[s // y_unit for s in out.stride()[:3]],
               out.stride(3), *[s // f_unit for s in f_strides[:3]], geom.stride_w, geom.pad_top, geom.pad_left,
               config.block_h)
    constants = dict(
        DILATION_H=geom.dilation_h, DILATION_W=geom.dilation_w, SLOTS=ring_size(geom), TAPS=taps, VEC=vec,
        WINDOW_OFF=window_off, WINDOW_LANE0=window_lane0, WINDOW_VECS=window_vecs, X_UNIT=x_unit, Y_UNIT=y_unit,
        ODD_ROW_ALIGN=odd_row_align, PAD_TOP_ODD=geom.pad_top % 2, WEIGHT_GRAD=features is not None, F_UNIT=f_unit,
        ODD_OUT_ALIGN=odd_out_align, EVICT="evict_first" if config.stream else "",
        STORE_CACHE=".cs" if config.stream else "", FLIP_TAPS=flip_weight,
        WIDEN_BF16=WIDEN_BF16 and x.dtype == torch.bfloat16 and vec > 1, **common,
    )
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return LaunchPlan("rows", (programs,), scalars, constants, partial_shape, acc_dtype)


def _nchw_pixels_plan(geom: ConvGeometry, config: ForwardConfig, x: torch.Tensor, out: torch.Tensor, common: dict,
                      features: Optional[torch.Tensor] = None, runs: Optional[int] = None) -> LaunchPlan:
    """depthwise_fwd_nchw_pixels_kernel: stride 1, unit column steps in x and out, 4 columns a thread.
    features: the fused backward's input (the weight gradient's partial sums: runs a column of
    tiles, default nchw_pixels_runs)."""
    assert geom.stride_h == geom.stride_w == 1 and x.stride(3) == 1 and out.stride(3) == 1, \
        "nchw_pixels needs stride 1 and unit column steps"
    assert config.block_w % 4 == 0 and config.block_h * geom.kernel_h * geom.kernel_w <= MAX_PIXEL_TAPS
    x_unit, y_unit = _stride_unit(x, 4, geom.in_w), _stride_unit(out, 4, geom.out_w)
    odd_out_align = int(NCHW_PIXELS_ODD_OUT_ALIGN and features is None and y_unit == 2 and config.block_h % 2 == 0
                        and odd_out_rows_alignable(out, geom) and window_fits(geom, 4, 0, 2))
    window_off, window_lane0, window_vecs = window_layout(geom, 4, 0, 2 * odd_out_align)
    row_tiles = cdiv(geom.out_h, config.block_h)
    f_strides, f_unit, partial_shape = out.stride(), 1, None  # placeholders when WEIGHT_GRAD is off
    if features is not None:
        assert geom.multiplier == 1 and features.shape == out.shape and features.stride(3) == 1, \
            "the fused backward reads the input with unit column steps, multiplier 1"
        f_strides, f_unit = features.stride(), _stride_unit(features, 4, geom.out_w)
        runs = min(row_tiles, runs or nchw_pixels_runs(row_tiles))
    else:
        runs = row_tiles  # (one row tile a program)
    programs = geom.batch * geom.out_channels * runs * cdiv(geom.out_w, config.block_w)
    if features is not None:
        partial_shape = (programs, geom.kernel_h * geom.kernel_w)
    scalars = (geom.out_channels, geom.in_h, geom.in_w // x_unit, geom.out_h, geom.out_w // y_unit,
               *[s // x_unit for s in x.stride()[:3]], *[s // y_unit for s in out.stride()[:3]],
               *[s // f_unit for s in f_strides[:3]], geom.pad_top, geom.pad_left, runs)
    constants = dict(common, DILATION_H=geom.dilation_h, DILATION_W=geom.dilation_w, BLOCK_H=config.block_h,
                     WINDOW_OFF=window_off, WINDOW_LANE0=window_lane0, WINDOW_VECS=window_vecs,
                     X_UNIT=x_unit, Y_UNIT=y_unit, F_UNIT=f_unit, WEIGHT_GRAD=features is not None,
                     ODD_OUT_ALIGN=odd_out_align, num_stages=1,
                     # (the fused backward's widened: #84 bfloat16 backward 1.600 -> 1.626 ms, one run
                     # each, std 0.04-0.06, session 18; left off there)
                     WIDEN_BF16=WIDEN_BF16 and x.dtype == torch.bfloat16 and features is None)
    return LaunchPlan("nchw_pixels", (programs,), scalars, constants, partial_shape)


def _pairs_plan(geom: ConvGeometry, config: ForwardConfig, x: torch.Tensor, out: torch.Tensor, common: dict
                ) -> LaunchPlan:
    x_unit = _stride_unit(x, 4, geom.in_w)
    tiles = cdiv(geom.out_h, config.block_h) * cdiv(geom.out_w, config.block_w)
    scalars = (geom.out_channels, geom.in_h, geom.in_w // x_unit, geom.out_h, geom.out_w,
               *[s // x_unit for s in x.stride()[:3]], *out.stride()[:3], geom.stride_h, geom.pad_top,
               geom.dilation_h)
    constants = dict(common, PAD_LEFT=geom.pad_left, X_UNIT=x_unit, BLOCK_H=config.block_h)
    return LaunchPlan("pairs", (geom.batch * geom.out_channels * tiles,), scalars, constants)


# Row tiles a fused-backward program of "nchw_pixels" walks (its weight-gradient partial sums are
# written once a run): #84's 4-row tiles, 16 a run: 131072 programs, 4.7 MB of partial sums.
NCHW_PIXELS_RUN_TILES = 16


def nchw_pixels_runs(row_tiles: int) -> int:
    return cdiv(row_tiles, NCHW_PIXELS_RUN_TILES)


def bf16_pairs_apply(x: torch.Tensor, geom: ConvGeometry, block_c: int, num_warps: int) -> bool:
    """Whether "nhwc_pixels" loads bfloat16 channel pairs as 32-bit words: where a thread holds one
    pair (other spreads cost shuffles: sm_90 code of 4 x 8 x 32 channels took 3.2 instructions an
    FMA with pairs, 1.7 without), every pair starts on 4 bytes (even channel counts and strides, an
    aligned base) and lies in one input channel pair (multiplier 1)."""
    return (x.dtype == torch.bfloat16 and geom.multiplier == 1 and x.stride(1) == 1 and block_c == 64 * num_warps
            and geom.in_channels % 2 == 0 and all(s % 2 == 0 for s in (x.stride(0), x.stride(2), x.stride(3)))
            and x.data_ptr() % 4 == 0)


# The channels_last kernels read the weight taps-major ([taps, C]: a tap's weights for a run of
# channels are one vector load) for inputs of at least this many bytes: the strided loads of the
# weight as given cost "nhwc_pixels" 7% on #84 float32 (docs/notes.md, session 10). The copy is
# made on every call (three dispatcher calls and a copy launch), host time that smaller, host-bound
# layers save by reading the weight as given (session 21; not yet timed on the GPU).
NHWC_TAPS_MAJOR_MIN_BYTES = 64 << 20


def nhwc_weight_taps_major(x: torch.Tensor) -> bool:
    """Whether launch_forward hands the channels_last kernels the weight taps-major (a copy)."""
    return x.numel() * x.element_size() >= NHWC_TAPS_MAJOR_MIN_BYTES


def _tile_weight_strides(kernel: str, geom: ConvGeometry, flipped: bool, x: torch.Tensor) -> Tuple[int, int, int]:
    """(channel stride, tap stride, first tap's offset) of the weight depthwise_fwd_tile_kernel reads:
    [C, taps] as given, or [taps, C] where the channels_last kernels take it taps-major (launch_forward
    transposes it); flipped: the taps from the last one back."""
    taps = geom.kernel_h * geom.kernel_w
    channel, tap = (1, geom.out_channels) if kernel in NHWC_KERNELS and nhwc_weight_taps_major(x) else (taps, 1)
    return (channel, -tap, (taps - 1) * tap) if flipped else (channel, tap, 0)


# Register caps (ptxas .maxnreg) of the "nhwc_pixels" forward by element size: none. A sub-partition
# of an SM holds 16384 registers, so resident warps step at 128, 96, 80 and 64 registers a thread
# (16, 20, 24, 32 warps an SM). H200, session 27 (benchmarks/probe_nhwc.py --graphs --maxnreg 0 96
# 80): float32 stride-2 rows 9-16% slower at 96 and #84 2.18 -> 2.70 ms (the spills cost more than
# the warps gain), stride-1 small layers level at 96; bfloat16 within 1-4% either way.
NHWC_PIXELS_MAXNREG: dict = {}


def _tile_plan(geom: ConvGeometry, config: ForwardConfig, x: torch.Tensor, out: torch.Tensor, common: dict,
               flip_weight: bool = False) -> LaunchPlan:
    """The tile kernel, one channel a program (NCHW) or a block of channels ("nhwc", "nhwc_pixels":
    unit channel strides; the launcher hands it the weight taps-major)."""
    nhwc = config.kernel in NHWC_KERNELS
    assert not nhwc or channels_last_kernel_applies(x, out), "the NHWC tiles need unit channel strides"
    taps = geom.kernel_h * geom.kernel_w
    pixels = config.kernel == "nhwc_pixels"
    assert not pixels or (taps <= MAX_BAND_TAPS and config.block_h * config.block_w * taps <= MAX_PIXEL_TAPS), \
        "too many outputs x taps to unroll"
    block_c = config.block_c  # >1 on NCHW too under the interpreter (any channel stride works)
    if nhwc:  # offsets inside one image (not one plane) are 32-bit unless they can reach 2**31
        common = dict(common, INDEX_64=image_needs_int64(x, out))
    tiles = cdiv(geom.out_h, config.block_h) * cdiv(geom.out_w, config.block_w)
    scalars = (geom.out_channels, geom.in_h, geom.in_w, geom.out_h, geom.out_w, *x.stride(), *out.stride(),
               *_tile_weight_strides(config.kernel, geom, flip_weight, x), geom.stride_w, geom.pad_top, geom.pad_left,
               geom.dilation_w)
    unroll = taps <= MAX_BAND_TAPS
    assert config.block_h * taps <= band_limit(x.device) or config.block_h == 1, "band too long to unroll"
    assert unroll or config.block_h == 1, "large kernels take one output row a program"
    constants = dict(common, STRIDE_H=geom.stride_h, DILATION_H=geom.dilation_h, UNROLL=unroll,
                     BLOCK_H=config.block_h, BLOCK_C=block_c, PIXELS=pixels,
                     PIXEL_STRIDE_W=geom.stride_w if pixels else 1, PIXEL_DILATION_W=geom.dilation_w if pixels else 1,
                     PIXEL_X_STRIDE_W=x.stride(3) if pixels else 1, PIXEL_Y_STRIDE_W=out.stride(3) if pixels else 1,
                     BF16_PAIRS=pixels and bf16_pairs_apply(x, geom, block_c, config.num_warps),
                     INTERIOR_TILES=geom.has_interior_tile(config.block_h, config.block_w, block_c),
                     num_stages=1)  # (bands are unrolled: no loop loads to software-pipeline)
    register_cap = NHWC_PIXELS_MAXNREG.get(x.element_size()) if pixels else None
    if register_cap and gpu_plan(x.device):
        constants["maxnreg"] = register_cap
    return LaunchPlan(config.kernel, (geom.batch * cdiv(geom.out_channels, block_c) * tiles,), scalars, constants)
