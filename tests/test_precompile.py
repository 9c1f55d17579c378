"""dwconv.warmup: the layer calls it finds on fake tensors, and the kernels its worker processes
compile into Triton's disk cache (for sm_90 without a GPU; on the GPU, for the GPU, and then the
model's real step compiles nothing)."""

import copy
import os
import shutil

import pytest
import torch
import torch.nn as nn

import dwconv
from dwconv.precompile import layer_calls
from helpers import DEVICE, assert_close, randn


class Block(nn.Module):
    """Depthwise layers as networks use them: BatchNorm between, a stride-2 layer, a 5x5 with a
    channel multiplier, and one layer called twice."""

    def __init__(self):
        super().__init__()
        self.dw1 = nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.dw2 = nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6)
        self.dw3 = nn.Conv2d(6, 12, 5, padding=2, groups=6)

    def forward(self, x):
        y = self.dw1(self.bn(self.dw1(x)))
        return self.dw3(self.dw2(y)).mean()


def converted(memory_format=torch.contiguous_format):
    torch.manual_seed(0)
    return dwconv.convert(Block(), verbose=False).to(DEVICE, memory_format=memory_format)


def test_layer_calls_on_fake_tensors():
    model = converted()
    before = copy.deepcopy(model.state_dict())
    x = randn(2, 6, 11, 13)
    calls = layer_calls(model, x)
    # dw1 twice (its input needs no gradient at the first call), dw2, dw3
    assert [c.tensors[0][0] for c in calls] == [(2, 6, 11, 13)] * 3 + [(2, 6, 6, 7)]
    assert [c.tensors[1][0] for c in calls] == [(6, 1, 3, 3)] * 3 + [(12, 1, 5, 5)]
    assert [c.arguments for c in calls] == [((1, 1), (1, 1), (1, 1))] * 2 + [((2, 2), (1, 1), (1, 1)),
                                                                             ((1, 1), (2, 2), (1, 1))]
    assert [c.grads for c in calls] == [(False, True, False), (True, True, False), (True, True, True),
                                        (True, True, True)]
    assert calls[0].tensors[2] is None and calls[2].tensors[2] == ((6,), (1,), "float32")
    # nothing of the model changed: BatchNorm's running statistics, the training mode
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert model.training
    inference = layer_calls(model, x, train=False)  # (dw1's two calls are one)
    assert len(inference) == 3 and all(c.grads == (False, False, False) for c in inference)
    assert model.training
    model.bn.eval()  # (each module's own mode comes back, not the model's)
    layer_calls(model, x)
    assert model.training and not model.bn.training


def test_layer_calls_see_autocast_and_channels_last():
    model = converted(torch.channels_last)
    x = randn(2, 6, 11, 13).contiguous(memory_format=torch.channels_last).requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        calls = layer_calls(model, x)
    assert all(c.tensors[0][2] == c.tensors[1][2] == "bfloat16" for c in calls)
    assert calls[0].tensors[0][1] == (6 * 11 * 13, 1, 13 * 6, 6)  # channels_last strides
    assert calls[0].grads[0]


def test_warmup_fills_the_disk_cache(tmp_path, monkeypatch):
    """Compiles into an empty cache directory; a second warmup finds everything there. On the GPU the
    model's forward and backward then compile nothing (no new cache entries)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    model = converted()
    x = randn(3, 6, 17, 19)  # (sizes no other test uses: the GPU process compiled nothing for them yet)
    report = dwconv.warmup(model, x, workers=2, arch=None if DEVICE == "cuda" else 90, verbose=False)
    assert report.errors == [] and report.layers == 4
    assert report.passes_warm == 0 and report.launches >= 4
    # launches of one kernel binary (here the weight gradient's summing pass) compile once: every compile
    # made a binary of its own
    assert report.launches_shared > 0 and report.launches == len(_kernel_binaries(tmp_path))
    entries = set(os.listdir(tmp_path))
    # (a marker a pass, a batch-free one beside it, and the model's for this call)
    assert len(entries) >= 3 and len(os.listdir(tmp_path / "dwconv-warmup")) == 2 * 8 + 1
    again = dwconv.warmup(model, x, workers=1, arch=None if DEVICE == "cuda" else 90, verbose=False)
    # the markers say every pass is compiled: no worker starts
    assert again.errors == [] and again.workers == 0 and again.passes_warm == 8
    assert set(os.listdir(tmp_path)) == entries
    # another batch size: the batch-free markers say its kernels are those compiled (no worker either)
    other_batch = dwconv.warmup(model, x[:2], workers=1, arch=None if DEVICE == "cuda" else 90, verbose=False)
    assert other_batch.workers == 0 and other_batch.passes_warm == 8
    if DEVICE == "cuda":
        model(x.requires_grad_()).backward()
        model(x[:2]).backward()
        torch.cuda.synchronize()
        assert set(os.listdir(tmp_path)) == entries, "the real steps compiled kernels that warmup did not"


def test_a_warm_model_skips_the_fake_run(tmp_path, monkeypatch):
    """Once a warmup of a model for a call found or compiled every kernel, a warmup of the same model
    for the same call (in this process or another) reads one marker and neither runs the model on
    fake tensors nor starts a worker; any change to the model's structure, attributes, training
    flag, forward code, parameters or the call's inputs and autocast runs the fake run again."""
    from dwconv import precompile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    arch = None if DEVICE == "cuda" else 90
    torch.manual_seed(0)
    model = dwconv.convert(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), nn.ReLU()),
                           verbose=False).to(DEVICE)
    x = randn(2, 4, 9, 10)
    first = dwconv.warmup(model, x, workers=2, arch=arch, verbose=False)
    assert first.errors == [] and first.workers > 0 and (first.layers, first.passes_warm) == (1, 0)
    traced = []
    real_layer_calls = precompile.layer_calls
    monkeypatch.setattr(precompile, "layer_calls", lambda *a, **k: traced.append(1) or real_layer_calls(*a, **k))
    again = dwconv.warmup(model, x, workers=2, arch=arch, verbose=False)
    assert traced == [] and again.workers == 0 and (again.layers, again.passes_warm) == (1, 2)
    changes = [lambda: model[0].__setattr__("padding", (2, 2)),  # (an attribute)
               lambda: model.eval(),  # (training flags)
               lambda: model[0].weight.requires_grad_(False),
               lambda: model.append(nn.Identity()),  # (the structure)
               lambda: monkeypatch.setattr(nn.ReLU, "forward", lambda self, y: y.clamp(min=0))]  # (forward code)
    for number, change in enumerate(changes):
        change()
        dwconv.warmup(model, x, workers=2, arch=arch, verbose=False)
        assert len(traced) == number + 1, number
        dwconv.warmup(model, x, workers=2, arch=arch, verbose=False)
        assert len(traced) == number + 1, number  # (now marked)
    for other in (randn(2, 4, 9, 11), x.to(torch.float64), x.requires_grad_()):
        dwconv.warmup(model, other, workers=2, arch=arch, verbose=False)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        dwconv.warmup(model, x, workers=2, arch=arch, verbose=False)
    assert len(traced) == len(changes) + 4


def test_warmup_needs_arch_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="arch"):
        dwconv.warmup(converted(), randn(1, 6, 8, 8), verbose=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_warmup_casts_as_the_autocast_it_is_told(monkeypatch, tmp_path, dtype):
    """warmup(..., autocast=dtype) finds the calls a run under torch.autocast("cuda", dtype) makes,
    on any device (a container image's build without a GPU, where torch turns CUDA autocast off):
    each depthwise layer gets its tensors in dtype, as the model cast to dtype would give them."""
    from dwconv import precompile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    found = []
    monkeypatch.setattr(precompile, "compile_calls", lambda calls, *args: found.append(calls) or
                        precompile.WarmupReport(len(calls), 0.0, 0))
    model = converted(torch.channels_last)
    x = randn(2, 6, 11, 13).contiguous(memory_format=torch.channels_last)
    dwconv.warmup(model, x, arch=90, autocast=dtype, verbose=False)
    assert not torch.is_autocast_enabled(DEVICE)
    cast = copy.deepcopy(model).to(dtype)
    assert found[0] == layer_calls(cast, x.to(dtype))
    assert {c.tensors[0][2] for c in found[0]} == {str(dtype).split(".")[1]}
    with pytest.raises(ValueError, match="autocast must be"):
        dwconv.warmup(model, x, arch=90, autocast=torch.float32, verbose=False)


def test_warmup_workers_a_core_or_as_tuned(retune, monkeypatch):
    """A warmup starts one compile process a CPU core it may use, or tuned().warmup_workers, shared
    among a distributed run's local ranks."""
    from dwconv.precompile import default_workers

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_workers() == cores
    retune(warmup_workers=cores + 5)
    assert default_workers() == cores + 5
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_workers() == (cores + 5) // 2


def test_workers_get_the_tuning_changes(retune, monkeypatch, tmp_path):
    """The workers make the caller's choices: its tuning changes go to each (as repr()s)."""
    import json
    import subprocess

    from dwconv import tuning

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    retune(per_branch_weight_taps=4, nhwc_rows_widths=(48,))
    assert tuning.changes() == {"per_branch_weight_taps": 4, "nhwc_rows_widths": (48,), "poison_partials": True}
    commands = []

    class NoWorker:
        def __init__(self, command, **kwargs):
            commands.append(command)
            raise OSError("no worker in this test")

    monkeypatch.setattr(subprocess, "Popen", NoWorker)
    with pytest.raises(OSError):
        dwconv.warmup(converted(), randn(1, 6, 8, 8), arch=90, verbose=False)
    assert json.loads(commands[0][4]) == {"per_branch_weight_taps": "4", "nhwc_rows_widths": "(48,)",
                                           "poison_partials": "True"}


def test_workers_that_exit_are_reported_not_waited_for(monkeypatch, tmp_path, capsys):
    """Workers that die (here: at once) leave their tasks as errors, and warmup returns. Its
    progress, where stderr is no terminal, is one line at the end."""
    import subprocess
    import sys

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    popen = subprocess.Popen

    def dying(command, **kwargs):
        return popen([sys.executable, "-c", "pass"], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", dying)
    with pytest.warns(UserWarning, match="the compile worker exited"):
        report = dwconv.warmup(converted(), randn(1, 6, 8, 8), workers=2, arch=90)
    assert report.layers == 4 and len(report.errors) == 8 and report.launches == 0  # (each pass once)
    assert capsys.readouterr().err.splitlines() == [
        "dwconv.warmup: 0/? kernels of 4 depthwise calls compiled on 2 processes, 0 s"]
    assert not os.path.exists(tmp_path / "dwconv-warmup")  # (nothing marked compiled)


class ReadsAValue(nn.Module):
    """A forward that reads a tensor's value on the host after its first depthwise layer."""

    def __init__(self):
        super().__init__()
        self.dw1 = dwconv.DepthwiseConv2d(4, 4, 3, padding=1)
        self.dw2 = dwconv.DepthwiseConv2d(4, 4, 5, padding=2)

    def forward(self, x):
        y = self.dw1(x)
        return self.dw2(y) if y.sum().item() > -1e30 else y


def test_untraceable_model_is_reported_and_what_was_found_compiles(monkeypatch):
    from dwconv import precompile

    model = ReadsAValue().to(DEVICE)
    x = randn(1, 4, 9, 9)
    with pytest.raises(precompile.ModelNotTraceable, match="after 1 depthwise call") as failure:
        layer_calls(model, x)
    assert [c.tensors[1][0] for c in failure.value.calls] == [(4, 1, 3, 3)]
    compiled = []
    monkeypatch.setattr(precompile, "compile_calls", lambda calls, *args: compiled.extend(calls) or
                        precompile.WarmupReport(len(calls), 0.0, 1))
    with pytest.warns(UserWarning, match="fake tensors"):
        dwconv.warmup(model, x, arch=90, verbose=False)
    assert compiled == failure.value.calls


def test_markers_key_on_arch_tuning_and_call(retune):
    from dwconv.precompile import LayerCall, _marker

    call = LayerCall((((2, 6, 9, 9), (486, 81, 9, 1), "float32"), (((6, 1, 3, 3), (9, 9, 3, 1), "float32")), None),
                     (True, True, False), ((1, 1), (1, 1), (1, 1)))
    other = LayerCall(call.tensors, (False, True, False), call.arguments)
    keys = {_marker(call, "forward", 90, "{}"), _marker(call, "backward", 90, "{}"), _marker(other, "backward", 90, "{}"),
            _marker(call, "forward", 100, "{}"), _marker(call, "forward", 90, '{"per_branch_weight_taps": "4"}')}
    assert len(keys) == 5 and _marker(call, "forward", 90, "{}") in keys


class FirstCalls:
    """Records the warmups the first-call hook starts (on CPU tensors too, for the test)."""

    def __init__(self, monkeypatch):
        from dwconv import precompile

        self.calls = []
        monkeypatch.setattr(precompile, "_WARM_UP_ON", ("cpu", "cuda"))
        monkeypatch.setattr(precompile, "warmup", lambda model, *args, **kwargs: self.calls.append(
            (tuple(a.shape for a in args), kwargs["train"])))


def test_converted_model_warms_up_at_its_first_call_with_each_signature(monkeypatch):
    first_calls = FirstCalls(monkeypatch)
    model = converted()
    x = randn(2, 6, 9, 9)
    model(x)
    model(x)  # (seen: no warmup)
    assert first_calls.calls == [(((2, 6, 9, 9),), True)]
    model(randn(3, 6, 9, 9))
    with torch.no_grad():
        model(x)  # (no gradient: another signature, forward kernels only)
    model.eval()(x)
    with torch.inference_mode():
        model(x)  # (no gradient either: the same signature)
    assert first_calls.calls[1:] == [(((3, 6, 9, 9),), True), (((2, 6, 9, 9),), False)]
    copy.deepcopy(model).train()(randn(4, 6, 9, 9))  # (the copy keeps the hook)
    assert len(first_calls.calls) == 4
    monkeypatch.setenv("DWCONV_WARMUP", "0")
    model(randn(5, 6, 9, 9))
    assert len(first_calls.calls) == 4
    assert len(dwconv.convert(model, verbose=False)._forward_pre_hooks) == 1  # (converted again: one hook)
    assert not dwconv.convert(Block(), verbose=False, precompile=False)._forward_pre_hooks


def warmups_without_compiles(monkeypatch, tmp_path) -> list:
    """First-call warmups on CPU tensors as on an sm_90 GPU, their compiles replaced by a record of
    the calls each would compile (returned, one list a warmup)."""
    from dwconv import precompile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # (no model marker of another run)
    monkeypatch.setattr(precompile, "_WARM_UP_ON", ("cpu", "cuda"))
    found = []
    monkeypatch.setattr(precompile, "compile_calls", lambda calls, *args: found.append(calls) or
                        precompile.WarmupReport(len(calls), 0.0, 1))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return found


def test_first_call_warmup_runs_the_model_on_fakes_once_and_never_fails_the_call(monkeypatch, tmp_path):
    from dwconv import precompile

    found = warmups_without_compiles(monkeypatch, tmp_path)
    model = converted()
    x = randn(2, 6, 9, 9)
    expected = model(x)
    assert len(found) == 1 and len(found[0]) == 4  # (the hook stayed out of its own fake run)
    with torch.inference_mode():
        model.eval()(x[:, :, :7])
    assert len(found) == 2 and all(not any(call.grads) for call in found[1])
    model.train()
    monkeypatch.setattr(precompile, "compile_calls", lambda *args: 1 / 0)
    with pytest.warns(RuntimeWarning, match="ZeroDivisionError"):
        assert torch.equal(model(x[:1]), model(x[:1]))
    assert torch.equal(model(x), expected)


def test_first_call_warmup_inside_activation_checkpointing(monkeypatch, tmp_path):
    """A converted model's first call inside torch.utils.checkpoint (non-reentrant: the saved tensors
    go through its hooks): its warmup's fake run saves nothing through them (before: the non-reentrant form counted 18
    tensors saved in the forward against 9 in the recomputation and raised CheckpointError); the
    output and every gradient as without the checkpoint."""
    from torch.utils.checkpoint import checkpoint

    found = warmups_without_compiles(monkeypatch, tmp_path)
    model, x = converted(), randn(1, 6, 5, 4)
    reference = copy.deepcopy(model)
    leaf, reference_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = checkpoint(model, leaf, use_reentrant=False)
    assert len(found) == 1  # (the warmup ran, at this call)
    out.backward()
    expected = reference(reference_leaf)
    expected.backward()
    assert torch.equal(out, expected) and torch.equal(leaf.grad, reference_leaf.grad)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad), name


def test_first_call_warmup_under_jit_trace(monkeypatch, tmp_path):
    """torch.jit.trace of a converted model not called before: its first-call warmup runs (the fake
    run finds every call) and stays out of the trace, whose graph holds the model's own ops alone."""
    found = warmups_without_compiles(monkeypatch, tmp_path)
    model, x = converted().eval(), randn(2, 6, 9, 9)
    traced = torch.jit.trace(model, (x,), check_trace=False)
    assert len(found) == 1 and len(found[0]) == 3  # (dw1's two calls one, in inference)
    kinds = [node.kind() for node in traced.inlined_graph.nodes()]
    assert kinds.count("dwconv::conv2d") == 4 and kinds.count("aten::batch_norm") == 1, kinds
    fresh = randn(2, 6, 9, 9)
    assert_close(traced(fresh), model(fresh).double(), torch.float32, "traced output")


def test_first_call_warmup_leaves_each_module_in_its_own_mode(monkeypatch, tmp_path):
    """A model trained with a frozen BatchNorm (the model in training, the BatchNorm in eval) keeps it
    frozen through the warmup at its first call: its running statistics do not move."""
    warmups_without_compiles(monkeypatch, tmp_path)
    model = converted()
    model.bn.eval()
    statistics = model.bn.running_mean.clone()
    model(randn(2, 6, 9, 9))
    model(randn(2, 6, 9, 9))
    assert model.training and not model.bn.training
    assert torch.equal(model.bn.running_mean, statistics)


def _kernel_binaries(cache) -> dict:
    """Triton's cache entries that hold a compiled kernel: {entry: kernel name}."""
    import glob
    import json

    found = {}
    for entry in os.listdir(cache):
        for path in glob.glob(os.path.join(cache, entry, "*.json")):
            if not os.path.basename(path).startswith("__grp__"):
                found[entry] = json.load(open(path)).get("name")
    return found


def test_batch_and_image_sizes_share_kernel_binaries(tmp_path, monkeypatch):
    """The channels_last kernels of a training step (forward, input and weight gradients) take the
    batch and image size as runtime arguments: another batch or image size (divisible by 16 or not)
    compiles nothing new, except the forward tile for an output width that takes another block
    width (stride 2: nor the input gradient's phase kernel). Channel counts are specialised (the pixel tiles' pixel strides are constants): another
    count compiles each kernel again. Compiled for
    sm_90 into an empty cache."""
    from dwconv.precompile import LayerCall, compile_calls

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))

    def call(n, c, h, w, stride=1):
        x = torch.empty(n, c, h, w, device="meta", dtype=torch.bfloat16, memory_format=torch.channels_last)
        weight = torch.empty(c, 1, 3, 3, device="meta", dtype=torch.bfloat16)
        return LayerCall.of(x, weight, None, (stride, 1, 1), (True, True, False))

    new = []
    # (32 rows: 16 row tiles of the backward's pixel tiles and a height of 32, sizes Triton would specialise)
    for layer in (call(2, 16, 9, 11), call(3, 16, 9, 11), call(2, 16, 13, 10), call(2, 16, 9, 7), call(2, 24, 9, 11),
                  call(2, 16, 32, 11)):
        before = _kernel_binaries(tmp_path)
        shutil.rmtree(tmp_path / "dwconv-warmup", ignore_errors=True)  # (markers would skip the batch-only change)
        report = compile_calls([layer], 90, workers=2, verbose=False)
        assert report.errors == [] and report.launches == 3
        new.append(sorted(name for entry, name in _kernel_binaries(tmp_path).items() if entry not in before))
    kernels = ["depthwise_fwd_tile_kernel", "depthwise_grad_nhwc_pixels_kernel", "depthwise_weight_grad_sums_kernel"]
    assert new == [kernels, [], [], ["depthwise_fwd_tile_kernel"], kernels, []], new
    # stride 2: the input gradient's phase kernel too (sizes 32 and 16 against 18 and 9)
    strided = []
    for layer in (call(2, 16, 32, 32, stride=2), call(2, 16, 18, 18, stride=2)):
        before = _kernel_binaries(tmp_path)
        shutil.rmtree(tmp_path / "dwconv-warmup", ignore_errors=True)
        assert compile_calls([layer], 90, workers=2, verbose=False).errors == []
        strided.append(sorted(name for entry, name in _kernel_binaries(tmp_path).items() if entry not in before))
    assert "depthwise_grad_input_phase_kernel" in strided[0], strided
    assert "depthwise_grad_input_phase_kernel" not in strided[1], strided


def test_nchw_batch_sizes_share_kernel_binaries(tmp_path, monkeypatch):
    """The NCHW kernels whose counts follow the batch (large_fma's rows and splits, the weight
    gradient's) take them at run time: batch sizes divisible by 16, odd, or 1 (splits of 1) share
    every binary. float32 training steps of a 3x3 on a narrow plane, a stride-2 3x3 on a wide one
    and a 5x5, compiled for sm_90."""
    from dwconv.precompile import LayerCall, compile_calls

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))

    def call(n, kernel, size, stride=1):
        x = torch.empty(n, 8, size, size, device="meta")
        return LayerCall.of(x, torch.empty(8, 1, kernel, kernel, device="meta"), None, (stride, kernel // 2, 1),
                            (True, True, False))

    new = []
    for batch in (16, 3, 1, 64):
        before = _kernel_binaries(tmp_path)
        shutil.rmtree(tmp_path / "dwconv-warmup", ignore_errors=True)  # (markers would skip the batch-only change)
        calls = [call(batch, 3, 14), call(batch, 3, 40, stride=2), call(batch, 5, 14)]
        assert compile_calls(calls, 90, workers=2, verbose=False).errors == []
        new.append(sorted(name for entry, name in _kernel_binaries(tmp_path).items() if entry not in before))
    assert "depthwise_grad_weight_kernel" in new[0] and "depthwise_fwd_large_fma_kernel" in new[0], new
    assert new[1:] == [[], [], []], new


def test_batch_free_markers_follow_the_plans_batch_dependent_choices(retune):
    """Markers shared by batch sizes are honest: what the kernel binaries follow of the batch splits
    them (the channels_last tiles' size thresholds; the Toeplitz products' batch itself)."""
    from dwconv.precompile import LayerCall

    retune(nhwc_taps_major_min_bytes=2 * 16 * 9 * 11 * 2)

    def call(n, kernel=3):
        x = torch.empty(n, 16, 9, 11, device="meta", dtype=torch.bfloat16, memory_format=torch.channels_last)
        weight = torch.empty(16, 1, kernel, kernel, device="meta", dtype=torch.bfloat16)
        return LayerCall.of(x, weight, None, (1, kernel // 2, 1)).without_batch()

    assert call(1) == call(1) != call(2) == call(5)
    assert call(2, 13) != call(5, 13) and call(128, 13) != call(300, 13)


def test_channel_counts_compile_tiles_of_their_own_and_share_the_summing_pass(tmp_path, monkeypatch):
    """The channels_last pixel tiles compile the pixel stride (the channel count) in, a binary per
    count; the weight gradient's summing pass is one binary for both counts, and a warmup compiles
    it once. Compiled for sm_90."""
    from dwconv.precompile import LayerCall, compile_calls

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))

    def call(c):
        x = torch.empty(2, c, 9, 11, device="meta", dtype=torch.bfloat16, memory_format=torch.channels_last)
        weight = torch.empty(c, 1, 3, 3, device="meta", dtype=torch.bfloat16)
        return LayerCall.of(x, weight, None, (1, 1, 1), (True, True, False))

    report = compile_calls([call(32), call(48)], 90, workers=2, verbose=False)
    assert report.errors == []
    assert (report.launches, report.launches_shared) == (5, 1), report
    assert report.launches == len(_kernel_binaries(tmp_path))


def test_the_fake_run_calls_no_user_hook_but_torch_weight_hooks():
    """A user's hooks keep what they see: the fake run must not call them (fake tensors, a run that
    is none). The older weight_norm's pre-hook computes the weight: it runs. Every hook is back after."""
    import warnings

    model = converted()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch.nn.utils.weight_norm is deprecated)
        torch.nn.utils.weight_norm(model.dw3)
    seen = []
    model.dw1.register_forward_hook(lambda module, args, out: seen.append(out))
    model.register_forward_pre_hook(lambda module, args: seen.append("pre"))
    hooks = {m: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()}
    calls = layer_calls(model, randn(2, 6, 11, 13))
    assert seen == []
    assert [c.tensors[1][0] for c in calls][-1] == (12, 1, 5, 5)  # (dw3 through its weight_norm hook)
    assert {m: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()} == hooks
    model(randn(2, 6, 11, 13))
    assert seen[0] == "pre" and len(seen) == 3  # (dw1 is called twice)
