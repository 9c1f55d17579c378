"""The kernels compile for sm_90 with the GPU configurations, under the installed Triton and under
the GPU machine's Triton 3.6 (installed beside the venv by scripts/setup.sh): tests/compile_check.py
in a fresh process, since this one runs the kernels under the interpreter, which compiles nothing."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON_36 = os.environ.get("DWCONV_TRITON36", os.path.join(ROOT, ".triton36"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on the GPU every test compiles its kernels for real")
@pytest.mark.parametrize("triton_version", ["installed", "3.6"])
def test_kernels_compile_for_sm90(triton_version):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_version == "3.6":
        if not os.path.isdir(os.path.join(TRITON_36, "triton")):
            pytest.skip(f"no Triton 3.6 at {TRITON_36} (scripts/setup.sh installs it)")
        env["PYTHONPATH"] = os.pathsep.join([TRITON_36, env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "compile_check.py")], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    if triton_version == "3.6":
        assert "triton 3.6" in result.stdout, result.stdout[-500:]
