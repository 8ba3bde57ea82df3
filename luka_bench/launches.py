"""Count the kernel-launching aten ops of a decode step, per layer, against stock transformers (issue 36).

On a GPU a decode step of a small or mid-sized model is bound by kernel launches, not by arithmetic: every
kernel costs a few microseconds of host time whatever its size. A method that adds 30 small ops per layer and
step can double a step's time while its FLOPs are negligible. ``LaunchCounter`` (a ``TorchDispatchMode``, the
sibling of ``host_sync.SyncCounter``) counts the aten ops that reach the dispatcher below autograd — the ops that
would launch a kernel on CUDA — and leaves out the ones that launch none:

- **views** (``NOT_LAUNCHING`` rule 1): every op whose schema says an output aliases an input without writing it
  (``Tensor(a)`` returns: ``view``, ``_reshape_alias``, ``expand``, ``select``, ``slice``, ``transpose``, ``t``,
  ``permute``, ``as_strided``, ``unsqueeze``, ``squeeze``, ``detach``, ``alias``, ``split``/``unbind``/``chunk``,
  ``diagonal``, ``unfold``, ``narrow``, ...) and ``_unsafe_view`` (a view whose schema does not say so);
- **pure metadata and allocation** (rule 2, ``METADATA``): ``size``/``stride``/``numel``/``dim``/``sym_*``,
  ``is_contiguous``, ``empty``/``empty_like``/``empty_strided``/``new_empty``/``new_empty_strided`` (an
  allocation from the caching allocator, no kernel), ``lift_fresh`` and ``_to_copy`` to the tensor's own dtype and
  device (a no-op copy request; ``Tensor.to`` with nothing to do returns ``self`` and dispatches nothing anyway).

Everything else counts once per call: in-place ops (``add_``, ``index_copy_``, ``copy_``, ``fill_``), factories
that write (``zeros`` = ``empty`` + ``zero_``: one), ``_local_scalar_dense`` (a device-to-host copy; also a sync,
counted by ``SyncCounter``). A composite op (``reshape`` of a non-contiguous tensor, ``contiguous``,
``softmax``) is counted as the ops it decomposes into before it reaches the mode — what the GPU would run. The
count is taken on the CPU; on CUDA the fused kernels chosen for a few ops (SDPA's backend, a matmul's epilogue)
can differ by one or two, the same for a method and for stock.

Per layer per step: the launches of one model forward (a steady-state decode step: one token, teacher-forced)
divided by the number of layers, embedding and LM head included (the same in every method, so the *extra* over
stock is the method's alone). Stock is plain transformers: the same model with ``sdpa`` attention and a
``DynamicCache``, no luka_bench code. ``python -m luka_bench.launches`` prints, per method, the median over 24
steady-state steps without an event and, for steps with events (entropy_ols flushes, lychee index updates, LuKA
clustered's segmentation/compression), their extra launches per event (an event: one layer taking that step),
and the mean over every step, events included (rows whose events fall on different steps: entropy_ols's flushes at
8 ragged rows leave no step without one).
``tests/test_launches.py`` holds the budgets.

The count is of the portable path, the one CUDA runs: the decode steps are counted with the CPU-only fused
kernels off (``LUKA_BENCH_NO_KERNEL=1``; on the CPU, lychee's chunk choice is one C++ op, ``cpu_kernel``)."""
from __future__ import annotations

import contextlib
import functools
import statistics
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

METADATA = {"size", "stride", "numel", "dim", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
            "is_contiguous", "is_non_overlapping_and_dense", "storage_offset", "is_same_size", "empty",
            "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "_unsafe_view",
            "_reshape_alias", "resize_"}  # resize_ of an empty output (an out= op's result): an allocation


def _is_view(func) -> bool:
    """An output aliases an input and the op writes none of them (a view: metadata only)."""
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _noop_copy(base: str, args, kwargs) -> bool:
    if base != "_to_copy" or not args or not isinstance(args[0], torch.Tensor):
        return False
    t = args[0]
    dt, dev = kwargs.get("dtype"), kwargs.get("device")
    return (dt is None or dt == t.dtype) and (dev is None or torch.device(dev) == t.device) and \
        kwargs.get("memory_format") in (None, torch.preserve_format)


def launches_op(func, args, kwargs) -> bool:
    """Whether one dispatched aten op launches a kernel (see the module docstring for what does not)."""
    base = func.__name__.split(".")[0]
    if base in METADATA or _is_view(func):
        return False
    return not _noop_copy(base, args, kwargs or {})


def _signature(a):
    """What a CUDA graph captures of one argument: a tensor's shape, dtype and device (its data may change between
    replays), any other value as it is (a Python number is baked into the captured kernel: a value that changes
    from step to step would replay stale)."""
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), str(a.dtype), a.device.type)
    if isinstance(a, (list, tuple)):
        return tuple(_signature(x) for x in a)
    return a


class LaunchCounter(TorchDispatchMode):
    """``with LaunchCounter() as c: ...``; ``c.total``, ``c.ops`` (Counter by op name, launching ops only),
    ``c.trace`` (with ``trace=True``: every dispatched op as (name, its arguments' signatures, its keyword
    arguments'), views included — for the graph-ready check that two steps dispatch the same ops on tensors of the
    same shapes with the same non-tensor arguments)."""

    def __init__(self, trace: bool = False, method_only: bool = False):
        super().__init__()
        self.ops: Counter = Counter()
        self.trace: list | None = [] if trace else None
        self.method_only = method_only  # trace only the ops dispatched inside luka_bench's cache and attention code

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if launches_op(func, args, kwargs):
            self.ops[func.__name__.split(".")[0]] += 1
        if self.trace is not None and (not self.method_only or _IN_METHOD[0]):
            self.trace.append((func.__name__, tuple(_signature(a) for a in args),
                               tuple((k, _signature(v)) for k, v in sorted(kwargs.items()))))
        return func(*args, **kwargs)


_IN_METHOD = [0]  # > 0 while luka_bench's own per-forward code runs (``method_scope``)


@contextlib.contextmanager
def method_scope():
    """While active, the code luka_bench runs in a forward — a layer's cache update (``KVStore.update``), its
    attention and per-step policy work (``hf.run_policy``), the end of the forward (``MethodCache.after_forward``),
    stacked rows' write, attention and positions (``methods/stacked.py``) — is marked, so that
    ``LaunchCounter(method_only=True)`` traces it alone. The model's own code (embeddings, projections, RoPE, the
    positions transformers derives from the cache's length) is left out: it is transformers' business whether that
    part can be captured, and stock decode has the same."""
    from luka_bench.methods import hf

    def scoped(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            _IN_METHOD[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                _IN_METHOD[0] -= 1
        return wrapper

    from luka_bench.methods import stacked

    saved = (hf.run_policy, hf.KVStore.update, hf.MethodCache.after_forward, hf._stacked_attention,
             stacked.StackedLayer.write, stacked.RowStack.positions)
    hf.run_policy = scoped(saved[0])
    hf.KVStore.update = scoped(saved[1])
    hf.MethodCache.after_forward = scoped(saved[2])
    hf._stacked_attention = scoped(saved[3])  # rows of a batch decoding a layer as one (``methods/stacked.py``)
    stacked.StackedLayer.write = scoped(saved[4])
    stacked.RowStack.positions = scoped(saved[5])
    try:
        yield
    finally:
        (hf.run_policy, hf.KVStore.update, hf.MethodCache.after_forward, hf._stacked_attention,
         stacked.StackedLayer.write, stacked.RowStack.positions) = saved


def event_count(cache) -> list[int]:
    """Host-side decisions each layer has taken so far (``host_sync.events``: entropy_ols flushes, lychee chunks
    indexed) plus LuKA clustered's compressions (its frontier: raw tokens turned into pages so far)."""
    from luka_bench.host_sync import events

    out = events(cache)
    for i, s in enumerate(cache.stores):
        if s._k is not None and hasattr(s.policy, "frontier") and hasattr(s.policy, "compress"):
            out[i] += int(s.policy.frontier)
    return out


def _ids(model, prompt_len: int, steps: int, seed: int, batch: int = 1):
    """Random token ids [batch, prompt_len + steps] (row 0 the same whatever ``batch``)."""
    g = torch.Generator().manual_seed(seed)
    vocab = min(model.config.get_text_config().vocab_size, 256)
    first = torch.randint(0, vocab, (1, prompt_len + steps), generator=g)
    return torch.cat([first, torch.randint(0, vocab, (batch - 1, prompt_len + steps), generator=g)])


@torch.no_grad()
def stock_launch_counts(model, prompt_len: int, steps: int, seed: int = 0, batch: int = 1) -> list[int]:
    """Launches of each of ``steps`` decode steps of plain transformers (sdpa, ``DynamicCache``) after a prefill
    of ``prompt_len`` random tokens (``batch`` rows)."""
    from transformers import DynamicCache

    ids = _ids(model, prompt_len, steps, seed, batch).to(model.device)
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        cache = DynamicCache()
        model(input_ids=ids[:, :prompt_len], past_key_values=cache, use_cache=True, logits_to_keep=1)
        out = []
        for i in range(steps):
            with LaunchCounter() as c:
                model(input_ids=ids[:, prompt_len + i: prompt_len + i + 1], past_key_values=cache, use_cache=True,
                      logits_to_keep=1)
            out.append(c.total)
    finally:
        model.set_attn_implementation(previous)
    return out


@torch.no_grad()
def decode_launch_counts(model, method, prompt_len: int, steps: int, seed: int = 0, tokenizer=None,
                         trace: bool = False, method_only: bool = False, batch: int = 1, ragged: bool = False):
    """``method``'s cache prefilled with ``prompt_len`` random tokens (``batch`` rows of one length; ``ragged``: rows
    of ``prompt_len``, ``prompt_len - 7``, ... tokens, each prefilled alone in its own cache and decoded together
    through ``hf.RowBatch``, the events summed over the rows), then ``steps``
    teacher-forced decode steps (as ``host_sync.decode_sync_counts``). Returns per step (launches, events — layers that took a host-side
    decision or compressed —, Counter of launching ops, trace or None). ``method_only``: the trace holds the ops
    of luka_bench's own code only (``method_scope``); the counts are always the whole forward's."""
    from luka_bench.engine import stand_in_question
    from luka_bench.methods import cpu_kernel, hf

    ids = _ids(model, prompt_len, steps, seed, batch)
    host_ids = ids[0].tolist()
    ids = ids.to(model.device)
    out = []
    with hf.attach(model, method, tokenizer) as att, (method_scope() if method_only else contextlib.nullcontext()):
        if ragged:  # rows of different lengths, one cache each (``host_sync.ragged_rows``)
            from luka_bench.host_sync import ragged_rows

            caches, ragged_step = ragged_rows(att, model, method, ids, prompt_len)
        else:
            caches = [att.new_cache(reference_length=prompt_len, **stand_in_question(method, prompt_len))]
            caches[0].add_tokens(host_ids[:prompt_len])
            model(input_ids=ids[:, :prompt_len], past_key_values=caches[0], use_cache=True, logits_to_keep=1)
        cache = hf.RowBatch(caches) if ragged else caches[0]

        def count():
            return [e for c in caches for e in event_count(c)]

        before = count()
        for i in range(steps):
            if ragged:
                x = ragged_step(i)
            else:
                x = ids[:, prompt_len + i: prompt_len + i + 1]
                cache.add_tokens(host_ids[prompt_len + i: prompt_len + i + 1])
            with cpu_kernel.kernels_off(), LaunchCounter(trace=trace, method_only=method_only) as c:
                model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            now = count()
            out.append((c.total, sum(a > b for a, b in zip(now, before)), c.ops, c.trace))
            before = now
    return out


def summary(rows, stock: list[int], layers: int) -> dict:
    """Per layer: ``stock`` (median stock launches / layers), ``extra`` (median launches of the steps without an
    event / layers - stock), ``event_extra`` (launches of the event steps over that median, per event; None if
    no step had one), ``steps_with_events``, ``mean_extra`` (the mean over every step, events included / layers -
    stock: what rows whose events fall on different steps pay per step — at 8 ragged rows entropy_ols has no step
    without one)."""
    base = statistics.median(stock) / layers
    plain = [n for n, ev, _, _ in rows if not ev]
    med = statistics.median(plain) if plain else float("nan")
    ev_rows = [(n, ev) for n, ev, _, _ in rows if ev]
    per_event = (sum(n - med for n, _ in ev_rows) / sum(ev for _, ev in ev_rows)) if ev_rows else None
    return {"stock": base, "extra": med / layers - base, "event_extra": per_event, "steps_with_events": len(ev_rows),
            "mean_extra": statistics.mean(n for n, _, _, _ in rows) / layers - base}


def extra_ops(rows, stock_ops: Counter, layers: int) -> Counter:
    """The launching ops of a median step without an event over stock's, per layer (for stating what remains)."""
    plain = sorted([r for r in rows if not r[1]], key=lambda r: r[0])
    if not plain:
        return Counter()
    ops = plain[len(plain) // 2][2].copy()
    ops.subtract(stock_ops)
    return Counter({k: v / layers for k, v in ops.items() if v})


@torch.no_grad()
def stock_ops(model, prompt_len: int, seed: int = 0) -> Counter:
    """The launching ops of one stock decode step (after the prefill)."""
    from transformers import DynamicCache

    ids = _ids(model, prompt_len, 1, seed).to(model.device)
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        cache = DynamicCache()
        model(input_ids=ids[:, :prompt_len], past_key_values=cache, use_cache=True, logits_to_keep=1)
        with LaunchCounter() as c:
            model(input_ids=ids[:, prompt_len:], past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    return c.ops


def main(argv=None) -> int:
    import argparse
    from pathlib import Path

    from hydra.utils import instantiate

    from luka_bench.host_sync import sync_method_config
    from luka_bench.models import TinyRandomModel

    p = argparse.ArgumentParser(description="kernel launches per layer per steady-state decode step, per method, "
                                            "over stock transformers (tiny random model)")
    p.add_argument("--methods", default=None, help="comma-separated conf/method names (default: all)")
    p.add_argument("--arch", default="llama")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=400)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--ops", action="store_true", help="print each method's launching ops over stock, per layer")
    p.add_argument("--batch", type=int, default=1, help="rows of one length decoded together (issue 60)")
    p.add_argument("--ragged", action="store_true", help="--batch rows of different lengths, one cache each")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    lm = TinyRandomModel(name="tiny", arch=a.arch, num_hidden_layers=a.layers, device="cpu", dtype="float32").load()
    names = a.methods.split(",") if a.methods else sorted(
        q.stem for q in (Path(__file__).resolve().parent.parent / "conf" / "method").glob("*.yaml"))
    stock = stock_launch_counts(lm.model, a.prompt, a.steps, batch=a.batch)
    sops = stock_ops(lm.model, a.prompt) if a.ops else None
    print(f"launches per layer per decode step ({a.arch}, {a.layers} layers, prompt {a.prompt}, batch {a.batch}"
          f"{' of different lengths, one cache per row' if a.ragged else ''}, "
          f"median of {a.steps} steps; all steps: their mean, events included); stock (sdpa + DynamicCache): "
          f"{statistics.median(stock) / a.layers:g}")
    print(f"{'method':16s} {'stock/layer':>11s} {'extra/layer':>11s} {'per event':>10s} {'event steps':>11s} "
          f"{'all steps':>9s}")
    for name in names:
        method = instantiate(sync_method_config(name), _convert_="all")
        if a.batch > 1 and not a.ragged and method.batch_refusal():
            print(f"{name:16s} refuses a batch: {method.batch_refusal()}")
            continue
        rows = decode_launch_counts(lm.model, method, a.prompt, a.steps, tokenizer=lm.tokenizer, batch=a.batch,
                                    ragged=a.ragged)
        s = summary(rows, stock, a.layers)
        ev = "-" if s["event_extra"] is None else f"{s['event_extra']:.1f}"
        print(f"{name:16s} {s['stock']:11g} {s['extra']:11g} {ev:>10s} {s['steps_with_events']:11d} "
              f"{s['mean_extra']:9.2f}")
        if a.ops:
            for op, v in sorted(extra_ops(rows, sops, a.layers).items(), key=lambda kv: -abs(kv[1])):
                print(f"    {v:+6g}  {op}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
