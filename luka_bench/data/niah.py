"""Needle in a haystack (Kamradt, 2023; the form RULER's ``niah_single_2`` standardised): one needle sentence at a
chosen depth of an essays haystack cut to a chosen length; the depth x length grid is drawn as a heat map by the
report (:mod:`luka_bench.niah_plot`). Card: ``datasets/niah.md``.

The needle, question and answer prefix are RULER's single-needle ones ("One of the special magic numbers for
{key} is: {value}.", a 7-digit value and an adjective-noun key); the score is RULER's ``string_match_all``: 100
when the answer holds the value. ``data.lengths`` counts the whole prompt in the model's own tokens (chat template
included) plus ``max_new_tokens``; the haystack is the essays text from its start (sample k > 0: from a later
essay), cut to the most tokens that fit. The needle goes in at the last sentence end at or before ``depth`` % of
the haystack's tokens (0: before the first sentence, 100: after the last).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from luka_bench.data.base import Task, DataError, QAExample, Question, evidence_positions, qa_prompt_ids
from luka_bench.data.ruler_gen import NEEDLE, TEMPLATES, Generator, read_haystack
from luka_bench.data.scoring_ruler import ruler_summary, score_item

__all__ = ["NIAH", "insert_needle"]

_SENT_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*\s")


def insert_needle(haystack: str, needle: str, char_at: int) -> tuple[str, tuple[int, int]]:
    """``needle`` put into ``haystack`` at the last sentence end at or before ``char_at`` (the start when there is
    none; the end when ``char_at`` is past the end). Returns the text and the needle's (start, end) characters."""
    if char_at >= len(haystack):
        cut = len(haystack)
    else:
        ends = [m.end() for m in _SENT_END.finditer(haystack, 0, char_at + 1)]
        cut = ends[-1] if ends else 0
    before, after = haystack[:cut].rstrip(), haystack[cut:].lstrip()
    start = len(before) + (1 if before else 0)
    text = (before + " " if before else "") + needle + (" " + after if after else "")
    return text, (start, start + len(needle))


def _as_list(v: Any, what: str, lo: float, hi: float | None, integer: bool) -> list:
    items = [v] if isinstance(v, (int, float, str)) and not isinstance(v, bool) else list(v)
    out = []
    for x in items:
        try:
            y = int(x) if integer else float(x)
        except (TypeError, ValueError):
            y = None
        if y is None or isinstance(x, bool) or y < lo or (hi is not None and y > hi) or (integer and float(x) != y):
            rng = f"[{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
            raise DataError(f"data.{what}={x!r} is not allowed; allowed: {'integers' if integer else 'numbers'} "
                            f"{rng} (a list, e.g. [0, 50, 100])")
        out.append(y)
    if not out:
        raise DataError(f"data.{what} is empty; give at least one value")
    return list(dict.fromkeys(out))


@dataclass
class NIAH(Task):
    """Needle in a haystack (a Hydra ``_target_``).

    lengths: total tokens (prompt + max_new_tokens) per cell, in the model's tokens. depths: needle depths, % of
    the haystack. limit: samples per (length, depth) cell. seed: cell (length, depth) sample k draws its key and
    value with ``Random("niah:{seed}:{length}:{depth}:{k}")``. haystack: ``essays`` or a text file.
    """

    lengths: Any = (1024, 2048, 4096, 8192)
    depths: Any = (0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100)
    limit: int | None = 1
    seed: int = 42
    haystack: str = "essays"

    kind: ClassVar[str] = "qa"
    headline: ClassVar[str] = "niah_score"
    max_new_tokens: ClassVar[int] = 32  # a 7-digit number after the answer prefix
    stop_strings: ClassVar[tuple[str, ...]] = ()

    _tok: Any = field(default=None, init=False, repr=False, compare=False)
    _chat: bool = field(default=False, init=False, repr=False, compare=False)
    _cache: list[QAExample] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.lengths = _as_list(self.lengths, "lengths", 1, None, True)
        self.depths = _as_list(self.depths, "depths", 0, 100, False)
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or self.limit < 1):
            raise DataError(f"data.limit={self.limit!r} must be an integer >= 1 (samples per cell)")
        floor = self._min_length()
        short = [n for n in self.lengths if n < floor]
        if short:
            raise DataError(f"data.lengths has {short[0]}, too short for the NIAH template and answer "
                            f"(more than {floor} tokens); allowed: lengths >= {floor}")

    def _min_length(self) -> int:
        template, prefix, _ = TEMPLATES["niah"]
        return len((template + prefix + NEEDLE).replace("{context}", " ").split()) + self.max_new_tokens

    @property
    def name(self) -> str:
        return "niah"

    def check_model(self, model) -> None:
        mc = getattr(model, "max_context", None)
        if isinstance(mc, int) and max(self.lengths) > mc:
            raise DataError(f"data.lengths has {max(self.lengths)}, which does not fit model.max_context={mc}; "
                            f"allowed: lengths <= {mc}")

    def check(self) -> None:
        read_haystack(self.haystack)

    def prepare(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = True) -> None:
        if tokenizer is not self._tok or chat_template != self._chat:
            self._tok, self._chat, self._cache = tokenizer, chat_template, None

    # -- building -------------------------------------------------------------------------------------------
    def _parts(self, key: str, value: str, context: str) -> tuple[str, str, str]:
        template, prefix, _ = TEMPLATES["niah"]
        for a, b in [("Some", "A"), ("are all", "is"), ("are", "is")]:  # RULER's singular wording
            template, prefix = template.replace(a, b), prefix.replace(a, b)
        head, tail = template.split("{context}")
        return (head.format(type_needle_v="number") + context, tail.format(type_needle_v="number", query=key),
                prefix.format(type_needle_v="number", query=key))

    def _tokens(self, context_block: str, question: str, prefix: str) -> int:
        c, q = qa_prompt_ids(self._tok, self._chat, context_block, question, prefix)
        return len(c) + len(q)

    def examples(self) -> list[QAExample]:
        if self._cache is not None:
            return self._cache
        if self._tok is None:
            raise DataError("niah: samples are measured in the model's tokens; call prepare() first")
        text = re.sub(r"\s+", " ", read_haystack(self.haystack)).strip()
        gen = Generator("niah_single_2", self.seed, 0, None)
        n = 1 if self.limit is None else self.limit
        exs = []
        for k in range(n):
            # sample k starts k/n of the way into the essays, at a sentence start, so samples differ in haystack
            start = 0
            if k:
                m = _SENT_END.search(text, len(text) * k // n)
                start = m.end() if m else 0
            src = text[start:] + " " + text[:start]
            # ~4-5 characters per token in English prose: 8 per token of the longest length is plenty
            offs = self._tok(src[: 8 * max(self.lengths) + 1000], add_special_tokens=False,
                             return_offsets_mapping=True)["offset_mapping"]
            for length in self.lengths:
                budget = length - self.max_new_tokens
                for depth in self.depths:
                    rng = random.Random(f"niah:{self.seed}:{length}:{depth:g}:{k}")
                    key, value = gen._random(rng, "words"), gen._random(rng, "numbers")
                    needle = NEEDLE.format(type_needle_v="numbers", key=key, value=value)
                    hay_tokens = min(len(offs), budget)
                    while True:  # the most haystack tokens whose prompt + answer fits the length
                        hay = src[: offs[hay_tokens - 1][1]] if hay_tokens > 0 else ""
                        hay_ids = hay_tokens
                        at = offs[int(hay_ids * depth / 100)][0] if depth < 100 and hay_ids else len(hay)
                        context, span = insert_needle(hay, needle, at)
                        cb, q, p = self._parts(key, value, context)
                        over = self._tokens(cb, q, p) + self.max_new_tokens - length
                        if over <= 0 or hay_tokens == 0:
                            break
                        hay_tokens = max(0, hay_tokens - over)
                    if over > 0:
                        raise DataError(f"data.lengths has {length}, too short for the NIAH prompt and answer; "
                                        "allowed: a larger length")
                    ex_id = f"niah-{length}-d{depth:g}-s{self.seed}-{k}"
                    lead = len(cb) - len(context)
                    tok_pos = evidence_positions(self._tok, self._chat, cb, [(lead + span[0], lead + span[1])])
                    meta = {"task": "niah", "length": length, "depth": depth, "index": k, "key": key,
                            "needle_span": [span[0], span[1]], "needle_token_span": [tok_pos[0], tok_pos[-1] + 1],
                            "haystack_tokens": hay_tokens, "total_tokens": length + over,
                            "answer_prefix": p, "max_new_tokens": self.max_new_tokens}
                    qn = Question(id=f"{ex_id}-q", question=q, answers=[value], meta=meta)
                    exs.append(QAExample(id=ex_id, context=context, questions=[qn], meta=dict(meta)))
        self._cache = exs
        return exs

    # -- prompt ---------------------------------------------------------------------------------------------
    def context_block(self, ex: QAExample) -> str:
        return self._parts(ex.meta["key"], "", ex.context)[0]

    def question_block(self, q: Question) -> str:
        return self._parts(q.meta["key"], "", "")[1]

    def answer_prefix(self, q: Question) -> str:
        return q.meta["answer_prefix"]

    def evidence_spans(self, ex: QAExample) -> list[tuple[int, int]]:
        """The needle's characters in ``context_block(ex)``: the runner reports the share of its tokens a method
        holds after the prefill (``evidence_kept``)."""
        lead = len(self.context_block(ex)) - len(ex.context)
        a, b = ex.meta["needle_span"]
        return [(lead + a, lead + b)]

    # -- scoring --------------------------------------------------------------------------------------------
    def postprocess(self, generated: str) -> str:
        return generated

    def score(self, prediction: str, q: Question) -> dict[str, float]:
        return {"niah": score_item("niah", prediction, q.answers)}

    def aggregate(self, records: list[dict]) -> dict[str, float | None]:
        """``niah_score`` (mean over every cell's samples, 0-100) and its standard error."""
        out = ruler_summary(records, "niah")
        return {k: v for k, v in out.items() if not k.startswith("niah_niah")}
