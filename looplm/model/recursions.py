"""Mixture-of-Recursions (`model.mor`): how many rounds each token runs, decided by a router.

Token choice (`"token_choice"`): a depth per token, chosen up front. A linear router on the token's prelude output e picks, for each token, how many of the R
recursions (rounds) it runs — top-1 over R depths — and the probability of that choice scales
every update the token receives:

    p = softmax(router(e))                         (B, T, R)      over depths 1..R
    d = argmax(p + bias) + 1                       bias: loss-free balancing (a buffer, not learned)
    w = p[d]                                       the chosen depth's probability
    round r, token with d >= r:   s <- s + w * (core(s) - s)
    round r, token with d <  r:   s unchanged (it stopped; its readout is its state after round d)

The router reads only the token itself, so the decision is causal at decode time: the cached
engine routes each generated token exactly as training did (`ExitController` with the "routed"
policy). Warm-up (`train.mor_warmup_steps`) sends every token to full depth with w = 1: the plain loop.

Expert choice (`"expert_choice"`, `LoopedLM.expert_choice`): at round r a router on the state entering
it keeps, in training, the top ceil(capacity_r * T) of each sequence's tokens still running
(`select_top`, nested sets), alpha * sigmoid(score) scaling their updates. A top-k over the
sequence reads the future, so at inference (the engine, and the forward in eval mode) a token
continues while a causal decision logit is > 0 — the router's own or an auxiliary router's on the
detached state — trained towards the top-k choice by BCE ("mor_aux", `expert_choice_losses`).

Which earlier tokens a round's attention sees is the *cache rule* (`model.mor_cache`); it changes
the function being trained, so it is a recipe field recorded on the card, and training (a mask
here, `RoutedVisibility`) and decoding (the engine's cache) implement the same rule:

    recursion_wise  round r attends only to tokens that entered round r (and the query itself): the
                    decoder's "full" cache with stopped tokens masked (cache.MISSING "mask")
    shared_first    round r attends to every earlier token's round-1 keys/values and its own
                    round-r ones: the decoder's "first" cache policy

Auxiliary losses (`LoopOutput.aux_losses`): "mor_balance" = R * sum_i f_i P_i (f_i: share of tokens
routed to depth i, P_i: mean router probability of depth i; 1 when the depths are used evenly) and
"mor_z" = mean logsumexp(router logits)^2; `update_bias` is the loss-free alternative.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .blocks import round_visibility, sdpa

CACHE_RULES = ("recursion_wise", "shared_first")


def route(router: torch.nn.Linear, bias: Tensor, e: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """e (B, T, d) -> (depth (B, T) long in 1..R, weight (B, T), logits (B, T, R) fp32)."""
    logits = router(e).float()
    probs = logits.softmax(-1)
    depth = (probs + bias.to(probs.dtype)).argmax(-1)                       # (B, T) 0-based
    weight = probs.gather(-1, depth.unsqueeze(-1)).squeeze(-1).to(e.dtype)
    return depth + 1, weight, logits


def mor_losses(depth: Tensor, logits: Tensor) -> dict[str, Tensor]:
    """Token choice: the depth-balance loss (the experts' load balance with depths as the options)
    and the router z-loss."""
    from .moe import load_balance, z_loss
    return {"mor_balance": load_balance(depth - 1, logits.softmax(-1)), "mor_z": z_loss(logits)}


def depth_counts(depth: Tensor, R: int) -> Tensor:
    """(R,) how many tokens the router sent to each depth 1..R."""
    return torch.bincount((depth - 1).flatten(), minlength=R)


@torch.no_grad()
def update_bias(bias: Tensor, counts: Tensor, rate: float) -> None:
    """Loss-free balancing after an optimizer step: raise the selection bias of depths chosen less
    than evenly (counts (R,): the step's tokens per depth, over every process), lower the others'."""
    load = counts.float() / counts.sum().clamp(min=1)
    bias += rate * torch.sign(1.0 / bias.shape[0] - load).to(bias.device)


def select_top(scores: Tensor, kept: Tensor, capacity: float) -> Tensor:
    """Expert choice at one round: among each sequence's kept tokens (B, T) bool, the
    ceil(capacity * T) with the highest scores (B, T) -> (B, T) bool, a subset of kept (nested)."""
    T = scores.shape[1]
    k = min(T, math.ceil(capacity * T - 1e-9))
    top = scores.masked_fill(~kept, float("-inf")).topk(k, dim=1).indices                # (B, k)
    return torch.zeros_like(kept).scatter(1, top, True) & kept


def expert_choice_losses(records: list[tuple[Tensor, Tensor, Tensor]]) -> dict[str, Tensor]:
    """records: per round after the first, (decision logits (B, T), selected (B, T), candidates (B, T));
    empty when no round chose (then no loss and no record of one).
    "mor_aux": BCE of the decision logits against the selection, over each round's candidates (what
    makes the causal threshold reproduce the top-k); "mor_z": mean squared logit (keeps them small)."""
    if not records:           # one round, or warm-up at capacity 1: nothing was chosen
        return {}
    import torch.nn.functional as F
    aux = [F.binary_cross_entropy_with_logits(lg[cand], sel[cand].to(lg.dtype)) for lg, sel, cand in records]
    z = [lg[cand].pow(2).mean() for lg, _, cand in records]
    return {"mor_aux": torch.stack(aux).mean(), "mor_z": torch.stack(z).mean()}


class RoutedVisibility:
    """The cache rule as attention masks over a whole sequence (training and the full forward): a
    `KVCache` for the core blocks (`attend(slot, q, k, v)`). Which tokens entered each round: from the
    token-choice depths (depth (B, T): round r holds depth >= r), or told round by round (`enter`,
    expert choice)."""

    def __init__(self, rule: str, depth: Tensor | None = None):
        if rule not in CACHE_RULES:
            raise ValueError(f"cache rule {rule!r}: expected one of {', '.join(CACHE_RULES)}")
        self.rule, self.depth = rule, depth                                  # depth (B, T)
        self.first: dict[int, tuple[Tensor, Tensor]] = {}
        self._entered: dict[int, Tensor] = {}
        self.query_pos: Tensor | None = None
        """shared_first: (B, K) the positions of the queries of rounds after the first, when those rounds run
        at some positions only (`LoopedLM.forward`'s later_positions); None: every position, in order."""

    def enter(self, r: int, tokens: Tensor) -> None:
        """The tokens (B, T) bool that run round r (before its blocks attend)."""
        self._entered[r] = tokens

    def entered(self, r: int) -> Tensor:
        return self.depth >= r if self.depth is not None else self._entered[r]

    def attend(self, slot: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kind, r, i = slot
        if kind != "core":
            raise RuntimeError(f"RoutedVisibility covers the core only, asked for {slot}")
        T = q.shape[2]
        if r == 1:
            self.first[i] = (k, v)
            return sdpa(q, k, v, torch.ones(T, T, dtype=torch.bool, device=q.device).tril())
        if self.rule == "recursion_wise":             # keys: tokens that entered round r, and the query itself
            positions = torch.arange(T, device=q.device).expand(q.shape[0], T)
            return sdpa(q, k, v, round_visibility(positions, self.entered(r), T).unsqueeze(1))   # (B, 1, T, T)
        k1, v1 = self.first[i]                        # earlier tokens' round-1 entries, the query's own round-r
        S = k1.shape[2]
        pos = torch.arange(T, device=q.device).unsqueeze(0) if self.query_pos is None else self.query_pos
        before = torch.arange(S, device=q.device) < pos.unsqueeze(-1)                     # (B or 1, T, S)
        eye = torch.eye(T, dtype=torch.bool, device=q.device).expand(before.shape[0], T, T)
        mask = torch.cat([before, eye], -1).unsqueeze(1)                                  # (B or 1, 1, T, S + T)
        return sdpa(q, torch.cat([k1, k], 2), torch.cat([v1, v], 2), mask)


class RoutedLoop:
    """A routed loop over whole sequences (`LoopedLM.forward`): `step(s, r)` is the recurrence's
    step, `record(out)` puts what the routing did on the LoopOutput (rounds_used, routed_depth, the
    auxiliary losses). Token choice decides every depth from e up front; expert choice decides round
    by round — by the top-k in training, by the causal decision in eval mode (what decoding runs).
    A token that does not run round r keeps its state; the cache rule masks what each round sees."""

    def __init__(self, model, e: Tensor, rope: Any, rounds: int, full_depth: bool, e_term: Tensor | None = None):
        self.model, self.e, self.rope, self.full = model, e, rope, full_depth
        self.e_term = e_term                       # concat's W_e e, computed once by the forward
        B, T = e.shape[:2]
        rule = model.cfg.mor_cache
        if model.cfg.mor == "token_choice":
            depth, self.weight, self.logits = model.route(e)
            self.routed = depth
            if full_depth:                      # warm-up: every token every round, weight 1 (the plain loop)
                depth, self.weight = torch.full_like(depth, model.nominal_rounds), torch.ones_like(self.weight)
            self.depth = depth.clamp(max=rounds)
            self.vis = RoutedVisibility(rule, self.depth)
        else:
            self.vis = RoutedVisibility(rule)
            self.kept = torch.ones(B, T, dtype=torch.bool, device=e.device)
            self.count = torch.zeros(B, T, dtype=torch.long, device=e.device)
            self.records: list[tuple[Tensor, Tensor, Tensor]] = []

    def step(self, s: Tensor, r: int) -> Tensor:
        m = self.model
        if m.cfg.mor == "token_choice":
            runs, weight = self.depth >= r, self.weight
        else:
            runs, weight, rec = m.expert_choice(s, r, self.kept, not m.training, self.full)
            self.vis.enter(r, runs)
            self.kept, self.count = runs, self.count + runs
            if rec is not None:
                self.records.append(rec)
        return torch.where(runs.unsqueeze(-1), m.routed_step(s, self.e, r, self.rope, self.vis, weight,
                                                             e_term=self.e_term), s)

    def record(self, out: Any) -> None:
        if self.model.cfg.mor == "token_choice":
            out.rounds_used, out.routed_depth = self.depth, self.routed
            out.aux_losses.update(mor_losses(self.routed, self.logits))
        else:
            out.rounds_used = out.routed_depth = self.count
            out.aux_losses.update(expert_choice_losses(self.records))
