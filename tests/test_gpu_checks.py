"""``scripts/gpu_checks.sh`` (docs/gpu.md, "One prepared run"): the script a session lent a GPU runs first. Its
``env`` stage, in smoke mode on the CPU, must import what the run imports and decode two rows together through the
public API as it stands (a renamed argument would otherwise surface only on a GPU machine, minutes of its budget
later); an unknown stage is one line and exit 2."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _checks(tmp_path, *stages):
    env = {**os.environ, "GPU_CHECKS_SMOKE": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_checks.sh"), *stages], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_gpu_checks_env_stage_runs_here_in_smoke_mode(tmp_path):
    proc = _checks(tmp_path, "env")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "summary.txt").read_text().startswith("env: rc=0 in "), proc.stdout[-3000:]
    log = (tmp_path / "env.log").read_text()
    assert "two rows decoded together with h2o on cpu" in log and "transformers 5.23" in log, log[-2000:]


def test_an_unknown_stage_is_one_line_before_any_stage_runs(tmp_path):
    proc = _checks(tmp_path, "env", "bogus")
    assert proc.returncode == 2 and proc.stdout.strip() == \
        "gpu_checks: unknown stage 'bogus'; allowed: env, tests, bench, half", proc.stdout + proc.stderr
    assert not (tmp_path / "summary.txt").exists()  # env did not run first

