"""KNorm (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024):
after the prefill each KV head keeps the ``capacity`` tokens whose keys (post-RoPE, as cached) have the lowest L2
norm — low-norm keys draw the most attention, and no query is needed to find them. The scorer base does the rest
(``scorer.py``); the score is the negated norm in fp32, as kvpress's ``KnormPress``. Method card: methods/knorm.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from luka_bench.methods.base import KVMethod, LayerPolicy
from luka_bench.methods.scorer import ScorerPolicy


class KNormPolicy(ScorerPolicy):
    def score(self, store, start, stop, obs):
        return -store.keys[:, :, start:stop].float().norm(dim=-1)  # [B, Hkv, stop - start]: low norm scores high


@dataclass
class KNorm(KVMethod):
    """budget: fraction of the context kept per layer and KV head (the lowest-norm keys)."""

    budget: float = 0.125

    name: ClassVar[str] = "knorm"
    policy_class: ClassVar[type[LayerPolicy]] = KNormPolicy
