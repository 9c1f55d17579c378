"""Every part of Triton dwconv touches that is not its documented API (`triton.jit`, `tl.*`, a
kernel's `[grid](...)` launch), in one place: what to check when a Triton release moves them.
Tested against Triton 3.6 and 3.9."""

from __future__ import annotations

import functools
import time
from typing import Callable, List, Optional, Tuple


def arg_names(kernel) -> List[str]:
    """A @triton.jit kernel's parameter names, in order."""
    return kernel.arg_names


@functools.lru_cache(maxsize=None)
def float64_parameters(kernel) -> frozenset:
    """The names of a @triton.jit kernel's parameters annotated tl.float64 (compiled or under the
    interpreter), as Triton's launcher reads the annotations."""
    import inspect

    from triton.runtime.jit import _normalize_ty

    parameters = inspect.signature(kernel.fn).parameters.values()
    return frozenset(p.name for p in parameters
                     if p.annotation is not inspect.Parameter.empty and _normalize_ty(p.annotation) == "fp64")


def launch_compiled(compiled, grid: Tuple[int, int, int], *args) -> None:
    """Launches a CompiledKernel (what a JITFunction launch returns) directly, skipping the
    JITFunction's per-call specialisation and cache lookup; args: the non-constexpr arguments."""
    compiled[grid](*args)


def launch_parameters(compiled):
    """What a launch of a CompiledKernel needs outside Triton: (CUfunction handle, threads, shared
    memory bytes, [(parameter name, type)] of the signature, the PTX text), or None where it needs
    global scratch memory or clusters (which such a launch cannot give it)."""
    compiled._init_handles()
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "num_ctas", 1) != 1:
        return None
    return compiled.function, 32 * meta.num_warps, meta.shared, list(compiled.src.signature.items()), \
        compiled.asm["ptx"]


def cache_dir() -> str:
    """Triton's disk cache directory (TRITON_CACHE_DIR, default ~/.triton/cache)."""
    from triton import knobs

    return knobs.cache.dir


def libcuda_dirs() -> List[str]:
    """The directories of CUDA's driver library, as Triton finds them."""
    from triton.backends.nvidia.driver import libcuda_dirs as find

    return find()


def intercept_launches(arch: int, on_launch: Callable) -> None:
    """Makes this process target an NVIDIA GPU of compute capability `arch` (90 for sm_90) whether
    or not it has one, and launch nothing: every `kernel[grid](*args, **kwargs)` calls
    on_launch(kernel, grid, args, kwargs) instead. Irreversible: for compile workers and checks,
    never for a process that runs kernels. TRITON_INTERPRET must be unset before dwconv's kernels
    are imported."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnlyDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(CompileOnlyDriver())
    JITFunction.__getitem__ = lambda self, grid: lambda *args, **kwargs: on_launch(self, grid, args, kwargs)


def compile_only(arch: int, on_compile: Optional[Callable] = None, select: Optional[Callable] = None) -> None:
    """intercept_launches(arch) with every launch compiled into Triton's caches (memory and disk)
    instead. on_compile(kernel name, CompiledKernel, seconds) sees each compile (or cache hit);
    select(kernel, args, kwargs), where given, is asked first at each launch, which is skipped when
    it answers False."""
    def compile_launch(kernel, grid, args, kwargs):
        if select is not None and not select(kernel, args, kwargs):
            return
        started = time.perf_counter()
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        if on_compile is not None:
            on_compile(kernel.__name__, compiled, time.perf_counter() - started)

    intercept_launches(arch, compile_launch)


def binary_key(kernel, args, kwargs) -> str:
    """A short digest of what selects a launch's compiled binary: the kernel, its specialisation
    and its compile options (num_warps, num_stages, maxnreg): two launches of one key compile once."""
    import hashlib

    names = {p.name for p in kernel.params}
    options = sorted((name, repr(value)) for name, value in kwargs.items() if name not in names)
    text = repr((kernel.__module__, kernel.__name__, specialisation(kernel, args, kwargs), options))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def specialisation(kernel, args, kwargs) -> tuple:
    """((parameter name, Triton's specialisation of its value), ...) for a launch of `kernel` with
    these arguments: what its compiled binary is keyed on (constexpr values, integers' divisibility
    by 16 or equality to 1, pointers' alignment), by Triton's own binder (Triton 3.6 and 3.9)."""
    _, specialised, _ = kernel.create_binder()[4](*args, **kwargs)
    return tuple(zip((p.name for p in kernel.params), map(str, specialised)))


def build_launcher(compiled) -> bool:
    """Builds, into Triton's disk cache, the C launcher a first launch of this CompiledKernel would
    build: Triton 3.6 compiles one per kernel signature with the C compiler (about a second each),
    found by the hash of its source, so a process that launches the kernel later finds it. Later
    Triton versions launch every kernel through one launcher: nothing to build (True). False where
    it cannot be built here (no libcuda: a machine without a GPU driver)."""
    from triton.backends.nvidia import driver as nvidia

    if not hasattr(nvidia, "make_launcher"):
        return True
    try:
        nvidia.library_dirs()  # (finds libcuda, which the launcher links)
    except Exception:
        return False
    nvidia.CudaLauncher(compiled.src, compiled.metadata)
    return True


def build_driver_utils() -> bool:
    """Builds Triton's CUDA utilities module into its disk cache (a C compile at a process's first
    launch, once per cache), where libcuda is found; False where it cannot be built here."""
    from triton.backends.nvidia import driver as nvidia

    try:
        nvidia.CudaUtils()
        return True
    except Exception:
        return False
