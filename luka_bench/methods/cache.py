"""A prompt's cache (torch only): ``MethodCache`` holds one ``KVStore`` per layer with the policy
``policies.layer_policy`` gives it, and owns the prompt's lifecycle (the prefill, its end and the compression, the
decode steps, scratch forwards), its cross-layer state, the token ids, the per-step device values a graph-ready
step reads, the timers and the held/attended accounting, and ``clone``. ``run_policy`` is one layer's method work
in a forward. ``luka_bench.methods.hf.ModelCache`` is this cache as a transformers ``Cache``.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref

import torch

from luka_bench.device import trim_heap

from .base import DeviceCount, KVMethod, LayerInfo, LayerPolicy
from .policies import layer_policy
from .store import KVStore

# The thread that runs a leading chunk of a layer-major prefill (``hf``): its forward is a split chunk for the cache
# named here, while the caller's thread runs the prefill's last chunk through the same cache at the same time
_CHUNK_THREAD = threading.local()


class MethodCache:
    """A prompt's cache: one ``KVStore`` per decoder layer and the method's policies. Make a new one per prompt
    (``new_cache``); ``clone()`` gives an independent copy (the runner answers every question from a clone of
    the context-only cache)."""

    def __init__(self, method: KVMethod, infos: list[LayerInfo], model=None, *,
                 reference_length: int | None = None, question_ids: list[int] | None = None, prefill_chunk: int = 0,
                 observer=None, manual: bool = False, cuda_events: bool = False, question_span: int = 0,
                 layer_major: bool = True):
        """``reference_length``: the length the budget is a fraction of (QA: the context; perplexity: the
        document); None: the first forward's length. ``question_ids``: the question's token ids, for
        question-aware prefill compression (several questions on one context: concatenated in order).
        ``question_span``: the prefill's last tokens that are the question (the query-aware protocol: question and
        context compressed together; FINCH's observation window), 0 when the question is not in the prefill.
        ``prefill_chunk``: the prefill goes through the model in chunks of this size (the method's own
        ``prefill_chunk()`` wins; 0: at once) — layer by layer where the method compresses each layer inside the
        prefill's forward (``hf._layer_major``: one layer's full cache alive at a time), unless ``layer_major`` is
        False (chunk by chunk through every layer: the same results, every layer full until the last chunk).
        ``observer``: see below. ``manual``: the caller says when the prefill ends (``end_prefill``) and sizes the
        forwards itself; otherwise the first forward is the prefill.
        ``cuda_events``: time the method's components on CUDA (``latency_breakdown``) with recorded events (see
        ``mark``); off, a CUDA step records none."""
        self.method = method
        self.cuda_events = cuda_events
        self.model = model  # needed by scratch_forward and rotate_keys
        self.reference_length = 0 if reference_length is None else int(reference_length)
        self._reference_from_prefill = reference_length is None
        self.manual = manual
        # a manual cache's caller sizes its forwards; otherwise the method's chunk size wins
        self.prefill_chunk = int(prefill_chunk or 0) if manual else (method.prefill_chunk() or int(prefill_chunk or 0))
        self._splitting = False  # inside the pre-hook's chunked prefill (the chunks are not the prefill's end)
        self.layer_major_allowed = layer_major
        self.layer_major = False  # the chunked prefill ran layer by layer: every chunk through a layer, then the next
        self._end_split = None  # while a layer-major prefill's chunks run: what ends it (``hf._layer_major``)
        self.phase = "prefill"  # "prefill" -> "decode"; "scratch" during a scratch_forward
        # the forward under way ends the prefill and its layers compress inside it (``KVMethod.compresses_in_forward``)
        self.in_forward = False
        self.question_ids: list[int] | None = list(question_ids) if question_ids is not None else None
        self.question_span = int(question_span or 0)
        self.state: dict = {}  # per-prompt, cross-layer method state (copied by clone)
        self.peak_bytes = 0  # bytes held at most during the decode phase (see _note)
        self._timings: dict[str, float] = {}  # seconds per component, summed (methods add: span / add_span)
        self._pending: list = []  # (key, start event, end event) of CUDA spans not yet resolved
        # Optional callable(store, query, out, scaling), called after every ``attend`` and before ``after_step`` (so the
        # policy's ``attended(store)`` describes this forward); ``store.last_update`` holds the keys/values this
        # forward appended. Used by the fidelity probe (luka_bench/probe/); None costs nothing.
        self.observer = observer
        self.token_ids: list[int] = []  # ids of every token fed so far (add_tokens, or the pre-hook from input_ids)
        # attended metric: per decode forward, sum over layers of held tokens read and their bytes; a policy may
        # give its count as a device tensor (no host sync per step): resolved in one copy when the lists are read
        self._attended: tuple[list[float], list[float], list[float]] = ([], [], [])
        self._attended_pending: list[tuple] = []
        # device -> [value, 0-dim int64 counter (a view of ``flat``), flat int64 [1 + riders' columns], riders
        # {key: [weakref to the owner, base, first column, value last asked at]}, next free column]: see
        # position_tensor and riding
        self._position: dict = {}
        self._offsets: dict = {}  # (key, device) -> (counter, value, tensor): see per_step
        self._masks: dict = {}  # (name, width, rows, dtype, device) -> [mask, held]: see held_mask
        self._init_layers([self.store_class(layer_policy(method, info), self) for info in infos])

    store_class: type[KVStore] = KVStore  # the transformers cache (``hf.ModelCache``) makes its cache layers

    def _init_layers(self, stores: list[KVStore]) -> None:
        self.layers = stores

    @property
    def stores(self) -> list[KVStore]:
        return self.layers  # type: ignore[return-value]

    def position_tensor(self, seen: int, device: torch.device) -> torch.Tensor:
        """A 0-dim int64 tensor on ``device`` holding ``seen`` (the logical position of a decode step's token),
        shared by the layers of one forward. From one decode step to the next it is advanced in place (``add_(1)``,
        once per step, not per layer): a step's ops then carry no Python number that changes between steps (a
        ``fill_(seen)`` would bake ``seen`` into a captured CUDA graph) — the graph-ready steady state of
        ``tests/test_graph_ready.py``. Any other jump (a scratch forward, a prefill) refills it."""
        got = self._position.get(device)
        if got is None:
            flat = torch.full((1,), seen, dtype=torch.long, device=device)
            got = self._position[device] = [seen, flat[0], flat, {}, 1]
        elif got[0] != seen:
            if got[0] == seen - 1:
                got[2].add_(1)  # the position and every rider's column (``riding``)
            else:
                got[1].fill_(seen)
                got[3].clear()  # the riders' columns no longer hold base + position: written again when asked
                got[4] = 1
            got[0] = seen
        return got[1]

    def riding(self, owner, tag, base: torch.Tensor, seen: int) -> torch.Tensor:
        """``base + position_tensor(seen)`` (``base`` int64 on the counter's device, any shape) as a view of the
        counter's own tensor, so that the one ``add_`` that moves the position on each step moves it too: per-step
        indices without an op of their own (a packed layer's decode slots and window slots, ``packed.py``). Written
        (one op) when ``owner`` first asks with this ``tag`` (hashable) and ``base``, and after the position jumped.
        When the counter's tensor runs out of columns it is made anew with the riders still in use (their owner
        alive, asked this step or the last) — an event, as a rider's first step is."""
        self.position_tensor(seen, base.device)
        got = self._position[base.device]
        flat, riders, key, n = got[2], got[3], (id(owner), tag), base.numel()
        r = riders.get(key)
        if r is None or r[0]() is not owner or r[1] is not base:
            if got[4] + n > flat.numel():  # no free column left: the riders in use (and this one) in a new tensor
                live = {k: v for k, v in riders.items() if v[0]() is not None and v[3] >= seen - 1 and k != key}
                new = flat.new_empty(2 * (1 + sum(v[1].numel() for v in live.values()) + n))
                new[:1].copy_(flat[:1])
                flat, got[1], got[2], got[4] = new, new[0], new, 1
                riders = got[3] = {}
                for k, (ref, b, _, at) in live.items():
                    torch.add(b.reshape(-1), got[1], out=flat[got[4]: got[4] + b.numel()])
                    riders[k] = [ref, b, got[4], at]
                    got[4] += b.numel()
            torch.add(base.reshape(-1), got[1], out=flat[got[4]: got[4] + n])
            r = riders[key] = [weakref.ref(owner), base, got[4], seen]
            got[4] += n
        r[3] = seen
        return flat[r[2]: r[2] + n].view(base.shape)

    def position_before(self, seen: int, delta: int, device: torch.device) -> torch.Tensor:
        """``position_tensor(seen) - delta``, a 0-dim device tensor computed once per step for all layers (e.g. the
        first position of a recent window that ends at the step's token): no Python number that changes from step
        to step in the ops, one kernel per step instead of one per layer."""
        if delta == 0:
            return self.position_tensor(seen, device)
        return self.per_step(("minus", delta), seen, device, lambda counter: torch.sub(counter, delta))

    def per_step(self, key, seen: int, device: torch.device, make) -> torch.Tensor:
        """``make(position_tensor(seen))``, a device tensor computed once per step for all the layers that ask for
        it with the same ``key`` (hashable, holding the constants ``make`` uses): e.g. a budget left after the
        held tokens — no Python number that changes from step to step in the ops, one kernel per step, not one
        per layer."""
        counter = self.position_tensor(seen, device)
        key = (key, device)
        got = self._offsets.get(key)
        if got is None or got[0] is not counter or got[1] != seen:
            if got is None and len(self._offsets) >= 16:  # keys of earlier events (a new delta per compression)
                self._offsets = {k: v for k, v in self._offsets.items() if v[1] == seen}
            got = self._offsets[key] = (counter, seen, make(counter))
        return got[2]

    def held_mask(self, name: str, width: int, held: int, slot: torch.Tensor | None, rows: int,
                  dtype: torch.dtype, device: torch.device, offset: int = 0) -> torch.Tensor:
        """An additive mask [rows, 1, width]: 0 on the first ``held`` slots, -inf on the rest — for a policy that
        attends over a buffer of fixed width whose slots fill one per decode step (the free ones masked, so that
        consecutive steps have the same shapes). Shared by every layer that asks for the same ``name`` and width in
        a step (their buffers are laid out alike): the step's new slot (``slot``, the device tensor [1] of the slot
        ``held - 1``, counted from slot ``offset``: opened through a view from there, so that a store's own slot
        serves a mask whose buffer puts other entries first, with no add) is opened by one ``index_fill_`` per step
        for all the layers, not one per layer; any other change of ``held`` remakes it (an event step)."""
        key = (name, width, rows, dtype, device)
        got = self._masks.get(key)
        if got is not None and got[1] == held - 1 and slot is not None:
            (got[0] if not offset else got[0][..., offset:]).index_fill_(2, slot, 0.0)
            got[1] = held
        elif got is None or got[1] != held:
            if len(self._masks) >= 8:  # layouts of earlier events
                self._masks.clear()
            mask = torch.zeros(rows, 1, width, dtype=dtype, device=device)
            mask[..., held:] = float("-inf")
            got = self._masks[key] = [mask, held]
        return got[0]

    def position_holds(self, counter: torch.Tensor, seen: int) -> bool:
        """Whether ``counter`` (a ``position_tensor``) still holds ``seen``."""
        got = self._position.get(counter.device)
        return got is not None and got[1] is counter and got[0] == seen

    def add_tokens(self, ids) -> None:
        """Announce the ids of the next forward before it runs (``token_ids`` grows by them): a caller holding them
        on the host saves the pre-hook a device-to-host copy of ``input_ids``."""
        self.token_ids.extend(int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids))

    @property
    def splitting(self) -> bool:
        """The forward under way (in this thread) is a leading chunk of a chunked prefill, not the prefill's end."""
        return self._splitting or getattr(_CHUNK_THREAD, "cache", None) is self

    @property
    def seen(self) -> int:
        """Tokens that went through the model so far (the logical length)."""
        return self.stores[0].seen if self.stores else 0

    def before_forward(self, input_ids: torch.Tensor | None, length: int) -> None:
        """Called by ``attach``'s pre-hook before a forward of ``length`` tokens: the first one sets
        ``reference_length`` (unless given) and ``token_ids`` catches up with ``input_ids`` when the caller did not
        announce them (``add_tokens``)."""
        if self.phase == "scratch":
            return
        if self.phase == "prefill" and self.seen == 0 and self._reference_from_prefill and not self.splitting:
            self.reference_length = max(self.reference_length, int(length))
        if self.phase == "prefill" and not self.manual:  # this forward (its last chunk) ends the prefill
            self.in_forward = self.method.compresses_in_forward(self)
        missing = self.seen + length - len(self.token_ids)
        if missing > 0 and input_ids is not None and input_ids.shape[0] == 1:  # a batch's rows: no one list of ids
            self.token_ids.extend(int(i) for i in input_ids[0, -missing:].tolist())

    def _note_attended(self) -> None:
        """After a decode forward: tokens (and bytes) read by every layer's last attend (``LayerPolicy.attended``,
        per KV head, averaged over heads; + ``attended_extra``), summed over layers. Counts a policy gives as
        device tensors (or ``DeviceCount``) are kept as they are, per layer, and read with every other pending
        count in one device-to-host copy when something reads them (``attended_tokens``): a decode step adds no
        arithmetic on the device for the harness's bookkeeping."""
        row = []
        for s in self.stores:
            if s._k is None:
                continue
            # entries held besides the store are read as entries too
            row.append((s.policy.attended_count(s), s.policy.attended_extra(), s.token_bytes(),
                        s.held_per_head() + s.policy.extra_entries()))
        self._attended_pending.append(row)

    def _resolve_attended(self) -> tuple[list[float], list[float], list[float]]:
        if self._attended_pending:
            def parts(x):  # (device tensor or None, scale, offset)
                if isinstance(x, DeviceCount):
                    return x.total, x.scale, x.offset
                return (x, 1.0, 0.0) if torch.is_tensor(x) else (None, 0.0, float(x))

            flat = [t for row in self._attended_pending for c, e, _, _ in row for t in (parts(c)[0], parts(e)[0])
                    if t is not None]
            read = iter(torch.stack([t.detach().double().reshape(()) for t in flat]).tolist() if flat else [])

            def value(x) -> float:
                t, scale, offset = parts(x)
                return offset if t is None else next(read) * scale + offset

            for row in self._attended_pending:
                toks = byts = held = 0.0
                for c, e, tb, h in row:
                    per_head = value(c) + value(e)
                    toks += per_head
                    byts += per_head * tb
                    held += h
                for lst, v in zip(self._attended, (toks, byts, held)):
                    lst.append(float(v))
            self._attended_pending.clear()
        return self._attended

    @property
    def attended_tokens(self) -> list[float]:
        """Per decode forward: held tokens read, summed over layers (per KV head, mean over heads)."""
        return self._resolve_attended()[0]

    @property
    def attended_bytes(self) -> list[float]:
        return self._resolve_attended()[1]

    @property
    def held_token_steps(self) -> list[float]:
        return self._resolve_attended()[2]

    def attended_stats(self, since: int = 0) -> dict:
        """Over the decode forwards from number ``since`` on, the mean per forward of: ``attended_tokens`` (held
        tokens read by attention, per layer: mean over KV heads and layers), ``attended_bytes`` (their keys and
        values, all layers) and ``attended_ratio`` (attended / held entries: the store's tokens plus the policy's
        ``extra_entries``, so a method reading all it holds has 1.0). None when there was no such forward."""
        t, b, h = self.attended_tokens[since:], self.attended_bytes[since:], self.held_token_steps[since:]
        if not t:
            return {"attended_tokens": None, "attended_bytes": None, "attended_ratio": None}
        return {"attended_tokens": sum(t) / len(t) / max(1, len(self.stores)), "attended_bytes": sum(b) / len(b),
                "attended_ratio": sum(t) / sum(h) if sum(h) else None}

    def end_prefill(self) -> None:
        """The context has been prefilled: run prefill-time compression; later forwards are decode steps."""
        if self.phase != "prefill":
            raise RuntimeError("end_prefill() called twice for one prompt")
        self.method.after_prefill_cache(self)
        self.phase = "decode"
        self.in_forward = False
        self._note()

    def after_forward(self) -> None:
        """Called once after every model forward through this cache (after the last layer; see ``attach``), in
        the prefill and decode phases; not for a scratch forward. Runs ``KVMethod.after_forward``; after the
        first forward (the prefill, all its chunks) of a cache that is not ``manual``, ends the prefill."""
        if self.phase == "scratch":
            return
        self.method.after_forward(self)
        if self.phase == "prefill" and not self.manual and not self.splitting:
            self.end_prefill()

    @torch.no_grad()
    def scratch_forward(self, ids: list[int] | torch.Tensor, start: int | None = None) -> torch.Tensor:
        """Run ``ids`` through the model at logical positions ``start, start + 1, ...`` (default: right after the
        declared context, ``reference_length``) over what the cache holds, then drop their keys/values: every
        store gets back its length and logical length. During it ``phase == "scratch"``: policies can read the
        queries in ``attend`` (question-aware scoring); ``after_step`` / ``after_forward`` are not called.
        Returns the last position's logits."""
        if self.model is None:
            raise RuntimeError("scratch_forward needs a cache made by new_cache(model, method)")
        start = self.reference_length if start is None else int(start)
        first = self.stores[0]
        rows = first.packed.B if first.packed is not None else first._k.shape[0] if first._k is not None else 1
        if rows != 1:
            raise ValueError(f"method={self.method.name}: a scratch forward (question-aware scoring, the tail rule) "
                             f"runs one row, and this cache holds {rows}; allowed: a batch of 1")
        saved = [(s.n, s.seen) for s in self.stores]
        phase, self.phase = self.phase, "scratch"
        for s in self.stores:
            s.seen = start  # transformers derives the new tokens' positions (RoPE) from the logical length
        try:
            x = torch.as_tensor(ids, device=self.model.device).view(1, -1)
            logits = self.model(input_ids=x, past_key_values=self, use_cache=True, logits_to_keep=1).logits[0, -1]
        finally:
            self.phase = phase
            for s, (n, seen) in zip(self.stores, saved):
                s.n, s.seen = n, seen
        return logits

    def _note(self) -> None:
        # Peak over the decode phase (from the end of the prefill on): during the prefill every method holds the
        # whole context transiently; what a method saves is what it holds while generating.
        if self.phase == "decode":
            self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    # -- component timings (latency_breakdown) ------------------------------------------------------------
    # CUDA runs kernels asynchronously: a host clock around a component measures its launch, not its work. On
    # CUDA a span is a pair of recorded events, resolved (one synchronisation) only when ``timings`` is read —
    # between decode steps — so timing adds no synchronisation inside the forward. Elsewhere: perf_counter.
    # Events cost host time inside the step (64-200 of them per decode step), so on CUDA they are recorded only
    # when the cache was made with ``cuda_events=True`` (or the attribute set before the forward): a latency
    # breakdown was asked for. Without it CUDA spans record nothing and ``timings`` stays empty.
    def mark(self, device: torch.device):
        """A point in time on ``device``'s clock (pair two with ``add_span``): a CUDA event recorded on the
        current stream of ``device`` (not of the current device: ``model.device=cuda:1``), or None on CUDA without
        ``cuda_events``; elsewhere ``time.perf_counter()``."""
        if device.type == "cuda":
            if not self.cuda_events:
                return None
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter()

    def add_span(self, key: str, start, end) -> None:
        """Add the time from mark ``start`` to mark ``end`` to component ``key`` (attention, refinement, ...)."""
        if start is None or end is None:  # CUDA without cuda_events: not timed
            return
        if isinstance(start, float):
            self._timings[key] = self._timings.get(key, 0.0) + (end - start)
        else:
            self._pending.append((key, start, end))

    @contextlib.contextmanager
    def span(self, key: str, device: torch.device):
        """``with cache.span("eviction", store.device): ...`` times the block as component ``key``."""
        start = self.mark(device)
        try:
            yield
        finally:
            if start is not None:
                self.add_span(key, start, self.mark(device))

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per component, summed since the cache was made (or cleared)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for key, start, end in self._pending:
                self._timings[key] = self._timings.get(key, 0.0) + start.elapsed_time(end) / 1000.0
            self._pending.clear()
        return self._timings

    def held_bytes(self) -> int:
        return sum(s.held_bytes() + s.policy.extra_bytes() for s in self.stores)

    def bookkeeping_bytes(self) -> int:
        """The cache's own per-step tensors (the position counter, the per-step offsets, the shared held masks of
        fixed-shape decode steps) and the per-prompt state its method declares (``KVMethod.state_bytes``): what
        the allocation check (``owned.allocation``) expects besides the stores and the policies."""
        step = [v[2] for v in self._position.values()] + [v[2] for v in self._offsets.values()]
        step += [m for m, _ in self._masks.values()]
        # attended counts a policy gave as device tensors, resolved when read (``attended_stats``)
        for row in self._attended_pending:
            for count, extra, _, _ in row:
                step += [t.total if isinstance(t, DeviceCount) else t for t in (count, extra)
                         if isinstance(t, (DeviceCount, torch.Tensor))]
        return sum(t.nbytes for t in step) + self.method.state_bytes(self)

    def allocated_bytes(self) -> int:
        return sum(s.allocated_bytes() for s in self.stores)

    def full_bytes(self) -> int:
        return sum(s.full_bytes() for s in self.stores)

    def held_tokens(self) -> list[int]:
        return [s.n for s in self.stores]

    def method_report(self) -> dict[str, float]:
        """FAIR and REAL accounting now, for every method: ``fair_entries`` = held tokens + entries held outside
        the store (``LayerPolicy.extra_entries``), mean per layer; ``fair_ratio`` = that over the mean logical
        length; ``real_bytes`` = bytes of everything held (``held_bytes``: store + ``extra_bytes``); plus each
        policy's own ``report`` numbers: ``*_bytes`` summed over layers, the others averaged per layer. Where policies
        report ``offloaded_bytes`` (bytes held off the device: ArkVale's offloaded pages, ShadowKV's values),
        ``device_bytes`` = ``real_bytes`` - ``offloaded_bytes`` - ``harness_only_bytes`` (bytes the store holds for the
        harness that the method itself would not hold at all: ShadowKV's exact keys of the factored prompt)."""
        stores = [s for s in self.stores if s._k is not None]
        if not stores:
            return {}
        fair = sum(s.held_per_head() + s.policy.extra_entries() for s in stores) / len(stores)
        seen = sum(s.seen for s in stores) / len(stores)
        out: dict[str, float] = {"fair_entries": fair, "fair_ratio": fair / seen if seen else 0.0,
                                 "real_bytes": float(self.held_bytes())}
        for s in stores:
            for k, v in s.policy.report(s).items():
                out[k] = out.get(k, 0.0) + float(v) / (1 if k.endswith("_bytes") else len(stores))
        if "offloaded_bytes" in out:  # a method that offloads (ArkVale, ShadowKV): what of real_bytes is on the device
            out["device_bytes"] = out["real_bytes"] - out["offloaded_bytes"] - out.get("harness_only_bytes", 0.0)
        return out

    def clone(self) -> "MethodCache":
        import copy

        self.timings  # resolve pending CUDA events (events cannot be copied)
        stack = getattr(self, "_row_stack", None)
        if stack is not None:  # rows decoded stacked (``stacked.py``): each row's storage its own before a copy
            stack.dissolve()
        # deepcopy copies tensors and policy state; the method config is shared (it is immutable).
        memo = {id(self.method): self.method}
        if self.model is not None:
            memo[id(self.model)] = self.model  # the model is shared, never copied
        if self.observer is not None:  # shared, not copied (it is the probe's, not the prompt's state)
            memo[id(self.observer)] = self.observer
        new = copy.deepcopy(self, memo=memo)
        for store in new.stores:  # a weak reference is copied as is: point the copies at the copy
            store.cache = new
        return new


class Step:
    """A decode step (``base.DecodeStep``): the cache's per-step device values for one layer's ``LayerPolicy.step``,
    on that layer's device. Made by ``policy_attention``; holds no tensor of its own."""

    __slots__ = ("cache", "position", "device")

    def __init__(self, cache: MethodCache, position: int, device: torch.device):
        self.cache, self.position, self.device = cache, position, device

    def counter(self) -> torch.Tensor:
        return self.cache.position_tensor(self.position, self.device)

    def before(self, delta: int) -> torch.Tensor:
        return self.cache.position_before(self.position, delta, self.device)

    def per_step(self, key, make) -> torch.Tensor:
        return self.cache.per_step(key, self.position, self.device, make)

    def slot(self, store: KVStore, offset: int = 0) -> torch.Tensor | None:
        if store.static_slot is None:
            return None
        return store.static_slot if offset == 0 else store.static_slot_at(offset)

    def held_mask(self, store: KVStore, name: str, width: int, held: int, rows: int,
                  dtype: torch.dtype) -> torch.Tensor:
        offset = held - store.n  # where the store's slot 0 sits in the mask: from there through a view (no add)
        if offset > 0:
            return self.cache.held_mask(name, width, held, self.slot(store), rows, dtype, self.device, offset)
        return self.cache.held_mask(name, width, held, self.slot(store, offset), rows, dtype, self.device)


def policy_attention(store: KVStore, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """The layer policy's attention for one forward, the caller deciding which hook: ``step`` with the step's state
    (``Step``) for a decode step (the decode phase, one query token per row), ``attend`` for anything else (the
    prefill, its chunks, a scratch forward, several tokens at once after the prefill)."""
    policy, cache = store.policy, store.cache
    if cache.phase == "decode" and query.shape[2] == 1:
        return policy.step(store, query, scaling, Step(cache, store.seen - 1, query.device))
    return policy.attend(store, query, scaling)


def run_policy(store: KVStore, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """One layer's method work for one forward, after ``store.update``: ``attend`` (timed), the cache's
    observer if any, then in the forward that ends the prefill a layer-local policy's ``after_prefill``, in the
    decode phase ``after_step`` (timed) and, after the last layer, the peak-bytes note. ``attend`` is
    ``policy_attention`` (a decode step runs the policy's ``step``). Returns the attention output [B, Hq, Lq, D]."""
    policy, cache = store.policy, store.cache
    if policy.times_itself:
        out = policy_attention(store, query, scaling)
    else:
        with cache.span("attention", query.device):
            out = policy_attention(store, query, scaling)
    return finish_policy(store, query, out, scaling)


def finish_policy(store: KVStore, query: torch.Tensor, out: torch.Tensor, scaling: float,
                  after_step: bool = True) -> torch.Tensor:
    """``run_policy`` after the attention ``out`` of ``query`` (also for a row of stacked rows, whose attention ran
    for all rows at once: ``stacked.py``; ``after_step`` False where the stacked step evicted for it). Returns
    ``out``."""
    policy, cache = store.policy, store.cache
    if cache.observer is not None:
        cache.observer(store, query, out, scaling)
    if cache.phase == "prefill" and cache.in_forward and policy.layer_local_prefill and not cache.splitting:
        # the forward that ends the prefill: this layer compresses now, so its full keys and values are freed before
        # the next layer runs (``end_prefill`` then skips it)
        policy.after_prefill(store)
        store.compressed_in_forward = True
        if query.device.type == "cpu":  # its freed temporaries' pages back to the OS: a peak that repeats
            trim_heap()
    if cache.phase == "decode":
        if after_step and (policy.times_itself or type(policy).after_step is LayerPolicy.after_step):
            policy.after_step(store)
        elif after_step:
            with cache.span("eviction", query.device):
                policy.after_step(store)
        if policy.info.layer_idx == policy.info.num_layers - 1:
            store.cache._note()  # once per forward, after the last layer
            store.cache._note_attended()
    store.end_forward()  # before the next step moves the cache's position counter
    return out


def replay_forward(cache: MethodCache, layer_idx: int, key: torch.Tensor, value: torch.Tensor,
                   query: torch.Tensor, scaling: float) -> torch.Tensor:
    """One layer's forward without the model (the fidelity probe's replay): append captured post-RoPE
    ``key``/``value`` [B, Hkv, L, D] to the layer's store and run its policy on ``query`` [B, Hq, L, D] exactly
    as the attention function would. Call it layer by layer for each forward, on a ``manual`` cache, and
    ``cache.end_prefill()`` after the context."""
    store = cache.stores[layer_idx]
    store.update(key, value)
    return run_policy(store, query, scaling)
