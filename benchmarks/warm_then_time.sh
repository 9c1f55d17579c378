#!/usr/bin/env bash
# One device call for probes whose Triton compiles cost more than their timing: every command first
# runs in parallel (JOBS at a time, output kept in $OUT/warm.log) only to fill the Triton cache,
# then again one at a time, alone on the GPU, for the timings ($OUT/timed.log).
# Usage (repo root, GPU machine): JOBS=6 WARM_S=240 bash benchmarks/warm_then_time.sh 'cmd' 'cmd' ...
# Commands run from benchmarks/. TRITON_CACHE_DIR may point into the repo so a later call can carry it.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cd benchmarks
start=$SECONDS
printf '%s\0' "$@" | timeout "${WARM_S:-240}" xargs -0 -P "${JOBS:-6}" -I{} bash -c '{} >/dev/null 2>>"$0"' "$OUT/warm.log"
echo "warm-up: $((SECONDS - start)) s (rc $?)" | tee -a "$OUT/timed.log"
for cmd in "$@"; do
  echo "\$ $cmd" | tee -a "$OUT/timed.log"
  timeout "${TIMED_S:-200}" bash -c "$cmd" 2>&1 | tee -a "$OUT/timed.log"
done
echo "timed: $((SECONDS - start)) s" | tee -a "$OUT/timed.log"
