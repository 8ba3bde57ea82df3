"""luka_bench/ruler_table.py: the RULER summary from a sweep folder — per-task means, the overall score (mean of the
task means), the niah-only row over the niah_* tasks, and the paired difference from full attention."""
from __future__ import annotations

import json

import pytest
import yaml



def fake_run(folder, method, scores: dict[str, list[float]], complete=True, data=None):
    folder.mkdir(parents=True)
    cfg = {"model": {"name": "m"}, "method": {"_target_": method}, "data": data or {}, "method_name": method}
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [json.dumps({"item_id": f"{t}/{i}", "meta": {"task": t}, "scores": {"ruler": x}})
             for t, xs in scores.items() for i, x in enumerate(xs)]
    (folder / "predictions.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "metrics.json").write_text(json.dumps({"complete": complete}))


def test_overall_niah_and_paired_rows(tmp_path):
    from luka_bench import ruler_table as RT
    from luka_bench.data.ruler import TASKS

    niah = [t for t in TASKS if t.startswith("niah")]
    full = {t: [100.0, 100.0] if t in niah else [0.0, 50.0] for t in TASKS}
    other = {t: [0.0, 100.0] if t in niah else [0.0, 50.0] for t in TASKS}
    fake_run(tmp_path / "a", "full", full)
    fake_run(tmp_path / "b", "snapkv", other)
    md, csv = RT.ruler_table(tmp_path)
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in md.splitlines()
            if r.startswith("| ") and not r.startswith("| task")}
    n_other = len(TASKS) - len(niah)
    se_all = (n_other * 25.0 ** 2) ** 0.5 / len(TASKS)  # the other tasks: 25 ± 25 each; niah 100 ± 0
    score = next(k for k in rows if k.startswith("**RULER score**"))
    assert rows[score][0] == f"**{(len(niah) * 100 + n_other * 25) / len(TASKS):.1f}** ± {se_all:.1f}"
    # snapkv: each niah task 50 ± 50 (two samples), so the niah mean is 50 with SE sqrt(T * 50^2) / T
    se = (len(niah) * 50.0 ** 2) ** 0.5 / len(niah)
    assert rows[f"niah tasks (mean over the {len(niah)} niah_* tasks)"] == ["100.0 ± 0.0", f"50.0 ± {se:.1f}"]
    assert rows["difference from full (paired items)"][1].startswith(f"{-50 * len(niah) / len(TASKS):+.1f}")
    assert {r["method"] for r in csv} == {"full", "snapkv"} and len(csv) == 2 * len(TASKS)


def test_a_method_missing_a_niah_task_says_how_many_it_has(tmp_path):
    from luka_bench import ruler_table as RT
    from luka_bench.data.ruler import TASKS

    fake_run(tmp_path / "a", "full", {t: [100.0] for t in TASKS})
    fake_run(tmp_path / "b", "h2o", {t: [0.0] for t in list(TASKS)[1:]}, complete=False)
    md, _ = RT.ruler_table(tmp_path)
    niah_row = next(r for r in md.splitlines() if r.startswith("| niah tasks"))
    n_niah = sum(t.startswith("niah") for t in TASKS)
    assert f"- ({n_niah - 1}/{n_niah} tasks)" in niah_row
    assert "h2o (partial)" in md


@pytest.mark.parametrize("data,comparable,says", [
    ({"source": "synthetic", "qa_source": "synthetic"}, False, "offline stand-ins"),
    ({"source": "synthetic", "qa_source": "hub"}, True, "real SQuAD v2 / HotpotQA"),
    ({"source": "hub", "qa_source": "synthetic"}, True, "real SQuAD v2 / HotpotQA"),  # the hub set's QA is real
    ({"source": "file", "qa_source": "synthetic"}, False, "cannot be told"),
    (None, False, "do not say"),
])
def test_the_headline_says_what_it_averages_and_whether_it_is_comparable(tmp_path, data, comparable, says):
    from luka_bench import ruler_table as RT
    from luka_bench.data.ruler import TASKS

    fake_run(tmp_path / "a", "full", {t: [100.0] for t in TASKS}, data=data)
    fake_run(tmp_path / "b", "snapkv", {t: [0.0] for t in TASKS}, data=data)
    md, _ = RT.ruler_table(tmp_path)
    label = next(r for r in md.splitlines() if r.startswith("| **RULER score**")).split("|")[1]
    assert "mean over the 13 tasks" in label
    assert ("NOT comparable" not in label and "comparable with published" in label) == comparable, label
    note = next(r for r in md.splitlines() if r.startswith("Headline (every method)"))
    assert "all 13 RULER tasks" in note and says in note
    assert ("NOT comparable" in note) != comparable


def test_mixed_qa_sources_are_labelled_per_method(tmp_path):
    from luka_bench import ruler_table as RT
    from luka_bench.data.ruler import TASKS

    fake_run(tmp_path / "a", "full", {t: [100.0] for t in TASKS}, data={"source": "synthetic", "qa_source": "hub"})
    fake_run(tmp_path / "b", "snapkv", {t: [0.0] for t in TASKS},
             data={"source": "synthetic", "qa_source": "synthetic"})
    md, _ = RT.ruler_table(tmp_path)
    assert "NOT comparable with published RULER scores: see below" in md
    assert any(r.startswith("Headline (full): ") and "NOT" not in r for r in md.splitlines())
    assert any(r.startswith("Headline (snapkv): ") and "offline stand-ins" in r for r in md.splitlines())


def test_a_sweep_over_lengths_on_a_task_subset_pairs_each_method_with_full_at_its_length(tmp_path):
    """LycheeCluster's Table 6: two lengths, the paper's subset of tasks — a column per method and length, rows only
    for the tasks run, a score over those (not called a RULER score), each method paired with full at its length."""
    from luka_bench import ruler_table as RT

    tasks = ["niah_single_2", "vt"]
    fake_run(tmp_path / "a", "full", {t: [100.0, 100.0] for t in tasks}, data={"length": 1024})
    fake_run(tmp_path / "b", "lychee", {t: [100.0, 0.0] for t in tasks}, data={"length": 1024})
    fake_run(tmp_path / "c", "full", {t: [0.0, 0.0] for t in tasks}, data={"length": 2048})
    fake_run(tmp_path / "d", "lychee", {t: [0.0, 100.0] for t in tasks}, data={"length": 2048})
    md, _ = RT.ruler_table(tmp_path)
    assert md.splitlines()[0] == "| task | full@1024 | lychee@1024 | full@2048 | lychee@2048 |"
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in md.splitlines()
            if r.startswith("| ") and not r.startswith("| task")}
    assert set(rows) >= set(tasks) and "niah_single_1" not in rows
    assert rows["**mean over the 2 tasks run** (a subset of RULER: not a RULER score)"][0].startswith("**100.0**")
    diff = rows["difference from full (paired items, same length)"]
    assert diff[1].startswith("-50.0") and diff[3].startswith("+50.0")  # against full at 1024, at 2048
