"""One run: build model, method and data from the config; evaluate; write the run folder; print a summary.

Data flow per QA example: context prompt -> fresh method cache (question ids handed over first) -> prefill, in
chunks of the method's ``prefill_chunk()`` if it asks (the method may compress after each chunk and after it)
-> for every question: a clone of that context-only cache -> question tokens -> greedy answer (the method acts
every step) -> score -> one line in predictions.jsonl. Per perplexity document: first token, then teacher
forcing token by token with the method active; NLLs summed in fp32.
"""
from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from luka_bench import metrics as M
from luka_bench.data.base import evidence_positions, qa_prompt_ids
from luka_bench.errors import PromptTooLong, RunConfigError, RunInterrupted, one_line_errors, unwrap
from luka_bench.methods.hf import MethodCache, attach
from luka_bench.results import RunFolder, RunFolderBusy, config_difference, environment, write_job_error

log = logging.getLogger("luka_bench")


# ---------------------------------------------------------------------------------------------------------
# Building blocks (used by the tests too)
# ---------------------------------------------------------------------------------------------------------

def evidence_kept(cache: MethodCache, positions: list[int]) -> float | None:
    """Share of the evidence token ``positions`` a cache holds: per layer and KV head the fraction held, averaged
    over every layer and KV head (sliding-window layers included as they are)."""
    if not positions:
        return None
    shares = []
    for s in cache.stores:
        pos = s.positions  # [B, Hkv, n]
        want = torch.as_tensor(positions, device=pos.device)
        held = (pos.unsqueeze(-1) == want).any(dim=2).float().mean(dim=-1)  # [B, Hkv]
        shares.append(held.flatten())
    return float(torch.cat(shares).mean())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def forward(model, ids: list[int] | torch.Tensor, cache: MethodCache, chunk: int = 0) -> torch.Tensor:
    """Run ``ids`` through the model with ``cache``; returns the logits of the last position [vocab]."""
    device = model.device
    x = torch.as_tensor(ids, device=device).view(1, -1)
    host = None if torch.is_tensor(ids) else list(ids)  # ids from the host: no device-to-host copy per forward
    step = chunk if chunk and chunk > 0 else x.shape[1]
    logits = None
    for s in range(0, x.shape[1], step):
        cache.add_tokens(host[s: s + step] if host is not None else x[0, s: s + step])
        # logits_to_keep=1: only the last position goes through the LM head (a long prefill's N x vocab logits
        # would cost ~1/5 of its compute and 6 GB at 32K)
        logits = model(input_ids=x[:, s: s + step], past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits[0, -1]
    return logits


@torch.no_grad()
def prefill(model, ids: list[int], cache: MethodCache, chunk: int = 0) -> torch.Tensor:
    """Prefill the context (in chunks of the method's ``prefill_chunk()`` if it asks, else of ``chunk``; 0: at
    once) and let the method compress it. Returns the last position's logits."""
    cache.reference_length = len(ids)
    logits = forward(model, ids, cache, cache.method.prefill_chunk() or chunk)
    cache.end_prefill()
    return logits


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    question_s: float
    step_s: list[float]
    step_timings: dict[str, float]  # method component seconds summed over the generated-token steps
    attended: dict | None = None  # MethodCache.attended_stats over the generated-token steps


@torch.no_grad()
def greedy_answer(model, tokenizer, cache: MethodCache, question_ids: list[int], max_new_tokens: int,
                  eos_ids: set[int], stop_strings: tuple[str, ...] = ("\n",)) -> Generation:
    """Feed the question to a context cache and decode greedily with the method active."""
    device = model.device
    _sync(device)
    t0 = time.perf_counter()
    logits = forward(model, question_ids, cache)
    _sync(device)
    question_s = time.perf_counter() - t0
    before = dict(cache.timings)
    n_before = len(cache.attended_tokens)
    out: list[int] = []
    steps: list[float] = []
    while True:
        tok = int(torch.argmax(logits))
        if tok in eos_ids:
            break
        out.append(tok)
        text = tokenizer.decode(out, skip_special_tokens=True)
        if len(out) >= max_new_tokens or any(s in text.lstrip() for s in stop_strings):
            break
        t = time.perf_counter()
        logits = forward(model, [tok], cache)
        _sync(device)
        steps.append(time.perf_counter() - t)
    after = {k: v - before.get(k, 0.0) for k, v in cache.timings.items()}
    return Generation(out, tokenizer.decode(out, skip_special_tokens=True), question_s, steps, after,
                      cache.attended_stats(n_before))


@torch.no_grad()
def teacher_forced_nll(model, cache: MethodCache, ids: list[int]) -> tuple[list[float], list[float]]:
    """The pg19 protocol: feed the first token, then every next token one at a time with the cache and the
    method active. Returns (NLL of tokens 1..n-1, seconds per step). fp32 log-softmax."""
    cache.reference_length = len(ids)
    device = model.device
    logits = forward(model, ids[:1], cache)
    cache.end_prefill()
    nll, steps = [], []
    for t in range(1, len(ids)):
        nll.append(float(-torch.log_softmax(logits.float(), dim=-1)[ids[t]]))
        if t == len(ids) - 1:
            break
        s = time.perf_counter()
        logits = forward(model, ids[t: t + 1], cache)
        _sync(device)
        steps.append(time.perf_counter() - s)
    return nll, steps


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return ids


def breakdown(timings: dict[str, float], step_s: list[float]) -> dict[str, float] | None:
    """Seconds per decode step by component: the timed parts (attention, eviction; LuKA's refinement and
    segment_compress; see ``LayerPolicy``) and ``rest`` (the model around them: projections, MLPs, norms)."""
    if not step_s:
        return None
    n = len(step_s)
    out = {k: v / n for k, v in sorted(timings.items())}
    out["rest"] = max(0.0, sum(step_s) / n - sum(out.values()))
    return out


def _mem(cache: MethodCache) -> dict:
    return {"kv_bytes_peak": cache.peak_bytes, "kv_bytes_full": cache.full_bytes(),
            "kv_bytes_allocated": cache.allocated_bytes(), "kv_tokens": cache.held_tokens(),
            "method_stats": cache.method_report()}


# ---------------------------------------------------------------------------------------------------------
# Evaluation loops
# ---------------------------------------------------------------------------------------------------------

def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _max_new(task, q, max_new: int, cfg: DictConfig) -> int:
    """New tokens for one question: ``max_new_tokens`` when set, else the question's own (RULER's per-task
    ``tokens_to_generate``, ``Task.max_new_tokens_for``), else the dataset's."""
    if cfg.get("max_new_tokens") is None and hasattr(task, "max_new_tokens_for"):
        return int(task.max_new_tokens_for(q))
    return max_new


def _resuming(folder: RunFolder, done: int, total: int) -> None:
    """Remember the run's size (for the line Ctrl-C prints) and say so when a run resumes."""
    folder.total = total
    if done:
        print(f"resuming: {done}/{total} items done in {folder.path}", file=sys.stderr, flush=True)


def evaluate_qa(lm, attached, task, folder: RunFolder, cfg: DictConfig, on_item=None) -> list[dict]:
    tok, model = lm.tokenizer, lm.model
    max_new = int(cfg.max_new_tokens if cfg.get("max_new_tokens") is not None else getattr(task, "max_new_tokens", 24))
    stop = tuple(getattr(task, "stop_strings", ("\n",)))
    eos = eos_token_ids(model, tok)
    if hasattr(task, "prepare"):  # tokenizer-measured lengths (BABILong), truncation to fit the model (LongBench v2)
        task.prepare(tok, lm.max_context - max_new, chat_template=lm.chat_template)
    examples = task.examples()
    # Tokenise everything first: an over-long prompt fails the run before any work is done.
    plan = []
    for ex in examples:
        ctx_ids = None
        qs = []
        for q in ex.questions:
            prefix = task.answer_prefix(q) if hasattr(task, "answer_prefix") else ""  # RULER's answer prefix
            c, qi = qa_prompt_ids(tok, lm.chat_template, task.context_block(ex), task.question_block(q), prefix)
            ctx_ids = ctx_ids or c
            need = len(c) + len(qi) + _max_new(task, q, max_new, cfg)
            if need > lm.max_context:
                raise PromptTooLong(
                    f"example {ex.id!r} needs {need} tokens (context {len(c)} + question {len(qi)} + "
                    f"{max_new} new) but model.max_context={lm.max_context} for '{lm.name}'; allowed: <= "
                    f"{lm.max_context} — use a shorter data setting or a model with a longer context")
            qs.append((q, qi))
        evidence = None
        if hasattr(task, "evidence_spans"):  # character spans of the facts that answer the question (BABILong)
            spans = task.evidence_spans(ex)
            if spans:
                evidence = evidence_positions(tok, lm.chat_template, task.context_block(ex), spans)
        plan.append((ex, ctx_ids, qs, evidence))
    total = sum(len(qs) for _, _, qs, _ in plan)
    records = [folder.done[q.id] for _, _, qs, _ in plan for q, _ in qs if q.id in folder.done]
    _resuming(folder, len(records), total)
    bar = _progress(total, f"{cfg.get('method_name', 'method')} on {cfg.get('data_name', 'data')}", cfg.progress)
    bar.update(len(records))
    chunk = attached.method.prefill_chunk() or int(cfg.prefill_chunk or 0)  # the method's own size wins
    for ex, ctx_ids, qs, evidence in plan:
        todo = [(q, qi) for q, qi in qs if q.id not in folder.done]
        if not todo:
            continue
        cache = attached.new_cache()
        # question-aware methods see the questions at prefill time: all of the example's, concatenated in order
        cache.question_ids = [t for _, qi in qs for t in qi]
        _sync(model.device)
        t0 = time.perf_counter()
        prefill(model, ctx_ids, cache, chunk)
        _sync(model.device)
        prefill_s = time.perf_counter() - t0
        kv_prefill, kv_prefill_full = cache.held_bytes(), cache.full_bytes()
        tokens_prefill = cache.held_tokens()
        kept = evidence_kept(cache, evidence) if evidence else None
        for q, qi in todo:
            c = cache.clone()
            gen = greedy_answer(model, tok, c, qi, _max_new(task, q, max_new, cfg), eos, stop)
            pred = task.postprocess(gen.text)
            rec: dict[str, Any] = {
                "item_id": q.id, "example_id": ex.id, "question": q.question, "gold": q.answers,
                "prediction": pred, "raw_output": gen.text, "scores": task.score(pred, q),
                "context_tokens": len(ctx_ids), "question_tokens": len(qi), "new_tokens": len(gen.token_ids),
                "prefill_s": prefill_s, "question_s": gen.question_s, "ttft_s": prefill_s + gen.question_s,
                "tpot_s": M.mean(gen.step_s), "latency_breakdown": breakdown(gen.step_timings, gen.step_s),
                "kv_bytes_prefill": kv_prefill, "kv_bytes_full_prefill": kv_prefill_full,
                "kv_tokens_prefill": tokens_prefill, **_mem(c), **(gen.attended or {}), "evidence_kept": kept, "meta": q.meta,
            }
            folder.append(rec)
            records.append(rec)
            bar.update(1)
            running = task.aggregate(records) if hasattr(task, "aggregate") else M.qa_summary(records)
            bar.set_postfix({k: f"{v:.2f}" for k, v in running.items() if isinstance(v, float)})
            if on_item is not None:
                on_item(records)
    bar.close()
    return records


def evaluate_ppl(lm, attached, task, folder: RunFolder, cfg: DictConfig, on_item=None) -> list[dict]:
    docs = task.documents(lm.tokenizer)
    for d in docs:
        n = len(d.meta["ids"])
        if n > lm.max_context:
            raise PromptTooLong(f"document {d.id!r} has {n} tokens but model.max_context={lm.max_context} for "
                                f"'{lm.name}'; allowed: data.max_tokens <= {lm.max_context}")
    records = [folder.done[d.id] for d in docs if d.id in folder.done]
    _resuming(folder, len(records), len(docs))
    bar = _progress(len(docs), f"{cfg.get('method_name', 'method')} on {cfg.get('data_name', 'data')}", cfg.progress)
    bar.update(len(records))
    for d in docs:
        if d.id in folder.done:
            continue
        cache = attached.new_cache()
        ids = d.meta["ids"]
        t0 = time.perf_counter()
        nll, steps = teacher_forced_nll(lm.model, cache, ids)
        rec = {"item_id": d.id, "n_tokens": len(nll), "nll_sum": float(sum(nll)), "nll_blocks": M.nll_blocks(nll),
               "perplexity": math.exp(sum(nll) / len(nll)), "tpot_s": M.mean(steps), "ttft_s": None,
               "latency_breakdown": breakdown(cache.timings, steps),
               "wall_s": time.perf_counter() - t0, "kv_bytes_prefill": None, **_mem(cache),
               **cache.attended_stats()}
        folder.append(rec)
        records.append(rec)
        bar.update(1)
        bar.set_postfix(ppl=f"{M.ppl_summary(records)['perplexity']:.3f}")
        if on_item is not None:
            on_item(records)
    bar.close()
    return records


def aggregate(task, records: list[dict]) -> dict:
    if hasattr(task, "aggregate"):  # the dataset's own metrics (accuracy by task, difficulty, length, ...)
        out = task.aggregate(records)
    else:
        out = M.qa_summary(records) if task.kind == "qa" else M.ppl_summary(records)
    out.update(M.latency_summary(records))
    out.update(M.kv_summary(records))
    kept = [r["evidence_kept"] for r in records if r.get("evidence_kept") is not None]
    if kept:  # share of the answer's supporting tokens held after the prefill (datasets with evidence_spans)
        out["evidence_kept"] = sum(kept) / len(kept)
    out.update(M.attended_summary(records))
    out["latency_breakdown"] = M.breakdown_summary(records)
    out["method_stats"] = M.method_stats_summary(records)
    out["n_examples"] = len(records)
    # mean ± SE (clustered by example) and n of every per-item metric: the summary table prints them
    out["uncertainty"] = M.item_uncertainty(records)
    return out


# ---------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------

def run_config(cfg: DictConfig) -> dict:
    """The resolved config a run folder stores and compares. Where the run is logged (``logger``) and the
    sweep it belongs to (``sweep_name``) are not part of the run."""
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.pop("logger", None)
        cfg.pop("sweep_name", None)
    return OmegaConf.to_container(cfg, resolve=True)


def finished_metrics(run_dir: str | Path, resolved: dict) -> dict | None:
    """The metrics of a complete run of this same config in ``run_dir`` (same items: ``data.limit`` too), else
    None. Lets a re-run sweep skip its finished jobs without loading a model. ``threads`` only says how the
    finished run was executed, so a re-run with another thread count still finds it."""
    path, cfg_path = Path(run_dir) / "metrics.json", Path(run_dir) / "config.yaml"
    if not (path.exists() and cfg_path.exists()):
        return None
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
        old = yaml.safe_load(cfg_path.read_text(encoding="utf-8")) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return None
    same_items = (old.get("data") or {}).get("limit") == (resolved.get("data") or {}).get("limit")
    if metrics.get("complete") is True and same_items and not config_difference(old, resolved):
        return metrics
    return None


def _int_setting(cfg: DictConfig, key: str, minimum: int, allow_null: bool, what: str) -> int | None:
    v = cfg.get(key)
    if v is None and allow_null:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise RunConfigError(f"{key}={v!r} must be {what}")
    return v


def check_settings(cfg: DictConfig) -> None:
    """One-line RunConfigError for a bad top-level setting, before anything is built, loaded or written."""
    _int_setting(cfg, "seed", -(2 ** 63), False, "an integer")
    _int_setting(cfg, "threads", 1, True, "an integer >= 1 or null (torch's default)")
    _int_setting(cfg, "max_new_tokens", 1, True, "an integer >= 1 or null (the dataset's default)")
    _int_setting(cfg, "prefill_chunk", 0, True, "an integer >= 0 (0: the whole context in one pass)")
    limit = (cfg.get("data") or {}).get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise RunConfigError(f"data.limit={limit!r} must be an integer >= 1 or null (every item)")


@dataclass
class Prepared:
    """Everything a run needs before its model loads, each part validated; nothing written yet."""

    method: Any
    task: Any
    model: Any
    resolved: dict


def _build(cfg: DictConfig, group: str):
    """``cfg.<group>`` instantiated; a key its class does not take is a one-line RunConfigError naming it and
    the class's settings (Hydra's own error is a traceback)."""
    import dataclasses

    from hydra.errors import InstantiationException
    from hydra.utils import get_class, instantiate

    try:
        return instantiate(cfg[group])
    except InstantiationException as e:
        inner = unwrap(e)
        if isinstance(inner, TypeError) and "unexpected keyword argument" in str(inner):
            bad = str(inner).rsplit("argument", 1)[-1].strip(" '\"")
            try:
                cls = get_class(cfg[group]["_target_"])
                names = [f.name for f in dataclasses.fields(cls) if f.init] if dataclasses.is_dataclass(cls) else []
            except Exception:  # noqa: BLE001 - the message without the list is still one line
                names = []
            allowed = f"; allowed: {', '.join(names)}" if names else ""
            raise RunConfigError(f"{group}.{bad} is not a setting of {group}={cfg.get(f'{group}_name')}"
                                 f"{allowed}") from None
        raise


def _check_hub_data(cfg: DictConfig, task) -> None:
    """DataError (one line) when the dataset downloads from a hub that cannot be reached (luka_bench.hub)."""
    from luka_bench.data.base import DataError
    from luka_bench.hub import unavailable

    for repo_id in getattr(task, "hub_datasets", list)():
        why = unavailable(repo_id, "dataset")
        if why is not None:
            raise DataError(f"data={cfg.get('data_name')}: {why}; use its offline source (see the dataset card) "
                            "or run where the hub can be reached")


def prepare(cfg: DictConfig, run_dir: str | Path) -> Prepared:
    """Validate a run without writing anything: the settings, the method, the data (its files read and checked,
    ``Task.check``), the model's settings and the run folder (``RunFolder.check``). Bad input fails here with one
    line and leaves the folder as it was."""
    check_settings(cfg)
    method = _build(cfg, "method")  # validates its settings first: cheap failures before the model loads
    task = _build(cfg, "data")
    model = _build(cfg, "model")
    if hasattr(model, "check"):
        model.check()
    _check_hub_data(cfg, task)
    resolved = run_config(cfg)
    RunFolder.check(run_dir, resolved)
    if hasattr(task, "check"):  # data files exist and parse, before the model loads
        task.check()
    if hasattr(task, "check_model"):  # a data length the configured model cannot hold (RULER, NIAH)
        task.check_model(model)
    return Prepared(method, task, model, resolved)


def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    """One run into ``run_dir``: skipped when it already holds a complete run of this config; validated
    (``prepare``) before the tracker starts or anything is written; tracked by ``cfg.logger`` (finished also
    when the run crashes)."""
    from luka_bench import tracking

    check_settings(cfg)  # even a finished run's re-run refuses a bad setting
    done = finished_metrics(run_dir, run_config(cfg))
    if done is not None:
        print(f"{run_dir}: already complete (metrics.json); skipped")
        if not tracking.in_multirun():  # a single run shows its results again
            try:
                print(summary_table(done, Path(run_dir)))
            except (KeyError, TypeError):  # a run made before a summary field existed: the line says enough
                pass
        write_job_error(run_dir, None)  # an earlier refused attempt's error (e.g. a smaller data.limit) is over
        return done
    tracker, result, exit_code = None, None, 1
    try:
        prepared = prepare(cfg, run_dir)
        tracker = tracking.build(cfg, run_dir)
        write_job_error(run_dir, None)  # this attempt's outcome replaces an earlier failure's
        tracker.start(OmegaConf.to_container(cfg, resolve=True))
        result = _run(cfg, run_dir, tracker, prepared)
        exit_code = 0
        return result
    except Exception as e:
        if isinstance(unwrap(e), RunFolderBusy):  # another process's folder: leave it exactly as it is
            if tracking.in_multirun():  # the sweep's other jobs go on; its closing lines name this one
                return {"failed": f"RunFolderBusy: {unwrap(e)}", "busy": True}
            raise
        if tracking.in_multirun():
            cfg_path = Path(run_dir) / "config.yaml"
            if not cfg_path.exists():  # failed before the folder was opened: leave its config for the report
                try:
                    cfg_path.parent.mkdir(parents=True, exist_ok=True)
                    cfg_path.write_text(yaml.safe_dump(run_config(cfg), sort_keys=False), encoding="utf-8")
                except Exception:  # noqa: BLE001 - an unresolvable config: the job's own error says more
                    pass
            inner = unwrap(e)
            if isinstance(inner, one_line_errors()):  # bad input: the other jobs go on (results.JOB_ERROR_FILE)
                message = f"{type(inner).__name__}: {inner}"
                try:
                    write_job_error(run_dir, message)
                except OSError:  # an unwritable folder: the sweep's FAILED line still says why
                    pass
                return {"failed": message}
        raise
    finally:
        if tracker is not None:
            tracker.finish(result, exit_code)


def _run(cfg: DictConfig, run_dir: str | Path, tracker, prepared: Prepared | None = None) -> dict:
    prepared = prepared or prepare(cfg, run_dir)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(cfg.seed))
    with RunFolder(run_dir, prepared.resolved) as folder:  # locked against a second process until the run ends
        return _run_in(cfg, prepared, folder, tracker)


def _run_in(cfg: DictConfig, prepared: Prepared, folder: RunFolder, tracker) -> dict:
    method, task = prepared.method, prepared.task
    loaded = prepared.model.load()
    folder.write_env(environment(int(cfg.seed), loaded.info["device"], loaded.info["dtype"]))
    t0 = time.perf_counter()

    def on_item(records: list[dict]) -> None:  # running metrics to the tracker after every item
        tracker.log(len(records), aggregate(task, records))

    try:
        with attach(loaded.model, method, loaded.tokenizer) as attached:
            evaluate = evaluate_qa if task.kind == "qa" else evaluate_ppl
            records = evaluate(loaded, attached, task, folder, cfg, on_item)
    except KeyboardInterrupt:  # Ctrl-C: what is saved stays saved (predictions.jsonl is flushed per item)
        of = f"/{folder.total}" if folder.total is not None else ""
        saved = len(folder.reread())  # the file, not the in-memory count: Ctrl-C can land between the two
        raise RunInterrupted(f"interrupted: {saved}{of} items saved in {folder.path}; run the same "
                             "command to resume") from None
    result = {
        "model": cfg.get("model_name"), "method": cfg.get("method_name"), "data": cfg.get("data_name"),
        "kind": task.kind, "headline": getattr(task, "headline", "em_lenient"),
        **aggregate(task, records),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "wall_s": time.perf_counter() - t0, "complete": True,
    }
    folder.write_metrics(result)
    print(summary_table(result, folder.path))
    return result


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return str(v)


def _bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def summary_table(m: dict, path: Path) -> str:
    import os

    where = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else str(path)
    rows = [("run", where), ("model / method / data", f"{m['model']} / {m['method']} / {m['data']}"),
            ("n_examples", _fmt(m["n_examples"]))]
    keys = ["em", "em_lenient", "f1", "accuracy"] + sorted(k for k in m if k.startswith("accuracy_")) + \
        ["perplexity", "n_tokens", "ttft_s", "tpot_s", "kv_ratio", "attended_tokens", "attended_ratio"]
    from luka_bench.tables import fmt_mean_se

    unc = m.get("uncertainty") or {}
    for k in keys:
        if k == "perplexity" and k in unc and unc[k].get("unit"):  # corpus perplexity ± SE over its units
            u = unc[k]
            rows.append((f"perplexity (± SE over {u['clusters']} {u['unit']})", fmt_mean_se(u["mean"], u["se"])))
        elif k in unc and k not in ("ttft_s", "tpot_s"):  # scores: mean ± SE clustered by example (n items)
            rows.append((f"{k} (± SE, n)", fmt_mean_se(unc[k]["mean"], unc[k]["se"], unc[k]["n"])))
        elif k in m:
            rows.append((k, _fmt(m[k])))
    hl = m.get("headline")
    if isinstance(hl, str) and hl in m and hl not in keys:  # a dataset's own headline (ruler_score)
        rows.append((f"{hl} (± SE)", fmt_mean_se(m[hl], m.get(f"{hl}_se"))))
    # the rule the headline follows (what it averages, whether it is comparable), under the table: it is long
    note = f"\n{m[f'{hl}_rule']}" if isinstance(hl, str) and m.get(f"{hl}_rule") else ""
    if m.get("latency_breakdown") and len(m["latency_breakdown"]) > 1:
        rows.append(("latency_breakdown (s/token)", _fmt(m["latency_breakdown"])))
    if m.get("attended_bytes") is not None:
        rows.append(("attended_bytes (per step)", _bytes(m["attended_bytes"])))
    rows.append(("kv_bytes (peak / full)", f"{_bytes(m['kv_bytes']['peak'])} / {_bytes(m['kv_bytes_full']['peak'])}"))
    rows.append(("peak_rss_bytes", _bytes(m["peak_rss_bytes"])))
    rows.append(("wall_s", _fmt(m["wall_s"])))
    w = max(len(r[0]) for r in rows)
    line = "+" + "-" * (w + 2) + "+" + "-" * (max(len(r[1]) for r in rows) + 2) + "+"
    body = "\n".join(f"| {a:<{w}} | {b:<{len(line) - w - 7}} |" for a, b in rows)
    return f"{line}\n{body}\n{line}{note}"
