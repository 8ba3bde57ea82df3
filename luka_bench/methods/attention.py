"""Attention numerics shared by the methods (torch only; the bottom of the methods package: it imports nothing of
the interface). Exact attention over what a store holds (SDPA, GQA-aware, with the masks a store needs after
eviction), attention that also returns the mass every held key received (and each query's entropy), attention
over held tokens plus position-less extra entries, the kernel dispatch (the fused CPU kernel, the Triton kernel on
CUDA), top-k helpers and deterministic group sums.

Functions that take a ``store`` read only what ``HeldKV`` names: any object with those attributes will do (the
method interface's ``Store``, ``luka_bench.methods.store.KVStore``).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from . import cpu_kernel


class HeldKV(Protocol):
    """What the attention functions read of a store: the held keys and values [B, Hkv, n, D], their logical
    positions [B, Hkv, n], the physical (``n``) and logical (``seen``) lengths and the device."""

    n: int
    seen: int

    @property
    def keys(self) -> torch.Tensor: ...

    @property
    def values(self) -> torch.Tensor: ...

    @property
    def positions(self) -> torch.Tensor: ...

    @property
    def device(self) -> torch.device: ...

    def head_mask(self) -> torch.Tensor | None:
        """Optional: [B, Hkv, n] True where the head holds the slot (head-wise budgets), None when all do."""


# ---------------------------------------------------------------------------------------------------------
# Attention primitives shared by the methods (pure torch).
# ---------------------------------------------------------------------------------------------------------

def chunk_mask(
    store: HeldKV, q_len: int, sliding_window: int | None
) -> torch.Tensor | None:
    """Boolean [Lq, Lk] mask for the last ``q_len`` held tokens attending to everything held, or None when
    every query may see every held key. Causality: held tokens before the chunk are all in the past (eviction
    only ever removes, appends go to the end); inside the chunk, query i sees chunk keys <= i. A sliding
    window (Gemma3: a key is visible when q_pos - k_pos < window) is applied from the logical positions."""
    n = store.n
    past = n - q_len
    windowed = sliding_window is not None and n > sliding_window
    if not windowed and (q_len == 1 or past == 0):
        return None  # decode step, or a plain causal prefill (SDPA's is_causal)
    dev = store.device
    qi = torch.arange(q_len, device=dev)
    kj = torch.arange(n, device=dev)
    mask = (kj[None, :] < past) | ((kj[None, :] - past) <= qi[:, None])
    if sliding_window is not None:
        # positions are identical across heads for a layer that never evicts per head
        k_pos = store.positions[0, 0]
        q_pos = store.seen - q_len + qi
        mask = mask & (k_pos[None, :] > q_pos[:, None] - sliding_window)
    return mask


def fused_masked_gqa(device: torch.device) -> bool:
    """Whether PyTorch's SDPA runs a *masked* grouped-query call (``attn_mask`` with ``enable_gqa``) in a fused
    kernel on ``device``. CPU: yes — its flash kernel takes both (``tests/test_methods_core.py`` checks the op
    dispatched). CUDA: no — flash takes no mask and the efficient kernel no GQA, so PyTorch falls back to its math
    backend, which builds the whole [B, Hq, Lq, N] score matrix (Llama-8B at 32K in 4,096-query chunks: ~17 GB
    in fp32)."""
    return device.type == "cpu"


def _expand_kv(x: torch.Tensor, g: int) -> torch.Tensor:
    """Keys or values [B, Hkv, N, D] repeated for the ``g`` query heads of each group: [B, Hkv * g, N, D] (a copy;
    query head h reads KV head h // g, as ``enable_gqa`` does)."""
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, g, n, d).reshape(b, h * g, n, d)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query SDPA without copying KV heads. query [B, Hq, Lq, D], key/value [B, Hkv, Lk, D].

    A masked chunk (a prefill chunk after a prefix, LASER-KV's blocks, Gemma3's sliding windows) on a device where
    SDPA has no fused masked-GQA kernel (``fused_masked_gqa``: CUDA) would run PyTorch's math backend and hold
    the [B, Hq, Lq, N] scores; there the keys and values are repeated per query head instead (2 x Hq x N x D
    elements, independent of the chunk: the scores' bytes exceed it from Lq > D x element size / 2 on) and the
    call becomes plain multi-head SDPA with a mask, which the memory-efficient kernel serves. Short chunks (a
    masked decode step) keep the math backend: their scores are smaller than the copy."""
    b, hq, lq, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    if lq == 1 and mask is None and g > 1:
        # One query per head: fold each KV group's query heads into the query-length axis, so SDPA runs once
        # per KV head with no repeated keys (faster than enable_gqa on CPU at long contexts).
        out = F.scaled_dot_product_attention(query.view(b, hkv, g, d), key, value, scale=scaling)
        return out.view(b, hq, 1, value.shape[-1])
    if mask is None and lq == key.shape[2]:
        return F.scaled_dot_product_attention(query, key, value, is_causal=lq > 1, scale=scaling,
                                              enable_gqa=g > 1)
    if g > 1 and mask is not None and not fused_masked_gqa(query.device) and \
            lq * 4 > 2 * d * key.element_size():  # the scores (4 B per query and key) outgrow the K/V copy
        return F.scaled_dot_product_attention(query, _expand_kv(key, g), _expand_kv(value, g), attn_mask=mask,
                                              scale=scaling)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=g > 1)


def kv_rows(kv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` [n] of keys and values stored as one tensor ``kv`` [2, N, W]: [2, n, W]. One ``index_select``
    over the middle axis (one launch: what CUDA runs); on the CPU with the kernels on (``cpu_kernel.cpu_fast``) one
    over the first axis of each half, written into one tensor: torch's CPU gather along a middle axis is 3-4x slower
    at rows of 64 floats and 2x at 1,024 (2 threads, 8 x 3 x 1,024 rows out of twice as many: 6.1 vs 1.6 ms at 64
    floats, 2.3 vs 1.1 ms at 1,024)."""
    if cpu_kernel.cpu_fast(kv.device):
        out = kv.new_empty(2, rows.numel(), kv.shape[-1])
        torch.index_select(kv[0], 0, rows, out=out[0])
        torch.index_select(kv[1], 0, rows, out=out[1])
        return out
    return kv.index_select(1, rows)


def attend_rows(qg: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, bias: torch.Tensor,
                scaling: float) -> torch.Tensor:
    """Exact attention of grouped decode queries qg [B, Hkv, g, D] over the rows ``idx`` [B, Hkv, T] of keys and
    values stored as one tensor ``kv`` [2, N, D], with the additive ``bias`` [B, Hkv, 1, T] (-inf: not read):
    [B, Hkv, g, Dv]. On the CPU in fp32 with the kernels on, one C++ op reading the rows where they lie
    (``rows_attention``: no gathered copy); elsewhere (CUDA, other dtypes) the rows gathered by ``kv_rows`` and one
    SDPA over them."""
    op = cpu_kernel.rows_attention_op() if cpu_kernel.cpu_fast(kv.device) and \
        qg.dtype == kv.dtype == bias.dtype == torch.float32 else None
    if op is not None:
        return op(qg, kv, idx, bias, scaling)
    b, h, t = idx.shape
    rows = kv_rows(kv, idx.reshape(-1)).view(2, b, h, t, kv.shape[-1])
    return F.scaled_dot_product_attention(qg, rows[0], rows[1], attn_mask=bias, scale=scaling)


def group_logits(q: torch.Tensor, k: torch.Tensor, scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of grouped queries q [B, Hkv, g, Lq, D] against their KV head's keys k [B, Hkv, m, D]:
    [B, Hkv, g, Lq, m] float32. The group's query heads are folded into the rows of one matmul per KV head; a
    matmul broadcasting k over the group axis copies the keys g times first (one decode query over 4K keys: 6.9 ms
    against 0.37 ms here). One 3-D ``bmm`` over (batch x KV head): a 4-D ``matmul`` adds about as much again
    in call overhead, which a decode step's small matmuls feel. ``mask``: an additive [B, Hkv, 1, m] (0 / -inf)
    added to every query's logits — in float32 the GEMM's own input (no op of its own)."""
    b, h, g, lq, d = q.shape
    m = k.shape[2]
    qf, kf = q.reshape(b * h, g * lq, d), k.reshape(b * h, m, d).transpose(1, 2)  # 3-D: ~2x cheaper call
    if q.dtype == torch.float32 and k.dtype == torch.float32 and (mask is None or mask.dtype == torch.float32):
        # the scaling inside the GEMM (beta=0: the input is not read): one kernel instead of a matmul and a mul_
        start = qf.new_empty(()) if mask is None else mask.reshape(b * h, 1, m)
        return torch.baddbmm(start.expand(b * h, g * lq, m), qf, kf, beta=0.0 if mask is None else 1.0,
                             alpha=scaling).view(b, h, g, lq, m)
    out = torch.bmm(qf, kf).float().mul_(scaling).view(b, h, g, lq, m)
    return out if mask is None else out.add_(mask.view(b, h, 1, 1, m))


def group_apply(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Weights w [B, Hkv, g, Lq, m] applied to their KV head's values v [B, Hkv, m, Dv]: [B, Hkv, g, Lq, Dv], the
    group folded into the rows as in ``group_logits``."""
    b, h, g, lq, m = w.shape
    dv = v.shape[-1]
    return torch.bmm(w.reshape(b * h, g * lq, m).to(v.dtype), v.reshape(b * h, m, dv)).view(b, h, g, lq, dv)


MASK_BLOCK_ELEMENTS = 1 << 22  # a prefill chunk's causal mask is made for this many (query, key) pairs at a time


def causal_chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           scaling: float) -> torch.Tensor:
    """Exact attention of a prefill chunk: query [B, Hq, Lq, D] the last Lq of the n keys' tokens, each seeing every
    key before the chunk and the chunk's keys up to its own. In blocks of queries, each over the keys up to its
    last query with an additive mask of at most ``MASK_BLOCK_ELEMENTS`` entries: one [Lq, n] boolean mask and
    SDPA's float copy of it took 0.8 GB at 8,192 queries over 16,384 keys (a chunked prefill's second chunk), more
    than the chunk's activations. Where SDPA runs a masked grouped-query call fused (``fused_masked_gqa``: CPU)."""
    b, hq, lq, _ = query.shape
    n = key.shape[2]
    past = n - lq
    block = max(1, min(lq, MASK_BLOCK_ELEMENTS // n))
    out = query.new_empty(b, hq, lq, value.shape[-1])
    for q0 in range(0, lq, block):
        q1 = min(lq, q0 + block)
        end = past + q1  # keys after the block's last query are masked for all of it: left out
        pos = torch.arange(past + q0, past + q1, device=query.device)[:, None]
        mask = torch.zeros(q1 - q0, end, dtype=query.dtype, device=query.device).masked_fill_(
            torch.arange(end, device=query.device)[None, :] > pos, float("-inf"))
        out[:, :, q0:q1] = sdpa(query[:, :, q0:q1], key[:, :, :end], value[:, :, :end], scaling, mask)
    return out


def exact_attention(store: HeldKV, query: torch.Tensor, scaling: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Exact attention of the last query chunk over everything the store holds — each KV head over its own tokens
    where head-wise budgets left some heads holding fewer (``head_mask``). A long prefill chunk after a prefix
    (no window, no head-wise budgets) takes ``causal_chunk_attention``: no mask over the whole chunk."""
    packed = getattr(store, "packed", None)  # head-wise budgets in storage of their own width (``methods/packed.py``)
    if packed is not None:
        return packed.attend(query, scaling, query.shape[2])
    held = store.head_mask() if hasattr(store, "head_mask") else None  # a bare HeldKV has no head-wise budgets
    lq, n = query.shape[2], store.n
    if held is None and 1 < lq < n and lq * n > MASK_BLOCK_ELEMENTS and fused_masked_gqa(query.device) and \
            (sliding_window is None or n <= sliding_window):
        return causal_chunk_attention(query, store.keys, store.values, scaling)
    mask = chunk_mask(store, lq, sliding_window)
    if held is not None and mask is None and query.shape[2] == 1:  # a decode step: the group's query heads folded
        b, hq, _, d = query.shape  # into the query axis, as sdpa's unmasked step; the mask broadcasts over them
        hkv = held.shape[1]
        out = F.scaled_dot_product_attention(query.view(b, hkv, hq // hkv, d), store.keys, store.values,
                                             attn_mask=held[:, :, None, :], scale=scaling)
        return out.view(b, hq, 1, out.shape[-1])
    if held is not None:  # [B, Hkv, n] -> [B, Hq, 1 or Lq, n], with the chunk's causal mask where there is one
        held = held[:, :, None, :].repeat_interleave(query.shape[1] // held.shape[1], dim=1)
        mask = held if mask is None else held & mask
    return sdpa(query, store.keys, store.values, scaling, mask)


BLOCKED_MIN_QUERIES = 64  # query chunks at least this long (prefills) take the blocked single pass on CPU


def _blocked(query: torch.Tensor, lq: int) -> bool:
    """Whether a query chunk takes ``_blocked_attention``: long chunks on CPU, where it was measured fastest, and
    on CUDA where the Triton kernel runs (``triton_kernel``: flash-style, no N x N logits). Elsewhere (and on
    CUDA with ``LUKA_BENCH_NO_KERNEL=1`` or without Triton) the batched explicit path (one kernel per op for all
    heads, fp32 softmax chunks)."""
    if lq < BLOCKED_MIN_QUERIES:
        return False
    if query.device.type == "cpu":
        return True
    from . import triton_kernel  # imported where it can run: Triton's import costs a CPU run a second

    # and where its tiles fit the device's shared memory (head size 256 on sm_86/89: smaller tiles, or none)
    return triton_kernel.available(query.device) and triton_kernel.fits(query.shape[-1], query.shape[-1],
                                                                        query.dtype, query.device)


KERNEL_ROWS = 48  # the fused kernel's query block: about this many (group head x query) rows, measured fastest


def _blocked_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, past: int,
                       block: int | None = None, entropy: bool = False, kernel: bool = True):
    """Exact causal attention of a query chunk, the column masses it gives every held key and, with
    ``entropy``, each query's Shannon entropy — in one pass over the logits, never more than one block of them
    alive. Per KV head and block of ``block`` queries (all query heads of the group at once): the logits of the
    keys it may see, keys-major [keys, group queries] (one GEMM whose long side is the key axis, which both
    cores split well), the row max, an in-place exp, the normaliser, then P @ V for the output and P @ (1/l)
    for the masses (a GEMV); the entropy adds P @ K: H_i = m_i + log l_i - s q_i . (sum_j p_ij k_j).
    Measured on this 2-core CPU at N = 8K (SmolLM2's 9 query / 3 KV heads): output and masses for 1.4-2x a
    flash SDPA pass, where a flash pass followed by a second pass for the masses from its log-sum-exp cost 1.9-2x.

    With ``kernel`` (and fp32) the same computation runs in the fused C++ kernel of ``cpu_kernel`` — one thread per
    (KV head, block of queries: ``block``, by default ``KERNEL_ROWS // g``), the block's logits in that core's
    cache, max/exp/sum and the mass GEMV fused into sweeps over them: 1.0-1.2x SDPA at 2K-16K. This loop (``block``
    by default 64) is its reference and the fallback when the kernel cannot be built. On CUDA the Triton kernel
    (``triton_kernel``) computes the same three outputs; ``_explicit_attention`` is its reference there.

    query [B, Hq, Lq, D] (the last Lq held tokens), k/v [B, Hkv, past + Lq, D]. Returns (out [B, Hq, Lq, Dv],
    mass [B, Hkv, n] float32, entropy [B, Hq, Lq] float32 in nats or None)."""
    b, hq, lq, d = query.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    dv = v.shape[-1]
    dev = query.device
    qs = (query * scaling).reshape(b * hkv, g, lq, d)
    kk, vv = k.reshape(b * hkv, n, d), v.reshape(b * hkv, n, dv)
    if kernel and dev.type == "cuda":
        from . import triton_kernel  # imported only where it can run

        got = triton_kernel.attention_mass(qs, kk, vv, past, entropy) if triton_kernel.available(dev) else None
        if got is not None:  # None: no tile configuration fits the device's shared memory (the loop below runs)
            out, mass, ent = got
            return out.view(b, hq, lq, dv), mass.view(b, hkv, n), ent.view(b, hq, lq) if entropy else None
    fp32_cpu = dev.type == "cpu" and all(t.dtype == torch.float32 for t in (qs, kk, vv))
    op = cpu_kernel.attention_mass_op() if kernel and fp32_cpu and not cpu_kernel.disabled() else None
    if op is not None:
        out, mass, ent = op(qs, kk, vv, past, block or max(1, KERNEL_ROWS // g), entropy)
        return out.view(b, hq, lq, dv), mass.view(b, hkv, n), ent.view(b, hq, lq) if entropy else None
    block = block or 64
    out = query.new_empty(b * hkv, g, lq, dv)
    mass = torch.zeros(b * hkv, n, dtype=torch.float32, device=dev)
    ent = torch.empty(b * hkv, g, lq, dtype=torch.float32, device=dev) if entropy else None
    after = torch.ones(block, block, dtype=torch.bool, device=dev).tril(-1)[:, None, :]  # [key, -, query]
    for h in range(b * hkv):
        for s in range(0, lq, block):
            c = min(block, lq - s)
            e = past + s + c  # keys this block may see
            qc = qs[h, :, s: s + c].reshape(g * c, d)
            w = (kk[h, :e] @ qc.t()).float()  # scaled logits [e, g*c]; columns: (group head, query)
            w[e - c:].view(c, g, c).masked_fill_(after[:c, :, :c], float("-inf"))  # the chunk's own future keys
            mx = w.amax(0)
            w.sub_(mx).exp_()
            inv = w.sum(0).reciprocal_()  # 1 / normaliser per (head, query)
            o = (w.t().to(vv.dtype) @ vv[h, :e]).mul_(inv[:, None])
            out[h, :, s: s + c] = o.view(g, c, dv)
            mass[h, :e].addmv_(w, inv)
            if entropy:
                kbar = (w.t() @ kk[h, :e].float()).mul_(inv[:, None])  # sum_j p_ij k_j
                ent[h, :, s: s + c] = (mx - inv.log() - (qc.float() * kbar).sum(-1)).view(g, c)
    ent = None if ent is None else ent.view(b, hq, lq)
    return out.view(b, hq, lq, dv), mass.view(b, hkv, n), ent


def attention_with_mass(store: HeldKV, query: torch.Tensor, scaling: float,
                        chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of the last query chunk over everything held, and the attention mass each held token
    received, summed over the queries and over the query heads of each KV group (GQA): returns
    (output [B, Hq, Lq, Dv], mass [B, Hkv, n] float32).

    Long query chunks (a prefill) on CPU take ``_blocked_attention``: one pass over the logits, a block of
    queries at a time (about 1.4-1.5x an SDPA prefill's attention cost); on CUDA the Triton kernel. Otherwise (decode steps, short chunks,
    other devices) the weights are computed explicitly for all heads at once: fp32 softmax, queries ``chunk`` at
    a time so a long prefill never holds the N x N weights."""
    k, v = store.keys, store.values
    b, hq, lq, d = query.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    past = n - lq
    if _blocked(query, lq):
        out, mass, _ = _blocked_attention(query, k, v, scaling, past)
        return out, mass
    out, mass, _, _, _ = _explicit_attention(query.view(b, hkv, g, lq, d), k, v, scaling, past, chunk)
    return out.view(b, hq, lq, v.shape[-1]), mass


def attention_with_extra(store: HeldKV | None, query: torch.Tensor, scaling: float,
                         extra_k: torch.Tensor | None = None, extra_v: torch.Tensor | None = None,
                         extra_bias: torch.Tensor | None = None, causal: bool = True, chunk: int = 256,
                         keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                         mask: torch.Tensor | None = None, seen: torch.Tensor | None = None):
    """Exact attention over the held tokens plus ``S`` position-less *extra* entries with a per-entry logit bias
    (synthetic or summary key/value pairs held by a policy): logit ``q.k * scaling`` for a held token,
    ``q.k_e * scaling + b_e`` for an extra entry; one softmax over both (fp32). Extra entries summarise the past,
    so every query sees all of them. ``causal``: the last Lq held tokens are the query tokens (the usual case);
    False lets every query see every held token (replaying held-out queries over a compressed cache).
    ``keys``/``values`` override the store's (same layout) for such replays, or are the rows of a batch decoded as
    one (``entropy_ols_stacked``; ``store`` None): then ``mask`` [B, Hkv, 1, n] (0 / -inf, float32) closes each row's
    slots it does not hold and ``seen`` [B, 1, 1, 1] is each row's count of entries (one decode query each).

    Returns (out [B, Hq, Lq, Dv], mass [B, Hkv, n], extra_mass [B, Hkv, S], entropy [B, Hkv, Lq], extra_w):
    masses summed over queries and the query heads of each KV group, as ``attention_with_mass``; ``entropy`` the
    Shannon entropy of each query's attention distribution divided by log(entries it saw) (0 when it saw one),
    averaged over the query heads of its group; ``extra_w`` the weights on the extra entries [B, Hkv, g, Lq, S]
    (policies whose extra values depend on the query add their own term with them). With no extra entries and
    ``causal`` this is ``attention_with_mass``'s output and mass."""
    k = store.keys if keys is None else keys
    v = store.values if values is None else values
    b, hq, lq, d = query.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    S = 0 if extra_k is None else extra_k.shape[2]
    q = query.view(b, hkv, g, lq, d)
    past = n - lq if causal else n
    if S == 0 and causal and mask is None and _blocked(query, lq):
        out, mass, h = _blocked_attention(query, k, v, scaling, past, entropy=True)
        seen = torch.arange(past + 1, n + 1, device=query.device, dtype=torch.float32)  # entries query i saw
        ent = (h.clamp_min(0.0) / seen.log().clamp_min(1e-12)).view(b, hkv, g, lq).mean(2) * (seen > 1)
        emass = ew = None
    else:
        out, mass, emass, ent, ew = _explicit_attention(q, k, v, scaling, past, chunk, causal=causal, entropy=True,
                                                        extra=(extra_k, extra_v, extra_bias) if S else None,
                                                        mask=mask, seen=seen)
        out = out.view(b, hq, lq, v.shape[-1])
    if emass is None:  # no extra entries: their mass and weights are empty
        emass = torch.zeros(b, hkv, 0, dtype=torch.float32, device=query.device)
        ew = torch.zeros(b, hkv, g, lq, 0, dtype=torch.float32, device=query.device)
    return out, mass, emass, ent, ew


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, past: int, chunk: int,
                        causal: bool = True, entropy: bool = False, extra: tuple | None = None,
                        mask: torch.Tensor | None = None, seen: torch.Tensor | None = None):
    """The explicit-weights pass of ``attention_with_mass`` and ``attention_with_extra``: q [B, Hkv, g, Lq, D]
    over held keys/values [B, Hkv, n, D] (+ ``extra`` = (keys [B, Hkv, S, D], values, logit bias [B, Hkv, S] or
    None)), fp32 softmax for all heads at once, queries ``chunk`` at a time so a long chunk never holds the
    N x N weights; with ``causal`` query i sees the held tokens up to ``past + i`` only (halves a prefill's
    work). Returns (out [B, Hkv, g, Lq, Dv], mass [B, Hkv, n], extra mass [B, Hkv, S], normalised entropy
    [B, Hkv, Lq], extra weights [B, Hkv, g, Lq, S]) — see ``attention_with_extra``; None for the entropy
    unless asked, for the extra ones without extra entries. ``mask``, ``seen``: rows of a batch
    (``attention_with_extra``)."""
    b, hkv, g, lq, _ = q.shape
    n, dev = k.shape[2], q.device
    extra_k, extra_v, extra_bias = extra if extra is not None else (None, None, None)
    S = 0 if extra_k is None else extra_k.shape[2]
    if S == 0 and not entropy and lq <= chunk and (lq == 1 or not causal):
        # one chunk seeing every held key (a decode step): the loop's result without its output buffer, zeroed
        # mass and the copies into them (issue 36: three kernel launches fewer per layer and step; same values)
        w = torch.softmax(group_logits(q, k, scaling), dim=-1)
        return group_apply(w, v), w.sum(dim=(2, 3)), None, None, None
    single = lq <= chunk and (not causal or past + lq >= n)  # one chunk seeing every key: its results are the outputs
    if not single:
        out = q.new_empty(b, hkv, g, lq, v.shape[-1])
        mass = torch.zeros(b, hkv, n, dtype=torch.float32, device=dev)
        emass = torch.zeros(b, hkv, S, dtype=torch.float32, device=dev) if S else None
        ew = torch.zeros(b, hkv, g, lq, S, dtype=torch.float32, device=dev) if S else None
        ent = torch.zeros(b, hkv, lq, dtype=torch.float32, device=dev) if entropy else None
    rows = seen  # each row's entries, given (rows of a batch, one query each); else counted per chunk below
    for s in range(0, lq, chunk):
        qc = q[:, :, :, s: s + chunk]
        c = qc.shape[3]
        m = min(n, past + s + c) if causal else n  # keys visible to this chunk
        logits = group_logits(qc, k[:, :, :m], scaling, None if mask is None else mask[..., :m])  # [B, Hkv, g, c, m]
        if entropy and rows is None:
            seen = torch.full((c,), float(m + S), device=dev)
        if causal and c > 1:
            qi = torch.arange(s, s + c, device=dev)
            visible = torch.arange(m, device=dev)[None, :] <= (past + qi)[:, None]
            logits = logits.masked_fill(~visible, float("-inf"))
            seen = visible.sum(-1).float() + S if entropy else None
        if S:
            el = group_logits(qc, extra_k, scaling)
            if extra_bias is not None:
                el = el + extra_bias[:, :, None, None, :].float()
            logits = torch.cat([logits, el], dim=-1)
        if entropy:
            logp = torch.log_softmax(logits, dim=-1)
            w = logp.exp()
            h = -torch.where(w > 0, w * logp, torch.zeros_like(w)).sum(-1)  # [B, Hkv, g, c]
            held = (seen > 1) if rows is None else (seen > 1).view(-1, 1, 1)
            ent_c = (h / seen.log().clamp_min(1e-12)).mean(2) * held
        else:
            w = torch.softmax(logits, dim=-1)
        o = group_apply(w[..., :m], v[:, :, :m])
        if S:
            o = o + group_apply(w[..., m:], extra_v)
        if single:  # the chunk's own results (the buffers below would hold them as 0 + x: the same values)
            return (o, w[..., :m].sum(dim=(2, 3)), w[..., m:].sum(dim=(2, 3)) if S else None,
                    ent_c if entropy else None, w[..., m:] if S else None)
        if entropy:
            ent[:, :, s: s + c] = ent_c
        if S:
            emass += w[..., m:].sum(dim=(2, 3))
            ew[:, :, :, s: s + c] = w[..., m:]
        out[:, :, :, s: s + c] = o
        mass[:, :, :m] += w[..., :m].sum(dim=(2, 3))
    return out, mass, emass, ent, ew


def kept_indices(keep: torch.Tensor, m: int) -> torch.Tensor:
    """Indices of the True entries of ``keep`` [..., n], in order, when every row has exactly ``m`` of them:
    [..., m]. A stable sort puts them first; ``nonzero`` would give the same with a host sync (its output size
    depends on the data)."""
    return torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :m]


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores along the last axis, in time order. Ties go to the earlier token
    (a stable sort), so a selection is reproducible — max pooling makes plateaus of equal scores."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values


# ---------------------------------------------------------------------------------------------------------
# Deterministic sums by group (CUDA's scatter_add_ on floats adds with atomics in no fixed order: the low bits of
# a sum — and through them a k-means assignment or a top-k among near-ties — change from run to run). On the CPU
# scatter_add_ is deterministic (each output row is summed by one thread, in index order) and stays; elsewhere
# (``dense``) the sums are computed without atomics. Sums of integer-valued floats (counts, token lengths) are
# exact in any order below 2^24 and keep scatter_add_.
# ---------------------------------------------------------------------------------------------------------

DENSE_ELEMENTS = 1 << 25  # the largest one-hot / dense block the atomics-free sums build at once (elements)


def group_sum(x: torch.Tensor, a: torch.Tensor, k: int, dense: bool | None = None) -> torch.Tensor:
    """Sum of the rows of x [B, H, m, D] by group a [B, H, m] (values 0..k-1): [B, H, k, D]. ``dense`` (default:
    off the CPU): one batched matmul by the one-hot membership [B, H, k', m] per block of groups k' (at most
    ``DENSE_ELEMENTS`` one-hot elements at once) — no atomics, the same bits on every run. (On CUDA it follows
    the global TF32 setting of fp32 matmuls, off by default.)"""
    b, h, m, d = x.shape
    if dense is None:
        dense = x.device.type != "cpu"
    if not dense:
        return torch.zeros(b, h, k, d, dtype=x.dtype, device=x.device).scatter_add_(
            2, a.unsqueeze(-1).expand(b, h, m, d), x)
    step = max(1, DENSE_ELEMENTS // max(1, b * h * m))
    parts = []
    for lo in range(0, k, step):
        groups = torch.arange(lo, min(k, lo + step), device=x.device)
        onehot = (a.unsqueeze(-2) == groups.view(-1, 1)).to(x.dtype)  # [B, H, k', m]
        parts.append(torch.matmul(onehot, x))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def scatter_add_rows(target: torch.Tensor, ids: torch.Tensor, src: torch.Tensor, dense: bool | None = None) -> None:
    """``target`` [B, H, n] += ``src`` [B, H, R, m] at ``ids`` [B, H, R, m] (ids distinct within each row r: a
    query's refined tokens or nodes; rows may share ids). ``dense`` (default: off the CPU): each row scattered into
    its own zero row (distinct ids: no two writes meet) and the rows summed in order, in blocks of at most
    ``DENSE_ELEMENTS`` elements — deterministic, where one scatter_add_ over all rows would add the rows' shares
    of a shared id with atomics in no fixed order."""
    b, h, n = target.shape
    r = ids.shape[2]
    if dense is None:
        dense = target.device.type != "cpu"
    if not dense:
        target.scatter_add_(2, ids.reshape(b, h, -1), src.reshape(b, h, -1).to(target.dtype))
        return
    step = max(1, DENSE_ELEMENTS // max(1, b * h * n))
    for lo in range(0, r, step):
        hi = min(r, lo + step)
        rows = target.new_zeros(b, h, hi - lo, n).scatter_(3, ids[:, :, lo:hi], src[:, :, lo:hi].to(target.dtype))
        target += rows.sum(2)


def timed_exact(store: HeldKV, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """``exact_attention`` timed as the ``attention`` component, for a policy that times itself
    (``LayerPolicy.times_itself``: a decode-time retrieval method, whose steps ``add_retrieval_spans``)."""
    with store.cache.span("attention", query.device):
        return exact_attention(store, query, scaling)


def add_retrieval_spans(store: HeldKV, t0, t1) -> None:
    """A retrieval step's components for a policy that times itself: ``retrieval`` (choosing what to read) from the
    mark ``t0`` to ``t1``, ``attention`` (reading it) from ``t1`` to now (marks: ``cache.mark``; none on CUDA
    without ``cuda_events``)."""
    cache = store.cache
    cache.add_span("retrieval", t0, t1)
    cache.add_span("attention", t1, cache.mark(store.device))
