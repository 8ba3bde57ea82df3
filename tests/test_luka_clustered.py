"""LuKA clustered attention (§3.2, Algorithm 1): invariants on tiny models (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from luka_bench.methods.base import LayerPolicy, MethodConfigError
from luka_bench.methods.full import Full
from luka_bench.methods.hf import attach, layer_infos
from luka_bench.methods.luka_clustered import MASS, LuKAClustered
from luka_bench.methods.cache import policy_attention

from conftest import compose, fixed_and_python_slots, tiny
from test_methods_core import method_logits

IDS = torch.randint(0, 256, (1, 140), generator=torch.Generator().manual_seed(21))


def luka(**kw):
    kw.setdefault("page_size", 8)
    kw.setdefault("tail", 16)
    kw.setdefault("compress_every", 4)
    return LuKAClustered(**kw)


def run(model, method, ids=IDS, split=100, question=10):
    return method_logits(model, method, ids, split, question=question)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3", "tiny_gqa3"])
@pytest.mark.parametrize("kw", [
    dict(refine={"rule": "top_frac", "fraction": 1.0}),
    dict(refine={"rule": "top_frac", "fraction": 1.0}, compressor="mean", sink=4),
    dict(refine={"rule": "top_frac", "fraction": 1.0}, compressor="random", summary_bias="log_size"),
    dict(refine={"rule": "threshold", "threshold": 0.0}),
    dict(refine={"rule": "top_k", "k": 1000}),
    dict(refine={"rule": "top_frac", "fraction": 1.0}, levels=2, page_size=4),
    dict(refine={"rule": "top_frac", "fraction": 1.0}, levels=3, page_size=3, tail=10),
], ids=["top_frac1", "mean_sink", "random_bias", "threshold0", "topk_all", "two_levels", "three_levels"])
def test_refining_every_page_equals_full(arch, kw, request):
    lm = request.getfixturevalue(arch)
    ref, _ = run(lm.model, Full())
    got, cache = run(lm.model, luka(**kw))
    pol = cache.stores[0].policy
    assert pol.P[1] > 5  # pages really exist
    if kw.get("levels", 1) > 1:
        assert pol.P[2] > 0
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()


def manual_cover_attention(q, store, pol, scaling):
    """Slow reference for refine.rule=none: softmax over [summary keys of every page] + [raw tail], per query
    head, for a single query."""
    k_raw, v_raw = store.keys[0], store.values[0]  # [Hkv, n, D]
    P = pol.P[1]
    hq = q.shape[1]
    g = hq // k_raw.shape[0]
    out = torch.zeros(hq, v_raw.shape[-1])
    for h in range(hq):
        kv = h // g
        keys = [pol.sk[1][0, kv, p] for p in range(P)] + [k_raw[kv, j] for j in range(pol.frontier, store.n)]
        vals = [pol.sv[1][0, kv, p] for p in range(P)] + [v_raw[kv, j] for j in range(pol.frontier, store.n)]
        logits = torch.stack([q[0, h, 0] @ k for k in keys]) * scaling
        w = torch.softmax(logits.double(), 0).float()
        out[h] = sum(wi * vi for wi, vi in zip(w, vals))
    return out


def test_no_refinement_equals_summaries_plus_tail(tiny_llama):
    model = tiny_llama.model
    method = luka(refine={"rule": "none"}, compressor="mean")
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=100, manual=True)
        model(IDS[:, :100], past_key_values=c)
        c.end_prefill()
        store = c.stores[0]
        pol = store.policy
        assert pol.P[1] == (100 - 16) // 8
        # one attention call of layer 0 with a random query, through the policy
        q = torch.randn(1, 4, 1, 16)
        store.append(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
        out = policy_attention(store, q, 0.25)[0, :, 0]
        ref = manual_cover_attention(q, store, pol, 0.25)
    assert torch.allclose(out, ref, atol=1e-5)
    # mean compressor: a summary is the mean of its page
    assert torch.allclose(pol.sk[1][0, :, 0], store.keys[0, :, :8].mean(1), atol=1e-6)


@pytest.mark.parametrize("mass", ["exact", "parent"])
@pytest.mark.parametrize("rule", [{"rule": "top_k", "k": 2}, {"rule": "threshold", "threshold": 0.02},
                                  {"rule": "top_frac", "fraction": 0.3}, {"rule": "none"}])
def test_masses_sum_to_one(rule, mass, tiny_qwen3):
    rule = dict(rule, mass=mass)
    _, cache = run(tiny_qwen3.model, luka(refine=rule, levels=2, page_size=4))
    for s in cache.stores:
        tot = s.policy.last_masses
        assert torch.allclose(tot, torch.ones_like(tot), atol=1e-5)


def test_parent_mass_is_mass_preserving(tiny_llama):
    """Eq. 3: with mass=parent a refined page keeps the mass its summary had; with exact it gets its exact one.
    Checked on one layer: the output with parent mass equals sum over pages alpha_c * (local softmax of the
    children) for the refined page and alpha_c * v_c for the others."""
    model = tiny_llama.model
    method = luka(refine={"rule": "top_k", "k": 1, "mass": "parent"}, compressor="mean")
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=100, manual=True)
        model(IDS[:, :100], past_key_values=c)
        c.end_prefill()
        store = c.stores[1]
        pol = store.policy
        q = torch.randn(1, 4, 1, 16)
        store.append(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
        out = policy_attention(store, q, 0.3)[0, :, 0]
    # slow reference
    P, S, fr = pol.P[1], 8, pol.frontier
    k, v = store.keys[0], store.values[0]
    for kv in range(2):
        heads = [2 * kv, 2 * kv + 1]
        keys = torch.cat([pol.sk[1][0, kv, :P], k[kv, fr:]])
        vals = torch.cat([pol.sv[1][0, kv, :P], v[kv, fr:]])
        alphas = [torch.softmax((keys @ q[0, h, 0]) * 0.3, 0) for h in heads]
        page = int(torch.stack([a[:P] for a in alphas]).sum(0).argmax())  # per KV head: summed over the group
        for h, alpha in zip(heads, alphas):
            child = torch.softmax((k[kv, page * S:(page + 1) * S] @ q[0, h, 0]) * 0.3, 0)
            o = (alpha[:, None] * vals).sum(0) - alpha[page] * vals[page] + alpha[page] * (child[:, None] *
                                                                                             v[kv, page * S:(page + 1) * S]).sum(0)
            assert torch.allclose(out[h], o, atol=1e-5)


def test_attention_weighted_with_large_tau_equals_mean(tiny_llama):
    a, ca = run(tiny_llama.model, luka(compressor="attention_weighted", tau=1e9, refine={"rule": "top_k", "k": 2}))
    b, cb = run(tiny_llama.model, luka(compressor="mean", refine={"rule": "top_k", "k": 2}))
    assert torch.allclose(a, b, atol=1e-4)
    assert torch.allclose(ca.stores[0].policy.sk[1][:, :, :ca.stores[0].policy.P[1]],
                          cb.stores[0].policy.sk[1][:, :, :cb.stores[0].policy.P[1]], atol=1e-5)


def test_attention_weighted_uses_accumulated_mass(tiny_llama):
    """pi = softmax(w / tau) with w = accumulated attention mass: check the first page's summary."""
    model = tiny_llama.model
    with attach(model, luka(compressor="attention_weighted", tau=0.5)) as a, torch.no_grad():
        c = a.new_cache(reference_length=100, manual=True)
        model(IDS[:, :100], past_key_values=c)
        store = c.stores[2]
        w = store.aux(MASS)[0, :, :8].clone()
        keys = store.keys[0, :, :8].clone()
        c.end_prefill()
    pi = torch.softmax(w / 0.5, -1)
    assert torch.allclose(store.policy.sk[2 - 2 + 1][0, :, 0], (pi[..., None] * keys).sum(1), atol=1e-5)
    # the accumulated mass of the prefill is the column sums of the causal attention: total = number of queries
    assert store.aux(MASS)[0].sum(-1).allclose(torch.full((2,), 100.0 * 2), rtol=1e-4)


def test_zero_value_summaries_contribute_nothing(tiny_llama):
    model = tiny_llama.model
    method = luka(compressor="zero_value", refine={"rule": "none"})
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=100, manual=True)
        model(IDS[:, :100], past_key_values=c)
        c.end_prefill()
        store = c.stores[0]
        pol = store.policy
        assert torch.count_nonzero(pol.sv[1][:, :, :pol.P[1]]) == 0
        q = torch.randn(1, 4, 1, 16)
        store.append(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
        out = policy_attention(store, q, 0.25)[0, :, 0]
    # = tail values weighted by their cover masses only (summary masses multiply zero vectors)
    k, v = store.keys[0], store.values[0]
    for h in range(4):
        kv = h // 2
        keys = torch.cat([pol.sk[1][0, kv, :pol.P[1]], k[kv, pol.frontier:]])
        alpha = torch.softmax(keys @ q[0, h, 0] * 0.25, 0)[pol.P[1]:]
        assert torch.allclose(out[h], (alpha[:, None] * v[kv, pol.frontier:]).sum(0), atol=1e-5)


def test_tail_never_summarised_pages_from_oldest(tiny_llama):
    model = tiny_llama.model
    method = luka(tail=20, compress_every=5, page_size=8)
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=50, manual=True)
        model(IDS[:, :50], past_key_values=c)
        c.end_prefill()
        pol = c.stores[0].policy
        history = [(pol.P[1], c.stores[0].n)]
        for t in range(50, 90):
            model(IDS[:, t: t + 1], past_key_values=c)
            history.append((pol.P[1], c.stores[0].n))
    for pages, n in history:
        assert n - pol.method.sink - pages * 8 >= 20  # the tail stays raw
    assert history[0][0] == (50 - 20) // 8  # pages start at token 0 and grow contiguously
    # compression runs only every 5 decode steps
    changes = [i for i in range(1, len(history)) if history[i][0] != history[i - 1][0]]
    assert changes and all(i % 5 == 0 for i in changes)


def test_no_leak_between_examples(tiny_llama):
    model = tiny_llama.model
    method = luka(refine={"rule": "top_k", "k": 2})
    other = torch.randint(0, 256, (1, 140), generator=torch.Generator().manual_seed(99))
    run(model, method, other)
    after, _ = run(model, method)
    alone, _ = run(model, luka(refine={"rule": "top_k", "k": 2}))
    assert torch.equal(after, alone)


def test_memory_counts_raw_and_summaries(tiny_llama):
    _, c = run(tiny_llama.model, luka())
    pol = c.stores[0].policy
    assert c.held_bytes() > c.full_bytes()  # every raw token kept + the summaries: measured, not assumed
    per_entry = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, fp32
    assert pol.extra_bytes() == (pol.P[1] + pol.cover.n) * per_entry  # summaries + the fast path's cover copy


def test_latency_components_recorded(tiny_llama):
    _, c = run(tiny_llama.model, luka())
    assert {"attention", "refinement", "segment_compress"} <= set(c.timings)


def test_settings_checked():
    for kw, word in [(dict(compressor="median"), "compressor"), (dict(refine={"rule": "top_p"}), "refine.rule"),
                     (dict(page_size=1), "page_size"), (dict(levels=4), "levels"), (dict(budget=0.5), "budget"),
                     (dict(refine={"mass": "other"}), "refine.mass")]:
        with pytest.raises(MethodConfigError, match=word):
            LuKAClustered(**kw)


def test_luka_mixed_assignment_scales_with_depth():
    cfg = compose("method=luka_mixed")
    method = instantiate(cfg.method)
    for layers, lined in [(36, 8), (30, 7), (4, 1)]:
        lm = tiny("llama", num_hidden_layers=layers, hidden_size=32, intermediate_size=32)
        names = method.assignment(layer_infos(lm.model))
        assert names == ["h2o"] * lined + ["luka_clustered"] * (layers - 2 * lined) + ["h2o"] * lined


@pytest.mark.parametrize("kw", [
    dict(refine={"rule": "top_k", "k": 2}),
    dict(refine={"rule": "top_k", "k": 2, "mass": "parent"}, sink=4),
    dict(refine={"rule": "threshold", "threshold": 0.03}, summary_bias="log_size"),
    dict(refine={"rule": "top_frac", "fraction": 0.4}, compressor="mean"),
    dict(refine={"rule": "none"}, compressor="zero_value"),
], ids=["topk", "parent_sink", "threshold_bias", "topfrac_mean", "none_zero"])
@pytest.mark.parametrize("kernels", ["cpu", "portable"])
def test_decode_fast_path_equals_general_path(kw, kernels, tiny_qwen3, monkeypatch):
    """The per-token fast path computes exactly what the general top-down path computes (logits and the
    accumulated importance that later summaries are built from) — with the CPU's variant of the refined pages'
    gather and with the portable one (``LUKA_BENCH_NO_KERNEL=1``: what CUDA runs)."""
    from luka_bench.methods import cpu_kernel
    if kernels == "portable":
        monkeypatch.setenv(cpu_kernel.DISABLE_ENV, "1")
    model = tiny_qwen3.model
    fast, cf = run(model, luka(**kw))
    general_method = luka(**kw)
    # same run with the fast path switched off in every layer
    from luka_bench.methods import luka_clustered as LC

    orig = LC.LuKAPolicy.__init__

    def no_fast(self, *a, **k):
        orig(self, *a, **k)
        self.use_fast_path = False

    LC.LuKAPolicy.__init__ = no_fast
    try:
        slow, cs = run(model, general_method)
    finally:
        LC.LuKAPolicy.__init__ = orig
    assert not cs.stores[0].policy.use_fast_path and cf.stores[0].policy.cover.k is not None
    assert torch.allclose(fast, slow, atol=1e-5), (fast - slow).abs().max()
    # importance is read only for raw tokens not yet in a page (sinks are never summarised, paged tokens never
    # again): there the fast path must accumulate exactly what the general path does
    for a, b in zip(cf.stores, cs.stores):
        assert a.policy.frontier == b.policy.frontier and a.policy.frontier > a.policy.method.sink
        fr = a.policy.frontier
        assert torch.allclose(a.aux(MASS)[..., fr:], b.aux(MASS)[..., fr:], atol=1e-4) \
            if a.policy._needs_mass() else True


@pytest.mark.parametrize("kw", [
    dict(refine={"rule": "top_k", "k": 2}),
    dict(refine={"rule": "top_k", "k": 2}, sink=4),
    dict(refine={"rule": "threshold", "threshold": 0.03}),
    dict(refine={"rule": "none"}),
], ids=["topk", "topk_sink", "threshold", "none"])
def test_decode_attended_count_equals_the_mask(kw, tiny_qwen3):
    """The decode path's closed-form count of tokens read (sinks + tail + the chosen pages' tokens), which the
    harness records after every step, equals the count of the ``attended`` mask over the store."""
    model = tiny_qwen3.model
    seen = []

    def observe(store, query, out, scaling):
        pol = store.policy
        if query.shape[2] == 1 and pol.P[1] > 0:
            seen.append((pol.attended_count(store), LayerPolicy.attended_count(pol, store), pol._att_count))

    with attach(model, luka(**kw)) as a, torch.no_grad():
        c = a.new_cache(reference_length=90, manual=True)
        model(IDS[:, :90], past_key_values=c)
        c.end_prefill()
        c.observer = observe
        for t in range(90, IDS.shape[1]):
            model(IDS[:, t: t + 1], past_key_values=c)
    assert len(seen) == (IDS.shape[1] - 90) * len(c.stores)
    for fast, mask, closed in seen:
        assert fast == pytest.approx(mask)
    # the closed form is what is used where it applies (every rule but the threshold's padded top-K)
    assert all(x[2] is not None for x in seen) == (kw["refine"]["rule"] != "threshold")


@pytest.mark.parametrize("kw", [dict(refine={"rule": "top_k", "k": 2}),
                                dict(refine={"rule": "threshold", "threshold": 0.03}, sink=4)], ids=["topk", "sink"])
@pytest.mark.parametrize("kernels", ["cpu", "portable"])
def test_the_fixed_shape_decode_step_equals_the_step_over_the_held_tokens(kw, kernels, tiny_gqa3, monkeypatch):
    """The graph-ready decode step (the new token written into the store and the cover at slots held on the device,
    attention over the cover's fixed-width tail region with its free slots masked, the refined pages gathered
    straight into the cover's scratch) gives the logits and accumulated importance of the step written at Python
    slots, at every step, through compressions (the cover updated in place, then outgrown), a storage
    reallocation and a clone."""
    from luka_bench.methods import cpu_kernel
    from luka_bench.methods.luka_clustered import LuKAPolicy
    from luka_bench.methods.luka_cover import Cover

    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(6))
    env = {cpu_kernel.DISABLE_ENV: "1"} if kernels == "portable" else {}
    (fixed, grew), (plain, _) = fixed_and_python_slots(
        monkeypatch, tiny_gqa3.model, lambda: luka(**kw), [LuKAPolicy], ids, 40, 120,
        lambda c: ([s.aux(MASS).clone() for s in c.stores], c.stores[0].policy.cover.k.shape[2]), env,
        patches=[(Cover, "ROOM", 4)])  # the cover outgrown within the run
    widths = {w for _, (_, w) in fixed}
    assert grew and len(widths) > 1  # the storage grew and the cover was outgrown on the way
    for (lf, (mf, _)), (lp, (mp, _)) in zip(fixed, plain):
        torch.testing.assert_close(lf, lp, rtol=1e-5, atol=1e-6)
        for a_, b_ in zip(mf, mp):
            torch.testing.assert_close(a_, b_, rtol=1e-5, atol=1e-6)
