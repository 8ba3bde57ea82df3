"""Real-shape random-weight models (``conf/model/shape_*.yaml``, ``models.ShapeModel``): the architecture is
built from the config's numbers — checked on the ``meta`` device (no memory: the 8B shape is never allocated
here) by counting parameters against the count the numbers imply — and a shrunk copy (``scale``) runs a method
in bfloat16 on the CPU."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from luka_bench.methods.h2o import H2O
from luka_bench.methods.hf import attach

from conftest import compose

SHAPES = ["shape_llama31_8b", "shape_qwen3_4b"]


def implied_parameters(c) -> int:
    """Parameters of a Llama/Qwen3 decoder with these numbers: embeddings, per layer q/k/v/o projections, the
    gated MLP and two RMSNorms (+ Qwen3's q/k norms over head_dim), a final norm, the LM head unless tied."""
    h, hd, q, kv, i, v = (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                          c.intermediate_size, c.vocab_size)
    layer = h * q * hd + 2 * h * kv * hd + q * hd * h + 3 * h * i + 2 * h
    if c.model_type == "qwen3":
        layer += 2 * hd
    return v * h + c.num_hidden_layers * layer + h + (0 if c.tie_word_embeddings else v * h)


@pytest.mark.parametrize("name", SHAPES)
def test_full_shape_built_from_the_config_numbers_on_meta(name):
    cfg = compose(f"model={name}").model
    lm = instantiate(cfg).load(device="meta")
    c = lm.model.config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "tie_word_embeddings"):
        assert getattr(c, key) == cfg[key], key
    assert c.rope_parameters["rope_theta"] == cfg.rope_parameters.rope_theta
    assert lm.info["parameters"] == implied_parameters(c)
    assert all(p.device.type == "meta" for p in lm.model.parameters())
    assert lm.max_context == cfg.max_context


@pytest.mark.parametrize("name", SHAPES)
def test_shrunk_shape_runs_a_method_in_bfloat16(name):
    cfg = compose(f"model={name}", "model.scale=0.0625", "model.device=cpu", "model.dtype=bfloat16").model
    lm = instantiate(cfg).load()
    c = lm.model.config
    full = compose(f"model={name}").model
    assert c.num_attention_heads // c.num_key_value_heads == full.num_attention_heads // full.num_key_value_heads
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    assert lm.info["parameters"] == implied_parameters(c) < 1e7  # shrunk: a few million
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(0))
    with attach(lm.model, H2O(budget=0.5)) as a, torch.no_grad():
        cache = a.new_cache(reference_length=70, manual=True)
        lm.model(ids[:, :70], past_key_values=cache)
        cache.end_prefill()
        for t in range(70, 80):
            logits = lm.model(ids[:, t: t + 1], past_key_values=cache).logits
    assert torch.isfinite(logits).all()
    assert cache.stores[0].n == 40 and cache.stores[0].keys.dtype == torch.bfloat16


def test_bad_scale_is_one_line_error():
    from luka_bench.models import ModelConfigError

    cfg = compose("model=shape_qwen3_4b", "model.scale=2", "model.device=cpu").model
    with pytest.raises(ModelConfigError, match="model.scale=2"):
        instantiate(cfg).check()
