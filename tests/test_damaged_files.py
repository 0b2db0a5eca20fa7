"""Every file looplm reads, damaged: exit 2 and one stderr line naming the file, never a traceback, and a
command that writes a folder leaves none behind (nor its OUT.partial).

A tiny Hugging Face Llama folder (as tests/test_import.py builds them) is damaged one way per case for
`looplm import`; a copy of the tiny trained run (conftest.tiny_run) one way per case for every command
that loads a run; then mixers, recipes and data files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import cli

transformers = pytest.importorskip("transformers")


def refused(capsys, *argv) -> str:
    """The one stderr line of `looplm ARGV`, which must exit 2."""
    code, _, err = cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("looplm: error: "), err
    return lines[0]


def leaves_nothing(out: Path) -> None:
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


# ----------------------------------------------------------------------------- import

@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny random Llama saved by transformers, with its tokenizer (test_import's shapes)."""
    from test_import import _configs, _tokenizer
    cls, cfg = _configs()["llama"]
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf") / "llama"
    cls(cfg).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return folder


def _drop_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})


def _del(key):
    return lambda cfg: cfg.pop(key)


def _set(key, value):
    return lambda cfg: cfg.update({key: value})


HF_DAMAGE = {
    "weights cut in half": (lambda d: truncate(d / "model.safetensors"), ["model.safetensors", "cut short"]),
    "config not JSON": (lambda d: (d / "config.json").write_text('{"model_type": "llama",\n'),
                        ["config.json", "not valid JSON"]),
    "config a list": (lambda d: (d / "config.json").write_text("[1, 2]"), ["config.json", "JSON list"]),
    "config lacks a size": (lambda d: edit_json(d / "config.json", _del("intermediate_size")),
                            ["config.json", "incomplete, no intermediate_size"]),
    "config size not a number": (lambda d: edit_json(d / "config.json", _set("hidden_size", "64")),
                                 ["config.json", "hidden_size"]),
    "rope scaling lacks its factor": (lambda d: edit_json(d / "config.json", lambda c: c["rope_parameters"].pop("factor")),
                                      ["config.json", "factor"]),
    "eos id not an id": (lambda d: edit_json(d / "config.json", _set("eos_token_id", "</s>")),
                         ["config.json", "eos_token_id"]),
    "a tensor missing": (_drop_tensor, ["model.layers.1.mlp.up_proj.weight"]),
    "intermediate_size disagrees with the weights": (lambda d: edit_json(d / "config.json", _set("intermediate_size", 100)),
                                                     ["model.safetensors", "shape", "intermediate_size"]),
    "vocab_size disagrees with the weights": (lambda d: edit_json(d / "config.json", _set("vocab_size", 400)),
                                              ["model.safetensors", "embed_tokens"]),
    "tokenizer.json junk": (lambda d: (d / "tokenizer.json").write_text("junk"), ["tokenizer.json", "not a readable"]),
    "tokenizer.json of a larger vocabulary": (lambda d: edit_json(d / "config.json", _set("vocab_size", 200)),
                                              ["tokenizer.json", "vocab_size 200"]),
    "generation_config.json junk": (lambda d: (d / "generation_config.json").write_text("{"),
                                    ["generation_config.json"]),
}


@pytest.mark.parametrize("case", list(HF_DAMAGE))
def test_a_damaged_hf_checkpoint_is_refused_naming_the_file(hf_llama, tmp_path, capsys, case):
    damage, words = HF_DAMAGE[case]
    src = tmp_path / "hf"
    shutil.copytree(hf_llama, src)
    if case == "eos id not an id":
        (src / "generation_config.json").unlink()
    damage(src)
    out = tmp_path / "run"
    err = refused(capsys, "import", src, "--out", out)
    for w in words:
        assert w in err, err
    assert str(src) in err
    leaves_nothing(out)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]          # no debris beside it either


def test_the_undamaged_hf_checkpoint_imports(hf_llama, tmp_path, capsys):
    """The cases above fail for their damage alone: the same folder undamaged imports and loads."""
    import looplm
    out = tmp_path / "run"
    assert cli(capsys, "import", hf_llama, "--out", out)[0] == 0
    assert looplm.load_run(out).recipe.model.ffn_hidden == 96
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "import.json", "recipe.toml"]
    assert not (tmp_path / "run.partial").exists()


# ----------------------------------------------------------------------------- a run, loaded

def _other_weights(run: Path) -> None:
    from safetensors.torch import save_file
    save_file({"embed.weight": torch.zeros(3, 3)}, str(run / "checkpoint" / "model.safetensors"))


def _bpe_without_its_file(run: Path) -> None:
    (run / "checkpoint" / "tokenizer_config.json").write_text('{"kind": "bpe"}')


RUN_DAMAGE = {
    "weights cut in half": (lambda r: truncate(r / "checkpoint" / "model.safetensors"), "model.safetensors: not a readable"),
    "another model's weights": (_other_weights, "model.safetensors"),
    "state.pt junk": (lambda r: (r / "checkpoint" / "state.pt").write_bytes(b"junk"), "state.pt"),
    "recipe.toml syntax error": (lambda r: (r / "recipe.toml").write_text("[model\nd_model = 3\n"), "recipe.toml"),
    "recipe.toml wrong type": (lambda r: (r / "recipe.toml").write_text(
        (r / "recipe.toml").read_text().replace("d_model = 32", 'd_model = "wide"')), "recipe.toml"),
    "report.json junk": (lambda r: (r / "report.json").write_text("{junk"), "report.json"),
    "report.json not an object": (lambda r: (r / "report.json").write_text("[1, 2]"), "report.json"),
    "tokenizer config missing": (lambda r: (r / "checkpoint" / "tokenizer_config.json").unlink(), "tokenizer_config.json"),
    "tokenizer config junk": (lambda r: (r / "checkpoint" / "tokenizer_config.json").write_bytes(b"\xff\xfe"),
                              "tokenizer_config.json"),
    "tokenizer.json missing": (_bpe_without_its_file, "tokenizer.json"),
}
COMMANDS = {"eval": [], "generate": ["--prompt", "def f"], "check": [], "lens": [], "export": ["--hf", "{tmp}/hf"]}


@pytest.mark.parametrize("case", list(RUN_DAMAGE))
def test_a_damaged_run_is_refused_by_every_command_naming_the_file(tiny_run, tmp_path, capsys, case):
    damage, name = RUN_DAMAGE[case]
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    damage(run)
    for command, extra in COMMANDS.items():
        err = refused(capsys, command, run, *[a.format(tmp=tmp_path) for a in extra])
        assert name in err and str(run) in err, (command, err)
    leaves_nothing(tmp_path / "hf")


def test_check_names_a_damaged_metrics_line(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    err = refused(capsys, "check", run)
    assert "metrics.jsonl, line" in err


def test_a_torn_last_metrics_row_is_left_out(tiny_run, tmp_path):
    """A kill while the trainer wrote a row leaves it without its newline: readers skip it (a resume logs that
    step again), rather than refusing the run."""
    from looplm.runs.checkpoint import read_metrics
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    rows = read_metrics(run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "lo')
    assert read_metrics(run) == rows and rows


# ----------------------------------------------------------------------------- mixers, recipes, data

def _mixer(path: Path, tensors: dict, kind: str = "constant_scalar", width: int = 32) -> Path:
    from safetensors.torch import save_file
    save_file(tensors, str(path), metadata={"kind": kind, "d_model": str(width), "record": "{}"})
    return path


@pytest.mark.parametrize("case, words", [
    ("junk", "cut short"), ("other tensors", "its tensors do not make"), ("other width", "not a mixer for this model"),
    ("missing", "missing"),
])
def test_a_damaged_mixer_is_refused_naming_the_file(tiny_run, tmp_path, capsys, case, words):
    path = tmp_path / "mixer.safetensors"
    if case == "junk":
        path.write_bytes(b"not a safetensors file at all")
    elif case == "other tensors":
        _mixer(path, {"net.0.weight": torch.zeros(4)})
    elif case == "other width":
        _mixer(path, {"logits": torch.zeros(2)}, width=64)
    err = refused(capsys, "generate", tiny_run, "--prompt", "def f", "--recirculate", "3:2",
                  "--recirculate-mixer", path)
    assert str(path) in err and words in err, err


def test_a_good_mixer_loads(tiny_run, tmp_path, capsys):
    """What the mixer cases refuse is the damage: a mixer as save_mixer writes it generates."""
    from looplm.model.mixer import AdaptiveMixer, save_mixer
    path = tmp_path / "mixer.safetensors"
    save_mixer(AdaptiveMixer(32, "constant_scalar"), path)
    code, out, err = cli(capsys, "generate", tiny_run, "--prompt", "def f", "--recirculate", "3:2",
                         "--recirculate-mixer", path, "--max-new-tokens", "2")
    assert code == 0, err


@pytest.mark.parametrize("text", ["[model\nd_model = 64\n", "name = 'x'\nname = 'y'\n", "\udcff"])
def test_a_recipe_file_with_a_syntax_error_is_refused_naming_it(tmp_path, capsys, text):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(text.encode("utf-8", "surrogateescape"))
    out = tmp_path / "run"
    assert str(bad) in refused(capsys, "train", "--recipe", bad, "--out", out)
    assert str(bad) in refused(capsys, "recipe", "show", bad)
    leaves_nothing(out)


def test_a_binary_data_file_is_refused_naming_it(tiny_run, tmp_path, capsys):
    blob = tmp_path / "blob.txt"
    blob.write_bytes(bytes(range(256)) * 40)
    assert str(blob) in refused(capsys, "eval", tiny_run, "--data", blob)
    out = tmp_path / "run"
    assert str(blob) in refused(capsys, "train", "--out", out, "--set", f"data.path={blob}")
    leaves_nothing(out)
    assert str(blob) in refused(capsys, "data", "prepare", blob, "--out", tmp_path / "prep")
    leaves_nothing(tmp_path / "prep")


@pytest.mark.parametrize("lines, words", [
    (['{"prompt": "a", "answer": "b"}', '{"prompt": "c", "answer"'], "line 2"),
    (['{"prompt": "a", "answer": "b"}', '{"prompt": "c"}'], "'answer'"),
])
def test_a_damaged_task_file_is_refused_and_leaves_no_run(tmp_path, capsys, lines, words):
    task = tmp_path / "task.jsonl"
    task.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    err = refused(capsys, "train", "--out", out, "--set", f"data.task={task}", "--set", "train.steps=1")
    assert str(task) in err and words in err, err
    leaves_nothing(out)


def _cut(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(100)


PREPARED_DAMAGE = {
    "manifest.json": lambda p: p.write_text('{"format": "looplm-prepared-data", "tokenizer": '),
    "train.json": lambda p: p.write_text("{junk"),
    "train-00000.bin": _cut,
    "val.bin": lambda p: p.unlink(),
}


@pytest.fixture(scope="module")
def prepared_folder(tmp_path_factory):
    from conftest import write_corpus
    from looplm.cli import main
    root = tmp_path_factory.mktemp("prepared")
    assert main(["data", "prepare", str(write_corpus(root / "corpus")), "--out", str(root / "prep"), "--quiet"]) == 0
    return root / "prep"


@pytest.mark.parametrize("name", list(PREPARED_DAMAGE))
def test_a_damaged_prepared_folder_is_refused_naming_the_file(prepared_folder, tmp_path, capsys, name):
    prep = tmp_path / "prep"
    shutil.copytree(prepared_folder, prep)
    PREPARED_DAMAGE[name](prep / name)
    out = tmp_path / "run"
    assert str(prep / name) in refused(capsys, "train", "--out", out, "--set", f"data.path={prep}")
    leaves_nothing(out)


def test_eval_data_of_a_prepared_folder_with_a_junk_manifest_is_refused(prepared_folder, tiny_run, tmp_path, capsys):
    prep = tmp_path / "prep"
    shutil.copytree(prepared_folder, prep)
    PREPARED_DAMAGE["manifest.json"](prep / "manifest.json")
    assert str(prep / "manifest.json") in refused(capsys, "eval", tiny_run, "--data", prep)


@pytest.mark.parametrize("name", ["checkpoint/tokenizer_config.json", "data/train.bin", "data/val.json"])
def test_train_init_names_the_damaged_file_of_the_run_it_starts_from(tiny_run, tmp_path, capsys, name):
    """--init copies the run's tokenizer and token split into the new run: each is checked where it lies, so
    the refusal names the run's file (not the copy in RUN.partial), and the new run never appears."""
    src = tmp_path / "src"
    shutil.copytree(tiny_run, src)
    path = src / name
    path.write_bytes(b"{" if path.suffix == ".json" else path.read_bytes()[:10])
    out = tmp_path / "run"
    assert str(path) in refused(capsys, "train", "--init", src, "--out", out, "--set", "train.steps=1")
    leaves_nothing(out)
