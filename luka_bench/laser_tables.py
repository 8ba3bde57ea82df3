"""The LASER-KV paper's Tables 1 and 2 from a sweep of ``+experiment=laser_table1`` / ``laser_table2``: BABILong
accuracy (%) per row and task (QA1/2/3/5/6), mean ± one standard error over samples, n per cell, one column block
per context length, the share of supporting-fact tokens held after the prefill and the share of the context held
(the KV bytes after the prefill over full attention's: the rows hold about as much by construction); the paper's numbers printed
beside for the layout only (its model, lengths and N differ from a CPU-sized run).

Usage: python -m luka_bench.laser_tables results/sweeps/laser_table1 --table 1 --out results/summaries/laser_table1

Rows are read from each run's ``laser_row`` (set by ``conf/laser_row/<row>.yaml``); runs that did not finish are
read too and marked "(partial)".
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

ROWS = {1: ["full", "finch", "pyramidkv", "snapkv", "exact", "magicpig", "mp25", "mp50", "laser_kv"],
        2: ["full", "finch_4k", "pyramidkv", "snapkv", "laser_kv"]}
LABEL = {"full": "Full Attention", "finch": "FINCH", "finch_4k": "FINCH", "pyramidkv": "PyramidKV",
         "snapkv": "SnapKV", "exact": "Exact", "magicpig": "MagicPIG", "mp25": "Exact+MP(0.25)",
         "mp50": "Exact+MP(0.5)", "laser_kv": "Exact+MP(0.75) = LASER-KV"}
TASKS = ["qa1", "qa2", "qa3", "qa5", "qa6"]
# the paper's accuracies (%), Llama-3.1-8B-Instruct (Table 2's 128K: Llama-3-8B-Instruct-Gradient-1048k)
PAPER = {
    (1, "16k"): {"full": [58, 19, 33, 90, 68], "finch": [51, 24, 25, 85, 63], "pyramidkv": [40, 17, 14, 78, 80],
                 "snapkv": [34, 17, 13, 75, 78], "exact": [49, 20, 31, 89, 57], "magicpig": [12, 2, 11, 35, 28],
                 "mp25": [53, 15, 31, 88, 58], "mp50": [53, 15, 32, 89, 56], "laser_kv": [54, 18, 31, 91, 59]},
    (2, "64k"): {"full": [24, 6, 21, 72, 51], "finch_4k": [22, 8, 13, 44, 45], "pyramidkv": [16, 13, 25, 72, 70],
                 "snapkv": [7, 1, 15, 51, 36], "laser_kv": [25, 9, 31, 87, 48]},
    (2, "128k"): {"full": [31, 6, 15, 80, 55], "finch_4k": [0, 0, 0, 0, 0], "pyramidkv": [25, 10, 19, 84, 59],
                  "snapkv": [22, 5, 19, 84, 57], "laser_kv": [38, 7, 25, 84, 66]},
}


def mean_se(values: list[float]) -> tuple[float, float | None]:
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, None
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)


def cell(values: list[float], scale: float = 100.0) -> str:
    if not values:
        return "-"
    m, se = mean_se([v * scale for v in values])
    return f"{m:.0f} ± {se:.0f} (n={len(values)})" if se is not None else f"{m:.0f} (n=1)"


def collect(sweep: Path) -> dict:
    """{(row, length): {"records": [...], "complete": bool}} of every run folder below ``sweep``."""
    from luka_bench.results import find_runs, read_metrics, read_predictions, read_run_config

    out: dict = {}
    for run in find_runs(sweep):
        cfg = read_run_config(run / "config.yaml") or {}
        row = cfg.get("laser_row")
        if row is None:
            continue
        length = str((cfg.get("data") or {}).get("length"))
        got = out.setdefault((row, length), {"records": [], "complete": True})
        got["records"] += read_predictions(run)
        got["complete"] &= read_metrics(run)[0] is not None
    return out


def table(sweep: Path, which: int) -> str:
    runs = collect(sweep)
    lengths = sorted({length for _, length in runs}, key=lambda s: int(s.rstrip("k") or 0))
    lines = []
    for length in lengths:
        paper = PAPER.get((which, length)) or PAPER.get((which, {1: "16k"}.get(which, "")), {})
        lines += [f"### {length} tokens", "",
                  "| row | " + " | ".join(t.upper() for t in TASKS) + " | evidence held | context held | paper (%) |",
                  "|---|" + "--:|" * (len(TASKS) + 3)]
        for row in ROWS[which]:
            got = runs.get((row, length))
            if got is None:
                continue
            by_task = {t: [r["scores"]["accuracy"] for r in got["records"] if (r.get("meta") or {}).get("task") == t]
                       for t in TASKS}
            ev = [r["evidence_kept"] for r in got["records"] if r.get("evidence_kept") is not None]
            held = [r["kv_bytes_prefill"] / r["kv_bytes_full_prefill"] for r in got["records"]
                    if r.get("kv_bytes_prefill") is not None and r.get("kv_bytes_full_prefill")]
            name = LABEL[row] + ("" if got["complete"] else " (partial)")
            ref = paper.get(row)
            lines.append(f"| {name} | " + " | ".join(cell(by_task[t]) for t in TASKS) +
                         f" | {cell(ev)} | {cell(held)} | {' / '.join(map(str, ref)) if ref else '-'} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--table", type=int, choices=(1, 2), required=True)
    ap.add_argument("--out", type=Path, default=None, help="folder for table.md")
    args = ap.parse_args()
    if not args.sweep.is_dir():
        raise SystemExit(f"error: no sweep folder {args.sweep}; allowed: a folder of +experiment=laser_table"
                         f"{args.table} runs")
    text = table(args.sweep, args.table)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
