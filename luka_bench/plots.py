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


def _se_column(df: pd.DataFrame, col: str) -> pd.Series:
    """The standard errors of ``col`` (``<col>_se`` of ``load_runs``), NaN where a run has none."""
    se = f"{col}_se"
    return pd.to_numeric(df[se], errors="coerce") if se in df.columns else pd.Series(float("nan"), index=df.index)


def _cell(done: pd.DataFrame, col: str) -> tuple[float, float, float]:
    """(mean, SE, items) of the runs in ``done``: one run's own; several runs' mean, sqrt(sum SE^2)/k, sum."""
    y = pd.to_numeric(done[col], errors="coerce")
    se = _se_column(done, col)
    n = pd.to_numeric(done[f"{col}_n"], errors="coerce") if f"{col}_n" in done.columns else se * float("nan")
    if not y.notna().any():
        return float("nan"), float("nan"), float("nan")
    from luka_bench.tables import _se_of_mean

    has = y.notna()
    return float(y.mean()), _se_of_mean(se[has]), float(n[has].sum(min_count=int(has.sum())))


def _value_label(y: float, se: float) -> str:
    """A bar's label at the precision its SE supports (``0.74±0.05``); a value without an SE at 3 digits."""
    from luka_bench.tables import se_decimals

    if isnull(se) or se == 0:
        return f"{y:.3g}" + ("±0" if se == 0 else "")
    d = se_decimals(se)
    return f"{y:.{d}f}±{se:.{d}f}"


def _footnote(fig, lines: list[str]) -> None:
    if lines:
        fig.text(0.01, 0.005, "\n".join(lines), fontsize=7, color="0.3", ha="left", va="bottom")


def plot_headline(df: pd.DataFrame, metric: str = HEADLINE, order: dict[str, list[str]] | None = None,
                  missing: int = 0):
    """Bars with ± SE error bars: one panel per dataset (its own metric and y axis: perplexity ~30 and a score
    in 0-1 never share one), one bar per variant with a result there (runs without results are left out and
    counted in a footnote; ``missing.csv`` lists them). Each bar is labelled with its value at the precision
    its SE supports; a bar of height 0 is drawn as a thick line at 0 with its label. One legend for the
    figure, outside the panels."""
    plt = pyplot()
    done = complete(df)
    col = value_column(df, metric)
    datasets = _datasets(done, order) or ["-"]
    variants = _variants(done, order)
    colors = {v: f"C{i % 10}" for i, v in enumerate(variants)}
    heads = done.groupby("data_name")["headline"].first() if "headline" in done.columns else {}
    fig, axes = plt.subplots(1, len(datasets), figsize=(0.9 + sum(0.55 * len(variants) + 1.3 for _ in datasets),
                                                        4.0), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        sub = done[done["data_name"] == d] if d != "-" else done
        cells = [(v, *_cell(sub[sub["variant"] == v], col)) for v in variants]
        cells = [c for c in cells if not isnull(c[1])]  # no result here: no bar (listed as missing)
        xs = list(range(len(cells)))
        ys = [c[1] for c in cells]
        es = [0.0 if isnull(c[2]) else c[2] for c in cells]
        ax.bar(xs, ys, width=0.7, color=[colors[c[0]] for c in cells], yerr=es, capsize=3,
               error_kw={"elinewidth": 1, "ecolor": "0.25"})
        for x, (v, y, e, _) in zip(xs, cells):
            if y == 0:  # a zero bar has no area: a thick line in its colour keeps it visible
                ax.hlines(0, x - 0.35, x + 0.35, colors=colors[v], linewidth=3, zorder=3)
        top = max([y + e for y, e in zip(ys, es)] + [0.0])
        bottom = min([y - e for y, e in zip(ys, es)] + [0.0])
        span = (top - bottom) or 1.0
        for x, (v, y, e, _) in zip(xs, cells):  # vertical labels above each bar: never wider than the bar
            ax.text(x, max(y, 0) + (0 if isnull(e) else e) + 0.02 * span, _value_label(y, e), rotation=90,
                    ha="center", va="bottom", fontsize=7)
        ax.set_ylim(min(bottom, 0) - (0.02 * span if bottom < 0 else 0), top + 0.45 * span)
        ax.set_xlim(-0.7, max(len(xs), 3) - 0.3)  # a lone bar stays a bar, not a wall
        ax.set_xticks(xs)
        ax.set_xticklabels([""] * len(xs))
        name = heads[d] if metric == HEADLINE and d in heads else _metric_name(sub, metric)
        ax.set_title(f"{d}\n{name}", fontsize=9)
        ax.set_ylabel(name)
        ax.grid(axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[v]) for v in variants]
    fig.legend(handles, variants, title="method", fontsize=8, title_fontsize=8, loc="upper left",
               bbox_to_anchor=(1.0, 0.95))
    notes = ["bars: mean; error bars: ± standard error (clustered by example for QA)"]
    if missing:
        notes.append(f"{missing} run(s) without results not shown (listed in missing.csv)")
    _footnote(fig, notes)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
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
    hues = sorted(done[hue].dropna().unique(), key=lambda h: (sort_key(str(h), [hue], order), str(h)))
    for ax, d in zip(axes[0], datasets):
        sub = done[done["data_name"] == d] if d != "-" else done
        for i, h in enumerate(hues):
            part = sub[sub[hue] == h].copy()
            part["_x"] = pd.to_numeric(part[x], errors="coerce")
            pts = sorted((float(xv), *_cell(g, col)) for xv, g in part.dropna(subset=["_x"]).groupby("_x"))
            pts = [p for p in pts if not isnull(p[1])]
            if not pts:
                continue
            # shapes and shrinking sizes: lines that coincide (two methods with the same scores) both show
            px, py = [p[0] for p in pts], [p[1] for p in pts]
            ax.errorbar(px, py, yerr=[0 if isnull(p[2]) else p[2] for p in pts], fmt="none", capsize=3,
                        ecolor=f"C{i % 10}", alpha=0.7)
            ax.plot(px, py, marker="osD^vPX*<>"[i % 10], markersize=max(3.0, 8.0 - 1.5 * i), label=str(h),
                    color=f"C{i % 10}", alpha=0.9)
        ax.set_title(d)
        ax.set_xlabel(x)
        ax.set_ylabel(_metric_name(sub, metric))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(title=hue, fontsize=8, title_fontsize=8)
    fig.suptitle(f"{_metric_name(df, metric)} vs {x} (± standard error)")
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
    ax.set_title(f"latency breakdown: {machine_label(done)}", fontsize=9)
    ax.legend(title="component", fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ns = pd.to_numeric(done.get("tpot_s_n", pd.Series(dtype=float)), errors="coerce").dropna()
    n = f"n = {int(ns.min())}-{int(ns.max())} items per bar" if len(ns) and ns.min() != ns.max() else \
        (f"n = {int(ns.iloc[0])} items per bar" if len(ns) else "n = n_examples of each run")
    _footnote(fig, [f"{n}; timed inside these runs, on a machine that may have been shared:",
                    "not a speed comparison; for that use scripts/bench_decode.py (docs: speed)"])
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig


def machine_label(done: pd.DataFrame) -> str:
    """Where the runs ran, from their env.json: host, device (GPU name or CPU) and torch threads; every distinct
    value, so mixed runs say they are mixed."""
    def values(col: str) -> list[str]:
        return sorted({f"{v:g}" if isinstance(v, float) else str(v)
                       for v in done.get(col, pd.Series(dtype=object)).dropna()})

    hosts, gpus, devices = values("env.host"), values("env.cuda"), values("env.device")
    threads = values("env.torch_threads")
    where = "/".join(hosts) or "host unknown"
    dev = "/".join(gpus) if gpus and any(d.startswith("cuda") for d in devices) else ("/".join(devices) or "?")
    return f"{where}, {dev}, {'/'.join(threads) or '?'} thread(s)"


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
        es = _se_column(sub, col).tolist()
        vs = sub["variant"].astype(str).tolist()
        pts = [(x, y, v) for x, y, v in zip(xs, ys, vs) if not (isnull(x) or isnull(y))]
        err = {(x, y, v): e for x, y, v, e in zip(xs, ys, vs, es)}
        for v in variants:
            mine = [(x, y) for x, y, w in pts if w == v]
            if mine:
                ax.errorbar([p[0] for p in mine], [p[1] for p in mine], fmt="none", ecolor=colors[v], capsize=2,
                            yerr=[0 if isnull(err[(x, y, v)]) else err[(x, y, v)] for x, y in mine], zorder=2)
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
    fig.suptitle(f"{_metric_name(df, metric)} vs measured KV memory (± standard error)")
    fig.tight_layout()
    return fig


def figures(df: pd.DataFrame, metric: str = HEADLINE, x: str | None = None, hue: str = "method_name",
            order: dict[str, list[str]] | None = None, missing: int = 0) -> dict:
    """All plots that apply to these runs: {file name: Figure}; panels, bars and legends in ``order`` (the
    sweep's, see ``sweep_order``) where it lists their values."""
    out: dict[str, Any] = {}
    done = complete(df)
    if done.empty:
        return out
    tag = metric.replace("/", "_")
    out[f"{tag}_by_method.png"] = plot_headline(df, metric, order, missing)
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
    fig.savefig(path, dpi=110, metadata={"Software": None}, bbox_inches="tight")  # legends outside the axes
    pyplot().close(fig)
