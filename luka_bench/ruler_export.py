"""``python -m luka_bench.ruler_export``: write a generated RULER set in the hub schema, or print its lengths.

    python -m luka_bench.ruler_export export --model smollm2_135m --task all --length 4096 --limit 10 --out ruler.jsonl
    python -m luka_bench.ruler_export lengths --model smollm2_135m --length 4096,8192,16384

``export`` writes one JSON line per sample with the fields of the ``simonjegou/ruler`` set (context, question,
answer_prefix, answer, task, max_new_tokens), so the exact items can be run by another harness, and read back
here with ``data.source=file data.path=<file>`` to the same prompts. Lengths are measured with the tokenizer of
``--model`` (a ``conf/model`` name; only a hub model's tokenizer is fetched, not its weights) or ``--tokenizer``
(a hub id or folder), with its chat template unless ``--no-chat-template``: another tokenizer or template gives
other lengths. ``lengths`` prints each task's prompt + tokens to generate and what one more haystack step costs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from luka_bench.data.base import DataError
from luka_bench.data.ruler import QA_SOURCES, TASKS, Ruler

__all__ = ["export_rows", "length_table", "load_tokenizer", "main"]


def load_tokenizer(model: str | None, tokenizer: str | None, chat: bool | None):
    """(tokenizer, chat template on, a label): ``tokenizer`` (a hub id or folder) when given, else the tokenizer of
    ``conf/model/<model>.yaml``, with its chat template when the model config and the tokenizer have one (as a
    run uses it) unless ``chat`` says otherwise."""
    from transformers import AutoTokenizer

    if tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer)
        except (OSError, ValueError) as e:
            raise DataError(f"--tokenizer={tokenizer!r} cannot be loaded ({type(e).__name__}); allowed: a hub id "
                            "or a folder with a tokenizer") from None
        use, label = True if chat is None else chat, tokenizer
    else:
        from hydra.utils import instantiate
        from omegaconf import OmegaConf

        from luka_bench.errors import CONF_DIR, group_options
        from luka_bench.models import HubModel

        if model not in group_options("model"):
            raise DataError(f"--model={model!r} is unknown; allowed: {', '.join(group_options('model'))}")
        loader = instantiate(OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml"))
        if isinstance(loader, HubModel):  # the tokenizer alone: an 8B model's weights are not needed to count
            tok = AutoTokenizer.from_pretrained(loader.repo_id, revision=loader.revision)
        else:  # a GGUF package (converted once, then ~1 s) or a tiny model (its byte tokenizer)
            tok = loader.load().tokenizer
        use, label = (loader.chat_template if chat is None else chat), model
    has = getattr(tok, "chat_template", None) is not None
    if chat and not has:
        raise DataError(f"--chat-template asked, but {label}'s tokenizer has no chat template; allowed: "
                        "--no-chat-template")
    return tok, bool(use and has), label


def export_rows(ruler: Ruler) -> list[dict]:
    """The prepared ``ruler``'s samples as rows of the hub schema (``HUB_FIELDS``), in task order."""
    rows = []
    for ex in ruler.examples():
        q = ex.questions[0]
        rows.append({"context": ex.context, "question": q.question, "answer_prefix": q.meta["answer_prefix"],
                     "answer": list(q.answers), "task": q.meta["task"],
                     "max_new_tokens": int(q.meta["max_new_tokens"])})
    return rows


def length_table(tok, chat: bool, tasks: str, lengths: list[int], seed: int, haystack: str, qa_source: str) -> str:
    """Markdown: task x length, each cell the first sample's prompt + tokens to generate and the tokens one
    more haystack step would add (the same sample, one of RULER's steps larger)."""
    cells: dict[str, list[str]] = {}
    for n in lengths:
        r = Ruler(task=tasks, length=n, limit=1, seed=seed, haystack=haystack, qa_source=qa_source)
        r.prepare(tok, None, chat)
        for ex in r.examples():
            t, total, units = ex.meta["task"], ex.meta["total_tokens"], ex.meta["haystack_units"]
            _, bigger = r.draw(t, 0, units + r.step(t))
            cells.setdefault(t, []).append(f"{total:,} (+{bigger - total:,})")
    head = "| task | " + " | ".join(f"{n:,}" for n in lengths) + " |\n|---|" + "--:|" * len(lengths) + "\n"
    return head + "".join(f"| {t} | " + " | ".join(v) + " |\n" for t, v in cells.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m luka_bench.ruler_export", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a generated set in the hub schema (JSON lines)")
    ln = sub.add_parser("lengths", help="print each task's total tokens (prompt + to generate) per length")
    for s in (ex, ln):
        who = s.add_mutually_exclusive_group()
        who.add_argument("--model", default="smollm2_135m", help="a conf/model name (default smollm2_135m)")
        who.add_argument("--tokenizer", help="a hub id or folder instead of --model")
        s.add_argument("--chat-template", dest="chat", action=argparse.BooleanOptionalAction, default=None,
                       help="wrap prompts in the tokenizer's chat template (default: as the model config says)")
        s.add_argument("--task", default="all", help="all, one task or a comma list (as data.task)")
        s.add_argument("--seed", type=int, default=42)
        s.add_argument("--haystack", default="essays", help="essays or a text file (as data.haystack)")
        s.add_argument("--qa-source", default="synthetic", choices=QA_SOURCES,
                       help="qa_1/qa_2 documents (as data.qa_source)")
    ex.add_argument("--length", type=int, required=True, help="tokens per sample (as data.length)")
    ex.add_argument("--limit", type=int, default=10, help="samples per task (as data.limit)")
    ex.add_argument("--out", required=True, help="the JSON-lines file to write")
    ln.add_argument("--length", default="4096,8192,16384", help="comma list of lengths")
    a = p.parse_args(argv)
    from luka_bench.models import ModelConfigError, ModelUnavailable

    try:
        tok, chat, label = load_tokenizer(None if a.tokenizer else a.model, a.tokenizer, a.chat)
        if a.command == "lengths":
            try:
                lengths = [int(x) for x in a.length.split(",") if x.strip()]
            except ValueError:
                raise DataError(f"--length={a.length!r} must be a comma list of integers, e.g. 4096,8192") from None
            for n in lengths:  # bad values fail here, before any generation
                Ruler(task=a.task, length=n, seed=a.seed, haystack=a.haystack, qa_source=a.qa_source)
            print(f"RULER lengths, {label} tokenizer, chat template {'on' if chat else 'off'}, seed {a.seed}, sample 0:"
                  " prompt + tokens to generate (+ tokens one more haystack step would add)\n")
            print(length_table(tok, chat, a.task, lengths, a.seed, a.haystack, a.qa_source))
            return 0
        r = Ruler(task=a.task, length=a.length, limit=a.limit, seed=a.seed, haystack=a.haystack,
                  qa_source=a.qa_source)
        r.check()
        r.prepare(tok, None, chat)
        rows = export_rows(r)
    except (DataError, ModelUnavailable, ModelConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    qa = any(TASKS[t]["family"] == "qa" for t in r.tasks)
    task_arg = f"data.task={r.task}" if "," not in r.task else f"'data.task=[{r.task}]'"
    print(f"wrote {len(rows)} rows ({r.task}, length {a.length} with {label}'s tokenizer, chat template "
          f"{'on' if chat else 'off'}, seed {a.seed}) to {out}"
          + (f"; qa_1/qa_2 from qa_source={a.qa_source}" if qa else "") + "\nread back: python -m luka_bench "
          f"data=ruler data.source=file data.path={out} data.length={a.length} {task_arg} data.limit=null",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
