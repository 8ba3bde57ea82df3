"""How often Quest's two selection rules (``select``: kernel, evaluation) pick different pages (SmolLM2-135M
offline, fp32 on the CPU, token_budget 256, page_size 16, full_layers 2). The prompt: the repository's method cards
concatenated (methods/*.md, sorted), the first PREFILL tokens prefilled, the next STEPS teacher-forced one token at
a time (decode steps). At every decode step, on every sparse layer and query head, both rules' page sets are
computed from the SAME query and keys (the bound of every page, the partial last page's over the tokens it holds):
kernel = the top K - 1 closed pages + the last page, evaluation = the top K of all pages, K = min(max(3, 256 // 16),
pages) = 16. The run itself follows the rule given (the states differ between the two runs). methods/quest.md
quotes its output.

    .venv/bin/python scripts/quest_rules.py [kernel|evaluation] [prefill tokens] [decode steps]
    (defaults: kernel 2000 300)
"""
import sys
from pathlib import Path

import torch

import luka_bench as lb
from luka_bench.methods.hf import attach
from luka_bench.methods.pages import page_bound
from luka_bench.methods.quest import Quest, QuestPolicy

follow = sys.argv[1] if len(sys.argv) > 1 else "kernel"
PREFILL = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 300
BUDGET, PS = 256, 16
torch.set_num_threads(2)
lm = lb.load_model("smollm2_135m", device="cpu", dtype="float32")
text = "\n\n".join(p.read_text() for p in sorted((Path(__file__).resolve().parent.parent / "methods").glob("*.md")))
ids = lm.tokenizer(text, return_tensors="pt").input_ids[:, : PREFILL + STEPS]
assert ids.shape[1] == PREFILL + STEPS, ids.shape
stats = {"sel": 0, "sel_differ": 0, "eval_no_last": 0, "steps": {}, "pid_match": 0}


def observer(store, query, out, scaling):
    pol = store.policy
    if not isinstance(pol, QuestPolicy) or pol.pid is None:
        return
    n, K = store.n, store.keys[0].float()
    hkv, _, d = K.shape
    pages = -(-n // PS)
    k = min(max(3, BUDGET // PS), pages)
    boxed = torch.cat([K, K[:, -1:].expand(hkv, pages * PS - n, d)], 1).view(hkv, pages, PS, d)
    bound = page_bound(query[0].reshape(hkv, -1, d), boxed.amax(2), boxed.amin(2))  # [Hkv, g, pages]
    top = torch.topk(bound[..., :-1], k - 1).indices
    kern = torch.cat([top, torch.full_like(top[..., :1], pages - 1)], -1).sort(-1).values
    ev = torch.topk(bound, k).indices.sort(-1).values
    differ = (kern != ev).any(-1)  # [Hkv, g]
    stats["sel"] += differ.numel()
    stats["sel_differ"] += int(differ.sum())
    stats["eval_no_last"] += int((ev != pages - 1).all(-1).sum())
    stats["pid_match"] += int(torch.equal(pol.pid.view(hkv, -1, k).sort(-1).values, kern if follow == "kernel" else ev))
    stats["steps"][store.seen] = stats["steps"].get(store.seen, False) or bool(differ.any())


with attach(lm.model, Quest(token_budget=BUDGET, page_size=PS, full_layers=2, select=follow)) as a, torch.no_grad():
    c = a.new_cache()
    lm.model(ids[:, :PREFILL], past_key_values=c)
    c.observer = observer
    for t in range(PREFILL, PREFILL + STEPS):
        lm.model(ids[:, t: t + 1], past_key_values=c)
layers = len(c.stores) - 2
print(f"run follows select={follow}; prefill {PREFILL}, {STEPS} decode steps, {layers} sparse layers x 9 query heads")
print(f"the run's pages read = its rule's set (recomputed) on {stats['pid_match']} of {STEPS * layers} layer-steps")
print(f"(layer, query head, step) selections: {stats['sel']}; the two rules differ on {stats['sel_differ']} "
      f"({100 * stats['sel_differ'] / stats['sel']:.1f}%); evaluation leaves the last page out on "
      f"{stats['eval_no_last']} "
      f"({100 * stats['eval_no_last'] / stats['sel']:.1f}%)")
st = stats["steps"]
print(f"decode steps where the rules differ on at least one (layer, head): {sum(st.values())} of {len(st)} "
      f"({100 * sum(st.values()) / len(st):.1f}%)")
