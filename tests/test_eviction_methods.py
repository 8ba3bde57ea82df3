"""H2O (= LuKA lined), SnapKV and per-layer assignment: the invariants from their papers, on tiny models."""
from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from luka_bench.methods.base import MethodConfigError
from luka_bench.methods.attention import top_indices
from luka_bench.methods.full import Full
from luka_bench.methods.h2o import H2O, MASS, H2OPolicy
from luka_bench.methods.hf import attach, layer_infos
from luka_bench.methods.layered import Layered, select_layers
from luka_bench.methods.snapkv import SnapKV, SnapKVPolicy

from conftest import CONF, attn_impl, compose, masked_eager_logits, tiny
from test_methods_core import method_logits

METHOD_CONFIGS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))


def with_budget_one(node):
    """Every `budget` in a method config (nested ones too) set to 1.0."""
    if OmegaConf.is_dict(node):
        for k in node:
            if k == "budget":
                node[k] = 1.0
            else:
                with_budget_one(node[k])
    elif OmegaConf.is_list(node):
        for x in node:
            with_budget_one(x)
    return node


# methods whose "whole context" is not a budget: DuoAttention keeps everything when no head is a streaming head
# (its pattern: a synthetic one, no learned pattern ships for the tiny models)
WHOLE = {"duo_attention": ["method.pattern_seed=0", "method.head_compression_ratio=0.0"]}


@pytest.mark.parametrize("name", METHOD_CONFIGS)
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3", "tiny_gqa3"])
def test_every_method_config_with_whole_budget_equals_full(name, arch, request):
    """Any method given the whole context as budget must equal full attention (every conf/method/*.yaml)."""
    lm = request.getfixturevalue(arch)
    cfg = compose(f"method={name}", "model=tiny_llama", *WHOLE.get(name, []))
    method = instantiate(with_budget_one(cfg.method))
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(7))
    ref, _ = method_logits(lm.model, Full(), ids, 36)
    got, cache = method_logits(lm.model, method, ids, 36)
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (name, (got - ref).abs().max())
    assert all(s.n == 48 for s in cache.stores)


# ---------------------------------------------------------------------------------------------------------- H2O

def eager_weights(model, ids):
    """Per-layer attention weights [Hq, L, L] of one eager forward (explicit softmax), the slow way."""
    with attn_impl(model, "eager"):
        out = model(ids, output_attentions=True, use_cache=False)
    return [a[0] for a in out.attentions]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3", "tiny_gqa3"])
def test_h2o_scores_are_attention_column_sums(arch, request):
    """Accumulated mass after a prefill of 30 tokens and 6 decode steps = column sums of the attention weights of
    those 36 queries (eager, explicit softmax), summed over the query heads of each KV group."""
    lm = request.getfixturevalue(arch)
    model = lm.model
    ids = torch.randint(0, 256, (1, 36), generator=torch.Generator().manual_seed(8))
    with attach(model, H2O(budget=1.0)) as a, torch.no_grad():
        c = a.new_cache(reference_length=30, manual=True)
        model(ids[:, :30], past_key_values=c)
        c.end_prefill()
        for t in range(30, 36):
            model(ids[:, t: t + 1], past_key_values=c)
    weights = eager_weights(model, ids)
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    for store, w in zip(c.stores, weights):
        hq, L, _ = w.shape
        ref = w.sum(dim=1).view(hq // g, g, L).sum(dim=1)  # [Hkv, L]
        assert torch.allclose(store.aux(MASS)[0], ref, atol=1e-4), (store.aux(MASS)[0] - ref).abs().max()


def test_h2o_decay_applies_per_forward(tiny_llama):
    model = tiny_llama.model
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(9))
    with attach(model, H2O(budget=1.0, decay=0.5)) as a, torch.no_grad():
        c = a.new_cache(manual=True)
        model(ids[:, :10], past_key_values=c)
        c.end_prefill()
        model(ids[:, 10:11], past_key_values=c)
    w = eager_weights(model, ids[:, :11])[0]
    g = 2
    prefill = w[:, :10].sum(1).view(2, g, 11).sum(1)
    step = w[:, 10].view(2, g, 11).sum(1)
    assert torch.allclose(c.stores[0].aux(MASS)[0], 0.5 * prefill + step, atol=1e-4)


def test_h2o_keeps_heavy_hitters_and_recent_per_kv_head_and_frees_memory():
    lm = tiny("qwen3", num_hidden_layers=1)  # one layer: its kept set can be checked against a masked forward
    model = lm.model
    ids = torch.randint(0, 256, (1, 81), generator=torch.Generator().manual_seed(10))
    method = H2O(budget=0.25, recent_fraction=0.5)
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=80, manual=True)
        model(ids[:, :80], past_key_values=c)
        store = c.stores[0]
        mass = store.aux(MASS).clone()
        alloc = c.allocated_bytes()
        c.end_prefill()
        assert store.n == 20 and c.allocated_bytes() < alloc / 2
        pos = store.positions[0]  # [Hkv, 20]
        for h in range(pos.shape[0]):
            heavy = set(mass[0, h, :70].topk(10).indices.tolist())
            assert set(pos[h, :10].tolist()) == heavy
            assert pos[h, 10:].tolist() == list(range(70, 80))
        kept = pos.clone()
        got = model(ids[:, 80:81], past_key_values=c).logits[0, -1]
    # reference: eager forward where the last query sees, per KV head, exactly the kept tokens and itself
    hq, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    allowed = torch.ones(hq, 81, 81, dtype=torch.bool).tril()
    allowed[:, 80] = False
    for qh in range(hq):
        allowed[qh, 80, kept[qh // (hq // hkv)].tolist() + [80]] = True
    ref = masked_eager_logits(model, ids, allowed)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    assert c.stores[0].n == 21  # ceil(0.25 * 81)


def test_h2o_evicts_at_every_decode_step(tiny_llama):
    model = tiny_llama.model
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(11))
    with attach(model, H2O(budget=0.5)) as a, torch.no_grad():
        c = a.new_cache(reference_length=40, manual=True)
        model(ids[:, :40], past_key_values=c)
        c.end_prefill()
        sizes = []
        for t in range(40, 60):
            model(ids[:, t: t + 1], past_key_values=c)
            sizes.append(c.stores[0].n)
    assert sizes == [-(-(t + 1) // 2) for t in range(40, 60)]
    assert c.held_bytes() / c.full_bytes() == pytest.approx(0.5)


@pytest.mark.parametrize("ties", [False, True], ids=["masses", "tied_masses"])
def test_h2o_one_token_eviction_equals_the_full_top_k(ties, tiny_llama, monkeypatch):
    """A decode step one token over capacity drops the single least-mass older token in place, the new token
    moved into its slot (``evict_into``): held positions, keys, values, masses (in time order) and logits equal the
    general top-k + keep path's at every step, also when masses tie (the later of equal tokens goes, as the stable
    top-k keeps the earlier)."""
    from luka_bench.methods.hf import KVStore

    model = tiny_llama.model
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(12))
    drops = []
    real = KVStore.evict_into
    monkeypatch.setattr(KVStore, "evict_into", lambda self, i, src=None: drops.append(1) or real(self, i, src))
    if ties:  # coarse masses right before each eviction: many equal ones among the older tokens
        attend = H2OPolicy.attend

        def coarse(self, store, query, scaling):
            out = attend(self, store, query, scaling)
            store.aux(MASS).copy_(store.aux(MASS).floor())
            if self._new_mass is not None:  # a slot step's new token: its mass is written where it moves
                self._new_mass = self._new_mass.floor()
            return out

        monkeypatch.setattr(H2OPolicy, "attend", coarse)

    def run(incremental):
        monkeypatch.setattr(H2OPolicy, "incremental", incremental)
        states, logits = [], []
        with attach(model, H2O(budget=0.25)) as a, torch.no_grad():
            c = a.new_cache(reference_length=60, manual=True)
            model(ids[:, :60], past_key_values=c)
            c.end_prefill()
            for t in range(60, 90):
                logits.append(model(ids[:, t: t + 1], past_key_values=c).logits[0, -1])
                # in time order: slot steps leave the slots unordered (each token keeps its position)
                order = [s.positions.argsort(-1) for s in c.stores]
                states.append([(s.positions.gather(-1, o), s.keys.gather(2, o[..., None].expand_as(s.keys)),
                                s.values.gather(2, o[..., None].expand_as(s.values)), s.aux(MASS).gather(-1, o))
                               for s, o in zip(c.stores, order)])
        return states, logits

    fast, fast_logits = run(True)
    assert len(drops) > 30  # most steps took the in-place path (capacity grows every 4th step)
    del drops[:]
    slow, slow_logits = run(False)
    assert not drops
    for a_, b_ in zip(fast, slow):
        for sa, sb in zip(a_, b_):
            assert torch.equal(sa[0], sb[0])  # the same tokens held
            for x, y in zip(sa[1:], sb[1:]):  # masses: sums over the same terms in another slot order
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    for x, y in zip(fast_logits, slow_logits):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_luka_lined_is_h2o_with_the_paper_settings():
    cfg = compose("method=luka_lined")
    m = instantiate(cfg.method)
    assert isinstance(m, H2O) and m.decay is None and m.min_recent == 128 and m.budget == 0.125
    assert m.recent_budget == "on_top"  # the paper's reading: 1/8 heavy hitters plus the tail
    assert H2OPolicy(m, None).split(50) == (50, 128)  # a 400-token prompt: ceil(400/8) = 50 heavy + 128 recent
    m.recent_budget = "inside"
    assert H2OPolicy(m, None).split(400) == (272, 128)


@pytest.mark.parametrize("where", ["on_top", "inside"])
def test_lined_tail_on_top_of_or_inside_the_heavy_budget(where, tiny_llama):
    """Held per layer after the prefill and after every decode step: on_top = ceil(budget * seen) heavy hitters +
    the tail; inside = ceil(budget * seen) in all, the tail included; the tail is always the newest tokens."""
    model = tiny_llama.model
    L, tail, budget = 80, 16, 0.25
    ids = torch.randint(0, 256, (1, L + 6), generator=torch.Generator().manual_seed(31))
    m = H2O(budget=budget, recent_fraction=0.0, min_recent=tail, recent_budget=where)
    with attach(model, m) as a, torch.no_grad():
        c = a.new_cache(reference_length=L, manual=True)
        model(ids[:, :L], past_key_values=c)
        c.end_prefill()
        for t in range(L, L + 6):
            seen = max(t, L)
            want = math.ceil(budget * seen) + (tail if where == "on_top" else 0)
            assert c.held_tokens() == [want] * len(c.stores), (t, where)
            # held, in whatever slots (a slot step puts the new token where the evicted one was)
            held = c.stores[0].positions.sort(-1).values
            assert (held[..., -tail:] == torch.arange(seen - tail, seen)).all()
            model(ids[:, t: t + 1], past_key_values=c)


# -------------------------------------------------------------------------------------------------------- SnapKV

def slow_snapkv_indices(q, k, scaling, cap, window, kernel, pooling):
    """A readable reference: loops over heads and tokens."""
    _, hq, w, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    prefix = n - window
    out = []
    for h in range(hkv):
        score = [0.0] * n
        for qh in range(h * g, (h + 1) * g):
            for i in range(window):
                qpos = n - window + i
                logits = [float(q[0, qh, i] @ k[0, h, j]) * scaling for j in range(qpos + 1)]
                p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0).tolist()
                for j in range(qpos + 1):
                    score[j] += p[j]
        pooled = []
        for j in range(prefix):
            nb = [score[x] for x in range(j - kernel // 2, j - kernel // 2 + kernel) if 0 <= x < prefix]
            # avg: out-of-range neighbours count as zeros (reference avg_pool1d, padding=kernel//2)
            pooled.append(max(nb) if pooling == "max" else sum(nb) / (kernel if pooling == "avg" else len(nb)))
        top = sorted(range(prefix), key=lambda j: -pooled[j])[: cap - window]
        out.append(sorted(top) + list(range(prefix, n)))
    return out


class RecordingSnapKV(SnapKVPolicy):
    seen: dict = {}

    def after_prefill(self, store):
        RecordingSnapKV.seen[self.info.layer_idx] = (self.q_window.clone(), store.keys.clone(), self.scaling)
        super().after_prefill(store)


@pytest.mark.parametrize("pooling", ["max", "avg", "avg_inrange"])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3", "tiny_gqa3"])
def test_snapkv_kept_indices_equal_slow_reference(arch, pooling, request):
    lm = request.getfixturevalue(arch)
    model = lm.model
    method = SnapKV(budget=0.4, window=6, kernel=5, pooling=pooling)
    method.policy_class = RecordingSnapKV  # instance attribute: records queries/keys before compressing
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(12))
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=50, manual=True)
        model(ids, past_key_values=c)
        c.end_prefill()
    for store in c.stores:
        q, k, scaling = RecordingSnapKV.seen[store.policy.info.layer_idx]
        ref = slow_snapkv_indices(q, k, scaling, 20, 6, 5, pooling)
        assert store.positions[0].tolist() == ref
        assert store.n == 20


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gqa3"])
def test_snapkv_observes_the_last_window_queries_of_the_prompt(arch, pooling, request):
    """Independent of what the policy records: the scores come from one eager forward's attention weights
    (output_attentions), rows of the *last* ``window`` prompt queries, summed over the group's query heads; a
    policy observing any other queries (e.g. the first window) keeps other tokens."""
    model = request.getfixturevalue(arch).model
    L, w, cap = 56, 6, 20
    ids = torch.randint(0, 256, (1, L), generator=torch.Generator().manual_seed(21))
    with attach(model, SnapKV(budget=cap / L, window=w, kernel=5, pooling=pooling)) as a, torch.no_grad():
        c = a.new_cache(reference_length=L, manual=True)
        model(ids, past_key_values=c)
        c.end_prefill()
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, att in enumerate(eager_weights(model, ids)):
        score = att[:, L - w:, : L - w].double().sum(1).view(-1, g, L - w).sum(1)  # [Hkv, prefix]
        pad = 5 // 2
        padded = torch.nn.functional.pad(score, (pad, pad), value=float("-inf") if pooling == "max" else 0.0)
        win = padded.unfold(-1, 5, 1)
        pooled = win.max(-1).values if pooling == "max" else win.sum(-1) / 5
        top = [sorted(sorted(range(L - w), key=lambda j: (-float(row[j]), j))[: cap - w]) for row in pooled]
        ref = [t + list(range(L - w, L)) for t in top]
        assert c.stores[layer].positions[0].tolist() == ref, layer


def test_snapkv_avg_pooling_follows_the_reference_edge_rule():
    """A row where the edge rules disagree: the reference (SnapKV code, kvpress: avg_pool1d with padding
    kernel//2, zeros counted) averages the spike at position 0 with two padded zeros (3/3 = 1.0 < 1.1 at the
    plateau's centre), while averaging the in-range neighbours only would give it 3/2 = 1.5 and keep it."""
    import torch.nn.functional as F

    from luka_bench.methods.snapkv import pool_scores

    row = torch.tensor([[[3.0, 0, 0, 1.1, 1.1, 1.1, 0, 0, 0, 0]]])
    ref = F.avg_pool1d(row, kernel_size=3, padding=1, stride=1)  # the reference implementations' call
    assert torch.allclose(pool_scores(row, 3, "avg"), ref)
    assert top_indices(pool_scores(row, 3, "avg"), 1).tolist() == [[[4]]]
    assert top_indices(pool_scores(row, 3, "avg_inrange"), 1).tolist() == [[[0]]]
    wide = torch.rand(2, 3, 40, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(pool_scores(wide, 5, "avg"), F.avg_pool1d(wide, 5, padding=2, stride=1))


def test_snapkv_defaults_are_the_reference_defaults():
    m = SnapKV()
    assert (m.window, m.kernel, m.pooling) == (64, 5, "avg")


def test_snapkv_compresses_once_then_grows(tiny_llama):
    model = tiny_llama.model
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(13))
    with attach(model, SnapKV(budget=0.25, window=8)) as a, torch.no_grad():
        c = a.new_cache(reference_length=60, manual=True)
        model(ids[:, :60], past_key_values=c)
        c.end_prefill()
        assert c.held_tokens() == [15] * 3
        for t in range(60, 70):
            model(ids[:, t: t + 1], past_key_values=c)
        assert c.held_tokens() == [25] * 3 and c.get_seq_length() == 70
        assert c.stores[0].positions[0, 0, -10:].tolist() == list(range(60, 70))


def test_snapkv_chunked_prefill_keeps_the_last_window(tiny_llama):
    model = tiny_llama.model
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(14))
    kept = []
    for chunk in (50, 16):
        with attach(model, SnapKV(budget=0.3, window=8)) as a, torch.no_grad():
            c = a.new_cache(reference_length=50, manual=True)
            for s in range(0, 50, chunk):
                model(ids[:, s: s + chunk], past_key_values=c)
            c.end_prefill()
            kept.append(c.stores[1].positions.clone())
    assert torch.equal(kept[0], kept[1])


@pytest.mark.parametrize("kw", [dict(window=0), dict(kernel=0), dict(pooling="median"), dict(budget=2.0)])
def test_snapkv_bad_settings(kw):
    with pytest.raises(MethodConfigError):
        SnapKV(**kw)


# ---------------------------------------------------------------------------------------------- state isolation

@pytest.mark.parametrize("method", [H2O(budget=0.3), SnapKV(budget=0.3, window=4)], ids=["h2o", "snapkv"])
def test_no_state_leaks_between_prompts(method, tiny_llama):
    model = tiny_llama.model
    a_ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(15))
    b_ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(16))

    def run(ids, att):
        c = att.new_cache(reference_length=32, manual=True)
        with torch.no_grad():
            model(ids[:, :32], past_key_values=c)
            c.end_prefill()
            out = [model(ids[:, t: t + 1], past_key_values=c).logits for t in range(32, 40)]
        return torch.cat(out, 1), c.stores[0].positions.clone()

    with attach(model, method) as att:
        run(a_ids, att)
        after_a = run(b_ids, att)
    with attach(model, method) as att:
        alone = run(b_ids, att)
    assert torch.equal(after_a[0], alone[0]) and torch.equal(after_a[1], alone[1])


# ------------------------------------------------------------------------------------------ per-layer assignment

def test_layer_selectors():
    assert select_layers("first:8", 36) == set(range(8))
    assert select_layers("last:8", 36) == set(range(28, 36))
    assert select_layers("first:8/36,last:8/36", 30) == set(range(7)) | set(range(23, 30))
    assert select_layers("first:25%", 8) == {0, 1}
    assert select_layers("2-4,7,-1", 10) == {2, 3, 4, 7, 9}
    assert select_layers("type:sliding_attention", 4, ["sliding_attention", "full_attention"] * 2) == {0, 2}
    assert select_layers("all", 3) == {0, 1, 2}
    with pytest.raises(MethodConfigError, match="first:N"):
        select_layers("middle", 4)


def test_assignment_puts_each_method_on_exactly_its_layers():
    lm = tiny("llama", num_hidden_layers=8)
    cfg = compose("method=h2o_outer")
    method = instantiate(cfg.method)
    infos = layer_infos(lm.model)
    assert method.assignment(infos) == ["h2o"] * 2 + ["full"] * 4 + ["h2o"] * 2
    with attach(lm.model, method) as a:
        c = a.new_cache(manual=True)
    kinds = [type(s.policy).__name__ for s in c.stores]
    assert kinds == ["H2OPolicy"] * 2 + ["LayerPolicy"] * 4 + ["H2OPolicy"] * 2
    # and the H2O layers evict while the full ones keep everything
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(17))
    with attach(lm.model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=40, manual=True)
        lm.model(ids, past_key_values=c)
        c.end_prefill()
    assert c.held_tokens() == [5, 5, 40, 40, 40, 40, 5, 5]


def test_type_selector_on_sliding_layers():
    lm = tiny("gemma3")
    method = Layered(rules=[{"layers": "type:full_attention", "method": H2O(budget=0.5)}])
    infos = layer_infos(lm.model)
    names = method.assignment(infos)
    assert names == ["h2o" if i.layer_type == "full_attention" else "full" for i in infos]
    assert "full" in names and "h2o" in names


@pytest.mark.parametrize("method", [H2O(budget=0.5), SnapKV(budget=0.5, window=4)], ids=["h2o", "snapkv"])
def test_latency_components(method, tiny_llama):
    """H2O's explicit attention and its per-step eviction are timed; SnapKV evicts once, after the prefill."""
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))
    _, c = method_logits(tiny_llama.model, method, ids, 36)
    want = {"attention", "eviction"} if isinstance(method, H2O) else {"attention"}
    assert set(c.timings) == want and all(v > 0 for v in c.timings.values())
