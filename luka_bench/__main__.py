"""``python -m luka_bench [overrides]``: one run (or a sweep with ``-m``). See README.md."""
from __future__ import annotations

import difflib
import sys
from pathlib import Path

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


OUTPUT_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "logger.dir")


def check_output_dirs(argv: list[str]) -> str | None:
    """One-line message for an output folder in the command line (``hydra.run.dir``, ``hydra.sweep.dir``,
    ``logger.dir``) that cannot be written, else None. Checked before Hydra starts: Hydra creates the run folder
    itself and would fail with a traceback. Values with interpolations are left to the run."""
    from luka_bench.errors import writable_dir_problem

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


def _drop_empty_run_folder(run_dir: str) -> None:
    """Bad input leaves no trace: Hydra makes the run folder (and its empty job log) before the run starts;
    when that is all the folder holds, it goes again."""
    folder = Path(run_dir)
    try:
        files = list(folder.iterdir())
        if all(p.name == "luka_bench.log" and p.is_file() and p.stat().st_size == 0 for p in files):
            for p in files:
                p.unlink()
            folder.rmdir()
    except OSError:
        pass


def main() -> None:
    msg = check_group_overrides(sys.argv[1:]) or check_output_dirs(sys.argv[1:])
    if msg:
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)

    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, open_dict

    @hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
    def _app(cfg: DictConfig) -> dict:
        from luka_bench.errors import one_line_errors, unwrap
        from luka_bench.run import run

        hc = HydraConfig.get()
        with open_dict(cfg):
            for g in GROUPS:
                cfg[f"{g}_name"] = hc.runtime.choices.get(g)
        try:
            return run(cfg, hc.runtime.output_dir)
        except Exception as e:  # noqa: BLE001 - turn known bad input into one line, re-raise the rest
            inner = unwrap(e)
            if isinstance(inner, one_line_errors()):
                print(f"error: {inner}", file=sys.stderr)
                _drop_empty_run_folder(hc.runtime.output_dir)
                sys.exit(2)
            raise

    _app()


if __name__ == "__main__":
    main()
