"""Peak memory of a prefill under each KV method: every method in a process of its own, at each context length.

What one measurement is: in a fresh process, load the model, warm the method up (a 256-token prefill in chunks of
128, then one of ``--warm-up`` tokens (2,048) in a single forward, each with two decode steps: kernels, allocator),
free what is left (``device.release_memory``), then reset the process's RSS high-water mark (CPU: ``device.reset_peak_rss``) or the allocator's (CUDA) and run a prefill of N tokens of the essays
through the method followed by two decode steps; the peak's growth over the RSS (allocated bytes) just before the
prefill is the measure: the cache, the activations and whatever the method computes for its scores, not the model.
``--repeats`` processes per (method, N), the median reported with the range. Every measured process runs with
``MALLOC_MMAP_THRESHOLD_=65536`` (``--mmap-threshold``): tensors are then mmapped and a freed one leaves the RSS at
once, so the peak is of what was alive, not of glibc's heap history; and with ``MKL_DISABLE_FAST_MM=1``
(``--mkl-fast-mm`` leaves it on): MKL's memory manager otherwise keeps each thread's GEMM packing buffers (~5 MB
each at 8K here) for reuse, and whether a thread already holds one when the peak is reset depends on what ran
before (the warm-up's shapes, which threads served which GEMMs: ``strace`` showed both threads allocating one
inside the measured prefill of one process and one thread in another's), so the same forward measured 4-6 MB
apart. ``--keep-heap`` (a sensitivity check, both sides) leaves glibc's free heap pages resident when the peak is
reset (``release_memory`` hands them back by default, and the growth then also counts the pages the measured
work's small temporaries touch again in a heap shaped by the process's history). A method named ``<name>+after``
compresses after the prefill's whole forward, as every method did before the per-layer compression (issue 50): a
manual cache whose ``end_prefill`` runs after the forward; the same tokens kept, the old peak. ``<name>,key=value``
sets the method's ``key`` (``duo_attention,pattern_seed=0``); a method that needs the question inside the prompt
(FINCH) reads the prompt's last ``--question`` tokens (32) as its question. ``<name>@<chunk>``
prefills in chunks of that many tokens (``prefill_chunk``: layer by layer for a method that compresses each layer in
the prefill), ``<name>@<chunk>/chunkwise`` chunk by chunk through every layer (``layer_major=False``). The table
(``--markdown``) gives each method's growth, its ratio to full attention's and the KV it holds over full's at each N
(below 1: a compressing method), then names the compressing methods that peak above full attention; ``--plot`` draws
per method (sorted) and length its peak over full attention's beside the KV it holds over full's, kvpress's rows
marked. ``--json`` keeps every measurement, with the bytes of free
chunks in glibc's heap at the reset (``heap_free_bytes``: the history a process's measured work can land in).

    .venv/bin/python scripts/bench_memory.py --lengths 8192 16384 --repeats 3 \\
        --json results/summaries/memory/cpu.json --markdown results/summaries/memory/cpu.md \\
        --plot docs/img/prefill_memory.png

On a GPU: ``--model shape_llama31_8b --device cuda --dtype bfloat16`` (the allocator's peak instead of the RSS).

NVIDIA kvpress beside it, measured the same way (``--kvpress PYTHON``: the interpreter of a venv where kvpress is
installed — it pins an older transformers than this project, so it lives in a venv of its own, e.g.
``python3 -m venv ../kvpress-venv && ../kvpress-venv/bin/pip install torch==2.13.0 kvpress==0.5.5``): the model and
its tokenizer are saved once to a folder (``save_pretrained``), the essays' text and its token ids to files; kvpress's
rows ``kvpress:full`` (no press), ``kvpress:streaming_llm`` (``StreamingLLMPress``, 4 sinks) and ``kvpress:snapkv``
(``SnapKVPress``, window 64, kernel 5) load the model and the tokenizer, tokenize the text (as this project's child
does; the ids checked against the file), run a plain forward of the N tokens under ``with press(model):`` into a
``DynamicCache`` (kvpress compresses each layer in its attention's forward hook), then two decode steps, each in a
process of its own with the same warm-up, reset and peak. ``compression_ratio = 1 - budget`` (``--budget``).
Both sides tokenize because it changes the peak: tokenizing the essays leaves ~47 MB of free chunks in glibc's heap
(mallinfo2), and glibc serves a request from a free chunk before it maps one, whatever ``MALLOC_MMAP_THRESHOLD_``:
the prefill's mid-size tensors then land in trimmed heap pages, which stay resident after their free. kvpress's full
attention at 8K grew 608.7 MB (median of 3 processes) reading the ids from the file and 620.4 MB tokenizing first
(``results/summaries/memory/cpu_8k_session6.json``, ``cpu_8k_session7.json``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AFTER = "+after"  # compress after the prefill's whole forward (a manual cache): the peak before issue 50
DEFAULT = ["full", "streaming_llm", "snapkv", "knorm", "h2o", "laser_kv", "entropy_ols"]


def measure(method: str, n: int, model_over: list[str], threads: int, warm: int, keep_heap: bool = False,
            question: int = 32) -> dict:
    """One measurement in this process (the child's work)."""
    import torch
    from hydra.utils import instantiate

    from luka_bench import config, device as D
    from luka_bench.data.pg19 import essays_text
    from luka_bench.engine import forward, stand_in_question, warm_up
    from luka_bench.methods.hf import attach

    torch.set_num_threads(threads)
    name, chunk, layer_major = parse_method(method)
    name, settings = method_settings(name)
    after = name.endswith(AFTER)
    kv, model_cfg = config.compose_method([f"method={name.removesuffix(AFTER)}", *settings, *model_over])
    lm = instantiate(model_cfg).load()
    model, tok = lm.model, lm.tokenizer
    ids = tok(essays_text(), add_special_tokens=False).input_ids
    if len(ids) < n + 2:
        raise SystemExit(f"--lengths {n}: the essays have {len(ids)} tokens; allowed: up to {len(ids) - 2}")
    dev = model.device
    with torch.no_grad():
        # both prefill paths warmed (a 256-token prompt in chunks of 128, then ``warm`` tokens in one forward, as the
        # unchunked measurement and kvpress's warm-up run them): a kernel's code first run inside the measured prefill
        # would count its pages of libtorch in the peak (SnapKV unchunked at 8K: 2.2 MB of libtorch_cpu.so, smaps)
        warm_up(model, kv, tok)
        warm_up(model, kv, tok, prompt_len=warm, chunk=warm)
        heap_free = free_before_peak(keep_heap)
        if dev.type == "cuda":
            D.synchronize(dev)
            before = torch.cuda.memory_allocated(dev)
            D.reset_peak(dev)
        else:
            before = D.rss_bytes()
            D.reset_peak_rss()
        t0 = time.perf_counter()

        def run() -> tuple[int, int]:
            with attach(model, kv, tok) as att:
                cache = att.new_cache(reference_length=n, manual=after, prefill_chunk=chunk, layer_major=layer_major,
                                      **stand_in_question(kv, n, question))
                forward(model, ids[:n], cache)
                if after:
                    cache.end_prefill()
                for i in range(2):
                    forward(model, ids[n + i: n + i + 1], cache)
                D.synchronize(dev)
                return cache.held_bytes(), cache.full_bytes()

        held, full = run()
        peak = D.peak_allocated(dev) if dev.type == "cuda" else D.rss_bytes("VmHWM")
        seconds = time.perf_counter() - t0
        tensors = None
        if dev.type == "cpu":  # a second run, profiled (after the RSS peak: the profiler's own memory is not in it)
            D.release_memory()
            tensors = tensor_peak(run)
    return {"method": method, "n": n, "peak_growth_bytes": peak - before, "tensor_peak_bytes": tensors,
            "kv_bytes": held, "kv_bytes_full": full, "seconds": seconds, "device": str(dev), "describe": kv.describe(),
            "heap": "kept" if keep_heap else "trimmed", "heap_free_bytes": heap_free}


def free_before_peak(keep_heap: bool) -> int | None:
    """Free what is left before the peak is reset: Python's garbage, and glibc's free heap pages handed back to the OS
    (``device.release_memory``: the growth then counts every heap page the measured work touches, its small
    temporaries' churn included) — unless ``keep_heap`` (``--keep-heap``, a sensitivity check): the free pages stay
    resident and only heap pages beyond them count. Returns the bytes of free chunks left in glibc's heap
    (``heap_free_bytes``): the process's history the measured work can land in."""
    import gc

    from luka_bench import device as D

    if keep_heap:
        gc.collect()
    else:
        D.release_memory()
    return heap_free_bytes()


def heap_free_bytes() -> int | None:
    """Bytes in free chunks of glibc's main heap and arenas (``mallinfo2().fordblks``; None where the C library is not
    glibc >= 2.33). Trimmed pages of these chunks are not resident, but glibc serves a request from a free chunk before
    it maps a new block, so a process with more of them (a tokenizer run before, say) puts more of its measured work's
    mid-size buffers into heap pages that stay resident after their free: a peak to read beside this number."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        return int(libc.mallinfo2().fordblks)
    except (OSError, AttributeError):
        return None


def tensor_peak(fn) -> int:
    """The most bytes of tensors alive at once while ``fn()`` runs on the CPU (PyTorch's allocations, from the
    profiler's record of every allocation and free; not the Python heap, MKL's buffers or code pages), over what was
    alive before: the CPU's counterpart of the CUDA allocator's peak. Only torch is needed (the kvpress child too)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        todo.extend(e.children)
    alive = peak = 0
    for _, size in sorted(events):
        alive += size
        peak = max(peak, alive)
    return peak


TEXT = "essays.txt"  # beside the ids file: the text the kvpress child tokenizes
KVPRESS = "kvpress:"  # rows measured with NVIDIA kvpress's presses (``--kvpress``)
CHUNKWISE = "/chunkwise"  # a chunked prefill run chunk by chunk through every layer (``layer_major=False``)


def method_settings(name: str) -> tuple[str, list[str]]:
    """``config[,key=value...]`` -> (config, ["method.key=value", ...]): a method's settings given with its name
    (``duo_attention,pattern_seed=0``: DuoAttention needs a head pattern, and none ships for the offline models)."""
    base, *settings = name.split(",")
    bad = [x for x in settings if "=" not in x or not x.split("=", 1)[0]]
    if bad:
        raise SystemExit(f"--methods {name}: {', '.join(bad)} is not key=value; allowed: <config>[,key=value...]")
    return base, [f"method.{x}" for x in settings]


def parse_method(method: str) -> tuple[str, int, bool]:
    """``name[@CHUNK[/chunkwise]]`` -> (name, prefill chunk (0: at once), layer-major)."""
    name, _, chunk = method.partition("@")
    return name, int(chunk.removesuffix(CHUNKWISE) or 0), not chunk.endswith(CHUNKWISE)


def measure_kvpress(press_name: str, n: int, model_dir: str, ids_file: str, budget: float, threads: int,
                    warm: int, keep_heap: bool = False) -> dict:
    """One kvpress measurement in this process (run by the kvpress venv's interpreter; imports of this package:
    ``luka_bench.device`` only, which needs nothing but torch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    sys.path.insert(0, str(ROOT))
    from luka_bench import device as D

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenized_as_ours(AutoTokenizer.from_pretrained(model_dir), ids_file)
    press = None
    if press_name != "full":
        from kvpress import SnapKVPress, StreamingLLMPress

        press = {"streaming_llm": lambda: StreamingLLMPress(compression_ratio=1 - budget, n_sink=4),
                 "snapkv": lambda: SnapKVPress(compression_ratio=1 - budget, window_size=64, kernel_size=5)}[press_name]()

    def run(tokens: list[int]) -> int:
        cache = DynamicCache()
        with press(model) if press is not None else contextlib.nullcontext():
            model(torch.tensor([tokens[:-2]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        for i in (2, 1):
            model(torch.tensor([[tokens[-i]]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)

    with torch.no_grad():
        run(ids[:258])  # warm-up: 256 tokens and two steps, as ``engine.warm_up``, then ``warm`` tokens
        run(ids[: warm + 2])
        heap_free = free_before_peak(keep_heap)
        before = D.rss_bytes()
        D.reset_peak_rss()
        t0 = time.perf_counter()
        held = run(ids[: n + 2])
        peak = D.rss_bytes("VmHWM")
        seconds = time.perf_counter() - t0
        D.release_memory()
        tensors = tensor_peak(lambda: run(ids[: n + 2]))
    return {"method": KVPRESS + press_name, "n": n, "peak_growth_bytes": peak - before, "tensor_peak_bytes": tensors,
            "kv_bytes": held, "kv_bytes_full": None, "seconds": seconds, "device": "cpu",
            "describe": f"kvpress {press_name} (compression_ratio={1 - budget:g})" if press else "kvpress full",
            "heap": "kept" if keep_heap else "trimmed", "heap_free_bytes": heap_free}


def tokenized_as_ours(tokenizer, ids_file: str) -> list[int]:
    """The essays' text beside ``ids_file`` tokenized by ``tokenizer`` (the kvpress child's, in its own venv), checked
    against the ids this project's tokenizer gave (``ids_file``)."""
    ids = tokenizer(Path(ids_file).with_name(TEXT).read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    if ids != json.loads(Path(ids_file).read_text()):
        raise SystemExit(f"{ids_file}: the kvpress side's tokenizer gives other ids for the essays' text; allowed: "
                         "the same ids on both sides (the same prompt measured)")
    return ids


def export_for_kvpress(args, work: Path) -> tuple[str, str]:
    """The model and its tokenizer saved to a folder, the essays' text and token ids to files, for the kvpress
    interpreter."""
    from hydra.utils import instantiate

    from luka_bench import config
    from luka_bench.data.pg19 import essays_text

    model_dir, ids_file = work / "model", work / "ids.json"
    if not (ids_file.exists() and (work / TEXT).exists() and (model_dir / "tokenizer_config.json").exists()):
        _, model_cfg = config.compose_method(["method=full", *model_overrides(args)])
        lm = instantiate(model_cfg).load()
        lm.model.save_pretrained(model_dir)
        lm.tokenizer.save_pretrained(model_dir)
        text = essays_text()
        (work / TEXT).write_text(text, encoding="utf-8")
        ids_file.write_text(json.dumps(lm.tokenizer(text, add_special_tokens=False).input_ids))
    return str(model_dir), str(ids_file)


def run_child(method: str, n: int, args) -> dict:
    if method.startswith(KVPRESS):
        cmd = [args.kvpress, __file__, "--kvpress-child", method.removeprefix(KVPRESS), str(n), *args.kvpress_files,
               "--budget", str(args.budget), "--threads", str(args.threads), "--warm-up", str(args.warm_up)] + \
            ["--keep-heap"] * args.keep_heap
    else:
        cmd = [sys.executable, __file__, "--child", method, str(n), "--threads", str(args.threads),
               "--warm-up", str(args.warm_up), "--question", str(args.question)] + ["--keep-heap"] * args.keep_heap + \
            sum((["--over", o] for o in model_overrides(args)), [])
    # large blocks always mmapped, so a freed tensor leaves the RSS at once: glibc otherwise raises its mmap threshold
    # after a free and serves later tensors from a heap it does not shrink, and the peak RSS then measures the
    # allocator's history (streaming_llm at 8K: 0.61 GB without, 0.29 GB with) — the same for every row, kvpress's too
    # (0: glibc's own behaviour — the harness's default threshold, ``device.steady_allocator``, turned off too)
    env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else
                            {"LUKA_BENCH_ALLOCATOR": "system"}),
           **({} if args.mkl_fast_mm else {"MKL_DISABLE_FAST_MM": "1"})}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{method} at N={n} failed:\n{out.stderr[-2000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["allocator"] = {k: env[k] for k in ("MALLOC_MMAP_THRESHOLD_", "MKL_DISABLE_FAST_MM", "LUKA_BENCH_ALLOCATOR")
                        if k in env}
    return row


def median_or_none(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def model_overrides(args) -> list[str]:
    return [f"model={args.model}"] * bool(args.model) + [f"model.device={args.device}"] * bool(args.device) + \
        [f"model.dtype={args.dtype}"] * bool(args.dtype)


def table(rows: list[dict], methods: list[str], lengths: list[int]) -> str:
    """Markdown: per method and N, the median peak growth (GB, min-max over the repeats), its ratio to full's, the KV
    it holds after the two steps over full attention's (``held``: below 1 a compressing method; at or above 1 a method
    that keeps every token, plus its summaries or index) and, where measured (CPU), the median peak of the tensors
    alive at once (``tensor_peak``, MB). Under the table, per N, the compressing methods whose peak is above full
    attention's (the prefill-memory issue's check), or that there are none."""
    med = {(r["method"], r["n"]): r for r in rows}
    tensors = any(r.get("tensor_median") is not None for r in rows)
    per_n = " | / full | held KV / full" + " | tensors' peak MB" * tensors
    head = "| method | " + " | ".join(f"N = {n}: peak growth GB (range)" + per_n for n in lengths) + " |"
    lines = [head, "|---|" + ("--:|--:|--:|" + "--:|" * tensors) * len(lengths)]
    above = {n: [] for n in lengths}
    for m in methods:
        cells = []
        for n in lengths:
            r, f = med.get((m, n)), med.get(("full", n))
            if r is None:
                cells += ["—", "—", "—"] + ["—"] * tensors
                continue
            held = held_fraction(r, f or med.get((KVPRESS + "full", n)))
            rng = f"{r['min'] / 1e9:.3f}–{r['max'] / 1e9:.3f}"
            cells += [f"{r['median'] / 1e9:.3f} ({rng})",
                      f"{r['median'] / f['median']:.2f}" if f and f["median"] else "—",
                      f"{held:.3f}" if held is not None else "—"]
            if tensors:
                cells.append(f"{r['tensor_median'] / 1e6:.2f}" if r.get("tensor_median") is not None else "—")
            if f and held is not None and held < 1 and r["median"] > f["median"]:
                above[n].append(f"{m} (+{(r['median'] - f['median']) / 1e6:.1f} MB)")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    verdicts = [f"N = {n}: compressing methods (held KV / full < 1) peaking above full attention: "
                + (", ".join(above[n]) or "none") + ("" if ("full", n) in med else " (no full row to compare)")
                for n in lengths]
    lines += "\n\n".join(verdicts).split("\n")  # a paragraph each (markdown joins adjacent lines)
    return "\n".join(lines)


def held_fraction(r: dict, full: dict | None) -> float | None:
    """The KV a row holds after its prefill and two steps over full attention's at the same N: its own record of
    full's bytes (``kv_bytes_full``, this project's rows) or a full row's held bytes (kvpress's rows: ours, else
    kvpress's)."""
    whole = r.get("kv_bytes_full") or (full or {}).get("kv_bytes")
    return r["kv_bytes"] / whole if r.get("kv_bytes") is not None and whole else None


def plot_points(rows: list[dict], methods: list[str]) -> tuple[list[str], list[int], dict]:
    """What ``plot`` draws: the methods sorted by peak over full attention's at the longest N (lowest first; a
    method not measured there by its shortest-N ratio), the lengths, and {(method, N): (peak / full, held / full)}
    (held None where unknown). A row needs a full row at its N (ours, else kvpress's)."""
    med = {(r["method"], r["n"]): r for r in rows}
    lengths = sorted({r["n"] for r in rows})
    pts = {}
    for (m, n), r in med.items():
        f = med.get(("full", n)) or med.get((KVPRESS + "full", n))
        if m in methods and f and f["median"]:
            pts[(m, n)] = (r["median"] / f["median"], held_fraction(r, f))
    order = [m for m in methods if any((m, n) in pts for n in lengths)]

    def key(m):
        got = [pts[(m, n)][0] for n in reversed(lengths) if (m, n) in pts]
        return (got[0], m)

    return sorted(order, key=key), lengths, pts


def plot(rows: list[dict], methods: list[str], path: str) -> None:
    """One row per method (sorted by peak / full at the longest N), one colour per context length: a filled dot at the
    prefill's peak over full attention's, a hollow diamond at the KV it holds over full's, a line between them (what
    the method computes or keeps beside its KV during the prefill); kvpress's rows named in italics with square
    dots; a dashed line at full attention (1.0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order, lengths, pts = plot_points(rows, methods)
    fig, ax = plt.subplots(figsize=(7.0, 2.2 + 0.3 * len(order)))  # read at a docs page's width
    colors = plt.get_cmap("tab10").colors
    span = 0.36 / max(1, len(lengths) - 1) if len(lengths) > 1 else 0.0
    for j, n in enumerate(lengths):
        c = colors[j % len(colors)]
        dy = (j - (len(lengths) - 1) / 2) * span
        for i, m in enumerate(order):
            if (m, n) not in pts:
                continue
            peak, held = pts[(m, n)]
            y = i + dy
            if held is not None:
                ax.plot([min(peak, held), max(peak, held)], [y, y], color=c, alpha=0.35, linewidth=1.5)
                ax.plot([held], [y], marker="D", markersize=5, markerfacecolor="none", markeredgecolor=c)
            ax.plot([peak], [y], marker="s" if m.startswith(KVPRESS) else "o", markersize=6, color=c,
                    label=f"N = {n}: peak / full" if i == 0 else None)
        ax.plot([], [], marker="D", linestyle="none", markerfacecolor="none", markeredgecolor=c,
                label=f"N = {n}: KV held / full")
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels(order, fontsize=10)
    for t, m in zip(ax.get_yticklabels(), order):
        if m.startswith(KVPRESS):
            t.set_fontstyle("italic")
    ax.invert_yaxis()
    ax.set_xlabel("over full attention's (1.0 = full)", fontsize=10)
    ax.set_title("Prefill peak (dots; kvpress: squares) and KV held (diamonds)", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.35 / max(1, len(order)) * 8), ncol=2)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--over", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--kvpress-child", nargs=4, metavar=("PRESS", "N", "MODEL_DIR", "IDS"), help=argparse.SUPPRESS)
    ap.add_argument("--kvpress", default=None, metavar="PYTHON",
                    help="a Python with kvpress installed: adds kvpress's full, streaming_llm and snapkv rows")
    ap.add_argument("--kvpress-dir", default="/tmp/luka_bench_kvpress",
                    help="where the model and the token ids are written for the kvpress interpreter")
    ap.add_argument("--mkl-fast-mm", action="store_true",
                    help="leave MKL's buffer cache on in the measured processes (off by default: see the docstring)")
    ap.add_argument("--keep-heap", action="store_true",
                    help="do not hand glibc's free heap pages back before the peak is reset (both sides; a "
                         "sensitivity check: the small temporaries' churn in pages trimmed before is then not counted)")
    ap.add_argument("--mmap-threshold", type=int, default=65536,
                    help="MALLOC_MMAP_THRESHOLD_ of every measured process (glibc; 0: the allocator's default)")
    ap.add_argument("--budget", type=float, default=0.125, help="kvpress's budget (compression_ratio = 1 - budget)")
    ap.add_argument("--methods", nargs="+", default=DEFAULT)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--repeats", type=int, default=3, help="processes per (method, N); the median is reported")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm-up", type=int, default=2048,
                    help="tokens of the second warm-up prefill (one forward, both sides): kernels whose code depends "
                         "on the size (a sort, SDPA's blocking) are then not first run inside the measured prefill")
    ap.add_argument("--question", type=int, default=32,
                    help="for a method that needs the question inside the prompt (FINCH): the prompt's last tokens "
                         "that stand for it (the others get no question)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--table-from", nargs="+", default=None, metavar="JSON",
                    help="measure nothing: merge earlier --json outputs (a later file's (method, N) replacing an "
                         "earlier one's) into the table (--markdown) and the plot (--plot)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.over, args.threads, args.warm_up,
                                 args.keep_heap, args.question)))
        return
    if args.kvpress_child:
        p, n, model_dir, ids_file = args.kvpress_child
        print(json.dumps(measure_kvpress(p, int(n), model_dir, ids_file, args.budget, args.threads, args.warm_up,
                                         args.keep_heap)))
        return
    if args.table_from:
        merged: dict = {}
        for f in args.table_from:
            for r in json.loads(Path(f).read_text())["rows"]:
                merged[(r["method"], r["n"])] = r
        rows = list(merged.values())
        methods = list(dict.fromkeys(r["method"] for r in rows))
        lengths = sorted({r["n"] for r in rows})
        write_outputs(rows, methods, lengths, args)
        return
    known = sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))
    bad = [m for m in args.methods if method_settings(parse_method(m)[0])[0].removesuffix(AFTER) not in known]
    if bad:
        sys.exit(f"--methods {' '.join(bad)}: unknown; allowed: {', '.join(known)}")
    methods = list(args.methods)
    if args.kvpress:
        Path(args.kvpress_dir).mkdir(parents=True, exist_ok=True)
        args.kvpress_files = export_for_kvpress(args, Path(args.kvpress_dir))
        methods += [KVPRESS + p for p in ("full", "streaming_llm", "snapkv")]
    rows, raw = [], []
    print(f"load {os.getloadavg()}; {args.repeats} process(es) per method and N, {args.threads} threads", flush=True)
    for n in args.lengths:
        for m in methods:
            got = [run_child(m, n, args) for _ in range(args.repeats)]
            raw += got
            g = [r["peak_growth_bytes"] for r in got]
            rows.append({"method": m, "n": n, "median": statistics.median(g), "min": min(g), "max": max(g),
                         "tensor_median": median_or_none([r.get("tensor_peak_bytes") for r in got]),
                         "allocator": got[0].get("allocator"), "warm_up": args.warm_up, "heap": got[0].get("heap"),
                         "heap_free_median": median_or_none([r.get("heap_free_bytes") for r in got]),
                         "kv_bytes": got[0]["kv_bytes"], "kv_bytes_full": got[0]["kv_bytes_full"],
                         "seconds": statistics.median(r["seconds"] for r in got), "describe": got[0]["describe"]})
            full = got[0]["kv_bytes_full"]
            print(f"N={n:6d} {m:22s} peak growth {statistics.median(g) / 1e9:.3f} GB "
                  f"(runs: {', '.join(f'{x / 1e9:.3f}' for x in g)}); kv held after {got[0]['kv_bytes'] / 1e9:.3f} GB"
                  + (f" of {full / 1e9:.3f}" if full else "")
                  + (f"; tensors' peak {rows[-1]['tensor_median'] / 1e9:.4f} GB"
                     if rows[-1]["tensor_median"] is not None else "")
                  + (f"; heap's free chunks at the reset {rows[-1]['heap_free_median'] / 1e6:.1f} MB"
                     if rows[-1]["heap_free_median"] is not None else "")
                  + f"; {rows[-1]['seconds']:.1f} s", flush=True)
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"rows": rows, "runs": raw}, indent=1))
    write_outputs(rows, methods, args.lengths, args)


def write_outputs(rows: list[dict], methods: list[str], lengths: list[int], args) -> None:
    md = table(rows, methods, lengths)
    print(md)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(md + "\n")
    if args.plot:
        plot(rows, methods, args.plot)


if __name__ == "__main__":
    main()
