"""Mean lenient EM of run folders with two standard errors: over questions (binomial-style, treats questions as
independent) and over examples (the mean of per-example means; questions of one example share a context, so
this is the honest one). Usage: python scripts/em_with_se.py RUN_DIR [RUN_DIR ...] [--metric em_lenient] [--paired BASE_RUN_DIR]

--paired adds each run's difference to BASE on the questions both answered (same item ids), with the standard
error over examples of the per-example mean differences (paired: the context's difficulty cancels)."""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path


def summary(run: Path, metric: str) -> dict:
    rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines() if line.strip()]
    xs = [float(r["scores"][metric]) for r in rows]
    by_ex = defaultdict(list)
    for r in rows:
        by_ex[r["example_id"]].append(float(r["scores"][metric]))
    ex = [sum(v) / len(v) for v in by_ex.values()]

    def se(v):
        if len(v) < 2:
            return float("nan")
        m = sum(v) / len(v)
        return math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v))

    return {"run": run.name, "questions": len(xs), "examples": len(ex), "mean": sum(xs) / max(1, len(xs)),
            "se_questions": se(xs), "mean_of_examples": sum(ex) / max(1, len(ex)), "se_examples": se(ex)}


def scores(run: Path, metric: str) -> dict[str, tuple[str, float]]:
    rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines() if line.strip()]
    return {r["item_id"]: (r["example_id"], float(r["scores"][metric])) for r in rows}


def paired(run: Path, base: Path, metric: str) -> tuple[float, float, int]:
    """Mean difference run - base over shared questions, its SE over examples, and the number of questions."""
    a, b = scores(run, metric), scores(base, metric)
    by_ex = defaultdict(list)
    for k in a.keys() & b.keys():
        by_ex[a[k][0]].append(a[k][1] - b[k][1])
    diffs = [x for v in by_ex.values() for x in v]
    ex = [sum(v) / len(v) for v in by_ex.values()]
    if len(ex) < 2:
        return float("nan"), float("nan"), len(diffs)
    m = sum(ex) / len(ex)
    se = math.sqrt(sum((x - m) ** 2 for x in ex) / (len(ex) - 1) / len(ex))
    return sum(diffs) / len(diffs), se, len(diffs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--metric", default="em_lenient")
    ap.add_argument("--paired", type=Path, default=None, help="base run folder for paired differences")
    a = ap.parse_args()
    extra = " | − base, paired ± SE (examples) |" if a.paired else " |"
    print(f"| run | questions | examples | {a.metric} ± SE (questions) | ± SE (examples){extra}\n"
          + "|:--|--:|--:|--:|--:|" + ("--:|" if a.paired else ""))
    for run in [r for r in a.runs if (r / "predictions.jsonl").exists()]:
        s = summary(run, a.metric)
        line = (f"| {s['run']} | {s['questions']} | {s['examples']} | {s['mean']:.3f} ± {s['se_questions']:.3f} | "
                f"± {s['se_examples']:.3f} |")
        if a.paired:
            d, se, n = paired(run, a.paired, a.metric)
            line += f" {d:+.3f} ± {se:.3f} ({n} q) |"
        print(line)


if __name__ == "__main__":
    main()
