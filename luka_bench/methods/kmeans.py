"""Spherical k-means and per-cluster statistics of key vectors (torch only), shared by the clustered retrieval
methods: LycheeCluster's two-level index (``lychee.py``) and ClusterKV's per-head key clusters (``clusterkv.py``).
Deterministic on every device: a fixed initialisation, ties to the lower-numbered cluster, and atomics-free sums
(``attention.group_sum``)."""
from __future__ import annotations

import torch

from .attention import group_sum


def spherical_kmeans(x: torch.Tensor, k: int, iters: int, valid: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Spherical k-means of unit vectors x [B, H, M, D] into k clusters (cosine similarity), batched over B, H.
    Init: k points spread evenly over the M inputs (deterministic). An emptied cluster keeps its centroid.
    Ties: a point equally near two centroids joins the lower-numbered one (``argmax`` returns the first maximum);
    the centroid sums are deterministic on every device (``attention.group_sum``: no float atomics on CUDA), so the
    same input gives the same clusters on every run.
    Returns (assignment [B, H, M], centroid directions [B, H, k, D])."""
    b, h, m, d = x.shape
    init = torch.linspace(0, m - 1, k, device=x.device).round().long()
    c = x[:, :, init].clone()
    for _ in range(iters):
        a = torch.matmul(x, c.transpose(-1, -2)).argmax(-1)
        s = group_sum(x, a, k)
        norm = s.norm(dim=-1, keepdim=True)
        c = torch.where(norm > 0, s / norm.clamp_min(1e-12), c)
    a = torch.matmul(x, c.transpose(-1, -2)).argmax(-1)
    return a, c


def node_stats(x: torch.Tensor, a: torch.Tensor, k: int, weight: torch.Tensor | None = None):
    """Per node of an assignment a [B, H, M] of points x [B, H, M, D]: count (or summed ``weight``) [B, H, k],
    mean mu [B, H, k, D] (weighted) and radius r = max ||x - mu[a]|| [B, H, k]."""
    b, h, m, d = x.shape
    w = torch.ones(b, h, m, dtype=x.dtype, device=x.device) if weight is None else weight.to(x.dtype)
    cnt = torch.zeros(b, h, k, dtype=x.dtype, device=x.device).scatter_add_(2, a, w)  # integer-valued: exact
    s = group_sum(x * w.unsqueeze(-1), a, k)
    mu = s / cnt.clamp_min(1e-12).unsqueeze(-1)
    dist = (x - mu.gather(2, a.unsqueeze(-1).expand(b, h, m, d))).norm(dim=-1)
    r = torch.zeros(b, h, k, dtype=x.dtype, device=x.device).scatter_reduce_(2, a, dist, "amax", include_self=True)
    return cnt, mu, r
