"""clusterkv: the clusters partition the non-sink prompt; every decode step and sparse layer equals a slow per-query-head
loop reference (clusters ranked by q . centroid, taken until they hold token_budget - sink tokens, cut to exactly
that, + sinks + generated tokens); exactly token_budget - sink prompt tokens per query head; a prompt within the
budget is full attention; one cluster per token is the top-k by logit; dense first layers; the fixed-shape step
equals the step at Python slots; one-line errors for bad settings."""
from __future__ import annotations

import pytest
import torch

from conftest import fixed_and_python_slots, tiny
from luka_bench.methods.base import MethodConfigError
from luka_bench.methods.clusterkv import ClusterKV, ClusterKVPolicy, cluster_keys, ranked_prefix
from luka_bench.methods.full import Full
from luka_bench.methods.hf import attach
from luka_bench.methods.policies import StaticExactPolicy


def decode(model, method, ids, prefill, observer=None, question=0):
    """Teacher-forced decode after a ``prefill``-token prefill (and a ``question``-token chunk): (logits per step,
    the cache)."""
    steps = []
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache()
        model(ids[:, :prefill], past_key_values=c)
        if question:
            model(ids[:, prefill: prefill + question], past_key_values=c)
        c.observer = observer
        for t in range(prefill + question, ids.shape[1]):
            steps.append(model(ids[:, t: t + 1], past_key_values=c).logits[0, -1])
    return steps, c


def ids_of(n, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def slow_reference(q, K, V, scaling, pol):
    """One decode query q [1, Hq, 1, D] over K/V [1, Hkv, n, D] in plain loops per query head, from the prompt's
    clusters (``assign``, from its keys) and the policy's centroids: rank the clusters by q . centroid, walk them
    listing members in position order until token_budget - sink are taken, + sinks + every token from the prompt's
    end on; softmax over those.
    Returns (out [1, Hq, 1, D], read mask per KV head = union [1, Hkv, n], chosen prompt tokens per query head)."""
    m, P = pol.method, pol.prompt
    s, w = m.sink, m.token_budget - m.sink
    _, hq, _, d = q.shape
    hkv, n = K.shape[1], K.shape[2]
    g = hq // hkv
    # the clusters of each token: the policy keeps only the member list (as storage rows); the k-means is
    # deterministic, so the same keys give the same clusters
    assign = cluster_keys(K[:, :, s:P], m.clusters, m.iterations)["assign"][0]  # [Hkv, M]
    cent = pol.index["centroids"].transpose(1, 2)  # [Hkv, C, D]
    out = torch.empty(1, hq, 1, V.shape[-1])
    read = torch.zeros(1, hkv, n, dtype=torch.bool)
    chosen = []
    for h in range(hq):
        kv = h // g
        score = [float(q[0, h, 0].double() @ cent[kv, c].double()) for c in range(cent.shape[1])]
        taken = []
        for c in sorted(range(len(score)), key=lambda c: (-score[c], c)):
            taken += [s + t for t in range(assign.shape[1]) if int(assign[kv, t]) == c]
            if len(taken) >= w:
                break
        taken = taken[:w]
        chosen.append(sorted(taken))
        idx = sorted(list(range(s)) + taken + list(range(P, n)))
        read[0, kv, idx] = True
        wts = torch.softmax((q[0, h, 0].double() @ K[0, kv, idx].double().T) * scaling, -1)
        out[0, h, 0] = (wts @ V[0, kv, idx].double()).float()
    return out, read, chosen


def test_the_clusters_partition_the_non_sink_prompt():
    torch.manual_seed(0)
    keys = torch.randn(2, 3, 57, 16)
    ix = cluster_keys(keys, 8, 5)
    r, c = 6, 8
    assert ix["centroids"].shape == (r, 16, c) and ix["size"].shape == (r, 1, c)
    assign = ix["assign"].view(r, 57)
    for row in range(r):  # every token in exactly one cluster; members list them by cluster, then by position
        assert int(ix["size"][row].sum()) == 57
        assert sorted(ix["members"][row].tolist()) == list(range(57))
        for cl in range(c):
            lo, k = int(ix["first"][row, 0, cl]), int(ix["size"][row, 0, cl])
            mem = ix["members"][row, lo: lo + k].tolist()
            assert mem == sorted(mem) and all(int(assign[row, t]) == cl for t in mem)
            assert k == int((assign[row] == cl).sum())
            if k:  # the ranking vector: the mean of the members' keys
                torch.testing.assert_close(ix["centroids"][row, :, cl], keys.view(r, 57, 16)[row, mem].mean(0))
    assert cluster_keys(keys[:, :, :5], 8, 5)["size"].shape[-1] == 5  # a short prompt: min(clusters, tokens)


def test_ranked_prefix_takes_whole_clusters_in_order_cut_to_w():
    # 1 row, 1 query head, clusters of sizes 3, 0, 2, 4 with members listed by cluster
    size = torch.tensor([[[3, 0, 2, 4]]])
    first = size.cumsum(-1) - size
    members = torch.tensor([[[10, 11, 12, 20, 21, 30, 31, 32, 33]]])
    score = torch.tensor([[[0.5, 9.0, 2.0, 1.0]]])  # order: 1 (empty), 2, 3, 0
    for w, want in [(1, [20]), (2, [20, 21]), (5, [20, 21, 30, 31, 32]), (9, [20, 21, 30, 31, 32, 33, 10, 11, 12])]:
        p = torch.arange(w).expand(1, 1, w).contiguous()
        assert ranked_prefix(score, size, first, members, p).view(-1).tolist() == want


@pytest.mark.parametrize("clusters,question", [(6, 0), (16, 7), (400, 0)])
def test_every_step_and_layer_equals_the_slow_reference(tiny_gqa3, clusters, question):
    """GQA 3:1, clusters ranked per query head: output and read set (union per KV head) of every sparse layer at
    every decode step equal the loop reference; exactly token_budget - sink prompt tokens per query head; the
    runner's attended count is the union's count. clusters 400 > the prompt: one cluster per token."""
    checked = []
    method = ClusterKV(token_budget=40, sink=4, clusters=clusters, iterations=4, full_layers=1)

    def observer(store, query, out, scaling):
        pol = store.policy
        if isinstance(pol, ClusterKVPolicy):
            ref, read, chosen = slow_reference(query, store.keys, store.values, scaling, pol)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
            assert torch.equal(pol.attended(store), read)
            count = pol.attended_count(store)
            count = float(count.total) * count.scale + count.offset
            assert count == pytest.approx(float(read.sum()) / read.shape[1])
            cap = store.storage()[0].shape[2]
            sel = (pol.sel - (torch.arange(pol.sel.shape[0]) * cap).view(-1, 1, 1)).view(-1, pol.sel.shape[-1])
            for h, want in enumerate(chosen):  # exactly w distinct prompt tokens per query head, the reference's
                assert sorted(sel[h].tolist()) == want and len(want) == 36
            checked.append(1)

    _, c = decode(tiny_gqa3.model, method, ids_of(130, clusters), 90 - question, observer, question)
    assert len(checked) == 2 * 40  # 2 sparse layers x 40 steps, every one sparse
    P = 90
    assert all(s.policy.prompt == P and s.policy.clusters == min(clusters, P - 4) for s in c.stores[1:])
    assert all(s.policy.layout_events == 1 for s in c.stores[1:])  # clustered once


def test_one_cluster_per_token_is_the_top_k_by_logit():
    """clusters >= the non-sink prompt: each token its own cluster, its centroid its key, so each query head reads the
    token_budget - sink prompt tokens of largest logit (+ sinks + generated): a direct computation, step by step."""
    lm = tiny("llama", num_attention_heads=4, num_key_value_heads=2)
    method = ClusterKV(token_budget=24, sink=3, clusters=10_000, iterations=2, full_layers=0)
    n_checked = []

    def observer(store, query, out, scaling):
        pol = store.policy
        P, n, K, V = pol.prompt, store.n, store.keys, store.values
        g = query.shape[1] // K.shape[1]
        want = torch.empty_like(out)
        for h in range(query.shape[1]):
            kv = h // g
            logit = query[0, h, 0] @ K[0, kv, 3:P].T
            idx = sorted(list(range(3)) + (3 + logit.topk(21).indices).tolist() + list(range(P, n)))
            wts = torch.softmax((query[0, h, 0] @ K[0, kv, idx].T) * scaling, -1)
            want[0, h, 0] = wts @ V[0, kv, idx]
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
        n_checked.append(1)

    decode(lm.model, method, ids_of(120, 3), 80, observer)
    assert len(n_checked) == 3 * 40


def test_a_prompt_within_the_budget_is_full_attention(tiny_gqa3):
    ids = ids_of(150, 1)
    ref, _ = decode(tiny_gqa3.model, Full(), ids, 100)
    for budget in (100, 140):  # the prompt (100 tokens) <= token_budget: full for every later step
        got, c = decode(tiny_gqa3.model, ClusterKV(token_budget=budget, sink=4, clusters=8, full_layers=0), ids, 100)
        for a, b in zip(ref, got):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert all(s.policy.index is None and s.policy.attended(s) is None for s in c.stores)
    got, c = decode(tiny_gqa3.model, ClusterKV(token_budget=99, sink=4, clusters=8, full_layers=0), ids, 100)
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(ref, got))  # one under: sparse
    assert c.attended_stats()["attended_ratio"] < 1.0


def test_dense_first_layers_are_untouched(tiny_qwen3):
    outs = {}

    def observer(store, query, out, scaling):
        outs.setdefault(store.policy.info.layer_idx, []).append(out)

    decode(tiny_qwen3.model, Full(), ids_of(130, 3), 100, observer)
    full_outs, outs = outs, {}
    _, c = decode(tiny_qwen3.model, ClusterKV(token_budget=32, sink=4, clusters=8), ids_of(130, 3), 100, observer)
    assert [type(s.policy) for s in c.stores] == [StaticExactPolicy, StaticExactPolicy, ClusterKVPolicy]
    for layer in (0, 1):
        for a, b in zip(full_outs[layer], outs[layer]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert c.stores[2].policy.sel is not None
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(full_outs[2], outs[2]))


def test_fixed_shape_step_equals_the_step_at_python_slots(tiny_gqa3, monkeypatch):
    (fixed, grew), (plain, _) = fixed_and_python_slots(
        monkeypatch, tiny_gqa3.model, lambda: ClusterKV(token_budget=32, sink=4, clusters=8, full_layers=1),
        [ClusterKVPolicy, StaticExactPolicy], ids_of(160, 5), 40, 100,
        lambda c: [s.policy.sel.clone() for s in c.stores if isinstance(s.policy, ClusterKVPolicy)])
    assert grew
    for (lf, tf), (lp, tp) in zip(fixed, plain):
        torch.testing.assert_close(lf, lp, rtol=1e-5, atol=1e-6)
        assert len(tf) == len(tp)
        for a_, b_ in zip(tf, tp):  # the same storage rows read
            assert torch.equal(a_, b_)


def test_index_is_counted_and_fresh_per_prompt(tiny_llama):
    method = ClusterKV(token_budget=32, sink=4, clusters=8, full_layers=1)
    _, c = decode(tiny_llama.model, method, ids_of(130), 100)
    assert c.held_bytes() - c.full_bytes() == sum(s.policy.extra_bytes() for s in c.stores) > 0
    _, c2 = decode(tiny_llama.model, method, ids_of(90, 1), 60)  # a new prompt: clustered again, on its own prompt
    assert all(s.policy.prompt == 60 and s.policy.layout_events == 1 for s in c2.stores[1:])


def test_the_prefill_and_the_question_are_exact(tiny_gqa3):
    ids = ids_of(150, 1)
    with attach(tiny_gqa3.model, Full()) as a, torch.no_grad():
        ref = tiny_gqa3.model(ids, past_key_values=a.new_cache()).logits
    with attach(tiny_gqa3.model, ClusterKV(token_budget=16, sink=2, clusters=4, full_layers=0)) as a, torch.no_grad():
        c = a.new_cache()
        got = tiny_gqa3.model(ids[:, :100], past_key_values=c).logits
        got2 = tiny_gqa3.model(ids[:, 100:], past_key_values=c).logits
    torch.testing.assert_close(torch.cat([got, got2], 1), ref, atol=1e-5, rtol=1e-5)
    assert all(s.policy.attended(s) is None and s.policy.prompt is None for s in c.stores)


@pytest.mark.parametrize("bad,says", [
    (dict(token_budget=0), "method.token_budget=0 must be an integer >= 1"),
    (dict(clusters=0), "method.clusters=0 must be an integer >= 1"),
    (dict(iterations=-1), "method.iterations=-1 must be an integer >= 0"),
    (dict(sink=2.5), "method.sink=2.5"),
    (dict(sink=16, token_budget=16), "sink < token_budget"),
    (dict(budget=0.5), "allowed: 1.0"),
    (dict(clusters=True), "method.clusters=True"),
])
def test_bad_settings_are_one_line_errors(bad, says):
    with pytest.raises(MethodConfigError) as e:
        ClusterKV(**bad)
    assert says in str(e.value) and "\n" not in str(e.value)
