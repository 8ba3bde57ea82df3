"""One layer's attention over rows chosen per KV head, on the CPU: the rows gathered then SDPA (what CUDA runs,
``attention.kv_rows``) against the C++ op reading them in place (``rows_attention``, ``attention.attend_rows``).

The shapes are lychee's decode step at SmolLM2's: 3 KV heads of 3 query heads, head dim 64, 2,048 slots per row and
head, ``--read`` of them read as 16-token chunks in random order; rows stacked as in a batch (``--batches``). Mean
milliseconds per call over ``--calls`` calls after 5 warm-up ones, ``--runs`` times, in one process::

    .venv/bin/python scripts/bench_rows_attention.py --threads 2
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--read", type=int, default=1024, help="rows read per (row, KV head), whole 16-token chunks")
    ap.add_argument("--slots", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    from luka_bench.methods import cpu_kernel
    from luka_bench.methods.attention import attend_rows, kv_rows

    torch.set_num_threads(args.threads)
    if cpu_kernel.rows_attention_op() is None:
        raise SystemExit("the fused CPU kernel is not available here (LUKA_BENCH_NO_KERNEL set, or no compiler)")
    gen = torch.Generator().manual_seed(0)
    H, G, D, cap, T, chunk = 3, 3, 64, args.slots, args.read, 16
    print(f"{H} KV heads x {G} query heads, head dim {D}, {T} of {cap} slots read as {chunk}-token chunks; "
          f"ms per call, mean of {args.calls}, {args.runs} runs, {args.threads} threads")
    for B in (int(b) for b in args.batches.split(",")):
        kv = torch.randn(2, B * H * cap, D, generator=gen)
        first = torch.stack([torch.randperm(cap // chunk, generator=gen)[: T // chunk] for _ in range(B * H)]) * chunk
        idx = (first[:, :, None] + torch.arange(chunk)).view(B, H, T) + (torch.arange(B * H) * cap).view(B, H, 1)
        bias = torch.zeros(B, H, 1, T)
        q = torch.randn(B, H, G, D, generator=gen)

        def gathered():
            rows = kv_rows(kv, idx.view(-1)).view(2, B, H, T, D)
            return F.scaled_dot_product_attention(q, rows[0], rows[1], attn_mask=bias, scale=D ** -0.5)

        def in_place():
            return attend_rows(q, kv, idx, bias, D ** -0.5)

        torch.testing.assert_close(in_place(), gathered(), rtol=1e-4, atol=1e-5)
        times = {"gathered + SDPA": [], "in place": []}
        for _ in range(args.runs):
            for name, f in zip(times, (gathered, in_place)):
                for _ in range(5):
                    f()
                t = time.perf_counter()
                for _ in range(args.calls):
                    f()
                times[name].append((time.perf_counter() - t) / args.calls * 1e3)
        print(f"batch {B}: " + "; ".join(f"{k} {', '.join(f'{x:.3f}' for x in v)}" for k, v in times.items()))


if __name__ == "__main__":
    main()
