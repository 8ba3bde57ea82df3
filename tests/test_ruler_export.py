"""``python -m luka_bench.ruler_export export``: a generated RULER set written in the hub schema reads back with
data.source=file to the same prompts (same token ids), answers and tokens to generate; ``lengths`` prints the
table; bad input is one line."""
from __future__ import annotations

import json

from conftest import ROOT

from luka_bench.data.base import qa_prompt_ids
from luka_bench.data.ruler import HUB_FIELDS, TASKS, Ruler
from luka_bench.ruler_export import export_rows, main
from luka_bench.models import byte_tokenizer


def _prompts(r: Ruler, tok, chat: bool):
    out = []
    for ex in r.examples():
        q = ex.questions[0]
        c, qi = qa_prompt_ids(tok, chat, r.context_block(ex), r.question_block(q), r.answer_prefix(q))
        out.append((ex.meta["task"], c, qi, q.answers, r.max_new_tokens_for(q)))
    return out


def test_every_task_reads_back_to_the_same_prompt_ids(smollm2_tokenizer, tmp_path):
    r = Ruler(task="all", length=2048, limit=1, seed=5)
    r.prepare(smollm2_tokenizer, None, True)
    rows = export_rows(r)
    assert all(tuple(row) == HUB_FIELDS for row in rows) and [row["task"] for row in rows] == list(TASKS)
    path = tmp_path / "ruler_2048.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    back = Ruler(task="all", length=2048, source="file", path=str(path), limit=None)
    back.prepare(smollm2_tokenizer, None, True)
    assert _prompts(back, smollm2_tokenizer, True) == _prompts(r, smollm2_tokenizer, True)


def test_the_command_writes_what_the_file_source_reads(tmp_path, capsys):
    out = tmp_path / "sub" / "ruler.jsonl"
    args = ["--model", "tiny_llama", "--task", "niah_single_1,vt", "--length", "2000", "--seed", "3"]
    assert main(["export", *args, "--limit", "2", "--out", str(out)]) == 0
    assert "'data.task=[niah_single_1,vt]'" in capsys.readouterr().err  # how to read it back
    tok = byte_tokenizer()  # tiny_llama's: no chat template
    made = Ruler(task="niah_single_1,vt", length=2000, limit=2, seed=3)
    made.prepare(tok, None, False)
    back = Ruler(task="niah_single_1,vt", length=2000, source="file", path=str(out), limit=None)
    back.prepare(tok, None, False)
    assert _prompts(back, tok, False) == _prompts(made, tok, False) and len(_prompts(back, tok, False)) == 4
    assert main(["lengths", *args]) == 0
    table = capsys.readouterr().out
    assert "| task | 2,000 |" in table and "| vt | " in table and "chat template off" in table


def test_bad_input_is_one_line(capsys):
    code = main(["export", "--model", "nope", "--length", "4096", "--out", "x.jsonl"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "'nope'" in lines[0] and "smollm2_135m" in lines[0] and "tiny_llama" in lines[0]
    assert not (ROOT / "x.jsonl").exists()
