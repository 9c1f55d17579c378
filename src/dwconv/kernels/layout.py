"""Layout copies between channels_last and NCHW for the kernels that index unit-stride rows (the
Toeplitz and large_fma paths): each image is a [pixels, channels] matrix one way and [channels,
pixels] the other, so the copy is a batched transpose, tile by tile, read and written whole lines.
(PyTorch's own copy of a channels_last tensor to NCHW goes through its strided copy.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._geometry import cdiv
from ._launch import LaunchPlan, cached_plan, launch, layout_key, plan_cache


@triton.jit
def transpose_images_kernel(src_ptr, dst_ptr, rows, cols, tiles_r, tiles_c, BLOCK_R: tl.constexpr,
                            BLOCK_C: tl.constexpr):
    """dst[n] = src[n].T for [rows, cols] row-major images (src) into [cols, rows] ones (dst);
    one BLOCK_R x BLOCK_C tile a program, a tile row's column tiles on neighbouring programs."""
    pid = tl.program_id(0)
    n = (pid // (tiles_r * tiles_c)).to(tl.int64)
    tile = pid % (tiles_r * tiles_c)
    r = ((tile // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]).to(tl.int64)
    c = ((tile % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]).to(tl.int64)
    inside = (r < rows) & (c < cols)
    image = n * rows * cols
    values = tl.load(src_ptr + image + r * cols + c, mask=inside)
    tl.store(dst_ptr + image + c * rows + r, values, mask=inside)


BLOCK = 64


def dense_channels_last(t: torch.Tensor) -> bool:
    """Whether t is a channels_last tensor with no gaps and not also NCHW-contiguous."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _transpose(src: torch.Tensor, dst: torch.Tensor, rows: int, cols: int) -> None:
    plan = cached_plan(_PLANS, (layout_key(src), layout_key(dst)), lambda: _plan(src, rows, cols))
    launch(transpose_images_kernel, plan, src, dst)


def _plan(src: torch.Tensor, rows: int, cols: int) -> LaunchPlan:
    tiles_r, tiles_c = cdiv(rows, BLOCK), cdiv(cols, BLOCK)
    return LaunchPlan("transpose", (src.shape[0] * tiles_r * tiles_c,), (rows, cols, tiles_r, tiles_c),
                      dict(BLOCK_R=BLOCK, BLOCK_C=BLOCK, num_warps=4))


_PLANS = plan_cache()


def nchw_copy(t: torch.Tensor) -> torch.Tensor:
    """t with unit column steps: t itself where it has them, else an NCHW-contiguous copy."""
    if t.stride(3) == 1:
        return t
    if not dense_channels_last(t) or t.numel() == 0:
        return t.contiguous()
    n, c, h, w = t.shape
    dst = torch.empty(t.shape, device=t.device, dtype=t.dtype)
    _transpose(t, dst, h * w, c)
    return dst


def copy_into(out: torch.Tensor, src: torch.Tensor) -> None:
    """out.copy_(src) for an NCHW-contiguous src (a kernel's result) into out of any layout."""
    if dense_channels_last(out) and src.is_contiguous() and out.numel() > 0:
        n, c, h, w = out.shape
        _transpose(src, out, c, h * w)
    else:
        out.copy_(src)
