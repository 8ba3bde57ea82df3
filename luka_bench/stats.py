"""Statistics: every standard error, delta-method perplexity interval and paired difference luka_bench reports
is computed here and nowhere else (the runner's metrics.json, the report's tables, the studies in scripts/).

- ``mean_se``: a mean with its cluster-robust standard error (questions sharing a context are one cluster);
- ``perplexity_se``: corpus perplexity with its SE by the delta method (documents, or 256-token blocks of one);
- ``paired_difference``: a method minus a reference on the items both answered, clustered by example;
- ``binomial_se``: the SE of a share of successes (the needle study's accuracy).
"""
from __future__ import annotations

import math

# ---------------------------------------------------------------------------------------------------------------

def cluster_of(record: dict) -> str:
    """The cluster an item belongs to: its example (questions that share a context are not independent draws:
    WikiSalad asks several questions of one context), else the item itself."""
    return str(record.get("example_id", record.get("item_id")))


def mean_se(values: list[float], clusters: list[str] | None = None) -> dict:
    """Mean of per-item ``values`` with its standard error clustered by ``clusters`` (the cluster-robust
    "sandwich" estimate with the G/(G-1) small-sample factor: SE^2 = G/(G-1) * sum_g (sum_{i in g} (x_i -
    mean))^2 / n^2). With one item per cluster it is the usual s/sqrt(n). ``se`` is None (undefined) with fewer
    than two clusters: None, not NaN, so that metrics.json stays valid JSON and equal to itself when re-read.
    Returns {mean, se, n (items), clusters}."""
    n = len(values)
    if n == 0:
        return {"mean": None, "se": None, "n": 0, "clusters": 0}
    clusters = clusters if clusters is not None else [str(i) for i in range(n)]
    m = sum(values) / n
    sums: dict[str, float] = {}
    for v, c in zip(values, clusters):
        sums[c] = sums.get(c, 0.0) + (v - m)
    g = len(sums)
    if g < 2:
        return {"mean": m, "se": None, "n": n, "clusters": g}
    se = math.sqrt(g / (g - 1) * sum(s * s for s in sums.values())) / n
    if se < 1e-12 * max(1.0, abs(m)):  # clusters with equal means: 0, not rounding noise (4e-17)
        se = 0.0
    return {"mean": m, "se": se, "n": n, "clusters": g}


NLL_BLOCK = 256  # tokens per block of a document's NLL (pg19 records' ``nll_blocks``)


def nll_blocks(nll: list[float], size: int = NLL_BLOCK) -> list[list[float]]:
    """A document's per-token NLL cut into consecutive blocks of ``size`` tokens (the last may be shorter):
    ``[[nll sum, tokens], ...]``, the units of a one-document perplexity's standard error."""
    return [[float(sum(nll[i:i + size])), len(nll[i:i + size])] for i in range(0, len(nll), size)]


def _ratio_se(nll: list[float], tok: list[int]) -> float | None:
    """SE of exp(sum nll / sum tok) by the delta method, the (nll, tok) pairs as clusters (the ratio
    estimator's linearisation with the G/(G-1) factor); None with fewer than two."""
    g, total = len(nll), sum(tok)
    if g < 2 or total <= 0:
        return None
    rate = sum(nll) / total
    var = g / (g - 1) * sum((a - rate * b) ** 2 for a, b in zip(nll, tok)) / total ** 2
    return math.exp(rate) * math.sqrt(var)


def perplexity_se(records: list[dict]) -> dict:
    """Corpus perplexity exp(sum NLL / sum tokens) with a standard error by the delta method: documents as the
    clusters when there are two or more; with one document, its consecutive blocks of ``NLL_BLOCK`` tokens
    (``nll_blocks`` in the record; neighbouring tokens are correlated, blocks much less, so this SE is a lower
    bound on the document-to-document spread it cannot see). ``unit`` says which: ``documents``,
    ``256-token blocks``, or None (one document without blocks: SE undefined)."""
    nll = [float(r["nll_sum"]) for r in records]
    tok = [int(r["n_tokens"]) for r in records]
    g, total = len(records), sum(tok)
    if not g or total <= 0:
        return {"mean": None, "se": None, "n": 0, "clusters": 0, "unit": None}
    ppl = math.exp(sum(nll) / total)
    if g > 1:
        return {"mean": ppl, "se": _ratio_se(nll, tok), "n": g, "clusters": g, "unit": "documents"}
    blocks = records[0].get("nll_blocks") or []
    if len(blocks) > 1:
        return {"mean": ppl, "se": _ratio_se([float(b[0]) for b in blocks], [int(b[1]) for b in blocks]),
                "n": 1, "clusters": len(blocks), "unit": f"{NLL_BLOCK}-token blocks"}
    return {"mean": ppl, "se": None, "n": 1, "clusters": 1, "unit": None}


# Per-item fields that get a standard error besides the item scores (QA) and perplexity (teacher forcing).
_TIMED = ("ttft_s", "tpot_s")


def item_uncertainty(records: list[dict]) -> dict[str, dict]:
    """{metric: {mean, se, n, clusters}} of a run's prediction records: every per-item score (``em``,
    ``em_lenient``, ``f1``, ``accuracy`` ...) and ``ttft_s`` / ``tpot_s``, SE clustered by example; for perplexity
    runs ``perplexity`` by documents (``perplexity_se``)."""
    out: dict[str, dict] = {}
    if records and all("nll_sum" in r and "n_tokens" in r for r in records):
        out["perplexity"] = perplexity_se(records)
    keys = sorted({k for r in records for k, v in (r.get("scores") or {}).items() if isinstance(v, (int, float))})
    for k in [*keys, *_TIMED]:
        rows = [r for r in records if isinstance((r.get("scores") or {}).get(k, r.get(k)), (int, float))]
        if rows:  # timings: the items that have one (an answer of one token has no time per output token)
            vals = [float((r.get("scores") or {}).get(k, r.get(k))) for r in rows]
            out[k] = mean_se(vals, [cluster_of(r) for r in rows])
    return out


def paired_difference(records: list[dict], reference: list[dict], metric: str) -> dict:
    """Mean of ``metric`` minus the reference's on the items both hold (same ``item_id``), with its SE clustered
    by example: a paired comparison, so the items' own difficulty cancels. {mean, se, n, clusters}; for
    perplexity runs the difference of NLL per token (log perplexity): per 256-token block where both runs
    recorded ``nll_blocks`` (clustered by document; one document: by block), else per document."""
    def value(r: dict) -> float | None:
        if metric == "perplexity" and "nll_sum" in r:
            return float(r["nll_sum"]) / max(1, int(r["n_tokens"]))
        v = (r.get("scores") or {}).get(metric, r.get(metric))
        return float(v) if isinstance(v, (int, float)) else None

    if metric == "perplexity" and records and all(r.get("nll_blocks") for r in [*records, *reference]):
        # per 256-token block, paired on the same text: documents as clusters, or with one common document
        # its blocks (as perplexity_se does)
        refb = {r["item_id"]: r["nll_blocks"] for r in reference}
        common = [r for r in records if r["item_id"] in refb and len(refb[r["item_id"]]) == len(r["nll_blocks"])]
        pairs = [(b[0] / b[1] - a[0] / a[1], r["item_id"] if len(common) > 1 else f"{r['item_id']}#{k}")
                 for r in common for k, (a, b) in enumerate(zip(refb[r["item_id"]], r["nll_blocks"]))
                 if a[1] == b[1] and a[1] > 0]
        return mean_se([d for d, _ in pairs], [c for _, c in pairs])
    ref = {r["item_id"]: value(r) for r in reference}
    pairs = [(value(r) - ref[r["item_id"]], cluster_of(r)) for r in records
             if r.get("item_id") in ref and ref[r["item_id"]] is not None and value(r) is not None]
    return mean_se([d for d, _ in pairs], [c for _, c in pairs])


def binomial_se(successes: int, n: int) -> float | None:
    """SE of a share of ``successes`` in ``n`` independent trials, sqrt(p(1-p)/(n-1)) (what ``mean_se`` gives
    for 0/1 values); None with fewer than two trials."""
    if n < 2:
        return None
    p = successes / n
    return math.sqrt(p * (1 - p) / (n - 1))
