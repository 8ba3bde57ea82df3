"""Paged key summaries: per page of consecutive held tokens, the per-channel mean, minimum and maximum of its keys
(post-RoPE, as the store holds them), kept up to date as pages close during the decode — what page-level retrieval
reads (Quest's upper bound of q.k over a page from its min/max; ArkVale's digest box; a page's mean key as
LuKA's and LycheeCluster's summaries start from).

``PagedKeys(size, start)`` summarises the store's slots ``start, start + size, ...`` in slot order; for a store that
only appends (Quest, ArkVale, LycheeCluster keep every raw token) slot order is time order. ``update(store)``
closes the pages completed since its last call (a decode step that completes none costs nothing; one that does
costs three reductions over that page); the tail after the last full page is not summarised. Storage grows
geometrically, as the store's.
"""
from __future__ import annotations

import torch

from .base import Store


class PagedKeys:
    """Per-page mean / min / max of a store's keys (see the module docstring)."""

    GROWTH = 1.25

    def __init__(self, size: int, start: int = 0):
        if size < 1:
            raise ValueError(f"page size {size} must be >= 1")
        self.size, self.start = int(size), int(start)
        self.pages = 0  # pages summarised
        self._buf: torch.Tensor | None = None  # [3, B, Hkv, capacity, D]: mean, min, max

    def _view(self, i: int) -> torch.Tensor:
        return self._buf[i, :, :, : self.pages]

    @property
    def mean(self) -> torch.Tensor:
        """[B, Hkv, pages, D] (the keys' dtype)."""
        return self._view(0)

    @property
    def min(self) -> torch.Tensor:
        return self._view(1)

    @property
    def max(self) -> torch.Tensor:
        return self._view(2)

    def update(self, store: Store) -> int:
        """Summarise the pages of ``store`` completed since the last call; returns how many were added."""
        full = max(0, (store.n - self.start) // self.size)
        new = full - self.pages
        if new <= 0:
            return 0
        lo = self.start + self.pages * self.size
        k = store.keys[:, :, lo: lo + new * self.size]
        b, h, _, d = k.shape
        pages = k.reshape(b, h, new, self.size, d)
        if self._buf is None or full > self._buf.shape[3]:
            cap = max(full, int((0 if self._buf is None else self._buf.shape[3]) * self.GROWTH) + 8)
            buf = k.new_zeros(3, b, h, cap, d)
            if self._buf is not None:
                buf[:, :, :, : self.pages] = self._buf[:, :, :, : self.pages]
            self._buf = buf
        out = self._buf[:, :, :, self.pages: full]
        torch.mean(pages, dim=3, out=out[0])
        torch.amin(pages, dim=3, out=out[1])
        torch.amax(pages, dim=3, out=out[2])
        self.pages = full
        return new

    def bound(self, q: torch.Tensor) -> torch.Tensor:
        """Quest's upper bound of q.k over each page: sum over channels of max(q_d * max_d, q_d * min_d), for queries
        q [B, Hkv, g, D] (the query heads of each KV head's group): [B, Hkv, g, pages] (fp32). Never below the
        largest q.k of a key in the page (each term bounds q_d * k_d)."""
        qf = q.float()[:, :, :, None, :]  # [B, Hkv, g, 1, D]
        hi, lo = self.max.float()[:, :, None], self.min.float()[:, :, None]  # [B, Hkv, 1, P, D]
        return torch.maximum(qf * hi, qf * lo).sum(-1)

    def nbytes(self) -> int:
        """Bytes of the summaries held (the index's memory, for ``extra_bytes``)."""
        return 0 if self._buf is None else 3 * self._buf[0, :, :, : self.pages].nbytes
