"""One run: build model, method and data from the config; evaluate; write the run folder; print a summary.

Data flow per QA example: context prompt -> fresh method cache (question ids handed over first) -> prefill, in
chunks of the method's ``prefill_chunk()`` if it asks (the method may compress after each chunk and after it)
-> for every question: a clone of that context-only cache -> question tokens (the tail, through the compressed
cache) -> greedy answer (the method acts every step) -> score -> one line in predictions.jsonl. With
``query_aware=true`` the question is prefilled and compressed with the context and only what follows its text (end
of turn, assistant header, answer prefix; at least one token) is the tail (``engine.answer_example``). Per perplexity document: first token, then teacher
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

from luka_bench import device as D
from luka_bench import engine as E
from luka_bench import metrics as M
from luka_bench import stats as S
from luka_bench.config import build
from luka_bench.errors import PromptTooLong, RunConfigError, RunInterrupted, one_line_errors, unwrap
from luka_bench.methods.hf import attach
from luka_bench.prompting import plan_qa
from luka_bench.tables import run_summary
from luka_bench.results import RunFolder, RunFolderBusy, config_difference, environment, write_job_error

log = logging.getLogger("luka_bench")


# ---------------------------------------------------------------------------------------------------------
# Evaluation loops (the engine does the generation; these write records and show progress)
# ---------------------------------------------------------------------------------------------------------

def _record(folder: RunFolder, cfg: DictConfig, item_ids: list[str], new_records, on_item=None) -> list[dict]:
    """The records of a run's items: those ``folder`` already holds (a resumed run says so), then each record
    ``new_records`` yields (the items not done yet), appended to the folder as it comes, with a progress bar."""
    from tqdm.auto import tqdm

    records = [folder.done[i] for i in item_ids if i in folder.done]
    folder.total = len(item_ids)  # the run's size, for the line Ctrl-C prints
    if records:
        print(f"resuming: {len(records)}/{len(item_ids)} items done in {folder.path}", file=sys.stderr, flush=True)
    bar = tqdm(total=len(item_ids), desc=f"{cfg.get('method_name', 'method')} on {cfg.get('data_name', 'data')}",
               disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True, initial=len(records))
    for rec in new_records:
        folder.append(rec)
        records.append(rec)
        bar.update(1)
        if on_item is not None:
            on_item(records)
    bar.close()
    where = {i: k for k, i in enumerate(item_ids)}
    if [r["item_id"] for r in records] != sorted((r["item_id"] for r in records), key=where.__getitem__):
        folder.put_in_order(item_ids)  # batches ran longest first: the file as the dataset orders its items
        records.sort(key=lambda r: where[r["item_id"]])
    return records


def longest_first(items: list, length, batch: int) -> list:
    """``items`` in the order their batches run: with ``batch`` > 1 the longest first (``length(item)``; equal ones in
    the dataset's order), as lm-eval's collator orders requests — rows of a batch of similar lengths hold less
    padding in their stacked storage (rectangular at the widest row) and the longest (most memory) comes first."""
    return sorted(items, key=lambda x: -length(x)) if batch > 1 else list(items)


def cache_settings(cfg: DictConfig) -> dict:
    """The run's settings of every cache it makes: its prefill chunk, and CUDA events for the component timings
    only when a latency breakdown is asked for there (``cuda_breakdown``: events are host time inside every step)."""
    return {"prefill_chunk": int(cfg.prefill_chunk or 0), "cuda_events": bool(cfg.get("cuda_breakdown"))}


def evaluate_qa(lm, attached, task, folder: RunFolder, cfg: DictConfig, on_item=None) -> list[dict]:
    plans = plan_qa(task, lm, cfg.get("max_new_tokens"))  # every prompt checked before any work is done
    eos = E.eos_token_ids(lm.model, lm.tokenizer)

    batch = int(cfg.get("batch_size") or 1)
    by_id = {q.question.id: p for p in plans for q in p.questions}

    def answered():
        """Every question not done, ``batch_size`` questions (of any examples) decoded together as the rows of one
        batch, the examples longest first (``longest_first``; one at a time: the dataset's order); a batch's records
        are written as soon as it ends, so an interrupted run loses at most the batch under way (its questions run
        again on resume), and the finished run's file is put in the dataset's order (``_record``)."""

        def ready():
            for plan in longest_first(plans, lambda p: len(p.context_ids), batch):
                todo = [q for q in plan.questions if q.question.id not in folder.done]
                if todo:
                    yield from E.ready_questions(lm, attached, plan, todo, cache_settings(cfg),
                                                 bool(cfg.get("query_aware")))

        for rows in E.in_batches(ready(), batch):
            yield from E.answer_rows(lm, rows, eos, tuple(task.stop_strings))

    def new_records():
        for a in answered():
            plan = by_id[a.plan.question.id]
            q, gen, info = a.plan.question, a.generation, a.prefill
            pred = task.postprocess(gen.text)
            yield {
                "item_id": q.id, "example_id": plan.example.id, "question": q.question, "gold": q.answers,
                "prediction": pred, "raw_output": gen.text, "scores": task.score(pred, q),
                "context_tokens": len(plan.context_ids), "question_tokens": len(a.plan.ids),
                "tail_tokens": gen.tail_tokens,
                "new_tokens": len(gen.token_ids), "prefill_s": info["prefill_s"], "question_s": gen.question_s,
                "ttft_s": info["prefill_s"] + gen.question_s, "tpot_s": M.mean(gen.step_s),
                "latency_breakdown": E.breakdown(gen.step_timings, gen.step_s),
                "kv_bytes_prefill": info["kv_bytes_prefill"],
                "kv_bytes_full_prefill": info["kv_bytes_full_prefill"],
                "kv_tokens_prefill": info["kv_tokens_prefill"],
                "prefill_peak_growth_bytes": info["prefill_peak_growth_bytes"], **E.memory(a.cache),
                **(gen.attended or {}),
                "evidence_kept": info["evidence_kept"], "device_peak_bytes": a.device_peak_bytes, "meta": q.meta,
            }

    return _record(folder, cfg, [q.question.id for p in plans for q in p.questions], new_records(), on_item)


def evaluate_ppl(lm, attached, task, folder: RunFolder, cfg: DictConfig, on_item=None) -> list[dict]:
    docs = task.documents(lm.tokenizer)
    for d in docs:
        n = len(d.meta["ids"])
        if n > lm.max_context:
            raise PromptTooLong(f"document {d.id!r} has {n} tokens but model.max_context={lm.max_context} for "
                                f"'{lm.name}'; allowed: data.max_tokens <= {lm.max_context}")

    batch = int(cfg.get("batch_size") or 1)

    def scored():
        """(document, NLLs, seconds per step, cache, wall seconds) of every document not done, ``batch_size``
        documents teacher-forced together as the rows of one batch, the longest first (``longest_first``)."""
        todo = longest_first([d for d in docs if d.id not in folder.done], lambda d: len(d.meta["ids"]), batch)
        for group in E.in_batches(todo, batch):
            t0 = time.perf_counter()
            D.reset_peak(lm.model.device)
            rows = E.teacher_forced_nll_rows(lm.model, attached, [d.meta["ids"] for d in group], **cache_settings(cfg))
            wall = time.perf_counter() - t0
            for d, (nll, steps, cache) in zip(group, rows):
                yield d, nll, steps, cache, wall

    def new_records():
        for d, nll, steps, cache, wall in scored():
            yield {"item_id": d.id, "n_tokens": len(nll), "nll_sum": float(sum(nll)),
                   "nll_blocks": S.nll_blocks(nll), "perplexity": math.exp(sum(nll) / len(nll)),
                   "tpot_s": M.mean(steps), "ttft_s": None, "latency_breakdown": E.breakdown(cache.timings, steps),
                   "wall_s": wall, "kv_bytes_prefill": None, **E.memory(cache),
                   "device_peak_bytes": D.peak_allocated(lm.model.device),
                   **cache.attended_stats()}

    return _record(folder, cfg, [d.id for d in docs], new_records(), on_item)


def aggregate(task, records: list[dict]) -> dict:
    out = task.aggregate(records)  # the dataset's own metrics (accuracy by task, difficulty, length, ...)
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
    out["uncertainty"] = S.item_uncertainty(records)
    return out


# ---------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------

def run_config(cfg: DictConfig) -> dict:
    """The resolved config a run folder stores and compares. Where the run is logged (``logger``) and the
    sweep it belongs to (``sweep_name``) are not part of the run."""
    from luka_bench.results import NOT_RECORDED

    cfg = cfg.copy()
    with open_dict(cfg):
        for key in NOT_RECORDED:
            cfg.pop(key, None)
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
    _int_setting(cfg, "batch_size", 1, True, "an integer >= 1 or null (1: one item at a time)")
    for key in ("query_aware", "cuda_breakdown"):
        if cfg.get(key) not in (None, True, False):
            raise RunConfigError(f"{key}={cfg.get(key)!r} must be true, false or null (false)")
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


def _check_hub_data(cfg: DictConfig, task) -> None:
    """DataError (one line) when the dataset downloads from a hub that cannot be reached (luka_bench.hub)."""
    from luka_bench.data.base import DataError
    from luka_bench.hub import unavailable

    for repo_id in task.hub_datasets():
        why = unavailable(repo_id, "dataset")
        if why is not None:
            raise DataError(f"data={cfg.get('data_name')}: {why}; use its offline source (see the dataset card) "
                            "or run where the hub can be reached")


def prepare(cfg: DictConfig, run_dir: str | Path) -> Prepared:
    """Validate a run without writing anything: the settings, the method, the data (its files read and checked,
    ``Task.check``), the model's settings and the run folder (``RunFolder.check``). Bad input fails here with one
    line and leaves the folder as it was."""
    check_settings(cfg)
    method = build(cfg, "method")  # validates its settings first: cheap failures before the model loads
    task = build(cfg, "data")
    if method.question_in_prompt and (task.kind != "qa" or not cfg.get("query_aware")):
        from luka_bench.methods.base import MethodConfigError
        from luka_bench.methods.finch import NEEDS_QUESTION

        raise MethodConfigError(f"{NEEDS_QUESTION}; got a {task.kind} dataset with query_aware="
                                f"{str(bool(cfg.get('query_aware'))).lower()}")
    model = build(cfg, "model")
    if hasattr(model, "check"):
        model.check()
    _check_hub_data(cfg, task)
    resolved = run_config(cfg)
    RunFolder.check(run_dir, resolved)
    task.check()  # data files exist and parse, before the model loads
    task.check_model(model)  # a data length the configured model cannot hold (RULER, NIAH)
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
                print(run_summary(done, Path(run_dir)))
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


def warm_up_needed(device: torch.device) -> bool:
    """One throwaway prefill and decode before the first timed item, on CUDA (its first kernels pay one-time costs)."""
    return device.type == "cuda"


def _run_in(cfg: DictConfig, prepared: Prepared, folder: RunFolder, tracker) -> dict:
    method, task = prepared.method, prepared.task
    loaded = prepared.model.load()
    folder.write_env(environment(int(cfg.seed), loaded.info["device"], loaded.info["dtype"]))
    t0 = time.perf_counter()

    def log_item(records: list[dict]) -> None:  # running metrics to a tracker that logs them, after every item
        tracker.log(len(records), aggregate(task, records))

    # nothing reads running metrics without such a tracker: no aggregate over all records per item (quadratic)
    on_item = log_item if getattr(tracker, "logs_items", True) else None

    if warm_up_needed(loaded.model.device):  # Triton compilation, CUDA lazy loading, cuBLAS set-up: not timed
        E.warm_up(loaded.model, method, loaded.tokenizer)
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
        "kind": task.kind, "headline": task.headline,
        **aggregate(task, records),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "wall_s": time.perf_counter() - t0, "complete": True,
    }
    folder.write_metrics(result)
    print(run_summary(result, folder.path))
    return result
