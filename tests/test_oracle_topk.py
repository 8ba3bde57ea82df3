"""oracle_topk: the read set is the true top-k of the group-summed attention weights (crafted GQA 3:1 case and a
slow per-head reference), sinks/recent are always read, attention is exact over the read set, a budget covering
everything equals full token for token through the runner, and ``attended`` reports exactly what was read."""
from __future__ import annotations

import pytest
import torch

from conftest import fixed_and_python_slots, tiny
from luka_bench.methods.base import MethodConfigError
from luka_bench.methods.policies import StaticExactPolicy
from luka_bench.methods.full import Full
from luka_bench.methods.hf import attach
from luka_bench.methods.oracle_topk import OracleTopK, oracle_topk_attention
from luka_bench.engine import greedy_answer, prefill


def slow_reference(q, K, V, scaling, k, sink=0, recent=0):
    """Per KV head, in plain loops: true weights of every query head of the group, summed; top-k (forced tokens
    first); attention of each query head over exactly those tokens."""
    b, hq, _, d = q.shape
    hkv, n = K.shape[1], K.shape[2]
    g = hq // hkv
    out = torch.empty(b, hq, 1, V.shape[-1])
    read = torch.zeros(b, hkv, n, dtype=torch.bool)
    for h in range(hkv):
        score = sum(torch.softmax(q[0, h * g + i, 0] @ K[0, h].T * scaling, -1) for i in range(g))
        forced = [j for j in range(n) if j < sink or j >= n - recent]
        rest = [j for j in sorted(range(n), key=lambda j: -float(score[j])) if j not in forced]
        chosen = forced + rest[: k - len(forced)]
        read[0, h, chosen] = True
        idx = torch.tensor(sorted(chosen))
        for i in range(g):
            w = torch.softmax(q[0, h * g + i, 0] @ K[0, h, idx].T * scaling, -1)
            out[0, h * g + i, 0] = w @ V[0, h, idx]
    return out, read


def test_crafted_gqa_3_to_1_reads_the_group_summed_top_k():
    """3 query heads share a KV head. Head 0 looks hard at token 2, head 1 at token 6, head 2 spreads its weight
    evenly; the true top-2 of the summed weights is {2, 6}. A mean of the logits (or head 2 alone) ranks token 9
    first: it is the runner-up key of both sharp heads and the strongest for head 2."""
    d, n = 12, 10
    K = torch.zeros(1, 1, n, d)
    K[0, 0, 2, 0] = 1.0
    K[0, 0, 6, 1] = 1.0
    K[0, 0, 9, :3] = torch.tensor([0.7, 0.7, 0.3])
    q = torch.zeros(1, 3, 1, d)
    q[0, 0, 0, 0] = 20.0
    q[0, 1, 0, 1] = 20.0
    q[0, 2, 0, 2] = 1.0
    V = torch.randn(1, 1, n, d)
    logit_mean = (q[0, :, 0] @ K[0, 0].T).mean(0)
    assert int(logit_mean.argmax()) == 9  # the crafted trap: a logit mean would read token 9 first
    out, read = oracle_topk_attention(q, K, V, 1.0, 2)
    assert read[0, 0].nonzero().flatten().tolist() == [2, 6]
    ref, ref_read = slow_reference(q, K, V, 1.0, 2)
    assert torch.equal(read, ref_read)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("k,sink,recent", [(1, 0, 0), (7, 0, 0), (7, 2, 3), (12, 4, 4), (40, 0, 0)])
def test_random_matches_slow_reference(k, sink, recent):
    torch.manual_seed(k + sink)
    b, hkv, g, n, d = 1, 2, 3, 40, 16
    q, K, V = torch.randn(b, hkv * g, 1, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    out, read = oracle_topk_attention(q, K, V, d ** -0.5, k, sink, recent)
    ref, ref_read = slow_reference(q, K, V, d ** -0.5, k, sink, recent)
    assert torch.equal(read, ref_read)
    assert (read.sum(-1) == min(k, n)).all()
    assert read[..., :sink].all() and read[..., n - recent:].all()
    assert torch.allclose(out, ref, atol=1e-5)
    if k >= n:  # everything read: exact attention
        exact = torch.nn.functional.scaled_dot_product_attention(q, K, V, scale=d ** -0.5, enable_gqa=True)
        assert torch.allclose(out, exact, atol=1e-5)


def answer(lm, method, ctx, question, steps=12):
    with attach(lm.model, method, lm.tokenizer) as att:
        c = att.new_cache()
        prefill(lm.model, ctx, c)
        gen = greedy_answer(lm.model, lm.tokenizer, c, question, steps, set(), stop_strings=())
    return gen, c


@pytest.fixture(scope="module")
def tiny_gqa3():
    return tiny("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96)


def test_budget_covering_everything_equals_full_through_the_runner(tiny_gqa3):
    lm = tiny_gqa3
    ids = list(torch.randint(0, 256, (160,), generator=torch.Generator().manual_seed(0)).tolist())
    ctx, q = ids[:150], ids[150:]
    ref, _ = answer(lm, Full(), ctx, q)
    got, c = answer(lm, OracleTopK(token_budget=200), ctx, q)
    assert got.token_ids == ref.token_ids
    assert got.attended["attended_ratio"] == 1.0
    # a binding budget reads exactly token_budget tokens per layer and KV head, and changes the answer's path
    small, c = answer(lm, OracleTopK(token_budget=8, sink=1, recent=2, full_layers=1), ctx, q)
    assert type(c.stores[0].policy) is StaticExactPolicy  # every method's full_layers: exact, graph-ready
    for s in c.stores[1:]:
        m = s.policy.attended(s)
        assert (m.sum(-1) == 8).all() and m[..., :1].all() and m[..., -2:].all()
        assert s.policy.attended_count(s) == float(m.sum()) / (m.shape[0] * m.shape[1])
    # per generated-token forward i (i = 0..10): layer 0 reads all 161 + i held tokens, every other layer 8
    L = len(c.stores)
    want = sum(161 + i + 8 * (L - 1) for i in range(11)) / 11 / L
    assert small.attended["attended_tokens"] == pytest.approx(want)
    assert small.token_ids != ref.token_ids


def test_question_and_prefill_are_exact(tiny_gqa3):
    lm = tiny_gqa3
    ids = list(torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist())
    with attach(lm.model, Full()) as a:
        c = a.new_cache()
        ref = prefill(lm.model, ids, c)
    with attach(lm.model, OracleTopK(token_budget=4)) as a:
        c = a.new_cache()
        got = prefill(lm.model, ids, c)
    assert torch.equal(got, ref)
    assert all(s.policy.attended(s) is None for s in c.stores)


@pytest.mark.parametrize("bad", [dict(budget=0.5), dict(token_budget=0), dict(sink=-1), dict(recent=1.5),
                                 dict(sink=3, recent=3, token_budget=5), dict(full_layers=True)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(MethodConfigError):
        OracleTopK(**bad)


def test_the_fixed_shape_decode_step_reads_and_outputs_what_the_held_tokens_give(tiny_gqa3, monkeypatch):
    """The graph-ready decode step (the store's whole capacity with its free slots masked; the new token written at
    a slot held on the device) reads the same tokens and gives the same logits as the step over the held tokens
    alone, at every step, through a storage reallocation and in a clone."""
    from luka_bench.methods.oracle_topk import OracleTopKPolicy

    ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(5))
    (fixed, grew), (plain, _) = fixed_and_python_slots(
        monkeypatch, tiny_gqa3.model, lambda: OracleTopK(token_budget=24), [OracleTopKPolicy], ids, 40, 100,
        lambda c: [s.policy.top.sort(-1).values for s in c.stores])
    assert grew  # the storage grew on the way
    for (lf, tf), (lp, tp) in zip(fixed, plain):
        torch.testing.assert_close(lf, lp, rtol=1e-5, atol=1e-6)
        for a_, b_ in zip(tf, tp):
            assert torch.equal(a_, b_)
