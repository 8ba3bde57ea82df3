"""Why a method misses the needle (issue 28): open-loop replays of full attention's queries on the NIAH prompts of
``scripts/needle_study.py``, with the methods' own state inspected at every generated-token step and layer.

    python scripts/needle_why.py --prompts 3 --threads 1 > results/needle_study/why.md

Per prompt the model runs once under full attention (``probe.capture``: the context, the question chunk, 12 greedy
steps; cached in ``~/.cache/luka_bench/probe``); then, without the model (``probe.replay``):
- ``luka_clustered`` (k=3): per step, layer and KV head, the rank of the best needle page among the pages by the
  refinement score (the summary's share of the cover softmax, what the method ranks by) and by the page's *true*
  mass (exact weights of its raw tokens), and the logit of the needle page's summary key against the largest and
  the log-mean-exp of its raw tokens' logits (a page summary's key is a weighted mean of its keys, so its logit is
  a weighted mean of the raw logits: a page whose mass sits on one or two tokens is scored like an average page);
- ``lychee`` (1024): whether a needle chunk was retrieved, whether its coarse unit was kept, the rank of its fine
  cluster among the fine clusters by UB and by q·mu, and the rank of the needle chunk among chunks by true mass;
- ``snapkv`` (question-aware, from the captured question queries, which are what the scratch forward computes on
  the un-compressed cache): which digit tokens of the number each layer keeps at 1/8 with the reference pooling
  (avg, kernel 5), with max pooling, without pooling, and with the context's last-64 window instead of the
  question; the digits' score rank;
- ``h2o`` (1/8): the needle tokens' share held after the prefill and the rank of their accumulated mass.
Means over layers (and heads, steps, prompts) are printed as markdown.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch



def rank_of(scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Best (smallest, 0 = top) rank among ``idx`` of ``scores`` [..., N] (descending)."""
    order = scores.argsort(-1, descending=True).argsort(-1)  # rank of every entry
    return order[..., idx].min(-1).values


class Why:
    """An Observer whose measurement also inspects the policy (``probe.Observer.__call__`` plus ``extra``)."""

    def __init__(self, kind: str, needle: list[int]):
        from luka_bench.probe import Observer

        base = self

        class Obs(Observer):
            def __call__(self, store, query, out, scaling):
                super().__call__(store, query, out, scaling)
                if store.cache.phase == "decode" and query.shape[2] == 1:
                    base.extra(store, query, self.k[store.policy.info.layer_idx], scaling)

        self.obs = Obs(32, needle)
        self.kind = kind
        self.needle = torch.tensor(needle)
        self.rows: list[dict] = []

    def true_w(self, query, K, scaling):
        b, hq, _, d = query.shape
        hkv = K.shape[1]
        logits = (query.reshape(b, hkv, hq // hkv, d) @ K.transpose(-1, -2)).float() * scaling  # [B, Hkv, g, n]
        return logits, torch.softmax(logits, -1).sum(2)  # group-summed weights [B, Hkv, n]

    def extra(self, store, query, K, scaling):
        pol = store.policy
        layer = pol.info.layer_idx
        logits, w = self.true_w(query, K, scaling)
        if self.kind == "luka" and hasattr(pol, "P") and pol.P[1] > 0:
            m = pol.method
            S, s0, P, fr = m.page_size, m.sink, pol.P[1], pol.frontier
            pages = torch.unique((self.needle - s0) // S)
            pages = pages[(pages >= 0) & (pages < P)]
            if len(pages) == 0:
                return
            b, hkv, g, n = logits.shape
            cover = torch.cat([K[:, :, :s0], pol.sk[1][:, :, :P], K[:, :, fr:n]], 2)
            cl = (query.reshape(b, hkv, g, -1) @ cover.transpose(-1, -2)).float() * scaling
            score = torch.softmax(cl, -1)[..., s0: s0 + P].sum(2)  # what _select ranks [B, Hkv, P]
            true = w[..., s0: s0 + P * S].reshape(b, hkv, P, S).sum(-1)
            raw = logits[..., s0: s0 + P * S].reshape(b, hkv, g, P, S)[..., pages, :]  # [B, Hkv, g, np, S]
            summ = cl[..., s0 + pages]  # [B, Hkv, g, np]
            for h in range(hkv):
                self.rows.append({"layer": layer, "rank_score": int(rank_of(score[0, h], pages)),
                                  "rank_true": int(rank_of(true[0, h], pages)), "pages": P,
                                  "refined": int(rank_of(score[0, h], pages)) < m.refine.k,
                                  "page0_refined": bool((torch.topk(score[0, h], min(m.refine.k, P)).indices == 0).any()),
                                  "refined_true_mass": float(true[0, h].gather(
                                      0, torch.topk(score[0, h], min(m.refine.k, P)).indices).sum() / g),
                                  "best3_true_mass": float(torch.topk(true[0, h], min(3, P)).values.sum() / g),
                                  "true_top3": int(rank_of(true[0, h], pages)) < 3,
                                  "needle_page_true_mass": float(true[0, h, pages].sum() / g),
                                  "summary_logit": float(summ[0, h].max(-1).values.mean()),
                                  "raw_max_logit": float(raw[0, h].amax((-1, -2)).mean()),
                                  "raw_lme_logit": float((torch.logsumexp(raw[0, h], -1) - torch.log(
                                      torch.tensor(float(S)))).max(-1).values.mean())})
        elif self.kind == "lychee" and getattr(pol, "last", None) is not None:
            ch = store.cache.state["lychee_chunker"]
            last = pol.last
            M = pol.M
            starts = ch.starts[:M + 1]
            tok_chunk = torch.bucketize(self.needle, starts[1:], right=True)
            cids = torch.unique(tok_chunk[(self.needle >= starts[0]) & (self.needle < starts[M])])
            if len(cids) == 0:
                return
            b, hq, _, d = query.shape
            hkv = K.shape[1]
            qg = query.reshape(b, hkv, hq // hkv, d).float()
            qs, qn = qg.sum(2), qg.norm(dim=-1).sum(2)
            mu = torch.matmul(pol.mu_c, qs.unsqueeze(-1)).squeeze(-1)
            live = pol.cnt_c > 0
            ub = (mu + qn.unsqueeze(-1) * pol.r_c).masked_fill(~live, -1e30)
            qmu = mu.masked_fill(~live, -1e30)
            cm = torch.zeros(b, hkv, M).scatter_add_(2, torch.bucketize(torch.arange(int(starts[0]), int(starts[M])),
                                                                        starts[1:], right=True).expand(b, hkv, -1),
                                                     w[..., int(starts[0]): int(starts[M])])
            if "chunk_sel" in last:  # lychee before main's gather rewrite
                chunk_sel, kept = last["chunk_sel"], last["sel_c"]
            else:  # the chosen chunk ids and their validity; the clusters they came from
                chunk_sel = torch.zeros(b, hkv, M, dtype=torch.long).scatter_reduce(
                    2, last["cid"].clamp_max(M - 1), last["cvalid"].long(), "amax", include_self=True).bool()
                kept = pol.chosen_clusters()
            for h in range(hkv):
                a = pol.assign[0, h, cids]
                self.rows.append({"layer": layer, "retrieved": bool(chunk_sel[0, h, cids].any()),
                                  "unit_kept": bool(last["sel_g"][0, h, pol.parent[0, h, a]].any()),
                                  "cluster_rank_ub": int(rank_of(ub[0, h], a)),
                                  "cluster_rank_qmu": int(rank_of(qmu[0, h], a)),
                                  "clusters": int(live[0, h].sum()), "chunks": M,
                                  "chunk_rank_true": int(rank_of(cm[0, h], cids)),
                                  "clusters_kept": int(kept[0, h].sum())})


def snapkv_digits(cap, digits: list[int], needle: list[int], budget: float = 0.125) -> list[dict]:
    """SnapKV's selection at ``budget`` per layer from the captured queries, for several observation/pooling rules:
    the share of digit tokens (and needle tokens) kept, over layers and KV heads."""
    from luka_bench.methods.attention import top_indices
    from luka_bench.methods.snapkv import pool_scores, window_scores

    n = cap.context
    q0 = n + cap.lengths[0][0]  # the question chunk's queries: stored right after the context
    cap_tokens = -(-int(budget * n * 1000) // 1000)
    w = 64
    keep = cap_tokens - w
    rules = {"question, avg k=5 (reference)": ("q", "avg", 5), "question, max k=5": ("q", "max", 5),
             "question, no pooling": ("q", "avg", 1), "last-64 window, avg k=5": ("w", "avg", 5),
             "the 12 answer steps' own queries, avg k=5 (not causal: an oracle window)": ("a", "avg", 5)}
    out = []
    for name, (obs, pooling, kernel) in rules.items():
        shares, nshares, ranks = [], [], []
        for L in range(len(cap.infos)):
            K = cap.k[L][:, :, :n].float()
            if obs == "a":  # the generated-token steps' queries (they follow the question chunk)
                s = window_scores(cap.q[L][:, :, q0:].float(), K, cap.scaling, causal=False)[:, :, : n - w]
            elif obs == "q":
                s = window_scores(cap.q[L][:, :, n:q0].float(), K, cap.scaling, causal=False)[:, :, : n - w]
            else:
                s = window_scores(cap.q[L][:, :, n - w: n].float(), K, cap.scaling, causal=True)[:, :, : n - w]
            s = pool_scores(s, kernel, pooling)
            top = top_indices(s, keep)
            kept = torch.zeros_like(s, dtype=torch.bool).scatter_(2, top, True)
            shares.append(kept[..., digits].float().mean())
            nshares.append(kept[..., needle].float().mean())
            ranks.append((s.argsort(-1, descending=True).argsort(-1)[..., digits].float().median()))
        out.append({"rule": name, "digits_kept": float(torch.stack(shares).mean()),
                    "needle_kept": float(torch.stack(nshares).mean()),
                    "digit_median_rank": float(torch.stack(ranks).mean()), "keep": keep,
                    "by_layer": [round(float(x), 2) for x in shares]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=3700)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default=None, help="write every measured row here (JSON)")
    ap.add_argument("--report", default=None, help="print the report of rows written by --rows, without running")
    args = ap.parse_args()
    if args.report:
        import gzip
        import json

        f = Path(args.report)
        report(json.loads(gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_text()), args)
        return
    torch.set_num_threads(args.threads)
    from hydra.utils import instantiate

    import needle_study as N
    from luka_bench.config import compose
    from luka_bench import probe as P

    lm = instantiate(compose(["model=smollm2_135m"]).model).load()
    essays = N.haystack_text()
    acc: dict[str, list] = {"luka": [], "lychee": [], "snap": [], "h2o": []}
    for i in range(args.start, args.start + args.prompts):
        pr = N.build_prompt(lm.tokenizer, essays, i, args.tokens)
        prompt = P.Prompt(str(i), pr["ctx"], [pr["q"]], None, 12, pr["needle"])
        cap = P.capture(lm, prompt, "~/.cache/luka_bench/probe", {"name": "smollm2_135m"})
        cap = cap.to(torch.float32, "cpu")
        for kind, ov in (("luka", ["method=luka_clustered", "method.refine.k=3"]),
                         ("lychee", ["method=lychee", "method.token_budget=1024"])):
            method = instantiate(compose(ov).method)
            method.bind(lm.tokenizer)
            why = Why(kind, pr["needle"])
            _replay(P, method, cap, why)
            acc[kind] += why.rows
        acc["snap"] += [dict(r, prompt=i) for r in snapkv_digits(cap, pr["digits"], pr["needle"])]
        h2o = instantiate(compose(["method=h2o", "method.budget=0.125"]).method)
        acc["h2o"].append(_h2o(P, h2o, cap, pr))
        print(f"prompt {i} done", file=sys.stderr, flush=True)
    if args.rows:
        import json

        Path(args.rows).write_text(json.dumps(acc))
    report(acc, args)


def _replay(P, method, cap, why: Why):
    """``probe.replay`` with ``why``'s observer on the cache."""
    from luka_bench.methods.hf import MethodCache, replay_forward

    cache = MethodCache(method, cap.infos, reference_length=cap.context, observer=why.obs, manual=True)
    n = cap.context

    def one(c, sl):
        c.add_tokens(cap.ids[sl])
        for i in range(len(cap.infos)):
            replay_forward(c, i, cap.k[i][:, :, sl], cap.v[i][:, :, sl], cap.q[i][:, :, sl], cap.scaling)
        c.after_forward()

    with torch.no_grad():
        one(cache, slice(0, n))
        cache.end_prefill()
        off = n
        for L in cap.lengths[0]:
            one(cache, slice(off, off + L))
            off += L


def _h2o(P, method, cap, pr) -> dict:
    from luka_bench.methods.hf import MethodCache, replay_forward

    cache = MethodCache(method, cap.infos, reference_length=cap.context, manual=True)
    n = cap.context
    with torch.no_grad():
        cache.add_tokens(cap.ids[:n])
        masses = []
        for i in range(len(cap.infos)):
            replay_forward(cache, i, cap.k[i][:, :, :n], cap.v[i][:, :, :n], cap.q[i][:, :, :n], cap.scaling)
            st = cache.stores[i]
            masses.append(st.aux("h2o_mass").clone() if "h2o_mass" in st._aux else None)
        cache.after_forward()
        cache.end_prefill()
    held_needle = [float((s.positions[..., None] == torch.tensor(pr["needle"])).any(2).float().mean())
                   for s in cache.stores]
    held_digits = [float((s.positions[..., None] == torch.tensor(pr["digits"])).any(2).float().mean())
                   for s in cache.stores]
    ranks = []
    for m in masses:
        if m is not None:
            ranks.append(float(m.argsort(-1, descending=True).argsort(-1)[..., pr["needle"]].float().median()))
    return {"needle_held": statistics.mean(held_needle), "digits_held": statistics.mean(held_digits),
            "needle_mass_median_rank": statistics.mean(ranks) if ranks else float("nan"),
            "held": cache.stores[-1].n, "context": n}


def report(acc, args) -> None:
    import pandas as pd

    print(f"# needle_why: prompts {args.start}..{args.start + args.prompts - 1} of scripts/needle_study.py "
          f"(~{args.tokens} tokens), open loop (full attention's queries)\n")
    if acc["luka"]:
        d = pd.DataFrame(acc["luka"])
        print("## luka_clustered refine.k=3 (page 16, tail 128): the best needle page, per step, layer, KV head\n")
        print(f"- needle page among the 3 refined: {d.refined.mean():.3f}; in the true top-3 pages by mass: "
              f"{d.true_top3.mean():.3f} (n = {len(d)} step x layer x head rows, {d.pages.mean():.0f} pages)")
        print(f"- median rank by the summary score: {d.rank_score.median():.0f}; by true page mass: "
              f"{d.rank_true.median():.0f}")
        print(f"- needle page's true mass (mean over group heads): {d.needle_page_true_mass.mean():.3f}")
        print(f"- logits: summary key {d.summary_logit.mean():.2f}, raw max {d.raw_max_logit.mean():.2f}, raw "
              f"log-mean-exp {d.raw_lme_logit.mean():.2f}\n")
        t3 = d[d.true_top3]
        print(f"- page 0 (the first tokens: attention sinks, sink=0) among the 3 refined: {d.page0_refined.mean():.3f} "
              f"of all rows")
        print(f"- when the needle page is in the true top-3 (n = {len(t3)} rows): refined {t3.refined.mean():.3f}; "
              f"page 0 among the refined {t3.page0_refined.mean():.3f}")
        print(f"- true mass of the 3 refined pages {d.refined_true_mass.mean():.3f} vs the best 3 pages "
              f"{d.best3_true_mass.mean():.3f} (mean over group heads)\n")
        g = d.groupby("layer")[["refined", "true_top3", "needle_page_true_mass"]].mean()
        print(g.round(3).T.to_markdown() + "\n")
    if acc["lychee"]:
        d = pd.DataFrame(acc["lychee"])
        print("## lychee token_budget=1024: the needle chunk, per step, layer (>= 2), KV head\n")
        print(f"- needle chunk retrieved: {d.retrieved.mean():.3f}; its coarse unit kept: {d.unit_kept.mean():.3f}; "
              f"clusters kept {d.clusters_kept.mean():.0f} of {d.clusters.mean():.0f}")
        print(f"- median rank of its fine cluster by UB {d.cluster_rank_ub.median():.0f}, by q.mu "
              f"{d.cluster_rank_qmu.median():.0f}; of the needle chunk by true mass {d.chunk_rank_true.median():.0f} "
              f"(of {d.chunks.mean():.0f} chunks)")
        print(f"- needle chunk in the true top-10 chunks: {(d.chunk_rank_true < 10).mean():.3f}; its cluster in the "
              f"top-{d.clusters_kept.mean():.0f} by UB: {(d.cluster_rank_ub < d.clusters_kept).mean():.3f}, by q.mu: "
              f"{(d.cluster_rank_qmu < d.clusters_kept).mean():.3f}\n")
        t10 = d[d.chunk_rank_true < 10]
        print(f"- when the needle chunk is in the true top-10 chunks (n = {len(t10)} rows): retrieved "
              f"{t10.retrieved.mean():.3f}, unit kept {t10.unit_kept.mean():.3f}, its cluster in the kept count by UB "
              f"{(t10.cluster_rank_ub < t10.clusters_kept).mean():.3f}, by q.mu "
              f"{(t10.cluster_rank_qmu < t10.clusters_kept).mean():.3f}")
        u = t10[t10.unit_kept.astype(bool)]
        print(f"- of those, when its coarse unit was kept (n = {len(u)}): retrieved {u.retrieved.mean():.3f}, its "
              f"cluster in the kept count by UB {(u.cluster_rank_ub < u.clusters_kept).mean():.3f}, by q.mu "
              f"{(u.cluster_rank_qmu < u.clusters_kept).mean():.3f}\n")
        g = d.groupby("layer")[["retrieved", "unit_kept"]].mean()
        print(g.round(3).T.to_markdown() + "\n")
    if acc["snap"]:
        d = pd.DataFrame(acc["snap"])
        print("## snapkv 1/8 (question-aware unless said): digit tokens of the number kept, mean over layers, heads, "
              "prompts\n")
        print(d.groupby("rule", sort=False)[["digits_kept", "needle_kept", "digit_median_rank", "keep"]].mean()
              .round(3).to_markdown() + "\n")
        for r, x in d.groupby("rule", sort=False):
            by = [round(statistics.mean(v), 2) for v in zip(*x.by_layer)]
            print(f"- {r}: digits kept by layer {by}")
        print()
    if acc["h2o"]:
        d = pd.DataFrame(acc["h2o"])
        print("## h2o 1/8 after the prefill\n")
        print(d.mean().round(3).to_frame().T.to_markdown() + "\n")


if __name__ == "__main__":
    main()
