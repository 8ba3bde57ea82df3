"""One layer's KV storage (torch only): ``KVStore`` holds the keys and values a layer keeps, the logical position of
every held token and the policy's per-token state, and gives a policy the operations it evicts, moves and reads
tokens with. ``luka_bench.methods.hf`` makes it a transformers cache layer (``CacheLayer``) without adding state.
"""
from __future__ import annotations

import weakref

import torch

from .base import LayerPolicy
from . import packed as packed_store, rope
from .attention import kv_rows
from .packed import UNHELD, PackedHeads  # UNHELD: True on a slot its head does not hold (``keep_heads``)
from .protocols import PromptCache
from .positions import LazyPositions, write_position




def _stackable(k: torch.Tensor, v: torch.Tensor) -> bool:
    return k.shape == v.shape and k.dtype == v.dtype and k.device == v.device


def _rows(t: torch.Tensor, flat: torch.Tensor, m: int) -> torch.Tensor:
    """``t[b, h, index[b, h, i]]`` for storage t [B, Hkv, cap, ...] (contiguous), ``flat`` the row ids of ``index``
    [B, Hkv, m] in t flattened to [B * Hkv * cap, ...] (``KVStore._flat``): one index_select, [B, Hkv, m, ...]."""
    b, h, cap = t.shape[:3]
    return t.reshape(b * h * cap, *t.shape[3:]).index_select(0, flat).view(b, h, m, *t.shape[3:])


class KVStore:
    """One layer's KV cache: keys/values [B, Hkv, n, D] in pre-allocated storage that grows geometrically (no
    O(N) ``torch.cat`` per decode step), the logical position of every held token [B, Hkv, n], and the layer's
    policy. ``seen`` is the logical length (tokens that went through the layer), ``n`` the physical one."""

    # capacity factor when full (+ 16 slots): 1/16 more than held, so a cache that grows by decode steps after its
    # prefill holds ~6 % unused, not 25 % (a reallocation every ~n/16 steps copies n slots: 16 per step, amortised);
    # storage shrinks when an eviction frees more than half
    GROWTH = 1.0625
    PACK_HEADS = True  # head-wise budgets packed (``pack``); False: the classic layout (the tests' reference)

    def __init__(self, policy: LayerPolicy, cache: "PromptCache"):
        # keys/values are views of the storage (properties below), never attributes
        self.is_initialized = False
        self.policy = policy
        self.cache = cache  # held weakly (the property below): a store must not keep its cache alive
        self.is_sliding = policy.info.sliding_window is not None
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        # keys and values in one tensor [2, B, Hkv, cap, D] (``_k``/``_v`` are its halves) where their shapes and
        # dtypes agree: a token moved inside the cache is then one copy, not two (``move_last_into``)
        self._kv: torch.Tensor | None = None
        # the logical position of every held token, written lazily (``positions.LazyPositions``: no table while no
        # token moved; a decode step's and a run's positions pending until read)
        self._positions = LazyPositions()
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
        # head-wise budgets (``keep_heads``): a KV head may hold fewer tokens than the store's n; the slots it does
        # not hold are masked out of attention (``head_mask``) and left out of every count. ``_unheld``: those slots
        # over all batch rows and heads (a host number, known when they were made); 0 = every head holds n
        self._unheld = 0
        self.compressed_in_forward = False  # the policy's after_prefill ran inside the prefill's last forward
        self.pos_shift = 0  # seen - the position the next token gets (StreamingLLM's positions=cache); 0: logical
        # what an evicting stack that let this row go knew of its positions (``stacked.same_tokens_lineage``)
        self.stacked_lineage: tuple | None = None
        self.packed: PackedHeads | None = None  # head-wise budgets packed (``pack``): then ``_k``, ``_v``, ``_kv`` None

    # The cache owns its stores; a strong reference back would make every cache a reference cycle, freed only by
    # Python's cyclic garbage collector, which runs on object counts, not bytes: a run answering 200 questions
    # from cache clones kept ~150 MB per clone alive and was killed for memory at 21 GB. ``MethodCache.clone``
    # points the copied stores at the copy.
    @property
    def cache(self) -> "PromptCache":
        cache = self._cache_ref()
        if cache is None:
            raise RuntimeError("this KVStore's MethodCache was dropped: keep the cache alive while its stores are used")
        return cache

    @cache.setter
    def cache(self, cache: "PromptCache") -> None:
        self._cache_ref = weakref.ref(cache)

    # -- views ---------------------------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.view(self.seen)["keys"]
        return self._k[:, :, : self.n]

    @keys.setter
    def keys(self, value):  # CacheLayerMixin API compatibility (never used to replace storage)
        if value is not None:
            raise AttributeError("KVStore.keys is a view; use append/keep")

    @property
    def values(self) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.view(self.seen)["values"]
        return self._v[:, :, : self.n]

    @values.setter
    def values(self, value):
        if value is not None:
            raise AttributeError("KVStore.values is a view; use append/keep")

    @property
    def positions(self) -> torch.Tensor:
        """Logical position of each held token, [B, Hkv, n] (int64)."""
        if self.packed is not None:
            return self.packed.view(self.seen)["positions"]
        return self._positions.read(self.n, self._k, self._due_cache())

    def positions_before(self, stop: int) -> torch.Tensor:
        """Positions of the held tokens in slots ``:stop`` (``stop < n``), without writing a decode step's pending
        position (the last slot's): for an eviction that moves that token and writes its position where it lands."""
        self.unpack()
        return self._positions.before(stop, self.n, self._k)

    def _due_cache(self) -> "PromptCache | None":
        """The cache, where a decode step's position is pending (its counter is the cache's): only then is it read, so
        that a store whose cache was dropped still gives its positions (``cache`` raises)."""
        return self.cache if self._positions.due is not None else None

    def settle_positions(self) -> None:
        """Write every pending position (``LazyPositions.settle``)."""
        self._positions.settle(self.n, self._k, self._due_cache())

    def end_forward(self) -> None:
        """The layer's forward is over: a decode step's pending position joins the run of unwritten positions when it
        continues it — no kernel — and is written otherwise (``LazyPositions.end_forward``)."""
        if self.packed is None and self._positions.due is not None:
            self._positions.end_forward(self.n, self.policy.moves_tokens_every_step, self._k, self.cache)

    def aux(self, name: str, dtype: torch.dtype = torch.float32, zero_new: bool = True,
            whole: bool = False) -> torch.Tensor:
        """A per-held-token tensor [B, Hkv, n] owned by the policy (e.g. accumulated attention mass). It is
        created zero-filled on first use and ``keep``/``keep_ends``/``evict_into`` move it with the keys. New
        tokens get 0 — unless it was created with ``zero_new=False``: then the policy writes every new token's
        entry itself in the forward that appended it (one kernel fewer per step where it writes them anyway).
        ``whole``: the whole capacity [B, Hkv, cap] (entries from n on are 0 and must stay 0: a policy that adds
        over a fixed span, so that its steps have the same shapes, adds 0 there)."""
        self.unpack()
        if name not in self._aux:
            b, h, cap = self._k.shape[:3]
            self._aux[name] = torch.zeros(b, h, cap, dtype=dtype, device=self._k.device)
            if not zero_new:
                self._aux_unzeroed.add(name)
        return self._aux[name] if whole else self._aux[name][:, :, : self.n]

    @property
    def device(self) -> torch.device:
        return self.packed.kv.device if self.packed is not None else self._k.device

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
        # positions only where some were written (otherwise the pending run and decode step stay valid: no slot moves)
        pos = None
        if self._positions.table is not None:
            pos = torch.empty(b, h, cap, dtype=torch.long, device=like_k.device)
            self.settle_positions()
        if self._k is not None and self.n:
            k[:, :, : self.n] = self.keys
            v[:, :, : self.n] = self.values
            if pos is not None:
                pos[:, :, : self.n] = self.positions
        for name, a in self._aux.items():
            new = torch.zeros(b, h, cap, dtype=a.dtype, device=a.device)
            new[:, :, : self.n] = a[:, :, : self.n]
            self._aux[name] = new
        self._k, self._v, self._kv = k, v, kv
        self._positions.table = pos
        self._aux_zero_from = self.n

    def _set_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """New storage holding exactly ``k``/``v`` [B, Hkv, m, D] (stacked where they can be)."""
        if _stackable(k, v):
            self._kv = torch.stack([k, v])
            self._k, self._v = self._kv[0], self._kv[1]
        else:
            self._kv, self._k, self._v = None, k.contiguous(), v.contiguous()

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        L = key_states.shape[2]
        if self.packed is not None:
            packed_store.append_store(self, key_states, value_states)
            return
        self.end_forward()  # a previous decode step's position, if its forward did not end through run_policy
        need = self.n + L
        if self._k is None or need > self._k.shape[2]:
            cap = need if self._k is None else max(need, int(self._k.shape[2] * self.GROWTH) + 16)
            a = self.policy.storage_multiple
            cap = -(-cap // a) * a  # whole pages (``LayerPolicy.storage_multiple``)
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
        # a decode step's position is the cache's counter (no Python number); a run's is written when read or moved
        self._positions.append(self.n, L, self.seen, self._k, self.cache)
        if self.n < self._aux_zero_from:  # slots a removal left stale
            for name, a in self._aux.items():
                if name not in self._aux_unzeroed:
                    a[:, :, self.n : need] = 0
        self._aux_zero_from = max(self._aux_zero_from, need)
        self.n = need
        self.seen += L

    def keep_heads(self, index: torch.Tensor, held: torch.Tensor) -> None:
        """Head-wise budgets: keep, per KV head, the tokens at ``index`` [B, Hkv, m] whose entry of ``held`` (bool, same
        shape) is True (a head holding fewer fills its other entries with any slot), then pack them (``pack``: storage
        as wide as what the heads hold; attention, ``head_mask`` and every count read each head's own tokens). One
        host read of the count (a prefill-time compression, not a decode step)."""
        self.keep(index)
        unheld = ~held
        self.aux(UNHELD, dtype=torch.bool)[:, :, : self.n] = unheld
        self._unheld = int(unheld.sum())
        if not self._unheld:  # every head holds the same tokens' count: classic storage, no flags to keep
            self._aux.pop(UNHELD)
        self.pack()

    def unhold(self, start: int, stop: int, heads: torch.Tensor, count: int) -> None:
        """Head-wise budgets without moving a token: the heads flagged in ``heads`` [B, Hkv] (bool) stop holding the
        slots ``start:stop`` (masked out of their attention, left out of every count, as ``keep_heads``'s unheld
        slots); ``count`` is the number of flagged heads over all batch rows (a host number the caller knows: no
        read of ``heads``). One in-place op, no host sync; the slots stay allocated until the policy calls ``pack``."""
        self.unpack()
        if stop <= start:
            return
        unheld = self.aux(UNHELD, dtype=torch.bool)
        unheld[:, :, start:stop] |= heads[:, :, None]
        self._unheld += (stop - start) * count

    def head_mask(self) -> torch.Tensor | None:
        """[B, Hkv, n] bool, True where the head holds the slot; None when every head holds all n (no head-wise
        budget in play): attention then needs no mask for it."""
        if self.packed is not None:
            return self.packed.view(self.seen)["mask"]
        return None if not self._unheld else ~self.aux(UNHELD, dtype=torch.bool)

    def held_per_head(self) -> float:
        """Tokens held per KV head, mean over batch rows and heads (``n`` unless head-wise budgets differ)."""
        if self.packed is not None:
            return self.packed.held_total(self.seen) / (self.packed.B * self.packed.H)
        if not self._unheld:
            return float(self.n)
        b, h = self._k.shape[:2]
        return self.n - self._unheld / (b * h)

    def keep(self, index: torch.Tensor, runs: tuple[tuple[int, int], ...] | None = None) -> None:
        """Keep only the held tokens at ``index`` (into the current ``n`` tokens): [m] for all heads alike, or
        [B, Hkv, m] per KV head. Order is preserved as given; pass sorted indices to keep time order. Storage
        is reallocated (memory actually freed) as ``_shrinks`` says. ``runs``: a 1-D ``index``
        described as runs of consecutive tokens ((start, stop), ...) in its order (``keep_ends``): the positions
        are then kept as runs, no tensor."""
        self.unpack()
        # the kept positions from the index alone where no position was written yet (``LazyPositions.plan_keep``)
        pos, shared = self._positions.plan_keep(index, runs, self.n, self._k, self._due_cache())
        if index.dim() == 1:
            m = index.numel()
            k, v = self.keys.index_select(2, index), self.values.index_select(2, index)
            if pos is None and shared is None:
                pos = self.positions.index_select(2, index)
            aux = {name: a[:, :, : self.n].index_select(2, index) for name, a in self._aux.items()}
        else:  # per KV head: one row gather from each storage (torch.gather over an expanded index is ~6x slower)
            m = index.shape[-1]
            flat = self._flat(index)
            k, v = _rows(self._k, flat, m), _rows(self._v, flat, m)
            if pos is None:
                pos = _rows(self._positions.table, flat, m)
            aux = {name: _rows(a, flat, m) for name, a in self._aux.items()}
        if self._shrinks(m):
            self._set_kv(k, v)
            self._positions.table = pos.contiguous() if shared is None else None
            self._aux = {name: a.contiguous() for name, a in aux.items()}
            self._aux_zero_from = m  # the new storage holds exactly the kept tokens
        else:
            self._k[:, :, :m] = k
            self._v[:, :, :m] = v
            if shared is None:
                self._positions.materialize(self._k)
                self._positions.table[:, :, :m] = pos
            for name, a in aux.items():
                self._aux[name][:, :, :m] = a
        self._positions.shared = shared
        self.n = m
        self._recount_unheld()

    def _shrinks(self, m: int) -> bool:
        """Whether a keep of ``m`` tokens gets storage of its own (the memory freed): when it frees more than half the
        storage, or outside the decode phase when more free slots would be left than ``declared_room`` (a decode
        step's keep keeps its storage: no copy per step)."""
        return m < self._k.shape[2] // 2 or self._frees_room(m)

    def _frees_room(self, m: int) -> bool:
        """Outside the decode phase: keeping ``m`` tokens would leave more free slots than ``declared_room``."""
        if self._cache_ref() is None or self.cache.phase == "decode":
            return False
        return self._k.shape[2] - m > self.declared_room(m)

    def _recount_unheld(self) -> None:
        """Head-wise budgets: the slots a head does not hold moved with the kept ones; count them again (a host read:
        only a store that has such slots pays it)."""
        if self._unheld:
            self._unheld = int(self._aux[UNHELD][:, :, : self.n].sum())

    def evict_into(self, slot: torch.Tensor, sources: dict[str, torch.Tensor] | None = None,
                   may_be_last: bool = False) -> None:
        """Drop one held token per row and KV head, ``slot`` [B, Hkv] (int64, before the last; ``may_be_last``: or
        the last), by moving the newest (the last slot) into it: one indexed write per storage tensor (keys and values
        as one, the position, each aux — from ``sources[name]`` [B, Hkv] where given) and ``n`` shrinks by one. No
        shift, no host sync; slots leave time order (positions move with their tokens: read ``positions``)."""
        self.unpack()
        P = self._positions
        P.settle_run(self.n, self._k)
        n = self.n
        bi, hi = self.head_index()
        index = (bi, hi, slot)
        due, P.due = P.due, None
        sources = sources or {}
        named = {id(a): name for name, a in self._aux.items()}
        for t, ax in self._token_tensors():
            rows = t.movedim(0, 3) if ax == 3 else t  # stacked K/V [2, B, H, cap, D] -> [B, H, cap, 2, D]
            # through a view that ends before the source slot (``may_be_last``: the newest, copied first, onto itself)
            window = rows.narrow(2, 0, n if may_be_last else n - 1)
            if t is P.table and due is not None:  # a decode step's token: its position goes straight there
                counter, seen = due
                if not self.cache.position_holds(counter, seen):
                    counter = torch.full((), seen, dtype=torch.long, device=t.device)
                window.index_put_(index, counter.expand(slot.shape))
            elif named.get(id(t)) in sources:
                window.index_put_(index, sources[named[id(t)]])
            else:
                src = rows.select(2, n - 1)
                window.index_put_(index, src.clone() if may_be_last else src)
        self.n = n - 1
        self._recount_unheld()

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
        stacked tensor where they are: one copy for both), positions (settled by the caller first), each aux."""
        kv = [(self._kv, 3)] if self._kv is not None else [(self._k, 2), (self._v, 2)]
        return [*kv, (self._positions.table, 2), *((a, 2) for a in self._aux.values())]

    def move_last_into(self, slot: torch.Tensor, start: int = 0, may_be_last: bool = False) -> None:
        """Drop the held token at slot ``start + slot`` (``slot``: a one-element int64 device tensor, all heads
        alike; the slot before the last) by moving the newest held token, the last slot, into it: one copy of its
        keys and values (stacked storage), one of its position and of each aux; ``n`` shrinks by one. A decode
        step's eviction at a slot the device chose: fixed-size copies, no shift, no host sync. The held tokens are
        no longer in time order; positions (and keys: cached after RoPE) move with their tokens, so attention is
        unchanged, and a policy that needs time order reads ``positions``.

        ``may_be_last``: ``slot`` may also be the last slot itself (the newest token is the one dropped, TOVA's
        decode step): the newest token is copied first (one copy more per storage tensor), so that it can be
        written onto itself; ``n`` shrinking then drops it."""
        self.unpack()
        P = self._positions
        P.settle_run(self.n, self._k)
        n = self.n
        due, P.due = P.due, None
        for t, ax in self._token_tensors():
            # written through a view that ends before the source slot: an in-place copy whose source overlaps
            # its destination is refused (with ``may_be_last`` the view reaches it and the source is a copy)
            window = t.narrow(ax, start, n - start if may_be_last else n - 1 - start)
            if t is P.table and due is not None:  # a decode step's token: its position goes straight there
                write_position(window, due, self.cache, slot)
            else:
                src = t.narrow(ax, n - 1, 1)
                window.index_copy_(ax, slot, src.clone() if may_be_last else src)
        self.n = n - 1
        self._recount_unheld()

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the held tokens at ``index`` [B, Hkv, m] (per KV head; any order, repeats allowed):
        ([B, Hkv, m, Dk], [B, Hkv, m, Dv]). One row gather from the storage (much faster than ``torch.gather``
        with an index expanded over the head dimension)."""
        return self.gather_flat(self._flat(index), index.shape[-1])

    def gather_flat(self, flat: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``gather`` for row ids already in the flattened storage (index + ``row_offsets()``, flattened; [B * Hkv
        * m]), for a policy that builds them in fewer ops on its per-step path (stored stacked: ``kv_rows``)."""
        rows = self.gather_stacked(flat, m)
        if rows is not None:
            return rows[0], rows[1]
        return _rows(self._k, flat, m), _rows(self._v, flat, m)

    def gather_stacked(self, flat: torch.Tensor, m: int) -> torch.Tensor | None:
        """``gather_flat``'s keys and values as one tensor [2, B, Hkv, m, D] (one copy moves both), or None."""
        kv = self.kv_flat()
        return None if kv is None else kv_rows(kv, flat).view(2, *self._k.shape[:2], m, kv.shape[-1])

    def kv_flat(self) -> torch.Tensor | None:
        """Keys and values as rows of one tensor [2, B * Hkv * cap, D], or None where they are stored apart."""
        self.unpack()
        return None if self._kv is None else self._kv.view(2, -1, self._kv.shape[-1])

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
        self.unpack()
        return self._k, self._v

    def stacked(self, start: int, stop: int) -> torch.Tensor | None:
        """Keys and values of the held slots ``start:stop`` as one view [2, B, Hkv, stop - start, D] of the stacked
        storage (one copy moves both), or None where they are stored apart (their shapes or dtypes differ)."""
        self.unpack()
        return None if self._kv is None else self._kv[:, :, :, start:stop]

    def pages(self, start: int, size: int) -> torch.Tensor | None:
        """The stacked storage from slot ``start`` on as pages of ``size`` slots, keys and values together: a view
        [2, B * Hkv, pages, size * D] (page p of a head: slots start + p * size ...), for a policy that gathers whole
        pages in one kernel; None where keys and values are stored apart."""
        self.unpack()
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
        self.unpack()
        drop_to = self.n - tail
        if drop_to <= head:
            return
        if drop_to - head < self._k.shape[2] // 2 and tail > 0 and not self._frees_room(head + tail):
            # small drop (a decode step): shift the tail left in place, no new tensors of cache size
            self.settle_positions()
            for t, ax in self._token_tensors():
                t.narrow(ax, head, tail).copy_(t.narrow(ax, drop_to, tail).clone())
            self.n = head + tail
            self._recount_unheld()
            return
        index = torch.cat([torch.arange(head, device=self.device),
                           torch.arange(drop_to, self.n, device=self.device)])
        self.keep(index, runs=((0, head), (drop_to, self.n)))

    def pack(self, windows: list[tuple[int, int] | None] | None = None, bias: str | None = None) -> bool:
        """Head-wise budgets: what each head holds into storage of its own width (``packed.pack_store``)."""
        return packed_store.pack_store(self, windows, bias)

    def unpack(self) -> None:
        """Back to the classic layout for an operation the packed storage does not do: ``packed.unpack_store``."""
        packed_store.unpack_store(self)

    def slide_windows(self) -> None:
        """Packed storage with windows: what left a window head's window in this forward stops being held."""
        packed_store.slide_store(self)

    def token_bytes(self) -> int:
        """Bytes of one token's keys and values over all heads of this layer."""
        if self.packed is not None:
            p = self.packed
            return p.B * p.H * 2 * p.kv.shape[-1] * p.kv.element_size()
        b, h, _, dk = self._k.shape
        return b * h * (dk + self._v.shape[-1]) * self._k.element_size()

    def held_bytes(self) -> int:
        """Bytes of keys and values actually held (the live part of the storage; with head-wise budgets, each
        head's own tokens: ``allocated_bytes`` counts the slots a shorter head leaves unused)."""
        if self.packed is not None:
            return self.packed.held_total(self.seen) * self.token_bytes() // (self.packed.B * self.packed.H)
        if self._k is None:
            return 0
        b, h = self._k.shape[:2]
        return (self.n * b * h - self._unheld) * self.token_bytes() // (b * h)

    def allocated_bytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes()
        if self._k is None:
            return 0
        pos = self._positions.nbytes()
        return self._k.nbytes + self._v.nbytes + pos + sum(a.nbytes for a in self._aux.values())

    def declared_room(self, n: int | None = None) -> int:
        """The free slots beyond ``n`` (default: the store's) the growth rule may leave (``append``: 1/16 more + 16
        slots, rounded up to the policy's ``storage_multiple``): the decode headroom a store declares."""
        n = self.n if n is None else n
        return -(-n // 16) + 16 + self.policy.storage_multiple

    def full_bytes(self) -> int:
        """What plain full attention would hold for this layer at the same logical length."""
        if self._k is None and self.packed is None:
            return 0
        w = self.policy.info.sliding_window
        held = self.seen if w is None else min(self.seen, w - 1)
        return held * self.token_bytes()

    # -- the forward's append (transformers' cache-layer API names it ``update``) ----------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.append(key_states, value_states)
        if self.cache.observer is not None:  # the fidelity probe reads what this forward added
            self.last_update = (key_states, value_states)
        if self.packed is not None:  # our attention function reads the packed storage, not these
            return key_states, value_states
        if self.static_slot is not None:
            # transformers hands these to our attention function, which reads the store instead: a static decode
            # step returns the whole storage, so that no view of a step-dependent length is made in the step
            return self.storage()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        # transformers derives the new tokens' positions (RoPE) from it: the logical length, or the position inside
        # the cache when a policy re-assigns positions (pos_shift, with rotate_keys)
        return self.seen - self.pos_shift

    def rotate_keys(self, start: int, stop: int, delta: int | torch.Tensor) -> None:
        """Move the held keys ``start:stop`` (stored after RoPE) by ``delta`` positions in place (one number, or one per
        key [B, Hkv, stop - start]): ``rope.rotate_keys``."""
        self.unpack()
        rope.rotate_keys(self, start, stop, delta)

    def set_next_position(self, position: int) -> None:
        """The next token appended gets logical position ``position`` (transformers' ``cache_position`` follows it:
        ``get_seq_length``), not ``seen``: after ``rotate_keys`` moved the held keys to new positions (StreamingLLM's
        ``positions=cache``, FINCH's ``rerotate``: slot i at position i, the next token at ``n``)."""
        self.pos_shift = self.seen - position

    def rope_cos_sin(self, positions: torch.Tensor, scaled: bool = False) -> tuple[torch.Tensor, ...]:
        """The model's rotary embedding at ``positions`` [1, m]: (cos, sin) [m, rot] fp32, a pure rotation
        (``scaled``: with the model's attention scaling as a third item): ``rope.rope_cos_sin``."""
        return rope.rope_cos_sin(self, positions, scaled)

    def reset(self) -> None:
        self.packed = None
        self._unheld = 0
        self._k = self._v = self._kv = None
        self._positions.reset()
        self._aux = {}
        self._aux_unzeroed = set()
        self._aux_zero_from = 0
        self.n = self.seen = 0
        self.pos_shift = 0
        self.is_initialized = False
