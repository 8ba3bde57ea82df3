"""A graph-ready steady state (issue 36, item 3): for the methods that hold a fixed number of tokens between events,
two consecutive steady-state decode steps must dispatch the same ops, on tensors of the same shapes, dtypes and
devices, with the same non-tensor arguments, and make no host sync — what capturing one step in a CUDA graph and
replaying it needs (a Python number that changes from step to step would be baked into the capture and replay
stale; a shape that changes needs a new capture).

Only luka_bench's own code is compared (``launches.method_scope``: the cache update, the attention and per-step
policy work, the end of the forward); the model around it is transformers' (its eager decode derives positions
from the cache length on the host: its static-cache path is what it captures).

oracle_topk's store grows by one token per step: its decode step writes the new token at a slot held on the
device and attends over the whole storage with the free slots masked (``LayerPolicy.static_decode``), so its shapes
change only when the storage grows. LuKA clustered writes the step's token into its cover at a slot held on the
device too and attends over the cover's fixed-width tail region with the free slots masked (``luka_cover.Cover.sync``;
cover and mask are remade in the compression step itself). LycheeCluster between chunk closings: the torch path
(what CUDA runs; the CPU's C++ op is turned off here) reads the recent tokens from a region of fixed width with its
free slots masked, takes the budget left to the chunks as a device tensor, and its exact ``full_layers`` read the
storage's whole capacity masked (``StaticExactPolicy``). Quest between page closings: the pages are gathered from the
storage's whole capacity (whole pages), the candidate pages and the last page's index fixed until the next closing,
the last page's free slots masked."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from luka_bench.host_sync import SyncCounter, sync_method_config
from luka_bench.launches import LaunchCounter, event_count, method_scope
from luka_bench.models import TinyRandomModel

from conftest import DEVICE

PROMPT, STEPS = 300, 12
pytestmark = [pytest.mark.device, pytest.mark.usefixtures("one_thread")]  # also on LUKA_TEST_DEVICE=cuda

CASES = [
    pytest.param("streaming_llm", id="streaming_llm"),
    pytest.param("h2o", id="h2o"),
    pytest.param("luka_lined", id="luka_lined"),
    pytest.param("luka_mixed", id="luka_mixed"),
    pytest.param("oracle_topk", id="oracle_topk"),
    pytest.param("quest", id="quest"),
    pytest.param(("quest", {"select": "evaluation"}), id="quest-evaluation"),  # the reference's accuracy rule
    pytest.param("arkvale", id="arkvale"),
    pytest.param("shadowkv", id="shadowkv"),
    pytest.param("clusterkv", id="clusterkv"),
    pytest.param("luka_clustered", id="luka_clustered"),
    pytest.param("lychee", id="lychee"),
]


@pytest.fixture(scope="module")
def llama():
    return TinyRandomModel(name="tiny_llama", arch="llama", num_hidden_layers=2, device=DEVICE,
                           dtype="float32").load()


def _first_difference(a: list, b: list) -> str:
    if len(a) != len(b):
        return f"{len(a)} ops vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"op {i}: {x} vs {y}"
    return "none"


@torch.no_grad()
def _steps(model, method, tokenizer):
    """Per decode step: (luka_bench's traced ops, host syncs, tokens held per layer before, after, events)."""
    from luka_bench.methods import cpu_kernel, hf

    host = torch.randint(0, 200, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(0))
    ids = host.to(model.device)
    out = []
    with hf.attach(model, method, tokenizer) as att, method_scope(), cpu_kernel.kernels_off():
        cache = att.new_cache(reference_length=PROMPT)
        cache.add_tokens(host[0, :PROMPT].tolist())
        model(input_ids=ids[:, :PROMPT], past_key_values=cache, use_cache=True, logits_to_keep=1)
        for i in range(PROMPT, PROMPT + STEPS):
            x = ids[:, i: i + 1]
            cache.add_tokens([int(host[0, i])])
            held, before = cache.held_tokens(), event_count(cache)
            with SyncCounter() as syncs, LaunchCounter(trace=True, method_only=True) as c:
                model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            events = sum(a > b for a, b in zip(event_count(cache), before))
            out.append((c.trace, syncs.total, held, cache.held_tokens(), events))
    return out


def _assert_steady(name: str, rows: list, least: int, after_alike: bool = False) -> None:
    """At least ``least`` pairs of consecutive steady steps (no event, the same growth of the tokens held) traced
    alike, and no host sync on a steady step. ``after_alike``: the steps before them grew alike too (stacked rows: a
    step moves the slots of the rows that kept their token in the step before, ``stacked._Layout.advance``)."""
    steady = [i for i, r in enumerate(rows) if i and not r[4]]
    grew = [[a - b for a, b in zip(r[3], r[2])] for r in rows]
    pairs = [(i, i + 1) for i in steady if i + 1 in steady and grew[i] == grew[i + 1]
             and (not after_alike or grew[i - 1] == grew[i])]
    assert len(pairs) >= least, f"{name}: too few consecutive steady steps: {[(r[2], r[3], r[4]) for r in rows]}"
    for i, j in pairs:
        a, b = rows[i][0], rows[j][0]
        assert a, f"{name}: nothing traced inside luka_bench's code at step {i}"
        assert a == b, f"{name}: steps {i} and {j} differ: {_first_difference(a, b)}"
    assert all(rows[i][1] == 0 for i in steady), f"{name}: host syncs on steady steps: {[r[1] for r in rows]}"


@pytest.mark.parametrize("name", CASES)
def test_two_steady_steps_dispatch_the_same_ops_on_the_same_shapes_without_a_sync(name, llama):
    """Steady: a step with no event (compression, flush, chunk closing); two are compared when they change the
    tokens held alike (with ``budget`` a fraction of the tokens seen, one step in 1/budget grows a fixed-capacity
    method's capacity by one: that step is compared with none)."""
    name, overrides = name if isinstance(name, tuple) else (name, {})
    rows = _steps(llama.model, instantiate(sync_method_config(name, overrides), _convert_="all"), llama.tokenizer)
    _assert_steady(name, rows, 3)


@torch.no_grad()
def _row_steps(model, method, tokenizer, rows=2):
    """``_steps`` for rows of different lengths decoded together (``host_sync.ragged_rows``: rows of 300, 293, ...
    tokens, each prefilled alone in its own cache; then one forward per step over all rows, ``hf.RowBatch``); per
    step the events and held tokens over the rows."""
    from luka_bench.host_sync import ragged_rows
    from luka_bench.methods import cpu_kernel, hf

    ids = torch.randint(0, 200, (rows, PROMPT + STEPS), generator=torch.Generator().manual_seed(0)).to(model.device)
    out = []
    with hf.attach(model, method, tokenizer) as att, method_scope(), cpu_kernel.kernels_off():
        caches, step = ragged_rows(att, model, method, ids, PROMPT)
        for i in range(STEPS):
            x = step(i)
            held = [h for c in caches for h in c.held_tokens()]
            before = [e for c in caches for e in event_count(c)]
            with SyncCounter() as syncs, LaunchCounter(trace=True, method_only=True) as counter:
                model(input_ids=x, past_key_values=hf.RowBatch(caches), use_cache=True, logits_to_keep=1)
            events = sum(a > b for a, b in zip([e for c in caches for e in event_count(c)], before))
            out.append((counter.trace, syncs.total, held, [h for c in caches for h in c.held_tokens()], events))
    return out


@pytest.mark.parametrize("name", CASES)
def test_rows_of_different_lengths_keep_the_steady_state(name, llama):
    """Issue 60: the graph-ready steady state holds with a batch — rows of 300 and 293 prompt tokens, each in its
    own cache, decoded together: two consecutive steady steps (after a step that changed the rows' held tokens as
    they do) dispatch the same ops on the same shapes (both rows' work), with no host sync."""
    name, overrides = name if isinstance(name, tuple) else (name, {})
    rows = _row_steps(llama.model, instantiate(sync_method_config(name, overrides), _convert_="all"),
                      llama.tokenizer)
    _assert_steady(name, rows, 2, after_alike=True)


def test_stacked_exact_rows_of_a_graph_ready_policy_keep_the_steady_state(llama):
    """The stacked exact layers (``methods/stacked.py``) of rows of different lengths whose policy is graph-ready
    (``StaticExactPolicy``: Quest with every layer a ``full_layers`` one): after the step that made the stack (and
    grew it: a fresh prefill's storage has no room), consecutive steps dispatch the same ops on the same shapes — the
    rows' slots and the positions advanced in place, no Python number in the ops — with no host sync. (An exact
    policy that is not graph-ready alone — full attention's, SnapKV's — is not with rows either: its rows are
    right-aligned and read up to their last slot, the launches of one row's step.)"""
    method = instantiate(sync_method_config("quest", {"full_layers": 2}), _convert_="all")
    rows = _row_steps(llama.model, method, llama.tokenizer, rows=3)
    _assert_steady("quest (every layer exact)", rows, 3)


@torch.no_grad()
def test_the_position_counter_is_advanced_in_place_and_refilled_after_a_jump(llama):
    """The decode step's position comes from one device tensor per cache, advanced by one in place between
    consecutive steps (no Python number in the op) and refilled after any other jump; clones own theirs."""
    method = instantiate(sync_method_config("h2o"), _convert_="all")
    from luka_bench.methods import hf

    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(1)).to(llama.model.device)
    dev = llama.model.device
    with hf.attach(llama.model, method, llama.tokenizer) as att:
        cache = att.new_cache()
        llama.model(input_ids=ids[:, :30], past_key_values=cache, use_cache=True)
        for t in range(30, 33):
            llama.model(input_ids=ids[:, t: t + 1], past_key_values=cache, use_cache=True)
        counter = cache.position_tensor(32, dev)
        assert counter.item() == 32
        other = cache.clone()
        llama.model(input_ids=ids[:, 33:34], past_key_values=cache, use_cache=True)
        assert cache.position_tensor(33, dev).item() == 33
        assert other.position_tensor(32, dev).item() == 32  # the clone's is its own
        assert cache.position_tensor(7, dev).item() == 7  # a jump refills
        for s in cache.stores:  # the held positions are the logical ones, each once
            pos = s.positions[0, 0]
            assert int(pos.max()) == 33 and len(set(pos.tolist())) == s.n


def test_riders_move_on_with_the_position_counter(llama):
    """``MethodCache.riding``: base + position as columns of the counter's own tensor — moved on by the step's one
    add (no op of their own), written again after a jump, kept right when the tensor runs out of columns and is made
    anew (a dead owner's columns given up then), each clone's its own."""
    from luka_bench.host_sync import sync_method_config as cfg
    from luka_bench.methods import hf

    dev = llama.model.device
    with hf.attach(llama.model, instantiate(cfg("full"), _convert_="all"), llama.tokenizer) as att:
        cache = att.new_cache()

    class Owner:
        pass
    a, b, gone = Owner(), Owner(), Owner()
    base_a = torch.tensor([[3, 100], [7, 200]], device=dev)
    base_b = torch.arange(5, device=dev)
    ra = cache.riding(a, "slot", base_a, 10)
    assert torch.equal(ra, base_a + 10)
    counter = cache.position_tensor(11, dev)
    assert counter.item() == 11 and torch.equal(ra, base_a + 11)  # the counter's add moved it
    with LaunchCounter() as lc:  # asked again in the same step: the same columns, no op
        again = cache.riding(a, "slot", base_a, 11)
    assert lc.total == 0 and again.data_ptr() == ra.data_ptr()
    cache.riding(gone, "slot", torch.zeros(40, dtype=torch.long, device=dev), 11)
    del gone  # its columns are given up when the tensor is made anew
    rb = cache.riding(b, "slot", base_b, 11)  # no free column: a new tensor, the live riders written again
    assert torch.equal(rb, base_b + 11) and torch.equal(cache.riding(a, "slot", base_a, 11), base_a + 11)
    assert cache.position_tensor(11, dev).item() == 11
    other = cache.clone()
    cache.position_tensor(12, dev)
    assert torch.equal(cache.riding(b, "slot", base_b, 12), base_b + 12)
    assert other.position_tensor(11, dev).item() == 11  # the clone's counter is its own
    assert torch.equal(other.riding(b, "slot", base_b, 11), base_b + 11)
    cache.position_tensor(4, dev)  # a jump: refilled, the riders written again when asked
    assert torch.equal(cache.riding(a, "slot", base_a, 4), base_a + 4)
    assert torch.equal(cache.riding(a, "leave", base_b, 4), base_b + 4)  # another tag: other columns
    new_base = base_a * 2  # a new layout of the same owner
    assert torch.equal(cache.riding(a, "slot", new_base, 4), new_base + 4)
