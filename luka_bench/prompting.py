"""A QA item's prompt as token ids, laid out for the tail rule (``engine``: no token is scored or generated from
logits computed before the method's compression of what precedes it): what is prefilled and compressed, and the
*tail* of at least one token fed through the compressed cache before the first scored or generated token.

- ``plan_qa``: a QA dataset's prompts as token ids (context part, each question part and its query-aware tail,
  its new-token limit, the evidence positions), checked against the model's context before any work is done;
- ``with_tail``: (compressed part, tail) with a tail of at least one token;
- where the tail starts: ``qa_tail`` (the query-aware protocol: everything after the question's text — the chat
  template's end of turn and assistant header (``generation_prompt``) and the answer prefix), ``text_tail``
  (the tokens of a text's known ending, e.g. lm-eval's generation prompt).

Prompt building only: nothing here runs the model (``engine`` does).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def with_tail(head: list[int], tail: list[int]) -> tuple[list[int], list[int]]:
    """(compressed part, tail) with a tail of at least one token: an empty tail takes the head's last token (the
    tail rule: the first scored or generated token comes from logits computed through the compressed cache)."""
    head, tail = list(head), list(tail)
    if not tail:
        if len(head) < 2:
            raise ValueError(f"a prompt of {len(head)} token(s) cannot be split into a compressed part and a tail; "
                             "allowed: at least 2 tokens")
        head, tail = head[:-1], head[-1:]
    return head, tail


# ---------------------------------------------------------------------------------------------------------
# Where the tail starts in a prompt
# ---------------------------------------------------------------------------------------------------------

def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def text_tail(encode, text: str, tail_text: str) -> int:
    """How many of ``encode(text)``'s last tokens are ``tail_text`` (which ``text`` ends with): the tokens after
    the longest common prefix of ``encode(text)`` and ``encode(text minus tail_text)`` (a token that straddles the
    boundary goes to the tail). At least 1 (the tail rule); 1 when ``text`` does not end with ``tail_text``."""
    if not tail_text or not text.endswith(tail_text):
        return 1
    ids = list(encode(text))
    head = list(encode(text[: len(text) - len(tail_text)]))
    return max(1, len(ids) - _common_prefix(ids, head))


def generation_prompt(tokenizer) -> str | None:
    """What a chat template puts after a user message's text when the assistant's turn is opened (the end of the
    user's turn and the assistant header, e.g. SmolLM2's ``<|im_end|>\\n<|im_start|>assistant\\n``); None without a
    template, or when the template does not end the message right after its text."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    from luka_bench.data.base import chat_text

    marker = "\u2063LUKATAIL\u2063"
    try:
        text = chat_text(tokenizer, marker)
    except Exception:  # noqa: BLE001 - a template that refuses a lone user message: no generation prompt known
        return None
    if text.count(marker) != 1:
        return None
    return text.split(marker)[1] or None


def qa_tail(tokenizer, use_chat: bool, context_block: str, question_block: str, answer_prefix: str) -> int:
    """The query-aware tail of a QA prompt whose question part ``data.base.qa_prompt_ids`` tokenised: how many of
    that part's last tokens come after the question's text — with a chat template the end of the user's turn, the
    assistant header (``generation_prompt``) and the answer prefix; without one the answer prefix. At least 1 (the
    tail rule; kvpress's query-aware protocol: the question is compressed with the context, the rest goes through
    the compressed cache)."""
    encode = (lambda s: tokenizer(s, add_special_tokens=False).input_ids)
    if use_chat:
        from luka_bench.data.base import chat_text

        marker = "\u2063LUKASPLIT\u2063"  # the split qa_prompt_ids makes: the question part's text is after it
        text = chat_text(tokenizer, context_block + marker + question_block).split(marker)[1] + answer_prefix
        tail_text = (generation_prompt(tokenizer) or "") + answer_prefix
    else:
        text, tail_text = question_block + answer_prefix, answer_prefix
    return text_tail(encode, text, tail_text)


# ---------------------------------------------------------------------------------------------------------
# QA prompts: planned once, for every client
# ---------------------------------------------------------------------------------------------------------

@dataclass
class QuestionPlan:
    question: Any  # data.base.Question
    ids: list[int]  # the question part of the prompt (after the context part)
    max_new_tokens: int
    tail: int = 1  # query-aware protocol: the last ``tail`` ids (end of turn, assistant header, answer prefix)


@dataclass
class ExamplePlan:
    example: Any  # data.base.QAExample
    context_ids: list[int]
    questions: list[QuestionPlan]
    evidence: list[int] | None = None  # token positions of the supporting facts, when the dataset gives them
    question_ids: list[int] = field(default_factory=list)  # every question's ids in order (question-aware methods)


def plan_qa(task, lm, max_new_tokens: int | None = None, questions: int | None = None,
            evidence: bool = True) -> list[ExamplePlan]:
    """Every example's prompt as token ids, with the dataset's prompt blocks, answer prefix and chat template;
    ``max_new_tokens`` (None: each question's own, ``Task.max_new_tokens_for``) reserved after it. The first
    ``questions`` questions of each example (None: all). An over-long prompt is a one-line ``PromptTooLong``
    before any work is done."""
    from luka_bench.data.base import evidence_positions, qa_prompt_ids
    from luka_bench.errors import PromptTooLong

    tok = lm.tokenizer
    task.prepare(tok, lm.max_context - (max_new_tokens or task.max_new_tokens), chat_template=lm.chat_template)
    plans = []
    for ex in task.examples():
        ctx_ids, qs = None, []
        for q in ex.questions[: questions if questions else None]:
            c, qi = qa_prompt_ids(tok, lm.chat_template, task.context_block(ex), task.question_block(q),
                                  task.answer_prefix(q))
            ctx_ids = ctx_ids or c
            new = int(max_new_tokens if max_new_tokens is not None else task.max_new_tokens_for(q))
            need = len(c) + len(qi) + new
            if need > lm.max_context:
                raise PromptTooLong(
                    f"example {ex.id!r} needs {need} tokens (context {len(c)} + question {len(qi)} + "
                    f"{new} new) but model.max_context={lm.max_context} for '{lm.name}'; allowed: <= "
                    f"{lm.max_context} — use a shorter data setting or a model with a longer context")
            qs.append(QuestionPlan(q, qi, new, qa_tail(tok, lm.chat_template, task.context_block(ex),
                                                       task.question_block(q), task.answer_prefix(q))))
        ev = None
        spans = task.evidence_spans(ex) if evidence else None
        if spans:
            ev = evidence_positions(tok, lm.chat_template, task.context_block(ex), spans)
        plans.append(ExamplePlan(ex, ctx_ids, qs, ev, [t for p in qs for t in p.ids]))
    return plans
