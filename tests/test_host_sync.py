"""No host synchronisation on the decode path (design note 10): the ops that force a device-to-host copy
(``luka_bench.host_sync.SyncCounter``: ``.item()``/``int(t)``, ``nonzero``, boolean indexing, ``tolist``, linalg
error checks, host data handed to the device, kernels that synchronise inside on CUDA, ...) counted during each
steady-state decode step of every method, on a tiny model. On the CPU they are cheap, but they are the same ops
that stall a CUDA step, so counting them here proves their absence there.

Budget per step: 0 for every method on a step where it takes no host-side decision; a step where LycheeCluster
closes chunks reads the chunk boundaries' separator levels from the host token ids (declared host-side work: CPU
tensors, not counted) and hands the new boundaries to the device without a sync (``device.host_to_device``); 2 per
layer that updates its index (see EVENT_BUDGET). entropy_ols flushes (k-means, OLS fit, binning) are sync-free in
modes ols and drop: budget 0 per flush; mode linear: 2 per flush (pinv and svd). ``python -m luka_bench.host_sync``
prints the counts. Set ``LUKA_TEST_DEVICE=cuda`` to count on a GPU (copies to the host and to the device are
counted there too, and the steps also run under ``torch.cuda.set_sync_debug_mode``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from luka_bench.host_sync import SyncCounter, decode_sync_counts, sync_method_config
from luka_bench.models import TinyRandomModel

CONF = Path(__file__).resolve().parent.parent / "conf" / "method"
DEVICE = os.environ.get("LUKA_TEST_DEVICE", "cpu")
pytestmark = [pytest.mark.device, pytest.mark.usefixtures("one_thread")]  # one torch thread: conftest.one_thread


# syncs allowed on a step with events (host_sync.events: layers that flushed / updated their index this step), as
# a function of the number of events. lychee: 1 per step that closes chunks (the new tokens' separator levels, read
# from the host-side token ids) + 2 per layer that updates its index then (its CSR layout's padded gather widths:
# the largest cluster and the number of coarse units to visit, read once per update, not per step).
# (Since issue 37 the chunk boundaries' levels are declared host-side work and the new boundaries go to the device
# through ``device.host_to_device`` — pinned, non_blocking —: the per-step 1 is gone.) entropy_ols in linear mode:
# 2 per layer that flushes (``torch.linalg.pinv`` and ``torch.linalg.svd`` of the bins' map, batched over the bins:
# both synchronise inside on CUDA; there is no ``_ex`` variant), stated rather than fixed.
EVENT_BUDGET = {"lychee": lambda events: 2 * events, "entropy_ols mode=linear": lambda events: 2 * events}


def event_budget(name: str, overrides: dict):
    """The budget of a variant (``EVENT_BUDGET``), or None: 0 on every step."""
    key = name + "".join(f" {k}={v}" for k, v in overrides.items() if (name, k) == ("entropy_ols", "mode"))
    return EVENT_BUDGET.get(key, EVENT_BUDGET.get(name))
VARIANTS = [(p.stem, {}) for p in sorted(CONF.glob("*.yaml"))] + [
    ("luka_clustered", {"refine": {"rule": "threshold"}}),
    ("luka_clustered", {"refine": {"rule": "top_frac"}}),
    ("luka_clustered", {"levels": 2}),  # the general (tree) path
    ("entropy_ols", {"mode": "linear"}),
    ("entropy_ols", {"mode": "drop"}),
    ("h2o", {"decay": 0.9}),
    ("quest", {"select": "evaluation"}),  # the reference's accuracy-evaluation rule
]


@pytest.fixture(scope="module")
def model():
    return TinyRandomModel(name="tiny_qwen3", arch="qwen3", num_hidden_layers=3, device=DEVICE,
                           dtype="float32").load()


@pytest.mark.parametrize("name,overrides", VARIANTS,
                         ids=[n + "".join(f"-{k}" for k in o) for n, o in VARIANTS])
def test_decode_steps_do_not_sync(name, overrides, model):
    method = instantiate(sync_method_config(name, overrides), _convert_="all")
    rows = decode_sync_counts(model.model, method, prompt_len=400, steps=20, tokenizer=model.tokenizer)
    plain = [(i, n, dict(ops)) for i, (n, ev, ops, _) in enumerate(rows) if not ev and n]
    assert not plain, f"{name}: host syncs on decode steps without an event: {plain}"
    budget = event_budget(name, overrides) or (lambda events: 0)
    over = [(i, n, ev, dict(ops)) for i, (n, ev, ops, _) in enumerate(rows) if ev and n > budget(ev)]
    assert not over, f"{name}: more syncs than its budget on a step with events (step, syncs, events, ops): {over}"


def test_methods_with_events_reach_them():
    """The budgets above are tested, not vacuous: in these runs entropy_ols flushes and lychee closes chunks."""
    lm = TinyRandomModel(name="tiny_llama", arch="llama", num_hidden_layers=3, device=DEVICE,
                         dtype="float32").load()
    for name in ("entropy_ols", "lychee"):
        method = instantiate(sync_method_config(name), _convert_="all")
        rows = decode_sync_counts(lm.model, method, prompt_len=400, steps=20, tokenizer=lm.tokenizer)
        assert sum(r[1] for r in rows) > 0, name


def test_the_counter_sees_every_kind_of_sync():
    x = torch.arange(6.0, device=DEVICE)
    reps = torch.tensor([1, 2, 0], device=DEVICE)  # made outside: host data handed over is counted since issue 37
    with SyncCounter() as c:
        int(x[0]), float(x.sum()), bool((x > 2).any()), x.nonzero(), x[x > 2], x.tolist()
        torch.linalg.solve(torch.eye(2, device=DEVICE), torch.ones(2, 1, device=DEVICE))
        torch.arange(3, device=DEVICE).repeat_interleave(reps)
    assert c.ops == {"_local_scalar_dense": 3, "nonzero": 1, "index[bool]": 1, "tolist": 1,
                     "_linalg_check_errors": 1, "repeat_interleave": 1}, c.ops
    with SyncCounter() as c:  # none of these syncs
        y = torch.sort((x > 2).to(torch.uint8), stable=True).indices[:3] + x.argmax()
        torch.arange(3, device=DEVICE).repeat_interleave(reps, output_size=3)
        torch.linalg.solve_ex(torch.eye(2, device=DEVICE), torch.ones(2, 1, device=DEVICE))
    assert c.total == 0, c.ops
    assert y.shape == (3,)


def test_the_counter_sees_host_data_and_syncing_kernels():
    """Issue 37: host-to-device hand-overs (a tensor made from Python data: on a GPU a blocking copy, or host work
    to declare) and the kernels that synchronise inside on CUDA (svd, pinv, eigh, lstsq, equal, allclose,
    bincount, histc) are counted; a scalar written into a slice, ``host_side()`` work and
    ``device.host_to_device`` are not."""
    from luka_bench.device import host_to_device
    from luka_bench.host_sync import host_side

    x = torch.randn(6, 4, device=DEVICE)
    with SyncCounter() as c:
        torch.tensor([1, 2, 3], device=DEVICE)
        torch.linalg.svd(x, full_matrices=False)
        torch.linalg.pinv(x)
        torch.linalg.eigh(x.T @ x)
        torch.linalg.lstsq(x, x)
        torch.equal(x, x)
        torch.allclose(x, x)
        torch.histc(x)
    want = {"_linalg_svd": 1, "linalg_pinv": 1, "_linalg_eigh": 1, "linalg_lstsq": 1, "equal": 1, "allclose": 1,
            "histc": 1, ("host_data" if DEVICE == "cpu" else "copy_to_device"): 1}
    assert dict(c.ops) == want, c.ops
    with SyncCounter() as c:
        torch.bincount(torch.arange(3, device=DEVICE))
    assert dict(c.ops) == {"bincount": 1}, c.ops
    with SyncCounter() as c:  # none of these is counted
        x[:, 1:3] = 0
        with host_side():
            torch.tensor([4, 5]).tolist()
        host_to_device([1, 2], x.device)
    assert c.total == 0, c.ops


def test_the_counter_sees_blocking_copies_to_a_device():
    """A copy from the CPU to a device waits for the device on CUDA (non_blocking=False): counted. The meta device
    stands in for a GPU here (the copy is dispatched with a non-CPU destination)."""
    host = torch.arange(4)
    with SyncCounter() as c:
        host.to("meta")
        torch.tensor([1, 2], device="meta")
        torch.empty(4, device="meta").copy_(host)
    assert dict(c.ops) == {"copy_to_device": 3}, c.ops
    with SyncCounter() as c:
        host.to("meta", non_blocking=True)
    assert c.total == 0, c.ops


def test_tolist_is_counted_once(monkeypatch):
    """On a GPU ``tolist`` copies to the host inside (one sync): counted as ``tolist`` only, not again as the ops
    it runs (here a stand-in that reads a scalar first)."""
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, *a, **k: (float(t.sum()), real(t, *a, **k))[1])
    with SyncCounter() as c:
        torch.arange(3.0).tolist()
    assert dict(c.ops) == {"tolist": 1}, c.ops


def test_sync_debug_mode_around_each_step(monkeypatch, model):
    """``decode_sync_counts(sync_debug=...)`` runs each step under ``torch.cuda.set_sync_debug_mode`` and restores
    the default after it; with "warn" the synchronisation warnings CUDA raises are counted per step (mocked here:
    the forward of step 1 warns once)."""
    import warnings

    from luka_bench.methods.full import Full

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    real, steps = model.model.forward, []

    def forward(*a, **kw):
        steps.append(kw["input_ids"].shape[1])
        if len(steps) == 3:  # prefill, step 0, step 1
            warnings.warn("called a synchronizing CUDA operation", UserWarning)
        return real(*a, **kw)

    monkeypatch.setattr(model.model, "forward", forward)
    rows = decode_sync_counts(model.model, Full(), prompt_len=32, steps=3, sync_debug="warn")
    assert modes == ["warn", 0] * 3
    assert [r[2].get("cuda_sync_warnings", 0) for r in rows] == [0, 1, 0]
    assert [r[0] for r in rows] == [0, 0, 0]  # beside the counted syncs, not in them


def test_random_draws_happen_on_the_caches_device(monkeypatch):
    """LuKA's random compressor and LASER-KV's hyperplanes draw with a generator of the cache's device (a CPU draw
    copied over was a blocking host-to-device copy on every compressing step on CUDA)."""
    from luka_bench.methods.base import LayerInfo
    from luka_bench.methods.laser_kv import LaserKV
    from luka_bench.methods.luka_clustered import LuKAClustered, LuKAPolicy

    made = []
    real = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda device="cpu": made.append(torch.device(device)) or real(device))
    pol = LuKAPolicy(LuKAClustered(compressor="random"), LayerInfo(0, 1, 4, 2, 8))
    w = torch.zeros(1, 2, 3, 16, device=DEVICE)
    pi = pol._weights(w)
    assert made == [w.device] and pi.device == w.device and (pi.sum(-1) == 1).all()
    planes = LaserKV(budget=0.5).planes({"planes": None}, 8, w.device)
    assert made == [w.device, w.device] and planes.device == w.device


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA's sync debug mode (LUKA_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("name,overrides", VARIANTS,
                         ids=[n + "".join(f"-{k}" for k in o) for n, o in VARIANTS])
def test_decode_steps_do_not_sync_under_cuda_sync_debug(name, overrides, model):
    """On CUDA every synchronising call is seen by the driver-side check, counted op or not: a method with no
    event budget runs its decode steps under ``set_sync_debug_mode("error")``; the others under "warn", the
    warnings of each step within its budget (0 on steps without an event)."""
    method = instantiate(sync_method_config(name, overrides), _convert_="all")
    budget = event_budget(name, overrides)
    rows = decode_sync_counts(model.model, method, prompt_len=400, steps=20, tokenizer=model.tokenizer,
                              sync_debug="error" if budget is None else "warn")
    if budget is not None:
        bad = [(i, ev, dict(ops)) for i, (n, ev, ops, _) in enumerate(rows)
               if ops.get("cuda_sync_warnings", 0) > (budget(ev) if ev else 0)]
        assert not bad, bad


def test_entropy_ols_linear_flushes_cost_their_stated_syncs():
    """entropy_ols mode=linear flushes first after ~30 steps here (the 20-step runs above never reach one): every
    step with flushes syncs exactly 2 per flushing layer — ``linalg_pinv`` and ``_linalg_svd`` of the batched
    bins' map, the stated budget — and no other step syncs."""
    lm = TinyRandomModel(name="tiny_llama", arch="llama", num_hidden_layers=3, device=DEVICE,
                         dtype="float32").load()
    method = instantiate(sync_method_config("entropy_ols", {"mode": "linear"}), _convert_="all")
    rows = decode_sync_counts(lm.model, method, prompt_len=400, steps=40, tokenizer=lm.tokenizer)
    assert sum(r[1] for r in rows) > 0
    assert all(n == 2 * ev for n, ev, _, _ in rows), [(n, ev, dict(ops)) for n, ev, ops, _ in rows if n != 2 * ev]
    assert {k for r in rows for k in r[2]} == {"linalg_pinv", "_linalg_svd"}


@pytest.mark.parametrize("name", ["tova", "h2o", "streaming_llm", "luka_clustered", "quest", "arkvale", "clusterkv",
                                  "shadowkv", "adakv", "duo_attention", "laser_kv"])
def test_a_batch_of_rows_does_not_sync_either(name, model):
    """Issue 60: four rows of one length decoded together sync no more than one (0 on a step without an event)."""
    method = instantiate(sync_method_config(name), _convert_="all")
    rows = decode_sync_counts(model.model, method, prompt_len=400, steps=12, tokenizer=model.tokenizer, batch=4)
    plain = [(i, n, dict(ops)) for i, (n, ev, ops, _) in enumerate(rows) if not ev and n]
    assert not plain, f"{name}: host syncs on batched decode steps without an event: {plain}"


@pytest.mark.parametrize("name", sorted(p.stem for p in CONF.glob("*.yaml")))
def test_rows_of_different_lengths_decoded_together_do_not_sync_either(name, model):
    """Issue 60: three rows of 400, 393 and 386 tokens, each its own cache, decoded together (``hf.RowBatch``): no
    host sync on a step without an event, every method config; with events, the method's own budget (summed over
    the rows' events)."""
    method = instantiate(sync_method_config(name), _convert_="all")
    rows = decode_sync_counts(model.model, method, prompt_len=400, steps=8, tokenizer=model.tokenizer, batch=3,
                              ragged=True)
    budget = event_budget(name, {})
    bad = [(i, n, ev, dict(ops)) for i, (n, ev, ops, _) in enumerate(rows)
           if n > (budget(ev) if budget is not None and ev else 0)]
    assert not bad, f"{name}: host syncs on decode steps of rows of different lengths: {bad}"
