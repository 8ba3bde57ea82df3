"""Small device helpers for the CUDA path, each a no-op (or the obvious value) on the CPU, so the code that calls
them runs unchanged on both and the tests can reach them with mocks of ``torch.cuda`` (``tests/test_device.py``).

- ``guard(device)``: a context that makes ``device`` the current CUDA device (kernels that launch on the *current*
  device — Triton's — must run under the device their tensors live on: with ``model.device=cuda:1`` a launch on
  GPU 0 with GPU 1 pointers is an illegal memory access);
- ``reset_peak(device)`` / ``peak_allocated(device)``: the device allocator's high-water mark (None on the CPU);
- ``smem_per_block(device)``: the shared memory one block may opt into (None on the CPU: no limit to respect);
- ``host_to_device(values, device, dtype)``: host data (a list of numbers) on the device without a host
  synchronisation (pinned staging + ``non_blocking``; a plain ``torch.tensor(list, device=cuda)`` waits for the
  copy, a sync on every call);
- ``synchronize(device)``: wait for the device (CUDA), nothing elsewhere;
- ``rss_bytes(key)`` / ``reset_peak_rss()`` / ``release_memory()``: the process's resident set (``VmRSS``) and its
  high-water mark (``VmHWM``), the mark's reset (Linux >= 4.0), and freeing what Python and the allocator hold —
  the CPU's peak memory, which has no allocator counter;
- ``memory_mark(device)`` / ``peak_growth(device, mark)``: the peak growth of memory over a span — the device
  allocator's (CUDA) or the process's resident set (CPU) — over what was in use at the mark.

This module imports no other module of the package but ``errors`` (the engine's ``warm_up`` uses it).
"""
from __future__ import annotations

import contextlib
import gc
import resource
from pathlib import Path

import torch

from .errors import RunConfigError


_HOST_SIDE = [0]  # depth of host_side() blocks: the sync counter (luka_bench.host_sync) counts nothing inside


@contextlib.contextmanager
def host_side():
    """Declare host-side work (CPU tensors made from host data, read back on the host): not counted by the sync
    counter (``luka_bench.host_sync.SyncCounter``). Only for code that never touches a device tensor inside."""
    _HOST_SIDE[0] += 1
    try:
        yield
    finally:
        _HOST_SIDE[0] -= 1


def _cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def guard(device) -> contextlib.AbstractContextManager:
    """``with guard(t.device): launch(...)``: on CUDA ``torch.cuda.device(device)`` (the current device — and its
    current stream — become the tensors' for the block); elsewhere nothing."""
    if _cuda(device):
        return torch.cuda.device(torch.device(device))
    return contextlib.nullcontext()


def reset_peak(device) -> None:
    """Start a new high-water mark of the device allocator (``torch.cuda.reset_peak_memory_stats``); nothing on
    the CPU (its peak is the process RSS, measured elsewhere)."""
    if _cuda(device):
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def peak_allocated(device) -> int | None:
    """Bytes the device allocator held at most since the last ``reset_peak`` (``torch.cuda.max_memory_allocated``);
    None on the CPU."""
    if _cuda(device):
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return None


def smem_per_block(device) -> int | None:
    """Shared memory (bytes) one thread block may use on ``device`` when it opts in (sm_80: 166,912; sm_86/89:
    101,376; sm_90: 232,448); None on the CPU. Read from the device properties
    (``shared_memory_per_block_optin``, else ``shared_memory_per_block``)."""
    if not _cuda(device):
        return None
    props = torch.cuda.get_device_properties(torch.device(device))
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


def host_to_device(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A 1-D tensor of host ``values`` (a list of Python numbers) on ``device`` without a host synchronisation:
    on CUDA the values are staged in pinned memory and copied with ``non_blocking=True`` (the caching host
    allocator keeps the staging block alive until the copy has run); on the CPU a plain tensor. The sync
    counter (``luka_bench.host_sync``) does not count it: it is the sanctioned way to hand host data over."""
    with host_side():
        if _cuda(device):
            return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
        return torch.tensor(values, dtype=dtype, device=device)


def synchronize(device) -> None:
    """Wait for ``device`` (CUDA runs kernels asynchronously: a host clock would time their launch); nothing on
    the CPU."""
    if _cuda(device):
        torch.cuda.synchronize(torch.device(device))


def rss_bytes(key: str = "VmRSS") -> int:
    """Bytes of a /proc/self/status memory line: ``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark since the
    process started or ``reset_peak_rss``); the lifetime peak (``ru_maxrss``) where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark to the RSS now (Linux >= 4.0: "5" into /proc/self/clear_refs); False
    where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def release_memory() -> None:
    """Free what Python no longer references and hand the allocator's free pages back to the OS (glibc), so that a
    peak measured next starts from what is really held."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


MMAP_THRESHOLD = 4 << 20  # bytes: an allocation at least this large is its own mapping, returned to the OS when freed
_STEADY = [False]
_TRIM = []  # glibc's malloc_trim, once the harness set the threshold itself (``steady_allocator``); else empty
ALLOCATORS = ("steady", "system")


def steady_allocator() -> bool:
    """Make the process's CPU memory peak follow what is alive, once per process (the harness calls it when a method is
    attached to a model on the CPU): glibc's mmap threshold fixed at ``MMAP_THRESHOLD`` (4 MiB; the variable
    ``LUKA_BENCH_MMAP_THRESHOLD`` changes it) with ``mallopt``. glibc otherwise raises its threshold to the size of
    each large block freed, up to 32 MB, so that later blocks of that size come from the heap, whose freed pages stay
    resident in an order-dependent way: identical processes peaked 6-43 % apart; with the threshold fixed, within 3 %.
    Where it sets the threshold, ``trim_heap`` also trims the heap after each layer a prefill compresses.
    Its price: a CPU prefill's large temporaries are fresh mappings, ~1.15x its seconds at 2K tokens (decode unchanged;
    ``docs/speed.md``). Left alone where the process set glibc's own ``MALLOC_MMAP_THRESHOLD_`` (the memory
    benchmark's 64 KiB) and with ``LUKA_BENCH_ALLOCATOR=system``. ``LUKA_BENCH_MKL_CACHE=off`` also turns MKL's
    buffer cache off (``mkl_serv_disable_fast_mm``, exported by torch's CPU library: each thread keeps its GEMM
    packing buffers, a few MB). Returns whether anything was set (False: already set, ``system``, the process's own
    setting, not glibc and no MKL symbol)."""
    import ctypes
    import os

    mode = os.environ.get("LUKA_BENCH_ALLOCATOR", "steady")
    if mode not in ALLOCATORS:
        raise RunConfigError(f"LUKA_BENCH_ALLOCATOR={mode!r} is unknown; allowed: steady (the default: a CPU "
                             f"peak that repeats), system (glibc's and MKL's own behaviour)")
    if _STEADY[0] or mode != "steady":
        return False
    _STEADY[0] = True
    done = False
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        try:
            libc = ctypes.CDLL("libc.so.6")
            threshold = int(os.environ.get("LUKA_BENCH_MMAP_THRESHOLD", MMAP_THRESHOLD))
            done = bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD
            if done:
                _TRIM.append(libc.malloc_trim)
        except (OSError, AttributeError):  # not glibc
            pass
    if os.environ.get("LUKA_BENCH_MKL_CACHE", "keep") != "off":
        return done
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        lib.mkl_serv_disable_fast_mm()
        done = True
    except (OSError, AttributeError):  # no MKL inside torch's CPU library
        pass
    return done


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``) where the harness set the allocator
    (``steady_allocator``); nothing otherwise. Called on the CPU after each layer of a prefill that compresses inside
    its forward: a layer's kept keys and values (below the mmap threshold: heap blocks) land between its freed
    temporaries, and the free pages left between them stayed resident in an order that varied from process to
    process (the heap's free bytes after the last layer of StreamingLLM's 8K prefill 3-43 MB in six identical
    processes, its in-use bytes identical to the KiB; trimmed, its five processes peaked within 0.1 %). A few ms a call
    (3.5 ms in SnapKV's 8K prefill, 0.2 % of it; ``docs/speed.md``)."""
    if _TRIM:
        _TRIM[0](0)


def memory_mark(device) -> int:
    """Start a peak measurement on ``device``: the high-water mark reset (the allocator's on CUDA, the process RSS's on
    the CPU) and the bytes in use now returned, for ``peak_growth``."""
    if _cuda(device):
        reset_peak(device)
        return int(torch.cuda.memory_allocated(torch.device(device)))
    reset_peak_rss()
    return rss_bytes()


def peak_growth(device, mark: int) -> int:
    """The peak bytes in use since ``memory_mark`` over what was in use at it (CUDA: allocated; CPU: resident — the
    whole process, so other threads' allocations count too)."""
    if _cuda(device):  # read directly: the per-item peak (``peak_allocated``) is read apart from it
        return int(torch.cuda.max_memory_allocated(torch.device(device))) - mark
    return rss_bytes("VmHWM") - mark
