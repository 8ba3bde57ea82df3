import pytest

from luka_bench.metrics import exact_match, f1_score, lenient_match, normalize_answer, qa_scores


def test_normalize_answer():
    assert normalize_answer("The Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("  A  cat,   an apple; the end. ") == "cat apple end"
    assert normalize_answer("12,400") == "12400"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words
    assert normalize_answer("") == ""


def test_exact_match():
    assert exact_match("The Eiffel Tower", ["eiffel tower"]) == 1.0
    assert exact_match("Eiffel Tower.", "the eiffel tower") == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert exact_match("Paris", ["London", "paris"]) == 1.0  # max over golds


def test_paris_france_vs_paris():
    assert lenient_match("Paris, France", ["Paris"]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert f1_score("Paris, France", ["Paris"]) == pytest.approx(2 / 3)


def test_lenient_containment_both_ways():
    assert lenient_match("1843", ["1843 metres"]) == 1.0  # gold contains prediction
    assert lenient_match("It was founded in 1843.", ["1843"]) == 1.0  # prediction contains gold
    assert lenient_match("1844", ["1843"]) == 0.0


def test_empty_prediction():
    assert exact_match("", ["Paris"]) == 0.0
    assert lenient_match("", ["Paris"]) == 0.0  # "" is in every string: must not count
    assert lenient_match("the", ["Paris"]) == 0.0  # normalises to ""
    assert f1_score("", ["Paris"]) == 0.0


def test_unanswerable_gold_is_empty_string():
    assert exact_match("", []) == 1.0
    assert f1_score("", []) == 1.0
    assert lenient_match("", []) == 1.0
    assert exact_match("Paris", []) == 0.0
    assert lenient_match("Paris", []) == 0.0
    assert f1_score("Paris", []) == 0.0
    assert lenient_match("Paris", ["the"]) == 0.0  # an empty normalised gold never contains/is contained


def test_f1_max_over_golds_and_token_counts():
    assert f1_score("blue whale", ["whale", "blue whale"]) == 1.0
    assert f1_score("red red fox", ["red fox"]) == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert f1_score("a b c", ["d e"]) == 0.0
    assert f1_score("The cat sat", ["cat sat on mat"]) == pytest.approx(2 * 1 * 0.5 / 1.5)


def test_qa_scores_keys():
    s = qa_scores("Paris, France", ["Paris"])
    assert s == {"em": 0.0, "em_lenient": 1.0, "f1": pytest.approx(2 / 3)}
