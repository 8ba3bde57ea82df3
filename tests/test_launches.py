"""Kernel launches per layer per steady-state decode step over stock transformers (issue 36): on a GPU a decode
step is bound by launches, so every method has a budget of *extra* launching aten ops per layer over plain
transformers (sdpa + ``DynamicCache``), counted by ``luka_bench.launches.LaunchCounter`` on a tiny 4-layer Llama
after a 400-token prompt: the median over 24 steps without an event (LuKA clustered's segmentation/compression,
entropy_ols's flushes, lychee's index updates). ``python -m luka_bench.launches --ops`` prints the table and the
ops behind each number.

A method over its budget is an ``xfail(strict=True)`` whose reason states the count and the ops that remain: the
gap is on record, and the case fails the moment the method fits (then the mark goes). Budgets are never loosened
to fit."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from luka_bench.host_sync import sync_method_config
from luka_bench.launches import LaunchCounter, decode_launch_counts, launches_op, stock_launch_counts, summary
from luka_bench.models import TinyRandomModel

CONF = Path(__file__).resolve().parent.parent / "conf" / "method"
LAYERS, PROMPT, STEPS = 4, 400, 24
pytestmark = [pytest.mark.usefixtures("one_thread")]

# extra launches per layer per step over stock (issue 36). h2o_outer (H2O on the outer layers, full in the
# middle) is not in the list: it gets H2O's, which it meets whenever H2O does.
BUDGET = {"full": 2, "snapkv": 2, "knorm": 2, "laser_kv": 2, "streaming_llm": 4, "oracle_topk": 8, "quest": 9, "h2o": 12,
          "luka_lined": 12, "luka_clustered": 12, "luka_mixed": 12, "h2o_outer": 12, "entropy_ols": 14, "lychee": 20,
          # tova: measured 8.75 (the step's weights from one explicit fp32 softmax, their sum, the victim's argmax
          # over a bits-and-position key, the newest token moved — copied first, as it may be the victim itself)
          "tova": 9,
          # prefill-only, as knorm and snapkv: nothing on a decode step
          "expected_attention": 2, "pyramidkv": 2, "finch": 2,
          # adakv: measured 1.75 — its heads packed (methods/packed.py): keys, values and the bias written at the
          # step's slots (3 index_put_; the slots ride the cache's position counter: no add of their own), the bias
          # expanded over the row's query heads (one copy)
          "adakv": 2,
          # the LASER-KV paper's rows (laser_kv with another alpha): prefill-only as laser_kv
          "laser_kv_exact": 2, "laser_kv_magicpig": 2, "laser_kv_mp25": 2, "laser_kv_mp50": 2,
          # duo_attention (synthetic pattern, half the heads streaming): measured 2 — a mixed layer packed as adakv's,
          # plus the slot leaving each streaming head's window (index_put_; riding the counter too); a streaming-only
          # layer is StreamingLLM's
          "duo_attention": 2,
          # arkvale (page_size 16, page_budget 12, topk 6, full_layers 1): measured 11.75 — per sparse layer the digest
          # scores (2 clamps, bmm, baddbmm, the group's mean), the candidates' bias (add), the top k' (topk), the
          # device set's key (add, scatter_ of the top k'), the device's M pages (topk), the device set rewritten
          # (fill_, scatter_), the page ids (cat), rows (add), one index_select of whole pages, the masked SDPA
          "arkvale": 12,
          # shadowkv (token_budget 64, outliers 4, local_chunks 2): measured 16.25 — per layer the landmark scores
          # (matmul, scale, softmax, the group's max), topk, the chunks' positions (gather, add), the rebuilt keys (the
          # rows of U and of the RoPE table: 2 index_select, one bmm with [SV, rotate_half(SV)], mul, addcmul), the
          # values (offsets add, index_select), the masked SDPA over outliers + rebuilt + local and tail
          "shadowkv": 17,
          # clusterkv: measured 12.5 with ``full_layers: 1`` of these 4 layers — per sparse layer the ranking GEMM
          # (bmm), sort, the ranked sizes (gather), cumsum, searchsorted, the shift (gather, add, sub), the members
          # (gather), the rows (cat), one index_select of keys and values, the masked SDPA, and the union of the
          # group's picks for the attended count (zeros, scatter_, sum)
          "clusterkv": 13,
          # razor_attention: measured 0.25 — prefill-only; a mixed layer is packed (its bias carried: 3 index_put_ at
          # the step's slots, the bias expanded over the row's query heads — 2 more than its classic layout's step,
          # one SDPA with the per-token bias as its mask, kept as the store's per-token state)
          "razor_attention": 1}
# a step with an event (LuKA's segmentation/compression, entropy_ols's flush, lychee's chunk closing: index update
# and its decode tables rebuilt) is counted apart, per event (one layer taking it) over a plain step's launches;
# measured 14.0 (LuKA), 186.0 (entropy_ols), 83.7 (lychee), 10.7 (quest: a page closing, its min/max/mean and the
# page layout remade): the budgets below guard those with a margin.
EVENT_BUDGET = {"luka_clustered": 16, "luka_mixed": 16, "entropy_ols": 200, "lychee": 100, "quest": 14,
                # arkvale: measured 17.7 (a page closing: its digest box — min, max, centre, spread — and the
                # candidates' bias, sink and window page ids remade)
                "arkvale": 22,
                # clusterkv: measured 225.0 — its one event per layer and prompt, the k-means (20 Lloyd steps) at the
                # first decode step
                "clusterkv": 250}
# over budget, not reduced yet: "<count> > <budget>: <the ops that remain>" (per layer, over stock). Every count
# includes 0.25 per layer (1 per step on these 4 layers) for the step's position counter, advanced in place so
# that a step carries no Python number (``MethodCache.position_tensor``; tests/test_graph_ready.py), and saves
# 0.5 (2 per step): the model takes its positions from that counter instead of an arange and an add of its own.
# A store that moves no token on a decode step writes no position per step (``KVStore.end_forward``: written as one
# run when read), so full attention is 0.25 under stock.
# lychee's count is per layer of the model, as every method's: with ``full_layers: 1`` of these 4 layers attending
# exactly, its 3 retrieval layers add ~26.75 each ((20 * 4 + 0.25) / 3); on a 32-layer model with the paper's 2
# full layers the per-layer figure would be ~25 (docs/speed.md). Counted on the portable path (CUDA's): on the CPU
# the scoring and the choice are one C++ op (``cpu_kernel.kernels_off``).
# quest (8.75 with ``full_layers: 1`` of these 4 layers): per sparse layer the page bounds (2 clamps, bmm, baddbmm),
# topk, the last page's index appended (cat) and the rows offset (add), one index_select of whole pages (keys and
# values), the masked SDPA over them (the last page's free slots: one index_fill_ per step for all layers), and the
# union of the group's pages for the attended count (zeros, scatter_, sum; none with one query head per KV head).
OVER: dict[str, str] = {}


def _cases():
    out = []
    for p in sorted(CONF.glob("*.yaml")):
        name = p.stem
        marks = [pytest.mark.xfail(strict=True, reason=OVER[name])] if name in OVER else []
        out.append(pytest.param(name, id=name, marks=marks))
    return out


@pytest.fixture(scope="module")
def llama():
    return TinyRandomModel(name="tiny_llama", arch="llama", num_hidden_layers=LAYERS, device="cpu",
                           dtype="float32").load()


@pytest.fixture(scope="module")
def stock(llama):
    return stock_launch_counts(llama.model, PROMPT, STEPS)


def test_every_method_has_a_budget():
    assert {p.stem for p in CONF.glob("*.yaml")} == set(BUDGET)


@pytest.mark.parametrize("name", _cases())
def test_extra_launches_per_layer_within_budget(name, llama, stock):
    method = instantiate(sync_method_config(name), _convert_="all")
    rows = decode_launch_counts(llama.model, method, PROMPT, STEPS, tokenizer=llama.tokenizer)
    s = summary(rows, stock, LAYERS)
    assert 35 <= s["stock"] <= 45, s  # the reference itself (issue 36: ~40 per layer)
    assert s["extra"] <= BUDGET[name], f"{name}: {s['extra']:g} extra launches per layer > {BUDGET[name]}: {s}"
    if name in EVENT_BUDGET:  # every method with events has them within these 24 steps
        assert s["event_extra"] is not None and s["event_extra"] <= EVENT_BUDGET[name], s
    else:
        assert s["event_extra"] is None, s


def test_the_counter_skips_views_and_metadata():
    x = torch.randn(4, 6)
    with LaunchCounter() as c:  # none of these launches a kernel
        x.view(2, 12), x.reshape(24), x[1:3], x[:, 2], x.t(), x.unsqueeze(0).squeeze(0), x.expand(2, 4, 6)
        x.detach(), x.transpose(0, 1), x.as_strided((2, 2), (1, 1)), x.to(torch.float32), x.contiguous()
        torch.empty(3), x.new_empty(2), x.size(), x.split(2)
    assert c.total == 0, c.ops
    with LaunchCounter() as c:  # each of these launches one
        x + 1, x.t().contiguous(), x.add_(1), torch.zeros(3), x.sum(), x.to(torch.float64), x[:, :2].clone()
    assert c.total == 7 and c.ops["add"] == 1 and c.ops["add_"] == 1, c.ops


def test_views_are_told_by_the_schema():
    aten = torch.ops.aten
    assert not launches_op(aten.view.default, (torch.zeros(2),), {})
    assert not launches_op(aten.select.int, (torch.zeros(2), 0, 0), {})
    assert launches_op(aten.index_copy_.default, (torch.zeros(2),), {})  # in place: writes, launches
    assert launches_op(aten.mul.Tensor, (torch.zeros(2),), {})


# issue 60: a batch of rows launches what one row does (the launch-bound decode step then costs about the same for
# 4 rows as for 1). ShadowKV reads its rows of U by (batch row, position) in one gather: no offset added per row.
BATCH = 4


@pytest.mark.parametrize("name", ["full", "snapkv", "streaming_llm", "h2o", "tova", "luka_clustered", "quest",
                                  "oracle_topk", "arkvale", "clusterkv", "entropy_ols", "adakv", "duo_attention",
                                  "razor_attention", "shadowkv"])
def test_a_batch_launches_what_one_row_does(name, llama, stock):
    method = instantiate(sync_method_config(name), _convert_="all")
    one = summary(decode_launch_counts(llama.model, method, PROMPT, STEPS, tokenizer=llama.tokenizer), stock, LAYERS)
    rows = decode_launch_counts(llama.model, method, PROMPT, STEPS, tokenizer=llama.tokenizer, batch=BATCH)
    many = summary(rows, stock_launch_counts(llama.model, PROMPT, STEPS, batch=BATCH), LAYERS)
    assert (many["extra"], many["event_extra"]) == (one["extra"], one["event_extra"]), (one, many)
