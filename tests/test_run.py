"""The runner in-process on tiny models: resume, isolation between questions, perplexity protocol."""
from __future__ import annotations

import json
import math

import pytest
import torch

import luka_bench.engine as E
import luka_bench.run as R
from luka_bench.data.base import qa_prompt_ids
from luka_bench import metrics as M
from luka_bench.methods.full import Full
from luka_bench.methods.hf import attach
from luka_bench.methods.streaming_llm import StreamingLLM

from conftest import compose


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_does_not_redo_finished_items(tmp_path, monkeypatch):
    cfg = compose("model=tiny_llama", "data.limit=2", "max_new_tokens=3", "progress=false")
    first = R.run(cfg, tmp_path)
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines(keepends=True)
    n_items = len(lines)
    assert n_items == first["n_examples"] >= 4
    # interrupt: keep the first 3 items plus half a line, lose metrics.json
    (tmp_path / "predictions.jsonl").write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    (tmp_path / "metrics.json").unlink()
    calls = []
    real = E.answer_rows
    monkeypatch.setattr(E, "answer_rows", lambda lm, ready, *a, **k: calls.extend(ready) or real(lm, ready, *a, **k))
    again = R.run(cfg, tmp_path)
    assert len(calls) == n_items - 3
    recs = read_jsonl(tmp_path / "predictions.jsonl")
    assert [r["item_id"] for r in recs] == [json.loads(x)["item_id"] for x in lines]
    assert [r["prediction"] for r in recs] == [json.loads(x)["prediction"] for x in lines]
    assert again["em_lenient"] == first["em_lenient"] and again["n_examples"] == n_items
    # a third run finds everything done
    calls.clear()
    R.run(cfg, tmp_path)
    assert calls == []


def test_question_after_another_equals_alone(tiny_llama):
    """Isolation: the answer to question 2 must not depend on question 1 having been asked first."""
    lm = tiny_llama
    tok = lm.tokenizer
    ctx, q1 = qa_prompt_ids(tok, False, "some context text " * 8, "\nQuestion one?\nAnswer:")
    _, q2 = qa_prompt_ids(tok, False, "some context text " * 8, "\nAnother question?\nAnswer:")
    for method in (Full(), StreamingLLM(budget=0.3)):
        with attach(lm.model, method) as a:
            cache = a.new_cache()
            E.prefill(lm.model, ctx, cache)
            c1 = cache.clone()
            E.greedy_answer(lm.model, tok, c1, q1, 8, set(), ())
            after = E.greedy_answer(lm.model, tok, cache.clone(), q2, 8, set(), ())
            fresh = a.new_cache()
            E.prefill(lm.model, ctx, fresh)
            alone = E.greedy_answer(lm.model, tok, fresh, q2, 8, set(), ())
        assert after.token_ids == alone.token_ids
        assert c1.get_seq_length() > cache.get_seq_length()  # the first question really used its own copy


def test_chunked_prefill_equals_one_pass(tiny_qwen3):
    lm = tiny_qwen3
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    with attach(lm.model, Full()) as a:
        one = E.prefill(lm.model, ids, a.new_cache())
        chunked = E.prefill(lm.model, ids, a.new_cache(prefill_chunk=16))
    assert torch.allclose(one, chunked, atol=1e-4)


def test_teacher_forced_nll_equals_one_forward(tiny_llama):
    """The pg19 protocol with full attention equals the log-likelihood of one un-cached forward."""
    lm = tiny_llama
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with attach(lm.model, Full()) as a:
        nll, steps, _ = E.teacher_forced_nll(lm.model, a, ids)
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids]), use_cache=False).logits[0].float()
    ref = -torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert len(nll) == 39 and len(steps) == 38
    assert torch.allclose(torch.tensor(nll), ref, atol=1e-4)


def test_perplexity_is_token_weighted():
    # two documents: 1 token with NLL 4, 3 tokens with NLL 0 each -> exp(4/4) = e, not mean of exp(4), exp(0)
    assert M.perplexity([4.0, 0.0], [1, 3]) == pytest.approx(math.e)
    recs = [{"nll_sum": 4.0, "n_tokens": 1}, {"nll_sum": 0.0, "n_tokens": 3}]
    assert M.ppl_summary(recs)["perplexity"] == pytest.approx(math.e)
    with pytest.raises(ValueError):
        M.perplexity([], [])


def test_ppl_run_streaming_budget_one_equals_full(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 6)
    common = ["model=tiny_llama", "data=pg19", "data.source=file", f"data.path={text}", "data.max_tokens=200",
              "progress=false"]
    full = R.run(compose(*common), tmp_path / "full")
    stream = R.run(compose(*common, "method=streaming_llm", "method.budget=1.0"), tmp_path / "s1")
    small = R.run(compose(*common, "method=streaming_llm", "method.budget=0.25"), tmp_path / "s25")
    assert math.isfinite(full["perplexity"]) and full["n_tokens"] == 199
    assert stream["perplexity"] == pytest.approx(full["perplexity"], rel=1e-5)
    assert small["kv_ratio"] == pytest.approx(0.25, abs=0.01)
    assert full["kv_ratio"] == 1.0


def test_kv_summary_and_latency():
    recs = [{"kv_bytes_prefill": 10, "kv_bytes_peak": 30, "kv_bytes_full": 100, "ttft_s": 1.0, "tpot_s": 0.1},
            {"kv_bytes_prefill": 20, "kv_bytes_peak": 10, "kv_bytes_full": 100, "ttft_s": 3.0, "tpot_s": None}]
    kv = M.kv_summary(recs)
    assert kv["kv_ratio"] == pytest.approx(0.2)
    assert kv["kv_bytes"] == {"after_prefill": 15, "peak": 30}
    assert M.latency_summary(recs) == {"ttft_s": 2.0, "tpot_s": 0.1}


def test_a_new_null_setting_keeps_old_runs_resumable(tmp_path):
    from luka_bench.results import RunFolder, RunFolderError, config_difference

    old = {"method": {"budget": 0.25}, "data": {"limit": 5, "repeat": 1}, "threads": 1}
    # a setting added to the configs later (null by default) is the same run; a real value is not
    assert config_difference(old, {**old, "data": {"limit": 20, "repeat": 1, "target_chars": None}}) == []
    assert config_difference(old, {**old, "data": {"limit": 5, "repeat": 1, "target_chars": 5300}}) == [
        "data.target_chars: '<unset>' -> 5300"]
    assert config_difference(old, {**old, "method": {"budget": 0.5}}) == ["method.budget: 0.25 -> 0.5"]
    RunFolder(tmp_path / "r", old)
    RunFolder(tmp_path / "r", {**old, "data": {"limit": 5, "repeat": 1, "target_chars": None}})
    with pytest.raises(RunFolderError, match="method.budget: 0.25 -> 0.5"):
        RunFolder(tmp_path / "r", {**old, "method": {"budget": 0.5}})


def test_env_names_the_commit_the_process_loaded(tmp_path):
    """A sweep process keeps the code it imported; a commit made while it runs must not appear in the env.json of
    its later jobs (it did: RULER jobs of one sweep named three different commits)."""
    import subprocess

    from luka_bench import results as Rs

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    first = Rs.git_sha(repo)
    (repo / "f").write_text("2")
    subprocess.run([*git, "commit", "-qam", "two"], check=True)
    assert Rs.git_sha(repo) == first and first["git_sha"] and first["git_dirty"] is False
    assert Rs._read_git_sha(repo)["git_sha"] != first["git_sha"]  # HEAD did move


def test_query_aware_runs_on_a_qa_dataset_and_compresses_the_question_too(tmp_path):
    """``query_aware=true`` is a run setting for every QA dataset: the question is prefilled and compressed with
    the context, so a prefill-only method's cache after the prefill is a quarter of context + question minus the
    tail (what follows the question's text: at least one token, fed through the compressed cache)."""
    base = ("model=tiny_llama", "data.limit=1", "max_new_tokens=2", "progress=false", "method=streaming_llm",
            "method.budget=0.25")
    plain = R.run(compose(*base), tmp_path / "plain")
    aware = R.run(compose(*base, "query_aware=true"), tmp_path / "aware")
    assert plain["n_examples"] == aware["n_examples"] >= 2
    for p, a in zip(read_jsonl(tmp_path / "plain" / "predictions.jsonl"),
                    read_jsonl(tmp_path / "aware" / "predictions.jsonl")):
        assert p["kv_tokens_prefill"][0] == math.ceil(0.25 * p["context_tokens"])
        assert p["tail_tokens"] == p["question_tokens"] and 1 <= a["tail_tokens"] < a["question_tokens"]
        assert a["kv_tokens_prefill"][0] == math.ceil(
            0.25 * (a["context_tokens"] + a["question_tokens"] - a["tail_tokens"]))
    with pytest.raises(Exception, match="query_aware='yes' must be true, false or null"):
        R.run(compose(*base, "query_aware=yes"), tmp_path / "bad")


def test_device_peak_per_item_reaches_records_metrics_and_the_summary(tmp_path, monkeypatch):
    """On CUDA every item records the allocator's peak (reset before, read after); mocked here: the records,
    metrics.json and the closing table carry it, and each item's peak is reset before it is read."""
    import luka_bench.device as D

    calls = []
    monkeypatch.setattr(D, "reset_peak", lambda dev: calls.append("reset"))
    monkeypatch.setattr(D, "peak_allocated", lambda dev: calls.append("read") or 1000 * len(calls))
    cfg = compose("model=tiny_llama", "data.limit=1", "max_new_tokens=2", "progress=false")
    out = R.run(cfg, tmp_path)
    recs = read_jsonl(tmp_path / "predictions.jsonl")
    assert all(isinstance(r["device_peak_bytes"], int) for r in recs)
    assert out["device_peak_bytes"] == max(r["device_peak_bytes"] for r in recs)
    assert calls[0] == "reset" and calls.count("reset") == calls.count("read")
    from luka_bench.tables import run_summary

    assert "device_peak_bytes (allocated)" in run_summary(out, tmp_path)


def test_cuda_events_only_when_a_breakdown_is_asked_for():
    assert R.cache_settings(compose("model=tiny_llama"))["cuda_events"] is False
    assert R.cache_settings(compose("model=tiny_llama", "cuda_breakdown=true"))["cuda_events"] is True


def test_a_cuda_run_warms_up_before_its_first_timed_item(tmp_path, monkeypatch):
    """One throwaway prefill + decode (``engine.warm_up``) before the items, where the device needs it (CUDA;
    forced here), with the run's method."""
    import luka_bench.device as D

    seen = []
    monkeypatch.setattr(R, "warm_up_needed", lambda dev: True)
    monkeypatch.setattr(E, "warm_up", lambda model, method, tok: seen.append(type(method).__name__))
    R.run(compose("model=tiny_llama", "data.limit=1", "max_new_tokens=2", "progress=false", "method=h2o"), tmp_path)
    assert seen == ["H2O"]


@pytest.mark.parametrize("limit,max_tokens", [(1, 80), (3, 1024), (1, 2)])
def test_pg19_tokenizes_only_the_prefix_it_uses_and_gets_the_same_ids(smollm2_tokenizer, limit, max_tokens):
    """With ``limit`` set, pg19 tokenizes a prefix of the text (plus a margin) instead of all of it: the documents'
    ids equal the windows of the whole text's tokenization."""
    from luka_bench.data.pg19 import PG19, essays_text

    text = essays_text()
    whole = smollm2_tokenizer(text, add_special_tokens=False).input_ids
    seen = []

    def tok(t, **kw):
        seen.append(len(t))
        return smollm2_tokenizer(t, **kw)

    docs = PG19(source="essays", limit=limit, max_tokens=max_tokens).documents(tok)
    assert max(seen) < len(text) // 10  # a prefix, not the ~500K-token text
    want = [whole[s: s + max_tokens] for s in range(0, len(whole), max_tokens)][:limit]
    assert [d.meta["ids"] for d in docs] == want
