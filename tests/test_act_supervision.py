"""supervision.kind = "act_mixture" (ACT): one cross-entropy on the exit-mass mixture of the rounds'
output probabilities, against a hand computation from the model's own per-round logits and hazards.

- the trainer's loss for one step = -log Σ_r p_r softmax(z_r)[y] (+ β·KL(p ‖ uniform)), masses by hand
  (p_1 = h_1, p_r = h_r ∏_{j<r}(1 - h_j), the last round takes the rest): a mixture of probabilities,
  not of logits and not of losses;
- learned_exit's loss on the same forward is a different (larger, by Jensen) number;
- a tiny recipe trains a few steps with it and its loss is finite;
- what cannot apply is refused with exit 2, naming the field.
"""

from __future__ import annotations

import math

import pytest
import torch

import looplm
from looplm.cli import main
from looplm.model.losses import supervised_loss
from looplm.recipe.config import SupervisionConfig
from looplm.train.trainer import Counters, train_step

from conftest import tiny_recipe, write_corpus

R = 4
BETA = 0.05
ACT = {"depth.rounds": R, "exit.gate": True, "supervision.kind": "act_mixture", "supervision.prior": "uniform",
       "supervision.entropy_beta": BETA, "model.init_std": 0.5}


def _step():
    """One train_step of a tiny act_mixture model whose gate spreads the exit masses; (loss, out, y)."""
    torch.manual_seed(0)
    rec = tiny_recipe(**ACT)
    model = looplm.build_model(rec).train()
    with torch.no_grad():   # hazards well away from 0 and 1, different per token
        model.gate[1].weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
        model.gate[1].bias.zero_()
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 257, (2, 16), generator=g)
    y = torch.randint(0, 257, (2, 16), generator=g)
    loss, out, info = train_step(model, rec, x, y, 0, 0, Counters(), rounds=R)
    return loss, out, y, info


def _hand_masses(h: torch.Tensor) -> list[torch.Tensor]:
    masses, alive = [], torch.ones_like(h[..., 0])
    for r in range(R - 1):
        masses.append(h[..., r] * alive)
        alive = alive * (1 - h[..., r])
    return masses + [alive]                                           # the last round takes the rest


def _hand(out, y):
    """(act_mixture task, learned_exit task, KL(p ‖ uniform)) per token mean, in float64, by hand."""
    h = out.hazards[..., :R].detach().double()
    p = _hand_masses(h)
    probs = [torch.softmax(out.round_logits[r].detach().double(), -1).gather(-1, y[..., None])[..., 0]
             for r in range(1, R + 1)]                                # P_r(y), (B, T)
    mixed = sum(pr * qr for pr, qr in zip(p, probs))                  # Σ_r p_r softmax(z_r)[y]
    act = (-torch.log(mixed)).mean().item()
    expected_loss = sum(pr * -torch.log(qr) for pr, qr in zip(p, probs)).mean().item()
    kl = sum(pr * torch.log(pr * R) for pr in p).mean().item()
    return act, expected_loss, kl


def test_trainer_loss_is_one_ce_on_the_mixed_probabilities():
    loss, out, y, info = _step()
    assert out.hazards is not None and set(out.round_logits) == set(range(1, R + 1))   # every round read out
    h = out.hazards[..., :R - 1]
    assert 0.01 < h.min().item() and h.max().item() < 0.99            # a real spread, not a collapsed gate
    act, _, kl = _hand(out, y)
    assert loss == pytest.approx(act + BETA * kl, rel=1e-5, abs=1e-6)
    assert info["task_loss"] == pytest.approx(act, rel=1e-5)
    assert info["regulariser"] == pytest.approx(BETA * kl, rel=1e-4, abs=1e-7)
    assert sum(info["round_weights"].values()) == pytest.approx(1.0, abs=1e-5)
    # mixing logits instead of probabilities is a different number
    p = _hand_masses(out.hazards[..., :R].detach().double())
    mixed_logits = sum(pr[..., None] * out.round_logits[r + 1].detach().double() for r, pr in enumerate(p))
    logit_mix = torch.nn.functional.cross_entropy(mixed_logits.flatten(0, 1), y.flatten()).item()
    assert abs(logit_mix - act) > 1e-3


def test_differs_from_learned_exit_on_the_same_forward():
    loss, out, y, _ = _step()
    act, expected_loss, kl = _hand(out, y)
    le = SupervisionConfig(kind="learned_exit", prior="uniform", entropy_beta=BETA)
    le_loss, le_info = supervised_loss(le, out, y)
    assert le_loss.item() == pytest.approx(expected_loss + BETA * kl, rel=1e-5)   # Σ p_r L_r: mixture of losses
    assert le_info["regulariser"] == pytest.approx(BETA * kl, rel=1e-4, abs=1e-7)  # same regulariser
    assert le_loss.item() - loss > 1e-3                                # Jensen: -log E[P] < E[-log P]


def test_mask_drops_padding_from_task_and_regulariser():
    _, out, y, _ = _step()
    cfg = SupervisionConfig(kind="act_mixture", prior="uniform", entropy_beta=BETA)
    mask = torch.ones_like(y, dtype=torch.float32)
    mask[:, 8:] = 0
    masked, _ = supervised_loss(cfg, out, y, mask)
    cut = type(out)(**{**out.__dict__, "round_logits": {r: z[:, :8] for r, z in out.round_logits.items()},
                       "hazards": out.hazards[:, :8]}) if hasattr(out, "__dict__") else None
    if cut is None:
        pytest.skip("LoopOutput cannot be sliced here")
    alone, _ = supervised_loss(cfg, cut, y[:, :8])
    assert masked.item() == pytest.approx(alone.item(), rel=1e-5)


def test_a_tiny_act_mixture_recipe_trains(tmp_path):
    from looplm.train.trainer import train
    rec = tiny_recipe(**{**ACT, "model.init_std": 0.02, "train.steps": 3, "train.log_every": 1,
                         "train.checkpoint_every": 3, "train.eval_batches": 1,
                         "data.path": str(write_corpus(tmp_path / "corpus"))})
    report = train(rec, tmp_path / "run", quiet=True)
    assert report["loss_placement"]["kind"] == "act_mixture"
    assert report["loss_placement"]["rounds"] == list(range(1, R + 1))
    losses = report.get("train_losses") or []
    text = (tmp_path / "run" / "metrics.jsonl").read_text() if (tmp_path / "run" / "metrics.jsonl").exists() else ""
    assert losses or text
    import json
    rows = [json.loads(line) for line in text.splitlines() if line]
    vals = [r["loss"] for r in rows if "loss" in r] + list(losses)
    assert vals and all(math.isfinite(v) for v in vals)


REFUSED = [
    (["--set", "supervision.kind=act_mixture"], "exit.gate"),                               # no gate to read
    (["--set", "supervision.kind=act_mixture", "--set", "exit.gate=true", "--set", "depth.kind=fixed",
      "--set", "depth.rounds=1", "--set", "backward.window=all"], "exit.gate"),                                             # no hazard reaches it
    (["--set", "supervision.kind=act_mixture", "--set", "exit.gate=true", "--set", "train.stage=2"],
     "supervision.kind"),                                                                   # stage II: gate only
    (["--set", "supervision.kind=act_mixture", "--set", "exit.gate=true", "--set", "data.task=chain",
      "--set", "data.round_targets=trace"], "data.round_targets"),                          # not per-round
    (["--set", "supervision.kind=act_mixture", "--set", "exit.gate=true", "--set", "model.mor=token_choice",
      "--set", "depth.kind=fixed"], "model.mor"),
    (["--set", "supervision.kind=every", "--set", "supervision.prior=uniform"], "supervision.prior"),
]


@pytest.mark.parametrize("args,field", REFUSED)
def test_refusals_exit_2_naming_the_field(args, field, capsys):
    assert main(["recipe", "show", "quickstart", *args]) == 2
    assert field in capsys.readouterr().err


def test_accepted_with_its_regulariser_fields(capsys):
    assert main(["recipe", "show", "quickstart", "--set", "supervision.kind=act_mixture", "--set", "exit.gate=true",
                 "--set", "supervision.prior=geometric", "--set", "supervision.geometric_lambda=0.3"]) == 0


def test_eval_exit_mixture_is_the_hand_mixture_of_the_rounds_probabilities():
    """`looplm eval`'s exit_mixture (what an ACT model outputs) on held-out tokens = -log Σ_r p_r softmax(z_r)[y]
    from the same model's own per-round logits and hazards, and its mean exit round = Σ_r r p_r."""
    from looplm.evaluation.early_exit import exit_distribution_depth, exit_mixture
    torch.manual_seed(0)
    model = looplm.build_model(tiny_recipe(**ACT)).eval()
    with torch.no_grad():
        model.gate[1].weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 257, (2, 16), generator=g), torch.randint(0, 257, (2, 16), generator=g))
               for _ in range(2)]
    rep = exit_mixture(model, batches, R)
    act, expected, depth, n = 0.0, 0.0, 0.0, 0
    with torch.no_grad():
        for x, y in batches:   # the initial state seeded per batch as evaluate_rounds seeds it
            out = model(x, R, readout_rounds=tuple(range(1, R + 1)), generator=torch.Generator().manual_seed(n))
            a, e, _ = _hand(out, y)
            p = _hand_masses(out.hazards[..., :R].double())
            act, expected = act + a * y.numel(), expected + e * y.numel()
            depth += sum((r + 1) * pr for r, pr in enumerate(p)).sum().item()
            n += y.numel()
    assert rep["loss"] == pytest.approx(act / n, rel=1e-5)
    assert rep["mean_exit_round"] == pytest.approx(depth / n, rel=1e-5)
    assert exit_distribution_depth(model, batches, R) == pytest.approx(depth / n, rel=1e-5)
    assert rep["loss"] < expected / n - 1e-3                           # Jensen: below learned_exit's expected loss
    plain = looplm.build_model(tiny_recipe(**{"depth.rounds": R}))
    assert exit_mixture(plain, batches, R) is None                     # no gate: nothing to mix by
