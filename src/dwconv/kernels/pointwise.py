"""A trained block's eval 1x1 convolution (stride 1, no padding, one group) of a channels_last input
as one launch: out[row, :] = act(x[row, :] @ weight.T * scale + shift), a row being one pixel's
channels (N*H*W rows, each contiguous), scale and shift the BatchNorm in eval mode (and the
convolution's bias) per output channel, computed by each program from the BatchNorm's own tensors
(`batch_norm._eval_norm`, the fold kernel's arithmetic). The weight [out, in, 1, 1] is read by its
strides in any floating dtype and cast to the input's, as autocast casts it for stock's convolution.

Where cuBLAS took the product, the op's program was a fold launch, three views and the product
(a cuBLAS call costs the host about 20 us), and an activation other than ReLU a pass of its own:
an eager eval forward of MobileNetV4 makes 45 such calls, and it is bound by its host
(docs/decisions.md, "1x1 convolutions of the fused eval forward as one Triton launch").
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..tuning import tuned
from ._launch import LaunchPlan, cached_plan, gpu_plan, launch, plan_cache
from ._shared import _activate
from .batch_norm import _eval_norm


@triton.jit(do_not_specialize=["rows", "eps"])
def pointwise_kernel(x_ptr, weight_ptr, bias_ptr, norm_weight_ptr, norm_bias_ptr, mean_ptr, var_ptr, out_ptr,
                     rows, in_channels, out_channels, weight_stride_out, weight_stride_in, eps: tl.float64,
                     HAS_BIAS: tl.constexpr, NORM: tl.constexpr, AFFINE: tl.constexpr, ACTIVATION: tl.constexpr,
                     DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program p: rows (p // column blocks) * BLOCK_M .. and output channels (p % column blocks) *
    BLOCK_N .. (a row block's column blocks neighbour in the launch order: its input is read from L2
    after the first). DOT: the product on the tensor cores (half precision on the GPU); else as float32
    or float64 multiply-adds (each product exact, as cuBLAS's are without TF32)."""
    program = tl.program_id(0)
    column_blocks = tl.cdiv(out_channels, BLOCK_N)
    m = (program // column_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = (program % column_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < rows, n < out_channels
    x_rows = x_ptr + m.to(tl.int64)[:, None] * in_channels
    acc_dtype: tl.constexpr = tl.float64 if x_ptr.dtype.element_ty == tl.float64 else tl.float32
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_dtype)
    for start in range(0, in_channels, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < in_channels
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(weight_ptr + n[None, :] * weight_stride_out + k[:, None] * weight_stride_in,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(x.dtype)
        if DOT:
            acc = tl.dot(x, w, acc)
        else:
            acc += tl.sum(x.to(acc_dtype)[:, :, None] * w.to(acc_dtype)[None, :, :], axis=1)
    if NORM:
        scale, shift = _eval_norm(n, n_ok, norm_weight_ptr, norm_bias_ptr, mean_ptr, var_ptr, eps, bias_ptr, AFFINE,
                                  HAS_BIAS)
        acc = acc * scale.to(acc_dtype)[None, :] + shift.to(acc_dtype)[None, :]
    elif HAS_BIAS:  # (in the input's dtype, as autocast casts it for stock's convolution)
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(x_ptr.dtype.element_ty).to(acc_dtype)[None, :]
    acc = _activate(acc, ACTIVATION)
    out = out_ptr + m.to(tl.int64)[:, None] * out_channels + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_PLANS = plan_cache()


def pointwise(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
              norm_bias: Optional[torch.Tensor], norm_mean: Optional[torch.Tensor], norm_var: Optional[torch.Tensor],
              eps: float, activation: int) -> torch.Tensor:
    """act(conv1x1(x, weight, bias) then the BatchNorm in eval mode where norm_mean is given), x
    channels_last [N, C_in, H, W], the output channels_last in x's dtype: one launch. The caller
    checks the arguments (_library.pointwise_folded)."""
    batch, in_channels, height, width = x.shape
    out_channels = weight.shape[0]
    rows = batch * height * width
    weight_strides = weight.stride()[:2]
    key = (rows, in_channels, out_channels, weight_strides, x.dtype, bias is not None, norm_mean is not None,
           norm_weight is not None, eps, activation, x.device.type)
    plan = cached_plan(_PLANS, key, lambda: _plan(rows, in_channels, out_channels, weight_strides, x.dtype,
                                                  bias is not None, norm_mean is not None, norm_weight is not None,
                                                  eps, activation, gpu_plan(x.device)))
    # (Triton's interpreter truncates float32 to half precision where the GPU rounds to nearest: off the
    # GPU's plans the kernel writes float32 and PyTorch rounds, as batch_norm.fold does)
    written = x.dtype if plan.constants["DOT"] or x.dtype.itemsize >= 4 else torch.float32
    out = torch.empty((batch, out_channels, height, width), dtype=written, device=x.device,
                      memory_format=torch.channels_last)
    if tuned().poison_partials:  # (the tests: an element no program wrote then shows)
        out.fill_(float("nan"))
    # (an absent tensor's pointer is never read: the weight stands in for it)
    launch(pointwise_kernel, plan, x, weight, *(weight if t is None else t for t in
                                                (bias, norm_weight, norm_bias, norm_mean, norm_var)), out)
    return out if written == x.dtype else out.to(x.dtype)


def _plan(rows: int, in_channels: int, out_channels: int, weight_strides: tuple, dtype: torch.dtype, has_bias: bool,
          norm: bool, affine: bool, eps: float, activation: int, gpu: bool) -> LaunchPlan:
    # (the interpreter's tl.dot multiplies half precision's raw bits: the CPU tests take the multiply-adds)
    dot = gpu and dtype in (torch.float16, torch.bfloat16)
    stages = 1
    if dot:
        # (tl.dot takes 16 and up; a block of rows each program, as wide as the output's channels up to 128)
        block_m, block_n = tuned().pointwise_block_m, min(tuned().pointwise_block_n,
                                                          max(16, triton.next_power_of_2(out_channels)))
        block_k = min(tuned().pointwise_block_k, max(16, triton.next_power_of_2(in_channels)))
        warps = 8 if block_m * block_n >= 128 * 128 else 4
        stages = tuned().pointwise_stages
    elif gpu:
        block_m, block_n, block_k, warps = 32, min(64, max(16, triton.next_power_of_2(out_channels))), 8, 4
    else:  # (the interpreter: few programs, each a whole tile)
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
        block_n = max(16, triton.next_power_of_2(min(out_channels, 64)))
        block_k = max(16, triton.next_power_of_2(min(in_channels, 64)))
        warps = 1
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(out_channels, block_n),)
    return LaunchPlan("pointwise", grid, (rows, in_channels, out_channels, *weight_strides, float(eps)),
                      dict(HAS_BIAS=has_bias, NORM=norm, AFFINE=affine, ACTIVATION=activation, DOT=dot,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages))
