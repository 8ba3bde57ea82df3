"""ShadowKV: low-rank pre-RoPE keys, offloaded values and chunk retrieval by landmarks at decode time (Sun et al.,
"ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference", ICML 2025; reference code
bytedance/ShadowKV @ a21f5a9, ``models/kv_cache.py`` ``ShadowKVCache``: the accuracy path).

After the prefill of n0 tokens, per layer (``after_prefill``; reference L195-281):
- **Low-rank keys.** The pre-RoPE keys of all KV heads, concatenated [n0, Hkv * D], are factored by an SVD kept to
  rank r = min(``rank``, Hkv * D, n0): U [n0, r] and SV = diag(S) V^T [Hkv, r, D] (reference ``get_svd``). The
  model gives us post-RoPE keys (the store caches them after RoPE); we recover the pre-RoPE keys by un-rotating
  them with the model's own rotary embedding at their positions (RoPE is a rotation: k = R(-p) R(p) k; its
  attention scaling divided out; ``KVStore.rope_cos_sin``), not by capturing them inside the model.
- **Chunks and landmarks.** The first chunks = n0 // ``chunk`` - ``local_chunks`` chunks of ``chunk`` post-RoPE
  keys (positions 0..L0-1, L0 = chunks * ``chunk``) each get a landmark, their mean key; the rest of the prompt (the
  last ``local_chunks`` chunks and the remainder) is the *local* part, kept exact.
- **Outliers.** Per KV head, the ``outliers`` chunks whose lowest cosine between landmark and key is smallest are
  kept exact (keys and values copied into a buffer); the other chunks keep their landmark.
- **Values** of positions 0..L0-1 stay exact, taken by the policy (``V0``; offloaded in the reference,
  ``v_cache_cpu``): read back only for the chunks selected.
- **The store drops positions 0..L0-1** (``keep_ends``): it holds the local part and every later token, slot i at
  position L0 + i (its logical length ``seen`` and the new tokens' RoPE positions unchanged).

At every decode step, on every layer from ``full_layers`` on (reference: all layers; L283-334): per query head
softmax(q . landmark * scaling) over the landmarks, max over the KV head's group of query heads; the top
token_budget / chunk chunks per KV head are rebuilt as keys U[t] SV with RoPE applied at their positions t, their
exact values gathered from V0; attention (one softmax) over outliers + selected + local + every token after the
prompt (generated or fed after the prefill, kept exact). The three prompt sets are disjoint: the selected chunks are
drawn from the landmarks of the non-outlier chunks, which lie before the local part.

A multi-token chunk after the prefill (the question: its tokens join the exact tail) attends over what ShadowKV
holds: the rebuilt keys (U SV, RoPE at their positions) of every position 0..L0-1 with V0, and the store's local
part and tail, causal inside the chunk. Exact attention: the prefill, a layer whose non-outlier chunks are fewer
than token_budget / chunk (the reference asserts against it; its store keeps every token), and the first
``full_layers`` layers.

Memory: no exact key of positions 0..L0-1 is held anywhere (they are the factors; the outliers' copies excepted).
``kv_bytes`` (``held_bytes``; the peak is taken from it) = the store (local part and tail) + ``extra_bytes``: U,
[SV, rotate_half(SV)], the landmarks and their positions, the outlier copies, V0 and the RoPE table the decode step
reads (cos / sin per prompt position in the keys' dtype, one per prompt shared by the layers, counted on the layer
that made it; the reference reads the model's own rotary cache). ``method_stats``: ``offloaded_bytes`` (V0: the
values the reference keeps off the GPU) and ``device_bytes`` (``real_bytes`` less them). A layer that stays exact
(too short a prompt) keeps every token in its store.

Shapes: query [B, Hq, 1, D]; U [B * n0, r]; SV and its rotate-half [B * Hkv, r, 2D]; landmarks [B, Hkv, Cl, D] with
Cl = chunks - outliers; V0 [B, Hkv, L0, Dv]; chunks read [B, Hkv, token_budget / chunk]. The decode step is
fixed-shape and free of host syncs (``static_decode``): the local part and tail are the store's whole storage (free
slots masked by the mask ``DecodeStep.held_mask`` opens one slot per step for all layers), the rebuilt keys one GEMM
of the gathered rows of U with [SV, rotate_half(SV)] (RoPE is linear: rotate_half(U SV) = U rotate_half(SV)) and one
multiply-add with the gathered cos / sin rows, the values one row gather from V0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from luka_bench.device import host_to_device
from luka_bench.methods.attention import add_retrieval_spans, causal_chunk_attention, sdpa, timed_exact
from luka_bench.methods.base import KVMethod, LayerInfo, LayerPolicy, MethodConfigError, setting


def rotate_half(x: torch.Tensor, rot: int) -> torch.Tensor:
    """The rotate-half map of RoPE on the first ``rot`` channels of x [..., D] ([-x2, x1]), 0 on the others (which
    RoPE leaves alone): RoPE(x) = x * cos + rotate_half(x) * sin with cos 1 and sin 0 beyond ``rot``."""
    half = rot // 2
    out = torch.zeros_like(x)
    out[..., :half] = -x[..., half:rot]
    out[..., half:rot] = x[..., :half]
    return out


def rope_table(store, n0: int, dtype: torch.dtype = torch.float32,
               shared: bool = True) -> tuple[torch.Tensor, int, bool]:
    """([n0, 2D] (cos, sin) of the model's RoPE at the positions 0..n0-1 as the model applies it — its attention
    scaling included; cos 1 and sin 0 beyond the rotary part — in ``dtype`` (made in fp32), the rotary channels,
    whether this call made the shared one). ``shared``: one per prompt and dtype, shared by the layers
    (``MethodCache.state``); else made for the caller alone."""
    key = ("shadowkv_rope", n0, dtype, store.device, store.policy.info.layer_type)  # Gemma3: a RoPE per layer type
    got = store.cache.state.get(key) if shared else None
    if got is not None:
        return got[0], got[1], False
    d = store.keys.shape[-1]
    cos, sin, scale = store.rope_cos_sin(torch.arange(n0, device=store.device).view(1, n0), scaled=True)
    rot = cos.shape[-1]
    table = torch.zeros(n0, 2 * d, device=store.device)
    table[:, :d] = 1.0
    table[:, :rot] = cos * scale
    table[:, d: d + rot] = sin * scale
    table = table.to(dtype)
    if shared:
        store.cache.state[key] = (table, rot)
    return table, rot, shared


def unrotate(keys: torch.Tensor, table: torch.Tensor, rot: int) -> torch.Tensor:
    """Pre-RoPE keys [B, Hkv, n0, D] (fp32) from post-RoPE ones, with ``table`` the model's (cos, sin) at their
    positions (fp32): the model's key is a R(p) k (a its attention scaling), so k = R(-p) key / a = (key cos -
    rotate_half(key) sin) / a^2 with cos = a cos(p), sin = a sin(p)."""
    d = keys.shape[-1]
    cos, sin = table[:, :rot], table[:, d: d + rot]
    x = keys.float()
    out = x.clone()
    out[..., :rot] = (x[..., :rot] * cos - rotate_half(x, rot)[..., :rot] * sin) / (cos ** 2 + sin ** 2)
    return out


class ShadowKVPolicy(LayerPolicy):
    times_itself = True  # retrieval (choosing what to read) and attention (reading it), timed inside

    static_decode = True  # the local part and tail read from the store's whole capacity, free slots masked

    def __init__(self, method: "ShadowKV", info: LayerInfo):
        super().__init__(method, info)
        self.ready = False  # the prompt was factored and its first L0 positions left the store
        self.n0 = self.L0 = self.rank = 0
        self.U = self.W = self.lm = self.lm_base = self.outlier_kv = self.outlier_pos = self.V0 = None
        self.rope_rows: torch.Tensor | None = None  # the shared RoPE table [n0, 2D] (``rope_table``)
        self.rope_bytes = 0  # its bytes, on the layer that made it
        self.pos: torch.Tensor | None = None  # the last sparse step's selected token positions [B, Hkv, m]
        self.n_read = 0  # the store's n at the last sparse step

    # -- the prefill ---------------------------------------------------------------------------------------------
    def after_prefill(self, store) -> None:
        m = self.method
        self.ready = False
        n0, cs = store.n, m.chunk
        chunks = n0 // cs - m.local_chunks
        if chunks - m.outliers < m.token_budget // cs:  # too short: exact (the reference asserts against it)
            return
        K = store.keys  # [B, Hkv, n0, D], post-RoPE keys, slot = position (nothing evicted)
        b, hkv, _, d = K.shape
        # the RoPE table in the keys' dtype (as the model casts it), shared by the layers and kept for the decode
        # steps (counted by the layer that made it); the un-rotation's fp32 one only for this call
        self.rope_rows, rot, made = rope_table(store, n0, K.dtype)  # [n0, 2D]
        self.rope_bytes = self.rope_rows.nbytes if made else 0
        table = self.rope_rows if K.dtype == torch.float32 else rope_table(store, n0, shared=False)[0]
        # low-rank pre-RoPE keys: SVD of [n0, Hkv * D] per batch row (reference get_svd), kept to rank r
        pre = unrotate(K, table, rot).transpose(1, 2).reshape(b, n0, hkv * d)
        u, s, vh = torch.linalg.svd(pre, full_matrices=False)
        r = min(m.rank, hkv * d, n0)
        sv = (s[:, :r, None] * vh[:, :r]).view(b, r, hkv, d).transpose(1, 2)  # [B, Hkv, r, D]
        # a copy of U's r columns (a view would keep the SVD's whole U alive)
        self.U = u[:, :, :r].to(K.dtype).contiguous().view(b * n0, r)
        self.W = torch.cat([sv, rotate_half(sv, rot)], dim=-1).to(K.dtype).reshape(b * hkv, r, 2 * d)
        self.rank, self.n0 = r, n0
        # chunks, landmarks (mean post-RoPE key) and outliers (lowest min cosine landmark-key; reference L236-245)
        kc = K[:, :, : chunks * cs].reshape(b, hkv, chunks, cs, d)
        lm = kc.float().mean(dim=3)  # [B, Hkv, chunks, D]
        cos = F.cosine_similarity(lm[:, :, :, None].expand_as(kc), kc.float(), dim=-1)  # [B, Hkv, chunks, cs]
        out_idx = torch.topk(cos.amin(dim=-1), m.outliers, dim=-1, largest=False).indices  # [B, Hkv, outliers]
        rest = torch.ones(b, hkv, chunks, dtype=torch.bool, device=K.device).scatter_(2, out_idx, False)
        rest_idx = torch.arange(chunks, device=K.device).expand(b, hkv, chunks)[rest].view(b, hkv, -1)
        self.lm = lm.gather(2, rest_idx[..., None].expand(-1, -1, -1, d)).to(K.dtype)  # [B, Hkv, Cl, D]
        self.lm_base = rest_idx * cs  # each landmark's first position
        ar = torch.arange(cs, device=K.device)
        self.outlier_pos = (out_idx.sort(dim=-1).values[..., None] * cs + ar).reshape(b, hkv, -1)
        ok, ov = store.gather(self.outlier_pos)
        self.outlier_kv = (ok.clone(), ov.clone())
        self._ar = ar
        self._rows = torch.arange(b, device=K.device).view(b, 1, 1)  # a position's row of U: (batch row, position)
        L0 = self.L0 = chunks * cs  # the local part: positions L0..n0-1, then the tail
        # the values of positions 0..L0-1 (offloaded in the reference), rows of V0 per (batch row, KV head)
        self.V0 = store.values[:, :, :L0].clone(memory_format=torch.contiguous_format)  # [B, Hkv, L0, Dv]
        self._voff = (torch.arange(b * hkv, device=K.device) * L0).view(b, hkv, 1)
        # positions 0..L0-1 leave the store: it reallocates to the n0 - L0 kept slots when they are under half its
        # storage (whenever L0 exceeds the local part; at the defaults L0 >= 2432 against <= 39); otherwise it shifts
        # them down in place and the freed slots take the next tokens
        store.keep_ends(0, n0 - L0)
        self.ready = True

    # -- attention -------------------------------------------------------------------------------------------
    def attend(self, store, query, scaling):
        """Attention of ``query`` [B, Hq, Lq, D] (the store's last Lq tokens) over what the layer holds: the store
        before the prompt was factored (exact); after it, the rebuilt keys (U SV, RoPE at their positions) of every
        position 0..L0-1 with V0, then the store's local part and tail, causal inside the chunk — what ShadowKV
        itself holds (a question after the prefill). Returns [B, Hq, Lq, Dv]."""
        self.pos = None
        if not self.ready:
            return timed_exact(store, query, scaling)
        with store.cache.span("attention", query.device):
            b, hkv = self.V0.shape[:2]
            k0 = self.rebuilt_keys(store, torch.arange(self.L0, device=query.device).expand(b, hkv, self.L0))
            keys = torch.cat([k0, store.keys], dim=2)
            values = torch.cat([self.V0, store.values], dim=2)
            return causal_chunk_attention(query, keys, values, scaling)

    def step(self, store, query, scaling, step):
        if not self.ready:
            return self.attend(store, query, scaling)
        m = self.method
        t0 = store.cache.mark(query.device)
        b, hq, _, d = query.shape
        Kst, Vst = store.storage()  # slot i: position L0 + i (the local part, then the tail)
        hkv, cap = Kst.shape[1], Kst.shape[2]
        g, cs = hq // hkv, m.chunk
        sets = m.token_budget // cs
        # landmark scores: softmax over the landmarks per query head (fp32), max over the group (reference L290-296)
        logits = torch.matmul(query.view(b, hkv, g, d), self.lm.transpose(-1, -2))  # [B, Hkv, g, Cl]
        score = torch.softmax(logits.float() * scaling, dim=-1).amax(dim=2)  # [B, Hkv, Cl]
        top = torch.topk(score, sets, dim=-1).indices
        self.pos = pos = (self.lm_base.gather(2, top)[..., None] + self._ar).view(b, hkv, sets * cs)
        self.n_read = store.n
        w = sets * cs
        # rebuilt keys: rows of U times [SV, rotate_half(SV)], then RoPE at their positions (reference L313-334)
        u = self.u_rows(pos).view(b * hkv, w, self.rank)
        kw = torch.bmm(u, self.W)  # [B * Hkv, w, 2D]: the pre-RoPE keys and their rotate-half
        cs_rows = self.rope_rows.index_select(0, pos.view(-1)).view(b * hkv, w, 2 * d)
        ksel = torch.addcmul(kw[..., :d] * cs_rows[..., :d], kw[..., d:], cs_rows[..., d:])
        dv = self.V0.shape[-1]
        vsel = self.V0.view(-1, dv).index_select(0, (pos + self._voff).view(-1))  # rows of V0 [B * Hkv * L0, Dv]
        t1 = store.cache.mark(query.device)  # retrieval: the landmark scores, the top chunks and their keys rebuilt
        ok, ov = self.outlier_kv
        f = ok.shape[2]
        keys = torch.cat([ok, ksel.view(b, hkv, w, d), Kst], dim=2)
        values = torch.cat([ov, vsel.view(b, hkv, w, dv), Vst], dim=2)
        width = f + w + cap
        mask = step.held_mask(store, "shadowkv", width, f + w + store.n, 1, query.dtype).view(1, 1, 1, width)
        out = sdpa(query, keys, values, scaling, mask)
        add_retrieval_spans(store, t0, t1)
        return out

    def u_rows(self, pos: torch.Tensor) -> torch.Tensor:
        """The rows of U of each batch row's prompt positions ``pos`` [B, Hkv, m]: [B, Hkv, m, r] — one gather
        (one row: by position; several: by (batch row, position), U seen as [B, n0, r]; no offset added)."""
        b, hkv, w = pos.shape
        if b == 1:
            return self.U.index_select(0, pos.reshape(-1)).view(b, hkv, w, self.rank)
        return self.U.view(b, -1, self.rank)[self._rows, pos]

    def rebuilt_keys(self, store, pos: torch.Tensor) -> torch.Tensor:
        """The keys the decode step rebuilds for the prompt positions ``pos`` [B, Hkv, m] (U SV, RoPE at ``pos``):
        [B, Hkv, m, D]."""
        b, hkv, w = pos.shape
        d = self.W.shape[-1] // 2
        u = self.u_rows(pos)
        kw = torch.einsum("bhwr,bhrd->bhwd", u, self.W.view(b, hkv, self.rank, 2 * d))
        cs_rows = self.rope_rows.index_select(0, pos.reshape(-1)).view(b, hkv, w, 2 * d)
        return kw[..., :d] * cs_rows[..., :d] + kw[..., d:] * cs_rows[..., d:]

    # -- stacked rows of a batch (``stacked.py``): every row's chunks chosen, rebuilt and read at once --------------
    stacked_select = True

    def stacked_plan(self, store):
        """"dense" while the layer stays exact (its prompt not factored); else ("sparse", the factors' rank): rows
        whose factors have one rank are stacked."""
        return ("sparse", self.rank) if self.ready else "dense"

    def stacked_attend(self, layer, query, scaling):
        """``step`` for every row: the rows' landmarks stacked (a row's past its own masked -inf before the
        softmax), their U, [SV, rotate_half(SV)] and V0 one table each (``_stacked_fit``: each row's own a view of
        its part), so the chunks' keys are rebuilt by one gather, one GEMM and one multiply-add for all rows and
        their values read by one gather; one SDPA over each row's outliers, rebuilt chunks and its store's slots
        (the stack's mask on its free ones)."""
        stores = layer.stores
        if layer.plans[0] == "dense":
            return layer.exact_step(query, scaling, pos=None)
        m = self.method
        st = self._stacked_fit(layer)
        b, hq, _, d = query.shape
        hkv = layer.kv.shape[2]
        g, cs = hq // hkv, m.chunk
        sets = m.token_budget // cs
        w = sets * cs
        lm = st["lm"]  # [B, Hkv, Cl, D]
        if query.dtype == lm.dtype == torch.float32:  # the scaling and the mask past a row's own in one GEMM
            cl = lm.shape[2]
            logits = torch.baddbmm(st["lm_mask"].view(b * hkv, 1, cl).expand(b * hkv, g, cl), query.view(b * hkv, g, d),
                                   lm.view(b * hkv, cl, d).transpose(1, 2), alpha=scaling)
            score = torch.softmax(logits, dim=-1).view(b, hkv, g, cl).amax(dim=2)
        else:
            logits = torch.matmul(query.view(b, hkv, g, d), lm.transpose(-1, -2))  # [B, Hkv, g, Cl]
            score = torch.softmax(logits.float() * scaling + st["lm_mask"], dim=-1).amax(dim=2)
        top = torch.topk(score, sets, dim=-1).indices
        pos = (st["lm_base"].gather(2, top)[..., None] + self._ar).view(b, hkv, w)
        u = st["U"][st["rows"], pos].view(b * hkv, w, self.rank)  # U [B, longest n0, r]: by (row, position)
        kw = torch.bmm(u, st["W"])
        cs_rows = st["rope"].index_select(0, pos.view(-1)).view(b * hkv, w, 2 * d)
        ksel = torch.addcmul(kw[..., :d] * cs_rows[..., :d], kw[..., d:], cs_rows[..., d:])
        dv = st["V0"].shape[-1]
        vsel = st["V0"].index_select(0, (pos + st["voff"]).view(-1))
        ok, ov = st["outliers"]
        keys = torch.cat([ok, ksel.view(b, hkv, w, d), layer.kv[0]], dim=2)
        values = torch.cat([ov, vsel.view(b, hkv, w, dv), layer.kv[1]], dim=2)
        lay = layer.layout
        front = ok.shape[2] + w

        def mask():  # the read prompt sets, then the stack's mask over the rows' slots: once per step for all layers
            return torch.cat([lay.mask.new_zeros(b, 1, 1, front), lay.mask[:, :1]], dim=-1)  # (heads alike)

        out = sdpa(query, keys, values, scaling, layer.stack.memo(("shadowkv", front, id(lay)), mask))
        for i, s in enumerate(stores):
            s.policy.pos, s.policy.n_read = pos[i: i + 1], s.n
        return out

    def _stacked_fit(self, layer) -> dict:
        """The rows' tables, made once for the stack (they never change after the prefill): landmarks, their first
        positions and the mask past a row's own [B, Hkv, Cl(, D)]; U [B, longest n0, r] (a shorter row's rows
        past its prompt unused: read by (row, position), no offset added per step), [SV, rotate_half(SV)]
        [B * Hkv, r, 2D] and V0 as rows [sum of Hkv * L0, Dv] (``voff``: each row's and KV head's first) — each
        row's own U, W and V0 then a view of its part, so nothing is held twice;
        the RoPE table of the longest prompt (a position's row is every row's); the outliers' keys and values."""
        st = layer.kept
        if "U" in st:
            return st
        pols = [s.policy for s in layer.stores]
        b, hkv = len(pols), pols[0].V0.shape[1]
        dev, d = layer.kv.device, pols[0].lm.shape[-1]
        cl = max(p.lm.shape[2] for p in pols)
        lm = pols[0].lm.new_zeros(b, hkv, cl, d)
        lm_mask = torch.full((b, hkv, 1, cl), float("-inf"), device=dev)
        lm_base = torch.zeros(b, hkv, cl, dtype=torch.long, device=dev)
        for i, p in enumerate(pols):
            c = p.lm.shape[2]
            lm[i, :, :c], lm_base[i, :, :c] = p.lm[0], p.lm_base[0]
            lm_mask[i, :, :, :c] = 0.0
        U = pols[0].U.new_zeros(b, max(p.U.shape[0] for p in pols), pols[0].rank)
        W = torch.cat([p.W for p in pols])
        V0 = torch.cat([p.V0.reshape(-1, p.V0.shape[-1]) for p in pols])
        voff, v0 = [], 0
        for i, p in enumerate(pols):
            n0, L0 = p.U.shape[0], p.L0
            U[i, :n0] = p.U
            voff += [v0 + h * L0 for h in range(hkv)]
            p.U, p.W = U[i, :n0], W[i * hkv: (i + 1) * hkv]
            p.V0 = V0[v0: v0 + hkv * L0].view(1, hkv, L0, -1)
            v0 += hkv * L0
        longest = max(pols, key=lambda p: p.rope_rows.shape[0])
        st.update(lm=lm, lm_mask=lm_mask, lm_base=lm_base, U=U, W=W, V0=V0, rope=longest.rope_rows,
                  rows=torch.arange(b, device=dev).view(b, 1, 1), voff=host_to_device(voff, dev).view(b, hkv, 1),
                  outliers=tuple(torch.cat([p.outlier_kv[j] for p in pols]) for j in (0, 1)))
        return st

    # -- what the last step read ---------------------------------------------------------------------------------
    def sets(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last sparse step's prompt sets per KV head, as positions: (outliers, selected, local) [B, Hkv, *]."""
        b, hkv = self.pos.shape[:2]
        local = torch.arange(self.L0, self.n0, device=self.pos.device).expand(b, hkv, self.n0 - self.L0)
        return self.outlier_pos, self.pos, local

    def attended(self, store):
        """The last sparse step's reads as a mask over the logical positions 0..L0 + n_read - 1 (not the store's
        slots: positions 0..L0-1 are not in the store; slot i is position L0 + i): [B, Hkv, L0 + n_read], True on
        the outliers, the selected chunks, the local part and the tail. None after ``attend``."""
        if self.pos is None:
            return None
        b, hkv = self.pos.shape[:2]
        read = torch.zeros(b, hkv, self.L0 + self.n_read, dtype=torch.bool, device=self.pos.device)
        read.scatter_(2, self.outlier_pos, True).scatter_(2, self.pos, True)
        read[:, :, self.L0:] = True  # the local part and the tail
        return read

    def attended_count(self, store):
        if self.pos is None:  # attend: every held entry (the rebuilt prompt once factored)
            return float(store.n + (self.L0 if self.ready else 0))
        return float(self.outlier_pos.shape[2] + self.pos.shape[2] + self.n_read)

    # -- memory ----------------------------------------------------------------------------------------------
    def extra_entries(self) -> int:
        """Positions 0..L0-1, held besides the store (their value in V0, their key as a row of U), per KV head."""
        return self.L0 if self.ready else 0

    def extra_bytes(self) -> int:
        """Bytes held besides the store: U, [SV, rotate_half(SV)], the landmarks and their positions, the outlier
        copies, V0 and, on the layer that made it, the RoPE table the layers share."""
        if not self.ready:
            return 0
        held = [self.U, self.W, self.lm, self.lm_base, *self.outlier_kv, self.V0]
        return sum(t.nbytes for t in held) + self.rope_bytes

    def report(self, store) -> dict[str, float]:
        """``offloaded_bytes``: V0's bytes (the values the reference keeps off the GPU); ``rank``."""
        if not self.ready:
            return {}
        return {"offloaded_bytes": float(self.V0.nbytes), "rank": float(self.rank)}


@dataclass
class ShadowKV(KVMethod):
    """token_budget: prompt tokens rebuilt and read per decode step, per layer and KV head, in whole chunks (besides
    the outliers, the local part and the tail); chunk: tokens per chunk; rank: the SVD's rank (capped at Hkv x head
    dim); local_chunks: last prompt chunks kept exact; outliers: chunks per KV head kept exact for their landmark's
    poor fit; full_layers: first layers with full attention (reference: none). ``budget`` must be 1.0."""

    budget: float = setting(1.0, holds_every_token="what is rationed is the tokens rebuilt per step, "
                                                   "method.token_budget")
    token_budget: int = setting(2048, at_least=1)
    chunk: int = setting(8, at_least=1)
    rank: int = setting(160, at_least=1)
    local_chunks: int = setting(4, at_least=0)
    outliers: int = setting(48, at_least=0)
    full_layers: int = 0

    name: ClassVar[str] = "shadowkv"
    policy_class: ClassVar[type[LayerPolicy]] = ShadowKVPolicy

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token_budget % self.chunk:
            raise MethodConfigError(
                f"method.token_budget={self.token_budget} is not a multiple of method.chunk={self.chunk} (allowed: "
                f"whole chunks, e.g. method.token_budget={max(1, self.token_budget // self.chunk) * self.chunk})")
