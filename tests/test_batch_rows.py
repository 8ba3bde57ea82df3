"""Rows of a batch, each exactly as it would be alone (issue 60), for every method config:

- rows of one length through one cache (``model(ids[B, L], past_key_values=cache)``): every method decides per row —
  each row's logits, kept positions per layer and KV head, and held bytes equal the same prompt run alone (fp64 tiny
  model: within 1e-9), and permuting the rows permutes the outputs (within 1e-9) — or refuses the batch in one line naming itself
  and why (lychee, FINCH: their token ids / question span are one per cache);
- rows of different lengths, each prefilled alone in its own cache and then decoded together (``hf.RowBatch``, the
  engine's ``teacher_force_rows`` / ``greedy_decode_rows``): ragged teacher-forced continuations and per-row greedy
  stop points, each row equal to the row alone and unchanged by its partners — every method config, none refused.
"""
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
KEEP_ALL = {"arkvale", "clusterkv", "full", "luka_clustered", "lychee", "oracle_topk", "quest"}


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
    # the rows swapped: each row's logits within the same 1e-9 (a BLAS may round a GEMM's rows by where they sit:
    # bit-equal on the machine of the earlier sessions, 1 ulp apart on an AMD EPYC for every method, full attention
    # included) and the same kept positions
    torch.testing.assert_close(swapped, logits.flip(0), rtol=0, atol=1e-9)
    assert kept_swapped == kept[::-1]


# -- rows of different lengths: each row its own cache, decoded together (``hf.RowBatch``, the engine's ``*_rows``) --

RAGGED = (240, 200, 150)  # context lengths; every row then gets a 4-token tail
FORCED = (6, 3, 5)  # teacher-forced continuation lengths (right-padded in effect: a row leaves when done)
LIMITS = (4, 2, 5)  # greedy tokens per row after the forced ones


def rows_run(lm, model, method, prompts, conts, limits, eos):
    """Each row prefilled alone with its tail (the tail rule), then together: its continuation teacher-forced, its
    last token fed, greedy decoding to its own limit. Per row: (log-probabilities, is-greedy, generated ids, the
    held positions per layer and KV head, held bytes, kv ratio at the end)."""
    from luka_bench import engine as E

    with attach(model, method, lm.tokenizer) as a:
        caches, logits = [], []
        for p in prompts:
            head, tail = p[:-4], p[-4:]
            c = a.new_cache(reference_length=len(head), **E.stand_in_question(method, len(head)))
            logits.append(E.prefill_with_tail(model, head, tail, c).logits)
            caches.append(c)
        forced = E.teacher_force_rows(model, caches, torch.stack(logits), conts, dtype=None)
        last = E.forward_rows(model, [c[-1] for c in conts], caches)
        gens = E.greedy_decode_rows(model, None, caches, last, list(limits), eos, ())
    out = []
    for c, f, g in zip(caches, forced, gens):
        kept = []
        for s in c.stores:
            pos, mask = s.positions[0], s.head_mask()
            kept.append([sorted(pos[h][mask[0, h]].tolist() if mask is not None else pos[h].tolist())
                         for h in range(pos.shape[0])])
        out.append((f.logprobs, f.greedy, g.token_ids, kept, c.held_bytes(), c.held_bytes() / c.full_bytes()))
    return out


@pytest.mark.parametrize("name", METHOD_CONFIGS)
def test_rows_of_different_lengths_decode_together_each_as_alone(name, model64):
    """Every method config (lychee and FINCH included: each row's token ids and question span are its own cache's):
    rows of 244, 204 and 154 prompt tokens, continuations of 6, 3 and 5 forced tokens, then 4, 2 and 5 greedy ones —
    each row's log-probabilities within 1e-9 (fp64) of the row alone, its greedy flags, generated ids, held positions
    per layer and KV head, held bytes and kv ratio equal; rows 2 and 0 alone together (other partners, another order)
    give the same rows again."""
    lm = tiny("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    lm.model = model64
    method = instantiate(sync_method_config(name), _convert_="all")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n + 4,), generator=g).tolist() for n in RAGGED]
    conts = [torch.randint(0, 256, (k,), generator=g).tolist() for k in FORCED]
    eos = {int(torch.randint(0, 256, (), generator=g))}
    solo = [rows_run(lm, model64, method, [prompts[r]], [conts[r]], [LIMITS[r]], eos)[0] for r in range(3)]
    together = rows_run(lm, model64, method, prompts, conts, LIMITS, eos)
    other = rows_run(lm, model64, method, [prompts[2], prompts[0]], [conts[2], conts[0]], [LIMITS[2], LIMITS[0]], eos)
    for r, row in enumerate(together):
        alone = solo[r]
        torch.testing.assert_close(row[0], alone[0], rtol=0, atol=1e-9)
        assert torch.equal(row[1], alone[1]) and row[2] == alone[2], f"{name}: row {r}'s tokens differ from alone"
        assert row[3] == alone[3] and row[4:] == alone[4:], f"{name}: row {r} holds other tokens than alone"
    assert (min(len(h) for layer in together[0][3] for h in layer) < RAGGED[0]) != (name in KEEP_ALL)
    for r, row in zip((2, 0), other):
        torch.testing.assert_close(row[0], together[r][0], rtol=0, atol=1e-9)
        assert row[2:] == together[r][2:], f"{name}: row {r} changed with its partners"
