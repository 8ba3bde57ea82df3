"""quest: the page bound bounds every q.k of its page; the decode step equals a slow per-query-head loop reference
(bounds from the page min/max, exact attention over the pages read; by the kernel rule the newest token's page
forced in, by the evaluation rule the top pages of all, the partial last one competing) on a tiny model at every
step and layer; each rule's invariant over a decode; a budget covering every page is full attention under both
rules; page_size 1 is oracle_topk by logit; dense first layers; per-query-head selection; the fixed-shape step
equals the step at Python slots and makes no host sync; one-line errors for bad settings."""
from __future__ import annotations

import pytest
import torch

from conftest import fixed_and_python_slots, tiny
from luka_bench.methods.base import LayerInfo, MethodConfigError
from luka_bench.methods.cache import MethodCache, policy_attention
from luka_bench.methods.full import Full
from luka_bench.methods.hf import attach
from luka_bench.methods.oracle_topk import OracleTopK
from luka_bench.methods.pages import PagedKeys
from luka_bench.methods.policies import StaticExactPolicy
from luka_bench.methods.quest import Quest, QuestPolicy, page_bound, quest_pages


def slow_reference(q, K, V, scaling, ps, budget, select="kernel"):
    """One decode query q [1, Hq, 1, D] over K/V [1, Hkv, n, D], in plain loops per query head: the pages' key
    min/max (the last page's over the tokens it holds), the bound sum_d max(q_d M_d, q_d m_d) of each page; by the
    kernel rule the top K - 1 pages but the last + the last page, by the evaluation rule the top K of all pages;
    softmax over their tokens. Returns (out [1, Hq, 1, D], read mask per KV head = union [1, Hkv, n])."""
    _, hq, _, d = q.shape
    hkv, n = K.shape[1], K.shape[2]
    g = hq // hkv
    n_pages = -(-n // ps)
    k = min(max(3, budget // ps), n_pages)
    out = torch.empty(1, hq, 1, V.shape[-1])
    read = torch.zeros(1, hkv, n, dtype=torch.bool)
    for h in range(hq):
        kv = h // g
        if n <= budget or k == n_pages:
            idx = list(range(n))
        else:
            bounds = []
            for p in range(n_pages):
                page = K[0, kv, p * ps: (p + 1) * ps]
                hi, lo = page.max(0).values, page.min(0).values
                bounds.append(float(sum(max(float(q[0, h, 0, c] * hi[c]), float(q[0, h, 0, c] * lo[c]))
                                        for c in range(d))))
            if select == "kernel":
                chosen = sorted(range(n_pages - 1), key=lambda p: -bounds[p])[: k - 1] + [n_pages - 1]
            else:
                chosen = sorted(range(n_pages), key=lambda p: -bounds[p])[:k]
            idx = sorted(t for p in chosen for t in range(p * ps, min(n, (p + 1) * ps)))
        read[0, kv, idx] = True
        w = torch.softmax((q[0, h, 0] @ K[0, kv, idx].T).double() * scaling, -1)
        out[0, h, 0] = (w @ V[0, kv, idx].double()).float()
    return out, read


def decode(model, method, ids, prefill, observer=None):
    """Teacher-forced decode after a ``prefill``-token prefill: (logits per step, the cache)."""
    steps = []
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache()
        model(ids[:, :prefill], past_key_values=c)
        c.observer = observer
        for t in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, t: t + 1], past_key_values=c).logits[0, -1])
    return steps, c


def ids_of(n, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ the bound

@pytest.mark.parametrize("ps", [1, 3, 16])
def test_the_page_bound_is_at_least_every_q_dot_k_of_its_page(ps):
    torch.manual_seed(ps)
    b, hkv, g, pages, d = 2, 3, 2, 7, 16
    K = torch.randn(b, hkv, pages * ps, d) * 3

    class S:  # what PagedKeys.update reads of a store
        keys, n = K, pages * ps

    pk = PagedKeys(ps)
    pk.update(S)
    q = torch.randn(b, hkv, g, d) * 2
    ub = page_bound(q.reshape(b * hkv, g, d), pk.max.reshape(b * hkv, pages, d), pk.min.reshape(b * hkv, pages, d))
    ub = ub.view(b, hkv, g, pages)
    torch.testing.assert_close(ub, pk.bound(q))  # the two-GEMM form = the channel-wise max form
    qk = torch.einsum("bhgd,bhnd->bhgn", q, K).view(b, hkv, g, pages, ps)
    assert (ub >= qk.amax(-1) - 1e-4).all()
    if ps == 1:  # one key per page: the bound is q.k itself
        torch.testing.assert_close(ub, qk[..., 0], atol=1e-4, rtol=1e-5)


def test_pages_are_read_in_place_where_the_gather_would_move_more():
    from luka_bench.methods.quest import reads_in_place

    assert reads_in_place(3, 9, 2048, 1024)  # SmolLM2 at 2K: 3 x 2,048 slots against 3 x 9 x 1,024 moved
    assert reads_in_place(3, 9, 9216, 1024) and not reads_in_place(3, 9, 9232, 1024)
    assert not reads_in_place(8, 32, 32768, 1024)  # Llama 3.1 8B at 32K: the gather
    assert not reads_in_place(4, 4, 4096, 1024)  # no grouped query heads: in place only up to 3 x the budget


def test_page_count_is_the_references():
    assert quest_pages(4000, 16, 1024) == 64
    assert quest_pages(4000, 16, 20) == 3  # never fewer than 3 pages
    assert quest_pages(40, 16, 1024) == 3  # nor more than the pages held (ceil: the last page counts)
    assert quest_pages(4000, 16, 1000) == 62


# ------------------------------------------------------------------------------------------------ on a model

@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "gathered"])
@pytest.mark.parametrize("select,ps,budget", [("kernel", 16, 64), ("kernel", 4, 20), ("kernel", 5, 12),
                                               ("evaluation", 16, 64)])
def test_every_step_and_layer_equals_the_slow_reference(tiny_gqa3, monkeypatch, select, ps, budget, in_place):
    """GQA 3:1, pages read per query head: output and read set (the union per KV head) of every sparse layer at
    every decode step equal the loop reference; the runner's attended count is that union's count. (5, 12): fewer
    than 3 pages of budget, 3 read. Both ways of reading the pages (``reads_in_place``'s choice forced): in place
    (one SDPA, the pages not read masked) and gathered into a copy."""
    import luka_bench.methods.quest as Q

    monkeypatch.setattr(Q, "reads_in_place", lambda *a: in_place)
    checked = []

    def observer(store, query, out, scaling):
        pol = store.policy
        if isinstance(pol, QuestPolicy):
            ref, read = slow_reference(query, store.keys, store.values, scaling, ps, budget, select)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
            got = pol.attended(store)
            assert torch.equal(got if got is not None else torch.ones_like(read), read)
            count = pol.attended_count(store)
            count = count if isinstance(count, float) else float(count.total) * count.scale + count.offset
            assert count == pytest.approx(float(read.sum()) / read.shape[1])
            checked.append(pol.pid is not None)

    decode(tiny_gqa3.model, Quest(token_budget=budget, page_size=ps, full_layers=1, select=select), ids_of(140), 100,
           observer)
    assert sum(checked) > 40 and len(checked) == 2 * 40  # 2 sparse layers x 40 steps, the sparse path taken


@pytest.mark.parametrize("select", ["kernel", "evaluation"])
def test_each_rule_reads_the_pages_it_names(tiny_gqa3, select):
    """The selection rules as invariants over a decode (GQA 3:1, pages of 8, prompt 100: 13 to 18 pages; budget 16,
    2 pages' worth), at every sparse step and query head: K = min(max(3, token_budget // page_size), pages) = 3
    distinct pages are read (the floor of 3);
    kernel: the last page (the newest token's) is one of them, the others the top K - 1 closed pages by bound;
    evaluation: they are the top K of all pages by bound, the partial last page's bound over the tokens it holds
    (here: the page padded with copies of the newest key, which leaves its min/max as they are) — and the last page
    is left out at some steps, read at others."""
    ps, budget = 8, 16
    last_read = []

    def observer(store, query, out, scaling):
        pol = store.policy
        if not isinstance(pol, QuestPolicy) or pol.pid is None:
            return
        n, K = store.n, store.keys[0]  # [Hkv, n, D]
        hkv, _, d = K.shape
        pages = -(-n // ps)
        k = min(max(3, budget // ps), pages)
        boxed = torch.cat([K, K[:, -1:].expand(hkv, pages * ps - n, d)], 1).view(hkv, pages, ps, d)
        bound = page_bound(query[0].reshape(hkv, -1, d), boxed.amax(2), boxed.amin(2))  # [Hkv, g, pages]
        if select == "kernel":
            top = torch.topk(bound[..., :-1], k - 1).indices
            want = torch.cat([top, torch.full_like(top[..., :1], pages - 1)], -1)
        else:
            want = torch.topk(bound, k).indices
        pid = pol.pid.view(hkv, -1, 3)
        assert torch.equal(pid.sort(-1).values, want.sort(-1).values)
        assert (pid.sort(-1).values.diff(dim=-1) > 0).all()  # distinct
        last_read.append((pid == pages - 1).any(-1).flatten())

    decode(tiny_gqa3.model, Quest(token_budget=budget, page_size=ps, full_layers=1, select=select), ids_of(140), 100,
           observer)
    read = torch.cat(last_read)
    assert len(last_read) == 2 * 40
    assert bool(read.all()) if select == "kernel" else 0 < int(read.sum()) < read.numel()


@pytest.mark.parametrize("select", ["kernel", "evaluation"])
def test_a_budget_covering_every_page_is_full_attention(tiny_gqa3, select):
    ids = ids_of(150, 1)
    ref, _ = decode(tiny_gqa3.model, Full(), ids, 110)
    for method in (Quest(token_budget=160, page_size=16, full_layers=0, select=select),  # >= the sequence
                   # below it until step 2: sparse after
                   Quest(token_budget=112, page_size=16, full_layers=0, select=select)):
        got, c = decode(tiny_gqa3.model, method, ids, 110)
        n_exact = 150 - 110 if method.token_budget >= 150 else 112 - 110
        for a, b in zip(ref[:n_exact], got[:n_exact]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert c.attended_stats()["attended_ratio"] < 1.0  # the binding budget read fewer
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(ref, got))


@pytest.mark.parametrize("select,recent", [("kernel", 1), ("evaluation", 0)])
def test_page_size_1_is_oracle_topk_by_logit(select, recent):
    """One query head per KV head (MHA), pages of one token: Quest's bound is q.k, so its read set is the top-k by
    logit = by weight; by the kernel rule with the newest token forced (oracle_topk's recent=1), by the evaluation
    rule the newest token competing (recent=0)."""
    lm = tiny("llama", num_attention_heads=4, num_key_value_heads=4)
    ids = ids_of(130, 2)
    ref, _ = decode(lm.model, OracleTopK(token_budget=24, recent=recent), ids, 100)
    got, c = decode(lm.model, Quest(token_budget=24, page_size=1, full_layers=0, select=select), ids, 100)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for s in c.stores:
        count = s.policy.attended_count(s)
        assert (count if isinstance(count, float) else float(count.total) * count.scale + count.offset) == 24.0


def test_dense_first_layers_are_untouched(tiny_qwen3):
    outs = {}

    def observer(store, query, out, scaling):
        outs.setdefault(store.policy.info.layer_idx, []).append(out)

    _, c_full = decode(tiny_qwen3.model, Full(), ids_of(130, 3), 100, observer)
    full_outs, outs = outs, {}
    _, c = decode(tiny_qwen3.model, Quest(token_budget=32, page_size=8), ids_of(130, 3), 100, observer)
    assert [type(s.policy) for s in c.stores] == [StaticExactPolicy, StaticExactPolicy, QuestPolicy]
    for layer in (0, 1):  # the model's own first two layers (not the reference's counter from 32)
        assert c.stores[layer].policy.attended(c.stores[layer]) is None
        for a, b in zip(full_outs[layer], outs[layer]):  # teacher-forced: their inputs never depend on layer 2
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert c.stores[2].policy.pid is not None
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(full_outs[2], outs[2]))


def test_each_query_head_picks_its_own_pages():
    """Two query heads of one KV head: head 0 points at page 1's keys, head 1 at page 4's; each reads its page."""
    ps, d = 4, 8
    info = LayerInfo(layer_idx=3, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=d)
    cache = MethodCache(Quest(token_budget=8, page_size=ps, full_layers=0), [info])
    store = cache.stores[0]
    K = torch.randn(1, 1, 8 * ps, d) * 0.1
    K[0, 0, 1 * ps: 2 * ps, 0] = 5.0
    K[0, 0, 4 * ps: 5 * ps, 1] = 5.0
    store.update(K, torch.randn(1, 1, 8 * ps, d))
    cache.end_prefill()
    store.update(torch.zeros(1, 1, 1, d), torch.zeros(1, 1, 1, d))
    q = torch.zeros(1, 2, 1, d)
    q[0, 0, 0, 0] = q[0, 1, 0, 1] = 1.0
    policy_attention(store, q, 1.0)
    pid = store.policy.pid  # [1, 2, K = 3]: 2 chosen + the last page (8)
    assert pid[0, 0, 0] == 1 and pid[0, 1, 0] == 4 and (pid[..., -1] == 8).all()
    read = store.policy.attended(store)  # the union: both heads' pages
    assert read[0, 0, 1 * ps: 2 * ps].all() and read[0, 0, 4 * ps: 5 * ps].all() and read[0, 0, -1]


@pytest.mark.parametrize("select", ["kernel", "evaluation"])
def test_fixed_shape_step_equals_the_step_at_python_slots(tiny_gqa3, monkeypatch, select):
    """The graph-ready step (the token written at a slot held on the device, the mask opened in place) reads the same
    pages and gives the same logits as with the slot a Python number, through a storage growth and a clone; the
    storage stays whole pages."""
    (fixed, grew), (plain, _) = fixed_and_python_slots(
        monkeypatch, tiny_gqa3.model, lambda: Quest(token_budget=32, page_size=8, full_layers=1, select=select),
        [QuestPolicy, StaticExactPolicy],
        ids_of(160, 5), 40, 100, lambda c: [s.policy.pid.clone() for s in c.stores
                                            if isinstance(s.policy, QuestPolicy) and s.policy.pid is not None])
    assert grew
    for (lf, tf), (lp, tp) in zip(fixed, plain):
        torch.testing.assert_close(lf, lp, rtol=1e-5, atol=1e-6)
        assert len(tf) == len(tp)
        for a_, b_ in zip(tf, tp):
            assert torch.equal(a_, b_)


def test_the_evaluation_rule_is_graph_ready_and_makes_no_host_sync():
    """The evaluation rule's steady steps (between page closings) dispatch the same ops on the same shapes and make no
    host sync, as the kernel rule's (tests/test_graph_ready.py, tests/test_host_sync.py run the configs: the default
    rule); 0 syncs on the steps with a page closing too."""
    from hydra.utils import instantiate

    from luka_bench.host_sync import decode_sync_counts, sync_method_config
    from luka_bench.models import TinyRandomModel
    from test_graph_ready import _steps

    lm = TinyRandomModel(name="tiny_llama", arch="llama", num_hidden_layers=2, device="cpu", dtype="float32").load()
    make = lambda: instantiate(sync_method_config("quest", {"select": "evaluation"}), _convert_="all")  # noqa: E731
    rows = _steps(lm.model, make(), lm.tokenizer)
    steady = [i for i, r in enumerate(rows) if i and not r[4]]
    pairs = [(i, i + 1) for i in steady if i + 1 in steady]
    assert len(pairs) >= 3 and all(rows[i][0] and rows[i][0] == rows[j][0] for i, j in pairs)
    assert all(r[1] == 0 for r in rows)
    syncs = decode_sync_counts(lm.model, make(), prompt_len=400, steps=20, tokenizer=lm.tokenizer)
    assert any(r[1] for r in syncs) and not any(r[0] for r in syncs)  # page closings seen; no sync at all


def test_storage_is_whole_pages_and_summaries_are_counted(tiny_llama):
    _, c = decode(tiny_llama.model, Quest(token_budget=32, page_size=16, full_layers=1), ids_of(150), 101)
    for s in c.stores[1:]:
        assert s.storage()[0].shape[2] % 16 == 0
        assert s.policy.paged.pages == (s.n - 1) // 16
        assert s.policy.extra_bytes() == s.policy.paged.nbytes() > 0
    # every raw token held (kv_ratio 1) + the page summaries (mean, min, max per page and KV head)
    assert c.held_bytes() - c.full_bytes() == sum(s.policy.extra_bytes() for s in c.stores) > 0


def test_the_prefill_and_the_question_are_exact(tiny_gqa3):
    prefill_and_question_are_exact(tiny_gqa3.model, Quest(token_budget=16, full_layers=0))


def prefill_and_question_are_exact(model, method):
    """A decode-time method's prefill and a multi-token chunk after it are full attention, and read no subset."""
    ids = ids_of(150, 1)
    with attach(model, Full()) as a, torch.no_grad():
        ref = model(ids, past_key_values=a.new_cache()).logits
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache()
        got = model(ids[:, :100], past_key_values=c).logits
        got2 = model(ids[:, 100:], past_key_values=c).logits  # a multi-token chunk after the prefill
    torch.testing.assert_close(torch.cat([got, got2], 1), ref, atol=1e-5, rtol=1e-5)
    assert all(s.policy.attended(s) is None for s in c.stores)


@pytest.mark.parametrize("bad,says", [
    (dict(page_size=0), "method.page_size=0 must be an integer >= 1"),
    (dict(page_size=2.5), "method.page_size=2.5"),
    (dict(token_budget=0), "method.token_budget=0 must be an integer >= 1"),
    (dict(token_budget=8, page_size=16), "token_budget >= page_size"),
    (dict(budget=0.5), "allowed: 1.0"),
    (dict(full_layers=-1), "method.full_layers=-1"),
    (dict(token_budget=True), "method.token_budget=True"),
    (dict(select="cuda"), "method.select='cuda' is unknown; allowed: kernel, evaluation"),
])
def test_bad_settings_are_one_line_errors(bad, says):
    with pytest.raises(MethodConfigError) as e:
        Quest(**bad)
    assert says in str(e.value) and "\n" not in str(e.value)
