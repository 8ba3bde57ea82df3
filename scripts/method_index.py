"""The index of the methods, ``methods/README.md``: one row per config in ``conf/method/`` — its card, config, code,
kind, reference code, kvpress press and tests — generated from the tree (``tests/test_method_index.py`` keeps the
committed file equal to what this writes).

    .venv/bin/python scripts/method_index.py           # (re)write methods/README.md
    .venv/bin/python scripts/method_index.py --check   # exit 1 if methods/README.md is not what the tree gives

Nothing in the table is kept by hand; each column is read from the tree:

- **method**: the config's file name, what ``method=<name>`` selects.
- **card**: ``methods/<name>.md`` if it exists, else the card the config's header comment names (``h2o_outer``:
  ``methods/layered.md``).
- **config**: ``conf/method/<name>.yaml``. A config without ``_target_`` is a variant of the config its ``defaults``
  list names (the LASER-KV paper's ``laser_kv_*`` rows): it runs that config's code.
- **code**: the module of the config's ``_target_``, then those of its nested ``_target_`` (a per-layer assignment's
  layer methods).
- **kind**: read from the code of the method's layer policy (``policy_class``, its base classes included) and of the
  method; the first rule that holds:
    - *decode-time*: the policy overrides ``after_step``: it changes what is held after every forward past the
      prefill (evicts or compresses while decoding);
    - *retrieval*: the policy has a fixed-shape decode step (``static_decode``) and overrides ``attended``: it holds
      every token and each decode step reads the subset it selects (pages, chunks, clusters, the true top-k);
    - *prefill*: the policy overrides ``after_prefill`` (every scorer does: ``ScorerPolicy``), or the method
      ``after_prefill_cache`` or ``after_forward``: it selects what to keep once, during or after the prefill;
    - *exact*: none of these (full attention).
  A config with nested methods (``Layered``) has the kinds of those, *exact* left out unless it is all there is.
- **reference code**: the repositories the card's lead paragraph (the first after its title: **Paper.**,
  **Source.**) names — a GitHub link, a backticked ``owner/name`` or ``owner/name`` right after "Reference code:" —
  with the commit it gives (``at <sha>``); *NVIDIA kvpress* where the lead names no repository but a kvpress press
  (kvpress is the reference: FINCH, ExpectedAttention); *none public* where the lead says no public code exists. A
  variant config whose card names none has its parent's.
- **kvpress**: the first NVIDIA kvpress press the card's lead names in backticks (``XPress`` or a composition,
  ``AdaKVPress(SnapKVPress())``); a variant config's parent's where its card names none.
- **tests**: the test files (``tests/test_*.py``, but this index's own test) that name the method: its config name
  quoted (``"snapkv"``), ``method=<name>``, ``conf/method/<name>.yaml`` or ``methods/<name>.md``, and, for a config
  named after its code module, the class (called, read or imported: ``SnapKV(``) or the module
  (``methods.snapkv``). The tests that go over every config (a glob of ``conf/method/*.yaml`` or the config
  group's options) are listed once, under the table.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf" / "method"
CARDS = ROOT / "methods"
TESTS = ROOT / "tests"
INDEX = CARDS / "README.md"
OWN_TEST = "test_method_index.py"
KINDS = ("prefill", "decode-time", "retrieval", "exact")
COMMAND = ".venv/bin/python scripts/method_index.py"


@dataclass(frozen=True)
class Row:
    name: str
    card: Path
    config: Path
    code: tuple[Path, ...]
    kind: str
    reference: tuple[str, ...]
    kvpress: str
    tests: tuple[str, ...]


# -- the config -------------------------------------------------------------------------------------------------
def load_config(name: str) -> tuple[dict, str | None]:
    """The config's settings, a variant's merged over its parent's, and the parent's name (None: not a variant)."""
    cfg = yaml.safe_load((CONF / f"{name}.yaml").read_text(encoding="utf-8")) or {}
    parents = [d for d in cfg.pop("defaults", []) or [] if isinstance(d, str) and d != "_self_"]
    if "_target_" in cfg or not parents:
        return cfg, None
    merged, _ = load_config(parents[0])
    return {**merged, **cfg}, parents[0]


def header(name: str) -> str:
    """The comment lines at the top of the config."""
    lines = []
    for line in (CONF / f"{name}.yaml").read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return " ".join(lines)


def targets(cfg) -> list[str]:
    """Every ``_target_`` of the config, the top one first, then the nested ones in the order they appear."""
    found = [cfg["_target_"]] if isinstance(cfg, dict) and "_target_" in cfg else []
    children = cfg.values() if isinstance(cfg, dict) else cfg if isinstance(cfg, list) else []
    for child in children:
        found += [t for t in targets(child) if t not in found]
    return found


def module_file(target: str) -> Path:
    return ROOT / (target.rsplit(".", 1)[0].replace(".", "/") + ".py")


def load_class(target: str):
    module, name = target.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


# -- the kind ---------------------------------------------------------------------------------------------------
def method_kind(cls) -> str:
    """The kind of one method class (the rule in the module docstring)."""
    from luka_bench.methods.base import KVMethod, LayerPolicy

    policy = cls.policy_class

    def overrides(owner, base, hook: str) -> bool:
        return getattr(owner, hook, None) is not getattr(base, hook, None)

    if overrides(policy, LayerPolicy, "after_step"):
        return "decode-time"
    if policy.static_decode and overrides(policy, LayerPolicy, "attended"):
        return "retrieval"
    if overrides(policy, LayerPolicy, "after_prefill") or any(
            overrides(cls, KVMethod, hook) for hook in ("after_prefill_cache", "after_forward")):
        return "prefill"
    return "exact"


def config_kind(cfg: dict) -> str:
    from luka_bench.methods.base import KVMethod

    nested = [c for c in map(load_class, targets(cfg)[1:]) if isinstance(c, type) and issubclass(c, KVMethod)]
    kinds = {method_kind(c) for c in nested} or {method_kind(load_class(cfg["_target_"]))}
    shown = [k for k in KINDS if k in kinds and (k != "exact" or kinds == {"exact"})]
    return " + ".join(shown)


# -- the card ---------------------------------------------------------------------------------------------------
def card_of(name: str) -> Path:
    own = CARDS / f"{name}.md"
    if own.is_file():
        return own
    named = re.search(r"\bmethods/(\w+)\.md\b", header(name))
    return CARDS / f"{named.group(1) if named else name}.md"


def lead(card: Path) -> str:
    """The card's first paragraph after its title, on one line."""
    paragraphs = re.split(r"\n\s*\n", card.read_text(encoding="utf-8").strip())
    body = paragraphs[1] if paragraphs[0].startswith("#") and len(paragraphs) > 1 else paragraphs[0]
    return " ".join(body.split())


REPO = r"[A-Za-z0-9][A-Za-z0-9-]*/[A-Za-z0-9][\w.-]*[A-Za-z0-9]"
REFERENCE = re.compile(
    rf"(?:\[[^\]]*\]\(https://github\.com/(?P<link>{REPO})/?\)"   # [owner/name](https://github.com/owner/name)
    rf"|`(?P<tick>{REPO})`"                                       # `owner/name`
    rf"|Reference code:\s+(?P<bare>{REPO})(?![\w./-]))"           # Reference code: owner/name
    r"(?:\s+at\s+`(?P<sha>[0-9a-f]{7,40})`)?")                     # at `sha`
PRESS = re.compile(r"`([A-Z]\w*Press(?:\([^`]*\))?)`")


def references(text: str) -> tuple[str, ...]:
    if re.search(r"no public code", text, re.I):
        return ("none public",)
    out = []
    for m in REFERENCE.finditer(text):
        repo = m.group("link") or m.group("tick") or m.group("bare")
        if re.search(r"\.(py|md|cu|yaml|json|tsv)$", repo):
            continue  # a file path, not a repository
        shown = f"[{repo}](https://github.com/{repo})" if m.group("link") else f"`{repo}`"
        shown += f" at `{m.group('sha')}`" if m.group("sha") else ""
        if shown not in out:
            out.append(shown)
    return tuple(out) or (("NVIDIA kvpress",) if PRESS.search(text) else ())


def press(text: str) -> str:
    m = PRESS.search(text)
    return f"`{m.group(1)}`" if m else ""


# -- the tests --------------------------------------------------------------------------------------------------
def test_texts() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(TESTS.glob("test_*.py")) if p.name != OWN_TEST}


def naming(name: str, target: str) -> re.Pattern:
    """What names the method in a test file (the rule in the module docstring)."""
    module, cls = target.rsplit(".", 1)
    module = module.rsplit(".", 1)[-1]
    patterns = [rf"""["']{name}["']""", rf"\bmethod={name}\b", rf"conf/method/{name}\.yaml", rf"methods/{name}\.md"]
    if module == name:
        patterns += [rf"\b{cls}\b(?=[(.])", rf"\bimport\b[^\n]*\b{cls}\b", rf"\bmethods[./]{module}\b"]
    return re.compile("|".join(patterns))


EVERY_CONFIG = re.compile(r"""(?:CONF|"conf")\s*/\s*"method"|group_options\(\s*"method"\s*\)""")


def every_config_tests(texts: dict[str, str]) -> list[str]:
    """The test files that read every config of conf/method/ (a glob or the config group's options)."""
    return [n for n, s in texts.items() if EVERY_CONFIG.search(s) and ("glob(" in s or "group_options(" in s)]


# -- the rows and the page ----------------------------------------------------------------------------------------
def rows() -> list[Row]:
    texts = test_texts()
    out: list[Row] = []
    by_name: dict[str, Row] = {}
    for path in sorted(CONF.glob("*.yaml")):
        name = path.stem
        cfg, parent = load_config(name)
        card = card_of(name)
        text = lead(card) if card.is_file() else ""
        reference, kvpress = references(text), press(text)
        if parent and parent in by_name:
            reference = reference or by_name[parent].reference
            kvpress = kvpress or by_name[parent].kvpress
        rx = naming(name, cfg["_target_"])
        row = Row(name=name, card=card, config=path, code=tuple(module_file(t) for t in targets(cfg)),
                  kind=config_kind(cfg), reference=reference, kvpress=kvpress,
                  tests=tuple(n for n, s in texts.items() if rx.search(s)))
        by_name[name] = row
        out.append(row)
    return out


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _columns_doc() -> str:
    """The module docstring's account of the columns, as the page's last section."""
    doc = __doc__.split("Nothing in the table is kept by hand; each column is read from the tree:\n\n", 1)[1]
    return re.sub(r"``([^`]+)``", r"`\1`", doc).strip()


def render(table: list[Row] | None = None) -> str:
    table = rows() if table is None else table
    lines = [
        "# Methods: the index",
        "",
        f"<!-- Generated by scripts/method_index.py from the tree; do not edit by hand: run `{COMMAND}`"
        " (tests/test_method_index.py keeps this file equal to what it writes). -->",
        "",
        "One row per config in `conf/method/` (what `method=<name>` selects): its card (the paper, the settings, the",
        "differences from the reference and the invariants its tests check), the config, the code, the kind of method",
        "and where its reference implementation is. Kinds: *prefill* (selects once, during or after the prefill),",
        "*decode-time* (evicts or compresses while decoding), *retrieval* (holds every token, each decode step reads",
        "the subset it selects), *exact* (full attention).",
        "",
        "| method | card | config | code | kind | reference code | kvpress | tests (`tests/`) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        cells = [f"`{r.name}`", f"[{r.card.name}]({r.card.name})", f"`{_rel(r.config)}`",
                 "<br>".join(f"`{_rel(p)}`" for p in r.code), r.kind, "<br>".join(r.reference) or "—",
                 r.kvpress or "—", ", ".join(f"`{t}`" for t in r.tests)]
        lines.append("| " + " | ".join(cells) + " |")
    every = every_config_tests(test_texts())
    lines += ["", "Every config is also run, built or checked by the tests that go over every `conf/method/*.yaml`: "
              + ", ".join(f"`tests/{t}`" for t in every) + ".",
              "", "## How each column is derived", "", _columns_doc(), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if methods/README.md is not what the tree gives")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        held = INDEX.read_text(encoding="utf-8") if INDEX.is_file() else ""
        if held != text:
            sys.stdout.writelines(difflib.unified_diff(held.splitlines(True), text.splitlines(True),
                                                       _rel(INDEX), "generated"))
            print(f"methods/README.md is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(text, encoding="utf-8")
    print(f"wrote {_rel(INDEX)} ({text.count(chr(10) + '| `')} methods)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
