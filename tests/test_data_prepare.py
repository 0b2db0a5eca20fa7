"""`looplm data prepare`: tokenize once, train from the prepared folder with the same tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

import looplm.runs.report
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


def test_prepared_folder_trains_like_the_text(tmp_path, text_dir, monkeypatch):
    monkeypatch.setattr(looplm.runs.report, "write_plots", lambda run_dir, report: [])   # seconds of matplotlib
    prep = tmp_path / "prep"
    assert main(["data", "prepare", str(text_dir), "--out", str(prep)]) == 0
    manifest = json.loads((prep / "manifest.json").read_text())
    assert manifest["documents"] == {"train": 5, "val": 1} and manifest["tokenizer"] == {"kind": "byte", "vocab_size": 257}
    assert manifest["tokens"]["train"] == len(data_mod.open_tokens(prep / "train.bin"))
    over = {"train.steps": 2, "train.checkpoint_every": 2}
    train(tiny_recipe(**over, **{"data.path": str(text_dir)}), tmp_path / "from_text", quiet=True)

    def no_text(*a, **k):  # a prepared folder is never read or tokenized again
        raise AssertionError("read_documents called on a prepared folder")
    monkeypatch.setattr(data_mod, "read_documents", no_text)
    train(tiny_recipe(**over, **{"data.path": str(prep)}), tmp_path / "from_prep", quiet=True)
    for split in ("train.bin", "val.bin"):
        prepared = (prep / split).read_bytes()
        assert (tmp_path / "from_prep" / "data" / split).read_bytes() == prepared
        assert (tmp_path / "from_text" / "data" / split).read_bytes() == prepared
    assert (tmp_path / "from_prep" / "checkpoint" / "tokenizer_config.json").is_file()
    assert losses(tmp_path / "from_prep") == losses(tmp_path / "from_text")
    # eval --data DIR scores DIR's held-out split: for the run trained on the text, its own val split
    import contextlib
    import io
    out = {}
    for key, extra in (("own", []), ("prep", ["--data", str(prep)])):
        with contextlib.redirect_stdout(io.StringIO()) as buf:
            assert main(["eval", str(tmp_path / "from_text"), "--rounds", "1,3", "--json", *extra]) == 0
        out[key] = json.loads(buf.getvalue())["rounds"]
    assert out["prep"] == out["own"]


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
