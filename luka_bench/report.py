"""``python -m luka_bench.report <folder>``: every run folder below ``<folder>`` -> one pandas table, pivot
tables (Markdown, CSV, LaTeX) and plots (PNG), written to ``<folder>/report/``. The tables are
``luka_bench.tables``, the plots ``luka_bench.plots``; this module is the command that writes them.

Outputs carry no times and rows are sorted by run path, so re-running the report gives the same files.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from luka_bench.plots import figures, save_figure
from luka_bench.tables import (HEADLINE, SE_NOTE, ReportError, apply_filters, cell_counts, headline_note, load_runs,
                               metric_list, paired_strings, parse_filters, pivot, pivot_strings, sweep_order,
                               to_latex, to_markdown)

def _csv(df: pd.DataFrame, path: Path, index: bool = False) -> None:
    df.to_csv(path, index=index, float_format="%.10g", lineterminator="\n")


def _print_missing(missing: pd.DataFrame, out: Path) -> None:
    print(f"{len(missing)} run(s) without complete metrics (listed in {out / 'missing.csv'}):")
    for _, m in missing.iterrows():
        print(f"  {m['run']}: {m['status']} ({m['items_done']} items done) [{m['method_name']} / {m['data_name']}]")


def build(folder: str | Path, rows: Sequence[str] = ("data_name",), cols: Sequence[str] = ("method_name",),
          metric: str | Sequence[str] = HEADLINE, filters: dict[str, str] | None = None, x: str | None = None,
          hue: str = "method_name", out: str | Path | None = None, plots: bool = True,
          echo: bool = True, paired: str | None = None) -> dict[str, Any]:
    """Write the report of ``folder`` into ``out`` (default ``<folder>/report``). Returns the tables, the
    figures' paths and the missing runs. ``paired``: a method name; adds the table of every run's paired
    difference to that method's run on the same items (``pivot_paired_<method>_<metric>``)."""
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
    if not (runs["status"] == "complete").any():  # nothing to tabulate: say which jobs are missing, and stop
        if echo:
            _print_missing(missing, out)
        raise ReportError(f"no complete run below {folder} yet ({len(runs)} run folder(s), none with a complete "
                          "metrics.json; listed above and in missing.csv): finish or re-run the sweep, then report")
    sel = apply_filters(runs, filters or {})
    metrics = metric_list(metric)
    tag = "-".join(metrics).replace("/", "_")
    order = sweep_order(folder)
    table = pivot(sel, rows, cols, metrics, order)
    strings = pivot_strings(sel, table, rows, cols, metrics, order)
    note = headline_note(sel, metrics) + "; " + SE_NOTE
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
    paired_md = ""
    if paired:
        diffs = paired_strings(sel, folder, paired, rows, cols, metrics[0], order)
        what = "each dataset's headline metric" if metrics[0] == HEADLINE else metrics[0]
        pnote = (f"cells: {what} minus {paired}'s on the same items (same model and data settings), mean ± "
                 "standard error of the paired differences (n = shared items), clustered by example"
                 + ("; perplexity: the difference of log perplexity (NLL per token), n = shared 256-token blocks where "
                    "the runs recorded them (clustered by document; one document: by block)"
                    if metrics[0] == "perplexity" else ""))
        paired_md = to_markdown(diffs, pnote)
        ptag = f"pivot_paired_{paired}_{metrics[0]}".replace("/", "_")
        (out / f"{ptag}.md").write_text(paired_md, encoding="utf-8")
        _csv(diffs, out / f"{ptag}.csv", index=True)
        written += [out / f"{ptag}.md", out / f"{ptag}.csv"]
    figs = {}
    if plots:
        for name, fig in figures(sel, metrics[0], x, hue, order, missing=len(missing)).items():
            save_figure(fig, out / name)
            figs[name] = out / name
            written.append(out / name)
        from luka_bench.niah_plot import niah_figures  # depth x length heat map when runs have NIAH results

        for name, fig in niah_figures(folder, sel, (order or {}).get("method_name")).items():
            save_figure(fig, out / name)
            figs[name] = out / name
            written.append(out / name)
    if echo:
        print(to_markdown(strings, note))
        if paired_md:
            print(paired_md)
        if len(missing):
            _print_missing(missing, out)
        print(f"{len(runs)} run(s) read; wrote {', '.join(p.name for p in written)} to {out}")
    return {"runs": runs, "missing": missing, "pivot": table, "pivot_strings": strings, "figures": figs,
            "out": out, "paired": paired_md}


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
    p.add_argument("--paired", default=None, metavar="REF",
                   help="also a table of each method's paired difference to method REF on the same items, ± SE")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    a = p.parse_args(argv)
    try:
        build(a.folder, rows=[s for s in a.rows.split(",") if s], cols=[s for s in a.cols.split(",") if s],
              metric=a.metric, filters=parse_filters(a.filter), x=a.x, hue=a.hue, out=a.out, plots=not a.no_plots,
              paired=a.paired)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
