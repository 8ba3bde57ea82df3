"""The GPU kernel behind ``attention._blocked_attention`` on CUDA (Triton): exact causal attention of a long query
chunk (a prefill) plus the column masses — and, if asked, each query's entropy — that the mass-reading methods
(H2O / LuKA lined, LuKA clustered's attention-weighted compressor, entropy_ols) need, without ever holding a
block of logits larger than one tile: on CUDA these prefills otherwise take ``_explicit_attention``, fp32
softmax chunks of 256 queries x N keys (about 1 GiB of logits per chunk at 32K for Qwen3-4B).

Two passes, flash-attention style:

1. ``_fwd`` — per (query head, block of ``BM`` queries): an online softmax over key blocks of ``BN`` (running row
   max m, normaliser l, output accumulator; the tile's logits in fp32, the value product in the input dtype with
   fp32 accumulation), then out = acc / l, the row log-sum-exp LSE = m + log l and, with ``ENTROPY``, the Shannon
   entropy H = LSE - (sum_j e^(s_j - m) s_j) / l (the sum rescaled with l), in nats.
2. ``_mass`` — per (KV head, block of ``BN`` keys): the logits of every query of the KV group that may see the
   block are recomputed and p_ij = exp(s_ij - LSE_i) summed over the queries and the group's query heads (GQA:
   masses per KV head, as ``attention_with_mass`` defines them). No atomics: each program owns its keys.

Causality with an arbitrary prefix: query i of the chunk is held token ``past + i`` and sees keys 0..past + i.
Inputs: scaled queries [B*Hkv, g, Lq, D], keys [B*Hkv, N, D], values [B*Hkv, N, Dv] (any row stride: views of
the store's storage); fp32, bf16 or fp16. fp32 products run in IEEE fp32 (not TF32).

``tests/test_triton_kernel.py`` checks it against float64 in Triton's CPU interpreter (``TRITON_INTERPRET=1`` set
before Triton is imported: ``tests/conftest.py`` does so unless ``LUKA_TEST_DEVICE=cuda``, where it is compiled
for real). ``LUKA_BENCH_NO_KERNEL=1`` turns it off (the explicit path then runs, as it does where Triton is not
installed)."""
from __future__ import annotations

import functools
import os

import torch

from . import cpu_kernel

try:  # module globals: the interpreter patches ``tl`` in the kernels' globals
    import triton
    import triton.language as tl
except Exception:  # not installed (a CPU install without the test extras): the explicit path runs
    triton = tl = None

BM, BN = 64, 64  # query and key tile sizes (fp32 with head size > 64: 32, 32, to fit shared memory)
NUM_WARPS, NUM_STAGES = 4, 2


def available(device: torch.device) -> bool:
    """Whether the kernel runs for tensors on ``device``: CUDA, Triton installed, not disabled."""
    return device.type == "cuda" and not cpu_kernel.disabled() and triton is not None


# The kernels, as plain functions: ``_kernels`` decorates them (for the GPU or the interpreter).

def _fwd(Q, K, V, O, LSE, ENT, Lq, N, past, G,
         sq_h, sq_m, sk_h, sk_n, sv_h, sv_n, so_h, so_m,
         D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
         BM: tl.constexpr, BN: tl.constexpr, ENTROPY: tl.constexpr, PREC: tl.constexpr, DOT32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)  # query head: (batch x KV head) * G + group member
    bh = pid_h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    row_ok = offs_m < Lq
    q = tl.load(Q + pid_h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if DOT32:
        q = q.to(tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    t_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    hi = tl.minimum(N, past + (pid_m + 1) * BM)  # keys the block's last query may see
    for start in range(0, hi, BN):
        offs_n = start + tl.arange(0, BN)
        k = tl.load(K + bh * sk_h + offs_n[:, None] * sk_n + offs_d[None, :],
                    mask=(offs_n[:, None] < N) & (offs_d[None, :] < D), other=0.0)
        if DOT32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BM, BN] fp32 (queries are pre-scaled)
        vis = (offs_n[None, :] <= past + offs_m[:, None]) & (offs_n[None, :] < N)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key 0 is visible to every query
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if ENTROPY:  # p = 0 where the key is hidden (s = -inf): its term is 0, not 0 * -inf
            t_i = t_i * alpha + tl.sum(p * tl.where(vis, s, 0.0), 1)
        v = tl.load(V + bh * sv_h + offs_n[:, None] * sv_n + offs_dv[None, :],
                    mask=(offs_n[:, None] < N) & (offs_dv[None, :] < DV), other=0.0)
        if DOT32:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision=PREC)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + pid_h * so_h + offs_m[:, None] * so_m + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    lse = m_i + tl.log(l_i)
    tl.store(LSE + pid_h * Lq + offs_m, lse, mask=row_ok)
    if ENTROPY:
        tl.store(ENT + pid_h * Lq + offs_m, lse - t_i / l_i, mask=row_ok)

def _mass(Q, K, LSE, MASS, Lq, N, past, G,
          sq_h, sq_m, sk_h, sk_n,
          D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
          DOT32: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)  # (batch x KV head)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    key_ok = offs_n < N
    k = tl.load(K + bh * sk_h + offs_n[:, None] * sk_n + offs_d[None, :],
                mask=key_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if DOT32:
        k = k.to(tl.float32)
    mass = tl.zeros([BN], tl.float32)
    first = tl.maximum(pid_n * BN - past, 0)  # the first query that sees a key of this block
    lo = (first // BM) * BM
    for gi in range(0, G):
        h = bh * G + gi
        for start in range(lo, Lq, BM):
            offs_m = start + tl.arange(0, BM)
            row_ok = offs_m < Lq
            q = tl.load(Q + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :],
                        mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            if DOT32:
                q = q.to(tl.float32)
            lse = tl.load(LSE + h * Lq + offs_m, mask=row_ok, other=float("inf"))
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            vis = (offs_n[None, :] <= past + offs_m[:, None]) & row_ok[:, None] & key_ok[None, :]
            p = tl.where(vis, tl.exp(s - lse[:, None]), 0.0)
            mass += tl.sum(p, 0)
    tl.store(MASS + bh * N + offs_n, mass, mask=key_ok)


# Lengths change with every chunk and step: Triton would specialise an int argument on its value being 1 and on
# its divisibility by 16, compiling a new kernel for each (Lq, N, past) class the first time it is met (inside a
# timed prefill). They are only loop bounds and mask terms, so the kernels are compiled once for all of them.
NO_SPECIALIZE = ("Lq", "N", "past")


@functools.cache
def _kernels():
    """(forward kernel, mass kernel): compiled for the GPU, or — when ``TRITON_INTERPRET=1`` was set before
    Triton was imported (Triton's own functions are built then) — run by Triton's CPU interpreter."""
    return triton.jit(_fwd, do_not_specialize=NO_SPECIALIZE), triton.jit(_mass, do_not_specialize=NO_SPECIALIZE)


def interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; older ones read the environment
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _pow2(x: int) -> int:
    return max(16, 1 << (int(x) - 1).bit_length())  # tl.arange needs a power of 2; tl.dot at least 16


def smem_bytes(bm: int, bn: int, bd: int, bdv: int, elt: int, stages: int = NUM_STAGES) -> int:
    """An upper estimate of the shared memory one program of either kernel needs: the query tile, ``stages``
    buffered key and value tiles and the [BM, BN] probability tile in the input dtype. The forward kernel at head
    size 256 in bf16 with 64 x 64 tiles needs 106,496 B compiled (more than sm_86/89's 101,376); this estimate
    says 172,032 for it and stays under 101,376 for every configuration used at head sizes up to 128."""
    return elt * (bm * bd + stages * bn * (bd + bdv) + bm * bn)


def _configs(bd: int, bdv: int, elt: int):
    """Tile configurations (BM, BN, stages), the preferred first: 64 x 64 (32 x 32 for fp32 beyond head size 64,
    as before), then smaller tiles and a single stage, for devices with less shared memory."""
    first = (BM, BN) if elt <= 2 or max(bd, bdv) <= 64 else (32, 32)
    out = [(*first, NUM_STAGES)]
    for c in ((64, 32, NUM_STAGES), (32, 32, NUM_STAGES), (32, 32, 1), (16, 32, 1), (16, 16, 1)):
        if c[0] <= first[0] and c[1] <= first[1] and c not in out:
            out.append(c)
    return out


def pick_config(d: int, dv: int, elt: int, limit: int | None):
    """The first tile configuration (BM, BN, stages) whose shared memory estimate fits ``limit`` (bytes per block,
    ``device.smem_per_block``; None: no limit, the CPU interpreter), or None when none does (the caller takes the
    explicit path)."""
    bd, bdv = _pow2(d), _pow2(dv)
    for c in _configs(bd, bdv, elt):
        if limit is None or smem_bytes(c[0], c[1], bd, bdv, elt, c[2]) <= limit:
            return c
    return None


def fits(d: int, dv: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether some tile configuration of the kernels fits ``device``'s shared memory at these head sizes."""
    from luka_bench import device as devices

    return pick_config(d, dv, torch.empty((), dtype=dtype).element_size(), devices.smem_per_block(device)) \
        is not None


def _out_of_resources() -> tuple:
    try:
        from triton.runtime.errors import OutOfResources
        return (OutOfResources,)
    except Exception:  # pragma: no cover - an older or newer Triton
        return ()


def attention_mass(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, entropy: bool = False):
    """qs [BH, g, Lq, D] scaled queries (query i is held token past + i), k [BH, N, D], v [BH, N, Dv]. Returns
    (out [BH, g, Lq, Dv] in v's dtype, mass [BH, N] float32 summed over the group's heads and the queries,
    entropy [BH, g, Lq] float32 in nats, or None) — or None when no tile configuration fits the device's shared
    memory (head size 256 on a small-shared-memory device with every configuration too big; the caller then takes
    the explicit path). Launched under the tensors' device (``device.guard``): Triton launches on the current
    device, which need not be theirs (``model.device=cuda:1``)."""
    from luka_bench import device as devices

    bh, g, lq, d = qs.shape
    n, dv = k.shape[1], v.shape[-1]
    qs = qs.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    dev = qs.device
    out = torch.empty(bh, g, lq, dv, dtype=v.dtype, device=dev)
    lse = torch.empty(bh, g, lq, dtype=torch.float32, device=dev)
    ent = torch.empty(bh, g, lq, dtype=torch.float32, device=dev) if entropy else lse
    mass = torch.empty(bh, n, dtype=torch.float32, device=dev)
    fwd, mass_k = _kernels()
    prec = "ieee" if qs.dtype == torch.float32 else "tf32"
    # the interpreter's dot mishandles bfloat16 (numpy has none): there the operands (already rounded to the
    # input dtype) are multiplied in fp32; compiled, they are bf16 tensor-core products with fp32 accumulation
    dot32 = interpreted() and qs.dtype == torch.bfloat16
    bd, bdv = _pow2(d), _pow2(dv)
    limit = devices.smem_per_block(dev)
    configs = [c for c in _configs(bd, bdv, qs.element_size())
               if limit is None or smem_bytes(c[0], c[1], bd, bdv, qs.element_size(), c[2]) <= limit]
    for i, (bm, bn, stages) in enumerate(configs):
        try:
            with devices.guard(dev):
                fwd[(triton.cdiv(lq, bm), bh * g)](
                    qs, k, v, out, lse, ent, lq, n, past, g,
                    lq * d, d, k.stride(0), k.stride(1), v.stride(0), v.stride(1), lq * dv, dv,
                    D=d, DV=dv, BD=bd, BDV=bdv, BM=bm, BN=bn, ENTROPY=entropy, PREC=prec, DOT32=dot32,
                    num_warps=NUM_WARPS, num_stages=stages)
                mass_k[(triton.cdiv(n, bn), bh)](
                    qs, k, lse, mass, lq, n, past, g, lq * d, d, k.stride(0), k.stride(1),
                    D=d, BD=bd, BM=bm, BN=bn, PREC=prec, DOT32=dot32, num_warps=NUM_WARPS, num_stages=stages)
        except _out_of_resources():  # the estimate was short of what the compiler made: smaller tiles
            if i + 1 == len(configs):
                return None
            continue
        return out, mass, ent if entropy else None
    return None
