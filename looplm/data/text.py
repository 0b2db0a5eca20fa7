"""Training data: read documents, split them, tokenize to disk, and sample batches.

The pipeline is
    read_documents -> split_documents -> encode_to_memmap -> TokenSampler / val_batches

With no data path the corpus is the Python standard library of the running interpreter:
real text that is present on every machine, so nothing has to be downloaded.

Everything here is deterministic. Training batches are a pure function of (seed, step), so a
run resumed at step k sees exactly the batches an uninterrupted run would have seen, and
every data-parallel rank can compute the same global batch without talking to the others.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .tokenizer import AnyTokenizer

Document = tuple[str, str]  # (name, text)

TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".py", ".rst", ".json", ".jsonl", ".toml", ".yaml", ".yml",
    ".c", ".h", ".js", ".ts", ".html", ".css",
})
ENCODE_CHUNK_DOCS = 256  # documents tokenized per batch call; bounds peak memory


# ----------------------------------------------------------------------------- reading

def default_corpus_files() -> list[Path]:
    """All `*.py` files of the interpreter's standard library, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _walk(root, lambda p: p.suffix == ".py", skip={"site-packages", "__pycache__"})
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_documents(path: str | None, max_bytes: int) -> list[Document]:
    """Read whole documents, in a fixed order, until at least `max_bytes` bytes are read.

    `path` None or "" means the default corpus; otherwise a single file (any extension) or a
    folder searched recursively for text files (see TEXT_SUFFIXES; hidden folders skipped).
    """
    if not isinstance(max_bytes, int) or max_bytes <= 0:
        raise UserError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    if not path:
        # A few stdlib files are deliberately not UTF-8 (encoding tests); they are not the
        # user's fault, so skip them instead of failing.
        root = Path(sysconfig.get_paths()["stdlib"])
        docs = _read_files(default_corpus_files(), root, max_bytes, skip_undecodable=True)
        where = f"the default corpus ({root})"
    else:
        root = Path(path)
        docs = _read_files(_user_files(root), root, max_bytes, skip_undecodable=False)
        where = str(root)
    if not docs:
        raise UserError(f"{where}: no non-empty text documents found "
                        f"(looked for {', '.join(sorted(TEXT_SUFFIXES))})")
    return docs


def _user_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise UserError(f"data path {root}: no such file or folder")
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


def _read_files(files: list[Path], root: Path, max_bytes: int,
                skip_undecodable: bool) -> list[Document]:
    docs: list[Document] = []
    total = 0
    for file in files:
        if total >= max_bytes:
            break
        try:
            raw = file.read_bytes()
        except OSError as exc:
            raise UserError(f"{file}: cannot read ({exc.strerror})") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if skip_undecodable:
                continue
            raise UserError(f"{file}: not valid UTF-8 (byte {exc.start}); "
                            f"convert it to UTF-8 or remove it from the data folder") from exc
        if not text:
            continue
        name = file.name if file == root else file.relative_to(root).as_posix()
        docs.append((name, text))
        total += len(raw)
    return docs


# ----------------------------------------------------------------------------- splitting

def split_documents(docs: Sequence[Document],
                    val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Split whole documents into (train, val), decided by a stable hash of each name.

    With two or more documents both sides get at least one; a single document goes to train
    and val is empty. Each side keeps the input order.
    """
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")
    scores = [_name_score(name) for name, _ in docs]
    is_val = [s < val_fraction for s in scores]
    if len(docs) >= 2:
        # Tiny corpora can hash entirely onto one side; move the closest document across.
        if not any(is_val):
            is_val[min(range(len(docs)), key=lambda i: (scores[i], i))] = True
        elif all(is_val):
            is_val[max(range(len(docs)), key=lambda i: (scores[i], i))] = False
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val


def _name_score(name: str) -> float:
    """A number in [0, 1) from the name; unlike hash(), the same in every process."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


# ----------------------------------------------------------------------------- token files

def encode_to_memmap(docs: Iterable[Document], tokenizer: AnyTokenizer,
                     path: str | Path) -> np.memmap:
    """Tokenize each document, append eos after each, and write them to `path` (.bin).

    `docs` may be a stream (a generator): only ENCODE_CHUNK_DOCS documents are held at once.
    A `.json` sidecar next to it records dtype and length. Returns a read-only memmap.
    """
    path = Path(path)
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary name and rename, so a crash never leaves a truncated token file
    # that a later run would trust.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per-process: ranks may race
    length = documents = 0
    stream = iter(docs)
    with open(tmp, "wb") as f:
        while chunk := [text for _, text in itertools.islice(stream, ENCODE_CHUNK_DOCS)]:
            documents += len(chunk)
            for ids in tokenizer.encode_batch(chunk):
                ids.append(tokenizer.eos_id)
                f.write(np.asarray(ids, dtype=dtype).tobytes())
                length += len(ids)
    if not documents:
        tmp.unlink()
        raise UserError(f"{path}: no documents to tokenize; train and validation each need "
                        f"at least one, so the data must hold two or more documents")
    os.replace(tmp, path)
    sidecar = {"dtype": np.dtype(dtype).name, "length": length,
               "vocab_size": tokenizer.vocab_size, "documents": documents}
    _sidecar_path(path).write_text(json.dumps(sidecar) + "\n", encoding="utf-8")
    return open_tokens(path)


def open_tokens(path: str | Path) -> np.memmap:
    """Reopen a token file written by `encode_to_memmap`, read-only."""
    path = Path(path)
    meta_path = _sidecar_path(path)
    if not path.is_file() or not meta_path.is_file():
        raise UserError(f"{path}: token file or its sidecar {meta_path.name} is missing")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        dtype, length = np.dtype(meta["dtype"]), int(meta["length"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{meta_path}: not a valid token sidecar ({exc})") from exc
    if dtype not in (np.uint16, np.uint32) or length <= 0:
        raise UserError(f"{meta_path}: expected dtype uint16/uint32 and length > 0")
    if path.stat().st_size != length * dtype.itemsize:
        raise UserError(f"{path}: size does not match {meta_path.name}; the file is truncated "
                        f"or from another run, delete it to re-tokenize")
    return np.memmap(path, dtype=dtype, mode="r", shape=(length,))


def _sidecar_path(path: Path) -> Path:
    return path.with_suffix(".json")


# ----------------------------------------------------------------------------- batches

class TokenSampler:
    """Random training windows that depend only on (seed, step), with coverage tracking."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        _check_window(tokens, seq_len)
        if batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise UserError(f"seed must be >= 0, got {seed}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self._seen = np.zeros(len(tokens), dtype=bool)  # which positions went into a batch
        self._offsets = np.arange(seq_len + 1)

    def batch(self, step: int, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch for `step`, or its `rows` (this process's share of a multi-process
        step): x and y = x shifted by one, each (rows, seq_len). Coverage marks the whole global
        batch, so every process (and rank 0's report) counts what all of them consumed."""
        rng = np.random.default_rng([self.seed, step])
        # A window needs seq_len + 1 tokens, so the last valid start is len - seq_len - 1.
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        index = starts[:, None] + self._offsets
        # Marking is idempotent, so replaying a step (e.g. after resume) never double counts.
        self._seen[index.ravel()] = True
        window = torch.from_numpy(self.tokens[index[rows if rows is not None else slice(None)]].astype(np.int64))
        return window[:, :-1], window[:, 1:]

    def unique_tokens(self) -> int:
        """How many distinct token positions have appeared in any batch so far."""
        return int(np.count_nonzero(self._seen))

    def state_dict(self) -> dict[str, torch.Tensor]:
        # Packed 8 positions per byte to keep checkpoints small on large corpora.
        return {
            "coverage": torch.from_numpy(np.packbits(self._seen)),
            "num_tokens": torch.tensor(len(self.tokens), dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        num_tokens = int(state["num_tokens"])
        if num_tokens != len(self.tokens):
            raise UserError(f"checkpoint sampler covers {num_tokens} tokens but the training "
                            f"data has {len(self.tokens)}; resume with the same data and tokenizer")
        packed = state["coverage"].cpu().numpy().astype(np.uint8)
        self._seen = np.unpackbits(packed, count=num_tokens).astype(bool)


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
