"""Rows of a batch that decode a layer as one (issue 60; torch only): ``RowStack``.

``hf.RowBatch`` decodes rows of different lengths together, each row on its own ``MethodCache`` (prefilled and
compressed alone, so its compression is the solo one). A layer whose policy decides per step (H2O, Quest, LuKA, ...)
runs row by row on the row's own store. A layer whose every row decodes by **exact attention over everything its
store holds** (``exact_decode``: full attention, the prefill-only methods — SnapKV, PyramidKV, KNorm, ... — and the
exact ``full_layers`` of any method) needs no per-row decision, so its rows are stacked:

- **storage**: one tensor ``[2, B, Hkv, cap, D]`` (keys and values) rectangular at the widest row; each row's store
  keeps a view of its row as its own storage (``KVStore._kv``), so the rows' held tokens are not copied twice and
  every per-row figure (held tokens, positions, ``held_bytes``) is the row's as alone. The rows are
  **right-aligned** (``aligned``): each row's tokens end at the longest row's length, the slots before a row's first
  closed by a mask ``[B, 1, 1, cap]`` made once; a row's store views its row from its first slot on;
- **a decode step**: every row's new keys and values written at the rows' one slot (two copies, as one row's), then
  one SDPA over the rows reading the slots up to it (a view, as one row reads its held slots): the launches per
  layer are batch 1's, whatever the rows' lengths. An exact policy that is graph-ready alone (``static_decode``:
  ``StaticExactPolicy``, the ``full_layers`` of the graph-ready methods) stays so with rows: its rows' tokens start
  at slot 0, each row writes at its own slot (a column of the stack's counter, moved on by the one add per step that
  moves the positions on: ``RowStack.positions``, ``ride``) and the SDPA reads the whole storage with each row's
  free slots masked (``_Layout``: opened at the step's slots once per step for every layer of the same layout that
  reads it — a layer attending over a mask of its own, LuKA's cover, costs it nothing), no
  Python number in the ops;
- **bookkeeping** per row is host arithmetic (lengths, the positions' pending run, the peak and attended notes).

A layer whose policy evicts **at most one token per row per step** (``stacked_evict``: H2O, TOVA, StreamingLLM) is
stacked too: its positions and per-token state (``aux``) are stacked beside the keys and values, a step writes the new
token's position at its slot, the policy's ``stacked_attend`` runs once for all rows (its scores from the same
weights), and each row whose policy says this step puts it one token over (``stacked_plan``, host numbers, as alone)
drops the victim ``stacked_victims`` chose among its held slots: the new token is written into the victim's slot (its
keys, values, position and state; a row that keeps its new token gets it written onto itself), the row's length goes
back by one and its next step writes at the same slot. A row whose step would need more (several tokens over)
leaves the layer unstacked for that step (``serves``). ``DECODE_HOOKS`` and the ``stacked_*`` hooks overridden below
the declaring class void the declaration as for ``exact_decode``.

A layer whose policy **selects** (``stacked_select``: reads a selection of what each row holds, drops nothing in the
step) runs the policy's ``stacked_attend`` once for all rows; where that policy is not graph-ready alone (Razor's
bias layers, entropy-OLS) its rows are right-aligned as an exact layer's, and a row that dropped tokens in its own
``after_step`` (entropy-OLS's flushes) is seated again at its next step (``reseat``) rather than dissolving the stack.

A layer whose KV heads hold different counts (head-wise budgets packed per head: AdaKV, DuoAttention,
RazorAttention) is stacked as its rows' packings in one storage (``stacked_packed.py``); the declarations and checks
above are in ``stack_rules.py``.

The stack lives across steps (``for_rows``: the rows' caches point at it; a ``RowBatch`` of the same rows, each
exactly one step on, reuses it). Another set of rows (a row finished) lets it go layer by layer as their new stack is
made (``RowStack.let_go_layer``): a row going on is copied once, from this storage into the new one, a row that left
gets private storage, each old layer is freed as its new layer is made. Anything else — a row fed alone, an eviction
that re-homed a store, ``MethodCache.clone`` — dissolves it first: each row gets private storage again (its held
tokens and its decode room, as alone; layer by layer, each layer's storage freed before the next's rows copy theirs)
and nothing the stack wrote is lost.
"""
from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F

from luka_bench.device import host_to_device

from .attention import group_apply, group_logits

from .stack_rules import (DECODE_HOOKS, EVICT_HOOKS, declares, evicts_one, exact_decode,  # noqa: F401 (exported)
                          exact_here, own_storage, plan_ahead, plans_agree, stack_mode, stackable)
from .stacked_packed import StackedPacked, packed_decode, packings_agree


class _Layout:
    """The rows' slots and mask shared by every stacked layer whose rows have the same lengths and width at a step."""

    def __init__(self, ns: list[int], cap: int, heads: int, dtype: torch.dtype, device: torch.device,
                 ctr: torch.Tensor | None = None, col: int = 0):
        B = len(ns)
        self.ns, self.cap = list(ns), cap  # the rows' lengths before the step's write
        # [B]: each row's slot of the step — its own tensor, or column ``col`` of the stack's counter ``ctr``
        # (``RowStack.ride``: ``ns`` written there), which the positions' one add per step moves on with them
        self.rides = ctr  # the counter whose column ``slot`` is, or None
        self.slot = host_to_device(ns, device) if ctr is None else ctr[:, col]
        self.rows = torch.arange(B, device=device)
        self.heads = torch.arange(heads, device=device)[None, :]
        # [B, Hkv, 1, cap]: per KV head (a view per (row, head) for a GEMM's input; an SDPA broadcasts it); always
        # each row's slots up to its step's slot open (``mask``: brought up to date when read)
        self._mask = torch.where(torch.arange(cap, device=device)[None, None, :] < self.slot[:, None, None], 0.0,
                                 float("-inf")).to(dtype).expand(B, heads, cap).contiguous().view(B, heads, 1, cap)
        self.open = torch.zeros((), dtype=dtype, device=device)
        self.closed = torch.full((), float("-inf"), dtype=dtype, device=device)
        self._due = 0  # steps whose slot is not opened in ``_mask`` yet (0, 1: the step's slot; more: remade whole)
        self.at: int | None = None  # the step whose slots it holds (None: fresh)
        self.kept: dict = {}  # what a policy's stacked step shares between the layers of this layout, across steps

    @property
    def mask(self) -> torch.Tensor:
        """The rows' additive mask [B, Hkv, 1, cap]: 0 on each row's slots up to its step's slot, -inf after. Opened
        where a step moved a row on only when a layer reads it (a layer attending over a mask of its own — LuKA's
        cover — costs the layout no op): the step's slot opened (one op, as every step of a reader), or, after
        steps nobody read, remade from the slots (two)."""
        if self._due == 1:
            self._mask.view(self._mask.shape[0], self._mask.shape[1], -1).index_put_(
                (self.rows[:, None], self.heads, self.slot[:, None]), self.open)
        elif self._due > 1:
            at = torch.arange(self.cap, device=self._mask.device)
            torch.where((at <= self.slot[:, None, None, None]).expand(self._mask.shape), self.open, self.closed,
                        out=self._mask)
        self._due = 0
        return self._mask

    def advance(self, ns: list[int], at: int, delta, moved: bool = False) -> None:
        """Move to step ``at`` (rows at lengths ``ns``, each the last step's or one more: ``delta`` [B] of 0/1, or 1
        for all) and open the step's slots in the mask (when a layer reads it: ``mask``), once per step for all its
        layers. ``moved``: the slots were moved on by one already (a column of the stack's counter, advanced with the
        positions this step). Rows that all stayed at their slots (``delta`` 0: an evicting layer's rows at their
        capacity) cost no op: the slots are where they were and open already."""
        if self.at is not None and isinstance(delta, int) and delta == 0 and not moved:  # all stayed: nothing to do
            self.ns, self.at = list(ns), at
            return
        if self.at is not None and not (moved and isinstance(delta, int)):  # moved on: only a row that stayed
            self.slot.add_(delta)  # (given as -1 then) goes back by one
        self._due += 1  # the step's slots opened when the mask is read (``mask``)
        self.ns, self.at = list(ns), at


class StackedLayer:
    """One layer's rows in one storage (module docstring): ``mode`` "exact" or "evict"."""

    def __init__(self, stack: "RowStack", stores: list, mode: str = "exact"):
        self.stack = stack
        self.stores = stores
        self.mode = mode
        self.policy = stores[0].policy  # an evicting layer's stacked hooks run on row 0's policy for every row
        self.plans: list = [False] * len(stores)
        self.ns = [s.n for s in stores]
        self.layout: _Layout | None = None
        self.pos: torch.Tensor | None = None  # "evict": the rows' positions [B, Hkv, cap] (int64)
        # "evict" with ``stacked_same_tokens``: the id of the rows' positions as the host knew them when stacked
        # (``same_tokens_lineage``: layers with the same lineage hold the same positions slot for slot, and keep them
        # alike — the victims chosen once per step for all of them), or None
        self.lineage: int | None = None
        self.aux: dict[str, torch.Tensor] = {}  # "evict", "select": the rows' per-token state, each [B, Hkv, cap]
        # "evict": a state's values after the step where the policy's step left its ``aux`` entry at the step's slot
        # unfinished (H2O: the step's mass added to whatever the slot held), read there for the new token's state
        self.sources: dict[str, torch.Tensor] = {}
        self.state: dict = {}  # what the policy's stacked step keeps for these rows (remade with the storage)
        self.kept: dict = {}  # what it keeps for these rows whatever the storage's width (made once)
        # an exact or selecting layer whose policy is not graph-ready (``static_decode``: a step at a Python slot over
        # the held slots, as one row's) has its rows right-aligned (``_home``); a graph-ready one's rows ride the
        # counter
        self.aligned = mode in ("exact", "select") and not any(s.policy.static_decode for s in stores)
        self.fill = 0  # aligned: the rows' common slot of the next step (each row's tokens end there)
        self.open_mask: torch.Tensor | None = None  # aligned: -inf before each row's first slot (None: none)
        shift = [max(self.ns) - n if self.aligned else 0 for n in self.ns]
        self._home(self._width(max(o + s._k.shape[2] for o, s in zip(shift, stores))))

    def _width(self, cap: int) -> int:
        """``cap`` rounded up to whole pages of every row's policy (``storage_multiple``)."""
        grow = max(s.policy.storage_multiple for s in self.stores)
        return -(-cap // grow) * grow

    def _home(self, cap: int) -> None:
        """Storage ``cap`` wide holding every row's tokens; each store's storage becomes a view of its row (an
        evicting layer's positions and per-token state too)."""
        if self.state and self.policy.stacked_release is not None:
            self.policy.stacked_release(self)
        first = self.stores[0]._kv
        _, _, h, _, d = first.shape
        B = len(self.stores)
        kv = first.new_zeros(2, B, h, cap, d)
        evict = self.mode == "evict"
        if evict:
            if self.policy.stacked_same_tokens and not hasattr(self, "kv"):  # stacked now (a re-home keeps it)
                self.lineage = self.stack.lineage_id(same_tokens_lineage(self.stores))
            for s in self.stores:
                s.settle_positions()
                s._positions.materialize(s._k)
            pos = torch.full((B, h, cap), self.policy.stacked_free_position, dtype=torch.long, device=first.device)
            if self.policy.stacked_free_descending:  # free slot j at stacked_free_position + (cap - j)
                pos.add_(torch.arange(cap, 0, -1, device=first.device))
        # per-token state (H2O's masses, LuKA's accumulated mass) stacked beside the keys and values
        aux = {} if self.mode == "exact" else {name: a.new_full((B, h, cap), self.policy.stacked_free_state)
                                               for name, a in self.stores[0]._aux.items()}
        self.views = []
        # an aligned layer's rows right-aligned: each row's tokens end at the longest row's length, so every row
        # writes its step at one slot (a copy, as one row does) and reads the slots up to it (a view): no per-row
        # slot, and a mask that closes only the slots before each row's first (made here, never touched per step)
        aligned = self.aligned
        right = max(s.n for s in self.stores) if aligned else 0
        offsets = [right - s.n for s in self.stores] if aligned else [0] * B
        for b, s in enumerate(self.stores):
            self.views.append(self._seat(kv, aux, b, offsets[b], s._kv, dict(s._aux)))
            if evict:
                pos[b:b + 1, :, : s.n] = s._positions.table[:, :, : s.n]
                s._positions.table = pos[b:b + 1]
        self.kv, self.cap = kv, cap
        self.fill = right
        self.open_mask = None
        if aligned and any(offsets):
            before = torch.arange(cap, device=kv.device)[None, :] < host_to_device(offsets, kv.device)[:, None]
            self.open_mask = torch.where(before, float("-inf"), 0.0).to(kv.dtype).view(B, 1, 1, cap)
        self.heads = torch.arange(h, device=kv.device)[None, :]
        self.aux = aux
        if evict:
            self.pos = pos
        self.layout = None  # a new width: a fresh layout at the next write
        self.state = {}

    def _seat(self, kv: torch.Tensor, aux: dict, b: int, o: int, src: torch.Tensor, src_aux: dict) -> torch.Tensor:
        """Row ``b``'s held tokens (``src`` [2, 1, Hkv, >= n, D], per-token state ``src_aux``) at slots ``o`` on of
        the stacked ``kv`` and ``aux``; its store then views its row from slot ``o`` (a positions table of its own
        as wide). Returns the view."""
        s = self.stores[b]
        n, cap = s.n, kv.shape[3]
        kv[:, b:b + 1, :, o: o + n] = src[:, :, :, :n]
        view = kv[:, b:b + 1, :, o:]
        for name, a in aux.items():
            a[b:b + 1, :, o: o + n] = src_aux[name][:, :, :n]
            s._aux[name] = a[b:b + 1, :, o:]
        table = s._positions.table
        if self.mode != "evict" and table is not None and table.shape[2] != cap - o:
            wide = table.new_empty(1, table.shape[1], cap - o)
            wide[:, :, :n] = table[:, :, :n]
            s._positions.table = wide
        s._kv, s._k, s._v = view, view[0], view[1]
        s.static_slot = s.static_kv = None
        return view

    def holds(self) -> bool:
        """Every row's store still views this storage at the length the stack left it, and (an evicting layer) its
        next step can be stacked."""
        return (all(s._kv is v and s.n == n for s, v, n in zip(self.stores, self.views, self.ns))
                and (self.mode == "exact" or plans_agree(self.stores, self.mode)))

    def reseat(self) -> bool:
        """An aligned layer whose rows dropped tokens in their own ``after_step`` (entropy_ols's flushes: the store
        kept fewer tokens, in its view or in storage of its own): each such row seated again so that its tokens end
        at the rows' one slot, its slots before them closed — an event of that row, not a new stack for every row.
        True where the layer then holds (``holds``)."""
        if not self.aligned or self.mode != "select" or self.policy.stacked_free_state != 0 or \
                not plans_agree(self.stores, self.mode):
            return False
        moved = [b for b, (s, v, n) in enumerate(zip(self.stores, self.views, self.ns)) if s._kv is not v or s.n != n]
        if any(s.n > self.fill or s.n == 0 or s._k.shape[0] != 1 or s.packed is not None or s._unheld
               for s in (self.stores[b] for b in moved)):
            return False
        if self.state and self.policy.stacked_release is not None:
            self.policy.stacked_release(self)
        self.state = {}  # the policy's per-storage state made again at the next step
        B = self.kv.shape[1]
        if self.open_mask is None:
            self.open_mask = self.kv.new_zeros(B, 1, 1, self.cap)
        for b in moved:
            s = self.stores[b]
            src = s._kv[:, :, :, : s.n].clone()  # (it may overlap where it goes)
            src_aux = {name: a[:, :, : s.n].clone() for name, a in s._aux.items()}
            o = self.fill - s.n
            self.views[b] = self._seat(self.kv, self.aux, b, o, src, src_aux)
            s._aux_zero_from = s.n  # its slots from its length on: free (the stack's free state, 0 here)
            self.open_mask[b, :, :, :o] = float("-inf")
            self.ns[b] = s.n
        return self.holds()

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A decode step's keys and values [B, Hkv, 1, D]: each row's at its own slot (an evicting layer's position
        too); the rows' lengths move on; an evicting layer's plans for the step (``stacked_plan``, per row)."""
        if (self.fill if self.aligned else max(self.ns)) + 1 > self.cap:  # the room ran out: grown as a store grows
            self._home(self._width(int(self.cap * self.stores[0].GROWTH) + 16))
        self.step_kv = (k, v)  # the step's keys and values, for a policy that mirrors them (LuKA's cover)
        evict = self.mode == "evict"
        if self.aligned:  # every row's step at the rows' one slot: two copies, as one row's
            self.kv[0][:, :, self.fill] = k[:, :, 0]
            self.kv[1][:, :, self.fill] = v[:, :, 0]
            self.fill += 1
        else:
            lay = self.layout = self.stack.layout(self, self.ns, self.cap, self.kv.shape[2], self.kv.dtype,
                                                  self.kv.device)
            if evict:  # keys and values as one [B, Hkv, 2, D]: written here and again at the victims (``evict``)
                self.new = torch.stack((k[:, :, 0], v[:, :, 0]), dim=2)
                self.kv.movedim(0, 3)[lay.rows, :, lay.slot] = self.new
            else:
                self.kv[0][lay.rows, :, lay.slot] = k[:, :, 0]
                self.kv[1][lay.rows, :, lay.slot] = v[:, :, 0]
        for b, s in enumerate(self.stores):
            if not evict:
                s._positions.append_run(s.n, 1, s.seen, s._k)
            s.n += 1
            s.seen += 1
            s._aux_zero_from = max(s._aux_zero_from, s.n)
            self.ns[b] = s.n
        if self.mode != "exact":
            self.plans = [s.policy.stacked_plan(s) for s in self.stores]
            assert None not in self.plans, "a stacked row's step that cannot be stacked (``RowStack.serves``)"
            marks = self.policy.stacked_slot_positions(self) if evict else None
            if marks is not None:
                self.pos[self.layout.rows, :, self.layout.slot] = marks

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The rows' decode step: an exact layer's (or an evicting layer's whose policy keeps no scores) one SDPA over
        the rows, each query over its own row's held slots; an evicting policy's ``stacked_attend`` otherwise; then
        the evictions (``evict``). [B, Hq, 1, D]."""
        if self.mode == "exact" and self.aligned:  # the slots up to the rows' last (a view), those before a row's
            return self.exact_step(query, scaling)  # first closed
        if self.mode != "exact" and getattr(self.policy, "stacked_attend", None) is not None:
            out = self.policy.stacked_attend(self, query, scaling)
        else:
            out = masked_attention(query, self.kv[0], self.kv[1], self.layout.mask, scaling)
        if self.mode == "evict":
            self.evict()
        return out

    def exact_step(self, query: torch.Tensor, scaling: float, **cleared) -> torch.Tensor:
        """A selecting layer's step where every row reads all it holds (its plan "dense"): each row's policy's
        ``cleared`` attributes set (what a step read: nothing chosen), then one SDPA over the rows."""
        for s in self.stores:
            for name, value in cleared.items():
                setattr(s.policy, name, value)
        if self.aligned:  # the slots up to the rows' last (a view), those before a row's first closed
            w = self.fill
            mask = None if self.open_mask is None else self.open_mask[..., :w]
            return masked_attention(query, self.kv[0][:, :, :w], self.kv[1][:, :, :w], mask, scaling)
        return masked_attention(query, self.kv[0], self.kv[1], self.layout.mask, scaling)

    def held_upto(self, key, at: torch.Tensor) -> torch.Tensor:
        """An additive mask over a region of each row's slots, ``at`` [B, ...] (each entry the slot it reads): 0
        where the slot holds a token at this step (at most the row's slot of the step), -inf elsewhere. Made once per
        step for every layer asking with the same hashable ``key`` (what ``at``'s values follow) and layout."""
        lay = self.layout
        return self.stack.memo((key, id(lay)), lambda: torch.where(
            at <= lay.slot.view(-1, *[1] * (at.dim() - 1)), lay.open, lay.closed))

    def after(self, query: torch.Tensor) -> None:
        """After every row's ``after_step`` (``hf._stacked_attention``): the policy's ``stacked_after``, if any."""
        if self.mode != "exact" and self.policy.stacked_after is not None:
            self.policy.stacked_after(self, query)

    def weights(self, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' step as explicit weights (a policy that scores from them): (fp32 softmax weights [B, Hkv, g, 1,
        cap], each row's free slots 0; the output [B, Hq, 1, Dv]) — ``attention_with_mass``'s decode pass, masked."""
        b, hq, _, d = query.shape
        hkv = self.kv.shape[2]
        logits = group_logits(query.view(b, hkv, hq // hkv, 1, d), self.kv[0], scaling, self.layout.mask)
        w = torch.softmax(logits, dim=-1)
        return w, group_apply(w, self.kv[1]).view(b, hq, 1, -1)

    def evict(self) -> None:
        """Each row whose plan drops a token this step: the new token written into the victim's slot (keys, values,
        position, state), its length back by one. Rows that keep it get it written onto its own slot."""
        plans = self.plans
        lay = self.layout
        sources, self.sources = self.sources, {}
        if not any(plans):
            if not self.policy.stacked_slot_position:  # its position where it stays
                self.pos[lay.rows, :, lay.slot] = self.stack.pos
            for name, src in sources.items():
                self.aux[name][lay.rows, :, lay.slot] = src[lay.rows, :, lay.slot]
            return
        B, h = self.kv.shape[1], self.kv.shape[2]
        victims, start = self.policy.stacked_victims(self), 0  # [B, Hkv], counted from slot ``start``
        if isinstance(victims, tuple):
            victims, start = victims
        here = lay.slot[:, None].expand(B, h)  # (a row that keeps its token: its victim is this, its own slot)
        bi, hi = lay.rows[:, None], self.heads
        index = (bi, hi, victims)
        width = self.cap - start  # the writes through views from slot ``start`` on
        self.kv.movedim(0, 3).narrow(2, start, width).index_put_(index, self.new)  # [B, Hkv, cap, 2, D]
        self.pos.narrow(2, start, width).index_put_(index, self.stack.pos.expand(B, h))
        for name, t in self.aux.items():
            t.narrow(2, start, width).index_put_(index, sources.get(name, t)[bi, hi, here])
        for b, s in enumerate(self.stores):
            if plans[b]:
                s.n -= 1
                self.ns[b] = s.n
            s.policy.stacked_note(s, plans[b])

    def release(self, keep: set[int] = frozenset()) -> None:
        """Each row that still views this storage gets its own again: its held tokens and its decode room (an
        evicting layer's positions and state too; the slots from its length on zeroed in the state). The rows in
        ``keep`` go on viewing it (``RowStack.let_go_layer``: a new stack's layer copies them next)."""
        if self.mode != "exact" and self.policy.stacked_release is not None:
            self.policy.stacked_release(self)
        for b, (s, view) in enumerate(zip(self.stores, self.views)):
            s.stacked_lineage = None
            if s._kv is not view:
                continue
            if b not in keep:
                width = own_storage(s, view, view.shape[3])
                for name, a in list(s._aux.items()):
                    mine = a[:, :, :width].clone()
                    mine[:, :, s.n:] = 0
                    s._aux[name] = mine
                    s._aux_zero_from = s.n  # zeroed from its length on (a dropping row left stale entries there)
            if self.lineage is not None:  # what its positions are known as, while it stays as it leaves
                s.stacked_lineage = ((self.lineage, b), s.n, s.seen, weakref.ref(s._positions.table))
        self.stores, self.views = [], []


def same_tokens_lineage(stores: list) -> tuple | None:
    """What the host knows of an evicting layer's rows' positions, with the policy's kind and method: two layers of a
    policy declaring ``stacked_same_tokens`` whose lineages are equal hold the same positions slot for slot, and keep
    holding the same while they evict the same victims. Per row, its positions' host description where no table was
    made (``LazyPositions.shared`` and its run: StreamingLLM's sinks and window after its prefill), else what a stack
    that let the row go left it (``StackedLayer.release``: its lineage there and its row, while the row's length,
    logical length and table are the ones it left with — no step alone since, no copy of another table). None where
    a row's table is not known so (what it holds is not known without reading it)."""
    policy = stores[0].policy
    out: list = [type(policy), id(policy.method)]
    for s in stores:
        P = s._positions
        if P.due is not None or P.run is not None:
            return None
        if P.table is None and (P.shared is None or isinstance(P.shared, tuple)):
            out.append((s.n, s.seen, s.reference_length, s.pos_shift, P.shared))
            continue
        left = s.stacked_lineage
        if left is None or left[1:3] != (s.n, s.seen) or left[3]() is not P.table:
            return None
        out.append(left[0])
    return tuple(out)


_LINEAGES = itertools.count()


def masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """One SDPA over stacked rows, the group's query heads folded into the query axis: query [B, Hq, 1, D] over
    keys / values [B, Hkv, cap, D] with the additive ``mask`` [B, 1, 1, cap]. [B, Hq, 1, Dv]."""
    b, hq, _, d = query.shape
    hkv = keys.shape[1]
    out = F.scaled_dot_product_attention(query.view(b, hkv, hq // hkv, d), keys, values, attn_mask=mask,
                                         scale=scaling)
    return out.view(b, hq, 1, out.shape[-1])


def stack_as(stores: list) -> str | None:
    """How the rows' stores of a classic layer (not packed) can be stacked for their next step: one mode for every
    row, storage of one head count, width, dtype and device, and (an evicting or selecting layer, whose hooks run on
    row 0's policy) every row's policy of one type and method, the same per-token state and plans that agree."""
    modes = {stack_mode(s) for s in stores}
    if len(modes) != 1 or None in modes or \
            len({(s._kv.shape[2], s._kv.shape[4], s._kv.dtype, s._kv.device) for s in stores}) != 1:
        return None
    mode = modes.pop()
    first = stores[0].policy
    if mode != "exact" and not (all(type(s.policy) is type(first) and s.policy.method == first.method
                                    and set(s._aux) == set(stores[0]._aux) for s in stores)
                                and plans_agree(stores, mode)):
        return None
    return mode


class RowStack:
    """The stacked layers of one set of rows, kept across their decode steps (module docstring)."""

    def __init__(self, caches: list, letting_go: list | None = None):
        """The stack of ``caches``' rows; ``letting_go``: stacks some of these rows were in (a batch whose row
        finished), let go layer by layer as this one is made (``let_go_layer``): a row going on is copied once, from
        the old stack's storage into the new one's, and each old layer's storage is freed as its new layer is made —
        the process holds the rows' keys and values once plus one layer's."""
        self.rows = [weakref.ref(c) for c in caches]
        self.at = 0
        self._layouts: dict = {}
        self._memo: dict = {}
        self._memo_at = -1
        self._kept: dict = {}
        self._step_masks: dict = {}
        self._lineages: dict = {}  # ``lineage_id``
        self.layers: dict[int, StackedLayer] = {}
        self.pos: torch.Tensor | None = None
        self.pos_seen: list[int] = []
        # the positions and the layouts' slots in one counter [B, 1 + n_riders] (column 0 the positions): one add per
        # step moves them all on (``positions``); ``moved`` the step it did, ``riders`` the layout of each column
        self.ctr: torch.Tensor | None = None
        self.moved = -1
        self.riders: list = []
        # layers not stacked because a row cannot say yet how its next step goes (ClusterKV before it clusters its
        # prompt, at the first decode step): stacked as soon as every row can (``serves``)
        self.pending: list[int] = []
        packed_cols = []
        letting_go = letting_go or []
        for i in range(len(caches[0].stores)):
            stores = [c.stores[i] for c in caches]
            classic = not any(s.packed is not None for s in stores)
            mode = stack_as(stores) if classic else None
            for old in letting_go:
                old.let_go_layer(i, caches if mode is not None else None)
            if not classic:  # head-wise budgets packed (``stacked_packed.py``)
                first = stores[0].policy
                if all((s.packed is None or packed_decode(s)) and type(s.policy) is type(first)
                       and s.policy.method == first.method for s in stores) and packings_agree(stores):
                    packed_cols.append((i, stores))
                continue
            if mode is not None:
                self.layers[i] = StackedLayer(self, stores, mode)
            elif any(declares(stores[0].policy, f) for f in ("stacked_evict", "stacked_select")) and \
                    any(stack_mode(s) is None for s in stores):
                self.pending.append(i)
        # columns for the layouts' slots: a layout per layer, and a layer's next while its last is held; then the
        # stacked packed layers' slots (``StackedPacked._ride``), a run of columns each
        self.n_riders = len(self.layers) + 3  # and two for the entries of masks that open one entry per step
        self.n_columns = self.n_riders
        for i, stores in packed_cols:
            self.layers[i] = StackedPacked(self, stores, 1 + self.n_columns)
            self.n_columns += StackedPacked.columns(stores)
        self.layers = dict(sorted(self.layers.items()))
        for old in letting_go:  # (every layer let go above: its rows no longer point at it)
            old.dissolve()

    @classmethod
    def for_rows(cls, caches: list) -> "RowStack":
        """The stack of these rows (in this order), reused when it still holds them one step on; else a new one made,
        letting the old stacks of any of them go layer by layer as it is made."""
        old = getattr(caches[0], "_row_stack", None)
        if old is not None and old.serves(caches):
            old.at += 1
            return old
        olds = list({id(s): s for s in (getattr(c, "_row_stack", None) for c in caches) if s is not None}.values())
        new = cls(caches, olds)  # (the old stacks let go layer by layer as the new one is made)
        for c in caches:
            c._row_stack = new
        return new

    def serves(self, caches: list) -> bool:
        # (a layer left out while a row could not say how its next step goes, that every row can now take: stacked
        # anew — ClusterKV clusters its prompt at the first decode step, each row alone, then stacks)
        return (len(caches) == len(self.rows) and all(r() is c for r, c in zip(self.rows, caches))
                and all(layer.holds() or (isinstance(layer, StackedLayer) and layer.reseat())
                        for layer in self.layers.values())
                and not any(stack_as([c.stores[i] for c in caches]) for i in self.pending))

    def layout(self, layer: StackedLayer, ns: list[int], cap: int, heads: int, dtype: torch.dtype,
               device: torch.device) -> _Layout:
        """The layout of a layer's step whose rows are at lengths ``ns``: shared by every layer at the same lengths and
        width this step; else the layer's own from the last step moved on (each row the same or one slot further),
        else a fresh one — riding the positions' counter where the rows move on every step (an exact or selecting
        layer), its own slots where they mostly stay (an evicting layer at its capacity: no op then)."""
        ride = layer.mode != "evict"
        key = (tuple(ns), cap, heads, dtype, device, ride)
        got = self._layouts.get(key)
        if got is not None and got.at == self.at:
            return got
        old = layer.layout
        lay = None
        if old is not None and old.at is not None and old.at != self.at and old.cap == cap:
            delta = [a - b for a, b in zip(ns, old.ns)]
            # a layout riding the counter: reused only one step on, on the same counter (its column moved on by the
            # positions' add of this step, or of no step since)
            fits = old.rides is None or (old.rides is self.ctr and old.at == self.at - 1)
            if set(delta) <= {0, 1} and fits:
                moved = old.rides is not None and self.moved == self.at  # then a row that stayed goes back by one
                d = 1 if set(delta) == {1} else 0 if set(delta) == {0} and not moved else \
                    self.constant([x - int(moved) for x in delta], torch.long, device)
                old.advance(ns, self.at, d, moved)
                lay = old
        if lay is None:
            col = self.ride(ns, device) if ride else None
            lay = _Layout(ns, cap, heads, dtype, device, None if col is None else self.ctr, 1 + (col or 0))
            if col is not None:
                self.riders[col] = lay
            lay.advance(ns, self.at, None)
        self._layouts = {k: v for k, v in self._layouts.items() if v.at == self.at}  # earlier steps' are stale
        self._layouts[key] = lay
        return lay

    def lineage_id(self, lineage: tuple | None) -> int | None:
        """One id for the layers of this stack whose rows' positions are known alike (``same_tokens_lineage``), a
        new one for each lineage (None: none)."""
        return None if lineage is None else self._lineages.setdefault(lineage, next(_LINEAGES))

    def made(self, key) -> bool:
        """Whether ``memo(key, ...)`` was made this step already."""
        return self._memo_at == self.at and key in self._memo

    def memo(self, key, make):
        """``make()``, made once per step for every layer asking with the same hashable ``key``."""
        if self._memo_at != self.at:
            self._memo, self._memo_at = {}, self.at
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def kept(self, key, make):
        """``make()``, kept across steps for every layer asking with the same hashable ``key`` while some layer asked
        for it this step or the last (a buffer that layers laid out alike share and update once per step)."""
        got = self._kept.get(key)
        if got is None:
            if len(self._kept) >= 16:
                self._kept = {k: v for k, v in self._kept.items() if v[1] >= self.at - 1}
            got = self._kept[key] = [make(), self.at]
        got[1] = self.at
        return got[0]

    def step_mask(self, lay: _Layout, offsets: list[int], width: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
        """An additive mask [B, width] over a region each row reads: 0 on its entries up to ``lay.slot + offsets[b]``
        (the step's token's entry), -inf after — for rows that each move on one entry per step (a selecting layer:
        Quest's pages read, ArkVale's). Kept across steps for every layer asking with the same offsets, layout and
        width: made once (where the offsets change, a page closing: an event), then opened at each row's new entry
        once per step for all those layers, the entries a column of the positions' counter (``ride``: moved on by
        the step's one add, no op of their own)."""
        key = (tuple(offsets), width, dtype, device)
        rec = self._step_masks.get(key)
        if rec is not None and rec["lay"] is lay and rec["at"] == self.at:
            return rec["mask"]
        if rec is not None and rec["lay"] is lay and rec["at"] == self.at - 1 and rec["ctr"] is self.ctr \
                and self.moved == self.at:
            mask = rec["mask"]
            mask[lay.rows, rec["entry"]] = lay.open
            rec["at"] = self.at
            return mask
        if len(self._step_masks) >= 8:
            self._step_masks = {k: v for k, v in self._step_masks.items() if v["at"] >= self.at - 1}
        rec = self._step_masks[key] = {"lay": lay, "at": self.at, "ctr": self.ctr}
        values = [n + o for n, o in zip(lay.ns, offsets)]
        col = self.ride(values, device) if lay.rides is not None else None
        if col is None:  # no free column: the entries a tensor of their own, and the mask made again each step
            rec["entry"], rec["ctr"] = host_to_device(values, device), None
        else:
            self.riders[col] = rec
            rec["entry"] = self.ctr[:, 1 + col]
        at = self.kept(("step_mask_slots", width, device), lambda: torch.arange(width, device=device))
        rec["mask"] = torch.where(at[None, :] <= rec["entry"][:, None], lay.open, lay.closed).to(dtype)
        return rec["mask"]

    def constant(self, values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A small host list (per-row plans, slot moves) as a device tensor, made anew at every step that asks (the
        same ops every step; on the CPU no kernel, on CUDA one small copy)."""
        return host_to_device([int(x) for x in values], device, dtype)

    def positions(self, caches: list, device: torch.device) -> torch.Tensor:
        """[B, 1] int64: each row's position for a step of one token (its length less its position shift): advanced in
        place from the last step's when every row moved on by one (one kernel per step, the riding layouts' slots
        with it: ``ride``), else written anew (no layout rides that counter yet)."""
        seen = [c.stores[0].get_seq_length() for c in caches]
        if self.pos is not None and self.pos.device == device and [s - 1 for s in seen] == self.pos_seen:
            self.ctr.add_(1)
            self.moved = self.at
        else:
            B, w = len(seen), 1 + self.n_columns
            self.ctr = host_to_device([x for s in seen for x in [s] + [0] * self.n_columns], device).view(B, w)
            self.pos = self.ctr[:, :1]
            self.riders = [None] * self.n_riders
        self.pos_seen = seen
        return self.pos

    def ride(self, ns: list[int], device: torch.device) -> int | None:
        """A column of the positions' counter for a new layout's slots, ``ns`` written there (a column whose layout
        no layer holds any more, nor this step's layouts, is taken again), or None (no counter on this device, or
        every column taken — not expected: a column per stacked layer and one more — the layout then moves its own
        slots on)."""
        if self.ctr is None or self.ctr.device != device:
            return None
        live = {id(layer.layout) for layer in self.layers.values() if isinstance(layer, StackedLayer)}
        live |= {id(lay) for lay in self._layouts.values()}
        live |= {id(rec) for rec in self._step_masks.values() if rec["at"] >= self.at - 1}
        for j, lay in enumerate(self.riders):
            if lay is None or id(lay) not in live:
                self.ctr[:, 1 + j].copy_(host_to_device(ns, device))
                return j
        return None

    def let_go_layer(self, i: int, going_on: list | None = None) -> None:
        """Layer ``i`` let go: each of its rows gets its own storage again — except, where ``going_on`` is given (the
        caches of a new stack that stacks this classic layer too: ``RowStack.__init__``), the rows of this stack among
        them, which keep viewing this storage until the new layer copies them into its own (one copy, none in
        between). The layer's storage is freed once nothing views it."""
        layer = self.layers.pop(i, None)
        if layer is None:
            return
        keep: set[int] = set()
        if going_on and isinstance(layer, StackedLayer):
            mine = {id(c): b for b, c in enumerate(r() for r in self.rows) if c is not None}
            keep = {mine[id(c)] for c in going_on if id(c) in mine}
        if keep:  # (a packed layer, ``StackedPacked``, releases every row: its rows are never kept)
            layer.release(keep)
        else:
            layer.release()

    def dissolve(self) -> None:
        """Every row back on storage of its own; the rows no longer point at this stack. Layer by layer: each layer's
        stacked storage freed as soon as its rows hold their own copies (never the stack and the copies side by side)."""
        for i in list(self.layers):
            self.let_go_layer(i)
        self._layouts, self._memo, self._kept, self._step_masks = {}, {}, {}, {}
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
