#!/usr/bin/env bash
# Prints the python to use, after making sure torch, triton, pytest and dwconv are importable.
# - GPU machine (no network; torch and triton already installed): uses python3 as it is, with src/ on PYTHONPATH.
# - Fresh CPU machine: makes .venv with torch==2.13.0 (the CPU build; a bare `torch` would pull a
#   multi-GB CUDA build), triton, pytest and pytest-xdist from the package registry, and dwconv installed editable.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if python3 -c 'import torch, triton, pytest; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  echo python3
  exit 0
fi
venv=$root/.venv
# (ninja: torch.utils.cpp_extension builds dwconv's C++ replayer, replay/replay.cpp, with it)
if ! "$venv/bin/python" -c 'import torch, triton, pytest, xdist, ninja, dwconv' >/dev/null 2>&1; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" "triton==3.9.0" "pytest>=8" "pytest-xdist>=3" \
    numpy ninja >&2
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -e "$root" >&2
fi
# The GPU machine's Triton (3.6), beside the venv's, only to compile the kernels for sm_90 with it
# (tests/test_compile.py): a kernel can compile under one Triton and not the other.
if [ ! -d "$root/.triton36/triton" ]; then
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --target "$root/.triton36" "triton==3.6.0" >&2
fi
echo "$venv/bin/python"
