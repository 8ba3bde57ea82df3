"""The public API (``import luka_bench as lb``): load a model, build a method, attach it, generate.

    lm = lb.load_model("smollm2_135m")
    method = lb.method("snapkv", budget=0.125)
    with lb.attach(lm, method) as kv:
        answer = kv.generate(context, question="...", max_new_tokens=32)     # context compressed, question not
        out = lm.model.generate(ids, past_key_values=kv.new_cache(), max_new_tokens=32)   # plain transformers

``kv.generate`` is the runner's protocol (``luka_bench.engine``, its tail rule: the first answer token comes from
logits computed through the compressed cache); ``model.generate`` through ``kv.new_cache()``
runs the method too: the first forward through a fresh cache is the prefill, compressed after it, and every later
forward is a decode step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from luka_bench import engine as E
from luka_bench.metrics import kv_ratio
from luka_bench.prompting import qa_tail, with_tail


def method(name: str, /, **settings):
    """A KV method from ``conf/method/<name>.yaml`` with ``settings`` on top (``budget=0.125``), validated as the
    command line validates ``method=<name> method.<key>=<value>``: an unknown name, key or value is one line
    naming it and the allowed ones."""
    from luka_bench.config import build_group

    return build_group("method", name, **settings)


def load_model(spec, tokenizer=None, **settings):
    """A model and its tokenizer (``LoadedModel``: ``.model``, ``.tokenizer``, ``.max_context``, ...) from
    - a ``conf/model`` name (``"smollm2_135m"``), ``settings`` on top (``dtype="bfloat16"``);
    - a hub id or a local folder in the hub layout (``"Qwen/Qwen3-4B-Instruct-2507"``), ``settings`` as
      ``conf/model``'s hub settings (``dtype``, ``device``, ``revision``, ``max_context``, ``chat_template``);
    - a model already loaded (a transformers ``PreTrainedModel``; pass its ``tokenizer``), used as it is."""
    from luka_bench.errors import group_options
    from luka_bench.models import HubModel, LoadedModel

    if isinstance(spec, LoadedModel):
        return spec
    if isinstance(spec, torch.nn.Module):
        cfg = spec.config.get_text_config()
        return LoadedModel(spec, tokenizer, getattr(spec.config, "name_or_path", type(spec).__name__),
                           int(settings.get("max_context") or getattr(cfg, "max_position_embeddings", 2048)),
                           bool(settings.get("chat_template", True)) and getattr(tokenizer, "chat_template", None)
                           is not None, {"device": str(spec.device), "dtype": str(spec.dtype).replace("torch.", "")})
    spec = str(spec)
    if spec in group_options("model"):
        from luka_bench.config import build_group

        loader = build_group("model", spec, **settings)
    else:
        if "/" not in spec and not Path(spec).expanduser().is_dir():
            from luka_bench.models import ModelUnavailable

            raise ModelUnavailable(f"model {spec!r} is neither a conf/model name nor a hub id (owner/name) nor a "
                                   f"local folder; conf/model names: {', '.join(group_options('model'))}")
        loader = HubModel(name=spec, repo_id=spec, **settings)
    loader.check()
    return loader.load()


@dataclass
class Answer:
    """What ``KV.generate`` returns: the text, and what the method held and read doing it."""

    text: str
    token_ids: list[int]
    context_tokens: int
    question_tokens: int
    kv_ratio: float | None  # bytes held at most while decoding / what full attention would hold then
    kv_ratio_context: float | None  # the same right after the context's prefill and compression
    kv_tokens: list[int]  # tokens each layer holds at the end
    attended_tokens: float | None  # held tokens attention read per decode step and layer (mean over KV heads)
    attended_ratio: float | None  # read / held
    prefill_s: float
    tpot_s: float | None
    method_stats: dict = field(default_factory=dict)
    tail_tokens: int = 0  # tokens fed through the compressed cache before the first answer token (the tail rule)

    def __str__(self) -> str:
        return self.text


class KV:
    """A method attached to a model (``attach``): ``generate`` answers with the runner's protocol; ``new_cache``
    gives a cache for plain transformers calls (``model(...)``, ``model.generate``)."""

    def __init__(self, attached, tokenizer, chat_template: bool):
        self.attached = attached
        self.model = attached.model
        self.method = attached.method
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def new_cache(self, **kwargs):
        """A fresh cache for one prompt (keyword arguments: ``luka_bench.methods.hf.MethodCache``)."""
        return self.attached.new_cache(**kwargs)

    def prefilled_cache(self, ids, tail: int = 1, **kwargs):
        """A fresh cache with all but the last ``tail`` tokens of ``ids`` (a prompt: token ids, [1, n] or flat)
        prefilled and compressed, for ``model.generate(ids, past_key_values=cache)``: generate then feeds the tail
        through the compressed cache before its first token (the engine's tail rule). Keyword arguments:
        ``MethodCache``'s (``reference_length`` defaults to the compressed part)."""
        flat = [int(t) for t in (ids.reshape(-1).tolist() if torch.is_tensor(ids) else ids)]
        head, _ = with_tail(flat[: len(flat) - tail], flat[len(flat) - tail:])
        kwargs.setdefault("reference_length", len(head))
        cache = self.new_cache(**kwargs)
        E.prefill(self.model, head, cache)
        return cache

    def _ids(self, context, question, answer_prefix: str) -> tuple[list[int], list[int]]:
        if not isinstance(context, str):  # token ids
            q = [] if question is None else list(question)
            if isinstance(question, str):
                raise TypeError("with context given as token ids, give the question as token ids too")
            return [int(t) for t in context], [int(t) for t in q]
        if self.tokenizer is None:
            raise ValueError("text needs a tokenizer: lb.attach(model, method, tokenizer)")
        from luka_bench.data.base import qa_prompt_ids

        return qa_prompt_ids(self.tokenizer, self.chat_template, context, question or "", answer_prefix)

    def generate(self, context, question=None, max_new_tokens: int = 32, stop_strings: tuple[str, ...] = (),
                 answer_prefix: str = "", question_aware: bool = True, query_aware: bool = False) -> Answer:
        """Greedy answer to ``question`` about ``context`` (text, or token ids), under the engine's tail rule: the
        context is prefilled and compressed by the method; the question part (question, the chat template's end of
        turn and assistant header, ``answer_prefix``) is then fed through the compressed cache, not compressed
        (question-aware methods see its ids at the prefill, as in the runner, unless ``question_aware=False``);
        logical positions are kept. With a chat template (the tokenizer's) the user message is context +
        question. Without a question the context is the whole prompt: its last token is the tail.
        ``query_aware=True`` (the runner's ``query_aware=true``, kvpress's protocol; text only): the question is
        compressed with the context, and only what follows the question's text is the tail."""
        return self.generate_many([context], [question], max_new_tokens, stop_strings, answer_prefix, question_aware,
                                  query_aware, batch_size=1)[0]

    def generate_many(self, contexts: list, questions: list | None = None, max_new_tokens: int = 32,
                      stop_strings: tuple[str, ...] = (), answer_prefix: str = "", question_aware: bool = True,
                      query_aware: bool = False, batch_size: int = 8) -> list[Answer]:
        """``generate`` for many prompts (``questions``: one per context, or None), ``batch_size`` at a time: each
        prompt prefilled, compressed and fed its tail alone in its own cache (its compression is exactly the solo
        one), then the batch's rows decoded together, one forward per step over the rows still running
        (``engine.greedy_decode_rows``): every answer equals ``generate``'s for its prompt alone, whatever its
        length or its partners. Answers in the order of ``contexts``; an answer's ``tpot_s`` is its batch's step."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be an integer >= 1")
        questions = [None] * len(contexts) if questions is None else list(questions)
        if len(questions) != len(contexts):
            raise ValueError(f"{len(contexts)} contexts and {len(questions)} questions; allowed: one question per "
                             f"context (or questions=None)")
        model, eos = self.model, E.eos_token_ids(self.model, self.tokenizer)
        answers = []
        for group in E.in_batches(zip(contexts, questions), batch_size):
            rows = []
            for context, question in group:
                ctx, q, head, tail_ids, cache_kw = self._plan(context, question, answer_prefix, question_aware,
                                                              query_aware)
                cache = self.new_cache(**cache_kw)
                info = E.timed_prefill(model, head, cache)
                rows.append((ctx, q, tail_ids, cache, info, E.feed(model, tail_ids, cache)))
            gens = E.greedy_decode_rows(model, self.tokenizer, [r[3] for r in rows], torch.stack([r[5] for r in rows]),
                                        max_new_tokens, eos, tuple(stop_strings))
            answers += [self._answer(ctx, q, tail_ids, cache, info, gen)
                        for (ctx, q, tail_ids, cache, info, _), gen in zip(rows, gens)]
        return answers

    def _plan(self, context, question, answer_prefix: str, question_aware: bool, query_aware: bool):
        """A prompt's layout under the tail rule: (context ids, question ids, the compressed part, the tail, the
        cache's settings)."""
        ctx, q = self._ids(context, question, answer_prefix)
        tail = len(q)
        if query_aware:
            if not isinstance(context, str):
                raise TypeError("query_aware=True needs the context and question as text (where the question "
                                "ends is read from the text)")
            tail = qa_tail(self.tokenizer, self.chat_template, context, question or "", answer_prefix) if q else 0
        head, tail_ids = with_tail(ctx + q[: len(q) - tail], q[len(q) - tail:] if tail else [])
        aware = q if (q and question_aware and not query_aware) else None
        cache_kw = {"reference_length": len(head), "question_ids": aware,
                    "question_span": max(0, len(head) - len(ctx)) if query_aware else 0}
        return ctx, q, head, tail_ids, cache_kw

    @staticmethod
    def _answer(ctx, q, tail_ids, cache, info, gen) -> Answer:
        mem = E.memory(cache)
        att = gen.attended or {}
        return Answer(
            text=gen.text, token_ids=gen.token_ids, context_tokens=len(ctx), question_tokens=len(q),
            kv_ratio=kv_ratio(mem["kv_bytes_peak"], mem["kv_bytes_full"]),
            kv_ratio_context=kv_ratio(info["kv_bytes_prefill"], info["kv_bytes_full_prefill"]),
            kv_tokens=mem["kv_tokens"], attended_tokens=att.get("attended_tokens"),
            attended_ratio=att.get("attended_ratio"), prefill_s=info["prefill_s"],
            tpot_s=sum(gen.step_s) / len(gen.step_s) if gen.step_s else None, method_stats=mem["method_stats"],
            tail_tokens=len(tail_ids))


@contextlib.contextmanager
def attach(model, method_or_name: Any, tokenizer=None, chat_template: bool | None = None):
    """Route ``model``'s attention through a KV method for the block; yields a ``KV``. ``model``: a
    ``LoadedModel`` (``load_model``'s) or a transformers model (give its ``tokenizer`` for text); the method: a
    ``method(...)`` or a conf/method name. ``chat_template``: wrap prompts in the tokenizer's chat template
    (default: when it has one; a ``LoadedModel``: its own setting)."""
    from luka_bench.methods.hf import attach as hf_attach
    from luka_bench.models import LoadedModel

    if isinstance(model, LoadedModel):
        tokenizer = tokenizer or model.tokenizer
        chat_template = model.chat_template if chat_template is None else chat_template
        model = model.model
    m = method(method_or_name) if isinstance(method_or_name, str) else method_or_name
    if chat_template is None:
        chat_template = getattr(tokenizer, "chat_template", None) is not None
    with hf_attach(model, m, tokenizer) as attached:
        yield KV(attached, tokenizer, bool(chat_template))
