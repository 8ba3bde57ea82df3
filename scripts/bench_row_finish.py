"""The memory a batch pays when its rows finish at different steps (issue 60): rows of different lengths are prefilled
alone, then decoded together by ``engine.greedy_decode_rows`` with row b stopping after 2 + 2b tokens, so each step
where a row stops stacks the rest again (``stacked.RowStack``). Prints, as one JSON line, the process's peak resident
growth over the decode's start (the high-water mark reset after the prefill) against the rows' keys and values.

    .venv/bin/python scripts/bench_row_finish.py --method full --length 2048
    MALLOC_MMAP_THRESHOLD_=65536 MKL_DISABLE_FAST_MM=1 .venv/bin/python scripts/bench_row_finish.py   # live bytes

Under the second line (``scripts/bench_memory.py``'s rule) every block above 64 KiB is its own mapping, so the resident
memory follows the bytes in use; without it a process's heap keeps freed blocks below glibc's threshold resident.
SmolLM2-135M on the CPU, the essays of ``data/pg19`` as text (offline)."""
from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="full")
    ap.add_argument("--length", type=int, default=2048, help="the longest row's prompt; row b has 37 b fewer")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    import torch

    import luka_bench as lb
    from luka_bench.data.pg19 import essays_text
    from luka_bench.device import memory_mark, peak_growth, release_memory
    from luka_bench.engine import greedy_decode_rows, prefill

    torch.set_num_threads(a.threads)
    lm = lb.load_model("smollm2_135m")
    ids = lm.tokenizer(essays_text(), add_special_tokens=False).input_ids
    lengths = [a.length - 37 * b for b in range(a.rows)]
    if min(lengths) < 1 or 1000 * (a.rows - 1) + a.length > len(ids):
        raise SystemExit(f"--length {a.length} with --rows {a.rows}: allowed: rows of 1 to "
                         f"{len(ids) - 1000 * (a.rows - 1)} tokens")
    prompts = [ids[1000 * b: 1000 * b + n] for b, n in enumerate(lengths)]
    with lb.attach(lm.model, lb.method(a.method), lm.tokenizer) as kv, torch.no_grad():
        caches, logits = [], []
        for p in prompts:
            c = kv.new_cache(reference_length=len(p))
            logits.append(prefill(lm.model, p, c))
            caches.append(c)
        held = sum(s._kv.nbytes for c in caches for s in c.stores if s._kv is not None)
        release_memory()
        mark = memory_mark("cpu")  # the resident high-water mark reset
        t = time.perf_counter()
        gens = greedy_decode_rows(lm.model, None, caches, torch.stack(logits), [2 + 2 * b for b in range(a.rows)],
                                  set(), ())
        seconds = time.perf_counter() - t
        growth = peak_growth("cpu", mark)
    print(json.dumps({"method": a.method, "rows": lengths, "kv_storage_mib": round(held / 2**20, 1),
                      "peak_growth_mib": round(growth / 2**20, 1), "decode_s": round(seconds, 2),
                      "tokens": [len(g.token_ids) for g in gens]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
