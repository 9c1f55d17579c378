"""`python -m dwconv bench --model NAME`: whole models, stock against dwconv.convert, on the GPU.

For each precision (float32 NCHW; bfloat16 autocast with channels_last) a training step (forward,
cross-entropy, backward, SGD step) and an inference forward (eval, no_grad) are timed with CUDA
events after warm-up, for the stock model and the converted one, each eager and compiled
(torch.compile, default mode). Random weights and inputs: nothing is downloaded. Before timing, the
converted model's eval outputs and parameter gradients are compared with the stock model's.

Models come from torchvision (mobilenet_v2, efficientnet_b0, convnext_tiny, ...) or, failing that,
timm; `convnext_tiny_lk31` is timm's ConvNeXt-T with RepLKNet-31's kernel sizes (31, 29, 27, 13);
`tiny` is a small depthwise network for smoke tests.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Collection, Dict, List, Optional, Set

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import replay, tuning
from .convert import convert


class TinyDepthwiseNet(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, 2, 1), nn.ReLU(),
            nn.Conv2d(width, width, 3, 1, 1, groups=width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 1), nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 7, 1, 3, groups=2 * width), nn.ReLU(),
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


# Large-kernel networks: timm's ConvNeXt-T with RepLKNet-31's depthwise kernel sizes per stage
LARGE_KERNEL_MODELS = {"convnext_tiny_lk31": ("convnext_tiny", dict(kernel_sizes=(31, 29, 27, 13)))}


def build_model(name: str) -> nn.Module:
    if name == "tiny":
        return TinyDepthwiseNet()
    if name in LARGE_KERNEL_MODELS:
        import timm

        base, options = LARGE_KERNEL_MODELS[name]
        return timm.create_model(base, pretrained=False, **options)
    try:
        import torchvision

        if hasattr(torchvision.models, name):
            return getattr(torchvision.models, name)(weights=None)
    except ImportError:
        pass
    try:
        import timm

        return timm.create_model(name, pretrained=False)
    except ImportError as e:
        raise SystemExit(f"--model {name}: neither torchvision nor timm has it ({e})") from e


def training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer, autocast_dtype,
                  device: str = "cuda") -> Callable[[], None]:
    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return step


def inference(model: nn.Module, x: torch.Tensor, autocast_dtype) -> Callable[[], None]:
    def forward():
        with torch.no_grad(), torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            model(x)
    return forward


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured in a CUDA graph (after warm-up on a side stream, as torch.cuda.graph asks):
    its replay, which launches the same kernels with no Python in between. Captured on the same
    side stream: a backward runs on its forward's stream, and autograd graphs built in the warm-up
    (the "backward" pass's) must not tie the capture to another stream.
    The replay holds fn, and so what fn holds: the graph reads and writes memory made outside its
    pool (parameters, gradients, an optimizer's momentum), and were that freed, the next capture's
    empty_cache would hand it back to the driver and this replay fault (an illegal memory access:
    docs/decisions.md, "Whole models")."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # cuBLAS's workspace for the side stream, made in the warm-up outside the graph's memory pool,
    # would be baked into the graph, and PyTorch may free it while the graph lives (pytorch/pytorch
    # #193402). Dropped before the capture, it is made again inside the graph's pool, which the graph
    # holds; dropped after it, eager calls make their own (as torch.compile's CUDA graphs do:
    # cudagraph_trees.clear_cublas_manager).
    torch._C._cuda_clearCublasWorkspaces()
    with torch.cuda.graph(graph, stream=side):
        fn()
    torch._C._cuda_clearCublasWorkspaces()

    def replay() -> None:
        graph.replay()
    replay.captured = fn
    return replay


def _allocator_retries() -> int:
    """The CUDA caching allocator's retries so far (cudaMalloc failed, cached blocks freed), 0 off a GPU."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0


def time_ms(fn: Callable[[], None], warmup: int, iters: int) -> List[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


class without_tf32:
    """TF32 off for cuDNN's convolutions and matmuls inside the block: comparisons of float32 models
    (with it, the stock layers round their inputs to 10 bits, and a last-bit change of a fused
    layer's output moved MobileNetV2's eval output by 1.5e-4 of its largest value)."""

    def __enter__(self):
        self.saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self.saved


def compare_outputs(stock: nn.Module, converted: nn.Module, x: torch.Tensor) -> float:
    """Relative max difference of the eval-mode outputs (float32 without TF32, NCHW)."""
    with torch.no_grad(), without_tf32():
        a, b = stock.eval()(x), converted.eval()(x)
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()


def replays_bitwise(fused: nn.Module, module_by_module: nn.Module, x: torch.Tensor, calls: int = 3) -> bool:
    """Whether the fused model's eval forwards (its blocks replayed from the second call on, bfloat16
    autocast, channels_last) equal those of its copy run module by module, bit for bit."""
    x = x.contiguous(memory_format=torch.channels_last)
    models = [m.eval().to(memory_format=torch.channels_last) for m in (fused, module_by_module)]
    with torch.no_grad(), torch.autocast(x.device.type, dtype=torch.bfloat16):
        return all(torch.equal(models[0](x), models[1](x)) for _ in range(calls))


PRECISIONS = {"float32": (None, torch.contiguous_format), "bf16": (torch.bfloat16, torch.channels_last)}


def depthwise_layers(model: nn.Module) -> List[nn.Module]:
    """The model's depthwise layers: stock nn.Conv2d of groups == in_channels > 1, or dwconv's."""
    return [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups == m.in_channels > 1]


def hook_layers(layers: List[nn.Module], enter: Callable, leave: Callable) -> list:
    """enter(layer, pass) as each layer's forward or backward begins, leave(layer, pass) as it ends
    (pass "forward" or "backward"; the backward from the gradient reaching the layer's output to
    its input's: full backward hooks). Returns the hooks' handles, to remove."""
    def at(call, pass_):
        return lambda module, *_: call(module, pass_)
    return [h for m in layers for h in (m.register_forward_pre_hook(at(enter, "forward")),
                                        m.register_forward_hook(at(leave, "forward")),
                                        m.register_full_backward_pre_hook(at(enter, "backward")),
                                        m.register_full_backward_hook(at(leave, "backward")))]


def depthwise_share(model: nn.Module, fn: Callable[[], None], steps: int = 3,
                    events: Optional[list] = None, hooks: bool = True) -> Dict[str, float]:
    """Per call of fn, from torch's profiler: the GPU time of every kernel (ms) and of the kernels
    launched by the model's depthwise layers, forward and backward (stock nn.Conv2d of groups ==
    in_channels > 1, or dwconv's): each layer's forward and backward is a "depthwise" profiler range
    (module hooks: forward pre/post, full backward pre/post), and dwconv's kernels count by their
    names (launched outside any operator, they are linked to no range); `ranges` counts the ranges,
    on the CPU too. events: a list that receives the profiler's events. hooks=False: no ranges, dwconv's
    kernels by their names alone (a fused model: a hook on a block's module makes it compute unfused)."""
    ranges: Dict[tuple, object] = {}

    def open_range(module, pass_):
        ranges[(module, pass_)] = torch.profiler.record_function("depthwise")
        ranges[(module, pass_)].__enter__()

    def close_range(module, pass_):
        record = ranges.pop((module, pass_), None)
        if record is not None:
            record.__exit__(None, None, None)

    handles = hook_layers(depthwise_layers(model), open_range, close_range) if hooks else []
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        fn()  # (outside the profile: compiles, allocations)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    if events is not None:
        events += prof.events()
    return dict(depthwise_ms=_kernel_us(prof.events(), within="depthwise", named=dwconv_kernel_names()) / 1e3 / steps,
                gpu_ms=_kernel_us(prof.events()) / 1e3 / steps,
                ranges=sum(e.name == "depthwise" for e in prof.events() if e.device_type.name == "CPU") / steps)


def dwconv_kernel_names() -> Set[str]:
    """The names of dwconv's Triton kernels (and their jit helpers, which never launch)."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface

    from . import kernels

    modules = [importlib.import_module(f"{kernels.__name__}.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
    return {value.__name__ for module in modules for value in vars(module).values()
            if isinstance(value, KernelInterface) and hasattr(value, "__name__")}


def launched_kernels(events, within: str = "", named: Collection[str] = ()):
    """The GPU kernels (name, duration in us) of the profiled events: every device event but the
    GPU spans of record_function ranges (which key_averages adds to the kernels' time:
    pytorch/pytorch#130730, a step's "GPU time" came out above its wall time). within: only those
    launched under a CPU range of that name, or named in `named`. A kernel is under the range when
    the host call that launched it (the runtime or driver call, cudaLaunchKernel, cuLaunchKernelEx,
    ..., of the kernel's own correlation id) sits under it or ran while it was open, or when the
    operator it is linked to (torch >= 2.13 keeps the link) sits under it; one launched with neither
    is known by its name alone."""
    # (torch 2.11 keeps no linked_correlation_id on its events: on the H200 every kernel read 0 there,
    # and only the launches' ids led to the operators. Ids count in two sequences that overlap, the
    # operators' and the runtime calls': an id may name an operator and a launch, hence the launches
    # known by their names, "cu...", and the operators by their lack of a link)
    def linked(event):
        return getattr(event, "linked_correlation_id", 0) or 0

    cpu = [e for e in events if e.device_type.name == "CPU"]
    operators: Dict[int, list] = {}
    for event in cpu:
        if not linked(event) and not event.name.startswith("cu"):
            operators.setdefault(event.id, []).append(event)
    launches = {e.id: e for e in cpu if e.name.startswith("cu")}
    ranges = {e.name for e in cpu if getattr(e, "is_user_annotation", False)}
    # (a launch the profiler tied to no operator has no parent: then by time, not thread, as in a
    # training step one thread at a time launches: the caller waits in backward())
    open_spans = sorted((e.time_range.start, e.time_range.end) for e in cpu if e.name == within)

    def under(event):
        while event is not None:
            if event.name == within:
                return True
            event = event.cpu_parent
        return False

    def launched_under(kernel):
        launch = launches.get(kernel.id)
        if launch is not None and (under(launch) or any(start <= launch.time_range.start <= end
                                                        for start, end in open_spans)):
            return True
        return any(under(operator) for operator in operators.get(linked(kernel), ()))

    kernels = []
    for event in events:
        if event.device_type.name == "CPU" or getattr(event, "is_user_annotation", False) or event.name in ranges:
            continue
        if within and not (launched_under(event) or event.name in named):
            continue
        kernels.append((event.name, event.time_range.elapsed_us()))
    return kernels


def _kernel_us(events, within: str = "", named: Collection[str] = ()) -> float:
    return sum(duration for _, duration in launched_kernels(events, within, named))


def compare_gradients(stock: nn.Module, converted: nn.Module, x: torch.Tensor) -> float:
    """Largest relative difference, over the parameters, of the gradients of the eval-mode outputs'
    sum (float32 without TF32, NCHW): max |stock - converted| / max |stock| per parameter tensor."""
    worst = 0.0
    for model in (stock, converted):
        model.eval().zero_grad(set_to_none=True)
        with without_tf32():
            model(x).float().sum().backward()
    for (name, a), b in zip(stock.named_parameters(), converted.parameters()):
        if a.grad is None or b.grad is None:
            if (a.grad is None) != (b.grad is None):
                raise AssertionError(f"{name}: a gradient on one model only")
            continue
        scale = a.grad.abs().max().clamp_min(1e-12)
        worst = max(worst, ((a.grad - b.grad).abs().max() / scale).item())
    for model in (stock, converted):
        model.zero_grad(set_to_none=True)
    return worst


def rows_layout(memory_format) -> str:
    return "channels_last" if memory_format == torch.channels_last else "nchw"


COMPILE_MODES = {"no": [], "default": ["default"], "reduce-overhead": ["reduce-overhead"],
                 "all": ["default", "max-autotune-no-cudagraphs", "reduce-overhead"]}
CUDA_GRAPH = "CUDA graph"  # (a path's "mode": the eager step captured whole in a CUDA graph and replayed)


def model_paths(compile_modes: List[str], eager: bool = True, fuse: bool = False, unfused: bool = True) -> List[tuple]:
    """(path label, model, mode, DWCONV_NATIVE for the timing or None): stock and converted eager,
    the converted model's eager calls also through the Python path (the C++ replayer off: whether
    it wins on whole models), both eager steps captured in a CUDA graph (GPU time alone: the host
    issues nothing), and each torch.compile mode for both. Without eager: the compiled paths alone
    (a device call's time for torch.compile's compiles). fuse: the model converted with fuse=True too
    (its BatchNorms folded and activations fused in eval mode: its inference rows), in eager, in a
    CUDA graph and compiled; unfused=False: stock's and the fused model's paths alone (a device call's
    time for the fused rows)."""
    paths = [("stock eager", "stock", None, None), ("dwconv eager", "dwconv", None, None),
             ("dwconv eager, Python path", "dwconv", None, "0"),
             (f"stock eager, {CUDA_GRAPH}", "stock", CUDA_GRAPH, None),
             (f"dwconv eager, {CUDA_GRAPH}", "dwconv", CUDA_GRAPH, None)] if eager else []
    if eager and fuse:
        paths += [("dwconv fused eager", "fused", None, None), (f"dwconv fused eager, {MODULE_BY_MODULE}",
                                                                "fused module by module", None, None),
                  (f"dwconv fused eager, {CUDA_GRAPH}", "fused", CUDA_GRAPH, None)]
    for mode in compile_modes:
        label = "compiled" if mode == "default" else f"compiled {mode}"
        paths += [(f"stock {label}", "stock", mode, None), (f"dwconv {label}", "dwconv", mode, None)]
        paths += [(f"dwconv fused {label}", "fused", mode, None)] if fuse else []
    return [path for path in paths if unfused or not fuse or path[1] != "dwconv"]


def stock_path(path: str) -> str:
    """The stock path a path is compared with: the same compilation."""
    return (path.replace("dwconv fused", "stock").replace("dwconv", "stock").replace(", Python path", "")
            .replace(f", {MODULE_BY_MODULE}", ""))


# the fused model's eager path without its blocks' replayed programs (dwconv.block_replay): what they save
MODULE_BY_MODULE = "blocks module by module"


def module_by_module(fused: nn.Module) -> nn.Module:
    """A copy of a fused model whose inverted-residual blocks run their modules' calls (never one replayed program)."""
    copied = copy.deepcopy(fused)
    for module in copied.modules():
        if "dwconv_programs" in module.__dict__:
            module.__dict__["dwconv_programs"] = None
    return copied


class native_setting:
    """DWCONV_NATIVE set to `value` inside the block (None: as it is)."""

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        self.saved = os.environ.get("DWCONV_NATIVE")
        if self.value is not None:
            os.environ["DWCONV_NATIVE"] = self.value

    def __exit__(self, *exc):
        if self.value is not None:
            os.environ.pop("DWCONV_NATIVE") if self.saved is None else os.environ.update(DWCONV_NATIVE=self.saved)


def bench_model(name: str, batch: int, image: int, warmup: int, iters: int, compile_modes: str = "default",
                precisions: str = "all", rounds: int = 10, eager: bool = True, fuse: bool = False,
                unfused: bool = True) -> List[Dict]:
    """Steady state of every path (model_paths) for each precision, training step and inference.
    The paths are timed in turn, `rounds` times over (iters / rounds steps a path each round, after
    one untimed and one timed apart: time_ms synchronises after its warm-up, so that step starts
    from an idle GPU, as in a loop that waits on the GPU every step (reading its loss, say), where a
    loop that never waits overlaps each step's host time with the last step's kernels; those steps
    are rows of their own, "STEP, from an idle GPU"), and each path's median taken over all its steps: the GPU
    machine's host speed drifts between and within runs (a stock MobileNetV2 step measured 13.8-30.8 ms in different
    processes), and a path timed only after another would take the drift for its own. Each round's
    ratio to stock is printed too (its range: how far the drift moves a ratio). The CUDA-graph
    paths (the GPU's time alone: no drift) come last, one graph alive at a time: each is captured,
    timed over as many steps and released (with its memory pool) before the next capture."""
    torch.backends.cudnn.benchmark = True  # (as conv nets are trained: cuDNN's fastest algorithm for the stock layers)
    replay.prepare()  # (the steady state: the C++ replayer built, as a run has it within its first minute)
    torch.manual_seed(0)
    stock = build_model(name).cuda()
    converted = convert(stock, verbose=False)
    models = {"stock": stock, "dwconv": converted}
    if fuse:
        models["fused"] = convert(stock, verbose=True, fuse=True)
        models["fused module by module"] = module_by_module(models["fused"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, 3, image, image, device="cuda", generator=gen)
    y = torch.randint(0, 10, (batch,), device="cuda", generator=gen)
    rel = compare_outputs(stock, converted, x[:8])
    if fuse:
        print(f"{name}: fused model's eval outputs differ from stock's by "
              f"{compare_outputs(stock, models['fused'], x[:8]):.2e} (relative, float32 without TF32); its "
              f"blocks replayed equal them run module by module bit for bit (bfloat16): "
              f"{replays_bitwise(models['fused'], models['fused module by module'], x[:8])}", flush=True)
    grad_rel = compare_gradients(stock, converted, x[:8])
    print(f"{name}: {converted.dwconv_converted} depthwise layers converted; eval outputs differ by {rel:.2e}, "
          f"parameter gradients by {grad_rel:.2e} (relative, float32 without TF32)"
          + (f"; tuning changes {tuning.changes()}" if tuning.changes() else ""), flush=True)
    rows, profiles = [], []
    # the eager paths, profiled once every path of every precision is timed: after the profiler has
    # run, CUPTI stays attached to the process and every launch costs more host time
    # (pytorch/pytorch#144455), so a host-bound path timed after a profile read slower than it runs
    profiled = []
    for key in (PRECISIONS if precisions == "all" else [precisions]):
        dtype, memory_format = PRECISIONS[key]
        precision = "bf16 autocast CL" if dtype is not None else key
        inputs = x.contiguous(memory_format=memory_format)
        timed = []  # (path, step, native setting, fn, model run): built and warmed first, then timed in turns
        captured = []  # the same for the CUDA-graph paths: captured and timed after the others, one at a time
        for path, variant, mode, native in model_paths(COMPILE_MODES[compile_modes], eager, fuse, unfused):
            model = copy.deepcopy(models[variant]).to(memory_format=memory_format)
            run = torch.compile(model, mode=mode) if mode and mode != CUDA_GRAPH else model
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
            try:  # (a path that fails is reported and skipped: the other rows still come)
                with native_setting(native):
                    for step, fn in (("train step", training_step(run, inputs, y, optimizer, dtype)),
                                     ("inference", inference(run, inputs, dtype))):
                        run.train(step == "train step")  # (BatchNorm on the batch's statistics when training)
                        time_ms(fn, warmup, 1)
                        if mode == CUDA_GRAPH:
                            captured.append((path, step, native, fn, run))
                            continue
                        if not mode:  # (profiled after all timing: below)
                            profiled.append((precision, memory_format, path, step, native, fn, model, variant))
                        timed.append((path, step, native, fn, run))
            except Exception as error:
                print(f"  {precision:<17} {path}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
        # (each step from an idle GPU under a mode of its own: one sample a round)
        modes = [(path, mode) for path, step, *_ in timed for mode in (step, f"{step}, from an idle GPU")]
        samples = {key: [] for key in modes}
        round_ms = {key: [] for key in modes}  # (each round's median)
        # (the caching allocator's retries during a path's samples: a retry frees cached blocks and
        # waits for the GPU, a candidate for a round far slower than the others)
        retries = {(path, step): 0 for path, step, *_ in timed}
        for _ in range(rounds):
            for path, step, native, fn, run in timed:
                run.train(step == "train step")
                before = _allocator_retries()
                with native_setting(native):
                    idle_ms, *ms = time_ms(fn, 1, max(1, iters // rounds) + 1)
                retries[(path, step)] += _allocator_retries() - before
                for mode, mode_ms in ((step, ms), (f"{step}, from an idle GPU", [idle_ms])):
                    samples[(path, mode)] += mode_ms
                    round_ms[(path, mode)].append(statistics.median(mode_ms))
        for path, step, native, fn, run in captured:
            run.train(step == "train step")
            try:
                with native_setting(native):
                    graph_replay = graphed(fn)
                    samples[(path, step)] = time_ms(graph_replay, 2, rounds * max(1, iters // rounds))
                del graph_replay  # (the graph and its memory pool released before the next capture)
            except Exception as error:
                print(f"  {precision:<17} {path} {step}: failed: {type(error).__name__}: {str(error)[:300]}",
                      flush=True)
        for (path, step), ms in samples.items():
            rows.append(dict(model=name, precision=precision, mode=step, path=path, stock_path=stock_path(path),
                             ms=statistics.median(ms), std=statistics.pstdev(ms),
                             # (the results CSVs' schema: bench.CSV_FIELDS)
                             suite="model", layer=name, dtype=precision, **{"pass": step},
                             layout=rows_layout(memory_format)))
            base = round_ms.get((stock_path(path), step))
            ratios = ([a / b for a, b in zip(base, round_ms[(path, step)])]
                      if base and path != stock_path(path) else [])
            print(f"  {precision:<17} {step:<28} {path:<26} {rows[-1]['ms']:8.3f} ms "
                  f"(spread {min(ms):.3f}-{max(ms):.3f})"
                  + (f"; vs stock by round {min(ratios):.2f}-{max(ratios):.2f}x, "
                     f"{sum(r >= 1 for r in ratios)} of {len(ratios)} rounds >= 1" if ratios else "")
                  + (f"; {retries[(path, step)]} allocator retries" if retries.get((path, step)) else ""), flush=True)
        del timed, captured, samples
        torch.cuda.empty_cache()
    for precision, memory_format, path, step, native, fn, model, variant in profiled:  # (the same steps' GPU time)
        model.train(step == "train step")
        with native_setting(native):
            share = depthwise_share(model, fn, hooks=not variant.startswith("fused"))
        # (no kernel found under the layers' ranges is no measurement, not 0 ms: stock cuDNN layers
        # read 0 on the H200 while kernels were found by their operators' links alone,
        # test_depthwise_share_of_stock_layers)
        attributed = share["depthwise_ms"] > 0 or not share["ranges"]
        # (a fused model's kernels of dwconv are its blocks' BatchNorms' too: not stock's
        # depthwise layers' share, so its whole step's GPU time alone)
        for what in ("depthwise_ms", "gpu_ms")[0 if attributed and not variant.startswith("fused") else 1:]:
            profiles.append(dict(suite="model profile", layer=name, dtype=precision, path=path,
                                 layout=rows_layout(memory_format), ms=share[what],
                                 **{"pass": f"{step} {what[:-3]} GPU"}))
        depthwise = f"{share['depthwise_ms']:.3f}" if attributed else "not attributed"
        print(f"  {precision:<17} {step:<10} {path:<26} profiler: "
              + ("blocks (dwconv's kernels) " if variant.startswith("fused") else "depthwise ")
              + f"{depthwise} of {share['gpu_ms']:.3f} ms GPU", flush=True)
    for row in rows:  # speedup against the stock model of the same precision, step and compilation
        base_path = row.pop("stock_path")
        base = next((r for r in rows if (r["precision"], r["mode"], r["path"]) == (row["precision"], row["mode"],
                                                                                 base_path)), None)
        row["vs_stock"] = row["dwconv_speedup"] = base["ms"] / row["ms"] if base else float("nan")
    for row in profiles:  # the profiled GPU times, stock's over this one's (depthwise: the 1.5x)
        base = next((r for r in profiles if (r["dtype"], r["pass"], r["path"]) == (row["dtype"], row["pass"],
                                                                                  "stock eager")), None)
        row["dwconv_speedup"] = base["ms"] / row["ms"] if base and row["ms"] else float("nan")
    return rows + profiles


# cold start: (variant, what the subprocess does, its Triton cache: "own" an empty one of its own, or one
# that runs share in turn, empty for the first)
COLD_START_RUNS = [
    ("stock", "stock", "own"),
    ("dwconv", "dwconv", "shared"),  # convert's warmup at the first call, then the step
    ("dwconv warm", "dwconv", "shared"),  # a second process: the kernels on disk
]
WITHOUT_WARMUP = ("dwconv no warmup", "dwconv no warmup", "own")  # each layer compiles at its first call
FUSED_RUNS = [  # the model converted with fuse=True (BatchNorm's kernels too), from an empty cache, then warm
    ("dwconv fused", "fused", "own"),
    ("dwconv fused warm", "fused", "dwconv fused"),
]
FROM_IMAGE = [  # a container image's build compiles the kernels with no GPU in sight; a fresh node runs from them
    ("dwconv image build", "image build", "image"),
    ("dwconv from image", "dwconv", "image"),
]


def first_step(name: str, batch: int, image: int, precision: str, variant: str, arch: int = 90) -> Dict[str, float]:
    """In a fresh process: seconds to build the model and for its first and second training steps
    (cuDNN's benchmark mode on, as for a real run), and what the first step's warmup did. Without a
    GPU (the tests' smoke run, under TRITON_INTERPRET=1) on the CPU, warmup compiling for sm_90.
    variant "image build": on the CPU, as an image's build would (the caller hides the GPU), the
    model's warmup for arch under the autocast of its precision, and no step."""
    from . import precompile

    started = time.perf_counter()
    torch.backends.cudnn.benchmark = True
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, memory_format = PRECISIONS[precision]
    torch.manual_seed(0)
    model = build_model(name).to(device, memory_format=memory_format)
    x = torch.randn(batch, 3, image, image, device=device).contiguous(memory_format=memory_format)
    y = torch.randint(0, 10, (batch,), device=device)
    if variant != "stock":
        model = convert(model, inplace=True, verbose=False, precompile=variant != "dwconv no warmup",
                        fuse=variant == "fused")
    if variant in ("dwconv", "fused", "image build") and device == "cpu":  # (the first-call warmup acts on CUDA inputs only)
        precompile.warmup(model.train(), x, arch=arch, autocast=dtype, verbose=False)
    built_s = time.perf_counter() - started
    if variant == "image build":
        report = precompile.last_report
        return dict(build_s=built_s, warmup_s=report.seconds, launches=report.launches, workers=report.workers,
                    errors=len(report.errors))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    step = training_step(model.train(), x, y, optimizer, dtype, device)
    times = []
    for _ in range(2):
        began = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    report = precompile.last_report
    warmed = {} if report is None else dict(
        warmup_s=report.seconds, trace_s=report.trace_seconds, first_answer_s=report.first_answer_seconds,
        longest_launch_s=report.longest_launch, launches=report.launches, workers=report.workers,
        passes_warm=report.passes_warm, errors=len(report.errors))
    return dict(build_s=built_s, first_step_s=times[0], second_step_s=times[1],
                to_first_step_end_s=time.perf_counter() - started - times[1], **warmed)


def cold_start(name: str, batch: int, image: int, precisions: str = "all", timeout: float = 900,
               without_warmup: bool = False, from_image: bool = False, fuse: bool = False) -> List[Dict]:
    """First training steps in fresh processes (COLD_START_RUNS, and WITHOUT_WARMUP first and
    FUSED_RUNS and FROM_IMAGE last if asked), each with an empty temporary Triton cache, the one the
    converted model's run filled, or the one an image build filled (that process sees no GPU); the
    process's wall time includes its imports."""
    rows = []
    runs = (([WITHOUT_WARMUP] if without_warmup else []) + COLD_START_RUNS + (FUSED_RUNS if fuse else [])
            + (FROM_IMAGE if from_image else []))
    major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    for precision in (PRECISIONS if precisions == "all" else [precisions]):
        with tempfile.TemporaryDirectory() as root:
            for label, variant, cache in runs:
                env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(root, label if cache == "own" else cache))
                if variant == "image build":
                    env["CUDA_VISIBLE_DEVICES"] = ""
                began = time.perf_counter()
                try:
                    done = subprocess.run([sys.executable, "-m", "dwconv.bench_models", name, str(batch), str(image),
                                           precision, variant, str(10 * major + minor)], env=env,
                                          capture_output=True, text=True, timeout=timeout)
                    result = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
                    error = "" if done.returncode == 0 else done.stderr[-400:]
                except subprocess.TimeoutExpired:
                    result, error = {}, f"over {timeout:.0f} s"
                process_s = time.perf_counter() - began
                measured = dict(result, process_s=process_s)
                for key, what in (("warmup_s", "warmup"), ("first_step_s", "first train step"),
                                  ("second_step_s", "second train step"), ("process_s", "process")):
                    if key in measured:
                        rows.append(dict(suite="model cold start", layer=name, dtype=precision, path=label,
                                         layout="channels_last" if precision == "bf16" else "nchw",
                                         ms=1000 * measured[key], **{"pass": what}))
                print(f"  {name} {precision:<8} {label:<18} " + (error.strip().splitlines()[-1] + "  " if error else
                      "".join(f"{k} {v:.1f}  " if isinstance(v, float) else f"{k} {v}  " for k, v in result.items()))
                      + f"process {process_s:.1f} s",
                      flush=True)
    return rows


def print_model_table(rows: List[Dict]) -> None:
    print(f"\n{'model':<16} {'precision':<17} {'mode':<28} {'path':<44} {'ms':>9} {'std':>7} {'vs stock':>8}")
    print("-" * 134)
    for r in (r for r in rows if "model" in r):  # (the profile rows are printed as they are measured)
        print(f"{r['model']:<16} {r['precision']:<17} {r['mode']:<28} {r['path']:<44} {r['ms']:9.3f} "
              f"{r['std']:7.3f} {r['vs_stock']:7.2f}x")


if __name__ == "__main__":  # (cold_start's subprocess: NAME BATCH IMAGE PRECISION VARIANT ARCH)
    name, batch, image, precision, variant, arch = sys.argv[1:7]
    print(json.dumps(first_step(name, int(batch), int(image), precision, variant, int(arch))))
