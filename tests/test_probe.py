"""The fidelity probe (luka_bench/probe/; its report luka_bench/probe_report.py): exact methods measure 0, replay
is faithful to a real run, LuKA declares what it attended, and every method config runs through it."""
from __future__ import annotations

import pytest
import torch

from luka_bench.data.base import Task
from hydra import compose as hcompose
from hydra import initialize_config_dir
from hydra.utils import instantiate
from omegaconf import open_dict

from luka_bench import probe as P
from luka_bench import probe_report as R
from luka_bench.errors import group_options
from luka_bench.methods.base import MethodConfigError

from conftest import CONF, compose, tiny


@pytest.fixture(scope="module")
def lm():
    return tiny("llama")


def _prompt(n_ctx=160, steps=6, seed=0, chunk=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 250, (n_ctx + chunk + steps,), generator=g).tolist()
    return P.Prompt("p", ids[:n_ctx], [ids[n_ctx:n_ctx + chunk]], [ids[n_ctx + chunk:]], steps)


@pytest.fixture(scope="module")
def cap(lm):
    return P.capture(lm, _prompt())


def _method(name, *overrides):
    return instantiate(compose(f"method={name}", *overrides).method)


def _df(obs):
    return R.frame(obs, "m")


def test_full_and_budget_one_methods_are_exact(cap):
    full = _df(P.replay(_method("full"), cap, topk=8))
    assert len(full) == 6 * 3 * cap.k[0].shape[1]  # steps x layers x KV heads
    assert full["rel_err"].max() == 0.0
    assert full["recall"].min() == 1.0 and (full["mass"] - 1).abs().max() < 1e-5 and full["held"].min() == 1.0
    for name in ("h2o", "luka_lined", "snapkv", "streaming_llm"):
        df = _df(P.replay(_method(name, "method.budget=1.0"), cap, topk=8))
        assert df["rel_err"].max() < 1e-5, name
        assert df["recall"].min() == 1.0, name


def test_evicting_method_is_measured_against_all_tokens(cap):
    df = _df(P.replay(_method("h2o", "method.budget=0.25"), cap, topk=8))
    assert df["held"].max() < 0.3 and df["rel_err"].mean() > 1e-3
    assert df["mass"].max() < 1.0 and df["recall"].min() < 1.0
    seen = 160 + 3 + df["step"]  # tokens seen at a step (question chunk is continuation step 0)
    assert (df["tokens"] <= df["held"] * seen + 1e-3).all()


def test_luka_attended_is_sink_tail_and_refined_pages(cap):
    # sink 4, pages of 8, tail 16: the prefill's 160 tokens make (160 - 4 - 16) // 8 = 17 pages (no compression
    # during the 7 forwards after it); refine the top-2 pages
    m = _method("luka_clustered", "method.sink=4", "method.page_size=8", "method.tail=16", "method.refine.k=2",
                "method.compress_every=100")
    df = _df(P.replay(m, cap, topk=8))
    pages = (160 - 4 - 16) // 8
    seen = 160 + 3 + df["step"]  # held raw tokens when the step is measured (the query included)
    tail = seen - (4 + pages * 8)
    # sink + tail + 2 refined pages of 8 raw tokens, plus every unrefined summary
    assert (df["tokens"] == 4 + tail + 2 * 8 + (pages - 2)).all()
    # refining every page with exact masses is exact attention
    m = _method("luka_clustered", "method.sink=4", "method.page_size=8", "method.tail=16",
                f"method.refine.k={pages}", "method.compress_every=100")
    df = _df(P.replay(m, cap, topk=8))
    assert df["rel_err"].max() < 1e-5 and df["recall"].min() == 1.0 and df["tokens"].eq(seen).all()


def test_replay_matches_a_real_run_at_the_first_layer(lm):
    # layer 0 sees the token embeddings only, so with forced tokens its Q/K/V are those of the capture: the
    # replay and the closed loop (the model generating with the method) must measure the same thing there.
    pr = _prompt(seed=1)
    cap = P.capture(lm, pr)
    m = _method("h2o", "method.budget=0.3")
    open_ = _df(P.replay(m, cap, topk=8))
    closed = _df(P.closed_loop(lm, m, pr, topk=8))
    a = open_[open_.layer == 0].reset_index(drop=True)
    b = closed[closed.layer == 0].reset_index(drop=True)
    assert len(a) == len(b) > 0
    for c in P.METRICS:
        if c not in P.NEEDLE:  # no needle here (NaN): see the needle tests
            assert (a[c] - b[c]).abs().max() < 1e-4, c
    assert closed[closed.layer > 0]["rel_err"].max() > 0  # later layers differ: errors compound in a real run


def test_capture_cache_round_trip(lm, tmp_path):
    pr = _prompt(n_ctx=40, steps=2, seed=2)
    a = P.capture(lm, pr, tmp_path, {"name": "tiny"})
    b = P.capture(lm, pr, tmp_path, {"name": "tiny"})
    assert len(list(tmp_path.glob("*.pt"))) == 1
    assert all(torch.equal(x, y) for x, y in zip(a.k + a.q, b.k + b.q))
    assert a.lengths == b.lengths == [[3, 1, 1]]


def test_a_cached_capture_is_in_the_models_dtype_as_a_fresh_one(lm, tmp_path):
    """A capture read back from ``probe.cache_dir`` (stored in float16 for an fp32 model) is in the model's dtype, as a
    fresh one is: the bytes read per step and the masses are the same from the first run and from the cache."""
    pr = _prompt(n_ctx=40, steps=2, seed=3)
    a = P.capture(lm, pr, tmp_path, {"name": "tiny"})
    b = P.capture(lm, pr, tmp_path, {"name": "tiny"})
    dtype = lm.model.dtype
    assert {x.dtype for x in a.q + a.k + a.v} == {x.dtype for x in b.q + b.k + b.v} == {dtype}
    assert all(torch.equal(x, y) for x, y in zip(a.v, b.v))


# the probe replays captured queries, keys and values without the model: a method that needs the model itself (its
# rotary embedding: expected_attention's un-rotation; razor_attention's head scores) or the question inside the
# prompt (finch) is refused with one line
NEEDS_THE_MODEL = {"expected_attention": "rotary embedding", "razor_attention": "retrieval heads", "finch": "query_aware"}


@pytest.mark.parametrize("name", group_options("method"))
def test_every_method_runs_through_the_probe(cap, name):
    m = _method(name, *(["method.pattern_seed=0", "method.sink=4", "method.recent=16"] if name == "duo_attention"
                        else []))
    if name in NEEDS_THE_MODEL:
        with pytest.raises(MethodConfigError, match=NEEDS_THE_MODEL[name]) as e:
            P.replay(m, cap, topk=8)
        assert "\n" not in str(e.value)
        return
    df = _df(P.replay(m, cap, topk=8))
    assert len(df) == 6 * 3 * cap.k[0].shape[1]
    assert df[[c for c in P.METRICS if c not in P.NEEDLE]].notna().all().all()
    assert df[list(P.NEEDLE)].isna().all().all()  # no needle in this prompt
    assert df["recall"].between(0, 1).all() and df["mass"].between(0, 1 + 1e-5).all()


def test_command_writes_tables(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = hcompose(config_name="probe", overrides=[
            "model=tiny_llama", "data=pg19", "data.max_tokens=120", "probe.steps=3", "probe.plot=true",
            f"probe.cache_dir={tmp_path / 'cache'}", "probe.methods=[full,\"h2o budget=0.5\"]"])
        with open_dict(cfg):
            cfg.model_name, cfg.data_name = "tiny_llama", "pg19"
        s = R.probe(cfg, tmp_path / "out", ["model=tiny_llama", "data=pg19", "data.max_tokens=120"])
        assert list(s.index) == ["full", "h2o budget=0.5"]
        assert s.loc["full", "rel_err"] == 0.0 and s.loc["h2o budget=0.5", "rel_err"] > 0
        for f in ("probe_summary.md", "probe_layers.csv", "probe_steps.csv", "probe_by_layer.png"):
            assert (tmp_path / "out" / f).exists()
        with pytest.raises(MethodConfigError, match="h20"):
            R.compose_method("h20", [])


def test_block_prefill_is_replayed_block_by_block(cap):
    # LASER-KV selects after each prefill block (after_forward); a replay that fed the context at once would
    # compress once at the end (or not at all). After the prefill every layer holds the closed form's count.
    from luka_bench.methods.laser_kv import held_tokens

    m = _method("laser_kv", "method.block_size=64", "method.budget=0.25")
    df = _df(P.replay(m, cap, topk=8))
    first = df[df["step"] == df["step"].min()]
    seen = cap.context + sum(cap.lengths[0][: int(first["step"].iloc[0]) + 1])
    held = first["held"] * seen
    expect = held_tokens(cap.context, 64, 0.25, 4) + seen - cap.context
    assert held_tokens(cap.context, 64, 0.25, 4) != held_tokens(cap.context, cap.context, 0.25, 4)  # blocks matter
    assert (held - expect).abs().max() < 1e-3, (held.unique(), expect)


def test_capture_keeps_the_token_ids(cap):
    pr = _prompt()
    assert cap.ids == pr.context + pr.chunks[0] + pr.forced[0]


# ------------------------------------------------------------------------------------------------ needle diagnostics

class _NeedleTask(Task):
    """A QA task of one example whose context has a planted needle; the context block wraps it in an instruction."""
    kind = "qa"

    def __init__(self, filler: str, needle: str, depth: float, on_question: bool = False):
        from luka_bench.data.base import QAExample, Question

        cut = int(len(filler) * depth)
        ctx = filler[:cut] + needle + filler[cut:]
        span = (cut, cut + len(needle))
        meta = {"needle_span": span}
        self.ex = QAExample("n0", ctx, [Question("n0/q", "What is the number?", ["7"],
                                                  meta if on_question else {})], {} if on_question else meta)

    def examples(self):
        return [self.ex]

    def context_block(self, ex):
        return "Remember the number.\n" + ex.context + "\n"

    def question_block(self, q):
        return q.question


FILLER = "the grass is green and the sky is blue. " * 5
NEEDLE = "The magic number is 7341."


@pytest.mark.parametrize("on_question", [False, True])
def test_needle_positions_are_the_span_tokens(lm, on_question):
    task = _NeedleTask(FILLER, NEEDLE, 0.5, on_question)
    (pr,) = P.prompts(lm, task, steps=2, questions=1)
    text = lm.tokenizer.decode(pr.context)  # byte tokenizer: one token per character (no chat template)
    first = text.index(NEEDLE)
    assert pr.needle == list(range(first, first + len(NEEDLE)))


def _needle_prompt(lm, depth):
    task = _NeedleTask(FILLER, NEEDLE, depth)
    (pr,) = P.prompts(lm, task, steps=4, questions=1)
    return pr


def test_needle_metrics_open_loop(lm):
    pr = _needle_prompt(lm, 0.5)
    cap = P.capture(lm, pr)
    full = _df(P.replay(_method("full"), cap, topk=8, needle=pr.needle))
    assert (full["needle_recall"] == 1).all()
    assert (full["needle_mass_read"] - full["needle_mass"]).abs().max() < 1e-6
    # the exact mass on the needle from the captured queries and keys (layer 1, first generated step)
    L, nd = 1, torch.tensor(pr.needle)
    at = cap.context + cap.lengths[0][0]  # the first single-token forward's query
    q, k = cap.q[L][0, :, at], cap.k[L][0, :, : at + 1]
    g = q.shape[0] // k.shape[0]
    w = torch.softmax((q.view(k.shape[0], g, 1, -1) @ k.transpose(-1, -2).unsqueeze(1)).squeeze(2) * cap.scaling,
                      -1).mean(1)  # [Hkv, seen]
    row = full[(full.layer == L) & (full.step == 1)].sort_values("head")
    assert torch.allclose(torch.tensor(row["needle_mass"].values), w[:, nd].sum(-1), atol=1e-5)
    # StreamingLLM keeps sinks and a recent window: a needle in the middle is never read, the mass is still there
    sl = _df(P.replay(_method("streaming_llm", "method.budget=0.2"), cap, topk=8, needle=pr.needle))
    assert (sl["needle_recall"] == 0).all() and (sl["needle_mass_read"] == 0).all()
    assert (sl["needle_mass"] - full["needle_mass"]).abs().max() < 1e-6  # open loop: the same queries
    assert sl["needle_mass"].min() > 0
    # the oracle reads the true top-k: what it reads of the needle is its share of the top-k
    ok = _df(P.replay(_method("oracle_topk", "method.token_budget=16"), cap, topk=16, needle=pr.needle))
    step = ok[ok.step >= 1]
    assert step["needle_recall"].between(0, 1).all() and (step["needle_recall"] < 1).any()
    assert (step["needle_mass_read"] <= step["needle_mass"] + 1e-6).all()


def test_needle_metrics_closed_loop_and_plot(lm, tmp_path):
    end = _needle_prompt(lm, 1.0)  # the needle is the context's last sentence: in StreamingLLM's recent window
    mid = _needle_prompt(lm, 0.5)
    m = _method("streaming_llm", "method.budget=0.25")
    assert (_df(P.closed_loop(lm, m, end, topk=8))["needle_recall"] == 1).all()
    df = _df(P.closed_loop(lm, m, mid, topk=8))
    assert (df["needle_recall"] == 0).all()
    full = _df(P.closed_loop(lm, _method("full"), mid, topk=8))
    frames = [R.frame(P.closed_loop(lm, _method("full"), mid, topk=8), "full"),
              R.frame(P.closed_loop(lm, m, mid, topk=8), "streaming_llm")]
    md, summary = R.write_tables(frames, {}, {}, tmp_path, 8, True, True, "test")
    assert "needle read" in md
    assert summary.loc["full", "needle_recall"] == 1.0 and summary.loc["streaming_llm", "needle_recall"] == 0.0
    assert (tmp_path / "probe_needle_by_layer.png").exists()
    assert full["needle_mass"].gt(0).all()


def test_probe_on_niah_gives_needle_metrics(tmp_path):
    """data=niah items carry meta needle_span: the probe finds the needle's tokens, the question chunk ends with
    the answer prefix as in a run, and the command writes the needle columns and plot."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        ov = ["model=tiny_llama", "data=niah", "data.limit=1", "data.lengths=[800]", "data.depths=[50]"]
        cfg = hcompose(config_name="probe", overrides=ov + [
            "probe.steps=2", "probe.plot=true", f"probe.cache_dir={tmp_path / 'cache'}",
            "probe.methods=[full,\"streaming_llm budget=0.25\"]"])
        with open_dict(cfg):
            cfg.model_name, cfg.data_name = "tiny_llama", "niah"
        task = instantiate(cfg.data)
        lm = instantiate(cfg.model).load()
        (pr,) = P.prompts(lm, task, 2, 1)
        (ex,) = task.examples()
        q = ex.questions[0]
        assert lm.tokenizer.decode([pr.context[j] for j in pr.needle]).strip() == \
            ex.context[q.meta["needle_span"][0]: q.meta["needle_span"][1]].strip()
        assert lm.tokenizer.decode(pr.chunks[0]).endswith(task.answer_prefix(q))
        s = R.probe(cfg, tmp_path / "out", ov)
        assert s.loc["full", "needle_recall"] == 1.0 and s.loc["streaming_llm budget=0.25", "needle_recall"] == 0.0
        assert (tmp_path / "out" / "probe_needle_by_layer.png").exists()
        assert "needle read" in (tmp_path / "out" / "probe_summary.md").read_text()
