"""The KV method interface.

A *method* (``KVMethod``) is a typed, validated config (a dataclass built by Hydra from ``conf/method/*.yaml``)
and a factory of per-layer *policies* (``LayerPolicy``). A policy holds the method's state for one layer of one
prompt; a fresh set is made for every prompt (``luka_bench.methods.hf.MethodCache``), so nothing can leak
between examples. The policy sees its layer's storage (``KVStore``: the physically held keys, values and the
logical position of every held token) and acts at these points:

====================  ==========================================================================================
``attend``            every forward of this layer, after the new keys/values were appended. Returns the
                      attention output. Default: exact attention over what is held (SDPA, GQA-aware).
                      Methods that read attention (H2O) or replace it (LuKA clustered) override it.
``after_prefill``     once, when the runner says the context has been prefilled (``MethodCache.end_prefill``).
                      Prefill-time methods (SnapKV, StreamingLLM) compress here.
``after_step``        after ``attend`` of every forward *after* the prefill (question chunk, each generated or
                      teacher-forced token). Decode-time methods (StreamingLLM, H2O, LuKA) evict/compress here.
====================  ==========================================================================================

Cross-layer methods (LASER-KV) override ``KVMethod.after_prefill(cache)``, which sees every layer at once.
Which policy runs on which layer is ``KVMethod.policy_for_layer``; sliding-window layers (Gemma3) get exact
attention within their window unless a method sets ``handles_sliding = True``.

Conventions (all methods):
- Tensors are ``[batch, heads, tokens, head_dim]``; queries have ``num_attention_heads`` heads, keys/values the
  model's ``num_key_value_heads`` (GQA). Scores are per KV head: a method sums over the query heads of a group.
- ``budget`` is the fraction of tokens held: a layer may hold at most ``capacity = ceil(budget * max(seen,
  reference_length))`` tokens, sinks and windows included, where ``seen`` is the number of tokens the layer has
  seen (the logical length) and ``reference_length`` the length the runner declared as "the context" (QA: the
  context prompt; perplexity: the document). So budget 1.0 never evicts, and the cache-to-full ratio is the
  budget. Each method card says exactly what it counts.
- Logical length (``KVStore.seen``: RoPE positions, ``cache_position``) and physical length (``KVStore.n``:
  tensors held) are kept apart. Keys are cached after RoPE, so evicting a token never changes another's position.

This module depends on torch only; everything that touches transformers internals is in ``hf.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # pragma: no cover
    from luka_bench.methods.hf import KVStore, MethodCache


class MethodConfigError(ValueError):
    """A method setting is out of range. The message is one line naming the value and what is allowed."""


@dataclass(frozen=True)
class LayerInfo:
    """What a policy may know about its layer."""

    layer_idx: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None  # set for sliding-window layers (Gemma3)
    layer_type: str = "full_attention"


class LayerPolicy:
    """Per-layer, per-prompt state and behaviour of a method. The default is exact attention (= ``full``).

    Timing (``latency_breakdown``): the attention function times ``attend`` as component ``attention`` and an
    overridden ``after_step`` as ``eviction``. A policy with finer components of its own sets
    ``times_itself = True`` and records them with ``store.cache.span`` / ``mark`` + ``add_span``."""

    times_itself: bool = False

    def __init__(self, method: "KVMethod", info: LayerInfo):
        self.method = method
        self.info = info

    # -- hook points ---------------------------------------------------------------------------------------
    def attend(self, store: "KVStore", query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of ``query`` [B, Hq, Lq, D] over everything ``store`` holds (the last Lq held tokens are the
        query tokens themselves). Returns [B, Hq, Lq, D]."""
        return exact_attention(store, query, scaling, self.info.sliding_window)

    def after_prefill(self, store: "KVStore") -> None:
        """Called once after the context prefill."""

    def after_step(self, store: "KVStore") -> None:
        """Called after ``attend`` on every forward that follows the prefill."""

    # -- what the last ``attend`` read (fidelity probe, attended-tokens metric) --------------------------------
    def attended(self, store: "KVStore") -> torch.Tensor | None:
        """Which held tokens the last ``attend`` call read: a boolean mask [B, Hkv, n] over the store's held
        tokens (per KV head; for a query chunk, the union over its queries), or None when it read every held
        token (exact attention). Methods that attend to a subset (LuKA clustered's refined pages + raw tail,
        LycheeCluster's retrieved chunks) override it; positions are ``store.positions[mask]``."""
        return None

    def attended_extra(self) -> int:
        """Entries held outside the store that the last ``attend`` call read, per KV head (LuKA's unrefined
        summaries, synthetic key/value pairs): counted as attended entries, but they have no position."""
        return 0

    # -- helpers -------------------------------------------------------------------------------------------
    def extra_bytes(self) -> int:
        """Bytes of KV-like state the policy holds besides the store (e.g. summary keys/values)."""
        return 0

    def capacity(self, store: "KVStore") -> int:
        return self.method.capacity(store.seen, store.reference_length)


class SlidingWindowPolicy(LayerPolicy):
    """Exact attention within a sliding window (Gemma3's local layers), and physically only the window: after
    every forward the layer keeps its last ``window - 1`` tokens, as transformers' own sliding layer does."""

    def attend(self, store: "KVStore", query: torch.Tensor, scaling: float) -> torch.Tensor:
        out = exact_attention(store, query, scaling, self.info.sliding_window)
        keep = self.info.sliding_window - 1
        if store.n > keep:
            store.keep_ends(0, keep)
        return out


@dataclass
class KVMethod:
    """Base of every method config. Subclasses are dataclasses with typed, checked fields.

    ``budget``: fraction of tokens held (see module docstring); 1.0 = keep everything.
    """

    budget: float = 1.0

    name: ClassVar[str] = "base"
    # True if the method wants to act on sliding-window layers too (default: they keep exact windowed attention).
    handles_sliding: ClassVar[bool] = False
    policy_class: ClassVar[type[LayerPolicy]] = LayerPolicy

    def __post_init__(self) -> None:
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (0.0 < float(b) <= 1.0):
            raise MethodConfigError(
                f"method.budget={b!r} is outside (0, 1]: it is the fraction of context tokens kept "
                "(e.g. method.budget=0.125)"
            )
        self.budget = float(b)

    # -- budget --------------------------------------------------------------------------------------------
    def capacity(self, seen: int, reference_length: int = 0) -> int:
        """Tokens a layer may hold after ``seen`` tokens: ceil(budget * max(seen, reference_length))."""
        if self.budget >= 1.0:
            return max(seen, reference_length)
        return math.ceil(self.budget * max(seen, reference_length) - 1e-9)

    # -- factory -------------------------------------------------------------------------------------------
    def policy_for_layer(self, info: LayerInfo) -> LayerPolicy:
        """The policy that runs on one layer of one prompt. Override for per-layer assignment."""
        if info.sliding_window is not None and not self.handles_sliding:
            return SlidingWindowPolicy(self, info)
        return self.policy_class(self, info)

    def after_prefill(self, cache: "MethodCache") -> None:
        """Cross-layer hook after the context prefill; the default runs every layer's policy."""
        for store in cache.stores:
            store.policy.after_prefill(store)

    def describe(self) -> str:
        return f"{self.name}(budget={self.budget:g})"


# ---------------------------------------------------------------------------------------------------------
# Attention primitives shared by the methods (pure torch).
# ---------------------------------------------------------------------------------------------------------

def chunk_mask(
    store: "KVStore", q_len: int, sliding_window: int | None
) -> torch.Tensor | None:
    """Boolean [Lq, Lk] mask for the last ``q_len`` held tokens attending to everything held, or None when
    every query may see every held key. Causality: held tokens before the chunk are all in the past (eviction
    only ever removes, appends go to the end); inside the chunk, query i sees chunk keys <= i. A sliding
    window (Gemma3: a key is visible when q_pos - k_pos < window) is applied from the logical positions."""
    n = store.n
    past = n - q_len
    windowed = sliding_window is not None and n > sliding_window
    if not windowed and (q_len == 1 or past == 0):
        return None  # decode step, or a plain causal prefill (SDPA's is_causal)
    dev = store.device
    qi = torch.arange(q_len, device=dev)
    kj = torch.arange(n, device=dev)
    mask = (kj[None, :] < past) | ((kj[None, :] - past) <= qi[:, None])
    if sliding_window is not None:
        # positions are identical across heads for a layer that never evicts per head
        k_pos = store.positions[0, 0]
        q_pos = store.seen - q_len + qi
        mask = mask & (k_pos[None, :] > q_pos[:, None] - sliding_window)
    return mask


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query SDPA without copying KV heads. query [B, Hq, Lq, D], key/value [B, Hkv, Lk, D]."""
    b, hq, lq, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    if lq == 1 and mask is None and g > 1:
        # One query per head: fold each KV group's query heads into the query-length axis, so SDPA runs once
        # per KV head with no repeated keys (faster than enable_gqa on CPU at long contexts).
        out = F.scaled_dot_product_attention(query.view(b, hkv, g, d), key, value, scale=scaling)
        return out.view(b, hq, 1, value.shape[-1])
    if mask is None and lq == key.shape[2]:
        return F.scaled_dot_product_attention(query, key, value, is_causal=lq > 1, scale=scaling,
                                              enable_gqa=g > 1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=g > 1)


def exact_attention(store: "KVStore", query: torch.Tensor, scaling: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Exact attention of the last query chunk over everything the store holds."""
    mask = chunk_mask(store, query.shape[2], sliding_window)
    return sdpa(query, store.keys, store.values, scaling, mask)


def _flash_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Causal SDPA that also returns each query's log-sum-exp of its logits (torch's CPU flash kernel, which
    computes it anyway), or None where that kernel is not available (other devices, other torch builds).
    query/key/value [B, H, L, D] with the same head size and heads."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or query.device.type != "cpu":
        return None
    try:
        out, lse = op(query, key, value, 0.0, True, scale=scale)
    except RuntimeError:  # pragma: no cover - an unsupported dtype/shape in some build: the caller falls back
        return None
    return out, lse


def _mass_by_transposed_flash(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scaling: float
                              ) -> torch.Tensor | None:
    """Column masses of a causal prefill, sum_i exp(s q_i.k_j - lse_i) over queries i >= j, without the N x N
    weights: it is a log-sum-exp over *queries* for each *key*, i.e. attention with the roles swapped. The
    -lse_i term rides in one extra head dimension (key j -> [s k_j, 1], query i -> [q_i, -lse_i], scale 1) and
    reversing both sequences turns "i >= j" into a causal mask, so the flash kernel's own lse is log(mass).
    q, k [B, H, N, D] (same heads), lse [B, H, N]. Returns mass [B, H, N] float32, or None (no kernel)."""
    b, h, n, d = q.shape
    dp = -(-(d + 1) // 8) * 8  # pad to a multiple of 8 (the kernel's vector width): same speed as d
    qt = q.new_zeros(b, h, n, dp)
    kt = q.new_zeros(b, h, n, dp)
    qt[..., :d] = k.flip(2) * scaling
    qt[..., d] = 1.0
    kt[..., :d] = q.flip(2)
    kt[..., d] = -lse.flip(2).to(q.dtype)
    res = _flash_with_lse(qt, kt, torch.zeros_like(kt), 1.0)
    if res is None:
        return None
    return res[1].flip(2).float().exp()


def attention_with_mass(store: "KVStore", query: torch.Tensor, scaling: float,
                        chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of the last query chunk over everything held, and the attention mass each held token
    received, summed over the queries and over the query heads of each KV group (GQA): returns
    (output [B, Hq, Lq, Dv], mass [B, Hkv, n] float32).

    A causal prefill (the queries are everything held) on CPU never materialises softmax weights: one flash
    SDPA gives the output and each query's log-sum-exp, a second flash pass with queries and keys swapped gives
    the column masses from them (``_mass_by_transposed_flash``); about twice an SDPA prefill's attention cost.
    Otherwise (decode steps, query chunks after a prefix, other devices) the weights are computed explicitly:
    fp32 softmax, queries ``chunk`` at a time so a long prefill never holds the N x N weights."""
    k, v = store.keys, store.values
    b, hq, lq, d = query.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    past = n - lq
    if past == 0 and lq > 1 and v.shape[-1] == d:
        ke = k.repeat_interleave(g, dim=1) if g > 1 else k
        ve = v.repeat_interleave(g, dim=1) if g > 1 else v
        res = _flash_with_lse(query, ke, ve, scaling)
        if res is not None:
            mass = _mass_by_transposed_flash(query, ke, res[1], scaling)
            if mass is not None:
                return res[0], mass.view(b, hkv, g, n).sum(2)
    q = query.view(b, hkv, g, lq, d)
    out = query.new_empty(b, hkv, g, lq, v.shape[-1])
    mass = torch.zeros(b, hkv, n, dtype=torch.float32, device=query.device)
    for s in range(0, lq, chunk):
        qc = q[:, :, :, s: s + chunk]
        c = qc.shape[3]
        m = past + s + c  # keys visible to this chunk: the causal part only (halves a long prefill's work)
        logits = (qc @ k[:, :, :m].transpose(-1, -2).unsqueeze(2)).float() * scaling  # [B, Hkv, g, c, m]
        if c > 1:
            qi = torch.arange(s, s + c, device=query.device)
            visible = torch.arange(m, device=query.device)[None, :] <= (past + qi)[:, None]
            logits = logits.masked_fill(~visible, float("-inf"))
        w = torch.softmax(logits, dim=-1)
        out[:, :, :, s: s + c] = (w.to(v.dtype) @ v[:, :, :m].unsqueeze(2))
        mass[:, :, :m] += w.sum(dim=(2, 3))
    return out.view(b, hq, lq, v.shape[-1]), mass


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores along the last axis, in time order. Ties go to the earlier token
    (a stable sort), so a selection is reproducible — max pooling makes plateaus of equal scores."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values
