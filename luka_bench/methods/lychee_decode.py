"""LycheeCluster's decode fast path (``k_c: null``, the default) as fixed-shape tensor code: the scoring table of
every node (``DecodePath.rebuild``, redone whenever the index changes), the flattened storage's row ids
(``flat_tables``), the reused query row, unit comparison matrix and additive mask (``buffers``), the torch path's
row ids laid out once per chunk closing (``static_layout``, graph-ready between closings), the retrieval rule as
torch ops (``score`` then ``select``: what the decode step and ``LycheePolicy.retrieve`` both call) and the chunk
token rows (``token_rows``). ``LycheePolicy._decode_attend`` (``lychee.py``) runs a step with them; on the CPU the
choice is ``cpu_kernel``'s ``lychee_decode``, which reads the same table.

Below the method file (``lychee.py`` imports it, never the other way round): a ``DecodePath`` holds one layer's
tables and buffers, reads only the settings of the method it is given (``token_budget``, ``sink``, ``buffer``,
``min_chunk``, ``max_chunk``, ``ranking``, ``k_g``, ``coarse_factor``) and the index tensors the policy hands over."""
from __future__ import annotations

import torch

from luka_bench.methods import cpu_kernel

NEG = float("-inf")


class DecodePath:
    """One layer's decode fast path: the tables made from the index (``rebuild``) and the step's buffers."""

    def __init__(self, method, group: int):
        self.method = method
        self.group = group  # query heads per KV head
        self.M = 0  # chunks in the table
        # every node's scoring column, each chunk's unit and cluster (indices into a score row), the units' tokens
        self.tab = self.chunk_unit = self.chunk_cluster = self.tok_g = None
        self.flat = self.buf = None  # the flat row tables (``flat_tables``) and the step's buffers (``buffers``)
        self.no_bias = torch.empty(0)
        self.lay: tuple | None = None  # the torch path's row ids, laid out per chunk closing (``static_layout``)
        self.open: int | None = None  # recent slots open (0) in the mask's recent part (None: all 0, up to n)
        self.cf_t: torch.Tensor | None = None

    def nbytes(self) -> int:
        """The index's decode tables (the policy's ``extra_bytes``: the node table, the chunks' units and clusters;
        not the token counts, the index's own)."""
        t = [self.tab, self.chunk_unit, self.chunk_cluster]
        return sum(x.nbytes for x in t if x is not None)

    def buffer_bytes(self) -> int:
        """The step's scaffolding, as allocated (the policy's ``buffer_bytes``): the buffers (``buffers``: the query
        row, the units' comparison matrix, the additive mask and its constants; ``cf``'s 0-dim tensor) and the
        storage's row ids (``flat_tables``, ``static_layout``: made from the storage's width and the chunk
        boundaries, remade when either changes). Not held state: a row decoding in a stack (``lychee_stacked``)
        holds the same index and reads the stack's row ids instead."""
        t = list(self.buf[1:4]) + list(self.buf[4]) if self.buf is not None else []
        t += [self.cf_t, self.no_bias]
        t += list(self.flat[1:3]) + [self.flat[4]] if self.flat is not None else []
        t += [self.lay[1]] if self.lay is not None else []
        return sum(x.untyped_storage().nbytes() for x in t if x is not None)

    def rebuild(self, units, clusters, ck: torch.Tensor, assign: torch.Tensor, parent: torch.Tensor,
                tok_g: torch.Tensor) -> None:
        """After the index changed (build, lazy update): every node's scoring column in one table [B, H, D + g + 1,
        P + L + M] — units, fine clusters, chunks; column = [centroid or chunk key, its radius once per query head
        of the group (g rows), 0 or -inf for an empty node] — so that one product [q_s, ||q_1|| .. ||q_g||, 1] @
        table gives every node's UB q_s.mu + sum_i ||q_i|| r (chunks: their own score q_s.v; the norms written by
        one op straight into the query row, their sum done by the product; a row vector times the table: a
        matrix-vector product on the CPU is several times slower the other way round); each chunk's unit and
        cluster (indices into that score row), the units' token counts. ``units`` / ``clusters``: (mu, r, cnt) of
        the coarse units [B, H, P(, D)] and fine clusters [B, H, L(, D)]; ``ck`` / ``assign``: the M indexed chunks'
        keys [B, H, M, D] and fine clusters [B, H, M]; ``parent``: each fine cluster's unit [B, H, L]."""
        mu_g, r_g, cnt_g = units
        mu_c, r_c, cnt_c = clusters
        b, h, P, d = mu_g.shape
        L, M = mu_c.shape[2], ck.shape[2]
        g = self.group
        self.flat = None  # the flat row tables follow M and the storage
        self.M, self.tok_g = M, tok_g
        ops = cpu_kernel.lychee_index_ops(ck.device, ck.dtype)
        if ops is not None:  # the same table in one call on the CPU (``cpu_kernel``)
            self.tab, self.chunk_unit, self.chunk_cluster = ops[1](mu_g, r_g, cnt_g, mu_c, r_c, cnt_c, ck, assign,
                                                                   parent, M, g)
            return
        tab = mu_g.new_zeros(b, h, d + g + 1, P + L + M)
        tab[:, :, :d, :P] = mu_g.transpose(-1, -2)
        tab[:, :, :d, P: P + L] = mu_c.transpose(-1, -2)
        tab[:, :, :d, P + L:] = ck.transpose(-1, -2)
        tab[:, :, d: d + g, :P] = r_g.unsqueeze(2)
        tab[:, :, d: d + g, P: P + L] = r_c.unsqueeze(2)
        tab[:, :, d + g, :P].masked_fill_(cnt_g <= 0, NEG)
        tab[:, :, d + g, P: P + L].masked_fill_(cnt_c <= 0, NEG)
        self.tab = tab
        self.chunk_unit = parent.gather(2, assign)
        self.chunk_cluster = assign + P

    def flat_tables(self, store, ch):
        """Row ids in the flattened storage (``KVStore.gather_flat``), made once per storage shape and index
        size: ``rows`` [B, H, cap] (row of each slot: the sinks and the recent buffer are slices of it), ``start``
        [B, H, M] (row of each chunk's first token), the last row, and ``start_len`` [B, H, M, 2] (that row and the
        chunk's length: one gather reads both). ``ch``: the prompt's ``Chunker``."""
        k = store.storage()[0]
        key = (k.shape, self.M, k.device)
        if self.flat is None or self.flat[0] != key:
            cap = key[0][2]
            base = store.row_offsets()
            rows = base + torch.arange(cap, device=k.device)
            start = base + ch.starts[: self.M]
            start_len = torch.stack([start, ch.lens[: self.M].expand_as(start)], -1)
            self.flat = (key, rows, start, int(base.numel() * cap) - 1, start_len)
        return self.flat[1:]

    def buffers(self, query: torch.Tensor, hkv: int, p: int, c: int, t: int):
        """The query row [B, H, 1, D + g + 1] (fp32: the group's summed query, its g query heads' norms — the
        radius rows' weights, written by the norm itself — and 1, the -inf row's weight), the units' comparison
        matrix [B, H, P, P] (fp32, written by the comparison itself), the additive mask [B, H, 1, >= t] (the
        query's dtype; its chunk part [sink, sink + c) written by every step, the recent part by
        ``static_layout``) and (-inf, 0, arange(max_chunk)), reused while their shapes hold."""
        m = self.method
        b, hq, _, d = query.shape
        key = (b, hkv, d, p, c, query.dtype, query.device)
        if self.buf is None or self.buf[0] != key or self.buf[3].shape[-1] < t:
            qa = torch.zeros(b, hkv, 1, d + hq // hkv + 1, dtype=torch.float32, device=query.device)
            qa[..., -1] = 1.0
            above = torch.zeros(b, hkv, p, p, dtype=torch.float32, device=query.device)
            width = max(t, m.sink + c + m.buffer + 2 * m.max_chunk)
            bias = torch.zeros(b, hkv, 1, width, dtype=query.dtype, device=query.device)
            consts = (torch.full((), NEG, dtype=query.dtype, device=query.device),
                      torch.zeros((), dtype=query.dtype, device=query.device),
                      torch.arange(m.max_chunk, device=query.device))
            self.buf = (key, qa, above, bias, consts)
        return self.buf[1:]

    def cf(self, dev: torch.device) -> torch.Tensor:
        """``coarse_factor`` as a 0-dim float64 tensor (made once): R x it is rounded as the Python product is."""
        if self.cf_t is None or self.cf_t.device != dev:
            self.cf_t = torch.tensor(float(self.method.coarse_factor), dtype=torch.float64, device=dev)
        return self.cf_t

    def static_layout(self, store, step, rows, bias, S: int, C: int, fr: int, n: int, width: int):
        """The torch path's row ids [B, H, S + C + width]: the sinks' rows, C chunk slots (written by each step),
        the rows of the recent region fr .. fr + width (its slots from n on are free: zero or stale storage rows,
        finite); laid out once per chunk closing (and storage reallocation), with the recent part of the additive
        mask: 0 on the held tokens, -inf on the free slots. A decode step opens its token's slot in the mask (one
        ``index_fill_`` at a slot from the position counter): consecutive steps dispatch the same ops on the same
        shapes."""
        key = (rows.shape, rows.data_ptr(), self.M, fr, C, width, bias.data_ptr())
        lay = self.lay
        if lay is None or lay[0] != key:
            b, h = rows.shape[:2]
            idx = torch.empty(b, h, S + C + width, dtype=torch.long, device=rows.device)
            idx[:, :, :S] = rows[:, :, :S]
            idx[:, :, S + C:] = rows[:, :, fr: fr + width]
            lay = self.lay = (key, idx)
            self.open = None
        if self.open == n - fr - 1 and (slot := step.slot(store, S + C - fr)) is not None:
            bias.index_fill_(3, slot, 0.0)  # mask slot of raw token i: i + S + C - fr
        elif self.open != n - fr:
            bias[..., S + C: S + C + n - fr] = 0.0
            bias[..., S + C + n - fr: S + C + width] = NEG
        self.open = n - fr
        return lay[1]

    def all_held(self, bias, start: int) -> None:
        """The mask's recent part from ``start`` all 0 (the CPU op reads every recent slot as held), where
        ``static_layout`` masked free slots."""
        if self.open is not None:
            bias[..., start:] = 0.0
            self.open = None

    def slots(self) -> tuple[int, int]:
        """(cmax, C): the most chunks a step reads (every chunk holds >= ``min_chunk`` tokens of the largest
        retrieval budget) and the chunks' token slots, compacted (<= that budget)."""
        m = self.method
        r_max = m.token_budget - m.sink - m.buffer
        cmax = max(1, min(self.M, r_max // m.min_chunk))
        return cmax, min(cmax * m.max_chunk, r_max)

    def score(self, qg: torch.Tensor, qa: torch.Tensor) -> torch.Tensor:
        """Every unit's, fine cluster's and chunk's score [B, H, P + L + M] for the grouped query qg [B, H, g, D]:
        one product of the query row ``qa`` (``buffers``; the group's summed query and, ``ranking: ub``, each
        query head's norm — it weighs its own radius row: sum_i ||q_i|| r — written by the sum and the norm
        themselves) with the node table (``rebuild``)."""
        d = qg.shape[-1]
        if qg.dtype == torch.float64:  # (fp64 test models: the norm below takes no narrowing dtype)
            qg = qg.float()
        torch.sum(qg, dim=2, dtype=torch.float32, out=qa[:, :, 0, :d])
        if self.method.ranking == "ub":
            torch.linalg.vector_norm(qg, dim=-1, dtype=torch.float32, out=qa[:, :, 0, d: d + qg.shape[2]])
        return torch.matmul(qa, self.tab).squeeze(-2)

    def select(self, sc, start_len, above, neg, P: int, L: int, R, cfR, cmax: int):
        """The retrieval rule (``k_c: null``), as torch ops, on one step's scores ``sc`` (``score``): what
        ``retrieve`` and the decode step's torch path (what CUDA runs; on the CPU, ``cpu_kernel``'s
        ``lychee_decode`` is the same rule in C++) both call. A unit is kept when the tokens of the units scoring
        above it stay under ``cfR`` = ``coarse_factor`` x R (``k_g``: when fewer than k_g units score above it):
        the rank-order rule without a sort, exact ties keeping both or neither. Every chunk of a kept unit gets its
        cluster's UB (-inf elsewhere) and two stable sorts order the chunks by (cluster UB, own score q_s.v): whole
        clusters in rank order, each one's chunks best first; the prefix whose tokens fit ``R`` is read. So the
        cluster that does not fit whole contributes its best chunks (App. D's index drift: a cluster grown by lazy
        updates ranks first with an inflated radius; stopping at it left most steps with no chunk at all), and the
        budget is filled to within one chunk whenever the kept units hold R tokens. ``R`` / ``cfR``: Python
        numbers, or 0-dim device tensors (graph-ready). Returns (the chunks in reading order [B, H, cmax], their
        (first row, length) [B, H, cmax, 2] from ``start_len``, the lengths read (0 after the prefix), the units
        kept [B, H, P])."""
        m = self.method
        su = sc[:, :, :P]
        torch.gt(su.unsqueeze(-2), su.unsqueeze(-1), out=above)  # [B, H, u, v]: unit v scores above unit u
        if m.k_g is None:
            sel = torch.matmul(above, self.tok_g.unsqueeze(-1)).squeeze(-1) < cfR
        else:
            sel = above.sum(-1) < m.k_g
        prim = torch.where(sel.gather(2, self.chunk_unit), sc.gather(2, self.chunk_cluster), neg)
        o1 = torch.sort(sc[:, :, P + L:], dim=-1, descending=True, stable=True).indices
        top, o2 = torch.sort(prim.gather(2, o1), dim=-1, descending=True, stable=True)
        order = o1.gather(2, o2[:, :, :cmax])  # the chunks in reading order (at most cmax fit R)
        sl = start_len.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, 2))  # their first rows and lengths
        lens = sl[..., 1]
        take = lens.cumsum(-1) <= R
        if m.k_g is not None:  # kept units may hold fewer than R tokens: never read past them
            take &= top[:, :, :cmax] > NEG
        return order, sl, lens * take, sel

    def token_rows(self, sl, lens, last_row, within, C: int, out: torch.Tensor) -> torch.Tensor:
        """The decode step's chunk token slots: the storage rows of the chunks read (``select``'s ``sl`` /
        ``lens``), the read tokens first, in order (a stable sort of the padding flags), the first C written into
        ``out`` [B, H, C]. Returns the slots' padding flags [B, H, C]."""
        m = self.method
        b, hkv = lens.shape[:2]
        tok = sl[..., 0].unsqueeze(-1) + within  # [B, H, cmax, max_chunk] storage rows
        if m.buffer < m.max_chunk - m.min_chunk:  # a chunk's padding could run past the storage's last row
            tok.clamp_max_(last_row)
        pad, first = torch.sort((within >= lens.unsqueeze(-1)).view(b, hkv, -1), dim=-1, stable=True)
        torch.gather(tok.view(b, hkv, -1), 2, first[:, :, :C], out=out)
        return pad[:, :, :C]
