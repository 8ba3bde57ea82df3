"""K-means of key vectors (torch only): one Lloyd loop (``lloyd``) under two rules. Spherical k-means and per-cluster
statistics, shared by the clustered retrieval methods: LycheeCluster's two-level index (``lychee.py``) and
ClusterKV's per-head key clusters (``clusterkv.py``); deterministic on every device: a fixed initialisation, ties
to the lower-numbered cluster, and atomics-free sums (``attention.group_sum``). Euclidean k-means with one-hot
assignments, for entropy-OLS's synthetic keys (``entropy_ols_fit.py``): batched over any leading dims, no host
sync."""
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
    return lloyd(x, x[:, :, init].clone(), iters, _nearest_direction, lambda x, a: _direction(x, a, k))


def _nearest_direction(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, c.transpose(-1, -2)).argmax(-1)


def _direction(x: torch.Tensor, a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = group_sum(x, a, k)
    norm = s.norm(dim=-1, keepdim=True)
    return s / norm.clamp_min(1e-12), norm > 0


def euclidean_kmeans(x: torch.Tensor, r: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched Lloyd k-means over the second-to-last axis: x [..., m, D] -> (centroids [..., r, D], one-hot
    assignment [..., m, r]). Initialised at r evenly spaced members (deterministic); an emptied cluster keeps its
    previous centroid. r >= m: every member is its own cluster (centroids = x). ``iters`` + 1 centroid updates,
    the assignment before the last one."""
    m = x.shape[-2]
    if r >= m:
        eye = torch.eye(m, dtype=x.dtype, device=x.device).expand(*x.shape[:-2], m, m)
        return x.clone(), eye.clone()
    x = x.float()
    init = (torch.arange(r, device=x.device) * m) // r
    onehot, c = lloyd(x, x[..., init, :].clone(), iters, _nearest_onehot, _mean)
    new, live = _mean(x, onehot)
    return torch.where(live, new, c), onehot


def _nearest_onehot(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    a = torch.cdist(x, c).argmin(dim=-1)  # [..., m]
    return (a.unsqueeze(-1) == torch.arange(c.shape[-2], device=a.device)).to(x.dtype)  # [..., m, r]; one_hot syncs


def _mean(x: torch.Tensor, onehot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cnt = onehot.sum(-2)  # [..., r]
    return (onehot.transpose(-1, -2) @ x) / cnt.clamp_min(1).unsqueeze(-1), cnt.unsqueeze(-1) > 0


def lloyd(x: torch.Tensor, c: torch.Tensor, iters: int, assign, centroid):
    """Lloyd's iterations from centroids c: ``iters`` times, assign the points (``assign(x, c)``) and move each
    centroid to ``centroid(x, assignment)`` = (new centroids, which have members); an emptied cluster keeps its
    previous centroid. Returns (the assignment to the last centroids, those centroids)."""
    for _ in range(iters):
        new, live = centroid(x, assign(x, c))
        c = torch.where(live, new, c)
    return assign(x, c), c


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
