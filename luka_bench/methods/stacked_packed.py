"""Rows of a batch whose layer is packed per head (``packed.py``: AdaKV's per-head budgets, DuoAttention's streaming
heads, RazorAttention's compressed heads) decoded as one (issue 60 on issue 61's storage).

Each row keeps its own ``PackedHeads`` (its segments, offsets, room and windows: what it would have alone); the
rows' packings are copied into one storage ``[2, B, R, W, D]`` (W the widest row's, a narrower row's extra slots
-inf in its bias) and each row's packing becomes a view of its row (``PackedHeads.adopt``), so that a decode step is
what one row's is, for all rows at once: the step's slots (each row's bases + each row's position, columns of the
rows' position counter that its one add per step moves on: ``RowStack.positions``), keys, values and bias written
by three ``index_put_``, one SDPA (on the CPU in fp32: one C++ call over each head's own segment,
``packed.step_attention``), and where heads hold windows one more ``index_put_`` for the slots leaving them. A row
whose segments' room runs out is packed again alone (as its append would) and the rows stacked anew: an event,
amortised as a store's growth. On release each row gets storage of its own width again, its slots where the stack
left them.

A layer is stacked this way where every row's packing has the same head groups, windows, bias and dtype, and its
policy decodes exactly over the packing (``exact_decode``, or ``stacked_packed`` for a policy whose step is exact
attention followed by the windows' slide: DuoAttention, RazorAttention). A row whose heads happen to hold the same
count (AdaKV: its store classic, decoding exactly) joins as what its classic storage is, a packing of equal
segments: its storage ``[2, 1, H, cap, D]`` becomes the view of its row seen as ``[2, 1, R, H / R * cap, D]`` (the
stack as wide as H / R times its ``cap``), its free slots -inf in its bias, its store classic throughout.
"""
from __future__ import annotations

import torch

from .packed import _recount, segment_table, step_attention
from .stack_rules import declares, exact_decode, own_storage, stack_mode


def packed_decode(store) -> bool:
    """Whether ``store`` is packed and its policy's decode step is exact attention over the packing (then its
    windows slid), its packing one row, caught up (no scratch tokens above its length, windows slid to it, the slide
    a device step where it has windows)."""
    p = store.packed
    if p is None or p.B != 1 or store.policy.info.sliding_window is not None or \
            store.cache.stores[0].get_seq_length() != store.seen:  # the rows' stacked positions are their lengths
        return False
    if not (exact_decode(store.policy) or declares(store.policy, "stacked_packed")):
        return False
    windows = any(w is not None for w in p.windows)
    return p.top == store.seen and (not windows or (p.slid == store.seen and p.base_leave is not None))


def packings_agree(stores: list) -> bool:
    """The rows' packings can share one storage: the same head groups, windows, bias, width of a key and dtype; a
    classic row (``stack_mode`` "exact": every head holds every slot) joins packings without windows or bias."""
    packed = [s for s in stores if s.packed is not None]
    first = packed[0].packed

    def shape(p):
        return p.R, p.H, list(p.windows), p.bias_name, p.kv.shape[-1], p.kv.dtype, p.kv.device, p.bias.dtype
    if not all(shape(s.packed) == shape(first) for s in packed):
        return False
    classic = [s for s in stores if s.packed is None]
    return not classic or (first.bias_name is None and not any(w is not None for w in first.windows) and all(
        stack_mode(s) == "exact" and (s._kv.shape[4], s._kv.dtype, s._kv.device) == shape(first)[4:7]
        and s.cache.stores[0].get_seq_length() == s.seen for s in classic))


class StackedPacked:
    """One packed layer's rows in one storage (module docstring)."""

    mode = "packed"

    def __init__(self, stack, stores: list, col: int):
        self.stack = stack
        self.col = col  # its columns of the rows' position counter: H for the slots, then the window heads' leaving
        self._ctr = self._base = None  # the counter whose columns hold the slots of these bases (``_ride``)
        self.stores = stores
        self.policy = stores[0].policy
        self.seen = [s.seen for s in stores]
        self._own: dict[int, int] = {}  # id(packing) -> the width of its own storage (restored on release)
        self.cap = 0  # a classic row's slots per head in the stack
        self._home()

    def _home(self) -> None:
        """Storage as wide as the widest row's packing (and H / R times a classic row's slots) holding every row's
        slots; each packing a view of its row, each classic row's storage too."""
        first = next(s.packed for s in self.stores if s.packed is not None)
        B, R, H, d = len(self.stores), first.R, first.H, first.kv.shape[-1]
        hr = H // R
        classic = [s for s in self.stores if s.packed is None]
        if classic:  # room for a classic row's next tokens, as its own growth would leave
            self.cap = max(self.cap, max(s.n + 1 + s.declared_room() for s in classic))
        W = max([s.packed.W for s in self.stores if s.packed is not None] + [hr * self.cap])
        self.cap = -(-W // hr)
        W = hr * self.cap
        kv = first.kv.new_zeros(2, B, R, W, d)
        bias = first.bias.new_full((B, R, hr, W), float("-inf"))
        pos = first.pos.new_zeros(B, R, W)
        bases, self.views, segs = [], [], []
        for b, s in enumerate(self.stores):
            p = s.packed
            off, cap = (p.off[0], p.cap[0]) if p is not None else \
                ([h % hr * self.cap for h in range(H)], [self.cap] * H)
            segs.append([((b * R + h // hr) * W + off[h], (b * H + h) * W + off[h], cap[h]) for h in range(H)])
            if p is not None:
                self._own.setdefault(id(p), p.W)
                kv[:, b:b + 1, :, : p.W] = p.kv
                bias[b:b + 1, ..., : p.W] = p.bias
                pos[b:b + 1, :, : p.W] = p.pos
                p.adopt(kv[:, b:b + 1], bias[b:b + 1], pos[b:b + 1])
                bases.append(p.base)
                self.views.append(p.kv)
                continue
            view = kv[:, b:b + 1].view(2, 1, H, self.cap, d)  # its heads' slots, hr heads to a row
            view[:, :, :, : s.n] = s._kv[:, :, :, : s.n]
            j = torch.arange(hr, device=kv.device)  # head (r, j) reads the j-th block of cap slots of row r
            bias[b].view(R, hr, hr, self.cap)[:, j, j, : s.n] = 0.0
            table = s._positions.table
            if table is not None and table.shape[2] != self.cap:
                wide = table.new_empty(1, H, self.cap)
                wide[:, :, : s.n] = table[:, :, : s.n]
                s._positions.table = wide
            s._kv, s._k, s._v = view, view[0], view[1]
            s.static_slot = s.static_kv = None
            heads = torch.arange(H, device=kv.device) % hr * self.cap
            bases.append((heads + (s.n - s.seen)).view(1, H))
            self.views.append(view)
        self.packings = [s.packed for s in self.stores]
        self.kv, self.bias, self.pos = kv, bias, pos
        self.seg = segment_table(segs)  # each row's segments in the stack (``segments_attention`` on the CPU)
        self.base = torch.cat(bases)  # [B, H]: each segment's slot of its token at position 0
        self.at_b = torch.arange(B, device=kv.device).view(B, 1)
        self.at_r, self.at_j, self.zero = first.at_r, first.at_j, first.zero
        self.leave = torch.cat([p.base_leave for p in self.packings]) if first.base_leave is not None else None

    @staticmethod
    def columns(stores: list) -> int:
        """The position counter's columns a stacked packed layer of these rows rides on (``RowStack``)."""
        first = next(s.packed for s in stores if s.packed is not None)
        return first.H + sum(w is not None for w in first.windows)  # (the rows' packings agree on their windows)

    def _ride(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's slots [B, H] (each row's bases + its position) and the window heads' slots leaving [B, Hw]:
        columns of the rows' position counter, moved on with the positions by its one add per step; written (one
        add) when the counter was made anew (the rows' positions jumped) or the stack was laid out again."""
        ctr, H = self.stack.ctr, self.base.shape[1]
        cols = ctr[:, self.col: self.col + H + (0 if self.leave is None else self.leave.shape[1])]
        if self._ctr is not ctr or self._base is not self.base:
            bases = self.base if self.leave is None else torch.cat([self.base, self.leave], 1)
            torch.add(bases, self.stack.pos, out=cols)
            self._ctr, self._base = ctr, self.base
        return cols[:, :H], (None if self.leave is None else cols[:, H:])

    def holds(self) -> bool:
        """Every row's store still has the storage the stack viewed, at the length the stack left it."""
        return all(s.packed is p and (s._kv if p is None else p.kv) is v and s.seen == n
                   for s, p, v, n in zip(self.stores, self.packings, self.views, self.seen))

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A decode step's keys and values [B, Hkv, 1, D] after each segment's held tokens, each row at its own
        position (the rows' stacked positions)."""
        full = [s for s in self.stores if s.packed is not None and s.packed.spare(s.seen) < 1]
        for s in full:  # its room ran out: packed again alone (``packed.append_store``), the rows stacked anew
            p = s.packed
            s.packed = p.relayout(s.seen, s.declared_room(p.longest(s.seen)) + 1)
            self._own.pop(id(p), None)
        if full or any(s.packed is None and s.n + 1 > self.cap for s in self.stores):
            self._home()
        slot, _ = self._ride()
        self.kv[0].index_put_((self.at_b, self.at_r, slot), k[:, :, 0])
        self.kv[1].index_put_((self.at_b, self.at_r, slot), v[:, :, 0])
        self.bias.index_put_((self.at_b, self.at_r, self.at_j, slot), self.zero)
        for b, s in enumerate(self.stores):
            if s.packed is not None:
                s.packed.top = s.seen + 1
                s.seen += 1
                if self.leave is None:  # (with windows: counted once their slide is done, ``attend``)
                    _recount(s)
            else:
                s._positions.append_run(s.n, 1, s.seen, s._k)
                s.n += 1
                s.seen += 1
            self.seen[b] = s.seen

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The rows' step: one SDPA over the stacked packings, then the slots leaving each window head's window
        (``PackedHeads.slide``'s device step, for all rows). [B, Hq, 1, Dv]"""
        first = next(p for p in self.packings if p is not None)
        out = step_attention(query, self.kv, self.bias, first.H, scaling, self.seg)
        if self.leave is not None:  # (every row packed: a classic row joins packings without windows)
            self.bias.index_put_((self.at_b, first.win_r, first.win_j, self._ride()[1]), first.minus_inf)
            for s in self.stores:
                s.packed.slid = s.seen
                _recount(s)
        return out

    def after(self, query: torch.Tensor) -> None:
        return None

    def release(self) -> None:
        """Each row that still views this storage gets storage of its own width again (its slots where they are)."""
        for s, p, view in zip(self.stores, self.packings, self.views):
            if s.packed is not p or (s._kv if p is None else p.kv) is not view:
                continue
            if p is not None:
                w = self._own.get(id(p), p.W)
                p.adopt(p.kv[..., :w, :].clone(), p.bias[..., :w].clone(), p.pos[..., :w].clone())
                continue
            own_storage(s, view, self.cap)
