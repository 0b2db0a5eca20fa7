"""The one recurrence engine: run a step function for R rounds.

Everything that loops in looplm goes through `unroll`: the transformer core in training, in the
engine's chunks (with its per-row exits as the `rule` that drops finished rows) and in
whole-sequence early exit (its rule drops finished tokens), Mixture-of-Recursions (its step
weighs each token's update), the seeds' scalar example s = w*s + e, the untied baseline (whose
step picks a different block per round). It owns the two controls the seeds insist are separate:

- forward depth `rounds`: how many times `step` runs;
- backward window `backward_window` = B: only the last B rounds are part of the autograd
  graph. The rounds before them still run and shape the answer, but under `torch.no_grad`,
  so no loss can send gradient through them (and they keep no activations).

A readout asked for at a round before the window is computed from that round's state as a
constant: it trains only what the readout itself applies (coda, final norm, LM head), never
the core or the prelude through the early rounds. A readout inside the window traces the
window's rounds up to it. So `grad_rounds`, the rounds whose computation receives gradient,
is the window's rounds up to the last loss-bearing readout inside it — the last B rounds
when the final round is supervised, fewer when no loss reads the last ones, none when every
supervised readout lies before the window or nothing in the graph requires grad (under
no_grad, or a frozen model). The record a run reports is what autograd reaches
(tests/test_backward_window.py measures it against an untied copy).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch


@dataclass
class Unrolled:
    """What happened in one unroll."""

    state: Any
    """The state after the last round."""
    readouts: dict[int, Any] = field(default_factory=dict)
    """round (1-based) -> readout(state after that round), for the requested rounds."""
    rounds_run: int = 0
    """Rounds computed."""
    grad_rounds: tuple[int, ...] = ()
    """Rounds whose computation receives gradient from a loss-bearing readout (1-based)."""
    readout_only_rounds: tuple[int, ...] = ()
    """Read-out rounds before the window: their readouts train the readout alone."""
    states: list[Any] = field(default_factory=list)
    """The state after each round (round r at index r - 1), when keep_states."""


def first_grad_round(rounds: int, backward_window: int | None) -> int:
    """The first round inside the backward window (1 = every round)."""
    return 1 if backward_window is None else max(1, rounds - backward_window + 1)


def unroll(
    step: Callable[[Any, int], Any],
    state: Any,
    rounds: int,
    backward_window: int | None = None,
    readout_rounds: Iterable[int] | None = None,
    readout: Callable[[Any, int], Any] | None = None,
    keep_states: bool = False,
    loss_rounds: Iterable[int] | None = None,
    rule: Callable[[Any, int], Any] | None = None,
) -> Unrolled:
    """Run `state = step(state, r)` for r = 1..rounds.

    backward_window: B >= 1 runs rounds 1..rounds-B without gradient and detaches the state
    entering round rounds-B+1 (None = full backprop).
    readout_rounds: rounds after which to call `readout(state, r)` (default: only the last).
    readout: maps a state to what is kept (default: the state itself); always called with
    gradients enabled, so a readout before the window still trains the readout's own weights.
    keep_states: also return the state after every round.
    loss_rounds: the readout rounds a loss will use (default: all of readout_rounds); only they
    make a round gradient-visible.
    rule: how this caller drops finished tokens, applied after each round (and its readout):
    `rule(state, r)` returns the state of the tokens that go on — fewer rows when some stopped,
    the rule compacting whatever else its step reads — or None when none do, which ends the loop
    (the engine's per-row exits, whole-sequence early exit). None: every token runs every round.
    """
    if type(rounds) is not int or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if backward_window is not None and not 1 <= backward_window:
        raise ValueError(f"backward_window must be >= 1 or None, got {backward_window!r}")
    wanted = {rounds} if readout_rounds is None else set(readout_rounds)
    first_grad = first_grad_round(rounds, backward_window)
    losses = wanted if loss_rounds is None else set(loss_rounds)
    reached: list[int] = []        # window rounds whose output is in the autograd graph
    out = Unrolled(state=state)
    for r in range(1, rounds + 1):
        if r == first_grad and r > 1 and hasattr(state, "detach"):
            # Keep the value, cut its history: earlier rounds ran but get no gradient.
            state = state.detach()
        with torch.no_grad() if r < first_grad else nullcontext():
            state = step(state, r)
        out.rounds_run = r
        if r >= first_grad and getattr(state, "requires_grad", True):
            reached.append(r)
        if keep_states:
            out.states.append(state)
        if r in wanted:
            out.readouts[r] = readout(state, r) if readout is not None else state
        if rule is not None:
            state = rule(state, r)
            if state is None:
                break
    out.state = state
    last = max((r for r in losses if first_grad <= r <= rounds), default=0)
    out.grad_rounds = tuple(r for r in reached if r <= last)
    out.readout_only_rounds = tuple(sorted(r for r in losses if r < first_grad))
    return out
