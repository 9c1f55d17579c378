"""Large kernels on the tensor cores: the forward and the weight gradient as Toeplitz matrix products.

A depthwise convolution has no channel reduction, so it has no matrix product of its own. Along one
row it is a product with a band (Toeplitz) matrix: for kernel row kh, a row of output columns
j = 0 .. BLOCK_W-1 is

    y[row, j] += sum_i x[row * stride_h + kh * dilation_h, first_col + i] * T_kh[i, j],
    T_kh[i, j] = w[kh, (i - j * stride_w) / dilation_w]  (zero where that is not a tap),

with i running over the BLOCK_K input columns the strip reads. So a program takes BLOCK_M tiles
of OUT_ROWS output rows (of any images of its channel: tiles are numbered over batch x tiles a
column) by BLOCK_W columns, and for each input row the tiles span loads a [BLOCK_M, BLOCK_K] input
tile once and adds one `tl.dot` with the bands T_kh of all OUT_ROWS output rows side by side (from
zero-padded weight rows the launcher builds; OUT_ROWS 1: one band a kernel row). BLOCK_K / kernel_w
is the arithmetic spent on T's zeros (2 to 4 at the chosen widths): the loads, not the products,
bound these kernels on the H200. float32 uses three TF32 products of its
operands' high and low parts (float32 accuracy); float16 / bfloat16 multiply natively; all
accumulate in float32.

The weight gradient is the same product turned around: for kernel row kh,
C = grad_out_tile^T @ x_tile ([BLOCK_W, BLOCK_K], a sum over rows), and dw[kh, kw] is the sum of
C's diagonal C[j, j * stride_w + kw * dilation_w]; KH_ROWS kernel rows share a pass (one x tile
a row, grad_out's rows shifted side by side). One float32 partial sum per program and tap, added
in a fixed order by the launcher (deterministic, no atomics).

The kernels read rows with unit column steps; a channels_last tensor is copied to NCHW first, by
layout.py's transposes. float64 stays on the CUDA-core kernels. The grad_input of stride 1 is
this forward of grad_out with the flipped weight (dispatch.py).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._env import triton_interpreter_enabled
from .._geometry import ConvGeometry, cdiv, next_power_of_2
from ..tuning import tuned
from ._launch import LaunchPlan, cached_plan, gpu_plan, launch, layout_key, new_partial, plan_cache
from ._shared import _activate, dividing_unit, needs_int64
from .layout import copy_into, nchw_copy
from .weight_sums import sum_partials


@triton.jit
def _tile_rows(rows, total_rows, out_h, out_c, MULTIPLIER: tl.constexpr, x_stride_n, x_stride_c,
               g_stride_n, g_stride_c, stride_h, pad_top, UNIT: tl.constexpr, INDEX_64: tl.constexpr):
    """Rows numbered over batch x out_h: which exist, their row in the plane, the first input row each
    reads (kernel row 0), and the offsets of the input and the output (or grad_out) plane they lie in
    (plane strides in UNITs: the compiler then knows every row start is a multiple of UNIT)."""
    row_ok = rows < total_rows
    n = (rows // out_h).to(tl.int64)
    out_row = rows % out_h
    if INDEX_64:
        out_row = out_row.to(tl.int64)
    x_base = (n * x_stride_n + (out_c // MULTIPLIER).to(tl.int64) * x_stride_c) * UNIT
    g_base = (n * g_stride_n + out_c.to(tl.int64) * g_stride_c) * UNIT
    return row_ok, out_row, out_row * stride_h - pad_top, x_base, g_base


@triton.jit
def _strip_window(first_col, stride_w, pad_shift, pad_up, in_w, UNIT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The BLOCK_K input columns a strip reads, from the multiple of UNIT at or below its first one
    (so that rows load as UNIT-wide vectors), which of them exist, and `shift`: where the strip's first
    column lies in the window. pad_up (a multiple of UNIT, in UNITs) = pad_left + pad_shift."""
    start = first_col * stride_w + pad_shift  # (>= 0: floor division means the same everywhere)
    in_cols = (start // UNIT - pad_up) * UNIT + tl.arange(0, BLOCK_K)
    return in_cols, (in_cols >= 0) & (in_cols < in_w * UNIT), start % UNIT


@triton.jit
def _tf32_parts(x):
    """x = high + low, high with TF32's 10 mantissa bits (truncated: two bit operations, where
    rounding to nearest takes ~6 instructions an element on sm_90). The tensor cores read only
    low's top 10 mantissa bits too, so high * high + high * low + low * high misses ~2^-20 of x * y."""
    high = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return high, x - high


@triton.jit
def _product(a, b, acc, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SPLIT_TF32: tl.constexpr):
    """acc + a @ b on the tensor cores. SPLIT_TF32 (float32 operands): three TF32 products of the
    operands' parts, the small ones first, as Triton's "tf32x3" does, with the cheaper split. The
    three sum into a fresh accumulator, added to acc on the CUDA cores: the tensor cores' own
    accumulation truncates (k31: 1.1e-5 of the largest output against 3.7e-7)."""
    if SPLIT_TF32:
        a_high, a_low = _tf32_parts(a)
        b_high, b_low = _tf32_parts(b)
        product = tl.dot(a_low, b_high, tl.zeros_like(acc), input_precision="tf32")
        product = tl.dot(a_high, b_low, product, input_precision="tf32")
        return acc + tl.dot(a_high, b_high, product, input_precision="tf32")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision=PRECISION)


@triton.jit
def _input_tile(a_ptrs, in_rows, row_ok, col_ok, in_h, x_stride_h, UNIT: tl.constexpr):
    """The window's columns of input rows in_rows (one a program row; zero outside the image)."""
    a_ok = (row_ok & (in_rows >= 0) & (in_rows < in_h))[:, None] & col_ok[None, :]
    return tl.load(a_ptrs + (in_rows * (x_stride_h * UNIT))[:, None], mask=a_ok, other=0.0)


@triton.jit
def _bands(band_ptrs, step, tile_row, stride_h, dilation_h, w_kh_stride, KH: tl.constexpr, OUT_ROWS: tl.constexpr,
           ROW_STEP: tl.constexpr):
    """The bands that input row `step` (of a tile's span, ROW_STEP rows apart) meets: for output row
    tile_row of a tile, T_kh with kh * dilation_h = step * ROW_STEP - tile_row * stride_h, zero where
    that is no kernel row (OUT_ROWS 1: step is the kernel row, every band exists)."""
    if OUT_ROWS == 1:
        return tl.load(band_ptrs + step * w_kh_stride)
    offset = step * ROW_STEP - tile_row * stride_h
    kh = offset // dilation_h
    is_tap = (offset >= 0) & (offset % dilation_h == 0) & (kh < KH)
    return tl.load(band_ptrs + (tl.where(is_tap, kh, 0) * w_kh_stride)[None, :], mask=is_tap[None, :], other=0.0)


@triton.jit
def depthwise_fwd_toeplitz_kernel(
    x_ptr, w_rows_ptr, b_ptr, y_ptr,
    out_channels, in_h, in_w, out_h, out_w, tiles_h, total_tiles,
    x_stride_n, x_stride_c, x_stride_h, y_stride_n, y_stride_c, y_stride_h,
    stride_h, stride_w, pad_top, pad_shift, pad_up, dilation_h, w_row_len,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SPLIT_TF32: tl.constexpr, UNIT: tl.constexpr,
    INDEX_64: tl.constexpr, BAND_VECTOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
    OUT_ROWS: tl.constexpr, ROW_STEP: tl.constexpr, STEPS: tl.constexpr, PREFETCH: tl.constexpr,
    OUT_UNIT: tl.constexpr,
):
    """One program = BLOCK_M tiles of OUT_ROWS output rows x BLOCK_W columns of one output channel
    (tiles numbered over batch x tiles_h; unit column steps; x's in_w and strides in UNITs, y's
    strides in OUT_UNITs, so that the compiler knows rows start on whole vectors). It walks
    the STEPS input rows a tile spans (ROW_STEP apart; OUT_ROWS 1: the kernel rows), loads each
    row's window once and multiplies it with the bands of every output row of the tile that reads
    it, side by side in one product: an input row loaded once feeds OUT_ROWS output rows (the input
    tile's loads bound these kernels: module docstring). w_rows: BAND_VECTOR copies of each padded
    kernel row, copy r starting r elements further (padded_weight_rows). PREFETCH (OUT_ROWS 1): the
    next kernel row's input tile is loaded before this row's product (plain loads, cached in L1, in
    flight during the product)."""
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(out_w, BLOCK_W)
    row_blocks = tl.cdiv(total_tiles, BLOCK_M)
    out_c = pid // (row_blocks * tiles_w)
    first_col = (pid % tiles_w) * BLOCK_W
    tiles = ((pid // tiles_w) % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    tile_ok, tile, first_in_row, x_base, _ = _tile_rows(
        tiles, total_tiles, tiles_h, out_c, MULTIPLIER, x_stride_n, x_stride_c, 0, 0, stride_h * OUT_ROWS, pad_top,
        UNIT, INDEX_64)
    in_cols, col_ok, shift = _strip_window(first_col, stride_w, pad_shift, pad_up, in_w, UNIT, BLOCK_K)
    # the product's columns: OUT_ROWS output rows of BLOCK_W columns side by side
    tile_row = tl.arange(0, OUT_ROWS * BLOCK_W) // BLOCK_W
    cols = tl.arange(0, OUT_ROWS * BLOCK_W) % BLOCK_W
    # T[i, j] = row_kh[BAND0 - shift - j * stride_w + i], BAND0 = UNIT - 1 + (BLOCK_W - 1) * stride_w:
    # the launcher's zero-padded, dilated weight rows make each band one load. Column j's run starts
    # at `start`, one element further each column: no column of one row is aligned, but in the row's
    # copy start % BAND_VECTOR it starts at a multiple of BAND_VECTOR (whole-vector loads)
    start = UNIT - 1 + (BLOCK_W - 1) * stride_w - shift - cols * stride_w
    w_channel = w_rows_ptr + out_c.to(tl.int64) * (KH * BAND_VECTOR * w_row_len)  # (int64: past 2^31 elements)
    band_ptrs = w_channel + (tl.arange(0, BLOCK_K)[:, None]
                             + ((start % BAND_VECTOR) * w_row_len + (start // BAND_VECTOR) * BAND_VECTOR)[None, :])
    w_kh_stride = BAND_VECTOR * w_row_len
    a_ptrs = x_ptr + x_base[:, None] + in_cols[None, :]
    row_step = dilation_h if OUT_ROWS == 1 else ROW_STEP
    acc = tl.zeros([BLOCK_M, OUT_ROWS * BLOCK_W], dtype=tl.float32)
    if PREFETCH:
        next_a = _input_tile(a_ptrs, first_in_row, tile_ok, col_ok, in_h, x_stride_h, UNIT)
    for step in range(STEPS):
        if PREFETCH:
            a = next_a
            next_a = _input_tile(a_ptrs, first_in_row + (step + 1) * row_step, tile_ok & (step + 1 < STEPS), col_ok,
                                 in_h, x_stride_h, UNIT)
        else:
            a = _input_tile(a_ptrs, first_in_row + step * row_step, tile_ok, col_ok, in_h, x_stride_h, UNIT)
        bands = _bands(band_ptrs, step, tile_row, stride_h, dilation_h, w_kh_stride, KH, OUT_ROWS, ROW_STEP)
        acc = _product(a, bands, acc, DOT_DTYPE, PRECISION, SPLIT_TF32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + out_c).to(tl.float32)
    # one output row a row of the stored block ([tiles, rows x columns] -> [tiles x rows, columns]:
    # whole-vector stores along the columns, and an address a row, not one an element)
    out = tl.reshape(_activate(acc, ACTIVATION).to(y_ptr.dtype.element_ty), [BLOCK_M * OUT_ROWS, BLOCK_W])
    out_row = tl.reshape(tile[:, None] * OUT_ROWS + tl.arange(0, OUT_ROWS)[None, :], [BLOCK_M * OUT_ROWS])
    row_ok = tl.reshape(tl.broadcast_to(tile_ok[:, None], [BLOCK_M, OUT_ROWS]), [BLOCK_M * OUT_ROWS])
    n = tl.reshape(tl.broadcast_to((tiles // tiles_h)[:, None], [BLOCK_M, OUT_ROWS]), [BLOCK_M * OUT_ROWS])
    y_base = (n.to(tl.int64) * y_stride_n + out_c.to(tl.int64) * y_stride_c + out_row * y_stride_h) * OUT_UNIT
    out_cols = first_col + tl.arange(0, BLOCK_W)
    tl.store(y_ptr + y_base[:, None] + out_cols[None, :], out,
             mask=(row_ok & (out_row < out_h))[:, None] & (out_cols < out_w)[None, :])


@triton.jit
def depthwise_grad_weight_toeplitz_kernel(
    g_ptr, x_ptr, partial_ptr,
    out_channels, in_h, in_w, out_h, out_w, plane_rows, total_rows, rows_per_split, splits,
    x_stride_n, x_stride_c, x_stride_h, g_stride_n, g_stride_c, g_stride_h,
    stride_h, stride_w, pad_top, pad_shift, pad_up, dilation_h, dilation_w,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, KW_PAD: tl.constexpr, BIAS_GRAD: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SPLIT_TF32: tl.constexpr, UNIT: tl.constexpr,
    INDEX_64: tl.constexpr, TRANSPOSED: tl.constexpr, KH_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program = one output channel, BLOCK_W output columns, rows_per_split rows (a multiple of
    BLOCK_M): partial[out_c, split x column tile, tap] for every tap (and the bias after them).
    in_w, out_w and the strides of x and grad_out in UNITs.
    KH_ROWS kernel rows a pass over the rows (stride and dilation 1 across rows where > 1): row b of
    a plane (plane_rows = out_h + KH_ROWS - 1 of them) pairs x's row b - pad_top + kh0 with
    grad_out's rows b - d for kernel rows kh0 + d, side by side in one product, so each x row is
    loaded once for KH_ROWS kernel rows."""
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(out_w * UNIT, BLOCK_W)
    out_c = pid // (splits * tiles_w)
    part = pid % (splits * tiles_w)
    first_col = (part % tiles_w) * BLOCK_W
    first_row = (part // tiles_w) * rows_per_split
    in_cols, col_ok, shift = _strip_window(first_col, stride_w, pad_shift, pad_up, in_w, UNIT, BLOCK_K)
    # the product's columns: KH_ROWS kernel rows' BLOCK_W grad_out columns side by side
    kernel_row = tl.arange(0, KH_ROWS * BLOCK_W) // BLOCK_W
    cols = tl.arange(0, KH_ROWS * BLOCK_W) % BLOCK_W
    out_cols = first_col + cols
    out_col_ok = out_cols < out_w * UNIT
    # C[j, i] pairs grad_out column j with window column i; tap kw sits on i = shift + j * stride_w + kw * dilation_w
    kws = tl.arange(0, KW_PAD)
    diagonal = tl.minimum(shift + cols[:, None] * stride_w + kws[None, :] * dilation_w, BLOCK_K - 1)
    partial_row = partial_ptr + (out_c.to(tl.int64) * (splits * tiles_w) + part) * (KH * KW + BIAS_GRAD)
    bias_acc = tl.zeros([KH_ROWS * BLOCK_W], dtype=tl.float32)
    step_images, step_rows = BLOCK_M // plane_rows, BLOCK_M % plane_rows  # (a row block's step: images, then rows)
    for kh0 in range(0, KH, KH_ROWS):
        # C, or its transpose ([BLOCK_K, columns]: a product with BLOCK_K rows, which the H200's
        # warpgroup MMA takes from 64 rows on, where BLOCK_W is 16 or 32)
        products = tl.zeros([BLOCK_K, KH_ROWS * BLOCK_W] if TRANSPOSED else [KH_ROWS * BLOCK_W, BLOCK_K],
                            dtype=tl.float32)
        rows = first_row + tl.arange(0, BLOCK_M)
        _, plane_row, first_in_row, x_base, g_base = _tile_rows(
            rows, total_rows, plane_rows, out_c, MULTIPLIER, x_stride_n, x_stride_c, g_stride_n, g_stride_c,
            stride_h, pad_top, UNIT, INDEX_64)
        in_rows = first_in_row + kh0 * dilation_h
        g_offsets = g_base + plane_row * (g_stride_h * UNIT)
        x_offsets = x_base + in_rows * (x_stride_h * UNIT)
        g_columns = out_cols - kernel_row * (g_stride_h * UNIT)  # (kernel row kh0 + d: grad_out's row b - d)
        for m in range(first_row, tl.minimum(first_row + rows_per_split, total_rows), BLOCK_M):
            row_ok = rows < total_rows
            g_ok = row_ok[:, None] & out_col_ok[None, :]
            if KH_ROWS > 1:
                g_rows = plane_row[:, None] - kernel_row[None, :]
                g_ok &= (g_rows >= 0) & (g_rows < out_h)
            g = tl.load(g_ptr + g_offsets[:, None] + g_columns[None, :], mask=g_ok, other=0.0)
            a_ok = (row_ok & (in_rows >= 0) & (in_rows < in_h))[:, None] & col_ok[None, :]
            a = tl.load(x_ptr + x_offsets[:, None] + in_cols[None, :], mask=a_ok, other=0.0)
            # the next BLOCK_M rows, by steps of the offsets (a division by plane_rows a row was most
            # of this loop's instructions): rows_moved rows down, into the next image where they wrap
            wrap = (plane_row + step_rows >= plane_rows).to(plane_row.dtype)
            images = (step_images + wrap).to(tl.int64)
            rows_moved = step_rows - wrap * plane_rows
            plane_row += rows_moved
            in_rows += rows_moved * stride_h
            g_offsets += (images * g_stride_n + rows_moved * g_stride_h) * UNIT
            x_offsets += (images * x_stride_n + (rows_moved * stride_h) * x_stride_h) * UNIT
            rows += BLOCK_M
            if TRANSPOSED:
                products = _product(tl.trans(a), g, products, DOT_DTYPE, PRECISION, SPLIT_TF32)
            else:
                products = _product(tl.trans(g), a, products, DOT_DTYPE, PRECISION, SPLIT_TF32)
            if BIAS_GRAD:
                if kh0 == 0:  # (every grad_out row once: kernel row 0's columns)
                    bias_acc += tl.sum(tl.where((kernel_row == 0)[None, :], g.to(tl.float32), 0.0), axis=0)
        if TRANSPOSED:
            products = tl.trans(products)
        taps = tl.where(kws[None, :] < KW, tl.gather(products, diagonal, axis=1), 0.0)
        taps = tl.sum(tl.reshape(taps, [KH_ROWS, BLOCK_W, KW_PAD]), axis=1)
        kernel_rows = kh0 + tl.arange(0, KH_ROWS)
        tl.store(partial_row + kernel_rows[:, None] * KW + kws[None, :], taps,
                 mask=(kernel_rows < KH)[:, None] & (kws < KW)[None, :])
    if BIAS_GRAD:
        tl.store(partial_row + KH * KW, tl.sum(bias_acc, axis=0))


# ---- choosing and launching -------------------------------------------------------------------

def window_width(geom: ConvGeometry, block_w: int, unit: int = 1) -> int:
    """BLOCK_K: the input columns a strip of block_w output columns reads from the multiple of unit at
    or below its first (a power of 2, >= 16)."""
    reach = (block_w - 1) * geom.stride_w + (geom.kernel_w - 1) * geom.dilation_w + 1
    return max(16, next_power_of_2(window_shift(geom, block_w, unit) + reach))


def window_shift(geom: ConvGeometry, block_w: int, unit: int) -> int:
    """The most columns a strip's first input column lies past the multiple of unit at or below it.
    Strips start block_w * stride_w columns apart, so where that is a multiple of unit, every strip
    has the same offset, (-pad_left) mod unit (the kernels' `shift`): k31 with padding 15 then reads
    32 columns in 16-byte vectors from a 64-column window (1 + 62 columns) instead of 2-element ones."""
    return (-geom.pad_left) % unit if (block_w * geom.stride_w) % unit == 0 else unit - 1


def load_unit(geom: ConvGeometry, block_w: int, tensors, widths) -> int:
    """Elements a row load takes at once (16 bytes at most): the largest power of two dividing the
    rows' widths and the tensors' row, channel and batch strides (as the kernel reads them: NCHW
    copies of channels_last tensors) that does not widen the window."""
    unit = 16 // tensors[0].element_size()
    def read_strides(t):
        _, c, h, w = t.shape
        return t.stride()[:3] if t.stride(3) == 1 else (c * h * w, h * w, w)  # (copied NCHW-contiguous)
    strides = [s for t in tensors for s in read_strides(t)]
    while unit > 1 and (any(w % unit for w in widths) or any(s % unit for s in strides)
                        or window_width(geom, block_w, unit) > window_width(geom, block_w)):
        unit //= 2
    return unit


def store_unit(out: torch.Tensor, block_w: int) -> int:
    """Elements an output row store takes at once (16 bytes at most): the largest power of two
    dividing the output's batch, channel and row strides and the strip width."""
    return dividing_unit(16 // out.element_size(), (*out.stride()[:3], block_w))


def toeplitz_block_w(geom: ConvGeometry, x: torch.Tensor, grad_weight: bool = False) -> int:
    """The strip width: in half precision the fewest load instructions per output (each
    kernel row reloads the window: BLOCK_K / width / load unit), then the narrowest window; in float32
    (three TF32 products a kernel row) the narrowest window first. The weight gradient takes at least
    32 columns where the rows have them, and float32's at most 32 (docs/decisions.md, toeplitz)."""
    def cost(width):
        unit = load_unit(geom, width, (x,), (geom.in_w,))
        block_k = window_width(geom, width, unit)
        loads = block_k / width / unit
        return (block_k, loads, -width) if x.element_size() == 4 else (loads, block_k)
    widest = min(32 if grad_weight and x.element_size() == 4 else 64, max(16, next_power_of_2(geom.out_w)))
    narrowest = min(32 if grad_weight else 16, widest)
    return min((w for w in (16, 32, 64) if narrowest <= w <= widest), key=cost)


def toeplitz_out_rows(geom: ConvGeometry, x: torch.Tensor) -> int:
    """Output rows a forward tile takes: each input row it loads then feeds that many
    output rows' products. tuned().toeplitz_out_rows in half precision below the prefetch height, at
    unit row steps (the measured case); float32 (not timed) 1."""
    measured = geom.stride_h == geom.dilation_h == 1 and geom.kernel_h < tuned().toeplitz_prefetch_min_kernel_h
    return tuned().toeplitz_out_rows if x.element_size() == 2 and measured else 1


def toeplitz_num_warps(out_rows: int, block_m: int) -> int:
    """Warps of a forward program: 8 where its float32 accumulator (tiles x rows x 32-column
    strips) takes 64 KB or more, which on one warpgroup's 128 threads would be 128 registers a
    thread for it alone."""
    return 8 if out_rows * block_m >= 512 else 4


def toeplitz_block_m(x: torch.Tensor) -> int:
    """Output rows a forward product takes: 64 for float32, 128 for half precision."""
    return 64 if x.element_size() == 4 else 128


def _dot_types(dtype: torch.dtype) -> dict:
    """The products' constexprs: operand dtype, input_precision, and whether float32 operands are
    split in the kernel into three TF32 products (SPLIT_TF32; Triton's "tf32x3" spent most of the
    loop's instructions on its rounding split)."""
    if dtype == torch.float32:
        return dict(DOT_DTYPE=tl.float32, PRECISION="tf32", SPLIT_TF32=True)
    if dtype == torch.bfloat16 and triton_interpreter_enabled():  # (the interpreter's bfloat16 dot is wrong)
        return dict(DOT_DTYPE=tl.float32, PRECISION="ieee", SPLIT_TF32=False)
    return dict(DOT_DTYPE=tl.float16 if dtype == torch.float16 else tl.bfloat16, PRECISION="tf32", SPLIT_TF32=False)


def toeplitz_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geom: ConvGeometry,
                     out: torch.Tensor, block_m: Optional[int] = None, block_w: Optional[int] = None,
                     num_warps: Optional[int] = None, num_stages: Optional[int] = None, flip_weight: bool = False,
                     out_rows: Optional[int] = None, activation: int = 0) -> torch.Tensor:
    """Writes the convolution into out (allocated by the caller, any layout) and returns it.
    flip_weight: convolve with weight.flip(2, 3) (grad_input), without a flipped copy. out_rows:
    output rows a tile (toeplitz_out_rows); block_m: tiles a program. activation: a code
    of _geometry.ACTIVATION_CODES, applied to the outputs."""
    x = nchw_copy(x)
    out_rows = out_rows or toeplitz_out_rows(geom, x)
    block_m, num_stages = block_m or toeplitz_block_m(x), num_stages or tuned().toeplitz_num_stages
    num_warps = num_warps or toeplitz_num_warps(out_rows, block_m)
    dst = out if out.stride(3) == 1 else torch.empty(out.shape, device=out.device, dtype=out.dtype)
    plan = cached_plan(_PLANS, ("forward", geom, layout_key(x), layout_key(dst), bias is not None, block_m, block_w,
                                num_warps, num_stages, out_rows, activation),
                       lambda: _forward_plan(geom, x, dst, bias is not None, block_m, block_w, num_warps, num_stages,
                                             out_rows, activation))
    w_rows = padded_weight_rows(weight, geom, plan.constants["BLOCK_W"], plan.constants["BLOCK_K"],
                                plan.constants["UNIT"], plan.constants["BAND_VECTOR"], flip_weight)
    launch(depthwise_fwd_toeplitz_kernel, plan, x, w_rows, bias.contiguous() if bias is not None else w_rows, dst)
    if dst is not out:
        copy_into(out, dst)
    return out


_PLANS = plan_cache()


@triton.jit
def _band_rows_kernel(w_ptr, rows_ptr, row_elems, blocks, kernel_h, kernel_w, dilation_w, start, row_len, vector,
                      FLIP: tl.constexpr, BLOCK: tl.constexpr):
    """rows[c, j] = the tap of channel c that position j of its [kH, vector, row_len] row holds
    (padded_weight_rows), 0 where it holds none: BLOCK of one channel's row elements a program."""
    pid = tl.program_id(0)
    channel = (pid // blocks).to(tl.int64)
    j = (pid % blocks) * BLOCK + tl.arange(0, BLOCK)
    ok = j < row_elems
    kh = j // (vector * row_len)
    column = j % row_len + (j // row_len) % vector - start  # (copy r starts r elements further left)
    kw = column // dilation_w  # (negative columns hold no tap: masked below, whichever way // rounds)
    is_tap = ok & (column >= 0) & (column % dilation_w == 0) & (kw < kernel_w)
    if FLIP:  # (grad_input's flipped kernel)
        kh = kernel_h - 1 - kh
        kw = kernel_w - 1 - kw
    value = tl.load(w_ptr + channel * (kernel_h * kernel_w) + kh * kernel_w + kw, mask=is_tap, other=0.0)
    tl.store(rows_ptr + channel * row_elems + j, value, mask=ok)


def padded_weight_rows(weight: torch.Tensor, geom: ConvGeometry, block_w: int, block_k: int, unit: int,
                       vector: int, flip: bool = False) -> torch.Tensor:
    """[C*m, kH * vector * row_len] (a channel's [kH, vector, row_len], flat): each kernel row from
    unit - 1 + (block_w - 1) * stride_w on, its taps dilation_w apart, zeros around, in `vector`
    copies, copy r shifted r elements to the left (row_len >= unit - 1 + (block_w - 1) * stride_w +
    block_k, a multiple of 16; k31 bfloat16: 6.6 MB). The kernel reads every band from it unmasked,
    each band column in whole vectors. flip: of weight.flip(2, 3) (grad_input). One launch that
    works out each position's tap itself: torch ops cost host time, and a cached index tensor could
    not be replayed by the C++ path."""
    start, row_len = _band_row(geom, block_w, block_k, unit)
    weight = weight.contiguous()
    row_elems = geom.kernel_h * vector * row_len
    rows = torch.empty((geom.out_channels, row_elems), device=weight.device, dtype=weight.dtype)
    plan = cached_plan(_PLANS, ("band_rows", geom, start, row_len, vector, flip),
                       lambda: _band_rows_plan(geom, start, row_len, vector, flip))
    launch(_band_rows_kernel, plan, weight, rows)
    return rows


def _band_rows_plan(geom: ConvGeometry, start: int, row_len: int, vector: int, flip: bool) -> LaunchPlan:
    row_elems = geom.kernel_h * vector * row_len
    block = min(1024, next_power_of_2(row_elems))
    blocks = cdiv(row_elems, block)
    return LaunchPlan("band_rows", (geom.out_channels * blocks,),
                      (row_elems, blocks, geom.kernel_h, geom.kernel_w, geom.dilation_w, start, row_len, vector),
                      dict(FLIP=flip, BLOCK=block, num_warps=4))


def _band_row(geom: ConvGeometry, block_w: int, block_k: int, unit: int) -> Tuple[int, int]:
    """Where a padded weight row's first tap sits, and the row's length (a multiple of 16)."""
    start = unit - 1 + (block_w - 1) * geom.stride_w
    return start, cdiv(start + block_k, 16) * 16


def _small_batch_block(block_m: int, rows) -> int:
    """block_m, or where a small batch gives fewer rows (tiles) than that, their next power of two
    (at least 16). The test comes before the size: a trace with a dynamic batch then guards on the
    batch's range and keeps it symbolic past the small batches, where sizing it always specialised it."""
    return min(block_m, max(16, next_power_of_2(rows))) if rows < block_m else block_m


def _forward_plan(geom: ConvGeometry, x: torch.Tensor, out: torch.Tensor, has_bias: bool, block_m: int,
                  block_w: Optional[int], num_warps: int, num_stages: int, out_rows: int,
                  activation: int = 0) -> LaunchPlan:
    block_w = block_w or toeplitz_block_w(geom, x)
    unit = load_unit(geom, block_w, (x,), (geom.in_w,))
    tiles_h = cdiv(geom.out_h, out_rows)
    total_tiles = geom.batch * tiles_h
    block_k = window_width(geom, block_w, unit)
    # the input tile of a product at most 32 KB (its pipeline keeps 3 in shared memory: float32 k51
    # at 128 rows asked for 256 KB, over the H200's 227 KB)
    block_m = min(_small_batch_block(block_m, total_tiles), max(16, 32768 // (block_k * x.element_size())))
    # a tile's input rows: ROW_STEP apart (every row its output rows' taps read), STEPS of them
    row_step = math.gcd(geom.stride_h, geom.dilation_h)
    steps = geom.kernel_h if out_rows == 1 else \
        ((out_rows - 1) * geom.stride_h + (geom.kernel_h - 1) * geom.dilation_h) // row_step + 1
    pad_up = cdiv(geom.pad_left, unit)
    out_unit = store_unit(out, block_w)
    scalars = (geom.out_channels, geom.in_h, geom.in_w // unit, geom.out_h, geom.out_w, tiles_h, total_tiles,
               *[s // unit for s in x.stride()[:3]], *[s // out_unit for s in out.stride()[:3]],
               geom.stride_h, geom.stride_w, geom.pad_top,
               pad_up * unit - geom.pad_left, pad_up, geom.dilation_h, _band_row(geom, block_w, block_k, unit)[1])
    constants = dict(MULTIPLIER=geom.multiplier, KH=geom.kernel_h, HAS_BIAS=has_bias, ACTIVATION=activation,
                     **_dot_types(x.dtype),
                     UNIT=unit, BLOCK_M=block_m,
                     INDEX_64=needs_int64(x, out),
                     BAND_VECTOR=16 // x.element_size(),
                     PREFETCH=out_rows == 1 and geom.kernel_h >= tuned().toeplitz_prefetch_min_kernel_h,
                     OUT_ROWS=out_rows, ROW_STEP=row_step, STEPS=steps, OUT_UNIT=out_unit,
                     BLOCK_W=block_w, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    grid = (geom.out_channels * cdiv(total_tiles, block_m) * cdiv(geom.out_w, block_w),)
    return LaunchPlan("toeplitz", grid, scalars, constants)


def toeplitz_grad_weight(grad_out: torch.Tensor, x: torch.Tensor, geom: ConvGeometry, weight_dtype: torch.dtype,
                         bias_grad: bool, block_m: int = 64, block_w: Optional[int] = None,
                         rows_per_split: Optional[int] = None, num_warps: Optional[int] = None,
                         num_stages: Optional[int] = None, kh_rows: Optional[int] = None
                         ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """grad of the weight (C*m, 1, kH, kW) and, when bias_grad, of the bias; grad_out not empty.
    rows_per_split: rows a program sums (default: rows_a_program); kh_rows and num_warps: kernel
    rows a pass over them and the warps (default: toeplitz_grad_weight_kh_rows)."""
    grad_out, x = nchw_copy(grad_out), nchw_copy(x)
    num_stages = num_stages or tuned().toeplitz_num_stages
    plan = cached_plan(_PLANS, ("grad_weight", geom, layout_key(grad_out), layout_key(x), bias_grad, block_m,
                                block_w, rows_per_split, num_warps, num_stages, kh_rows),
                       lambda: _grad_weight_plan(geom, grad_out, x, bias_grad, block_m, block_w, rows_per_split,
                                                 num_warps, num_stages, kh_rows))
    partial = new_partial(plan, x.device)
    launch(depthwise_grad_weight_toeplitz_kernel, plan, grad_out, x, partial)
    return sum_partials(partial, geom, weight_dtype, bias_grad)


def toeplitz_grad_weight_kh_rows(geom: ConvGeometry, x: torch.Tensor, block_w: Optional[int] = None
                                 ) -> Tuple[int, int]:
    """Kernel rows a weight-gradient pass takes (KH_ROWS), and its warps: each x row it
    loads then feeds that many kernel rows' products. tuned().toeplitz_grad_weight_kh_rows where rows
    are one step apart and the pass's float32 products (window x kernel rows x strip) fit 64 x 128
    elements on 4 warps, or 128 x 256 on 8 (k51, which spills on 4); else one."""
    if tuned().toeplitz_grad_weight_kh_rows == 1 or geom.stride_h != 1 or geom.dilation_h != 1:
        return 1, 4
    block_w = block_w or toeplitz_block_w(geom, x, grad_weight=True)
    unit = load_unit(geom, block_w, (x,), (geom.in_w,))
    products = window_width(geom, block_w, unit) * tuned().toeplitz_grad_weight_kh_rows * block_w
    if products > 128 * 256:
        return 1, 4
    return tuned().toeplitz_grad_weight_kh_rows, 4 if products <= 64 * 128 else 8


def rows_a_program(total_rows: int, strips: int) -> int:
    """Rows a weight-gradient program sums (each program does every tap of one strip of one channel,
    then writes its partial sums): at most 1024 (H200, k31 bfloat16, 16-column strips: 1024 rows
    1.20 ms against 1.35 at ~4096 programs), fewer where that leaves under GRAD_WEIGHT_PROGRAMS
    programs (k51 half precision: 256 programs of 896 rows on 132 SMs; 512 of 448 now, not yet timed)."""
    return min(1024, cdiv(total_rows, max(1, cdiv(tuned().toeplitz_grad_weight_programs, strips))))


def _grad_weight_plan(geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor, bias_grad: bool, block_m: int,
                      block_w: Optional[int], rows_per_split: Optional[int], num_warps: Optional[int], num_stages: int,
                      kh_rows: Optional[int] = None) -> LaunchPlan:
    block_w = block_w or toeplitz_block_w(geom, x, grad_weight=True)
    unit = load_unit(geom, block_w, (x, grad_out), (geom.in_w, geom.out_w))
    default_rows, default_warps = toeplitz_grad_weight_kh_rows(geom, x, block_w)  # (once a plan, not a call)
    kh_rows, num_warps = kh_rows or default_rows, num_warps or default_warps
    assert kh_rows == 1 or geom.stride_h == geom.dilation_h == 1, "kernel rows side by side need unit row steps"
    plane_rows = geom.out_h + kh_rows - 1  # (grad_out's rows and the kh_rows - 1 below a plane: kernel_row d
    total_rows = geom.batch * plane_rows   # pairs row b with grad_out's b - d)
    block_m = _small_batch_block(block_m, total_rows)
    tiles_w = cdiv(geom.out_w, block_w)
    block_k = window_width(geom, block_w, unit)
    if rows_per_split is None:
        rows_per_split = rows_a_program(total_rows, geom.out_channels * tiles_w) if gpu_plan(x.device) \
            else total_rows
    rows_per_split = cdiv(rows_per_split, block_m) * block_m
    splits = cdiv(total_rows, rows_per_split)
    pad_up = cdiv(geom.pad_left, unit)
    scalars = (geom.out_channels, geom.in_h, geom.in_w // unit, geom.out_h, geom.out_w // unit, plane_rows,
               total_rows, rows_per_split, splits, *[s // unit for s in x.stride()[:3]],
               *[s // unit for s in grad_out.stride()[:3]],
               geom.stride_h, geom.stride_w, geom.pad_top, pad_up * unit - geom.pad_left, pad_up, geom.dilation_h,
               geom.dilation_w)
    constants = dict(MULTIPLIER=geom.multiplier, KH=geom.kernel_h, KW=geom.kernel_w,
                     KW_PAD=next_power_of_2(geom.kernel_w), BIAS_GRAD=bias_grad,
                     **_dot_types(x.dtype), UNIT=unit, BLOCK_M=block_m,
                     INDEX_64=needs_int64(x, grad_out),
                     TRANSPOSED=block_k >= 64 > block_w, KH_ROWS=kh_rows,
                     BLOCK_W=block_w, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    grid = (geom.out_channels * splits * tiles_w,)
    return LaunchPlan("grad_weight_toeplitz", grid, scalars, constants,
                      (geom.out_channels, splits * tiles_w, geom.kernel_h * geom.kernel_w + int(bias_grad)))
