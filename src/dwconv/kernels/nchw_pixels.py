"""The nchw_pixels family: stride 1 on NCHW planes with unit column steps, as tiles of output pixels
(`depthwise_fwd_nchw_pixels_kernel`).

A thread holds 4 adjacent columns of BLOCK_H output rows; per input row it loads the aligned
4-vectors covering its outputs' columns and takes each output's input as a lane of them: every
output is one FMA chain over its taps, with no ring of partial rows and no zero-weight FMAs. With
WEIGHT_GRAD it is also the NCHW fused backward of 3x3 kernels.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._geometry import ConvGeometry, cdiv
from ..tuning import tuned
from ._launch import ForwardConfig, LaunchPlan, launch, new_partial
from ._shared import (_activate, _lane, _load_row_window, _pack4, _plane_pointers, _store_aligned_rows, _window_lane,
                      forward_constants, odd_out_rows_alignable, partial_dtype, stride_unit, window_fits,
                      window_layout)


@triton.jit
def _conv_nchw_pixels(x_base, y_base, weights, start, first_row, group_cols, lanes, zero, in_h, in_w, out_h, out_w,
                      x_stride_h, y_stride_h, pad_top, KH: tl.constexpr, KW: tl.constexpr,
                      DILATION_H: tl.constexpr, DILATION_W: tl.constexpr, ACC_DTYPE: tl.constexpr,
                      BLOCK_H: tl.constexpr, WINDOW_OFF: tl.constexpr, WINDOW_LANE0: tl.constexpr,
                      WINDOW_VECS: tl.constexpr, Y_UNIT: tl.constexpr, ODD_OUT_ALIGN: tl.constexpr,
                      WIDEN_BF16: tl.constexpr, ACTIVATION: tl.constexpr, MASKED: tl.constexpr,
                      WEIGHT_GRAD: tl.constexpr, weight_grads, features):
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
                                          WINDOW_OFF, WINDOW_VECS, 4, 0, False, MASKED, WIDEN_BF16)
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
            value = _activate(_pack4(accs[j * 4], accs[j * 4 + 1], accs[j * 4 + 2], accs[j * 4 + 3]),
                              ACTIVATION).to(y_base.dtype.element_ty)
            _store_aligned_rows(y_row + group_cols + lanes, value, group_cols - ODD_SHIFT * (j % 2), lanes,
                                out_row < out_h, out_w, 4)
        elif Y_UNIT == 4:  # rows of whole vectors: one 16-byte store
            value = _activate(_pack4(accs[j * 4], accs[j * 4 + 1], accs[j * 4 + 2], accs[j * 4 + 3]),
                              ACTIVATION).to(y_base.dtype.element_ty)
            if MASKED:
                tl.store(y_row + group_cols + lanes, value, mask=(out_row < out_h) & (group_cols + lanes < out_w))
            else:
                tl.store(y_row + group_cols + lanes, value)
        else:  # two pairs, each stored as it is held (a 4-vector would cross alignment and take shared memory)
            for half in tl.static_range(2):
                value = _activate(tl.join(accs[j * 4 + 2 * half], accs[j * 4 + 2 * half + 1]),
                                  ACTIVATION).to(y_base.dtype.element_ty)
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
                      ACTIVATION: tl.constexpr, WEIGHT_GRAD: tl.constexpr, weight_grads):
    """One tile of depthwise_fwd_nchw_pixels_kernel, without bounds tests where every window vector
    and output lies inside the image."""
    interior = ((first_row - pad_top >= 0) & (first_row + BLOCK_H - 1 - pad_top + (KH - 1) * DILATION_H < in_h)
                & (first_row + BLOCK_H <= out_h) & (first_col + BLOCK_W <= out_w)
                & (first_col - WINDOW_OFF >= 0) & (first_col + BLOCK_W - 4 - WINDOW_OFF + 4 * WINDOW_VECS <= in_w))
    if interior:
        weight_grads = _conv_nchw_pixels(
            x_base, y_base, weights, start, first_row, group_cols, lanes, zero, in_h, in_w, out_h, out_w,
            x_stride_h, y_stride_h, pad_top, KH, KW, DILATION_H, DILATION_W, ACC_DTYPE, BLOCK_H, WINDOW_OFF,
            WINDOW_LANE0, WINDOW_VECS, Y_UNIT, ODD_OUT_ALIGN, WIDEN_BF16, ACTIVATION, False, WEIGHT_GRAD, weight_grads,
            _tile_lanes(f_base, first_row, group_cols, lanes, zero, out_h, out_w, f_stride_h, ACC_DTYPE, BLOCK_H,
                        WEIGHT_GRAD, False))
    else:
        weight_grads = _conv_nchw_pixels(
            x_base, y_base, weights, start, first_row, group_cols, lanes, zero, in_h, in_w, out_h, out_w,
            x_stride_h, y_stride_h, pad_top, KH, KW, DILATION_H, DILATION_W, ACC_DTYPE, BLOCK_H, WINDOW_OFF,
            WINDOW_LANE0, WINDOW_VECS, Y_UNIT, ODD_OUT_ALIGN, WIDEN_BF16, ACTIVATION, True, WEIGHT_GRAD, weight_grads,
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
    DILATION_W: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INDEX_64: tl.constexpr,
    ACC_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, WINDOW_OFF: tl.constexpr, WINDOW_LANE0: tl.constexpr,
    WINDOW_VECS: tl.constexpr, X_UNIT: tl.constexpr, Y_UNIT: tl.constexpr, F_UNIT: tl.constexpr,
    FLIP_TAPS: tl.constexpr, WEIGHT_GRAD: tl.constexpr, ODD_OUT_ALIGN: tl.constexpr, WIDEN_BF16: tl.constexpr,
):
    """NCHW, stride 1, unit column steps ("nchw_pixels"; float32 3x3's default): one program =
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
                                             WINDOW_VECS, Y_UNIT, False, WIDEN_BF16, 0, True, weight_grads)
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
                          Y_UNIT, ODD_OUT_ALIGN, WIDEN_BF16, ACTIVATION, False, (start,))


# ---- blocks and launch plan ---------------------------------------------------------------------

def blocks(geom: ConvGeometry, x: torch.Tensor) -> ForwardConfig:
    """Rows over 256 wide in whole-row tiles of 512 on 4 warps (a 32-byte sector of an output row is
    never written half by one program and half by another), 8 rows in float32, 16 in half precision;
    narrower rows 8 x 128 on one warp."""
    if geom.out_w > 256:
        return ForwardConfig("nchw_pixels", 8 if x.element_size() >= 4 else 16, 512, 4)
    return ForwardConfig("nchw_pixels", 8, 128, 1)


def fused_blocks(geom: ConvGeometry) -> ForwardConfig:
    """The fused backward's grad_input tiles (geom: grad_input's flipped forward): 4 x 256 on two warps
    on rows over 256 wide, else 4 x 128 on one."""
    wide = geom.out_w > 256
    return ForwardConfig("nchw_pixels", 4, 256 if wide else 128, 2 if wide else 1)


def plan(geom: ConvGeometry, config: ForwardConfig, x: torch.Tensor, out: torch.Tensor, has_bias: bool,
         features: Optional[torch.Tensor], flip_weight: bool, runs: Optional[int] = None,
         activation: int = 0) -> LaunchPlan:
    """Stride 1, unit column steps in x and out, 4 columns a thread. features: the fused backward's
    input (the weight gradient's partial sums, `runs` a column of tiles)."""
    assert geom.stride_h == geom.stride_w == 1 and x.stride(3) == 1 and out.stride(3) == 1, \
        "nchw_pixels needs stride 1 and unit column steps"
    assert config.block_w % 4 == 0 and config.block_h * geom.kernel_h * geom.kernel_w <= tuned().max_pixel_taps
    x_unit, y_unit = stride_unit(x, 4, geom.in_w), stride_unit(out, 4, geom.out_w)
    odd_out_align = int(features is None and y_unit == 2 and config.block_h % 2 == 0
                        and odd_out_rows_alignable(out, geom) and window_fits(geom, 4, 0, 2))
    window_off, window_lane0, window_vecs = window_layout(geom, 4, 0, 2 * odd_out_align)
    row_tiles = cdiv(geom.out_h, config.block_h)
    f_strides, f_unit, partial_shape = out.stride(), 1, None  # placeholders when WEIGHT_GRAD is off
    if features is not None:
        assert geom.multiplier == 1 and features.shape == out.shape and features.stride(3) == 1, \
            "the fused backward reads the input with unit column steps, multiplier 1"
        f_strides, f_unit = features.stride(), stride_unit(features, 4, geom.out_w)
        runs = min(row_tiles, runs or cdiv(row_tiles, tuned().nchw_pixels_run_tiles))
    else:
        runs = row_tiles  # (one row tile a program)
    programs = geom.batch * geom.out_channels * runs * cdiv(geom.out_w, config.block_w)
    if features is not None:
        partial_shape = (programs, geom.kernel_h * geom.kernel_w)
    scalars = (geom.out_channels, geom.in_h, geom.in_w // x_unit, geom.out_h, geom.out_w // y_unit,
               *[s // x_unit for s in x.stride()[:3]], *[s // y_unit for s in out.stride()[:3]],
               *[s // f_unit for s in f_strides[:3]], geom.pad_top, geom.pad_left, runs)
    constants = dict(forward_constants(geom, config, x, out, has_bias, activation), FLIP_TAPS=flip_weight,
                     DILATION_H=geom.dilation_h, DILATION_W=geom.dilation_w, BLOCK_H=config.block_h,
                     WINDOW_OFF=window_off, WINDOW_LANE0=window_lane0, WINDOW_VECS=window_vecs,
                     X_UNIT=x_unit, Y_UNIT=y_unit, F_UNIT=f_unit, WEIGHT_GRAD=features is not None,
                     ODD_OUT_ALIGN=odd_out_align, num_stages=1,
                     # (widening in the fused backward measured slower)
                     WIDEN_BF16=x.dtype == torch.bfloat16 and features is None)
    return LaunchPlan("nchw_pixels", (programs,), scalars, constants, partial_shape, partial_dtype(x.dtype))


def launch_nchw_pixels(plan: LaunchPlan, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       out: torch.Tensor, features: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Launches the plan; returns the weight gradient's partial sums (features given) or None."""
    weight = weight.contiguous()
    partial = new_partial(plan, x.device) if features is not None else None
    launch(depthwise_fwd_nchw_pixels_kernel, plan, x, weight, bias.contiguous() if bias is not None else weight,
           out, out if features is None else features, out if partial is None else partial)
    return partial
