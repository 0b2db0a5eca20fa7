"""Forward-depth samplers: how many rounds a training step runs.

Every draw is a pure function of (seed, step, micro-batch), so a resumed run redraws the
same depths and every data-parallel rank agrees on the depth of a micro-batch without
communicating (Huginn synchronises depth across workers per micro-batch).
"""

from __future__ import annotations

import math

import numpy as np
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


def _capped_poisson_mean(rate: torch.Tensor, lo: int, top: torch.Tensor) -> torch.Tensor:
    """E[clamp(Poisson(rate) + 1, lo, top)] for each rate (..., float64) and its cap top (..., int), exactly:
    every count below top - 1 weighted by its probability, the cap taking the rest of the mass."""
    n = torch.arange(int(top.max()) - 1, dtype=torch.float64)                     # counts 0 .. max(top) - 2
    rate = rate.unsqueeze(-1)                                                     # (..., 1)
    pmf = torch.exp(torch.xlogy(n, rate) - rate - torch.lgamma(n + 1))           # (..., N); rate 0: all at n = 0
    pmf = pmf * (n < top.unsqueeze(-1) - 1)                                       # counts the cap leaves alone
    below = (pmf * (n + 1).clamp(min=lo)).sum(-1)
    return below + top * (1 - pmf.sum(-1))


def _step_means(cfg: DepthConfig, tops: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """The sampler's exact mean rounds at steps whose cap is tops[i] and (lognormal_poisson) mean means[i]."""
    tops = tops.to(torch.float64)
    if cfg.kind == "uniform":
        return (cfg.min + tops) / 2
    if cfg.kind == "geometric":     # min + sum_{g=1}^{top-min} P(G >= g), P(G >= g) = (1-p)^g
        q = 1 - cfg.stop_prob
        span = tops - cfg.min
        return cfg.min + (span if q == 1 else q * (1 - q**span) / (1 - q))
    # lognormal_poisson: the Poisson's capped mean integrated over tau ~ LogNormal(ln mean - sigma^2/2, sigma)
    # by Gauss-Hermite quadrature in log tau (the integrand is smooth there; with 64 nodes it agrees with a fine
    # trapezoid to 1e-9 in tests/test_depth.py)
    x, w = (torch.from_numpy(a) for a in np.polynomial.hermite.hermgauss(64))
    mu = torch.log(means) - cfg.sigma**2 / 2                                      # (S,)
    tau = torch.exp(mu[:, None] + cfg.sigma * math.sqrt(2) * x[None, :])          # (S, 64)
    per_node = _capped_poisson_mean(tau, cfg.min, tops[:, None].expand_as(tau))  # (S, 64)
    return (per_node * w).sum(-1) / math.sqrt(math.pi)


def expected_depth(cfg: DepthConfig, total_steps: int = 0) -> float:
    """Mean rounds under the sampler, exactly (the log-normal Poisson by quadrature). total_steps with a depth
    curriculum: the mean over the run's steps 0 .. total_steps - 1, each at its ramped cap and mean."""
    if cfg.kind == "fixed":
        return float(cfg.rounds)
    ramping = cfg.ramp_fraction > 0 and total_steps > 0
    steps = range(total_steps) if ramping else [total_steps]
    total = 0.0
    for start in range(0, len(steps), 4096):                                      # bounded memory on long runs
        pairs = [ramped(cfg, s, total_steps) if ramping else (cfg.max, cfg.mean) for s in steps[start:start + 4096]]
        tops = torch.tensor([t for t, _ in pairs], dtype=torch.int64)
        means = torch.tensor([m for _, m in pairs], dtype=torch.float64)
        total += float(_step_means(cfg, tops, means).sum())
    return total / len(steps)
