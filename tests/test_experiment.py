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
from looplm.data.taskdata import PROBE_SEED, TaskSource, encode_examples
from looplm.data.tasks import TASKS, solve
from looplm.data.tokenizer import ByteTokenizer

from conftest import answer_scores


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp") / "x"
    import contextlib
    import io
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        # one seed, the recipe's own (what `rescored` reloads): the single-seed layout and keys
        seed = str(looplm.load_recipe("extrapolate").train.seed)
        code = main(["experiment", "extrapolate", "--quick", "--seeds", seed, "--out", str(out), "--json"])
    return code, stdout.getvalue(), out


@pytest.fixture(scope="module")
def rescored(quick_run):
    """Some cells of every model's table, recomputed from the saved weights: model -> difficulty ->
    rounds -> (accuracy, answer loss). The looped model at rounds 1, 2, 4 (its training maximum) and
    8 (the evaluation maximum); the untied stacks and the LSTM at their one depth."""
    from safetensors.torch import load_model
    _, stdout, out = quick_run
    info = json.loads(stdout)["model_info"]
    recipe = looplm.load_recipe("extrapolate", QUICK_OVERRIDES)
    tok, sep = ByteTokenizer(), recipe.data.separator
    sets = TaskSource(recipe).eval_sets(recipe.data.eval_examples)
    lstm = LSTMLM(257, recipe.model.d_model, info["lstm"]["hidden"])
    load_model(lstm, str(out / "lstm" / "model.safetensors"))
    models = {"looped": (looplm.load_run(out / "looped").model, (1, 2, 4, 8)),
              "untied_same_params": (looplm.load_run(out / "untied_same_params").model, (1,)),
              "untied_same_compute": (looplm.load_run(out / "untied_same_compute").model, (4,)),
              "lstm": (lstm.eval(), (1,))}
    return {name: {d: {r: answer_scores(m, tok, exs, r, sep) for r in rounds} for d, exs in sets.items()}
            for name, (m, rounds) in models.items()}


def same_as_rescored(result, rescored):
    for name, table in rescored.items():
        for d, row in table.items():
            for r, (acc, loss) in row.items():
                assert result["models"][name][str(d)][str(r)] == acc, (name, d, r)
                assert result["answer_loss"][name][str(d)][str(r)] == pytest.approx(loss, rel=1e-5), (name, d, r)


def test_quick_experiment_json_shape(quick_run, rescored):
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
    same_as_rescored(result, rescored)
    assert list(models["looped"]["1"]) == [str(r) for r in range(1, 2 * rmax + 1)]
    assert list(models["untied_same_params"]["1"]) == ["1"]
    assert list(models["untied_same_compute"]["1"]) == [str(rmax)]
    assert list(models["lstm"]["1"]) == ["1"]  # no rounds: one column
    # prompt length reported apart from difficulty, and the same at every difficulty
    lengths = result["prompt_length"]["tokens_by_difficulty"]
    assert list(lengths) == difficulties and len(set(lengths.values())) == 1
    assert result["prompt_length"]["items"] >= 2 * dmax


def test_quick_experiment_writes_report_and_runs(quick_run, rescored):
    _, stdout, out = quick_run
    result = json.loads(stdout)
    same_as_rescored(json.loads((out / "report.json").read_text()), rescored)
    md = (out / "report.md").read_text()
    for name in result["models"]:
        assert (out / f"heatmap_{name}.png").stat().st_size > 0
        assert f"heatmap_{name}.png" in md
    assert "Probes" in md
    for name in ("looped", "untied_same_params", "untied_same_compute"):
        assert (out / name / "report.json").is_file()
    info = result["model_info"]
    stored = {name: sum(p.numel() for p in looplm.load_run(out / name).model.parameters())
              for name in ("looped", "untied_same_params", "untied_same_compute")}
    assert {name: info[name]["params_stored"] for name in stored} == stored
    assert stored["untied_same_params"] == stored["looped"] < stored["untied_same_compute"]
    # probes: an accuracy per probed difficulty and round; chance is the majority first answer
    # character among the tested half of the probe examples, by hand
    probes = result["probes"]
    assert set(probes) >= {"answer", "hop", "chance"}
    for table in (probes["answer"], probes["hop"]):
        assert list(table) == ["2", "4"] and all(len(row) == result["eval_rounds_max"] for row in table.values())
    recipe = looplm.load_recipe("extrapolate", QUICK_OVERRIDES)
    sets = TaskSource(recipe).eval_sets(32, seed=PROBE_SEED, levels=[2, 4])
    for d, exs in sets.items():
        tested = [ex.answer[0] for ex in exs[16:]]
        assert probes["chance"][str(d)] == max(tested.count(c) for c in tested) / 16


def test_existing_out_and_missing_task_exit_2(quick_run, tmp_path, capsys):
    _, _, out = quick_run
    assert main(["experiment", "extrapolate", "--quick", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err          # refused before any training
    assert main(["experiment", "extrapolate", "--quick", "--out", str(tmp_path / "y"), "--set", "data.task="]) == 2
    assert "data.task" in capsys.readouterr().err


def block_visits(model, rounds: int) -> list[int]:
    """The parameter count of each block a forward pass at `rounds` runs, in order (forward hooks)."""
    from looplm.model.blocks import Block
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append(sum(p.numel() for p in mod.parameters())))
             for m in model.modules() if isinstance(m, Block)]
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long), rounds)
    for h in hooks:
        h.remove()
    return seen


def test_baselines_match_params_and_compute():
    recipe = looplm.load_recipe("extrapolate")
    base = baseline_recipes(recipe)
    looped = looplm.build_model(recipe)
    same_params = looplm.build_model(base["untied_same_params"])
    same_compute = looplm.build_model(base["untied_same_compute"])
    stored = {name: sum(p.numel() for p in m.parameters())     # each tensor once: the shared core once
              for name, m in (("looped", looped), ("same_params", same_params), ("same_compute", same_compute))}
    assert stored["same_params"] == stored["looped"] < stored["same_compute"]
    assert (same_params.params_stored(), looped.params_stored()) == (stored["same_params"], stored["looped"])
    # the untied stack runs as many blocks of the same size per token as the looped model at depth.max:
    # the prelude, 8 rounds of the core block (distinct blocks untied), no coda
    R = recipe.depth.max
    assert block_visits(same_compute, R) == block_visits(looped, R) == [block_visits(looped, 1)[0]] * (1 + R)
    # per token, what each round applies again: the shared core, and (untied too) the concat adapter and
    # the state norm
    def per_round(m, parts):
        return sum(p.numel() for n, p in m.named_parameters() if n.startswith(parts))
    assert looped.params_per_token_visit(R) == stored["looped"] + (R - 1) * per_round(
        looped, ("core.", "adapter.", "state_norm."))
    assert same_compute.params_per_token_visit(R) == stored["same_compute"] + (R - 1) * per_round(
        same_compute, ("adapter.", "state_norm."))
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
    # recomputed at difficulty 2: the state a forward of r rounds ends in, at the last prompt position;
    # the probe fitted on the first 12 examples' and tested on the last 12's targets, by hand
    exs = TaskSource(recipe).eval_sets(24, seed=PROBE_SEED, levels=[2])[2]
    b = encode_examples(ByteTokenizer(), exs, recipe.model.context)
    last = torch.tensor(b.prompt_lens) - 1
    for r in (1, 2, 3):
        with torch.no_grad():
            state = model(b.x, r).state[torch.arange(24), last].float()
        for name, target in (("answer", lambda ex: ex.answer[0]), ("hop", lambda ex: chain_path(ex.prompt)[min(r, 2)])):
            labels = [target(ex) for ex in exs]
            assert result[name][2][r] == fit_probe(state[:12], labels[:12], state[12:], labels[12:]), (name, r)


class HopStates(torch.nn.Module):
    """A stand-in for a looped model whose state after round r, at every position of a chain prompt, is
    the one-hot code of the node reached after min(r, hops) links: the hop target is exactly there."""

    cfg = type("Cfg", (), {"context": None})

    def __init__(self, examples):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))    # the probes read the device from a parameter
        self.examples = examples
        self.codes = {node: i for i, node in enumerate(sorted({n for ex in examples for n in chain_path(ex.prompt)}))}

    def forward(self, x, rounds, **_):
        texts = [ByteTokenizer().decode(row.tolist()) for row in x]
        exs = [max((ex for ex in self.examples if t.startswith(ex.prompt)), key=lambda ex: len(ex.prompt)) for t in texts]
        states = []
        for r in range(1, rounds + 1):
            nodes = [chain_path(ex.prompt)[min(r, ex.difficulty)] for ex in exs]
            one_hot = torch.nn.functional.one_hot(torch.tensor([self.codes[n] for n in nodes]), len(self.codes))
            states.append(one_hot.float()[:, None].expand(-1, x.shape[1], -1))          # (B, T, nodes)
        return type("Out", (), {"round_states": states})


def test_probes_read_a_state_that_holds_the_hop_target():
    """A linear probe on states that hold the hop target gets right exactly the held-out examples whose
    target it saw among the fitted half (it cannot name a class it never saw), by round; the answer
    digit likewise from the round the chain is followed to its end."""
    recipe = looplm.load_recipe("extrapolate", QUICK_OVERRIDES)
    exs = TaskSource(recipe).eval_sets(24, seed=PROBE_SEED, levels=[2])[2]
    result = run_probes(HopStates(exs), ByteTokenizer(), TaskSource(recipe), 24, [2], rounds=3,
                        separator=recipe.data.separator)

    def seen_share(labels):
        return sum(label in labels[:12] for label in labels[12:]) / 12
    for r in (1, 2, 3):
        hop = [chain_path(ex.prompt)[min(r, 2)] for ex in exs]
        assert result["hop"][2][r] == pytest.approx(seen_share(hop)), r
    assert seen_share([chain_path(ex.prompt)[1] for ex in exs]) < 1      # round 1's target differs from round 2's
    for r in (2, 3):
        assert result["answer"][2][r] == pytest.approx(seen_share([ex.answer[0] for ex in exs])), r


def test_probe_needs_enough_examples():
    recipe = looplm.load_recipe("extrapolate", QUICK_OVERRIDES)
    with pytest.raises(UserError):
        run_probes(looplm.build_model(recipe), ByteTokenizer(), TaskSource(recipe), 2, [1], rounds=2)


def test_two_seeds_in_one_pool_train_what_one_seed_trains_alone(tmp_path, quick_run):
    """Two seeds' models share one pool of two worker processes (costliest first across the seeds):
    the recipe's seed trains exactly the models the quick run trained alone in this process, and the
    other seed's folder holds its own seed's models, not a copy."""
    from looplm.experiments.extrapolate import run_extrapolate
    recipe = looplm.load_recipe("extrapolate", {**QUICK_OVERRIDES, "train.threads": 2, "data.probe_examples": 0,
                                                "data.baselines": ["untied_same_params", "lstm"]})
    seed = recipe.train.seed
    threads = torch.get_num_threads()
    torch.set_num_threads(3)                      # the caller's count, whatever it is, comes back
    try:
        result = run_extrapolate(recipe, tmp_path / "p", quiet=True, seeds=[seed + 1, seed])
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    mine = json.loads((tmp_path / "p" / f"seed-{seed}" / "report.json").read_text())
    other = json.loads((tmp_path / "p" / f"seed-{seed + 1}" / "report.json").read_text())
    assert set(mine["models"]) == {"looped", "untied_same_params", "lstm"}
    serial = json.loads(quick_run[1])
    for name in mine["models"]:
        assert mine["models"][name] == serial["models"][name], name
        assert mine["answer_loss"][name] == serial["answer_loss"][name], name
        assert mine["model_info"][name]["train_loss_final"] == serial["model_info"][name]["train_loss_final"], name
    assert other["recipe"]["train"]["seed"] == seed + 1
    assert other["answer_loss"]["looped"] != mine["answer_loss"]["looped"]
    assert mine["probes"] == {} and result["seeds"]["seeds"] == [seed + 1, seed]
    assert all(i["process_wall_time_s"] > 0 for r in (mine, other) for i in r["model_info"].values())
    assert (tmp_path / "p" / f"seed-{seed}" / "lstm" / "model.safetensors").is_file()
