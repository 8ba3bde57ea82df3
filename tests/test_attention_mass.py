"""attention_with_mass (base.py): the column masses H2O and LuKA's attention-weighted compressor read, computed
without softmax weights on a causal prefill (a flash pass, then tiles from its log-sum-exp), equal the explicit float64 softmax's; outputs
equal exact attention. The explicit fallback (decode steps, chunks after a prefix, no kernel) too."""
import pytest
import torch

from luka_bench.methods import base


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
@pytest.mark.parametrize("kernel", [True, False])
def test_masses_equal_explicit_softmax(n, lq, hq, hkv, kernel, monkeypatch):
    if not kernel:  # the explicit path (other devices / torch builds without the CPU flash kernel)
        monkeypatch.setattr(base, "_flash_with_lse", lambda *a, **k: None)
    torch.manual_seed(n + lq)
    q = torch.randn(1, hq, lq, 32) * 3  # peaked attention: masses over many orders of magnitude
    k, v = torch.randn(1, hkv, n, 32) * 3, torch.randn(1, hkv, n, 32)
    out, mass = base.attention_with_mass(_Store(k, v), q, 32 ** -0.5, chunk=64)
    ref_out, ref_mass = _reference(q, k, v, 32 ** -0.5)
    assert mass.dtype == torch.float32 and mass.shape == (1, hkv, n)
    torch.testing.assert_close(mass.double(), ref_mass, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mass.sum(), torch.tensor(float(hq * lq)), rtol=1e-5, atol=0)


def test_flash_path_is_taken_on_a_cpu_prefill(monkeypatch):
    """The prefill must not fall back to the explicit weights silently (that was 3x full's prefill)."""
    calls = []
    real = base._flash_with_lse
    monkeypatch.setattr(base, "_flash_with_lse", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = torch.randn(1, 4, 50, 16), torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)
    out, mass = base.attention_with_mass(_Store(k, v), q, 0.25)
    assert len(calls) == 1
    torch.testing.assert_close(out, base.sdpa(q, k, v, 0.25), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk,tile", [(64, 256), (16, 48), (7, 7), (32, 1024)])
def test_tiled_masses_from_lse_equal_explicit_softmax(chunk, tile):
    """The tiled column-mass pass: any tiling, a batch of two, group heads, a length no tile size divides."""
    torch.manual_seed(chunk + tile)
    b, hq, hkv, n, d = 2, 6, 2, 301, 16
    q, k, v = torch.randn(b, hq, n, d) * 3, torch.randn(b, hkv, n, d) * 3, torch.randn(b, hkv, n, d)
    ke = k.repeat_interleave(hq // hkv, 1)
    lse = ((q @ ke.transpose(-1, -2)) * 0.25).masked_fill(
        torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).logsumexp(-1)
    mass = base._mass_from_lse(q, k, lse, 0.25, chunk=chunk, tile=tile)
    torch.testing.assert_close(mass.double(), _reference(q, k, v, 0.25)[1], rtol=1e-4, atol=1e-6)
