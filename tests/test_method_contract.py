"""The method contract (issue 47): the scorer base and KNorm on it, ``full_layers`` as every method's setting,
``Layered`` forwarding every method-level hook, ``describe`` from the settings."""
from __future__ import annotations

import math

import pytest
import torch

from luka_bench.methods.base import KVMethod, LayerPolicy
from luka_bench.methods.full import Full
from luka_bench.methods.h2o import H2O
from luka_bench.methods.hf import attach
from luka_bench.methods.knorm import KNorm
from luka_bench.methods.laser_kv import LaserKV
from luka_bench.methods.layered import Layered
from luka_bench.methods.policies import StaticExactPolicy
from luka_bench.methods.scorer import ScorerPolicy
from luka_bench.methods.snapkv import SnapKV
from luka_bench.methods.streaming_llm import StreamingLLM

from test_methods_core import method_logits


def ids_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def prefill(model, method, ids, question_ids=None, before_compression=None, **cache_kw):
    """Prefill ``ids`` through a manual cache (more settings: ``cache_kw``), optionally look at it
    (``before_compression(cache)``), compress."""
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=ids.shape[1], question_ids=question_ids, manual=True, **cache_kw)
        model(ids, past_key_values=c)
        seen = before_compression(c) if before_compression else None
        c.end_prefill()
    return c, seen


def kept_positions(cache) -> list[list[list[int]]]:
    """Per layer, per KV head (batch 0): the sorted logical positions held."""
    return [[sorted(s.positions[0, h].tolist()) for h in range(s.positions.shape[1])] for s in cache.stores]


# -- KNorm on the scorer base ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gqa3"])
@pytest.mark.parametrize("budget", [0.1, 0.37])
def test_knorm_keeps_exactly_the_lowest_norm_keys_of_each_kv_head(arch, budget, request):
    lm = request.getfixturevalue(arch)
    ids = ids_of(90, 3)
    norms = lambda c: [s.keys[0].float().norm(dim=-1) for s in c.stores]  # noqa: E731  [Hkv, n] per layer
    cache, before = prefill(lm.model, KNorm(budget=budget), ids, before_compression=norms)
    cap = math.ceil(budget * 90)
    for layer, (store, nrm) in enumerate(zip(cache.stores, before)):
        assert store.n == cap, (layer, store.n, cap)
        for h in range(nrm.shape[0]):
            want = sorted(torch.sort(-nrm[h], descending=True, stable=True).indices[:cap].tolist())
            assert sorted(store.positions[0, h].tolist()) == want, (layer, h)
    # heads choose on their own (per KV head, not one set per layer), on at least one layer
    if lm.model.config.num_key_value_heads > 1:
        assert any(len({tuple(h) for h in layer}) > 1 for layer in kept_positions(cache))


def test_knorm_with_the_whole_budget_equals_full(tiny_llama):
    ids = ids_of(60, 4)
    ref, _ = method_logits(tiny_llama.model, Full(), ids, 40)
    got, c = method_logits(tiny_llama.model, KNorm(budget=1.0), ids, 40)
    assert torch.equal(got, ref)
    assert all(s.n == 60 for s in c.stores)


def test_knorm_changes_the_logits_when_it_drops(tiny_llama):
    ids = ids_of(60, 4)
    ref, _ = method_logits(tiny_llama.model, Full(), ids, 40)
    got, _ = method_logits(tiny_llama.model, KNorm(budget=0.25), ids, 40)
    assert not torch.allclose(got[:, 35:], ref[:, 35:], atol=1e-3)


def test_the_scorer_base_keeps_sinks_recent_and_the_best_scored_in_time_order(tiny_llama):
    """A scorer that prefers odd positions, with 3 sinks and 5 recent protected: exactly those, in time order."""

    class OddPolicy(ScorerPolicy):
        def protected(self, store, cap):
            return 3, 5

        def score(self, store, start, stop, obs):
            return (store.positions[:, :, start:stop] % 2).float()

    class Odd(KVMethod):
        name = "odd"
        policy_class = OddPolicy

    cache, _ = prefill(tiny_llama.model, Odd(budget=0.25), ids_of(80, 5))
    cap = 20
    for store in cache.stores:
        got = store.positions[0].tolist()
        odd = [p for p in range(3, 75) if p % 2][: cap - 8]
        assert all(row == [0, 1, 2] + odd + list(range(75, 80)) for row in got), got[0]


# -- full_layers: one setting of every method ----------------------------------------------------------------------

@pytest.mark.parametrize("method", [KNorm(budget=0.25, full_layers=2), SnapKV(budget=0.25, window=8, full_layers=2),
                                    StreamingLLM(budget=0.25, full_layers=2), H2O(budget=0.25, full_layers=2)],
                         ids=lambda m: m.name)
def test_full_layers_keep_every_token_and_attend_exactly_in_every_method(method, tiny_llama):
    cache, _ = prefill(tiny_llama.model, method, ids_of(64, 6))
    assert [type(s.policy) is StaticExactPolicy for s in cache.stores] == [True, True, False]
    assert [s.n for s in cache.stores] == [64, 64, 16]


def test_full_layers_is_checked():
    from luka_bench.methods.base import MethodConfigError

    with pytest.raises(MethodConfigError, match="full_layers=-1"):
        KNorm(full_layers=-1)


# -- Layered forwards every method-level hook ---------------------------------------------------------------------------

def test_question_aware_snapkv_inside_layered_compresses_as_it_does_alone(tiny_gqa3):
    model = tiny_gqa3.model
    ids, question = ids_of(96, 7), list(range(200, 212))
    snap = dict(budget=0.25, window=8, question_aware=True)
    alone, _ = prefill(model, SnapKV(**snap), ids, question)
    layered, _ = prefill(model, Layered(rules=[{"layers": "first:2", "method": SnapKV(**snap)}], default=Full()),
                         ids, question)
    unaware, _ = prefill(model, SnapKV(**{**snap, "question_aware": False}), ids, question)
    assert kept_positions(layered)[:2] == kept_positions(alone)[:2]
    assert kept_positions(alone)[:2] != kept_positions(unaware)[:2]  # the question's queries chose differently
    assert layered.stores[2].n == 96  # the default (full) layer keeps everything


def test_laser_kv_inside_layered_compresses_as_it_does_alone(tiny_llama):
    model = tiny_llama.model
    ids = ids_of(160, 8)
    laser = dict(budget=0.25, block_size=40, divisor=4)
    layered_method = Layered(rules=[{"layers": "all", "method": LaserKV(**laser)}])
    assert layered_method.prefill_chunk() == 40

    def run(method):
        with attach(model, method) as a, torch.no_grad():
            c = a.new_cache(reference_length=160)
            model(ids, past_key_values=c)  # the pre-hook prefills in the method's blocks
        return c

    alone, layered = run(LaserKV(**laser)), run(layered_method)
    assert all(s.n < 160 for s in alone.stores)
    assert kept_positions(layered) == kept_positions(alone)


def test_layered_refuses_two_different_prefill_chunks():
    from luka_bench.methods.base import MethodConfigError

    m = Layered(rules=[{"layers": "first:1", "method": LaserKV(block_size=64)}], default=LaserKV(block_size=32))
    with pytest.raises(MethodConfigError, match=r"\[32, 64\]"):
        m.prefill_chunk()


def test_layered_hooks_see_only_their_layers(tiny_llama):
    seen: dict[str, list[int]] = {}

    class Probe(KVMethod):
        name = "probe"
        policy_class = LayerPolicy

        def __init__(self, tag):
            super().__init__()
            self.tag = tag

        def after_prefill_cache(self, cache):
            seen[self.tag] = [s.policy.info.layer_idx for s in cache.stores]
            super().after_prefill_cache(cache)

    cache, _ = prefill(tiny_llama.model, Layered(rules=[{"layers": "0,2", "method": Probe("a")}], default=Probe("b")),
                       ids_of(20, 9))
    assert seen == {"a": [0, 2], "b": [1]}


# -- describe: from the settings, one rule ---------------------------------------------------------------------------

def test_describe_names_every_setting():
    assert KNorm().describe() == "knorm(budget=0.125)"
    assert KNorm(full_layers=2).describe() == "knorm(budget=0.125, full_layers=2)"
    d = SnapKV(window=16).describe()
    assert d.startswith("snapkv(budget=0.125, window=16, kernel=5, pooling=avg, question_aware=False")
    lay = Layered(rules=[{"layers": "first:2", "method": KNorm(budget=0.5)}]).describe()
    assert "first:2: knorm(budget=0.5)" in lay and "default=full(budget=1)" in lay


def test_describe_and_lm_evals_settings_come_from_one_place():
    """``describe`` (the run's report, the cache key) and lm-eval's ``method_settings`` both read
    ``KVMethod.settings``: the same names in the same order, every value JSON-ready (a nested method as
    ``describe`` writes it)."""
    import json

    from luka_bench.methods.luka_clustered import LuKAClustered

    for m in (SnapKV(window=16), KNorm(full_layers=2), LuKAClustered(),
              Layered(rules=[{"layers": "first:2", "method": KNorm(budget=0.5)}])):
        js = json.loads(json.dumps(m.settings_json()))
        assert list(js) == list(m.settings())
        shown = m.describe()[len(m.name) + 1: -1]
        for k, v in js.items():
            assert f"{k}=" in shown or (k == "full_layers" and v == 0)
    assert SnapKV(window=16).settings_json()["window"] == 16
    assert Layered(rules=[{"layers": "first:2", "method": KNorm(budget=0.5)}]).settings_json()["default"] == \
        "full(budget=1)"


# -- head-wise budgets: a layer's budget split across its KV heads ----------------------------------------------------

class HeadKNormPolicy(ScorerPolicy):
    """KNorm's score with the capacities a test gives per KV head (``Heads.caps``: a function of cap and n)."""

    def score(self, store, start, stop, obs):
        return -store.keys[:, :, start:stop].float().norm(dim=-1)

    def protected(self, store, cap):
        return self.method.sinks, self.method.recent

    def head_capacities(self, store, cap, scores):
        return None if self.method.caps is None else self.method.caps(cap, store.n)


class Heads(KVMethod):
    name = "heads"
    policy_class = HeadKNormPolicy

    def __init__(self, budget, caps=None, sinks=0, recent=0):
        super().__init__(budget=budget)
        self.caps, self.sinks, self.recent = caps, sinks, recent


def replay(method, k, v, q, steps):
    """A one-layer cache replayed without a model: prefill k/v [1, Hkv, n, D] (queries q [1, Hq, n, D]), compress,
    then ``steps`` decode tokens (the last ones of k/v/q beyond n). Returns (outputs of the decode steps, store)."""
    from luka_bench.methods.base import LayerInfo
    from luka_bench.methods.cache import MethodCache, replay_forward

    n = k.shape[2] - steps
    info = LayerInfo(0, 1, q.shape[1], k.shape[1], k.shape[3])
    cache = MethodCache(method, [info], reference_length=n, manual=True)
    replay_forward(cache, 0, k[:, :, :n], v[:, :, :n], q[:, :, :n], 0.125)
    cache.end_prefill()
    outs = [replay_forward(cache, 0, k[:, :, t: t + 1], v[:, :, t: t + 1], q[:, :, t: t + 1], 0.125)
            for t in range(n, n + steps)]
    return torch.cat(outs, 2), cache.stores[0]


def kv_q(hkv=3, g=2, n=64, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, hkv, n + steps, 16, generator=gen) for _ in range(2))
    return k, v, torch.randn(1, hkv * g, n + steps, 16, generator=gen)


def test_head_budgets_all_equal_are_todays_results_bit_for_bit():
    k, v, q = kv_q()
    same, s1 = replay(Heads(0.25, caps=lambda cap, n: torch.full((1, 3), cap)), k, v, q, 3)
    uniform, s2 = replay(Heads(0.25), k, v, q, 3)
    assert torch.equal(same, uniform) and torch.equal(s1.positions, s2.positions)
    assert s1.head_mask() is None and s1.held_per_head() == s1.n == 16 + 3


@pytest.mark.parametrize("sinks,recent", [(0, 0), (2, 4)])
def test_a_head_given_the_whole_context_attends_as_full_attention(sinks, recent):
    k, v, q = kv_q(seed=1)
    n, steps, g = 64, 3, 2
    out, store = replay(Heads(0.25, caps=lambda cap, m: torch.tensor([[m, cap // 2, 2 * cap]]), sinks=sinks,
                              recent=recent), k, v, q, steps)
    # every head holds exactly its capacity (then the decode steps' tokens)
    held = store.head_mask().sum(-1)[0].tolist()
    assert held == [n + steps, 8 + steps, 32 + steps]
    full = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, n:], k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), scale=0.125,
        attn_mask=torch.ones(steps, n + steps, dtype=torch.bool).tril(n))
    torch.testing.assert_close(out[:, :g], full[:, :g], rtol=1e-5, atol=1e-6)  # head 0's query heads: exact
    assert not torch.allclose(out[:, g:], full[:, g:], atol=1e-3)  # the others attend over less
    # each head's own tokens: the lowest-norm ones outside its protected sinks/recent, in time order
    norms = k[0, :, :n].norm(dim=-1)
    for h, keep in enumerate([n, 8, 32]):
        pos = store.positions[0, h][store.head_mask()[0, h]].tolist()[: keep]
        mid = torch.arange(sinks, n - recent)
        best = mid[torch.sort(-norms[h, sinks: n - recent], descending=True, stable=True).indices[: keep - sinks - recent]]
        assert pos == list(range(sinks)) + sorted(best.tolist()) + list(range(n - recent, n)), h


def test_head_budgets_count_what_each_head_holds():
    k, v, q = kv_q(seed=2)
    _, store = replay(Heads(0.25, caps=lambda cap, m: torch.tensor([[4, 16, 28]])), k, v, q, 2)
    per_token_head = store.token_bytes() // 3  # one token of one KV head (keys + values)
    assert store.n == 28 + 2  # the storage is the longest head's wide
    assert store.held_bytes() == (4 + 16 + 28 + 3 * 2) * per_token_head
    assert store.held_per_head() == (4 + 16 + 28) / 3 + 2
    assert store.allocated_bytes() > store.held_bytes()  # the unused slots of the shorter heads are still allocated
    assert store.policy.attended_count(store) == store.held_per_head()


# -- paged key summaries ----------------------------------------------------------------------------------------------

def test_paged_key_summaries_follow_the_pages_as_they_close():
    from luka_bench.methods.pages import PagedKeys

    k, v, q = kv_q(n=37, steps=12, seed=3)
    summary, start, size = PagedKeys(size=8, start=2), 2, 8
    from luka_bench.methods.base import LayerInfo
    from luka_bench.methods.cache import MethodCache, replay_forward

    cache = MethodCache(Full(), [LayerInfo(0, 1, 6, 3, 16)], reference_length=37, manual=True)
    replay_forward(cache, 0, k[:, :, :37], v[:, :, :37], q[:, :, :37], 0.125)
    cache.end_prefill()
    store = cache.stores[0]
    assert summary.update(store) == 4 and summary.update(store) == 0  # slots 2..33: 4 closed pages
    added = []
    for t in range(37, 49):
        replay_forward(cache, 0, k[:, :, t: t + 1], v[:, :, t: t + 1], q[:, :, t: t + 1], 0.125)
        added.append(summary.update(store))
    assert added == [1 if (n - start) % size == 0 else 0 for n in range(38, 50)]  # closes when n - start hits 8m
    assert summary.pages == (49 - start) // size == 5
    pages = k[:, :, start: start + summary.pages * size].reshape(1, 3, summary.pages, size, 16)
    torch.testing.assert_close(summary.mean, pages.mean(3))
    assert torch.equal(summary.min, pages.amin(3)) and torch.equal(summary.max, pages.amax(3))
    assert summary.nbytes() == 3 * pages.mean(3).nbytes


@pytest.mark.parametrize("size", [1, 4, 16])
def test_quests_page_bound_is_never_below_a_keys_logit_and_exact_for_pages_of_one(size):
    from luka_bench.methods.pages import PagedKeys

    k, v, q = kv_q(n=64, steps=0, seed=size)
    summary = PagedKeys(size=size)
    summary.update(type("S", (), {"n": 64, "keys": k})())
    qg = q[:, :, -1].reshape(1, 3, 2, 16)  # the last query of each query head, by KV group
    bound = summary.bound(qg)  # [1, 3, 2, pages]
    logits = torch.einsum("bhgd,bhnd->bhgn", qg, k).reshape(1, 3, 2, 64 // size, size)
    assert (bound >= logits.amax(-1) - 1e-5).all()
    if size == 1:
        torch.testing.assert_close(bound, logits[..., 0], rtol=1e-5, atol=1e-5)


# -- the explicit decode step: the caller decides between ``attend`` and ``step`` ------------------------------------

def test_the_caller_decides_step_or_attend_and_hands_the_step_its_state(tiny_llama):
    """``step`` runs for every decode step (the decode phase, one token per row) and for nothing else — not the
    prefill, not its chunks, not a scratch forward, not several tokens at once after the prefill (those run
    ``attend``); the ``DecodeStep`` it gets holds the step's token position as a device counter, the store's slot of
    the token and per-step constants, the same for every layer of the step."""
    calls = []

    class Recording(LayerPolicy):
        static_decode = True  # the store writes a step's token at a device slot

        def attend(self, store, query, scaling):
            calls.append(("attend", self.info.layer_idx, store.cache.phase, query.shape[2]))
            return super().attend(store, query, scaling)

        def step(self, store, query, scaling, step):
            slot = step.slot(store)
            calls.append(("step", self.info.layer_idx, step.position, int(step.counter()), int(step.before(3)),
                          None if slot is None else int(slot), store.n, store.seen,
                          step.per_step(("plus", 7), lambda pos: pos + 7)))
            return LayerPolicy.attend(self, store, query, scaling)

    class Recorded(Full):
        def policy_for_layer(self, info):
            return Recording(self, info)

    model, layers = tiny_llama.model, tiny_llama.model.config.num_hidden_layers
    ids = ids_of(40)
    with attach(model, Recorded()) as a, torch.no_grad():
        c = a.new_cache(reference_length=30, prefill_chunk=16)
        model(ids[:, :30], past_key_values=c)  # a chunked prefill: 16 + 14
        assert {x[0] for x in calls} == {"attend"} and len(calls) == 2 * layers
        del calls[:]
        for t in (30, 31, 32):
            model(ids[:, t: t + 1], past_key_values=c)
        c.scratch_forward(ids[:, 33:34])  # one token, but a scratch forward: attend
        model(ids[:, 33:36], past_key_values=c)  # three tokens after the prefill: attend
    steps = [x for x in calls if x[0] == "step"]
    assert len(steps) == 3 * layers and calls[3 * layers:] == \
        [("attend", i, "scratch", 1) for i in range(layers)] + [("attend", i, "decode", 3) for i in range(layers)]
    for i, (_, layer, pos, counter, before, slot, n, seen, plus) in enumerate(steps):
        t = 30 + i // layers
        assert (layer, pos, counter, before, seen) == (i % layers, t, t, t - 3, t + 1)
        assert slot == n - 1  # the token's slot: the last held one
        assert plus is steps[i - i % layers][-1] and int(plus) == t + 7  # made once per step for all layers
