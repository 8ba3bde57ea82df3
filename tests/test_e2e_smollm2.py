"""End to end on the real small model (SmolLM2-135M-Instruct from its PyPI GGUF package), offline."""
from __future__ import annotations

import json

import pytest

import luka_bench.run as R
from conftest import compose, in_process, load_script

# Runs in CI (scripts/setup.sh installs the model's package); without it the tests fail, they do not skip.
pytestmark = [pytest.mark.slow]


def test_cli_wikisalad_one_example(tmp_path):
    from test_cli import cli_here  # the command line's entry point, in this process

    proc = cli_here("data.limit=1", "progress=false", f"hydra.run.dir={tmp_path}")  # 4 questions
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("em", "em_lenient", "f1", "ttft_s", "tpot_s", "kv_ratio", "kv_bytes", "kv_bytes_full",
                "peak_rss_bytes", "n_examples"):
        assert key in m, key
    assert m["model"] == "smollm2_135m" and m["method"] == "full" and m["data"] == "wikisalad_easy"
    assert m["kv_ratio"] == 1.0 and m["ttft_s"] > 0 and m["tpot_s"] > 0
    preds = [json.loads(x) for x in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == m["n_examples"] >= 2
    assert "kv_ratio" in proc.stdout and "em_lenient" in proc.stdout  # the summary table


def test_streaming_quarter_budget_ratio(tmp_path):
    m = R.run(compose("method=streaming_llm", "method.budget=0.25", "data=wikisalad_hard", "data.limit=1",
                      "max_new_tokens=4", "progress=false"), tmp_path)
    assert abs(m["kv_ratio"] - 0.25) <= 0.05


def test_pg19_streaming_budget_one_equals_full(tmp_path):
    full = R.run(compose("data=pg19", "data.max_tokens=48", "progress=false"), tmp_path / "f")
    s1 = R.run(compose("data=pg19", "data.max_tokens=48", "method=streaming_llm", "method.budget=1.0",
                       "progress=false"), tmp_path / "s")
    assert f"{full['perplexity']:.4g}" == f"{s1['perplexity']:.4g}"
    rec = json.loads((tmp_path / "f" / "predictions.jsonl").read_text().splitlines()[0])
    assert sum(b[0] for b in rec["nll_blocks"]) == pytest.approx(rec["nll_sum"])  # the SE's units add up
    assert [b[1] for b in rec["nll_blocks"]] == [rec["n_tokens"]]  # 47 predicted tokens: one block, SE None
    assert full["uncertainty"]["perplexity"]["se"] is None


def test_bench_decode_both_modes_and_table(tmp_path):
    """scripts/bench_decode.py (the README's speed table): interleaved at the short length, one method at a time
    from --isolate-from on; every method has its ratios to the references, full's are exactly 1, its JSON is
    written as it goes and the markdown table has a row per method."""
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    bench = load_script("bench_decode")  # its main in this process, sys.argv as the shell sets it
    proc = in_process(bench.main, ["bench_decode.py", "--lengths", "32", "48", "--isolate-from", "48", "--methods",
                                   "streaming_llm", "luka_clustered", "--steps", "2", "--round", "1",
                                   "--prefill-reps", "2", "--threads", "1", "--json", str(js), "--markdown", str(md)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(js.read_text())
    assert [(r["N"], r["mode"]) for r in rows] == [(32, "interleaved"), (48, "isolate")]
    for r in rows:
        assert list(r["methods"]) == ["stock", "full", "streaming_llm", "luka_clustered"]
        assert r["methods"]["full"]["decode_vs_full"] == 1.0 and r["methods"]["stock"]["decode_vs_stock"] == 1.0
        for d in r["methods"].values():
            assert d["decode_ms"] > 0 and d["prefill_s"] > 0 and d["prefill_vs_full"] > 0
            assert d["prefill_peak_rss_gb"] >= d["rss_before_prefill_gb"] > 0.1  # the model alone is ~0.5 GB
    assert len(md.read_text().splitlines()) == 2 + 4
    assert "harness overhead of full" in proc.stdout
    # --table-from merges per (N, method): a later run of one method at 48 replaces that cell only
    later = tmp_path / "later.json"
    cell = {"decode_vs_full": 0.25, "prefill_vs_full": 1.5, "prefill_peak_rss_gb": 9.0}
    later.write_text(json.dumps([{"N": 48, "methods": {"luka_clustered": cell, "h2o": cell}}]))
    md2 = tmp_path / "merged.md"
    proc = in_process(bench.main, ["bench_decode.py", "--table-from", str(js), str(later), "--markdown", str(md2)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = {ln.split(" | ")[0].strip("| "): ln for ln in md2.read_text().splitlines()[2:]}
    assert list(table) == ["stock", "full", "h2o", "luka_clustered", "streaming_llm"]
    # a cell: decode/stock, decode/full, prefill/full, GB; the later run measured no stock: "—" in its place
    assert table["luka_clustered"].endswith("| —, 0.25, 1.50, 9.0 |") and table["h2o"].startswith("| h2o | — |")
    full = rows[1]["methods"]["full"]
    assert table["full"].endswith(f"| {full['decode_vs_stock']:.2f}, 1.00, 1.00, {full['prefill_peak_rss_gb']:.1f} |")
    assert not table["streaming_llm"].endswith("| —, 0.25, 1.50, 9.0 |")


def test_bench_decode_layout_ab_runs_the_classic_layout_beside_the_packed(tmp_path):
    """--layout-ab: a head-wise method also runs as <name>+classic (``KVStore.PACK_HEADS`` off around its prefill
    and decode, and only there), its prefill's logits beside the packed run's."""
    from luka_bench.methods.store import KVStore

    js = tmp_path / "ab.json"
    bench = load_script("bench_decode")
    with bench.variant("adakv+classic"):
        assert KVStore.PACK_HEADS is False
    assert KVStore.PACK_HEADS is True
    proc = in_process(bench.main, ["bench_decode.py", "--lengths", "256", "--refs", "full", "--methods", "adakv",
                                   "--layout-ab", "--steps", "2", "--round", "1", "--threads", "1", "--no-warm-up",
                                   "--json", str(js)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ms = json.loads(js.read_text())[0]["methods"]
    assert list(ms) == ["full", "adakv", "adakv+classic"]
    assert ms["adakv+classic"]["prefill_logits_max_abs_diff_vs_packed"] < 1e-4
    assert KVStore.PACK_HEADS is True
