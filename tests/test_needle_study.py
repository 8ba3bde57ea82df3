"""scripts/needle_study.py builds the issue-28 NIAH protocol: the needle tokens it reports are the needle, the digit
tokens are the number, the question ends with the answer prefix, the prompt is about the asked length, and the
needle sits at the asked depth."""
from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.parametrize("i", [0, 5, 9])
def test_prompt_protocol(smollm2_tokenizer, i):
    import needle_study as N

    tok = smollm2_tokenizer
    pr = N.build_prompt(tok, N.haystack_text(), i, 3700)
    needle = N.NEEDLE.format(key=pr["key"], value=pr["value"])
    assert tok.decode([pr["ctx"][j] for j in pr["needle"]]).strip() == needle
    assert tok.decode([pr["ctx"][j] for j in pr["digits"]]).strip() == pr["value"]
    assert pr["needle"] == list(range(pr["needle"][0], pr["needle"][-1] + 1))  # one contiguous span
    assert tok.decode(pr["q"]).rstrip().endswith(N.ANSWER_PREFIX.format(key=pr["key"]))
    assert N.QUESTION.format(key=pr["key"]) in tok.decode(pr["q"])
    assert 3500 <= len(pr["ctx"]) + len(pr["q"]) <= 3800
    assert abs(pr["needle"][0] / len(pr["ctx"]) - pr["depth"]) < 0.05
    assert len(pr["value"]) == 7 and N.INSTRUCTION in tok.decode(pr["ctx"][:80])
