"""LycheeCluster's structure-aware chunking (Li et al., App. B, Table 4): the tokens after the ``sink`` first ones
are cut into chunks of ``min_chunk``..``max_chunk`` tokens at the strongest text boundary in the window, read from
the tokens' *strings* (a per-vocabulary table of separator levels), or into plain ``max_chunk``-token pages
(``chunking: fixed``). The rule is written out in ``lychee.py``'s docstring; ``Chunker`` holds one prompt's chunk
boundaries, shared by every layer of the prompt's cache.

Below the method file (``lychee.py`` imports it, never the other way round): a ``Chunker`` reads only the settings
of the method it is given (``sink``, ``buffer``, ``min_chunk``, ``max_chunk``, ``chunking``, ``tokenizer`` and
``level_tables()``, the tables of ``vocab_levels`` made once per tokenizer)."""
from __future__ import annotations

import torch

from luka_bench.device import host_side, host_to_device

NONE_LEVEL = 5
# App. B, Table 4: separators by priority (1 = strongest).
LEVEL1 = ("\n\n", "```", "---", "***", "___", "}", "]", ">")
LEVEL2 = (".", "?", "!", "\u3002", "\uff1f", "\uff01", "\n")
LEVEL3 = (",", ";", ":", "\uff0c", "\uff1b", "\uff1a", "\u3001")
LEVEL4 = (" ", "\t", "\u3000")


def token_levels(text: str) -> tuple[int, int]:
    """(end level, start level) of one token's string: the strongest separator it contains (levels 1-3; level 4
    only when it ends in whitespace) — a boundary after it — and the one it starts with (blank line 1, newline 2,
    whitespace 4) — a boundary before it. 5 = none."""
    end = NONE_LEVEL
    for lvl, seps in ((1, LEVEL1), (2, LEVEL2), (3, LEVEL3)):
        if any(s in text for s in seps):
            end = lvl
            break
    if end == NONE_LEVEL and text and text[-1] in LEVEL4:
        end = 4
    start = NONE_LEVEL
    if text.startswith("\n\n"):
        start = 1
    elif text.startswith("\n"):
        start = 2
    elif text and text[0] in LEVEL4:
        start = 4
    return end, start


def vocab_levels(tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-vocabulary tables [V] from each id's decoded string (computed once per tokenizer): end level, start
    level (int8) and whether the string ends with a newline (bool)."""
    n = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    lv = [token_levels(t) for t in texts]
    return (torch.tensor([a for a, _ in lv], dtype=torch.int8), torch.tensor([b for _, b in lv], dtype=torch.int8),
            torch.tensor([t.endswith("\n") for t in texts], dtype=torch.bool))


def boundary_levels(ids: torch.Tensor, tables, prev: int | None = None) -> torch.Tensor:
    """Level of the boundary after each token of ``ids`` but the last (its successor is needed): the stronger of
    the token's end level and its successor's start level; a newline right after a newline (a blank line split
    over two tokens) is level 1. ``prev``: the id before ``ids[0]``, if any. Vectorised."""
    end_t, start_t, nl = tables
    ids = ids.clamp(0, len(end_t) - 1)  # ids past the tokenizer (a padded model vocabulary) count as no separator
    lv = torch.minimum(end_t[ids[:-1]], start_t[ids[1:]])
    before = torch.cat([torch.tensor([prev if prev is not None else ids[0]]), ids[:-2]]) if len(ids) > 1 else ids[:0]
    blank = nl[ids[:-1]] & nl[before]
    if prev is None and len(blank):
        blank[0] = False
    return torch.where(blank, torch.ones_like(lv), lv)


def split_chunks(levels: list[int], start: int, stop: int, lo: int, hi: int) -> list[int]:
    """Structure-aware chunk ends (exclusive) for tokens from ``start``: ``levels[e]`` is the level of the boundary
    after token e (known for e < len(levels)); chunks of lo..hi tokens end at the best (lowest) level in their
    window, the latest on ties, forced at hi. Cuts while a whole window lies before ``stop``. One pass over the
    chunks (prefill: once per prompt; decode: at most a chunk per token)."""
    ends = []
    s = start
    while s + hi <= stop:
        window = levels[s + lo - 1: s + hi]
        best = min(window)
        # latest position of the best level (a forced split at hi when best is NONE_LEVEL)
        off = len(window) - 1 - window[::-1].index(best)
        s = s + lo + off
        ends.append(s)
    return ends


class Chunker:
    """The chunk boundaries of one prompt, shared by every layer (``MethodCache.state``). Chunks cover tokens
    [sink, frontier); ``starts`` [M + 1] are their boundaries and ``tok_chunk`` [frontier - sink] the chunk of each
    token, on the model's device. ``advance(cache, n)`` cuts the chunks that ``n`` seen tokens allow (idempotent)."""

    def __init__(self, method, device: torch.device):
        self.m = method
        self.device = device
        self.bounds = [method.sink]  # chunk boundaries (python ints)
        self.levels: list[int] = []  # level of the boundary after each token whose successor is known
        self.starts = torch.tensor(self.bounds, dtype=torch.long, device=device)  # [M + 1]
        self.lens = torch.empty(0, dtype=torch.long, device=device)
        self.tok_chunk = torch.empty(0, dtype=torch.long, device=device)
        self.upto = 0  # advanced for this many seen tokens

    def nbytes(self) -> int:
        """Bytes of its tensors (``starts``, ``lens``, ``tok_chunk``), as allocated."""
        return sum(t.untyped_storage().nbytes() for t in (self.starts, self.lens, self.tok_chunk))

    @property
    def n_chunks(self) -> int:
        return len(self.bounds) - 1

    @property
    def frontier(self) -> int:
        return self.bounds[-1]

    def _levels(self, cache, n: int) -> None:
        m = self.m
        if m.chunking == "fixed" or len(self.levels) >= n - 1:
            return
        ids = cache.token_ids
        if len(ids) < n or m.tokenizer is None:
            raise RuntimeError(
                "lychee: chunking=structure needs the token ids of every forward (MethodCache.add_tokens, as "
                "luka_bench.run.forward does) and the tokenizer (hf.attach(model, method, tokenizer)); "
                f"have {len(ids)} ids for {n} tokens, tokenizer {'set' if m.tokenizer is not None else 'missing'}")
        a = len(self.levels)
        with host_side():  # CPU tensors of the host token ids, read back on the host: no device involved
            cur = torch.tensor(ids[a: n], dtype=torch.long)
            self.levels.extend(boundary_levels(cur, m.level_tables(), ids[a - 1] if a else None).tolist())

    def advance(self, cache, n: int) -> int:
        """Cut every chunk the first ``n`` tokens allow; returns the number of new chunks."""
        if n <= self.upto:
            return 0
        self.upto = n
        m = self.m
        stop = n - m.buffer
        if stop - self.frontier < m.max_chunk:
            return 0
        if m.chunking == "fixed":
            k = (stop - self.frontier) // m.max_chunk
            ends = [self.frontier + (i + 1) * m.max_chunk for i in range(k)]
        else:
            self._levels(cache, n)
            ends = split_chunks(self.levels, self.frontier, stop, m.min_chunk, m.max_chunk)
        if not ends:
            return 0
        first = self.n_chunks
        old = self.frontier
        self.bounds.extend(ends)
        new_b = host_to_device([old] + ends, self.device)  # pinned + non_blocking on CUDA: no host sync
        self.starts = torch.cat([self.starts, new_b[1:]])
        lens = new_b[1:] - new_b[:-1]
        self.lens = torch.cat([self.lens, lens])
        ids = torch.arange(first, first + len(ends), device=self.device).repeat_interleave(
            lens, output_size=ends[-1] - old)  # the size from the host: no device sync
        self.tok_chunk = torch.cat([self.tok_chunk, ids])
        return len(ends)

