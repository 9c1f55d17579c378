"""Markdown tables for docs/performance.md from `python -m dwconv bench --csv` files.

    python benchmarks/tables.py docs/data/kb84-session3.csv [more.csv ...]

One table per file: a row per (layer, pass), dwconv's time and % of copy, each other path's time,
and dwconv's speedup over it; with --channels-last runs, dwconv on channels_last tensors against
cuDNN on the same; peak memory when the file has it (forward+backward runs).
"""

import csv
import math
import sys

NAMES = {"eager": "eager", "cudnn_cl": "cuDNN channels_last", "compile": "torch.compile"}


def table(path):
    rows = list(csv.DictReader(open(path)))
    paths = [p for p in NAMES if any(r["path"] == p for r in rows)]
    keyed = {(r["layer"], r["pass"], r["path"]): r for r in rows}
    keys = list(dict.fromkeys((r["layer"], r["pass"]) for r in rows))
    has_peak = any(r["peak_mb"] not in ("", "nan") for r in rows)
    head = ["layer", "pass", "dwconv ms", "% of copy"] + [f"{NAMES[p]} ms" for p in paths] + [f"vs {NAMES[p]}" for p in paths]
    has_cl = any(r["path"] == "dwconv_cl" for r in rows)  # --channels-last: dwconv against cuDNN, both NHWC
    if has_cl:
        head += ["dwconv channels_last ms", "its % of copy", "vs cuDNN channels_last (both NHWC)"]
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
        if has_cl:
            ours_cl, cudnn_cl = keyed.get((layer, pass_, "dwconv_cl")), keyed.get((layer, pass_, "cudnn_cl"))
            cells += [f"{float(ours_cl['ms']):.3f}", f"{float(ours_cl['pct_copy']):.1f}%",
                      f"{float(cudnn_cl['ms']) / float(ours_cl['ms']):.2f}x" if cudnn_cl else ""] if ours_cl else ["", "", ""]
        if has_peak:
            eager = keyed.get((layer, pass_, "eager"))
            peak = ours["peak_mb"]
            cells.append(f"{float(peak):.1f} / {float(eager['peak_mb']):.1f}" if peak not in ("", "nan") and eager else "")
        lines.append("| " + " | ".join(cells) + " |")
    if has_cl:
        lines += ["", cl_summary(rows)]
    copy = {round(float(r["copy_gbps"])) for r in rows}
    lines.append("")
    lines.append(f"Copy rate in the run: {min(copy)}-{max(copy)} GB/s; {rows[0]['device']}.")
    return "\n".join(lines)


def cl_summary(rows):
    """Issue #4's criteria: per pass, on how many layers dwconv on channels_last tensors beats cuDNN
    on the same, and the geometric mean of the ratios, by mean time (the bench's statistic) and
    by median (the small layers' host-bound calls are spread wide: session 23)."""
    keyed = {(r["layer"], r["pass"], r["path"]): r for r in rows}
    # (ours, cuDNN's) rows of each layer and pass that has both
    pairs = [(r, keyed[(r["layer"], r["pass"], "cudnn_cl")]) for r in rows
             if r["path"] == "dwconv_cl" and (r["layer"], r["pass"], "cudnn_cl") in keyed]
    parts = []
    for pass_ in dict.fromkeys(r["pass"] for r in rows):
        for stat in ("ms", "median"):
            ratios = [float(theirs[stat]) / float(ours[stat]) for ours, theirs in pairs if ours["pass"] == pass_
                      and all(row.get(stat, "") not in ("", "nan") for row in (ours, theirs))]
            if ratios:
                geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
                parts.append(f"{pass_} by {'mean' if stat == 'ms' else 'median'}: faster on {sum(r > 1 for r in ratios)} "
                             f"of {len(ratios)}, geometric mean {geomean:.2f}x")
    return "dwconv channels_last against cuDNN channels_last: " + "; ".join(parts) + "."


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(f"<!-- {p} -->")
        print(table(p))
        print()
