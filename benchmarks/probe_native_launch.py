"""Developer probe (GPU): how much of a small layer's host time a C++ launch path would remove
(docs/notes.md, session 17's design note; issues #3 and #4 are bound by host time there).

It compiles a small C++ extension (torch.utils.cpp_extension.load_inline; the GPU machine has a
compiler, as Triton's own launchers need one) that registers `dwconv_probe::forward(x, w, kernel,
out_shape)`: a custom op whose CUDA kernel allocates the output and launches, with cuLaunchKernel,
the cubin Triton compiled for dwconv's own forward plan, its parameters packed from the compiled
kernel's signature (constexprs dropped; the scratch pointers Triton appends passed as null). Then,
per layer, host time per call (host_overhead_gpu.per_call_us: back-to-back calls that do not fill
the launch queue) of:
  dwconv.depthwise_conv2d (the user's call), ops.forward.conv_forward (the launcher alone),
  the C++ op, and F.conv2d (cuDNN) -- and the C++ op's output against dwconv's (it must match exactly).

    python benchmarks/probe_native_launch.py [--calls 50] [--layers 0 1 2]
"""

import argparse
import os
import re

import torch
import torch.nn.functional as F

import dwconv
from dwconv._geometry import conv_geometry
from dwconv.ops import forward as fwd
from dwconv.ops import large_fma
from host_overhead_gpu import per_call_us  # (benchmarks/ is on the path when run as a script)

# (N, C, H, W), kernel, padding: issue #3's small layers (float32, NCHW)
LAYERS = [((64, 144, 56, 56), 3, 1), ((64, 384, 14, 14), 7, 3), ((64, 240, 28, 28), 5, 2),
          ((64, 128, 256, 512), 3, 0)]

CPP = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cstring>
#include <vector>

namespace {

// One launch plan: a loaded CUfunction and its parameters, each a tensor ('p': index into the
// op's tensors), an int32 or int64 value ('i', 'l') or a null pointer ('s': Triton's scratch).
struct NativeKernel {
  CUfunction function;
  unsigned grid, block, shared;
  std::string kinds;
  std::vector<int64_t> values;
};
std::vector<NativeKernel> kernels;

int64_t register_kernel(int64_t function, int64_t grid, int64_t block, int64_t shared, std::string kinds,
                        std::vector<int64_t> values) {
  TORCH_CHECK(kinds.size() == values.size(), "one value a parameter");
  kernels.push_back({reinterpret_cast<CUfunction>(function), static_cast<unsigned>(grid),
                     static_cast<unsigned>(block), static_cast<unsigned>(shared), kinds, values});
  return static_cast<int64_t>(kernels.size()) - 1;
}

at::Tensor forward(const at::Tensor& x, const at::Tensor& w, int64_t kernel, at::IntArrayRef out_shape) {
  const NativeKernel& k = kernels.at(kernel);
  at::Tensor y = at::empty(out_shape, x.options());
  const at::Tensor* tensors[3] = {&x, &w, &y};
  std::vector<uint64_t> storage(k.kinds.size(), 0);
  std::vector<void*> params(k.kinds.size());
  for (size_t i = 0; i < k.kinds.size(); ++i) {
    if (k.kinds[i] == 'p') {
      storage[i] = reinterpret_cast<uint64_t>(tensors[k.values[i]]->data_ptr());
    } else if (k.kinds[i] == 'i') {
      int32_t v = static_cast<int32_t>(k.values[i]);
      std::memcpy(&storage[i], &v, sizeof v);
    } else if (k.kinds[i] == 'l') {
      storage[i] = static_cast<uint64_t>(k.values[i]);
    }
    params[i] = &storage[i];
  }
  CUresult status = cuLaunchKernel(k.function, k.grid, 1, 1, k.block, 1, 1, k.shared,
                                   c10::cuda::getCurrentCUDAStream(x.get_device()).stream(), params.data(),
                                   nullptr);
  TORCH_CHECK(status == CUDA_SUCCESS, "cuLaunchKernel failed: ", static_cast<int>(status));
  return y;
}

}  // namespace

TORCH_LIBRARY(dwconv_probe, m) {
  m.def("register_kernel(int function, int grid, int block, int shared, str kinds, int[] values) -> int",
        &register_kernel);
  m.def("forward(Tensor x, Tensor w, int kernel, int[] out_shape) -> Tensor");
}

TORCH_LIBRARY_IMPL(dwconv_probe, CUDA, m) {
  m.impl("forward", &forward);
}
"""


def build_extension():
    import triton
    from torch.utils.cpp_extension import load_inline
    from triton.backends.nvidia.driver import libcuda_dirs

    nvidia = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia")
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    load_inline("dwconv_probe_native", cpp_sources=CPP, is_python_module=False, verbose=False,
                extra_include_paths=[os.path.join(nvidia, "include")],
                extra_ldflags=[f"-L{d}" for d in libcuda_dirs()] + ["-lcuda", f"-L{torch_lib}", "-lc10_cuda"])


def ptx_params(ptx: str) -> int:
    """How many parameters the kernel's .entry takes."""
    entry = ptx[ptx.index(".entry"):]
    return len(re.findall(r"\.param\s", entry[:entry.index(")")]))


def register(x, w, out, geom):
    """The forward plan dwconv would launch for (x, w, out), compiled by Triton and registered with
    the C++ op: returns its index."""
    if large_fma.large_fma_applies(geom, x):  # (5x5 up, unpadded weight rows: under 100 taps)
        assert geom.kernel_h * geom.kernel_w < large_fma.WEIGHT_VECTORS_MIN_TAPS
        plan = large_fma._plan(geom, x, out, False, False, large_fma.large_fma_blocks(geom, True), False)
        kernel, tensors = large_fma.depthwise_fwd_large_fma_kernel, (x, w, w, out)
    else:
        plan = fwd._forward_plan(geom, None, x, out, False, None)
        kernels = {"nchw_pixels": fwd.depthwise_fwd_nchw_pixels_kernel, "rows": fwd.depthwise_fwd_rows_kernel}
        kernel = kernels[plan.kernel]
        tensors = (x, w, w, out, out, out)  # x, weight, bias (unused), y, features (unused), partial (unused)
    compiled = kernel[plan.grid](*tensors, *plan.scalars, **plan.constants)
    torch.cuda.synchronize()
    compiled._init_handles()
    meta = compiled.metadata
    assert getattr(meta, "global_scratch_size", 0) == 0 and getattr(meta, "num_ctas", 1) == 1, "not a plain launch"
    args = dict(zip(kernel.arg_names, (*tensors, *plan.scalars)))
    tensor_index = {"x_ptr": 0, "w_ptr": 1, "b_ptr": 1, "y_ptr": 2, "f_ptr": 2, "partial_ptr": 2}
    kinds, values = "", []
    for name, kind in compiled.src.signature.items():
        if kind == "constexpr" or name in plan.constants:
            continue
        if kind.startswith("*"):
            kinds, values = kinds + "p", values + [tensor_index[name]]
        else:
            kinds, values = kinds + ("l" if "64" in kind else "i"), values + [int(args[name])]
    extra = ptx_params(compiled.asm["ptx"]) - len(kinds)
    assert 0 <= extra <= 2, f"{extra} parameters past the signature's"
    kinds, values = kinds + "s" * extra, values + [0] * extra
    return torch.ops.dwconv_probe.register_kernel(compiled.function, plan.grid[0], 32 * meta.num_warps,
                                                  meta.shared, kinds, values)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--layers", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args()
    build_extension()
    for shape, k, pad in [LAYERS[i] for i in args.layers]:
        x = torch.randn(shape, device="cuda")
        w = torch.randn(shape[1], 1, k, k, device="cuda")
        geom = conv_geometry(x, w, None, 1, pad, 1)
        out = torch.empty(geom.output_shape, device="cuda")
        if not large_fma.large_fma_applies(geom, x) and fwd.forward_config(geom, x, out).kernel not in (
                "nchw_pixels", "rows"):
            print(f"{shape} k{k}: dwconv takes another kernel here; skipped")
            continue
        index = register(x, w, out, geom)
        native = torch.ops.dwconv_probe.forward(x, w, index, list(geom.output_shape))
        expected = dwconv.depthwise_conv2d(x, w, None, 1, pad)
        torch.cuda.synchronize()
        error = (native - expected).abs().max().item()
        calls = {
            "dwconv.depthwise_conv2d": lambda: dwconv.depthwise_conv2d(x, w, None, 1, pad),
            "conv_forward (launcher)": lambda: fwd.conv_forward(x, w, None, geom),
            "C++ op (cuLaunchKernel)": lambda: torch.ops.dwconv_probe.forward(x, w, index, list(geom.output_shape)),
            "F.conv2d (cuDNN)": lambda: F.conv2d(x, w, None, 1, pad, 1, shape[1]),
        }
        times = {name: per_call_us(fn, args.calls)[0] for name, fn in calls.items()}
        print(f"{shape} k{k} p{pad} float32: C++ op against dwconv max abs diff {error:.1e}")
        for name, us in times.items():
            print(f"  {name:26s} {us:7.1f} us a call (host)")


if __name__ == "__main__":
    main()
