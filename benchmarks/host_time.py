"""Host time per eager call of dwconv (public API only, so that two source trees compare): small
layers whose kernels take a few microseconds, so that the host is the bottleneck. For each tree
given, in alternation (ROUNDS rounds), microseconds per call of the forward (no grad) and of
forward+backward, on CUDA, the C++ path built first.

    python benchmarks/host_time.py OLD_SRC NEW_SRC
"""

import os
import statistics
import subprocess
import sys

LAYERS = [(8, 32, 14, 14, 3), (8, 96, 7, 7, 5), (8, 64, 28, 28, 3)]
ROUNDS, CALLS = 5, 300

CHILD = r"""
import sys, time, torch
sys.path.insert(0, sys.argv[1])
import dwconv
try:
    from dwconv import replay
except ImportError:
    from dwconv.ops import native as replay
replay.prepare()
for n, c, h, w, k in %r:
    x = torch.randn(n, c, h, w, device="cuda", requires_grad=True)
    weight = torch.randn(c, 1, k, k, device="cuda", requires_grad=True)
    for mode in ("forward", "fwd+bwd"):
        def call():
            if mode == "forward":
                with torch.no_grad():
                    dwconv.depthwise_conv2d(x, weight, None, 1, k // 2)
            else:
                dwconv.depthwise_conv2d(x, weight, None, 1, k // 2).sum().backward()
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(%d):
            call()
        torch.cuda.synchronize()
        print(f"{n}x{c}x{h}x{w} k{k} {mode} {(time.perf_counter() - start) / %d * 1e6:.1f}")
""" % (LAYERS, CALLS, CALLS)


def main(trees):
    results = {tree: {} for tree in trees}
    for _ in range(ROUNDS):
        for number, tree in enumerate(trees):
            # (a build directory a tree: the replayer's sources differ between trees)
            env = dict(os.environ, TORCH_EXTENSIONS_DIR=f"/tmp/dwconv_ext_{number}")
            out = subprocess.run([sys.executable, "-c", CHILD, tree], capture_output=True, text=True, check=True,
                                 env=env).stdout
            for line in out.strip().splitlines():
                *name, value = line.rsplit(" ", 1)
                results[tree].setdefault(name[0], []).append(float(value))
    names = list(results[trees[0]])
    print("us per call (median of %d rounds; min-max)" % ROUNDS)
    print("layer".ljust(34) + "".join(t.ljust(26) for t in trees))
    for name in names:
        print(name.ljust(34) + "".join(
            f"{statistics.median(results[t][name]):7.1f} ({min(results[t][name]):.1f}-{max(results[t][name]):.1f})".ljust(26)
            for t in trees))


if __name__ == "__main__":
    main(sys.argv[1:])
