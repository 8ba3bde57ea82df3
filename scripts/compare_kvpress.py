"""Kept positions per layer and KV head: our prefill methods against NVIDIA kvpress's presses on the same model, the
same token ids and the same settings (issue 49).

    .venv/bin/python scripts/compare_kvpress.py --kvpress ../kvpress-venv/bin/python            # every pair, 2,048 tokens
    .venv/bin/python scripts/compare_kvpress.py --kvpress ../kvpress-venv/bin/python --methods pyramidkv --tokens 4096 \\
        --budget 0.5 --out results/summaries/kvpress_compare

kvpress runs in a venv of its own (it pins an older transformers: ``python3 -m venv ../kvpress-venv &&
../kvpress-venv/bin/pip install torch==2.13.0 kvpress==0.5.5``). The model (SmolLM2 by default, ``--model``) is saved
once to a folder and the essays' first ``--tokens`` token ids written to a file (``scripts/bench_memory.py``'s
export); the kvpress interpreter runs this file with ``--kvpress-child``: one forward of the ids under
``with press(model):`` into a ``DynamicCache`` — kvpress compresses each layer in its attention's forward hook — and
the kept positions are recovered by matching each kept key row to the uncompressed cache's (post-RoPE keys are
unique per position; none of the compared presses re-rotates; AdaKV masks instead of dropping: its kept set is what ``masked_key_indices`` leaves). Our side: the
same ids through ``luka_bench`` with the method's kvpress-equivalent settings, then ``store.positions``.

Pairs (ours ↔ kvpress), budget b = 1 - compression_ratio, chosen so that ``b * tokens`` is an integer (kvpress
floors, we ceil):
- ``knorm`` ↔ ``KnormPress``;  ``snapkv`` (window 64, kernel 5, avg) ↔ ``SnapKVPress``;
- ``pyramidkv`` (``budget_rule=kvpress``) ↔ ``PyramidKVPress`` (window 64, kernel 5, beta 20);
- ``adakv`` (``rule=kvpress``, window 64, kernel 5, avg, alpha 0.2) ↔ ``AdaKVPress(SnapKVPress(), 0.2)``;
- ``finch`` (``rerotate=false``, the last ``--question`` tokens the question) ↔ ``FinchPress`` with that window
  (its delimiter detection bypassed: the window size set directly); ``finch_chunked``: the same per chunk of 512
  (``chunk=512`` ↔ ``chunk_length=512``);
- ``tova`` (``decode=false, protect_last=true``) ↔ ``TOVAPress``; ``expected_attention`` ↔ ``ExpectedAttentionPress``
  (defaults: 512 future positions, 4 sinks, covariance, ‖v‖).
A head is identical when both keep the same set; the script prints, per method, identical heads / all heads, and for
the others how many positions differ and whether the differing tokens sit at a near-tie of the score (the two
transformers versions and attention kernels differ in the last bits of the keys).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAIRS = ("knorm", "snapkv", "pyramidkv", "adakv", "finch", "finch_chunked", "tova", "expected_attention")
# kvpress's count of kept tokens (``+method.rounding=kvpress``: max(1, int(n * (1 - ratio))), where ours is
# ceil(budget * n)) for the presses that count so; PyramidKV and FINCH have rules of their own
KV = "+method.rounding=kvpress"
OURS = {
    "knorm": ["method=knorm", KV],
    "snapkv": ["method=snapkv", "method.window=64", "method.kernel=5", "method.pooling=avg", KV],
    "pyramidkv": ["method=pyramidkv", "method.window=64", "method.kernel=5", "method.pooling=avg", "method.beta=20",
                  "method.budget_rule=kvpress"],
    "adakv": ["method=adakv", "method.window=64", "method.kernel=5", "method.pooling=avg", "method.alpha=0.2",
              "method.rule=kvpress", KV],
    "finch": ["method=finch", "method.rerotate=false"],
    "finch_chunked": ["method=finch", "method.rerotate=false", "method.chunk=512"],
    "tova": ["method=tova", "method.decode=false", "method.protect_last=true", KV],
    "expected_attention": ["method=expected_attention", KV],
}


def kvpress_child(name: str, model_dir: str, ids_file: str, tokens: int, budget: float, question: int) -> dict:
    """Run by the kvpress venv's interpreter: kept positions [layer][head] under kvpress's press ``name``."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    import kvpress as K

    ratio = 1 - budget
    press = {
        "knorm": lambda: K.KnormPress(compression_ratio=ratio),
        "snapkv": lambda: K.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5),
        "pyramidkv": lambda: K.PyramidKVPress(compression_ratio=ratio, window_size=64, kernel_size=5, beta=20),
        "adakv": lambda: K.AdaKVPress(K.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5), 0.2),
        "finch": lambda: K.FinchPress(compression_ratio=ratio, rerotate_keys=False),
        "finch_chunked": lambda: K.FinchPress(compression_ratio=ratio, rerotate_keys=False, chunk_length=512),
        "tova": lambda: K.TOVAPress(compression_ratio=ratio),
        "expected_attention": lambda: K.ExpectedAttentionPress(compression_ratio=ratio),
    }[name]()
    if name.startswith("finch"):  # the question is the window: its size set directly, the delimiter never found
        press.delimiter_token_id, press.window_size = -1, question
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.tensor([json.loads(Path(ids_file).read_text())[:tokens]])
    with torch.no_grad():
        full = DynamicCache()
        model.model(ids, past_key_values=full)
        cache = DynamicCache()
        with press(model):
            model.model(ids, past_key_values=cache)
    kept = []
    for layer in range(len(cache.layers)):
        # keys, not values: a value depends on the token alone in the first layer (a repeated token's rows are
        # equal), a key carries its position (RoPE); none of these presses re-rotates (finch: rerotate_keys=False)
        v_all, v = full.layers[layer].keys[0].double(), cache.layers[layer].keys[0].double()
        w = torch.randn(v_all.shape[-1], dtype=torch.double, generator=torch.Generator().manual_seed(0))
        heads = []
        for h in range(v_all.shape[0]):
            if name == "adakv":  # masked, not dropped
                b, hh, s = model.model.layers[layer].self_attn.masked_key_indices
                dropped = set(s[hh == h].tolist())
                heads.append(sorted(set(range(v_all.shape[1])) - dropped))
                continue
            a, k = v_all[h] @ w, v[h] @ w  # one number per row: equal rows give equal numbers
            order = a.argsort()
            pos = order[torch.searchsorted(a[order], k).clamp(max=len(a) - 1)]
            assert torch.equal(v_all[h][pos], v[h]), f"{name} layer {layer} head {h}: a kept row matched no row"
            heads.append(sorted(pos.tolist()))
        kept.append(heads)
    return {"kept": kept}


def ours(name: str, model: str | None, ids: list[int], budget: float, question: int, threads: int) -> list:
    import torch
    from hydra.utils import instantiate

    from luka_bench import config
    from luka_bench.methods.hf import attach

    torch.set_num_threads(threads)
    over = OURS[name] + [f"method.budget={budget}"] + ([f"model={model}"] if model else [])
    method, model_cfg = config.compose_method(over)
    lm = instantiate(model_cfg).load()
    with attach(lm.model, method, lm.tokenizer) as a, torch.no_grad():
        cache = a.new_cache(reference_length=len(ids), question_span=question if name.startswith("finch") else 0)
        lm.model(torch.tensor([ids]), past_key_values=cache)
    out = []
    for s in cache.stores:
        held = s.head_mask()
        heads = []
        for h in range(s.positions.shape[1]):
            p = s.positions[0, h]
            heads.append(sorted((p if held is None else p[held[0, h]]).tolist()))
        out.append(heads)
    return out


def compare(a: list, b: list) -> dict:
    heads = same = 0
    diffs, where = [], []
    for layer, (la, lb) in enumerate(zip(a, b)):
        for h, (ha, hb) in enumerate(zip(la, lb)):
            heads += 1
            if ha == hb:
                same += 1
            else:
                diffs.append(len(set(ha) ^ set(hb)) // 2)
                where.append(f"{layer}.{h}")
    return {"heads": heads, "identical": same, "differing_heads": len(diffs), "differing": where,
            "max_positions_differing": max(diffs, default=0), "mean_positions_differing": (sum(diffs) / len(diffs)
                                                                                           if diffs else 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvpress", help="python of a venv with kvpress installed")
    ap.add_argument("--methods", nargs="+", default=list(PAIRS), choices=PAIRS)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--question", type=int, default=32, help="finch: the last tokens taken as the question")
    ap.add_argument("--model", default=None, help="a conf/model name (default: the offline SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=str(ROOT / "results" / "kvpress_compare_work"))
    ap.add_argument("--out", default=None, help="folder for compare.json / compare.md")
    ap.add_argument("--kvpress-child", nargs=6, metavar=("NAME", "MODEL_DIR", "IDS", "TOKENS", "BUDGET", "QUESTION"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.kvpress_child:
        n, model_dir, ids_file, tokens, budget, question = args.kvpress_child
        print(json.dumps(kvpress_child(n, model_dir, ids_file, int(tokens), float(budget), int(question))))
        return
    if not args.kvpress:
        raise SystemExit("--kvpress PYTHON is needed (the interpreter of a venv where kvpress is installed)")
    if abs(args.budget * args.tokens - round(args.budget * args.tokens)) > 1e-9:
        raise SystemExit(f"--budget {args.budget} x --tokens {args.tokens} is not a whole number of tokens; allowed: "
                         "a product that is (kvpress floors it, we ceil it)")
    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT))
    from bench_memory import export_for_kvpress

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    args.device = args.dtype = None
    model_dir, ids_file = export_for_kvpress(args, work)
    ids = json.loads(Path(ids_file).read_text())[: args.tokens]
    rows = {}
    for name in args.methods:
        cmd = [args.kvpress, __file__, "--kvpress-child", name, model_dir, ids_file, str(args.tokens),
               str(args.budget), str(args.question)]
        got = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if got.returncode != 0:
            raise SystemExit(f"kvpress {name} failed:\n{got.stderr[-2000:]}")
        theirs = json.loads(got.stdout.strip().splitlines()[-1])["kept"]
        mine = ours(name, args.model, ids, args.budget, args.question, args.threads)
        rows[name] = compare(mine, theirs)
        r = rows[name]
        print(f"{name:10s} identical heads {r['identical']}/{r['heads']}; differing heads {r['differing_heads']} "
              f"(positions differing per head: max {r['max_positions_differing']}, mean "
              f"{r['mean_positions_differing']:.1f}); layer.head: {' '.join(r['differing']) or '-'}", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"tokens": args.tokens, "budget": args.budget, "question": args.question, "model": args.model or
                "smollm2_135m", "rows": rows}
        (out / "compare.json").write_text(json.dumps(meta, indent=1) + "\n")
        lines = ["| ours ↔ kvpress | identical heads | differing heads | positions differing (max / mean) |",
                 "|---|--:|--:|--:|"]
        lines += [f"| {k} | {r['identical']}/{r['heads']} | {r['differing_heads']} | {r['max_positions_differing']} / "
                  f"{r['mean_positions_differing']:.1f} |" for k, r in rows.items()]
        (out / "compare.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
