"""The rows family: row sliding for stride_h 1 on NCHW planes (`depthwise_fwd_rows_kernel`).

A program walks down a column strip of one plane, loading each input row once and adding it into
the partial sums of every output row it touches, held in a ring of register rows; on 16-byte
aligned rows each thread builds the shifted views of its columns from aligned 4-vectors. With
WEIGHT_GRAD it is also the NCHW fused backward (grad_input and the weight gradient in one pass).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._geometry import ConvGeometry, cdiv, next_power_of_2
from ._launch import ForwardConfig, LaunchPlan, launch, new_partial
from ._shared import (_activate, _load_row_window, _plane_pointers, _row_under_tap, _store_aligned_rows, _window_view,
                      forward_constants, odd_out_rows_alignable, odd_rows_alignable, partial_dtype, ring_size,
                      stride_unit, window_fits, window_layout)


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
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INDEX_64: tl.constexpr, ACC_DTYPE: tl.constexpr,
    SLOTS: tl.constexpr, TAPS: tl.constexpr, BLOCK_W: tl.constexpr,
    VEC: tl.constexpr, WINDOW_OFF: tl.constexpr, WINDOW_LANE0: tl.constexpr, WINDOW_VECS: tl.constexpr,
    X_UNIT: tl.constexpr, Y_UNIT: tl.constexpr, ODD_ROW_ALIGN: tl.constexpr, PAD_TOP_ODD: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, F_UNIT: tl.constexpr, FLIP_TAPS: tl.constexpr, ODD_OUT_ALIGN: tl.constexpr,
    WIDEN_BF16: tl.constexpr,
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
                                              ODD_SHIFT * ((phase + PAD_TOP_ODD) % 2), ODD_ROW_ALIGN > 0, True,
                                              WIDEN_BF16)
            for kw in tl.static_range(KW):
                x = _row_under_tap(x_row, w0, w1, w2, w3, out_cols, row_ok, in_w, stride_w, pad_left, x_stride_w,
                                   kw, DILATION_W, WINDOW_LANE0 + ODD_SHIFT * ((phase + PAD_TOP_ODD) % 2), VEC)
                if ODD_OUT_ALIGN > 0:  # odd output rows: the view 2 columns to the left
                    x = tl.where(odd_slots, _window_view(w0, w1, w2, w3, WINDOW_LANE0 - 2 + kw * DILATION_W, VEC), x)
                tap_weight = tl.sum(tl.where(taps == kh * KW + kw, weights, 0.0), axis=2, keep_dims=True)
                # Select the sum, not the weight: tap_ok is constant per register, so the slots it
                # leaves out cost nothing (a zero weight was still an FMA: 0 * x may be NaN, so
                # the compiler keeps it; a quarter of kb84's FMAs, sm_90).
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
            _store_aligned_rows(y_row + out_cols, _activate(finished, ACTIVATION).to(y_ptr.dtype.element_ty), first, lanes,
                                (done >= first_row) & (done < last_row), out_w, VEC)
        else:
            store_ok = col_ok & (done >= first_row) & (done < last_row)
            tl.store(y_base + done * (y_stride_h * Y_UNIT) + out_cols * y_stride_w,
                     _activate(finished, ACTIVATION).to(y_ptr.dtype.element_ty), mask=store_ok)
    if WEIGHT_GRAD:
        tap_ids = tl.arange(0, TAPS)
        tl.store(partial_ptr + pid.to(tl.int64) * TAPS + tap_ids, tl.sum(tl.sum(weight_grad, axis=2), axis=1),
                 mask=tap_ids < KH * KW)


# ---- blocks and launch plan ---------------------------------------------------------------------

def blocks(geom: ConvGeometry, x: torch.Tensor) -> ForwardConfig:
    """128 rows a program on tall planes (32 else). Wide rows (over 128) that are 16-byte aligned, or
    whose odd rows the kernel can align: 4-column windows, two a thread, whatever the dtype; other
    rows two columns a thread (registers low, occupancy high)."""
    rows = 128 if geom.out_h >= 128 else 32
    if geom.stride_w == 1 and (stride_unit(x, 4, geom.in_w) == 4 or odd_rows_alignable(x, geom)) \
            and geom.out_w > 128:
        block_w = min(512, next_power_of_2(geom.out_w))
        return ForwardConfig("rows", rows, block_w, max(1, block_w // 256), vec=4)
    block_w = min(128, next_power_of_2(geom.out_w))
    return ForwardConfig("rows", rows, block_w, max(1, block_w // 64))


def plan(geom: ConvGeometry, config: ForwardConfig, x: torch.Tensor, out: torch.Tensor, has_bias: bool,
         features: Optional[torch.Tensor], flip_weight: bool, activation: int = 0) -> LaunchPlan:
    """features: the fused backward's input (this launch is then grad_input and also accumulates the
    weight gradient); flip_weight: the taps read in reverse (grad_input)."""
    assert geom.stride_h == 1, "the row-sliding kernel needs stride_h == 1"
    chunks = cdiv(geom.out_h, config.block_h)
    vec = config.vec
    assert vec == 1 or (vec in (4, 8) and geom.stride_w == 1 and x.stride(3) == 1), "vec 4 needs unit column steps"
    x_unit = stride_unit(x, vec, geom.in_w)
    odd_row_align = int(vec == 4 and x_unit == 2 and odd_rows_alignable(x, geom) and window_fits(geom, vec, 2))
    y_unit = stride_unit(out, vec, geom.out_w)
    odd_out_align = int(vec == 4 and x_unit == 4 and y_unit == 2 and features is None and ring_size(geom) % 2 == 0
                        and odd_out_rows_alignable(out, geom) and window_fits(geom, vec, 2 * odd_row_align, 2))
    window_off, window_lane0, window_vecs = window_layout(geom, vec, 2 if odd_row_align else 0, 2 * odd_out_align)
    programs = geom.batch * geom.out_channels * chunks * cdiv(geom.out_w, config.block_w)
    taps = next_power_of_2(geom.kernel_h * geom.kernel_w)
    f_strides, f_unit, partial_shape = out.stride(), 1, None  # placeholders when WEIGHT_GRAD is off
    if features is not None:
        assert geom.multiplier == 1 and geom.stride_w == 1 and features.shape == out.shape
        assert features.stride(3) == 1, "the fused backward reads the input with unit column steps"
        f_strides, f_unit, partial_shape = features.stride(), stride_unit(features, vec, geom.out_w), (programs, taps)
    scalars = (geom.out_channels, geom.in_h, geom.in_w // x_unit, geom.out_h, geom.out_w // y_unit,
               *[s // x_unit for s in x.stride()[:3]], x.stride(3), *[s // y_unit for s in out.stride()[:3]],
               out.stride(3), *[s // f_unit for s in f_strides[:3]], geom.stride_w, geom.pad_top, geom.pad_left,
               config.block_h)
    constants = dict(
        forward_constants(geom, config, x, out, has_bias, activation),
        DILATION_H=geom.dilation_h, DILATION_W=geom.dilation_w, SLOTS=ring_size(geom), TAPS=taps, VEC=vec,
        WINDOW_OFF=window_off, WINDOW_LANE0=window_lane0, WINDOW_VECS=window_vecs, X_UNIT=x_unit, Y_UNIT=y_unit,
        ODD_ROW_ALIGN=odd_row_align, PAD_TOP_ODD=geom.pad_top % 2, WEIGHT_GRAD=features is not None, F_UNIT=f_unit,
        ODD_OUT_ALIGN=odd_out_align, FLIP_TAPS=flip_weight, WIDEN_BF16=x.dtype == torch.bfloat16 and vec > 1,
    )
    return LaunchPlan("rows", (programs,), scalars, constants, partial_shape, partial_dtype(x.dtype))


def launch_rows(plan: LaunchPlan, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                out: torch.Tensor, features: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Launches the plan; returns the weight gradient's partial sums (features given) or None."""
    weight = weight.contiguous()
    partial = new_partial(plan, x.device) if features is not None else None
    launch(depthwise_fwd_rows_kernel, plan, x, weight, bias.contiguous() if bias is not None else weight, out,
           out if features is None else features, out if partial is None else partial)
    return partial
