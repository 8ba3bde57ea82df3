"""LASER-KV: the invariants of the issue, on tiny random models (block-wise prefill through the real hooks)."""
from __future__ import annotations

import math

import pytest
import torch

from luka_bench.methods.base import MethodConfigError
from luka_bench.methods.hf import attach
from luka_bench.methods.laser_kv import STATE, LaserKV, collision_counts, held_tokens, simhash_codes
from luka_bench.methods.snapkv import SnapKV
from luka_bench.engine import forward

from conftest import attn_impl

ARCHS = ["tiny_llama", "tiny_qwen3"]


def closed_form(L: int, S: int, r: float, n: int) -> tuple[int, int]:
    """(held tokens, anchors) written out from the paper's budget: B = floor(2rSL/(S+L)); B//n anchors (the first
    tokens), B//n local window per block (its look-back tail), G = B - 2(B//n) selected per block from the
    candidates (previous tail + the block's tokens that are neither anchors nor its tail); the last tail stays."""
    B = math.floor(2 * r * S * L / (S + L))
    A = W = B // n
    G = B - 2 * A
    held, tail = min(A, L), 0
    for t in range(math.ceil(L / S)):
        size = min(S, L - t * S)
        anchors = len(set(range(t * S, t * S + size)) & set(range(A)))
        local = min(W, size - anchors)
        held += min(G, tail + size - anchors - local)
        tail = local
    return held + tail, A


def run_laser(model, method, ids, question=(3, 4, 5, 6), trace=False):
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=ids.numel(), question_ids=list(question) if question else None)
        if trace:
            method.state(c)["trace"] = []
        forward(model, ids, c)  # the prefill, in the method's blocks; compressed after it
    return c


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("L,S,r,alpha,qa", [(200, 64, 0.25, 0.75, True), (97, 32, 0.5, 1.0, False),
                                            (150, 150, 0.25, 0.0, True), (130, 40, 0.3, 0.75, False)])
def test_held_tokens_equal_closed_form_and_protected_tokens_kept(arch, L, S, r, alpha, qa, request):
    model = request.getfixturevalue(arch).model
    ids = torch.randint(0, 256, (L,), generator=torch.Generator().manual_seed(L))
    c = run_laser(model, LaserKV(budget=r, block_size=S, alpha=alpha, question_aware=qa), ids)
    held, anchors = closed_form(L, S, r, 4)
    assert held == held_tokens(L, S, r, 4)
    assert [s.n for s in c.stores] == [held] * len(c.stores)
    pos = c.stores[0].positions[0, 0].tolist()
    assert all((s.positions == c.stores[0].positions[:, :1]).all() for s in c.stores)  # one set, every layer/head
    assert set(range(anchors)) <= set(pos)  # anchors
    last = (L - 1) // S * S
    local = min(anchors, L - last - len(set(range(last, L)) & set(range(anchors))))
    assert set(range(L - local, L)) <= set(pos)  # the last block's window
    assert pos == sorted(pos) and len(set(pos)) == len(pos)


def slow_scores(entries, alpha, planes):
    """S_exact and S_lsh over one block's scoring window, with loops over layers, heads and queries (float64)."""
    m = entries[0]["k"].shape[2]
    exact, lsh = [0.0] * m, [0.0] * m
    for e in entries:
        q, k = e["q"][0].double(), e["k"][0].double()
        hq, nq, _ = q.shape
        g = hq // k.shape[0]
        for h in range(hq):
            kh = k[h // g]
            for i in range(nq):
                logits = (kh @ q[h, i]) * e["scaling"]
                if e["causal"]:
                    logits[m - nq + i + 1:] = float("-inf")
                w = torch.softmax(logits, dim=0)
                for j in range(m):
                    exact[j] += float(w[j])
                if planes is not None:
                    qbits = (planes.double() @ q[h, i] > 0)  # [R, K]
                    for j in range(m):
                        kbits = (planes.double() @ kh[j] > 0)
                        lsh[j] += int((qbits == kbits).all(dim=1).sum())  # collisions (frequency x R)
    return exact, lsh


def slow_selection(L, S, r, alpha, traces, planes, n_layers):
    """The kept positions, block by block, from the paper's rules and the slow scores (ties: earlier token)."""
    B = math.floor(2 * r * S * L / (S + L))
    A = W = B // 4
    G = B - 2 * A
    kept, tail = [], []
    for t in range(math.ceil(L / S)):
        block = list(range(t * S, min(L, (t + 1) * S)))
        window = tail + block
        exact, lsh = slow_scores(traces[t * n_layers:(t + 1) * n_layers], alpha, planes)
        assert len(exact) == len(window)
        anchors = [p for p in block if p < A]
        rest = [p for p in block if p >= A]
        local = rest[len(rest) - min(W, len(rest)):]
        cand = [i for i, p in enumerate(window) if p not in anchors and p not in local]
        if len(cand) <= G:
            chosen = set(cand)
        else:
            ke = math.floor(alpha * G + 1e-9)
            by_exact = sorted(cand, key=lambda i: (-exact[i], i))[:ke]
            left = [i for i in cand if i not in by_exact]
            by_lsh = sorted(left, key=lambda i: (-lsh[i], i))[:G - ke]
            chosen = set(by_exact) | set(by_lsh)
        kept += sorted(set(anchors) | {window[i] for i in chosen})
        tail = local
    return sorted(kept + tail)


@pytest.mark.parametrize("arch", ARCHS + ["tiny_gqa3"])  # gqa3: 3 query heads per KV head (SmolLM2's ratio)
@pytest.mark.parametrize("alpha,qa", [(1.0, True), (0.0, True), (1.0, False), (0.0, False), (0.75, True),
                                      (0.75, False)])
def test_exact_and_lsh_selection_equal_slow_reference(arch, alpha, qa, request):
    """alpha = 1 (exact only) and alpha = 0 (LSH only), question-aware and not: the kept positions equal a slow
    loop reference computed from the same queries and window keys (recorded per layer and block). Here G = 10,
    so alpha = 0.75 gives alpha G = 7.5: floor(7.5) = 7 by exact scores and 3 by LSH (a ceil would take 8 + 2)."""
    model = request.getfixturevalue(arch).model
    L, S, r = 90, 32, 0.4
    ids = torch.randint(0, 256, (L,), generator=torch.Generator().manual_seed(11))
    m = LaserKV(budget=r, block_size=S, alpha=alpha, question_aware=qa, lsh_bits=3, lsh_tables=7)
    c = run_laser(model, m, ids, trace=True)
    st = c.state[STATE]
    assert math.floor(2 * r * S * L / (S + L)) == 18  # B = 18, A = W = 4, G = 10
    assert st["planes"] is None  # dropped after the prefill: the same ones are drawn again from the seed
    planes = m.planes({"planes": None}, st["trace"][0]["q"].shape[-1], torch.device("cpu")) if alpha < 1 else None
    ref = slow_selection(L, S, r, alpha, st["trace"], planes, model.config.num_hidden_layers)
    assert c.stores[0].positions[0, 0].tolist() == ref


def test_question_is_scored_at_the_positions_right_after_the_whole_context(tiny_gqa3):
    """Every block's scratch forward puts the question right after the *whole* context (positions L, L + 1, ...),
    not after the block just prefilled: the first layer's question queries depend only on the question's ids and
    positions, so they are the same after every block (the last block's are at L by construction)."""
    model = tiny_gqa3.model
    L, S = 120, 32
    ids = torch.randint(0, 256, (L,), generator=torch.Generator().manual_seed(8))
    c = run_laser(model, LaserKV(budget=0.3, block_size=S, alpha=1.0), ids, question=(5, 6, 7, 8), trace=True)
    first = [e["q"] for e in c.state[STATE]["trace"] if e["layer"] == 0 and not e["causal"]]
    assert len(first) == math.ceil(L / S)
    for q in first[:-1]:
        assert torch.allclose(q, first[-1], atol=1e-5), (q - first[-1]).abs().max()


def _eager_block_logits(model, ids, allowed):
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    with attn_impl(model, "eager"):
        return model(ids.view(1, -1), attention_mask=mask, use_cache=False).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_block_logits_equal_eager_forward_with_earlier_evictions_masked(arch, request):
    """Block t is computed over what the earlier blocks kept (+ the previous tail): its logits equal one eager
    forward of the whole prefix in which every query of block u sees the earlier tokens held when block u ran."""
    model = request.getfixturevalue(arch).model
    L, S = 80, 20
    ids = torch.randint(0, 256, (L,), generator=torch.Generator().manual_seed(5))
    m = LaserKV(budget=0.3, block_size=S)
    allowed = torch.zeros(L, L, dtype=torch.bool)
    with attach(model, m) as a, torch.no_grad():
        c = a.new_cache(reference_length=L, question_ids=[7, 8, 9], manual=True)
        for t in range(L // S):
            held = c.stores[0].positions[0, 0].tolist() if c.stores[0].n else []
            rows = slice(t * S, (t + 1) * S)
            allowed[rows, held] = True
            allowed[rows, rows] = torch.ones(S, S, dtype=torch.bool).tril()
            got = model(ids[None, rows], past_key_values=c).logits[0]
            ref = _eager_block_logits(model, ids[: (t + 1) * S], allowed[: (t + 1) * S, : (t + 1) * S])[rows]
            assert torch.allclose(got, ref, atol=1e-4, rtol=0), (t, (got - ref).abs().max())
            if t > 0:
                assert c.stores[0].n < (t + 1) * S  # something was evicted: the test is not vacuous
        c.end_prefill()


def test_lsh_collision_estimate_matches_closed_form():
    """SimHash: the fraction of tables in which a query and a key collide (all K bits equal) estimates
    (1 - angle / pi) ** K; and the histogram count equals a direct comparison."""
    gen = torch.Generator().manual_seed(0)
    d, K, R = 32, 3, 20000
    planes = torch.randn(R, K, d, generator=gen)
    q = torch.randn(1, d, generator=gen)
    q = q / q.norm()
    ortho = torch.randn(1, d, generator=gen)
    ortho = ortho - (ortho @ q.T) * q
    ortho = ortho / ortho.norm()
    angles = torch.tensor([0.2, 0.7, 1.2, 1.6, 2.4])
    keys = torch.cos(angles)[:, None] * q + torch.sin(angles)[:, None] * ortho  # [5, d] at known angles
    qc, kc = simhash_codes(q[None], planes), simhash_codes(keys[None], planes)
    freq = collision_counts(qc, kc, K)[0] / R
    expected = (1 - angles / math.pi) ** K
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)
    # random queries and keys: the histogram count equals the naive [Q, M, R] comparison
    qs, ks = torch.randn(2, 9, d, generator=gen), torch.randn(2, 13, d, generator=gen)
    p = planes[:50]
    qc, kc = simhash_codes(qs, p), simhash_codes(ks, p)
    naive = (qc[:, :, None, :] == kc[:, None, :, :]).float().sum(dim=(1, 3))
    assert torch.equal(collision_counts(qc, kc, K), naive)


def test_question_aware_scores_with_the_question_and_drops_its_kv(tiny_llama):
    """The selection depends on the question; the question's keys/values never stay in the cache."""
    model = tiny_llama.model
    ids = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(2))
    m = LaserKV(budget=0.25, block_size=40, alpha=1.0)
    a = run_laser(model, m, ids, question=(1, 2, 3, 4, 5))
    b = run_laser(model, m, ids, question=(200, 100, 50))
    assert a.stores[0].seen == b.stores[0].seen == 120
    assert int(a.stores[0].positions.max()) == 119
    assert a.stores[0].positions[0, 0].tolist() != b.stores[0].positions[0, 0].tolist()


def test_question_aware_snapkv_uses_the_question(tiny_llama):
    model = tiny_llama.model
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(3))
    kept = []
    for q in ((1, 2, 3), (90, 91, 92, 93)):
        with attach(model, SnapKV(budget=0.3, window=8, question_aware=True)) as a, torch.no_grad():
            c = a.new_cache(reference_length=100, question_ids=list(q), manual=True)
            model(ids[None], past_key_values=c)
            c.end_prefill()
        assert all(s.n == 30 and s.seen == 100 for s in c.stores)
        assert (c.stores[0].positions[..., -8:] == torch.arange(92, 100)).all()  # the context's last window kept
        kept.append(c.stores[0].positions.tolist())
    assert kept[0] != kept[1]


@pytest.mark.parametrize("bad", [dict(divisor=2), dict(alpha=1.5), dict(block_size=0), dict(lsh_bits=20),
                                 dict(question_aware="yes"), dict(budget=0.0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(MethodConfigError):
        LaserKV(**bad)


def test_babilong_evidence_spans_and_token_positions_are_the_supporting_facts(tiny_llama):
    """The generator's supporting facts -> character spans in the context block -> token positions of the
    context prompt (what ``evidence_kept`` counts)."""
    import random

    from luka_bench.data.bab_world import generate_story
    from luka_bench.data.babilong import BABILong
    from luka_bench.data.base import evidence_positions

    tok = tiny_llama.tokenizer
    task = BABILong(task="qa2", length="1k", limit=2)
    task.prepare(tok)
    for k, ex in enumerate(task.examples()):
        story = generate_story("qa2", random.Random(f"babilong:42:qa2:{k}"))
        block = task.context_block(ex)
        spans = task.evidence_spans(ex)
        assert [block[a:b] for a, b in spans] == [story.facts[i] for i in story.supporting]
        pos = evidence_positions(tok, False, block, spans)
        ids = tok(block, add_special_tokens=True).input_ids
        assert tok.decode([ids[p] for p in pos]) == "".join(story.facts[i] for i in story.supporting)


def test_gemma3_sliding_layers_keep_their_window_full_layers_the_closed_form(tiny_gemma3):
    model = tiny_gemma3.model
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(4))
    c = run_laser(model, LaserKV(budget=0.25, block_size=64), ids)
    window = model.config.sliding_window
    for s in c.stores:
        assert s.seen == 200
        assert s.n == (window - 1 if s.is_sliding else held_tokens(200, 64, 0.25, 4))
