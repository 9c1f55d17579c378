"""The pairs family: column stride 2 on NCHW planes (`depthwise_fwd_pairs_kernel`).

Output column c reads input column 2c + o through tap kw, o = kw - pad_left: the pair (2(c + o//2),
+1) holds it. So each kernel row loads the pairs its taps fall in as contiguous rows and splits
them, where strided loads would use half of each load's bytes.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._geometry import ConvGeometry, cdiv, next_power_of_2
from ._launch import ForwardConfig, LaunchPlan, gpu_plan, launch
from ._shared import _activate, forward_constants, stride_unit


@triton.jit
def depthwise_fwd_pairs_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    out_channels, in_h, in_w, out_h, out_w,
    x_stride_n, x_stride_c, x_stride_h, y_stride_n, y_stride_c, y_stride_h,
    stride_h, pad_top, dilation_h,
    MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, PAD_LEFT: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, FLIP_TAPS: tl.constexpr, INDEX_64: tl.constexpr,
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
    tl.store(y_base + out_rows * y_stride_h + out_cols, _activate(acc, ACTIVATION).to(y_ptr.dtype.element_ty),
             mask=(out_rows < out_h) & (out_cols < out_w))


# ---- blocks and launch plan ---------------------------------------------------------------------

def applies(geom: ConvGeometry, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> bool:
    """What the kernel takes: column stride 2, column dilation 1 (with a dilation the taps fall in
    different pairs), unit column steps (NCHW)."""
    return geom.stride_w == 2 and geom.dilation_w == 1 and x.stride(3) == 1 and (out is None or out.stride(3) == 1)


def blocks(geom: ConvGeometry, x: torch.Tensor) -> ForwardConfig:
    """256 outputs a program on one warp (2048 under the interpreter), rows of up to 64."""
    block_w = min(64, next_power_of_2(geom.out_w))
    block_h = min(next_power_of_2(geom.out_h), max(1, (256 if gpu_plan(x.device) else 2048) // block_w))
    return ForwardConfig("pairs", block_h, block_w, 1)


def plan(geom: ConvGeometry, config: ForwardConfig, x: torch.Tensor, out: torch.Tensor, has_bias: bool,
         flip_weight: bool, activation: int = 0) -> LaunchPlan:
    assert applies(geom, x, out), "pairs: column stride 2, unit column steps"
    x_unit = stride_unit(x, 4, geom.in_w)
    tiles = cdiv(geom.out_h, config.block_h) * cdiv(geom.out_w, config.block_w)
    scalars = (geom.out_channels, geom.in_h, geom.in_w // x_unit, geom.out_h, geom.out_w,
               *[s // x_unit for s in x.stride()[:3]], *out.stride()[:3], geom.stride_h, geom.pad_top,
               geom.dilation_h)
    constants = dict(forward_constants(geom, config, x, out, has_bias, activation), FLIP_TAPS=flip_weight,
                     PAD_LEFT=geom.pad_left, X_UNIT=x_unit, BLOCK_H=config.block_h)
    return LaunchPlan("pairs", (geom.batch * geom.out_channels * tiles,), scalars, constants)


def launch_pairs(plan: LaunchPlan, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 out: torch.Tensor) -> None:
    weight = weight.contiguous()
    launch(depthwise_fwd_pairs_kernel, plan, x, weight, bias.contiguous() if bias is not None else weight, out)
