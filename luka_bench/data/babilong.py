"""BABILong (Kuratov et al., 2024; booydar/babilong): bAbI facts hidden in long haystack text.

Sources (all end up as the same rows ``{input, question, target}`` of the hub dataset):
- ``hf``: Hugging Face ``RMT-team/babilong`` (config = length, split = task), via ``datasets.load_dataset``;
- ``file``: a local JSON / JSON-lines file in that schema (``path``);
- ``synthetic`` (offline default): stories from the project's bAbI-world simulator
  (:mod:`luka_bench.data.bab_world`) with their facts scattered, in order, through haystack text (Paul Graham's
  essays offline, pg19 books or any text file otherwise) up to the target length.

One run is one length and one task or several (``task: qa1`` or ``task: qa1,qa2`` / ``[qa1, qa2]``). Each sample
is one example with one question. The prompt is the official structure, with instruction, examples and
post-prompt texts written for this project; the official scoring rule is in
:mod:`luka_bench.data.scoring_babilong`. See ``datasets/babilong.md``.
"""
from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from luka_bench.data.bab_world import TASKS as SYNTHETIC_TASKS
from luka_bench.data.bab_world import generate_story
from luka_bench.data.base import (Task, DataError, QAExample, Question, check_source, file_problem, read_json_or_jsonl,
                                  require_fields)
from luka_bench.data.scoring_babilong import TASK_LABELS, accuracy_summary, compare_answers

__all__ = [
    "BABILong", "PROMPTS", "LENGTHS", "TEMPLATE", "HUB_ID", "target_tokens", "load_rows_file", "validate_rows",
    "haystack_sentences", "scatter_facts", "approx_tokens", "format_prompt",
]

HUB_ID = "RMT-team/babilong"
SOURCES = ("synthetic", "hf", "file")
LENGTHS = ("0k", "1k", "2k", "4k", "8k", "16k", "32k", "64k", "128k", "256k", "512k", "1M")
FIELDS = ("input", "question", "target")
PROMPT_RESERVE = 300  # the official generator leaves 300 tokens of each length for the prompt
CHARS_PER_TOKEN = 4  # the approximation used when no tokenizer is given (see approx_tokens)
MIN_SENTENCE_CHARS = 40  # haystack sentences shorter than this are skipped (the official skips < 10 tokens)

TEMPLATE = "{instruction}\n\n{examples}\n\n{post_prompt}\n\n<context>\n{context}\n</context>\n\nQuestion: {question}"


def target_tokens(length: str) -> int:
    """Tokens of context (facts + haystack) for a length name, as the official generator: ``N*1000 - 300``
    (``0k``: the facts alone)."""
    if length not in LENGTHS:
        raise DataError(f"data.length={length!r} is unknown for babilong; allowed: {', '.join(LENGTHS)}")
    n = 1_000_000 if length == "1M" else int(length[:-1]) * 1000
    return max(0, n - PROMPT_RESERVE)


def approx_tokens(text: str) -> int:
    """Length approximation used when no tokenizer is available: ceil(characters / 4)."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


# ---------------------------------------------------------------------------------------------------------------
# prompts: the official structure, texts written for this project
# ---------------------------------------------------------------------------------------------------------------

_LOC_INSTR = ("The context below hides a few short facts about people moving from place to place among unrelated "
              "text. Use only those facts.")
_OBJ_INSTR = ("The context below hides a few short facts about people moving from place to place and picking up, "
              "putting down or handing over things, among unrelated text. Use only those facts. A thing that "
              "someone carries goes wherever that person goes; a thing that is put down stays where it was put.")

PROMPTS: dict[str, dict[str, str]] = {
    "qa1": {
        "instruction": _LOC_INSTR + " A person is in the last place they went to.",
        "examples": (
            "<example>\nNora went to the attic. Liam walked to the porch. Nora moved to the cellar. Where is Nora?\n"
            "Answer: Nora is in the cellar.\n</example>\n\n"
            "<example>\nIvy travelled to the barn. Omar went to the studio. Ivy journeyed to the garage. "
            "Omar went back to the library. Where is Omar?\nAnswer: Omar is in the library.\n</example>"),
        "post_prompt": "Answer with one sentence: <person> is in the <place>.",
    },
    "qa2": {
        "instruction": _OBJ_INSTR,
        "examples": (
            "<example>\nNora went to the attic. Nora took the lamp there. Nora moved to the cellar. "
            "Where is the lamp?\nAnswer: The lamp is in the cellar.\n</example>\n\n"
            "<example>\nOmar went to the studio. Omar picked up the violin there. Omar put down the violin there. "
            "Omar travelled to the barn. Where is the violin?\nAnswer: The violin is in the studio.\n</example>"),
        "post_prompt": "Answer with one sentence: The <thing> is in the <place>.",
    },
    "qa3": {
        "instruction": _OBJ_INSTR + " The question asks where a thing was just before it came to a given place.",
        "examples": (
            "<example>\nIvy went to the barn. Ivy got the lamp there. Ivy moved to the porch. Ivy went to the attic. "
            "Where was the lamp before the attic?\nAnswer: Before the attic the lamp was in the porch.\n"
            "</example>\n\n"
            "<example>\nOmar went to the cellar. Omar grabbed the violin there. Omar travelled to the studio. "
            "Omar dropped the violin there. Liam went to the garage. Where was the violin before the studio?\n"
            "Answer: Before the studio the violin was in the cellar.\n</example>"),
        "post_prompt": "Answer with one sentence: Before the <place> the <thing> was in the <other place>.",
    },
    "qa4": {
        "instruction": ("The context below hides a few short facts about how places lie relative to each other "
                        "(north, south, east, west) among unrelated text. Use only those facts."),
        "examples": (
            "<example>\nThe attic is north of the porch. The cellar is west of the porch. "
            "What is north of the porch?\nAnswer: attic\n</example>\n\n"
            "<example>\nThe barn is east of the studio. The garage is south of the barn. "
            "What is the barn east of?\nAnswer: studio\n</example>"),
        "post_prompt": "Answer with a single word: the place.",
    },
    "qa5": {
        "instruction": ("The context below hides a few short facts about people moving, picking things up and "
                        "handing things to each other, among unrelated text. Use only those facts."),
        "examples": (
            "<example>\nNora picked up the lamp there. Nora handed the lamp to Omar. Ivy went to the barn. "
            "Who gave the lamp to Omar?\nAnswer: Nora\n</example>\n\n"
            "<example>\nLiam took the violin there. Liam passed the violin to Ivy. Omar moved to the attic. "
            "Who did Liam give the violin to?\nAnswer: Ivy\n</example>\n\n"
            "<example>\nOmar got the kite there. Omar gave the kite to Nora. What did Omar give to Nora?\n"
            "Answer: kite\n</example>"),
        "post_prompt": "Answer with a single word: a name or a thing.",
    },
    "qa6": {
        "instruction": _LOC_INSTR + " A person is in the last place they went to.",
        "examples": (
            "<example>\nNora went to the attic. Nora moved to the porch. Is Nora in the porch?\nAnswer: yes\n"
            "</example>\n\n"
            "<example>\nLiam went to the cellar. Ivy travelled to the barn. Liam journeyed to the studio. "
            "Is Liam in the cellar?\nAnswer: no\n</example>"),
        "post_prompt": "Answer with a single word: yes or no.",
    },
    "qa7": {
        "instruction": _OBJ_INSTR,
        "examples": (
            "<example>\nNora went to the attic. Nora took the lamp there. How many objects is Nora carrying?\n"
            "Answer: one\n</example>\n\n"
            "<example>\nLiam grabbed the kite there. Liam handed the kite to Ivy. "
            "How many objects is Liam carrying?\nAnswer: none\n</example>\n\n"
            "<example>\nOmar went to the barn. Omar picked up the violin there. Omar got the lamp there. "
            "How many objects is Omar carrying?\nAnswer: two\n</example>"),
        "post_prompt": "Answer with a single word: none, one, two or three.",
    },
    "qa8": {
        "instruction": _OBJ_INSTR,
        "examples": (
            "<example>\nNora went to the attic. Nora took the lamp there. What is Nora carrying?\nAnswer: lamp\n"
            "</example>\n\n"
            "<example>\nLiam grabbed the kite there. Liam put down the kite there. What is Liam carrying?\n"
            "Answer: nothing\n</example>\n\n"
            "<example>\nOmar went to the barn. Omar picked up the violin there. Omar got the lamp there. "
            "What is Omar carrying?\nAnswer: violin,lamp\n</example>"),
        "post_prompt": "Answer with the things only, separated by a comma, or with the word nothing.",
    },
    "qa9": {
        "instruction": (_LOC_INSTR + " Some facts say that a person is not in a place. Use the latest fact "
                        "about the person."),
        "examples": (
            "<example>\nNora is not in the attic. Liam is in the porch. Is Nora in the attic?\nAnswer: no\n"
            "</example>\n\n"
            "<example>\nIvy went to the barn. Omar is no longer in the studio. Is Ivy in the barn?\nAnswer: yes\n"
            "</example>"),
        "post_prompt": "Answer with a single word: yes or no.",
    },
    "qa10": {
        "instruction": (_LOC_INSTR + " Some facts only say that a person is in one of two places; then the "
                        "answer for either of those places is maybe. Use the latest fact about the person."),
        "examples": (
            "<example>\nNora is in the attic. Liam is either in the porch or the barn. Is Nora in the cellar?\n"
            "Answer: no\n</example>\n\n"
            "<example>\nIvy is in the studio. Omar is either in the garage or the attic. Is Omar in the garage?\n"
            "Answer: maybe\n</example>\n\n"
            "<example>\nLiam is either in the barn or the porch. Ivy went to the cellar. Is Ivy in the cellar?\n"
            "Answer: yes\n</example>"),
        "post_prompt": "Answer with a single word: yes, no or maybe.",
    },
}
DEFAULT_PROMPT = {
    "instruction": ("Below is a long text. Somewhere inside it are short statements of facts, mixed into unrelated "
                    "writing. Answer the question using only those statements."),
    "examples": "",
    "post_prompt": "Answer briefly.",
}


def format_prompt(task: str, context: str, question: str) -> str:
    """The full user message, as the official ``get_formatted_input`` builds it (stripped)."""
    p = PROMPTS.get(task, DEFAULT_PROMPT)
    return TEMPLATE.format(context=context.strip(), question=question, **p).strip()


# ---------------------------------------------------------------------------------------------------------------
# real data: rows {input, question, target}
# ---------------------------------------------------------------------------------------------------------------


def validate_rows(rows: Any, src: str) -> list[dict[str, str]]:
    """Rows in the hub schema, checked: every row a mapping with string fields input, question, target."""
    return require_fields(rows, FIELDS, src, "row")


def load_rows_file(path: str, tasks: Sequence[str], length: str) -> dict[str, list[dict[str, str]]]:
    """A local file in the hub schema -> {task: rows}.

    Accepted layouts: a JSON list or JSON lines of rows (one task: used for the single requested task); a JSON
    object ``{task: [rows]}``; or ``{length: {task: [rows]}}``.
    """
    obj = read_json_or_jsonl(path, "babilong")
    if isinstance(obj, Mapping) and length in obj and isinstance(obj[length], Mapping):
        obj = obj[length]
    if isinstance(obj, Mapping):
        out = {}
        for t in tasks:
            if t not in obj:
                raise DataError(f"babilong: {path} has no rows for task {t!r}; it holds: {', '.join(map(str, obj))}")
            out[t] = validate_rows(obj[t], f"{path} [{t}]")
        return out
    if len(tasks) != 1:
        raise DataError(f"babilong: {path} holds one list of rows but data.task asks for {len(tasks)} tasks; "
                        "use a JSON object {task: [rows]} or run one task")
    return {tasks[0]: validate_rows(obj, path)}


def load_rows_hub(dataset_id: str, length: str, task: str) -> list[dict[str, str]]:
    from datasets import load_dataset

    try:
        ds = load_dataset(dataset_id, length, split=task)
    except Exception as e:  # noqa: BLE001 - no hub, unknown config or split: one line for the user
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(f"babilong: could not load {dataset_id} config {length!r} split {task!r} "
                        f"({type(e).__name__}: {first}); offline, use data.source=synthetic") from None
    return validate_rows(list(ds), f"{dataset_id}[{length}/{task}]")


# ---------------------------------------------------------------------------------------------------------------
# haystack
# ---------------------------------------------------------------------------------------------------------------

_SENT_SPLIT = re.compile(r"(?<=[.!?])[\"'\u201d\u2019)]*\s+")


def haystack_sentences(text: str, min_chars: int = MIN_SENTENCE_CHARS) -> list[str]:
    """Sentences of a haystack text (white space collapsed), dropping those shorter than ``min_chars``."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        flat = " ".join(para.split())
        for s in _SENT_SPLIT.split(flat):
            s = s.strip()
            if len(s) >= min_chars:
                out.append(s)
    return out


def _haystack_text(haystack: str) -> str:
    if haystack == "essays":
        from luka_bench.data.pg19 import essays_text

        return essays_text()
    if haystack == "pg19":
        from datasets import load_dataset

        try:
            ds = load_dataset("emozilla/pg19", split="test", streaming=True)
            texts, n = [], 0
            for row in ds:  # a few books are plenty: samples start at random places in them
                texts.append(row["text"])
                n += len(row["text"])
                if n > 8_000_000:
                    break
        except Exception as e:  # noqa: BLE001
            raise DataError(f"babilong: haystack=pg19 needs the hub (emozilla/pg19): {type(e).__name__}; "
                            "offline, use data.haystack=essays or a text file") from None
        return "\n\n".join(texts)
    problem = file_problem(haystack)
    if problem is not None:
        raise DataError(f"babilong: data.haystack={haystack!r} is not essays or pg19, and the file {problem}; "
                        "allowed: essays | pg19 | a path to a UTF-8 text file")
    return Path(haystack).read_text(encoding="utf-8")


class _Lengths:
    """Length measure: the model's tokenizer when given, else ceil(chars / 4). Pieces are measured with a
    leading space, as they appear in the joined context (the official generator does the same)."""

    def __init__(self, tokenizer=None):
        self.tok = tokenizer

    @property
    def unit(self) -> str:
        return "tokens" if self.tok is not None else "approx_tokens(chars/4)"

    def pieces(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        if self.tok is None:
            return [(len(t) + 1) / CHARS_PER_TOKEN for t in texts]  # + the joining space
        enc = self.tok([" " + t for t in texts], add_special_tokens=False)["input_ids"]
        return [len(e) for e in enc]

    def total(self, text: str) -> int:
        if self.tok is None:
            return approx_tokens(text)
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def cut(self, sentence: str, n: float) -> str:
        """The beginning of ``sentence`` that measures about ``n``."""
        if n <= 0:
            return ""
        if self.tok is None:
            k = int(n * CHARS_PER_TOKEN) - 1
            cut = sentence[:k]
            return cut[: cut.rfind(" ")] if " " in cut and k < len(sentence) else cut
        ids = self.tok(" " + sentence, add_special_tokens=False)["input_ids"][: int(n)]
        return self.tok.decode(ids).strip()


def scatter_facts(facts: list[str], sentences: list[str], sent_lens: list[float], start: int, target: int,
                  rng: random.Random, lengths: _Lengths) -> tuple[str, list[int]]:
    """Facts, in order, at random sentence boundaries of background text taken from ``sentences[start:]``
    (wrapping), so that facts + background measure ``target``. Returns (context, char offset of each fact).

    As the official generator: background sentences are added until the total reaches the target, the last one
    is cut to fit, and each fact goes to a uniformly drawn boundary (with replacement; sorted, so the facts keep
    their order). A target at or below the facts' own length gives the facts alone (the ``0k`` setting)."""
    fact_lens = lengths.pieces(facts)
    need = target - sum(fact_lens)
    background: list[str] = []
    if need > 0 and sentences:
        total = 0.0
        i = start
        while total < need:
            s, n = sentences[i % len(sentences)], sent_lens[i % len(sentences)]
            i += 1
            if total + n > need:
                s = lengths.cut(s, need - total)
                if s:
                    background.append(s)
                break
            background.append(s)
            total += n
    positions = sorted(rng.randrange(len(background) + 1) for _ in facts)
    slots: list[list[str]] = [[] for _ in range(len(background) + 1)]
    for f, pos in zip(facts, positions):
        slots[pos].append(f)
    pieces: list[tuple[str, int | None]] = []
    fi = 0
    for k in range(len(background) + 1):
        for f in slots[k]:
            pieces.append((f, fi))
            fi += 1
        if k < len(background):
            pieces.append((background[k], None))
    context, offsets = "", [0] * len(facts)
    for text, idx in pieces:
        if context:
            context += " "
        if idx is not None:
            offsets[idx] = len(context)
        context += text
    return context, offsets


# ---------------------------------------------------------------------------------------------------------------
# the task
# ---------------------------------------------------------------------------------------------------------------


def _task_list(task: Any) -> list[str]:
    if isinstance(task, str):
        items = [t.strip() for t in task.split(",")]
    elif isinstance(task, Sequence) or hasattr(task, "__iter__"):
        items = [str(t).strip() for t in task]
    else:
        items = [str(task)]
    items = [t for t in items if t]
    if not items:
        raise DataError("data.task is empty; allowed: qa1 ... qa20 (one, a comma list or a list)")
    return list(dict.fromkeys(items))


@dataclass
class BABILong(Task):
    """BABILong task (a Hydra ``_target_``).

    task: ``qa1`` ... (``qa1``-``qa10`` synthetic; ``qa1``-``qa20`` from the hub/file), a comma string or a list.
    length: ``0k`` ... ``128k`` (context = facts + haystack = N*1000 - 300 tokens; ``0k`` = the facts alone).
    source: ``synthetic`` (offline) | ``hf`` (``dataset_id``, config = length, split = task) | ``file`` (``path``).
    limit: samples per task (null: all; the hub has 100 per task and length).
    seed: synthetic sample k of a task is the story drawn with ``Random("babilong:{seed}:{task}:{k}")`` (the same
        story at every length) in a haystack drawn with ``Random("babilong-hay:{seed}:{task}:{length}:{k}")``.
    haystack: ``essays`` (offline, Paul Graham) | ``pg19`` (hub ``emozilla/pg19``, test split) | a text file.
    """

    task: Any = "qa1"
    length: str = "0k"
    source: str = "synthetic"
    path: str | None = None
    dataset_id: str = HUB_ID
    limit: int | None = 20
    seed: int = 42
    haystack: str = "essays"
    official_quirk: bool = True  # keep the official "cut at 'Question' after lower-casing" (never fires)

    kind: ClassVar[str] = "qa"
    headline: ClassVar[str] = "accuracy"
    max_new_tokens: ClassVar[int] = 20
    # Everything after the first "." is discarded by the official scorer, so stopping there is exact.
    stop_strings: ClassVar[tuple[str, ...]] = (".",)

    _tokenizer: Any = field(default=None, init=False, repr=False, compare=False)
    _cache: list[QAExample] | None = field(default=None, init=False, repr=False, compare=False)
    _hay: tuple[list[str], list[float]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.length = str(self.length)
        target_tokens(self.length)  # validates
        tasks = _task_list(self.task)
        allowed = SYNTHETIC_TASKS if self.source == "synthetic" else tuple(TASK_LABELS)
        bad = [t for t in tasks if t not in allowed]
        if bad:
            raise DataError(f"data.task={bad[0]!r} is unknown for babilong source={self.source}; "
                            f"allowed: {', '.join(allowed)}")
        self.task = tasks[0] if len(tasks) == 1 else ",".join(tasks)
        check_source("babilong", self.source, SOURCES, self.path,
                     "a JSON/JSONL file with fields input, question, target", self.limit)

    @property
    def tasks(self) -> list[str]:
        return _task_list(self.task)

    @property
    def name(self) -> str:
        return f"babilong_{'+'.join(self.tasks)}_{self.length}"

    def prepare(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = True) -> None:
        """Called by the runner before ``examples()``: lengths are then measured in the model's tokens."""
        if tokenizer is not self._tokenizer:
            self._tokenizer = tokenizer
            self._cache = None
            self._hay = None

    # -- data -----------------------------------------------------------------------------------------------
    def _haystack(self, lengths: _Lengths) -> tuple[list[str], list[float]]:
        if self._hay is None:
            sents = haystack_sentences(_haystack_text(self.haystack))
            if not sents:
                raise DataError(f"babilong: haystack {self.haystack!r} has no sentence of >= "
                                f"{MIN_SENTENCE_CHARS} characters")
            self._hay = (sents, lengths.pieces(sents))
        return self._hay

    def _synthetic(self, task: str, n: int, lengths: _Lengths) -> list[QAExample]:
        target = target_tokens(self.length)
        sents, sent_lens = self._haystack(lengths) if target > 0 else ([], [])
        out = []
        for k in range(n):
            story = generate_story(task, random.Random(f"babilong:{self.seed}:{task}:{k}"))
            hay_rng = random.Random(f"babilong-hay:{self.seed}:{task}:{self.length}:{k}")
            start = hay_rng.randrange(len(sents)) if sents else 0
            context, offsets = scatter_facts(story.facts, sents, sent_lens, start, target, hay_rng, lengths)
            ex_id = f"babilong-{task}-{self.length}-s{self.seed}-{k}"
            sup_chars = [offsets[i] for i in story.supporting]
            meta = {
                "task": task, "length": self.length, "source": "synthetic", "index": k,
                "target_tokens": target, "context_tokens": lengths.total(context), "length_unit": lengths.unit,
                "n_facts": len(story.facts), "supporting_facts": story.supporting,
                "supporting_chars": sup_chars,
                "supporting_spans": [[offsets[i], offsets[i] + len(story.facts[i])] for i in story.supporting],
                "supporting_depth": [round(c / max(len(context), 1), 4) for c in sup_chars],
                "fact_chars": offsets,
            }
            q = Question(id=f"{ex_id}-q", question=story.question, answers=[story.answer], meta=meta)
            out.append(QAExample(id=ex_id, context=context, questions=[q], meta=dict(meta)))
        return out

    def _from_rows(self, task: str, rows: list[dict[str, str]], src: str) -> list[QAExample]:
        out = []
        for k, row in enumerate(rows):
            ex_id = f"babilong-{task}-{self.length}-{src}-{k}"
            meta = {"task": task, "length": self.length, "source": src, "index": k}
            q = Question(id=f"{ex_id}-q", question=row["question"].strip(), answers=[row["target"]], meta=meta)
            out.append(QAExample(id=ex_id, context=row["input"], questions=[q], meta=dict(meta)))
        return out

    def hub_datasets(self) -> list[str]:
        """Hub datasets this data setting downloads (``run.prepare`` checks first that they can be had)."""
        return ([self.dataset_id] if self.source == "hf" else []) + \
            (["emozilla/pg19"] if self.source == "synthetic" and self.haystack == "pg19" else [])

    def check(self) -> None:
        """Read and check a local file source (present, JSON / JSON lines, every task's rows with their fields)
        before the model loads; the synthetic and hub sources are built later, in the model's tokens."""
        if self.source == "file":
            load_rows_file(self.path, self.tasks, self.length)

    def examples(self) -> list[QAExample]:
        if self._cache is None:
            lengths = _Lengths(self._tokenizer)
            exs: list[QAExample] = []
            file_rows = load_rows_file(self.path, self.tasks, self.length) if self.source == "file" else {}
            for task in self.tasks:
                if self.source == "synthetic":
                    exs += self._synthetic(task, 100 if self.limit is None else self.limit, lengths)
                    continue
                rows = file_rows[task] if self.source == "file" else load_rows_hub(self.dataset_id, self.length, task)
                if self.limit is not None:
                    rows = rows[: self.limit]
                exs += self._from_rows(task, rows, "file" if self.source == "file" else "hf")
            self._cache = exs
        return self._cache

    # -- prompt -----------------------------------------------------------------------------------------------
    def context_block(self, ex: QAExample) -> str:
        """Instruction, examples, post-prompt and ``<context>...</context>``: the official template up to the
        question (prefilled once, then compressed by the method)."""
        p = PROMPTS.get(ex.meta["task"], DEFAULT_PROMPT)
        head = TEMPLATE.split("{question}")[0].rsplit("\n\nQuestion: ", 1)[0]
        return head.format(context=ex.context.strip(), **p).lstrip()

    def evidence_spans(self, ex: QAExample) -> list[tuple[int, int]]:
        """Character spans, in ``context_block(ex)``, of the supporting facts of the example's question (synthetic
        source only: the generator knows where it put them; hub/file rows: none). The runner turns them into token
        positions and reports the share a method holds after the prefill (``evidence_kept``)."""
        spans = ex.meta.get("supporting_spans")
        if not spans:
            return []
        stripped = ex.context.strip()
        lead = len(ex.context) - len(ex.context.lstrip())
        at = self.context_block(ex).rfind(stripped)
        if at < 0:
            return []
        return [(at + a - lead, at + b - lead) for a, b in spans]

    def question_block(self, q: Question) -> str:
        return f"\n\nQuestion: {q.question.strip()}"

    # -- scoring ----------------------------------------------------------------------------------------------
    def postprocess(self, generated: str) -> str:
        return generated.strip()

    def score(self, prediction: str, q: Question) -> dict[str, float]:
        task = q.meta["task"]
        ok = compare_answers(q.answers[0], prediction, q.question, TASK_LABELS[task], self.official_quirk)
        return {"accuracy": float(ok)}

    def aggregate(self, records: list[dict]) -> dict[str, float | None]:
        """``accuracy`` (mean of the per-task accuracies) and ``accuracy_<task>``."""
        return accuracy_summary(records)
