"""examples/train_ddp.py under torchrun with 2 processes: DDP's first steps match one process on the
global batch. Without a GPU the processes use gloo and PyTorch's convolution (the Triton interpreter
would take minutes), which checks the example's training loop and comparison; on 2 GPUs it runs
dwconv's kernels with NCCL."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs or none")
def test_train_ddp_matches_one_process():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
         str(ROOT / "examples" / "train_ddp.py"), "--steps", "3", "--global-batch", "8", "--image", "32",
         "--width", "8", "--check"],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "MATCH" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU `python -m dwconv bench` is the full benchmark")
def test_bench_demo_without_gpu():
    """The README's main command on a machine without a GPU: the interpreter demo, started from an
    environment without TRITON_INTERPRET (the demo sets it before the kernels are imported)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-m", "dwconv", "bench"], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and "demo passed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
