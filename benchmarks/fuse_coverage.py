"""Developer tool (no GPU needed; needs timm): what `convert(model, fuse=True)` fuses in timm's models,
and the fused model's eval output against the stock model's in float64 (BatchNorm statistics made
non-trivial first). On a machine without a GPU and without TRITON_INTERPRET, PyTorch computes the
convolutions: this checks the blocks found and the folding, not the kernels (the tests do those).

    python benchmarks/fuse_coverage.py mobilenetv3_large_100 efficientnet_b0 repvit_m1
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


if __name__ == "__main__":
    main()
