"""Masked grouped-query attention (issue 37, item 2): a prefill chunk after a prefix, LASER-KV's blocks and Gemma3's
sliding windows call ``attention.sdpa`` with a mask and fewer KV heads than query heads. PyTorch runs such a call with
``enable_gqa=True`` in its math backend on CUDA, which builds the whole [B, Hq, Lq, N] score matrix. These tests
check that the path taken never does: on the CPU the op dispatched is the fused flash kernel; where SDPA has no
fused masked-GQA kernel (``attention.fused_masked_gqa`` False: CUDA, mocked here) the keys and values are repeated per
query head and the call is plain masked multi-head SDPA (on CUDA: the memory-efficient kernel); and the peak memory
of a long chunk grows with chunk x N, not with chunk x N x heads — measured as the process's resident high-water
mark, which the math backend's scores do move (checked in the same test, so the measurement can fail)."""
from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from luka_bench.methods import attention


class _Ops(TorchDispatchMode):
    """Records every op dispatched, with its tensor arguments' shapes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.__name__.split(".")[0], [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))

    def names(self):
        return [n for n, _ in self.calls]


class _Store:
    """What ``exact_attention`` reads of a KVStore: a chunk of Lq new tokens after ``n - Lq`` held ones."""

    def __init__(self, k, v, window=None):
        self.keys, self.values = k, v
        self.n = self.seen = k.shape[2]
        self.device = k.device
        self.positions = torch.arange(self.n).expand(k.shape[0], k.shape[1], -1)


def _chunk(hq=8, hkv=2, lq=192, past=320, d=64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, lq, d, generator=gen).to(dtype)
    k = torch.randn(1, hkv, past + lq, d, generator=gen).to(dtype)
    v = torch.randn(1, hkv, past + lq, d, generator=gen).to(dtype)
    return q, k, v


def _reference(q, k, v, mask, scaling):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scaling
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv


MATH_OPS = {"_scaled_dot_product_attention_math", "_softmax", "bmm"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("window", [None, 100], ids=["chunk_after_prefix", "sliding_window"])
def test_masked_gqa_chunk_takes_a_fused_kernel_not_math(dtype, window):
    """A masked GQA chunk on the CPU (the chunked prefill's and Gemma3's sliding-window masks, through
    ``exact_attention``): one fused flash op, none of the math backend's (bmm, softmax over [Hq, Lq, N])."""
    q, k, v = _chunk(dtype=dtype)
    store = _Store(k, v)
    mask = attention.chunk_mask(store, q.shape[2], window)
    assert mask is not None
    with _Ops() as ops:
        out = attention.exact_attention(store, q, 0.125, window)
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops.names(), ops.names()
    assert not MATH_OPS & set(ops.names()), ops.names()
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, 0.125), rtol=tol, atol=tol)


def test_masked_gqa_without_a_fused_kernel_expands_kv(monkeypatch):
    """Where SDPA has no fused masked-GQA kernel (CUDA; mocked with ``fused_masked_gqa`` False) a long masked chunk
    runs as multi-head SDPA over keys/values repeated per query head — exact — and no op ever holds [Hq, Lq, N];
    a short one (a masked decode step, whose scores are smaller than the copy) keeps the un-repeated call."""
    monkeypatch.setattr(attention, "fused_masked_gqa", lambda device: False)
    q, k, v = _chunk()
    store = _Store(k, v)
    mask = attention.chunk_mask(store, q.shape[2], None)
    with _Ops() as ops:
        out = attention.sdpa(q, k, v, 0.125, mask)
    flash = [shapes for name, shapes in ops.calls if name == "_scaled_dot_product_flash_attention_for_cpu"]
    assert len(flash) == 1 and flash[0][1][1] == q.shape[1], flash  # keys with Hq heads: no enable_gqa
    hq, lq, n = q.shape[1], q.shape[2], k.shape[2]
    assert all(hq * lq * n > max((torch.Size(s).numel() for s in shapes), default=0)
               for _, shapes in ops.calls), ops.calls
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, 0.125), rtol=1e-5, atol=1e-5)
    q1 = q[:, :, -4:]
    with _Ops() as ops:
        attention.sdpa(q1, k, v, 0.125, mask[-4:])
    flash = [shapes for name, shapes in ops.calls if name == "_scaled_dot_product_flash_attention_for_cpu"]
    assert flash and flash[0][1][1] == k.shape[1]  # un-repeated keys (enable_gqa)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_bytes(fn) -> int:
    """Resident memory the call added at most (Linux: VmHWM after resetting it via /proc/self/clear_refs)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    out = fn()
    peak = _status("VmHWM") - before
    del out
    return peak


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_long_chunk_peak_memory_grows_with_the_chunk_not_with_the_heads(monkeypatch):
    """16 query heads over 4 KV heads, N = 4,096 held keys, chunks of 256 and 512 queries: the chunk's attention
    adds at most ~16 bytes per (query, key) — the mask and its float form are 1 + 4 —, where the math backend's
    scores alone are Hq x 4 = 64 (its peak, measured in the same way, is above them: the measurement sees it).
    The same with the keys/values repeated (the CUDA path, mocked): the copy is 2 x Hq x N x D x 4 bytes, fixed
    in the chunk."""
    hq, hkv, d, n = 16, 4, 64, 4096
    peaks = {}
    for lq in (256, 512):
        q, k, v = _chunk(hq=hq, hkv=hkv, lq=lq, past=n - lq, d=d)
        store = _Store(k, v)
        peaks[lq] = _peak_bytes(lambda: attention.exact_attention(store, q, 0.125))
        assert peaks[lq] < 16 * lq * n + 4 * 2**20, (lq, peaks[lq])
        mask = attention.chunk_mask(store, lq, None)

        def math():
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)

        assert _peak_bytes(math) >= hq * lq * n * 4  # the defect this guards against, visible to the measurement
    print(f"masked GQA chunk peak RSS (Hq={hq}, Hkv={hkv}, N={n}): {peaks} bytes; math scores "
          f"{ {lq: hq * lq * n * 4 for lq in peaks} }")
    monkeypatch.setattr(attention, "fused_masked_gqa", lambda device: False)
    lq = 512
    q, k, v = _chunk(hq=hq, hkv=hkv, lq=lq, past=n - lq, d=d)
    store = _Store(k, v)
    expanded = _peak_bytes(lambda: attention.exact_attention(store, q, 0.125))
    assert expanded < 16 * lq * n + 2 * hq * n * d * 4 + 4 * 2**20 < hq * lq * n * 4, expanded


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU (LUKA_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("window", [None, 1024], ids=["chunk_after_prefix", "sliding_window"])
def test_cuda_masked_gqa_chunk_peak_memory(window):
    """On a GPU: a 2,048-query masked chunk over 8,192 keys with Llama-8B's heads (32 query, 8 KV, head size 128,
    bf16) through ``exact_attention`` — the repeated keys/values and the memory-efficient kernel — adds at most the
    K/V copy plus ~16 bytes per (query, key), where the math backend's scores are 32 x 2,048 x 8,192 x 2 bytes =
    1 GiB; its output equals the math backend's."""
    from luka_bench import device as devices

    hq, hkv, d, n, lq = 32, 8, 128, 8192, 2048
    q, k, v = (t.cuda() for t in _chunk(hq=hq, hkv=hkv, lq=lq, past=n - lq, d=d, dtype=torch.bfloat16))
    store = _Store(k, v)
    torch.cuda.synchronize()
    base_bytes = torch.cuda.memory_allocated()
    devices.reset_peak(q.device)
    out = attention.exact_attention(store, q, d ** -0.5, window)
    torch.cuda.synchronize()
    peak = devices.peak_allocated(q.device) - base_bytes
    copy = 2 * hq * n * d * 2
    print(f"CUDA masked GQA chunk ({window=}): peak {peak / 2**20:.0f} MiB above the inputs; K/V copy "
          f"{copy / 2**20:.0f} MiB; math scores {hq * lq * n * 2 / 2**20:.0f} MiB")
    assert peak < copy + 16 * lq * n + 64 * 2**20
    mask = attention.chunk_mask(store, lq, window)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5, enable_gqa=True)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
