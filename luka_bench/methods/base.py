"""The KV method interface, in two tiers.

A *method* (``KVMethod``) is a typed, validated config (a dataclass built by Hydra from ``conf/method/*.yaml``)
and a factory of per-layer *policies* (``LayerPolicy``). A policy holds the method's state for one layer of one
prompt; a fresh set is made for every prompt (``luka_bench.methods.cache.MethodCache``), so nothing can leak
between examples. The policy sees its layer's storage (a ``Store``: the physically held keys, values and the
logical position of every held token).

**Core tier** — all that a prefill scorer or a simple decode-time method needs to know:

====================  ==========================================================================================
settings              the method's dataclass fields (``budget``, ``full_layers`` and its own), checked in
                      ``__post_init__``; ``capacity(seen, reference_length)`` is the budget rule below.
``score``             a prefill scorer (``luka_bench.methods.scorer.ScorerPolicy``) only scores the held tokens;
                      the base keeps the best per KV head (KNorm: one line).
``attend``            every forward of this layer, after the new keys/values were appended. Returns the
                      attention output. Default: exact attention over what is held (SDPA, GQA-aware).
``after_prefill``     once, after the prefill (the first forward through a fresh cache; ``MethodCache.end_prefill``).
                      Prefill-time methods (SnapKV, StreamingLLM) compress here.
``after_step``        after ``attend`` of every forward *after* the prefill (question chunk, each generated or
                      teacher-forced token). Decode-time methods (StreamingLLM, H2O, LuKA) evict/compress here.
====================  ==========================================================================================

The core protocols (``protocols.py``: ``CoreStore``, ``CorePromptCache``) name what such a policy may use of its
store and its cache. The rules every policy follows:

- Three phases (``cache.phase``): "prefill" (the context, maybe in chunks), "decode" (every forward after it) and
  "scratch" (``MethodCache.scratch_forward``: some ids run at given positions, their keys/values dropped after).
  A policy that accumulates state in ``attend`` ignores scratch forwards it did not ask for.
- A policy changes its store only through the store's methods and keeps per-token state in ``store.aux``, per-prompt
  state shared by layers in ``cache.state``: it never sets an attribute of the store or the cache
  (``tests/test_protocols.py`` reads every method file for it).
- A tensor kept beyond the call (observation queries) is a clone: a slice of a forward's tensor keeps the whole chunk
  alive.
- ``store.positions`` writes pending positions first; ``store.positions_before(stop)`` reads slots below ``stop``
  without writing a decode step's pending one (for an eviction that then moves that token).

**Capabilities** — opt-in, each declared where its rules are written:

==============================  ======================================================================================
fixed-shape decode              ``LayerPolicy.step`` (a decode step's attention, with the step's device state
                                ``DecodeStep``), ``static_decode``, ``storage_multiple``; store side
                                ``FixedShapeStore``, cache side ``FixedShapeCache``. A graph-ready step holds no
                                step-dependent Python number in an op.
eviction during decode          ``MovingStore`` (``evict_into``, ``move_last_into``, ``rotate_keys``,
                                ``set_next_position``), ``LayerPolicy.moves_tokens_every_step``. Slots leave time
                                order after a move: read ``positions``.
per-head budgets                ``HeadBudgetStore`` (``keep_heads``, ``unhold``, ``pack``, ``slide_windows``);
                                ``ScorerPolicy.head_capacities``.
entries held outside the store  ``LayerPolicy.extra_bytes`` / ``extra_entries`` / ``attended_extra``; ``AccountedStore``.
                                LuKA's summaries, entropy_ols's synthetic pairs: ``attention_with_extra`` attends over
                                the held tokens plus such entries in one softmax; they count in ``kv_bytes`` (REAL
                                bytes) and against the budget (FAIR entries, ``MethodCache.method_report``).
self-timing                     ``LayerPolicy.times_itself``; ``TimingCache`` (``span``, ``mark``, ``add_span``).
what the last attend read       ``LayerPolicy.attended`` / ``attended_count`` (the fidelity probe, ``luka_bench.probe``, and
                                the attended-tokens metric; exact methods read everything they hold).
layer-local prefill             ``LayerPolicy.layer_local_prefill``: ``after_prefill`` runs inside the prefill's last
                                forward, right after the layer's attention (one layer's full cache alive at a time).
cross-layer and per-prompt      ``KVMethod.after_prefill_cache(cache)`` (after the prefill, every layer at once:
                                LASER-KV; the default runs each layer's ``after_prefill``), ``KVMethod.after_forward``
                                (after every forward's last layer, not a scratch one: LASER-KV's blocks),
                                ``KVMethod.prefill_chunk()`` (the chunk size the method needs), ``cache.question_ids``
                                / ``question_span`` (question-aware compression), ``cache.token_ids`` and
                                ``KVMethod.bind(tokenizer)`` (methods that read the text: LycheeCluster).
==============================  ======================================================================================

Token ids and the tokenizer: the ids of every forward (prefill chunks, the question, each generated or teacher-forced
token) are in ``MethodCache.token_ids`` *before* the forward (the engine announces them, ``MethodCache.add_tokens``;
for other callers ``attach``'s hook copies them from ``input_ids``), so during a forward ``cache.token_ids[:store.seen]``
are the ids of the tokens the store has seen; ``hf.attach(model, method, tokenizer)`` calls ``KVMethod.bind(tokenizer)``
once (``method.tokenizer``). Code that drives the model itself (tests) may skip both; a method that needs them says
so with a one-line error.

What the last ``attend`` read (``LayerPolicy.attended`` / ``attended_extra``) feeds the *attended* metric: the
runner averages, per decode step, the held tokens (and their bytes) every layer's attention read
(``MethodCache.attended_stats``); exact methods attend to everything they hold.
Which policy runs on which layer is ``policies.layer_policy``: the first ``full_layers`` layers (a setting of every
method) attend exactly, sliding-window layers (Gemma3) get exact attention within their window unless a method
sets ``handles_sliding = True``, and every other layer gets ``KVMethod.policy_for_layer``.

Settings: a method's own settings are its dataclass fields, each constraint stated once beside its field with
``setting`` (``window: int = setting(64, at_least=1, note="reference: 32-64")``); ``KVMethod.__post_init__`` checks
``budget``, ``full_layers``, then every declared field in field order, each refusal one line naming
``method.<field>=<value>``. A subclass's ``__post_init__`` keeps what no declaration states (checks that relate
settings to each other, an unusual rule).

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

Where the parts live (imports run one way, from the bottom up; no module imports one above it, not even for
types): ``attention.py`` (the numerics: SDPA, masks, attention with masses, kernel dispatch) <- this module (the
interface: ``LayerInfo``, ``LayerPolicy``, ``KVMethod``, the errors, the settings' checks) on ``protocols.py`` (the
``Store`` / ``PromptCache`` / ``DecodeStep`` protocols, in tiers, that name what a policy may use of the store, the
cache and the step above it) <- ``positions.py`` (``LazyPositions``: a store's
positions, written lazily) <- ``store.py`` (``KVStore``) <- ``policies.py``
(the stock policies: sliding windows, exact layers; which policy runs on a layer) <- ``cache.py`` (``MethodCache``:
a prompt's stores, lifecycle, state, token ids, clone) <- the method files <- ``hf.py`` (the transformers glue).
This module depends on torch only.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple, get_args

import torch

from luka_bench.errors import OneLineError

from .attention import exact_attention
from .protocols import DecodeStep, PromptCache, Store


ROUNDINGS = ("ceil", "kvpress")  # ``KVMethod.rounding``: how budget * tokens becomes a count


class MethodConfigError(OneLineError, ValueError):
    """A method setting is out of range. The message is one line naming the value and what is allowed."""


def check_ints(method, **lowest: int) -> None:
    """One-line MethodConfigError for the first setting of ``method`` named here that is not an integer at least its
    lowest value (``check_ints(self, token_budget=1, sink=0)``)."""
    for key, lo in lowest.items():
        v = getattr(method, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise MethodConfigError(f"method.{key}={v!r} must be an integer >= {lo}")


def check_holds_every_token(method, what_it_reads: str) -> None:
    """One-line MethodConfigError when ``method.budget`` is not 1.0 on a method that holds every raw token (its
    reads are set elsewhere, ``what_it_reads``: e.g. "the tokens read per step are method.token_budget")."""
    if method.budget != 1.0:
        raise MethodConfigError(f"method.budget={method.budget:g} is not used by {method.name} (allowed: 1.0): it "
                                f"holds every token; {what_it_reads}")


# -- settings: each setting's constraint stated once, beside its field -------------------------------------------------

@dataclass(frozen=True)
class Allowed:
    """What one setting allows (``setting``'s keywords). The kind comes from the field's annotation: ``int`` (an
    integer, never a bool), ``float`` (a number, stored as a float), ``bool`` (true or false), ``str`` (one of
    ``choices``), ``X | None`` (null too). ``note`` ends the message, in parentheses."""

    at_least: float | None = None  # "must be >= lo" ("an integer >= lo" for an int)
    above: float | None = None  # "must be > lo"
    within: str | None = None  # an interval as the message writes it: "[0, 1]", "(0, 1]"
    choices: tuple | None = None  # strings: "is unknown; allowed: a, b"; integers: "must be 1, 2 or 3"
    nested: type | None = None  # a dataclass of settings (a mapping is made one); its own fields are checked in turn
    holds_every_token: str = ""  # budget only: it must be 1.0 (``check_holds_every_token``'s what_it_reads)
    number: bool = False  # a float's message says "a number" before its bound ("must be a number >= 1")
    true_note: str = ""  # a bool's message says what each side means: "must be true (true_note) or false (false_note)"
    false_note: str = ""
    note: str = ""


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, repr: bool = True, **allowed: Any) -> Any:
    """A dataclass field with its constraint beside it (``window: int = setting(64, at_least=1, note="reference:
    32-64")``); ``KVMethod.__post_init__`` checks every such field in field order (``check_settings``). A subclass
    that redeclares the field with a plain default keeps the constraint. ``repr`` is the field's (False: a setting
    ``describe`` shows only where it is not its default)."""
    return field(default=default, default_factory=default_factory, repr=repr, metadata={"allowed": Allowed(**allowed)})


def check_settings(obj: Any, prefix: str = "method.") -> None:
    """One-line MethodConfigError for the first field of the dataclass ``obj`` declared with ``setting`` whose value it
    does not allow, in field order: ``method.<field>=<value!r> must be ... (note)``. Float settings are stored as
    floats; a nested dataclass of settings is checked as ``method.<field>.<its field>``."""
    for f, allowed, kind, optional in declared_settings(type(obj)):
        name, v = f"{prefix}{f.name}", getattr(obj, f.name)
        if allowed.nested is not None:
            if not isinstance(v, allowed.nested):
                v = allowed.nested(**dict(v))
                setattr(obj, f.name, v)
            check_settings(v, f"{name}.")
        elif allowed.holds_every_token:
            check_holds_every_token(obj, allowed.holds_every_token)
        elif not (optional and v is None):
            problem = _problem(allowed, kind, optional, v)
            if problem:
                raise MethodConfigError(f"{name}={v!r} {problem}" + (f" ({allowed.note})" if allowed.note else ""))
            if kind == "float":
                setattr(obj, f.name, float(v))


def _problem(a: Allowed, kind: str, optional: bool, v: Any) -> str:
    """What is wrong with ``v`` ("must be ...", "is unknown; allowed: ..."), or "" when it is allowed."""
    if kind == "bool":
        return "" if isinstance(v, bool) else "must be true{} or false{}".format(
            *(f" ({n})" if n else "" for n in (a.true_note, a.false_note)))
    if kind == "str":
        return "" if a.choices is None or v in a.choices else f"is unknown; allowed: {', '.join(a.choices)}"
    number = isinstance(v, int) and not isinstance(v, bool) or (kind != "int" and isinstance(v, float))
    if a.choices is not None:
        *most, last = map(str, a.choices)
        return "" if number and v in a.choices else f"must be {', '.join(most)} or {last}"
    ok, bound = number, ""
    if a.within is not None:
        lo, hi = (float(x) for x in a.within[1:-1].split(","))
        ok = number and (lo < v if a.within[0] == "(" else lo <= v) and (v < hi if a.within[-1] == ")" else v <= hi)
        bound = f"in {a.within}"
    elif a.above is not None:
        ok, bound = number and v > a.above, f"> {_setting(a.above)}"
    elif a.at_least is not None:
        ok, bound = number and v >= a.at_least, f">= {_setting(a.at_least)}"
    noun = "an integer" if kind == "int" else "a number" if a.number else ""
    what = " ".join(x for x in (noun, bound) if x) or "a number"
    return "" if ok else f"must be {'null or ' if optional else ''}{what}"


_DECLARED: dict[type, list] = {}


def declared_settings(cls: type) -> list:
    """(field, Allowed, kind, optional) of every field of ``cls`` declared with ``setting``, here or (redeclared with
    a plain default) in a base class; in field order."""
    if cls not in _DECLARED:
        out = []
        for f in fields(cls):
            declared = [d.metadata["allowed"] for c in cls.__mro__
                        if (d := getattr(c, "__dataclass_fields__", {}).get(f.name)) and "allowed" in d.metadata]
            if declared:
                out.append((f, declared[0], *_kind(f.type)))
        _DECLARED[cls] = out
    return _DECLARED[cls]


def _kind(annotation: Any) -> tuple[str, bool]:
    """("int" | "float" | "bool" | "str" | "" for another, whether null is allowed) of a field's annotation (a string
    under ``from __future__ import annotations``)."""
    parts = [p.strip() for p in annotation.split("|")] if isinstance(annotation, str) else \
        [getattr(t, "__name__", str(t)) for t in (get_args(annotation) or (annotation,))]
    rest = [p for p in parts if p not in ("None", "NoneType")]
    return (rest[0] if len(rest) == 1 else "", len(rest) < len(parts))


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


class DeviceCount(NamedTuple):
    """A count that ``LayerPolicy.attended_count`` knows as ``total * scale + offset`` with ``total`` a 0-d device
    tensor: the harness reads every pending ``total`` in one device-to-host copy when the counts are read and
    applies the host numbers then, so a decode step adds one reduction, not the arithmetic around it."""
    total: torch.Tensor
    scale: float
    offset: float


class LayerPolicy:
    """Per-layer, per-prompt state and behaviour of a method. The default is exact attention (= ``full``).

    Timing (``latency_breakdown``): the attention function times ``attend`` as component ``attention`` and an
    overridden ``after_step`` as ``eviction``. A policy with finer components of its own sets
    ``times_itself = True`` and records them with ``store.cache.span`` / ``mark`` + ``add_span``."""

    times_itself: bool = False
    # True for a policy that reads or moves held tokens' positions on every decode step (an eviction per step):
    # its store writes each step's position at once. Otherwise decode steps' positions are written lazily, as one
    # run, when something reads them (``KVStore.end_forward``): no kernel per step for them.
    moves_tokens_every_step: bool = False
    # True for a policy whose store grows by one token per decode step and that attends over the store's whole
    # capacity with the free slots masked (``KVStore.storage``): its store then writes a decode step's keys and values
    # at a slot held on the device (``KVStore.static_slot``), so consecutive steps dispatch the same ops on the same
    # shapes until the storage grows (the graph-ready steady state, tests/test_graph_ready.py).
    static_decode: bool = False
    # The store's storage capacity is a multiple of this (a paged policy reading whole pages of the storage, Quest:
    # the page holding the newest token then lies inside the storage even when it is not full, ``KVStore.pages``)
    storage_multiple: int = 1
    # True for a policy whose ``after_prefill`` needs only its own store and what its ``attend`` kept: in the forward
    # that ends the prefill it runs right after the layer's attention (``KVMethod.compresses_in_forward``), so that
    # the layer's full keys and values are freed before the next layer runs — one layer's full cache alive at a
    # time, not all of them (the scorer base's methods)
    layer_local_prefill: bool = False
    # True where a decode step is exact attention over every token the store holds and nothing runs after it (the
    # default hooks; a prefill-only method's policy declares it again on the class that overrides ``attend``): rows
    # of a batch then decode the layer as one attention over their stacked storage (``stacked.py``). A subclass that
    # overrides a decode hook below the declaring class is not stacked (``stacked.exact_decode``)
    exact_decode: bool = True
    # True where a decode step is attention over what the store holds followed by at most one token dropped per row
    # (the newest moved into the victim's slot): the class then implements ``stacked_plan`` and ``stacked_victims``
    # (and ``stacked_attend`` where its scores come from the step's own weights), and rows of a batch decode the
    # layer stacked (``stacked.py``). Voided, as ``exact_decode``, by a hook overridden below the declaring class
    stacked_evict: bool = False
    # True where a decode step reads a selection of what the store holds and drops nothing (Quest): the class
    # implements ``stacked_plan`` (the same plan for every row, or the layer is not stacked that step) and
    # ``stacked_attend``
    stacked_select: bool = False
    # True where a decode step over a packed store (head-wise budgets, ``packed.py``) is exact attention over the
    # packing followed at most by its windows' slide (``KVStore.slide_windows``): rows of a batch then decode the
    # layer over their packings stacked (``stacked_packed.py``). An ``exact_decode`` policy needs no declaration
    stacked_packed: bool = False
    stacked_free_position = 0  # an evicting stack's position on a free slot (StreamingLLM: the largest int64)
    # free slot j's position is ``stacked_free_position + (width - j)``: the first free slot's the largest (H2O)
    stacked_free_descending: bool = False
    stacked_free_state = 0.0  # a stack's per-token state (``aux``) on a free slot (H2O: +inf mass, never a victim)
    # True where every layer of a row that starts from the same positions keeps the same tokens in the same slots (no
    # per-layer scores: StreamingLLM): an evicting stack then chooses the victims once per step for all the layers
    # whose rows' positions were alike, told on the host when they were stacked (``stacked.same_tokens_lineage``)
    stacked_same_tokens: bool = False
    # an evicting stack writes the step's position at the step's slot before the victims are chosen (False: only
    # where the token ends up, as alone — StreamingLLM, whose victims never read the new token's slot)
    stacked_slot_position = True
    stacked_attend = None  # (layer: stacked.StackedLayer, query, scaling) -> [B, Hq, 1, Dv]; None: exact attention
    stacked_after = None  # (layer, query) -> None: after every row's after_step (what an event remade, remade now)
    # (layer) -> None: before the stack's storage is made anew or given back to the rows (what the policy's stacked
    # step kept for the rows, written back to their stores: LuKA clustered's importance in cover coordinates)
    stacked_release = None

    def decodes_exactly(self, store: "Store") -> bool:
        """For a class whose decode step depends on the layer (so it cannot declare ``exact_decode``): True where this
        layer's step is exact attention over everything ``store`` holds and its ``after_step`` changes nothing, so
        that rows of a batch decode it stacked (``stacked.py``, *exact*). Voided, as ``exact_decode``, by a decode
        hook overridden below the class that defines it."""
        return False

    def stacked_plan(self, store: "Store") -> bool | None:
        """A stacked step's plan for one row, after its token was appended (host numbers, as ``after_step`` would
        decide alone): False keeps the token, True drops one token (``stacked_victims``), None cannot be stacked."""
        return None

    def stacked_victims(self, layer) -> torch.Tensor:
        """The slot each stacked row drops this step, [B, Hkv] int64 — for a row that keeps its token (its plan
        False), its own slot, the step's, where the stack then writes the token again (the victims' own argmax says
        so: a free slot's position or a mark at the step's slots, ``stacked_slot_positions``; no choice per row
        after it); or (those slots counted from slot ``start``, ``start``): one offset for every row, no add to make
        them absolute."""
        raise NotImplementedError(f"{type(self).__name__} declares no stacked eviction")

    def stacked_slot_positions(self, layer) -> torch.Tensor | None:
        """What an evicting stack writes at the step's slots once the plans are known, [B, 1] int64, or None (nothing):
        the step's positions where ``stacked_slot_position`` (a policy may mark there the rows that keep their token,
        TOVA, or write only such marks, StreamingLLM)."""
        return layer.stack.pos if self.stacked_slot_position else None

    def stacked_note(self, store: "Store", evicted: bool) -> None:
        """A row's host state after a stacked step (``evicted``: it dropped a token)."""

    def __init__(self, method: "KVMethod", info: LayerInfo):
        self.method = method
        self.info = info

    # -- hook points ---------------------------------------------------------------------------------------
    def attend(self, store: "Store", query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of ``query`` [B, Hq, Lq, D] over everything ``store`` holds (the last Lq held tokens are the
        query tokens themselves). Returns [B, Hq, Lq, D]."""
        return exact_attention(store, query, scaling, self.info.sliding_window)

    def step(self, store: "Store", query: torch.Tensor, scaling: float, step: DecodeStep) -> torch.Tensor:
        """A decode step's attention: ``query`` [B, Hq, 1, D], the step's token already appended (the last held
        slot, or ``step.slot(store)``). Called instead of ``attend`` for every forward of one token per row after
        the prefill (never in the prefill, a prefill chunk or a scratch forward, never with several query tokens).
        Default: ``attend``."""
        return self.attend(store, query, scaling)

    def after_prefill(self, store: "Store") -> None:
        """Called once after the context prefill."""

    def after_step(self, store: "Store") -> None:
        """Called after ``attend`` on every forward that follows the prefill."""

    # -- what the last ``attend`` read (fidelity probe, attended-tokens metric) --------------------------------
    def attended(self, store: "Store") -> torch.Tensor | None:
        """Which held tokens the last ``attend`` call read: a boolean mask [B, Hkv, n] over the store's held
        tokens (per KV head; for a query chunk, the union over its queries), or None when it read every held
        token (exact attention). Methods that attend to a subset (LuKA clustered's refined pages + raw tail,
        LycheeCluster's retrieved chunks) override it; positions are ``store.positions[mask]``."""
        return None

    def attended_count(self, store: "Store") -> float | torch.Tensor | DeviceCount:
        """How many held tokens the last ``attend`` read, per KV head (mean over batch and heads): the harness
        records it after every decode forward. From the ``attended`` mask (a 0-d device tensor: reading it on the
        host would sync every step; the harness resolves all of them at once); a policy that knows the count
        without building the mask overrides it (it must equal the mask's count: see LuKA clustered's test)."""
        mask = self.attended(store)
        return store.held_per_head() if mask is None else mask.sum() / (mask.shape[0] * mask.shape[1])

    def attended_extra(self) -> int | torch.Tensor:
        """Entries held outside the store that the last ``attend`` call read, per KV head (LuKA's unrefined
        summaries, synthetic key/value pairs): counted as attended entries, but they have no position. An int, or
        a 0-d device tensor where knowing it needs the device (as ``attended_count``)."""
        return 0

    def extra_entries(self) -> int:
        """Key/value entries the policy holds besides the store, per KV head (synthetic or summary entries): they
        count against the budget like held tokens (FAIR accounting, ``MethodCache.method_report``)."""
        return 0

    def report(self, store: "Store") -> dict[str, float]:
        """Method-specific numbers for this layer at the end of an item (e.g. flushes, synthetic entries);
        summed over layers into the record's ``method_stats`` and averaged over items into metrics.json."""
        return {}

    # -- helpers -------------------------------------------------------------------------------------------
    def extra_bytes(self) -> int:
        """Bytes of KV-like state the policy holds besides the store (e.g. summary keys/values)."""
        return 0

    def buffer_bytes(self, store: "Store") -> int:
        """Bytes the policy preallocates for its decode steps besides what it holds (scratch of a fixed-shape step):
        declared, so that the allocation check (``owned.allocation``) can tell them from memory held unreported."""
        return 0

    def capacity(self, store: "Store") -> int:
        return self.method.capacity(store.seen, store.reference_length)


@dataclass
class KVMethod:
    """Base of every method config. Subclasses are dataclasses with typed, checked fields.

    ``budget``: fraction of tokens held (see module docstring); 1.0 = keep everything.
    """

    budget: float = 1.0
    # the first ``full_layers`` layers keep every token and attend exactly (LycheeCluster's full first layers, the
    # dense first layers of Quest and ClusterKV): one setting every method has (``policies.layer_policy`` obeys it)
    full_layers: int = 0
    # how ``budget * tokens`` becomes a count (``capacity``): "ceil" (ours: budget 1/8 of 1,268 tokens holds 159) or
    # "kvpress" (kvpress's presses: max(1, int(n * (1 - compression_ratio))), 158) — for comparisons with kvpress's
    # pipeline; shown in ``describe`` only where it is not the default (``settings``)
    rounding: str = setting("ceil", choices=ROUNDINGS, repr=False,
                            note="ceil: ours; kvpress: its presses' int(n * (1 - compression_ratio))")
    # True for a method that needs the question inside the compressed prompt (FINCH: the question is its observation
    # window): the runner refuses it unless ``query_aware=true`` on a QA dataset, lm-eval refuses it
    question_in_prompt: ClassVar[bool] = False

    name: ClassVar[str] = "base"
    # True if the method wants to act on sliding-window layers too (default: they keep exact windowed attention).
    handles_sliding: ClassVar[bool] = False
    policy_class: ClassVar[type[LayerPolicy]] = LayerPolicy

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "after_prefill" in vars(cls):  # the hook's old name: it would never be called
            raise TypeError(f"{cls.__name__}.after_prefill: the method-level hook is KVMethod.after_prefill_cache(cache) "
                            "(LayerPolicy.after_prefill(store) is the per-layer one)")

    def __post_init__(self) -> None:
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (0.0 < float(b) <= 1.0):
            raise MethodConfigError(
                f"method.budget={b!r} is outside (0, 1]: it is the fraction of context tokens kept "
                "(e.g. method.budget=0.125)"
            )
        self.budget = float(b)
        f = self.full_layers
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise MethodConfigError(f"method.full_layers={f!r} must be an integer >= 0 (the first layers kept exact)")
        check_settings(self)  # every field declared with ``setting`` (``rounding`` too), in field order

    # -- budget --------------------------------------------------------------------------------------------
    def capacity(self, seen: int, reference_length: int = 0) -> int:
        """Tokens a layer may hold after ``seen`` tokens: ceil(budget * max(seen, reference_length)); with
        ``rounding: kvpress``, kvpress's count for ``compression_ratio = 1 - budget``: max(1, int(n * (1 - ratio)))."""
        n = max(seen, reference_length)
        if self.budget >= 1.0:
            return n
        if self.rounding == "kvpress":
            return max(1, int(n * (1 - (1 - self.budget))))
        return math.ceil(self.budget * n - 1e-9)

    # -- the text (see module docstring) ------------------------------------------------------------------------
    tokenizer = None  # set by ``bind`` (class default: none bound)

    def bind(self, tokenizer) -> None:
        """Called by ``hf.attach`` with the model's tokenizer (None when the caller has none). Methods that need
        token strings keep it (the default does) and may precompute per-vocabulary tables here."""
        self.tokenizer = tokenizer

    # -- factory -------------------------------------------------------------------------------------------
    def policy_for_layer(self, info: LayerInfo) -> LayerPolicy:
        """The method's own policy for one layer of one prompt (override for per-layer choices). The cache asks
        ``policies.layer_policy``, which gives the ``full_layers`` and the sliding-window layers (unless
        ``handles_sliding``) their stock policies first and this method the rest."""
        return self.policy_class(self, info)

    def check_layer(self, info: LayerInfo) -> None:
        """Refuse, with a one-line ``MethodConfigError``, a layer the method cannot serve (asked for every layer,
        before its policy is chosen)."""

    def prefill_chunk(self) -> int:
        """Prefill chunk size the method needs (the runner honours it); 0: no requirement."""
        return 0

    def after_forward(self, cache: "PromptCache") -> None:
        """Cross-layer hook after every model forward through ``cache`` (after the last layer; not for a scratch
        forward). ``cache.phase`` says whether it was a prefill chunk or a decode-phase forward."""

    def compresses_in_forward(self, cache: "PromptCache") -> bool:
        """Whether the layers whose policy is ``layer_local_prefill`` compress inside the forward that ends the prefill
        (each right after its attention) instead of after it: yes unless the method overrides ``after_prefill_cache``
        (a cross-layer or question-aware compression needs the whole prefilled cache; such a method says when it
        can, as SnapKV without a question does). The result is the same tokens kept either way
        (``tests/test_prefill_memory.py``); what changes is the peak memory of the prefill."""
        return type(self).after_prefill_cache is KVMethod.after_prefill_cache

    def batch_refusal(self) -> str | None:
        """Why this method cannot run a batch of rows through one cache (the one-line refusal's reason), or None: it
        decides per row (``tests/test_batch_rows.py`` checks every row equals the same prompt run alone)."""
        return None

    def state_bytes(self, cache: "PromptCache") -> int:
        """Bytes of the per-prompt tensors the method keeps in ``cache.state`` that are not KV it holds (not in
        ``kv_bytes``: e.g. a RoPE table the model would hold anyway): declared for the allocation check."""
        return 0

    def after_prefill_cache(self, cache: "PromptCache") -> None:
        """Cross-layer hook after the context prefill; the default runs every layer's policy (but for the layers that
        compressed inside the prefill's forward)."""
        for store in cache.stores:
            if not store.compressed_in_forward:
                store.policy.after_prefill(store)

    def settings(self) -> dict[str, Any]:
        """Every setting by name, from the method's fields (those it shows: ``repr``, and a hidden one where it is not
        its default: ``rounding``), in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.repr or getattr(self, f.name) != f.default}

    def describe(self) -> str:
        """The method and every setting (``settings``; one rule for every method: the run's report, lm-eval's
        model string and report and the cache key all read it); ``full_layers`` only where it is set."""
        return f"{self.name}(" + ", ".join(f"{k}={_setting(v)}" for k, v in self.settings().items()
                                           if not (k == "full_layers" and v == 0)) + ")"

    def settings_json(self) -> dict[str, Any]:
        """``settings`` with every value JSON-ready: numbers, strings, booleans and None as they are, anything
        else (a nested method, a rule, a dataclass of settings) as ``describe`` writes it."""
        plain = (int, float, str, bool, type(None))
        return {k: v if isinstance(v, plain) else _setting(v) for k, v in self.settings().items()}


def _setting(v: Any) -> str:
    """A setting as ``describe`` writes it: floats as %g, methods by their own ``describe``, containers element-wise."""
    if isinstance(v, KVMethod):
        return v.describe()
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_setting(x)}" for k, x in v.items()) + "}"
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], KVMethod):  # a layer rule (selector, method)
        return f"{v[0]}: {_setting(v[1])}"
    if isinstance(v, (list, tuple)):
        return "[" + "; ".join(_setting(x) for x in v) + "]"
    return str(v)

