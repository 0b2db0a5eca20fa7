"""`looplm data prepare`: tokenize a corpus once into a folder that training runs reuse.

A prepared folder holds what the trainer would write for itself — `train.bin` / `val.bin` (with
their `.json` sidecars, see text.encode_to_memmap), the tokenizer files — plus `manifest.json`,
which records how it was made. `looplm train --set data.path=DIR` on such a folder links the
token files into RUN/data and the tokenizer into RUN/checkpoint instead of reading text again.

Sources: what data.path accepts (a text file or a folder of text files, one document per file),
or a `.jsonl` file whose lines are objects with a "text" string (one document per line). JSONL
is streamed: it is read line by line once per pass and never held whole in memory.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..errors import UserError
from . import text as data_mod
from .text import Document
from .tokenizer import BPE_FILE, CONFIG_FILE, AnyTokenizer, build_tokenizer, load_tokenizer

MANIFEST = "manifest.json"
FORMAT = "looplm-prepared-data"
VERSION = 1
TOKEN_FILES = ("train.bin", "train.json", "val.bin", "val.json")


def tokenize_splits(kind: str, vocab_size: int, train_docs: Callable[[], Iterable[Document]],
                    val_docs: Callable[[], Iterable[Document]], tok_dir: Path, data_dir: Path):
    """Build the tokenizer on the training split, save it to tok_dir, and encode both splits into
    data_dir/train.bin and val.bin. The split arguments return a fresh stream on each call (a BPE
    is trained on one pass, the encoding is another). Returns (tokenizer, train, val) memmaps.
    The one path both the trainer and `looplm data prepare` take, so their tokens are the same."""
    if kind == "pretrained":    # the tokenizer of the run training starts from, already copied in (--init)
        if not (Path(tok_dir) / CONFIG_FILE).is_file():
            raise UserError("data.tokenizer = \"pretrained\" uses the tokenizer of the run training starts "
                            "from: train with --init RUN")
        tok = load_tokenizer(tok_dir)
    else:
        tok = build_tokenizer(kind, (t for _, t in train_docs()), vocab_size)
    if tok.vocab_size > vocab_size:
        raise UserError(f"model.vocab_size {vocab_size} is smaller than the tokenizer's {tok.vocab_size}")
    tok.save(tok_dir)
    train = data_mod.encode_to_memmap(train_docs(), tok, data_dir / "train.bin")
    val = data_mod.encode_to_memmap(val_docs(), tok, data_dir / "val.bin")
    return tok, train, val


# ----------------------------------------------------------------------------- sources

def _jsonl_documents(path: Path, max_bytes: int) -> Iterator[Document]:
    """One document per line with a non-empty "text" (named FILE:LINE), until max_bytes are read;
    blank lines are skipped. Streams the file."""
    total = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if total >= max_bytes:
                    return
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                text = obj.get("text") if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise UserError(f"{path}:{lineno}: expected a JSON object with a \"text\" string "
                                    f"(one document per line)")
                if text:
                    total += len(text.encode("utf-8"))
                    yield f"{path.name}:{lineno}", text
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None


def prepare(source: str | Path, out: str | Path, recipe) -> dict[str, Any]:
    """Tokenize `source` into `out` with the recipe's data.tokenizer, model.vocab_size,
    data.max_bytes and data.val_fraction; returns the manifest written to out/manifest.json."""
    src, out = Path(source), Path(out)
    if not src.exists():
        raise UserError(f"{src}: no such file or folder")
    if is_prepared(src):
        raise UserError(f"{src}: already a prepared data folder; pass it as data.path to `looplm train`")
    d = recipe.data
    if d.task:
        raise UserError(f"data.task {d.task!r}: task data is generated or read per run; `looplm data prepare` "
                        f"tokenizes language-model text (leave data.task empty)")
    if src.is_file() and src.suffix.lower() == ".jsonl":
        kind = "jsonl"
        names = [name for name, _ in _jsonl_documents(src, d.max_bytes)]   # pass 1: names only
        if not names:
            raise UserError(f"{src}: no lines with a non-empty \"text\" field")
        train_names, val_names = data_mod.split_documents([(n, "") for n in names], d.val_fraction)
        held_out, counts = {n for n, _ in val_names}, (len(train_names), len(val_names))

        def train_docs():
            return (doc for doc in _jsonl_documents(src, d.max_bytes) if doc[0] not in held_out)

        def val_docs():
            return (doc for doc in _jsonl_documents(src, d.max_bytes) if doc[0] in held_out)
    else:
        kind = "text"
        train, val = data_mod.split_documents(data_mod.read_documents(str(src), d.max_bytes), d.val_fraction)
        train_docs, val_docs = (lambda: train), (lambda: val)
        counts = (len(train), len(val))
    if not all(counts):
        raise UserError(f"{src}: holds {sum(counts)} document(s); training needs a train and a validation split, "
                        f"so at least two documents (a JSONL file: two lines with \"text\")")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)          # a half-written folder is never taken as prepared
    tok, train_tokens, val_tokens = tokenize_splits(d.tokenizer, recipe.model.vocab_size, train_docs, val_docs,
                                                    out, out)
    sidecars = {s: json.loads((out / f"{s}.json").read_text(encoding="utf-8")) for s in ("train", "val")}
    manifest = {
        "format": FORMAT, "version": VERSION,
        "source": str(src.resolve()), "source_kind": kind,
        "tokenizer": {"kind": d.tokenizer, "vocab_size": tok.vocab_size},
        "model_vocab_size": recipe.model.vocab_size,
        "dtype": train_tokens.dtype.name,
        "tokens": {"train": int(len(train_tokens)), "val": int(len(val_tokens))},
        "documents": {s: sidecars[s]["documents"] for s in ("train", "val")},
        "max_bytes": d.max_bytes, "val_fraction": d.val_fraction,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


# ----------------------------------------------------------------------------- using a prepared folder

def is_prepared(path: str | Path | None) -> bool:
    return bool(path) and Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(manifest, dict) and manifest.get("format") == FORMAT
        kind, vocab = manifest["tokenizer"]["kind"], int(manifest["model_vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise UserError(f"{path}: not a looplm prepared-data manifest; run `looplm data prepare` again") from None
    if manifest.get("version") != VERSION:
        raise UserError(f"{path}: format version {manifest.get('version')!r}, this looplm reads {VERSION}; "
                        f"run `looplm data prepare` again")
    return {**manifest, "_kind": kind, "_vocab": vocab}


def use_prepared(recipe, directory: str | Path, run_dir: Path) -> tuple[AnyTokenizer, Any, Any]:
    """Check the recipe against DIR's manifest, then link (or copy) its token files into RUN/data
    and its tokenizer into RUN/checkpoint, as the trainer would have written them."""
    from ..recipe.config import DataConfig
    directory = Path(directory)
    fields = DataConfig.__dataclass_fields__
    for name in ("max_bytes", "val_fraction"):   # fixed when DIR was prepared: never silently ignored
        if getattr(recipe.data, name) != fields[name].default:
            raise UserError(f"data.{name}: {directory} is already prepared (its split and size are fixed); "
                            f"leave data.{name} at its default, or pass it to `looplm data prepare`")
    m = read_manifest(directory)
    if recipe.data.tokenizer != m["_kind"]:
        raise UserError(f"data.tokenizer {recipe.data.tokenizer!r} disagrees with {directory / MANIFEST} "
                        f"(prepared with {m['_kind']!r})")
    if m["_kind"] == "bpe" and recipe.model.vocab_size != m["_vocab"]:
        raise UserError(f"model.vocab_size {recipe.model.vocab_size} disagrees with {directory / MANIFEST} "
                        f"(its BPE was trained for {m['_vocab']})")
    for name in TOKEN_FILES:
        if not (directory / name).is_file():
            raise UserError(f"{directory / name}: missing from the prepared folder; run `looplm data prepare` again")
    tok = load_tokenizer(directory)
    if tok.vocab_size > recipe.model.vocab_size:
        raise UserError(f"model.vocab_size {recipe.model.vocab_size} is smaller than the tokenizer's {tok.vocab_size}")
    ddir, cdir = run_dir / "data", run_dir / "checkpoint"
    for name in TOKEN_FILES:
        _link_or_copy(directory / name, ddir / name)
    for name in (CONFIG_FILE, BPE_FILE):
        if (directory / name).is_file():
            _link_or_copy(directory / name, cdir / name)
    return tok, data_mod.open_tokens(ddir / "train.bin"), data_mod.open_tokens(ddir / "val.bin")


def prepared_eval_tokens(directory: str | Path, tokenizer: AnyTokenizer) -> Any:
    """DIR's held-out split (val.bin) for `looplm eval RUN --data DIR`, when DIR was tokenized as the run
    is: the same tokenizer kind, and for BPE the same merges (the tokenizer files compared byte for byte,
    through a save of the run's tokenizer); UserError naming DIR otherwise."""
    import tempfile
    directory = Path(directory)
    m = read_manifest(directory)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        ours = {name: (Path(tmp) / name).read_bytes() for name in (CONFIG_FILE, BPE_FILE) if (Path(tmp) / name).is_file()}
    theirs = {name: (directory / name).read_bytes() for name in ours if (directory / name).is_file()}
    if ours != theirs:
        raise UserError(f"--data {directory}: prepared with a {m['_kind']} tokenizer that is not this run's; "
                        "prepare it again with the run's recipe (looplm data prepare SOURCE --recipe RUN/recipe.toml)")
    if not (directory / "val.bin").is_file():
        raise UserError(f"{directory / 'val.bin'}: missing from the prepared folder; run `looplm data prepare` again")
    return data_mod.open_tokens(directory / "val.bin")


def _link_or_copy(src: Path, dst: Path) -> None:
    """Token arrays (.bin): a hard link where the file system allows (no copy of a large corpus);
    re-preparing DIR replaces them by rename (new inodes), so a run's linked tokens never change
    under it. Everything else (small, rewritten in place) and any failed link: a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)
    if src.suffix == ".bin":
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)
