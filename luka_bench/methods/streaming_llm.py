"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2023).

Keeps the first ``sink`` tokens (attention sinks) and the most recent tokens; everything in between is evicted
physically. Acts at both hook points: once after the context prefill, and after every later step (question
chunk, each generated / teacher-forced token), so the cache never exceeds its capacity. A decode step that puts
the cache one token over moves the new token into the slot of the window's oldest (``KVStore.move_last_into``):
the window's slots are then not in time order (attention does not care; positions move with their tokens).

Budget: a layer holds ``capacity = ceil(budget * max(seen, reference_length))`` tokens, sinks included:
``sink`` sinks + ``capacity - sink`` recent tokens. Every KV head keeps the same tokens (no scores, GQA
irrelevant).

Positions (``positions``): ``original`` (default) — keys are stored after RoPE at the positions they were seen at,
and a new token gets its logical position, so the gap left by evicted tokens stays in the relative distances.
``cache`` — the paper's (§3.2) and its official code's rule ("key pos is the pos in cache"): positions are
assigned inside the cache, the held key at index i sits at position i and a new token at the cache length, so no
distance exceeds the cache size (needed to stream past the trained context). Implemented by re-rotating: after an
eviction the kept window's keys move by minus the number of tokens evicted (``KVStore.rotate_keys``; RoPE
rotations compose), and the store tells transformers the cache length as the next position (``set_next_position``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from luka_bench.methods.base import KVMethod, LayerInfo, LayerPolicy, MethodConfigError, setting
from luka_bench.methods.scorer import ScorerPolicy

POSITIONS = ("original", "cache")


class StreamingPolicy(ScorerPolicy):
    """The prefill eviction on the scorer base (sinks and the recent window protected: nothing is scored); the
    decode steps' eviction is ``_evict``."""

    moves_tokens_every_step = True  # an eviction per decode step

    def __init__(self, method, info):
        super().__init__(method, info)
        self.in_order = True  # held tokens in time order (false once a decode step moved one: ``move_last_into``)

    def _evict(self, store) -> None:
        cap = self.capacity(store)
        if store.n <= cap:
            return
        sink = min(self.method.sink, cap)
        before = store.n
        if before == cap + 1 and cap > sink and self.method.positions == "original":
            # one token over (a decode step): the oldest of the window leaves and the newest, in the last slot,
            # takes its place. One argmin over the window's positions and fixed-size copies (issue 36: no shift of
            # the window, no host sync); the window's slots stop being in time order, which attention ignores.
            # positions=cache keeps the window in time order: the key at cache index i sits at position i
            oldest = store.positions_before(before - 1)[0, 0, sink:].argmin().view(1)
            store.move_last_into(oldest, sink)
            self.in_order = False
        elif self.in_order:
            store.keep_ends(sink, cap - sink)
        else:  # several tokens over after decode steps moved some: keep the sinks and the newest, in time order
            order = store.positions[0, 0].argsort()
            store.keep(torch.cat([order[:sink], order[before - (cap - sink):]]))
            self.in_order = True
        if self.method.positions == "cache":
            self._shift_positions(store, before)

    # -- stacked rows of a batch (``stacked.py``): exact attention, then each row's oldest of the window --------------
    stacked_evict = True
    stacked_free_position = torch.iinfo(torch.long).max  # a free slot is never the oldest: no mask for the victims
    # the step's slot is never the oldest either (a free slot's position until a row keeps its token there): its
    # position written where the token ends up only, as alone
    stacked_slot_position = False
    # a step where some rows keep their token and others drop one: the keeping rows' slots marked -1 (the least
    # position of all: their own slot is then their victim, the token stays), the dropping rows' the free position
    # (``stacked_slot_positions``: one write, where a `where` after the victims and an offset made them before)

    # every layer holds the same tokens (no scores): layers stacked from the same positions share their victims
    stacked_same_tokens = True

    def _shared_victims(self, layer):
        """The key under which the layers whose rows hold the same positions (``layer.lineage``) choose this step's
        victims once, or None (this layer's own)."""
        if layer.lineage is None:
            return None
        return ("streaming_victims", layer.lineage, tuple(layer.plans), tuple(layer.ns), layer.cap,
                layer.kv.shape[2])

    def stacked_slot_positions(self, layer):
        plans = layer.plans
        if all(plans) or not any(plans):
            return None
        key = self._shared_victims(layer)
        if key is not None and layer.stack.made(key):  # the victims chosen already (the marks are read there only)
            return None
        return layer.stack.constant([self.stacked_free_position if p else -1 for p in plans], torch.long,
                                    layer.pos.device)[:, None]

    def stacked_plan(self, store):
        if self.method.positions != "original":
            return None
        cap = self.capacity(store)
        if store.n <= cap:
            return False
        return True if store.n == cap + 1 and cap > min(self.method.sink, cap) else None

    def stacked_victims(self, layer):
        """``_evict``'s victim for every row: the oldest held token after the sinks (free slots never: their position
        in the stack is the largest int64, ``stacked_free_position``); a row that keeps its token: its own slot (marked
        -1, ``stacked_slot_positions``), counted from its sinks where it lies after them, else from slot 0. Chosen once
        per step for the layers whose rows hold the same positions (``stacked_same_tokens``): one argmin, and the
        marks written in the first such layer only."""
        key = self._shared_victims(layer)
        if key is None:
            return self._victims(layer)
        return layer.stack.memo(key, lambda: self._victims(layer))

    def _victims(self, layer):
        b = layer.layout.rows.shape[0]
        rows = []
        for s, plan in zip(layer.stores, layer.plans):
            sink = min(self.method.sink, self.capacity(s))
            rows.append(sink if plan or s.n - 1 >= sink else 0)  # (a keeping row's own slot is its n - 1)
        pos = layer.pos[:, 0]
        if len(set(rows)) == 1:
            sink = rows[0]
            return pos[:, sink:].argmin(-1)[:, None].expand(b, layer.kv.shape[2]), sink
        # rows whose capacity is below the sinks (tiny budgets) keep fewer; a keeping row within its sinks (a prompt
        # of a few tokens) reads from slot 0
        lo = layer.stack.constant(rows, torch.long, pos.device)[:, None]
        pos = pos.masked_fill(torch.arange(pos.shape[1], device=pos.device)[None, :] < lo, torch.iinfo(torch.long).max)
        return pos.argmin(-1)[:, None].expand(b, layer.kv.shape[2])

    def stacked_note(self, store, evicted: bool) -> None:
        if evicted:
            self.in_order = False

    def _shift_positions(self, store, before: int) -> None:
        """positions=cache: the window moves down by the tokens evicted (re-rotated keys, the store's shift)."""
        store.rotate_keys(min(self.method.sink, store.n), store.n, store.n - before)
        store.set_next_position(store.n)

    def protected(self, store, cap: int) -> tuple[int, int]:
        sink = min(self.method.sink, cap)
        return sink, cap - sink

    def after_prefill(self, store) -> None:
        before = store.n
        if self.compress(store) and self.method.positions == "cache":
            self._shift_positions(store, before)

    def after_step(self, store) -> None:
        self._evict(store)


@dataclass
class StreamingLLM(KVMethod):
    """sink: number of initial tokens always kept (paper: 4); positions: original (keys keep the positions they
    were seen at) | cache (positions inside the cache, the paper's and its official code's rule)."""

    sink: int = setting(4, at_least=0, note="paper: 4")
    positions: str = setting("original", choices=POSITIONS)

    name: ClassVar[str] = "streaming_llm"
    policy_class: ClassVar[type[LayerPolicy]] = StreamingPolicy

    def check_layer(self, info: LayerInfo) -> None:
        if self.positions == "cache" and info.sliding_window is not None:
            # transformers takes every layer's positions from one length; a sliding layer's own keys would need
            # the same shifts
            raise MethodConfigError("method.positions=cache is not supported on models with sliding-window layers "
                                    "(e.g. gemma3); allowed there: original")
