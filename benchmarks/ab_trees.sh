#!/usr/bin/env bash
# Bitwise A/B of two source trees on the GPU: every layer of the given suites, all dtypes, both layouts,
# outputs and gradients hashed and every launch (kernel, grid, arguments) listed, by SHARDS processes
# per tree at once (compiles in parallel), then compared. Writes $OUT/ab_old.json, ab_new.json, ab.txt.
#   OLD=.ab_old/src NEW=src SUITES=models,large SHARDS=7 [SKIP=done.json] bash benchmarks/ab_trees.sh
set -u
old=${OLD:-.ab_old/src}; new=${NEW:-src}; suites=${SUITES:-models,large}; shards=${SHARDS:-7}
work=$(mktemp -d)
for tree in old new; do
  src=$old; [ $tree = new ] && src=$new
  for ((i = 0; i < shards; i++)); do
    PYTHONPATH=$src timeout ${AB_TIMEOUT_S:-500} python3 benchmarks/fingerprint.py --src "$src" --suite "$suites" \
      --shard $i/$shards ${SKIP:+--skip "$SKIP"} --out "$work/${tree}_$i.json" >"$work/${tree}_$i.log" 2>&1 &
  done
done
wait
tail -n 3 "$work"/*.log > "$OUT/ab_logs.txt"
python3 - "$work" "$OUT" "$shards" <<'PY'
import json, sys, glob
work, out, shards = sys.argv[1], sys.argv[2], int(sys.argv[3])
for tree in ("old", "new"):
    merged = {}
    for path in glob.glob(f"{work}/{tree}_*.json"):
        merged.update(json.load(open(path)))
    json.dump(merged, open(f"{out}/ab_{tree}.json", "w"), sort_keys=True)
PY
python3 benchmarks/fingerprint.py --compare "$OUT/ab_old.json" "$OUT/ab_new.json" | tee "$OUT/ab.txt" | tail -20
