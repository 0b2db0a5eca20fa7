"""Block visits: every executed block of the unrolled model, indexed once.

    prelude block i            visit i                         i < P
    core block i at round r    visit P + (r - 1) K + i         r = 1..R, i < K
    coda block i               visit P + R K + i               i < C

A looped model runs its K core blocks R times, so one stored block is several visits; an untied
model's round r runs its own copies, and the same index names them. The visit is named by the cache
slot its attention writes (("prelude", 0, i), ("core", r, i), ("coda", r, i)), the key every block
call already carries, so a tap on the residual stream (`Ops.tap`) knows where it is without a second
count. `looplm recirculate RUN --visits` prints the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Visit:
    """One executed block."""

    index: int
    part: str
    """prelude, core or coda."""
    round: int
    """0 for the prelude, 1..R for the core, R for the coda (the readout after the last round)."""
    block: int
    """Its position within its part (a core block: within the round's K blocks)."""

    @property
    def slot(self) -> tuple[str, int, int]:
        return (self.part, self.round, self.block)

    def __str__(self) -> str:
        where = f"round {self.round} block {self.block}" if self.part == "core" else f"block {self.block}"
        return f"{self.index}: {self.part} {where}"


def visit_plan(cfg: Any, rounds: int) -> list[Visit]:
    """Every visit of a forward at `rounds` rounds, in execution order (the index is the position)."""
    P, K, C = cfg.n_prelude, cfg.n_core, cfg.n_coda
    plan = [Visit(i, "prelude", 0, i) for i in range(P)]
    plan += [Visit(P + (r - 1) * K + i, "core", r, i) for r in range(1, rounds + 1) for i in range(K)]
    plan += [Visit(P + rounds * K + i, "coda", rounds, i) for i in range(C)]
    return plan


def visit_index(slot: tuple[str, int, int], cfg: Any, rounds: int) -> int:
    """The visit a block call with this cache slot is (a coda slot's round is the readout's; the plan's
    coda visits are the readout after the last round, the only one a fixed-depth forward runs)."""
    part, r, i = slot
    if part == "prelude":
        return i
    if part == "core":
        return cfg.n_prelude + (r - 1) * cfg.n_core + i
    return cfg.n_prelude + rounds * cfg.n_core + i
