"""Recorded passes (replay/program.py): a program replayed on fresh inputs of its key gives bitwise
what dwconv's Python path gives on them, forward and every backward combination; it refuses what it
cannot replay; the NaN poison shows a launch that did not happen."""

import pytest
import torch

from dwconv._geometry import conv_geometry
from dwconv._library import _backward_formula
from dwconv.replay import program
from dwconv.dispatch import conv_forward
from helpers import assert_close, randn

LAYOUTS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}
# (shape, kernel, stride, padding, dilation, multiplier, dtype): the kernels' families (rows / pixels,
# strided, dilated, a multiplier, large_fma on a narrow plane, half precision)
CASES = [
    ((2, 3, 7, 9), 3, 1, 1, 1, 1, torch.float32),
    ((1, 4, 10, 9), 3, 2, 1, 1, 1, torch.float32),
    ((1, 2, 7, 8), 3, 1, 2, 2, 2, torch.float32),
    ((1, 3, 8, 7), 5, 1, 2, 1, 1, torch.bfloat16),
]
IDS = ["k3", "k3-stride2", "k3-dil2-mult2", "k5-bf16"]


def inputs(shape, kernel, multiplier, dtype, layout, bias):
    x = randn(*shape, dtype=dtype).contiguous(memory_format=LAYOUTS[layout])
    weight = randn(shape[1] * multiplier, 1, kernel, kernel, dtype=dtype)
    return x, weight, randn(shape[1] * multiplier, dtype=dtype) if bias else None


def assert_same(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), (what, i)
        if a is not None:
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype, (what, i)
            assert torch.equal(a, b), f"{what}[{i}]: max abs difference {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape,kernel,stride,padding,dilation,multiplier,dtype", CASES, ids=IDS)
def test_forward_program_replays(shape, kernel, stride, padding, dilation, multiplier, dtype, layout):
    x, weight, bias = inputs(shape, kernel, multiplier, dtype, layout, bias=True)
    geom = conv_geometry(x, weight, bias, stride, padding, dilation)
    out, prog = program.record(lambda x, w, b: conv_forward(x, w, b, geom), [x, weight, bias])
    assert any(isinstance(step, program.LaunchStep) for step in prog.steps)
    fresh = inputs(shape, kernel, multiplier, dtype, layout, bias=True)
    assert program.program_key(fresh) == program.program_key((x, weight, bias))
    assert_same([prog.replay(*fresh, poison=True)], [conv_forward(*fresh, geom)], "output")


@pytest.mark.parametrize("wanted", [(True, True, False), (True, True, True), (False, True, True), (True, False, False)],
                         ids=["input+weight", "all", "weight+bias", "input"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape,kernel,stride,padding,dilation,multiplier,dtype", CASES[:3], ids=IDS[:3])
def test_backward_program_replays(shape, kernel, stride, padding, dilation, multiplier, dtype, layout, wanted):
    x, weight, _ = inputs(shape, kernel, multiplier, dtype, layout, bias=False)
    geom = conv_geometry(x, weight, None, stride, padding, dilation)

    def grads(grad_out, x, weight):
        return _backward_formula(grad_out, x, weight, geom, *wanted, traced=False)

    grad_out = randn(*geom.output_shape, dtype=dtype).contiguous(memory_format=LAYOUTS[layout])
    recorded, prog = program.record(grads, [grad_out, x, weight])
    assert [g is not None for g in recorded] == list(wanted)
    fresh_x, fresh_w, _ = inputs(shape, kernel, multiplier, dtype, layout, bias=False)
    fresh = (randn(*geom.output_shape, dtype=dtype).contiguous(memory_format=LAYOUTS[layout]), fresh_x, fresh_w)
    assert_same(prog.replay(*fresh, poison=True), grads(*fresh), "gradients")


def test_poison_shows_a_missing_launch():
    """The check above can fail: without its launch, the replayed output is the NaN poison."""
    x, weight, bias = inputs((1, 2, 6, 6), 3, 1, torch.float32, "nchw", bias=False)
    geom = conv_geometry(x, weight, bias, 1, 1, 1)
    _, prog = program.record(lambda x, w, b: conv_forward(x, w, b, geom), [x, weight, bias])
    prog.steps = [step for step in prog.steps if not isinstance(step, program.LaunchStep)]
    assert torch.isnan(prog.replay(x, weight, bias, poison=True)).all()


def test_program_key_sees_strides_and_alignment():
    x = randn(1, 2, 6, 9)
    shifted = randn(1, 2, 6, 10)[..., 1:]  # same shape, other strides and a 4-byte offset
    keys = {program.program_key((t,)) for t in (x, x.contiguous(memory_format=torch.channels_last), shifted,
                                                  x.to(torch.bfloat16))}
    assert len(keys) == 4


def test_refuses_what_it_cannot_replay():
    x = randn(1, 2, 4, 4)
    made_before = randn(2)
    with pytest.raises(program.NotRecordable, match="returned a"):
        program.record(lambda x: x.sum().item(), [x])
    with pytest.raises(program.NotRecordable, match="made before recording"):
        program.record(lambda x: x + made_before.view(1, 2, 1, 1), [x])
    assert program._launch.recorder() is None  # (a failed recording leaves none behind)


def test_recording_frees_what_the_pass_frees():
    """The recording call lets an intermediate go when the pass does (the first call's peak memory
    is then the replay's), and a tensor made later in the freed one's memory or id is still told
    apart from it in the program."""
    import weakref

    freed_during_recording = []

    def fn(x):
        temp = x + 1
        product = temp * 3
        dead = weakref.ref(temp)
        del temp
        freed_during_recording.append(dead() is None)
        later = x - 5  # (may take temp's id)
        return product + later

    x = randn(4, 6)
    out, prog = program.record(fn, [x])
    assert freed_during_recording == [True], "the recording held an intermediate the pass let go"
    fresh = randn(4, 6)
    assert_close(prog.replay(fresh), (fresh + 1) * 3 + (fresh - 5), torch.float32, "replay")
    assert_close(out, (x + 1) * 3 + (x - 5), torch.float32, "recorded result")
