"""The tokens in flight inside the loop: a `LoopState` outlives one call, so a token's loop can pause
after any round and go on at the next scheduler tick beside other rows' tokens.

One entry per token being looped (continuous depth batching, inference/depth.py):

    rows    (M,)          its cache row (the request's slot)
    cols    (M,)          its cache column (its RoPE position is the column less its row's left pad)
    rounds  (M,)          the round it runs next, 1-based
    s       (M, 1, d)     its loop state after the rounds it ran
    e       (M, 1, d)     its prelude output (what every round injects)
    rope    RoPE rows for its position, (M, 1, 1, Dh) each

The exit controller's per-token slots are indexed by cache row (`ExitController.reset` when a row
takes its next token), so they need no copy here. `keep(mask)` drops the tokens that left the loop,
`merge(other)` adds tokens that entered it (their round 1 next); order is whatever the two held.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import Tensor


@dataclass
class LoopState:
    """Tokens in flight inside the loop (see the module docstring)."""

    rows: Tensor
    cols: Tensor
    rounds: Tensor
    s: Tensor
    e: Tensor
    rope: tuple[Tensor, ...]

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def keep(self, mask: Tensor) -> "LoopState":
        """The tokens where mask (M,) is True."""
        return LoopState(self.rows[mask], self.cols[mask], self.rounds[mask], self.s[mask], self.e[mask],
                         tuple(t[mask] for t in self.rope))

    def merge(self, other: "LoopState | None") -> "LoopState":
        """These tokens followed by `other`'s."""
        if other is None or len(other) == 0:
            return self
        if len(self) == 0:
            return other
        return LoopState(*(torch.cat([a, b]) for a, b in ((self.rows, other.rows), (self.cols, other.cols),
                                                          (self.rounds, other.rounds), (self.s, other.s),
                                                          (self.e, other.e))),
                         tuple(torch.cat([a, b]) for a, b in zip(self.rope, other.rope)))

    def advanced(self, s: Tensor) -> "LoopState":
        """After one round: the new states, each token's next round one later."""
        return LoopState(self.rows, self.cols, self.rounds + 1, s, self.e, self.rope)
