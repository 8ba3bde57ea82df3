"""``python -m luka_bench.report <folder>``: every run folder below ``<folder>`` -> one pandas table, pivot
tables (Markdown, CSV, LaTeX) and plots (PNG), written to ``<folder>/report/``.

A run folder is a folder holding our ``config.yaml`` (a dict with ``model``, ``method`` and ``data``). With a
``metrics.json`` that says ``"complete": true`` it is a finished run; without one (or with a partial or
unreadable one) it is a broken or unfinished run: it is listed (printed and in ``missing.csv``, and shown as
``missing`` in the pivot tables), never silently dropped.

Columns of ``runs.csv``: ``run`` (path below the folder), ``status``, the config flattened with dots
(``method.budget``, ``data.difficulty``, ``model_name`` ...), ``variant`` (method name plus the settings that
differ between runs: the label used in legends), ``headline_value`` (the value of the run's headline metric,
named in ``headline``) and every metric (nested ones flattened: ``kv_bytes.peak``,
``latency_breakdown.attention``).

Outputs carry no times and rows are sorted by run path, so re-running the report gives the same files. The
plotting functions return the matplotlib Figure (tests read its axes and legends).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from luka_bench.results import read_job_error

HEADLINE = "headline"
# Metrics where lower is better (everything else, e.g. em / f1 / accuracy, is higher-is-better).
LOWER_IS_BETTER = {"perplexity", "ttft_s", "tpot_s", "wall_s", "kv_ratio", "peak_rss_bytes", "nll"}
# Config keys that say how a run was executed, not what it measured: never used to tell runs apart.
NOT_IDENTITY = {"progress", "threads", "sweep_name", "data.limit"}
NOT_IDENTITY_PREFIXES = ("logger.",)
SKIP_DIRS = {"wandb", "report", "__pycache__"}
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


def _read_config(path: Path) -> dict | None:
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    if isinstance(cfg, dict) and all(k in cfg for k in ("model", "method", "data")):
        return cfg
    return None


def find_runs(folder: str | Path) -> list[Path]:
    """Run folders below ``folder`` (itself included), sorted. Skips hidden folders (``.submitit``), W&B's
    ``wandb/`` and report outputs."""
    folder = Path(folder)
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        if "config.yaml" in files and _read_config(Path(root) / "config.yaml") is not None:
            found.append(Path(root))
    return sorted(found)


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.endswith(b"\n"))
    except OSError:
        return 0


def _read_metrics(run: Path) -> tuple[dict | None, str]:
    path = run / "metrics.json"
    if not path.exists():
        error = read_job_error(run)  # a sweep job stopped by bad input left its one-line error
        return None, f"failed: {error}" if error is not None else "no metrics.json"
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, "unreadable metrics.json"
    if not isinstance(m, dict):
        return None, "unreadable metrics.json"
    if m.get("complete") is not True:
        return None, "incomplete metrics.json"
    return m, "complete"


def load_runs(folder: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """All runs below ``folder``: (runs, missing). ``runs`` has one row per run folder (broken ones included,
    with ``status`` saying why); ``missing`` lists the broken ones: run, method, data, status, items done."""
    folder = Path(folder)
    rows, missing = [], []
    for run in find_runs(folder):
        cfg = _read_config(run / "config.yaml") or {}
        rel = run.relative_to(folder).as_posix() if run != folder else "."
        row: dict[str, Any] = {"run": rel}
        row.update(_flatten(cfg))
        metrics, status = _read_metrics(run)
        row["status"] = status
        if metrics is not None:
            for g in ("model", "method", "data"):
                if row.get(f"{g}_name") is None and isinstance(metrics.get(g), str):
                    row[f"{g}_name"] = metrics[g]
            flat = _flatten({k: v for k, v in metrics.items() if k not in _DUPLICATE_METRICS})
            row.update(flat)
            headline = metrics.get("headline")
            row["headline_value"] = metrics.get(headline) if isinstance(headline, str) else None
        else:
            missing.append({"run": rel, "model_name": row.get("model_name"), "method_name": row.get("method_name"),
                            "data_name": row.get("data_name"), "status": status,
                            "items_done": _count_lines(run / "predictions.jsonl")})
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


def _is_identity(col: str) -> bool:
    return col not in NOT_IDENTITY and not col.startswith(NOT_IDENTITY_PREFIXES)


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


def _distinct(values: Iterable[Any]) -> set:
    return {json.dumps(v, sort_keys=True, default=str) for v in values if not _isnull(v)}


def _isnull(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def variant_labels(df: pd.DataFrame) -> list[str]:
    """Legend label of each run: the method's name plus the method settings that differ between the runs of
    that method (``streaming_llm budget=0.25``), plus other identity settings that differ between all runs
    (``model_name=...``). Dataset settings are left out: they are the other axis of every table."""
    if df.empty or "method_name" not in df.columns:
        return [str(r) for r in df.get("run", [])]
    cfg_cols = [c for c in config_columns(df) if _is_identity(c)]
    global_cols = [c for c in cfg_cols if not c.startswith(("method.", "data.")) and c not in ("method_name", "data_name")
                   and len(_distinct(df[c])) > 1]
    labels = []
    for _, row in df.iterrows():
        same = df[df["method_name"] == row["method_name"]]
        parts = [str(row["method_name"])]
        for c in cfg_cols:
            if c.startswith("method.") and not c.endswith("_target_") and len(_distinct(same[c])) > 1:
                parts.append(f"{c[len('method.'):]}={_short(row[c])}")
        parts += [f"{c}={_short(row[c])}" for c in global_cols]
        labels.append(" ".join(parts))
    return labels


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return "-" if _isnull(v) else str(v)


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
    if _isnull(value):
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
        _need_columns(df, [k], "--filter")
        df = df[[_matches(x, v) for x in df[k]]]
    return df


def _need_columns(df: pd.DataFrame, cols: Iterable[str], what: str) -> None:
    for c in cols:
        if c not in df.columns:
            allowed = ", ".join(sorted(map(str, df.columns)))
            raise ReportError(f"{what}: no column {c!r} in the runs table; available: {allowed}")


def _value_column(df: pd.DataFrame, metric: str) -> str:
    col = "headline_value" if metric == HEADLINE else metric
    _need_columns(df, [col], "--metric")
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
            return _sort_key(k[:-1], levels[:-1], order), metrics.index(k[-1])
        return _sort_key(k, levels, order), 0
    return key


def pivot(df: pd.DataFrame, rows: Sequence[str] = ("data_name",), cols: Sequence[str] = ("method_name",),
          metric: str | Sequence[str] = HEADLINE, order: dict[str, list[str]] | None = None) -> pd.DataFrame:
    """rows x cols table of ``metric`` over the complete runs (``headline``: each run's own headline metric).
    Several metrics (``"em_lenient,f1,kv_ratio"``) become the last column level, in the order given. Cells
    holding several runs (a setting not on either axis differs) show their mean. Rows and columns follow
    ``order`` (see ``sweep_order``) where it lists their values."""
    rows, cols, metrics = list(rows), list(cols), metric_list(metric)
    _need_columns(df, rows + cols, "--rows/--cols")
    value_cols = [_value_column(df, m) for m in metrics]
    done = complete(df)
    if done.empty or not rows:
        return pd.DataFrame()
    parts = []
    for m, col in zip(metrics, value_cols):
        part = done[rows + cols].copy()
        part["metric"] = m
        part["value"] = pd.to_numeric(done[col], errors="coerce")
        parts.append(part)
    long = pd.concat(parts, ignore_index=True)
    levels = _column_levels(metrics, cols)
    table = long.pivot_table(index=rows, columns=levels, values="value", aggfunc="mean", dropna=False, sort=True)
    table = table.loc[sorted(table.index, key=lambda k: _sort_key(k, rows, order))]
    return table[sorted(table.columns, key=_column_order(metrics, levels, order))]


def cell_counts(df: pd.DataFrame, rows: Sequence[str], cols: Sequence[str]) -> pd.DataFrame:
    done = complete(df)
    if done.empty:
        return pd.DataFrame()
    return done.groupby(list(rows) + list(cols)).size()


def _sort_key(key: Any, names: Sequence[str] = (), order: dict[str, list[str]] | None = None) -> tuple:
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


def _fmt(v: Any) -> str:
    if _isnull(v):
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _label(key: Any) -> str:
    return " / ".join(map(str, key)) if isinstance(key, tuple) else str(key)


def pivot_strings(df: pd.DataFrame, table: pd.DataFrame, rows: Sequence[str], cols: Sequence[str],
                  metric: str | Sequence[str] = HEADLINE, order: dict[str, list[str]] | None = None) -> pd.DataFrame:
    """The pivot as display strings (4 significant digits); the empty cells of broken runs read ``missing``."""
    rows, cols, metrics = list(rows), list(cols), metric_list(metric)
    levels = _column_levels(metrics, cols)
    broken = df[df["status"] != "complete"] if "status" in df.columns else df.iloc[0:0]

    def key(values: list) -> Any:
        return tuple(values) if len(values) > 1 else values[0]

    def has_null(k: Any) -> bool:
        return any(_isnull(x) for x in (k if isinstance(k, tuple) else (k,)))

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
    r_keys = sorted(r_keys, key=lambda k: _sort_key(k, rows, order))
    c_keys = sorted(c_keys, key=_column_order(metrics, levels, order))
    out = pd.DataFrame("", index=[_label(k) for k in r_keys], columns=[_label(k) for k in c_keys], dtype=object)
    for rk in r_keys:
        for ck in c_keys:
            v = table.loc[rk, ck] if (rk in table.index and ck in table.columns) else float("nan")
            out.loc[_label(rk), _label(ck)] = _fmt(v)
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
# Plots (Agg backend; each returns its Figure)
# ---------------------------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _metric_name(df: pd.DataFrame, metric: str) -> str:
    if metric != HEADLINE:
        return metric
    names = sorted(set(complete(df).get("headline", pd.Series(dtype=object)).dropna().astype(str)))
    return "headline (" + ", ".join(names) + ")" if names else "headline"


def _lower_is_better(df: pd.DataFrame, metric: str) -> bool:
    if metric == HEADLINE:
        names = set(complete(df).get("headline", pd.Series(dtype=object)).dropna())
        return bool(names) and names <= LOWER_IS_BETTER
    return metric in LOWER_IS_BETTER


def _datasets(done: pd.DataFrame, order: dict[str, list[str]] | None) -> list[str]:
    """The datasets of these runs, in the sweep's order (``sweep_order``), else alphabetical."""
    return sorted(done["data_name"].dropna().astype(str).unique(), key=lambda d: _sort_key(d, ["data_name"], order))


def _variants(done: pd.DataFrame, order: dict[str, list[str]] | None) -> list[str]:
    """The variants (legend labels) of these runs: by method in the sweep's order, then by label."""
    method = dict(zip(done["variant"].astype(str), done.get("method_name", done["variant"]).astype(str)))
    return sorted(method, key=lambda v: (_sort_key(method[v], ["method_name"], order), v))


def plot_headline(df: pd.DataFrame, metric: str = HEADLINE, order: dict[str, list[str]] | None = None):
    """Grouped bars: one group per dataset, one bar per variant (method + its differing settings)."""
    plt = _plt()
    done = complete(df)
    col = _value_column(df, metric)
    datasets = _datasets(done, order)
    variants = _variants(done, order)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 + 0.45 * len(datasets) * max(len(variants), 1)), 3.6))
    width = 0.8 / max(len(variants), 1)
    for i, v in enumerate(variants):
        ys = []
        for d in datasets:
            cell = pd.to_numeric(done[(done["variant"] == v) & (done["data_name"] == d)][col], errors="coerce")
            ys.append(float(cell.mean()) if cell.notna().any() else float("nan"))
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(datasets))]
        bars = ax.bar(xs, ys, width=width, label=v)
        ax.bar_label(bars, labels=[_fmt(y) for y in ys], fontsize=7, padding=1)
    heads = done.groupby("data_name")["headline"].first() if metric == HEADLINE else {}
    ax.set_xticks(range(len(datasets)))
    ax.set_xticklabels([f"{d}\n({heads[d]})" if metric == HEADLINE and d in heads else d for d in datasets])
    ax.set_ylabel(_metric_name(df, metric))
    ax.set_xlabel("dataset")
    ax.set_title(f"{_metric_name(df, metric)} by method and dataset")
    ax.legend(title="method", fontsize=8, title_fontsize=8, loc="best")
    finite = [y for y in pd.to_numeric(done[col], errors="coerce").dropna()]
    if finite and min(finite) >= 0:  # metrics >= 0: bars start at 0, room above for the labels
        ax.set_ylim(0, max(finite) * 1.18 if max(finite) > 0 else 1.0)
    fig.tight_layout()
    return fig


def default_x(df: pd.DataFrame, hue: str = "method_name") -> str | None:
    """The numeric setting to put on the x axis: the method budget if it was swept (differs between runs with
    the same ``hue`` and dataset), else the first other numeric setting that was. None when nothing was swept:
    every line would be a single point."""
    done = complete(df)
    cands = [c for c in config_columns(done) if _is_identity(c) and not c.endswith("_name")]
    group = [c for c in (hue, "data_name") if c in done.columns]

    def swept(c: str) -> bool:
        if not group:
            return len(_distinct(done[c])) > 1
        return any(len(_distinct(g[c])) > 1 for _, g in done.groupby(group, dropna=False))

    numeric = [c for c in cands if pd.api.types.is_numeric_dtype(done[c]) and not pd.api.types.is_bool_dtype(done[c])
               and swept(c)]
    if "method.budget" in numeric:
        return "method.budget"
    return numeric[0] if numeric else None


def plot_metric_vs(df: pd.DataFrame, x: str, metric: str = HEADLINE, hue: str = "method_name",
                   order: dict[str, list[str]] | None = None):
    """Lines: ``metric`` against the setting ``x``, one line per value of ``hue``, one panel per dataset."""
    plt = _plt()
    _need_columns(df, [x, hue], "--x/--hue")
    done = complete(df)
    col = _value_column(df, metric)
    datasets = _datasets(done, order) or ["-"]
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets) + 1.2, 3.4), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        sub = done[done["data_name"] == d] if d != "-" else done
        for h in sorted(sub[hue].dropna().unique(), key=lambda h: (_sort_key(str(h), [hue], order), str(h))):
            part = sub[sub[hue] == h][[x, col]].copy()
            part[x] = pd.to_numeric(part[x], errors="coerce")
            part[col] = pd.to_numeric(part[col], errors="coerce")
            part = part.dropna().groupby(x, as_index=False)[col].mean().sort_values(x)
            if part.empty:
                continue
            ax.plot(part[x], part[col], marker="o", label=str(h))
        ax.set_title(d)
        ax.set_xlabel(x)
        ax.set_ylabel(_metric_name(sub, metric))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(title=hue, fontsize=8, title_fontsize=8)
    fig.suptitle(f"{_metric_name(df, metric)} vs {x}")
    fig.tight_layout()
    return fig


def latency_columns(df: pd.DataFrame) -> list[str]:
    return sorted(c for c in df.columns if c.startswith("latency_breakdown."))


def plot_latency(df: pd.DataFrame, order: dict[str, list[str]] | None = None):
    """Stacked bars: seconds per token by component (``latency_breakdown``), one bar per run. None when no run
    has a breakdown."""
    done = complete(df)
    comps = [c for c in latency_columns(done) if pd.to_numeric(done[c], errors="coerce").notna().any()]
    if not comps:
        return None
    plt = _plt()
    done = done[done[comps].notna().any(axis=1)]
    multi_data = done["data_name"].nunique() > 1
    labels = [f"{v}\n{d}" if multi_data else str(v) for v, d in zip(done["variant"], done["data_name"])]
    rank_v = {v: i for i, v in enumerate(_variants(done, order))}
    rank_d = {d: i for i, d in enumerate(_datasets(done, order))}
    bars = sorted(range(len(labels)), key=lambda i: (rank_v[str(done["variant"].iloc[i])],
                                                      rank_d.get(str(done["data_name"].iloc[i]), -1), labels[i]))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.0 + 0.9 * len(labels)), 3.8))
    bottom = [0.0] * len(bars)
    for c in comps:
        vals = [float(pd.to_numeric(pd.Series([done[c].iloc[i]]), errors="coerce").fillna(0.0).iloc[0]) for i in bars]
        ax.bar(range(len(bars)), vals, bottom=bottom, label=c[len("latency_breakdown."):])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([labels[i] for i in bars], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("seconds per token")
    ax.set_title("latency breakdown")
    ax.legend(title="component", fontsize=8, title_fontsize=8)
    fig.tight_layout()
    return fig


def pareto_front(points: Sequence[tuple[float, float]], lower_y_better: bool = False) -> list[int]:
    """Indices of the points not dominated by another (smaller x is better; larger y, or smaller y when
    ``lower_y_better``), ordered by x."""
    sign = -1.0 if lower_y_better else 1.0
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -sign * points[i][1]))
    front, best = [], -math.inf
    for i in order:
        y = sign * points[i][1]
        if y > best:
            front.append(i)
            best = y
    return front


def plot_accuracy_vs_kv(df: pd.DataFrame, metric: str = HEADLINE, order: dict[str, list[str]] | None = None):
    """One point per run: ``metric`` against the measured ``kv_ratio``, one panel per dataset, the Pareto front
    (less memory, better metric) drawn as a dashed step line."""
    plt = _plt()
    _need_columns(df, ["kv_ratio"], "kv_ratio")
    done = complete(df)
    col = _value_column(df, metric)
    datasets = _datasets(done, order) or ["-"]
    variants = _variants(done, order)
    colors = {v: f"C{i % 10}" for i, v in enumerate(variants)}
    # shapes and shrinking sizes keep runs that land on the same point (same kv_ratio and score) visible
    markers = {v: "osD^vPX*<>"[i % 10] for i, v in enumerate(variants)}
    sizes = {v: max(28.0, 110.0 - 22.0 * i) for i, v in enumerate(variants)}
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets) + 1.5, 3.6), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        sub = done[done["data_name"] == d] if d != "-" else done
        xs = pd.to_numeric(sub["kv_ratio"], errors="coerce").tolist()
        ys = pd.to_numeric(sub[col], errors="coerce").tolist()
        vs = sub["variant"].astype(str).tolist()
        pts = [(x, y, v) for x, y, v in zip(xs, ys, vs) if not (_isnull(x) or _isnull(y))]
        for v in variants:
            mine = [(x, y) for x, y, w in pts if w == v]
            if mine:
                ax.scatter([p[0] for p in mine], [p[1] for p in mine], color=colors[v], marker=markers[v],
                           s=sizes[v], label=v, zorder=3, edgecolors="white", linewidths=0.5)
        front = pareto_front([(x, y) for x, y, _ in pts], _lower_is_better(sub, metric))
        if front:
            fx = [pts[i][0] for i in front]
            fy = [pts[i][1] for i in front]
            ax.step(fx, fy, where="post", linestyle="--", color="black", alpha=0.6, label="Pareto front", zorder=2)
            ax.scatter(fx, fy, s=200, facecolors="none", edgecolors="black", zorder=4)
        ax.set_title(d)
        ax.set_xlabel("kv_ratio (KV held / full attention)")
        ax.set_ylabel(_metric_name(sub, metric))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{_metric_name(df, metric)} vs measured KV memory")
    fig.tight_layout()
    return fig


def figures(df: pd.DataFrame, metric: str = HEADLINE, x: str | None = None, hue: str = "method_name",
            order: dict[str, list[str]] | None = None) -> dict:
    """All plots that apply to these runs: {file name: Figure}; panels, bars and legends in ``order`` (the
    sweep's, see ``sweep_order``) where it lists their values."""
    out: dict[str, Any] = {}
    done = complete(df)
    if done.empty:
        return out
    tag = metric.replace("/", "_")
    out[f"{tag}_by_method.png"] = plot_headline(df, metric, order)
    x = x or default_x(df, hue)
    if x is not None:
        out[f"{tag}_vs_{x}.png"] = plot_metric_vs(df, x, metric, hue, order)
    lat = plot_latency(df, order)
    if lat is not None:
        out["latency_breakdown.png"] = lat
    if "kv_ratio" in done.columns and pd.to_numeric(done["kv_ratio"], errors="coerce").notna().any():
        out[f"{tag}_vs_kv_ratio.png"] = plot_accuracy_vs_kv(df, metric, order)
    return out


def save_figure(fig, path: Path) -> None:
    # No metadata (software version) in the PNG: the same runs give byte-identical files.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    _plt().close(fig)


# ---------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------

def _csv(df: pd.DataFrame, path: Path, index: bool = False) -> None:
    df.to_csv(path, index=index, float_format="%.10g", lineterminator="\n")


def build(folder: str | Path, rows: Sequence[str] = ("data_name",), cols: Sequence[str] = ("method_name",),
          metric: str | Sequence[str] = HEADLINE, filters: dict[str, str] | None = None, x: str | None = None,
          hue: str = "method_name", out: str | Path | None = None, plots: bool = True,
          echo: bool = True) -> dict[str, Any]:
    """Write the report of ``folder`` into ``out`` (default ``<folder>/report``). Returns the tables, the
    figures' paths and the missing runs."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"{folder} is not a folder; give a sweep folder (results/sweeps/<name>) or a run folder")
    out = Path(out) if out else folder / "report"
    runs, missing = load_runs(folder)
    if runs.empty:
        raise ReportError(f"no run folders (config.yaml + metrics.json) below {folder}")
    out.mkdir(parents=True, exist_ok=True)
    _csv(runs, out / "runs.csv")
    _csv(missing, out / "missing.csv")
    sel = apply_filters(runs, filters or {})
    metrics = metric_list(metric)
    tag = "-".join(metrics).replace("/", "_")
    order = sweep_order(folder)
    table = pivot(sel, rows, cols, metrics, order)
    strings = pivot_strings(sel, table, rows, cols, metrics, order)
    note = headline_note(sel, metrics)
    n_done = int((sel["status"] == "complete").sum())
    counts = cell_counts(sel, rows, cols) if rows else []
    if len(counts) and int(counts.max()) > 1:
        note += (f"; some cells average up to {int(counts.max())} runs (a setting not on the axes differs: add it "
                 "to --rows/--cols or pick one with --filter)")
    if filters:
        note += "; runs with " + ", ".join(f"{k}={v}" for k, v in filters.items())
    note += f"; {n_done} complete run(s), {len(sel) - n_done} missing"
    written = [out / "runs.csv", out / "missing.csv"]
    (out / f"pivot_{tag}.md").write_text(to_markdown(strings, note), encoding="utf-8")
    _csv(table, out / f"pivot_{tag}.csv", index=True) if not table.empty else _csv(strings, out / f"pivot_{tag}.csv", True)
    (out / f"pivot_{tag}.tex").write_text(to_latex(strings, note), encoding="utf-8")
    written += [out / f"pivot_{tag}.{e}" for e in ("md", "csv", "tex")]
    figs = {}
    if plots:
        for name, fig in figures(sel, metrics[0], x, hue, order).items():
            save_figure(fig, out / name)
            figs[name] = out / name
            written.append(out / name)
    if echo:
        print(to_markdown(strings, note))
        if len(missing):
            print(f"{len(missing)} run(s) without complete metrics (listed in {out / 'missing.csv'}):")
            for _, m in missing.iterrows():
                print(f"  {m['run']}: {m['status']} ({m['items_done']} items done) "
                      f"[{m['method_name']} / {m['data_name']}]")
        print(f"{len(runs)} run(s) read; wrote {', '.join(p.name for p in written)} to {out}")
    return {"runs": runs, "missing": missing, "pivot": table, "pivot_strings": strings, "figures": figs,
            "out": out}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m luka_bench.report",
                                description="Tables and plots of every run folder below a folder.")
    p.add_argument("folder", help="a sweep folder (results/sweeps/<name>), results/, or any folder of runs")
    p.add_argument("--rows", default="data_name", help="pivot rows: column(s), comma-separated (default data_name)")
    p.add_argument("--cols", default="method_name",
                   help="pivot columns (default method_name; '' for none: one column per metric)")
    p.add_argument("--metric", default=HEADLINE,
                   help="cell value: 'headline' (each dataset's headline metric) or runs.csv column(s), e.g. f1 or "
                        "em_lenient,f1,kv_ratio (several: one column group per metric; plots use the first)")
    p.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE",
                   help="only runs with this value (repeatable), e.g. --filter method.budget=0.25")
    p.add_argument("--x", default=None, help="x axis of the line plot (default: method.budget if it varies)")
    p.add_argument("--hue", default="method_name", help="one line per value of this column (default method_name)")
    p.add_argument("--out", default=None, help="output folder (default <folder>/report)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    a = p.parse_args(argv)
    try:
        build(a.folder, rows=[s for s in a.rows.split(",") if s], cols=[s for s in a.cols.split(",") if s],
              metric=a.metric, filters=parse_filters(a.filter), x=a.x, hue=a.hue, out=a.out, plots=not a.no_plots)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
