"""The fused CPU kernel behind ``attention._blocked_attention`` (``csrc/attention_mass.cpp``): exact causal attention
of a long query chunk plus the column masses (and, if asked, entropies) the mass-reading methods need, per KV
head and block of queries with the block's logits in one core's cache — about as fast as SDPA's own flash pass,
where the pure-torch loop over blocks costs 1.5-2x it.

Compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler is needed; the build is cached under
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions`` and takes ~30 s once here). ``scripts/setup.sh``
builds it. The build is named by the source's content and compiled from a copy of it beside the cache, so
checkouts at different paths (worktrees, CI clones) share one build instead of rebuilding each other's. If it cannot be built, or ``LUKA_BENCH_NO_KERNEL=1``, the pure-torch loop computes the same numbers
(a warning says so once). ``python -m luka_bench.methods.cpu_kernel`` builds it and prints where it stands."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import time
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "attention_mass.cpp"
DISABLE_ENV = "LUKA_BENCH_NO_KERNEL"


def disabled() -> bool:
    """Whether ``LUKA_BENCH_NO_KERNEL`` asks for the pure-torch path."""
    return os.environ.get(DISABLE_ENV, "").strip() not in ("", "0")


def cpu_fast(device: torch.device) -> bool:
    """Whether a policy on ``device`` may take a CPU-tuned variant of its portable decode ops (the CPU with the
    kernels on): the portable ops are written for CUDA — fewest launches, fixed shapes for a graph — and a few
    of them are slower on the CPU than a variant with more ops (a gather over an expanded index: ~2.7x the row
    copy at LuKA's page sizes; SDPA with a mask over the whole storage: ~1.3x SDPA over the held tokens at 8K;
    ``torch.utils.benchmark``, two threads). ``LUKA_BENCH_NO_KERNEL=1`` runs the portable ops everywhere (what the
    launch counter and the graph-ready test check)."""
    return device.type == "cpu" and not disabled()


@contextlib.contextmanager
def kernels_off(on: bool = True):
    """The block runs with ``LUKA_BENCH_NO_KERNEL=1`` (when ``on``): the pure-torch paths, the ops CUDA runs."""
    saved = os.environ.get(DISABLE_ENV)
    if on:
        os.environ[DISABLE_ENV] = "1"
    try:
        yield
    finally:
        if on:
            if saved is None:
                os.environ.pop(DISABLE_ENV, None)
            else:
                os.environ[DISABLE_ENV] = saved


def _build_flags() -> tuple[str, list[str]]:
    """(torch's CPU capability, compiler flags): AVX2/FMA code where torch itself runs AVX2 or better, portable
    scalar code elsewhere. The capability is part of the build's name, so nodes of a cluster sharing one home
    directory never load a build their CPU cannot run."""
    cap = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for's pragma lives in a header, compiled here
    if cap.startswith("AVX2") or cap.startswith("AVX512"):
        flags += ["-mavx2", "-mfma"]
    return cap, flags


def _stable_source() -> tuple[str, Path]:
    """(build name suffix, the source's copy at a path that depends only on its content): torch's build records
    the source's path, so compiling each checkout's own file would rebuild whenever another checkout loaded it."""
    text = SOURCE.read_bytes()
    digest = hashlib.sha256(text).hexdigest()[:12]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    copy = root / "luka_bench_sources" / f"attention_mass_{digest}.cpp"
    if not copy.exists() or copy.read_bytes() != text:
        copy.parent.mkdir(parents=True, exist_ok=True)
        tmp = copy.with_name(f"{copy.name}.{os.getpid()}.tmp")  # written whole, then renamed: racing processes
        tmp.write_bytes(text)
        os.replace(tmp, copy)
    return digest, copy


STALE_LOCK_S = 900  # a build takes ~30 s; a lock this old was left by a process killed while it held it


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build_dir/lock`` when it is older than ``max_age_s``: torch's extension loader waits on that file
    forever, so one process killed while holding it (Ctrl-C, a job's time limit) would hang every later run. True when
    one was removed."""
    lock = Path(build_dir) / "lock"
    try:
        if time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink()
            print(f"[luka_bench] removed a stale build lock ({lock})", file=sys.stderr, flush=True)
            return True
    except FileNotFoundError:
        pass
    return False


@functools.cache
def attention_mass_op():
    """``torch.ops.luka_bench.attention_mass``, built on the first call; None when disabled or the build failed."""
    op = None
    if not disabled():
        try:
            from torch.utils.cpp_extension import load
            cap, flags = _build_flags()
            digest, source = _stable_source()
            print(f"[luka_bench] loading the fused CPU attention kernel ({cap}; the first build takes ~30 s)",
                  file=sys.stderr, flush=True)
            from torch.utils import cpp_extension

            name = f"luka_bench_attention_mass_{cap.lower()}_{digest}"
            with contextlib.suppress(Exception):  # where torch builds it (its own rule: root / python-and-device tag)
                clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
            load(name=name, sources=[str(source)], extra_cflags=flags,
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
            op = torch.ops.luka_bench.attention_mass
        except Exception as ex:  # no compiler, no OpenMP, ...: the pure-torch loop gives the same numbers
            reason = (str(ex).strip().splitlines() or [type(ex).__name__])[0][:200]
            warnings.warn(f"luka_bench: the fused CPU attention kernel could not be built ({reason}); prefills "
                          "that need attention masses take the slower pure-torch loop", stacklevel=2)
    return op


def lychee_decode_op():
    """``torch.ops.luka_bench.lychee_decode`` (built with ``attention_mass``, the same source), or None when the
    kernel is disabled or could not be built: ``lychee`` then runs its choice as torch ops."""
    if disabled() or attention_mass_op() is None:
        return None
    return torch.ops.luka_bench.lychee_decode


def rows_attention_op():
    """``torch.ops.luka_bench.rows_attention`` (built with ``attention_mass``, the same source), or None when the
    kernel is disabled or could not be built: the caller gathers the rows and runs SDPA over them."""
    if disabled() or attention_mass_op() is None:
        return None
    return torch.ops.luka_bench.rows_attention


def segments_attention_op():
    """``torch.ops.luka_bench.segments_attention`` (built with ``attention_mass``, the same source), or None when the
    kernel is disabled or could not be built: a packed layer's decode step is then one SDPA over its rows."""
    if disabled() or attention_mass_op() is None:
        return None
    return torch.ops.luka_bench.segments_attention


def lychee_index_ops(device: torch.device, dtype: torch.dtype):
    """``(lychee_index_add, lychee_table, lychee_pool)`` from ``torch.ops.luka_bench`` (built with
    ``attention_mass``, the same source) for an fp32 index on the CPU with the kernels on, else None: ``lychee``
    then pools its new chunks, updates its index and rebuilds its decode table as torch ops (what CUDA runs)."""
    if device.type != "cpu" or dtype != torch.float32 or disabled() or attention_mass_op() is None:
        return None
    ops = torch.ops.luka_bench
    return ops.lychee_index_add, ops.lychee_table, ops.lychee_pool


if __name__ == "__main__":
    if disabled():
        print(f"fused CPU attention kernel: disabled by {DISABLE_ENV}")
    else:
        print("fused CPU attention kernel:", "ready" if attention_mass_op() is not None else "NOT AVAILABLE "
              "(the pure-torch loop will be used)")
