"""The LuKA study's table (methods/luka_clustered.md) and the Table-1 layout (conf/experiment/luka_table1.yaml):
for each WikiSalad level and run in a sweep folder, lenient EM with its standard error clustered by example (``luka_bench.stats``), the paired
difference to lined at 1/8 on the same questions, attended tokens per layer and step, and kv_ratio. Every row
names the rules its run used, read from the run's own ``config.yaml``: ``mass: exact`` (the reference code's
corrected refinement mass, the default) or ``mass: parent`` (eq. 3 of the paper) for clustered layers; ``tail on
top`` (1/8 heavy hitters + the 128-token tail: the paper's reading, the default) or ``tail inside`` (the tail
counted in the 1/8; every run before ``recent_budget`` existed) for lined layers.

    .venv/bin/python scripts/luka_study_table.py [results/sweeps/luka_study_paper]
    .venv/bin/python scripts/luka_study_table.py results/sweeps/luka_table1
"""
from __future__ import annotations

import sys
from pathlib import Path


from luka_bench.results import find_runs, read_metrics, read_predictions, read_run_config
from luka_bench.stats import cluster_of, mean_se, paired_difference

LEVELS = ["easy", "medium", "hard", "very_hard"]
ORDER = ["full", "luka_lined", "luka_clustered", "luka_mixed"]
IGNORED = ("data", "data.target_chars", "data.limit", "threads", "sweep_name")


def rules(method: dict) -> list[str]:
    """The rules a run's method config used, as short labels (lined tail budget, clustered refinement mass)."""
    out = []
    target = str(method.get("_target_", ""))
    lined = method if target.endswith("h2o.H2O") else None
    clustered = method if target.endswith("LuKAClustered") else None
    if target.endswith("layered.Layered"):  # luka_mixed: lined outer layers, clustered default
        lined = (method.get("rules") or [{}])[0].get("method")
        clustered = method.get("default")
    if lined is not None and int(lined.get("min_recent") or 0) > 0:
        where = lined.get("recent_budget", "inside")  # runs before the setting existed counted it inside
        out.append("tail on top of the 1/8" if where == "on_top" else "tail inside the 1/8")
    if clustered is not None:
        mass = (clustered.get("refine") or {}).get("mass", "exact")
        out.append("mass: parent (eq. 3)" if mass == "parent" else "mass: exact (reference code)")
    return out


def parse(run: Path) -> tuple[str, str, dict]:
    """(level, method name, other overrides) from a Hydra override dirname like
    ``data.target_chars=paper,data=wikisalad_easy,method.refine.k=16,method=luka_clustered``."""
    ov = dict(kv.split("=", 1) for kv in run.name.split(",") if "=" in kv)
    level = ov.get("data", "").removeprefix("wikisalad_")
    return level, ov.get("method", ""), {k: v for k, v in ov.items() if k not in IGNORED and k != "method"}


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "results/sweeps/luka_study_paper")
    runs = [d for d in find_runs(root) if d != root and read_metrics(d)[0] is not None]  # finished runs
    print("| level | method | rules | examples / questions | em_lenient ± SE (examples) | − lined 1/8, paired ± SE "
          "| attended tokens / layer / step | kv_ratio |")
    print("|---|---|---|--:|--:|--:|--:|--:|")
    for level in LEVELS:
        rows = [(parse(d), d) for d in runs if parse(d)[0] == level]
        rows.sort(key=lambda r: (ORDER.index(r[0][1]) if r[0][1] in ORDER else len(ORDER), sorted(r[0][2].items())))
        base = next((d for (lv, m, ov), d in rows if m == "luka_lined" and not ov), None)
        for (_, method, ov), d in rows:
            cfg = read_run_config(d / "config.yaml") or {}
            label = " ".join([method] + [f"{k.removeprefix('method.')}={v}" for k, v in sorted(ov.items())])
            recs = read_predictions(d)
            s = mean_se([float(r["scores"]["em_lenient"]) for r in recs], [cluster_of(r) for r in recs])
            m = read_metrics(d)[0]
            if base is None or d == base:
                diff = "—"
            else:
                p = paired_difference(recs, read_predictions(base), "em_lenient")
                diff = f"{p['mean']:+.3f} ± {p['se']:.3f}"
            print(f"| {level.replace('_', ' ')} | {label} | {'; '.join(rules(cfg.get('method') or {})) or '—'} | "
                  f"{s['clusters']} / {s['n']} | {s['mean']:.3f} ± {s['se']:.3f} | {diff} | "
                  f"{m.get('attended_tokens') or float('nan'):.0f} | {m['kv_ratio']:.3f} |")


if __name__ == "__main__":
    main()
