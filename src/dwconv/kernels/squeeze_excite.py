"""A squeeze-and-excitation block's kernels, after the input's mean over H and W (PyTorch's reduction):

- `excite_kernel`: per image, gate = gate_fn(expand(act(reduce(mean)))), both 1x1 convolutions as
  small products from the parameters as they are (any floating dtype and strides), in float32
  (float64 for a float64 input): one launch where stock runs two convolutions, the activation and
  the gate, and under autocast casts all four parameters (ops inside a registered op would be cast
  by autocast too; a launch is not).
- `channel_scale_kernel`: out = x * gate[n, c] (+ shift[n, c] / (H * W)), one pass, a program one
  contiguous run of one image and the gate's row of it. PyTorch's broadcast multiply, which the
  block runs as `scale * input` (its generic kernel computes each element's broadcast index), took
  1.655 ms for EfficientNet-B0's 16 blocks of a bfloat16 eval forward at batch 256, this kernel
  0.716 ms, in the same process on the H100 (docs/decisions.md, "A squeeze-and-excitation block as
  one op in eager eval"). x is channels_last or contiguous (NCHW); the product is computed in
  float32 (float64 for a float64 gate) and rounded once into out, x's dtype and memory format. In
  training it also computes the block's grad_x = grad * gate[n, c] + (the squeeze's gradient) /
  (H * W), both of the input's two uses at once.
- `gate_gradient_kernel` (training): the gate's gradient, the sums over H and W of grad * x, in
  one pass over grad and x, where PyTorch's backward of the broadcast multiply takes two multiplies
  and a reduction.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..tuning import tuned
from ._launch import LaunchPlan, cached_plan, gpu_plan, launch, plan_cache
from ._shared import _activate


# (a model's blocks share binaries: nothing specialised but BLOCK_R's power of two, the options and dtypes)
@triton.jit(do_not_specialize=["channels", "hidden", "reduce_stride_out", "reduce_stride_in", "expand_stride_out",
                               "expand_stride_in"])
def excite_kernel(squeezed_ptr, reduce_weight_ptr, reduce_bias_ptr, expand_weight_ptr, expand_bias_ptr, gate_ptr,
                  channels, hidden, reduce_stride_out, reduce_stride_in, expand_stride_out, expand_stride_in,
                  REDUCE_BIAS: tl.constexpr, EXPAND_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, GATE: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program n: image n's gate [channels] from its mean [channels] (squeezed_ptr's dtype, the
    accumulator's), hidden <= BLOCK_R channels between; the weights [out, in, 1, 1] by their strides.
    ACTIVATION: _activate's code; GATE: 0 sigmoid, 1 hard sigmoid."""
    n = tl.program_id(0)
    acc: tl.constexpr = squeezed_ptr.dtype.element_ty
    r = tl.arange(0, BLOCK_R)
    r_ok = r < hidden
    total = tl.zeros([BLOCK_R], dtype=acc)
    for start in range(0, channels, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        c_ok = c < channels
        mean = tl.load(squeezed_ptr + n * channels + c, mask=c_ok, other=0.0)
        weight = tl.load(reduce_weight_ptr + r[:, None] * reduce_stride_out + c[None, :] * reduce_stride_in,
                         mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(acc)
        total += tl.sum(weight * mean[None, :], axis=1)
    if REDUCE_BIAS:
        total += tl.load(reduce_bias_ptr + r, mask=r_ok, other=0.0).to(acc)
    between = tl.where(r_ok, _activate(total, ACTIVATION), 0.0)
    for start in range(0, channels, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        c_ok = c < channels
        weight = tl.load(expand_weight_ptr + c[None, :] * expand_stride_out + r[:, None] * expand_stride_in,
                         mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(acc)
        excited = tl.sum(weight * between[:, None], axis=0)
        if EXPAND_BIAS:
            excited += tl.load(expand_bias_ptr + c, mask=c_ok, other=0.0).to(acc)
        if GATE == 0:
            excited = 1.0 / (1.0 + tl.exp(-excited))
        else:
            excited = _activate(excited, 7)  # (hardsigmoid's code)
        tl.store(gate_ptr + n * channels + c, excited, mask=c_ok)


# (one binary for every layer of a dtype and layout, so that a model's first eval call compiles one or
# two: only the image's element count is specialised, on divisibility by 16, which vectorises the loads)
@triton.jit(do_not_specialize=["channels", "plane", "blocks_per_image"])
def channel_scale_kernel(x_ptr, gate_ptr, shift_ptr, out_ptr, image_elements, channels, plane, blocks_per_image,
                         CHANNELS_LAST: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: elements (p % blocks_per_image) * BLOCK .. of image p // blocks_per_image, whose
    channel is the element's index mod channels (channels_last) or its index // plane (NCHW):
    x * gate[n, c], plus shift[n, c] / plane (SHIFT: the squeeze's gradient, spread over the image's
    pixels here rather than by launches of a cast and a division before)."""
    program = tl.program_id(0)
    image = program // blocks_per_image
    offsets = (program % blocks_per_image) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < image_elements
    if CHANNELS_LAST:
        c = offsets % channels
    else:
        c = offsets // plane
    base = image.to(tl.int64) * image_elements
    gate = tl.load(gate_ptr + image * channels + c, mask=inside)
    x = tl.load(x_ptr + base + offsets, mask=inside)
    # (in float32, float64 for a float64 gate: a half gate's product is then exact before its one rounding,
    # as PyTorch's; Triton's interpreter multiplied bfloat16 values into NaNs)
    if gate.dtype == tl.float64:
        product = x.to(tl.float64) * gate
    else:
        product = x.to(tl.float32) * gate.to(tl.float32)
    if SHIFT:
        shift = tl.load(shift_ptr + image * channels + c, mask=inside)
        if gate.dtype == tl.float64:
            product += shift.to(tl.float64) / plane
        else:  # (IEEE's division, as PyTorch's: Triton's float32 `/` is an approximation)
            product += tl.math.div_rn(shift.to(tl.float32), plane.to(tl.float32))
    tl.store(out_ptr + base + offsets, product.to(out_ptr.dtype.element_ty), mask=inside)


# (one binary for every layer of a dtype and layout: nothing of the shape specialised)
@triton.jit(do_not_specialize=["channels", "plane", "pixels_per_split"])
def gate_gradient_kernel(grad_ptr, x_ptr, partial_ptr, out_ptr, channels, plane, pixels_per_split,
                         CHANNELS_LAST: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (image n, channel block, split s): the sum of grad * x over the pixels s *
    pixels_per_split .. (a multiple of BLOCK_P) of image n, in partial's dtype (float32, float64 for
    float64), stored to partial[n, s, c]: one value a program, so the gate's gradient (partial summed
    over s) is the same at every run. With one split (a large batch) the sum is the gradient: stored
    to out[n, c] in out's dtype instead, rounded once (no launches after; a runtime test, so that
    every batch size takes one binary)."""
    n = tl.program_id(0)
    split = tl.program_id(2)
    acc: tl.constexpr = partial_ptr.dtype.element_ty
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    base = n.to(tl.int64) * channels * plane
    total = tl.zeros([BLOCK_P, BLOCK_C], dtype=acc)
    first = split * pixels_per_split
    for start in range(first, first + pixels_per_split, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        inside = (p < plane)[:, None] & c_ok[None, :]
        if CHANNELS_LAST:
            offsets = p[:, None] * channels + c[None, :]
        else:
            offsets = c[None, :] * plane + p[:, None]
        grad = tl.load(grad_ptr + base + offsets, mask=inside, other=0.0).to(acc)
        x = tl.load(x_ptr + base + offsets, mask=inside, other=0.0).to(acc)
        total += grad * x
    sums = tl.sum(total, axis=0)
    if tl.num_programs(2) == 1:
        tl.store(out_ptr + n * channels + c, sums.to(out_ptr.dtype.element_ty), mask=c_ok)
    else:
        tl.store(partial_ptr + (n * tl.num_programs(2) + split) * channels + c, sums, mask=c_ok)


_EXCITE_PLANS = plan_cache()


MAX_HIDDEN = 1024  # (excite_kernel holds a program's hidden values in registers)


def excite(squeezed: torch.Tensor, reduce_weight: torch.Tensor, reduce_bias: Optional[torch.Tensor],
           expand_weight: torch.Tensor, expand_bias: Optional[torch.Tensor], activation: int, gate: int
           ) -> torch.Tensor:
    """The gate [N, C] in squeezed's dtype from the mean squeezed [N, C] (contiguous): one launch."""
    batch, channels = squeezed.shape
    hidden = reduce_weight.shape[0]
    key = (batch, channels, hidden, reduce_weight.stride()[:2], expand_weight.stride()[:2], reduce_bias is not None,
           expand_bias is not None, activation, gate, squeezed.device.type)
    plan = cached_plan(_EXCITE_PLANS, key, lambda: _excite_plan(batch, channels, hidden, reduce_weight.stride()[:2],
                                                                expand_weight.stride()[:2], reduce_bias is not None,
                                                                expand_bias is not None, activation, gate))
    out = torch.empty_like(squeezed)
    if tuned().poison_partials:  # (the tests: an element no program wrote then shows)
        out.fill_(float("nan"))
    launch(excite_kernel, plan, squeezed, reduce_weight, reduce_weight if reduce_bias is None else reduce_bias,
           expand_weight, expand_weight if expand_bias is None else expand_bias, out)
    return out


def _excite_plan(batch: int, channels: int, hidden: int, reduce_strides: tuple, expand_strides: tuple,
                 reduce_bias: bool, expand_bias: bool, activation: int, gate: int) -> LaunchPlan:
    # (a [BLOCK_R, BLOCK_C] tile of weights a step, at most 4096 values: 32 a thread of 4 warps; BLOCK_C
    # from BLOCK_R alone, so that EfficientNet-B0's 16 blocks take three binaries)
    block_r = max(16, triton.next_power_of_2(hidden))
    block_c = max(4, 4096 // block_r)
    return LaunchPlan("excite", (batch,), (channels, hidden, *reduce_strides, *expand_strides),
                      dict(REDUCE_BIAS=reduce_bias, EXPAND_BIAS=expand_bias, ACTIVATION=activation, GATE=gate,
                           BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4))


_PLANS = plan_cache()


def _plan(batch: int, channels: int, plane: int, channels_last: bool, shift: bool, gpu: bool) -> LaunchPlan:
    image_elements = channels * plane
    block = 2048 if gpu else triton.next_power_of_2(min(image_elements, 4096))
    blocks_per_image = triton.cdiv(image_elements, block)
    return LaunchPlan("channel_scale", (batch * blocks_per_image,), (image_elements, channels, plane, blocks_per_image),
                      dict(CHANNELS_LAST=channels_last, SHIFT=shift, BLOCK=block, num_warps=8 if gpu else 1))


def scalable(x: torch.Tensor) -> bool:
    """Whether channel_scale takes x: 4-D, channels_last or contiguous, each image's elements indexed
    in 32 bits, and a grid of fewer than 2^31 programs."""
    if x.dim() != 4 or x.numel() == 0:
        return False
    # (the image's size from the shape: x[0] would be a select, a step of the op's recorded program)
    image_elements = x.shape[1] * x.shape[2] * x.shape[3]
    return ((x.is_contiguous(memory_format=torch.channels_last) or x.is_contiguous())
            and image_elements < 2**31 - 2**16 and x.numel() // 2048 < 2**30)


def channel_scale(x: torch.Tensor, gate: torch.Tensor, shift: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x * gate[:, :, None, None] + shift[:, :, None, None] / (H * W) (x `scalable`, gate [N, C]
    contiguous, on x's device; shift None, or [N, C] contiguous in any floating dtype: a squeeze's
    gradient), computed in float32 (float64 for a float64 gate), in x's dtype and memory format: one
    launch."""
    batch, channels, height, width = x.shape
    # (a tensor both contiguous and channels_last, H = W = 1 or C = 1, reads the same either way)
    channels_last = x.is_contiguous(memory_format=torch.channels_last)
    key = (batch, channels, height * width, channels_last, shift is not None, x.device.type)
    plan = cached_plan(_PLANS, key, lambda: _plan(batch, channels, height * width, channels_last, shift is not None,
                                                  gpu_plan(x.device)))
    out = torch.empty_like(x)  # (x's memory format)
    if tuned().poison_partials:  # (the tests: an element no program wrote then shows)
        out.fill_(float("nan"))
    launch(channel_scale_kernel, plan, x, gate, gate if shift is None else shift, out)
    return out


_GATE_GRADIENT_PLANS = plan_cache()

# programs the gate's gradient aims for: a few waves of the GPU's SMs (an image's pixels split among
# programs where images and channel blocks alone are fewer); the interpreter's few, but more than one
# a block, so that the tests' images take several splits
_GATE_GRADIENT_PROGRAMS = {True: 1024, False: 8}


def _gate_gradient_plan(batch: int, channels: int, plane: int, channels_last: bool, gpu: bool) -> LaunchPlan:
    # (a tile of at most 4096 values, contiguous along its channels (channels_last) or its pixels)
    if channels_last:
        block_c = min(64, triton.next_power_of_2(channels))
        block_p = min(4096 // block_c, triton.next_power_of_2(plane))
    else:
        block_p = min(512, triton.next_power_of_2(plane))
        block_c = min(4096 // block_p, triton.next_power_of_2(channels))
    channel_blocks = triton.cdiv(channels, block_c)
    splits = min(triton.cdiv(plane, block_p),
                 max(1, triton.cdiv(_GATE_GRADIENT_PROGRAMS[gpu], batch * channel_blocks)))
    pixels_per_split = triton.cdiv(triton.cdiv(plane, splits), block_p) * block_p
    splits = triton.cdiv(plane, pixels_per_split)  # (none empty)
    return LaunchPlan("gate_gradient", (batch, channel_blocks, splits), (channels, plane, pixels_per_split),
                      dict(CHANNELS_LAST=channels_last, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=8 if gpu else 1),
                      partial_shape=(batch, splits, channels))


def gate_gradient(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of channel_scale's out = x * gate by its gate: [N, C] in dtype, the sums over H
    and W of grad * x (x `scalable`, grad in x's strides and dtype), in float32 (float64 for float64):
    one launch, then the sum of its per-split partial sums where there are several (one split: the
    launch's output alone)."""
    batch, channels, height, width = x.shape
    channels_last = x.is_contiguous(memory_format=torch.channels_last)
    key = (batch, channels, height * width, channels_last, x.device.type)
    plan = cached_plan(_GATE_GRADIENT_PLANS, key, lambda: _gate_gradient_plan(batch, channels, height * width,
                                                                              channels_last, gpu_plan(x.device)))
    splits, gpu = plan.grid[2], gpu_plan(x.device)
    # (one split writes out alone: its partial is a placeholder of the partials' dtype, which the binary keys)
    partial = torch.empty(plan.partial_shape if splits > 1 else (1,),
                          dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=x.device)
    # (Triton's interpreter truncates float32 to half precision where the GPU rounds to nearest: off the
    # GPU's plans the kernel writes float32 and PyTorch rounds, as the GPU does; batch_norm.fold's way)
    written = dtype if gpu or dtype.itemsize >= 4 else torch.float32
    out = torch.empty((batch, channels), dtype=written, device=x.device)
    if tuned().poison_partials:  # (the tests: a value no program wrote then shows)
        partial.fill_(float("nan"))
        out.fill_(float("nan"))
    launch(gate_gradient_kernel, plan, grad, x, partial, out)
    # (summed in the partials' dtype, then rounded once: sum(dtype=) would round each partial first)
    if splits > 1:
        return partial.sum(1).to(dtype)
    return out if written == dtype else out.to(dtype)  # (no `.to` at all: a recorded program would replay it)
