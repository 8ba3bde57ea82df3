"""The public API: ``lb.method``, ``lb.load_model``, ``lb.attach`` -> ``kv.generate`` / ``kv.new_cache`` under plain
``model.generate``. Every conf/method through ``model.generate`` equals the runner's protocol token for token."""
from __future__ import annotations

import math
import re

import pytest
import torch

import luka_bench as lb
from luka_bench import engine as E
from luka_bench.errors import group_options

from conftest import ROOT

PROMPT = 200
NEW = 10


def _prompt(seed: int = 0, n: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def generate_by_the_tail_rule(kv, model, ids: torch.Tensor, **kw) -> tuple[torch.Tensor, object]:
    """Plain transformers under the engine's tail rule: ``kv.prefilled_cache`` prefills (and compresses) the
    prompt minus its last token, and ``model.generate`` with that cache feeds the last token through the
    compressed cache before the first generated token."""
    cache = kv.prefilled_cache(ids)
    return model.generate(ids, past_key_values=cache, max_new_tokens=NEW, do_sample=False, **kw), cache


@pytest.mark.parametrize("name", group_options("method"))
def test_model_generate_through_a_method_cache_equals_kv_generate(name, tiny_llama, one_thread):
    """``model.generate`` through ``kv.new_cache()`` after a prefill of all but the prompt's last token runs the
    method as the engine does with the whole prompt as the context (its last token the tail): same tokens, same
    tokens held in every layer."""
    ids = _prompt()
    if name == "duo_attention":  # no learned head pattern ships for the tiny models: a synthetic one
        return _generate_equals(tiny_llama, lb.method(name, pattern_seed=0, sink=4, recent=16), ids)
    if lb.method(name).question_in_prompt:  # FINCH: no question in a prompt of ids: refused in one line
        from luka_bench.methods.base import MethodConfigError

        with lb.attach(tiny_llama.model, lb.method(name)) as kv, pytest.raises(MethodConfigError, match="query_aware"):
            kv.generate(ids[0].tolist(), max_new_tokens=NEW)
        return
    _generate_equals(tiny_llama, lb.method(name), ids)


def _generate_equals(tiny_llama, method, ids):
    with lb.attach(tiny_llama.model, method) as kv:
        ans = kv.generate(ids[0].tolist(), max_new_tokens=NEW)
        out, cache = generate_by_the_tail_rule(kv, tiny_llama.model, ids)
    got = out[0, PROMPT:].tolist()
    assert got[: len(ans.token_ids)] == ans.token_ids and ans.tail_tokens == 1
    if len(ans.token_ids) < NEW:  # the engine stopped at an end-of-sequence id, which generate keeps
        assert got[len(ans.token_ids)] in E.eos_token_ids(tiny_llama.model, None)
    assert [layer.keys.shape[-2] for layer in cache.layers] == ans.kv_tokens
    assert cache.phase == "decode" and cache.reference_length == PROMPT - 1


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_gemma3"])
@pytest.mark.parametrize("name", ["full", "h2o"])
def test_model_generate_equals_kv_generate_on_other_architectures(arch, name, request, one_thread):
    """Qwen3 (QK-norm) and Gemma3 (sliding-window layers left to exact windowed attention) as well."""
    lm = request.getfixturevalue(arch)
    ids = _prompt(11)
    with lb.attach(lm.model, lb.method(name, **({} if name == "full" else {"budget": 0.25}))) as kv:
        ans = kv.generate(ids[0].tolist(), max_new_tokens=NEW)
        out, cache = generate_by_the_tail_rule(kv, lm.model, ids)
    assert out[0, PROMPT:].tolist()[: len(ans.token_ids)] == ans.token_ids
    assert [layer.keys.shape[-2] for layer in cache.layers] == ans.kv_tokens


def test_full_through_model_generate_equals_stock_generate(tiny_llama, one_thread):
    ids = _prompt(1)
    stock = tiny_llama.model.generate(ids, max_new_tokens=NEW, do_sample=False)
    with lb.attach(tiny_llama.model, "full") as kv:
        got = tiny_llama.model.generate(ids, past_key_values=kv.new_cache(), max_new_tokens=NEW, do_sample=False)
    assert got.tolist() == stock.tolist()


def test_snapkv_through_model_generate_holds_its_budget(tiny_llama, one_thread):
    """SnapKV at 0.125 compresses the prompt once, then keeps what it generates: every layer holds at most
    ceil(0.125 x prompt) + generated tokens, and physically (``cache.layers[i].keys``)."""
    ids = _prompt(2)
    with lb.attach(tiny_llama.model, lb.method("snapkv", budget=0.125)) as kv:
        cache = kv.new_cache()
        out = tiny_llama.model.generate(ids, past_key_values=cache, max_new_tokens=NEW, do_sample=False)
    generated = out.shape[1] - PROMPT
    for layer in cache.layers:
        assert layer.keys.shape[-2] <= math.ceil(0.125 * PROMPT) + generated
        assert layer.keys.shape[-2] < PROMPT // 4


def test_a_method_that_prefills_in_blocks_gets_its_blocks_from_model_generate(tiny_llama, one_thread):
    """LASER-KV selects after every block of S prompt tokens: one ``model(...)`` call with the whole prompt is
    split into those blocks by the attach hook, so it equals feeding the blocks by hand (a manual cache)."""
    ids = _prompt(3)
    method = lb.method("laser_kv", block_size=64)
    with lb.attach(tiny_llama.model, method) as kv, torch.no_grad():
        auto = kv.new_cache()
        a = [tiny_llama.model(ids, past_key_values=auto).logits[0, -1]]
        hand = kv.new_cache(reference_length=PROMPT, manual=True)
        for s in range(0, PROMPT, 64):
            b = [tiny_llama.model(ids[:, s: s + 64], past_key_values=hand).logits[0, -1]]
        hand.end_prefill()
        nxt = _prompt(4, 5)
        for t in range(5):
            a.append(tiny_llama.model(nxt[:, t: t + 1], past_key_values=auto).logits[0, -1])
            b.append(tiny_llama.model(nxt[:, t: t + 1], past_key_values=hand).logits[0, -1])
    assert [s.n for s in auto.stores] == [s.n for s in hand.stores] and auto.stores[0].n < PROMPT
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-5)


def test_question_is_fed_through_the_compressed_cache_not_compressed(tiny_llama, one_thread):
    """``kv.generate(context, question)``: the context is compressed, the question's tokens are all held after
    it (StreamingLLM at 0.25 holds a quarter of the context, then every question token)."""
    ctx, q = _prompt(5)[0].tolist(), _prompt(6, 12)[0].tolist()
    with lb.attach(tiny_llama.model, lb.method("streaming_llm", budget=0.25)) as kv:
        ans = kv.generate(ctx, question=q, max_new_tokens=1)
    assert ans.kv_ratio_context == pytest.approx(0.25, abs=0.01)
    assert ans.context_tokens == PROMPT and ans.question_tokens == 12


@pytest.mark.parametrize("name", ["full", "streaming_llm"])
def test_generate_with_a_batch_of_rows_of_one_length_gives_each_rows_own_tokens(name, tiny_llama):
    """``model.generate`` through a method's cache with a batch of equal-length prompts (issue 60's first step):
    each row's greedy tokens are the row's alone."""
    ids = torch.cat([_prompt(7), _prompt(8)])
    method = lb.method(name, budget=0.25) if name != "full" else name
    with lb.attach(tiny_llama.model, method) as kv:
        both = tiny_llama.model.generate(ids, past_key_values=kv.new_cache(), max_new_tokens=4, do_sample=False)
        alone = [tiny_llama.model.generate(ids[r: r + 1], past_key_values=kv.new_cache(), max_new_tokens=4,
                                           do_sample=False) for r in range(2)]
    assert torch.equal(both, torch.cat(alone))


@pytest.mark.parametrize("name", ["h2o", "lychee"])
def test_generate_many_decodes_prompts_of_different_lengths_together_each_as_alone(name, tiny_llama):
    """``kv.generate_many``: prompts of 256, 200 and 150 tokens, each with its question, decoded as rows of one
    batch (``batch_size`` 3, and 2: a batch of two then one) — each answer's tokens, kv ratios and held tokens equal
    ``generate``'s for the prompt alone."""
    contexts = [_prompt(9)[0].tolist(), _prompt(10)[0, :200].tolist(), _prompt(11)[0, :150].tolist()]
    questions = [_prompt(12, 6)[0].tolist(), _prompt(13, 3)[0].tolist(), _prompt(14, 9)[0].tolist()]
    method = lb.method(name, budget=0.25) if name == "h2o" else lb.method(name, chunking="fixed")
    with lb.attach(tiny_llama.model, method) as kv:
        alone = [kv.generate(c, q, max_new_tokens=6) for c, q in zip(contexts, questions)]
        for size in (3, 2):
            many = kv.generate_many(contexts, questions, max_new_tokens=6, batch_size=size)
            for a, m in zip(alone, many):
                assert (m.token_ids, m.kv_ratio, m.kv_ratio_context, m.kv_tokens) == \
                       (a.token_ids, a.kv_ratio, a.kv_ratio_context, a.kv_tokens)
        with pytest.raises(ValueError, match=r"^batch_size=0: must be an integer >= 1$"):
            kv.generate_many(contexts, questions, batch_size=0)
        with pytest.raises(ValueError, match="^3 contexts and 2 questions"):
            kv.generate_many(contexts, questions[:2])


def test_a_padded_batch_or_a_method_that_refuses_one_is_refused_in_one_line(tiny_llama):
    ids = torch.cat([_prompt(7), _prompt(8)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    with lb.attach(tiny_llama.model, "full") as kv, pytest.raises(NotImplementedError) as e:
        tiny_llama.model.generate(ids, attention_mask=mask, past_key_values=kv.new_cache(), max_new_tokens=2,
                                  do_sample=False)
    assert "unpadded" in str(e.value) and "\n" not in str(e.value)
    with lb.attach(tiny_llama.model, lb.method("lychee", chunking="fixed")) as kv, pytest.raises(ValueError) as e:
        tiny_llama.model.generate(ids, past_key_values=kv.new_cache(), max_new_tokens=2, do_sample=False)
    assert str(e.value).startswith("method=lychee runs one sequence at a time: got a batch of 2 (")
    assert "\n" not in str(e.value)


def test_method_settings_are_validated_as_the_command_line_validates_them():
    from luka_bench.methods.base import MethodConfigError

    assert lb.method("snapkv", budget=0.125).budget == 0.125
    with pytest.raises(MethodConfigError, match="Did you mean 'snapkv'"):
        lb.method("snapk")
    with pytest.raises(MethodConfigError, match="budget"):
        lb.method("snapkv", budget=1.5)
    with pytest.raises(Exception, match="not a setting of method=snapkv; allowed: .*budget"):
        lb.method("snapkv", bugdet=0.5)


def test_load_model_takes_a_conf_name_a_loaded_model_or_refuses_in_one_line(tiny_llama):
    from luka_bench.models import LoadedModel, ModelUnavailable

    lm = lb.load_model("tiny_llama", num_hidden_layers=2)
    assert isinstance(lm, LoadedModel) and lm.model.config.num_hidden_layers == 2
    same = lb.load_model(tiny_llama.model, tokenizer=tiny_llama.tokenizer)
    assert same.model is tiny_llama.model
    with pytest.raises(ModelUnavailable, match="neither a conf/model name"):
        lb.load_model("no_such_model")


def _readme_snippet() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Use it from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_python_snippet_runs_as_written_and_snapkv_holds_an_eighth(one_thread):
    """The README's "Use it from Python" block, executed as written on SmolLM2: the answer comes back, and SnapKV
    at 0.125 through plain ``model.generate`` holds at most 1/8 of the prompt (+ the generated tokens)."""
    scope: dict = {}
    exec(compile(_readme_snippet(), "README.md", "exec"), scope)
    answer, out, cache, ids = scope["answer"], scope["out"], scope["cache"], scope["ids"]
    assert answer.text and answer.kv_ratio_context <= math.ceil(answer.context_tokens / 8) / answer.context_tokens
    prompt = ids.shape[1]
    generated = out.shape[1] - prompt
    # the prefill is all but the last token (the tail rule); the tail and the generated tokens are held on top
    assert max(layer.keys.shape[-2] for layer in cache.layers) <= math.ceil((prompt - 1) / 8) + 1 + generated


def _plan(ctx, q):
    from luka_bench.prompting import ExamplePlan, QuestionPlan

    qp = QuestionPlan(question=None, ids=q, max_new_tokens=3, tail=3)
    return ExamplePlan(example=None, context_ids=ctx, questions=[qp], question_ids=q), qp


def test_query_aware_protocol_compresses_the_question_with_the_context(tiny_llama, one_thread):
    """``query_aware``: a prefill-only method (StreamingLLM at 0.25) compresses context + question (all but its
    tail of 3 tokens) as one prompt, so its compressed cache holds a quarter of both and includes the question's
    last tokens before the tail; the default feeds the question through a cache compressed from the context alone."""
    from luka_bench.engine import answer_example

    ctx, q = _prompt(9)[0].tolist(), _prompt(10, 40)[0].tolist()
    plan, qp = _plan(ctx, q)
    with lb.attach(tiny_llama.model, lb.method("streaming_llm", budget=0.25, sink=4)) as kv:
        aware = next(answer_example(tiny_llama, kv.attached, plan, [qp], set(), (), query_aware=True))
        plain = next(answer_example(tiny_llama, kv.attached, plan, [qp], set(), ()))
    n = PROMPT + len(q) - 3
    assert aware.prefill["kv_tokens_prefill"] == [math.ceil(0.25 * n)] * 3
    assert aware.generation.tail_tokens == 3 and plain.generation.tail_tokens == len(q)
    assert plain.prefill["kv_tokens_prefill"] == [math.ceil(0.25 * PROMPT)] * 3
    pos = aware.cache.stores[0].positions[0, 0].tolist()
    assert set(range(n - 10, n)) <= set(pos) and aware.cache.reference_length == n  # question tokens compressed in
    assert plain.cache.reference_length == PROMPT
