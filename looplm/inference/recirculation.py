"""Recirculation in a frozen model: a deeper residual mixed into an earlier block visit, and the
refined history written back before later positions read it.

For each position t, in this order (the serial schedule, exact):

    1. the ordinary pass at t (the cache as it is): its logits are t's readout, and the residual
       stream after visit s (the source) and visit d < s (the destination) is captured;
    2. mix, in float32:  h' = beta_t * h_d + alpha_t * (|h_d| / max(|h_s|, eps)) * h_s
       (the source scaled to the destination's norm, per token; alpha_t = min(t / ramp, 1) * alpha,
       beta_t = 1 - alpha_t ("complement") or 1 ("one"));
    3. the pass at t again with h' in place of h_d: the visits after d recompute, and their keys and
       values overwrite t's entries in the cache (visits up to d recompute what they held), so every
       later position attends to t's refined history. Its logits are not read: the readout is pass 1's.

Only t's own states are mixed into t (the withdrawn public result leaked t's deep state into t + 1).
alpha = 0 with beta = 1 skips step 3: the base model exactly. Each position costs two passes, the
prompt's too — exact refinement is serial in positions; batched requests are serial each, together
(`Runner.run_chunk` with many rows), which is the faster exact schedule. "blockwise" runs a whole
chunk (a prompt) through both passes at once: position t's pass 1 then reads unrefined history of
the chunk, so it is an approximation, named as one (its loss gap is measured, evaluation/recirculation.py).

Visits are indexed once (model/visits.py); both taps find theirs by the cache slot a block call
carries, through the model's own pieces (`Ops.tap`), on the engine's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from ..errors import UserError
from ..model.visits import visit_index, visit_plan

if TYPE_CHECKING:
    from .cache import LoopKVCache


@dataclass(frozen=True)
class Recirculation:
    """One recirculation setting (validated here; the visits against the model by `check`)."""

    source: int
    """s: the visit whose output is mixed in."""
    dest: int
    """d < s: the visit whose output it is mixed into."""
    alpha: float = 0.15
    """The source's weight (after norm matching); the seeds' fixed setting is about 0.15."""
    beta: Literal["complement", "one"] = "complement"
    """The destination's weight: 1 - alpha_t (convex) or 1 (residual addition)."""
    ramp: int = 0
    """alpha_t = min(t / ramp, 1) * alpha at position t (0: alpha from the first position)."""
    eps: float = 1e-6
    """The norm clamp: a source of norm below eps is scaled by |h_d| / eps, never divided by zero."""
    schedule: Literal["resume", "serial", "blockwise"] = "resume"
    """resume: exact, position by position, the second pass resuming after d (visits up to d and the LM head
    not recomputed); serial: exact, the second pass the whole model again (the reference resume is tested
    against); blockwise: each chunk (a prompt) refined at once, an approximation (its second pass resumes
    after d too)."""
    mixer: str | None = None
    """A trained adaptive mixer (model/mixer.py, safetensors): its alpha and beta per token replace the fixed
    alpha and beta, which are then not read (beta must stay the default; the command line refuses an alpha
    beside a mixer); the ramp still applies to its alpha."""

    def __post_init__(self) -> None:
        if not (isinstance(self.source, int) and isinstance(self.dest, int)) or not 0 <= self.dest < self.source:
            raise UserError(f"recirculation --s {self.source} --d {self.dest}: needs 0 <= d < s (visits; "
                            "looplm recirculate RUN --visits lists them)")
        if not 0.0 <= self.alpha <= 1.0:
            raise UserError(f"recirculation --alpha {self.alpha}: must lie in [0, 1]")
        if self.beta not in ("complement", "one"):
            raise UserError(f"recirculation --beta {self.beta!r}: complement (1 - alpha) or one")
        if not (isinstance(self.ramp, int) and self.ramp >= 0):
            raise UserError(f"recirculation --ramp {self.ramp!r}: an integer >= 0")
        if not self.eps > 0:
            raise UserError(f"recirculation eps {self.eps}: must be > 0")
        if self.schedule not in ("resume", "serial", "blockwise"):
            raise UserError(f"recirculation --schedule {self.schedule!r}: resume, serial or blockwise")
        if self.mixer is not None and self.beta != "complement":
            raise UserError(f"recirculation --beta {self.beta}: a mixer gives its own beta per token")

    def check(self, cfg: Any, rounds: int) -> None:
        """The visits exist in a forward at `rounds` rounds."""
        n = len(visit_plan(cfg, rounds))
        if self.source >= n:
            raise UserError(f"recirculation --s {self.source}: this model runs visits 0..{n - 1} at {rounds} rounds "
                            f"(--d in 0..{n - 2}, --s in d+1..{n - 1})")

    def ramp_factor(self, positions: Tensor) -> Tensor:
        """min(t / ramp, 1) at positions t (B, T), as (B, T, 1) float32 (ones without a ramp)."""
        f = torch.ones(positions.shape, dtype=torch.float32, device=positions.device)
        if self.ramp:
            f = (positions.float() / self.ramp).clamp(max=1.0)
        return f.unsqueeze(-1)

    def weights(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(alpha_t, beta_t), each (B, T, 1) float32, at positions (B, T)."""
        a = self.alpha * self.ramp_factor(positions)
        b = 1.0 - a if self.beta == "complement" else torch.ones_like(a)
        return a, b


def mix(h_dst: Tensor, h_src: Tensor, alpha: Tensor | float, beta: Tensor | float, eps: float = 1e-6) -> Tensor:
    """beta * h_dst + alpha * h_src scaled to h_dst's norm (per token, over the last dimension), in float32;
    a source norm below eps is clamped to eps. Returns h_dst's dtype."""
    d, s = h_dst.float(), h_src.float()
    scaled = s * (d.norm(dim=-1, keepdim=True) / s.norm(dim=-1, keepdim=True).clamp_min(eps))
    return (beta * d + alpha * scaled).to(h_dst.dtype)


class _Resume:
    """The second pass's tap under the resume schedule: the visits before d are the first pass's outputs
    (`held`), d's is the refined state, so none of them runs again (their cache entries stay the first
    pass's, which is what a recomputation would write); the visits after d compute."""

    def __init__(self, held: dict[int, Tensor], refined: Tensor, d: int, cfg: Any, rounds: int):
        self.held, self.refined, self.d, self.cfg, self.rounds = held, refined, d, cfg, rounds

    def known(self, slot: tuple) -> Tensor | None:
        v = visit_index(slot, self.cfg, self.rounds)
        return self.refined if v == self.d else self.held.get(v) if v < self.d else None

    def __call__(self, slot: tuple, h: Tensor) -> Tensor:
        return h


def schedule(run_pass: Callable[..., Tensor], rc: Recirculation, cfg: Any, rounds: int,
             idx: Tensor, start: int, pad: Tensor, mixer: Any = None) -> list[Tensor]:
    """The schedule, whatever runs the passes (the module docstring's steps 1-3): tokens idx (B, T) at
    columns start..start+T, rows starting at columns `pad` (B,). `run_pass(x, col, tap, skipped=0)` runs
    tokens x at column col through the model with `tap` on its block visits, writing their cache entries,
    and returns the logits (B, T', V) or (B, V) — None when `skipped` (the resumed pass: its first `skipped`
    visits supplied by the tap, no LM head). Returns the ordinary passes' logits, one entry per span. The
    engine's chunks run it (`recirculated_chunk`), and so does the eager, differentiable pass the adaptive
    mixer trains through (`EagerPasses`). mixer: None (the fixed alpha, beta) or `mixer(h_dst, h_src)` ->
    (alpha, beta), the learned coefficients (ramped like alpha)."""
    s_at, d_at = rc.source, rc.dest
    T = idx.shape[1]
    resume = rc.schedule != "serial"              # only the reference recomputes the visits up to d
    spans = [(0, T)] if rc.schedule == "blockwise" else [(c, c + 1) for c in range(T)]
    out: list[Tensor] = []
    for a, b in spans:
        x, col = idx[:, a:b], start + a
        held: dict[int, Tensor] = {}

        def capture(slot: tuple, h: Tensor) -> Tensor:
            v = visit_index(slot, cfg, rounds)
            if v == s_at or v == d_at or (resume and v < d_at):
                held[v] = h                                                                  # (B, T', d)
            return h

        out.append(run_pass(x, col, capture))
        positions = (col + torch.arange(b - a, device=pad.device))[None, :] - pad[:, None]    # (B, T')
        alpha, beta = rc.weights(positions.clamp_min(0))
        if mixer is not None:                       # learned coefficients, ramped as the fixed alpha is
            alpha, beta = mixer(held[d_at], held[s_at])
            alpha = alpha * rc.ramp_factor(positions.clamp_min(0))
        elif not bool(alpha.any()) and not bool((beta != 1).any()):
            continue                                     # the identity: nothing to refine
        refined = mix(held[d_at], held[s_at], alpha, beta, rc.eps)
        if resume:                        # the same column again from d on: t's entries after d become refined
            run_pass(x, col, _Resume(held, refined, d_at, cfg, rounds), skipped=d_at + 1)
            continue

        def replace(slot: tuple, h: Tensor) -> Tensor:
            return refined if visit_index(slot, cfg, rounds) == d_at else h

        run_pass(x, col, replace)         # the same column again: t's entries after d become the refined ones
    return out


def recirculated_chunk(engine: Any, rc: Recirculation, idx: Tensor, start: int, cache: "LoopKVCache", *,
                       phase: str, noise: Tensor | None, all_logits: bool, rows: Tensor | None,
                       work: Any, work_phase: str | None) -> tuple[Tensor, int]:
    """`Runner.run_chunk` under recirculation: `schedule` over the runner's chunks (resume and serial: column
    by column; blockwise: whole); (logits, rounds), the logits the ordinary passes'. `engine` is the runner
    (runner.py, which calls this: this module does not import it back)."""
    k, R = engine.kernels(), engine.rounds

    def run_pass(x: Tensor, col: int, tap: Any, skipped: int = 0) -> Tensor:
        with k.tapping(tap):
            return engine.chunk(x, col, cache, phase=phase, noise=noise, all_logits=all_logits, rows=rows,
                                work=work, work_phase=work_phase, head=not skipped, skipped=skipped).logits

    pad = cache.pad if rows is None else cache.pad[rows]                                      # (B,)
    out = schedule(run_pass, rc, engine.cfg, R, idx, start, pad, engine.mixer)
    return (torch.cat(out, 1) if all_logits else out[-1]), R
