"""The allocation check (issue 61): memory a method reports as held is what its cache allocates. After the prefill
and after 32 decode steps, every storage the cache reaches (``owned.owned_tensors``: stores, policies, per-prompt
state) against what the method reports (``kv_bytes`` less harness-only bytes) plus what it declares (the stores'
bookkeeping, their growth headroom, the policies' decode buffers): at most 5 % more, for every method config on a
tiny model."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from luka_bench.host_sync import sync_method_config
from luka_bench.methods import hf
from luka_bench.methods.owned import allocation, check, owned_tensors
from luka_bench.methods.snapkv import SnapKV
from luka_bench.methods.streaming_llm import StreamingLLM

from conftest import CONF

METHOD_CONFIGS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
PROMPT, STEPS, TOLERANCE = 400, 32, 1.05


def measured(lm, method, prompt: int = PROMPT, steps: int = STEPS):
    return check(lm.model, method, prompt, steps, tokenizer=lm.tokenizer)


def explain(a: dict) -> str:
    top = ", ".join(f"{p} {b}" for p, b in a["largest"][:5])
    return (f"allocated {a['allocated']} B vs declared {a['declared']} B (reported {a['reported']}, bookkeeping "
            f"{a['bookkeeping']}, headroom {a['headroom']}): x{a['ratio']:.3f}; largest: {top}")


@pytest.mark.parametrize("name", METHOD_CONFIGS)
def test_every_method_allocates_what_it_reports(name, tiny_gqa3):
    method = instantiate(sync_method_config(name), _convert_="all")
    prefill, decode, _ = measured(tiny_gqa3, method)
    assert prefill["ratio"] <= TOLERANCE, f"{name} after the prefill: {explain(prefill)}"
    assert decode["ratio"] <= TOLERANCE, f"{name} after {STEPS} decode steps: {explain(decode)}"


def test_the_check_counts_a_storage_once_and_sees_what_a_policy_hides(tiny_llama):
    """Views of one storage are one allocation; a tensor a policy keeps without reporting it makes the check fail."""
    from luka_bench.methods.full import Full

    _, before, cache = measured(tiny_llama, Full(), prompt=64, steps=2)
    store = cache.stores[0]
    keys = owned_tensors(cache)
    assert len({k for k in keys if keys[k][0].startswith("store[0]")}) >= 1
    assert before["ratio"] <= TOLERANCE
    store.policy.hidden = [store.keys[:, :, :2], torch.zeros(store.keys.numel() * 8)]  # a view (free) + a hidden buffer
    after = allocation(cache)
    assert after["allocated"] - before["allocated"] == store.keys.numel() * 8 * 4
    assert after["ratio"] > TOLERANCE


def test_storage_wider_than_what_the_heads_hold_fails_the_check(tiny_llama):
    """Slots a head stops holding (``unhold``) are out of ``kv_bytes``; while they stay allocated the check fails."""
    from luka_bench.methods.full import Full

    _, _, cache = measured(tiny_llama, Full(), prompt=256, steps=0)
    for s in cache.stores:
        b, h = s.keys.shape[:2]
        heads = torch.zeros(b, h, dtype=torch.bool)
        heads[:, 0] = True
        s.unhold(4, s.n - 4, heads, b)
    assert allocation(cache)["ratio"] > TOLERANCE


def test_decode_growth_stays_within_the_declared_room(tiny_llama):
    """Appending decode steps one by one never leaves more free slots than ``declared_room`` (the growth rule)."""
    from luka_bench.methods.full import Full

    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(5))
    with hf.attach(tiny_llama.model, Full()) as att, torch.no_grad():
        cache = att.new_cache(reference_length=40)
        tiny_llama.model(input_ids=ids[:, :40], past_key_values=cache, use_cache=True)
        for t in range(40, 300):
            tiny_llama.model(input_ids=ids[:, t: t + 1], past_key_values=cache, use_cache=True)
            for s in cache.stores:
                assert 0 <= s.storage()[0].shape[2] - s.n <= s.declared_room(), t


@pytest.mark.parametrize("make", [lambda: SnapKV(budget=0.6), lambda: StreamingLLM(budget=0.6)],
                         ids=["snapkv", "streaming_llm"])
def test_a_prefill_keeping_most_of_the_prompt_frees_the_rest(make, tiny_gqa3):
    """A compression that keeps 60 % of the prompt holds 60 % of its storage (the storage is not left as wide as the
    prompt because less than half was dropped)."""
    prefill, decode, cache = measured(tiny_gqa3, make(), prompt=400, steps=4)
    assert prefill["ratio"] <= TOLERANCE and decode["ratio"] <= TOLERANCE, explain(prefill)
    assert all(s.storage()[0].shape[2] <= s.n + s.declared_room() for s in cache.stores)
