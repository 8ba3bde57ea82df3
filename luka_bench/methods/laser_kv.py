"""LASER-KV (Sood, Sharma & Agrawal, "More than a Quick Glance: Overcoming the Greedy Bias in KV-Cache
Compression"): block-wise, accumulative prefill compression with Exact + LSH selection.

The context is prefilled in blocks of ``block_size`` (S) tokens (the runner honours ``prefill_chunk()``). After
each block's forward (``after_forward``) one set of tokens is chosen for every layer and head alike:

- budget ``B = floor(2 r S L / (S + L))`` (``r`` = ``budget``, L = context length), ``A = W = B // n`` with the
  protection divisor ``n``, and ``G = B - 2 (B // n)`` per block for the long-term pool;
- anchors: the first ``A`` tokens of the context are always kept;
- local window: the last ``W`` tokens of the block (fewer if the block is short) are kept *for now*: they are the
  block's look-back tail. The next block is computed over everything held (kept tokens + this tail) and its
  *scoring window* is tail + block; its candidates are the tail plus the block's tokens that are neither anchors
  nor its own tail; after the last block the last tail stays;
- from the candidates, ``min(G, |C|)`` are selected: ``floor(alpha G)`` by exact attention (``S_exact``: the
  scoring queries' softmax over the scoring window's keys, fp32, summed over every layer, query head and query),
  the rest, among the candidates not yet chosen, by SimHash LSH collision frequency (``S_lsh``: ``lsh_tables``
  tables of ``lsh_bits`` sign bits of random hyperplanes; a key collides with a query in a table when all its
  bits agree; the fraction of tables that collide, summed over every layer, query head and query — MagicPIG's
  estimate of ``(1 - angle / pi) ** lsh_bits``). Unselected candidates are dropped from every layer: later
  blocks never see them.

Scoring queries: ``question_aware`` (default, as the reference code): the question (``MethodCache.question_ids``)
is run after every block as a *scratch* forward at the positions right after the whole context
(``MethodCache.scratch_forward``; its keys/values are then dropped). Question-agnostic (or no question, e.g.
perplexity): the queries of the block's own local window (its last ``W`` tokens), with the causal mask.

``budget`` 1.0 keeps everything (no scoring, no scratch forward). Sliding-window layers (Gemma3) keep exact
windowed attention and take no part in the scores or the selection.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from luka_bench.methods.base import KVMethod, LayerPolicy, MethodConfigError, setting
from luka_bench.methods.attention import exact_attention, group_logits, top_indices

STATE = "laser_kv"
QUERY_CHUNK = 256  # scoring queries are processed this many at a time: never a [L, L] weight matrix


def budget_split(context: int, block_size: int, r: float, divisor: int) -> tuple[int, int, int, int]:
    """(B, anchors A, local window W, long-term pool G per block) for a context of ``context`` tokens."""
    b = math.floor(2 * r * block_size * context / (block_size + context) + 1e-9) if context > 0 else 0
    a = b // divisor
    return b, a, a, b - 2 * a


def held_tokens(context: int, block_size: int, r: float, divisor: int) -> int:
    """Tokens every full-attention layer holds after the prefill of ``context`` tokens (the closed form the
    method follows): anchors + sum over blocks of min(G, |candidates|) + the last block's tail."""
    if r >= 1.0:
        return context
    _, a, w, g = budget_split(context, block_size, r, divisor)
    held, tail = min(a, context), 0
    for start in range(0, context, block_size):
        size = min(block_size, context - start)
        anchors = max(0, min(a, start + size) - start)
        local = min(w, size - anchors)
        held += min(g, tail + size - anchors - local)
        tail = local
    return held + tail


def simhash_codes(x: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """SimHash codes: x [..., D], planes [R, K, D] -> int64 [..., R] (the K sign bits of each table packed)."""
    r, k, d = planes.shape
    bits = (x.to(planes.dtype) @ planes.reshape(r * k, d).T > 0).view(*x.shape[:-1], r, k)
    return (bits.long() << torch.arange(k, device=x.device)).sum(-1)


def collision_counts(q_codes: torch.Tensor, k_codes: torch.Tensor, bits: int) -> torch.Tensor:
    """For every key, the number of (query, table) pairs whose codes are equal, summed over the queries.
    q_codes [H, Q, R], k_codes [H, M, R] (H: query groups that share keys) -> [H, M] float32. Uses a histogram of
    the query codes per table (O((Q + M) R), no [Q, M, R] tensor)."""
    h, nq, r = q_codes.shape
    hist = torch.zeros(h, r, 1 << bits, dtype=torch.float32, device=q_codes.device)
    hist.scatter_add_(2, q_codes.transpose(1, 2), torch.ones(h, r, nq, device=q_codes.device))
    return hist.gather(2, k_codes.transpose(1, 2)).sum(1)  # [H, M]


class LaserKVPolicy(LayerPolicy):
    exact_decode = True  # ``attend`` scores in the prefill and the question's scratch forward; decodes exactly

    def attend(self, store, query, scaling):
        out = exact_attention(store, query, scaling)
        m = self.method
        cache = store.cache
        if m.budget >= 1.0:
            return out
        st = m.state(cache)
        if cache.phase == "scratch" and st["scoring"]:  # the question, after the whole context
            w0 = st["w0"]
            self.score(st, query, store.keys[:, :, w0: store.n - query.shape[2]], scaling, causal=False)
        elif cache.phase == "prefill" and not st["question"]:  # question-agnostic: the block's local window
            _, a, w, _ = m.split(cache)
            start = store.seen - query.shape[2]
            local = min(w, query.shape[2] - max(0, min(a, store.seen) - start))
            if local > 0:
                w0 = st["w0"]
                self.score(st, query[:, :, -local:], store.keys[:, :, w0:], scaling, causal=True)
        return out

    def score(self, st: dict, q: torch.Tensor, k: torch.Tensor, scaling: float, causal: bool) -> None:
        """Add this layer's exact and LSH scores of the window keys k [B, Hkv, M, D] from the queries
        q [B, Hq, Q, D] (causal: the queries are the last Q of the window) to the shared accumulators."""
        b, hq, nq, d = q.shape
        hkv, mlen = k.shape[1], k.shape[2]
        g = hq // hkv
        qg = q.reshape(b, hkv, g, nq, d)
        exact = torch.zeros(b, mlen, dtype=torch.float32, device=k.device)  # per batch row: each row selects its own
        if self.method.alpha > 0:
            for s in range(0, nq, QUERY_CHUNK):
                qc = qg[:, :, :, s: s + QUERY_CHUNK]
                logits = group_logits(qc, k, scaling)  # [B, Hkv, g, c, M]
                if causal:
                    qpos = mlen - nq + torch.arange(s, s + qc.shape[3], device=k.device)
                    visible = torch.arange(mlen, device=k.device)[None, :] <= qpos[:, None]
                    logits = logits.masked_fill(~visible, float("-inf"))
                exact += torch.softmax(logits, dim=-1).sum(dim=(1, 2, 3))
        lsh = torch.zeros(b, mlen, dtype=torch.float32, device=k.device)
        if self.method.alpha < 1:
            planes = self.method.planes(st, d, k.device)
            qc = simhash_codes(qg.reshape(b * hkv, g * nq, d), planes)  # [B*Hkv, g*Q, R]
            kc = simhash_codes(k.reshape(b * hkv, mlen, d), planes)  # [B*Hkv, M, R]
            # collisions counted, not divided by R: integer sums are exact in fp32, so ties rank the same
            # whatever the order of summation (the frequency is this / R, a constant factor)
            lsh = collision_counts(qc, kc, self.method.lsh_bits).view(b, hkv, mlen).sum(1)
            # (causality does not matter here: every candidate lies before every scoring query)
        if st["exact"] is None or st["exact"].shape != exact.shape:
            st["exact"], st["lsh"] = exact, lsh
        else:
            st["exact"] += exact
            st["lsh"] += lsh
        if st.get("trace") is not None:  # tests: the inputs of the selection, for a slow reference
            st["trace"].append({"layer": self.info.layer_idx, "q": q.detach().clone(), "k": k.detach().clone(),
                                "scaling": scaling, "causal": causal})


@dataclass
class LaserKV(KVMethod):
    """budget: the compression ratio r (1.0 keeps everything); block_size: S, the prefill block (paper 4096);
    divisor: the protection divisor n; alpha: share of the long-term pool chosen by exact attention (1: exact
    only, 0: LSH only); lsh_bits / lsh_tables: SimHash bits per table (K) and tables (R) (reference code runs
    8 / 100 and 10 / 8); question_aware: score with the question's queries (reference code) or, when False, with
    the block's local window; seed: the random hyperplanes."""

    budget: float = 0.25
    block_size: int = setting(4096, at_least=1)
    divisor: int = setting(4, at_least=3, note="anchors + window take 2B/n, n = 2 leaves nothing")
    alpha: float = setting(0.75, within="[0, 1]", note="1: exact only, 0: LSH only")
    lsh_bits: int = setting(8, at_least=1)
    lsh_tables: int = setting(100, at_least=1)
    question_aware: bool = setting(True)
    seed: int = 0

    name: ClassVar[str] = "laser_kv"
    policy_class: ClassVar[type[LayerPolicy]] = LaserKVPolicy

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lsh_bits > 16:
            raise MethodConfigError(f"method.lsh_bits={self.lsh_bits} must be <= 16 (codes are histogrammed)")


    def prefill_chunk(self) -> int:
        return self.block_size

    # -- per-prompt state (in the cache: nothing leaks between prompts) ------------------------------------
    def state(self, cache) -> dict:
        st = cache.state.get(STATE)
        if st is None:
            st = cache.state[STATE] = {
                "w0": 0,  # index of the first held token of the scoring window (the look-back tail)
                "prev_seen": 0,  # logical length before the current block
                "exact": None, "lsh": None, "scoring": False, "planes": None,
                "question": bool(self.question_aware and cache.question_ids),
            }
        return st

    def split(self, cache) -> tuple[int, int, int, int]:
        return budget_split(cache.reference_length, self.block_size, self.budget, self.divisor)

    def planes(self, st: dict, dim: int, device: torch.device) -> torch.Tensor:
        """The random hyperplanes [R, K, D] (fp32), drawn once per prompt from ``seed``."""
        if st["planes"] is None:
            # drawn on the device (a CPU draw copied over is a blocking host-to-device copy on CUDA); a CUDA
            # generator draws other planes than the CPU's, equally seeded
            gen = torch.Generator(device=device).manual_seed(self.seed)
            st["planes"] = torch.randn(self.lsh_tables, self.lsh_bits, dim, generator=gen, device=device)
        return st["planes"]

    def after_prefill_cache(self, cache) -> None:
        """After the prefill (every block selected in ``after_forward``): the per-layer hooks, then the per-prompt
        scoring state is dropped — the random hyperplanes (``lsh_tables`` x ``lsh_bits`` x head_dim fp32) score the
        prefill's blocks only; a decode step never reads them."""
        super().after_prefill_cache(cache)
        st = cache.state.get(STATE)
        if st is not None:
            st["planes"] = st["exact"] = st["lsh"] = None

    def compresses_in_forward(self, cache) -> bool:
        """As the default's (``after_prefill_cache`` above only frees the scoring state: it needs no layer's full
        cache): the layers that compress inside the forward still do."""
        return True

    # -- the block step ------------------------------------------------------------------------------------
    def after_forward(self, cache) -> None:
        if cache.phase != "prefill" or self.budget >= 1.0:
            return
        stores = [s for s in cache.stores if isinstance(s.policy, LaserKVPolicy)]
        if not stores:
            return
        st = self.state(cache)
        ref = stores[0]
        if st["question"]:
            st["exact"] = st["lsh"] = None
            st["scoring"] = True
            try:
                cache.scratch_forward(cache.question_ids, cache.reference_length)
            finally:
                st["scoring"] = False
        pos, w0 = ref.positions[:, 0], st["w0"]  # every KV head holds the same tokens; each batch row its own
        picks = []
        for row in range(pos.shape[0]):  # each row selects from its own scores (the same block geometry)
            st["w0"] = w0
            picks.append(self.select(st, pos[row], ref.n, ref.seen, cache, row))
        if len({p.numel() for p in picks}) > 1:
            raise MethodConfigError(f"method={self.name}: the rows of a batch kept different numbers of tokens "
                                    f"({', '.join(str(p.numel()) for p in picks)}); allowed: rows of one length")
        index = picks[0] if len(picks) == 1 else torch.stack(picks)[:, None].expand(-1, ref.keys.shape[1], -1)
        for s in stores:
            s.keep(index)
        st["prev_seen"] = ref.seen
        st["exact"] = st["lsh"] = None

    def select(self, st: dict, positions: torch.Tensor, n: int, seen: int, cache, row: int = 0) -> torch.Tensor:
        """Held-token indices to keep after the block that ends at logical position ``seen``, for batch row ``row``;
        sets the next block's window start. positions [n]: logical positions of the held tokens (time order)."""
        _, a, w, g = self.split(cache)
        w0, start = st["w0"], st["prev_seen"]
        dev = positions.device
        pos = positions[w0:n]
        size = seen - start
        anchors_in_block = max(0, min(a, seen) - start)
        local = min(w, size - anchors_in_block)
        is_anchor = pos < a
        is_local = (pos >= seen - local) & ~is_anchor
        cand = ~is_anchor & ~is_local
        n_cand = int(cand.sum())
        keep = is_anchor | is_local
        if n_cand <= g:
            keep = keep | cand
        else:
            k_exact = min(math.floor(self.alpha * g + 1e-9), n_cand)
            chosen = torch.zeros_like(cand)
            if k_exact > 0:
                sc = st["exact"][row] if st["exact"] is not None else torch.zeros(pos.shape[0], device=dev)
                chosen[top_indices(sc.masked_fill(~cand, float("-inf")), k_exact)] = True
            k_lsh = g - k_exact
            if k_lsh > 0:
                rest = cand & ~chosen
                sc = st["lsh"][row] if st["lsh"] is not None else torch.zeros(pos.shape[0], device=dev)
                chosen[top_indices(sc.masked_fill(~rest, float("-inf")), k_lsh)] = True
            keep = keep | chosen
        index = torch.cat([torch.arange(w0, device=dev), w0 + keep.nonzero().flatten()])
        st["w0"] = index.numel() - local  # the next scoring window starts at this block's tail
        return index
