"""LongBench v2: answer extraction, grouped accuracy, middle truncation, loaders, synthetic items. No model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from luka_bench.data.base import DataError
from luka_bench.data.longbench_v2 import (
    FIELDS,
    LongBenchV2,
    format_prompt,
    generate_items,
    middle_truncate,
    validate_items,
)
from luka_bench.data.scoring_longbench import accuracy_summary, extract_answer, is_correct

FIX = Path(__file__).parent / "fixtures"

# prompts/0shot.txt of THUDM/LongBench (the zero-shot template)
OFFICIAL_0SHOT = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
    "Format your response as follows: \"The correct answer is (insert answer here)\"."
)


def official_prompt(item, doc=None):
    return (OFFICIAL_0SHOT.replace("$DOC$", (item["context"] if doc is None else doc).strip())
            .replace("$Q$", item["question"].strip()).replace("$C_A$", item["choice_A"].strip())
            .replace("$C_B$", item["choice_B"].strip()).replace("$C_C$", item["choice_C"].strip())
            .replace("$C_D$", item["choice_D"].strip()))


class CharTokenizer:
    """One token per character: decode(encode(x)) == x, so truncation can be checked exactly."""

    def __call__(self, text, add_special_tokens=True):
        ids = [[ord(c) for c in t] for t in text] if isinstance(text, list) else [ord(c) for c in text]
        return _Enc(ids)

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class _Enc(dict):
    def __init__(self, ids):
        super().__init__(input_ids=ids)
        self.input_ids = ids


# ---------------------------------------------------------------------------------------------------------------
# extraction and scoring
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("response,letter", [
    ("The correct answer is (B)", "B"),
    ("The correct answer is B", "B"),
    ("The correct answer is B.", "B"),
    ("**The correct answer is (C)**", "C"),
    ("The correct answer is **(D)**", "D"),
    ("The correct answer is **A**", "A"),
    ("Let me think.\n\nThe correct answer is (A) because the text says so.", "A"),
    # the parenthesised form wins over an earlier bare one (the official order of the two patterns)
    ("The correct answer is B, no wait. The correct answer is (C)", "C"),
])
def test_extraction(response, letter):
    assert extract_answer(response) == letter


@pytest.mark.parametrize("response", [
    "", "B", "(B)", "I think it is B.", "the correct answer is (B)", "The correct answer is (E)",
    "The answer is (B)",
])
def test_nothing_extractable_is_wrong(response):
    assert extract_answer(response) is None
    assert not is_correct(response, "B")


def test_score_and_aggregate_by_group():
    recs = [
        {"scores": {"accuracy": 1.0}, "meta": {"difficulty": "easy", "length": "short"}},
        {"scores": {"accuracy": 0.0}, "meta": {"difficulty": "hard", "length": "short"}},
        {"scores": {"accuracy": 1.0}, "meta": {"difficulty": "hard", "length": "long"}},
        {"scores": {"accuracy": 1.0}, "meta": {"difficulty": "hard", "length": "long"}},
    ]
    out = accuracy_summary(recs)
    assert out == {"accuracy": 0.75, "accuracy_easy": 1.0, "accuracy_hard": pytest.approx(2 / 3),
                   "accuracy_short": 0.5, "accuracy_medium": None, "accuracy_long": 1.0}
    assert LongBenchV2().aggregate(recs) == out


# ---------------------------------------------------------------------------------------------------------------
# middle truncation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,m", [(10, 4), (11, 4), (10, 5), (101, 37), (8, 1), (20, 20), (5, 9)])
def test_middle_truncation_keeps_exactly_the_first_and_last_halves(n, m):
    ids = list(range(n))
    out = middle_truncate(ids, m)
    if n <= m:
        assert out == ids
        return
    assert len(out) == m
    assert out[: m // 2] == ids[: m // 2]
    assert out[m // 2:] == ids[n - (m - m // 2):]
    assert out == ids[: m // 2] + ids[-m // 2:]  # pred.py's expression


def test_prompt_truncation_is_the_official_one():
    tok = CharTokenizer()
    items = generate_items(3, seed=1)
    item = max(items, key=lambda it: len(it["context"]))
    full = official_prompt(item)
    m = 1000
    task = LongBenchV2(limit=3, seed=1, max_tokens=m)
    task.prepare(tok, None, chat_template=False)
    ex = next(e for e in task.examples() if e.id == f"lbv2-{item['_id']}")
    assert ex.meta["truncated"] and ex.meta["max_len"] == m
    rebuilt = task.context_block(ex) + task.question_block(ex.questions[0])
    assert rebuilt == full[: m // 2] + full[-(m - m // 2):]


def test_prompt_is_truncated_to_fit_the_model_context():
    from luka_bench.data.base import qa_prompt_ids

    tok = CharTokenizer()
    task = LongBenchV2(limit=4, seed=3)
    task.prepare(tok, 1500, chat_template=False)
    for ex in task.examples():
        c, q = qa_prompt_ids(tok, False, task.context_block(ex), task.question_block(ex.questions[0]))
        assert len(c) + len(q) <= 1500
        if ex.meta["truncated"]:
            assert len(c) + len(q) >= 1490
    # short prompts are left alone
    task = LongBenchV2(source="file", path=str(FIX / "longbench_v2_items.json"))
    task.prepare(tok, 4000, chat_template=False)
    assert not any(e.meta["truncated"] for e in task.examples())


def test_truncation_with_the_smollm2_tokenizer(smollm2_tokenizer):
    from luka_bench.data.base import qa_prompt_ids

    tok = smollm2_tokenizer
    task = LongBenchV2(limit=3, seed=5)
    task.prepare(tok, 700, chat_template=True)
    for ex in task.examples():
        c, q = qa_prompt_ids(tok, True, task.context_block(ex), task.question_block(ex.questions[0]))
        assert len(c) + len(q) <= 700
        assert ex.meta["truncated"]


# ---------------------------------------------------------------------------------------------------------------
# loaders
# ---------------------------------------------------------------------------------------------------------------


def test_file_loader_json_and_prompt():
    task = LongBenchV2(source="file", path=str(FIX / "longbench_v2_items.json"), limit=None)
    items = json.loads((FIX / "longbench_v2_items.json").read_text())
    exs = task.examples()
    assert len(exs) == 4
    for ex, item in zip(exs, items):
        q = ex.questions[0]
        assert task.context_block(ex) + task.question_block(q) == official_prompt(item) == format_prompt(item)
        assert task.context_block(ex).endswith("\n</text>")
        assert task.question_block(q).startswith("\n\nWhat is the correct answer to this question: ")
        assert q.answers == [item["answer"]]
        assert q.meta["difficulty"] == item["difficulty"] and q.meta["length"] == item["length"]
    assert task.score("The correct answer is (C)", exs[0].questions[0]) == {"accuracy": 1.0}
    assert task.score("The correct answer is (A)", exs[0].questions[0]) == {"accuracy": 0.0}


def test_file_loader_jsonl_filters_and_limit():
    path = str(FIX / "longbench_v2_items.jsonl")
    assert [e.questions[0].answers for e in LongBenchV2(source="file", path=path).examples()] == [["C"], ["C"]]
    easy = LongBenchV2(source="file", path=str(FIX / "longbench_v2_items.json"), difficulty="easy")
    assert [e.meta["difficulty"] for e in easy.examples()] == ["easy", "easy"]
    medium = LongBenchV2(source="file", path=str(FIX / "longbench_v2_items.json"), length="medium", limit=1)
    assert [e.meta["length"] for e in medium.examples()] == ["medium"]


def test_missing_field_is_one_line_naming_file_and_field():
    path = str(FIX / "longbench_v2_missing_answer.json")
    with pytest.raises(DataError) as e:
        LongBenchV2(source="file", path=path).examples()
    msg = str(e.value)
    assert "\n" not in msg and path in msg and "'answer'" in msg


def test_bad_values_in_items():
    item = json.loads((FIX / "longbench_v2_items.json").read_text())[0]
    with pytest.raises(DataError, match="'answer' is 'E'"):
        validate_items([{**item, "answer": "E"}], "x.json")
    with pytest.raises(DataError, match="'difficulty'"):
        validate_items([{**item, "difficulty": "medium"}], "x.json")
    with pytest.raises(DataError, match="'length'"):
        validate_items([{**item, "length": "huge"}], "x.json")


def test_hub_loader(monkeypatch):
    import datasets

    rows = json.loads((FIX / "longbench_v2_items.json").read_text())
    calls = []

    def fake(name, split=None, **kw):
        calls.append((name, split))
        return rows

    monkeypatch.setattr(datasets, "load_dataset", fake)
    exs = LongBenchV2(source="hf", limit=3).examples()
    assert calls == [("THUDM/LongBench-v2", "train")] and len(exs) == 3


def test_bad_settings():
    with pytest.raises(DataError, match="source"):
        LongBenchV2(source="web")
    with pytest.raises(DataError, match="data.path"):
        LongBenchV2(source="file")
    with pytest.raises(DataError, match="max_tokens"):
        LongBenchV2(max_tokens=3)
    with pytest.raises(DataError, match="difficulty"):
        LongBenchV2(difficulty="medium")
    with pytest.raises(DataError, match="not found"):
        LongBenchV2(source="file", path="/nonexistent.json").examples()


# ---------------------------------------------------------------------------------------------------------------
# synthetic items
# ---------------------------------------------------------------------------------------------------------------


def test_synthetic_items_are_in_the_real_schema_with_one_right_choice():
    items = generate_items(60, seed=11)
    assert validate_items(items, "synthetic") == items
    assert all(set(it) == set(FIELDS) for it in items)
    assert {it["difficulty"] for it in items} == {"easy", "hard"}
    assert {it["length"] for it in items} == {"short", "medium", "long"}
    assert len({it["_id"] for it in items}) == 60
    n_hard_in_doc = 0
    for it in items:
        choices = [it[f"choice_{L}"] for L in "ABCD"]
        assert len({c.lower() for c in choices}) == 4
        right = it[f"choice_{it['answer']}"]
        assert it["context"].count(right) == 1
        wrong = [c for c in choices if c != right]
        if it["difficulty"] == "easy":
            assert not any(w in it["context"] for w in wrong)
        else:
            n_hard_in_doc += sum(w in it["context"] for w in wrong)
    assert n_hard_in_doc > 0


def test_synthetic_items_are_deterministic_and_prefix_stable():
    assert generate_items(5, seed=2) == generate_items(5, seed=2)
    assert generate_items(8, seed=2)[:5] == generate_items(5, seed=2)
    assert generate_items(3, seed=3) != generate_items(3, seed=2)


def test_synthetic_length_classes_grow():
    items = generate_items(40, seed=4)
    by = {}
    for it in items:
        by.setdefault(it["length"], []).append(len(it["context"]))
    mean = {k: sum(v) / len(v) for k, v in by.items()}
    assert mean["short"] < mean["medium"] < mean["long"]
    assert mean["long"] < 8192 * 4  # fits SmolLM2's context


def test_generation_settings_and_config():
    from hydra.utils import instantiate

    from tests.conftest import compose

    assert LongBenchV2.max_new_tokens >= 32
    assert "\n" not in LongBenchV2.stop_strings
    assert all(extract_answer(s) is not None for s in LongBenchV2.stop_strings)
    task = instantiate(compose("data=longbench_v2").data)
    assert isinstance(task, LongBenchV2) and task.source == "synthetic" and task.limit == 10
    assert task.kind == "qa" and task.headline == "accuracy"
    assert len(task.examples()) == 10
