"""The channels_last <-> NCHW copies of the paths that index unit-stride rows (kernels/layout.py)."""

import pytest
import torch

from dwconv.kernels import layout
from helpers import DTYPES, poisoned, randn

CL = torch.channels_last
# tiles past the last row and column (65 = 64 + 1 pixels, 70 channels), one pixel, one image
SHAPES = [(2, 70, 5, 13), (1, 3, 1, 1), (3, 64, 8, 8), (1, 130, 3, 7)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nchw_copy_of_channels_last(shape, dtype):
    x = randn(*shape, dtype=dtype).contiguous(memory_format=CL)
    copied = layout.nchw_copy(x)
    if layout.dense_channels_last(x):
        assert copied.data_ptr() != x.data_ptr()
    assert copied.is_contiguous() and torch.equal(copied, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_copy_into_channels_last(shape, dtype):
    src = randn(*shape, dtype=dtype)
    out = poisoned(shape, dtype, memory_format=CL)
    layout.copy_into(out, src)
    assert out.is_contiguous(memory_format=CL) and torch.equal(out, src)


def test_other_layouts_take_torch_copies():
    """NCHW is returned as it is; a channels_last view with gaps (a channel slice) and an
    NCHW-strided destination are copied by PyTorch, rightly."""
    x = randn(2, 6, 5, 7)
    assert layout.nchw_copy(x) is x
    sliced = randn(2, 8, 5, 7).contiguous(memory_format=CL)[:, 1:7]
    assert not layout.dense_channels_last(sliced)
    copied = layout.nchw_copy(sliced)
    assert copied.is_contiguous() and torch.equal(copied, sliced)
    out = poisoned((2, 8, 5, 7), torch.float32, memory_format=CL)[:, 1:7]
    layout.copy_into(out, x)
    assert torch.equal(out, x)
