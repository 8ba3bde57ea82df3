"""LycheeCluster's decode step for the stacked rows of a batch (issue 60; ``stacked.py``'s *select* kind): every
row's retrieval and attention at once, each row choosing exactly what it chooses alone.

The rows' keys and values are already one storage ``[2, B, Hkv, cap, D]`` (``stacked.py``). Each row keeps its own
index (chunker, clusters, units: built and lazily updated on its own store, as alone, ``LycheePolicy._sync_index``);
``RowTables`` copies every row's decode tables (``DecodePath.rebuild``: the node table, each chunk's unit and
cluster, the units' tokens, the chunks' first rows and lengths) into one table per kind, padded to the largest row:

- columns ``[units Pu | fine clusters Lc | chunks Mc]`` with ``Pu`` = the most units + 1, ``Lc`` = the most clusters
  + 1: a row's columns past its own are *dead* (score -inf through the table's -inf row, no tokens), so a row's
  unit ranking, kept units, cluster UBs and chunk order are its own (a dead unit is never above a live one; a padded
  chunk belongs to the last, dead unit and the last, dead cluster, so it is never a candidate and sorts after every
  real chunk: its own score is -inf too); cluster indices keep their order (each row's shifted by ``Pu - P``);
- the chunk budget (``cmax``, ``C`` slots) of the row with the most chunks: a row with fewer chunks reads at most all
  of them, fewer slots than ``C`` (the rest padding, masked), so its choice is its own;
- each row's ``R`` (tokens left to the chunks), frontier and length per row: the CPU's C++ op (``cpu_kernel``) takes
  them as lists; the torch path (what CUDA runs) as ``[B, 1, 1]`` tensors made once per step for every layer;
- the recent region at the widest row's ``n - fr``: a row's slots past its own recent tokens masked.

A row's tables are copied again when its index changed (an event: a chunk closed, once per ~``max_chunk`` steps per
row) or the storage was re-homed. Each row's policy gets what its step chose (``_fast``, sliced to its own chunk
budget and units; the tokens read counted for all rows by one sum). The stacked tables are a second copy of the rows'
decode tables for as long as the rows decode together (a few percent of the layer's keys and values at the paper's
settings; released with the stack)."""
from __future__ import annotations

import torch

from luka_bench.device import host_to_device
from luka_bench.methods import cpu_kernel
from luka_bench.methods.attention import attend_rows
from luka_bench.methods.lychee_decode import NEG, DecodePath


class RowTables:
    """The rows' decode tables stacked and padded (module docstring), for one stacked layer and storage width."""

    def __init__(self, layer, policies: list, pu: int, lc: int, mc: int):
        m = policies[0].method
        kv = layer.kv
        _, B, H, cap, d = kv.shape
        dev = kv.device
        g = policies[0].path.group
        e = d + g + 1
        self.key = (layer.cap, pu, lc, mc)
        self.pu, self.lc, self.mc, self.cap = pu, lc, mc, cap
        self.path = DecodePath(m, g)  # the stacked tables, read by DecodePath's own score / select / token_rows
        self.path.tab = torch.zeros(B, H, e, pu + lc + mc, dtype=torch.float32, device=dev)
        self.path.tab[:, :, e - 1] = NEG  # every column dead until a row's own is copied in
        self.path.chunk_unit = torch.full((B, H, mc), pu - 1, dtype=torch.long, device=dev)
        self.path.chunk_cluster = torch.full((B, H, mc), pu + lc - 1, dtype=torch.long, device=dev)
        self.path.tok_g = torch.zeros(B, H, pu, dtype=torch.float32, device=dev)
        self.rows = torch.arange(B * H * cap, device=dev).view(B, H, cap)  # each slot's row of the flat storage
        self.base = self.rows[:, :, :1]  # [B, H, 1]: each (row, head)'s first
        self.start = self.base.expand(B, H, mc).clone()  # each chunk's first row (padding: the head's first)
        self.start_len = torch.stack([self.start, torch.zeros_like(self.start)], -1)  # and its length
        self.slen = torch.zeros(B, mc, dtype=torch.long, device=dev)  # each row's chunk lengths (padding 0)
        self.versions = [None] * B
        self.Ms = [0] * B
        self.sinks = self.rows[:, :, : m.sink]
        self.qa = torch.zeros(B, H, 1, e, dtype=torch.float32, device=dev)
        self.qa[..., -1] = 1.0
        self.above = torch.zeros(B, H, pu, pu, dtype=torch.float32, device=dev)
        self.bias: torch.Tensor | None = None
        self.fr_key = None  # the frontiers the recent region's tensors were made for (``per_step``)
        self.consts = (torch.full((), NEG, dtype=kv.dtype, device=dev), torch.zeros((), dtype=kv.dtype, device=dev),
                       torch.arange(m.max_chunk, device=dev))

    def refresh(self, i: int, policy, store) -> None:
        """Row ``i``'s tables copied in (after its index changed)."""
        if self.versions[i] == policy.index_version:
            return
        p = policy.path
        P, L, M = policy.mu_g.shape[2], policy.mu_c.shape[2], policy.M
        pu, lc = self.pu, self.lc
        tab = self.path.tab[i]
        tab[:, :, :P] = p.tab[0, :, :, :P]
        tab[:, :, pu: pu + L] = p.tab[0, :, :, P: P + L]
        tab[:, :, pu + lc: pu + lc + M] = p.tab[0, :, :, P + L:]
        self.path.chunk_unit[i, :, :M] = p.chunk_unit[0]
        torch.add(p.chunk_cluster[0], pu - P, out=self.path.chunk_cluster[i, :, :M])
        self.path.tok_g[i, :, :P] = p.tok_g[0]
        ch = policy.chunker(store)
        self.slen[i, :M] = ch.lens[:M]
        torch.add(self.base[i], ch.starts[:M], out=self.start[i, :, :M])
        self.start_len[i, :, :M, 0] = self.start[i, :, :M]
        self.start_len[i, :, :M, 1] = ch.lens[:M]
        self.versions[i], self.Ms[i] = policy.index_version, M

    def buffers(self, T: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask [B, H, 1, >= T] (its sink part 0; the rest written by each step)."""
        if self.bias is None or self.bias.shape[-1] < T or self.bias.dtype != dtype:
            m = self.path.method
            B, H = self.rows.shape[:2]
            width = max(T, m.sink + self.slots()[1] + m.buffer + 2 * m.max_chunk)
            self.bias = torch.zeros(B, H, 1, width, dtype=dtype, device=self.rows.device)
        return self.bias

    def shared(self, lay, S: int, C: int, W: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's row ids [B, H, S + C + W] and additive mask [B, H, 1, S + C + W], one pair for every layer of
        the rows' layout (``stacked._Layout.kept``: kept across steps): the sinks' rows laid out once, the recent
        part written once per step (``per_step``), the chunk part by each layer before its attention (as a row
        alone writes its own buffer: no copy per layer)."""
        key = ("lychee_rows", S, C, W, dtype)
        got = lay.kept.get(key)
        if got is None:
            B, H = self.rows.shape[:2]
            idx = torch.empty(B, H, S + C + W, dtype=torch.long, device=self.rows.device)
            idx[:, :, :S] = self.sinks
            got = lay.kept[key] = (idx, torch.zeros(B, H, 1, S + C + W, dtype=dtype, device=self.rows.device))
        return got

    def per_step(self, slot: torch.Tensor, frs: list[int], W: int, neg: torch.Tensor, zero: torch.Tensor,
                 rows_out: torch.Tensor, open_out: torch.Tensor):
        """What every layer of a step shares on the torch path, from the rows' slots (``slot`` [B]: each row's length
        before the step's write, advanced in place by ``stacked.py``) and tensors remade only when a row's frontier
        moved (a chunk closed): each row's R = budget - sinks - (n - fr) [B, 1, 1] and coarse line cfR (fp32, as a
        row alone compares its own with its fp32 token sums), and, written into the layout's shared buffers
        (``shared``), its recent rows ``rows_out`` [B, H, W] (slots past its own recent tokens: its first row) and
        their mask ``open_out`` [B, H, W] (0 / -inf). Five ops per step."""
        m = self.path.method
        B = len(frs)
        if self.fr_key != (tuple(frs), W):
            dev = self.rows.device
            fr = host_to_device(frs, dev).view(B, 1, 1)
            self.fr_at = fr + torch.arange(W, device=dev)  # [B, 1, W]: each recent slot's slot in the row
            self.fr_rows = self.base + self.fr_at.clamp_max(self.cap - 1)  # and its row of the flat storage
            self.top = fr + (m.token_budget - m.sink - 1)  # R = top - slot (n = slot + 1)
            self.cf = torch.full((), float(m.coarse_factor), dtype=torch.float64, device=dev)
            self.fr_key = (tuple(frs), W)
            self.cfR = torch.empty(B, 1, 1, dtype=torch.float32, device=dev)
        s = slot.view(B, 1, 1)
        R = self.top - s
        # fp32 written by the product itself (computed in fp64, rounded once: R x cf then .float())
        cfR = None if m.k_g is not None else torch.mul(R, self.cf, out=self.cfR)
        inside = (self.fr_at <= s).expand(rows_out.shape)  # slot fr + i holds a token: fr + i < n
        torch.where(inside, self.fr_rows, self.base, out=rows_out)
        torch.where(inside, zero, neg, out=open_out)
        return R, cfR

    def slots(self) -> tuple[int, int]:
        """(cmax, C) of the row with the most chunks (``DecodePath.slots``)."""
        self.path.M = max(self.Ms)
        return self.path.slots()


def row_tables(layer, stores: list) -> RowTables:
    """The layer's stacked tables, made anew when the storage, the most units or clusters, or the chunk room changed;
    each row's copied in where its index changed."""
    pols = [s.policy for s in stores]
    pu = max(p.mu_g.shape[2] for p in pols) + 1
    lc = max(p.mu_c.shape[2] for p in pols) + 1
    most = max(p.M for p in pols)
    t = layer.state.get("lychee")
    if t is None or t.key[:3] != (layer.cap, pu, lc) or t.mc < most:
        t = layer.state["lychee"] = RowTables(layer, pols, pu, lc, most + max(64, most // 4))
    for i, (p, s) in enumerate(zip(pols, stores)):
        t.refresh(i, p, s)
    return t


def stacked_step(policy, layer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """The rows' decode step (``LycheePolicy.stacked_attend``): exact attention over everything where every row holds
    at most ``token_budget`` tokens ("dense"), else every row's retrieval and the one SDPA over what each chose."""
    stores = layer.stores
    if layer.plans[0] == "dense":
        return layer.exact_step(query, scaling, last=None)
    m = policy.method
    for s in stores:  # chunks closed, the index built or updated: each row's own (an event, as alone)
        s.policy._sync_index(s)
    t = row_tables(layer, stores)
    b, hq, _, d = query.shape
    hkv = layer.kv.shape[2]
    dev = query.device
    chs = [s.policy.chunker(s) for s in stores]
    ns, frs = [s.n for s in stores], [ch.frontier for ch in chs]
    S = m.sink
    cmax, C = t.slots()
    qg = query.view(b, hkv, hq // hkv, d)
    op = cpu_kernel.lychee_decode_op() if dev.type == "cpu" else None
    path, (neg, zero, within) = t.path, t.consts
    if op is not None:  # the same choice in one C++ call (as alone on the CPU), each row's numbers
        T = S + C + max(n - fr for n, fr in zip(ns, frs))
        Rs = [m.token_budget - S - (n - fr) for n, fr in zip(ns, frs)]
        bias = t.buffers(T, torch.float32)  # the op writes an fp32 mask
        idx, pad, order, lens, sel = op(
            qg.float(), path.tab, path.chunk_unit, path.chunk_cluster, path.tok_g, t.slen, t.start, t.rows, bias,
            t.pu, t.lc, m.ranking == "ub", [float(m.coarse_factor * R) for R in Rs], m.k_g or 0, Rs, cmax, C, S,
            frs, ns)
        if query.dtype != torch.float32:
            bias = bias[..., :T].to(query.dtype)
    else:  # torch ops (what CUDA runs): the same ops on the same shapes between chunk closings
        W = max(m.buffer + m.max_chunk, max(n - fr for n, fr in zip(ns, frs)))  # the recent region, fixed
        T = S + C + W
        lay = layer.layout
        idx, bias = t.shared(lay, S, C, W, query.dtype)
        R, cfR = layer.stack.memo(("lychee", tuple(frs), W, C, t.cap, hkv, query.dtype, id(lay)),  # per buffer pair
                                  lambda: t.per_step(lay.slot, frs, W, neg, zero, idx[:, :, S + C:],
                                                     bias[:, :, 0, S + C:]))
        sc = path.score(qg, t.qa)
        order, sl, lens, sel = path.select(sc, t.start_len, t.above, neg, t.pu, t.lc, R, cfR, cmax)
        pad = path.token_rows(sl, lens, t.rows.numel() - 1, within, C, out=idx[:, :, S: S + C])
        torch.where(pad, neg, zero, out=bias[:, :, 0, S: S + C])
    out = attend_rows(qg, layer.kv.view(2, -1, d), idx, bias[..., :T], scaling)
    total = lens.sum((1, 2))  # each row's chunk tokens read, for all rows at once
    for i, (s, ch) in enumerate(zip(stores, chs)):
        p = s.policy
        cm = p.path.slots()[0]
        p.last = None
        p._fast = {"order": order[i: i + 1, :, :cm], "lens": lens[i: i + 1, :, :cm],
                   "sel": sel[i: i + 1, :, : p.mu_g.shape[2]], "n": ns[i], "frontier": frs[i], "starts": ch.starts,
                   "total": total[i]}
    return out.reshape(b, hq, 1, out.shape[-1])

