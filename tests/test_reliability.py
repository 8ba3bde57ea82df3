"""Reliability as a new user meets it (issue 15): every bad input stops with one line (``error: ...``), a
non-zero exit and its run folder byte-identical; a finished run never loses results; resume survives a cut
multi-byte character; an unreachable W&B server costs seconds, not minutes; the report of a sweep with no
complete run lists the missing jobs; SQuAD v2's rule for gold answers that normalise to empty.

The command line runs in this process (``luka_bench.__main__.main`` with ``sys.argv`` set): a new interpreter
per case would cost ~5-15 s of imports each on a loaded machine. ``assert_bad_input`` is the one check every
bad-input case goes through: exit code, one ``error:`` line and no traceback, every file hashed before and after.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

TINY = ["model=tiny_llama", "data.limit=2", "max_new_tokens=2", "progress=false", "threads=1"]


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------

def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file below ``folder`` (relative path -> digest); {} when it does not exist."""
    if not folder.exists():
        return {}
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def cli(args: list[str], capsys, cwd: Path | None = None) -> tuple[int, str, str]:
    """``python -m luka_bench <args>`` in this process: (exit code, stdout, stderr)."""
    from hydra.core.global_hydra import GlobalHydra

    from luka_bench.__main__ import main

    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = ["luka_bench", *args]
    code = 0
    try:
        if cwd is not None:
            os.chdir(cwd)
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
        GlobalHydra.instance().clear()
    out, err = capsys.readouterr()
    return code, out, err


def assert_bad_input(args: list[str], folder: Path, capsys, *needles: str, cwd: Path | None = None) -> str:
    """Run ``args`` (in ``cwd``); assert exit 2, exactly one line on stderr (``error: ...``, naming every needle),
    no traceback, and ``folder`` byte-identical (every file hashed before and after). Returns the line."""
    before = snapshot(folder)
    code, out, err = cli(args, capsys, cwd=cwd)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, out[-2000:], err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "Traceback" not in err + out
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert snapshot(folder) == before, "the run folder changed"
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run (2 WikiSalad examples = 8 questions) and its file hashes."""
    from test_cli import cli_here  # the command line's entry point, in this process

    d = tmp_path_factory.mktemp("finished")
    proc = cli_here(*TINY, f"hydra.run.dir={d}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((d / "metrics.json").read_text())["n_examples"] == 8
    return d


def _count(path: Path) -> int:
    return sum(1 for _ in path.open(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------------------
# 1. a smaller data.limit never rewrites a finished run
# ---------------------------------------------------------------------------------------------------------

def test_smaller_limit_on_a_finished_run_is_refused(finished, capsys):
    line = assert_bad_input([*TINY, "data.limit=1", f"hydra.run.dir={finished}"], finished, capsys,
                            "data.limit=2", "data.limit=1")
    assert "new hydra.run.dir" in line
    assert _count(finished / "predictions.jsonl") == 8


def test_smaller_limit_in_a_sweep_rerun_keeps_every_job(tmp_path, capsys):
    sweep = ["-m", "model=tiny_llama", "method=full,streaming_llm", "max_new_tokens=2", "progress=false",
             "threads=1", f"hydra.sweep.dir={tmp_path / 'sw'}"]
    code, _, err = cli([*sweep, "data.limit=2"], capsys)
    assert code == 0, err[-3000:]
    keep = {d.name: {f: snapshot(d)[f] for f in ("config.yaml", "metrics.json", "predictions.jsonl")}
            for d in (tmp_path / "sw").iterdir() if d.is_dir()}
    assert len(keep) == 2
    code, _, err = cli([*sweep, "data.limit=1"], capsys)
    assert code == 2
    assert "error: 2 job(s) of sweep sw failed" in err and err.count("data.limit=1 would rewrite") >= 2
    assert "Traceback" not in err
    for name, files in keep.items():
        now = snapshot(tmp_path / "sw" / name)
        assert {f: now[f] for f in files} == files  # results, config and predictions untouched
    # the same limit again: both complete, skipped; the stale error files go
    code, out, err = cli([*sweep, "data.limit=2"], capsys)
    assert code == 0 and (out + err).count("already complete") == 2
    assert not list((tmp_path / "sw").glob("*/error.txt"))


# ---------------------------------------------------------------------------------------------------------
# 2, 3, 6. bad settings: one line, exit 2, the finished folder byte-identical
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override,needles", [
    ("data.limit=0", ["data.limit=0", ">= 1"]),
    ("data.limit=-3", ["data.limit=-3", ">= 1"]),
    ("max_new_tokens=0", ["max_new_tokens=0", ">= 1"]),
    ("max_new_tokens=-1", ["max_new_tokens=-1", ">= 1"]),
    ("model.dtype=float8", ["model.dtype='float8'", "bfloat16"]),
    ("model.device=cuda", ["model.device='cuda'", "no CUDA GPU"]),
    ("model.device=gpu", ["model.device='gpu'", "cpu"]),
    ("model.arch=mamba", ["model.arch='mamba'", "llama, qwen3, gemma3"]),
    ("seed=abc", ["seed='abc'", "integer"]),
    ("threads=abc", ["threads='abc'", "integer"]),
    ("threads=0", ["threads=0", ">= 1"]),
    ("prefill_chunk=-1", ["prefill_chunk=-1", ">= 0"]),
])
def test_bad_setting_is_one_line_and_leaves_the_run(finished, capsys, override, needles):
    if override == "model.device=cuda":
        import torch

        if torch.cuda.is_available():
            override, needles = "model.device=cuda:99", ["model.device='cuda:99'", "CUDA device"]
    assert_bad_input([*TINY, override, f"hydra.run.dir={finished}"], finished, capsys, *needles)


def test_max_new_tokens_zero_in_a_fresh_folder_writes_nothing(tmp_path, capsys):
    run = tmp_path / "r"
    assert_bad_input([*TINY, "max_new_tokens=0", f"hydra.run.dir={run}"], run, capsys, "max_new_tokens=0")
    assert not (run / "config.yaml").exists()


def test_max_new_tokens_is_what_is_generated(tmp_path):
    """max_new_tokens=1 generates at most one token (it used to fall back to the dataset's 24 when falsy)."""
    import luka_bench.run as R
    from conftest import compose

    R.run(compose("model=tiny_llama", "data.limit=1", "max_new_tokens=1", "progress=false"), tmp_path)
    recs = [json.loads(ln) for ln in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert recs and all(r["new_tokens"] <= 1 for r in recs)


def test_unwritable_run_dir_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert_bad_input([*TINY, f"hydra.run.dir={blocker}/run"], tmp_path, capsys, "hydra.run.dir=", "is a file")


def test_unwritable_logger_dir_is_one_line(finished, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert_bad_input([*TINY, "logger=wandb", "logger.mode=offline", f"logger.dir={blocker}/wandb",
                      f"hydra.run.dir={finished}"], finished, capsys, "logger.dir=", "is a file")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir", "logger.dir"])
def test_output_dir_in_proc_is_one_line(finished, capsys, key):
    """/proc refuses new folders even to root, for whom os.access says it is writable: Hydra's own mkdir used
    to end in a traceback (exit 1)."""
    args = [*TINY, f"{key}=/proc/luka_bench_x/y", f"hydra.run.dir={finished}"]
    if key == "hydra.run.dir":
        args = [*TINY, f"{key}=/proc/luka_bench_x/y"]
    elif key == "hydra.sweep.dir":
        args = ["-m", *TINY, f"{key}=/proc/luka_bench_x/y"]
    else:
        args = [*TINY, "logger=wandb", "logger.mode=offline", *args[len(TINY):]]
    assert_bad_input(args, finished, capsys, f"{key}=/proc/luka_bench_x/y", "/proc")
    assert not Path("/proc/luka_bench_x").exists()


def test_writable_dir_probe_leaves_nothing(tmp_path):
    from luka_bench.errors import writable_dir_problem

    assert writable_dir_problem(tmp_path / "a" / "b") is None
    assert writable_dir_problem(tmp_path) is None
    assert list(tmp_path.iterdir()) == []
    if Path("/proc/self").is_dir():
        assert "/proc" in writable_dir_problem("/proc")  # exists, but takes no new folders (root included)


def test_unwritable_logger_dir_set_in_a_config_is_one_line(finished, tmp_path, capsys, monkeypatch):
    """The same check when the folder does not come from the command line (the tracker checks it)."""
    from luka_bench.errors import RunConfigError
    from luka_bench.tracking import WandbTracker

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(RunConfigError, match="logger.dir=.*is a file"):
        WandbTracker(mode="offline", dir=str(blocker / "wandb"))


# ---------------------------------------------------------------------------------------------------------
# 4. resume after a crash that cut the last line inside a multi-byte character
# ---------------------------------------------------------------------------------------------------------

def test_resume_drops_a_last_line_cut_inside_a_utf8_character(tmp_path):
    from luka_bench.results import RunFolder

    good = json.dumps({"item_id": "a", "prediction": "café"}, ensure_ascii=False) + "\n"
    cut = (json.dumps({"item_id": "b", "prediction": "naïve ☃"}, ensure_ascii=False) + "\n").encode("utf-8")
    cut = cut[: cut.index("☃".encode("utf-8")) + 1]  # one byte of a three-byte character
    (tmp_path / "predictions.jsonl").write_bytes(good.encode("utf-8") + cut)
    folder = RunFolder(tmp_path, {"data": {"limit": 1}})
    assert set(folder.done) == {"a"} and folder.done["a"]["prediction"] == "café"
    assert (tmp_path / "predictions.jsonl").read_bytes() == good.encode("utf-8")


def test_resume_through_the_cli_after_a_cut_character(finished, tmp_path, capsys):
    import shutil

    run = tmp_path / "r"
    shutil.copytree(finished, run)
    (run / "metrics.json").unlink()
    lines = (run / "predictions.jsonl").read_bytes().splitlines(keepends=True)
    last = lines[-1].replace(b'"prediction": "', '"prediction": "\u00e9\u00e9'.encode("utf-8"), 1)
    (run / "predictions.jsonl").write_bytes(b"".join(lines[:-1]) + last[: last.index(b"\xc3") + 1])
    code, out, err = cli([*TINY, f"hydra.run.dir={run}"], capsys)
    assert code == 0, err[-3000:]
    assert json.loads((run / "metrics.json").read_text())["n_examples"] == 8
    assert _count(run / "predictions.jsonl") == 8


# ---------------------------------------------------------------------------------------------------------
# 5. W&B server unreachable: offline within seconds, once per sweep
# ---------------------------------------------------------------------------------------------------------

def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused
    return port


def test_unreachable_wandb_server_falls_back_offline_within_seconds(tmp_path, monkeypatch, capsys):
    from luka_bench import tracking

    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # "logged in": mode auto goes online
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(tracking, "_unreachable", {})
    sweep = tmp_path / "sweep"
    times = []
    for job in ("job1", "job2"):
        t = tracking.WandbTracker(mode="auto", log_plots=False)
        t.run_dir, t.sweep_name = sweep / job, "sweep"
        (sweep / job).mkdir(parents=True)
        assert t.resolved_mode() == "online"
        t0 = time.perf_counter()
        t.start({"x": 1})
        times.append(time.perf_counter() - t0)
        assert t.run is not None and t.run.settings.mode == "offline"
        t.finish({"em": 1.0}, 0)
        if job == "job1":
            assert (sweep / tracking.REACH_FILE).exists()  # the other jobs of the sweep (other processes) read it
            tracking._unreachable.clear()
    err = capsys.readouterr().err
    assert err.count("logging offline") == 2 and "unreachable" in err
    assert max(times) < 20, times  # wandb.init's own wait for a dead server is ~90 s
    assert list(sweep.glob("job*/wandb/offline-run-*"))


def test_server_probe_is_fast_and_names_the_host():
    from luka_bench.tracking import server_problem

    t0 = time.perf_counter()
    why = server_problem(f"http://127.0.0.1:{_closed_port()}", timeout=3)
    assert why is not None and "127.0.0.1" in why and time.perf_counter() - t0 < 3.5


# ---------------------------------------------------------------------------------------------------------
# 7. report of a sweep with no complete run
# ---------------------------------------------------------------------------------------------------------

def test_report_with_no_complete_run_lists_the_missing_jobs(tmp_path, capsys):
    import yaml

    from luka_bench.report import main

    for name, method in (("data=easy,method=full", "full"), ("data=easy,method=h2o", "h2o")):
        d = tmp_path / name
        d.mkdir()
        cfg = {"model": {}, "method": {"budget": 1.0}, "data": {"limit": 1}, "model_name": "tiny_llama",
               "method_name": method, "data_name": "wikisalad_easy"}
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
        (d / "predictions.jsonl").write_text('{"item_id": "q1"}\n')
    (tmp_path / "data=easy,method=h2o" / "error.txt").write_text("MethodConfigError: method.budget=2 ...\n")
    assert main([str(tmp_path), "--no-plots"]) == 2
    out, err = capsys.readouterr()
    assert "2 run(s) without complete metrics" in out
    assert "data=easy,method=full: no metrics.json (1 items done)" in out
    assert "data=easy,method=h2o: failed: MethodConfigError" in out
    errs = [ln for ln in err.splitlines() if ln.strip()]
    assert len(errs) == 1 and errs[0].startswith("error: no complete run below") and "headline_value" not in err
    assert (tmp_path / "report" / "missing.csv").read_text().count("wikisalad_easy") == 2


# ---------------------------------------------------------------------------------------------------------
# 8. data files are checked before the model loads
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture()
def no_model_load(monkeypatch):
    """Any model load fails the test: bad data must be found first."""
    from luka_bench import models

    def boom(self):
        raise AssertionError("the model was loaded before the data was checked")

    for cls in (models.TinyRandomModel, models.HubModel, models.GGUFPackageModel):
        monkeypatch.setattr(cls, "load", boom)


@pytest.mark.parametrize("data,content,needle", [
    ("data=wikisalad_easy", None, "not found"),
    ("data=wikisalad_easy", "{not json", "not valid JSON"),
    ("data=wikisalad_easy", '{"version": "v2.0"}', "field 'data'"),
    ("data=longbench_v2", None, "not found"),
    ("data=longbench_v2", '[{"_id": "x"}]', "missing required field"),
    ("data=babilong", None, "not found"),
    ("data=pg19", b"\xff\xfe not utf-8 \xc3", "UTF-8"),
])
def test_bad_data_file_is_found_before_the_model_loads(tmp_path, capsys, no_model_load, data, content, needle):
    f = tmp_path / ("data.txt" if data == "data=pg19" else "data.json")
    if isinstance(content, bytes):
        f.write_bytes(content)
    elif content is not None:
        f.write_text(content)
    run = tmp_path / "run"
    assert_bad_input(["model=tiny_llama", data, "data.source=file", f"data.path={f}", "progress=false",
                      f"hydra.run.dir={run}"], run, capsys, needle)
    assert not (run / "config.yaml").exists()


# ---------------------------------------------------------------------------------------------------------
# 9. SQuAD v2 scoring: gold answers that normalise to empty are dropped
# ---------------------------------------------------------------------------------------------------------

def test_golds_that_normalise_to_empty_are_dropped():
    from luka_bench.metrics import exact_match, f1_score, lenient_match, qa_scores

    # "The" normalises to "": the official SQuAD v2 script drops it, so an empty prediction does not match
    assert exact_match("", ["The", "Paris"]) == 0.0
    assert f1_score("", ["the", "Paris"]) == 0.0
    assert lenient_match("", ["A", "Paris"]) == 0.0
    assert exact_match("Paris", ["The", "Paris"]) == 1.0
    # no gold left: unanswerable, only the empty prediction matches
    assert qa_scores("", ["the", "."]) == {"em": 1.0, "em_lenient": 1.0, "f1": 1.0}
    assert exact_match("Paris", ["the"]) == 0.0
    assert exact_match("", []) == 1.0


# ---------------------------------------------------------------------------------------------------------
# 10. what method.budget bounds: kv_ratio_context for every evicting method, kv_ratio for those evicting while
#     decoding (SnapKV keeps the question and the answer on top of its compressed context)
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def budget_runs(tmp_path_factory):
    import luka_bench.run as R
    from conftest import compose

    out = {}
    for m in ("streaming_llm", "h2o", "luka_lined", "snapkv"):
        d = tmp_path_factory.mktemp(m)
        metrics = R.run(compose("model=tiny_llama", f"method={m}", "method.budget=0.125", "data=wikisalad_hard",
                                "data.limit=1", "max_new_tokens=4", "progress=false"), d)
        recs = [json.loads(ln) for ln in (d / "predictions.jsonl").read_text().splitlines()]
        out[m] = (metrics, recs)
    return out


@pytest.mark.parametrize("method", ["streaming_llm", "h2o", "luka_lined", "snapkv"])
def test_budget_bounds_the_context_share_for_every_evicting_method(budget_runs, method):
    metrics, recs = budget_runs[method]
    slack = 1 / min(r["context_tokens"] for r in recs)  # ceil(budget * n) rounds up by less than one token
    # luka_lined (recent_budget: on_top, the paper's reading): 1/8 heavy hitters + the 128-token tail on top
    tail = [128 / r["context_tokens"] if method == "luka_lined" else 0.0 for r in recs]
    assert 0.125 + min(tail) - slack <= metrics["kv_ratio_context"] <= 0.125 + max(tail) + slack
    for r, t in zip(recs, tail):
        assert r["kv_bytes_prefill"] <= (0.125 + t + slack) * r["kv_bytes_full_prefill"]
    if method == "snapkv":  # compresses once, then keeps every question and answer token: above its budget
        assert metrics["kv_ratio"] > metrics["kv_ratio_context"] + 0.01
    else:  # evicts at every step: the decode peak stays within the budget too
        assert metrics["kv_ratio"] <= 0.125 + max(tail) + slack


def test_issue_repro_snapkv_reports_its_context_share(budget_runs):
    """`method=snapkv method.budget=0.125 data=wikisalad_hard`: kv_ratio (decode peak) above 1/8 as the card says,
    kv_ratio_context at 1/8 like the methods that evict while decoding."""
    snap = budget_runs["snapkv"][0]
    h2o = budget_runs["h2o"][0]
    assert snap["kv_ratio_context"] == pytest.approx(h2o["kv_ratio_context"])
    assert snap["kv_ratio"] > h2o["kv_ratio"]


def test_a_setting_the_class_does_not_take_is_one_line(finished, capsys):
    assert_bad_input([*TINY, "+model.arch_typo=llama", f"hydra.run.dir={finished}"], finished, capsys,
                     "model.arch_typo is not a setting of model=tiny_llama", "arch")


# ---------------------------------------------------------------------------------------------------------
# 10. issue 26: a run's folder is named by its settings (resume, already complete), Ctrl-C, hub checks,
#     a key a method does not have, the sweep's closing hint
# ---------------------------------------------------------------------------------------------------------

RUN_NAME = "tiny_llama,full,wikisalad_easy,max_new_tokens=2"  # threads, progress, data.limit: not in the name


def test_same_command_finds_its_folder_and_says_already_complete(tmp_path, capsys):
    code, out, err = cli([*TINY, "data.limit=1"], capsys, cwd=tmp_path)
    assert code == 0, err[-3000:]
    runs = tmp_path / "results" / "runs"
    assert [p.name for p in runs.iterdir()] == [RUN_NAME]
    before = snapshot(runs)
    code, out, err = cli([*TINY, "data.limit=1", "threads=2"], capsys, cwd=tmp_path)
    assert code == 0 and f"{RUN_NAME}: already complete" in out
    assert snapshot(runs) == before
    code, out, err = cli([*TINY, "data.limit=1", "method=h2o", "method.budget=0.5"], capsys, cwd=tmp_path)
    assert code == 0
    assert sorted(p.name for p in runs.iterdir()) == [RUN_NAME, "tiny_llama,h2o,wikisalad_easy,max_new_tokens=2,"
                                                                "method.budget=0.5"]


def test_run_dir_name_is_short_enough_for_any_file_system():
    from luka_bench.results import run_dir_name

    long = ",".join(f"method.setting_{i}={'x' * 20}" for i in range(20))
    a, b = run_dir_name("m", "k", "d", long), run_dir_name("m", "k", "d", long + ",seed=1")
    assert len(a) <= 180 and len(b) <= 180 and a != b
    assert run_dir_name("m", "k", "d", "data=d,method=k,x=a/b") == "m,k,d,x=a_b"


def test_ctrl_c_is_one_line_exit_130_and_the_same_command_resumes(tmp_path, capsys):
    import signal
    import subprocess

    args = [*TINY, "data.limit=8"]  # 32 questions: the signal lands while questions are being answered
    proc = subprocess.Popen([sys.executable, "-m", "luka_bench", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    pred = tmp_path / "results" / "runs" / RUN_NAME / "predictions.jsonl"
    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline:
        if pred.exists() and pred.read_bytes().count(b"\n") >= 3:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.02)
    out, err = proc.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    saved = _count(pred)
    assert 3 <= saved < 32
    assert lines[-1] == (f"interrupted: {saved}/32 items saved in {pred.parent}; run the same command to resume")
    code, out, err = cli(args, capsys, cwd=tmp_path)
    assert code == 0 and f"resuming: {saved}/32 items done" in err
    assert json.loads((pred.parent / "metrics.json").read_text())["n_examples"] == 32 == _count(pred)


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """A hub endpoint where nothing listens and an empty hub cache."""
    from huggingface_hub import constants

    from luka_bench import hub

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    monkeypatch.setattr(hub, "_problems", {})
    return tmp_path


@pytest.mark.parametrize("args,needle", [
    (["model=qwen3_0_6b"], "Qwen/Qwen3-0.6B is not in the local cache"),
    (["data=longbench_v2", "data.source=hf"], "THUDM/LongBench-v2 is not in the local cache"),
    (["data=babilong", "data.source=hf"], "RMT-team/babilong is not in the local cache"),
    (["data.source=squad_v2"], "rajpurkar/squad_v2 is not in the local cache"),
])
def test_unreachable_hub_is_one_line_within_seconds_and_leaves_no_folder(no_hub, capsys, args, needle):
    import luka_bench.run  # noqa: F401 - imports (torch, transformers) are not what is timed
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    t0 = time.perf_counter()
    line = assert_bad_input([*TINY, *args], no_hub / "results", capsys, needle, "127.0.0.1", "unreachable",
                            cwd=no_hub)
    assert time.perf_counter() - t0 < 15  # transformers / datasets alone retry for 60-90 s
    assert not (no_hub / "results").exists() and line


def test_a_cached_hub_model_needs_no_hub(no_hub, monkeypatch):
    from luka_bench import hub

    (Path(no_hub / "hub_cache") / "models--org--name").mkdir(parents=True)
    assert hub.unavailable("org/name") is None and hub.unavailable(str(no_hub)) is None
    assert "org/other is not in the local cache" in hub.unavailable("org/other")


@pytest.mark.parametrize("plus", ["", "+"])
def test_a_key_the_method_does_not_have_is_one_line_with_or_without_plus(finished, capsys, plus):
    line = assert_bad_input([*TINY, "method=h2o", f"{plus}method.foo=1", f"hydra.run.dir={finished}"], finished,
                            capsys, "method.foo is not a setting of method=h2o", "recent_fraction")
    import dataclasses

    from luka_bench.methods.h2o import H2O

    allowed = ", ".join(f.name for f in dataclasses.fields(H2O) if f.init)
    assert line == f"error: method.foo is not a setting of method=h2o; allowed: {allowed}"  # both forms alike


@pytest.mark.parametrize("arg, needles", [
    ("foo=1", ["foo is not a setting of a run", "batch_size", "method.budget=0.25"]),
    ("batchsize=8", ["batchsize is not a setting of a run (did you mean batch_size?)", "threads"]),
    ("results_dir.x=1", ["results_dir.x is not a setting of a run", "hydra.*"]),
    ("experiment=budgets", ["experiment=budgets needs a plus: +experiment=budgets", "luka_table1"]),
])
def test_a_key_the_run_does_not_have_is_one_line(finished, capsys, arg, needles):
    """A top-level key the run has not (Hydra's own message: a multi-line struct error naming no allowed key), or an
    experiment without its plus: one line naming it and what is allowed; the finished run untouched."""
    assert_bad_input([*TINY, arg, f"hydra.run.dir={finished}"], finished, capsys, *needles)


def test_sweep_hint_names_the_python_that_works(monkeypatch, tmp_path):
    import shutil

    from luka_bench import tracking

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no python on PATH: the venv is not active
    assert tracking.python_command() == os.path.abspath(sys.executable)
    monkeypatch.setattr(shutil, "which", lambda name: str(Path(sys.executable).parent / name))
    assert tracking.python_command() == "python"
    monkeypatch.chdir(Path(sys.executable).parent.parent.parent)  # the venv's parent: a relative path
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/python")
    assert tracking.python_command() == os.path.relpath(os.path.abspath(sys.executable))


# ---------------------------------------------------------------------------------------------------------
# 11. one process per run folder: two sweeps on one sweep_name once appended to the same predictions.jsonl
# ---------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def hold(run: Path):
    """``run`` opened by another process (``RunFolder`` of its own config.yaml), held until the block ends.
    Yields that process's pid."""
    import subprocess

    config = (run / "config.yaml").read_text(encoding="utf-8")
    code = ("import sys, yaml; from luka_bench.results import RunFolder; "
            f"f = RunFolder({str(run)!r}, yaml.safe_load({config!r})); print('held', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc.pid
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def test_a_folder_in_use_is_refused_and_left_alone(finished, tmp_path, capsys):
    """An interrupted run (metrics.json gone, one prediction dropped: a resume would write) held by another
    process: opening it, checking it and running the command line on it are all refused with one line naming
    the holder, and the folder stays byte-identical. Once the holder ends, the same command resumes it."""
    import shutil

    import yaml

    from luka_bench.results import RunFolder, RunFolderBusy

    run = tmp_path / "r"
    shutil.copytree(finished, run)
    (run / "metrics.json").unlink()
    lines = (run / "predictions.jsonl").read_bytes().splitlines(keepends=True)
    (run / "predictions.jsonl").write_bytes(b"".join(lines[:-1]))
    config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    with hold(run) as pid:
        before = snapshot(run)
        with pytest.raises(RunFolderBusy, match=f"in use by another process \\(pid {pid}\\)"):
            RunFolder(run, config)
        with pytest.raises(RunFolderBusy):  # prepare's check (writes nothing) refuses it too
            RunFolder.check(run, config)
        line = assert_bad_input([*TINY, f"hydra.run.dir={run}"], run, capsys, str(run),
                                "in use by another process", f"pid {pid}")
        assert "new hydra.run.dir" in line
        assert snapshot(run) == before and not (run / "error.txt").exists()
    code, out, err = cli([*TINY, f"hydra.run.dir={run}"], capsys)  # free again: resumes
    assert code == 0, err[-3000:]
    assert _count(run / "predictions.jsonl") == 8 and (run / "metrics.json").exists()
    with RunFolder(run, config):  # the finished run released its lock
        pass


def test_a_sweep_skips_a_folder_in_use_and_runs_the_others(tmp_path, capsys):
    """The defect: two sweeps on one sweep_name both ran a job and appended to one predictions.jsonl. Now the
    second sweep leaves the held job's folder byte-identical (no error.txt the report would read as a failure),
    runs the free job, and exits 2 naming the busy one."""
    sweep = ["-m", "model=tiny_llama", "method=full,streaming_llm", "max_new_tokens=2", "progress=false",
             "threads=1", f"hydra.sweep.dir={tmp_path / 'sw'}"]
    code, _, err = cli([*sweep, "data.limit=1"], capsys)
    assert code == 0, err[-3000:]
    runs = [d for d in (tmp_path / "sw").iterdir() if (d / "config.yaml").exists()]
    full, = [d for d in runs if "method=full," in d.name]
    other, = [d for d in runs if "method=streaming_llm," in d.name]
    n_other = _count(other / "predictions.jsonl")
    with hold(full):
        before = snapshot(full)
        code, out, err = cli([*sweep, "data.limit=2"], capsys)
        assert code == 2, (out[-2000:], err[-2000:])
        assert "error: 1 job(s) of sweep sw failed" in err and "in use by another process" in err, err[-2000:]
        assert full.name in err and "Traceback" not in err
        assert snapshot(full) == before and not (full / "error.txt").exists()
    assert _count(other / "predictions.jsonl") > n_other  # the free job ran (extended to data.limit=2)
