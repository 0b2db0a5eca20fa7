"""Forward-depth samplers: moments of Huginn's log-normal Poisson, determinism per (seed, step)."""

import math

import pytest
import torch

from looplm.recipe.config import DepthConfig
from looplm.train.depth import depth_generator, expected_depth, sample_depth


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
