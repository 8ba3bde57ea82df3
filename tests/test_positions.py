"""Bookkeeping that a decode step no longer pays for with a kernel (issue 36), checked for what it must keep:

- a store that moves no token on a decode step writes its tokens' positions lazily, as one run, when something
  reads them (``KVStore.end_forward``); they read back exactly as if each step had written its own, through scratch
  forwards, clones and a prefill chunk after decode steps;
- the model takes a decode step's position from the cache's device counter (no position of its own): logits equal
  those of the model deriving positions itself;
- an append zero-fills per-token method state (``KVStore.aux``) only where a removal left stale entries.
"""
from __future__ import annotations

import torch

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
        assert s._pos_run == (0, 0, 50) and s._pos_due is None and s._pos is None
        assert torch.equal(s.positions[0, 0], torch.arange(50)) and s._pos_run is None
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
