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


def sample_depth(cfg: DepthConfig, seed: int, step: int, micro: int = 0) -> int:
    """Rounds for one micro-batch.

    fixed: cfg.rounds. uniform: an integer uniform on {min..max}.
    geometric (stochastic stopping): start at min; after each round below max, stop with probability
    stop_prob, else run one more.
    lognormal_poisson (Huginn): tau ~ LogNormal(ln(mean) - sigma^2/2, sigma), so E[tau] = mean;
    rounds = Poisson(tau) + 1, clamped to [min, max].
    """
    if cfg.kind == "fixed":
        return cfg.rounds
    g = depth_generator(seed, step, micro)
    if cfg.kind == "uniform":
        return int(torch.randint(cfg.min, cfg.max + 1, (1,), generator=g).item())
    if cfg.kind == "geometric":
        rounds = cfg.min
        while rounds < cfg.max and float(torch.rand((), generator=g, dtype=torch.float64)) >= cfg.stop_prob:
            rounds += 1
        return rounds
    mu = math.log(cfg.mean) - cfg.sigma**2 / 2
    tau = torch.exp(mu + cfg.sigma * torch.randn((), generator=g, dtype=torch.float64))
    rounds = int(torch.poisson(tau.unsqueeze(0), generator=g).item()) + 1
    return max(cfg.min, min(cfg.max, rounds))


def expected_depth(cfg: DepthConfig, draws: int = 20000) -> float:
    """Mean rounds under the sampler (exact for fixed/uniform/geometric, Monte Carlo for the capped log-normal
    Poisson)."""
    if cfg.kind == "fixed":
        return float(cfg.rounds)
    if cfg.kind == "uniform":
        return (cfg.min + cfg.max) / 2
    if cfg.kind == "geometric":   # E[min(min + G, max)] = min + sum_{g=1}^{max-min} P(G >= g), P(G >= g) = (1-p)^g
        return cfg.min + sum((1 - cfg.stop_prob) ** g for g in range(1, cfg.max - cfg.min + 1))
    return sum(sample_depth(cfg, 12345, i) for i in range(draws)) / draws
