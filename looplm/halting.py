"""Halting maths for looped models: exit hazards, exit masses, exit losses and exit policies.

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
  - stage2_gate_loss                                     Ouro Stage II gate training (BCE on improvement)
  - ExitPolicy / parse_exit_policy                      inference-time exit policies
  - ExitController / first_exit_round                   the one "stop now?" decision and its per-token state

Errors: bad *user* settings (a policy string, beta, prior name, ...) raise
`looplm.errors.UserError`; tensors of the wrong shape are programming errors and raise ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from looplm.errors import UserError

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
) -> LearnedExitTerms:
    """Task term Σ_t p_t L_t plus the exit-distribution regulariser, split into parts.

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

    task = (masses * round_losses).sum(dim=-1)                      # (...)
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


# -----------------------------------------------------------------------------
# inference-time exit policies

_POLICY_HELP = "expected fixed:R, quantile:Q (0<Q<=1), entropy:TAU or kl:EPS"
_KINDS = ("fixed", "quantile", "entropy", "kl")


@dataclass(frozen=True)
class ExitPolicy:
    """When to stop looping at inference.

    kind "fixed"    value R:   stop after round R.
         "quantile" value Q:   stop at the first round whose exit CDF (from the gates) is >= Q.
         "entropy"  value TAU: stop once this round's next-token entropy is < TAU nats.
         "kl"       value EPS: stop once KL(p_t ‖ p_{t-1}) between successive rounds' next-token
                               distributions is < EPS nats (never at round 1).
    min_rounds:       never stop before this round.
    exit_in_prefill:  if False, prompt tokens always run every round (later decode steps may
                      attend to deep-round KV of the prompt); policies only apply to decoding.
    Every policy stops at the last allowed round T. str(policy) gives the canonical "kind:value".
    """

    kind: str
    value: float
    min_rounds: int = 1
    exit_in_prefill: bool = False

    def __post_init__(self) -> None:
        text = f"{self.kind}:{self.value}"
        if self.kind not in _KINDS:
            raise UserError(f"exit policy {text!r}: {_POLICY_HELP}")
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UserError(f"exit policy {text!r}: value must be a finite number; {_POLICY_HELP}")
        if self.kind == "fixed" and (v != int(v) or v < 1):
            raise UserError(f"exit policy {text!r}: R must be an integer >= 1")
        if self.kind == "quantile" and not (0.0 < v <= 1.0):
            raise UserError(f"exit policy {text!r}: Q must satisfy 0<Q<=1")
        if self.kind in ("entropy", "kl") and v < 0:
            name = "TAU" if self.kind == "entropy" else "EPS"
            raise UserError(f"exit policy {text!r}: {name} must be >= 0 (nats)")
        if isinstance(self.min_rounds, bool) or not isinstance(self.min_rounds, int) or self.min_rounds < 1:
            raise UserError(f"exit policy min_rounds: expected an integer >= 1, got {self.min_rounds!r}")
        if not isinstance(self.exit_in_prefill, bool):
            raise UserError(f"exit policy exit_in_prefill: expected true or false, got {self.exit_in_prefill!r}")
        # store fixed:R as an int and the others as floats, so equality and str() are canonical
        object.__setattr__(self, "value", int(v) if self.kind == "fixed" else float(v))

    def __str__(self) -> str:
        return f"{self.kind}:{self.value!r}"


def parse_exit_policy(text: str, *, min_rounds: int = 1, exit_in_prefill: bool = False) -> ExitPolicy:
    """Parse "fixed:R", "quantile:Q", "entropy:TAU" or "kl:EPS" into an ExitPolicy.

    parse_exit_policy(str(p)) == p for any policy with the default min_rounds/exit_in_prefill.
    """
    if not isinstance(text, str):
        raise UserError(f"exit policy {text!r}: {_POLICY_HELP}")
    kind, sep, raw = text.strip().partition(":")
    kind, raw = kind.strip().lower(), raw.strip()
    if not sep or kind not in _KINDS or not raw:
        raise UserError(f"exit policy {text!r}: {_POLICY_HELP}")
    try:
        value: float = int(raw) if kind == "fixed" else float(raw)
    except ValueError:
        what = "R must be an integer >= 1" if kind == "fixed" else _POLICY_HELP
        raise UserError(f"exit policy {text!r}: {what}") from None
    return ExitPolicy(kind, value, min_rounds=min_rounds, exit_in_prefill=exit_in_prefill)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision logits lose too much in log_softmax over a large vocab; use float32."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) over the vocab: (..., V) -> (...).

    Computed in at least float32; -inf logits (masked tokens) contribute 0 rather than NaN.
    """
    logp = torch.log_softmax(_upcast(logits), dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)


def successive_kl(logits: torch.Tensor, prev_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_t ‖ p_{t-1}) in nats between this round's and last round's next-token
    distributions: (..., V), (..., V) -> (...). Terms with p_t = 0 contribute 0."""
    logp = torch.log_softmax(_upcast(logits), dim=-1)
    logq = torch.log_softmax(_upcast(prev_logits), dim=-1)
    p = logp.exp()
    # KL >= 0 exactly; rounding can leave a tiny negative, which would make `kl:0` fire.
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(dim=-1).clamp_min(0)


class ExitController:
    """The one early-exit decision: the per-token stop state of one pass of up to R rounds.

    Evaluation (adaptive.early_exit, every token of a sequence), decoding (the Engine, one
    column of every running row), speculative exit drafts and the server all decide through
    this class, so a policy means the same thing everywhere. Tokens are numbered 0..N-1 by the
    caller (flat (B*T) positions in evaluation, cache rows in decoding); after round r the
    caller passes the tokens that ran it (`ids`, in the order of its rows) with what the policy
    reads, and gets back which of them stop:

        ctl = ExitController(policy, R, N)
        for r in 1..R:   run round r for ctl.active tokens
                         stop = ctl.decide(r, ids, hazard=..., logits=...)   # (M,) bool

    What it keeps between rounds, per token: the survival S_r = prod (1 - lambda) for quantile
    (the same sequential product `exit_cdf` takes), the latest readout (the previous round's
    distribution for kl, and each token's exit logits for entropy/kl), which tokens are still
    active and the round each stopped at. The rules, in order: round R always stops; before
    `min_rounds`, during a prefill the policy does not open to exits, or for a token outside
    `may_exit`, nothing stops; otherwise the policy decides. Mixture-of-Recursions routers plug
    in here: a router is another rule for "which of these tokens continue after round r".
    """

    def __init__(self, policy: "ExitPolicy", rounds: int, n: int, *, prefill: bool = False,
                 may_exit: torch.Tensor | None = None, device: torch.device | str | None = None):
        if not (isinstance(rounds, int) and rounds >= 1):
            raise ValueError(f"ExitController: rounds must be an integer >= 1, got {rounds!r}")
        self.policy, self.rounds, self.n = policy, rounds, n
        self.active = torch.ones(n, dtype=torch.bool, device=device)                # (N,)
        self.exit_round = torch.full((n,), rounds, dtype=torch.long, device=device)  # (N,) valid once stopped
        self.may_exit = None if may_exit is None else may_exit.reshape(-1).to(device=device, dtype=torch.bool)
        open_ = not prefill or policy.exit_in_prefill
        decide = set(range(max(1, policy.min_rounds), rounds)) if open_ else set()
        if policy.kind == "kl":
            decide.discard(1)                                    # nothing to compare with at round 1
        self.decide_rounds = frozenset(decide)
        """Rounds before R after which the policy may stop a token."""
        reads: set[int] = set()
        if policy.kind in ("entropy", "kl"):
            reads = decide | {rounds} | ({r - 1 for r in decide} if policy.kind == "kl" else set())
        self.read_rounds = frozenset(reads)
        """Rounds after which active tokens need a readout for the decision (entropy/kl; always R)."""
        self.needs_hazard = policy.kind == "quantile"
        """Whether `decide` needs the gate's hazard of every active token each round."""
        self.survival = torch.ones(n, device=device) if self.needs_hazard else None   # (N,) S_r
        self.logits: torch.Tensor | None = None                                       # (N, V) latest readout
        self._read_at = 0                                                             # its round

    def needs_readout(self, r: int) -> bool:
        """Whether the tokens that run round r must be read out (coda + head) for the decision."""
        return r in self.read_rounds

    def decide(self, r: int, ids: torch.Tensor | None = None, *, hazard: torch.Tensor | None = None,
               logits: torch.Tensor | None = None) -> torch.Tensor:
        """After round r (1-based) of the tokens `ids` (M,) (None: every token, in order), with
        their hazards (M,) (quantile, every round) and readouts (M, V) (entropy/kl at
        `read_rounds`): which stop now, (M,) bool. Stopped tokens leave `active`."""
        if not (isinstance(r, int) and 1 <= r <= self.rounds):
            raise ValueError(f"ExitController.decide: need an integer 1 <= r <= {self.rounds}, got {r!r}")
        policy, R = self.policy, self.rounds
        if ids is None:
            ids = torch.arange(self.n, device=self.active.device)
        M = ids.shape[0]
        if self.needs_hazard:
            if hazard is None:
                raise ValueError("ExitController.decide: quantile needs this round's hazards")
            self.survival[ids] = self.survival[ids] * (1.0 - hazard.reshape(M).clamp(0.0, 1.0).to(self.survival.dtype))
        prev = None
        if logits is not None:
            if self.logits is None:
                self.logits = logits.new_zeros(self.n, logits.shape[-1])
            elif policy.kind == "kl" and self._read_at == r - 1:
                prev = self.logits[ids]                                               # (M, V) round r-1's
            self.logits[ids] = logits
            self._read_at = r
        if r >= R:
            stop = torch.ones(M, dtype=torch.bool, device=ids.device)
        elif r not in self.decide_rounds:
            stop = torch.zeros(M, dtype=torch.bool, device=ids.device)
        else:
            if policy.kind == "fixed":
                stop = torch.full((M,), r >= policy.value, dtype=torch.bool, device=ids.device)
            elif policy.kind == "quantile":
                # not exit_cdf: round r is not the last allowed round here, so no forced mass
                stop = (1.0 - self.survival[ids]) >= policy.value
            elif logits is None:
                raise ValueError(f"ExitController.decide: {policy.kind} needs round {r}'s readout")
            elif policy.kind == "entropy":
                stop = token_entropy(logits) < policy.value
            else:
                stop = successive_kl(logits, prev) < policy.value if prev is not None else \
                    torch.zeros(M, dtype=torch.bool, device=ids.device)
            stop = stop.reshape(M)
            if self.may_exit is not None:
                stop = stop & self.may_exit[ids]
        done = ids[stop]
        self.active[done] = False
        self.exit_round[done] = r
        return stop


def first_exit_round(
    policy: ExitPolicy,
    T: int,
    *,
    hazards: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    prefill: bool = False,
) -> torch.Tensor:
    """Offline use of the inference decision: the 1-based round each token would exit at.

    hazards: (..., T) gates of every round; logits: (..., T, V) every round's readout.
    Returns a long tensor (...) (0-dim when neither is given). Useful for evaluation when all
    rounds have been computed anyway; the decision is `ExitController`'s.
    """
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"first_exit_round: T must be an integer >= 1, got {T!r}")
    lead = hazards.shape[:-1] if hazards is not None else logits.shape[:-2] if logits is not None else ()
    n = math.prod(lead)
    ref = hazards if hazards is not None else logits
    ctl = ExitController(policy, T, n, prefill=prefill, device=None if ref is None else ref.device)
    for t in range(1, T + 1):
        ids = ctl.active.nonzero().squeeze(1)                                    # (M,)
        if ids.numel() == 0:
            break
        h = None if hazards is None else hazards.reshape(n, T)[ids, t - 1]
        lg = None
        if logits is not None and ctl.needs_readout(t):
            lg = logits.reshape(n, T, logits.shape[-1])[ids, t - 1]
        ctl.decide(t, ids, hazard=h, logits=lg)
    return ctl.exit_round.reshape(lead)
