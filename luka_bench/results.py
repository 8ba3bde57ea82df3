"""The run folder: ``config.yaml`` (resolved), ``predictions.jsonl`` (one line per item, appended and flushed as
each finishes), ``metrics.json`` (written atomically at the end), ``env.json`` (git SHA, versions, device, seed).

Resume: opening a folder that already holds a run of the *same* config returns the finished item ids, so they
are not redone; a half-written last line (a crash mid-write) or a garbage line is dropped (its item is redone),
said in one line and kept in ``predictions.jsonl.dropped``. A folder holding a run of a different config is
refused with one line, and nothing in it is touched. One process at a time: an open run folder holds an
exclusive lock (``.lock``, ``fcntl.flock``) until its run ends, and a second process opening it (two sweeps on one
sweep_name, a run started twice) is refused with one line before it writes anything.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from luka_bench.errors import CONF_DIR, OneLineError

import yaml

# What identifies a run, decided here and nowhere else (the folder name, resume, the report's columns): its
# resolved config, less the keys below. NOT_RECORDED are not part of the run at all (where it is logged, the
# sweep it belongs to, the experiment file that set its values); NOT_COMPARED are recorded in its config.yaml but
# may change between a run and its resumption (more items, display, how many CPU threads ran it).
NOT_RECORDED = ("logger", "sweep_name", "experiment")
NOT_COMPARED = ("data.limit", "progress", "threads", "batch_size")


def identifies_run(key: str | tuple) -> bool:
    """Whether a config key (``"method.budget"`` or ``("method", "budget")``) tells two runs apart."""
    k = ".".join(map(str, key)) if isinstance(key, tuple) else str(key)
    return not any(k == x or k.startswith(x + ".") for x in NOT_RECORDED + NOT_COMPARED)


def folder_name_excludes() -> list[str]:
    """The command-line keys left out of a run folder's name (Hydra's ``override_dirname.exclude_keys``, set by
    ``conf/config.yaml`` through the ``luka_not_identity`` resolver): the keys that do not identify a run, with
    every logger setting spelled out (Hydra matches whole keys)."""
    import glob

    import yaml as _yaml

    keys = list(NOT_RECORDED + NOT_COMPARED)
    for f in sorted(glob.glob(str(CONF_DIR / "logger" / "*.yaml"))):
        for k in (_yaml.safe_load(Path(f).read_text(encoding="utf-8")) or {}):
            if not k.startswith("_") and f"logger.{k}" not in keys:
                keys.append(f"logger.{k}")
    return keys


# A sweep job stopped by bad input does not raise: it leaves its one-line error in its folder's error.txt and
# returns ``{"failed": message}`` (run.run), so the other jobs still run; the sweep ends with one line per failed
# job and exit 2 (tracking.SweepProgress), and the report lists the run as ``failed: <error>``.
JOB_ERROR_FILE = "error.txt"


def write_job_error(run_dir: str | Path, message: str | None) -> None:
    """Leave ``message`` in the run folder's error file; None clears an earlier failure's."""
    path = Path(run_dir) / JOB_ERROR_FILE
    if message is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(message + "\n", encoding="utf-8")


def read_job_error(run_dir: str | Path) -> str | None:
    """The one-line error a failed sweep job left in its folder, or None."""
    try:
        return (Path(run_dir) / JOB_ERROR_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None


# A file name longer than this is cut and ends in a hash of the whole name (file systems stop at 255 bytes).
_MAX_NAME = 180


def run_dir_name(model: str, method: str, data: str, overrides: str = "") -> str:
    """The folder name of a single run: ``<model>,<method>,<data>`` and then the command line's other overrides
    that change results (Hydra's ``override_dirname``: sorted ``key=value`` joined by commas, with the keys of
    ``hydra.job.config.override_dirname.exclude_keys`` left out), e.g. ``smollm2_135m,h2o,wikisalad_easy,
    method.budget=0.25``. The same command gives the same folder, so it resumes; ``/`` in a value becomes ``_``."""
    groups = ("model=", "method=", "data=")
    extra = [o for o in str(overrides or "").split(",") if o and not o.startswith(groups)]
    name = ",".join([str(model), str(method), str(data), *extra]).replace("/", "_")
    if len(name) > _MAX_NAME:
        import hashlib

        name = f"{name[:_MAX_NAME - 13]}~{hashlib.sha1(name.encode()).hexdigest()[:12]}"
    return name


class RunFolderError(OneLineError, RuntimeError):
    """The folder cannot take this run. One line."""


class RunFolderBusy(RunFolderError):
    """Another process holds the folder's lock. Nothing is written to the folder (not even error.txt)."""


LOCK_FILE = ".lock"


def _lock(path: Path, stamp: bool = True) -> int | None:
    """An exclusive, non-blocking lock on ``path/.lock``: the open file descriptor (closing it releases the
    lock; so does the process ending, also when it is killed), or RunFolderError naming the holder's pid when
    another process holds it. None where the platform has no ``fcntl`` (no lock, as before)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
        except OSError:
            holder = "?"
        os.close(fd)
        raise RunFolderBusy(
            f"{path} is in use by another process (pid {holder}): wait for it to finish, or give this run a new "
            "hydra.run.dir (sweep: a new sweep_name)") from None
    if stamp:  # the holder's pid, for the refusal's message
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode("ascii"))
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _flatten(d: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    if isinstance(d, dict):
        out: dict[tuple, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, prefix + (k,)))
        return out
    return {prefix: d}


def config_difference(old: dict, new: dict) -> list[str]:
    """The settings that differ, one line each. A setting missing on one side and null on the other is the
    same run: a setting added to the configs later, null by default, keeps earlier runs resumable."""
    a, b = _flatten(old), _flatten(new)
    diffs = []
    for key in sorted(set(a) | set(b), key=str):
        if not identifies_run(key):
            continue
        if a.get(key) is None and b.get(key) is None:
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            diffs.append(f"{'.'.join(map(str, key))}: {a.get(key, '<unset>')!r} -> {b.get(key, '<unset>')!r}")
    return diffs


def _limit_shrinks(old: Any, new: Any) -> bool:
    """True when ``data.limit`` goes from ``old`` to a smaller ``new`` (null = every item: the largest)."""
    return new is not None and (old is None or (isinstance(old, int) and isinstance(new, int) and new < old))


class RunFolder:
    """A run folder opened for this run's config: ``RunFolder.check`` validates (nothing written), the
    constructor validates and then writes ``config.yaml`` and repairs a half-written last prediction line."""

    def __init__(self, path: str | Path, config: dict):
        self._lock_fd: int | None = None
        self.check(path, config)
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock(self.path)  # before anything in the folder is read or written
        self.check(path, config, probe_lock=False)  # again, now that no other process can change it
        self.config = config
        self.pred_path = self.path / "predictions.jsonl"
        self.metrics_path = self.path / "metrics.json"
        self.done: dict[str, dict] = self._read_predictions()
        self.total: int | None = None  # items of the whole run, once the evaluation loop knows them
        self._write_atomic(self.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))

    def close(self) -> None:
        """Release the folder's lock (the run is over). Also on garbage collection and at process exit."""
        _unlock(self._lock_fd)
        self._lock_fd = None

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_lock_fd"):  # a constructor that failed before the lock has nothing to release
            self.close()

    @staticmethod
    def check(path: str | Path, config: dict, probe_lock: bool = True) -> None:
        """RunFolderError (one line) when ``path`` cannot take a run of ``config``: it holds a run of another
        config, or of a larger ``data.limit`` (a smaller limit would rewrite a run's config and metrics to fewer
        items than its predictions hold: refused, the folder is never rewritten smaller). Writes nothing."""
        path = Path(path)
        if probe_lock and (path / LOCK_FILE).exists():  # in use now? (checked without keeping the lock; RunFolder() takes it)
            _unlock(_lock(path, stamp=False))
        cfg_path = path / "config.yaml"
        if not cfg_path.exists():
            return
        try:
            old = yaml.safe_load(cfg_path.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise RunFolderError(f"{cfg_path} is unreadable ({type(e).__name__}); pick a new hydra.run.dir") from None
        if not isinstance(old, dict):
            raise RunFolderError(f"{cfg_path} does not hold a run config; pick a new hydra.run.dir")
        diffs = config_difference(old, config)
        if diffs:
            raise RunFolderError(
                f"{path} already holds a run with another config ({diffs[0]}"
                f"{f' and {len(diffs) - 1} more' if len(diffs) > 1 else ''}); "
                "pick a new hydra.run.dir or repeat the original overrides to resume")
        old_limit = (old.get("data") or {}).get("limit")
        new_limit = (config.get("data") or {}).get("limit")
        pred = path / "predictions.jsonl"
        has_results = (path / "metrics.json").exists() or (pred.exists() and pred.stat().st_size > 0)
        if has_results and _limit_shrinks(old_limit, new_limit):
            old_s = "null (every item)" if old_limit is None else old_limit
            raise RunFolderError(
                f"{path} holds a run of data.limit={old_s}; data.limit={new_limit} would rewrite it with fewer "
                f"items: repeat data.limit={old_s} (or a larger one) to resume or extend it, or give the smaller "
                "run a new hydra.run.dir (sweep: a new sweep_name)")

    # -- predictions ---------------------------------------------------------------------------------------
    def _read_predictions(self, report: bool = True) -> dict[str, dict]:
        """Finished items by id. Read as bytes: a crash mid-write can cut the last line anywhere, also inside a
        multi-byte UTF-8 character. A line that is not a whole prediction record (that cut last line, or garbage
        anywhere: a disk error, a hand edit) is dropped, its item is redone, and the lines after it are kept; the
        file is rewritten without it and the dropped bytes are appended to ``predictions.jsonl.dropped`` beside it.
        ``report``: say so in one line on stderr (the resume; not the re-read after Ctrl-C, whose one line is the
        interrupt's)."""
        if not self.pred_path.exists():
            return {}
        raw = self.pred_path.read_bytes()
        lines = raw.splitlines(keepends=True)
        good, records, dropped = [], {}, []
        for number, line in enumerate(lines, 1):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("cut short by an interrupted write")
                rec = json.loads(line.decode("utf-8"))
                if not isinstance(rec, dict) or "item_id" not in rec:
                    raise ValueError("not a prediction record")
            except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                why = (f"not JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else
                       "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else str(e))
                dropped.append((number, line, why))
                continue
            records[rec["item_id"]] = rec
            good.append(line)
        if dropped:
            kept = self.pred_path.with_name(self.pred_path.name + ".dropped")
            with open(kept, "ab") as f:  # appended: what every resume dropped stays
                f.write(b"".join(line if line.endswith(b"\n") else line + b"\n" for _, line, _ in dropped))
            tmp = self.pred_path.with_name(self.pred_path.name + ".tmp")
            tmp.write_bytes(b"".join(good))
            os.replace(tmp, self.pred_path)
            if report:
                numbers = ", ".join(str(n) for n, _, _ in dropped[:5]) + (", ..." if len(dropped) > 5 else "")
                what = f"line {numbers}" if len(dropped) == 1 else f"{len(dropped)} lines ({numbers})"
                print(f"{self.pred_path}: dropped {what}: {dropped[0][2]}; "
                      f"{'its item' if len(dropped) == 1 else 'their items'} will be redone; the dropped "
                      f"{'line is' if len(dropped) == 1 else 'lines are'} kept in {kept}", file=sys.stderr, flush=True)
        return records

    def reread(self) -> dict[str, dict]:
        """Finished items as ``predictions.jsonl`` holds them now (what a resume will find; a line cut by an
        interrupt is dropped, as on resume, without a line of its own)."""
        self.done = self._read_predictions(report=False)
        return self.done

    def append(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False, default=_json_default) + "\n"
        with open(self.pred_path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.done[record["item_id"]] = record

    def put_in_order(self, item_ids: list[str]) -> None:
        """Rewrite ``predictions.jsonl`` with its records in the order of ``item_ids`` (records of other items after
        them, as they were), atomically: an interrupt leaves the old file or the new one, never a part."""
        where = {i: k for k, i in enumerate(item_ids)}
        recs = sorted(self.done.values(), key=lambda r: where.get(r["item_id"], len(where)))
        text = "".join(json.dumps(r, ensure_ascii=False, default=_json_default) + "\n" for r in recs)
        self._write_atomic(self.pred_path, text)

    # -- metrics / env -------------------------------------------------------------------------------------
    def write_metrics(self, metrics: dict) -> None:
        self._write_atomic(self.metrics_path, json.dumps(metrics, indent=2, default=_json_default) + "\n")

    def write_env(self, env: dict) -> None:
        self._write_atomic(self.path / "env.json", json.dumps(env, indent=2, default=_json_default) + "\n")

    @staticmethod
    def _write_atomic(path: Path, text: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


_SHA_AT_LOAD: dict[str, dict] = {}


def git_sha(repo_dir: Path) -> dict:
    """The checkout's commit and whether tracked files differ from it, read once per process: a sweep runs all
    its jobs with the code it loaded at its first job, so every job's ``env.json`` names that commit, not a
    HEAD that moved while the sweep ran (a later commit's code never ran in this process)."""
    key = str(repo_dir)
    if key not in _SHA_AT_LOAD:
        _SHA_AT_LOAD[key] = _read_git_sha(repo_dir)
    return dict(_SHA_AT_LOAD[key])


def _read_git_sha(repo_dir: Path) -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_dir,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return {"git_sha": sha or None, "git_dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"git_sha": None, "git_dirty": None}


def environment(seed: int, device: str, dtype: str) -> dict:
    import torch
    import transformers

    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    env = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "argv": sys.argv,
        "seed": seed,
        "device": device,
        "dtype": dtype,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "versions": {n: ver(n) for n in ("luka_bench", "torch", "transformers", "hydra-core", "datasets")},
    }
    env["versions"]["transformers"] = transformers.__version__
    env.update(git_sha(Path(__file__).resolve().parent.parent))
    return env


# ---------------------------------------------------------------------------------------------------------
# Reading run folders (the report, the sweep's closing line)
# ---------------------------------------------------------------------------------------------------------

# Folders below a sweep that are never run folders.
SKIP_DIRS = {"wandb", "report", "__pycache__"}


def read_run_config(path: Path) -> dict | None:
    """A run folder's ``config.yaml`` if it is ours (a dict with model, method and data), else None."""
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    if isinstance(cfg, dict) and all(k in cfg for k in ("model", "method", "data")):
        return cfg
    return None


def find_runs(folder: str | Path) -> list[Path]:
    """Run folders below ``folder`` (itself included), sorted. Skips hidden folders (``.submitit``), W&B's
    ``wandb/`` and report outputs."""
    folder = Path(folder)
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        if "config.yaml" in files and read_run_config(Path(root) / "config.yaml") is not None:
            found.append(Path(root))
    return sorted(found)


def count_lines(path: Path) -> int:
    """Complete lines in a file (items done in a predictions.jsonl); 0 if unreadable."""
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.endswith(b"\n"))
    except OSError:
        return 0


def read_predictions(run: Path) -> list[dict]:
    """A run folder's prediction records (complete lines only; read-only, unlike ``RunFolder``)."""
    out = []
    try:
        with open(run / "predictions.jsonl", "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                try:
                    rec = json.loads(line)
                except ValueError:  # a garbage line: skipped, as a resume drops it
                    continue
                if isinstance(rec, dict) and "item_id" in rec:
                    out.append(rec)
    except OSError:
        pass
    return out


def read_env(run: Path) -> dict:
    """A run folder's ``env.json`` (machine, threads, device), {} when absent or unreadable."""
    try:
        env = json.loads((run / "env.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return env if isinstance(env, dict) else {}


def read_metrics(run: Path) -> tuple[dict | None, str]:
    """(metrics, "complete") for a finished run folder, else (None, why: failed / no / unreadable / incomplete)."""
    path = run / "metrics.json"
    if not path.exists():
        error = read_job_error(run)  # a sweep job stopped by bad input left its one-line error
        return None, f"failed: {error}" if error is not None else "no metrics.json"
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, "unreadable metrics.json"
    if not isinstance(m, dict):
        return None, "unreadable metrics.json"
    if m.get("complete") is not True:
        return None, "incomplete metrics.json"
    return m, "complete"
