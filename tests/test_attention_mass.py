"""attention_with_mass (attention.py): the column masses H2O and LuKA's attention-weighted compressor read, computed
by the blocked single pass on a CPU prefill (one block of logits at a time), equal the explicit float64
softmax's; outputs equal exact attention. The batched explicit path (decode steps, short chunks, other devices)
too."""
import pytest
import torch

from luka_bench.methods import attention


class _Store:
    def __init__(self, k, v):
        self.keys, self.values = k, v


def _reference(q, k, v, scaling):
    """float64 explicit softmax: output [B, Hq, Lq, D] and column masses summed over queries and group heads."""
    b, hq, lq, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    ke, ve = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    logits = (q.double() @ ke.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(torch.ones(lq, n, dtype=torch.bool).triu(n - lq + 1), float("-inf"))
    w = logits.softmax(-1)
    return w @ ve, w.sum(2).view(b, hkv, g, n).sum(2)


@pytest.mark.parametrize("n,lq,hq,hkv", [(300, 300, 6, 2), (257, 257, 4, 4), (300, 40, 6, 2), (300, 1, 6, 3)])
@pytest.mark.parametrize("blocked", [True, False])
def test_masses_equal_explicit_softmax(n, lq, hq, hkv, blocked, monkeypatch):
    # blocked: every chunk of 2+ queries takes the single pass (also the 40 queries after a 260-token prefix);
    # otherwise the batched explicit path (other devices)
    monkeypatch.setattr(attention, "BLOCKED_MIN_QUERIES", 2 if blocked else 10 ** 9)
    torch.manual_seed(n + lq)
    q = torch.randn(1, hq, lq, 32) * 3  # peaked attention: masses over many orders of magnitude
    k, v = torch.randn(1, hkv, n, 32) * 3, torch.randn(1, hkv, n, 32)
    out, mass = attention.attention_with_mass(_Store(k, v), q, 32 ** -0.5, chunk=64)
    ref_out, ref_mass = _reference(q, k, v, 32 ** -0.5)
    assert mass.dtype == torch.float32 and mass.shape == (1, hkv, n)
    torch.testing.assert_close(mass.double(), ref_mass, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mass.sum(), torch.tensor(float(hq * lq)), rtol=1e-5, atol=0)


def test_blocked_path_is_taken_on_a_cpu_prefill(monkeypatch):
    """A CPU prefill must not fall back to the batched explicit weights silently (that was 3x full's prefill)."""
    calls = []
    real = attention._blocked_attention
    monkeypatch.setattr(attention, "_blocked_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = torch.randn(1, 4, 150, 16), torch.randn(1, 2, 150, 16), torch.randn(1, 2, 150, 16)
    out, mass = attention.attention_with_mass(_Store(k, v), q, 0.25)
    assert len(calls) == 1
    torch.testing.assert_close(out, attention.sdpa(q, k, v, 0.25), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", [True, False], ids=["fused_kernel", "torch_loop"])
@pytest.mark.parametrize("block,past", [(64, 0), (16, 0), (7, 0), (1024, 0), (16, 45), (7, 1), (None, 0),
                                        (None, 45)])
def test_blocked_pass_any_block_and_prefix(block, past, kernel):
    """The single pass — the fused C++ kernel and the pure-torch loop it replaces: any block size (one that
    divides nothing, one longer than the chunk, each path's default), a batch of two, group heads, queries after
    a prefix; output, masses and entropies against float64."""
    torch.manual_seed((block or 0) + past)
    b, hq, hkv, n, d = 2, 6, 2, 301, 16
    q = torch.randn(b, hq, n - past, d) * 3
    k, v = torch.randn(b, hkv, n, d) * 3, torch.randn(b, hkv, n, d)
    out, mass, ent = attention._blocked_attention(q, k, v, 0.25, past, block=block, entropy=True, kernel=kernel)
    ref_out, ref_mass = _reference(q, k, v, 0.25)
    torch.testing.assert_close(mass.double(), ref_mass, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)
    ke = k.double().repeat_interleave(hq // hkv, 1)
    logp = ((q.double() @ ke.transpose(-1, -2)) * 0.25).masked_fill(
        torch.ones(n - past, n, dtype=torch.bool).triu(past + 1), float("-inf")).log_softmax(-1)
    ref_ent = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    # H = m + log l - s q.(sum_j p_j k_j) in fp32: a difference of terms of ~10-30 nats (eps 1.2e-7 each), so a
    # near-zero entropy carries ~1e-5 absolute error; 2e-5 failed by 2.3e-5 on one of 3,600 entries on an AVX512
    # build of the kernel (block 7, prefix 1), 5e-5 is ~4x the rounding
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-4, atol=5e-5)


def test_fused_kernel_is_built_here():
    """CI builds the fused kernel (scripts/setup.sh); a silent fallback to the torch loop would hide a broken
    build behind passing tests. LUKA_BENCH_NO_KERNEL=1 is the one way to ask for the loop."""
    from luka_bench.methods import cpu_kernel
    if cpu_kernel.disabled():
        assert cpu_kernel.attention_mass_op() is None
    else:
        assert cpu_kernel.attention_mass_op() is not None


def test_fused_kernel_equals_the_torch_loop_on_awkward_inputs():
    """Logit gaps far past float underflow (weights that must come out exactly 0, not NaN), a head dimension no
    vector width divides, non-contiguous keys (a store's view), one KV head per query head, a query chunk shorter
    than a block, batch 3: the kernel and the loop both give float64's output, masses and entropies (logits here
    reach the hundreds, so float32 is good to ~1e-4 absolute)."""
    torch.manual_seed(5)
    b, hq, hkv, n, lq, d = 3, 5, 5, 90, 70, 13
    q = torch.randn(b, hq, lq, d) * 40
    k = torch.randn(b, hkv, 2 * n, d)[:, :, ::2] * 4  # every other row: not contiguous
    v = torch.randn(b, hkv, n, d)
    sc, past = d ** -0.5, n - lq
    logp = ((q.double() @ k.double().transpose(-1, -2)) * sc).masked_fill(
        torch.ones(lq, n, dtype=torch.bool).triu(past + 1), float("-inf")).log_softmax(-1)
    w = logp.exp()
    ref = (w @ v.double(), w.sum(2), -(w * logp.nan_to_num(neginf=0.0)).sum(-1))
    for kernel in (True, False):
        got = attention._blocked_attention(q, k, v, sc, past, entropy=True, kernel=kernel)
        assert all(torch.isfinite(t).all() for t in got)
        for a, r, tol in zip(got, ref, (2e-4, 1e-4, 5e-4)):
            torch.testing.assert_close(a.double(), r, rtol=0, atol=tol)
        assert (got[1] == 0).any()  # some keys get no mass at all: the underflow path ran


@pytest.mark.parametrize("d", [64, 128])
def test_fused_kernel_at_real_head_sizes_and_2k_keys(d):
    """Real shapes: head dims 64 and 128 (SmolLM2 / most 1-8B models), 2,304 keys, SmolLM2's 3 query heads per KV
    head; a chunk of 256 queries after a 2,048-token prefix (the kernel's per-block max, exp and GEMV over a long
    key axis, several key tiles per row): output, masses and entropies against float64."""
    torch.manual_seed(d)
    b, hq, hkv, n, lq = 1, 6, 2, 2304, 256
    past = n - lq
    q = torch.randn(b, hq, lq, d) * 1.5
    k, v = torch.randn(b, hkv, n, d) * 1.5, torch.randn(b, hkv, n, d)
    sc = d ** -0.5
    out, mass, ent = attention._blocked_attention(q, k, v, sc, past, entropy=True, kernel=True)
    ref_out, ref_mass = _reference(q, k, v, sc)
    ke = k.double().repeat_interleave(hq // hkv, 1)
    logp = ((q.double() @ ke.transpose(-1, -2)) * sc).masked_fill(
        torch.ones(lq, n, dtype=torch.bool).triu(past + 1), float("-inf")).log_softmax(-1)
    ref_ent = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    torch.testing.assert_close(mass.double(), ref_mass, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(mass.sum(), torch.tensor(float(hq * lq)), rtol=1e-5, atol=0)


@pytest.mark.parametrize("g, d", [(3, 64), (9, 13), (1, 128)])
def test_rows_attention_reads_the_rows_in_place_as_sdpa_over_them(g, d):
    """``attention.attend_rows`` on the CPU (the C++ ``rows_attention``: each chosen row read where it lies, no
    gathered copy) against float64 softmax attention over the gathered rows: head dims with and without the vector
    width (64, 13, 128), group sizes under and over the kernel's 8 (3, 9, 1), rows repeated, rows out of order, a
    finite bias on each row read, -inf on some (never read), logits far past underflow; the storage a view with gaps
    (one tensor of keys and values inside a larger one). Each (batch row, KV head) is its own: a row computed alone
    gives the same bits as in the batch."""
    from luka_bench.methods import cpu_kernel
    if cpu_kernel.rows_attention_op() is None:
        pytest.skip("the fused CPU kernel could not be built here")
    gen = torch.Generator().manual_seed(g * 100 + d)
    b, h, n, t = 3, 2, 300, 77
    big = torch.randn(2, n + 50, d, generator=gen)
    kv = big[:, 25: 25 + n]  # keys and values 2 x n rows, the halves n + 50 rows apart
    q = torch.randn(b, h, g, d, generator=gen) * 6
    idx = torch.randint(0, n, (b, h, t), generator=gen)
    idx[:, :, 5] = idx[:, :, 6]  # a row read twice
    bias = torch.randn(b, h, 1, t + 3, generator=gen) * 2  # a finite bias of its own on every row read
    bias[:, :, :, 60:] = float("-inf")
    bias[1, 0, 0, 10:20] = float("-inf")
    bias[2, 1, 0, 30] = -50.0
    out = attention.attend_rows(q, kv, idx, bias[..., :t], d ** -0.5)
    keys, values = kv.double()[0][idx], kv.double()[1][idx]  # [b, h, t, d]
    logits = torch.einsum("bhgd,bhtd->bhgt", q.double(), keys) * d ** -0.5 + bias[..., :t].double()
    ref = torch.einsum("bhgt,bhtd->bhgd", logits.softmax(-1), values)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for r in range(b):
        alone = attention.attend_rows(q[r: r + 1], kv, idx[r: r + 1], bias[r: r + 1, :, :, :t], d ** -0.5)
        assert torch.equal(alone, out[r: r + 1])


@pytest.mark.parametrize("g, d", [(3, 64), (9, 13), (4, 128)])
def test_segments_attention_reads_each_heads_own_segment(g, d):
    """The C++ ``segments_attention`` (a packed layer's decode step on the CPU, ``packed.step_attention``): each (batch
    row, KV head) attends over its own run of consecutive storage rows with its own run of the flattened bias, against
    float64 softmax attention over that run: segments of different lengths (1 to 301 rows, under and over the
    kernel's blocks) at any offsets, -inf slots inside them, a finite carried bias; a row alone gives the same bits."""
    from luka_bench.methods import cpu_kernel
    if cpu_kernel.segments_attention_op() is None:
        pytest.skip("the fused CPU kernel could not be built here")
    op = cpu_kernel.segments_attention_op()
    gen = torch.Generator().manual_seed(g * 10 + d)
    b, h, n = 3, 2, 2000
    kv = torch.randn(2, n, d, generator=gen)
    bias = torch.randn(3 * n, generator=gen) * 2
    bias[torch.rand(3 * n, generator=gen) < 0.2] = float("-inf")
    lens = [[301, 1], [77, 150], [16, 5]]
    first = [[10, 500], [900, 1200], [1500, 1700]]
    at = [[5000, 40], [3000, 2500], [100, 700]]
    for r in range(b):
        for j in range(h):
            bias[at[r][j]] = 0.0  # every segment reads at least one slot (a decode step's own token)
    q = torch.randn(b, h, g, d, generator=gen) * 6
    seg = torch.tensor([sum(first, []), sum(at, []), sum(lens, [])])
    out = op(q, kv, bias, seg, d ** -0.5)
    assert torch.isfinite(out).all()
    for r in range(b):
        for j in range(h):
            rows = slice(first[r][j], first[r][j] + lens[r][j])
            own = bias[at[r][j]: at[r][j] + lens[r][j]].double()
            logits = q[r, j].double() @ kv[0, rows].double().T * d ** -0.5 + own
            ref = logits.softmax(-1) @ kv[1, rows].double()
            torch.testing.assert_close(out[r, j].double(), ref, rtol=1e-5, atol=1e-5)
        alone = op(q[r: r + 1], kv, bias, seg.view(3, b, h)[:, r].contiguous(), d ** -0.5)
        assert torch.equal(alone, out[r: r + 1])
    bad = seg.clone()
    bad[2, 0] = n  # a segment past the storage's end
    with pytest.raises(RuntimeError, match="segment out of the storage"):
        op(q, kv, bias, bad, d ** -0.5)
