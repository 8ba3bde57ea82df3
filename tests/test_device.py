"""The CUDA-path helpers of ``luka_bench/device.py`` and ``MethodCache``'s CUDA timing (issue 37), reached on a
CPU-only machine through mocks of the ``torch.cuda`` calls they make: the launch guard of the Triton kernel
(``model.device=cuda:1``), CUDA events recorded on the tensors' device's stream and only when a latency breakdown
is asked for, the peak-memory pair, the shared-memory limit and the kernel's fall-back to smaller tiles, the
sync-free host-to-device hand-over, the warm-up run. What only a GPU can confirm is in docs/gpu.md."""
from __future__ import annotations

import contextlib

import pytest
import torch

from luka_bench import device as devices
from luka_bench import engine
from luka_bench.methods import triton_kernel
from luka_bench.methods.full import Full
from luka_bench.methods.hf import MethodCache, layer_infos

CUDA1 = torch.device("cuda", 1)


class _FakeCudaDevice:
    """Stands in for ``torch.cuda.device``: records which device is current inside the block."""
    current: list = []

    def __init__(self, dev):
        self.dev = torch.device(dev)

    def __enter__(self):
        _FakeCudaDevice.current.append(self.dev)

    def __exit__(self, *exc):
        _FakeCudaDevice.current.pop()


def test_guard_makes_the_tensors_device_current(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", _FakeCudaDevice)
    with devices.guard(CUDA1):
        assert _FakeCudaDevice.current == [CUDA1]
    assert _FakeCudaDevice.current == []
    with devices.guard(torch.device("cpu")):  # nothing on the CPU
        assert _FakeCudaDevice.current == []


@pytest.mark.skipif(triton_kernel.triton is None, reason="triton not installed")
def test_triton_kernel_launches_under_the_tensors_device(monkeypatch):
    """Both kernels are launched inside ``device.guard(<the tensors' device>)``: Triton launches on the current
    device, which with model.device=cuda:1 is not the tensors' one."""
    seen, inside = [], []

    @contextlib.contextmanager
    def guard(dev):
        inside.append(dev)
        try:
            yield
        finally:
            inside.pop()

    class _Launcher:
        def __getitem__(self, grid):
            return lambda *a, **k: seen.append(list(inside))

    monkeypatch.setattr(devices, "guard", guard)
    monkeypatch.setattr(triton_kernel, "_kernels", lambda: (_Launcher(), _Launcher()))
    qs, k = torch.randn(2, 3, 70, 64), torch.randn(2, 70, 64)
    assert triton_kernel.attention_mass(qs, k, k, 0) is not None
    assert seen == [[qs.device], [qs.device]]  # forward and mass kernels, each under the tensors' device


def test_cuda_marks_are_events_on_the_devices_stream_only_when_asked(monkeypatch):
    """``MethodCache.mark`` on CUDA: no event unless ``cuda_events`` (the default timing records nothing inside
    the step); with it an event recorded on the current stream *of the tensors' device* (cuda:1), not of the
    current device; spans without events add nothing."""
    streams, recorded = [], []

    class _Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream=None):
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: streams.append(dev) or f"stream of {dev}")
    cache = MethodCache(Full(), [])
    assert cache.cuda_events is False
    assert cache.mark(CUDA1) is None
    with cache.span("attention", CUDA1):
        pass
    cache.add_span("attention", cache.mark(CUDA1), cache.mark(CUDA1))
    assert recorded == [] and cache.timings == {} and cache._pending == []
    cache = MethodCache(Full(), [], cuda_events=True)
    ev = cache.mark(CUDA1)
    assert isinstance(ev, _Event) and streams == [CUDA1] and recorded == [f"stream of {CUDA1}"]
    cpu = MethodCache(Full(), [])  # the CPU keeps its host clock either way
    assert isinstance(cpu.mark(torch.device("cpu")), float)


def test_peak_memory_pair(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev=None: calls.append(("reset", dev)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: calls.append(("peak", dev)) or 12345)
    devices.reset_peak(CUDA1)
    assert devices.peak_allocated(CUDA1) == 12345
    assert calls == [("reset", CUDA1), ("peak", CUDA1)]
    assert devices.reset_peak("cpu") is None and devices.peak_allocated("cpu") is None
    assert len(calls) == 2


class _Props:
    def __init__(self, optin):
        self.shared_memory_per_block_optin = optin
        self.shared_memory_per_block = 49152


@pytest.mark.parametrize("limit,expect", [(232448, (64, 64, 2)), (101376, (32, 32, 2)), (20000, None)],
                         ids=["sm90", "sm86", "too-small"])
def test_head_size_256_picks_tiles_that_fit_shared_memory(monkeypatch, limit, expect):
    """Gemma3's head size 256 in bf16: 64 x 64 tiles on an H100 (232,448 B per block), smaller ones on sm_86/89
    (101,376 B: the forward kernel at 64 x 64 needs 106,496 B compiled), none where nothing fits (the explicit
    path runs: ``fits`` is False, so ``base._blocked`` does not choose the kernel)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: _Props(limit))
    assert devices.smem_per_block(CUDA1) == limit
    assert triton_kernel.pick_config(256, 256, 2, devices.smem_per_block(CUDA1)) == expect
    assert triton_kernel.fits(256, 256, torch.bfloat16, CUDA1) is (expect is not None)
    if expect is not None:
        assert triton_kernel.smem_bytes(expect[0], expect[1], 256, 256, 2, expect[2]) <= limit
    # head sizes up to 128 keep their tiles on every sm_8x/9x device
    assert triton_kernel.pick_config(128, 128, 2, 101376) == (64, 64, 2)
    assert triton_kernel.pick_config(128, 128, 4, 101376) == (32, 32, 2)


@pytest.mark.skipif(triton_kernel.triton is None, reason="triton not installed")
def test_kernel_with_a_shared_memory_limit_is_exact_or_declines(monkeypatch):
    """Under a limit that excludes the default tiles the kernel runs smaller ones and stays exact (interpreter);
    under one that excludes all it returns None."""
    import test_triton_kernel as ref

    bh, g, lq, past, d = 1, 2, 40, 30, 64
    gen = torch.Generator().manual_seed(7)
    qs = torch.randn(bh, g, lq, d, generator=gen) * 0.3
    k, v = torch.randn(bh, past + lq, d, generator=gen), torch.randn(bh, past + lq, d, generator=gen)
    used = []
    real = triton_kernel._kernels()

    class _Spy:
        def __init__(self, kern):
            self.kern = kern

        def __getitem__(self, grid):
            launch = self.kern[grid]
            return lambda *a, **kw: used.append((kw["BM"], kw["BN"], kw["num_stages"])) or launch(*a, **kw)

    monkeypatch.setattr(triton_kernel, "_kernels", lambda: (_Spy(real[0]), _Spy(real[1])))
    limit = triton_kernel.smem_bytes(64, 64, 64, 64, 4) - 1  # fp32, head size 64: 64 x 64 tiles no longer fit
    monkeypatch.setattr(devices, "smem_per_block", lambda dev: limit)
    out, mass, _ = triton_kernel.attention_mass(qs, k, v, past)
    assert used and all(c != (64, 64, 2) for c in used)
    ref_out, ref_mass, _ = ref._reference(qs, k, v, past)
    torch.testing.assert_close(mass.double(), ref_mass, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(devices, "smem_per_block", lambda dev: 1000)
    assert triton_kernel.attention_mass(qs, k, v, past) is None


@pytest.mark.skipif(triton_kernel.triton is None, reason="triton not installed")
def test_triton_kernels_do_not_specialise_on_lengths():
    """Lq, N and past change with every chunk: Triton must not compile a kernel per (value == 1, value % 16)
    class of them. Checked on the compiled-path JITFunction's parameters (buildable without a GPU)."""
    from triton.runtime.jit import JITFunction

    for fn in (triton_kernel._fwd, triton_kernel._mass):
        jf = JITFunction(fn, do_not_specialize=triton_kernel.NO_SPECIALIZE)
        flags = {p.name: p.do_not_specialize for p in jf.params}
        assert all(flags[n] for n in ("Lq", "N", "past")), flags
        assert not flags["G"]
    for kern in triton_kernel._kernels():  # what attention_mass launches carries the same setting
        got = kern.kwargs["do_not_specialize"] if hasattr(kern, "kwargs") else kern.do_not_specialize
        assert tuple(got) == triton_kernel.NO_SPECIALIZE


def test_host_to_device_is_pinned_and_non_blocking_on_cuda(monkeypatch):
    made = {}
    real_tensor = torch.tensor

    class _Host:
        def to(self, dev, non_blocking=False):
            made.update(dev=dev, non_blocking=non_blocking)
            return "on device"

    def fake_tensor(values, dtype=None, pin_memory=False, device=None):
        made.update(pin=pin_memory, device=device, values=values)
        return _Host()

    monkeypatch.setattr(torch, "tensor", fake_tensor)
    assert devices.host_to_device([3, 5], CUDA1) == "on device"
    assert made == {"pin": True, "device": None, "values": [3, 5], "dev": CUDA1, "non_blocking": True}
    monkeypatch.setattr(torch, "tensor", real_tensor)
    t = devices.host_to_device([3, 5], torch.device("cpu"))
    assert t.tolist() == [3, 5] and t.dtype == torch.long


def test_warm_up_runs_a_chunked_prefill_and_decode_steps(tiny_qwen3, monkeypatch):
    """``warm_up`` (for the runner, before the first timed item on CUDA): a prefill in chunks — the second after a
    prefix — and decode steps through the method's cache, then a device synchronisation (mocked here)."""
    from luka_bench.methods.h2o import H2O

    model = tiny_qwen3.model
    calls = []
    real = model.forward

    def spy(*a, **kw):
        calls.append(kw["input_ids"].shape[1])
        return real(*a, **kw)

    monkeypatch.setattr(model, "forward", spy)
    secs = engine.warm_up(model, H2O(budget=0.5), prompt_len=96, chunk=64, steps=3)
    # H2O compresses each layer in the prefill: its chunks go layer by layer, the leading one a forward in a thread
    # of its own that starts after this forward's (the last chunk's) call — each chunk once, then the steps
    assert secs > 0 and sorted(calls[:2]) == [32, 64] and calls[2:] == [1, 1, 1]
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: synced.append(dev))
    monkeypatch.setattr(devices, "_cuda", lambda dev: True)  # pretend the model is on a GPU: it synchronises
    calls.clear()
    engine.warm_up(model, prompt_len=16, chunk=16, steps=1)
    assert calls == [16, 1] and synced == [model.device]
    assert model.config._attn_implementation != "luka_bench"  # detached again


def test_the_warm_up_runs_a_method_that_needs_the_question_in_the_prompt(tiny_qwen3, monkeypatch):
    """FINCH refuses a prefill without a question inside the prompt; the run's warm-up (on CUDA before the first timed
    item) gives it the prompt's last tokens as a stand-in question (``engine.stand_in_question``), as the launch and
    sync counters do — other methods get none."""
    from luka_bench.methods.finch import Finch
    from luka_bench.methods.snapkv import SnapKV

    assert engine.stand_in_question(Finch(budget=0.25), 96) == {"question_span": 16}
    assert engine.stand_in_question(Finch(budget=0.25), 20, tokens=32) == {"question_span": 10}
    assert engine.stand_in_question(SnapKV(budget=0.25), 96) == {}
    model, grad = tiny_qwen3.model, []
    real = model.forward

    def spy(*a, **kw):
        grad.append(torch.is_grad_enabled())
        return real(*a, **kw)

    monkeypatch.setattr(model, "forward", spy)
    assert engine.warm_up(model, Finch(budget=0.25), prompt_len=96, chunk=64, steps=2) > 0
    assert grad and not any(grad)  # a throwaway run: no autograd graph


# -- on a GPU (LUKA_TEST_DEVICE=cuda): what the mocks above cannot confirm ----------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or triton_kernel.triton is None
                               or triton_kernel.interpreted(), reason="a GPU with Triton (LUKA_TEST_DEVICE=cuda)")


@pytest.mark.device
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_cuda_smem_estimate_bounds_the_compiled_kernels(d, dtype):
    """Every tile configuration the kernel may pick compiles within its shared-memory estimate (so a
    configuration chosen to fit a device's limit fits it), read from the compiled kernels' metadata."""
    import triton

    fwd, mass_k = triton_kernel._kernels()
    bd = triton_kernel._pow2(d)
    elt = torch.empty((), dtype=dtype).element_size()
    limit = devices.smem_per_block(torch.device("cuda"))
    qs = torch.randn(1, 2, 130, d, device="cuda", dtype=dtype)
    k = torch.randn(1, 130, d, device="cuda", dtype=dtype)
    out, lse = torch.empty_like(qs), torch.empty(1, 2, 130, device="cuda")
    mass = torch.empty(1, 130, device="cuda")
    for bm, bn, stages in triton_kernel._configs(bd, bd, elt):
        est = triton_kernel.smem_bytes(bm, bn, bd, bd, elt, stages)
        if est > limit:
            continue
        prec = "ieee" if dtype == torch.float32 else "tf32"
        ck = fwd[(triton.cdiv(130, bm), 2)](qs, k, k, out, lse, lse, 130, 130, 0, 2, 130 * d, d, k.stride(0),
                                            k.stride(1), k.stride(0), k.stride(1), 130 * d, d, D=d, DV=d, BD=bd,
                                            BDV=bd, BM=bm, BN=bn, ENTROPY=True, PREC=prec, DOT32=False,
                                            num_warps=triton_kernel.NUM_WARPS, num_stages=stages)
        cm = mass_k[(triton.cdiv(130, bn), 1)](qs, k, lse, mass, 130, 130, 0, 2, 130 * d, d, k.stride(0),
                                               k.stride(1), D=d, BD=bd, BM=bm, BN=bn, PREC=prec, DOT32=False,
                                               num_warps=triton_kernel.NUM_WARPS, num_stages=stages)
        print(f"d={d} {dtype} tiles {bm}x{bn} stages {stages}: shared memory fwd {ck.metadata.shared}, "
              f"mass {cm.metadata.shared}, estimate {est}")
        assert ck.metadata.shared <= est and cm.metadata.shared <= est


@pytest.mark.device
@needs_gpu
def test_cuda_kernel_on_the_second_gpu_with_the_first_current():
    """model.device=cuda:1: the kernel runs on GPU 1 while GPU 0 is current, and equals float64."""
    if torch.cuda.device_count() < 2:
        pytest.skip("two GPUs")
    import test_triton_kernel as ref

    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(11)
    qs = (torch.randn(2, 3, 100, 64, generator=gen) * 0.3).to("cuda:1")
    k, v = torch.randn(2, 140, 64, generator=gen).to("cuda:1"), torch.randn(2, 140, 64, generator=gen).to("cuda:1")
    out, mass, _ = triton_kernel.attention_mass(qs, k, v, 40)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0 and out.device == qs.device
    ref_out, ref_mass, _ = ref._reference(qs, k, v, 40)
    torch.testing.assert_close(mass.double(), ref_mass, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    cache = MethodCache(Full(), [], cuda_events=True)
    with cache.span("attention", qs.device):
        qs @ k.transpose(1, 2)
    assert cache.timings["attention"] > 0  # events of GPU 1 paired and resolved


@pytest.mark.device
@needs_gpu
def test_cuda_kernel_compiles_once_for_every_length():
    """After one launch per (dtype, entropy), chunks of other lengths and prefixes compile nothing new."""
    fwd, mass_k = triton_kernel._kernels()

    def compiled():
        return sum(len(c[0]) for c in fwd.device_caches.values()) + \
            sum(len(c[0]) for c in mass_k.device_caches.values())

    def run(lq, past):
        qs = torch.randn(2, 3, lq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, past + lq, 128, device="cuda", dtype=torch.bfloat16)
        triton_kernel.attention_mass(qs, k, k, past, entropy=True)

    run(64, 0)
    before = compiled()
    for lq, past in ((65, 0), (100, 3), (128, 16), (1000, 4097), (77, 1)):
        run(lq, past)
    torch.cuda.synchronize()
    assert compiled() == before, (before, compiled())


def test_a_stale_kernel_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    """torch's extension loader waits forever on its build directory's ``lock``: a process killed while holding it
    would hang every later run (seen here: a CI run waited 18 minutes). A lock older than a build can take is removed;
    a fresh one (a build under way) is kept."""
    import os
    import time

    from luka_bench.methods.cpu_kernel import clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
    assert not clear_stale_lock(tmp_path)  # none there: nothing to do


def test_the_steady_allocator_is_the_default_set_once_per_process_and_can_be_turned_off(monkeypatch):
    """``steady_allocator`` (issue 61): by default glibc's mmap threshold fixed at 4 MiB (MKL's buffer cache kept),
    once per process (attaching a method calls it); ``LUKA_BENCH_ALLOCATOR=system`` and a process's own
    ``MALLOC_MMAP_THRESHOLD_`` leave glibc alone; ``LUKA_BENCH_MKL_CACHE=off`` turns MKL's cache off; an unknown
    setting is one line naming the allowed ones."""
    import ctypes

    from luka_bench.errors import OneLineError

    calls = []
    real = ctypes.CDLL

    class Lib:
        def __init__(self, name):
            self.name, self.lib = name, real(name)

        def __getattr__(self, fn):
            if fn not in ("mallopt", "mkl_serv_disable_fast_mm"):
                return getattr(self.lib, fn)
            return lambda *a: calls.append((fn, a)) or 1

    monkeypatch.setattr(ctypes, "CDLL", Lib)
    for var in ("LUKA_BENCH_ALLOCATOR", "LUKA_BENCH_MKL_CACHE", "LUKA_BENCH_MMAP_THRESHOLD", "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(var, raising=False)

    def fresh():
        monkeypatch.setattr(devices, "_STEADY", [False])
        monkeypatch.setattr(devices, "_TRIM", [])
        calls.clear()
        return devices.steady_allocator()

    assert fresh() is True and calls == [("mallopt", (-3, 4 << 20))]  # the default: threshold only, MKL's cache kept
    assert len(devices._TRIM) == 1  # and the heap trimmed after each layer a CPU prefill compresses (below)
    n = len(calls)
    assert devices.steady_allocator() is False and len(calls) == n  # once per process
    monkeypatch.setenv("LUKA_BENCH_ALLOCATOR", "system")
    assert fresh() is False and not calls
    monkeypatch.setenv("LUKA_BENCH_ALLOCATOR", "steady")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the process's own glibc setting wins (bench_memory.py)
    assert fresh() is False and not calls and not devices._TRIM
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("LUKA_BENCH_MMAP_THRESHOLD", "65536")
    monkeypatch.setenv("LUKA_BENCH_MKL_CACHE", "off")
    assert fresh() is True and ("mallopt", (-3, 65536)) in calls
    assert [c for c in calls if c[0] == "mkl_serv_disable_fast_mm"] or not torch.backends.mkl.is_available()
    monkeypatch.setenv("LUKA_BENCH_ALLOCATOR", "default")
    with pytest.raises(OneLineError, match=r"LUKA_BENCH_ALLOCATOR='default' is unknown; allowed: steady .*system"):
        fresh()


def test_a_cpu_prefill_that_compresses_each_layer_in_its_forward_trims_the_heap_after_each_layer(tiny_llama,
                                                                                                 monkeypatch):
    """``trim_heap`` (issue 61): where the harness set the allocator (``steady_allocator``), a CPU prefill whose layers
    compress inside its forward hands the heap's free pages back after each layer — the kept keys and values land
    between the layer's freed temporaries, and the pages left free between them stayed resident in an order that
    varied from process to process; elsewhere (the allocator not the harness's, a method that does not compress in
    the forward, a decode step) nothing is called."""
    import luka_bench as lb

    calls = []
    ids = torch.randint(0, tiny_llama.model.config.vocab_size, (40,)).tolist()
    layers = tiny_llama.model.config.num_hidden_layers
    for name, trims in (("snapkv", layers), ("streaming_llm", layers), ("full", 0)):
        monkeypatch.setattr(devices, "_TRIM", [lambda pad: calls.append(pad)])
        calls.clear()
        with lb.attach(tiny_llama.model, lb.method(name, **({} if name == "full" else {"budget": 0.5}))) as kv:
            kv.generate(ids, max_new_tokens=3)
        assert calls == [0] * trims, name  # once per layer of the prefill, none in the decode steps
    monkeypatch.setattr(devices, "_TRIM", [])  # the process's own allocator setting: left alone
    with lb.attach(tiny_llama.model, lb.method("snapkv", budget=0.5)) as kv:
        kv.generate(ids, max_new_tokens=1)
    assert calls == []
