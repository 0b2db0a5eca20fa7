"""Forward-depth samplers: how many rounds a training step runs.

Every draw is a pure function of (seed, step, micro-batch), so a resumed run redraws the
same depths and every data-parallel rank agrees on the depth of a micro-batch without
communicating (Huginn synchronises depth across workers per micro-batch).
"""

from __future__ import annotations

import math

import torch

from ..recipe.config import DepthConfig


def depth_generator(seed: int, step: int, micro: int = 0) -> torch.Generator:
    g = torch.Generator()
    # Distinct, reproducible stream per (seed, step, micro); large odd multipliers avoid collisions.
    g.manual_seed((seed * 1_000_003 + step * 8191 + micro * 131 + 17) % (2**63 - 1))
    return g


def ramp(cfg: DepthConfig, step: int, total_steps: int) -> float:
    """The depth curriculum's progress rho in [0, 1] at `step` of `total_steps` (1 = the full setting; 1 when
    depth.ramp_fraction = 0): phase t = step / (ramp_fraction * total_steps), rho = t (linear) or
    1 - sqrt(1 - t) (1-sqrt)."""
    span = cfg.ramp_fraction * total_steps
    if cfg.kind == "fixed" or span <= 0:
        return 1.0
    t = min(1.0, step / span)
    return t if cfg.ramp_shape == "linear" else 1.0 - math.sqrt(1.0 - t)


def ramped(cfg: DepthConfig, step: int, total_steps: int) -> tuple[int, float]:
    """(cap, mean) the sampler uses at `step`: max and lognormal_poisson's mean moved from depth.min toward
    their settings by `ramp` (the cap rounded up, so a ramp reaches each depth as soon as it may)."""
    rho = ramp(cfg, step, total_steps)
    if rho >= 1.0:
        return cfg.max, cfg.mean
    cap = min(cfg.max, math.ceil(cfg.min + (cfg.max - cfg.min) * rho - 1e-9))
    return max(cfg.min, cap), max(1.0, cfg.min + (cfg.mean - cfg.min) * rho)


def sample_depth(cfg: DepthConfig, seed: int, step: int, micro: int = 0, total_steps: int = 0) -> int:
    """Rounds for one micro-batch.

    fixed: cfg.rounds. uniform: an integer uniform on {min..max}.
    geometric (stochastic stopping): start at min; after each round below max, stop with probability
    stop_prob, else run one more.
    lognormal_poisson (Huginn): tau ~ LogNormal(ln(mean) - sigma^2/2, sigma), so E[tau] = mean;
    rounds = Poisson(tau) + 1, clamped to [min, max].
    With a depth curriculum (depth.ramp_fraction > 0 and total_steps, the run's train.steps) max and mean
    are those of `ramped` at this step.
    """
    if cfg.kind == "fixed":
        return cfg.rounds
    top, mean = ramped(cfg, step, total_steps) if total_steps else (cfg.max, cfg.mean)
    g = depth_generator(seed, step, micro)
    if cfg.kind == "uniform":
        return int(torch.randint(cfg.min, top + 1, (1,), generator=g).item())
    if cfg.kind == "geometric":
        rounds = cfg.min
        while rounds < top and float(torch.rand((), generator=g, dtype=torch.float64)) >= cfg.stop_prob:
            rounds += 1
        return rounds
    mu = math.log(mean) - cfg.sigma**2 / 2
    tau = torch.exp(mu + cfg.sigma * torch.randn((), generator=g, dtype=torch.float64))
    rounds = int(torch.poisson(tau.unsqueeze(0), generator=g).item()) + 1
    return max(cfg.min, min(top, rounds))


def expected_depth(cfg: DepthConfig, draws: int = 20000, total_steps: int = 0) -> float:
    """Mean rounds under the sampler (exact for fixed/uniform/geometric, Monte Carlo for the capped log-normal
    Poisson). total_steps with a depth curriculum: the mean over the run's steps (Monte Carlo)."""
    if cfg.kind != "fixed" and cfg.ramp_fraction > 0 and total_steps:
        return sum(sample_depth(cfg, 12345, i % total_steps, i // total_steps, total_steps)
                   for i in range(draws)) / draws
    if cfg.kind == "fixed":
        return float(cfg.rounds)
    if cfg.kind == "uniform":
        return (cfg.min + cfg.max) / 2
    if cfg.kind == "geometric":   # E[min(min + G, max)] = min + sum_{g=1}^{max-min} P(G >= g), P(G >= g) = (1-p)^g
        return cfg.min + sum((1 - cfg.stop_prob) ** g for g in range(1, cfg.max - cfg.min + 1))
    return sum(sample_depth(cfg, 12345, i) for i in range(draws)) / draws
