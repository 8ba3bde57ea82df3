"""The signals a scheduler sends to stop a run (SIGTERM; SIGUSR1/SIGUSR2 before a time limit when asked, e.g.
``sbatch --signal=USR1@120``), handled like Ctrl-C: the run stops between two items' bytecodes, the folder keeps
every finished item (``predictions.jsonl`` ends with a whole line), one line names what was saved and how to
resume, and the exit status is the shell's for that signal (128 + its number: SIGTERM 143, SIGUSR1 138, SIGUSR2
140; Ctrl-C keeps Python's own handler and 130).

Under submitit (``hydra/launcher=slurm``, ``submitit_local``) submitit has installed its own handlers before the
job starts: its preemption signal (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default; SLURM sends it
``hydra.launcher.signal_delay_s`` before the time limit) checkpoints the job through the Hydra launcher's
``checkpoint`` (the same job, the same arguments) and requeues it (``scontrol requeue``); SIGTERM is logged and
otherwise ignored (SLURM sends it on ``scancel`` and at preemption, and requeues a preempted job itself). Those
handlers are left in place, so requeueing works as submitit means it to; the run folder resumes in the requeued
job. Here they are only wrapped to print one line (requeued or not, items saved); the other user signal (USR1
when submitit listens on USR2), which would kill the job without a result, goes to submitit's handler too.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Callable


def stop_signals() -> tuple[signal.Signals, ...]:
    """SIGTERM, SIGUSR1, SIGUSR2 (those this platform has)."""
    return tuple(getattr(signal, n) for n in ("SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, n))


class Stopped(KeyboardInterrupt):
    """A stop signal arrived: handled exactly as Ctrl-C (``run.py``'s ``KeyboardInterrupt`` block)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(signum: int | None) -> int:
    """The shell's exit status for a process stopped by ``signum`` (SIGINT when None): 128 + its number."""
    return 128 + int(signum if signum is not None else signal.SIGINT)


def _saved(folder: Path) -> int:
    from luka_bench.results import count_lines

    return count_lines(folder / "predictions.jsonl")


def _say(line: str) -> None:
    print(f"\n{line}", file=sys.stderr, flush=True)


class StopGuard:
    """Stop signals handled as Ctrl-C (or, inside a submitit job, as submitit's requeue) while a ``with StopGuard(
    run_dir):`` block runs; the previous handlers come back after it. A signal whose handler someone else set
    (SIG_IGN, submitit's SIGTERM) is left alone. Outside the main thread (no handlers can be set there) nothing
    changes. ``signum``: the stop signal that arrived, if any."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.signum: int | None = None
        self._old: dict[signal.Signals, object] = {}

    def __enter__(self) -> "StopGuard":
        sub = _submitit_handler()
        try:
            for sig in stop_signals():
                current = signal.getsignal(sig)
                if sub is not None and sig == sub[0]:
                    new = self.around_submitit(sub[1])
                elif current is not signal.SIG_DFL:  # SIG_IGN, another's handler, or one set outside Python
                    continue
                elif sub is not None and sig != signal.SIGTERM:
                    new = self.around_submitit(sub[1])  # the other user signal: submitit's requeue, not a lost job
                else:
                    new = self.interrupt
                self._old[sig] = signal.signal(sig, new)
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, h in self._old.items():
            try:
                signal.signal(sig, h)
            except (ValueError, TypeError):
                pass
        self._old.clear()

    def interrupt(self, signum: int, frame) -> None:
        if self.signum is not None:  # a second signal while the first is handled: let the folder be finished
            return
        self.signum = signum
        raise Stopped(signum)

    def around_submitit(self, handler: Callable) -> Callable:
        """submitit's checkpoint-and-requeue handler, and one line saying what it did."""

        def wrapped(signum: int, frame) -> None:
            name = signal.Signals(signum).name
            try:
                handler(signum, frame)
            except SystemExit:  # submitit requeued the job and exits (no result file: the launcher keeps waiting)
                self.signum = signum
                _say(f"{name}: {_saved(self.run_dir)} items saved in {self.run_dir}; submitit requeued the job, "
                     "which resumes from there")
                raise
            except Exception as e:  # noqa: BLE001 - submitit's UncompletedJobError: not requeued, the job ends
                self.signum = signum
                _say(f"{name}: not requeued ({e}); {_saved(self.run_dir)} items saved in {self.run_dir}; run the "
                     "same command to resume (more requeues on time-out: hydra.launcher.max_num_timeout)")
                raise

        return wrapped


def _submitit_handler() -> tuple[signal.Signals, Callable] | None:
    """(submitit's preemption signal, its handler) inside a submitit job, else None."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
    if sig is None:
        return None
    handler = signal.getsignal(sig)
    return (sig, handler) if callable(handler) else None
