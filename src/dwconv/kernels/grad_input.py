"""The grad_input family: the input gradient of any geometry as a gather by stride phase
(`depthwise_grad_input_phase_kernel`): each input pixel sums the taps that reach it, with no
atomics, no zero-stuffed tensors and no masked-off taps. (Stride 1, multiplier 1 runs instead as a
forward convolution of grad_out with the flipped weight: dispatch.py.)
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from .._geometry import ConvGeometry, cdiv, next_power_of_2
from ..tuning import tuned
from ._launch import LaunchPlan, cached_plan, gpu_plan, launch, layout_key, plan_cache
from ._shared import acc_dtype, channels_last_kernel_applies, needs_int64


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


# NCHW runs its columns along the vectors, whose masks gain from the sizes' divisibility by 16; in
# channels_last the sizes bound the pixel masks only (the same PTX either way, sm_90), so there they
# are runtime values: one binary for every image size.
_phase_source = depthwise_grad_input_phase_kernel
depthwise_grad_input_phase_kernel = triton.jit(_phase_source)
depthwise_grad_input_phase_nhwc_kernel = triton.jit(do_not_specialize=["in_h", "in_w", "out_h", "out_w"])(
    _phase_source)


# ---- blocks and launch plan ---------------------------------------------------------------------

def _values_a_thread(geom: ConvGeometry, channels_last: bool) -> int:
    """Values of a grad_out tile a thread holds (its warps; NCHW: its rows too): 8 for channels_last
    and for strided NCHW from phase_wide_nchw_w columns on, else 2."""
    strided = geom.stride_h * geom.stride_w > 1
    return 8 if channels_last or (strided and geom.in_w >= tuned().phase_wide_nchw_w) else 2


def blocks(geom: ConvGeometry, channels_last: bool, gpu: bool) -> Tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_W, BLOCK_C, warps), powers of two (its aranges), for the GPU or for the
    interpreter (gpu False: larger programs): groups of stride_h x stride_w input pixels, about as
    many pixels a program as at stride 1."""
    group_h, group_w = cdiv(geom.in_h, geom.stride_h), cdiv(geom.in_w, geom.stride_w)
    phases = geom.stride_h * geom.stride_w
    values = _values_a_thread(geom, channels_last)
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


def _plan(geom: ConvGeometry, grad_out: torch.Tensor, dx: torch.Tensor) -> LaunchPlan:
    channels_last = channels_last_kernel_applies(grad_out, dx)
    block_h, block_w, block_c, num_warps = blocks(geom, channels_last, gpu_plan(grad_out.device))
    tiles = cdiv(cdiv(geom.in_h, geom.stride_h), block_h) * cdiv(cdiv(geom.in_w, geom.stride_w), block_w)
    scalars = (geom.in_channels, geom.in_h, geom.in_w, geom.out_h, geom.out_w, *grad_out.stride(), *dx.stride())
    first_shift_h, shifts_h = grad_out_shifts(geom.pad_top, geom.dilation_h, geom.stride_h, geom.kernel_h)
    first_shift_w, shifts_w = grad_out_shifts(geom.pad_left, geom.dilation_w, geom.stride_w, geom.kernel_w)
    constants = dict(
        STRIDE_H=geom.stride_h, STRIDE_W=geom.stride_w, PAD_TOP=geom.pad_top, PAD_LEFT=geom.pad_left,
        DILATION_H=geom.dilation_h, DILATION_W=geom.dilation_w, MULTIPLIER=geom.multiplier, KH=geom.kernel_h,
        KW=geom.kernel_w, SHARED_LOADS=geom.kernel_h * geom.kernel_w <= tuned().shared_load_taps,
        FIRST_SHIFT_H=first_shift_h, SHIFTS_H=shifts_h, FIRST_SHIFT_W=first_shift_w, SHIFTS_W=shifts_w,
        INDEX_64=needs_int64(grad_out, dx), ACC_DTYPE=acc_dtype(dx.dtype), BLOCK_H=block_h, BLOCK_W=block_w,
        BLOCK_C=block_c, num_warps=num_warps,
    )
    programs = geom.batch * cdiv(geom.in_channels, block_c) * tiles
    return LaunchPlan("grad_input_nhwc" if channels_last else "grad_input", (programs,), scalars, constants)


_PLANS = plan_cache()


def grad_input(geom: ConvGeometry, grad_out: torch.Tensor, weight: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """Writes grad_input into dx (any geometry) and returns it."""
    plan = cached_plan(_PLANS, (geom, layout_key(grad_out), layout_key(dx)), lambda: _plan(geom, grad_out, dx))
    kernel = depthwise_grad_input_phase_nhwc_kernel if plan.kernel == "grad_input_nhwc" else \
        depthwise_grad_input_phase_kernel
    launch(kernel, plan, grad_out, weight.contiguous(), dx)
    return dx
