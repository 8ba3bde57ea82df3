"""luka_bench.report on hand-made run folders (no model): the runs table, pivots with a broken run, options,
every plot (axes and legend entries, not pixels), determinism and the command line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from luka_bench import plots, report, tables

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(root: Path, name: str, method: str, data: str, metrics: dict | None, budget: float = 0.125,
             headline: str = "em_lenient", model: str = "tiny_llama", preds: int = 0) -> Path:
    d = root / name
    d.mkdir(parents=True)
    cfg = {"model": {"_target_": "x.Model", "name": model}, "method": {"_target_": f"x.{method}", "budget": budget},
           "data": {"_target_": "x.Data", "limit": 2}, "seed": 42, "max_new_tokens": None, "prefill_chunk": 0,
           "threads": 1, "progress": False, "model_name": model, "method_name": method, "data_name": data}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    if preds:
        (d / "predictions.jsonl").write_text("".join(json.dumps({"item_id": str(i)}) + "\n" for i in range(preds)))
    if metrics is not None:
        m = {"model": model, "method": method, "data": data, "kind": "qa", "headline": headline, **metrics}
        (d / "metrics.json").write_text(json.dumps(m))
    return d


def qa(em: float, kv: float, lat: dict | None = None) -> dict:
    m = {"em": em, "em_lenient": em + 0.1, "f1": em / 2, "ttft_s": 0.5, "tpot_s": 0.02, "kv_ratio": kv,
         "kv_bytes": {"after_prefill": 100.0, "peak": 120}, "n_examples": 4, "complete": True}
    if lat is not None:
        m["latency_breakdown"] = lat
    return m


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    make_run(root, "data=easy,method=full", "full", "wikisalad_easy", qa(0.6, 1.0, {"attention": 0.01, "rest": 0.02}),
             budget=1.0)
    make_run(root, "data=easy,method=streaming_llm", "streaming_llm", "wikisalad_easy",
             qa(0.3, 0.13, {"attention": 0.004, "rest": 0.02}))
    make_run(root, "data=easy,method=h2o", "h2o", "wikisalad_easy", qa(0.4, 0.14, {"attention": 0.005,
                                                                                     "refinement": 0.001, "rest": 0.02}))
    make_run(root, "data=hard,method=full", "full", "wikisalad_hard", qa(0.5, 1.0), budget=1.0)
    make_run(root, "data=hard,method=streaming_llm", "streaming_llm", "wikisalad_hard", qa(0.1, 0.13))
    # broken: killed before metrics.json (3 items done), and a metrics.json that is not complete
    make_run(root, "data=hard,method=h2o", "h2o", "wikisalad_hard", None, preds=3)
    make_run(root, "data=medium,method=full", "full", "wikisalad_medium", {**qa(0.9, 1.0), "complete": False},
             budget=1.0)
    # things that are not runs: W&B files (with their own config.yaml), the submitit folder
    (root / "data=easy,method=full" / "wandb" / "run-1" / "files").mkdir(parents=True)
    (root / "data=easy,method=full" / "wandb" / "run-1" / "files" / "config.yaml").write_text("a: 1\n")
    (root / ".submitit").mkdir()
    return root


@pytest.fixture(scope="module")
def built(sweep):
    """The report of the sweep, built once (tables and plots)."""
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        res = report.build(sweep)
    return res, buf.getvalue()


def test_runs_table_and_missing(sweep):
    runs, missing = tables.load_runs(sweep)
    assert len(runs) == 7
    assert list(runs["run"]) == sorted(runs["run"])
    assert {"method.budget", "model_name", "em", "kv_bytes.peak", "latency_breakdown.attention", "headline_value",
            "variant", "status"} <= set(runs.columns)
    assert sorted(missing["run"]) == ["data=hard,method=h2o", "data=medium,method=full"]
    row = missing.set_index("run").loc["data=hard,method=h2o"]
    assert row["status"] == "no metrics.json" and row["items_done"] == 3
    assert missing.set_index("run").loc["data=medium,method=full", "status"] == "incomplete metrics.json"


def test_pivot_with_a_broken_run_lists_it_and_builds_tables(sweep, built):
    res, printed = built
    out = sweep / "report"
    t = res["pivot"]
    assert t.loc["wikisalad_easy", "full"] == pytest.approx(0.7)  # the headline: em_lenient = em + 0.1
    assert t.loc["wikisalad_hard", "streaming_llm"] == pytest.approx(0.2)
    md = (out / "pivot_headline.md").read_text()
    assert "missing" in md  # the broken h2o / hard cell
    strings = res["pivot_strings"]
    assert strings.loc["wikisalad_hard", "h2o"] == "missing"
    assert strings.loc["wikisalad_medium", "full"] == "missing"
    assert strings.loc["wikisalad_easy", "h2o"] == "0.5"
    assert "data=hard,method=h2o: no metrics.json (3 items done)" in printed
    miss = (out / "missing.csv").read_text().splitlines()
    assert miss[0].startswith("run,") and len(miss) == 3
    assert len((out / "runs.csv").read_text().splitlines()) == 8
    tex = (out / "pivot_headline.tex").read_text()
    assert "\\begin{tabular}" in tex and "wikisalad\\_easy" in tex and "missing" in tex
    csv = (out / "pivot_headline.csv").read_text()
    assert csv.splitlines()[0].startswith("data_name,")


def test_pivot_options(sweep):
    runs, _ = tables.load_runs(sweep)
    t = tables.pivot(runs, rows=["method_name"], cols=["data_name"], metric="f1")
    assert t.loc["h2o", "wikisalad_easy"] == pytest.approx(0.2)
    sel = tables.apply_filters(runs, tables.parse_filters(["method.budget=0.125"]))
    assert set(sel["method_name"]) == {"streaming_llm", "h2o"}
    with pytest.raises(tables.ReportError, match="no column 'nope'.*available"):
        tables.pivot(runs, rows=["nope"])
    with pytest.raises(tables.ReportError, match="key=value"):
        tables.parse_filters(["method.budget"])


def test_determinism(sweep, built, tmp_path):
    first = {p.name: p.read_bytes() for p in sorted((sweep / "report").iterdir())}
    report.build(sweep, out=tmp_path / "again", echo=False)
    second = {p.name: p.read_bytes() for p in sorted((tmp_path / "again").iterdir())}
    assert first == second
    assert {"runs.csv", "missing.csv", "pivot_headline.md", "pivot_headline.csv", "pivot_headline.tex",
            "headline_by_method.png", "latency_breakdown.png", "headline_vs_kv_ratio.png"} <= set(first)
    assert "headline_vs_method.budget.png" not in first  # no method was run at two budgets: no line plot


def legend_texts(ax) -> list[str]:
    leg = ax.get_legend()
    assert leg is not None
    return [t.get_text() for t in leg.get_texts()]


def test_plot_files_are_pngs(built):
    res, _ = built
    assert res["figures"]
    for path in res["figures"].values():
        data = Path(path).read_bytes()
        assert data[:8] == PNG_MAGIC
        from PIL import Image

        with Image.open(path) as im:
            im.verify()


def test_headline_bars(sweep):
    runs, _ = tables.load_runs(sweep)
    fig = plots.plot_headline(runs)
    easy, hard = fig.axes
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["full", "h2o", "streaming_llm"]
    assert [ax.get_title().split("\n")[0] for ax in fig.axes] == ["wikisalad_easy", "wikisalad_hard"]
    assert "em_lenient" in easy.get_ylabel()
    assert len(easy.patches) == 3 and len(hard.patches) == 2  # the h2o/hard run has no result: no bar
    heights = {round(p.get_height(), 6) for ax in fig.axes for p in ax.patches}
    assert heights == {0.7, 0.4, 0.5, 0.6, 0.2}


def test_metric_vs_setting_lines(sweep):
    runs, _ = tables.load_runs(sweep)
    assert plots.default_x(runs) is None  # budgets differ only between methods: nothing to draw lines through
    fig = plots.plot_metric_vs(runs, x="method.budget", metric="em", hue="method_name")
    assert [ax.get_title() for ax in fig.axes] == ["wikisalad_easy", "wikisalad_hard"]
    easy = fig.axes[0]
    assert easy.get_xlabel() == "method.budget" and easy.get_ylabel() == "em"
    assert legend_texts(easy) == ["full", "h2o", "streaming_llm"]
    line = {ln.get_label(): ln for ln in easy.get_lines()}["streaming_llm"]
    assert list(line.get_xdata()) == [0.125] and list(line.get_ydata()) == [pytest.approx(0.3)]


def test_latency_breakdown_stacked(sweep):
    runs, _ = tables.load_runs(sweep)
    fig = plots.plot_latency(runs)
    (ax,) = fig.axes
    assert legend_texts(ax) == ["attention", "refinement", "rest"]
    assert ax.get_ylabel() == "seconds per token"
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert len(labels) == 3  # only the runs that have a breakdown
    # stacked: the attention part of 'full' starts at 0 and 'rest' sits on top of it
    assert len(ax.patches) == 3 * 3


def test_latency_plot_skipped_without_breakdown(tmp_path):
    make_run(tmp_path, "a", "full", "wikisalad_easy", qa(0.5, 1.0), budget=1.0)
    runs, _ = tables.load_runs(tmp_path)
    assert plots.plot_latency(runs) is None
    res = report.build(tmp_path, echo=False)
    assert "latency_breakdown.png" not in res["figures"]
    assert not (tmp_path / "report" / "latency_breakdown.png").exists()


def test_accuracy_vs_kv_with_pareto_front(sweep):
    runs, _ = tables.load_runs(sweep)
    fig = plots.plot_accuracy_vs_kv(runs)
    easy = fig.axes[0]
    assert easy.get_title() == "wikisalad_easy"
    assert easy.get_xlabel().startswith("kv_ratio")
    assert legend_texts(easy) == ["full", "h2o", "streaming_llm", "Pareto front"]
    front = [ln for ln in easy.get_lines() if ln.get_label() == "Pareto front"][0]
    # streaming (0.13, 0.4) -> h2o (0.14, 0.5) -> full (1.0, 0.7): all three are on the front
    assert list(front.get_xdata()) == [0.13, 0.14, 1.0]
    hard = fig.axes[1]
    assert legend_texts(hard) == ["full", "streaming_llm", "Pareto front"]


def test_pareto_front():
    pts = [(1.0, 0.7), (0.13, 0.4), (0.14, 0.3), (0.5, 0.4), (0.14, 0.5)]
    assert plots.pareto_front(pts) == [1, 4, 0]
    # perplexity: lower is better
    assert plots.pareto_front([(1.0, 10.0), (0.2, 12.0), (0.3, 15.0)], lower_y_better=True) == [1, 0]


def test_budget_sweep_labels_and_lines(tmp_path):
    make_run(tmp_path, "a", "streaming_llm", "wikisalad_easy", qa(0.3, 0.25), budget=0.25)
    make_run(tmp_path, "b", "streaming_llm", "wikisalad_easy", qa(0.2, 0.13), budget=0.125)
    make_run(tmp_path, "c", "full", "wikisalad_easy", qa(0.5, 1.0), budget=1.0)
    runs, _ = tables.load_runs(tmp_path)
    assert list(runs["variant"]) == ["streaming_llm budget=0.25", "streaming_llm budget=0.125", "full"]
    assert plots.default_x(runs) == "method.budget"
    res = report.build(tmp_path, echo=False)
    assert "headline_vs_method.budget.png" in res["figures"]
    fig = plots.plot_metric_vs(runs, x="method.budget", metric="em")
    line = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}["streaming_llm"]
    assert list(line.get_xdata()) == [0.125, 0.25] and list(line.get_ydata()) == [pytest.approx(0.2), pytest.approx(0.3)]


def test_command_line(sweep, tmp_path, capsys):
    out = tmp_path / "cli"
    assert report.main([str(sweep), "--metric", "f1", "--rows", "method_name", "--cols", "data_name", "--no-plots",
                        "--filter", "model_name=tiny_llama", "--out", str(out)]) == 0
    assert (out / "pivot_f1.md").exists() and "| method_name \\ data_name" in capsys.readouterr().out
    assert report.main([str(sweep), "--rows", "nope", "--no-plots", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope" in err and len(err.strip().splitlines()) == 1
    assert report.main([str(tmp_path / "no-such-folder")]) == 2
    assert "not a folder" in capsys.readouterr().err
    # the module runs as a command
    p = subprocess.run([sys.executable, "-m", "luka_bench.report", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "--filter" in p.stdout


def test_several_metrics_in_one_table(sweep, tmp_path):
    runs, _ = tables.load_runs(sweep)
    t = tables.pivot(runs, rows=["method_name"], cols=[], metric="kv_ratio,em")
    assert list(t.columns) == ["kv_ratio", "em"]  # in the order asked for
    assert t.loc["h2o", "em"] == pytest.approx(0.4)
    assert t.loc["full", "em"] == pytest.approx(0.55)  # easy and hard averaged (the note says so)
    t2 = tables.pivot(runs, rows=["method_name"], cols=["data_name"], metric="em,f1")
    assert t2.loc["streaming_llm", ("wikisalad_hard", "f1")] == pytest.approx(0.05)
    strings = tables.pivot_strings(runs, t2, ["method_name"], ["data_name"], "em,f1")
    assert strings.loc["h2o", "wikisalad_hard / em"] == "missing"
    # the metrics of one setting side by side (em_lenient with its kv_ratio), settings in order
    assert list(strings.columns)[:4] == ["wikisalad_easy / em", "wikisalad_easy / f1", "wikisalad_hard / em",
                                         "wikisalad_hard / f1"]
    res = report.build(sweep, rows=["method_name"], cols=[], metric="em,kv_ratio", out=tmp_path / "r", plots=False,
                       echo=False)
    md = (tmp_path / "r" / "pivot_em-kv_ratio.md").read_text()
    assert md.splitlines()[0].replace(" ", "") == "|method_name\\metric|em|kv_ratio|"
    assert "average up to 2 runs" in md and res["pivot"].shape == (3, 2)


def test_rows_and_columns_follow_the_sweep_command(tmp_path):
    # the sweep listed data hard before easy and methods h2o before full: the tables keep that order
    root = tmp_path / "s"
    for data in ("wikisalad_easy", "wikisalad_hard"):
        for method, kv in (("full", 1.0), ("h2o", 0.13)):
            make_run(root, f"data={data},method={method}", method, data, qa(0.5, kv))
    (root / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"params": {"method": "h2o,full"}},
        "overrides": {"task": ["data=wikisalad_hard,wikisalad_easy", "threads=1"]}}}))
    assert tables.sweep_order(root) == {"method_name": ["h2o", "full"],
                                        "data_name": ["wikisalad_hard", "wikisalad_easy"]}
    res = report.build(root, metric="em_lenient,kv_ratio", plots=False, echo=False)
    assert list(res["pivot_strings"].index) == ["wikisalad_hard", "wikisalad_easy"]
    assert list(res["pivot_strings"].columns) == ["h2o / em_lenient", "h2o / kv_ratio", "full / em_lenient",
                                                  "full / kv_ratio"]
    assert list(res["pivot"].index) == ["wikisalad_hard", "wikisalad_easy"]
    assert res["pivot"].loc["wikisalad_hard", ("h2o", "kv_ratio")] == pytest.approx(0.13)
    # plots too: panels in the sweep's data order, legend in its method order
    runs, _ = tables.load_runs(root)
    fig = plots.plot_accuracy_vs_kv(runs, "em_lenient", tables.sweep_order(root))
    assert [ax.get_title() for ax in fig.axes] == ["wikisalad_hard", "wikisalad_easy"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()][:2] == ["h2o", "full"]
    # without multirun.yaml: alphabetical
    (root / "multirun.yaml").unlink()
    res = report.build(root, metric="em_lenient", plots=False, echo=False)
    assert list(res["pivot_strings"].index) == ["wikisalad_easy", "wikisalad_hard"]
    assert list(res["pivot_strings"].columns) == ["full", "h2o"]


# ---------------------------------------------------------------------------------------------------------
# Issue 26: uncertainty (± SE clustered by example, n), --paired, plots of a mixed folder, the latency label
# ---------------------------------------------------------------------------------------------------------

def make_scored_run(root: Path, name: str, method: str, data: str, scores: dict[str, list[float]],
                    kv: float = 1.0, model: str = "tiny_llama", extra: dict | None = None) -> Path:
    """A QA run whose predictions hold per-question ``em_lenient`` scores: {example id: [score per question]};
    its metrics.json says what the runner would (the mean over questions)."""
    recs = [{"item_id": f"{ex}/q{i}", "example_id": ex, "scores": {"em_lenient": s}, "ttft_s": 0.1, "tpot_s": 0.01}
            for ex, ss in scores.items() for i, s in enumerate(ss)]
    mean = sum(r["scores"]["em_lenient"] for r in recs) / len(recs)
    d = make_run(root, name, method, data, {**qa(mean - 0.1, kv), "em_lenient": mean, "n_examples": len(recs),
                                            **(extra or {})}, model=model)
    (d / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "env.json").write_text(json.dumps({"host": "box1", "device": "cpu", "cuda": None, "torch_threads": 1,
                                            "platform": "Linux"}))
    return d


def test_cluster_se_counts_an_example_once():
    import statistics

    from luka_bench.stats import mean_se

    # questions of one example answered alike: the examples, not the questions, are the independent draws
    per_example = [0.0, 1.0, 1.0, 0.0, 1.0]
    vals = [v for v in per_example for _ in range(4)]
    clusters = [str(i) for i, _ in enumerate(per_example) for _ in range(4)]
    got = mean_se(vals, clusters)
    assert got["n"] == 20 and got["clusters"] == 5
    assert got["se"] == pytest.approx(statistics.stdev(per_example) / len(per_example) ** 0.5)
    naive = mean_se(vals)  # one cluster per item: s / sqrt(n)
    assert naive["se"] == pytest.approx(statistics.stdev(vals) / len(vals) ** 0.5)
    assert got["se"] > 1.5 * naive["se"]  # treating questions as independent understates the error
    assert mean_se([1.0], ["a"])["se"] is None  # one cluster: undefined (None, valid JSON), not 0


def test_perplexity_se_is_zero_for_identical_documents_and_grows_with_spread():
    from luka_bench.stats import perplexity_se

    same = perplexity_se([{"nll_sum": 30.0, "n_tokens": 10}] * 3)
    spread = perplexity_se([{"nll_sum": 20.0, "n_tokens": 10}, {"nll_sum": 40.0, "n_tokens": 10},
                            {"nll_sum": 30.0, "n_tokens": 10}])
    assert same["mean"] == pytest.approx(spread["mean"]) and same["se"] == pytest.approx(0.0)
    assert spread["se"] > 0 and spread["n"] == 3
    assert same["unit"] == spread["unit"] == "documents"


def test_one_document_perplexity_gets_its_se_from_256_token_blocks():
    """pg19 runs of one document (the default) had no SE at all. Its blocks of NLL_BLOCK tokens are the units:
    equal blocks give 0, spread blocks the documents formula applied to the blocks; a document without blocks
    (a run made before ``nll_blocks``) or of one block keeps SE None."""
    import math
    import random

    from luka_bench.stats import NLL_BLOCK, nll_blocks, perplexity_se

    rng = random.Random(0)
    nll = [rng.uniform(1.0, 5.0) for _ in range(2 * NLL_BLOCK + 100)]
    blocks = nll_blocks(nll)
    assert [b[1] for b in blocks] == [NLL_BLOCK, NLL_BLOCK, 100]
    assert sum(b[0] for b in blocks) == pytest.approx(sum(nll))
    assert blocks[1][0] == pytest.approx(sum(nll[NLL_BLOCK:2 * NLL_BLOCK]))
    rec = {"nll_sum": sum(nll), "n_tokens": len(nll), "nll_blocks": blocks}
    got = perplexity_se([rec])
    as_docs = perplexity_se([{"nll_sum": b[0], "n_tokens": b[1]} for b in blocks])
    assert got["mean"] == pytest.approx(math.exp(sum(nll) / len(nll))) == pytest.approx(as_docs["mean"])
    assert got["se"] == pytest.approx(as_docs["se"]) and got["se"] > 0
    assert got["unit"] == f"{NLL_BLOCK}-token blocks" and got["clusters"] == 3 and got["n"] == 1
    flat = perplexity_se([{"nll_sum": 6.0 * NLL_BLOCK, "n_tokens": 2 * NLL_BLOCK,
                           "nll_blocks": [[3.0 * NLL_BLOCK, NLL_BLOCK]] * 2}])
    assert flat["se"] == pytest.approx(0.0)
    assert perplexity_se([{"nll_sum": 30.0, "n_tokens": 10}])["se"] is None
    assert perplexity_se([{"nll_sum": 30.0, "n_tokens": 10, "nll_blocks": [[30.0, 10]]}])["se"] is None



def test_paired_perplexity_of_one_document_is_per_block():
    """Two methods on the same document: the paired difference of log perplexity per token is taken block by
    block (the blocks a method leaves unchanged give 0, and the SE is over blocks), not None as with one document
    as the only unit."""
    import statistics

    from luka_bench.stats import paired_difference

    ref = {"item_id": "d", "nll_sum": 40.0, "n_tokens": 40, "nll_blocks": [[10.0, 10]] * 4}
    rec = {"item_id": "d", "nll_sum": 42.0, "n_tokens": 40,
           "nll_blocks": [[10.0, 10], [10.0, 10], [10.5, 10], [11.5, 10]]}
    got = paired_difference([rec], [ref], "perplexity")
    diffs = [0.0, 0.0, 0.05, 0.15]
    assert got["mean"] == pytest.approx(statistics.mean(diffs))
    assert got["se"] == pytest.approx(statistics.stdev(diffs) / 2) and got["clusters"] == 4
    old = paired_difference([{k: v for k, v in rec.items() if k != "nll_blocks"}], [ref], "perplexity")
    assert old["mean"] == pytest.approx(0.05) and old["se"] is None  # without blocks: one unit, SE undefined


@pytest.fixture
def scored(tmp_path) -> Path:
    root = tmp_path / "s"
    full = {"e1": [1, 1, 1, 0], "e2": [1, 0, 1, 1], "e3": [0, 0, 1, 0], "e4": [1, 1, 1, 1]}
    h2o = {"e1": [1, 0, 1, 0], "e2": [1, 0, 0, 1], "e3": [0, 0, 0, 0], "e4": [1, 1, 0]}  # one question short
    make_scored_run(root, "data=easy,method=full", "full", "wikisalad_easy", full)
    make_scored_run(root, "data=easy,method=h2o", "h2o", "wikisalad_easy", h2o, kv=0.13)
    return root


def test_every_cell_shows_mean_se_and_n(scored):
    import re

    from luka_bench.stats import mean_se

    res = report.build(scored, plots=False, echo=False)
    cell = res["pivot_strings"].loc["wikisalad_easy", "full"]
    m = re.fullmatch(r"(\d\.\d+) ± (\d\.\d+) \(n=(\d+)\)", cell)
    assert m, cell
    vals = [1, 1, 1, 0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 1]
    want = mean_se([float(v) for v in vals], [f"e{i // 4 + 1}" for i in range(16)])
    d = len(m.group(2).split(".")[1])
    assert m.group(1) == f"{want['mean']:.{d}f}" and m.group(2) == f"{want['se']:.{d}f}" and int(m.group(3)) == 16
    md = (scored / "report" / "pivot_headline.md").read_text()
    assert "clustered by example" in md and "± " in md


def test_values_at_the_precision_their_se_supports():
    assert tables.fmt_mean_se(0.7375, 0.0512, 40) == "0.74 ± 0.05 (n=40)"
    assert tables.fmt_mean_se(0.7375, 0.0142, 40) == "0.738 ± 0.014 (n=40)"
    assert tables.fmt_mean_se(31.234, 1.7, 3) == "31 ± 2 (n=3)"
    assert tables.fmt_mean_se(0.031, 0.004, 8, signed=True) == "+0.031 ± 0.004 (n=8)"
    assert tables.fmt_mean_se(0.5, float("nan"), 1) == "0.5 (n=1)"


def test_paired_differences_to_a_reference_on_shared_items(scored, capsys):
    from luka_bench.stats import mean_se

    assert report.main([str(scored), "--paired", "full", "--no-plots"]) == 0
    out = capsys.readouterr().out
    md = (scored / "report" / "pivot_paired_full_headline.md").read_text()
    full = {"e1": [1, 1, 1, 0], "e2": [1, 0, 1, 1], "e3": [0, 0, 1, 0], "e4": [1, 1, 1, 1]}
    h2o = {"e1": [1, 0, 1, 0], "e2": [1, 0, 0, 1], "e3": [0, 0, 0, 0], "e4": [1, 1, 0]}
    diffs = [(h - f, ex) for ex in h2o for h, f in zip(h2o[ex], full[ex])]
    want = mean_se([float(d) for d, _ in diffs], [ex for _, ex in diffs])
    assert want["n"] == 15  # the question h2o lacks is left out
    assert tables.fmt_mean_se(want["mean"], want["se"], 15, signed=True) in md
    assert "reference" in md and md in out
    assert report.main([str(scored), "--paired", "nope", "--no-plots"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.fixture
def mixed(tmp_path) -> Path:
    """A folder like results/runs after a few tries: QA and perplexity runs, a zero score, two runs that land on
    the same point, and a run of another model that failed (its config differs in model_name and _target_)."""
    root = tmp_path / "runs"
    make_scored_run(root, "a", "full", "wikisalad_easy", {"e1": [1, 0, 1], "e2": [1, 1, 1]})
    make_scored_run(root, "b", "h2o", "wikisalad_easy", {"e1": [0, 0, 0], "e2": [0, 0, 0]}, kv=0.13)
    make_scored_run(root, "c", "snapkv", "wikisalad_easy", {"e1": [0, 0, 0], "e2": [0, 0, 0]}, kv=0.13)
    ppl = make_run(root, "d", "full", "pg19", {**qa(0.0, 1.0), "perplexity": 31.5}, headline="perplexity")
    (ppl / "predictions.jsonl").write_text("".join(json.dumps({"item_id": f"doc{i}", "nll_sum": 34.0 + i,
                                                               "n_tokens": 10}) + "\n" for i in range(3)))
    bad = make_run(root, "e", "full", "wikisalad_easy", None, model="qwen3_0_6b")
    cfg = yaml.safe_load((bad / "config.yaml").read_text())
    cfg["model"]["_target_"] = "x.HubModel"
    (bad / "config.yaml").write_text(yaml.safe_dump(cfg))
    return root


def _boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_mixed_folder_plots_one_panel_per_dataset_with_clean_labels(mixed):
    runs, missing = tables.load_runs(mixed)
    assert list(missing["run"]) == ["e"]
    assert set(tables.complete(runs)["variant"]) == {"full", "h2o", "snapkv"}  # no model_name=..., no _target_
    fig = plots.plot_headline(runs, missing=len(missing))
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert set(panels) == {"pg19\nperplexity", "wikisalad_easy\nem_lenient"}
    qa_ax, ppl_ax = panels["wikisalad_easy\nem_lenient"], panels["pg19\nperplexity"]
    assert ppl_ax.get_ylim()[1] > 30 > 2 > qa_ax.get_ylim()[1]  # each metric on its own axis
    assert len(ppl_ax.patches) == 1 and len(qa_ax.patches) == 3  # the failed run: no bar anywhere
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["full", "h2o", "snapkv"]
    labels = [t for t in qa_ax.texts]
    assert sorted(t.get_text() for t in labels) == ["0.83±0.17", "0±0", "0±0"]  # at the precision of the SE
    zero_lines = [c for c in qa_ax.collections if hasattr(c, "get_segments") and c.get_segments() and
                  all(abs(s[:, 1]).max() == 0 for s in c.get_segments()) and c.get_linewidth()[0] >= 3]
    assert len(zero_lines) == 2  # the two zero bars are drawn as thick lines at 0
    assert any("missing.csv" in t.get_text() for t in fig.texts)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [t.get_window_extent(r) for t in ax.texts]
        assert not any(_boxes_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
        inside = ax.get_window_extent(r)
        assert all(b.y1 <= inside.y1 + 1 for b in boxes)  # labels inside their panel: never clipped
    plots.pyplot().close(fig)


def test_coinciding_points_both_show(mixed):
    runs, _ = tables.load_runs(mixed)
    fig = plots.plot_accuracy_vs_kv(runs, "em_lenient")
    ax = [a for a in fig.axes if a.get_title() == "wikisalad_easy"][0]
    pts = {}
    for coll in ax.collections:
        if coll.get_label() in ("h2o", "snapkv"):
            pts[coll.get_label()] = (tuple(coll.get_offsets()[0]), coll.get_sizes()[0], coll.get_paths()[0])
    assert pts["h2o"][0] == pts["snapkv"][0]  # the same point ...
    assert pts["h2o"][1] != pts["snapkv"][1]  # ... drawn at two sizes (and shapes): both visible
    plots.pyplot().close(fig)


def test_latency_plot_names_machine_threads_n_and_the_speed_script(scored):
    make_scored_run(scored, "data=easy,method=snapkv", "snapkv", "wikisalad_easy", {"e1": [1]},
                    extra={"latency_breakdown": {"attention": 0.01, "rest": 0.02}})
    runs, _ = tables.load_runs(scored)
    fig = plots.plot_latency(runs)
    title = fig.axes[0].get_title()
    assert "box1" in title and "cpu" in title and "1 thread" in title
    foot = " ".join(t.get_text() for t in fig.texts)
    assert "scripts/bench_decode.py" in foot and "n = 1 items per bar" in foot
    plots.pyplot().close(fig)
