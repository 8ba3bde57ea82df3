"""RULER / NIAH bad input from the command line: one line naming the value and what is allowed, exit 2, before
the model loads (no 'Loading weights'), nothing written."""
from __future__ import annotations

import pytest

from test_cli import cli_here, error_line


@pytest.mark.parametrize("args,words", [
    (["data=ruler", "data.task=niah_single_9"], ["niah_single_9", "allowed", "qa_2"]),
    (["data=ruler", "data.length=8192"], ["data.length=8192", "model.max_context=4096", "<= 4096"]),
    (["data=ruler", "data.length=100"], ["data.length=100", "too short", ">="]),
    (["data=ruler", "data.task=niah_single_2", "data.haystack=/no/such/essays.txt"],
     ["/no/such/essays.txt", "allowed: essays"]),
    (["data=niah", "data.lengths=[1024,8192]"], ["8192", "model.max_context=4096"]),
])
def test_bad_input_one_line_nothing_written(args, words, tmp_path):
    out = tmp_path / "run"
    proc = cli_here("model=tiny_llama", "progress=false", *args, f"hydra.run.dir={out}")
    line = error_line(proc)
    assert all(w in line for w in words), line
    assert "Loading weights" not in proc.stderr + proc.stdout
    assert not out.exists()
