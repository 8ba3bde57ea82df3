"""The engine's tail rule (luka_bench/engine.py): no token is scored or generated from logits computed before the
method compressed what precedes it. Every client — the runner, the library (``KV.generate``) and lm-eval — feeds a
tail of at least one token through the compressed cache before its first scored or generated token; the runner's
``query_aware=true`` is kvpress's protocol (the question compressed with the context, what follows the question's
text the tail); the engine's greedy decoding is ``model.generate`` up to its first end-of-sequence id, excluded."""
from __future__ import annotations

import pytest
import torch

import luka_bench as lb
from luka_bench import engine as E
from luka_bench.prompting import qa_tail

from conftest import TailFeed, compose


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_decoding_returns_generates_ids_up_to_the_first_eos_excluded(tiny_llama, one_thread):
    """``engine.greedy_decode`` from a tail's logits: the ids ``model.generate`` gives through the same method's
    cache, up to its first end-of-sequence id, that id excluded (made the third generated token here)."""
    model = tiny_llama.model
    ids = _prompt(1, 120)
    with lb.attach(model, lb.method("streaming_llm", budget=0.5)) as kv:
        free = model.generate(torch.tensor([ids]), past_key_values=_by_rule(kv, model, ids), max_new_tokens=8,
                              do_sample=False)[0, len(ids):].tolist()
        eos = free[2]
        want = free[: free.index(eos)]
        ref = model.generate(torch.tensor([ids]), past_key_values=_by_rule(kv, model, ids), max_new_tokens=8,
                             do_sample=False, eos_token_id=eos)[0, len(ids):].tolist()
        assert ref[: len(want) + 1] == want + [eos]  # generate keeps the end-of-sequence id
        cache = kv.new_cache(reference_length=len(ids) - 1)
        pre = E.prefill_with_tail(model, ids[:-1], ids[-1:], cache)
        got = E.greedy_decode(model, None, cache, pre.logits, 8, {eos}, ())
    assert got.token_ids == want and eos not in got.token_ids


def _by_rule(kv, model, ids):
    cache = kv.new_cache(reference_length=len(ids) - 1)
    with torch.no_grad():
        model(torch.tensor([ids[:-1]]), past_key_values=cache)
    return cache


def test_a_prefill_only_method_changes_the_first_generated_tokens_logits(tiny_llama, one_thread):
    """The first generated token's logits come through the compressed cache: StreamingLLM keeping its 4 sinks and
    little else changes them, where the prefill's own logits (exact attention) were full attention's."""
    model, ids = tiny_llama.model, _prompt(2, 300)
    logits = {}
    for name, kw in (("full", {}), ("streaming_llm", {"budget": 0.02, "sink": 4})):
        with lb.attach(model, lb.method(name, **kw)) as kv:
            cache = kv.new_cache(reference_length=len(ids) - 1)
            logits[name] = E.prefill_with_tail(model, ids[:-1], ids[-1:], cache).logits
    assert not torch.allclose(logits["full"], logits["streaming_llm"], atol=1e-3)


def test_the_library_feeds_the_tail_as_decode_steps(tiny_llama, monkeypatch, one_thread):
    """``KV.generate``: with a question its whole question part is the tail; without one the context's last token:
    the tokens fed as decode steps before the first generated token."""
    model = tiny_llama.model
    ctx, q = _prompt(3, 150), _prompt(4, 9)
    feed = TailFeed(model, monkeypatch)
    try:
        with lb.attach(model, lb.method("snapkv", budget=0.1, window=8)) as kv:
            a = kv.generate(ctx, question=q, max_new_tokens=2)
            b = kv.generate(ctx, max_new_tokens=2)
    finally:
        feed.remove()
    assert feed.fed() == [len(q), 1] and (a.tail_tokens, b.tail_tokens) == (len(q), 1)
    assert b.context_tokens == len(ctx)


def _plan(ctx, q, tail):
    from luka_bench.prompting import ExamplePlan, QuestionPlan

    qp = QuestionPlan(question=None, ids=q, max_new_tokens=2, tail=tail)
    return ExamplePlan(example=None, context_ids=ctx, questions=[qp], question_ids=q), qp


def test_query_aware_compresses_up_to_the_question_and_feeds_the_tail_through_the_cache(tiny_llama, monkeypatch,
                                                                                        one_thread):
    """``answer_example(query_aware=True)``: SnapKV's compression sees context + question minus the tail (so its
    observation window ends at the question), and the tail is the first decode-phase forward, before the first
    answer token; the default protocol feeds the whole question part."""
    from luka_bench.methods.snapkv import SnapKV

    model = tiny_llama.model
    ctx, q = _prompt(5, 200), _prompt(6, 14)
    plan, qp = _plan(ctx, q, 4)
    seen = []
    real = SnapKV.after_prefill_cache
    monkeypatch.setattr(SnapKV, "after_prefill_cache", lambda self, cache: seen.append(list(cache.token_ids)) or
                        real(self, cache))
    feed = TailFeed(model, monkeypatch)
    try:
        with lb.attach(model, lb.method("snapkv", budget=0.1, window=8)) as kv:
            aware = next(E.answer_example(tiny_llama, kv.attached, plan, [qp], set(), (), query_aware=True))
            plain = next(E.answer_example(tiny_llama, kv.attached, plan, [qp], set(), ()))
    finally:
        feed.remove()
    assert seen[0] == ctx + q[:-4] and seen[1] == ctx  # the window: the last prefilled queries, ending at q[-5]
    assert feed.fed() == [4, len(q)]
    assert (aware.generation.tail_tokens, plain.generation.tail_tokens) == (4, len(q))


def test_qa_tail_is_what_follows_the_questions_text(smollm2_tokenizer):
    """With SmolLM2's chat template the query-aware tail is the end of the user's turn, the assistant header and
    the answer prefix; without a template the answer prefix; at least one token."""
    from luka_bench.data.base import qa_prompt_ids

    tok = smollm2_tokenizer
    for chat, prefix, want in ((True, "The answer is", "<|im_end|>\n<|im_start|>assistant\nThe answer is"),
                               (True, "", "<|im_end|>\n<|im_start|>assistant\n"),
                               (False, " Answer:", " Answer:")):
        _, q = qa_prompt_ids(tok, chat, "Some context here.", "\n\nQuestion: where is it?", prefix)
        n = qa_tail(tok, chat, "Some context here.", "\n\nQuestion: where is it?", prefix)
        assert tok.decode(q[-n:]) == want and tok.decode(q[:-n]).endswith("where is it?"), (chat, prefix)
    _, q = qa_prompt_ids(tok, False, "Some context here.", "\n\nQuestion: where is it?", "")
    assert qa_tail(tok, False, "Some context here.", "\n\nQuestion: where is it?", "") == 1


def _watched(lm, feed):
    feed.watch(lm.model)
    return lm


def test_the_runner_feeds_the_query_aware_tail_as_decode_steps(tmp_path, monkeypatch):
    """``python -m luka_bench ... query_aware=true``: the tokens fed as decode steps before each question's first
    answer token are its tail (``tail_tokens`` in the record; RULER's answer prefix here, more than one token)."""
    import luka_bench.models as models

    import json

    from luka_bench import run as R

    cfg = compose("model=tiny_llama", "model.num_hidden_layers=2", "data=ruler", "data.task=niah_single_1",
                  "data.length=1024", "data.limit=1", "method=snapkv", "method.budget=0.25", "method.window=8",
                  "query_aware=true", "max_new_tokens=2", "progress=false")
    feed = TailFeed(None, monkeypatch)
    built = models.TinyRandomModel.load
    monkeypatch.setattr(models.TinyRandomModel, "load", lambda self, *a, **k: _watched(built(self, *a, **k), feed))
    R.run(cfg, tmp_path / "run")
    recs = [json.loads(x) for x in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]
    assert feed.fed() == [r["tail_tokens"] for r in recs] and all(r["tail_tokens"] > 1 for r in recs)


def test_the_librarys_query_aware_generate_compresses_the_question(tiny_llama, monkeypatch, one_thread):
    """``KV.generate(..., query_aware=True)``: the question joins the context in the compressed part; the answer
    prefix (no chat template here) is the tail fed before the first answer token."""
    model = tiny_llama.model
    context, question, prefix = "x" * 300, "\nQuestion: what is it?", "\nAnswer:"
    feed = TailFeed(model, monkeypatch)
    try:
        with lb.attach(model, lb.method("streaming_llm", budget=0.25, sink=4), tiny_llama.tokenizer,
                       chat_template=False) as kv:
            ans = kv.generate(context, question=question, answer_prefix=prefix, max_new_tokens=2, query_aware=True)
    finally:
        feed.remove()
    n_prefix = len(tiny_llama.tokenizer(prefix, add_special_tokens=False).input_ids)
    assert feed.fed() == [n_prefix] and ans.tail_tokens == n_prefix
    compressed = ans.context_tokens + ans.question_tokens - n_prefix
    assert ans.kv_ratio_context == pytest.approx(-(-compressed // 4) / compressed, abs=1e-9)
