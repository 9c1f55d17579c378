"""Developer tool: the host's time of one eager call of a converted layer, piece by piece, beside
stock's. The eager gap to stock on whole models is host time; this says which piece of a call holds it.

    python benchmarks/host_python.py [--calls 20000]            # no GPU: the Python alone
    python benchmarks/host_python.py --cuda [--calls 200]       # on a GPU: the real calls, and stock's
    python benchmarks/host_python.py [--cuda] --train            # the depthwise block's training step

Without --cuda the C++ known-call lookup is stubbed (it returns a preallocated output), so that only
the Python around it is timed (CPU tensors, nothing launched). With --cuda nothing is stubbed: the C++
path is built first and every call launches its kernel, timed while the GPU sleeps on a queued wait
(the host never waits on the GPU: its own time), on a MobileNetV2 layer in bfloat16 channels_last.
Prints microseconds a call for each piece: the best of 3 rounds in each of 3 turns through the pieces.
--train times the depthwise block (conv, BatchNorm2d, ReLU6) in training instead: a forward and a
backward, stock, converted and converted with fuse=True, and the fused BatchNorm's pieces (without
--cuda every dwconv launch is stubbed: the Python alone, against stock's calls on tiny CPU tensors).
"""

import argparse
import os
import sys
import time

CUDA = "--cuda" in sys.argv
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (CPU tensors take dwconv's path; nothing is launched here)
os.environ["DWCONV_NATIVE"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dwconv  # noqa: E402
from dwconv import functional, replay  # noqa: E402
from dwconv import fuse  # noqa: E402
from dwconv.fuse import folded_now, tensors_of  # noqa: E402
from dwconv.kernels import batch_norm as batch_norm_kernels  # noqa: E402


def per_call_us(fn, calls: int, rounds: int) -> float:
    """Best of `rounds` rounds of `calls` calls. On a GPU each round runs behind a queued sleep
    longer than its calls' kernels, and `calls` stays under the driver's queue of pending launches,
    so the host never waits."""
    best = float("inf")
    for _ in range(rounds):
        if CUDA:
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e8))
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    if CUDA:
        torch.cuda.synchronize()
    return best


def pieces() -> list:
    """(name, autocast, fn) for each piece timed."""
    device = "cuda" if CUDA else "cpu"
    shape = (64, 144, 56, 56) if CUDA else (2, 8, 6, 6)
    channels = shape[1]
    x = torch.randn(shape, device=device).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    stock = torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False, device=device)
    layer = dwconv.convert(torch.nn.Sequential(torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels,
                                                               bias=False, device=device)), verbose=False)[0]
    weight = layer.weight
    half_weight = weight.detach().to(torch.bfloat16)
    identity = torch.nn.Identity()
    rows = [("a no-op module's call", False, lambda: identity(x))]
    if CUDA:
        replay.prepare()
        lookup = replay.native._DEFAULT_MODULE[0].conv_known
        spelling = repr((1, 1, 1))
        rows += [("stock: F.conv2d, bfloat16 weight", False, lambda: F.conv2d(x, half_weight, None, 1, 1, 1, channels)),
                 ("stock: the nn.Conv2d's call under bfloat16 autocast", True, lambda: stock(x))]
    else:  # (the lookup and the launcher answer at once: what is left is the Python around them)
        from dwconv import _library

        out = torch.empty_like(x)
        replay.native._DEFAULT_MODULE[:] = [type("StubbedLookup", (), {"conv_known": staticmethod(lambda *a: out)})()]
        replay.native.has_known_layers = lambda: True
        _library.conv_forward = lambda *args, **kwargs: out
        _library._served_from_cpp = lambda t: None  # (the fused block's op: its Python, not the stubbed replayer)
        batch_norm_kernels.launch = lambda *args: None  # (the eval blocks' folding: its Python, no launch)
        fuse.replayed = lambda fn, inputs, *args, **kwargs: fn(*inputs, *args)  # (the folding's Python path)
    rows += [("depthwise_conv2d, bfloat16 weight", False, lambda: dwconv.depthwise_conv2d(x, half_weight, None, 1, 1, 1)),
             ("  of which the lookup's checks (_known_layer)", False,
              lambda: functional._known_layer(x, half_weight, None, 1, 1, 1))]
    if CUDA:
        from dwconv import _library

        rows.append(("    of which the C++ lookup and call (conv_known)", False,
                     lambda: lookup(x, half_weight, None, spelling)))
        conv = ([1, 1], [1, 1, 1, 1], [1, 1])  # (a compiled graph's calls: stock's aten op, dwconv's registered op)
        rows += [("stock: aten.convolution (a compiled graph's call)", False,
                  lambda: torch.ops.aten.convolution.default(x, half_weight, None, [1, 1], [1, 1], [1, 1], False,
                                                             [0, 0], channels)),
                 ("dwconv::conv2d (a compiled graph's call, the replayer's)", False,
                  lambda: torch.ops.dwconv.conv2d.default(x, half_weight, None, *conv)),
                 ("  its Python implementation alone", False,
                  lambda: _library._IMPLEMENTATIONS["conv2d"](x, half_weight, None, *conv))]
    rows += [("the converted layer's call under bfloat16 autocast", True, lambda: layer(x)),
             ("  its forward alone", True, lambda: layer.forward(x)),
             ("depthwise_conv2d under autocast, float32 weight", True,
              lambda: dwconv.depthwise_conv2d(x, weight, None, 1, 1, 1)),
             ("  the same with the layer's (pair) arguments", True,
              lambda: dwconv.depthwise_conv2d(x, weight, None, layer.stride, layer.padding, layer.dilation)),
             ("the full path's casts (_autocast)", True, lambda: functional._autocast(x, weight, None)),
             ("  of which the weight's cast", True, lambda: weight.to(torch.bfloat16))]
    # the depthwise block of MobileNetV2 (conv, BatchNorm2d, ReLU6) in eval mode, stock and fused
    block = torch.nn.Sequential(torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False),
                                torch.nn.BatchNorm2d(channels), torch.nn.ReLU6()).to(device).eval()
    fused = dwconv.convert(block, fuse=True, verbose=False, precompile=False)
    if CUDA:
        rows.append(("stock block (conv, BatchNorm2d, ReLU6) in eval, bfloat16 autocast", True, lambda: block(x)))
    norm = fused[1]
    rows += [("fused block (convert(fuse=True)) in eval, bfloat16 autocast", True, lambda: fused(x)),
             ("  of which depthwise_conv2d(activation='relu6')", False,
              lambda: dwconv.depthwise_conv2d(x, half_weight, None, 1, 1, 1, "relu6")),
             ("  of which the folding (fuse.folded_now)", False,
              lambda: folded_now(*tensors_of(fused[0], norm), norm.eps, torch.bfloat16))]
    if CUDA:  # (the fused block's registered op alone, as its eager call and a compiled graph make it)
        from dwconv.fuse import _block_op, _input_link

        tensors = tensors_of(fused[0], norm)
        rows.append(("  of which the block op (dwconv::conv2d_block), as the fused call makes it", False,
                     lambda: _block_op(fused[0], norm, _input_link(fused[0]), x, tensors)))
    if CUDA:  # (a pointwise convolution's block: PyTorch's convolution, the BatchNorm folded into it)
        pointwise = torch.nn.Sequential(torch.nn.Conv2d(channels, channels, 1, bias=False), torch.nn.BatchNorm2d(channels),
                                        torch.nn.ReLU6()).to(device).eval()
        folding = dwconv.convert(pointwise, fuse=True, verbose=False, precompile=False)
        rows += [("stock pointwise block (1x1 conv, BatchNorm2d, ReLU6) in eval, autocast", True,
                  lambda: pointwise(x)),
                 ("the same, its BatchNorm folded (convert(fuse=True))", True, lambda: folding(x))]
        # an inverted residual's expansion and depthwise block: the depthwise layer applies the
        # expansion's BatchNorm and ReLU6 as it loads (nothing folded into the expansion)
        narrow = x[:, :24].contiguous(memory_format=torch.channels_last)
        inverted = torch.nn.Sequential(
            torch.nn.Sequential(torch.nn.Conv2d(24, channels, 1, bias=False), torch.nn.BatchNorm2d(channels),
                                torch.nn.ReLU6()),
            torch.nn.Sequential(torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False),
                                torch.nn.BatchNorm2d(channels), torch.nn.ReLU6())).to(device).eval()
        rows.append(("stock expansion + depthwise blocks in eval, autocast", True, lambda: inverted(narrow)))
        linked = dwconv.convert(inverted, fuse=True, verbose=False, precompile=False)
        rows.append(("the same fused (the expansion's BatchNorm applied by the depthwise layer)", True,
                     lambda: linked(narrow)))
    return rows


def training_pieces() -> list:
    """(name, autocast, fn) for the block's training step and the fused BatchNorm's pieces."""
    import copy

    from dwconv.activations import activation_code
    from dwconv.batch_norm import BatchNormActivationFunction
    from dwconv.kernels import _launch, batch_norm

    device = "cuda" if CUDA else "cpu"
    if CUDA:
        replay.prepare()
    shape = (64, 144, 56, 56) if CUDA else (2, 144, 6, 6)
    channels = shape[1]
    x = torch.randn(shape, device=device).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    grad = torch.randn_like(x)
    block = torch.nn.Sequential(torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False),
                                torch.nn.BatchNorm2d(channels), torch.nn.ReLU6()).to(device)
    converted = dwconv.convert(copy.deepcopy(block), verbose=False, precompile=False)
    fused = dwconv.convert(copy.deepcopy(block), fuse=True, verbose=False, precompile=False)
    norm = copy.deepcopy(block[1])
    y = x.detach().clone().requires_grad_()
    relu6 = activation_code("relu6")
    saved = {}

    def step(model):
        def run():
            out = model(x)
            out.backward(grad)
        return run

    def bn_forward():
        saved["out"] = batch_norm.batch_norm_forward(y.detach(), norm.weight, norm.bias, norm.running_mean,
                                                     norm.running_var, 0.1, norm.eps, relu6)

    def bn_backward():
        _, mean, invstd = saved["out"]
        batch_norm.batch_norm_backward(grad, y.detach(), norm.weight, norm.bias, mean, invstd, norm.eps, relu6)

    def stock_bn():
        out = F.hardtanh(F.batch_norm(y, norm.running_mean, norm.running_var, norm.weight, norm.bias, True, 0.1,
                                      norm.eps), 0.0, 6.0)
        out.backward(grad)

    def fused_bn(replay=True):
        def run():
            out = BatchNormActivationFunction.apply(y, norm.weight, norm.bias, norm.running_mean, norm.running_var,
                                                    0.1, norm.eps, "relu6", replay)
            out.backward(grad)
        return run

    rows = [("stock block train step (forward, backward), bf16 autocast", True, step(block)),
            ("converted block train step", True, step(converted)),
            ("fused block train step (convert(fuse=True))", True, step(fused)),
            ("stock BatchNorm2d + ReLU6 forward, backward", False, stock_bn),
            ("fused BatchNorm + ReLU6 (the Function) forward, backward", False, fused_bn()),
            ("  the same, its forward's launches from Python", False, fused_bn(replay=False)),
            ("  its forward's kernels (batch_norm_forward: 3 launches)", False, bn_forward),
            ("  its backward's kernels (batch_norm_backward: 3 launches)", False, bn_backward)]
    if not CUDA:
        for _, autocast, fn in rows:  # (the first calls record the layers; then nothing launches)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                fn()
        _launch.launch_now = lambda *args, **kwargs: None
    return rows


def measure(calls: int, rounds: int = 3, turns: int = 3, train: bool = False) -> list:
    """[(name, us)]: each piece's best over `turns` turns through all pieces (the host drifts)."""
    rows = training_pieces() if train else pieces()
    best = {name: float("inf") for name, _, _ in rows}
    with torch.set_grad_enabled(train):
        for _ in range(turns):
            for name, autocast, fn in rows:
                with torch.autocast("cuda" if CUDA else "cpu", dtype=torch.bfloat16, enabled=autocast):
                    fn()  # (a first call records the layer; warm-up)
                    best[name] = min(best[name], per_call_us(fn, calls, rounds))
    return list(best.items())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=None, help="calls a round (default 20000, 200 with --cuda; --train: 1000, 40)")
    parser.add_argument("--cuda", action="store_true", help="real calls on the GPU, beside stock's")
    parser.add_argument("--train", action="store_true", help="the depthwise block's training step and its pieces")
    args = parser.parse_args()
    calls = args.calls or {(False, False): 20000, (True, False): 200, (False, True): 1000, (True, True): 40}[
        (CUDA, args.train)]  # (a GPU round: fewer launches than the driver queues, about a thousand)
    for name, us in measure(calls, train=args.train):
        print(f"{name:<55} {us:7.2f} us")


if __name__ == "__main__":
    main()
