#!/usr/bin/env bash
# Runs the test suite. Without a GPU the Triton kernels run under TRITON_INTERPRET=1 on small CPU tensors.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=$(bash "$root/scripts/setup.sh")
cd "$root"
export PYTHONPATH=$root/src${PYTHONPATH:+:$PYTHONPATH}
if ! "$python" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  export TRITON_INTERPRET=1
fi
exec "$python" -m pytest -q -p no:cacheprovider tests "$@"
