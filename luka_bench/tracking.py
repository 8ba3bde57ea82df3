"""Experiment tracking and sweep progress.

A tracker is built from ``conf/logger/<name>.yaml`` via ``_target_`` (``logger=none``, the default, or
``logger=wandb``) and has three calls, made by ``luka_bench.run.run``:

    start(config)              the resolved config, before any work
    log(step, metrics)         running metrics after every finished item (step = items done)
    finish(metrics, exit_code) final metrics (None after a crash); always called, from a ``finally``

``SweepProgress`` is a Hydra callback (``hydra.callbacks`` in conf/config.yaml): in a multirun it prints the
sweep's folder and job count, one line per job as it starts (``job 3/8``, its overrides and its run folder) and
as it ends, and a closing summary with the report command.
"""
from __future__ import annotations

import io
import math
import netrc
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from hydra.experimental.callback import Callback

from luka_bench.hub import REACH_TIMEOUT_S, server_problem  # noqa: F401 (one reachability check)


# ---------------------------------------------------------------------------------------------------------
# Trackers
# ---------------------------------------------------------------------------------------------------------

class NullTracker:
    """``logger=none``: nothing leaves the run folder."""

    logs_items = False  # the runner computes running metrics only for a tracker that logs them

    run_dir: Path | None = None
    sweep_name: str | None = None

    def start(self, config: dict) -> None:
        pass

    def log(self, step: int, metrics: dict) -> None:
        pass

    def finish(self, metrics: dict | None, exit_code: int) -> None:
        pass


def flatten(d: dict, prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """Nested metrics as flat scalar keys (``kv_bytes/peak``); None and non-finite values dropped."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + sep, sep))
        elif isinstance(v, bool) or v is None:
            if v is not None:
                out[key] = v
        elif isinstance(v, (int, float)):
            if not (isinstance(v, float) and not math.isfinite(v)):
                out[key] = v
        elif isinstance(v, str):
            out[key] = v
    return out


# How long a W&B server may take to accept a connection before a run logs offline instead (seconds).
# A sweep's jobs share what the first one found: the server answered or not (<sweep folder>/REACH_FILE; one
# process per job with the local and SLURM launchers), so an unreachable server costs one timeout per sweep.
REACH_FILE = ".wandb_unreachable"
_unreachable: dict[str, str] = {}  # base URL -> why, for this process


def wandb_base_url() -> str:
    return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")


def wandb_logged_in() -> bool:
    """True when W&B has an API key to use (the WANDB_API_KEY variable or a `wandb login` entry for its host).
    Only whether one exists is checked; the key itself is left to wandb."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


@dataclass
class WandbTracker:
    """``logger=wandb``. ``mode: auto`` goes online only when logged in, else offline (nothing is sent; upload
    later with ``wandb sync``); an online start that fails (no network) falls back to offline. ``group``
    defaults to the sweep's name, so every job of a sweep lands in one W&B group."""

    project: str = "luka_bench"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    name: str | None = None
    mode: str = "auto"
    dir: str | None = None
    log_plots: bool = True
    run_dir: Path | None = None
    sweep_name: str | None = None

    def __post_init__(self) -> None:
        from luka_bench.errors import RunConfigError

        allowed = ("auto", "online", "offline", "disabled")
        if self.mode not in allowed:
            raise RunConfigError(f"logger.mode={self.mode!r} is unknown; allowed: {', '.join(allowed)}")
        if self.dir:
            from luka_bench.errors import check_writable_dir

            check_writable_dir("logger.dir", self.dir)
        self.run = None

    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        env = os.environ.get("WANDB_MODE")
        if env in ("online", "offline", "disabled"):
            return env
        return "online" if wandb_logged_in() else "offline"

    def _reach_file(self) -> Path | None:
        return Path(self.run_dir).parent / REACH_FILE if self.sweep_name and self.run_dir else None

    def _unreachable_server(self) -> str | None:
        """Why online logging cannot work here (checked once per process and per sweep), else None."""
        url = wandb_base_url()
        if url in _unreachable:
            return _unreachable[url]
        marker = self._reach_file()
        if marker is not None and marker.exists():
            why = marker.read_text(encoding="utf-8").strip() or "unreachable"
        else:
            why = server_problem(url)
            if why is not None and marker is not None:
                try:
                    marker.write_text(why + "\n", encoding="utf-8")
                except OSError:
                    pass
        if why is not None:
            _unreachable[url] = why
        return why

    def start(self, config: dict) -> None:
        import wandb

        mode = self.resolved_mode()
        wdir = self.dir or os.environ.get("WANDB_DIR") or (str(self.run_dir) if self.run_dir else None)
        if wdir:
            try:
                Path(wdir).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                from luka_bench.errors import RunConfigError

                key = "logger.dir" if self.dir else ("WANDB_DIR" if os.environ.get("WANDB_DIR") else "the run folder")
                raise RunConfigError(f"{key} {wdir} cannot be created ({type(e).__name__}: {e.strerror}); "
                                     "pick a folder you can write to") from None
        if mode == "online":
            why = self._unreachable_server()
            if why is not None:  # wandb.init would wait ~90 s for it: log offline at once, say so in one line
                print(f"wandb: server {wandb_base_url()} {why}; logging offline (results stay in the run folder; "
                      "upload later with `wandb sync`)", file=sys.stderr)
                mode = "offline"
        kwargs = dict(project=self.project, entity=self.entity, group=self.group or self.sweep_name,
                      tags=[str(t) for t in self.tags] or None, config=config, dir=wdir,
                      name=self.name or (Path(self.run_dir).name if self.run_dir else None),
                      job_type="sweep-job" if self.sweep_name else "run", reinit="finish_previous")
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception as e:  # noqa: BLE001 - no network / server: keep the run, log offline
            if mode != "online":
                raise
            print(f"wandb: online start failed ({type(e).__name__}: {e}); logging offline instead "
                  f"(upload later with `wandb sync`)", file=sys.stderr)
            self.run = wandb.init(mode="offline", **kwargs)

    logs_items = True

    def log(self, step: int, metrics: dict) -> None:
        if self.run is not None:
            self.run.log(flatten(metrics, "running/"), step=step)

    def finish(self, metrics: dict | None, exit_code: int) -> None:
        if self.run is None:
            return
        try:
            if metrics:
                flat = flatten(metrics)
                self.run.summary.update(flat)
                lat = metrics.get("latency_breakdown")
                if isinstance(lat, dict) and lat:
                    import wandb

                    table = wandb.Table(columns=["component", "seconds_per_token"],
                                        data=[[k, v] for k, v in lat.items() if isinstance(v, (int, float))])
                    self.run.log({"latency_breakdown_table": table})
                if self.log_plots and self.run_dir is not None:
                    self._log_plots()
        except Exception as e:  # noqa: BLE001 - logging must never lose the run's results or skip finish()
            print(f"wandb: could not log the final metrics/plots: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            run, self.run = self.run, None
            try:
                run.finish(exit_code=exit_code)
            except Exception as e:  # noqa: BLE001 - never hide the run's own outcome behind a logging error
                print(f"wandb: finish failed: {type(e).__name__}: {e}", file=sys.stderr)

    def _log_plots(self) -> None:
        import wandb
        from PIL import Image

        from luka_bench.plots import figures, pyplot
        from luka_bench.tables import load_runs

        runs, _ = load_runs(self.run_dir)
        images = {}
        for name, fig in figures(runs).items():
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=100)
            pyplot().close(fig)
            buf.seek(0)
            images[f"plots/{name.removesuffix('.png')}"] = wandb.Image(Image.open(buf).convert("RGB"))
        if images:
            self.run.log(images)


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def build(cfg, run_dir: str | Path):
    """The tracker of a run: ``cfg.logger`` instantiated (NullTracker when absent), told its run folder and,
    inside a sweep, the sweep's name."""
    from hydra.utils import instantiate

    tracker = instantiate(cfg.logger) if cfg.get("logger") is not None else NullTracker()
    tracker.run_dir = Path(run_dir)
    if in_multirun():  # the sweep's folder name (= sweep_name unless hydra.sweep.dir was set directly)
        from hydra.core.hydra_config import HydraConfig

        tracker.sweep_name = Path(str(HydraConfig.get().sweep.dir)).name
    else:
        tracker.sweep_name = None
    return tracker


# ---------------------------------------------------------------------------------------------------------
# Sweep progress (a Hydra callback)
# ---------------------------------------------------------------------------------------------------------

def count_jobs(config) -> int | None:
    """How many jobs Hydra's basic sweeper makes of this multirun config (None for other sweepers)."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser

        if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
            return None
        params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
        loader = GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(params + list(config.hydra.overrides.task))
        return sum(len(b) for b in BasicSweeper.split_arguments(parsed, None))
    except Exception:  # noqa: BLE001 - progress is cosmetic: never fail a sweep over it
        return None


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class SweepProgress(Callback):
    """Prints where a sweep is. Works in the launching process and in launcher workers (the callback object
    is pickled along with the job, so the job count travels with it)."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.name: str | None = None
        self.sweep_dir: str | None = None
        self.started: float | None = None
        self.busy: list[tuple[str, str]] = []  # (run folder, message): jobs refused a folder another process held

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        self.started = time.time()
        self.total = count_jobs(config)
        self.sweep_dir = os.path.abspath(str(config.hydra.sweep.dir))
        self.name = Path(self.sweep_dir).name
        (Path(self.sweep_dir) / REACH_FILE).unlink(missing_ok=True)  # this sweep finds the W&B server anew
        launcher = str(config.hydra.launcher.get("_target_", "")).rsplit(".", 1)[-1]
        n = f"{self.total} jobs" if self.total is not None else "jobs"
        _say(f"sweep {self.name}: {n} -> {self.sweep_dir} (launcher: {launcher}); finished jobs are skipped")

    def _job(self, config) -> str:
        num = int(config.hydra.job.num) + 1 if config.hydra.job.get("num") is not None else "?"
        return f"[{self.name or 'sweep'}] job {num}/{self.total if self.total is not None else '?'}"

    def on_job_start(self, config, **kwargs: Any) -> None:
        if not _is_multirun(config):
            return
        from hydra.core.utils import filter_overrides

        overrides = " ".join(filter_overrides(list(config.hydra.overrides.task))) or "(no overrides)"
        _say(f"{self._job(config)}: {overrides} -> {config.hydra.runtime.output_dir}")

    def on_job_end(self, config, job_return=None, **kwargs: Any) -> None:
        if not _is_multirun(config) or job_return is None:
            return
        from hydra.core.utils import JobStatus

        value = job_return._return_value
        if job_return.status == JobStatus.FAILED or (isinstance(value, dict) and "failed" in value):
            if isinstance(value, dict):
                message = value["failed"]
            else:
                cause = getattr(value, "__cause__", None) or value
                message = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
            if isinstance(value, dict) and value.get("busy"):  # no error.txt in another process's folder: kept here
                self.busy.append((str(config.hydra.runtime.output_dir), message))
            _say(f"{self._job(config)} FAILED: {message} ({config.hydra.runtime.output_dir}); "
                 "re-run the sweep to retry it")
        else:
            _say(f"{self._job(config)} done: {config.hydra.runtime.output_dir}")

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        sweep_dir = self.sweep_dir or os.path.abspath(str(config.hydra.sweep.dir))
        from luka_bench.results import JOB_ERROR_FILE, find_runs, read_job_error, read_metrics

        runs = find_runs(sweep_dir)
        done = sum(1 for r in runs if read_metrics(r)[0] is not None)
        failed = sorted(p for p in Path(sweep_dir).glob(f"*/{JOB_ERROR_FILE}")
                        if self.started is None or p.stat().st_mtime >= self.started - 1)
        _say(f"sweep {Path(sweep_dir).name}: {done}/{len(runs)} run folders complete in {sweep_dir}\n"
             f"  tables and plots: {python_command()} -m luka_bench.report {os.path.relpath(sweep_dir)}")
        if failed or self.busy:  # bad input in some jobs (real crashes have raised already, with their traceback)
            lines = "\n".join([f"  {p.parent.name}: {read_job_error(p.parent)}" for p in failed]
                              + [f"  {Path(d).name}: {m}" for d, m in self.busy])
            _say(f"error: {len(failed) + len(self.busy)} job(s) of sweep {Path(sweep_dir).name} failed:\n{lines}")
            raise SystemExit(2)


def python_command() -> str:
    """How to call this Python from the shell the user is in: ``python`` when that is the one on PATH (the venv
    is active), else this interpreter's path (``.venv/bin/python`` below the current folder): a bare ``python``
    outside the venv has no luka_bench."""
    import shutil

    on_path = shutil.which("python")
    if on_path and Path(on_path).parent.resolve() == Path(sys.executable).parent.resolve():
        return "python"
    exe = os.path.abspath(sys.executable)  # not resolved: a venv's bin/python is a link to the base interpreter
    rel = os.path.relpath(exe)
    return rel if not rel.startswith("..") else exe


def _is_multirun(config) -> bool:
    from hydra.types import RunMode

    try:
        return config.hydra.mode == RunMode.MULTIRUN
    except Exception:  # noqa: BLE001
        return False
