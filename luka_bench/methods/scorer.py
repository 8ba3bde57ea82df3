"""The scorer base: a prefill method that only says how to score the held tokens.

As kvpress's ``ScorerPress`` does for its presses, ``ScorerPolicy`` does the rest once for every such method: after
the context prefill, a layer over its capacity (``capacity = ceil(budget * max(seen, reference_length))``, the
budget rule of ``base``) keeps

    its first ``sinks`` tokens  +  the ``capacity - sinks - recent`` best-scored tokens in between  +  its last ``recent``

per KV head (``protected(store, capacity)`` gives ``(sinks, recent)``; both default to 0), in time order; ties go to the
earlier token (``attention.top_indices``); the others are dropped from the store (``KVStore.keep``: memory freed).

A method on it writes ``score(store, start, stop)``: a score per KV head for the held tokens ``start:stop``
([B, Hkv, stop - start], higher = kept; GQA: aggregate the query heads of a group), reading what it needs from the
store (keys, values, positions, per-token state it gathered in ``attend``). KNorm (``knorm.py``) is the smallest
example; SnapKV scores with its observation window, H2O with the attention mass of the prefill, StreamingLLM with
nothing (everything it keeps is protected).
"""
from __future__ import annotations

import torch

from .attention import top_indices
from .base import LayerPolicy, Store


class ScorerPolicy(LayerPolicy):
    """A policy that compresses once after the prefill by a per-token score (see the module docstring). Layer-local:
    in the forward that ends the prefill each layer compresses right after its attention."""

    layer_local_prefill = True

    def protected(self, store: Store, cap: int) -> tuple[int, int]:
        """(sinks, recent): tokens kept at the start and at the end whatever their score, at capacity ``cap``."""
        return 0, 0

    def score(self, store: Store, start: int, stop: int) -> torch.Tensor:
        """Scores [B, Hkv, stop - start] of the held tokens ``start:stop`` (higher = kept)."""
        raise NotImplementedError(f"{type(self).__name__} must define score()")

    def after_prefill(self, store: Store) -> None:
        self.compress(store)

    def compress(self, store: Store) -> bool:
        """Keep the protected tokens and the best-scored rest up to the capacity; False when nothing was over it."""
        cap, n = self.capacity(store), store.n
        if n <= cap:
            return False
        sinks, recent = self.protected(store, cap)
        sinks = min(sinks, cap)
        recent = min(recent, cap - sinks)
        chosen = cap - sinks - recent
        dev = store.device
        if chosen <= 0:  # nothing scored: every head keeps the same tokens (one index for all)
            store.keep(torch.cat([torch.arange(sinks, device=dev), torch.arange(n - recent, n, device=dev)]))
            return True
        b, h = store.keys.shape[:2]
        top = sinks + top_indices(self.score(store, sinks, n - recent), chosen)
        parts = [torch.arange(sinks, device=dev).expand(b, h, sinks), top,
                 torch.arange(n - recent, n, device=dev).expand(b, h, recent)]
        store.keep(torch.cat([p for p in parts if p.shape[-1]], dim=-1))
        return True
