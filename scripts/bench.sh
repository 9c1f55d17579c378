#!/usr/bin/env bash
# The main job: the KernelBench 84 benchmark on a GPU (a correctness demo under the interpreter without one).
# Extra arguments go to `python -m dwconv bench` (e.g. --suite forward, --dtype all --compile, --csv FILE).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=$(bash "$root/scripts/setup.sh")
export PYTHONPATH=$root/src${PYTHONPATH:+:$PYTHONPATH}
exec "$python" -m dwconv bench "$@"
