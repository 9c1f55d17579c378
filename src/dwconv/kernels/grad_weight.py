"""The grad_weight family: the NCHW weight gradient by row sliding (`depthwise_grad_weight_kernel`).

A program sums grad_out x input products over a share of the rows of one channel, for every tap at
once, reading input rows through the aligned windows the rows kernel uses, and writes one float32
partial sum per tap; weight_sums.py adds them in a fixed order (deterministic).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._geometry import ConvGeometry, cdiv, next_power_of_2
from ._launch import GradWeightConfig, LaunchPlan, cached_plan, gpu_plan, launch, layout_key, new_partial, plan_cache
from ._shared import _load_row_window, _row_under_tap, acc_dtype, needs_int64, partial_dtype, stride_unit, window_layout
from .weight_sums import sum_partials


@triton.jit(do_not_specialize=["pad_left", "total_rows", "splits"])  # (the last two follow the batch)
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
                                                  0, False, True, False)
                for kw in tl.static_range(KW):
                    x = _row_under_tap(x_row, w0, w1, w2, w3, out_cols, row_ok, in_w, stride_w, pad_left, x_stride_w,
                                       kw, DILATION_W, WINDOW_LANE0, VEC)
                    acc = tl.where(taps == kh * KW + kw, acc + g * x.to(ACC_DTYPE), acc)
            if BIAS_GRAD:
                acc = tl.where(taps == KH * KW, acc + g, acc)
    sums = tl.sum(tl.sum(acc, axis=2), axis=1)
    tap_ids = tl.arange(0, TAPS)
    tl.store(partial_ptr + (out_c * splits + split) * TAPS + tap_ids, sums, mask=tap_ids < KH * KW + BIAS_GRAD)


# ---- blocks and launch plan ---------------------------------------------------------------------

def blocks(geom: ConvGeometry, x: torch.Tensor) -> GradWeightConfig:
    """4 grad_out rows a loop step (their loads in flight together) up to 5x5 (7x7: 49 taps x 4
    rows of registers), about 16384 programs; wide aligned rows in 4-vectors, one a thread in
    float32, two in half precision; narrow planes two columns a thread. Under the interpreter
    few, large programs."""
    total_rows = geom.batch * geom.out_h
    if not gpu_plan(x.device):
        block_w = min(32, next_power_of_2(geom.out_w))
        return GradWeightConfig(block_w, 1, 1, min(geom.batch, total_rows))
    rows = 4 if geom.kernel_h * geom.kernel_w <= 25 else 1
    vec = 4 if (geom.stride_w == 1 and stride_unit(x, 4, geom.in_w) == 4 and geom.out_w > 128) else 1
    block_w = min(512 if vec > 1 else 64, next_power_of_2(geom.out_w))
    per_thread = (1 if x.element_size() >= 4 else 2) if vec > 1 else 2
    items = cdiv(total_rows, rows) * cdiv(geom.out_w, block_w)
    splits = min(items, cdiv(16384, geom.out_channels))
    return GradWeightConfig(block_w, max(1, block_w // (vec * 32 * per_thread)), vec, splits, rows)


def _plan(geom: ConvGeometry, config: Optional[GradWeightConfig], grad_out: torch.Tensor, x: torch.Tensor,
          bias_grad: bool) -> LaunchPlan:
    if config is None:
        config = blocks(geom, x)
    vec, block_w = config.vec, config.block_w
    total_rows = geom.batch * geom.out_h
    splits = max(1, min(config.splits, cdiv(total_rows, config.rows) * cdiv(geom.out_w, block_w)))
    padded_taps = next_power_of_2(geom.kernel_h * geom.kernel_w + int(bias_grad))
    assert vec == 1 or (geom.stride_w == 1 and x.stride(3) == 1), "vec > 1 needs unit column steps"
    window_off, window_lane0, window_vecs = window_layout(geom, vec)
    x_unit = stride_unit(x, vec, geom.in_w)
    g_unit = stride_unit(grad_out, vec, geom.out_w)
    scalars = (geom.out_channels, geom.in_h, geom.in_w // x_unit, geom.out_h, geom.out_w // g_unit, total_rows, splits,
               *[s // x_unit for s in x.stride()[:3]], x.stride(3), *[s // g_unit for s in grad_out.stride()[:3]],
               grad_out.stride(3), geom.stride_h, geom.stride_w, geom.pad_top, geom.pad_left)
    constants = dict(
        MULTIPLIER=geom.multiplier, KH=geom.kernel_h, KW=geom.kernel_w, DILATION_H=geom.dilation_h,
        DILATION_W=geom.dilation_w, BIAS_GRAD=bias_grad, INDEX_64=needs_int64(x, grad_out),
        ACC_DTYPE=acc_dtype(x.dtype), TAPS=padded_taps, BLOCK_W=block_w, VEC=vec,
        WINDOW_OFF=window_off, WINDOW_LANE0=window_lane0, WINDOW_VECS=window_vecs, X_UNIT=x_unit, G_UNIT=g_unit,
        ROWS=config.rows, num_warps=config.num_warps,
    )
    return LaunchPlan("grad_weight", (geom.out_channels * splits,), scalars, constants,
                      (geom.out_channels, splits, padded_taps), partial_dtype(x.dtype))


_PLANS = plan_cache()


def grad_weight(geom: ConvGeometry, grad_out: torch.Tensor, x: torch.Tensor, config: Optional[GradWeightConfig],
                bias_grad: bool, weight_dtype: torch.dtype) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """grad of the weight (C*m, 1, kH, kW) and, when bias_grad, of the bias, of NCHW-strided tensors."""
    plan = cached_plan(_PLANS, (geom, config, layout_key(grad_out), layout_key(x), bias_grad),
                       lambda: _plan(geom, config, grad_out, x, bias_grad))
    partial = new_partial(plan, x.device)
    launch(depthwise_grad_weight_kernel, plan, grad_out, x, partial)
    return sum_partials(partial, geom, weight_dtype, bias_grad)  # (partial[out_c, split, padded taps])
