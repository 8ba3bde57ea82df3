"""Plots of a runs table (``luka_bench.tables.load_runs``): grouped bars of a metric, a metric against a swept
setting, the latency breakdown, and a metric against the measured KV ratio with its Pareto front. Agg backend;
each function returns its matplotlib Figure (tests read its axes and legends); ``save_figure`` writes a PNG
without metadata, so the same runs give byte-identical files."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from luka_bench.tables import (HEADLINE, LOWER_IS_BETTER, complete, config_columns, distinct, fmt_value, is_identity,
                               isnull, need_columns, sort_key, value_column)

def pyplot():
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
    return sorted(done["data_name"].dropna().astype(str).unique(), key=lambda d: sort_key(d, ["data_name"], order))


def _variants(done: pd.DataFrame, order: dict[str, list[str]] | None) -> list[str]:
    """The variants (legend labels) of these runs: by method in the sweep's order, then by label."""
    method = dict(zip(done["variant"].astype(str), done.get("method_name", done["variant"]).astype(str)))
    return sorted(method, key=lambda v: (sort_key(method[v], ["method_name"], order), v))


def plot_headline(df: pd.DataFrame, metric: str = HEADLINE, order: dict[str, list[str]] | None = None):
    """Grouped bars: one group per dataset, one bar per variant (method + its differing settings)."""
    plt = pyplot()
    done = complete(df)
    col = value_column(df, metric)
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
        ax.bar_label(bars, labels=[fmt_value(y) for y in ys], fontsize=7, padding=1)
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
    cands = [c for c in config_columns(done) if is_identity(c) and not c.endswith("_name")]
    group = [c for c in (hue, "data_name") if c in done.columns]

    def swept(c: str) -> bool:
        if not group:
            return len(distinct(done[c])) > 1
        return any(len(distinct(g[c])) > 1 for _, g in done.groupby(group, dropna=False))

    numeric = [c for c in cands if pd.api.types.is_numeric_dtype(done[c]) and not pd.api.types.is_bool_dtype(done[c])
               and swept(c)]
    if "method.budget" in numeric:
        return "method.budget"
    return numeric[0] if numeric else None


def plot_metric_vs(df: pd.DataFrame, x: str, metric: str = HEADLINE, hue: str = "method_name",
                   order: dict[str, list[str]] | None = None):
    """Lines: ``metric`` against the setting ``x``, one line per value of ``hue``, one panel per dataset."""
    plt = pyplot()
    need_columns(df, [x, hue], "--x/--hue")
    done = complete(df)
    col = value_column(df, metric)
    datasets = _datasets(done, order) or ["-"]
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets) + 1.2, 3.4), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        sub = done[done["data_name"] == d] if d != "-" else done
        for h in sorted(sub[hue].dropna().unique(), key=lambda h: (sort_key(str(h), [hue], order), str(h))):
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
    plt = pyplot()
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
    plt = pyplot()
    need_columns(df, ["kv_ratio"], "kv_ratio")
    done = complete(df)
    col = value_column(df, metric)
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
        pts = [(x, y, v) for x, y, v in zip(xs, ys, vs) if not (isnull(x) or isnull(y))]
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
    pyplot().close(fig)
