"""Train a small depthwise-heavy network with dwconv layers under DistributedDataParallel, and check
that its first steps match a single-process run of the same global batch.

    torchrun --nproc_per_node=2 examples/train_ddp.py --steps 5 --check

One process a GPU with NCCL; without a GPU, CPU processes with gloo, where dwconv falls back to
PyTorch's convolution unless TRITON_INTERPRET=1 is set (the interpreter takes seconds a layer even
at toy sizes), which still checks the training loop and the comparison. Every rank builds the same model from the same
seed and draws the same global batch each step, then trains on its own slice; plain DDP averages
the gradients. With --check, rank 0 also trains a copy of the model on the whole global batch in
one process and compares the loss of every step and the gradients of the first: DDP's averaged
gradients of per-slice mean losses equal the gradients of the global mean loss.
"""

import argparse
import copy
import os
import sys

# NVLink multicast stays off on shared hosts (the GPU machines' notes): set before NCCL starts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import dwconv  # noqa: E402


def block(channels: int, expand: int, kernel: int, stride: int) -> nn.Sequential:
    """An inverted-residual-style block: pointwise up, depthwise, pointwise down."""
    hidden = channels * expand
    return nn.Sequential(
        nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
        nn.Conv2d(hidden, hidden, kernel, stride, kernel // 2, groups=hidden, bias=False),
        nn.BatchNorm2d(hidden), nn.ReLU6(),
        nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels),
    )


class TinyMobileNet(nn.Module):
    def __init__(self, width: int, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU6())
        self.blocks = nn.Sequential(block(width, 4, 3, 1), block(width, 4, 5, 2), block(width, 6, 7, 1))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def batch(step: int, size: int, image: int, device) -> tuple:
    """The global batch of a step: the same on every rank (seeded by the step)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 3, image, image, generator=gen)
    y = torch.randint(0, 10, (size,), generator=gen)
    return x.to(device), y.to(device)


def train(model, optimizer, steps, global_batch, image, device, rank=0, world=1):
    """Losses of each step (of the whole global batch) and the gradients after the first step."""
    losses, first_grads = [], None
    per_rank = global_batch // world
    for step in range(steps):
        x, y = batch(step, global_batch, image, device)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if step == 0:
            first_grads = [p.grad.detach().clone() for p in model.parameters()]
        optimizer.step()
        total = loss.detach().clone()
        if world > 1:  # the global batch's mean loss, for the report
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses, first_grads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--image", type=int, default=64, help="image side (small without a GPU)")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--check", action="store_true", help="compare with one process on the global batch")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        # the reference comparison needs the same arithmetic in both runs
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if args.global_batch % world:
        raise SystemExit(f"--global-batch ({args.global_batch}) must be a multiple of the world size ({world})")

    torch.manual_seed(0)
    model = dwconv.convert(TinyMobileNet(args.width), verbose=rank == 0).to(device)
    # BatchNorm statistics are per process under DDP (no SyncBatchNorm), so the comparison with one
    # process is exact only for the loss of step 0 and the first gradients if BN is in eval mode.
    reference = copy.deepcopy(model)
    for m in list(model.modules()) + list(reference.modules()):
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    losses, grads = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), args.steps,
                          args.global_batch, args.image, device, rank, world)
    if rank == 0:
        from dwconv.functional import uses_triton

        kernels = "dwconv's Triton kernels" if uses_triton(next(model.parameters())) else "PyTorch's fallback"
        print(f"world {world} ({'NCCL, ' + torch.cuda.get_device_name() if cuda else 'gloo, CPU'}), "
              f"{model.dwconv_converted} dwconv layers on {kernels}; loss per step: "
              + " ".join(f"{v:.5f}" for v in losses))
    status = 0
    if args.check and rank == 0:
        ref_losses, ref_grads = train(reference, torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9),
                                      args.steps, args.global_batch, args.image, device)
        print("single process, global batch:  " + " ".join(f"{v:.5f}" for v in ref_losses))
        loss_err = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref_losses))
        grad_err = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for g, r in zip(grads, ref_grads))
        ok = loss_err <= 1e-4 and grad_err <= 1e-3
        print(f"max relative difference: loss {loss_err:.2e}, first-step gradients {grad_err:.2e} -> "
              f"{'MATCH' if ok else 'MISMATCH'}")
        status = 0 if ok else 1
    # rank 0 runs the reference alone: the others wait, so that no rank tears its connections down
    # while a peer still holds them open (gloo aborted a rank so under a loaded CPU)
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    status = main()
    # All work is done and the process group destroyed; skip the interpreter's teardown, where gloo's
    # worker threads aborted a rank now and then under a loaded CPU ("terminate called without an
    # active exception", ~1 run in 15 with 3 runs side by side on 2 cores) after its result was out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
