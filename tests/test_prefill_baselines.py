"""The LASER-KV paper's prefill baselines on the scorer base (issue 49): PyramidKV's per-layer capacities, AdaKV's
per-head budgets, FINCH's question window with re-rotated keys; each against its paper's invariants."""
from __future__ import annotations

import math

import pytest
import torch

from luka_bench.methods.adakv import AdaKV, head_counts
from luka_bench.methods.base import MethodConfigError
from luka_bench.methods.finch import Finch
from luka_bench.methods.full import Full
from luka_bench.methods.pyramidkv import PyramidKV, layer_capacity
from luka_bench.methods.snapkv import SnapKV, pool_scores, window_scores

from test_method_contract import ids_of, kept_positions, prefill
from test_methods_core import method_logits


# -- PyramidKV ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,budget,window,layers", [(8192, 0.125, 64, 30), (4096, 0.05, 8, 32), (2000, 0.3, 64, 24),
                                                    (700, 0.2, 16, 3)])
def test_pyramid_capacities_sum_to_the_uniform_total_and_fall_with_depth(n, budget, window, layers):
    cap = math.ceil(budget * n)
    caps = [layer_capacity("paper", n, cap, budget, window, 20, layer, layers) for layer in range(layers)]
    assert all(a >= b for a, b in zip(caps, caps[1:])), caps
    assert caps[0] > caps[-1]
    # the reference's integer step rounds down: the sum is never below the uniform total, and above it by less
    # than one step's rounding per layer pair
    assert layers * cap <= sum(caps) <= layers * cap + layers * (layers - 1) // 2, (sum(caps), layers * cap)
    # the last layer keeps about (B - w) / beta scored tokens (the integer step leaves up to L - 1 more)
    lo = (cap - window) // 20 if caps[0] - window < n - window else 2 * (cap - window) - (n - window)
    assert lo <= caps[-1] - window < lo + layers
    kv = [layer_capacity("kvpress", n, cap, budget, window, 20, layer, layers) for layer in range(layers)]
    assert all(a >= b for a, b in zip(kv, kv[1:]))
    assert abs(sum(kv) / layers - n * budget) <= 0.5  # kvpress's own test: the mean is the budget (rounding apart)


def test_pyramid_fallbacks_are_the_references():
    # a context under the capacity: nothing to compress; under 2 (B - w): uniform SnapKV
    assert layer_capacity("paper", 100, 120, 0.9, 8, 20, 0, 4) == 120
    assert {layer_capacity("paper", 100, 60, 0.6, 8, 20, layer, 4) for layer in range(4)} == {60}
    # kvpress: uniform unless context >= max >= min >= window (roughly beta * window tokens kept per layer)
    assert {layer_capacity("kvpress", 4096, 512, 0.125, 64, 20, layer, 30) for layer in range(30)} == {512}
    assert len({layer_capacity("kvpress", 65536, 8192, 0.125, 64, 20, layer, 30) for layer in range(30)}) > 1


def test_pyramidkv_keeps_its_layer_capacities_with_snapkv_scores(tiny_llama):
    ids = ids_of(160, 1)
    m = PyramidKV(budget=0.25, window=8, beta=4)
    cache, _ = prefill(tiny_llama.model, m, ids)
    want = [layer_capacity("paper", 160, 40, 0.25, 8, 4, layer, 3) for layer in range(3)]
    assert [s.n for s in cache.stores] == want and want[0] > want[-1]
    # the window is kept by every layer and head
    for layer in kept_positions(cache):
        for head in layer:
            assert set(range(152, 160)) <= set(head)


def test_pyramidkv_at_beta_one_is_snapkv(tiny_gqa3):
    ids = ids_of(150, 2)
    a, _ = prefill(tiny_gqa3.model, PyramidKV(budget=0.3, window=8, beta=1), ids)
    b, _ = prefill(tiny_gqa3.model, SnapKV(budget=0.3, window=8), ids)
    assert kept_positions(a) == kept_positions(b)


def test_pyramidkv_with_the_whole_budget_equals_full(tiny_llama):
    ids = ids_of(80, 4)
    ref, _ = method_logits(tiny_llama.model, Full(), ids, 60)
    got, c = method_logits(tiny_llama.model, PyramidKV(budget=1.0, window=8), ids, 60)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("bad", [{"beta": 0.5}, {"beta": "x"}, {"budget_rule": "steep"}])
def test_pyramidkv_bad_settings_are_one_line_errors(bad):
    with pytest.raises(MethodConfigError) as e:
        PyramidKV(**bad)
    assert "\n" not in str(e.value) and str(next(iter(bad.values()))) in str(e.value)


# -- AdaKV ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["paper", "kvpress"])
@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5])
def test_adakv_head_budgets_sum_to_the_layers_and_respect_the_floor(rule, alpha):
    g = torch.Generator().manual_seed(3)
    h, m, room, window = 8, 300, 40, 16
    scores = torch.rand(2, h, m, generator=g) ** torch.linspace(1, 8, h)[None, :, None]  # heads of unequal spread
    n = head_counts(scores, room, alpha, rule, window)
    total = n.sum(-1)
    if rule == "paper":
        assert ((total - h * room).abs() <= h / 2).all(), total
        assert (n >= round(int(room * alpha) * 1.0) - 0.5).all() if alpha else True
    else:
        assert (total == h * room).all(), total
        floor = max(0, max(1, int((room + window) * alpha)) - window) if alpha else 0
        assert (n >= floor).all()
    if alpha < 1:
        assert (n != room).any()  # the budget moved between heads


def test_adakv_at_alpha_one_is_snapkv(tiny_gqa3):
    ids = ids_of(150, 5)
    kw = dict(budget=0.3, window=8, kernel=5, pooling="max")
    for rule in ("paper", "kvpress"):
        a, _ = prefill(tiny_gqa3.model, AdaKV(alpha=1.0, rule=rule, **kw), ids)
        b, _ = prefill(tiny_gqa3.model, SnapKV(**kw), ids)
        assert kept_positions(a) == kept_positions(b), rule


def _scores_before(cache):
    """Each layer's pooled SnapKV scores of its non-window tokens, from the uncompressed cache."""
    out = []
    for s in cache.stores:
        p, m = s.policy.inner, s.policy.method  # AdaKV: the scores are its inner SnapKV policy's
        sc = window_scores(p.q_window, s.keys, p.scaling)[:, :, : s.n - m.window]
        out.append(pool_scores(sc, m.kernel, m.pooling)[0])
    return out


@pytest.mark.parametrize("rule", ["paper", "kvpress"])
def test_adakv_heads_keep_their_own_top_tokens_and_memory_counts_them(tiny_gqa3, rule):
    ids = ids_of(200, 6)
    m = AdaKV(budget=0.2, window=8, alpha=0.2, rule=rule)
    cache, before = prefill(tiny_gqa3.model, m, ids, before_compression=_scores_before)
    cap = math.ceil(0.2 * 200)
    differ = False
    for store, sc in zip(cache.stores, before):
        held = store.head_mask()[0] if store.head_mask() is not None else torch.ones_like(store.positions[0], dtype=bool)
        counts = held.sum(-1)
        want = 8 + head_counts(sc[None], cap - 8, 0.2, rule, 8)[0]
        assert counts.tolist() == want.tolist()
        differ |= len(set(counts.tolist())) > 1
        for h in range(sc.shape[0]):
            got = sorted(store.positions[0, h][held[h]].tolist())
            k = int(counts[h]) - 8
            top = torch.sort(sc[h], descending=True, stable=True).indices[:k].tolist()
            assert got == sorted(top + list(range(192, 200))), (h, rule)
        # memory counts what each head holds, not the padded width
        assert store.held_per_head() == pytest.approx(counts.float().mean().item())
    assert differ  # head-wise budgets in play


def test_adakv_with_the_whole_budget_equals_full(tiny_llama):
    ids = ids_of(80, 7)
    ref, _ = method_logits(tiny_llama.model, Full(), ids, 60)
    got, _ = method_logits(tiny_llama.model, AdaKV(budget=1.0), ids, 60)
    assert torch.equal(got, ref)


def test_adakv_changes_the_logits_when_it_drops(tiny_gqa3):
    ids = ids_of(120, 8)
    ref, _ = method_logits(tiny_gqa3.model, Full(), ids, 100)
    got, _ = method_logits(tiny_gqa3.model, AdaKV(budget=0.25, window=8), ids, 100)
    assert not torch.allclose(got[:, 95:], ref[:, 95:], atol=1e-3)


@pytest.mark.parametrize("bad", [{"alpha": 1.5}, {"alpha": -0.1}, {"rule": "fair"}])
def test_adakv_bad_settings_are_one_line_errors(bad):
    with pytest.raises(MethodConfigError) as e:
        AdaKV(**bad)
    assert "\n" not in str(e.value) and str(next(iter(bad.values()))) in str(e.value)


# -- FINCH ----------------------------------------------------------------------------------------------------

def _finch_prefill(model, method, ids, span, before=None):
    return prefill(model, method, ids, before_compression=before, question_span=span)


def _finch_reference(cache):
    """Each layer's FINCH scores from the uncompressed cache, written out from the definition: per query head h of
    KV head h // g, each question query (position p) attends causally over the keys; its row is multiplied by p; sum
    over queries and over the group's heads."""
    out = []
    for s in cache.stores:
        q, k = s.policy.q_window[0].double(), s.keys[0].double()  # [Hq, w, D], [Hkv, n, D]: the question's
        hq, w, _ = q.shape
        n, g = k.shape[1], hq // k.shape[0]
        sc = torch.zeros(k.shape[0], n, dtype=torch.double)
        for h in range(hq):
            for i in range(w):
                p = n - w + i
                a = torch.softmax((k[h // g, : p + 1] @ q[h, i]) * s.policy.scaling, dim=0)
                sc[h // g, : p + 1] += a * p
        out.append(sc)
    return out


@pytest.mark.parametrize("chunk", [0, 40])
def test_finch_keeps_the_question_and_the_best_scored_context(tiny_gqa3, chunk):
    ids, span = ids_of(130, 9), 12
    m = Finch(budget=0.25, chunk=chunk, rerotate=False)
    cache, ref = _finch_prefill(tiny_gqa3.model, m, ids, span, before=_finch_reference)
    for store, sc in zip(cache.stores, ref):
        for h in range(sc.shape[0]):
            got = sorted(store.positions[0, h].tolist())
            s = sc[h].clone()
            s[130 - span:] = float("inf")
            want = []
            for a in range(0, 130, chunk or 130):
                c = min(chunk or 130, 130 - a)
                keep = max(math.ceil(0.25 * c - 1e-9), sum(1 for t in range(a, a + c) if t >= 130 - span))
                want += (a + torch.sort(s[a: a + c], descending=True, stable=True).indices[:keep]).tolist()
            assert got == sorted(want), (h, chunk)
            assert set(range(130 - span, 130)) <= set(got)


def test_finch_rerotates_kept_keys_to_consecutive_positions(tiny_llama):
    """Layer 0's keys depend only on the token and its position: after the re-rotation each kept key equals the key
    a fresh prefill of the kept tokens alone gives at its new position; the next token takes position kept."""
    from luka_bench.methods.hf import attach

    model = tiny_llama.model
    ids, span = ids_of(100, 10), 10
    cache, _ = _finch_prefill(model, Finch(budget=0.3), ids, span)
    store = cache.stores[0]
    assert store.get_seq_length() == store.n == 30
    for h in range(store.keys.shape[1]):
        kept = store.positions[0, h].sort().values
        with attach(model, Full()) as a, torch.no_grad():
            c = a.new_cache()
            model(ids[:, kept], past_key_values=c)
        assert torch.allclose(store.keys[0, h], c.stores[0].keys[0, h], atol=2e-5), h


def test_finch_with_the_whole_budget_equals_full(tiny_llama):
    ids, span = ids_of(70, 11), 8
    a, _ = _finch_prefill(tiny_llama.model, Finch(budget=1.0), ids, span)
    assert all(s.n == 70 and s.pos_shift == 0 for s in a.stores)


def test_finch_without_the_question_in_the_prompt_is_a_one_line_error(tiny_llama):
    with pytest.raises(MethodConfigError) as e:
        _finch_prefill(tiny_llama.model, Finch(), ids_of(50, 1), 0)
    assert "query_aware=true" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [{"chunk": -1}, {"normalize": "yes"}, {"full_layers": 2}])
def test_finch_bad_settings_are_one_line_errors(bad):
    with pytest.raises(MethodConfigError) as e:
        Finch(**bad)
    assert "\n" not in str(e.value) and str(next(iter(bad.values()))) in str(e.value)


def test_finch_windows_the_question_under_the_query_aware_protocol(tiny_llama, monkeypatch, one_thread):
    """``answer_example(query_aware=True)`` (the runner's) and ``KV.generate(..., query_aware=True)`` (the library's):
    FINCH's window is the question's tokens — the prefill's last ``len(question) - tail`` — and it keeps them."""
    import luka_bench as lb
    from luka_bench import engine as E
    from luka_bench.methods.finch import FinchPolicy

    from test_tail_rule import _plan, _prompt

    spans = []
    real = FinchPolicy.after_prefill
    monkeypatch.setattr(FinchPolicy, "after_prefill", lambda self, store: spans.append(
        (store.cache.question_span, store.n)) or real(self, store))
    ctx, q = _prompt(5, 200), _prompt(6, 14)
    plan, qp = _plan(ctx, q, 4)
    with lb.attach(tiny_llama.model, lb.method("finch", budget=0.2)) as kv:
        got = next(E.answer_example(tiny_llama, kv.attached, plan, [qp], set(), (), query_aware=True))
    assert spans[0] == (10, 210) and got.generation.tail_tokens == 4
    assert all(set(range(200, 210)) <= set(s.positions[0, 0].tolist()) for s in got.cache.stores)
    spans.clear()
    with lb.attach(tiny_llama.model, lb.method("finch", budget=0.25), tiny_llama.tokenizer, chat_template=False) as kv:
        ans = kv.generate("x" * 300, question="\nQuestion: what is it?", answer_prefix="\nAnswer:", max_new_tokens=2,
                          query_aware=True)
    n_prefix = len(tiny_llama.tokenizer("\nAnswer:", add_special_tokens=False).input_ids)
    assert spans[0][0] == ans.question_tokens - n_prefix > 0


# -- the LASER-KV paper's tables as experiments ---------------------------------------------------------------

def test_laser_budget_is_laser_kvs_held_fraction():
    from luka_bench.methods.laser_kv import held_tokens
    from luka_bench.config import laser_equal_budget

    for length, block in (("16k", 4096), ("64k", 4096), ("2k", 512)):
        n = int(length[:-1]) * 1000 - 300
        assert laser_equal_budget(length, block) == pytest.approx(held_tokens(n, block, 0.25, 4) / n, abs=1e-6)
    assert 0.1 < laser_equal_budget("16k", 4096) < 0.3
    with pytest.raises(ValueError, match="allowed: 1k"):
        laser_equal_budget("sixteen", 4096)


@pytest.mark.parametrize("table,rows", [("laser_table1", ["full", "finch", "pyramidkv", "snapkv", "exact",
                                                          "magicpig", "mp25", "mp50", "laser_kv"]),
                                        ("laser_table2", ["full", "finch_4k", "pyramidkv", "snapkv", "laser_kv"])])
def test_laser_experiments_compose_every_row(table, rows):
    """Every row of both tables composes into its method, BABILong QA1/2/3/5/6, the paper's model; baselines hold
    LASER-KV's fraction and compress the question with the context; the LASER-KV rows keep the paper's S."""
    import yaml

    from luka_bench import config
    from luka_bench.config import build
    from luka_bench.config import laser_equal_budget

    exp = yaml.safe_load((config.CONF_DIR / "experiment" / f"{table}.yaml").read_text())
    assert exp["hydra"]["sweeper"]["params"]["+laser_row"].split(",") == rows
    for row in rows:
        cfg = config.compose([f"+experiment={table}", f"+laser_row={row}", "data.length=16k"], run_names=True)
        m = build(cfg, "method")
        assert cfg.model.name == "llama31_8b_instruct" and cfg.data.task == "qa1,qa2,qa3,qa5,qa6"
        assert cfg.laser_row == row
        if row in ("snapkv", "pyramidkv", "finch", "finch_4k"):
            assert m.budget == laser_equal_budget("16k", 4096) and cfg.query_aware is True
        elif row != "full":
            assert m.name == "laser_kv" and m.block_size == 4096 and m.budget == 0.25
    assert build(config.compose([f"+experiment={table}", f"+laser_row={rows[1]}", "data.length=16k"],
                                run_names=True), "method").chunk == (1024 if table == "laser_table1" else 4096)


def test_laser_tables_reads_a_sweep(tmp_path):
    import luka_bench.run as R
    from luka_bench import config
    from luka_bench.laser_tables import table

    for row in ("full", "snapkv"):
        cfg = config.compose(["+experiment=laser_table1", f"+laser_row={row}", "model=tiny_llama", "data.length=1k",
                              "data.source=synthetic", "data.task=[qa1,qa2]", "data.limit=1", "laser_block=256",
                              "max_new_tokens=2", "progress=false"], run_names=True)
        R.run(cfg, tmp_path / "sweep" / row)
    text = table(tmp_path / "sweep", 1)
    lines = [x for x in text.splitlines() if x.startswith("| ")]
    assert lines[1].startswith("| Full Attention |") and lines[2].startswith("| SnapKV |")
    assert "(n=1)" in lines[1] and lines[1].count(" - ") == 3  # qa3, qa5, qa6 not run
    assert "58 / 19 / 33 / 90 / 68" in lines[1]  # the paper's row beside, for the layout
