"""The index of the methods, ``methods/README.md``, is what ``scripts/method_index.py`` generates from the tree (one
row per config: card, config, code, kind, reference code, kvpress press, tests); every config has a card, a code file
and a test that names it, and every card is some config's."""
from __future__ import annotations

import difflib

from conftest import ROOT, load_script

INDEX = load_script("method_index")


def test_the_committed_index_is_the_generated_one():
    held = (ROOT / "methods" / "README.md").read_text(encoding="utf-8")
    made = INDEX.render()
    diff = "".join(list(difflib.unified_diff(held.splitlines(True), made.splitlines(True), "methods/README.md",
                                             "generated"))[:40])
    assert held == made, f"methods/README.md is not what the tree gives: run {INDEX.COMMAND}\n{diff}"


def test_every_config_has_a_card_code_and_a_test():
    rows = INDEX.rows()
    assert [r.name for r in rows] == sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))
    for r in rows:
        assert r.card.is_file(), f"{r.name}: no card {r.card.relative_to(ROOT)}"
        assert r.code and all(p.is_file() for p in r.code), f"{r.name}: code {r.code}"
        assert r.tests, f"{r.name}: no test file names it"
        assert all((ROOT / "tests" / t).is_file() for t in r.tests)
        assert r.kind and set(r.kind.split(" + ")) <= set(INDEX.KINDS), r.kind


def test_every_card_is_a_configs_card():
    cards = {p for p in (ROOT / "methods").glob("*.md") if p.name != "README.md"}
    assert cards == {r.card for r in INDEX.rows()}, "a card that no config of conf/method/ points to"


def test_kinds_follow_the_code():
    kind = {r.name: r.kind for r in INDEX.rows()}
    assert {n for n, k in kind.items() if k == "retrieval"} == {
        "arkvale", "clusterkv", "lychee", "oracle_topk", "quest", "shadowkv"}
    for name in ("snapkv", "knorm", "pyramidkv", "adakv", "finch", "expected_attention", "laser_kv", "laser_kv_exact"):
        assert kind[name] == "prefill", name
    for name in ("h2o", "streaming_llm", "luka_clustered", "luka_lined", "entropy_ols", "luka_mixed", "h2o_outer"):
        assert kind[name] == "decode-time", name
    assert kind["full"] == "exact"


def test_references_come_from_the_cards():
    rows = {r.name: r for r in INDEX.rows()}
    assert rows["quest"].reference == ("[mit-han-lab/Quest](https://github.com/mit-han-lab/Quest) at `01c1623`",)
    assert rows["adakv"].reference == ("`FFY0/AdaKV`",) and rows["adakv"].kvpress == "`AdaKVPress(SnapKVPress())`"
    assert rows["finch"].reference == ("NVIDIA kvpress",) and rows["finch"].kvpress == "`FinchPress`"
    assert rows["lychee"].reference == ("none public",)
    assert rows["laser_kv_exact"].reference == rows["laser_kv"].reference == ("`zer0-data/LASER-KV`",)
    assert rows["h2o_outer"].card.name == "layered.md" and rows["laser_kv_mp25"].card.name == "laser_kv_mp25.md"
    # a file path or a "key/value" in the lead is not a repository
    assert INDEX.references("Reference code: FFY0/AdaKV (`adaptive_snapkv/monkeypatch/snapkv_utils.py`); "
                            "softmax key/value pairs, `presses/tova_press.py`") == ("`FFY0/AdaKV`",)
