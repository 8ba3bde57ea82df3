"""Bad input that stops a run with one line (``error: ...``, exit 2) instead of a traceback.

Each layer raises its own one-line error type (data: ``DataError``, methods: ``MethodConfigError``, models:
``ModelUnavailable`` / ``ModelConfigError``, run folders: ``RunFolderError``, prompts: ``PromptTooLong``, the
run's own settings and output folders: ``RunConfigError``), each a subclass of ``OneLineError``, which the
command line (``__main__``) and a sweep job (``run.run``) print as one line. This module imports no other module
of the package, so every layer can import it. The command line's own checks,
made before Hydra starts (unknown model/method/data names, output folders that cannot be written), are here
too, for every entry point (``python -m luka_bench``, ``python -m luka_bench.probe``).
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path


class OneLineError(Exception):
    """Bad input: the message is one line naming the bad value and the allowed ones, printed as ``error: ...``
    (exit 2) instead of a traceback."""


class PromptTooLong(OneLineError, ValueError):
    """A prompt does not fit the model's context. One line."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message is the one line the command line prints (items saved, how to resume)."""


class RunConfigError(OneLineError, ValueError):
    """A bad top-level setting (``seed``, ``threads``, ``max_new_tokens``, ...) or an output folder that cannot
    be written. One line."""


def writable_dir_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be (or become) a writable folder, or None when it can. Nothing is left behind: the
    nearest existing folder on the way (``path`` itself or an ancestor) must be one this process may write into,
    checked by making a hidden empty folder there and removing it at once (``os.access`` says yes to root
    everywhere, also in ``/proc``, which refuses new files and folders)."""
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        return f"{probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".luka_bench_probe_", dir=probe))
    except OSError as e:
        return f"{probe} does not accept new folders ({type(e).__name__}: {e.strerror})"
    return None


def check_writable_dir(key: str, path: str | Path) -> None:
    """RunConfigError naming the setting when ``path`` cannot be written."""
    problem = writable_dir_problem(path)
    if problem is not None:
        raise RunConfigError(f"{key}={path} cannot be written: {problem}; pick a folder you can write to")


def one_line_errors() -> tuple[type[BaseException], ...]:
    """The errors printed as one line (every ``OneLineError``)."""
    return (OneLineError,)


def unwrap(e: BaseException) -> BaseException:
    """The error inside Hydra's ``InstantiationException`` wrappers (a bad method/data setting raised in a
    dataclass's ``__post_init__``)."""
    from hydra.errors import InstantiationException

    while isinstance(e, InstantiationException) and e.__cause__ is not None:
        e = e.__cause__
    return e


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("model", "method", "data")


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_group_overrides(argv: list[str]) -> str | None:
    """One-line message for an unknown model/method/data name in the command line, else None. Hydra's own
    message for this is many lines; this one names the bad value, the closest match and the allowed values."""
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in GROUPS:
            continue
        allowed = group_options(key)
        if value.startswith("glob(") or value.startswith("choice(") or value.startswith("range("):
            names = [v.strip(" '\"") for v in value[value.index("(") + 1: -1].split(",")] \
                if value.startswith("choice(") else []
        else:
            names = [v.strip() for v in value.split(",")]
        for name in names:
            if name and name not in allowed:
                close = difflib.get_close_matches(name, allowed, n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                return f"Unknown {key} '{name}'.{hint} Available: {', '.join(allowed)}"
    return None


def _root_config() -> dict:
    """conf/config.yaml as written (its defaults list, the run's settings, Hydra's block)."""
    import yaml

    return yaml.safe_load((CONF_DIR / "config.yaml").read_text(encoding="utf-8")) or {}


def run_settings() -> list[str]:
    """The run's own settings: conf/config.yaml's top-level keys (its ``defaults`` and ``hydra`` aside)."""
    return [k for k in _root_config() if k not in ("defaults", "hydra")]


def check_top_keys(argv: list[str]) -> str | None:
    """One-line message for an override of a key the run does not have (``foo=1``, ``results_dir=x``, a typo of a
    group or setting) or for ``experiment=NAME`` without its plus, else None. Hydra's own message for both is a
    multi-line struct error that names no allowed key. ``+key=value`` (adding a key on purpose) is left to Hydra,
    as is everything when an experiment is given (it may add keys of its own)."""
    if any(a.startswith("+experiment=") for a in argv):
        return None
    settings = run_settings()
    groups = [*GROUPS, "logger"]
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or arg.startswith(("-", "+", "~")):
            continue
        top = key.split(".", 1)[0].split("/", 1)[0]  # (hydra/launcher=slurm: a group of Hydra's own)
        if top == "experiment":
            return (f"experiment={value} needs a plus: +experiment={value} (an experiment is added to the run's "
                    f"config; allowed: {', '.join(group_options('experiment'))})")
        if top in settings or top in groups or top == "hydra":
            continue
        close = difflib.get_close_matches(top, settings + groups, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return (f"{key} is not a setting of a run{hint}; allowed: {', '.join(settings)}, the groups "
                f"{', '.join(groups)} (e.g. method=h2o, method.budget=0.25), hydra.*")
    return None


OUTPUT_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "logger.dir")


def check_output_dirs(argv: list[str]) -> str | None:
    """One-line message for an output folder in the command line (``hydra.run.dir``, ``hydra.sweep.dir``,
    ``logger.dir``) that cannot be written, else None. Checked before Hydra starts: Hydra creates the run folder
    itself and would fail with a traceback. Values with interpolations are left to the run."""
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        value = value.strip().strip("'\"")
        if key in OUTPUT_DIR_KEYS and value and value != "null" and "${" not in value:
            problem = writable_dir_problem(value)
            if problem is not None:
                return f"{key}={value} cannot be written: {problem}; pick a folder you can write to"
    return None


SWEEPS_DIR = "results/sweeps"  # conf/config.yaml: hydra.sweep.dir = results/sweeps/${sweep_name}


def check_sweep_name(argv: list[str]) -> str | None:
    """One-line message for a ``sweep_name`` in the command line that would put the sweep outside results/sweeps/
    (``..`` up and out; an empty name, the folder of every sweep itself), else None. An absolute name stays inside,
    as Hydra joins it (``sweep_name=/x`` is results/sweeps/x). ``hydra.sweep.dir`` is the way to put a sweep
    anywhere on purpose. Values with interpolations are left to Hydra."""
    import posixpath

    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or arg.startswith("-") or key.lstrip("+~") != "sweep_name":
            continue
        value = value.strip().strip("'\"")
        if "${" in value:
            continue
        where = posixpath.normpath(f"{SWEEPS_DIR}/{value.replace(chr(92), '/')}")
        if not where.startswith(SWEEPS_DIR + "/"):
            return (f"sweep_name={value!r} would put the sweep at {where}, not inside {SWEEPS_DIR}/; allowed: a "
                    f"name or path inside {SWEEPS_DIR}/ (e.g. sweep_name=paper/table1); to put a sweep anywhere, "
                    "set hydra.sweep.dir=<folder>")
    return None


def _group_choices(argv: list[str]) -> dict[str, list[str]] | None:
    """The config chosen for each group by the command line (comma lists: each), else conf/config.yaml's
    default; None when an experiment is given (it may choose the groups itself)."""
    defaults = _root_config().get("defaults", [])
    chosen = {g: [v] for d in defaults if isinstance(d, dict) for g, v in d.items() if g in GROUPS}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or arg.startswith("-"):
            continue
        key = key.lstrip("+~")
        if key == "experiment":
            return None
        if key in GROUPS:
            if value.startswith(("glob(", "choice(", "range(")):
                return None
            chosen[key] = [v.strip() for v in value.split(",") if v.strip()]
    return chosen


def _settings_of(group: str, name: str) -> tuple[list[str], list[str]]:
    """(keys of conf/<group>/<name>.yaml, settings of its ``_target_`` class: dataclass fields, or those keys)."""
    import dataclasses

    import yaml

    cfg = yaml.safe_load((CONF_DIR / group / f"{name}.yaml").read_text(encoding="utf-8")) or {}
    keys = [k for k in cfg if k != "_target_"]
    try:
        from hydra.utils import get_class

        cls = get_class(cfg["_target_"])
        fields = [f.name for f in dataclasses.fields(cls) if f.init] if dataclasses.is_dataclass(cls) else keys
    except Exception:  # noqa: BLE001 - the keys of the file still name the settings
        fields = keys
    return keys, fields


def check_group_keys(argv: list[str]) -> str | None:
    """One-line message for ``method.foo=1`` (no ``+``) where the chosen method's config has no key ``foo``,
    else None. Hydra's own message for this is a multi-line struct error; the ``+method.foo=1`` form fails in
    ``run._build`` with the same line as this one."""
    chosen = None
    for arg in argv:
        key, sep, _ = arg.partition("=")
        if not sep or arg.startswith(("-", "+", "~")) or "." not in key:
            continue
        group, sub = key.split(".", 1)
        if group not in GROUPS:
            continue
        chosen = chosen if chosen is not None else _group_choices(argv)
        if chosen is None:
            return None
        for name in chosen.get(group, []):
            if name not in group_options(group):
                continue  # an unknown name: check_group_overrides says so
            keys, fields = _settings_of(group, name)
            top = sub.split(".", 1)[0]
            if top in keys:
                continue
            if top in fields:
                return (f"{group}.{top} is not in conf/{group}/{name}.yaml; add it with a plus: +{arg} "
                        f"(settings of {group}={name}: {', '.join(fields)})")
            return f"{group}.{top} is not a setting of {group}={name}; allowed: {', '.join(fields)}"
    return None
