"""`looplm experiment extrapolate` end to end (quick mode), its JSON shape and report, the
baselines' parameter matching, and the linear probes."""

from __future__ import annotations

import json

import pytest
import torch

import looplm
from looplm.cli import main
from looplm.errors import UserError
from looplm.experiments.extrapolate import QUICK_OVERRIDES, baseline_recipes, lstm_hidden_for, lstm_params
from looplm.model.lstm import LSTMLM
from looplm.evaluation.probes import chain_path, fit_probe, run_probes
from looplm.data.taskdata import TaskSource
from looplm.data.tasks import TASKS, solve
from looplm.data.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp") / "x"
    import contextlib
    import io
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["experiment", "extrapolate", "--quick", "--out", str(out), "--json"])
    return code, stdout.getvalue(), out


def test_quick_experiment_json_shape(quick_run):
    code, stdout, out = quick_run
    assert code == 0
    result = json.loads(stdout)  # exactly one JSON object on stdout
    assert stdout.strip().count("\n") == 0
    recipe = looplm.load_recipe("extrapolate", QUICK_OVERRIDES)
    dmax, rmax = recipe.data.difficulty_max, recipe.depth.max
    assert result["task"] == "chain" and result["train_difficulty_max"] == dmax
    models = result["models"]
    assert {"looped", "untied_same_params", "untied_same_compute"} <= set(models)
    difficulties = [str(d) for d in range(1, 2 * dmax + 1)]
    for name, table in models.items():
        assert list(table) == difficulties
        for row in table.values():
            assert all(0.0 <= acc <= 1.0 for acc in row.values())
    assert list(models["looped"]["1"]) == [str(r) for r in range(1, 2 * rmax + 1)]
    assert list(models["untied_same_params"]["1"]) == ["1"]
    assert list(models["untied_same_compute"]["1"]) == [str(rmax)]
    assert list(models["lstm"]["1"]) == ["1"]  # no rounds: one column
    # prompt length reported apart from difficulty, and the same at every difficulty
    lengths = result["prompt_length"]["tokens_by_difficulty"]
    assert list(lengths) == difficulties and len(set(lengths.values())) == 1
    assert result["prompt_length"]["items"] >= 2 * dmax


def test_quick_experiment_writes_report_and_runs(quick_run):
    _, stdout, out = quick_run
    result = json.loads(stdout)
    assert json.loads((out / "report.json").read_text())["models"] == result["models"]
    md = (out / "report.md").read_text()
    for name in result["models"]:
        assert (out / f"heatmap_{name}.png").stat().st_size > 0
        assert f"heatmap_{name}.png" in md
    assert "Probes" in md
    for name in ("looped", "untied_same_params", "untied_same_compute"):
        assert (out / name / "report.json").is_file()
    info = result["model_info"]
    assert info["untied_same_params"]["params_stored"] == info["looped"]["params_stored"]
    assert info["untied_same_compute"]["params_stored"] > info["looped"]["params_stored"]
    # probes: an accuracy per probed difficulty and round
    probes = result["probes"]
    assert set(probes) >= {"answer", "hop", "chance"}
    for table in (probes["answer"], probes["hop"]):
        for row in table.values():
            assert len(row) == result["eval_rounds_max"] and all(0 <= a <= 1 for a in row.values())


def test_existing_out_and_missing_task_exit_2(quick_run, tmp_path, capsys):
    _, _, out = quick_run
    assert main(["experiment", "extrapolate", "--quick", "--out", str(out)]) == 2
    assert "already holds" in capsys.readouterr().err
    assert main(["experiment", "extrapolate", "--quick", "--out", str(tmp_path / "y"), "--set", "data.task="]) == 2
    assert "data.task" in capsys.readouterr().err


def test_baselines_match_params_and_compute():
    recipe = looplm.load_recipe("extrapolate")
    base = baseline_recipes(recipe)
    looped = looplm.build_model(recipe)
    same_params = looplm.build_model(base["untied_same_params"])
    same_compute = looplm.build_model(base["untied_same_compute"])
    assert same_params.params_stored() == looped.params_stored()
    # the untied stack applies as many block visits per token as the looped model at depth.max
    assert same_compute.params_per_token_visit(recipe.depth.max) == looped.params_per_token_visit(recipe.depth.max)
    target = looped.params_stored()
    h = lstm_hidden_for(target, 257, recipe.model.d_model)
    lstm = LSTMLM(257, recipe.model.d_model, h)
    assert sum(p.numel() for p in lstm.parameters()) == lstm_params(257, recipe.model.d_model, h)
    assert abs(lstm_params(257, recipe.model.d_model, h) - target) / target < 0.05


def test_chain_path_agrees_with_the_solver():
    for d in range(1, 9):
        for ex in TASKS["chain"](seed=3, difficulty=d, n=20, length=16):
            path = chain_path(ex.prompt)
            assert len(path) == d + 1 and path[-1] == solve("chain", ex.prompt) == ex.answer


def test_fit_probe_separates_a_linear_signal():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 8, generator=g)
    labels = ["a" if v > 0 else "b" for v in (x[:, 2] - x[:, 5]).tolist()]
    assert fit_probe(x[:100], labels[:100], x[100:], labels[100:]) > 0.9


def test_run_probes_on_a_small_model():
    recipe = looplm.load_recipe("extrapolate", {**QUICK_OVERRIDES, "train.threads": 1})
    model = looplm.build_model(recipe)
    result = run_probes(model, ByteTokenizer(), TaskSource(recipe), 24, [1, 2], rounds=3)
    assert set(result) == {"answer", "hop", "chance"}
    assert set(result["answer"]) == {1, 2} and set(result["answer"][1]) == {1, 2, 3}
    assert all(0 <= a <= 1 for row in result["hop"].values() for a in row.values())


def test_probe_needs_enough_examples():
    recipe = looplm.load_recipe("extrapolate", QUICK_OVERRIDES)
    with pytest.raises(UserError):
        run_probes(looplm.build_model(recipe), ByteTokenizer(), TaskSource(recipe), 2, [1], rounds=2)


def test_parallel_workers_give_the_same_shape(tmp_path):
    from looplm.experiments.extrapolate import run_extrapolate
    recipe = looplm.load_recipe("extrapolate", {**QUICK_OVERRIDES, "train.threads": 2, "data.probe_examples": 0,
                                                "data.baselines": ["untied_same_params", "lstm"]})
    result = run_extrapolate(recipe, tmp_path / "p", quiet=True)
    assert set(result["models"]) == {"looped", "untied_same_params", "lstm"}
    assert result["probes"] == {}
    assert all(i["process_wall_time_s"] > 0 for i in result["model_info"].values())
    assert (tmp_path / "p" / "lstm" / "model.safetensors").is_file()
