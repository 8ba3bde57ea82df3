"""The front door and the docs site: README.md stays short and its sample output is the committed one; the MkDocs
site builds with ``--strict`` (a broken link fails), shows every method and dataset card and the index of the
methods, and reads its result tables from the committed files."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

README = ROOT / "README.md"
SAMPLE = ROOT / "results" / "summaries" / "readme" / "default_run.txt"


def build(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(src / "mkdocs.yml"),
                           "-d", str(out)], cwd=src, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extras: bash scripts/setup.sh")
    out = tmp_path_factory.mktemp("site")
    proc = build(ROOT, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_readme_is_a_short_front_door():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    for needed in ("bash scripts/setup.sh && .venv/bin/python -m pytest -q -n 2", "## One run", "## One sweep",
                   "## Reading results", "## Adding a method", "## Adding a dataset", "mkdocs"):
        assert needed in text
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ".venv/bin/python -m pytest -q -n 2\n" in ci  # CI runs the README's test command


def test_readme_sample_summary_is_the_committed_one():
    """The summary table in the README is the committed output of the default run, byte for byte."""
    sample = SAMPLE.read_text(encoding="utf-8").strip("\n")
    blocks = re.findall(r"```\n(\+-.*?)\n```", README.read_text(encoding="utf-8"), re.S)
    assert blocks == [sample]
    assert "smollm2_135m / full / wikisalad_easy" in sample and "n_examples" in sample


def test_site_builds_strictly_with_every_card(site):
    for kind in ("methods", "datasets"):
        for card in (ROOT / kind).glob("*.md"):
            if card.name != "README.md":  # a folder's index, not a card: the section's first page
                assert (site / kind / card.stem / "index.html").exists(), card
    index = (site / "methods" / "index.html").read_text(encoding="utf-8")  # methods/README.md: a row per config
    for p in (ROOT / "conf" / "method").glob("*.yaml"):
        assert f"conf/method/{p.name}" in index
    page = (site / "results" / "index.html").read_text(encoding="utf-8")
    committed = (ROOT / "results/summaries/eviction_table/pivot_em_lenient-kv_ratio.md").read_text(encoding="utf-8")
    first_row = committed.splitlines()[2].split("|")[1].strip()  # a row name of the committed table
    assert first_row in page and "<!-- include" not in page
    conf = (site / "configuration" / "index.html").read_text(encoding="utf-8")
    for p in (ROOT / "conf" / "method").glob("*.yaml"):
        assert f"conf/method/{p.name}" in conf


def test_a_broken_link_fails_the_build(tmp_path):
    pytest.importorskip("mkdocs")
    src = tmp_path / "repo"
    for name in ("docs", "methods", "datasets", "conf"):
        shutil.copytree(ROOT / name, src / name)
    shutil.copytree(ROOT / "results" / "summaries", src / "results" / "summaries")
    shutil.copy(ROOT / "mkdocs.yml", src / "mkdocs.yml")
    with open(src / "docs" / "speed.md", "a", encoding="utf-8") as f:
        f.write("\nSee [the old page](no_such_page.md).\n")
    proc = build(src, tmp_path / "out")
    assert proc.returncode != 0 and "no_such_page.md" in proc.stderr
