"""The package's shape: its import graph runs one way (user API -> registered ops and autograd ->
dispatch -> kernels -> geometry) with no circle, kernel families never import each other, and the
dispatcher's choices for a table of geometries."""

import ast
import os

import pytest
import torch

from dwconv import dispatch
from dwconv._geometry import conv_geometry

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "dwconv")
FAMILIES = {"tile", "rows", "nchw_pixels", "pairs", "grad_input", "grad_weight", "large_fma", "toeplitz"}
# what each layer may import from the package (modules below it), by module name prefix
BASE = {"dwconv._geometry", "dwconv._env", "dwconv.tuning", "dwconv._triton_compat"}
LAYERS = [
    ("dwconv.kernels", {"dwconv.kernels"} | BASE),
    ("dwconv.dispatch", {"dwconv.kernels"} | BASE),
    ("dwconv.replay", {"dwconv.replay", "dwconv.kernels._launch"} | BASE),
    ("dwconv._library", {"dwconv.dispatch", "dwconv.replay", "dwconv.kernels"} | BASE),
    ("dwconv._triton_compat", set()),
    ("dwconv.tuning", {"dwconv._env"}),
]


def _is_module(name):
    path = os.path.join(os.path.dirname(PACKAGE), *name.split("."))
    return os.path.isdir(path) or os.path.exists(path + ".py")


def module_imports():
    """{module: {package modules it imports, at any depth of its code}}."""
    graph = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].split(os.sep)
            is_package = parts[-1] == "__init__"
            module = ".".join(parts[:-1] if is_package else parts)
            base = module.split(".") if is_package else module.split(".")[:-1]
            imported = set()
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                    else:
                        target = node.module or ""
                    names = [f"{target}.{alias.name}" for alias in node.names]
                    modules = [n for n in names if _is_module(n)]  # (from a package import its submodules)
                    imported.update(modules if len(modules) == len(names) else modules + [target])
                elif isinstance(node, ast.Import):
                    imported.update(alias.name for alias in node.names if alias.name.startswith("dwconv"))
            graph[module] = imported
    modules = set(graph)
    # keep names that are modules (from x import y: y may be a function)
    return {m: {i for i in imported if i in modules and i != m} for m, imported in graph.items()}


def test_importing_dwconv_imports_no_triton():
    """Triton reads TRITON_INTERPRET when its language module is imported: the package's import
    must leave it to the first call (a compile worker, a demo without a GPU, sets it first)."""
    import subprocess
    import sys

    code = "import sys, dwconv; print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=os.path.dirname(PACKAGE)))
    assert done.stdout.strip() == "[]", done.stdout[:200]


def test_no_import_circle():
    graph = module_imports()
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_layers_import_only_below():
    graph = module_imports()
    for module, imported in graph.items():
        for prefix, allowed in LAYERS:
            if module == prefix or module.startswith(prefix + "."):
                wrong = {i for i in imported if not any(i == a or i.startswith(a + ".") for a in allowed)}
                assert not wrong, f"{module} imports {sorted(wrong)} from above its layer"
        family = module.rsplit(".", 1)[-1]
        if module.startswith("dwconv.kernels.") and family in FAMILIES:
            others = {i for i in imported if i.rsplit(".", 1)[-1] in FAMILIES}
            assert not others, f"kernel family {family} imports family {sorted(others)}"


# (input shape, layout, dtype, kernel, stride, padding, dilation) -> forward, grad_input's forward, fused
DISPATCH = [
    ((64, 128, 256, 512), "nchw", torch.float32, 3, 1, 0, 1, "nchw_pixels", "nchw_pixels", True),
    ((64, 128, 256, 512), "nchw", torch.bfloat16, 3, 1, 0, 1, "nchw_pixels", "nchw_pixels", True),
    ((64, 32, 112, 112), "nchw", torch.bfloat16, 3, 1, 1, 1, "rows", "rows", True),
    ((64, 96, 112, 112), "nchw", torch.float32, 3, 2, 1, 1, "pairs", None, False),
    ((64, 144, 56, 56), "nchw", torch.float32, 5, 2, 2, 1, "tile", None, False),
    ((64, 192, 28, 28), "nchw", torch.float32, 3, 1, 1, 1, "large_fma", "large_fma", False),
    ((64, 96, 56, 56), "nchw", torch.float32, 7, 1, 3, 1, "large_fma", "large_fma", False),
    ((32, 256, 64, 64), "nchw", torch.float32, 3, 1, 2, 2, "rows", "rows", True),
    ((64, 144, 56, 56), "channels_last", torch.bfloat16, 3, 1, 1, 1, "nhwc_pixels", "nhwc_pixels", True),
    ((64, 96, 56, 56), "channels_last", torch.bfloat16, 7, 1, 3, 1, "nhwc_pixels", "nhwc_pixels", False),
    ((32, 128, 56, 56), "channels_last", torch.bfloat16, 9, 1, 4, 1, "nhwc", "nhwc", False),
    ((32, 128, 56, 56), "nchw", torch.float32, 31, 1, 15, 1, "large_fma", "large_fma", False),
    ((32, 128, 56, 56), "nchw", torch.bfloat16, 31, 1, 15, 1, "toeplitz", "toeplitz", False),
    ((32, 128, 56, 56), "channels_last", torch.bfloat16, 51, 1, 25, 1, "toeplitz", "toeplitz", False),
    ((8, 16, 20, 20), "nchw", torch.float64, 3, 1, 1, 1, "tile", "tile", False),
    ((8, 16, 20, 40), "nchw", torch.float64, 3, 1, 1, 1, "rows", "rows", True),
]


@pytest.mark.parametrize("shape,layout,dtype,kernel,stride,padding,dilation,forward,grad_input,fused", DISPATCH,
                         ids=lambda v: str(v))
def test_gpu_dispatch_table(retune, shape, layout, dtype, kernel, stride, padding, dilation, forward, grad_input,
                            fused):
    """The GPU's family for each pass of real layers (meta tensors with the GPU's plans)."""
    retune(plan_as_gpu=True)
    x = torch.empty(shape, dtype=dtype, device="meta")
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.empty(shape[1], 1, kernel, kernel, dtype=dtype, device="meta")
    geom = conv_geometry(x, weight, None, stride, padding, dilation)
    assert dispatch.forward_config(geom, x).kernel == forward
    if grad_input is not None:
        from dwconv._geometry import grad_input_as_forward

        grad_out = torch.empty(geom.output_shape, dtype=dtype, device="meta")
        if layout == "channels_last":
            grad_out = grad_out.contiguous(memory_format=torch.channels_last)
        chosen = dispatch.forward_config(grad_input_as_forward(geom), grad_out, backward=True).kernel
        assert chosen == grad_input, chosen
    assert dispatch.fused_backward_applies(geom, x) == fused
