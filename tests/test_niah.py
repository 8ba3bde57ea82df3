"""Needle in a haystack: the needle sits at the asked depth and inside the length in the model's tokens, its span
is recorded; the report's depth x length heat map averages the right predictions."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from luka_bench.data.base import DataError, qa_prompt_ids
from luka_bench.data.niah import NIAH, insert_needle
from luka_bench.niah_plot import niah_cells, niah_figures

LENGTHS = [512, 1536]
DEPTHS = [0, 25, 50, 75, 100]


@pytest.fixture(scope="module")
def cells(smollm2_tokenizer):
    n = NIAH(lengths=LENGTHS, depths=DEPTHS, limit=2, seed=3)
    n.prepare(smollm2_tokenizer, None, True)
    return n, n.examples()


def test_one_example_per_cell_and_sample(cells):
    n, exs = cells
    assert sorted((e.meta["length"], e.meta["depth"], e.meta["index"]) for e in exs) == sorted(
        (ln, float(d), k) for ln in LENGTHS for d in DEPTHS for k in range(2))


def test_needle_span_holds_the_needle_and_the_answer(cells, smollm2_tokenizer):
    n, exs = cells
    for e in exs:
        a, b = e.meta["needle_span"]
        needle = e.context[a:b]
        q = e.questions[0]
        assert needle.startswith("One of the special magic numbers for " + e.meta["key"]) and needle.endswith(".")
        assert needle.count(q.answers[0]) == 1 and e.context.count(q.answers[0]) == 1
        # the token span, in the context part of the prompt the runner builds, decodes to the needle
        c, _ = qa_prompt_ids(smollm2_tokenizer, True, n.context_block(e), n.question_block(q), n.answer_prefix(q))
        s, t = e.meta["needle_token_span"]
        assert q.answers[0] in smollm2_tokenizer.decode(c[s:t])


def test_needle_depth_orders_its_position(cells):
    n, exs = cells
    for ln in LENGTHS:
        row = sorted((e.meta["depth"], e.meta["needle_span"][0] / len(e.context)) for e in exs
                     if e.meta["length"] == ln and e.meta["index"] == 0)
        rel = [r for _, r in row]
        assert rel[0] == 0.0 and rel == sorted(rel)
        assert all(abs(r - d / 100) < 0.12 for d, r in row[:-1])  # sentence boundaries move it a little
        last = [e for e in exs if e.meta["length"] == ln and e.meta["depth"] == 100 and e.meta["index"] == 0][0]
        assert last.meta["needle_span"][1] == len(last.context)


def test_prompt_fits_the_length(cells, smollm2_tokenizer):
    n, exs = cells
    for e in exs:
        q = e.questions[0]
        c, qi = qa_prompt_ids(smollm2_tokenizer, True, n.context_block(e), n.question_block(q), n.answer_prefix(q))
        total = len(c) + len(qi) + n.max_new_tokens
        assert total <= e.meta["length"] and total >= e.meta["length"] - 8


def test_samples_differ_and_repeat(cells, smollm2_tokenizer):
    n, exs = cells
    again = NIAH(lengths=LENGTHS, depths=DEPTHS, limit=2, seed=3)
    again.prepare(smollm2_tokenizer, None, True)
    assert [(e.context, e.questions[0].answers) for e in again.examples()] == [
        (e.context, e.questions[0].answers) for e in exs]
    k0 = [e.context for e in exs if e.meta["index"] == 0]
    k1 = [e.context for e in exs if e.meta["index"] == 1]
    assert not set(k0) & set(k1)


def test_insert_needle_at_a_sentence_end():
    text, (a, b) = insert_needle("One two. Three four. Five six.", "NEEDLE.", 15)
    assert text == "One two. NEEDLE. Three four. Five six." and text[a:b] == "NEEDLE."
    text, (a, b) = insert_needle("One two. Three four.", "N.", 0)
    assert text == "N. One two. Three four." and (a, b) == (0, 2)


@pytest.mark.parametrize("kw,words", [
    ({"depths": [0, 150]}, ["150", "[0, 100]"]),
    ({"lengths": [0]}, ["data.lengths=0"]),
    ({"lengths": [60]}, ["60", "too short"]),
    ({"limit": 0}, ["data.limit=0"]),
])
def test_bad_settings(kw, words):
    with pytest.raises(DataError) as e:
        NIAH(**kw)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value)


def test_heat_map_cells_are_the_means_of_the_predictions(tmp_path):
    """Two runs' predictions -> per-method depth x length means, and the figure the report writes."""
    rows = []
    for method, hits in [("full", {(0, 512): [100, 100], (50, 512): [0, 100], (0, 1024): [0, 0]}),
                         ("snapkv", {(0, 512): [0, 0]})]:
        run = tmp_path / method
        run.mkdir()
        with open(run / "predictions.jsonl", "w") as f:
            for (d, ln), scores in hits.items():
                for s in scores:
                    f.write(json.dumps({"scores": {"niah": s}, "meta": {"depth": d, "length": ln}}) + "\n")
        rows.append({"run": method, "status": "complete", "method_name": method})
    cells = niah_cells(tmp_path, pd.DataFrame(rows))
    assert cells["full"].loc[0.0, 512] == 100 and cells["full"].loc[50.0, 512] == 50
    assert cells["full"].loc[0.0, 1024] == 0 and pd.isna(cells["full"].loc[50.0, 1024])
    assert cells["snapkv"].shape == (1, 1)
    figs = niah_figures(tmp_path, pd.DataFrame(rows), ["snapkv", "full"])
    ax_titles = [ax.get_title() for ax in figs["niah_heatmap.png"].axes if ax.get_title()]
    assert ax_titles == ["snapkv (mean 0.0)", "full (mean 50.0)"]
    assert niah_figures(tmp_path, pd.DataFrame([{"run": "x", "status": "complete"}])) == {}


def test_length_beyond_the_model():
    class M:
        max_context = 4096

    with pytest.raises(DataError, match="8192, which does not fit model.max_context=4096"):
        NIAH(lengths=[1024, 8192]).check_model(M())
    NIAH(lengths=[1024, 4096]).check_model(M())
