"""The protocols a method codes against (torch only), in two tiers: what a policy or a method-level hook may use of
its layer's storage (``Store``: ``luka_bench.methods.store.KVStore``), of the prompt's cache (``PromptCache``:
``luka_bench.methods.cache.MethodCache``) and of a decode step (``DecodeStep``: ``luka_bench.methods.cache.Step``).

The core tier (``CoreStore``, ``CorePromptCache``) is all that a prefill scorer or a simple decode-time method needs;
each capability (fixed-shape decode, eviction during decode, per-head budgets, accounting of entries held outside the
store, self-timing) is a protocol of its own with its rules in its docstring. ``Store`` and ``PromptCache`` are the
whole contract: a member no protocol here names is not part of it, and no method writes an attribute of a store or a
cache (``tests/test_protocols.py`` reads every method file). The interface that uses them is ``base.py``.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol

import torch

from .attention import HeldKV


class CorePromptCache(Protocol):
    """Core tier: what any policy or method-level hook may use of the prompt's cache
    (``luka_bench.methods.cache.MethodCache``): its phase, its layers' stores, the per-prompt state, the question and
    the token ids, and a scratch forward.

    Rules: ``phase`` is "prefill" (the context, maybe in chunks), "decode" (every forward after it: the question
    chunk, each generated or teacher-forced token) or "scratch" (``scratch_forward``: keys and values dropped
    afterwards) — a policy that accumulates state in ``attend`` must ignore scratch forwards it did not ask for.
    ``token_ids[:store.seen]`` are the ids of the tokens a store has seen (announced before each forward).
    Per-prompt state shared by the layers goes in ``state`` (copied by ``clone``), never in a new attribute."""

    phase: str  # "prefill" | "decode" | "scratch"
    reference_length: int
    question_ids: list[int] | None
    question_span: int  # the prefill's last tokens that are the question (query-aware protocol); 0: none
    token_ids: list[int]
    state: dict
    model: Any

    @property
    def stores(self) -> list["Store"]: ...

    @property
    def seen(self) -> int: ...

    def scratch_forward(self, ids, start: int | None = None) -> torch.Tensor: ...


class TimingCache(Protocol):
    """Capability *self-timing* (``LayerPolicy.times_itself = True``): a policy with finer latency components than
    ``attention`` / ``eviction`` records them itself. Rules: ``mark`` returns a device-side timestamp (an event on
    CUDA) and never syncs; ``add_span(key, start, end)`` books the time between two marks under ``key``; ``span`` is
    the same as a context manager. Keys are the ``latency_breakdown`` components (attention, refinement,
    segment_compress, index_build, update, retrieval, eviction)."""

    def span(self, key: str, device: torch.device) -> ContextManager: ...

    def mark(self, device: torch.device) -> Any: ...

    def add_span(self, key: str, start: Any, end: Any) -> None: ...


class FixedShapeCache(Protocol):
    """Capability *fixed-shape decode* (see ``FixedShapeStore``), the cache's side: per-step device values shared by
    every layer. Rules: ``position_tensor`` / ``position_before`` give a step's position (minus ``delta``) as a
    0-dim device tensor made once per step; ``position_holds`` says whether the cache's counter still holds
    ``seen``; ``held_mask`` lays out, ahead of the next steps, an additive mask over a buffer (an event, such as a
    compression after a step, that changes what the next steps read). Nothing here may be turned into a Python
    number on a decode step (no ``.item()``, ``int(t)``, ``.tolist()``)."""

    observer: Any

    def position_holds(self, counter: torch.Tensor, seen: int) -> bool: ...

    def position_tensor(self, seen: int, device: torch.device) -> torch.Tensor: ...

    def position_before(self, seen: int, delta: int, device: torch.device) -> torch.Tensor: ...

    def held_mask(self, name: str, width: int, held: int, slot: torch.Tensor | None, rows: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...


class PromptCache(CorePromptCache, TimingCache, FixedShapeCache, Protocol):
    """Everything a policy may use of the prompt's cache: the core tier and the capabilities' members. A member no
    protocol here names is not part of the contract (``tests/test_protocols.py`` reads every method file)."""


class DecodeStep(Protocol):
    """Capability *fixed-shape decode*: the decode step under way, handed to ``LayerPolicy.step``
    (``luka_bench.methods.cache.Step``): one new token per row, after the prefill. Everything a fixed-shape step
    needs that changes from step to step comes from here as a device tensor made once per step for all layers, so
    that consecutive steps dispatch the same ops with no step-dependent Python number in them (the graph-ready
    steady state, ``tests/test_graph_ready.py``)."""

    position: int  # the step's token's logical position (host bookkeeping only: never put it in an op)
    device: torch.device

    def counter(self) -> torch.Tensor:
        """``position`` as a 0-dim int64 device tensor, advanced in place from one step to the next."""

    def before(self, delta: int) -> torch.Tensor:
        """``position - delta`` as a 0-dim device tensor (e.g. the first position of a recent window)."""

    def per_step(self, key: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``make(counter())``, computed once per step for every layer asking with the same hashable ``key``."""

    def slot(self, store: "Store", offset: int = 0) -> torch.Tensor | None:
        """The device slot [1] where ``store`` wrote this step's token, moved by ``offset`` (where a policy mirrors
        the token into a buffer of its own); None when the store wrote it at a Python slot (then shapes change)."""

    def held_mask(self, store: "Store", name: str, width: int, held: int, rows: int,
                  dtype: torch.dtype) -> torch.Tensor:
        """An additive mask [rows, 1, width] over a buffer laid out like ``store``'s slots moved by ``held -
        store.n`` (the step's token at slot ``held - 1``): 0 on the first ``held`` slots, -inf on the rest, shared by
        every layer asking for the same ``name`` and shape; a step that fills one more slot opens it (at
        ``slot(store, held - store.n)``) with one kernel for all the layers."""


class CoreStore(HeldKV, Protocol):
    """Core tier: what any policy may use of its layer's storage (``luka_bench.methods.store.KVStore``, whose
    docstrings say what each does): the held keys, values and positions (``HeldKV``: ``n``, ``seen``, ``keys``,
    ``values``, ``positions``, ``device``, ``head_mask``), per-token state (``aux``), removals (``keep``,
    ``keep_ends``) and row gathers.

    Rules: ``n`` is the physical length (tokens held), ``seen`` the logical one (tokens that went through the
    layer: RoPE positions); keys are stored after RoPE, so a removal never changes another token's position.
    ``positions`` writes every pending position first; ``positions_before(stop)`` reads the slots below ``stop``
    without writing a decode step's pending one (for an eviction that moves that token). A policy changes the store
    only through its methods, never by setting an attribute; a tensor it keeps beyond the call (e.g. observation
    queries) is a clone, never a slice of a forward's tensor (a slice keeps the whole chunk alive)."""

    policy: "LayerPolicy"

    @property
    def cache(self) -> PromptCache: ...

    @property
    def reference_length(self) -> int: ...

    def aux(self, name: str, dtype: torch.dtype = torch.float32, zero_new: bool = True,
            whole: bool = False) -> torch.Tensor: ...

    def keep(self, index: torch.Tensor) -> None: ...

    def keep_ends(self, head: int, tail: int) -> None: ...

    def positions_before(self, stop: int) -> torch.Tensor: ...

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class MovingStore(Protocol):
    """Capability *eviction during decode*: moving a token into a freed slot and re-numbering positions (H2O, TOVA,
    StreamingLLM, LuKA lined). Rules: after ``move_last_into`` / ``evict_into`` the slots leave time order (read
    ``positions`` for time order, never the slot index); a policy that moves tokens on every decode step sets
    ``LayerPolicy.moves_tokens_every_step``; ``rotate_keys`` re-rotates held keys by a position delta and
    ``set_next_position`` says which position the next token gets (the two together move positions, as
    StreamingLLM's ``positions=cache`` and FINCH's ``rerotate`` do)."""

    def evict_into(self, slot: torch.Tensor, sources: dict[str, torch.Tensor] | None = None,
                   may_be_last: bool = False) -> None: ...

    def move_last_into(self, slot: torch.Tensor, start: int = 0, may_be_last: bool = False) -> None: ...

    def rotate_keys(self, start: int, stop: int, delta: int | torch.Tensor) -> None: ...

    def rope_cos_sin(self, positions: torch.Tensor, scaled: bool = False) -> tuple[torch.Tensor, ...]: ...

    def set_next_position(self, position: int) -> None: ...


class HeadBudgetStore(Protocol):
    """Capability *per-head budgets*: KV heads of one layer holding different numbers of tokens (AdaKV,
    DuoAttention, RazorAttention). Rules: the slots a head does not hold are masked out of attention
    (``head_mask``) and out of every count; ``held_per_head`` is the mean count per KV head. Memory: ``keep_heads``
    packs what the heads hold (``packed``: storage as wide as each head's tokens, ``methods/packed.py``); a policy
    that unholds calls ``pack`` once its heads' shares are set (with ``windows`` for heads that keep only their sinks
    and last tokens, slid by ``slide_windows`` after every forward). Packed, a store appends, attends
    (``exact_attention``) and reports; any other operation unpacks it first (``unpack``: a copy back to the classic
    layout; refused for a packing with windows)."""

    packed: "object | None"  # the PackedHeads of a packed store, None in the classic layout

    def keep_heads(self, index: torch.Tensor, held: torch.Tensor) -> None: ...

    def unhold(self, start: int, stop: int, heads: torch.Tensor, count: int) -> None: ...

    def held_per_head(self) -> float: ...

    def pack(self, windows: list[tuple[int, int] | None] | None = None, bias: str | None = None) -> bool: ...

    def unpack(self) -> None: ...

    def slide_windows(self) -> None: ...


class FixedShapeStore(Protocol):
    """Capability *fixed-shape decode* (``LayerPolicy.static_decode`` / ``storage_multiple``, ``LayerPolicy.step``):
    a decode step that attends over the whole storage capacity with the free slots masked, or gathers rows of the
    flattened storage, so consecutive steps dispatch the same ops on the same shapes. Rules: a graph-ready step holds
    no step-dependent Python number in an op (take it from ``DecodeStep``); free slots are finite (zero or a dropped
    token's) and must be masked; ``gather_stacked`` / ``kv_flat`` / ``stacked`` / ``pages`` are None where keys and
    values are stored apart (``kv_flat``: the storage as rows [2, B * Hkv * cap, D], row ids as ``gather_flat``'s,
    read in place by ``attention.attend_rows``); ``row_offsets`` is the same tensor until the storage is reallocated."""

    static_kv: tuple[torch.Tensor, torch.Tensor] | None  # a decode step's own keys and values (``DecodeStep.slot``)

    def storage(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def row_offsets(self) -> torch.Tensor: ...

    def gather_flat(self, flat: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_stacked(self, flat: torch.Tensor, m: int) -> torch.Tensor | None: ...

    def kv_flat(self) -> torch.Tensor | None: ...

    def stacked(self, start: int, stop: int) -> torch.Tensor | None: ...

    def pages(self, start: int, size: int) -> torch.Tensor | None: ...


class AccountedStore(Protocol):
    """Capability *accounting of entries held outside the store* (``LayerPolicy.extra_bytes`` / ``extra_entries``):
    a policy sizing what it holds beside the store in the store's units. ``compressed_in_forward``: read-only, the
    policy's ``after_prefill`` ran inside the prefill's forward (``layer_local_prefill``)."""

    compressed_in_forward: bool

    def token_bytes(self) -> int: ...

    def held_bytes(self) -> int: ...


class Store(CoreStore, MovingStore, HeadBudgetStore, FixedShapeStore, AccountedStore, Protocol):
    """Everything a policy may use of its layer's storage: the core tier and the capabilities' members. A member no
    protocol here names is not part of the contract (``tests/test_protocols.py`` reads every method file)."""
