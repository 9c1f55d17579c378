"""Every part of Triton dwconv touches that is not its documented API (`triton.jit`, `tl.*`, a
kernel's `[grid](...)` launch), in one place: what to check when a Triton release moves them.
Tested against Triton 3.6 and 3.9."""

from __future__ import annotations

from typing import List, Tuple


def arg_names(kernel) -> List[str]:
    """A @triton.jit kernel's parameter names, in order."""
    return kernel.arg_names


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


def libcuda_dirs() -> List[str]:
    """The directories of CUDA's driver library, as Triton finds them."""
    from triton.backends.nvidia.driver import libcuda_dirs as find

    return find()
