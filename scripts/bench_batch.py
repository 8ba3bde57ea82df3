"""Decode throughput on batches (issue 60): tokens/s at batch 1, 4, 8, 16 for KV methods and stock transformers'
batched ``generate``, on the same RULER prompts (items of different lengths), in one process; and the end-to-end
items/s of a RULER sweep through the runner at ``batch_size`` 1 and 8.

Our rows: each prompt prefilled alone in its own cache (the tail rule: the question part fed through the compressed
cache), then the batch's rows decoded together (``engine.greedy_decode_rows``: one forward per step, each layer's
attention on each row's own store). Every row generates exactly ``--steps`` tokens (no end-of-sequence, no stop
string), so every method does the same work; decode tokens/s = rows x (steps - 1) / the seconds of the steps' forwards
(the first token comes from the tail's logits). The prefills are made once per method and cloned for each batch.
Stock: the model as users run it — transformers' SDPA attention and its ``DynamicCache``, ``model.generate`` on the
left-padded batch with ``min_new_tokens = max_new_tokens = steps``; its decode seconds are the time between the
first and the last step's logits (a logits processor's clock). Rounds alternate over methods and batch sizes
(``--rounds``), so that machine noise hits all alike; each figure is the median over rounds, and the ratios (batch B
over batch 1, a method over full) are taken in-process.

    .venv/bin/python scripts/bench_batch.py --threads 2 --json results/summaries/batch/cpu.json --plot
    .venv/bin/python scripts/bench_batch.py --sweep --threads 2 --json results/summaries/batch/sweep.json
    # a GPU (the weights of an 8B-shaped model read once per step whatever the batch):
    python scripts/bench_batch.py --model shape_llama31_8b --device cuda --dtype bfloat16 --json gpu_batch.json --plot
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METHODS = ("full", "snapkv", "streaming_llm", "h2o", "tova", "quest", "lychee", "luka_clustered")


def load(args):
    from luka_bench.config import build, compose

    over = [f"model={args.model}"] + ([f"model.device={args.device}"] if args.device else []) + \
        ([f"model.dtype={args.dtype}"] if args.dtype else [])
    cfg = compose(over)
    return build(cfg, "model").load()


def ruler_prompts(lm, length: int, count: int, tasks: str = "all") -> list[tuple[list[int], list[int], int]]:
    """``count`` RULER items of ``length`` tokens (the first of each task in turn, the synthetic offline set;
    ``tasks``: all 13, or a comma-separated list): per item (context ids, question ids, the task's new tokens)."""
    from luka_bench.config import build, compose
    from luka_bench.prompting import plan_qa

    per_task = -(-count // (13 if tasks == "all" else len(tasks.split(","))))
    task = build(compose(["data=ruler", f"data.length={length}", f"data.limit={per_task}",
                          f"data.task='{tasks}'"]), "data")
    items = [(plan.context_ids, qp.ids, qp.max_new_tokens) for plan in plan_qa(task, lm) for qp in plan.questions]
    # the tasks interleaved (task-major order, ``per_task`` each): every batch holds items of different lengths
    return [items[i] for j in range(per_task) for i in range(j, len(items), per_task)][:count]


def method_of(name: str):
    from luka_bench.config import compose_method

    return compose_method([f"method={name}"])[0]


@torch.no_grad()
def ours(lm, name: str, prompts, batches, steps: int) -> dict[int, float]:
    """Decode tokens/s at each batch size for method ``name`` (prefills once, a clone per row per batch)."""
    from luka_bench import engine as E
    from luka_bench.methods.hf import attach

    method = method_of(name)
    out = {}
    with attach(lm.model, method, lm.tokenizer) as a:
        base = []
        for ctx, q, _ in prompts[: max(batches)]:
            c = a.new_cache(reference_length=len(ctx), question_ids=q)
            base.append((c, E.prefill_with_tail(lm.model, ctx, q, c).logits))
        for B in batches:
            caches = [c.clone() for c, _ in base[:B]]
            logits = torch.stack([lg for _, lg in base[:B]])
            gens = E.greedy_decode_rows(lm.model, None, caches, logits, steps, set(), ())
            assert all(len(g.token_ids) == steps for g in gens)
            out[B] = B * (steps - 1) / sum(gens[0].step_s)
            del caches, gens
    return out


@torch.no_grad()
def stock(lm, prompts, batches, steps: int) -> dict[int, float]:
    """Stock transformers: ``generate`` on the left-padded batch (SDPA, DynamicCache)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model, tok = lm.model, lm.tokenizer
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    class Clock(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    out = {}
    try:
        for B in batches:
            rows = [ctx + q for ctx, q, _ in prompts[:B]]
            width = max(len(r) for r in rows)
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=model.device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
            clock = Clock()
            model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                           pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
            out[B] = B * (steps - 1) / (clock.t[-1] - clock.t[0])
    finally:
        model.set_attn_implementation(previous)
    return out


def sweep(args) -> dict:
    """A RULER sweep through the runner (``python -m luka_bench``'s ``run.run``) at batch_size 1 and 8, in turn,
    ``--rounds`` times: items/s (items / the run's wall seconds, the model loaded once)."""
    import shutil
    import tempfile

    from luka_bench import run as R
    from luka_bench.config import compose
    from luka_bench.stats import mean_se

    rates: dict[int, list[float]] = {1: [], 8: []}
    for r in range(args.rounds):
        for bs in (1, 8) if r % 2 == 0 else (8, 1):
            folder = Path(tempfile.mkdtemp(prefix="bench_batch_"))
            cfg = compose([f"model={args.model}", "method=full", "data=ruler", f"data.length={args.length}",
                           "data.limit=1", f"batch_size={bs}", "progress=false", f"threads={args.threads}"],
                          run_names=True)
            t0 = time.perf_counter()
            m = R.run(cfg, folder)
            rates[bs].append(m["n_examples"] / (time.perf_counter() - t0))
            print(f"round {r}: batch_size {bs}: {rates[bs][-1]:.3f} items/s ({m['n_examples']} items)", flush=True)
            shutil.rmtree(folder, ignore_errors=True)
    ratio = [b / a for a, b in zip(rates[1], rates[8])]
    return {"items_per_s": {str(k): mean_se(v) for k, v in rates.items()}, "ratio_8_over_1": mean_se(ratio),
            "rounds": args.rounds, "raw": {str(k): v for k, v in rates.items()}}


def table(res: dict) -> str:
    """A markdown table: tokens/s per batch size, each row's batch-8 (else its largest batch) / batch-1 ratio and
    that ratio over full's."""
    batches = res["batches"]
    k = str(8 if 8 in batches else max(batches))
    full = res["tokens_per_s"].get("full")
    lines = ["| method | " + " | ".join(f"batch {b} tok/s" for b in batches) + f" | batch {k} / batch 1 | "
             "that / full's |", "|---|" + "---:|" * (len(batches) + 2)]
    f_ratio = full[k] / full["1"] if full else None
    for name, row in res["tokens_per_s"].items():
        r = row[k] / row["1"]
        rel = "" if f_ratio is None else f"{r / f_ratio:.2f}"
        lines.append(f"| {name} | " + " | ".join(f"{row[str(b)]:.1f}" for b in batches) + f" | {r:.2f}x | {rel} |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, row in res["tokens_per_s"].items():
        xs = [int(b) for b in row]
        style = dict(ls="--", color="black") if name == "stock" else dict(marker="o")
        ax.plot(xs, [row[str(b)] for b in xs], label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(res["batches"], [str(b) for b in res["batches"]])
    ax.set_xlabel("batch size (rows decoded together)")
    ax.set_ylabel("decode tokens / s (all rows)")
    ax.set_title(f"{res['model']}, RULER {res['length']} prompts, {res['device']} ({res['threads']} threads)",
                 fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--methods", nargs="*", default=list(METHODS))
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--steps", type=int, default=24, help="tokens each row generates")
    p.add_argument("--length", type=int, default=2048, help="RULER length (tokens)")
    p.add_argument("--tasks", default="all", help="RULER tasks: all, or a comma-separated list")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-stock", action="store_true")
    p.add_argument("--sweep", action="store_true", help="the runner's RULER sweep at batch_size 1 and 8 instead")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", action="store_true", help="a plot beside --json (same name, .png)")
    p.add_argument("--allocator", choices=("system", "steady"), default="system",
                   help="the CPU allocator (LUKA_BENCH_ALLOCATOR) of the process: system (default: glibc's own, as a "
                        "user runs stock transformers; under the harness's steady 4 MiB mmap threshold stock's "
                        "batched generate, whose DynamicCache concatenates multi-MiB tensors every step, ran at half "
                        "its speed) or steady (the harness's default)")
    args = p.parse_args(argv)
    os.environ["LUKA_BENCH_ALLOCATOR"] = args.allocator  # read when a method is first attached
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sweep:
        res = sweep(args)
        print(json.dumps({k: v for k, v in res.items() if k != "raw"}, indent=1))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=1))
        return
    lm = load(args)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = ruler_prompts(lm, args.length, max(batches), args.tasks)
    print(f"{len(prompts)} RULER prompts of {min(len(c) + len(q) for c, q, _ in prompts)}-"
          f"{max(len(c) + len(q) for c, q, _ in prompts)} tokens; {args.steps} tokens per row", flush=True)
    from luka_bench.engine import warm_up

    warm_up(lm.model)
    names = (["stock"] if not args.no_stock else []) + list(args.methods)
    runs: dict[str, list[dict[int, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            got = stock(lm, prompts, batches, args.steps) if name == "stock" else \
                ours(lm, name, prompts, batches, args.steps)
            runs[name].append(got)
            print(f"round {r} {name}: " + "  ".join(f"B={b} {v:.1f} tok/s" for b, v in got.items()), flush=True)
    res = {"model": args.model, "device": str(lm.model.device), "dtype": str(lm.model.dtype),
           "threads": torch.get_num_threads(), "allocator": args.allocator, "length": args.length,
           "steps": args.steps, "rounds": args.rounds,
           "batches": batches, "prompt_tokens": [len(c) + len(q) for c, q, _ in prompts],
           "tokens_per_s": {n: {str(b): statistics.median(x[b] for x in runs[n]) for b in batches} for n in names},
           "raw": {n: [{str(b): v for b, v in x.items()} for x in runs[n]] for n in names}}
    print(table(res))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
        if args.plot:
            plot(res, args.json.with_suffix(".png"))


if __name__ == "__main__":
    main()
