"""Storage that follows the heads (torch only): ``PackedHeads`` keeps a layer whose KV heads hold different numbers of
tokens (DuoAttention's retrieval and streaming heads, RazorAttention's retrieval and compressed heads, AdaKV's
per-head budgets) in storage as wide as what they hold, not as wide as the longest head.

Layout. Each (batch row, KV head) is a **segment**: its held tokens, contiguous and in time order, followed by its
decode room. The KV heads are split into ``R`` groups of consecutive heads (R divides the head count); a group's
segments lie one after the other in one storage row, so the storage is ``[2, B, R, W, D]`` (keys and values stacked)
with ``W`` the widest row. ``R`` is chosen for the least storage (``plan``: R = 1 puts all heads of a batch row in one
row, no slot wasted; ties go to more rows, which attend over fewer keys). Which slots a head may read is an additive
bias ``[B, R, H / R, W]`` (0 on the head's held slots, -inf elsewhere; RazorAttention's compensation token carries its
log |D| there): a decode step is one SDPA per layer over the rows, each query head reading only its own segment.

Growth. Every segment gets the same tokens in every forward (one per decode step), so where a token goes is a
function of the layer's logical length: a decode step writes its keys and values at ``base + position`` (``base``
a device tensor made at packing, ``position`` the cache's per-step counter: no host number that changes per step, no
host sync). When the room runs out the layer is packed again (``relayout``: an amortised copy, as a store's growth).
A **window** segment (a DuoAttention streaming head) holds its first ``sink`` tokens and its last ``recent``: after
every forward the slots leaving the window get -inf (``slide``), and a relayout drops them.

Positions of tokens appended after packing are not written (they are ``seen0 + rel - f0``: derived when read).
``view`` gives the classic padded layout ``[B, H, n, D]`` (n: the most any head holds; ``mask`` says which slots a
head holds) for reads outside the decode path (reports, tests, the probe): a copy, made on demand.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from luka_bench.device import host_side, host_to_device
from luka_bench.methods import cpu_kernel
from luka_bench.methods.attention import kv_rows

MASK_BLOCK_ELEMENTS = 1 << 22  # a multi-token chunk's mask is made for this many (query, key) pairs at a time


def _dev(values: list[int], device) -> torch.Tensor:
    """Host numbers as a 1-D int64 device tensor without a host synchronisation (``device.host_to_device``)."""
    return host_to_device(values, device)


def plan(caps: list[list[int]], heads: int) -> tuple[int, int]:
    """(R, W): storage rows per batch row and their width for segment capacities ``caps[b][h]``, heads split into R
    groups of consecutive heads. The least R * W; a tie goes to the larger R (each query reads fewer keys)."""
    best: tuple[int, int, int] | None = None
    for r in range(1, heads + 1):
        if heads % r:
            continue
        g = heads // r
        w = max(sum(cb[i * g:(i + 1) * g]) for cb in caps for i in range(r))
        if best is None or r * w <= best[0]:
            best = (r * w, r, w)
    return best[1], best[2]


class PackedHeads:
    """One layer's packed head-wise storage (module docstring). Built by ``build`` from per-segment source rows;
    ``seen`` arguments are the store's logical length."""

    def __init__(self) -> None:
        self.kv: torch.Tensor | None = None  # [2, B, R, W, D]
        self.bias: torch.Tensor | None = None  # [B, R, H / R, W]
        self.pos: torch.Tensor | None = None  # [B, R, W] int64: positions of the slots filled when packed
        self.B = self.H = self.R = self.W = 0
        self.off: list[list[int]] = []  # [B][H] a segment's first slot in its row
        self.f0: list[list[int]] = []  # [B][H] slots it filled when packed
        self.cap: list[list[int]] = []  # [B][H] its slots
        self.seen0 = 0  # the store's logical length when packed
        self.windows: list[tuple[int, int] | None] = []  # [H] (sink, recent) of a window head, None: holds all
        self.slid = 0  # logical length up to which the windows were slid
        self.top = 0  # the highest logical length written (a scratch forward's tokens above ``seen`` are stale)
        self.base_kv: torch.Tensor | None = None  # [B * H] flat row of a segment's token at position 0 ... (below)
        self.base: torch.Tensor | None = None
        self.at_b = self.at_r = self.at_j = self.zero = self.minus_inf = None
        self.win_r = self.win_j = None  # the window heads' rows and heads-in-row [1, Hw] (``base_leave`` [B, Hw])
        self.base_bias: torch.Tensor | None = None
        self.base_leave: torch.Tensor | None = None  # [B * Hw] the flat bias entry leaving a window at a step
        self.bias_name: str | None = None  # the store's additive per-token bias aux this packing carries (Razor)
        self.seg: torch.Tensor | None = None  # [3, B * H] on the host: each segment's first kv row, bias entry, slots

    # -- building ------------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, kv_rows: torch.Tensor, pos_rows: torch.Tensor, bias_rows: torch.Tensor | None,
              segments: list[list[torch.Tensor]], seen: int, windows: list[tuple[int, int] | None],
              room: int, bias_name: str | None = None) -> "PackedHeads":
        """Pack: ``kv_rows`` [2, rows, D] and ``pos_rows`` [rows] (and ``bias_rows`` [rows], additive) the source
        flattened to rows; ``segments[b][h]`` the source rows a segment holds, in time order; ``room`` free slots
        per segment."""
        self = cls()
        B, H = len(segments), len(segments[0])
        dev, d = kv_rows.device, kv_rows.shape[-1]
        counts = [[int(s.numel()) for s in row] for row in segments]
        self.cap = [[c + room for c in row] for row in counts]
        R, W = plan(self.cap, H)
        g = H // R
        self.B, self.H, self.R, self.W = B, H, R, W
        self.f0, self.seen0, self.slid, self.top = counts, seen, seen, seen
        self.windows, self.bias_name = list(windows), bias_name
        self.off = [[sum(self.cap[b][(h // g) * g: h]) for h in range(H)] for b in range(B)]
        dst, dst_bias, src = [], [], []
        for b in range(B):
            for h in range(H):
                c = counts[b][h]
                rel = torch.arange(c, device=dev)
                dst.append((b * R + h // g) * W + self.off[b][h] + rel)
                dst_bias.append((b * H + h) * W + self.off[b][h] + rel)
                src.append(segments[b][h].to(dev))
        dst, dst_bias, src = torch.cat(dst), torch.cat(dst_bias), torch.cat(src)
        self.kv = kv_rows.new_zeros(2, B, R, W, d)
        self.kv.view(2, B * R * W, d).index_copy_(1, dst, kv_rows.index_select(1, src))
        self.pos = torch.zeros(B, R, W, dtype=torch.long, device=dev)
        self.pos.view(-1).index_copy_(0, dst, pos_rows.index_select(0, src))
        self.bias = torch.full((B, R, g, W), float("-inf"), dtype=kv_rows.dtype, device=dev)
        held = bias_rows.index_select(0, src).to(kv_rows.dtype) if bias_rows is not None else 0.0
        self.bias.view(-1).index_put_((dst_bias,), torch.as_tensor(held, dtype=kv_rows.dtype, device=dev))
        f_minus = [[self.off[b][h] + counts[b][h] - seen for h in range(H)] for b in range(B)]
        # a decode step's slot in its row: base + the step's position [B, H]; the row and head-in-row of each head
        self.base = _dev([x for row in f_minus for x in row], dev).view(B, H)
        self.at_b = torch.arange(B, device=dev).view(B, 1)
        self.at_r = (torch.arange(H, device=dev) // g).view(1, H)
        self.at_j = (torch.arange(H, device=dev) % g).view(1, H)
        self.zero = torch.zeros((), dtype=kv_rows.dtype, device=dev)
        self.minus_inf = torch.full((), float("-inf"), dtype=kv_rows.dtype, device=dev)
        self.adopt(self.kv, self.bias, self.pos)  # the flat row ids of a multi-token append (``base_kv``, ...)
        win = [(b, h) for b in range(B) for h in range(H) if windows[h] is not None]
        # the device step slides a window only where it holds its whole window already (the slot leaving is past
        # the sinks); otherwise ``slide`` works on the host
        heads_w = [h for h in range(H) if windows[h] is not None]
        if win and all(counts[b][h] >= sum(windows[h]) for b, h in win):
            # the slot leaving a window at a step: the step's slot less the window
            self.base_leave = _dev([f_minus[b][h] - windows[h][1] for b in range(B) for h in heads_w],
                                   dev).view(B, len(heads_w))
            self.win_r = _dev([h // g for h in heads_w], dev).view(1, -1)
            self.win_j = _dev([h % g for h in heads_w], dev).view(1, -1)
        # per-step numbers in O(1) (every segment grows by the forward's tokens; a full window stays full)
        flat = [(b, h) for b in range(B) for h in range(H)]
        grow = [(b, h) for b, h in flat if windows[h] is None]
        self._grow = (sum(counts[b][h] for b, h in grow), len(grow), max((counts[b][h] for b, h in grow), default=0))
        self._win = (sum(sum(windows[h]) for _, h in win), len(win), max((sum(windows[h]) for _, h in win),
                                                                          default=0))
        self._spare = min(self.cap[b][h] - counts[b][h] for b, h in flat)
        return self

    def segments(self, seen: int) -> list[list[torch.Tensor]]:
        """The slots (relative to its segment) each segment holds at logical length ``seen``, in time order."""
        dev = self.kv.device
        out = []
        for b in range(self.B):
            row = []
            for h in range(self.H):
                f = self.fill(b, h, seen)
                w = self.windows[h]
                stop = self._window_start(b, h, self.slid) if w is not None else 0
                rel = torch.arange(f, device=dev)
                if w is not None and stop > w[0]:
                    rel = torch.cat([rel[: w[0]], rel[stop:]])
                row.append(rel)
            out.append(row)
        return out

    def relayout(self, seen: int, room: int) -> "PackedHeads":
        """The same held tokens packed again with ``room`` free slots per segment (the room ran out)."""
        segs = self.segments(seen)
        g = self.H // self.R
        rows = [[(b * self.R + h // g) * self.W + self.off[b][h] + segs[b][h] for h in range(self.H)]
                for b in range(self.B)]
        d = self.kv.shape[-1]
        bias = self.bias.view(-1)
        bias_rows = None
        if self.bias_name is not None:  # the bias entries follow the kv rows: the row's flat index -> the head's
            flat_b = torch.empty(self.B * self.R * self.W, dtype=self.bias.dtype, device=self.kv.device)
            for b in range(self.B):
                for h in range(self.H):
                    at = (b * self.H + h) * self.W + self.off[b][h] + segs[b][h]
                    flat_b[rows[b][h]] = bias[at]
            bias_rows = flat_b
        new = PackedHeads.build(self.kv.view(2, -1, d), self._positions(seen).view(-1), bias_rows, rows, seen,
                                self.windows, room, self.bias_name)
        return new

    # -- numbers -------------------------------------------------------------------------------------------------
    def fill(self, b: int, h: int, seen: int) -> int:
        return self.f0[b][h] + seen - self.seen0

    def _window_start(self, b: int, h: int, seen: int) -> int:
        sink, recent = self.windows[h]
        return max(sink, self.fill(b, h, seen) - recent)

    def held(self, b: int, h: int, seen: int) -> int:
        f = self.fill(b, h, seen)
        w = self.windows[h]
        return f if w is None else f - max(0, self._window_start(b, h, self.slid) - w[0])

    def held_total(self, seen: int) -> int:
        if self.base_leave is None and self._win[1]:  # windows not yet full: per segment
            return sum(self.held(b, h, seen) for b in range(self.B) for h in range(self.H))
        return self._grow[0] + self._grow[1] * (seen - self.seen0) + self._win[0] + self._win[1] * (seen - self.slid)

    def longest(self, seen: int) -> int:
        if self.base_leave is None and self._win[1]:
            return max(self.held(b, h, seen) for b in range(self.B) for h in range(self.H))
        grow = self._grow[2] + seen - self.seen0 if self._grow[1] else 0
        return max(grow, self._win[2] + seen - self.slid if self._win[1] else 0)

    def spare(self, seen: int) -> int:
        """Tokens every segment can still take."""
        return self._spare - (seen - self.seen0)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.kv, self.bias, self.pos, *self.small()) if t is not None)

    def small(self) -> tuple:
        """The per-segment index tensors."""
        return (self.base_kv, self.base_bias, self.base_leave, self.base, self.at_b, self.at_r, self.at_j, self.zero,
                self.minus_inf, self.win_r, self.win_j)

    # -- the forward ---------------------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, seen: int, slot: torch.Tensor | None) -> None:
        """Write ``k``/``v`` [B, H, L, D] after each segment's held tokens (``spare`` must allow L). ``slot``: a
        decode step's slots, ``base`` + the step's position as a device tensor (no host number in the ops), or None."""
        B, H, L, d = k.shape
        kf, vf = self.kv[0].view(-1, d), self.kv[1].view(-1, d)
        if L == 1 and slot is not None and self.top <= seen + 1:
            # three indexed writes (keys, values, the bias), whatever the layout
            self.kv[0].index_put_((self.at_b, self.at_r, slot), k[:, :, 0])
            self.kv[1].index_put_((self.at_b, self.at_r, slot), v[:, :, 0])
            self.bias.index_put_((self.at_b, self.at_r, self.at_j, slot), self.zero)
        else:
            step = torch.arange(L, device=k.device)
            rows = ((self.base_kv + seen)[:, None] + step).view(-1)
            kf.index_copy_(0, rows, k.reshape(B * H * L, d))
            vf.index_copy_(0, rows, v.reshape(B * H * L, d))
            self.bias.view(-1).index_fill_(0, ((self.base_bias + seen)[:, None] + step).view(-1), 0.0)
            if self.top > seen + L:  # a scratch forward wrote beyond: its tokens were dropped
                stale = torch.arange(self.top - seen - L, device=k.device) + L
                self.bias.view(-1).index_fill_(0, ((self.base_bias + seen)[:, None] + stale).view(-1), float("-inf"))
        self.top = seen + L

    def slide(self, seen: int, leave: torch.Tensor | None) -> None:
        """Windows: the slots that left a window head's window since the last slide stop being held (-inf). ``leave``:
        at a decode step, the slot leaving each window, ``base_leave`` + the step's position as a device tensor."""
        if not any(w is not None for w in self.windows) or seen == self.slid:
            return
        if seen == self.slid + 1 and leave is not None and self.base_leave is not None:
            self.bias.index_put_((self.at_b, self.win_r, self.win_j, leave), self.minus_inf)
        else:
            at = []
            for b in range(self.B):
                for h in range(self.H):
                    if self.windows[h] is None:
                        continue
                    a, z = self._window_start(b, h, self.slid), self._window_start(b, h, seen)
                    if z > a:
                        start = (b * self.H + h) * self.W + self.off[b][h]
                        at.append(torch.arange(start + a, start + z, device=self.bias.device))
            if at:
                self.bias.view(-1).index_fill_(0, torch.cat(at), float("-inf"))
        self.slid = seen

    def attend(self, query: torch.Tensor, scaling: float, chunk: int) -> torch.Tensor:
        """Attention of ``query`` [B, Hq, Lq, D] over each head's own segment; the last ``chunk`` (= Lq) tokens of
        every segment are the queries' own (causal among them). Returns [B, Hq, Lq, Dv]."""
        if query.shape[2] == 1:
            return step_attention(query, self.kv, self.bias, self.H, scaling, self.seg)
        b, hq, lq, d = query.shape
        R, H, W = self.R, self.H, self.W
        g, hr = hq // H, H // R
        k, v = self.kv[0], self.kv[1]
        dv = v.shape[-1]
        bias = self.bias if self.bias.dtype == query.dtype else self.bias.to(query.dtype)
        # the chunk's own slots: index in the chunk, -1 elsewhere (a query sees chunk slots up to its own)
        idx = torch.full((b * R * W,), -1, dtype=torch.long, device=query.device)
        step = torch.arange(lq, device=query.device)
        seen = self.top  # the chunk was just appended: its last token is at logical length top - 1
        idx[((self.base_kv + seen - lq)[:, None] + step).view(-1)] = step.repeat(b * H)
        idx = idx.view(b, R, 1, 1, 1, W)
        q = query.reshape(b, R, hr, g, lq, d)
        out = query.new_empty(b, R, hr, g, lq, dv)
        block = max(1, MASK_BLOCK_ELEMENTS // (hr * g * W))
        for s in range(0, lq, block):
            e = min(lq, s + block)
            qi = step[s:e].view(1, 1, 1, 1, e - s, 1)
            mask = torch.where(idx > qi, float("-inf"), bias[:, :, :, None, None, :])  # [B, R, hr, 1, l, W]
            mask = mask.expand(b, R, hr, g, e - s, W).reshape(b, R, hr * g * (e - s), W)
            o = F.scaled_dot_product_attention(q[:, :, :, :, s:e].reshape(b, R, hr * g * (e - s), d), k, v,
                                               attn_mask=mask, scale=scaling)
            out[:, :, :, :, s:e] = o.view(b, R, hr, g, e - s, dv)
        return out.view(b, hq, lq, dv)

    def adopt(self, kv: torch.Tensor, bias: torch.Tensor, pos: torch.Tensor) -> None:
        """Hold the same slots in ``kv`` [2, B, R, W', D], ``bias`` [B, R, H / R, W'] and ``pos`` [B, R, W'] (W' >= W,
        the caller copied the slots over): views of rows stacked with other rows' (``stacked_packed.py``), or storage
        of its own again. Only the flat row ids of a multi-token append depend on the width."""
        W = kv.shape[3]
        g = self.H // self.R
        heads = [(b, h) for b in range(self.B) for h in range(self.H)]
        # each segment's first slot, flattened in the storage and in the bias
        kv0 = [(b * self.R + h // g) * W + self.off[b][h] for b, h in heads]
        bias0 = [(b * self.H + h) * W + self.off[b][h] for b, h in heads]
        self.kv, self.bias, self.pos, self.W = kv, bias, pos, W
        self.seg = segment_table([list(zip(kv0, bias0, (self.cap[b][h] for b, h in heads)))])
        f = [self.f0[b][h] - self.seen0 for b, h in heads]  # a segment's slot of position 0, relative to its first
        self.base_kv = _dev([x + y for x, y in zip(kv0, f)], kv.device)
        self.base_bias = _dev([x + y for x, y in zip(bias0, f)], kv.device)

    # -- the classic layout, on demand -------------------------------------------------------------------------
    def _positions(self, seen: int) -> torch.Tensor:
        """[B, R, W] int64: every filled slot's logical position (appended tokens' derived)."""
        pos = self.pos.clone()
        for b in range(self.B):
            for h in range(self.H):
                r = h // (self.H // self.R)
                a, f = self.off[b][h] + self.f0[b][h], self.off[b][h] + self.fill(b, h, seen)
                if f > a:
                    pos[b, r, a:f] = torch.arange(self.seen0, self.seen0 + f - a, device=pos.device)
        return pos

    def view(self, seen: int) -> dict[str, torch.Tensor]:
        """The padded layout: keys / values [B, H, n, D], positions [B, H, n], mask [B, H, n] (True: held) and, where
        the packing carries one, bias [B, H, n] (n = the most any head holds; a head's other slots repeat its first)."""
        segs = self.segments(seen)
        n = max(1, max(s.numel() for row in segs for s in row))
        dev = self.kv.device
        g = self.H // self.R
        rows = torch.zeros(self.B, self.H, n, dtype=torch.long, device=dev)
        brow = torch.zeros(self.B, self.H, n, dtype=torch.long, device=dev)
        mask = torch.zeros(self.B, self.H, n, dtype=torch.bool, device=dev)
        for b in range(self.B):
            for h in range(self.H):
                rel, c = segs[b][h], segs[b][h].numel()
                rows[b, h] = (b * self.R + h // g) * self.W + self.off[b][h]
                rows[b, h, :c] += rel
                brow[b, h] = (b * self.H + h) * self.W + self.off[b][h]
                brow[b, h, :c] += rel
                mask[b, h, :c] = True
        d = self.kv.shape[-1]
        kv = kv_rows(self.kv.view(2, -1, d), rows.view(-1)).view(2, self.B, self.H, n, d)
        out = {"keys": kv[0], "values": kv[1], "mask": mask,
               "positions": self._positions(seen).view(-1)[rows.view(-1)].view(self.B, self.H, n)}
        if self.bias_name is not None:
            out["bias"] = self.bias.view(-1)[brow.view(-1)].view(self.B, self.H, n)
        return out


def segment_table(rows: list[list[tuple[int, int, int]]]) -> torch.Tensor:
    """``rows[b][h]`` = (the segment's first row of the flattened storage, its first entry of the flattened bias, its
    slots): the host table [3, B * H] that ``segments_attention`` reads (host data, on the host whatever the device)."""
    with host_side():
        return torch.tensor([x for row in rows for x in row], dtype=torch.long).view(-1, 3).t().contiguous()


def step_attention(query: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, heads: int,
                   scaling: float, seg: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step over packed rows: query [B, Hq, 1, D] over ``kv`` [2, B, R, W, D] with the additive ``bias``
    [B, R, H / R, W] (H = ``heads`` KV heads) expanded over each KV head's query heads: one SDPA. [B, Hq, 1, Dv]

    On the CPU in fp32 with the kernels on, given the segments' table ``seg`` (``segment_table``) of contiguous
    storage: one C++ call instead (``segments_attention``), each KV head's query heads over its own segment only, a
    work item per (row, KV head). The SDPA scores every segment of a packed row for every query head (3x the keys on
    a row of SmolLM2's 3 KV heads) and the CPU's runs a row of one head group as one work item, on one thread."""
    b, hq, _, d = query.shape
    R, W = kv.shape[2], kv.shape[3]
    g, hr = hq // heads, heads // R
    if seg is not None and query.dtype == kv.dtype == bias.dtype == torch.float32 and \
            cpu_kernel.cpu_fast(kv.device) and kv.is_contiguous() and bias.is_contiguous():
        op = cpu_kernel.segments_attention_op()
        if op is not None:
            return op(query.reshape(b, heads, g, d), kv.view(2, -1, d), bias.view(-1), seg, scaling).view(b, hq, 1, d)
    bias = bias if bias.dtype == query.dtype else bias.to(query.dtype)
    mask = bias if g == 1 else bias[:, :, :, None, :].expand(b, R, hr, g, W).reshape(b, R, hr * g, W)
    out = F.scaled_dot_product_attention(query.reshape(b, R, hr * g, d), kv[0], kv[1], attn_mask=mask, scale=scaling)
    return out.view(b, hq, 1, kv.shape[-1])


# -- a store's packing (``KVStore.pack`` / ``unpack`` / ``slide_windows`` and its packed append) ---------------------
UNHELD = "unheld"  # ``store.UNHELD``: the per-token flag of the slots a head does not hold


def pack_store(store, windows: list[tuple[int, int] | None] | None, bias: str | None) -> bool:
    """``KVStore.pack``: ``windows`` per KV head, (sink, recent) for a head that from now on holds only its first
    ``sink`` and last ``recent`` tokens (``slide_store`` after every forward), None for one that keeps every token;
    ``bias`` the name of an additive per-token ``aux`` the attention adds (carried into the packing). Nothing to do
    (False) where every head holds every slot, for a sliding-window layer, or keys and values of different shapes
    (kept as they are). A prefill-time step: one host read of the held counts."""
    if not store.PACK_HEADS or store.packed is not None or not store._unheld or store._kv is None or \
            store.policy.info.sliding_window:
        return False
    b, h, cap, d = store._k.shape
    held = ~store._aux[UNHELD][:, :, : store.n]
    segs = [[(i * h + j) * cap + held[i, j].nonzero().view(-1) for j in range(h)] for i in range(b)]
    pos = torch.zeros(b, h, cap, dtype=torch.long, device=store._k.device)
    pos[:, :, : store.n] = store.positions
    bias_rows = store._aux[bias].view(-1) if bias is not None else None
    longest = int(held.sum(-1).max())
    store.packed = PackedHeads.build(store._kv.view(2, b * h * cap, d), pos.view(-1), bias_rows, segs, store.seen,
                                     windows or [None] * h, store.declared_room(longest), bias)
    store._k = store._v = store._kv = None
    store._aux, store._aux_unzeroed, store._aux_zero_from = {}, set(), 0
    store._positions.reset()
    store._row_base = store._heads = None
    store.static_slot = store.static_kv = None
    _recount(store)
    return True


def unpack_store(store) -> None:
    """``KVStore.unpack``: the classic layout again (the longest head's width, the others' slots unheld), a copy;
    refused for a packing with windows (its policy counts slots in time order)."""
    p = store.packed
    if p is None:
        return
    if any(w is not None for w in p.windows):
        raise RuntimeError(f"method={store.policy.method.name}: a packing with windows (heads holding their sinks "
                           "and last tokens) cannot go back to the classic layout, whose slots its policy counts "
                           "in time order; allowed: the packed operations (append, attention, slide_windows)")
    view = p.view(store.seen)
    store.packed = None
    store._set_kv(view["keys"], view["values"])
    store._positions.reset()
    store._positions.table = view["positions"].contiguous()
    store._aux = {UNHELD: ~view["mask"]}
    if p.bias_name is not None:
        store._aux[p.bias_name] = view["bias"].masked_fill(~view["mask"], float("-inf"))
    store.n = view["mask"].shape[-1]
    store._aux_zero_from = store.n
    store._unheld = int((~view["mask"]).sum())


def _recount(store) -> None:
    p = store.packed
    store.n = p.longest(store.seen)
    store._unheld = p.B * p.H * store.n - p.held_total(store.seen)


def append_store(store, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """A packed store's append: packed again first when the room ran out (amortised, as a store's growth); a decode
    step's slots from the cache's per-step counter."""
    p, L = store.packed, key_states.shape[2]
    if p.spare(store.seen) < L:
        p = store.packed = p.relayout(store.seen, store.declared_room(p.longest(store.seen)) + L)
    slot = None
    if L == 1 and store.cache.phase == "decode":  # riding the cache's position counter: no add of its own
        slot = store.cache.riding(p, "slot", p.base, store.seen)
    p.append(key_states, value_states, store.seen, slot)
    store.seen += L
    _recount(store)


def slide_store(store) -> None:
    """``KVStore.slide_windows`` (a decode step: one indexed write, no host sync)."""
    p = store.packed
    leave = None
    if store.cache.phase == "decode" and p.top == store.seen and p.slid == store.seen - 1 and \
            p.base_leave is not None:
        leave = store.cache.riding(p, "leave", p.base_leave, store.seen - 1)
    p.slide(store.seen, leave)
    _recount(store)
