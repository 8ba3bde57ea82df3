"""``python -m luka_bench [overrides]``: one run (or a sweep with ``-m``). See README.md."""
from __future__ import annotations

import signal
import sys
from pathlib import Path

from luka_bench.errors import (CONF_DIR, GROUPS, check_group_keys, check_group_overrides, check_output_dirs,
                               check_sweep_name, check_top_keys)


def _drop_empty_run_folder(run_dir: str) -> None:
    """Bad input leaves no trace: Hydra makes the run folder (and its empty job log) before the run starts;
    when that is all the folder holds, it goes again, with the empty folders above it that Hydra made on the way
    (``results/runs/``), up to the current folder."""
    folder = Path(run_dir).absolute()
    try:
        files = list(folder.iterdir())
        if all(p.name == "luka_bench.log" and p.is_file() and p.stat().st_size == 0 for p in files):
            for p in files:
                p.unlink()
            folder.rmdir()
            cwd = Path.cwd().absolute()
            for parent in folder.parents:
                if parent == cwd or cwd not in parent.parents or any(parent.iterdir()):
                    break
                parent.rmdir()
    except OSError:
        pass


def main() -> None:
    argv = sys.argv[1:]
    msg = (check_group_overrides(argv) or check_group_keys(argv) or check_top_keys(argv) or check_output_dirs(argv)
           or check_sweep_name(argv))
    if msg:
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)

    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, open_dict

    from luka_bench.config import register_resolvers

    register_resolvers()

    @hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
    def _app(cfg: DictConfig) -> dict:
        from luka_bench.errors import one_line_errors, unwrap
        from luka_bench.run import run

        hc = HydraConfig.get()
        with open_dict(cfg):
            for g in GROUPS:
                cfg[f"{g}_name"] = hc.runtime.choices.get(g)
        from luka_bench.stop_signals import StopGuard, exit_status

        stop = StopGuard(hc.runtime.output_dir)  # SIGTERM, SIGUSR1/2 as Ctrl-C (luka_bench/stop_signals.py)
        try:
            with stop:
                return run(cfg, hc.runtime.output_dir)
        except KeyboardInterrupt as e:  # Ctrl-C or a stop signal: one line, the shell's exit status for it
            from luka_bench.errors import RunInterrupted

            if not isinstance(e, RunInterrupted):  # before the first item: nothing was saved
                _drop_empty_run_folder(hc.runtime.output_dir)
                e = f"interrupted before any item was saved ({hc.runtime.output_dir})"
            by = "" if stop.signum is None else f"{signal.Signals(stop.signum).name}: "
            print(f"\n{by}{e}", file=sys.stderr)
            sys.exit(exit_status(stop.signum))
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
