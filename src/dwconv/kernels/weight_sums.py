"""The weight gradient's second pass: every weight-gradient kernel (grad_weight.py, tile.py,
large_fma.py, toeplitz.py, and the fused backward's) writes float32 partial sums per program and tap (and the bias after the taps); this
adds them per channel and tap in a fixed order (deterministic) and writes grad_weight and grad_bias
in the weight's dtype, in one launch. It replaced a torch sum and a dtype cast, two dispatcher calls
and launches whose host time counted in small layers' backward.

Partial layouts differ by kernel; each is described by where value (channel c, tap t) of part
(outer o, inner i) lies: o * outer_stride + i * inner_stride + c * channel_stride + t.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..tuning import tuned
from ._launch import LaunchPlan, cached_plan, gpu_plan, launch, plan_cache




# (the part counts and strides change with the batch and image size: runtime values, never specialised,
# so that one binary serves every batch and image size of a layer)
@triton.jit(do_not_specialize=["outer", "inner", "outer_stride", "inner_stride"])
def depthwise_weight_grad_sums_kernel(
    partial_ptr, grad_w_ptr, grad_b_ptr,
    outputs, outer, inner, outer_stride, inner_stride, channel_stride,
    TAPS: tl.constexpr, BIAS_GRAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Program p: outputs p * BLOCK_E .. (channel-major over TAPS taps and the bias), each the sum
    of its outer x inner parts, BLOCK_R parts a step (a [BLOCK_R, BLOCK_E] tile summed down)."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < outputs
    c = e // (TAPS + BIAS_GRAD)
    t = e % (TAPS + BIAS_GRAD)
    values = partial_ptr + (c.to(tl.int64) * channel_stride + t)[None, :]
    parts = outer * inner
    acc = tl.zeros([BLOCK_R, BLOCK_E], dtype=partial_ptr.dtype.element_ty)
    for start in range(0, parts, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        offsets = ((r // inner).to(tl.int64) * outer_stride + (r % inner).to(tl.int64) * inner_stride)[:, None]
        acc += tl.load(values + offsets, mask=(r < parts)[:, None] & e_ok[None, :], other=0.0)
    sums = tl.sum(acc, axis=0)
    tl.store(grad_w_ptr + c * TAPS + t, sums.to(grad_w_ptr.dtype.element_ty), mask=e_ok & (t < TAPS))
    if BIAS_GRAD:
        tl.store(grad_b_ptr + c, sums.to(grad_b_ptr.dtype.element_ty), mask=e_ok & (t == TAPS))


def weight_grad_sums(partial: torch.Tensor, geom, weight_dtype: torch.dtype, bias_grad: bool,
                     channel_stride: int, inner: Tuple[int, int], outer: Tuple[int, int] = (1, 0)
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(grad_weight [C*m, 1, kH, kW], grad_bias [C*m] or None), contiguous and in weight_dtype, from
    the partial sums: value (c, t) of part (o, i) at o * outer[1] + i * inner[1] + c * channel_stride
    + t, o < outer[0], i < inner[0]; t = kH * kW is the bias."""
    taps = geom.kernel_h * geom.kernel_w
    if outer[0] * inner[0] > tuned().weight_sums_max_parts:  # (past it torch's reduction, which splits the parts)
        values = partial.as_strided((outer[0], inner[0], geom.out_channels, taps + int(bias_grad)),
                                    (outer[1], inner[1], channel_stride, 1)).sum(dim=(0, 1))
        grad_w = values[:, :taps].to(weight_dtype).contiguous().view(geom.out_channels, 1, geom.kernel_h, geom.kernel_w)
        return grad_w, (values[:, taps].to(weight_dtype, copy=True) if bias_grad else None)
    grad_w = torch.empty((geom.out_channels, 1, geom.kernel_h, geom.kernel_w), device=partial.device,
                         dtype=weight_dtype)
    grad_b = torch.empty(geom.out_channels, device=partial.device, dtype=weight_dtype) if bias_grad else None
    key = (geom.out_channels, taps, bool(bias_grad), channel_stride, inner, outer, partial.device.type)
    plan = cached_plan(_PLANS, key, lambda: _plan(geom.out_channels, taps, bool(bias_grad), channel_stride,
                                                  inner, outer, gpu_plan(partial.device)))
    launch(depthwise_weight_grad_sums_kernel, plan, partial, grad_w, grad_w if grad_b is None else grad_b)
    return grad_w, grad_b


def sum_partials(partial: torch.Tensor, geom, weight_dtype: torch.dtype, bias_grad: bool):
    """weight_grad_sums of partial[out_c, part, tap] (taps contiguous)."""
    return weight_grad_sums(partial, geom, weight_dtype, bias_grad, partial.stride(0),
                            (partial.shape[1], partial.stride(1)))


_PLANS = plan_cache()


def _plan(channels: int, taps: int, bias_grad: bool, channel_stride: int, inner: Tuple[int, int],
          outer: Tuple[int, int], gpu: bool) -> LaunchPlan:
    # 8 outputs by 256 parts a step on the GPU: many programs (C*taps / 8), few steps each; the
    # step's size does not follow the part count (another batch or image size would compile again),
    # rows past it are masked. Under the interpreter few programs, small steps
    outputs = channels * (taps + int(bias_grad))
    parts = outer[0] * inner[0]
    block_e = 8 if gpu else triton.next_power_of_2(min(outputs, 256))
    block_r = 256 if gpu else triton.next_power_of_2(min(parts, 64))
    scalars = (outputs, outer[0], inner[0], outer[1], inner[1], channel_stride)
    constants = dict(TAPS=taps, BIAS_GRAD=bias_grad, BLOCK_E=block_e, BLOCK_R=block_r, num_warps=4)
    return LaunchPlan("weight_grad_sums", (triton.cdiv(outputs, block_e),), scalars, constants)
