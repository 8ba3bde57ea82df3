"""Per-layer compression inside the prefill (issue 50): a layer-local method compresses each layer right after its
attention in the forward that ends the prefill, so one layer's full cache is alive at a time — and keeps exactly the
tokens it keeps when it compresses after the whole forward."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from luka_bench.methods.adakv import AdaKV
from luka_bench.methods.duo_attention import DuoAttention
from luka_bench.methods.entropy_ols import EntropyOLS
from luka_bench.methods.expected_attention import ExpectedAttention
from luka_bench.methods.full import Full
from luka_bench.methods.h2o import H2O
from luka_bench.methods.hf import attach
from luka_bench.methods.knorm import KNorm
from luka_bench.methods.laser_kv import LaserKV
from luka_bench.methods.layered import Layered
from luka_bench.methods.pyramidkv import PyramidKV
from luka_bench.methods.razor_attention import RazorAttention
from luka_bench.methods.snapkv import SnapKV
from luka_bench.methods.streaming_llm import StreamingLLM
from luka_bench.methods.tova import TOVA

N, STEPS = 120, 6

METHODS = {
    "snapkv": lambda: SnapKV(budget=0.2, window=8),
    "streaming_llm": lambda: StreamingLLM(budget=0.2),
    "streaming_llm_cache_positions": lambda: StreamingLLM(budget=0.2, positions="cache"),
    "h2o": lambda: H2O(budget=0.2),
    "h2o_on_top": lambda: H2O(budget=0.2, recent_budget="on_top", min_recent=8, recent_fraction=0.0),
    "knorm": lambda: KNorm(budget=0.2),
    "entropy_ols": lambda: EntropyOLS(budget=0.25, bin_size=8, rank=2),
    "knorm_full_layers": lambda: KNorm(budget=0.2, full_layers=1),
    "tova_once": lambda: TOVA(budget=0.2, decode=False),
    "expected_attention": lambda: ExpectedAttention(budget=0.2),
    "pyramidkv": lambda: PyramidKV(budget=0.2, window=8, beta=4),
    "adakv": lambda: AdaKV(budget=0.2, window=8),
    "duo_attention": lambda: DuoAttention(pattern_seed=0, sink=2, recent=8),
    # retrieval heads measured (a scoring forward before the prefill's, never inside a layer): mixed layers
    "razor_attention": lambda: RazorAttention(sink=2, local=16, compression_ratio=0, heads_cache=None,
                                              score_length=16),
    # no retrieval head: every layer evicts for real
    "razor_no_retrieval": lambda: RazorAttention(sink=2, local=16, compression_ratio=0, induction=0.0, echo=0.0,
                                                 heads_cache=None, score_length=16),
    "layered": lambda: Layered(rules=[{"layers": "0", "method": SnapKV(budget=0.2, window=8)}],
                               default=KNorm(budget=0.3)),
}


def run(model, method, ids, manual: bool, question_ids=None):
    """Prefill ids[:N] (compressed inside the forward unless ``manual``), then STEPS teacher-forced tokens."""
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=N, manual=manual, question_ids=question_ids)
        out = [model(ids[:, :N], past_key_values=c).logits[:, -1:]]
        if manual:
            c.end_prefill()
        inside = [s.compressed_in_forward for s in c.stores]
        held = [s.positions[0].clone() for s in c.stores]
        for t in range(N, N + STEPS):
            out.append(model(ids[:, t: t + 1], past_key_values=c).logits)
    return torch.cat(out, 1), held, inside, c


@pytest.mark.parametrize("name", sorted(METHODS))
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gqa3"])
def test_compressing_inside_the_prefill_keeps_the_same_tokens_bit_for_bit(name, arch, request):
    model = request.getfixturevalue(arch).model
    ids = torch.randint(0, 256, (1, N + STEPS), generator=torch.Generator().manual_seed(11))
    after, held_after, inside_after, _ = run(model, METHODS[name](), ids, manual=True)
    inside, held_inside, flags, cache = run(model, METHODS[name](), ids, manual=False)
    assert not any(inside_after)
    assert any(flags), "no layer compressed inside the prefill's forward"
    assert all(s.held_per_head() < N for s, f in zip(cache.stores, flags) if f)
    for a, b in zip(held_after, held_inside):
        assert torch.equal(a, b)
    assert torch.equal(after, inside)


def full_layers_alive(model, method, question_ids=None, prefill_chunk: int = 0) -> int:
    """The largest number of layers holding a full-length cache at once during one prefill: before each decoder
    layer runs, the earlier layers still at full length, plus the one about to fill. With ``prefill_chunk``: the
    largest number of layers holding every token of the prefill so far (nothing dropped yet), before and after
    each decoder layer's forward of each chunk."""
    ids = torch.randint(0, 256, (1, N), generator=torch.Generator().manual_seed(12))
    most = [0]
    with attach(model, method) as a, torch.no_grad():
        c = a.new_cache(reference_length=N, question_ids=question_ids, prefill_chunk=prefill_chunk)

        def count(module, *args):
            if c.phase != "prefill":  # not the question's scratch forward after it
                return
            if prefill_chunk:
                most[0] = max(most[0], sum(0 < s.seen == s.n for s in c.stores))
            else:
                most[0] = max(most[0], 1 + sum(s.seen == N and s.n == N for s in c.stores))

        hooks = [layer.register_forward_pre_hook(count) for layer in model.model.layers]
        if prefill_chunk:
            hooks += [layer.register_forward_hook(count) for layer in model.model.layers]
        try:
            model(ids, past_key_values=c)
        finally:
            for h in hooks:
                h.remove()
    return most[0]


@pytest.mark.parametrize("name", ["snapkv", "streaming_llm", "h2o", "knorm", "entropy_ols", "razor_no_retrieval",
                                  "tova_once", "expected_attention", "pyramidkv", "adakv"])
def test_one_full_layer_cache_at_a_time_during_a_compressing_prefill(name, tiny_llama):
    model = tiny_llama.model
    layers = model.config.num_hidden_layers
    assert full_layers_alive(model, Full()) == layers  # full attention holds every layer's, as it must
    assert full_layers_alive(model, METHODS[name]()) == 1


@pytest.mark.parametrize("name", ["snapkv", "streaming_llm", "h2o", "knorm", "entropy_ols", "razor_no_retrieval",
                                  "tova_once", "expected_attention", "pyramidkv", "adakv"])
def test_a_chunked_prefill_holds_one_full_layer_cache_at_a_time(name, tiny_llama):
    """With ``prefill_chunk`` the chunks go through the model layer by layer (``hf._layer_major``): every chunk
    through a layer, which the last one compresses, before any enters the next — one layer holds the whole prefill
    at a time, as without chunks (chunk by chunk through every layer, all of them would until the last chunk)."""
    model = tiny_llama.model
    layers = model.config.num_hidden_layers
    assert full_layers_alive(model, Full(), prefill_chunk=32) == layers
    assert full_layers_alive(model, METHODS[name](), prefill_chunk=32) == 1


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_layer_major_prefill_equals_the_chunk_by_chunk_one_bit_for_bit(name, tiny_gqa3):
    """The same computation per layer in the same order: the same tokens kept, the same logits after it, as the
    prefill that runs each chunk through every layer (``layer_major=False``)."""
    model = tiny_gqa3.model
    ids = torch.randint(0, 256, (1, N + STEPS), generator=torch.Generator().manual_seed(13))
    runs = []
    for layer_major in (True, False):
        with attach(model, METHODS[name]()) as a, torch.no_grad():
            c = a.new_cache(reference_length=N, prefill_chunk=32, layer_major=layer_major)
            out = [model(ids[:, :N], past_key_values=c).logits[:, -1:]]
            held = [s.positions[0].clone() for s in c.stores]
            for t in range(N, N + STEPS):
                out.append(model(ids[:, t: t + 1], past_key_values=c).logits)
        runs.append((torch.cat(out, 1), held, c.layer_major))
    (a_out, a_held, a_lm), (b_out, b_held, b_lm) = runs
    assert a_lm == (name != "layered") and not b_lm  # Layered forwards after_forward: chunk by chunk
    assert torch.equal(a_out, b_out)
    assert all(torch.equal(x, y) for x, y in zip(a_held, b_held))


def test_a_failing_chunk_of_a_layer_major_prefill_stops_it_in_one_error(tiny_llama):
    """A leading chunk's forward that raises stops the prefill with that error (no thread left waiting), and the
    model works afterwards."""
    model = tiny_llama.model
    ids = torch.randint(0, 256, (1, N), generator=torch.Generator().manual_seed(14))
    layer = model.model.layers[1]
    calls = [0]

    def boom(module, args):
        calls[0] += 1
        if calls[0] == 2:  # the second chunk's forward through layer 1
            raise ValueError("boom")

    h = layer.register_forward_pre_hook(boom)
    try:
        with attach(model, SnapKV(budget=0.2, window=8)) as a, torch.no_grad():
            with pytest.raises(RuntimeError, match="another chunk's forward failed") as err:
                model(ids, past_key_values=a.new_cache(reference_length=N, prefill_chunk=32))
            assert isinstance(err.value.__cause__, ValueError)
    finally:
        h.remove()
    left = [f for f in (*layer._forward_pre_hooks.values(), *layer._forward_hooks.values())
            if f.__module__ == "luka_bench.methods.hf"]  # transformers may keep hooks of its own there
    assert not left
    with attach(model, SnapKV(budget=0.2, window=8)) as a, torch.no_grad():
        c = a.new_cache(reference_length=N, prefill_chunk=32)
        model(ids, past_key_values=c)
        assert c.layer_major and c.phase == "decode"


def test_methods_that_need_the_whole_prefill_keep_it_and_say_so(tiny_llama):
    """Question-aware SnapKV (its question runs through every uncompressed layer after the prefill) and LASER-KV
    (cross-layer scores) compress after the forward: every layer is full at the end of it."""
    model = tiny_llama.model
    layers = model.config.num_hidden_layers
    aware = SnapKV(budget=0.2, window=8, question_aware=True)
    assert not aware.compresses_in_forward(type("C", (), {"question_ids": [5, 6]})())
    assert full_layers_alive(model, aware, question_ids=[5, 6, 7]) == layers
    assert full_layers_alive(model, SnapKV(budget=0.2, window=8, question_aware=True)) == 1  # no question: local
    assert full_layers_alive(model, LaserKV(budget=0.25, block_size=N, divisor=4)) == layers


def test_every_qa_run_records_its_prefill_peak(tmp_path):
    """The prefill's peak growth (CPU: the process's resident set over what it held before the prefill) reaches
    every record and metrics.json, beside kv_bytes."""
    from conftest import compose
    from luka_bench import run as R
    from test_run import read_jsonl

    out = R.run(compose("model=tiny_llama", "method=snapkv", "data.limit=1", "max_new_tokens=2", "progress=false"),
                tmp_path)
    recs = read_jsonl(tmp_path / "predictions.jsonl")
    assert recs and all(isinstance(r["prefill_peak_growth_bytes"], int) and r["prefill_peak_growth_bytes"] >= 0
                        for r in recs)
    assert out["prefill_peak_growth_bytes"] == max(r["prefill_peak_growth_bytes"] for r in recs)


def test_the_peak_growth_of_a_span_is_measured_on_the_cpu():
    """In a fresh process: in this one, earlier tests leave freed memory resident in the allocator's heap, which a
    new tensor may reuse without the RSS growing (a CI run measured 15 MB for these 64 MiB)."""
    import subprocess
    import sys

    code = ("import torch; from luka_bench import device as D; mark = D.memory_mark('cpu'); "
            "x = torch.ones(64 << 20, dtype=torch.uint8); del x; print(D.peak_growth('cpu', mark))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert int(out.stdout.split()[-1]) >= 60 << 20  # 64 MiB, touched


def test_a_long_chunk_after_a_prefix_attends_in_query_blocks_with_small_masks(monkeypatch):
    """A prefill chunk after a prefix (the second chunk of a chunked prefill) attends exactly as one SDPA call with
    the chunk's causal mask, but no mask it makes covers more than ``MASK_BLOCK_ELEMENTS`` (query, key) pairs: a
    whole [Lq, n] boolean mask and SDPA's float copy of it were 0.8 GB at 8,192 queries over 16,384 keys."""
    import torch.nn.functional as F

    from luka_bench.methods import attention as A

    class Held:
        def __init__(self, k, v):
            self.keys, self.values, self.n = k, v, k.shape[2]

    gen = torch.Generator().manual_seed(0)
    lq, n = 300, 700
    q, k, v = torch.randn(1, 6, lq, 16, generator=gen), *(torch.randn(1, 2, n, 16, generator=gen) for _ in range(2))
    causal = torch.arange(n)[None, :] <= torch.arange(n - lq, n)[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=0.25, enable_gqa=True)
    monkeypatch.setattr(A, "MASK_BLOCK_ELEMENTS", 20_000)
    masks, sdpa = [], F.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kw):
        masks.append(0 if attn_mask is None else attn_mask.numel())
        return sdpa(*args, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    got = A.exact_attention(Held(k, v), q, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(masks) == -(-lq // (20_000 // n)) and 0 < max(masks) <= 20_000


def test_the_tensors_peak_counts_what_is_alive_at_once():
    """``bench_memory.tensor_peak`` (the CPU's counterpart of CUDA's allocator peak): two 4 MB tensors alive
    together count 8 MB; made one after the other (the first freed), 4 MB; what was alive before is not counted."""
    from conftest import load_script

    bench = load_script("bench_memory")
    before = torch.ones(1 << 20)  # alive before: not counted

    def together():
        a, b = torch.ones(1 << 20), torch.ones(1 << 20)
        return a.sum() + b.sum()

    def in_turn():
        s = torch.ones(1 << 20).sum()
        return s + torch.ones(1 << 20).sum()

    mb = 4 << 20
    assert 2 * mb <= bench.tensor_peak(together) < 2 * mb + (64 << 10)
    assert mb <= bench.tensor_peak(in_turn) < mb + (64 << 10)
    assert before.numel() == 1 << 20


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gqa3"])
def test_a_compressing_prefill_peaks_below_full_attention_in_tensors(arch, request):
    """The tensors alive at once during a prefill and two steps: a method compressing each layer inside the prefill
    peaks below full attention (one layer's full cache at a time, not all of them) and below itself compressing after
    the whole forward (``manual``: every layer's full cache alive at its end)."""
    from conftest import load_script

    bench = load_script("bench_memory")
    model = request.getfixturevalue(arch).model
    ids = torch.randint(0, 256, (1, 400 + 2), generator=torch.Generator().manual_seed(5))

    def peak(method, manual=False):
        def go():
            with attach(model, method) as a, torch.no_grad():
                c = a.new_cache(reference_length=400, manual=manual)
                model(ids[:, :400], past_key_values=c)
                if manual:
                    c.end_prefill()
                for t in (400, 401):
                    model(ids[:, t: t + 1], past_key_values=c)
        go()  # warm
        return bench.tensor_peak(go)

    full = peak(Full())
    for make in (lambda: SnapKV(budget=0.1, window=8), lambda: StreamingLLM(budget=0.1)):
        inside, after = peak(make()), peak(make(), manual=True)
        assert inside < 0.9 * after and after <= full * 1.05, (inside, after, full)


def test_the_kvpress_side_tokenizes_the_text_and_must_get_our_ids(tmp_path, smollm2_tokenizer):
    """``bench_memory``'s kvpress child tokenizes the essays' text itself (its heap then has the history ours has):
    the ids it gets are ours, read back from the file; other ids stop the measurement with the file named."""
    import json

    from conftest import load_script

    bench = load_script("bench_memory")
    text = "Sixteen essays, one prompt.\n\nThe same ids on both sides."
    (tmp_path / bench.TEXT).write_text(text, encoding="utf-8")
    ids = smollm2_tokenizer(text, add_special_tokens=False).input_ids
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(ids))
    assert bench.tokenized_as_ours(smollm2_tokenizer, str(ids_file)) == ids
    ids_file.write_text(json.dumps(ids[:-1] + [ids[-1] + 1]))
    with pytest.raises(SystemExit, match="ids.json: the kvpress side's tokenizer gives other ids"):
        bench.tokenized_as_ours(smollm2_tokenizer, str(ids_file))


def test_the_table_names_compressing_methods_above_full_and_not_those_holding_every_token():
    """``bench_memory.table``: a held-KV column (a row's KV after the prefill over full attention's) and, per N, the
    compressing methods (held < 1) whose peak is above full's; a method holding every token above full is not one."""
    from conftest import load_script

    bench = load_script("bench_memory")

    def row(method, n, median, kv, full_kv=1000):
        return {"method": method, "n": n, "median": median, "min": median, "max": median, "tensor_median": None,
                "kv_bytes": kv, "kv_bytes_full": full_kv}

    rows = [row("full", 8, 100e6, 1000), row("snapkv", 8, 101e6, 125), row("lychee", 8, 105e6, 1130),
            row("full", 16, 200e6, 2000, 2000), row("snapkv", 16, 90e6, 250, 2000),
            {**row("kvpress:snapkv", 16, 95e6, 250), "kv_bytes_full": None}]
    md = bench.table(rows, ["full", "snapkv", "lychee", "kvpress:snapkv"], [8, 16])
    lines = md.splitlines()
    assert "held KV / full" in lines[0]
    assert "| snapkv | 0.101 (0.101–0.101) | 1.01 | 0.125 |" in md and "| 1.130 |" in md
    assert "0.095 (0.095–0.095) | 0.47 | 0.125 |" in md  # kvpress's held over the full row's KV
    assert lines[-3] == "N = 8: compressing methods (held KV / full < 1) peaking above full attention: snapkv (+1.0 MB)"
    assert lines[-2] == ""  # a paragraph each
    assert lines[-1] == "N = 16: compressing methods (held KV / full < 1) peaking above full attention: none"


def test_the_heap_free_bytes_count_freed_chunks_in_glibcs_heap():
    """``bench_memory.heap_free_bytes`` (recorded at every reset, both sides): chunks freed in glibc's heap (below
    the mmap threshold) and kept apart by live ones show up in it."""
    import ctypes
    import platform

    from conftest import load_script

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's mallinfo2 only")
    bench = load_script("bench_memory")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    ptrs = [libc.malloc(4000) for _ in range(2000)]
    before = bench.heap_free_bytes()
    for p in ptrs[::2]:
        libc.free(p)  # freed, each between two live chunks: not merged into the top, not trimmed
    try:
        assert bench.heap_free_bytes() - before >= 1000 * 4000 * 0.9
    finally:
        for p in ptrs[1::2]:
            libc.free(p)


def test_a_method_row_can_carry_its_settings():
    """``bench_memory --methods duo_attention,pattern_seed=0``: the config's name, then its settings as overrides; a
    setting that is not key=value is a one-line error naming it."""
    from conftest import load_script

    bench = load_script("bench_memory")
    assert bench.method_settings("duo_attention,pattern_seed=0,sink=8") == (
        "duo_attention", ["method.pattern_seed=0", "method.sink=8"])
    assert bench.method_settings("snapkv+after") == ("snapkv+after", [])
    assert bench.parse_method("finch,chunk=512@4096") == ("finch,chunk=512", 4096, True)
    with pytest.raises(SystemExit, match="seed is not key=value; allowed: <config>"):
        bench.method_settings("duo_attention,seed")


def test_the_memory_figure_sorts_methods_by_peak_over_full_and_pairs_it_with_the_held_kv(tmp_path):
    """``bench_memory.plot_points`` (what the figure draws): per method and N the peak over full attention's and the KV
    held over full's, methods sorted by the longest N's peak ratio; kvpress's rows over kvpress's full where ours is
    missing; the figure is written."""
    from conftest import load_script

    bench = load_script("bench_memory")

    def row(method, n, median, kv, full_kv=1000):
        return {"method": method, "n": n, "median": median, "min": median, "max": median, "tensor_median": None,
                "kv_bytes": kv, "kv_bytes_full": full_kv}

    rows = [row("full", 8, 100e6, 1000), row("snapkv", 8, 46e6, 125), row("duo", 8, 90e6, 520),
            row("full", 16, 200e6, 2000, 2000), row("snapkv", 16, 92e6, 250, 2000), row("duo", 16, 120e6, 1040, 2000),
            {**row("kvpress:snapkv", 16, 94e6, 250), "kv_bytes_full": None}]
    order, lengths, pts = bench.plot_points(rows, ["full", "duo", "snapkv", "kvpress:snapkv", "absent"])
    assert order == ["snapkv", "kvpress:snapkv", "duo", "full"] and lengths == [8, 16]
    assert pts[("duo", 16)] == (0.6, 0.52) and pts[("snapkv", 8)] == (0.46, 0.125)
    assert pts[("kvpress:snapkv", 16)] == (0.47, 0.125)  # held over our full row's KV
    bench.plot(rows, ["full", "duo", "snapkv", "kvpress:snapkv"], str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").stat().st_size > 10_000
