"""The method interface, `full` and `streaming_llm` on tiny random models (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from luka_bench.methods.base import MethodConfigError
from luka_bench.methods.full import Full
from luka_bench.methods.hf import attach
from luka_bench.methods.streaming_llm import StreamingLLM

from conftest import attn_impl, masked_eager_logits

ARCHS = ["tiny_llama", "tiny_qwen3", "tiny_gemma3", "tiny_gqa3"]


def plain_logits(model, ids, split):
    """Plain transformers (SDPA + DynamicCache): prefill ids[:split], then one token at a time."""
    with attn_impl(model, "sdpa"):
        c = DynamicCache(config=model.config)
        out = [model(ids[:, :split], past_key_values=c).logits]
        for t in range(split, ids.shape[1]):
            out.append(model(ids[:, t: t + 1], past_key_values=c).logits)
    return torch.cat(out, 1)


def method_logits(model, method, ids, split, question=5, reference_length=None):
    """Context prefill of ids[:split-question], end_prefill, a question chunk, then one token at a time."""
    ctx = split - question
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=ctx if reference_length is None else reference_length, manual=True)
        out = [model(ids[:, :ctx], past_key_values=c).logits]
        c.end_prefill()
        out.append(model(ids[:, ctx:split], past_key_values=c).logits)
        for t in range(split, ids.shape[1]):
            out.append(model(ids[:, t: t + 1], past_key_values=c).logits)
    return torch.cat(out, 1), c


@pytest.mark.parametrize("arch", ARCHS)
def test_full_equals_plain_transformers(arch, request):
    lm = request.getfixturevalue(arch)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))
    ref = plain_logits(lm.model, ids, 36)
    got, cache = method_logits(lm.model, Full(), ids, 36)
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
    # and against one un-cached forward over the whole sequence
    with torch.no_grad():
        whole = lm.model(ids, use_cache=False).logits
    assert torch.allclose(got, whole, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_streaming_budget_one_equals_full(arch, request):
    lm = request.getfixturevalue(arch)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(2))
    ref, _ = method_logits(lm.model, Full(), ids, 36)
    got, cache = method_logits(lm.model, StreamingLLM(budget=1.0), ids, 36)
    assert torch.allclose(got, ref, atol=1e-4, rtol=0)
    assert cache.held_tokens() == [s.n for s in cache.stores]
    assert all(s.n == 48 for s in cache.stores if not s.is_sliding)


def test_streaming_evicts_physically_keeps_positions(tiny_llama):
    model = tiny_llama.model
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(3))
    method = StreamingLLM(budget=0.25, sink=4)
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=100, manual=True)
        model(ids[:, :100], past_key_values=c)
        before = c.allocated_bytes()
        full_before = c.full_bytes()
        c.end_prefill()
        # after prefill: 25 tokens = 4 sinks + 21 most recent, in every layer, storage really smaller
        for s in c.stores:
            assert s.n == 25
            assert s.positions[0, 0].tolist() == [0, 1, 2, 3] + list(range(79, 100))
            assert s.keys.shape[2] == 25
        assert c.allocated_bytes() < 0.5 * before
        assert c.held_bytes() == pytest.approx(0.25 * full_before)
        # decode: logical length grows, the cache follows ceil(0.25 * seen), positions continue
        for t in range(100, 120):
            model(ids[:, t: t + 1], past_key_values=c)
        assert c.get_seq_length() == 120
        for s in c.stores:  # a decode step's new token takes the evicted one's slot: the window is unordered
            assert s.n == 30
            assert s.positions[0, 0, :4].tolist() == [0, 1, 2, 3]
            assert sorted(s.positions[0, 0].tolist()) == [0, 1, 2, 3] + list(range(94, 120))
        assert c.held_bytes() / c.full_bytes() == pytest.approx(0.25)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gqa3"])
def test_streaming_slot_moves_equal_shifting_the_window(arch, request):
    """A decode step's eviction moves the new token into the oldest window token's slot (issue 36: no shift):
    every step's logits and the held tokens equal those of the in-order eviction (``keep_ends``, the window
    shifted left), through capacity growth (budget 0.25: one more token held every 4 steps) and a multi-token
    forward after the slots were reordered."""
    from luka_bench.methods.streaming_llm import StreamingPolicy

    class Shifting(StreamingPolicy):
        def _evict(self, store):
            cap = self.capacity(store)
            if store.n > cap:
                sink = min(self.method.sink, cap)
                store.keep_ends(sink, cap - sink)

    class ShiftingLLM(StreamingLLM):
        policy_class = Shifting

    model = request.getfixturevalue(arch).model
    ids = torch.randint(0, 256, (1, 110), generator=torch.Generator().manual_seed(31))
    runs = []
    for method in (StreamingLLM(budget=0.25, sink=4), ShiftingLLM(budget=0.25, sink=4)):
        with attach(model, method) as a, torch.no_grad():
            c = a.new_cache(reference_length=60, manual=True)
            model(ids[:, :60], past_key_values=c)
            c.end_prefill()
            logits = [model(ids[:, t: t + 1], past_key_values=c).logits[0, -1] for t in range(60, 100)]
            logits.append(model(ids[:, 100:110], past_key_values=c).logits[0])  # a chunk after the moves
            logits += [model(ids[:, t: t + 1], past_key_values=c).logits[0, -1] for t in range(0, 5)]
            held = [sorted(s.positions[0, 0].tolist()) for s in c.stores]
            runs.append((logits, held, [s.n for s in c.stores]))
    (moved, held, n), (shifted, held_ref, n_ref) = runs
    assert held == held_ref and n == n_ref
    assert held[0][:4] == [0, 1, 2, 3] and held[0][-1] == 114
    for x, y in zip(moved, shifted):
        assert torch.allclose(x, y, atol=1e-5, rtol=0), (x - y).abs().max()


def test_streaming_positions_match_a_manual_reference(tiny_llama):
    """After eviction, the next token's logits equal attention over exactly the kept keys at their original
    positions: recompute them with plain transformers on the full sequence and an explicit 4-D mask that hides
    the evicted tokens."""
    model = tiny_llama.model
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(4))
    with attach(model, StreamingLLM(budget=0.25, sink=2)) as a, torch.no_grad():
        c = a.new_cache(reference_length=63, manual=True)
        model(ids[:, :63], past_key_values=c)
        c.end_prefill()
        kept = c.stores[0].positions[0, 0].tolist()  # 16 tokens: 2 sinks + 14 recent
        got = model(ids[:, 63:64], past_key_values=c).logits[0, -1]
    assert len(kept) == 16
    # Reference: for the last query, only `kept` + itself are visible; earlier rows are plain causal. Every layer
    # must see exactly the same kept set for this to hold, which streaming guarantees.
    allowed = torch.ones(64, 64, dtype=torch.bool).tril()
    allowed[63] = False
    allowed[63, kept + [63]] = True
    ref = masked_eager_logits(model, ids, allowed)
    # rows 0-62 are plain causal in both (the prefill is exact), so every layer's keys/values agree and the
    # last row must match
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()


def test_clone_isolates_questions(tiny_llama):
    """Answering from a clone of the context cache leaves the original untouched."""
    model = tiny_llama.model
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    with attach(model, StreamingLLM(budget=0.5)) as a, torch.no_grad():
        c = a.new_cache(reference_length=30, manual=True)
        model(ids[:, :30], past_key_values=c)
        c.end_prefill()
        snapshot = [(s.n, s.seen, s.keys.clone()) for s in c.stores]
        q1 = c.clone()
        model(ids[:, 30:40], past_key_values=q1)
        assert q1.get_seq_length() == 40
        for s, (n, seen, k) in zip(c.stores, snapshot):
            assert (s.n, s.seen) == (n, seen)
            assert torch.equal(s.keys, k)
        assert q1.stores[0].policy is not c.stores[0].policy
        assert all(s.cache is q1 for s in q1.stores) and all(s.cache is c for s in c.stores)


def test_a_dropped_cache_and_its_clones_are_freed_at_once(tiny_llama, tmp_path):
    """Caches are freed by reference counting, not left to the cyclic garbage collector: a store pointing back
    at its cache strongly made each cache a cycle, and a real run (very hard WikiSalad, ~230 questions answered
    from clones of a 4K-token context) grew ~150 MB per question until it was killed for memory at 21 GB."""
    import gc
    import weakref

    import luka_bench.run as R
    from conftest import compose
    from luka_bench.methods.hf import MethodCache

    model = tiny_llama.model
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    gc.collect()
    gc.disable()
    try:
        with attach(model, StreamingLLM(budget=0.5)) as a, torch.no_grad():
            c = a.new_cache(manual=True)
            model(ids[:, :30], past_key_values=c)
            c.end_prefill()
            q = c.clone()
            model(ids[:, 30:], past_key_values=q)
            refs = [weakref.ref(c), weakref.ref(q), weakref.ref(c.stores[0]), weakref.ref(q.stores[0]._k)]
            del c, q
            assert [r() for r in refs] == [None] * 4
        R.run(compose("model=tiny_llama", "data.limit=2", "max_new_tokens=2", "progress=false", "threads=1"),
              tmp_path / "r")  # 2 contexts, 8 question clones
        assert not [o for o in gc.get_objects() if isinstance(o, MethodCache)]
    finally:
        gc.enable()


@pytest.mark.parametrize("budget", [0, -0.1, 1.5, "half"])
def test_budget_outside_range_is_one_line_error(budget):
    with pytest.raises(MethodConfigError) as e:
        StreamingLLM(budget=budget)
    assert "method.budget" in str(e.value) and "(0, 1]" in str(e.value) and "\n" not in str(e.value)


def test_full_refuses_a_budget():
    with pytest.raises(MethodConfigError, match="full"):
        Full(budget=0.5)


def test_sliding_window_layers_left_to_windowed_attention(tiny_gemma3):
    """Gemma3's local layers hold only their window whatever the method; the global ones follow the method."""
    model = tiny_gemma3.model
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(6))
    with attach(model, StreamingLLM(budget=0.5)) as a, torch.no_grad():
        c = a.new_cache(reference_length=60, manual=True)
        model(ids, past_key_values=c)
        c.end_prefill()
    for s in c.stores:
        if s.is_sliding:
            assert s.n == 15 and s.positions[0, 0].tolist() == list(range(45, 60))
        else:
            assert s.n == 30


@pytest.mark.parametrize("method, components", [
    (Full(), {"attention"}),
    (StreamingLLM(budget=0.5), {"attention", "eviction"}),
])
def test_latency_components_of_every_method(method, components, tiny_llama):
    """The attention function times each method's attention (and its per-step eviction, where it has one)."""
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))
    _, c = method_logits(tiny_llama.model, method, ids, 36)
    assert set(c.timings) == components and all(v > 0 for v in c.timings.values())


class FakeEvent:
    """Stands in for torch.cuda.Event: a recorded time in ms, and whether it was waited on."""

    def __init__(self, ms):
        self.ms, self.waited = ms, False

    def synchronize(self):
        self.waited = True

    def elapsed_time(self, end):
        return end.ms - self.ms


def test_device_spans_resolve_when_read(tiny_llama):
    """On CUDA a span is a pair of events, resolved (one wait, on the last event) only when timings are read;
    clone() resolves them first (events cannot be copied)."""
    from luka_bench.methods.hf import new_cache

    c = new_cache(tiny_llama.model, Full())
    c.add_span("attention", 0.5, 0.75)  # host clock (CPU): added at once
    ends = [FakeEvent(30.0), FakeEvent(70.0)]
    c.add_span("attention", FakeEvent(10.0), ends[0])
    c.add_span("eviction", FakeEvent(60.0), ends[1])
    assert len(c._pending) == 2 and not ends[1].waited
    assert c.timings == pytest.approx({"attention": 0.25 + 0.020, "eviction": 0.010})
    assert ends[1].waited and c._pending == []
    c.add_span("eviction", FakeEvent(0.0), FakeEvent(5.0))
    d = c.clone()
    assert d.timings == pytest.approx({"attention": 0.27, "eviction": 0.015}) and c._pending == []


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3", "tiny_gqa3"])
def test_streaming_cache_positions_put_every_key_at_its_place_in_the_cache(arch, request):
    """positions=cache (the StreamingLLM paper's and official code's rule): after evictions at the prefill and at
    every step, the first layer's held keys equal the keys of a fresh forward of just the held tokens (its keys
    depend only on the token and its position, so this holds iff the key at cache index i sits at position i,
    the new tokens included). positions=original keeps the seen positions and differs."""
    model = request.getfixturevalue(arch).model
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(23))
    for mode in ("cache", "original"):
        with attach(model, StreamingLLM(budget=0.25, sink=4, positions=mode)) as a, torch.no_grad():
            c = a.new_cache(reference_length=50, manual=True)
            model(ids[:, :50], past_key_values=c)
            c.end_prefill()
            for t in range(50, 70):
                model(ids[:, t: t + 1], past_key_values=c)
            s = c.stores[0]
            kept = s.positions[0, 0]
            assert s.n == 18 and kept[:4].tolist() == [0, 1, 2, 3] and kept.max() == 69  # original: unordered window
            with attach(model, Full()) as f:
                fresh = f.new_cache()
                model(ids[:, kept], past_key_values=fresh)
            close = torch.allclose(s.keys, fresh.stores[0].keys, atol=1e-5)
            assert close == (mode == "cache"), (mode, (s.keys - fresh.stores[0].keys).abs().max())
            assert torch.allclose(s.values, fresh.stores[0].values, atol=1e-5)
            assert c.get_seq_length() == (18 if mode == "cache" else 70)


def test_streaming_positions_setting_is_checked(tiny_gemma3):
    with pytest.raises(MethodConfigError, match="allowed: original, cache"):
        StreamingLLM(positions="relative")
    with pytest.raises(MethodConfigError, match="sliding-window"):
        with attach(tiny_gemma3.model, StreamingLLM(budget=0.5, positions="cache")) as a:
            a.new_cache()
