"""The difficulty and prompt-length curricula on a JSONL task file: per step, the sampler draws the
difficulties and prompt lengths (in the recipe's data.length_unit) a hand computation of the
schedule allows, deterministically from (seed, step); a dial that cannot apply to the file is
refused at startup (exit 2) naming the field."""

from __future__ import annotations

import json
import math

import pytest

import looplm
from looplm.cli import main
from looplm.data.taskdata import TaskSampler, TaskSource
from looplm.data.tokenizer import ByteTokenizer
from looplm.errors import UserError

TOK = ByteTokenizer()
BASE = {"model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2, "train.batch_size": 8,
        "train.grad_accum": 1, "train.threads": 1}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def recipe_for(path, **overrides):
    return looplm.load_recipe("quickstart", overrides={**BASE, "data.task": str(path), **overrides})


def sampler_for(path, **overrides):
    recipe = recipe_for(path, **overrides)
    return TaskSampler(TaskSource(recipe), TOK, recipe)


def chain_rows(levels, lengths, copies=3, sep="; "):
    """Pointer-chasing lines: `length` links "xN->yN" joined by sep, one per (difficulty, length, copy)."""
    rows = []
    for d in levels:
        for n in lengths:
            for c in range(copies):
                links = [f"v{d}{n}{c}{i}->w{i}" for i in range(n)]
                rows.append({"prompt": sep.join(links), "answer": f"a{d}", "difficulty": d})
    return rows


def items(prompt, sep="; "):
    return len([p for p in prompt.split(sep) if p.strip()])


# ---------------------------------------------------------------------------------------
# Difficulty schedule


def test_difficulty_schedule_selects_by_the_difficulty_field_per_step(tmp_path):
    path = write_jsonl(tmp_path / "hops.jsonl", chain_rows([1, 2, 3, 4, 6], [4], copies=6))
    # warm-up 20 steps, then the top difficulty grows over 0.4 x 200 = 80 steps
    s = sampler_for(path, **{"data.difficulty_min": 1, "data.difficulty_max": 4, "data.warmup_steps": 20,
                             "data.curriculum": 0.4, "train.steps": 200})

    def top(step):  # by hand: 1 during warm-up, then 1 + int(4 * (step - 20) / 80), at most 4
        return 1 if step < 20 else min(4, 1 + int(4 * min(1.0, (step - 20) / 80)))

    assert [top(t) for t in (0, 19, 20, 39, 40, 59, 60, 79, 80, 199)] == [1, 1, 1, 1, 2, 2, 3, 3, 4, 4]
    phases: dict[int, set[int]] = {}
    for step in range(200):
        drawn = {ex.difficulty for ex in s.examples(step)}
        assert len(drawn) == 1, "one difficulty per micro-batch"
        assert drawn <= set(range(1, top(step) + 1)), (step, drawn)
        phases.setdefault(top(step), set()).update(drawn)
    # every phase draws exactly the difficulties its schedule allows; 6 is held out, never trained
    assert phases == {1: {1}, 2: {1, 2}, 3: {1, 2, 3}, 4: {1, 2, 3, 4}}
    assert s.source.train_levels == [1, 2, 3, 4] and 6 in s.source.eval_sets(10)


def test_selection_is_deterministic_from_seed_and_step(tmp_path):
    path = write_jsonl(tmp_path / "hops.jsonl", chain_rows([1, 2, 3], range(2, 7)))
    dials = {"data.length_unit": "items", "data.item_separator": "; ", "data.task_length": 6,
             "data.train_length_min": 2, "data.length_curriculum": 0.5, "data.curriculum": 0.5,
             "data.difficulty_max": 3, "train.steps": 40}

    def draws(seed):
        s = sampler_for(path, **dials, **{"train.seed": seed})
        return [[ex.prompt for ex in s.examples(i)] for i in range(40)]

    assert draws(0) == draws(0)
    assert draws(0) != draws(1)


# ---------------------------------------------------------------------------------------
# Prompt-length schedule


def test_length_schedule_in_items_per_step(tmp_path):
    path = write_jsonl(tmp_path / "hops.jsonl", chain_rows([1, 2], range(2, 9)))   # 2..8 links
    s = sampler_for(path, **{"data.length_unit": "items", "data.item_separator": "; ", "data.task_length": 7,
                             "data.train_length_min": 3, "data.warmup_steps": 20, "data.length_curriculum": 0.5,
                             "data.difficulty_max": 2, "train.steps": 400})

    def hi(step):  # by hand: the window opens at 3 and its top grows to 7 over 0.5 x 400 steps after warm-up
        p = 0.0 if step < 20 else min(1.0, (step - 20) / 200)
        return 3 + math.ceil(p * (7 - 3))

    assert [hi(t) for t in (0, 20, 21, 70, 71, 120, 121, 170, 171, 399)] == [3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    phases: dict[int, set[int]] = {}
    for step in range(400):
        exs = s.examples(step)
        lengths = {items(ex.prompt) for ex in exs}
        assert len(lengths) == 1, "one prompt length per micro-batch"
        assert lengths <= set(range(3, hi(step) + 1)), (step, lengths)
        if step < 20:
            assert {ex.difficulty for ex in exs} == {1}   # warm-up: difficulty_min on the shortest prompts
        phases.setdefault(hi(step), set()).update(lengths)
    assert phases == {3: {3}, 4: {3, 4}, 5: {3, 4, 5}, 6: {3, 4, 5, 6}, 7: {3, 4, 5, 6, 7}}
    # what was selected is recorded: lines by difficulty and length (2 and 8 links are never trained)
    assert all(set(c) == {3, 4, 5, 6, 7} for c in s.source.train_length_counts.values())
    assert s.source.train_counts == {d: sum(c.values()) for d, c in s.source.train_length_counts.items()}
    assert s.source.length_window(1, 0.0) == (3, 3) and s.source.length_window(1, 1.0) == (3, 7)


def test_tokens_and_items_select_different_lines(tmp_path):
    # same number of links, different token lengths: 3 links of 4 or 9 bytes each
    rows = []
    for d in (1, 2):
        for c in range(4):
            for w in (1, 6):
                rows.append({"prompt": "; ".join(f"{c}{d}" + "x" * w + "->y" for _ in range(3)),
                             "answer": "a", "difficulty": d})
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    short = len(TOK.encode(rows[0]["prompt"]))
    long_ = len(TOK.encode(rows[1]["prompt"]))
    assert short < long_ and items(rows[0]["prompt"]) == items(rows[1]["prompt"]) == 3
    common = {"data.difficulty_max": 2, "train.steps": 30}
    # items: every line has 3 items, so task_length = 3 keeps them all
    s = sampler_for(path, **common, **{"data.length_unit": "items", "data.item_separator": "; ",
                                       "data.task_length": 3})
    seen = {len(TOK.encode(ex.prompt)) for i in range(30) for ex in s.examples(i)}
    assert seen == {short, long_}
    # tokens: task_length = the short prompts' token count keeps only those
    s = sampler_for(path, **common, **{"data.length_unit": "tokens", "data.task_length": short})
    assert {len(TOK.encode(ex.prompt)) for i in range(30) for ex in s.examples(i)} == {short}
    # tokens with a window: both lengths, one per micro-batch
    s = sampler_for(path, **common, **{"data.length_unit": "tokens", "data.train_length_min": 1})
    per_batch = [{len(TOK.encode(ex.prompt)) for ex in s.examples(i)} for i in range(30)]
    assert all(len(b) == 1 for b in per_batch) and set().union(*per_batch) == {short, long_}
    assert s.source.length_top == long_


def test_builtin_length_schedule_unchanged():
    # the shared window helper keeps the built-in draw: uniform over max(min, level's min)..ramped top
    recipe = looplm.load_recipe("quickstart", overrides={
        **BASE, "data.task": "chain", "data.difficulty_max": 3, "data.task_length": 10,
        "data.train_length_min": 2, "data.length_curriculum": 0.5, "train.steps": 100})
    src = TaskSource(recipe)
    assert src.length_window(3, 0.0) == (3, 3) and src.length_window(1, 0.5) == (2, 6)
    assert all(2 <= src.train_length(1, i, 0.5) <= 6 for i in range(50))


# ---------------------------------------------------------------------------------------
# Refusals: exit 2, naming the field


@pytest.fixture
def train_on(tmp_path, capsys):
    def run(rows, *sets):
        path = write_jsonl(tmp_path / "f.jsonl", rows)
        argv = ["train", "--recipe", "quickstart", "--out", str(tmp_path / "run"), "--set", f"data.task={path}",
                "--set", "train.steps=2"]
        code = main(argv + [a for s in sets for a in ("--set", s)])
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return code, err
    return run


LEVELLED = chain_rows([1, 2], [2, 3, 4])
BARE = [{"prompt": f"p{i}", "answer": "a"} for i in range(6)]


@pytest.mark.parametrize("rows,sets,field", [
    (LEVELLED, ["data.length_unit=items"], "data.item_separator"),
    (LEVELLED, ["data.task_length=3"], "data.task_length"),                   # no unit: prompts as written
    (LEVELLED, ["data.length_unit=tokens", "data.task_length=999"], "data.task_length"),      # no line that long
    (LEVELLED, ["data.length_unit=items", "data.item_separator=; ", "data.train_length_min=5"],
     "data.train_length_min"),                                                # beyond the longest line
    (LEVELLED, ["data.length_unit=items", "data.item_separator=; ", "data.task_length=3",
                "data.train_length_min=3", "data.length_curriculum=0.5"], "data.length_curriculum"),  # one length
    (chain_rows([1], [2]) + chain_rows([2], [4]),
     ["data.length_unit=items", "data.item_separator=; ", "data.task_length=3", "data.train_length_min=1"],
     "data.train_length_min"),                                                # difficulty 2 has no line in 1..3
    (BARE, ["data.curriculum=0.5"], "data.curriculum"),                       # no difficulties to schedule
    (BARE, ["data.warmup_steps=1"], "data.warmup_steps"),
    (BARE, ["data.depth_by_difficulty=true", "depth.kind=uniform"], "data.depth_by_difficulty"),
    (chain_rows([1], [2, 3]), ["data.curriculum=0.5"], "data.curriculum"),    # one difficulty only
])
def test_refusals_name_the_field(train_on, rows, sets, field):
    code, err = train_on(rows, *sets)
    assert code == 2 and field in err, err


def test_length_unit_is_for_jsonl_only():
    with pytest.raises(UserError, match="data.length_unit"):
        looplm.load_recipe("quickstart", overrides={"data.task": "chain", "data.length_unit": "tokens"})
    with pytest.raises(UserError, match="data.item_separator"):
        looplm.load_recipe("quickstart", overrides={"data.task": "x.jsonl", "data.length_unit": "tokens",
                                                    "data.item_separator": ";"})


def test_report_records_the_lines_the_length_dials_allowed(tmp_path):
    path = write_jsonl(tmp_path / "hops.jsonl", chain_rows([1, 2], range(2, 9), copies=6))   # 2..8 links
    run = tmp_path / "run"
    from looplm.train.trainer import train
    train(recipe_for(path, **{"data.length_unit": "items", "data.item_separator": "; ", "data.task_length": 7,
                              "data.train_length_min": 3, "data.difficulty_max": 2, "train.steps": 2,
                              "data.eval_examples": 4, "data.probe_examples": 0, "depth.kind": "fixed",
                              "depth.rounds": 2, "backward.window": "all"}), run, quiet=True)
    rep = json.loads((run / "report.json").read_text())["task_difficulties"]
    counts = rep["train_length_counts"]
    assert set(counts) == {"1", "2"}
    for d, by_length in counts.items():
        assert set(by_length) <= {str(n) for n in range(3, 8)}     # never 2 or 8 links
        assert sum(by_length.values()) == rep["train_examples"][d]
        assert all(0 < c <= 6 for c in by_length.values())         # at most the file's copies of that length
    assert "by prompt length in items" in (run / "report.md").read_text()


@pytest.mark.parametrize("sep", ["\n", "\t|", ' "; ', "\\ ", "é → "])
def test_a_separator_with_escapes_survives_the_saved_recipe(tmp_path, sep):
    from looplm.recipe.config import read_recipe_dict, recipe_from_dict
    path = write_jsonl(tmp_path / "t.jsonl", chain_rows([1], range(2, 4), sep=sep))
    recipe = recipe_for(path, **{"data.length_unit": "items", "data.item_separator": sep})
    (tmp_path / "r.toml").write_text(recipe.to_toml())
    assert recipe_from_dict(read_recipe_dict(str(tmp_path / "r.toml"))).data.item_separator == sep


def test_experiment_report_names_a_jsonl_files_own_lengths():
    """A JSONL task has no generator's length dial: the experiment's report says so, and never "None items"."""
    from looplm.experiments.extrapolate import _setting_lines
    result = {"recipe": looplm.load_recipe("extrapolate").to_dict(), "train_difficulty_min": 1,
              "train_difficulty_max": 4, "train_rounds": {"min": 1, "max": 8}, "eval_rounds_max": 16,
              "eval_difficulty_max": 8, "prompt_length": {"items": None, "tokens_by_difficulty": {"1": 37.3, "8": 58.0}}}
    text = "\n".join(_setting_lines(result))
    assert "None" not in text and "the data file's own" in text and "1: 37, 8: 58" in text
    result["prompt_length"]["items"] = 10
    assert "every prompt has 10 items" in "\n".join(_setting_lines(result))
