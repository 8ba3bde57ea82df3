"""Half precision (the dtypes users run on GPUs), on the CPU: every method on tiny Llama / Qwen3 / Gemma3 in
bfloat16 and float16 runs through a prefill, a question chunk and decode steps with finite logits; the exactness
invariants hold in that dtype; the accumulations that must be fp32 (attention masses, entropies, k-means, the OLS
fit, LSH projections) are fp32; and the command line runs with ``model.dtype=bfloat16``.

Tolerance of an invariant "method X = full" in a half dtype: X and full compute the same function with different
roundings (X: fp32 softmax over half-precision logits, or other summation orders; full: SDPA in the dtype), so
each is off the fp32 result by about the dtype's own rounding noise. The noise is measured on the same model and
input — ``noise`` = max |full in the dtype - full in fp32| over the logits — and X may differ from full by
``NOISE_FACTOR`` times it (the two errors add; factor 2 plus a margin), plus 1e-3 absolute. A real violation
(a wrong token kept, a page mass off) moves logits by far more: see test_invariant_tolerance_catches_an_eviction.
"""
from __future__ import annotations

import dataclasses

import functools
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from luka_bench.host_sync import sync_method_config
from luka_bench.methods import attention
from luka_bench.methods.full import Full
from luka_bench.methods.hf import attach
from luka_bench.methods.luka_clustered import LuKAClustered
from luka_bench.methods.lychee import Lychee

from conftest import DEVICE, tiny

# LUKA_TEST_DEVICE=cuda: the same tests on the GPU (tiny() builds there); one torch thread (conftest.one_thread)
pytestmark = [pytest.mark.device, pytest.mark.usefixtures("one_thread")]



CONF = Path(__file__).resolve().parent.parent / "conf" / "method"
METHODS = sorted(p.stem for p in CONF.glob("*.yaml"))
ARCHS = ["llama", "qwen3", "gemma3"]
DTYPES = [torch.bfloat16, torch.float16]
NOISE_FACTOR = 3.0
CTX, QUESTION, STEPS = 100, 4, 6


@functools.cache
def model(arch: str, dtype: torch.dtype):
    """The same random weights in every dtype (one seed): the fp32 model is the reference."""
    return tiny(arch, dtype=str(dtype).removeprefix("torch."))


@functools.cache
def ids(arch: str):
    lm = model(arch, torch.float32)
    text = ("The harbour master counted the boats twice, once at dawn and once at dusk.\n\n" * 8)
    return lm.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[:, : CTX + QUESTION + STEPS]


def run(lm, method, x):
    """Context prefill, end_prefill, a question chunk, then one token at a time (as the runner), with the
    token ids handed over (lychee chunks by text). Returns (logits of every position, fp32; the cache)."""
    model_ = lm.model
    x = x.to(model_.device)
    with attach(model_, method, lm.tokenizer) as a, torch.no_grad():
        # a method that needs the question inside the prefill (FINCH): the context's last 8 tokens stand for it
        c = a.new_cache(reference_length=CTX, manual=True, question_span=8 if method.question_in_prompt else 0)
        out = []
        for lo, hi in [(0, CTX), (CTX, CTX + QUESTION)] + [(t, t + 1) for t in range(CTX + QUESTION, x.shape[1])]:
            c.add_tokens(x[0, lo:hi].tolist())
            out.append(model_(x[:, lo:hi], past_key_values=c).logits.float())
            if hi == CTX:
                c.end_prefill()
    return torch.cat(out, 1), c


@functools.cache
def full_logits(arch: str, dtype: torch.dtype):
    return run(model(arch, dtype), Full(), ids(arch))[0]


def noise(arch: str, dtype: torch.dtype) -> float:
    return (full_logits(arch, dtype) - full_logits(arch, torch.float32)).abs().max().item()


def assert_close_to_full(got, arch, dtype):
    ref = full_logits(arch, dtype)
    tol = NOISE_FACTOR * noise(arch, dtype) + 1e-3
    err = (got - ref).abs().max().item()
    print(f"[{arch} {str(dtype)[6:]}] max |X - full| {err:.3g}, noise {noise(arch, dtype):.3g}, tolerance {tol:.3g}")
    assert err <= tol, f"max |X - full| = {err:.4g} > {tol:.4g} ({NOISE_FACTOR} x the {dtype} noise + 1e-3)"


MASKS = {"razor_bias"}


def fp32_state(cache) -> list[tuple[str, torch.dtype]]:
    """Every accumulator a method keeps that must be fp32: per-token masses/entropies (store aux), LuKA's page
    importance, entropy_ols's biases/masses/entropies, lychee's chunk keys and centroids (k-means)."""
    found = []
    for s in cache.stores:
        # flags (bool) and additive attention masks (razor_attention's, in the attention's own dtype) are no sums
        found += [(f"aux:{k}", a.dtype) for k, a in s._aux.items() if a.dtype != torch.bool and k not in MASKS]
        p = s.policy
        for name in ("imp", "sb", "smass", "sent", "ck", "mu_c", "r_c", "mu_g", "r_g"):
            val = getattr(p, name, None)
            for t in (val if isinstance(val, list) else [val]):
                if torch.is_tensor(t):
                    found.append((f"{type(p).__name__}.{name}", t.dtype))
    return found


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", METHODS)
def test_every_method_runs_in_half_precision(name, arch, dtype):
    lm = model(arch, dtype)
    method = instantiate(sync_method_config(name), _convert_="all")
    if name == "finch" and arch == "gemma3":  # re-rotation needs every layer's positions to move (none sliding)
        method = dataclasses.replace(method, rerotate=False)
    logits, c = run(lm, method, ids(arch))
    assert torch.isfinite(logits).all(), f"{name} on {arch} in {dtype}: non-finite logits"
    assert all(s.keys.dtype == dtype for s in c.stores if s._k is not None)  # the cache is held in the dtype
    state = fp32_state(c)
    assert all(dt == torch.float32 for _, dt in state), state
    if name in ("h2o", "luka_lined", "entropy_ols", "luka_clustered", "lychee"):
        assert state, f"{name}: no fp32 accumulator found to check"


# -- exactness invariants, in the dtype ---------------------------------------------------------------------
BUDGET_ONE = ["h2o", "streaming_llm", "snapkv", "entropy_ols", "laser_kv"]  # luka_lined is H2O


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", BUDGET_ONE)
def test_budget_one_equals_full(name, arch, dtype):
    method = instantiate(sync_method_config(name, {"budget": 1.0}), _convert_="all")
    got, c = run(model(arch, dtype), method, ids(arch))
    assert all(s.n == s.seen or s.is_sliding for s in c.stores)  # nothing evicted
    assert_close_to_full(got, arch, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_luka_refining_every_page_equals_full(arch, dtype):
    method = LuKAClustered(page_size=8, tail=16, compress_every=4, refine={"rule": "top_frac", "fraction": 1.0})
    got, c = run(model(arch, dtype), method, ids(arch))
    assert max(s.policy.P[1] for s in c.stores if hasattr(s.policy, "P")) > 5  # pages really exist
    assert_close_to_full(got, arch, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lychee_covering_everything_equals_full(arch, dtype):
    method = Lychee(token_budget=60, sink=4, buffer=16, full_layers=0, k_g=64, k_c=10 ** 6)
    got, c = run(model(arch, dtype), method, ids(arch))
    assert all(s.policy.last is not None and s.policy.M >= 4 for s in c.stores)  # retrieval really ran
    assert_close_to_full(got, arch, dtype)


def test_invariant_tolerance_catches_an_eviction():
    """The tolerance is tight enough to fail: H2O at budget 0.9 (a tenth of the tokens gone) is outside it."""
    method = instantiate(sync_method_config("h2o", {"budget": 0.9}), _convert_="all")
    got, _ = run(model("llama", torch.bfloat16), method, ids("llama"))
    with pytest.raises(AssertionError):
        assert_close_to_full(got, "llama", torch.bfloat16)


# -- fp32 accumulations ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("lq", [1, 100], ids=["decode", "prefill"])
def test_attention_masses_and_entropies_are_fp32(lq, dtype):
    class _Store:
        def __init__(self, k, v):
            self.keys, self.values = k, v

    gen = torch.Generator().manual_seed(lq)
    q = torch.randn(1, 6, lq, 32, generator=gen).to(DEVICE, dtype)
    k = torch.randn(1, 2, 120, 32, generator=gen).to(DEVICE, dtype)
    v = torch.randn(1, 2, 120, 32, generator=gen).to(DEVICE, dtype)
    out, mass = attention.attention_with_mass(_Store(k, v), q, 32 ** -0.5)
    _, mass2, _, ent, _ = attention.attention_with_extra(_Store(k, v), q, 32 ** -0.5)
    assert out.dtype == dtype and mass.dtype == mass2.dtype == ent.dtype == torch.float32
    # fp32 masses: every query's weights sum to 1 to fp32 precision, not to the dtype's (bf16: 1 +- 4e-3)
    assert abs(mass.sum().item() - 6 * lq) < 1e-5 * 6 * lq


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_kmeans_ols_and_lsh_are_fp32(dtype):
    from luka_bench.methods.entropy_ols_fit import fit_ols_entries
    from luka_bench.methods.kmeans import euclidean_kmeans
    from luka_bench.methods.laser_kv import simhash_codes
    from luka_bench.methods.lychee import node_stats, spherical_kmeans

    gen = torch.Generator().manual_seed(0)
    kb = torch.randn(1, 2, 3, 16, 32, generator=gen).to(dtype)  # [B, H, bins, m, D]
    c, onehot = euclidean_kmeans(kb, 4, 5)
    assert c.dtype == onehot.dtype == torch.float32
    q = torch.randn(1, 2, 1, 8, 32, generator=gen).to(dtype)
    vb = torch.randn(1, 2, 3, 16, 32, generator=gen).to(dtype)
    keys, values, bias, _ = fit_ols_entries(q, kb, vb, torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 1, 8),
                                            32 ** -0.5, 4, 5, 1e-3)
    assert bias.dtype == torch.float32 and keys.dtype == values.dtype == dtype  # fitted in fp32, held in dtype
    assert torch.isfinite(values.float()).all()
    # lychee pools keys in fp32 (LycheePolicy.pool) before its spherical k-means and node statistics
    x = torch.nn.functional.normalize(kb[:, :, 0].float(), dim=-1)
    a, cent = spherical_kmeans(x, 4, 5)
    cnt, mu, r = node_stats(x, a, 4)
    assert cent.dtype == mu.dtype == r.dtype == torch.float32
    # LASER-KV's SimHash projections run in fp32 whatever the keys' dtype: codes equal the fp32 keys' codes
    planes = torch.randn(8, 6, 32, generator=gen)
    assert torch.equal(simhash_codes(kb[0, 0, 0], planes), simhash_codes(kb[0, 0, 0].float(), planes))


# -- the command line ------------------------------------------------------------------------------------------
def test_cli_runs_in_bfloat16(tmp_path):
    import json

    from test_cli import cli_here  # the command line's entry point, in this process

    proc = cli_here("model=tiny_llama", "model.dtype=bfloat16", "method=h2o", "data.limit=1", "max_new_tokens=3",
                    "progress=false", "threads=1", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = json.loads((tmp_path / "env.json").read_text())
    assert "bfloat16" in json.dumps(env), env
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["n_examples"] >= 1
    preds = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert preds and all(p.get("prediction") is not None for p in preds)
