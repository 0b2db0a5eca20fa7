"""`looplm eval RUN --prompt-mode`: a feedback task run's greedy answers decoded by the cached engine in
each prompt mode, against independent computations: each prompt decoded alone and its answer compared
by hand, and standard mode against the plain pass scored teacher-forced one example at a time; the
refusals exit 2 before any work."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import looplm
import looplm.evaluation.tasks as tasks_mod
import looplm.runs.report
from conftest import answer_scores, tiny_recipe, write_corpus
from looplm.cli import main
from looplm.data.taskdata import TaskSource
from looplm.data.tasks import ANSWER_END, SEPARATOR
from looplm.evaluation.tasks import greedy_answers, prompt_mode_accuracy
from looplm.inference import Engine, SamplingParams
from looplm.train.trainer import train

MODES = ["standard", "soft", "fused"]


def _train(recipe, out):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(looplm.runs.report, "write_plots", lambda run_dir, report: [])    # seconds of matplotlib
        torch.manual_seed(0)
        train(recipe, out, quiet=True)
    return out


@pytest.fixture(scope="module")
def feedback_task_run(tmp_path_factory):
    """A feedback run on `completion` ("yes"/"no" answers) trained plainly for 71 steps, then 29 of the
    pass mixture: its plain pass answers some examples right, and its feedback is half trained, so
    soft decoding (fed from the answer's second token) loses some of those answers and fused decoding
    (fed from the prompt) loses more. Three different tables: a mode ignored or swapped shows."""
    out = tmp_path_factory.mktemp("fbtask") / "run"
    return _train(tiny_recipe(**{
        "data.task": "completion", "data.difficulty_max": 2, "data.eval_difficulty_max": 3,
        "data.eval_examples": 16, "model.context": 128, "model.init_state": "prelude", "train.steps": 100,
        "train.threads": 1, "train.checkpoint_every": 1000, "optim.lr": 3e-3, "feedback.mode": "gate",
        "feedback.passes": [0.5, 0.5], "feedback.mix_from_step": 71,
        "model.injection": "add"}), out)     # as the feedback recipe; the three tables below were found with it


def test_accuracy_by_prompt_mode_equals_each_prompt_decoded_alone_and_compared_by_hand(feedback_task_run, capsys):
    run = looplm.load_run(feedback_task_run)
    assert main(["eval", str(feedback_task_run), "--prompt-mode", "standard,soft,fused", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    got = result["accuracy_by_prompt_mode"]
    R = run.recipe.depth.rounds
    assert list(got) == MODES and result["prompt_mode_rounds"] == R
    sets = TaskSource(run.recipe).eval_sets(run.recipe.data.eval_examples)
    assert result["examples_by_difficulty"] == {str(d): len(exs) for d, exs in sets.items()}
    engine = Engine(run.model, run.tokenizer)          # the recipe's fixed depth R
    for mode in MODES:
        for d, exs in sets.items():
            # right: the continuation is the answer, then the newline that ends it (one byte a character)
            hits = [engine.generate([ex.prompt + SEPARATOR], SamplingParams(
                max_new_tokens=len(ex.answer) + 1, stop_at_eos=False, prompt_mode=mode))[0].text
                == ex.answer + ANSWER_END for ex in exs]
            assert got[mode][str(d)] == sum(hits) / len(exs), (mode, d)
    tables = [json.dumps(got[m], sort_keys=True) for m in MODES]
    assert len(set(tables)) == 3, f"the modes must score differently for this test to see one ignored: {got}"
    # the human output prints the same numbers as a difficulty x mode table, in the order asked
    assert main(["eval", str(feedback_task_run), "--prompt-mode", "standard,fused"]) == 0
    text = capsys.readouterr().out
    assert "| difficulty \\ prompt mode | standard | fused |" in text
    for d in sets:
        assert f"| {d} | {100 * got['standard'][str(d)]:.0f} | {100 * got['fused'][str(d)]:.0f} |" in text


def test_standard_mode_is_the_plain_pass_greedy_and_teacher_forced(feedback_task_run):
    """Standard mode reads no feedback: its cached greedy answers are the whole-forward reference's
    (greedy_answers without a mode), and its accuracy is the plain pass's teacher-forced exact match
    (answer and newline all argmax), computed one example at a time by conftest.answer_scores."""
    run = looplm.load_run(feedback_task_run)
    model, tok, R = run.model.eval(), run.tokenizer, run.recipe.depth.rounds
    sets = TaskSource(run.recipe).eval_sets(run.recipe.data.eval_examples)
    acc = prompt_mode_accuracy(model, tok, sets, ["standard", "fused"], R)
    for d, exs in sets.items():
        prompts = [ex.prompt for ex in exs]
        assert greedy_answers(model, tok, prompts, R, prompt_mode="standard") == greedy_answers(model, tok, prompts, R)
        assert acc["standard"][d] == answer_scores(model, tok, exs, R, separator=True)[0]
    assert acc["fused"] != acc["standard"]               # feedback changes the answers: the mode is not ignored
    # an answer the model only begins is wrong: the newline must follow it ("no\n" does not answer "n")
    right = next(ex for d, exs in sets.items() for ex in exs
                 if greedy_answers(model, tok, [ex.prompt], R) == [ex.answer])
    begun = dataclasses.replace(right, answer=right.answer[:-1])
    assert prompt_mode_accuracy(model, tok, {1: [right], 2: [begun]}, ["standard"], R)["standard"] == {1: 1.0, 2: 0.0}
    assert answer_scores(model, tok, [begun], R, separator=True)[0] == 0.0


def test_prompt_mode_is_refused_on_a_language_model_run_and_where_the_model_lacks_it(feedback_task_run, tmp_path,
                                                                                    capsys, monkeypatch):
    lm = _train(tiny_recipe(**{"data.path": str(write_corpus(tmp_path / "corpus")), "train.steps": 2,
                               "feedback.mode": "gate"}), tmp_path / "lm")
    assert main(["eval", str(lm), "--prompt-mode", "fused"]) == 2
    err = capsys.readouterr().err
    assert "K-pass loss" in err and "--feedback-passes" in err and "fused = 2 passes" in err
    # a task run without feedback: soft and fused refused as generate refuses them, standard scored
    plain = _train(tiny_recipe(**{"data.task": "completion", "data.difficulty_max": 1, "data.eval_difficulty_max": 1,
                                  "data.eval_examples": 4, "model.context": 128, "train.steps": 2}), tmp_path / "plain")
    assert main(["generate", str(plain), "--prompt", "x", "--prompt-mode", "soft"]) == 2
    refusal = capsys.readouterr().err
    assert "no full-bandwidth feedback" in refusal
    assert main(["eval", str(plain), "--prompt-mode", "standard,soft"]) == 2
    assert capsys.readouterr().err == refusal
    assert main(["eval", str(plain), "--prompt-mode", "standard", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["accuracy_by_prompt_mode"]) == {"standard"}
    assert main(["eval", str(feedback_task_run), "--prompt-mode", "standard,greedy"]) == 2
    assert "--prompt-mode 'standard,greedy'" in capsys.readouterr().err
    # refused before any scoring is done
    monkeypatch.setattr(tasks_mod, "score_task_sets", lambda *a, **k: pytest.fail("scored before refusing"))
    assert main(["eval", str(plain), "--prompt-mode", "fused"]) == 2
    assert capsys.readouterr().err == refusal.replace("soft", "fused")
