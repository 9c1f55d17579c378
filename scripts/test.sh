#!/usr/bin/env bash
# Runs the test suite. Without a GPU the Triton kernels run under TRITON_INTERPRET=1 on small CPU tensors.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=$(bash "$root/scripts/setup.sh")
cd "$root"
export PYTHONPATH=$root/src${PYTHONPATH:+:$PYTHONPATH}
workers=()
if ! "$python" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  export TRITON_INTERPRET=1
  # the interpreter is CPU-bound: one worker a core (CI's machines have 2), where pytest-xdist is there
  if "$python" -c 'import xdist' 2>/dev/null; then workers=(-n "$(nproc)" --dist worksteal); fi
fi
# (--durations: the slowest tests in every CI log, to keep CI well under 20 minutes)
exec "$python" -m pytest -q -p no:cacheprovider --durations=15 ${workers[@]+"${workers[@]}"} tests "$@"
