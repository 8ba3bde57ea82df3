"""Every method config on a real model: prompts of different lengths decoded together as the rows of one batch
(``KV.generate_many``) against each prompt alone (``KV.generate``) — issue 60's invariant on SmolLM2 in fp32:
tokens identical, or, where a batched matrix product's rounding flips a token, the solo run's top-two logit margin
at that step shown to be a near-tie (below 1e-4) and reported.

    .venv/bin/python scripts/rows_alone.py --threads 2 --json results/summaries/batch/rows_alone_smollm2.json

Prompts: essay passages of different lengths (pg19's essays), one question each, each method's own config
(``conf/method``; DuoAttention with synthetic gates, ``pattern_seed=0``; FINCH under the query-aware protocol, its
question inside the compressed prompt), greedy, ``--new`` tokens, the engine's stops (EOS). Per config: the rows
whose tokens equal the row alone, and for any other the first step that differs with the solo run's top-two margin
there (a manual solo decode, checked to give ``generate``'s tokens). A table per config; exit 1 when a difference is
not a near-tie."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NEAR_TIE = 1e-4
# what a config needs on the offline models (none of DuoAttention's learned head patterns ships for them)
SETTINGS = {"duo_attention": {"pattern_seed": 0}}
QUERY_AWARE = {"finch"}  # its observation window is the question inside the compressed prompt (kvpress's protocol)
QUESTION = "What is this passage about? Answer in one sentence."


def configs() -> list[str]:
    from luka_bench.errors import group_options

    return group_options("method")


@torch.no_grad()
def solo_margins(kv, context: str, new: int, query_aware: bool = False) -> tuple[list[int], list[float]]:
    """The prompt alone, step by step as ``generate`` runs it (``KV._plan``, the tail rule, greedy, EOS): its
    tokens and, per step, the top-two logit margin."""
    from luka_bench import engine as E

    _, _, head, tail_ids, cache_kw = kv._plan(context, QUESTION, "", True, query_aware)
    cache = kv.new_cache(**cache_kw)
    E.timed_prefill(kv.model, head, cache)
    logits = E.feed(kv.model, tail_ids, cache)
    eos = E.eos_token_ids(kv.model, kv.tokenizer)
    tokens, margins = [], []
    while len(tokens) < new:
        top = torch.topk(logits.float().reshape(-1), 2)
        tok = int(top.indices[0])
        if tok in eos:
            break
        tokens.append(tok)
        margins.append(float(top.values[0] - top.values[1]))
        logits = E.forward_rows(kv.model, [tok], [cache])[0]
    E.release_rows([cache])
    return tokens, margins


def check(lm, name: str, contexts: list[str], new: int) -> dict:
    import luka_bench as lb

    t0 = time.perf_counter()
    qa = name in QUERY_AWARE
    with lb.attach(lm, lb.method(name, **SETTINGS.get(name, {}))) as kv:
        alone = [kv.generate(c, QUESTION, max_new_tokens=new, query_aware=qa) for c in contexts]
        together = kv.generate_many(contexts, [QUESTION] * len(contexts), max_new_tokens=new, query_aware=qa,
                                    batch_size=len(contexts))
        rows = []
        for r, (a, t) in enumerate(zip(alone, together)):
            row = {"prompt_tokens": a.context_tokens + a.question_tokens, "new_tokens": len(a.token_ids),
                   "equal": t.token_ids == a.token_ids,
                   "kv_equal": t.kv_tokens == a.kv_tokens and t.kv_ratio == a.kv_ratio}
            if not row["equal"]:
                tokens, margins = solo_margins(kv, contexts[r], new, qa)
                step = next((i for i, (x, y) in enumerate(zip(t.token_ids, a.token_ids)) if x != y),
                            min(len(t.token_ids), len(a.token_ids)))
                row.update(step=step, solo_matches_generate=tokens == a.token_ids,
                           margin=margins[step] if step < len(margins) else None)
            rows.append(row)
    return {"rows": rows, "query_aware": qa, "seconds": round(time.perf_counter() - t0, 1)}


def verdict(res: dict) -> str:
    bad = [r for r in res["rows"] if not r["equal"]]
    if not bad:
        return "identical"
    if all(r.get("margin") is not None and r["margin"] < NEAR_TIE and r["solo_matches_generate"] for r in bad):
        return "near-tie flips only"
    return "DIFFERS"


def table(results: dict) -> str:
    lines = ["| method | rows equal to alone | held tokens and kv_ratio equal | flips (row: step, solo top-2 margin) |"
             " verdict |", "|---|---:|---:|---|---|"]
    for name, res in results.items():
        rows = res["rows"]
        flips = "; ".join(f"{i}: step {r['step']}, {r['margin']:.2e}" if r.get("margin") is not None else
                          f"{i}: step {r['step']}" for i, r in enumerate(rows) if not r["equal"]) or "—"
        lines.append(f"| {name} | {sum(r['equal'] for r in rows)}/{len(rows)} | "
                     f"{sum(r['kv_equal'] for r in rows)}/{len(rows)} | {flips} | {verdict(res)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--methods", nargs="*", default=None, help="method configs (default: every one)")
    p.add_argument("--rows", type=int, default=6)
    p.add_argument("--new", type=int, default=12, help="tokens each row generates at most")
    p.add_argument("--scale", type=float, default=1.0, help="the passages' lengths times this (a tiny model: 0.1)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import luka_bench as lb
    from luka_bench.data.pg19 import essays_text

    names = args.methods or configs()
    unknown = sorted(set(names) - set(configs()))
    if unknown:
        print(f"error: unknown method {', '.join(unknown)}; allowed: {', '.join(configs())}", file=sys.stderr)
        return 2
    lm = lb.load_model(args.model)
    text = essays_text()
    sizes = [2600, 800, 1700, 1100, 3400, 1300, 900, 2100][: args.rows]  # characters: prompts of different lengths
    contexts = [text[at: at + int(size * args.scale)] for at, size in zip(range(0, 10 ** 6, 6000), sizes)]
    results = {}
    for name in names:
        results[name] = check(lm, name, contexts, args.new)
        print(f"{name}: {verdict(results[name])} ({results[name]['seconds']} s)", flush=True)
    out = table(results)
    print(out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "rows": args.rows, "new": args.new,
                                         "prompt_tokens": [r["prompt_tokens"] for r in results[names[0]]["rows"]],
                                         "results": results}, indent=1))
        args.json.with_suffix(".md").write_text(out + "\n")
    return 0 if all(verdict(r) != "DIFFERS" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
