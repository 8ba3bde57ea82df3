"""The one generation loop every client drives: the CLI runner, the probe, the studies, the public API and
lm-eval (``--model luka_bench``).

**The tail rule**: no token is scored or generated from logits computed before the method's compression of what
precedes it. A prompt is split in two: the part that is prefilled and then compressed by the method, and a *tail*
of at least one token fed through the compressed cache as a decode-phase forward; the first scored or generated
token comes from the tail's last logits (``prefill_with_tail``). The prefill's own logits (exact attention over
the whole prompt) are never used. Where the tail comes from (the prompt's layout is planned in
``luka_bench.prompting``, nothing there runs the model):

- the runner's default protocol and ``KV.generate``: the question part (question, end of turn, assistant header,
  answer prefix), the context alone compressed;
- ``query_aware=true`` (kvpress's query-aware protocol): the question joins the context in the compressed part;
  the tail is everything after the question's text (``prompting.qa_tail``): the chat template's end of turn and
  assistant header and the answer prefix; without a chat template the answer prefix, at least the prompt's last
  token;
- lm-eval: the generation prompt lm-eval's chat template puts after the last user message
  (``prompting.text_tail``), else the context's last token.

Protocols (each used by every client that needs it), on prompts planned by ``prompting.plan_qa`` (a QA dataset's
prompts as token ids, checked against the model's context before any work is done):
- ``prefill``: the compressed part through a fresh cache (the method compresses after it: ``MethodCache``);
- ``prefill_with_tail``: the rule above, timed, with what the cache held after the compression (``Prefilled``);
- ``teacher_force``: tokens scored one by one through a cache from given logits (log-probabilities, is-greedy);
  ``feed_each``: the same without scores;
- ``greedy_decode``: greedy tokens from a cache until an end-of-sequence id (not kept), a stop or a limit;
- ``greedy_answer``: a tail through a compressed cache, then ``greedy_decode``;
- ``teacher_forced_nll``: the perplexity protocol (first token, then every next token through the cache);
- ``answer_example``: one QA example as the runner answers it (one prefill, every question from a clone).

A cache knows what it needs when it is made (``Attached.new_cache(reference_length=..., question_ids=...,
prefill_chunk=...)``): nothing here sets attributes on it. The first forward through a fresh cache is its prefill,
so ``model.generate(..., past_key_values=attached.new_cache())`` follows the same rules.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from luka_bench import device as D
from luka_bench.methods.hf import MethodCache, RowBatch
from luka_bench.methods.stacked import release_rows
from luka_bench.prompting import ExamplePlan, QuestionPlan, with_tail


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
    """The compressed part of a prompt through a fresh cache: its first forward, in the cache's prefill chunks; the
    method compresses after it. Returns the last position's logits, computed *before* the compression: no client
    scores or generates from them (the tail rule, ``prefill_with_tail``)."""
    if cache.phase != "prefill" or cache.seen:
        raise RuntimeError("prefill() needs a fresh cache")
    return forward(model, ids, cache)


def feed(model, ids: list[int] | torch.Tensor, cache: MethodCache) -> torch.Tensor:
    """Tokens after the prefill (a tail, a question) through the compressed cache as one decode-phase forward;
    returns the last position's logits."""
    if cache.phase != "decode":
        raise RuntimeError(f"feed() needs a cache past its prefill and compression (phase 'decode', got "
                           f"{cache.phase!r}): prefill() first")
    if len(ids) < 1:
        raise ValueError("feed() needs at least one token")
    return forward(model, ids, cache)


def timed_feed(model, ids: list[int], cache: MethodCache) -> tuple[torch.Tensor, float]:
    """``feed`` timed (device synchronised before and after): (the last position's logits, seconds)."""
    sync(model.device)
    t0 = time.perf_counter()
    logits = feed(model, ids, cache)
    sync(model.device)
    return logits, time.perf_counter() - t0


def in_batches(items, size: int) -> Iterator[list]:
    """``items`` (any iterable, consumed lazily) in lists of ``size``, the last one shorter."""
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass
class Prefilled:
    """What ``prefill_with_tail`` did: the logits after the tail, and the timed figures."""

    logits: torch.Tensor  # the tail's last position [vocab]: the first scored or generated token comes from them
    prefill_s: float  # the compressed part's prefill and the method's compression
    tail_s: float  # the tail through the compressed cache
    tail_tokens: int
    kv_bytes_prefill: int  # held right after the compression (before the tail)
    kv_bytes_full_prefill: int  # what full attention holds then
    kv_tokens_prefill: list[int]

    def info(self) -> dict:
        return {"prefill_s": self.prefill_s, "kv_bytes_prefill": self.kv_bytes_prefill,
                "kv_bytes_full_prefill": self.kv_bytes_full_prefill, "kv_tokens_prefill": self.kv_tokens_prefill}


@torch.no_grad()
def timed_prefill(model, ids: list[int] | torch.Tensor, cache: MethodCache) -> dict:
    """``prefill`` timed (device synchronised), with what the cache holds after the method's compression:
    ``prefill_s``, ``kv_bytes_prefill``, ``kv_bytes_full_prefill``, ``kv_tokens_prefill``, and the memory the prefill
    needed at its peak over what was in use before it, ``prefill_peak_growth_bytes`` (CUDA: the allocator's; CPU:
    the process's resident set: the cache, the activations and what the method computes for its scores)."""
    sync(model.device)
    mark = D.memory_mark(model.device)
    t0 = time.perf_counter()
    prefill(model, ids, cache)
    sync(model.device)
    return {"prefill_s": time.perf_counter() - t0, "kv_bytes_prefill": cache.held_bytes(),
            "kv_bytes_full_prefill": cache.full_bytes(), "kv_tokens_prefill": cache.held_tokens(),
            "prefill_peak_growth_bytes": D.peak_growth(model.device, mark)}


@torch.no_grad()
def prefill_with_tail(model, head: list[int], tail: list[int], cache: MethodCache) -> Prefilled:
    """The tail rule: ``head`` prefilled through the fresh ``cache`` and compressed by the method, then ``tail`` (at
    least one token: ``prompting.with_tail``) fed through the compressed cache as one decode-phase forward. Returns
    the tail's last logits and the timed figures."""
    if not tail:
        raise ValueError("prefill_with_tail() needs a tail of at least one token (the tail rule; see with_tail)")
    info = timed_prefill(model, head, cache)
    t0 = time.perf_counter()
    logits = feed(model, tail, cache)
    sync(model.device)
    return Prefilled(logits, info["prefill_s"], time.perf_counter() - t0, len(tail), info["kv_bytes_prefill"],
                     info["kv_bytes_full_prefill"], info["kv_tokens_prefill"])


# ---------------------------------------------------------------------------------------------------------
# Decoding and scoring from a cache
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Generation:
    token_ids: list[int]
    text: str
    question_s: float  # the tail (question) through the compressed cache; 0 when decoding started from logits
    step_s: list[float]
    step_timings: dict[str, float]  # method component seconds summed over the generated-token steps
    attended: dict | None = None  # MethodCache.attended_stats over the generated-token steps
    tail_tokens: int = 0  # tokens fed through the compressed cache before the first generated token


def stopped(text: str, stop_strings: tuple[str, ...]) -> bool:
    return any(s in text.lstrip() for s in stop_strings)


@torch.no_grad()
def greedy_decode(model, tokenizer, cache: MethodCache, logits: torch.Tensor, max_new_tokens: int,
                  eos_ids: set[int], stop_strings: tuple[str, ...] = ("\n",), special_stops: bool = False
                  ) -> Generation:
    """Greedy decoding with the method active, the first token from ``logits`` (a tail's, ``prefill_with_tail``).
    Returns the ids ``model.generate`` returns with the same cache up to its first end-of-sequence id, that id
    excluded; stops there, after ``max_new_tokens`` or once the text contains a stop string. The text is decoded
    without special tokens; with ``special_stops`` the stop check decodes with them (lm-eval's stop criterion, so
    ``<|im_end|>`` stops), otherwise it reads the text without them, leading blanks stripped (the runner's)."""
    return greedy_decode_rows(model, tokenizer, [cache], logits.view(1, -1), max_new_tokens, eos_ids, stop_strings,
                              special_stops)[0]


def _goes_on(tok: int, out: list[int], tokenizer, max_new_tokens: int, eos_ids: set[int],
             stop_strings: tuple[str, ...], special_stops: bool) -> bool:
    """Greedy decoding's rule for one argmax ``tok``: an end-of-sequence id stops before it (not kept); otherwise it
    joins ``out``, and decoding stops once the text holds a stop string or ``out`` is ``max_new_tokens`` long.
    True: ``tok`` is fed as the next decode step."""
    if tok in eos_ids:
        return False
    out.append(tok)
    if stop_strings and tokenizer is not None:
        if special_stops:
            if any(s in tokenizer.decode(out, skip_special_tokens=False) for s in stop_strings):
                return False
        elif stopped(tokenizer.decode(out, skip_special_tokens=True), stop_strings):
            return False
    return len(out) < max_new_tokens


@torch.no_grad()
def forward_rows(model, tokens: list[int], caches: list[MethodCache]) -> torch.Tensor:
    """One token per row, each through its own cache, all rows in one forward of the model (``hf.RowBatch``: the
    projections over the batch, each layer's attention on the row's own store); logits [B, vocab]. One row is
    ``forward`` itself (batch 1 unchanged)."""
    if len(caches) == 1:
        return forward(model, tokens[:1], caches[0]).view(1, -1)
    for c, tok in zip(caches, tokens):
        c.add_tokens([tok])
    x = torch.as_tensor(tokens, device=model.device).view(-1, 1)
    return model(input_ids=x, past_key_values=RowBatch(caches), use_cache=True, logits_to_keep=1).logits[:, -1]


@torch.no_grad()
def greedy_decode_rows(model, tokenizer, caches: list[MethodCache], logits: torch.Tensor,
                       max_new_tokens: int | list[int], eos_ids: set[int],
                       stop_strings: tuple[str, ...] | list[tuple[str, ...]] = ("\n",), special_stops: bool = False
                       ) -> list[Generation]:
    """``greedy_decode`` for a batch of rows, each from its own compressed cache and its row of ``logits`` [B,
    vocab] (its tail's), every row under the same rule as alone (``_goes_on``; ``max_new_tokens`` and
    ``stop_strings`` one for all or one per row). Each step is one forward over the rows still running
    (``forward_rows``): a row that stopped costs nothing further and never changes another row (rows of any lengths
    and methods: each row's cache is its own).
    One host read of the step's argmaxes for all rows. A row's ``step_s`` are the seconds of the batched steps it
    took part in."""
    B = len(caches)
    limits = [max_new_tokens] * B if isinstance(max_new_tokens, int) else list(max_new_tokens)
    stops = [stop_strings] * B if isinstance(stop_strings, tuple) else [tuple(s) for s in stop_strings]
    if logits.shape[0] != B or len(limits) != B:
        raise ValueError(f"greedy_decode_rows: {B} caches, {logits.shape[0]} rows of logits and {len(limits)} "
                         f"limits; allowed: one of each per row")
    before = [dict(c.timings) for c in caches]
    n_before = [len(c.attended_tokens) for c in caches]
    outs: list[list[int]] = [[] for _ in range(B)]
    steps: list[list[float]] = [[] for _ in range(B)]
    active = [b for b in range(B) if limits[b] > 0]
    logits = logits[active] if len(active) < B else logits
    device = model.device
    while active:
        toks = torch.argmax(logits, dim=-1).tolist()
        going = [(b, tok) for b, tok in zip(active, toks)
                 if _goes_on(tok, outs[b], tokenizer, limits[b], eos_ids, stops[b], special_stops)]
        if not going:
            break
        active = [b for b, _ in going]
        t = time.perf_counter()
        logits = forward_rows(model, [tok for _, tok in going], [caches[b] for b in active])
        sync(device)
        dt = time.perf_counter() - t
        for b in active:
            steps[b].append(dt)
    release_rows(caches)  # rows decoded stacked get storage of their own again (``methods/stacked.py``)
    gens = []
    for b, c in enumerate(caches):
        after = {k: v - before[b].get(k, 0.0) for k, v in c.timings.items()}
        text = tokenizer.decode(outs[b], skip_special_tokens=True) if tokenizer is not None else ""
        gens.append(Generation(outs[b], text, 0.0, steps[b], after, c.attended_stats(n_before[b])))
    return gens


@torch.no_grad()
def greedy_answer(model, tokenizer, cache: MethodCache, question_ids: list[int], max_new_tokens: int,
                  eos_ids: set[int], stop_strings: tuple[str, ...] = ("\n",), special_stops: bool = False
                  ) -> Generation:
    """Feed the tail (``question_ids``: the question part, at least one token) through a compressed cache, then
    ``greedy_decode`` from its logits. ``question_s``: the tail's seconds."""
    logits, question_s = timed_feed(model, question_ids, cache)
    gen = greedy_decode(model, tokenizer, cache, logits, max_new_tokens, eos_ids, stop_strings, special_stops)
    gen.question_s, gen.tail_tokens = question_s, len(question_ids)
    return gen


@torch.no_grad()
def feed_each(model, cache: MethodCache, tokens: list[int]) -> torch.Tensor | None:
    """Teacher forcing without scores: every token of ``tokens`` fed as its own decode step (the method acts on each);
    returns the last logits (None for no tokens)."""
    logits = None
    for j in range(len(tokens)):
        logits = forward(model, tokens[j: j + 1], cache)
    return logits


@dataclass
class Forced:
    """What ``teacher_force`` returns: per token its log-probability [n] and whether it was the argmax [n]."""

    logprobs: torch.Tensor
    greedy: torch.Tensor
    step_s: list[float]


@torch.no_grad()
def teacher_force(model, cache: MethodCache, logits: torch.Tensor, tokens: list[int],
                  dtype: torch.dtype | None = torch.float32, timed: bool = False) -> Forced:
    """Score ``tokens`` one by one through ``cache``: the first from ``logits`` (a tail's), each next one after
    feeding the one before it as a decode step (the method acts on every token). Log-softmax in ``dtype`` (None: the
    logits' own dtype, as lm-eval's hf model takes it); no host synchronisation per token unless ``timed`` (then
    ``step_s`` holds each forward's seconds)."""
    return teacher_force_rows(model, [cache], logits.view(1, -1), [tokens], dtype, timed)[0]


@torch.no_grad()
def teacher_force_rows(model, caches: list[MethodCache], logits: torch.Tensor, tokens: list[list[int]],
                       dtype: torch.dtype | None = torch.float32, timed: bool = False) -> list[Forced]:
    """``teacher_force`` for a batch of rows, each from its own cache and its row of ``logits`` [B, vocab]: row b's
    ``tokens[b]`` scored one by one, the rows of different lengths right-padded in effect — a row whose tokens are
    all scored leaves the batch, so no pad is ever fed, attended or scored. Each step is one forward over the rows
    still going (``forward_rows``)."""
    B = len(caches)
    if logits.shape[0] != B or len(tokens) != B:
        raise ValueError(f"teacher_force_rows: {B} caches, {logits.shape[0]} rows of logits and {len(tokens)} token "
                         f"lists; allowed: one of each per row")
    lps: list[list[torch.Tensor]] = [[] for _ in range(B)]
    greedy: list[list[torch.Tensor]] = [[] for _ in range(B)]
    steps: list[list[float]] = [[] for _ in range(B)]
    device = model.device
    active = [b for b in range(B) if tokens[b]]
    logits = logits[active] if len(active) < B else logits
    j = 0
    while active:
        lp = torch.log_softmax(logits, dim=-1, dtype=dtype)
        for i, b in enumerate(active):
            tok = tokens[b][j]
            lps[b].append(lp[i, tok])
            greedy[b].append(torch.argmax(lp[i]) == tok)
        going = [i for i, b in enumerate(active) if j < len(tokens[b]) - 1]
        if not going:
            break
        active = [active[i] for i in going]
        t = time.perf_counter()
        logits = forward_rows(model, [tokens[b][j] for b in active], [caches[b] for b in active])
        if timed:
            sync(device)
            dt = time.perf_counter() - t
            for b in active:
                steps[b].append(dt)
        j += 1
    release_rows(caches)  # rows decoded stacked get storage of their own again (``methods/stacked.py``)
    return [Forced(torch.stack(lps[b]), torch.stack(greedy[b]), steps[b]) if lps[b] else
            Forced(torch.zeros(0), torch.zeros(0, dtype=torch.bool), steps[b]) for b in range(B)]


@torch.no_grad()
def teacher_forced_nll(model, attached, ids: list[int], **cache_kw) -> tuple[list[float], list[float], MethodCache]:
    """The pg19 protocol: feed the first token (the prefill: one token, nothing to compress; the budget is a
    fraction of the whole document), then every next token one at a time with the method active. Returns (NLL of
    tokens 1..n-1, seconds per step, the cache). fp32 log-softmax. ``cache_kw``: more settings of the cache
    (``MethodCache``)."""
    return teacher_forced_nll_rows(model, attached, [ids], **cache_kw)[0]


@torch.no_grad()
def teacher_forced_nll_rows(model, attached, docs: list[list[int]], **cache_kw
                            ) -> list[tuple[list[float], list[float], MethodCache]]:
    """``teacher_forced_nll`` for documents of any lengths as the rows of one batch (``teacher_force_rows``): each
    its own cache and one-token prefill, then every next token of every row still going in one forward per step;
    each row's NLL is its document's alone. A row's seconds per step are its batch's."""
    return [((-f.logprobs).tolist(), f.step_s, c)
            for f, c in forced_documents(model, attached, docs, torch.float32, timed=True, **cache_kw)]


@torch.no_grad()
def forced_documents(model, attached, docs: list[list[int]], dtype: torch.dtype | None = torch.float32,
                     timed: bool = False, **cache_kw) -> list[tuple["Forced", MethodCache]]:
    """Each document its own fresh cache (the budget a fraction of the document) and a one-token prefill (nothing to
    compress before it), then every next token teacher-forced, the documents as the rows of one batch
    (``teacher_force_rows``): per document (its ``Forced``, its cache)."""
    caches = [attached.new_cache(reference_length=len(ids), **cache_kw) for ids in docs]
    logits = torch.stack([prefill(model, ids[:1], c) for ids, c in zip(docs, caches)])
    forced = teacher_force_rows(model, caches, logits, [list(ids[1:]) for ids in docs], dtype, timed)
    return list(zip(forced, caches))


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


@dataclass
class Answered:
    """One question answered from an example's prefilled context (``answer_example``)."""

    plan: QuestionPlan
    generation: Generation
    cache: MethodCache  # the question's own cache (a clone of the context's) after generating
    prefill: dict  # the example's prefill: seconds, bytes and tokens held after it, evidence kept
    device_peak_bytes: int | None = None  # the device allocator's peak over the prefill and this answer (CUDA)


@dataclass
class Ready:
    """A question ready to decode (``ready_questions``): its own cache past the tail and the tail's logits."""

    plan: QuestionPlan
    cache: MethodCache
    logits: torch.Tensor
    question_s: float  # the tail through the compressed cache
    tail_tokens: int
    prefill: dict  # the example's (or, query-aware, the question's) prefill: ``_prefill``'s info
    prefill_peak: int | None  # the device allocator's peak over that prefill (CUDA)


def ready_questions(lm, attached, plan: ExamplePlan, todo: list[QuestionPlan], cache_kw: dict | None = None,
                    query_aware: bool = False) -> Iterator[Ready]:
    """The runner's QA protocol for one example up to the first answer token: one prefill of the context
    (question-aware methods see every question's ids), compressed, then for each question in ``todo`` a clone of
    that context-only cache with the question part fed through it as the tail.

    ``query_aware`` (kvpress's "query-aware" protocol): the question is compressed together with the context: each
    question's context + question text is one prefill, compressed by the method (its observation window, if any,
    ends at the question), and the rest of the prompt — the chat template's end of turn and assistant header, the
    answer prefix (``QuestionPlan.tail``; at least the prompt's last token) — is the tail fed through the compressed
    cache before the first answer token. ``cache_kw``: more settings of the caches (``MethodCache``:
    ``prefill_chunk``, ``cuda_events``). Lazy: a question's cache is made when the caller asks for it."""
    model, cache_kw = lm.model, dict(cache_kw or {})

    def tail_through(qp, cache, tail, info, peak) -> Ready:
        return Ready(qp, cache, *timed_feed(model, tail, cache), len(tail), info, peak)

    if query_aware:
        for qp in todo:
            D.reset_peak(model.device)
            head, tail = with_tail(plan.context_ids + qp.ids[: len(qp.ids) - qp.tail], qp.ids[len(qp.ids) - qp.tail:])
            span = max(0, len(head) - len(plan.context_ids))  # the question's tokens at the end of the prefill
            cache, info = _prefill(lm, attached, plan, head, None, {**cache_kw, "question_span": span})
            yield tail_through(qp, cache, tail, info, None)
        return
    D.reset_peak(model.device)
    context, first_tail = plan.context_ids, None
    if any(not qp.ids for qp in todo):  # a question part of no tokens: the context's last token is the tail
        context, first_tail = with_tail(plan.context_ids, [])
    cache, info = _prefill(lm, attached, plan, context, plan.question_ids, cache_kw)
    prefill_peak = D.peak_allocated(model.device)
    for qp in todo:
        D.reset_peak(model.device)
        yield tail_through(qp, cache.clone(), (first_tail or []) + qp.ids, info, prefill_peak)


def answer_rows(lm, ready: list[Ready], eos_ids: set[int], stop_strings: tuple[str, ...]) -> list[Answered]:
    """Questions ready to decode (of any examples) answered as the rows of one batch (``greedy_decode_rows``): each
    answer is the one its question gets alone. On CUDA each answer carries the device allocator's peak over its
    prefill and the batch's generation."""
    model = lm.model
    gens = greedy_decode_rows(model, lm.tokenizer, [r.cache for r in ready], torch.stack([r.logits for r in ready]),
                              [r.plan.max_new_tokens for r in ready], eos_ids, stop_strings)
    peak = D.peak_allocated(model.device)
    out = []
    for r, gen in zip(ready, gens):
        gen.question_s, gen.tail_tokens = r.question_s, r.tail_tokens
        out.append(Answered(r.plan, gen, r.cache, r.prefill,
                            None if peak is None else max(peak, r.prefill_peak or 0)))
    return out


def answer_example(lm, attached, plan: ExamplePlan, todo: list[QuestionPlan], eos_ids: set[int],
                   stop_strings: tuple[str, ...], cache_kw: dict | None = None, query_aware: bool = False
                   ) -> Iterator[Answered]:
    """The runner's QA protocol for one example, one question at a time: ``ready_questions`` (one prefill, each
    question from a clone of the compressed context, its question part the tail), then greedy decoding."""
    for r in ready_questions(lm, attached, plan, todo, cache_kw, query_aware):
        yield answer_rows(lm, [r], eos_ids, stop_strings)[0]


def _prefill(lm, attached, plan: ExamplePlan, ids: list[int], question_ids, cache_kw: dict):
    """A fresh cache with ``ids`` prefilled (timed) and compressed: (cache, what it held after)."""
    cache = attached.new_cache(reference_length=len(ids), question_ids=question_ids, **cache_kw)
    info = timed_prefill(lm.model, ids, cache)
    info["evidence_kept"] = evidence_kept(cache, plan.evidence) if plan.evidence else None
    return cache, info


def stand_in_question(method, prompt_len: int, tokens: int = 16) -> dict:
    """Cache settings for a throwaway or measuring prefill of a method that needs the question inside the prompt
    (FINCH, ``question_in_prompt``): the prompt's last ``tokens`` tokens (at most half of it) stand for the question;
    {} for every other method. The warm-up, ``host_sync``'s and ``launches``' counters and ``bench_memory`` use it."""
    return {"question_span": min(tokens, prompt_len // 2)} if getattr(method, "question_in_prompt", False) else {}


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
        cache = att.new_cache(reference_length=prompt_len, prefill_chunk=max(1, chunk),
                              **stand_in_question(method, prompt_len))  # FINCH refuses a prompt without one
        prefill(model, ids[:prompt_len], cache)
        for i in range(steps):
            forward(model, ids[prompt_len + i: prompt_len + i + 1], cache)
        cache.timings  # resolve any recorded events
    D.synchronize(dev)
    return time.perf_counter() - t0
