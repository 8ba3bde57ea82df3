"""The scorer base: a prefill method that only says how to score the held tokens.

As kvpress's ``ScorerPress`` does for its presses, ``ScorerPolicy`` does the rest once for every such method: after
the context prefill, a layer over its capacity (``capacity = ceil(budget * max(seen, reference_length))``, the
budget rule of ``base``) keeps

    its first ``sinks`` tokens  +  the ``capacity - sinks - recent`` best-scored tokens in between  +  its last ``recent``

per KV head (``protected(store, capacity)`` gives ``(sinks, recent)``; both default to 0), in time order; ties go to the
earlier token (``attention.top_indices``); the others are dropped from the store (``KVStore.keep``: memory freed).

Head-wise budgets: ``head_capacities(store, capacity)`` may give each KV head its own count [B, Hkv] (a layer's
budget split across its heads, as AdaKV); each head then keeps its own sinks + recent + best-scored tokens, the
store's width is the longest head's, and attention and every memory figure count what each head holds.

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

    def head_capacities(self, store: Store, cap: int) -> torch.Tensor | None:
        """Head-wise budgets: the tokens each KV head keeps [B, Hkv] (sinks and recent included; a layer's budget
        split across its heads, as AdaKV's), or None (the default): every head keeps ``cap``."""
        return None

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
        caps = self.head_capacities(store, cap)
        if caps is not None:
            caps = torch.as_tensor(caps, device=dev).long().clamp(sinks + recent, n)
            if bool((caps != cap).any()):  # one host read, at the prefill: heads keep different numbers of tokens
                self._keep_heads(store, caps - sinks - recent, sinks, recent)
                return True
        if chosen <= 0:  # nothing scored: every head keeps the same tokens, its first and its last (positions as runs)
            store.keep_ends(sinks, recent)
            return True
        b, h = store.keys.shape[:2]
        top = sinks + top_indices(self.score(store, sinks, n - recent), chosen)
        parts = [torch.arange(sinks, device=dev).expand(b, h, sinks), top,
                 torch.arange(n - recent, n, device=dev).expand(b, h, recent)]
        store.keep(torch.cat([p for p in parts if p.shape[-1]], dim=-1))
        return True

    def _keep_heads(self, store: Store, chosen: torch.Tensor, sinks: int, recent: int) -> None:
        """Each KV head keeps its sinks, its recent window and its own ``chosen`` [B, Hkv] best-scored tokens (the
        first of a stable descending sort, as ``top_indices``), in time order; a head keeping fewer than the most
        fills the rest with slot 0, which it does not hold (``KVStore.keep_heads``)."""
        n, dev = store.n, store.device
        b, h = store.keys.shape[:2]
        most = int(chosen.max())
        scores = self.score(store, sinks, n - recent)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :most]
        mine = torch.arange(most, device=dev) < chosen[..., None]  # [B, Hkv, most]: the head's own picks
        spare = scores.shape[-1] + torch.arange(most, device=dev)  # sorts after every real index
        key = torch.where(mine, order, spare).sort(dim=-1).values
        held = key < scores.shape[-1]
        parts = [torch.arange(sinks, device=dev).expand(b, h, sinks), sinks + torch.where(held, key, 0),
                 torch.arange(n - recent, n, device=dev).expand(b, h, recent)]
        flags = [torch.ones(b, h, sinks, dtype=torch.bool, device=dev), held,
                 torch.ones(b, h, recent, dtype=torch.bool, device=dev)]
        store.keep_heads(torch.cat(parts, dim=-1), torch.cat(flags, dim=-1))
