"""Gradients of dwconv (input, weight, bias) against F.conv2d's in float64, over the parameter grid.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 on CPU tensors (conftest.py).
"""

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dwconv
from dwconv._geometry import conv_geometry
from dwconv.kernels import _launch
from dwconv.dispatch import (GradWeightConfig, conv_grad_input, conv_grad_input_and_weight, conv_grad_weight,
                                 fused_backward_applies)
from dwconv.dispatch import ForwardConfig
from helpers import CONV_OPTIONS, DEVICE, DTYPES, assert_close, poisoned, randn

KERNELS = [(1, 1), (2, 2), (3, 3), (5, 5), (1, 3), (5, 3)]
# the forward's (stride, padding, dilation) grid less two cases, plus padding wider than the
# kernel (the flipped convolution of grad_input then crops)
OPTIONS = [o for o in CONV_OPTIONS if o not in ((1, "same", 1), (2, "valid", 1))] + [(1, 4, 1)]


def reference_grads(x, weight, bias, grad_out, stride, padding, dilation):
    """F.conv2d's gradients in float64 on the CPU, from the same (rounded) inputs."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())]
    out = F.conv2d(leaves[0], leaves[1], leaves[2] if bias is not None else None, stride, padding, dilation,
                   groups=x.shape[1])
    return torch.autograd.grad(out, leaves, grad_out.detach().double().cpu())


def dwconv_grads(x, weight, bias, grad_out, stride, padding, dilation):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())]
    out = dwconv.depthwise_conv2d(leaves[0], leaves[1], leaves[2] if bias is not None else None,
                                  stride, padding, dilation)
    return torch.autograd.grad(out, leaves, grad_out)


def check_grads(x, weight, bias, stride=1, padding=0, dilation=1, grad_out_format=None):
    """grad_out in x's memory format unless grad_out_format says otherwise (mixed layouts)."""
    geom = conv_geometry(x, weight, bias, stride, padding, dilation)
    channels_last = x.shape[1] > 1 and x.stride(1) == 1 and not x.is_contiguous()
    grad_out = randn(*geom.output_shape, dtype=x.dtype).contiguous(
        memory_format=grad_out_format or (torch.channels_last if channels_last else torch.contiguous_format))
    got = dwconv_grads(x, weight, bias, grad_out, stride, padding, dilation)
    ref = reference_grads(x, weight, bias, grad_out, stride, padding, dilation)
    if channels_last:
        assert got[0].is_contiguous(memory_format=torch.channels_last), "grad_input lost the channels_last layout"
    for name, g, r in zip(("grad_input", "grad_weight", "grad_bias"), got, ref):
        assert g.dtype == x.dtype, f"{name} dtype {g.dtype}"
        # grad_weight sums N*H*W products: scale the tolerance by the sum of |terms|, not the result
        assert_close(g, r, x.dtype, name) if name == "grad_input" else assert_close_sum(g, r, x, grad_out, name)
    return got


def assert_close_sum(got, ref, x, grad_out, name):
    terms = grad_out.double().abs().sum().item() / grad_out.shape[1] * x.double().abs().max().item()
    atol, rtol = {torch.float32: (1e-6, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}[x.dtype]
    worst = (got.double().cpu() - ref).abs().max().item()
    bound = atol * terms + rtol * ref.abs().max().item()
    assert worst <= bound, f"{name}: max error {worst:.3g} > {bound:.3g}; got {got.flatten()[:6]}, ref {ref.flatten()[:6]}"


LAYOUTS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"k{k[0]}x{k[1]}")
@pytest.mark.parametrize("stride,padding,dilation", OPTIONS, ids=str)
def test_gradient_grid(kernel, stride, padding, dilation, layout):
    x = randn(2, 2, 9, 10).contiguous(memory_format=LAYOUTS[layout])
    weight = randn(4, 1, *kernel)  # multiplier 2
    try:
        conv_geometry(x, weight, None, stride, padding, dilation)
    except ValueError:
        pytest.skip("PyTorch rejects this combination too")
    check_grads(x, weight, randn(4), stride, padding, dilation)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("multiplier", [1, 3])
@pytest.mark.parametrize("kernel,stride,padding", [(3, 1, 1), (3, 2, 1), (4, 1, "same")], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradient_dtypes(dtype, multiplier, kernel, stride, padding, layout):
    x = randn(2, 2, 8, 10, dtype=dtype).contiguous(memory_format=LAYOUTS[layout])
    weight = randn(2 * multiplier, 1, kernel, kernel, dtype=dtype)
    check_grads(x, weight, randn(2 * multiplier, dtype=dtype), stride, padding)


@pytest.mark.parametrize("width", [9, 14])  # (14: 7-column tiles, nhwc_pixels_config's whole_tiles)
@pytest.mark.parametrize("kernel,stride,padding", [(3, 1, 1), (7, 1, 3), (3, 2, 1)], ids=str)
def test_channels_last_gradients_with_the_gpu_forward_choice(monkeypatch, kernel, stride, padding, width):
    """channels_last forward and grad_input on the blocks the GPU picks ("nhwc_pixels"), here under
    the interpreter: grad_input's geometry (padding k-1-p, flipped taps) runs the same kernel."""
    from dwconv import dispatch
    from dwconv.kernels import tile

    monkeypatch.setattr(tile, "nhwc_blocks", lambda geom, x: tile.nhwc_pixels_blocks(geom, x))
    x = randn(2, 64, 7, width).contiguous(memory_format=torch.channels_last)
    weight = randn(64, 1, kernel, kernel)
    assert dispatch.forward_config(conv_geometry(x, weight, None, stride, padding, 1), x).kernel == "nhwc_pixels"
    check_grads(x, weight, randn(64), stride, padding)


@pytest.mark.parametrize("kernel,stride,padding,short_max_bytes,rows", [
    (3, 2, 1, None, 2), (3, 1, 1, None, 2), (3, 1, 1, 0, 4), (7, 1, 3, None, 4)], ids=str)
def test_channels_last_pixel_tile_rows(monkeypatch, retune, kernel, stride, padding, short_max_bytes, rows):
    """The pixel tiles' output rows a program: 2 for 3x3 on inputs up to short_pixel_tile_max_bytes,
    else 4; values and gradients right with each."""
    from dwconv import dispatch
    from dwconv.kernels import tile

    if short_max_bytes is not None:
        retune(short_pixel_tile_max_bytes=short_max_bytes)
    monkeypatch.setattr(tile, "nhwc_blocks", lambda geom, x: tile.nhwc_pixels_blocks(geom, x))
    x = randn(2, 64, 9, 9).contiguous(memory_format=torch.channels_last)
    weight = randn(64, 1, kernel, kernel)
    assert dispatch.forward_config(conv_geometry(x, weight, None, stride, padding, 1), x).block_h == rows
    check_grads(x, weight, randn(64), stride, padding)


@pytest.mark.parametrize("width", [16, 14])  # (16: 4 x 4 tiles, some interior; 14: 7-column tiles)
def test_channels_last_7x7_tiles_without_interior_branch(monkeypatch, width):
    """7x7 (and 5x5) channels_last tiles, forward and backward, take the masked branch alone
    (interior_branch_max_taps) and 7-column tiles 2 rows (whole_tile_rows): values and gradients
    right, and the launches are those; 3x3 keeps the interior branch and 4 rows."""
    from dwconv import dispatch
    from dwconv.kernels import _launch, tile

    monkeypatch.setattr(tile, "nhwc_blocks", lambda geom, x: tile.nhwc_pixels_blocks(geom, x))
    launched = []
    launch = _launch.launch

    def recorded(kernel, plan, *tensors):
        launched.append((kernel.__name__, plan.constants))
        return launch(kernel, plan, *tensors)
    monkeypatch.setattr(_launch, "launch", recorded)
    monkeypatch.setattr(tile, "launch", recorded)  # (tile.py calls the name it imported)
    x = randn(2, 32, 11, width).contiguous(memory_format=torch.channels_last)
    weight = randn(32, 1, 7, 7)
    geom = conv_geometry(x, weight, None, 1, 3, 1)
    assert geom.has_interior_tile(4, 4, 32)  # (the backward's 4 x 4 tiles would have an interior branch)
    config = dispatch.forward_config(geom, x)
    assert (config.block_h, config.block_w) == ((2, 7) if width == 14 else (4, 4))
    check_grads(x, weight, randn(32), 1, 3)
    tiles = [constants for name, constants in launched if name in ("depthwise_fwd_tile_kernel",
                                                                   "depthwise_grad_nhwc_pixels_kernel")]
    assert tiles and not any(constants["INTERIOR_TILES"] for constants in tiles), launched
    # (5x5 too, with 2-row 7-column tiles; 3x3 keeps the interior branch)
    small = randn(2, 32, 20, 32).contiguous(memory_format=torch.channels_last)
    for kernel, interior in ((5, False), (3, True)):
        small_geom = conv_geometry(small, randn(32, 1, kernel, kernel), None, 1, kernel // 2, 1)
        config = tile.nhwc_pixels_blocks(small_geom, small)
        assert small_geom.has_interior_tile(config.block_h, config.block_w, config.block_c), kernel
        plan = tile.forward_plan(small_geom, config, small, torch.empty_like(small), False)
        assert plan.constants["INTERIOR_TILES"] == interior, kernel
    narrow = randn(2, 32, 11, 14).contiguous(memory_format=torch.channels_last)
    config = dispatch.forward_config(conv_geometry(narrow, randn(32, 1, 5, 5), None, 1, 2, 1), narrow)
    assert (config.block_h, config.block_w) == (2, 7)


def test_channels_last_takes_the_nhwc_kernels():
    """grad_weight of channels_last x and grad_out on the NHWC kernel, grad_input (stride 1) on the
    forward's NHWC kernel; an NCHW grad_out keeps the strided NCHW kernels."""
    from dwconv._geometry import input_grad_geometry
    from dwconv.dispatch import forward_config
    from dwconv.kernels import grad_weight, tile
    from dwconv.kernels.grad_input import _plan as _grad_input_plan
    from dwconv.kernels.tile import NHWC_KERNELS
    x = randn(2, 5, 9, 9).contiguous(memory_format=torch.channels_last)
    geom = conv_geometry(x, randn(5, 1, 3, 3), None, 1, 1, 1)
    grad_out = randn(*geom.output_shape).contiguous(memory_format=torch.channels_last)
    assert tile._grad_weight_plan(geom, None, grad_out, x, True).kernel == "grad_weight_nhwc"
    assert forward_config(input_grad_geometry(geom), grad_out, torch.empty_like(x)).kernel in NHWC_KERNELS
    assert grad_weight._plan(geom, None, grad_out.contiguous(), x, True).kernel == "grad_weight"
    strided = conv_geometry(x, randn(5, 1, 3, 3), None, 2, 1, 1)  # stride 2: the gather kernel, by channel blocks
    grad_out = randn(*strided.output_shape).contiguous(memory_format=torch.channels_last)
    assert _grad_input_plan(strided, grad_out, torch.empty_like(x)).constants["BLOCK_C"] > 1
    assert _grad_input_plan(strided, grad_out.contiguous(), torch.empty_like(x)).constants["BLOCK_C"] == 1


def test_grad_input_blocks_are_powers_of_two():
    """The phase kernel's blocks, as the GPU and the interpreter take them, over strides 1-4 a side
    and plane sizes: powers of two (the GPU's table once gave 5 rows for stride (2, 3) on 9-wide
    input rows, which did not compile; the interpreter's table, the only one CPU tests run, gave 16)."""
    from dwconv.kernels.grad_input import blocks as grad_input_blocks
    for stride_h, stride_w, size, channels_last, gpu in itertools.product(
            range(1, 5), range(1, 5), (7, 18, 19, 56, 113), (False, True), (False, True)):
        x = torch.empty(2, 3, size, size + 2)
        geom = conv_geometry(x, torch.empty(3, 1, 3, 3), None, (stride_h, stride_w), 1, 1)
        blocks = grad_input_blocks(geom, channels_last, gpu)
        assert all(b & (b - 1) == 0 for b in blocks), (stride_h, stride_w, size, channels_last, gpu, blocks)


@pytest.mark.parametrize("channels_last,width,stride,values", [(True, 56, 2, 8), (False, 56, 2, 2), (False, 112, 2, 8),
                                                                 (False, 112, 1, 2)])
def test_phase_kernel_values_a_thread_on_the_gpu(channels_last, width, stride, values):
    """The GPU's phase-kernel programs give a thread 8 values of a tile on channels_last and on wide
    strided NCHW planes, 2 elsewhere (as measured best)."""
    from dwconv.kernels.grad_input import blocks as grad_input_blocks

    x = torch.empty(64, 144, width, width, device="meta")
    geom = conv_geometry(x, torch.empty(288, 1, 3, 3, device="meta"), None, stride, 1, 1)
    block_h, block_w, block_c, warps = grad_input_blocks(geom, channels_last, True)
    assert block_h * block_w * block_c == 32 * warps * values, (block_h, block_w, block_c, warps)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("x_layout,grad_out_layout", [("channels_last", "nchw"), ("nchw", "channels_last")], ids=str)
def test_gradients_mixed_layouts(x_layout, grad_out_layout, stride):
    """A channels_last input with an NCHW grad_out, and the reverse: right values, grad_input in x's layout."""
    x = randn(2, 3, 9, 10).contiguous(memory_format=LAYOUTS[x_layout])
    grad_x = check_grads(x, randn(3, 1, 3, 3), randn(3), stride, 1, grad_out_format=LAYOUTS[grad_out_layout])[0]
    assert grad_x.is_contiguous(memory_format=LAYOUTS[x_layout])


@pytest.mark.parametrize("kernel,padding,vec,rows", [((3, 3), 0, 4, 1), ((3, 3), 1, 4, 3), ((5, 3), (2, 1), 4, 2),
                                                     ((3, 3), 1, 1, 4)], ids=str)
def test_grad_weight_kernel_configs(kernel, padding, vec, rows):
    """The grad_weight kernel's window path (vec 4), several column strips, programs per channel and
    rows per step (3 does not divide the 14 rows: the last step runs past the end)."""
    x = randn(2, 2, 7, 21)
    weight = randn(2, 1, *kernel)
    geom = conv_geometry(x, weight, None, 1, padding, 1)
    grad_out = randn(*geom.output_shape)
    got_w, got_b = conv_grad_weight(grad_out, x, geom, x.dtype, True, GradWeightConfig(16, 1, vec, 5, rows))
    ref = reference_grads(x, weight, randn(2), grad_out, 1, padding, 1)
    assert_close_sum(got_w, ref[1], x, grad_out, "grad_weight")
    assert_close_sum(got_b, ref[2], torch.ones_like(x), grad_out, "grad_bias")


@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 1), ((1, 2), 0)], ids=str)
def test_grad_input_writes_every_element(stride, padding):
    """grad_input into a NaN-poisoned buffer: every element (also those no output reached) is written."""
    x = randn(2, 3, 9, 10)
    weight = randn(3, 1, 3, 3)
    geom = conv_geometry(x, weight, None, stride, padding, 1)
    grad_out = randn(*geom.output_shape)
    out = conv_grad_input(grad_out, weight, geom, x, out=poisoned(tuple(x.shape), x.dtype))
    assert_close(out, reference_grads(x, weight, None, grad_out, stride, padding, 1)[0], x.dtype, "grad_input")


@pytest.mark.parametrize("stride,padding,dilation,multiplier", [(1, 1, 1, 1), (2, 0, 1, 2), (1, "same", 2, 1)], ids=str)
def test_gradcheck_float64(stride, padding, dilation, multiplier):
    x = randn(1, 2, 6, 7, dtype=torch.float64).requires_grad_()
    weight = randn(2 * multiplier, 1, 3, 2, dtype=torch.float64).requires_grad_()
    bias = randn(2 * multiplier, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b, c: dwconv.depthwise_conv2d(a, b, c, stride, padding, dilation), (x, weight, bias), fast_mode=True)


def test_backward_is_deterministic():
    x = randn(2, 2, 8, 40)
    weight = randn(2, 1, 3, 3)
    bias = randn(2)
    grad_out = randn(2, 2, 8, 40)
    first = dwconv_grads(x, weight, bias, grad_out, 1, 1, 1)
    second = dwconv_grads(x, weight, bias, grad_out, 1, 1, 1)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("wrt", ["input", "weight", "bias", "weight+bias"])
def test_partial_requires_grad(wrt):
    x = randn(1, 2, 8, 9).requires_grad_("input" in wrt)
    weight = randn(2, 1, 3, 3).requires_grad_("weight" in wrt)
    bias = randn(2).requires_grad_("bias" in wrt)
    dwconv.depthwise_conv2d(x, weight, bias, 1, 1).square().sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    F.conv2d(*ref, 1, 1, 1, groups=2).square().sum().backward()
    for t, r in zip((x, weight, bias), ref):
        if t.requires_grad:
            assert_close(t.grad, r.grad, torch.float32, "grad")
        else:
            assert t.grad is None


def test_network_of_modules_matches_nn_conv2d():
    """depthwise -> pointwise -> depthwise, built from dwconv and from nn.Conv2d with the same weights."""
    torch.manual_seed(0)

    def net(depthwise):
        return nn.Sequential(depthwise(4, 4, 3, padding=1, groups=4), nn.ReLU(), nn.Conv2d(4, 8, 1),
                             depthwise(8, 16, 5, stride=2, padding=2, groups=8, bias=False))

    ours = net(dwconv.DepthwiseConv2d).to(DEVICE)
    stock = net(nn.Conv2d).to(DEVICE)
    stock.load_state_dict(ours.state_dict())
    x = randn(2, 4, 8, 9)
    for model in (ours, stock):
        model(x).square().mean().backward()
    for (name, p), q in zip(ours.named_parameters(), stock.parameters()):
        assert_close(p.grad, q.grad, torch.float32, name)


def test_expanded_grad_out_and_channels_last_input():
    """`.sum().backward()` hands the kernels an expanded grad_out (all strides 0); a channels_last
    input gets a channels_last grad, as PyTorch gives."""
    x = randn(2, 3, 7, 9).contiguous(memory_format=torch.channels_last).requires_grad_()
    weight = randn(3, 1, 3, 3).requires_grad_()
    dwconv.depthwise_conv2d(x, weight, None, 1, 1).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (x, weight)]
    F.conv2d(*ref, None, 1, 1, 1, groups=3).sum().backward()
    assert x.grad.is_contiguous(memory_format=torch.channels_last)
    assert_close(x.grad, ref[0].grad, torch.float32, "grad_input")
    assert_close(weight.grad, ref[1].grad, torch.float32, "grad_weight")


BIG = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: > 2**31 elements")


@pytest.mark.parametrize("shape", [pytest.param((1, 1, 46500, 46500), marks=BIG), pytest.param((9, 1024, 480, 488), marks=BIG),
                                   (1, 1, 45, 20), (2, 2, 44, 12)], ids=["one_plane", "many_planes", "small_plane", "small"])
def test_gradients_past_2_31_elements(shape):
    """64-bit offsets in the backward kernels: grad_weight and grad_bias over every element (against
    PyTorch's float32 gradients, taken in slices), grad_input at the last rows of the last planes.
    The small shapes run the same checks everywhere, so the test's own slicing is tested too."""
    torch.manual_seed(0)
    batch, channels, height, width = shape
    x = randn(*shape, dtype=torch.float16)
    weight = randn(channels, 1, 3, 3, dtype=torch.float16)
    geom = conv_geometry(x, weight, None, 1, 1, 1)
    grad_out = (randn(*geom.output_shape) * 0.01).half()  # sums stay in float16's range
    grad_w, grad_b = conv_grad_weight(grad_out, x, geom, weight.dtype, True)

    # The reference sums grad_out * shifted x per tap in float64, in slices (PyTorch's own weight
    # gradient runs one thread block per weight element: minutes on a single 46500 x 46500 plane).
    ref_w = torch.zeros(channels, 9, device=DEVICE, dtype=torch.float64)
    if batch > 1:
        slices = ((F.pad(x[i:i + 1].double(), (1, 1, 1, 1)), grad_out[i:i + 1].double()) for i in range(batch))
    else:  # bands of output rows; band i..i+step reads input rows i-1..i+step (zero rows past the ends)
        step = 4096 if height > 4096 else 16
        slices = ((F.pad(x[:, :, max(0, i - 1):i + step + 1].double(), (1, 1, int(i == 0), int(i + step >= height))),
                   grad_out[:, :, i:i + step].double()) for i in range(0, height, step))
    for xs, gs in slices:
        rows, cols = gs.shape[2:]
        for tap in range(9):
            ref_w[:, tap] += (gs * xs[:, :, tap // 3:tap // 3 + rows, tap % 3:tap % 3 + cols]).sum(dim=(0, 2, 3))
    ref_w = ref_w.view(weight.shape)
    typical = (grad_out.numel() / channels) ** 0.5 * grad_out.float().std().item() * x.float().std().item()
    worst = (grad_w.double() - ref_w).abs().max().item()
    assert worst <= 1e-3 * typical + 2e-3 * ref_w.abs().max().item(), f"grad_weight off by {worst} (scale {typical})"
    assert_close(grad_b, grad_out.double().sum(dim=(0, 2, 3)), torch.float16, "grad_bias")

    grad_x = conv_grad_input(grad_out, weight, geom, x)
    # grad_input rows H-39 .. H-3 of the last channels: from output rows H-40 .. H-2 through input rows H-41..
    c = min(8, channels)
    xs = x[-1:, -c:, height - 41:].float().requires_grad_()
    out = F.conv2d(xs, weight[-c:].float(), None, 1, (0, 1), 1, groups=c)
    ref = torch.autograd.grad(out, xs, grad_out[-1:, -c:, height - 40:height - 1].float())[0]
    assert_close(grad_x[-1:, -c:, height - 39:height - 2], ref[:, :, 2:39], torch.float16, "grad_input")
    del grad_x
    if not fused_backward_applies(geom, x):  # on the GPU, rows narrower than 32 take the separate passes
        assert x.is_cuda and width < 32
        return
    fused_x, fused_w = conv_grad_input_and_weight(grad_out, x, weight, geom)  # the same sums, another order
    worst = (fused_w.double() - ref_w).abs().max().item()
    assert worst <= 1e-3 * typical + 2e-3 * ref_w.abs().max().item(), f"fused grad_weight off by {worst}"
    assert_close(fused_x[-1:, -c:, height - 39:height - 2], ref[:, :, 2:39], torch.float16, "fused grad_input")


@pytest.mark.parametrize(
    "shape,kernel,padding,dilation,vec",
    [
        ((2, 1, 10, 22), (3, 3), 0, 1, 4),  # rows of 2 mod 4 elements: aligned odd-row windows
        ((2, 1, 9, 21), (3, 3), 1, 1, 1),
        ((1, 1, 12, 24), (5, 3), (2, 1), 1, 4),
        ((1, 2, 11, 22), (3, 3), 2, 2, 1),  # dilation: ring of 8
        ((1, 2, 8, 22), (2, 4), "same", 1, 4),  # asymmetric padding
    ],
    ids=str,
)
def test_fused_backward(shape, kernel, padding, dilation, vec):
    """grad_input and grad_weight from one pass of the rows kernel over grad_out, in chunks of 4 rows
    (each grad_out row counted by one chunk only)."""
    x = randn(*shape)
    weight = randn(shape[1], 1, *kernel)
    geom = conv_geometry(x, weight, None, 1, padding, dilation)
    assert fused_backward_applies(geom, x.to("meta"))  # (on the GPU, rows this narrow take the tile kernel)
    grad_out = randn(*geom.output_shape)
    grad_x, grad_w = conv_grad_input_and_weight(grad_out, x, weight, geom, ForwardConfig("rows", 4, 16, 1, vec))
    ref = reference_grads(x, weight, None, grad_out, 1, padding, dilation)
    assert_close(grad_x, ref[0], torch.float32, "grad_input")
    assert_close_sum(grad_w, ref[1], x, grad_out, "grad_weight")


@pytest.mark.parametrize(
    "dtype,shape,kernel,padding,dilation,block,runs",
    [
        (torch.float32, (2, 2, 10, 22), (3, 3), 1, 1, (4, 16), 1),  # kb84's kernel: interior and edge tiles
        (torch.bfloat16, (2, 2, 10, 22), (3, 3), 1, 1, (4, 16), 2),
        (torch.float32, (1, 3, 13, 21), (3, 3), 0, 1, (2, 8), 3),  # no padding (grad_out padded by 2), odd rows
        (torch.float32, (1, 2, 12, 24), (5, 3), (2, 1), 1, (3, 8), 2),  # non-square kernel, rows not a tile multiple
        (torch.float32, (1, 2, 11, 22), (3, 3), 2, 2, (2, 8), 4),  # dilation 2
        (torch.float32, (1, 2, 8, 22), (2, 4), "same", 1, (4, 8), 2),  # asymmetric padding
    ],
    ids=str,
)
def test_fused_backward_nchw_pixels(dtype, shape, kernel, padding, dilation, block, runs):
    """grad_input and grad_weight from one pass of the "nchw_pixels" kernel over grad_out: each
    grad_out x input pair in one FMA of one tile, partial sums per run of row tiles; deterministic."""
    x = randn(*shape, dtype=dtype)
    weight = randn(shape[1], 1, *kernel, dtype=dtype)
    geom = conv_geometry(x, weight, None, 1, padding, dilation)
    grad_out = randn(*geom.output_shape, dtype=dtype)
    config = ForwardConfig("nchw_pixels", block[0], block[1], 1)
    grad_x, grad_w = conv_grad_input_and_weight(grad_out, x, weight, geom, config, runs)
    assert grad_w.dtype == dtype
    ref = reference_grads(x, weight, None, grad_out, 1, padding, dilation)
    assert_close(grad_x, ref[0], dtype, "grad_input")
    assert_close_sum(grad_w, ref[1], x, grad_out, "grad_weight")
    again = conv_grad_input_and_weight(grad_out, x, weight, geom, config, runs)
    assert torch.equal(again[0], grad_x) and torch.equal(again[1], grad_w), "not deterministic"


@pytest.mark.skipif(DEVICE != "cuda", reason="the switch picks the GPU's fused blocks")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_nchw_pixels(dtype):
    """autograd's NCHW fused backward on "nchw_pixels" (rows of KernelBench 84's width, a 3x3 and a
    5x5 layer)."""
    check_grads(randn(2, 3, 18, 512, dtype=dtype), randn(3, 1, 3, 3, dtype=dtype), None, 1, 0)
    check_grads(randn(2, 4, 21, 40, dtype=dtype), randn(4, 1, 5, 5, dtype=dtype), None, 1, 2)


def test_fused_backward_through_autograd(monkeypatch):
    import dwconv.dispatch as ops

    calls = []
    fused = ops.conv_grad_input_and_weight
    monkeypatch.setattr(ops, "conv_grad_input_and_weight", lambda *a, **k: calls.append(1) or fused(*a, **k))
    x = randn(2, 2, 8, 34)
    weight = randn(2, 1, 3, 3)
    check_grads(x, weight, None, 1, 1, 1)
    assert calls, "the fused path did not run"
    calls.clear()  # a bias gradient takes the two kernels (grad_weight sums grad_out for it)
    check_grads(x, weight, randn(2), 1, 1, 1)
    assert not calls, "the fused path ran with a bias gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,kernel,padding,dilation,block,runs",
    [
        ((2, 64, 7, 9), (3, 3), 1, 1, None, None),  # the default blocks (small inputs: 32 channels)
        ((2, 64, 7, 9), (3, 3), 1, 1, (2, 4, 64), None),  # 64 channels a warp: bf16 pairs
        ((1, 128, 6, 7), (3, 3), 1, 1, (4, 4, 128), 2),  # kb84's blocks: 128 channels on 2 warps
        ((1, 40, 6, 11), (5, 5), 2, 1, (2, 4, 16), 2),  # channels not a block multiple, two runs a column
        ((2, 64, 9, 8), (3, 3), 0, 2, (3, 4, 64), 2),  # dilation 2, no padding, rows not a block multiple
        ((3, 8, 7, 6), (3, 3), 1, 1, (2, 4, 8), 5),  # runs that cross from one image into the next
        ((1, 6, 5, 5), (3, 3), 3, 1, (2, 2, 4), 3),  # padding past the kernel's reach (cropped grad_out)
        ((1, 8, 9, 7), (7, 3), (3, 1), 1, (4, 4, 8), 1),  # a non-square kernel
        ((1, 3, 1, 2), (3, 3), 1, 1, (2, 2, 4), 1),  # a 1 x 2 image
    ],
    ids=str,
)
def test_fused_backward_channels_last(dtype, shape, kernel, padding, dilation, block, runs):
    """grad_input and grad_weight of channels_last tensors from one pass of the unrolled-pixels kernel
    over grad_out (each grad_out x input pair in one FMA of one tile; partial sums per column of
    tiles and run)."""
    from dwconv.dispatch import conv_grad_input_and_weight as conv_grad_input_and_weight_nhwc

    x = randn(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = randn(shape[1], 1, *kernel, dtype=dtype)
    geom = conv_geometry(x, weight, None, 1, padding, dilation)
    grad_out = randn(*geom.output_shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    config = ForwardConfig("nhwc_pixels", block[0], block[1], max(1, block[2] // 64), block_c=block[2]) if block else None
    grad_x, grad_w = conv_grad_input_and_weight_nhwc(grad_out, x, weight, geom, config, runs)
    assert grad_x.is_contiguous(memory_format=torch.channels_last) and grad_w.dtype == dtype
    ref = reference_grads(x, weight, None, grad_out, 1, padding, dilation)
    assert_close(grad_x, ref[0], dtype, "grad_input")
    assert_close_sum(grad_w, ref[1], x, grad_out, "grad_weight")
    again = conv_grad_input_and_weight_nhwc(grad_out, x, weight, geom, config, runs)
    assert torch.equal(again[0], grad_x) and torch.equal(again[1], grad_w), "not deterministic"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,kernel,padding,dilation,block",
    [
        ((2, 64, 7, 9), (3, 3), 1, 1, None),  # the launcher's blocks (the interpreter's: one strip)
        ((1, 128, 9, 10), (3, 3), 0, 1, (9, 4, 128)),  # kb84's: no padding, 128 channels on 2 warps
        ((1, 128, 9, 10), (3, 3), 0, 1, (9, 4, 128, "prefetch")),  # the next row's loads issued first
        ((2, 64, 7, 9), (3, 3), 1, 1, (3, 4, 64)),  # segments of 3 rows, the last short; bf16 pairs
        ((2, 64, 7, 9), (3, 3), 1, 1, (3, 4, 64, "prefetch")),  # prefetches past a segment and an image
        ((1, 40, 6, 11), (5, 5), 2, 1, (4, 3, 16)),  # channels and columns not block multiples
        ((2, 16, 9, 8), (3, 3), 0, 2, (2, 4, 16, "prefetch")),  # dilation 2: a ring of 4 rows
        ((1, 6, 5, 5), (3, 3), 3, 1, (2, 2, 4)),  # padding past the kernel's reach (cropped grad_out)
        ((1, 8, 9, 7), (3, 2), (1, 0), 1, (5, 4, 8)),  # a non-square kernel
        ((1, 8, 6, 5), (1, 3), (0, 1), 1, (4, 4, 8)),  # one kernel row: no ring
        ((1, 3, 1, 2), (3, 3), 1, 1, (1, 2, 4)),  # a 1 x 2 image
    ],
    ids=str,
)
def test_fused_backward_channels_last_rows(dtype, shape, kernel, padding, dilation, block):
    """The row-sliding fused pass (depthwise_grad_nhwc_rows_kernel): each program walks its segment
    of an image's rows, keeping the grad_out rows it shares with the next step in a ring; grad_input
    and grad_weight against float64, with programs that start mid-image (the ring's first rows)."""
    from dwconv.dispatch import conv_grad_input_and_weight as conv_grad_input_and_weight_nhwc
    from dwconv.kernels.tile import rows_grad_blocks as nhwc_rows_grad_config

    x = randn(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = randn(shape[1], 1, *kernel, dtype=dtype)
    geom = conv_geometry(x, weight, None, 1, padding, dilation)
    grad_out = randn(*geom.output_shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    config = ForwardConfig("nhwc_rows", block[0], block[1], max(1, block[2] // 64), block_c=block[2],
                           prefetch="prefetch" in block) if block else nhwc_rows_grad_config(geom, x)
    grad_x, grad_w = conv_grad_input_and_weight_nhwc(grad_out, x, weight, geom, config)
    assert grad_x.is_contiguous(memory_format=torch.channels_last) and grad_w.dtype == dtype
    ref = reference_grads(x, weight, None, grad_out, 1, padding, dilation)
    assert_close(grad_x, ref[0], dtype, "grad_input")
    assert_close_sum(grad_w, ref[1], x, grad_out, "grad_weight")
    again = conv_grad_input_and_weight_nhwc(grad_out, x, weight, geom, config)
    assert torch.equal(again[0], grad_x) and torch.equal(again[1], grad_w), "not deterministic"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,kernel,padding,block,activation,affine",
    [
        ((2, 64, 7, 9), (3, 3), 1, (3, 4, 64, "prefetch"), "relu6", True),  # segments, prefetch, a ring
        ((1, 40, 6, 11), (5, 5), 2, (4, 3, 16), "silu", True),  # channels and columns not block multiples
        ((2, 24, 5, 8), (3, 3), 1, (5, 8, 32), "identity", False),  # no affine, no activation; masked channels
        ((1, 6, 5, 5), (3, 3), 3, (2, 2, 4), "hardswish", True),  # padding past the kernel's reach
        # 1 x 2 images, three of them: two values a channel would leave BatchNorm's gradient all rounding
        ((3, 3, 1, 2), (3, 3), 1, (1, 2, 4), "relu", True),
    ],
    ids=str,
)
def test_convolution_backward_through_batch_norm(dtype, shape, kernel, padding, block, activation, affine):
    """The row-sliding backward computing a BatchNorm's gradient (training, with its activation) as it
    loads grad_out (tile.NormGrad: grad_y never written), and the path that writes grad_y first
    (BatchNorm's grad_input pass, then the convolution's backward), each against float64: the
    convolution's gradients from the float64 gradient of BatchNorm and the activation at the same
    (rounded) convolution output."""
    from dwconv.activations import FUNCTIONS, activation_code
    from dwconv.dispatch import conv_grad_through_batch_norm
    from dwconv.kernels.batch_norm import batch_norm_forward, batch_norm_grad_input, batch_norm_grad_sums
    from dwconv.kernels.tile import NormGrad

    channels = shape[1]
    x = randn(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = randn(channels, 1, *kernel, dtype=dtype)
    geom = conv_geometry(x, weight, None, 1, padding, 1)
    y = randn(*geom.output_shape, dtype=dtype).contiguous(memory_format=torch.channels_last)  # (the conv's output)
    gamma, beta = (randn(channels), randn(channels)) if affine else (None, None)
    grad = randn(*geom.output_shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    code, eps = activation_code(activation), 1e-5
    _, mean, invstd = batch_norm_forward(y, gamma, beta, None, None, 0.1, eps, code)
    totals, _, _ = batch_norm_grad_sums(grad, y, gamma, beta, mean, invstd, eps, code)
    norm = NormGrad(y, mean, invstd, gamma, beta, totals, code)
    y64 = y.detach().double().cpu().requires_grad_()
    out64 = FUNCTIONS[activation](F.batch_norm(y64, None, None, *(t.double().cpu() for t in (gamma, beta))
                                               if affine else (None, None), True, 0.0, eps))
    (grad_y64,) = torch.autograd.grad(out64, [y64], grad.double().cpu())
    ref = reference_grads(x, weight, None, grad_y64, 1, padding, 1)
    config = ForwardConfig("nhwc_rows", block[0], block[1], max(1, block[2] // 64), block_c=block[2],
                           prefetch="prefetch" in block)
    # (written first, grad_y is rounded to the dtype before the convolution reads it, as stock's is:
    # that path's reference is the float64 convolution of that grad_y, itself checked against float64)
    grad_y = batch_norm_grad_input(grad, y, gamma, beta, mean, invstd, totals, eps, code)
    assert_close(grad_y, grad_y64, dtype, "grad_y")
    for path, how, expected in (("grad_y computed in the rows pass", config, ref),
                                ("grad_y written first", None, reference_grads(x, weight, None, grad_y, 1, padding, 1))):
        grad_x, grad_w = conv_grad_through_batch_norm(grad, x, weight, geom, norm, eps, how)
        assert grad_x.is_contiguous(memory_format=torch.channels_last) and grad_w.dtype == dtype
        assert_close(grad_x, expected[0], dtype, f"{path}: grad_input")
        assert_close_sum(grad_w, expected[1], x, grad_y64.to(dtype), f"{path}: grad_weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,kernel,stride,padding,dilation,multiplier,block",
    [
        ((2, 64, 7, 9), (3, 3), 1, 1, 1, 1, None),  # the GPU's blocks (4 x 8 outputs, 64 channels: bf16 pairs)
        ((1, 40, 11, 10), (3, 3), 2, 1, 1, 1, (2, 4, 16)),  # stride 2, channels not a block multiple
        ((1, 48, 7, 6), (5, 5), 1, 2, 1, 1, (4, 4, 32)),  # 5x5 in half precision on the GPU (240 channels)
        ((1, 16, 13, 12), (5, 5), (2, 1), 2, (1, 2), 1, (3, 2, 8)),  # mixed strides and dilations
        ((2, 8, 9, 7), (7, 3), 1, (3, 1), 1, 2, (4, 4, 8)),  # a non-square kernel, multiplier 2
        ((1, 6, 5, 5), (3, 3), 1, 3, 1, 1, (2, 2, 4)),  # padding past the kernel's reach
        ((1, 3, 1, 2), (3, 3), 1, 1, 1, 3, (2, 2, 4)),  # a 1 x 2 image, multiplier 3
    ],
    ids=str,
)
def test_grad_weight_channels_last_pixels(dtype, shape, kernel, stride, padding, dilation, multiplier, block):
    """The weight and bias gradients of channels_last tensors on the unrolled pixels (the GPU's path
    up to 7x7): tiles of grad_out, each tap adding the input under it; partial sums per column of
    tiles and run, with one run a column (the interpreter's) and with runs across images."""
    from dwconv.kernels.tile import _pixels_grad as _launch_nhwc_pixels_grad

    x = randn(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = randn(shape[1] * multiplier, 1, *kernel, dtype=dtype)
    geom = conv_geometry(x, weight, None, stride, padding, dilation)
    grad_out = randn(*geom.output_shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    config = ForwardConfig("nhwc_pixels", block[0], block[1], 1, block_c=block[2]) if block else \
        ForwardConfig("nhwc_pixels", 4, 8, 1, block_c=64)
    grad_w, grad_b = conv_grad_weight(grad_out, x, geom, dtype, True, config)
    assert grad_w.dtype == grad_b.dtype == dtype and grad_w.shape == weight.shape
    ref = reference_grads(x, weight, randn(weight.shape[0]), grad_out, stride, padding, dilation)
    assert_close_sum(grad_w, ref[1], x, grad_out, "grad_weight")
    assert_close_sum(grad_b, ref[2], torch.ones_like(x), grad_out, "grad_bias")
    again = conv_grad_weight(grad_out, x, geom, dtype, True, config)
    assert torch.equal(again[0], grad_w) and torch.equal(again[1], grad_b), "not deterministic"
    grad_w, grad_b = _launch_nhwc_pixels_grad(geom, grad_out, x, None, None, config, 3, True, dtype)  # 3 runs a column
    assert_close_sum(grad_w, ref[1], x, grad_out, "grad_weight, 3 runs")
    assert_close_sum(grad_b, ref[2], torch.ones_like(x), grad_out, "grad_bias, 3 runs")


def test_grad_weight_channels_last_pixels_through_autograd(monkeypatch):
    """Where grad_weight_pixels_applies (the GPU up to 7x7), autograd's weight and bias gradients of
    channels_last tensors come from the unrolled pixels: strided, dilated, with a multiplier."""
    import dwconv.dispatch as ops
    from dwconv.kernels import tile

    calls = []
    launch = tile.grad_weight_pixels
    monkeypatch.setattr(ops, "grad_weight_pixels_applies", lambda geom, x, g: ops.channels_last_kernel_applies(x, g))
    monkeypatch.setattr(tile, "grad_weight_pixels", lambda *a, **k: calls.append(True) or launch(*a, **k))
    x = randn(2, 16, 9, 8).contiguous(memory_format=torch.channels_last)
    check_grads(x, randn(32, 1, 3, 3), randn(32), 2, 1, 1)
    check_grads(x, randn(16, 1, 5, 3), randn(16), 1, (2, 1), (1, 2))
    assert calls.count(True) == 2, "the weight gradient did not run on the unrolled pixels"


def test_fused_backward_channels_last_through_autograd(monkeypatch):
    """autograd takes the channels_last fused pass where it applies (stride 1, no bias gradient) and
    the two kernels elsewhere; an NCHW grad_out is made channels_last."""
    from dwconv.kernels import tile as ops

    calls = []
    fused = ops.grad_input_and_weight
    monkeypatch.setattr(ops, "grad_input_and_weight", lambda *a, **k: calls.append(1) or fused(*a, **k))
    x = randn(2, 32, 6, 7).contiguous(memory_format=torch.channels_last)
    weight = randn(32, 1, 3, 3)
    check_grads(x, weight, None, 1, 1, 1)
    assert calls, "the fused path did not run"
    calls.clear()
    check_grads(x, weight, None, 1, 1, 1, grad_out_format=torch.contiguous_format)
    assert calls, "the fused path did not run on an NCHW grad_out"
    calls.clear()
    check_grads(x, weight, None, 2, 1, 1)  # stride 2: grad_input is a gather
    check_grads(x, weight, randn(32), 1, 1, 1)  # a bias gradient: the two kernels
    assert not calls, "the fused path ran where it does not apply"


def test_channels_last_pixel_grad_programs_on_the_gpu(retune):
    """pixels_grad_blocks' GPU answer: KernelBench 84's fused pass keeps the measured layout (one
    program an image column of tiles, 128 channels); small layers keep their partial sums near a
    twelfth of the tensors (14 MB of them on 64x384x14x14, more than x, made the backward 3x slower)
    with at least min_pixel_grad_programs programs, and the fused pass takes 32 channels."""
    from dwconv.kernels.tile import pixels_grad_blocks as nhwc_pixels_grad_config
    from dwconv.tuning import tuned

    MIN_PIXEL_GRAD_PROGRAMS = tuned().min_pixel_grad_programs

    retune(plan_as_gpu=True)  # (the GPU's plans for tensors without one)

    def on_gpu(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    def geometry(shape, k, padding):
        return conv_geometry(torch.empty(shape, device="meta"), torch.empty(shape[1], 1, k, k, device="meta"), None,
                             1, padding, 1)

    kb84 = geometry((64, 128, 256, 512), 3, 0)
    config, runs = nhwc_pixels_grad_config(kb84, on_gpu((64, 128, 256, 512), torch.bfloat16), True)
    assert (config.block_h, config.block_w, config.block_c, runs) == (4, 4, 128, 64)
    tensor_mb = 2 * 64 * 384 * 14 * 14 * 2 / 2**20
    for k, grad_input, block_c in [(3, True, 32), (7, False, 32), (7, True, 32)]:
        small = geometry((64, 384, 14, 14), k, k // 2)
        config, runs = nhwc_pixels_grad_config(small, on_gpu((64, 384, 14, 14), torch.bfloat16), grad_input)
        columns = (384 // config.block_c) * -(-14 // config.block_w)
        partial_mb = columns * runs * config.block_c * k * k * 4 / 2**20
        assert config.block_c == block_c, (k, grad_input, config)
        assert columns * runs >= MIN_PIXEL_GRAD_PROGRAMS, (k, grad_input, runs)
        # (a program's tiles more where the floor of programs allows: 7x7's sums are larger)
        assert partial_mb <= max(tensor_mb / 12 * 1.1, MIN_PIXEL_GRAD_PROGRAMS * 32 * k * k * 4 * 1.1 / 2**20), \
            (k, grad_input, partial_mb)


def test_channels_last_rows_pass_on_the_gpu(retune):
    """Where the GPU's fused channels_last backward slides down rows (nhwc_rows_apply): the 56-wide
    small layers (32-channel blocks), in strips of 8 with prefetch, the whole image a program; not
    KernelBench 84, 112 or 28 wide, or dilated."""
    from dwconv.dispatch import fused_backward_config, nhwc_rows_apply
    from dwconv.kernels.tile import _pixels_grad_plan as _nhwc_pixels_grad_plan
    from dwconv.kernels.tile import rows_grad_blocks as nhwc_rows_grad_config

    retune(plan_as_gpu=True)

    def case(shape, dtype, dilation=1):
        x = torch.empty(shape, dtype=dtype, device="meta").contiguous(memory_format=torch.channels_last)
        weight = torch.empty(shape[1], 1, 3, 3, dtype=dtype, device="meta")
        return conv_geometry(x, weight, None, 1, dilation, dilation), x

    for dtype in (torch.bfloat16, torch.float32):
        geom, x = case((64, 144, 56, 56), dtype)
        assert nhwc_rows_apply(geom, x)
        config = nhwc_rows_grad_config(geom, x)
        assert (config.block_h, config.block_w, config.block_c, config.prefetch) == (56, 8, 32, True)
        grad_out = torch.empty(geom.output_shape, dtype=dtype, device="meta").contiguous(
            memory_format=torch.channels_last)
        chosen, _ = fused_backward_config(geom, x, grad_out)
        assert _nhwc_pixels_grad_plan(geom, grad_out, x, x, chosen, None, False).kernel == "grad_nhwc_rows"
        for shape, dilation in [((64, 128, 256, 512), 1), ((64, 32, 112, 112), 1), ((64, 240, 28, 28), 1),
                                ((64, 144, 56, 56), 2)]:
            assert not nhwc_rows_apply(*case(shape, dtype, dilation)), (shape, dilation)


@pytest.mark.parametrize("dtype,dilation,cap", [(torch.bfloat16, 1, 128), (torch.float16, 1, 128),
                                                 (torch.float32, 1, None), (torch.bfloat16, 2, None)], ids=str)
def test_channels_last_fused_register_cap(retune, dtype, dilation, cap):
    """The GPU's fused channels_last pass is capped at 128 registers in half precision at dilation 1
    only (KernelBench 84 bfloat16 gained 9%, the dilated layer lost 18%, float32 gained nothing);
    the weight gradient alone is never capped."""
    from dwconv.kernels.tile import _pixels_grad_plan as _nhwc_pixels_grad_plan

    retune(plan_as_gpu=True)
    x = randn(2, 64, 12, 12, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = randn(64, 1, 3, 3, dtype=dtype)
    geom = conv_geometry(x, weight, None, 1, dilation, dilation)
    grad_out = randn(*geom.output_shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    fused = _nhwc_pixels_grad_plan(geom, grad_out, x, torch.empty_like(x), None, None, False)
    assert fused.constants.get("maxnreg") == cap, fused.constants
    alone = _nhwc_pixels_grad_plan(geom, grad_out, x, None, None, None, False)
    assert "maxnreg" not in alone.constants, alone.constants


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("bias_grad", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_weight_grad_sums(retune, monkeypatch, weight_dtype, bias_grad, path):
    """The second pass of every weight gradient: partial sums over (outer, inner) parts, in a layout
    with padding between taps rows (as the kernels' padded taps), added per channel and tap in the
    partial's precision and cast to the weight's dtype; 70 parts (more than a GPU step's 64); by the
    kernel, and by torch's sum past weight_sums_max_parts."""
    from dwconv.kernels import weight_sums
    from dwconv.kernels.weight_sums import weight_grad_sums

    launches = []
    monkeypatch.setattr(weight_sums, "launch", lambda *a: launches.append(a[0]) or _launch.launch(*a))
    retune(weight_sums_max_parts=70 if path == "kernel" else 69)

    channels, kernel, outer, inner, padded = 5, (3, 2), 7, 10, 8
    x = randn(1, channels, 4, 4)
    geom = conv_geometry(x, randn(channels, 1, *kernel), None, 1, 1, 1)
    values = kernel[0] * kernel[1] + bias_grad
    partial_dtype = torch.float64 if weight_dtype == torch.float64 else torch.float32
    # partial[o, c, i, tap]: value (c, t) of part (o, i) at o * s0 + i * s2 + c * s1 + t
    partial = randn(outer, channels, inner, padded, dtype=partial_dtype)
    sums = partial[..., :values].sum(dim=(0, 2))
    grad_w, grad_b = weight_grad_sums(partial, geom, weight_dtype, bias_grad, partial.stride(1),
                                      (inner, partial.stride(2)), (outer, partial.stride(0)))
    assert grad_w.dtype == weight_dtype and grad_w.shape == (channels, 1, *kernel) and grad_w.is_contiguous()
    tolerance = dict(rtol=1e-2, atol=1e-2) if weight_dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_w.double(), sums[:, :-1 if bias_grad else None].reshape(grad_w.shape).double()
                               .to(weight_dtype).double(), **tolerance)
    if bias_grad:
        assert grad_b.dtype == weight_dtype and grad_b.shape == (channels,)
        torch.testing.assert_close(grad_b.double(), sums[:, -1].to(weight_dtype).double(), **tolerance)
    else:
        assert grad_b is None
    assert len(launches) == (path == "kernel")


def test_fused_nchw_pixels_float64_weight_gradient_keeps_float64(retune):
    """float64's fused NCHW backward on the GPU's "nchw_pixels" blocks (here under the interpreter):
    the weight gradient's partial sums are float64 too, so the gradient has float64's precision."""
    retune(plan_as_gpu=True)
    x = randn(1, 2, 6, 12, dtype=torch.float64)
    weight = randn(2, 1, 3, 3, dtype=torch.float64)
    geom = conv_geometry(x, weight, None, 1, 1, 1)
    grad_out = randn(*geom.output_shape, dtype=torch.float64)
    grad_x, grad_w = conv_grad_input_and_weight(grad_out, x, weight, geom)
    ref = reference_grads(x, weight, None, grad_out, 1, 1, 1)
    assert torch.allclose(grad_x.cpu(), ref[0], rtol=1e-12, atol=1e-12)
    assert torch.allclose(grad_w.cpu(), ref[1], rtol=1e-12, atol=1e-12), (grad_w.cpu() - ref[1]).abs().max()
