"""Test set-up: without CUDA, run dwconv's Triton kernels under the interpreter on CPU tensors."""

import os

import torch

if not torch.cuda.is_available():
    # Must happen before triton.jit decorates dwconv's kernels (Triton reads it then).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dwconv.ops._launch  # noqa: E402  (after TRITON_INTERPRET is set)

# Every partial-sum buffer starts as NaN in the tests: an entry no program writes fails the test.
dwconv.ops._launch.POISON_PARTIALS = True
