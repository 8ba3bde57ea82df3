"""LuKA clustered attention's decode-path buffer (``luka_clustered.py`` is the policy: the pages, the refinement,
the attention): the *cover* — the keys and values one decode step attends over, one buffer laid out
[sink | P page summaries | tail region | scratch for the refined pages' tokens] — kept in sync with the store, plus
the step's fixed scratch (its logits buffer, the group-sum GEMV's ones, a zero for ``baddbmm``).

The tail region holds the raw tokens frontier..n-1 and free slots up to a width fixed between compressions (the
tail, a page and ``compress_every`` steps: what accumulates until the next compression), masked in the step
(``DecodeStep.held_mask``). A decode step's token is written at a slot the device holds (the store's slot plus a
per-compression offset, one kernel per step for all layers: ``DecodeStep.slot``): consecutive steps between
compressions have the same ops on the same shapes (the graph-ready steady state). Pages made by a compression are
written in place while they fit; the buffer is remade (zeroed, with room to spare) when they do not.

Below the method file (``luka_clustered.py`` imports it, never the other way round): a ``Cover`` is given the
settings it lays out by (``sink``, ``tail``, ``page_size``, ``compress_every``) and, at each sync, the level-1
page summaries, their count and the frontier."""
from __future__ import annotations

import torch

from luka_bench.methods import cpu_kernel
from luka_bench.methods.protocols import DecodeStep, Store


class Cover:
    """One layer's cover buffer (see the module docstring) and the decode step's scratch."""

    ROOM = 64  # spare cover entries made at a reallocation (at least; a quarter of the need when more)

    def __init__(self, sink: int, tail: int, page_size: int, compress_every: int) -> None:
        self.sink, self.tail, self.page_size, self.every = sink, tail, page_size, compress_every
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.kv: torch.Tensor | None = None  # both, stacked [2, ...], where they can be (``_alloc``)
        self.n = 0        # valid entries (sink, pages, the raw tail)
        self.w = 0        # the width: sink, pages and the tail region (valid entries and free slots)
        self.pages = -1   # pages the buffer was built with
        self.raw = 0      # raw tokens mirrored into it (its tail ends at raw index ``raw``)
        self._rows: tuple | None = None  # page 0's storage rows [B, Hkv, 1, S], per storage (``gather_pages``)
        self._lbuf: torch.Tensor | None = None  # ``logits``
        self._ones: torch.Tensor | None = None  # ``ones``
        self._zero: torch.Tensor | None = None  # ``zero``

    def nbytes(self) -> int:
        """Bytes of the copies it holds (its valid entries)."""
        return 0 if self.k is None else (self.k[:, :, :1].nbytes + self.v[:, :, :1].nbytes) * self.n

    def scratch_bytes(self) -> int:
        """Bytes it allocates beyond its valid entries (``nbytes``), as allocated: the buffer's free tail slots, the
        refined pages' scratch and the room for later pages, and the step's logits buffer, ones and zero, the
        pages' row offsets (not the store's row offsets it keys them by: the store's own)."""
        if self.k is None:
            return 0
        kv = [self.kv] if self.kv is not None else [self.k, self.v]
        scratch = [t for t in (self._lbuf, self._ones, self._zero) if t is not None]
        scratch += [self._rows[2]] if self._rows is not None else []
        return sum(t.untyped_storage().nbytes() for t in kv + scratch) - self.nbytes()

    def sync(self, store: Store, step: DecodeStep | None, sk: torch.Tensor, sv: torch.Tensor, P: int, fr: int,
             room: int) -> int:
        """Bring the buffer in sync with the store: ``sk`` / ``sv`` [B, Hkv, >= P, D] the ``P`` page summaries,
        ``fr`` the first raw token not in a page, ``room`` the scratch a step's refined pages need; ``step`` a
        decode step (its token written at the slot the device holds), None at a compression. Returns the width W =
        sink + pages + the tail region."""
        s0, n = self.sink, store.n
        base = s0 + P - fr  # cover slot of raw token i: i + base
        if self.pages != P or self.k is None or n - fr > self.w - s0 - P:
            old, T = self.pages, self.w - s0 - self.pages
            if self.k is not None and 0 <= old <= P and n - fr <= T and s0 + P + T + room <= self.k.shape[2]:
                first = old  # pages were added (a compression): only they and the tail are written, in place
            else:
                T = max(self.tail + self.page_size + self.every, n - fr + self.every)
                need = s0 + P + T + room
                self._alloc(store.keys, store.values, need + max(self.ROOM, need // 4))  # room for later
                first = 0
                self._copy_raw(store, 0, s0, 0)
            if P > first:
                self.k[:, :, s0 + first: s0 + P] = sk[:, :, first:P]
                self.v[:, :, s0 + first: s0 + P] = sv[:, :, first:P]
            self._copy_raw(store, fr, n, s0 + P)
            self.w, self.pages = s0 + P + T, P
        elif step is not None and self.raw == n - 1 and (slot := step.slot(store, base)) is not None:
            k, v = store.static_kv  # a decode step, at its slot
            self.k.index_copy_(2, slot, k)
            self.v.index_copy_(2, slot, v)
        else:
            self._copy_raw(store, self.raw, n, self.raw + base)
        self.n, self.raw = n + base, n
        return self.w

    def _copy_raw(self, store: Store, start: int, stop: int, dst: int) -> None:
        """The store's raw tokens start..stop-1 into the buffer at dst.. (keys and values in one copy where both
        are stacked)."""
        if stop <= start:
            return
        new = store.stacked(start, stop)
        if new is not None and self.kv is not None:
            self.kv[:, :, :, dst: dst + stop - start] = new
        else:
            self.k[:, :, dst: dst + stop - start] = store.keys[:, :, start:stop]
            self.v[:, :, dst: dst + stop - start] = store.values[:, :, start:stop]

    def _alloc(self, like_k: torch.Tensor, like_v: torch.Tensor, cap: int) -> None:
        """Zeroed buffers of ``cap`` entries (a free slot is read, masked: never uninitialised bits, whose NaN would
        survive the mask): keys and values stacked in one tensor [2, B, Hkv, cap, D] where their shapes and dtypes
        agree (the refined pages' tokens are then gathered into it in one kernel)."""
        b, h, _, d = like_k.shape
        if like_k.shape[-1] == like_v.shape[-1] and like_k.dtype == like_v.dtype:
            self.kv = like_k.new_zeros(2, b, h, cap, d)
            self.k, self.v = self.kv[0], self.kv[1]
        else:
            self.kv = None
            self.k, self.v = like_k.new_zeros(b, h, cap, d), like_v.new_zeros(b, h, cap, like_v.shape[-1])

    def gather_pages(self, store: Store, idx: torch.Tensor, W: int) -> None:
        """The raw tokens of the refined pages ``idx`` [B * Hkv, K] into the scratch (W .. W + K * S): one gather
        over the stacked storage seen as pages [2, B * Hkv, pages, S * D] where both are stacked, else (and on the
        CPU, where a gather over an expanded index took ~2.7x the row copy: ``cpu_kernel.cpu_fast``) the pages'
        rows computed, gathered by one ``index_select`` and copied."""
        S, s0 = self.page_size, self.sink
        b, h = self.k.shape[:2]
        k_sel = idx.shape[-1]
        src = None if cpu_kernel.cpu_fast(idx.device) else store.pages(s0, S)
        if src is not None and self.kv is not None:
            dst = self.kv[:, :, :, W: W + k_sel * S].view(2, b * h, k_sel, -1)
            torch.gather(src, 2, idx.view(1, b * h, k_sel, 1).expand(2, -1, -1, src.shape[-1]), out=dst)
            return
        off = store.row_offsets()
        if self._rows is None or self._rows[0] is not off or self._rows[1] != (s0, S):  # made once per storage
            self._rows = (off, (s0, S), off.unsqueeze(-1) + torch.arange(s0, s0 + S, device=idx.device))
        rows = torch.add(self._rows[2], idx.view(b, h, k_sel, 1), alpha=S).view(-1)
        both = store.gather_stacked(rows, k_sel * S) if self.kv is not None else None
        if both is not None:  # keys and values in one copy
            self.kv[:, :, :, W: W + k_sel * S] = both
        else:
            kk, vv = store.gather_flat(rows, k_sel * S)
            self.k[:, :, W: W + k_sel * S] = kk
            self.v[:, :, W: W + k_sel * S] = vv

    def logits(self, bh: int, g: int, need: int, like: torch.Tensor) -> torch.Tensor:
        """A float32 [bh, g, >= need] scratch for a decode step's logits (cover, then refined children), kept
        between steps and grown by a quarter when short."""
        t = self._lbuf
        if t is None or t.shape[:2] != (bh, g) or t.shape[2] < need or t.device != like.device:
            t = self._lbuf = torch.empty(bh, g, int(need * 1.25) + 64, dtype=torch.float32, device=like.device)
        return t

    def ones(self, bh: int, g: int, like: torch.Tensor) -> torch.Tensor:
        """[bh, 1, g] ones of ``like``'s dtype and device, made once (the group-sum GEMV's left factor)."""
        t = self._ones
        if t is None or t.shape != (bh, 1, g) or t.device != like.device or t.dtype != like.dtype:
            t = self._ones = like.new_ones(bh, 1, g)
        return t

    def zero(self, like: torch.Tensor) -> torch.Tensor:
        """A 0-d tensor for ``baddbmm(…, beta=0)`` (its input is ignored but must be given), made once."""
        if self._zero is None or self._zero.device != like.device or self._zero.dtype != like.dtype:
            self._zero = like.new_zeros(())
        return self._zero
