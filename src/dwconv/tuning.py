"""Every threshold and switch that steers dwconv's kernel choice and blocks, in one table.

The values are the measured winners on the H200 (docs/decisions.md gives each one's measurement).
Code reads them through `tuned()`; tests and tools change them only through `override`, which also
drops every cached launch plan and recorded layer, so that nothing built under one table is reused
under another.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from ._env import switch


@dataclass(frozen=True)
class Tuning:
    # ---- which kernel family (dispatch.py)
    large_fma_min_taps: int = 9  # large_fma from 3x3 on narrow planes
    large_fma_wide_min_taps: int = 25  # and from 5x5 on any width (unit column steps)
    large_fma_small_kernel_max_width: int = 28  # "narrow": 3x3 beats the tile kernels on rows up to 28
    large_fma_half_forward_max_width: int = 56  # half-precision forward: up to 56 wide
    large_fma_half_max_taps: int = 150  # half precision past this: Toeplitz's tensor cores win
    large_fma_max_stride_w: int = 2  # column strides past 2 waste the window's loads
    toeplitz_min_taps: int = 100  # Toeplitz products where large_fma does not apply (10x10 up)
    pixel_kernel_taps: int = 49  # channels_last unrolled pixels up to 7x7 (larger: band kernel, slow compiles)
    fused_nhwc_taps: int = 9  # channels_last fused backward up to 3x3 (7x7 spills)
    nhwc_rows_widths: Tuple[int, int] = (48, 64)  # channels_last fused backward slides rows on these widths
    # ---- blocks
    max_band_taps: int = 256  # tile kernel: rows x taps unrolled per program on the GPU
    interpreter_band_taps: int = 4096  # the same under the interpreter (cost per operation, not size)
    max_pixel_taps: int = 2048  # outputs x taps an unrolled-pixels program holds
    # channels_last 3x3 pixel tiles on inputs up to short_pixel_tile_max_bytes: 2 output rows a program, not 4
    # (MobileNetV2 and EfficientNet-B0 3x3 layers' forward+backward 20% faster in all, their compiles 2.6-4x
    # shorter; 5x5 and 7x7 tiles 4-24% slower with 2, KernelBench 84 in bfloat16 channels_last 14% slower)
    short_pixel_tile_rows: int = 2
    short_pixel_tile_max_bytes: int = 256 << 20
    per_branch_weight_taps: int = 9  # up to 3x3 each tile branch loads its own weights
    # the unmasked interior branch of the forward tiles and of the channels_last backward's pixel tiles up to
    # 3x3; past it the masked branch alone, and 2 rows for the 7-column forward tiles (7x7: ConvNeXt-T's
    # layers 0-13% faster without the branch, 5-17% slower with 2 rows on the 14- and 7-wide ones, their
    # compiles 19-32 -> 7-10 s; 5x5: EfficientNet-B0's layers 0.4% faster to 7.5% slower, 0.034 ms a
    # training step, its first training step on a fresh machine 49.8 -> 25.3 s)
    interior_branch_max_taps: int = 9
    whole_tile_rows: int = 2
    nhwc_taps_major_min_bytes: int = 64 << 20  # channels_last inputs this large read a taps-major weight copy
    nchw_pixels_run_tiles: int = 16  # row tiles a fused NCHW backward program walks
    min_pixel_grad_programs: int = 768  # channels_last backward: at least this many programs
    partial_share: int = 12  # ... and partial sums at most 1/12 of grad_out + input
    small_fused_bytes: int = 64 << 20  # fused channels_last backward: 32-channel blocks under this size
    nhwc_fused_half_maxnreg: int = 128  # register cap of that pass in half precision (dilation 1)
    nhwc_rows_programs: int = 2048  # programs the row-sliding channels_last backward aims at
    shared_load_taps: int = 49  # grad_input phase kernel: one grad_out tile load for all phases up to 7x7
    phase_wide_nchw_w: int = 112  # NCHW strided grad_input: 8 values a thread from this width
    weight_vectors_min_taps: int = 100  # large_fma reads weight rows as padded 4-vectors from 10x10
    large_fma_whole_row_min_taps: int = 100  # large_fma float32 forward: whole rows of up to 56 outputs ...
    large_fma_whole_row_max_kernel_w: int = 31  # ... for kernels up to 31 wide
    large_fma_whole_row_max_vec: int = 56
    toeplitz_num_stages: int = 1  # > 1 pipelines through cp.async, which bypasses L1
    toeplitz_prefetch_min_kernel_h: int = 51  # next kernel row's loads issued early from k51
    toeplitz_out_rows: int = 4  # half-precision forward tile: output rows a program's products cover
    toeplitz_grad_weight_kh_rows: int = 4  # kernel rows a weight-gradient pass takes
    toeplitz_grad_weight_programs: int = 512  # weight-gradient programs to aim for
    weight_sums_max_parts: int = 2048  # partial sums a channel may have for the Triton summing pass
    # BatchNorm's passes (kernels/batch_norm.py): programs along the tensor, elements a tile; channels_last
    # tiles as wide in channels as the one of these widths that takes the fewest lanes, masked ones included,
    # narrow for the passes that sum over the tensor, wide for the others (H100, 256x144x56x56 bfloat16:
    # normalising 410 -> 226 us and grad_y 651 -> 347 us from 16- to 256-channel tiles, the sums 211 -> 303
    # and 328 -> 354 us); the reductions' rows of partial sums a step and channels a program (one
    # program of 32 channels over 1792 rows took 30 us, 16 channels over 256 rows a step 9.5-12.5 us; all
    # measured while every tile load was a 2-byte scalar: docs/decisions.md)
    batch_norm_programs: int = 2048
    batch_norm_tile: int = 2048
    batch_norm_summing_channels: Tuple[int, ...] = (16, 32, 64)
    batch_norm_channels: Tuple[int, ...] = (128, 256, 512)
    batch_norm_reduce_rows: int = 256
    batch_norm_reduce_channels: int = 16
    # ---- checks and launching
    fast_launch: bool = switch("DWCONV_FAST_LAUNCH") is not False  # repeat launches skip Triton's dispatch
    poison_partials: bool = False  # tests: NaN-fill partial sums and BatchNorm's outputs, so an unwritten one shows
    plan_as_gpu: bool = False  # compile checks: CPU tensors get the GPU's kernels and blocks
    replay_layer_capacity: int = 512  # layers the C++ path keeps recorded (least recently used go)
    replay_build_timeout_s: float = 600.0  # the C++ replayer's build never waits longer (stale locks too)
    # a warmup's compile processes; 0: one a CPU core. Under evaluation: 16 compiles at once on the H200's
    # 16-core host ran each 2-2.5x slower than one alone (docs/decisions.md, "Cold start")
    warmup_workers: int = 0


def from_text(text: str) -> Dict[str, object]:
    """Changes written "name=value,name=value" (Python literals), checked against the table's fields."""
    import ast

    changes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, value = (side.strip() for side in part.partition("=")[::2])
        if name not in {f.name for f in dataclasses.fields(Tuning)}:
            raise ValueError(f"dwconv: {name!r} is no tuning field (dwconv/tuning.py)")
        try:
            changes[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"dwconv: tuning field {name}: {value!r} is no Python literal") from None
    return changes


_DEFAULT = Tuning()
# DWCONV_TUNING="name=value,...": the table this process starts with (A/B runs of whole processes: cold
# starts, models; its compile workers get the same changes)
_CURRENT = dataclasses.replace(_DEFAULT, **from_text(os.environ.get("DWCONV_TUNING", "")))
_LOCK = threading.Lock()
_RESETS: List[Callable[[], None]] = []


def tuned() -> Tuning:
    """The table in force."""
    return _CURRENT


def changes() -> Dict[str, object]:
    """The fields of the table in force that differ from the defaults (what a worker process that
    must make the same choices is given: dwconv.warmup's)."""
    return {f.name: getattr(_CURRENT, f.name) for f in dataclasses.fields(Tuning)
            if getattr(_CURRENT, f.name) != getattr(_DEFAULT, f.name)}


def on_change(reset: Callable[[], None]) -> Callable[[], None]:
    """Registers a cache's reset, called whenever the table changes (launch plans, recorded layers)."""
    _RESETS.append(reset)
    return reset


def _install(table: Tuning) -> None:
    global _CURRENT
    _CURRENT = table
    for reset in _RESETS:
        reset()


class override:
    """The table with `changes` in force (names as in Tuning; a wrong one raises), from this call
    until restore(), or for a with-block:

        with tuning.override(toeplitz_min_taps=81): ...     # the block only
        tuning.override(poison_partials=True)               # the rest of the process (tests' set-up)
    """

    def __init__(self, **changes):
        with _LOCK:
            self._before = _CURRENT
            _install(dataclasses.replace(_CURRENT, **changes))

    def __enter__(self) -> Tuning:
        return _CURRENT

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        with _LOCK:
            _install(self._before)
