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
- ``warm_up(model, method, ...)``: a throwaway prefill and a few decode steps through a method's cache, so that
  one-time costs (Triton compilation, cuBLAS handles, allocator growth) are not timed in the first item.
"""
from __future__ import annotations

import contextlib
import time

import torch


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
    from luka_bench.host_sync import host_side

    with host_side():
        if _cuda(device):
            return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
        return torch.tensor(values, dtype=dtype, device=device)


@torch.no_grad()
def warm_up(model, method=None, tokenizer=None, prompt_len: int = 256, chunk: int = 128, steps: int = 2,
            seed: int = 0) -> float:
    """A throwaway run through ``method`` (default: full attention) on ``model``: a prefill of ``prompt_len``
    random token ids in chunks of ``chunk`` (the first chunk a plain causal prefill, the next ones the masked
    chunk-after-a-prefix path; chunks of >= 64 queries take the Triton prefill kernel on CUDA), then ``steps``
    decode steps, then a device synchronisation. Nothing is kept. Returns the seconds it took. Meant for CUDA
    before the first timed item (one-time costs: kernel compilation and autotuning, library handles, allocator
    growth); it runs on any device."""
    from luka_bench import engine
    from luka_bench.methods import hf
    from luka_bench.methods.full import Full

    method = Full() if method is None else method
    dev = model.device
    vocab = min(model.config.get_text_config().vocab_size, 256)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (prompt_len + steps,), generator=g).tolist()
    t0 = time.perf_counter()
    with hf.attach(model, method, tokenizer) as att:
        # the prefill in chunks of ``chunk`` (split by attach's hook), then decode steps, as the engine runs them
        cache = att.new_cache(reference_length=prompt_len, prefill_chunk=max(1, chunk))
        engine.prefill(model, ids[:prompt_len], cache)
        for i in range(steps):
            engine.forward(model, ids[prompt_len + i: prompt_len + i + 1], cache)
        cache.timings  # resolve any recorded events
    if _cuda(dev):
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0
