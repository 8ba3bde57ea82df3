"""Entropy-guided OLS summarisation's decode step for rows of a batch decoded as one (issue 60; ``stacked.py``).

Rows of different lengths, each prefilled and compacted alone on its own cache, decode a layer in one step: the
layer is a *selecting* stacked layer (it reads everything each row holds and drops nothing in the step; a row's
flush runs in its own ``after_step``, as alone) whose rows are right-aligned (``StackedLayer.aligned``: each row's
raw tokens end at one slot). The step is ``EntropyOLSPolicy._decode_attend`` for all rows at once:

- the raw tokens' logits and the synthetic entries' logits (their log-mass bias as the GEMM's input) side by side in
  one buffer; a row's slots before its first raw token, and the synthetic slots past its own entries, carry a large
  finite negative logit (``PAD``), so their weight is exactly 0 and their p log p term 0 (not -inf's NaN);
- the new token's entropy normalised by each row's own ``g log N`` (N its raw tokens plus its synthetic entries):
  one batched dot product and one multiply by the rows' factors (batch 1: the factor is the GEMM's scalar);
- the masses added into the stacked per-token state and into the rows' synthetic masses (views of one tensor);
- the step's queries written into the rows' reference-query rings at one slot: each row's ring is turned once, when
  the rows are stacked, so that all rows write the same slot next (``EntropyOLSPolicy._qoff``).

The rows' synthetic entries (keys, values, biases, masses) are stacked at the widest row's count; each row's policy
holds views of its part, so its own figures (``S``, bytes) stay the row's. A row's flush or re-binning replaces its
entries by tensors of its own: the stack notices (identity, on the host) and stacks them again at its next step.
Leaving the stack (``stacked_release``), each row gets private copies. In float32 the step is the fast path's
(``_fast``); in another dtype (bfloat16 on a GPU) it is ``attention_with_extra``'s explicit pass over the rows
(``_general``), as a row alone runs it there. Not with the linear mode's per-centroid maps: a row then plans no
stacked step and the rows decode one by one.
"""
from __future__ import annotations

import math

import torch

from luka_bench.device import host_to_device
from luka_bench.methods.attention import group_apply, group_logits

PAD = -1e30  # the logit of a slot a row does not hold: exp(PAD - max) == 0 and 0 * PAD == 0 in float32


def stackable(policy) -> bool:
    """A row whose next decode step can run stacked: no per-centroid linear maps, and its reference-query ring full
    (or none: budget 1)."""
    return policy.la is None and (policy._qring is None or policy._qn >= policy._qring.shape[2])


def _synthetic(layer, pols, st) -> None:
    """The rows' synthetic entries stacked at the widest row's count (``st``: keys, values, biases, masses; each
    row's policy then views its part), made again where a row's entries are no longer the views it was given."""
    if st.get("views") is not None and all(p.sk is v for p, v in zip(pols, st["views"])):
        return
    B, hkv, d = len(pols), layer.kv.shape[2], layer.kv.shape[4]  # (keys and values of one width in the stack)
    smax = max(p.S for p in pols)
    st["smax"] = smax
    if smax == 0:
        st["views"] = [None] * B
        return
    dev = layer.kv.device
    sk = layer.kv.new_zeros(B, hkv, smax, d)
    sv = layer.kv.new_zeros(B, hkv, smax, d)
    sb = torch.full((B, hkv, smax), PAD, dtype=torch.float32, device=dev)
    sm = torch.zeros(B, hkv, smax, dtype=torch.float32, device=dev)
    for b, p in enumerate(pols):
        s = p.S
        if s:
            sk[b:b + 1, :, :s], sv[b:b + 1, :, :s] = p.sk, p.sv
            sb[b:b + 1, :, :s], sm[b:b + 1, :, :s] = p.sb, p.smass
            p.sk, p.sv, p.sb, p.smass = sk[b:b + 1, :, :s], sv[b:b + 1, :, :s], sb[b:b + 1, :, :s], sm[b:b + 1, :, :s]
    st.update(sk=sk, sv=sv, sb=sb, sm=sm, views=[p.sk for p in pols])


def _ring(layer, pols, st, query) -> None:
    """The rows' reference-query rings as one tensor [B, Hq, R, D], each turned (its ``_qoff``) so that every row
    writes the same slot next; each row's policy views its part."""
    if pols[0]._qring is None or (st.get("rings") is not None and all(p._qring is r for p, r in
                                                                        zip(pols, st["rings"]))):
        return
    R = pols[0]._qring.shape[2]
    at = (pols[0]._qn + pols[0]._qoff) % R
    ring = torch.empty(len(pols), *pols[0]._qring.shape[1:], dtype=pols[0]._qring.dtype, device=query.device)
    for b, p in enumerate(pols):
        turn = (at - (p._qn + p._qoff)) % R
        ring[b:b + 1] = torch.roll(p._qring, turn, dims=2) if turn else p._qring
        p._qoff = (p._qoff + turn) % R
        p._qring = ring[b:b + 1]
    st.update(ring=ring, rings=[p._qring for p in pols], at=at)


def stacked_attend(layer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """The rows' decode step (module docstring). [B, Hq, 1, Dv]."""
    pols = [s.policy for s in layer.stores]
    mass_name, ent_name = pols[0].aux_names
    st = layer.state
    for p in pols:
        p.scaling = scaling
    _synthetic(layer, pols, st)
    if query.dtype == torch.float32 and layer.kv.dtype == torch.float32:
        out = _fast(layer, pols, st, query, scaling, mass_name, ent_name)
    else:
        out = _general(layer, pols, st, query, scaling, mass_name, ent_name)
    if pols[0].method.budget < 1.0:  # the step's queries into the rows' rings, at their one slot
        _ring(layer, pols, st, query)
        at = st["at"]
        st["ring"][:, :, at] = query[:, :, 0]
        st["at"] = (at + 1) % st["ring"].shape[2]
        for pol in pols:
            pol._qn += 1
    return out


def _fast(layer, pols, st, query, scaling, mass_name, ent_name) -> torch.Tensor:
    """``EntropyOLSPolicy._decode_attend`` for the rows (float32)."""
    b, hq, _, d = query.shape
    hkv = layer.kv.shape[2]
    g, bh = hq // hkv, b * hkv
    W, S = layer.fill, st["smax"]
    N = W + S
    if "pad" not in st:  # the slots before each row's first raw token: PAD (made once per storage)
        om = layer.open_mask
        st["pad"] = None if om is None else om.clamp(min=PAD).expand(b, hkv, 1, layer.cap).reshape(bh, 1, layer.cap)
        st["zero"] = query.new_zeros(())
        st["ones"] = query.new_ones(bh, 1, g)
    buf = st.get("buf")
    if buf is None or buf.shape[2] < N:
        buf = st["buf"] = torch.empty(bh, g, int(N * 1.25) + 64, dtype=torch.float32, device=query.device)
    buf = buf[:, :, :N]
    q = query.reshape(bh, g, d)
    K, V = layer.kv[0][:, :, :W].reshape(bh, W, d), layer.kv[1][:, :, :W]
    pad, zero, ones = st["pad"], st["zero"], st["ones"]
    if pad is None:
        torch.baddbmm(zero, q, K.transpose(1, 2), beta=0.0, alpha=scaling, out=buf[:, :, :W])
    else:
        torch.baddbmm(pad[:, :, :W], q, K.transpose(1, 2), alpha=scaling, out=buf[:, :, :W])
    if S:
        torch.baddbmm(st["sb"].view(bh, 1, S), q, st["sk"].view(bh, S, d).transpose(1, 2), alpha=scaling,
                      out=buf[:, :, W:])
    logp = torch.log_softmax(buf, dim=-1)
    p = logp.exp()
    # each row's entropy factor -1 / (g log N_b), N_b its raw tokens and synthetic entries (as alone)
    held = [s.n + pol.S for s, pol in zip(layer.stores, pols)]
    factor = host_to_device([-1.0 / (g * math.log(n)) if n > 1 else 0.0 for n in held for _ in range(hkv)],
                            query.device, torch.float32).view(bh, 1, 1)
    torch.mul(torch.bmm(p.view(bh, 1, g * N), logp.view(bh, g * N, 1)), factor,
              out=layer.aux[ent_name][:, :, W - 1: W].view(bh, 1, 1))
    layer.aux[mass_name][:, :, :W].view(bh, 1, W).baddbmm_(ones, p[:, :, :W])
    out = torch.bmm(p[:, :, :W], V.reshape(bh, W, -1))
    if S:
        st["sm"].view(bh, 1, S).baddbmm_(ones, p[:, :, W:])
        out = torch.baddbmm(out, p[:, :, W:], st["sv"].view(bh, S, -1))
    return out.view(b, hq, 1, -1)


def _general(layer, pols, st, query, scaling, mass_name, ent_name) -> torch.Tensor:
    """``attention_with_extra``'s decode step (its explicit pass, ``attention._explicit_attention``) for the rows, in
    the model's dtype (bfloat16 on a GPU): the same ops on the rows' stacked tensors, the slots before a row's
    first raw token closed by the rows' mask added to the float32 logits (+0 elsewhere: the same values), each row's
    own count of entries as the entropy's normaliser."""
    b, hq, _, d = query.shape
    hkv = layer.kv.shape[2]
    g = hq // hkv
    W, S = layer.fill, st["smax"]
    q = query.view(b, hkv, g, 1, d)
    if "mask" not in st:  # the slots before each row's first raw token: -inf, float32 (made once per storage)
        om = layer.open_mask
        st["mask"] = None if om is None else om.float()
    mask = st["mask"]
    logits = group_logits(q, layer.kv[0][:, :, :W], scaling,
                          None if mask is None else mask[..., :W].expand(b, hkv, 1, W))
    if S:
        el = group_logits(q, st["sk"], scaling) + st["sb"][:, :, None, None, :].float()
        logits = torch.cat([logits, el], dim=-1)
    logp = torch.log_softmax(logits, dim=-1)
    w = logp.exp()
    h = -torch.where(w > 0, w * logp, torch.zeros_like(w)).sum(-1)  # [B, Hkv, g, 1]
    seen = host_to_device([float(s.n + pol.S) for s, pol in zip(layer.stores, pols)], query.device,
                          torch.float32).view(b, 1, 1, 1)  # each row's entries (held tokens and synthetic ones)
    ent = (h / seen.log().clamp_min(1e-12)).mean(2) * (seen > 1).view(b, 1, 1)
    layer.aux[ent_name][:, :, W - 1: W] = ent
    o = group_apply(w[..., :W], layer.kv[1][:, :, :W])
    if S:
        o = o + group_apply(w[..., W:], st["sv"])
        st["sm"] += w[..., W:].sum(dim=(2, 3))
    layer.aux[mass_name][:, :, :W] += w[..., :W].sum(dim=(2, 3))
    return o.view(b, hq, 1, o.shape[-1])


def stacked_release(layer) -> None:
    """Before the stack's storage is remade or given back: each row's synthetic entries and ring its own again."""
    st = layer.state
    for b, s in enumerate(layer.stores):
        p = s.policy
        if st.get("views") is not None and st["views"][b] is not None and p.sk is st["views"][b]:
            p.sk, p.sv, p.sb, p.smass = (x.clone() for x in (p.sk, p.sv, p.sb, p.smass))
        if st.get("rings") is not None and p._qring is st["rings"][b]:
            p._qring = p._qring.clone()
    st.pop("views", None)
    st.pop("rings", None)
