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


def kv_ratio(held_bytes: float, full_bytes: float) -> float | None:
    """The one definition of ``kv_ratio``, every client's (runner, library, lm-eval): bytes a method held / bytes
    full attention would hold at the same point (None when full attention holds nothing)."""
    return held_bytes / full_bytes if full_bytes else None


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
    out["kv_ratio"] = kv_ratio(sum(peak), sum(full))
    # the device allocator's peak per item (CUDA: model, activations and cache together), beside the computed bytes
    dev = [r["device_peak_bytes"] for r in records if r.get("device_peak_bytes") is not None]
    if dev:
        out["device_peak_bytes"] = max(dev)
    # what the prefill needed at its peak over what was in use before it (CUDA allocator / CPU resident set): where
    # a method that compresses after the whole prefill would show all layers' full caches (issue 50)
    grow = [r["prefill_peak_growth_bytes"] for r in records if r.get("prefill_peak_growth_bytes") is not None]
    if grow:
        out["prefill_peak_growth_bytes"] = max(grow)
    # The same ratio right after the context prefill and the method's compression (QA only): what every
    # evicting method's budget bounds, SnapKV's included (it compresses the context once and then keeps the
    # question and the answer, so its decode-peak kv_ratio is above its budget by design; methods/snapkv.md).
    pre = [(r.get("kv_bytes_prefill"), r.get("kv_bytes_full_prefill")) for r in records]
    if pre and all(h is not None and f for h, f in pre):
        out["kv_ratio_context"] = kv_ratio(sum(h for h, _ in pre), sum(f for _, f in pre))
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

# Standard errors, perplexity's delta method and paired differences: ``luka_bench.stats`` (the one place).
