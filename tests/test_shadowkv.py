"""shadowkv: full rank with every chunk selected is full attention; the rebuilt keys at full rank are the original
keys, and at rank r the rank-r SVD of the pre-RoPE keys rotated back; every decode step and layer equals a slow
loop reference (landmarks, outliers, softmax per query head and max over the group, keys rebuilt from an SVD of
the un-rotated keys); the local, outlier and selected sets are disjoint; short prompts and the prefill are exact; a
question after the prefill reads the rebuilt prompt; the store drops the factored prompt, and what the method holds
is what it reports, less than full attention; the memory report; dense first layers; the fixed-shape step equals
the step at Python slots; one-line errors for bad settings."""
from __future__ import annotations

import pytest
import torch

from conftest import fixed_and_python_slots
from luka_bench.methods.base import MethodConfigError
from luka_bench.methods.full import Full
from luka_bench.methods.hf import attach
from luka_bench.methods.policies import StaticExactPolicy
from luka_bench.methods.shadowkv import ShadowKV, ShadowKVPolicy
from luka_bench.methods.store import KVStore

from test_quest import decode, ids_of


def decode_factored(model, method, ids, prefill, observer=None, before=None):
    """``decode`` through a manual cache that keeps, per layer, the store's keys and values [B, Hkv, prefill, D] as
    the prefill left them, before the compression drops the factored prompt: (logits per step, the cache, that
    list). ``before``: a list to fill with them (an observer reads it during the steps)."""
    before = [] if before is None else before
    steps = []
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=prefill, manual=True)
        model(ids[:, :prefill], past_key_values=c)
        before.extend((s.keys.clone(), s.values.clone()) for s in c.stores)
        c.end_prefill()
        c.observer = observer
        for t in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, t: t + 1], past_key_values=c).logits[0, -1])
    return steps, c, before


# 100-token prompt, chunks of 4: 25 chunks, 23 before the 2 local ones, 3 outliers, 20 landmarks
SMALL = dict(chunk=4, local_chunks=2, outliers=3)


@pytest.mark.parametrize("arch", ["tiny_gqa3", "tiny_qwen3", "tiny_gemma3"])
def test_full_rank_with_every_chunk_selected_is_full_attention(arch, request):
    lm = request.getfixturevalue(arch)
    ids = ids_of(130)
    ref, _ = decode(lm.model, Full(), ids, 100)
    got, c = decode(lm.model, ShadowKV(token_budget=80, **SMALL), ids, 100)  # 20 chunks of 4: every landmark
    sparse = [s for s in c.stores if isinstance(s.policy, ShadowKVPolicy)]  # Gemma3: its global layers only
    assert sparse and all(s.policy.ready and s.policy.rank == s.keys.shape[1] * s.keys.shape[3] for s in sparse)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    got, c = decode(lm.model, ShadowKV(token_budget=40, rank=8, **SMALL), ids, 100)
    assert c.attended_stats()["attended_ratio"] < 1.0
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(ref, got))


@pytest.mark.parametrize("arch", ["tiny_gqa3", "tiny_qwen3", "tiny_gemma3"])
def test_rebuilt_keys_are_the_rank_r_keys_rotated(arch, request):
    """At full rank the rebuilt keys are the stored (post-RoPE) keys; at rank r they are the best rank-r
    approximation of the concatenated pre-RoPE keys (un-rotated with the model's RoPE, here by its own cos/sin),
    rotated back."""
    lm = request.getfixturevalue(arch)
    for rank in (10 ** 6, 5):
        _, c, before = decode_factored(lm.model, ShadowKV(token_budget=40, rank=rank, **SMALL), ids_of(110, 1), 100)
        for s, (K, _) in zip(c.stores, before):
            pol = s.policy
            if not isinstance(pol, ShadowKVPolicy):
                continue
            b, hkv, _, d = K.shape
            n0 = pol.n0
            pos = torch.arange(n0).expand(b, hkv, n0)
            got = pol.rebuilt_keys(s, pos)
            K = K.double()  # the keys as the prefill left them: the store no longer holds positions 0..L0-1
            if rank > hkv * d:
                torch.testing.assert_close(got.double(), K, atol=1e-5, rtol=1e-5)
                continue
            cos, sin = s.rope_cos_sin(torch.arange(n0).view(1, n0))  # pure rotations [n0, rot]
            cos, sin, rot = cos.double(), sin.double(), cos.shape[-1]
            half = rot // 2

            def rh(x):
                return torch.cat([-x[..., half:rot], x[..., :half]], -1)

            pre = K.clone()
            pre[..., :rot] = K[..., :rot] * cos - rh(K) * sin
            X = pre.transpose(1, 2).reshape(b, n0, hkv * d)
            u, sv, vh = torch.linalg.svd(X, full_matrices=False)
            low = (u[..., :rank] * sv[:, None, :rank]) @ vh[:, :rank]
            low = low.view(b, n0, hkv, d).transpose(1, 2)
            want = low.clone()
            want[..., :rot] = low[..., :rot] * cos + rh(low) * sin
            torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)


def slow_reference(q, K, V, scaling, n0, m: ShadowKV, low_keys):
    """One decode query over a layer's held keys/values, in loops per KV head: chunks of the prompt's first
    n0 // chunk - local_chunks chunks, landmarks (mean key), outliers (lowest min cosine), per query head the softmax
    over the other landmarks, max over the group, top token_budget / chunk chunks with ``low_keys`` (the rebuilt
    keys), attention over outliers + selected + local + tail. Returns (out, read mask, (outliers, selected))."""
    _, hq, _, d = q.shape
    hkv, n = K.shape[1], K.shape[2]
    g, cs = hq // hkv, m.chunk
    chunks = n0 // cs - m.local_chunks
    out = torch.empty(1, hq, 1, V.shape[-1])
    read = torch.zeros(1, hkv, n, dtype=torch.bool)
    sets = []
    for kv in range(hkv):
        lms, mins = [], []
        for ci in range(chunks):
            keys = K[0, kv, ci * cs: (ci + 1) * cs].double()
            lm = keys.mean(0)
            lms.append(lm)
            mins.append(min(float(torch.nn.functional.cosine_similarity(lm, k, dim=0)) for k in keys))
        outl = sorted(range(chunks), key=lambda ci: mins[ci])[: m.outliers]
        rest = [ci for ci in range(chunks) if ci not in outl]
        best = {ci: 0.0 for ci in rest}
        for h in range(kv * g, (kv + 1) * g):
            lg = torch.stack([q[0, h, 0].double() @ lms[ci] for ci in rest]) * scaling
            p = torch.softmax(lg, 0)
            for i, ci in enumerate(rest):
                best[ci] = max(best[ci], float(p[i]))
        sel = sorted(rest, key=lambda ci: -best[ci])[: m.token_budget // cs]
        sets.append((sorted(outl), sorted(sel)))
        exact = [t for ci in outl for t in range(ci * cs, (ci + 1) * cs)] + list(range(chunks * cs, n))
        rebuilt = [t for ci in sel for t in range(ci * cs, (ci + 1) * cs)]
        keys = torch.cat([K[0, kv, exact].double(), low_keys[0, kv, rebuilt].double()])
        vals = torch.cat([V[0, kv, exact].double(), V[0, kv, rebuilt].double()])
        read[0, kv, exact + rebuilt] = True
        for h in range(kv * g, (kv + 1) * g):
            w = torch.softmax((q[0, h, 0].double() @ keys.T) * scaling, -1)
            out[0, h, 0] = (w @ vals).float()
    return out, read, sets


def test_every_step_and_layer_equals_the_slow_reference(tiny_gqa3):
    m = ShadowKV(token_budget=24, rank=6, **SMALL)
    checked, before = [], []

    def observer(store, query, out, scaling):
        pol = store.policy
        if not isinstance(pol, ShadowKVPolicy) or pol.pos is None:
            return
        # every key and value at its position: positions 0..L0-1 as the prefill left them (V0 holds their values),
        # then the store (slot i: position L0 + i)
        K0, V0 = before[pol.info.layer_idx]
        assert torch.equal(pol.V0, V0[:, :, : pol.L0])
        assert torch.equal(store.keys[:, :, : pol.n0 - pol.L0], K0[:, :, pol.L0:])
        K = torch.cat([K0[:, :, : pol.L0], store.keys], dim=2)
        V = torch.cat([V0[:, :, : pol.L0], store.values], dim=2)
        low = pol.rebuilt_keys(store, torch.arange(pol.n0).expand(1, K.shape[1], pol.n0))
        want, read, sets = slow_reference(query, K, V, scaling, pol.n0, m, low)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
        assert torch.equal(pol.attended(store), read)
        assert pol.attended_count(store) == pytest.approx(float(read.sum()) / read.shape[1])
        outl, sel, _ = pol.sets()
        for kv, (o, s) in enumerate(sets):
            assert sorted(set((outl[0, kv] // m.chunk).tolist())) == o
            assert sorted(set((sel[0, kv] // m.chunk).tolist())) == s
        checked.append(1)

    decode_factored(tiny_gqa3.model, m, ids_of(115, 2), 100, observer, before)
    assert len(checked) == 3 * 15


def test_the_local_outlier_and_selected_sets_are_disjoint(tiny_gqa3):
    def observer(store, query, out, scaling):
        pol = store.policy
        if pol.pos is None:
            return
        outl, sel, local = pol.sets()
        allp = torch.cat([outl, sel, local], dim=-1)
        for row in allp.view(-1, allp.shape[-1]):
            assert len(set(row.tolist())) == row.numel()  # no position twice
        assert int(sel.max()) < pol.L0 and int(outl.max()) < pol.L0  # both before the local part
        assert local.shape[-1] == pol.n0 - pol.L0 >= 2 * 4

    decode(tiny_gqa3.model, ShadowKV(token_budget=40, rank=8, **SMALL), ids_of(120, 3), 103, observer)


def test_short_prompts_the_prefill_and_the_question_at_full_rank_are_exact(tiny_gqa3):
    ids = ids_of(150, 1)
    with attach(tiny_gqa3.model, Full()) as a, torch.no_grad():
        ref = tiny_gqa3.model(ids, past_key_values=a.new_cache()).logits
    with attach(tiny_gqa3.model, ShadowKV(token_budget=40, rank=10 ** 6, **SMALL)) as a, torch.no_grad():
        c = a.new_cache()
        got = tiny_gqa3.model(ids[:, :100], past_key_values=c).logits
        # a multi-token chunk after the prefill: over the rebuilt prompt, its keys exact at full rank
        got2 = tiny_gqa3.model(ids[:, 100:], past_key_values=c).logits
    assert all(s.policy.ready for s in c.stores)
    torch.testing.assert_close(got, ref[:, :100], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got2, ref[:, 100:], atol=2e-5, rtol=1e-5)
    assert all(s.policy.attended(s) is None for s in c.stores)
    # a prompt with fewer landmarks than the budget's chunks stays exact, its store whole
    ref, _ = decode(tiny_gqa3.model, Full(), ids, 100)
    got, c = decode(tiny_gqa3.model, ShadowKV(token_budget=84, rank=4, **SMALL), ids, 100)
    assert not any(s.policy.ready for s in c.stores)
    assert all(s.n == 150 and s.policy.extra_bytes() == 0 and s.policy.report(s) == {} for s in c.stores)
    for a_, b_ in zip(ref, got):
        torch.testing.assert_close(a_, b_, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["tiny_gqa3", "tiny_gemma3"])
def test_a_question_after_the_prefill_reads_the_rebuilt_prompt(arch, request):
    """A multi-token chunk after the prefill attends over what ShadowKV holds: its logits are full attention's over
    the rebuilt keys (U SV, RoPE at their positions) of positions 0..L0-1 with V0, and the exact store after them."""
    lm = request.getfixturevalue(arch)
    ids = ids_of(110, 4)
    with attach(lm.model, ShadowKV(token_budget=40, rank=4, **SMALL)) as a, torch.no_grad():
        c = a.new_cache()
        lm.model(ids[:, :100], past_key_values=c)
        got = lm.model(ids[:, 100:], past_key_values=c).logits
    with attach(lm.model, Full()) as a, torch.no_grad():
        exact = lm.model(ids, past_key_values=a.new_cache()).logits[:, 100:]
        r = a.new_cache()
        lm.model(ids[:, :100], past_key_values=r)
        sparse = 0
        for s, sk in zip(r.stores, c.stores):
            pol = sk.policy
            if not isinstance(pol, ShadowKVPolicy):
                continue
            assert pol.ready and sk.n == 100 - pol.L0 + 10
            L0, (b, hkv) = pol.L0, s.keys.shape[:2]
            assert torch.equal(pol.V0, s.values[:, :, :L0])
            assert torch.equal(sk.keys[:, :, : 100 - L0], s.keys[:, :, L0:])
            s.keys[:, :, :L0] = pol.rebuilt_keys(sk, torch.arange(L0).expand(b, hkv, L0))
            sparse += 1
        want = lm.model(ids[:, 100:], past_key_values=r).logits
    assert sparse
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert float((got - exact).abs().max()) > 1e-4  # rank 4: not the exact keys


def tensor_bytes(objs) -> int:
    """Bytes of every tensor storage reached from ``objs`` (tensors, tuples or lists of them, objects' attributes),
    each storage once."""
    storages: dict[int, int] = {}

    def visit(x):
        if isinstance(x, torch.Tensor):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, (tuple, list)):
            for y in x:
                visit(y)

    for o in objs:
        visit(o)
    return sum(storages.values())


def test_the_store_drops_the_factored_prompt_and_holds_less_than_full(tiny_llama):
    """After the prefill the store holds the local part only (positions L0..n0-1, its storage that wide); the
    policy holds V0 and the factors; every tensor the policy and the store hold adds up to ``held_bytes`` within
    5 % (the positions table is bookkeeping, left out), and that is less than full attention's at the default's rank
    ratio (160 of Llama-3-8B's 1024 key channels per token: 5 of 32 here)."""
    model = tiny_llama.model
    n0, L0, steps = 400, (50 - 2) * 8, 17  # 50 chunks of 8, the last 2 local
    m = ShadowKV(token_budget=64, chunk=8, local_chunks=2, outliers=4, rank=5)
    ids = ids_of(n0 + steps, 7)

    def held_tensors(c) -> int:
        return tensor_bytes([*(list(vars(s.policy).values()) for s in c.stores), *(s.storage() for s in c.stores)])

    with attach(model, m) as a, torch.no_grad():
        c = a.new_cache(reference_length=n0, manual=True)
        model(ids[:, :n0], past_key_values=c)
        before = [(s.keys.clone(), s.values.clone()) for s in c.stores]
        c.end_prefill()
        for s, (k, v) in zip(c.stores, before):
            assert s.policy.ready and s.policy.L0 == L0 and s.policy.rank == 5
            assert (s.n, s.seen) == (n0 - L0, n0)
            assert s.storage()[0].shape[2] == s.storage()[1].shape[2] == n0 - L0  # reallocated: L0 slots freed
            assert torch.equal(s.keys, k[:, :, L0:]) and torch.equal(s.values, v[:, :, L0:])
            assert torch.equal(s.policy.V0, v[:, :, :L0]) and s.policy.V0.is_contiguous()
            assert torch.equal(s.positions, torch.arange(L0, n0).expand_as(s.positions))
        assert c.peak_bytes == c.held_bytes()
        assert held_tensors(c) == pytest.approx(c.held_bytes(), rel=0.05)
        assert c.held_bytes() < c.full_bytes()
        for t in range(n0, n0 + steps):
            model(ids[:, t: t + 1], past_key_values=c)
    for s in c.stores:
        assert (s.n, s.seen) == (n0 - L0 + steps, n0 + steps)
        assert s.n <= s.storage()[0].shape[2] <= int((n0 - L0) * KVStore.GROWTH) + 16  # one decode growth
        assert torch.equal(s.positions, torch.arange(L0, n0 + steps).expand_as(s.positions))
    assert c.peak_bytes == c.held_bytes()  # it grows by one token per step
    assert held_tensors(c) == pytest.approx(c.held_bytes(), rel=0.05)
    assert c.held_bytes() < c.full_bytes()


def test_memory_is_reported(tiny_llama):
    m = ShadowKV(token_budget=40, rank=6, **SMALL)
    _, c = decode(tiny_llama.model, m, ids_of(120), 100)
    stats = c.method_report()
    s = c.stores[0]
    b, hkv, _, d = s.keys.shape
    v0 = 92 * b * hkv * d * s.values.element_size()  # L0 = 23 chunks of 4: their values, per layer
    assert "harness_only_bytes" not in stats
    assert stats["offloaded_bytes"] == v0 * len(c.stores)
    assert stats["real_bytes"] == c.held_bytes()
    assert stats["device_bytes"] == c.held_bytes() - v0 * len(c.stores)
    assert all(x.n == 100 - 92 + 20 and x.held_bytes() == x.n * x.token_bytes() for x in c.stores)
    assert stats["fair_entries"] == 120  # the store's 28 tokens and the 92 positions held as V0 and rows of U
    assert c.held_bytes() == sum(x.held_bytes() + x.policy.extra_bytes() for x in c.stores)
    pol = s.policy
    assert pol.extra_bytes() == sum(t.nbytes for t in (pol.U, pol.W, pol.lm, pol.lm_base, *pol.outlier_kv,
                                                       pol.V0)) + pol.rope_bytes
    # the RoPE table (cos, sin per prompt position; fp32 keys) is shared by the layers: counted once
    assert [x.policy.rope_bytes for x in c.stores] == [100 * 2 * d * 4] + [0] * (len(c.stores) - 1)
    assert all(x.policy.rope_rows is pol.rope_rows for x in c.stores)
    assert pol.U.shape == (100, 6) and pol.U.is_contiguous()  # U over every prompt token, rank 6
    assert pol.U.untyped_storage().nbytes() == pol.U.nbytes  # not a view of the SVD's whole U
    assert c.peak_bytes == c.held_bytes()


def test_dense_first_layers_are_untouched(tiny_qwen3):
    outs = {}

    def observer(store, query, out, scaling):
        outs.setdefault(store.policy.info.layer_idx, []).append(out)

    decode(tiny_qwen3.model, Full(), ids_of(120, 3), 100, observer)
    full_outs, outs = outs, {}
    _, c = decode(tiny_qwen3.model, ShadowKV(token_budget=40, rank=4, full_layers=2, **SMALL), ids_of(120, 3), 100,
                  observer)
    assert [type(s.policy) for s in c.stores] == [StaticExactPolicy, StaticExactPolicy, ShadowKVPolicy]
    for layer in (0, 1):
        for a, b in zip(full_outs[layer], outs[layer]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(full_outs[2], outs[2]))


def test_fixed_shape_step_equals_the_step_at_python_slots(tiny_gqa3, monkeypatch):
    (fixed, grew), (plain, _) = fixed_and_python_slots(
        monkeypatch, tiny_gqa3.model, lambda: ShadowKV(token_budget=40, rank=6, **SMALL),
        [ShadowKVPolicy], ids_of(160, 5), 100, 130, lambda c: [s.policy.pos.clone() for s in c.stores])
    assert grew
    for (lf, tf), (lp, tp) in zip(fixed, plain):
        torch.testing.assert_close(lf, lp, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a_, b_) for a_, b_ in zip(tf, tp))


@pytest.mark.parametrize("bad,says", [
    (dict(chunk=0), "method.chunk=0 must be an integer >= 1"),
    (dict(rank=0), "method.rank=0 must be an integer >= 1"),
    (dict(rank=1.5), "method.rank=1.5"),
    (dict(outliers=-1), "method.outliers=-1 must be an integer >= 0"),
    (dict(local_chunks=-2), "method.local_chunks=-2"),
    (dict(token_budget=100), "method.token_budget=100 is not a multiple of method.chunk=8"),
    (dict(token_budget=0), "method.token_budget=0 must be an integer >= 1"),
    (dict(budget=0.5), "allowed: 1.0"),
    (dict(full_layers=-1), "method.full_layers=-1"),
])
def test_bad_settings_are_one_line_errors(bad, says):
    with pytest.raises(MethodConfigError) as e:
        ShadowKV(**bad)
    assert says in str(e.value) and "\n" not in str(e.value)
