"""Every method config runs on every dataset config through the real runner (tiny model, one item each).

Both are discovered: every ``conf/method/*.yaml`` and every ``conf/data/*.yaml``. A data config says how to
shrink itself for this test in a comment line of its own, ``# tests: <overrides>`` (e.g. ``# tests: data.limit=1
data.max_tokens=300``): command-line overrides that make it one small offline item. A comment, so every
``instantiate(cfg.data)`` takes the file as it is; the line is also the command a user can try it with.
"""
from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import pytest

import luka_bench.run as R
from luka_bench.config import build
from luka_bench.methods.base import MethodConfigError
from conftest import CONF, compose

METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))
TESTS_LINE = re.compile(r"^# tests:(.*?)(?:\s+\(.*\))?\s*$", re.MULTILINE)


def shrink(data: str) -> list[str]:
    """The overrides of the ``# tests:`` line of conf/data/<data>.yaml (required: a dataset that does not say how
    to shrink itself would run whole, for minutes, in every method's test)."""
    found = TESTS_LINE.findall((CONF / "data" / f"{data}.yaml").read_text(encoding="utf-8"))
    assert len(found) == 1, f"conf/data/{data}.yaml needs one line '# tests: data.limit=1 ...' (see the README)"
    over = shlex.split(found[0])
    assert over and all(o.lstrip("+").startswith("data.") and "=" in o for o in over), (data, over)
    return over


@pytest.mark.parametrize("data", DATA)
def test_every_data_config_says_how_to_shrink_itself(data):
    cfg = compose(f"data={data}", *shrink(data))
    assert cfg.data.get("limit") is not None, "the tests line must bound data.limit"


# settings a method needs to run at all: FINCH's observation window is the question, inside the compressed prompt
NEEDS = {"finch": ["query_aware=true"]}


# a config that only changes settings of another method config (its first line of YAML is a ``defaults:`` list
# naming it, e.g. the LASER-KV paper's rows over conf/method/laser_kv.yaml) runs the same code on every dataset as
# its base: it is run on one dataset, the one its paper's table uses
VARIANTS = {m: "babilong" for m in METHODS if "\ndefaults:" in (CONF / "method" / f"{m}.yaml").read_text()}
# WikiSalad's difficulties are one dataset class with a longer pattern (more segments, more questions: very_hard asks
# 18 per item): every method runs on the easy one, which already asks several questions from one context-only cache;
# the harder ones run with full attention and the LuKA paper's method (their paper's table)
HARDER = {"wikisalad_medium", "wikisalad_hard", "wikisalad_very_hard"}
ON_HARDER = {"full", "luka_clustered"}
PAIRS = [(m, d) for m in METHODS for d in DATA if VARIANTS.get(m, d) == d and (d not in HARDER or m in ON_HARDER)]


def duo_pattern(tmp_path: Path) -> list[str]:
    """DuoAttention needs a learned head pattern, and none ships for the offline models (its config errors without
    one): a synthetic one in the reference's format (``full_attention_heads.tsv``, layers x KV heads) for the tiny
    model, and a window the short test prompts exceed."""
    model = compose("model=tiny_llama").model
    rows = [[(7 * i + 3 * j) % 10 / 10 for j in range(model.num_key_value_heads)]
            for i in range(model.num_hidden_layers)]
    (tmp_path / "full_attention_heads.tsv").write_text("\n".join("\t".join(map(str, r)) for r in rows) + "\n")
    return [f"method.pattern_path={tmp_path / 'full_attention_heads.tsv'}", "method.sink=4", "method.recent=32"]


# files a method needs to run at all, written into the test's tmp_path: the overrides that name them
def razor_cache(tmp_path: Path) -> list[str]:
    """RazorAttention caches its measured head scores on disk: in the test's folder, not the user's; a window the short
    test prompts exceed and a short scoring sequence."""
    return [f"method.heads_cache={tmp_path / 'razor_heads'}", "method.local=32", "method.score_length=32"]


NEEDS_FILES = {"duo_attention": duo_pattern, "razor_attention": razor_cache}


@pytest.mark.parametrize("method,data", PAIRS)
def test_method_runs_on_dataset(method, data, tmp_path):
    over = [f"method={method}", f"data={data}", "model=tiny_llama", "max_new_tokens=3", "progress=false",
            *NEEDS.get(method, []), *shrink(data),
            *(NEEDS_FILES[method](tmp_path) if method in NEEDS_FILES else [])]
    cfg = compose(*over)
    if method in NEEDS and build(cfg, "data").kind != "qa":  # no question to put in the prompt: refused up front
        with pytest.raises(MethodConfigError, match="query_aware=true") as e:
            R.run(cfg, tmp_path / "run")
        assert "\n" not in str(e.value) and not (tmp_path / "run" / "predictions.jsonl").exists()
        return
    m = R.run(cfg, tmp_path / "run")
    assert m["complete"] and m["n_examples"] >= 1
    headline = m["headline"]
    assert m[headline] is not None and math.isfinite(m[headline])
    assert m["kv_ratio"] > 0
    # read at most what is held: extra entries (summaries, synthetic pairs) count on both sides
    assert m.get("attended_ratio") is None or 0 < m["attended_ratio"] <= 1 + 1e-9, m["attended_ratio"]
    assert (Path(tmp_path / "run") / "metrics.json").exists()
