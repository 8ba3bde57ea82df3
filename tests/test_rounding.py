"""How ``budget * tokens`` becomes a count (``KVMethod.rounding``, issue 59): ours rounds up (budget 1/8 of 1,268
tokens holds 159), kvpress's presses count ``max(1, int(n * (1 - compression_ratio)))`` (158) — the one item of 13
under the query-aware protocol on RULER 2K whose answer differed from kvpress's pipeline. ``rounding: kvpress``
counts as kvpress does."""
from __future__ import annotations

import math

import pytest

from luka_bench.methods.adakv import AdaKV
from luka_bench.methods.base import MethodConfigError
from luka_bench.methods.knorm import KNorm
from luka_bench.methods.snapkv import SnapKV

from test_method_contract import ids_of, prefill


def kvpress_kept(n: int, ratio: float) -> int:
    """kvpress's ScorerPress: the tokens kept of ``n`` at ``compression_ratio``."""
    return max(1, int(n * (1 - ratio)))


@pytest.mark.parametrize("budget", [0.125, 0.1, 0.25, 0.3, 0.5, 0.7, 0.01])
def test_kvpress_rounding_counts_as_kvpress_and_ours_rounds_up(budget):
    for n in range(1, 3000, 7):
        assert KNorm(budget=budget, rounding="kvpress").capacity(n) == kvpress_kept(n, 1 - budget), n
        assert KNorm(budget=budget).capacity(n) == math.ceil(budget * n - 1e-9), n
    assert KNorm(budget=0.125).capacity(1268) == 159 and KNorm(budget=0.125, rounding="kvpress").capacity(1268) == 158


def test_snapkv_with_kvpress_rounding_keeps_158_of_1268_per_head_and_otherwise_the_same_tokens(tiny_gqa3):
    ids = ids_of(1268, 3)
    ours, _ = prefill(tiny_gqa3.model, SnapKV(budget=0.125, window=8), ids)
    theirs, _ = prefill(tiny_gqa3.model, SnapKV(budget=0.125, window=8, rounding="kvpress"), ids)
    for a, b in zip(ours.stores, theirs.stores):
        assert (a.n, b.n) == (159, 158)
        # the 158 kept are the 159 but the lowest-scored one: the window's 8 and the best 150 of the rest
        for h in range(a.positions.shape[1]):
            assert set(b.positions[0, h].tolist()) < set(a.positions[0, h].tolist())


def test_a_wrapper_runs_its_scorer_at_its_own_rounding(tiny_gqa3):
    m = AdaKV(budget=0.125, scorer=KNorm(), rounding="kvpress", alpha=1.0)
    assert m.inner().rounding == "kvpress" and m.inner().budget == 0.125
    a, _ = prefill(tiny_gqa3.model, m, ids_of(300, 5))
    assert {s.n for s in a.stores} == {int(300 * 0.125)}


def test_rounding_shows_in_describe_only_where_set_and_is_checked():
    assert "rounding" not in KNorm().describe()
    assert KNorm(rounding="kvpress").describe() == "knorm(budget=0.125, rounding=kvpress)"
    with pytest.raises(MethodConfigError) as e:
        KNorm(rounding="floor")
    assert "\n" not in str(e.value) and "method.rounding='floor'" in str(e.value) and "ceil, kvpress" in str(e.value)


def test_the_library_and_the_command_line_take_the_rounding():
    import luka_bench as lb
    from luka_bench.config import compose_method

    assert lb.method("snapkv", rounding="kvpress").rounding == "kvpress"
    assert compose_method(["method=knorm", "+method.rounding=kvpress"])[0].rounding == "kvpress"
