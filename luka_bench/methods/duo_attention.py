"""DuoAttention (Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads",
2024; reference code mit-han-lab/duo-attention; NVIDIA kvpress ``DuoAttentionPress``).

Every KV head of every layer is either a **retrieval** head (keeps the whole cache) or a **streaming** head (keeps the
first ``sink`` tokens and the last ``recent``). Which is which is learned offline, per model, and shipped as a
pattern: a gate per layer and KV head in ``full_attention_heads.tsv`` (rows = layers, tab-separated columns = KV
heads; the reference's ``attn_patterns/<model>/<run>/`` folder, with ``config.json`` giving its ``sink_size`` and
``recent_size``). The gates are clipped to [0, 1] and binarised: the ``round(head_compression_ratio * layers * heads)``
lowest gates over the whole model are streaming heads (kvpress ``post_init_from_model``: an argsort, here stable).

No pattern is shipped for the offline models: ``pattern_path`` must name a pattern (the tsv or its folder); unset
or missing is a one-line error. ``pattern_seed`` draws uniform gates for the model's shape instead — a synthetic
pattern for smoke tests with no learned meaning (its results are not DuoAttention's).

Memory is freed per head with the store's head-wise budgets: on a layer with both kinds, the streaming heads stop
holding the slots between their sinks and their recent window (``KVStore.unhold``: masked out of their attention,
out of ``kv_bytes`` and the held counts), after the prefill and after every later forward (as the reference's
streaming heads keep a fixed sink + recent cache while decoding; kvpress masks only the prefill's middle), and the
layer is then packed (``KVStore.pack``, ``methods/packed.py``): each streaming head's segment is as wide as its sinks,
its window and its decode room, each retrieval head's as its whole cache — the reference's two caches, in one
storage tensor. A layer of streaming heads only is StreamingLLM's policy with a
capacity of ``sink + recent`` (physically evicted); a layer of retrieval heads only is full attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from luka_bench.methods.base import KVMethod, LayerInfo, LayerPolicy, MethodConfigError, setting
from luka_bench.methods.streaming_llm import StreamingPolicy

PATTERN_FILE = "full_attention_heads.tsv"
KVPRESS_WINDOW = "kvpress: sink 128, recent 256"  # what a streaming head keeps


def load_pattern(path: str | Path) -> torch.Tensor:
    """The gates [layers, KV heads] (float64, clipped to [0, 1]) of a pattern in the reference's format: the tsv file,
    or a folder holding ``full_attention_heads.tsv``."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / PATTERN_FILE
    if not p.is_file():
        raise MethodConfigError(f"method.pattern_path={str(path)!r}: no such file (expected {PATTERN_FILE} or its "
                                "folder, as mit-han-lab/duo-attention's attn_patterns/<model>/<run>/)")
    try:
        rows = [[float(x) for x in line.split("\t")] for line in p.read_text(encoding="utf-8").splitlines()
                if line.strip()]
        gates = torch.tensor(rows, dtype=torch.float64)
    except ValueError as e:  # a non-number, or rows of different lengths
        raise MethodConfigError(f"method.pattern_path={str(path)!r} is not a tab-separated matrix of gates "
                                f"(layers x KV heads): {e}") from None
    if gates.dim() != 2 or gates.numel() == 0:
        raise MethodConfigError(f"method.pattern_path={str(path)!r} is not a tab-separated matrix of gates "
                                "(layers x KV heads)")
    return gates.clamp(0, 1)


def streaming_heads(gates: torch.Tensor, ratio: float) -> torch.Tensor:
    """The streaming heads [layers, KV heads] (bool): the ``round(ratio * gates.numel())`` lowest gates over the whole
    model (a stable sort: equal gates go in layer-major order)."""
    n = round(gates.numel() * ratio)
    mask = torch.zeros(gates.numel(), dtype=torch.bool)
    mask[torch.sort(gates.flatten(), stable=True).indices[:n]] = True
    return mask.view(gates.shape)


class DuoPolicy(StreamingPolicy):
    """One layer: ``full`` (retrieval heads only: exact attention), ``streaming`` (streaming heads only: StreamingLLM at
    capacity ``sink + recent``) or ``mixed`` (each streaming head stops holding what falls between its sinks and its
    recent window, after every forward; slots stay in time order, nothing moves)."""

    # rows of a batch decode a layer stacked (``stacked.py``): a mixed one, packed, is exact attention over the
    # packing, then its streaming heads' windows slide (``_unhold``); a streaming one evicts as StreamingLLM; a
    # full one is exact attention (``decodes_exactly``)
    stacked_packed = True
    stacked_evict = True

    def __init__(self, method, info):
        super().__init__(method, info)
        row = method.streaming_row(info)
        self.row = row
        self.mode = "full" if not any(row) else "streaming" if all(row) else "mixed"
        self.moves_tokens_every_step = self.mode == "streaming"
        self._dropped = method.sink  # mixed: the streaming heads hold no slot in [sink, _dropped)
        self._heads: torch.Tensor | None = None

    def capacity(self, store) -> int:
        if self.mode == "streaming":
            return self.method.sink + self.method.recent
        return super().capacity(store)

    def _unhold(self, store) -> None:
        if store.packed is not None:  # the windows slide in the packed storage
            store.slide_windows()
            return
        target = store.n - self.method.recent
        if target > self._dropped:
            b = store.keys.shape[0]
            if self._heads is None:
                self._heads = torch.tensor(self.row, dtype=torch.bool, device=store.device)[None].expand(b, -1)
            store.unhold(self._dropped, target, self._heads, b * sum(self.row))
            self._dropped = target
            # the streaming heads' freed slots leave the storage: each head group in storage of its own width
            m = self.method
            store.pack(windows=[(m.sink, m.recent) if s else None for s in self.row])

    def after_prefill(self, store) -> None:
        if self.mode == "streaming":
            super().after_prefill(store)
        elif self.mode == "mixed":
            self._unhold(store)

    def after_step(self, store) -> None:
        if self.mode == "streaming":
            super().after_step(store)
        elif self.mode == "mixed":
            self._unhold(store)

    def decodes_exactly(self, store) -> bool:
        return self.mode == "full"

    def stacked_plan(self, store):
        return super().stacked_plan(store) if self.mode == "streaming" else None


@dataclass
class DuoAttention(KVMethod):
    """pattern_path: the learned head pattern (``full_attention_heads.tsv`` or its folder; required unless
    pattern_seed); pattern_seed: synthetic uniform gates from this seed instead (smoke tests only);
    head_compression_ratio: share of all KV heads made streaming (the lowest gates); sink / recent: what a streaming
    head keeps (kvpress and the Llama-3.1-8B pattern's config.json: 128 / 256; the reference README: 64 / 256).
    budget: must stay 1.0 — the memory is set by head_compression_ratio, sink and recent."""

    budget: float = 1.0
    pattern_path: str | None = None
    pattern_seed: int | None = None
    head_compression_ratio: float = setting(0.5, within="[0, 1]",
                                            note="the share of KV heads made streaming; README sparsity 0.5")
    sink: int = setting(128, at_least=0, note=KVPRESS_WINDOW)
    recent: int = setting(256, at_least=0, note=KVPRESS_WINDOW)

    name: ClassVar[str] = "duo_attention"
    policy_class: ClassVar[type[LayerPolicy]] = DuoPolicy
    positions: ClassVar[str] = "original"  # StreamingPolicy's setting: streaming heads keep their positions

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget != 1.0:
            raise MethodConfigError(f"method.budget={self.budget!r}: duo_attention keeps no fraction of tokens (allowed: "
                                    "1.0); its memory is set by method.head_compression_ratio, method.sink and "
                                    "method.recent")
        if (self.pattern_path is None) == (self.pattern_seed is None):
            got = "both are set" if self.pattern_path is not None else "neither is set"
            raise MethodConfigError(f"method.pattern_path / method.pattern_seed: give exactly one ({got}); "
                                    f"pattern_path=<{PATTERN_FILE} or its folder> (DuoAttention's learned heads, "
                                    "mit-han-lab/duo-attention attn_patterns/; none ship for the offline models) or "
                                    "pattern_seed=<int> (synthetic gates, smoke tests only)")
        if self.pattern_seed is not None and (isinstance(self.pattern_seed, bool)
                                              or not isinstance(self.pattern_seed, int)):
            raise MethodConfigError(f"method.pattern_seed={self.pattern_seed!r} must be an integer or null")
        self._gates = load_pattern(self.pattern_path) if self.pattern_path is not None else None
        self._streaming: dict[tuple[int, int], torch.Tensor] = {}

    def gates(self, layers: int, heads: int) -> torch.Tensor:
        """The pattern's gates [layers, KV heads] for a model of that shape (a one-line error if the file's differ)."""
        if self._gates is None:
            return torch.rand(layers, heads, generator=torch.Generator().manual_seed(self.pattern_seed),
                              dtype=torch.float64)
        if tuple(self._gates.shape) != (layers, heads):
            raise MethodConfigError(f"method.pattern_path={self.pattern_path!r} has gates for "
                                    f"{self._gates.shape[0]} layers x {self._gates.shape[1]} KV heads; the model has "
                                    f"{layers} x {heads}: use the pattern learned for this model")
        return self._gates

    def streaming_row(self, info: LayerInfo) -> list[bool]:
        """Which KV heads of this layer are streaming heads."""
        key = (info.num_layers, info.num_kv_heads)
        if key not in self._streaming:
            self._streaming[key] = streaming_heads(self.gates(*key), self.head_compression_ratio)
        return self._streaming[key][info.layer_idx].tolist()

    def check_layer(self, info: LayerInfo) -> None:
        self.streaming_row(info)  # the pattern's shape is checked before any policy is made
