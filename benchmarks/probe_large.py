"""Developer probe (GPU): large kernels (issue #6). The Toeplitz tensor-core path against the CUDA-core
tile kernel and PyTorch eager, forward and forward+backward, in NCHW and channels_last; the errors of
dwconv and of PyTorch against float64; a block sweep; the crossover by kernel size.

    PYTHONPATH=src python benchmarks/probe_large.py [--quick] [--sweep] [--crossover] [--parts] [--fma] [--layers I ...]
"""

import argparse

import torch
import torch.nn.functional as F

import dwconv
from dwconv._geometry import conv_geometry
from dwconv.ops import toeplitz
from dwconv.ops.forward import ForwardConfig, band_rows, conv_forward
from dwconv.bench import graphed
from profile_model import events_ms  # (benchmarks/ is on the path when run as a script)

LAYERS = [((32, 128, 56, 56), 31, 15), ((32, 256, 28, 28), 13, 6), ((32, 128, 56, 56), 51, 25),
          ((32, 128, 56, 56), 13, 6)]  # (the last: where whole 56-wide rows a thread start to pay)


GRAPHS = False  # --graphs: dwconv's forward timed as CUDA-graph replays


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def flops(shape, k):
    return 2 * shape[0] * shape[1] * shape[2] * shape[3] * k * k  # (stride 1, 'same' padding)


def tile_config(geom, x):
    return ForwardConfig("tile", band_rows(geom, 4, x.device), 64, 2)


def forward_rows(shape, k, pad, dtype, layouts=("nchw", "cl"), old=True):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype) / k
    ref = F.conv2d(x.double(), w.double(), None, 1, pad, 1, groups=shape[1])
    for layout in layouts:
        xl = x.contiguous(memory_format=torch.channels_last) if layout == "cl" else x
        geom = conv_geometry(xl, w, None, 1, pad, 1)
        eager = events_ms(lambda: F.conv2d(xl, w, None, 1, pad, 1, groups=shape[1]), 5)
        torch_err = rel_err(F.conv2d(xl, w, None, 1, pad, 1, groups=shape[1]), ref)
        out = dwconv.depthwise_conv2d(xl, w, None, 1, pad)
        assert out.is_contiguous(memory_format=torch.channels_last if layout == "cl" else torch.contiguous_format)
        if GRAPHS:  # the GPU's time: k13's forward is host-bound under plain events
            ms = events_ms(graphed(lambda: dwconv.depthwise_conv2d(xl, w, None, 1, pad)), 50)
        else:
            ms = events_ms(lambda: dwconv.depthwise_conv2d(xl, w, None, 1, pad), 10)
        line = (f"fwd {str(dtype)[6:]:8s} {layout:4s} {str(shape):18s} k{k}: dwconv {ms:.3f} ms "
                f"({flops(shape, k) / ms / 1e9:.1f} TFLOP/s), eager {eager:.3f} ms, x{eager / ms:.2f}; "
                f"err dwconv {rel_err(out, ref):.1e} torch {torch_err:.1e}")
        if old and layout == "nchw" and dtype != torch.float16:
            old_ms = events_ms(lambda: conv_forward(xl, w, None, geom, tile_config(geom, xl)), 3)
            line += f"; tile kernel {old_ms:.3f} ms"
        print(line, flush=True)


def backward_rows(shape, k, pad, dtype, layouts=("nchw", "cl")):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype) / k
    g = torch.randn(shape, device="cuda", dtype=dtype)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    F.conv2d(xd, wd, None, 1, pad, 1, groups=shape[1]).backward(g.double())
    for layout in layouts:
        fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
        xl = x.detach().contiguous(memory_format=fmt).requires_grad_()
        gl = g.contiguous(memory_format=fmt)
        wl = w.clone().requires_grad_()

        def step(fn):
            xl.grad = wl.grad = None
            fn(xl, wl, None, 1, pad).backward(gl)

        def torch_conv(*args):
            return F.conv2d(*args, groups=shape[1])

        step(torch_conv)
        torch_errs = rel_err(xl.grad, xd.grad), rel_err(wl.grad, wd.grad)
        eager = events_ms(lambda: step(torch_conv), 3)
        torch.cuda.reset_peak_memory_stats()
        step(dwconv.depthwise_conv2d)
        peak = torch.cuda.max_memory_allocated() / 2**20
        errs = rel_err(xl.grad, xd.grad), rel_err(wl.grad, wd.grad)
        ms = events_ms(lambda: step(dwconv.depthwise_conv2d), 5)
        print(f"f+b {str(dtype)[6:]:8s} {layout:4s} {str(shape):18s} k{k}: dwconv {ms:.3f} ms "
              f"({3 * flops(shape, k) / ms / 1e9:.1f} TFLOP/s), eager {eager:.3f} ms, x{eager / ms:.2f}; "
              f"err gx/gw dwconv {errs[0]:.1e}/{errs[1]:.1e} torch {torch_errs[0]:.1e}/{torch_errs[1]:.1e}; "
              f"peak {peak:.0f} MiB", flush=True)


def parts(shape, k, pad, dtype):
    """The backward's parts alone (CUDA events, no L2 flush), beside the forward: where the
    forward+backward's time goes."""
    from dwconv.ops.backward import conv_grad_input, conv_grad_weight

    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype) / k
    g = torch.randn(shape, device="cuda", dtype=dtype)
    geom = conv_geometry(x, w, None, 1, pad, 1)
    times = dict(forward=events_ms(lambda: conv_forward(x, w, None, geom), 10),
                 grad_input=events_ms(lambda: conv_grad_input(g, w, geom, x), 10),
                 grad_weight=events_ms(lambda: conv_grad_weight(g, x, geom, dtype, False), 10))
    print(f"parts {str(dtype)[6:]:8s} {str(shape):18s} k{k}: " + ", ".join(f"{n} {t:.3f} ms" for n, t in times.items())
          + f" (sum {sum(times.values()):.3f})", flush=True)


def sweep():
    """Forward blocks (rows, warps) and grad_weight blocks on the k31 layer."""
    shape, k, pad = LAYERS[0]
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(shape, device="cuda", dtype=dtype)
        w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype) / k
        geom = conv_geometry(x, w, None, 1, pad, 1)
        out = torch.empty_like(x)
        for block_m, block_w, warps in [(64, 16, 4), (128, 16, 4), (128, 16, 8), (64, 32, 4), (128, 32, 8),
                                        (256, 16, 8), (64, 64, 4)]:
            ms = events_ms(lambda: toeplitz.toeplitz_forward(x, w, None, geom, out, block_m, block_w, warps), 10)
            print(f"sweep fwd {str(dtype)[6:]} k{k} M{block_m} W{block_w} warps{warps}: {ms:.3f} ms", flush=True)
        g = torch.randn_like(x)
        for block_m, block_w, rows, warps in [(64, 16, 0, 4), (128, 16, 0, 4), (64, 32, 0, 4), (64, 16, 256, 4),
                                              (64, 16, 1024, 4), (128, 32, 0, 8)]:
            ms = events_ms(lambda: toeplitz.toeplitz_grad_weight(g, x, geom, dtype, False, block_m, block_w, rows,
                                                                 warps), 5)
            print(f"sweep gw  {str(dtype)[6:]} k{k} M{block_m} W{block_w} rows{rows} warps{warps}: {ms:.3f} ms",
                  flush=True)


def crossover(dtypes):
    """Toeplitz against the CUDA-core kernels by kernel size: forward, and forward+backward."""
    shape = (32, 128, 56, 56)
    threshold = toeplitz.TOEPLITZ_MIN_TAPS
    for dtype in dtypes:
        for k in (5, 7, 9, 11, 13, 17):
            x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
            w = torch.randn(shape[1], 1, k, k, device="cuda", dtype=dtype, requires_grad=True)
            g = torch.randn(shape, device="cuda", dtype=dtype)
            times = {}
            for name, min_taps in (("toeplitz", 1), ("cuda-core", 10**9)):
                toeplitz.TOEPLITZ_MIN_TAPS = min_taps
                fwd = events_ms(lambda: dwconv.depthwise_conv2d(x, w, None, 1, k // 2), 5)
                both = events_ms(lambda: dwconv.depthwise_conv2d(x, w, None, 1, k // 2).backward(g), 3)
                times[name] = (fwd, both)
            toeplitz.TOEPLITZ_MIN_TAPS = threshold
            print(f"crossover {str(dtype)[6:]} k{k}: " + ", ".join(
                f"{name} fwd {f:.3f} f+b {b:.3f} ms" for name, (f, b) in times.items()), flush=True)


def fma(layers, extra_blocks=()):
    """float32: the CUDA-core kernels (large_fma) against the Toeplitz products: the forward at the
    launcher's blocks, 28 outputs a thread and weight vectors (errors against float64), the weight gradient, then
    forward+backward through dwconv with large_fma off (large_fma.LARGE_FMA_MIN_TAPS beyond any kernel) and on."""
    from dwconv.ops import large_fma
    from dwconv.ops.backward import conv_grad_input, conv_grad_weight

    for shape, k, pad in layers:
        x = torch.randn(shape, device="cuda")
        w = torch.randn(shape[1], 1, k, k, device="cuda") / k
        g = torch.randn(shape, device="cuda")
        geom = conv_geometry(x, w, None, 1, pad, 1)
        ref = F.conv2d(x.double(), w.double(), None, 1, pad, 1, groups=shape[1])
        out = torch.empty_like(x)
        default = large_fma.large_fma_forward_blocks(geom, x)
        # (session 14 timed 8, 16 and 32 outputs a thread against the default's: docs/notes.md)
        # 28 outputs a thread: 56-wide rows in two groups, 28-wide in one (no wasted columns; rows
        # of 16 or 32 waste 8 of 64 or 4 of 32; sm_90 loop 86% FFMA on k31 against 78% at 16)
        groups = 1 if geom.out_w <= 28 else 2
        whole_rows = (32 // groups, 28 * groups, 1, 28)
        runs = {"toeplitz": lambda: toeplitz.toeplitz_forward(x, w, None, geom, out)}
        # 32 outputs a thread at most: the weight gradient's blocks, the forward's before session 19
        for blocks in dict.fromkeys([default, large_fma.large_fma_blocks(geom), whole_rows, *extra_blocks]):
            runs[f"fma {blocks}"] = lambda blocks=blocks: large_fma.large_fma_forward(x, w, None, geom, out,
                                                                                      blocks=blocks)
        runs["fma, weight vectors"] = lambda: with_weight_vectors(large_fma.large_fma_forward, x, w, None, geom, out)
        runs["fma, scalar weights"] = lambda: with_weight_vectors(large_fma.large_fma_forward, x, w, None, geom, out,
                                                                  on=False)
        for name, fn in runs.items():
            out.fill_(float("nan"))
            fn()
            ms = events_ms(fn, 10)
            print(f"fma fwd float32 {str(shape):18s} k{k} {name:28s}: {ms:.3f} ms ({flops(shape, k) / ms / 1e9:.1f} "
                  f"TFLOP/s), err {rel_err(out, ref):.1e}", flush=True)
        weight_grads = []
        for name, fn in (("toeplitz", lambda: toeplitz.toeplitz_grad_weight(g, x, geom, torch.float32, False)),
                         ("fma", lambda: large_fma.large_fma_grad_weight(g, x, geom, torch.float32, False)),
                         (f"fma {whole_rows}", lambda: large_fma.large_fma_grad_weight(g, x, geom, torch.float32,
                                                                                       False, whole_rows))):
            weight_grads.append(fn()[0])
            print(f"fma gw  float32 {str(shape):18s} k{k} {name:28s}: {events_ms(fn, 5):.3f} ms", flush=True)
        # rows a program sums (default: grad_weight_rows, ~4096 programs: 56 rows on k31 / k51):
        # more programs hide more latency, each adds a reduction of KW sums a kernel row
        for rows in (16, 32, 112):
            ms = events_ms(lambda: large_fma.large_fma_grad_weight(g, x, geom, torch.float32, False,
                                                                   rows_per_split=rows), 5)
            print(f"fma gw  float32 {str(shape):18s} k{k} {f'fma, {rows} rows a program':28s}: {ms:.3f} ms", flush=True)
        print(f"fma grad_weight fma / toeplitz: relative difference "
              f"{rel_err(weight_grads[1], weight_grads[0].double()):.1e}, whole rows "
              f"{rel_err(weight_grads[2], weight_grads[0].double()):.1e}", flush=True)
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        grad_inputs = []
        min_taps = large_fma.LARGE_FMA_MIN_TAPS
        for switch in (False, True):
            large_fma.LARGE_FMA_MIN_TAPS = min_taps if switch else 10**9
            ms = events_ms(lambda: torch.autograd.grad(dwconv.depthwise_conv2d(xl, wl, None, 1, pad), (xl, wl), g), 5)
            grad_inputs.append(torch.autograd.grad(dwconv.depthwise_conv2d(xl, wl, None, 1, pad), xl, g)[0])
            print(f"fma f+b float32 {str(shape):18s} k{k} large_fma {'on ' if switch else 'off'}: {ms:.3f} ms, "
                  f"grad_input alone {events_ms(lambda: conv_grad_input(g, w, geom, x), 10):.3f} ms", flush=True)
        print(f"fma grad_input on / off: relative difference {rel_err(grad_inputs[1], grad_inputs[0].double()):.1e}")
        large_fma.LARGE_FMA_MIN_TAPS = min_taps
    # below the Toeplitz threshold: the CUDA-core kernel against the default's forward and weight gradient
    shape = (32, 128, 56, 56)
    for k in (5, 7, 9):
        x = torch.randn(shape, device="cuda")
        w = torch.randn(shape[1], 1, k, k, device="cuda") / k
        g = torch.randn(shape, device="cuda")
        geom = conv_geometry(x, w, None, 1, k // 2, 1)
        blocks = large_fma.large_fma_blocks(geom)
        fma_config = ForwardConfig("large_fma", *blocks[:3], vec=blocks[3])
        times = dict(default=events_ms(lambda: conv_forward(x, w, None, geom), 10),
                     fma=events_ms(lambda: conv_forward(x, w, None, geom, fma_config), 10),
                     gw_default=events_ms(lambda: conv_grad_weight(g, x, geom, torch.float32, False), 5),
                     gw_fma=events_ms(lambda: large_fma.large_fma_grad_weight(g, x, geom, torch.float32, False), 5))
        print(f"fma crossover float32 {shape} k{k}: " + ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()),
              flush=True)


def with_weight_vectors(fn, *args, on=True):
    """fn(*args) with the forward's weights as 4-vectors (session 14) or, with on=False, as scalars
    (large_fma.WEIGHT_VECTORS_MIN_TAPS beyond or at any kernel)."""
    from dwconv.ops import large_fma

    taps, large_fma.WEIGHT_VECTORS_MIN_TAPS = large_fma.WEIGHT_VECTORS_MIN_TAPS, 0 if on else 10**9
    try:
        return fn(*args)
    finally:
        large_fma.WEIGHT_VECTORS_MIN_TAPS = taps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="the k31 layer only")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--crossover", action="store_true")
    p.add_argument("--parts", action="store_true", help="time forward, grad_input and grad_weight alone")
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--no-tile", action="store_true", help="skip timing the CUDA-core tile kernel")
    p.add_argument("--stages", type=int, help="num_stages of the Toeplitz kernels (toeplitz.NUM_STAGES)")
    p.add_argument("--prefetch", choices=["on", "off"],
                   help="the Toeplitz forward loads the next kernel row during a product at every kernel "
                   "size, or at none (default: from toeplitz.PREFETCH_MIN_KERNEL_H)")
    p.add_argument("--graphs", action="store_true", help="dwconv's forward as CUDA-graph replays (50 of them)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--fma", action="store_true", help="only float32's CUDA-core kernel against the Toeplitz products")
    p.add_argument("--fma-blocks", nargs=4, type=int, action="append", default=[],
                   metavar=("BH", "BW", "WARPS", "VEC"), help="with --fma: more large_fma forward blocks to time")
    p.add_argument("--layers", type=int, nargs="+", help="indices into LAYERS (k31, k13, k51)")
    args = p.parse_args()
    layers = LAYERS[:1] if args.quick else [LAYERS[i] for i in args.layers] if args.layers else LAYERS
    if args.fma:
        return fma(layers, [tuple(b) for b in args.fma_blocks])
    if args.stages:
        toeplitz.NUM_STAGES = args.stages
    if args.prefetch:
        toeplitz.PREFETCH_MIN_KERNEL_H = 1 if args.prefetch == "on" else 1 << 30
    global GRAPHS
    GRAPHS = args.graphs
    dtypes = [getattr(torch, name) for name in args.dtype]
    for shape, k, pad in layers:
        for dtype in dtypes:
            forward_rows(shape, k, pad, dtype, old=not args.no_tile)
    if not args.no_backward:
        for shape, k, pad in layers:
            for dtype in dtypes:
                backward_rows(shape, k, pad, dtype)
    if args.parts:
        for shape, k, pad in layers:
            for dtype in dtypes:
                parts(shape, k, pad, dtype)
    if args.sweep:
        sweep()
    if args.crossover:
        crossover(dtypes)


if __name__ == "__main__":
    main()
