"""The benchmark's own logic (no GPU needed): the models suite, speedups, the progress bar, the plot."""

import pytest
import torch

from dwconv._geometry import conv_geometry
from dwconv.bench import SUITES, parse_args, cases_from_args, progress_bar
from dwconv.bench_plot import plot_rows, speedups


def test_models_suite_holds_valid_distinct_layers():
    cases = SUITES["models"]
    assert len({c.label for c in cases}) == len(cases)
    assert {c.dtype for c in cases} == {"float32", "float16", "bfloat16"}
    for c in cases:  # every layer is a valid depthwise convolution (meta tensors: no memory)
        x = torch.empty(c.n, c.c, c.h, c.w, device="meta")
        conv_geometry(x, torch.empty(c.c * c.multiplier, 1, c.kernel, c.kernel, device="meta"), None, c.stride,
                      c.padding, c.dilation)
    shapes = {(c.n, c.c, c.h, c.w, c.kernel, c.stride, c.dilation) for c in cases}
    for wanted in [(64, 128, 256, 512, 3, 1, 1), (64, 96, 56, 56, 7, 1, 1), (64, 144, 56, 56, 3, 1, 1),
                   (32, 256, 64, 64, 3, 1, 2)]:  # kb84 and the models suite's layers
        assert wanted in shapes


def test_large_suite_and_flops():
    """The large suite's layers in every dtype; the k31 forward is 24.7 GFLOP."""
    from dwconv.bench import FULL_SUITES, Case

    cases = SUITES["large"]
    assert {(c.kernel, c.padding, c.dtype) for c in cases} == {(k, k // 2, d) for k in (13, 31, 51)
                                                               for d in ("float32", "float16", "bfloat16")}
    assert "large" in FULL_SUITES
    k31 = next(c for c in cases if c.kernel == 31)
    assert round(k31.flops() / 1e9, 1) == 24.7 and k31.flops(backward=True) == 2 * k31.flops()
    # output size from stride, padding and dilation: 5x5 input, k3 s2 p1 -> 3x3 outputs of 9 taps
    assert Case(1, 2, 5, 5, 3, 2, 1, multiplier=2).flops() == 2 * 4 * 9 * 9


def test_suite_dtype_filter():
    assert {c.dtype for c in cases_from_args(parse_args(["--suite", "models", "--dtype", "bfloat16"]))} == {"bfloat16"}
    assert len(cases_from_args(parse_args(["--suite", "models"]))) == len(SUITES["models"])
    assert [c.dtype for c in cases_from_args(parse_args([]))] == ["float32"]
    bf16 = cases_from_args(parse_args(["--suite", "models", "--dtype", "bfloat16"]))
    assert cases_from_args(parse_args(["--suite", "models", "--dtype", "bfloat16", "--cases", "2", "0"])) == \
        [bf16[2], bf16[0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA graphs")
def test_bench_with_cuda_graphs(capsys):
    """Forward+backward of dwconv and PyTorch captured in CUDA graphs and replayed for the timing."""
    from dwconv.bench import main

    assert main(["-N", "2", "-C", "8", "-H", "16", "-W", "16", "--padding", "1", "--backward", "--channels-last",
                 "--cuda-graphs", "--iters", "3", "--warmup", "1"]) == 0
    assert "replayed from a CUDA graph" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the GPU")
def test_bench_block(capsys, tmp_path):
    """--block: the block (conv, BatchNorm, activation) in eval mode and in a training step, stock's
    kernels against dwconv's, both layouts, with its values checked against float64 first."""
    from dwconv.bench import main, read_csv_rows

    csv = tmp_path / "block.csv"
    assert main(["-N", "2", "-C", "8", "-H", "16", "-W", "16", "--padding", "1", "--dtype", "bfloat16",
                 "--block", "hardswish", "--iters", "3", "--warmup", "1", "--csv", str(csv)]) == 0
    rows = read_csv_rows(str(csv))
    assert {r["path"] for r in rows} == {"dwconv", "eager", "dwconv_cl", "cudnn_cl"}
    assert {r["pass"] for r in rows} == {"block forward", "block train step"}
    assert all("+bn+hardswish" in r["layer"] for r in rows) and len(rows) == 8


def fake_rows():
    rows = []
    for layer, scale in (("a", 1.0), ("b", 2.0)):
        for pass_name in ("forward", "fwd+bwd"):
            for path, ms in (("dwconv", 1.0), ("eager", 3.0), ("dwconv_cl", 2.0), ("cudnn_cl", 1.0)):
                rows.append({"layer": layer, "pass": pass_name, "path": path, "ms": ms * scale, "gbps": 100.0 / ms})
    return rows


def test_speedups():
    got = speedups(fake_rows(), "forward")
    assert got["NCHW: dwconv / eager"] == {"a": 3.0, "b": 3.0}
    assert got["channels_last: dwconv / cuDNN"] == {"a": 0.5, "b": 0.5}


def test_progress_bar():
    assert progress_bar(0, 4, 8) == "[........] 0/4"
    assert progress_bar(2, 4, 8) == "[####....] 2/4"
    assert progress_bar(4, 4, 8) == "[########] 4/4"


def test_plot_rows(tmp_path):
    pytest.importorskip("matplotlib")  # (on the GPU machine; not installed on CI's)
    path = tmp_path / "suite.png"
    plot_rows(fake_rows(), 4000.0, str(path), "test")
    assert path.stat().st_size > 1000


def test_csv_rows_round_trip_for_resume(tmp_path):
    """--resume reads an earlier run's rows back with numbers as numbers; rows of another run (an
    extra column) are written beside them."""
    from dwconv.bench import read_csv_rows, write_csv

    path = str(tmp_path / "rows.csv")
    old = dict(copy_gbps=4200.5, layer="L k3 bfloat16", path="dwconv", **{"pass": "forward"}, ms=0.125, std=0.002,
               gbps=3000.0, pct_copy=71.4, peak_mb=float("nan"), max_err=1e-3, cuda_graph=False, dwconv_speedup=1.0)
    write_csv(path, [old], quiet=True)
    back = read_csv_rows(path)
    assert back[0]["ms"] == 0.125 and back[0]["cuda_graph"] is False and back[0]["layer"] == "L k3 bfloat16"
    assert back[0]["peak_mb"] != back[0]["peak_mb"]  # NaN survives
    write_csv(path, back + [dict(old, layer="M", ms=0.5, extra=1)], quiet=True)
    rows = read_csv_rows(path)
    assert [r["layer"] for r in rows] == ["L k3 bfloat16", "M"] and rows[1]["ms"] == 0.5



def test_table_prints_tflops(capsys):
    """The TFLOP/s column, and rows resumed from a CSV written before it (NaN there)."""
    from dwconv.bench import print_table

    row = dict(layer="L k31 bfloat16", path="dwconv", ms=0.5, std=0.01, gbps=800.0, pct_copy=19.0, tflops=49.4,
               peak_mb=float("nan"), dwconv_speedup=1.0, **{"pass": "forward"})
    old = {k: v for k, v in row.items() if k != "tflops"}
    print_table([row, old], 4200.0)
    out = capsys.readouterr().out
    assert "TFLOP/s" in out and "49.4" in out and "nan" in out and "float32 FMA 67" in out


def test_channels_last_summary_counts_and_geometric_mean(tmp_path):
    """benchmarks/tables.py's channels_last summary line: rows faster than cuDNN channels_last and the geometric
    mean, by mean and by median time (a CSV written before the median column: mean only)."""
    import csv
    import importlib.util
    import os

    from dwconv.bench import write_csv

    spec = importlib.util.spec_from_file_location(
        "tables", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "tables.py"))
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    rows = []
    for layer, ours, theirs in (("a", 1.0, 2.0), ("b", 1.0, 0.5), ("c", 1.0, 8.0)):
        for path, ms in (("dwconv", ours), ("eager", 1.0), ("dwconv_cl", ours), ("cudnn_cl", theirs)):
            median = ms / 2 if (layer, path) == ("c", "dwconv_cl") else ms
            rows.append(dict(copy_gbps=4000.0, layer=layer, path=path, ms=ms, median=median, pct_copy=1.0,
                             peak_mb=float("nan"), **{"pass": "fwd+bwd"}))
    path = str(tmp_path / "rows.csv")
    write_csv(path, rows, quiet=True)
    line = tables.cl_summary(list(csv.DictReader(open(path))))
    # ratios 2, 0.5, 8: geometric mean 2 by mean; by median c's is 16: (2 * 0.5 * 16) ** (1/3)
    assert "fwd+bwd by mean: faster on 2 of 3, geometric mean 2.00x" in line
    assert "fwd+bwd by median: faster on 2 of 3, geometric mean 2.52x" in line
    rows_old = [{k: v for k, v in r.items() if k != "median"} for r in rows]
    write_csv(path, rows_old, quiet=True)
    line = tables.cl_summary(list(csv.DictReader(open(path))))
    assert "by median" not in line and "faster on 2 of 3" in line


def test_performance_doc_is_generated_from_the_csvs():
    """docs/performance.md, and the README's tables (layers, fused models, whole models), are what
    benchmarks/tables.py makes of docs/data/*.csv (regenerate them with the command they name after
    adding or replacing a results CSV)."""
    import glob
    import importlib.util
    import os

    root = os.path.join(os.path.dirname(__file__), "..")
    spec = importlib.util.spec_from_file_location("tables", os.path.join(root, "benchmarks", "tables.py"))
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    cwd = os.getcwd()
    try:
        os.chdir(root)
        expected = tables.document(glob.glob("docs/data/*.csv"))
        readme = open("README.md").read()
        expected_readme = tables.readme(readme, glob.glob("docs/data/*.csv"))
    finally:
        os.chdir(cwd)
    assert open(os.path.join(root, "docs", "performance.md")).read() == expected
    assert readme == expected_readme


def test_host_python_tool_runs():
    """benchmarks/host_python.py without a GPU (the Python of an eager call around the stubbed C++
    lookup) runs against the package as it is: it reaches into the replayer's internals, which may move."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "host_python.py"), "--calls", "20"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len([line for line in done.stdout.splitlines() if line.endswith(" us")]) == 12, done.stdout


def test_fold_ab_tool_runs():
    """benchmarks/fold_ab.py --smoke (no GPU: its layers shrunk, on the CPU): every path of every layer
    computes the block (checked against float64 inside the tool), the products where they apply."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "fold_ab.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    paths = [line.split()[-6] for line in done.stdout.splitlines() if line.endswith(tuple("0123456789"))
             and "x " in line]
    assert sorted(set(paths)) == ["converted", "fold+conv", "fold+product", "fold+product+relu", "stock"], paths
    assert len(paths) == 20 and paths.count("fold+product") == 4 and paths.count("fold+product+relu") == 1, paths


def test_input_activation_ab_tool_runs():
    """benchmarks/input_activation_ab.py --smoke (no GPU: four layers shrunk, on the CPU): each path of
    each layer runs, and the input-activated ones match float64's (checked inside the tool too)."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "input_activation_ab.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("2x")]
    assert len(rows) == 4 * 5, done.stdout
    errors = [float(line.split()[-1]) for line in rows if "in-act" in line or "pass" in line]
    assert len(errors) == 12 and max(errors) < 0.02, done.stdout


def test_compile_cost_keys_at_another_image_size():
    """benchmarks/compile_cost.py --keys-at (no GPU, nothing compiled): the kernel binaries another
    image size adds, each with what differs from the same layer's key at the suite's size. ConvNeXt-T's
    7x7 layers at 192 x 192 instead of 224: the 7-column tiles (chosen for widths divisible by 7) give
    way to 4-column ones, a new binary each."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "compile_cost.py"), "--match", "ConvNeXt",
                           "--keys-at", "0.857"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counted = re.search(r"(\d+) kernel binaries; image sizes x 0.857 add (\d+):", done.stdout)
    assert counted and 0 < int(counted[2]) <= int(counted[1]), done.stdout
    assert "BLOCK_W ('constexpr', 7) -> ('constexpr', 4)" in done.stdout, done.stdout


def test_compile_cost_keys_at_another_batch_size():
    """benchmarks/compile_cost.py --keys-at-batch: MobileNetV2's bfloat16 channels_last binaries at
    batch 8 instead of 64 add one, the largest layer's forward tile reading the weight as given
    (not the taps-major copy of inputs of 64 MB and up); nothing else follows the batch."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "compile_cost.py"), "--match",
                           "MobileNetV2", "--keys-at-batch", "8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kernel binaries; batch 8 adds 1:" in done.stdout, done.stdout
    assert "64x96x112x112 k3 s2 p1 d1 bfloat16 forward depthwise_fwd_tile_kernel: w_stride_c" in done.stdout, done.stdout
