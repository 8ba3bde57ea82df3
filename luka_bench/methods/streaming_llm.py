"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2023).

Keeps the first ``sink`` tokens (attention sinks) and the most recent tokens; everything in between is evicted
physically. Acts at both hook points: once after the context prefill, and after every later step (question
chunk, each generated / teacher-forced token), so the cache never exceeds its capacity.

Budget: a layer holds ``capacity = ceil(budget * max(seen, reference_length))`` tokens, sinks included:
``sink`` sinks + ``capacity - sink`` recent tokens. Every KV head keeps the same tokens (no scores, GQA
irrelevant). Keys are stored after RoPE, so kept tokens keep their original positions (the paper's variant that
re-assigns positions inside the cache is not used; this matches common reference code for RoPE models).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from luka_bench.methods.base import KVMethod, LayerPolicy, MethodConfigError


class StreamingPolicy(LayerPolicy):
    def _evict(self, store) -> None:
        cap = self.capacity(store)
        if store.n <= cap:
            return
        sink = min(self.method.sink, cap)
        store.keep_ends(sink, cap - sink)

    def after_prefill(self, store) -> None:
        self._evict(store)

    def after_step(self, store) -> None:
        self._evict(store)


@dataclass
class StreamingLLM(KVMethod):
    """sink: number of initial tokens always kept (paper: 4)."""

    sink: int = 4

    name: ClassVar[str] = "streaming_llm"
    policy_class: ClassVar[type[LayerPolicy]] = StreamingPolicy

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.sink, int) or self.sink < 0:
            raise MethodConfigError(f"method.sink={self.sink!r} must be an integer >= 0 (paper: 4)")
