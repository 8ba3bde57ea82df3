"""Rows of different lengths decoding a layer as one (methods/stacked.py, issue 60): which layers are stacked, that
the rows' storage is one tensor with each row's store a view of its row, that a stacked row stays the row alone when
it is fed alone in between, cloned, grown past its room or released, and that the launches per layer at a ragged
batch are batch 1's for every config whose every layer is stacked. (That every config's rows equal the rows alone is
``tests/test_batch_rows.py``, which runs these layers stacked.)"""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from luka_bench.engine import forward, forward_rows
from luka_bench.host_sync import sync_method_config
from luka_bench.launches import decode_launch_counts, stock_launch_counts, summary
from luka_bench.methods.base import LayerInfo, LayerPolicy
from luka_bench.methods.hf import RowBatch, attach
from luka_bench.methods.policies import layer_policy
from luka_bench.methods.stacked import exact_decode, release_rows, stackable

from conftest import CONF, prefilled, tiny

pytestmark = pytest.mark.device  # LUKA_TEST_DEVICE=cuda runs them on the GPU (docs/gpu.md)

METHOD_CONFIGS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
# the configs whose decode step is exact attention over what they hold, on every layer (prefill-only methods)
EXACT = {"full", "snapkv", "pyramidkv", "knorm", "expected_attention", "finch", "adakv", "laser_kv", "laser_kv_exact",
         "laser_kv_magicpig", "laser_kv_mp25", "laser_kv_mp50"}
# of those, the ones whose layers are stacked in a batch: all (AdaKV's packed layers as the rows' packings,
# ``stacked_packed.py``)
STACKED = set(EXACT)
# the configs whose every layer drops at most one token per row per step (``stacked_evict``), stacked too
EVICTS = {"h2o", "luka_lined", "tova", "streaming_llm", "h2o_outer"}
# and the ones whose every layer reads a selection and drops nothing (``stacked_select``; their full_layers exact)
SELECTS = {"quest", "oracle_topk", "luka_clustered", "lychee", "clusterkv", "arkvale", "shadowkv"}
# the per-step configs whose ragged rows launch no more than one row (lychee: the row ids' and mask's recent part
# written once per step into buffers its layers share, ``lychee_stacked.RowTables.shared``; the head-wise ones: their
# packed layers' slots ride the positions' counter, their exact and bias layers' rows right-aligned; StreamingLLM: its
# layers' victims chosen once per step, ``test_stacked_streaming_layers_choose_their_victims_once_per_step``)
RAGGED_AS_ONE = {"lychee", "duo_attention", "razor_attention", "streaming_llm"}


@pytest.fixture(scope="module")
def lm64():
    lm = tiny("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    lm.model = lm.model.double()
    return lm


def method_of(name):
    return instantiate(sync_method_config(name), _convert_="all")


@pytest.mark.parametrize("name", METHOD_CONFIGS)
def test_exact_decode_is_what_each_policy_declares(name):
    """Every layer of the prefill-only configs; a method's exact ``full_layers`` and a composition's full layers
    (h2o_outer: H2O on the first and last layer, full attention between); no layer of a method deciding per step."""
    method = method_of(name)
    got = [exact_decode(layer_policy(method, LayerInfo(layer_idx=i, num_layers=4, num_heads=6, num_kv_heads=2,
                                                       head_dim=16, sliding_window=None,
                                                       layer_type="full_attention")))
           for i in range(4)]
    if name in EXACT:
        want = [True] * 4
    elif name == "h2o_outer":
        want = [False, True, True, False]
    else:
        want = [i < method.full_layers for i in range(4)]
    assert got == want, name


def test_a_subclass_that_decides_per_step_is_never_stacked():
    class Peeks(LayerPolicy):
        def after_step(self, store):
            pass

    class Declares(Peeks):
        exact_decode = True

    class Overrides(Declares):
        def step(self, store, query, scaling, step):
            return self.attend(store, query, scaling)

    info = LayerInfo(layer_idx=0, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=None,
                     layer_type="full_attention")
    method = method_of("full")
    assert exact_decode(LayerPolicy(method, info))
    assert not exact_decode(Peeks(method, info))  # a hook overridden below LayerPolicy's declaration
    assert exact_decode(Declares(method, info))  # declared again where it was overridden
    assert not exact_decode(Overrides(method, info))


@pytest.mark.parametrize("name", sorted(STACKED | EVICTS | SELECTS))
def test_a_ragged_batch_stacks_exactly_the_layers_every_row_decodes_exactly(name, lm64):
    model64 = lm64.model
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (230, 181, 140)]
    # ArkVale's test budget (12 pages of 16) is above two rows' lengths: rows that read every page and a row that
    # recalls are not stacked together (the rows' plans differ); 8 pages: every row recalls
    method = instantiate(sync_method_config(name, {"page_budget": 8} if name == "arkvale" else {}), _convert_="all")
    with attach(model64, method, lm64.tokenizer) as a, torch.no_grad():
        caches = prefilled(a, model64, prompts)
        for step in range(3):
            rows = RowBatch(caches)
            forward_rows(model64, [7 + step] * 3, caches)
        stack = caches[0]._row_stack
        want = [i for i in range(len(caches[0].stores)) if all(stackable(c.stores[i]) for c in caches)]
        assert sorted(stack.layers) == want
        layers = len(caches[0].stores)
        # every layer of a prefill-only method and AdaKV (its packed layers stacked as packings), of an evicting or
        # selecting method
        assert want == list(range(layers))

        def kv(store):
            return store.packed.kv if store.packed is not None else store._kv

        packed = {i for i, layer in stack.layers.items() if layer.mode == "packed"}
        assert not packed or name == "adakv"  # (here its heads hold the same counts: its window; the packed
        # layers' own tests are ``test_packed_rows_fed_alone_cloned_and_released_stay_the_rows_alone``)
        for i, layer in stack.layers.items():
            base = layer.kv.untyped_storage().data_ptr()
            assert all(kv(c.stores[i]).untyped_storage().data_ptr() == base for c in caches)  # one storage
            assert layer.kv.shape[1] == 3 and layer.kv.shape[3] >= max(c.stores[i].n for c in caches)
        assert rows.stack is stack
        release_rows(caches)
        assert caches[0]._row_stack is None
        ptrs = {kv(c.stores[i]).untyped_storage().data_ptr() for c in caches for i in want}
        assert len(ptrs) == len(caches) * len(want)  # each row's storage its own again
        for c in caches:
            for i in want:
                s = c.stores[i]
                if i in packed:  # its own packing's width again, as wide as its segments
                    p = s.packed
                    assert p.W == max(sum(p.cap[0][r * (p.H // p.R):(r + 1) * (p.H // p.R)]) for r in range(p.R))
                    continue
                mult = s.policy.storage_multiple  # its held tokens and its decode room, as alone (whole pages)
                assert s._kv.shape[3] <= -(-(s.n + s.declared_room()) // mult) * mult


@pytest.mark.parametrize("case", [("full", {}), ("h2o", {}), ("streaming_llm", {}),
                                  ("quest", {"token_budget": 48, "page_size": 8, "full_layers": 0})], ids=str)
def test_a_batch_whose_row_finished_goes_on_without_copying_its_rows_twice(case, lm64, monkeypatch):
    """A batch whose row finished is stacked again (``RowStack.for_rows`` -> ``RowStack(caches, letting_go)``, each old
    layer let go by ``let_go_layer`` as the new one is made): the rows going on
    keep viewing the old stack's storage until the new stack copies them into its own — no copy of their own in
    between (only the finished row gets one), and every old layer's storage is freed once the new stack holds them
    (before: each row copied out and back in, the stack and the copies side by side — the rows' keys and values once
    more at each row's finish, 827 MiB over the decode's start for 8 SmolLM2 rows of 1,789-2,048 tokens). A stack let go
    outright (``release_rows``) frees each layer's storage before the next layer's rows copy theirs. Each row still
    equals itself alone (``test_a_stacked_row_fed_alone_cloned_and_released_stays_the_row_alone``: rows 1 and 2 go on
    while row 0 steps alone)."""
    import gc
    import weakref

    from luka_bench.methods import stacked
    from luka_bench.methods.stacked import StackedLayer

    name, overrides = case
    method = instantiate(sync_method_config(name, overrides), _convert_="all")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (200, 163, 140)]
    model64 = lm64.model
    copied: list = []
    own = stacked.own_storage

    def counted(store, view, cap):
        copied.append(id(store))
        return own(store, view, cap)

    with attach(model64, method, lm64.tokenizer) as a, torch.no_grad():
        caches = prefilled(a, model64, prompts)
        for step in range(3):
            forward_rows(model64, [7 + step] * 3, caches)
        layers = caches[0]._row_stack.layers
        assert len(layers) == len(caches[0].stores)
        old = [weakref.ref(layer.kv) for layer in layers.values()]
        del layers
        monkeypatch.setattr(stacked, "own_storage", counted)
        forward_rows(model64, [9, 9], caches[:2])  # row 2 finished: rows 0 and 1 stacked again
        monkeypatch.setattr(stacked, "own_storage", own)
        assert sorted(copied) == sorted(id(s) for s in caches[2].stores)  # the finished row's copies only
        gc.collect()
        assert all(r() is None for r in old)  # every old layer's storage freed
        assert len(caches[0]._row_stack.layers) == len(caches[0].stores)

        let_go: list = []
        release = StackedLayer.release

        def watched(layer, *args):
            gc.collect()
            assert all(r() is None for r in let_go), "an earlier layer's stacked storage is still held"
            let_go.append(weakref.ref(layer.kv))
            release(layer, *args)

        monkeypatch.setattr(StackedLayer, "release", watched)
        release_rows(caches)
        assert len(let_go) == len(caches[0].stores)
        gc.collect()
        assert all(r() is None for r in let_go)


def kept(cache):
    """Per layer and KV head the held positions, sorted (slots leave time order after an eviction; a head-wise
    budget's unheld slots left out)."""
    out = []
    for s in cache.stores:
        pos, mask = s.positions, s.head_mask()
        out.append([sorted((pos[0, h][mask[0, h]] if mask is not None else pos[0, h]).tolist())
                    for h in range(pos.shape[1])])
    return out


# the configs stacked with evictions (``stacked_evict``), with the settings that change their step
EVICTING = [("h2o", {}), ("h2o", {"decay": 0.9}), ("luka_lined", {}), ("tova", {}), ("tova", {"protect_last": True}),
            ("tova", {"decode": False}), ("streaming_llm", {}), ("streaming_llm", {"sink": 0})]


# Quest reading a selection of pages (``stacked_select``): a budget below the rows' lengths, pages closing in each row
# at its own steps
SELECTING = [("quest", {"token_budget": 48, "page_size": 8, "full_layers": 0}),
             ("quest", {"token_budget": 64, "page_size": 16, "full_layers": 1}),
             ("oracle_topk", {"token_budget": 40}),
             ("luka_clustered", {"tail": 24, "compress_every": 4}),
             ("luka_clustered", {"tail": 24, "compress_every": 4, "compressor": "mean", "sink": 2,
                                 "summary_bias": "log_size"}),
             ("luka_clustered", {"tail": 24, "compress_every": 8,
                                 "refine": {"rule": "top_k", "k": 2, "mass": "parent"}}),
             # LycheeCluster retrieving (a budget below the rows' lengths; chunks closing in each row at its own
             # steps, each row's index lazily updated): structure-aware chunks (the tiny tokenizer's strings), fixed
             # pages with the coarse units' k_g and q.mu ranking, max pooling with a small coarse factor
             ("lychee", {"token_budget": 72, "sink": 4, "buffer": 16, "min_chunk": 4, "max_chunk": 8,
                         "full_layers": 1}),
             ("lychee", {"token_budget": 64, "sink": 2, "buffer": 12, "min_chunk": 6, "max_chunk": 6,
                         "chunking": "fixed", "k_g": 2, "ranking": "qmu", "full_layers": 0}),
             ("lychee", {"token_budget": 80, "sink": 4, "buffer": 20, "min_chunk": 3, "max_chunk": 9,
                         "pooling": "max", "coarse_factor": 1.3, "cluster_size": 3, "full_layers": 0}),
             # ClusterKV recalling clusters (each row clusters its own prompt at its first decode step, alone; the
             # rows' prompts and cluster counts differ: 150 clusters > the shortest row's 136 clustered tokens)
             ("clusterkv", {"token_budget": 48, "sink": 4, "clusters": 12, "iterations": 3, "full_layers": 0}),
             ("clusterkv", {"token_budget": 100, "sink": 0, "clusters": 150, "iterations": 2, "full_layers": 1}),
             # ArkVale recalling pages (each row's device set carried on in the stack, pages closing in each row at
             # its own steps); with a budget of 160 tokens the shortest row attends densely until it outgrows it
             # (the layer leaves the stack while the rows' plans differ; stacked again when the stack is remade)
             ("arkvale", {"page_size": 8, "page_budget": 8, "topk": 4, "sink_pages": 1, "window_pages": 2,
                          "full_layers": 0}),
             ("arkvale", {"page_size": 4, "page_budget": 12, "topk": 7, "sink_pages": 2, "window_pages": 3,
                          "group": "kv_head", "full_layers": 1}),
             ("arkvale", {"page_size": 8, "page_budget": 20, "topk": 6, "full_layers": 0}),
             # ShadowKV rebuilding its chosen chunks from the rows' factors (prompts of different lengths: their
             # landmarks, U and V0 of different sizes, one table each in the stack)
             ("shadowkv", {"token_budget": 32, "chunk": 8, "rank": 12, "local_chunks": 2, "outliers": 2}),
             ("shadowkv", {"token_budget": 48, "chunk": 4, "local_chunks": 1, "outliers": 3, "full_layers": 1})]


# entropy-OLS flushing at each row's own steps (bins of 8): in fp64 its stacked step is ``attention_with_extra``'s
# explicit pass over the rows (``entropy_ols_stacked._general``, what bfloat16 runs on a GPU), as a row alone there
FLUSHING = [("entropy_ols", {"bin_size": 8, "rank": 2}), ("entropy_ols", {"bin_size": 8, "rank": 2, "mode": "drop"})]


@pytest.mark.parametrize("case", [("full", {}), ("snapkv", {})] + EVICTING + SELECTING + FLUSHING, ids=str)
def test_a_stacked_row_fed_alone_cloned_and_released_stays_the_row_alone(case, lm64):
    """Rows decoded together; between batched steps row 0 takes a step alone (the stack dissolves and is made again),
    row 1 is cloned mid-decode and its clone goes on alone; many steps (the widest row's room runs out: the stack
    grows; an evicting method's rows reach their capacity growth at different steps, so some rows drop a token while
    others keep theirs; entropy-OLS's rows flush at their own steps). Every row's logits equal the same tokens through
    its cache alone (fp64, 1e-9), and so do the positions each row holds per layer and KV head."""
    name, overrides = case
    method = instantiate(sync_method_config(name, overrides), _convert_="all")
    want = {"evict"} if case in EVICTING else {"select"} if case in SELECTING + FLUSHING else {"exact"}
    rows_equal_alone(method, lm64, want, drops=case in FLUSHING)


def test_stacked_streaming_rows_keep_a_few_token_rows_token_within_its_sinks(lm64):
    """StreamingLLM's rows where one row's prompt is shorter than its sinks: that row keeps every token (its own slot
    within its sinks, where the other rows' victims are counted from) while the others drop one — each row as alone
    (its victims marked at its own slot read from slot 0: ``StreamingPolicy.stacked_victims``)."""
    method = instantiate(sync_method_config("streaming_llm", {"sink": 4}), _convert_="all")
    rows_equal_alone(method, lm64, {"evict"}, lengths=(200, 163, 3))


def test_stacked_streaming_layers_choose_their_victims_once_per_step(lm64):
    """StreamingLLM keeps the same tokens in every layer: the layers stacked from positions the host knows alike
    (``stacked.same_tokens_lineage``: each row's prompt kept as its sinks and window) share one lineage and choose a
    step's victims with one argmin for all of them — also after a row leaves the batch (the others stacked again from
    what the stack left them); a row that took a step alone holds a table the host does not know, and the layers of
    its next stack choose their own. Every layer holds what every other does, slot for slot, and every row's logits
    equal its tokens through its cache alone (fp64, 1e-9)."""
    from luka_bench.launches import LaunchCounter

    method = instantiate(sync_method_config("streaming_llm"), _convert_="all")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (200, 163, 140)]
    toks = torch.randint(0, 256, (3, 40), generator=g).tolist()
    model64 = lm64.model
    fed: list[list[int]] = [[], [], []]
    got: list[list[torch.Tensor]] = [[], [], []]

    def step(rows):
        with LaunchCounter() as c:
            out = forward_rows(model64, [toks[r][len(fed[r])] for r in rows], [caches[r] for r in rows])
        for i, r in enumerate(rows):
            got[r].append(out[i])
            fed[r].append(toks[r][len(fed[r])])
        layers = caches[rows[0]]._row_stack.layers
        lineages = {layer.lineage for layer in layers.values()}
        return c.ops["argmin"], lineages, len(layers)

    def same_positions(rows):
        for r in rows:
            first = caches[r].stores[0].positions
            assert all(torch.equal(s.positions, first) for s in caches[r].stores), r

    with attach(model64, method, lm64.tokenizer) as a, torch.no_grad():
        caches = prefilled(a, model64, prompts)
        for _ in range(12):  # stacked from the prefill's descriptions: one lineage, one argmin a step (or none)
            argmins, lineages, layers = step([0, 1, 2])
            assert len(lineages) == 1 and None not in lineages and argmins <= 1 and layers == 3
        same_positions([0, 1, 2])
        for _ in range(10):  # row 0 leaves: rows 1 and 2 stacked again from what the stack left them
            argmins, lineages, _ = step([1, 2])
            assert len(lineages) == 1 and None not in lineages and argmins <= 1
        got[0].append(forward(model64, [toks[0][len(fed[0])]], caches[0]))  # row 0 alone for a step
        fed[0].append(toks[0][len(fed[0])])
        counts = [step([0, 1, 2]) for _ in range(10)]
        assert all(lineages == {None} for _, lineages, _ in counts)  # its table not known: each layer its own
        assert max(argmins for argmins, _, _ in counts) == 3
        same_positions([0, 1, 2])
        release_rows(caches)
        for r in range(3):
            alone = prefilled(a, model64, [prompts[r]])[0]
            want = torch.stack([forward(model64, [x], alone) for x in fed[r]])
            torch.testing.assert_close(torch.stack(got[r]).view(len(fed[r]), -1), want.view(len(fed[r]), -1),
                                       rtol=0, atol=1e-9)


FP32 = [c for c in EVICTING + SELECTING if c[0] in ("h2o", "tova", "streaming_llm")] + \
    [next(c for c in SELECTING if c[0] == n) for n in ("quest", "luka_clustered", "shadowkv", "oracle_topk")] + \
    [("entropy_ols", {"bin_size": 8, "rank": 2}),  # its float32 fast path stacked: flushes at each row's steps
     ("entropy_ols", {"bin_size": 8, "rank": 2, "mode": "drop", "n_ref": 4}),
     ("entropy_ols", {"budget": 1.0})]  # nothing flushed, no reference queries kept


@pytest.mark.parametrize("case", FP32, ids=str)
def test_stacked_rows_in_float32_keep_what_each_row_keeps_alone(case):
    """The test above in float32, where the stacked steps take their own fast paths (the rows' mask as a GEMM's input,
    ShadowKV's landmark scores in one GEMM, LuKA's importance in cover coordinates): logits within 1e-6 (a row alone
    and in a stack differ in float32's last bits, full attention's too) and every row holds, per layer and KV head,
    the positions it holds alone."""
    name, overrides = case
    method = instantiate(sync_method_config(name, overrides), _convert_="all")
    lm = tiny("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    rows_equal_alone(method, lm, {"evict"} if case in EVICTING else {"select"}, atol=1e-6,
                     drops=name == "entropy_ols" and method.budget < 1)


def rows_equal_alone(method, lm64, want: set[str], atol: float = 1e-9, drops: bool = False,
                     lengths: tuple[int, ...] = (200, 163, 140)) -> None:
    """The test above for ``method``, whose stacked layers at step 30 are of the kinds ``want`` (and "exact");
    ``drops``: a selecting layer whose rows drop tokens in their own ``after_step`` (entropy_ols's flushes);
    ``lengths``: the three rows' prompts."""
    g = torch.Generator().manual_seed(2)
    # every row holds at least 16 tokens: over fewer, torch's CPU softmax takes its scalar path, whose exp differs
    # from the vector path's in the last float32 bit (a row alone and the same row in a wider stack, ~1e-7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    toks = torch.randint(0, 256, (3, 40), generator=g).tolist()
    model64 = lm64.model
    with attach(model64, method, lm64.tokenizer) as a, torch.no_grad():
        solo, solo_kept = [], []
        for p, t in zip(prompts, toks):
            c = prefilled(a, model64, [p])[0]
            solo.append(torch.stack([forward(model64, [x], c) for x in t]))
            solo_kept.append(kept(c))
        caches = prefilled(a, model64, prompts)
        held = [c.stores[0].n for c in caches]
        got = [[] for _ in range(3)]
        clone = clone_out = None
        for j in range(40):
            if j == 12:  # row 0 alone for one step
                got[0].append(forward(model64, [toks[0][j]], caches[0]))
                rows = [1, 2]
            else:
                rows = [0, 1, 2]
            if j == 20:
                clone = caches[1].clone()
                clone_out = [forward(model64, [x], clone) for x in toks[1][j: j + 5]]
            out = forward_rows(model64, [toks[r][j] for r in rows], [caches[r] for r in rows])
            for i, r in enumerate(rows):
                got[r].append(out[i])
            if j == 30:
                modes = {layer.mode for layer in caches[0]._row_stack.layers.values()}
                assert modes - {"exact"} == want - {"exact"} and len(caches[0]._row_stack.layers) == 3, modes
        release_rows(caches)
        for r in range(3):
            torch.testing.assert_close(torch.stack(got[r]).view(40, -1), solo[r].view(40, -1), rtol=0, atol=atol)
        torch.testing.assert_close(torch.stack(clone_out).view(5, -1), solo[1].view(40, -1)[20:25], rtol=0,
                                   atol=atol)
        assert [c.stores[0].seen for c in caches] == [n + 40 for n in lengths]
        assert [kept(c) for c in caches] == solo_kept
        if not want & {"evict", "packed"} and not drops:  # nothing dropped
            assert [c.stores[0].n - n0 for c, n0 in zip(caches, held)] == [40, 40, 40]


@pytest.mark.parametrize("name", sorted(STACKED | EVICTS | SELECTS | RAGGED_AS_ONE))
def test_a_ragged_batch_launches_what_one_row_does_where_every_layer_is_stacked(name):
    """Per step, 8 rows of different lengths launch what one row does where every layer decodes exactly (the rows
    right-aligned: one slot for all, written by a copy and read up to by a view, as one row's); an
    evicting config's launches do not grow with the rows (8 rows against 2: at most the ops of a step where some
    rows drop a token and others keep theirs — the victims keep such a row's token in its own slot by themselves
    (``LayerPolicy.stacked_victims``; TOVA by one write of its marks at the step's slots); the slots of the rows
    that moved on, one add and one opening of the mask per step for the layers of a layout (rows that all stay, 2
    rows at their capacity, need neither); and TOVA's exact attention beside its weights and the ``where`` between
    them)."""
    lm = tiny("llama", num_hidden_layers=4)
    method = method_of(name)
    stock = stock_launch_counts(lm.model, 400, 24)
    one = summary(decode_launch_counts(lm.model, method, 400, 24, tokenizer=lm.tokenizer), stock, 4)

    def ragged(b):
        rows = decode_launch_counts(lm.model, method, 400, 24, tokenizer=lm.tokenizer, batch=b, ragged=True)
        return summary(rows, stock_launch_counts(lm.model, 400, 24, batch=b), 4)["extra"]

    many = ragged(8)
    if name in STACKED:
        assert many <= one["extra"], (one, many)
    elif name in RAGGED_AS_ONE:
        assert many <= one["extra"], (name, one, many)
    else:
        # (H2O's, TOVA's and StreamingLLM's victims keep a keeping row's token in its own slot: a `where` more fails
        # this for H2O)
        allowed = {"tova": 2.75}.get(name, 0.5 if name in EVICTS else 1.5)
        assert many - ragged(2) <= allowed, (name, many)
    if name == "luka_clustered":
        # over one row: each row's pages masked over the cover (an add) and their indices from the cover's slots (a
        # sub), the step's writes by index; its softmax reads each row's entries as alone with no gather (the covers
        # right-aligned: 1 more, two gathers, when they were left-aligned)
        assert many - one["extra"] <= 2.25, (one, many)


def test_stacked_quest_never_reads_a_page_a_row_does_not_hold(monkeypatch, lm64):
    """The stacked boxes are as wide as the widest row's storage: a row's pages from its last on are empty boxes,
    scored 0 by the bound. With the bound reversed (``-bound - 1``: a real page now scores below an empty one) the
    rows still equal the rows alone — the empty pages are never chosen (their -inf), as alone, where they do not
    exist."""
    import luka_bench.methods.quest as Q

    bound = Q.page_bound
    monkeypatch.setattr(Q, "page_bound", lambda q, hi, lo, start=None: -bound(q, hi, lo) - 1.0 + (
        0.0 if start is None else start))  # (the pages past a row's own: -inf, the stack's ``start``)
    test_a_stacked_row_fed_alone_cloned_and_released_stays_the_row_alone(SELECTING[0], lm64)


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "gathered"])
def test_stacked_quest_reads_its_pages_in_place_or_gathered_as_alone(monkeypatch, lm64, in_place):
    """Both ways of reading a stacked step's pages (``quest.reads_in_place`` forced, alone and stacked alike): one
    SDPA over the stacked storage with the pages a query head does not read masked (and each row's free slots), or
    the pages gathered into a copy; each row equals the row alone."""
    import luka_bench.methods.quest as Q

    monkeypatch.setattr(Q, "reads_in_place", lambda *a: in_place)
    test_a_stacked_row_fed_alone_cloned_and_released_stays_the_row_alone(SELECTING[1 if in_place else 0], lm64)


from luka_bench.methods.adakv import AdaKV  # noqa: E402


def packed_methods(tmp_path, layers: int = 3, kv_heads: int = 2) -> dict:
    """Every layer mixed (``test_packed_heads.methods``): one streaming / compressed head, the other a retrieval
    head; AdaKV's per-head budgets."""
    from test_packed_heads import methods

    return methods(tmp_path, layers, kv_heads)


@pytest.mark.parametrize("name", ["adakv", "adakv_classic_row", "duo_attention", "razor_attention"])
def test_packed_rows_fed_alone_cloned_and_released_stay_the_rows_alone(name, lm64, tmp_path):
    """Head-wise budgets packed per head (``packed.py``) and rows of different lengths decoded stacked
    (``stacked_packed.py``): every layer stacked, each row's logits, held positions per layer and head equal the row
    alone (fed alone between batched steps, cloned, its segments' room running out at its own step: packed again and
    the rows stacked anew, released). AdaKV at a budget where every row's heads hold different counts in every
    layer, and at one where a row's heads hold the same count in a layer (its store classic) whose other rows are
    packed: it joins them as a packing of equal segments."""
    if name.startswith("adakv"):
        method = AdaKV(budget=0.5 if name == "adakv" else 0.4, window=8)
    else:
        method = packed_methods(tmp_path)[name]
    rows_equal_alone(method, lm64, {"packed"})


def test_head_wise_layers_of_every_kind_stack_and_stay_the_rows_alone(lm64, tmp_path):
    """A layer of each kind DuoAttention and RazorAttention make: mixed (packed: ``stacked_packed.py``), every head
    streaming (DuoAttention: StreamingLLM's eviction, *evict*) or none a retrieval head (RazorAttention: its tokens
    dropped alike and the compensation token's bias, *select*), every head full or a retrieval head (*exact*, the
    policy's ``decodes_exactly``). Every layer stacked, each row equal to the row alone."""
    from test_packed_heads import razor_heads, write_pattern

    from luka_bench.methods.duo_attention import DuoAttention
    from luka_bench.methods.razor_attention import RazorAttention

    duo = DuoAttention(pattern_path=str(write_pattern(tmp_path / "duo", [[0.1, 0.9], [0.1, 0.1], [0.9, 0.9]])),
                       head_compression_ratio=0.5, sink=4, recent=16)
    rows_equal_alone(duo, lm64, {"packed", "evict", "exact"})
    razor = RazorAttention(heads_file=razor_heads(tmp_path / "razor.json", [(0, 1), (2, 0), (2, 1)]), sink=4,
                           local=24, compression_ratio=0, heads_cache=None)
    rows_equal_alone(razor, lm64, {"packed", "select", "exact"})


def test_entropy_ols_rows_stay_stacked_through_each_rows_flush():
    """entropy-OLS's rows (float32: its stacked step, ``methods/entropy_ols_stacked.py``) flush at their own steps in
    their own ``after_step``; the stack seats such a row again (``StackedLayer.reseat``) instead of making a new
    stack for every row: one stack through every flush, every layer stacked at every step, and a steady step (no
    flush) launches one row's step plus one multiply per layer (each row's own entropy normalisation)."""
    lm = tiny("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    method = instantiate(sync_method_config("entropy_ols", {"bin_size": 8, "rank": 2}), _convert_="all")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (180, 151, 122)]
    with attach(lm.model, method, lm.tokenizer) as a, torch.no_grad():
        caches = prefilled(a, lm.model, prompts)
        flushes = lambda: sum(s.policy.stats["flushes"] for c in caches for s in c.stores)  # noqa: E731
        before, stacks = flushes(), set()
        for j in range(24):
            forward_rows(lm.model, [int(x) for x in torch.randint(0, 256, (3,), generator=g)], caches)
            stack = caches[0]._row_stack
            stacks.add(stack)  # (the objects, not their ids: a freed stack's id may be reused)
            assert {layer.mode for layer in stack.layers.values()} == {"select"} and len(stack.layers) == 3
        assert flushes() - before >= 6 and len(stacks) == 1, (flushes() - before, len(stacks))
        release_rows(caches)
    one = summary(decode_launch_counts(lm.model, method, 400, 24, tokenizer=lm.tokenizer),
                  stock_launch_counts(lm.model, 400, 24), 3)["extra"]
    rows = decode_launch_counts(lm.model, method, 400, 24, tokenizer=lm.tokenizer, batch=2, ragged=True)
    assert summary(rows, stock_launch_counts(lm.model, 400, 24, batch=2), 3)["extra"] <= one + 1, rows


def test_a_layouts_mask_read_late_is_the_mask_kept_every_step():
    """``_Layout.mask`` is opened only when a layer reads it (LuKA's layers attend over their covers' masks: the
    layout costs them no op): read after one step it opens the step's slots (one op), read after steps nobody read it
    is remade from the slots — either way the mask a layout opened at every step, rows moving on or staying."""
    from luka_bench.methods.stacked import _Layout

    ns, cap, heads = [5, 9, 2, 7], 16, 3
    every, late = (_Layout(ns, cap, heads, torch.float64, torch.device("cpu")) for _ in range(2))
    every.advance(ns, 0, None)
    late.advance(ns, 0, None)
    assert late._due == 1
    torch.testing.assert_close(every.mask, late.mask, rtol=0, atol=0)  # the one-step path
    g = torch.Generator().manual_seed(3)
    for at in range(1, 6):
        delta = torch.randint(0, 2, (len(ns),), generator=g).tolist()
        ns = [n + d for n, d in zip(ns, delta)]
        for lay in (every, late):
            lay.advance(ns, at, torch.tensor(delta))
        every.mask  # noqa: B018 - read at every step, as a layer attending over it
    assert late._due == 5
    want = torch.where(torch.arange(cap) <= torch.tensor(ns)[:, None], 0.0, float("-inf")).double()
    for lay in (every, late):
        torch.testing.assert_close(lay.mask, want[:, None, None, :].expand(len(ns), heads, 1, cap), rtol=0, atol=0)
    assert late._due == 0
