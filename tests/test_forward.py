"""Forward values of dwconv against a float64 F.conv2d reference, over the parameter grid.

On a machine without CUDA these run the Triton kernels under TRITON_INTERPRET=1 on CPU
tensors (conftest.py); with CUDA they run the compiled kernels on the GPU.
"""

import pytest
import torch

import dwconv
from dwconv._geometry import conv_geometry
from dwconv.dispatch import ForwardConfig, _forward_plan, conv_forward, forward_config, launch_forward
from dwconv.kernels._shared import odd_rows_alignable, output_memory_format
from dwconv.kernels.tile import NHWC_KERNELS
from helpers import CONV_OPTIONS as OPTIONS, DEVICE, DTYPES, assert_close, poisoned, randn, reference_conv

KERNELS = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (7, 7), (1, 3), (3, 1), (5, 3)]


def run_kernel(x, weight, bias, stride, padding, dilation, config=None):
    """Launches the forward kernel into a NaN-poisoned output and returns it."""
    geom = conv_geometry(x, weight, bias, stride, padding, dilation)
    out = poisoned(geom.output_shape, x.dtype, memory_format=output_memory_format(x))
    return conv_forward(x, weight, bias, geom, config=config, out=out)


def check(x, weight, bias, stride=1, padding=0, dilation=1, config=None):
    out = run_kernel(x, weight, bias, stride, padding, dilation, config)
    assert out.dtype == x.dtype
    if x.shape[1] > 1 and x.stride(1) == 1 and not x.is_contiguous():  # channels_last in, channels_last out
        assert out.is_contiguous(memory_format=torch.channels_last), "output lost the channels_last layout"
    ref = reference_conv(x, weight, bias, stride, padding, dilation)
    assert_close(out, ref, x.dtype)
    return out


def in_layout(x, layout):
    """x in the layout a test runs: "nchw" (contiguous) or "channels_last" (the NHWC kernels)."""
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


LAYOUTS = ["nchw", "channels_last"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"k{k[0]}x{k[1]}")
@pytest.mark.parametrize("stride,padding,dilation", OPTIONS, ids=str)
def test_geometry_grid(kernel, stride, padding, dilation, layout):
    x = in_layout(randn(2, 3, 17, 13), layout)
    weight = randn(6, 1, *kernel)  # multiplier 2
    bias = randn(6)
    try:
        reference_conv(x, weight, bias, stride, padding, dilation)
    except RuntimeError:  # PyTorch refuses (kernel larger than the padded input): so must we
        with pytest.raises(ValueError, match="larger than the padded input"):
            dwconv.depthwise_conv2d(x, weight, bias, stride, padding, dilation)
        return
    check(x, weight, bias, stride, padding, dilation)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("multiplier", [1, 2])
@pytest.mark.parametrize("kernel,padding", [(3, 1), (5, 0), (4, "same")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dtypes_bias_multiplier(dtype, has_bias, multiplier, kernel, padding, layout):
    x = in_layout(randn(2, 3, 11, 19, dtype=dtype), layout)
    weight = randn(3 * multiplier, 1, kernel, kernel, dtype=dtype)
    bias = randn(3 * multiplier, dtype=dtype) if has_bias else None
    check(x, weight, bias, 1, padding)


@pytest.mark.parametrize(
    "shape,kernel,padding",
    [
        ((1, 1, 1, 1), 1, 0),  # a 1x1 image
        ((2, 3, 1, 1), 3, 1),  # a 1x1 image seen only through padding
        ((1, 2, 1, 7), (1, 3), 0),
        ((3, 5, 2, 31), 2, 0),
        ((1, 7, 23, 29), 3, 1),  # primes
        ((2, 1, 37, 5), 5, 2),
        ((1, 2, 3, 67), 3, (0, 1)),  # wider than one 32/64-column block
    ],
    ids=str,
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_odd_and_tiny_sizes(shape, kernel, padding, layout):
    x = in_layout(randn(*shape), layout)
    k = (kernel, kernel) if isinstance(kernel, int) else kernel
    weight = randn(shape[1], 1, *k)
    check(x, weight, randn(shape[1]), 1, padding)


@pytest.mark.parametrize("layout", ["channels_last", "sliced", "transposed_hw", "expanded_batch"])
def test_strided_inputs(layout):
    base = randn(2, 4, 13, 15)
    if layout == "channels_last":
        x = base.contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        x = randn(3, 9, 20, 31)[1:, ::2, 3:16, 1::2]
    elif layout == "transposed_hw":
        x = base.transpose(2, 3)
    else:
        x = randn(1, 4, 13, 15).expand(3, 4, 13, 15)
    weight = randn(x.shape[1] * 2, 1, 3, 3)
    out = check(x, weight, randn(x.shape[1] * 2), 1, 1)
    if layout == "channels_last":
        assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    "kernel,padding,dilation,stride_w,block_h,block_w",
    [
        ((3, 3), 0, 1, 1, 5, 16),  # chunks of 5 rows, two column strips
        ((3, 3), 1, 1, 1, 4, 32),
        ((5, 3), (2, 1), 1, 2, 3, 8),
        ((3, 3), 2, 2, 1, 7, 16),  # dilation: ring of 8 slots
        ((7, 7), 3, 1, 1, 32, 32),
        ((1, 1), 0, 1, 1, 6, 16),
        ((2, 4), "same", 1, 1, 4, 16),
    ],
    ids=str,
)
def test_row_sliding_kernel(kernel, padding, dilation, stride_w, block_h, block_w):
    """The row-sliding kernel (stride_h == 1) with chunks and strips smaller than the plane
    (one input channel, multiplier 2: the interpreter's time goes by programs)."""
    x = randn(1, 1, 19, 21)
    weight = randn(2, 1, *kernel)
    config = ForwardConfig("rows", block_h, block_w, 4)
    check(x, weight, randn(2), (1, stride_w), padding, dilation, config=config)


@pytest.mark.parametrize("vec", [4, 8])
@pytest.mark.parametrize(
    "width,kernel,padding,dilation,block_w",
    [
        (24, (3, 3), 0, 1, 16),  # rows of whole vectors: aligned loads and stores
        (21, (3, 3), 1, 1, 32),  # odd width: unaligned rows, window starts left of the row
        (24, (5, 3), (2, 1), 1, 64),
        (23, (3, 3), 2, 2, 16),  # dilation: wider window, ring of 8 slots
        (22, (2, 4), "same", 1, 16),  # asymmetric padding
        (21, (3, 7), 3, 1, 32),  # a window of three vectors (VEC 4) or two (VEC 8)
    ],
    ids=str,
)
def test_row_sliding_window(vec, width, kernel, padding, dilation, block_w):
    """The rows kernel with VEC-wide windows: shifted views built in registers from vector loads."""
    x = randn(1, 1, 11, width)
    weight = randn(2, 1, *kernel)  # (multiplier 2)
    config = ForwardConfig("rows", 5, block_w, 1, vec)
    check(x, weight, randn(2), 1, padding, dilation, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_row_sliding_window_half(dtype):
    x = randn(1, 2, 6, 40, dtype=dtype)[:, :, :, 3:]  # a sliced view: unaligned rows
    weight = randn(2, 1, 3, 3, dtype=dtype)
    check(x, weight, None, 1, 1, config=ForwardConfig("rows", 4, 32, 1, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,kernel,padding,dilation",
    [
        ((2, 2, 10, 22), (3, 3), 0, 1),
        ((1, 3, 8, 30), (3, 3), 1, 1),  # odd top padding: odd rows are the even padded rows
        ((1, 2, 12, 26), (3, 3), (2, 1), 1),
        ((1, 2, 10, 22), (3, 3), 2, 2),
        ((1, 2, 8, 22), (2, 4), "same", 1),
    ],
    ids=str,
)
def test_row_sliding_window_odd_rows(dtype, shape, kernel, padding, dilation):
    """Rows of 2 mod 4 elements (even height): odd rows' windows start 2 elements early, aligned."""
    x = randn(*shape, dtype=dtype)
    weight = randn(shape[1], 1, *kernel, dtype=dtype)
    assert odd_rows_alignable(x, conv_geometry(x, weight, None, 1, padding, dilation))
    check(x, weight, randn(shape[1], dtype=dtype), 1, padding, dilation, config=ForwardConfig("rows", 5, 16, 1, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,kernel,padding,dilation,block_w",
    [
        ((2, 1, 10, 24), (3, 3), 0, 1, 16),  # kb84's case: 22-wide output rows, two column strips
        ((1, 2, 12, 28), (3, 7), (1, 0), 1, 32),  # a window of four vectors
        ((1, 1, 10, 28), (3, 3), 0, 3, 16),  # dilation: ring of 8
        ((1, 1, 8, 24), (5, 5), 1, 1, 8),  # padding: the window starts left of the row
    ],
    ids=str,
)
def test_row_sliding_odd_output_rows(dtype, shape, kernel, padding, dilation, block_w):
    """Output rows of 2 mod 4 elements (even height): odd rows are computed 2 columns to the left
    and stored as aligned vectors, with pairs at the row ends."""
    x = randn(*shape, dtype=dtype)
    weight = randn(shape[1], 1, *kernel, dtype=dtype)
    geom = conv_geometry(x, weight, None, 1, padding, dilation)
    config = ForwardConfig("rows", 5, block_w, 1, 4)
    plan = _forward_plan(geom, config, x, poisoned(geom.output_shape, dtype), True, None)
    assert plan.constants["ODD_OUT_ALIGN"] == 1, "the aligned odd-row stores are not in use"
    check(x, weight, randn(shape[1], dtype=dtype), 1, padding, dilation, config=config)


def test_default_config_is_valid():
    x = randn(1, 2, 9, 9)
    geom = conv_geometry(x, randn(2, 1, 3, 3), None, 2, 1, 1)
    assert forward_config(geom, x).kernel == "pairs"
    geom = conv_geometry(x, randn(2, 1, 3, 3), None, (2, 3), 1, 1)
    assert forward_config(geom, x).kernel == "tile"


def test_nchw_3x3_dispatch_on_the_gpu(retune):
    """The GPU's NCHW 3x3 stride-1 choices (measured, docs/decisions.md): "nchw_pixels" in float32, and
    in half precision on rows over 256 wide (16 rows a program there, 8 in float32); the rows
    kernel for narrower half-precision rows; dilation leaves "nchw_pixels"."""
    retune(plan_as_gpu=True)  # (the GPU's plans for tensors without one)

    def config(shape, dtype, padding=0, dilation=1):
        x = torch.empty(shape, dtype=dtype, device="meta")
        weight = torch.empty(shape[1], 1, 3, 3, dtype=dtype, device="meta")
        chosen = forward_config(conv_geometry(x, weight, None, 1, padding, dilation), x)
        return chosen.kernel, chosen.block_h, chosen.block_w

    kb84 = (64, 128, 256, 512)
    assert config(kb84, torch.float32) == ("nchw_pixels", 8, 512)
    for half in (torch.float16, torch.bfloat16):
        assert config(kb84, half) == ("nchw_pixels", 16, 512)
        assert config((64, 144, 56, 56), half, 1)[0] == "rows"
    assert config((64, 144, 56, 56), torch.float32, 1) == ("nchw_pixels", 8, 128)
    assert config((32, 256, 64, 64), torch.float32, 2, 2)[0] != "nchw_pixels"


def test_channels_last_takes_the_nhwc_kernel():
    """Only tensors with unit channel strides on both sides go to an NHWC kernel (the band kernel
    under the interpreter, the unrolled-pixels one on the GPU)."""
    x = randn(2, 5, 9, 9).contiguous(memory_format=torch.channels_last)
    geom = conv_geometry(x, randn(5, 1, 3, 3), None, 1, 1, 1)
    assert forward_config(geom, x).kernel == ("nhwc_pixels" if DEVICE == "cuda" else "nhwc")
    assert forward_config(geom, x, torch.empty(geom.output_shape, device=DEVICE)).kernel not in NHWC_KERNELS
    assert forward_config(geom, x.contiguous()).kernel not in NHWC_KERNELS
    one_channel = randn(2, 1, 9, 9).contiguous(memory_format=torch.channels_last)
    assert forward_config(conv_geometry(one_channel, randn(1, 1, 3, 3), None), one_channel).kernel not in NHWC_KERNELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,kernel,multiplier,padding,dilation,block",
    [
        ((1, 2, 9, 14), (3, 3), 1, 0, 1, (4, 8)),  # interior and edge tiles, 16-byte output rows
        ((1, 2, 6, 16), (3, 3), 1, 0, 1, (4, 8)),  # output rows of 14: stored as pairs
        ((2, 2, 8, 10), (3, 3), 2, 1, 1, (4, 8)),  # padding, multiplier 2
        ((1, 2, 11, 13), (5, 3), 1, (2, 1), 2, (3, 8)),  # dilation 2, a window of three vectors
        ((1, 1, 7, 7), (7, 7), 1, 3, 1, (4, 4)),  # k7 on an image smaller than the window
        ((1, 2, 10, 139), (3, 3), 1, 1, 1, (8, 128)),  # the GPU's float32 choice (nchw_pixels_wins), odd rows
        ((1, 2, 10, 302), (3, 3), 1, 0, 1, (8, 512)),  # its choice for rows over 256: whole rows, 300 of 512
        ((1, 1, 20, 30), (3, 7), 1, 0, (1, 2), (2, 8)),  # 18-wide rows whose window leaves no room for odd-row shifts
    ],
    ids=str,
)
def test_nchw_pixels(dtype, shape, kernel, multiplier, padding, dilation, block):
    """NCHW with each output one FMA chain over lanes of aligned window vectors ("nchw_pixels")."""
    x = randn(*shape, dtype=dtype)
    weight = randn(shape[1] * multiplier, 1, *kernel, dtype=dtype)
    check(x, weight, randn(shape[1] * multiplier, dtype=dtype), 1, padding, dilation,
          config=ForwardConfig("nchw_pixels", block[0], block[1], 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,kernel,padding,dilation,block",
    [
        ((1, 2, 10, 512), (3, 3), 0, 1, (8, 512)),  # kb84's rows: 510 of a 512-wide tile
        ((2, 1, 10, 24), (3, 3), 0, 1, (4, 8)),  # 22-wide rows, three column tiles, two row tiles
        ((1, 2, 12, 26), (3, 3), 0, 2, (4, 16)),  # dilation 2
        ((1, 1, 8, 22), (5, 5), 2, 1, (2, 8)),  # padding: the window starts left of the row
    ],
    ids=str,
)
def test_nchw_pixels_odd_output_rows(dtype, shape, kernel, padding, dilation, block):
    """"nchw_pixels" on output rows of 2 mod 4 elements (even height): odd rows are computed 2
    columns to the left and stored as aligned vectors, with pairs at the row ends."""
    x = randn(*shape, dtype=dtype)
    weight = randn(shape[1], 1, *kernel, dtype=dtype)
    geom = conv_geometry(x, weight, None, 1, padding, dilation)
    config = ForwardConfig("nchw_pixels", block[0], block[1], 1)
    plan = _forward_plan(geom, config, x, poisoned(geom.output_shape, dtype), True, None)
    assert plan.constants["ODD_OUT_ALIGN"] == 1, "the aligned odd-row stores are not in use"
    check(x, weight, randn(shape[1], dtype=dtype), 1, padding, dilation, config=config)


@pytest.mark.parametrize("taps_major", [False, True], ids=["weight-as-given", "taps-major"])
@pytest.mark.parametrize("config", [ForwardConfig("nhwc_pixels", 2, 4, 1, block_c=8),
                                    ForwardConfig("nhwc", 4, 4, 1, block_c=8)], ids=lambda c: c.kernel)
@pytest.mark.parametrize("flip", [False, True], ids=["forward", "flipped"])
def test_nhwc_weight_layouts(retune, taps_major, config, flip):
    """The channels_last kernels read the weight taps-major (a copy made per call, for large inputs)
    or as given ([C, taps], small inputs: nhwc_taps_major_min_bytes), forward and flipped, a 5x3
    kernel with a bias (and a multiplier of 2 unflipped)."""
    from dwconv.kernels import tile

    retune(nhwc_taps_major_min_bytes=0 if taps_major else 1 << 60)
    multiplier = 1 if flip else 2
    x = randn(2, 3, 11, 16).contiguous(memory_format=torch.channels_last)
    weight, bias = randn(3 * multiplier, 1, 5, 3), randn(3 * multiplier)
    assert tile.weight_taps_major(config.kernel, x) == taps_major
    geom = conv_geometry(x, weight, bias, 1, (2, 1), 1)
    out = poisoned(geom.output_shape, x.dtype, memory_format=torch.channels_last)
    out, _ = launch_forward(x, weight, bias, geom, config, out=out, flip_weight=flip)
    assert_close(out, reference_conv(x, weight.flip(2, 3) if flip else weight, bias, 1, (2, 1), 1), x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,kernel,multiplier,stride,padding,dilation,block",
    [
        ((1, 2, 9, 14), (3, 3), 1, 2, 1, 1, (4, 8)),  # MobileNet's strided 3x3: two pair loads a row
        ((2, 2, 11, 17), (3, 3), 2, (1, 2), 1, 1, (4, 8)),  # odd rows (pairs not vector-aligned), multiplier 2
        ((1, 2, 12, 20), (5, 4), 1, (3, 2), (2, 3), (2, 1), (2, 8)),  # row dilation, padding 3: pairs -2 .. 0
        ((1, 1, 6, 40), (1, 7), 1, (1, 2), (0, 3), 1, (8, 16)),  # pairs -2 .. 1, two column tiles
        ((1, 2, 5, 6), (3, 3), 1, 2, 0, 1, (4, 4)),  # no padding, a tile past the image
    ],
    ids=str,
)
def test_pairs(dtype, shape, kernel, multiplier, stride, padding, dilation, block):
    """Column stride 2 from split pairs ("pairs"), and with the taps read in reverse (flip_weight)."""
    x = randn(*shape, dtype=dtype)
    weight = randn(shape[1] * multiplier, 1, *kernel, dtype=dtype)
    config = ForwardConfig("pairs", block[0], block[1], 1)
    check(x, weight, randn(shape[1] * multiplier, dtype=dtype), stride, padding, dilation, config=config)
    geom = conv_geometry(x, weight, None, stride, padding, dilation)
    out, _ = launch_forward(x, weight, None, geom, config, out=poisoned(geom.output_shape, x.dtype), flip_weight=True)
    assert_close(out, reference_conv(x, weight.flip(2, 3), None, stride, padding, dilation), x.dtype)


def test_pairs_dispatch():
    """NCHW column stride 2 with 3x3 takes "pairs" (on inputs over 28 wide: large_fma below, whose rule
    this module's fixture turns off), float32 and bfloat16; a 5x5 kernel does not; a channels_last
    input keeps the NHWC kernels."""
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(2, 3, 10, 37, dtype=dtype)
        weight = randn(3, 1, 3, 3, dtype=dtype)
        geom = conv_geometry(x, weight, None, 2, 1, 1)
        assert forward_config(geom, x).kernel == "pairs"
        check(x, weight, None, 2, 1, 1)
        assert forward_config(geom, x.contiguous(memory_format=torch.channels_last)).kernel in NHWC_KERNELS
        k5 = randn(3, 1, 5, 5, dtype=dtype)
        assert forward_config(conv_geometry(x, k5, None, 2, 2, 1), x).kernel != "pairs"


@pytest.mark.parametrize(
    "config,layout",
    [
        (ForwardConfig("rows", 8, 16, 1, 4), "nchw"),
        (ForwardConfig("rows", 8, 16, 1), "nchw"),
        (ForwardConfig("nchw_pixels", 4, 8, 1), "nchw"),
        (ForwardConfig("tile", 4, 8, 1), "nchw"),
        (ForwardConfig("nhwc_pixels", 2, 4, 1, block_c=8), "channels_last"),
        (ForwardConfig("nhwc", 4, 4, 1, block_c=8), "channels_last"),
        (ForwardConfig("toeplitz", 16, 16, 4), "nchw"),  # (its band rows gathered in reverse)
    ],
    ids=lambda v: v.kernel + (f"-vec{v.vec}" if getattr(v, "vec", 1) > 1 else "") if isinstance(v, ForwardConfig) else v,
)
def test_flipped_taps(config, layout):
    """flip_weight (grad_input's convolution): every kernel reads the taps in reverse, in place of a
    flipped copy; a 5x3 kernel, so that a flip along either axis alone, or none, fails."""
    x = in_layout(randn(2, 3, 11, 16), layout)
    weight = randn(3, 1, 5, 3)
    geom = conv_geometry(x, weight, None, 1, (2, 1), 1)
    out = poisoned(geom.output_shape, x.dtype, memory_format=output_memory_format(x))
    out, _ = launch_forward(x, weight, None, geom, config, out=out, flip_weight=True)
    assert_close(out, reference_conv(x, weight.flip(2, 3), None, 1, (2, 1), 1), x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,kernel,multiplier,stride,padding,dilation,block",
    [
        ((2, 8, 11, 13), (3, 3), 1, 1, 1, 1, (4, 8, 8)),  # kb84's kernel: interior and edge strips
        ((1, 6, 9, 10), (3, 3), 1, 1, 0, 1, (3, 4, 8)),  # no padding, channels not a block multiple
        ((1, 4, 12, 11), (5, 3), 2, 2, (2, 1), 1, (2, 4, 8)),  # stride 2 both ways, multiplier 2
        ((1, 4, 13, 14), (3, 3), 1, 1, 2, 2, (2, 4, 4)),  # dilation 2
        ((1, 3, 7, 9), (7, 7), 1, (1, 2), 3, 1, (2, 2, 4)),  # k7, strides (1, 2)
        ((2, 5, 1, 2), (3, 3), 1, 1, 1, 1, (2, 2, 4)),  # a 1 x 2 image
        ((1, 64, 7, 9), (3, 3), 1, 1, 1, 1, (2, 4, 64)),  # a channel pair a thread: bfloat16 pair loads
    ],
    ids=str,
)
def test_nhwc_pixels(dtype, shape, kernel, multiplier, stride, padding, dilation, block):
    """The channels_last tile kernel with its columns unrolled ("nhwc_pixels"): every pixel loaded once
    a band, bounds tests per pixel on the edge strips."""
    x = randn(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = randn(shape[1] * multiplier, 1, *kernel, dtype=dtype)
    block_h, block_w, block_c = block
    geom = conv_geometry(x, weight, None, stride, padding, dilation)
    config = ForwardConfig("nhwc_pixels", block_h, block_w, 1, block_c=block_c)
    plan = _forward_plan(geom, config, x, poisoned(geom.output_shape, dtype, memory_format=torch.channels_last),
                         True, None)
    assert plan.constants["PIXELS"]
    # bfloat16 channel pairs as 32-bit words where every pair is aligned and in one channel pair
    assert plan.constants["BF16_PAIRS"] == (dtype == torch.bfloat16 and multiplier == 1 and block_c == 64)
    check(x, weight, randn(shape[1] * multiplier, dtype=dtype), stride, padding, dilation, config=config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,kernel,stride,padding,dilation",
    [
        ((1, 128, 6, 11), 3, 1, 0, 1),  # kb84's kind: 128 channels on 2 warps, bfloat16 pairs on both
        ((1, 144, 5, 9), 3, 2, 1, 1),  # 32-channel strips, the last one masked
        ((1, 48, 7, 6), 5, 1, 2, 1),  # as 240 on the GPU: float32 16-channel strips, half 32 (one masked)
        ((1, 96, 6, 7), 7, 1, 3, 1),  # 7 wide: 2 x 7 outputs (4 x 4 where 7 does not divide the width)
        ((1, 64, 9, 9), 3, 1, 2, 2),  # dilation 2
        # 7 columns a tile where 7 divides the output's width and the default's width does not
        ((1, 64, 9, 21), 3, 1, 1, 1),  # 3 tiles a row, the middle one of the middle rows interior
        ((1, 32, 17, 28), 3, 2, 1, 1),  # stride 2 (14 wide), an interior tile
        ((1, 32, 9, 14), 5, 1, 2, 1),
        ((1, 48, 7, 7), 7, 1, 3, 1),
    ],
    ids=str,
)
def test_nhwc_pixels_gpu_choice(dtype, shape, kernel, stride, padding, dilation):
    """The blocks nhwc_config picks on the GPU (nhwc_pixels_config), run here under the interpreter."""
    from dwconv.kernels.tile import nhwc_pixels_blocks as nhwc_pixels_config

    x = randn(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = randn(shape[1], 1, kernel, kernel, dtype=dtype)
    geom = conv_geometry(x, weight, None, stride, padding, dilation)
    config = nhwc_pixels_config(geom, x)
    assert (config.block_w == 7) == (geom.out_w % 7 == 0 and geom.out_w % (8 if kernel == 3 else 4) != 0), config
    check(x, weight, randn(shape[1], dtype=dtype), stride, padding, dilation, config=config)


def test_has_interior_tile_matches_every_tile():
    """ConvGeometry.has_interior_tile (the tile kernels' INTERIOR_TILES: without it only the masked
    branch is compiled) against the kernels' own interior test on every tile, over random geometries."""
    gen = torch.Generator().manual_seed(31)
    draws = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=gen))  # noqa: E731
    seen = set()
    for _ in range(400):
        kernel, dilation, stride = (draws(1, 7), draws(1, 7)), (draws(1, 2), draws(1, 2)), (draws(1, 2), draws(1, 2))
        size, padding = (draws(1, 20), draws(1, 20)), (draws(0, 3), draws(0, 3))
        if any((k - 1) * d + 1 > s + 2 * p for k, d, s, p in zip(kernel, dilation, size, padding)):
            continue
        channels, block_c = draws(1, 40), 2 ** draws(0, 5)
        block_h, block_w = draws(1, 5), draws(1, 8)
        x, weight = torch.empty(1, channels, *size, device="meta"), torch.empty(channels, 1, *kernel, device="meta")
        geom = conv_geometry(x, weight, None, stride, padding, dilation)

        def inside(first, block, stride, pad, kernel, dilation, outputs, inputs):
            return (first + block <= outputs and first * stride - pad >= 0
                    and (first + block - 1) * stride - pad + (kernel - 1) * dilation < inputs)
        expected = block_c <= channels and any(
            inside(r, block_h, geom.stride_h, geom.pad_top, geom.kernel_h, geom.dilation_h, geom.out_h, geom.in_h)
            for r in range(0, geom.out_h, block_h)) and any(
            inside(c, block_w, geom.stride_w, geom.pad_left, geom.kernel_w, geom.dilation_w, geom.out_w, geom.in_w)
            for c in range(0, geom.out_w, block_w))
        assert geom.has_interior_tile(block_h, block_w, block_c) == expected, (geom, block_h, block_w, block_c)
        seen.add(expected)
    assert seen == {True, False}


def test_nhwc_pixels_candidate_blocks_fit():
    """nhwc_pixels_config's blocks (the GPU's channels_last choice) make valid plans for the suite's
    layers (the models suite's layers, kb84) in both dtypes, with bfloat16 pair loads wherever a warp holds 64
    channels that divide the channel count."""
    from dwconv.bench import MODEL_LAYERS
    from dwconv.kernels.tile import nhwc_pixels_blocks as nhwc_pixels_config

    for case in MODEL_LAYERS:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.empty(1, case.c, case.h, case.w, dtype=dtype).contiguous(memory_format=torch.channels_last)
            weight = torch.empty(case.c, 1, case.kernel, case.kernel, dtype=dtype)
            geom = conv_geometry(x, weight, None, case.stride, case.padding, case.dilation)
            if geom.kernel_h * geom.kernel_w >= 100:
                continue
            out = torch.empty(geom.output_shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
            config = nhwc_pixels_config(geom, x)
            plan = _forward_plan(geom, config, x, out, False, None)
            assert plan.constants["PIXELS"]
            pairs = config.block_c == 64 * config.num_warps and case.c % config.block_c == 0
            assert plan.constants["BF16_PAIRS"] == (dtype == torch.bfloat16 and pairs), case


@pytest.mark.parametrize("dtype,block_c", [(torch.float32, 16), (torch.bfloat16, 32), (torch.float16, 32)], ids=str)
def test_nhwc_pixels_channel_block_of_runs_of_16(dtype, block_c):
    """5x5 on 240 channels (EfficientNet-B0): float32 in 16-channel blocks, half precision in 32 with
    the last block masked (bfloat16 0.039 ms against 0.067 with 16 on the H200)."""
    from dwconv.kernels.tile import nhwc_pixels_blocks as nhwc_pixels_config

    x = torch.empty(1, 240, 28, 28, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.empty(240, 1, 5, 5, dtype=dtype)
    assert nhwc_pixels_config(conv_geometry(x, weight, None, 1, 2, 1), x).block_c == block_c


def test_nhwc_pixels_bfloat16_pairs_need_alignment():
    """Channels sliced from an odd channel start 2 bytes off a word: no pair loads, right values."""
    x = randn(2, 65, 8, 10, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)[:, 1:]
    weight = randn(64, 1, 3, 3, dtype=torch.bfloat16)
    geom = conv_geometry(x, weight, None, 1, 1, 1)
    config = ForwardConfig("nhwc_pixels", 2, 4, 1, block_c=64)
    out = poisoned(geom.output_shape, torch.bfloat16, memory_format=torch.channels_last)
    assert not _forward_plan(geom, config, x, out, False, None).constants["BF16_PAIRS"]
    assert_close(conv_forward(x, weight, None, geom, config, out=out), reference_conv(x, weight, None, 1, 1, 1),
                 torch.bfloat16)


@pytest.mark.parametrize("out_format", [torch.contiguous_format, torch.channels_last], ids=["nchw_out", "cl_out"])
@pytest.mark.parametrize("in_format", [torch.contiguous_format, torch.channels_last], ids=["nchw_in", "cl_in"])
def test_mixed_layouts(in_format, out_format):
    """An output buffer in the other layout than the input: still the right values, in its layout."""
    x = randn(2, 6, 10, 11).contiguous(memory_format=in_format)
    weight, bias = randn(6, 1, 3, 3), randn(6)
    geom = conv_geometry(x, weight, bias, 1, 1, 1)
    out = poisoned(geom.output_shape, x.dtype, memory_format=out_format)
    conv_forward(x, weight, bias, geom, out=out)
    assert out.is_contiguous(memory_format=out_format)
    assert_close(out, reference_conv(x, weight, bias, 1, 1, 1), torch.float32)


def test_public_api_matches_reference():
    x = randn(2, 4, 12, 10)
    weight = randn(8, 1, 3, 3)
    bias = randn(8)
    out = dwconv.depthwise_conv2d(x, weight, bias, stride=(1, 2), padding="valid", dilation=1)
    assert out.device.type == x.device.type
    assert_close(out, reference_conv(x, weight, bias, (1, 2), 0, 1), torch.float32)


@pytest.mark.parametrize(
    "shape,kernel,padding",
    [((0, 3, 8, 8), 3, 1), ((0, 1, 1, 1), 1, 0), ((0, 2, 5, 7), 3, "same")],
    ids=str,
)
def test_empty_tensors(shape, kernel, padding):
    x = randn(*shape)
    weight = randn(shape[1], 1, kernel, kernel)
    out = dwconv.depthwise_conv2d(x, weight, None, 1, padding)
    ref = reference_conv(x, weight, None, 1, padding, 1)
    assert out.shape == ref.shape
    assert_close(out, ref, torch.float32)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: > 2**31 elements")
@pytest.mark.parametrize("kernel", [3, 5], ids=["k3", "k5-large_fma"])
@pytest.mark.parametrize("shape", [(1, 1, 46500, 46500), (9, 1024, 480, 488)], ids=["one_plane", "many_planes"])
def test_more_than_2_31_elements(shape, kernel):
    """64-bit offsets: inside one huge plane, and across planes past 2**31 elements ('same' padding)."""
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=torch.float16)
    assert x.numel() > 2**31
    weight = randn(shape[1], 1, kernel, kernel, dtype=torch.float16)
    pad = kernel // 2
    out = run_kernel(x, weight, None, 1, pad, 1)
    # Check the last planes / the last rows, where 32-bit offsets would have wrapped.
    if shape[0] == 1:
        # out rows H-40-pad .. H-pad-1 read input rows H-40-2pad .. H-1 (no bottom padding); the
        # last pad rows read padding
        height = shape[2]
        ref = reference_conv(x[:, :, height - 40 - 2 * pad:], weight, None, 1, (0, pad), 1)
        assert_close(out[:, :, height - 40 - pad:height - pad], ref, torch.float16)
        assert not torch.isnan(out[:, :, -pad:]).any()
    else:
        ref = reference_conv(x[-1:, -8:], weight[-8:], None, 1, pad, 1)
        assert_close(out[-1:, -8:], ref, torch.float16)
        assert not torch.isnan(out).any()
