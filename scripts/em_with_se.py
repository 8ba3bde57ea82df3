"""Mean lenient EM of run folders with two standard errors: over questions (binomial-style, treats questions as
independent) and over examples (the mean of per-example means; questions of one example share a context, so
this is the honest one). Usage: python scripts/em_with_se.py RUN_DIR [RUN_DIR ...] [--metric em_lenient]"""
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--metric", default="em_lenient")
    a = ap.parse_args()
    print(f"| run | questions | examples | {a.metric} ± SE (questions) | ± SE (examples) |\n|:--|--:|--:|--:|--:|")
    for run in [r for r in a.runs if (r / "predictions.jsonl").exists()]:
        s = summary(run, a.metric)
        print(f"| {s['run']} | {s['questions']} | {s['examples']} | {s['mean']:.3f} ± {s['se_questions']:.3f} | "
              f"± {s['se_examples']:.3f} |")


if __name__ == "__main__":
    main()
