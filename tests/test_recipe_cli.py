"""Recipe validation through the real command line: exit code 2, the field named, no traceback."""

import json
import shutil
import subprocess
import sys
import tomllib

import pytest
import torch

import looplm
from looplm.runs.checkpoint import CHECKPOINT_VERSION, load_run
from looplm.cli import main
from looplm.recipe.config import dump_toml, field_docs, recipe_from_dict
from looplm.errors import UserError

from conftest import tiny_recipe


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
        for name, default, doc, _ in rows:
            assert doc.split(". ", 1)[1].strip(), f"{section}.{name} has no docstring"


def test_readme_documents_every_recipe_field():
    # the recipe reference moved from README.md to docs/recipe.md (the README links to it)
    from pathlib import Path
    root = Path(__file__).parent.parent
    reference = (root / "docs" / "recipe.md").read_text()
    for section, rows in field_docs().items():
        for name, _, _, _ in rows:
            assert f"`{section}.{name}`" in reference, f"docs/recipe.md lacks {section}.{name}"
    assert "docs/recipe.md" in (root / "README.md").read_text()


def test_recipe_reference_is_generated():
    # docs/recipe.md's tables are exactly what scripts/readme_fields.py writes from the docstrings
    # now: a docstring changed without rerunning the script (or a table edited by hand) fails here
    import importlib.util
    from pathlib import Path
    root = Path(__file__).parent.parent
    spec = importlib.util.spec_from_file_location("readme_fields", root / "scripts" / "readme_fields.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = (root / "docs" / "recipe.md").read_text()
    assert text.count(script.START) == 1 and text.count(script.END) == 1, "docs/recipe.md lacks its markers"
    between = text.split(script.START, 1)[1].split(script.END, 1)[0]
    assert between == "\n" + script.tables(), "docs/recipe.md is stale: run python scripts/readme_fields.py"


# --- issue 14: refused combinations, checkpoint version, defaults filled into older runs ---
REFUSED = [
    # DeepLoop's blocks have no inner norms, so the model used to drop sandwich without a word
    (["--set", "model.norm=sandwich", "--set", "model.residual_scaling=deeploop"], "model.residual_scaling"),
    # quickstart samples up to depth.max = 8 rounds; an exit floor above that can never be met
    (["--set", "exit.min_rounds=9"], "exit.min_rounds"),
    (["--set", "depth.kind=fixed", "--set", "depth.rounds=3", "--set", "exit.min_rounds=4"], "exit.min_rounds"),
]


@pytest.mark.parametrize("args,field", REFUSED)
def test_refused_combinations_exit_2_naming_field(args, field, capsys):
    assert main(["recipe", "show", "quickstart", *args]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args,field", REFUSED[:2])
def test_train_refuses_combinations_before_work_starts(args, field, tmp_path):
    code, _, err = run_cli("train", "--out", str(tmp_path / "run"), *args)
    assert code == 2 and field in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_refusal_boundaries():
    # the largest forward depth is depth.rounds for fixed depth and depth.max otherwise
    assert tiny_recipe(**{"exit.min_rounds": 3}).exit.min_rounds == 3           # TINY: fixed, 3 rounds
    with pytest.raises(UserError, match="exit.min_rounds"):
        tiny_recipe(**{"exit.min_rounds": 4})
    sampled = {"depth.kind": "uniform", "depth.min": 1, "depth.max": 5, "depth.rounds": 2}
    assert tiny_recipe(**sampled, **{"exit.min_rounds": 5}).exit.min_rounds == 5
    with pytest.raises(UserError, match="exit.min_rounds"):
        tiny_recipe(**sampled, **{"exit.min_rounds": 6})
    # each setting alone stays allowed; only the pair is refused
    assert tiny_recipe(**{"model.norm": "sandwich"}).model.norm == "sandwich"
    assert tiny_recipe(**{"model.residual_scaling": "deeploop"}).model.residual_scaling == "deeploop"
    with pytest.raises(UserError, match="model.norm.*model.residual_scaling"):
        tiny_recipe(**{"model.residual_scaling": "deeploop", "model.norm": "sandwich"})
    # a recipe file's sandwich norm that an override makes inapplicable goes back to its default
    assert looplm.load_recipe("huginn-style", {"model.residual_scaling": "deeploop"}).model.norm == "pre"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """One tiny finished run; tests copy it before changing it."""
    root = tmp_path_factory.mktemp("trained")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.py").write_text("\n".join(f"def f{i}_{j}(x):\n    return x + {j}" for j in range(80)))
    from looplm.train.trainer import train
    train(tiny_recipe(**{"data.path": str(corpus), "train.steps": 2}), root / "run", quiet=True)
    return root / "run"


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _set_version(run, version):
    path = run / "checkpoint" / "state.pt"
    state = torch.load(path, weights_only=True)
    if version is None:
        del state["version"]
    else:
        state["version"] = version
    torch.save(state, path)


def test_checkpoint_version_is_read_and_a_newer_one_refused(trained_run, tmp_path, capsys):
    run = _copy(trained_run, tmp_path)
    assert torch.load(run / "checkpoint/state.pt", weights_only=True)["version"] == CHECKPOINT_VERSION
    assert load_run(run).version == CHECKPOINT_VERSION
    _set_version(run, CHECKPOINT_VERSION + 1)
    with pytest.raises(UserError, match=f"checkpoint version {CHECKPOINT_VERSION + 1} is newer"):
        load_run(run)
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert "version" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    from looplm.train.trainer import train  # resuming reads the same state file
    with pytest.raises(UserError, match="newer"):
        train(looplm.load_recipe(str(run / "recipe.toml")), run, resume=True, quiet=True)
    _set_version(run, None)
    with pytest.raises(UserError, match="no valid version"):
        load_run(run)


def test_old_run_loads_with_defaults_filled_and_logged(trained_run, tmp_path, caplog):
    run = _copy(trained_run, tmp_path)
    full = tomllib.loads((run / "recipe.toml").read_text())
    assert load_run(run).filled_defaults == {}  # a current run lacks nothing
    old = {k: (dict(v) if isinstance(v, dict) else v) for k, v in full.items()}
    del old["model"]["state_norm"]  # as if written before these fields existed
    del old["exit"]
    (run / "recipe.toml").write_text(dump_toml(old))
    caplog.clear()
    with caplog.at_level("WARNING", logger="looplm.runs.checkpoint"):
        loaded = load_run(run)
    expected = {"model.state_norm": False, "exit.gate": False, "exit.policy": "fixed",
                "exit.min_rounds": 1, "exit.exit_in_prefill": False}
    assert loaded.filled_defaults == expected
    assert loaded.recipe.to_dict() == full
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(expected)
    for line, key in zip(lines, expected):
        assert key in line and "default" in line
    # with no logging set up (a script, the CLI) each filled field is one line on stderr
    proc = subprocess.run([sys.executable, "-c", "import sys, looplm; looplm.load_run(sys.argv[1])", str(run)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == len(expected) and all(key in line for line, key in zip(err, expected))
    assert "model.state_norm = false" in err[0]


def test_field_docs_are_one_line_each():
    # a docstring wrapped over lines used to break its README table row in two
    for section, rows in field_docs().items():
        for name, _, doc, _ in rows:
            assert "\n" not in doc and "  " not in doc, f"{section}.{name}"


def test_old_run_with_an_inapplicable_field_loads_it_at_its_default(trained_run, tmp_path, caplog, capsys):
    # an older looplm wrote every field out, also ones nothing read (depth.mean on a fixed-depth run)
    run = _copy(trained_run, tmp_path)
    data = tomllib.loads((run / "recipe.toml").read_text())
    data["depth"]["mean"] = 3.0
    (run / "recipe.toml").write_text(dump_toml(data))
    loaded = load_run(run)
    assert loaded.recipe.depth.mean == 4.0 and "depth.mean" in caplog.text and "does not apply" in caplog.text
    # a gate no loss reached is refused, not loaded as if trained
    data["exit"]["gate"] = True
    (run / "recipe.toml").write_text(dump_toml(data))
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert "exit.gate" in err and "never received gradient" in err and len(err.strip().splitlines()) == 1
