"""The Triton attention-with-mass kernel (``luka_bench/methods/triton_kernel.py``), the prefill pass of the
mass-reading methods on CUDA: output, column masses (per KV head, summed over the group's query heads and the
queries) and entropies equal a float64 explicit softmax on small shapes — GQA 3:1, head sizes 64 and 128, query
chunks that are not multiples of the tiles, with and without a prefix of earlier keys — in fp32, bf16 and fp16.

On the CPU it runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py); with
``LUKA_TEST_DEVICE=cuda`` the same tests compile it for the GPU. Tolerances: fp32 products are IEEE fp32, so
1e-5 (a few thousand fp32 terms). In half precision the inputs are rounded first (the reference uses the same
rounded inputs); masses and entropies come from fp32 logits of those inputs (1e-5); the output is
sum_j p_j v_j with p_j rounded to the value dtype before the product (as flash attention does) and the output
rounded at the end: relative error up to ~2 ulp of the dtype, 2^-7 for bf16, 2^-10 for fp16, of |v| ~ 3."""
from __future__ import annotations

import pytest
import torch

from luka_bench.methods import attention, triton_kernel

from conftest import DEVICE

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(triton_kernel.triton is None, reason="triton not installed (pip install triton)")]
if DEVICE == "cpu" and triton_kernel.triton is not None and not triton_kernel.interpreted():
    raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set (see tests/conftest.py)")

OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _reference(qs, k, v, past):
    """float64: qs [BH, g, Lq, D] scaled, k/v [BH, N, D]; query i sees keys 0..past + i."""
    n, lq = k.shape[1], qs.shape[2]
    s = torch.einsum("bgqd,bnd->bgqn", qs.double(), k.double())
    hidden = torch.arange(n, device=qs.device)[None, :] > past + torch.arange(lq, device=qs.device)[:, None]
    p = s.masked_fill(hidden, float("-inf")).softmax(-1)
    ent = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
    return p @ v.double()[:, None], p.sum((1, 2)), ent


CASES = [  # (batch x KV heads, group, query chunk, prefix, head dim, dtype)
    (2, 3, 70, 0, 64, torch.float32),     # a whole prefill, 70 = 64 + 6 queries
    (2, 3, 45, 83, 128, torch.float32),   # a chunk after a prefix: keys 0..127 ragged against the 64-tiles
    (1, 3, 100, 29, 64, torch.bfloat16),
    (2, 3, 65, 0, 128, torch.float16),
]


@pytest.mark.parametrize("bh,g,lq,past,d,dtype", CASES, ids=[f"{c[5]}-d{c[4]}-lq{c[2]}-past{c[3]}"[6:] for c in CASES])
def test_kernel_equals_float64_softmax(bh, g, lq, past, d, dtype):
    gen = torch.Generator().manual_seed(lq + past + d)
    qs = (torch.randn(bh, g, lq, d, generator=gen) * 3 * d ** -0.5).to(DEVICE, dtype)  # peaked: masses span decades
    k = torch.randn(bh, past + lq, d, generator=gen).to(DEVICE, dtype)
    v = (torch.randn(bh, past + lq, d, generator=gen) * 3).to(DEVICE, dtype)
    out, mass, ent = triton_kernel.attention_mass(qs, k, v, past, entropy=True)
    ref_out, ref_mass, ref_ent = _reference(qs, k, v, past)
    assert out.dtype == dtype and mass.dtype == torch.float32 and ent.dtype == torch.float32
    errs = {"out": (out.double() - ref_out).abs().max().item(), "mass": (mass.double() - ref_mass).abs().max().item(),
            "entropy": (ent.double() - ref_ent).abs().max().item()}
    print(f"triton kernel vs float64 ({str(dtype)[6:]}, d={d}, lq={lq}, past={past}): max abs errors {errs}")
    torch.testing.assert_close(mass.double(), ref_mass, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=OUT_TOL[dtype], atol=OUT_TOL[dtype] * 3)
    # every query's weights sum to 1: the masses add up to the number of (query head, query) rows
    assert abs(mass.sum().item() - bh * g * lq) < 1e-4 * bh * g * lq


def test_kernel_reads_keys_through_strides():
    """The store's keys are views of a larger storage (row stride = capacity x D): read in place, not copied."""
    gen = torch.Generator().manual_seed(3)
    storage = torch.randn(2, 100, 64, generator=gen).to(DEVICE)
    k, v = storage[:, :70], storage[:, 10:80] * 2
    qs = (torch.randn(2, 3, 70, 64, generator=gen) * 0.2).to(DEVICE)
    out, mass, _ = triton_kernel.attention_mass(qs, k, v, 0)
    ref_out, ref_mass, _ = _reference(qs, k, v, 0)
    torch.testing.assert_close(mass.double(), ref_mass, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernel is chosen on CUDA only (LUKA_TEST_DEVICE=cuda)")
def test_cuda_prefill_takes_the_kernel_and_equals_the_explicit_path(monkeypatch):
    """On CUDA a prefill of a mass-reading method takes the kernel; its output and masses equal the explicit
    path's (its reference there), also through attention_with_extra's entropies (entropy_ols)."""
    calls = []
    real = triton_kernel.attention_mass
    monkeypatch.setattr(triton_kernel, "attention_mass", lambda *a, **k: calls.append(1) or real(*a, **k))

    class _Store:
        def __init__(self, k, v):
            self.keys, self.values = k, v

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 6, 300, 64, generator=gen).to("cuda")
    k, v = torch.randn(1, 2, 300, 64, generator=gen).to("cuda"), torch.randn(1, 2, 300, 64, generator=gen).to("cuda")
    out, mass, _, ent, _ = attention.attention_with_extra(_Store(k, v), q, 0.125)
    assert len(calls) == 1
    monkeypatch.setenv("LUKA_BENCH_NO_KERNEL", "1")
    ref_out, ref_mass, _, ref_ent, _ = attention.attention_with_extra(_Store(k, v), q, 0.125)
    assert len(calls) == 1
    torch.testing.assert_close(mass, ref_mass, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-4, atol=1e-5)
