"""LongBench v2 scoring, as the official ``pred.py`` / ``result.py`` (THUDM/LongBench) do it. Pure functions.

Answer extraction: remove every ``*`` (markdown bold), then the first match of
``The correct answer is \\(([A-D])\\)``, else of ``The correct answer is ([A-D])``; nothing extracted = wrong.
Accuracy overall and by difficulty (easy / hard) and by length (short / medium / long).
"""
from __future__ import annotations

import re

__all__ = ["extract_answer", "is_correct", "accuracy_summary", "DIFFICULTIES", "LENGTHS"]

DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")

_PAREN = re.compile(r"The correct answer is \(([A-D])\)")
_BARE = re.compile(r"The correct answer is ([A-D])")


def extract_answer(response: str) -> str | None:
    """The letter the response commits to, or None."""
    response = response.replace("*", "")
    m = _PAREN.search(response) or _BARE.search(response)
    return m.group(1) if m else None


def is_correct(response: str, answer: str) -> bool:
    pred = extract_answer(response)
    return pred is not None and pred == answer.strip()


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def accuracy_summary(records: list[dict]) -> dict[str, float | None]:
    """``accuracy`` and ``accuracy_{easy,hard,short,medium,long}`` (None for a group with no item) from the
    runner's per-question records (``scores["accuracy"]``, ``meta["difficulty"]``, ``meta["length"]``)."""
    acc = [float(r["scores"]["accuracy"]) for r in records]
    out: dict[str, float | None] = {"accuracy": _mean(acc)}
    for key, groups in (("difficulty", DIFFICULTIES), ("length", LENGTHS)):
        for g in groups:
            out[f"accuracy_{g}"] = _mean([a for a, r in zip(acc, records) if (r.get("meta") or {}).get(key) == g])
    return out
