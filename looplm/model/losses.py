"""Loss placement: which rounds are supervised, with what weights.

The recipe's `supervision.kind` picks one of:
- final: next-token loss at the last round run;
- rounds: losses at chosen rounds, combined as sum(w*L)/sum(w) over the chosen rounds that
  ran this step (rounds beyond the sampled depth are skipped; if none ran, the final round
  is supervised instead and that is counted);
- every: equal weights over every round run;
- learned_exit: every round read out, per-token losses weighted by the exit masses of the
  model's gate, minus an entropy bonus or plus KL to a prior (Ouro stage I);
- act_mixture: every round read out, ONE cross-entropy on the exit-mass mixture of the rounds' output
  probabilities (ACT), with learned_exit's regulariser (halting.hazards.act_mixture_terms).
The other weighted placements combine per-round *losses*; only act_mixture mixes (probabilities, not logits).

Beside any placement, `supervision.fixed_point` adds the terminal fixed-point term (`fixed_point_term`), a
depth-safety objective on the states, not the readouts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..recipe.config import SupervisionConfig
from ..halting import hazards_to_masses, learned_exit_terms
from ..halting.hazards import act_mixture_terms


@dataclass(frozen=True)
class Placement:
    """The rounds a step reads out and their weights (normalised to sum to 1)."""

    rounds: tuple[int, ...]
    weights: tuple[float, ...]
    fallback: bool = False
    """True when none of the chosen rounds ran and the final round was supervised instead."""


def placement(cfg: SupervisionConfig, rounds_run: int) -> Placement:
    if cfg.kind == "final":
        return Placement((rounds_run,), (1.0,))
    if cfg.kind in ("every", "learned_exit", "act_mixture"):
        return Placement(tuple(range(1, rounds_run + 1)), tuple(1.0 / rounds_run for _ in range(rounds_run)))
    pairs = [(r, w) for r, w in zip(cfg.rounds, cfg.round_weights) if r <= rounds_run and w > 0]
    if not pairs:
        return Placement((rounds_run,), (1.0,), fallback=True)
    total = sum(w for _, w in pairs)
    return Placement(tuple(r for r, _ in pairs), tuple(w / total for _, w in pairs))


def token_losses(logits: Tensor, targets: Tensor, mask: Tensor | None = None) -> Tensor:
    """(..., V), (...) -> (...) cross-entropy per position, (B, T) or the (N,) positions a readout_at
    forward read out; masked positions are 0. Targets are ids, or (..., V) distributions (a trace
    entry of several tokens, RoundTargets.bags)."""
    V = logits.shape[-1]
    if targets.is_floating_point():
        loss = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1, V),
                               reduction="none").view(targets.shape[:-1])
    else:
        loss = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), reduction="none").view_as(targets)
    return loss if mask is None else loss * mask


def mean_loss(per_token: Tensor, mask: Tensor | None = None) -> Tensor:
    if mask is None:
        return per_token.mean()
    return per_token.sum() / mask.sum().clamp_min(1)


def supervised_loss(cfg: SupervisionConfig, out, targets: Tensor, mask: Tensor | None = None,
                    round_targets: Callable[[int], tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, dict]:
    """The training loss for one forward output and what it was made of (for the report).
    round_targets(r) -> (targets, mask) replaces targets/mask at supervised rounds before the final one
    (task traces). A forward that read out at some positions only (out.readout_at) is scored there:
    every mask must be False elsewhere."""
    at = getattr(out, "readout_at", None)
    if cfg.kind in ("learned_exit", "act_mixture") and at is not None:
        raise ValueError(f"supervision.kind {cfg.kind} weighs every position's rounds; it needs whole readouts")
    if cfg.kind in ("learned_exit", "act_mixture"):
        per_round = torch.stack([token_losses(out.round_logits[r], targets, mask)
                                 for r in range(1, out.rounds + 1)], dim=-1)  # (B, T, R)
        masses = hazards_to_masses(out.hazards[..., :out.rounds])              # (B, T, R)
        terms_of = learned_exit_terms if cfg.kind == "learned_exit" else act_mixture_terms
        terms = terms_of(per_round, masses, cfg.entropy_beta, cfg.prior, cfg.geometric_lambda, reduce=False)
        if cfg.kind == "act_mixture" and mask is not None:   # padding adds neither task nor regulariser
            terms = type(terms)(task=terms.task * mask, regulariser=terms.regulariser * mask,
                                total=terms.total * mask)
        total = mean_loss(terms.total, mask)
        with torch.no_grad():   # the weight each round's loss carried: its exit mass, averaged over scored tokens
            m = masses if mask is None else masses * mask[..., None]                       # (B, T, R)
            mean_mass = (m.flatten(0, 1).sum(0) / (masses.shape[0] * masses.shape[1] if mask is None
                                                    else mask.sum().clamp_min(1))).tolist()  # (R,), one host sync
        info = {"task_loss": mean_loss(terms.task, mask).item(), "regulariser": mean_loss(terms.regulariser, mask).item(),
                "mean_exit_round": mean_loss((masses * torch.arange(1, out.rounds + 1, device=masses.device)).sum(-1), mask).item(),
                "round_weights": dict(enumerate(mean_mass, start=1))}
        return total, info
    place = placement(cfg, out.rounds)
    losses = []
    for r in place.rounds:
        # the final round is the model's answer, whatever the trace says (a fixed-depth model may
        # run fewer rounds than an example has steps)
        y, m = round_targets(r) if round_targets is not None and r < out.rounds else (targets, mask)
        if at is not None:   # the positions read out: the loss is the same sum over the mask's positions
            if m is None:
                raise ValueError("a forward read out at some positions only is scored with a mask")
            y, m = y[at], m[at]
        losses.append(mean_loss(token_losses(out.round_logits[r], y, m), m))
    total = sum(w * loss for w, loss in zip(place.weights, losses))
    info = {"round_losses": {r: loss.item() for r, loss in zip(place.rounds, losses)}, "fallback": place.fallback,
            "round_weights": dict(zip(place.rounds, place.weights))}
    return total, info


FIXED_POINT_EPS = 1e-6
"""Per feature: the term's denominator is ||s_(r-1)||^2 + FIXED_POINT_EPS * d (a zero state stays finite)."""


def fixed_point_rounds(rounds_run: int, k: int) -> tuple[int, ...]:
    """The rounds whose change the fixed-point term reads in a step of rounds_run rounds: the last k, from
    round 2 on (round 1's change is away from the initial state, which is no fixed point to keep)."""
    return tuple(range(max(2, rounds_run - k + 1), rounds_run + 1))


def fixed_point_term(states: list[Tensor], k: int, valid: Tensor | None = None) -> Tensor | None:
    """The terminal fixed-point objective on one unroll's states (states[r - 1] = s_r, each (B, T, d)):
    mean over the rounds r of fixed_point_rounds and over positions of
    ||s_r - s_(r-1)||^2 / (||s_(r-1)||^2 + eps d), the relative change one more round made. Trained at a
    step's final rounds, it asks the readout's state to be one the core leaves where it is, so rounds run
    past the trained depth have little left to change. valid (B, T): the positions that count (task
    batches' padding does not). None when the step ran one round (there is no change to read)."""
    rounds = fixed_point_rounds(len(states), k)
    if not rounds:
        return None
    terms = []
    for r in rounds:
        prev, cur = states[r - 2].float(), states[r - 1].float()
        d = cur.shape[-1]
        rel = (cur - prev).pow(2).sum(-1) / (prev.pow(2).sum(-1) + FIXED_POINT_EPS * d)     # (B, T)
        terms.append(rel)
    per_position = torch.stack(terms, -1).mean(-1)                                         # (B, T)
    return mean_loss(per_position if valid is None else per_position * valid, valid)
