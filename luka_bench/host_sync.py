"""Count the operations that force a device-to-host copy (a host synchronisation on CUDA) while code runs.

On CUDA every such op stalls the host until the GPU has caught up, so a decode step that syncs once per layer
cannot keep the GPU busy. The same ops can be counted on the CPU, where they are cheap, so the test suite proves
the absence of syncs without a GPU (``tests/test_host_sync.py``). Counted, per call:

- ``aten._local_scalar_dense``: ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)`` (``if t:``) of a tensor;
- ``aten.nonzero`` (and ``masked_select``, ``unique*``, ``repeat_interleave`` without ``output_size``): the
  output's size depends on the data;
- ``aten.index`` / ``index_put_`` with a boolean mask (a ``nonzero`` inside);
- ``aten._linalg_check_errors`` (``torch.linalg.solve``/``inv``/``cholesky`` read an error flag from the device;
  the ``*_ex`` variants do not);
- ``Tensor.tolist()`` (on the CPU it reads memory without dispatching an op; patched while counting);
- a copy from a non-CPU device to the CPU (``.cpu()``, ``.to("cpu")``) — only on a GPU;
- a blocking copy from the CPU to a device (``.to(cuda)`` of host data, ``copy_`` into a device tensor):
  ``copy_to_device``, on a GPU; a tensor made from Python data (``torch.tensor(list, ...)``, ``as_tensor``,
  ``from_numpy``: ``aten.lift_fresh``) is counted on every device — ``copy_to_device`` when it lands on a device,
  ``host_data`` on the CPU, because on a GPU run it is either such a copy (``device=``) or host work that the code
  must declare with ``host_side()`` (``luka_bench.device.host_to_device`` is the sync-free way to hand host data
  over: pinned staging and ``non_blocking``);
- kernels that synchronise internally on CUDA (their result size or an error flag is read on the host):
  ``linalg.svd``, ``pinv``, ``eigh``, ``eig``, ``lstsq`` (no ``_ex`` variant), ``torch.equal``, ``allclose``,
  ``bincount``, ``histc`` — on the CPU they dispatch under these names, so they are counted there too.

``Tensor.tolist()`` is counted once (on a GPU it also copies to the host inside: not counted again);
``torch.tensor`` / ``torch.as_tensor`` of Python data are patched while counting too (with ``device=cuda`` the copy
runs below the dispatcher, where a dispatch mode does not see it).
``with host_side(): ...`` marks host-side work (CPU tensors by construction, e.g. reading the host token ids): not
counted. On CUDA the tests also run under ``torch.cuda.set_sync_debug_mode`` (``decode_sync_counts(sync_debug=)``),
which sees every synchronising CUDA call, counted or not.

``python -m luka_bench.host_sync`` prints the counts per method per steady-state decode step on a tiny model
(see ``decode_sync_counts``)."""
from __future__ import annotations

import contextlib
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
           "unique_consecutive", "unique_dim_consecutive", "_linalg_check_errors",
           # synchronise inside on CUDA (cusolver info flags read on the host, eig computed on the host, a bool
           # or a data-dependent size returned)
           "_linalg_svd", "linalg_svd", "svd", "linalg_pinv", "_linalg_eigh", "linalg_eigh", "linalg_eig",
           "linalg_eigvals", "linalg_lstsq", "equal", "allclose", "bincount", "histc"}

# host_side() and its depth live with the device helpers (a module that imports nothing of the package)
from luka_bench.device import _HOST_SIDE, host_side  # noqa: E402,F401


def _is_bool_index(args) -> bool:
    idx = args[1] if len(args) > 1 else None
    return isinstance(idx, (list, tuple)) and any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in idx)


def _to_device(func, args, kwargs) -> bool:
    """A blocking copy whose source is on the CPU and whose destination is a device (on a GPU: the host waits)."""
    name = func.__name__
    if name.startswith("_to_copy") or name.startswith("to."):
        src = args[0] if args else None
        dev = kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.device.type == "cpu" and dev is not None and \
            torch.device(dev).type != "cpu" and not kwargs.get("non_blocking", False)
    if name.startswith("copy_"):
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst.device.type != "cpu" and \
            not non_blocking
    return False


def _to_host(func, args, kwargs) -> bool:
    """A copy whose source is on a device and whose destination is the CPU."""
    name = func.__name__
    if name.startswith("_to_copy") or name.startswith("to."):
        src = args[0] if args else None
        dev = kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dev is not None and \
            torch.device(dev).type == "cpu"
    if name.startswith("copy_"):
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
    return False


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as c: ...``; ``c.total``, ``c.ops`` (Counter by op name); with ``where=True`` also
    ``c.sites``: Counter of the innermost luka_bench source line of each sync (to find them)."""

    def __init__(self, where: bool = False):
        super().__init__()
        self.ops: Counter = Counter()
        self.sites: Counter = Counter()
        self.where = where
        self._quiet = False

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def _hit(self, name: str) -> None:
        if _HOST_SIDE[0] or self._quiet:
            return
        self.ops[name] += 1
        if self.where:
            frames = [f for f in traceback.extract_stack()[:-2] if "luka_bench" in f.filename
                      and "host_sync" not in f.filename]
            if frames:
                f = frames[-1]
                self.sites[f"{f.filename.split('luka_bench/', 1)[-1]}:{f.lineno} {f.line}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        base = func.__name__.split(".")[0]
        if base in _ALWAYS:
            self._hit(base)
        elif base == "repeat_interleave" and len(args) > 0 and isinstance(args[0], torch.Tensor) and \
                kwargs.get("output_size") is None and not isinstance(args[1] if len(args) > 1 else
                                                                     kwargs.get("repeats"), int):
            self._hit(base)
        elif base in ("index", "index_put", "index_put_") and _is_bool_index(args):
            self._hit(base + "[bool]")
        elif base == "lift_fresh" and isinstance(args[0] if args else None, torch.Tensor):
            # a tensor made from Python data (torch.tensor, as_tensor, from_numpy); a 0-d one on the CPU is a
            # wrapped scalar (``t[i] = 0``): a kernel argument, not a copy
            t = args[0]
            if t.device.type != "cpu":
                self._hit("copy_to_device")
            elif t.dim() > 0:
                self._hit("host_data")
        elif _to_host(func, args, kwargs):
            self._hit("copy_to_host")
        elif _to_device(func, args, kwargs):
            self._hit("copy_to_device")
        return func(*args, **kwargs)

    def __enter__(self):
        counter = self
        self._tolist = torch.Tensor.tolist

        def tolist(t, *a, **k):
            counter._hit("tolist")
            # its own copy to the host (on a GPU) is this one sync: not counted again
            quiet, counter._quiet = counter._quiet, True
            try:
                return counter._tolist(t, *a, **k)
            finally:
                counter._quiet = quiet

        torch.Tensor.tolist = tolist
        # torch.tensor / as_tensor of Python data with a device: the copy happens below the dispatcher (no op for a
        # dispatch mode to see): counted here, the lift_fresh inside not again
        self._factories = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}
        for name, real in self._factories.items():
            setattr(torch, name, self._counted_factory(real))
        return super().__enter__()

    def _counted_factory(self, real):
        counter = self

        def factory(data, *a, **k):
            quiet, counter._quiet = counter._quiet, True  # the lift_fresh (and copy) inside: this one count
            try:
                out = real(data, *a, **k)
            finally:
                counter._quiet = quiet
            if not isinstance(data, torch.Tensor):  # Python data or an array: a copy from the host
                if out.device.type != "cpu":
                    counter._hit("copy_to_device")
                elif out.dim() > 0:
                    counter._hit("host_data")
            return out

        return factory

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        for name, real in self._factories.items():
            setattr(torch, name, real)
        return super().__exit__(*exc)


# ---------------------------------------------------------------------------------------------------------
# Steady-state decode steps of a method on a model.
# ---------------------------------------------------------------------------------------------------------

def events(cache) -> list[int]:
    """Host-side decisions each layer has taken so far: entropy_ols flushes (``flushes`` in its report), lychee
    chunks indexed (``M``), Quest's page closings (``layout_events``). A decode step's events are the layers whose
    count grew (one flush round or one index update of a layer is one event, however many bins or chunks it
    handles)."""
    out = []
    for s in cache.stores:
        n = 0
        if s._k is not None:
            n += int(s.policy.report(s).get("flushes", 0))
            if type(s.policy).__name__ == "LycheePolicy":
                n += int(s.policy.M)
            n += int(getattr(s.policy, "layout_events", 0))  # a paged policy's page closings (Quest)
        out.append(n)
    return out


@contextlib.contextmanager
def cuda_sync_debug(mode: str | None):
    """``with cuda_sync_debug("warn") as flagged:`` runs the block under ``torch.cuda.set_sync_debug_mode(mode)``
    ("warn": every synchronising CUDA call warns — collected in ``flagged``; "error": it raises) and restores the
    default (0) after it. ``None``: nothing (the CPU)."""
    import warnings

    if mode is None:
        yield []
        return
    torch.cuda.set_sync_debug_mode(mode)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            flagged: list = []
            yield flagged
            flagged.extend(w for w in caught if "synchroniz" in str(w.message))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@torch.no_grad()
def decode_sync_counts(model, method, prompt_len: int, steps: int, where: bool = False, seed: int = 0,
                       tokenizer=None, sync_debug: str | None = None, batch: int = 1, ragged: bool = False):
    """Prefill ``prompt_len`` random tokens (``batch`` rows of one length; ``ragged``: rows of ``prompt_len``,
    ``prompt_len - 7``, ... tokens, each prefilled alone in its own cache and decoded together through
    ``hf.RowBatch``) through ``method``'s cache, then run ``steps`` teacher-forced decode
    steps, counting syncs during each step's model forward (the method's whole per-step work: attention, eviction,
    compression). Returns a list of (syncs, events — layers that took a host-side decision —, Counter of ops,
    Counter of sites) per step. ``sync_debug`` ("warn" or "error", CUDA only): each step also runs under
    ``torch.cuda.set_sync_debug_mode`` — with "error" a synchronising CUDA call raises; with "warn" their number is
    added to the step's ops as ``cuda_sync_warnings`` (beside the counted syncs, not in them)."""
    from luka_bench.engine import stand_in_question
    from luka_bench.methods import hf

    dev = model.device
    g = torch.Generator().manual_seed(seed)
    vocab = min(model.config.get_text_config().vocab_size, 256)
    ids = torch.randint(0, vocab, (1, prompt_len + steps), generator=g)
    ids = torch.cat([ids, torch.randint(0, vocab, (batch - 1, prompt_len + steps), generator=g)])
    host_ids = ids[0].tolist()  # the runner hands the ids over from the host (MethodCache.add_tokens)
    ids = ids.to(dev)
    if ragged:
        return _ragged_sync_counts(model, method, ids, prompt_len, steps, where, tokenizer, sync_debug)
    out = []
    with hf.attach(model, method, tokenizer) as att:
        cache = att.new_cache(reference_length=prompt_len, **stand_in_question(method, prompt_len))
        cache.add_tokens(host_ids[:prompt_len])
        model(input_ids=ids[:, :prompt_len], past_key_values=cache, use_cache=True, logits_to_keep=1)  # the prefill
        before = events(cache)
        for i in range(steps):
            x = ids[:, prompt_len + i: prompt_len + i + 1]
            cache.add_tokens(host_ids[prompt_len + i: prompt_len + i + 1])
            with SyncCounter(where=where) as c, cuda_sync_debug(sync_debug) as flagged:
                model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            total = c.total
            if flagged:
                c.ops["cuda_sync_warnings"] += len(flagged)
            now = events(cache)
            out.append((total, sum(a > b for a, b in zip(now, before)), c.ops, c.sites))
            before = now
    return out


def ragged_rows(att, model, method, ids: torch.Tensor, prompt_len: int):
    """Rows of ``prompt_len``, ``prompt_len - 7``, ... tokens of ``ids`` [B, ...], each prefilled alone in its own
    cache (``att``: an ``hf.Attached``): (caches, step) where ``step(i)`` announces decode step i's token to each row's
    cache and returns the step's input ids [B, 1] (row b's token after its own prompt)."""
    from luka_bench.engine import stand_in_question

    lengths = [prompt_len - 7 * b for b in range(ids.shape[0])]
    host = ids.tolist()
    caches = []
    for b, n in enumerate(lengths):
        c = att.new_cache(reference_length=n, **stand_in_question(method, n))
        c.add_tokens(host[b][:n])
        model(input_ids=ids[b: b + 1, :n], past_key_values=c, use_cache=True, logits_to_keep=1)
        caches.append(c)

    def step(i: int) -> torch.Tensor:
        for b, (c, n) in enumerate(zip(caches, lengths)):
            c.add_tokens(host[b][n + i: n + i + 1])
        return torch.stack([ids[b, n + i: n + i + 1] for b, n in enumerate(lengths)])

    return caches, step


def _ragged_sync_counts(model, method, ids, prompt_len, steps, where, tokenizer, sync_debug):
    """``decode_sync_counts`` for rows of different lengths (``ragged_rows``), every decode step one forward of all
    rows (``hf.RowBatch``); a step's events are summed over the rows."""
    from luka_bench.methods import hf

    out = []
    with hf.attach(model, method, tokenizer) as att:
        caches, step = ragged_rows(att, model, method, ids, prompt_len)
        before = [e for c in caches for e in events(c)]
        for i in range(steps):
            x = step(i)
            with SyncCounter(where=where) as cnt, cuda_sync_debug(sync_debug) as flagged:
                model(input_ids=x, past_key_values=hf.RowBatch(caches), use_cache=True, logits_to_keep=1)
            if flagged:
                cnt.ops["cuda_sync_warnings"] += len(flagged)
            now = [e for c in caches for e in events(c)]
            out.append((cnt.total, sum(a > b for a, b in zip(now, before)), cnt.ops, cnt.sites))
            before = now
    return out


def main(argv=None) -> int:
    import argparse

    from hydra.utils import instantiate

    from luka_bench.models import TinyRandomModel
    p = argparse.ArgumentParser(description="syncs per steady-state decode step, per method (tiny random model)")
    p.add_argument("--methods", default=None, help="comma-separated conf/method names (default: all)")
    p.add_argument("--arch", default="llama")
    p.add_argument("--prompt", type=int, default=400)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--where", action="store_true", help="print the source line of every sync")
    p.add_argument("--batch", type=int, default=1, help="rows of one length decoded together (issue 60)")
    p.add_argument("--ragged", action="store_true", help="--batch rows of different lengths, one cache each")
    a = p.parse_args(argv)
    lm = TinyRandomModel(name="tiny", arch=a.arch, num_hidden_layers=4, device=a.device, dtype=a.dtype).load()
    from pathlib import Path

    names = a.methods.split(",") if a.methods else sorted(
        p.stem for p in (Path(__file__).resolve().parent.parent / "conf" / "method").glob("*.yaml"))
    for name in names:
        method = instantiate(sync_method_config(name), _convert_="all")
        if a.batch > 1 and not a.ragged and method.batch_refusal():
            print(f"{name:16s} refuses a batch: {method.batch_refusal()}")
            continue
        rows = decode_sync_counts(lm.model, method, a.prompt, a.steps, where=a.where, tokenizer=lm.tokenizer,
                                  batch=a.batch, ragged=a.ragged)
        per_step = [r[0] for r in rows]
        ev = [r[1] for r in rows]
        with_ev = [s for s, e in zip(per_step, ev) if e]
        without = [s for s, e in zip(per_step, ev) if not e]
        print(f"{name:16s} syncs per step (n={len(rows)}): without an event max {max(without, default=0)}, "
              f"steps with events {len(with_ev)} (events {sum(ev)}, syncs {sum(with_ev)}); per step: {per_step}")
        if a.where:
            sites = Counter()
            for r in rows:
                sites.update(r[3])
            for s, n in sites.most_common():
                print(f"    {n:5d}  {s}")
    return 0


def sync_method_config(name: str, overrides: dict | None = None):
    """``conf/method/<name>.yaml`` scaled to a tiny model and a 400-token prompt so that every method reaches its
    steady state within a few steps: LuKA's and lychee's tails/buffers/budgets shrunk, LASER-KV's block smaller."""
    from pathlib import Path

    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parent.parent / "conf" / "method"
    def load(stem: str):  # (config, the base it varies): a variant (``defaults: [<base>]``, laser_kv_exact) on its base
        raw = OmegaConf.load(root / f"{stem}.yaml")
        base = raw.pop("defaults", None)
        if not base:
            return raw, stem
        under, root_name = load(base[0])
        return OmegaConf.merge(under, raw), root_name

    loaded, base_name = load(name)
    cfg = OmegaConf.create({"method": loaded})  # ${method.*} interpolations
    small = {"luka_clustered": {"tail": 32, "compress_every": 8},
             "lychee": {"token_budget": 96, "buffer": 16, "sink": 4, "full_layers": 1},
             "oracle_topk": {"token_budget": 64},
             "quest": {"token_budget": 64, "full_layers": 1},
             # 400-token prompt: 25 pages of 16, 12 on the device (sink, window and 9 candidates), 6 must be
             "arkvale": {"page_size": 16, "page_budget": 12, "topk": 6, "full_layers": 1},
             # 400-token prompt: 48 chunks of 8 before the 2 local ones, 4 outliers, 8 chunks rebuilt per step
             "shadowkv": {"token_budget": 64, "outliers": 4, "local_chunks": 2},
             "clusterkv": {"token_budget": 64, "sink": 4, "clusters": 16, "full_layers": 1},
             # a window the 400-token prompt exceeds; a short scoring sequence, not cached on disk
             "razor_attention": {"local": 64, "score_length": 32, "heads_cache": None},
             "laser_kv": {"block_size": 128},
             "luka_mixed": {"default": {"tail": 32, "compress_every": 8}},
             "luka_lined": {"min_recent": 16},
             "snapkv": {"window": 16},
             "entropy_ols": {"bin_size": 8, "rank": 2},
             # no learned pattern ships for the tiny models: synthetic gates (half the heads streaming), a window
             # the 400-token prompt exceeds
             "duo_attention": {"pattern_seed": 0, "sink": 4, "recent": 64}}
    if name in small or base_name in small:
        cfg = OmegaConf.merge(cfg, {"method": small.get(name, small.get(base_name))})
    if overrides:
        cfg = OmegaConf.merge(cfg, {"method": overrides})
    if name in ("luka_mixed", "h2o_outer"):
        cfg.method.rules[0].layers = "first:1,last:1"
    if name == "luka_mixed":
        cfg.method.rules[0].method.min_recent = 16
    OmegaConf.resolve(cfg)
    return cfg.method


if __name__ == "__main__":
    # run the imported module's main, not this __main__ copy: host_side() state must be the one the methods import
    from luka_bench.host_sync import main as _main

    raise SystemExit(_main())
