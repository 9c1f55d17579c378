"""Backward of the depthwise conv2d: grad_input and grad_weight / grad_bias kernels, launchers.

Reading order: the grad_input kernel for any geometry (a gather over the taps that reach each
input position, by stride phase: no atomics, no zero-stuffed tensors, no masked-off taps), the
grad_weight kernels (NCHW: row sliding;
channels_last: pixel tiles by channel blocks; both one float32 partial sum per tap, program and
channel, then a second pass), then the launchers.

grad_input with stride 1 and multiplier 1 is a forward convolution of grad_out with the flipped
weight, so it runs on the forward's kernels (`input_grad_geometry`): rows for NCHW, NHWC for
channels_last.
Everything is deterministic: every output element is written by one program, and the partial
sums of grad_weight are added in a fixed order.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._geometry import ConvGeometry, cdiv, next_power_of_2
from ._launch import LaunchPlan, cached_plan, gpu_plan, launch, layout_key, new_partial, plane_needs_int64
from .large_fma import large_fma_applies, large_fma_grad_weight
from .toeplitz import toeplitz_applies, toeplitz_grad_weight
from .weight_sums import sum_partials, weight_grad_sums
from .forward import (_ACC_DTYPES, MAX_PIXEL_TAPS, PIXEL_KERNEL_TAPS, _conv_pixels, _load_row_window, _pairs_ok,
                      _row_pixels, _row_taps, _row_under_tap, _store_pixels, _stride_unit, _tap_weights, _tile_pixels,
                      _widen_pixels, bf16_pairs_apply, channels_last_kernel_applies, ForwardConfig, image_needs_int64,
                      launch_forward, nchw_config, nhwc_pixels_config, output_memory_format, rows_kernel_fits,
                      window_layout)


@triton.jit
def depthwise_grad_input_phase_kernel(
    g_ptr, w_ptr, dx_ptr,
    in_channels, in_h, in_w, out_h, out_w,
    g_stride_n, g_stride_c, g_stride_h, g_stride_w,
    dx_stride_n, dx_stride_c, dx_stride_h, dx_stride_w,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_TOP: tl.constexpr, PAD_LEFT: tl.constexpr,
    DILATION_H: tl.constexpr, DILATION_W: tl.constexpr, MULTIPLIER: tl.constexpr, KH: tl.constexpr,
    KW: tl.constexpr, SHARED_LOADS: tl.constexpr, FIRST_SHIFT_H: tl.constexpr, SHIFTS_H: tl.constexpr,
    FIRST_SHIFT_W: tl.constexpr, SHIFTS_W: tl.constexpr, INDEX_64: tl.constexpr,
    ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program = BLOCK_H x BLOCK_W groups of STRIDE_H x STRIDE_W input pixels (rows, columns) x
    BLOCK_C input channels of one image: BLOCK_C = 1 for NCHW (a plane's tile), a run of channels
    along the contiguous axis for channels_last.
    Input pixel (STRIDE_H * a + rp, STRIDE_W * b + cp), its phase (rp, cp), received out pixel
    (a + t_h, b + t_w) through tap (kh, kw) where rp + PAD_TOP - kh * DILATION_H = STRIDE_H * t_h
    and cp + PAD_LEFT - kw * DILATION_W = STRIDE_W * t_w. So each phase gathers only the taps that
    reach it (at stride 2, 3x3: 1, 2 or 4 of the 9), with loads contiguous along b.
    SHARED_LOADS: every phase's accumulator is live at once and each grad_out tile at a shift
    (t_h, t_w) (FIRST_SHIFT_H .. + SHIFTS_H - 1 by FIRST_SHIFT_W .. + SHIFTS_W - 1) is loaded once
    for all the taps of all the phases it meets (5x5 at stride 2: 9 loads a group of 4 pixels, not
    25); the taps are unrolled, so only for small kernels. Else a phase at a time, a loop over the
    kernel rows."""
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(tl.cdiv(in_w, STRIDE_W), BLOCK_W)
    tiles_per_plane = tl.cdiv(tl.cdiv(in_h, STRIDE_H), BLOCK_H) * tiles_w
    channel_blocks = tl.cdiv(in_channels, BLOCK_C)
    plane = pid // tiles_per_plane
    tile = pid % tiles_per_plane
    n = plane // channel_blocks
    in_c = (plane % channel_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)[None, None, :]
    c_ok = in_c < in_channels
    group_rows = (tile // tiles_w) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None, None]
    group_cols = (tile % tiles_w) * BLOCK_W + tl.arange(0, BLOCK_W)[None, :, None]
    if INDEX_64:
        group_rows = group_rows.to(tl.int64)
        group_cols = group_cols.to(tl.int64)
    dx_base = dx_ptr + n.to(tl.int64) * dx_stride_n + in_c.to(tl.int64) * dx_stride_c
    if SHARED_LOADS:
        accs = ()
        for phase in tl.static_range(STRIDE_H * STRIDE_W):
            accs = accs + (tl.zeros([BLOCK_H, BLOCK_W, BLOCK_C], dtype=ACC_DTYPE),)
        for j in tl.static_range(MULTIPLIER):  # every output channel fed by this input channel
            out_c = in_c * MULTIPLIER + j
            g_base = g_ptr + n.to(tl.int64) * g_stride_n + out_c.to(tl.int64) * g_stride_c
            for u in tl.static_range(SHIFTS_H):
                out_rows = group_rows + (FIRST_SHIFT_H + u)
                rows_ok = (out_rows >= 0) & (out_rows < out_h) & c_ok
                for v in tl.static_range(SHIFTS_W):
                    out_cols = group_cols + (FIRST_SHIFT_W + v)
                    ok = rows_ok & (out_cols >= 0) & (out_cols < out_w)
                    g = tl.load(g_base + out_rows * g_stride_h + out_cols * g_stride_w, mask=ok, other=0.0)
                    g = g.to(ACC_DTYPE)
                    # (the tests are on constants: only the taps at this shift are in the code)
                    for rp in tl.static_range(STRIDE_H):
                        for kh in tl.static_range(KH):
                            if rp + PAD_TOP - kh * DILATION_H == (FIRST_SHIFT_H + u) * STRIDE_H:
                                for cp in tl.static_range(STRIDE_W):
                                    for kw in tl.static_range(KW):
                                        if cp + PAD_LEFT - kw * DILATION_W == (FIRST_SHIFT_W + v) * STRIDE_W:
                                            w = tl.load(w_ptr + (out_c * KH + kh) * KW + kw, mask=c_ok, other=0.0)
                                            accs = accs[:rp * STRIDE_W + cp] + (
                                                accs[rp * STRIDE_W + cp] + g * w.to(ACC_DTYPE),
                                            ) + accs[rp * STRIDE_W + cp + 1:]
        for rp in tl.static_range(STRIDE_H):
            for cp in tl.static_range(STRIDE_W):
                rows = group_rows * STRIDE_H + rp
                cols = group_cols * STRIDE_W + cp
                tl.store(dx_base + rows * dx_stride_h + cols * dx_stride_w,
                         accs[rp * STRIDE_W + cp].to(dx_ptr.dtype.element_ty),
                         mask=(rows < in_h) & (cols < in_w) & c_ok)
    else:
        for rp in tl.static_range(STRIDE_H):
            rows = group_rows * STRIDE_H + rp
            for cp in tl.static_range(STRIDE_W):
                cols = group_cols * STRIDE_W + cp
                acc = tl.zeros([BLOCK_H, BLOCK_W, BLOCK_C], dtype=ACC_DTYPE)
                for j in tl.static_range(MULTIPLIER):
                    out_c = in_c * MULTIPLIER + j
                    g_base = g_ptr + n.to(tl.int64) * g_stride_n + out_c.to(tl.int64) * g_stride_c
                    for kh in range(KH):
                        reach_h = rp + PAD_TOP - kh * DILATION_H
                        if reach_h % STRIDE_H == 0:  # (exact multiples: truncating division is exact)
                            out_rows = group_rows + reach_h // STRIDE_H
                            rows_ok = (out_rows >= 0) & (out_rows < out_h) & c_ok
                            for kw in tl.static_range(KW):
                                if (cp + PAD_LEFT - kw * DILATION_W) % STRIDE_W == 0:
                                    out_cols = group_cols + (cp + PAD_LEFT - kw * DILATION_W) // STRIDE_W
                                    ok = rows_ok & (out_cols >= 0) & (out_cols < out_w)
                                    g = tl.load(g_base + out_rows * g_stride_h + out_cols * g_stride_w, mask=ok,
                                                other=0.0)
                                    w = tl.load(w_ptr + (out_c * KH + kh) * KW + kw, mask=c_ok, other=0.0)
                                    acc += g.to(ACC_DTYPE) * w.to(ACC_DTYPE)
                tl.store(dx_base + rows * dx_stride_h + cols * dx_stride_w, acc.to(dx_ptr.dtype.element_ty),
                         mask=(rows < in_h) & (cols < in_w) & c_ok)


@triton.jit(do_not_specialize=["pad_left"])
def depthwise_grad_weight_kernel(
    g_ptr, x_ptr, partial_ptr,
    out_channels, in_h, in_w, out_h, out_w, total_rows, splits,
    x_stride_n, x_stride_c, x_stride_h, x_stride_w,
    g_stride_n, g_stride_c, g_stride_h, g_stride_w,
    stride_h, stride_w, pad_top, pad_left,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    DILATION_H: tl.constexpr, DILATION_W: tl.constexpr, BIAS_GRAD: tl.constexpr,
    INDEX_64: tl.constexpr, ACC_DTYPE: tl.constexpr, TAPS: tl.constexpr, BLOCK_W: tl.constexpr,
    VEC: tl.constexpr, WINDOW_OFF: tl.constexpr, WINDOW_LANE0: tl.constexpr, WINDOW_VECS: tl.constexpr,
    X_UNIT: tl.constexpr, G_UNIT: tl.constexpr, ROWS: tl.constexpr,
):
    """grad_weight[c, kh, kw] = sum over n, oh, ow of grad_out[n, c, oh, ow] * x[n, c // m, ih, iw].

    Program (out_c, split) walks the items split, split + splits, ... (an item: ROWS consecutive
    rows of the flattened (n, out row) axis, one column strip) and, per grad_out row, loads the KH input rows it met (as the forward's rows kernel does: VEC
    window loads and shifted views in registers, or one load per tap when VEC == 1).
    Accumulators are one [TAPS, groups, VEC] tensor whose tap axis each thread holds whole, so
    `where(taps == t, ...)` picks a register at compile time. The last tap slot (when BIAS_GRAD)
    sums grad_out for grad_bias. Writes partial[out_c, split, TAPS]; the launcher adds over splits.
    """
    in_w = in_w * X_UNIT
    out_w = out_w * G_UNIT
    pid = tl.program_id(0)
    out_c = pid // splits
    split = pid % splits
    in_c = out_c // MULTIPLIER
    tiles_w = tl.cdiv(out_w, BLOCK_W)
    GROUPS: tl.constexpr = BLOCK_W // VEC
    groups = VEC * tl.arange(0, GROUPS)[None, :, None]
    lanes = tl.arange(0, VEC)[None, None, :]
    taps = tl.arange(0, TAPS)[:, None, None]
    acc = tl.zeros([TAPS, GROUPS, VEC], dtype=ACC_DTYPE)
    # Row indices are [1, 1, 1] tensors so that masks stay tensors (the interpreter mishandles
    # scalar & tensor), 64-bit when INDEX_64.
    if INDEX_64:
        zero = tl.zeros([1, 1, 1], dtype=tl.int64)
    else:
        zero = tl.zeros([1, 1, 1], dtype=tl.int32)
    for item in range(split, tl.cdiv(total_rows, ROWS) * tiles_w, splits):
        group_cols = (item % tiles_w) * BLOCK_W + groups
        if INDEX_64:
            group_cols = group_cols.to(tl.int64)
        out_cols = group_cols + lanes
        for r in tl.static_range(ROWS):  # ROWS rows an item: their loads can all be in flight together
            row = zero + (item // tiles_w) * ROWS + r
            live = row < total_rows
            n = row // out_h
            out_row = row % out_h
            g_row = g_ptr + n.to(tl.int64) * (g_stride_n * G_UNIT) + out_c.to(tl.int64) * (g_stride_c * G_UNIT) \
                + out_row * (g_stride_h * G_UNIT)  # n is a tensor: .to(int64) keeps plane offsets 64-bit
            g = tl.load(g_row + out_cols * g_stride_w, mask=live & (out_cols < out_w), other=0.0).to(ACC_DTYPE)
            x_plane = x_ptr + n.to(tl.int64) * (x_stride_n * X_UNIT) + in_c.to(tl.int64) * (x_stride_c * X_UNIT)
            for kh in tl.static_range(KH):
                in_row = out_row * stride_h - pad_top + kh * DILATION_H
                row_ok = live & (in_row >= 0) & (in_row < in_h)
                x_row = x_plane + in_row * (x_stride_h * X_UNIT)
                w0, w1, w2, w3 = _load_row_window(x_row, group_cols, lanes, row_ok, in_w, WINDOW_OFF, WINDOW_VECS, VEC,
                                                  0, False, "", True, False)
                for kw in tl.static_range(KW):
                    x = _row_under_tap(x_row, w0, w1, w2, w3, out_cols, row_ok, in_w, stride_w, pad_left, x_stride_w,
                                       kw, DILATION_W, WINDOW_LANE0, VEC)
                    acc = tl.where(taps == kh * KW + kw, acc + g * x.to(ACC_DTYPE), acc)
            if BIAS_GRAD:
                acc = tl.where(taps == KH * KW, acc + g, acc)
    sums = tl.sum(tl.sum(acc, axis=2), axis=1)
    tap_ids = tl.arange(0, TAPS)
    tl.store(partial_ptr + (out_c * splits + split) * TAPS + tap_ids, sums, mask=tap_ids < KH * KW + BIAS_GRAD)


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
def depthwise_grad_nhwc_pixels_kernel(
    src_ptr, w_ptr, q_ptr, dx_ptr, partial_ptr,
    channels, batch, src_h, src_w, tile_h, tile_w, row_tiles, runs,
    src_stride_n, src_stride_h, q_stride_n, q_stride_h, dx_stride_n, dx_stride_h,
    pad_top, pad_left,
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
    consecutive (all columns of the same rows at once, as session 9 measured #84: whole rows of
    the image read together, each tile's halo columns shared with its neighbours through L2).
    INTERIOR_TILES: as the forward's (depthwise_fwd_tile_kernel): without, only the masked branch."""
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
            q = _tile_pixels(q_base, first_row, first_col, c_ok, tile_h, tile_w, q_stride_h, Q_STRIDE_W, ACC_DTYPE,
                             BLOCK_H, BLOCK_W, False)
            weight_grads = _conv_pixels(src_base, weights, w_ptr, dx_base, first_row, first_col, c_ok,
                                        src_h, src_w, tile_h, tile_w, src_stride_h, SRC_STRIDE_W, dx_stride_h,
                                        DX_STRIDE_W, pad_top, pad_left, KH, KW, STRIDE_H, DILATION_H, STRIDE_W,
                                        DILATION_W, False, ACC_DTYPE, BLOCK_H, BLOCK_W, BLOCK_C, BF16_PAIRS, False,
                                        GRAD_INPUT, True, weight_grads, q)
        else:
            q = _tile_pixels(q_base, first_row, first_col, c_ok, tile_h, tile_w, q_stride_h, Q_STRIDE_W, ACC_DTYPE,
                             BLOCK_H, BLOCK_W, True)
            weight_grads = _conv_pixels(src_base, weights, w_ptr, dx_base, first_row, first_col, c_ok,
                                        src_h, src_w, tile_h, tile_w, src_stride_h, SRC_STRIDE_W, dx_stride_h,
                                        DX_STRIDE_W, pad_top, pad_left, KH, KW, STRIDE_H, DILATION_H, STRIDE_W,
                                        DILATION_W, False, ACC_DTYPE, BLOCK_H, BLOCK_W, BLOCK_C, BF16_PAIRS, True,
                                        GRAD_INPUT, True, weight_grads, q)
        if BIAS_GRAD:
            bias_grad = weight_grads[KH * KW]
            for p in tl.static_range(BLOCK_H * BLOCK_W):
                bias_grad += q[p]
            weight_grads = weight_grads[:KH * KW] + (bias_grad,)
    slot = (column % tiles_w) * runs + run  # (channel blocks share a slot)
    partial = partial_ptr + (slot.to(tl.int64) * channels + c) * (KH * KW + BIAS_GRAD)
    for tap in tl.static_range(KH * KW + BIAS_GRAD):
        if GRAD_INPUT:  # (tap of the flipped weight: stored at the weight's own)
            tl.store(partial + (KH * KW - 1 - tap), weight_grads[tap], mask=c_ok)
        else:
            tl.store(partial + tap, weight_grads[tap], mask=c_ok)


@triton.jit
def _strip_row_loads(src_strip, q_base, row, first_in_col, first_col, c_ok, pairs_ok, src_h, src_w, tile_h, tile_w,
                     src_stride_h, SRC_STRIDE_W: tl.constexpr, q_stride_h, Q_STRIDE_W: tl.constexpr, pad_top,
                     RING: tl.constexpr, PIXELS: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_W: tl.constexpr,
                     BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr, MASKED: tl.constexpr):
    """What _slide_rows' step for grad_input row `row` loads, as loaded (widened where used): the
    newest grad_out row of the strip (zero outside grad_out's rows) and x's row."""
    in_row = row - pad_top + RING
    src = _row_pixels(src_strip + in_row * src_stride_h, (in_row >= 0) & (in_row < src_h), first_in_col, src_w,
                      c_ok, pairs_ok, PIXELS, SRC_STRIDE_W, ACC_DTYPE, BLOCK_C, BF16_PAIRS, MASKED, not MASKED, False)
    q = _tile_pixels(q_base, row, first_col, c_ok, tile_h, tile_w, q_stride_h, Q_STRIDE_W, q_base.dtype.element_ty,
                     1, BLOCK_W, MASKED)
    return src, q


@triton.jit
def _slide_rows(src_base, weights, q_base, dx_base, first_row, last_row, first_col, c_ok, src_h, src_w, tile_h,
                tile_w, src_stride_h, SRC_STRIDE_W: tl.constexpr, q_stride_h, Q_STRIDE_W: tl.constexpr, dx_stride_h,
                DX_STRIDE_W: tl.constexpr, pad_top, pad_left, KH: tl.constexpr, KW: tl.constexpr,
                DILATION_H: tl.constexpr, DILATION_W: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr, PREFETCH: tl.constexpr, MASKED: tl.constexpr):
    """The fused pass down grad_input rows first_row..last_row-1 of one BLOCK_W x BLOCK_C strip:
    each step loads one grad_out row of the strip (with its KW-1 halo columns) and keeps the last
    (KH-1) * DILATION_H in registers (a ring, rotated by renaming), so a grad_out pixel is loaded
    (BLOCK_W + KW - 1) / BLOCK_W times, where 4 x 4 tiles load it 2.25 times at 3x3 (session 28:
    faster on 56-wide small layers, slower on #84, whose tiles issue 52 loads before their
    products). MASKED: column and channel tests (strips at the image's sides); else only the row
    test of grad_out. PREFETCH: each step issues the next row's loads before its products (the
    last step reloads its own row). Returns the taps' weight gradients (flipped taps, as weights)."""
    RING: tl.constexpr = (KH - 1) * DILATION_H
    PIXELS: tl.constexpr = BLOCK_W + (KW - 1) * DILATION_W
    first_in_col = first_col - pad_left
    src_strip = src_base + first_in_col * SRC_STRIDE_W
    dx_strip = dx_base + first_col * DX_STRIDE_W
    pairs_ok = _pairs_ok(c_ok, BLOCK_C, BF16_PAIRS)
    ring = ()
    for k in tl.static_range(RING):
        in_row = first_row - pad_top + k
        ring = ring + _row_pixels(src_strip + in_row * src_stride_h, (in_row >= 0) & (in_row < src_h), first_in_col,
                                  src_w, c_ok, pairs_ok, PIXELS, SRC_STRIDE_W, ACC_DTYPE, BLOCK_C, BF16_PAIRS,
                                  MASKED, not MASKED)
    weight_grads = ()
    for tap in tl.static_range(KH * KW):
        weight_grads = weight_grads + (tl.zeros([1, BLOCK_C], dtype=ACC_DTYPE),)
    if PREFETCH:
        src_next, q_next = _strip_row_loads(src_strip, q_base, first_row, first_in_col, first_col, c_ok, pairs_ok,
                                            src_h, src_w, tile_h, tile_w, src_stride_h, SRC_STRIDE_W, q_stride_h,
                                            Q_STRIDE_W, pad_top, RING, PIXELS, ACC_DTYPE, BLOCK_W, BLOCK_C, BF16_PAIRS,
                                            MASKED)
    for row in range(first_row, last_row):
        if PREFETCH:  # the next row's loads in flight while this row's products run
            src_loaded, q_loaded = src_next, q_next
            src_next, q_next = _strip_row_loads(src_strip, q_base, tl.minimum(row + 1, last_row - 1), first_in_col,
                                                first_col, c_ok, pairs_ok, src_h, src_w, tile_h, tile_w, src_stride_h,
                                                SRC_STRIDE_W, q_stride_h, Q_STRIDE_W, pad_top, RING, PIXELS, ACC_DTYPE,
                                                BLOCK_W, BLOCK_C, BF16_PAIRS, MASKED)
        else:
            src_loaded, q_loaded = _strip_row_loads(src_strip, q_base, row, first_in_col, first_col, c_ok, pairs_ok,
                                                    src_h, src_w, tile_h, tile_w, src_stride_h, SRC_STRIDE_W,
                                                    q_stride_h, Q_STRIDE_W, pad_top, RING, PIXELS, ACC_DTYPE, BLOCK_W,
                                                    BLOCK_C, BF16_PAIRS, MASKED)
        window = ring + _widen_pixels(src_loaded, ACC_DTYPE, BLOCK_C, BF16_PAIRS)
        q = _widen_pixels(q_loaded, ACC_DTYPE, BLOCK_C, False)
        accs = ()
        for i in tl.static_range(BLOCK_W):
            accs = accs + (tl.zeros([1, BLOCK_C], dtype=ACC_DTYPE),)
        for kh in tl.static_range(KH):
            accs, weight_grads = _row_taps(window[kh * DILATION_H * PIXELS:(kh * DILATION_H + 1) * PIXELS],
                                           kh * DILATION_H, weights, accs, weight_grads, q, KH, KW, 1, DILATION_H,
                                           1, DILATION_W, 1, BLOCK_W, True, True)
        _store_pixels(dx_strip, accs, row, first_col, c_ok, tile_h, tile_w, dx_stride_h, DX_STRIDE_W, 1, BLOCK_W,
                      MASKED)
        ring = window[PIXELS:]
    return weight_grads


@triton.jit
def depthwise_grad_nhwc_rows_kernel(
    src_ptr, w_ptr, q_ptr, dx_ptr, partial_ptr,
    channels, batch, src_h, src_w, tile_h, tile_w, segments, segment_rows,
    src_stride_n, src_stride_h, q_stride_n, q_stride_h, dx_stride_n, dx_stride_h,
    pad_top, pad_left,
    KH: tl.constexpr, KW: tl.constexpr, DILATION_H: tl.constexpr, DILATION_W: tl.constexpr,
    SRC_STRIDE_W: tl.constexpr, Q_STRIDE_W: tl.constexpr, DX_STRIDE_W: tl.constexpr, INDEX_64: tl.constexpr,
    ACC_DTYPE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, BF16_PAIRS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The channels_last fused backward (stride 1, multiplier 1) sliding down the rows: program
    (image, segment of segment_rows rows, column strip) walks its rows one at a time (_slide_rows),
    writing grad_input (dx) as the forward of grad_out (src) with the flipped weight, and one
    partial weight gradient per tap and channel: partial[slot, channel, tap], slot = (strip
    column, image, segment), in the weight's tap order. Programs of the same rows are consecutive
    (neighbouring strips share their halo columns through L2)."""
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
    q_base = q_ptr + n * q_stride_n + c
    dx_base = dx_ptr + n * dx_stride_n + c
    cols_inside = ((first_col + BLOCK_W <= tile_w) & (first_c + BLOCK_C <= channels) & (first_col - pad_left >= 0)
                   & (first_col + BLOCK_W - 1 - pad_left + (KW - 1) * DILATION_W < src_w))
    if cols_inside:
        weight_grads = _slide_rows(src_base, weights, q_base, dx_base, first_row, last_row, first_col, c_ok, src_h,
                                   src_w, tile_h, tile_w, src_stride_h, SRC_STRIDE_W, q_stride_h, Q_STRIDE_W,
                                   dx_stride_h, DX_STRIDE_W, pad_top, pad_left, KH, KW, DILATION_H, DILATION_W,
                                   ACC_DTYPE, BLOCK_W, BLOCK_C, BF16_PAIRS, PREFETCH, False)
    else:
        weight_grads = _slide_rows(src_base, weights, q_base, dx_base, first_row, last_row, first_col, c_ok, src_h,
                                   src_w, tile_h, tile_w, src_stride_h, SRC_STRIDE_W, q_stride_h, Q_STRIDE_W,
                                   dx_stride_h, DX_STRIDE_W, pad_top, pad_left, KH, KW, DILATION_H, DILATION_W,
                                   ACC_DTYPE, BLOCK_W, BLOCK_C, BF16_PAIRS, PREFETCH, True)
    slot = (column % tiles_w) * (batch * segments) + rows_block  # (channel blocks share a slot)
    partial = partial_ptr + (slot.to(tl.int64) * channels + c) * (KH * KW)
    for tap in tl.static_range(KH * KW):  # (tap of the flipped weight: stored at the weight's own)
        tl.store(partial + (KH * KW - 1 - tap), weight_grads[tap], mask=c_ok)


def _input_grad_geometry(geom: ConvGeometry) -> ConvGeometry:
    """For stride 1: grad_input = forward conv of grad_out (out_h x out_w) with the flipped weight,
    padded by (K-1)*dilation - pad before (negative: cropped), giving in_h x in_w."""
    assert geom.stride_h == 1 and geom.stride_w == 1 and geom.multiplier == 1
    pad_top = (geom.kernel_h - 1) * geom.dilation_h - geom.pad_top
    pad_left = (geom.kernel_w - 1) * geom.dilation_w - geom.pad_left
    return dataclasses.replace(
        geom, in_h=geom.out_h, in_w=geom.out_w, out_h=geom.in_h, out_w=geom.in_w,
        pad_top=pad_top, pad_left=pad_left,
        pad_bottom=geom.in_h - geom.out_h - pad_top + (geom.kernel_h - 1) * geom.dilation_h,
        pad_right=geom.in_w - geom.out_w - pad_left + (geom.kernel_w - 1) * geom.dilation_w,
    )


input_grad_geometry = functools.lru_cache(maxsize=1024)(_input_grad_geometry)


# Session-3 sweep: #84 backward 4.5 ms as two kernels -> 3.41 ms fused (fp32), 2.8 -> 2.16 ms (bf16).
FUSED_BACKWARD = True


# The channels_last fused backward (depthwise_grad_nhwc_pixels_kernel). Session 9 probe (H200):
# #84 bfloat16 1.99 ms against 27.9 for the two kernels it replaces and 5.77 for cuDNN; float32
# 3.15 against 19.4 and 73.5.
FUSED_NHWC_BACKWARD = True

# Kernels the channels_last fused backward takes, by taps: each thread holds a weight and a weight
# gradient a tap besides its outputs and their inputs; 7x7 spills (sm_90, Triton 3.6, float32, 32
# channels a warp: 2 x 4 outputs 240 bytes of stack, 4 x 4 424).
FUSED_NHWC_TAPS = 9


# The NCHW fused backward of 3x3 kernels (stride and dilation 1) on the "nchw_pixels" kernel
# (WEIGHT_GRAD) instead of the rows kernel: ~half its sm_90 instructions an output. H200, session
# 12, benchmarks/probe_nchw_backward.py (one run), grad_input + grad_weight: #84 bfloat16 1.611 ms
# at 4 x 128 outputs a program against 2.147 on rows, float32 3.222 (4 x 256, 2 warps: 3.144)
# against 3.391; 64x144x56x56 bfloat16 0.120 against 0.172, float32 0.135 against 0.168.
FUSED_NCHW_PIXELS = True


def fused_backward_applies(geom: ConvGeometry, x: torch.Tensor) -> bool:
    """Whether grad_input and grad_weight can come from one pass (the rows kernel on grad_out, or
    for channels_last x the unrolled-pixels kernel): stride 1, multiplier 1, unit column steps in x,
    padding within the kernel's reach (every grad_out row is visited) and, on the GPU, a geometry
    the rows kernel takes. Shapes and strides only, so it also answers for the fake tensors
    torch.compile traces with."""
    if channels_last_kernel_applies(x):  # the unrolled-pixels kernel, up to FUSED_NHWC_TAPS taps
        return (FUSED_NHWC_BACKWARD and geom.stride_h == geom.stride_w == 1 and geom.multiplier == 1
                and geom.kernel_h * geom.kernel_w <= FUSED_NHWC_TAPS)
    if not (geom.stride_h == geom.stride_w == 1 and geom.multiplier == 1 and x.stride(3) == 1) \
            or toeplitz_applies(geom, x.dtype) or large_fma_applies(geom, x, backward=True):  # their own two kernels
        return False
    gi_geom = input_grad_geometry(geom)  # (cached: dataclasses.replace costs ~6 us a backward)
    if min(gi_geom.pad_top, gi_geom.pad_bottom, gi_geom.pad_left, gi_geom.pad_right) < 0:
        return False
    return rows_kernel_fits(gi_geom) or not gpu_plan(x.device)  # the interpreter runs every case on rows


def gradients_read_grad_out_as_nchw(geom: ConvGeometry, x: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """Whether both gradients' kernels read grad_out with unit column steps, through an NCHW copy
    where it has none (ops/layout.py): the large kernels (Toeplitz, large_fma) for the weight
    gradient and for grad_input's flipped forward. The backward formula then makes that copy once
    for both (a channels_last k31 bfloat16 grad_out of 32x128x56x56: ~14 us a copy on the H200)."""
    if geom.stride_h != 1 or geom.stride_w != 1 or geom.multiplier != 1:
        return False  # (grad_input's phase kernel reads grad_out as it is)
    if not (toeplitz_applies(geom, x.dtype) or large_fma_applies(geom, x, backward=True)):
        return False
    gi_geom = _input_grad_geometry(geom)  # (not the cached one: traced shapes may be SymInts, unhashable)
    return toeplitz_applies(gi_geom, grad_out.dtype) or large_fma_applies(gi_geom, grad_out, backward=True)


def fused_backward_config(gi_geom: ConvGeometry, grad_out: torch.Tensor) -> ForwardConfig:
    """The grad_input launch of the fused backward: the forward's choice on the GPU (the fused path
    applies where that is the rows kernel), or with FUSED_NCHW_PIXELS "nchw_pixels" where that was
    timed (3x3, dilation 1); under the interpreter one 32 x 32 block per plane."""
    if gpu_plan(grad_out.device) and FUSED_NCHW_PIXELS and grad_out.stride(3) == 1 \
            and gi_geom.kernel_h == gi_geom.kernel_w == 3 and gi_geom.dilation_h == gi_geom.dilation_w == 1:
        # (#84's rows of 510: 4 x 256 on two warps, 2% faster in float32; 56-wide rows lost 40% there)
        wide = gi_geom.out_w > 256
        return ForwardConfig("nchw_pixels", 4, 256 if wide else 128, 2 if wide else 1)
    if gpu_plan(grad_out.device):
        config = nchw_config(gi_geom, grad_out)  # (a channels_last grad_out too: the rows kernel takes strides)
        # Session-3 sweep, #84: float32 best at two 4-vectors a thread (3.41 ms), half precision at
        # one (2.16 ms against 2.51 at two: the per-tap accumulators are float32 either way).
        if config.vec > 1 and grad_out.element_size() < 4:
            config = ForwardConfig(config.kernel, config.block_h, min(config.block_w, 128), 1, config.vec)
        return config
    return ForwardConfig("rows", min(32, next_power_of_2(gi_geom.out_h)), min(32, next_power_of_2(gi_geom.out_w)), 1)


def conv_grad_input_and_weight(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geom: ConvGeometry,
                               config=None, runs: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fused backward (see fused_backward_applies): grad_input and grad_weight from one read of
    grad_out and x. Partial sums per program, added per channel in a fixed order. runs: the
    unrolled-pixels kernels' runs a column of tiles (channels_last, and "nchw_pixels" configs)."""
    if x.numel() == 0 or grad_out.numel() == 0:  # nothing to launch: the separate paths give the zeros
        return conv_grad_input(grad_out, weight, geom, x), conv_grad_weight(grad_out, x, geom, weight.dtype, False)[0]
    if channels_last_kernel_applies(x):
        return conv_grad_input_and_weight_nhwc(grad_out, x, weight, geom, config, runs)
    gi_geom = input_grad_geometry(geom)
    if config is None:  # once per layout, like the launch plans: this is on every eager backward
        config = cached_plan(_FUSED_CONFIGS, (gi_geom, layout_key(grad_out)),
                             lambda: fused_backward_config(gi_geom, grad_out))
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype, memory_format=output_memory_format(x))
    dx, partial = launch_forward(grad_out, weight, None, gi_geom, config, out=dx, weight_grad_from=x,
                                 flip_weight=True, runs=runs)
    # partial[(image, channel, program of the plane), tap]
    programs = partial.shape[0] // (geom.batch * geom.out_channels)
    row = partial.stride(0)
    grad_w, _ = weight_grad_sums(partial, geom, weight.dtype, False, programs * row, (programs, row),
                                 (geom.batch, geom.out_channels * programs * row))
    return dx, grad_w


_FUSED_CONFIGS: dict = {}


# Programs of the channels_last pixel-tile backward (nhwc_pixels_grad_config): at least this many,
# so small layers still fill the GPU (session 22 probe, H200, 7x7 on 64x384x14x14: 768 programs
# 0.118 ms, 384 0.147, 1536 0.130), and partial sums at most 1/PARTIAL_SHARE of grad_out and x
MIN_PIXEL_GRAD_PROGRAMS = 768
PARTIAL_SHARE = 12
# The fused pass's channel block under this input size: 32 channels a program, 1 warp (session 22
# probe, 3x3 on 64x384x14x14, 64x960x7x7, 64x1152x7x7: 0.018-0.027 ms against 0.020-0.032 with
# the forward's 128 on 2 warps at their best programs); #84 keeps the forward's blocks
SMALL_FUSED_BYTES = 64 << 20
# Register caps of the fused channels_last pass (ptxas .maxnreg) by element size, at dilation 1.
# H200, session 24 (benchmarks/probe_nhwc_backward.py --graphs [--maxnreg N]): #84 bfloat16 2.030 ->
# 1.843 ms at 128 (168 registers uncapped: 6 -> 8 programs of 2 warps an SM; 96 spills: 2.336),
# float16 1.853 at 112; 64x32x112x112 bfloat16 0.092 -> 0.085, 64x144x56x56 and 64x192x28x28
# within 1%; but the dilated 32x256x64x64 0.122 -> 0.144, so not at dilation 2. float32 uncapped
# (#84: 3.230, 3.212 at 168, 3.486 at 128).
NHWC_FUSED_MAXNREG = {2: 128}
# The same for the channels_last weight gradient alone (none yet: 5x5 stride 2 takes 213 registers in
# sm_90 code at its 4x4x32 one-warp tiles, 9 warps an SM; `probe_strided_backward.py --gw-maxnreg`).
NHWC_WEIGHT_GRAD_MAXNREG: dict = {}


def nhwc_pixels_grad_config(geom: ConvGeometry, x: torch.Tensor, grad_input: bool, bias_grad: bool = False
                            ) -> Tuple[ForwardConfig, int]:
    """Blocks and runs (programs a column of tiles) of depthwise_grad_nhwc_pixels_kernel, whose tiles
    cover grad_input for the fused pass and grad_out for the weight gradient alone: the forward's
    blocks, the fused pass with 4 x 4 outputs in half precision and 2 x 4 in float32 (session 9
    probe, H200, #84 and 64x144x56x56: bfloat16 1.99 / 0.148 ms at 4 x 4 against 2.10 / 0.164 at
    2 x 4; float32 3.15 / 0.188 at 2 x 4 against 3.28 / 0.197), and 32 channels on small inputs.
    Programs: as many as image columns of tiles and at least 4096, but fewer where the partial
    sums would pass a twelfth of grad_out and x, and never under MIN_PIXEL_GRAD_PROGRAMS: each
    program writes its tiles' sums for every tap, and the second pass reads them all (session 22:
    with the earlier floor of 16 MB, 3x3 on 64x384x14x14 wrote 14 MB of partial sums, more than x,
    and the backward took 0.066 ms where 1.8 MB take 0.023). Under the interpreter one program a column."""
    tile_geom = input_grad_geometry(geom) if grad_input else geom
    config = nhwc_pixels_config(tile_geom, x, whole_tiles=False)
    if grad_input:
        block_h = min(config.block_h, 4 if x.element_size() < 4 else 2)
        block_c = 32 if x.numel() * x.element_size() < SMALL_FUSED_BYTES else config.block_c
        config = ForwardConfig("nhwc_pixels", block_h, 4, max(1, block_c // 64), block_c=block_c)
    columns = cdiv(geom.out_channels, config.block_c) * cdiv(tile_geom.out_w, config.block_w)
    tiles = geom.batch * cdiv(tile_geom.out_h, config.block_h)
    if not gpu_plan(x.device):
        return config, 1
    tensor_bytes = (x.numel() + geom.batch * geom.out_channels * geom.out_h * geom.out_w) * x.element_size()
    sums_a_program = config.block_c * (geom.kernel_h * geom.kernel_w + int(bias_grad)) * 4
    programs = min(max(4096, geom.batch * columns),
                   max(MIN_PIXEL_GRAD_PROGRAMS, tensor_bytes // PARTIAL_SHARE // sums_a_program))
    return config, max(1, min(tiles, cdiv(programs, columns)))


def conv_grad_input_and_weight_nhwc(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                    geom: ConvGeometry, config: Optional[ForwardConfig] = None,
                                    runs: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fused backward of channels_last x (see fused_backward_applies): grad_input and grad_weight
    from one read of grad_out and x (depthwise_grad_nhwc_pixels_kernel with GRAD_INPUT)."""
    # (any kernel that fits the unrolled code is correct; FUSED_NHWC_TAPS is where autograd takes it)
    assert geom.stride_h == geom.stride_w == 1 and geom.multiplier == 1 and channels_last_kernel_applies(x), \
        "the channels_last fused backward needs stride 1, multiplier 1 and unit channel strides"
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    grad_w, _ = _launch_nhwc_pixels_grad(geom, grad_out, x, dx, weight.contiguous(), config, runs, False,
                                         weight.dtype)
    return dx, grad_w


def _launch_nhwc_pixels_grad(geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor,
                             dx: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                             config: Optional[ForwardConfig], runs: Optional[int], bias_grad: bool,
                             weight_dtype: torch.dtype) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Launches depthwise_grad_nhwc_pixels_kernel (the fused pass when dx is given, with the
    contiguous weight; else the weight gradient alone) and returns grad_weight and grad_bias (or
    None) from its partial sums."""
    if grad_out.stride(1) != 1:  # (autograd hands the output's layout back; this is the odd case)
        grad_out = grad_out.contiguous(memory_format=torch.channels_last)
    key = (geom, layout_key(grad_out), layout_key(x), dx is not None and layout_key(dx), config, runs, bias_grad)
    plan = cached_plan(_NHWC_PIXELS_GRAD_PLANS, key,
                       lambda: _nhwc_pixels_grad_plan(geom, grad_out, x, dx, config, runs, bias_grad))
    partial = new_partial(plan, x.device)
    if dx is None:  # the weight gradient: rows of x under the taps, grad_out at the tiles
        launch(depthwise_grad_nhwc_pixels_kernel, plan, x, x, grad_out, x, partial)
    elif plan.kernel == "grad_nhwc_rows":
        launch(depthwise_grad_nhwc_rows_kernel, plan, grad_out, weight, x, dx, partial)
    else:
        launch(depthwise_grad_nhwc_pixels_kernel, plan, grad_out, weight, x, dx, partial)
    # partial[slot, channel, tap]
    return weight_grad_sums(partial, geom, weight_dtype, bias_grad, partial.stride(1),
                            (partial.shape[0], partial.stride(0)))


_NHWC_PIXELS_GRAD_PLANS: dict = {}


def _nhwc_pixels_grad_plan(geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor, dx: Optional[torch.Tensor],
                           config: Optional[ForwardConfig], runs: Optional[int], bias_grad: bool) -> LaunchPlan:
    grad_input = dx is not None
    assert not (grad_input and bias_grad), "the fused pass has no bias gradient"
    tile_geom = input_grad_geometry(geom) if grad_input else geom
    default_config, default_runs = nhwc_pixels_grad_config(geom, x, grad_input, bias_grad)
    if config is None and grad_input and nhwc_rows_apply(geom, x):
        config = nhwc_rows_grad_config(geom, x)
    config = config or default_config
    if config.kernel == "nhwc_rows":
        assert grad_input, "the row-sliding pass is the fused backward's"
        return _nhwc_rows_grad_plan(geom, tile_geom, grad_out, x, dx, config)
    row_tiles = cdiv(tile_geom.out_h, config.block_h)
    runs = max(1, min(geom.batch * row_tiles, runs or default_runs))
    taps = geom.kernel_h * geom.kernel_w
    assert config.kernel == "nhwc_pixels" and config.block_h * config.block_w * taps <= MAX_PIXEL_TAPS, \
        "too many outputs x taps to unroll"
    # the swept tensor (src: grad_out for the fused pass, x for the weight gradient) and the one
    # read at the tiles' positions (q)
    src, q = (grad_out, x) if grad_input else (x, grad_out)
    dx_strides = (dx.stride(0), dx.stride(2), dx.stride(3)) if grad_input else (0, 0, 1)
    scalars = (geom.out_channels, geom.batch, tile_geom.in_h, tile_geom.in_w, tile_geom.out_h, tile_geom.out_w,
               row_tiles, runs, src.stride(0), src.stride(2), q.stride(0), q.stride(2), dx_strides[0],
               dx_strides[1], tile_geom.pad_top, tile_geom.pad_left)
    constants = dict(GRAD_INPUT=grad_input, MULTIPLIER=geom.multiplier, KH=geom.kernel_h, KW=geom.kernel_w,
                     STRIDE_H=tile_geom.stride_h, STRIDE_W=tile_geom.stride_w, DILATION_H=geom.dilation_h,
                     DILATION_W=geom.dilation_w, BIAS_GRAD=bias_grad, SRC_STRIDE_W=src.stride(3),
                     Q_STRIDE_W=q.stride(3), DX_STRIDE_W=dx_strides[2],
                     INDEX_64=image_needs_int64(grad_out, x, *([dx] if grad_input else [])),
                     ACC_DTYPE=_ACC_DTYPES.get(x.dtype, tl.float32), BLOCK_H=config.block_h,
                     BLOCK_W=config.block_w, BLOCK_C=config.block_c,
                     BF16_PAIRS=bf16_pairs_apply(src, tile_geom, config.block_c, config.num_warps),
                     INTERIOR_TILES=tile_geom.has_interior_tile(config.block_h, config.block_w, config.block_c),
                     num_warps=config.num_warps, num_stages=1)
    register_caps = NHWC_FUSED_MAXNREG if grad_input else NHWC_WEIGHT_GRAD_MAXNREG
    register_cap = register_caps.get(x.element_size()) if geom.dilation_h == geom.dilation_w == 1 else None
    if register_cap and gpu_plan(x.device):
        constants["maxnreg"] = register_cap
    tiles_w = cdiv(tile_geom.out_w, config.block_w)
    channel_blocks = cdiv(geom.out_channels, config.block_c)
    slots = tiles_w * runs  # (channel blocks share a slot)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return LaunchPlan("grad_nhwc_pixels", (slots * channel_blocks,), scalars, constants,
                      (slots, geom.out_channels, taps + int(bias_grad)), acc_dtype)


# The row-sliding fused pass (depthwise_grad_nhwc_rows_kernel) in place of the tile pass: dilation 1,
# the small layers' 32-channel blocks, grad_input 48-64 columns wide in whole strips of 8, with prefetch.
# H200, session 28 (benchmarks/probe_nhwc_backward.py --graphs --rows 8 0 0 1, docs/notes.md): 3x3 on
# 64x144x56x56 0.081 ms against the tile pass's 0.098 in bfloat16, 0.108 / 0.124 in float32; not
# at 112 wide (64x32x112x112 bfloat16 0.089 / 0.085), 28 (half a strip empty: bfloat16 0.052 / 0.047)
# or on #84 (128 channels: 1.96-2.35 ms against 1.83 in bfloat16 at every block tried).
NHWC_ROWS_WIDTHS = (48, 64)
# Programs the row-sliding pass aims at (fewer: images cut into segments of rows)
NHWC_ROWS_PROGRAMS = 2048


def nhwc_rows_apply(geom: ConvGeometry, x: torch.Tensor) -> bool:
    """Whether the GPU's fused channels_last pass (fused_backward_applies) slides down rows (session 28)."""
    return (gpu_plan(x.device) and geom.dilation_h == geom.dilation_w == 1 and geom.in_w % 8 == 0
            and NHWC_ROWS_WIDTHS[0] <= geom.in_w <= NHWC_ROWS_WIDTHS[1]
            and nhwc_pixels_grad_config(geom, x, True)[0].block_c == 32)


def nhwc_rows_grad_config(geom: ConvGeometry, x: torch.Tensor, block_w: int = 8, prefetch: bool = True
                          ) -> ForwardConfig:
    """Blocks of the row-sliding fused pass: strips of block_w columns and the tile pass's channels;
    block_h is the rows a program walks, the whole image unless that leaves fewer than
    NHWC_ROWS_PROGRAMS programs (under the interpreter: the whole image, one strip)."""
    tile_geom = input_grad_geometry(geom)
    tile_config, _ = nhwc_pixels_grad_config(geom, x, True)
    if not gpu_plan(x.device):
        return ForwardConfig("nhwc_rows", tile_geom.out_h, tile_geom.out_w, tile_config.num_warps,
                             block_c=tile_config.block_c, prefetch=prefetch)
    strips = geom.batch * cdiv(tile_geom.out_w, block_w) * cdiv(geom.out_channels, tile_config.block_c)
    segments = min(tile_geom.out_h, cdiv(NHWC_ROWS_PROGRAMS, strips))
    return ForwardConfig("nhwc_rows", cdiv(tile_geom.out_h, segments), block_w, tile_config.num_warps,
                         block_c=tile_config.block_c, prefetch=prefetch)


def _nhwc_rows_grad_plan(geom: ConvGeometry, tile_geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor,
                         dx: torch.Tensor, config: ForwardConfig) -> LaunchPlan:
    """depthwise_grad_nhwc_rows_kernel's launch: config.block_h rows a program (a segment of an image),
    strips of block_w columns by block_c channels."""
    assert config.block_w * geom.kernel_h * geom.kernel_w <= MAX_PIXEL_TAPS, "too many outputs x taps to unroll"
    segments = cdiv(tile_geom.out_h, config.block_h)
    scalars = (geom.out_channels, geom.batch, tile_geom.in_h, tile_geom.in_w, tile_geom.out_h, tile_geom.out_w,
               segments, config.block_h, grad_out.stride(0), grad_out.stride(2), x.stride(0), x.stride(2),
               dx.stride(0), dx.stride(2), tile_geom.pad_top, tile_geom.pad_left)
    constants = dict(KH=geom.kernel_h, KW=geom.kernel_w, DILATION_H=geom.dilation_h, DILATION_W=geom.dilation_w,
                     SRC_STRIDE_W=grad_out.stride(3), Q_STRIDE_W=x.stride(3), DX_STRIDE_W=dx.stride(3),
                     INDEX_64=image_needs_int64(grad_out, x, dx), ACC_DTYPE=_ACC_DTYPES.get(x.dtype, tl.float32),
                     BLOCK_W=config.block_w, BLOCK_C=config.block_c,
                     BF16_PAIRS=bf16_pairs_apply(grad_out, tile_geom, config.block_c, config.num_warps),
                     PREFETCH=config.prefetch, num_warps=config.num_warps, num_stages=1)
    register_cap = NHWC_ROWS_MAXNREG.get(x.element_size())
    if register_cap and gpu_plan(x.device):
        constants["maxnreg"] = register_cap
    slots = cdiv(tile_geom.out_w, config.block_w) * geom.batch * segments  # (channel blocks share a slot)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return LaunchPlan("grad_nhwc_rows", (slots * cdiv(geom.out_channels, config.block_c),), scalars, constants,
                      (slots, geom.out_channels, geom.kernel_h * geom.kernel_w), acc_dtype)


# Register caps of the row-sliding pass by element size (none yet: probes set them).
NHWC_ROWS_MAXNREG: dict = {}


def conv_grad_input(grad_out: torch.Tensor, weight: torch.Tensor, geom: ConvGeometry,
                    input_like: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """grad of the input: same shape, dtype and memory format as the input (written into out if given)."""
    dx = out
    if dx is None:
        dx = torch.empty((geom.batch, geom.in_channels, geom.in_h, geom.in_w), device=grad_out.device,
                         dtype=input_like.dtype, memory_format=output_memory_format(input_like))
    if dx.numel() == 0:
        return dx
    if grad_out.numel() == 0:
        return dx.zero_()
    if geom.stride_h == 1 and geom.stride_w == 1 and geom.multiplier == 1:
        return launch_forward(grad_out, weight, None, input_grad_geometry(geom), out=dx, flip_weight=True)[0]
    plan = cached_plan(_GRAD_INPUT_PLANS, (geom, layout_key(grad_out), layout_key(dx)),
                       lambda: _grad_input_plan(geom, grad_out, dx))
    launch(depthwise_grad_input_phase_kernel, plan, grad_out, weight.contiguous(), dx)
    return dx


_GRAD_INPUT_PLANS: dict = {}


# The phase kernel's grad_out tiles loaded once for all the phases up to this many taps (its taps
# are unrolled: compile time and code grow with them).
SHARED_LOAD_TAPS = 49
# Values of a grad_out tile a thread holds in the phase kernel (its warps; NCHW: its rows too).
# H200, session 24, bfloat16 at stride 2 with shared loads (benchmarks/probe_strided_backward.py
# --values V, docs/data/phase_kernel_session24.log): channels_last 8 against 2, 64x96x112x112 k3
# 0.144 -> 0.080 ms, 64x144x56x56 k3 0.063 -> 0.034 (5x5 at 8: 0.052, a phase at a time 0.202);
# 16 no better. NCHW 8 wins on the 112-wide input (0.210 -> 0.131; float32 0.211 -> 0.195) and loses
# on 56- and 28-wide ones (k3 0.081 -> 0.105, 5x5 0.081 -> 0.103, 64x240x28x28 0.040 -> 0.086).
PHASE_VALUES_A_THREAD = None  # (a number: that everywhere, for probes)
PHASE_WIDE_NCHW_W = 112


def phase_values_a_thread(geom: ConvGeometry, channels_last: bool) -> int:
    if PHASE_VALUES_A_THREAD:
        return PHASE_VALUES_A_THREAD
    strided = geom.stride_h * geom.stride_w > 1
    return 8 if channels_last or (strided and geom.in_w >= PHASE_WIDE_NCHW_W) else 2


def grad_input_blocks(geom: ConvGeometry, channels_last: bool, gpu: bool) -> Tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_W, BLOCK_C, warps) of depthwise_grad_input_phase_kernel, blocks powers of two
    (its aranges), for the GPU or for the interpreter (gpu False: larger programs): groups of
    stride_h x stride_w input pixels, about as many pixels a program as at stride 1."""
    group_h, group_w = cdiv(geom.in_h, geom.stride_h), cdiv(geom.in_w, geom.stride_w)
    phases = geom.stride_h * geom.stride_w
    values = phase_values_a_thread(geom, channels_last)
    if channels_last:  # tiles of 4 x 8 groups by up to 64 channels
        block_c = min(64, next_power_of_2(geom.in_channels))
        block_w = min(8, next_power_of_2(group_w))
        pixels = (2048 if gpu else 4096) // phases
    else:  # one channel a program
        block_c = 1
        block_w = min(64 if gpu else 32, next_power_of_2(group_w))
        pixels = (128 * values if gpu else 1024) // phases
    rows = max(1, pixels // (block_w * block_c))
    block_h = min(next_power_of_2(group_h), 1 << (rows.bit_length() - 1))
    return block_h, block_w, block_c, max(1, min(8, block_h * block_w * block_c // (32 * values)))


def grad_out_shifts(pad: int, dilation: int, stride: int, kernel: int) -> Tuple[int, int]:
    """(first, count) of the shifts t = (phase + pad - k * dilation) / stride, over the phases and
    taps where the division is exact: the grad_out rows (or columns) a group of input pixels meets."""
    shifts = [(phase + pad - k * dilation) // stride for phase in range(stride) for k in range(kernel)
              if (phase + pad - k * dilation) % stride == 0]
    return min(shifts), max(shifts) - min(shifts) + 1


def _grad_input_plan(geom: ConvGeometry, grad_out: torch.Tensor, dx: torch.Tensor) -> LaunchPlan:
    block_h, block_w, block_c, num_warps = grad_input_blocks(geom, channels_last_kernel_applies(grad_out, dx),
                                                               gpu_plan(grad_out.device))
    tiles = cdiv(cdiv(geom.in_h, geom.stride_h), block_h) * cdiv(cdiv(geom.in_w, geom.stride_w), block_w)
    index_64 = plane_needs_int64(grad_out, (geom.out_h, geom.out_w)) or plane_needs_int64(dx, (geom.in_h, geom.in_w))
    scalars = (geom.in_channels, geom.in_h, geom.in_w, geom.out_h, geom.out_w, *grad_out.stride(), *dx.stride())
    first_shift_h, shifts_h = grad_out_shifts(geom.pad_top, geom.dilation_h, geom.stride_h, geom.kernel_h)
    first_shift_w, shifts_w = grad_out_shifts(geom.pad_left, geom.dilation_w, geom.stride_w, geom.kernel_w)
    constants = dict(
        STRIDE_H=geom.stride_h, STRIDE_W=geom.stride_w, PAD_TOP=geom.pad_top, PAD_LEFT=geom.pad_left,
        DILATION_H=geom.dilation_h, DILATION_W=geom.dilation_w, MULTIPLIER=geom.multiplier, KH=geom.kernel_h,
        KW=geom.kernel_w, SHARED_LOADS=geom.kernel_h * geom.kernel_w <= SHARED_LOAD_TAPS,
        FIRST_SHIFT_H=first_shift_h, SHIFTS_H=shifts_h, FIRST_SHIFT_W=first_shift_w, SHIFTS_W=shifts_w,
        INDEX_64=index_64, ACC_DTYPE=_ACC_DTYPES.get(dx.dtype, tl.float32), BLOCK_H=block_h, BLOCK_W=block_w,
        BLOCK_C=block_c, num_warps=num_warps,
    )
    return LaunchPlan("grad_input", (geom.batch * cdiv(geom.in_channels, block_c) * tiles,), scalars, constants)


@dataclass(frozen=True)
class GradWeightConfig:
    block_w: int  # output columns a program covers per row
    num_warps: int
    vec: int  # output columns a thread owns (4: window loads; stride_w 1 only)
    splits: int  # programs per output channel
    rows: int = 1  # grad_out rows a loop step handles (more loads in flight on narrow planes)
    block_c: int = 1  # channels a program covers (channels_last kernel)


def grad_weight_config(geom: ConvGeometry, x: torch.Tensor) -> GradWeightConfig:
    """Block sizes for the grad_weight kernel (measured choices: docs/notes.md)."""
    total_rows = geom.batch * geom.out_h
    if not gpu_plan(x.device):  # interpreter: few, large programs
        block_w = min(32, next_power_of_2(geom.out_w))
        return GradWeightConfig(block_w, 1, 1, min(geom.batch, total_rows))
    # Session-3 sweep: 4 grad_out rows a step (their loads in flight together) except for k7 and up
    # (49 taps x 4 rows of registers), about 16384 programs; 4-vectors: one a thread for float32
    # (#84 2.12 ms), two for half precision (bf16 1.64 ms); narrow planes: two columns a thread.
    rows = 4 if geom.kernel_h * geom.kernel_w <= 25 else 1
    vec = 4 if (geom.stride_w == 1 and _stride_unit(x, 4, geom.in_w) == 4 and geom.out_w > 128) else 1
    block_w = min(512 if vec > 1 else 64, next_power_of_2(geom.out_w))
    per_thread = (1 if x.element_size() >= 4 else 2) if vec > 1 else 2
    items = cdiv(total_rows, rows) * cdiv(geom.out_w, block_w)
    splits = min(items, cdiv(16384, geom.out_channels))
    return GradWeightConfig(block_w, max(1, block_w // (vec * 32 * per_thread)), vec, splits, rows)


def conv_grad_weight(grad_out: torch.Tensor, x: torch.Tensor, geom: ConvGeometry, weight_dtype: torch.dtype,
                     bias_grad: bool, config=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """grad of the weight (C*m, 1, kH, kW) and, when bias_grad, of the bias (C*m,). config: a
    GradWeightConfig, or for channels_last tensors an "nhwc_pixels" ForwardConfig (the tiles of
    depthwise_grad_nhwc_pixels_kernel)."""
    if grad_out.numel() == 0:
        grad_w = torch.zeros((geom.out_channels, 1, geom.kernel_h, geom.kernel_w), device=x.device, dtype=weight_dtype)
        return grad_w, (torch.zeros(geom.out_channels, device=x.device, dtype=weight_dtype) if bias_grad else None)
    if config is None and large_fma_applies(geom, x, backward=True):
        return large_fma_grad_weight(grad_out, x, geom, weight_dtype, bool(bias_grad))
    if config is None and toeplitz_applies(geom, x.dtype):
        return toeplitz_grad_weight(grad_out, x, geom, weight_dtype, bool(bias_grad))
    if isinstance(config, ForwardConfig) or (config is None and grad_weight_pixels_applies(geom, x, grad_out)):
        return _launch_nhwc_pixels_grad(geom, grad_out, x, None, None, config, None, bool(bias_grad), weight_dtype)
    plan = cached_plan(_GRAD_WEIGHT_PLANS, (geom, config, layout_key(grad_out), layout_key(x), bool(bias_grad)),
                       lambda: _grad_weight_plan(geom, config, grad_out, x, bool(bias_grad)))
    partial = new_partial(plan, x.device)
    kernel = depthwise_grad_weight_nhwc_kernel if plan.kernel == "grad_weight_nhwc" else depthwise_grad_weight_kernel
    launch(kernel, plan, grad_out, x, partial)
    return sum_partials(partial, geom, weight_dtype, bool(bias_grad))  # (partial[out_c, split, padded taps])


_GRAD_WEIGHT_PLANS: dict = {}


def _grad_weight_plan(geom: ConvGeometry, config: Optional[GradWeightConfig], grad_out: torch.Tensor,
                      x: torch.Tensor, bias_grad: bool) -> LaunchPlan:
    if channels_last_kernel_applies(x, grad_out):
        return _grad_weight_nhwc_plan(geom, config, grad_out, x, bias_grad)
    if config is None:
        config = grad_weight_config(geom, x)
    vec, block_w = config.vec, config.block_w
    total_rows = geom.batch * geom.out_h
    splits = max(1, min(config.splits, cdiv(total_rows, config.rows) * cdiv(geom.out_w, block_w)))
    padded_taps = next_power_of_2(geom.kernel_h * geom.kernel_w + int(bias_grad))
    assert vec == 1 or (geom.stride_w == 1 and x.stride(3) == 1), "vec > 1 needs unit column steps"
    window_off, window_lane0, window_vecs = window_layout(geom, vec)
    x_unit = _stride_unit(x, vec, geom.in_w)
    g_unit = _stride_unit(grad_out, vec, geom.out_w)
    index_64 = plane_needs_int64(x, (geom.in_h, geom.in_w)) or plane_needs_int64(grad_out, (geom.out_h, geom.out_w))
    scalars = (geom.out_channels, geom.in_h, geom.in_w // x_unit, geom.out_h, geom.out_w // g_unit, total_rows, splits,
               *[s // x_unit for s in x.stride()[:3]], x.stride(3), *[s // g_unit for s in grad_out.stride()[:3]],
               grad_out.stride(3), geom.stride_h, geom.stride_w, geom.pad_top, geom.pad_left)
    constants = dict(
        MULTIPLIER=geom.multiplier, KH=geom.kernel_h, KW=geom.kernel_w, DILATION_H=geom.dilation_h,
        DILATION_W=geom.dilation_w, BIAS_GRAD=bias_grad, INDEX_64=index_64,
        ACC_DTYPE=_ACC_DTYPES.get(x.dtype, tl.float32), TAPS=padded_taps, BLOCK_W=block_w, VEC=vec,
        WINDOW_OFF=window_off, WINDOW_LANE0=window_lane0, WINDOW_VECS=window_vecs, X_UNIT=x_unit, G_UNIT=g_unit,
        ROWS=config.rows, num_warps=config.num_warps,
    )
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return LaunchPlan("grad_weight", (geom.out_channels * splits,), scalars, constants,
                      (geom.out_channels, splits, padded_taps), acc_dtype)


def grad_weight_pixels_applies(geom: ConvGeometry, x: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """Where the channels_last weight gradient runs on the unrolled pixels
    (depthwise_grad_nhwc_pixels_kernel) rather than depthwise_grad_weight_nhwc_kernel: on the GPU,
    kernels the forward unrolls too (session 9 probe, H200: the latter took 27.9 ms for #84's
    bfloat16 weight gradient; whose per-tile sums over pixels cross threads)."""
    return (gpu_plan(x.device) and channels_last_kernel_applies(x, grad_out)
            and geom.kernel_h * geom.kernel_w <= PIXEL_KERNEL_TAPS)


def grad_weight_nhwc_config(geom: ConvGeometry, x: torch.Tensor) -> GradWeightConfig:
    """Channels_last: tiles of 16 pixels by up to 64 channels; about 1024 programs in all (each
    writes TAPS partial sums per channel, so more programs mean a larger second pass)."""
    block_c = min(64, next_power_of_2(geom.out_channels))
    block_w = min(16, next_power_of_2(geom.out_w))
    tiles = geom.batch * geom.out_h * cdiv(geom.out_w, block_w)
    programs = 1024 if gpu_plan(x.device) else 4  # (interpreter: the work is the same however it is split)
    splits = min(tiles, cdiv(programs, cdiv(geom.out_channels, block_c)))
    return GradWeightConfig(block_w, 4, 1, splits, block_c=block_c)


def _grad_weight_nhwc_plan(geom: ConvGeometry, config: Optional[GradWeightConfig], grad_out: torch.Tensor,
                           x: torch.Tensor, bias_grad: bool) -> LaunchPlan:
    if config is None:
        config = grad_weight_nhwc_config(geom, x)
    tiles = geom.batch * geom.out_h * cdiv(geom.out_w, config.block_w)
    splits = max(1, min(config.splits, tiles))
    padded_taps = next_power_of_2(geom.kernel_h * geom.kernel_w + int(bias_grad))
    index_64 = image_needs_int64(x, grad_out)
    scalars = (geom.out_channels, geom.in_h, geom.in_w, geom.out_h, geom.out_w, tiles, splits,
               x.stride(0), x.stride(2), x.stride(3), grad_out.stride(0), grad_out.stride(2), grad_out.stride(3),
               geom.stride_h, geom.stride_w, geom.pad_top, geom.pad_left, geom.dilation_h, geom.dilation_w)
    constants = dict(MULTIPLIER=geom.multiplier, KH=geom.kernel_h, KW=geom.kernel_w, BIAS_GRAD=bias_grad,
                     INDEX_64=index_64, ACC_DTYPE=_ACC_DTYPES.get(x.dtype, tl.float32), TAPS=padded_taps,
                     BLOCK_W=config.block_w, BLOCK_C=config.block_c, num_warps=config.num_warps)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return LaunchPlan("grad_weight_nhwc", (splits, cdiv(geom.out_channels, config.block_c)), scalars, constants,
                      (geom.out_channels, splits, padded_taps), acc_dtype)
