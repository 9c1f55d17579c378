"""Shared helpers for dwconv's tests: device choice, references, tolerances, NaN poisoning."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (stride, padding, dilation) combinations every kernel size is tested with
CONV_OPTIONS = [
    (1, 0, 1),
    (1, 1, 1),
    (2, 1, 1),
    (3, 0, 1),
    (1, (2, 1), 2),
    ((2, 1), (0, 3), 3),
    (1, "same", 1),
    (1, "same", (2, 3)),
    (2, "valid", 1),
]

# |out - ref| <= atol + rtol * |ref| against a float64 reference computed from the same inputs.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),  # one rounding to 11 bits at the end, float32 accumulation
    torch.bfloat16: (1e-2, 1e-2),  # one rounding to 8 bits
}


def randn(*shape, dtype=torch.float32, device=DEVICE, generator=None):
    """Fresh normal samples (never zeros), drawn in float32 then cast."""
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def reference_conv(x, weight, bias, stride, padding, dilation):
    """F.conv2d in float64 on the CPU: the ground truth for every comparison."""
    bias64 = None if bias is None else bias.double().cpu()
    return F.conv2d(x.double().cpu(), weight.double().cpu(), bias64, stride, padding, dilation,
                    groups=x.shape[1])


def poisoned(shape, dtype, device=DEVICE, memory_format=torch.contiguous_format):
    """An output buffer full of NaN, so any element a kernel fails to write fails the check."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device).contiguous(memory_format=memory_format)


def reversed_strides(t: torch.Tensor) -> torch.Tensor:
    """t's values in memory ordered neither as contiguous nor as channels_last (what a saved-tensor
    hook may hand back)."""
    return torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).permute(*range(t.dim() - 1, -1, -1)).copy_(t)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest error against the largest value of the reference (a gradient that is all zeros, a
    ReLU's after dead channels: its absolute error)."""
    return ((got.double().cpu() - expected.cpu()).abs().max() / expected.abs().max().clamp(min=1e-12)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "output"):
    """Fails with the position and values of the worst element."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    out64 = out.detach().double().cpu()
    ref64 = ref.detach().double().cpu()
    atol, rtol = TOLERANCES[dtype]
    nan = torch.isnan(out64)
    if nan.any():
        index = tuple(int(i) for i in nan.nonzero()[0])
        raise AssertionError(f"{what}: {int(nan.sum())} NaN elements (unwritten?), first at {index}")
    excess = (out64 - ref64).abs() - (atol + rtol * ref64.abs())
    if excess.numel() and excess.max() > 0:
        index = tuple(int(i) for i in (excess == excess.max()).nonzero()[0])
        bad = int((excess > 0).sum())
        raise AssertionError(
            f"{what}: {bad}/{excess.numel()} elements out of tolerance (atol={atol}, rtol={rtol}); worst at "
            f"{index}: got {out64[index].item():.6g}, expected {ref64[index].item():.6g}"
        )
