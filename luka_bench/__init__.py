"""luka_bench: KV-cache methods on Hugging Face causal LMs, as a library and a benchmark.

    import luka_bench as lb
    lm = lb.load_model("smollm2_135m")
    with lb.attach(lm, lb.method("snapkv", budget=0.125)) as kv:
        print(kv.generate(context, question="...").text)

The names below are imported on first use: ``import luka_bench`` itself loads nothing heavy (the command line
checks its arguments before torch loads).
"""
from __future__ import annotations

__all__ = ["load_model", "method", "attach", "KV", "Answer"]


def __getattr__(name: str):
    if name in __all__:
        from luka_bench import api

        return getattr(api, name)
    raise AttributeError(f"module 'luka_bench' has no attribute {name!r}")
