"""Metrics.

QA scoring (SQuAD official normalisation, exact match, lenient match, token F1) as pure functions.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

# ---------------------------------------------------------------------------------------------------------------
# QA scoring (SQuAD v1.1/v2.0 official evaluation script behaviour)
# ---------------------------------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower-case, remove punctuation, remove articles (a/an/the), collapse white space."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golds(golds: str | Iterable[str]) -> list[str]:
    """Gold answers as a list, by the official SQuAD v2 rule: golds that normalise to the empty string are
    dropped, and when none is left (unanswerable) the gold is the empty string."""
    if isinstance(golds, str):
        golds = [golds]
    out = [g for g in golds if normalize_answer(g)]
    return out if out else [""]


def exact_match(pred: str, golds: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals some normalised gold answer, else 0.0."""
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(g) for g in _golds(golds)))


def _lenient_one(p: str, g: str) -> bool:
    if p == g:
        return True
    if not p or not g:  # an empty side never "contains" / "is contained in" a non-empty one
        return False
    return g in p or p in g


def lenient_match(pred: str, golds: str | Iterable[str]) -> float:
    """WikiSalad's lenient EM: normalised equality, or either normalised string contains the other.

    Containment is on normalised strings (substring, as in the reference code). An empty normalised prediction
    never matches a non-empty gold, and an empty gold (unanswerable) only matches an empty prediction.
    """
    p = normalize_answer(pred)
    return float(any(_lenient_one(p, normalize_answer(g)) for g in _golds(golds)))


def _f1_one(pred_toks: list[str], gold_toks: list[str]) -> float:
    if not pred_toks or not gold_toks:
        return float(pred_toks == gold_toks)
    common = Counter(pred_toks) & Counter(gold_toks)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_toks)
    recall = same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def f1_score(pred: str, golds: str | Iterable[str]) -> float:
    """SQuAD token-overlap F1 after normalisation, max over gold answers."""
    pt = normalize_answer(pred).split()
    return max(_f1_one(pt, normalize_answer(g).split()) for g in _golds(golds))


def qa_scores(pred: str, golds: str | Iterable[str]) -> dict[str, float]:
    """All QA metrics of one prediction: ``{"em", "em_lenient", "f1"}``."""
    return {"em": exact_match(pred, golds), "em_lenient": lenient_match(pred, golds), "f1": f1_score(pred, golds)}


# ---------------------------------------------------------------------------------------------------------------
# Perplexity, latency and memory aggregation (pure functions of the per-item records)
# ---------------------------------------------------------------------------------------------------------------

def perplexity(nll_sums: Iterable[float], token_counts: Iterable[int]) -> float:
    """Corpus perplexity: exp of the token-weighted mean NLL, exp(sum(nll) / sum(tokens)) — never the mean of
    per-document perplexities."""
    import math

    total = sum(float(x) for x in nll_sums)
    n = sum(int(c) for c in token_counts)
    if n <= 0:
        raise ValueError("perplexity needs at least one predicted token")
    return math.exp(total / n)


def mean(values: Iterable[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def median(values: Iterable[float | None]) -> float | None:
    vals = sorted(float(v) for v in values if v is not None)
    if not vals:
        return None
    m = len(vals) // 2
    return vals[m] if len(vals) % 2 else (vals[m - 1] + vals[m]) / 2


def kv_summary(records: list[dict]) -> dict:
    """Memory metrics from per-item records holding ``kv_bytes_prefill``, ``kv_bytes_peak`` and
    ``kv_bytes_full`` (what full attention would hold at the item's peak length). ``kv_ratio`` is the ratio of
    the summed peaks: the share of full attention's KV memory the method actually held. ``kv_ratio_context``
    (when records hold ``kv_bytes_full_prefill``) is the same share right after the context prefill."""
    peak = [r["kv_bytes_peak"] for r in records]
    full = [r["kv_bytes_full"] for r in records]
    out = {
        "kv_bytes": {"after_prefill": mean(r.get("kv_bytes_prefill") for r in records), "peak": max(peak)},
        "kv_bytes_full": {"peak": max(full)},
    }
    out["kv_ratio"] = sum(peak) / sum(full) if sum(full) else None
    # The same ratio right after the context prefill and the method's compression (QA only): what every
    # evicting method's budget bounds, SnapKV's included (it compresses the context once and then keeps the
    # question and the answer, so its decode-peak kv_ratio is above its budget by design; methods/snapkv.md).
    pre = [(r.get("kv_bytes_prefill"), r.get("kv_bytes_full_prefill")) for r in records]
    if pre and all(h is not None and f for h, f in pre):
        out["kv_ratio_context"] = sum(h for h, _ in pre) / sum(f for _, f in pre)
    return out


def attended_summary(records: list[dict]) -> dict:
    """What attention read per decode step, from per-item ``attended_tokens`` (held tokens read per layer, mean over
    KV heads and layers), ``attended_bytes`` (their keys and values, all layers) and ``attended_ratio`` (attended /
    held): the mean over items that recorded them. Exact methods read everything they hold (ratio 1); methods
    that attend to a subset (LycheeCluster, LuKA clustered) read less than they hold."""
    return {k: mean(r.get(k) for r in records) for k in ("attended_tokens", "attended_bytes", "attended_ratio")}


def latency_summary(records: list[dict]) -> dict:
    """``ttft_s``: mean time to first token (context prefill + question); ``tpot_s``: mean over items of their
    mean seconds per generated (or teacher-forced) token."""
    return {"ttft_s": mean(r.get("ttft_s") for r in records), "tpot_s": mean(r.get("tpot_s") for r in records)}


def breakdown_summary(records: list[dict]) -> dict | None:
    """Mean seconds per decode step by component over the items that recorded a breakdown."""
    rows = [r["latency_breakdown"] for r in records if r.get("latency_breakdown")]
    if not rows:
        return None
    keys = sorted({k for r in rows for k in r})
    return {k: mean(r.get(k, 0.0) for r in rows) for k in keys}


def method_stats_summary(records: list[dict]) -> dict | None:
    """Mean over items of each ``method_stats`` number (FAIR entries, REAL bytes, method-specific counts) over the
    items that recorded them; None when none did (runs made before the field existed)."""
    rows = [r["method_stats"] for r in records if r.get("method_stats")]
    if not rows:
        return None
    keys = sorted({k for r in rows for k in r})
    return {k: mean(r.get(k) for r in rows) for k in keys}


def qa_summary(records: list[dict]) -> dict:
    """Mean of each per-question score."""
    keys = ("em", "em_lenient", "f1")
    return {k: mean(r["scores"][k] for r in records) for k in keys if all(k in r["scores"] for r in records)}


def ppl_summary(records: list[dict]) -> dict:
    return {"perplexity": perplexity([r["nll_sum"] for r in records], [r["n_tokens"] for r in records]),
            "n_tokens": sum(r["n_tokens"] for r in records)}


# ---------------------------------------------------------------------------------------------------------------
# Uncertainty: standard errors clustered by example, paired differences (the report's ± SE and n)
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
    import math

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
    import math

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
    import math

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
