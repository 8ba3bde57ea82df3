"""A batch of rows through one cache (issue 60, its first step: rows of one length, unpadded): every method config
decides per row — each row's logits, kept positions per layer and KV head, and held bytes equal the same prompt run
alone (fp64 tiny model: within 1e-9), and permuting the rows permutes the outputs — or refuses the batch in one
line naming itself and why. Rows of different lengths, the engine and the clients on batches are the issue's next
steps."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from luka_bench.host_sync import sync_method_config
from luka_bench.methods.hf import attach

from conftest import CONF, tiny

pytestmark = pytest.mark.device  # LUKA_TEST_DEVICE=cuda runs them on the GPU (docs/gpu.md)

METHOD_CONFIGS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
REFUSE = {"lychee": "its chunks follow the prompt's token ids", "finch": "its question lies inside the prompt"}
# held once per cache, whatever its rows: ShadowKV's RoPE table (its step reads the table of positions 0..L0-1)
CTX, QUESTION, LENGTH = 240, 5, 270
# methods that hold every token (they select what to read at each step: the logits check it per row); every other
# config compresses this prompt (the test would be vacuous otherwise)
KEEP_ALL = {"arkvale", "clusterkv", "full", "luka_clustered", "oracle_topk", "quest"}


@pytest.fixture(scope="module")
def model64():
    lm = tiny("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    return lm.model.double()


def run(model, method, ids):
    """Prefill ids[:, :CTX], a question chunk, then one token at a time (teacher-forced). Returns the logits
    [B, L, V], the held bytes the rows hold (less what a cache holds once for all its rows), and per row, layer
    and KV head the held positions (sorted)."""
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=CTX, manual=True)
        out = [model(ids[:, :CTX], past_key_values=c).logits]
        c.end_prefill()
        out.append(model(ids[:, CTX: CTX + QUESTION], past_key_values=c).logits)
        for t in range(CTX + QUESTION, ids.shape[1]):
            out.append(model(ids[:, t: t + 1], past_key_values=c).logits)
    kept = []
    for row in range(ids.shape[0]):
        per = []
        for s in c.stores:
            pos, mask = s.positions[row], s.head_mask()
            per.append([sorted(pos[h][mask[row, h]].tolist() if mask is not None else pos[h].tolist())
                        for h in range(pos.shape[0])])
        kept.append(per)
    shared = sum(getattr(s.policy, "rope_bytes", 0) for s in c.stores)
    return torch.cat(out, 1), c.held_bytes() - shared, kept


@pytest.mark.parametrize("name", METHOD_CONFIGS)
def test_every_row_of_a_batch_is_the_row_alone(name, model64):
    method = instantiate(sync_method_config(name), _convert_="all")
    ids = torch.randint(0, 256, (2, LENGTH), generator=torch.Generator().manual_seed(11))
    if name in REFUSE:
        with pytest.raises(ValueError, match=f"^method={name} runs one sequence at a time: got a batch of 2 "
                                             f"\\({REFUSE[name]}"):
            run(model64, method, ids)
        return
    solo = [run(model64, method, ids[r: r + 1]) for r in range(2)]
    logits, held, kept = run(model64, method, ids)
    for r in range(2):
        torch.testing.assert_close(logits[r], solo[r][0][0], rtol=0, atol=1e-9)
        assert kept[r] == solo[r][2][0], f"{name}: row {r} kept other positions than alone"
    assert held == solo[0][1] + solo[1][1]
    assert (min(len(h) for layer in kept[0] for h in layer) < LENGTH) != (name in KEEP_ALL)
    swapped, _, kept_swapped = run(model64, method, ids.flip(0))
    assert torch.equal(swapped, logits.flip(0)) and kept_swapped == kept[::-1]
