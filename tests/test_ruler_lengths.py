"""RULER's length rule with SmolLM2's real tokenizer and chat template (no model forward): every task's sample
is within one haystack step of data.length at 4K, 8K and 16K (cwe, vt and fwe also at 32K): its prompt + tokens
to generate fits, and the same sample one step larger (RULER's step for the task) would not."""
from __future__ import annotations

import pytest

from luka_bench.data.base import qa_prompt_ids
from luka_bench.data.ruler import TASKS, Ruler
from luka_bench.data.ruler_gen import largest_fit, tokens_to_generate

LENGTHS = (4096, 8192, 16384)
LONG = 32768
LONG_TASKS = ("cwe", "vt", "fwe")  # the tasks whose search was capped: 32K for them only (the rest adds ~30 s)
CASES = [(t, n) for n in LENGTHS for t in TASKS] + [(t, LONG) for t in LONG_TASKS]


@pytest.fixture(scope="module")
def generated(smollm2_tokenizer):
    """One sample per task and length (seed default), generated once for all the cases."""
    out = {}
    for n in LENGTHS + (LONG,):
        r = Ruler(task="all" if n != LONG else ",".join(LONG_TASKS), length=n, limit=1)
        r.prepare(smollm2_tokenizer, None, True)
        out[n] = (r, {e.meta["task"]: e for e in r.examples()})
    return out


@pytest.mark.parametrize("task,length", CASES)
def test_every_sample_within_one_step_of_the_length(generated, smollm2_tokenizer, task, length):
    r, exs = generated[length]
    ex = exs[task]
    q = ex.questions[0]
    c, qi = qa_prompt_ids(smollm2_tokenizer, True, ex.context, q.question, q.meta["answer_prefix"])
    total = len(c) + len(qi) + tokens_to_generate(task)
    assert total == q.meta["total_tokens"] <= length
    units, step = q.meta["haystack_units"], r.step(task)
    again, _ = r.draw(task, 0, units)
    assert again.context == ex.context  # the sample is the generator's draw at its size
    _, bigger = r.draw(task, 0, units + step)
    # one step more overflows, i.e. the sample is less than one step (in its own tokens) short of the length
    assert bigger > length, (task, length, total, bigger)
    assert length - total < bigger - total


def test_search_is_not_capped_by_the_fixed_part_of_the_prompt():
    """A prompt with a large fixed part (template, example) and cheap units: the search still reaches the
    largest size that fits (RULER's bound from the tokens per unit at the first step would stop far below)."""
    fixed, per_unit, budget = 1000, 3, 16384
    best = largest_fit(lambda m: fixed + per_unit * m, incremental=10, budget=budget, gen=120)
    assert best == (budget - 120 - fixed) // per_unit


@pytest.mark.parametrize("fixed,per_unit,budget,inc", [(0, 1, 50, 5), (40, 7, 500, 5), (900, 25, 4096, 25),
                                                       (100, 1, 100_000, 500)])
def test_search_finds_the_boundary(fixed, per_unit, budget, inc):
    calls = []

    def total(m):
        calls.append(m)
        return fixed + per_unit * m

    best = largest_fit(total, inc, budget, 0)
    assert total(best) <= budget < total(best + 1)
    assert len(calls) <= 20  # a few tokenizations, not a scan
    assert largest_fit(lambda m: budget + 1, inc, budget, 0) is None  # nothing fits
