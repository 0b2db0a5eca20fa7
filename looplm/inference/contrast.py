"""LoopCD-style contrastive decoding's pieces (`GenerationConfig.contrast`, generate/serve/eval --contrast): the
spec, its ranges and the logits z_R + beta (z_R - z_r). The runner reads out the earlier round inside its loop
(runner.py); the capability table says what it combines with (capabilities.py)."""

from __future__ import annotations

import math

from torch import Tensor

from ..errors import UserError
from .sampler import is_int


def parse_contrast(spec: str, flag: str = "--contrast") -> tuple[int, float]:
    """"ROUND:BETA" (generate/serve/eval --contrast) as (round, beta); the ranges are `check_contrast`'s,
    which needs the depth."""
    head, sep, tail = str(spec).partition(":")
    try:
        if not sep:
            raise ValueError
        return int(head), float(tail)
    except ValueError:
        raise UserError(f"{flag} {spec!r}: expected ROUND:BETA (an earlier round and the extrapolation "
                        "coefficient), e.g. 2:0.5") from None


def check_contrast(contrast: tuple[int, float], rounds: int, flag: str = "--contrast") -> None:
    """An earlier round 1 <= r < R to contrast with the final round R, and beta >= 0 (finite): beta < 0
    would pull towards the shallow readout, r = R is the plain readout, and r > R was never computed."""
    r, beta = contrast
    if not is_int(r) or not 1 <= r < rounds:
        raise UserError(f"{flag} {r}:{beta}: the earlier round must satisfy 1 <= ROUND < {rounds} (the final round)")
    if not math.isfinite(beta) or beta < 0:
        raise UserError(f"{flag} {r}:{beta}: BETA must be a finite number >= 0 (0 = plain decoding)")


def contrast_logits(final: Tensor, early: Tensor, beta: float) -> Tensor:
    """LoopCD-style contrastive logits z_R + beta (z_R - z_r) = (1 + beta) z_R - beta z_r, in float32
    (the difference of two nearly equal bf16 logits would lose what it extrapolates); shapes as given,
    (..., V). The engine's sampling transforms (temperature, penalties, top-k/p) apply after this."""
    final, early = final.float(), early.float()
    return final + beta * (final - early)
