"""MkDocs build hook: the site shows files that live outside ``docs/`` where the project keeps them, so nothing
is copied and nothing goes stale.

- The method and dataset cards (``methods/*.md``, ``datasets/*.md``) become the pages ``methods/<name>.md`` and
  ``datasets/<name>.md``, read from their own files (engineers edit the cards, never a copy).
- The committed result summaries (``results/summaries/**``: Markdown tables, CSV, PNG) are served under
  ``results/summaries/``, so pages link to the files the report wrote.
- ``<!-- include: PATH -->`` on a line of its own is replaced by the file at PATH (from the repository root): a
  committed table (``results/summaries/.../pivot_*.md``) appears as the report wrote it, with the command that
  made it beside it. ``<!-- include-code: GLOB -->`` puts every matching file in a code block with its path
  (the configuration reference). A PATH that does not exist fails the build.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
CARDS = ("methods", "datasets")
SUMMARY_EXT = {".md", ".png", ".csv"}
INCLUDE = re.compile(r"^<!-- include(-code)?: (\S+) -->$", re.MULTILINE)


def _title(path: Path) -> str:
    first = path.read_text(encoding="utf-8").lstrip().splitlines()[:1]
    return first[0].lstrip("# ").strip() if first and first[0].startswith("#") else path.stem


def cards(kind: str) -> list[Path]:
    return sorted((ROOT / kind).glob("*.md"))


def on_files(files, config):
    for kind in CARDS:
        for card in cards(kind):
            files.append(File.generated(config, f"{kind}/{card.name}", abs_src_path=str(card)))
    for p in sorted((ROOT / "results" / "summaries").rglob("*")):
        if p.is_file() and p.suffix in SUMMARY_EXT:
            files.append(File.generated(config, p.relative_to(ROOT).as_posix(), abs_src_path=str(p)))
    return files


def on_config(config):
    """The Methods and Datasets sections of the navigation list every card there is. Link warnings are kept
    even under ``-q`` (which silences warnings, and with them ``--strict``'s count of them): a broken link
    fails ``mkdocs build --strict -q`` too."""
    for name in ("mkdocs.structure.pages", "mkdocs.structure.nav", "mkdocs.plugins"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for entry in config["nav"]:
        if isinstance(entry, dict):
            for kind, label in (("methods", "Methods"), ("datasets", "Datasets")):
                if label in entry and isinstance(entry[label], list):
                    entry[label] = [e for e in entry[label] if not (isinstance(e, dict) and any(
                        str(v).startswith(f"{kind}/") for v in e.values()))]
                    entry[label] += [{_title(c): f"{kind}/{c.name}"} for c in cards(kind)]
    return config


def _include(match: re.Match) -> str:
    code, pattern = match.group(1), match.group(2)
    paths = sorted(ROOT.glob(pattern)) if code else [ROOT / pattern]
    if not paths or not all(p.is_file() for p in paths):
        raise PluginError(f"include: {pattern} matches no file below {ROOT}")
    if not code:
        return paths[0].read_text(encoding="utf-8").rstrip("\n")
    return "\n\n".join(f"`{p.relative_to(ROOT).as_posix()}`\n\n```yaml\n{p.read_text(encoding='utf-8').rstrip()}\n```"
                       for p in paths)


def on_page_markdown(markdown, page, config, files):
    return INCLUDE.sub(_include, markdown)
