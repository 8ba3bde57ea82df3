"""scripts/needle_study.py builds the issue-28 NIAH protocol: the needle tokens it reports are the needle, the digit
tokens are the number, the question ends with the answer prefix, the prompt is about the asked length, and the
needle sits at the asked depth."""
from __future__ import annotations

import pytest

from conftest import load_script


@pytest.mark.parametrize("i", [0, 5, 9])
def test_prompt_protocol(smollm2_tokenizer, i):
    N = load_script("needle_study")

    tok = smollm2_tokenizer
    pr = N.build_prompt(tok, N.haystack_text(), i, 3700)
    needle = N.NEEDLE.format(key=pr["key"], value=pr["value"])
    assert tok.decode([pr["ctx"][j] for j in pr["needle"]]).strip() == needle
    assert tok.decode([pr["ctx"][j] for j in pr["digits"]]).strip() == pr["value"]
    assert pr["needle"] == list(range(pr["needle"][0], pr["needle"][-1] + 1))  # one contiguous span
    assert tok.decode(pr["q"]).rstrip().endswith(N.ANSWER_PREFIX.format(key=pr["key"]))
    assert N.QUESTION.format(key=pr["key"]) in tok.decode(pr["q"])
    assert 3500 <= len(pr["ctx"]) + len(pr["q"]) <= 3800
    assert abs(pr["needle"][0] / len(pr["ctx"]) - pr["depth"]) < 0.05
    assert len(pr["value"]) == 7 and N.INSTRUCTION in tok.decode(pr["ctx"][:80])


def test_table_pairs_each_method_with_its_oracle_over_prompts_every_method_finished(tmp_path):
    """The table counts only prompts every method finished, puts the oracle at a method's tokens read beside it,
    and says which methods did not run; it reads the study's run folders, also split over several folders (two
    processes that took half the prompts each)."""
    from luka_bench.results import RunFolder

    N = load_script("needle_study")
    folders = {}
    for p in range(3):
        for m in N.METHODS[:3]:
            if m == N.METHODS[2] and p == 2:
                continue  # prompt 2 unfinished for one method: it must leave the table
            base = {"prompt": p, "needle_recall": 0.5, "needle_mass": 0.03, "needle_mass_read": 0.01, "code": "abc"}
            for label, rec in ((m, {**base, "correct": int(p == 0), "tokens_read": 400.0 + p}),
                               (f"oracle_topk@{m}", {**base, "correct": 1, "tokens_read": 400.0 + p,
                                                     "needle_mass_read": 0.03})):
                out = tmp_path / ("a" if p < 2 else "b")
                key = (out, label)
                if key not in folders:
                    folders[key] = RunFolder(out / N.slug(label), N.run_config(
                        {"name": "tiny"}, label, {"_target_": "x"}, {"tokens": 100, "first": 0, "limit": 3}))
                N.record(folders[key], {**rec, "method": label}, 0, 3)
    for f in folders.values():
        f.close()
    t = N.table([str(tmp_path / "a"), str(tmp_path / "b")])
    row = next(r for r in t.splitlines() if r.startswith(f"| {N.METHODS[1]} |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "400"  # tokens read: mean over prompts 0 and 1 (400.0, 401.0) -> 400.5 -> "400"
    assert cells[2] == "0.50 ± 0.50" and cells[3] == "1.00 ± 0.00"  # method 1/2, its oracle 2/2
    assert cells[6] == "0.010 ± 0.000" and cells[7] == "0.030 ± 0.000" and cells[8] == "2"
    assert "(2: [0, 1])" in t and "not run: " + N.METHODS[3] in t and "code: abc" in t


def test_study_folders_are_run_folders_the_report_reads(tmp_path):
    """Each method label's folder is an ordinary run folder: the report's loader reads it, its metrics say accuracy
    ± binomial SE over the prompts it holds and ``complete`` only once it holds every prompt of the study's range;
    a second process cannot open the same folder."""
    from luka_bench.results import RunFolder, RunFolderBusy
    from luka_bench.tables import load_runs

    N = load_script("needle_study")
    cfg = N.run_config({"name": "tiny"}, "h2o 1/8", {"_target_": "luka_bench.methods.h2o.H2O", "budget": 0.125},
                       {"tokens": 100, "max_new_tokens": 12, "first": 0, "limit": 3})
    run = RunFolder(tmp_path / N.slug("h2o 1/8"), cfg)
    assert run.path.name == "h2o_1-8"
    with pytest.raises(RunFolderBusy):
        RunFolder(run.path, cfg)
    for p, correct in ((0, 1), (1, 0)):
        N.record(run, {"prompt": p, "correct": correct, "tokens_read": 10.0, "needle_recall": 0.5}, 0, 3)
    runs, missing = load_runs(tmp_path)
    assert len(runs) == 0 or runs.iloc[0]["status"] != "complete"
    N.record(run, {"prompt": 2, "correct": 1, "tokens_read": 13.0, "needle_recall": 1.0}, 0, 3)
    run.close()
    runs, missing = load_runs(tmp_path)
    row = runs.iloc[0]
    assert row["status"] == "complete" and row["method_name"] == "h2o 1/8" and row["data_name"] == "needle_study"
    assert row["accuracy"] == pytest.approx(2 / 3) and row["accuracy_se"] == pytest.approx((2 / 9 / 2) ** 0.5)
    assert row["attended_tokens"] == pytest.approx(11.0) and row["n_examples"] == 3
    assert [r["item_id"] for r in N.records(str(tmp_path))] == ["needle-0", "needle-1", "needle-2"]


def test_why_report_conditions_the_page0_share_on_the_rows_it_names(capsys):
    """needle_why's luka line 'when the needle page is in the true top-3 ...: page 0 among the refined' is over those
    rows, not all rows (it printed the all-rows share there)."""
    import argparse

    load_script("needle_study")  # needle_why imports its sibling
    W = load_script("needle_why")

    row = {"layer": 0, "rank_score": 5, "rank_true": 5, "pages": 10, "refined": False, "refined_true_mass": 0.3,
           "best3_true_mass": 0.4, "needle_page_true_mass": 0.01, "summary_logit": -5.0, "raw_max_logit": -3.0,
           "raw_lme_logit": -4.0}
    rows = [dict(row, true_top3=True, page0_refined=True)] * 3 + [dict(row, true_top3=False, page0_refined=False)] * 7
    W.report({"luka": rows, "lychee": [], "snap": [], "h2o": []},
             argparse.Namespace(rows=None, report="x", start=0, prompts=1, tokens=3700))
    out = capsys.readouterr().out
    assert "among the 3 refined: 0.300 of all rows" in out
    assert "(n = 3 rows): refined 0.000; page 0 among the refined 1.000" in out
