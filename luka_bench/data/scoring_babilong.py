"""BABILong scoring, as the official ``babilong/metrics.py`` (booydar/babilong) does it. Pure functions.

A prediction is correct when, after preprocessing, the set of the task's label words found in it (substring
matching), minus the labels that also occur in the question, is exactly the target (qa8: all comma-separated
sub-targets and nothing else).

Preprocessing, in the official order: lower-case; keep the text before the first ``.``; cut at ``<context>``;
cut at ``<example>``; cut at ``Question``. Because the text is already lower-case when it is cut at the
capitalised ``Question``, that last cut never fires. This quirk is kept on purpose (published numbers were
computed this way); ``official_quirk=False`` cuts at ``question`` instead.

Two consequences of substring matching worth knowing (both official, both kept): in qa7 the label ``one`` is a
substring of ``none``, so a correct ``none`` is never scored correct; ``no`` matches inside words such as
``not`` or ``know`` in qa6/qa9/qa10.
"""
from __future__ import annotations

from collections.abc import Iterable

__all__ = ["TASK_LABELS", "preprocess_output", "compare_answers", "accuracy_summary"]

TASK_LABELS: dict[str, tuple[str, ...]] = {
    "qa1": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "qa2": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "qa3": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "qa4": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "qa5": ("Bill", "Fred", "Jeff", "Mary", "apple", "football", "milk"),
    "qa6": ("no", "yes"),
    "qa7": ("none", "one", "three", "two"),
    "qa8": ("apple", "football", "milk", "nothing"),
    "qa9": ("no", "yes"),
    "qa10": ("maybe", "no", "yes"),
    "qa11": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "qa12": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "qa13": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "qa14": ("bedroom", "cinema", "kitchen", "office", "park", "school"),
    "qa15": ("cat", "mouse", "sheep", "wolf"),
    "qa16": ("gray", "green", "white", "yellow"),
    "qa17": ("no", "yes"),
    "qa18": ("no", "yes"),
    "qa19": ("e,e", "e,n", "e,s", "n,e", "n,n", "n,w", "s,e", "s,s", "s,w", "w,n", "w,s", "w,w"),
    "qa20": ("bedroom", "bored", "garden", "hungry", "kitchen", "thirsty", "tired"),
}


def preprocess_output(output: str, official_quirk: bool = True) -> str:
    """Lower-case, first sentence, cut where the model starts writing a new context/example/question."""
    out = output.lower()
    out = out.split(".")[0]
    out = out.split("<context>")[0]
    out = out.split("<example>")[0]
    out = out.split("Question" if official_quirk else "question")[0]
    return out


def compare_answers(target: str, output: str, question: str, labels: Iterable[str],
                    official_quirk: bool = True) -> bool:
    """True when the labels in ``output`` (minus those in ``question``) are exactly ``target``."""
    out = preprocess_output(output, official_quirk)
    target = target.lower()
    labels = {lab.lower() for lab in labels}
    in_question = {lab for lab in labels if lab in question.lower()}
    in_output = {lab for lab in labels if lab in out} - in_question
    if "," in target and len(target) > 3:  # qa8: several sub-targets (qa19's "n,e" labels are 3 characters)
        subs = target.split(",")
        return all(t in in_output for t in subs) and len(in_output) == len(subs)
    return target in in_output and len(in_output) == 1


def accuracy_summary(records: list[dict]) -> dict[str, float | None]:
    """``accuracy`` (mean over tasks of the per-task accuracy) and ``accuracy_<task>`` for every task present.

    Records are the runner's per-question records: ``scores["accuracy"]`` and ``meta["task"]``.
    """
    by_task: dict[str, list[float]] = {}
    for r in records:
        task = str((r.get("meta") or {}).get("task", "all"))
        by_task.setdefault(task, []).append(float(r["scores"]["accuracy"]))
    per = {t: sum(v) / len(v) for t, v in by_task.items() if v}
    out: dict[str, float | None] = {"accuracy": sum(per.values()) / len(per) if per else None}
    for t in sorted(per, key=lambda t: (len(t), t)):
        out[f"accuracy_{t}"] = per[t]
    return out
