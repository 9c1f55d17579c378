"""Markdown tables for docs/performance.md from `python -m dwconv bench --csv` files.

    python benchmarks/tables.py docs/data/kb84-session3.csv [more.csv ...]

One table per file: a row per (layer, pass), dwconv's time and % of copy, each other path's time,
and dwconv's speedup over it; peak memory when the file has it (forward+backward runs).
"""

import csv
import sys

NAMES = {"eager": "eager", "cudnn_cl": "cuDNN channels_last", "compile": "torch.compile"}


def table(path):
    rows = list(csv.DictReader(open(path)))
    paths = [p for p in NAMES if any(r["path"] == p for r in rows)]
    keyed = {(r["layer"], r["pass"], r["path"]): r for r in rows}
    keys = list(dict.fromkeys((r["layer"], r["pass"]) for r in rows))
    has_peak = any(r["peak_mb"] not in ("", "nan") for r in rows)
    head = ["layer", "pass", "dwconv ms", "% of copy"] + [f"{NAMES[p]} ms" for p in paths] + [f"vs {NAMES[p]}" for p in paths]
    if has_peak:
        head.append("peak MB dwconv / eager")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for layer, pass_ in keys:
        ours = keyed[(layer, pass_, "dwconv")]
        ms = float(ours["ms"])
        cells = [layer, pass_, f"{ms:.3f}", f"{float(ours['pct_copy']):.1f}%"]
        others = [keyed.get((layer, pass_, p)) for p in paths]
        cells += [f"{float(o['ms']):.3f}" if o else "" for o in others]
        cells += [f"{float(o['ms']) / ms:.2f}x" if o else "" for o in others]
        if has_peak:
            eager = keyed.get((layer, pass_, "eager"))
            peak = ours["peak_mb"]
            cells.append(f"{float(peak):.1f} / {float(eager['peak_mb']):.1f}" if peak not in ("", "nan") and eager else "")
        lines.append("| " + " | ".join(cells) + " |")
    copy = {round(float(r["copy_gbps"])) for r in rows}
    lines.append("")
    lines.append(f"Copy rate in the run: {min(copy)}-{max(copy)} GB/s; {rows[0]['device']}.")
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(f"<!-- {p} -->")
        print(table(p))
        print()
