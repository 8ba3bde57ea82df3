"""The allocation check of every method config (issue 61): what a cache allocates against what its method reports
and declares (``luka_bench.methods.owned``), after a 400-token prefill and after 32 decode steps, on a tiny random
model (CPU; the configs scaled as the host-sync check scales them). Prints a markdown table and, for each row over
the 5 % tolerance, its largest allocations with their paths. The test is tests/test_allocation.py.

    .venv/bin/python scripts/allocation_check.py                  # every conf/method config
    .venv/bin/python scripts/allocation_check.py duo_attention adakv
"""
from __future__ import annotations

import argparse
from pathlib import Path

from hydra.utils import instantiate

from luka_bench.host_sync import sync_method_config
from luka_bench.methods.owned import check
from luka_bench.models import TinyRandomModel

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    """``scripts/allocation_check.py [names...]``: the allocation check of every ``conf/method`` config (or
    the named ones) on a tiny random model (the configs scaled as ``host_sync.sync_method_config``), a table of
    allocated / declared after the prefill and after the decode steps, and the largest allocations of a row over
    the 5 % tolerance."""
    root = ROOT / "conf" / "method"
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("names", nargs="*", default=sorted(p.stem for p in root.glob("*.yaml")))
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args(argv)
    lm = TinyRandomModel(name="tiny_gqa3", arch="llama", num_hidden_layers=3, num_attention_heads=6,
                         num_key_value_heads=2, hidden_size=96, device="cpu").load()
    print("| method | allocated / declared after the prefill | after the decode steps | KV reported (B) |")
    print("|---|--:|--:|--:|")
    over = []
    for name in a.names:
        pre, dec, _ = check(lm.model, instantiate(sync_method_config(name), _convert_="all"), a.prompt, a.steps,
                             tokenizer=lm.tokenizer)
        print(f"| {name} | {pre['ratio']:.3f} | {dec['ratio']:.3f} | {dec['reported']} |")
        if max(pre["ratio"], dec["ratio"]) > 1.05:
            over.append((name, dec))
    for name, d in over:
        excess = {k: v for k, v in d["owners"].items() if v[0] > v[1]}
        print(f"\n{name}: allocated over declared: " + "; ".join(f"{k} {a} > {b}" for k, (a, b) in excess.items()))
        print("  largest: " + "; ".join(f"{p} {b}" for p, b in d["largest"][:6]))
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
