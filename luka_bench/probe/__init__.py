"""The fidelity probe: how close is each method's attention to exact attention, layer by layer and KV head by KV
head, and what does it read?

    python -m luka_bench.probe method=luka_clustered data=pg19 data.max_tokens=4096
    python -m luka_bench.probe probe.methods=all data=wikisalad_easy data.target_chars=paper data.limit=10
    python -m luka_bench.probe probe.methods='[luka_lined,"luka_clustered sink=4 refine.k=8"]' probe.closed_loop=true

Open loop (default): the model runs once per prompt under full attention and a recording policy captures every
layer's post-RoPE queries, keys and values (the context prefill, then ``probe.steps`` decode steps: greedy tokens
after the question for QA, the document's last tokens for perplexity data). The capture is cached on disk
(``probe.cache_dir``, keyed by model + prompt tokens + steps). Each method is then *replayed without the model*:
a fresh ``MethodCache`` gets the captured keys/values layer by layer through the public interface
(``hf.replay_forward``: ``store.update``, ``policy.attend``, ``after_step``; ``cache.end_prefill()`` after the
context, so a cross-layer ``KVMethod.after_prefill_cache(cache)`` sees every layer), and every decode step is compared
with exact attention over the full keys/values. Every method sees the same queries, so the differences are the
methods' alone (errors do not compound across layers).

Closed loop (``probe.closed_loop=true``): the model generates with the method attached and the same measurements
are taken during that generation, against exact attention over every key/value of that trajectory (errors of
earlier layers and steps feed into later ones, as in a real run).

Per decode step, layer and KV head (the query heads of a group together):
- ``rel_err``: ||o - o*|| / ||o*||, o the method's attention output, o* exact attention;
- ``recall``: share of the ``probe.topk`` tokens with the highest exact attention weight (mean over the group's
  query heads) that the method attended (``LayerPolicy.attended``: LuKA's refined pages + tail + sinks, not all
  the raw tokens it holds; an evicting method attends everything it holds);
- ``mass``: exact attention mass on the attended tokens;
- ``tokens`` / ``bytes``: entries read (attended tokens + ``attended_extra()``: summaries) and their key+value
  bytes; ``held``: tokens held, as a fraction of the tokens seen.

Needle diagnostics, for prompts with a known needle (a QA example or question whose ``meta["needle_span"]`` is a
(start_char, end_char) span of the example's context, as ``data=niah`` / ``data=ruler`` give it; NaN otherwise):
- ``needle_recall``: share of the needle's tokens the method read at this step (``attended``; an evicting method
  reads what it holds);
- ``needle_mass``: exact attention mass on the needle's tokens (mean over the group's query heads), what a
  method would have to read to copy the needle;
- ``needle_mass_read``: the part of it on needle tokens the method read.
In the open loop the queries are full attention's, so ``needle_mass`` is the same for every method; in the
closed loop it is that of the method's own trajectory. ``probe_needle_by_layer.png`` plots the first and the
last by layer.

The command line, the tables and the plots (the probe's report) are ``luka_bench.probe_report``;
``python -m luka_bench.probe`` runs them. Here: what the probe measures (the capture, the replay, the closed
loop, the ``Observer``) and the prompts it measures on.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from luka_bench.methods.base import KVMethod, LayerInfo, LayerPolicy
from luka_bench.methods.attention import exact_attention, sdpa

METRICS = ("rel_err", "recall", "mass", "tokens", "bytes", "held", "needle_recall", "needle_mass",
           "needle_mass_read")
NEEDLE = ("needle_recall", "needle_mass", "needle_mass_read")


# ---------------------------------------------------------------------------------------------------------
# Capture (the model runs once under full attention)
# ---------------------------------------------------------------------------------------------------------

class _RecordPolicy(LayerPolicy):
    """Exact attention that keeps every query it is given (and every key: it never evicts, windows included)."""

    def __init__(self, method, info):
        super().__init__(method, info)
        self.queries: list[torch.Tensor] = []
        self.scaling = None

    def attend(self, store, query, scaling):
        self.queries.append(query.detach())
        self.scaling = scaling
        return exact_attention(store, query, scaling, self.info.sliding_window)


@dataclass
class _Record(KVMethod):
    name = "record"
    handles_sliding = True
    policy_class = _RecordPolicy


@dataclass
class Prompt:
    """One probed prompt: a context, then continuations (each: a chunk fed at once, e.g. the question, then
    ``steps`` single-token forwards, greedy under full attention unless ``forced`` gives the tokens)."""

    id: str
    context: list[int]
    chunks: list[list[int]]           # per continuation: the chunk before the steps (may be empty)
    forced: list[list[int]] | None    # per continuation: the step tokens (ppl), or None (greedy)
    steps: int
    needle: list[int] | None = None   # token positions (into ``context``) of a planted needle, if known


@dataclass
class Capture:
    """Per layer: queries [B, Hq, T, D], keys/values [B, Hkv, T, D] (post-RoPE) of the context followed by
    every continuation (each continuation's tokens follow the context logically; they are stored one after the
    other). ``lengths[j]``: the forward lengths of continuation j after the context."""

    infos: list[LayerInfo]
    scaling: float
    context: int
    lengths: list[list[int]]
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    ids: list[int] | None = None  # token ids in the stored order (context, then each continuation's)

    def to(self, dtype: torch.dtype, device) -> "Capture":
        f = (lambda xs: [x.to(device=device, dtype=dtype) for x in xs])
        return Capture(self.infos, self.scaling, self.context, self.lengths, f(self.q), f(self.k), f(self.v),
                       self.ids)


def _key(model_cfg: dict, prompt: Prompt) -> str:
    blob = json.dumps([model_cfg, prompt.context, prompt.chunks, prompt.forced, prompt.steps], sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:20]


@torch.no_grad()
def _continue(model, cache, prompt: Prompt, j: int) -> list[int]:
    """Feed continuation ``j`` to ``cache`` (the chunk, then ``steps`` tokens); returns the forward lengths."""
    _steps(model, cache, prompt, j)
    return ([len(prompt.chunks[j])] if prompt.chunks[j] else []) + [1] * prompt.steps


def _steps(model, cache, prompt: Prompt, j: int, before_forward=None) -> None:
    """Continuation ``j`` through ``cache`` with the engine's protocols: the chunk (the question: the tail through
    the compressed context) as one decode-phase forward (``engine.feed``), then ``steps`` tokens each fed as a
    decode step — the forced ones by teacher forcing (``engine.feed_each``), or greedy (``engine.greedy_decode``,
    no end-of-sequence stop, its last token fed too). ``before_forward(t)`` is called before each of these
    forwards (t = 0 the chunk, t >= 1 the steps), through a forward pre-hook on the model."""
    from luka_bench import engine as E

    count = [0 if prompt.chunks[j] else 1]

    def hook(module, args, kwargs):
        before_forward(count[0])
        count[0] += 1

    handle = model.register_forward_pre_hook(hook, with_kwargs=True) if before_forward is not None else None
    try:
        logits = E.feed(model, prompt.chunks[j], cache) if prompt.chunks[j] else None
        if prompt.forced is not None:
            E.feed_each(model, cache, list(prompt.forced[j][: prompt.steps]))
            return
        if logits is None:
            raise ValueError("greedy probe steps need a chunk (the question) before them")
        toks = E.greedy_decode(model, None, cache, logits, prompt.steps, set(), ()).token_ids
        E.feed(model, toks[-1:], cache)
    finally:
        if handle is not None:
            handle.remove()


@torch.no_grad()
def capture(lm, prompt: Prompt, cache_dir: str | Path | None = None, model_cfg: dict | None = None) -> Capture:
    """Run the model once on ``prompt`` with a recording policy; load from / save to ``cache_dir`` if given."""
    from luka_bench.engine import prefill
    from luka_bench.methods.hf import attach

    path = None
    if cache_dir is not None:
        path = Path(cache_dir).expanduser() / f"{_key(model_cfg or {'name': lm.name}, prompt)}.pt"
        if path.exists():
            d = torch.load(path, weights_only=False)
            if d.get("ids") is not None:  # captures stored before token ids were kept are redone
                d["infos"] = [LayerInfo(**i) for i in d["infos"]]
                # stored in float16 for an fp32 model: back in the model's dtype, as a fresh capture is after saving
                return Capture(**d).to(lm.model.dtype, lm.model.device)
    model = lm.model
    with attach(model, _Record()) as att:
        cache = att.new_cache()
        prefill(model, prompt.context, cache)
        n_ctx = len(prompt.context)
        qs = [torch.cat(s.policy.queries, 2) for s in cache.stores]
        ks = [s.keys.clone() for s in cache.stores]
        vs = [s.values.clone() for s in cache.stores]
        lengths, ids = [], list(cache.token_ids)
        for j in range(len(prompt.chunks)):
            c = cache.clone()
            lengths.append(_continue(model, c, prompt, j))
            ids += c.token_ids[n_ctx:]
            for i, s in enumerate(c.stores):
                qs[i] = torch.cat([qs[i], torch.cat(s.policy.queries, 2)[:, :, n_ctx:]], 2)
                ks[i] = torch.cat([ks[i], s.keys[:, :, n_ctx:]], 2)
                vs[i] = torch.cat([vs[i], s.values[:, :, n_ctx:]], 2)
        infos = [s.policy.info for s in cache.stores]
        scaling = float(cache.stores[0].policy.scaling)
    cap = Capture(infos, scaling, n_ctx, lengths, qs, ks, vs, ids)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        store_dtype = torch.float16 if qs[0].dtype == torch.float32 else qs[0].dtype
        d = asdict(cap.to(store_dtype, "cpu"))
        d["infos"] = [asdict(i) for i in infos]
        tmp = path.with_suffix(".tmp")
        torch.save(d, tmp)
        tmp.replace(path)
        # replay from what is stored, so a cached and a fresh capture give the same numbers
        cap = cap.to(store_dtype, qs[0].device).to(qs[0].dtype, qs[0].device)
    return cap


# ---------------------------------------------------------------------------------------------------------
# Measurement (shared by the replay and the closed loop)
# ---------------------------------------------------------------------------------------------------------

class Observer:
    """``MethodCache.observer``: keeps every layer's full keys/values (from ``store.last_update``; a clone that
    branches from the context truncates them to its own logical length) and, on every single-query forward of
    the decode phase, compares the method's output with exact attention. Rows: [layer, head, metrics...]."""

    def __init__(self, topk: int, needle: list[int] | None = None):
        self.topk = topk
        self.needle = needle  # logical positions of the needle's tokens (None: no needle metrics, NaN)
        self._needle_t: torch.Tensor | None = None
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.rows: list[torch.Tensor] = []  # [Hkv, 2 + len(METRICS)] per measured (step, layer)
        self.tag: tuple = ()
        self.tags: list[tuple] = []

    def __deepcopy__(self, memo):  # never copied with a cache (MethodCache.clone shares it anyway)
        return self

    def __call__(self, store, query, out, scaling: float) -> None:
        layer = store.policy.info.layer_idx
        nk, nv = store.last_update
        L = nk.shape[2]
        keep = store.seen - L
        if layer in self.k:
            self.k[layer] = torch.cat([self.k[layer][:, :, :keep], nk], 2)
            self.v[layer] = torch.cat([self.v[layer][:, :, :keep], nv], 2)
        else:
            self.k[layer], self.v[layer] = nk, nv
        if store.cache.phase != "decode" or query.shape[2] != 1:
            return
        self.rows.append(self.measure(store, query, out, self.k[layer], self.v[layer], scaling))
        self.tags.append(self.tag + (layer,))

    def measure(self, store, query, out, K, V, scaling: float) -> torch.Tensor:
        policy = store.policy
        b, hq, _, d = query.shape
        hkv, seen = K.shape[1], K.shape[2]
        g = hq // hkv
        w_ = policy.info.sliding_window
        mask = None
        if w_ is not None and seen > w_:
            mask = (torch.arange(seen, device=K.device) >= seen - w_ + 1).view(1, seen)
        exact = sdpa(query, K, V, scaling, mask)  # [B, Hq, 1, Dv], the same kernel full attention uses
        err = (out - exact).float().reshape(b, hkv, -1).norm(dim=-1) / \
            exact.float().reshape(b, hkv, -1).norm(dim=-1).clamp_min(1e-30)
        logits = (query.reshape(b, hkv, g, d) @ K.transpose(-1, -2)).float() * scaling  # [B, Hkv, g, seen]
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        w = torch.softmax(logits, -1).mean(2)  # [B, Hkv, seen]
        att_mask = policy.attended(store)
        pos = store.positions
        att = torch.zeros(b, hkv, seen, dtype=torch.bool, device=K.device)
        att.scatter_(2, pos, torch.ones_like(pos, dtype=torch.bool) if att_mask is None else att_mask)
        k = min(self.topk, seen)
        top = torch.topk(w, k, dim=-1).indices
        recall = att.gather(2, top).float().mean(-1)
        mass = (w * att).sum(-1)
        tokens = att.sum(-1).float() + float(policy.attended_extra())
        per_token = (store.keys.shape[-1] + store.values.shape[-1]) * store.keys.element_size()
        held = torch.full_like(mass, store.n / seen)
        if self.needle:
            if self._needle_t is None or self._needle_t.device != K.device:
                self._needle_t = torch.as_tensor(self.needle, device=K.device, dtype=torch.long)
            nd = self._needle_t
            n_read = att[..., nd].float()  # [B, Hkv, needle tokens]
            n_w = w[..., nd]
            needle = [n_read.mean(-1), n_w.sum(-1), (n_w * n_read).sum(-1)]
        else:
            needle = [torch.full_like(mass, float("nan"))] * 3
        m = torch.stack([err, recall, mass, tokens, tokens * per_token, held, *needle], -1)[0]  # [Hkv, M] (batch 1)
        ids = torch.stack([torch.full((hkv,), float(policy.info.layer_idx), device=m.device),
                           torch.arange(hkv, device=m.device, dtype=torch.float32)], -1)
        return torch.cat([ids, m], -1).cpu()


def replay(method: KVMethod, cap: Capture, topk: int, tag: tuple = (0,), needle: list[int] | None = None
           ) -> Observer:
    """Replay one capture through ``method`` without the model, forward by forward as the runner feeds it: the
    context in the method's prefill chunks (``KVMethod.prefill_chunk``, e.g. LASER-KV's blocks; else at once),
    each forward's token ids announced first (``add_tokens``) and ``after_forward`` after its last layer, then
    ``end_prefill``. No question ids are given (a replay cannot run the scratch forward a question-aware method
    would): LASER-KV is probed question-agnostic. Returns the observer with its rows."""
    from luka_bench.methods.hf import MethodCache, replay_forward

    obs = Observer(topk, needle)
    cache = MethodCache(method, cap.infos, reference_length=cap.context, observer=obs, manual=True)
    n = cap.context

    def one(c: MethodCache, sl: slice) -> None:
        if cap.ids is not None:
            c.add_tokens(cap.ids[sl])
        for i in range(len(cap.infos)):
            replay_forward(c, i, cap.k[i][:, :, sl], cap.v[i][:, :, sl], cap.q[i][:, :, sl], cap.scaling)
        c.after_forward()

    with torch.no_grad():
        step = int(method.prefill_chunk() or 0) or n
        for s in range(0, n, step):
            one(cache, slice(s, min(n, s + step)))
        cache.end_prefill()
        off = n
        for j, lengths in enumerate(cap.lengths):
            c = cache.clone()
            for t, L in enumerate(lengths):
                obs.tag = tag + (j, t)
                one(c, slice(off, off + L))
                off += L
    return obs


@torch.no_grad()
def closed_loop(lm, method: KVMethod, prompt: Prompt, topk: int, tag: tuple = (0,)) -> Observer:
    """Generate with ``method`` attached and measure every decode step against exact attention."""
    from luka_bench.engine import prefill
    from luka_bench.methods.hf import attach

    obs = Observer(topk, prompt.needle)
    with attach(lm.model, method, lm.tokenizer) as att:
        # question-aware methods see every continuation's ids, as the runner gives them every question's
        cache = att.new_cache(observer=obs, question_ids=[t for c in prompt.chunks for t in c] or None)
        prefill(lm.model, prompt.context, cache)
        for j in range(len(prompt.chunks)):
            c = cache.clone()

            def set_tag(t: int, j: int = j) -> None:
                obs.tag = tag + (j, t)

            _steps(lm.model, c, prompt, j, set_tag)
    return obs


# ---------------------------------------------------------------------------------------------------------
# Prompts (a dataset's, as the runner plans them)
# ---------------------------------------------------------------------------------------------------------

def needle_positions(tokenizer, use_chat: bool, task, ex) -> list[int] | None:
    """Token positions (into the context part of the prompt) of the needle of a QA example: ``meta["needle_span"]``
    = (start_char, end_char) in ``ex.context``, on the first question or on the example; None without one."""
    from luka_bench.data.base import evidence_positions

    span = next((q.meta["needle_span"] for q in ex.questions[:1] if "needle_span" in q.meta),
                ex.meta.get("needle_span"))
    if span is None:
        return None
    block = task.context_block(ex)
    shift = block.find(ex.context)  # the context block may wrap the context (an instruction before it)
    if shift < 0:
        from luka_bench.data.base import DataError

        raise DataError(f"example {ex.id!r}: needle_span is given but its context is not in the context block")
    start, end = int(span[0]) + shift, int(span[1]) + shift
    return evidence_positions(tokenizer, use_chat, block, [(start, end)]) or None


def prompts(lm, task, steps: int, questions: int) -> list[Prompt]:
    """The probed prompts of a dataset (``data.limit`` examples / documents): the engine's plan of them
    (``prompting.plan_qa``, the runner's prompts), ``steps`` new tokens reserved."""
    from luka_bench.prompting import plan_qa
    from luka_bench.errors import PromptTooLong

    out = []
    if task.kind == "qa":
        for p in plan_qa(task, lm, steps, max(1, questions), evidence=False):
            out.append(Prompt(str(p.example.id), p.context_ids, [q.ids for q in p.questions], None, steps,
                              needle_positions(lm.tokenizer, lm.chat_template, task, p.example)))
    else:
        for d in task.documents(lm.tokenizer):
            ids = d.meta["ids"]
            if len(ids) <= steps + 1:
                raise PromptTooLong(f"document {d.id!r} has {len(ids)} tokens; probe.steps={steps} needs more "
                                    f"(allowed: probe.steps < {len(ids) - 1})")
            out.append(Prompt(str(d.id), ids[:-steps], [[]], [ids[-steps:]], steps))
    return out

