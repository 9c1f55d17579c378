"""Kernels of 5x5 and up on the CUDA cores: every output one FMA chain, inputs reused from registers
(float32 at any size, float16 / bfloat16 below 13x13), and 3x3 up on narrow planes (dispatch.py
says where).

The Toeplitz path (toeplitz.py) multiplies float32 as three TF32 products, twice the work of the
convolution in zeros of the band, and on the H200 it is bound by moving each kernel row's input
tile through L1 and shared memory (k31 float32 forward 1.02 ms, 24 TFLOP/s of useful products,
where the float32 FMA peak is 67). Here a thread owns OUT_VEC
adjacent outputs of one output row. For each kernel row it loads the aligned 4-vectors covering
the input columns those outputs read (OUT_VEC + kernel_w - 1 of them at unit steps, a "window"),
then for each tap of the row multiplies the tap's weight into each output from a lane of the
window: KW * OUT_VEC FMAs for ~(OUT_VEC + KW) / 4 vector loads and KW weight loads. k31 at 28
outputs a thread: 868 FMAs, 15 loads of 16 bytes and 31 of the weight a kernel row, 86% of the
loop's sm_90 instructions, with no product spent on zeros (H200: 0.505 ms, 48.7 TFLOP/s: 85% of
what that share of issue slots allows at the 67 peak).

One program = BLOCK_H output rows (numbered over batch x out_h: a tile may span images) x BLOCK_W
columns of one channel; any stride, dilation, padding and multiplier (column steps above 1 as
constexprs: a thread's window then spans stride_w input columns an output). FLIP_TAPS: the
weight's taps in reverse (the stride-1 grad_input, as the other forward kernels do). The weight
gradient takes the same tiles with grad_out's values in place of the weights: KW sums a thread,
each an FMA chain over its outputs, reduced over the program at the end of each kernel row
(deterministic partial sums).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._geometry import ConvGeometry, cdiv, next_power_of_2
from ..tuning import tuned
from ._launch import LaunchPlan, cached_plan, gpu_plan, launch, layout_key, new_partial, plan_cache
from ._shared import _activate, _lane, _pack4, dividing_unit, needs_int64
from .layout import copy_into, nchw_copy
from .weight_sums import sum_partials

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # (what the kernels take: any geometry)


@triton.jit
def _load_window(x_row, group_cols, lanes, row_ok, in_w, WINDOW_OFF: tl.constexpr, WINDOW_VECS: tl.constexpr):
    """The lanes (a tuple of [R, G] float32) of the aligned 4-vectors of an input row from column
    group_cols - WINDOW_OFF on, zero outside the row and where row_ok is False."""
    window = ()
    for v in tl.static_range(WINDOW_VECS):
        cols = group_cols - WINDOW_OFF + 4 * v + lanes
        vector = tl.load(x_row + cols, mask=row_ok & (cols >= 0) & (cols < in_w), other=0.0)
        for lane in tl.static_range(4):
            window = window + (_lane(vector, lane, 4).to(tl.float32),)
    return window


# (the counts of rows, which follow the batch, bound masks and loops only: not specialised, so that
# another batch size compiles nothing; docs/decisions.md, "Cold start")
@triton.jit(do_not_specialize=["total_rows"])
def depthwise_fwd_large_fma_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    out_channels, in_h, in_w, out_h, out_w, total_rows,
    x_stride_n, x_stride_c, x_stride_h, y_stride_n, y_stride_c, y_stride_h,
    stride_h, dilation_h, pad_top,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, STRIDE_W: tl.constexpr, DILATION_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    FLIP_TAPS: tl.constexpr, INDEX_64: tl.constexpr, X_UNIT: tl.constexpr, Y_UNIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, OUT_VEC: tl.constexpr,
    WINDOW_OFF: tl.constexpr, WINDOW_LANE0: tl.constexpr, WINDOW_VECS: tl.constexpr, W_ROW: tl.constexpr,
):
    """x, y: NCHW with unit column steps; widths and strides in X_UNIT / Y_UNIT elements (so the
    compiler can prove the window's 4-vectors aligned). A thread's output i reads, through tap kw,
    window lane WINDOW_LANE0 + STRIDE_W * i + DILATION_W * kw of the vectors loaded from input
    column STRIDE_W * group_col - WINDOW_OFF on (a multiple of 4, as OUT_VEC is). Rows are
    numbered over batch x out_h (total_rows) for one channel a program: a row tile may span images,
    so planes shorter than BLOCK_H waste no rows, and the weight stays one value a tap."""
    in_w = in_w * X_UNIT
    out_w = out_w * Y_UNIT
    GROUPS: tl.constexpr = BLOCK_W // OUT_VEC
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(out_w, BLOCK_W)
    tiles = tl.cdiv(total_rows, BLOCK_H) * tiles_w
    out_c = pid // tiles
    tile = pid % tiles
    rows = (tile // tiles_w) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None, None]
    live = rows < total_rows  # (past the last image: no loads, no stores)
    n = (rows // out_h).to(tl.int64)
    out_rows = rows % out_h
    x_base = x_ptr + (n * x_stride_n + (out_c // MULTIPLIER).to(tl.int64) * x_stride_c) * X_UNIT
    y_base = y_ptr + (n * y_stride_n + out_c.to(tl.int64) * y_stride_c) * Y_UNIT
    group_cols = (tile % tiles_w) * BLOCK_W + OUT_VEC * tl.arange(0, GROUPS)[None, :, None]
    lanes = tl.arange(0, 4)[None, None, :]
    if INDEX_64:
        out_rows = out_rows.to(tl.int64)
    first_in_rows = out_rows * stride_h - pad_top
    start = tl.zeros([BLOCK_H, GROUPS], dtype=tl.float32)
    if HAS_BIAS:
        start += tl.load(b_ptr + out_c).to(tl.float32)
    accs = ()
    for i in tl.static_range(OUT_VEC):
        accs = accs + (start,)
    w_plane = w_ptr + out_c.to(tl.int64) * (KH * W_ROW)
    for kh in range(KH):
        in_rows = first_in_rows + kh * dilation_h
        x_row = x_base + in_rows * (x_stride_h * X_UNIT)
        row_ok = live & (in_rows >= 0) & (in_rows < in_h)
        window = _load_window(x_row, STRIDE_W * group_cols, lanes, row_ok, in_w, WINDOW_OFF, WINDOW_VECS)
        w_row = w_plane + ((KH - 1 - kh) * W_ROW if FLIP_TAPS else kh * W_ROW)
        if W_ROW != KW:  # (rows padded to 4-vectors: the row's taps in W_ROW / 4 aligned loads)
            taps = ()
            for v in tl.static_range(W_ROW // 4):
                vector = tl.load(w_row + 4 * v + lanes)
                for lane in tl.static_range(4):
                    taps = taps + (_lane(vector, lane, 4).to(tl.float32),)
        for kw in tl.static_range(KW):
            if W_ROW != KW:
                weight = taps[KW - 1 - kw if FLIP_TAPS else kw]
            else:
                weight = tl.load(w_row + (KW - 1 - kw if FLIP_TAPS else kw)).to(tl.float32)
            for i in tl.static_range(OUT_VEC):
                pixel = window[WINDOW_LANE0 + STRIDE_W * i + DILATION_W * kw]
                accs = accs[:i] + (tl.fma(pixel, weight, accs[i]),) + accs[i + 1:]
    y_rows = y_base + out_rows * (y_stride_h * Y_UNIT)
    for q in tl.static_range(OUT_VEC // 4):
        cols = group_cols + 4 * q + lanes
        value = _activate(_pack4(accs[4 * q], accs[4 * q + 1], accs[4 * q + 2], accs[4 * q + 3]), ACTIVATION)
        tl.store(y_rows + cols, value.to(y_ptr.dtype.element_ty), mask=live & (cols < out_w))


@triton.jit(do_not_specialize=["total_rows", "rows_per_split", "splits"])
def depthwise_grad_weight_large_fma_kernel(
    g_ptr, x_ptr, partial_ptr,
    out_channels, in_h, in_w, out_h, out_w, total_rows, rows_per_split, splits,
    x_stride_n, x_stride_c, x_stride_h, g_stride_n, g_stride_c, g_stride_h,
    stride_h, dilation_h, pad_top,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, STRIDE_W: tl.constexpr, DILATION_W: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    X_UNIT: tl.constexpr, G_UNIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, OUT_VEC: tl.constexpr,
    WINDOW_OFF: tl.constexpr, WINDOW_LANE0: tl.constexpr, WINDOW_VECS: tl.constexpr,
):
    """The weight gradient with the forward's tiles: a thread holds OUT_VEC grad_out values of a
    row and, for each kernel row, the input window under them, and adds their products into one
    float32 sum a tap (KW FMA chains, each OUT_VEC long). One program = one output channel, BLOCK_W
    columns, rows_per_split rows (numbered over batch x out_h): it sums its rows for one kernel row
    at a time, then reduces each tap over its threads and writes partial[out_c, split x column
    tile, tap] (the bias after the taps), summed in a fixed order by the launcher."""
    in_w = in_w * X_UNIT
    out_w = out_w * G_UNIT
    GROUPS: tl.constexpr = BLOCK_W // OUT_VEC
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(out_w, BLOCK_W)
    out_c = pid // (splits * tiles_w)
    part = pid % (splits * tiles_w)
    group_cols = (part % tiles_w) * BLOCK_W + OUT_VEC * tl.arange(0, GROUPS)[None, :, None]
    lanes = tl.arange(0, 4)[None, None, :]
    first_row = (part // tiles_w) * rows_per_split
    last_row = tl.minimum(first_row + rows_per_split, total_rows)
    x_channel = x_ptr + (out_c // MULTIPLIER).to(tl.int64) * (x_stride_c * X_UNIT)
    g_channel = g_ptr + out_c.to(tl.int64) * (g_stride_c * G_UNIT)
    partial_row = partial_ptr + (out_c.to(tl.int64) * (splits * tiles_w) + part) * (KH * KW + BIAS_GRAD)
    bias_sum = tl.zeros([BLOCK_H, GROUPS], dtype=tl.float32)
    for kh in range(KH):
        sums = ()
        for kw in tl.static_range(KW):
            sums = sums + (tl.zeros([BLOCK_H, GROUPS], dtype=tl.float32),)
        for m in range(first_row, last_row, BLOCK_H):
            rows = m + tl.arange(0, BLOCK_H)[:, None, None]
            row_ok = rows < last_row
            n = (rows // out_h).to(tl.int64)
            out_rows = (rows % out_h).to(tl.int64)  # (64-bit: row offsets inside a plane too)
            g_row = g_channel + (n * g_stride_n + out_rows * g_stride_h) * G_UNIT
            grads = ()
            for q in tl.static_range(OUT_VEC // 4):
                cols = group_cols + 4 * q + lanes
                vector = tl.load(g_row + cols, mask=row_ok & (cols < out_w), other=0.0)
                for lane in tl.static_range(4):
                    grads = grads + (_lane(vector, lane, 4).to(tl.float32),)
            if BIAS_GRAD:
                if kh == 0:
                    for i in tl.static_range(OUT_VEC):
                        bias_sum += grads[i]
            in_rows = out_rows * stride_h - pad_top + kh * dilation_h
            x_row = x_channel + (n * x_stride_n + in_rows * x_stride_h) * X_UNIT
            in_ok = row_ok & (in_rows >= 0) & (in_rows < in_h)
            window = _load_window(x_row, STRIDE_W * group_cols, lanes, in_ok, in_w, WINDOW_OFF, WINDOW_VECS)
            for kw in tl.static_range(KW):
                total = sums[kw]
                for i in tl.static_range(OUT_VEC):
                    total = tl.fma(window[WINDOW_LANE0 + STRIDE_W * i + DILATION_W * kw], grads[i], total)
                sums = sums[:kw] + (total,) + sums[kw + 1:]
        for kw in tl.static_range(KW):
            tl.store(partial_row + kh * KW + kw, tl.sum(tl.sum(sums[kw], axis=1), axis=0))
    if BIAS_GRAD:
        tl.store(partial_row + KH * KW, tl.sum(tl.sum(bias_sum, axis=1), axis=0))


# ---- blocks and launching ---------------------------------------------------------------------------

def large_fma_forward_blocks(geom: ConvGeometry, x: torch.Tensor):
    """The forward's blocks (large_fma_blocks), whole rows of up to 56 for large float32 kernels."""
    whole_rows = (x.dtype == torch.float32 and geom.kernel_h * geom.kernel_w >= tuned().large_fma_whole_row_min_taps
                  and geom.kernel_w <= tuned().large_fma_whole_row_max_kernel_w)
    return large_fma_blocks(geom, gpu_plan(x.device), tuned().large_fma_whole_row_max_vec if whole_rows else 32)


def large_fma_blocks(geom: ConvGeometry, on_gpu: bool = True, max_vec: int = 32):
    """(block_h, block_w, num_warps, out_vec): out_vec outputs a thread, a multiple of 4 up to max_vec
    that wastes the fewest columns of a row (then the largest), one output row of a group a thread,
    the fewest wasted rows over batch x out_h (then the fewest warps) over 1, 2 or 4 warps (k31 and
    k51 on 56 x 56: 16 x 56 on one warp, 28 a thread). Under the interpreter (on_gpu False: a
    program costs by its tensor operations, not their size) the most warps on ties."""
    def waste(vec):
        block_w = min(32, next_power_of_2(cdiv(geom.out_w, vec))) * vec
        return cdiv(geom.out_w, block_w) * block_w - geom.out_w

    out_vec = min(range(4, max_vec + 1, 4), key=lambda vec: (waste(vec), -vec))
    groups = min(32, next_power_of_2(cdiv(geom.out_w, out_vec)))
    total_rows = geom.batch * geom.out_h
    options = [(32 * warps // groups, warps) for warps in (1, 2, 4) if 32 * warps >= groups]
    block_h, warps = min(options, key=lambda o: (cdiv(total_rows, o[0]) * o[0], o[1] if on_gpu else -o[1]))
    return block_h, groups * out_vec, warps, out_vec


def _unit(t: torch.Tensor, width: int) -> int:
    """4 where the width and the row, channel and batch strides are multiples of 4 (16-byte rows
    of float32: aligned window vectors), else 1."""
    return 4 if dividing_unit(4, (width, *t.stride()[:3])) == 4 else 1


def large_fma_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geom: ConvGeometry,
                      out: torch.Tensor, flip_weight: bool = False, blocks=None, activation: int = 0) -> torch.Tensor:
    """Writes the convolution into out (any layout) and returns it; channels_last x is read from an
    NCHW copy, as the Toeplitz path does. blocks: (block_h, block_w, num_warps, out_vec).
    activation: a code of _geometry.ACTIVATION_CODES, applied to the outputs."""
    x = nchw_copy(x)
    dst = out if out.stride(3) == 1 else torch.empty(out.shape, device=out.device, dtype=out.dtype)
    # weight rows as padded 4-vectors (one F.pad a call: only for large kernels)
    weight_vectors = geom.kernel_h * geom.kernel_w >= tuned().weight_vectors_min_taps
    plan = cached_plan(_PLANS, (geom, layout_key(x), layout_key(dst), bias is not None, flip_weight, blocks,
                                weight_vectors, activation),
                       lambda: _plan(geom, x, dst, bias is not None, flip_weight,
                                     blocks or large_fma_forward_blocks(geom, x), weight_vectors, activation))
    w_row = plan.constants["W_ROW"]
    weight = weight.contiguous() if w_row == geom.kernel_w else F.pad(weight, (0, w_row - geom.kernel_w))
    launch(depthwise_fwd_large_fma_kernel, plan, x, weight, bias.contiguous() if bias is not None else weight, dst)
    if dst is not out:
        copy_into(out, dst)
    return out


_PLANS = plan_cache()


def large_fma_grad_weight(grad_out: torch.Tensor, x: torch.Tensor, geom: ConvGeometry, weight_dtype: torch.dtype,
                          bias_grad: bool, blocks=None, rows_per_split: Optional[int] = None):
    """grad of the weight (C*m, 1, kH, kW) and, when bias_grad, of the bias; grad_out not empty.
    rows_per_split: rows a program sums (default: rows_a_program)."""
    grad_out = nchw_copy(grad_out)
    x = nchw_copy(x)
    plan = cached_plan(_PLANS, ("grad_weight", geom, layout_key(grad_out), layout_key(x), bias_grad, blocks,
                                rows_per_split),
                       lambda: _grad_weight_plan(geom, grad_out, x, bias_grad,
                                                 blocks or large_fma_blocks(geom, gpu_plan(x.device)), rows_per_split))
    partial = new_partial(plan, x.device)
    launch(depthwise_grad_weight_large_fma_kernel, plan, grad_out, x, partial)
    return sum_partials(partial, geom, weight_dtype, bias_grad)


def rows_a_program(total_rows: int, strips: int, block_h: int) -> int:
    """Rows a weight-gradient program sums: about 4096 programs in all, and at least two row
    blocks (each kernel row ends in a reduction of every tap over the program's threads)."""
    return max(2 * block_h, cdiv(total_rows, max(1, 4096 // strips)))


def _fma_window(geom: ConvGeometry, out_vec: int):
    """(WINDOW_OFF, WINDOW_LANE0, WINDOW_VECS): a thread's window starts WINDOW_OFF columns left of
    its first output's input column, stride_w x its column (a multiple of 4, as group columns are:
    aligned 4-vectors), and holds the input of output i through tap kw in lane WINDOW_LANE0 +
    stride_w * i + dilation_w * kw of its WINDOW_VECS vectors."""
    window_off = cdiv(geom.pad_left, 4) * 4
    window_lane0 = window_off - geom.pad_left
    last_lane = window_lane0 + geom.stride_w * (out_vec - 1) + geom.dilation_w * (geom.kernel_w - 1)
    return window_off, window_lane0, cdiv(last_lane + 1, 4)


def _plan(geom: ConvGeometry, x: torch.Tensor, out: torch.Tensor, has_bias: bool, flip: bool, blocks,
          weight_vectors: bool, activation: int = 0) -> LaunchPlan:
    assert x.dtype in DTYPES, "large_fma: float32, float16 or bfloat16"
    block_h, block_w, num_warps, out_vec = blocks
    x_unit, y_unit = _unit(x, geom.in_w), _unit(out, geom.out_w)
    window_off, window_lane0, window_vecs = _fma_window(geom, out_vec)
    total_rows = geom.batch * geom.out_h
    scalars = (geom.out_channels, geom.in_h, geom.in_w // x_unit, geom.out_h, geom.out_w // y_unit, total_rows,
               *[s // x_unit for s in x.stride()[:3]], *[s // y_unit for s in out.stride()[:3]],
               geom.stride_h, geom.dilation_h, geom.pad_top)
    constants = dict(MULTIPLIER=geom.multiplier, KH=geom.kernel_h, KW=geom.kernel_w, STRIDE_W=geom.stride_w,
                     DILATION_W=geom.dilation_w, HAS_BIAS=has_bias, ACTIVATION=activation,
                     FLIP_TAPS=flip, INDEX_64=needs_int64(x, out),
                     X_UNIT=x_unit, Y_UNIT=y_unit, BLOCK_H=block_h, BLOCK_W=block_w, OUT_VEC=out_vec,
                     WINDOW_OFF=window_off, WINDOW_LANE0=window_lane0, WINDOW_VECS=window_vecs,
                     W_ROW=cdiv(geom.kernel_w, 4) * 4 if weight_vectors else geom.kernel_w, num_warps=num_warps)
    grid = (geom.out_channels * cdiv(total_rows, block_h) * cdiv(geom.out_w, block_w),)
    return LaunchPlan("large_fma", grid, scalars, constants)


def _grad_weight_plan(geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor, bias_grad: bool, blocks,
                      rows_per_split: Optional[int]) -> LaunchPlan:
    assert x.dtype in DTYPES, "large_fma: float32, float16 or bfloat16"
    block_h, block_w, num_warps, out_vec = blocks
    x_unit, g_unit = _unit(x, geom.in_w), _unit(grad_out, geom.out_w)
    window_off, window_lane0, window_vecs = _fma_window(geom, out_vec)
    total_rows = geom.batch * geom.out_h
    tiles_w = cdiv(geom.out_w, block_w)
    if rows_per_split is None:
        rows_per_split = rows_a_program(total_rows, geom.out_channels * tiles_w, block_h) if gpu_plan(x.device) \
            else total_rows
    rows_per_split = cdiv(rows_per_split, block_h) * block_h
    splits = cdiv(total_rows, rows_per_split)
    scalars = (geom.out_channels, geom.in_h, geom.in_w // x_unit, geom.out_h, geom.out_w // g_unit, total_rows,
               rows_per_split, splits, *[s // x_unit for s in x.stride()[:3]],
               *[s // g_unit for s in grad_out.stride()[:3]], geom.stride_h, geom.dilation_h, geom.pad_top)
    constants = dict(MULTIPLIER=geom.multiplier, KH=geom.kernel_h, KW=geom.kernel_w, STRIDE_W=geom.stride_w,
                     DILATION_W=geom.dilation_w, BIAS_GRAD=bias_grad,
                     X_UNIT=x_unit, G_UNIT=g_unit, BLOCK_H=block_h, BLOCK_W=block_w, OUT_VEC=out_vec,
                     WINDOW_OFF=window_off, WINDOW_LANE0=window_lane0, WINDOW_VECS=window_vecs, num_warps=num_warps)
    grid = (geom.out_channels * splits * tiles_w,)
    return LaunchPlan("grad_weight_large_fma", grid, scalars, constants,
                      (geom.out_channels, splits * tiles_w, geom.kernel_h * geom.kernel_w + int(bias_grad)))
