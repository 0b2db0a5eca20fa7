"""`looplm data prepare`: tokenize once, train from the prepared folder with the same tokens."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import looplm.runs.report
import looplm.train.trainer
from looplm.cli import main
from looplm.data import text as data_mod
from looplm.train.trainer import train

from conftest import TINY, tiny_recipe


def sets(**extra):
    return [a for k, v in {**TINY, **extra}.items() for a in ("--set", f"{k}={v}")]


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def texts_of(path):
    """The documents of a byte-tokenized token file (each ends with eos 256)."""
    ids = np.asarray(data_mod.open_tokens(path))
    assert ids[-1] == 256
    return [bytes(part.astype(np.uint8)).decode("utf-8") for part in np.split(ids, np.flatnonzero(ids == 256))[:-1]
            for part in [part[part != 256]]]


def refusal(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_prepared_folder_trains_from_its_shards(tmp_path, text_dir, monkeypatch):
    monkeypatch.setattr(looplm.runs.report, "write_plots", lambda run_dir, report: [])   # seconds of matplotlib
    prep = tmp_path / "prep"
    assert main(["data", "prepare", str(text_dir), "--out", str(prep), "--shard-tokens", "4000"]) == 0
    manifest = json.loads((prep / "manifest.json").read_text())
    assert manifest["documents"] == {"train": 5, "val": 1} and manifest["tokenizer"] == {"kind": "byte", "vocab_size": 257}
    shards = manifest["shards"]["train"]
    assert [s["file"] for s in shards] == [f"train-{i:05d}.bin" for i in range(len(shards))] and len(shards) == 4
    assert all(s["tokens"] == 4000 for s in shards[:-1]) and sum(s["tokens"] for s in shards) == manifest["tokens"]["train"]
    assert manifest["tokens"]["train"] == len(data_mod.open_tokens(prep / "train.bin"))
    over = {"train.steps": 2, "train.checkpoint_every": 2}
    train(tiny_recipe(**over, **{"data.path": str(text_dir)}), tmp_path / "from_text", quiet=True)

    def no_text(*a, **k):  # a prepared folder is never read or tokenized again
        raise AssertionError("a source was opened for a prepared folder")
    monkeypatch.setattr(looplm.train.trainer, "open_source", no_text)
    train(tiny_recipe(**over, **{"data.path": str(prep)}), tmp_path / "from_prep", quiet=True)
    # the same tokens as the trainer's own: the shards concatenated are its train.bin
    text_train = (tmp_path / "from_text" / "data" / "train.bin").read_bytes()
    assert b"".join((prep / s["file"]).read_bytes() for s in shards) == text_train
    assert (tmp_path / "from_prep" / "data" / "val.bin").read_bytes() == (prep / "val.bin").read_bytes() \
        == (tmp_path / "from_text" / "data" / "val.bin").read_bytes()
    assert (tmp_path / "from_prep" / "checkpoint" / "tokenizer_config.json").is_file()
    assert all(math.isfinite(v) for v in losses(tmp_path / "from_prep"))
    # resuming a run trained from shards reopens them from RUN/data
    train(tiny_recipe(**{**over, "train.steps": 3}, **{"data.path": str(prep)}), tmp_path / "from_prep", resume=True,
          quiet=True)
    assert len(losses(tmp_path / "from_prep")) == 2      # the saved recipe (2 steps) wins on resume
    # eval --data DIR scores DIR's held-out split: for the run trained on the text, its own val split
    import contextlib
    import io
    out = {}
    for key, extra in (("own", []), ("prep", ["--data", str(prep)])):
        with contextlib.redirect_stdout(io.StringIO()) as buf:
            assert main(["eval", str(tmp_path / "from_text"), "--rounds", "1,3", "--json", *extra]) == 0
        out[key] = json.loads(buf.getvalue())["rounds"]
    assert out["prep"] == out["own"]


def test_a_version_1_folder_still_trains_like_the_text(tmp_path, text_dir, monkeypatch):
    """Folders prepared before shards (one train.bin) keep training, on the same windows as the text."""
    import shutil
    monkeypatch.setattr(looplm.runs.report, "write_plots", lambda run_dir, report: [])
    over = {"train.steps": 2, "train.checkpoint_every": 2, "train.eval_batches": 1}
    train(tiny_recipe(**over, **{"data.path": str(text_dir)}), tmp_path / "from_text", quiet=True)
    old = tmp_path / "v1"
    old.mkdir()
    for name in ("train.bin", "train.json", "val.bin", "val.json"):
        shutil.copy(tmp_path / "from_text" / "data" / name, old / name)
    shutil.copy(tmp_path / "from_text" / "checkpoint" / "tokenizer_config.json", old)
    (old / "manifest.json").write_text(json.dumps({
        "format": "looplm-prepared-data", "version": 1, "source": str(text_dir), "source_kind": "text",
        "tokenizer": {"kind": "byte", "vocab_size": 257}, "model_vocab_size": 257, "dtype": "uint16",
        "tokens": {}, "documents": {"train": 5, "val": 1}, "max_bytes": 2_000_000, "val_fraction": 0.05}))
    train(tiny_recipe(**over, **{"data.path": str(old)}), tmp_path / "from_v1", quiet=True)
    assert losses(tmp_path / "from_v1") == losses(tmp_path / "from_text")


def test_jsonl_source_one_document_per_line(tmp_path):
    lines = [f"document {i}: " + "héllo wörld " * (i + 3) for i in range(8)]
    src = tmp_path / "docs.jsonl"
    rows = [json.dumps({"text": t, "id": i}) for i, t in enumerate(lines)]
    src.write_text("\n".join(rows[:4] + ["", json.dumps({"text": ""})] + rows[4:]) + "\n", encoding="utf-8")
    prep = tmp_path / "prep"
    assert main(["data", "prepare", str(src), "--out", str(prep), "--set", "data.val_fraction=0.3"]) == 0
    train_texts, val_texts = texts_of(prep / "train.bin"), texts_of(prep / "val.bin")
    assert train_texts and val_texts
    assert sorted(train_texts + val_texts) == sorted(lines)          # every line once, none split or dropped
    assert train_texts == [t for t in lines if t in train_texts]     # file order within each split
    assert val_texts == [t for t in lines if t in val_texts]
    m = json.loads((prep / "manifest.json").read_text())
    assert m["source_kind"] == "jsonl" and m["documents"] == {"train": len(train_texts), "val": len(val_texts)}
    assert m["val_fraction"] == 0.3


def test_recipe_disagreeing_with_the_manifest_is_refused(tmp_path, text_dir, capsys):
    prep = tmp_path / "prep"
    assert main(["data", "prepare", str(text_dir), "--out", str(prep),
                 "--set", "data.tokenizer=bpe", "--set", "model.vocab_size=300"]) == 0
    capsys.readouterr()
    # a run with another tokenizer cannot be scored on these tokens (looplm eval RUN --data DIR)
    from looplm.data.prepared import prepared_eval_tokens
    from looplm.data.tokenizer import ByteTokenizer, load_tokenizer
    from looplm.errors import UserError
    with pytest.raises(UserError, match="not this run's"):
        prepared_eval_tokens(prep, ByteTokenizer())
    assert len(prepared_eval_tokens(prep, load_tokenizer(prep))) == len(data_mod.open_tokens(prep / "val.bin"))
    run = ["train", "--out", str(tmp_path / "run"), *sets(**{"data.path": prep})]
    assert "data.tokenizer" in refusal(capsys, run)
    assert "model.vocab_size" in refusal(capsys, run + ["--set", "data.tokenizer=bpe", "--set", "model.vocab_size=320"])
    for field, value in (("data.max_bytes", 5000), ("data.val_fraction", 0.2)):
        err = refusal(capsys, run + ["--set", "data.tokenizer=bpe", "--set", "model.vocab_size=300",
                                     "--set", f"{field}={value}"])
        assert field in err


@pytest.mark.parametrize("name, content", [
    ("missing", None), ("empty_folder", ""), ("no_text.jsonl", '{"body": "x"}\n'),
    ("broken.jsonl", '{"text": "ok"}\n{"text": \n'), ("blank.jsonl", "\n\n"), ("one_doc.txt", "only one document\n"),
])
def test_bad_sources_exit_2(tmp_path, capsys, name, content):
    src = tmp_path / name
    if name == "empty_folder":
        src.mkdir()
    elif content is not None:
        src.write_text(content)
    err = refusal(capsys, ["data", "prepare", str(src), "--out", str(tmp_path / "out")])
    assert name in err
    assert not (tmp_path / "out" / "manifest.json").exists()


# ----------------------------------------------------------------------------- resuming

RESUMABLE = ["--set", "data.tokenizer=bpe", "--set", "model.vocab_size=300", "--shard-tokens", "1500", "--quiet"]
KILLED_AFTER = 3


def killed_prepare(source: Path, out: Path) -> subprocess.CompletedProcess:
    """`looplm data prepare` in its own process, killed (SIGKILL: no cleanup runs) right after it
    recorded its third shard."""
    script = f"""
import os, signal, sys
from looplm.data import prepared
real = prepared.prepare
def killing(*a, **k):
    def hook(split, shards):
        if shards == {KILLED_AFTER}:
            os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k, on_shard=hook)
prepared.prepare = killing
from looplm.cli import main
main({["data", "prepare", str(source), "--out", str(out), *RESUMABLE]!r})
"""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def folder(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_a_killed_prepare_resumes_to_the_same_bytes(tmp_path, text_dir, capsys, monkeypatch):
    whole = tmp_path / "whole"
    assert main(["data", "prepare", str(text_dir), "--out", str(whole), *RESUMABLE]) == 0
    assert len(json.loads((whole / "manifest.json").read_text())["shards"]["train"]) > KILLED_AFTER + 1
    capsys.readouterr()

    out = tmp_path / "out"
    proc = killed_prepare(text_dir, out)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # the work so far is beside OUT, in OUT.partial: OUT itself appears only when whole
    partial = tmp_path / "out.partial"
    assert not out.exists() and (partial / "prepare.journal.json").is_file()
    assert {f"train-{i:05d}.bin" for i in range(KILLED_AFTER)} <= set(os.listdir(partial))
    # an unfinished folder is neither a prepared folder nor text to train on, by either name
    run = ["train", "--out", str(tmp_path / "run"), *sets(**{"data.path": out})]
    err = refusal(capsys, run)
    assert "not prepared yet" in err and str(partial) in err
    assert "has not finished" in refusal(capsys, run[:-1] + [f"data.path={partial}"])
    # other settings into the same folder are refused, naming what differs
    for extra, differs in ((["--set", "data.val_fraction=0.2"], "val_fraction"), (["--shard-tokens", "999"], "shard_tokens")):
        err = refusal(capsys, ["data", "prepare", str(text_dir), "--out", str(out), *RESUMABLE, *extra])
        assert differs in err and str(out) in err
    other = tmp_path / "other.txt"
    other.write_text("another source\n" * 50)
    assert "source" in refusal(capsys, ["data", "prepare", str(other), "--out", str(out), *RESUMABLE])

    # the same command again continues after the last recorded shard ...
    from looplm.data import prepared
    calls, real = [], prepared.prepare
    monkeypatch.setattr(prepared, "prepare", lambda *a, **k: real(*a, **k, on_shard=lambda s, n: calls.append(n)))
    assert main(["data", "prepare", str(text_dir), "--out", str(out), *RESUMABLE]) == 0
    assert calls[0] == KILLED_AFTER + 1
    # ... to exactly the bytes of an uninterrupted run, moved into place
    assert folder(out) == folder(whole) and not partial.exists()
    # run again, it is already prepared: nothing is redone or changed
    calls.clear()
    assert main(["data", "prepare", str(text_dir), "--out", str(out), *RESUMABLE]) == 0
    assert not calls and folder(out) == folder(whole)


def test_prepare_shows_progress_on_stderr(tmp_path, text_dir, capsys):
    from looplm.data.prepared import prepare
    prepare(text_dir, tmp_path / "prep", tiny_recipe(), progress=True)
    err = capsys.readouterr().err
    assert "split" in err and "train" in err and "val" in err and "doc" in err
