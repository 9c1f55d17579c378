"""Bad input raises a clear Python exception naming the argument (never a crash or a wrong answer)."""

import pytest
import torch

import dwconv
from helpers import DEVICE, randn

def call(x=None, weight=None, bias=None, **kwargs):
    x = randn(2, 3, 8, 8) if x is None else x
    weight = randn(3, 1, 3, 3) if weight is None else weight
    return dwconv.depthwise_conv2d(x, weight, bias, **kwargs)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(x=randn(3, 8, 8)), ValueError, "input must be 4-D"),
        (dict(x=randn(1, 2, 3, 8, 8)), ValueError, "input must be 4-D"),
        (dict(weight=randn(3, 3, 3)), ValueError, "weight must be 4-D"),
        (dict(weight=randn(4, 1, 3, 3)), ValueError, r"weight.shape\[0\]"),
        (dict(weight=randn(3, 3, 3, 3)), ValueError, r"weight.shape\[1\]"),
        (dict(weight=randn(3, 1, 3, 3, dtype=torch.float16)), TypeError, "weight dtype"),
        (dict(bias=randn(3, dtype=torch.bfloat16)), TypeError, "bias dtype"),
        (dict(bias=randn(4)), ValueError, "bias must have shape"),
        (dict(bias=randn(3, 1)), ValueError, "bias must have shape"),
        (dict(x=torch.ones(2, 3, 8, 8, dtype=torch.int32, device=DEVICE),
              weight=torch.ones(3, 1, 3, 3, dtype=torch.int32, device=DEVICE)), TypeError, "input dtype"),
        (dict(stride=0), ValueError, "stride must be >= 1"),
        (dict(stride=(1, -1)), ValueError, "stride must be >= 1"),
        (dict(dilation=0), ValueError, "dilation must be >= 1"),
        (dict(padding=-1), ValueError, "padding must be non-negative"),
        (dict(padding=(0, -2)), ValueError, "padding must be non-negative"),
        (dict(padding="full"), ValueError, "padding must be 'valid', 'same'"),
        (dict(padding="same", stride=2), ValueError, "'same' is not supported for strided"),
        (dict(stride=(1, 2, 3)), TypeError, "stride must be an int or a pair"),
        (dict(dilation=1.5), TypeError, "dilation must be an int or a pair"),
        (dict(weight=randn(3, 1, 9, 3)), ValueError, "larger than the padded input"),
        (dict(weight=randn(3, 1, 3, 3), dilation=4), ValueError, "larger than the padded input"),
        (dict(x=randn(2, 3, 0, 8)), ValueError, "empty spatial size"),
        (dict(x="not a tensor"), TypeError, "input must be a torch.Tensor"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_input_raises(kwargs, error, match):
    with pytest.raises(error, match=match):
        call(**kwargs)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a second device")
def test_device_mismatch():
    with pytest.raises(ValueError, match="weight is on"):
        call(weight=torch.randn(3, 1, 3, 3))
    with pytest.raises(ValueError, match="bias is on"):
        call(bias=torch.randn(3))


def test_float64_runs():
    """float64 is supported (accumulated in float64), not refused."""
    x = randn(1, 2, 5, 5, dtype=torch.float64)
    out = dwconv.depthwise_conv2d(x, randn(2, 1, 3, 3, dtype=torch.float64))
    assert out.dtype == torch.float64


def test_module_rejects_other_groups():
    with pytest.raises(ValueError, match="groups must equal in_channels"):
        dwconv.DepthwiseConv2d(4, 4, 3, groups=2)


@pytest.mark.parametrize("setting,answer", [
    ("short_pixel_tile_rows=4, max_pixel_taps=1024", "4 1024 {'max_pixel_taps': 1024, 'short_pixel_tile_rows': 4}"),
    ("pixel_tile_row=2", "'pixel_tile_row' is no tuning field"),
    ("short_pixel_tile_rows=two", "short_pixel_tile_rows: 'two' is no Python literal"),
])
def test_tuning_from_the_environment(setting, answer):
    """DWCONV_TUNING sets the table a process starts with (whole-process A/B runs); a wrong name or
    value raises at import, naming it."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, DWCONV_TUNING=setting)
    done = subprocess.run([sys.executable, "-c", "from dwconv import tuning; t = tuning.tuned(); "
                           "print(t.short_pixel_tile_rows, t.max_pixel_taps, dict(sorted(tuning.changes().items())))"],
                          env=env, capture_output=True, text=True)
    assert answer in (done.stdout if done.returncode == 0 else done.stderr)
