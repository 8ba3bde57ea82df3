"""TOVA: Token Omission Via Attention (Oren, Hassid, Yarden, Adi, Schwartz, "Transformers are Multi-State RNNs",
2024; reference code schwartz-lab-NLP/TOVA, ``src/tova_cache.py``).

At every forward through the cache (the end of the prefill and every later step), a layer holding more than its
capacity keeps the ``capacity`` tokens that the **last query** attends to most, the attention weights (fp32 softmax
per query head) **averaged over all query heads of the layer** — one kept set per layer, identical for every KV
head (GQA: the mean runs over all ``num_attention_heads`` query heads, not per group). The others are evicted
physically. The newest token is scored like any other and may itself be evicted (the reference does not protect it).

Settings that give kvpress's ``TOVAPress`` instead: ``decode: false`` (compress once, after the context prefill; later
tokens are appended and kept) and ``protect_last: true`` (the last token is always kept: kvpress pads its score with
the maximum + 1, ``tova_press.py``).

Budget: ``capacity = ceil(budget * max(seen, reference_length))`` tokens per layer (the project's rule, ``base``),
the protected last token included. The reference's ``cache_size`` is a fixed token count; here it follows the budget.

Decode steps (``decode: true``): a step that puts the layer one token over its capacity drops the token of least
score, the latest of equal ones (a top-k keeps the earlier: ``attention.top_indices``), by moving the newest token
into its slot (``KVStore.move_last_into``; with the newest token itself the victim, it stays where it is and is
dropped). Scores come from the step's own attention (output and weights of one fp32 softmax), the
victim from one argmax over a key made of the score's bits and the position, as H2O's: fixed shapes, no host sync.
A chunk of several tokens (a question), or a step several tokens over, keeps the top ``capacity`` by the chunk's
last query (``_keep_top``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from luka_bench.device import host_to_device
from luka_bench.methods.attention import exact_attention, group_apply, group_logits, top_indices
from luka_bench.methods.base import KVMethod, LayerPolicy, setting
from luka_bench.methods.scorer import ScorerPolicy
from luka_bench.methods.stacked import masked_attention


def last_query_scores(q_last: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """TOVA's score of every held token: the attention weight the last query q_last [B, Hq, 1, D] gives it, fp32
    softmax per query head, summed over all query heads of the layer (the mean times Hq: the same order). keys [B,
    Hkv, n, D]. Returns [B, n] float32."""
    b, hq, _, d = q_last.shape
    hkv = keys.shape[1]
    w = torch.softmax(group_logits(q_last.reshape(b, hkv, hq // hkv, 1, d), keys, scaling), dim=-1)
    return w.sum(dim=(1, 2, 3))


class TOVAPolicy(ScorerPolicy):
    """The prefill compression on the scorer base (``score``: the last prompt query's head-averaged attention,
    the same for every KV head); the later forwards' eviction is TOVA's own (``attend`` + ``after_step``)."""

    moves_tokens_every_step = True  # an eviction per decode step (decode: true)

    def __init__(self, method, info):
        super().__init__(method, info)
        self.moves_tokens_every_step = bool(method.decode and method.budget < 1.0)
        self._q_last: torch.Tensor | None = None  # the last query of the latest forward [B, Hq, 1, D]
        self._step_scores: torch.Tensor | None = None  # a decode step's scores [B, n] (from its attention)
        self.scaling = 1.0

    def _evicts(self, store) -> bool:
        """Whether this forward ends over capacity (host numbers only): only then are scores computed."""
        return store.n > self.capacity(store)

    def attend(self, store, query, scaling):
        """The prefill's last query is the base's observation (``observation_window``); a later forward of several
        tokens (``decode: true``) keeps its own last query, which scores that forward's eviction (``after_step``)."""
        self.scaling = scaling
        if store.cache.phase == "decode" and self.method.decode and self.method.budget < 1.0:
            self._q_last = query[:, :, -1:].detach().clone()  # a copy: a slice keeps the whole chunk alive
        return super().attend(store, query, scaling)

    def step(self, store, query, scaling, step):
        self.scaling = scaling
        if self.method.budget >= 1.0 or not self.method.decode or not self._evicts(store):
            return exact_attention(store, query, scaling)
        # the step's output and its query's weights from one fp32 softmax (``attention_with_mass``'s decode path,
        # the weights summed over all query heads of the layer at once)
        b, hq, _, d = query.shape
        hkv = store.keys.shape[1]
        w = torch.softmax(group_logits(query.view(b, hkv, hq // hkv, 1, d), store.keys, scaling), dim=-1)
        self._step_scores = w.sum(dim=(1, 2, 3))  # [B, n]
        return group_apply(w, store.values).view(b, hq, 1, -1)

    # -- the prefill, on the scorer base ------------------------------------------------------------------------------
    def protected(self, store, cap: int) -> tuple[int, int]:
        return 0, 1 if self.method.protect_last else 0

    def observation_window(self, store) -> int:
        return 1  # the prompt's last query

    def score(self, store, start: int, stop: int, obs) -> torch.Tensor:
        s = last_query_scores(obs.queries, store.keys, obs.scaling)[:, start:stop]
        return s[:, None].expand(-1, store.keys.shape[1], -1)  # one set for every KV head

    # -- later forwards (decode: true) ---------------------------------------------------------------------------------
    def after_step(self, store) -> None:
        scores, self._step_scores = self._step_scores, None
        q, self._q_last = self._q_last, None
        if not self.method.decode or store.n <= self.capacity(store):
            return
        if scores is not None and store.n == self.capacity(store) + 1:
            self._drop_one(store, scores)
        else:
            if scores is None:
                scores = last_query_scores(q, store.keys, self.scaling)
            self._keep_top(store, scores)

    # -- stacked rows of a batch (``stacked.py``) ---------------------------------------------------------------------
    stacked_evict = True

    def stacked_plan(self, store):
        if not self.method.decode or self.method.budget >= 1.0 or store.n <= self.capacity(store):
            return False
        return True if store.n == self.capacity(store) + 1 else None

    def stacked_attend(self, layer, query, scaling):
        """As ``step`` for each row: the weights where a row drops a token this step (their sum over every query head
        of the layer scores its held tokens; the output from them), exact attention where it keeps it."""
        plans = layer.plans
        if not any(plans):
            return masked_attention(query, layer.kv[0], layer.kv[1], layer.layout.mask, scaling)
        w, out = layer.weights(query, scaling)
        self._step_scores = w.sum(dim=(1, 2, 3))  # [B, cap]
        if not all(plans):
            exact = masked_attention(query, layer.kv[0], layer.kv[1], layer.layout.mask, scaling)
            out = torch.where(layer.stack.constant(plans, torch.bool, out.device).view(-1, 1, 1, 1), out, exact)
        return out

    # a free slot's position in the stack: its key (position - 2^32 x the bits of its score, 0) below every held
    # token's (scores are sums of at most the query heads' weights: bits < 0x43800000 up to 256 heads, keys above
    # -4.9e18), so a free slot is never the victim without a mask
    stacked_free_position = -(3 << 61)
    # a row that keeps its token this step gets it kept in its own slot by the victims' one argmax: its slot's
    # position is written 3 x 2^61 higher (``stacked_slot_positions``; its key then above 2.0e18, every held token's
    # below 2^31), or (``protect_last``, whose step writes the slot's score anyway) its score written -1 (bits below
    # 0: its key above 4.6e18) where a row that drops one gets +inf

    def stacked_slot_positions(self, layer):
        plans, stack = layer.plans, layer.stack
        if all(plans) or not any(plans) or self.method.protect_last:
            return stack.pos
        return stack.memo(("tova_keep", tuple(plans)), lambda: stack.pos + stack.constant(
            [0 if p else 3 << 61 for p in plans], torch.long, stack.pos.device)[:, None])

    def stacked_victims(self, layer):
        """``_drop_one``'s victim for every row (the newest token a candidate, unless ``protect_last``); free slots
        never (``stacked_free_position``); a row that keeps its token: its own slot (marked: ``stacked_slot_positions``)."""
        scores, self._step_scores = self._step_scores, None
        lay = layer.layout
        b = lay.rows.shape[0]
        if self.method.protect_last:
            plans = layer.plans
            scores[lay.rows, lay.slot] = float("inf") if all(plans) else host_to_device(
                [float("inf") if p else -1.0 for p in plans], scores.device, scores.dtype)
        key = torch.sub(layer.pos[:, 0], scores.view(torch.int32), alpha=1 << 32)
        return key.argmax(-1)[:, None].expand(b, layer.kv.shape[2])

    def _drop_one(self, store, scores: torch.Tensor) -> None:
        """One token over capacity (a decode step): the token of least score goes — among equal ones the latest,
        as a stable top-k keeps the earlier —, told by one argmax over ``position - 2^32 * bits(score)``
        (non-negative float32s order as their bits; positions < 2^31), the newest token's position read as the
        largest (it is the latest; its own is not written yet). ``protect_last``: the newest token is not a
        candidate. Then the newest token moves into the victim's slot (or, being the victim, is dropped)."""
        n = store.n
        last = not self.method.protect_last
        b, h = store.keys.shape[:2]
        # every KV head holds the same tokens in the same slots; each batch row its own
        pos = store.positions_before(n - 1)[:, 0] if b > 1 else store.positions_before(n - 1)[0, 0]
        if last:
            pos = F.pad(pos, (0, 1), value=(1 << 31) - 1)
        else:
            scores = scores[:, : n - 1]
        if b > 1:  # a victim per row: each row's newest token moves into its own victim's slot
            key = torch.sub(pos, scores.contiguous().view(torch.int32), alpha=1 << 32)
            store.evict_into(key.argmax(-1)[:, None].expand(b, h), may_be_last=last)
            return
        key = torch.sub(pos, scores[0].contiguous().view(torch.int32), alpha=1 << 32)
        store.move_last_into(key.argmax().view(1), may_be_last=last)

    def _keep_top(self, store, scores: torch.Tensor) -> None:
        """Keep the top ``capacity`` tokens by ``scores`` [B, n] (the last one too with ``protect_last``), ties to the
        earlier token by position (decode steps leave the slots out of time order), in time order."""
        n, cap = store.n, self.capacity(store)
        keep_last = 1 if self.method.protect_last else 0
        b, h = store.keys.shape[:2]
        if b > 1:  # each batch row keeps its own top tokens (the same count), every head of a row the same
            order = store.positions[:, 0].argsort(-1)  # [B, n]: each row's time order
            order = order[:, : n - keep_last]
            top = order.gather(1, top_indices(scores.gather(1, order), cap - keep_last))
            if keep_last:
                top = torch.cat([top, torch.full((b, 1), n - 1, dtype=top.dtype, device=top.device)], dim=1)
            store.keep(top[:, None].expand(b, h, -1))
            return
        order = store.positions[0, 0].argsort()  # time order of the slots (the same for every head)
        if keep_last:  # the newest token (the last slot, the last in time order) is kept whatever its score
            order = order[: n - 1]
        top = order[top_indices(scores[0, order], cap - keep_last)]
        if keep_last:
            top = torch.cat([top, torch.full((1,), n - 1, dtype=top.dtype, device=top.device)])
        store.keep(top)


@dataclass
class TOVA(KVMethod):
    """decode: evict at every forward through the cache (true: the reference's TOVA) or only once after the prefill
    (false: kvpress's TOVAPress); protect_last: never evict the newest token (true: kvpress; false: the reference)."""

    budget: float = 0.125
    decode: bool = setting(True, true_note="TOVA: evict at every step", false_note="kvpress TOVAPress: prefill only")
    protect_last: bool = setting(False, true_note="kvpress", false_note="TOVA's reference")

    name: ClassVar[str] = "tova"
    policy_class: ClassVar[type[LayerPolicy]] = TOVAPolicy
