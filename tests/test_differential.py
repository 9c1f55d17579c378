"""A randomized differential test of the eager path against float64 F.conv2d: random layer
geometries (kernel, stride, padding, dilation, multiplier, bias), dtypes, layouts and doors
(DWCONV_NATIVE=0 / 1), each through forward and backward, a second call on tensors of other strides
and offsets, a saved-tensor hook, no_grad and inference_mode, and two threads at once. The seed of a
case is in its name: a failure is reproduced by its id alone.
"""

import os
import random
import threading

import pytest
import torch
import torch.nn.functional as F

import dwconv
from helpers import DEVICE, assert_close

SEED = 20261203
# (the interpreter: a few seconds a case; DWCONV_DIFFERENTIAL_CASES=N for a longer run)
CASES = int(os.environ.get("DWCONV_DIFFERENTIAL_CASES", 48 if DEVICE == "cuda" else 8))
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_layer(rng: random.Random) -> dict:
    kernel = (rng.randint(1, 5), rng.choice([1, 2, 3, 5, 7]))
    stride = (rng.randint(1, 3), rng.randint(1, 2))
    dilation = (rng.randint(1, 2), rng.randint(1, 2))
    if stride == (1, 1) and rng.random() < 0.3:
        padding = "same"
    else:
        padding = (rng.randint(0, kernel[0] - 1), rng.randint(0, kernel[1] - 1))
    span = [d * (k - 1) + 1 for d, k in zip(dilation, kernel)]
    pad = (0, 0) if padding == "same" else padding
    shape = (rng.randint(1, 2), rng.randint(1, 5), *(max(1, s - 2 * p) + rng.randint(0, 7) for s, p in zip(span, pad)))
    return dict(shape=shape, multiplier=rng.choice([1, 1, 2]), kernel=kernel, stride=stride, padding=padding,
                dilation=dilation, bias=rng.random() < 0.5, dtype=rng.choice(DTYPES),
                channels_last=rng.random() < 0.5, native=rng.choice(["0", "1"]),
                wanted=rng.choice([(True, True), (True, False), (False, True)]))


def draw(layer: dict, generator: torch.Generator):
    """Fresh input, weight, bias and grad_out of the layer (bias None where it has none)."""
    dtype, (n, c, h, w) = layer["dtype"], layer["shape"]
    out_channels = c * layer["multiplier"]
    x = torch.randn(n, c, h, w, generator=generator).to(DEVICE, dtype)
    if layer["channels_last"]:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(out_channels, 1, *layer["kernel"], generator=generator) / layer["kernel"][1]).to(DEVICE,
                                                                                                         dtype)
    bias = torch.randn(out_channels, generator=generator).to(DEVICE, dtype) if layer["bias"] else None
    return x, weight, bias


def options(layer):
    return dict(stride=layer["stride"], padding=layer["padding"], dilation=layer["dilation"])


def reference(layer, x, weight, bias, grad_out):
    """float64 F.conv2d: output and the gradients of input, weight and bias."""
    leaves = [None if t is None else t.detach().double().cpu().requires_grad_() for t in (x, weight, bias)]
    out = F.conv2d(*leaves, groups=x.shape[1], **options(layer))
    out.backward(grad_out.double().cpu())
    return out, [None if t is None else t.grad for t in leaves]


def check(layer, what, out, grads, x, weight, bias, grad_out):
    dtype = layer["dtype"]
    ref, ref_grads = reference(layer, x, weight, bias, grad_out)
    assert_close(out, ref, dtype, f"{what}: output")
    for name, got, want in zip(["input", "weight", "bias"], grads, ref_grads):
        if got is None:
            continue
        scale = want.abs().max().clamp(min=1) if name != "input" else 1  # (sums over many products)
        assert_close(got.double().cpu() / scale, want / scale, dtype, f"{what}: grad of {name}")


def run(layer, x, weight, bias, grad_out, context=None):
    """forward and backward on leaves of the tensors (those `wanted`, and bias): output and gradients."""
    want_input, want_weight = layer["wanted"]
    leaves = [x.detach().clone(memory_format=torch.preserve_format).requires_grad_(want_input),
              weight.detach().clone().requires_grad_(want_weight),
              None if bias is None else bias.detach().clone().requires_grad_()]
    if context is None:
        out = dwconv.depthwise_conv2d(*leaves, **options(layer))
    else:
        with context:
            out = dwconv.depthwise_conv2d(*leaves, **options(layer))
    out.backward(grad_out)
    return out, [None if t is None else t.grad for t in leaves]


def offset_copy(t):
    """t's values at other strides and a 16-byte-misaligned offset: a view into a wider buffer."""
    n, c, h, w = t.shape
    wide = torch.empty(n, c, h, w + 3, dtype=t.dtype, device=t.device)
    view = wide[..., 1:w + 1]
    return view.copy_(t)


@pytest.mark.parametrize("seed", range(SEED, SEED + CASES))
def test_random_layer(seed, monkeypatch):
    rng = random.Random(seed)
    layer = random_layer(rng)
    monkeypatch.setenv("DWCONV_NATIVE", layer["native"])
    generator = torch.Generator().manual_seed(seed)
    x, weight, bias = draw(layer, generator)
    out_shape = F.conv2d(x.float().cpu(), weight.float().cpu(), None, groups=x.shape[1], **options(layer)).shape
    described = f"{layer}"

    def fresh_grad_out():
        return torch.randn(*out_shape, generator=generator).to(DEVICE, layer["dtype"])

    grad_out = fresh_grad_out()
    for call in range(2):  # (the second: replayed or planned, not recorded)
        out, grads = run(layer, x, weight, bias, grad_out)
        check(layer, f"{described} call {call}", out, grads, x, weight, bias, grad_out)

    moved, moved_grad = offset_copy(x), offset_copy(grad_out)
    out, grads = run(layer, moved, weight, bias, moved_grad)
    check(layer, f"{described} other strides and offset", out, grads, moved, weight, bias, moved_grad)

    hook = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: offset_copy(t) if t.dim() == 4 else t)
    out, grads = run(layer, x, weight, bias, grad_out, hook)
    check(layer, f"{described} saved-tensor hook", out, grads, x, weight, bias, grad_out)

    ref = reference(layer, x, weight, bias, grad_out)[0]
    for name, context in [("no_grad", torch.no_grad()), ("inference_mode", torch.inference_mode())]:
        with context:
            out = dwconv.depthwise_conv2d(x, weight, bias, **options(layer))
        assert out.grad_fn is None
        assert_close(out, ref, layer["dtype"], f"{described} {name}: output")

    inputs = [(draw(layer, generator), fresh_grad_out()) for _ in range(2)]
    results, errors = [None, None], []

    def thread(i):
        try:
            results[i] = run(layer, *inputs[i][0], inputs[i][1])
        except Exception as error:  # (reported below)
            errors.append(repr(error))

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        check(layer, f"{described} thread {i}", *results[i], *inputs[i][0], inputs[i][1])
