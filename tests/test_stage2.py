"""Ouro stage II from a finished run: `looplm train --stage2 RUN` trains only the exit gate.

Every language-model weight must come out bit-identical to RUN's; the gate must change; the
recipe card must record the stage-II choices (k, gamma, averaging) and where training started.
A run trained without a gate gets a fresh one (its LM weights still untouched).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from looplm.cli import main
from looplm.errors import UserError
from looplm.train.trainer import stage2_recipe, train

from conftest import tiny_recipe


def corpus(root):
    d = root / "corpus"
    d.mkdir()
    for i in range(6):
        (d / f"doc{i}.py").write_text("\n".join(f"def g{i}_{j}(x):\n    return x - {j} * {i}" for j in range(60)))
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A stage-I learned-exit run and a plain run without a gate."""
    root = tmp_path_factory.mktemp("stage2")
    data = corpus(root)
    gated = tiny_recipe(**{"depth.rounds": 3, "exit.gate": True, "supervision.kind": "learned_exit",
                           "data.path": str(data)})
    plain = tiny_recipe(**{"data.path": str(data)})
    train(gated, root / "gated", quiet=True)
    train(plain, root / "plain", quiet=True)
    return root


def weights(run):
    return load_file(str(run / "checkpoint" / "model.safetensors"))


def assert_lm_identical_gate_changed(before: dict, after: dict, gate_existed: bool = True):
    lm = [k for k in after if not k.startswith("gate.")]
    assert lm and set(lm) == {k for k in before if not k.startswith("gate.")}
    for k in lm:
        assert torch.equal(before[k], after[k]), f"LM weight {k} changed in stage II"
    gate = [k for k in after if k.startswith("gate.")]
    assert gate
    if gate_existed:
        assert any(not torch.equal(before[k], after[k]) for k in gate), "the gate did not train"


def test_stage2_changes_no_lm_weight(runs):
    rec = stage2_recipe(runs / "gated", {"train.steps": 4, "optim.lr": 0.05})
    assert rec.train.stage == 2 and rec.name.endswith("-stage2")
    report = train(rec, runs / "gated-s2", quiet=True, init_from=runs / "gated")
    assert_lm_identical_gate_changed(weights(runs / "gated"), weights(runs / "gated-s2"))
    assert report["init_from"] == str(runs / "gated")
    card = (runs / "gated-s2" / "report.md").read_text()
    assert "STAGE II" in card and "k = 50.0" in card and "gamma = 0.005" in card and "averaged" in card
    assert "only the exit gate trained" in card
    # same tokenizer and data split as the run it started from
    assert (runs / "gated-s2" / "data" / "val.bin").read_bytes() == (runs / "gated" / "data" / "val.bin").read_bytes()


def test_stage2_cli_on_a_run_without_gate(runs, capsys):
    out = runs / "plain-s2"
    assert main(["train", "--stage2", str(runs / "plain"), "--out", str(out), "--set", "train.steps=3"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    before, after = weights(runs / "plain"), weights(out)
    assert not any(k.startswith("gate.") for k in before)
    assert_lm_identical_gate_changed(before, after, gate_existed=False)
    rec = json.loads((out / "report.json").read_text())["recipe"]
    assert rec["train"]["stage"] == 2 and rec["exit"]["gate"] is True


@pytest.mark.parametrize("args,needle", [
    (["--recipe", "quickstart"], "takes its recipe from RUN"),
    (["--set", "train.stage=1"], "train.stage must stay 2"),
])
def test_stage2_cli_bad_input(runs, capsys, args, needle):
    assert main(["train", "--stage2", str(runs / "gated"), "--out", str(runs / "bad"), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_stage2_of_a_missing_run(tmp_path):
    with pytest.raises(UserError, match="not a finished looplm run"):
        stage2_recipe(tmp_path / "nothing")


def test_stage2_resume_keeps_origin_and_lm(runs):
    rec = stage2_recipe(runs / "gated", {"train.steps": 4, "train.checkpoint_every": 2})
    out = runs / "gated-s2-resume"
    assert train(rec, out, quiet=True, init_from=runs / "gated", stop_after=2)["stopped_early"]
    report = train(rec, out, quiet=True, resume=True)
    assert report["steps"] == 4 and report["init_from"] == str(runs / "gated")
    assert_lm_identical_gate_changed(weights(runs / "gated"), weights(out))
