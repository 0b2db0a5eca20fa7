"""One rule for the recipe: a field that does not apply stays at its default, or the recipe is refused.

The enumeration below is generated from the config classes: every field that declares an
applicability rule is set away from its default once where the rule holds (accepted, and kept)
and once for each of its conditions where that condition fails (refused, naming the field and
the field that decides). A field added later with a rule is covered here without a new test;
a rule on a new deciding field fails `test_every_deciding_field_has_witnesses` until the
witness table below says which values it can take.
"""

from __future__ import annotations

import dataclasses
import json
import itertools
import typing
from typing import Any, Literal

import pytest

import looplm
from looplm.cli import main
from looplm.errors import UserError
from looplm.recipe.config import inapplicable, section_classes

from conftest import tiny_recipe

BASE = {"model.d_model": 32, "model.n_heads": 4, "train.steps": 2}

# deciding field -> (value, companion settings that value needs to be a valid recipe)
WITNESSES: dict[str, list[tuple[Any, dict[str, Any]]]] = {
    "depth.kind": [("fixed", {}), ("uniform", {}), ("lognormal_poisson", {}), ("geometric", {})],
    "supervision.kind": [("final", {}), ("rounds", {"supervision.rounds": [1]}), ("every", {}),
                         ("learned_exit", {"exit.gate": True}), ("act_mixture", {"exit.gate": True})],
    "supervision.prior": [("none", {}), ("uniform", {}), ("geometric", {})],
    "train.stage": [(1, {}), (2, {"exit.gate": True})],
    "train.parallel": [("none", {}), ("ddp", {})],
    "model.init_state": [("zeros", {}), ("prelude", {}), ("random", {})],
    "model.residual_scaling": [("none", {}), ("deeploop", {})],
    "model.moe_experts": [(0, {}), (4, {})],
    "model.rope_scaling": [("none", {}), ("linear", {}), ("llama3", {})],
    "feedback.mode": [("none", {}), ("gate", {}), ("add", {}), ("concat", {})],
    "model.local_rope_base": [(0.0, {}), (10000.0, {"model.local_blocks": [0]})],
    "model.mor": [("none", {}), ("token_choice", {"depth.kind": "fixed"}),
                  ("expert_choice", {"depth.kind": "fixed", "depth.rounds": 1, "backward.window": "all"})],
    "optim.schedule": [("cosine", {}), ("wsd", {}), ("constant", {})],
    "data.task": [("", {}), ("chain", {}), ("held_out.jsonl", {})],
    "data.path": [("", {}), ("corpus.jsonl", {})],
    "data.depth_by_difficulty": [(False, {}), (True, {"data.task": "chain", "depth.kind": "uniform"})],
    "data.train_length_min": [(0, {}), (2, {})],
    "data.length_unit": [("", {}), ("tokens", {}), ("items", {"data.item_separator": "; "})],
    "data.crop_curriculum": [(0.0, {}), (0.5, {"data.item_separator": "; "})],
    "data.round_targets": [("answer", {}), ("trace", {}), ("query_trace", {"data.item_separator": "; "})],
    "supervision.fixed_point": [(0.0, {}), (0.5, {})],
    "model.injection": [("add", {}), ("decay", {}), ("concat", {}), ("none", {"model.init_state": "prelude"})],
    "model.round_update": [("plain", {}), ("damped", {}), ("euler", {})],
    "depth.ramp_fraction": [(0.0, {}), (0.25, {"depth.kind": "uniform"})],
    "optim.optimizer": [("adamw", {}), ("muon", {})],
}


def ruled_fields():
    for section, cls in section_classes().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("applies"):
                yield f"{section}.{f.name}", f, hints[f.name]


def candidates(f: dataclasses.Field, tp: Any) -> list[Any]:
    """Values other than the default, of the field's type, to try."""
    d = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if typing.get_origin(tp) is Literal:
        return [v for v in typing.get_args(tp) if v != d]
    if tp is bool:
        return [not d]
    if tp is int:
        return [v for v in (d + 1, d - 1, 2 * d) if v != d]
    if tp is float:
        return [v for v in (d / 2, d + 0.5, 0.5) if v != d]
    if tp is str:
        return ["elsewhere"]
    if typing.get_origin(tp) is tuple:
        return [list(d[-1:])] if d else [[1]] if typing.get_args(tp)[0] is int else [[1.0]]
    raise AssertionError(f"no candidate values for type {tp}")


def settings(keys: tuple[str, ...]):
    """Every combination of witness values for `keys`, with companions merged (contradictions skipped)."""
    for combo in itertools.product(*(WITNESSES[k] for k in keys)):
        merged: dict[str, Any] = {}
        ok = True
        for key, (value, companions) in zip(keys, combo):
            for k, v in {**companions, key: value}.items():
                if merged.get(k, v) != v:
                    ok = False
                merged[k] = v
        if ok and all(merged[k] == v for k, (v, _) in zip(keys, combo)):
            yield merged


def build(overrides: dict[str, Any]):
    return looplm.load_recipe("quickstart", {**BASE, **overrides})


def holds(cond, setting: dict[str, Any]) -> bool:
    """The condition on the recipe dict as written (defaults for what it leaves out), valid or not."""
    data = _plain({**BASE, **setting})
    defaults = looplm.recipe.config.Recipe().to_dict()
    return cond.test(*(data.get(k.split(".")[0], {}).get(k.split(".")[1], defaults[k.split(".")[0]][k.split(".")[1]])
                       for k in cond.keys))


def test_every_deciding_field_has_witnesses():
    sections = section_classes()
    for key, f, _ in ruled_fields():
        for cond in f.metadata["applies"]:
            for k in cond.keys:
                section, name = k.split(".")
                assert name in {g.name for g in dataclasses.fields(sections[section])}, f"{key}: {k} is no field"
                assert k in WITNESSES, f"{key}'s rule reads {k}: add its values to WITNESSES"


@pytest.mark.parametrize("key", [k for k, _, _ in ruled_fields()])
def test_field_applies_or_is_refused(key):
    _, f, tp = next(r for r in ruled_fields() if r[0] == key)
    conds = f.metadata["applies"]
    keys = tuple(dict.fromkeys(k for c in conds for k in c.keys))
    valid = [(setting, [holds(c, setting) for c in conds]) for setting in settings(keys)]
    # where every condition holds (in a valid recipe), some non-default value is accepted and kept
    value = None
    for (setting, h), v in itertools.product(valid, candidates(f, tp)):
        if not all(h):
            continue
        own = dict(next((c for w, c in WITNESSES.get(key, []) if w == v), {}))   # what the value itself needs
        try:
            got = build({**setting, **own, key: v}).to_dict()[key.split(".")[0]][f.name]
        except UserError:
            continue
        assert got == v, f"{key} = {v!r} was accepted but the recipe holds {got!r}"
        value = v
        break
    assert value is not None, f"{key}: no non-default value accepted where it applies"
    # where exactly one condition fails, the same value is refused, naming the field and the decider
    for i, cond in enumerate(conds):
        setting = next((s for s, h in valid if not h[i] and all(h[:i] + h[i + 1:])), None)
        assert setting is not None, f"{key}: no witness setting where only '{cond.text}' fails"
        data = {**BASE, **setting, key: value}
        with pytest.raises(UserError):
            build({**setting, key: value})
        found = [item for item in inapplicable(_plain(data)) if item.key == key]
        assert found and set(found[0].deciding) == set(cond.keys), (key, setting, found)
        assert key in f"{found[0].key}: {found[0].message}" and all(k in found[0].message for k in cond.keys)


def _plain(overrides: dict[str, Any]) -> dict[str, Any]:
    """The quickstart recipe dict with dotted overrides applied (no validation)."""
    from looplm.recipe.config import apply_overrides, read_recipe_dict
    return apply_overrides(read_recipe_dict("quickstart"), overrides)


# --- the combinations the issue tried, through the real command line ---------------------------------
ISSUE = [
    (["exit.gate=true", "exit.policy=quantile:0.5"], "exit.gate", "supervision.kind"),
    (["supervision.rounds=[1,2]"], "supervision.rounds", "supervision.kind"),
    (["supervision.weights=[1.0]"], "supervision.weights", "supervision.kind"),
    (["optim.decay_fraction=0.3"], "optim.decay_fraction", "optim.schedule"),
    (["depth.kind=uniform", "depth.mean=6"], "depth.mean", "depth.kind"),
    (["depth.kind=fixed", "depth.rounds=4", "depth.sigma=0.2"], "depth.sigma", "depth.kind"),
    (["model.init_state=zeros", "model.init_state_std=0.5"], "model.init_state_std", "model.init_state"),
    (["supervision.entropy_beta=0.1"], "supervision.entropy_beta", "supervision.kind"),
    (["supervision.prior=uniform"], "supervision.prior", "supervision.kind"),
    (["train.stage2_k=10"], "train.stage2_k", "train.stage"),
    (["data.task=chain", "data.path=corpus"], "data.path", "data.task"),
]


@pytest.mark.parametrize("sets,field,decider", ISSUE)
def test_train_refuses_inapplicable_fields(sets, field, decider, tmp_path, capsys):
    args = [a for s in [*sets, "train.steps=1"] for a in ("--set", s)]   # one step, were it accepted
    assert main(["train", "--out", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and decider in err[0]
    assert not (tmp_path / "run").exists()


def test_a_recipe_value_an_override_makes_inapplicable_goes_back_to_its_default(caplog):
    # quickstart sets depth.mean = 3; switching to fixed depth leaves nothing to read it
    recipe = looplm.load_recipe("quickstart", {"depth.kind": "fixed"})
    assert recipe.depth.mean == 4.0 and "depth.mean" in caplog.text and "reset to its default" in caplog.text
    # ... but the same field given as an override is refused
    with pytest.raises(UserError, match="depth.mean.*depth.kind"):
        looplm.load_recipe("quickstart", {"depth.kind": "fixed", "depth.mean": 3.0})


def test_learned_exit_needs_a_round_before_the_last():
    # the last round's exit is forced: at one round no hazard reaches the loss, and the gate never trains
    with pytest.raises(UserError, match="exit.gate"):
        tiny_recipe(**{"depth.rounds": 1, "supervision.kind": "learned_exit", "exit.gate": True})
    assert tiny_recipe(**{"depth.rounds": 2, "supervision.kind": "learned_exit", "exit.gate": True}).exit.gate


def test_the_gate_line_comes_from_the_gradient_the_gate_received(tmp_path, monkeypatch, text_dir):
    from looplm.model.looped import LoopedLM
    from looplm.train.trainer import train
    gated = {"supervision.kind": "learned_exit", "exit.gate": True, "train.steps": 3, "train.eval_batches": 1,
             "data.path": str(text_dir)}
    report = train(tiny_recipe(**gated), tmp_path / "a", quiet=True)
    assert report["exit_gate"]["steps_with_gradient"] == 3 == report["exit_gate"]["steps"]
    assert "received a nonzero gradient in 3 of 3" in (tmp_path / "a" / "report.md").read_text()
    # a gate whose hazards are cut from autograd never trains, and the card says so
    real = LoopedLM.hazard
    monkeypatch.setattr(LoopedLM, "hazard", lambda self, s: real(self, s).detach())
    report = train(tiny_recipe(**gated), tmp_path / "b", quiet=True)
    assert report["exit_gate"]["steps_with_gradient"] == 0
    assert "NEVER TRAINED" in (tmp_path / "b" / "report.md").read_text()


# ---------------------------------------------------------------------------------------
# Fields one command reads and another does not: refused where given, reset (with a note) where a recipe
# file carries them, never accepted and ignored.

def test_experiment_only_fields_are_refused_by_train_and_reset_from_a_recipe(tmp_path, capsys, caplog):
    from looplm.recipe.config import EXPERIMENT_ONLY, single_run_recipe
    for key, value in (("data.baselines", "[]"), ("data.probe_examples", "0")):
        code, _, err = _cli(capsys, "train", "--out", tmp_path / "r", "--set", f"{key}={value}",
                            "--set", "data.task=chain")
        assert code == 2 and len(err.strip().splitlines()) == 1 and key in err and "experiment" in err
        assert not (tmp_path / "r").exists()
    # the built-in extrapolate recipe sets them (here probe_examples too, as a recipe file may): `looplm train`
    # runs it with both at their defaults, saying so
    rec = looplm.load_recipe("extrapolate", overrides={"data.probe_examples": 50})
    default = looplm.load_recipe("quickstart", overrides={"data.task": "chain"})
    assert rec.data.baselines != default.data.baselines and rec.data.probe_examples != default.data.probe_examples
    with caplog.at_level("WARNING"):
        single = single_run_recipe(rec, {})
    assert (single.data.baselines, single.data.probe_examples) == (default.data.baselines, default.data.probe_examples)
    assert all(any(k in m and "reset to its default" in m for m in caplog.messages) for k in EXPERIMENT_ONLY)
    assert dataclasses.replace(single, data=rec.data) == rec          # nothing else changed


def test_eval_batches_is_refused_on_a_task_run():
    with pytest.raises(UserError, match="train.eval_batches"):
        looplm.load_recipe("quickstart", overrides={"data.task": "chain", "train.eval_batches": 3})
    assert looplm.load_recipe("quickstart", overrides={"train.eval_batches": 3}).train.eval_batches == 3


def test_data_prepare_refuses_fields_it_never_reads(tmp_path, text_dir, capsys):
    code, _, err = _cli(capsys, "data", "prepare", text_dir, "--out", tmp_path / "p", "--set", "model.d_model=64")
    assert code == 2 and "model.d_model" in err and "data.val_fraction" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()
    code, _, _ = _cli(capsys, "data", "prepare", text_dir, "--out", tmp_path / "q", "--quiet",
                      "--set", "data.val_fraction=0.3")
    assert code == 0 and json.loads((tmp_path / "q" / "manifest.json").read_text())["val_fraction"] == 0.3


def test_lm_eval_refuses_max_batch_size(tiny_run):
    pytest.importorskip("lm_eval")
    from looplm.lm_eval import LoopLM
    with pytest.raises(UserError, match="max_batch_size"):
        LoopLM.create_from_arg_string(f"run={tiny_run},max_batch_size=8")
    with pytest.raises(UserError, match="max_batch_size"):            # lm-eval's own --max_batch_size 8
        LoopLM.create_from_arg_obj({"run": str(tiny_run)}, {"batch_size": 1, "max_batch_size": 8, "device": "cpu"})
    assert LoopLM.create_from_arg_obj({"run": str(tiny_run)}, {"batch_size": 2, "max_batch_size": None}).batch_size == 2


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err
