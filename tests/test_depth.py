"""Forward-depth samplers: moments of Huginn's log-normal Poisson, determinism per (seed, step)."""

import math

import pytest
import torch

from looplm.recipe.config import DepthConfig
from looplm.train.depth import depth_generator, expected_depth, ramped, sample_depth


def test_fixed_and_uniform():
    assert {sample_depth(DepthConfig(kind="fixed", rounds=5), 0, s) for s in range(20)} == {5}
    draws = [sample_depth(DepthConfig(kind="uniform", min=2, max=6, rounds=3), 0, s) for s in range(3000)]
    assert set(draws) == {2, 3, 4, 5, 6}
    assert sum(draws) / len(draws) == pytest.approx(4.0, abs=0.1)


def test_lognormal_poisson_moments():
    """rate ~ LogNormal(ln m - s^2/2, s) has mean m; rounds = Poisson(rate) + 1 has mean m + 1 and
    variance E[rate] + Var[rate] = m + m^2 (exp(s^2) - 1) (law of total variance)."""
    m, sigma = 6.0, 0.5
    cfg = DepthConfig(kind="lognormal_poisson", mean=m, sigma=sigma, min=1, max=1000, rounds=6)
    draws = torch.tensor([sample_depth(cfg, 7, s) for s in range(20000)], dtype=torch.float64)
    assert draws.mean().item() == pytest.approx(m + 1, rel=0.03)
    expected_var = m + m * m * (math.exp(sigma**2) - 1)
    assert draws.var().item() == pytest.approx(expected_var, rel=0.08)
    assert draws.min().item() >= 1


def test_lognormal_poisson_cap():
    cfg = DepthConfig(kind="lognormal_poisson", mean=32, sigma=0.5, min=4, max=16, rounds=8)
    draws = [sample_depth(cfg, 0, s) for s in range(500)]
    assert min(draws) >= 4 and max(draws) == 16
    assert expected_depth(cfg) <= 16


def test_same_seed_and_step_agree_across_generators():
    cfg = DepthConfig(kind="lognormal_poisson", mean=4, sigma=0.5, min=1, max=32, rounds=4)
    a = [sample_depth(cfg, 3, s, micro) for s in range(50) for micro in range(2)]
    b = [sample_depth(cfg, 3, s, micro) for s in range(50) for micro in range(2)]
    assert a == b                                        # e.g. two data-parallel ranks
    assert a != [sample_depth(cfg, 4, s, micro) for s in range(50) for micro in range(2)]
    g1, g2 = depth_generator(1, 2, 0), depth_generator(1, 2, 0)
    assert torch.equal(torch.randn(5, generator=g1), torch.randn(5, generator=g2))


def _capped_mean_by_hand(mean: float, sigma: float, lo: int, hi: int) -> float:
    """E[clamp(Poisson(tau) + 1, lo, hi)], tau ~ LogNormal(ln mean - sigma^2/2, sigma): a trapezoid over the
    normal variable z on [-10, 10], each rate's Poisson mass built by the recurrence p_n = p_{n-1} tau / n."""
    mu, steps, total = math.log(mean) - sigma**2 / 2, 8000, 0.0
    for i in range(steps + 1):
        z = -10 + 20 * i / steps
        tau, p, below, mass = math.exp(mu + sigma * z), 0.0, 0.0, 0.0
        for n in range(hi - 1):                       # counts the cap leaves alone: n + 1 < hi
            p = math.exp(-tau) if n == 0 else p * tau / n
            below, mass = below + max(lo, n + 1) * p, mass + p
        inner = below + hi * (1 - mass)
        total += (0.5 if i in (0, steps) else 1) * inner * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    return total * 20 / steps


@pytest.mark.parametrize("mean,sigma,lo,hi", [(32, 0.5, 4, 16), (2, 0.8, 3, 9), (4, 0.5, 1, 8), (6, 0.0, 1, 12)])
def test_expected_depth_is_the_capped_samplers_exact_mean(mean, sigma, lo, hi):
    cfg = DepthConfig(kind="lognormal_poisson", mean=mean, sigma=sigma, min=lo, max=hi, rounds=lo)
    exact = expected_depth(cfg)
    assert exact == pytest.approx(_capped_mean_by_hand(mean, sigma, lo, hi), rel=1e-9)
    draws = torch.tensor([sample_depth(cfg, 3, s) for s in range(6000)], dtype=torch.float64)
    se = draws.std().item() / math.sqrt(len(draws))
    assert abs(draws.mean().item() - exact) < 4.5 * se + 1e-12     # the sampler draws from the law computed


def test_expected_depth_uncapped_is_mean_plus_one():
    cfg = DepthConfig(kind="lognormal_poisson", mean=5.5, sigma=0.5, min=1, max=400, rounds=5)
    assert expected_depth(cfg) == pytest.approx(6.5, rel=1e-10)


@pytest.mark.parametrize("kind,steps", [("uniform", 60_000), ("geometric", 60_000), ("lognormal_poisson", 400)])
def test_expected_depth_under_a_ramp_averages_every_step_of_the_run(kind, steps):
    """The mean over every step: the ramp's first half, then the full setting (the sampler's draws at 60000
    steps cover both; a mean over the first 20000 steps alone would see the ramp only). Each step's mean by
    hand: uniform (min + cap) / 2, geometric min + sum_g (1 - p)^g up to the cap, the log-normal Poisson the
    unramped expectation at that step's cap and mean."""
    base = dict(kind=kind, min=2, max=10, rounds=4, mean=7.0, stop_prob=0.2)
    cfg = DepthConfig(**base, ramp_fraction=0.5)
    hand = {}
    for s in range(steps):
        top, mean = ramped(cfg, s, steps)
        if (top, mean) not in hand:
            hand[(top, mean)] = ((2 + top) / 2 if kind == "uniform" else
                                 2 + sum(0.8**g for g in range(1, top - 2 + 1)) if kind == "geometric" else
                                 expected_depth(DepthConfig(**{**base, "max": top, "mean": mean, "rounds": 2})))
        hand.setdefault("sum", 0.0)
        hand["sum"] += hand[(top, mean)]
    got = expected_depth(cfg, total_steps=steps)
    assert got == pytest.approx(hand["sum"] / steps, rel=1e-9)
    assert got < expected_depth(DepthConfig(**base)) - 0.2        # the ramp's shallow steps count


def test_expected_depth_stays_finite_where_rates_underflow():
    """sigma = 40: most quadrature rates underflow to 0 (all mass at Poisson count 0, so min rounds), none
    may turn into NaN (0 * log 0)."""
    cfg = DepthConfig(kind="lognormal_poisson", mean=4, sigma=40, min=2, max=8, rounds=4)
    assert expected_depth(cfg) == pytest.approx(2.0, abs=1e-6)
