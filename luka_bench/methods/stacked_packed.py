"""Rows of a batch whose layer is packed per head (``packed.py``: AdaKV's per-head budgets, DuoAttention's streaming
heads, RazorAttention's compressed heads) decoded as one (issue 60 on issue 61's storage).

Each row keeps its own ``PackedHeads`` (its segments, offsets, room and windows: what it would have alone); the
rows' packings are copied into one storage ``[2, B, R, W, D]`` (W the widest row's, a narrower row's extra slots
-inf in its bias) and each row's packing becomes a view of its row (``PackedHeads.adopt``), so that a decode step is
what one row's is, for all rows at once: the step's slots (each row's bases + each row's position: one add), keys,
values and bias written by three ``index_put_``, one SDPA, and where heads hold windows one more add and
``index_put_`` for the slots leaving them. A row whose segments' room runs out is packed again alone (as its append
would) and the rows stacked anew: an event, amortised as a store's growth. On release each row gets storage of its
own width again, its slots where the stack left them.

A layer is stacked this way where every row's packing has the same head groups, windows, bias and dtype, and its
policy decodes exactly over the packing (``exact_decode``, or ``stacked_packed`` for a policy whose step is exact
attention followed by the windows' slide: DuoAttention, RazorAttention).
"""
from __future__ import annotations

import torch

from .packed import _recount, step_attention
from .stacked import declares, exact_decode


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
    """The rows' packings can share one storage: the same head groups, windows, bias, width of a key and dtype."""
    first = stores[0].packed

    def shape(p):
        return p.R, p.H, list(p.windows), p.bias_name, p.kv.shape[-1], p.kv.dtype, p.kv.device, p.bias.dtype
    return all(shape(s.packed) == shape(first) for s in stores)


class StackedPacked:
    """One packed layer's rows in one storage (module docstring)."""

    mode = "packed"

    def __init__(self, stack, stores: list):
        self.stack = stack
        self.stores = stores
        self.policy = stores[0].policy
        self.seen = [s.seen for s in stores]
        self._own: dict[int, int] = {}  # id(packing) -> the width of its own storage (restored on release)
        self._home()

    def _home(self) -> None:
        """Storage as wide as the widest row's packing holding every row's slots; each packing a view of its row."""
        ps = [s.packed for s in self.stores]
        first = ps[0]
        B, R, d = len(ps), first.R, first.kv.shape[-1]
        W = max(p.W for p in ps)
        kv = first.kv.new_zeros(2, B, R, W, d)
        bias = first.bias.new_full((B, R, first.H // R, W), float("-inf"))
        pos = first.pos.new_zeros(B, R, W)
        for b, p in enumerate(ps):
            self._own.setdefault(id(p), p.W)
            kv[:, b:b + 1, :, : p.W] = p.kv
            bias[b:b + 1, ..., : p.W] = p.bias
            pos[b:b + 1, :, : p.W] = p.pos
        for b, p in enumerate(ps):
            p.adopt(kv[:, b:b + 1], bias[b:b + 1], pos[b:b + 1])
        self.packings = ps
        self.kv, self.bias, self.pos = kv, bias, pos
        self.base = torch.cat([p.base for p in ps])  # [B, H]: each segment's slot of its token at position 0
        self.at_b = torch.arange(B, device=kv.device).view(B, 1)
        self.leave = torch.cat([p.base_leave for p in ps]) if first.base_leave is not None else None  # [B, Hw]

    def holds(self) -> bool:
        """Every row's store still has the packing the stack viewed, at the length the stack left it."""
        return all(s.packed is p and p.kv.data_ptr() == self.kv[:, b:b + 1].data_ptr() and s.seen == n
                   for b, (s, p, n) in enumerate(zip(self.stores, self.packings, self.seen)))

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A decode step's keys and values [B, Hkv, 1, D] after each segment's held tokens, each row at its own
        position (the rows' stacked positions)."""
        full = [s for s in self.stores if s.packed.spare(s.seen) < 1]
        for s in full:  # its room ran out: packed again alone (``packed.append_store``), the rows stacked anew
            p = s.packed
            s.packed = p.relayout(s.seen, s.declared_room(p.longest(s.seen)) + 1)
            self._own.pop(id(p), None)
        if full:
            self._home()
        first = self.packings[0]
        slot = self.base + self.stack.pos  # [B, H] + [B, 1]
        self.kv[0].index_put_((self.at_b, first.at_r, slot), k[:, :, 0])
        self.kv[1].index_put_((self.at_b, first.at_r, slot), v[:, :, 0])
        self.bias.index_put_((self.at_b, first.at_r, first.at_j, slot), first.zero)
        for b, s in enumerate(self.stores):
            s.packed.top = s.seen + 1
            s.seen += 1
            self.seen[b] = s.seen
            _recount(s)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The rows' step: one SDPA over the stacked packings, then the slots leaving each window head's window
        (``PackedHeads.slide``'s device step, for all rows). [B, Hq, 1, Dv]"""
        first = self.packings[0]
        out = step_attention(query, self.kv, self.bias, first.H, scaling)
        if self.leave is not None:
            self.bias.index_put_((self.at_b, first.win_r, first.win_j, self.leave + self.stack.pos), first.minus_inf)
            for s in self.stores:
                s.packed.slid = s.seen
                _recount(s)
        return out

    def after(self, query: torch.Tensor) -> None:
        return None

    def release(self) -> None:
        """Each row that still views this storage gets storage of its own width again (its slots where they are)."""
        for b, (s, p) in enumerate(zip(self.stores, self.packings)):
            if s.packed is not p or p.kv.data_ptr() != self.kv[:, b:b + 1].data_ptr():
                continue
            w = self._own.get(id(p), p.W)
            p.adopt(p.kv[..., :w, :].clone(), p.bias[..., :w].clone(), p.pos[..., :w].clone())
