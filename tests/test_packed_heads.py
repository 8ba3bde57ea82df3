"""Storage that follows the heads (methods/packed.py, issue 61): a layer whose KV heads hold different numbers of
tokens keeps them packed, as wide as what they hold. Against the classic layout (the longest head's width, the others'
slots masked; ``KVStore.PACK_HEADS = False``) every logit, held position, count and byte figure is the same through
a prefill, a question chunk, decode steps, a scratch forward and the relayouts when the room runs out — and the
storage allocated is smaller."""
from __future__ import annotations

import pytest
import torch

from luka_bench.methods.adakv import AdaKV
from luka_bench.methods.duo_attention import DuoAttention
from luka_bench.methods.hf import attach
from luka_bench.methods.packed import plan
from luka_bench.methods.razor_attention import RazorAttention
from luka_bench.methods.store import KVStore

pytestmark = pytest.mark.device  # LUKA_TEST_DEVICE=cuda runs them on the GPU (docs/gpu.md)


def write_pattern(path, rows):
    path.mkdir(parents=True, exist_ok=True)
    (path / "full_attention_heads.tsv").write_text("\n".join("\t".join(str(x) for x in r) for r in rows) + "\n")
    return path


def razor_heads(path, heads):
    path.write_text(str([list(h) for h in heads]))
    return str(path)


def methods(tmp_path, layers, kv_heads):
    # every layer mixed: one streaming / compressed head and the others retrieval heads (layer-dependent choice)
    gates = [[0.1 if h == (li % kv_heads) else 0.9 for h in range(kv_heads)] for li in range(layers)]
    duo = DuoAttention(pattern_path=str(write_pattern(tmp_path / "duo", gates)),
                       head_compression_ratio=1 / kv_heads, sink=4, recent=16)
    razor = RazorAttention(heads_file=razor_heads(tmp_path / "razor.json",
                                                  [(li, h) for li in range(layers) for h in range(kv_heads)
                                                   if h != li % kv_heads]),
                           sink=4, local=24, compression_ratio=0, heads_cache=None)
    return {"duo_attention": duo, "razor_attention": razor, "adakv": AdaKV(budget=0.3, window=8)}


def run(model, method, ids, ctx, question, scratch_at=None):
    """Prefill ids[:ctx], a question chunk, one token at a time to the end (a scratch forward of 3 tokens before the
    step ``scratch_at``). Returns the logits, the cache, and per step the held positions of every layer and head."""
    held = []
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=ctx, manual=True)
        out = [model(ids[:, :ctx], past_key_values=c).logits]
        c.end_prefill()
        out.append(model(ids[:, ctx: ctx + question], past_key_values=c).logits)
        for t in range(ctx + question, ids.shape[1]):
            if t == scratch_at:
                c.scratch_forward(ids[0, 3:6].tolist(), start=t)
            out.append(model(ids[:, t: t + 1], past_key_values=c).logits)
            held.append(positions(c))
    return torch.cat(out, 1), c, held


def positions(cache):
    out = []
    for s in cache.stores:
        mask, pos = s.head_mask(), s.positions
        out.append([sorted(pos[0, h][mask[0, h]].tolist() if mask is not None else pos[0, h].tolist())
                    for h in range(pos.shape[1])])
    return out


@pytest.mark.parametrize("name", ["duo_attention", "razor_attention", "adakv"])
def test_packed_equals_the_classic_layout_and_allocates_less(name, tiny_gqa3, tmp_path, monkeypatch):
    model = tiny_gqa3.model
    cfg = model.config
    ids = torch.randint(0, 256, (1, 200 + 5 + 70), generator=torch.Generator().manual_seed(3))
    method = methods(tmp_path, cfg.num_hidden_layers, cfg.num_key_value_heads)[name]
    got, cache, held = run(model, method, ids, 200, 5, scratch_at=240)
    packed = [s.packed is not None for s in cache.stores]
    assert all(packed), packed
    relayouts = {s.packed.seen0 for s in cache.stores}
    assert max(relayouts) > 205, relayouts  # the room ran out during the decode: packed again at least once
    monkeypatch.setattr(KVStore, "PACK_HEADS", False)
    want, ref, held_ref = run(model, method, ids, 200, 5, scratch_at=240)
    assert all(s.packed is None for s in ref.stores)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert held == held_ref
    assert cache.held_bytes() == ref.held_bytes()
    assert [s.held_per_head() for s in cache.stores] == pytest.approx([s.held_per_head() for s in ref.stores])
    assert [s.n for s in cache.stores] == [s.n for s in ref.stores]
    alloc, alloc_ref = (sum(s.allocated_bytes() for s in c.stores) for c in (cache, ref))
    assert alloc < alloc_ref
    # what a packed store allocates is what its heads hold, the decode room and the bias (a few % more)
    assert alloc <= 1.35 * cache.held_bytes(), (alloc, cache.held_bytes())


@pytest.mark.parametrize("name", ["razor_attention", "adakv"])
def test_unpacking_mid_decode_changes_nothing(name, tiny_gqa3, tmp_path):
    """An operation the packed storage does not do turns it back into the classic layout: the run goes on the same
    (a packing with windows refuses: its policy counts slots in time order)."""
    model = tiny_gqa3.model
    cfg = model.config
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(4))
    method = methods(tmp_path, cfg.num_hidden_layers, cfg.num_key_value_heads)[name]
    want, _, _ = run(model, method, ids, 100, 4)
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=100, manual=True)
        out = [model(ids[:, :100], past_key_values=c).logits]
        c.end_prefill()
        out.append(model(ids[:, 100:104], past_key_values=c).logits)
        for t in range(104, 120):
            if t == 110:
                for s in c.stores:
                    s.unpack()
            out.append(model(ids[:, t: t + 1], past_key_values=c).logits)
    torch.testing.assert_close(torch.cat(out, 1), want, rtol=1e-5, atol=1e-5)
    assert all(s.packed is None for s in c.stores)


def test_a_packing_with_windows_refuses_to_unpack(tiny_gqa3, tmp_path):
    model = tiny_gqa3.model
    cfg = model.config
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(5))
    _, cache, _ = run(model, methods(tmp_path, cfg.num_hidden_layers, cfg.num_key_value_heads)["duo_attention"],
                      ids, 50, 2)
    with pytest.raises(RuntimeError, match="method=duo_attention: a packing with windows"):
        cache.stores[0].keep(torch.arange(3))


def test_plan_picks_the_least_storage_and_more_rows_on_a_tie():
    assert plan([[100, 20, 20]], 3) == (1, 140)  # one row: no slot wasted
    assert plan([[50, 50, 50, 50]], 4) == (4, 50)  # equal heads: a row each
    assert plan([[60, 40, 50, 50]], 4) == (2, 100)  # pairs fit exactly
    assert plan([[10, 10], [30, 5]], 2) == (1, 35)  # batch rows share a width


@pytest.mark.parametrize("name", ["duo_attention", "razor_attention", "adakv"])
def test_the_cpu_segment_step_equals_the_sdpa_step(name, tiny_gqa3, tmp_path, monkeypatch):
    """On the CPU in fp32 a packed layer's decode step is one C++ call over each KV head's own segment
    (``segments_attention``); the SDPA over the whole packed row (what CUDA runs) is the reference: two rows of
    different lengths decoded stacked (``stacked_packed``) and one alone, 24 steps (a row packed again among them),
    the logits within 1e-5 — and the kernel is what ran, stacked and alone."""
    from luka_bench.engine import forward, forward_rows
    from luka_bench.methods import cpu_kernel, packed as packed_mod

    from conftest import prefilled

    if tiny_gqa3.model.device.type != "cpu" or cpu_kernel.segments_attention_op() is None:
        pytest.skip("the CPU kernel (built here, off under LUKA_BENCH_NO_KERNEL=1)")
    model = tiny_gqa3.model
    cfg = model.config
    method = methods(tmp_path, cfg.num_hidden_layers, cfg.num_key_value_heads)[name]
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (150, 121, 96)]
    toks = torch.randint(0, 256, (3, 24), generator=g).tolist()
    real = cpu_kernel.segments_attention_op()
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    def decode():
        with attach(model, method) as a, torch.no_grad():
            caches = prefilled(a, model, prompts)
            alone = caches.pop()
            packed = all(s.packed is not None for c in caches for s in c.stores)
            rows = torch.stack([forward_rows(model, [t[j] for t in toks[:2]], caches) for j in range(24)])
            solo = torch.stack([forward(model, [x], alone) for x in toks[2]])
            seen0 = {s.packed.seen0 for c in caches for s in c.stores if s.packed is not None}
        return rows, solo, packed, seen0

    monkeypatch.setattr(packed_mod.cpu_kernel, "segments_attention_op", lambda: counted)
    rows, solo, packed, seen0 = decode()
    assert packed and max(seen0) > 121, seen0  # every layer packed; a row packed again during the decode
    assert 2 in calls and 1 in calls, sorted(set(calls))  # the stacked rows' step and the row alone's
    monkeypatch.setattr(packed_mod.cpu_kernel, "segments_attention_op", lambda: None)
    want_rows, want_solo, _, _ = decode()
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(solo, want_solo, rtol=1e-5, atol=1e-5)
