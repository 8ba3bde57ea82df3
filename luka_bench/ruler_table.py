"""RULER / NIAH summary tables from a sweep folder's predictions: task x method (RULER) or depth x length per
method (NIAH), mean ± one standard error over samples and n, full attention first. Runs that did not finish
are read too: their finished tasks are shown, the rest marked "-", and the column is labelled "(partial)".

Usage: python -m luka_bench.ruler_table results/sweeps/<ruler sweep> --out results/summaries/ruler
       python -m luka_bench.ruler_table results/sweeps/<niah sweep> --niah --out results/summaries/niah

Run folders are read through the report's loaders (``luka_bench.results``).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import yaml

from luka_bench.data.ruler import TASKS
from luka_bench.data.scoring_ruler import headline_rule, mean_se
from luka_bench.stats import paired_difference


def qa_origin(cfg: dict) -> str:
    """Where a run's qa_1/qa_2 come from, by its saved data settings (``Ruler.qa_origin``): ``hub``,
    ``synthetic``, ``file``, or ``unknown`` when config.yaml does not say."""
    data = cfg.get("data") if isinstance(cfg.get("data"), dict) else {}
    source = data.get("source")
    if source == "synthetic":
        return str(data.get("qa_source", "synthetic"))
    return source if source in ("hub", "file") else "unknown"


def runs(sweep: Path) -> list[tuple[str, bool, list[dict], str]]:
    """(method, complete, records, QA origin) of every run folder below ``sweep``, full first, then the sweep's
    order. A sweep over several context lengths names each run ``method@length`` (shortest length first)."""
    from luka_bench.results import find_runs, read_metrics, read_predictions, read_run_config

    out = []
    for run in find_runs(sweep):
        cfg = read_run_config(run / "config.yaml") or {}
        done = read_metrics(run)[0] is not None
        data = cfg.get("data") if isinstance(cfg.get("data"), dict) else {}
        out.append((str(cfg.get("method_name")), done, read_predictions(run), qa_origin(cfg), data.get("length")))
    order = []
    mr = sweep / "multirun.yaml"
    if mr.is_file():
        for o in (yaml.safe_load(mr.read_text()).get("hydra", {}).get("overrides", {}).get("task") or []):
            if o.startswith(("method=", "+lychee_row=")):
                order = o.split("=", 1)[1].split(",")
    rank = {m: i for i, m in enumerate(["full"] + [m for m in order if m != "full"])}
    lengths = sorted({r[4] for r in out}, key=lambda x: (str(type(x)), x))
    several = len(lengths) > 1
    out.sort(key=lambda r: (lengths.index(r[4]) if several else 0, rank.get(r[0], len(rank)), r[0]))
    return [((f"{m}@{n}" if several else m), done, recs, origin) for m, done, recs, origin, n in out]


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    m, se = mean_se(values)
    return f"{m:.1f} ± {se:.1f}" if se is not None else f"{m:.1f} (n=1)"


def task_mean(d: dict[str, list[float]], tasks) -> tuple[float, float | None, bool]:
    """Mean of the task means over ``tasks``, its SE (sqrt(sum SE_t^2)/T; with one sample per task, the SE over
    those T items, which mixes task difficulty into it) and whether that one-sample rule was used."""
    stats = [mean_se(d[t]) for t in tasks]
    mu = sum(s[0] for s in stats) / len(stats)
    ses = [s[1] for s in stats]
    if all(x is not None for x in ses):
        return mu, math.sqrt(sum(x * x for x in ses)) / len(ses), False
    if all(len(d[t]) == 1 for t in tasks):
        return mu, mean_se([d[t][0] for t in tasks])[1], True
    return mu, None, False


def ruler_table(sweep: Path) -> tuple[str, list[dict]]:
    rs = runs(sweep)
    head = ["task"] + [m + ("" if done else " (partial)") for m, done, _, _ in rs]
    rows, csv = [], []
    per_method_task: list[dict[str, list[float]]] = []
    for m, _, recs, _ in rs:
        d: dict[str, list[float]] = {}
        for r in recs:
            d.setdefault(r["meta"]["task"], []).append(float(r["scores"]["ruler"]))
        per_method_task.append(d)
    # the tasks the sweep ran (all 13, or a paper's subset: then the score is over those and is no RULER score)
    ran = [t for t in TASKS if any(t in d for d in per_method_task)] or list(TASKS)
    subset = len(ran) < len(TASKS)
    for t in ran:
        rows.append([t] + [cell(d.get(t, [])) for d in per_method_task])
        for (m, _, _, _), d in zip(rs, per_method_task):
            if d.get(t):
                mu, se = mean_se(d[t])
                csv.append({"method": m, "task": t, "mean": mu, "se": se, "n": len(d[t])})
    one_each = False
    niah = [t for t in ran if t.startswith("niah")]
    # the headline's rule, per column (the tasks it averages, where its QA comes from, whether it is comparable)
    rules = [headline_rule(list(TASKS), origin) for _, _, _, origin in rs]
    comparable = bool(rules) and all(r["ruler_score_comparable"] for r in rules)
    score_label = ("**RULER score** (mean over the 13 tasks; " + ("real QA: comparable with published RULER scores)"
             if comparable else "NOT comparable with published RULER scores: see below)"))
    if subset:
        score_label = f"**mean over the {len(ran)} tasks run** (a subset of RULER: not a RULER score)"
    for label, tasks, bold in ((score_label, ran, True),
                               (f"niah tasks (mean over the {len(niah)} niah_* tasks)", niah, False)):
        row = [label]
        for d in per_method_task:
            if all(t in d for t in tasks):
                mu, se, one = task_mean(d, tasks)
                one_each = one_each or one
                row.append((f"**{mu:.1f}**" if bold else f"{mu:.1f}") + (f" ± {se:.1f}" if se is not None else ""))
            else:
                row.append(f"- ({sum(t in d for t in tasks)}/{len(tasks)} tasks)")
        rows.append(row)
    # paired with full attention on the same samples (same seed: identical prompts and item ids), SE over the
    # paired items (``stats.paired_difference``)
    fulls = {m.partition("@")[2]: recs for m, _, recs, _ in rs if m.partition("@")[0] == "full"}
    if fulls:
        diff = ["difference from full (paired items" + (")" if "" in fulls else ", same length)")]
        for (m, _, recs, _), d in zip(rs, per_method_task):
            ref = fulls.get(m.partition("@")[2])
            p = paired_difference(recs, ref, "ruler") if ref is not None else {"n": 0}
            if all(t in d for t in ran) and p["n"]:
                diff.append(f"{p['mean']:+.1f}" + (f" ± {p['se']:.1f}" if p["se"] is not None else ""))
            else:
                diff.append("-")
        rows.append(diff)
    n = sorted({len(v) for d in per_method_task for v in d.values()})
    md = "| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
    md += "".join("| " + " | ".join(r) + " |\n" for r in rows)
    md += (f"\nRULER score per task, 0-100 (RULER's string_match_all; qa: string_match_part), mean ± one standard "
           f"error over samples; n = {', '.join(map(str, n))} sample(s) per task (n=1: no standard error). "
           f"The overall score is the mean of the {len(ran)} task means (its SE: sqrt(sum SE_t^2)/{len(ran)}"
           + (f"; with one sample per task: the SE over the {len(ran)} items, which mixes task difficulty into it"
              if one_each else "") + "); the niah row likewise over the niah_* tasks only. The paired difference is "
           "over the items both methods answered.\n")
    by_rule: dict[str, list[str]] = {}
    for (m, _, _, _), r in zip(rs, rules):
        by_rule.setdefault(str(r["ruler_score_rule"]), []).append(m)
    for rule, methods in by_rule.items():
        md += f"\nHeadline ({'every method' if len(by_rule) == 1 else ', '.join(methods)}): {rule}.\n"
    return md, csv


def protocol_table(sweep: Path, other: Path, names: tuple[str, str]) -> str:
    """Per method: its RULER score in ``sweep`` and in ``other`` (the same items run under another protocol, e.g.
    query-aware against the default) and the paired difference over the items both answered (``sweep`` minus
    ``other``, SE clustered by example), how many of them changed their score, and each one's difference from full
    attention in its own sweep."""
    mine = {m: recs for m, _, recs, _ in runs(sweep)}
    theirs = {m: recs for m, _, recs, _ in runs(other)}

    def score(recs):
        d: dict[str, list[float]] = {}
        for r in recs:
            d.setdefault(r["meta"]["task"], []).append(float(r["scores"]["ruler"]))
        if not all(t in d for t in TASKS):
            return "-"
        mu, se, _ = task_mean(d, list(TASKS))
        return f"{mu:.1f}" + (f" ± {se:.1f}" if se is not None else "")

    def paired(a, b):
        p = paired_difference(a, b, "ruler")
        return f"{p['mean']:+.1f} ± {p['se']:.1f}" if p["n"] and p["se"] is not None else "-", p["n"]

    a, b = names
    md = (f"| method | {a} | {b} | {a} − {b}, paired (items) | items whose score changed | − full, {a} | − full, {b} |"
          "\n|---|--:|--:|--:|--:|--:|--:|\n")
    for m in [m for m in mine if m in theirs]:
        diff, n = paired(mine[m], theirs[m])
        ref = {r["item_id"]: r["scores"]["ruler"] for r in theirs[m]}
        changed = sum(1 for r in mine[m] if r["item_id"] in ref and r["scores"]["ruler"] != ref[r["item_id"]])
        vs_full = [paired(x[m], x["full"])[0] if m != "full" and "full" in x else "—" for x in (mine, theirs)]
        md += f"| {m} | {score(mine[m])} | {score(theirs[m])} | {diff} ({n}) | {changed} | {vs_full[0]} | {vs_full[1]} |\n"
    return md


def niah_table(sweep: Path) -> tuple[str, list[dict]]:
    pooled: dict[str, tuple[bool, list[dict]]] = {}  # a method's runs (e.g. a 1-4K sweep and an 8K one) pooled
    for m, done, recs, _ in runs(sweep):
        was_done, was = pooled.get(m, (True, []))
        pooled[m] = (was_done and done, was + recs)
    md, csv = "", []
    for m, (done, recs) in pooled.items():
        lengths = sorted({r["meta"]["length"] for r in recs})
        depths = sorted({r["meta"]["depth"] for r in recs})
        allv = [float(r["scores"]["niah"]) for r in recs]
        title = f"### {m}{'' if done else ' (partial)'}: mean {cell(allv)} over {len(allv)} cells\n\n"
        md += title + "| depth \\ length | " + " | ".join(map(str, lengths)) + " |\n|" + "---|" * (len(lengths) + 1)
        md += "\n"
        for d in depths:
            vals = []
            for ln in lengths:
                v = [float(r["scores"]["niah"]) for r in recs if r["meta"]["depth"] == d and r["meta"]["length"] == ln]
                vals.append(cell(v) if len(v) > 1 else (f"{v[0]:.0f}" if v else "-"))
                if v:
                    csv.append({"method": m, "depth": d, "length": ln, "mean": sum(v) / len(v), "n": len(v)})
            md += f"| {d:g}% | " + " | ".join(vals) + " |\n"
        md += "\n"
    md += ("NIAH score, 0-100 (100: the answer holds the needle's 7-digit value; RULER's string_match_all), one "
           "sample per cell unless marked; a method's mean ± one standard error is over its cells.\n")
    return md, csv


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("sweep")
    p.add_argument("--niah", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--against", default=None, help="another sweep of the same items (another protocol): writes "
                   "protocols.md, each method's score in both and their paired difference")
    p.add_argument("--names", nargs=2, default=("this sweep", "the other"), metavar=("THIS", "OTHER"))
    a = p.parse_args()
    if a.against:
        md = protocol_table(Path(a.sweep), Path(a.against), tuple(a.names))
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "protocols.md").write_text(md, encoding="utf-8")
        print(md)
    md, rows = (niah_table if a.niah else ruler_table)(Path(a.sweep))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(md, encoding="utf-8")
    keys = list(rows[0]) if rows else []
    (out / "table.csv").write_text(",".join(keys) + "\n" + "".join(",".join(str(r[k]) for k in keys) + "\n"
                                                                  for r in rows), encoding="utf-8")
    print(md)


if __name__ == "__main__":
    main()
