"""Decode speed of KV methods against full attention (SDPA), measured in one process.

For each context length N: prefill N tokens of real text (Paul Graham essays) once per method (`--methods`, any
`conf/method` names; default `full,luka_clustered`), then decode the following tokens of the text
(teacher-forced, so all see the same inputs) in alternating rounds — a round of the first method, a round of the
second, ... — so machine noise hits all alike. Prints seconds per token (median over steps) for each, their ratio
to the first, and each one's latency breakdown by component.

    .venv/bin/python scripts/bench_decode.py                      # N = 2K, 4K, 8K, 16K
    .venv/bin/python scripts/bench_decode.py --lengths 8192 --steps 64 --threads 2
    .venv/bin/python scripts/bench_decode.py --set refine.k=3 compressor=mean
    .venv/bin/python scripts/bench_decode.py --methods full,lychee --lengths 8192 16384
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def compose_method(name: str, sets: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"method={name}"] + [f"method.{s}" for s in sets])
    return instantiate(cfg.method), cfg.model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--steps", type=int, default=48, help="decode steps per method (a multiple of --round)")
    ap.add_argument("--round", type=int, default=16, help="steps per alternating round")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--methods", type=str, default="full,luka_clustered",
                    help="comma-separated conf/method names; ratios are to the first")
    ap.add_argument("--set", nargs="*", default=[], help="overrides of every method but the first, e.g. refine.k=3")
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from hydra.utils import instantiate

    from luka_bench.data.pg19 import essays_text
    from luka_bench.methods.hf import attach
    from luka_bench.run import breakdown, forward, prefill

    names = [x for x in args.methods.split(",") if x]
    methods, model_cfg = {}, None
    for i, name in enumerate(names):
        methods[name], model_cfg = compose_method(name, args.set if i else [])
    lm = instantiate(model_cfg).load()
    model, tok = lm.model, lm.tokenizer
    ids = tok(essays_text(), add_special_tokens=False).input_ids
    print(f"model {lm.name} ({lm.info['device']}, {lm.info['dtype']}), torch threads {torch.get_num_threads()}, "
          "methods: " + ", ".join(m.describe() for m in methods.values()))
    rows = []
    base = names[0]
    for n in args.lengths:
        if n + args.steps > len(ids):
            print(f"skip N={n}: the text has only {len(ids)} tokens")
            continue
        if n + args.steps > lm.max_context:  # fine for timing: RoPE positions are computed, not looked up
            print(f"note: N={n} + {args.steps} steps is beyond {lm.name}'s trained context ({lm.max_context}); "
                  "outputs are meaningless there, timings are not")
        caches, prefill_s = {}, {}
        for name, method in methods.items():
            with attach(model, method, tok) as a:
                c = a.new_cache()
                t0 = time.perf_counter()
                prefill(model, ids[:n], c)
                prefill_s[name] = time.perf_counter() - t0
                c.timings.clear()
                caches[name] = (c, method)
        times = {name: [] for name in methods}
        pos = n
        for r in range(0, args.steps, args.round):
            for name in methods:
                c, method = caches[name]
                with attach(model, method, tok):
                    for t in range(pos, pos + args.round):
                        s = time.perf_counter()
                        forward(model, ids[t: t + 1], c)
                        times[name].append(time.perf_counter() - s)
            pos += args.round
        med = {k: statistics.median(v) for k, v in times.items()}
        comp = {name: breakdown(caches[name][0].timings, times[name]) for name in times}
        row = {"N": n, "s_per_token": med, "ratio_to_" + base: {k: v / med[base] for k, v in med.items()},
               "prefill_s": prefill_s, "breakdown_s_per_token": comp,
               "attended": {k: caches[k][0].attended_stats() for k in methods}}
        rows.append(row)
        print(f"N={n:6d}  " + "   ".join(f"{k} {v * 1e3:7.1f} ms/token" for k, v in med.items()) + "   ratio "
              + ", ".join(f"{k}/{base} {v / med[base]:.3f}" for k, v in med.items() if k != base)
              + "   (prefill s: " + ", ".join(f"{k} {v:.1f}" for k, v in prefill_s.items()) + ")")
        for name in times:
            att = row["attended"][name]["attended_tokens"]
            print(f"          {name} breakdown ms/token: "
                  + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in comp[name].items())
                  + (f"; attended tokens/layer/step {att:.0f}" if att is not None else ""))
        del caches
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
