"""Tracking: the tracker calls made by a run (start, running logs, finish also on a crash), W&B offline runs
read back from their files (summary = the final metrics; finished with the right exit code), mode `auto`."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest

import luka_bench.engine as E
import luka_bench.run as R
from luka_bench import tracking

from conftest import compose

TINY = ("model=tiny_llama", "data.limit=1", "max_new_tokens=2", "progress=false", "threads=1")


class Recorder:
    def __init__(self):
        self.calls = []

    def start(self, config):
        self.calls.append(("start", config))

    def log(self, step, metrics):
        self.calls.append(("log", step, metrics))

    def finish(self, metrics, exit_code):
        self.calls.append(("finish", metrics, exit_code))


@pytest.fixture()
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(tracking, "build", lambda cfg, run_dir: rec)
    return rec


def test_run_calls_the_tracker(tmp_path, recorder):
    metrics = R.run(compose(*TINY), tmp_path)
    kinds = [c[0] for c in recorder.calls]
    assert kinds[0] == "start" and kinds[-1] == "finish" and kinds.count("log") == metrics["n_examples"]
    assert recorder.calls[0][1]["model_name"] == "tiny_llama" and "logger" in recorder.calls[0][1]
    steps = [c[1] for c in recorder.calls if c[0] == "log"]
    assert steps == list(range(1, metrics["n_examples"] + 1))
    last_log = [c for c in recorder.calls if c[0] == "log"][-1][2]
    assert last_log["em_lenient"] == metrics["em_lenient"] and "kv_ratio" in last_log
    assert recorder.calls[-1][1:] == (metrics, 0)


def test_crash_still_finishes_the_tracker(tmp_path, recorder, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(E, "answer_rows", boom)
    with pytest.raises(RuntimeError, match="boom"):
        R.run(compose(*TINY), tmp_path)
    assert recorder.calls[-1] == ("finish", None, 1)


def test_finished_run_is_skipped_without_a_tracker(tmp_path, recorder):
    cfg = compose(*TINY)
    first = R.run(cfg, tmp_path)
    recorder.calls.clear()
    assert R.run(cfg, tmp_path) == first
    assert recorder.calls == []


def test_logger_and_sweep_name_are_not_part_of_the_run(tmp_path):
    import yaml

    R.run(compose(*TINY), tmp_path)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert "logger" not in saved and "sweep_name" not in saved
    # another logger on the same folder is the same run: found complete, nothing redone
    assert R.finished_metrics(tmp_path, R.run_config(compose(*TINY, "logger=wandb"))) is not None
    assert R.finished_metrics(tmp_path, R.run_config(compose(*TINY, "data.limit=2"))) is None
    assert R.finished_metrics(tmp_path, R.run_config(compose(*TINY, "threads=2"))) is not None
    assert R.finished_metrics(tmp_path, R.run_config(compose(*TINY, "seed=1"))) is None


def test_default_logger_is_none():
    cfg = compose(*TINY)
    t = tracking.build(cfg, "/tmp/x")
    assert isinstance(t, tracking.NullTracker)


def test_mode_auto_is_offline_without_login(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert tracking.WandbTracker(mode="auto").resolved_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert tracking.WandbTracker(mode="auto").resolved_mode() == "online"
    assert tracking.WandbTracker(mode="offline").resolved_mode() == "offline"
    with pytest.raises(ValueError, match="logger.mode='sometimes'"):
        tracking.WandbTracker(mode="sometimes")


# ---------------------------------------------------------------------------------------------------------
# W&B offline, read back from the run's .wandb file (the LevelDB-style log wandb writes: 7-byte file header,
# 32 KiB blocks, records of <crc32 u32, length u16, type u8> + protobuf chunks)
# ---------------------------------------------------------------------------------------------------------

def wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos: pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL / FIRST start a record, MIDDLE / LAST continue it
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
    return out


def offline_run(wandb_dir: Path):
    import wandb

    wandb.teardown()  # wandb-core writes the run file asynchronously: wait until its service has flushed it
    runs = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    import json

    recs = wandb_records(runs[0])
    summary = {}
    for r in recs:
        if r.WhichOneof("record_type") == "summary":
            for u in r.summary.update:
                summary[u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
    exits = [r.exit for r in recs if r.WhichOneof("record_type") == "exit"]
    run = [r.run for r in recs if r.WhichOneof("record_type") == "run"][0]
    history_keys = {i.key or "/".join(i.nested_key) for r in recs if r.WhichOneof("record_type") == "history"
                    for i in r.history.item}
    return summary, exits, run, history_keys


@pytest.fixture()
def wandb_env(tmp_path, monkeypatch):
    d = tmp_path / "wandb_dir"
    d.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(d))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return d


def test_wandb_offline_summary_holds_the_final_metrics(tmp_path, wandb_env):
    cfg = compose(*TINY, "logger=wandb", "logger.mode=offline", "logger.tags=[t1]", "logger.group=g")
    metrics = R.run(cfg, tmp_path / "run")
    summary, exits, run, history = offline_run(wandb_env)
    assert len(exits) == 1 and exits[0].exit_code == 0
    for k in ("em", "em_lenient", "f1", "kv_ratio", "n_examples", "ttft_s"):
        assert summary[k] == pytest.approx(metrics[k]), k
    assert summary["kv_bytes/peak"] == metrics["kv_bytes"]["peak"]
    assert run.run_group == "g" and list(run.tags) == ["t1"] and run.display_name == "run"
    assert {"running/em_lenient", "running/kv_ratio"} <= history
    assert any(k.startswith("plots/") for k in history)
    assert not (tmp_path / "run" / "wandb").exists()  # WANDB_DIR wins over the run folder


def test_wandb_run_is_finished_when_the_run_crashes(tmp_path, wandb_env, monkeypatch):

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(E, "answer_rows", boom)
    cfg = compose(*TINY, "logger=wandb", "logger.mode=offline")
    with pytest.raises(RuntimeError, match="boom"):
        R.run(cfg, tmp_path / "run")
    summary, exits, _, _ = offline_run(wandb_env)
    assert len(exits) == 1 and exits[0].exit_code == 1
    assert "em" not in summary
