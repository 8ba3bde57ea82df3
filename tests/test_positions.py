"""Bookkeeping that a decode step no longer pays for with a kernel (issue 36), checked for what it must keep:

- a store that moves no token on a decode step writes its tokens' positions lazily, as one run, when something
  reads them (``KVStore.end_forward``); they read back exactly as if each step had written its own, through scratch
  forwards, clones and a prefill chunk after decode steps;
- the model takes a decode step's position from the cache's device counter (no position of its own): logits equal
  those of the model deriving positions itself;
- an append zero-fills per-token method state (``KVStore.aux``) only where a removal left stale entries.
"""
from __future__ import annotations

import pytest
import torch

from luka_bench.engine import prefill
from luka_bench.methods.full import Full
from luka_bench.methods.h2o import H2O
from luka_bench.methods.hf import attach
from luka_bench.methods.luka_clustered import LuKAClustered


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefilled(att, model, ids, n: int):
    """A fresh cache of ``att`` with the first ``n`` ids prefilled."""
    c = att.new_cache()
    model(ids[:, :n], past_key_values=c)
    return c


@torch.no_grad()
def test_decode_positions_are_written_when_read_and_read_back_exactly(tiny_llama):
    model = tiny_llama.model
    ids = _ids(70, 3)
    with attach(model, Full()) as att:
        c = _prefilled(att, model, ids, 40)
        for t in range(40, 50):
            model(ids[:, t: t + 1], past_key_values=c)
        s = c.stores[0]
        # the prefill's positions and ten steps': not written yet — full attention holds no positions storage
        assert s._positions.run == (0, 0, 50) and s._positions.due is None and s._positions.table is None
        assert torch.equal(s.positions[0, 0], torch.arange(50)) and s._positions.run is None
        # a run restarted after the read, a scratch forward in the middle of it (its tokens dropped), a clone
        model(ids[:, 50:51], past_key_values=c)
        c.scratch_forward([5, 6, 7], start=80)
        model(ids[:, 51:52], past_key_values=c)
        twin = c.clone()
        for t in range(52, 60):
            model(ids[:, t: t + 1], past_key_values=c)
            model(ids[:, t: t + 1], past_key_values=twin)
        model(ids[:, 60:70], past_key_values=c)  # a chunk after decode steps
        for cache, n in ((c, 70), (twin, 60)):
            for store in cache.stores:
                assert torch.equal(store.positions, torch.arange(n).expand(1, store.positions.shape[1], n))


@torch.no_grad()
def test_lazy_positions_in_a_method_that_compresses(tiny_llama):
    """LuKA clustered pages its raw tokens every 16 steps: positions stay the held tokens' logical positions."""
    model = tiny_llama.model
    ids = _ids(140, 4)
    method = LuKAClustered(page_size=8, tail=16, compress_every=16)
    with attach(model, method) as att:
        c = _prefilled(att, model, ids, 60)
        for t in range(60, 140):
            model(ids[:, t: t + 1], past_key_values=c)
        for store in c.stores:
            assert torch.equal(store.positions[0, 0], torch.arange(140))


@torch.no_grad()
def test_a_step_position_from_the_cache_counter_gives_the_models_own_logits(tiny_llama):
    """The pre-hook hands the model the step's position (the cache's counter); with the model deriving it from the
    cache length instead, the logits are the same, step for step."""
    from luka_bench.methods import hf

    model = tiny_llama.model
    ids = _ids(60, 5)

    def run():
        out = []
        with attach(model, H2O(budget=0.5)) as att:
            c = _prefilled(att, model, ids, 40)
            for t in range(40, 60):
                out.append(model(ids[:, t: t + 1], past_key_values=c).logits[0, -1])
        return torch.stack(out)

    ours = run()
    hooked = hf._before_forward

    def without_positions(module, args, kwargs):
        got = hooked(module, args, kwargs)
        if got is not None:
            got[1].pop("position_ids", None)
        return got

    hf._before_forward = without_positions
    try:
        theirs = run()
    finally:
        hf._before_forward = hooked
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@torch.no_grad()
def test_append_zero_fills_method_state_only_where_a_removal_left_stale_entries(tiny_llama):
    model = tiny_llama.model
    ids = _ids(50, 6)
    with attach(model, Full()) as att:
        c = _prefilled(att, model, ids, 30)
        s = c.stores[0]
        s.aux("state").fill_(7.0)
        s.keep(torch.arange(20, 30))  # in place: stale entries beyond the kept ten
        assert s.n == 10
        model(ids[:, 30:31], past_key_values=c)
        assert s.aux("state")[0, :, -1].eq(0).all() and s.aux("state")[0, :, :10].eq(7.0).all()
        # a store that removed nothing since: its appends fill nothing (one launch fewer per step)
        from luka_bench.launches import LaunchCounter

        for t in range(31, 36):
            s.aux("state")[:, :, -1:] = 1.0  # the method's own write to its newest token
            with LaunchCounter() as count:
                model(ids[:, t: t + 1], past_key_values=c)
            assert s.aux("state")[0, :, -1].eq(0).all()
            assert count.ops["fill_"] == 0, count.ops


def _run_reading(model, method, ids, n: int, steps: int, read_every: bool, chunk: int = 0):
    """Prefill ``n`` ids (compressed inside the forward; in chunks of ``chunk``), then ``steps`` teacher-forced tokens;
    ``read_every``: every store's positions read after each forward (written at once, never left pending)."""
    with attach(model, method) as att:
        c = att.new_cache(reference_length=n, prefill_chunk=chunk)
        logits = [prefill(model, ids[0, :n], c)]
        for t in range(n, n + steps):
            if read_every:
                for s in c.stores:
                    s.positions
            logits.append(model(ids[:, t: t + 1], past_key_values=c).logits[0, -1])
        return torch.stack(logits), [s.positions.clone() for s in c.stores]


@torch.no_grad()
@pytest.mark.parametrize("name", ["streaming_llm", "streaming_llm_cache", "streaming_llm_chunked", "snapkv"])
def test_positions_kept_as_one_description_for_every_head_read_back_as_if_written(name, tiny_gqa3):
    """A keep that drops the same tokens from every head (StreamingLLM's sinks and window) keeps their positions as
    runs or one [m] tensor, not a [B, Hkv, cap] table: the prefill holds no per-head positions while the next layers
    run (issue 50); a per-head keep (SnapKV) one int32 [B, Hkv, m] tensor. Positions, logits and what decode steps
    evict are those of a store whose positions were written at once."""
    from luka_bench.methods.snapkv import SnapKV
    from luka_bench.methods.streaming_llm import StreamingLLM

    make, chunk = {
        "streaming_llm": (lambda: StreamingLLM(budget=0.25), 0),
        "streaming_llm_cache": (lambda: StreamingLLM(budget=0.25, positions="cache"), 0),
        "streaming_llm_chunked": (lambda: StreamingLLM(budget=0.25), 32),
        "snapkv": (lambda: SnapKV(budget=0.25, window=8), 0),  # per-head: a table, as before
    }[name]
    model, n = tiny_gqa3.model, 120
    ids = _ids(n + 12, 7)
    lazy, pos_lazy = _run_reading(model, make(), ids, n, 12, read_every=False, chunk=chunk)
    eager, pos_eager = _run_reading(model, make(), ids, n, 12, read_every=True, chunk=chunk)
    assert torch.equal(lazy, eager)
    assert all(torch.equal(a, b) for a, b in zip(pos_lazy, pos_eager))
    with attach(model, make()) as att:  # right after the prefill: what each layer holds for its positions
        c = att.new_cache(reference_length=n, prefill_chunk=chunk)
        prefill(model, ids[0, :n], c)
        for s in c.stores:
            b, h = s.keys.shape[:2]
            assert s.n < n
            if name == "snapkv":  # per head: one int32 [B, Hkv, n] tensor, half an int64 table's bytes
                assert s._positions.table is None and s._positions.shared.dtype == torch.int32
                assert s._positions.shared.shape == (b, h, s.n)
                assert s.allocated_bytes() == s._k.nbytes + s._v.nbytes + b * h * s.n * 4
                continue
            assert s._positions.table is None, "a head-independent keep wrote a per-head positions table"
            assert isinstance(s._positions.shared, tuple)  # runs: no tensor at all
            assert s.allocated_bytes() == s._k.nbytes + s._v.nbytes
            sink = 4
            want = torch.cat([torch.arange(sink), torch.arange(n - (s.n - sink), n)])
            if name != "streaming_llm_cache":  # positions=cache: the window renumbered after the sinks
                assert torch.equal(s.positions, want.expand(b, h, -1))


@torch.no_grad()
def test_a_keep_from_shared_positions_and_a_chunk_after_it_read_back_exactly(tiny_llama):
    """Store level: a 1-D keep from the untouched state, a per-head one, a chunk appended after them, a decode step,
    a second keep (which writes the shared positions into a table first) and a clone: each read back as if written
    at once."""
    model = tiny_llama.model
    ids = _ids(90, 8)
    with attach(model, Full()) as att:
        c = _prefilled(att, model, ids, 40)
        s = c.stores[0]
        idx = torch.tensor([0, 1, 2, 10, 11, 30, 39])
        s.keep(idx)
        assert s._positions.table is None and torch.equal(s._positions.shared, idx)
        want = idx
        s.keep_ends(2, 3)  # not from the untouched state: written first, then kept
        want = torch.cat([want[:2], want[-3:]])
        assert s._positions.table is not None and s._positions.shared is None
        assert torch.equal(s.positions[0, 0], want)
        s2 = c.stores[1]
        s2.keep_ends(4, 6)
        assert s2._positions.table is None and s2._positions.shared == ((0, 0, 4), (4, 34, 10))
        s3 = c.stores[2]  # per KV head, other tokens in each head: one int32 [B, Hkv, m] tensor
        h = s3.keys.shape[1]
        per_head = torch.stack([torch.arange(head, 40, 8)[:5] for head in range(h)]).unsqueeze(0)
        s3.keep(per_head)
        assert s3._positions.table is None and s3._positions.shared.dtype == torch.int32 and \
            torch.equal(s3._positions.shared, per_head)
        twin = c.clone()
        for cache in (c, twin):
            model(ids[:, 40:60], past_key_values=cache)  # a chunk after the keep: a new run, nothing written
            model(ids[:, 60:61], past_key_values=cache)
        t2, t3 = twin.stores[1], twin.stores[2]
        assert t2._positions.table is None and t2._positions.shared == ((0, 0, 4), (4, 34, 10))
        assert t3._positions.table is None and torch.equal(t3._positions.shared, per_head)
        for store in (c.stores[1], t2):
            assert torch.equal(store.positions[0, 0], torch.cat([torch.arange(4), torch.arange(34, 61)]))
        for store in (s3, t3):
            assert store.positions.dtype == torch.long
            assert torch.equal(store.positions, torch.cat([per_head, torch.arange(40, 61).expand(1, h, -1)], -1))
