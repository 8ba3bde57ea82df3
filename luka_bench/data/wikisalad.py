"""WikiSalad (LuKA paper, §4.1): interleaved segments of several articles, one question per segment.

An example samples N articles (2 or 3) and lays out segments following a difficulty pattern, e.g. ``ABAB``:
segment i belongs to the article of letter ``pattern[i]`` and is built from that article's i-th answerable QA pair
(wrapping); its text is ~3 sentences of that QA's paragraph. The context is the concatenation of the segments and
each segment contributes the question it was built from. See ``datasets/wikisalad.md`` for the full card.

Sources of articles (all turned into the same internal form, :class:`Article`):
- ``synthetic``: :func:`luka_bench.data.synthetic_articles.generate_squad` (offline, invented entities);
- ``squad_v2``: Hugging Face ``rajpurkar/squad_v2`` via ``datasets.load_dataset`` (needs the hub);
- a local SQuAD v2 JSON file (``source="file", path=...`` or ``source=<path>``).
"""
from __future__ import annotations

import functools
import json
import os
import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from luka_bench.data.base import Task, DataError, QAExample, Question, file_problem
from luka_bench.data.synthetic_articles import generate_squad
from luka_bench.metrics import exact_match, f1_score, lenient_match

__all__ = [
    "PATTERNS", "PROMPT_INSTRUCTION", "Article", "SourceQA", "WikiSalad", "articles_from_squad", "build_example",
    "load_squad_file", "load_squad_hub", "segment_text", "squad_rows_to_dict",
]

PATTERNS: dict[str, str] = {
    "easy": "ABAB",
    "medium": "AABBAABB",
    "hard": "ABCABC",
    "very_hard": "AAABBBCCCAAABBBCCC",
}
# ``target_chars: paper``: context lengths of the LuKA paper (1.5K / 2.5K / 2K / 4K tokens) in characters, at
# the ~3.5 characters per token of SmolLM2's tokenizer on this text (datasets/wikisalad.md).
PAPER_TARGET_CHARS: dict[str, int] = {"easy": 5300, "medium": 8800, "hard": 7000, "very_hard": 14000}
SOURCES = ("synthetic", "squad_v2", "file")
HUB_ID = "rajpurkar/squad_v2"
HUB_SPLITS = ("train", "validation")
MIN_FRAGMENT_CHARS = 50  # sentences of at most this many characters are dropped (unless they hold the answer)

PROMPT_INSTRUCTION = "Answer the following question in one short phrase. Do not include any other text."


# ---------------------------------------------------------------------------------------------------------------
# internal form
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceQA:
    """One answerable QA pair of an article, with the segment text built from its paragraph."""

    id: str
    question: str
    answers: tuple[str, ...]  # distinct gold texts that occur in ``segment``; the first is the annotated span
    segment: str  # ~3 sentences of the paragraph, always containing the first answer


@dataclass(frozen=True)
class Article:
    title: str
    qas: tuple[SourceQA, ...]  # answerable QA pairs in document order


# ---------------------------------------------------------------------------------------------------------------
# segment text
# ---------------------------------------------------------------------------------------------------------------

_SENT_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*(?=\s|$)")


def _sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the sentences of ``text``, stripped of surrounding white space."""
    spans: list[tuple[int, int]] = []
    start = 0
    bounds = [m.end() for m in _SENT_END.finditer(text)]
    if not bounds or bounds[-1] < len(text):
        bounds.append(len(text))
    for end in bounds:
        s, e = start, end
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if e > s:
            spans.append((s, e))
        start = end
    return spans


def segment_text(context: str, answer_start: int, answer_len: int, n_sentences: int = 3,
                 min_chars: int = MIN_FRAGMENT_CHARS) -> str:
    """The segment text for a QA pair: the first ``n_sentences`` sentences of its paragraph that are longer than
    ``min_chars`` characters, shifted so that the sentence(s) holding the answer span are always included.

    Rules (the reference code took the first ~3 sentences, which can lose the answer):
    - the sentences overlapping ``[answer_start, answer_start + answer_len)`` are merged into one unit (so an
      answer crossing a false sentence boundary such as "St. Louis" stays intact) and are never dropped, even when
      shorter than ``min_chars``;
    - other sentences of ``min_chars`` characters or fewer are dropped;
    - of the remaining units, take the first ``n_sentences``; if the answer unit is not among them, take the
      ``n_sentences`` consecutive units ending with the answer unit;
    - units are joined with one space.
    """
    spans = _sentence_spans(context)
    a0, a1 = answer_start, answer_start + max(answer_len, 1)
    req = [i for i, (s, e) in enumerate(spans) if s < a1 and e > a0]
    units: list[tuple[int, int]] = []
    ans_unit = -1
    i = 0
    while i < len(spans):
        if req and i == req[0]:
            ans_unit = len(units)
            units.append((spans[req[0]][0], spans[req[-1]][1]))
            i = req[-1] + 1
            continue
        s, e = spans[i]
        if e - s > min_chars:
            units.append((s, e))
        i += 1
    if ans_unit < 0:  # answer not inside any sentence (should not happen): fall back to the first sentences
        chosen = units[:n_sentences]
    elif ans_unit < n_sentences:
        chosen = units[:n_sentences]
    else:
        chosen = units[ans_unit - n_sentences + 1: ans_unit + 1]
    return " ".join(context[s:e] for s, e in chosen)


# ---------------------------------------------------------------------------------------------------------------
# sources -> articles
# ---------------------------------------------------------------------------------------------------------------


def _field(obj: Any, key: str, where: str, required: Iterable[str], src: str) -> Any:
    if not isinstance(obj, Mapping) or key not in obj:
        raise DataError(f"{src}: {where} is missing required field {key!r} (required: {', '.join(required)})")
    return obj[key]


_ART_FIELDS = ("title", "paragraphs")
_PAR_FIELDS = ("context", "qas")
_QA_FIELDS = ("id", "question", "answers")
_ANS_FIELDS = ("text", "answer_start")


def articles_from_squad(squad: Mapping[str, Any], src: str = "SQuAD data", n_sentences: int = 3,
                        min_chars: int = MIN_FRAGMENT_CHARS) -> list[Article]:
    """Validate a SQuAD v2 dict and turn it into :class:`Article` s (answerable QA pairs only).

    Unanswerable questions (``is_impossible`` or no answers) are skipped, as are answers whose text cannot be found
    in the paragraph; articles left with no QA pair are dropped. Articles sharing a title are merged.
    """
    data = _field(squad, "data", "the top level", ("version", "data"), src)
    if not isinstance(data, list):
        raise DataError(f"{src}: field 'data' must be a list of articles, got {type(data).__name__}")
    by_title: dict[str, list[SourceQA]] = {}
    for ai, art in enumerate(data):
        title = str(_field(art, "title", f"data[{ai}]", _ART_FIELDS, src))
        pars = _field(art, "paragraphs", f"data[{ai}]", _ART_FIELDS, src)
        qas_out = by_title.setdefault(title, [])
        for pi, par in enumerate(pars):
            where_p = f"data[{ai}].paragraphs[{pi}]"
            context = _field(par, "context", where_p, _PAR_FIELDS, src)
            qas = _field(par, "qas", where_p, _PAR_FIELDS, src)
            for qi, qa in enumerate(qas):
                where_q = f"{where_p}.qas[{qi}]"
                qid = str(_field(qa, "id", where_q, _QA_FIELDS, src))
                question = _field(qa, "question", where_q, _QA_FIELDS, src)
                answers = _field(qa, "answers", where_q, _QA_FIELDS, src)
                spans = []
                for ni, ans in enumerate(answers):
                    text = _field(ans, "text", f"{where_q}.answers[{ni}]", _ANS_FIELDS, src)
                    start = _field(ans, "answer_start", f"{where_q}.answers[{ni}]", _ANS_FIELDS, src)
                    spans.append((str(text), int(start)))
                if qa.get("is_impossible", False) or not spans:
                    continue  # unanswerable: skipped (see the dataset card)
                sqa = _make_qa(qid, str(question), str(context), spans, n_sentences, min_chars)
                if sqa is not None:
                    qas_out.append(sqa)
    return [Article(t, tuple(q)) for t, q in by_title.items() if q]


def _make_qa(qid: str, question: str, context: str, spans: list[tuple[str, int]], n_sentences: int,
             min_chars: int) -> SourceQA | None:
    located = []
    for text, start in spans:
        if not text.strip():
            continue
        if context[start:start + len(text)] != text:  # off annotation: use the first occurrence instead
            start = context.find(text)
            if start < 0:
                continue
        located.append((text, start))
    if not located:
        return None
    text0, start0 = located[0]
    seg = segment_text(context, start0, len(text0), n_sentences, min_chars)
    golds = []
    for text, _ in located:
        if text in seg and text not in golds:
            golds.append(text)
    if not golds:  # cannot happen (the answer sentence is always kept), but never emit an unanswerable segment
        return None
    return SourceQA(qid, question.strip(), tuple(golds), seg)


def squad_rows_to_dict(rows: Iterable[Mapping[str, Any]], src: str = "rows") -> dict:
    """Hugging Face ``rajpurkar/squad_v2`` rows (``id, title, context, question, answers{text, answer_start}``)
    -> SQuAD v2 dict, grouping rows by title then by context, in order of first appearance."""
    required = ("id", "title", "context", "question", "answers")
    arts: dict[str, dict[str, list[dict]]] = {}
    for ri, row in enumerate(rows):
        where = f"row {ri}"
        vals = {k: _field(row, k, where, required, src) for k in required}
        ans = vals["answers"]
        texts = _field(ans, "text", f"{where}.answers", _ANS_FIELDS, src)
        starts = _field(ans, "answer_start", f"{where}.answers", _ANS_FIELDS, src)
        if len(texts) != len(starts):
            raise DataError(f"{src}: {where}.answers has {len(texts)} texts but {len(starts)} answer_start values")
        qa = {
            "id": str(vals["id"]),
            "question": vals["question"],
            "is_impossible": len(texts) == 0,
            "answers": [{"text": t, "answer_start": int(s)} for t, s in zip(texts, starts)],
        }
        arts.setdefault(str(vals["title"]), {}).setdefault(vals["context"], []).append(qa)
    return {
        "version": "v2.0",
        "data": [{"title": t, "paragraphs": [{"context": c, "qas": q} for c, q in pars.items()]}
                 for t, pars in arts.items()],
    }


def load_squad_file(path: str) -> dict:
    """A local SQuAD v2 JSON file (``{"data": [...]}``), or a JSON list / JSON-lines file of hub-schema rows."""
    problem = file_problem(path)
    if problem is not None:
        raise DataError(f"WikiSalad: SQuAD file {path} {problem}; allowed: a SQuAD v2 JSON file or JSON lines of rows")
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"WikiSalad: cannot read {path}: {e.strerror}") from e
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        try:  # JSON lines of hub-schema rows
            obj = [json.loads(line) for line in raw.splitlines() if line.strip()]
        except json.JSONDecodeError:
            raise DataError(f"WikiSalad: {path} is not valid JSON ({e.msg} at line {e.lineno})") from e
    if isinstance(obj, list):
        return squad_rows_to_dict(obj, src=path)
    if not isinstance(obj, dict):
        raise DataError(f"WikiSalad: {path} must hold a SQuAD v2 object with field 'data', got {type(obj).__name__}")
    return obj


def load_squad_hub(split: str = "train", name: str = HUB_ID) -> dict:
    """``rajpurkar/squad_v2`` from the Hugging Face hub (``datasets.load_dataset``), as a SQuAD v2 dict."""
    if split not in HUB_SPLITS:
        raise DataError(f"WikiSalad: unknown split {split!r} for {name}; allowed: {', '.join(HUB_SPLITS)}")
    from datasets import load_dataset

    try:
        ds = load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - one line for the user; the chain keeps the details
        first = (str(e).strip().splitlines() or [""])[0]
        raise DataError(f"WikiSalad: could not load {name} split {split!r}: {type(e).__name__}: {first}") from e
    return squad_rows_to_dict(ds, src=f"{name}[{split}]")


# ---------------------------------------------------------------------------------------------------------------
# examples
# ---------------------------------------------------------------------------------------------------------------


def _letters(pattern: str) -> list[str]:
    """Distinct letters in order of first appearance (deterministic, unlike ``list(set(pattern))``)."""
    return list(dict.fromkeys(pattern))


def build_example(articles: list[Article], pattern: str, rng: random.Random, ex_id: str, repeat: int = 1,
                  target_chars: int | None = None, meta: dict[str, Any] | None = None) -> QAExample:
    """One WikiSalad example: sample one article per pattern letter, lay out the segments, collect the questions.

    The pattern is cycled ``repeat`` times, then further whole cycles are added while the context is shorter than
    ``target_chars``; the segment index keeps counting across cycles (so QA pairs keep advancing, wrapping per
    article). A QA pair met again after wrapping adds its segment text again but not a second question.
    """
    letters = _letters(pattern)
    if len(articles) < len(letters):
        raise DataError(f"WikiSalad: pattern {pattern!r} needs {len(letters)} articles with answerable questions, "
                        f"the source has {len(articles)}")
    picks = rng.sample(range(len(articles)), len(letters))
    by_letter = {ltr: articles[j] for ltr, j in zip(letters, picks)}
    segments: list[str] = []
    questions: list[Question] = []
    seen: set[str] = set()
    length = 0
    cycle = 0
    while cycle < max(repeat, 1) or (target_chars is not None and length < target_chars):
        for pos, ltr in enumerate(pattern):
            i = cycle * len(pattern) + pos
            art = by_letter[ltr]
            qa = art.qas[i % len(art.qas)]
            seg = f"# Segment {i + 1}: {art.title}\n\n{qa.segment}\n"
            seg_start = length + (1 if segments else 0)  # segments are joined with "\n"
            segments.append(seg)
            length = seg_start + len(seg)
            if qa.id in seen:
                continue
            seen.add(qa.id)
            body_start = seg_start + seg.index("\n\n") + 2
            questions.append(Question(
                id=f"{ex_id}-s{i + 1}",
                question=qa.question,
                answers=list(qa.answers),
                meta={"segment": i + 1, "letter": ltr, "title": art.title, "source_id": qa.id,
                      "answer_char": body_start + qa.segment.index(qa.answers[0])},
            ))
        cycle += 1
    context = "\n".join(segments)
    m = {"pattern": pattern, "titles": {ltr: a.title for ltr, a in by_letter.items()},
         "n_segments": len(segments), "n_chars": len(context)}
    m.update(meta or {})
    return QAExample(id=ex_id, context=context, questions=questions, meta=m)


@functools.lru_cache(maxsize=8)
def _synthetic_articles(n_articles: int, seed: int, n_sentences: int) -> tuple[Article, ...]:
    """The offline stand-in's articles, built once per setting in a process (a sweep or a test session builds
    the same ones for every run; Articles are frozen, so sharing them is safe)."""
    return tuple(articles_from_squad(generate_squad(n_articles, seed), src="synthetic", n_sentences=n_sentences))


@dataclass
class WikiSalad(Task):
    """WikiSalad task (usable as a Hydra ``_target_``).

    difficulty: easy (ABAB) | medium (AABBAABB) | hard (ABCABC) | very_hard (AAABBBCCCAAABBBCCC).
    source: ``synthetic`` (offline invented articles) | ``squad_v2`` (hub ``rajpurkar/squad_v2``) | ``file``
        (local SQuAD v2 JSON at ``path``) | a path to such a file.
    seed: example k samples its articles with ``random.Random(f"wikisalad:{seed}:{k}")``; the synthetic article
        pool is generated with the same seed.
    limit: number of examples (None: one example per ``len(pattern letters)`` articles of the pool).
    repeat / target_chars: cycle the pattern ``repeat`` times and further until the context has ``target_chars``
        characters (default: the plain pattern once); ``target_chars: paper`` = the paper's length for this
        difficulty (``PAPER_TARGET_CHARS``).
    """

    difficulty: str = "easy"
    source: str = "synthetic"
    path: str | None = None
    split: str = "train"
    seed: int = 42
    limit: int | None = 20
    n_articles: int = 200
    repeat: int = 1
    target_chars: int | str | None = None
    n_sentences: int = 3
    kind: ClassVar[str] = "qa"
    _cache: list[QAExample] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.difficulty not in PATTERNS:
            raise DataError(f"WikiSalad: unknown difficulty {self.difficulty!r}; allowed: {', '.join(PATTERNS)}")
        self._resolve_source()
        for name in ("repeat", "n_sentences", "n_articles"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise DataError(f"WikiSalad: {name} must be an integer >= 1, got {v!r}")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1):
            raise DataError(f"data.limit={self.limit!r} must be an integer >= 1 or null (every item)")
        t = self.target_chars
        if t is not None and t != "paper" and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise DataError(f"WikiSalad: target_chars must be an integer >= 0, 'paper' or null, got {t!r}")

    # -- data -----------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"wikisalad_{self.difficulty}"

    @property
    def pattern(self) -> str:
        return PATTERNS[self.difficulty]

    @property
    def context_chars(self) -> int | None:
        """The context length aimed at, in characters (``target_chars`` with ``paper`` resolved), or None."""
        return PAPER_TARGET_CHARS[self.difficulty] if self.target_chars == "paper" else self.target_chars

    def _resolve_source(self) -> tuple[str, str | None]:
        """(kind, path) with kind in SOURCES; raises DataError for an unknown source."""
        src = str(self.source)
        if src == "synthetic":
            if self.path is not None:
                raise DataError(f"WikiSalad: path={self.path!r} given with source='synthetic'; "
                                "set source=file to read it (allowed sources: synthetic, squad_v2, file, <path>)")
            return "synthetic", None
        if src in ("squad_v2", HUB_ID):
            if self.split not in HUB_SPLITS:
                raise DataError(f"WikiSalad: unknown split {self.split!r} for {HUB_ID}; "
                                f"allowed: {', '.join(HUB_SPLITS)}")
            return "squad_v2", None
        if src == "file":
            if not self.path:
                raise DataError("WikiSalad: source='file' needs path=<local SQuAD v2 .json file>")
            return "file", str(self.path)
        if src.endswith((".json", ".jsonl")) or os.sep in src or os.path.exists(src):
            return "file", src
        raise DataError(f"WikiSalad: unknown source {src!r}; allowed: synthetic, squad_v2, file (with path=...), "
                        "or a path to a local SQuAD v2 .json file")

    def articles(self) -> list[Article]:
        kind, path = self._resolve_source()
        if kind == "synthetic":
            return list(_synthetic_articles(self.n_articles, self.seed, self.n_sentences))
        elif kind == "squad_v2":
            squad, src = load_squad_hub(self.split), f"{HUB_ID}[{self.split}]"
        else:
            assert path is not None
            squad, src = load_squad_file(path), path
        return articles_from_squad(squad, src=src, n_sentences=self.n_sentences)

    def hub_datasets(self) -> list[str]:
        """Hub datasets this data setting downloads (``run.prepare`` checks first that they can be had)."""
        return [HUB_ID] if self._resolve_source()[0] == "squad_v2" else []

    def check(self) -> None:
        """Read and check the source (a local SQuAD file: present, JSON, SQuAD v2 schema) before the model
        loads; the examples are built once and kept."""
        self.examples()

    def examples(self) -> list[QAExample]:
        if self._cache is None:
            arts = self.articles()
            n_letters = len(_letters(self.pattern))
            n = self.limit if self.limit is not None else len(arts) // n_letters
            src = self.source if self.path is None else str(self.path)
            self._cache = [
                build_example(arts, self.pattern, random.Random(f"wikisalad:{self.seed}:{k}"),
                              ex_id=f"wikisalad-{self.difficulty}-{self.seed}-{k}", repeat=self.repeat,
                              target_chars=self.context_chars,
                              meta={"difficulty": self.difficulty, "source": src, "seed": self.seed, "index": k})
                for k in range(n)
            ]
        return self._cache

    # -- prompt ---------------------------------------------------------------------------------------------
    def context_block(self, ex: QAExample) -> str:
        """The part of the user message that holds the context (prefilled once, then compressed by the method)."""
        return ex.context

    def question_block(self, q: Question) -> str:
        """The rest of the user message: instruction and question (reference WikiSalad answer prompt)."""
        return f"\n\n{PROMPT_INSTRUCTION}\n\nQuestion: {q.question}\n\nAnswer:"

    # -- scoring --------------------------------------------------------------------------------------------
    def postprocess(self, generated: str) -> str:
        """First non-empty line (and its first sentence when longer than 100 characters); a leading "Answer:"
        that the model repeats from the prompt is removed."""
        text = generated.strip()
        line = text.split("\n", 1)[0].strip()
        line = re.sub(r"^(?:\**answer\**\s*:\s*)", "", line, flags=re.IGNORECASE).strip()
        if len(line) > 100:
            line = re.split(r"(?<=[.!?])\s+", line, maxsplit=1)[0]
        return line

    def score(self, prediction: str, q: Question) -> dict[str, float]:
        return {
            "em": exact_match(prediction, q.answers),
            "em_lenient": lenient_match(prediction, q.answers),
            "f1": f1_score(prediction, q.answers),
        }
