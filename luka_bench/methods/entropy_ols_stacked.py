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
from luka_bench.methods.attention import attention_with_extra

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
    st.update(ring=ring, rings=[p._qring for p in pols])


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
        ring, first = st["ring"], pols[0]
        ring[:, :, (first._qn + first._qoff) % ring.shape[2]] = query[:, :, 0]  # every row's next slot: the same
        for pol in pols:
            pol._qn += 1
    return out


def decode_pass(q, keys, values, extra, buf, zero, pad, scaling, factor, ent_out, mass, smass, ones):
    """One decode query's pass over ``n`` held tokens and ``S`` synthetic entries, per (row x KV head) ``bh`` — the
    float32 fast path of a row alone (``EntropyOLSPolicy._decode_attend``) and of rows stacked (``_fast``): both
    sets of logits side by side in ``buf`` [bh, g, n + S] (the synthetic bias as the GEMM's input), one log-softmax
    and one exp, the entropy -sum p log p x ``factor`` into ``ent_out`` [bh, 1, 1] (a float: the GEMM's own scalar;
    a tensor [bh, 1, 1], each row's own: one multiply), the masses added into ``mass`` [bh, 1, n] and ``smass``
    [bh, 1, S] by ``ones`` [bh, 1, g], the output as one GEMM plus one for the synthetic values. q [bh, g, d], keys
    [bh, n, d], values [bh, n, dv], ``extra`` (keys [bh, S, d], values [bh, S, dv], bias [bh, 1, S]) or None; ``pad``
    [bh, 1, n] added to the held logits (the rows' slots before their first: PAD) or None. [bh, g, dv]."""
    bh, g, _ = q.shape
    n = keys.shape[1]
    N = buf.shape[2]
    if pad is None:
        torch.baddbmm(zero, q, keys.transpose(1, 2), beta=0.0, alpha=scaling, out=buf[:, :, :n])
    else:
        torch.baddbmm(pad, q, keys.transpose(1, 2), alpha=scaling, out=buf[:, :, :n])
    if extra is not None:
        torch.baddbmm(extra[2], q, extra[0].transpose(1, 2), alpha=scaling, out=buf[:, :, n:])
    logp = torch.log_softmax(buf, dim=-1)
    p = logp.exp()
    if isinstance(factor, torch.Tensor):
        torch.mul(torch.bmm(p.view(bh, 1, g * N), logp.view(bh, g * N, 1)), factor, out=ent_out)
    else:
        torch.baddbmm(zero, p.view(bh, 1, g * N), logp.view(bh, g * N, 1), beta=0.0, alpha=factor, out=ent_out)
    mass.baddbmm_(ones, p[:, :, :n])
    out = torch.bmm(p[:, :, :n], values)
    if extra is not None:
        smass.baddbmm_(ones, p[:, :, n:])
        out = torch.baddbmm(out, p[:, :, n:], extra[1])
    return out


def _fast(layer, pols, st, query, scaling, mass_name, ent_name) -> torch.Tensor:
    """``EntropyOLSPolicy._decode_attend`` for the rows (float32): ``decode_pass`` over the stacked tensors, the
    rows' slots before their first at PAD, each row's own entropy factor."""
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
    # each row's entropy factor -1 / (g log N_b), N_b its raw tokens and synthetic entries (as alone)
    held = [s.n + pol.S for s, pol in zip(layer.stores, pols)]
    factor = host_to_device([-1.0 / (g * math.log(n)) if n > 1 else 0.0 for n in held for _ in range(hkv)],
                            query.device, torch.float32).view(bh, 1, 1)
    extra = (st["sk"].view(bh, S, d), st["sv"].view(bh, S, -1), st["sb"].view(bh, 1, S)) if S else None
    out = decode_pass(query.reshape(bh, g, d), layer.kv[0][:, :, :W].reshape(bh, W, d),
                      layer.kv[1][:, :, :W].reshape(bh, W, -1), extra, buf[:, :, :N], st["zero"],
                      None if st["pad"] is None else st["pad"][:, :, :W], scaling, factor,
                      layer.aux[ent_name][:, :, W - 1: W].view(bh, 1, 1),
                      layer.aux[mass_name][:, :, :W].view(bh, 1, W), st["sm"].view(bh, 1, S) if S else None,
                      st["ones"])
    return out.view(b, hq, 1, -1)


def _general(layer, pols, st, query, scaling, mass_name, ent_name) -> torch.Tensor:
    """``attention_with_extra``'s decode step for the rows, in the model's dtype (bfloat16 on a GPU): its explicit
    pass over the rows' stacked tensors, the slots before a row's first raw
    token closed by the rows' mask added to the float32 logits (+0 elsewhere: the same values), each row's own count
    of entries as the entropy's normaliser; then the masses and the entropy into the rows' state, as alone."""
    b, hq, _, d = query.shape
    hkv = layer.kv.shape[2]
    W, S = layer.fill, st["smax"]
    if "mask" not in st:  # the slots before each row's first raw token: -inf, float32 (made once per storage)
        om = layer.open_mask
        st["mask"] = None if om is None else om.float()
    mask = st["mask"]
    seen = host_to_device([float(s.n + pol.S) for s, pol in zip(layer.stores, pols)], query.device,
                          torch.float32).view(b, 1, 1, 1)  # each row's entries (held tokens and synthetic ones)
    out, mass, emass, ent, _ = attention_with_extra(
        None, query, scaling, *((st["sk"], st["sv"], st["sb"]) if S else ()), keys=layer.kv[0][:, :, :W],
        values=layer.kv[1][:, :, :W], mask=None if mask is None else mask[..., :W].expand(b, hkv, 1, W), seen=seen)
    layer.aux[mass_name][:, :, :W].add_(mass)
    layer.aux[ent_name][:, :, W - 1: W] = ent
    if S:
        st["sm"] += emass
    return out.view(b, hq, 1, out.shape[-1])


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
