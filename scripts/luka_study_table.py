"""The LuKA study's table (methods/luka_clustered.md): for each WikiSalad level and setting in a sweep folder,
lenient EM with its standard error over examples, the paired difference to lined at 1/8 on the same questions,
attended tokens per layer and step, and kv_ratio.

    .venv/bin/python scripts/luka_study_table.py [results/sweeps/luka_study_paper]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from em_with_se import paired, summary  # noqa: E402

SETTINGS = {  # run-folder suffix (Hydra override dirname) -> label; differences are to lined at 1/8
    "method=full": "full attention",
    "method=luka_lined": "luka_lined (1/8)",
    "method.budget=0.3,method=luka_lined": "luka_lined budget 0.3",
    "method=luka_clustered": "luka_clustered (paper: k 3, sink 0)",
    "method.refine.k=8,method=luka_clustered": "luka_clustered refine.k=8",
    "method.refine.k=16,method=luka_clustered": "luka_clustered refine.k=16",
    "method.refine.k=16,method.sink=16,method=luka_clustered": "luka_clustered refine.k=16 sink=16",
    "method.sink=16,method=luka_clustered": "luka_clustered sink=16",
    "method.compressor=mean,method=luka_clustered": "luka_clustered compressor=mean",
}


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "results/sweeps/luka_study_paper")
    print("| level | method | examples / questions | em_lenient ± SE (examples) | − lined 1/8, paired ± SE "
          "| attended tokens / layer / step | kv_ratio |")
    print("|---|---|--:|--:|--:|--:|--:|")
    for level in ["easy", "medium", "hard", "very_hard"]:
        pre = f"data.target_chars=paper,data=wikisalad_{level},"
        base = root / (pre + "method=luka_lined")
        for key, label in SETTINGS.items():
            d = root / (pre + key)
            if not (d / "metrics.json").exists():
                continue
            s = summary(d, "em_lenient")
            m = json.loads((d / "metrics.json").read_text())
            if key == "method=luka_lined" or not (base / "predictions.jsonl").exists():
                diff = "—"
            else:
                dd, se, _ = paired(d, base, "em_lenient")
                diff = f"{dd:+.3f} ± {se:.3f}"
            print(f"| {level.replace('_', ' ')} | {label} | {s['examples']} / {s['questions']} | {s['mean']:.3f} ± "
                  f"{s['se_examples']:.3f} | {diff} | {m.get('attended_tokens') or float('nan'):.0f} | "
                  f"{m['kv_ratio']:.3f} |")


if __name__ == "__main__":
    main()
