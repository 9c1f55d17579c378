"""Developer tool: logs the inputs of every Triton cache key a run computes, one JSON line each, to
find why a cache built on the CPU machine (device_triton_cache.py) misses kernels on the GPU one,
and how long each kernel it compiles takes ({"compiled": name, "seconds": s}).

Run the same layer both ways and diff the lines of one kernel:

    PYTHONPATH=.triton36:src python benchmarks/trace_cache_keys.py --log /tmp/cpu.jsonl \
        benchmarks/device_triton_cache.py --suite models --dtype float16 --cases 2 --out /tmp/kb
    python3 benchmarks/trace_cache_keys.py --log $OUT/gpu.jsonl -m dwconv bench --suite models \
        --dtype float16 --cases 2 --channels-last --backward --iters 3
"""

import hashlib
import json
import runpy
import sys
import time


def install(log_path: str) -> None:
    from triton.compiler import compiler
    from triton.runtime import cache

    original = compiler.get_cache_key

    def traced(src, backend, options, env_vars):
        key = original(src, backend, options, env_vars)
        opts = {k: v for k, v in sorted(options.__dict__.items()) if k != "extern_libs"}
        line = dict(name=getattr(src, "name", "?"), hash=hashlib.sha256(key.encode()).hexdigest(),
                    fn=getattr(getattr(src, "fn", None), "cache_key", None), attrs=str(getattr(src, "attrs", "")),
                    signature=str(getattr(src, "signature", "")),
                    constants=str(sorted((str(k), str(v)) for k, v in getattr(src, "constants", {}).items())),
                    backend=backend.hash(), options=str(opts), env=str(sorted(env_vars.items())),
                    triton_key=hashlib.sha256(cache.triton_key().encode()).hexdigest()[:16])
        with open(log_path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return key

    compiler.get_cache_key = traced

    # and each compile's duration (a kernel loaded from the cache logs ~0 s)
    from triton.runtime import jit

    do_compile = getattr(jit.JITFunction, "_do_compile", None)  # (Triton 3.6's; the hook is skipped elsewhere)
    if do_compile is None:
        return

    def timed(self, *args, **kwargs):
        started = time.time()
        kernel = do_compile(self, *args, **kwargs)
        with open(log_path, "a") as f:
            f.write(json.dumps(dict(compiled=self.fn.__name__, seconds=round(time.time() - started, 2))) + "\n")
        return kernel

    jit.JITFunction._do_compile = timed


def main() -> None:
    """--log FILE, then `-m module args...` or `script args...` (parsed by hand: the run's own options,
    `-q` and the like, must not reach this tool's parser)."""
    argv = sys.argv[1:]
    if len(argv) < 3 or argv[0] != "--log":
        raise SystemExit("usage: trace_cache_keys.py --log FILE (-m MODULE | SCRIPT) [ARGS...]")
    install(argv[1])
    rest = argv[2:]
    if rest[0] == "-m":
        sys.argv = rest[1:]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
