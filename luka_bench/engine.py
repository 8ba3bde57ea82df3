"""The one generation loop every client drives: the CLI runner, the probe, the studies and the public API.

- ``plan_qa``: a QA dataset's prompts as token ids (context part, each question part, its new-token limit, the
  evidence positions), checked against the model's context before any work is done;
- ``prefill``: the context through a fresh cache (the method compresses after it: ``MethodCache``);
- ``greedy_answer``: a question through a context cache, then greedy decoding with the method active;
- ``teacher_forced_nll``: the perplexity protocol (first token, then every next token through the cache);
- ``answer_example``: one QA example as the runner answers it (one prefill, every question from a clone).

A cache knows what it needs when it is made (``Attached.new_cache(reference_length=..., question_ids=...,
prefill_chunk=...)``): nothing here sets attributes on it. The first forward through a fresh cache is its prefill,
so ``model.generate(..., past_key_values=attached.new_cache())`` follows the same rules.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from luka_bench import device as D
from luka_bench.methods.hf import MethodCache


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA runs kernels asynchronously: a host clock would time their launch)."""
    D.synchronize(device)


@torch.no_grad()
def forward(model, ids: list[int] | torch.Tensor, cache: MethodCache) -> torch.Tensor:
    """Run ``ids`` through the model with ``cache``; returns the logits of the last position [vocab]. Ids given on
    the host are announced to the cache first (no device-to-host copy of them per forward)."""
    x = torch.as_tensor(ids, device=model.device).view(1, -1)
    if not torch.is_tensor(ids):
        cache.add_tokens(ids)
    # logits_to_keep=1: only the last position goes through the LM head (a long prefill's N x vocab logits
    # would cost ~1/5 of its compute and 6 GB at 32K)
    return model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]


def prefill(model, ids: list[int] | torch.Tensor, cache: MethodCache) -> torch.Tensor:
    """The context through a fresh cache: its first forward, in the cache's prefill chunks; the method compresses
    after it. Returns the last position's logits."""
    if cache.phase != "prefill" or cache.seen:
        raise RuntimeError("prefill() needs a fresh cache")
    return forward(model, ids, cache)


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    question_s: float
    step_s: list[float]
    step_timings: dict[str, float]  # method component seconds summed over the generated-token steps
    attended: dict | None = None  # MethodCache.attended_stats over the generated-token steps


def stopped(text: str, stop_strings: tuple[str, ...]) -> bool:
    return any(s in text.lstrip() for s in stop_strings)


@torch.no_grad()
def greedy_answer(model, tokenizer, cache: MethodCache, question_ids: list[int], max_new_tokens: int,
                  eos_ids: set[int], stop_strings: tuple[str, ...] = ("\n",), logits: torch.Tensor | None = None
                  ) -> Generation:
    """Feed the question to a context cache and decode greedily with the method active. Without question ids the
    first token comes from ``logits`` (the prefill's). Stops at an end-of-sequence id (not kept), after
    ``max_new_tokens`` or once the text contains a stop string."""
    device = model.device
    sync(device)
    t0 = time.perf_counter()
    if question_ids:
        logits = forward(model, question_ids, cache)
    elif logits is None:
        raise ValueError("greedy_answer needs question ids or the prefill's logits")
    sync(device)
    question_s = time.perf_counter() - t0
    before = dict(cache.timings)
    n_before = len(cache.attended_tokens)
    out: list[int] = []
    steps: list[float] = []
    while True:
        tok = int(torch.argmax(logits))
        if tok in eos_ids:
            break
        out.append(tok)
        if len(out) >= max_new_tokens or (stop_strings and stopped(
                tokenizer.decode(out, skip_special_tokens=True), stop_strings)):
            break
        t = time.perf_counter()
        logits = forward(model, [tok], cache)
        sync(device)
        steps.append(time.perf_counter() - t)
    after = {k: v - before.get(k, 0.0) for k, v in cache.timings.items()}
    text = tokenizer.decode(out, skip_special_tokens=True) if tokenizer is not None else ""
    return Generation(out, text, question_s, steps, after, cache.attended_stats(n_before))


@torch.no_grad()
def teacher_forced_nll(model, attached, ids: list[int], **cache_kw) -> tuple[list[float], list[float], MethodCache]:
    """The pg19 protocol: feed the first token (the prefill; the budget is a fraction of the whole document), then
    every next token one at a time with the method active. Returns (NLL of tokens 1..n-1, seconds per step, the
    cache). fp32 log-softmax. ``cache_kw``: more settings of the cache (``MethodCache``)."""
    cache = attached.new_cache(reference_length=len(ids), **cache_kw)
    device = model.device
    logits = prefill(model, ids[:1], cache)
    nll, steps = [], []
    for t in range(1, len(ids)):
        nll.append(float(-torch.log_softmax(logits.float(), dim=-1)[ids[t]]))
        if t == len(ids) - 1:
            break
        s = time.perf_counter()
        logits = forward(model, ids[t: t + 1], cache)
        sync(device)
        steps.append(time.perf_counter() - s)
    return nll, steps, cache


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model.generation_config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return ids


def breakdown(timings: dict[str, float], step_s: list[float]) -> dict[str, float] | None:
    """Seconds per decode step by component: the timed parts (attention, eviction; LuKA's refinement and
    segment_compress; see ``LayerPolicy``) and ``rest`` (the model around them: projections, MLPs, norms)."""
    if not step_s:
        return None
    n = len(step_s)
    out = {k: v / n for k, v in sorted(timings.items())}
    out["rest"] = max(0.0, sum(step_s) / n - sum(out.values()))
    return out


def memory(cache: MethodCache) -> dict:
    """What a cache holds now and held at most while decoding, against full attention."""
    return {"kv_bytes_peak": cache.peak_bytes, "kv_bytes_full": cache.full_bytes(),
            "kv_bytes_allocated": cache.allocated_bytes(), "kv_tokens": cache.held_tokens(),
            "method_stats": cache.method_report()}


def evidence_kept(cache: MethodCache, positions: list[int]) -> float | None:
    """Share of the evidence token ``positions`` a cache holds: per layer and KV head the fraction held, averaged
    over every layer and KV head (sliding-window layers included as they are)."""
    if not positions:
        return None
    shares = []
    for s in cache.stores:
        pos = s.positions  # [B, Hkv, n]
        want = torch.as_tensor(positions, device=pos.device)
        held = (pos.unsqueeze(-1) == want).any(dim=2).float().mean(dim=-1)  # [B, Hkv]
        shares.append(held.flatten())
    return float(torch.cat(shares).mean())


# ---------------------------------------------------------------------------------------------------------
# QA prompts: planned once, for every client
# ---------------------------------------------------------------------------------------------------------

@dataclass
class QuestionPlan:
    question: Any  # data.base.Question
    ids: list[int]  # the question part of the prompt (after the context part)
    max_new_tokens: int


@dataclass
class ExamplePlan:
    example: Any  # data.base.QAExample
    context_ids: list[int]
    questions: list[QuestionPlan]
    evidence: list[int] | None = None  # token positions of the supporting facts, when the dataset gives them
    question_ids: list[int] = field(default_factory=list)  # every question's ids in order (question-aware methods)


def plan_qa(task, lm, max_new_tokens: int | None = None, questions: int | None = None,
            evidence: bool = True) -> list[ExamplePlan]:
    """Every example's prompt as token ids, with the dataset's prompt blocks, answer prefix and chat template;
    ``max_new_tokens`` (None: each question's own, ``Task.max_new_tokens_for``) reserved after it. The first
    ``questions`` questions of each example (None: all). An over-long prompt is a one-line ``PromptTooLong``
    before any work is done."""
    from luka_bench.data.base import evidence_positions, qa_prompt_ids
    from luka_bench.errors import PromptTooLong

    tok = lm.tokenizer
    task.prepare(tok, lm.max_context - (max_new_tokens or task.max_new_tokens), chat_template=lm.chat_template)
    plans = []
    for ex in task.examples():
        ctx_ids, qs = None, []
        for q in ex.questions[: questions if questions else None]:
            c, qi = qa_prompt_ids(tok, lm.chat_template, task.context_block(ex), task.question_block(q),
                                  task.answer_prefix(q))
            ctx_ids = ctx_ids or c
            new = int(max_new_tokens if max_new_tokens is not None else task.max_new_tokens_for(q))
            need = len(c) + len(qi) + new
            if need > lm.max_context:
                raise PromptTooLong(
                    f"example {ex.id!r} needs {need} tokens (context {len(c)} + question {len(qi)} + "
                    f"{new} new) but model.max_context={lm.max_context} for '{lm.name}'; allowed: <= "
                    f"{lm.max_context} — use a shorter data setting or a model with a longer context")
            qs.append(QuestionPlan(q, qi, new))
        ev = None
        spans = task.evidence_spans(ex) if evidence else None
        if spans:
            ev = evidence_positions(tok, lm.chat_template, task.context_block(ex), spans)
        plans.append(ExamplePlan(ex, ctx_ids, qs, ev, [t for p in qs for t in p.ids]))
    return plans


@dataclass
class Answered:
    """One question answered from an example's prefilled context (``answer_example``)."""

    plan: QuestionPlan
    generation: Generation
    cache: MethodCache  # the question's own cache (a clone of the context's) after generating
    prefill: dict  # the example's prefill: seconds, bytes and tokens held after it, evidence kept
    device_peak_bytes: int | None = None  # the device allocator's peak over the prefill and this answer (CUDA)


def answer_example(lm, attached, plan: ExamplePlan, todo: list[QuestionPlan], eos_ids: set[int],
                   stop_strings: tuple[str, ...], cache_kw: dict | None = None, query_aware: bool = False
                   ) -> Iterator[Answered]:
    """The runner's QA protocol for one example: one prefill of the context (question-aware methods see every
    question's ids), then each question in ``todo`` from a clone of that context-only cache, greedy.

    ``query_aware`` (kvpress's "query-aware" protocol): the question is compressed together with the context
    instead: each question's whole prompt (context + question) is one prefill, compressed by the method, and the
    answer starts right after it. ``cache_kw``: more settings of the caches (``MethodCache``: ``prefill_chunk``,
    ``cuda_events``). On CUDA each answer carries the device allocator's peak over its prefill and generation."""
    model, cache_kw = lm.model, dict(cache_kw or {})
    if query_aware:
        for qp in todo:
            D.reset_peak(model.device)
            cache, logits, info = _prefill(lm, attached, plan, plan.context_ids + qp.ids, None, cache_kw)
            gen = greedy_answer(model, lm.tokenizer, cache, [], qp.max_new_tokens, eos_ids, stop_strings,
                                logits=logits)
            yield Answered(qp, gen, cache, info, D.peak_allocated(model.device))
        return
    D.reset_peak(model.device)
    cache, _, info = _prefill(lm, attached, plan, plan.context_ids, plan.question_ids, cache_kw)
    prefill_peak = D.peak_allocated(model.device)
    for qp in todo:
        D.reset_peak(model.device)
        c = cache.clone()
        gen = greedy_answer(model, lm.tokenizer, c, qp.ids, qp.max_new_tokens, eos_ids, stop_strings)
        peak = D.peak_allocated(model.device)
        yield Answered(qp, gen, c, info, None if peak is None else max(peak, prefill_peak or 0))


def _prefill(lm, attached, plan: ExamplePlan, ids: list[int], question_ids, cache_kw: dict):
    """A fresh cache with ``ids`` prefilled (timed) and compressed: (cache, last logits, what it held after)."""
    model = lm.model
    cache = attached.new_cache(reference_length=len(ids), question_ids=question_ids, **cache_kw)
    sync(model.device)
    t0 = time.perf_counter()
    logits = prefill(model, ids, cache)
    sync(model.device)
    info = {"prefill_s": time.perf_counter() - t0, "kv_bytes_prefill": cache.held_bytes(),
            "kv_bytes_full_prefill": cache.full_bytes(), "kv_tokens_prefill": cache.held_tokens(),
            "evidence_kept": evidence_kept(cache, plan.evidence) if plan.evidence else None}
    return cache, logits, info


@torch.no_grad()
def warm_up(model, method=None, tokenizer=None, prompt_len: int = 256, chunk: int = 128, steps: int = 2,
            seed: int = 0) -> float:
    """A throwaway run through ``method`` (default: full attention) on ``model``: a prefill of ``prompt_len``
    random token ids in chunks of ``chunk`` (the first chunk a plain causal prefill, the next ones the masked
    chunk-after-a-prefix path; chunks of >= 64 queries take the Triton prefill kernel on CUDA), then ``steps``
    decode steps, then a device synchronisation. Nothing is kept. Returns the seconds it took. Meant for CUDA
    before the first timed item (one-time costs: kernel compilation and autotuning, library handles, allocator
    growth); it runs on any device."""
    from luka_bench.methods import hf
    from luka_bench.methods.full import Full

    method = Full() if method is None else method
    dev = model.device
    vocab = min(model.config.get_text_config().vocab_size, 256)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (prompt_len + steps,), generator=g).tolist()
    t0 = time.perf_counter()
    with hf.attach(model, method, tokenizer) as att:
        # the prefill in chunks of ``chunk`` (split by attach's hook), then decode steps, as the engine runs them
        cache = att.new_cache(reference_length=prompt_len, prefill_chunk=max(1, chunk))
        prefill(model, ids[:prompt_len], cache)
        for i in range(steps):
            forward(model, ids[prompt_len + i: prompt_len + i + 1], cache)
        cache.timings  # resolve any recorded events
    D.synchronize(dev)
    return time.perf_counter() - t0
