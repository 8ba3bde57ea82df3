"""ArkVale: page eviction and recall by page digests at decode time (Chen et al., "ArkVale: Efficient Generative LLM
Inference with Recallable Key-Value Eviction", NeurIPS 2024; reference code pku-liang/ArkVale @ 0c3b45e).

The held tokens are cut into pages of ``page_size`` consecutive slots from position 0 (the store only appends, so
slot order is time order). The page holding the newest token is *open*; the pages before it are *closed* and have a
digest (``PagedKeys`` with ``stats=("lo", "hi")``): per channel, the centre c = (min + max) / 2 of the page's keys
minus / plus the mean absolute deviation mean_t |k_t - c| (``source/arkvale/infer_state.py`` L448-462) — a box
shrunk around the centre, NOT the min/max box: its score

    score(q, page) = sum_d max(q_d * hi_d, q_d * lo_d)        (``estimate.cu`` L43; ``pages.page_bound``, fp32)

is an estimate, not an upper bound of q.k over the page (Quest's is). A page's score for a group of query heads is
the mean over the group's query heads (each against the digest of its own KV head; ``estimate.cu`` L556-560);
``group``: ``layer`` (the reference's default, one group: all heads share the pages) or ``kv_head``.

The device cache ("GPU pages") holds ``page_budget`` pages per group: the ``sink_pages`` first pages, the
``window_pages`` last pages (the open page and the newest closed ones) and M = page_budget - sink_pages -
window_pages others; the rest is offloaded ("CPU pages"). Attention reads every page of the device cache — the
reference's default decode path (``use_sparse_attn`` is asserted off, ``adapter/modeling.py`` L160-165), not only
the top-k.
- After the prefill (``after_prefill``), when the prompt has more than ``page_budget`` pages, the device cache keeps
  max(2, sink_pages) first pages, the window, and the page_budget - max(2, sink_pages) - window_pages candidate
  pages with the best score for the prefill's LAST query, averaged over every query head of the layer, whatever
  ``group`` is (``prefill_evict_extra_pages``, L490-500).
- At every decode step the candidate pages (closed, neither sink nor window; offloaded ones included: their digests
  stay on the device) are scored; the top k' = topk - sink_pages - (window_pages - 1) of them (L89-92: ``topk``
  counts the sink and the window's closed pages) must be on the device: those that are not are *recalled*, each
  replacing the lowest-scoring device page (``select.cu``, ``SelectTopkKernel``). Equivalently: the device's M
  candidate pages become the top M by key = +inf for the top k', the score for a page on the device, -inf for an
  offloaded one (what we compute: two ``topk``, no loop).
- When a page closes, the page leaving the window is dropped from the device (``kv_cache.py``
  ``_decode_alloc_1_page``: its slot is reused for the newer window page) unless the cache is not full yet.
- The first ``full_layers`` layers (the reference's ``n_unlimited_layers``, 2) are dense; so is a layer while it
  holds at most ``page_budget`` pages, the prefill, and a multi-token chunk after it (the question).

Memory: every token stays in the store (the offloaded pages are the "host" copy; on the CPU device and host are the
same memory), so ``kv_bytes`` counts them; ``method_stats`` says what is where: ``offloaded_bytes`` (keys and
values of the pages off the device, summed over layers) and ``device_bytes`` (``real_bytes`` less those:
``MethodCache.method_report``).

Shapes: query [B, Hq, 1, D]; keys/values [B, Hkv, n, D]; digests [B, Hkv, pages, D]; scores and the device set
[R, pages] with R = B (``layer``) or B * Hkv (``kv_head``); pages read [R, page_budget]. The decode step is
fixed-shape and free of host syncs between page closings (``static_decode``, ``storage_multiple`` as Quest): the
device set is an additive bias [R, pages] (0 on the device, -inf offloaded) updated in place; the pages read are
gathered from the storage in one ``index_select`` of page rows; the open page's free slots are masked by the mask
``DecodeStep.held_mask`` opens one slot per step for all layers. A page closing is an event (``layout_events``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from luka_bench.device import host_to_device
from luka_bench.methods.attention import add_retrieval_spans, kv_rows, sdpa, timed_exact
from luka_bench.methods.base import KVMethod, LayerInfo, LayerPolicy, MethodConfigError, setting
from luka_bench.methods.pages import PagedKeys, gather_pages, page_bound

GROUPS = ("layer", "kv_head")
NEG = float("-inf")


def arkvale_scores(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, per_layer: bool) -> torch.Tensor:
    """Digest scores of every page for one query per head, query [B, Hq, 1, D], digests ``lo`` / ``hi`` [B, Hkv, P,
    D]: the mean over a group's query heads of sum_d max(q_d hi_d, q_d lo_d), each query head against its own KV
    head's digests; [B, P] (``per_layer``: one group, every head of the layer) or [B * Hkv, P] (a group per KV head);
    fp32."""
    b, hq, _, d = query.shape
    hkv, p = lo.shape[1], lo.shape[2]
    s = page_bound(query.reshape(b * hkv, hq // hkv, d), hi.reshape(b * hkv, p, d), lo.reshape(b * hkv, p, d))
    return s.view(b, hq, p).mean(1) if per_layer else s.mean(1)


class ArkValePolicy(LayerPolicy):
    times_itself = True  # retrieval (choosing what to read) and attention (reading it), timed inside

    static_decode = True  # the decode step's token at a slot held on the device; shapes fixed between page closings

    def __init__(self, method: "ArkVale", info: LayerInfo):
        super().__init__(method, info)
        self.storage_multiple = method.page_size
        self.paged = PagedKeys(method.page_size, stats=("lo", "hi"))
        self.layout_events = 0  # page closings seen by the decode step (host_sync.events / launches.event_count)
        self._q_last: torch.Tensor | None = None  # the prefill's last query [B, Hq, 1, D] (its eviction's scorer)
        # the device set: [R, pages of the storage] fp32, 0 on a page on the device, -inf on an offloaded one (and
        # on pages not yet closed); None while every page is on the device (the layer holds <= page_budget pages)
        self.res: torch.Tensor | None = None
        self._c = 0  # closed pages the device set accounts for
        self._layout: tuple | None = None  # (closed pages C, storage capacity) the tensors below fit
        self._cand: torch.Tensor | None = None  # [1, C] 0 on a candidate page, -inf on sink and window pages
        self._head: torch.Tensor | None = None  # [R, sink_pages] the sink pages' ids
        self._tail: torch.Tensor | None = None  # [R, window_pages] the window's page ids (the open page last)
        self._off: torch.Tensor | None = None  # the first page row of each KV head in the storage's page view
        self.pid: torch.Tensor | None = None  # the last sparse step's pages read [R, page_budget] (None: all)
        self.n_read = 0  # tokens held at that step

    # -- groups ------------------------------------------------------------------------------------------------
    @property
    def per_layer(self) -> bool:
        return self.method.group == "layer"

    def _rows_of(self, b: int, hkv: int) -> int:
        return b if self.per_layer else b * hkv

    def _candidates_end(self, c: int) -> int:
        """The candidate pages are [sink_pages, end): closed, before the window's closed pages."""
        return c - self.method.window_pages + 1

    # -- the prefill -------------------------------------------------------------------------------------------
    def attend(self, store, query, scaling):
        if store.cache.phase == "prefill":
            self._q_last = query[:, :, -1:].clone()  # the last prefill chunk's stays: the prompt's last query
        self.pid = None
        return timed_exact(store, query, scaling)

    def after_prefill(self, store) -> None:
        """Evict the prompt's pages beyond ``page_budget`` (the reference's ``prefill_evict_extra_pages``): keep
        max(2, sink_pages) first pages, the window and the best-scoring candidates for the prompt's last query,
        averaged over every query head of the layer (one selection for all groups, as the reference)."""
        m = self.method
        q, self._q_last = self._q_last, None
        n = store.n
        c = (n - 1) // m.page_size
        self._c, self.res, self._layout = c, None, None
        if c + 1 <= m.page_budget or q is None:
            return
        self.paged.update(store)
        b, hkv = store.keys.shape[:2]
        ns = max(2, m.sink_pages)
        end = self._candidates_end(c)
        score = arkvale_scores(q, self.paged.lo[:, :, :c], self.paged.hi[:, :, :c], True)  # [B, C]
        score[:, :ns] = NEG
        score[:, end:] = NEG
        keep = torch.topk(score, m.page_budget - ns - m.window_pages, dim=-1).indices
        res = torch.full((b, store.storage()[0].shape[2] // m.page_size), NEG, device=score.device)
        res.scatter_(1, keep, 0.0)
        res[:, m.sink_pages: ns] = 0.0  # the prefill's extra sink pages stay, as decode-time candidates
        self.res = res if self.per_layer else res.repeat_interleave(hkv, dim=0)

    # -- the decode step -----------------------------------------------------------------------------------------
    def step(self, store, query, scaling, step):
        m = self.method
        ps, n = m.page_size, store.n
        c = (n - 1) // ps
        if c + 1 <= m.page_budget:  # every page on the device and read
            return self.attend(store, query, scaling)
        t0 = store.cache.mark(query.device)
        self._fit(store, query, c)
        b, hq, _, d = query.shape
        hkv = store.storage()[0].shape[1]  # not store.keys: a view sliced at n, a number that changes every step
        lo, hi = self.paged.lo[:, :, :c], self.paged.hi[:, :, :c]
        s = arkvale_scores(query, lo, hi, self.per_layer) + self._cand  # [R, C]: -inf on sink and window pages
        top = torch.topk(s, m.topk - m.sink_pages - m.window_pages + 1, dim=-1).indices
        # the device's M candidate pages: the top k' (recalled if offloaded), then the best of those on the device
        key = s + self.res[:, :c]
        key.scatter_(1, top, float("inf"))
        dev = torch.topk(key, m.page_budget - m.sink_pages - m.window_pages, dim=-1).indices  # [R, M]
        self.res[:, :c].fill_(NEG).scatter_(1, dev, 0.0)
        self.pid = pid = torch.cat([self._head, dev, self._tail], dim=-1)  # [R, page_budget]
        self.n_read = n
        w = m.page_budget * ps
        rows = ((pid[:, None, :] if self.per_layer else pid) + self._off).view(-1)
        t1 = store.cache.mark(query.device)
        ksel, vsel = gather_pages(store, rows, ps, b, hkv, w)  # [B, Hkv, w, D]
        # the open page (read last) holds n - c * ps tokens; its slots from n on are free: masked
        before = (m.page_budget - 1) * ps - c * ps
        mask = step.held_mask(store, "arkvale", w, before + n, 1, query.dtype).view(1, 1, 1, w)
        out = sdpa(query, ksel, vsel, scaling, mask)
        add_retrieval_spans(store, t0, t1)
        return out

    def _fit(self, store, query, c: int) -> None:
        """Close the pages completed since the last call (their digests; the page leaving the window goes off the
        device once the cache is full) and remake what depends on the page layout and the storage's capacity (an
        event step: a page closed; or the storage grew)."""
        m = self.method
        ps = m.page_size
        cap = store.storage()[0].shape[2]
        if self._layout == (c, cap):
            return
        if self.paged.pages < c:
            self.paged.update(store)
        b, hq = query.shape[:2]
        hkv = store.storage()[0].shape[1]
        r, pages, dev = self._rows_of(b, hkv), cap // ps, query.device
        if self.res is None:  # the cache fills up now: the first M candidates on the device, the newer ones not
            self.res = self._filling(r, pages, dev)
        elif self.res.shape[1] < pages:  # the storage grew: pages beyond the old capacity are not on the device
            res = torch.full((r, pages), NEG, device=dev)
            res[:, : self.res.shape[1]] = self.res
            self.res = res
        if self._layout is None or self._layout[0] != c:
            self.layout_events += 1
            self._c = c
        cand = torch.zeros(1, c, device=dev)
        cand[:, : m.sink_pages] = NEG
        cand[:, self._candidates_end(c):] = NEG
        self._cand = cand
        self._head = torch.arange(m.sink_pages, device=dev).expand(r, m.sink_pages)
        self._tail = torch.arange(c - m.window_pages + 1, c + 1, device=dev).expand(r, m.window_pages)
        base = torch.arange(b * hkv, device=dev) * pages
        self._off = base.view(b, hkv, 1) if self.per_layer else base.view(b * hkv, 1)
        self._layout = (c, cap)

    def _filling(self, r: int, pages: int, dev: torch.device) -> torch.Tensor:
        """The device set of a cache filling up now: the first M candidates on the device, the newer ones not."""
        m = self.method
        res = torch.full((r, pages), NEG, device=dev)
        res[:, m.sink_pages: m.page_budget - m.window_pages] = 0.0
        return res

    # -- stacked rows of a batch (``stacked.py``): every row's pages scored, recalled and read at once ------------
    stacked_select = True

    def stacked_plan(self, store):
        """"dense" while the layer holds at most ``page_budget`` pages (every page read), else "sparse"."""
        m = self.method
        return "dense" if (store.n - 1) // m.page_size + 1 <= m.page_budget else "sparse"

    def stacked_attend(self, layer, query, scaling):
        """``step`` for every row: the rows' digests and device sets stacked (``_stacked_fit``; each row's device set
        a view of its rows of the stack, so it carries on alone where the stack left it), a row's pages from its
        own candidates' end on scored -inf, the two ``topk`` and the device sets' update once for all rows, the
        pages read gathered from the stacked storage in one ``index_select``, each row's open page's free slots
        masked."""
        stores = layer.stores
        if layer.plans[0] == "dense":
            return layer.exact_step(query, scaling, pid=None)
        m = self.method
        ps = m.page_size
        b, hq, _, d = query.shape
        hkv = layer.kv.shape[2]
        cs = [(s.n - 1) // ps for s in stores]
        st = self._stacked_fit(layer, cs, b, hkv)
        c = max(cs)
        s = arkvale_scores(query, st["lo"][:, :, :c], st["hi"][:, :, :c], self.per_layer) + st["cand"]
        top = torch.topk(s, m.topk - m.sink_pages - m.window_pages + 1, dim=-1).indices
        res = st["res"][:, :c]
        key = s + res
        key.scatter_(1, top, float("inf"))
        dev = torch.topk(key, m.page_budget - m.sink_pages - m.window_pages, dim=-1).indices
        res.fill_(NEG).scatter_(1, dev, 0.0)
        pid = torch.cat([st["head"], dev, st["tail"]], dim=-1)  # [R, page_budget]
        w = m.page_budget * ps
        rows = ((pid[:, None, :] if self.per_layer else pid) + st["off"]).view(-1)
        kv = kv_rows(layer.kv.view(2, -1, ps * d), rows).view(2, b, hkv, w, d)
        # each row's open page open up to its slot of the step: entry j reads slot j - before (``st["before"]``)
        mask = layer.stack.step_mask(layer.layout, st["before"], w, query.dtype, query.device)
        out = sdpa(query, kv[0], kv[1], scaling, mask.view(b, 1, 1, w))
        r1 = pid.shape[0] // b
        for i, row in enumerate(stores):
            row.policy.pid, row.policy.n_read = pid[i * r1: (i + 1) * r1], row.n
        return out

    def _stacked_fit(self, layer, cs: list[int], b: int, hkv: int) -> dict:
        """The rows' stacked digests [B, Hkv, pages, D] and device sets [R, pages] (made with the storage: each row's
        device set then a view of its rows), and what follows each row's closed pages — its candidates, window and
        open page's mask (moved on for the rows whose pages closed: each row's own digests updated first, an event
        as in ``_fit``)."""
        st, stores = layer.state, layer.stores
        m = self.method
        ps, dev = m.page_size, layer.kv.device
        pages = layer.cap // ps
        r1 = 1 if self.per_layer else hkv
        if st.get("arkvale") != layer.cap:
            res = torch.full((b * r1, pages), NEG, device=dev)
            for i, s in enumerate(stores):
                p = s.policy
                own = res[i * r1: (i + 1) * r1]
                if p.res is None:  # the cache fills up now (as ``_fit``)
                    own.copy_(p._filling(r1, pages, dev))
                else:
                    width = min(pages, p.res.shape[1])
                    own[:, :width] = p.res[:, :width]
                p.res = own
            base = torch.arange(b * hkv, device=dev) * pages
            st.update(arkvale=layer.cap, res=res, cs=[0] * b, lo=layer.kv.new_zeros(b, hkv, pages, layer.kv.shape[-1]),
                      hi=layer.kv.new_zeros(b, hkv, pages, layer.kv.shape[-1]),
                      off=base.view(b, hkv, 1) if self.per_layer else base.view(b * hkv, 1),
                      head=torch.arange(m.sink_pages, device=dev).expand(b * r1, m.sink_pages))
        if st["cs"] != cs:
            for i, (c0, c1) in enumerate(zip(st["cs"], cs)):
                if c0 == c1:
                    continue
                p = stores[i].policy
                if p.paged.pages < c1:
                    p.paged.update(stores[i])
                st["lo"][i, :, c0:c1] = p.paged.lo[0, :, c0:c1]
                st["hi"][i, :, c0:c1] = p.paged.hi[0, :, c0:c1]
                p.layout_events += 1
                p._c, p._layout = c1, None  # alone again, its own step remakes its layout
            j = torch.arange(max(cs), device=dev)
            ends = host_to_device([self._candidates_end(c) for c in cs], dev).view(b, 1)
            cand = torch.where((j >= m.sink_pages) & (j < ends), 0.0, NEG)  # [B, C]
            tails = host_to_device([c - m.window_pages + 1 for c in cs], dev).view(b, 1, 1)
            tail = (tails + torch.arange(m.window_pages, device=dev)).expand(b, r1, m.window_pages)
            st.update(cs=list(cs), key=(layer.cap, tuple(cs)), cand=cand.repeat_interleave(r1, dim=0),
                      tail=tail.reshape(b * r1, m.window_pages), before=[(m.page_budget - 1 - c) * ps for c in cs])
        return st

    # -- what the last step read -------------------------------------------------------------------------------
    def attended(self, store):
        """The tokens of the pages read [B, Hkv, n] (one set per group; None: everything)."""
        if self.pid is None:
            return None
        ps, n = self.method.page_size, self.n_read
        b, hkv = store.keys.shape[:2]
        pages = (n - 1) // ps + 1
        u = torch.zeros(self.pid.shape[0], pages, dtype=torch.bool, device=self.pid.device).scatter_(1, self.pid, True)
        u = u.view(b, 1, pages).expand(b, hkv, pages) if self.per_layer else u.view(b, hkv, pages)
        return u[..., None].expand(b, hkv, pages, ps).reshape(b, hkv, -1)[:, :, :n]

    def attended_count(self, store):
        """page_budget distinct pages per group, the open page's free slots less: known on the host."""
        if self.pid is None:
            return float(store.n)
        ps, n = self.method.page_size, self.n_read
        return float(self.method.page_budget * ps - (((n - 1) // ps + 1) * ps - n))

    # -- memory ----------------------------------------------------------------------------------------------
    def offloaded_pages(self, store) -> int:
        """Pages per group off the device: every page beyond ``page_budget`` once the cache is full (the device
        always holds exactly page_budget pages then)."""
        if self.res is None or store.n == 0:
            return 0
        return max(0, (store.n - 1) // self.method.page_size + 1 - self.method.page_budget)

    def extra_bytes(self) -> int:
        return self.paged.nbytes()  # the digests (on the device, for every page)

    def report(self, store) -> dict[str, float]:
        off = self.offloaded_pages(store) * self.method.page_size * store.token_bytes() if store.n else 0
        return {"pages_offloaded": float(self.offloaded_pages(store)), "offloaded_bytes": float(off)}


@dataclass
class ArkVale(KVMethod):
    """page_size: tokens per page; page_budget: pages per group on the device (sink and window included) — the
    pages every decode step reads; topk: pages a step must have on the device (recalled if offloaded), counting
    the sink pages and the window's closed pages (the reference's ``page_topks``); sink_pages / window_pages: first
    / last pages never evicted (the window includes the open page); group: ``layer`` (all heads share the pages,
    the reference's default) or ``kv_head``; full_layers: first layers with full attention (``n_unlimited_layers``).
    ``budget`` must be 1.0: every raw token is held (on the device or offloaded)."""

    budget: float = setting(1.0, holds_every_token="on the device or offloaded; the pages read per step are "
                                                     "method.page_budget")
    page_size: int = setting(32, at_least=1)
    page_budget: int = setting(128, at_least=1)
    topk: int = setting(32, at_least=1)
    sink_pages: int = setting(1, at_least=0)
    window_pages: int = setting(2, at_least=2)  # the reference asserts n_win_pages >= 2
    group: str = "layer"
    full_layers: int = 2

    name: ClassVar[str] = "arkvale"
    policy_class: ClassVar[type[LayerPolicy]] = ArkValePolicy

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group not in GROUPS:  # its own message: "is not one of [...]"
            raise MethodConfigError(f"method.group={self.group!r} is not one of {list(GROUPS)} (pages shared by the "
                                    "whole layer, the reference's default, or per KV head)")
        pinned = self.sink_pages + self.window_pages - 1
        if self.topk <= pinned:
            raise MethodConfigError(
                f"method.topk={self.topk} must exceed sink_pages + window_pages - 1 = {pinned} (it counts the sink and "
                f"the window's closed pages), e.g. method.topk={pinned + 31}")
        if self.page_budget <= self.topk:
            raise MethodConfigError(f"method.page_budget={self.page_budget} must exceed method.topk={self.topk} "
                                    f"(allowed: page_budget >= {self.topk + 1}, as the reference asserts)")
        if self.page_budget < max(2, self.sink_pages) + self.window_pages:
            raise MethodConfigError(
                f"method.page_budget={self.page_budget} is below max(2, sink_pages) + window_pages = "
                f"{max(2, self.sink_pages) + self.window_pages} (the pages the prefill's eviction always keeps)")
