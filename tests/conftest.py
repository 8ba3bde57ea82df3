"""Shared fixtures: tiny random models (no files), the real config composed and shrunk."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"

# the cores shared among pytest-xdist's workers (``-n 2`` on 2 cores: one thread each): a worker running two
# threads on a core another worker also runs on waits at every parallel region for a descheduled thread
# (the whole suite took 2.8x as long so — 999 s against 360 s — single tests up to 9x)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
if _WORKERS > 1:  # the same for the processes a test starts (the CLI, sweeps, SLURM jobs)
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


@pytest.fixture(autouse=True, scope="session")
def _resolvers():
    """The config's resolvers (run folder names, what identifies a run), as the command line registers them
    before Hydra composes."""
    from luka_bench.config import register_resolvers

    register_resolvers()

# The device tests run on: cpu (default) or cuda (``LUKA_TEST_DEVICE=cuda``: tests that make sense on a GPU run
# there, e.g. the Triton kernel compiled for real, the host-sync counts). On the CPU, Triton kernels run in
# Triton's interpreter, which must be chosen before Triton is first imported.
DEVICE = os.environ.get("LUKA_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "device: runs on LUKA_TEST_DEVICE (cpu or cuda); with cuda only these run")


# Tests that mostly wait (for a SLURM queue, a requeue, accounting): run first, so that under ``-n 2`` their waits
# overlap the other worker's tests instead of leaving one core idle at the end of the run.
RUN_FIRST = ("test_slurm_cluster.py",)


def pytest_collection_modifyitems(config, items):
    """The waiting tests (``RUN_FIRST``) first, the rest in collection order. With LUKA_TEST_DEVICE=cuda, the tests
    written for any device (marked ``device``) run, on the GPU; the others (CPU fixtures, the C++ CPU kernel,
    CPU-side tensors) are skipped, not run on the wrong device."""
    items.sort(key=lambda item: item.path.name not in RUN_FIRST)  # stable: the order within each part is kept
    if DEVICE == "cpu":
        return
    skip = pytest.mark.skip(reason=f"CPU test; LUKA_TEST_DEVICE={DEVICE} runs the tests marked 'device'")
    for item in items:
        if item.get_closest_marker("device") is None:
            item.add_marker(skip)


def tiny(arch: str = "llama", **kw):
    from luka_bench.models import TinyRandomModel

    kw.setdefault("num_hidden_layers", 3 if arch != "gemma3" else 6)
    kw.setdefault("device", DEVICE)  # not "auto": on a GPU machine the CPU tests stay on the CPU
    if arch == "gemma3":
        kw.setdefault("num_key_value_heads", 1)
    return TinyRandomModel(name=f"tiny_{arch}", arch=arch, **kw).load()


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny("llama")


@pytest.fixture(scope="session")
def tiny_qwen3():
    return tiny("qwen3")


@pytest.fixture(scope="session")
def tiny_gqa3():
    """Llama with 3 query heads per KV head (SmolLM2's ratio: 9 / 3); the other tiny models have 2."""
    return tiny("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96)


@pytest.fixture(scope="session")
def tiny_gemma3():
    return tiny("gemma3")


def in_process(main, argv: list[str], cwd: Path | None = None):
    """A command's ``main()`` in this process as the shell would run it (``sys.argv = argv``, from ``cwd``):
    (returncode, stdout, stderr). The logging handlers it adds (Hydra's, lm-eval's) are removed after it and
    torch's thread count put back, so later tests see the process as it was."""
    import contextlib
    import io
    import logging
    import sys
    from types import SimpleNamespace

    old_argv, here, out, err, code = sys.argv, os.getcwd(), io.StringIO(), io.StringIO(), 0
    root = logging.getLogger()
    handlers, level, threads = list(root.handlers), root.level, torch.get_num_threads()
    sys.argv = list(argv)
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main() or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = old_argv
        os.chdir(here)
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        root.setLevel(level)
        torch.set_num_threads(threads)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def load_script(name: str):
    """``scripts/<name>.py`` as a module (registered under ``name``, as a script's sibling imports find it when it
    runs; no sys.path edit)."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def compose(*overrides: str):
    """The real config, composed like the CLI does, with the group names filled in."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = hcompose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    choices = cfg.hydra.runtime.choices
    with open_dict(cfg):
        for g in ("model", "method", "data"):
            cfg[f"{g}_name"] = choices[g]
        del cfg["hydra"]
    return cfg


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer from its converted folder, converting the GGUF once if this machine has not yet (the
    package is installed by scripts/setup.sh; without it the loader fails with its one-line install hint)."""
    from hydra.utils import instantiate
    from transformers import AutoTokenizer

    from luka_bench.models import cache_root

    folder = cache_root() / "models" / "smollm2_135m"
    if not (folder / "tokenizer.json").exists():
        instantiate(compose("model=smollm2_135m").model).load()
    return AutoTokenizer.from_pretrained(str(folder))


@contextlib.contextmanager
def attn_impl(model, name: str):
    """Run the block with the model on another attention implementation (sdpa, eager), then restore it."""
    prev = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            yield model
    finally:
        model.set_attn_implementation(prev)


def masked_eager_logits(model, ids, allowed: torch.Tensor) -> torch.Tensor:
    """Last-position logits of one un-cached eager forward in which query i sees key j only where
    ``allowed[..., i, j]`` ([L, L], or [Hq, L, L] for a per-head mask): the slow reference for eviction."""
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    mask = mask.view(1, -1, *allowed.shape[-2:])
    with attn_impl(model, "eager"):
        return model(ids, attention_mask=mask, use_cache=False).logits[0, -1]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and on a loaded machine a parallel region of a tiny matmul
    waits for a descheduled thread (measured here: 25 ms per linear instead of 0.03 ms)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def fixed_and_python_slots(monkeypatch, model, method_factory, classes, ids, prefill: int, clone_at: int, record,
                           env: dict | None = None, patches: tuple = ()):
    """Teacher-forced decode of ``ids`` after a ``prefill``-token prefill, twice: with the graph-ready decode steps
    (``static_decode`` on the policy ``classes``: the step written at a slot held on the device) and with them off
    (written at Python slots); the cache is cloned before step ``clone_at``. Returns, per run, ([(logits,
    record(cache)) per step], layers whose storage grew on the way). ``env``: variables set for both runs;
    ``patches``: (object, attribute, value) set for both runs."""
    from luka_bench.methods.hf import attach

    def run(static):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        for cls in classes:
            monkeypatch.setattr(cls, "static_decode", static)
        for obj, name, value in patches:
            monkeypatch.setattr(obj, name, value)
        steps, grew = [], set()
        with attach(model, method_factory()) as a, torch.no_grad():
            c = a.new_cache()
            model(ids[:, :prefill], past_key_values=c)
            for t in range(prefill, ids.shape[1]):
                if t == clone_at:
                    c = c.clone()
                caps = [s.storage()[0].shape[2] for s in c.stores]
                logits = model(ids[:, t: t + 1], past_key_values=c).logits[0, -1]
                grew |= {i for i, s in enumerate(c.stores) if s.storage()[0].shape[2] != caps[i]}
                assert all((s.static_slot is not None) == static for s in c.stores)
                steps.append((logits, record(c)))
        monkeypatch.undo()
        return steps, grew

    return run(True), run(False)


class TailFeed:
    """Counts the tokens fed as decode steps before the first generated token (the engine's tail rule): a forward
    pre-hook on ``model`` records every forward through a method cache as (phase before it, tokens), and
    ``engine.greedy_decode_rows`` (patched with ``monkeypatch``; ``greedy_decode`` is its one-row case) marks where
    greedy decoding starts."""

    def __init__(self, model, monkeypatch):
        from luka_bench import engine as E

        self.events: list[tuple] = []
        self.handles = []
        if model is not None:
            self.watch(model)
        real = E.greedy_decode_rows
        monkeypatch.setattr(E, "greedy_decode_rows", lambda *a, **k: self.events.append(("generate",)) or
                            real(*a, **k))

    def watch(self, model):
        self.handles.append(model.register_forward_pre_hook(self._hook, with_kwargs=True))
        return model

    def _hook(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if cache is not None and hasattr(cache, "phase") and ids is not None and not cache.splitting:
            self.events.append((cache.phase, int(ids.shape[1])))

    def fed(self) -> list[int]:
        """Per generation: decode-phase tokens fed after its prefill and before its first generated token."""
        out, n = [], None
        for e in self.events:
            if e[0] == "prefill":
                n = 0
            elif e[0] == "decode" and n is not None:
                n += e[1]
            elif e[0] == "generate":
                out.append(n)
                n = None
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def prefilled(a, model, prompts):
    """One cache per prompt through the attached method ``a`` (``hf.attach``), each prompt prefilled alone with the
    method's stand-in question: rows ready to be decoded together (``engine.forward_rows``) or alone."""
    from luka_bench.engine import stand_in_question

    caches = []
    for p in prompts:
        c = a.new_cache(reference_length=len(p), **stand_in_question(a.method, len(p)))
        c.add_tokens(p)
        model(torch.tensor([p]), past_key_values=c)
        caches.append(c)
    return caches
