"""`looplm check`: passes on a healthy run, each check fails when its own property is broken, and a
check that does not apply says so instead of passing."""

import copy
import json
import types

import pytest
import torch
import torch.nn.functional as F

import looplm
import looplm.model.looped as model_mod
from looplm.runs.checkpoint import Run
from looplm.checks import (STATE_GROWTH_LIMIT, check_backward_window, check_backward_window_measured, check_causality,
                           check_exit_masses, check_state_stability, check_token_accounting, check_untied_parity,
                           measured_grad_rounds)
from looplm.cli import main
from looplm.model.looped import build_model
from looplm.train.trainer import train

from conftest import tiny_recipe

NOT_APPLICABLE_WITHOUT_FEEDBACK = {"feedback_shift_by_one", "feedback_start_convention",
                                   "feedback_pass_loss_composition", "feedback_request_isolation",
                                   "feedback_batch_reorder"}
NOT_APPLICABLE_WITHOUT_GATE = {"exit_masses_conserved", "quantile_exit_matches_cumulative_mass",
                               "routed_decode_matches_training", "task_above_chance", *NOT_APPLICABLE_WITHOUT_FEEDBACK}
RECORD_CHECKS = {"round_telemetry_present"}  # every other check that runs measures
NOT_APPLICABLE_UNTIED = {"exit_masses_conserved", "looped_equals_untied_copies", "state_stable_past_training_depth",
                         "quantile_exit_matches_cumulative_mass", "routed_decode_matches_training", "task_above_chance",
                         *NOT_APPLICABLE_WITHOUT_FEEDBACK}


def make_run(tmp_path, text_dir, name="run", **overrides):
    from looplm.recipe.config import derive_recipe
    base = tiny_recipe(**{"data.path": str(text_dir), "depth.kind": "uniform", "depth.min": 1, "depth.max": 3,
                          "depth.rounds": 2, "backward.window": 2})
    rec = derive_recipe(base.to_dict(), overrides)     # an override of depth.kind resets depth.min/max
    train(rec, tmp_path / name, quiet=True)
    return tmp_path / name


def untrained_run(**overrides) -> Run:
    """A Run around a freshly built model (no training, no report): enough for the checks that measure."""
    rec = tiny_recipe(**overrides)
    return Run(path=None, recipe=rec, model=build_model(rec).eval(),
               tokenizer=types.SimpleNamespace(vocab_size=rec.model.vocab_size), report={})


def json_checks(capsys, path):
    capsys.readouterr()
    code = main(["check", str(path), "--json"])
    out = capsys.readouterr().out
    return code, out, {c["name"]: c for c in json.loads(out)["checks"]}


def test_checks_pass_on_a_trained_run(tmp_path, text_dir, capsys):
    path = make_run(tmp_path, text_dir)
    code, raw, checks = json_checks(capsys, path)
    assert code == 0
    assert set(checks) >= {"causality", "shared_parameters_once", "looped_equals_untied_copies",
                           "state_stable_past_training_depth", "backward_window_measured", "backward_window_recorded"}
    for name, c in checks.items():
        if name in NOT_APPLICABLE_WITHOUT_GATE:          # no exit gate: said so, not counted as passed
            assert c["status"] == "not applicable" and c["passed"] is None, c
        else:
            assert c["status"] == "pass" and c["passed"] is True, c
    assert '"passed": null' in raw                        # JSON null, not false or a string
    for name, c in checks.items():                        # every row says how it knows
        assert c["kind"] == ("not_applicable" if c["passed"] is None else
                             "record" if name in RECORD_CHECKS else "measured"), c
    for name in ("tokens_vs_token_passes", "backward_window_recorded"):
        assert checks[name]["kind"] == "measured", checks[name]
    na = len(NOT_APPLICABLE_WITHOUT_GATE)
    assert json.loads(raw)["summary"] == {"passed": len(checks) - na, "failed": 0, "not_applicable": na}
    assert main(["check", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines if "exit_masses_conserved" in ln] == ["N/A"]
    assert any(ln.startswith("PASS  tokens_vs_token_passes [measured]: ") for ln in lines)
    assert any(ln.startswith("PASS  round_telemetry_present [record]: ") for ln in lines)
    assert lines[-1] == f"{len(checks) - na} passed, 0 failed, {na} not applicable"


def test_untied_baseline_says_not_applicable(tmp_path, text_dir, capsys):
    path = make_run(tmp_path, text_dir, **{"model.untied": True, "depth.kind": "fixed", "depth.rounds": 2})
    code, _, checks = json_checks(capsys, path)
    assert code == 0                                       # nothing failed; N/A rows do not fail the run
    assert {n for n, c in checks.items() if c["status"] == "not applicable"} == NOT_APPLICABLE_UNTIED
    assert all(c["passed"] is None for n, c in checks.items() if n in NOT_APPLICABLE_UNTIED)
    assert all(c["passed"] is True for n, c in checks.items() if n not in NOT_APPLICABLE_UNTIED)


def _break_weight_sharing(model, monkeypatch):
    """Rounds >= 2 use a perturbed copy of core block 0: the looped model no longer applies one set of
    tensors every round (the copy is not in the state dict the untied comparison is built from)."""
    stray = copy.deepcopy(model.core[0])
    with torch.no_grad():
        stray.mlp.down.weight.add_(0.05 * torch.randn_like(stray.mlp.down.weight))
    shared_step = type(model).core_step

    def unshared_step(s, e, r, rope, cache=None, e_term=None):
        if r < 2:
            return shared_step(model, s, e, r, rope, cache, e_term=e_term)
        shared = model.core[0]
        model.core[0] = stray
        try:
            return shared_step(model, s, e, r, rope, cache, e_term=e_term)
        finally:
            model.core[0] = shared

    monkeypatch.setattr(model, "core_step", unshared_step, raising=False)


def _leak_gradient_past_the_window(monkeypatch):
    """The engine back-propagates through every round but still records only the window's rounds."""
    real = model_mod.unroll

    def leaky(step, state, rounds, backward_window=None, *args, **kw):
        out = real(step, state, rounds, None, *args, **kw)
        if backward_window is not None:
            out.grad_rounds = tuple(r for r in out.grad_rounds if r > rounds - backward_window)
        return out

    monkeypatch.setattr(model_mod, "unroll", leaky)


def test_checks_fail_when_broken(tmp_path, text_dir, monkeypatch, capsys):
    path = make_run(tmp_path, text_dir)
    run = looplm.load_run(path)

    # the record: more gradient-visible rounds than autograd reaches under the window of 2
    assert check_backward_window(run).passed
    recorded = run.report["backward_histogram"]
    run.report["backward_histogram"] = {"3": 6}
    assert check_backward_window(run).status == "fail"
    run.report["backward_histogram"] = recorded

    # token accounting: a record one micro-batch off the replayed data, or with another depth
    assert check_token_accounting(run).passed
    good, one = dict(run.report), 4 * 32                # one micro-batch: batch 4 x seq_len 32, no padding
    depth3 = {**good["depth_histogram"], "3": good["depth_histogram"]["3"] - 1}
    depth3["2"] = depth3.get("2", 0) + 1
    for broken in ({"token_passes": good["token_passes"] - 3 * one}, {"tokens_seen": good["tokens_seen"] + one},
                   {"depth_histogram": depth3}, {"unique_tokens": good["unique_tokens"] + 1}):
        run.report.update(broken)
        result = check_token_accounting(run)
        assert result.status == "fail", (broken, result.detail)
        run.report.update(good)

    # causality: attention that sees the future
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, is_causal=False, **kw: sdpa(q, k, v, is_causal=False, **kw))
    assert check_causality(run).status == "fail"
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    assert check_causality(run).passed

    # weight sharing: round 2 runs a different tensor than round 1
    assert check_untied_parity(run).passed
    with monkeypatch.context() as m:
        _break_weight_sharing(run.model, m)
        parity = check_untied_parity(run)
        assert parity.status == "fail", parity.detail
    assert check_untied_parity(run).passed

    # compute: a counter that forgets one product of every block visit
    from looplm.checks import check_flops_count_every_visit
    from looplm.model import flops as flops_mod
    assert check_flops_count_every_visit(run).passed
    with monkeypatch.context() as m:
        real = flops_mod.block_matmul_params
        m.setattr(flops_mod, "block_matmul_params", lambda cfg, core=False: real(cfg, core) - cfg.d_model * cfg.ffn_hidden)
        assert check_flops_count_every_visit(run).status == "fail"

    # the engine: a request that leaves state behind for the next one
    from looplm.checks import check_engine_request_reset, check_round_telemetry
    from looplm.inference import engine as engine_mod
    assert check_engine_request_reset(run).passed
    with monkeypatch.context() as m:
        real_noise = engine_mod.Engine.initial_noise
        drawn = {"n": 0}

        def carried(self, plist, ref):     # initial states drawn from a stream that runs on across requests
            drawn["n"] += 1
            table = real_noise(self, plist, ref)
            return None if table is None else table + 0.5 * drawn["n"]
        m.setattr(engine_mod.Engine, "initial_noise", carried)
        broken = check_engine_request_reset(run)
        assert broken.status == "fail", broken.detail

    # dependency: a round that ignores the injected input the recipe says it reads
    from looplm.checks import check_start_state, check_state_dependency
    assert check_state_dependency(run).passed
    with monkeypatch.context() as m:
        m.setattr(run.model, "inject", lambda s, e, ops=None, e_term=None: s, raising=False)
        assert check_state_dependency(run).status == "fail"

    # start state: evaluation that draws fresh noise each call
    assert check_start_state(run).passed
    with monkeypatch.context() as m:
        real_init = type(run.model).initial_state
        m.setattr(run.model, "initial_state", lambda e, generator=None, *a, **k: real_init(
            run.model, e, generator if generator is not None else torch.Generator().manual_seed(
                int(torch.randint(0, 10**6, ())))), raising=False)
        assert check_start_state(run).status == "fail"

    # caches: a cached decoder that computes another function than the forward pass
    from looplm.checks import check_cache_policies
    assert check_cache_policies(run).passed
    with monkeypatch.context() as m:
        real_chunk = engine_mod.Engine.run_chunk

        def skewed(self, *args, **kwargs):
            logits, used = real_chunk(self, *args, **kwargs)
            return logits + torch.linspace(0, 1, logits.shape[-1], device=logits.device), used
        m.setattr(engine_mod.Engine, "run_chunk", skewed)
        assert check_cache_policies(run).status == "fail"

    # telemetry: a logged step without per-round RMS, or a gradient RMS before the window
    assert check_round_telemetry(run).passed
    metrics = run.path / "metrics.jsonl"
    good = metrics.read_text()
    rows = [json.loads(line) for line in good.splitlines()]
    rows[0]["grad_rms"][0] = 0.5 if rows[0]["grad_rms"][0] is None else None
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert check_round_telemetry(run).status == "fail"
    metrics.write_text(good)

    # the backward window: autograd reaches rounds the record leaves out
    assert check_backward_window_measured(run).passed
    with monkeypatch.context() as m:
        _leak_gradient_past_the_window(m)
        window = check_backward_window_measured(run)
        assert window.status == "fail", window.detail
        assert "R=3: measured [1, 2, 3], recorded [2, 3]" in window.detail
        # ... and so the backward_histogram (the window's 2 rounds at R=3) is not what autograd implies
        recorded = check_backward_window(run)
        assert recorded.status == "fail" and "R=3: [1, 2, 3]" in recorded.detail, recorded.detail

    run.report["backward_histogram"] = {"3": 6}                 # the one failure the CLI reports

    (path / "report.json").write_text(json.dumps({**run.report}))
    capsys.readouterr()
    assert main(["check", str(path)]) == 1
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"1 failed, {len(NOT_APPLICABLE_WITHOUT_GATE)} not applicable")


def _state_rms_by_hand(model, idx, rounds):
    """The loop written out round by round (not through the engine): RMS of the state after each round."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        rope = model.rope(0, idx.shape[1])
        e = model.encode(idx, rope)
        s = model.initial_state(e, gen)
        rms = []
        for r in range(1, rounds + 1):
            s = model.core_step(s, e, r, rope)
            rms.append(s.pow(2).mean().sqrt().item())
    return rms


def _scale_core(model, factor):
    with torch.no_grad():
        for p in model.core.parameters():
            if p.dim() == 2:
                p.mul_(factor)


def test_state_growth_past_trained_depth_fails():
    run = untrained_run(**{"depth.rounds": 4, "model.injection": "add"})    # s + e: e enters once more each round
    _scale_core(run.model, 30.0)
    rms = _state_rms_by_hand(run.model, torch.randint(0, 256, (2, 24)), 8)
    assert rms[-1] / rms[3] > STATE_GROWTH_LIMIT          # the constructed model really grows (about 2x)
    assert all(torch.isfinite(torch.tensor(rms)))        # ... while staying finite: the old check passed it
    result = check_state_stability(run)
    assert result.status == "fail", result.detail
    assert f"limit {STATE_GROWTH_LIMIT}x" in result.detail


@pytest.mark.parametrize("bound", [{"model.state_norm": True, "model.injection": "add"},
                                   {"model.injection": "decay"}])
def test_state_growth_check_passes_a_bounded_state(bound):
    run = untrained_run(**{"depth.rounds": 4, **bound})
    _scale_core(run.model, 30.0)          # same weights' scale; the state norm or the carry below 1 holds it
    rms = _state_rms_by_hand(run.model, torch.randint(0, 256, (2, 24)), 8)
    assert rms[-1] / rms[3] <= STATE_GROWTH_LIMIT
    result = check_state_stability(run)
    assert result.status == "pass", result.detail


def test_backward_window_with_a_readout_before_the_window():
    """Supervision on rounds 1 and 4, window 2 of 4: the round-1 readout trains only the coda and head,
    so autograd must reach rounds 3 and 4 and nothing else (the model once sent it into round 1 too)."""
    run = untrained_run(**{"supervision.kind": "rounds", "supervision.rounds": (1, 4), "backward.window": 2,
                           "depth.kind": "fixed", "depth.rounds": 4})
    x = torch.randint(0, run.recipe.model.vocab_size, (2, 17))
    assert measured_grad_rounds(run.model, run.recipe, x, 4) == ((3, 4), (3, 4))
    result = check_backward_window_measured(run)
    assert result.status == "pass", result.detail


def test_measured_grad_rounds_follow_the_window():
    """Final-round supervision: the measured rounds are the last min(window, R), hand-listed."""
    run = untrained_run(**{"backward.window": 2, "depth.rounds": 4})
    x = torch.randint(0, run.recipe.model.vocab_size, (2, 17))
    assert measured_grad_rounds(run.model, run.recipe, x, 4)[0] == (3, 4)
    assert measured_grad_rounds(run.model, run.recipe, x, 1)[0] == (1,)
    full = untrained_run(**{"backward.window": "all", "depth.rounds": 3})
    assert measured_grad_rounds(full.model, full.recipe, x, 3)[0] == (1, 2, 3)
    # a loss on round 3 only: round 4 is in the window and in the graph, but no loss reads it
    third = untrained_run(**{"backward.window": 2, "depth.rounds": 4, "supervision.kind": "rounds",
                             "supervision.rounds": (3,)})
    assert measured_grad_rounds(third.model, third.recipe, x, 4)[0] == (3,)


def test_quantile_exit_check_catches_a_controller_off_its_threshold(monkeypatch):
    """Measured on an untrained gated model: the controller's decisions against the cumulative mass
    recomputed from the recorded hazards; a controller that stops at another quantile fails."""
    import dataclasses

    import looplm.inference.early_exit as ee
    from looplm.checks import check_quantile_thresholds
    run = untrained_run(**{"exit.gate": True, "supervision.kind": "learned_exit", "depth.kind": "fixed",
                           "depth.rounds": 4, "model.context": 32, "model.injection": "add"})
    with torch.no_grad():                      # hazards spread over rounds, so exits differ by token
        for p in run.model.gate.parameters():
            p.normal_(0, 2.0)
    assert check_quantile_thresholds(run).passed
    real = ee.ExitController

    class OffThreshold(real):
        def __init__(self, policy, *args, **kwargs):
            super().__init__(dataclasses.replace(policy, value=min(1.0, policy.value + 0.3)), *args, **kwargs)
    monkeypatch.setattr(ee, "ExitController", OffThreshold)
    broken = check_quantile_thresholds(run)
    assert broken.status == "fail", broken.detail
    assert check_quantile_thresholds(untrained_run()).status == "not applicable"


def test_token_accounting_replays_a_resumed_task_run(tmp_path):
    """Ragged task rows (padding in every batch), depths by difficulty, two micro-batches a step, stopped
    and resumed: the replay counts what the trainer counts, padding left out; a report counting it fails."""
    from looplm.data.taskdata import TaskSampler, TaskSource
    rows = [{"prompt": "a" * n, "answer": "x" * (1 + n % 3), "difficulty": 1 + n % 2} for n in range(1, 25)]
    data = tmp_path / "ragged.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = looplm.load_recipe("quickstart", overrides={
        "model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2, "model.context": 128, "model.n_prelude": 1,
        "model.n_core": 1, "model.n_coda": 0, "depth.kind": "uniform", "depth.min": 1, "depth.max": 3,
        "depth.rounds": 2, "data.task": str(data), "data.depth_by_difficulty": True, "train.batch_size": 4,
        "train.grad_accum": 2, "train.steps": 4, "train.checkpoint_every": 2, "train.log_every": 2,
        "optim.warmup_steps": 2})
    train(rec, tmp_path / "run", quiet=True, stop_after=2)
    train(rec, tmp_path / "run", quiet=True, resume=True)
    run = looplm.load_run(tmp_path / "run")
    result = check_token_accounting(run)
    assert result.status == "pass" and result.kind == "measured", result.detail
    # what counting the padding gives: the batches as the model ran them, B x T each
    sampler = TaskSampler(TaskSource(run.recipe), run.tokenizer, run.recipe)
    batches = [sampler.batch(i) for i in range(4 * 2)]
    padded = {"tokens_seen": sum(x.numel() for x, _, _ in batches),
              "token_passes": sum(x.numel() * opts["rounds"] for x, _, opts in batches)}
    assert padded["token_passes"] > run.report["token_passes"]        # the batches really are padded
    run.report.update(padded)
    broken = check_token_accounting(run)
    assert broken.status == "fail" and "counts the padding" in broken.detail, broken.detail


def test_exit_masses_against_the_hand_recurrence(monkeypatch):
    """The library's masses against the recurrence written out by hand; conversions that still sum to 1
    and stay non-negative (the old identity check passed them) but are wrong must fail."""
    import looplm.halting as halting
    run = untrained_run(**{"exit.gate": True, "supervision.kind": "learned_exit", "depth.kind": "fixed",
                           "depth.rounds": 4})
    with torch.no_grad():                      # hazards spread over (0, 1), not all near 0.5
        for p in run.model.gate.parameters():
            p.normal_(0, 2.0)
    result = check_exit_masses(run)
    assert result.status == "pass" and result.kind == "measured", result.detail
    real = halting.hazards_to_masses

    def own_hazard_last(h):                    # the last round exits by its own hazard, renormalised
        m = real(h).clone()
        m[..., -1] *= h[..., -1]
        return m / m.sum(-1, keepdim=True)

    def survival_after(h):                     # mass_r = h_r x S_r (its own round's survival too)
        early = (h * torch.cumprod(1 - h, -1))[..., :-1]
        return torch.cat([early, 1 - early.sum(-1, keepdim=True)], -1)
    for wrong in (lambda h: h / h.sum(-1, keepdim=True), own_hazard_last, survival_after):
        monkeypatch.setattr(halting, "hazards_to_masses", wrong)
        h = run.model(torch.randint(0, 256, (2, 16)), 4).hazards
        assert torch.allclose(wrong(h).sum(-1), torch.ones(())) and (wrong(h) >= 0).all()
        broken = check_exit_masses(run)
        assert broken.status == "fail", broken.detail


def test_a_task_run_at_chance_fails_the_chance_check_and_a_perfect_one_passes(monkeypatch):
    """task_above_chance: an untrained task model guesses (fails, saying it learned nothing); the same model with
    its evaluation replaced by perfect answers passes; a language-model run: not applicable."""
    from looplm.checks.tasks import check_task_above_chance
    from looplm.data.tokenizer import ByteTokenizer
    import looplm.evaluation.tasks as tasks_mod
    rec = tiny_recipe(**{"data.task": "chain", "data.difficulty_max": 2, "data.eval_examples": 60})
    torch.manual_seed(0)
    run = Run(path=None, recipe=rec, model=build_model(rec).eval(), tokenizer=ByteTokenizer(), report={})
    got = check_task_above_chance(run)
    assert got.passed is False and "LEARNED NOTHING MEASURABLE" in got.detail and got.kind == "measured"
    real = tasks_mod.score_task_sets

    def perfect(model, tok, sets, rounds, **k):
        out = real(model, tok, sets, rounds, **k)
        return {**out, "by_difficulty": {d: {r: {"accuracy": 1.0, "loss": 0.0} for r in rounds} for d in sets}}
    monkeypatch.setattr(tasks_mod, "score_task_sets", perfect)
    assert check_task_above_chance(run).passed is True
    assert check_task_above_chance(untrained_run()).passed is None
