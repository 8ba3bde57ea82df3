"""Quest: query-aware page selection at decode time (Tang et al., "Quest: Query-Aware Sparsity for Efficient
Long-Context LLM Inference", ICML 2024; reference code mit-han-lab/Quest @ 01c1623).

Every raw token is held (``budget`` must be 1.0). The held tokens are cut into pages of ``page_size`` consecutive
slots from position 0 (the store only appends, so slot order is time order); per page the per-channel minimum m
and maximum M of its post-RoPE keys are kept (``PagedKeys``, closed as pages fill during the decode). At every
decode step, on every layer from ``full_layers`` on, each QUERY head q scores every page by Quest's upper bound
of q.k over the page (paper Alg. 1; ``evaluation/quest_attention.py`` L146-184)

    bound(q, page) = sum_d max(q_d * M_d, q_d * m_d)   (computed as relu(q).M + min(q, 0).m, fp32)

and attends exactly over ``K = min(max(3, token_budget // page_size), n_pages)`` pages (reference L56) with
``n_pages = ceil(held / page_size)``: the page holding the newest token (the last page, incomplete unless the held
count is a multiple of ``page_size``) is always one of them, as in the reference's CUDA path (``page_budget`` is
"the real page budget including the last page", ``quest/utils/controller.py``), and the other K - 1 are the
closed pages with the largest bound: ``select="kernel"`` (the default). ``select="evaluation"`` is the rule of
the reference's PyTorch evaluation path, which produced the paper's accuracy numbers (``quest_attention.py``
L23-65, L146-218): the same K pages are the top K by bound over ALL ``n_pages`` pages, the last one competing by
the bound over the tokens it holds (the newest among them: the reference pads the page with the dtype's minimum
before its per-channel max, L150-172), so the newest token is read only when its page wins.

GQA: the reference ``repeat_kv``'s the keys and selects per query head; so do we. Each query head reads its own
K pages (at most K * page_size tokens), so a KV head's tokens read are the union of its g query heads' sets: up to
g times the budget. ``attended`` / ``attended_count`` report that union per KV head (the distinct tokens a kernel
must load); the gather moves each query head's pages, g * K * page_size rows per KV head.

Full attention: the prefill, multi-token chunks (the question), a layer holding at most ``token_budget`` tokens
(budget >= the sequence), a step where K covers every page, and the first ``full_layers`` layers (2, reference
L84; there by a global counter fixed at 32, so that on a model with fewer than 32 layers the dense layers are the
counter's ids 0-1, i.e. none of the model's layers: we keep the model's first two).

Shapes: query [B, Hq, 1, D]; keys/values [B, Hkv, n, D]; page bounds [B * Hkv, g, pages]; pages read [B * Hkv, g,
K]. The decode step is fixed-shape and free of host syncs, as ``oracle_topk``'s static path: the step's token is
written at a slot held on the device (``static_decode``), the pages are read either in place (one SDPA over the
step's pages, each query head's unread pages masked -inf: ``read_pages_in_place``) or gathered from the storage's
whole capacity (a multiple of ``page_size``: ``storage_multiple``) in one ``index_select`` of page rows — in place
where the gather would move more (``reads_in_place``: the keys held at most 3x the group's pages read) — and the
last page's free slots are masked by an additive mask opened by one ``index_fill_`` per step for all layers
(``DecodeStep.held_mask``). What changes only when a page closes (the number of candidate pages, the last page's
index, the mask's layout) is rebuilt then: an event (``layout_events``), one per layer every ``page_size`` steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from luka_bench.methods.attention import add_retrieval_spans, kv_rows, sdpa, timed_exact
from luka_bench.methods.base import DeviceCount, KVMethod, LayerInfo, LayerPolicy, MethodConfigError, setting
from luka_bench.methods.pages import PagedKeys, gather_pages, page_bound  # noqa: F401 (page_bound: re-exported)


SELECT = ("kernel", "evaluation")  # which pages a step reads: Quest.select


def reads_in_place(hkv: int, hq: int, width: int, w: int) -> bool:
    """Whether a sparse step reads its pages in place — one SDPA over the ``width`` slots of the pages held, the
    pages a query head does not read masked -inf for it — rather than gathering each query head's ``w`` tokens into
    a copy first. The gather reads the group's g x w tokens, writes them and SDPA reads them again (~3 hq w per
    row); in place reads each KV head's slots once for its g query heads (hkv x width) and scores every slot (the
    masked ones for nothing): in place when hkv x width <= 3 hq w. On this project's CPU (SmolLM2, 3 KV heads of 3
    query heads, w = 1,024) at 2K held: in place 0.25 ms per layer vs the gather's 0.64 at one row, 1.6 vs 24 ms at
    8 stacked rows (the gather's copy outgrows the caches); at 8K held the gather 0.71 vs 0.79 ms at one row."""
    return hkv * width <= 3 * hq * w


def read_pages_in_place(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pid: torch.Tensor,
                        held: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of each query head over its pages ``pid`` [B * Hkv, g, K] (ids among the ``width / ps`` pages of
    keys / values [B, Hkv, width, D]) in place: one SDPA, the group's query heads folded into the query axis, with
    an additive mask -inf on the pages a query head does not read plus ``held`` [B or 1, 1 or Hkv, 1, pages, ps] (0
    on the held slots, -inf on the free ones). Equal to the gathered pages' attention up to the sum's order.
    [B, Hq, 1, Dv]"""
    b, hq, _, d = query.shape
    hkv, width = keys.shape[1], keys.shape[2]
    g, pages = hq // hkv, held.shape[-2]
    bias = torch.full((b * hkv, g, pages), float("-inf"), dtype=query.dtype, device=query.device).scatter_(2, pid, 0.0)
    mask = torch.add(bias.view(b, hkv, g, pages, 1), held).view(b, hkv, g, width)
    out = F.scaled_dot_product_attention(query.view(b, hkv, g, d), keys, values, attn_mask=mask, scale=scaling)
    return out.view(b, hq, 1, out.shape[-1])


def quest_pages(n: int, page_size: int, token_budget: int) -> int:
    """Pages a decode step reads with ``n`` held tokens (the reference's count; the last page included)."""
    n_pages = -(-n // page_size)
    return min(max(3, token_budget // page_size), n_pages)


class QuestPolicy(LayerPolicy):
    times_itself = True  # retrieval (choosing what to read) and attention (reading it), timed inside

    static_decode = True  # the decode step's token at a slot held on the device; shapes fixed between page closings

    def __init__(self, method: "Quest", info: LayerInfo):
        super().__init__(method, info)
        self.storage_multiple = method.page_size
        self.paged = PagedKeys(method.page_size)
        self.layout_events = 0  # page closings seen by the decode step (host_sync.events / launches.event_count)
        self._layout: tuple | None = None  # (candidate pages C, storage capacity, pages read K) the tensors below fit
        self._off: torch.Tensor | None = None  # [B * Hkv, 1, 1] first page row of each head in the page view
        self._last: torch.Tensor | None = None  # [B * Hkv, g, 1] the last page's index (C), per query head (kernel)
        self._zero: torch.Tensor | None = None  # 0-d zero in the query's dtype (evaluation)
        self._held: torch.Tensor | None = None  # [pages of the step, page_size] 0 held, -inf free (evaluation)
        self.pid: torch.Tensor | None = None  # the last sparse step's pages read [B * Hkv, g, K] (None: all read)
        self._union_total: torch.Tensor | None = None  # a stacked step's count of the pages its KV heads read
        self.n_read = 0  # tokens held at that step

    # -- the decode step -------------------------------------------------------------------------------------
    def attend(self, store, query, scaling):  # the prefill, its chunks, a scratch forward: exact
        self.pid = self._union_total = None
        return timed_exact(store, query, scaling)

    def step(self, store, query, scaling, step):
        """The pages read: by the default rule (``select="kernel"``) the top K - 1 closed pages and the last page;
        by ``select="evaluation"`` the top K of all pages, the last (partial) page's bound taken over the slots it
        holds (its min/max over them, the free slots masked: one per-step mask for all layers, the same that
        masks them in the attention where a query head read the last page and in the attended count)."""
        m = self.method
        n = store.n
        if n <= m.token_budget:
            return self.attend(store, query, scaling)
        ps = m.page_size
        c = (n - 1) // ps  # closed pages before the last one: the candidates
        k = quest_pages(n, ps, m.token_budget)
        if k > c:  # every page read
            return self.attend(store, query, scaling)
        t0 = store.cache.mark(query.device)
        self._union_total = None
        self._fit(store, query, c, k)
        b, hq, _, d = query.shape
        hkv = store.storage()[0].shape[1]  # not store.keys: a view sliced at n, a number that changes every step
        g, bh = hq // hkv, b * hkv
        # the bound of every candidate page for every query head (fp32)
        hi = self.paged.max[:, :, :c].reshape(bh, c, d)
        lo = self.paged.min[:, :, :c].reshape(bh, c, d)
        w = k * ps
        if m.select == "kernel":
            score = page_bound(query.reshape(bh, g, d), hi, lo)  # [B * Hkv, g, C]
            top = torch.topk(score, k - 1, dim=-1).indices  # [B * Hkv, g, K - 1]
            self.pid = pid = torch.cat([top, self._last], dim=-1)  # + the last page: [B * Hkv, g, K]
        else:  # the last page competes: its box over the slots it holds, the free ones masked
            # 0 on the n held slots of the C + 1 pages, -inf on the last page's free ones (kept for the count)
            self._held = step.held_mask(store, "quest_pages", (c + 1) * ps, n, 1, query.dtype).view(c + 1, ps)
            free = self._held[c].view(1, ps, 1)
            last = store.storage()[0].reshape(bh, -1, ps, d)[:, c]  # [B * Hkv, ps, D]
            hi = torch.cat([hi, (last + free).amax(1, keepdim=True)], dim=1)  # [B * Hkv, C + 1, D]
            lo = torch.cat([lo, (last - free).amin(1, keepdim=True)], dim=1)
            score = page_bound(query.reshape(bh, g, d), hi, lo)  # [B * Hkv, g, C + 1]
            self.pid = pid = torch.topk(score, k, dim=-1).indices  # [B * Hkv, g, K]
        self.n_read = n
        t1 = store.cache.mark(query.device)
        width = (c + 1) * ps  # the pages of the step
        if reads_in_place(hkv, hq, width, w):
            held = self._held if m.select == "evaluation" else \
                step.held_mask(store, "quest_pages", width, n, 1, query.dtype)
            K, V = store.storage()
            out = read_pages_in_place(query, K[:, :, :width], V[:, :, :width], pid, held.view(1, 1, 1, c + 1, ps),
                                      scaling)
            add_retrieval_spans(store, t0, t1)
            return out
        rows = (pid + self._off).view(-1)
        ksel, vsel = gather_pages(store, rows, ps, b, hq, w)  # [B, Hq, w, D]: each query head's pages
        if m.select == "kernel":
            # the last page's slots from n on are free: masked (0 on the K - 1 full pages read and the held slots)
            held = (k - 1) * ps + n - c * ps
            mask = step.held_mask(store, "quest", w, held, 1, query.dtype).view(1, 1, 1, w)
        else:  # the last page, wherever a query head read it, has its free slots masked
            mask = torch.where((pid == c).unsqueeze(-1), free.view(1, 1, 1, ps), self._zero).view(b, hq, 1, w)
        out = sdpa(query, ksel, vsel, scaling, mask)
        add_retrieval_spans(store, t0, t1)
        return out

    def _fit(self, store, query, c: int, k: int) -> None:
        """Close the pages completed since the last call and remake what depends on the page layout and the
        storage's capacity (an event step: a page closed; or the storage grew)."""
        cap = store.storage()[0].shape[2]
        if self._layout == (c, cap, k):
            return
        if self.paged.pages < c:
            self.paged.update(store)
        if self._layout is None or self._layout[0] != c:
            self.layout_events += 1
        b, hq = query.shape[:2]
        hkv = store.storage()[0].shape[1]
        bh, g = b * hkv, hq // hkv
        self._off = (torch.arange(bh, device=query.device) * (cap // self.method.page_size)).view(bh, 1, 1)
        if self.method.select == "kernel":
            self._last = torch.full((bh, g, 1), c, dtype=torch.long, device=query.device)
        else:  # the mask's value on the pages read in full (a tensor: no scalar made per step)
            self._zero = torch.zeros((), dtype=query.dtype, device=query.device)
        self._layout = (c, cap, k)

    # -- stacked rows of a batch (``stacked.py``): every row's pages scored, chosen and read at once ---------------
    stacked_select = True

    def stacked_plan(self, store):
        """"sparse" where ``step`` reads a selection of pages (the default rule only), "dense" where it reads all."""
        m = self.method
        if m.select != "kernel":
            return None
        n = store.n
        if n <= m.token_budget or quest_pages(n, m.page_size, m.token_budget) > (n - 1) // m.page_size:
            return "dense"
        return "sparse"

    def stacked_attend(self, layer, query, scaling):
        """``step`` for every row: the page boxes of the rows stacked ([B * Hkv, pages, D], a row's pages from its
        last on scored -inf), the top K - 1 closed pages and each row's last page gathered from the stacked storage
        in one ``index_select``, each row's free slots of its last page masked."""
        stores = layer.stores
        if layer.plans[0] == "dense":
            return layer.exact_step(query, scaling, pid=None, _union_total=None)
        ps = self.method.page_size
        b, hq, _, d = query.shape
        hkv = layer.kv.shape[2]
        g, bh = hq // hkv, b * hkv
        ns = [s.n for s in stores]
        cs = [(n - 1) // ps for n in ns]
        k = quest_pages(ns[0], ps, self.method.token_budget)
        st = self._stacked_fit(layer, cs, k, g)
        score = page_bound(query.reshape(bh, g, d), st["max"], st["min"], st["closed"])  # [B * Hkv, g, P]
        top = torch.topk(score, k - 1, dim=-1).indices
        pid = torch.cat([top, st["last"]], dim=-1)  # + each row's last page: [B * Hkv, g, K]
        w = k * ps
        if reads_in_place(hkv, hq, layer.cap, w):
            out = read_pages_in_place(query, layer.kv[0], layer.kv[1], pid,
                                      layer.layout.mask.view(b, hkv, 1, layer.cap // ps, ps), scaling)
            self._stacked_count(stores, pid, st, ns, b, hkv, g, k)
            return out
        pages = layer.kv.view(2, bh * (layer.cap // ps), ps * d)
        kv = kv_rows(pages, (pid + st["off"]).view(-1)).view(2, b, hq, w, d)
        # the slots read that hold a token, per row: (k - 1) * ps + n - c * ps, one more each step (the step's token's
        # entry, the row's slot moved by its closed pages' offset, opened once per step for all layers)
        mask = layer.stack.step_mask(layer.layout, [(k - 1 - c) * ps for c in cs], w, query.dtype, query.device)
        out = sdpa(query, kv[0], kv[1], scaling, mask.view(b, 1, 1, w))
        self._stacked_count(stores, pid, st, ns, b, hkv, g, k)
        return out

    @staticmethod
    def _stacked_count(stores, pid, st, ns, b: int, hkv: int, g: int, k: int) -> None:
        """Each row's pages read and, where several query heads share a KV head, the distinct pages its KV heads
        read (``attended_count``), for all rows at once."""
        total = None
        if g > 1:
            bh = b * hkv
            union = torch.zeros(bh, st["max"].shape[1] + 1, dtype=torch.bool, device=pid.device)
            total = union.scatter_(1, pid.view(bh, g * k), True).view(b, -1).sum(1)
        for i, s in enumerate(stores):
            p = s.policy
            p.pid, p.n_read = pid[i * hkv: (i + 1) * hkv], ns[i]
            p._union_total = None if total is None else total[i]

    def _stacked_fit(self, layer, cs: list[int], k: int, g: int) -> dict:
        """The rows' stacked page boxes, the -inf over each row's pages from its last on, each row's last page and
        page offset: made with the storage, moved on for the rows whose pages closed (each row's own ``paged``
        summarises its closed pages first: an event, as ``_fit``)."""
        st, stores = layer.state, layer.stores
        ps = self.method.page_size
        hkv, d = layer.kv.shape[2], layer.kv.shape[4]
        bh, dev = len(stores) * hkv, layer.kv.device
        if st.get("key") != (layer.cap, k):
            pages = layer.cap // ps
            st.update(key=(layer.cap, k), cs=[0] * len(stores), max=layer.kv.new_zeros(bh, pages, d),
                      min=layer.kv.new_zeros(bh, pages, d),
                      closed=torch.full((bh, 1, pages), float("-inf"), device=dev),
                      off=(torch.arange(bh, device=dev) * pages).view(bh, 1, 1))
        if st["cs"] != cs:
            for i, (c0, c1) in enumerate(zip(st["cs"], cs)):
                if c0 == c1:
                    continue
                p = stores[i].policy
                p.paged.update(stores[i])
                p.layout_events += 1
                rows = slice(i * hkv, (i + 1) * hkv)
                st["max"][rows, c0:c1] = p.paged.max[0, :, c0:c1]
                st["min"][rows, c0:c1] = p.paged.min[0, :, c0:c1]
                st["closed"][rows, :, c0:c1] = 0.0
                p._layout = None  # alone again, its own step remakes its layout
            last = [c for c in cs for _ in range(hkv)]
            st["last"] = layer.stack.constant(last, torch.long, dev).view(bh, 1, 1).expand(bh, g, 1)
            st["cs"] = list(cs)
        return st

    # -- what the last step read -------------------------------------------------------------------------------
    def _page_union(self) -> torch.Tensor:
        """[B * Hkv, pages of the step] bool: the pages any query head of the group read."""
        bh, g, k = self.pid.shape
        pages = (self.n_read - 1) // self.method.page_size + 1
        return torch.zeros(bh, pages, dtype=torch.bool, device=self.pid.device).scatter_(
            1, self.pid.view(bh, g * k), True)

    def attended(self, store):
        """The union over each KV head's query heads of the tokens read [B, Hkv, n] (None: everything)."""
        if self.pid is None:
            return None
        ps, n = self.method.page_size, self.n_read
        b, hkv = store.keys.shape[:2]
        u = self._page_union()
        return u[:, :, None].expand(*u.shape, ps).reshape(b, hkv, -1)[:, :, :n]

    def attended_count(self, store):
        if self.pid is None:
            return float(store.n)
        ps, n = self.method.page_size, self.n_read
        bh, g, k = self.pid.shape
        if self.method.select == "evaluation":  # the last page is read where it won: its held slots counted
            return DeviceCount((self._page_union()[:, :, None] & (self._held == 0)).sum(), 1.0 / bh, 0.0)
        free = ((n - 1) // ps + 1) * ps - n  # the last page's free slots (always read)
        if g == 1:  # one query head per KV head: K pages, known on the host
            return float(k * ps - free)
        total = self._union_total if self._union_total is not None else self._page_union().sum()
        return DeviceCount(total, ps / bh, -float(free))

    def extra_bytes(self) -> int:
        return self.paged.nbytes()

    def report(self, store) -> dict[str, float]:
        return {"pages_summarised": float(self.paged.pages)}


@dataclass
class Quest(KVMethod):
    """token_budget: tokens read per decode step, per layer and QUERY head, in whole pages (the reference's page
    count min(max(3, token_budget // page_size), pages held)); page_size: tokens per page (the reference's
    chunk_size); full_layers: first layers with full attention (reference: 2); select: which pages, "kernel" (the
    newest token's page always, as the reference's CUDA path) or "evaluation" (the top pages by bound, the partial
    last page competing, as its accuracy-evaluation path). ``budget`` must be 1.0: every raw token is held."""

    budget: float = setting(1.0, holds_every_token="the tokens read per step are method.token_budget")
    token_budget: int = setting(1024, at_least=1)
    page_size: int = setting(16, at_least=1)
    full_layers: int = 2
    select: str = setting("kernel", choices=SELECT)

    name: ClassVar[str] = "quest"
    policy_class: ClassVar[type[LayerPolicy]] = QuestPolicy

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token_budget < self.page_size:
            raise MethodConfigError(
                f"method.token_budget={self.token_budget} is below method.page_size={self.page_size}; allowed: "
                "token_budget >= page_size (the budget is read in whole pages, e.g. method.token_budget=1024)")
