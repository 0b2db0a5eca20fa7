"""Data sources and sharded token streams: JSONL with a text field, parquet files and saved datasets
folders read as streams of documents; prepared shards read as one memory-mapped stream, each process
of a multi-process run reading its own disjoint part; every format prepares and trains."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import looplm.runs.report
from looplm.cli import main
from looplm.data.sources import open_source, read_documents
from looplm.data.text import TokenSampler, TokenStream, encode_tokens, open_tokens
from looplm.data.tokenizer import ByteTokenizer
from looplm.errors import UserError
from looplm.train.parallel import World, shard
from looplm.train.trainer import train

from conftest import tiny_recipe

TEXTS = [f"document {i}: " + "héllo wörld, loops and rounds " * (i % 5 + 2) for i in range(40)]


def write_jsonl(path, texts, field="content"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def write_parquet(path, texts, field="body"):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path, row_group_size=7)
    return path


def write_dataset(path, texts, field="body", splits=None):
    import datasets
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"id": list(range(len(texts))), field: texts})
    (datasets.DatasetDict({s: ds for s in splits}) if splits else ds).save_to_disk(str(path))
    return path


def one_line_refusal(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


# ----------------------------------------------------------------------------- sources

def test_every_source_streams_its_documents_in_order(tmp_path):
    texts = TEXTS[:20] + ["", None] + TEXTS[20:]       # empty and null texts are skipped
    kept = [t for t in texts if t]
    (tmp_path / "pq").mkdir()
    write_parquet(tmp_path / "pq" / "a.parquet", texts[:15])
    write_parquet(tmp_path / "pq" / "b.parquet", texts[15:])
    (tmp_path / "pq" / "README.md").write_text("a parquet folder's other files are not documents")
    sources = {
        "jsonl": (write_jsonl(tmp_path / "d.jsonl", texts), "content"),
        "parquet": (write_parquet(tmp_path / "one.parquet", texts), "body"),
        "folder": (tmp_path / "pq", "body"),
        "datasets": (write_dataset(tmp_path / "ds", texts), "body"),
        "datasetdict": (write_dataset(tmp_path / "dd", texts, splits=("train", "test")), "body"),
    }
    for kind, (path, field) in sources.items():
        src = open_source(path, field)
        docs = list(src.documents(10**9))
        assert [t for _, t in docs] == kept, kind
        assert len({n for n, _ in docs}) == len(docs), kind          # names are unique: they decide the split
        # whole documents until at least max_bytes: the first one over the limit is the last one read
        sizes = [len(t.encode()) for t in kept]
        few = list(src.documents(sizes[0] + 1))
        assert [t for _, t in few] == kept[:2], kind
    assert open_source(tmp_path / "dd", "body").split == "train"
    assert read_documents(str(tmp_path / "d.jsonl"), 10**9, "content")[0] == ("d.jsonl:1", TEXTS[0])


def test_a_missing_text_field_names_the_field_and_what_is_there(tmp_path, capsys):
    paths = [write_jsonl(tmp_path / "d.jsonl", TEXTS, field="body"), write_parquet(tmp_path / "p.parquet", TEXTS),
             write_dataset(tmp_path / "ds", TEXTS)]
    for path in paths:
        with pytest.raises(UserError) as err:
            list(open_source(path, "content").documents(10**9))
        msg = str(err.value)
        assert "'content'" in msg and "data.text_field" in msg and "body" in msg and "id" in msg and str(path) in msg
    # through the command line: one line, exit 2, nothing written
    for path in paths[:2]:
        err = one_line_refusal(capsys, ["data", "prepare", str(path), "--out", str(tmp_path / "out"),
                                        "--text-field", "content"])
        assert "content" in err and "body" in err
    assert not (tmp_path / "out" / "manifest.json").exists()
    # a column that is not text
    with pytest.raises(UserError, match="'id' .*not text"):
        open_source(paths[1], "id")
    # a DatasetDict without a train split says which splits it has
    write_dataset(tmp_path / "dd", TEXTS, splits=("validation", "test"))
    with pytest.raises(UserError, match="validation, test"):
        open_source(tmp_path / "dd", "body")


def test_text_field_applies_only_to_sources_with_fields(tmp_path, text_dir, capsys):
    # the recipe rule: no data.path (the embedded corpus), no field to choose
    with pytest.raises(UserError, match="data.text_field.*data.path"):
        tiny_recipe(**{"data.text_field": "body"})
    # plain text has no fields: refused when the source is opened, in one line naming the field
    err = one_line_refusal(capsys, ["data", "prepare", str(text_dir), "--out", str(tmp_path / "out"),
                                    "--text-field", "body"])
    assert "data.text_field" in err and str(text_dir) in err


# ----------------------------------------------------------------------------- shards

def sharded(tmp_path, shard_tokens=37, docs=TEXTS):
    docs = [(f"d{i}", t) for i, t in enumerate(docs)]
    whole = encode_tokens(docs, ByteTokenizer(), tmp_path / "whole" / "train.bin")
    stream = encode_tokens(docs, ByteTokenizer(), tmp_path / "shards" / "train.bin", shard_tokens=shard_tokens)
    return np.asarray(whole), stream


def test_shards_read_as_one_stream(tmp_path):
    whole, stream = sharded(tmp_path)
    assert isinstance(stream, TokenStream) and len(stream.shards) == math.ceil(len(whole) / 37)
    assert all(len(s) == 37 for s in stream.shards[:-1])
    reopened = open_tokens(tmp_path / "shards" / "train.bin")
    assert np.array_equal(np.asarray(reopened), whole) and reopened.dtype == np.uint16
    rng = np.random.default_rng(0)
    index = rng.integers(0, len(whole), size=(5, 40))
    assert np.array_equal(stream[index], whole[index])
    for sl in (slice(0, 10), slice(30, 80), slice(35, 37), slice(len(whole) - 5, None), slice(10, 10)):
        assert np.array_equal(stream[sl], whole[sl])
    assert stream[-1] == whole[-1] and stream[40] == whole[40]
    with pytest.raises(IndexError):
        stream[np.array([len(whole)])]
    # a shard that does not match the sidecar is named
    (tmp_path / "shards" / "train-00001.bin").write_bytes(b"\0\0")
    with pytest.raises(UserError, match="train-00001.bin"):
        open_tokens(tmp_path / "shards" / "train.bin")


class Recorded(TokenStream):
    """A token stream that remembers which positions were read."""

    def __init__(self, stream: TokenStream) -> None:
        super().__init__(stream.files, stream.dtype, stream.filename)
        self.read: list[np.ndarray] = []

    def __getitem__(self, key):
        self.read.append(np.asarray(key).ravel())
        return super().__getitem__(key)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_process_reads_its_own_disjoint_part(tmp_path, world_size):
    whole, stream = sharded(tmp_path)
    batch, seq = 6, 8
    reference = TokenSampler(stream, seq, batch, seed=3)
    parts, batches = [], {}
    for rank in range(world_size):
        rows = shard(World(rank=rank, size=world_size), batch)
        tokens = Recorded(stream)
        sampler = TokenSampler(tokens, seq, batch, seed=3)
        lo, hi = sampler.part(rows)
        for step in range(60):
            batches.setdefault(step, []).append(sampler.batch(step, rows)[0])
        read = np.concatenate(tokens.read)
        assert lo <= read.min() and read.max() < hi          # only its own part
        parts.append((lo, hi))
    # the parts are disjoint and together cover every token
    parts.sort()
    assert parts[0][0] == 0 and parts[-1][1] == len(whole)
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    # ... and the global batch is the same at every world size
    for step, pieces in batches.items():
        assert torch.equal(torch.cat(pieces), reference.batch(step)[0])
    # a plain array keeps the whole-array windows (and the same batch as before shards)
    plain = TokenSampler(whole, seq, batch, seed=3)
    assert plain.part(shard(World(rank=0, size=world_size), batch)) == (0, len(whole))


def test_a_stream_too_short_for_its_rows_is_refused(tmp_path):
    _, stream = sharded(tmp_path, docs=TEXTS[:2])
    with pytest.raises(UserError, match="batch_size"):
        TokenSampler(stream, seq_len=len(stream) // 4, batch_size=8, seed=0)


@pytest.mark.parametrize("kind", ["plain", "stream"])
def test_coverage_counts_distinct_positions_in_bounded_memory(tmp_path, kind, monkeypatch):
    whole, stream = sharded(tmp_path)
    tokens = whole if kind == "plain" else stream
    from looplm.data import text as text_mod
    monkeypatch.setattr(text_mod._Coverage, "MERGE_EVERY", 16)      # merge in the middle of the run too
    sampler = TokenSampler(tokens, 8, 4, seed=1)
    seen = np.zeros(len(whole), dtype=bool)
    rng_steps = [5, 0, 3, 5, 17, 2, 200, 3]
    for step in rng_steps + list(range(30)):
        x, y = sampler.batch(step)
        rng = np.random.default_rng([1, step])
        lo, hi = sampler._lo, sampler._hi
        starts = rng.integers(lo, hi - 8) if kind == "stream" else rng.integers(0, len(whole) - 8, size=4)
        for s in starts:
            seen[s:s + 9] = True
        assert sampler.unique_tokens() == int(seen.sum())
    state = sampler.state_dict()
    assert state["coverage"].dtype == torch.uint8 and state["coverage"].numel() <= 16 * 4 * 40
    resumed = TokenSampler(tokens, 8, 4, seed=1)
    resumed.load_state_dict(state)
    assert resumed.unique_tokens() == sampler.unique_tokens()
    # a checkpoint written before: one bit per position
    old = {"coverage": torch.from_numpy(np.packbits(seen)), "num_tokens": torch.tensor(len(whole))}
    legacy = TokenSampler(tokens, 8, 4, seed=1)
    legacy.load_state_dict(old)
    assert legacy.unique_tokens() == int(seen.sum())
    legacy.batch(999)
    sampler.batch(999)
    assert legacy.unique_tokens() == sampler.unique_tokens()


# ----------------------------------------------------------------------------- every format trains

def test_every_format_prepares_and_trains(tmp_path, monkeypatch):
    monkeypatch.setattr(looplm.runs.report, "write_plots", lambda run_dir, report: [])   # seconds of matplotlib
    sources = {"parquet": (write_parquet(tmp_path / "c.parquet", TEXTS * 3), "body"),
               "datasets": (write_dataset(tmp_path / "ds", TEXTS * 3), "body"),
               "jsonl": (write_jsonl(tmp_path / "c.jsonl", TEXTS * 3), "content")}
    over = {"train.steps": 3, "train.checkpoint_every": 3, "train.eval_batches": 1, "train.log_every": 1}
    for kind, (path, field) in sources.items():
        prep = tmp_path / f"prep-{kind}"
        assert main(["data", "prepare", str(path), "--out", str(prep), "--text-field", field,
                     "--shard-tokens", "2000", "--quiet"]) == 0
        m = json.loads((prep / "manifest.json").read_text())
        assert m["source_kind"] == kind and m["text_field"] == field and len(m["shards"]["train"]) > 1
        assert sum(s["tokens"] for s in m["shards"]["train"]) == m["tokens"]["train"]
        report = train(tiny_recipe(**over, **{"data.path": str(prep)}), tmp_path / f"run-{kind}", quiet=True)
        assert all(math.isfinite(v) for v in report["val_loss_by_rounds"].values())
        assert math.isfinite(report["train_loss_final"]) and report["train_data_tokens"] == m["tokens"]["train"]
        # the run's token files are the prepared ones, linked (not copied)
        first = m["shards"]["train"][0]["file"]
        assert (tmp_path / f"run-{kind}" / "data" / first).stat().st_ino == (prep / first).stat().st_ino
    # data.path straight at a source: the trainer streams it through the same tokenizing path
    direct = train(tiny_recipe(**over, **{"data.path": str(tmp_path / "c.parquet"), "data.text_field": "body"}),
                   tmp_path / "direct", quiet=True)
    assert math.isfinite(direct["train_loss_final"])
    prepared_val = np.asarray(open_tokens(tmp_path / "prep-parquet" / "val.bin"))
    assert np.array_equal(np.asarray(open_tokens(tmp_path / "direct" / "data" / "val.bin")), prepared_val)
