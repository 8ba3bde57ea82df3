"""Per-layer method assignment: which method runs on which layers.

Used by LuKA's mixed mode (lined on the outer layers, clustered in the middle), LycheeCluster (full attention
on the first layers), or any experiment such as "H2O on the outer layers, full in the middle". Rules are tried in
order; the first whose ``layers`` matches a layer decides its method; unmatched layers get ``default``.

Layer selectors (``layers``), combined with commas:
- ``all``; ``first:N`` / ``last:N`` with N an integer, a percentage (``first:25%``) or a fraction of the depth
  (``first:8/36``: 8 of every 36 layers, rounded — how LuKA's mixed mode scales from the paper's 36-layer model);
- ``A-B`` (inclusive range), ``K`` (one index), negative indices count from the end (``-1`` = last layer);
- ``type:NAME`` — every layer whose config ``layer_types`` entry is NAME (``sliding_attention``,
  ``full_attention``).

Each rule's method keeps its own settings (budget, ``full_layers`` included): in YAML, point them at one value
with an interpolation such as ``budget: ${method.budget}``. Each layer's policy is what the rule's method would run
there alone (``policies.layer_policy``: its ``full_layers``, sliding windows, its own policy), and every
method-level hook reaches every rule's method: ``after_prefill_cache``, ``after_forward`` and ``bind`` with a view of the
cache whose ``stores`` are that method's layers only (``LayerView``; everything else — the phase, the question,
the per-prompt state, the scratch forward, the timers — is the prompt's cache), in rule order, the default's
last; ``prefill_chunk`` is the chunk size the methods ask for (two different ones are refused). So a question-aware
SnapKV or a LASER-KV on some layers compresses those layers as it does alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from luka_bench.methods.base import KVMethod, LayerInfo, LayerPolicy, MethodConfigError
from luka_bench.methods.full import Full
from luka_bench.methods.policies import layer_policy


def _build(obj: Any) -> Any:
    """A nested method config that Hydra left as a config node (inside a list) is built here."""
    if hasattr(obj, "keys") and "_target_" in obj:
        from hydra.utils import instantiate

        return instantiate(obj)
    return obj


def _count(spec: str, num_layers: int) -> int:
    s = spec.strip()
    if s.endswith("%"):
        return round(float(s[:-1]) / 100.0 * num_layers)
    if "/" in s:
        a, b = s.split("/", 1)
        return round(int(a) / int(b) * num_layers)
    return int(s)


def select_layers(spec: str, num_layers: int, layer_types: list[str] | None = None) -> set[int]:
    """The set of layer indices a selector names (see module docstring)."""
    out: set[int] = set()
    for part in str(spec).split(","):
        p = part.strip()
        try:
            if p == "all":
                out.update(range(num_layers))
            elif p.startswith("first:"):
                out.update(range(min(num_layers, _count(p[6:], num_layers))))
            elif p.startswith("last:"):
                k = min(num_layers, _count(p[5:], num_layers))
                out.update(range(num_layers - k, num_layers))
            elif p.startswith("type:"):
                types = layer_types or ["full_attention"] * num_layers
                out.update(i for i, t in enumerate(types) if t == p[5:])
            elif "-" in p[1:]:
                a, b = p[0] + p[1:].split("-", 1)[0], p[1:].split("-", 1)[1]
                lo, hi = int(a), int(b)
                lo, hi = lo % num_layers if lo < 0 else lo, hi % num_layers if hi < 0 else hi
                out.update(range(lo, min(hi, num_layers - 1) + 1))
            else:
                i = int(p)
                out.add(i % num_layers if i < 0 else i)
        except ValueError:
            raise MethodConfigError(
                f"layer selector {p!r} is not understood; allowed: all, first:N, last:N (N = 8, 25%, 8/36), A-B, "
                "K, type:NAME, joined by commas") from None
    return {i for i in out if 0 <= i < num_layers}


class LayerView:
    """The prompt's cache as one rule's method sees it in its method-level hooks: ``stores`` are the layers that
    method runs on; every other attribute is the prompt's cache's — ``state`` included, which its policies reach
    through their stores too (a method keeps its state under a key of its own)."""

    def __init__(self, cache, method: KVMethod):
        self._cache, self._method = cache, method

    @property
    def stores(self) -> list:
        return [s for s in self._cache.stores if s.policy.method is self._method]

    def __getattr__(self, name: str):
        return getattr(self._cache, name)


@dataclass
class Layered(KVMethod):
    """rules: list of {layers: <selector>, method: <a method config>}; default: the method of other layers."""

    rules: list[Any] = field(default_factory=list)
    default: Any = None

    name: ClassVar[str] = "layered"
    handles_sliding: ClassVar[bool] = True  # each rule's method decides for its layers (``layer_policy``)

    def __post_init__(self) -> None:
        super().__post_init__()
        norm = []
        for r in self.rules:
            layers, method = (r["layers"], r["method"]) if isinstance(r, dict) or hasattr(r, "keys") \
                else (r.layers, r.method)
            method = _build(method)
            if not isinstance(method, KVMethod):
                raise MethodConfigError(f"layer rule {layers!r}: its method must be a method config with a _target_ (and `_convert_: all` on the layered config)")
            select_layers(layers, 8)  # check the syntax now, before any model is loaded
            norm.append((str(layers), method))
        self.rules = norm
        self.default = Full() if self.default is None else _build(self.default)
        if not isinstance(self.default, KVMethod):
            raise MethodConfigError("method.default must be a method config with a _target_")

    def method_for_layer(self, info: LayerInfo, layer_types: list[str] | None = None) -> KVMethod:
        types = layer_types
        if types is None:
            types = ["full_attention"] * info.num_layers
            types[info.layer_idx] = info.layer_type
        for layers, method in self.rules:
            if info.layer_idx in select_layers(layers, info.num_layers, types):
                return method
        return self.default

    def policy_for_layer(self, info: LayerInfo) -> LayerPolicy:
        return layer_policy(self.method_for_layer(info), info)

    def methods(self) -> list[KVMethod]:
        """Every rule's method, in rule order, then the default (each once)."""
        out: list[KVMethod] = []
        for m in [m for _, m in self.rules] + [self.default]:
            if not any(m is o for o in out):
                out.append(m)
        return out

    def _views(self, cache) -> list[tuple[KVMethod, LayerView]]:
        return [(m, LayerView(cache, m)) for m in self.methods()]

    def after_prefill_cache(self, cache) -> None:
        for m, view in self._views(cache):
            m.after_prefill_cache(view)

    def compresses_in_forward(self, cache) -> bool:
        return all(m.compresses_in_forward(view) for m, view in self._views(cache))

    def after_forward(self, cache) -> None:
        for m in self.methods():  # every forward, decode steps too: a view only for a method with the hook
            if type(m).after_forward is not KVMethod.after_forward:
                m.after_forward(LayerView(cache, m))

    def prefill_chunk(self) -> int:
        sizes = {m.prefill_chunk() for m in self.methods()} - {0}
        if len(sizes) > 1:
            raise MethodConfigError(f"the layered methods ask for different prefill chunks {sorted(sizes)}; allowed: "
                                    "one size (set the methods' block sizes equal)")
        return sizes.pop() if sizes else 0

    def assignment(self, infos: list[LayerInfo]) -> list[str]:
        """The method name that runs on each layer (what the tests check and the run records)."""
        types = [i.layer_type for i in infos]
        return [self.method_for_layer(i, types).name for i in infos]

    def bind(self, tokenizer) -> None:
        """The tokenizer reaches every assigned method."""
        self.tokenizer = tokenizer
        for method in self.methods():
            method.bind(tokenizer)
