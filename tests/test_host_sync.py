"""No host synchronisation on the decode path (design note 10): the ops that force a device-to-host copy
(``luka_bench.host_sync.SyncCounter``: ``.item()``/``int(t)``, ``nonzero``, boolean indexing, ``tolist``, linalg
error checks, ...) counted during each steady-state decode step of every method, on a tiny model. On the CPU they
are cheap, but they are the same ops that stall a CUDA step, so counting them here proves their absence there.

Budget per step: 0 for every method on a step where it takes no host-side decision; a step where LycheeCluster
closes chunks may read the chunk boundaries' separator levels from the host token ids (1 ``tolist`` of a CPU
tensor, per step: the chunker is shared by the layers; not a device sync on a GPU) and 2 per layer that updates
its index (see EVENT_BUDGET). entropy_ols flushes (k-means, OLS fit, binning) are sync-free: budget 0 per flush. ``python -m luka_bench.host_sync`` prints the counts.
Set ``LUKA_TEST_DEVICE=cuda`` to count on a GPU (copies to the host are counted there too)."""
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
EVENT_BUDGET = {"lychee": lambda events: 1 + 2 * events}
VARIANTS = [(p.stem, {}) for p in sorted(CONF.glob("*.yaml"))] + [
    ("luka_clustered", {"refine": {"rule": "threshold"}}),
    ("luka_clustered", {"refine": {"rule": "top_frac"}}),
    ("luka_clustered", {"levels": 2}),  # the general (tree) path
    ("entropy_ols", {"mode": "linear"}),
    ("entropy_ols", {"mode": "drop"}),
    ("h2o", {"decay": 0.9}),
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
    budget = EVENT_BUDGET.get(name, lambda events: 0)
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
    with SyncCounter() as c:
        int(x[0]), float(x.sum()), bool((x > 2).any()), x.nonzero(), x[x > 2], x.tolist()
        torch.linalg.solve(torch.eye(2, device=DEVICE), torch.ones(2, 1, device=DEVICE))
        torch.arange(3, device=DEVICE).repeat_interleave(torch.tensor([1, 2, 0], device=DEVICE))
    assert c.ops == {"_local_scalar_dense": 3, "nonzero": 1, "index[bool]": 1, "tolist": 1,
                     "_linalg_check_errors": 1, "repeat_interleave": 1}, c.ops
    with SyncCounter() as c:  # none of these syncs
        y = torch.sort((x > 2).to(torch.uint8), stable=True).indices[:3] + x.argmax()
        torch.arange(3, device=DEVICE).repeat_interleave(torch.tensor([1, 2, 0], device=DEVICE), output_size=3)
        torch.linalg.solve_ex(torch.eye(2, device=DEVICE), torch.ones(2, 1, device=DEVICE))
    assert c.total == 0, c.ops
    assert y.shape == (3,)
