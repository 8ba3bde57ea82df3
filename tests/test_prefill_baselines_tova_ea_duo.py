"""TOVA, ExpectedAttention and DuoAttention (methods/tova.md, expected_attention.md, duo_attention.md): their
invariants on tiny random models and on random keys/queries replayed without a model."""
from __future__ import annotations

import math

import pytest
import torch

from luka_bench.methods.base import LayerInfo, MethodConfigError
from luka_bench.methods.cache import MethodCache, replay_forward
from luka_bench.methods.full import Full
from luka_bench.methods.tova import TOVA

from test_method_contract import ids_of, kept_positions, prefill
from test_methods_core import method_logits


def replay(method, k, v, q, n, steps, scaling=0.25, chunks=None):
    """One layer replayed without a model: prefill k/v/q[:n], end the prefill, then ``steps`` one-token forwards.
    Returns (the store, the held positions after the prefill and after each step, as sorted lists per KV head)."""
    info = LayerInfo(0, 1, q.shape[1], k.shape[1], k.shape[3])
    cache = MethodCache(method, [info], reference_length=n, manual=True)
    replay_forward(cache, 0, k[:, :, :n], v[:, :, :n], q[:, :, :n], scaling)
    cache.end_prefill()
    store = cache.stores[0]
    held = [[sorted(store.positions[0, h].tolist()) for h in range(k.shape[1])]]
    for t in range(n, n + steps):
        replay_forward(cache, 0, k[:, :, t: t + 1], v[:, :, t: t + 1], q[:, :, t: t + 1], scaling)
        held.append([sorted(store.positions[0, h].tolist()) for h in range(k.shape[1])])
    return store, held, cache


def kvq(hkv=2, g=3, n=40, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, hkv, n, d, generator=gen) for _ in range(2))
    return k, v, torch.randn(1, hkv * g, n, d, generator=gen)


# -- TOVA ----------------------------------------------------------------------------------------------------------

def tova_direct(k, q, n, steps, budget, scaling, protect_last=False, decode=True):
    """TOVA written out: after the prefill and after each step, while over capacity, keep the top-capacity positions
    by the last query's softmax weights averaged over all query heads (ties to the earlier position)."""
    kept = list(range(n))
    out = []
    for t in range(n - 1, n + steps):
        if t >= n:
            kept.append(t)
        cap = math.ceil(budget * max(t + 1, n) - 1e-9)
        if len(kept) > cap and (decode or t == n - 1):
            keys = k[0][:, kept]  # [Hkv, m, D]
            g = q.shape[1] // k.shape[1]
            logits = torch.einsum("hd,hmd->hm", q[0, :, t], keys.repeat_interleave(g, 0)) * scaling
            score = torch.softmax(logits.double(), -1).mean(0)  # [m]
            cand = list(range(len(kept) - (1 if protect_last else 0)))
            order = sorted(cand, key=lambda i: (-score[i].item(), kept[i]))[: cap - (1 if protect_last else 0)]
            if protect_last:
                order.append(len(kept) - 1)
            kept = sorted(kept[i] for i in order)
        out.append(list(kept))
    return out


@pytest.mark.parametrize("protect_last", [False, True])
@pytest.mark.parametrize("decode", [True, False])
def test_tova_keeps_the_last_querys_head_averaged_top_k_at_every_step(decode, protect_last):
    k, v, q = kvq(n=48, seed=1)
    n, steps, budget = 40, 8, 0.3
    _, held, _ = replay(TOVA(budget=budget, decode=decode, protect_last=protect_last), k, v, q, n, steps)
    want = tova_direct(k, q, n, steps, budget, 0.25, protect_last, decode)
    for step, (got, w) in enumerate(zip(held, want)):
        assert all(h == w for h in got), (step, got[0], w)  # one set, identical across KV heads


def test_tova_may_evict_the_newest_token_unless_protected():
    """A step whose own key gets almost no attention: the reference drops it, kvpress's setting keeps it."""
    k, v, q = kvq(n=30, seed=2)
    q[:, :, -1] = q[:, ::3, -1].repeat_interleave(3, 1)  # one query per group, and its own key turned away
    k[:, :, -1] = -10 * q[:, ::3, -1]
    _, held, _ = replay(TOVA(budget=0.5), k, v, q, 29, 1)
    assert 29 not in held[-1][0]
    _, held, _ = replay(TOVA(budget=0.5, protect_last=True), k, v, q, 29, 1)
    assert 29 in held[-1][0]


def test_tova_on_a_model_keeps_one_set_per_layer_and_budget_one_is_full(tiny_gqa3):
    model = tiny_gqa3.model
    ids = ids_of(70, 3)
    ref, _ = method_logits(model, Full(), ids, 50)
    got, c = method_logits(model, TOVA(budget=1.0), ids, 50)
    assert torch.equal(got, ref)
    assert all(s.n == 70 for s in c.stores)
    got, c = method_logits(model, TOVA(budget=0.25), ids, 50)
    assert not torch.allclose(got[:, 45:], ref[:, 45:], atol=1e-3)
    for layer in kept_positions(c):
        assert all(h == layer[0] for h in layer)  # identical across KV heads
    assert all(s.n == math.ceil(0.25 * 70) for s in c.stores)  # capacity follows the logical length


def test_tova_prefill_matches_the_models_last_query(tiny_llama):
    """On a model: the prefill keeps the top-capacity tokens of the last prompt query's head-averaged weights,
    recomputed here from the post-RoPE queries captured by the attention function (the policy's ``attend``)."""
    captured = {}

    from luka_bench.methods.tova import TOVAPolicy

    class Spy(TOVAPolicy):
        def attend(self, store, query, scaling):
            captured[self.info.layer_idx] = (query[:, :, -1].clone(), store.keys.clone(), scaling)
            return super().attend(store, query, scaling)

    class SpyTOVA(TOVA):
        policy_class = Spy

    cache, _ = prefill(tiny_llama.model, SpyTOVA(budget=0.2), ids_of(60, 5))
    cap = 12
    for layer, store in enumerate(cache.stores):
        ql, keys, scaling = captured[layer]
        g = ql.shape[1] // keys.shape[1]
        w = torch.softmax(torch.einsum("hd,hnd->hn", ql[0], keys[0].repeat_interleave(g, 0)) * scaling, -1).mean(0)
        want = sorted(torch.sort(w, descending=True, stable=True).indices[:cap].tolist())
        assert all(sorted(store.positions[0, h].tolist()) == want for h in range(keys.shape[1])), layer


def test_tova_settings_are_checked():
    with pytest.raises(MethodConfigError, match="decode='yes'"):
        TOVA(decode="yes")
    with pytest.raises(MethodConfigError, match="protect_last=1"):
        TOVA(protect_last=1)


# -- ExpectedAttention -----------------------------------------------------------------------------------------------

def llama_rope(positions, d, theta):
    """Llama's rotation angles written out: position p, pair i (entries i and i + d/2) turns by p * theta^(-2i/d)."""
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return positions.double()[:, None] * inv[None, :]  # [P, d/2]


def rotate(x, ang):
    """x [..., P, d] rotated pair-wise by ang [P, d/2] (entries i and i + d/2 form a pair)."""
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], dim=-1)


def expected_direct(q_pre, k, v, n_sink, future, theta, eps=0.0):
    """kvpress's ExpectedAttention written out in float64: pre-RoPE queries q_pre [Hq, N, d], cached (post-RoPE)
    keys k and values v [Hkv, N, d]. Scores [Hkv, N - n_sink] of the keys after the sinks."""
    hq, n, d = q_pre.shape
    g = hq // k.shape[0]
    qs = q_pre[:, n_sink:].double()
    mu = qs.mean(1)  # [Hq, d]
    cov = torch.einsum("hni,hnj->hij", qs - mu[:, None], qs - mu[:, None]) / qs.shape[1]
    ang = llama_rope(torch.arange(n, n + future), d, theta)  # the next `future` positions
    eye = torch.eye(d, dtype=torch.float64)
    r = rotate(eye.T[None].expand(future, d, d).transpose(1, 2), ang[:, None, :]).mean(0)  # mean_p R(p), columns
    r = r.T  # r[:, j] = mean_p R(p) e_j
    mu, cov = mu @ r.T, r @ cov @ r.T
    keys = k[:, n_sink:].double().repeat_interleave(g, 0)  # [Hq, m, d]
    logits = torch.einsum("hd,hmd->hm", mu, keys) / math.sqrt(d) + \
        torch.einsum("hmi,hij,hmj->hm", keys, cov, keys) / (2 * d)
    s = torch.softmax(logits, -1).view(k.shape[0], g, -1).mean(1)
    return (s + eps) * v[:, n_sink:].double().norm(dim=-1)


def test_averaged_rope_and_unrotation_are_the_inverse_of_llamas_rope():
    from luka_bench.methods.expected_attention import averaged_rope, unrotate

    d, theta = 8, 10000.0
    ang = llama_rope(torch.arange(5, 12), d, theta)
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    x = torch.randn(1, 2, 7, d)
    post = rotate(x.double(), ang).float()
    torch.testing.assert_close(unrotate(post, cos, sin), x, rtol=1e-5, atol=1e-5)
    r = averaged_rope(cos, sin, d)
    y = torch.randn(d)
    want = rotate(y.double()[None].expand(7, d), ang).mean(0)
    torch.testing.assert_close(r.double() @ y.double(), want, rtol=1e-5, atol=1e-5)


def test_expected_attention_scores_equal_the_formula_on_a_model(tiny_gqa3):
    """The policy's scores after a (chunked) prefill equal the formula recomputed from the pre-RoPE queries (captured at
    q_proj), the cached keys and values, and the kept set is its top-k per KV head after the sinks."""
    from luka_bench.methods.expected_attention import ExpectedAttention, ExpectedAttentionPolicy

    model = tiny_gqa3.model
    cfg = model.config
    hq, d = cfg.num_attention_heads, cfg.head_dim
    got, pre, before = {}, {}, {}

    class Spy(ExpectedAttentionPolicy):
        def score(self, store, start, stop, obs):
            before[self.info.layer_idx] = (store.keys[0].clone(), store.values[0].clone())
            got[self.info.layer_idx] = s = super().score(store, start, stop, obs)
            return s

    class SpyEA(ExpectedAttention):
        policy_class = Spy

    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda mod, inp, out, i=i: pre.setdefault(i, []).append(out[0].view(-1, hq, d).transpose(0, 1)))
        for i, layer in enumerate(model.model.layers)]
    ids = ids_of(80, 11)
    method = SpyEA(budget=0.3, n_future_positions=64)
    try:
        from luka_bench.methods.hf import attach

        with attach(model, method) as a, torch.no_grad():
            c = a.new_cache(reference_length=80, manual=True)
            model(ids[:, :50], past_key_values=c)  # two prefill chunks: the moments merge
            model(ids[:, 50:], past_key_values=c)
            c.end_prefill()
    finally:
        for h in hooks:
            h.remove()
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    cap = math.ceil(0.3 * 80)
    for layer, store in enumerate(c.stores):
        k, v = before[layer]
        want = expected_direct(torch.cat(pre[layer], 1), k, v, 4, 64, theta)
        torch.testing.assert_close(got[layer][0].double(), want, rtol=2e-4, atol=1e-7)
        for h in range(k.shape[0]):
            top = 4 + torch.sort(want[h], descending=True, stable=True).indices[: cap - 4]
            assert sorted(store.positions[0, h].tolist()) == list(range(4)) + sorted(top.tolist()), (layer, h)


def test_expected_attention_covariance_and_vnorm_switches_on_random_tensors():
    from luka_bench.methods.expected_attention import expected_scores

    gen = torch.Generator().manual_seed(4)
    mu, k, v = torch.randn(1, 6, 8, generator=gen), torch.randn(1, 2, 30, 8, generator=gen), \
        torch.randn(1, 2, 30, 8, generator=gen)
    a = torch.randn(1, 6, 8, 8, generator=gen)
    cov = a @ a.transpose(-1, -2) / 8
    full = expected_scores(mu, cov, k, v, True, 0.1)
    kk = k[0].repeat_interleave(3, 0).double()
    logits = torch.einsum("hd,hmd->hm", mu[0].double(), kk) / math.sqrt(8) + \
        torch.einsum("hmi,hij,hmj->hm", kk, cov[0].double(), kk) / 16
    want = (torch.softmax(logits, -1).view(2, 3, 30).mean(1) + 0.1) * v[0].double().norm(dim=-1)
    torch.testing.assert_close(full[0].double(), want, rtol=1e-5, atol=1e-7)
    plain = expected_scores(mu, None, k, v, False)
    want = torch.softmax(torch.einsum("hd,hmd->hm", mu[0].double(), kk) / math.sqrt(8), -1).view(2, 3, 30).mean(1)
    torch.testing.assert_close(plain[0].double(), want, rtol=1e-5, atol=1e-7)


def test_expected_attention_budget_one_is_full_and_sinks_are_kept(tiny_llama):
    from luka_bench.methods.expected_attention import ExpectedAttention

    ids = ids_of(60, 12)
    ref, _ = method_logits(tiny_llama.model, Full(), ids, 40)
    got, c = method_logits(tiny_llama.model, ExpectedAttention(budget=1.0), ids, 40)
    assert torch.equal(got, ref) and all(s.n == 60 for s in c.stores)
    got, c = method_logits(tiny_llama.model, ExpectedAttention(budget=0.25), ids, 40)
    assert not torch.allclose(got[:, 35:], ref[:, 35:], atol=1e-3)
    for layer in kept_positions(c):
        assert all(h[:4] == [0, 1, 2, 3] for h in layer)


def test_expected_attention_settings_are_checked():
    from luka_bench.methods.expected_attention import ExpectedAttention

    with pytest.raises(MethodConfigError, match="n_future_positions=0"):
        ExpectedAttention(n_future_positions=0)
    with pytest.raises(MethodConfigError, match="n_sink=-1"):
        ExpectedAttention(n_sink=-1)
    with pytest.raises(MethodConfigError, match="use_vnorm='no'"):
        ExpectedAttention(use_vnorm="no")


# -- DuoAttention ------------------------------------------------------------------------------------------------------

def write_pattern(folder, gates) -> str:
    """A pattern in the reference's format: ``full_attention_heads.tsv``, one row of tab-separated gates per layer."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "full_attention_heads.tsv").write_text(
        "\n".join("\t".join(f"{g:.6f}" for g in row) for row in gates) + "\n", encoding="utf-8")
    return str(folder)


def test_duo_with_no_streaming_head_is_full_attention(tiny_llama, tmp_path):
    from luka_bench.methods.duo_attention import DuoAttention

    path = write_pattern(tmp_path / "p", [[0.2, 0.9], [0.5, 0.1], [0.7, 0.3]])
    ids = ids_of(60, 13)
    ref, _ = method_logits(tiny_llama.model, Full(), ids, 40)
    got, c = method_logits(tiny_llama.model, DuoAttention(pattern_path=path, head_compression_ratio=0.0, sink=4,
                                                          recent=8), ids, 40)
    assert torch.equal(got, ref)
    assert all(s.n == 60 and s.head_mask() is None for s in c.stores)


def test_duo_with_only_streaming_heads_is_streaming_llm_bit_for_bit(tiny_llama, tmp_path):
    from luka_bench.methods.duo_attention import DuoAttention
    from luka_bench.methods.streaming_llm import StreamingLLM

    path = write_pattern(tmp_path / "p", [[0.2, 0.9], [0.5, 0.1], [0.7, 0.3]])
    ids = ids_of(60, 14)
    sink, recent, ref_len = 4, 8, 1200  # StreamingLLM's capacity ceil(budget * 1200) = sink + recent at every step
    want, cw = method_logits(tiny_llama.model, StreamingLLM(budget=(sink + recent) / ref_len, sink=sink), ids, 40,
                             reference_length=ref_len)
    got, cg = method_logits(tiny_llama.model, DuoAttention(pattern_path=path, head_compression_ratio=1.0, sink=sink,
                                                           recent=recent), ids, 40)
    assert torch.equal(got, want)
    assert kept_positions(cg) == kept_positions(cw)
    assert all(s.n == sink + recent for s in cg.stores)


def test_duo_mixed_layers_free_memory_per_head_and_attend_over_what_each_head_holds(tmp_path):
    """One layer, KV head 1 streaming, heads 0 and 2 retrieval, replayed without a model: the decode steps' outputs are
    full attention for the retrieval heads' query heads and attention over sinks + recent window for the streaming
    head's; the held counts, the bytes and the attended counts count each head's own tokens."""
    from luka_bench.methods.duo_attention import DuoAttention

    path = write_pattern(tmp_path / "p", [[0.9, 0.1, 0.8]])
    k, v, q = kvq(hkv=3, g=2, n=50, seed=15)
    n, steps, sink, recent, g = 44, 6, 3, 7, 2
    info = LayerInfo(0, 1, 6, 3, 8)
    cache = MethodCache(DuoAttention(pattern_path=path, head_compression_ratio=1 / 3, sink=sink, recent=recent),
                        [info], reference_length=n, manual=True)
    replay_forward(cache, 0, k[:, :, :n], v[:, :, :n], q[:, :, :n], 0.25)
    cache.end_prefill()
    store = cache.stores[0]
    per_head = store.token_bytes() // 3
    for t in range(n, n + steps):
        out = replay_forward(cache, 0, k[:, :, t: t + 1], v[:, :, t: t + 1], q[:, :, t: t + 1], 0.25)
        seen = t + 1
        held = store.head_mask()[0].sum(-1).tolist()
        assert held == [seen, sink + recent, seen]
        assert store.held_bytes() == (2 * seen + sink + recent) * per_head
        assert store.held_per_head() == pytest.approx((2 * seen + sink + recent) / 3)
        assert float(store.policy.attended_count(store)) == pytest.approx(store.held_per_head())
        mask = store.head_mask()[0, 1]
        assert store.positions[0, 1][mask].tolist() == list(range(sink)) + list(range(seen - recent, seen))
        kf, vf = k[:, :, :seen].repeat_interleave(g, 1), v[:, :, :seen].repeat_interleave(g, 1)
        full = torch.nn.functional.scaled_dot_product_attention(q[:, :, t: t + 1], kf, vf, scale=0.25)
        # the step attends before the window moves on (as StreamingLLM's steps): its sinks, the window it held, itself
        keep = torch.tensor(list(range(sink)) + list(range(seen - 1 - recent, seen)))
        stream = torch.nn.functional.scaled_dot_product_attention(q[:, :, t: t + 1], kf[:, :, keep], vf[:, :, keep],
                                                                  scale=0.25)
        torch.testing.assert_close(out[:, [0, 1, 4, 5]], full[:, [0, 1, 4, 5]], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[:, [2, 3]], stream[:, [2, 3]], rtol=1e-5, atol=1e-6)


def test_duo_binarises_the_lowest_gates_of_the_whole_model(tmp_path):
    from luka_bench.methods.duo_attention import DuoAttention, streaming_heads

    gates = torch.tensor([[0.2, 0.9], [0.5, 0.1], [0.7, 0.3]], dtype=torch.float64)
    assert streaming_heads(gates, 0.5).tolist() == [[True, False], [False, True], [False, True]]
    assert streaming_heads(gates, 0.0).sum() == 0 and streaming_heads(gates, 1.0).all()
    # clipped to [0, 1] as the reference: -3 and 0 tie at 0, the earlier (layer-major) goes first
    path = write_pattern(tmp_path / "p", [[-3.0, 2.0], [0.0, 0.5]])
    m = DuoAttention(pattern_path=path + "/full_attention_heads.tsv", head_compression_ratio=0.25)
    assert m.streaming_row(LayerInfo(0, 2, 4, 2, 8)) == [True, False]
    assert m.streaming_row(LayerInfo(1, 2, 4, 2, 8)) == [False, False]


def test_duo_needs_a_pattern_of_the_models_shape(tmp_path):
    from luka_bench.methods.duo_attention import DuoAttention

    with pytest.raises(MethodConfigError, match="neither is set"):
        DuoAttention()
    with pytest.raises(MethodConfigError, match="no such file"):
        DuoAttention(pattern_path=str(tmp_path / "nope"))
    with pytest.raises(MethodConfigError, match="budget=0.5"):
        DuoAttention(pattern_seed=0, budget=0.5)
    with pytest.raises(MethodConfigError, match="head_compression_ratio=1.5"):
        DuoAttention(pattern_seed=0, head_compression_ratio=1.5)
    m = DuoAttention(pattern_path=write_pattern(tmp_path / "p", [[0.1, 0.2]]))
    with pytest.raises(MethodConfigError, match="1 layers x 2 KV heads; the model has 3 x 2"):
        m.check_layer(LayerInfo(0, 3, 4, 2, 8))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "full_attention_heads.tsv").write_text("0.1\tx\n")
    with pytest.raises(MethodConfigError, match="not a tab-separated matrix"):
        DuoAttention(pattern_path=str(tmp_path / "bad"))
    # a synthetic pattern is drawn for whatever shape the model has, the same for the same seed
    a, b = DuoAttention(pattern_seed=3), DuoAttention(pattern_seed=3)
    info = LayerInfo(1, 4, 8, 4, 8)
    assert a.streaming_row(info) == b.streaming_row(info)
