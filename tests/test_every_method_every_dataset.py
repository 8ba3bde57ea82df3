"""Every method config runs on every dataset kind through the real runner (tiny model, one item each)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

import luka_bench.run as R
from conftest import CONF, compose

METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
DATA = {
    "wikisalad_easy": ["data.limit=1"],
    "babilong": ["data.limit=1", "data.task=qa1", "data.length=0k"],
    "longbench_v2": ["data.limit=1", "data.max_tokens=300"],
    "pg19": ["data.limit=1", "data.max_tokens=80"],
    "ruler": ["data.limit=1", "data.task=niah_single_1", "data.length=1200"],
    "niah": ["data.lengths=[800]", "data.depths=[50]"],
}


@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("method", METHODS)
def test_method_runs_on_dataset(method, data, tmp_path):
    over = [f"method={method}", f"data={data}", "model=tiny_llama", "max_new_tokens=3", "progress=false",
            *DATA[data]]
    if data == "pg19":
        book = tmp_path / "book.txt"
        book.write_text("The quick brown fox jumps over the lazy dog near the river bank. " * 8)
        over += ["data.source=file", f"data.path={book}"]
    m = R.run(compose(*over), tmp_path / "run")
    assert m["complete"] and m["n_examples"] >= 1
    headline = m["headline"]
    assert m[headline] is not None and math.isfinite(m[headline])
    assert m["kv_ratio"] > 0
    assert (Path(tmp_path / "run") / "metrics.json").exists()
