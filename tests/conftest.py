"""Test set-up: without CUDA, run dwconv's Triton kernels under the interpreter on CPU tensors."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must happen before triton.jit decorates dwconv's kernels (Triton reads it then).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dwconv.ops._launch  # noqa: E402  (after TRITON_INTERPRET is set)
from dwconv.ops import large_fma  # noqa: E402

# Every partial-sum buffer starts as NaN in the tests: an entry no program writes fails the test.
dwconv.ops._launch.POISON_PARTIALS = True

if torch.cuda.is_available():
    # eager calls on CUDA take the C++ replayer once it is built (ops/native.py): built now, so that
    # every GPU test takes the path users get, not whichever the background build allows
    from dwconv.ops import native  # noqa: E402

    native.prepare()


@pytest.fixture(autouse=True)
def default_kernels_on_small_images(request, monkeypatch):
    """The forward and backward grids test the default kernels: on their small images the dispatcher
    would take large_fma for every 3x3 kernel (it does on planes up to 28 wide), which
    test_large_kernels.py tests at those sizes."""
    if request.module.__name__ in ("test_forward", "test_backward"):
        monkeypatch.setattr(large_fma, "LARGE_FMA_SMALL_KERNEL_MAX_WIDTH", 0)
        monkeypatch.setattr(large_fma, "LARGE_FMA_HALF_FORWARD_MAX_WIDTH", 0)
