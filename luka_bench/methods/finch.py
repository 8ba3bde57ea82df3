"""FINCH (Corallo & Papotti, "FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models", TACL
2024), as NVIDIA kvpress's ``FinchPress`` implements it: the question is the observation window. Method card:
methods/finch.md.

Needs the question inside the compressed prompt (``query_aware=true``: context + question are one prefill; the
cache's ``question_span`` says how many of its last tokens are the question). After that prefill, per layer: the
question's queries attend over the whole prompt (causal, fp32 softmax); each query's attention row is multiplied by
its position (the number of keys it sees, less one: kvpress's ``normalize_scores``, so that late queries, whose
attention spreads over more keys, weigh as much as early ones); a token's score is the sum over the question's
queries and over the query heads of its KV group. The question's tokens always stay. Each KV head keeps its
``ceil(budget * prompt)`` best tokens — or, with ``chunk > 0``, ``ceil(budget * c)`` of each consecutive run of
``c <= chunk`` tokens (kvpress's ``chunk_length``). With ``rerotate: true`` (kvpress's default) the kept keys are
moved to the positions 0..kept-1 (RoPE re-applied to each key by its own shift) and the next token takes the
position ``kept``, as kvpress's pipeline does; ``false`` keeps the original positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from luka_bench.methods.attention import group_logits, top_indices
from luka_bench.methods.base import KVMethod, LayerInfo, LayerPolicy, MethodConfigError, setting
from luka_bench.methods.scorer import ScorerPolicy

NEEDS_QUESTION = ("method=finch needs the question inside the compressed prompt; allowed: query_aware=true on a QA "
                  "dataset (runner, library) — the question's tokens are its observation window")


def finch_scores(q: torch.Tensor, keys: torch.Tensor, scaling: float, normalize: bool = True) -> torch.Tensor:
    """Scores [B, Hkv, n] of the held tokens from the last ``w`` held tokens' queries q [B, Hq, w, D] (causal): each
    query's attention row times its position when ``normalize``, summed over the queries and each KV group."""
    b, hq, w, d = q.shape
    hkv, n = keys.shape[1], keys.shape[2]
    logits = group_logits(q.reshape(b, hkv, hq // hkv, w, d), keys, scaling)  # [B, Hkv, g, w, n]
    qpos = n - w + torch.arange(w, device=keys.device)
    logits = logits.masked_fill(torch.arange(n, device=keys.device)[None, :] > qpos[:, None], float("-inf"))
    att = torch.softmax(logits.float(), dim=-1)
    if normalize:
        att = att * qpos.to(att.dtype)[:, None]
    return att.sum(dim=(2, 3))


class FinchPolicy(ScorerPolicy):
    """The question's queries (the prompt's last ``question_span``) are the base's observation window; the selection
    per run of ``chunk`` tokens is FINCH's own (``after_prefill``)."""

    def observation_window(self, store) -> int:
        span = store.cache.question_span
        if span <= 0:
            raise MethodConfigError(NEEDS_QUESTION)
        return span

    def after_prefill(self, store) -> None:
        q, scaling = self.take_observation()[:2]
        if q is None:
            return
        m, n, span = self.method, store.n, q.shape[2]
        if m.budget >= 1.0:
            return
        scores = finch_scores(q, store.keys, scaling, m.normalize)
        scores[:, :, n - span:] = float("inf")  # the question stays (kvpress: the window's score is above all)
        size = m.chunk if m.chunk else n
        parts = []
        for s in range(0, n, size):
            c = min(size, n - s)
            asked = min(s + c, n) - max(s, n - span)  # the question's tokens in this run: all kept
            keep = max(m.capacity(c) if m.chunk else self.capacity(store), asked)
            if keep < c:
                parts.append(s + top_indices(scores[:, :, s: s + c], keep))
            else:
                parts.append(torch.arange(s, s + c, device=scores.device).expand(*scores.shape[:2], c))
        index = torch.cat(parts, dim=-1)
        if index.shape[-1] == n:
            return
        store.keep(index)
        if m.rerotate:  # the key at slot i moves to position i; the next token takes position n_kept
            target = torch.arange(store.n, device=index.device).expand_as(index)
            store.rotate_keys(0, store.n, target - store.positions)
            store.set_next_position(store.n)


@dataclass
class Finch(KVMethod):
    """budget: fraction of the prompt (context + question) kept per layer and KV head, the question included; chunk:
    select per run of this many tokens (0: over the whole prompt; kvpress chunk_length); normalize: weigh each
    question query's attention by its position (kvpress normalize_scores); rerotate: move the kept keys to
    consecutive positions (kvpress rerotate_keys)."""

    budget: float = 0.125
    chunk: int = setting(0, at_least=0, note="0: the whole prompt; LASER-KV ran FINCH with 1024")
    normalize: bool = setting(True)
    rerotate: bool = setting(True)

    name: ClassVar[str] = "finch"
    policy_class: ClassVar[type[LayerPolicy]] = FinchPolicy
    question_in_prompt: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rerotate and self.full_layers:
            raise MethodConfigError(f"method.full_layers={self.full_layers} with method.rerotate=true: every layer's "
                                    "positions must move together; allowed: full_layers=0, or rerotate=false")

    def batch_refusal(self) -> str | None:
        return "its question lies inside the prompt at one span per cache"

    def check_layer(self, info: LayerInfo) -> None:
        if self.rerotate and info.sliding_window is not None:
            raise MethodConfigError("method.rerotate=true is not supported on models with sliding-window layers "
                                    "(e.g. gemma3); allowed there: false")
