"""RoPE on a store's cached keys (torch only): the model's rotary embedding at given positions (``rope_cos_sin``)
and the in-place move of held keys to new positions (``rotate_keys``) — ``KVStore.rope_cos_sin`` / ``rotate_keys``
(StreamingLLM's ``positions=cache``, FINCH's re-rotation, ShadowKV's rebuilt keys)."""
from __future__ import annotations

import inspect

import torch

from .base import MethodConfigError


def rotate_keys(store, start: int, stop: int, delta: int | torch.Tensor) -> None:
    """Move the held keys ``start:stop`` (stored after RoPE) by ``delta`` positions in place: RoPE rotations
    compose, R(p + delta) k = R(delta) R(p) k, so a key rotated for position p becomes the key for p + delta
    (the model's own rotary embedding gives cos/sin of ``delta``; its attention scaling divided out; the
    rotate-half layout of Llama / Qwen / Mistral / Gemma; a partial rotary dimension rotates only its part).
    ``delta``: one number for all, or one per key [B, Hkv, stop - start] (FINCH's re-rotation to new positions)."""
    per_key = isinstance(delta, torch.Tensor)
    if stop <= start or (not per_key and delta == 0):
        return
    k = store._k[:, :, start:stop]
    if per_key:
        cos, sin = store.rope_cos_sin(delta.to(k.device, torch.long).reshape(1, -1))  # [B*Hkv*m, rot]
        cos, sin = cos.reshape(*k.shape[:3], -1), sin.reshape(*k.shape[:3], -1)
    else:
        cos, sin = store.rope_cos_sin(torch.full((1, 1), delta, device=k.device, dtype=torch.long))  # [1, rot]
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    x = k[..., :rot].float()
    out = x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
    store._k[:, :, start:stop, :rot] = out.to(k.dtype)


def rope_cos_sin(store, positions: torch.Tensor, scaled: bool = False) -> tuple[torch.Tensor, ...]:
    """The model's rotary embedding at ``positions`` [1, m] (int64): (cos, sin) [m, rot] fp32 with its attention
    scaling divided out (a pure rotation; the rotate-half layout of Llama / Qwen / Mistral / Gemma; ``rot`` the
    rotary part of the head dimension). ``scaled``: (cos, sin, scaling) as the model applies them, unscaled."""
    model = store.cache.model
    if model is None:  # a cache made without its model (the probe's replay)
        raise MethodConfigError(f"method={store.policy.method.name} needs the model's rotary embedding, and this "
                                "cache has no model (the probe replays without one); allowed: a cache made by "
                                "new_cache(model, method)")
    rope = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rope is None:
        raise RuntimeError(f"{type(model).__name__} has no model.rotary_emb: keys cannot be re-rotated")
    x = store._k[:1, :1, :1].float() if store._k is not None else torch.zeros(1, device=positions.device)
    layer_type = store.policy.info.layer_type
    if "layer_type" in inspect.signature(rope.forward).parameters:  # one RoPE per layer type (Gemma3)
        cos, sin = rope(x, positions, layer_type=layer_type)  # [1, m, rot]
        scale = getattr(rope, f"{layer_type}_attention_scaling", None)
    else:
        cos, sin = rope(x, positions)
        scale = getattr(rope, "attention_scaling", None)
    scale = float(scale or 1.0)
    cos, sin = cos[0].float() / scale, sin[0].float() / scale
    return (cos, sin, scale) if scaled else (cos, sin)
