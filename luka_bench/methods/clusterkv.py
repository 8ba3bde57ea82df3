"""ClusterKV: decode-time recall of semantic clusters of the prompt's keys (Liu et al., "ClusterKV: Manipulating LLM
KV Cache in Semantic Space for Recallable Compression", DAC 2025; reference code sjtu-zhao-lab/ClusterKV @ cb66a22,
``accuracy/cluster_attention.py``).

Every raw token is held (``budget`` must be 1.0); what is rationed is the prompt tokens read per decode step.

**Clustering (once per prompt and layer, at the first single-token decode step**, as the reference's
``forward_cluster`` L266-274 builds its clusters lazily on the first step with ``q_len == 1``): the *prompt* is
every token held before that step (the prefilled context and a question chunk prefilled after it), ``P`` tokens.
If ``P <= token_budget`` the layer attends fully for the rest of the prompt (reference L247-249). Otherwise, per
KV head, the post-RoPE keys of the prompt without its first ``sink`` tokens (``M = P - sink`` of them) are
clustered by spherical k-means (cosine; ``kmeans.spherical_kmeans``, shared with LycheeCluster) into
``C = min(clusters, M)`` clusters with ``iterations`` Lloyd steps (the reference's RAFT fit needs ``M >= nlist``;
we lower the count instead of failing on a short prompt). Each token belongs to exactly one cluster (a
partition of the non-sink prompt); a cluster's ranking vector is the mean of its members' raw keys (Lloyd's
update; for a cluster of one token, the token's key). Tokens generated after the prompt are never clustered.

**Each decode step**, each QUERY head q (GQA: the reference ``repeat_kv``'s the centroids, L78-82, and ranks per
query head; so do we) ranks its KV head's clusters by q . centroid (raw inner product, L108-109) and takes clusters
in that order until they hold >= ``w = token_budget - sink`` tokens, cut to exactly ``w`` (the reference's "truc",
L155: within the last cluster taken, its earliest tokens, as its CSR lists members in position order). It attends
exactly over the ``sink`` first tokens + those ``w`` + every token from the prompt's end on (L207-210).

Shapes: query [B, Hq, 1, D]; keys/values [B, Hkv, n, D]; per layer R = B * Hkv rows: centroids [R, D, C]
(fp32), cluster sizes / first member [R, 1, C], members (slot ids in cluster-then-position order, as storage
rows) [R, 1, M]; a step's selected rows [R, g, w]. The decode step is fixed-shape and free of host syncs: the
tokens a query head reads are found without a per-token pass (the w concatenation positions p located in the
ranked clusters' cumulative sizes by one ``searchsorted``, then the member at ``p - start + first member``),
the step's token is written at a slot held on the device (``static_decode``), and sinks + selection + the
generated region up to the storage's capacity are gathered in one ``index_select`` of rows, the generated
region's free slots masked by an additive mask opened by one ``index_fill_`` per step for all layers
(``DecodeStep.held_mask``). The clustering is an event (``layout_events``, once per layer and prompt).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from luka_bench.device import host_to_device
from luka_bench.methods.attention import add_retrieval_spans, kv_rows, sdpa, timed_exact
from luka_bench.methods.base import DeviceCount, KVMethod, LayerInfo, LayerPolicy, MethodConfigError, setting
from luka_bench.methods.kmeans import node_stats, spherical_kmeans


def _storage_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes allocated for ``tensors`` (whole storages: a view costs what it views; each storage once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def cluster_keys(keys: torch.Tensor, clusters: int, iterations: int) -> dict[str, torch.Tensor]:
    """ClusterKV's index of keys [B, H, M, D] (the non-sink prompt, post-RoPE), per (batch, head) row R = B * H:
    ``assign`` [B, H, M] (cluster of each token), ``centroids`` [R, D, C] fp32 (mean of the members' keys, transposed
    for the ranking GEMM), ``size`` and ``first`` [R, 1, C] int64 (members per cluster, first member's place in
    ``members``), ``members`` [R, M] int64 (token indices 0..M-1 sorted by cluster, then position)."""
    b, h, m, d = keys.shape
    c = min(clusters, m)
    kf = keys.float()
    assign, _ = spherical_kmeans(F.normalize(kf, dim=-1), c, iterations)
    cnt, mu, _ = node_stats(kf, assign, c)
    size = cnt.round().long().view(b * h, 1, c)
    members = torch.sort(assign.view(b * h, m), dim=-1, stable=True).indices  # by cluster, then by position
    return {"assign": assign, "centroids": mu.view(b * h, c, d).transpose(1, 2).contiguous(), "size": size,
            "first": size.cumsum(-1) - size, "members": members}


def ranked_prefix(score: torch.Tensor, size: torch.Tensor, first: torch.Tensor, members: torch.Tensor,
                  p: torch.Tensor) -> torch.Tensor:
    """The first ``w`` tokens of the clusters concatenated in descending ``score`` order: score [R, g, C] (a query
    head's q . centroid), size / first [R, 1, C], members [R, 1, M] (any per-token payload in cluster-then-position
    order: token indices or storage rows), p = 0..w-1 as [R, g, w] (contiguous). Returns the payload [R, g, w].
    Position p of the concatenation lies in the k-th ranked cluster with ends[k-1] <= p < ends[k] (``searchsorted``
    of the cumulative sizes; empty clusters are skipped by ``right=True``), at member ``first[that cluster] + p -
    ends[k-1]``: O(w log C) per query head, no pass over the M tokens, no host sync."""
    r, g, c = score.shape
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices  # ties: the lower-numbered cluster
    sz = size.expand(r, g, c).gather(2, order)
    ends = sz.cumsum(-1)
    k = torch.searchsorted(ends, p, right=True)  # [R, g, w]: the ranked cluster holding position p
    shift = first.expand(r, g, c).gather(2, order) + sz - ends  # first member - where the cluster starts in the order
    return members.expand(r, g, members.shape[-1]).gather(2, p + shift.gather(2, k))


class ClusterKVPolicy(LayerPolicy):
    times_itself = True  # retrieval (choosing what to read) and attention (reading it), timed inside

    static_decode = True  # the step's token at a slot held on the device; shapes fixed until the storage grows

    def __init__(self, method: "ClusterKV", info: LayerInfo):
        super().__init__(method, info)
        self.layout_events = 0  # clusterings (one per prompt) and stacks laid out (host_sync.events, launches)
        self.prompt: int | None = None  # tokens held at the first decode step (None: not reached yet)
        # cluster_keys' output but ``assign`` (read only to list the members) and ``members`` (once ``_rows`` holds
        # them as storage rows): centroids, size, first (None: full attention)
        self.index: dict[str, torch.Tensor] | None = None
        self._layout: tuple | None = None  # (storage capacity, g) the tensors below fit
        self._rows: torch.Tensor | None = None  # [R, 1, M] storage rows of the members (the index's member list)
        self._sink_rows = self._gen_rows = self._p = None  # [R, g, sink], [R, g, cap - P], [R, g, w]
        self.sel: torch.Tensor | None = None  # the last sparse step's selected rows [R, g, w] (None: all read)
        self.n_read = 0  # tokens held at that step
        # the storage width and first row those rows are counted in (stacked rows: the stack's, this row's offset)
        self.read_at = (0, 0)
        self._union_total: torch.Tensor | None = None  # a stacked step's count of the rows its KV heads read

    @property
    def clusters(self) -> int:
        return 0 if self.index is None else self.index["size"].shape[-1]

    def attend(self, store, query, scaling):
        self.sel = None
        return timed_exact(store, query, scaling)

    def step(self, store, query, scaling, step):
        m = self.method
        self.sel = None
        if self.prompt is None:  # the first decode step: the prompt is what is held before it
            self.prompt = store.n - 1
            if self.prompt > m.token_budget:
                with store.cache.span("index_build", query.device):
                    self.index = cluster_keys(store.keys[:, :, m.sink: self.prompt], m.clusters, m.iterations)
                    del self.index["assign"]  # the members list it: a step never reads it
                self.layout_events += 1
        if self.index is None:  # prompt <= token_budget: full attention (reference L247-249)
            return timed_exact(store, query, scaling)
        return self._sparse(store, query, scaling, step)

    def _fit(self, store, g: int) -> None:
        """(Re)make the row tables for the storage's capacity (at the clustering and when the storage grows)."""
        K = store.storage()[0]
        b, hkv, cap = K.shape[:3]
        if self._layout == (cap, g):
            return
        r, dev, s, P = b * hkv, K.device, self.method.sink, self.prompt
        w = self.method.token_budget - s
        base = (torch.arange(r, device=dev) * cap).view(r, 1, 1)
        members = self.index.pop("members", None)  # [R, M] at the clustering; later, from the rows of the old layout
        if members is None:
            members = (self._rows - (torch.arange(r, device=dev) * self._layout[0]).view(r, 1, 1) - s)[:, 0]
        self._rows = (base + s + members[:, None]).contiguous()  # [R, 1, M]: the member list, as storage rows
        self._sink_rows = (base + torch.arange(s, device=dev)).expand(r, g, s)
        self._gen_rows = (base + torch.arange(P, cap, device=dev)).expand(r, g, cap - P)
        self._p = torch.arange(w, device=dev).expand(r, g, w).contiguous()
        self._layout = (cap, g)

    def _sparse(self, store, query, scaling, step):
        m = self.method
        b, hq, _, d = query.shape
        K, V = store.storage()
        hkv, cap = K.shape[1], K.shape[2]
        g, r = hq // hkv, b * hkv
        t0 = store.cache.mark(query.device)
        self._fit(store, g)
        s, P, n = m.sink, self.prompt, store.n
        w = m.token_budget - s
        ix = self.index
        score = torch.bmm(query.reshape(r, g, d).float(), ix["centroids"])  # [R, g, C] q . centroid (fp32)
        self.sel = sel = ranked_prefix(score, ix["size"], ix["first"], self._rows, self._p)  # [R, g, w] rows
        self.n_read, self.read_at, self._union_total = n, (cap, 0), None
        rows = torch.cat([self._sink_rows, sel, self._gen_rows], dim=-1).view(-1)
        width = s + w + cap - P
        t1 = store.cache.mark(query.device)
        pages = store.pages(0, 1)  # [2, R, cap, D]: keys and values together
        if pages is not None:
            kv = kv_rows(pages.reshape(2, -1, d), rows).view(2, b, hq, width, d)
            ksel, vsel = kv[0], kv[1]
        else:  # keys and values stored apart (their shapes or dtypes differ)
            ksel = K.reshape(-1, d).index_select(0, rows).view(b, hq, width, d)
            vsel = V.reshape(-1, V.shape[-1]).index_select(0, rows).view(b, hq, width, V.shape[-1])
        # the generated region's slots from n on are free: masked (0 on sinks, selection and held slots)
        mask = step.held_mask(store, "clusterkv", width, s + w + n - P, 1, query.dtype)
        out = sdpa(query, ksel, vsel, scaling, mask.view(1, 1, 1, width))
        add_retrieval_spans(store, t0, t1)
        return out

    def member_ids(self) -> torch.Tensor:
        """[Hkv, M]: the clustered tokens (0 = the first after the sinks) in cluster-then-position order."""
        if self._rows is None:
            return self.index["members"]
        r = self._rows.shape[0]
        base = (torch.arange(r, device=self._rows.device) * self._layout[0]).view(r, 1, 1)
        return (self._rows - base - self.method.sink)[:, 0]

    # -- stacked rows of a batch (``stacked.py``): every row's clusters ranked and read at once -------------------
    stacked_select = True

    def stacked_plan(self, store):
        """None at the first decode step (it clusters the prompt: each row alone), then "sparse" where the prompt was
        clustered and "dense" where the layer attends to everything."""
        if self.prompt is None:
            return None
        return "dense" if self.index is None else "sparse"

    def stacked_attend(self, layer, query, scaling):
        """``_sparse`` for every row: the rows' indexes stacked (``_stacked_fit``: centroids, sizes and first members
        padded with empty clusters, the member lists as rows of the stacked storage), one ranking and one gather of
        every row's sinks, selection and generated region (from its own prompt's end, as wide as the shortest prompt
        leaves; a row's slots past its length masked), one SDPA; each row's union of rows read counted for all."""
        stores = layer.stores
        if layer.plans[0] == "dense":
            return layer.exact_step(query, scaling, sel=None)
        b, hq, _, d = query.shape
        hkv = layer.kv.shape[2]
        g, r = hq // hkv, b * hkv
        st = self._stacked_fit(layer, g)
        score = torch.bmm(query.reshape(r, g, d).float(), st["centroids"])
        sel = ranked_prefix(score, st["size"], st["first"], st["rows"], st["p"])  # [R, g, w] rows of the stack
        rows = torch.cat([st["sink_rows"], sel, st["gen_rows"]], dim=-1).view(-1)
        width = rows.numel() // (r * g)
        kv = kv_rows(layer.kv.view(2, -1, d), rows).view(2, b, hq, width, d)
        # each row's generated region open up to its slot of the step (once per step for all layers)
        mask = layer.held_upto(("clusterkv", st["key"]), st["at"]).view(b, 1, 1, width)
        out = sdpa(query, kv[0], kv[1], scaling, mask)
        total = None
        if g > 1:
            cap = layer.cap
            total = torch.zeros(b * hkv * cap, dtype=torch.bool, device=sel.device).scatter_(
                0, sel.reshape(-1), True).view(b, -1).sum(1)
        for i, s in enumerate(stores):
            p = s.policy
            p.sel, p.n_read = sel[i * hkv: (i + 1) * hkv], s.n
            p.read_at, p._union_total = (layer.cap, i * hkv * layer.cap), None if total is None else total[i]
        return out

    def _stacked_fit(self, layer, g: int) -> dict:
        """The rows' stacked index, made with the storage (its width and the rows' prompts fixed while it lives)."""
        st, stores = layer.state, layer.stores
        if st.get("clusterkv") == (layer.cap, g):
            return st
        m = self.method
        pols = [s.policy for s in stores]
        kv = layer.kv
        B, hkv, cap, d = kv.shape[1:]
        r, dev, s = B * hkv, kv.device, m.sink
        C = max(p.clusters for p in pols)
        members = [p.member_ids() for p in pols]
        cent = torch.zeros(r, d, C, dtype=torch.float32, device=dev)
        size = torch.zeros(r, 1, C, dtype=torch.long, device=dev)
        first = torch.zeros(r, 1, C, dtype=torch.long, device=dev)  # an empty cluster: no member, never read
        base = (torch.arange(r, device=dev) * cap).view(r, 1, 1)
        rows = base.expand(r, 1, max(x.shape[-1] for x in members)).clone()
        for i, (p, mem) in enumerate(zip(pols, members)):
            p.layout_events += 1  # the row's index laid out anew, in the stack
            own, c = slice(i * hkv, (i + 1) * hkv), p.clusters
            cent[own, :, :c] = p.index["centroids"]
            size[own, :, :c] = p.index["size"]
            first[own, :, :c] = p.index["first"]
            rows[own, :, : mem.shape[-1]] = base[own] + s + mem[:, None]
        w = m.token_budget - s
        prompts = [p.prompt for p in pols]
        gen = torch.arange(cap - min(prompts), device=dev)
        at = host_to_device(prompts, dev).view(B, 1) + gen  # [B, G]: each generated-region slot's slot in its row
        gen_rows = (base.view(B, hkv, 1) + at.clamp_max(cap - 1).view(B, 1, -1)).view(r, 1, -1)
        st.update(clusterkv=(layer.cap, g), key=(layer.cap, tuple(prompts), g, kv.dtype), centroids=cent, size=size,
                  first=first, rows=rows, p=torch.arange(w, device=dev).expand(r, g, w).contiguous(),
                  sink_rows=(base + torch.arange(s, device=dev)).expand(r, g, s), gen_rows=gen_rows.expand(r, g, -1),
                  at=torch.cat([torch.full((B, s + w), -1, dtype=torch.long, device=dev), at], dim=1))
        return st

    # -- what the last step read -------------------------------------------------------------------------------
    def _union(self) -> torch.Tensor:
        """[R * cap] bool: the storage rows any query head of the group selected (sinks and generated not set)."""
        cap, first = self.read_at
        r = self.sel.shape[0]
        rows = self.sel.reshape(-1) - first if first else self.sel.reshape(-1)
        return torch.zeros(r * cap, dtype=torch.bool, device=self.sel.device).scatter_(0, rows, True)

    def attended(self, store):
        """Sinks + the union over each KV head's query heads of the selected prompt tokens + every generated token
        [B, Hkv, n] (None: everything)."""
        if self.sel is None:
            return None
        b, hkv = store.keys.shape[:2]
        u = self._union().view(b, hkv, self.read_at[0])[:, :, : self.n_read].clone()
        u[:, :, : self.method.sink] = True
        u[:, :, self.prompt:] = True
        return u

    def attended_count(self, store):
        if self.sel is None:
            return float(store.n)
        r, g, w = self.sel.shape
        rest = float(self.method.sink + self.n_read - self.prompt)
        if g == 1:
            return float(w) + rest
        return DeviceCount(self._union().sum() if self._union_total is None else self._union_total, 1.0 / r, rest)

    def extra_bytes(self) -> int:
        """The index a step reads: the centroids [R, D, C] fp32, the cluster sizes and first members [R, 1, C] and
        the member list [R, M] (as storage rows, ``_rows``, once laid out)."""
        if self.index is None:
            return 0
        members = self._rows if self._rows is not None else self.index["members"]
        return sum(self.index[k].nbytes for k in ("centroids", "size", "first")) + members.nbytes

    def buffer_bytes(self, store) -> int:
        """The sparse step's fixed scratch, as allocated: the sinks' and the generated region's storage rows
        ([R, 1, sink] and [R, 1, cap - P], expanded over the group), the positions 0..w-1 [R, g, w] and the last
        step's selected rows ``sel`` [R, g, w] (kept for ``attended``)."""
        return _storage_bytes(self._sink_rows, self._gen_rows, self._p, self.sel)

    def report(self, store) -> dict[str, float]:
        return {"clusters": float(self.clusters)}


@dataclass
class ClusterKV(KVMethod):
    """token_budget: prompt tokens read per decode step, per layer and QUERY head, sinks included (reference 1024);
    sink: first tokens always read and never clustered (16); clusters: k-means clusters per KV head (nlist 400;
    fewer on a prompt with fewer non-sink tokens); iterations: Lloyd steps (fit_iter 20); full_layers: first layers
    with full attention (2). Every token generated after the prompt is read too. ``budget`` must be 1.0."""

    budget: float = setting(1.0, holds_every_token="the prompt tokens read per step are method.token_budget")
    token_budget: int = setting(1024, at_least=1)
    sink: int = setting(16, at_least=0)
    clusters: int = setting(400, at_least=1)
    iterations: int = setting(20, at_least=0)
    full_layers: int = 2

    name: ClassVar[str] = "clusterkv"
    policy_class: ClassVar[type[LayerPolicy]] = ClusterKVPolicy

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sink >= self.token_budget:
            raise MethodConfigError(
                f"method.sink={self.sink} is not below method.token_budget={self.token_budget}; allowed: sink < "
                "token_budget (the sinks are read out of the budget, the rest is recalled from clusters)")
