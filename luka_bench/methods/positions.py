"""The logical positions of one store's held tokens, written lazily (torch only): ``LazyPositions``.

A store that never drops or moves a token (full attention) holds no position table at all: every held token's
position is its slot's plus a run's first. Positions exist in four forms, any of which may be pending at once:

- ``table``: the positions' storage [B, Hkv, cap] (int64), the store's capacity wide, allocated only when a position
  must be written;
- ``due``: a decode step's position not yet written to its slot (the last): (the cache's position counter, the value it
  holds) — written when something reads positions or at the end of the layer's forward, unless an eviction moving the
  token writes it straight into its new slot;
- ``run``: decode steps' (or chunks') positions not yet written, as one run (first slot, its position, end slot): the
  slots first..end-1 hold position + (slot - first); consecutive steps of a store that moves no token extend it at no
  cost, and it is written (one arange) when something reads or moves positions;
- ``shared``: while there is no table, after a keep from the untouched state, the positions of slots 0..k-1 as a
  description — for a keep that dropped the same tokens from every head (StreamingLLM's sinks and window, a
  head-independent keep) runs ((first slot, its position, end slot), ...) or one tensor [k]; for a per-head keep
  (SnapKV) one int32 tensor [B, Hkv, k] (half the table's bytes; positions stay below 2**31) — so that a prefill
  compressing each layer holds no [B, Hkv, cap] table while the next layers run. Written into the table when it is
  made; the pending run then starts at slot k.

The store (``store.KVStore``) owns one and calls it with its physical length ``n`` and its keys' storage (``like``:
[B, Hkv, cap, D], whose shape and device the table follows).
"""
from __future__ import annotations

import itertools
from typing import Any

import torch


def write_position(dst: torch.Tensor, due: tuple[torch.Tensor, int], cache: Any,
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


class LazyPositions:
    """One store's positions: the table, the pending decode step, the pending run and the shared description (module
    docstring)."""

    __slots__ = ("table", "due", "run", "shared")

    def __init__(self) -> None:
        self.table: torch.Tensor | None = None
        self.due: tuple[torch.Tensor, int] | None = None
        self.run: tuple[int, int, int] | None = None
        self.shared: tuple[tuple[int, int, int], ...] | torch.Tensor | None = None

    def reset(self) -> None:
        self.table = self.due = self.run = self.shared = None

    def nbytes(self) -> int:
        n = self.table.nbytes if self.table is not None else 0
        return n + (self.shared.nbytes if isinstance(self.shared, torch.Tensor) else 0)

    # -- writing what is pending ------------------------------------------------------------------------------
    def materialize(self, like: torch.Tensor | None) -> None:
        """Allocate the table (the capacity's width) if it is not there, with the shared description written in: the
        pending run and decode step are written by the caller (``settle_run`` / ``settle``)."""
        if self.table is None and like is not None:
            b, h, cap = like.shape[:3]
            self.table = torch.empty(b, h, cap, dtype=torch.long, device=like.device)
            shared, self.shared = self.shared, None
            if isinstance(shared, torch.Tensor):  # [k] or [B, Hkv, k]
                self.table[:, :, : shared.shape[-1]] = shared
            elif shared:
                for first, pos, end in shared:
                    self.table[:, :, first:end] = torch.arange(pos, pos + end - first, device=self.table.device)

    def shared_end(self) -> int:
        """The slots whose positions the shared description holds: 0..this-1."""
        shared = self.shared
        if shared is None:
            return 0
        return shared.shape[-1] if isinstance(shared, torch.Tensor) else max(end for _, _, end in shared)

    def settle_run(self, n: int, like: torch.Tensor | None) -> None:
        """Write the pending run (one arange); whoever reads or moves positions settles first: the table is there
        after."""
        self.materialize(like)
        run, self.run = self.run, None
        if run is not None:
            first, pos, end = run
            end = min(end, n - (self.due is not None))  # a scratch forward's tokens were dropped
            if end > first:
                self.table[:, :, first:end] = torch.arange(pos, pos + end - first, device=self.table.device)

    def settle(self, n: int, like: torch.Tensor | None, cache: Any) -> None:
        """Write every pending position: the run (one arange) and the decode step's (the last slot's), from the cache's
        position counter while it still holds the step's position (one copy, no Python number); after the counter
        moved on (a caller that never ran the layer's attention through ``run_policy``), from the number."""
        self.settle_run(n, like)
        due, self.due = self.due, None
        if due is not None:
            write_position(self.table[:, :, n - 1], due, cache)

    def read(self, n: int, like: torch.Tensor | None, cache: Any) -> torch.Tensor:
        """Every held token's position, [B, Hkv, n] (int64)."""
        self.settle(n, like, cache)
        return self.table[:, :, :n]

    def before(self, stop: int, n: int, like: torch.Tensor | None) -> torch.Tensor:
        """The positions of slots ``:stop`` (``stop < n``), the decode step's pending one (the last slot's) not
        written."""
        assert stop < n or self.due is None
        self.settle_run(n, like)
        return self.table[:, :, :stop]

    # -- what the store's operations do to them ---------------------------------------------------------------
    def end_forward(self, n: int, eager: bool, like: torch.Tensor | None, cache: Any) -> None:
        """The layer's forward is over: a decode step's pending position (its token still in the last slot) joins the
        run when it continues it — no kernel — and is written otherwise (before the next step moves the cache's
        counter), or at once when ``eager`` (a policy that reads or moves positions every step)."""
        due = self.due
        if due is None:
            return
        if eager:
            self.settle(n, like, cache)
            return
        slot, seen = n - 1, due[1]
        run = self.run
        if run is None or (run[2] == slot and run[1] + slot - run[0] == seen):
            self.due = None
            self.run = (slot, seen, slot + 1) if run is None else (run[0], run[1], slot + 1)
        else:
            self.settle(n, like, cache)

    def append(self, n: int, count: int, seen: int, like: torch.Tensor, cache: Any) -> None:
        """``count`` tokens appended at slot ``n`` with the positions from ``seen`` on: a decode step's (count 1) is
        the cache's counter, no Python number; a run's is pending (none written)."""
        if count == 1:
            self.due = (cache.position_tensor(seen, like.device), seen)
            return
        self.append_run(n, count, seen, like)

    def append_run(self, n: int, count: int, seen: int, like: torch.Tensor) -> None:
        """``count`` tokens appended at slot ``n`` with the positions from ``seen`` on, pending as a run (a decode step
        of stacked rows too: ``stacked.py``, no counter of the cache's)."""
        need, run = n + count, self.run
        if run is not None and run[2] == n and run[1] + n - run[0] == seen:
            self.run = (run[0], run[1], need)
        else:
            if self.table is not None or n > self.shared_end():  # slots whose positions are unwritten
                self.settle_run(n, like)
            self.run = (n, seen, need)

    def plan_keep(self, index: torch.Tensor, runs: tuple[tuple[int, int], ...] | None, n: int,
                  like: torch.Tensor, cache: Any) -> tuple[torch.Tensor | None, Any]:
        """Before a keep of ``index`` (``KVStore.keep``): (the kept tokens' positions, their shared description) when
        they follow from the index alone — every position is its slot's plus the run's first, no table written for
        the tokens dropped — else (None, None), every pending position written."""
        run = self.run
        if not (self.table is None and self.due is None and self.shared is None and run is not None
                and run[0] == 0 and run[2] == n):
            self.settle(n, like, cache)
            return None, None
        self.run = None
        if index.dim() == 1 and runs is not None:
            slots = list(itertools.accumulate((stop - start for start, stop in runs), initial=0))
            return None, tuple((a, run[1] + start, z) for (start, _), a, z in zip(runs, slots, slots[1:]) if z > a)
        if index.dim() == 1:
            pos = index.long() + run[1]
            return pos, pos
        if run[2] + run[1] <= torch.iinfo(torch.int32).max:
            pos = index.to(torch.int32, copy=True).add_(run[1])
            return pos, pos
        return index.long() + run[1], None
