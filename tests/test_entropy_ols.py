"""entropy_ols (HAE): the fit's invariants, the attention over position-less biased entries, FAIR/REAL accounting."""
from __future__ import annotations

import math

import pytest
import torch

from luka_bench.methods.base import MethodConfigError
from luka_bench.methods.attention import attention_with_extra, attention_with_mass
from luka_bench.methods.entropy_ols import EntropyOLS
from luka_bench.methods.entropy_ols_fit import bin_attention, fit_bias, fit_linear_map, fit_ols_entries, fit_values
from luka_bench.methods.kmeans import euclidean_kmeans
from luka_bench.methods.hf import attach


G = torch.Generator().manual_seed(0)


def rnd(*shape):
    return torch.randn(*shape, generator=G, dtype=torch.float64).float()


class Held:  # what attention_with_extra reads from a store
    def __init__(self, k, v):
        self.keys, self.values = k, v


def test_rank_equal_bin_size_with_bin_keys_reproduces_the_bin_exactly():
    """Keys = the bin's keys (k-means with one cluster per member), biases fitted (must come out 0), values by the
    least-squares fit without ridge: the synthetic entries' attention equals the bin's on *held-out* queries."""
    m, d, mq = 8, 16, 48
    kb, vb, bb = rnd(3, m, d), rnd(3, m, d), torch.zeros(3, m)
    q_fit, q_new = rnd(3, mq, d), rnd(3, 20, d)
    s = d ** -0.5
    keys, onehot = euclidean_kmeans(kb, m, 5)
    assert torch.equal(keys, kb)
    logits, lz, out = bin_attention(q_fit, kb, vb, bb, s)
    bias = fit_bias(logits, onehot, q_fit, keys, s)
    assert bias.abs().max() < 1e-5
    p = torch.softmax(q_fit @ keys.transpose(-1, -2) * s + bias.unsqueeze(-2), dim=-1)
    values = fit_values(p, out, torch.ones(3, mq), ridge=0.0)
    assert torch.allclose(values, vb, atol=1e-3), (values - vb).abs().max()
    _, lz_new, ref = bin_attention(q_new, kb, vb, bb, s)
    _, lz_hat, got = bin_attention(q_new, keys, values, bias, s)
    assert torch.allclose(got, ref, atol=1e-3) and torch.allclose(lz_hat, lz_new, atol=1e-5)
    # and the shortcut used when rank >= bin size is the bin itself
    k2, v2, b2, _ = fit_ols_entries(q_fit, kb, vb, bb, lz, s, m, 5, 1e-3)
    assert torch.equal(k2, kb) and torch.equal(v2, vb) and torch.equal(b2, bb)


def test_bias_fit_matches_the_cluster_mass_in_the_log_domain():
    """b_j is the least-squares solution of log Z_j(q) ~ q.k_j s + b_j: residuals have zero mean per cluster, and
    a cluster of identical keys gets b = log(size) exactly."""
    d, s = 8, 8 ** -0.5
    k0 = rnd(1, d)
    kb = torch.cat([k0.expand(3, d), rnd(2, d)])  # cluster {0,1,2} of identical keys
    onehot = torch.tensor([[1., 0, 0], [1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]])
    keys = (onehot.T @ kb) / onehot.sum(0)[:, None]
    q = rnd(30, d)
    logits = q @ kb.T * s
    bias = fit_bias(logits, onehot, q, keys, s)
    assert abs(float(bias[0]) - math.log(3)) < 1e-5
    lzj = torch.stack([torch.logsumexp(logits[:, onehot[:, j] > 0], -1) for j in range(3)], -1)
    resid = lzj - q @ keys.T * s - bias
    assert resid.mean(0).abs().max() < 1e-5


def test_value_fit_equals_lstsq():
    p, t, w = torch.rand(2, 40, 5, generator=G), rnd(2, 40, 7), torch.rand(2, 40, generator=G)
    ridge = 0.01
    got = fit_values(p, t, w, ridge)
    pw, tw = (p * w[..., None]).double(), (t * w[..., None]).double()
    lam = ridge * (pw.transpose(-1, -2) @ pw).diagonal(dim1=-2, dim2=-1).sum(-1) / 5
    a = torch.cat([pw, lam.sqrt()[:, None, None] * torch.eye(5, dtype=torch.float64).expand(2, 5, 5)], 1)
    b = torch.cat([tw, torch.zeros(2, 5, 7, dtype=torch.float64)], 1)
    ref = torch.linalg.lstsq(a, b).solution
    assert torch.allclose(got.double(), ref, atol=1e-4), (got - ref).abs().max()
    # without ridge: plain weighted least squares
    ref0 = torch.linalg.lstsq(pw, tw).solution
    assert torch.allclose(fit_values(p, t, w, 0.0).double(), ref0, atol=1e-3)


def test_linear_map_is_the_pinv_solution_and_svd_truncation_error_is_the_dropped_singular_values():
    q, d, dv = rnd(40, 16), 16, 12
    target = rnd(40, dv)
    full_a, full_b, sv = fit_linear_map(q, target, d)
    w = full_a @ full_b
    ref = torch.linalg.lstsq(q.double(), target.double()).solution
    assert torch.allclose(w.double(), ref, atol=1e-4)
    for k in (1, 3, 6):
        a, b, s = fit_linear_map(q, target, k)
        err = float(((w - a @ b) ** 2).sum())
        assert abs(err - float((s[k:] ** 2).sum())) < 1e-4 * max(1.0, err)


def test_attention_with_extra_entries():
    """No extras: attention_with_mass's output and mass. Extras: one explicit softmax over [held | extra] with the
    per-entry bias, extras visible to every query; entropy = -sum p log p / log(entries seen)."""
    b, hq, hkv, n, d, S = 1, 4, 2, 10, 8, 3
    k, v, q = rnd(b, hkv, n, d), rnd(b, hkv, n, d), rnd(b, hq, 4, d)
    s = d ** -0.5
    out, mass, _, _, _ = attention_with_extra(Held(k, v), q, s)
    o2, m2 = attention_with_mass(Held(k, v), q, s)
    assert torch.allclose(out, o2, atol=1e-6) and torch.allclose(mass, m2, atol=1e-6)
    ek, ev, eb = rnd(b, hkv, S, d), rnd(b, hkv, S, d), rnd(b, hkv, S)
    out, mass, emass, ent, _ = attention_with_extra(Held(k, v), q, s, ek, ev, eb)
    kk = torch.cat([k, ek], 2).repeat_interleave(2, 1)
    vv = torch.cat([v, ev], 2).repeat_interleave(2, 1)
    logits = q @ kk.transpose(-1, -2) * s + torch.cat([torch.zeros(b, hkv, n), eb], -1).repeat_interleave(2, 1)[:, :, None]
    causal = torch.ones(4, n + S, dtype=torch.bool)
    causal[:, n - 4: n] = torch.ones(4, 4, dtype=torch.bool).tril()
    w = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
    assert torch.allclose(out, w @ vv, atol=1e-5)
    wk = w.view(b, hkv, 2, 4, n + S).sum((2, 3))
    assert torch.allclose(mass, wk[..., :n], atol=1e-5) and torch.allclose(emass, wk[..., n:], atol=1e-5)
    h = -(w * w.clamp_min(1e-30).log()).sum(-1) / causal.sum(-1).float().log()
    assert torch.allclose(ent, h.view(b, hkv, 2, 4).mean(2), atol=1e-5)


def run_decode(model, method, ids, ctx, check=None):
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=ctx, manual=True)
        model(ids[:, :ctx], past_key_values=c)
        c.end_prefill()
        for t in range(ctx, ids.shape[1]):
            model(ids[:, t: t + 1], past_key_values=c)
            if check:
                check(c)
    return c


@pytest.mark.parametrize("mode", ["ols", "linear", "drop"])
def test_budget_fair_real_accounting_every_step(mode, tiny_llama):
    """At every decode step: held tokens + synthetic entries <= capacity (FAIR); REAL bytes = store keys/values +
    synthetic keys/values/biases (+ linear factors) + their mass/entropy + the reference-query buffer, counted by
    hand; the report's
    numbers are those; the post's FAIR budget is capacity - (bin_size - rank)."""
    model = tiny_llama.model
    m = EntropyOLS(budget=0.3, mode=mode, bin_size=8, rank=2, n_ref=4)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    cfg = model.config
    hkv, hq, d = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    seen_flush = []

    def check(c):
        for s in c.stores:
            p = s.policy
            cap = m.capacity(s.seen, s.reference_length)
            assert s.n + p.extra_entries() <= cap
            S = p.S
            per = {"ols": 1, "linear": 1 + m.rank, "drop": 0}[mode]
            assert p.extra_entries() == S * per
            syn = S * hkv * (2 * d * 4 + 4) + (S * hkv * m.rank * 2 * d * 4 if mode == "linear" else 0)
            assert p.synthetic_bytes() == syn
            assert p.stats_bytes() == S * hkv * 2 * 4  # accumulated mass and inherited entropy, fp32
            assert p.extra_bytes() == syn + p.stats_bytes() + hq * m.n_ref * d * 4
            seen_flush.append(p.stats["flushes"])
        rep = c.method_report()
        assert rep["fair_entries"] == sum(s.n + s.policy.extra_entries() for s in c.stores) / len(c.stores)
        assert rep["real_bytes"] == c.held_bytes() == sum(s.held_bytes() + s.policy.extra_bytes() for s in c.stores)
        cap = m.capacity(c.stores[0].seen, c.stores[0].reference_length)
        assert rep["post_fair_budget"] == cap - (m.bin_size - m.rank)

    c = run_decode(model, m, ids, 40, check)
    assert max(seen_flush) > 0
    # attention reads every held token and every synthetic entry: the share of held entries read is exactly 1
    # (it was 1.78 on RULER when the synthetic entries were counted as read but not as held)
    assert c.attended_stats()["attended_ratio"] == pytest.approx(1.0)
    if mode == "ols":
        assert all(s.policy.S > 0 for s in c.stores)
    if mode == "drop":
        assert all(s.policy.S == 0 for s in c.stores)


def test_flush_frees_the_bin_and_attention_reads_only_what_is_held(tiny_llama):
    """After a flush the bin's tokens are gone from the store (positions absent, n smaller by the bin) and the
    next step's attention equals an explicit softmax over exactly [store | synthetic entries + biases]."""
    model = tiny_llama.model
    m = EntropyOLS(budget=0.5, mode="ols", bin_size=8, rank=2, n_ref=4, sink=2)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with attach(model, m) as a, torch.no_grad():
        c = a.new_cache(reference_length=20, manual=True)
        model(ids[:, :20], past_key_values=c)
        s0 = c.stores[0]
        n0, pos0 = s0.n, s0.positions.clone()
        c.end_prefill()
        p = s0.policy
        freed = n0 - s0.n
        assert freed == p.stats["binned_tokens"] and freed % m.bin_size == 0 and freed > 0
        assert p.S == freed // m.bin_size * m.rank
        assert s0.positions.shape[-1] == n0 - freed
        gone = [set(pos0[0, h].tolist()) - set(s0.positions[0, h].tolist()) for h in range(pos0.shape[1])]
        assert all(len(g) == freed for g in gone)
        # one more step: capture the layer-0 query and compare with an explicit softmax over what is held
        got = {}
        orig = p.attend

        def spy(store, query, scaling):
            got["q"], got["k"], got["v"] = query.clone(), store.keys.clone(), store.values.clone()
            got["sk"], got["sv"], got["sb"] = p.sk.clone(), p.sv.clone(), p.sb.clone()
            got["out"] = orig(store, query, scaling)
            return got["out"]

        p.attend = spy
        model(ids[:, 20:21], past_key_values=c)
    g = got["q"].shape[1] // got["k"].shape[1]
    kk = torch.cat([got["k"], got["sk"]], 2).repeat_interleave(g, 1)
    vv = torch.cat([got["v"], got["sv"]], 2).repeat_interleave(g, 1)
    bias = torch.cat([torch.zeros(got["k"].shape[:3]), got["sb"]], -1).repeat_interleave(g, 1)[:, :, None]
    d = got["q"].shape[-1]
    ref = torch.softmax(got["q"] @ kk.transpose(-1, -2) * d ** -0.5 + bias, -1) @ vv
    assert torch.allclose(got["out"], ref, atol=1e-5)


def test_ols_is_closer_to_full_than_dropping_the_bin(tiny_llama):
    """Same selection, same budget: the fitted synthetic entries keep the next-token logits closer to full
    attention than evicting the bin (entropy-drop)."""
    from luka_bench.methods.full import Full
    from test_methods_core import method_logits

    model = tiny_llama.model
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(5))
    ref, _ = method_logits(model, Full(), ids, 60)
    err = {}
    for mode in ("ols", "drop"):
        got, _ = method_logits(model, EntropyOLS(budget=0.3, mode=mode, bin_size=8, rank=2, n_ref=4), ids, 60)
        err[mode] = float((got[0, 60:] - ref[0, 60:]).abs().mean())
    assert err["ols"] < err["drop"], err


@pytest.mark.parametrize("kw", [dict(mode="lstsq"), dict(rank=32, bin_size=32), dict(rank=31, bin_size=32, mode="linear"),
                                dict(bin_size=1), dict(n_ref=0), dict(recent_fraction=1.5),
                                dict(synthetic_fraction=0.0), dict(ridge=-1.0), dict(budget=0.0)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(MethodConfigError) as e:
        EntropyOLS(**kw)
    assert "\n" not in str(e.value)


def test_no_state_leaks_between_prompts(tiny_llama):
    model = tiny_llama.model
    m = EntropyOLS(budget=0.3, bin_size=8, rank=2, n_ref=4)
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(6))
    a = run_decode(model, m, ids, 30)
    b = run_decode(model, m, ids, 30)
    for s, t in zip(a.stores, b.stores):
        assert torch.equal(s.keys, t.keys) and torch.equal(s.policy.sk, t.policy.sk)
        assert s.policy.stats == t.policy.stats


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)])
def test_prefill_entropy_from_the_blocked_pass_equals_the_explicit_softmax(hq, hkv, monkeypatch):
    """A CPU prefill with no extra entries takes the blocked single pass (entropy from P @ K: H_i = m_i + log l_i
    - s q_i . sum_j p_ij k_j): the same output, masses and normalised entropies as the explicit softmax."""
    from luka_bench.methods import attention

    torch.manual_seed(hq)
    n, d = 300, 16
    k, v, q = torch.randn(1, hkv, n, d) * 2, torch.randn(1, hkv, n, d), torch.randn(1, hq, n, d) * 2
    calls = []
    real = attention._blocked_attention
    monkeypatch.setattr(attention, "_blocked_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fast = attention_with_extra(Held(k, v), q, 0.25)
    assert len(calls) == 1  # the blocked path ran
    monkeypatch.setattr(attention, "BLOCKED_MIN_QUERIES", 10 ** 9)
    slow = attention_with_extra(Held(k, v), q, 0.25)
    assert len(calls) == 1
    for a, b_ in zip(fast, slow):
        assert a.shape == b_.shape
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=2e-5)


def test_bin_takes_high_entropy_low_mass_tokens_first(tiny_gqa3, monkeypatch):
    """Which raw tokens go to the recycle bin, against a plain reference over the entropies and masses the layer
    held when it flushed (their values are tested against the explicit softmax below): candidates (neither sinks
    nor the recent window) ranked by percentile rank of the *high* entropy + percentile rank of the *low*
    accumulated mass, the top ``bins x bin_size`` binned (ties: the earlier token)."""
    from luka_bench.methods.entropy_ols import ENT, MASS, EntropyOLSPolicy

    seen = {}
    real = EntropyOLSPolicy._flush_raw

    def spy(self, store, deficit, cap):
        lo, hi = self._candidates(store, cap)
        before = (store.aux(ENT)[0].clone(), store.aux(MASS)[0].clone(), store.positions[0].clone(), lo, hi)
        ok = real(self, store, deficit, cap)
        seen.setdefault(self.info.layer_idx, (*before, store.positions[0].clone()))
        return ok

    monkeypatch.setattr(EntropyOLSPolicy, "_flush_raw", spy)
    model = tiny_gqa3.model
    m = EntropyOLS(budget=0.8, mode="ols", bin_size=8, rank=2, n_ref=4, sink=2)
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(9))
    with attach(model, m) as a, torch.no_grad():
        c = a.new_cache(reference_length=60, manual=True)
        model(ids, past_key_values=c)
        c.end_prefill()
    assert len(seen) == model.config.num_hidden_layers
    for layer, (ent, mass, pos, lo, hi, after) in seen.items():
        for h in range(ent.shape[0]):
            cand = list(range(lo, hi))
            e, w = ent[h].tolist(), mass[h].tolist()
            by_ent = sorted(cand, key=lambda j: (e[j], j))  # ascending entropy: rank 0 = lowest
            by_low_mass = sorted(cand, key=lambda j: (-w[j], j))  # rank 0 = highest mass
            prio = {j: by_ent.index(j) + by_low_mass.index(j) for j in cand}
            n_bin = pos.shape[-1] - after.shape[-1]
            binned = sorted(sorted(cand, key=lambda j: (-prio[j], j))[:n_bin])
            assert n_bin > 0 and len(cand) > n_bin
            gone = sorted(set(pos[h].tolist()) - set(after[h].tolist()))
            assert gone == [int(pos[h, j]) for j in binned], (layer, h)


def test_value_fit_weights_each_reference_query_by_the_bins_share_of_its_attention():
    """Replacing a bin by synthetic entries of the same partition mass changes the *whole* attention output of a
    query q by share_q * (bin output estimate - bin output), share_q = Z_bin(q) / Z_all(q). So the values must
    minimise sum_q share_q^2 ||p_q V - t_q||^2 (ridge 0: the weighted least-squares solution), not the unweighted
    error, which over-fits queries that barely look at the bin."""
    d, m, mq, r = 8, 12, 40, 3
    kb, vb, bb = rnd(m, d), rnd(m, d), torch.zeros(m)
    q = rnd(mq, d) * 2
    s = d ** -0.5
    _, lz_bin, target = bin_attention(q, kb, vb, bb, s)
    rest = torch.linspace(-4.0, 6.0, mq)  # log-mass of everything else held: the bin's share spans 0.002 .. 1
    lz_all = torch.logaddexp(lz_bin, lz_bin + rest)
    keys, values, bias, _ = fit_ols_entries(q, kb, vb, bb, lz_all, s, r, 8, 0.0)
    p = torch.softmax(q @ keys.T * s + bias, -1).double()
    share = torch.exp(lz_bin - lz_all).double()
    t = target.double()
    weighted = torch.linalg.lstsq(p * share[:, None], t * share[:, None]).solution
    plain = torch.linalg.lstsq(p, t).solution
    cost = lambda v: float((((p @ v - t) * share[:, None]) ** 2).sum())  # noqa: E731
    assert torch.allclose(values.double(), weighted, atol=2e-3), (values.double() - weighted).abs().max()
    assert cost(plain) > 1.05 * cost(weighted)  # the two solutions really differ here: the test can fail


@pytest.mark.parametrize("mode", ["ols", "drop"])
def test_decode_fast_path_equals_the_general_path(mode, tiny_gqa3, monkeypatch):
    """A decode step's attention in the fewest kernels (``_decode_attend``: logits of the held tokens and the
    synthetic entries in one buffer, the entropy and the masses by batched dot products) gives the general path's
    logits, accumulated masses, synthetic masses, entropies and flushes at every step, through several flushes."""
    from luka_bench.methods.entropy_ols import ENT, MASS, EntropyOLSPolicy

    model = tiny_gqa3.model
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(21))

    def run(fast):
        if not fast:
            monkeypatch.setattr(EntropyOLSPolicy, "_fast_path", lambda self, store, query: False)
        steps = []
        with attach(model, EntropyOLS(budget=0.3, mode=mode, bin_size=8, rank=2, n_ref=4)) as a, torch.no_grad():
            c = a.new_cache()
            model(ids[:, :60], past_key_values=c)
            for t in range(60, 100):
                logits = model(ids[:, t: t + 1], past_key_values=c).logits[0, -1]
                steps.append((logits, [(s.positions.clone(), s.aux(MASS).clone(), s.aux(ENT).clone(),
                                        None if s.policy.smass is None else s.policy.smass.clone(),
                                        s.policy.stats["flushes"]) for s in c.stores]))
        monkeypatch.undo()
        return steps

    fast, slow = run(True), run(False)
    assert fast[-1][1][0][4] > 2  # several flushes on the way
    for (lf, sf), (ls, ss) in zip(fast, slow):
        torch.testing.assert_close(lf, ls, rtol=1e-4, atol=1e-5)
        for a_, b_ in zip(sf, ss):
            assert torch.equal(a_[0], b_[0]) and a_[4] == b_[4]  # the same tokens held, the same flushes
            for x, y in zip(a_[1:4], b_[1:4]):
                if x is None or y is None:
                    assert x is None and y is None
                else:
                    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
