"""What a dataset gives the runner.

Two kinds of task:
- ``qa``: examples with a context and one or more questions. The runner prefills the context once
  (``Task.context_block``), lets the method compress it, then answers every question from a copy of that
  context-only cache (``Task.question_block``), greedy, and scores each answer with ``Task.score``.
- ``ppl``: documents scored by teacher-forced token-by-token decoding with the method active
  (``Task.documents``); perplexity is computed once over the corpus from token NLLs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from luka_bench.errors import OneLineError


class DataError(OneLineError, ValueError):
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


class Task:
    """The contract between a dataset and every client of the engine (the runner, the probe, the studies): every
    hook a client calls, with its default. A dataset is a dataclass (its settings, checked in ``__post_init__``)
    subclassing ``Task`` and overriding what it needs; ``conf/data/<name>.yaml`` names it as ``_target_``.

    QA datasets override ``examples``, ``context_block``, ``question_block`` and ``score`` (and ``postprocess``
    where the answer needs cutting); perplexity datasets set ``kind = "ppl"`` and override ``documents``."""

    kind: ClassVar[str] = "qa"  # "qa": examples with questions; "ppl": documents, teacher-forced
    headline: ClassVar[str] = "em_lenient"  # the metric a table shows first
    max_new_tokens: ClassVar[int] = 24  # new tokens per answer, unless the run sets max_new_tokens
    stop_strings: ClassVar[tuple[str, ...]] = ("\n",)  # greedy decoding stops once the answer contains one

    # -- checks, before the model loads -------------------------------------------------------------------------
    def check(self) -> None:
        """One-line ``DataError`` when the data cannot be read (a missing file, a bad schema)."""

    def check_model(self, model) -> None:
        """One-line error when the configured model (its loader config) cannot hold the data's lengths."""

    def hub_datasets(self) -> list[str]:
        """Hub dataset ids this configuration downloads (checked for reachability before anything runs)."""
        return []

    # -- QA --------------------------------------------------------------------------------------------------
    def prepare(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = True) -> None:
        """Called once with the model's tokenizer before ``examples``: datasets whose lengths are measured in the
        model's tokens (BABILong, RULER, NIAH) or truncated to fit it (LongBench v2) build them here."""

    def examples(self) -> list[QAExample]:
        raise NotImplementedError(f"{type(self).__name__} has no QA examples (kind={self.kind!r})")

    def context_block(self, ex: QAExample) -> str:
        """The part of the user message before the question: prefilled once, compressed by the method."""
        return ex.context

    def question_block(self, q: Question) -> str:
        return q.question

    def answer_prefix(self, q: Question) -> str:
        """Text that starts the model's answer (after the assistant header with a chat template)."""
        return ""

    def max_new_tokens_for(self, q: Question) -> int:
        """New tokens for one question (RULER: its task's ``tokens_to_generate``)."""
        return self.max_new_tokens

    def evidence_spans(self, ex: QAExample) -> list[tuple[int, int]] | None:
        """Character spans of ``context_block(ex)`` holding the facts that answer the questions (for the
        ``evidence_kept`` metric), or None."""
        return None

    def postprocess(self, generated: str) -> str:
        return generated.strip()

    def score(self, prediction: str, q: Question) -> dict[str, float]:
        raise NotImplementedError(f"{type(self).__name__} does not score answers")

    def aggregate(self, records: list[dict]) -> dict:
        """The dataset's metrics over its records (per-item scores in ``record["scores"]``)."""
        from luka_bench import metrics as M

        return M.qa_summary(records) if self.kind == "qa" else M.ppl_summary(records)

    # -- perplexity --------------------------------------------------------------------------------------------
    def documents(self, tokenizer) -> list[Document]:
        """Documents with their token ids in ``meta["ids"]``."""
        raise NotImplementedError(f"{type(self).__name__} has no documents (kind={self.kind!r})")


def check_source(dataset: str, source: str, sources: tuple[str, ...], path: str | None, file_hint: str,
                 limit: Any = None) -> None:
    """One-line errors for a dataset's ``source`` / ``path`` / ``limit`` settings: an unknown source, a file
    source without a path (``file_hint`` says what the file holds), a path without the file source, a limit
    that is not an integer >= 1 or null."""
    if source not in sources:
        raise DataError(f"data.source={source!r} is unknown for {dataset}; allowed: {', '.join(sources)}")
    if source == "file" and not path:
        raise DataError(f"data.source=file needs data.path=<{file_hint}>")
    if source != "file" and path:
        raise DataError(f"data.path={path!r} given with data.source={source}; set data.source=file")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DataError(f"data.limit={limit!r} must be an integer >= 1 or null (every item)")


def require_fields(rows, fields: tuple[str, ...], src: str, noun: str = "row",
                   strings: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Rows of a real-schema file or hub split, checked: a list of objects, each with every field present (not
    null) and a string (only the fields in ``strings`` when given: the caller checks the others). Returns the rows
    reduced to those fields; anything else is a one-line DataError naming the source, the row and the field."""
    from collections.abc import Mapping, Sequence

    names = ", ".join(fields)
    if not isinstance(rows, Sequence) or isinstance(rows, (str, bytes)):
        raise DataError(f"{src}: expected a list of {noun}s with fields {names}, got {type(rows).__name__}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DataError(f"{src}: {noun} {i} is a {type(row).__name__}, not an object with fields {names}")
        for k in fields:
            if k not in row or row[k] is None:
                raise DataError(f"{src}: {noun} {i} is missing required field {k!r} (required: {names})")
            if (strings is None or k in strings) and not isinstance(row[k], str):
                raise DataError(f"{src}: {noun} {i} field {k!r} must be a string, got {type(row[k]).__name__}")
        out.append({k: row[k] for k in fields})
    return out


def file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be read as a data file, as the end of a sentence ("was not found", "is a directory", "is a
    character device, not a regular file", ...), or None when it is a readable regular file. A device or a named
    pipe would block or never end; a directory is no file at all: each says what it is, not "not found"."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "was not found" if not os.path.islink(path) else "was not found (a broken symbolic link)"
    except NotADirectoryError:
        return "was not found (a part of its path is a file, not a folder)"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISREG(mode):
        return None if os.access(path, os.R_OK) else "is not readable (permission denied)"
    kind = ("a directory" if stat.S_ISDIR(mode) else "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else "a named pipe" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a special file")
    return "is a directory" if kind == "a directory" else f"is {kind}, not a regular file"


_JSON_LINES = (".jsonl", ".ndjson")


def read_json_or_jsonl(path: str, dataset: str):
    """A local data file: JSON, or JSON lines (one object per line). A file named ``*.jsonl`` / ``*.ndjson`` is rows,
    one per line, however many: a list also when it holds one row (as JSON, one object on one line would be that
    object). Any other name whose text is one JSON document is that document. One-line DataError naming the dataset
    and the file when it is missing, unreadable or neither."""
    import json
    from pathlib import Path

    p = Path(path)
    problem = file_problem(p)
    if problem is not None:
        raise DataError(f"{dataset}: data file {path} {problem}; allowed: a JSON or JSON-lines file")
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{dataset}: cannot read {path}: {e}") from None
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        try:
            return [json.loads(line) for line in raw.splitlines() if line.strip()]
        except json.JSONDecodeError:
            raise DataError(f"{dataset}: {path} is neither JSON nor JSON lines ({e.msg} at line {e.lineno})") from None
    if p.suffix.lower() in _JSON_LINES and not isinstance(obj, list):
        return [obj]  # JSON lines of one row
    return obj


def chat_text(tokenizer, user_message: str) -> str:
    """The chat template rendered for one user message, the assistant's turn opened: the one place a prompt meets
    a chat template. ``enable_thinking=False``: a template that can think (Qwen3 and others) renders the turn
    with thinking off, the prompt kvpress builds; a template without the switch ignores the variable."""
    return tokenizer.apply_chat_template([{"role": "user", "content": user_message}], add_generation_prompt=True,
                                         tokenize=False, enable_thinking=False)


def qa_prompt_ids(tokenizer, use_chat: bool, context_block: str, question_block: str,
                  answer_prefix: str = "") -> tuple[list[int], list[int]]:
    """Token ids of the context part and the question part of one prompt. With a chat template the user
    message is ``context_block + question_block``; the rendered text is split where the question starts, so
    the context part can be prefilled (and compressed) once and shared by all questions of an example. An
    ``answer_prefix`` (RULER's) starts the model's answer: after the assistant header with a chat template."""
    if use_chat:
        marker = "\u2063LUKASPLIT\u2063"
        text = chat_text(tokenizer, context_block + marker + question_block)
        pre, post = text.split(marker)
        return (tokenizer(pre, add_special_tokens=False).input_ids,
                tokenizer(post + answer_prefix, add_special_tokens=False).input_ids)
    return (tokenizer(context_block, add_special_tokens=True).input_ids,
            tokenizer(question_block + answer_prefix, add_special_tokens=False).input_ids)


def evidence_positions(tokenizer, use_chat: bool, context_block: str, spans: list[tuple[int, int]]) -> list[int]:
    """Token positions (into the context part of the prompt, ``qa_prompt_ids``' first list) of the tokens that
    overlap the character ``spans`` of ``context_block`` (e.g. BABILong's supporting facts). Needs a fast
    tokenizer (offset mapping)."""
    if not spans:
        return []
    if use_chat:
        marker = "\u2063LUKASPLIT\u2063"
        text = chat_text(tokenizer, context_block + marker + "x")
        pre = text.split(marker)[0]
        enc = tokenizer(pre, add_special_tokens=False, return_offsets_mapping=True)
    else:
        pre = context_block
        enc = tokenizer(pre, add_special_tokens=True, return_offsets_mapping=True)
    shift = pre.rfind(context_block)
    if shift < 0:
        raise ValueError("the context block does not appear in the rendered prompt")
    out = []
    for i, (a, b) in enumerate(enc["offset_mapping"]):
        if b > a and any(a < shift + e and b > shift + s for s, e in spans):
            out.append(i)
    return out
