"""AdaKV (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference", 2024) on SnapKV's scores — or on any prefill scorer's (``scorer``: KNorm, ExpectedAttention, ..., as
kvpress's ``AdaKVPress(press)`` wraps any press): a layer's budget is split across its KV heads by where the highest
scores are, each head guaranteed a floor; each head then keeps its own top tokens plus the protected ones (SnapKV's
window). Method card: methods/adakv.md.

With ``B' = capacity - window`` scored tokens (``window``: the tokens the scorer protects, sinks and recent) per head on average and ``H`` KV heads, the layer's ``H * B'`` best
scores over all its heads are counted per head (``n_h``), then

- ``rule: paper`` (the authors' FFY0/AdaKV ``AdaptiveSnapKVCluster``): head h keeps ``round((1 - alpha) n_h +
  int(alpha B'))`` scored tokens (sums to ``H B'`` within ``H / 2``: the rounding);
- ``rule: kvpress`` (``AdaKVPress``): each head's top ``int(alpha * capacity)`` tokens (the window counts among them)
  are safe; the rest of the ``H * capacity`` is the layer's highest other scores (sums to ``H B'`` exactly).

The store holds a different number of tokens per head (``KVStore.keep_heads``): attention and every memory figure
count what each head holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from luka_bench.methods.base import LayerPolicy, setting
from luka_bench.methods.scorer import WrappedScorerPolicy
from luka_bench.methods.snapkv import OverScores

RULES = ("paper", "kvpress")


def head_counts(scores: torch.Tensor, room: int, alpha: float, rule: str, window: int = 0) -> torch.Tensor:
    """Scored tokens each KV head keeps, [B, H] (int64), from the scores [B, H, m] of a layer's scored tokens, ``room``
    (= B') of them per head on average, floor fraction ``alpha``, under ``rule`` (module docstring; ``window``: the
    protected tokens each head keeps besides, which kvpress's safe count includes)."""
    b, h, m = scores.shape
    s = scores.float()
    if rule == "kvpress":
        safe = int((room + window) * alpha)
        if alpha > 0:
            safe = max(1, safe)
        safe = min(max(0, safe - window), room)  # the window is kvpress's top-scored part of the safe set
        if safe:
            s = s.scatter(-1, s.topk(safe, dim=-1).indices, float("inf"))
    top = s.reshape(b, h * m).topk(h * room, dim=-1).indices // m  # the head of each of the layer's best scores
    n = torch.zeros(b, h, dtype=torch.long, device=scores.device).scatter_add_(-1, top, torch.ones_like(top))
    if rule == "paper":
        n = torch.round(n * (1 - alpha) + int(room * alpha)).long()
    return n.clamp_(0, m)


class AdaKVPolicy(WrappedScorerPolicy):
    def head_capacities(self, store, cap: int, scores: torch.Tensor) -> torch.Tensor | None:
        sinks, recent = self.protected(store, cap)
        kept = min(sinks, cap) + min(recent, cap - min(sinks, cap))
        room = cap - kept
        if room <= 0:
            return None
        m = self.method
        return kept + head_counts(scores, room, m.alpha, m.rule, kept)


@dataclass
class AdaKV(OverScores):
    """SnapKV's scores (window, kernel, pooling as there; defaults the AdaKV authors' experiments: window 32,
    kernel 7, max pooling) with the layer's budget split across KV heads. alpha: each head's floor, a fraction of
    the per-head budget (0.2: the authors' experiments; kvpress's AdaKVPress also 0.2); rule: paper | kvpress.
    scorer: another prefill scorer whose scores are split instead of SnapKV's (None: SnapKV with window, kernel,
    pooling and question_aware above, which are then the only ones read)."""

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    alpha: float = setting(0.2, within="[0, 1]", number=True, note="paper: 0.2; 1 = SnapKV")
    rule: str = setting("paper", choices=RULES)

    name: ClassVar[str] = "adakv"
    policy_class: ClassVar[type[LayerPolicy]] = AdaKVPolicy

