"""ExpectedAttention (NVIDIA kvpress's own method, ``ExpectedAttentionPress``; kvpress 0.5.5
``presses/expected_attention_press.py``): score each held token by the attention that *future* queries are expected to
give it, modelling those queries as a Gaussian fitted to the prompt's queries.

After the context prefill, per layer:

1. ``mu``, ``Sigma``: mean and (biased) covariance over the prompt's positions ``n_sink..N-1`` of the **pre-RoPE**
   queries, per query head [B, Hq, D], [B, Hq, D, D] (fp32). The attention function receives post-RoPE queries: they
   are un-rotated here (RoPE is a rotation: R(p)^T q; positions are the prompt's, and the model's rotary embedding
   gives cos/sin), accumulated over prefill chunks with Chan's pairwise update of mean and co-moment.
2. RoPE averaged over the next ``n_future_positions`` positions ``N..N+n_future-1``: ``R = mean_p R(p)`` (a D x D matrix
   from the model's cos/sin), ``mu <- R mu``, ``Sigma <- R Sigma R^T``.
3. For every held key k after the first ``n_sink`` (post-RoPE, as cached), per query head:
   ``s = mu.k / sqrt(D) + k^T Sigma k / (2 D)`` (the log of E[exp(q.k / sqrt(D))] for Gaussian q), a softmax over
   those keys, the mean over the query heads of the KV group (GQA: per KV head), then ``(s + epsilon) * ||v||``.

The first ``n_sink`` tokens are kept whatever their score (kvpress pads their score with the maximum + 1) and count
in the capacity; the scorer base (``scorer.py``) keeps the top rest per KV head. Method card:
methods/expected_attention.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from luka_bench.methods.base import KVMethod, LayerPolicy, setting
from luka_bench.methods.scorer import ScorerPolicy


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def unrotate(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Pre-RoPE queries from post-RoPE ones q [B, H, L, D] (float32) rotated with cos/sin [L, rot] (the rotate-half
    layout; a partial rotary dimension rotates only its first ``rot`` entries): the inverse rotation R(p)^T, and the
    rotary embedding's ``attention_scaling`` (``scale``; cos and sin without it, as ``KVStore.rope_cos_sin``) divided
    out."""
    rot = cos.shape[-1]
    x = q[..., :rot]
    back = (x * cos - rotate_half(x) * sin) / scale
    return torch.cat([back, q[..., rot:]], dim=-1) if rot < q.shape[-1] else back


def averaged_rope(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``mean_p R(p)`` [D, D] for cos/sin [P, rot]: R(p) x = cos_p * x + sin_p * rotate_half(x) on the rotary part,
    the identity on the rest."""
    rot = cos.shape[-1]
    half = rot // 2
    c, s = cos.mean(0), sin.mean(0)  # [rot]
    r = torch.eye(head_dim, dtype=torch.float32, device=cos.device)
    r[:rot, :rot] = torch.diag(c)
    idx = torch.arange(half, device=cos.device)
    # rotate_half(x)[i] = -x[i + half] (i < half), x[i - half] (i >= half)
    r[idx, idx + half] = -s[:half]
    r[idx + half, idx] = s[half:]
    return r


class QueryMoments:
    """Running mean [B, H, D] and co-moment sum((q - mean)(q - mean)^T) [B, H, D, D] (fp32) of query chunks, merged
    with Chan et al.'s pairwise update (exact, and stable where the mean is large against the spread)."""

    def __init__(self, covariance: bool):
        self.covariance = covariance
        self.count = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None

    def add(self, q: torch.Tensor) -> None:
        """q [B, H, L, D] float32."""
        nb = q.shape[2]
        if nb == 0:
            return
        mb = q.mean(2)
        m2b = None
        if self.covariance:
            c = q - mb[:, :, None]
            m2b = c.transpose(-1, -2) @ c
        if self.count == 0:
            self.count, self.mean, self.m2 = nb, mb, m2b
            return
        na = self.count
        n = na + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / n)
        if self.covariance:
            self.m2 = self.m2 + m2b + delta[..., :, None] * delta[..., None, :] * (na * nb / n)
        self.count = n

    def cov(self) -> torch.Tensor | None:
        return None if self.m2 is None else self.m2 / self.count


def expected_scores(mu: torch.Tensor, cov: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                    use_vnorm: bool = True, epsilon: float = 0.0) -> torch.Tensor:
    """ExpectedAttention's score of keys/values [B, Hkv, m, D] for query statistics mu [B, Hq, D] and cov [B, Hq, D, D]
    (or None: the mean only), already under the averaged RoPE: softmax over the m keys of ``mu.k / sqrt(D) +
    k^T cov k / (2 D)`` per query head, the mean over each KV group's query heads, times ``||v||`` (after adding
    ``epsilon``) with ``use_vnorm``. Returns [B, Hkv, m] float32."""
    b, hkv, m, d = keys.shape
    hq = mu.shape[1]
    g = hq // hkv
    k = keys.float()
    mu = mu.view(b, hkv, g, d)
    logits = torch.einsum("bhgd,bhmd->bhgm", mu, k) / math.sqrt(d)
    if cov is not None:
        kc = torch.einsum("bhmd,bhgde->bhgme", k, cov.view(b, hkv, g, d, d))
        logits = logits + (kc * k[:, :, None]).sum(-1) / (2 * d)
    scores = torch.softmax(logits, dim=-1).mean(2)
    if use_vnorm:
        scores = (scores + epsilon) * values.float().norm(dim=-1)
    return scores


class ExpectedAttentionPolicy(ScorerPolicy):
    """On the scorer base: the first ``n_sink`` tokens protected, the rest scored by ``expected_scores`` from the
    prefill's pre-RoPE query statistics (gathered in ``attend``)."""

    def __init__(self, method, info):
        super().__init__(method, info)
        self.moments = QueryMoments(method.use_covariance)

    def observe(self, store, query) -> None:
        lq, seen = query.shape[2], store.seen
        first = max(0, self.method.n_sink - (seen - lq))  # the chunk's queries at positions >= n_sink
        if first < lq:
            pos = torch.arange(seen - lq + first, seen, device=query.device)
            cos, sin, scale = store.rope_cos_sin(pos.view(1, -1), scaled=True)  # the layer's own RoPE
            self.moments.add(unrotate(query[:, :, first:].float(), cos, sin, scale))

    def protected(self, store, cap: int) -> tuple[int, int]:
        return self.method.n_sink, 0

    def statistics(self, store) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mu, Sigma) of the future queries: the prefill's moments under RoPE averaged over the next
        ``n_future_positions`` positions."""
        m = self.method
        pos = torch.arange(store.seen, store.seen + m.n_future_positions, device=store.device)
        cos, sin, scale = store.rope_cos_sin(pos.view(1, -1), scaled=True)
        r = averaged_rope(cos * scale, sin * scale, store.keys.shape[-1])  # as the model applies it
        mu = self.moments.mean @ r.T
        cov = self.moments.cov()
        return mu, None if cov is None else r @ cov @ r.T

    def score(self, store, start: int, stop: int, obs) -> torch.Tensor:
        mu, cov = self.statistics(store)
        return expected_scores(mu, cov, store.keys[:, :, start:stop], store.values[:, :, start:stop],
                               self.method.use_vnorm, self.method.epsilon)

    def after_prefill(self, store) -> None:
        try:
            if self.moments.count:
                self.compress(store, self.take_observation())
        finally:
            self.moments = QueryMoments(self.method.use_covariance)  # freed: not needed after the compression


@dataclass
class ExpectedAttention(KVMethod):
    """n_future_positions: RoPE averaged over this many positions after the prompt; n_sink: first tokens kept and
    left out of the query statistics; use_covariance: the k^T Sigma k term; use_vnorm: scores times ||v||;
    epsilon: added to the scores before the ||v|| rescaling. Defaults: kvpress ExpectedAttentionPress."""

    budget: float = 0.125
    n_future_positions: int = setting(512, at_least=1, note="kvpress: 512")
    n_sink: int = setting(4, at_least=0, note="kvpress: 4")
    use_covariance: bool = setting(True)
    use_vnorm: bool = setting(True)
    epsilon: float = setting(0.0, at_least=0, number=True, note="kvpress: 0.0")

    name: ClassVar[str] = "expected_attention"
    policy_class: ClassVar[type[LayerPolicy]] = ExpectedAttentionPolicy
