"""Issue 38: a run stopped by what a cluster sends (SIGTERM; SIGUSR1/SIGUSR2 before a time limit) ends as Ctrl-C
does, one line and the shell's exit status, and resumes; a garbage line in predictions.jsonl is reported and kept
beside the file; a sweep_name cannot leave results/sweeps/; a directory or a device given as a data file says so.
The requeue of a timed-out SLURM job is in tests/test_slurm_cluster.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT

TINY = ["model=tiny_llama", "data.limit=8", "max_new_tokens=2", "progress=false", "threads=1"]  # 32 questions
RUN_NAME = "tiny_llama,full,wikisalad_easy,max_new_tokens=2"


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _stop_after(cwd: Path, sig: signal.Signals, after_lines: int = 3) -> tuple[subprocess.Popen, str, Path]:
    """Start the tiny run in ``cwd``, send ``sig`` once ``after_lines`` items are saved; (process, stderr,
    predictions.jsonl)."""
    proc = subprocess.Popen([sys.executable, "-m", "luka_bench", *TINY], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    pred = cwd / "results" / "runs" / RUN_NAME / "predictions.jsonl"
    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline:
        if pred.exists() and pred.read_bytes().count(b"\n") >= after_lines:
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    return proc, err, pred


def _stop_here_after(cwd: Path, sig: signal.Signals, capsys, after_lines: int = 3):
    """The same run through the same entry point in this process (``_main``), ``sig`` sent to this process by a
    watcher thread once ``after_lines`` items are saved (the handler runs in the main thread, between two
    bytecodes of the run, as in a process of its own); (exit status, stderr, predictions.jsonl)."""
    import threading

    pred = cwd / "results" / "runs" / RUN_NAME / "predictions.jsonl"
    done = threading.Event()

    def watch():
        deadline = time.time() + 240
        while not done.is_set() and time.time() < deadline:
            if pred.exists() and pred.read_bytes().count(b"\n") >= after_lines:
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        code, err = _main(TINY, cwd, capsys)
    finally:
        done.set()
        watcher.join()
    return SimpleNamespace(returncode=code), err, pred


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1", "SIGUSR2"])
def test_stop_signal_is_one_line_exit_128_plus_signal_and_the_folder_resumes(tmp_path, sig, capsys):
    """SIGTERM in a process of its own (the shell's exit status, then the same command resumes the folder);
    SIGUSR1 and SIGUSR2, which take the same path through ``StopGuard``, in this process (a fresh interpreter
    per signal costs ~6 s of imports)."""
    sig = getattr(signal, sig)
    if sig == signal.SIGTERM:
        proc, err, pred = _stop_after(tmp_path, sig)
    else:
        proc, err, pred = _stop_here_after(tmp_path, sig, capsys)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    assert "Traceback" not in err
    lines = _lines(pred)
    saved = len(lines)
    assert 3 <= saved < 32
    assert all(ln.endswith(b"\n") and "item_id" in json.loads(ln) for ln in lines)  # the last line is whole
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert last == (f"{sig.name}: interrupted: {saved}/32 items saved in {pred.parent}; run the same command to "
                    "resume"), err[-3000:]
    if sig != signal.SIGTERM:
        return
    code, again = _main(TINY, tmp_path, capsys)  # the same command again (here: in this process)
    assert code == 0 and f"resuming: {saved}/32 items done" in again, again[-3000:]
    ids = [json.loads(ln)["item_id"] for ln in _lines(pred)]
    assert len(ids) == 32 == len(set(ids))  # every item once
    assert json.loads((pred.parent / "metrics.json").read_text())["n_examples"] == 32


def test_stop_guard_leaves_handlers_set_by_others_and_restores_its_own():
    from luka_bench.stop_signals import StopGuard

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    mine = []
    signal.signal(signal.SIGUSR1, lambda *a: mine.append(a))  # someone else's handler (e.g. submitit's SIGTERM)
    try:
        with StopGuard("x") as g:
            assert signal.getsignal(signal.SIGTERM) == g.interrupt
            assert signal.getsignal(signal.SIGUSR1) is not g.interrupt
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    finally:
        signal.signal(signal.SIGUSR1, before[signal.SIGUSR1])


def test_under_submitit_its_requeue_handler_stays_and_says_one_line(tmp_path, monkeypatch, capsys):
    """Inside a submitit job submitit's preemption handler (checkpoint + ``scontrol requeue`` + exit) keeps the
    signal, wrapped only to print one line; the other user signal goes to it too; SIGTERM stays submitit's."""
    from luka_bench.stop_signals import StopGuard

    (tmp_path / "predictions.jsonl").write_text('{"item_id": "a"}\n{"item_id": "b"}\n')
    calls = []

    def requeue(signum, frame):  # what submitit's SignalHandler.checkpoint_and_try_requeue ends with
        calls.append(signum)
        sys.exit(-1)

    def bypass(signum, frame):
        calls.append(("bypass", signum))

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    signal.signal(signal.SIGUSR2, requeue)
    signal.signal(signal.SIGTERM, bypass)
    try:
        with StopGuard(tmp_path) as g:
            assert signal.getsignal(signal.SIGTERM) is bypass
            for sig in (signal.SIGUSR2, signal.SIGUSR1):
                with pytest.raises(SystemExit):
                    signal.getsignal(sig)(sig, None)
        assert signal.getsignal(signal.SIGUSR2) is requeue
        assert calls == [signal.SIGUSR2, signal.SIGUSR1] and g.signum == signal.SIGUSR1
        err = capsys.readouterr().err
        assert f"SIGUSR2: 2 items saved in {tmp_path}; submitit requeued the job, which resumes from there" in err
    finally:
        for s, h in before.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------------------------------------
# sweep_name stays inside results/sweeps/
# ---------------------------------------------------------------------------------------------------------

def _main(args: list[str], cwd: Path, capsys) -> tuple[int, str]:
    from luka_bench.__main__ import main

    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv, code = ["luka_bench", *args], 0
    try:
        os.chdir(cwd)
        main()
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name", ["../../../x", "a/../../x", "..", "", "."])
def test_a_sweep_name_that_leaves_results_sweeps_is_refused_in_one_line(tmp_path, capsys, name):
    project = tmp_path / "project"
    project.mkdir()
    code, err = _main(["-m", "model=tiny_llama", f"sweep_name={name}"], project, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: sweep_name={name!r} would put the sweep at ") and "hydra.sweep.dir" in lines[0]
    assert list(tmp_path.rglob("*")) == [project]  # nothing written, inside or outside the project


@pytest.mark.parametrize("name,where", [("paper/table1", "results/sweeps/paper/table1"),
                                        ("/tmp/x", "results/sweeps/tmp/x"), ("a/../b", "results/sweeps/b")])
def test_a_sweep_name_inside_results_sweeps_is_taken(name, where):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from luka_bench.errors import CONF_DIR, check_sweep_name

    assert check_sweep_name([f"sweep_name={name}"]) is None
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[f"sweep_name={name}"], return_hydra_config=True)
    assert os.path.normpath(cfg.hydra.sweep.dir) == where


# ---------------------------------------------------------------------------------------------------------
# a garbage line in predictions.jsonl: said in one line, kept beside the file, its item redone
# ---------------------------------------------------------------------------------------------------------

def test_a_garbage_line_in_the_middle_is_reported_kept_and_its_item_redone(tmp_path, capsys):
    from luka_bench.results import RunFolder

    rec = [json.dumps({"item_id": i, "prediction": "x"}) + "\n" for i in "abcd"]
    garbage = "{\"item_id\": \"c\", \"predic\x00GARBAGE\n"
    (tmp_path / "predictions.jsonl").write_text(rec[0] + rec[1] + garbage + rec[3], encoding="utf-8")
    folder = RunFolder(tmp_path, {"data": {"limit": 1}})
    assert set(folder.done) == {"a", "b", "d"}  # the lines after the garbage are kept; c will be redone
    assert (tmp_path / "predictions.jsonl").read_text(encoding="utf-8") == rec[0] + rec[1] + rec[3]
    assert (tmp_path / "predictions.jsonl.dropped").read_text(encoding="utf-8") == garbage
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(f"{tmp_path / 'predictions.jsonl'}: dropped line 3: not JSON ("), err
    assert err[0].endswith(f"; its item will be redone; the dropped line is kept in "
                           f"{tmp_path / 'predictions.jsonl.dropped'}")
    folder.close()
    # the re-read after Ctrl-C keeps its one line to itself, and the copy grows
    (tmp_path / "predictions.jsonl").write_text(rec[0] + "[1, 2]\n", encoding="utf-8")
    folder = RunFolder.__new__(RunFolder)
    folder.pred_path = tmp_path / "predictions.jsonl"
    assert set(folder.reread()) == {"a"} and capsys.readouterr().err == ""
    assert (tmp_path / "predictions.jsonl.dropped").read_text(encoding="utf-8") == garbage + "[1, 2]\n"
    from luka_bench.results import read_predictions

    (tmp_path / "predictions.jsonl").write_text(rec[0] + garbage + rec[1], encoding="utf-8")
    assert [r["item_id"] for r in read_predictions(tmp_path)] == ["a", "b"]  # the report reads past it too


# ---------------------------------------------------------------------------------------------------------
# a directory or a device given as a data file says what it is
# ---------------------------------------------------------------------------------------------------------

def _loaders(path: str):
    from luka_bench.data.babilong import BABILong, _haystack_text as babilong_haystack
    from luka_bench.data.longbench_v2 import LongBenchV2
    from luka_bench.data.pg19 import PG19
    from luka_bench.data.ruler_gen import read_haystack
    from luka_bench.data.wikisalad import load_squad_file

    return {
        "longbench_v2": lambda: LongBenchV2(source="file", path=path).examples(),
        "babilong": lambda: BABILong(task="qa1", source="file", path=path).examples(),
        "babilong haystack": lambda: babilong_haystack(path),
        "wikisalad": lambda: load_squad_file(path),
        "pg19": lambda: PG19(source="file", path=path),
        "ruler haystack": lambda: read_haystack(path),
    }


@pytest.mark.parametrize("loader", ["longbench_v2", "babilong", "babilong haystack", "wikisalad", "pg19",
                                    "ruler haystack"])
@pytest.mark.parametrize("kind", ["directory", "device", "missing"])
def test_a_directory_or_a_device_as_a_data_file_says_what_it_is(tmp_path, loader, kind):
    from luka_bench.data.base import DataError

    path, says = {"directory": (str(tmp_path), "is a directory"),
                  "device": ("/dev/null", "is a character device, not a regular file"),
                  "missing": (str(tmp_path / "nope.json"), "was not found")}[kind]
    with pytest.raises(DataError) as e:
        _loaders(path)[loader]()
    msg = str(e.value)
    assert "\n" not in msg and path in msg and says in msg, msg
    assert "allowed: " in msg


def test_a_directory_as_data_path_is_one_line_on_the_command_line(tmp_path, capsys):
    code, err = _main(["model=tiny_llama", "data=longbench_v2", "data.source=file", f"data.path={tmp_path}",
                       "progress=false", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and lines == [f"error: longbench_v2: data file {tmp_path} is a directory; allowed: a JSON or "
                                   "JSON-lines file"], err
