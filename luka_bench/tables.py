"""Run folders -> pandas tables: one row per run (``load_runs``), pivots (``pivot`` / ``pivot_strings``) and their
Markdown / LaTeX text. Used by ``luka_bench.report`` (the command) and ``luka_bench.plots``.

A run folder is a folder holding our ``config.yaml`` (a dict with ``model``, ``method`` and ``data``). With a
``metrics.json`` that says ``"complete": true`` it is a finished run; without one (or with a partial or
unreadable one) it is a broken or unfinished run: it is listed (``missing``, and shown as ``missing`` in the
pivot tables), never silently dropped.

Columns of ``runs.csv``: ``run`` (path below the folder), ``status``, the config flattened with dots
(``method.budget``, ``data.difficulty``, ``model_name`` ...), ``variant`` (method name plus the settings that
differ between runs: the label used in legends), ``headline_value`` (the value of the run's headline metric,
named in ``headline``) and every metric (nested ones flattened: ``kv_bytes.peak``,
``latency_breakdown.attention``). Rows are sorted by run path.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from luka_bench.stats import item_uncertainty
from luka_bench.results import (count_lines, identifies_run, find_runs, read_env, read_metrics, read_predictions,
                                read_run_config)

HEADLINE = "headline"
# Metrics where lower is better (everything else, e.g. em / f1 / accuracy, is higher-is-better).
LOWER_IS_BETTER = {"perplexity", "ttft_s", "tpot_s", "wall_s", "kv_ratio", "peak_rss_bytes", "nll"}
# Metrics keys that repeat config names (the config's *_name columns hold them).
_DUPLICATE_METRICS = {"model", "method", "data"}


class ReportError(ValueError):
    """Bad report arguments (unknown column, malformed filter). One line."""


# ---------------------------------------------------------------------------------------------------------
# Reading runs
# ---------------------------------------------------------------------------------------------------------

def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (list, tuple, dict)):
            out[key] = json.dumps(v, sort_keys=True)
        else:
            out[key] = v
    return out


def load_runs(folder: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """All runs below ``folder``: (runs, missing). ``runs`` has one row per run folder (broken ones included,
    with ``status`` saying why); ``missing`` lists the broken ones: run, method, data, status, items done."""
    folder = Path(folder)
    rows, missing = [], []
    for run in find_runs(folder):
        cfg = read_run_config(run / "config.yaml") or {}
        rel = run.relative_to(folder).as_posix() if run != folder else "."
        row: dict[str, Any] = {"run": rel}
        row.update(_flatten(cfg))
        metrics, status = read_metrics(run)
        row["status"] = status
        if metrics is not None:
            for g in ("model", "method", "data"):
                if row.get(f"{g}_name") is None and isinstance(metrics.get(g), str):
                    row[f"{g}_name"] = metrics[g]
            flat = _flatten({k: v for k, v in metrics.items() if k not in _DUPLICATE_METRICS})
            row.update(flat)
            headline = metrics.get("headline")
            row["headline_value"] = metrics.get(headline) if isinstance(headline, str) else None
            # ± SE and n of every per-item metric, from the predictions (clustered by example; stats.item_uncertainty)
            for k, u in item_uncertainty(read_predictions(run)).items():
                row[f"{k}_se"], row[f"{k}_n"] = u["se"], u["n"]
                if k == headline:
                    row["headline_value_se"], row["headline_value_n"] = u["se"], u["n"]
            env = read_env(run)  # where and how it ran: the latency plot says so
            row.update({f"env.{k}": env.get(k) for k in ("host", "device", "cuda", "torch_threads", "platform")})
        else:
            missing.append({"run": rel, "model_name": row.get("model_name"), "method_name": row.get("method_name"),
                            "data_name": row.get("data_name"), "status": status,
                            "items_done": count_lines(run / "predictions.jsonl")})
        rows.append(row)
    runs = pd.DataFrame(rows)
    if runs.empty:
        runs = pd.DataFrame(columns=["run", "status"])
    runs = _order_columns(runs)
    runs.insert(runs.columns.get_loc("status") + 1, "variant", variant_labels(runs))
    miss = pd.DataFrame(missing, columns=["run", "model_name", "method_name", "data_name", "status", "items_done"])
    return runs.reset_index(drop=True), miss


def _order_columns(df: pd.DataFrame) -> pd.DataFrame:
    first = [c for c in ("run", "status", "model_name", "method_name", "data_name", "headline", "headline_value")
             if c in df.columns]
    config_cols = sorted(c for c in df.columns if c.split(".")[0] in ("model", "method", "data") and "." in c)
    rest = [c for c in df.columns if c not in first and c not in config_cols]
    return df[first + config_cols + rest]


def is_identity(col: str) -> bool:
    """Config columns that tell runs apart (``results.identifies_run``: never how a run was executed)."""
    return identifies_run(col)


def config_columns(df: pd.DataFrame) -> list[str]:
    """Columns that come from the config (not metrics, not bookkeeping)."""
    metric_like = {"run", "status", "variant", "headline", "headline_value", "kind", "complete"}
    cols = []
    for c in df.columns:
        if c in metric_like:
            continue
        if c.endswith("_name") or c.split(".")[0] in ("model", "method", "data") and "." in c:
            cols.append(c)
        elif c in ("seed", "max_new_tokens", "prefill_chunk", "threads", "progress", "sweep_name"):
            cols.append(c)
    return cols


def distinct(values: Iterable[Any]) -> set:
    return {json.dumps(v, sort_keys=True, default=str) for v in values if not isnull(v)}


def isnull(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def variant_labels(df: pd.DataFrame) -> list[str]:
    """Legend label of each run: the method's name plus the method settings that differ between the runs of
    that method (``streaming_llm budget=0.25``), plus other identity settings that differ between all runs
    (``model_name=...``). Dataset settings are left out: they are the other axis of every table."""
    if df.empty or "method_name" not in df.columns:
        return [str(r) for r in df.get("run", [])]
    # Settings are compared among the complete runs (a failed run's config must not add words to every label);
    # never a class path (``_target_``), and the model by its name only.
    ref = complete(df) if (df.get("status") == "complete").any() else df
    cfg_cols = [c for c in config_columns(df) if is_identity(c) and not c.endswith("_target_")]
    global_cols = [c for c in cfg_cols if not c.startswith(("method.", "data.", "model.")) and
                   c not in ("method_name", "data_name") and len(distinct(ref[c])) > 1]
    labels = []
    for _, row in df.iterrows():
        same = ref[ref["method_name"] == row["method_name"]]
        parts = [str(row["method_name"])]
        for c in cfg_cols:
            if c.startswith("method.") and not c.endswith("_target_") and len(distinct(same[c])) > 1:
                parts.append(f"{c[len('method.'):]}={_short(row[c])}")
        parts += [f"{c}={_short(row[c])}" for c in global_cols]
        labels.append(" ".join(parts))
    return labels


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return "-" if isnull(v) else str(v)


# ---------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------

def parse_filters(items: Sequence[str] | None) -> dict[str, str]:
    out = {}
    for item in items or ():
        if "=" not in item:
            raise ReportError(f"--filter {item!r} is not key=value (e.g. --filter method.budget=0.25)")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _matches(value: Any, wanted: str) -> bool:
    if isnull(value):
        return wanted.lower() in ("null", "none", "")
    if str(value) == wanted or _short(value) == wanted:
        return True
    if isinstance(value, bool):
        return str(value).lower() == wanted.lower()
    try:
        return float(value) == float(wanted)
    except (TypeError, ValueError):
        return False


def apply_filters(df: pd.DataFrame, filters: dict[str, str]) -> pd.DataFrame:
    for k, v in filters.items():
        need_columns(df, [k], "--filter")
        df = df[[_matches(x, v) for x in df[k]]]
    return df


def need_columns(df: pd.DataFrame, cols: Iterable[str], what: str) -> None:
    for c in cols:
        if c not in df.columns:
            allowed = ", ".join(sorted(map(str, df.columns)))
            raise ReportError(f"{what}: no column {c!r} in the runs table; available: {allowed}")


def value_column(df: pd.DataFrame, metric: str) -> str:
    col = "headline_value" if metric == HEADLINE else metric
    need_columns(df, [col], "--metric")
    return col


def complete(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "complete"] if "status" in df.columns else df


def metric_list(metric: str | Sequence[str]) -> list[str]:
    return [m.strip() for m in metric.split(",") if m.strip()] if isinstance(metric, str) else list(metric)


def _column_levels(metrics: list[str], cols: list[str]) -> list[str]:
    """Column levels of the pivot: the metric is a level of its own when there are several (or no --cols),
    the last one, so that the metrics of one setting sit side by side (``full / em_lenient``, ``full /
    kv_ratio``, ``h2o / em_lenient``, ...)."""
    return cols + (["metric"] if len(metrics) > 1 or not cols else [])


def _column_order(metrics: list[str], levels: list[str], order: dict[str, list[str]] | None):
    """Sort key of pivot columns: settings in order, then (when the metric is the last level) the metrics in
    the order asked for."""
    def key(k: Any) -> tuple:
        k = k if isinstance(k, tuple) else (k,)
        if levels and levels[-1] == "metric":
            return sort_key(k[:-1], levels[:-1], order), metrics.index(k[-1])
        return sort_key(k, levels, order), 0
    return key


def _se_of_mean(se: pd.Series) -> float:
    """SE of the mean of k independent runs' means: sqrt(sum SE^2) / k."""
    return float((se ** 2).sum(min_count=len(se)) ** 0.5 / len(se)) if len(se) else float("nan")


# What a pivot cell holds, from the runs it averages: their mean, the SE of that mean, the items behind it.
_STATS = {"mean": ("", "mean"), "se": ("_se", _se_of_mean), "n": ("_n", "sum")}


def pivot(df: pd.DataFrame, rows: Sequence[str] = ("data_name",), cols: Sequence[str] = ("method_name",),
          metric: str | Sequence[str] = HEADLINE, order: dict[str, list[str]] | None = None,
          stat: str = "mean") -> pd.DataFrame:
    """rows x cols table of ``metric`` over the complete runs (``headline``: each run's own headline metric).
    Several metrics (``"em_lenient,f1,kv_ratio"``) become the last column level, in the order given. Cells
    holding several runs (a setting not on either axis differs) show their mean. Rows and columns follow
    ``order`` (see ``sweep_order``) where it lists their values. ``stat="se"`` / ``"n"``: the same table of
    the standard errors / item counts (``<column>_se`` / ``_n`` of ``load_runs``; NaN where a run has none)."""
    rows, cols, metrics = list(rows), list(cols), metric_list(metric)
    need_columns(df, rows + cols, "--rows/--cols")
    suffix, agg = _STATS[stat]
    value_cols = [value_column(df, m) + suffix for m in metrics]
    done = complete(df)
    if done.empty or not rows:
        return pd.DataFrame()
    parts = []
    for m, col in zip(metrics, value_cols):
        part = done[rows + cols].copy()
        part["metric"] = m
        part["value"] = pd.to_numeric(done[col], errors="coerce") if col in done.columns else float("nan")
        parts.append(part)
    long = pd.concat(parts, ignore_index=True)
    levels = _column_levels(metrics, cols)
    table = long.pivot_table(index=rows, columns=levels, values="value", aggfunc=agg, dropna=False, sort=True)
    table = table.loc[sorted(table.index, key=lambda k: sort_key(k, rows, order))]
    return table[sorted(table.columns, key=_column_order(metrics, levels, order))]


def cell_counts(df: pd.DataFrame, rows: Sequence[str], cols: Sequence[str]) -> pd.DataFrame:
    done = complete(df)
    if done.empty:
        return pd.DataFrame()
    return done.groupby(list(rows) + list(cols)).size()


def sort_key(key: Any, names: Sequence[str] = (), order: dict[str, list[str]] | None = None) -> tuple:
    """Values a sweep listed (``order``: level name -> its values in the order of the sweep command) in that
    order; then numbers in numeric order (budgets 0.0625 < 0.125 < 1); then strings in text order."""
    parts = key if isinstance(key, tuple) else (key,)
    out = []
    for i, p in enumerate(parts):
        listed = (order or {}).get(names[i] if i < len(names) else "", [])
        if str(p) in listed:
            out.append((-1, float(listed.index(str(p))), ""))
            continue
        try:
            out.append((0, float(p), ""))
        except (TypeError, ValueError):
            out.append((1, 0.0, str(p)))
    return tuple(out)


_GROUP_COLUMNS = {"model": "model_name", "method": "method_name", "data": "data_name"}


def sweep_order(folder: str | Path) -> dict[str, list[str]]:
    """The order in which the sweep in ``folder`` listed its values (``multirun.yaml``: the sweeper's params
    and the command's ``key=a,b,c`` overrides), keyed by runs.csv column: ``data=wikisalad_easy,...,
    wikisalad_very_hard`` puts the rows in difficulty order instead of alphabetical. Empty when there is none."""
    try:
        cfg = yaml.safe_load((Path(folder) / "multirun.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return {}
    hydra_cfg = cfg.get("hydra") or {}
    listed = [f"{k}={v}" for k, v in ((hydra_cfg.get("sweeper") or {}).get("params") or {}).items()]
    listed += list((hydra_cfg.get("overrides") or {}).get("task") or [])
    order: dict[str, list[str]] = {}
    for item in listed:
        key, sep, values = str(item).partition("=")
        if not sep or "," not in values or "(" in values:
            continue
        key = key.lstrip("+~")
        order[_GROUP_COLUMNS.get(key, key)] = [v.strip() for v in values.split(",")]
    return order


def fmt_value(v: Any) -> str:
    if isnull(v):
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def se_decimals(se: float) -> int:
    """Decimals that show a standard error to one significant digit (two when it starts with 1: 0.014 not
    0.01), the precision its mean is shown at too."""
    digits = -math.floor(math.log10(abs(se)))
    return max(0, digits + (1 if f"{abs(se):.{max(0, digits)}e}"[0] == "1" else 0))


def fmt_mean_se(mean: Any, se: Any = None, n: Any = None, signed: bool = False) -> str:
    """``0.74 ± 0.05 (n=40)``: the mean at the precision its SE supports. Without an SE (one cluster, or a run
    without predictions) the mean at 4 significant digits and ``n`` when known; an SE of 0 (every item the
    same) as ``± 0``."""
    if isnull(mean):
        return ""
    sign = "+" if signed else ""
    tail = f" (n={int(n)})" if not isnull(n) else ""
    if isnull(se):
        return f"{float(mean):{sign}.4g}{tail}"
    if se == 0:
        return f"{float(mean):{sign}.4g} ± 0{tail}"
    d = se_decimals(float(se))
    return f"{float(mean):{sign}.{d}f} ± {float(se):.{d}f}{tail}"


def _label(key: Any) -> str:
    return " / ".join(map(str, key)) if isinstance(key, tuple) else str(key)


def pivot_strings(df: pd.DataFrame, table: pd.DataFrame, rows: Sequence[str], cols: Sequence[str],
                  metric: str | Sequence[str] = HEADLINE, order: dict[str, list[str]] | None = None) -> pd.DataFrame:
    """The pivot as display strings: ``mean ± SE (n=items)`` (``fmt_mean_se``) where the runs' predictions give
    a standard error, else the value at 4 significant digits; the empty cells of broken runs read ``missing``."""
    rows, cols, metrics = list(rows), list(cols), metric_list(metric)
    se_t = pivot(df, rows, cols, metrics, order, stat="se") if not table.empty else table
    n_t = pivot(df, rows, cols, metrics, order, stat="n") if not table.empty else table
    levels = _column_levels(metrics, cols)
    broken = df[df["status"] != "complete"] if "status" in df.columns else df.iloc[0:0]

    def key(values: list) -> Any:
        return tuple(values) if len(values) > 1 else values[0]

    def has_null(k: Any) -> bool:
        return any(isnull(x) for x in (k if isinstance(k, tuple) else (k,)))

    r_keys = list(table.index) if not table.empty else []
    c_keys = list(table.columns) if not table.empty else []
    holes = []  # (row key, column key) of broken runs
    for _, b in broken.iterrows():
        rk = key([b[r] for r in rows])
        for m in metrics:
            ck = key([m if lv == "metric" else b[lv] for lv in levels])
            if has_null(rk) or has_null(ck):
                continue
            holes.append((rk, ck))
            if rk not in r_keys:
                r_keys.append(rk)
            if ck not in c_keys:
                c_keys.append(ck)
    r_keys = sorted(r_keys, key=lambda k: sort_key(k, rows, order))
    c_keys = sorted(c_keys, key=_column_order(metrics, levels, order))
    out = pd.DataFrame("", index=[_label(k) for k in r_keys], columns=[_label(k) for k in c_keys], dtype=object)
    for rk in r_keys:
        for ck in c_keys:
            at = rk in table.index and ck in table.columns
            v = table.loc[rk, ck] if at else float("nan")
            se, n = (se_t.loc[rk, ck], n_t.loc[rk, ck]) if at else (None, None)
            out.loc[_label(rk), _label(ck)] = fmt_value(v) if isnull(n) or n == 0 else fmt_mean_se(v, se, n)
    for rk, ck in holes:
        if out.loc[_label(rk), _label(ck)] == "":
            out.loc[_label(rk), _label(ck)] = "missing"
    out.index.name = f"{'/'.join(rows)} \\ {'/'.join(levels)}"
    return out


def headline_note(df: pd.DataFrame, metric: str | Sequence[str]) -> str:
    """What the cells hold (the headline metric of each dataset, by name) and the model when there is one."""
    done = complete(df)
    words = []
    for m in metric_list(metric):
        if m != HEADLINE:
            words.append(m)
        elif done.empty or "headline" not in done.columns:
            words.append("headline metric")
        else:
            by = done.groupby("data_name")["headline"].first() if "data_name" in done.columns else {}
            parts = [f"{k}: {v}" for k, v in sorted(dict(by).items(), key=lambda kv: str(kv[0]))]
            words.append("each dataset's headline metric (" + ", ".join(parts) + ")")
    note = "cells: " + ", ".join(words)
    models = sorted(set(done["model_name"].dropna().astype(str))) if "model_name" in done.columns else []
    if len(models) == 1:
        note += f"; model {models[0]}"
    return note


def to_markdown(strings: pd.DataFrame, note: str = "") -> str:
    from tabulate import tabulate

    headers = [strings.index.name or ""] + list(strings.columns)
    body = [[idx, *row] for idx, row in zip(strings.index, strings.values.tolist())]
    md = tabulate(body, headers=headers, tablefmt="pipe", disable_numparse=True,
                  colalign=["left"] + ["right"] * len(strings.columns))
    return md + ("\n\n" + note if note else "") + "\n"


def to_latex(strings: pd.DataFrame, note: str = "") -> str:
    def esc(s: str) -> str:
        for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("&", r"\&"), ("%", r"\%"), ("#", r"\#"),
                     ("$", r"\$"), ("{", r"\{"), ("}", r"\}")):
            s = s.replace(a, b) if a != "\\" else s.replace(a, "\x00")
        return s.replace("\x00", r"$\backslash$")

    cols = list(strings.columns)
    lines = ["\\begin{tabular}{l" + "r" * len(cols) + "}", "\\toprule",
             " & ".join([esc(strings.index.name or "")] + [esc(str(c)) for c in cols]) + " \\\\", "\\midrule"]
    for idx, row in zip(strings.index, strings.values.tolist()):
        lines.append(" & ".join([esc(str(idx))] + [esc(str(v)) for v in row]) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    tex = "\n".join(lines) + "\n"
    return (f"% {note}\n" if note else "") + tex


# ---------------------------------------------------------------------------------------------------------
# Paired differences to a reference method (--paired REF)
# ---------------------------------------------------------------------------------------------------------

SE_NOTE = ("cells: mean ± standard error (n = items); QA: SE clustered by example (questions that share a context "
           "are one cluster, not independent draws), perplexity: delta method over documents (one document: over its 256-token blocks)")


def paired_runs(df: pd.DataFrame, folder: str | Path, ref: str, metric: str = HEADLINE) -> pd.DataFrame:
    """Each complete run's paired difference to the run of method ``ref`` on the same model and data settings:
    ``metric`` minus the reference's on the items both answered (``stats.paired_difference``). Columns: the
    run's own, plus ``paired``, ``paired_se``, ``paired_n``. The reference runs themselves get NaN."""
    from luka_bench.stats import paired_difference

    done = complete(df).copy()
    need_columns(done, ["method_name"], "--paired")
    methods = sorted(set(done["method_name"].dropna().astype(str)))
    if ref not in methods:
        raise ReportError(f"--paired {ref}: no complete run of method {ref!r} here; methods: {', '.join(methods)}")
    same = [c for c in done.columns if is_identity(c) and (c in ("model_name", "data_name") or
                                                          c.startswith(("model.", "data.")))]
    refs = done[done["method_name"] == ref]
    cache: dict[str, list[dict]] = {}

    def records(run: str) -> list[dict]:
        if run not in cache:
            cache[run] = read_predictions(Path(folder) / run)
        return cache[run]

    vals = []
    for _, row in done.iterrows():
        match = refs[[all(distinct([a]) == distinct([b]) for a, b in zip(r[same], row[same]))
                      for _, r in refs.iterrows()]] if len(refs) else refs
        name = row["headline"] if metric == HEADLINE and "headline" in row else metric
        if row["method_name"] == ref or match.empty or isnull(name):
            vals.append({"mean": None, "se": None, "n": None})
            continue
        vals.append(paired_difference(records(row["run"]), records(match["run"].iloc[0]), str(name)))
    done["paired"] = [v["mean"] for v in vals]
    done["paired_se"] = [v["se"] for v in vals]
    done["paired_n"] = [v["n"] for v in vals]
    return done


def paired_strings(df: pd.DataFrame, folder: str | Path, ref: str, rows: Sequence[str], cols: Sequence[str],
                   metric: str = HEADLINE, order: dict[str, list[str]] | None = None) -> pd.DataFrame:
    """The pivot of paired differences to ``ref`` as display strings (``+0.05 ± 0.02 (n=40)``); the reference's
    own cells read ``reference``."""
    runs = paired_runs(df, folder, ref, metric)
    # 1 where the cell is the reference's own (same table keys as the differences: the flag under their name)
    is_ref = pivot(runs.assign(paired=(runs["method_name"] == ref).astype(float)), rows, cols, "paired", order)
    table = pivot(runs, rows, cols, "paired", order)
    se_t, n_t = pivot(runs, rows, cols, "paired", order, "se"), pivot(runs, rows, cols, "paired", order, "n")
    out = pd.DataFrame("", index=[_label(k) for k in table.index], columns=[_label(k) for k in table.columns],
                       dtype=object)
    for rk in table.index:
        for ck in table.columns:
            v = table.loc[rk, ck]
            out.loc[_label(rk), _label(ck)] = "reference" if is_ref.loc[rk, ck] == 1 else \
                fmt_mean_se(v, se_t.loc[rk, ck], n_t.loc[rk, ck], signed=True)
    name = metric if metric != HEADLINE else "headline"
    out.columns = [f"{name} − {ref} (paired)" if c == "paired" else c for c in out.columns]
    out.index.name = f"{'/'.join(rows)} \\ {'/'.join(cols) or 'metric'}"
    return out


# ---------------------------------------------------------------------------------------------------------
# One run's closing summary

def _fmt_summary(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt_summary(x)}" for k, x in v.items())
    return str(v)


def _bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def run_summary(m: dict, path: Path) -> str:
    """The table a run prints at its end (and a re-run of a finished one): its metrics.json, ± SE and n."""
    import os

    where = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else str(path)
    rows = [("run", where), ("model / method / data", f"{m['model']} / {m['method']} / {m['data']}"),
            ("n_examples", _fmt_summary(m["n_examples"]))]
    keys = ["em", "em_lenient", "f1", "accuracy"] + sorted(k for k in m if k.startswith("accuracy_")) + \
        ["perplexity", "n_tokens", "ttft_s", "tpot_s", "kv_ratio", "attended_tokens", "attended_ratio"]
    unc = m.get("uncertainty") or {}
    for k in keys:
        if k == "perplexity" and k in unc and unc[k].get("unit"):  # corpus perplexity ± SE over its units
            u = unc[k]
            rows.append((f"perplexity (± SE over {u['clusters']} {u['unit']})", fmt_mean_se(u["mean"], u["se"])))
        elif k in unc and k not in ("ttft_s", "tpot_s"):  # scores: mean ± SE clustered by example (n items)
            rows.append((f"{k} (± SE, n)", fmt_mean_se(unc[k]["mean"], unc[k]["se"], unc[k]["n"])))
        elif k in m:
            rows.append((k, _fmt_summary(m[k])))
    hl = m.get("headline")
    if isinstance(hl, str) and hl in m and hl not in keys:  # a dataset's own headline (ruler_score)
        rows.append((f"{hl} (± SE)", fmt_mean_se(m[hl], m.get(f"{hl}_se"))))
    # the rule the headline follows (what it averages, whether it is comparable), under the table: it is long
    note = f"\n{m[f'{hl}_rule']}" if isinstance(hl, str) and m.get(f"{hl}_rule") else ""
    if m.get("latency_breakdown") and len(m["latency_breakdown"]) > 1:
        rows.append(("latency_breakdown (s/token)", _fmt_summary(m["latency_breakdown"])))
    if m.get("attended_bytes") is not None:
        rows.append(("attended_bytes (per step)", _bytes(m["attended_bytes"])))
    rows.append(("kv_bytes (peak / full)", f"{_bytes(m['kv_bytes']['peak'])} / {_bytes(m['kv_bytes_full']['peak'])}"))
    if m.get("device_peak_bytes") is not None:
        rows.append(("device_peak_bytes (allocated)", _bytes(m["device_peak_bytes"])))
    rows.append(("peak_rss_bytes", _bytes(m["peak_rss_bytes"])))
    rows.append(("wall_s", _fmt_summary(m["wall_s"])))
    w = max(len(r[0]) for r in rows)
    line = "+" + "-" * (w + 2) + "+" + "-" * (max(len(r[1]) for r in rows) + 2) + "+"
    body = "\n".join(f"| {a:<{w}} | {b:<{len(line) - w - 7}} |" for a, b in rows)
    return f"{line}\n{body}\n{line}{note}"
