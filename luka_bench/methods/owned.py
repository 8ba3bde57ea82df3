"""What a prompt's cache really allocates, against what its method reports (the allocation check; torch only).

``owned_tensors(cache)`` walks everything a ``MethodCache`` reaches — its stores (key/value storage, the position
table, the per-token ``aux`` state, index caches), its policies (summaries, pages, factors, buffers: any attribute,
list, tuple, dict or object holding tensors), its per-prompt ``state`` and per-step tensors — and counts each storage
once (views of one storage are one allocation: a slice of a wide buffer costs the whole buffer). The model and the
method object (shared by every prompt) are not walked.

``allocation(cache)`` sets that against what the method reports and declares:

- ``kv_bytes`` (``cache.held_bytes()``: what the stores' heads hold + each policy's ``extra_bytes``), less what the
  method says it holds for the harness only (``harness_only_bytes`` in its report);
- the bookkeeping: the stores' (``bookkeeping_bytes``: the position table and the per-token ``aux`` state over
  the slots in use, index caches, the last step's slot) and the cache's (``MethodCache.bookkeeping_bytes``: per-step
  tensors, shared masks, and the per-prompt state the method declares, ``KVMethod.state_bytes``);
- the decode headroom each store declares (``declared_headroom_bytes``: the slots its growth rule may leave
  free beyond those in use, with their bookkeeping), and each policy's declared decode buffers
  (``LayerPolicy.buffer_bytes``).

A store whose storage is wider than what its heads hold (slots a head does not hold, padding to the longest head,
keys kept for the harness) allocates more than it reports: ``ratio`` > 1.
"""
from __future__ import annotations

import torch

# attributes that are shared by every prompt (not the cache's) or are back references
_SKIP = {"model", "method", "tokenizer", "_cache_ref", "observer"}


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr(), s.nbytes())


def owned_tensors(cache) -> dict[tuple, tuple[str, int]]:
    """Every storage the cache reaches: {storage key: (path of the first reference found, bytes)}. Paths start with
    ``store[i]`` (a layer's store), ``policy[i]`` (its policy) or ``cache`` (the cache's own state)."""
    seen_obj: set[int] = set()
    alive: list = []  # every visited container stays alive while walking: an id is not reused by a later object
    out: dict[tuple, tuple[str, int]] = {}

    def visit(obj, path: str, depth: int = 0) -> None:
        if obj is None or isinstance(obj, (int, float, str, bool, bytes, torch.dtype, torch.device, type)):
            return
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                return
            key = _storage_key(obj)
            if key not in out:
                out[key] = (path, obj.untyped_storage().nbytes())
            return
        if id(obj) in seen_obj or depth > 12 or isinstance(obj, torch.nn.Module):
            return
        seen_obj.add(id(obj))
        alive.append(obj)
        from .base import KVMethod  # noqa: PLC0415 (the method object is shared by every prompt)

        if isinstance(obj, KVMethod):
            return
        if isinstance(obj, dict):
            for k, v in obj.items():
                visit(v, f"{path}[{k!r}]", depth + 1)
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for i, v in enumerate(obj):
                visit(v, f"{path}[{i}]", depth + 1)
            return
        names = list(getattr(obj, "__dict__", {}).items())
        for cls in type(obj).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if hasattr(obj, slot):
                    names.append((slot, getattr(obj, slot)))
        for k, v in names:
            if k in _SKIP or callable(v) and not isinstance(v, torch.Tensor) and not hasattr(v, "__dict__"):
                continue
            visit(v, f"{path}.{k}", depth + 1)

    for i, store in enumerate(cache.stores):
        visit(store.policy, f"policy[{i}]")
    for i, store in enumerate(cache.stores):
        visit({k: v for k, v in vars(store).items() if k != "policy"}, f"store[{i}]")
    visit({k: v for k, v in vars(cache).items() if k not in ("layers",)}, "cache")
    return out


def _slot_state_bytes(store) -> int:
    """A store's bookkeeping bytes per slot over all rows and heads: the position table's and each ``aux``'s."""
    b, h = store._k.shape[:2]
    per = 8 if store._positions.table is not None else 0
    return b * h * (per + sum(a.element_size() for a in store._aux.values()))


def bookkeeping_bytes(store) -> int:
    """A store's own state besides keys and values, over the slots in use: the position table, the per-token ``aux``
    state, a shared position description, the index caches (``row_offsets``, ``head_index``) and the last decode
    step's slot, keys and values (``static_slot``, ``static_kv``)."""
    if store.packed is not None:  # the packing's bias (H / R entries a slot) and positions over the held slots, its bases
        p = store.packed
        held = p.held_total(store.seen)
        small = sum(t.nbytes for t in p.small() if t is not None)
        return held * (p.bias.element_size() * p.H // p.R + p.pos.element_size()) + small
    if store._k is None:
        return 0
    shared = store._positions.shared
    small = sum(t.nbytes for c in (store._row_base, store._heads) if c is not None for t in c[1:])
    step = [store.static_slot, *(store.static_kv or ())]
    small += sum(t.nbytes for t in step if t is not None)
    return store.n * _slot_state_bytes(store) + (shared.nbytes if isinstance(shared, torch.Tensor) else 0) + small


def declared_headroom_bytes(store) -> int:
    """Bytes of the free slots a store declares (``KVStore.declared_room``, at most what it has): keys, values and
    bookkeeping."""
    if store.packed is not None:  # each segment's free slots (at most ``declared_room`` of the longest head) and bookkeeping
        p = store.packed
        per_head = store.token_bytes() // (p.B * p.H) + p.bias.element_size() * p.H // p.R + p.pos.element_size()
        room = store.declared_room(store.n)
        free = sum(min(p.cap[b][h] - p.held(b, h, store.seen), room) for b in range(p.B) for h in range(p.H))
        return free * per_head
    if store._k is None:
        return 0
    free = min(store._k.shape[2] - store.n, store.declared_room())
    return free * (store.token_bytes() + _slot_state_bytes(store))


def allocation(cache) -> dict:
    """The cache's allocated bytes against its reported and declared bytes: ``allocated`` (every storage it reaches,
    once), ``reported`` (``kv_bytes`` less harness-only bytes), ``bookkeeping``, ``headroom`` (declared: the stores'
    room and the policies' decode buffers), ``declared`` (their sum), ``ratio`` = allocated / declared, ``owners``
    ({``store[i]`` / ``policy[i]`` / ``cache``: (allocated, declared)}: where an excess is) and ``largest`` (the ten
    largest allocations with their paths)."""
    owned = owned_tensors(cache)
    report = cache.method_report()
    harness_only = int(report.get("harness_only_bytes", 0))
    owners: dict[str, list[int]] = {}
    for path, b in owned.values():
        owner = path.split(".", 1)[0].split("[\'", 1)[0]
        owner = owner if owner.startswith(("store[", "policy[")) else "cache"
        owner = owner[: owner.index("]") + 1] if "]" in owner else owner
        owners.setdefault(owner, [0, 0])[0] += b
    bookkeeping = headroom = 0
    for i, s in enumerate(cache.stores):
        book, room, buf = bookkeeping_bytes(s), declared_headroom_bytes(s), s.policy.buffer_bytes(s)
        owners.setdefault(f"store[{i}]", [0, 0])[1] += s.held_bytes() + book + room
        owners.setdefault(f"policy[{i}]", [0, 0])[1] += s.policy.extra_bytes() + buf
        bookkeeping += book
        headroom += room + buf
    cache_book = cache.bookkeeping_bytes()
    owners.setdefault("cache", [0, 0])[1] += cache_book - harness_only  # harness-only bytes: the stores hold them
    bookkeeping += cache_book
    allocated = sum(b for _, b in owned.values())
    reported = cache.held_bytes() - harness_only
    declared = reported + bookkeeping + headroom
    largest = sorted(owned.values(), key=lambda x: -x[1])[:10]
    return {"allocated": allocated, "reported": reported, "bookkeeping": bookkeeping, "headroom": headroom,
            "declared": declared, "ratio": allocated / declared if declared else float("inf"),
            "owners": {k: tuple(v) for k, v in sorted(owners.items())}, "largest": largest}


def check(model, method, prompt: int = 400, steps: int = 32, seed: int = 3,
          tokenizer=None) -> tuple[dict, dict, object]:
    """``allocation`` after the prefill of ``prompt`` random token ids through ``method``'s cache (as the runner
    makes it: ``engine.stand_in_question`` for a question-aware method) and after ``steps`` teacher-forced decode
    steps: (after the prefill, after the steps, the cache). ``tokenizer``: for a method that reads the text
    (lychee's structure-aware chunking)."""
    from luka_bench.engine import stand_in_question  # noqa: PLC0415 (the engine imports the methods)
    from luka_bench.methods import hf  # noqa: PLC0415

    vocab = min(model.config.get_text_config().vocab_size, 256)
    ids = torch.randint(0, vocab, (1, prompt + steps), generator=torch.Generator().manual_seed(seed))
    host = ids[0].tolist()
    ids = ids.to(model.device)
    with hf.attach(model, method, tokenizer) as att, torch.no_grad():
        cache = att.new_cache(reference_length=prompt, **stand_in_question(method, prompt))
        cache.add_tokens(host[:prompt])
        model(input_ids=ids[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
        after_prefill = allocation(cache)
        for i in range(steps):
            cache.add_tokens(host[prompt + i: prompt + i + 1])
            model(input_ids=ids[:, prompt + i: prompt + i + 1], past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
        return after_prefill, allocation(cache), cache
