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
