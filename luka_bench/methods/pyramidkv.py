"""PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", 2024):
SnapKV's scores — or any prefill scorer's (``scorer``) — with per-layer capacities that fall linearly from the
first layer to the last. Method card: methods/pyramidkv.md.

``budget_rule: paper`` (the authors' KVCache-Factory ``PyramidKVCluster``, integer arithmetic): with ``B`` the
uniform capacity of a layer (``ceil(budget * context)``, window included) and ``w`` the window, layer ``l`` of ``L``
keeps ``max - l * step`` scored tokens plus the window, where ``min = (B - w) // beta``, ``max = 2 (B - w) - min``
(``max`` capped at ``context - w``, ``min`` then raised to keep the sum), ``step = (max - min) // (L - 1)``. A
context under ``2 (B - w)`` tokens takes uniform SnapKV (``B`` per layer); one under ``B`` is not compressed.
``budget_rule: kvpress`` (``PyramidKVPress``): the same pyramid in real numbers around ``budget * context`` (window
included in each layer's count, rounded), and uniform SnapKV unless ``context >= max >= min >= window``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from luka_bench.methods.base import LayerPolicy, setting
from luka_bench.methods.scorer import WrappedScorerPolicy
from luka_bench.methods.snapkv import OverScores

RULES = ("paper", "kvpress")


def layer_capacity(rule: str, n: int, cap: int, budget: float, window: int, beta: float, layer: int,
                   layers: int) -> int:
    """Tokens layer ``layer`` of ``layers`` keeps (window included) after a prefill of ``n`` tokens whose uniform
    capacity is ``cap`` (``ceil(budget * n)``), under ``rule`` (see the module docstring)."""
    if rule == "paper":
        room = cap - window  # scored tokens of a uniform layer
        if n < cap or room <= 0 or n < 2 * room:
            return cap  # the reference's fallbacks: no compression / uniform SnapKV
        lo = int(room // beta)
        hi = 2 * room - lo
        if hi >= n - window:
            hi = n - window
            lo = 2 * room - hi
        step = (hi - lo) // (layers - 1) if layers > 1 else 0
        return hi - layer * step + window
    room = n * budget  # kvpress: max_capacity_prompt - window = n (1 - compression_ratio)
    lo = room / beta
    hi = 2 * room - lo
    if hi >= n - window:
        hi = n - window
        lo = 2 * room - hi
    if not (n >= hi >= lo >= window):
        return max(1, round(n * budget))
    step = (hi - lo) / (layers - 1) if layers > 1 else 0.0
    return round(hi - layer * step)


class PyramidKVPolicy(WrappedScorerPolicy):
    def capacity(self, store) -> int:
        m, cap = self.method, super().capacity(store)
        if m.budget >= 1.0:
            return cap
        # the window: SnapKV's setting (as the references), else what the scorer protects at the uniform capacity
        window = m.window if m.scorer is None else sum(self.protected(store, cap))
        return layer_capacity(m.budget_rule, store.n, cap, m.budget, window, m.beta, self.info.layer_idx,
                              self.info.num_layers)


@dataclass
class PyramidKV(OverScores):
    """SnapKV (window, kernel, pooling as there) with pyramidal per-layer capacities. beta: the pyramid's
    steepness (the first layer's scored tokens / the last's ~ 2 beta - 1); budget_rule: paper | kvpress. scorer:
    another prefill scorer whose scores the layers keep instead of SnapKV's (None: SnapKV with the settings above)."""

    beta: float = setting(20, at_least=1, number=True, note="paper: 20; 1 = SnapKV")
    budget_rule: str = setting("paper", choices=RULES)

    name: ClassVar[str] = "pyramidkv"
    policy_class: ClassVar[type[LayerPolicy]] = PyramidKVPolicy

