"""Prompts meet a chat template in one place (``luka_bench.data.base.chat_text``), with thinking off: a template
that branches on ``enable_thinking`` (as Qwen3's does) renders the assistant turn kvpress builds, and a template
without the switch renders as before."""
from __future__ import annotations

import copy
import re

from conftest import ROOT

from luka_bench.data.base import chat_text, evidence_positions, qa_prompt_ids
from luka_bench.models import byte_tokenizer

# The shape of Qwen3's template: with enable_thinking=false the assistant turn opens with an empty think block.
THINKING = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
            "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
            "{%- endif %}{%- endif %}")
PLAIN = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
         "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _tok(template: str):
    tok = copy.deepcopy(byte_tokenizer())
    tok.chat_template = template
    return tok


def test_a_template_that_can_think_gets_thinking_off():
    tok = _tok(THINKING)
    c, q = qa_prompt_ids(tok, True, "Some context.", "\nWhat is it?", " Answer:")
    assert tok.decode(c) == "<|im_start|>user\nSome context."
    assert tok.decode(q) == "\nWhat is it?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n Answer:"
    # the context part (and the evidence positions in it) is the same whatever the switch does after it
    assert evidence_positions(tok, True, "Some context.", [(5, 12)]) == list(range(len("<|im_start|>user\nSome "),
                                                                                  len(c) - 1))


def test_a_template_without_the_switch_renders_as_before():
    tok = _tok(PLAIN)
    msg = [{"role": "user", "content": "hello"}]
    assert chat_text(tok, "hello") == tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)


def test_every_chat_template_call_goes_through_chat_text():
    calls = {}
    for folder in ("luka_bench", "scripts"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            n = len(re.findall(r"apply_chat_template\(", f.read_text(encoding="utf-8")))
            if n:
                calls[f.relative_to(ROOT).as_posix()] = n
    # lm_eval.py overrides lm-eval's HFLM.apply_chat_template (its def and its super() call): lm-eval renders its
    # own prompts; the override only notes that a template is applied (where the tail starts: engine.py)
    assert calls == {"luka_bench/data/base.py": 1, "luka_bench/lm_eval.py": 2}, calls
