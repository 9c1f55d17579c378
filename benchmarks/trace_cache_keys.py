"""Developer tool: logs the inputs of every Triton cache key a run computes, one JSON line each, to
find why a cache built on the CPU machine (device_triton_cache.py) misses kernels on the GPU one,
and how long each kernel it compiles takes ({"compiled": name, "seconds": s}).

Run the same layer both ways and diff the lines of one kernel:

    PYTHONPATH=.triton36:src python benchmarks/trace_cache_keys.py --log /tmp/cpu.jsonl \
        benchmarks/device_triton_cache.py --suite models --dtype float16 --cases 2 --out /tmp/kb
    python3 benchmarks/trace_cache_keys.py --log $OUT/gpu.jsonl -m dwconv bench --suite models \
        --dtype float16 --cases 2 --channels-last --backward --iters 3
"""

import argparse
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

    # and each compile's duration (a cache hit compiles nothing: no line)
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
    p = argparse.ArgumentParser()
    p.add_argument("--log", required=True)
    p.add_argument("-m", dest="module", help="run this module (as python -m) instead of a script")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the script (unless -m) and its arguments")
    args = p.parse_args()
    install(args.log)
    if args.module:
        sys.argv = [args.module] + args.rest
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = args.rest
        runpy.run_path(args.rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
