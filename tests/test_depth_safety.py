"""Depth safety as recipe options, each against a hand computation of its term:

- supervision.fixed_point: the trainer's loss is the readout's cross-entropy plus lambda x the relative state
  change of the last k rounds, computed here from a hand-unrolled loop; its gradient is exactly lambda x the
  hand term's gradient; the final round counts as gradient-visible even when no readout is there; the report
  counts the micro-batches that carried the term;
- depth.kind = "geometric" (stochastic stopping): the drawn depths follow the capped geometric law (a chi-square
  test on the deterministic draws) and expected_depth is its exact mean;
- model.state_norm: the state's RMS stays 1 at every round up to 4x the trained depth;
- evaluate_rounds(states=True): state RMS and relative change against the hand-unrolled states;
- `looplm experiment depth`: the goal line from a constructed profile, the quick run end to end, refusals.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import looplm
from looplm.cli import main
from looplm.evaluation.rounds import evaluate_rounds
from looplm.experiments.depth import GOAL_GAP, summarise
from looplm.model.losses import fixed_point_term
from looplm.recipe.config import DepthConfig
from looplm.train.depth import expected_depth, sample_depth
from looplm.train.trainer import Counters, train, train_step

from conftest import tiny_recipe

R = 4
LAMBDA = 0.7
K = 2


def _model_and_batch(**overrides):
    torch.manual_seed(0)
    rec = tiny_recipe(**{"depth.rounds": R, "model.init_state": "prelude", "model.init_std": 0.2, **overrides})
    model = looplm.build_model(rec).train()
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 257, (2, 12), generator=g)
    y = torch.randint(0, 257, (2, 12), generator=g)
    return rec, model, x, y


def _hand_states(model, x, rounds):
    """(states s_0..s_R, logits at R) by unrolling the core by hand (no unroll(), no forward())."""
    rope, e, s = model.loop_inputs(x)
    states = [s]
    for r in range(1, rounds + 1):
        s = model.core_step(s, e, r, rope)
        states.append(s)
    return states, model.readout(states[-1], rope)


def _hand_term(states, k):
    """mean over rounds r in max(2, R-k+1)..R and positions of ||s_r - s_(r-1)||^2 / (||s_(r-1)||^2 + 1e-6 d)."""
    rounds = len(states) - 1
    per_round = []
    for r in range(max(2, rounds - k + 1), rounds + 1):
        cur, prev = states[r], states[r - 1]
        num = ((cur - prev) ** 2).sum(-1)
        den = (prev ** 2).sum(-1) + 1e-6 * cur.shape[-1]
        per_round.append(num / den)
    return sum(per_round) / len(per_round) if per_round else None


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fixed_point_loss_and_gradient_match_a_hand_unrolled_loop():
    rec, model, x, y = _model_and_batch(**{"supervision.fixed_point": LAMBDA, "supervision.fixed_point_rounds": K})
    loss, out, info = train_step(model, rec, x, y, 0, 0, Counters(), rounds=R)
    with_term = _grads(model)
    model.zero_grad()
    states, logits = _hand_states(model, x, R)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    term = _hand_term(states, K).mean()
    assert term.item() > 1e-4                                          # a real change to penalise
    assert info["fixed_point_term"] == pytest.approx(term.item(), rel=1e-5)
    assert loss == pytest.approx(ce.item() + LAMBDA * term.item(), rel=1e-5)
    # the gradient with the term minus the plain recipe's gradient is lambda x the hand term's gradient
    plain = tiny_recipe(**{"depth.rounds": R, "model.init_state": "prelude", "model.init_std": 0.2})
    train_step(model, plain, x, y, 0, 0, Counters(), rounds=R)
    without = _grads(model)
    model.zero_grad()
    (LAMBDA * term).backward()
    hand = _grads(model)
    core = [n for n in hand if n.startswith("core.")]
    assert core and any(hand[n].abs().max() > 0 for n in core)
    eps = torch.finfo(torch.float32).eps
    for n in core:
        # with - without cancels two float32 gradients of size |without|: their rounding (a few eps x that
        # size, in whatever order this CPU sums) is the floor, far below the term's own gradient
        floor = 64 * eps * float(without[n].abs().max())
        assert floor < 0.01 * float(hand[n].abs().max())                 # the comparison still bites
        torch.testing.assert_close(with_term[n] - without[n], hand[n], rtol=1e-4, atol=floor)


def test_fixed_point_term_function_rounds_and_masks():
    g = torch.Generator().manual_seed(1)
    states = [torch.randn(2, 5, 8, generator=g) for _ in range(5)]      # s_1..s_5
    hand = _hand_term([torch.zeros(2, 5, 8)] + states, 3)                # rounds 3, 4, 5 of s_1..s_5
    assert fixed_point_term(states, 3).item() == pytest.approx(hand.mean().item(), rel=1e-6)
    # k larger than the rounds: from round 2 on, never round 1 (whose change is from the initial state)
    zero = torch.zeros(2, 5, 8)                                         # s_0: never read
    assert fixed_point_term(states, 10).item() == pytest.approx(_hand_term([zero] + states, 10).mean().item(), rel=1e-6)
    assert fixed_point_term(states[:1], 2) is None                       # one round: no change to read
    valid = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    masked = fixed_point_term(states, 1, valid)
    per = ((states[4] - states[3]) ** 2).sum(-1) / ((states[3] ** 2).sum(-1) + 8e-6)
    assert masked.item() == pytest.approx(per[valid].mean().item(), rel=1e-6)


def test_decay_carry_is_recorded_as_training_left_it(tmp_path):
    """report.json's depth_safety.carry: the carries of the saved weights (not the start, which is the recipe's
    and stays in report.json's recipe), and the card says them."""
    rec = tiny_recipe(**{"model.injection": "decay", "model.injection_decay_init": 0.6, "optim.lr": 0.05,
                         "train.steps": 4})
    train(rec, tmp_path / "run", quiet=True)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    a = looplm.load_run(tmp_path / "run").model.carry()
    carry = report["depth_safety"]["carry"]
    assert set(carry) == {"min", "mean", "max"} and not torch.allclose(a, torch.full_like(a, 0.6))   # training moved them
    assert carry["min"] == pytest.approx(a.min().item()) and carry["max"] == pytest.approx(a.max().item())
    assert carry["mean"] == pytest.approx(a.mean().item())
    card = (tmp_path / "run" / "report.md").read_text()
    assert f"mean {carry['mean']:.3f}" in card and "the recipe started it at 0.6" in card
    plain = tiny_recipe(**{"model.injection": "add", "train.steps": 1})
    train(plain, tmp_path / "add", quiet=True)
    assert "carry" not in json.loads((tmp_path / "add" / "report.json").read_text())["depth_safety"]


def test_fixed_point_reaches_the_final_round_and_is_recorded(tmp_path):
    from conftest import write_corpus
    rec, model, x, y = _model_and_batch(**{"supervision.kind": "rounds", "supervision.rounds": [1],
                                           "supervision.fixed_point": LAMBDA})
    _, out, _ = train_step(model, rec, x, y, 0, 0, Counters(), rounds=R)
    assert out.grad_rounds == tuple(range(1, R + 1))                   # the term reads s_(R-1), s_R
    # a sampled-depth run: the report counts the micro-batches whose depth was >= 2
    run = tmp_path / "run"
    train(tiny_recipe(**{"data.path": str(write_corpus(tmp_path / "c")), "depth.kind": "uniform",
                         "depth.min": 1, "depth.max": 3, "depth.rounds": 2, "train.steps": 8,
                         "train.log_every": 1, "supervision.fixed_point": LAMBDA}), run, quiet=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    recipe = looplm.load_run(run).recipe
    ran = [sample_depth(recipe.depth, recipe.train.seed, step) for step in range(recipe.train.steps)]   # the draws
    assert 1 in ran and max(ran) >= 2                                  # both kinds of step happened
    rep = json.loads((run / "report.json").read_text())
    fp = rep["depth_safety"]["fixed_point"]
    assert set(fp) == {"micro_batches", "mean_term"}                   # measured; the weight is the recipe's
    assert fp["micro_batches"] == sum(r >= 2 for r in ran)
    # the per-step term the mean is over is the one the loss carried (the test above: against a hand loop)
    assert fp["mean_term"] == pytest.approx(sum(r["fixed_point_term"] for r in rows if "fixed_point_term" in r)
                                            / fp["micro_batches"], rel=1e-6)
    assert "fixed_point_term" not in next(r for r in rows if r["rounds"][0] == 1)
    assert "fixed-point term" in (run / "report.md").read_text()


def _hand_profile(run, rounds):
    """{round: (state RMS, relative change)} of the saved model's loop states over the run's held-out batches,
    unrolled by hand (loop_inputs' e, core_step per round) in float64 sums, the random initial state drawn here
    as N(0, init_state_std^2) from a CPU generator seeded with the target tokens of the batches before."""
    from looplm.evaluation.rounds import eval_batches_for
    model = run.model.eval()
    top = max(rounds)
    sq = {r: [0.0, 0.0, 0.0] for r in rounds}            # sum s_r^2, sum (s_r - s_(r-1))^2, sum s_(r-1)^2
    count = elements = 0
    with torch.no_grad():
        for x, y in eval_batches_for(run):
            rope, e, _ = model.loop_inputs(x)
            s = torch.randn(e.shape, generator=torch.Generator().manual_seed(count)) * model.cfg.init_state_std
            for r in range(1, top + 1):
                prev, s = s, model.core_step(s, e, r, rope)
                if r in sq:
                    sq[r][0] += s.double().pow(2).sum().item()
                    sq[r][1] += (s.double() - prev.double()).pow(2).sum().item()
                    sq[r][2] += prev.double().pow(2).sum().item()
            count += y.numel()
            elements += e.numel()
    return {r: (math.sqrt(a / elements), math.sqrt(b / c)) for r, (a, b, c) in sq.items()}


def test_depth_safety_state_profile_is_what_the_final_weights_do_not_the_recipe(tmp_path):
    """report.json's depth_safety says what happened to the loop state, measured: its RMS and relative change per
    round on the held-out batches, equal to a hand-unrolled loop of the saved weights. With a state norm the
    recipe would say "RMS 1"; training moved the norm's weight, and the record says the RMS it produces."""
    rec = tiny_recipe(**{"model.state_norm": True, "optim.lr": 0.05, "train.steps": 4})
    assert rec.model.init_state == "random"                          # the initial noise is part of what is measured
    train(rec, tmp_path / "run", quiet=True)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    safety = report["depth_safety"]
    assert not {"state_norm", "depth_kind"} & set(safety)           # settings live in report["recipe"] only
    R = rec.depth.rounds
    rounds = sorted(set(range(1, 2 * R + 1)) | {1, 2, 4, 8})        # every depth read out: 1..2R and 1, 2, 4, 8
    assert list(safety["state_rms_by_rounds"]) == [str(r) for r in rounds]
    hand = _hand_profile(looplm.load_run(tmp_path / "run"), rounds)
    for r in rounds:
        assert safety["state_rms_by_rounds"][str(r)] == pytest.approx(hand[r][0], rel=1e-5), r
        assert safety["state_change_by_rounds"][str(r)] == pytest.approx(hand[r][1], rel=1e-4), r
    assert abs(safety["state_rms_by_rounds"][str(R)] - 1.0) > 1e-3    # not the norm's nominal scale: measured
    card = (tmp_path / "run" / "report.md").read_text()
    assert f"{R}: {safety['state_rms_by_rounds'][str(R)]:.4g}" in card


def test_geometric_depth_follows_the_capped_geometric_law():
    cfg = DepthConfig(kind="geometric", min=2, max=7, rounds=3, stop_prob=0.3)
    n = 20000
    counts = {r: 0 for r in range(2, 8)}
    for i in range(n):
        counts[sample_depth(cfg, 11, i)] += 1
    p = 0.3
    law = {r: (1 - p) ** (r - 2) * p for r in range(2, 7)}
    law[7] = (1 - p) ** 5                                               # the cap takes the rest
    chi2 = sum((counts[r] - n * law[r]) ** 2 / (n * law[r]) for r in law)
    assert chi2 < 20.5                                                  # chi-square, 5 dof, p = 0.001
    assert expected_depth(cfg) == pytest.approx(sum(r * q for r, q in law.items()), rel=1e-12)
    assert sum(r * c for r, c in counts.items()) / n == pytest.approx(expected_depth(cfg), abs=0.05)


def test_state_norm_keeps_the_state_at_unit_rms_and_profile_matches_hand_states():
    rec, model, x, _ = _model_and_batch(**{"model.state_norm": True})
    model.eval()
    y = torch.randint(0, 257, x.shape, generator=torch.Generator().manual_seed(2))
    prof = evaluate_rounds(model, [(x, y)], list(range(1, 4 * R + 1)), states=True)
    with torch.no_grad():
        states, _ = _hand_states(model, x, 4 * R)
    for r in range(1, 4 * R + 1):
        assert prof[r]["state_rms"] == pytest.approx(states[r].pow(2).mean().sqrt().item(), rel=1e-5)
        assert prof[r]["state_rms"] == pytest.approx(1.0, abs=1e-3)      # RMSNorm with unit weight
        change = (states[r] - states[r - 1]).norm() / states[r - 1].norm()
        assert prof[r]["state_change"] == pytest.approx(change.item(), rel=1e-5)
    rec, model, x, _ = _model_and_batch()
    model.eval()
    prof = evaluate_rounds(model, [(x, y)], [1, 2, 8], states=True)
    with torch.no_grad():
        states, _ = _hand_states(model, x, 8)
    assert prof[8]["state_rms"] == pytest.approx(states[8].pow(2).mean().sqrt().item(), rel=1e-5)
    assert abs(prof[8]["state_rms"] - 1.0) > 1e-2                      # without the norm it is not held at 1


def test_decay_injection_matches_its_closed_form_with_identity_blocks():
    """With every core block an identity (its output projections zeroed) a round is s_r = a * s_(r-1) + e,
    so s_r = a^r s_0 + e (1 - a^r) / (1 - a): bounded by |s_0| + |e| / (1 - a) at any depth, where additive
    injection's s_0 + r e grows without end. The forward's states and the gradient reaching theta against
    that closed form, evaluated in float64 from theta itself."""
    rec, model, x, _ = _model_and_batch(**{"model.injection": "decay", "model.injection_decay_init": 0.7})
    d = rec.model.d_model
    assert torch.allclose(model.carry(), torch.full((d,), 0.7))
    with torch.no_grad():
        for blk in model.core:
            blk.attn.o.weight.zero_()
            blk.mlp.down.weight.zero_()
        model.decay.copy_(torch.linspace(-2.0, 1.0, d))               # carries from 0.87 down to 0.07
    rounds = 4 * R
    out = model(x, rounds, collect_stats=True)
    _, e, s0 = model.loop_inputs(x)
    theta = model.decay.detach().double().requires_grad_(True)
    a = torch.exp(-torch.exp(theta))
    for r in range(1, rounds + 1):
        want = a ** r * s0.double() + e.double() * (1 - a ** r) / (1 - a)
        assert torch.allclose(out.round_states[r - 1].double(), want, rtol=1e-5, atol=1e-5), r
    # gradient of a scalar of the last state: autograd through the model's loop vs through the closed form
    w = torch.randn(out.round_states[-1].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (out.round_states[-1].double() * w).sum().backward()
    ((a ** rounds * s0.double().detach() + e.double().detach() * (1 - a ** rounds) / (1 - a)) * w).sum().backward()
    assert torch.allclose(model.decay.grad.double(), theta.grad, rtol=1e-4, atol=1e-5)


def _profile(loss, rms, deepest=2):
    return {"deepest_trained": deepest, "loss": {str(r): v for r, v in enumerate(loss, 1)},
            "state_rms": {str(r): v for r, v in enumerate(rms, 1)},
            "state_change": {str(r): 0.01 for r in range(1, len(loss) + 1)}}


def test_goal_line_from_a_constructed_profile():
    # best at round 2 (2.0); 2x = round 4, 4x = round 8
    good = summarise(_profile([2.5, 2.0, 2.004, 2.009, 2.0, 2.0, 2.0, 2.0095], [1, 1, 1, 1, 1, 1, 1, 1.2]), 1.995)
    assert good["best_rounds"] == 2 and good["best_loss"] == 2.0
    assert good["gap_2x"] == pytest.approx(0.009) and good["gap_4x"] == pytest.approx(0.0095)
    assert good["state_rms_growth"] == pytest.approx(1.2) and good["best_vs_plain"] == pytest.approx(0.005)
    assert good["goal_met"]
    too_deep = summarise(_profile([2.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0 + 2 * GOAL_GAP], [1] * 8), None)
    assert not too_deep["goal_met"] and too_deep["best_vs_plain"] is None
    growing = summarise(_profile([2.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0], [1, 1, 1, 1, 1, 1, 1, 1.3]), None)
    assert not growing["goal_met"]
    worse_than_plain = summarise(_profile([2.5, 2.0] + [2.0] * 6, [1] * 8), 1.98)
    assert not worse_than_plain["goal_met"]


def test_experiment_depth_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "depth"
    assert main(["experiment", "depth", "--quick", "--variants", "fixed_point", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["summary"]) == ["plain", "fixed_point"]          # plain always runs beside
    for v in ("plain", "fixed_point"):
        prof = result["profiles"][v]
        hist = json.loads((out / v / "report.json").read_text())["depth_histogram"]
        assert prof["deepest_trained"] == max(int(k) for k in hist)
        top = max(int(r) for r in prof["loss"])
        assert top == 4 * max(p["deepest_trained"] for p in result["profiles"].values())
        assert all(math.isfinite(v) for v in prof["loss"].values())
    assert json.loads((out / "fixed_point" / "report.json").read_text())["recipe"]["supervision"]["fixed_point"] > 0
    assert (out / "report.md").exists() and (out / "depth_safety.png").exists()


@pytest.mark.parametrize("args, field", [
    (["train", "--set", "supervision.fixed_point_rounds=2"], "supervision.fixed_point_rounds"),
    (["train", "--set", "depth.kind=geometric", "--set", "depth.stop_prob=0"], "depth.stop_prob"),
    (["train", "--set", "supervision.fixed_point=-1"], "supervision.fixed_point"),
    (["train", "--set", "model.injection=decay", "--set", "model.injection_decay_init=1"],
     "model.injection_decay_init"),
    (["train", "--set", "model.injection=add", "--set", "model.injection_decay_init=0.7"],
     "model.injection_decay_init"),
    (["experiment", "depth", "--quick", "--variants", "bogus"], "--variants"),
    (["experiment", "depth", "--quick", "--variants", "decay"], "is the base recipe itself"),   # quickstart decays
])
def test_refusals_name_the_field(args, field, tmp_path, capsys):
    assert main([*args, "--out", str(tmp_path / "x")]) == 2
    assert field in capsys.readouterr().err
