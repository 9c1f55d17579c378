"""The C++ replayer (csrc/replay.cpp through ops/native.py): recorded programs replayed from C++
give bitwise what dwconv's Python path gives, forward and backward, both layouts. On the CPU the
launches call back into Python (the interpreter); on a GPU they are cuLaunchKernel of Triton's cubins."""

import pytest
import torch

from dwconv._geometry import conv_geometry
from dwconv._library import _backward_formula
from dwconv.ops import native, program
from dwconv.ops.forward import conv_forward
from helpers import DEVICE, randn
from test_program import LAYOUTS, assert_same

# (shape, kernel, stride, padding, dilation): 3x3 (the fused backward), strided, and a 7x7 on a
# narrow plane (large_fma in NCHW)
CASES = [((2, 3, 7, 9), 3, 1, 1, 1), ((1, 4, 9, 8), 3, 2, 1, 1), ((1, 2, 9, 10), 7, 1, 3, 1)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape,kernel,stride,padding,dilation", CASES, ids=["k3", "k3-stride2", "k7"])
def test_native_replay(shape, kernel, stride, padding, dilation, layout):
    memory_format = LAYOUTS[layout]

    def tensors():
        x = randn(*shape).contiguous(memory_format=memory_format)
        return x, randn(shape[1], 1, kernel, kernel), randn(shape[1])

    x, weight, bias = tensors()
    geom = conv_geometry(x, weight, bias, stride, padding, dilation)

    def grads(grad_out, x, weight):
        return _backward_formula(grad_out, x, weight, geom, True, True, True, traced=False)

    grad_out = randn(*geom.output_shape).contiguous(memory_format=memory_format)
    _, forward = program.record(lambda x, w, b: conv_forward(x, w, b, geom), [x, weight, bias])
    _, backward = program.record(grads, [grad_out, x, weight])
    python_launches = DEVICE == "cpu"
    forward, backward = (native.native_program(p, python_launches) for p in (forward, backward))
    fresh = tensors()
    out = forward.replay(*fresh)
    out_again = forward.replay(*fresh)
    assert_same([out, out_again], [conv_forward(*fresh, geom)] * 2, "output")
    fresh_grad = randn(*geom.output_shape).contiguous(memory_format=memory_format)
    assert_same(backward.replay(fresh_grad, *fresh[:2]), grads(fresh_grad, *fresh[:2]), "gradients")


def test_native_program_checks_its_inputs():
    x, weight = randn(1, 2, 5, 5), randn(2, 1, 3, 3)
    geom = conv_geometry(x, weight, None, 1, 1, 1)
    _, prog = program.record(lambda x, w: conv_forward(x, w, None, geom), [x, weight])
    replay = native.native_program(prog, python_launches=DEVICE == "cpu")
    with pytest.raises(RuntimeError, match="program takes 2 inputs"):
        replay.replay(x)
