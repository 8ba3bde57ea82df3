"""Decode speed of luka_clustered against full attention (SDPA), measured in one process.

For each context length N: prefill N tokens of real text (Paul Graham essays) once with `full` and once with
`luka_clustered` (its paper settings unless overridden), then decode the following tokens of the text
(teacher-forced, so both see the same inputs) in alternating rounds — a round of `full`, a round of
`luka_clustered`, ... — so machine noise hits both alike. Prints seconds per token (median over steps) for
each, their ratio, and luka's latency breakdown by component.

    .venv/bin/python scripts/bench_decode.py                      # N = 2K, 4K, 8K, 16K
    .venv/bin/python scripts/bench_decode.py --lengths 8192 --steps 64 --threads 2
    .venv/bin/python scripts/bench_decode.py --set refine.k=3 compressor=mean
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
    ap.add_argument("--set", nargs="*", default=[], help="luka_clustered overrides, e.g. refine.k=3")
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from hydra.utils import instantiate

    from luka_bench.data.pg19 import essays_text
    from luka_bench.methods.full import Full
    from luka_bench.methods.hf import attach
    from luka_bench.run import breakdown, forward, prefill

    luka, model_cfg = compose_method("luka_clustered", args.set)
    lm = instantiate(model_cfg).load()
    model, tok = lm.model, lm.tokenizer
    ids = tok(essays_text(), add_special_tokens=False).input_ids
    print(f"model {lm.name} ({lm.info['device']}, {lm.info['dtype']}), torch threads {torch.get_num_threads()}, "
          f"luka: {luka.describe()} {luka.compressor} page={luka.page_size} tail={luka.tail} "
          f"refine={luka.refine.rule}/k={luka.refine.k}/{luka.refine.mass}")
    rows = []
    for n in args.lengths:
        if n + args.steps > len(ids):
            print(f"skip N={n}: the text has only {len(ids)} tokens")
            continue
        if n + args.steps > lm.max_context:  # fine for timing: RoPE positions are computed, not looked up
            print(f"note: N={n} + {args.steps} steps is beyond {lm.name}'s trained context ({lm.max_context}); "
                  "outputs are meaningless there, timings are not")
        caches, prefill_s = {}, {}
        for name, method in (("full", Full()), ("luka_clustered", luka)):
            with attach(model, method) as a:
                c = a.new_cache()
                t0 = time.perf_counter()
                prefill(model, ids[:n], c)
                prefill_s[name] = time.perf_counter() - t0
                c.timings.clear()
                caches[name] = (c, method)
        times = {"full": [], "luka_clustered": []}
        pos = n
        for r in range(0, args.steps, args.round):
            for name in ("full", "luka_clustered"):
                c, method = caches[name]
                with attach(model, method):
                    for t in range(pos, pos + args.round):
                        s = time.perf_counter()
                        forward(model, ids[t: t + 1], c)
                        times[name].append(time.perf_counter() - s)
            pos += args.round
        med = {k: statistics.median(v) for k, v in times.items()}
        comp = {name: breakdown(caches[name][0].timings, times[name]) for name in times}
        lc = caches["luka_clustered"][0]
        row = {"N": n, "full_s_per_token": med["full"], "luka_s_per_token": med["luka_clustered"],
               "ratio_luka_over_full": med["luka_clustered"] / med["full"],
               "prefill_s": prefill_s, "full_breakdown_s_per_token": comp["full"],
               "luka_breakdown_s_per_token": comp["luka_clustered"],
               "luka_pages_layer0": lc.stores[0].policy.P[1]}
        rows.append(row)
        print(f"N={n:6d}  full {med['full'] * 1e3:7.1f} ms/token   luka_clustered "
              f"{med['luka_clustered'] * 1e3:7.1f} ms/token   ratio luka/full {row['ratio_luka_over_full']:.3f}   "
              f"(prefill s: full {prefill_s['full']:.1f}, luka {prefill_s['luka_clustered']:.1f})")
        for name in times:
            print(f"          {name} breakdown ms/token: "
                  + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in comp[name].items()))
        del caches
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
