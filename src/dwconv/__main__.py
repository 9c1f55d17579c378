"""Command line: `python -m dwconv bench [...]` (see `python -m dwconv bench --help`) and
`python -m dwconv build` (the C++ launch path, built now rather than in the background at the first
call on a GPU: after installing, or in a container image)."""

import sys
import time

USAGE = ("usage: python -m dwconv bench [options]   (python -m dwconv bench --help for the options)\n"
         "       python -m dwconv build             (build the C++ launch path now)")


def build() -> int:
    import torch

    from .replay import native

    began = time.perf_counter()
    kind = "with CUDA launches" if torch.cuda.is_available() else "without CUDA (CPU tests)"
    try:
        module = native.extension()
    except native.BuildFailed as error:
        print(f"dwconv: the C++ launch path could not be built ({error}); eager calls take the Python path, "
              "which launches the same kernels", file=sys.stderr)
        return 1
    print(f"dwconv: C++ launch path {kind} ready in {time.perf_counter() - began:.1f} s: {module.__file__}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "build":
        return build()
    if argv[0] != "bench":
        print(f"unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    from .bench import main as bench_main

    return bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
