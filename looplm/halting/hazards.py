"""Halting maths for looped models: exit hazards, exit masses and exit losses.

A looped model runs one shared core for rounds t = 1..T. After every round an exit gate reads
the state and emits a *hazard* λ_t = P(stop at round t | the token reached round t). Everything
in this file is a pure tensor function of those hazards (or of the per-round losses / logits),
with the round dimension last and any leading dims, e.g. (B, T_seq, R).

Conventions used throughout (1-based rounds in prose, 0-based in code):

    survival  S_t = ∏_{j<=t} (1 - λ_j)                      S_0 = 1
    mass      p_t = λ_t · S_{t-1}          for t < T
              p_T = S_{T-1}                 (forced exit: the last round takes what is left)
    CDF       CDF(m) = 1 - S_m for m < T,   CDF(T) = 1

So the last gate value is never used: round T always exits. A uniform exit distribution over
4 rounds is hazards (1/4, 1/3, 1/2, forced), not four hazards of 1/4.

What lives here:
  - hazards_to_masses / masses_to_hazards / exit_cdf     the distribution over exit rounds
  - weighted_round_loss                                  fixed per-round weights on per-round losses
  - learned_exit_loss / learned_exit_terms               Σ p_t L_t  + entropy (Ouro) or KL (PonderNet)
  - act_mixture                                          ACT's Σ p_t y_t mixture of states/outputs
  - act_mixture_terms                                    -log Σ p_t P_t(y): one loss on the mixed distribution
  - stage2_gate_loss                                     Ouro Stage II gate training (BCE on improvement)
(inference-time exit policies and the controller that applies them: controller.py)

Errors: bad *user* settings (a policy string, beta, prior name, ...) raise
`looplm.errors.UserError`; tensors of the wrong shape are programming errors and raise ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UserError

# -----------------------------------------------------------------------------
# hazards <-> masses <-> CDF


def _check_rounds(x: torch.Tensor, name: str) -> int:
    """Return R, the size of the trailing round dimension, after checking there is one."""
    if x.dim() == 0 or x.shape[-1] < 1:
        raise ValueError(f"{name}: expected a trailing round dimension of size >= 1, got shape {tuple(x.shape)}")
    return x.shape[-1]


def _survival(hazards: torch.Tensor) -> torch.Tensor:
    """S_t = ∏_{j<=t} (1 - λ_j) for every t in hazards' trailing dim; (..., t) -> (..., t).

    A plain cumulative product, not exp(cumsum(log1p(-λ))): hazards of exactly 1 are legal
    (a saturated gate) and would put -inf into the log-space version. Multiplying by a factor in
    [0, 1] can never increase a float, so S is non-increasing even after rounding.
    """
    return torch.cumprod(1.0 - hazards.clamp(0.0, 1.0), dim=-1)


def hazards_to_masses(hazards: torch.Tensor) -> torch.Tensor:
    """Exit masses from hazards: (..., R) -> (..., R), non-negative, summing to 1 over R.

    Only hazards[..., :R-1] are read; the last round takes the remaining survival (forced exit).
    p_t = λ_t · S_{t-1} telescopes: Σ_{t<R} (S_{t-1} - S_t) + S_{R-1} = S_0 = 1, so the sum is 1
    up to a few ulps regardless of how extreme the hazards are.
    """
    R = _check_rounds(hazards, "hazards")
    h = hazards[..., : R - 1].clamp(0.0, 1.0)                       # (..., R-1) gates that matter
    surv = _survival(h)                                             # (..., R-1) S_1..S_{R-1}
    ones = torch.ones_like(hazards[..., :1])                        # (..., 1)   S_0
    surv_before = torch.cat([ones, surv[..., :-1]], dim=-1)         # (..., R-1) S_0..S_{R-2}
    early = h * surv_before                                         # (..., R-1) p_1..p_{R-1}
    last = surv[..., -1:] if R > 1 else ones                        # (..., 1)   p_R = S_{R-1}
    return torch.cat([early, last], dim=-1)


def masses_to_hazards(masses: torch.Tensor) -> torch.Tensor:
    """Hazards from exit masses, the inverse of `hazards_to_masses`: (..., R) -> (..., R).

    λ_t = p_t / (1 - Σ_{j<t} p_j) = p_t / Σ_{j>=t} p_j. We use the tail sum rather than
    1 - cumsum: it is exact for zero tails (no 1e-8 "survival" from cancellation) and keeps full
    relative precision when the survival is tiny. Where the survival is 0 the token has already
    exited, so the hazard is defined as 1 there; the final hazard is always 1 (forced exit).
    """
    _check_rounds(masses, "masses")
    p = masses.clamp_min(0.0)
    tail = torch.flip(torch.cumsum(torch.flip(p, [-1]), dim=-1), [-1])   # (..., R) Σ_{j>=t} p_j
    alive = tail > 0
    hazards = torch.where(alive, p / torch.where(alive, tail, torch.ones_like(tail)), torch.ones_like(p))
    hazards = hazards[..., :-1].clamp(0.0, 1.0)
    return torch.cat([hazards, torch.ones_like(p[..., :1])], dim=-1)   # forced exit at round R


def exit_cdf(hazards: torch.Tensor) -> torch.Tensor:
    """P(exit at or before round m) for every m: (..., R) -> (..., R), non-decreasing, last = 1.

    CDF(m) = 1 - S_m for m < R; CDF(R) = 1 because the last round is forced.
    """
    R = _check_rounds(hazards, "hazards")
    cdf = 1.0 - _survival(hazards[..., : R - 1])                    # (..., R-1)
    return torch.cat([cdf, torch.ones_like(hazards[..., :1])], dim=-1)


# -----------------------------------------------------------------------------
# training losses


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """H(p) = -Σ p log p over the trailing dim with 0 log 0 = 0; (..., R) -> (...).

    The clamp keeps log finite at p = 0 so gradients stay finite (torch.xlogy would give NaN
    gradients there); the p factor makes those terms exactly 0 in the forward pass.
    """
    tiny = torch.finfo(p.dtype).tiny
    return -(p * torch.log(p.clamp_min(tiny))).sum(dim=-1)


def geometric_prior(
    rounds: int,
    geometric_lambda: float = 0.5,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """PonderNet's geometric prior truncated to `rounds` rounds and renormalised: (rounds,).

    q_t ∝ λ (1 - λ)^(t-1), t = 1..rounds. Renormalising (rather than dumping the tail on the
    last round) keeps the prior's shape the same at every round, which is what the regulariser is
    supposed to express.
    """
    if not isinstance(rounds, int) or rounds < 1:
        raise UserError(f"rounds: expected an integer >= 1, got {rounds!r}")
    if not (0.0 < geometric_lambda < 1.0):
        raise UserError(f"geometric_lambda: expected 0 < geometric_lambda < 1, got {geometric_lambda!r}")
    t = torch.arange(rounds, dtype=torch.float64)
    # log-space so that tiny lambdas with many rounds don't underflow before normalising
    logq = math.log(geometric_lambda) + t * math.log1p(-geometric_lambda)
    q = torch.softmax(logq, dim=0)
    return q.to(dtype=dtype, device=device)


_PRIORS = ("none", "uniform", "geometric")


@dataclass(frozen=True)
class LearnedExitTerms:
    """The parts of the learned-exit objective, so reports can show them separately.

    total = task + regulariser. `regulariser` is signed: for prior "none" it is -β·H(p)
    (negative), for "uniform"/"geometric" it is +β·KL(p ‖ prior) (non-negative).
    Each field is a scalar (mean over tokens) or a (...) per-token tensor when reduce=False.
    """

    task: torch.Tensor
    regulariser: torch.Tensor
    total: torch.Tensor


def learned_exit_terms(
    round_losses: torch.Tensor,
    masses: torch.Tensor,
    beta: float,
    prior: str = "none",
    geometric_lambda: float = 0.5,
    reduce: bool = True,
    mixture: bool = False,
) -> LearnedExitTerms:
    """Task term Σ_t p_t L_t plus the exit-distribution regulariser, split into parts (mixture=True: ACT's
    task term instead, see `act_mixture_terms`; the regulariser is the same).

    round_losses: (..., R) per-token LM loss of each round's own readout.
    masses:       (..., R) exit masses (from `hazards_to_masses`), broadcastable to round_losses.
    beta:         regulariser weight, >= 0.
    prior:        "none"      -> subtract β·H(p)           (Ouro's entropy regularisation)
                  "uniform"   -> add β·KL(p ‖ uniform)     (PonderNet with a flat prior)
                  "geometric" -> add β·KL(p ‖ geometric)   (PonderNet, truncated + renormalised)

    The task term weights per-round *losses*. That is the expected loss under the exit
    distribution, and it is what lets the gate learn which round to trust. It is not the loss
    of a mixed state (see `act_mixture` for that different computation).
    If some tokens are padding, pass reduce=False and take your own masked mean.
    """
    if prior not in _PRIORS:
        raise UserError(f"prior: expected one of {', '.join(_PRIORS)}, got {prior!r}")
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta >= 0):
        raise UserError(f"beta: expected a finite number >= 0, got {beta!r}")
    R = _check_rounds(round_losses, "round_losses")
    if _check_rounds(masses, "masses") != R:
        raise ValueError(f"masses has {masses.shape[-1]} rounds but round_losses has {R}")

    if mixture:     # -log Σ p_t P_t(y); zero masses clamped inside the log so gradients stay finite
        task = -torch.logsumexp(torch.log(masses.clamp_min(torch.finfo(masses.dtype).tiny)) - round_losses, dim=-1)
    else:
        task = (masses * round_losses).sum(dim=-1)                  # (...)
    if prior == "none":
        regulariser = -beta * _entropy(masses)                      # (...)
    else:
        if prior == "uniform":
            log_q = torch.full((R,), -math.log(R), dtype=masses.dtype, device=masses.device)
        else:
            log_q = torch.log(geometric_prior(R, geometric_lambda, dtype=masses.dtype, device=masses.device))
        # KL(p ‖ q) = -H(p) - Σ p log q ; q > 0 everywhere so this is finite.
        kl = -_entropy(masses) - (masses * log_q).sum(dim=-1)       # (...)
        regulariser = beta * kl
    regulariser = regulariser.expand_as(task)                       # if losses had extra leading dims
    total = task + regulariser
    if reduce:
        task, regulariser, total = task.mean(), regulariser.mean(), total.mean()
    return LearnedExitTerms(task=task, regulariser=regulariser, total=total)


def learned_exit_loss(
    round_losses: torch.Tensor,
    masses: torch.Tensor,
    beta: float,
    prior: str = "none",
    geometric_lambda: float = 0.5,
    reduce: bool = True,
) -> torch.Tensor:
    """Total learned-exit loss: scalar mean over tokens, or (...) per token when reduce=False.

    See `learned_exit_terms` for the definition; this returns only `.total`.
    """
    return learned_exit_terms(round_losses, masses, beta, prior, geometric_lambda, reduce).total


def weighted_round_loss(
    round_losses: torch.Tensor,
    weights: torch.Tensor | Sequence[float],
    reduce: bool = True,
) -> torch.Tensor:
    """Σ_t w_t L_t with fixed per-round weights: (..., R) -> scalar mean (or (...) if reduce=False).

    weights: (R,) or broadcastable to round_losses, non-negative. They are not renormalised, so
    e.g. all-ones weights sum the rounds. Example: losses (0.8, 0.3), weights (0.25, 0.75) -> 0.425.
    """
    R = _check_rounds(round_losses, "round_losses")
    if not isinstance(weights, torch.Tensor):
        weights = [float(w) for w in weights]
        if len(weights) != R or any(not math.isfinite(w) or w < 0 for w in weights):
            raise UserError(f"round weights: expected {R} finite numbers >= 0, got {weights!r}")
        weights = torch.tensor(weights, dtype=round_losses.dtype, device=round_losses.device)
    elif weights.shape[-1] != R:
        raise ValueError(f"weights has {weights.shape[-1]} rounds but round_losses has {R}")
    loss = (round_losses * weights.to(round_losses.dtype)).sum(dim=-1)   # (...)
    return loss.mean() if reduce else loss


def act_mixture(states_or_outputs: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
    """ACT-style mixture Σ_t p_t · y_t of per-round states or outputs.

    states_or_outputs: (..., R, D) with masses (..., R)  -> (..., D)
                   or  (..., R)    with masses (..., R)  -> (...)   (one number per round)

    This is a *different* computation from `learned_exit_loss`: ACT averages the states (or
    logits) first and then computes one loss on the blend, so no single round is ever asked to
    be good on its own. The weighted loss instead scores every round's own readout and averages
    the losses. Use this only when you explicitly want ACT's behaviour.
    """
    R = _check_rounds(masses, "masses")
    y = states_or_outputs
    if y.dim() == masses.dim() + 1:
        if y.shape[-2] != R:
            raise ValueError(f"states_or_outputs: expected rounds at dim -2 of size {R}, got shape {tuple(y.shape)}")
        return (masses.unsqueeze(-1) * y).sum(dim=-2)
    if y.dim() == masses.dim():
        if y.shape[-1] != R:
            raise ValueError(f"states_or_outputs: expected {R} rounds in the last dim, got shape {tuple(y.shape)}")
        return (masses * y).sum(dim=-1)
    raise ValueError(
        f"states_or_outputs: expected shape (..., R) or (..., R, D) matching masses {tuple(masses.shape)}, "
        f"got {tuple(y.shape)}"
    )


def act_mixture_terms(
    round_losses: torch.Tensor,
    masses: torch.Tensor,
    beta: float,
    prior: str = "none",
    geometric_lambda: float = 0.5,
    reduce: bool = True,
) -> LearnedExitTerms:
    """ACT supervision: ONE cross-entropy on the exit-mass mixture of the rounds' output distributions.

    round_losses: (..., R) per-token cross-entropy of each round's own readout, L_t = -log P_t(y).
    masses:       (..., R) exit masses (from `hazards_to_masses`), broadcastable to round_losses.

    task = -log Σ_t p_t · P_t(y) = -logsumexp_t(log p_t - L_t): the probabilities are mixed (as
    `act_mixture` mixes outputs, same (..., R) convention), then one loss is taken; that is
    `-log act_mixture(exp(-L), p)` computed in log space. It is not Σ p_t L_t (`learned_exit_terms`,
    the expected loss, which is >= this by Jensen), and not the loss of mixed logits.

    Regulariser: the same β·(-H(p)) or β·KL(p ‖ prior) as learned_exit, taken from
    `learned_exit_terms` itself. We keep it because the mixture alone pays nothing for where the mass
    sits: it drifts onto the best (usually the last) round and the gate stops saying anything useful
    for early exit; ACT's ponder cost and PonderNet's prior exist for the same reason. Using the same
    regulariser also makes act_mixture vs learned_exit a comparison of the task term alone (one function,
    `learned_exit_terms(mixture=True)`). β = 0 gives the bare mixture. Zero masses are clamped to the
    smallest normal float inside the log, so gradients stay finite (their rounds contribute ~1e-38).
    """
    return learned_exit_terms(round_losses, masses, beta, prior, geometric_lambda, reduce, mixture=True)


def stage2_gate_loss(
    round_losses: torch.Tensor,
    hazards: torch.Tensor,
    k: float = 50.0,
    gamma: float = 0.005,
) -> torch.Tensor:
    """Ouro Stage II gate loss: teach the gate to continue only when continuing helps. Scalar.

    round_losses: (..., R) per-token loss of each round's readout; detached here, because this
                  loss trains the gate only, never the LM.
    hazards:      (..., R) or (..., R-1) gate outputs λ_1..λ_{R-1} (a last, forced λ_R is ignored).

    For t = 2..R:
        I_t = max(0, L_{t-1} - L_t)           how much running round t improved the loss
        w_t = σ(k · (I_t - γ))                target probability of "continue past round t-1"
        BCE between the predicted continuation probability 1 - λ_{t-1} and w_t

    Pairing convention: I_t is paired with λ_{t-1}. The gate read after round t-1 is the one
    that decides whether round t runs at all, so it is the gate whose decision round t's
    improvement can judge. λ_R is never trained (round R is forced).
    The BCE is averaged over tokens and the R-1 decisions. With R = 1 there is no decision and
    the loss is 0 (still attached to `hazards`, so backward() works).
    """
    R = _check_rounds(round_losses, "round_losses")
    if hazards.shape[-1] not in (R, R - 1):
        raise ValueError(f"hazards: expected {R} or {R - 1} rounds, got shape {tuple(hazards.shape)}")
    if R == 1:
        return hazards.sum() * 0.0
    L = round_losses.detach()
    improvement = (L[..., :-1] - L[..., 1:]).clamp_min(0.0)         # (..., R-1) I_2..I_R
    target = torch.sigmoid(k * (improvement - gamma))               # (..., R-1) w_2..w_R
    cont = 1.0 - hazards[..., : R - 1]                              # (..., R-1) 1-λ_1..1-λ_{R-1}
    cont, target = torch.broadcast_tensors(cont, target.to(cont.dtype))
    # F.binary_cross_entropy clamps its logs at -100, so a saturated gate gives a large but
    # finite loss instead of inf.
    return F.binary_cross_entropy(cont, target, reduction="mean")
