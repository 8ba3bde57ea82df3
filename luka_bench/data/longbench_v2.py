"""LongBench v2 (Bai et al., 2024; THUDM/LongBench): long-context four-choice questions, zero-shot.

Sources (all give items in the hub schema, checked by :func:`validate_items`):
- ``hf``: Hugging Face ``THUDM/LongBench-v2``, split ``train`` (503 items), via ``datasets.load_dataset``;
- ``file``: a local JSON list (the official ``data.json``) or JSON lines of items (``path``);
- ``synthetic`` (offline default): :func:`generate_items` writes items in that schema from the invented articles
  of :mod:`luka_bench.data.synthetic_articles` (a document of several articles, one question about one of them,
  four choices of which one is right).

Prompt: the official zero-shot template, split so that the document part (``... <text>\\n$DOC$\\n</text>``) is the
context block and ``\\n\\nWhat is the correct answer ...`` the question block. Too long prompts are truncated in the
middle as the official ``pred.py`` does (first and last ``max_len/2`` tokens of the prompt); this needs the
tokenizer, which the runner passes through :meth:`LongBenchV2.prepare`. Scoring:
:mod:`luka_bench.data.scoring_longbench`. See ``datasets/longbench_v2.md``.
"""
from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from luka_bench.data.base import (Task, DataError, QAExample, Question, check_source, qa_prompt_ids, read_json_or_jsonl,
                                  require_fields)
from luka_bench.data.scoring_longbench import DIFFICULTIES, LENGTHS, accuracy_summary, is_correct
from luka_bench.data.synthetic_articles import generate_squad

__all__ = [
    "LongBenchV2", "FIELDS", "HUB_ID", "PROMPT_HEAD", "PROMPT_QUESTION", "generate_items", "load_items_file",
    "validate_items", "middle_truncate", "format_prompt",
]

HUB_ID = "THUDM/LongBench-v2"
SOURCES = ("synthetic", "hf", "file")
LETTERS = ("A", "B", "C", "D")
FIELDS = ("_id", "domain", "sub_domain", "difficulty", "length", "question", "choice_A", "choice_B", "choice_C",
          "choice_D", "answer", "context")

# The official 0-shot template (prompts/0shot.txt), cut where the question starts.
PROMPT_HEAD = "Please read the following text and answer the question below.\n\n<text>\n{doc}\n</text>"
PROMPT_QUESTION = ("\n\nWhat is the correct answer to this question: {q}\nChoices:\n(A) {a}\n(B) {b}\n(C) {c}\n"
                   "(D) {d}\n\nFormat your response as follows: \"The correct answer is (insert answer here)\".")
_SPLIT_MARK = "\n</text>\n\nWhat is the correct answer to this question:"

# Offline synthetic items: document length per class, in approximate tokens (4 characters each). The real classes
# are < 32K / 32K-128K / > 128K words; these are scaled to fit a small model's 8K context.
SYNTHETIC_LENGTH_TOKENS = {"short": 1000, "medium": 2500, "long": 5000}
# Mix of the real data set (503 items): 180 short / 215 medium / 108 long; 192 easy / 311 hard.
_LENGTH_WEIGHTS = (180, 215, 108)
_DIFFICULTY_WEIGHTS = (192, 311)


def format_prompt(item: Mapping[str, str], doc: str | None = None) -> str:
    """The full official zero-shot prompt of an item (``doc`` replaces the item's context, e.g. truncated)."""
    return _head(item["context"] if doc is None else doc) + _question(item)


def _head(doc: str) -> str:
    return PROMPT_HEAD.format(doc=doc.strip())


def _question(item: Mapping[str, str]) -> str:
    return PROMPT_QUESTION.format(q=item["question"].strip(), a=item["choice_A"].strip(), b=item["choice_B"].strip(),
                                  c=item["choice_C"].strip(), d=item["choice_D"].strip())


def middle_truncate(ids: Sequence[int], max_len: int) -> list[int]:
    """The official middle truncation: if longer than ``max_len``, keep the first ``max_len // 2`` and the last
    ``max_len - max_len // 2`` tokens (``ids[:max_len//2] + ids[-max_len//2:]`` in ``pred.py``)."""
    ids = list(ids)
    if len(ids) <= max_len:
        return ids
    if max_len <= 0:
        return []
    head = max_len // 2
    return ids[:head] + ids[len(ids) - (max_len - head):]


# ---------------------------------------------------------------------------------------------------------------
# real data
# ---------------------------------------------------------------------------------------------------------------


def validate_items(rows: Any, src: str) -> list[dict[str, str]]:
    """Items in the hub schema; every field present and a string, with valid difficulty / length / answer."""
    out = require_fields(rows, FIELDS, src, "item")
    for i, row in enumerate(out):
        for k, allowed in (("difficulty", DIFFICULTIES), ("length", LENGTHS), ("answer", LETTERS)):
            if row[k] not in allowed:
                raise DataError(f"{src}: item {i} field {k!r} is {row[k]!r}; allowed: {', '.join(allowed)}")
    return out


def load_items_file(path: str) -> list[dict[str, str]]:
    obj = read_json_or_jsonl(path, "longbench_v2")
    return validate_items(obj, path)


def load_items_hub(dataset_id: str = HUB_ID, split: str = "train") -> list[dict[str, str]]:
    from datasets import load_dataset

    try:
        ds = load_dataset(dataset_id, split=split)
    except Exception as e:  # noqa: BLE001 - one line for the user
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(f"longbench_v2: could not load {dataset_id} split {split!r} ({type(e).__name__}: {first}); "
                        "offline, use data.source=synthetic") from None
    return validate_items(list(ds), f"{dataset_id}[{split}]")


# ---------------------------------------------------------------------------------------------------------------
# offline items from the synthetic articles
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _QA:
    article: int
    question: str
    answer: str
    key: tuple[str, str]  # (article kind, question with the entity name replaced by {n})


def _shape(value: str) -> str:
    return "number" if re.fullmatch(r"[\d,]+(?: \w+)?", value) else "text"


def _pool(n_articles: int, seed: int) -> tuple[list[str], list[str], list[_QA]]:
    """(article texts, article kinds, all QA pairs) of the synthetic article pool."""
    squad = generate_squad(n_articles, seed)
    texts, kinds, qas = [], [], []
    for ai, art in enumerate(squad["data"]):
        title = art["title"]
        name = re.sub(r" \(ship\)$", "", title)
        texts.append(f"## {title}\n\n" + "\n\n".join(p["context"] for p in art["paragraphs"]))
        kinds.append(art.get("kind", ""))
        for par in art["paragraphs"]:
            for qa in par["qas"]:
                ans = qa["answers"][0]["text"]
                qas.append(_QA(ai, qa["question"], ans, (art.get("kind", ""), qa["question"].replace(name, "{n}"))))
    return texts, kinds, qas


def generate_items(n: int, seed: int = 0, n_articles: int = 400,
                   length_tokens: Mapping[str, int] | None = None) -> list[dict[str, str]]:
    """``n`` LongBench-v2-schema items (deterministic in the arguments; item k depends only on ``(seed, k)`` and
    the pool).

    Item k: length class and difficulty drawn with the real data set's proportions; the question is one QA pair of
    a random article of the pool; the document is that article plus (``hard`` only) up to three articles that
    answer the same question about other entities, filled up with random articles to the class's length
    (4 characters per token), in random order. The right choice is the QA pair's answer (it occurs once in the
    document); the three wrong choices are answers to the same question template about other entities (else
    answers of the same article kind and shape: number or text).
    ``hard``: wrong choices come first from the other articles of the document, so they appear in the text too and
    the model must link the answer to the right entity. ``easy``: no wrong choice appears in the document.
    """
    lt = dict(SYNTHETIC_LENGTH_TOKENS if length_tokens is None else length_tokens)
    texts, kinds, qas = _pool(n_articles, seed)
    by_key: dict[tuple[str, str], list[_QA]] = {}
    by_kind_shape: dict[tuple[str, str], list[_QA]] = {}
    by_article: dict[int, list[_QA]] = {}
    for qa in qas:
        by_article.setdefault(qa.article, []).append(qa)
        by_key.setdefault(qa.key, []).append(qa)
        by_kind_shape.setdefault((kinds[qa.article], _shape(qa.answer)), []).append(qa)
    items = []
    for k in range(n):
        rng = random.Random(f"longbench-syn:{seed}:{k}")
        length = rng.choices(LENGTHS, weights=_LENGTH_WEIGHTS)[0]
        difficulty = rng.choices(DIFFICULTIES, weights=_DIFFICULTY_WEIGHTS)[0]
        for _ in range(100):
            item = _make_item(rng, k, seed, length, difficulty, lt[length] * 4, texts, kinds, by_article, by_key,
                              by_kind_shape)
            if item is not None:
                items.append(item)
                break
        else:  # pragma: no cover - the pool is far larger than needed
            raise DataError(f"longbench_v2: could not build synthetic item {k}; raise n_articles")
    return items


def _make_item(rng, k, seed, length, difficulty, target_chars, texts, kinds, qas_by_article, by_key,
               by_kind_shape):
    target_article = rng.randrange(len(texts))
    qa = rng.choice(qas_by_article[target_article])
    doc_ids = [target_article]
    if difficulty == "hard":  # bring in up to 3 entities that answer the same question differently
        others = sorted({x.article for x in by_key[qa.key]} - {target_article})
        rng.shuffle(others)
        doc_ids += others[:3]
    order = [ai for ai in range(len(texts)) if ai not in doc_ids]
    rng.shuffle(order)
    n_chars = sum(len(texts[ai]) + 2 for ai in doc_ids)
    for ai in order:
        if n_chars >= target_chars:
            break
        doc_ids.append(ai)
        n_chars += len(texts[ai]) + 2
    rng.shuffle(doc_ids)
    doc = "\n\n".join(texts[ai] for ai in doc_ids)
    in_doc = set(doc_ids)
    if doc.count(qa.answer) != 1:  # the right answer must occur once in the document
        return None
    right = qa.answer.strip()

    def usable(v: str, want_in_doc: bool) -> bool:
        return v.lower() != right.lower() and ((v in doc) if want_in_doc else (v not in doc))

    wrong: list[str] = []
    same_key = [x for x in by_key[qa.key] if x.article != qa.article]
    same_kind = [x for x in by_kind_shape[(kinds[qa.article], _shape(qa.answer))] if x.article != qa.article]
    if difficulty == "hard":
        tiers = [([x for x in same_key if x.article in in_doc], True),
                 ([x for x in same_key if x.article not in in_doc], False),
                 ([x for x in same_kind if x.article in in_doc], True),
                 ([x for x in same_kind if x.article not in in_doc], False)]
    else:
        tiers = [([x for x in same_key if x.article not in in_doc], False),
                 ([x for x in same_kind if x.article not in in_doc], False)]
    for pool, want_in_doc in tiers:
        pool = list(pool)
        rng.shuffle(pool)
        for x in pool:
            v = x.answer.strip()
            if len(wrong) < 3 and usable(v, want_in_doc) and v.lower() not in {w.lower() for w in wrong}:
                wrong.append(v)
    if len(wrong) < 3:
        return None
    pos = rng.randrange(4)
    choices = wrong[:pos] + [right] + wrong[pos:]
    item = {
        "_id": f"syn{seed}-{k:05d}",
        "domain": "Multi-Document QA",
        "sub_domain": "Synthetic articles",
        "difficulty": difficulty,
        "length": length,
        "question": qa.question,
        **{f"choice_{L}": c for L, c in zip(LETTERS, choices)},
        "answer": LETTERS[pos],
        "context": doc,
    }
    return item


# ---------------------------------------------------------------------------------------------------------------
# the task
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class LongBenchV2(Task):
    """LongBench v2 task (a Hydra ``_target_``).

    source: ``synthetic`` (offline) | ``hf`` (``dataset_id``, ``split``) | ``file`` (``path``).
    limit: number of items (null: all).
    max_tokens: cap on the prompt (the user message, before any chat template), in the model's tokens, as
        ``max_len`` of the official ``pred.py``; the prompt is further capped by the model context minus the
        answer budget and the chat template. null: that model bound only.
    difficulty / length: keep only items of these classes (null: all), e.g. ``length: short``.
    seed / n_articles / synthetic_tokens: the synthetic generator (see :func:`generate_items`).
    """

    source: str = "synthetic"
    path: str | None = None
    dataset_id: str = HUB_ID
    split: str = "train"
    limit: int | None = 10
    max_tokens: int | None = None
    difficulty: str | None = None
    length: str | None = None
    seed: int = 42
    n_articles: int = 400
    synthetic_tokens: dict | None = None

    kind: ClassVar[str] = "qa"
    headline: ClassVar[str] = "accuracy"
    # The answer is ~8 tokens; the official run allows 128 (answer budget deviation, see the card).
    max_new_tokens: ClassVar[int] = 32
    # Stop once the first extraction pattern has matched (nothing later can change the extracted letter); never
    # at a newline, which often comes before the answer.
    stop_strings: ClassVar[tuple[str, ...]] = tuple(f"The correct answer is ({L})" for L in LETTERS)

    _items: list[dict[str, str]] | None = field(default=None, init=False, repr=False, compare=False)
    _cache: list[QAExample] | None = field(default=None, init=False, repr=False, compare=False)
    _tokenizer: Any = field(default=None, init=False, repr=False, compare=False)
    _max_prompt: int | None = field(default=None, init=False, repr=False, compare=False)
    _chat: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_source("longbench_v2", self.source, SOURCES, self.path,
                     "a JSON list or JSON lines of LongBench v2 items", self.limit)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 64):
            raise DataError(f"data.max_tokens={self.max_tokens!r} must be an integer >= 64 or null")
        if self.difficulty is not None and self.difficulty not in DIFFICULTIES:
            raise DataError(f"data.difficulty={self.difficulty!r}; allowed: {', '.join(DIFFICULTIES)} or null")
        if self.length is not None and self.length not in LENGTHS:
            raise DataError(f"data.length={self.length!r}; allowed: {', '.join(LENGTHS)} or null")
        if self.synthetic_tokens is not None:
            st = dict(self.synthetic_tokens)
            if set(st) != set(LENGTHS) or any(not isinstance(v, int) or v < 1 for v in st.values()):
                raise DataError(f"data.synthetic_tokens={st!r} must map short, medium, long to positive integers")

    @property
    def name(self) -> str:
        return "longbench_v2"

    def prepare(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = True) -> None:
        """Called by the runner before ``examples()``: ``max_prompt_tokens`` is what the whole prompt (chat
        template included) may take, i.e. the model context minus the answer budget. Prompts longer than that (or
        than ``max_tokens``) are then truncated in the middle, in the model's tokens."""
        if (tokenizer, max_prompt_tokens, bool(chat_template)) != (self._tokenizer, self._max_prompt, self._chat):
            self._tokenizer, self._max_prompt, self._chat = tokenizer, max_prompt_tokens, bool(chat_template)
            self._cache = None

    # -- data -----------------------------------------------------------------------------------------------
    def items(self) -> list[dict[str, str]]:
        """The selected items, in the hub schema (before any truncation)."""
        if self._items is None:
            if self.source == "synthetic":
                n = 503 if self.limit is None else self.limit
                # the filters draw from a larger synthetic stream so that `limit` items survive them
                factor = 1 if (self.difficulty is None and self.length is None) else 8
                items = generate_items(n * factor, self.seed, self.n_articles, self.synthetic_tokens)
            elif self.source == "file":
                items = load_items_file(str(self.path))
            else:
                items = load_items_hub(self.dataset_id, self.split)
            items = [it for it in items if (self.difficulty is None or it["difficulty"] == self.difficulty)
                     and (self.length is None or it["length"] == self.length)]
            if self.limit is not None:
                items = items[: self.limit]
            self._items = items
        return self._items

    def _truncate(self, item: dict[str, str]) -> tuple[str, dict[str, Any]]:
        """The item's document after the official middle truncation of the whole prompt, and what was done."""
        doc = item["context"]
        tok = self._tokenizer
        if tok is None:  # no tokenizer: only max_tokens, approximated as 4 characters per token on the document
            if self.max_tokens is None:
                return doc, {"truncated": False}
            budget = self.max_tokens * 4 - len(format_prompt(item, ""))
            if len(doc) <= budget:
                return doc, {"truncated": False}
            return "".join(middle_truncate(doc, max(budget, 0))), {"truncated": True, "unit": "chars/4"}
        question = _question(item)
        full = tok(_head(doc) + question, add_special_tokens=False)["input_ids"]
        m = len(full) if self.max_tokens is None else min(self.max_tokens, len(full))
        for _ in range(8):
            new_doc = doc if m >= len(full) else self._cut(doc, full, m)
            excess = self._excess(new_doc, question)
            if excess <= 0:
                if m >= len(full):
                    return doc, {"truncated": False, "prompt_tokens": len(full)}
                return new_doc, {"truncated": True, "prompt_tokens": len(full), "max_len": m}
            m = min(m, len(full)) - excess
            if m <= 0:
                break
        raise DataError(f"longbench_v2: item {item['_id']!r} does not fit in {self._max_prompt} prompt tokens even "
                        "after truncation (the question and choices alone are too long)")

    def _cut(self, doc: str, full: list[int], m: int) -> str:
        """The document left by the official truncation of the whole prompt ``full`` to ``m`` tokens."""
        tok = self._tokenizer
        text = tok.decode(middle_truncate(full, m), skip_special_tokens=True)
        prefix = PROMPT_HEAD.split("{doc}")[0]
        pos = text.rfind(_SPLIT_MARK)
        if text.startswith(prefix) and pos >= len(prefix):
            return text[len(prefix):pos]
        # the question and choices take more than half the budget: cut the document alone to what is left
        doc_ids = tok(doc, add_special_tokens=False)["input_ids"]
        room = max(m - (len(full) - len(doc_ids)), 0)
        return tok.decode(middle_truncate(doc_ids, room), skip_special_tokens=True)

    def _excess(self, doc: str, question: str) -> int:
        """Tokens by which the prompt as the runner builds it exceeds the model bound (<= 0: fits)."""
        if self._max_prompt is None:
            return 0
        c, q = qa_prompt_ids(self._tokenizer, self._chat, _head(doc), question)
        return len(c) + len(q) - self._max_prompt

    def hub_datasets(self) -> list[str]:
        """Hub datasets this data setting downloads (``run.prepare`` checks first that they can be had)."""
        return [self.dataset_id] if self.source == "hf" else []

    def check(self) -> None:
        """Read and check the items (a local file: present, JSON / JSON lines, the hub schema) before the model
        loads; kept for ``examples()``."""
        self.items()

    def examples(self) -> list[QAExample]:
        if self._cache is None:
            out = []
            for item in self.items():
                doc, info = self._truncate(item)
                choices = {L: item[f"choice_{L}"] for L in LETTERS}
                meta = {"difficulty": item["difficulty"], "length": item["length"], "domain": item["domain"],
                        "sub_domain": item["sub_domain"], "choices": choices, **info}
                q = Question(id=f"lbv2-{item['_id']}", question=item["question"], answers=[item["answer"]], meta=meta)
                out.append(QAExample(id=f"lbv2-{item['_id']}", context=doc, questions=[q], meta=dict(meta)))
            self._cache = out
        return self._cache

    # -- prompt -----------------------------------------------------------------------------------------------
    def context_block(self, ex: QAExample) -> str:
        """The official zero-shot template up to ``</text>`` (the document: prefilled once, compressed)."""
        return _head(ex.context)

    def question_block(self, q: Question) -> str:
        c = q.meta["choices"]
        return _question({"question": q.question, "choice_A": c["A"], "choice_B": c["B"], "choice_C": c["C"],
                          "choice_D": c["D"]})

    # -- scoring ----------------------------------------------------------------------------------------------
    def postprocess(self, generated: str) -> str:
        return generated.strip()

    def score(self, prediction: str, q: Question) -> dict[str, float]:
        return {"accuracy": float(is_correct(prediction, q.answers[0]))}

    def aggregate(self, records: list[dict]) -> dict[str, float | None]:
        """``accuracy`` and ``accuracy_{easy,hard,short,medium,long}``."""
        return accuracy_summary(records)
