"""RULER (Hsieh et al., 2024; NVIDIA/RULER): 13 synthetic long-context tasks, generated offline to the recipe of
``scripts/synthetic.yaml`` and ``scripts/data/synthetic/*.py``, scored by ``scripts/eval`` (see
:mod:`luka_bench.data.scoring_ruler`). Card: ``datasets/ruler.md``.

Each sample is one example with one question. Its text is RULER's task template split in three: the context
block (instruction and haystack, plus the in-context example of vt/cwe: what the method compresses), the
question block (the question after the haystack) and the answer prefix (after the chat template's assistant
header, where the model has one). ``data.length`` counts the whole prompt in the model's own tokens, chat template
included (RULER's ``model_template_token``), plus the task's ``tokens_to_generate``; the haystack is the largest
that fits (RULER's search, its bound fixed: ``ruler_gen.largest_fit``), and every sample ends within one of RULER's
haystack steps of the length (``Ruler.step``): one step more would overflow.

Sources: ``synthetic`` (the generator: :mod:`luka_bench.data.ruler_gen`), ``hub`` (the pre-generated
``simonjegou/ruler`` set the KV-compression leaderboard uses: columns context, question, answer_prefix, answer, task,
max_new_tokens), ``file`` (a JSON / JSON-lines file in that schema). A file or hub set that holds only some of the
tasks runs those under ``data.task=all`` (a log line names the tasks it holds and lacks); a task named in
``data.task`` that it lacks is refused.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from luka_bench.data.base import (Task, DataError, QAExample, Question, check_source, qa_prompt_ids,
                                   read_json_or_jsonl, require_fields)
from luka_bench.data.ruler_gen import (INCREMENT, TASKS, Generator, Sample, essay_words, hotpot_pool,
                                       largest_fit, min_length, read_haystack, ruler_essays_text, squad_pool,
                                       tokens_to_generate, word_lists)
from luka_bench.data.scoring_ruler import headline_rule, ruler_summary, score_item

__all__ = ["Ruler", "TASKS", "Sample", "HUB_ID", "HUB_FIELDS", "QA_SOURCES", "validate_hub_rows"]

log = logging.getLogger(__name__)

HUB_ID = "simonjegou/ruler"
SOURCES = ("synthetic", "hub", "file")
QA_SOURCES = ("synthetic", "hub")
HUB_FIELDS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")


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
        g = Generator(task, self.seed, self.length, hay, self._qa_pool(task) if fam == "qa" else None)
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
            best = largest_fit(lambda m: self.prompt_tokens(make(search_rng, m)), inc, budget, gen)
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

    def _fwe_words(self, g: Generator, vocab: list[str], max_len: int) -> int:
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
            if absent and (self.task != "all" or not seen):  # a task asked by name, or none at all
                raise DataError(f"ruler: {self.source} rows hold no sample of task {absent[0]!r}; "
                                f"they hold: {', '.join(sorted({r['task'] for r in rows})) or 'no rows'}")
            if absent:  # data.task=all: the tasks the rows hold
                log.warning("ruler: data.task=all runs the %d tasks the %s rows hold (%s); they hold no sample of %s",
                            len(seen), self.source, ", ".join(t for t in self.tasks if t in seen), ", ".join(absent))
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

