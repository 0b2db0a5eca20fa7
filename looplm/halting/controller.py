"""Inference-time exit policies and the one early-exit controller.

`ExitPolicy` is what `--exit fixed:R | quantile:Q | entropy:TAU | kl:EPS` means; `ExitController`
holds each token's stop state across rounds (survival for quantile, the previous readout for kl,
min_rounds, which positions may exit) and answers "which of these tokens stop now?". Evaluation
(inference/early_exit.py), the cached engine, speculative drafts, batches and the server all ask
it, so every path stops a token at the same round. Mixture-of-Recursions routers will plug in here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from typing import Any

import torch

from ..errors import UserError

_POLICY_HELP = "expected fixed:R, quantile:Q (0<Q<=1), entropy:TAU or kl:EPS"
_KINDS = ("fixed", "quantile", "entropy", "kl", "routed")


@dataclass(frozen=True)
class ExitPolicy:
    """When to stop looping at inference.

    kind "fixed"    value R:   stop after round R.
         "quantile" value Q:   stop at the first round whose exit CDF (from the gates) is >= Q.
         "entropy"  value TAU: stop once this round's next-token entropy is < TAU nats.
         "kl"       value EPS: stop once KL(p_t ‖ p_{t-1}) between successive rounds' next-token
                               distributions is < EPS nats (never at round 1).
         "routed"   value R:   stop after the round a Mixture-of-Recursions router chose for the
                               token (`ExitController.set_depth`); the model's own decision, not a
                               user policy (the engine uses it for model.mor, prompt tokens included).
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
        if self.kind in ("fixed", "routed") and (v != int(v) or v < 1):
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
        object.__setattr__(self, "value", int(v) if self.kind in ("fixed", "routed") else float(v))

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
    if not sep or kind not in _KINDS or kind == "routed" or not raw:
        # "routed" is a Mixture-of-Recursions model's own decision (the engine sets it), not a user policy
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


@functools.lru_cache(maxsize=64)
def _round_table(rounds: int, members: frozenset[int], device: Any) -> torch.Tensor:
    """(R+1,) bool: which rounds are members, a lookup by round. Cached (read-only): the engine makes a
    controller per decode step, and these tables are the same every step."""
    return torch.tensor([x in members for x in range(rounds + 1)], device=device)


class ExitController:
    """The one early-exit decision: the per-token stop state of one pass of up to R rounds.

    Evaluation (inference.early_exit, every token of a sequence), decoding (the Engine, one
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
        self._open = _round_table(rounds, self.decide_rounds, device)                      # (R+1,) lookup
        reads: set[int] = set()
        if policy.kind in ("entropy", "kl"):
            reads = decide | {rounds} | ({r - 1 for r in decide} if policy.kind == "kl" else set())
        self.read_rounds = frozenset(reads)
        """Rounds after which active tokens need a readout for the decision (entropy/kl; always R)."""
        self.reads = _round_table(rounds, self.read_rounds, device)
        """(R+1,) bool: `read_rounds` as a lookup by round (tokens at different rounds at once)."""
        self.needs_hazard = policy.kind == "quantile"
        """Whether `decide` needs the gate's hazard of every active token each round."""
        self.survival = torch.ones(n, device=device) if self.needs_hazard else None   # (N,) S_r
        self.depth = torch.full((n,), rounds, dtype=torch.long, device=device) if policy.kind == "routed" else None
        """(N,) routed: each token's chosen depth (`set_depth`)."""
        self.logits: torch.Tensor | None = None                                       # (N, V) latest readout
        self._read_at = torch.zeros(n, dtype=torch.long, device=device)               # (N,) its round per token

    def reset(self, ids: torch.Tensor) -> None:
        """Tokens `ids` (M,) start a new pass (continuous depth batching: a slot whose token exited takes the
        next token): active again, no exit round, survival 1, no earlier readout."""
        self.active[ids] = True
        self.exit_round[ids] = self.rounds
        self._read_at[ids] = 0
        if self.survival is not None:
            self.survival[ids] = 1.0
        if self.depth is not None:
            self.depth[ids] = self.rounds

    def set_depth(self, ids: torch.Tensor, depth: torch.Tensor) -> None:
        """routed: the depths (M,) a router chose for tokens ids (M,), before their round 1."""
        if self.depth is None:
            raise ValueError("ExitController.set_depth: only the routed policy takes router depths")
        self.depth[ids] = depth.reshape(-1).to(self.depth.device).clamp(1, self.rounds)

    def needs_readout(self, r: int) -> bool:
        """Whether the tokens that run round r must be read out (coda + head) for the decision."""
        return r in self.read_rounds

    def decide(self, r: int | torch.Tensor, ids: torch.Tensor | None = None, *, hazard: torch.Tensor | None = None,
               logits: torch.Tensor | None = None, route_stop: torch.Tensor | None = None,
               read: torch.Tensor | None = None) -> torch.Tensor:
        """After round r (1-based) of the tokens `ids` (M,) (None: every token, in order), with
        their hazards (M,) (quantile, every round) and readouts (M, V) (entropy/kl at
        `read_rounds`), or for the routed policy the router's stop decision (M,) (expert choice;
        without it the depths of `set_depth`): which stop now, (M,) bool. Stopped tokens leave `active`.
        r may be (M,), each token's own round (continuous depth batching: tokens at different rounds decided
        in one call, by the same rules); `read` (M,) bool then says which rows of `logits` are readouts (the
        tokens at a read round; default all)."""
        policy, R = self.policy, self.rounds
        if ids is None:
            ids = torch.arange(self.n, device=self.active.device)
        M = ids.shape[0]
        per_row = isinstance(r, torch.Tensor)
        if per_row:
            r = r.reshape(M).to(device=ids.device, dtype=torch.long)
            if M and not (1 <= int(r.min()) and int(r.max()) <= R):
                raise ValueError(f"ExitController.decide: rounds must lie in 1..{R}, got {r.tolist()}")
        elif not (isinstance(r, int) and 1 <= r <= R):
            raise ValueError(f"ExitController.decide: need an integer 1 <= r <= {self.rounds}, got {r!r}")
        if self.needs_hazard:
            if hazard is None:
                raise ValueError("ExitController.decide: quantile needs this round's hazards")
            self.survival[ids] = self.survival[ids] * (1.0 - hazard.reshape(M).clamp(0.0, 1.0).to(self.survival.dtype))
        prev = None
        if logits is not None:
            if self.logits is None:
                self.logits = logits.new_zeros(self.n, logits.shape[-1])
            elif policy.kind == "kl":                           # round r-1's readout, where it was read then
                prev = (self.logits[ids], self._read_at[ids] == r - 1)
            got = slice(None) if read is None else read.reshape(M)
            self.logits[ids[got]] = logits[got]
            self._read_at[ids[got]] = r[got] if per_row else r
        if per_row:
            open_ = self._open[r]                               # (M,) r is a decide round
            stop = self._policy_stop(r, ids, logits, prev, route_stop) & open_ if bool(open_.any()) else open_
            if self.may_exit is not None:
                stop = stop & self.may_exit[ids]
            stop = stop | (r >= R)
        elif r >= R:
            stop = torch.ones(M, dtype=torch.bool, device=ids.device)
        elif r not in self.decide_rounds:
            stop = torch.zeros(M, dtype=torch.bool, device=ids.device)
        else:
            stop = self._policy_stop(r, ids, logits, prev, route_stop)
            if self.may_exit is not None:
                stop = stop & self.may_exit[ids]
        done = ids[stop]
        self.active[done] = False
        self.exit_round[done] = r[stop] if per_row else r
        return stop

    def _policy_stop(self, r: int | torch.Tensor, ids: torch.Tensor, logits: torch.Tensor | None,
                     prev: tuple[torch.Tensor, torch.Tensor] | None, route_stop: torch.Tensor | None) -> torch.Tensor:
        """The policy's own rule for tokens ids (M,) after round(s) r, at rounds it may decide: (M,) bool."""
        policy, M = self.policy, ids.shape[0]
        if policy.kind == "fixed":
            return (r >= policy.value) if isinstance(r, torch.Tensor) else \
                torch.full((M,), r >= policy.value, dtype=torch.bool, device=ids.device)
        if policy.kind == "routed":   # an expert-choice router's decision, or the token-choice depth
            return route_stop.reshape(M) if route_stop is not None else self.depth[ids] <= r
        if policy.kind == "quantile":
            # not exit_cdf: round r is not the last allowed round here, so no forced mass
            return (1.0 - self.survival[ids]) >= policy.value
        if logits is None:
            raise ValueError(f"ExitController.decide: {policy.kind} needs round {r}'s readout")
        if policy.kind == "entropy":
            return (token_entropy(logits) < policy.value).reshape(M)
        if prev is None:
            return torch.zeros(M, dtype=torch.bool, device=ids.device)
        before, ok = prev                                       # kl: against round r-1's readout, where read
        return (successive_kl(logits, before) < policy.value).reshape(M) & ok


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
