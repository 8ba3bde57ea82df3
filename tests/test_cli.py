"""The command line: bad input gives one line naming the bad value and the allowed values, exits non-zero,
and never touches results already written. Runs the real entry point on the tiny model."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model=tiny_llama", "data.limit=1", "max_new_tokens=3", "progress=false"]


def cli(*args: str, cwd=ROOT):
    """``python -m luka_bench *args`` in a fresh process (the real entry point, as a user types it)."""
    return subprocess.run([sys.executable, "-m", "luka_bench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def cli_here(*args: str):
    """The same entry point (``luka_bench.__main__.main``: the checks, Hydra, the run, the one-line errors) called
    in this process with ``sys.argv`` set as the command line sets it: its exit status and what it printed.
    A fresh interpreter per bad input costs ~6 s of imports each; the subprocess path is exercised by
    ``finished_run`` and ``test_did_you_mean``."""
    from conftest import in_process
    from luka_bench.__main__ import main

    return in_process(main, [str(ROOT / "luka_bench" / "__main__.py"), *args])


def error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    proc = cli(*TINY, f"hydra.run.dir={d}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"config.yaml", "predictions.jsonl", "metrics.json", "env.json"} <= set(digest(d))
    return d


@pytest.mark.parametrize("arg,bad,allowed", [
    ("method=h20", "h20", "streaming_llm"),
    ("model=smollm3", "smollm3", "smollm2_135m"),
    ("data=wikisalad_extreme", "wikisalad_extreme", "wikisalad_hard"),
])
def test_unknown_names(arg, bad, allowed, finished_run):
    before = digest(finished_run)
    line = error_line(cli_here(*TINY, arg, f"hydra.run.dir={finished_run}"))
    assert bad in line and allowed in line and "Available" in line
    assert digest(finished_run) == before


def test_did_you_mean():
    line = error_line(cli("method=streaming-llm"))
    assert "Did you mean 'streaming_llm'" in line


@pytest.mark.parametrize("budget", ["0", "1.5", "-0.25"])
def test_budget_outside_range(budget, finished_run):
    before = digest(finished_run)
    line = error_line(cli_here(*TINY, "method=streaming_llm", f"method.budget={budget}", f"hydra.run.dir={finished_run}"))
    assert f"method.budget={float(budget)!r}" in line or f"method.budget={budget}" in line
    assert "(0, 1]" in line
    assert digest(finished_run) == before


def test_prompt_longer_than_context(finished_run, tmp_path):
    line = error_line(cli_here(*TINY, "model.max_context=64", f"hydra.run.dir={tmp_path / 'r'}"))
    assert "max_context=64" in line and "<= 64" in line


def test_missing_data_file(finished_run):
    before = digest(finished_run)
    line = error_line(cli_here(*TINY, "data.source=file", "data.path=/no/such/squad.json",
                          f"hydra.run.dir={finished_run}"))
    assert "/no/such/squad.json" in line
    assert digest(finished_run) == before


def test_missing_pg19_file():
    line = error_line(cli_here(*TINY, "data=pg19", "data.source=file", "data.path=/no/such/book.txt"))
    assert "/no/such/book.txt" in line


def test_other_config_into_a_finished_run_is_refused(finished_run):
    before = digest(finished_run)
    line = error_line(cli_here(*TINY, "method=streaming_llm", "method.budget=0.5", f"hydra.run.dir={finished_run}"))
    assert str(finished_run) in line and "another config" in line
    assert digest(finished_run) == before
