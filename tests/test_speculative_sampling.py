"""Self-speculative sampling keeps the full-depth model's distribution: a statistical test.

A tiny looped model over a vocabulary of 3-4 tokens is sampled through the speculative engine
(shallow drafts, full-depth verification) once per seed, and the empirical distribution of the
first three generated tokens is compared with the exact target distribution, enumerated from
full-depth forward passes `model(idx)` over every continuation (softmax at temperature T after
top-k, computed here), by a chi-square test. The engine is never compared with itself.

Why this can fail: with max_new_tokens=4 and K=2, the first token comes from the prefill and
the next two from one draft/verify round (two drafts), so tokens 2 and 3 are exactly what the
acceptance rule produces: accept the draft with probability min(1, p/q), else resample from
max(p - q, 0). On this model one-round drafts are far from the full-depth target, so accepting
every draft or resampling from p instead of the residual moves the distribution of (t2, t3) by
far more than sampling noise. Each was tried by breaking Sampler.verify (at DRAWS = 300):
accepting every draft gives chi-square p-values below 1e-60 (and, with top-k, draws outside the
target's support); resampling rejected drafts from p instead of the residual gives p < 1e-8;
a residual of max(q - p, 0) or an acceptance ratio of q/p fail as badly as accepting
everything. A correct sampler gives p = 0.2-0.7 here. Seeds are fixed, so the outcome is
deterministic; the threshold is one a correct sampler exceeds with probability 1 - 1e-6.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from looplm.recipe.config import ModelConfig
from looplm.inference.engine import Engine, GenerationConfig, SamplingParams
from looplm.model.looped import LoopedLM

ROUNDS = 4
PROMPT = [0, 1, 2]
NEW = 4          # generated per draw; the first 3 are tested (t1 from the prefill, t2 and t3 drafted)
TESTED = 3
DRAWS = 300      # seeds per case; enough for the broken rules to fail by many standard deviations
P_MIN = 1e-6     # chi-square p-value a correct sampler stays above


def tiny_model(vocab: int, seed: int) -> LoopedLM:
    """No prelude or coda, one core block: cheap to run, and one round is far from four.
    A deterministic initial state, so the target distribution does not depend on the seed."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=16, n_heads=2, context=16, n_prelude=0, n_core=1, n_coda=0,
                      init_std=1.0, init_state="prelude")
    return LoopedLM(cfg, rounds=ROUNDS).eval()


def target_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """(..., V) logits -> the sampling distribution: softmax(logits / T) over the top_k tokens."""
    lg = logits.double() / temperature
    if top_k:
        rank = lg.argsort(-1, descending=True).argsort(-1)              # 0 = the likeliest token
        lg = lg.masked_fill(rank >= top_k, float("-inf"))
    return torch.softmax(lg, -1)


@torch.no_grad()
def exact_joint(model: LoopedLM, temperature: float, top_k: int) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | PROMPT) under full-depth sampling, by enumerating every continuation."""
    V = model.cfg.vocab_size
    conts = list(itertools.product(range(V), repeat=TESTED))
    seqs = torch.tensor([PROMPT + list(c[:-1]) for c in conts])               # (V^3, P + 2)
    probs = target_probs(model(seqs, ROUNDS).logits[:, len(PROMPT) - 1:], temperature, top_k)  # (V^3, 3, V)
    out = {}
    for i, c in enumerate(conts):
        p = 1.0
        for j, t in enumerate(c):
            p *= float(probs[i, j, t])
        out[c] = p
    return out


def chi_square(counts: Counter, probs: dict[tuple[int, ...], float], n: int) -> tuple[float, int, float]:
    """Pearson's statistic, degrees of freedom and p-value; cells expecting < 5 draws are pooled."""
    big = [c for c, p in probs.items() if p * n >= 5]
    obs = [counts[c] for c in big]
    exp = [probs[c] * n for c in big]
    rest_p = 1.0 - sum(probs[c] for c in big)
    if rest_p * n >= 1:
        obs.append(n - sum(obs))
        exp.append(rest_p * n)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, pvalue


@pytest.mark.parametrize("vocab, model_seed, temperature, top_k, config", [
    (3, 1, 1.0, 0, dict(speculative="1:2")),                                 # fixed-round drafts
    (4, 5, 1.0, 2, dict(speculative="1:2")),                                 # top-k: q's support is not p's
    (3, 1, 1.0, 0, dict(speculative="exit:2", exit="entropy:0.15")),         # drafts of 1-4 rounds by exit
], ids=["1:2", "1:2-top_k", "exit:2"])
def test_speculative_sampling_draws_from_the_full_depth_distribution(vocab, model_seed, temperature, top_k, config):
    model = tiny_model(vocab, model_seed)
    want = exact_joint(model, temperature, top_k)
    assert abs(sum(want.values()) - 1) < 1e-9
    # the test has power only if the one-round draft differs from the target where drafts are made
    with torch.no_grad():
        ctx = torch.tensor([PROMPT + [t] for t in range(vocab)])
        p = target_probs(model(ctx, ROUNDS).logits[:, -1], temperature, top_k)
        q = target_probs(model(ctx, 1).logits[:, -1], temperature, top_k)
    assert float(0.5 * (p - q).abs().sum(-1).min()) > 0.1

    eng = Engine(model, None, GenerationConfig(**config))
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(DRAWS):
        sp = SamplingParams(max_new_tokens=NEW, temperature=temperature, top_k=top_k, seed=seed, stop_at_eos=False)
        got = eng.generate([PROMPT], sp)[0]
        assert len(got.tokens) == NEW
        counts[tuple(got.tokens[:TESTED])] += 1
        drafted += got.stats["speculative"]["drafted"]
        accepted += got.stats["speculative"]["accepted"]
    outside = {c: n for c, n in counts.items() if want[c] == 0}
    assert not outside, f"sampled continuations the target never produces: {outside}"
    stat, df, pvalue = chi_square(counts, want, DRAWS)
    assert pvalue > P_MIN, f"chi-square {stat:.1f} on {df} df (p = {pvalue:.3g}): not the target distribution"
    assert 0 < accepted < drafted          # both acceptance and rejection (the residual) were exercised


def test_the_chi_square_test_rejects_a_distribution_that_is_slightly_off():
    """The statistic itself: exact target frequencies pass, frequencies of a mildly perturbed
    distribution (total variation 0.15) at the same draw count fail."""
    model = tiny_model(3, 1)
    want = exact_joint(model, 1.0, 0)
    exact = Counter({c: round(p * DRAWS) for c, p in want.items()})
    n = sum(exact.values())
    assert chi_square(exact, want, n)[2] > 0.99
    cells = sorted(want, key=want.get, reverse=True)
    shifted = Counter(exact)
    moved = int(0.15 * n)
    shifted[cells[0]] += moved
    for c in cells[1:]:                                                  # take the mass from the rest
        take = min(shifted[c], moved)
        shifted[c] -= take
        moved -= take
    assert chi_square(shifted, want, n)[2] < P_MIN
