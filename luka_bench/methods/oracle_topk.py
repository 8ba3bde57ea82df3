"""Oracle top-k attention: the ceiling for any method that reads ``token_budget`` held tokens per decode step.

Not a method from a paper: the reference that says whether a sparse method's loss is *selection* (it did not
read the tokens it could have read) or *budget* (no set of that size answers). At every decode step and layer
the policy computes the exact attention weights of this step's query over every held token, takes per KV head
the ``token_budget`` tokens with the largest weight (the weights of the group's query heads summed: GQA, one
selection per KV head, as the sparse methods select), and attends exactly over those, everything else masked.
``sink`` first tokens and ``recent`` newest tokens are always read (they count against ``token_budget``), and
``full_layers`` first layers read everything (to match LycheeCluster's full first layers when comparing at the
same tokens read per step).

Budget semantics (as ``lychee``'s ``token_budget``): every raw token is held (``budget`` must be 1.0); what is
rationed is the tokens *read* per decode step, per layer and KV head. The prefill and multi-token chunks (the
question) are exact, as in ``lychee``; a layer holding at most ``token_budget`` tokens is exact too (= full).
``attended`` reports exactly the tokens read.

Shapes: query [B, Hq, 1, D]; keys/values [B, Hkv, n, D]; selection mask [B, Hkv, n]. Everything on the decode
path is tensor ops (one softmax for the scores, ``topk``, one softmax over the read tokens for the output): no
host sync; 8 kernel launches per layer and step over stock transformers (``luka_bench.launches``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from luka_bench.methods.base import KVMethod, LayerInfo, LayerPolicy, MethodConfigError, setting
from luka_bench.methods.attention import exact_attention, group_logits, sdpa


def oracle_topk_select(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, k: int,
                       sink: int = 0, recent: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode path of ``oracle_topk_attention``: (output [B, Hq, 1, Dv], the read tokens' indices [B, Hkv,
    min(k, n)]). Issue 36 (kernel launches per step): the scaled logits in one ``baddbmm`` (fp32: the scaling
    inside the GEMM instead of a ``mul_`` after it), and the output from the ``k`` read tokens only — their keys
    and values gathered, one SDPA over them (= the softmax over all held tokens with the others masked, without
    building the mask) — so no [B, Hkv, n] mask is made on the step; ``read_mask`` builds it from the indices
    when someone asks (the probe)."""
    b, hq, lq, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    g = hq // hkv
    q = query.view(b, hkv, g, lq, d)
    logits = group_logits(q, keys, scaling)  # [B, Hkv, g, 1, n] fp32 (fp32 inputs: the scaling inside the GEMM)
    score = torch.softmax(logits, dim=-1).sum(dim=(2, 3))  # [B, Hkv, n]: the group's true weights summed
    if sink or recent:
        j = torch.arange(n, device=keys.device)
        forced = (j < sink) | (j >= n - recent)
        score = score.masked_fill(forced, float("inf"))
    m = min(k, n)
    top = torch.topk(score, m, dim=-1).indices  # [B, Hkv, m]
    # the output: the read tokens' keys and values gathered and one SDPA over them (= the softmax over all held
    # tokens with the others masked); one op fewer than gathering their logits for a softmax and a matmul
    ksel = keys.gather(2, top[..., None].expand(b, hkv, m, d))  # [B, Hkv, m, D]
    vsel = values.gather(2, top[..., None].expand(b, hkv, m, values.shape[-1]))  # [B, Hkv, m, Dv]
    return sdpa(query, ksel, vsel, scaling), top


def read_mask(top: torch.Tensor, n: int) -> torch.Tensor:
    """[B, Hkv, n] boolean: True at the indices ``top`` [B, Hkv, m]."""
    b, h = top.shape[:2]
    return torch.zeros(b, h, n, dtype=torch.bool, device=top.device).scatter_(2, top, True)


def oracle_topk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, k: int,
                          sink: int = 0, recent: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query [B, Hq, 1, D] over keys/values [B, Hkv, n, D] (held tokens in time order, n > 0).

    Per KV head: the score of token j is sum over the group's query heads of softmax(q_h . K * scaling)_j (the
    true attention weight); the ``k`` tokens with the largest score (``sink`` first and ``recent`` last tokens
    forced in, counted in ``k``) are read, with an fp32 softmax over them alone. Returns (output [B, Hq, 1, Dv],
    read mask [B, Hkv, n] with exactly min(k, n) True per head)."""
    out, top = oracle_topk_select(query, keys, values, scaling, k, sink, recent)
    return out, read_mask(top, keys.shape[2])


class OracleTopKPolicy(LayerPolicy):
    static_decode = True  # a decode step over the store's whole capacity, free slots masked (``_static_select``)

    def __init__(self, method: "OracleTopK", info: LayerInfo):
        super().__init__(method, info)
        self.top: torch.Tensor | None = None  # the last decode step's read indices (None: it read everything)
        self.n_read = 0  # tokens held at that step (the mask's length)

    def attend(self, store, query, scaling):
        self.top = None
        return exact_attention(store, query, scaling)

    def step(self, store, query, scaling, step):
        m = self.method
        if store.n <= m.token_budget:
            return self.attend(store, query, scaling)
        slot = step.slot(store)
        if m.sink or m.recent or slot is None:
            out, self.top = oracle_topk_select(query, store.keys, store.values, scaling, m.token_budget, m.sink,
                                               m.recent)
        else:
            b, hkv, cap = store.storage()[0].shape[:3]
            free = step.held_mask(store, "storage", cap, store.n, b * hkv, query.dtype)  # [B * Hkv, 1, cap]
            out, self.top = self._static_select(store, query, scaling, free)
        self.n_read = store.n
        return out

    def _static_select(self, store, query, scaling, bias: torch.Tensor, storage: tuple | None = None):
        """``oracle_topk_select`` over the store's whole capacity (``KVStore.storage``): the free slots masked by
        an additive bias that the logits GEMM adds itself (``baddbmm`` with beta 1) and that one op per step opens
        at the new token's slot for all layers (``bias``: ``DecodeStep.held_mask``), and again on the scores so
        that top-k never reads a free slot. Same tokens read and the same output as over the held tokens alone
        (tested), on shapes that stay fixed from step to step until the storage grows: the graph-ready steady
        state, for 1.25 kernels more per layer on the launch counter's 4-layer model."""
        m = self.method
        K, V = store.storage() if storage is None else storage  # a row's, or stacked rows' (``stacked_attend``)
        b, hq, _, d = query.shape
        hkv, cap = K.shape[1], K.shape[2]
        g, bh = hq // hkv, b * hkv
        logits = torch.baddbmm(bias, query.reshape(bh, g, d), K.reshape(bh, cap, d).transpose(1, 2),
                               alpha=scaling).float()  # [B*Hkv, g, cap]
        score = torch.softmax(logits, dim=-1).sum(1) + bias.view(bh, cap)  # free slots: -inf
        top = torch.topk(score, m.token_budget, dim=-1).indices.view(b, hkv, m.token_budget)
        ksel = K.gather(2, top[..., None].expand(b, hkv, m.token_budget, d))
        vsel = V.gather(2, top[..., None].expand(b, hkv, m.token_budget, V.shape[-1]))
        return sdpa(query, ksel, vsel, scaling), top

    # -- stacked rows of a batch (``stacked.py``): ``_static_select`` for every row at once ------------------------
    stacked_select = True

    def stacked_plan(self, store):
        """"sparse" where ``step`` reads the top ``token_budget`` (no sinks or recent window forced in: their path
        is per row), "dense" where it reads everything."""
        m = self.method
        if store.n <= m.token_budget:
            return "dense"
        return None if m.sink or m.recent else "sparse"

    def stacked_attend(self, layer, query, scaling):
        b, hq = query.shape[:2]
        hkv, cap = layer.kv.shape[2], layer.kv.shape[3]
        if layer.plans[0] == "dense":
            return layer.exact_step(query, scaling, top=None)
        bias = layer.layout.mask.view(b * hkv, 1, cap)  # each row's free slots: -inf (the rows' mask per KV head)
        out, top = self._static_select(None, query, scaling, bias, (layer.kv[0], layer.kv[1]))
        for i, s in enumerate(layer.stores):
            s.policy.top, s.policy.n_read = top[i: i + 1], s.n
        return out

    @property
    def read(self) -> torch.Tensor | None:
        """The last decode step's read mask [B, Hkv, n] (None: it read everything), built when asked."""
        return None if self.top is None else read_mask(self.top, self.n_read)

    def attended(self, store):
        return self.read

    def attended_count(self, store) -> float:
        return float(store.n) if self.top is None else float(min(self.method.token_budget, store.n))


@dataclass
class OracleTopK(KVMethod):
    """token_budget: held tokens read per decode step, per layer and KV head (the true top-k of this step's
    attention; sinks and recent window included); sink: first tokens always read; recent: newest tokens always
    read; full_layers: first layers with full attention. ``budget`` must be 1.0: every raw token is held."""

    budget: float = setting(1.0, holds_every_token="the tokens read per step are method.token_budget")
    token_budget: int = setting(1024, at_least=1)
    sink: int = setting(0, at_least=0)
    recent: int = setting(0, at_least=0)
    full_layers: int = 0

    name: ClassVar[str] = "oracle_topk"
    policy_class: ClassVar[type[LayerPolicy]] = OracleTopKPolicy

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sink + self.recent > self.token_budget:
            raise MethodConfigError(
                f"method.sink + method.recent = {self.sink + self.recent} exceeds method.token_budget="
                f"{self.token_budget}; allowed: sink + recent <= token_budget (they are read out of it)")

