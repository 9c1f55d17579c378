"""Test set-up: without CUDA, run dwconv's Triton kernels under the interpreter on CPU tensors."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Must happen before triton.jit decorates dwconv's kernels (Triton reads it then).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import interpreter

    interpreter.remove_dead_work()

import contextlib  # noqa: E402

from dwconv import replay, tuning  # noqa: E402  (after TRITON_INTERPRET is set)

# Every partial-sum buffer starts as NaN in the tests: an entry no program writes fails the test.
tuning.override(poison_partials=True)

if torch.cuda.is_available():
    # eager calls on CUDA take the C++ replayer once it is built (replay/native.py): built now, so that
    # the tests of the eager path take the path users get, not whichever the background build allows
    replay.prepare()

# Modules that test the eager path as users get it. The others test kernels and their dispatch,
# some with dispatch knobs patched or launches spied on, which a program recorded by an earlier
# test would not see: on a GPU they take the Python path unless the run sets DWCONV_NATIVE itself
# (a run with DWCONV_NATIVE=1 set takes every module's tests through the C++ path).
EAGER_PATH_MODULES = ("test_native", "test_integration", "test_modules", "test_examples", "test_autograd_safety",
                      "test_differential")
NATIVE_SET_FOR_THE_RUN = "DWCONV_NATIVE" in os.environ


@pytest.fixture(autouse=True)
def eager_path(request, monkeypatch):
    """Each test records its own programs (under its own knobs); kernel tests on the Python path."""
    replay.forget_layers()
    if torch.cuda.is_available() and not NATIVE_SET_FOR_THE_RUN and request.module.__name__ not in EAGER_PATH_MODULES:
        monkeypatch.setenv("DWCONV_NATIVE", "0")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from empty caches: Dynamo's recompile limit (8 entries a code object, such
    as nn.Sequential.forward's) counts every model a process has compiled, and past it
    fullgraph=True fails, whichever tests a worker happened to run before."""
    dynamo = sys.modules.get("torch._dynamo")  # (not imported where no test compiles)
    if dynamo is not None:
        dynamo.reset()


@pytest.fixture
def retune():
    """retune(name=value, ...): the tuning table changed for the rest of the test (tuning.override)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(tuning.override(**changes))


@pytest.fixture(autouse=True)
def default_kernels_on_small_images(request, retune):
    """The forward and backward grids and the block replays test the default kernels: on their small
    images the dispatcher would take large_fma for every 3x3 kernel (it does on planes up to 28 wide),
    which test_large_kernels.py tests at those sizes (and which the interpreter runs slowest: the
    block replays took 304 s of CI's time with it, 78 s without it and at half the channels)."""
    if request.module.__name__ in ("test_forward", "test_backward", "test_block_replay"):
        retune(large_fma_small_kernel_max_width=0, large_fma_half_forward_max_width=0)
