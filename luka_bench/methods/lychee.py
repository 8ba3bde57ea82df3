"""LycheeCluster (Li, Liu, Lin, Hu, Zhang, "LycheeCluster: structure-aware chunking and hierarchical KV indexing",
§4 and Appendices A-B): structure-aware chunks, a three-level index (coarse units -> fine clusters -> chunks) and
coarse-to-fine retrieval at every decode step, with exact attention over the retrieved chunks.

Per prompt (shared by the layers, ``Chunker``, in ``lychee_chunking.py``): the tokens after the ``sink`` first ones
are cut into chunks of ``min_chunk``..``max_chunk`` tokens from their *strings* (the tokenizer is bound by
``hf.attach``; the runner hands over the ids of every forward, ``MethodCache.token_ids``). A chunk starting at s may
end after any token e with ``min_chunk <= e - s + 1 <= max_chunk``; the boundary after e has a level (App. B, Table
4: 1 structural — ``\\n\\n``, Markdown fences/rules, ``}`` ``]`` ``>``; 2 sentence ends and a single newline; 3
phrasal ``, ; :``; 4 whitespace; 5 none) = the stronger of the separators token e contains (1-3; 4 only if it ends
in whitespace) and the one token e+1 starts with (whitespace = 4, newline = 2, blank line = 1); a newline token
after a newline is a blank line (1). The chunk ends at the highest-priority boundary in the window, the latest one
on ties (longer chunks); with none, a forced split at ``max_chunk``. The ``buffer`` most recent tokens are never
chunked: a chunk is cut when at least ``buffer + max_chunk`` tokens lie after the last one, so its boundary can see
the next token. ``chunking: fixed`` cuts plain ``max_chunk``-token pages (the paper's Quest-like ablation).

Per layer and KV head (``LycheePolicy``), built when retrieval is first needed (after the prefill, or later once
the sequence outgrows ``token_budget``):
- chunk key = mean of its tokens' keys (``pooling: max``: the per-dimension max, the ablation), L2-normalised;
- fine clusters: spherical k-means (cosine, ``kmeans_iters`` iterations, deterministic init at chunks spread
  over time) into L = ceil(chunks / ``cluster_size``) clusters; coarse units: the same k-means over the fine
  centroid directions into P = min(``max_coarse``, ceil(sqrt(L))) units (the paper's sub-linear three-tier index);
- each node keeps its centroid mu = the mean of its member chunk keys and a radius r with ||v - mu|| <= r for every
  member chunk v (coarse: r_g = max over its clusters of ||mu_c - mu_g|| + r_c, so it bounds the chunks, not only
  the fine centroids), so UB = q.mu + ||q||.r >= q.v for every member (eq. 2).

A decode step (one query), vectorised over KV heads, units, clusters and tokens (no Python loop):
1. GQA: the query heads of a KV group are aggregated: q_s = sum of the group's queries and ||q||_s = sum of their
   norms, so sum_i UB_i = q_s.mu + ||q||_s.r bounds the group's summed score q_s.v of any member;
2. coarse units ranked by UB (``ranking: qmu``: by q.mu alone); the top ``k_g`` (``k_g: null``: units in rank order
   until they hold ``coarse_factor`` x the retrieval budget in tokens);
3. their fine clusters ranked the same way; the top ``k_c`` (``k_c: null``: the chunks of the clusters in rank
   order, each cluster's chunks by their own score q_s.v, while their tokens fit the retrieval budget =
   ``token_budget`` - sinks - the unchunked recent tokens: whole clusters, then the best chunks of the first one
   that does not fit whole — ``DecodePath.select``);
4. exact attention (softmax over the union, fp32 by SDPA) over the ``sink`` first tokens + every token of the
   chosen clusters' chunks + the recent unchunked tokens (the buffer).
With ``k_c: null`` (the default) steps 1-3 are one rule, ``DecodePath.select`` (``lychee_decode.py``: the decode
fast path's fixed-shape tensor code, one ``DecodePath`` per layer), which the decode step (``_decode_attend``) and
``retrieve`` both call: one matmul scores every node and chunk (``DecodePath.score``), a unit is kept when the
tokens of the units scoring above it stay under the line (exact ties: both or neither), and two stable sorts give
the chunk order — a few dozen kernels instead of ~100 (docs/speed.md). An integer ``k_c`` runs ``retrieve``'s
general path (sorted units, CSR member gathers).
Lazy update (at the next step): each new chunk joins the fine cluster with the nearest centroid direction and that
cluster's coarse unit; centroids move to the new member mean (a moving average) and each touched radius becomes
max(r + ||mu' - mu||, ||x - mu'||): the old members' bound grows by the centroid shift (triangle inequality), so r
stays a true bound — covering only the new chunk would not.

Exact attention instead of retrieval: the first ``full_layers`` layers; every forward while the layer holds at most
``token_budget`` tokens (App. F.1); multi-token forwards (the prefill, and the question chunk, which in the paper
is part of the prefilled prompt). Every raw token stays in memory (kv_ratio >= 1 with the index): the method cuts
the attended span, so ``budget`` must be 1.0 and ``token_budget`` is the knob.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from luka_bench.methods import cpu_kernel
from luka_bench.methods.base import DeviceCount, KVMethod, LayerInfo, LayerPolicy, MethodConfigError, setting
from luka_bench.methods.attention import add_retrieval_spans, attend_rows, group_sum, timed_exact
from luka_bench.methods.kmeans import node_stats, spherical_kmeans  # shared with clusterkv
from luka_bench.methods.lychee_chunking import Chunker, vocab_levels
from luka_bench.methods.lychee_decode import DecodePath
from luka_bench.methods.lychee_stacked import stacked_step
from luka_bench.methods.pages import segment_pool

NEG = float("-inf")


class LycheePolicy(LayerPolicy):
    times_itself = True  # index_build / retrieval / update / attention, timed inside
    # a decode step is written at a slot the device holds (``KVStore.static_slot``): with the torch path's fixed
    # layout (``DecodePath.static_layout``), steps between chunk closings are graph-ready
    static_decode = True

    def __init__(self, method: "Lychee", info: LayerInfo):
        super().__init__(method, info)
        self.built = False
        self.M = 0  # chunks indexed
        self.ck: torch.Tensor | None = None       # chunk keys [B, H, Mcap, D]
        self.assign: torch.Tensor | None = None   # fine cluster of each chunk [B, H, Mcap]
        self.chunk_len: torch.Tensor | None = None  # [Mcap]
        self.mu_c = self.r_c = self.cnt_c = self.tok_c = self.parent = None  # fine clusters [B, H, L(, D)]
        self.mu_g = self.r_g = self.cnt_g = self.tok_g = None                # coarse units [B, H, P(, D)]
        self.last: dict | None = None  # what the last retrieval chose (attended(), tests)
        # grouped members (CSR, ``_layout``): clusters by unit, chunks by cluster; ku: units a step may choose
        self.u_members = self.u_start = self.u_count = self.c_members = self.c_start = self.c_count = None
        self.u_width = self.c_width = self.ku = 0
        self._layout_due: bool | None = None  # the CSR layout is built when the general path first needs it
        # the decode fast path's tables (rebuilt when the index changes) and buffers (``lychee_decode``)
        self.path = DecodePath(method, info.num_heads // info.num_kv_heads)
        self._fast: dict | None = None  # what the fast path's last step chose (``last`` materialises it)
        self.index_version = 0  # moves on whenever the index changes (stacked rows copy a row's tables again)
        self._extra: tuple | None = None  # (the index's version, its bytes): ``extra_bytes``

    # -- shared chunker ------------------------------------------------------------------------------------
    def chunker(self, store) -> Chunker:
        ch = store.cache.state.get("lychee_chunker")
        if ch is None:
            ch = store.cache.state["lychee_chunker"] = Chunker(self.method, store.device)
        return ch

    def extra_bytes(self) -> int:
        """The index's bytes, read after every decode forward (the peak's note): summed again only when the index
        or its grouped members changed."""
        if not self.built:
            return 0
        key = (self.index_version, self.M, id(self.u_members), id(self.c_members))
        if self._extra is None or self._extra[0] != key:
            t = [self.ck[:, :, : self.M], self.assign[:, :, : self.M], self.mu_c, self.r_c, self.cnt_c, self.tok_c,
                 self.parent, self.mu_g, self.r_g, self.cnt_g, self.tok_g, self.u_members, self.u_start, self.u_count,
                 self.c_members, self.c_start, self.c_count]
            self._extra = (key, sum(x.nbytes for x in t if x is not None) + self.path.nbytes())  # + the decode tables
        return self._extra[1]

    def buffer_bytes(self, store) -> int:
        """Allocated beyond what ``extra_bytes`` counts, as allocated: the chunk keys' and assignments' room past the
        M indexed chunks (``build`` / ``lazy_update``: M + max(64, M / 4) slots), what the last step chose (``_fast``
        or its materialised ``last``; the chunker's boundaries there are the prompt's, ``Lychee.state_bytes``) and
        the decode path's step buffers (``DecodePath.buffer_bytes``)."""
        total = self.path.buffer_bytes()
        if self.built:
            total += sum(t.untyped_storage().nbytes() - t[:, :, : self.M].nbytes for t in (self.ck, self.assign))
        ch = store.cache.state.get("lychee_chunker")
        starts = None if ch is None else ch.starts.untyped_storage().data_ptr()
        held = {}
        for d in (self._fast, self._last):
            for t in (d or {}).values():
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != starts:
                    held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return total + sum(held.values())

    # -- hooks ---------------------------------------------------------------------------------------------
    def after_prefill(self, store) -> None:
        if store.n > self.method.token_budget:
            self._sync_index(store)

    def attend(self, store, query, scaling):
        self.last = None
        return timed_exact(store, query, scaling)

    def step(self, store, query, scaling, step):
        cache, dev = store.cache, query.device
        m = self.method
        if store.n <= m.token_budget:
            return self.attend(store, query, scaling)
        self._sync_index(store)
        if m.k_c is None:
            return self._decode_attend(store, query, scaling, step)
        t0 = cache.mark(dev)
        idx, valid = self.retrieve(store, query)
        t1 = cache.mark(dev)
        out = self.sparse_attention(store, query, scaling, idx, valid)
        add_retrieval_spans(store, t0, t1)
        return out

    @property
    def last(self) -> dict | None:
        """What the last retrieval chose (None: the last step attended exactly): ``idx`` / ``valid`` [B, H, T] (the
        held tokens read: sinks, chunk tokens, recent buffer; invalid slots point at the newest token), ``cid`` /
        ``cvalid`` (the chunks read), ``sel_g`` (the units kept), ``frontier``. The fast path keeps only what its
        step computed and builds this on first read (diagnostics and tests, not the decode step)."""
        if self._fast is not None:
            self._last, self._fast = self._materialise(self._fast), None
        return self._last

    @last.setter
    def last(self, value: dict | None) -> None:
        self._last, self._fast = value, None

    def attended_count(self, store):
        f = self._fast
        if f is None:
            return super().attended_count(store)
        # sinks + recent buffer (host) + the taken chunks' tokens (one device sum; stacked: one for all rows), per head
        b, h = f["lens"].shape[:2]
        total = f["total"] if "total" in f else f["lens"].sum()
        return DeviceCount(total, 1.0 / (b * h), self.method.sink + f["n"] - f["frontier"])

    def attended(self, store):
        """Sinks + the retrieved chunks' tokens + the recent buffer of the last retrieval (None: exact)."""
        if self.last is None:
            return None
        b, h = store.keys.shape[:2]
        mask = torch.zeros(b, h, store.n, dtype=torch.bool, device=store.device)
        return mask.scatter_(2, self.last["idx"], True)  # padding slots point at the newest token, attended anyway

    # -- stacked rows of a batch (``stacked.py``, ``lychee_stacked.py``): every row's retrieval at once -----------
    stacked_select = True

    def stacked_plan(self, store):
        """"dense" where ``step`` attends exactly (the layer holds at most ``token_budget`` tokens), "sparse" where it
        retrieves by the decode fast path (``k_c: null``); an integer ``k_c`` (the general path) is not stacked."""
        m = self.method
        if m.k_c is not None:
            return None
        return "dense" if store.n <= m.token_budget else "sparse"

    def stacked_attend(self, layer, query, scaling):
        return stacked_step(self, layer, query, scaling)

    # -- index ---------------------------------------------------------------------------------------------
    def _sync_index(self, store) -> None:
        """Chunk what the seen tokens allow; build the index the first time, else lazily add the new chunks."""
        cache, dev = store.cache, store.device
        ch = self.chunker(store)
        ch.advance(cache, store.seen)
        if ch.n_chunks == self.M:
            return
        if not self.built:
            with cache.span("index_build", dev):
                self.build(store, ch)
        else:
            with cache.span("update", dev):
                self.lazy_update(store, ch)

    def pool(self, store, ch: Chunker, first: int, last: int) -> torch.Tensor:
        """Normalised keys of chunks first..last-1 [B, H, k, D] (mean or max of their tokens' keys, in fp32:
        ``pages.segment_pool``)."""
        lo, hi = int(ch.bounds[first]), int(ch.bounds[last])
        k = store.keys[:, :, lo:hi].float()
        ops = cpu_kernel.lychee_index_ops(k.device, k.dtype)
        if ops is not None and k.stride(-1) == 1:  # the same keys in one call on the CPU (``cpu_kernel``)
            return ops[2](k, [b - lo for b in ch.bounds[first: last + 1]], self.method.pooling == "max")
        seg = ch.tok_chunk[lo - self.method.sink: hi - self.method.sink] - first
        starts = ch.starts[first: last]
        out = segment_pool(k, seg, starts, ch.starts[first + 1: last + 1] - starts, self.method.max_chunk,
                           self.method.pooling, offset=lo)
        return F.normalize(out, dim=-1)

    def build(self, store, ch: Chunker) -> None:
        m = self.method
        M = ch.n_chunks
        x = self.pool(store, ch, 0, M)
        b, h, _, d = x.shape
        cap = M + max(64, M // 4)
        self.ck = x.new_zeros(b, h, cap, d)
        self.ck[:, :, :M] = x
        L = max(1, math.ceil(M / m.cluster_size))
        a, _ = spherical_kmeans(x, L, m.kmeans_iters)
        lens = (ch.starts[1:] - ch.starts[:-1]).to(x.dtype)
        self.assign = torch.zeros(b, h, cap, dtype=torch.long, device=x.device)
        self.assign[:, :, :M] = a
        self.cnt_c, self.mu_c, self.r_c = node_stats(x, a, L)
        self.tok_c = torch.zeros_like(self.cnt_c).scatter_add_(2, a, lens.view(1, 1, -1).expand(b, h, M))
        P = max(1, min(m.max_coarse, math.ceil(math.sqrt(L))))
        live = self.cnt_c > 0
        dirs = F.normalize(self.mu_c, dim=-1)
        self.parent, _ = spherical_kmeans(dirs, P, m.kmeans_iters)
        # an empty fine cluster weighs nothing in its unit
        self.cnt_g, self.mu_g, _ = node_stats(self.mu_c, self.parent, P, weight=self.cnt_c)
        reach = (self.mu_c - self.mu_g.gather(2, self.parent.unsqueeze(-1).expand(-1, -1, -1, d))).norm(dim=-1)
        reach = torch.where(live, reach + self.r_c, torch.zeros_like(reach))
        self.r_g = torch.zeros_like(self.cnt_g).scatter_reduce_(2, self.parent, reach, "amax", include_self=True)
        self.tok_g = torch.zeros_like(self.cnt_g).scatter_add_(2, self.parent, self.tok_c)
        self.M = M
        self.built = True
        self._layout_due = True  # units too
        self._index_changed()

    def lazy_update(self, store, ch: Chunker) -> None:
        """Each new chunk joins its nearest fine cluster (and that cluster's coarse unit): centroid = new member
        mean, radius = max(r + centroid shift, distance of the new chunk). Vectorised over the new chunks."""
        M0, M1 = self.M, ch.n_chunks
        x = self.pool(store, ch, M0, M1)  # [B, H, k, D]
        b, h, k, d = x.shape
        if M1 > self.ck.shape[2]:
            cap = M1 + max(64, M1 // 4)
            ck = x.new_zeros(b, h, cap, d)
            ck[:, :, :M0] = self.ck[:, :, :M0]
            asg = torch.zeros(b, h, cap, dtype=torch.long, device=x.device)
            asg[:, :, :M0] = self.assign[:, :, :M0]
            self.ck, self.assign = ck, asg
        self.ck[:, :, M0:M1] = x
        lens = (ch.starts[M0 + 1: M1 + 1] - ch.starts[M0: M1]).to(x.dtype)
        ops = cpu_kernel.lychee_index_ops(x.device, x.dtype)
        if ops is not None:  # the same rule in one call (``cpu_kernel``), the index's tensors updated in place
            ops[0](x, lens, self.mu_c, self.r_c, self.cnt_c, self.tok_c, self.parent, self.mu_g, self.r_g,
                   self.cnt_g, self.tok_g, self.assign, M0)
        else:
            self._join(x, lens, M0, M1)
        self.M = M1
        self._layout_due = bool(self._layout_due)  # the units' part stays due if it never was built
        self._index_changed()

    def _join(self, x: torch.Tensor, lens: torch.Tensor, M0: int, M1: int) -> None:
        """``lazy_update``'s rule as torch ops (what CUDA runs; the CPU's C++ call is tested against it)."""
        b, h, k, d = x.shape
        sim = torch.matmul(x, F.normalize(self.mu_c, dim=-1).transpose(-1, -2))
        sim = sim.masked_fill((self.cnt_c == 0).unsqueeze(2), NEG)
        c = sim.argmax(-1)  # [B, H, k]
        self.assign[:, :, M0:M1] = c
        g = self.parent.gather(2, c)
        lens = lens.view(1, 1, -1).expand(b, h, k)
        self.cnt_c, self.mu_c, self.r_c = self._grow(self.cnt_c, self.mu_c, self.r_c, c, x)
        self.cnt_g, self.mu_g, self.r_g = self._grow(self.cnt_g, self.mu_g, self.r_g, g, x)
        self.tok_c = self.tok_c.scatter_add(2, c, lens)
        self.tok_g = self.tok_g.scatter_add(2, g, lens)

    def _index_changed(self) -> None:
        """The decode path's tables follow the index (``DecodePath.rebuild``)."""
        self.index_version += 1
        M = self.M
        self.path.rebuild((self.mu_g, self.r_g, self.cnt_g), (self.mu_c, self.r_c, self.cnt_c), self.ck[:, :, :M],
                          self.assign[:, :, :M], self.parent, self.tok_g)

    def _layout(self, units: bool) -> None:
        """Members of each node in one flat, grouped order (CSR), so a decode step gathers only the clusters of the
        chosen units and only the chunks of those clusters: ``u_members`` (clusters grouped by unit; the parents
        never change after the build), ``c_members`` (chunk ids grouped by cluster, redone after every lazy
        update), with start offsets, counts and the largest count (the padded width of the gathers). ``ku``: at
        most this many units are chosen under ``k_g: null`` (the most units whose tokens before the last one stay
        under ``coarse_factor`` x the largest retrieval budget: the smallest units first)."""
        m = self.method
        b, h, L = self.parent.shape
        if units:
            P = self.mu_g.shape[2]
            self.u_members = torch.sort(self.parent, dim=-1, stable=True).indices
            cnt = torch.zeros(b, h, P, dtype=torch.long, device=self.parent.device).scatter_add_(
                2, self.parent, torch.ones_like(self.parent))
            self.u_start, self.u_count, self.u_width = cnt.cumsum(-1) - cnt, cnt, max(1, int(cnt.max()))
        a = self.assign[:, :, : self.M]
        self.c_members = torch.sort(a, dim=-1, stable=True).indices
        cnt = torch.zeros(b, h, L, dtype=torch.long, device=a.device).scatter_add_(2, a, torch.ones_like(a))
        self.c_start, self.c_count, self.c_width = cnt.cumsum(-1) - cnt, cnt, max(1, int(cnt.max()))
        P = self.mu_g.shape[2]
        if m.k_g is not None:
            self.ku = min(P, m.k_g)
        else:
            r_max = m.token_budget - m.sink - m.buffer
            t = torch.sort(self.tok_g, dim=-1).values
            self.ku = min(P, max(1, int(((t.cumsum(-1) - t) < m.coarse_factor * r_max).sum(-1).max())))

    @staticmethod
    def _grow(cnt, mu, r, a, x):
        """Add points x [B, H, k, D] to nodes a [B, H, k]: moving-average centroid, radius kept a true bound."""
        b, h, k, d = x.shape
        ones = torch.ones(b, h, k, dtype=cnt.dtype, device=cnt.device)
        cnt2 = cnt.scatter_add(2, a, ones)  # integer-valued: exact in any order
        s = mu * cnt.unsqueeze(-1) + group_sum(x, a, mu.shape[2])  # no float atomics (attention.group_sum)
        mu2 = torch.where(cnt2.unsqueeze(-1) > 0, s / cnt2.clamp_min(1e-12).unsqueeze(-1), mu)
        shift = (mu2 - mu).norm(dim=-1)
        r2 = torch.where(cnt > 0, r + shift, torch.zeros_like(r))
        dist = (x - mu2.gather(2, a.unsqueeze(-1).expand(b, h, k, d))).norm(dim=-1)
        r2 = r2.scatter_reduce(2, a, dist, "amax", include_self=True)
        return cnt2, mu2, r2

    # -- retrieval -----------------------------------------------------------------------------------------
    def scores(self, qs: torch.Tensor, qn: torch.Tensor, mu: torch.Tensor, r: torch.Tensor, cnt: torch.Tensor):
        """UB = q_s.mu + ||q||_s.r per node (``ranking: qmu``: q_s.mu), -inf for empty nodes. qs [B, H, D]."""
        s = torch.matmul(mu, qs.unsqueeze(-1)).squeeze(-1)
        if self.method.ranking == "ub":
            s = s + qn.unsqueeze(-1) * r
        return s.masked_fill(cnt <= 0, NEG)

    @staticmethod
    def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [B, H, N, D] at idx [B, H, K] -> [B, H, K, D]."""
        return x.gather(2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))

    @staticmethod
    def _members(members, start, count, width: int, nodes: torch.Tensor, ok: torch.Tensor):
        """The members (CSR ``members`` / ``start`` / ``count``) of ``nodes`` [B, H, K] where ``ok``: ids
        [B, H, K * width] (padding points at member 0) and their validity."""
        slot = torch.arange(width, device=nodes.device)
        pos = start.gather(2, nodes).unsqueeze(-1) + slot  # [B, H, K, width]
        valid = (slot < count.gather(2, nodes).unsqueeze(-1)) & ok.unsqueeze(-1)
        pos = torch.where(valid, pos, torch.zeros_like(pos)).flatten(2)
        return members.gather(2, pos), valid.flatten(2)

    def chosen_clusters(self) -> torch.Tensor:
        """The fine clusters the last retrieval read chunks of, as a mask [B, H, L] (tests, diagnostics)."""
        cid, ok = self.last["cid"], self.last["cvalid"]
        c = self.assign.gather(2, cid)
        return torch.zeros_like(self.cnt_c, dtype=torch.long).scatter_reduce(
            2, c, ok.long(), "amax", include_self=True).bool()

    def retrieve(self, store, query):
        """Coarse-to-fine selection for one query [B, Hq, 1, D]. Returns the held-token indices to attend
        [B, H, T] (sinks, the chosen chunks' tokens padded to ``max_chunk`` per chunk, the recent unchunked tokens)
        and their validity [B, H, T] (a padding slot points at the newest token and is masked out). ``k_c: null``
        (the default): the decode step's rule, ``DecodePath.select`` over ``score``'s scores, the one both paths
        call; an integer ``k_c``: the top ``k_c`` fine clusters of the kept units (sorted units, CSR member
        gathers), every chunk of each."""
        m = self.method
        ch = self.chunker(store)
        n, fr = store.n, ch.frontier
        R = m.token_budget - m.sink - (n - fr)  # tokens left for retrieved chunks
        if m.k_c is None:
            b, hq, _, d = query.shape
            hkv = store.keys.shape[1]
            P, L = self.mu_g.shape[2], self.mu_c.shape[2]
            path = self.path
            cmax, C = path.slots()
            qa, above, _, (neg, _, _) = path.buffers(query, hkv, P, C, 0)
            sc = path.score(query.reshape(b, hkv, hq // hkv, d), qa)
            start_len = path.flat_tables(store, ch)[3]
            cfR = m.coarse_factor * R if m.k_g is None else None  # rounded as ``DecodePath.cf``'s product is
            order, _, lens, sel = path.select(sc, start_len, above, neg, P, L, R, cfR, cmax)
            self.last = self._materialise({"order": order, "lens": lens, "sel": sel, "n": n, "frontier": fr,
                                           "starts": ch.starts})
            return self.last["idx"], self.last["valid"]
        if self._layout_due is not None:
            self._layout(units=self._layout_due)
            self._layout_due = None
        b, hq, _, d = query.shape
        hkv = store.keys.shape[1]
        qg = query.reshape(b, hkv, hq // hkv, d).float()
        qs, qn = qg.sum(2), qg.norm(dim=-1).sum(2)
        ug = self.scores(qs, qn, self.mu_g, self.r_g, self.cnt_g)
        order = torch.sort(ug, dim=-1, descending=True, stable=True).indices[:, :, : self.ku]  # [B, H, Ku]
        live = ug.gather(2, order) > NEG
        if m.k_g is None:
            # units in rank order until they hold coarse_factor x R tokens (the unit crossing the line included)
            t = self.tok_g.gather(2, order)
            unit_ok = (t.cumsum(-1) - t < m.coarse_factor * R) & live
        else:
            unit_ok = live  # ku = min(P, k_g)
        sel_g = torch.zeros_like(ug, dtype=torch.bool).scatter(2, order, unit_ok)
        # gather, not mask: only the clusters of the chosen units are scored (ku >= the units ever chosen)
        order_g = order
        cand, cand_ok = self._members(self.u_members, self.u_start, self.u_count, self.u_width, order_g, unit_ok)
        uc = self.scores(qs, qn, self._rows(self.mu_c, cand), self.r_c.gather(2, cand), self.cnt_c.gather(2, cand))
        uc = uc.masked_fill(~cand_ok, NEG)  # [B, H, Kc]: the candidate clusters' scores
        top = torch.sort(uc, dim=-1, descending=True, stable=True).indices[:, :, : m.k_c]
        chosen = cand.gather(2, top)
        cid, cvalid = self._members(self.c_members, self.c_start, self.c_count, self.c_width, chosen,
                                    uc.gather(2, top) > NEG)
        idx, valid = self._token_set(ch.starts, cid, ch.lens[cid] * cvalid, fr, n)
        self.last = {"sel_g": sel_g, "cid": cid, "cvalid": cvalid, "idx": idx, "valid": valid, "frontier": fr,
                     "candidates": cand_ok.sum(-1)}
        return idx, valid

    # -- decode fast path (``k_c: null``, the default) ------------------------------------------------------
    def _decode_attend(self, store, query, scaling, step):
        """One decode step's retrieval and attention in the fewest kernels (``k_c: null``): one matmul scores every
        unit, fine cluster and chunk (``DecodePath.score``), ``select`` chooses the chunks (the rule ``retrieve``
        calls too), their token rows are written straight into the flattened storage's row ids (``token_rows``),
        and one SDPA attends over the gathered rows with an additive mask for the chunk slots past each chunk's end.

        The torch ops (what CUDA runs) are graph-ready between chunk closings (``static_layout``): the recent
        tokens are read from a region of fixed width with its free slots masked, the budget R left to the chunks
        is a device tensor computed once per step for all layers, and the chunk slots' rows are written into a
        row-id buffer laid out at the closing. On the CPU the choice is one C++ op (``cpu_kernel``)."""
        m, cache, dev, path = self.method, store.cache, query.device, self.path
        ch = self.chunker(store)
        b, hq, _, d = query.shape
        hkv = self.info.num_kv_heads
        n, fr, S, mc = store.n, ch.frontier, m.sink, m.max_chunk
        P, L = self.mu_g.shape[2], self.mu_c.shape[2]
        cmax, C = path.slots()
        rows, start, last_row, start_len = path.flat_tables(store, ch)
        cap = rows.shape[-1]
        width = max(n - fr, min(m.buffer + mc, cap - fr))  # the recent region: n - fr tokens, free slots after
        qa, above, bias, (neg, zero, within) = path.buffers(query, hkv, P, C, S + C + width)
        t0 = cache.mark(dev)
        qg = query.view(b, hkv, hq // hkv, d)
        op = cpu_kernel.lychee_decode_op() if dev.type == "cpu" else None
        if op is not None:  # the same choice in one C++ call (ties between units: the lower index first)
            R = m.token_budget - S - (n - fr)
            T = S + C + (n - fr)
            path.all_held(bias, S + C)  # the torch path masked free recent slots: this path reads them all held
            fp32 = bias.dtype == torch.float32
            idx, pad, order, lens, sel = op(
                qg.float(), path.tab, path.chunk_unit, path.chunk_cluster, self.tok_g, ch.lens, start, rows,
                bias if fp32 else path.no_bias, P, L, m.ranking == "ub", [float(m.coarse_factor * R)], m.k_g or 0,
                [R], cmax, C, S, [fr], [n])
            if not fp32:
                torch.where(pad, neg, zero, out=bias[:, :, 0, S: S + C])
        else:
            T = S + C + width
            idx = path.static_layout(store, step, rows, bias, S, C, fr, n, width)
            # R (tokens left to the chunks) = budget - sinks - (n - fr): from the position counter, once per step
            # (n = the step's position + 1 - the tokens dropped before it)
            top = m.token_budget - S + fr - 1 + store.seen - n
            R = step.per_step(("lychee_R", top), lambda pos: torch.rsub(pos, top))
            cf = path.cf(dev)
            cfR = None if m.k_g is not None else step.per_step(("lychee_cfR", top), lambda _: torch.mul(R, cf))
            sc = path.score(qg, qa)
            order, sl, lens, sel = path.select(sc, start_len, above, neg, P, L, R, cfR, cmax)
            pad = path.token_rows(sl, lens, last_row, within, C, out=idx[:, :, S: S + C])
            torch.where(pad, neg, zero, out=bias[:, :, 0, S: S + C])
        t1 = cache.mark(dev)
        kv = store.kv_flat()
        if kv is not None:  # keys and values stored as one tensor: read in place on the CPU (``attend_rows``)
            out = attend_rows(qg, kv, idx, bias[..., :T], scaling)
        else:
            gk, gv = store.gather_flat(idx.view(-1), T)
            out = F.scaled_dot_product_attention(qg, gk, gv, attn_mask=bias[..., :T], scale=scaling)
        add_retrieval_spans(store, t0, t1)
        self._last = None
        self._fast = {"order": order, "lens": lens, "sel": sel, "n": n, "frontier": fr, "starts": ch.starts}
        return out.reshape(b, hq, 1, out.shape[-1])

    def _token_set(self, starts: torch.Tensor, cid: torch.Tensor, lens: torch.Tensor, fr: int, n: int):
        """The held tokens a retrieval reads, as ``retrieve`` returns them: idx / valid [B, H, sink + cmax *
        max_chunk + n - fr] — the sinks, the tokens of chunks ``cid`` [B, H, cmax] (the first ``lens`` of each,
        0 for a chunk not read; padding points at the newest token, invalid), the recent tokens fr..n-1."""
        m = self.method
        b, h, _ = cid.shape
        dev = cid.device
        within = torch.arange(m.max_chunk, device=dev)
        tvalid = within < lens.unsqueeze(-1)
        tok = torch.where(tvalid, starts[cid].unsqueeze(-1) + within, torch.full_like(tvalid, n - 1, dtype=torch.long))
        idx = torch.cat([torch.arange(m.sink, device=dev).view(1, 1, -1).expand(b, h, -1), tok.flatten(2),
                         torch.arange(fr, n, device=dev).view(1, 1, -1).expand(b, h, -1)], dim=2)
        valid = torch.cat([torch.ones(b, h, m.sink, dtype=torch.bool, device=dev), tvalid.flatten(2),
                           torch.ones(b, h, n - fr, dtype=torch.bool, device=dev)], dim=2)
        return idx, valid

    def _materialise(self, f: dict) -> dict:
        """``last`` of a fast-path step, in ``retrieve``'s form."""
        idx, valid = self._token_set(f["starts"], f["order"], f["lens"], f["frontier"], f["n"])
        return {"sel_g": f["sel"], "cid": f["order"], "cvalid": f["lens"] > 0, "idx": idx, "valid": valid,
                "frontier": f["frontier"]}

    def sparse_attention(self, store, query, scaling, idx, valid):
        """Exact attention (fp32 softmax) of one query over the held tokens ``idx`` where ``valid``."""
        K, V = store.keys, store.values
        b, hq, _, d = query.shape
        hkv = K.shape[1]
        gk, gv = store.gather(idx)
        q = query.reshape(b, hkv, hq // hkv, d)
        logits = torch.matmul(q, gk.transpose(-1, -2)).float() * scaling  # [B, H, g, T]
        logits = logits.masked_fill(~valid.unsqueeze(2), NEG)
        w = torch.softmax(logits, dim=-1).to(gv.dtype)
        return torch.matmul(w, gv).reshape(b, hq, 1, V.shape[-1])


@dataclass
class Lychee(KVMethod):
    """token_budget: tokens attended per step (sinks + retrieved chunks + recent buffer; paper 1024); sink: first
    tokens always attended (paper 16); buffer: most recent tokens never chunked, always attended (paper 128);
    min_chunk / max_chunk: chunk length range (paper 8 / 16); chunking: structure | fixed (``max_chunk``-token
    pages, the ablation); pooling: mean | max (ablation); cluster_size: average chunks per fine cluster (paper 2);
    max_coarse: most coarse units (paper 64); kmeans_iters: spherical k-means iterations (paper 10); ranking: ub
    (q.mu + |q|.r, eq. 2) | qmu (q.mu alone); k_g: coarse units kept (null: until they hold coarse_factor x the
    retrieval budget in tokens); k_c: fine clusters kept (null: as many as fit the token budget); full_layers:
    first layers with full attention (paper 2). ``budget`` must be 1.0: every raw token is kept."""

    budget: float = setting(1.0, holds_every_token="the attended span is method.token_budget (tokens, paper 1024)")
    token_budget: int = setting(1024, at_least=1)
    sink: int = setting(16, at_least=0)
    buffer: int = setting(128, at_least=1)
    min_chunk: int = setting(8, at_least=1)
    max_chunk: int = setting(16, at_least=1)
    chunking: str = setting("structure", choices=("structure", "fixed"))
    pooling: str = setting("mean", choices=("mean", "max"))
    cluster_size: int = setting(2, at_least=1)
    max_coarse: int = setting(64, at_least=1)
    kmeans_iters: int = setting(10, at_least=0)
    ranking: str = setting("ub", choices=("ub", "qmu"))
    k_g: int | None = setting(None, at_least=1)
    coarse_factor: float = setting(2.0, at_least=1)
    k_c: int | None = setting(None, at_least=1)
    full_layers: int = 2

    name: ClassVar[str] = "lychee"
    policy_class: ClassVar[type[LayerPolicy]] = LycheePolicy

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_chunk > self.max_chunk:
            raise MethodConfigError(f"method.min_chunk={self.min_chunk} must be <= method.max_chunk={self.max_chunk}")
        if self.token_budget <= self.sink + self.buffer + self.max_chunk:
            raise MethodConfigError(f"method.token_budget={self.token_budget} must exceed sink + buffer + max_chunk = "
                                    f"{self.sink + self.buffer + self.max_chunk} (the always-attended tokens)")
        self._tables = None

    def bind(self, tokenizer) -> None:
        if tokenizer is not self.tokenizer:
            self._tables = None
        self.tokenizer = tokenizer

    def batch_refusal(self) -> str | None:
        return "its chunks follow the prompt's token ids, which a cache records for one row"

    def state_bytes(self, cache) -> int:
        """The prompt's chunk boundaries (the ``Chunker`` every layer shares, in ``cache.state``): ``starts`` [M + 1],
        ``lens`` [M] and each chunked token's chunk ``tok_chunk`` (int64)."""
        ch = cache.state.get("lychee_chunker")
        return 0 if ch is None else ch.nbytes()

    def level_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._tables is None:
            self._tables = vocab_levels(self.tokenizer)
        return self._tables

