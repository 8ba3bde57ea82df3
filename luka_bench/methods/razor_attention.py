"""RazorAttention (Tang et al., "RazorAttention: Efficient KV Cache Compression Through Retrieval Heads", ICLR 2025;
no public code from the paper; defaults from Huawei's MindSpore port, ``mindspore-ai/golden-stick``,
``mindspore_gs/sequence_compress/razor_attention/ra_config.py``).

**Retrieval heads**, once per model: the model reads ``score_repeats`` copies of ``score_length`` random tokens (one
forward, exact attention weights in fp32). For a query i in the second copy on, a head's *echo* mass is the weight it
puts on the earlier occurrences of its own token (keys j < i with i - j a multiple of the length) and its *induction*
mass the weight on the tokens right after them (i - j = 1 less than a multiple of the length); a head's score is the
mean over those queries, and a KV head's the max over its group's query heads (as the port). The retrieval heads are
the top ``induction`` share of all scored KV heads (all layers) by induction score, together with the top ``echo``
share by echo score (each at least one head when its share is > 0: ``ceil``). The scores are cached on disk
(``heads_cache``, a JSON keyed by the model's name, config, a fingerprint of its weights and the scoring settings);
``heads_file`` gives the retrieval heads instead (a JSON list of ``[layer, kv_head]`` pairs, or an object with
``"retrieval_heads"``: the cache's own format works).

**After the prefill**, per layer (inside the forward that ends it, right after the layer's attention: one layer's
full cache alive at a time; the retrieval heads are found before that forward), retrieval heads keep their whole
cache. Every other KV head keeps its first
``sink`` tokens, its last ``L = max(local, ceil(N / compression_ratio))`` tokens (N the prompt's tokens; Algorithm
1's buffer length max(S0, N/C); ``compression_ratio: 0`` drops the N/C term, the port's rule) and one
**compensation token** in place of the dropped ones D = [sink, N - L): the mean k^ of their keys (post-RoPE, as
cached) and the mean v^ of their values, weighted |D| in the softmax (paper eq. 4-5: log |D| added to its logit),
so that identical dropped tokens are attended exactly. The compensation token sits in slot ``sink`` (the first
dropped slot) and its bias in a per-token additive mask (``aux`` "razor_bias": 0 held, log |D| the compensation
token, -inf a slot the head dropped). Memory: a layer with no retrieval head keeps only those tokens (physically
evicted, ``KVStore.keep``); a mixed layer's non-retrieval heads stop holding the dropped slots (``KVStore.unhold``,
head-wise budgets: out of ``kv_bytes`` and every count) and the layer is packed (``KVStore.pack``): each head's
tokens in a segment of its own width, the bias carried with them (``methods/packed.py``).

**Decode:** Algorithm 1 compresses the prompt's cache once; generated tokens are appended to every head and kept
(no sliding window during the decode): a step is one SDPA with the layer's bias as its mask, no host sync.

GQA: heads are KV heads (a KV head is a retrieval head when its group's best query head scores high, max).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F

from luka_bench.methods.attention import chunk_mask, exact_attention, group_apply, group_logits, sdpa
from luka_bench.methods.base import KVMethod, LayerInfo, LayerPolicy, MethodConfigError, setting

BIAS = "razor_bias"
HEAD_SHARE = "the share of KV heads made retrieval heads; port: induction 0.14, echo 0.01"


# ------------------------------------------------------------------------------------------------ head scores

def repeated_random_tokens(vocab: int, length: int, repeats: int, seed: int) -> torch.Tensor:
    """``repeats`` copies of ``length`` random token ids (uniform over the vocabulary, from ``seed``): [1, length *
    repeats] int64."""
    x = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))
    return x.repeat(repeats).view(1, -1)


def echo_induction(weights: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Echo and induction scores per head from causal attention weights [H, T, T] over ``length``-token copies: the
    mean over queries i >= length of the weight on keys j < i with (i - j) % length == 0 (echo: earlier occurrences of
    the query's token) and with (i - j) % length == length - 1, i - j >= length - 1 (induction: the token after each
    earlier occurrence). Returns ([H], [H]) fp32."""
    t = weights.shape[-1]
    i = torch.arange(t, device=weights.device)
    dist = i[:, None] - i[None, :]  # [T, T]
    echo = (dist > 0) & (dist % length == 0)
    ind = (dist >= length - 1) & (dist % length == length - 1) & (dist > 0)
    w = weights[:, length:].float()  # queries in the second copy on
    return ((w * echo[length:]).sum(-1).mean(-1), (w * ind[length:]).sum(-1).mean(-1))


class _ScorePolicy(LayerPolicy):
    """The scoring forward's policy: exact attention with explicit fp32 weights, from which it records each query
    head's echo and induction scores and each KV head's (max over its group) in the cache's state."""

    def attend(self, store, query, scaling):
        b, hq, lq, d = query.shape
        k, v = store.keys, store.values
        hkv, n = k.shape[1], k.shape[2]
        g = hq // hkv
        logits = group_logits(query.view(b, hkv, g, lq, d), k, scaling)  # [B, Hkv, g, Lq, n] fp32
        mask = chunk_mask(store, lq, None)
        if mask is None and lq > 1:
            mask = torch.ones(lq, n, dtype=torch.bool, device=query.device).tril(n - lq)
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        w = torch.softmax(logits, dim=-1)
        if lq == n:  # the scoring sequence itself (one forward)
            echo, ind = echo_induction(w[0].reshape(hq, lq, n), self.method.length)
            store.cache.state.setdefault("razor_scores", {})[self.info.layer_idx] = (
                echo.view(hkv, g).amax(1), ind.view(hkv, g).amax(1), echo, ind)
        return group_apply(w, v).view(b, hq, lq, v.shape[-1]).to(query.dtype)


@dataclass
class _HeadScorer(KVMethod):
    """The scoring forward's method (not a config: ``measure_scores`` makes it)."""

    length: int = 256
    name: ClassVar[str] = "razor_head_scores"
    policy_class: ClassVar[type[LayerPolicy]] = _ScorePolicy


@torch.no_grad()
def measure_scores(model, make_cache: Callable[[KVMethod], Any], length: int, repeats: int, seed: int
                   ) -> dict[str, list]:
    """Echo and induction scores of every KV head of ``model``: one forward of ``repeats`` copies of ``length``
    random tokens through a cache ``make_cache(method)`` of the scoring method. Returns {"echo": [layers][kv heads],
    "induction": ...} (a layer the scoring does not reach, a sliding-window layer, gets None)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = repeated_random_tokens(vocab, length, repeats, seed).to(model.device)
    cache = make_cache(_HeadScorer(length=length))
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    got = cache.state.get("razor_scores", {})
    layers = len(cache.stores)
    return {"echo": [got[i][0].tolist() if i in got else None for i in range(layers)],
            "induction": [got[i][1].tolist() if i in got else None for i in range(layers)]}


def top_heads(scores: list, share: float) -> set[tuple[int, int]]:
    """The ``ceil(share * scored heads)`` (layer, KV head) pairs of largest score (a stable sort: ties in layer-major
    order); none when share is 0."""
    flat = [(s, (li, h)) for li, row in enumerate(scores) if row is not None for h, s in enumerate(row)]
    k = math.ceil(share * len(flat) - 1e-9)
    order = sorted(range(len(flat)), key=lambda i: -flat[i][0])  # sorted() is stable
    return {flat[i][1] for i in order[:k]}


def read_heads_file(path: str) -> set[tuple[int, int]]:
    """Retrieval heads from a JSON file: a list of [layer, kv_head] pairs, or an object with "retrieval_heads"."""
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        pairs = data["retrieval_heads"] if isinstance(data, dict) else data
        return {(int(a), int(b)) for a, b in pairs}
    except FileNotFoundError:
        raise MethodConfigError(f"method.heads_file={path!r}: no such file (a JSON list of [layer, kv_head] pairs)") \
            from None
    except (ValueError, KeyError, TypeError) as e:
        raise MethodConfigError(f"method.heads_file={path!r} is not a JSON list of [layer, kv_head] pairs (or an "
                                f"object with 'retrieval_heads'): {e}") from None


def model_key(model, settings: dict) -> str:
    """The disk cache's key of a model's scores: its name, config, a fingerprint of its weights (the first 256 entries
    of its embeddings: a random model has no name of its own) and the scoring settings."""
    cfg = model.config
    w = model.get_input_embeddings().weight.reshape(-1)[:256].detach().float().cpu()
    blob = json.dumps({"name": getattr(cfg, "_name_or_path", ""), "config": cfg.to_json_string(use_diff=True),
                       "weights": w.tolist(), **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


# ------------------------------------------------------------------------------------------------ the policy

class RazorPolicy(LayerPolicy):
    """One layer: after the prefill, its non-retrieval KV heads keep sinks + the local window + one compensation
    token; attention adds the per-token bias (log |D| on the compensation token, -inf on what a head dropped). The
    compression needs only this layer once the retrieval heads are known (found before the forward that ends the
    prefill: ``RazorAttention.compresses_in_forward``), so it runs right after the layer's attention in that forward."""

    layer_local_prefill = True
    stacked_packed = True  # over a packed store its decode step is the packing's exact attention (``attend``)

    def decodes_exactly(self, store) -> bool:
        return not self.dropped  # every head a retrieval head (or nothing dropped): exact attention

    # a layer without retrieval heads (every head's tokens dropped alike, the compensation token's log |D| in the
    # bias): rows of a batch read it as one selection (``stacked.py``, *select*: the bias stacked with the rows)
    stacked_select = True

    def stacked_plan(self, store):
        return "bias" if self.dropped and store.packed is None else None  # (its bias made at the compression)

    def stacked_attend(self, layer, query, scaling):
        """``attend``'s decode step for every row: one SDPA, each row's bias (and -inf on the slots it does not hold).
        The rows are right-aligned (``StackedLayer.aligned``: the policy decides nothing per step), so the bias with
        the slots before each row's first closed is made once per storage (the decode's tokens' bias 0) and read up
        to the rows' last slot: a view, as one row's."""
        b, hq, _, d = query.shape
        hkv = layer.kv.shape[2]
        if "mask" not in layer.state:
            bias = layer.aux[BIAS].to(query.dtype)[:, :, None, :]
            layer.state["mask"] = bias if layer.open_mask is None else bias + layer.open_mask  # [B, Hkv, 1, cap]
        w = layer.fill
        out = F.scaled_dot_product_attention(query.view(b, hkv, hq // hkv, d), layer.kv[0][:, :, :w],
                                             layer.kv[1][:, :, :w], attn_mask=layer.state["mask"][..., :w],
                                             scale=scaling)
        return out.view(b, hq, 1, out.shape[-1])

    def __init__(self, method: "RazorAttention", info: LayerInfo):
        super().__init__(method, info)
        self.retrieval: list[bool] | None = None  # per KV head, set at the prefill
        self.dropped = 0  # |D| of each non-retrieval head (0: nothing dropped, exact attention)

    def compress(self, store, retrieval: list[bool]) -> None:
        m = self.method
        self.retrieval = retrieval
        n, s = store.n, m.sink
        local = m.local if not m.compression_ratio else max(m.local, math.ceil(n / m.compression_ratio))
        stop = n - local
        if stop - s < 1 or all(retrieval):
            return
        d = stop - s
        dev = store.device
        b = store.keys.shape[0]
        other = torch.tensor([not r for r in retrieval], device=dev)[None, :].expand(b, -1)  # [B, Hkv]
        K, V = store.storage()
        sel = other[:, :, None]
        bias = store.aux(BIAS, dtype=K.dtype)
        first = s  # the first slot a non-retrieval head stops holding
        if m.compensation:
            # eq. 4: the compensation token, the mean of the dropped keys and values (fp32 sums), in slot ``sink``
            K[:, :, s] = torch.where(sel, K[:, :, s:stop].float().mean(2).to(K.dtype), K[:, :, s])
            V[:, :, s] = torch.where(sel, V[:, :, s:stop].float().mean(2).to(V.dtype), V[:, :, s])
            bias[:, :, s] = torch.where(other, math.log(d), 0.0).to(K.dtype)  # eq. 5: weighted |D| in the softmax
            first = s + 1
        bias[:, :, first: stop] = torch.where(sel, float("-inf"), 0.0).to(K.dtype)
        if not any(retrieval):  # every head drops the same tokens: evicted for real
            store.keep_ends(first, n - stop)
        else:
            store.unhold(first, stop, other, b * sum(not r for r in retrieval))
            store.pack(bias=BIAS)  # the compressed heads' freed slots leave the storage (``methods/packed.py``)
        self.dropped = d

    def after_prefill(self, store) -> None:
        heads = self.method.retrieval_heads(store.cache)
        li = self.info.layer_idx
        self.compress(store, [(li, h) in heads for h in range(self.info.num_kv_heads)])

    def attend(self, store, query, scaling):
        if not self.dropped or store.packed is not None:  # packed: the bias is the packing's (``exact_attention``)
            return exact_attention(store, query, scaling)
        b, hq, lq, d = query.shape
        hkv = store.keys.shape[1]
        g = hq // hkv
        bias = store.aux(BIAS, dtype=store.keys.dtype)[:, :, None, :]  # [B, Hkv, 1, n]
        if lq == 1:  # a decode step: the group's query heads folded into the query axis, the bias broadcast over them
            out = F.scaled_dot_product_attention(query.view(b, hkv, g, d), store.keys, store.values,
                                                 attn_mask=bias.to(query.dtype), scale=scaling)
            return out.view(b, hq, 1, out.shape[-1])
        mask = bias.repeat_interleave(g, dim=1).to(query.dtype)  # [B, Hq, 1, n]
        causal = chunk_mask(store, lq, None)
        if causal is not None:
            mask = mask.masked_fill(~causal, float("-inf"))
        return sdpa(query, store.keys, store.values, scaling, mask)

    def report(self, store) -> dict[str, float]:
        r = self.retrieval or []
        return {"retrieval_heads": float(sum(r)), "dropped_per_head": float(self.dropped)}


@dataclass
class RazorAttention(KVMethod):
    """induction / echo: shares of all KV heads made retrieval heads by induction / echo score (port: 0.14 / 0.01);
    sink: first tokens a non-retrieval head keeps (4); local: its recent window S0 (local_capacity 256);
    compression_ratio: C of the window max(local, N / C) (0: local only, as the port); compensation: the compensation
    token (use_virtual_token True; false: the dropped tokens are only dropped); score_length / score_repeats / score_seed: the scoring sequence (random tokens,
    repeated); heads_file: retrieval heads given instead (JSON [[layer, kv_head], ...]); heads_cache: folder of the
    scores' disk cache (null: none). ``budget`` must be 1.0: the memory is set by the head shares and the window."""

    budget: float = 1.0
    induction: float = setting(0.14, within="[0, 1]", note=HEAD_SHARE)
    echo: float = setting(0.01, within="[0, 1]", note=HEAD_SHARE)
    sink: int = setting(4, at_least=0)
    local: int = setting(256, at_least=0)
    compression_ratio: float = 5.0
    compensation: bool = setting(True)
    score_length: int = setting(256, at_least=2)
    score_repeats: int = setting(2, at_least=2)
    score_seed: int = setting(0, at_least=0)
    heads_file: str | None = None
    heads_cache: str | None = "~/.cache/luka_bench/razor_heads"
    full_layers: int = 0

    name: ClassVar[str] = "razor_attention"
    policy_class: ClassVar[type[LayerPolicy]] = RazorPolicy

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget != 1.0:
            raise MethodConfigError(f"method.budget={self.budget!r}: razor_attention keeps no fraction of tokens "
                                    "(allowed: 1.0); its memory is set by method.induction, method.echo, method.sink, "
                                    "method.local and method.compression_ratio")
        c = self.compression_ratio
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not (c == 0 or c >= 1):
            raise MethodConfigError(f"method.compression_ratio={c!r} must be 0 (window = method.local only) or >= 1 "
                                    "(the window is max(local, N / compression_ratio))")
        self.compression_ratio = float(c)
        self._given = read_heads_file(self.heads_file) if self.heads_file is not None else None
        self._heads: dict[int, set[tuple[int, int]]] = {}  # id(model) -> retrieval heads

    # -- retrieval heads ----------------------------------------------------------------------------------------
    def retrieval_heads(self, cache) -> set[tuple[int, int]]:
        """The (layer, KV head) pairs that keep their whole cache, for the cache's model: given, cached or measured."""
        if self._given is not None:
            return self._given
        model = cache.model
        if model is None:
            raise MethodConfigError("razor_attention needs the model to find its retrieval heads (a cache made by "
                                    "new_cache(model, method)) or method.heads_file=<JSON of [layer, kv_head] pairs>")
        if id(model) not in self._heads:
            scores = self.scores(model, lambda m: type(cache)(m, [s.policy.info for s in cache.stores], model))
            self._heads[id(model)] = top_heads(scores["induction"], self.induction) | top_heads(scores["echo"],
                                                                                               self.echo)
        return self._heads[id(model)]

    def scores(self, model, make_cache) -> dict[str, list]:
        """Echo and induction scores of the model's KV heads, from the disk cache when it has them."""
        settings = {"length": self.score_length, "repeats": self.score_repeats, "seed": self.score_seed}
        path = None
        if self.heads_cache is not None:
            path = Path(self.heads_cache).expanduser() / f"{model_key(model, settings)}.json"
            if path.is_file():
                return json.loads(path.read_text(encoding="utf-8"))
        got = measure_scores(model, make_cache, self.score_length, self.score_repeats, self.score_seed)
        if path is not None:
            heads = sorted(top_heads(got["induction"], self.induction) | top_heads(got["echo"], self.echo))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**got, "model": getattr(model.config, "_name_or_path", ""), **settings,
                                        "retrieval_heads": [list(h) for h in heads],
                                        "shares": {"induction": self.induction, "echo": self.echo}}),
                            encoding="utf-8")
        return got

    def compresses_in_forward(self, cache) -> bool:
        """Yes: each layer compresses right after its attention in the forward that ends the prefill (one layer's
        full cache alive at a time). The retrieval heads are found first, here, before that forward starts: the
        scoring forward (when neither ``heads_file`` nor the disk cache has them) never runs inside a layer."""
        self.retrieval_heads(cache)
        return True
