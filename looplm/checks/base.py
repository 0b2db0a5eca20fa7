"""What every check is: its result (passed, failed or not applicable, and how it knows), and the
helpers the checks share (sample token ids, logits at a depth)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.looped import LoopedLM
from ..runs.checkpoint import Run

PASS, FAIL, NOT_APPLICABLE = "pass", "fail", "not applicable"
MEASURED, RECORD, NO_KIND = "measured", "record", "not_applicable"
"""How a check knows (CheckResult.kind): MEASURED compares against an independent computation on the
run's model and data; RECORD compares the run's records with each other; NO_KIND: it does not apply."""

STATE_GROWTH_LIMIT = 1.25
"""Largest allowed rms(state at 2x the trained max depth) / rms(state at the trained max depth).
A state that has settled (a fixed point, or a normalised state) gives about 1.0; 1.25 leaves room
for a slow approach to a fixed point but flags any growth like r^p with p >= log2(1.25) = 0.32:
linear growth (each round adds an update that never cancels, 2.0x over the doubled depth) and
random-walk growth (sqrt, 1.41x) both fail. 2.0 would pass exactly linear growth, the failure
seen on quickstart (docs/checks.md has the measured figures)."""


@dataclass
class CheckResult:
    name: str
    passed: bool | None
    """True / False; None when the check does not apply to this run (never counted as passed)."""
    detail: str
    kind: str = ""
    """MEASURED or RECORD, said by every check that ran (no default: a check must say how it knows);
    NO_KIND exactly when passed is None."""

    def __post_init__(self) -> None:
        if self.passed is None:
            self.kind = NO_KIND
            return
        self.passed = bool(self.passed)
        if self.kind not in (MEASURED, RECORD):
            raise ValueError(f"check {self.name}: kind must be {MEASURED!r} or {RECORD!r}, got {self.kind!r}")

    @classmethod
    def not_applicable(cls, name: str, why: str) -> "CheckResult":
        return cls(name, None, f"not applicable: {why}")

    @property
    def status(self) -> str:
        return NOT_APPLICABLE if self.passed is None else PASS if self.passed else FAIL

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "passed": self.passed, "kind": self.kind,
                "detail": self.detail}


def _sample_ids(run: Run, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, run.tokenizer.vocab_size, (2, T), generator=g)
    return ids.to(next(run.model.parameters()).device)


def _logits(model: LoopedLM, idx: torch.Tensor, rounds: int) -> torch.Tensor:
    return model(idx, rounds, generator=torch.Generator().manual_seed(0)).logits
