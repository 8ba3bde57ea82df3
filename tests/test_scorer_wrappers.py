"""Budget allocation over any scorer (issue 59), as kvpress composes ``AdaKVPress(press)`` / ``PyramidKVPress``: AdaKV's
head-wise budgets and PyramidKV's layer budgets wrap KNorm or ExpectedAttention as they wrap SnapKV; the scorer base
hands every score its observation (no policy keeps queries in its own ``attend``)."""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from luka_bench.methods.adakv import AdaKV, head_counts
from luka_bench.methods.base import MethodConfigError
from luka_bench.methods.expected_attention import ExpectedAttention
from luka_bench.methods.full import Full
from luka_bench.methods.knorm import KNorm
from luka_bench.methods.pyramidkv import PyramidKV, layer_capacity
from luka_bench.methods.quest import Quest
from luka_bench.methods.scorer import ScorerPolicy
from luka_bench.methods.snapkv import SnapKV

from test_method_contract import ids_of, kept_positions, prefill
from test_methods_core import method_logits

METHODS = Path(__file__).resolve().parents[1] / "luka_bench" / "methods"


def _knorm_scores(cache):
    """Each layer's KNorm scores [Hkv, n] (the negated key norms) from the uncompressed cache."""
    return [-s.keys[0].float().norm(dim=-1) for s in cache.stores]


@pytest.mark.parametrize("rule", ["paper", "kvpress"])
def test_adakv_over_knorm_splits_the_layers_budget_by_knorms_scores(tiny_gqa3, rule):
    ids = ids_of(160, 4)
    budget = 0.2
    cache, before = prefill(tiny_gqa3.model, AdaKV(budget=budget, scorer=KNorm(), rule=rule), ids,
                            before_compression=_knorm_scores)
    cap = math.ceil(budget * 160)
    differ = False
    for store, sc in zip(cache.stores, before):
        held = store.head_mask()
        held = held[0] if held is not None else torch.ones_like(store.positions[0], dtype=torch.bool)
        counts = held.sum(-1)
        want = head_counts(sc[None], cap, 0.2, rule, 0)[0]  # KNorm protects nothing: the whole capacity is scored
        assert counts.tolist() == want.tolist()
        differ |= len(set(counts.tolist())) > 1
        for h in range(sc.shape[0]):
            top = torch.sort(sc[h], descending=True, stable=True).indices[: int(counts[h])].tolist()
            assert sorted(store.positions[0, h][held[h]].tolist()) == sorted(top), (h, rule)
    assert differ  # head-wise budgets in play


def test_adakv_over_knorm_at_alpha_one_is_knorm(tiny_gqa3):
    ids = ids_of(150, 5)
    for rule in ("paper", "kvpress"):
        a, _ = prefill(tiny_gqa3.model, AdaKV(budget=0.3, alpha=1.0, rule=rule, scorer=KNorm()), ids)
        b, _ = prefill(tiny_gqa3.model, KNorm(budget=0.3), ids)
        assert kept_positions(a) == kept_positions(b), rule


def test_adakv_over_snapkv_given_as_its_scorer_is_adakv(tiny_gqa3):
    """The wrapper over an explicit SnapKV keeps what AdaKV's own SnapKV settings keep."""
    ids = ids_of(150, 6)
    kw = dict(window=8, kernel=5, pooling="max")
    a, _ = prefill(tiny_gqa3.model, AdaKV(budget=0.25, **kw), ids)
    b, _ = prefill(tiny_gqa3.model, AdaKV(budget=0.25, scorer=SnapKV(**kw)), ids)
    assert kept_positions(a) == kept_positions(b)


@pytest.mark.parametrize("scorer", [KNorm(), ExpectedAttention(n_future_positions=16)], ids=["knorm", "ea"])
def test_a_wrapper_with_the_whole_budget_equals_full(tiny_llama, scorer):
    ids = ids_of(80, 7)
    ref, _ = method_logits(tiny_llama.model, Full(), ids, 60)
    for m in (AdaKV(budget=1.0, scorer=scorer), PyramidKV(budget=1.0, scorer=scorer)):
        got, _ = method_logits(tiny_llama.model, m, ids, 60)
        assert torch.equal(got, ref), m.describe()


def test_adakv_over_expected_attention_holds_its_budget_and_keeps_the_sinks(tiny_gqa3):
    ids = ids_of(160, 8)
    m = AdaKV(budget=0.25, scorer=ExpectedAttention(n_future_positions=16, n_sink=4))
    cache, _ = prefill(tiny_gqa3.model, m, ids)
    cap = math.ceil(0.25 * 160)
    for store in cache.stores:
        assert store.held_per_head() * store.keys.shape[1] == pytest.approx(cap * store.keys.shape[1], abs=0.5 * 3)
        held = store.head_mask()
        held = held[0] if held is not None else torch.ones_like(store.positions[0], dtype=torch.bool)
        for h in range(store.keys.shape[1]):
            assert {0, 1, 2, 3} <= set(store.positions[0, h][held[h]].tolist())  # EA's sinks, in every head


def test_pyramidkv_over_knorm_keeps_its_layer_capacities_with_knorms_scores(tiny_llama):
    ids = ids_of(400, 9)
    budget, beta = 0.2, 4
    cache, before = prefill(tiny_llama.model, PyramidKV(budget=budget, beta=beta, scorer=KNorm()), ids,
                            before_compression=_knorm_scores)
    cap = math.ceil(budget * 400)
    layers = len(cache.stores)
    caps = [layer_capacity("paper", 400, cap, budget, 0, beta, i, layers) for i in range(layers)]
    assert len(set(caps)) > 1
    for store, sc, c in zip(cache.stores, before, caps):
        assert store.n == c
        for h in range(sc.shape[0]):
            top = torch.sort(sc[h], descending=True, stable=True).indices[:c].tolist()
            assert sorted(store.positions[0, h].tolist()) == sorted(top)


def test_pyramidkv_over_knorm_at_beta_one_is_knorm(tiny_gqa3):
    ids = ids_of(200, 3)
    a, _ = prefill(tiny_gqa3.model, PyramidKV(budget=0.2, beta=1, scorer=KNorm()), ids)
    b, _ = prefill(tiny_gqa3.model, KNorm(budget=0.2), ids)
    assert kept_positions(a) == kept_positions(b)


def test_a_wrapper_refuses_a_method_that_is_not_a_prefill_scorer_in_one_line():
    with pytest.raises(MethodConfigError) as e:
        AdaKV(scorer=Quest())
    assert "\n" not in str(e.value) and "method.scorer=quest" in str(e.value) and "knorm" in str(e.value)


def test_the_command_line_composes_a_wrapper_over_any_scorer():
    from luka_bench.config import build, compose

    m = build(compose(["method=adakv", "+method@method.scorer=knorm"], run_names=True), "method")
    assert isinstance(m.scorer, KNorm) and "scorer=knorm(" in m.describe()
    assert type(m.inner()) is KNorm and m.inner().budget == m.budget


def test_no_scorer_policy_overrides_attend_only_to_keep_queries():
    """The observation queries are the base's (``ScorerPolicy.observation_window`` / ``observes_question`` /
    ``observe``): SnapKV, FINCH and ExpectedAttention define no ``attend``; TOVA's keeps only its decode-time query
    and hands the prefill to the base."""
    from luka_bench.methods.expected_attention import ExpectedAttentionPolicy
    from luka_bench.methods.finch import FinchPolicy
    from luka_bench.methods.snapkv import SnapKVPolicy
    from luka_bench.methods.tova import TOVAPolicy

    for cls in (SnapKVPolicy, FinchPolicy, ExpectedAttentionPolicy):
        assert "attend" not in vars(cls), cls.__name__
    src = ast.unparse(next(n for n in ast.walk(ast.parse((METHODS / "tova.py").read_text()))
                           if isinstance(n, ast.FunctionDef) and n.name == "attend"))
    assert "super().attend(store, query, scaling)" in src and "'decode'" in src
    assert issubclass(TOVAPolicy, ScorerPolicy)
