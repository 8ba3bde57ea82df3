"""The one module that touches transformers internals (pinned range: see pyproject.toml).

Extension points used, all public:
- a ``transformers.cache_utils.Cache`` whose layers are our own ``CacheLayerMixin`` subclass (``KVStore``);
- an attention function registered with ``AttentionInterface.register`` **and** a mask function registered with
  ``AttentionMaskInterface.register`` under the same name, selected with ``model.set_attn_implementation``.

How a forward reaches the method: ``attach`` registers a forward pre-hook on the model; for a forward through a
``MethodCache`` it puts that cache into the forward's keyword arguments (``CACHE_KWARG``), which transformers hands
down to every attention call (as it does for its own attention kwargs). Each decoder layer calls
``cache.update(k, v, layer_idx)``, which appends to the layer's store (``CacheLayer``: a ``store.KVStore``); our
attention function then takes ``cache.stores[module.layer_idx]`` and hands the query to ``cache.run_policy``. No state is carried between
the cache and the attention function outside the forward's own arguments.

The prefill and the decode phase (``MethodCache.phase``): the first forward through a fresh cache is the prefill
(``reference_length`` = its length unless given; in chunks of the method's ``prefill_chunk()`` when it asks, split
by the pre-hook so the chunks reach the method one by one); after it the method compresses (``end_prefill``), and
every later forward is a decode step. So ``model.generate(ids, past_key_values=attached.new_cache())`` runs the
method exactly as the runner does. A cache made with ``manual=True`` leaves both to its caller (tests that look at
the cache between the prefill and the compression, and the probe's replay, call ``end_prefill()`` themselves).

Method-level hooks (``MethodCache``): ``question_ids`` (the question token ids given when the cache is made, for
question-aware prefill compression); ``state`` (a per-prompt dict a method may keep cross-layer state
in; copied by ``clone``); ``after_forward`` (called by a forward hook that ``attach`` registers on the model, once
per model forward after the last layer, never for a scratch forward); ``scratch_forward(ids, start)`` (a forward
whose keys/values are dropped afterwards: the stores are restored to their length and logical length).

Masks: every policy builds its own mask from what its store holds (``attention.chunk_mask``), because after eviction
the physical length no longer matches the logical positions transformers would build a mask from. Our mask
function therefore returns None; it refuses padded batches. A batch of rows of one length runs through one cache
where the method decides per row (``KVMethod.batch_refusal`` None: every row is what it would be alone,
``tests/test_batch_rows.py``); the harness's clients still run one sequence at a time (issue 60's next steps).

Everything that does not touch transformers lives below this module: the interface (``base``), the numerics
(``attention``), the store (``store``), the stock policies (``policies``) and the prompt's cache and its lifecycle
(``cache``). ``MethodCache``, ``KVStore``, ``run_policy`` and ``replay_forward`` are importable from here as well.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from luka_bench.device import steady_allocator

from .attention import sdpa
from .base import KVMethod, LayerInfo
from .cache import _CHUNK_THREAD, MethodCache, finish_policy, replay_forward, run_policy  # noqa: F401  (the glue)
from .stacked import RowStack, StackedLayer
from .store import KVStore

ATTN_NAME = "luka_bench"
CACHE_KWARG = "luka_bench_cache"  # the forward keyword that carries the MethodCache down to the attention calls


class CacheLayer(KVStore, CacheLayerMixin):
    """A ``KVStore`` as a transformers cache layer (the mixin's abstract API is the store's; no state added)."""

    is_compileable = False
    is_croppable = False

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_max_length(self) -> int:
        return -1


class ModelCache(MethodCache, Cache):
    """A ``MethodCache`` that a transformers model takes as ``past_key_values`` (``model(...)``, ``generate``)."""

    store_class = CacheLayer

    def _init_layers(self, stores: list[KVStore]) -> None:
        Cache.__init__(self, layers=stores)


class _RowsLayer(CacheLayerMixin):
    """One decoder layer of a ``RowBatch``: row b's new keys and values go to row b's own store."""

    is_compileable = False
    is_croppable = False

    def __init__(self, stores: list[KVStore], stacked: StackedLayer | None = None):
        super().__init__()
        self.stores = stores
        self.stacked = stacked  # the rows' storage stacked (``stacked.py``): one write and one attention for all
        self.is_sliding = stores[0].is_sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.stacked is not None and key_states.shape[2] == 1:
            self.stacked.write(key_states, value_states)
            return key_states, value_states
        for b, store in enumerate(self.stores):
            store.update(key_states[b: b + 1], value_states[b: b + 1])
        return key_states, value_states  # unused: our attention function reads each row's store

    def get_seq_length(self) -> int:
        return max(s.get_seq_length() for s in self.stores)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(s.n for s in self.stores) + query_length, 0

    def get_max_length(self) -> int:
        return -1


class RowBatch(Cache):
    """Rows decoded together (issue 60): each row keeps its own ``MethodCache`` — prefilled, compressed and fed its
    tail alone, so its compression is exactly the solo one — and one forward of the model runs every row: the
    projections and the MLP over the batch, each layer's attention row by row on the row's own store and policy
    (``_attention``) — or, where every row decodes the layer exactly, once for all rows over their stacked storage
    (``stacked.py``, kept across steps) — each row at its own positions (the pre-hook). A row is therefore exactly
    what it would be alone whatever its length, its partners or its method (per-row token ids, question spans and
    positions are its cache's); a finished row leaves the batch (the next forward is made over the rows still
    running: no pad ever enters a cache). Every row must be past its prefill (phase "decode")."""

    def __init__(self, caches: list[MethodCache]):
        if not caches:
            raise ValueError("RowBatch needs at least one row's cache")
        for i, c in enumerate(caches):
            if not isinstance(c, MethodCache) or c.phase != "decode":
                got = type(c).__name__ if not isinstance(c, MethodCache) else f"phase {c.phase!r}"
                raise ValueError(f"RowBatch row {i}: got {got}; allowed: a MethodCache past its prefill (phase "
                                 f"'decode'): prefill each row alone first")
        self.rows = list(caches)
        # layers every row decodes exactly are stacked (one attention for all rows), kept across steps
        self.stack = RowStack.for_rows(self.rows) if len(caches) > 1 and self.stackable() else None
        layers = self.stack.layers if self.stack is not None else {}
        Cache.__init__(self, layers=[_RowsLayer([c.stores[i] for c in caches], layers.get(i))
                                     for i in range(len(caches[0].stores))])
        self._fresh = True  # no forward yet: the stack made above is this step's

    def next_forward(self) -> None:
        """Each forward of the rows (the pre-hook): a ``RowBatch`` used again for a later step takes its rows' stack
        one step on (or a new one: ``RowStack.for_rows``), as a new ``RowBatch`` of the same rows would."""
        if self._fresh:
            self._fresh = False
        elif self.stack is not None:
            self.stack = RowStack.for_rows(self.rows)
            for i, layer in enumerate(self.layers):
                layer.stacked = self.stack.layers.get(i)

    def stackable(self) -> bool:
        """Rows whose layers may be stacked: one model's caches, no observer (the probe reads a row's own call)."""
        n = len(self.rows[0].stores)
        return all(c.observer is None and len(c.stores) == n for c in self.rows)

    def row_positions(self, length: int, device: torch.device) -> torch.Tensor:
        """[B, length] int64: each row's positions for the next ``length`` tokens (its logical length less its
        position shift); a decode step's are the rows' stack's, one tensor advanced in place (``stacked.py``)."""
        if self.stack is not None and length == 1:
            return self.stack.positions(self.rows, device)  # one in-place add per step
        out = []
        for c in self.rows:
            first = c.stores[0]
            if length == 1 and first.pos_shift == 0:
                out.append(c.position_tensor(c.seen, device).view(1, 1))
            else:
                start = first.get_seq_length()
                out.append(torch.arange(start, start + length, device=device).view(1, length))
        return torch.cat(out, 0)


def _rows_forward(cache: RowBatch, ids: torch.Tensor | None, x: torch.Tensor, kwargs: dict):
    """The pre-hook's part for a ``RowBatch``: each row's cache is told of its tokens, the positions are each row's."""
    if x.shape[0] != len(cache.rows):
        raise ValueError(f"a RowBatch of {len(cache.rows)} rows got a forward of {x.shape[0]} rows; allowed: "
                         f"{len(cache.rows)}")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise NotImplementedError("a RowBatch forward takes no padding: feed each row its own tokens (rows of "
                                  "different lengths: one token per row per forward, or the row alone)")
    n = x.shape[1]
    cache.next_forward()
    for b, c in enumerate(cache.rows):
        c.before_forward(None if ids is None else ids[b: b + 1], n)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("position_ids", "cache_position", "attention_mask")}
    kwargs["position_ids"] = cache.row_positions(n, x.device)
    kwargs[CACHE_KWARG] = cache
    return (), {**kwargs, ("input_ids" if ids is not None else "inputs_embeds"): x}


def layer_infos(model: PreTrainedModel) -> list[LayerInfo]:
    """Per-layer facts a policy may use, read from the model config."""
    cfg = model.config.get_text_config()
    n = cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    window = getattr(cfg, "sliding_window", None)
    return [
        LayerInfo(layer_idx=i, num_layers=n, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                  sliding_window=window if types[i] == "sliding_attention" else None, layer_type=types[i])
        for i in range(n)
    ]


def new_cache(model: PreTrainedModel, method: KVMethod, **kwargs) -> ModelCache:
    """A fresh cache for one prompt of ``model`` under ``method`` (keyword arguments: see ``MethodCache``)."""
    return ModelCache(method, layer_infos(model), model, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Attention and mask functions
# ---------------------------------------------------------------------------------------------------------

def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function: query [B, Hq, Lq, D]; key/value as returned by the cache update. The forward's
    ``MethodCache`` arrives in ``kwargs[CACHE_KWARG]`` (put there by ``attach``'s pre-hook)."""
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by luka_bench methods")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    cache = kwargs.get(CACHE_KWARG)
    if cache is None:
        # No method cache in play (use_cache=False, or another cache class): plain causal attention.
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask > -1
        lq, lk = query.shape[2], key.shape[2]
        mask = None
        if lq > 1:
            mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
        out = sdpa(query, key, value, scaling, mask)
        return out.transpose(1, 2).contiguous(), None
    if isinstance(cache, RowBatch):  # each row on its own store and policy, or all rows at once where stacked
        stacked = cache.layers[module.layer_idx].stacked
        if stacked is not None and query.shape[2] == 1:
            out = _stacked_attention(cache, stacked, module.layer_idx, query, scaling)
        else:
            out = torch.cat([run_policy(c.stores[module.layer_idx], query[b: b + 1], scaling)
                             for b, c in enumerate(cache.rows)])
    else:
        out = run_policy(cache.stores[module.layer_idx], query, scaling)
    return out.transpose(1, 2).contiguous(), None


def _stacked_attention(cache: RowBatch, stacked: StackedLayer, layer: int, query: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    """A stacked layer's decode step: one attention for all rows (timed once, the time each row's), then each row's
    own bookkeeping (``cache.finish_policy``)."""
    first = cache.rows[0]
    start = first.mark(query.device)
    out = stacked.attend(query, scaling)
    end = first.mark(query.device)
    for b, c in enumerate(cache.rows):
        c.add_span("attention", start, end)
        finish_policy(c.stores[layer], query[b: b + 1], out[b: b + 1], scaling, stacked.mode not in ("evict", "packed"))
    stacked.after(query)
    return out


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
          **kwargs):
    """AttentionMaskInterface function: policies build their own masks (see module docstring)."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise NotImplementedError("a padded batch through one method cache: rows of one length, unpadded; "
                                  "prompts of different lengths: KV.generate_many (each row its own cache)")
    return None


_registered = False


def register() -> None:
    """Register our attention and mask functions (idempotent; called when a method is attached)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, _attention)
        AttentionMaskInterface.register(ATTN_NAME, _mask)
        _registered = True


@dataclass
class Attached:
    """What ``attach`` yields: the model and method, and fresh caches for them."""

    model: PreTrainedModel
    method: KVMethod
    previous: str

    def new_cache(self, **kwargs) -> MethodCache:
        """A fresh cache for one prompt (keyword arguments: see ``MethodCache``). Passed to ``model(...)`` or
        ``model.generate(..., past_key_values=cache)``, its first forward is the prefill, compressed by the method
        after it; every later forward is a decode step."""
        return new_cache(self.model, self.method, **kwargs)


def _input_of(args, kwargs) -> tuple[torch.Tensor | None, torch.Tensor]:
    ids = kwargs.get("input_ids", args[0] if args else None)
    x = ids if ids is not None else kwargs.get("inputs_embeds")
    if x is None:
        raise ValueError("a forward through a luka_bench cache needs input_ids or inputs_embeds")
    return ids, x


def _before_forward(module, args, kwargs):
    """Forward pre-hook on the model: a forward through a ``MethodCache`` gets the cache as ``CACHE_KWARG``
    (handed down to the attention calls); positions come from the cache (its logical length), never from
    ``position_ids`` derived from an attention mask; a prefill longer than the cache's ``prefill_chunk`` goes
    through the model chunk by chunk (the leading chunks here, the last one as this forward)."""
    cache = kwargs.get("past_key_values")
    if isinstance(cache, RowBatch):
        ids, x = _input_of(args, kwargs)
        return _rows_forward(cache, ids, x, {k: v for k, v in kwargs.items() if k not in ("input_ids", "inputs_embeds")})
    if not isinstance(cache, MethodCache):
        return None
    if getattr(cache, "_row_stack", None) is not None:  # a row of stacked rows fed alone: its storage its own first
        cache._row_stack.dissolve()
    ids, x = _input_of(args, kwargs)
    if x.shape[0] != 1:  # rows of one length, unpadded (``_mask`` refuses padding), each decided on its own
        why = cache.method.batch_refusal()
        if why is not None:
            raise ValueError(f"method={cache.method.name} runs one sequence at a time: got a batch of {x.shape[0]} "
                             f"({why}); allowed: 1 (generate each prompt with its own cache)")
    kwargs = {**kwargs, CACHE_KWARG: cache}
    if cache.splitting:  # a leading chunk of a chunked prefill: positions as the split gave them
        return args, kwargs
    kwargs.pop("position_ids", None)  # the cache's logical length gives the positions (kept after eviction)
    kwargs.pop("cache_position", None)
    if cache.phase == "scratch":
        return args, kwargs
    n = x.shape[1]
    cache.before_forward(ids, n)
    if cache.phase == "decode" and n == 1 and cache.seen and cache.stores[0].pos_shift == 0:
        # A decode step's position is the cache's device counter (advanced in place, once per step): the model then
        # derives no position of its own (an arange and an add from a Python number, which a captured CUDA graph
        # would bake in), and the layers' appends find the counter already at this step.
        kwargs["position_ids"] = cache.position_tensor(cache.seen, x.device).view(1, 1)
    chunk = cache.prefill_chunk
    if cache.phase != "prefill" or not chunk or n <= chunk or ids is None:
        return args, kwargs
    last = (n - 1) // chunk * chunk  # start of the last chunk, which this forward itself runs
    if (cache.layer_major_allowed and cache.in_forward and any(s.policy.layer_local_prefill for s in cache.stores)
            and type(cache.method).after_forward is KVMethod.after_forward):
        layers = _decoder_layers(module, len(cache.stores))
        if layers is not None:
            return _layer_major(module, cache, ids, chunk, last, layers, kwargs)
    cache._splitting = True
    try:
        for s in range(0, last, chunk):
            module(input_ids=ids[:, s: s + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        cache._splitting = False
    kwargs["input_ids"] = ids[:, last:]
    return (), kwargs


def _decoder_layers(model: PreTrainedModel, count: int) -> list | None:
    """The model's decoder layers in order (the module list whose ``count`` members each own an attention with a
    ``layer_idx``), or None where the model is not built that way."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == count and all(
                hasattr(getattr(m, "self_attn", None), "layer_idx") for m in mod):
            return list(mod)
    return None


class _LayerTurns:
    """The order of a layer-major prefill: chunk c enters decoder layer l once every chunk has left layer l - 1 and
    chunks 0 .. c - 1 have left layer l. One chunk is inside a layer at a time, and layer l holds its whole prefill
    only while the chunks pass it: the last chunk's attention compresses it before any chunk enters layer l + 1."""

    def __init__(self, layers: int, chunks: int):
        self.done, self.chunks = [0] * layers, chunks
        self.turn = threading.Condition()
        self.error: BaseException | None = None
        self.local = threading.local()  # .chunk: the chunk this thread runs

    def enter(self, layer: int) -> None:
        c = self.local.chunk
        with self.turn:
            self.turn.wait_for(lambda: self.error is not None or (
                (layer == 0 or self.done[layer - 1] == self.chunks) and self.done[layer] == c))
            if self.error is not None:
                raise RuntimeError("a layer-major prefill stopped: another chunk's forward failed") from self.error

    def leave(self, layer: int) -> None:
        with self.turn:
            self.done[layer] += 1
            self.turn.notify_all()

    def stop(self, error: BaseException) -> None:
        with self.turn:
            self.error = self.error or error
            self.turn.notify_all()


def _layer_major(model, cache: MethodCache, ids: torch.Tensor, chunk: int, last: int, layers: list, kwargs: dict):
    """A chunked prefill run layer by layer, for a method whose layers compress inside the prefill's forward: every
    chunk passes decoder layer l (the last one compressing it) before any enters layer l + 1, so one layer's
    full cache is alive at a time, as in an unchunked prefill, and each waiting chunk holds only its hidden states.
    The leading chunks are forwards of the model in threads of their own, ordered by hooks on the decoder layers
    (``_LayerTurns``); this forward runs the last chunk. The same computation per layer, in the same order, as the
    chunk-by-chunk prefill: the same tokens kept and the same logits."""
    turns = _LayerTurns(len(layers), (last + chunk - 1) // chunk + 1)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()  # both are per thread in torch

    def positions(start: int, stop: int) -> torch.Tensor:
        return torch.arange(start, stop, device=ids.device).view(1, -1)

    def run(index: int, start: int) -> None:
        _CHUNK_THREAD.cache, turns.local.chunk = cache, index
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                if ids.device.type == "cuda":
                    torch.cuda.set_device(ids.device)
                model(input_ids=ids[:, start: start + chunk], position_ids=positions(start, start + chunk),
                      past_key_values=cache, use_cache=True, logits_to_keep=1)
        except BaseException as e:  # noqa: BLE001  (handed to the chunks waiting for this one)
            turns.stop(e)
        finally:
            _CHUNK_THREAD.cache = None

    threads = [threading.Thread(target=run, args=(i, s), daemon=True) for i, s in enumerate(range(0, last, chunk))]
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: turns.enter(i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: turns.leave(i)))

    def finish():  # the last chunk's forward ended, or raised: release and join the threads, remove the hooks
        turns.stop(RuntimeError("the prefill's last chunk stopped"))
        for t in threads:
            t.join()
        for h in hooks:
            h.remove()

    turns.local.chunk = len(threads)
    cache.layer_major, cache._end_split = True, finish
    for t in threads:
        t.start()
    kwargs["input_ids"] = ids[:, last:]
    kwargs["position_ids"] = positions(last, ids.shape[1])
    return (), kwargs


def _after_forward(module, args, kwargs, output):
    """Forward hook on the model: a forward through a ``MethodCache`` has finished (after the last layer)."""
    cache = kwargs.get("past_key_values")
    if isinstance(cache, MethodCache):
        cache.after_forward()
    elif isinstance(cache, RowBatch):
        for row in cache.rows:
            row.after_forward()


def _end_split(module, args, kwargs, output):
    """Forward hook on the model, called even when the forward raised: the end of a layer-major prefill's last
    chunk joins the threads of the leading chunks (``_layer_major``) before anything else sees the cache."""
    cache = kwargs.get("past_key_values")
    if isinstance(cache, MethodCache) and cache._end_split is not None and not cache.splitting:
        finish, cache._end_split = cache._end_split, None
        finish()


@contextlib.contextmanager
def attach(model: PreTrainedModel, method: KVMethod, tokenizer=None):
    """Route the model's attention through the method for the duration of the block: every forward of the model
    through one of its caches (``Attached.new_cache``) runs the method, ``model.generate`` included.
    ``tokenizer`` reaches the method through ``KVMethod.bind`` (methods that chunk by token strings need it)."""
    register()
    if model.device.type == "cpu":  # a CPU peak that follows what is alive (once per process; LUKA_BENCH_ALLOCATOR)
        steady_allocator()
    if tokenizer is not None or method.tokenizer is None:
        method.bind(tokenizer)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    hooks = [model.register_forward_pre_hook(_before_forward, with_kwargs=True),
             model.register_forward_hook(_end_split, with_kwargs=True, always_call=True),
             model.register_forward_hook(_after_forward, with_kwargs=True)]
    try:
        yield Attached(model, method, previous)
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(previous)
