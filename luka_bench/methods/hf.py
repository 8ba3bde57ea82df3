"""The one module that touches transformers internals (pinned range: see pyproject.toml).

Extension points used, all public:
- a ``transformers.cache_utils.Cache`` whose layers are our own ``CacheLayerMixin`` subclass (``KVStore``);
- an attention function registered with ``AttentionInterface.register`` **and** a mask function registered with
  ``AttentionMaskInterface.register`` under the same name, selected with ``model.set_attn_implementation``.

How a forward reaches the method: ``attach`` registers a forward pre-hook on the model; for a forward through a
``MethodCache`` it puts that cache into the forward's keyword arguments (``CACHE_KWARG``), which transformers hands
down to every attention call (as it does for its own attention kwargs). Each decoder layer calls
``cache.update(k, v, layer_idx)``, which appends to the layer's ``KVStore``; our attention function then takes
``cache.stores[module.layer_idx]`` and hands the query to the store's ``LayerPolicy``. No state is carried between
the cache and the attention function outside the forward's own arguments.

The prefill and the decode phase (``MethodCache.phase``): the first forward through a fresh cache is the prefill
(``reference_length`` = its length unless given; in chunks of the method's ``prefill_chunk()`` when it asks, split
by the pre-hook so the chunks reach the method one by one); after it the method compresses (``end_prefill``), and
every later forward is a decode step. So ``model.generate(ids, past_key_values=attached.new_cache())`` runs the
method exactly as the runner does. A cache made with ``manual=True`` leaves both to its caller (tests that look at
the cache between the prefill and the compression, and the probe's replay, call ``end_prefill()`` themselves).

Method-level hooks (``MethodCache``): ``question_ids`` (the question token ids given when the cache is made, for
question-aware prefill compression); ``state`` (a per-prompt dict a method may keep cross-layer state
in; copied by ``clone``); ``after_forward`` (called by a forward hook that ``attach`` registers on the model, once
per model forward after the last layer, never for a scratch forward); ``scratch_forward(ids, start)`` (a forward
whose keys/values are dropped afterwards: the stores are restored to their length and logical length).

Masks: every policy builds its own mask from what its store holds (``base.chunk_mask``), because after eviction
the physical length no longer matches the logical positions transformers would build a mask from. Our mask
function therefore returns None; it refuses padded batches, which the harness never makes (batch size 1).
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from luka_bench.methods.base import DeviceCount, KVMethod, LayerInfo, LayerPolicy, sdpa

ATTN_NAME = "luka_bench"
CACHE_KWARG = "luka_bench_cache"  # the forward keyword that carries the MethodCache down to the attention calls


def _stackable(k: torch.Tensor, v: torch.Tensor) -> bool:
    return k.shape == v.shape and k.dtype == v.dtype and k.device == v.device


def _write_position(dst: torch.Tensor, due: tuple[torch.Tensor, int], cache: "MethodCache",
                    slot: torch.Tensor | None = None) -> None:
    """Write a decode step's position ``due`` = (the cache's position counter, the value it held) into ``dst``
    [B, Hkv] (or, with ``slot``, into ``dst`` [B, Hkv, m] at that one-element index)."""
    counter, seen = due
    if not cache.position_holds(counter, seen):
        counter = torch.full((), seen, dtype=torch.long, device=dst.device)
    if slot is None:
        dst.copy_(counter)
    else:
        dst.index_copy_(2, slot, counter.expand(*dst.shape[:2], 1))


def _rows(t: torch.Tensor, flat: torch.Tensor, m: int) -> torch.Tensor:
    """``t[b, h, index[b, h, i]]`` for storage t [B, Hkv, cap, ...] (contiguous) and ``flat`` the row ids of
    ``index`` [B, Hkv, m] in t flattened to [B * Hkv * cap, ...] (``KVStore._flat``): one index_select, [B, Hkv,
    m, ...]."""
    b, h, cap = t.shape[:3]
    return t.reshape(b * h * cap, *t.shape[3:]).index_select(0, flat).view(b, h, m, *t.shape[3:])


class KVStore(CacheLayerMixin):
    """One layer's KV cache: keys/values [B, Hkv, n, D] in pre-allocated storage that grows geometrically (no
    O(N) ``torch.cat`` per decode step), the logical position of every held token [B, Hkv, n], and the layer's
    policy. ``seen`` is the logical length (tokens that went through the layer), ``n`` the physical one."""

    is_compileable = False
    is_croppable = False
    GROWTH = 1.25  # capacity factor when full; storage shrinks when an eviction frees more than half

    def __init__(self, policy: LayerPolicy, cache: "MethodCache"):
        # CacheLayerMixin.__init__ would set keys/values attributes; ours are views of the storage.
        self.is_initialized = False
        self.policy = policy
        self.cache = cache  # held weakly (the property below): a store must not keep its cache alive
        self.is_sliding = policy.info.sliding_window is not None
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        # keys and values in one tensor [2, B, Hkv, cap, D] (``_k``/``_v`` are its halves) where their shapes and
        # dtypes agree: a token moved inside the cache is then one copy, not two (``move_last_into``)
        self._kv: torch.Tensor | None = None
        # a decode step's position, not yet written to its slot (the last): (the cache's position counter, the
        # value it holds). Written when something reads positions or at the end of the layer's forward
        # (``settle_positions``), unless an eviction moving the token writes it straight into its new slot
        self._pos_due: tuple[torch.Tensor, int] | None = None
        # decode steps' positions not yet written, as one run: (first slot, its position, end slot): the slots
        # first..end-1 hold position + (slot - first). Consecutive decode steps of a store that moves no token
        # extend it at no cost; it is written (one arange) when something reads or moves positions
        self._pos_run: tuple[int, int, int] | None = None
        self._pos: torch.Tensor | None = None
        self._row_base: tuple | None = None  # row_offsets(), keyed by storage shape
        self._aux: dict[str, torch.Tensor] = {}  # per-token method state [B, Hkv, cap], kept aligned with keys
        self._aux_unzeroed: set[str] = set()  # aux the policy writes for new tokens itself (``aux(zero_new=False)``)
        # every aux entry at a slot >= this is 0 (storage is zeroed when allocated; only removals leave stale entries
        # beyond n): an append at n >= it needs no zero fill — a store that never drops a token fills none
        self._aux_zero_from = 0
        self._heads: tuple | None = None  # head_index(), keyed by storage shape
        self.static_slot: torch.Tensor | None = None  # the last decode step's slot, as a device tensor [1]
        self.static_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # that step's keys and values [B, Hkv, 1, D]
        self._slot_at: tuple[int, int] = (0, 0)  # (seen, n) before that step: ``static_slot_at``
        self.n = 0
        self.seen = 0
        self.pos_shift = 0  # seen - the position the next token gets (StreamingLLM's positions=cache); 0: logical

    # The cache owns its stores; a strong reference back would make every cache a reference cycle, freed only by
    # Python's cyclic garbage collector, which runs on object counts, not bytes: a run answering 200 questions
    # from cache clones kept ~150 MB per clone alive and was killed for memory at 21 GB. ``MethodCache.clone``
    # points the copied stores at the copy.
    @property
    def cache(self) -> "MethodCache":
        cache = self._cache_ref()
        if cache is None:
            raise RuntimeError("this KVStore's MethodCache was dropped: keep the cache alive while its stores are used")
        return cache

    @cache.setter
    def cache(self, cache: "MethodCache") -> None:
        self._cache_ref = weakref.ref(cache)

    # -- views ---------------------------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor:
        return self._k[:, :, : self.n]

    @keys.setter
    def keys(self, value):  # CacheLayerMixin API compatibility (never used to replace storage)
        if value is not None:
            raise AttributeError("KVStore.keys is a view; use append/keep")

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, :, : self.n]

    @values.setter
    def values(self, value):
        if value is not None:
            raise AttributeError("KVStore.values is a view; use append/keep")

    @property
    def positions(self) -> torch.Tensor:
        """Logical position of each held token, [B, Hkv, n] (int64)."""
        self.settle_positions()
        return self._pos[:, :, : self.n]

    def positions_before(self, stop: int) -> torch.Tensor:
        """Positions of the held tokens in slots ``:stop`` (``stop < n``), without writing a decode step's pending
        position (the last slot's): for an eviction that moves that token and writes its position where it lands."""
        assert stop < self.n or self._pos_due is None
        self._settle_run()
        return self._pos[:, :, :stop]

    def settle_positions(self) -> None:
        """Write every pending position: the run of earlier decode steps' (one arange) and this decode step's
        (the last slot's), from the cache's position counter while it still holds the step's position (one
        copy, no Python number); after the counter moved on (a caller that never ran the layer's attention
        through ``run_policy``), from the number."""
        self._settle_run()
        due, self._pos_due = self._pos_due, None
        if due is not None:
            _write_position(self._pos[:, :, self.n - 1], due, self.cache)

    def _settle_run(self) -> None:
        run, self._pos_run = self._pos_run, None
        if run is not None:
            first, pos, end = run
            end = min(end, self.n - (self._pos_due is not None))  # a scratch forward's tokens were dropped
            if end > first:
                self._pos[:, :, first:end] = torch.arange(pos, pos + end - first, device=self._pos.device)

    def end_forward(self) -> None:
        """The layer's forward is over: a decode step's pending position (its token still in the last slot) joins
        the run of unwritten positions when it continues it — no kernel — and is written otherwise (before the
        next step moves the cache's position counter)."""
        due = self._pos_due
        if due is None:
            return
        if self.policy.moves_tokens_every_step:  # it reads or moves positions anyway: written now, one copy
            self.settle_positions()
            return
        slot, seen = self.n - 1, due[1]
        run = self._pos_run
        if run is None or (run[2] == slot and run[1] + slot - run[0] == seen):
            self._pos_due = None
            self._pos_run = (slot, seen, slot + 1) if run is None else (run[0], run[1], slot + 1)
        else:
            self.settle_positions()

    def aux(self, name: str, dtype: torch.dtype = torch.float32, zero_new: bool = True,
            whole: bool = False) -> torch.Tensor:
        """A per-held-token tensor [B, Hkv, n] owned by the policy (e.g. accumulated attention mass). It is
        created zero-filled on first use and ``keep``/``keep_ends``/``evict_into`` move it with the keys. New
        tokens get 0 — unless it was created with ``zero_new=False``: then the policy writes every new token's
        entry itself in the forward that appended it (one kernel fewer per step where it writes them anyway).
        ``whole``: the whole capacity [B, Hkv, cap] (entries from n on are 0 and must stay 0: a policy that adds
        over a fixed span, so that its steps have the same shapes, adds 0 there)."""
        if name not in self._aux:
            b, h, cap = self._k.shape[:3]
            self._aux[name] = torch.zeros(b, h, cap, dtype=dtype, device=self._k.device)
            if not zero_new:
                self._aux_unzeroed.add(name)
        return self._aux[name] if whole else self._aux[name][:, :, : self.n]

    @property
    def device(self) -> torch.device:
        return self._k.device

    @property
    def reference_length(self) -> int:
        return self.cache.reference_length

    # -- storage -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device_ = key_states.dtype, key_states.device
        self.is_initialized = True

    def _allocate(self, like_k: torch.Tensor, like_v: torch.Tensor, cap: int) -> None:
        b, h, _, dk = like_k.shape
        dv = like_v.shape[-1]
        # zeroed, not empty: a policy that attends over the whole storage with the free slots masked
        # (``storage``) must not meet uninitialised bits there (a NaN times a masked weight is still NaN)
        kv = like_k.new_zeros(2, b, h, cap, dk) if _stackable(like_k, like_v) else None
        k, v = (kv[0], kv[1]) if kv is not None else (like_k.new_zeros(b, h, cap, dk), like_v.new_zeros(b, h, cap, dv))
        pos = torch.empty(b, h, cap, dtype=torch.long, device=like_k.device)
        self.settle_positions()
        if self._k is not None and self.n:
            k[:, :, : self.n] = self.keys
            v[:, :, : self.n] = self.values
            pos[:, :, : self.n] = self.positions
        for name, a in self._aux.items():
            new = torch.zeros(b, h, cap, dtype=a.dtype, device=a.device)
            new[:, :, : self.n] = a[:, :, : self.n]
            self._aux[name] = new
        self._k, self._v, self._pos, self._kv = k, v, pos, kv
        self._aux_zero_from = self.n

    def _set_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """New storage holding exactly ``k``/``v`` [B, Hkv, m, D] (stacked where they can be)."""
        if _stackable(k, v):
            self._kv = torch.stack([k, v])
            self._k, self._v = self._kv[0], self._kv[1]
        else:
            self._kv, self._k, self._v = None, k.contiguous(), v.contiguous()

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.end_forward()  # a previous decode step's position, if its forward did not end through run_policy
        L = key_states.shape[2]
        need = self.n + L
        if self._k is None or need > self._k.shape[2]:
            cap = need if self._k is None else max(need, int(self._k.shape[2] * self.GROWTH) + 16)
            self._allocate(key_states, value_states, cap)
        if L == 1 and self.policy.static_decode and self.n >= self._aux_zero_from:
            # a decode step written at a slot the device holds (the step's position less the tokens dropped before
            # it): no Python number that changes from step to step in the ops (``static_slot``); the step's own
            # keys and values are kept for a policy that mirrors them (``static_kv``). Not after a removal left
            # stale per-token state beyond n (its zero fill would slice at n)
            self.static_slot = self.cache.position_before(self.seen, self.seen - self.n, key_states.device).view(1)
            self.static_kv = (key_states, value_states)
            self._slot_at = (self.seen, self.n)
            self._k.index_copy_(2, self.static_slot, key_states)
            self._v.index_copy_(2, self.static_slot, value_states)
        else:
            self.static_slot = self.static_kv = None
            self._k[:, :, self.n : need] = key_states
            self._v[:, :, self.n : need] = value_states
        if L == 1:  # a decode step: its position is the cache's counter (no Python number), written when needed
            self._pos_due = (self.cache.position_tensor(self.seen, key_states.device), self.seen)
        else:
            self._pos[:, :, self.n : need] = torch.arange(self.seen, self.seen + L, device=key_states.device)
        if self.n < self._aux_zero_from:  # slots a removal left stale
            for name, a in self._aux.items():
                if name not in self._aux_unzeroed:
                    a[:, :, self.n : need] = 0
        self._aux_zero_from = max(self._aux_zero_from, need)
        self.n = need
        self.seen += L

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the held tokens at ``index`` (into the current ``n`` tokens): [m] for all heads alike, or
        [B, Hkv, m] per KV head. Order is preserved as given; pass sorted indices to keep time order. Storage
        is reallocated (memory actually freed) when the kept part is under half of it."""
        self.settle_positions()
        b, h = self._k.shape[:2]
        if index.dim() == 1:
            m = index.numel()
            k, v, pos = self.keys.index_select(2, index), self.values.index_select(2, index), \
                self.positions.index_select(2, index)
            aux = {name: a[:, :, : self.n].index_select(2, index) for name, a in self._aux.items()}
        else:  # per KV head: one row gather from each storage (torch.gather over an expanded index is ~6x slower)
            m = index.shape[-1]
            flat = self._flat(index)
            k, v, pos = _rows(self._k, flat, m), _rows(self._v, flat, m), _rows(self._pos, flat, m)
            aux = {name: _rows(a, flat, m) for name, a in self._aux.items()}
        if m < self._k.shape[2] // 2:
            self._set_kv(k, v)
            self._pos = pos.contiguous()
            self._aux = {name: a.contiguous() for name, a in aux.items()}
            self._aux_zero_from = m  # the new storage holds exactly the kept tokens
        else:
            self._k[:, :, :m] = k
            self._v[:, :, :m] = v
            self._pos[:, :, :m] = pos
            for name, a in aux.items():
                self._aux[name][:, :, :m] = a
        self.n = m

    def evict_into(self, slot: torch.Tensor, sources: dict[str, torch.Tensor] | None = None) -> None:
        """Drop one held token per KV head, ``slot`` [B, Hkv] (int64, any slot before the last), by moving the
        newest held token (the last slot) into it: one indexed write per storage tensor — keys and values as one
        (stacked storage), the position (a decode step's pending one goes straight from the cache's counter),
        each aux (from ``sources[name]`` [B, Hkv] where given: a value the policy computed for the new token
        instead of its slot's) — and ``n`` shrinks by one. A decode step's eviction at slots the device chose:
        fixed-size writes, no shift, no host sync. Slots are not in time order afterwards; positions (and keys:
        cached after RoPE) move with their tokens, so attention is unchanged, and a policy that needs time order
        reads ``positions``."""
        self._settle_run()
        n = self.n
        bi, hi = self.head_index()
        index = (bi, hi, slot)
        due, self._pos_due = self._pos_due, None
        sources = sources or {}
        named = {id(a): name for name, a in self._aux.items()}
        for t, ax in self._token_tensors():
            rows = t.movedim(0, 3) if ax == 3 else t  # stacked K/V [2, B, H, cap, D] -> [B, H, cap, 2, D]
            # written through a view that ends before the source slot (the source is not overwritten)
            window = rows.narrow(2, 0, n - 1)
            if t is self._pos and due is not None:  # a decode step's token: its position goes straight there
                counter, seen = due
                if not self.cache.position_holds(counter, seen):
                    counter = torch.full((), seen, dtype=torch.long, device=t.device)
                window.index_put_(index, counter.expand(slot.shape))
            elif named.get(id(t)) in sources:
                window.index_put_(index, sources[named[id(t)]])
            else:
                window.index_put_(index, rows.select(2, n - 1))
        self.n = n - 1

    def head_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, 1], [1, Hkv]) int64: the batch and head indices that, with a slot per head [B, Hkv], address one
        token of each head in an indexed read or write (made once per storage shape)."""
        b, h = self._k.shape[:2]
        key = (b, h, self._k.device)
        if self._heads is None or self._heads[0] != key:
            dev = self._k.device
            self._heads = (key, torch.arange(b, device=dev).view(b, 1), torch.arange(h, device=dev).view(1, h))
        return self._heads[1], self._heads[2]

    def _token_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """The storage that moves with the held tokens, each tensor with its token axis: keys and values (one
        stacked tensor where they are: one copy for both), positions, each aux."""
        kv = [(self._kv, 3)] if self._kv is not None else [(self._k, 2), (self._v, 2)]
        return [*kv, (self._pos, 2), *((a, 2) for a in self._aux.values())]

    def move_last_into(self, slot: torch.Tensor, start: int = 0) -> None:
        """Drop the held token at slot ``start + slot`` (``slot``: a one-element int64 device tensor, all heads
        alike; the slot before the last) by moving the newest held token, the last slot, into it: one copy of its
        keys and values (stacked storage), one of its position and of each aux; ``n`` shrinks by one. A decode
        step's eviction at a slot the device chose: fixed-size copies, no shift, no host sync. The held tokens are
        no longer in time order; positions (and keys: cached after RoPE) move with their tokens, so attention is
        unchanged, and a policy that needs time order reads ``positions``."""
        self._settle_run()
        n = self.n
        due, self._pos_due = self._pos_due, None
        for t, ax in self._token_tensors():
            # written through a view that ends before the source slot: an in-place copy whose source overlaps
            # its destination is refused
            window = t.narrow(ax, start, n - 1 - start)
            if t is self._pos and due is not None:  # a decode step's token: its position goes straight there
                _write_position(window, due, self.cache, slot)
            else:
                window.index_copy_(ax, slot, t.narrow(ax, n - 1, 1))
        self.n = n - 1

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the held tokens at ``index`` [B, Hkv, m] (per KV head; any order, repeats allowed):
        ([B, Hkv, m, Dk], [B, Hkv, m, Dv]). One row gather from the storage (much faster than ``torch.gather``
        with an index expanded over the head dimension)."""
        return self.gather_flat(self._flat(index), index.shape[-1])

    def gather_flat(self, flat: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``gather`` for row ids already in the flattened storage (index + ``row_offsets()``, flattened; [B *
        Hkv * m]), for a policy that builds them in fewer ops on its per-step path. Keys and values in one
        ``index_select`` where they are stored stacked."""
        rows = self.gather_stacked(flat, m)
        if rows is not None:
            return rows[0], rows[1]
        return _rows(self._k, flat, m), _rows(self._v, flat, m)

    def gather_stacked(self, flat: torch.Tensor, m: int) -> torch.Tensor | None:
        """``gather_flat``'s keys and values as one tensor [2, B, Hkv, m, D] (one copy moves both), or None where
        they are stored apart."""
        if self._kv is None:
            return None
        b, h, cap, d = self._k.shape
        return self._kv.view(2, b * h * cap, d).index_select(1, flat).view(2, b, h, m, d)

    def static_slot_at(self, offset: int) -> torch.Tensor:
        """``static_slot + offset`` [1] (the last decode step's slot moved by ``offset``: where a policy mirrors the
        step's token into a buffer of its own), a device tensor made once per step for all the layers asking with
        the same offset (``MethodCache.position_before``)."""
        seen, n = self._slot_at
        return self.cache.position_before(seen, seen - n - offset, self.device).view(1)

    def storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values over the whole allocated capacity [B, Hkv, cap, D] (slots from ``n`` on are free: zero
        or a dropped token's, always finite): for a policy that attends over a fixed shape with the free slots
        masked, so that consecutive decode steps have the same shapes (``LayerPolicy.static_decode``)."""
        return self._k, self._v

    def stacked(self, start: int, stop: int) -> torch.Tensor | None:
        """Keys and values of the held slots ``start:stop`` as one view [2, B, Hkv, stop - start, D] of the stacked
        storage (one copy moves both), or None where they are stored apart (their shapes or dtypes differ)."""
        return None if self._kv is None else self._kv[:, :, :, start:stop]

    def pages(self, start: int, size: int) -> torch.Tensor | None:
        """The stacked storage from slot ``start`` on as pages of ``size`` slots, keys and values together: a view
        [2, B * Hkv, pages, size * D] (page p of a head: slots start + p * size ...), for a policy that gathers whole
        pages in one kernel; None where keys and values are stored apart."""
        if self._kv is None:
            return None
        _, b, h, cap, d = self._kv.shape
        count = (cap - start) // size
        return self._kv[:, :, :, start: start + count * size].view(2, b * h, count, size * d)

    def row_offsets(self) -> torch.Tensor:
        """[B, Hkv, 1]: the first row of each head in the storage flattened to rows [B * Hkv * cap, D]; the
        same tensor until the storage is reallocated (made once per storage shape)."""
        b, h, cap = self._k.shape[:3]
        key = (b, h, cap, self._k.device)
        if self._row_base is None or self._row_base[0] != key:
            self._row_base = (key, (torch.arange(b * h, device=self._k.device) * cap).view(b, h, 1))
        return self._row_base[1]

    def _flat(self, index: torch.Tensor) -> torch.Tensor:
        """Row ids of ``index`` [B, Hkv, m] in the flattened storage."""
        return (index + self.row_offsets()).reshape(-1)

    def keep_ends(self, head: int, tail: int) -> None:
        """Keep the first ``head`` and the last ``tail`` held tokens, drop the rest (all heads alike)."""
        self.settle_positions()
        drop_to = self.n - tail
        if drop_to <= head:
            return
        if drop_to - head < self._k.shape[2] // 2 and tail > 0:
            # small drop (a decode step): shift the tail left in place, no new tensors of cache size
            for t, ax in self._token_tensors():
                t.narrow(ax, head, tail).copy_(t.narrow(ax, drop_to, tail).clone())
            self.n = head + tail
            return
        index = torch.cat([torch.arange(head, device=self.device),
                           torch.arange(drop_to, self.n, device=self.device)])
        self.keep(index)

    def token_bytes(self) -> int:
        """Bytes of one token's keys and values over all heads of this layer."""
        b, h, _, dk = self._k.shape
        return b * h * (dk + self._v.shape[-1]) * self._k.element_size()

    def held_bytes(self) -> int:
        """Bytes of keys and values actually held (the live part of the storage)."""
        return 0 if self._k is None else self.n * self.token_bytes()

    def allocated_bytes(self) -> int:
        if self._k is None:
            return 0
        return self._k.nbytes + self._v.nbytes + self._pos.nbytes + sum(a.nbytes for a in self._aux.values())

    def full_bytes(self) -> int:
        """What plain full attention would hold for this layer at the same logical length."""
        if self._k is None:
            return 0
        w = self.policy.info.sliding_window
        held = self.seen if w is None else min(self.seen, w - 1)
        return held * self.token_bytes()

    # -- CacheLayerMixin API -------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.append(key_states, value_states)
        if self.cache.observer is not None:  # the fidelity probe reads what this forward added
            self.last_update = (key_states, value_states)
        if self.static_slot is not None:
            # transformers hands these to our attention function, which reads the store instead: a static decode
            # step returns the whole storage, so that no view of a step-dependent length is made in the step
            return self.storage()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        # transformers derives the new tokens' positions (RoPE) from it: the logical length, or the position inside
        # the cache when a policy re-assigns positions (pos_shift, with rotate_keys)
        return self.seen - self.pos_shift

    def rotate_keys(self, start: int, stop: int, delta: int) -> None:
        """Move the held keys ``start:stop`` (stored after RoPE) by ``delta`` positions in place: RoPE rotations
        compose, R(p + delta) k = R(delta) R(p) k, so a key rotated for position p becomes the key for p + delta
        (the model's own rotary embedding gives cos/sin of ``delta``; its attention scaling divided out; the
        rotate-half layout of Llama / Qwen / Mistral / Gemma; a partial rotary dimension rotates only its part)."""
        if stop <= start or delta == 0:
            return
        model = self.cache.model
        rope = getattr(getattr(model, "model", model), "rotary_emb", None)
        if rope is None:
            raise RuntimeError(f"{type(model).__name__} has no model.rotary_emb: keys cannot be re-rotated")
        k = self._k[:, :, start:stop]
        pid = torch.full((1, 1), delta, device=k.device, dtype=torch.long)
        cos, sin = rope(k.float(), pid)  # [1, 1, rot]
        scale = float(getattr(rope, "attention_scaling", 1.0) or 1.0)
        cos, sin = cos.float() / scale, sin.float() / scale
        rot, half = cos.shape[-1], cos.shape[-1] // 2
        x = k[..., :rot].float()
        out = x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
        self._k[:, :, start:stop, :rot] = out.to(k.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._k = self._v = self._pos = self._kv = self._pos_due = self._pos_run = None
        self._aux = {}
        self._aux_unzeroed = set()
        self._aux_zero_from = 0
        self.n = self.seen = 0
        self.pos_shift = 0
        self.is_initialized = False


class MethodCache(Cache):
    """A cache with one ``KVStore`` per decoder layer and the method's policies. Make a new one per prompt
    (``new_cache``); ``clone()`` gives an independent copy (the runner answers every question from a clone of
    the context-only cache)."""

    def __init__(self, method: KVMethod, infos: list[LayerInfo], model: PreTrainedModel | None = None, *,
                 reference_length: int | None = None, question_ids: list[int] | None = None, prefill_chunk: int = 0,
                 observer=None, manual: bool = False, cuda_events: bool = False):
        """``reference_length``: the length the budget is a fraction of (QA: the context; perplexity: the
        document); None: the first forward's length. ``question_ids``: the question's token ids, for
        question-aware prefill compression (several questions on one context: concatenated in order).
        ``prefill_chunk``: the prefill goes through the model in chunks of this size (the method's own
        ``prefill_chunk()`` wins; 0: at once). ``observer``: see below. ``manual``: the caller says when the
        prefill ends (``end_prefill``) and sizes the forwards itself; otherwise the first forward is the prefill.
        ``cuda_events``: time the method's components on CUDA (``latency_breakdown``) with recorded events (see
        ``mark``); off, a CUDA step records none."""
        self.method = method
        self.cuda_events = cuda_events
        self.model = model  # needed by scratch_forward and rotate_keys
        self.reference_length = 0 if reference_length is None else int(reference_length)
        self._reference_from_prefill = reference_length is None
        self.manual = manual
        # a manual cache's caller sizes its forwards; otherwise the method's chunk size wins
        self.prefill_chunk = int(prefill_chunk or 0) if manual else (method.prefill_chunk() or int(prefill_chunk or 0))
        self._splitting = False  # inside the pre-hook's chunked prefill (the chunks are not the prefill's end)
        self.phase = "prefill"  # "prefill" -> "decode"; "scratch" during a scratch_forward
        self.question_ids: list[int] | None = list(question_ids) if question_ids is not None else None
        self.state: dict = {}  # per-prompt, cross-layer method state (copied by clone)
        self.peak_bytes = 0  # bytes held at most during the decode phase (see _note)
        self._timings: dict[str, float] = {}  # seconds per component, summed (methods add: span / add_span)
        self._pending: list = []  # (key, start event, end event) of CUDA spans not yet resolved
        # Optional callable(store, query, out, scaling), called after every ``attend`` and before ``after_step`` (so the
        # policy's ``attended(store)`` describes this forward); ``store.last_update`` holds the keys/values this
        # forward appended. Used by the fidelity probe (luka_bench/probe.py); None costs nothing.
        self.observer = observer
        self.token_ids: list[int] = []  # ids of every token fed so far (add_tokens, or the pre-hook from input_ids)
        # attended metric: per decode forward, sum over layers of held tokens read and their bytes; a policy may
        # give its count as a device tensor (no host sync per step): resolved in one copy when the lists are read
        self._attended: tuple[list[float], list[float], list[float]] = ([], [], [])
        self._attended_pending: list[tuple] = []
        self._position: dict = {}  # device -> [value, 0-dim int64 tensor]: see position_tensor
        self._offsets: dict = {}  # (key, device) -> (counter, value, tensor): see per_step
        self._masks: dict = {}  # (name, width, rows, dtype, device) -> [mask, held]: see held_mask
        stores = [KVStore(method.policy_for_layer(info), self) for info in infos]
        super().__init__(layers=stores)

    @property
    def stores(self) -> list[KVStore]:
        return self.layers  # type: ignore[return-value]

    def position_tensor(self, seen: int, device: torch.device) -> torch.Tensor:
        """A 0-dim int64 tensor on ``device`` holding ``seen`` (the logical position of a decode step's token),
        shared by the layers of one forward. From one decode step to the next it is advanced in place (``add_(1)``,
        once per step, not per layer): a step's ops then carry no Python number that changes between steps (a
        ``fill_(seen)`` would bake ``seen`` into a captured CUDA graph) — the graph-ready steady state of
        ``tests/test_graph_ready.py``. Any other jump (a scratch forward, a prefill) refills it."""
        got = self._position.get(device)
        if got is None:
            got = self._position[device] = [seen, torch.full((), seen, dtype=torch.long, device=device)]
        elif got[0] != seen:
            if got[0] == seen - 1:
                got[1].add_(1)
            else:
                got[1].fill_(seen)
            got[0] = seen
        return got[1]

    def position_before(self, seen: int, delta: int, device: torch.device) -> torch.Tensor:
        """``position_tensor(seen) - delta``, a 0-dim device tensor computed once per step for all layers (e.g. the
        first position of a recent window that ends at the step's token): no Python number that changes from step
        to step in the ops, one kernel per step instead of one per layer."""
        if delta == 0:
            return self.position_tensor(seen, device)
        return self.per_step(("minus", delta), seen, device, lambda counter: torch.sub(counter, delta))

    def per_step(self, key, seen: int, device: torch.device, make) -> torch.Tensor:
        """``make(position_tensor(seen))``, a device tensor computed once per step for all the layers that ask for
        it with the same ``key`` (hashable, holding the constants ``make`` uses): e.g. a budget left after the
        held tokens — no Python number that changes from step to step in the ops, one kernel per step, not one
        per layer."""
        counter = self.position_tensor(seen, device)
        key = (key, device)
        got = self._offsets.get(key)
        if got is None or got[0] is not counter or got[1] != seen:
            if got is None and len(self._offsets) >= 16:  # keys of earlier events (a new delta per compression)
                self._offsets = {k: v for k, v in self._offsets.items() if v[1] == seen}
            got = self._offsets[key] = (counter, seen, make(counter))
        return got[2]

    def held_mask(self, name: str, width: int, held: int, slot: torch.Tensor | None, rows: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An additive mask [rows, 1, width]: 0 on the first ``held`` slots, -inf on the rest — for a policy that
        attends over a buffer of fixed width whose slots fill one per decode step (the free ones masked, so that
        consecutive steps have the same shapes). Shared by every layer that asks for the same ``name`` and width in
        a step (their buffers are laid out alike): the step's new slot (``slot``, the device tensor [1] of the slot
        ``held - 1``) is opened by one ``index_fill_`` per step for all the layers, not one per layer; any other
        change of ``held`` remakes it (an event step)."""
        key = (name, width, rows, dtype, device)
        got = self._masks.get(key)
        if got is not None and got[1] == held - 1 and slot is not None:
            got[0].index_fill_(2, slot, 0.0)
            got[1] = held
        elif got is None or got[1] != held:
            if len(self._masks) >= 8:  # layouts of earlier events
                self._masks.clear()
            mask = torch.zeros(rows, 1, width, dtype=dtype, device=device)
            mask[..., held:] = float("-inf")
            got = self._masks[key] = [mask, held]
        return got[0]

    def position_holds(self, counter: torch.Tensor, seen: int) -> bool:
        """Whether ``counter`` (a ``position_tensor``) still holds ``seen``."""
        got = self._position.get(counter.device)
        return got is not None and got[1] is counter and got[0] == seen

    def add_tokens(self, ids) -> None:
        """Announce the ids of the next forward before it runs (``token_ids`` grows by them): a caller holding them
        on the host saves the pre-hook a device-to-host copy of ``input_ids``."""
        self.token_ids.extend(int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids))

    @property
    def seen(self) -> int:
        """Tokens that went through the model so far (the logical length)."""
        return self.stores[0].seen if self.stores else 0

    def before_forward(self, input_ids: torch.Tensor | None, length: int) -> None:
        """Called by ``attach``'s pre-hook before a forward of ``length`` tokens: the first one sets
        ``reference_length`` (unless given) and ``token_ids`` catches up with ``input_ids`` when the caller did not
        announce them (``add_tokens``)."""
        if self.phase == "scratch":
            return
        if self.phase == "prefill" and self.seen == 0 and self._reference_from_prefill and not self._splitting:
            self.reference_length = max(self.reference_length, int(length))
        missing = self.seen + length - len(self.token_ids)
        if missing > 0 and input_ids is not None:
            self.token_ids.extend(int(i) for i in input_ids[0, -missing:].tolist())

    def _note_attended(self) -> None:
        """After a decode forward: tokens (and bytes) read by every layer's last attend (``LayerPolicy.attended``,
        per KV head, averaged over heads; + ``attended_extra``), summed over layers. Counts a policy gives as
        device tensors (or ``DeviceCount``) are kept as they are, per layer, and read with every other pending
        count in one device-to-host copy when something reads them (``attended_tokens``): a decode step adds no
        arithmetic on the device for the harness's bookkeeping."""
        row = []
        for s in self.stores:
            if s._k is None:
                continue
            # entries held besides the store are read as entries too
            row.append((s.policy.attended_count(s), s.policy.attended_extra(), s.token_bytes(),
                        s.n + s.policy.extra_entries()))
        self._attended_pending.append(row)

    def _resolve_attended(self) -> tuple[list[float], list[float], list[float]]:
        if self._attended_pending:
            def parts(x):  # (device tensor or None, scale, offset)
                if isinstance(x, DeviceCount):
                    return x.total, x.scale, x.offset
                return (x, 1.0, 0.0) if torch.is_tensor(x) else (None, 0.0, float(x))

            flat = [t for row in self._attended_pending for c, e, _, _ in row for t in (parts(c)[0], parts(e)[0])
                    if t is not None]
            read = iter(torch.stack([t.detach().double().reshape(()) for t in flat]).tolist() if flat else [])

            def value(x) -> float:
                t, scale, offset = parts(x)
                return offset if t is None else next(read) * scale + offset

            for row in self._attended_pending:
                toks = byts = held = 0.0
                for c, e, tb, h in row:
                    per_head = value(c) + value(e)
                    toks += per_head
                    byts += per_head * tb
                    held += h
                for lst, v in zip(self._attended, (toks, byts, held)):
                    lst.append(float(v))
            self._attended_pending.clear()
        return self._attended

    @property
    def attended_tokens(self) -> list[float]:
        """Per decode forward: held tokens read, summed over layers (per KV head, mean over heads)."""
        return self._resolve_attended()[0]

    @property
    def attended_bytes(self) -> list[float]:
        return self._resolve_attended()[1]

    @property
    def held_token_steps(self) -> list[float]:
        return self._resolve_attended()[2]

    def attended_stats(self, since: int = 0) -> dict:
        """Over the decode forwards from number ``since`` on, the mean per forward of: ``attended_tokens`` (held
        tokens read by attention, per layer: mean over KV heads and layers), ``attended_bytes`` (their keys and
        values, all layers) and ``attended_ratio`` (attended / held entries: the store's tokens plus the policy's
        ``extra_entries``, so a method reading all it holds has 1.0). None when there was no such forward."""
        t, b, h = self.attended_tokens[since:], self.attended_bytes[since:], self.held_token_steps[since:]
        if not t:
            return {"attended_tokens": None, "attended_bytes": None, "attended_ratio": None}
        return {"attended_tokens": sum(t) / len(t) / max(1, len(self.stores)), "attended_bytes": sum(b) / len(b),
                "attended_ratio": sum(t) / sum(h) if sum(h) else None}

    def end_prefill(self) -> None:
        """The context has been prefilled: run prefill-time compression; later forwards are decode steps."""
        if self.phase != "prefill":
            raise RuntimeError("end_prefill() called twice for one prompt")
        self.method.after_prefill(self)
        self.phase = "decode"
        self._note()

    def after_forward(self) -> None:
        """Called once after every model forward through this cache (after the last layer; see ``attach``), in
        the prefill and decode phases; not for a scratch forward. Runs ``KVMethod.after_forward``; after the
        first forward (the prefill, all its chunks) of a cache that is not ``manual``, ends the prefill."""
        if self.phase == "scratch":
            return
        self.method.after_forward(self)
        if self.phase == "prefill" and not self.manual and not self._splitting:
            self.end_prefill()

    @torch.no_grad()
    def scratch_forward(self, ids: list[int] | torch.Tensor, start: int | None = None) -> torch.Tensor:
        """Run ``ids`` through the model at logical positions ``start, start + 1, ...`` (default: right after the
        declared context, ``reference_length``) over what the cache holds, then drop their keys/values: every
        store gets back its length and logical length. During it ``phase == "scratch"``: policies can read the
        queries in ``attend`` (question-aware scoring); ``after_step`` / ``after_forward`` are not called.
        Returns the last position's logits."""
        if self.model is None:
            raise RuntimeError("scratch_forward needs a cache made by new_cache(model, method)")
        start = self.reference_length if start is None else int(start)
        saved = [(s.n, s.seen) for s in self.stores]
        phase, self.phase = self.phase, "scratch"
        for s in self.stores:
            s.seen = start  # transformers derives the new tokens' positions (RoPE) from the logical length
        try:
            x = torch.as_tensor(ids, device=self.model.device).view(1, -1)
            logits = self.model(input_ids=x, past_key_values=self, use_cache=True, logits_to_keep=1).logits[0, -1]
        finally:
            self.phase = phase
            for s, (n, seen) in zip(self.stores, saved):
                s.n, s.seen = n, seen
        return logits

    def _note(self) -> None:
        # Peak over the decode phase (from the end of the prefill on): during the prefill every method holds the
        # whole context transiently; what a method saves is what it holds while generating.
        if self.phase == "decode":
            self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    # -- component timings (latency_breakdown) ------------------------------------------------------------
    # CUDA runs kernels asynchronously: a host clock around a component measures its launch, not its work. On
    # CUDA a span is a pair of recorded events, resolved (one synchronisation) only when ``timings`` is read —
    # between decode steps — so timing adds no synchronisation inside the forward. Elsewhere: perf_counter.
    # Events cost host time inside the step (64-200 of them per decode step), so on CUDA they are recorded only
    # when the cache was made with ``cuda_events=True`` (or the attribute set before the forward): a latency
    # breakdown was asked for. Without it CUDA spans record nothing and ``timings`` stays empty.
    def mark(self, device: torch.device):
        """A point in time on ``device``'s clock (pair two with ``add_span``): a CUDA event recorded on the
        current stream of ``device`` (not of the current device: ``model.device=cuda:1``), or None on CUDA without
        ``cuda_events``; elsewhere ``time.perf_counter()``."""
        if device.type == "cuda":
            if not self.cuda_events:
                return None
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter()

    def add_span(self, key: str, start, end) -> None:
        """Add the time from mark ``start`` to mark ``end`` to component ``key`` (attention, refinement, ...)."""
        if start is None or end is None:  # CUDA without cuda_events: not timed
            return
        if isinstance(start, float):
            self._timings[key] = self._timings.get(key, 0.0) + (end - start)
        else:
            self._pending.append((key, start, end))

    @contextlib.contextmanager
    def span(self, key: str, device: torch.device):
        """``with cache.span("eviction", store.device): ...`` times the block as component ``key``."""
        start = self.mark(device)
        try:
            yield
        finally:
            if start is not None:
                self.add_span(key, start, self.mark(device))

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per component, summed since the cache was made (or cleared)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for key, start, end in self._pending:
                self._timings[key] = self._timings.get(key, 0.0) + start.elapsed_time(end) / 1000.0
            self._pending.clear()
        return self._timings

    def held_bytes(self) -> int:
        return sum(s.held_bytes() + s.policy.extra_bytes() for s in self.stores)

    def allocated_bytes(self) -> int:
        return sum(s.allocated_bytes() for s in self.stores)

    def full_bytes(self) -> int:
        return sum(s.full_bytes() for s in self.stores)

    def held_tokens(self) -> list[int]:
        return [s.n for s in self.stores]

    def method_report(self) -> dict[str, float]:
        """FAIR and REAL accounting now, for every method: ``fair_entries`` = held tokens + entries held outside
        the store (``LayerPolicy.extra_entries``), mean per layer; ``fair_ratio`` = that over the mean logical
        length; ``real_bytes`` = bytes of everything held (``held_bytes``: store + ``extra_bytes``); plus each
        policy's own ``report`` numbers: ``*_bytes`` summed over layers, the others averaged per layer."""
        stores = [s for s in self.stores if s._k is not None]
        if not stores:
            return {}
        fair = sum(s.n + s.policy.extra_entries() for s in stores) / len(stores)
        seen = sum(s.seen for s in stores) / len(stores)
        out: dict[str, float] = {"fair_entries": fair, "fair_ratio": fair / seen if seen else 0.0,
                                 "real_bytes": float(self.held_bytes())}
        for s in stores:
            for k, v in s.policy.report(s).items():
                out[k] = out.get(k, 0.0) + float(v) / (1 if k.endswith("_bytes") else len(stores))
        return out

    def clone(self) -> "MethodCache":
        import copy

        self.timings  # resolve pending CUDA events (events cannot be copied)
        # deepcopy copies tensors and policy state; the method config is shared (it is immutable).
        memo = {id(self.method): self.method}
        if self.model is not None:
            memo[id(self.model)] = self.model  # the model is shared, never copied
        if self.observer is not None:  # shared, not copied (it is the probe's, not the prompt's state)
            memo[id(self.observer)] = self.observer
        new = copy.deepcopy(self, memo=memo)
        for store in new.stores:  # a weak reference is copied as is: point the copies at the copy
            store.cache = new
        return new


def layer_infos(model: PreTrainedModel) -> list[LayerInfo]:
    """Per-layer facts a policy may use, read from the model config."""
    cfg = model.config.get_text_config()
    n = cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    window = getattr(cfg, "sliding_window", None)
    return [
        LayerInfo(layer_idx=i, num_layers=n, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                  sliding_window=window if types[i] == "sliding_attention" else None, layer_type=types[i])
        for i in range(n)
    ]


def new_cache(model: PreTrainedModel, method: KVMethod, **kwargs) -> MethodCache:
    """A fresh cache for one prompt of ``model`` under ``method`` (keyword arguments: see ``MethodCache``)."""
    return MethodCache(method, layer_infos(model), model, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Attention and mask functions
# ---------------------------------------------------------------------------------------------------------

def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function: query [B, Hq, Lq, D]; key/value as returned by the cache update. The forward's
    ``MethodCache`` arrives in ``kwargs[CACHE_KWARG]`` (put there by ``attach``'s pre-hook)."""
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by luka_bench methods")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    cache = kwargs.get(CACHE_KWARG)
    if cache is None:
        # No method cache in play (use_cache=False, or another cache class): plain causal attention.
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask > -1
        lq, lk = query.shape[2], key.shape[2]
        mask = None
        if lq > 1:
            mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
        out = sdpa(query, key, value, scaling, mask)
        return out.transpose(1, 2).contiguous(), None
    out = run_policy(cache.stores[module.layer_idx], query, scaling)
    return out.transpose(1, 2).contiguous(), None


def run_policy(store: KVStore, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """One layer's method work for one forward, after ``store.update``: ``attend`` (timed), the cache's
    observer if any, then in the decode phase ``after_step`` (timed) and, after the last layer, the peak-bytes
    note. Returns the attention output [B, Hq, Lq, D]."""
    policy, cache = store.policy, store.cache
    if policy.times_itself:
        out = policy.attend(store, query, scaling)
    else:
        with cache.span("attention", query.device):
            out = policy.attend(store, query, scaling)
    if cache.observer is not None:
        cache.observer(store, query, out, scaling)
    if cache.phase == "decode":
        if policy.times_itself or type(policy).after_step is LayerPolicy.after_step:
            policy.after_step(store)
        else:
            with cache.span("eviction", query.device):
                policy.after_step(store)
        if policy.info.layer_idx == policy.info.num_layers - 1:
            store.cache._note()  # once per forward, after the last layer
            store.cache._note_attended()
    store.end_forward()  # before the next step moves the cache's position counter
    return out


def replay_forward(cache: MethodCache, layer_idx: int, key: torch.Tensor, value: torch.Tensor,
                   query: torch.Tensor, scaling: float) -> torch.Tensor:
    """One layer's forward without the model (the fidelity probe's replay): append captured post-RoPE
    ``key``/``value`` [B, Hkv, L, D] to the layer's store and run its policy on ``query`` [B, Hq, L, D] exactly
    as the attention function would. Call it layer by layer for each forward, on a ``manual`` cache, and
    ``cache.end_prefill()`` after the context."""
    store = cache.stores[layer_idx]
    store.update(key, value)
    return run_policy(store, query, scaling)


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
          **kwargs):
    """AttentionMaskInterface function: policies build their own masks (see module docstring)."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise NotImplementedError("luka_bench methods run one unpadded sequence at a time (batch size 1)")
    return None


_registered = False


def register() -> None:
    """Register our attention and mask functions (idempotent; called when a method is attached)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, _attention)
        AttentionMaskInterface.register(ATTN_NAME, _mask)
        _registered = True


@dataclass
class Attached:
    """What ``attach`` yields: the model and method, and fresh caches for them."""

    model: PreTrainedModel
    method: KVMethod
    previous: str

    def new_cache(self, **kwargs) -> MethodCache:
        """A fresh cache for one prompt (keyword arguments: see ``MethodCache``). Passed to ``model(...)`` or
        ``model.generate(..., past_key_values=cache)``, its first forward is the prefill, compressed by the method
        after it; every later forward is a decode step."""
        return new_cache(self.model, self.method, **kwargs)


def _input_of(args, kwargs) -> tuple[torch.Tensor | None, torch.Tensor]:
    ids = kwargs.get("input_ids", args[0] if args else None)
    x = ids if ids is not None else kwargs.get("inputs_embeds")
    if x is None:
        raise ValueError("a forward through a luka_bench cache needs input_ids or inputs_embeds")
    return ids, x


def _before_forward(module, args, kwargs):
    """Forward pre-hook on the model: a forward through a ``MethodCache`` gets the cache as ``CACHE_KWARG``
    (handed down to the attention calls); positions come from the cache (its logical length), never from
    ``position_ids`` derived from an attention mask; a prefill longer than the cache's ``prefill_chunk`` goes
    through the model chunk by chunk (the leading chunks here, the last one as this forward)."""
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, MethodCache):
        return None
    ids, x = _input_of(args, kwargs)
    if x.shape[0] != 1:
        raise ValueError(f"luka_bench methods run one sequence at a time: got a batch of {x.shape[0]}; allowed: 1 "
                         "(generate each prompt with its own cache)")
    kwargs = {**kwargs, CACHE_KWARG: cache}
    kwargs.pop("position_ids", None)  # the cache's logical length gives the positions (kept after eviction)
    kwargs.pop("cache_position", None)
    if cache.phase == "scratch" or cache._splitting:
        return args, kwargs
    n = x.shape[1]
    cache.before_forward(ids, n)
    if cache.phase == "decode" and n == 1 and cache.seen and cache.stores[0].pos_shift == 0:
        # A decode step's position is the cache's device counter (advanced in place, once per step): the model then
        # derives no position of its own (an arange and an add from a Python number, which a captured CUDA graph
        # would bake in), and the layers' appends find the counter already at this step.
        kwargs["position_ids"] = cache.position_tensor(cache.seen, x.device).view(1, 1)
    chunk = cache.prefill_chunk
    if cache.phase != "prefill" or not chunk or n <= chunk or ids is None:
        return args, kwargs
    last = (n - 1) // chunk * chunk  # start of the last chunk, which this forward itself runs
    cache._splitting = True
    try:
        for s in range(0, last, chunk):
            module(input_ids=ids[:, s: s + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        cache._splitting = False
    kwargs["input_ids"] = ids[:, last:]
    return (), kwargs


def _after_forward(module, args, kwargs, output):
    """Forward hook on the model: a forward through a ``MethodCache`` has finished (after the last layer)."""
    cache = kwargs.get("past_key_values")
    if isinstance(cache, MethodCache):
        cache.after_forward()


@contextlib.contextmanager
def attach(model: PreTrainedModel, method: KVMethod, tokenizer=None):
    """Route the model's attention through the method for the duration of the block: every forward of the model
    through one of its caches (``Attached.new_cache``) runs the method, ``model.generate`` included.
    ``tokenizer`` reaches the method through ``KVMethod.bind`` (methods that chunk by token strings need it)."""
    register()
    if tokenizer is not None or method.tokenizer is None:
        method.bind(tokenizer)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    hooks = [model.register_forward_pre_hook(_before_forward, with_kwargs=True),
             model.register_forward_hook(_after_forward, with_kwargs=True)]
    try:
        yield Attached(model, method, previous)
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(previous)
