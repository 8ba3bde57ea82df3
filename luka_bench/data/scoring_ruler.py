"""RULER's scoring rule (NVIDIA/RULER ``scripts/eval``), as pure functions of predictions and references.

- A prediction is cleaned as RULER's ``postprocess_pred``: stripped, every control character (U+0000-U+001F)
  turned into a newline, stripped again.
- ``string_match_all`` (niah, vt, cwe, fwe): the share of the references that occur in the prediction,
  case-insensitive; ``string_match_part`` (qa): 1 when any reference occurs in it.
- Per task: the mean over samples x 100; the RULER score: the mean of the per-task scores.

Per item the runner stores ``scores["ruler"]`` already x 100 (0-100, as RULER reports), so a table's mean is
the task score. Standard errors are over samples (``std / sqrt(n)``, n-1 in the variance); the overall
score's is that of a mean of independent task means, ``sqrt(sum se_t^2) / T``.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

__all__ = ["clean_prediction", "string_match_all", "string_match_part", "METRIC_BY_TASK", "score_item",
           "mean_se", "ruler_summary", "QA_ORIGINS", "headline_rule"]

_CONTROL = re.compile(r"[\x00-\x1f]")

# The 13 tasks of scripts/synthetic.yaml -> the metric of their task family (scripts/eval/synthetic/constants.py).
METRIC_BY_TASK = {
    **{t: "all" for t in ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                          "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")},
    "qa_1": "part", "qa_2": "part",
}


def clean_prediction(text: str) -> str:
    """RULER's ``postprocess_pred``: strip, control characters -> newline, strip."""
    return _CONTROL.sub("\n", text.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Share (0-1) of ``references`` found in ``prediction``, case-insensitive."""
    p = prediction.lower()
    return sum(r.lower() in p for r in references) / len(references) if references else 0.0


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any of ``references`` is in ``prediction`` (case-insensitive), else 0.0."""
    p = prediction.lower()
    return float(any(r.lower() in p for r in references))


def score_item(task: str, prediction: str, references: Sequence[str]) -> float:
    """One sample's RULER score, 0-100, by its task's metric (unknown task names: ``string_match_all``)."""
    fn = string_match_part if METRIC_BY_TASK.get(task) == "part" else string_match_all
    return 100.0 * fn(clean_prediction(prediction), list(references))


def mean_se(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (None for a single value): ``stats.mean_se`` as a pair."""
    from luka_bench.stats import mean_se as _mean_se

    r = _mean_se(list(values))
    return r["mean"], r["se"]


def ruler_summary(records: Iterable[dict], prefix: str = "ruler") -> dict[str, float | None]:
    """``{prefix}_score`` (mean of per-task means), ``{prefix}_<task>``, their ``_se`` and ``_n``.

    Records are the runner's: ``scores[prefix]`` (0-100) and ``meta["task"]``."""
    by_task: dict[str, list[float]] = {}
    for r in records:
        task = str((r.get("meta") or {}).get("task", "all"))
        by_task.setdefault(task, []).append(float(r["scores"][prefix]))
    out: dict[str, float | None] = {}
    per: dict[str, tuple[float, float | None]] = {t: mean_se(v) for t, v in by_task.items() if v}
    if not per:
        return {f"{prefix}_score": None}
    ses = [se for _, se in per.values()]
    out[f"{prefix}_score"] = sum(m for m, _ in per.values()) / len(per)
    out[f"{prefix}_score_se"] = (math.sqrt(sum(se * se for se in ses)) / len(per)
                                 if all(se is not None for se in ses) else None)
    order = list(METRIC_BY_TASK)
    for t in sorted(per, key=lambda t: (order.index(t) if t in order else len(order), t)):
        out[f"{prefix}_{t}"], out[f"{prefix}_{t}_se"] = per[t]
        out[f"{prefix}_{t}_n"] = len(by_task[t])
    return out


# Where qa_1/qa_2's documents and questions come from, as a run's settings say: ``hub`` the real SQuAD v2 /
# HotpotQA (data.qa_source=hub, or data.source=hub: the leaderboard's set, made by RULER's own scripts),
# ``synthetic`` invented stand-ins (data.qa_source=synthetic, offline), ``file`` rows from a file, whose origin a
# run cannot tell, ``unknown`` a saved run whose settings do not say (luka_bench/ruler_table.py).
QA_ORIGINS = {
    "hub": "qa_1/qa_2 are the real SQuAD v2 / HotpotQA",
    "synthetic": "qa_1/qa_2 are offline stand-ins (invented articles, data.qa_source=synthetic), not SQuAD/HotpotQA",
    "file": "qa_1/qa_2 come from a file, whose QA source cannot be told",
    "unknown": "the run's settings do not say where qa_1/qa_2 come from",
}


def headline_rule(tasks: Iterable[str], qa: str | None) -> dict[str, object]:
    """What ``ruler_score`` averages and whether it can be set beside a published RULER score: only when it is the
    mean over all 13 of RULER's tasks and qa_1/qa_2 are the real SQuAD/HotpotQA (``qa`` = ``hub``). ``tasks``:
    the tasks averaged; ``qa``: a key of ``QA_ORIGINS`` (None: no qa task ran).

    Returns ``ruler_score_tasks`` (their names, comma-joined), ``ruler_qa`` (``qa``, or None without a qa task),
    ``ruler_score_comparable`` (bool) and ``ruler_score_rule`` (one line that says all of it)."""
    order = list(METRIC_BY_TASK)
    tasks = sorted(set(tasks), key=lambda t: (order.index(t) if t in order else len(order), t))
    has_qa = any(METRIC_BY_TASK.get(t) == "part" for t in tasks)
    if has_qa and qa not in QA_ORIGINS:
        raise ValueError(f"qa={qa!r} is unknown; allowed: {', '.join(QA_ORIGINS)}")
    all13 = set(tasks) == set(METRIC_BY_TASK)
    why_not = ([] if all13 else [f"{len(tasks)} of RULER's 13 tasks"]) + \
        (["its QA is not the real SQuAD/HotpotQA"] if has_qa and qa != "hub" else [])
    comparable = not why_not
    rule = (f"ruler_score = mean of {len(tasks)} task means ("
            + ("all 13 RULER tasks" if all13 else ", ".join(tasks)) + ")"
            + (f"; {QA_ORIGINS[qa]}" if has_qa else "")
            + ("; comparable with a published RULER score (its 13 tasks, real QA)" if comparable
               else f"; NOT comparable with a published RULER score ({'; '.join(why_not)})"))
    return {"ruler_score_tasks": ",".join(tasks), "ruler_qa": qa if has_qa else None,
            "ruler_score_comparable": comparable, "ruler_score_rule": rule}
