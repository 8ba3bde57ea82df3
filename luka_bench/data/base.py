"""What a dataset gives the runner.

Two kinds of task:
- ``qa``: examples with a context and one or more questions. The runner prefills the context once
  (``Task.context_block``), lets the method compress it, then answers every question from a copy of that
  context-only cache (``Task.question_block``), greedy, and scores each answer with ``Task.score``.
- ``ppl``: documents scored by teacher-forced token-by-token decoding with the method active
  (``Task.documents``); perplexity is computed once over the corpus from token NLLs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class DataError(ValueError):
    """Bad data input (missing file, missing field, unknown source). The message is one line."""


@dataclass
class Question:
    id: str
    question: str
    answers: list[str]  # gold answers; empty list = unanswerable (SQuAD v2)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class QAExample:
    id: str
    context: str
    questions: list[Question]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Document:
    id: str
    text: str
    meta: dict[str, Any] = field(default_factory=dict)
