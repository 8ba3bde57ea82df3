"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024).

Prefill-time selection, once, after the context prefill: the last ``window`` prompt queries (the observation
window) attend over the whole prompt (causal, fp32 softmax); each earlier token's score is the attention it
receives from those queries, summed over the window and over the query heads of its KV group (GQA: per KV
head); scores are smoothed along the sequence by 1-D pooling (``kernel``, stride 1, same length); each KV head
keeps its top ``capacity - window`` tokens plus the window itself.

Pooling, as the SnapKV reference code and NVIDIA kvpress do it (``avg_pool1d(kernel, padding=kernel // 2,
stride=1)``, its default ``count_include_pad``): ``avg`` pads the sequence with zeros and divides by ``kernel``
everywhere, so a token near either edge of the scored span is averaged with zeros. ``max`` pads with -inf.
``avg_inrange`` divides by the in-range neighbours only (this project's earlier rule; kept for comparison).
Defaults are the reference ones: window 64, kernel 5, avg (kvpress ``SnapKVPress``). Later tokens
(question, answer) are appended and kept: SnapKV does not evict while decoding.

Budget: ``capacity = ceil(budget * context length)`` tokens per layer after the prefill, window included.

``question_aware``: the observation queries are the question's (``MethodCache.question_ids``, run after the
prefill as a scratch forward at the positions right after the context, its keys/values then dropped) instead of
the last ``window`` context tokens'; everything held is visible to them. The last ``window`` context tokens are
still kept. Without a question (perplexity) it falls back to the question-agnostic window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from luka_bench.methods.attention import group_logits
from luka_bench.methods.base import KVMethod, LayerPolicy, setting
from luka_bench.methods.scorer import ScorerPolicy, ScorerWrapper


POOLINGS = ("avg", "max", "avg_inrange")


def window_scores(q_window: torch.Tensor, keys: torch.Tensor, scaling: float, causal: bool = True) -> torch.Tensor:
    """Attention mass each held token receives from the window queries. q_window [B, Hq, w, D] are the queries
    of the last w held tokens (``causal``), or queries that see every held token (``causal=False``: the
    question's); keys [B, Hkv, n, D]. Returns [B, Hkv, n] (summed over window and group)."""
    b, hq, w, d = q_window.shape
    hkv, n = keys.shape[1], keys.shape[2]
    g = hq // hkv
    q = q_window.reshape(b, hkv, g, w, d)
    logits = group_logits(q, keys, scaling)  # [B, Hkv, g, w, n]
    if causal:
        qpos = n - w + torch.arange(w, device=keys.device)
        visible = torch.arange(n, device=keys.device)[None, :] <= qpos[:, None]
        logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=(2, 3))


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """1-D pooling along the token axis, stride 1, output the same length. scores [B, H, m]."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    b, h, m = scores.shape
    x = scores.reshape(b * h, 1, m)
    pad = kernel // 2
    if pooling == "max":
        y = F.max_pool1d(F.pad(x, (pad, kernel - 1 - pad), value=float("-inf")), kernel, stride=1)
    elif pooling == "avg":  # reference rule: zero padding counts (the first m outputs of avg_pool1d, pad k//2)
        y = F.avg_pool1d(F.pad(x, (pad, kernel - 1 - pad)), kernel, stride=1)
    else:  # avg_inrange: average over the in-range neighbours only
        y = F.avg_pool1d(F.pad(x, (pad, kernel - 1 - pad)), kernel, stride=1) * kernel
        cnt = F.avg_pool1d(F.pad(torch.ones_like(x), (pad, kernel - 1 - pad)), kernel, stride=1) * kernel
        y = y / cnt
    return y.reshape(b, h, m)


class SnapKVPolicy(ScorerPolicy):
    """On the scorer base: the last ``window`` context tokens protected, the rest scored by the pooled attention of
    the observation queries (the window's, or the question's)."""

    def observation_window(self, store) -> int:
        return self.method.window

    def observes_question(self) -> bool:
        return self.method.question_aware

    def protected(self, store, cap: int) -> tuple[int, int]:
        return 0, min(self.method.window, cap)  # the context's last w tokens (the window kept is still the context's)

    def score(self, store, start: int, stop: int, obs) -> torch.Tensor:
        scores = window_scores(obs.queries, store.keys, obs.scaling, causal=obs.causal)[:, :, start:stop]
        return pool_scores(scores, self.method.kernel, self.method.pooling)


@dataclass
class SnapKV(KVMethod):
    """window: observation window (last prompt queries); kernel: pooling kernel size; pooling: avg (reference:
    zero-padded) | max | avg_inrange. Defaults are kvpress's SnapKVPress / the SnapKV reference code's.
    question_aware: observe with the question's queries (see the module docstring)."""

    budget: float = 0.125
    window: int = setting(64, at_least=1, note="reference: 32-64")
    kernel: int = setting(5, at_least=1, note="reference: 5-7")
    pooling: str = setting("avg", choices=POOLINGS)
    question_aware: bool = setting(False)

    name: ClassVar[str] = "snapkv"
    policy_class: ClassVar[type[LayerPolicy]] = SnapKVPolicy

    def compresses_in_forward(self, cache) -> bool:
        return not self._asks_the_question(cache)  # the question's scratch forward needs every layer uncompressed

    def _asks_the_question(self, cache) -> bool:
        return bool(self.question_aware and cache.question_ids and self.budget < 1.0)

    def after_prefill_cache(self, cache) -> None:
        if self._asks_the_question(cache):
            cache.scratch_forward(cache.question_ids)  # policies keep the question's queries (attend)
        super().after_prefill_cache(cache)


@dataclass
class OverScores(ScorerWrapper, SnapKV):
    """The base of a budget allocation over a scorer (AdaKV, PyramidKV): SnapKV's scores with the settings above, as
    the references run them, or ``scorer``'s (a prefill scorer method, run at this method's budget; then window,
    kernel, pooling and question_aware are not read)."""

    scorer: KVMethod | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scorer is not None:
            self._inner_at_budget(self.scorer)  # refuses a method that is not a prefill scorer

    def inner(self) -> KVMethod:
        if self.scorer is not None:
            return self._inner_at_budget(self.scorer)
        return SnapKV(budget=self.budget, window=self.window, kernel=self.kernel, pooling=self.pooling,
                      question_aware=self.question_aware, rounding=self.rounding)
