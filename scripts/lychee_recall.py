"""Retrieval recall of LycheeCluster per layer (the paper's Table 3 "Recall Rate"), for its ablations.

Recall at a decode step = the share of the true top-k tokens (k = token_budget - sink; by exact attention
weights over every held token except the sinks, summed over the query heads of each KV head) that the method's
attention read at that step (retrieved chunks + recent buffer). Averaged over KV heads and teacher-forced decode
steps after an N-token prompt of Paul Graham essays, per layer, for these variants (one setting changed each):

    ub          the method's defaults (UB ranking, structure-aware chunks, mean pooling)
    qmu         clusters ranked by q.mu alone (no radius)
    fixed       fixed 16-token chunks (Quest-like pages)
    max         max pooling of chunk keys

    .venv/bin/python scripts/lychee_recall.py                         # N = 4096, budget 1024, 16 steps
    .venv/bin/python scripts/lychee_recall.py --n 4096 --steps 16 --out results/summaries/lychee
    # the perplexity protocol's index: built from the first 1,100 tokens, the rest added by lazy updates
    .venv/bin/python scripts/lychee_recall.py --variants ub --lazy-from 1100 --out results/summaries/lychee_lazy
Also reported: ``fill`` = tokens the retrieved chunks hold / the retrieval budget (token_budget - sinks - the
unchunked recent tokens), its minimum over (layer, KV head, step), the share of retrievals that returned no chunk,
and the largest fine cluster in tokens.
Writes recall.md (table: layer x variant), recall.csv, recall.json and recall_by_layer.png into --out.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

from luka_bench import config as _conf  # noqa: E402

VARIANTS = {"ub": [], "qmu": ["ranking=qmu"], "fixed": ["chunking=fixed"], "max": ["pooling=max"]}


def compose_method(sets: list[str]):
    return _conf.compose_method(["method=lychee"] + [f"method.{s}" for s in sets])


def true_top_recall(store, policy, query: torch.Tensor, top: int) -> torch.Tensor:
    """Per KV head [H]: share of the top-``top`` non-sink tokens by exact attention (summed over the group's query
    heads) that ``policy.attended`` read."""
    k = store.keys
    b, hq, _, d = query.shape
    hkv, n = k.shape[1], k.shape[2]
    q = query.reshape(b, hkv, hq // hkv, d).float()
    w = torch.softmax((q @ k.float().transpose(-1, -2)) * d ** -0.5, dim=-1).sum(2)  # [B, H, n]
    sink = policy.method.sink
    idx = w[:, :, sink:].topk(min(top, n - sink), dim=-1).indices + sink
    mask = policy.attended(store)
    return mask.gather(2, idx).float().mean(-1)[0]


def retrieved_fill(store, policy) -> torch.Tensor:
    """Per KV head [H]: tokens of the retrieved chunks / the retrieval budget of the last retrieval."""
    m, last = policy.method, policy.last
    budget = m.token_budget - m.sink - (store.n - last["frontier"])
    chunk_tokens = last["valid"].sum(-1) - m.sink - (store.n - last["frontier"])
    return (chunk_tokens.float() / budget)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=16, help="teacher-forced decode steps measured")
    ap.add_argument("--variants", type=str, default=",".join(VARIANTS))
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every variant, e.g. token_budget=512")
    ap.add_argument("--lazy-from", type=int, default=0, help="build the index from the first N0 prompt tokens and "
                    "add the rest by lazy updates, --lazy-step tokens at a time (0: build from the whole prompt)")
    ap.add_argument("--lazy-step", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=str, default="results/summaries/lychee")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from hydra.utils import instantiate

    from luka_bench.data.pg19 import essays_text
    from luka_bench.methods.hf import attach
    from luka_bench.methods.lychee import LycheePolicy
    from luka_bench.engine import forward

    names = [v for v in args.variants.split(",") if v]
    _, model_cfg = compose_method(args.set)
    lm = instantiate(model_cfg).load()
    model, tok = lm.model, lm.tokenizer
    ids = tok(essays_text(), add_special_tokens=False).input_ids[: args.n + args.steps]
    # The prompt's keys/values do not depend on the variant (the prefill attends exactly): prefill once with full
    # attention, then hand a copy to each variant's cache, whose end_prefill builds its index.
    from luka_bench.methods.full import Full

    t0 = time.perf_counter()
    with attach(model, Full(), tok) as a:
        base = a.new_cache(reference_length=args.n)
        forward(model, ids[: args.n], base)
    print(f"prefill {args.n} tokens: {time.perf_counter() - t0:.0f} s", flush=True)
    results: dict[str, dict] = {}
    for name in names:
        method, _ = compose_method(args.set + VARIANTS[name])
        top = method.token_budget - method.sink
        per_layer: dict[int, list[torch.Tensor]] = {}
        fills: list[torch.Tensor] = []
        attended: list[float] = []
        t0 = time.perf_counter()
        with attach(model, method, tok) as a:
            n0 = args.lazy_from or args.n
            cache = a.new_cache(reference_length=n0, manual=True)
            cache.add_tokens(base.token_ids)
            for new, old in zip(cache.stores, base.stores):
                new.update(old.keys[:, :, :n0].clone(), old.values[:, :, :n0].clone())
            cache.end_prefill()
            cache.phase = "decode"
            for a0 in range(n0, args.n, args.lazy_step):  # the rest of the prompt joins the index lazily
                a1 = min(args.n, a0 + args.lazy_step)
                for new, old in zip(cache.stores, base.stores):
                    new.update(old.keys[:, :, a0:a1].clone(), old.values[:, :, a0:a1].clone())
                    if isinstance(new.policy, LycheePolicy):
                        new.policy._sync_index(new)
            for store in cache.stores:
                pol = store.policy
                if not isinstance(pol, LycheePolicy):
                    continue

                def wrapped(st, query, scaling, _pol=pol, _orig=pol.attend):
                    out = _orig(st, query, scaling)
                    if _pol.last is not None:
                        per_layer.setdefault(_pol.info.layer_idx, []).append(true_top_recall(st, _pol, query, top))
                        fills.append(retrieved_fill(st, _pol))
                    return out

                pol.attend = wrapped
            for t in range(args.n, args.n + args.steps):
                forward(model, ids[t: t + 1], cache)
            attended = cache.attended_tokens
        recall = {layer: float(torch.stack(v).mean()) for layer, v in sorted(per_layer.items())}
        fill = torch.cat(fills)
        biggest = max(int(s.policy.tok_c.max()) for s in cache.stores if isinstance(s.policy, LycheePolicy))
        results[name] = {"settings": method.describe(), "recall_by_layer": recall,
                         "mean_recall": sum(recall.values()) / len(recall),
                         "index_built_at": n0, "fill_mean": float(fill.mean()), "fill_min": float(fill.min()),
                         "empty_share": float((fill == 0).float().mean()), "largest_cluster_tokens": biggest,
                         "attended_tokens_per_layer_step": sum(attended) / len(attended) / len(cache.stores),
                         "seconds": time.perf_counter() - t0}
        print(f"{name:6s} mean recall {results[name]['mean_recall']:.4f}  fill mean {float(fill.mean()):.3f} "
              f"min {float(fill.min()):.3f}  empty {float((fill == 0).float().mean()):.3f}  largest cluster "
              f"{biggest} tokens  ({method.describe()}, "
              f"{results[name]['seconds']:.0f} s)", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layers = sorted(next(iter(results.values()))["recall_by_layer"])
    head = "| layer | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    body = "".join(f"| {L} | " + " | ".join(f"{results[v]['recall_by_layer'][L]:.4f}" for v in names) + " |\n"
                   for L in layers)
    mean = "| **mean** | " + " | ".join(f"**{results[v]['mean_recall']:.4f}**" for v in names) + " |\n"
    lazy = (f" Index built from the first {args.lazy_from} tokens, the rest added by lazy updates "
            f"({args.lazy_step} tokens at a time)." if args.lazy_from else "")
    fill = "".join(f"\n{v}: fill mean {results[v]['fill_mean']:.3f}, min {results[v]['fill_min']:.3f}, no chunk "
                   f"in {results[v]['empty_share']:.1%} of retrievals, largest cluster "
                   f"{results[v]['largest_cluster_tokens']} tokens." for v in names)
    note = (f"\nRecall of the true top-{top} attention tokens (sinks excluded) at token_budget "
            f"{method.token_budget}, SmolLM2-135M-Instruct, {args.n}-token Paul Graham essays prompt, mean over "
            f"{args.steps} teacher-forced decode steps and the KV heads; layers < full_layers attend fully.{lazy}\n"
            f"{fill}\n")
    (out / "recall.md").write_text(head + body + mean + note)
    (out / "recall.csv").write_text("layer," + ",".join(names) + "\n" + "".join(
        f"{L}," + ",".join(f"{results[v]['recall_by_layer'][L]:.6f}" for v in names) + "\n" for L in layers))
    (out / "recall.json").write_text(json.dumps({"n": args.n, "steps": args.steps, "top": top,
                                                 "results": results}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for v in names:
        ax.plot(layers, [results[v]["recall_by_layer"][L] for L in layers], marker="o", ms=3,
                label=f"{v} (mean {results[v]['mean_recall']:.3f})")
    ax.set_xlabel("layer")
    ax.set_ylabel(f"recall of true top-{top}")
    ax.set_title(f"LycheeCluster retrieval recall, budget {method.token_budget}, N={args.n}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "recall_by_layer.png", dpi=120)
    print((out / "recall.md").read_text())


if __name__ == "__main__":
    main()
