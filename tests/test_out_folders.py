"""Output folders (looplm/outdir.py): `train`, `import`, `export` and `data prepare` build OUT in OUT.partial
and move it into place only when whole (train: at its first checkpoint, from when on it resumes); a failed
command leaves neither; an existing --out that is not the command's own kind is refused and left byte for
byte as it was; a stale OUT.partial a kill left is taken over, a live one or a foreign one refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import looplm.runs.report
import looplm.train.trainer
from looplm.errors import UserError
from looplm.outdir import MARKER, Staging, _try_lock, staging_path
from looplm.train.trainer import train

from conftest import cli, tiny_recipe

QUICK = {"train.steps": 4, "train.checkpoint_every": 2, "train.eval_batches": 1}


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    monkeypatch.setattr(looplm.runs.report, "write_plots", lambda run_dir, report: [])   # seconds of matplotlib


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def unrelated(folder: Path) -> dict[str, bytes]:
    """A folder of someone's own files, and what it held."""
    folder.mkdir()
    (folder / "notes.txt").write_text("mine, keep")
    (folder / "sub").mkdir()
    (folder / "sub" / "data.bin").write_bytes(b"\x00\x01")
    return snapshot(folder)


def refused(capsys, *argv) -> str:
    code, _, err = cli(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip()


def nothing_at(out: Path) -> bool:
    return not out.exists() and not staging_path(out).exists()


def sets(**over):
    return [a for k, v in over.items() for a in ("--set", f"{k}={v}")]


# ----------------------------------------------------------------------------- train

def test_train_refuses_a_folder_of_other_files(tmp_path, text_dir, capsys):
    out = tmp_path / "busy"
    before = unrelated(out)
    err = refused(capsys, "train", "--out", out, *sets(**{"data.path": text_dir, **QUICK}))
    assert "not empty" in err and "notes.txt" in err
    assert snapshot(out) == before and not staging_path(out).exists()
    # --resume of a folder that is no run is refused too, and changes nothing
    assert "no checkpoint" in refused(capsys, "train", "--out", out, "--resume")
    assert snapshot(out) == before


def test_an_empty_out_folder_is_taken(tmp_path, text_dir):
    out = tmp_path / "empty"
    out.mkdir()
    train(tiny_recipe(**{"data.path": str(text_dir), **QUICK}), out, quiet=True)
    assert (out / "checkpoint" / "state.pt").is_file() and not staging_path(out).exists()


def test_a_failed_start_leaves_nothing(tmp_path, tiny_run, capsys):
    """Bad data, bad --init weights, bad --stage2 weights: refused, and no run folder nor OUT.partial."""
    out = tmp_path / "run"
    assert "no such file" in refused(capsys, "train", "--out", out, *sets(**{"data.path": tmp_path / "nothing"}))
    assert nothing_at(out)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_run, broken)
    path = broken / "checkpoint" / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    assert "model.safetensors" in refused(capsys, "train", "--init", broken, "--out", out, "--set", "train.steps=2")
    assert nothing_at(out)
    assert "model.safetensors" in refused(capsys, "train", "--stage2", broken, "--out", out, "--set", "train.steps=2")
    assert nothing_at(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def _interrupt_at(monkeypatch, at_step: int) -> None:
    real = looplm.train.trainer.train_step

    def step(model, recipe, x, y, step, *a, **k):
        if step == at_step:
            raise KeyboardInterrupt
        return real(model, recipe, x, y, step, *a, **k)
    monkeypatch.setattr(looplm.train.trainer, "train_step", step)


def test_a_run_interrupted_before_its_first_checkpoint_leaves_nothing(tmp_path, text_dir, monkeypatch):
    out = tmp_path / "run"
    _interrupt_at(monkeypatch, 1)                        # the first checkpoint would come after step 2
    with pytest.raises(KeyboardInterrupt):
        train(tiny_recipe(**{"data.path": str(text_dir), **QUICK}), out, quiet=True)
    assert nothing_at(out)


def test_a_run_interrupted_after_its_first_checkpoint_resumes(tmp_path, text_dir, monkeypatch):
    out = tmp_path / "run"
    recipe = tiny_recipe(**{"data.path": str(text_dir), **QUICK})
    _interrupt_at(monkeypatch, 3)                        # after the checkpoint at 2
    with pytest.raises(KeyboardInterrupt):
        train(recipe, out, quiet=True)
    assert (out / "checkpoint" / "state.pt").is_file() and not staging_path(out).exists()
    assert not (out / MARKER).exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2]           # logged before and after the move into place
    monkeypatch.undo()
    report = train(recipe, out, resume=True, quiet=True)
    assert report["steps"] == 4 and (out / "report.json").is_file()


def test_a_stale_partial_is_taken_over_and_a_live_or_foreign_one_refused(tmp_path, text_dir, capsys):
    out = tmp_path / "run"
    partial = staging_path(out)
    args = ["train", "--out", out, *sets(**{"data.path": text_dir, **QUICK})]
    # another looplm command is writing it (it holds the marker's lock)
    partial.mkdir()
    (partial / MARKER).touch()
    lock = _try_lock(partial / MARKER)
    assert "another looplm command is writing it" in refused(capsys, *args)
    assert partial.is_dir() and not out.exists()
    lock.close()
    # the same folder, its writer gone (a kill): taken over; what it held does not reach the run
    (partial / "stray.txt").write_text("left by a killed start")
    assert resume_hint(capsys, out, partial)
    assert cli(capsys, *args)[0] == 0
    assert not partial.exists() and not (out / "stray.txt").exists() and (out / "report.json").is_file()
    # a folder of that name that looplm did not make is never touched
    other = tmp_path / "other"
    foreign = staging_path(other)
    foreign.mkdir()
    (foreign / "mine.txt").write_text("mine")
    assert "was not made by looplm" in refused(capsys, "train", "--out", other, *sets(**{"data.path": text_dir}))
    assert snapshot(foreign) == {"mine.txt": b"mine"} and not other.exists()


def resume_hint(capsys, out: Path, partial: Path) -> bool:
    """--resume of a start that never reached its first checkpoint says so (and removes nothing)."""
    err = refused(capsys, "train", "--out", out, "--resume")
    return "no checkpoint" in err and str(partial) in err and partial.is_dir()


# ----------------------------------------------------------------------------- data prepare, import, export

def test_prepare_refuses_a_folder_of_other_files_and_a_failed_prepare_leaves_nothing(tmp_path, text_dir, capsys):
    out = tmp_path / "busy"
    before = unrelated(out)
    err = refused(capsys, "data", "prepare", text_dir, "--out", out, "--quiet")
    assert "not empty" in err and str(out) in err
    assert snapshot(out) == before and not staging_path(out).exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"text": \n')
    refused(capsys, "data", "prepare", bad, "--out", tmp_path / "prep", "--quiet")
    assert nothing_at(tmp_path / "prep")
    # its own kind: the finished folder of the same settings is returned as it is
    assert cli(capsys, "data", "prepare", text_dir, "--out", tmp_path / "prep", "--quiet")[0] == 0
    done = snapshot(tmp_path / "prep")
    assert cli(capsys, "data", "prepare", text_dir, "--out", tmp_path / "prep", "--quiet")[0] == 0
    assert snapshot(tmp_path / "prep") == done and not staging_path(tmp_path / "prep").exists()


def test_an_interrupted_prepare_keeps_its_work_to_continue(tmp_path, text_dir):
    from looplm.data import prepared
    out = tmp_path / "prep"
    calls = []

    def interrupt(split, shards):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):           # Ctrl-C after a shard: OUT.partial stays to continue
        prepared.prepare(text_dir, out, tiny_recipe(), shard_tokens=3000, progress=False, on_shard=interrupt)
    assert not out.exists() and (staging_path(out) / prepared.JOURNAL).is_file()
    prepared.prepare(text_dir, out, tiny_recipe(), shard_tokens=3000, progress=False,
                     on_shard=lambda split, shards: calls.append(shards))
    assert calls[0] == 2                                # continued after the shard recorded before Ctrl-C
    assert (out / prepared.MANIFEST).is_file() and not staging_path(out).exists()


def test_import_refuses_a_folder_of_other_files_and_an_earlier_run(tmp_path, tiny_run, capsys):
    """--out of an import must be absent or empty: nothing of anyone's is overwritten, an earlier import
    (a run) included. Refused before the HF folder is even read."""
    out = tmp_path / "busy"
    before = unrelated(out)
    hf = tmp_path / "hf"
    hf.mkdir()
    assert "not empty" in refused(capsys, "import", hf, "--out", out)
    assert snapshot(out) == before and not staging_path(out).exists()
    assert "already holds a run" in refused(capsys, "import", hf, "--out", tiny_run)


def test_export_leaves_nothing_when_it_fails_and_keeps_files_beside_an_earlier_export(tmp_path, tiny_run, capsys,
                                                                                     monkeypatch):
    from looplm.interop import hf_export
    out = tmp_path / "hf"

    def broken(*a, **k):
        raise UserError("tokenizer: refused for the test")
    monkeypatch.setattr(hf_export, "write_tokenizer", broken)
    refused(capsys, "export", tiny_run, "--hf", out)
    assert nothing_at(out)
    monkeypatch.undo()
    assert cli(capsys, "export", tiny_run, "--hf", out)[0] == 0
    first = snapshot(out)
    assert "config.json" in first and not staging_path(out).exists()
    # an earlier export is this command's own kind: exported again file by file, files beside it kept
    (out / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (out / "model.safetensors").write_bytes(b"stale")
    monkeypatch.setattr(hf_export, "write_tokenizer", broken)
    refused(capsys, "export", tiny_run, "--hf", out)               # a failed re-export changes nothing
    assert (out / "model.safetensors").read_bytes() == b"stale" and not staging_path(out).exists()
    monkeypatch.undo()
    assert cli(capsys, "export", tiny_run, "--hf", out)[0] == 0
    again = snapshot(out)
    assert again.pop(".gitattributes") == b"*.safetensors filter=lfs\n" and again == first


def test_staging_commit_replaces_only_an_empty_folder(tmp_path):
    """The move into place never lands on files that appeared at OUT meanwhile: refused, the staging kept
    apart and removed, OUT's files as they were."""
    out = tmp_path / "out"
    with pytest.raises(UserError, match="cannot move"):
        with Staging(out, "--out") as stage:
            (stage.dir / "a.txt").write_text("ours")
            out.mkdir()
            (out / "theirs.txt").write_text("theirs")
            stage.commit()
    assert snapshot(out) == {"theirs.txt": b"theirs"} and not staging_path(out).exists()


def test_out_may_be_the_working_folder(tmp_path, text_dir, capsys, monkeypatch):
    """`--out .` in an empty working folder: the output moves into that same folder (the shell's working
    folder stays valid), and nothing is left beside it."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert cli(capsys, "data", "prepare", text_dir, "--out", ".", "--quiet")[0] == 0
    assert Path.cwd().samefile(here) and (here / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "here"]
