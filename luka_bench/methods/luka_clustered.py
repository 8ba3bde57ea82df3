"""LuKA clustered attention (Fei, Rodríguez, Patel, Montemayor, "LuKA: Line and Cluster Key-Value
Approximations", §3.2 and Algorithm 1): attention over a cover of summary pages and raw tokens, with
mass-preserving top-down refinement.

Per layer, the oldest raw tokens are grouped into pages of ``page_size`` tokens (from the oldest unsummarised
token on, never touching the ``sink`` first tokens nor the ``tail`` most recent ones); a compressor turns each
page into one summary key/value. With ``levels = 2`` every ``page_size`` consecutive pages are summarised again
into a level-2 node (a tree: node -> pages -> tokens). The *cover* holds each raw token exactly once: itself (sink,
tail) or one ancestor (the highest summary node above it).

One query (Algorithm 1, eqs. 1-4), vectorised over KV heads, query heads and queries:
1. logits over the cover, ``l_c = q.k_c * scale`` (+ ``log(page tokens)`` with ``summary_bias: log_size``);
2. masses ``alpha_c`` = softmax over the cover;
3. the refinement rule picks summary nodes to expand (per KV head, from the mass summed over the query heads of
   its group; for a query chunk, per query). A refined node is replaced by its children: their logits are
   softmaxed locally (``beta_i``) and each child gets ``alpha_c * beta_i`` (``refine.mass: parent``, eq. 3
   literally), or its exact share of the page's partition function (``refine.mass: exact``, the reference code's
   "corrected refinement": the page's mass becomes ``sum_i exp(l_i) / Z``, children still split it by ``beta_i``).
   With ``exact`` refining every page is full attention; with ``parent`` the page masses stay those of the summary
   keys. Level-2 refinement yields level-1 pages, which the rule may refine in turn (top-down);
4. output = sum over resolved nodes of mass x value; unrefined summaries contribute ``alpha_c v_c``.

Every ``compress_every`` decode steps (and once after the prefill) the segmenter turns the raw tokens between the
last page and the tail into new pages. Compressors: ``mean``; ``attention_weighted`` (pi = softmax(w / tau), w =
attention mass each token has received so far, accumulated over the prefill and every step while it was raw);
``random`` (one token of the page, seeded); ``zero_value`` (attention-weighted keys, zero values: the paper's
Fig. 6 ablation).

Memory: every raw token is kept (refinement needs it) plus the summaries, so the measured kv_ratio is >= 1: the
method cuts the attended span, not memory. ``budget`` is therefore not a knob here (must be 1.0).

No Python loop over pages, heads or tokens on the per-step path: gathers, scatters and batched matmuls; the only
loop is over tree levels (``levels`` <= 3).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from luka_bench.methods import cpu_kernel
from luka_bench.methods.base import KVMethod, LayerPolicy, setting
from luka_bench.methods.luka_cover import Cover
from luka_bench.methods.pages import page_means
from luka_bench.methods.attention import (attention_with_mass, exact_attention, group_apply, group_logits,
    kv_rows, scatter_add_rows)

MASS = "luka_mass"
RULES = ("none", "threshold", "top_k", "top_frac")
COMPRESSORS = ("mean", "attention_weighted", "random", "zero_value")
NEG = float("-inf")


@dataclass
class Refine:
    rule: str = setting("top_k", choices=RULES)  # none | threshold | top_k | top_frac
    k: int = setting(3, at_least=0)  # top_k (paper: 3)
    threshold: float = 0.05  # threshold: refine when the node's mass exceeds this
    fraction: float = setting(0.1, within="[0, 1]")  # top_frac: share of the candidate summary nodes refined
    mass: str = setting("exact", choices=("exact", "parent"))  # see module docstring


class LuKAPolicy(LayerPolicy):
    times_itself = True  # attention / refinement / segment_compress, timed inside
    # a decode step is written at a slot the device holds (``KVStore.static_slot``) and mirrored into the cover
    # at one (``luka_cover.Cover.sync``): between compressions, steps are graph-ready
    static_decode = True

    def __init__(self, method: "LuKAClustered", info):
        super().__init__(method, info)
        self.sk: list[torch.Tensor | None] = [None] * (method.levels + 1)  # sk[l]: level-l summary keys
        self.sv: list[torch.Tensor | None] = [None] * (method.levels + 1)
        # accumulated mass per level-l node: the compressor's weights of the level-(l+1) nodes, so kept for l < levels
        # only (the top level's is never read)
        self.imp: list[torch.Tensor | None] = [None] * (method.levels + 1)
        self.P = [0] * (method.levels + 2)  # P[l]: number of level-l nodes; P[levels+1] = 0
        self.steps = 0
        self._last_total: torch.Tensor | None = None  # the general path's resolved masses (last_masses, for tests)
        # Decode fast path (one query, one level): the cover's keys/values [sink | page summaries | tail region |
        # scratch] in one buffer (``luka_cover.Cover``), updated when pages are made and written as tokens arrive, so
        # a step is one matmul over the cover instead of one per part.
        self.cover = Cover(method.sink, method.tail, method.page_size, method.compress_every)
        self.use_fast_path = True
        # What the last attend read (``attended``): None = every held token (exact attention), else
        # (frontier, n, [(raw ids [B, Hkv, ...], valid [B, Hkv, ...])] — the decode path: (its refined pages
        # [B, Hkv, K], valid or None), resolved when asked —, summaries read per KV head)
        self._att: tuple | None = None
        self._att_count: float | None = None  # the decode path's attended count, when known without a mask

    # -- bookkeeping ---------------------------------------------------------------------------------------
    @property
    def frontier(self) -> int:
        """First raw token not covered by a page."""
        return self.method.sink + self.P[1] * self.method.page_size

    def extra_bytes(self) -> int:
        """The summaries held: each level's P[l] keys and values (and, below the top level, their accumulated mass,
        the next level's compressor weights) + the fast path's cover copies of its valid entries (``Cover.nbytes``).
        """
        m = self.method
        total = 0
        for lvl in range(1, m.levels + 1):
            if self.sk[lvl] is not None:
                per = self.sk[lvl][:, :, :1].nbytes + self.sv[lvl][:, :, :1].nbytes
                if self.imp[lvl] is not None:
                    per += self.imp[lvl][:, :, :1].nbytes
                total += per * self.P[lvl]
        return total + self.cover.nbytes()  # the fast path's cover buffer holds copies: counted too

    def buffer_bytes(self, store) -> int:
        """Allocated beyond what ``extra_bytes`` counts, as allocated: each level's summary buffers' room past its
        P[l] nodes (grown by half when short: ``_append``), the cover's free slots, room and the decode step's
        scratch (``Cover.scratch_bytes``) and what the last step read (``attended``) and its masses."""
        m = self.method
        total = self.cover.scratch_bytes()
        for lvl in range(1, m.levels + 1):
            bufs = [t for t in (self.sk[lvl], self.sv[lvl], self.imp[lvl]) if t is not None]
            total += sum(t.untyped_storage().nbytes() - t[:, :, :1].nbytes * self.P[lvl] for t in bufs)
        # what the last step read (``attended``: its refined pages or raw ids) and its masses (``last_masses``)
        last: dict[int, int] = {}
        todo = [self._att, self._last_total]
        while todo:
            x = todo.pop()
            if isinstance(x, (tuple, list)):
                todo.extend(x)
            elif isinstance(x, torch.Tensor):
                last[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return total + sum(last.values())

    def _needs_mass(self) -> bool:
        return self.method.compressor in ("attention_weighted", "zero_value")

    # -- hooks ---------------------------------------------------------------------------------------------
    def step(self, store, query, scaling, step):
        if self.P[1] > 0 and self.method.levels == 1 and self.use_fast_path:
            self._att = self._att_count = None
            return self.decode_step(store, query, scaling, step)
        return self.attend(store, query, scaling)

    def attend(self, store, query, scaling):
        self._att = self._att_count = None
        if self.P[1] == 0:
            with store.cache.span("attention", store.device):
                if self._needs_mass():
                    out, mass = attention_with_mass(store, query, scaling)
                    store.aux(MASS).add_(mass)
                else:
                    out = exact_attention(store, query, scaling)
            return out
        return self.clustered(store, query, scaling)

    def attended(self, store):
        """Sinks + raw tail + the raw tokens of the refined pages (union over a chunk's queries); unrefined
        summaries are ``attended_extra``. None before the first page (exact attention)."""
        if self._att is None:
            return None
        fr, n, raw, _ = self._att
        if isinstance(raw, tuple):  # the decode path's (pages, valid): their raw ids resolved only when asked
            raw = self._decode_raw(*raw, self.method.page_size, self.method.sink)
        b, h = store.keys.shape[:2]
        hit = torch.zeros(b, h, store.n, dtype=torch.int32, device=store.device)
        hit[:, :, : self.method.sink] = 1
        hit[:, :, fr:n] = 1
        for ids, valid in raw:  # integer sums: exact in any order (deterministic with CUDA's atomics too)
            src = torch.ones_like(ids, dtype=torch.int32) if valid is None else valid.to(torch.int32)
            hit.scatter_add_(2, ids.reshape(b, h, -1), src.reshape(b, h, -1))
        return hit > 0

    def attended_count(self, store) -> float:
        """The decode path knows it: sinks + raw tail + the chosen pages' tokens (distinct pages, all older than
        the tail) — no mask over the store built after every step."""
        if self._att_count is not None:
            return self._att_count
        return super().attended_count(store)

    def attended_extra(self) -> int:
        if self._att is None:
            return 0
        x = self._att[3]
        if isinstance(x, torch.Tensor) and x.dtype == torch.bool:  # the decode path's refined-page mask [B, Hkv, K]
            return self.P[1] - x.sum(-1).float().mean().round()  # pages not refined (a device tensor: no sync)
        return x

    def after_prefill(self, store) -> None:
        with store.cache.span("segment_compress", store.device):
            self.compress(store)

    def after_step(self, store) -> None:
        self.steps += 1
        if self.steps % self.method.compress_every == 0:
            with store.cache.span("segment_compress", store.device):
                self.compress(store)

    # -- segmentation and compression ----------------------------------------------------------------------
    def _weights(self, w: torch.Tensor) -> torch.Tensor:
        """Compressor weights over the last axis (the page's members). w: importance [..., S]."""
        m = self.method
        if m.compressor == "mean":
            return torch.full_like(w, 1.0 / w.shape[-1])
        if m.compressor == "random":
            # seeded by (seed, layer, pages so far): reproducible, and nothing to carry across cache clones. Drawn
            # on the cache's device (a CPU draw copied over would be a blocking host-to-device copy, a sync on
            # every compressing step on CUDA); a CUDA generator draws other numbers than the CPU's
            gen = torch.Generator(device=w.device).manual_seed(
                (m.seed * 1000003 + self.info.layer_idx * 7919 + self.P[1]) % (2**63))
            pick = torch.randint(0, w.shape[-1], w.shape[:-1], generator=gen, device=w.device)
            return torch.nn.functional.one_hot(pick, w.shape[-1]).to(w.dtype)
        return torch.softmax(w / m.tau, dim=-1)  # attention_weighted, zero_value

    def _append(self, lvl: int, pi: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                value: bool) -> None:
        """New level-``lvl`` nodes from groups ``k``/``v`` [B, H, new, S, D] with compressor weights ``pi`` and
        importance ``w`` [B, H, new, S]: each summary written straight into its slot of the level's buffers (no
        copy of a computed summary), the buffers grown by half when short."""
        cur, new = self.P[lvl], k.shape[2]
        buf = self.sk[lvl]
        if buf is None or cur + new > buf.shape[2]:
            cap = max(cur + new, int((0 if buf is None else buf.shape[2]) * 1.5) + 8)
            b, h = k.shape[:2]
            nk = k.new_empty(b, h, cap, k.shape[-1])
            nv = v.new_empty(b, h, cap, v.shape[-1])
            ni = w.new_zeros(b, h, cap) if lvl < self.method.levels else None
            if buf is not None:
                nk[:, :, :cur] = buf[:, :, :cur]
                nv[:, :, :cur] = self.sv[lvl][:, :, :cur]
                if ni is not None:
                    ni[:, :, :cur] = self.imp[lvl][:, :, :cur]
            self.sk[lvl], self.sv[lvl], self.imp[lvl] = nk, nv, ni
        self._combine(pi, k, self.sk[lvl][:, :, cur: cur + new])
        self._combine(pi, v, self.sv[lvl][:, :, cur: cur + new], value=value)
        if self.imp[lvl] is not None:
            torch.sum(w, -1, out=self.imp[lvl][:, :, cur: cur + new])
        self.P[lvl] = cur + new

    def compress(self, store) -> None:
        """Turn raw tokens from the frontier up to the tail into new pages (and pages into level-2 nodes)."""
        m = self.method
        S = m.page_size
        start = self.frontier
        new = (store.n - m.tail - start) // S
        if new <= 0:
            return
        b, h = store.keys.shape[:2]
        end = start + new * S
        k = store.keys[:, :, start:end].reshape(b, h, new, S, -1)
        v = store.values[:, :, start:end].reshape(b, h, new, S, -1)
        w = store.aux(MASS)[:, :, start:end].reshape(b, h, new, S) if self._needs_mass() else \
            torch.zeros(b, h, new, S, device=k.device)
        pi = self._weights(w)
        self._append(1, pi, k, v, w, value=True)
        for lvl in range(2, m.levels + 1):
            groups = self.P[lvl - 1] // S - self.P[lvl]
            if groups <= 0:
                break
            lo, hi = self.P[lvl] * S, (self.P[lvl] + groups) * S
            k = self.sk[lvl - 1][:, :, lo:hi].reshape(b, h, groups, S, -1)
            v = self.sv[lvl - 1][:, :, lo:hi].reshape(b, h, groups, S, -1)
            w = self.imp[lvl - 1][:, :, lo:hi].reshape(b, h, groups, S)
            pi = self._weights(w)
            # a level-2 value must summarise its pages' raw values; for zero_value they are all zero anyway
            self._append(lvl, pi, k, v, w, value=False)
        if m.levels == 1 and self.use_fast_path:
            # the decode path's cover and its mask remade now, in the event step, not in the next (steady) step
            W = self._cover(store)
            store.cache.held_mask("luka_cover", W, self.cover.n, None, b * h, store.keys.dtype, store.device)

    def _combine(self, pi: torch.Tensor, x: torch.Tensor, out: torch.Tensor, value: bool = False) -> None:
        """out [..., D] = the ``pi``-weighted sum of ``x`` [B, H, P, S, D] over each group of S (zero values for
        ``zero_value``; for ``mean`` the group's mean, ``pages.page_means``, as ``PagedKeys`` keeps it)."""
        if value and self.method.compressor == "zero_value":
            out.zero_()
        elif self.method.compressor == "mean":
            b, h, p, s, d = x.shape
            page_means(x.reshape(b, h, p * s, d), s, out=out)
        else:
            torch.sum(pi.unsqueeze(-1).to(x.dtype) * x, dim=-2, out=out)

    # -- attention over the cover with refinement ----------------------------------------------------------
    def _select(self, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Refinement rule over candidate nodes. score: mass per KV head [B, Hkv, Lq, C]. Returns (indices
        [B, Hkv, Lq, K], valid [B, Hkv, Lq, K] or None when every chosen node is refined) or None when nothing
        is refined."""
        r = self.method.refine
        K = self._nodes_refined(score.shape[-1])
        if K <= 0:
            return None
        # the K highest by a stable descending sort: equal masses go to the earlier node, on every device and run
        # (torch.topk leaves the order of ties to the implementation)
        idx = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :K]
        return idx, (score.gather(-1, idx) > r.threshold if r.rule == "threshold" else None)

    def _nodes_refined(self, C: int) -> int:
        """How many of ``C`` candidate nodes the rule refines (a fixed number: see the threshold rule)."""
        r = self.method.refine
        if r.rule == "none" or C == 0:
            return 0
        if r.rule == "top_k":
            return min(r.k, C)
        if r.rule == "top_frac":
            return min(C, math.ceil(r.fraction * C - 1e-9))
        # threshold: a fixed K that no (head, query) can exceed, the rest masked (``valid``) — as many as the
        # most demanding one needs would be data-dependent, a host sync per step. A KV head's score sums the
        # masses of its group's g query heads (<= g in all), so fewer than g / threshold nodes exceed it.
        g = self.info.num_heads // self.info.num_kv_heads
        return min(C, math.ceil(g / r.threshold - 1e-9)) if r.threshold > 0 else C

    def _cover(self, store, step=None) -> int:
        """The cover buffer in sync with the store (``Cover.sync``); returns its width W."""
        return self.cover.sync(store, step, self.sk[1], self.sv[1], self.P[1], self.frontier, self._max_children())

    def decode_step(self, store, query, scaling, step):
        """The per-token path (one query, one summary level): the same computation as ``clustered``, in the
        fewest tensor operations — a decode step at 2K is made of ~25 small ops, each costing more in dispatch
        than in arithmetic, so every op counts: logits over the whole cover buffer (``Cover.sync``: its free tail
        slots masked by an additive mask that the scaled matmul adds itself) in one op; the page masses for the
        rule from one softmax; the chosen pages' raw tokens gathered straight into the cover's scratch in one op
        (``Cover.gather_pages``); the refined parents masked in place; one softmax over cover + children; one matmul for
        the output. Every matmul is a 3-D ``bmm`` over (batch x KV head), the group's query heads as rows (a 4-D
        ``matmul`` costs about twice as much at these sizes). Between compressions every step has the same ops on
        the same shapes with no Python number that changes (graph-ready). Importance is accumulated only where it
        will be read: the raw tokens not yet in a page (sinks are never summarised, paged tokens never again; page
        importance is read only by level-2 nodes, which this path does not serve); the attended set is resolved
        only when asked. ``tests/test_luka_clustered.py`` checks it against ``clustered``."""
        m = self.method
        S, s0, P, fr = m.page_size, m.sink, self.P[1], self.frontier
        cache = store.cache
        t0 = cache.mark(query.device)
        b, hq, _, d = query.shape
        hkv, n = self.info.num_kv_heads, store.n
        g, bh = hq // hkv, b * hkv
        q = query.reshape(bh, g, d)  # a view for the usual layouts
        W = self._cover(store, step)
        mask = step.held_mask(store, "luka_cover", W, self.cover.n, bh, query.dtype)  # [B*Hkv, 1, W]
        ck, cv = self.cover.k, self.cover.v
        # fp32: the cover's logits and the refined children's are written side by side into one buffer, so the
        # softmax over both needs no concatenation (other dtypes: computed, cast to fp32 and concatenated)
        lb = self.cover.logits(bh, g, W + self._max_children(), query) if query.dtype == torch.float32 else None
        logit = torch.baddbmm(mask, q, ck[:, :, :W].view(bh, W, d).transpose(1, 2), alpha=scaling,
                              **({} if lb is None else {"out": lb[:, :, :W]})).float()  # [B*Hkv, g, W]
        if m.summary_bias != "none":
            logit[..., s0: s0 + P] += m.bias(1)
        t1 = cache.mark(query.device)
        sel = None
        if m.refine.rule != "none":
            sel = self._select(torch.softmax(logit, -1)[..., s0: s0 + P].sum(1))  # per KV head [B*Hkv, P]
        if sel is not None:
            idx, valid = sel  # [B*Hkv, K] page ids; valid: threshold rule's padding, else None
            k_sel = idx.shape[-1]
            KS = k_sel * S
            self.cover.gather_pages(store, idx, W)  # keys and values into the cover's scratch
            in_buf = lb is not None and m.refine.mass == "exact" and valid is None  # no out-of-place edits below
            cl = torch.baddbmm(self.cover.zero(query), q, ck[:, :, W: W + KS].view(bh, KS, d).transpose(1, 2), beta=0.0,
                               alpha=scaling, **({"out": lb[:, :, W: W + KS]} if in_buf else {})).float()
            pidx = (idx + s0 if s0 else idx).unsqueeze(1).expand(-1, g, -1)
            if m.refine.mass == "parent":
                parent = logit.gather(-1, pidx)  # [B*Hkv, g, K]
                cl4 = cl.view(bh, g, k_sel, S)
                cl = (cl4 + (parent - torch.logsumexp(cl4, -1)).unsqueeze(-1)).view(bh, g, KS)
            if valid is not None:  # pages below the threshold in a padded top-K stay unrefined
                vmask = valid.unsqueeze(1).expand(-1, g, -1)
                cl = cl.view(bh, g, k_sel, S).masked_fill(~vmask.unsqueeze(-1), NEG).view(bh, g, -1)
                logit = logit.scatter(-1, pidx, logit.gather(-1, pidx).masked_fill(vmask, NEG))
            else:
                logit.scatter_(-1, pidx, NEG)
            # what this step read (LayerPolicy.attended), resolved only when asked
            pages, valid = idx.view(b, hkv, k_sel), None if valid is None else valid.view(b, hkv, k_sel)
            self._att = (fr, n, (pages, valid), P - k_sel if valid is None else valid)
            if valid is None:
                self._att_count = float(s0 + n - fr + KS)
            t2 = cache.mark(query.device)
            p = torch.softmax(lb[:, :, : W + KS] if in_buf else torch.cat([logit, cl], -1), -1)
            out = torch.bmm(p.to(cv.dtype), cv[:, :, : W + KS].view(bh, W + KS, -1))
        else:
            self._att = (fr, n, [], P)
            self._att_count = float(s0 + n - fr)
            t2 = cache.mark(query.device)
            p = torch.softmax(logit, -1)
            out = torch.bmm(p.to(cv.dtype), cv[:, :, :W].view(bh, W, -1))
        self._last_total = None  # the step's masses are not kept (one softmax over cover + children: they sum to one)
        if self._needs_mass():
            # the raw tail's importance += its mass summed over the group's query heads: one batched GEMV that adds
            # into the accumulator (ones [1, g] @ p), instead of a sum and an add; over the whole tail region (its
            # free slots add 0) within the store's capacity
            acc = store.aux(MASS, whole=True)
            T = min(W - s0 - P, acc.shape[2] - fr)
            acc[:, :, fr: fr + T].view(bh, 1, T).baddbmm_(self.cover.ones(bh, g, p), p[:, :, s0 + P: s0 + P + T])
        t3 = cache.mark(query.device)
        cache.add_span("attention", t0, t1)
        cache.add_span("attention", t2, t3)
        cache.add_span("refinement", t1, t2)
        return out.view(b, hq, 1, -1).to(query.dtype)

    # -- stacked rows of a batch (``stacked.py``): ``decode_step`` for every row at once ----------------------------
    stacked_select = True

    def stacked_plan(self, store):
        """The pages a decode step refines (its K) where ``decode_step`` serves it with a fixed K (one summary level,
        the top-k or top-fraction rule or none: rows stack when their K agree); None otherwise (before the first
        page, the threshold rule, several levels)."""
        m = self.method
        if not (self.P[1] > 0 and m.levels == 1 and self.use_fast_path and m.refine.rule != "threshold"):
            return None
        return self._nodes_refined(self.P[1]) if m.refine.rule != "none" else 0

    def stacked_attend(self, layer, query, scaling):
        """``decode_step`` for every row: the rows' covers stacked ([2, B, Hkv, W + K * S, D], each row's cover
        right-aligned at W — -inf before it —, its free slots masked; made again when a row's pages change), the
        step's token written at each row's cover slot, one logits GEMM, each row's top-K pages (its pages only)
        refined from the stacked storage into the common scratch at W, one softmax and one output GEMM; the raw
        tail's importance added to each row's accumulated mass. The softmax runs over -inf entries, then each row's
        entries laid out as alone (its cover, then its children), so its float32 sums are the row's alone. Each
        row's own cover catches up from its store when it next syncs."""
        m = self.method
        S, s0 = m.page_size, m.sink
        b, hq, _, d = query.shape
        hkv = layer.kv.shape[2]
        g, bh = hq // hkv, b * hkv
        K = layer.plans[0]
        KS = K * S
        st = self._stacked_cover(layer, K, query)
        cov, W, lb = st["kv"], st["W"], st["lb"]
        q = query.reshape(bh, g, d)
        ck, cv = cov[0].view(bh, -1, d), cov[1].view(bh, -1, cov.shape[-1])
        f32 = query.dtype == torch.float32
        logit = torch.baddbmm(st["mask"].view(bh, 1, W), q, ck[:, :W].transpose(1, 2), alpha=scaling,
                              **({"out": lb[:, :, :W]} if f32 else {}))
        logit = logit if f32 else lb[:, :, :W].copy_(logit)
        if m.summary_bias != "none":
            logit += st["bias"]  # on each row's pages (0 elsewhere)
        if K:
            # a row's pages only (-inf elsewhere); their cover slots in page order, so the stable sort's ties fall as
            # alone, and K <= each row's pages (``stacked_plan``): the top K are pages
            mass = torch.softmax(logit, -1).sum(1) + st["pages"]
            at = torch.sort(mass, dim=-1, descending=True, stable=True).indices[..., :K]  # cover slots [B * Hkv, K]
            idx = at - st["page_at"]  # the pages' indices
            dst = cov.view(2, bh, -1, d)[:, :, W: W + KS]
            if cpu_kernel.cpu_fast(query.device):  # the pages' rows, one index_select and a copy (as ``gather_pages``)
                rows = torch.add(st["page0"], idx.unsqueeze(-1), alpha=S).view(-1)  # the pages' tokens, stacked
                dst.copy_(kv_rows(layer.kv.view(2, -1, d), rows).view(2, bh, KS, d))
            else:  # one gather of whole pages [2, B * Hkv, pages, S * D] of the stacked storage straight into place
                count = (layer.cap - s0) // S
                src = layer.kv.view(2, bh, -1, d)[:, :, s0: s0 + count * S].view(2, bh, count, S * d)
                torch.gather(src, 2, idx.view(1, bh, K, 1).expand(2, -1, -1, S * d), out=dst.view(2, bh, K, S * d))
            cl = torch.baddbmm(self.cover.zero(query), q, ck[:, W: W + KS].transpose(1, 2), beta=0.0, alpha=scaling,
                               **({"out": lb[:, :, W: W + KS]} if f32 else {}))
            pidx = at.unsqueeze(1).expand(-1, g, -1)
            if m.refine.mass == "parent":
                parent = logit.gather(-1, pidx)
                cl4 = cl.float().view(bh, g, K, S)
                cl = (cl4 + (parent - torch.logsumexp(cl4, -1)).unsqueeze(-1)).view(bh, g, KS)
            if not f32 or m.refine.mass == "parent":
                lb[:, :, W: W + KS] = cl
            logit.scatter_(-1, pidx, NEG)
            p = torch.softmax(lb[:, :, : W + KS], -1)  # each row's entries as alone, after its -inf lead
        else:
            idx = None
            p = torch.softmax(logit, -1)
        out = torch.bmm(p.to(cv.dtype), cv[:, : W + KS])
        if self._needs_mass():
            # the raw tail's importance += its mass, as ``decode_step``, kept in cover coordinates for the rows
            # (``st["acc"]``, each row's tail region as its store's entries when the stacked cover was made): one
            # GEMV over the whole cover (the other entries never read); written back to the rows' stores when a
            # row compresses, the covers are made again or the stack lets the rows go (``stacked_release``)
            st["acc"].baddbmm_(self.cover.ones(bh, g, p), p[:, :, :W])
            st["dirty"] = True
            if any((s.policy.steps + 1) % m.compress_every == 0 and s.n - m.tail - s.policy.frontier >= S
                   for s in layer.stores):  # a row's after_step compresses, reading its mass
                self.stacked_release(layer)
        for i, s in enumerate(layer.stores):
            pol, fr, n = s.policy, s.policy.frontier, s.n
            pol._last_total = None
            pages = None if idx is None else idx[i * hkv: (i + 1) * hkv].view(1, hkv, K)
            pol._att = (fr, n, (pages, None) if K else [], pol.P[1] - K)
            pol._att_count = float(s0 + n - fr + KS)
            pol.cover.n = s0 + pol.P[1] + n - fr  # its entries as alone (its own copy catches up when it syncs)
        return out.view(b, hq, 1, -1).to(query.dtype)

    def stacked_release(self, layer):
        """The rows' accumulated importance (``stacked_attend``) written back to their stores' entries."""
        st = layer.state
        if st.get("dirty"):
            acc = layer.aux[MASS].view(-1)
            acc.index_copy_(0, st["acc_store"], st["acc"].view(-1).index_select(0, st["acc_cover"]))
            st["dirty"] = False

    def stacked_after(self, layer, query):
        """A row compressed in this step (its event): the stacked covers made again now, not in the next step."""
        st = layer.state
        if "key" not in st or tuple(s.policy.P[1] for s in layer.stores) == st["key"][0]:
            return
        plans = {s.policy.stacked_plan(s) for s in layer.stores}
        if len(plans) == 1 and None not in plans:
            self._stacked_cover(layer, plans.pop(), query, now=True)

    def _stacked_cover(self, layer, K: int, query: torch.Tensor, now: bool = False) -> dict:
        """The rows' covers stacked (``stacked_attend``), with the step's token: made from each row's own cover (in
        sync with its store) when a row's pages, frontier or width changed, else the token written at each row's
        cover slot (one indexed write of keys and of values, the mask opened there: per layer)."""
        st, stores = layer.state, layer.stores
        pols = [s.policy for s in stores]
        ns = [s.n for s in stores]
        key = (tuple(p.P[1] for p in pols), layer.cap, K)
        fresh = now or st.get("key") != key or st["raw"] != [n - 1 for n in ns] or \
            any(n + base > st["W"] for n, base in zip(ns, st["bases"]))  # a row's tail region is full
        if not fresh:
            lay = layer.layout
            k, v = layer.step_kv
            slot = layer.stack.memo(("luka_slot", tuple(st["bases"]), id(lay)),
                                    lambda: lay.slot + layer.stack.constant(st["bases"], torch.long, k.device))
            cov = st["kv"]
            cov[0][lay.rows, :, slot] = k[:, :, 0]
            cov[1][lay.rows, :, slot] = v[:, :, 0]
            mask = st["mask"]  # shared by the layers whose covers are laid out alike: opened once per step

            def open_slots():
                mask[lay.rows, :, slot] = 0.0
            layer.stack.memo(("luka_open", id(mask)), open_slots)
            st["raw"] = ns
            return st
        self.stacked_release(layer)  # the importance accumulated under the old covers back in the stores first
        S, s0 = self.method.page_size, self.method.sink
        B, hkv, d = len(stores), layer.kv.shape[2], layer.kv.shape[4]
        for s, p in zip(stores, pols):
            p._cover(s)  # each row's own cover in sync with its store (its tokens up to this step's)
        W = max(p.cover.w for p in pols)
        KS = K * S
        # each row's cover right-aligned at W (its W_b entries from W - W_b on: ``lead``), its children from W on:
        # a row's softmax reads -inf entries, then its entries as alone — its sums its own (a lead of -inf leaves
        # torch's softmax bit for bit on the CPU; a gap inside the row would not: ``results/summaries/batch``)
        kv = layer.kv.new_zeros(2, B, hkv, W + KS, d)
        lens = [p.cover.n for p in pols]
        lead = [W - p.cover.w for p in pols]
        for i, p in enumerate(pols):
            kv[0, i, :, lead[i]: lead[i] + lens[i]] = p.cover.k[0, :, : lens[i]]
            kv[1, i, :, lead[i]: lead[i] + lens[i]] = p.cover.v[0, :, : lens[i]]
        dev = kv.device
        const = layer.stack.constant
        ar = torch.arange(W, device=dev)
        bases = [a + s0 + p.P[1] - p.frontier for a, p in zip(lead, pols)]
        # the free slots' -inf: one tensor for every layer whose covers are laid out alike this step (the same
        # lengths, leads, width and slots' bases), opened at the step's slots once per step for all of them
        mask = layer.stack.kept(
            ("luka_mask", tuple(lens), tuple(lead), W, tuple(bases), hkv, query.dtype, dev),
            lambda: torch.where((ar >= const(lead, torch.long, dev)[:, None])
                                & (ar < const([a + n for a, n in zip(lead, lens)], torch.long, dev)[:, None]), 0.0,
                                NEG).to(query.dtype)[:, None].expand(B, hkv, W).contiguous())
        st.update(key=key, kv=kv, W=W, raw=list(ns), mask=mask, bases=bases)
        # each row's pages: cover slots lead + s0 ... lead + s0 + P_b - 1 (the first ``page_at``)
        at0 = const([a + s0 for a in lead], torch.long, dev).repeat_interleave(hkv)[:, None]  # [B * Hkv, 1]
        at1 = at0 + const([p.P[1] for p in pols], torch.long, dev).repeat_interleave(hkv)[:, None]
        mine = (ar[None, :] >= at0) & (ar[None, :] < at1)
        st["page_at"] = at0
        st["pages"] = torch.where(mine, 0.0, NEG)  # [B * Hkv, W]
        if self.method.summary_bias != "none":
            st["bias"] = torch.where(mine, self.method.bias(1), 0.0)[:, None, :]  # [B * Hkv, 1, W]
        # page 0's first token of each (row, KV head) in the stacked storage seen as [B * Hkv * cap] rows
        first = torch.arange(B * hkv, device=dev) * layer.cap + s0
        st["page0"] = (first[:, None, None] + torch.arange(S, device=dev)[None, None, :])  # [B * Hkv, 1, S]
        if self._needs_mass():
            # cover slot lead_b + s0 + P_b + j of row b <-> its store slot frontier_b + j, for j below its tail
            # region's width (as ``decode_step``): the accumulator in cover coordinates starts from the stores' entries
            cover_at, store_at = [], []
            for i, p in enumerate(pols):
                width = min(p.cover.w - s0 - p.P[1], layer.cap - p.frontier)
                for h in range(hkv):
                    c0, s0_ = (i * hkv + h) * W + lead[i] + s0 + p.P[1], (i * hkv + h) * layer.cap + p.frontier
                    cover_at.extend(range(c0, c0 + width))
                    store_at.extend(range(s0_, s0_ + width))
            st["acc_cover"], st["acc_store"] = const(cover_at, torch.long, dev), const(store_at, torch.long, dev)
            acc = layer.aux[MASS]
            st["acc"] = acc.new_zeros(B * hkv, 1, W)
            st["acc"].view(-1).index_copy_(0, st["acc_cover"], acc.view(-1).index_select(0, st["acc_store"]))
            st["dirty"] = False
        st["lb"] = torch.full((B * hkv, query.shape[1] // hkv, W + KS), NEG, dtype=torch.float32, device=dev)
        return st

    @staticmethod
    def _decode_raw(idx: torch.Tensor, valid: torch.Tensor | None, S: int, s0: int) -> list:
        """The decode path's refined raw tokens for ``attended``: [(raw ids [B, Hkv, K*S], valid or None)]."""
        b, h, k = idx.shape
        ids = (idx.unsqueeze(-1) * S + torch.arange(s0, s0 + S, device=idx.device)).view(b, h, k * S)
        return [(ids, None if valid is None else valid.repeat_interleave(S, -1))]

    def _max_children(self) -> int:
        """Raw tokens a decode step's refinement adds to the cover: the pages the rule refines, each of
        ``page_size`` tokens."""
        return self._nodes_refined(self.P[1]) * self.method.page_size

    @property
    def last_masses(self) -> torch.Tensor | None:
        """For tests: the sum of the resolved masses per (KV head, query head, query) of the last attend through the
        general path (``clustered``); None after a decode fast-path step, which keeps no per-step tensor."""
        return self._last_total

    def clustered(self, store, query, scaling):
        m = self.method
        S, L, s0, fr = m.page_size, m.levels, m.sink, self.frontier
        cache, dev = store.cache, query.device
        t0 = cache.mark(dev)
        b, hq, lq, d = query.shape
        K_raw, V_raw = store.keys, store.values
        hkv, n = K_raw.shape[1], K_raw.shape[2]
        g = hq // hkv
        q = query.reshape(b, hkv, g, lq, d)

        def logits(keys):  # shared keys [B, Hkv, m, D] -> [B, Hkv, g, Lq, m]
            return group_logits(q, keys, scaling)

        # The resolved set, as parts: logits [B, Hkv, g, Lq, m] (effective), values ([B, Hkv, m, Dv] shared or
        # [B, Hkv, Lq, m, Dv] per query), level (0 = raw) and ids (raw index / node index, [B, Hkv, Lq, m]).
        parts: list[_Part] = []
        if s0:
            parts.append(_Part(logits(K_raw[:, :, :s0]), V_raw[:, :, :s0], 0, lo=0))
        tail = logits(K_raw[:, :, fr:n])
        if lq > 1:  # the query chunk is the end of the tail: causal inside it
            qi = torch.arange(lq, device=dev)
            kj = torch.arange(n - fr, device=dev)
            tail = tail.masked_fill(kj[None, :] > (n - fr - lq) + qi[:, None], NEG)
        parts.append(_Part(tail, V_raw[:, :, fr:n], 0, lo=fr))
        for lvl in range(L, 0, -1):  # free nodes: level-l nodes not under a level-(l+1) node
            lo, hi = self.P[lvl + 1] * S, self.P[lvl]
            if hi > lo:
                parts.append(_Part(logits(self.sk[lvl][:, :, lo:hi]) + m.bias(lvl), self.sv[lvl][:, :, lo:hi],
                                   lvl, lo=lo))
        t1 = cache.mark(dev)

        # Top-down refinement: at level l the candidates are the free level-l nodes and the level-l children of
        # the nodes refined at level l+1.
        for lvl in range(L, 0, -1):
            cands = [p for p in parts if p.level == lvl]
            if not cands or m.refine.rule == "none":
                continue
            parts = [p for p in parts if p.level != lvl]
            cand = _Part.merge(cands, b, hkv, lq, dev)
            parts.append(cand)
            z = torch.logsumexp(torch.cat([p.logit for p in parts], -1), -1, keepdim=True)
            sel = self._select(torch.exp(cand.logit - z).sum(2))  # mass per KV head [B, Hkv, Lq, C]
            if sel is None:
                continue
            idx, valid = sel
            if valid is None:
                valid = torch.ones_like(idx, dtype=torch.bool)
            k_sel = idx.shape[-1]
            node = cand.ids.gather(-1, idx)  # [B, Hkv, Lq, K] level-l node ids
            child = (node.unsqueeze(-1) * S + torch.arange(S, device=dev)).reshape(b, hkv, lq * k_sel * S)
            if lvl == 1:
                src_k, src_v, child = K_raw, V_raw, child + s0
            else:
                src_k, src_v = self.sk[lvl - 1], self.sv[lvl - 1]
            ck = src_k.gather(2, child.unsqueeze(-1).expand(-1, -1, -1, d)).view(b, hkv, lq, k_sel * S, d)
            cv = src_v.gather(2, child.unsqueeze(-1).expand(-1, -1, -1, src_v.shape[-1])).view(
                b, hkv, lq, k_sel * S, -1)
            cl = (torch.einsum("bhgqd,bhqmd->bhgqm", q, ck).float() * scaling + m.bias(lvl - 1)).view(
                b, hkv, g, lq, k_sel, S)
            gidx = idx.unsqueeze(2).expand(-1, -1, g, -1, -1)
            parent = cand.logit.gather(-1, gidx)  # [B, Hkv, g, Lq, K]
            if m.refine.mass == "parent":  # eq. 3: child mass = parent mass x local softmax share
                cl = cl + (parent - torch.logsumexp(cl, -1)).unsqueeze(-1)
            vmask = valid.unsqueeze(2).expand(-1, -1, g, -1, -1)
            cl = cl.masked_fill(~vmask.unsqueeze(-1), NEG).view(b, hkv, g, lq, k_sel * S)
            cand.logit = cand.logit.scatter(-1, gidx, parent.masked_fill(vmask, NEG))
            parts.append(_Part(cl, cv, lvl - 1, ids=child.view(b, hkv, lq, k_sel * S)))
        t2 = cache.mark(dev)

        z = torch.logsumexp(torch.cat([p.logit for p in parts], -1), -1, keepdim=True)
        read = [p for p in parts if p.ids is not None and p.level == 0]  # refined raw tokens (per query)
        summaries = sum(torch.isfinite(p.logit).any(2).sum(-1) for p in parts if p.level > 0)  # [B, Hkv, Lq]
        self._att = (fr, n, [(p.ids, torch.isfinite(p.logit).any(2)) for p in read],
                     summaries.amax(-1).float().mean().round() if torch.is_tensor(summaries) else 0)
        out = None
        total = None
        acc = store.aux(MASS) if self._needs_mass() else None
        for p in parts:
            pr = torch.exp(p.logit - z)
            if p.ids is None:
                o = group_apply(pr, p.value)
            else:
                o = torch.einsum("bhgqm,bhqmd->bhgqd", pr.to(p.value.dtype), p.value)
            out = o if out is None else out + o
            s = pr.sum(-1)
            total = s if total is None else total + s
            if acc is not None:  # importance: attention mass received, per KV head
                mass = pr.sum(2)  # [B, Hkv, Lq, m]
                if p.level == 0 and p.ids is None:
                    acc[:, :, p.lo: p.lo + mass.shape[-1]] += mass.sum(2)
                elif p.level == 0:  # per query, distinct ids; queries share them: no float atomics (CUDA)
                    scatter_add_rows(acc, p.ids, mass)
                elif p.level == 1 and self.imp[1] is not None:  # (levels 1: a page's mass is never read)
                    if p.ids is None:
                        self.imp[1][:, :, p.lo: p.lo + mass.shape[-1]] += mass.sum(2)
                    else:
                        scatter_add_rows(self.imp[1], p.ids, mass)
        self._last_total = total
        t3 = cache.mark(dev)
        cache.add_span("attention", t0, t1)
        cache.add_span("attention", t2, t3)
        cache.add_span("refinement", t1, t2)
        return out.reshape(b, hq, lq, -1).to(query.dtype)


class _Part:
    """A piece of the resolved set (see LuKAPolicy.clustered)."""

    __slots__ = ("logit", "value", "level", "ids", "lo")

    def __init__(self, logit, value, level, ids=None, lo=0):
        self.logit, self.value, self.level, self.ids, self.lo = logit, value, level, ids, lo

    @staticmethod
    def merge(parts: list["_Part"], b: int, hkv: int, lq: int, dev) -> "_Part":
        """One per-query part from several (shared values are expanded, not copied, when alone)."""
        def ids(p):
            if p.ids is not None:
                return p.ids
            return torch.arange(p.lo, p.lo + p.logit.shape[-1], device=dev).expand(b, hkv, lq, -1)

        def vals(p):
            return p.value if p.ids is not None else p.value.unsqueeze(2).expand(-1, -1, lq, -1, -1)

        if len(parts) == 1:
            p = parts[0]
            return _Part(p.logit, vals(p), p.level, ids=ids(p))
        return _Part(torch.cat([p.logit for p in parts], -1), torch.cat([vals(p) for p in parts], -2),
                     parts[0].level, ids=torch.cat([ids(p) for p in parts], -1))


@dataclass
class LuKAClustered(KVMethod):
    """page_size: tokens per page (paper 16); tail: most recent tokens never summarised (paper >= 128);
    sink: first tokens never summarised (paper 0); compress_every: decode steps between segmentation runs
    (paper 16); compressor: mean | attention_weighted | random | zero_value; tau: temperature of the
    attention-weighted compressor; refine: rule (none | threshold | top_k | top_frac), k, threshold, fraction,
    mass (exact | parent); levels: summary levels (paper 1); summary_bias: none | log_size (add log of the
    tokens a summary stands for to its logit, as an option of the reference code); seed: for ``random``."""

    budget: float = setting(1.0, holds_every_token="its attended span is set by method.page_size, method.tail and "
                                                   "method.refine")
    page_size: int = setting(16, at_least=2, note="paper: 16")
    tail: int = setting(128, at_least=1, note="paper: >= 128")
    sink: int = setting(0, at_least=0)
    compress_every: int = setting(16, at_least=1, note="paper: 16")
    compressor: str = setting("attention_weighted", choices=COMPRESSORS)
    tau: float = setting(1.0, above=0)
    refine: Any = setting(default_factory=Refine, nested=Refine)  # a mapping (the yaml's) is made a Refine
    levels: int = setting(1, choices=(1, 2, 3))
    summary_bias: str = setting("none", choices=("none", "log_size"))
    seed: int = 0

    name: ClassVar[str] = "luka_clustered"
    policy_class: ClassVar[type[LayerPolicy]] = LuKAPolicy

    def bias(self, level: int) -> float:
        """Logit bias of a level-``level`` node (0 = raw token)."""
        if level == 0 or self.summary_bias == "none":
            return 0.0
        return level * math.log(self.page_size)
