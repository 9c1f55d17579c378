"""Large kernels: the Toeplitz tensor-core path and the float32 CUDA-core kernel
(large_fma), forward and every gradient, against float64 F.conv2d. Tiny images under the
interpreter (CI), the same tests compiled on a GPU."""

import collections

import pytest
import torch

import dwconv
from dwconv._geometry import conv_geometry
from dwconv import dispatch
from dwconv.dispatch import fused_backward_applies
from dwconv.kernels import large_fma, toeplitz
from dwconv.tuning import tuned
from dwconv.dispatch import ForwardConfig, forward_config
from helpers import DEVICE, DTYPES, assert_close, randn
from test_backward import assert_close_sum, check_grads, reference_grads
from test_forward import check

LAYOUTS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}
# (shape, kernel, stride, padding, dilation, multiplier): 'same'-padded 13x13 and 9x9, a kernel
# wider than the image's rows, strides, dilation, a channel multiplier, a padding beyond the kernel
CASES = [
    ((1, 2, 16, 16), (13, 13), 1, 6, 1, 1),
    ((2, 3, 11, 17), (11, 11), 1, "same", 1, 2),
    ((1, 2, 13, 40), (4, 31), 1, (2, 15), 1, 1),
    ((1, 2, 19, 18), (9, 12), (2, 3), (3, 5), 1, 1),
    ((1, 1, 21, 23), (11, 11), 1, 10, 2, 1),
    ((1, 2, 8, 9), (11, 11), 1, 10, 1, 1),
    ((2, 2, 16, 40), (11, 11), 1, 5, 1, 1),  # rows loaded as 4-element vectors, windows shifted
    # windows filled to the last column by the strips' common shift (1 and 7 columns, 16-byte
    # vectors in half precision): k31's layout, and the largest shift
    ((1, 2, 8, 64), (5, 31), 1, (2, 15), 1, 1),
    ((1, 2, 6, 64), (4, 26), 1, 1, 1, 1),
]
IDS = ["k13-same", "k11-same-mult2", "k4x31-wide", "k9x12-stride", "k11-dil2", "k11-pad10", "k11-vectors",
       "k5x31-full-window", "k4x26-shift7"]


def take_path(path, geom, x, retune):
    """The dispatcher's large-kernel path ("default": large_fma where it applies, else Toeplitz), or
    "toeplitz" forced where the default is large_fma (NCHW: channels_last only adds a copy)."""
    fma = dispatch.large_fma_applies(geom, x)
    if path == "toeplitz":
        if not fma or x.is_contiguous(memory_format=torch.channels_last):
            pytest.skip("the default path is the Toeplitz one")
        retune(large_fma_min_taps=10**9)
        fma = False
    assert forward_config(geom, x).kernel == ("large_fma" if fma else "toeplitz")


@pytest.mark.parametrize("path", ["default", "toeplitz"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,kernel,stride,padding,dilation,multiplier", CASES, ids=IDS)
def test_forward(shape, kernel, stride, padding, dilation, multiplier, dtype, layout, path, retune):
    x = randn(*shape, dtype=dtype).contiguous(memory_format=LAYOUTS[layout])
    weight = randn(shape[1] * multiplier, 1, *kernel, dtype=dtype)
    bias = randn(shape[1] * multiplier, dtype=dtype)
    take_path(path, conv_geometry(x, weight, bias, stride, padding, dilation), x, retune)
    check(x, weight, bias, stride, padding, dilation)


@pytest.mark.parametrize("path", ["default", "toeplitz"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,kernel,stride,padding,dilation,multiplier", CASES[:1] + CASES[2:3] + CASES[4:5] + CASES[7:],
                         ids=IDS[:1] + IDS[2:3] + IDS[4:5] + IDS[7:])
def test_gradients(shape, kernel, stride, padding, dilation, multiplier, dtype, layout, path, retune):
    x = randn(*shape, dtype=dtype).contiguous(memory_format=LAYOUTS[layout])
    weight = randn(shape[1] * multiplier, 1, *kernel, dtype=dtype)
    geom = conv_geometry(x, weight, None, stride, padding, dilation)
    take_path(path, geom, x, retune)
    assert not fused_backward_applies(geom, x)
    check_grads(x, weight, randn(shape[1] * multiplier, dtype=dtype), stride, padding, dilation)


@pytest.mark.parametrize("dtype,kernel,path", [(torch.float32, 11, "large_fma"), (torch.bfloat16, 13, "toeplitz")],
                         ids=["large_fma", "toeplitz"])
@pytest.mark.parametrize("grad_out_format", [torch.channels_last, torch.contiguous_format], ids=["cl", "nchw"])
def test_channels_last_backward_copies_grad_out_once(dtype, kernel, path, grad_out_format, monkeypatch, retune):
    """A channels_last grad_out goes to NCHW once for both gradients (the weight gradient's kernel
    and grad_input's flipped forward both index unit-stride rows), none when it is NCHW already;
    x once (the weight gradient), and grad_input back once."""
    from dwconv.kernels import layout

    x = randn(2, 3, 12, 14, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = randn(3, 1, kernel, kernel, dtype=dtype)
    assert forward_config(conv_geometry(x, weight, None, 1, kernel // 2, 1), x).kernel == path
    sources, transpose = [], layout._transpose

    def spied(src, *args):
        sources.append(src)  # (held: a freed source's memory would come back under another tensor)
        transpose(src, *args)
    monkeypatch.setattr(layout, "_transpose", spied)
    grads = check_grads(x, weight, None, 1, kernel // 2, grad_out_format=grad_out_format)
    # by source: the input (the forward's and the weight gradient's copy), the forward's output back,
    # grad_out once (if channels_last), grad_input back
    reads = sorted(collections.Counter(src.data_ptr() for src in sources).values())
    assert reads == ([1, 1, 1, 2] if grad_out_format == torch.channels_last else [1, 1, 2]), reads
    assert grads[0].is_contiguous(memory_format=torch.channels_last)


def test_gradients_strided_multiplier_float32():
    """(grad_input of these takes the CUDA-core gather kernel: slow under the interpreter, so float32 only)"""
    check_grads(randn(1, 2, 19, 18), randn(2, 1, 9, 12), randn(2), (2, 3), (3, 5))
    check_grads(randn(2, 3, 11, 17), randn(6, 1, 11, 11), randn(6), 1, "same")


def test_forward_strided_bias_and_weight():
    """A bias and a weight that are views with steps (the launcher must not read them as contiguous)."""
    x = randn(1, 2, 12, 16)
    weight = randn(2, 1, 11, 22)[:, :, :, ::2]
    check(x, weight, randn(4)[::2], 1, 5)


@pytest.mark.parametrize("shape,kernel,stride,padding,dilation,multiplier", CASES[:5], ids=IDS[:5])
def test_toeplitz_forward_prefetch(retune, shape, kernel, stride, padding, dilation, multiplier, monkeypatch):
    """The next kernel row's input loaded during a product (tuned().toeplitz_prefetch_min_kernel_h, here
    at every height): the forward, and grad_input through it, as without. (Plans are cached: a fresh
    cache.)"""
    retune(toeplitz_prefetch_min_kernel_h=1)
    monkeypatch.setattr(toeplitz, "_PLANS", {})
    x = randn(*shape)
    weight = randn(shape[1] * multiplier, 1, *kernel)
    geom = conv_geometry(x, weight, None, stride, padding, dilation)
    config = ForwardConfig("toeplitz", 16, 16, 4)
    check(x, weight, randn(shape[1] * multiplier), stride, padding, dilation, config=config)
    assert any(plan.constants.get("PREFETCH") for plan in toeplitz._PLANS.values()), geom


@pytest.mark.parametrize("out_rows", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,kernel,stride,padding,dilation,multiplier", CASES, ids=IDS)
def test_toeplitz_out_rows(retune, shape, kernel, stride, padding, dilation, multiplier, dtype, out_rows, monkeypatch):
    """Tiles of several output rows (toeplitz_out_rows, here in every dtype and geometry): each input
    row's window multiplied with the bands of every output row reading it. Forward, and grad_input
    through it (the flipped forward where the stride is 1); strides and dilations across rows, row
    counts no tile divides, tiles past the last image. The weight gradient's passes of as many
    kernel rows (toeplitz_grad_weight_kh_rows, where rows are one step apart): kernel heights
    they do not divide, grad_out rows paired across a plane's end. (Plans are cached: a fresh cache.)"""
    monkeypatch.setattr(toeplitz, "toeplitz_out_rows", lambda geom, x: out_rows)
    monkeypatch.setattr(toeplitz, "toeplitz_grad_weight_kh_rows",
                        lambda geom, x, block_w=None: (out_rows if geom.stride_h == geom.dilation_h == 1 else 1, 4))
    monkeypatch.setattr(toeplitz, "_PLANS", {})
    retune(large_fma_min_taps=10**9)
    x = randn(*shape, dtype=dtype)
    weight = randn(shape[1] * multiplier, 1, *kernel, dtype=dtype)
    bias = randn(shape[1] * multiplier, dtype=dtype)
    geom = conv_geometry(x, weight, bias, stride, padding, dilation)
    assert forward_config(geom, x).kernel == "toeplitz"
    check(x, weight, bias, stride, padding, dilation)
    if geom.stride_h == geom.stride_w == 1:
        check_grads(x, weight, bias, stride, padding, dilation)
    assert {plan.constants["OUT_ROWS"] for key, plan in toeplitz._PLANS.items() if key[0] == "forward"} == {out_rows}
    if geom.stride_h == geom.dilation_h == 1:
        assert {plan.constants["KH_ROWS"] for key, plan in toeplitz._PLANS.items()
                if key[0] == "grad_weight"} == {out_rows}


@pytest.mark.parametrize("dtype,kernel,stride,dilation,rows", [
    (torch.bfloat16, 31, 1, 1, 4), (torch.float16, 13, 1, 1, 4), (torch.bfloat16, 51, 1, 1, 1),
    (torch.float32, 31, 1, 1, 1), (torch.bfloat16, 31, 2, 1, 1), (torch.float16, 13, 1, 2, 1)])
def test_toeplitz_out_rows_choice(retune, dtype, kernel, stride, dilation, rows):
    """Tiles of several rows where measured (half precision, rows one apart, below the prefetch's
    kernel height), and the launcher's plan takes them on 8 warps."""
    retune(large_fma_min_taps=10**9)
    x = randn(1, 2, 40, 40, dtype=dtype)
    weight = randn(2, 1, kernel, kernel, dtype=dtype)
    geom = conv_geometry(x, weight, None, stride, kernel // 2 * dilation, dilation)
    assert toeplitz.toeplitz_out_rows(geom, x) == rows
    config = forward_config(geom, x)
    assert config.num_warps == (8 if rows == 4 else 4)
    plan = toeplitz._forward_plan(geom, x, torch.empty_like(x), False, 128, None, config.num_warps, 1, rows)
    assert plan.constants["OUT_ROWS"] == rows and plan.constants["num_warps"] == config.num_warps


@pytest.mark.parametrize("shape,kernel,stride,rows,warps", [
    ((2, 128, 56, 56), 31, 1, 4, 4), ((2, 256, 28, 28), 13, 1, 4, 4), ((2, 128, 56, 56), 51, 1, 4, 8),
    ((2, 128, 56, 56), 31, 2, 1, 4), ((2, 64, 120, 120), 101, 1, 1, 4)])
def test_toeplitz_grad_weight_kh_rows_choice(shape, kernel, stride, rows, warps):
    """The weight gradient's kernel rows a pass and warps: 4 rows where rows are one step apart and
    the products fit 64 x 128 on 4 warps (k31, k13 at 32-column strips) or 128 x 256 on 8 (k51's
    64 x 128 windows); one row across strides and past that (k101); the plan takes both."""
    x = randn(*shape, dtype=torch.bfloat16)
    weight = randn(shape[1], 1, kernel, kernel, dtype=torch.bfloat16)
    geom = conv_geometry(x, weight, None, stride, kernel // 2, 1)
    assert toeplitz.toeplitz_grad_weight_kh_rows(geom, x) == (rows, warps)
    grad_out = torch.empty(geom.output_shape, dtype=x.dtype)
    plan = toeplitz._grad_weight_plan(geom, grad_out, x, False, 64, None, None, None, 1)
    assert (plan.constants["KH_ROWS"], plan.constants["num_warps"]) == (rows, warps)


@pytest.mark.parametrize("kernel,prefetch", [(31, False), (51, True)])
def test_toeplitz_prefetch_from_kernel_height(kernel, prefetch):
    """The forward prefetches the next kernel row from PREFETCH_MIN_KERNEL_H up (measured: k51 gains,
    k31 loses)."""
    x = randn(1, 2, 8, 8, dtype=torch.bfloat16)
    weight = randn(2, 1, kernel, kernel, dtype=torch.bfloat16)
    geom = conv_geometry(x, weight, None, 1, kernel // 2, 1)
    plan = toeplitz._forward_plan(geom, x, torch.empty_like(x), False, 64, None, 4, 1, 1)
    assert plan.constants["PREFETCH"] is prefetch


def test_forward_block_shapes():
    """Rows of several images in one product tile, several column strips, more than one row block."""
    x = randn(3, 2, 23, 45)
    weight = randn(2, 1, 11, 11)
    for block_m, block_w in [(16, 16), (32, 32), (64, 64)]:
        check(x, weight, randn(2), 1, 5, config=ForwardConfig("toeplitz", block_m, block_w, 4))


# (shape, kernel, stride, padding, dilation, multiplier, blocks): the GPU's blocks for 13x13 'same'
# on rows of 16 and 28; odd rows (scalar loads: no 4-element alignment), a row tile past the image,
# 16 outputs a thread on a row of 9; stride and dilation across rows, a multiplier; 8 and 4 outputs
# a thread; a window reaching past both row ends (padding 10 on 8 columns); 28 outputs a thread
# (a block width that is not a power of two: two groups on a 56-wide row); row tiles across images
# of 4 output rows (stride 2, a multiplier), the last tile past the last image
FMA_CASES = [
    ((1, 2, 16, 16), (13, 13), 1, 6, 1, 1, None),
    ((1, 1, 28, 28), (13, 13), 1, 6, 1, 1, None),
    ((2, 1, 13, 9), (11, 11), 1, 5, 1, 1, (4, 16, 1, 16)),
    ((1, 2, 19, 20), (9, 12), (3, 1), (3, 5), (2, 1), 2, (8, 32, 1, 8)),
    ((1, 1, 9, 8), (11, 11), 1, 10, 1, 1, (8, 16, 1, 4)),
    ((1, 2, 10, 56), (5, 11), 1, (2, 5), 1, 1, (16, 56, 1, 28)),
    ((3, 2, 7, 20), (5, 5), (2, 1), 2, 1, 2, (8, 32, 1, 8)),
    # small kernels on narrow planes (the dispatcher's LARGE_FMA_SMALL_KERNEL_MAX_WIDTH): 3x3 with
    # stride and dilation across rows and no padding across columns, rows of 2 and 1 outputs,
    # 'same' for an even kernel (the asymmetric split), 3x3 on a 28-wide row (28 outputs a thread)
    ((2, 3, 11, 9), (3, 3), (2, 1), (1, 0), (2, 1), 1, None),
    ((1, 2, 5, 2), (3, 3), 1, 1, 1, 2, None),
    ((2, 1, 4, 3), (3, 3), 1, 0, 1, 1, None),
    ((2, 2, 6, 11), (4, 4), 1, "same", 1, 1, None),
    ((1, 2, 5, 28), (3, 3), 1, 1, 1, 1, None),
    # column strides and dilations (STRIDE_W / DILATION_W: windows of stride_w columns an output),
    # with a multiplier, and with 8 outputs a thread over two groups
    ((2, 3, 12, 23), (3, 3), 2, 1, 1, 1, None),
    ((1, 2, 9, 30), (5, 5), (1, 3), 2, (1, 2), 2, None),
    ((1, 2, 8, 61), (3, 7), (2, 2), (1, 6), (2, 2), 1, (8, 16, 1, 8)),
    # whole rows of 56 a thread (the large float32 forward's blocks): two such groups on 61 columns
    ((1, 1, 6, 61), (11, 11), 1, 5, 1, 1, (16, 112, 1, 56)),
]
FMA_IDS = ["k13-16", "k13-28", "k11-odd-rows", "k9x12-stride-dil-mult", "k11-pad10", "k5x11-28-a-thread",
           "k5-tiles-across-images", "k3-stride-dil-rows", "k3-2-wide-mult", "k3-1-wide", "k4-same", "k3-28-wide",
           "k3-stride2", "k5-stride3-dil2-mult", "k3x7-stride2-dil2", "k11-56-a-thread-61-wide"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape,kernel,stride,padding,dilation,multiplier,blocks", FMA_CASES, ids=FMA_IDS)
def test_large_fma_forward(shape, kernel, stride, padding, dilation, multiplier, blocks, layout):
    """The float32 CUDA-core kernel, with a bias, at the launcher's blocks or the given ones."""
    x = randn(*shape).contiguous(memory_format=LAYOUTS[layout])
    weight = randn(shape[1] * multiplier, 1, *kernel)
    geom = conv_geometry(x, weight, None, stride, padding, dilation)
    block_h, block_w, warps, out_vec = blocks or large_fma.large_fma_blocks(geom)
    check(x, weight, randn(shape[1] * multiplier), stride, padding, dilation,
          config=ForwardConfig("large_fma", block_h, block_w, warps, out_vec))


@pytest.mark.parametrize("kernel,padding", [((5, 7), (2, 3)), ((3, 8), 1)], ids=str)
def test_large_fma_weight_vectors(retune, kernel, padding):
    """The forward with its weights as 4-vectors of rows padded on the host (WEIGHT_VECTORS_MIN_TAPS):
    output, and grad_input through the flipped taps, with a row length that is not a multiple of 4
    and one that is."""
    retune(weight_vectors_min_taps=0)
    x = randn(2, 2, 9, 13)
    weight = randn(2, 1, *kernel)
    assert forward_config(conv_geometry(x, weight, None, 1, padding, 1), x).kernel == "large_fma"
    check_grads(x, weight, randn(2), 1, padding)


def test_half_forward_on_large_fma_gradients_on_the_default_kernels(monkeypatch):
    """bfloat16 3x3 on a 40-wide plane: the forward on large_fma, grad_input and the weight gradient on
    the default kernels (the fused pass), each launch seen."""
    calls = []
    launch = large_fma.launch
    monkeypatch.setattr(large_fma, "launch", lambda *a: calls.append(a[0]) or launch(*a))
    x = randn(2, 2, 7, 40, dtype=torch.bfloat16)
    check_grads(x, randn(2, 1, 3, 3, dtype=torch.bfloat16), None, 1, 1)
    assert calls == [large_fma.depthwise_fwd_large_fma_kernel], calls
    assert fused_backward_applies(conv_geometry(x, randn(2, 1, 3, 3, dtype=torch.bfloat16), None, 1, 1, 1), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,kernel,padding", [((2, 3, 14, 13), 3, 1), ((1, 2, 11, 14), 5, 2)], ids=str)
def test_column_stride_2_on_large_fma(shape, kernel, padding, dtype, monkeypatch):
    """Stride 2 on a plane under 28 wide (LARGE_FMA_MAX_STRIDE_W): the forward and the weight gradient
    on large_fma (grad_input on its strided kernel), with a bias, each launch seen."""
    calls = []
    launch = large_fma.launch
    monkeypatch.setattr(large_fma, "launch", lambda *a: calls.append(a[0]) or launch(*a))
    x = randn(*shape, dtype=dtype)
    check_grads(x, randn(shape[1], 1, kernel, kernel, dtype=dtype), randn(shape[1], dtype=dtype), 2, padding)
    assert calls == [large_fma.depthwise_fwd_large_fma_kernel, large_fma.depthwise_grad_weight_large_fma_kernel], calls


def test_large_fma_blocks():
    """One output row of OUT_VEC columns a thread, every thread a row of a group; the large suite's layers."""
    for shape, kernel, padding, blocks in [((32, 128, 56, 56), 31, 15, (16, 56, 1, 28)),
                                           ((32, 256, 28, 28), 13, 6, (32, 28, 1, 28)),
                                           ((64, 384, 14, 14), 7, 3, (32, 16, 1, 16)),
                                           ((1, 2, 9, 6), 3, 1, (32, 8, 1, 8)), ((1, 2, 9, 4), 3, 1, (32, 4, 1, 4))]:
        x = torch.empty(shape, device="meta")
        geom = conv_geometry(x, torch.empty(shape[1], 1, kernel, kernel, device="meta"), None, 1, padding, 1)
        got = large_fma.large_fma_blocks(geom)
        assert got == blocks, (shape, got)
        assert got[0] * got[1] // got[3] == 32 * got[2]


def test_large_fma_forward_blocks(retune):
    """The float32 forward of kernels from 10x10 up to 31 columns: a whole row of up to 56 columns a
    thread (k13 and k31 on 56 x 56); k51, smaller kernels and half precision as the weight gradient's."""
    retune(plan_as_gpu=True)  # (the GPU's plans for tensors without one)
    for shape, kernel, dtype, blocks in [((32, 128, 56, 56), 31, torch.float32, (32, 56, 1, 56)),
                                         ((32, 128, 56, 56), 51, torch.float32, (16, 56, 1, 28)),
                                         ((32, 128, 56, 56), 13, torch.float32, (32, 56, 1, 56)),
                                         ((32, 128, 112, 112), 31, torch.float32, (16, 112, 1, 56)),
                                         ((32, 128, 56, 56), 31, torch.bfloat16, (16, 56, 1, 28)),
                                         ((32, 128, 56, 56), 9, torch.float32, (16, 56, 1, 28)),
                                         ((32, 256, 28, 28), 13, torch.float32, (32, 28, 1, 28))]:
        x = torch.empty(shape, device="meta", dtype=dtype)
        geom = conv_geometry(x, torch.empty(shape[1], 1, kernel, kernel, device="meta", dtype=dtype), None, 1,
                             kernel // 2, 1)
        got = large_fma.large_fma_forward_blocks(geom, x)
        assert got == blocks, (shape, kernel, dtype, got)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape,kernel,stride,padding,dilation,multiplier,blocks", FMA_CASES, ids=FMA_IDS)
def test_large_fma_grad_weight(shape, kernel, stride, padding, dilation, multiplier, blocks, layout):
    """The float32 CUDA-core weight gradient (and bias gradient), one row block a program and all
    rows in one; the second bitwise the same when run again (the first's split sums are the same
    code's, in a fixed order too)."""
    x = randn(*shape).contiguous(memory_format=LAYOUTS[layout])
    weight = randn(shape[1] * multiplier, 1, *kernel)
    geom = conv_geometry(x, weight, None, stride, padding, dilation)
    grad_out = randn(*geom.output_shape).contiguous(memory_format=LAYOUTS[layout])
    ref = reference_grads(x, weight, torch.zeros(weight.shape[0]), grad_out, stride, padding, dilation)
    blocks = blocks or large_fma.large_fma_blocks(geom)
    for rows in (blocks[0], None):
        grad_w, grad_b = large_fma.large_fma_grad_weight(grad_out, x, geom, torch.float32, True, blocks, rows)
        assert_close_sum(grad_w, ref[1], x, grad_out, "grad_weight")
        assert_close_sum(grad_b, ref[2], torch.ones(()), grad_out, "grad_bias")
        if rows is None:
            again = large_fma.large_fma_grad_weight(grad_out, x, geom, torch.float32, True, blocks, rows)
            assert torch.equal(again[0], grad_w) and torch.equal(again[1], grad_b), "not deterministic"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_large_fma_dispatch(monkeypatch, layout):
    """Forward, stride-1 grad_input and weight gradient on large_fma: float32 13x13 (any layout), half
    precision 7x7 in NCHW; not half precision 13x13 (Toeplitz) nor 7x7 in channels_last (NHWC kernels)."""
    calls = []
    launch = large_fma.launch
    monkeypatch.setattr(large_fma, "launch", lambda *a: calls.append(a[0]) or launch(*a))
    on_large_fma = [large_fma.depthwise_fwd_large_fma_kernel, large_fma.depthwise_grad_weight_large_fma_kernel,
                    large_fma.depthwise_fwd_large_fma_kernel]
    x = randn(1, 2, 16, 16).contiguous(memory_format=LAYOUTS[layout])
    check_grads(x, randn(2, 1, 13, 13), randn(2), 1, 6)
    assert calls == on_large_fma, "forward, grad_weight and grad_input on large_fma"
    calls.clear()
    check_grads(x.bfloat16(), randn(2, 1, 7, 7, dtype=torch.bfloat16), None, 1, 3)
    assert calls == (on_large_fma if layout == "nchw" else []), calls
    calls.clear()
    check(randn(1, 2, 16, 16, dtype=torch.bfloat16), randn(2, 1, 13, 13, dtype=torch.bfloat16), None, 1, 6)
    assert not calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_window_shifts(dtype):
    """Every offset of the strips' first column past a load vector (left padding 0-7), 32-column
    strips of a 31-wide kernel: the window must hold offset + 62 columns (a window one column short
    reads zeros for the last tap's input; the loads narrow to keep it 64 wide where they must)."""
    x = randn(1, 2, 4, 64, dtype=dtype)
    weight = randn(2, 1, 4, 31, dtype=dtype)
    for pad_left in range(8):
        padding = (1, pad_left)
        check(x, weight, None, 1, padding, 1, config=ForwardConfig("toeplitz", 16, 32, 4))
        geom = conv_geometry(x, weight, None, 1, padding, 1)
        grad_out = randn(*geom.output_shape, dtype=dtype)
        grad_w, _ = toeplitz.toeplitz_grad_weight(grad_out, x, geom, dtype, False, block_m=16, block_w=32)
        x64, w64 = x.double(), weight.double().requires_grad_()
        torch.nn.functional.conv2d(x64, w64, None, 1, padding, 1, 2).backward(grad_out.double())
        torch.testing.assert_close(grad_w.double(), w64.grad, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                                   atol=2e-1 if dtype == torch.bfloat16 else 1e-3, msg=lambda m: f"pad_left {pad_left}: {m}")


def test_grad_weight_splits_and_determinism():
    """Several row splits a channel (partial sums added in a fixed order): right, and bitwise the same twice."""
    x = randn(3, 2, 23, 21)
    weight = randn(2, 1, 11, 11)
    geom = conv_geometry(x, weight, None, 1, 5, 1)
    grad_out = randn(*geom.output_shape)
    checked = check_grads(x, weight, None, 1, 5)[1]  # (the default split, against float64)
    first = toeplitz.toeplitz_grad_weight(grad_out, x, geom, x.dtype, True, block_m=16, rows_per_split=16)
    again = toeplitz.toeplitz_grad_weight(grad_out, x, geom, x.dtype, True, block_m=16, rows_per_split=16)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert checked.shape == first[0].shape
    reference = toeplitz.toeplitz_grad_weight(grad_out, x, geom, x.dtype, True)
    torch.testing.assert_close(first[0], reference[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(first[1], grad_out.sum(dim=(0, 2, 3)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape,block_m,rows", [((3, 2, 23, 21), 16, 48), ((5, 2, 7, 21), 16, 32)],
                         ids=["blocks-within-images", "blocks-over-images"])
def test_grad_weight_row_steps(shape, block_m, rows):
    """A program's row blocks step through the images by offsets (no division a row): 16-row blocks
    over 23-row images (every step wraps into the next image at another row, one lands on a row
    start exactly), and over 7-row images (a block spans images)."""
    x = randn(*shape)
    weight = randn(2, 1, 11, 11)
    geom = conv_geometry(x, weight, None, 1, 5, 1)
    grad_out = randn(*geom.output_shape)
    grad_w, grad_b = toeplitz.toeplitz_grad_weight(grad_out, x, geom, x.dtype, True, block_m=block_m,
                                                   rows_per_split=rows)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    torch.nn.functional.conv2d(x64, w64, None, 1, 5, 1, 2).backward(grad_out.double())
    assert_close(grad_w, w64.grad, torch.float32, "grad_weight")
    assert_close(grad_b, grad_out.double().sum(dim=(0, 2, 3)), torch.float32, "grad_bias")


def test_grad_weight_rows():
    """At most 1024 rows a program, fewer where the channels' strips leave under 512 programs."""
    assert toeplitz.rows_a_program(32 * 56, 128 * 2) == 896  # k31: 2 splits, 512 programs
    assert toeplitz.rows_a_program(32 * 56, 128) == 448  # k51 half precision: 4 splits
    assert toeplitz.rows_a_program(256 * 56, 128) == 1024  # (many rows: the 1024 cap)
    assert toeplitz.rows_a_program(10, 4096) == 10  # (more strips than wanted programs: one split)


def test_dispatch_by_taps():
    """large_fma from LARGE_FMA_WIDE_MIN_TAPS taps on (half precision below LARGE_FMA_HALF_MAX_TAPS; below
    TOEPLITZ_MIN_TAPS NCHW only), and from LARGE_FMA_MIN_TAPS (3x3) on planes no wider than
    LARGE_FMA_SMALL_KERNEL_MAX_WIDTH; Toeplitz from TOEPLITZ_MIN_TAPS on where large_fma does not
    apply (column strides); float64 and small kernels on wide planes on neither."""
    x, wide = randn(1, 2, 16, 16), randn(1, 2, 4, 64)
    small, mid, large = randn(2, 1, 3, 3), randn(2, 1, 7, 7), randn(2, 1, 10, 11)
    assert 3 * 3 < tuned().large_fma_wide_min_taps <= 5 * 5 and 9 * 9 < tuned().toeplitz_min_taps <= 10 * 11
    assert 11 * 11 < tuned().large_fma_half_max_taps <= 13 * 13
    assert 28 <= tuned().large_fma_small_kernel_max_width < 56 and tuned().large_fma_min_taps == 9
    channels_last = x.contiguous(memory_format=torch.channels_last)

    def kernel(x, weight, stride=1):
        return forward_config(conv_geometry(x, weight, None, stride, weight.shape[-1] // 2, 1), x).kernel

    assert kernel(x, small) == kernel(x.half(), small.half()) == kernel(randn(1, 2, 7, 7), small) == "large_fma"
    assert kernel(wide, small) not in ("large_fma", "toeplitz")  # (a row wider than 28)
    # half precision: forwards up to LARGE_FMA_HALF_FORWARD_MAX_WIDTH, gradients up to 28
    half_wide = randn(1, 2, 4, 40, dtype=torch.bfloat16)
    assert 40 <= tuned().large_fma_half_forward_max_width < 64
    geom = conv_geometry(half_wide, small.bfloat16(), None, 1, 1, 1)
    assert forward_config(geom, half_wide).kernel == "large_fma"
    assert forward_config(geom, half_wide, backward=True).kernel not in ("large_fma", "toeplitz")
    assert kernel(randn(1, 2, 4, 40), small) not in ("large_fma", "toeplitz")  # (float32)
    assert kernel(randn(1, 2, 4, 64, dtype=torch.bfloat16), small.bfloat16()) not in ("large_fma", "toeplitz")
    assert kernel(x, randn(2, 1, 1, 3)) not in ("large_fma", "toeplitz")  # (fewer than 9 taps: not timed)
    assert kernel(channels_last, small) not in ("large_fma", "toeplitz")
    # column stride 2 below TOEPLITZ_MIN_TAPS on planes no wider than the limits (input width);
    # stride 3 and column dilations stay off
    assert kernel(x, small, (1, 2)) == kernel(x, mid, 2) == "large_fma"
    assert kernel(randn(1, 2, 4, 40), mid, 2) not in ("large_fma", "toeplitz")  # (float32, 40 wide)
    assert kernel(x, small, (1, 3)) not in ("large_fma", "toeplitz")
    assert forward_config(conv_geometry(x, small, None, 1, 2, (1, 2)), x).kernel not in ("large_fma", "toeplitz")
    assert kernel(wide, mid) == kernel(x.bfloat16(), mid.bfloat16()) == kernel(randn(1, 2, 7, 7), mid) == "large_fma"
    assert kernel(channels_last, mid) not in ("large_fma", "toeplitz")
    assert kernel(x, large) == kernel(channels_last, large) == kernel(x.half(), large.half()) == "large_fma"
    assert kernel(x, large, (1, 2)) == kernel(x.bfloat16(), randn(2, 1, 13, 13, dtype=torch.bfloat16)) == "toeplitz"
    x64, large64 = x.double(), large.double()
    assert not dispatch.toeplitz_applies(conv_geometry(x64, large64, None, 1, 4, 1), torch.float64)
    check(x64, large64, None, 1, 4)  # (the CUDA-core kernels)
    # past MAX_BAND_TAPS the tile kernel loops over the kernel rows, one output row a program
    check(randn(1, 2, 9, 9, dtype=torch.float64), randn(2, 1, 17, 17, dtype=torch.float64), None, 1, 8)


def relative_error(got, ref):
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", DTYPES if DEVICE == "cuda" else [torch.float32], ids=str)
def test_accuracy_against_pytorch(dtype):
    """The large kernels' accuracy rule on a 51x51 kernel (2601-term sums): float32 within 1e-4 of the
    largest float64 value (and within twice PyTorch's error, or 4e-6); half precision within twice PyTorch's own error (or one unit of the
    dtype's rounding, when PyTorch's error is smaller), output and both gradients. (On the CPU the
    interpreter's products and PyTorch's half-precision convolution are not the GPU's: float32 only.)"""
    # (one channel: each output is still a 2601-term sum, and the interpreter's time is per channel;
    # several channels are every other test's)
    channels = 2 if DEVICE == "cuda" else 1
    x = randn(1, channels, 60, 60, dtype=dtype).requires_grad_()
    weight = (randn(channels, 1, 51, 51, dtype=dtype) / 51).requires_grad_()
    grad_out = randn(1, channels, 60, 60, dtype=dtype)
    x64, weight64 = x.detach().double().cpu().requires_grad_(), weight.detach().double().cpu().requires_grad_()
    ref = torch.nn.functional.conv2d(x64, weight64, None, 1, 25, 1, channels)
    ref_grads = torch.autograd.grad(ref, (x64, weight64), grad_out.double().cpu())
    results = {}
    for name, conv in (("dwconv", dwconv.depthwise_conv2d),
                       ("torch", lambda *args: torch.nn.functional.conv2d(*args, groups=channels))):
        out = conv(x, weight, None, 1, 25)
        grads = torch.autograd.grad(out, (x, weight), grad_out)
        results[name] = [relative_error(t, r) for t, r in zip((out, *grads), (ref, *ref_grads))]
    for what, ours, theirs in zip(("output", "grad_input", "grad_weight"), results["dwconv"], results["torch"]):
        # float32: 1e-4, and PyTorch's own error as for half precision (the tensor
        # cores' truncating accumulation once gave 2.1e-5 on the H200's k51 layer against 2.3e-6)
        floor = 4e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
        bound = min(1e-4, max(2 * theirs, floor)) if dtype == torch.float32 else max(2 * theirs, floor)
        assert ours <= bound, f"{what}: relative error {ours:.2e} (PyTorch's {theirs:.2e}), bound {bound:.2e}"


@pytest.mark.skipif(DEVICE != "cuda", reason="real sizes on the GPU only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_sizes(dtype):
    """The large suite's k31 layer at full size, forward and gradients, against float64 on the GPU."""
    x = randn(4, 16, 56, 56, dtype=dtype)
    weight = randn(16, 1, 31, 31, dtype=dtype) / 31
    check_grads(x, weight, randn(16, dtype=dtype), 1, 15)
    out = dwconv.depthwise_conv2d(x, weight, None, 1, 15)
    assert out.shape == x.shape
