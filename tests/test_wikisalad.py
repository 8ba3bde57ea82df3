import json
import re

import pytest

from luka_bench.data.base import DataError, QAExample
from luka_bench.data.synthetic_articles import KINDS, generate_squad
from luka_bench.data.wikisalad import (
    PATTERNS,
    WikiSalad,
    articles_from_squad,
    load_squad_file,
    segment_text,
    squad_rows_to_dict,
)
from luka_bench.metrics import normalize_answer

_HEADER = re.compile(r"^# Segment (\d+): (.+)$", re.MULTILINE)


def _segments(ex: QAExample) -> list[tuple[int, str, str]]:
    """(number, title, text) of every segment of an example's context."""
    heads = list(_HEADER.finditer(ex.context))
    out = []
    for h, nxt in zip(heads, heads[1:] + [None]):
        body = ex.context[h.end():nxt.start() if nxt else len(ex.context)]
        out.append((int(h.group(1)), h.group(2), body.strip("\n")))
    return out


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


# ---------------------------------------------------------------------------------------------------------------
# synthetic articles
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def squad():
    return generate_squad(60, seed=3)


def test_synthetic_schema_and_answer_offsets(squad):
    assert squad["version"] == "v2.0"
    assert len(squad["data"]) == 60
    for art in squad["data"]:
        assert art["title"] and len(art["paragraphs"]) >= 3
        n_qas = 0
        for par in art["paragraphs"]:
            ctx = par["context"]
            assert 3 <= len(_sentences(ctx)) <= 5
            assert len(par["qas"]) >= 2
            for qa in par["qas"]:
                assert set(qa) >= {"id", "question", "is_impossible", "answers"}
                assert qa["is_impossible"] is False
                (ans,) = qa["answers"]
                assert ctx[ans["answer_start"]:ans["answer_start"] + len(ans["text"])] == ans["text"]
                # the question does not give the answer away
                assert normalize_answer(ans["text"]) not in normalize_answer(qa["question"])
                n_qas += 1
        assert n_qas >= 12  # enough for very_hard (6 QA pairs per article) without wrapping


def test_synthetic_sentences_are_long_and_facts_unique(squad):
    for art in squad["data"]:
        questions = [qa["question"] for p in art["paragraphs"] for qa in p["qas"]]
        assert len(questions) == len(set(questions))  # one value per attribute and article
        for par in art["paragraphs"]:
            assert all(len(s) > 50 for s in _sentences(par["context"]))
    titles = [a["title"] for a in squad["data"]]
    assert len(set(titles)) == len(titles)


def test_synthetic_kinds_and_determinism(squad):
    assert len(KINDS) >= 8
    assert {a["kind"] for a in squad["data"]} == {k.name for k in KINDS}
    assert generate_squad(60, seed=3) == squad
    assert generate_squad(60, seed=4) != squad


# ---------------------------------------------------------------------------------------------------------------
# WikiSalad structure
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("difficulty", list(PATTERNS))
def test_pattern_structure(difficulty):
    ws = WikiSalad(difficulty=difficulty, limit=5, n_articles=40)
    pattern = PATTERNS[difficulty]
    exs = ws.examples()
    assert len(exs) == 5
    for ex in exs:
        segs = _segments(ex)
        assert [n for n, _, _ in segs] == list(range(1, len(pattern) + 1))  # headers in order
        titles = [t for _, t, _ in segs]
        letters = list(dict.fromkeys(pattern))
        assert len(set(titles)) == len(letters)
        # the letter -> title mapping is consistent and follows order of first appearance
        mapping = {}
        for ltr, t in zip(pattern, titles):
            assert mapping.setdefault(ltr, t) == t
        assert list(mapping) == letters
        assert ex.meta["titles"] == mapping
        # one question per segment, in order, with its segment's title
        assert [q.meta["segment"] for q in ex.questions] == list(range(1, len(pattern) + 1))
        for q, (_, title, text) in zip(ex.questions, segs):
            assert q.meta["title"] == title
            assert q.answers and q.answers[0] in text  # the gold answer is in the segment built for it
            assert q.answers[0] in ex.context
            assert ex.context[q.meta["answer_char"]:].startswith(q.answers[0])
            assert all(len(s) > 50 for s in _sentences(text))  # fragments <= 50 chars dropped
            assert 1 <= len(_sentences(text)) <= 3


def test_segment_format_exact():
    ex = WikiSalad(limit=1, n_articles=20).examples()[0]
    segs = ex.context.split("\n# Segment ")
    assert ex.context.startswith("# Segment 1: ")
    assert len(segs) == 4
    for i, chunk in enumerate(segs):
        head, body = chunk.split("\n\n", 1)
        assert head.endswith(ex.meta["titles"]["AB"[i % 2]])
        assert body.endswith("\n") and not body.endswith("\n\n")


def test_segment_i_uses_ith_qa_of_its_article():
    ws = WikiSalad(difficulty="medium", limit=3, n_articles=30)
    arts = {a.title: a for a in ws.articles()}
    for ex in ws.examples():
        for i, q in enumerate(ex.questions):
            art = arts[q.meta["title"]]
            assert q.meta["source_id"] == art.qas[i % len(art.qas)].id


def test_determinism_and_seed():
    a = WikiSalad(difficulty="hard", seed=7, limit=4, n_articles=30).examples()
    b = WikiSalad(difficulty="hard", seed=7, limit=4, n_articles=30).examples()
    c = WikiSalad(difficulty="hard", seed=8, limit=4, n_articles=30).examples()
    assert a == b
    assert [e.context for e in a] != [e.context for e in c]
    # example k depends on (seed, k) only: a smaller limit gives a prefix
    assert WikiSalad(difficulty="hard", seed=7, limit=2, n_articles=30).examples() == a[:2]


def test_repeat_and_target_chars():
    base = WikiSalad(limit=2, n_articles=20).examples()
    rep = WikiSalad(limit=2, n_articles=20, repeat=3).examples()
    for b, r in zip(base, rep):
        segs = _segments(r)
        assert [n for n, _, _ in segs] == list(range(1, 13))
        assert [t for _, t, _ in segs] == [t for _, t, _ in _segments(b)] * 3
        assert r.context.startswith(b.context)
        assert len({q.meta["source_id"] for q in r.questions}) == len(r.questions)
    tgt = WikiSalad(limit=2, n_articles=20, target_chars=3000).examples()
    for ex in tgt:
        assert len(ex.context) >= 3000
        assert len(_segments(ex)) % 4 == 0  # whole pattern cycles


@pytest.mark.parametrize("difficulty", ["easy", "very_hard"])
def test_paper_length_contexts(difficulty):
    """target_chars: paper = the LuKA paper's context length for the level (1.5K / 4K tokens for these)."""
    from luka_bench.data.wikisalad import PAPER_TARGET_CHARS, PATTERNS

    short = WikiSalad(difficulty=difficulty, limit=1).examples()[0]
    ex = WikiSalad(difficulty=difficulty, limit=1, target_chars="paper").examples()[0]
    assert len(short.context) < PAPER_TARGET_CHARS[difficulty] <= len(ex.context)
    assert len(_segments(ex)) % len(PATTERNS[difficulty]) == 0
    assert ex.context.startswith(short.context) and len(ex.questions) > len(short.questions)


def test_limit_none_uses_pool():
    ws = WikiSalad(difficulty="hard", limit=None, n_articles=10)
    assert len(ws.examples()) == 3  # 10 articles // 3 topics


# ---------------------------------------------------------------------------------------------------------------
# segment text selection
# ---------------------------------------------------------------------------------------------------------------


def test_segment_text_keeps_answer_sentence():
    s = [f"Sentence number {i} is long enough to be kept by the fragment filter here." for i in range(6)]
    ctx = " ".join(s)
    # answer in sentence 0 -> the first three sentences
    assert segment_text(ctx, ctx.index("number 0"), 8) == " ".join(s[:3])
    # answer in sentence 4 -> the three sentences ending with it
    assert segment_text(ctx, ctx.index("number 4"), 8) == " ".join(s[2:5])


def test_segment_text_drops_short_fragments_but_not_the_answer():
    long1 = "This is a long first sentence that easily passes the length filter."
    long2 = "Another long sentence follows here and it is also well over fifty chars."
    ctx = f"{long1} Too short. {long2} Short answer 42. {long1}"
    assert segment_text(ctx, ctx.index("Another"), 7) == f"{long1} {long2} {long1}"
    assert segment_text(ctx, ctx.index("42"), 2).endswith("Short answer 42.")


def test_segment_text_answer_across_false_sentence_boundary():
    ctx = ("The museum was opened by the mayor of the old harbour town in spring. "
           "It moved to St. Louis in the following year after the great flood of the river. "
           "A third sentence that is long enough to be kept by the length filter.")
    seg = segment_text(ctx, ctx.index("St. Louis"), len("St. Louis"))
    assert "St. Louis" in seg


# ---------------------------------------------------------------------------------------------------------------
# hub rows, local files
# ---------------------------------------------------------------------------------------------------------------

ROWS = [
    {"id": "q1", "title": "Normans", "context": "The Normans were the people who in the 10th and 11th centuries "
     "gave their name to Normandy, a region in France. They were descended from Norse raiders.",
     "question": "In what country is Normandy located?", "answers": {"text": ["France"], "answer_start": [104]}},
    {"id": "q2", "title": "Normans", "context": "The Normans were the people who in the 10th and 11th centuries "
     "gave their name to Normandy, a region in France. They were descended from Norse raiders.",
     "question": "Who was the Norse leader?", "answers": {"text": [], "answer_start": []}},
    {"id": "q3", "title": "Normans", "context": "The Norman dynasty had a major political, cultural and military "
     "impact on medieval Europe and even the Near East.",
     "question": "What dynasty had a major impact on medieval Europe?",
     "answers": {"text": ["The Norman dynasty", "Norman"], "answer_start": [0, 4]}},
    {"id": "q4", "title": "Oxygen", "context": "Oxygen is a chemical element with symbol O and atomic number 8. "
     "It is a member of the chalcogen group on the periodic table.",
     "question": "What is the atomic number of oxygen?", "answers": {"text": ["8"], "answer_start": [61]}},
]


def test_hub_row_conversion():
    squad = squad_rows_to_dict(ROWS)
    assert squad["version"] == "v2.0"
    assert [a["title"] for a in squad["data"]] == ["Normans", "Oxygen"]
    normans = squad["data"][0]
    assert len(normans["paragraphs"]) == 2  # grouped by context
    assert [qa["id"] for qa in normans["paragraphs"][0]["qas"]] == ["q1", "q2"]
    assert normans["paragraphs"][0]["qas"][1]["is_impossible"] is True
    arts = articles_from_squad(squad)
    by_title = {a.title: a for a in arts}
    assert [q.id for q in by_title["Normans"].qas] == ["q1", "q3"]  # unanswerable q2 skipped
    assert by_title["Normans"].qas[0].answers == ("France",)
    assert by_title["Normans"].qas[1].answers == ("The Norman dynasty", "Norman")
    assert by_title["Oxygen"].qas[0].answers == ("8",)


def test_off_annotation_falls_back_to_first_occurrence_and_lost_answers_are_skipped():
    rows = [dict(ROWS[0], id="off", answers={"text": ["France"], "answer_start": [3]}),
            dict(ROWS[0], id="gone", answers={"text": ["Germany"], "answer_start": [10]})]
    (art,) = articles_from_squad(squad_rows_to_dict(rows))
    assert [q.id for q in art.qas] == ["off"]
    assert art.qas[0].answers == ("France",)


def test_hub_loader_with_stub_datasets(monkeypatch):
    """The real hub path (load_dataset -> rows -> articles), with ``datasets.load_dataset`` stubbed offline."""
    import sys
    import types

    calls = []
    rows = ROWS + [dict(r, id=r["id"] + "x", title=r["title"] + " II") for r in ROWS]

    def load_dataset(name, split=None):
        calls.append((name, split))
        return rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    ws = WikiSalad(source="squad_v2", split="validation", limit=2)
    exs = ws.examples()
    assert calls == [("rajpurkar/squad_v2", "validation")]
    assert len(exs) == 2 and all(q.answers[0] in ex.context for ex in exs for q in ex.questions)

    def failing(name, split=None):
        raise ConnectionError("hub unreachable\nmore details")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=failing))
    with pytest.raises(DataError) as e:
        WikiSalad(source="squad_v2").examples()
    assert "rajpurkar/squad_v2" in _one_line(e)


def test_hub_row_missing_field():
    bad = [dict(ROWS[0])]
    del bad[0]["question"]
    with pytest.raises(DataError, match="row 0.*'question'"):
        squad_rows_to_dict(bad)
    bad = [dict(ROWS[0], answers={"text": ["France"]})]
    with pytest.raises(DataError, match="'answer_start'"):
        squad_rows_to_dict(bad)


def _write_squad(tmp_path, squad, name="squad.json"):
    p = tmp_path / name
    p.write_text(json.dumps(squad))
    return str(p)


def test_local_squad_file(tmp_path):
    path = _write_squad(tmp_path, generate_squad(8, seed=1))
    for ws in (WikiSalad(source="file", path=path, limit=3, difficulty="hard"),
               WikiSalad(source=path, limit=3, difficulty="hard")):
        exs = ws.examples()
        assert len(exs) == 3
        for ex in exs:
            assert len(ex.questions) == 6
            assert all(q.answers[0] in ex.context for q in ex.questions)
    # a JSON list of hub-schema rows is accepted as well
    rows_path = tmp_path / "rows.json"
    rows_path.write_text(json.dumps(ROWS))
    exs = WikiSalad(source=str(rows_path), limit=2).examples()
    assert {q.question for ex in exs for q in ex.questions} <= {r["question"] for r in ROWS}
    assert all(q.answers for ex in exs for q in ex.questions)


def test_local_squad_file_with_real_style_article(tmp_path):
    squad = squad_rows_to_dict(ROWS)
    path = _write_squad(tmp_path, squad)
    assert load_squad_file(path) == squad
    ex = WikiSalad(source=path, limit=1).examples()[0]
    assert ex.context.count("# Segment") == 4
    assert all(q.answers[0] in ex.context for q in ex.questions)


# ---------------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------------


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_unknown_difficulty():
    with pytest.raises(DataError) as e:
        WikiSalad(difficulty="extreme")
    msg = _one_line(e)
    assert "'extreme'" in msg and "very_hard" in msg and "easy" in msg


def test_unknown_source():
    with pytest.raises(DataError) as e:
        WikiSalad(source="wikipedia")
    msg = _one_line(e)
    assert "'wikipedia'" in msg and "synthetic" in msg and "squad_v2" in msg


def test_file_source_without_path_and_path_with_synthetic():
    with pytest.raises(DataError) as e:
        WikiSalad(source="file")
    assert "path" in _one_line(e)
    with pytest.raises(DataError) as e:
        WikiSalad(path="x.json")
    assert "'x.json'" in _one_line(e)


def test_unknown_hub_split():
    with pytest.raises(DataError) as e:
        WikiSalad(source="squad_v2", split="test")
    msg = _one_line(e)
    assert "'test'" in msg and "train" in msg and "validation" in msg


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(DataError) as e:
        WikiSalad(source=missing).examples()
    assert missing in _one_line(e)


def test_invalid_json(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text("{not json")
    with pytest.raises(DataError) as e:
        WikiSalad(source=str(p)).examples()
    assert str(p) in _one_line(e)


@pytest.mark.parametrize("drop,where", [
    ("data", None),
    ("title", "data[0]"),
    ("paragraphs", "data[0]"),
    ("context", "data[0].paragraphs[0]"),
    ("qas", "data[0].paragraphs[0]"),
    ("question", "data[0].paragraphs[0].qas[0]"),
    ("answers", "data[0].paragraphs[0].qas[0]"),
    ("answer_start", "data[0].paragraphs[0].qas[0].answers[0]"),
])
def test_missing_field(tmp_path, drop, where):
    squad = generate_squad(4, seed=0)
    art = squad["data"][0]
    par = art["paragraphs"][0]
    qa = par["qas"][0]
    obj = {"data": squad, "title": art, "paragraphs": art, "context": par, "qas": par, "question": qa,
           "answers": qa, "answer_start": qa["answers"][0]}[drop]
    del obj[drop]
    path = _write_squad(tmp_path, squad)
    with pytest.raises(DataError) as e:
        WikiSalad(source=path).examples()
    msg = _one_line(e)
    assert path in msg and f"'{drop}'" in msg
    if where:
        assert where in msg


def test_too_few_articles(tmp_path):
    path = _write_squad(tmp_path, generate_squad(2, seed=0))
    with pytest.raises(DataError) as e:
        WikiSalad(source=path, difficulty="hard").examples()
    assert "'ABCABC'" in _one_line(e)


@pytest.mark.parametrize("kw", [{"repeat": 0}, {"limit": -1}, {"n_articles": 0}, {"target_chars": -5},
                                {"target_chars": "long"}])
def test_bad_numbers(kw):
    (name, value), = kw.items()
    with pytest.raises(DataError) as e:
        WikiSalad(**kw)
    msg = _one_line(e)
    assert name in msg and repr(value) in msg


# ---------------------------------------------------------------------------------------------------------------
# prompt and scoring
# ---------------------------------------------------------------------------------------------------------------


def test_prompt_blocks():
    ws = WikiSalad(limit=1, n_articles=20)
    ex = ws.examples()[0]
    q = ex.questions[0]
    assert ws.kind == "qa"
    assert ws.context_block(ex) == ex.context
    assert ws.question_block(q) == ("\n\nAnswer the following question in one short phrase. Do not include any "
                                    f"other text.\n\nQuestion: {q.question}\n\nAnswer:")


def test_postprocess():
    ws = WikiSalad(limit=1)
    assert ws.postprocess(" 1843\nQuestion: more") == "1843"
    assert ws.postprocess("\n\nAnswer: Tobin Askel.\n") == "Tobin Askel."
    long = "The town was founded in 1843 by a fisherman. " + "It grew quickly after that and it is now big. " * 3
    assert ws.postprocess(long) == "The town was founded in 1843 by a fisherman."
    short = "Founded in 1843. By a fisherman."
    assert ws.postprocess(short) == short  # <= 100 chars: kept whole
    assert ws.postprocess("") == ""


def test_score():
    ws = WikiSalad(limit=1)
    q = ws.examples()[0].questions[0]
    gold = q.answers[0]
    assert ws.score(gold, q) == {"em": 1.0, "em_lenient": 1.0, "f1": 1.0}
    s = ws.score(f"It is {gold}.", q)
    assert s["em"] == 0.0 and s["em_lenient"] == 1.0 and 0 < s["f1"] < 1
    assert ws.score("", q) == {"em": 0.0, "em_lenient": 0.0, "f1": 0.0}
