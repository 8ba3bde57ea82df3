"""Which layers of rows decoded together may be stacked, and how (``stacked.py``, ``stacked_packed.py``): the policy
declarations (``exact_decode``, ``decodes_exactly``, ``stacked_evict``, ``stacked_select``, ``stacked_packed``) and
the host-side checks of a store's next step, and a classic row's own storage again: shared by both stacking modules."""
from __future__ import annotations

from .base import LayerPolicy

# the policy hooks a decode step reaches: overriding any of them below the class that declared ``exact_decode`` voids
# the declaration (a subclass that decides per step is never stacked by mistake)
DECODE_HOOKS = ("attend", "step", "after_step", "attended", "attended_count", "attended_extra", "extra_entries")
EVICT_HOOKS = DECODE_HOOKS + ("stacked_plan", "stacked_attend", "stacked_victims", "stacked_note", "stacked_after",
                              "stacked_release", "stacked_slot_positions")


def exact_decode(policy: LayerPolicy) -> bool:
    """Whether ``policy``'s decode step is exact attention over everything its store holds, with nothing after it:
    the nearest class in its MRO that sets ``exact_decode`` says so, and no subclass below it overrides a decode
    hook (``DECODE_HOOKS``)."""
    cls = type(policy)
    owner = next(k for k in cls.__mro__ if "exact_decode" in vars(k))
    inner = getattr(policy, "inner", None)  # a wrapper's attention is its inner policy's
    return (bool(vars(owner)["exact_decode"]) and all(getattr(cls, h) is getattr(owner, h) for h in DECODE_HOOKS)
            and (not isinstance(inner, LayerPolicy) or exact_decode(inner)))


def exact_here(policy: LayerPolicy, store) -> bool:
    """``exact_decode``, or the policy's ``decodes_exactly(store)`` for this layer where no decode hook is overridden
    below the class that defines it."""
    if exact_decode(policy):
        return True
    cls = type(policy)
    owner = next(k for k in cls.__mro__ if "decodes_exactly" in vars(k))
    return (owner is not LayerPolicy and all(getattr(cls, h) is getattr(owner, h) for h in DECODE_HOOKS)
            and policy.decodes_exactly(store))


def declares(policy: LayerPolicy, flag: str) -> bool:
    """Whether ``policy`` declares a stacked step (``flag``: ``stacked_evict`` or ``stacked_select``), voided by a
    decode or stacked hook overridden below the declaring class."""
    cls = type(policy)
    owner = next((k for k in cls.__mro__ if flag in vars(k)), None)
    return (owner is not None and bool(vars(owner)[flag])
            and all(getattr(cls, h) is getattr(owner, h) for h in EVICT_HOOKS))


def evicts_one(policy: LayerPolicy) -> bool:
    """Whether ``policy`` declares a stacked step that evicts at most one token per row (``stacked_evict``)."""
    return declares(policy, "stacked_evict")


def plan_ahead(store):
    """The policy's ``stacked_plan`` for the store's next decode step (its length and logical length one on: host
    numbers only): False keeps the new token, True drops one, None cannot be stacked."""
    store.n += 1
    store.seen += 1
    try:
        return store.policy.stacked_plan(store)
    finally:
        store.n -= 1
        store.seen -= 1


def stack_mode(store) -> str | None:
    """How a store's layer may be decoded stacked: "exact" (exact decode, no per-token policy state), "evict" (a
    one-victim step whose next step can be stacked), "select" (a step that reads a selection of what it holds and
    drops nothing: ``stacked_select``, Quest) or None. Either needs one row, classic storage with keys and
    values in one tensor, every head holding every slot, no sliding window and no pending step."""
    if not (store.n > 0 and store._kv is not None and store._k.shape[0] == 1 and store.packed is None
            and not store._unheld and store.policy.info.sliding_window is None and store._positions.due is None):
        return None
    if not store._aux and exact_here(store.policy, store):
        return "exact"
    if store.pos_shift == 0 and evicts_one(store.policy) and plan_ahead(store) is not None:
        return "evict"
    if declares(store.policy, "stacked_select") and plan_ahead(store) is not None:
        return "select"
    return None


def plans_agree(stores: list, mode: str) -> bool:
    """The rows' next steps can be stacked: every row's plan known (an evicting layer), the same for every row (a
    selecting one: all read a selection, or all read everything)."""
    plans = [plan_ahead(s) for s in stores]
    return None not in plans and (mode == "evict" or len(set(plans)) == 1)


def stackable(store) -> bool:
    """A store whose layer may be decoded stacked (``stack_mode``)."""
    return stack_mode(store) is not None


def own_storage(store, view, cap: int) -> int:
    """A classic row leaving a stack: storage of its own again, its held tokens and its decode room as alone (whole
    pages for a paged policy), copied from ``view`` (its row of the stack, ``cap`` slots wide), its positions table
    too. Returns the width."""
    mult = store.policy.storage_multiple
    width = min(cap, -(-(store.n + store.declared_room()) // mult) * mult)
    own = view[:, :, :, :width].clone()
    store._kv, store._k, store._v = own, own[0], own[1]
    table = store._positions.table
    if table is not None:
        store._positions.table = table[:, :, :width].clone()
    return width

