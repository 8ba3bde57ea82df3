"""The scorer base: a prefill method that only says how to score the held tokens.

As kvpress's ``ScorerPress`` does for its presses, ``ScorerPolicy`` does the rest once for every such method: after
the context prefill, a layer over its capacity (``capacity = ceil(budget * max(seen, reference_length))``, the
budget rule of ``base``) keeps

    its first ``sinks`` tokens  +  the ``capacity - sinks - recent`` best-scored tokens in between  +  its last ``recent``

per KV head (``protected(store, capacity)`` gives ``(sinks, recent)``; both default to 0), in time order; ties go to the
earlier token (``attention.top_indices``); the others are dropped from the store (``KVStore.keep``: memory freed).

Head-wise budgets: ``head_capacities(store, capacity, scores)`` may give each KV head its own count [B, Hkv] (a layer's
budget split across its heads, as AdaKV); each head then keeps its own sinks + recent + best-scored tokens, the
store's width is the longest head's, and attention and every memory figure count what each head holds.

A method on it writes ``score(store, start, stop, obs)``: a score per KV head for the held tokens ``start:stop``
([B, Hkv, stop - start], higher = kept; GQA: aggregate the query heads of a group), reading what it needs from the
store (keys, values, positions, per-token state) and from ``obs`` (``Observation``), which the base hands in as
kvpress's ``score()`` receives its inputs: the observation queries, gathered by the base across prefill chunks and
cloned once (the prefill's last ``observation_window(store)`` queries, post-RoPE; or, for a policy that
``observes_question()``, the queries of the question's scratch forward), and the attention scaling. A score built
from statistics of every prefill query (ExpectedAttention) overrides ``observe(store, query)``, called with each
prefill chunk's queries. No policy overrides ``attend`` to keep queries. KNorm (``knorm.py``) is the smallest
example; SnapKV scores with its observation window, H2O with the attention mass of the prefill, StreamingLLM with
nothing (everything it keeps is protected).

Budget allocation over any scorer, as kvpress composes ``AdaKVPress(press)`` / ``PyramidKVPress``: a
``ScorerWrapper`` method holds an inner scorer method (``scorer``) and its ``WrappedScorerPolicy`` delegates the
observation, the protection and the score to the inner method's policy while it allocates the budget itself — per
KV head (``head_capacities``, AdaKV) or per layer (``capacity``, PyramidKV).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from .attention import exact_attention, top_indices
from .base import KVMethod, LayerInfo, LayerPolicy, MethodConfigError
from .protocols import PromptCache, Store


class Observation(NamedTuple):
    """What the base hands a score besides the store."""

    queries: torch.Tensor | None  # [B, Hq, w, D] the observation queries (post-RoPE), None: the policy observes none
    scaling: float  # the layer's attention scaling
    causal: bool  # the queries are the context's own last w tokens (query i sees the keys up to its own position);
    # False: the question's (a scratch forward after the context: every held key is in its past)


class ScorerPolicy(LayerPolicy):
    """A policy that compresses once after the prefill by a per-token score (see the module docstring). Layer-local:
    in the forward that ends the prefill each layer compresses right after its attention."""

    layer_local_prefill = True
    exact_decode = True  # ``attend`` observes in the prefill and the question's scratch forward; decodes exactly

    def __init__(self, method, info):
        super().__init__(method, info)
        self.q_window: torch.Tensor | None = None  # the prefill's last queries so far (a clone)
        self.q_question: torch.Tensor | None = None  # the question's queries (scratch forward)
        self.scaling = 1.0

    # -- what a score reads ---------------------------------------------------------------------------------------
    def observation_window(self, store: Store) -> int:
        """How many of the prefill's last queries the score reads (``Observation.queries``); 0 (the default): none."""
        return 0

    def observes_question(self) -> bool:
        """True: the queries of a scratch forward of the question (``KVMethod.after_prefill_cache`` runs it) replace
        the window's as the observation queries."""
        return False

    def observe(self, store: Store, query: torch.Tensor) -> None:
        """Every prefill chunk's queries [B, Hq, Lq, D] (post-RoPE), for a score built from statistics of them."""

    def attend(self, store: Store, query: torch.Tensor, scaling: float) -> torch.Tensor:
        if self.method.budget < 1.0:  # budget 1.0 keeps every token: nothing to observe
            phase = store.cache.phase
            if phase == "prefill":
                self.scaling = scaling
                w = self.observation_window(store)
                if w:
                    q = query if self.q_window is None else torch.cat([self.q_window, query], dim=2)
                    # a copy: a slice would keep the whole chunk's queries alive (every layer's, until the compression)
                    self.q_window = q[:, :, -w:].detach().clone()
                self.observe(store, query)
            elif phase == "scratch" and self.observes_question():
                self.q_question = query.detach()
        return exact_attention(store, query, scaling)

    def take_observation(self) -> Observation:
        """The observation queries gathered so far (the question's when there are some), handed over and forgotten."""
        q, self.q_window = self.q_window, None
        qq, self.q_question = self.q_question, None
        return Observation(q if qq is None else qq, self.scaling, qq is None)

    # -- what the method says -------------------------------------------------------------------------------------
    def protected(self, store: Store, cap: int) -> tuple[int, int]:
        """(sinks, recent): tokens kept at the start and at the end whatever their score, at capacity ``cap``."""
        return 0, 0

    def head_capacities(self, store: Store, cap: int, scores: torch.Tensor) -> torch.Tensor | None:
        """Head-wise budgets: the tokens each KV head keeps [B, Hkv] (sinks and recent included; a layer's budget
        split across its heads, as AdaKV's), from the scores of the tokens between the protected ones; or None (the
        default): every head keeps ``cap``."""
        return None

    def score(self, store: Store, start: int, stop: int, obs: Observation) -> torch.Tensor:
        """Scores [B, Hkv, stop - start] of the held tokens ``start:stop`` (higher = kept)."""
        raise NotImplementedError(f"{type(self).__name__} must define score()")

    # -- the compression ------------------------------------------------------------------------------------------
    def after_prefill(self, store: Store) -> None:
        obs = self.take_observation()
        if obs.queries is None and self.observation_window(store):
            return  # no prefill forward was observed (nothing to score with)
        self.compress(store, obs)

    def compress(self, store: Store, obs: Observation | None = None) -> bool:
        """Keep the protected tokens and the best-scored rest up to the capacity; False when nothing was over it."""
        cap, n = self.capacity(store), store.n
        if n <= cap:
            return False
        if obs is None:
            obs = Observation(None, self.scaling, True)
        sinks, recent = self.protected(store, cap)
        sinks = min(sinks, cap)
        recent = min(recent, cap - sinks)
        chosen = cap - sinks - recent
        if chosen <= 0:  # nothing scored: every head keeps the same tokens, its first and its last (positions as runs)
            store.keep_ends(sinks, recent)
            return True
        dev = store.device
        scores = self.score(store, sinks, n - recent, obs)  # once: the head budgets and the picks read the same
        caps = self.head_capacities(store, cap, scores)
        if caps is not None:
            caps = torch.as_tensor(caps, device=dev).long().clamp(sinks + recent, n)
            if bool((caps != cap).any()):  # one host read, at the prefill: heads keep different numbers of tokens
                self._keep_heads(store, scores, caps - sinks - recent, sinks, recent)
                return True
        b, h = store.keys.shape[:2]
        top = sinks + top_indices(scores, chosen)
        parts = [torch.arange(sinks, device=dev).expand(b, h, sinks), top,
                 torch.arange(n - recent, n, device=dev).expand(b, h, recent)]
        store.keep(torch.cat([p for p in parts if p.shape[-1]], dim=-1))
        return True

    def _keep_heads(self, store: Store, scores: torch.Tensor, chosen: torch.Tensor, sinks: int, recent: int) -> None:
        """Each KV head keeps its sinks, its recent window and its own ``chosen`` [B, Hkv] best-scored tokens (the
        first of a stable descending sort, as ``top_indices``), in time order; a head keeping fewer than the most
        fills the rest with slot 0, which it does not hold (``KVStore.keep_heads``)."""
        n, dev = store.n, store.device
        b, h = store.keys.shape[:2]
        most = int(chosen.max())
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :most]
        mine = torch.arange(most, device=dev) < chosen[..., None]  # [B, Hkv, most]: the head's own picks
        spare = scores.shape[-1] + torch.arange(most, device=dev)  # sorts after every real index
        key = torch.where(mine, order, spare).sort(dim=-1).values
        held = key < scores.shape[-1]
        parts = [torch.arange(sinks, device=dev).expand(b, h, sinks), sinks + torch.where(held, key, 0),
                 torch.arange(n - recent, n, device=dev).expand(b, h, recent)]
        flags = [torch.ones(b, h, sinks, dtype=torch.bool, device=dev), held,
                 torch.ones(b, h, recent, dtype=torch.bool, device=dev)]
        store.keep_heads(torch.cat(parts, dim=-1), torch.cat(flags, dim=-1))


class WrappedScorerPolicy(ScorerPolicy):
    """The policy of a ``ScorerWrapper``: the inner scorer's policy observes, protects and scores; this one allocates
    the budget (its subclass overrides ``capacity`` or ``head_capacities``) and compresses."""

    exact_decode = True  # its ``attend`` is the inner scorer's (``stacked.exact_decode`` asks the inner policy too)

    def __init__(self, method: "ScorerWrapper", info: LayerInfo):
        super().__init__(method, info)
        self.inner: ScorerPolicy = method.inner().policy_for_layer(info)

    def attend(self, store: Store, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return self.inner.attend(store, query, scaling)

    def observation_window(self, store: Store) -> int:
        return self.inner.observation_window(store)

    def take_observation(self) -> Observation:
        return self.inner.take_observation()

    def protected(self, store: Store, cap: int) -> tuple[int, int]:
        return self.inner.protected(store, cap)

    def score(self, store: Store, start: int, stop: int, obs: Observation) -> torch.Tensor:
        return self.inner.score(store, start, stop, obs)


class ScorerWrapper(KVMethod):
    """A method that allocates its budget over the scores of another (``inner()``: a scorer method whose policy is a
    ``ScorerPolicy``, run at this method's budget). Its method-level hooks are the inner method's (a question-aware
    SnapKV's scratch forward of the question, its layer-local prefill)."""

    def inner(self) -> KVMethod:
        """The scorer method whose scores this one allocates (a subclass builds it from its settings)."""
        raise NotImplementedError

    def _inner_at_budget(self, scorer: KVMethod) -> KVMethod:
        inner = replace(scorer, budget=self.budget, full_layers=0, rounding=self.rounding)
        if not issubclass(inner.policy_class, ScorerPolicy):
            raise MethodConfigError(f"method.scorer={scorer.name} is not a prefill scorer; allowed: a method on the "
                                    "scorer base (knorm, snapkv, expected_attention, tova, h2o, streaming_llm)")
        if self.tokenizer is not None:
            inner.bind(self.tokenizer)
        return inner

    def compresses_in_forward(self, cache: PromptCache) -> bool:
        return self.inner().compresses_in_forward(cache)

    def after_prefill_cache(self, cache: PromptCache) -> None:
        self.inner().after_prefill_cache(cache)  # the stores' policies are this method's: they compress
