"""Test set-up: without CUDA, run dwconv's Triton kernels under the interpreter on CPU tensors."""

import os

import torch

if not torch.cuda.is_available():
    # Must happen before triton.jit decorates dwconv's kernels (Triton reads it then).
    os.environ.setdefault("TRITON_INTERPRET", "1")
