"""Paged key summaries: per page of consecutive held tokens, per-channel statistics of its keys (post-RoPE, as the
store holds them) — by default the mean, minimum and maximum; ArkVale's digest box (``lo``, ``hi``) on request —
kept up to date as pages close during the decode: what page-level retrieval reads (Quest's upper bound of q.k over
a page from its min/max; ArkVale's digest box). The reductions themselves, shared: ``page_means`` (pages of one
size: ``PagedKeys``; LuKA's ``mean`` compressor, its pages' keys and values), ``segment_pool`` / ``segment_sums``
(pages of varying length: LycheeCluster's chunk keys, mean or max). Also the two page-level operations the paged
decode steps share: ``page_bound`` (the sign-trick score of a query against a per-channel box) and ``gather_pages``
(whole pages of the storage, keys and values, in one copy).

``PagedKeys(size, start)`` summarises the store's slots ``start, start + size, ...`` in slot order; for a store that
only appends (Quest, ArkVale, LycheeCluster keep every raw token) slot order is time order. ``update(store)``
closes the pages completed since its last call (a decode step that completes none costs nothing; one that does
costs three reductions over that page); the tail after the last full page is not summarised. Storage grows
geometrically, as the store's.
"""
from __future__ import annotations

import torch

from .protocols import Store
from .attention import kv_rows


STATS = ("mean", "min", "max", "lo", "hi")


def page_means(x: torch.Tensor, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over each page of ``size`` consecutive slots of ``x`` [B, H, P * size, D]: [B, H, P, D] (into
    ``out`` when given). What ``PagedKeys`` keeps as ``mean`` and LuKA's ``mean`` compressor makes of a page."""
    b, h, t, d = x.shape
    return torch.mean(x.reshape(b, h, t // size, size, d), dim=3, out=out)


def segment_sums(x: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """The sum over each of n pages of *varying* length (``starts`` / ``lens`` [n] into the slots of ``x``
    [B, H, T, D], none longer than ``max_len``): [B, H, n, D], as a gather into [B, H, n, max_len, D] (padding
    zeroed) summed over the slots in order — deterministic on every device (no float atomics, unlike a
    ``scatter_add_`` on CUDA); fixed shapes, no host sync. LycheeCluster's structure-aware chunks."""
    b, h, _, d = x.shape
    slot = torch.arange(max_len, device=x.device)
    ok = slot < lens.unsqueeze(-1)  # [n, max_len]
    tok = torch.where(ok, starts.unsqueeze(-1) + slot, torch.zeros_like(slot)).view(-1)
    g = x.index_select(2, tok).view(b, h, -1, slot.numel(), d)
    return (g * ok.view(1, 1, *ok.shape, 1).to(g.dtype)).sum(3)


def segment_pool(x: torch.Tensor, seg: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, max_len: int,
                 how: str = "mean", offset: int = 0) -> torch.Tensor:
    """Per-page mean (``how="mean"``) or per-channel maximum (``"max"``) of ``x`` [B, H, T, D] over n pages of
    varying length: ``seg`` [T] each slot's page (0..n-1), ``starts`` / ``lens`` [n] (``starts - offset`` into the
    slots of ``x``: see ``segment_sums``). [B, H, n, D]. The mean sums in slot order on the CPU (``scatter_add_``:
    one thread per output row there) and with ``segment_sums`` elsewhere."""
    b, h, t, d = x.shape
    n = lens.shape[0]
    idx = seg.view(1, 1, t, 1).expand(b, h, t, d)
    if how == "max":
        return torch.full((b, h, n, d), float("-inf"), dtype=x.dtype, device=x.device).scatter_reduce_(
            2, idx, x, "amax", include_self=True)
    if x.device.type == "cpu":
        sums = torch.zeros(b, h, n, d, dtype=x.dtype, device=x.device).scatter_add_(2, idx, x)
    else:
        sums = segment_sums(x, starts - offset, lens, max_len)
    return sums / lens.to(x.dtype).view(1, 1, -1, 1)


def page_bound(q: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """sum_d max(q_d * hi_d, q_d * lo_d) for queries q [R, g, D] (the query heads of each row's group, R = batch x
    KV heads) and each page's per-channel box ``hi`` / ``lo`` [R, P, D]: [R, g, P] fp32. With the box the page's
    min/max this is Quest's upper bound of q.k over the page; with ArkVale's shrunk box (``lo`` / ``hi``) it is its
    digest score, no bound. As two GEMMs, relu(q).hi + min(q, 0).lo (the positive part of q takes the upper end,
    the negative part the lower): no [R, g, P, D] product is made, as ``PagedKeys.bound`` makes. ``start``: an
    additive fp32 [R, 1, P] (0 / -inf: pages that do not count) taken as the first GEMM's input (no op of its own)."""
    q = q.float()
    if start is None:
        score = torch.bmm(q.clamp(min=0), hi.float().transpose(1, 2))
    else:
        score = torch.baddbmm(start.expand(q.shape[0], q.shape[1], hi.shape[1]), q.clamp(min=0),
                              hi.float().transpose(1, 2))
    return torch.baddbmm(score, q.clamp(max=0), lo.float().transpose(1, 2))


def gather_pages(store: Store, rows: torch.Tensor, page_size: int, b: int, h: int, w: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of whole pages of ``page_size`` slots from the store's storage (slot 0 on; its capacity a
    multiple of the page size: ``LayerPolicy.storage_multiple``): ``rows`` [b * h * w / page_size] are page ids in
    the storage flattened to [B * Hkv * capacity / page_size] pages; returns ([b, h, w, D], [b, h, w, Dv]). One
    ``index_select`` of page rows for keys and values together where they are stored stacked."""
    pages = store.pages(0, page_size)  # [2, B * Hkv, capacity / ps, ps * D]
    if pages is not None:
        d = pages.shape[-1] // page_size
        kv = kv_rows(pages.reshape(2, -1, pages.shape[-1]), rows).view(2, b, h, w, d)
        return kv[0], kv[1]
    K, V = store.storage()  # keys and values stored apart (their shapes or dtypes differ)
    d, dv = K.shape[-1], V.shape[-1]
    return (K.reshape(-1, page_size * d).index_select(0, rows).view(b, h, w, d),
            V.reshape(-1, page_size * dv).index_select(0, rows).view(b, h, w, dv))


class PagedKeys:
    """Per-page statistics of a store's keys (see the module docstring). ``stats``: which ones are kept, of
    ``mean``, ``min``, ``max`` (Quest, summaries) and ``lo``, ``hi`` (ArkVale's digest: the per-channel centre
    c = (min + max) / 2 minus / plus the mean absolute deviation mean_t |k_t - c| of the page's keys,
    ``source/arkvale/infer_state.py`` L448-462)."""

    GROWTH = 1.25

    def __init__(self, size: int, start: int = 0, stats: tuple[str, ...] = ("mean", "min", "max")):
        if size < 1:
            raise ValueError(f"page size {size} must be >= 1")
        bad = [s for s in stats if s not in STATS]
        if bad or not stats:
            raise ValueError(f"page statistics {bad or stats} are not among {STATS}")
        self.size, self.start = int(size), int(start)
        self.stats = tuple(stats)
        self.pages = 0  # pages summarised
        self._buf: torch.Tensor | None = None  # [len(stats), B, Hkv, capacity, D]

    def _view(self, name: str) -> torch.Tensor:
        if name not in self.stats:
            raise AttributeError(f"this PagedKeys keeps {self.stats}, not {name!r}")
        return self._buf[self.stats.index(name), :, :, : self.pages]

    @property
    def mean(self) -> torch.Tensor:
        """[B, Hkv, pages, D] (the keys' dtype)."""
        return self._view("mean")

    @property
    def min(self) -> torch.Tensor:
        return self._view("min")

    @property
    def max(self) -> torch.Tensor:
        return self._view("max")

    @property
    def lo(self) -> torch.Tensor:
        """ArkVale's digest, lower end: centre - mean |k - centre| [B, Hkv, pages, D]."""
        return self._view("lo")

    @property
    def hi(self) -> torch.Tensor:
        return self._view("hi")

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
            buf = k.new_zeros(len(self.stats), b, h, cap, d)
            if self._buf is not None:
                buf[:, :, :, : self.pages] = self._buf[:, :, :, : self.pages]
            self._buf = buf
        out = dict(zip(self.stats, self._buf[:, :, :, self.pages: full]))
        if "mean" in out:
            page_means(k, self.size, out=out["mean"])
        box = "lo" in out or "hi" in out
        ends = []
        for name, op in (("min", torch.amin), ("max", torch.amax)):
            if name in out:
                ends.append(op(pages, dim=3, out=out[name]))
            elif box:
                ends.append(op(pages, dim=3))
        if box:  # ArkVale's box, in fp32
            centre = (ends[0].float() + ends[1].float()) / 2
            spread = (pages.float() - centre[:, :, :, None]).abs().mean(dim=3)
            for name, t in (("lo", centre - spread), ("hi", centre + spread)):
                if name in out:
                    out[name].copy_(t)
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
        return 0 if self._buf is None else len(self.stats) * self._buf[0, :, :, : self.pages].nbytes
