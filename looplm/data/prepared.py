"""`looplm data prepare`: tokenize a corpus once into a folder that training runs reuse.

A prepared folder (format version 2) holds

    train-00000.bin ...   the training tokens, in shards of at most --shard-tokens tokens (uint16, or
                          uint32 for vocabularies over 65535); a document may continue into the next
    train.json            their sidecar: dtype, length, documents, each shard and its token count
    val.bin, val.json     the held-out split, one file (as in a run folder: `looplm eval` reads it)
    tokenizer files
    manifest.json         how it was made: the source, every setting and their hash, shards, tokens

`looplm train --set data.path=DIR` links the token files into RUN/data and the tokenizer into
RUN/checkpoint instead of reading the source again; text.open_tokens reads the shards as one
memory-mapped stream. Version 1 folders (one train.bin, written before shards) still train.

Sources: whatever data.path accepts (sources.py: text, JSONL, parquet, a saved datasets folder),
streamed: never held whole in memory. Preparing makes these passes over the source: the names
(deciding the split), the training text (for a BPE), the training documents, the held-out ones.

The folder is built in OUT.partial and moved into place as OUT when whole (outdir.Staging): OUT is
a finished prepared folder or absent. --out must be absent, an empty folder or an earlier prepared
folder (of the same settings: returned as it is); anything else is refused, never written into.

Resuming: `prepare.journal.json` in OUT.partial records each finished step (the split, the
tokenizer, every shard), rewritten atomically. A killed or interrupted (Ctrl-C) `looplm data
prepare` rerun with the same command continues after the last finished shard (the held-out split,
one file, is redone whole), and the folder ends byte-identical to an uninterrupted run's: shards
hold a fixed number of tokens, so where each one starts is a function of the settings alone. Other
settings (another source, changed source files, tokenizer, text field, size, split or shard size:
their hash) into the same --out are refused. A prepare that fails otherwise (bad input) removes
OUT.partial.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..files import read_json_object
from ..outdir import Staging, refuse_foreign
from . import text as data_mod
from .sources import DEFAULT_TEXT_FIELD, PREPARE_JOURNAL, Document, Source, open_source
from .text import DocumentSplit, EncodeProgress
from .tokenizer import BPE_FILE, CONFIG_FILE, AnyTokenizer, build_tokenizer, load_tokenizer

MANIFEST = "manifest.json"
JOURNAL = PREPARE_JOURNAL
FORMAT = "looplm-prepared-data"
VERSION = 2
READABLE_VERSIONS = (1, 2)
"""1: one train.bin / val.bin (before shards); 2: training shards."""
SHARD_TOKENS = 1 << 24
"""Default tokens per training shard (32 MiB of uint16 ids)."""

RECIPE_FIELDS = ("data.tokenizer", "model.vocab_size", "data.max_bytes", "data.val_fraction", "data.text_field")
"""The recipe fields `prepare` reads (the prepared bytes depend on these alone); `looplm data prepare --set`
refuses any other, which would change nothing."""


def tokenize_splits(kind: str, vocab_size: int, train_docs: Callable[[], Iterable[Document]],
                    val_docs: Callable[[], Iterable[Document]], tok_dir: Path, data_dir: Path,
                    shard_tokens: int | None = None, journal: Journal | None = None,
                    progress: bool | None = False, counts: tuple[int, int] | None = None):
    """Build the tokenizer on the training split, save it to tok_dir, and encode both splits into
    data_dir/train.bin and val.bin. The split arguments return a fresh stream on each call (a BPE
    is trained on one pass, the encoding is another). Returns (tokenizer, train, val) token arrays.
    The one path both the trainer and `looplm data prepare` take, so their tokens are the same.
    shard_tokens: the training split in shards of that many tokens (text.encode_tokens); journal: what
    an interrupted prepare finished, skipped now and recorded as it goes; progress: tqdm bars on stderr
    (None: when stderr is a terminal); counts: documents per split, for the bars' totals."""
    def bar(desc: str, total: int | None):
        return _bar(desc, total, progress)

    if kind == "pretrained":    # the tokenizer of the run training starts from, already copied in (--init)
        if not (Path(tok_dir) / CONFIG_FILE).is_file():
            raise UserError("data.tokenizer = \"pretrained\" uses the tokenizer of the run training starts "
                            "from: train with --init RUN")
        tok = load_tokenizer(tok_dir)
    elif journal is not None and journal.state.get("tokenizer"):     # trained before the interruption
        tok = load_tokenizer(tok_dir)
    else:       # a BPE reads the training split once (the byte tokenizer reads nothing)
        with bar("bpe", counts[0] if counts else None) if kind == "bpe" else nullcontext(None) as b:
            tok = build_tokenizer(kind, (_tick(b, t) for _, t in train_docs()), vocab_size)
    if tok.vocab_size > vocab_size:
        raise UserError(f"model.vocab_size {vocab_size} is smaller than the tokenizer's {tok.vocab_size}")
    tok.save(tok_dir)
    if journal is not None:
        journal.update(tokenizer=True)
    out = []
    for i, (split, docs, size) in enumerate((("train", train_docs, shard_tokens), ("val", val_docs, None))):
        path = Path(data_dir) / f"{split}.bin"
        if journal is not None and journal.state.get(split, {}).get("done"):
            out.append(data_mod.open_tokens(path))
            continue
        resume = journal.progress(split) if journal is not None and size is not None else None
        with bar(split, counts[i] if counts else None) as b:
            out.append(data_mod.encode_tokens(docs(), tok, path, size, resume=resume, bar=b,
                                              on_shard=(lambda p, s=split: journal.record(s, p)) if journal else None))
        if journal is not None:
            journal.update(**{split: {"done": True}})
    return tok, out[0], out[1]


def _bar(desc: str, total: int | None, progress: bool | None):
    if progress is False:
        return nullcontext(None)
    from tqdm import tqdm
    return tqdm(desc=desc, total=total, unit="doc", file=sys.stderr, dynamic_ncols=True,
                disable=None if progress is None else False)


def _tick(bar: Any, item: Any) -> Any:
    if bar is not None:
        bar.update(1)
    return item


def split_source(source: Source, max_bytes: int, val_fraction: float, progress: bool | None = False) -> DocumentSplit:
    """The train/validation split of `source` (one pass over its documents' names); UserError when it
    has no document, or too few for both sides."""
    with _bar("split", None, progress) as b:
        split = DocumentSplit.of((_tick(b, name) for name, _ in source.documents(max_bytes)), val_fraction)
    if not split.train + split.val:
        raise source.empty_error()
    if not (split.train and split.val):
        raise UserError(f"{source.where}: holds {split.train + split.val} document(s); training needs a train and "
                        f"a validation split, so at least two documents (a JSONL file: two lines with text)")
    return split


# ----------------------------------------------------------------------------- preparing

class Journal:
    """prepare.journal.json in the staging folder: the settings (and their hash) and every finished step.
    Opening one written with other settings is refused (naming --out); `record` is called after each shard."""

    def __init__(self, folder: Path, out: Path, settings: dict[str, Any], digest: str,
                 on_shard: Callable[[str, int], None] | None = None) -> None:
        self.path, self.on_shard = folder / JOURNAL, on_shard
        self.state: dict[str, Any] = {"format": f"{FORMAT}-journal", "settings_hash": digest, "settings": settings}
        if self.path.is_file():
            try:
                old = read_json_object(self.path, "a looplm prepare journal")
            except UserError as err:
                raise UserError(f"{err}; delete {folder} to prepare {out} again") from None
            if old.get("settings_hash") != digest:
                raise _other_settings(out, old.get("settings"), settings, unfinished=folder)
            self.state = old

    def split(self) -> DocumentSplit | None:
        s = self.state.get("split")
        return DocumentSplit(**s) if s else None

    def progress(self, split: str) -> EncodeProgress | None:
        s = self.state.get(split)
        return EncodeProgress.from_dict(s) if s and "shards" in s else None

    def record(self, split: str, progress: EncodeProgress) -> None:
        self.update(**{split: progress.to_dict()})
        if self.on_shard is not None:
            self.on_shard(split, len(progress.shards))

    def update(self, **entries: Any) -> None:
        self.state.update(entries)
        _write_json(self.path, self.state)


def prepare(source: str | Path, out: str | Path, recipe, shard_tokens: int | None = None,
            progress: bool | None = None, on_shard: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Tokenize `source` into `out` with the recipe's data.tokenizer, model.vocab_size, data.max_bytes,
    data.val_fraction and data.text_field, the training split in shards of shard_tokens tokens (None:
    SHARD_TOKENS);
    returns the manifest written to out/manifest.json. Resumes what an interrupted call with the same
    settings left in `out` (see the module docstring); `out` already prepared with the same settings
    is returned as it is. progress: tqdm bars on stderr (None: when it is a terminal). on_shard(split,
    shards written): called after each shard is recorded (tests interrupt there)."""
    src_path, out = Path(source), Path(out)
    if not src_path.exists():
        raise UserError(f"{src_path}: no such file or folder")
    if is_prepared(src_path):
        raise UserError(f"{src_path}: already a prepared data folder; pass it as data.path to `looplm train`")
    d = recipe.data
    if d.task:
        raise UserError(f"data.task {d.task!r}: task data is generated or read per run; `looplm data prepare` "
                        f"tokenizes language-model text (leave data.task empty)")
    shard_tokens = SHARD_TOKENS if shard_tokens is None else shard_tokens
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise UserError(f"--shard-tokens must be a positive integer, got {shard_tokens!r}")
    src = open_source(src_path, d.text_field)
    settings = _settings(src, recipe, shard_tokens)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    if is_prepared(out):
        done = read_manifest(out)
        if done.get("settings_hash") != digest:
            raise _other_settings(out, done.get("settings"), settings)
        return {k: v for k, v in done.items() if not k.startswith("_")}
    refuse_foreign(out, "--out", own_kind="a finished `looplm data prepare` folder")
    # built in OUT.partial, moved into place when whole; a killed or interrupted prepare leaves its journal
    # there, and the same command continues from it
    with Staging(out, "--out", resume=True) as stage:
        manifest = _prepare_into(stage, src, settings, digest, recipe, shard_tokens, progress, on_shard)
        stage.commit()
    return manifest


def _prepare_into(stage: Staging, src: Source, settings: dict[str, Any], digest: str, recipe,
                  shard_tokens: int, progress: bool | None,
                  on_shard: Callable[[str, int], None] | None) -> dict[str, Any]:
    """`prepare`'s passes into the staging folder, continuing what its journal records; the manifest."""
    d, work = recipe.data, stage.dir
    journal = Journal(work, stage.out, settings, digest, on_shard)
    split = journal.split()
    if split is None:
        split = split_source(src, d.max_bytes, d.val_fraction, progress)
        journal.update(split=asdict(split))
    stage.keep_interrupted = True        # from here on an interrupted prepare has work to continue
    for stale in work.glob("*.tmp"):          # what a killed run was writing
        stale.unlink(missing_ok=True)

    def docs(side: str) -> Callable[[], Iterable[Document]]:
        return lambda: split.select(src.documents(d.max_bytes), side)

    tok, train_tokens, val_tokens = tokenize_splits(d.tokenizer, recipe.model.vocab_size, docs("train"), docs("val"),
                                                    work, work, shard_tokens, journal, progress,
                                                    (split.train, split.val))
    sidecars = {s: read_json_object(work / f"{s}.json", "a token sidecar") for s in ("train", "val")}
    manifest = {
        "format": FORMAT, "version": VERSION,
        "source": settings["source"], "source_kind": src.kind, "text_field": settings["text_field"],
        "tokenizer": {"kind": d.tokenizer, "vocab_size": tok.vocab_size},
        "model_vocab_size": recipe.model.vocab_size,
        "dtype": train_tokens.dtype.name,
        "tokens": {"train": int(len(train_tokens)), "val": int(len(val_tokens))},
        "documents": {s: sidecars[s]["documents"] for s in ("train", "val")},
        "max_bytes": d.max_bytes, "val_fraction": d.val_fraction, "shard_tokens": shard_tokens,
        "shards": {"train": sidecars["train"]["shards"], "val": [{"file": "val.bin", "tokens": int(len(val_tokens))}]},
        "settings_hash": digest, "settings": settings,
    }
    _write_json(work / MANIFEST, manifest)
    journal.path.unlink(missing_ok=True)
    return manifest


def _settings(src: Source, recipe, shard_tokens: int) -> dict[str, Any]:
    """Everything the prepared bytes depend on; its hash names them (the source's files by path, size
    and modification time, so a changed file is another source)."""
    d = recipe.data
    files = hashlib.sha256(json.dumps(src.fingerprint()).encode()).hexdigest()
    return {"format_version": VERSION, "source": str(src.root.resolve()), "source_kind": src.kind,
            "source_files": files, "dataset_split": src.split,
            "text_field": d.text_field if src.kind not in ("default", "text") else None,
            "tokenizer": d.tokenizer, "vocab_size": recipe.model.vocab_size if d.tokenizer == "bpe" else None,
            "max_bytes": d.max_bytes, "val_fraction": d.val_fraction, "shard_tokens": shard_tokens}


def _other_settings(out: Path, theirs: Any, ours: dict[str, Any], unfinished: Path | None = None) -> UserError:
    """The refusal of --out prepared (or, unfinished: being prepared in that staging folder) otherwise."""
    held = f"an unfinished prepare in {unfinished}" if unfinished else "data prepared"
    gone = unfinished or out
    if not isinstance(theirs, dict):
        return UserError(f"--out {out}: holds {held} by an earlier looplm; choose another --out, "
                         f"or delete {gone} to prepare it again")
    differ = [k for k in ours if theirs.get(k) != ours[k]] or ["settings"]
    return UserError(f"--out {out}: holds {held} with other settings ({', '.join(differ)}); "
                     f"choose another --out, or delete {gone} to prepare it again")


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Written under another name and renamed: a kill never leaves half a file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- using a prepared folder

def is_prepared(path: str | Path | None) -> bool:
    return bool(path) and Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def read_manifest(directory: Path) -> dict[str, Any]:
    """DIR/manifest.json, checked (UserError naming it); the one reader of a prepared folder's manifest."""
    path = directory / MANIFEST
    manifest = read_json_object(path, "a looplm prepared-data manifest")
    try:
        assert manifest.get("format") == FORMAT
        kind, vocab = manifest["tokenizer"]["kind"], int(manifest["model_vocab_size"])
    except (ValueError, KeyError, TypeError, AssertionError):
        raise UserError(f"{path}: not a looplm prepared-data manifest; run `looplm data prepare` again") from None
    if manifest.get("version") not in READABLE_VERSIONS:
        raise UserError(f"{path}: format version {manifest.get('version')!r}, this looplm reads "
                        f"{' and '.join(map(str, READABLE_VERSIONS))}; run `looplm data prepare` again")
    return {**manifest, "_kind": kind, "_vocab": vocab}


def use_prepared(recipe, directory: str | Path, run_dir: Path) -> tuple[AnyTokenizer, Any, Any]:
    """Check the recipe against DIR's manifest, then link (or copy) its token files (one train.bin, or
    its shards) into RUN/data and its tokenizer into RUN/checkpoint, as the trainer would have written
    them. Returns (tokenizer, train, val) opened from RUN/data."""
    from ..recipe.config import DataConfig
    directory = Path(directory)
    fields = DataConfig.__dataclass_fields__
    for name in ("max_bytes", "val_fraction"):   # fixed when DIR was prepared: never silently ignored
        if getattr(recipe.data, name) != fields[name].default:
            raise UserError(f"data.{name}: {directory} is already prepared (its split and size are fixed); "
                            f"leave data.{name} at its default, or pass it to `looplm data prepare`")
    m = read_manifest(directory)
    prepared_field = m.get("text_field") or DEFAULT_TEXT_FIELD
    if recipe.data.text_field not in (fields["text_field"].default, prepared_field):
        raise UserError(f"data.text_field {recipe.data.text_field!r}: {directory} was prepared from "
                        f"{prepared_field!r}; leave data.text_field at its default, or prepare again with it")
    if recipe.data.tokenizer != m["_kind"]:
        raise UserError(f"data.tokenizer {recipe.data.tokenizer!r} disagrees with {directory / MANIFEST} "
                        f"(prepared with {m['_kind']!r})")
    if m["_kind"] == "bpe" and recipe.model.vocab_size != m["_vocab"]:
        raise UserError(f"model.vocab_size {recipe.model.vocab_size} disagrees with {directory / MANIFEST} "
                        f"(its BPE was trained for {m['_vocab']})")
    files = [f for split in ("train", "val") for f in data_mod.token_files(directory / f"{split}.bin")]
    for file in files:
        if not file.is_file():
            raise UserError(f"{file}: missing from the prepared folder; run `looplm data prepare` again")
    for split in ("train", "val"):     # every token file the size its sidecar says, checked where it lies
        data_mod.open_tokens(directory / f"{split}.bin")
    tok = load_tokenizer(directory)
    if tok.vocab_size > recipe.model.vocab_size:
        raise UserError(f"model.vocab_size {recipe.model.vocab_size} is smaller than the tokenizer's {tok.vocab_size}")
    ddir, cdir = run_dir / "data", run_dir / "checkpoint"
    for file in files:
        link_or_copy(file, ddir / file.name)
    for name in (CONFIG_FILE, BPE_FILE):
        if (directory / name).is_file():
            link_or_copy(directory / name, cdir / name)
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


def link_or_copy(src: Path, dst: Path) -> None:
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
