"""The one recurrence engine: run a step function for R rounds.

Everything that loops in looplm goes through `unroll`: the transformer core, the seeds'
scalar example s = w*s + e, the untied baseline (whose step picks a different block per
round). It owns the two controls the seeds insist are separate:

- forward depth `rounds`: how many times `step` runs;
- backward window `backward_window`: the state is detached before the last B rounds, so
  the earlier rounds still run and shape the answer but no gradient traces them.

It also reads out at chosen rounds and records which rounds were gradient-visible, so a
run can report exactly which cycles received gradients.

Early exit plugs in through `should_stop(round, state, readout)`: when it returns True the
remaining rounds are not computed at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


@dataclass
class Unrolled:
    """What happened in one unroll."""

    state: Any
    """The state after the last round that ran."""
    readouts: dict[int, Any] = field(default_factory=dict)
    """round (1-based) -> readout(state after that round), for the requested rounds that ran."""
    rounds_run: int = 0
    """Rounds actually computed (fewer than asked when should_stop fired)."""
    grad_rounds: tuple[int, ...] = ()
    """Rounds whose computation gradients can pass through (1-based)."""


def unroll(
    step: Callable[[Any, int], Any],
    state: Any,
    rounds: int,
    backward_window: int | None = None,
    readout_rounds: Iterable[int] | None = None,
    readout: Callable[[Any, int], Any] | None = None,
    should_stop: Callable[[int, Any, Any], bool] | None = None,
) -> Unrolled:
    """Run `state = step(state, r)` for r = 1..rounds.

    backward_window: B >= 1 detaches the state entering round rounds-B+1 (None = full backprop).
    readout_rounds: rounds after which to call `readout(state, r)` (default: only the last).
    readout: maps a state to what is kept (default: the state itself).
    should_stop: called after each round with (r, state, readout-or-None); True ends the loop.
    """
    if type(rounds) is not int or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if backward_window is not None and not 1 <= backward_window:
        raise ValueError(f"backward_window must be >= 1 or None, got {backward_window!r}")
    wanted = {rounds} if readout_rounds is None else set(readout_rounds)
    first_grad = 1 if backward_window is None else max(1, rounds - backward_window + 1)
    out = Unrolled(state=state)
    for r in range(1, rounds + 1):
        if r == first_grad and r > 1 and hasattr(state, "detach"):
            # Keep the value, cut its history: earlier rounds ran but get no gradient.
            state = state.detach()
        state = step(state, r)
        out.rounds_run = r
        kept = None
        if r in wanted or should_stop is not None:
            kept = readout(state, r) if readout is not None else state
            if r in wanted:
                out.readouts[r] = kept
        if should_stop is not None and r < rounds and should_stop(r, state, kept):
            break
    out.state = state
    out.grad_rounds = tuple(range(first_grad, out.rounds_run + 1))
    return out
