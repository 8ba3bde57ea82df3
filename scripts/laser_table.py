"""LASER-KV's Table 1 layout on BABILong (offline generator): accuracy and the share of supporting-fact tokens
held after the prefill, for full attention, exact-only (alpha=1), LSH-only (alpha=0), LASER-KV (alpha=0.75),
question-aware SnapKV and H2O at LASER-KV's token budget.

    .venv/bin/python scripts/laser_table.py --limit 2k=10,4k=4 --threads 1          # run what is missing + table
    .venv/bin/python scripts/laser_table.py --limit 2k=10,4k=4 --table-only         # table from finished runs

One run folder per (variant, length) under ``--sweep`` (a re-run skips finished runs and resumes half-done ones);
the table (mean ± one standard error over samples) goes to stdout and ``--out``/table.md.

Equal budget: SnapKV and H2O hold ``ceil(budget * L)`` tokens; their ``budget`` is set per length to the mean over
that length's samples of ``held_tokens(L) / L`` (LASER-KV's closed form, ``luka_bench.methods.laser_kv``), so
they hold the same number of tokens as LASER-KV after the prefill up to rounding (the table prints what each
really held).
"""
from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from luka_bench import config as _conf  # noqa: E402

VARIANTS = {  # name -> method overrides (block size and budget added below)
    "full": ["method=full"],
    "exact": ["method=laser_kv", "method.alpha=1.0"],
    "lsh": ["method=laser_kv", "method.alpha=0.0"],
    "laser_kv": ["method=laser_kv"],
    "snapkv_q": ["method=snapkv", "method.question_aware=true"],
    "h2o": ["method=h2o"],
}


def compose(overrides: list[str]):
    return _conf.compose(overrides, run_names=True)


def context_lengths(data_overrides: list[str]) -> list[int]:
    """Context-prompt token counts of the samples (as the runner tokenises them)."""
    from hydra.utils import instantiate

    from luka_bench.data.base import qa_prompt_ids

    cfg = compose(["method=full", *data_overrides])
    lm = instantiate(cfg.model).load()
    task = instantiate(cfg.data)
    task.prepare(lm.tokenizer, lm.max_context, chat_template=lm.chat_template)
    out = []
    for ex in task.examples():
        c, _ = qa_prompt_ids(lm.tokenizer, lm.chat_template, task.context_block(ex), task.question_block(ex.questions[0]))
        out.append(len(c))
    return out


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and SE of independent samples (``stats.mean_se``); NaN for the SE of one (printed as such)."""
    from luka_bench.stats import mean_se as _mean_se

    r = _mean_se(xs)
    return r["mean"], float("nan") if r["se"] is None else r["se"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2k,4k")
    ap.add_argument("--tasks", default="qa1,qa2,qa3")
    ap.add_argument("--limit", default="2k=10,4k=4", help="samples per task, per length: 2k=10,4k=4")
    ap.add_argument("--block", type=int, default=1024, help="LASER-KV block size S")
    ap.add_argument("--r", type=float, default=0.25, help="LASER-KV compression ratio r")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sweep", default=str(ROOT / "results/sweeps/laser_table"))
    ap.add_argument("--out", default=str(ROOT / "results/summaries/laser_kv"))
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()

    from luka_bench.methods.laser_kv import held_tokens
    from luka_bench.run import run

    limits = dict(kv.split("=") for kv in args.limit.split(","))
    lengths = args.lengths.split(",")
    variants = args.variants.split(",")
    sweep = Path(args.sweep)
    budgets = {}
    for length in ([] if args.table_only else lengths):
        data = ["data=babilong", f"data.task=[{args.tasks}]", f"data.length={length}", f"data.limit={limits[length]}"]
        ctx = context_lengths(data)
        frac = sum(held_tokens(L, args.block, args.r, 4) / L for L in ctx) / len(ctx)
        budgets[length] = round(frac, 6)
        print(f"{length}: context tokens {min(ctx)}-{max(ctx)}; LASER-KV holds {frac:.4f} of them "
              f"(S={args.block}, r={args.r}): SnapKV/H2O budget {budgets[length]}", flush=True)
        for v in variants:
            over = [*VARIANTS[v], *data, f"threads={args.threads}", "progress=false"]
            if v.startswith(("exact", "lsh", "laser")):
                over += [f"method.block_size={args.block}", f"method.budget={args.r}"]
            elif v != "full":
                # a folder started earlier keeps its budget (the mean over fewer samples differs in the 5th
                # decimal, and a run folder is never rewritten with another config); the table prints each's
                over += [f"method.budget={started_budget(sweep / f'{length}_{v}') or budgets[length]}"]
            print(f"[laser_table] {length} {v}: {' '.join(over)}", flush=True)
            run(compose(over), sweep / f"{length}_{v}")
    table(sweep, lengths, variants, args.tasks.split(","), budgets, Path(args.out),
          {k: int(v) for k, v in limits.items()})


def started_budget(folder: Path) -> float | None:
    """method.budget of a run folder already started (None if there is none)."""
    from luka_bench.results import read_run_config

    cfg = read_run_config(folder / "config.yaml")
    return cfg["method"]["budget"] if cfg else None


def table(sweep: Path, lengths, variants, tasks, budgets, out: Path, limits: dict[str, int]) -> None:
    """Mean ± SE per task over the first ``limits[length]`` samples (a folder may hold more from a longer run);
    run folders read through the report's loaders."""
    from luka_bench.results import read_predictions

    lines = ["| length | method | " + " | ".join(f"{t} acc" for t in tasks) + " | "
             + " | ".join(f"{t} facts kept" for t in tasks) + " | held after prefill (tokens) | method.budget | n/task |",
             "|" + "---|" * (2 * len(tasks) + 5)]
    for length in lengths:
        for v in variants:
            folder = sweep / f"{length}_{v}"
            recs = read_predictions(folder)
            if not recs:
                lines.append(f"| {length} | {v} | missing |")
                continue
            recs = [r for r in recs if r["meta"]["index"] < limits[length]]
            acc, kept = [], []
            for t in tasks:
                rs = [r for r in recs if r["meta"]["task"] == t]
                if not rs:
                    acc.append("-")
                    kept.append("-")
                    continue
                m, se = mean_se([100 * r["scores"]["accuracy"] for r in rs])
                acc.append(f"{m:.0f} ± {se:.0f}")
                ks = [100 * r["evidence_kept"] for r in rs if r.get("evidence_kept") is not None]
                if ks:
                    m, se = mean_se(ks)
                    kept.append(f"{m:.0f} ± {se:.0f}")
                else:
                    kept.append("-")
            held = [sum(r["kv_tokens_prefill"]) / len(r["kv_tokens_prefill"]) for r in recs]
            n = min(sum(1 for r in recs if r["meta"]["task"] == t) for t in tasks)
            budget = started_budget(folder)
            lines.append(f"| {length} | {v} | " + " | ".join(acc) + " | " + " | ".join(kept)
                         + f" | {sum(held) / len(held):.0f} | {budget:g} | {n} |")
    note = ("\nAccuracy and supporting-fact tokens kept after the prefill, % (mean ± one standard error over "
            "samples; nan: one sample). method.budget: r for LASER-KV variants; for SnapKV/H2O the fraction that holds "
            "LASER-KV's tokens (mean held_tokens(L)/L over the samples the run was started with).\n")
    text = "\n".join(lines) + "\n" + note
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
