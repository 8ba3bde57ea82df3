"""Entropy-guided OLS KV compaction, "HAE" (Chandra, "Entropy-Guided KV Cache Summarization via Low-Rank
Attention Reconstruction", blog post / Zenodo 2026): Selection (per-token attention entropy + cumulative
importance -> a "recycle bin") -> Reconstruction (least squares on reference queries) -> Compression (rank-k
synthetic key/value entries re-inserted into the cache). Card: ``methods/entropy_ols.md`` (derivation there).

Per layer and KV head the policy holds raw tokens (the store) and ``S`` position-less synthetic entries
(key, value, log-mass bias), held here and counted (``extra_bytes``, ``extra_entries``, ``attended_extra``).
Attention is one softmax over both (``attention.attention_with_extra``). Every held entry counts against
``capacity = ceil(budget * max(seen, reference_length))``; whenever a layer holds more, bins are flushed:

- selection: candidates are the raw tokens outside the ``sink`` first and the ``recent`` last ones; priority =
  percentile rank of the token's attention entropy (its own query row, normalised by log(entries seen), mean over
  the query heads of the group) + percentile rank of *low* accumulated attention mass (as H2O's, over prefill and
  decode). The ``bin_size`` x nb highest-priority candidates form nb bins (priority order), enough to get back
  under the capacity.
- reconstruction (``mode``):
  ``ols`` : per bin, ``rank`` synthetic entries whose softmax attention approximates the bin's: keys = k-means
  centroids of the bin's keys, per-entry log-mass bias fitted in the log domain so each cluster's partition mass
  is right on the reference queries, values by ridge-regularised, bin-share-weighted least squares of the bin's
  attention output on the synthetic softmax weights (``fit_bias``, ``fit_values``).
  ``linear``: the post's literal map W = pinv(Q_ref) Attn(Q_ref, K_bin, V_bin), SVD-truncated to ``rank``; the
  bin's output for a query q is q U_k S_k V_k^T, weighted in the softmax by one centroid entry carrying the bin's
  fitted log-mass (rank + 1 entries per bin).
  ``drop``: entropy selection without OLS: the bins are evicted (the post's "entropy-drop" baseline).
- synthetic entries are themselves re-binned (``ols``) when they exceed ``synthetic_fraction`` of the capacity;
  ``linear`` groups cannot be re-binned and the oldest are dropped then.

Reference queries: the last ``n_ref`` queries this layer saw (all query heads of a KV group: g x n_ref rows per
KV head), held in a buffer whose bytes count in REAL memory.

The maths (the priority, the log partition mass, the fits: ``fit_ols_entries``, ``fit_linear_entries``) are in
``entropy_ols_fit.py``, its Euclidean k-means in ``kmeans.py``; this file is the policy: when to flush, what is held.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from luka_bench.methods import entropy_ols_stacked
from luka_bench.methods.base import KVMethod, LayerPolicy, MethodConfigError, setting
from luka_bench.methods.attention import attention_with_extra, kept_indices
from luka_bench.methods.entropy_ols_fit import (fit_linear_entries, fit_ols_entries, log_partition, merged_stats,
                                                priority)

MASS, ENT = "ols_mass", "ols_entropy"
MODES = ("ols", "linear", "drop")


class EntropyOLSPolicy(LayerPolicy):
    # its compaction reads only this layer's store and the reference queries its attend kept: it runs inside the
    # forward that ends the prefill, right after this layer's attention (one layer's full cache alive at a time)
    layer_local_prefill = True
    aux_names = (MASS, ENT)

    # rows of a batch decode a layer as one (``entropy_ols_stacked.py``): a step reads everything each row holds and
    # drops nothing (a row's flushes run in its own ``after_step``, as alone)
    stacked_select = True

    def stacked_plan(self, store):
        return "all" if entropy_ols_stacked.stackable(self) else None

    def stacked_attend(self, layer, query, scaling):
        return entropy_ols_stacked.stacked_attend(layer, query, scaling)

    def stacked_release(self, layer) -> None:
        entropy_ols_stacked.stacked_release(layer)

    def __init__(self, method: "EntropyOLS", info):
        super().__init__(method, info)
        self.sk = self.sv = self.sb = None  # synthetic keys [B, Hkv, S, D], values, biases [B, Hkv, S] (fp32)
        self.smass = self.sent = None       # their accumulated mass / inherited entropy [B, Hkv, S]
        self.la = self.lb = None            # linear mode: per-centroid map factors [B, Hkv, S, D, k], [.., k, Dv]
        self._qring: torch.Tensor | None = None  # the last n_ref queries [B, Hq, n_ref, D], a ring (``qbuf``)
        self._qn = 0  # queries pushed so far
        self._qoff = 0  # the ring's turn: query i is at slot (i + _qoff) % n_ref (turned when rows are stacked)
        self._lbuf = self._ones_t = self._zero_t = None  # the decode step's scratch (``_decode_attend``)
        self.scaling = info.head_dim ** -0.5
        self.stats = {"flushes": 0.0, "binned_tokens": 0.0, "dropped_tokens": 0.0, "synthetic_made": 0.0}

    # -- accounting ----------------------------------------------------------------------------------------
    @property
    def S(self) -> int:
        return 0 if self.sk is None else self.sk.shape[2]

    def extra_entries(self) -> int:
        k = self.method.rank if self.la is not None else 0
        return self.S * (1 + k)  # linear: each centroid carries k factor pairs

    def attended_extra(self) -> int:
        return self.extra_entries()

    def synthetic_bytes(self) -> int:
        if self.sk is None:
            return 0
        total = self.sk.nbytes + self.sv.nbytes + self.sb.nbytes
        if self.la is not None:
            total += self.la.nbytes + self.lb.nbytes
        return total

    def stats_bytes(self) -> int:
        """The synthetic entries' accumulated mass and inherited entropy [B, Hkv, S] (fp32): their binning priority,
        as the store's ``aux`` is the raw tokens' (kept by every step, read by every re-binning)."""
        return 0 if self.smass is None else self.smass.nbytes + self.sent.nbytes

    def extra_bytes(self) -> int:
        """What the policy holds besides the store: the synthetic entries (``synthetic_bytes``: keys, values, biases,
        linear factors), their statistics (``stats_bytes``) and the reference-query ring (``_qbuf_bytes``)."""
        return self.synthetic_bytes() + self.stats_bytes() + self._qbuf_bytes()

    def buffer_bytes(self, store) -> int:
        """The decode step's scratch (``_decode_attend``), as allocated: the logits buffer (grown by a quarter when
        short: ``_logits``), the group-sum's ones and the 0-d zero."""
        return sum(t.untyped_storage().nbytes() for t in (self._lbuf, self._ones_t, self._zero_t) if t is not None)

    def report(self, store) -> dict[str, float]:
        m = self.method
        cap = self.capacity(store)
        return {**self.stats, "synthetic_entries": float(self.extra_entries()),
                "synthetic_bytes": float(self.synthetic_bytes()),
                "synthetic_stats_bytes": float(self.stats_bytes()),
                "query_buffer_bytes": float(self._qbuf_bytes()),
                "store_bytes": float(store.held_bytes()),
                # the post's FAIR formula, literally: k_budget - (bin_size - k_rank), per layer
                "post_fair_budget": float(cap - (m.bin_size - m.rank))}

    # -- attention -----------------------------------------------------------------------------------------
    def attend(self, store, query, scaling):
        self.scaling = scaling
        if self._fast_path(store, query):
            out = self._decode_attend(store, query, scaling)
        else:
            out, mass, emass, ent, ew = attention_with_extra(store, query, scaling, self.sk, self.sv, self.sb)
            if self.la is not None and self.S:
                out = out + self._linear_term(query, ew)
            store.aux(MASS).add_(mass)
            store.aux(ENT, zero_new=False)[:, :, store.n - query.shape[2]:] = ent  # every new token's, here
            if self.S:
                self.smass += emass
        if self.method.budget < 1.0:
            self._push_queries(query)
        return out

    def _fast_path(self, store, query) -> bool:
        """A decode step (one query) in fp32 without the linear mode's per-centroid maps: ``_decode_attend``."""
        return query.shape[2] == 1 and self.la is None and query.dtype == torch.float32 and \
            store.keys.dtype == torch.float32 and (self.S == 0 or self.smass.is_contiguous())

    def _decode_attend(self, store, query, scaling):
        """``attention_with_extra``'s decode step in the fewest kernels: the held tokens' and the synthetic
        entries' logits (bias included: ``baddbmm`` with beta 1) side by side in one buffer, one log-softmax and
        one exp for both; the entropy normalised and averaged over the group in one batched dot product
        (-sum p log p / (g log N)) written straight into the new token's slot; the masses added into their
        accumulators by ``baddbmm_`` (ones . P); the output as one GEMM plus one accumulating GEMM for the
        synthetic values (``entropy_ols_stacked.decode_pass``, the pass rows of a batch share). Same values as the
        general path (``tests/test_entropy_ols.py``)."""
        b, hq, _, d = query.shape
        hkv = self.info.num_kv_heads
        g, bh = hq // hkv, b * hkv
        n, S = store.n, self.S
        N = n + S
        buf = self._logits(bh, g, N, query)
        extra = (self.sk.reshape(bh, S, d), self.sv.reshape(bh, S, -1), self.sb.view(bh, 1, S)) if S else None
        out = entropy_ols_stacked.decode_pass(
            query.reshape(bh, g, d), store.keys.reshape(bh, n, d), store.values.reshape(bh, n, -1), extra, buf,
            self._const(query, 0.0), None, scaling, -1.0 / (g * math.log(N)) if N > 1 else 0.0,
            store.aux(ENT, zero_new=False)[:, :, n - 1:].view(bh, 1, 1), store.aux(MASS).view(bh, 1, n),
            self.smass.view(bh, 1, S) if S else None, self._ones(bh, g, query))
        return out.view(b, hq, 1, -1)

    def _logits(self, bh: int, g: int, N: int, like: torch.Tensor) -> torch.Tensor:
        """A float32 [bh, g, N] view of a scratch kept between steps (grown by a quarter when short)."""
        t = self._lbuf
        if t is None or t.shape[:2] != (bh, g) or t.shape[2] < N or t.device != like.device:
            t = self._lbuf = torch.empty(bh, g, int(N * 1.25) + 64, dtype=torch.float32, device=like.device)
        return t[:, :, :N]

    def _ones(self, bh: int, g: int, like: torch.Tensor) -> torch.Tensor:
        t = self._ones_t
        if t is None or t.shape != (bh, 1, g) or t.device != like.device or t.dtype != like.dtype:
            t = self._ones_t = like.new_ones(bh, 1, g)
        return t

    def _const(self, like: torch.Tensor, value: float) -> torch.Tensor:
        t = self._zero_t
        if t is None or t.device != like.device or t.dtype != like.dtype:
            t = self._zero_t = like.new_full((), value)
        return t

    # -- the reference queries: the last n_ref, in a ring (one copy per step) --------------------------------
    @property
    def qbuf(self) -> torch.Tensor | None:
        """The last ``n_ref`` queries [B, Hq, <= n_ref, D], oldest first."""
        ring = self._qring
        if ring is None:
            return None
        R = ring.shape[2]
        if self._qn < R:
            return ring[:, :, : self._qn]
        k = (self._qn + self._qoff) % R
        return ring if k == 0 else torch.cat([ring[:, :, k:], ring[:, :, :k]], dim=2)

    def _qbuf_bytes(self) -> int:
        ring = self._qring
        return 0 if ring is None else ring[:, :, :1].nbytes * min(self._qn, ring.shape[2])

    def _push_queries(self, query) -> None:
        b, hq, lq, d = query.shape
        R = self.method.n_ref
        if self._qring is None:
            self._qring = query.new_empty(b, hq, R, d)
        if lq >= R:
            self._qring.copy_(query[:, :, lq - R:])
            self._qn, self._qoff = R, 0
            return
        start = (self._qn + self._qoff) % R
        first = min(lq, R - start)
        self._qring[:, :, start: start + first] = query[:, :, :first]
        if lq > first:
            self._qring[:, :, : lq - first] = query[:, :, first:]
        self._qn += lq

    def _linear_term(self, query, ew):
        b, hq, lq, d = query.shape
        hkv = self.sk.shape[1]
        q = query.view(b, hkv, hq // hkv, lq, d).float()
        z = torch.einsum("bhgld,bhsdk->bhglsk", q, self.la)  # [B, Hkv, g, Lq, S, k]
        o = torch.einsum("bhglsk,bhskv->bhglsv", z, self.lb)
        return (ew.unsqueeze(-1) * o).sum(-2).reshape(b, hq, lq, -1).to(query.dtype)

    # -- compaction ----------------------------------------------------------------------------------------
    def after_prefill(self, store) -> None:
        self.compact(store)

    def after_step(self, store) -> None:
        self.compact(store)

    def _ref(self):
        q = self.qbuf
        b, hq, m, d = q.shape
        hkv = self.info.num_kv_heads
        return q.reshape(b, hkv, (hq // hkv) * m, d)

    def per_bin(self) -> int:
        """Entries one flushed bin becomes: rank (ols), rank + 1 (linear: factor pairs + the mass centroid), 0."""
        m = self.method
        return {"ols": m.rank, "linear": m.rank + 1, "drop": 0}[m.mode]

    def compact(self, store) -> None:
        m = self.method
        cap = self.capacity(store)
        for _ in range(8):  # rounds; each is vectorised over bins and heads (rarely more than two)
            held = store.n + self.extra_entries()
            if held <= cap:
                return
            if self.S and self.extra_entries() + self.per_bin() > m.synthetic_fraction * cap:
                self._rebin_synthetic(store, cap)
                continue
            if not self._flush_raw(store, held - cap, cap):
                break
        if store.n + self.extra_entries() > cap:
            self._drop(store, store.n + self.extra_entries() - cap, cap)

    def _split(self, store, cap):
        m = self.method
        recent = min(store.n, max(m.min_recent, round(m.recent_fraction * cap)))
        sink = min(m.sink, store.n - recent)
        return sink, recent

    def _candidates(self, store, cap):
        sink, recent = self._split(store, cap)
        lo, hi = sink, store.n - recent
        return lo, hi

    def _flush_raw(self, store, deficit: int, cap: int) -> bool:
        m = self.method
        lo, hi = self._candidates(store, cap)
        n_cand = hi - lo
        free = m.bin_size - self.per_bin()
        nb = min(math.ceil(deficit / free), n_cand // m.bin_size)
        if nb <= 0:
            return False
        b, h = store.keys.shape[:2]
        prio = priority(store.aux(ENT)[:, :, lo:hi], store.aux(MASS)[:, :, lo:hi])
        order = torch.sort(prio, dim=-1, descending=True, stable=True).indices
        chosen = order[..., : nb * m.bin_size] + lo  # [B, H, nb*bin]
        keep_mask = torch.ones(b, h, store.n, dtype=torch.bool, device=store.device)
        keep_mask.scatter_(2, chosen, False)
        if m.mode != "drop":
            idx = chosen.view(b, h, nb, m.bin_size)
            self._make_entries(store, idx)
        keep = kept_indices(keep_mask, store.n - nb * m.bin_size)
        store.keep(keep)
        self.stats["flushes"] += nb
        self.stats["binned_tokens"] += nb * m.bin_size
        if m.mode == "drop":
            self.stats["dropped_tokens"] += nb * m.bin_size
        return True

    def _gather(self, x, idx):
        """x [B, H, n, *] gathered at idx [B, H, nb, bin] -> [B, H, nb, bin, *]."""
        b, h, nb, s = idx.shape
        flat = idx.reshape(b, h, nb * s)
        if x.dim() == 3:
            return x.gather(2, flat).view(b, h, nb, s)
        return x.gather(2, flat.unsqueeze(-1).expand(b, h, nb * s, x.shape[-1])).view(b, h, nb, s, x.shape[-1])

    def _make_entries(self, store, idx) -> None:
        kb, vb = self._gather(store.keys, idx), self._gather(store.values, idx)
        bb = torch.zeros(idx.shape, device=store.device)
        self._add_from_bins(store, kb, vb, bb, self._gather(store.aux(MASS), idx), self._gather(store.aux(ENT), idx))

    def _add_from_bins(self, store, kb, vb, bb, mass, ent) -> None:
        m = self.method
        q = self._ref().unsqueeze(2)  # [B, H, 1, m_q, D]
        lz_all = log_partition(self._ref(), store.keys, self.scaling, self.sk if self.S else None,
                               self.sb).unsqueeze(2)  # [B, H, 1, m_q]
        b, h, nb = kb.shape[:3]
        if m.mode == "ols":
            keys, values, bias, onehot = fit_ols_entries(q, kb, vb, bb, lz_all, self.scaling, m.rank,
                                                         m.kmeans_iters, m.ridge)
            la = lb = None
        else:  # linear: one centroid carrying the bin's log-mass + the rank-k map
            keys, values, bias, onehot, la, lb = fit_linear_entries(q, kb, vb, bb, self.scaling, m.rank)
        r = keys.shape[3]
        smass, sent = merged_stats(onehot, mass, ent)
        new = [keys.reshape(b, h, nb * r, -1).to(store.keys.dtype), values.reshape(b, h, nb * r, -1).to(store.values.dtype),
               bias.reshape(b, h, nb * r).float(), smass.reshape(b, h, nb * r).float(), sent.reshape(b, h, nb * r).float()]
        if la is not None:
            new += [la.reshape(b, h, nb, *la.shape[-2:]), lb.reshape(b, h, nb, *lb.shape[-2:])]
        self._append_synthetic(new)
        self.stats["synthetic_made"] += nb * r

    def _append_synthetic(self, new) -> None:
        if self.sk is None:
            self.sk, self.sv, self.sb, self.smass, self.sent = new[:5]
            if len(new) > 5:
                self.la, self.lb = new[5:]
            return
        self.sk, self.sv, self.sb, self.smass, self.sent = (torch.cat([a, x], dim=2) for a, x in zip(
            (self.sk, self.sv, self.sb, self.smass, self.sent), new[:5]))
        if len(new) > 5:
            self.la, self.lb = torch.cat([self.la, new[5]], dim=2), torch.cat([self.lb, new[6]], dim=2)

    def _keep_synthetic(self, keep) -> None:
        """Keep the synthetic entries at keep [B, H, s] (sorted)."""
        g = lambda x: x.gather(2, keep) if x.dim() == 3 else x.gather(  # noqa: E731
            2, keep.view(*keep.shape, *([1] * (x.dim() - 3))).expand(*keep.shape, *x.shape[3:]))
        self.sk, self.sv, self.sb, self.smass, self.sent = (g(x) for x in (self.sk, self.sv, self.sb, self.smass,
                                                                            self.sent))
        if self.la is not None:
            self.la, self.lb = g(self.la), g(self.lb)
        if self.S == 0:
            self.sk = self.sv = self.sb = self.smass = self.sent = self.la = self.lb = None

    def _rebin_synthetic(self, store, cap) -> bool:
        """ols: the bin_size highest-priority synthetic entries become ``rank`` new ones (their biases enter the
        fit); linear: the oldest groups are dropped (a linear map cannot be merged into a softmax entry)."""
        m = self.method
        S = self.S
        b, h = self.sk.shape[:2]
        if m.mode == "linear" or S < m.bin_size:
            per = self.extra_entries() // S  # entries per synthetic slot
            n_drop = min(S, max(1, S - (int(m.synthetic_fraction * cap) - self.per_bin()) // per))
            keep = torch.arange(n_drop, S, device=self.sk.device).expand(b, h, S - n_drop)
            self._keep_synthetic(keep)
            self.stats["dropped_tokens"] += n_drop
            return True
        prio = priority(self.sent, self.smass)
        order = torch.sort(prio, dim=-1, descending=True, stable=True).indices
        chosen = order[..., : m.bin_size]
        keep_mask = torch.ones(b, h, S, dtype=torch.bool, device=self.sk.device)
        keep_mask.scatter_(2, chosen, False)
        keep = kept_indices(keep_mask, S - m.bin_size)
        idx = chosen.unsqueeze(2)
        kb, vb, bb = self._gather(self.sk, idx), self._gather(self.sv, idx), self._gather(self.sb, idx)
        mass, ent = self._gather(self.smass, idx), self._gather(self.sent, idx)
        self._keep_synthetic(keep)
        self._add_from_bins(store, kb, vb, bb, mass, ent)
        self.stats["flushes"] += 1
        return True

    def _drop(self, store, excess: int, cap: int) -> None:
        """Fallback when no full bin can be formed: evict the ``excess`` highest-priority raw candidates."""
        lo, hi = self._candidates(store, cap)
        excess = min(excess, hi - lo)
        if excess <= 0:
            return
        b, h = store.keys.shape[:2]
        prio = priority(store.aux(ENT)[:, :, lo:hi], store.aux(MASS)[:, :, lo:hi])
        chosen = torch.sort(prio, dim=-1, descending=True, stable=True).indices[..., :excess] + lo
        keep_mask = torch.ones(b, h, store.n, dtype=torch.bool, device=store.device)
        keep_mask.scatter_(2, chosen, False)
        store.keep(kept_indices(keep_mask, store.n - excess))
        self.stats["dropped_tokens"] += excess


@dataclass
class EntropyOLS(KVMethod):
    """mode: ols | linear | drop; bin_size: tokens per recycle bin; rank: synthetic entries per bin (k);
    n_ref: reference queries kept per query head; sink / recent_fraction / min_recent: never binned;
    synthetic_fraction: share of the capacity synthetic entries may take before they are re-binned;
    kmeans_iters, ridge: the fit."""

    budget: float = 0.25
    mode: str = setting("ols", choices=MODES)
    bin_size: int = setting(32, at_least=2)
    rank: int = setting(4, at_least=1)
    n_ref: int = setting(16, at_least=1)
    sink: int = setting(4, at_least=0)
    recent_fraction: float = setting(0.25, within="[0, 1]")
    min_recent: int = setting(0, at_least=0)
    synthetic_fraction: float = setting(0.5, within="(0, 1]")
    kmeans_iters: int = setting(8, at_least=0)
    ridge: float = setting(1e-3, at_least=0)

    name: ClassVar[str] = "entropy_ols"
    policy_class: ClassVar[type[LayerPolicy]] = EntropyOLSPolicy

    def __post_init__(self) -> None:
        super().__post_init__()
        per = self.rank + (1 if self.mode == "linear" else 0)
        if self.mode != "drop" and per >= self.bin_size:
            raise MethodConfigError(f"method.rank={self.rank!r} leaves nothing to free in a bin of "
                                    f"method.bin_size={self.bin_size}; allowed: rank < bin_size"
                                    + (" - 1 (linear adds a centroid)" if self.mode == "linear" else ""))

