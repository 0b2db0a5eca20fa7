"""What `data.path` points at, read as a stream of documents.

A source is one of

- the default corpus (no path): this Python's standard-library source, one document per file;
- plain text: a file (any suffix but the ones below), or a folder searched recursively for text
  files (TEXT_SUFFIXES; hidden folders skipped), one document per file;
- JSONL: a `.jsonl` file, one JSON object per line, the document in its `text_field` key;
- parquet: a `.parquet` file, or a folder holding `.parquet` files (its other files ignored), the
  document in the `text_field` column;
- a saved Hugging Face `datasets` folder (`Dataset.save_to_disk`; of a saved DatasetDict its "train"
  split, any other split by pointing at its own folder), the document in the `text_field` column.

`open_source` decides the kind and checks what can be checked before reading (the path, the
columns of parquet and datasets sources); `Source.documents(max_bytes)` then yields (name, text)
one document at a time, in a fixed order, until at least max_bytes bytes of text were yielded
(whole documents; a document's size is its UTF-8 length). Nothing holds the corpus: JSONL is read
line by line, parquet in record batches, a datasets folder through its memory-mapped Arrow files in
batches, text files one file at a time. Empty or null texts are skipped. A document's name (its
file's relative path, FILE:LINE, FILE:ROW, SPLIT:ROW) decides its train/validation side
(text.DocumentSplit), so a document lands on the same side in every pass and every process.

`jsonl_objects` is the one JSON Lines reader: the documents here and task files (tasks.load_jsonl)
both read through it.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError

Document = tuple[str, str]  # (name, text)

TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".py", ".rst", ".json", ".jsonl", ".toml", ".yaml", ".yml",
    ".c", ".h", ".js", ".ts", ".html", ".css",
})
DEFAULT_TEXT_FIELD = "text"
"""data.text_field's default: the key or column a document's text is read from."""
ARROW_BATCH_ROWS = 1024
"""Rows read per record batch from parquet and datasets sources; bounds what is held at once."""
KINDS = ("default", "text", "jsonl", "parquet", "datasets")
PREPARE_JOURNAL = "prepare.journal.json"
"""Present in a folder `looplm data prepare` has not finished (prepared.py): not a source to read."""


# ----------------------------------------------------------------------------- JSON Lines

def jsonl_objects(path: str | Path, expected: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) for each non-blank line of a JSON Lines file, streamed.
    A UTF-8 byte-order mark on the first line and CRLF endings are accepted. Anything else raises
    UserError naming the file and the line; `expected` says what a line should be ("with "prompt"
    and "answer"")."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            # bytes, not text: a bad byte is reported on its own line, not for the whole file
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}, line {lineno}"
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise UserError(f"{where}: not valid UTF-8 (bad byte at column {e.start + 1})") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise UserError(f"{where}: expected a JSON object {expected}, got {type(obj).__name__}")
                yield lineno, obj
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None


# ----------------------------------------------------------------------------- sources

@dataclass(frozen=True)
class Source:
    """A corpus as data.path names it; `documents` streams it (see the module docstring)."""

    kind: str
    """One of KINDS."""
    root: Path
    """The path given (the standard library's folder for the default corpus)."""
    files: tuple[Path, ...]
    """What is read, in reading order: the text, JSONL or parquet files; a datasets folder's files."""
    text_field: str = DEFAULT_TEXT_FIELD
    split: str | None = None
    """A saved DatasetDict's split that is read ("train"); None otherwise."""

    @property
    def where(self) -> str:
        return f"the default corpus ({self.root})" if self.kind == "default" else str(self.root)

    def documents(self, max_bytes: int) -> Iterator[Document]:
        """(name, text) of each non-empty document in order, until at least max_bytes bytes were yielded."""
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise UserError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        total = 0
        for name, text, size in self._sized():
            if total >= max_bytes:
                return
            total += size
            yield name, text

    def empty_error(self) -> UserError:
        """The error for a source that yields no document."""
        if self.kind in ("default", "text"):
            return UserError(f"{self.where}: no non-empty text documents found "
                             f"(looked for {', '.join(sorted(TEXT_SUFFIXES))})")
        unit = "lines" if self.kind == "jsonl" else "rows"
        return UserError(f"{self.where}: no {unit} with a non-empty {self.text_field!r} (data.text_field)")

    def fingerprint(self) -> list[list[Any]]:
        """[relative path, size, modification time in ns] of every file read: a source whose files
        changed is another source (`looplm data prepare` will not resume from it)."""
        out = []
        for file in self.files:
            st = file.stat()
            rel = file.name if file == self.root else file.relative_to(self.root).as_posix()
            out.append([rel, st.st_size, st.st_mtime_ns])
        return out

    def _sized(self) -> Iterator[tuple[str, str, int]]:
        if self.kind in ("default", "text"):
            return _text_documents(self.files, self.root, skip_undecodable=self.kind == "default")
        if self.kind == "jsonl":
            return _jsonl_documents(self.root, self.text_field)
        if self.kind == "parquet":
            return (doc for file in self.files for doc in _parquet_documents(file, self.root, self.text_field))
        return _datasets_documents(self.root, self.text_field, self.split)


def open_source(path: str | Path | None, text_field: str = DEFAULT_TEXT_FIELD) -> Source:
    """The source data.path names (None or "": the default corpus), its kind decided from the path and
    checked as far as it can be before reading: a missing path, a text_field for plain text, a parquet
    or datasets source without that column raise UserError naming data.text_field and what is there."""
    if not path:
        root = Path(sysconfig.get_paths()["stdlib"])
        source = Source("default", root, tuple(default_corpus_files()), text_field)
    else:
        root = Path(path)
        if not root.exists():
            from ..outdir import staging_path
            if (staging_path(root) / PREPARE_JOURNAL).is_file():
                raise UserError(f"data path {root}: not prepared yet; `looplm data prepare` has not finished it "
                                f"(its work so far is in {staging_path(root)}): run the same prepare command again "
                                "to finish it")
            raise UserError(f"data path {root}: no such file or folder")
        if root.is_file():
            suffix = root.suffix.lower()
            kind = {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")
            source = Source(kind, root, (root,), text_field)
        elif (root / PREPARE_JOURNAL).is_file():
            raise UserError(f"data path {root}: a `looplm data prepare` output it has not finished ({PREPARE_JOURNAL}); "
                            f"run the same prepare command again to finish it")
        elif (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
            source = _datasets_source(root, text_field)
        else:
            parquet = sorted(_walk(root, lambda p: p.suffix.lower() == ".parquet", skip={"__pycache__"}),
                             key=lambda p: p.relative_to(root).as_posix())
            source = (Source("parquet", root, tuple(parquet), text_field) if parquet
                      else Source("text", root, tuple(_user_files(root)), text_field))
    if source.kind in ("default", "text") and text_field != DEFAULT_TEXT_FIELD:
        raise UserError(f"data.text_field {text_field!r}: {source.where} is plain text (one document per file), "
                        f"which has no fields; it applies to a JSONL file, parquet file(s) or a saved datasets folder")
    if source.kind == "parquet":
        for file in source.files:
            _check_column(file, _parquet_schema(file), text_field)
    return source


def read_documents(path: str | None, max_bytes: int, text_field: str = DEFAULT_TEXT_FIELD) -> list[Document]:
    """Every document of `path` (see open_source) until at least max_bytes bytes, as a list; UserError
    when there is none. For small corpora (evaluation text); training streams Source.documents."""
    source = open_source(path, text_field)
    docs = list(source.documents(max_bytes))
    if not docs:
        raise source.empty_error()
    return docs


# ----------------------------------------------------------------------------- plain text

def default_corpus_files() -> list[Path]:
    """All `*.py` files of the interpreter's standard library, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _walk(root, lambda p: p.suffix == ".py", skip={"site-packages", "__pycache__"})
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _user_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = _walk(root, lambda p: p.suffix.lower() in TEXT_SUFFIXES, skip={"__pycache__"})
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _walk(root: Path, wanted: Callable[[Path], bool], skip: set[str]) -> list[Path]:
    """Files under `root` that `wanted` accepts, never entering `skip` or hidden folders.

    Pruning while walking matters: the stdlib's site-packages can hold gigabytes.
    """
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skip and not d.startswith(".")]
        found += [p for p in (Path(folder, n) for n in names) if wanted(p) and p.is_file()]
    return found


def _text_documents(files: Iterable[Path], root: Path, skip_undecodable: bool) -> Iterator[tuple[str, str, int]]:
    for file in files:
        try:
            raw = file.read_bytes()
        except OSError as exc:
            raise UserError(f"{file}: cannot read ({exc.strerror})") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            # a few stdlib files are deliberately not UTF-8 (encoding tests): not the user's fault
            if skip_undecodable:
                continue
            raise UserError(f"{file}: not valid UTF-8 (byte {exc.start}); "
                            f"convert it to UTF-8 or remove it from the data folder") from exc
        if text:
            yield (file.name if file == root else file.relative_to(root).as_posix()), text, len(raw)


# ----------------------------------------------------------------------------- records

def _jsonl_documents(path: Path, field: str) -> Iterator[tuple[str, str, int]]:
    for lineno, obj in jsonl_objects(path, f"with a {field!r} string (data.text_field), one document per line"):
        if field not in obj:
            raise UserError(f"{path}, line {lineno}: no {field!r} key (data.text_field); "
                            f"the object's keys: {', '.join(map(repr, obj)) or 'none'}")
        text = obj[field]
        if text is not None and not isinstance(text, str):
            raise UserError(f"{path}, line {lineno}: {field!r} (data.text_field) must be a string, "
                            f"got {type(text).__name__}")
        if text:
            yield f"{path.name}:{lineno}", text, len(text.encode("utf-8"))


def _check_column(where: Path, schema, field: str) -> None:
    """The text column must exist and hold strings."""
    import pyarrow as pa
    if field not in schema.names:
        raise UserError(f"{where}: no column {field!r} (data.text_field); its columns: {', '.join(schema.names)}")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
        raise UserError(f"{where}: column {field!r} (data.text_field) holds {kind}, not text")


def _parquet_schema(file: Path):
    import pyarrow.parquet as pq
    try:
        return pq.read_schema(file)
    except (OSError, ValueError) as exc:   # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"{file}: not a readable parquet file ({exc})") from None


def _record_documents(batches: Iterable[Any], field: str, prefix: str) -> Iterator[tuple[str, str, int]]:
    """Documents from Arrow record batches (or tables) of one text column; named PREFIX:ROW (0-based)."""
    import pyarrow.compute as pc
    row = 0
    for batch in batches:
        column = batch.column(field)
        sizes = pc.binary_length(column).to_pylist()   # UTF-8 bytes, without encoding each text again
        for i, (text, size) in enumerate(zip(column.to_pylist(), sizes)):
            if text:
                yield f"{prefix}:{row + i}", text, size
        row += batch.num_rows


def _parquet_documents(file: Path, root: Path, field: str) -> Iterator[tuple[str, str, int]]:
    import pyarrow.parquet as pq
    prefix = file.name if file == root else file.relative_to(root).as_posix()
    with pq.ParquetFile(file) as reader:
        yield from _record_documents(reader.iter_batches(batch_size=ARROW_BATCH_ROWS, columns=[field]), field, prefix)


def _load_dataset(root: Path, split: str | None):
    """The saved Dataset at root (of a DatasetDict, `split`), memory-mapped (load_from_disk reads local
    files only)."""
    import datasets
    try:
        ds = datasets.load_from_disk(str(root))
    except Exception as exc:   # datasets raises its own errors (FileNotFoundError, DatasetNotFoundError, ...)
        raise UserError(f"{root}: not a readable saved datasets folder ({type(exc).__name__}: {exc})") from None
    return ds[split] if split is not None else ds


def _datasets_source(root: Path, field: str) -> Source:
    import datasets
    split = None
    ds = _load_dataset(root, None)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"{root}: a saved DatasetDict with splits {', '.join(ds)} and no \"train\"; "
                            f"point data.path at one split's folder ({root}/NAME)")
        split, ds = "train", ds["train"]
    if field not in ds.column_names:
        raise UserError(f"{root}: no column {field!r} (data.text_field); its columns: {', '.join(ds.column_names)}")
    _check_column(root, ds.data.schema, field)
    folder = root / split if split else root
    files = tuple(sorted(p for p in folder.iterdir() if p.is_file()))
    return Source("datasets", root, files, field, split)


def _datasets_documents(root: Path, field: str, split: str | None) -> Iterator[tuple[str, str, int]]:
    ds = _load_dataset(root, split).select_columns([field]).with_format("arrow")
    yield from _record_documents(ds.iter(batch_size=ARROW_BATCH_ROWS), field, split or root.name)
