"""arkvale: the digest is the reference's box (centre +- mean |k - centre|) and its score is no upper bound; every
decode step and layer equals a slow loop simulation of the reference's device cache (prefill eviction by the last
query, recalls replacing the lowest-scoring device pages, the window page dropped as it leaves) in output and
pages read, with the selection shared by the layer or per KV head; a page budget covering every page is full
attention; sink and window pages are always read; the offloaded bytes are reported; dense first layers; the
fixed-shape step equals the step at Python slots; one-line errors for bad settings."""
from __future__ import annotations

import pytest
import torch

from conftest import fixed_and_python_slots
from luka_bench.methods.arkvale import ArkVale, ArkValePolicy, arkvale_scores
from luka_bench.methods.base import MethodConfigError
from luka_bench.methods.full import Full
from luka_bench.methods.hf import attach
from luka_bench.methods.pages import PagedKeys
from luka_bench.methods.policies import StaticExactPolicy

from test_quest import prefill_and_question_are_exact


def ids_of(n, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def decode(model, method, ids, prefill, observer=None):
    """Teacher-forced decode after a ``prefill``-token prefill: (logits per step, the cache). The observer sees the
    prefill too."""
    steps = []
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache()
        c.observer = observer
        model(ids[:, :prefill], past_key_values=c)
        for t in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, t: t + 1], past_key_values=c).logits[0, -1])
    return steps, c


# ------------------------------------------------------------------------------------------------ the digest

def box(page):
    """The reference's digest of one page's keys [ps, D] (plain ops, float64): (lo, hi)."""
    page = page.double()
    centre = (page.max(0).values + page.min(0).values) / 2
    spread = (page - centre).abs().mean(0)
    return centre - spread, centre + spread


def test_the_digest_is_the_references_box():
    torch.manual_seed(0)
    ps, d = 5, 8
    K = torch.randn(2, 3, 4 * ps, d)

    class S:  # what PagedKeys.update reads of a store
        keys, n = K, 4 * ps

    pk = PagedKeys(ps, stats=("lo", "hi"))
    pk.update(S)
    for b in range(2):
        for h in range(3):
            for p in range(4):
                lo, hi = box(K[b, h, p * ps: (p + 1) * ps])
                torch.testing.assert_close(pk.lo[b, h, p].double(), lo, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(pk.hi[b, h, p].double(), hi, atol=1e-5, rtol=1e-5)
    assert pk.nbytes() == 2 * K[:, :, :4].nbytes  # two vectors per page and KV head
    with pytest.raises(AttributeError):
        pk.min


def test_the_digest_score_is_not_an_upper_bound():
    """A page whose keys sit at 5 on channel 0 but for one at 0 and one at 10: the box is centred at 5 with half-width
    mean |k - 5| = 1.25, so a query along channel 0 scores the page 6.25, below the outlier's q.k = 10 (Quest's
    min/max bound never is)."""
    ps, d = 8, 4
    page = torch.zeros(1, 1, ps, d)
    page[0, 0, :, 0] = 5.0
    page[0, 0, 3, 0], page[0, 0, 6, 0] = 10.0, 0.0
    pk = PagedKeys(ps, stats=("lo", "hi", "min", "max"))

    class S:
        keys, n = page, ps

    pk.update(S)
    q = torch.zeros(1, 1, 1, d)
    q[0, 0, 0, 0] = 1.0
    score = arkvale_scores(q, pk.lo, pk.hi, per_layer=True)  # [1, 1]
    best_qk = float((q[0, 0, 0] @ page[0, 0].T).max())
    assert float(score[0, 0]) == pytest.approx(6.25) and best_qk == 10.0
    quest = torch.maximum(q[0, 0, 0] * pk.max[0, 0, 0], q[0, 0, 0] * pk.min[0, 0, 0]).sum()
    assert float(quest) >= best_qk


# ------------------------------------------------------------------------------------------------ the slow reference

class SlowArkVale:
    """The reference's device cache for one layer, in plain loops and Python sets: the candidate pages on the
    device per group; at the prefill the best max(2, sink) .. pages by the last query (layer-mean); at each step
    the top k' candidates by the group's mean digest score, the offloaded ones recalled, each replacing the
    lowest-scoring device page; a closed page leaving the window goes off the device once the cache is full."""

    def __init__(self, m: ArkVale, hq: int, hkv: int):
        self.m, self.hq, self.hkv, self.g = m, hq, hkv, hq // hkv
        self.groups = [list(range(hq))] if m.group == "layer" else [list(range(h * self.g, (h + 1) * self.g))
                                                                     for h in range(hkv)]
        self.res = None  # per group: set of candidate pages on the device (None: every page)
        self.c = None
        self.q_last = None

    def score(self, q, K, p, heads):
        ps = self.m.page_size
        tot = 0.0
        for h in heads:
            lo, hi = box(K[0, h // self.g, p * ps: (p + 1) * ps])
            qh = q[0, h, 0].double()
            tot += float(torch.maximum(qh * hi, qh * lo).sum())
        return tot / len(heads)

    def prefill(self, K, n):
        m = self.m
        c = (n - 1) // m.page_size
        self.c = c
        if c + 1 <= m.page_budget:
            return
        nsp, e = max(2, m.sink_pages), c - m.window_pages + 1
        sc = {p: self.score(self.q_last, K, p, range(self.hq)) for p in range(nsp, e)}
        keep = sorted(sc, key=lambda p: -sc[p])[: m.page_budget - nsp - m.window_pages]
        self.res = [set(keep) | set(range(m.sink_pages, nsp)) for _ in self.groups]

    def step(self, q, K, V, n, scaling):
        m, ps = self.m, self.m.page_size
        c = (n - 1) // ps
        out = torch.empty(1, self.hq, 1, V.shape[-1])
        read = torch.zeros(1, self.hkv, n, dtype=torch.bool)
        M = m.page_budget - m.sink_pages - m.window_pages
        e = c - m.window_pages + 1
        if c + 1 <= m.page_budget:
            pages = [list(range(c + 1)) for _ in self.groups]
        else:
            if self.res is None:  # the cache just filled: the oldest M candidates stay on the device
                self.res = [set(range(m.sink_pages, m.sink_pages + M)) for _ in self.groups]
            self.c = c  # pages closed since: off the device (never added)
            pages = []
            for gi, heads in enumerate(self.groups):
                sc = {p: self.score(q, K, p, heads) for p in range(m.sink_pages, e)}
                top = set(sorted(sc, key=lambda p: -sc[p])[: m.topk - m.sink_pages - m.window_pages + 1])
                recall = top - self.res[gi]
                stay = sorted(self.res[gi] - top, key=lambda p: sc[p])[len(recall):]  # the lowest go
                self.res[gi] = (self.res[gi] & top) | recall | set(stay)
                assert len(self.res[gi]) == M
                pages.append(sorted(set(range(m.sink_pages)) | self.res[gi] | set(range(e, c + 1))))
        for gi, heads in enumerate(self.groups):
            idx = [t for p in pages[gi] for t in range(p * ps, min(n, (p + 1) * ps))]
            for h in heads:
                kv = h // self.g
                read[0, kv, idx] = True
                w = torch.softmax((q[0, h, 0] @ K[0, kv, idx].T).double() * scaling, -1)
                out[0, h, 0] = (w @ V[0, kv, idx].double()).float()
        return out, read


# each grouping once, with each page geometry once (the four crossings cost CI 2.5 minutes for no other code path)
@pytest.mark.parametrize("group,ps,page_budget,topk", [("layer", 4, 8, 5), ("kv_head", 5, 10, 4)])
def test_every_step_and_layer_equals_the_slow_reference(tiny_gqa3, group, ps, page_budget, topk):
    method = ArkVale(page_size=ps, page_budget=page_budget, topk=topk, group=group, full_layers=1)
    slow, checked = {}, []
    prefill = 100

    def observer(store, query, out, scaling):
        pol = store.policy
        if not isinstance(pol, ArkValePolicy):
            return
        ref = slow.setdefault(pol.info.layer_idx, SlowArkVale(method, query.shape[1], store.keys.shape[1]))
        if store.cache.phase == "prefill":
            ref.q_last = query[:, :, -1:].clone()
            return
        if ref.c is None:
            ref.prefill(store.keys, store.n - 1)
        want, read = ref.step(query, store.keys, store.values, store.n, scaling)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
        got = pol.attended(store)
        assert torch.equal(got if got is not None else torch.ones_like(read), read)
        assert pol.attended_count(store) == pytest.approx(float(read.sum()) / read.shape[1])
        checked.append(pol.pid is not None)

    decode(tiny_gqa3.model, method, ids_of(140), prefill, observer)
    assert all(checked) and len(checked) == 2 * 40  # 2 sparse layers x 40 steps, all on the sparse path


def test_the_selection_is_shared_by_the_layer_or_per_kv_head(tiny_gqa3):
    shared, apart = set(), set()
    for group, seen in (("layer", shared), ("kv_head", apart)):
        def observer(store, query, out, scaling):
            pol = store.policy
            if isinstance(pol, ArkValePolicy) and pol.pid is not None:
                read = pol.attended(store)
                seen.add(bool(torch.equal(read[0, 0], read[0, 1])))

        decode(tiny_gqa3.model, ArkVale(page_size=4, page_budget=8, topk=5, group=group, full_layers=0),
               ids_of(130, 4), 100, observer)
    assert shared == {True}  # one page set for every KV head of the layer
    assert False in apart  # each KV head its own


def test_a_page_budget_covering_every_page_is_full_attention(tiny_gqa3):
    ids = ids_of(150, 1)
    ref, _ = decode(tiny_gqa3.model, Full(), ids, 110)
    got, c = decode(tiny_gqa3.model, ArkVale(page_size=4, page_budget=38, topk=37, full_layers=0), ids, 110)
    for a, b in zip(ref, got):  # 150 tokens = 38 pages: every page on the device and read
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(s.policy.pid is None and s.policy.offloaded_pages(s) == 0 for s in c.stores)
    got, c = decode(tiny_gqa3.model, ArkVale(page_size=4, page_budget=20, topk=8, full_layers=0), ids, 110)
    assert c.attended_stats()["attended_ratio"] < 1.0  # a binding page budget reads fewer
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(ref, got))


def test_sink_and_window_pages_are_always_read_and_never_offloaded(tiny_gqa3):
    m = ArkVale(page_size=4, page_budget=8, topk=5, sink_pages=2, window_pages=3, full_layers=0)

    def observer(store, query, out, scaling):
        pol = store.policy
        if store.cache.phase == "decode" and pol.pid is not None:
            n, ps = store.n, m.page_size
            c = (n - 1) // ps
            pinned = [0, 1, c - 2, c - 1, c]
            assert all(bool((pol.pid == p).any(dim=1).all()) for p in pinned)
            read = pol.attended(store)
            assert read[..., : 2 * ps].all() and read[..., (c - 2) * ps: n].all()

    _, c = decode(tiny_gqa3.model, m, ids_of(140, 2), 100, observer)
    for s in c.stores:  # the device holds page_budget pages: sink + window + M candidates
        pol = s.policy
        cand = pol.res[:, m.sink_pages: (s.n - 1) // m.page_size - m.window_pages + 1]
        assert ((cand == 0).sum(1) == m.page_budget - m.sink_pages - m.window_pages).all()


def test_offloaded_bytes_are_reported(tiny_llama):
    m = ArkVale(page_size=8, page_budget=6, topk=4, full_layers=1)
    _, c = decode(tiny_llama.model, m, ids_of(130), 100)
    stats = c.method_report()
    sparse = [s for s in c.stores if isinstance(s.policy, ArkValePolicy)]
    pages = (130 - 1) // 8 + 1
    want = sum((pages - 6) * 8 * s.token_bytes() for s in sparse)
    assert stats["offloaded_bytes"] == want > 0
    assert stats["device_bytes"] == stats["real_bytes"] - want == c.held_bytes() - want
    assert stats["pages_offloaded"] == pytest.approx((pages - 6) * len(sparse) / len(c.stores))
    # every raw token held (the offloaded pages are the host copy) + the digests
    assert c.held_bytes() - c.full_bytes() == sum(s.policy.extra_bytes() for s in c.stores) > 0


def test_dense_first_layers_are_untouched(tiny_qwen3):
    outs = {}

    def observer(store, query, out, scaling):
        if store.cache.phase == "decode":
            outs.setdefault(store.policy.info.layer_idx, []).append(out)

    decode(tiny_qwen3.model, Full(), ids_of(130, 3), 100, observer)
    full_outs, outs = outs, {}
    _, c = decode(tiny_qwen3.model, ArkVale(page_size=4, page_budget=8, topk=5), ids_of(130, 3), 100, observer)
    assert [type(s.policy) for s in c.stores] == [StaticExactPolicy, StaticExactPolicy, ArkValePolicy]
    for layer in (0, 1):
        for a, b in zip(full_outs[layer], outs[layer]):  # teacher-forced: their inputs never depend on layer 2
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert c.stores[2].policy.pid is not None
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(full_outs[2], outs[2]))


def test_fixed_shape_step_equals_the_step_at_python_slots(tiny_gqa3, monkeypatch):
    (fixed, grew), (plain, _) = fixed_and_python_slots(
        monkeypatch, tiny_gqa3.model, lambda: ArkVale(page_size=8, page_budget=6, topk=4, full_layers=1),
        [ArkValePolicy, StaticExactPolicy],
        ids_of(160, 5), 40, 100, lambda c: [s.policy.pid.clone() for s in c.stores
                                            if isinstance(s.policy, ArkValePolicy) and s.policy.pid is not None])
    assert grew and sum(len(tf) for _, tf in fixed) > 80  # the cache filled (6 pages) during the decode: sparse after
    for (lf, tf), (lp, tp) in zip(fixed, plain):
        torch.testing.assert_close(lf, lp, rtol=1e-5, atol=1e-6)
        assert len(tf) == len(tp)
        for a_, b_ in zip(tf, tp):
            assert torch.equal(a_, b_)


def test_the_prefill_and_the_question_are_exact(tiny_gqa3):
    prefill_and_question_are_exact(tiny_gqa3.model, ArkVale(page_size=4, page_budget=8, topk=5, full_layers=0))


@pytest.mark.parametrize("bad,says", [
    (dict(page_size=0), "method.page_size=0 must be an integer >= 1"),
    (dict(page_size=2.5), "method.page_size=2.5"),
    (dict(window_pages=1), "method.window_pages=1 must be an integer >= 2"),
    (dict(sink_pages=-1), "method.sink_pages=-1"),
    (dict(group="head"), "method.group='head' is not one of ['layer', 'kv_head']"),
    (dict(topk=2), "method.topk=2 must exceed sink_pages + window_pages - 1 = 2"),
    (dict(topk=128), "method.page_budget=128 must exceed method.topk=128"),
    (dict(page_budget=3, topk=2, sink_pages=0), "method.page_budget=3 is below max(2, sink_pages) + window_pages"),
    (dict(budget=0.5), "allowed: 1.0"),
    (dict(full_layers=-1), "method.full_layers=-1"),
    (dict(topk=True), "method.topk=True"),
])
def test_bad_settings_are_one_line_errors(bad, says):
    with pytest.raises(MethodConfigError) as e:
        ArkVale(**bad)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_setting_named_group_or_name_reaches_the_method_through_the_library_api():
    """``lb.method(name, **settings)``: a method's own settings may be called ``group`` or ``name`` (ArkVale's
    ``group``); they once collided with the builder's parameters (TypeError)."""
    import luka_bench as lb

    assert lb.method("arkvale", group="kv_head").group == "kv_head"
    from luka_bench.config import build_group

    assert build_group("method", "arkvale", group="kv_head").group == "kv_head"
