"""The needle-in-a-haystack heat map: needle depth x context length, one panel per method, cells the mean NIAH
score (0-100) of the samples in that cell, green = found, red = missed, the method's mean score in its panel
title. ``python -m luka_bench.report <folder>`` draws it (``niah_heatmap.png``) when runs below the folder have
``data=niah`` predictions; :func:`niah_cells` gives the numbers as tables.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

__all__ = ["niah_cells", "plot_niah_heatmap", "niah_figures"]


def _records(pred_file: Path) -> list[dict]:
    out = []
    with open(pred_file, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                meta = r.get("meta") or {}
                if "depth" in meta and "length" in meta and "niah" in (r.get("scores") or {}):
                    out.append({"depth": float(meta["depth"]), "length": int(meta["length"]),
                                "score": float(r["scores"]["niah"])})
    return out


def niah_cells(folder: str | Path, runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """{method: table of mean NIAH score, rows = depth (%), columns = length (tokens)} for every complete run in
    ``runs`` (``luka_bench.tables.load_runs`` rows; ``run`` relative to ``folder``) whose predictions carry NIAH
    scores. Several runs of one method (a resumed or repeated sweep) are pooled."""
    folder = Path(folder)
    pooled: dict[str, list[dict]] = {}
    if runs.empty or "run" not in runs.columns:
        return {}
    for _, row in runs.iterrows():
        if row.get("status") != "complete":
            continue
        pred = folder / str(row["run"]) / "predictions.jsonl"
        if not pred.is_file():
            continue
        recs = _records(pred)
        if recs:
            pooled.setdefault(str(row.get("method_name", row["run"])), []).extend(recs)
    out = {}
    for method, recs in pooled.items():
        df = pd.DataFrame(recs)
        out[method] = df.pivot_table(index="depth", columns="length", values="score", aggfunc="mean").sort_index()
    return out


def plot_niah_heatmap(cells: dict[str, pd.DataFrame], order: list[str] | None = None):
    """One panel per method (``order`` first, then the rest by name), RdYlGn from 0 to 100, every cell
    annotated, the mean over the method's cells in the title."""
    from luka_bench.plots import pyplot

    plt = pyplot()
    methods = [m for m in (order or []) if m in cells] + sorted(m for m in cells if m not in (order or []))
    n = len(methods)
    width = max(3.2, 0.9 * max(t.shape[1] for t in cells.values()) + 1.6)
    fig, axes = plt.subplots(1, n, figsize=(width * n + 1.0, 0.45 * max(t.shape[0] for t in cells.values()) + 2.0),
                             squeeze=False, sharey=False, constrained_layout=True)
    im = None
    for ax, m in zip(axes[0], methods):
        t = cells[m]
        im = ax.imshow(t.to_numpy(dtype=float), cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        ax.set_xticks(range(t.shape[1]), [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in t.columns])
        ax.set_yticks(range(t.shape[0]), [f"{d:g}%" for d in t.index])
        ax.set_xlabel("length (tokens)")
        if ax is axes[0][0]:
            ax.set_ylabel("needle depth")
        for i in range(t.shape[0]):
            for j in range(t.shape[1]):
                v = t.iat[i, j]
                if pd.notna(v):
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8)
        ax.set_title(f"{m} (mean {t.stack().mean():.1f})", fontsize=10)
    if im is not None:
        fig.colorbar(im, ax=list(axes[0]), shrink=0.9, label="NIAH score (0-100)")
    return fig


def niah_figures(folder: str | Path, runs: pd.DataFrame, order: list[str] | None = None) -> dict:
    """``{"niah_heatmap.png": Figure}`` when runs below ``folder`` have NIAH predictions, else ``{}``."""
    cells = niah_cells(folder, runs)
    return {"niah_heatmap.png": plot_niah_heatmap(cells, order)} if cells else {}
