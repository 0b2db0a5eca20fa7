"""`looplm experiment extrapolate --seeds`: the aggregate over seeds (mean, sample std, min, max and
every seed's value per cell; how many seeds formed the lookup, failed ones counted and kept in the
means), computed from constructed per-seed tables and checked against numbers worked out by hand,
and the command's wiring with the per-seed experiment stubbed (a real run takes ~10 s per seed;
tests/test_experiment.py keeps the one real run)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from looplm.cli import main
from looplm.experiments import extrapolate as ex


def fake_result(looped_cell: float, offset: float) -> dict:
    """One seed's result as `run_seed` returns it, small: trained on difficulties 1..2 at 1..2 rounds,
    evaluated on 1..4 at 1..4 rounds. The lookup criterion's cell (difficulty 2, 2 rounds) holds
    `looped_cell`; every other cell is a fixed pattern plus `offset`, so seeds differ everywhere."""
    def cell(dd: int, r: int) -> float:
        return looped_cell if (dd, r) == (2, 2) else round(min(1.0, 0.1 * dd + 0.05 * r + offset), 4)
    return {
        "task": "chain", "train_difficulty_min": 1, "train_difficulty_max": 2, "eval_difficulty_max": 4,
        "train_rounds": {"min": 1, "max": 2}, "eval_rounds_max": 4,
        "prompt_length": {"items": 8, "tokens_by_difficulty": {str(d): 40.0 for d in range(1, 5)}},
        "eval_examples_per_difficulty": {str(d): 16 for d in range(1, 5)},
        "digit_guess_baseline": {"1": 0.15, "2": 0.23, "3": 0.28, "4": 0.36},
        "models": {"looped": {str(d): {str(r): cell(d, r) for r in range(1, 5)} for d in range(1, 5)},
                   "untied_same_params": {str(d): {"1": round(0.2 + offset / 2, 4)} for d in range(1, 5)},
                   "lstm": {str(d): {"1": round(0.3 - offset, 4)} for d in range(1, 5)}},
    }


# Seed 1 stays at the guessing level where the criterion is judged: it did not form the lookup.
CELLS = {0: (0.95, 0.0), 1: (0.30, 0.1), 2: (1.00, 0.2)}


def constructed() -> dict[int, dict]:
    return {s: fake_result(*CELLS[s]) for s in CELLS}


def test_aggregate_equals_hand_computed_statistics():
    agg = ex.aggregate_seeds(constructed())
    assert agg["seeds"] == [0, 1, 2]
    assert set(agg["models"]) == {"looped", "untied_same_params", "lstm"}
    # every model keeps its own cells: looped 4 x 4, the others one column
    assert {m: {d: list(row) for d, row in t.items()} for m, t in agg["models"].items()} == {
        m: {d: list(row) for d, row in t.items()} for m, t in fake_result(0, 0)["models"].items()}
    # looped, difficulty 2 x 2 rounds: 0.95, 0.30, 1.00 -> mean 0.75; deviations .2, -.45, .25,
    # squares .04 + .2025 + .0625 = .305, / (3 - 1) = .1525
    c = agg["models"]["looped"]["2"]["2"]
    assert c["mean"] == pytest.approx(0.75)
    assert c["std"] == pytest.approx(math.sqrt(0.1525))
    assert (c["min"], c["max"]) == (0.30, 1.00)
    assert c["values"] == {"0": 0.95, "1": 0.30, "2": 1.00}
    # looped, difficulty 3 x 4 rounds: 0.5, 0.6, 0.7 -> mean 0.6, sample std 0.1
    c = agg["models"]["looped"]["3"]["4"]
    assert c["values"] == {"0": 0.5, "1": 0.6, "2": 0.7}
    assert (c["mean"], c["std"], c["min"], c["max"]) == pytest.approx((0.6, 0.1, 0.5, 0.7))
    # lstm: 0.3, 0.2, 0.1 -> mean 0.2, std 0.1, min 0.1, max 0.3 (the same at every difficulty)
    for d in "1234":
        c = agg["models"]["lstm"][d]["1"]
        assert (c["mean"], c["std"], c["min"], c["max"]) == pytest.approx((0.2, 0.1, 0.1, 0.3))
    # untied: 0.2, 0.25, 0.3 -> mean 0.25, std 0.05
    c = agg["models"]["untied_same_params"]["4"]["1"]
    assert (c["mean"], c["std"]) == pytest.approx((0.25, 0.05))


def test_a_failed_seed_is_counted_and_stays_in_the_mean():
    agg = ex.aggregate_seeds(constructed())
    lk = agg["lookup"]
    # the stated criterion: looped at the largest trained difficulty (2) and training depth (2), >= 0.9
    assert (lk["model"], lk["difficulty"], lk["rounds"], lk["threshold"]) == ("looped", 2, 2, ex.LOOKUP_THRESHOLD)
    assert "difficulty 2" in lk["criterion"] and "2 rounds" in lk["criterion"] and "90%" in lk["criterion"]
    assert (lk["formed"], lk["of"], lk["failed_seeds"]) == (2, 3, [1])
    assert lk["per_seed"] == {"0": {"accuracy": 0.95, "digit_guess": 0.23, "formed": True},
                              "1": {"accuracy": 0.30, "digit_guess": 0.23, "formed": False},
                              "2": {"accuracy": 1.00, "digit_guess": 0.23, "formed": True}}
    # the failed seed is in the statistics: without it the mean would be 0.975 and the min 0.95
    c = agg["models"]["looped"]["2"]["2"]
    assert (c["mean"], c["min"]) == pytest.approx((0.75, 0.30))
    # the threshold is a parameter, and reaching it counts (>=): at 0.95 seed 0 still forms it, at 0.96 not
    assert ex.aggregate_seeds(constructed(), 0.95)["lookup"]["failed_seeds"] == [1]
    assert ex.aggregate_seeds(constructed(), 0.96)["lookup"]["failed_seeds"] == [0, 1]


def test_one_seed_has_no_spread_and_unequal_tables_are_refused():
    one = ex.aggregate_seeds({7: fake_result(0.95, 0.0)})
    c = one["models"]["looped"]["2"]["2"]
    assert (c["mean"], c["std"], c["min"], c["max"], c["values"]) == (0.95, None, 0.95, 0.95, {"7": 0.95})
    other = fake_result(0.95, 0.0)
    del other["models"]["looped"]["4"]["4"]
    with pytest.raises(ValueError, match="seed 1"):
        ex.aggregate_seeds({0: fake_result(0.95, 0.0), 1: other})


@pytest.fixture
def stubbed(monkeypatch):
    """SeedPlan replaced by one that trains nothing and evaluates to the constructed table of
    the seed asked for (in CELLS), recording (seed, folder) when planned; the seeds' figure panels
    recorded on their way to the real plotting."""
    calls, panels = [], {}

    class Plan:
        def __init__(self, recipe, out, quiet=False, lookup_threshold=ex.LOOKUP_THRESHOLD, first=True):
            calls.append((recipe.train.seed, out))
            self.seed, self.out, self.threshold = recipe.train.seed, out, lookup_threshold

        def jobs(self):
            return []

        def evaluate(self, info):
            assert info == {}
            result = fake_result(*CELLS.get(self.seed, (0.95, 0.0)))
            return {**result, "lookup": ex.lookup_verdict(result, self.threshold), "out": str(self.out)}

    save = ex._save_panels

    def save_panels(path, model, result, panel_list):
        panels[path.name] = [title for title, _ in panel_list]
        save(path, model, result, panel_list)
    monkeypatch.setattr(ex, "SeedPlan", Plan)
    monkeypatch.setattr(ex, "_save_panels", save_panels)
    return calls, panels


def run_cli(*argv: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["experiment", "extrapolate", "--quick", *argv])
    return code, stdout.getvalue(), stderr.getvalue()


def test_cli_runs_each_seed_and_writes_the_aggregate(stubbed, tmp_path):
    calls, panels = stubbed
    out = tmp_path / "x"
    code, stdout, _ = run_cli("--seeds", "2,0,1", "--out", str(out), "--json")
    assert code == 0
    assert calls == [(2, out / "seed-2"), (0, out / "seed-0"), (1, out / "seed-1")]
    result = json.loads(stdout)
    assert result == json.loads((out / "report.json").read_text())
    expected = ex.aggregate_seeds({s: fake_result(*CELLS[s]) for s in (2, 0, 1)})
    assert result["seeds"] == json.loads(json.dumps(expected))
    # the contract's keys, `models` holding the mean of every cell
    assert (result["task"], result["train_difficulty_max"]) == ("chain", 2)
    assert result["models"]["looped"]["2"]["2"] == pytest.approx(0.75)
    assert result["models"]["lstm"]["3"]["1"] == pytest.approx(0.2)
    assert result["seed_dirs"] == {s: str(out / f"seed-{s}") for s in ("2", "0", "1")}
    # one figure per model: a panel for every seed, the failed one marked, and the mean
    assert set(panels) == {"heatmap_seeds_looped.png", "heatmap_seeds_untied_same_params.png",
                           "heatmap_seeds_lstm.png"}
    assert panels["heatmap_seeds_looped.png"] == ["looped, seed 2", "looped, seed 0", "looped, seed 1 (no lookup)",
                                                  "looped, mean of 3 seeds"]
    assert panels["heatmap_seeds_lstm.png"] == ["lstm, seed 2", "lstm, seed 0", "lstm, seed 1", "lstm, mean of 3 seeds"]
    md = (out / "report.md").read_text()
    for name in panels:
        assert (out / name).stat().st_size > 0 and f"]({name})" in md
    assert "**2 of 3 seeds formed the lookup**; failed: seed 1." in md
    # looped, difficulty 2: rounds 1 holds 0.25, 0.35, 0.45; rounds 2 the criterion's cell
    assert "| 2 | 35 ± 10 [25, 45] | 75 ± 39 [30, 100] |" in md
    assert "| 1 | 30.0 | 23 | no |" in md
    # without --json: the summary in words, the count among it
    code, stdout, _ = run_cli("--seeds", "0,1,2", "--out", str(tmp_path / "y"), "--lookup-threshold", "0.96")
    assert code == 0
    assert "1 of 3 seeds formed the lookup" in stdout
    assert "failed: seeds 0, 1 (counted, and kept in every mean)" in stdout


def test_cli_default_seeds_and_one_seed_layout(stubbed, tmp_path):
    calls, _ = stubbed
    assert run_cli("--out", str(tmp_path / "d"))[0] == 0
    assert [s for s, _ in calls] == list(ex.DEFAULT_SEEDS) == [0, 1, 2]
    calls.clear()
    code, stdout, _ = run_cli("--seeds", "5", "--out", str(tmp_path / "one"), "--json")
    # one seed: today's single run, in OUT itself, with today's keys and no aggregate
    assert code == 0 and calls == [(5, tmp_path / "one")]
    result = json.loads(stdout)
    assert "seeds" not in result and result["models"]["looped"]["2"]["2"] == 0.95
    assert result["lookup"]["formed"] is True


@pytest.mark.parametrize("argv, message", [
    (["--seeds", ""], "at least one seed"),
    (["--seeds", " , "], "at least one seed"),
    (["--seeds", "0,1,0"], "repeated"),
    (["--seeds", "0,x"], "non-negative integers"),
    (["--seeds", "1,-2"], "non-negative"),
    (["--seeds", "0,1", "--set", "train.seed=3"], "--seeds"),
    (["--seeds", "0,1", "--lookup-threshold", "1.5"], "(0, 1]"),
])
def test_refusals_exit_2_before_any_seed_runs(stubbed, tmp_path, argv, message):
    calls, _ = stubbed
    code, stdout, stderr = run_cli(*argv, "--out", str(tmp_path / "r"))
    assert code == 2 and message in stderr and stderr.count("\n") == 1
    assert calls == [] and not (tmp_path / "r").exists()


def test_a_taken_seed_folder_is_refused_before_any_seed_runs(stubbed, tmp_path):
    calls, _ = stubbed
    (tmp_path / "x" / "seed-2" / "looped" / "checkpoint").mkdir(parents=True)
    code, _, stderr = run_cli("--seeds", "0,1,2", "--out", str(tmp_path / "x"))
    assert code == 2 and "not empty" in stderr and "seed-2" in stderr and calls == []


def test_a_threshold_at_the_guessing_level_is_refused_before_training(tmp_path):
    """The real per-seed runner: the held-out sets (and the digit-guess level) come before training,
    so a criterion guessing would pass exits 2 in well under a second, with nothing trained."""
    code, _, stderr = run_cli("--seeds", "0", "--out", str(tmp_path / "g"), "--lookup-threshold", "0.1")
    assert code == 2 and "guessing" in stderr and "difficulty 2" in stderr
    assert not (tmp_path / "g" / "looped").exists()


def test_each_seeds_verdict_says_whether_its_lookup_cell_is_above_chance():
    """A seed whose looped accuracy in the lookup cell is not above the chance its prompts allow is named."""
    results = constructed()
    for s, above in ((0, True), (1, False), (2, True)):
        results[s]["chance"] = {"looped": {"2": {"chance": 0.25, "above_chance": {"2": above}, "p_value": {"2": 0.5}}}}
    agg = ex.aggregate_seeds(results, 0.9)
    lk = agg["lookup"]
    assert lk["at_chance_seeds"] == [1]
    assert lk["per_seed"]["1"]["above_chance"] is False and lk["per_seed"]["1"]["chance"] == 0.25
    assert "at chance in that cell" in ex.lookup_line({"seeds": agg})
    one = ex.lookup_verdict(results[1], 0.9)
    assert one["above_chance"] is False and "NOT above" in ex.lookup_line({"lookup": one})


def test_a_failed_lookup_without_short_prompts_says_what_the_recipe_rests_on():
    """A seed that did not form the lookup, trained with no length or crop curriculum, is told that short
    prompts are what the recipe needs; with either curriculum, or when the lookup formed, nothing is added."""
    results = constructed()
    one = ex.lookup_verdict(results[1], 0.9)
    assert not one["formed"]
    bare = {"task": "f.jsonl", "train_length_min": 0, "crop_curriculum": 0.0}
    assert ex.NO_SHORT_PROMPTS in ex.lookup_line({"lookup": one, "recipe": {"data": bare}})
    for curriculum in ({"crop_curriculum": 0.6}, {"train_length_min": 2}):
        line = ex.lookup_line({"lookup": one, "recipe": {"data": {**bare, **curriculum}}})
        assert ex.NO_SHORT_PROMPTS not in line and ex.NO_QUERY_ROUND not in line and "did not form" in line
        # with short prompts but round 1 finding the query and the first hop at once: the query round is named
        line = ex.lookup_line({"lookup": one, "recipe": {"data": {**bare, **curriculum, "round_targets": "trace"}}})
        assert ex.NO_QUERY_ROUND in line and ex.NO_SHORT_PROMPTS not in line
        line = ex.lookup_line({"lookup": one, "recipe": {"data": {**bare, **curriculum, "round_targets": "query_trace"}}})
        assert ex.NO_QUERY_ROUND not in line
    formed = ex.lookup_verdict(results[0], 0.9)
    assert formed["formed"] and ex.NO_SHORT_PROMPTS not in ex.lookup_line({"lookup": formed, "recipe": {"data": bare}})
