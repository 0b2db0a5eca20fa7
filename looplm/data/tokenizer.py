"""Tokenizers: turn text into token ids and back.

Two kinds share one small interface (`vocab_size`, `eos_id`, `encode`, `decode`, `token_bytes`,
`save`):

- `ByteTokenizer`: ids 0..255 are raw UTF-8 bytes and id 256 is `<|eos|>`, the document
  separator. Needs no training and handles any text.
- `BPETokenizer`: a byte-level BPE trained locally with the HF `tokenizers` library. Because
  it works on bytes, any text round-trips exactly.

A tokenizer is saved into a run folder as `tokenizer_config.json` (which kind) plus, for BPE,
`tokenizer.json`; `load_tokenizer` reads it back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..errors import UserError

EOS_TOKEN = "<|eos|>"
CONFIG_FILE = "tokenizer_config.json"
BPE_FILE = "tokenizer.json"
KINDS = ("byte", "bpe", "pretrained")


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus one end-of-document token."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # Drop eos and anything outside the byte range; a model can emit a split multi-byte
        # character, so undecodable bytes become U+FFFD rather than an exception.
        data = bytes(i for i in map(int, ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (b"" for eos): a token can hold part of a character."""
        return bytes([token]) if 0 <= token < 256 else b""

    def save(self, directory: str | Path) -> None:
        _write_config(Path(directory), "byte")


class BPETokenizer:
    """A byte-level BPE tokenizer backed by an HF `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        eos_id = tokenizer.token_to_id(EOS_TOKEN)
        if eos_id is None:
            raise UserError(f"BPE tokenizer has no {EOS_TOKEN} token; retrain it with looplm")
        # Text that happens to contain the literal string "<|eos|>" must be encoded as plain
        # bytes, otherwise it would silently split a document in two.
        tokenizer.encode_special_tokens = True
        self._tok = tokenizer
        self.eos_id: int = eos_id
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # The Rust side encodes a batch in parallel, which matters for large corpora.
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (b"" for eos): a token can hold part of a character.
        Byte-level BPE spells byte b as one printable character (GPT-2's table: printable
        Latin-1 bytes as themselves, the others as chr(256 + n) in byte order)."""
        if token == self.eos_id:
            return b""
        symbols = self._tok.id_to_token(int(token)) or ""
        return bytes(_BYTE_OF_SYMBOL[c] for c in symbols)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / BPE_FILE))
        _write_config(directory, "bpe")


class PretrainedTokenizer:
    """A pretrained model's own tokenizer (`tokenizer.json`, e.g. brought in by `looplm import`), used as
    it is: encode adds no special tokens (documents are joined with `eos_id` as every looplm stream is),
    `bos_id` is kept for callers that want the model's start-of-text token. `chat_template` is the model's
    Jinja chat template (a chat model's; None for a base model): `apply_chat` renders messages with it."""

    def __init__(self, tokenizer: Tokenizer, eos_id: int, bos_id: int | None = None,
                 chat_template: str | None = None) -> None:
        self._tok, self.eos_id, self.bos_id = tokenizer, int(eos_id), bos_id
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        if chat_template is not None:
            from .chat import compile_template
            compile_template(chat_template, "the tokenizer's chat_template")     # refused now, not at a request

    def apply_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{"role", "content"}]) through the chat template, ending where the
        assistant's reply begins (UserError when the model has no template or the template refuses them)."""
        from .chat import render_chat
        if self.chat_template is None:
            raise UserError("this model has no chat template (a base model): send a plain prompt instead")
        special = {"eos_token": self._tok.id_to_token(self.eos_id),
                   "bos_token": self._tok.id_to_token(self.bos_id) if self.bos_id is not None else None}
        return render_chat(self.chat_template, messages, add_generation_prompt, special)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for: byte-level BPE symbols (GPT-2's table: Llama 3, Qwen),
        SentencePiece byte fallback `<0xNN>` and `▁` for a space (Llama 2, Gemma); b"" for special tokens."""
        symbols = self._tok.id_to_token(int(token))
        if symbols is None or token in (self.eos_id, self.bos_id):
            return b""
        if len(symbols) == 6 and symbols.startswith("<0x") and symbols.endswith(">"):
            return bytes([int(symbols[3:5], 16)])
        if all(c in _BYTE_OF_SYMBOL for c in symbols):
            return bytes(_BYTE_OF_SYMBOL[c] for c in symbols)
        return symbols.replace("\u2581", " ").encode("utf-8")

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / BPE_FILE))
        _write_config(directory, "pretrained", eos_id=self.eos_id, bos_id=self.bos_id,
                      **({"chat_template": self.chat_template} if self.chat_template is not None else {}))


AnyTokenizer = ByteTokenizer | BPETokenizer | PretrainedTokenizer

_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
_BYTE_OF_SYMBOL = {chr(b): b for b in _PRINTABLE}
_BYTE_OF_SYMBOL.update({chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in _PRINTABLE)})


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE on `texts`; the same input gives the same tokenizer.

    The result can be smaller than `vocab_size` when the text has too few distinct merges.
    """
    minimum = ByteTokenizer.vocab_size + 1  # 256 bytes + eos + at least one merge
    if not isinstance(vocab_size, int) or not minimum <= vocab_size <= 2**32 - 1:
        raise UserError(f"vocab_size must be an integer >= {minimum} for a BPE tokenizer, "
                        f"got {vocab_size!r}")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps round trips exact (no space invented at the start).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # Seed with all 256 byte symbols so text unseen in training still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok)


def encode_with_eos(tok: AnyTokenizer, text: str) -> list[int]:
    """Text with each literal "<|eos|>" read as the end-of-text token (as Hugging Face tokenizers
    read special tokens in text). `encode` keeps such text as plain characters, so that no
    document is ever split; a client that finds the eos id by tokenizing its string (the
    server's /tokenize, for lm-evaluation-harness) needs this reading instead."""
    ids: list[int] = []
    for i, piece in enumerate(text.split(EOS_TOKEN)):
        if i:
            ids.append(tok.eos_id)
        ids.extend(tok.encode(piece) if piece else [])
    return ids


def build_tokenizer(kind: str, texts: Iterable[str], vocab_size: int) -> AnyTokenizer:
    """The byte tokenizer for "byte" (texts and vocab_size unused); a trained BPE for "bpe"."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return train_bpe(texts, vocab_size)
    if kind == "pretrained":
        raise UserError("data.tokenizer = \"pretrained\" uses the tokenizer of the run training starts from: "
                        "train with --init RUN")
    raise UserError(f"tokenizer kind must be one of {', '.join(KINDS)}, got {kind!r}")


def read_tokenizer_file(path: str | Path) -> Tokenizer:
    """A `tokenizers` file (tokenizer.json), checked: UserError naming it when it is missing or not a
    tokenizer the library reads. The one reader of tokenizer.json, a run's and an imported model's."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: missing (expected a tokenizers file, {BPE_FILE})")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust loader raises a bare Exception on bad JSON or an unknown model
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{path}: not a readable tokenizers file ({detail})") from None


def load_tokenizer(directory: str | Path) -> AnyTokenizer:
    """Read a tokenizer written by `save` from `directory`, every file checked (UserError naming it)."""
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    config = _read_config(config_path)
    kind = config.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer(read_tokenizer_file(directory / BPE_FILE))
    if kind == "pretrained":
        eos, bos = config.get("eos_id"), config.get("bos_id")
        if not _is_id(eos) or not (bos is None or _is_id(bos)):
            raise UserError(f"{config_path}: a pretrained tokenizer's config needs its eos_id (and bos_id, when "
                            f"given) as token ids, got eos_id {eos!r}, bos_id {bos!r}")
        template = config.get("chat_template")
        if not (template is None or isinstance(template, str)):
            raise UserError(f"{config_path}: chat_template must be a string (a Jinja template), got "
                            f"{type(template).__name__}")
        tok = PretrainedTokenizer(read_tokenizer_file(directory / BPE_FILE), eos, bos, template)
        if max(eos, bos or 0) >= tok.vocab_size:
            raise UserError(f"{config_path}: eos_id {eos} / bos_id {bos} outside {directory / BPE_FILE}'s "
                            f"{tok.vocab_size} ids")
        return tok
    raise UserError(f"{config_path}: 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _write_config(directory: Path, kind: str, **extra: int | str | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps({"kind": kind, **extra}) + "\n", encoding="utf-8")


def _read_config(path: Path) -> dict:
    from ..files import read_json_object
    return read_json_object(path, "a tokenizer config with a 'kind' field")
