"""Attention-output error vs keep ratio on held-out queries of captured SmolLM2 Q/K/V (entropy_ols, issue 12).

Capture: one full-attention forward of ``prefix + heldout`` tokens of real text (Paul Graham essays) through the
public method interface (a recording policy), per layer: post-RoPE queries, keys, values. Then, per layer and
keep ratio rho, the cache is the first ``prefix`` tokens compressed to ceil(rho * prefix) entries by:

- ``entropy_ols`` (mode ols / linear) and ``entropy_drop`` (mode drop): the real ``EntropyOLSPolicy`` on a real
  ``KVStore``: it sees the prefix as a prefill (its queries give the entropy, mass and reference-query buffer,
  i.e. the last ``n_ref`` prefix queries), then ``after_prefill`` compacts;
- ``top_k``: the ceil(rho * prefix) tokens with the highest attention mass accumulated over the prefix queries
  (per KV head, summed over its query heads);
- ``window``: the last ceil(rho * prefix) tokens.

Error: the queries of the ``heldout`` tokens that follow the prefix (never seen by any fit) attend over the
compressed prefix; relative error ||o_hat - o|| / ||o|| per (query head, query), o = exact attention over the
uncompressed prefix; mean over heads and queries. ``err_ref`` is the same on the reference (fitted) queries.

    PYTHONPATH=. python scripts/ols_error.py --out results/summaries/entropy_ols
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from luka_bench.methods.base import KVMethod, LayerInfo, LayerPolicy
from luka_bench.methods.attention import attention_with_extra, attention_with_mass, exact_attention, top_indices
from luka_bench.methods.entropy_ols import EntropyOLS
from luka_bench.methods.hf import MethodCache, attach


# -- capture (small and general: a probe can absorb it) ------------------------------------------------------
class RecordPolicy(LayerPolicy):
    """Exact attention that keeps the last query chunk and the store it attended over."""

    def attend(self, store, query, scaling):
        self.query, self.keys, self.values, self.scaling = query.clone(), store.keys.clone(), store.values.clone(), scaling
        return exact_attention(store, query, scaling)


@dataclass
class Record(KVMethod):
    name: ClassVar[str] = "record"
    policy_class: ClassVar[type[LayerPolicy]] = RecordPolicy


@torch.no_grad()
def capture(model, ids: torch.Tensor) -> list[dict]:
    """Per layer {q [1, Hq, L, D], k, v [1, Hkv, L, D], scaling} of one full-attention forward of ``ids``."""
    with attach(model, Record()) as a:
        cache = a.new_cache()
        model(ids.view(1, -1), past_key_values=cache)
    return [{"q": s.policy.query, "k": s.policy.keys, "v": s.policy.values, "scaling": s.policy.scaling,
             "info": s.policy.info} for s in cache.stores]


# -- compression of one layer's prefix, and the read-out ----------------------------------------------------
def exact_over(q, k, v, scaling):
    """Every query over every key (no mask): q [1, Hq, Lq, D], k/v [1, Hkv, Lk, D]."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True)


def subset(k, v, index):
    ik = index.unsqueeze(-1)
    return k.gather(2, ik.expand(*index.shape, k.shape[-1])), v.gather(2, ik.expand(*index.shape, v.shape[-1]))


def compress_policy(info: LayerInfo, q, k, v, scaling, rho: float, mode: str, **kw):
    """A real EntropyOLS policy and store after a prefill of (q, k, v) and its compaction."""
    method = EntropyOLS(budget=rho, mode=mode, **kw)
    cache = MethodCache(method, [info], reference_length=k.shape[2], manual=True)
    store = cache.stores[0]
    store.lazy_initialization(k, v)
    store.append(k, v)
    store.policy.attend(store, q, scaling)
    cache.end_prefill()
    return cache, store  # the caller keeps the cache: a store holds it weakly


def policy_readout(store, q, scaling):
    p = store.policy
    out, *_, ew = attention_with_extra(store, q, scaling, p.sk, p.sv, p.sb, causal=False)
    if p.la is not None and p.S:
        out = out + p._linear_term(q, ew)
    return out


def rel_err(o_hat, o):
    return float(((o_hat - o).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-12)).mean())


def evaluate_layer(rec: dict, prefix: int, heldout: int, rhos, n_ref: int, **kw) -> list[dict]:
    q, k, v, s, info = rec["q"], rec["k"], rec["v"], rec["scaling"], rec["info"]
    qp, kp, vp = q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix]
    qh = q[:, :, prefix: prefix + heldout]  # held-out: the queries after the prefix
    qr = qp[:, :, -n_ref:]  # the reference queries the fit uses
    o_h, o_r = exact_over(qh, kp, vp, s), exact_over(qr, kp, vp, s)

    class _S:  # attention_with_mass over the prefix (causal): H2O-style accumulated mass for top-K
        keys, values = kp, vp
    _, mass = attention_with_mass(_S, qp, s)
    rows = []
    full_bytes = (kp.nbytes + vp.nbytes)
    for rho in rhos:
        cap = math.ceil(rho * prefix - 1e-9)
        b, h = kp.shape[:2]
        for name in ("entropy_ols", "entropy_ols_linear", "entropy_drop", "top_k", "window"):
            t0 = time.perf_counter()
            if name.startswith("entropy"):
                mode = {"entropy_ols": "ols", "entropy_ols_linear": "linear", "entropy_drop": "drop"}[name]
                cache, store = compress_policy(info, qp, kp, vp, s, rho, mode, n_ref=n_ref, **kw)
                eh, er = policy_readout(store, qh, s), policy_readout(store, qr, s)
                fair = store.n + store.policy.extra_entries()
                real = store.held_bytes() + store.policy.extra_bytes()
                st = store.policy.stats
            else:
                if name == "top_k":
                    index = top_indices(mass, cap)
                else:
                    index = torch.arange(prefix - cap, prefix).expand(b, h, cap)
                ks, vs = subset(kp, vp, index)
                eh, er = exact_over(qh, ks, vs, s), exact_over(qr, ks, vs, s)
                fair, real, st = cap, ks.nbytes + vs.nbytes, {}
            rows.append({"layer": info.layer_idx, "method": name, "keep_ratio": rho, "err_heldout": rel_err(eh, o_h),
                         "err_ref": rel_err(er, o_r), "fair_entries": fair, "fair_ratio": fair / prefix,
                         "real_bytes": real, "real_ratio": real / full_bytes,
                         "dropped_tokens": st.get("dropped_tokens", 0.0), "seconds": time.perf_counter() - t0})
    return rows


METHODS = ("entropy_ols", "entropy_ols_linear", "entropy_drop", "top_k", "window")


def summarise(rows: list[dict], out: Path, meta: str, prefix_tokens: int) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rhos = sorted({r["keep_ratio"] for r in rows})
    layers = sorted({r["layer"] for r in rows})
    mean = {(m, rho): sum(r["err_heldout"] for r in rows if r["method"] == m and r["keep_ratio"] == rho) / len(layers)
            for m in METHODS for rho in rhos}
    ref = {(m, rho): sum(r["err_ref"] for r in rows if r["method"] == m and r["keep_ratio"] == rho) / len(layers)
           for m in METHODS for rho in rhos}
    realr = {(m, rho): sum(r["real_ratio"] for r in rows if r["method"] == m and r["keep_ratio"] == rho) / len(layers)
             for m in METHODS for rho in rhos}
    fairr = {(m, rho): sum(r["fair_ratio"] for r in rows if r["method"] == m and r["keep_ratio"] == rho) / len(layers)
             for m in METHODS for rho in rhos}
    lines = ["# Attention-output relative error vs keep ratio (held-out queries)\n", meta, "",
             "Mean over layers of the relative error on held-out queries (in brackets: on the fitted reference "
             "queries); FAIR = held entries / prefix tokens, REAL = bytes held (keys, values, synthetic entries, "
             "biases, reference-query buffer) / the prefix's full KV bytes.", "",
             "| method | " + " | ".join(f"keep {r:g}" for r in rhos) + " |",
             "|---|" + "---|" * len(rhos)]
    for m in METHODS:
        lines.append(f"| {m} | " + " | ".join(f"{mean[m, r]:.4f} ({ref[m, r]:.4f})" for r in rhos) + " |")
    lines += ["", "| method | " + " | ".join(f"FAIR / REAL at {r:g}" for r in rhos) + " |", "|---|" + "---|" * len(rhos)]
    for m in METHODS:
        lines.append(f"| {m} | " + " | ".join(f"{fairr[m, r]:.3f} / {realr[m, r]:.3f}" for r in rhos) + " |")
    dropped = {(m, rho): sum(r["dropped_tokens"] for r in rows if r["method"] == m and r["keep_ratio"] == rho)
               / len(layers) / prefix_tokens for m in METHODS[:3] for rho in rhos}
    lines += ["", "Share of the prefix the entropy methods evicted without a summary (no full bin could be formed, "
              "or synthetic entries over their share; `drop` evicts every bin by design):", "",
              "| method | " + " | ".join(f"keep {r:g}" for r in rhos) + " |", "|---|" + "---|" * len(rhos)]
    for m in METHODS[:3]:
        lines.append(f"| {m} | " + " | ".join(f"{dropped[m, r]:.3f}" for r in rhos) + " |")
    lines += ["", "Ratio of top-K's error to each method's (held-out, mean over layers; > 1 = lower error than top-K):", "",
              "| method | " + " | ".join(f"keep {r:g}" for r in rhos) + " |", "|---|" + "---|" * len(rhos)]
    for m in METHODS:
        lines.append(f"| {m} | " + " | ".join(f"{mean['top_k', r] / mean[m, r]:.2f}" for r in rhos) + " |")
    wins = {m: sum(1 for r in rows if r["method"] == m and all(
        r["err_heldout"] <= o["err_heldout"] for o in rows if o["layer"] == r["layer"] and o["keep_ratio"] == r["keep_ratio"]))
        for m in METHODS}
    lines += ["", "Lowest held-out error among the five, counted over (layer, keep ratio) cells: "
              + ", ".join(f"{m} {wins[m]}" for m in METHODS) + f" (of {len(layers) * len(rhos)}).", ""]
    lines += ["Per layer, held-out relative error:", "",
              "| layer | " + " | ".join(f"{m} @{r:g}" for r in rhos for m in ("entropy_ols", "top_k")) + " |",
              "|---|" + "---|" * (2 * len(rhos))]
    for L in layers:
        cell = {(r["method"], r["keep_ratio"]): r["err_heldout"] for r in rows if r["layer"] == L}
        lines.append(f"| {L} | " + " | ".join(f"{cell[m, rho]:.4f}" for rho in rhos for m in ("entropy_ols", "top_k")) + " |")
    text = "\n".join(lines) + "\n"
    (out / "ols_error.md").write_text(text)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in METHODS:
        axes[0].plot(rhos, [mean[m, r] for r in rhos], marker="o", label=m)
    axes[0].set_xlabel("keep ratio (FAIR: held entries / tokens)")
    axes[0].set_ylabel("relative error, held-out queries (mean over layers)")
    axes[0].set_yscale("log")
    axes[0].legend()
    mid = rhos[len(rhos) // 2]
    for m in METHODS:
        axes[1].plot(layers, [next(r["err_heldout"] for r in rows if r["method"] == m and r["layer"] == L
                                   and r["keep_ratio"] == mid) for L in layers], marker=".", label=m)
    axes[1].set_xlabel("layer")
    axes[1].set_ylabel(f"relative error at keep ratio {mid:g}")
    axes[1].set_yscale("log")
    fig.suptitle("SmolLM2-135M attention-output error on held-out queries")
    fig.tight_layout()
    fig.savefig(out / "ols_error.png", dpi=110)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=1024, help="tokens in the compressed cache")
    ap.add_argument("--heldout", type=int, default=64, help="held-out queries after the prefix")
    ap.add_argument("--ratios", default="0.1,0.2,0.3,0.4,0.5")
    ap.add_argument("--n-ref", type=int, default=16)
    ap.add_argument("--bin-size", type=int, default=32)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--offset", type=int, default=0, help="first token of the text window")
    ap.add_argument("--out", default="results/summaries/entropy_ols")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from luka_bench.data.pg19 import essays_text

    lm = instantiate(OmegaConf.load(Path(__file__).resolve().parent.parent / "conf/model/smollm2_135m.yaml")).load()
    ids = lm.tokenizer(essays_text(), add_special_tokens=False)["input_ids"][a.offset: a.offset + a.prefix + a.heldout]
    ids = torch.tensor(ids, device=lm.model.device)
    recs = capture(lm.model, ids)
    rhos = [float(x) for x in a.ratios.split(",")]
    rows = []
    for rec in recs:
        rows += evaluate_layer(rec, a.prefix, a.heldout, rhos, a.n_ref, bin_size=a.bin_size, rank=a.rank)
        print(f"layer {rec['info'].layer_idx} done", file=sys.stderr)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "ols_error.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta = (f"SmolLM2-135M-Instruct ({lm.model.dtype}), Paul Graham essays tokens {a.offset}..{a.offset + a.prefix + a.heldout}: "
            f"prefix {a.prefix} compressed, {a.heldout} held-out queries after it; entropy_ols bin_size {a.bin_size}, "
            f"rank {a.rank}, n_ref {a.n_ref} (method defaults otherwise); {len(recs)} layers, 9 query / 3 KV heads.\n\n"
            f"Command: `PYTHONPATH=. python scripts/ols_error.py {' '.join(argv if argv is not None else sys.argv[1:])}`")
    print(summarise(rows, out, meta, a.prefix))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
