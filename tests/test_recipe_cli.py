"""Recipe validation through the real command line: exit code 2, the field named, no traceback."""

import json
import subprocess
import sys

import pytest

import looplm
from looplm.cli import main
from looplm.config import field_docs, recipe_from_dict


def run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "looplm", *args], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


BAD = [
    (["--set", "depth.rounds=0"], "depth.rounds"),
    (["--set", "depth.kind=fixed", "--set", "depth.rounds=4", "--set", "backward.window=6"], "backward.window"),
    (["--set", "depth.kind=fixed", "--set", "depth.rounds=4", "--set", "supervision.kind=rounds",
      "--set", "supervision.rounds=[2,6]"], "supervision.rounds"),
    (["--set", "supervision.kind=rounds", "--set", "supervision.rounds=[2,4]",
      "--set", "supervision.weights=[1.0]"], "supervision.weights"),
    (["--set", "depth.sigma=-0.5"], "depth.sigma"),
    (["--set", "model.d_modle=64"], "model.d_modle"),
    (["--set", "modle.d_model=64"], "modle.d_model"),
    (["--set", "model.d_model=big"], "model.d_model"),
    (["--set", "model.d_model=64.5"], "model.d_model"),
    (["--set", "model.init_state=ones"], "model.init_state"),
    (["--set", "model.n_kv_heads=3"], "model.n_kv_heads"),
    (["--set", "train.steps=0"], "train.steps"),
    (["--set", "model.tie_embeddings=1"], "model.tie_embeddings"),
    (["--set", "supervision.kind=learned_exit"], "exit.gate"),
    (["--recipe", "no-such-recipe"], "no-such-recipe"),
]


@pytest.mark.parametrize("args,field", BAD)
def test_invalid_recipe_values_exit_2_naming_field(args, field, capsys):
    code = main(["recipe", "show", "quickstart", *[a for a in args if a != "--recipe" and a != "no-such-recipe"]]
                if args[0] != "--recipe" else ["recipe", "show", args[1]])
    err = capsys.readouterr().err
    assert code == 2
    assert field in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args,field", BAD[:3] + BAD[5:6])
def test_train_refuses_before_work_starts(args, field, tmp_path):
    code, out, err = run_cli("train", "--out", str(tmp_path / "run"), *args)
    assert code == 2 and field in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_bad_toml_file_and_missing_run(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nd_model = 3")
    code, _, err = run_cli("recipe", "show", str(bad))
    assert code == 2 and "bad.toml" in err and "Traceback" not in err
    code, _, err = run_cli("eval", str(tmp_path / "nope"))
    assert code == 2 and "nope" in err and "Traceback" not in err


def test_recipe_show_resolves_defaults_and_round_trips(tmp_path, capsys):
    assert main(["recipe", "show", "quickstart", "--set", "model.d_model=64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["d_model"] == 64 and data["model"]["head_dim"] == 16  # default written out
    assert recipe_from_dict(data).to_dict() == data
    path = tmp_path / "r.toml"
    path.write_text(looplm.load_recipe("quickstart").to_toml())
    assert looplm.load_recipe(str(path)) == looplm.load_recipe("quickstart")


def test_builtins_load_and_every_field_documented(capsys):
    assert main(["recipes"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert "quickstart" in names and "huginn-style" in names
    for name in names:
        looplm.load_recipe(name)
    for section, rows in field_docs().items():
        for name, default, doc in rows:
            assert doc.split(". ", 1)[1].strip(), f"{section}.{name} has no docstring"


def test_readme_documents_every_recipe_field():
    from pathlib import Path
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for section, rows in field_docs().items():
        for name, _, _ in rows:
            assert f"`{section}.{name}`" in readme, f"README lacks {section}.{name}"
