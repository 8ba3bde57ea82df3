"""H2O: Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023). Also the LuKA paper's *lined* attention (``conf/method/luka_lined.yaml``).

Every held token accumulates the attention mass it receives, over the prefill and every later step (no decay
unless ``decay`` is set: then ``mass <- decay * mass + new`` at every forward). After the prefill and after every
later step, a layer keeps its ``recent`` most recent tokens plus the ``capacity - recent`` older tokens with the
highest accumulated mass (the heavy hitters) and physically evicts the rest.

GQA: scores are per KV head, the mass summed over the query heads of its group; each KV head keeps its own set.
Attention and the masses come from ``attention.attention_with_mass`` (a CPU prefill: one pass over the logits a block
of queries at a time, output and masses from the same exp, no N x N matrix; decode steps and other devices:
grouped matmul + fp32 softmax, query-chunked) only on the layers
this method runs on; the model's other layers keep SDPA.

Budget (``recent_budget``): ``inside`` (H2O's own reading, the default): ``capacity = ceil(budget * max(seen,
reference_length))`` tokens held per layer, recent window included; ``recent = max(min_recent, round(recent_fraction *
capacity))``, at most ``capacity``. ``on_top`` (the LuKA paper's lined attention: "roughly 1/8 of the heavy hitters
with respect to the prompt length" plus a raw tail of at least 128): ``heavy = ceil(budget * max(seen,
reference_length))`` heavy hitters *plus* ``recent = max(min_recent, round(recent_fraction * heavy))`` recent tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from luka_bench.methods.attention import attention_with_mass, top_indices
from luka_bench.methods.base import KVMethod, LayerPolicy, setting
from luka_bench.methods.scorer import ScorerPolicy

MASS = "h2o_mass"
# a free slot's position in a stack of rows (``stacked_victims``): above any token's (positions < 2^31), below 2^32 -
# the stack's width, so that a free slot's key (its position - 2^32 x the bits of +inf) stays below every older
# held token's (its position - 2^32 x the bits of a finite mass: at least 2^32 more)
FREE = 1 << 31
RECENT_BUDGETS = ("inside", "on_top")


class H2OPolicy(ScorerPolicy):
    """The prefill eviction on the scorer base (the recent window protected, the rest scored by the attention mass
    the prefill gave them); the decode steps' eviction is H2O's own (``evict``)."""

    moves_tokens_every_step = True  # an eviction per decode step
    incremental = True  # a step one token over capacity moves the new token into the evicted slot (False: top-k)

    def __init__(self, method, info):
        super().__init__(method, info)
        self._new_mass: torch.Tensor | None = None  # a slot step's mass for its new token (see ``attend``)
        self._step = None  # the decode step under way (``DecodeStep``), from ``step`` to ``attend``
        self._slot_step_at = None  # a slot step's ``DecodeStep``, for ``evict``: where its recent window starts

    def step(self, store, query, scaling, step):
        self._step = step
        return self.attend(store, query, scaling)

    def attend(self, store, query, scaling):
        step, self._step = self._step, None
        out, mass = attention_with_mass(store, query, scaling)
        acc = store.aux(MASS, zero_new=False)  # the new tokens' entries are written here, not zeroed by append
        n, lq = store.n, query.shape[2]
        old = n - lq
        if self.method.decay is not None:
            acc[:, :, :old].mul_(self.method.decay)
        acc[:, :, :old].add_(mass[:, :, :old])
        if step is not None and self._slot_step(store):
            # the new token moves into the evicted slot after this forward: its mass goes there with it
            self._new_mass, self._slot_step_at = mass[:, :, n - 1], step
        else:
            acc[:, :, old:].copy_(mass[:, :, old:])
        return out

    def split(self, cap: int) -> tuple[int, int]:
        """(heavy, recent) token counts for a budget of ``cap = ceil(budget * N)`` tokens: recent inside it
        (``recent_budget: inside``) or on top of it (``on_top``: ``cap`` heavy hitters + the recent window)."""
        m = self.method
        if m.recent_budget == "on_top" and m.budget < 1.0:
            return cap, max(m.min_recent, round(m.recent_fraction * cap))
        recent = min(cap, max(m.min_recent, round(m.recent_fraction * cap)))
        return cap - recent, recent

    def capacity(self, store) -> int:
        return sum(self.split(super().capacity(store)))

    def _slot_step(self, store) -> bool:
        """This decode step puts the layer one token over capacity, with a recent window the new token belongs
        to: the least-mass older token goes and the new token takes its slot (``evict_into``)."""
        return self.incremental and store.n == self.capacity(store) + 1 and \
            self.split(super().capacity(store))[1] >= 1

    def evict(self, store) -> None:
        cap = self.capacity(store)
        n = store.n
        if n <= cap:
            return
        heavy, recent = self.split(super().capacity(store))
        older = n - recent
        new_mass, step, self._new_mass, self._slot_step_at = self._new_mass, self._slot_step_at, None, None
        if new_mass is not None:
            # One token more than fits (a decode step): the kept set, the top `heavy` of the `heavy + 1` older
            # tokens plus the recent window, drops exactly the older token of least mass — the latest of equal
            # ones, as the stable top-k below keeps the earlier. The recent window is told by position (older:
            # position < seen - recent), the victim by one key per held token, position - 2^32 * (the bits of
            # its mass): non-negative float32s order as their bits, so the key's argmax is the least mass and,
            # among equal masses, the latest position (positions < 2^32); the recent window's masses read as
            # +inf. The new token (the last slot: recent) then moves into the victim's slot. Five kernels and
            # three writes of fixed size, no host sync; slots are not in time order (positions tell it).
            first_recent = step.before(recent - 1)
            pos = store.positions_before(n - 1)
            mass = store.aux(MASS)[:, :, : n - 1].masked_fill(pos >= first_recent, float("inf"))
            key = torch.sub(pos, mass.view(torch.int32), alpha=1 << 32)
            store.evict_into(key.argmax(-1), {MASS: new_mass})
            return
        # in time order (slot steps leave the slots unordered): the older tokens, then the recent window;
        # top-k ties go to the earlier token
        order = store.positions.argsort(-1)
        tail = order[:, :, older:]
        if heavy > 0:
            first = order[:, :, :older]
            top = first.gather(-1, top_indices(store.aux(MASS).gather(-1, first), heavy))
            index = torch.cat([top, tail], dim=-1)
        else:
            index = tail
        store.keep(index)

    # -- stacked rows of a batch (``stacked.py``): the decode step for every row at once --------------------------
    stacked_evict = True

    def stacked_plan(self, store):
        if store.n <= self.capacity(store):
            return False
        return True if self._slot_step(store) else None

    def stacked_attend(self, layer, query, scaling):
        """The rows' attention and masses (free slots get none), added to each row's accumulated mass. The new
        token's entry is left as it is (what the slot held plus the step's mass; +inf on a slot never used): the
        stack's eviction writes the step's mass alone where the token ends up (``layer.sources``, as ``attend``'s
        copy), and until then its slot reads as a free one (``stacked_slot_position``)."""
        w, out = layer.weights(query, scaling)
        acc = layer.aux[MASS]
        if self.method.decay is not None:
            acc.mul_(self.method.decay)
        mass = w.sum(dim=(2, 3))
        acc.add_(mass)
        layer.sources[MASS] = mass
        return out

    stacked_free_state = float("inf")  # a free slot's mass in the stack: never the least (no mask for the victims)
    # the step's slot is a free slot's (+inf mass) until the token ends up there: never the victim of a row that drops
    # one, and its position written only where the token ends up, as alone (``stacked_attend`` leaves a slot's mass
    # as it was plus the step's: +inf stays +inf). A free slot's position is above every token's, the first free
    # slot's (the step's) the largest (``stacked_free_descending``): a row that keeps its token reads every slot as
    # recent, and the largest key is then the step's own slot — where its token stays, with no choice per row
    stacked_slot_position = False
    stacked_free_position = FREE
    stacked_free_descending = True

    def stacked_victims(self, layer):
        """``evict``'s victim for every row: its recent window (each row's own; its first position made once per
        step for every layer of the same windows) read as +inf mass, as are free slots, whose positions (above any
        token's: ``FREE``) make theirs keys below every older token's. A row that keeps its token this step (its
        plan False) reads every slot as recent: its largest key is then the step's own slot (the first free one)."""
        recent = tuple(self.split(ScorerPolicy.capacity(self, s))[1] - 1 if plan else 1 << 62
                       for s, plan in zip(layer.stores, layer.plans))
        stack = layer.stack
        first = stack.memo(("h2o_first_recent", recent), lambda: (
            stack.pos - stack.constant(recent, torch.long, stack.pos.device)[:, None])[:, :, None])
        mass = layer.aux[MASS].masked_fill(layer.pos >= first, float("inf"))
        return torch.sub(layer.pos, mass.view(torch.int32), alpha=1 << 32).argmax(-1)

    def protected(self, store, cap: int) -> tuple[int, int]:
        return 0, self.split(super().capacity(store))[1]

    def score(self, store, start: int, stop: int, obs) -> torch.Tensor:
        return store.aux(MASS)[:, :, start:stop]

    def after_prefill(self, store) -> None:
        self.compress(store)

    def after_step(self, store) -> None:
        self.evict(store)


@dataclass
class H2O(KVMethod):
    """recent_fraction: share of the capacity given to the recent window (H2O paper: half heavy, half recent);
    min_recent: the recent window is at least this many tokens; decay: None (accumulate without decay, as the
    H2O and LuKA papers) or a factor in (0, 1] applied to the accumulated mass at every forward; recent_budget:
    inside (the recent window counts in ``budget``) | on_top (``budget`` is the heavy hitters' share, the window
    comes on top: the LuKA paper's lined setting)."""

    budget: float = 0.125
    recent_fraction: float = setting(0.5, within="[0, 1]")
    min_recent: int = setting(0, at_least=0)
    decay: float | None = setting(None, within="(0, 1]")
    recent_budget: str = setting("inside", choices=RECENT_BUDGETS)

    name: ClassVar[str] = "h2o"
    policy_class: ClassVar[type[LayerPolicy]] = H2OPolicy
