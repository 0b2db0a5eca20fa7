"""Training data: split documents, tokenize them to disk, and sample batches.

The pipeline is
    sources.open_source -> DocumentSplit -> encode_tokens -> TokenSampler / val_batches

With no data path the corpus is the Python standard library of the running interpreter:
real text that is present on every machine, so nothing has to be downloaded (sources.py reads it,
and every other kind of source).

A split's tokens are one file (`train.bin`, what a run writes for itself) or, from `looplm data
prepare`, shards (`train-00000.bin`, ...) of a bounded size; either way `train.json` beside them
describes them, and `open_tokens("train.bin")` returns one read-only, memory-mapped array over them
(a TokenStream for shards): nothing is loaded whole.

Everything here is deterministic. Training batches are a pure function of (seed, step), so a
run resumed at step k sees exactly the batches an uninterrupted run would have seen, and
every data-parallel rank can compute the same global batch without talking to the others.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from .sources import TEXT_SUFFIXES, Document, default_corpus_files, read_documents  # noqa: F401  (re-exported)
from .tokenizer import AnyTokenizer

ENCODE_CHUNK_DOCS = 256  # documents tokenized per batch call; bounds peak memory


# ----------------------------------------------------------------------------- splitting

@dataclass(frozen=True)
class DocumentSplit:
    """Which documents are held out for validation: decided by a stable hash of each document's name,
    so a document's side depends on its name only, not on its neighbours. Built from one pass over
    the names (`of`), so a streamed corpus splits exactly as `split_documents` splits a list.

    With two or more documents both sides get at least one: a corpus that hashed entirely onto one
    side has its closest document moved across (`moved`: its position in the stream)."""

    val_fraction: float
    moved: int | None
    train: int
    """Documents on the training side."""
    val: int
    """Documents held out."""

    @classmethod
    def of(cls, names: Iterable[str], val_fraction: float) -> DocumentSplit:
        if not 0.0 < val_fraction < 1.0:
            raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")
        count = held = 0
        lowest = highest = None     # (score, position): the document to move if one side stays empty
        for i, name in enumerate(names):
            score = _name_score(name)
            count += 1
            held += score < val_fraction
            if lowest is None or (score, i) < lowest:
                lowest = (score, i)
            if highest is None or (score, i) > highest:
                highest = (score, i)
        moved = None
        if count >= 2 and held == 0:
            moved, held = lowest[1], 1
        elif count >= 2 and held == count:
            moved, held = highest[1], count - 1
        return cls(val_fraction, moved, count - held, held)

    def is_val(self, position: int, name: str) -> bool:
        return (_name_score(name) < self.val_fraction) != (position == self.moved)

    def select(self, docs: Iterable[Document], side: str) -> Iterator[Document]:
        """The documents of `docs` (the stream the split was made from) on `side` ("train" | "val"), in order."""
        want = side == "val"
        return (doc for i, doc in enumerate(docs) if self.is_val(i, doc[0]) == want)


def split_documents(docs: Sequence[Document],
                    val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Split whole documents into (train, val) by DocumentSplit. Each side keeps the input order;
    a single document lands on the side its name hashes to."""
    split = DocumentSplit.of((name for name, _ in docs), val_fraction)
    return list(split.select(docs, "train")), list(split.select(docs, "val"))


def _name_score(name: str) -> float:
    """A number in [0, 1) from the name; unlike hash(), the same in every process."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


# ----------------------------------------------------------------------------- token files

@dataclass
class EncodeProgress:
    """How far `encode_tokens` got into a sharded split: the shards written so far ([file, tokens]) and
    where the next one starts (a document's position in the split's stream, and how many of its tokens,
    eos included, earlier shards already hold). A resume journal stores it after every shard."""

    shards: list[list[Any]] = field(default_factory=list)
    next_doc: int = 0
    next_offset: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"shards": [list(s) for s in self.shards], "next_doc": self.next_doc, "next_offset": self.next_offset}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EncodeProgress:
        return cls([list(s) for s in d["shards"]], int(d["next_doc"]), int(d["next_offset"]))


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def encode_tokens(docs: Iterable[Document], tokenizer: AnyTokenizer, path: str | Path,
                  shard_tokens: int | None = None, resume: EncodeProgress | None = None,
                  on_shard: Callable[[EncodeProgress], None] | None = None, bar: Any = None) -> np.memmap | TokenStream:
    """Tokenize each document, append eos after each, and write the ids to disk: the one encoder.

    shard_tokens None: one file at `path` (`train.bin`). Otherwise shards of exactly shard_tokens
    tokens (the last one shorter) named after it (`train-00000.bin`, ...); a document may continue
    into the next shard. Each shard is written under a temporary name and renamed when full, so a
    killed process never leaves a truncated file that a later one would trust; then on_shard gets
    the progress to record, and `resume` (that record) makes a later call skip the documents and
    tokens already written and produce the same bytes an uninterrupted call would. `docs` may be a
    stream: only ENCODE_CHUNK_DOCS documents are held at once. The `.json` sidecar next to `path`
    records dtype, length, vocab_size, documents (and the shards). bar: a tqdm bar advanced per
    document. Returns the tokens, read-only (open_tokens)."""
    path = Path(path)
    dtype = token_dtype(tokenizer.vocab_size)
    sharded = shard_tokens is not None
    if sharded and shard_tokens < 1:
        raise UserError(f"shard size must be >= 1 token, got {shard_tokens}")
    path.parent.mkdir(parents=True, exist_ok=True)
    state = resume if resume is not None else EncodeProgress()
    if sharded:
        for stale in path.parent.glob(f"{path.stem}-*.tmp"):    # a killed run's unfinished shard
            stale.unlink(missing_ok=True)

    def shard_path(k: int) -> Path:
        return path.with_name(f"{path.stem}-{k:05d}{path.suffix}") if sharded else path

    capacity = shard_tokens if sharded else None
    stream = iter(docs)
    collections.deque(itertools.islice(stream, state.next_doc), maxlen=0)     # written before: skip
    position, skip = state.next_doc, state.next_offset
    if bar is not None:
        bar.update(position)
    out, tmp, fill = None, None, 0

    def close_shard() -> None:          # complete: renamed into place, then recorded
        nonlocal out, fill
        out.close()
        os.replace(tmp, shard_path(len(state.shards)))
        state.shards.append([shard_path(len(state.shards)).name, fill])
        out, fill = None, 0

    try:
        while chunk := [text for _, text in itertools.islice(stream, ENCODE_CHUNK_DOCS)]:
            for ids in tokenizer.encode_batch(chunk):
                ids.append(tokenizer.eos_id)
                arr = np.asarray(ids, dtype=dtype)
                pos, skip = skip, 0
                while pos < len(arr):
                    if out is None:    # per-process name: ranks may race on the trainer's own files
                        tmp = shard_path(len(state.shards)).with_name(
                            f"{shard_path(len(state.shards)).name}.{os.getpid()}.tmp")
                        out = open(tmp, "wb")
                    take = len(arr) - pos if capacity is None else min(capacity - fill, len(arr) - pos)
                    out.write(arr[pos:pos + take].tobytes())
                    fill, pos = fill + take, pos + take
                    if fill == capacity:
                        close_shard()
                        state.next_doc, state.next_offset = (position, pos) if pos < len(arr) else (position + 1, 0)
                        if on_shard is not None:
                            on_shard(state)
                position += 1
                if bar is not None:
                    bar.update(1)
        if out is not None:             # the last shard (or the one file)
            close_shard()
    finally:
        if out is not None:
            out.close()
            tmp.unlink(missing_ok=True)
    if not position:
        raise UserError(f"{path}: no documents to tokenize; train and validation each need "
                        f"at least one, so the data must hold two or more documents")
    state.next_doc, state.next_offset = position, 0
    sidecar: dict[str, Any] = {"dtype": dtype.name, "length": sum(n for _, n in state.shards),
                               "vocab_size": tokenizer.vocab_size, "documents": position}
    if sharded:
        sidecar["shards"] = [{"file": f, "tokens": n} for f, n in state.shards]
    _sidecar_path(path).write_text(json.dumps(sidecar) + "\n", encoding="utf-8")
    return open_tokens(path)


def encode_to_memmap(docs: Iterable[Document], tokenizer: AnyTokenizer,
                     path: str | Path) -> np.memmap:
    """Tokenize `docs` into the one file `path` (.bin) with its `.json` sidecar (encode_tokens
    unsharded); returns a read-only memmap."""
    return encode_tokens(docs, tokenizer, path)


def open_tokens(path: str | Path) -> np.memmap | TokenStream:
    """Reopen a split written by `encode_tokens`, read-only: a memmap of `path`, or a TokenStream over
    the shards its sidecar lists."""
    path = Path(path)
    meta_path = _sidecar_path(path)
    if not meta_path.is_file() or not (path.is_file() or _lists_shards(meta_path)):
        raise UserError(f"{path}: token file or its sidecar {meta_path.name} is missing")
    dtype, length, shards = _read_sidecar(meta_path)
    if shards is None:
        return _memmap(path, dtype, length, meta_path)
    if sum(n for _, n in shards) != length or any(Path(f).name != f or n <= 0 for f, n in shards):
        raise UserError(f"{meta_path}: its shards do not add up to its length; prepare the data again")
    return TokenStream([_checked(path.parent / f, dtype, n, meta_path) for f, n in shards], dtype, path)


def token_files(path: str | Path) -> list[Path]:
    """The files a split written at `path` consists of: its sidecar, and the one token file or its shards."""
    path = Path(path)
    meta_path = _sidecar_path(path)
    if meta_path.is_file():
        shards = _read_sidecar(meta_path)[2]
        if shards is not None:
            return [meta_path, *(path.parent / f for f, _ in shards)]
    return [meta_path, path]


def _read_sidecar(meta_path: Path) -> tuple[np.dtype, int, list[tuple[str, int]] | None]:
    """(dtype, length, shards or None) of a token split's sidecar, checked (UserError naming it); the one
    reader of train.json / val.json."""
    from ..files import read_json_object
    meta = read_json_object(meta_path, "a token sidecar (dtype, length)")
    try:
        dtype, length = np.dtype(meta["dtype"]), int(meta["length"])
        shards = [(str(s["file"]), int(s["tokens"])) for s in meta["shards"]] if "shards" in meta else None
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{meta_path}: not a valid token sidecar ({type(exc).__name__}: {exc})") from None
    if dtype not in (np.uint16, np.uint32) or length <= 0:
        raise UserError(f"{meta_path}: expected dtype uint16/uint32 and length > 0")
    return dtype, length, shards


def has_tokens(path: str | Path) -> bool:
    """Whether a split was written at `path` (its one file, or a sidecar listing shards)."""
    path = Path(path)
    return path.is_file() or _lists_shards(_sidecar_path(path))


def _lists_shards(meta_path: Path) -> bool:
    try:
        return "shards" in json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def _memmap(path: Path, dtype: np.dtype, length: int, meta_path: Path) -> np.memmap:
    return np.memmap(_checked(path, dtype, length, meta_path), dtype=dtype, mode="r", shape=(length,))


def _checked(path: Path, dtype: np.dtype, length: int, meta_path: Path) -> Path:
    """`path`, when it holds exactly `length` tokens of `dtype` (as its sidecar says)."""
    if not path.is_file():
        raise UserError(f"{path}: missing (listed in {meta_path.name}); prepare the data again")
    if path.stat().st_size != length * dtype.itemsize:
        raise UserError(f"{path}: size does not match {meta_path.name}; the file is truncated "
                        f"or from another run, delete it to re-tokenize")
    return path


def _sidecar_path(path: Path) -> Path:
    return path.with_suffix(".json")


class TokenStream:
    """Token shards read as one read-only array: `len`, and indexing by integers, integer arrays of any
    shape or slices, which gathers from the memory-mapped shards. Nothing is loaded whole, and what a
    read touched does not stay resident: the pages a read mapped count in the process's RSS (the kernel
    maps a block around each one read), so after copying a read out the stream hands its mappings' pages
    back (madvise DONTNEED; they stay in the page cache, and the file is read-only, so nothing changes).
    RSS then follows one batch, not every window a run has read. np.asarray() of a stream concatenates
    every shard: for small data only."""

    def __init__(self, files: list[Path], dtype: np.dtype, path: Path) -> None:
        self.filename = str(path)           # what errors name (as a memmap's filename)
        self.files = list(files)
        self.dtype = np.dtype(dtype)
        self._maps, self.shards = [], []
        for file in files:
            with open(file, "rb") as f:
                self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            self.shards.append(np.frombuffer(self._maps[-1], dtype=self.dtype))
        lengths = np.array([len(s) for s in self.shards], dtype=np.int64)
        self._ends = np.cumsum(lengths)
        self._starts = self._ends - lengths

    def __len__(self) -> int:
        return int(self._ends[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            first = int(np.searchsorted(self._ends, start, side="right"))
            parts, touched = [], []
            for s in range(first, len(self.shards)):
                if self._starts[s] >= stop:
                    break
                lo, hi = max(start, self._starts[s]) - self._starts[s], min(stop, self._ends[s]) - self._starts[s]
                parts.append(self.shards[s][lo:hi])
                touched.append(s)
            out = np.concatenate(parts) if parts else np.empty(0, self.dtype)   # a copy
            self._release(touched)
            return out
        index = np.asarray(key)
        if index.dtype.kind not in "iu":
            raise TypeError(f"token stream indices must be integers or slices, got {index.dtype}")
        flat = index.astype(np.int64).ravel()
        flat = np.where(flat < 0, flat + len(self), flat)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"index out of range for a token stream of {len(self)}")
        which = np.searchsorted(self._ends, flat, side="right")
        out = np.empty(flat.shape, self.dtype)
        touched = np.unique(which)
        for s in touched:
            hit = which == s
            out[hit] = self.shards[s][flat[hit] - self._starts[s]]
        self._release(touched)
        return out.reshape(index.shape) if index.ndim else out[0]

    def _release(self, shards: Iterable[int]) -> None:
        if hasattr(mmap, "MADV_DONTNEED"):
            for s in shards:
                self._maps[s].madvise(mmap.MADV_DONTNEED)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = np.concatenate(self.shards)
        return whole if dtype is None else whole.astype(dtype)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()


# ----------------------------------------------------------------------------- batches

class TokenSampler:
    """Random training windows that depend only on (seed, step), with coverage tracking.

    Row j of a global batch (train.batch_size rows) starts anywhere in a plain token array. In a
    TokenStream (a prepared, sharded corpus) it starts inside the j-th of batch_size equal contiguous
    stretches of the stream and never crosses into the next one, so the rows a process computes
    (train.parallel: rows rank*B/W ... (rank+1)*B/W - 1) read only its own contiguous part of the
    corpus, the parts of all processes are disjoint and together cover it (`part`), and the global
    batch is still the same at every world size."""

    def __init__(self, tokens: np.ndarray | TokenStream, seq_len: int, batch_size: int, seed: int) -> None:
        _check_window(tokens, seq_len)
        if batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise UserError(f"seed must be >= 0, got {seed}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.stratified = isinstance(tokens, TokenStream)
        n = len(tokens)
        self._lo = np.arange(batch_size, dtype=np.int64) * n // batch_size
        self._hi = np.arange(1, batch_size + 1, dtype=np.int64) * n // batch_size
        if self.stratified and int((self._hi - self._lo).min()) < seq_len + 1:
            raise UserError(f"{tokens.filename}: {n} tokens make train.batch_size {batch_size} stretches of "
                            f"{int((self._hi - self._lo).min())}, but each row's window needs seq_len + 1 = "
                            f"{seq_len + 1}; use more data, a shorter seq_len or a smaller batch")
        self._coverage = _Coverage(seq_len + 1)
        self._offsets = np.arange(seq_len + 1)

    def batch(self, step: int, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch for `step`, or its `rows` (this process's share of a multi-process
        step): x and y = x shifted by one, each (rows, seq_len). Only the rows' tokens are read;
        coverage marks the whole global batch, so every process (and rank 0's report) counts what
        all of them consumed."""
        rng = np.random.default_rng([self.seed, step])
        # A window needs seq_len + 1 tokens, so the last valid start is end - seq_len - 1.
        if self.stratified:
            starts = rng.integers(self._lo, self._hi - self.seq_len)
        else:
            starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        self._coverage.add(starts)
        index = starts[:, None] + self._offsets
        window = torch.from_numpy(self.tokens[index[rows if rows is not None else slice(None)]].astype(np.int64))
        return window[:, :-1], window[:, 1:]

    def part(self, rows: slice | None = None) -> tuple[int, int]:
        """[begin, end) of the token positions that `rows` of any batch can read: with a TokenStream
        the contiguous stretch of those rows, otherwise the whole array."""
        chosen = range(self.batch_size)[rows if rows is not None else slice(None)]
        if not self.stratified:
            return 0, len(self.tokens)
        return int(self._lo[chosen[0]]), int(self._hi[chosen[-1]])

    def unique_tokens(self) -> int:
        """How many distinct token positions have appeared in any batch so far."""
        return self._coverage.count()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """coverage: the covered positions as [begin, end) int64 pairs (little-endian bytes; their number
        follows the windows drawn, not the corpus size), coverage_encoding 1. Checkpoints written before
        hold a bitmap, one bit per position (no coverage_encoding); load_state_dict reads both."""
        pairs = np.ascontiguousarray(self._coverage.intervals(), dtype="<i8")
        return {
            "coverage": torch.from_numpy(pairs.reshape(-1).view(np.uint8).copy()),
            "coverage_encoding": torch.tensor(1, dtype=torch.int64),
            "num_tokens": torch.tensor(len(self.tokens), dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        num_tokens = int(state["num_tokens"])
        if num_tokens != len(self.tokens):
            raise UserError(f"checkpoint sampler covers {num_tokens} tokens but the training "
                            f"data has {len(self.tokens)}; resume with the same data and tokenizer")
        raw = state["coverage"].cpu().numpy().astype(np.uint8)
        if int(state.get("coverage_encoding", 0)) == 1:
            pairs = raw.view("<i8").reshape(-1, 2).astype(np.int64)
        else:                                   # a bitmap: its runs of set bits
            edges = np.diff(np.concatenate([[0], np.unpackbits(raw, count=num_tokens).astype(np.int8), [0]]))
            pairs = np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)], axis=1)
        self._coverage = _Coverage(self.seq_len + 1, pairs)


class _Coverage:
    """Distinct positions read, as sorted disjoint [begin, end) intervals of windows of `width` tokens.
    Its size follows the number of windows drawn (at most one interval each), never the corpus's: a
    bitmap over the corpus would make training memory grow with it. Starts are merged in bulk."""

    MERGE_EVERY = 1 << 14

    def __init__(self, width: int, pairs: np.ndarray | None = None) -> None:
        self.width = width
        pairs = np.zeros((0, 2), np.int64) if pairs is None else np.asarray(pairs, np.int64).reshape(-1, 2)
        self._begins, self._ends = pairs[:, 0].copy(), pairs[:, 1].copy()
        self._pending: list[np.ndarray] = []
        self._pending_n = 0

    def add(self, starts: np.ndarray) -> None:
        # replaying a step (after a resume) adds the same intervals again: merging never double counts
        self._pending.append(np.asarray(starts, np.int64))
        self._pending_n += len(starts)
        if self._pending_n >= self.MERGE_EVERY:
            self._merge()

    def intervals(self) -> np.ndarray:
        self._merge()
        return np.stack([self._begins, self._ends], axis=1)

    def count(self) -> int:
        self._merge()
        return int((self._ends - self._begins).sum())

    def _merge(self) -> None:
        if not self._pending:
            return
        starts = np.concatenate(self._pending)
        begins = np.concatenate([self._begins, starts])
        ends = np.concatenate([self._ends, starts + self.width])
        order = np.argsort(begins, kind="stable")
        begins, ends = begins[order], ends[order]
        reach = np.maximum.accumulate(ends)
        first = np.ones(len(begins), dtype=bool)
        first[1:] = begins[1:] > reach[:-1]          # a gap before it: a new interval starts here
        at = np.flatnonzero(first)
        self._begins, self._ends = begins[at], np.maximum.reduceat(ends, at)
        self._pending, self._pending_n = [], 0


def val_batches(tokens: np.ndarray, seq_len: int, batch_size: int,
                max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows from the start of `tokens`, grouped into at most max_batches.

    The last batch may have fewer rows. The result is the same on every call.
    """
    _check_window(tokens, seq_len)
    if batch_size < 1 or max_batches < 1:
        raise UserError(f"val batch_size and max_batches must be >= 1, "
                        f"got {batch_size} and {max_batches}")
    # Window i covers tokens[i*seq_len : i*seq_len + seq_len + 1]; neighbours share only the
    # one boundary token, which is an input in one window and never a target twice.
    windows = min((len(tokens) - 1) // seq_len, batch_size * max_batches)
    starts = np.arange(windows) * seq_len
    data = torch.from_numpy(tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in data.split(batch_size)]


def _check_window(tokens: np.ndarray, seq_len: int) -> None:
    if seq_len < 1:
        raise UserError(f"seq_len must be >= 1, got {seq_len}")
    if len(tokens) < seq_len + 1:
        where = getattr(tokens, "filename", None) or "token array"
        raise UserError(f"{where}: has {len(tokens)} tokens but seq_len {seq_len} needs at "
                        f"least {seq_len + 1}; use more data or a shorter seq_len")
