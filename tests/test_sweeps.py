"""Sweeps through the real entry point on the tiny model: a 2 x 2 multirun with the local (joblib) launcher,
its report, re-running it after losing a job, a sweep with a failing job, experiments and the SLURM launcher's
settings (checked against the sbatch script submitit would write; no cluster here)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONF

TINY = ["model=tiny_llama", "data.limit=1", "max_new_tokens=2", "progress=false", "threads=1"]
SWEEP = ["-m", "method=full,streaming_llm", "data=wikisalad_easy,wikisalad_medium", "sweep_name=grid", *TINY]
LOCAL = "hydra/launcher=local"  # joblib, 2 jobs at a time
FOLDERS = {f"data={d},max_new_tokens=2,method={m},model=tiny_llama"
           for m in ("full", "streaming_llm") for d in ("wikisalad_easy", "wikisalad_medium")}


def cli(*args: str, cwd: Path):
    return subprocess.run([sys.executable, "-m", "luka_bench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=400)


def cli_in(*args: str, cwd: Path):
    """The same command through the same entry point in this process, from ``cwd`` (the basic launcher runs
    its jobs in the calling process anyway; a fresh interpreter costs ~6 s of imports)."""
    import os

    from test_cli import cli_here

    here = os.getcwd()
    os.chdir(cwd)
    try:
        return cli_here(*args)
    finally:
        os.chdir(here)


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The 2 x 2 sweep, run once from an empty working folder (so the default results/sweeps/ is used)."""
    cwd = tmp_path_factory.mktemp("work")
    proc = cli(*SWEEP, LOCAL, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return cwd, cwd / "results" / "sweeps" / "grid", proc


def test_grid_sweep_folders_and_progress(grid):
    _, sweep, proc = grid
    runs = {p.name for p in sweep.iterdir() if p.is_dir()}
    assert runs == FOLDERS  # named by the job's overrides: no job number, no time
    for name in FOLDERS:
        m = json.loads((sweep / name / "metrics.json").read_text())
        assert m["complete"] is True and m["model"] == "tiny_llama"
    out = proc.stdout + proc.stderr
    assert "sweep grid: 4 jobs" in out and "JoblibLauncher" in out
    for i in range(1, 5):
        assert f"[grid] job {i}/4:" in out and f"[grid] job {i}/4 done" in out
    for name in FOLDERS:
        assert str(sweep / name) in out
    assert "python -m luka_bench.report results/sweeps/grid" in out


@pytest.mark.parametrize("metric", ["headline", "ttft_s"])
def test_grid_report_pivot_has_the_four_runs(grid, metric):
    from luka_bench import report

    _, sweep, _ = grid
    res = report.build(sweep, metric=metric, plots=False, echo=False)
    table = res["pivot"]
    assert list(table.index) == ["wikisalad_easy", "wikisalad_medium"]
    assert list(table.columns) == ["full", "streaming_llm"]
    for name in FOLDERS:
        m = json.loads((sweep / name / "metrics.json").read_text())
        want = m[m["headline"]] if metric == "headline" else m[metric]
        assert table.loc[m["data"], m["method"]] == pytest.approx(want)
    assert res["missing"].empty
    md = (sweep / "report" / f"pivot_{metric}.md").read_text()
    assert "wikisalad_medium" in md and "streaming_llm" in md


def test_rerun_runs_only_the_missing_job(grid):
    cwd, sweep, _ = grid
    lost = sweep / "data=wikisalad_medium,max_new_tokens=2,method=streaming_llm,model=tiny_llama"
    kept = {n: (sweep / n / "metrics.json").stat().st_mtime_ns for n in FOLDERS if n != lost.name}
    preds = {n: (sweep / n / "predictions.jsonl").read_text() for n in FOLDERS}
    (lost / "metrics.json").unlink()  # as if the sweep was killed while this job was finishing
    # the same sweep again (with the basic launcher: one process, quicker to start; the folders are the same)
    proc = cli_in(*SWEEP, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert out.count("already complete") == 3
    assert f"{lost}: already complete" not in out
    assert json.loads((lost / "metrics.json").read_text())["complete"] is True
    for n, t in kept.items():
        assert (sweep / n / "metrics.json").stat().st_mtime_ns == t
    # the lost job's items were all in predictions.jsonl already: resumed, not redone
    assert (lost / "predictions.jsonl").read_text() == preds[lost.name]


def test_a_failing_job_does_not_sink_the_sweep(tmp_path):
    # `full` refuses budget 0.5: that job fails, the other still runs (basic launcher: one process, in order)
    proc = cli_in("-m", "method=full,streaming_llm", "method.budget=0.5", "sweep_name=fails", *TINY, cwd=tmp_path)
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "[fails] job 1/2 FAILED" in out and "not allowed for 'full'" in out
    # the sweep ends with one line per failed job, not with Hydra's traceback of the first failure
    assert "Traceback" not in out and "HYDRA_FULL_ERROR" not in out
    assert "error: 1 job(s) of sweep fails failed" in out
    assert "job 2/2 done" in out
    sweep = tmp_path / "results" / "sweeps" / "fails"
    ok = sweep / "max_new_tokens=2,method.budget=0.5,method=streaming_llm,model=tiny_llama"
    bad = sweep / "max_new_tokens=2,method.budget=0.5,method=full,model=tiny_llama"
    assert json.loads((ok / "metrics.json").read_text())["complete"] is True
    assert (bad / "config.yaml").exists() and not (bad / "metrics.json").exists()
    assert "not allowed for 'full'" in (bad / "error.txt").read_text()

    from luka_bench import report

    res = report.build(sweep, plots=False, echo=False)
    assert list(res["missing"]["run"]) == [bad.name]
    assert res["missing"]["status"].iloc[0].startswith("failed: MethodConfigError")
    assert res["pivot"].loc["wikisalad_easy", "streaming_llm"] == pytest.approx(
        json.loads((ok / "metrics.json").read_text())["em_lenient"])


def compose_multirun(*overrides: str):
    from hydra import compose, initialize_config_dir

    from luka_bench.config import register_resolvers

    register_resolvers()  # as the command line does before Hydra composes
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def test_experiment_sets_sweep_name_params_and_values():
    cfg = compose_multirun("+experiment=readme")
    assert cfg.hydra.sweep.dir == "results/sweeps/readme"
    assert cfg.hydra.sweeper.params.method == "full,streaming_llm,h2o,snapkv"
    assert cfg.data.limit == 5 and cfg.hydra.runtime.choices.model == "smollm2_135m"
    assert cfg.hydra.runtime.choices.experiment == "readme"
    # every experiment names its sweep after itself, so a re-run lands in the same folder
    for path in sorted((CONF / "experiment").glob("*.yaml")):
        text = path.read_text()
        assert text.startswith("# @package _global_"), path
        assert f"\nsweep_name: {path.stem} " in text or f"\nsweep_name: {path.stem}\n" in text, path


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_composes_into_its_own_sweep_folder(name):
    cfg = compose_multirun(f"+experiment={name}")
    assert cfg.hydra.sweep.dir == f"results/sweeps/{name}"  # resolvable in the launching process
    assert cfg.hydra.sweeper.params  # it sweeps something


def test_sweep_dir_from_sweep_name_and_subdir_from_overrides():
    cfg = compose_multirun("sweep_name=abc")
    assert cfg.hydra.sweep.dir == "results/sweeps/abc"
    from omegaconf import OmegaConf

    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${hydra.job.override_dirname}"
    excluded = set(cfg.hydra.job.config.override_dirname.exclude_keys)
    assert {"sweep_name", "threads", "progress", "data.limit", "logger", "experiment"} <= excluded


def test_slurm_launcher_settings_reach_sbatch(tmp_path, monkeypatch):
    """Every SLURM setting of conf/hydra/launcher/slurm.yaml is overridable and lands in the sbatch script."""
    import submitit
    import os

    fake_bin = tmp_path / "bin"  # submitit insists on finding `srun`; nothing is submitted here
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 0\n")
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    from omegaconf import OmegaConf

    cfg = compose_multirun("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.account=lab",
                           "hydra.launcher.gpus_per_node=2", "hydra.launcher.cpus_per_task=6",
                           "hydra.launcher.mem_gb=32", "hydra.launcher.timeout_min=90",
                           "hydra.launcher.array_parallelism=3", "sweep_name=s",
                           "hydra.launcher.setup=['module load cuda','export HF_HOME=/scratch/hf']")
    lc = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert lc["_target_"].endswith("SlurmLauncher")
    # what hydra_submitit_launcher.BaseSubmititLauncher.launch does with these settings
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    lc.pop("_target_")
    ex = submitit.AutoExecutor(folder=tmp_path / "%j", cluster="slurm", slurm_max_num_timeout=lc.pop("max_num_timeout"))
    lc.pop("submitit_folder")
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    ex.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in lc.items()})
    script = ex._executor._make_submission_file_text("python -u -m x", "uid")
    for line in ("--partition=gpu", "--account=lab", "--gpus-per-node=2", "--cpus-per-task=6", "--mem=32GB",
                 "--time=90", "module load cuda", "export HF_HOME=/scratch/hf"):
        assert line in script, (line, script)
    assert ex._executor.parameters["array_parallelism"] == 3  # becomes --array=0-<n-1>%3 for an n-job sweep
