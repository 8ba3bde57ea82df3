"""Deterministic selection (issue 37, item 8). CUDA's ``scatter_add_`` on floats adds with atomics in no fixed
order, so a sum's low bits change from run to run — and with them a k-means assignment, a centroid's rank or a
top-k among near-ties. Where such sums feed a selection (LycheeCluster's chunk keys, k-means centroids and lazy
updates; LuKA's accumulated token and page masses when a query chunk's queries refine the same pages) they are
computed off the CPU without float atomics (``attention.group_sum``, ``attention.scatter_add_rows``,
``pages.segment_sums``); these tests force that path on the CPU (``dense=True``) and check it equals the
CPU's scatter and dispatches no scatter_add. Ties themselves have a stated rule: LuKA's refinement and lychee's
rankings take the earlier node (stable descending sorts, not ``topk``), k-means the lower-numbered centroid
(``argmax``'s first maximum)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from luka_bench.methods import attention
from luka_bench.methods.base import LayerInfo
from luka_bench.methods.luka_clustered import LuKAClustered, LuKAPolicy
from luka_bench.methods.lychee import Lychee, LycheePolicy, spherical_kmeans
from luka_bench.methods.pages import segment_sums

from conftest import DEVICE

pytestmark = pytest.mark.device


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_group_sum_without_atomics_equals_scatter_add():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 50, 8, generator=gen).to(DEVICE)
    a = torch.randint(0, 7, (2, 3, 50), generator=gen).to(DEVICE)
    ref = attention.group_sum(x, a, 7, dense=False)
    with _Ops() as ops:
        got = attention.group_sum(x, a, 7, dense=True)
    assert not {"scatter_add", "scatter_add_", "index_add", "index_add_"} & ops.names, ops.names
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    old = attention.DENSE_ELEMENTS
    try:  # in blocks of groups when the one-hot would be large: the same sums
        attention.DENSE_ELEMENTS = 2 * 3 * 50 * 2
        torch.testing.assert_close(attention.group_sum(x, a, 7, dense=True), ref, rtol=1e-6, atol=1e-6)
    finally:
        attention.DENSE_ELEMENTS = old


def test_scatter_add_rows_without_atomics_equals_scatter_add():
    """Rows (a chunk's queries) with distinct ids each, sharing ids across rows (the pages several queries
    refine): summed row by row in order, no float atomics."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(40, generator=gen)[:12] for _ in range(2 * 2 * 5)]).view(2, 2, 5, 12).to(DEVICE)
    src = torch.rand(2, 2, 5, 12, generator=gen).to(DEVICE)
    ref = torch.zeros(2, 2, 40, device=DEVICE)
    attention.scatter_add_rows(ref, ids, src, dense=False)
    got = torch.zeros(2, 2, 40, device=DEVICE)
    with _Ops() as ops:
        attention.scatter_add_rows(got, ids, src, dense=True)
    assert "scatter_add_" not in ops.names and "scatter_add" not in ops.names, ops.names
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_lychee_chunk_sums_without_atomics_equal_the_scatter():
    """Mean-pooled chunk keys (``pages.segment_sums``): each chunk's tokens gathered into max_chunk slots and summed
    in order."""
    pol = LycheePolicy(Lychee(max_chunk=6, min_chunk=2, token_budget=64, sink=0, buffer=4), LayerInfo(2, 3, 4, 2, 8))
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(1, 2, 30, 8, generator=gen).to(DEVICE)
    lens = torch.tensor([2, 6, 5, 3, 6, 4, 4], device=DEVICE)
    starts = torch.cumsum(lens, 0) - lens
    tc = torch.repeat_interleave(torch.arange(7, device=DEVICE), lens, output_size=30).view(1, 1, -1, 1)
    ref = torch.zeros(1, 2, 7, 8, device=DEVICE).scatter_add_(2, tc.expand(1, 2, -1, 8), k)
    torch.testing.assert_close(segment_sums(k, starts, lens, pol.method.max_chunk), ref, rtol=1e-6, atol=1e-6)


def test_spherical_kmeans_same_bits_on_every_run(monkeypatch):
    """The k-means of the index gives bit-identical centroids and assignments on repeated runs, on the path the
    device takes (CUDA: no atomics) and forced onto it on the CPU, where it also equals the CPU path."""
    gen = torch.Generator().manual_seed(3)
    x = torch.nn.functional.normalize(torch.randn(1, 2, 64, 16, generator=gen), dim=-1).to(DEVICE)
    runs = [spherical_kmeans(x, 9, 10) for _ in range(3)]
    assert all(torch.equal(r[0], runs[0][0]) and torch.equal(r[1], runs[0][1]) for r in runs)
    real = attention.group_sum
    monkeypatch.setattr("luka_bench.methods.lychee.group_sum", lambda x, a, k: real(x, a, k, dense=True))
    dense = [spherical_kmeans(x, 9, 10) for _ in range(3)]
    assert all(torch.equal(r[0], dense[0][0]) and torch.equal(r[1], dense[0][1]) for r in dense)
    assert torch.equal(dense[0][0], runs[0][0])
    torch.testing.assert_close(dense[0][1], runs[0][1], rtol=1e-5, atol=1e-6)


def test_luka_refinement_ties_go_to_the_earlier_page():
    """Equal page masses (identical summaries: repeated text) — the earlier page is refined, on every device;
    the threshold rule's validity follows the same order."""
    pol = LuKAPolicy(LuKAClustered(refine={"rule": "top_k", "k": 2}), LayerInfo(0, 1, 4, 2, 8))
    score = torch.tensor([[0.2, 0.3, 0.1, 0.3, 0.3]], device=DEVICE)
    idx, valid = pol._select(score)
    assert idx.tolist() == [[1, 3]] and valid is None
    pol = LuKAPolicy(LuKAClustered(refine={"rule": "threshold", "threshold": 0.25}), LayerInfo(0, 1, 4, 2, 8))
    idx, valid = pol._select(score)
    assert idx[0, :3].tolist() == [1, 3, 4] and valid[0].tolist()[:4] == [True, True, True, False]
