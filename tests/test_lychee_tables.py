"""The LycheeCluster paper's Tables 1 and 6 as experiments (issue 48): every row composes into its method at the
paper's budget, on the paper's data and model."""
from __future__ import annotations

import pytest
import yaml

from luka_bench import config
from luka_bench.config import build

ROWS = ["full", "razor_attention", "arkvale", "shadowkv", "quest", "clusterkv", "lychee"]


def test_lychee_table1_rows_read_the_papers_budget():
    exp = yaml.safe_load((config.CONF_DIR / "experiment" / "lychee_table1.yaml").read_text())
    assert exp["hydra"]["sweeper"]["params"]["+lychee_row"].split(",") == ROWS
    read = {}
    for row in ROWS:
        cfg = config.compose(["+experiment=lychee_table1", f"+lychee_row={row}"], run_names=True)
        m = build(cfg, "method")
        assert cfg.model.name == "llama31_8b_instruct" and cfg.data.source == "hf" and cfg.lychee_row == row
        assert type(build(cfg, "data")).__name__ == "LongBenchV2"
        read[row] = m
    for row in ("quest", "clusterkv", "lychee", "shadowkv"):
        assert read[row].token_budget == 1024, row
    assert read["arkvale"].page_budget * read["arkvale"].page_size == 1024
    # scaled for a CPU run in one place
    cfg = config.compose(["+experiment=lychee_table1", "+lychee_row=arkvale", "lychee_budget=256", "lychee_pages=8",
                          "lychee_topk=3"], run_names=True)
    assert build(cfg, "method").page_budget == 8


@pytest.mark.parametrize("length", [4096, 32768])
def test_lychee_table6_is_full_and_lychee_on_the_papers_ruler_tasks(length):
    exp = yaml.safe_load((config.CONF_DIR / "experiment" / "lychee_table6.yaml").read_text())
    assert exp["hydra"]["sweeper"]["params"]["+lychee_row"] == "full,lychee"
    cfg = config.compose(["+experiment=lychee_table6", "+lychee_row=lychee", f"data.length={length}"], run_names=True)
    task = build(cfg, "data")
    assert type(task).__name__ == "Ruler" and cfg.data.qa_source == "hub"
    assert cfg.data.task.split(",") == ["niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_multiquery", "vt",
                                        "fwe", "qa_1", "qa_2"]
    assert build(cfg, "method").token_budget == 1024


@pytest.mark.parametrize("table", ["lychee_table1", "lychee_table6"])
def test_the_cpu_commands_in_the_experiments_compose_for_every_row(table):
    """The CPU-sized command each experiment's header gives composes for each of its rows (its overrides exist)."""
    text = (config.CONF_DIR / "experiment" / f"{table}.yaml").read_text()
    command = " ".join(line.strip("# \\") for line in text.split("# CPU-sized")[1].split("\n")[1:3])
    over = [o for o in command.split()[4:] if not o.startswith(("sweep_name=", "threads="))]
    over = [o.split(",")[0] if o.startswith("data.length=") else o for o in over]
    rows = yaml.safe_load(text)["hydra"]["sweeper"]["params"]["+lychee_row"].split(",")
    for row in rows:
        cfg = config.compose([f"+experiment={table}", "model=smollm2_135m", f"+lychee_row={row}", *over[1:]],
                             run_names=True)
        m = build(cfg, "method")
        if row != "full" and hasattr(m, "token_budget"):
            assert m.token_budget == 256, (table, row)
