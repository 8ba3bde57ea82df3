"""Entropy-guided OLS compaction's maths (``entropy_ols.py`` is the policy: when to flush, what is held): the
selection priority (attention entropy and accumulated mass, ranked), the log partition mass of what a layer holds,
and the fit of a bin's synthetic entries — k-means keys (``kmeans.euclidean_kmeans``), per-entry log-mass biases,
ridge-regularised least-squares values, or the post's literal linear map. Pure torch on tensors, no store and no
policy; leading dims are batch dims ([B, Hkv, bins, ...]). Derivations: ``methods/entropy_ols.md``."""
from __future__ import annotations

import torch

from luka_bench.methods.kmeans import euclidean_kmeans


def priority(ent: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Percentile rank of entropy + percentile rank of low mass, over the last axis (higher = bin first)."""
    n = ent.shape[-1]
    re = ent.argsort(dim=-1, stable=True).argsort(dim=-1).float()
    rm = (-mass).argsort(dim=-1, stable=True).argsort(dim=-1).float()
    return (re + rm) / max(n - 1, 1)


def log_partition(q: torch.Tensor, keys: torch.Tensor, scaling: float, sk: torch.Tensor | None = None,
                  sb: torch.Tensor | None = None) -> torch.Tensor:
    """log Z(q) [..., m_q] of queries q [..., m_q, D] over held keys [..., n, D] and, when given, synthetic
    entries (keys sk [..., S, D], log-mass biases sb [..., S]) in one softmax."""
    logits = (q @ keys.transpose(-1, -2)).float() * scaling
    if sk is not None:
        el = (q @ sk.transpose(-1, -2)).float() * scaling + sb.unsqueeze(-2)
        logits = torch.cat([logits, el], dim=-1)
    return torch.logsumexp(logits, dim=-1)


def bin_attention(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, bb: torch.Tensor, scaling: float):
    """The bin's own attention for queries q [..., m_q, D] over its entries (keys kb [..., m, D], values vb,
    log-mass biases bb [..., m]; 0 for raw tokens): (logits [..., m_q, m], log partition mass [..., m_q],
    normalised output [..., m_q, Dv])."""
    logits = (q @ kb.transpose(-1, -2)).float() * scaling + bb.float().unsqueeze(-2)
    lz = torch.logsumexp(logits, dim=-1)
    out = torch.softmax(logits, dim=-1) @ vb.float()
    return logits, lz, out


def fit_bias(logits: torch.Tensor, onehot: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
             scaling: float) -> torch.Tensor:
    """Per-entry log-mass bias: b_j = mean over the reference queries of (log Z_j(q) - q.k_j * scaling), with
    Z_j(q) the exact partition mass of cluster j's members (logits [..., m_q, m], onehot [..., m, r]); the
    least-squares fit of log Z_j(q) ~ q.k_j * scaling + b_j in b_j. Empty clusters get -1e4 (no mass)."""
    member = torch.log(onehot.float()).unsqueeze(-3)  # [..., 1, m, r] (0 or -inf)
    lzj = torch.logsumexp(logits.unsqueeze(-1) + member, dim=-2)  # [..., m_q, r]
    own = (q @ keys.transpose(-1, -2)).float() * scaling  # [..., m_q, r]
    empty = onehot.sum(-2) == 0
    resid = torch.where(empty.unsqueeze(-2), torch.zeros_like(lzj), lzj - own)
    return resid.mean(-2).masked_fill(empty, -1e4)


def fit_values(p: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin_V sum_q w_q^2 ||p_q V - t_q||^2 + lam ||V||^2 (p [..., m_q, r], target [..., m_q, Dv], weight
    [..., m_q]), lam = ridge * trace(P_w^T P_w) / r: the normal equations, solved batched."""
    pw = p.float() * weight.unsqueeze(-1)
    tw = target.float() * weight.unsqueeze(-1)
    gram = pw.transpose(-1, -2) @ pw
    r = gram.shape[-1]
    lam = ridge * gram.diagonal(dim1=-2, dim2=-1).sum(-1) / r
    eye = torch.eye(r, dtype=gram.dtype, device=gram.device)
    # solve_ex: no error check (linalg.solve's reads the device's info flag: a host sync per flush on CUDA); the
    # ridge keeps the system positive definite
    return torch.linalg.solve_ex(gram + lam[..., None, None] * eye + 1e-12 * eye, pw.transpose(-1, -2) @ tw).result


def fit_ols_entries(q, kb, vb, bb, lz_all, scaling: float, rank: int, iters: int, ridge: float):
    """Synthetic entries for bins: q [..., m_q, D] reference queries, bin keys/values/biases [..., m, *],
    lz_all [..., m_q] the log partition mass of everything held for each reference query (weights each query by
    the bin's share of its attention). Returns (keys [..., r, D], values [..., r, Dv], biases [..., r], one-hot
    membership [..., m, r]). rank >= m: the bin itself (exact)."""
    if rank >= kb.shape[-2]:
        eye = torch.eye(kb.shape[-2], device=kb.device).expand(*kb.shape[:-1], kb.shape[-2])
        return kb.clone(), vb.clone(), bb.clone().float(), eye.clone()
    logits, lz, out = bin_attention(q, kb, vb, bb, scaling)
    keys, onehot = euclidean_kmeans(kb, rank, iters)
    bias = fit_bias(logits, onehot, q.float(), keys, scaling)
    p = torch.softmax((q.float() @ keys.transpose(-1, -2)) * scaling + bias.unsqueeze(-2), dim=-1)
    share = torch.exp((lz - lz_all).clamp_max(0.0))
    values = fit_values(p, out, share, ridge)
    return keys.to(kb.dtype), values.to(vb.dtype), bias, onehot


def fit_linear_map(q: torch.Tensor, target: torch.Tensor, rank: int):
    """The post's literal OLS map W = pinv(Q_ref) Attn(Q_ref, K_bin, V_bin) [..., D, Dv], truncated to ``rank``
    by SVD: returns (A = U_k S_k [..., D, k], B = V_k^T [..., k, Dv], singular values [..., min(D, Dv)]); the
    bin's output for a query q is q A B."""
    w = torch.linalg.pinv(q.float()) @ target.float()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    return u[..., :rank] * s[..., None, :rank], vh[..., :rank, :], s


def fit_linear_entries(q, kb, vb, bb, scaling: float, rank: int):
    """The ``linear`` mode's entries for bins (q, kb, vb, bb as ``fit_ols_entries``): one centroid per bin
    carrying the bin's fitted log-mass (zero value) and the rank-``rank`` map of its output. Returns (keys
    [..., 1, D], values [..., 1, Dv], biases [..., 1], one-hot membership [..., m, 1], map factors [..., 1, D, k]
    and [..., 1, k, Dv])."""
    logits, _, out = bin_attention(q, kb, vb, bb, scaling)
    keys, onehot = euclidean_kmeans(kb, 1, 0)
    bias = fit_bias(logits, onehot, q.float(), keys, scaling)
    b, h, nb = kb.shape[:3]
    values = torch.zeros(b, h, nb, 1, vb.shape[-1], dtype=vb.dtype, device=vb.device)
    a_, b_, _ = fit_linear_map(q.expand(b, h, nb, *q.shape[3:]), out, rank)
    return keys, values, bias, onehot, a_.unsqueeze(3), b_.unsqueeze(3)  # [B, H, nb, 1, D, k], [.., 1, k, Dv]


def merged_stats(onehot: torch.Tensor, mass: torch.Tensor, ent: torch.Tensor):
    """What a synthetic entry inherits from its members (one-hot membership [..., m, r]; the members' accumulated
    mass and entropy [..., m]): (their summed mass, their mean entropy) [..., r]."""
    w = onehot / onehot.sum(-2, keepdim=True).clamp_min(1)  # membership weights [.., m, r]
    smass = (mass.unsqueeze(-2) @ onehot).squeeze(-2)
    sent = (ent.unsqueeze(-2) @ w).squeeze(-2)
    return smass, sent
