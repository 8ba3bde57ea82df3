"""The clients on batches (issue 60): the runner's ``batch_size`` (QA and perplexity) gives every item the record it
gets alone, in the dataset's order, and an interrupted batch loses nothing already written."""
from __future__ import annotations

import json

import pytest
import torch

import luka_bench.engine as E
import luka_bench.run as R
from luka_bench.errors import RunConfigError
from luka_bench.methods.hf import attach
from luka_bench.methods.h2o import H2O

from conftest import compose

SAME = ("item_id", "prediction", "raw_output", "scores", "new_tokens", "kv_bytes_prefill", "kv_bytes_peak",
        "kv_bytes_full", "kv_tokens")


def records(folder):
    return [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]


def test_a_qa_run_in_batches_gives_each_item_its_record_alone_and_resumes_an_interrupted_batch(tmp_path,
                                                                                             monkeypatch):
    base = ["model=tiny_llama", "data.limit=3", "max_new_tokens=4", "progress=false", "method=h2o",
            "method.budget=0.5"]
    one = R.run(compose(*base), tmp_path / "one")
    alone = records(tmp_path / "one")
    assert len(alone) >= 6
    real, calls = E.answer_rows, []

    def stop_on_second(lm, ready, *a, **k):  # the second batch is interrupted
        calls.append(len(ready))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(lm, ready, *a, **k)

    monkeypatch.setattr(E, "answer_rows", stop_on_second)
    with pytest.raises(KeyboardInterrupt):
        R.run(compose(*base, "batch_size=4"), tmp_path / "four")
    first = records(tmp_path / "four")
    assert calls == [4, 4] and len(first) == 4  # the first batch written, whole
    # batches run longest first (the examples by context length): the first batch's questions are the longest
    lengths = sorted((r["context_tokens"] for r in alone), reverse=True)
    assert sorted((r["context_tokens"] for r in first), reverse=True) == lengths[:4]
    assert [r["item_id"] for r in first] != [r["item_id"] for r in alone[:4]]  # not the dataset's order
    monkeypatch.setattr(E, "answer_rows", real)
    four = R.run(compose(*base, "batch_size=4"), tmp_path / "four")
    together = records(tmp_path / "four")
    assert [[r[k] for k in SAME] for r in together] == [[r[k] for k in SAME] for r in alone]
    assert four["em_lenient"] == one["em_lenient"] and four["n_examples"] == one["n_examples"]
    with pytest.raises(RunConfigError, match=r"^batch_size=0 must be an integer >= 1"):
        R.run(compose(*base, "batch_size=0"), tmp_path / "bad")


def test_perplexity_of_documents_of_different_lengths_in_one_batch_is_each_documents_alone(tiny_llama, one_thread):
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (60, 25, 80)]
    with attach(tiny_llama.model, H2O(budget=0.25)) as a:
        alone = [E.teacher_forced_nll(tiny_llama.model, a, d) for d in docs]
        together = E.teacher_forced_nll_rows(tiny_llama.model, a, docs)
    for (nll, _, c), (nll_b, steps_b, c_b) in zip(alone, together):
        assert len(nll_b) == len(nll) and len(steps_b) == len(nll) - 1
        torch.testing.assert_close(torch.tensor(nll_b), torch.tensor(nll), rtol=0, atol=1e-4)
        assert c_b.held_tokens() == c.held_tokens() and c_b.held_bytes() < c_b.full_bytes()


def test_bench_batch_measures_every_batch_size_for_stock_and_our_methods(tmp_path):
    """``scripts/bench_batch.py`` on a tiny model: RULER prompts of different lengths, each method and stock at
    every batch size, a table with each method's batch-2 / batch-1 ratio, the JSON and the plot written."""
    from conftest import load_script

    bench = load_script("bench_batch")
    out = tmp_path / "b.json"
    bench.main(["--model", "tiny_llama", "--batches", "1,2", "--steps", "3", "--methods", "full", "h2o",
                "--rounds", "1", "--length", "1200", "--tasks", "niah_single_1,fwe", "--json", str(out), "--plot"])
    res = json.loads(out.read_text())
    assert set(res["tokens_per_s"]) == {"stock", "full", "h2o"} and res["batches"] == [1, 2]
    assert all(v > 0 for row in res["tokens_per_s"].values() for v in row.values())
    assert len(set(res["prompt_tokens"])) > 1 and out.with_suffix(".png").stat().st_size > 0
    assert "| h2o |" in bench.table(res)


@pytest.mark.parametrize("name", ["h2o", "snapkv", "adakv", "entropy_ols"])
def test_smollm2_prompts_of_different_lengths_decoded_together_give_the_tokens_alone(name):
    """The real small model (fp32), H2O (its layers stacked evicting: ``methods/stacked.py``), SnapKV (stacked, one
    masked SDPA over the rows right-aligned), AdaKV (its packed layers stacked as the rows' packings:
    ``stacked_packed.py``) and entropy-OLS (stacked selecting, its synthetic entries stacked:
    ``entropy_ols_stacked.py``) at a quarter: four essay passages of ~80 to ~260 tokens
    with a question each, decoded as the rows of one batch — every answer's tokens identical to the passage's answer
    alone (a batched matrix product rounds otherwise than one row's; no near-tie flipped a token in these
    prompts)."""
    import luka_bench as lb
    from luka_bench.data.pg19 import essays_text

    lm = lb.load_model("smollm2_135m")
    text = essays_text()
    contexts = [text[at: at + size] for at, size in ((0, 1100), (5000, 350), (9000, 750), (14000, 550))]
    question = "What is this passage about? Answer in one sentence."
    with lb.attach(lm, lb.method(name, budget=0.25)) as kv:
        alone = [kv.generate(c, question, max_new_tokens=8) for c in contexts]
        together = kv.generate_many(contexts, [question] * 4, max_new_tokens=8, batch_size=4)
    assert len({a.context_tokens for a in alone}) == 4
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids and len(a.token_ids) > 0
        assert t.kv_tokens == a.kv_tokens and t.kv_ratio == a.kv_ratio


def test_rows_alone_script_checks_every_row_and_calls_only_near_ties_flips(tmp_path):
    """``scripts/rows_alone.py`` (every config on a real model in the committed table): on the tiny model, rows of
    different lengths decoded together equal each alone, written as JSON and a table; its rule: a row that differs
    passes only as a near-tie (the solo run's top-two margin below 1e-4 at the first differing step, the manual
    solo decode giving ``generate``'s tokens), else the config DIFFERS and the script exits 1."""
    from conftest import load_script

    ra = load_script("rows_alone")
    out = tmp_path / "r.json"
    assert ra.main(["--model", "tiny_llama", "--methods", "h2o", "streaming_llm", "--rows", "3", "--new", "3",
                    "--scale", "0.1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"h2o", "streaming_llm"}
    assert all(r["equal"] and r["kv_equal"] for v in res.values() for r in v["rows"])
    assert len({r["prompt_tokens"] for r in res["h2o"]["rows"]}) == 3
    assert "| h2o | 3/3 | 3/3 | — | identical |" in out.with_suffix(".md").read_text()
    flip = {"equal": False, "step": 2, "solo_matches_generate": True}
    assert ra.verdict({"rows": [{"equal": True}, {**flip, "margin": 5e-5}]}) == "near-tie flips only"
    assert ra.verdict({"rows": [{**flip, "margin": 3e-2}]}) == "DIFFERS"
    assert ra.verdict({"rows": [{**flip, "margin": 5e-5, "solo_matches_generate": False}]}) == "DIFFERS"
