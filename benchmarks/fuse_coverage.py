"""Developer tool (no GPU needed; needs timm): what `convert(model, fuse=True)` fuses in timm's models,
and the fused model's eval output against the stock model's in float64 (BatchNorm statistics made
non-trivial first). On a machine without a GPU and without TRITON_INTERPRET, PyTorch computes the
convolutions: this checks the blocks found and the folding, not the kernels (the tests do those).
--train: also a training step (output, every parameter's gradient, the running statistics after
it) against stock's in float64, beside stock's in float32; on a GPU (or with TRITON_INTERPRET=1 on
the CPU machine, about 40 minutes for MobileNetV3 at 16 x 16) dwconv's kernels compute the
convolutions and the training blocks' BatchNorm.

    python benchmarks/fuse_coverage.py mobilenetv3_large_100 efficientnet_b0 repvit_m1
    python benchmarks/fuse_coverage.py mobilenetv3_large_100 efficientnet_b0 --train --image 64   # on a GPU
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

DEFAULT = ["mobilenetv3_large_100", "mobilenetv4_conv_small", "efficientnet_b0", "convnext_tiny", "repvit_m1",
           "ghostnet_100", "mixnet_s", "edgenext_small"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="*", default=DEFAULT)
    p.add_argument("--image", type=int, default=96)
    p.add_argument("--train", action="store_true", help="also a training step against stock's in float64")
    args = p.parse_args()
    import timm
    import torch

    import dwconv

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in args.models:
        stock = timm.create_model(name, pretrained=False).eval().to(device)
        for module in stock.modules():
            if isinstance(module, torch.nn.BatchNorm2d) and module.running_mean is not None:
                with torch.no_grad():
                    module.running_mean.normal_(0, 0.1)
                    module.running_var.uniform_(0.5, 1.5)
        print(f"--- {name}")
        fused = dwconv.convert(stock, fuse=True, precompile=False)
        x = torch.randn(2, 3, args.image, args.image, device=device)
        with torch.no_grad():
            out = fused(x)
            ref = stock.double()(x.double())
        error = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        print(f"{name}: max |fused - stock| / max |stock| = {error:.2e}; state_dict keys the same: "
              f"{list(fused.state_dict()) == list(stock.state_dict())}")
        if args.train:
            train_step_errors(name, stock, fused, x)


def relative(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def train_step_errors(name, stock, fused, x):
    """One training step of the fused model and of a float32 copy of stock's against stock's in
    float64 (the copy: float32's own error on this model and input, the floor the fused one is read
    against; a batch of 2 at a small image makes BatchNorm ill-conditioned in the late layers):
    the output's relative error, the parameters' gradients' (each against the largest of stock's
    gradients: a bias before a BatchNorm has none in exact arithmetic), the running statistics'."""
    import copy

    import torch

    stock32 = copy.deepcopy(stock).float()
    results = {}
    for label, model, inputs in (("fused", fused, x), ("stock float32", stock32, x), ("stock", stock, x.double())):
        model.train()
        out = model(inputs)
        out.square().mean().backward()
        results[label] = (out, [p.grad for p in model.parameters()], list(model.buffers()))
    ref_out, ref_grads, ref_buffers = results.pop("stock")
    scale = max(g.abs().max().item() for g in ref_grads if g is not None)
    for label, (out, grads, buffers) in results.items():
        grad_error = max((g.double() - r).abs().max().item() / scale for g, r in zip(grads, ref_grads) if r is not None)
        stats = max(relative(b, c) for b, c in zip(buffers, ref_buffers) if b.is_floating_point())
        counts = all(torch.equal(b.cpu(), c.cpu()) for b, c in zip(buffers, ref_buffers) if not b.is_floating_point())
        print(f"{name} training step, {label} against stock float64: output {relative(out, ref_out):.2e}, "
              f"parameter gradients {grad_error:.2e} (of the largest), running statistics {stats:.2e}, "
              f"num_batches_tracked equal: {counts}")


if __name__ == "__main__":
    main()
