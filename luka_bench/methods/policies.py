"""The stock policies every method shares, and which policy runs on a layer.

- ``StaticExactPolicy``: exact attention, graph-ready (the ``full_layers`` of every method);
- ``SlidingWindowPolicy``: exact attention within a sliding window, and only the window held (Gemma3's local
  layers, for a method that does not set ``handles_sliding``);
- ``layer_policy(method, info)``: the policy of one layer — the stock ones above where they apply, the method's own
  (``KVMethod.policy_for_layer``) everywhere else. The cache asks it for every layer, and ``Layered`` for each
  rule's method, so ``full_layers`` and sliding windows mean the same inside a composition as alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernel
from .attention import exact_attention
from .base import KVMethod, LayerInfo, LayerPolicy
from .protocols import DecodeStep, Store


class StaticExactPolicy(LayerPolicy):
    """Exact attention whose decode step reads the store's whole capacity with the free slots masked (one mask per
    cache, opened by one ``index_fill_`` per step for all layers: ``DecodeStep.held_mask``): graph-ready, at the
    price of reading up to ``KVStore.GROWTH`` x the held tokens' keys and values. For the exact layers of a method
    whose other layers are graph-ready (LycheeCluster's ``full_layers``); a layer with a sliding window, a query
    chunk, a step written at a Python slot and the CPU with its kernels on (``cpu_kernel.cpu_fast``: there SDPA over
    the masked storage took 1.3x SDPA over the held tokens at 8K) take ``exact_attention``."""

    static_decode = True
    exact_decode = True  # its ``step`` is exact over the held slots (the free ones masked)

    def step(self, store: "Store", query: torch.Tensor, scaling: float, step: DecodeStep) -> torch.Tensor:
        slot = step.slot(store)
        if slot is None or self.info.sliding_window is not None or \
                cpu_kernel.cpu_fast(query.device):  # CPU SDPA with a mask over the storage: slower, and no graph
            return self.attend(store, query, scaling)
        K, V = store.storage()
        b, hq, _, d = query.shape
        hkv, cap = K.shape[1], K.shape[2]
        mask = step.held_mask(store, "storage", cap, store.n, b * hkv, query.dtype)
        out = F.scaled_dot_product_attention(query.view(b, hkv, hq // hkv, d), K, V,
                                             attn_mask=mask.view(b, hkv, 1, cap), scale=scaling)
        return out.view(b, hq, 1, V.shape[-1])


class SlidingWindowPolicy(LayerPolicy):
    """Exact attention within a sliding window (Gemma3's local layers), and physically only the window: after
    every forward the layer keeps its last ``window - 1`` tokens, as transformers' own sliding layer does."""

    moves_tokens_every_step = True

    def attend(self, store: "Store", query: torch.Tensor, scaling: float) -> torch.Tensor:
        out = exact_attention(store, query, scaling, self.info.sliding_window)
        keep = self.info.sliding_window - 1
        if store.n > keep and store.cache.phase != "scratch":  # a scratch forward's tokens are dropped after it
            store.keep_ends(0, keep)
        return out


def layer_policy(method: KVMethod, info: LayerInfo) -> LayerPolicy:
    """The policy that runs on one layer of one prompt under ``method`` (see the module docstring)."""
    method.check_layer(info)
    if info.layer_idx < method.full_layers:
        return StaticExactPolicy(method, info)  # exact, and graph-ready as a method's other layers may be
    if info.sliding_window is not None and not method.handles_sliding:
        return SlidingWindowPolicy(method, info)
    return method.policy_for_layer(info)
