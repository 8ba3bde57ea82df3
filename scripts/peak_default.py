"""The peak memory of a default process (issue 61): what a user's own script sees, with none of the benchmark's
allocator settings. Each measurement is a fresh process that does what a new user does — ``import luka_bench as lb``,
``lb.load_model("smollm2_135m")``, ``lb.attach(model, method, tokenizer)``, ``kv.generate`` of N tokens of the essays
(token ids) and 2 new tokens — with the RSS high-water mark reset right before ``generate`` (after ``gc`` and
``malloc_trim``: ``device.release_memory``, ``device.reset_peak_rss``); the peak's growth over the RSS then is the
measure. ``--repeats`` processes per method, interleaved (method A, B, C, A, B, C, ...), each on ``--threads``
threads; the environment is the caller's less ``MALLOC_*``, ``MKL_*``, ``LUKA_BENCH_MMAP_THRESHOLD`` and
``LUKA_BENCH_MKL_CACHE`` (``--keep-env`` keeps them), and
``--allocator`` sets ``LUKA_BENCH_ALLOCATOR`` for the children: ``unset`` (the default: no variable, what a user's
process has — the harness's own setting, ``device.steady_allocator``), ``steady`` (the same, named) or ``system``
(glibc's and MKL's own behaviour).
Prints each process's growth, then per method the median, the range and the spread ((max - min) / median).

    .venv/bin/python scripts/peak_default.py --methods full streaming_llm snapkv --length 8192 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(method: str, length: int, threads: int) -> dict:
    import torch

    import luka_bench as lb
    from luka_bench.data.pg19 import essays_text
    from luka_bench.device import release_memory, reset_peak_rss, rss_bytes

    torch.set_num_threads(threads)
    lm = lb.load_model("smollm2_135m")
    ids = lm.tokenizer(essays_text(), add_special_tokens=False).input_ids[:length]
    with lb.attach(lm.model, lb.method(method), lm.tokenizer) as kv:
        release_memory()
        before = rss_bytes()
        reset_peak_rss()
        ans = kv.generate(ids, max_new_tokens=2)
        peak = _peak()
    return {"method": method, "length": length, "rss_before": before, "peak": peak, "growth": peak - before,
            "kv_ratio": ans.kv_ratio}


def _peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["full", "streaming_llm", "snapkv"])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep-env", action="store_true",
                    help="keep the caller's MALLOC_* / MKL_* / LUKA_BENCH_MMAP_THRESHOLD / LUKA_BENCH_MKL_CACHE")
    ap.add_argument("--allocator", choices=["unset", "steady", "system"], default="unset",
                    help="LUKA_BENCH_ALLOCATOR for the children: unset (what a user's process has: the harness's "
                         "default, device.steady_allocator), steady, or system (glibc's and MKL's own behaviour)")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    ap.add_argument("--child", nargs=3, metavar=("METHOD", "LENGTH", "THREADS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]), int(a.child[2]))))
        return 0
    env = dict(os.environ)
    if not a.keep_env:
        env = {k: v for k, v in env.items()
               if not k.startswith(("MALLOC_", "MKL_", "LUKA_BENCH_MMAP", "LUKA_BENCH_MKL"))}
    env.pop("LUKA_BENCH_ALLOCATOR", None)
    if a.allocator != "unset":
        env["LUKA_BENCH_ALLOCATOR"] = a.allocator
    rows = []
    for r in range(a.repeats):
        for m in a.methods:
            out = subprocess.run([sys.executable, __file__, "--child", m, str(a.length), str(a.threads)], env=env,
                                 capture_output=True, text=True, cwd=ROOT)
            if out.returncode:
                raise SystemExit(f"{m}: the child failed:\n{out.stderr[-2000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{m:16s} run {r + 1}: growth {row['growth'] / 2**30:.3f} GB "
                  f"(RSS before {row['rss_before'] / 2**30:.2f})", flush=True)
    print(f"\n| method | N | growth GB, median (range) | spread | runs |\n|---|--:|--:|--:|--:|")
    for m in a.methods:
        g = [x["growth"] / 2**30 for x in rows if x["method"] == m]
        med = statistics.median(g)
        print(f"| {m} | {a.length} | {med:.3f} ({min(g):.3f}-{max(g):.3f}) | {(max(g) - min(g)) / med:.1%} | "
              f"{', '.join(f'{x:.3f}' for x in g)} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
