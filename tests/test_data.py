"""Tests for looplm.data.tokenizer and looplm.data.text: tokenizers, corpus reading, token files, sampling."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from looplm.data.text import (TokenSampler, default_corpus_files, encode_to_memmap, open_tokens,
                         read_documents, split_documents, val_batches)
from looplm.errors import UserError
from looplm.data.tokenizer import (EOS_TOKEN, BPETokenizer, ByteTokenizer, build_tokenizer, encode_with_eos,
                              load_tokenizer, train_bpe)

TRICKY = "héllo wörld, 世界 🙂\n\ttabs  and  spaces <|eos|> end"


def small_corpus(n: int = 200) -> list[str]:
    """A generated corpus with enough repetition for BPE to find merges."""
    words = ["loop", "model", "token", "depth", "recurrent", "layer", "état", "データ"]
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(i % 13 + 3)) + f" {i}\n"
            for i in range(n)]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return train_bpe(small_corpus(), vocab_size=300)


# ----------------------------------------------------------------------------- tokenizers

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TRICKY)
    assert tok.vocab_size == 257 and tok.eos_id == 256
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == TRICKY
    assert tok.decode(ids + [tok.eos_id] + ids) == TRICKY + TRICKY
    assert tok.decode([0xE4]) == "\ufffd"  # a lone partial character does not raise


def test_bpe_round_trip_and_determinism(bpe: BPETokenizer):
    assert 257 < bpe.vocab_size <= 300
    for text in [TRICKY, small_corpus()[5], "", "never seen: ∮ E⋅da = Q"]:
        ids = bpe.encode(text)
        assert bpe.eos_id not in ids  # a literal "<|eos|>" in text stays plain text
        assert bpe.decode(ids) == text
    assert len(bpe.encode(small_corpus()[5])) < len(small_corpus()[5].encode())  # it merges
    again = train_bpe(small_corpus(), vocab_size=300)
    assert again.encode(TRICKY) == bpe.encode(TRICKY)
    assert again._tok.to_str() == bpe._tok.to_str()


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_token_bytes_concatenate_to_the_texts_utf8(bpe: BPETokenizer, kind: str):
    """token_bytes is what logprobs show for a token that holds part of a character."""
    tok = ByteTokenizer() if kind == "byte" else bpe
    for text in [TRICKY, small_corpus()[5], "never seen: ∮ E⋅da = Q 🙂"]:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.token_bytes(tok.eos_id) == b""
    assert all(tok.token_bytes(i).decode("utf-8", "replace") == tok.decode([i]) for i in range(tok.vocab_size))


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_encode_with_eos_reads_the_literal_token_as_the_token(bpe: BPETokenizer, kind: str):
    """The server's /tokenize reading: each literal "<|eos|>" is the eos id, the text around it
    encoded as `encode` would (each piece alone: the token is a boundary)."""
    tok = ByteTokenizer() if kind == "byte" else bpe
    assert encode_with_eos(tok, EOS_TOKEN) == [tok.eos_id]         # lm-eval's eos lookup: encode(eos)[0]
    a, b = "héllo wörld", " loop model"
    assert encode_with_eos(tok, a + EOS_TOKEN + b + EOS_TOKEN * 2) == \
        tok.encode(a) + [tok.eos_id] + tok.encode(b) + [tok.eos_id] * 2
    assert encode_with_eos(tok, TRICKY.replace(EOS_TOKEN, "")) == tok.encode(TRICKY.replace(EOS_TOKEN, ""))
    assert encode_with_eos(tok, "") == []


def test_bpe_rejects_tiny_vocab():
    with pytest.raises(UserError, match="vocab_size"):
        train_bpe(small_corpus(), vocab_size=100)


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_save_and_load_tokenizer(tmp_path: Path, kind: str):
    tok = build_tokenizer(kind, small_corpus(), 300)
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config == {"kind": kind}
    loaded = load_tokenizer(tmp_path)
    assert type(loaded) is type(tok)
    assert (loaded.vocab_size, loaded.eos_id) == (tok.vocab_size, tok.eos_id)
    assert loaded.encode(TRICKY) == tok.encode(TRICKY)
    assert loaded.decode(tok.encode(TRICKY)) == TRICKY


def test_load_tokenizer_errors(tmp_path: Path):
    with pytest.raises(UserError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match=str(tmp_path)):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"kind": "bpe"}')
    with pytest.raises(UserError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("garbage")
    with pytest.raises(UserError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(UserError, match="kind"):
        build_tokenizer("wordpiece", [], 300)


# ----------------------------------------------------------------------------- reading

def test_default_corpus():
    files = default_corpus_files()
    names = {f.name for f in files}
    assert "os.py" in names
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "__pycache__" in f.parts for f in files)
    docs = read_documents(None, max_bytes=20_000)
    assert docs and docs == read_documents("", max_bytes=20_000)
    assert docs[0][0] == "__future__.py"  # sorted by relative path
    # Whole documents only: stops after the first document that reaches the limit.
    sizes = [len(text.encode()) for _, text in docs]
    assert sum(sizes[:-1]) < 20_000 <= sum(sizes)


def write_tree(root: Path) -> None:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha document\n", encoding="utf-8")
    (root / "sub" / "b.md").write_text("# beta ünïcode\n", encoding="utf-8")
    (root / "sub" / "c.py").write_text("print('gamma')\n", encoding="utf-8")
    (root / "image.png").write_bytes(b"\x89PNG\x00\xff")  # not a text suffix: ignored
    (root / "empty.txt").write_text("", encoding="utf-8")  # empty: skipped


def test_read_documents_folder_and_file(tmp_path: Path):
    write_tree(tmp_path)
    docs = read_documents(str(tmp_path), max_bytes=10_000)
    assert [name for name, _ in docs] == ["a.txt", "sub/b.md", "sub/c.py"]
    assert docs[1][1] == "# beta ünïcode\n"
    assert read_documents(str(tmp_path), max_bytes=1) == docs[:1]
    assert read_documents(str(tmp_path / "a.txt"), max_bytes=10) == [("a.txt", "alpha document\n")]


def test_read_documents_errors(tmp_path: Path):
    missing = tmp_path / "nope"
    with pytest.raises(UserError, match=str(missing)):
        read_documents(str(missing), max_bytes=100)
    (tmp_path / "ok.txt").write_text("fine", encoding="utf-8")
    bad = tmp_path / "bad.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(UserError, match="bad.txt.*UTF-8"):
        read_documents(str(tmp_path), max_bytes=100)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=str(empty)):
        read_documents(str(empty), max_bytes=100)
    with pytest.raises(UserError, match="max_bytes"):
        read_documents(None, max_bytes=0)


# ----------------------------------------------------------------------------- splitting

def test_split_by_document():
    docs = [(f"doc{i}.txt", f"text {i}") for i in range(50)]
    train, val = split_documents(docs, 0.2)
    assert train and val
    assert sorted(train + val) == sorted(docs)  # every document whole, on exactly one side
    assert not set(train) & set(val)
    assert (train, val) == split_documents(docs, 0.2)
    assert 2 <= len(val) <= 25
    # The side a document lands on depends on its name only, not on its neighbours.
    train2, val2 = split_documents(docs[::-1], 0.2)
    assert set(val2) == set(val)


def test_split_never_leaves_a_side_empty():
    for n in range(2, 6):
        docs = [(f"d{i}", "x") for i in range(n)]
        for fraction in (0.001, 0.999):
            train, val = split_documents(docs, fraction)
            assert train and val and len(train) + len(val) == n
    assert split_documents([("only", "x")], 0.1) == ([("only", "x")], [])
    with pytest.raises(UserError, match="val_fraction"):
        split_documents([("a", "x")], 1.5)


# ----------------------------------------------------------------------------- token files

def test_memmap_round_trip(tmp_path: Path):
    tok = ByteTokenizer()
    docs = [("a", "héllo"), ("b", "world")]
    path = tmp_path / "train.bin"
    tokens = encode_to_memmap(docs, tok, path)
    expected = tok.encode("héllo") + [256] + tok.encode("world") + [256]
    assert tokens.dtype == np.uint16 and not tokens.flags.writeable
    assert tokens.tolist() == expected
    meta = json.loads((tmp_path / "train.json").read_text())
    assert meta["dtype"] == "uint16" and meta["length"] == len(expected)
    assert open_tokens(path).tolist() == expected
    assert not list(tmp_path.glob("*.tmp"))


def test_open_tokens_errors(tmp_path: Path):
    path = tmp_path / "x.bin"
    with pytest.raises(UserError, match="x.bin"):
        open_tokens(path)
    encode_to_memmap([("a", "abc")], ByteTokenizer(), path)
    with open(path, "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(UserError, match="x.bin"):
        open_tokens(path)


# ----------------------------------------------------------------------------- sampling

@pytest.fixture
def token_array() -> np.ndarray:
    return np.arange(1000, dtype=np.uint16)


def test_sampler_is_a_function_of_seed_and_step(token_array: np.ndarray):
    a = TokenSampler(token_array, seq_len=16, batch_size=4, seed=7)
    b = TokenSampler(token_array, seq_len=16, batch_size=4, seed=7)
    x1, y1 = a.batch(3)
    a.batch(0)  # what came before does not matter
    x2, y2 = a.batch(3)
    x3, _ = b.batch(3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(x1, x3)
    assert not torch.equal(a.batch(4)[0], x1)
    assert not torch.equal(TokenSampler(token_array, 16, 4, seed=8).batch(3)[0], x1)


def test_sampler_shapes_and_shift(token_array: np.ndarray):
    sampler = TokenSampler(token_array, seq_len=16, batch_size=4, seed=0)
    x, y = sampler.batch(0)
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)  # the array is arange, so the next token is +1
    assert int(y.max()) <= 999


def test_sampler_coverage_and_state(token_array: np.ndarray):
    sampler = TokenSampler(token_array, seq_len=16, batch_size=4, seed=1)
    assert sampler.unique_tokens() == 0
    counts = []
    for step in range(200):
        sampler.batch(step)
        counts.append(sampler.unique_tokens())
    assert counts == sorted(counts) and counts[0] > 0
    assert counts[-1] <= len(token_array)
    sampler.batch(5)  # replaying a step adds nothing
    assert sampler.unique_tokens() == counts[-1]

    state = sampler.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert state["coverage"].dtype == torch.uint8
    resumed = TokenSampler(token_array, seq_len=16, batch_size=4, seed=1)
    resumed.load_state_dict(state)
    assert resumed.unique_tokens() == sampler.unique_tokens()
    sampler.batch(500)
    resumed.batch(500)
    assert resumed.unique_tokens() == sampler.unique_tokens()

    other = TokenSampler(token_array[:500], seq_len=16, batch_size=4, seed=1)
    with pytest.raises(UserError, match="same data"):
        other.load_state_dict(state)


def test_sampler_too_short_names_the_file(tmp_path: Path):
    path = tmp_path / "tiny.bin"
    tokens = encode_to_memmap([("a", "abc")], ByteTokenizer(), path)  # 4 tokens
    with pytest.raises(UserError, match=r"tiny\.bin.*4 tokens.*at least 9"):
        TokenSampler(tokens, seq_len=8, batch_size=2, seed=0)
    with pytest.raises(UserError, match="tiny.bin"):
        val_batches(tokens, seq_len=8, batch_size=2, max_batches=1)
    TokenSampler(tokens, seq_len=3, batch_size=2, seed=0).batch(0)  # exactly enough is fine


def test_val_batches(token_array: np.ndarray):
    batches = val_batches(token_array, seq_len=100, batch_size=4, max_batches=10)
    assert [x.shape[0] for x, _ in batches] == [4, 4, 1]  # (1000 - 1) // 100 = 9 windows
    starts = [int(row[0]) for x, _ in batches for row in x]
    assert starts == list(range(0, 900, 100))  # contiguous from the start, no overlap
    for x, y in batches:
        assert torch.equal(y, x + 1)
    assert len(val_batches(token_array, 100, 4, max_batches=2)) == 2
    again = val_batches(token_array, 100, 4, 10)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    assert len(val_batches(token_array[:101], 100, 4, 10)) == 1
