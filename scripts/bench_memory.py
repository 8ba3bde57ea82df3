"""Peak memory of a prefill under each KV method: every method in a process of its own, at each context length.

What one measurement is: in a fresh process, load the model, warm the method up (a 256-token prefill and two decode
steps through it: kernels, allocator), free what is left (``device.release_memory``), then reset the process's RSS
high-water mark (CPU: ``device.reset_peak_rss``) or the allocator's (CUDA) and run a prefill of N tokens of the essays
through the method followed by two decode steps; the peak's growth over the RSS (allocated bytes) just before the
prefill is the measure: the cache, the activations and whatever the method computes for its scores, not the model.
``--repeats`` processes per (method, N), the median reported with the range. The table (``--markdown``) gives each
method's growth and its ratio to full attention's at each N; ``--plot`` draws peak growth against context length,
one line per method. ``--json`` keeps every measurement.

    .venv/bin/python scripts/bench_memory.py --lengths 8192 16384 --repeats 3 \\
        --json results/summaries/memory/cpu.json --markdown results/summaries/memory/cpu.md \\
        --plot docs/img/prefill_memory.png

On a GPU: ``--model shape_llama31_8b --device cuda --dtype bfloat16`` (the allocator's peak instead of the RSS).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ["full", "streaming_llm", "snapkv", "knorm", "h2o", "laser_kv", "entropy_ols"]


def measure(method: str, n: int, model_over: list[str], threads: int) -> dict:
    """One measurement in this process (the child's work)."""
    import torch
    from hydra.utils import instantiate

    from luka_bench import config, device as D
    from luka_bench.data.pg19 import essays_text
    from luka_bench.engine import forward, prefill, warm_up
    from luka_bench.methods.hf import attach

    torch.set_num_threads(threads)
    kv, model_cfg = config.compose_method([f"method={method}", *model_over])
    lm = instantiate(model_cfg).load()
    model, tok = lm.model, lm.tokenizer
    ids = tok(essays_text(), add_special_tokens=False).input_ids
    if len(ids) < n + 2:
        raise SystemExit(f"--lengths {n}: the essays have {len(ids)} tokens; allowed: up to {len(ids) - 2}")
    dev = model.device
    with torch.no_grad():
        warm_up(model, kv, tok)
        D.release_memory()
        if dev.type == "cuda":
            D.synchronize(dev)
            before = torch.cuda.memory_allocated(dev)
            D.reset_peak(dev)
        else:
            before = D.rss_bytes()
            D.reset_peak_rss()
        t0 = time.perf_counter()
        with attach(model, kv, tok) as att:
            cache = att.new_cache(reference_length=n)
            prefill(model, ids[:n], cache)
            for i in range(2):
                forward(model, ids[n + i: n + i + 1], cache)
            D.synchronize(dev)
            peak = D.peak_allocated(dev) if dev.type == "cuda" else D.rss_bytes("VmHWM")
            held = cache.held_bytes()
            full = cache.full_bytes()
    return {"method": method, "n": n, "peak_growth_bytes": peak - before, "kv_bytes": held, "kv_bytes_full": full,
            "seconds": time.perf_counter() - t0, "device": str(dev), "describe": kv.describe()}


def run_child(method: str, n: int, args) -> dict:
    cmd = [sys.executable, __file__, "--child", method, str(n), "--threads", str(args.threads)] + \
        sum((["--over", o] for o in model_overrides(args)), [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{method} at N={n} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def model_overrides(args) -> list[str]:
    return [f"model={args.model}"] * bool(args.model) + [f"model.device={args.device}"] * bool(args.device) + \
        [f"model.dtype={args.dtype}"] * bool(args.dtype)


def table(rows: list[dict], methods: list[str], lengths: list[int]) -> str:
    """Markdown: per method and N, the median peak growth (GB, min-max over the repeats) and its ratio to full."""
    med = {(r["method"], r["n"]): r for r in rows}
    head = "| method | " + " | ".join(f"N = {n}: peak growth GB (range) | / full" for n in lengths) + " |"
    lines = [head, "|---|" + "--:|--:|" * len(lengths)]
    for m in methods:
        cells = []
        for n in lengths:
            r, f = med.get((m, n)), med.get(("full", n))
            if r is None:
                cells += ["—", "—"]
                continue
            rng = f"{r['min'] / 1e9:.2f}–{r['max'] / 1e9:.2f}"
            cells += [f"{r['median'] / 1e9:.3f} ({rng})",
                      f"{r['median'] / f['median']:.2f}" if f and f["median"] else "—"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], methods: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in methods:
        pts = sorted((r["n"], r["median"] / 1e9) for r in rows if r["method"] == m)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m,
                    linestyle="--" if m == "full" else "-", color="black" if m == "full" else None)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("peak memory growth over the prefill + 2 steps (GB)")
    ax.set_title("Prefill peak per method (median over processes)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--over", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--methods", nargs="+", default=DEFAULT)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--repeats", type=int, default=3, help="processes per (method, N); the median is reported")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.over, args.threads)))
        return
    known = sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))
    bad = [m for m in args.methods if m not in known]
    if bad:
        sys.exit(f"--methods {' '.join(bad)}: unknown; allowed: {', '.join(known)}")
    rows, raw = [], []
    print(f"load {os.getloadavg()}; {args.repeats} process(es) per method and N, {args.threads} threads", flush=True)
    for n in args.lengths:
        for m in args.methods:
            got = [run_child(m, n, args) for _ in range(args.repeats)]
            raw += got
            g = [r["peak_growth_bytes"] for r in got]
            rows.append({"method": m, "n": n, "median": statistics.median(g), "min": min(g), "max": max(g),
                         "kv_bytes": got[0]["kv_bytes"], "kv_bytes_full": got[0]["kv_bytes_full"],
                         "seconds": statistics.median(r["seconds"] for r in got), "describe": got[0]["describe"]})
            print(f"N={n:6d} {m:16s} peak growth {statistics.median(g) / 1e9:.3f} GB "
                  f"(runs: {', '.join(f'{x / 1e9:.3f}' for x in g)}); kv held after {got[0]['kv_bytes'] / 1e9:.3f} GB "
                  f"of {got[0]['kv_bytes_full'] / 1e9:.3f}; {rows[-1]['seconds']:.1f} s", flush=True)
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"rows": rows, "runs": raw}, indent=1))
    md = table(rows, args.methods, args.lengths)
    print(md)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(md + "\n")
    if args.plot:
        plot(rows, args.methods, args.plot)


if __name__ == "__main__":
    main()
