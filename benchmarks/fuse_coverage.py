"""Developer tool (no GPU needed; needs timm): what `convert(model, fuse=True)` fuses in timm's models,
and the fused model's eval output against the stock model's in float64 (BatchNorm statistics made
non-trivial first). On a machine without a GPU and without TRITON_INTERPRET, PyTorch computes the
convolutions: this checks the blocks found and the folding, not the kernels (the tests do those).
--train: also a training step (output, every parameter's gradient, the running statistics after
it) against stock's in float64; with TRITON_INTERPRET=1 dwconv's kernels compute the convolutions
and the training blocks' BatchNorm (minutes a model on the CPU machine).

    python benchmarks/fuse_coverage.py mobilenetv3_large_100 efficientnet_b0 repvit_m1
    TRITON_INTERPRET=1 python benchmarks/fuse_coverage.py mobilenetv3_large_100 --train --image 64
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
    for name in args.models:
        stock = timm.create_model(name, pretrained=False).eval()
        for module in stock.modules():
            if isinstance(module, torch.nn.BatchNorm2d) and module.running_mean is not None:
                with torch.no_grad():
                    module.running_mean.normal_(0, 0.1)
                    module.running_var.uniform_(0.5, 1.5)
        print(f"--- {name}")
        fused = dwconv.convert(stock, fuse=True, precompile=False)
        x = torch.randn(2, 3, args.image, args.image)
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
    """One training step of each (float32 fused, float64 stock): the worst relative error of the
    output, of the parameters' gradients and of the BatchNorm statistics after it."""
    import torch

    fused.train(), stock.train()
    outputs = []
    for model, inputs in ((fused, x), (stock, x.double())):
        out = model(inputs)
        out.square().mean().backward()
        outputs.append(out)
    grads = [relative(p.grad, q.grad) for p, q in zip(fused.parameters(), stock.parameters()) if q.grad is not None]
    buffers = [relative(b, c) for b, c in zip(fused.buffers(), stock.buffers()) if b.is_floating_point()]
    counts = all(torch.equal(b, c) for b, c in zip(fused.buffers(), stock.buffers()) if not b.is_floating_point())
    print(f"{name} training step: output {relative(*outputs):.2e}, worst parameter gradient {max(grads):.2e} "
          f"(of {len(grads)}), worst running statistic {max(buffers):.2e}, num_batches_tracked equal: {counts}")


if __name__ == "__main__":
    main()
