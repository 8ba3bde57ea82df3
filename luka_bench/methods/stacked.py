"""Rows of a batch that decode a layer as one (issue 60; torch only): ``RowStack``.

``hf.RowBatch`` decodes rows of different lengths together, each row on its own ``MethodCache`` (prefilled and
compressed alone, so its compression is the solo one). A layer whose policy decides per step (H2O, Quest, LuKA, ...)
runs row by row on the row's own store. A layer whose every row decodes by **exact attention over everything its
store holds** (``exact_decode``: full attention, the prefill-only methods — SnapKV, PyramidKV, KNorm, ... — and the
exact ``full_layers`` of any method) needs no per-row decision, so its rows are stacked:

- **storage**: one tensor ``[2, B, Hkv, cap, D]`` (keys and values) rectangular at the widest row; each row's store
  keeps a view of its row as its own storage (``KVStore._kv``), so the rows' held tokens are not copied twice and
  every per-row figure (held tokens, positions, ``held_bytes``) is the row's as alone. A row's slots from its length
  on are free (zero; masked);
- **a decode step**: each row's new keys and values written at the row's own slot (one indexed write per layer for
  all rows, the slots a device tensor advanced in place once per step), then one SDPA over the rows with an additive
  mask ``[B, 1, 1, cap]`` (-inf on a row's free slots, opened at the step's slots once per step for every layer of
  the same layout). The launches per layer are batch 1's, whatever the rows' lengths;
- **bookkeeping** per row is host arithmetic (lengths, the positions' pending run, the peak and attended notes).

The stack lives across steps (``for_rows``: the rows' caches point at it; a ``RowBatch`` of the same rows, each
exactly one step on, reuses it). Anything else — another set of rows (a row finished), a row fed alone, an eviction
that re-homed a store, ``MethodCache.clone`` — dissolves it first: each row gets private storage again (its held
tokens and its decode room, as alone) and nothing the stack wrote is lost.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from luka_bench.device import host_to_device

from .base import LayerPolicy

# the policy hooks a decode step reaches: overriding any of them below the class that declared ``exact_decode`` voids
# the declaration (a subclass that decides per step is never stacked by mistake)
DECODE_HOOKS = ("attend", "step", "after_step", "attended", "attended_count", "attended_extra", "extra_entries")


def exact_decode(policy: LayerPolicy) -> bool:
    """Whether ``policy``'s decode step is exact attention over everything its store holds, with nothing after it:
    the nearest class in its MRO that sets ``exact_decode`` says so, and no subclass below it overrides a decode
    hook (``DECODE_HOOKS``)."""
    cls = type(policy)
    owner = next(k for k in cls.__mro__ if "exact_decode" in vars(k))
    inner = getattr(policy, "inner", None)  # a wrapper's attention is its inner policy's
    return (bool(vars(owner)["exact_decode"]) and all(getattr(cls, h) is getattr(owner, h) for h in DECODE_HOOKS)
            and (not isinstance(inner, LayerPolicy) or exact_decode(inner)))


def stackable(store) -> bool:
    """A store whose layer may be decoded stacked: exact decode, one row, classic storage with keys and values in
    one tensor, every head holding every slot, no per-token policy state, no sliding window, no pending step."""
    return (store.n > 0 and store._kv is not None and store._k.shape[0] == 1 and store.packed is None
            and not store._unheld and not store._aux and store.policy.info.sliding_window is None
            and store._positions.due is None and exact_decode(store.policy))


class _Layout:
    """The rows' slots and mask shared by every stacked layer whose rows have the same lengths and width."""

    def __init__(self, ns: list[int], cap: int, dtype: torch.dtype, device: torch.device):
        B = len(ns)
        self.slot = host_to_device(ns, device)  # [B]: each row's next slot
        self.rows = torch.arange(B, device=device)
        self.mask = torch.where(torch.arange(cap, device=device)[None, :] < self.slot[:, None], 0.0,
                                float("-inf")).to(dtype).view(B, 1, 1, cap)
        self.open = torch.zeros((), dtype=dtype, device=device)
        self.at: int | None = None  # the step whose slots it holds (None: fresh, at the rows' lengths)

    def step(self, at: int) -> None:
        """Move to step ``at``'s slots (once per step for all its layers) and open them in the mask."""
        if self.at == at:
            return
        if self.at is not None:
            self.slot.add_(1)
        self.mask.view(self.mask.shape[0], -1).index_put_((self.rows, self.slot), self.open)
        self.at = at


class StackedLayer:
    """One layer's rows in one storage (module docstring)."""

    def __init__(self, stack: "RowStack", stores: list):
        self.stack = stack
        self.stores = stores
        self.ns = [s.n for s in stores]
        self._home(max(s._k.shape[2] for s in stores))

    def _home(self, cap: int) -> None:
        """Storage ``cap`` wide holding every row's tokens; each store's storage becomes a view of its row."""
        first = self.stores[0]._kv
        _, _, h, _, d = first.shape
        kv = first.new_zeros(2, len(self.stores), h, cap, d)
        self.views = []
        for b, s in enumerate(self.stores):
            kv[:, b:b + 1, :, : s.n] = s._kv[:, :, :, : s.n]
            view = kv[:, b:b + 1]
            table = s._positions.table
            if table is not None and table.shape[2] != cap:
                wide = table.new_empty(1, h, cap)
                wide[:, :, : s.n] = table[:, :, : s.n]
                s._positions.table = wide
            s._kv, s._k, s._v = view, view[0], view[1]
            s.static_slot = s.static_kv = None
            self.views.append(view)
        self.kv, self.cap = kv, cap
        self.layout = self.stack.layout(self.ns, cap, kv.dtype, kv.device)

    def holds(self) -> bool:
        """Every row's store still views this storage at the length the stack left it."""
        return all(s._kv is v and s.n == n for s, v, n in zip(self.stores, self.views, self.ns))

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A decode step's keys and values [B, Hkv, 1, D]: each row's at its own slot; the rows' lengths move on."""
        if max(self.ns) + 1 > self.cap:  # the widest row's room ran out: grown as a store grows (amortised)
            grow = max(s.policy.storage_multiple for s in self.stores)
            cap = int(self.cap * self.stores[0].GROWTH) + 16
            self._home(-(-cap // grow) * grow)
        lay = self.layout
        lay.step(self.stack.at)
        self.kv[0][lay.rows, :, lay.slot] = k[:, :, 0]
        self.kv[1][lay.rows, :, lay.slot] = v[:, :, 0]
        for b, s in enumerate(self.stores):
            s._positions.append_run(s.n, 1, s.seen, s._k)
            s.n += 1
            s.seen += 1
            s._aux_zero_from = max(s._aux_zero_from, s.n)
            self.ns[b] = s.n

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """One SDPA over the rows, each query over its own row's held slots: [B, Hq, 1, D]."""
        b, hq, _, d = query.shape
        hkv = self.kv.shape[2]
        out = F.scaled_dot_product_attention(query.view(b, hkv, hq // hkv, d), self.kv[0], self.kv[1],
                                             attn_mask=self.layout.mask, scale=scaling)
        return out.view(b, hq, 1, out.shape[-1])

    def release(self) -> None:
        """Each row that still views this storage gets its own again: its held tokens and its decode room."""
        for s, view in zip(self.stores, self.views):
            if s._kv is view:
                width = min(self.cap, s.n + s.declared_room())
                own = view[:, :, :, :width].clone()
                s._kv, s._k, s._v = own, own[0], own[1]
                table = s._positions.table
                if table is not None:
                    s._positions.table = table[:, :, :width].clone()
        self.stores, self.views = [], []


class RowStack:
    """The stacked layers of one set of rows, kept across their decode steps (module docstring)."""

    def __init__(self, caches: list):
        self.rows = [weakref.ref(c) for c in caches]
        self.at = 0
        self._layouts: dict = {}
        self.layers: dict[int, StackedLayer] = {}
        self.pos: torch.Tensor | None = None
        self.pos_seen: list[int] = []
        for i in range(len(caches[0].stores)):
            stores = [c.stores[i] for c in caches]
            if all(stackable(s) for s in stores) and \
                    len({(s._kv.shape[2], s._kv.shape[4], s._kv.dtype, s._kv.device) for s in stores}) == 1:
                self.layers[i] = StackedLayer(self, stores)

    @classmethod
    def for_rows(cls, caches: list) -> "RowStack":
        """The stack of these rows (in this order), reused when it still holds them one step on; else the old stacks
        of any of them dissolved and a new one made."""
        old = getattr(caches[0], "_row_stack", None)
        if old is not None and old.serves(caches):
            old.at += 1
            return old
        for c in caches:
            stack = getattr(c, "_row_stack", None)
            if stack is not None:
                stack.dissolve()
        new = cls(caches)
        for c in caches:
            c._row_stack = new
        return new

    def serves(self, caches: list) -> bool:
        return (len(caches) == len(self.rows) and all(r() is c for r, c in zip(self.rows, caches))
                and all(layer.holds() for layer in self.layers.values()))

    def layout(self, ns: list[int], cap: int, dtype: torch.dtype, device: torch.device) -> _Layout:
        key = (tuple(ns), cap, dtype, device, self.at)
        if key not in self._layouts:
            self._layouts = {k: v for k, v in self._layouts.items() if k[4] == self.at}  # earlier steps' are stale
            self._layouts[key] = _Layout(ns, cap, dtype, device)
        return self._layouts[key]

    def positions(self, caches: list, device: torch.device) -> torch.Tensor:
        """[B, 1] int64: each row's position for a step of one token (its length less its position shift): advanced in
        place from the last step's when every row moved on by one (one kernel per step), else written anew."""
        seen = [c.stores[0].get_seq_length() for c in caches]
        if self.pos is not None and self.pos.device == device and [s - 1 for s in seen] == self.pos_seen:
            self.pos.add_(1)
        else:
            self.pos = host_to_device(seen, device).view(-1, 1)
        self.pos_seen = seen
        return self.pos

    def dissolve(self) -> None:
        """Every row back on storage of its own; the rows no longer point at this stack."""
        for layer in self.layers.values():
            layer.release()
        self.layers = {}
        self._layouts = {}
        for r in self.rows:
            c = r()
            if c is not None and getattr(c, "_row_stack", None) is self:
                c._row_stack = None


def release_rows(caches: list) -> None:
    """Dissolve the stacks of ``caches`` (after a batch's last step: each row's storage its own again)."""
    for c in caches:
        stack = getattr(c, "_row_stack", None)
        if stack is not None:
            stack.dissolve()
