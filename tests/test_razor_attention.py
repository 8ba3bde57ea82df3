"""razor_attention: echo and induction scores equal a direct computation from eager attention weights; the retrieval
heads are the top shares (ceil) of both; a non-retrieval head attends over sinks + window + the compensation token
weighted |D| (eq. 4-5, against a slow formula) and identical dropped tokens are compensated exactly; nothing dropped
is full attention; retrieval heads' outputs are full attention's; memory really freed; the scores are cached on
disk and a heads_file replaces them; one-line errors for bad settings."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import attn_impl, tiny
from luka_bench.methods.base import LayerInfo, MethodConfigError
from luka_bench.methods.cache import MethodCache
from luka_bench.methods.full import Full
from luka_bench.methods.hf import attach
from luka_bench.methods import razor_attention as RA
from luka_bench.methods.razor_attention import RazorAttention, RazorPolicy, echo_induction, measure_scores, top_heads


def ids_of(n, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def maker(cache):
    """make_cache for ``measure_scores``: a cache of the same class and layers as ``cache``, for another method."""
    return lambda m: type(cache)(m, [s.policy.info for s in cache.stores], cache.model)


def decode(model, method, ids, prefill, observer=None):
    steps = []
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache()
        model(ids[:, :prefill], past_key_values=c)
        c.observer = observer
        for t in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, t: t + 1], past_key_values=c).logits[0, -1])
    return steps, c


# ------------------------------------------------------------------------------------------------ head scores

def test_scores_equal_a_direct_computation_from_eager_weights(tiny_gqa3):
    model = tiny_gqa3.model
    length, repeats, seed = 24, 3, 5
    with attach(model, Full()) as a:
        got = measure_scores(model, maker(a.new_cache()), length, repeats, seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = RA.repeated_random_tokens(vocab, length, repeats, seed)
    assert torch.equal(ids[0, :length], ids[0, length: 2 * length])
    with attn_impl(model, "eager"):
        att = model(ids, output_attentions=True, use_cache=False).attentions  # per layer [1, Hq, T, T]
    t = ids.shape[1]
    for layer, w in enumerate(att):
        hq = w.shape[1]
        echo, ind = torch.zeros(hq, dtype=torch.float64), torch.zeros(hq, dtype=torch.float64)
        for h in range(hq):  # plain loops: earlier occurrences of the query's token, and the token after each
            for i in range(length, t):
                echo[h] += sum(float(w[0, h, i, j]) for j in range(i) if int(ids[0, j]) == int(ids[0, i]) and
                               (i - j) % length == 0)
                ind[h] += sum(float(w[0, h, i, j]) for j in range(i) if (i - j) % length == length - 1)
        echo, ind = echo / (t - length), ind / (t - length)
        g = hq // 2
        torch.testing.assert_close(torch.tensor(got["echo"][layer], dtype=torch.float64),
                                   echo.view(2, g).amax(1), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(got["induction"][layer], dtype=torch.float64),
                                   ind.view(2, g).amax(1), atol=1e-5, rtol=1e-4)


def test_echo_and_induction_masks_on_a_perfect_pattern():
    """A head that puts all its weight on the previous copy (echo) / on the token after it (induction) scores 1."""
    L, R = 5, 3
    T = L * R
    echo_w, ind_w = torch.zeros(1, T, T), torch.zeros(1, T, T)
    for i in range(L, T):
        echo_w[0, i, i - L] = 1.0
        ind_w[0, i, i - L + 1] = 1.0
    e, i_ = echo_induction(torch.cat([echo_w, ind_w]), L)
    torch.testing.assert_close(e, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(i_, torch.tensor([0.0, 1.0]))


def test_top_heads_are_the_ceil_share_of_every_scored_head():
    scores = [[0.1, 0.9], None, [0.5, 0.3]]  # a layer unscored (sliding window)
    assert top_heads(scores, 0.0) == set()
    assert top_heads(scores, 0.01) == {(0, 1)}  # ceil: at least one
    assert top_heads(scores, 0.5) == {(0, 1), (2, 0)}
    assert top_heads(scores, 1.0) == {(0, 0), (0, 1), (2, 0), (2, 1)}


# ------------------------------------------------------------------------------------------------ compression

def one_layer(method, hkv=2, g=2, d=8):
    info = LayerInfo(layer_idx=0, num_layers=1, num_heads=hkv * g, num_kv_heads=hkv, head_dim=d)
    return MethodCache(method, [info], manual=True)


def slow_step(q, K0, V0, n_prompt, sink, window, retrieval, scaling):
    """One decode query over the ORIGINAL keys/values [1, Hkv, n, D] (prompt + generated), in loops: a retrieval
    head attends to everything; another to sinks + the last ``window`` prompt tokens + the generated tokens + the
    mean of its dropped keys/values with weight |D| (eq. 5)."""
    _, hq, _, d = q.shape
    hkv, n = K0.shape[1], K0.shape[2]
    g = hq // hkv
    out = torch.empty(1, hq, 1, V0.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kv = h // g
        if retrieval[kv]:
            keep, drop = list(range(n)), []
        else:
            drop = list(range(sink, n_prompt - window))
            keep = [j for j in range(n) if j not in drop]
        ks, vs = K0[0, kv, keep].double(), V0[0, kv, keep].double()
        logit = (ks @ q[0, h, 0].double()) * scaling
        if drop:
            kh, vh = K0[0, kv, drop].double().mean(0), V0[0, kv, drop].double().mean(0)
            ks = torch.cat([ks, kh[None]])
            vs = torch.cat([vs, vh[None]])
            logit = torch.cat([logit, ((kh @ q[0, h, 0].double()) * scaling + math.log(len(drop)))[None]])
        out[0, h, 0] = torch.softmax(logit, -1) @ vs
    return out.float()


@pytest.mark.parametrize("retrieval", [[False, True], [False, False], [True, True]])
def test_a_decode_step_equals_the_compensated_formula(retrieval):
    torch.manual_seed(len(retrieval) + sum(retrieval))
    sink, local, n = 3, 10, 40
    method = RazorAttention(sink=sink, local=local, compression_ratio=0, heads_file=None, heads_cache=None)
    cache = one_layer(method)
    store = cache.stores[0]
    K0, V0 = torch.randn(1, 2, n + 3, 8), torch.randn(1, 2, n + 3, 8)
    store.update(K0[:, :, :n], V0[:, :, :n])
    store.policy.compress(store, retrieval)
    cache.end_prefill = lambda: None
    cache.phase = "decode"
    for t in range(n, n + 3):  # three decode steps: generated tokens appended to every head and kept
        store.update(K0[:, :, t: t + 1], V0[:, :, t: t + 1])
        q = torch.randn(1, 4, 1, 8)
        got = store.policy.attend(store, q, 0.35)
        want = slow_step(q, K0[:, :, : t + 1], V0[:, :, : t + 1], n, sink, local, retrieval, 0.35)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # memory: a non-retrieval head holds sinks + compensation + window + generated; a retrieval head everything
    per_head = [n + 3 if r else sink + 1 + local + 3 for r in retrieval]
    assert store.held_per_head() == pytest.approx(sum(per_head) / 2)
    if not any(retrieval):
        assert store.n == sink + 1 + local + 3  # evicted for real
    if all(retrieval):
        assert store.policy.dropped == 0


def test_identical_dropped_tokens_are_compensated_exactly():
    """|D| copies of one key/value attended one by one = the compensation token weighted |D|: full attention."""
    sink, local, n, d = 2, 6, 30, 8
    K = torch.randn(1, 2, n, d)
    V = torch.randn(1, 2, n, d)
    K[:, :, sink: n - local] = K[:, :, sink: sink + 1]
    V[:, :, sink: n - local] = V[:, :, sink: sink + 1]
    q = torch.randn(1, 4, 1, d)
    full = torch.softmax(torch.einsum("bhd,bhnd->bhn", q[:, :, 0], K.repeat_interleave(2, 1)) * 0.3, -1)
    want = torch.einsum("bhn,bhnd->bhd", full, V.repeat_interleave(2, 1))[:, :, None]
    cache = one_layer(RazorAttention(sink=sink, local=local, compression_ratio=0, heads_cache=None))
    store = cache.stores[0]
    store.update(K, V)
    store.policy.compress(store, [False, False])
    assert store.n == sink + 1 + local and store.policy.dropped == n - local - sink
    cache.phase = "decode"
    torch.testing.assert_close(store.policy.attend(store, q, 0.3), want, atol=1e-5, rtol=1e-5)


def test_the_window_is_max_of_local_and_n_over_c():
    for c, n, want in [(0, 100, 10), (5.0, 100, 20), (5.0, 40, 10), (4.0, 101, 26)]:
        cache = one_layer(RazorAttention(sink=2, local=10, compression_ratio=c, heads_cache=None))
        store = cache.stores[0]
        store.update(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8))
        store.policy.compress(store, [False, False])
        assert store.n == 2 + 1 + want and store.policy.dropped == n - want - 2


# ------------------------------------------------------------------------------------------------ on a model

def test_nothing_dropped_is_full_attention(tiny_gqa3, tmp_path):
    ids = ids_of(140, 1)
    ref, _ = decode(tiny_gqa3.model, Full(), ids, 100)
    for method in (RazorAttention(local=100, heads_cache=str(tmp_path), score_length=16),  # local >= the prompt
                   RazorAttention(local=0, compression_ratio=1.0, heads_cache=str(tmp_path), score_length=16),
                   RazorAttention(local=4, induction=1.0, heads_cache=str(tmp_path), score_length=16)):  # all heads
        got, c = decode(tiny_gqa3.model, method, ids, 100)
        for a, b in zip(ref, got):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert c.held_bytes() == c.full_bytes()


def test_retrieval_heads_output_is_full_attention_and_others_are_compressed(tiny_gqa3, tmp_path):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"retrieval_heads": [[0, 1], [2, 0]]}))  # the cache's own format
    method = RazorAttention(sink=2, local=16, compression_ratio=0, heads_file=str(heads), heads_cache=None)
    seen = []

    def observer(store, query, out, scaling):
        layer = store.policy.info.layer_idx
        g = query.shape[1] // store.keys.shape[1]
        full = torch.nn.functional.scaled_dot_product_attention(
            query, store.keys.repeat_interleave(g, 1), store.values.repeat_interleave(g, 1), scale=scaling)
        for kv in range(2):
            qs = slice(kv * g, (kv + 1) * g)
            if (layer, kv) in {(0, 1), (2, 0)}:  # everything held, nothing added: full attention's output
                torch.testing.assert_close(out[:, qs], full[:, qs], atol=1e-6, rtol=1e-5)
            else:
                assert float((out[:, qs] - full[:, qs]).abs().max()) > 1e-6
        seen.append(layer)

    _, c = decode(tiny_gqa3.model, method, ids_of(130, 2), 100, observer)
    assert len(seen) == 3 * 30
    for s in c.stores[0::2]:  # mixed layers: the non-retrieval head holds sinks + compensation + window + generated
        assert s.held_per_head() == pytest.approx((130 + 2 + 1 + 16 + 30) / 2) and s.n == 130
    assert c.stores[1].n == 2 + 1 + 16 + 30  # no retrieval head: evicted for real
    assert c.held_bytes() < c.full_bytes()


def test_scores_are_measured_once_and_cached_on_disk(tiny_llama, tmp_path, monkeypatch):
    method = RazorAttention(local=8, heads_cache=str(tmp_path), score_length=16)
    calls = []
    real = RA.measure_scores
    monkeypatch.setattr(RA, "measure_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    got1, _ = decode(tiny_llama.model, method, ids_of(60), 40)
    decode(tiny_llama.model, method, ids_of(60, 1), 40)  # the same method: remembered
    assert len(calls) == 1
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and "retrieval_heads" in json.loads(files[0].read_text())
    again = RazorAttention(local=8, heads_cache=str(tmp_path), score_length=16)  # a new one: from the disk
    got2, c = decode(tiny_llama.model, again, ids_of(60), 40)
    assert len(calls) == 1
    for a, b in zip(got1, got2):
        torch.testing.assert_close(a, b)
    RazorAttention(local=8, heads_cache=str(tmp_path), score_length=17).scores(tiny_llama.model, maker(c))
    assert len(list(tmp_path.glob("*.json"))) == 2  # other scoring settings: another entry


@pytest.mark.parametrize("bad,says", [
    (dict(induction=1.5), "method.induction=1.5 must be in [0, 1]"),
    (dict(echo=-0.1), "method.echo=-0.1"),
    (dict(sink=-1), "method.sink=-1 must be an integer >= 0"),
    (dict(local=2.5), "method.local=2.5"),
    (dict(score_repeats=1), "method.score_repeats=1 must be an integer >= 2"),
    (dict(compression_ratio=0.5), "method.compression_ratio=0.5"),
    (dict(budget=0.5), "allowed: 1.0"),
    (dict(heads_file="/nonexistent/heads.json"), "method.heads_file='/nonexistent/heads.json': no such file"),
    (dict(compensation="yes"), "method.compensation='yes'"),
])
def test_bad_settings_are_one_line_errors(bad, says):
    with pytest.raises(MethodConfigError) as e:
        RazorAttention(**bad)
    assert says in str(e.value) and "\n" not in str(e.value)
