"""Command line: `python -m dwconv bench [...]` (see `python -m dwconv bench --help`)."""

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m dwconv bench [options]   (python -m dwconv bench --help for the options)")
        return 0
    if argv[0] != "bench":
        print(f"unknown command {argv[0]!r}; the command is 'bench'", file=sys.stderr)
        return 2
    from .bench import main as bench_main

    return bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
