"""Tests for looplm/halting/hazards.py: exit distribution maths, exit losses and exit policies.

Property tests (hypothesis) cover the hazard/mass/CDF conversions on arbitrary gates, including
saturated ones (exactly 0 and 1). Everything else uses small constructed examples whose expected
values are worked out by hand with plain Python math, so a wrong convention shows up as a number.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from looplm.errors import UserError
from looplm.halting import (
    ExitController,
    ExitPolicy,
    LearnedExitTerms,
    act_mixture,
    exit_cdf,
    first_exit_round,
    geometric_prior,
    hazards_to_masses,
    learned_exit_loss,
    learned_exit_terms,
    masses_to_hazards,
    parse_exit_policy,
    stage2_gate_loss,
    successive_kl,
    token_entropy,
    weighted_round_loss,
)

F64 = torch.float64
fast = settings(max_examples=150, deadline=None)

# a hazard: any float in [0, 1], with the saturated ends drawn often on purpose
hazard = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0, allow_subnormal=False))


@st.composite
def hazard_batches(draw: st.DrawFn) -> torch.Tensor:
    """(B, R) float64 hazards, 1 <= B <= 3, 1 <= R <= 8."""
    R = draw(st.integers(1, 8))
    rows = draw(st.lists(st.lists(hazard, min_size=R, max_size=R), min_size=1, max_size=3))
    return torch.tensor(rows, dtype=F64)


@st.composite
def mass_batches(draw: st.DrawFn) -> torch.Tensor:
    """(B, R) float64 exit distributions, some with exact zeros (incl. zero tails)."""
    R = draw(st.integers(1, 8))
    weight = st.one_of(st.just(0.0), st.floats(0.0, 1.0, allow_subnormal=False))
    rows = draw(st.lists(st.lists(weight, min_size=R, max_size=R), min_size=1, max_size=3))
    m = torch.tensor(rows, dtype=F64)
    total = m.sum(-1, keepdim=True)
    onehot = torch.zeros_like(m)
    onehot[:, 0] = 1.0
    return torch.where(total > 1e-300, m / total.clamp_min(1e-300), onehot)  # a denormal total would not normalise


# -----------------------------------------------------------------------------
# hazards <-> masses <-> CDF


@fast
@given(hazard_batches())
def test_masses_are_a_distribution_and_last_takes_survival(h: torch.Tensor) -> None:
    p = hazards_to_masses(h)
    assert p.shape == h.shape
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(h.shape[0], dtype=F64), atol=1e-6, rtol=0)
    for row_h, row_p in zip(h.tolist(), p.tolist()):
        survival = math.prod(1.0 - x for x in row_h[:-1])   # the last hazard is never read
        assert row_p[-1] == pytest.approx(survival, abs=1e-12)


@fast
@given(hazard_batches())
def test_masses_sum_to_one_in_float32_too(h: torch.Tensor) -> None:
    p = hazards_to_masses(h.float())
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(h.shape[0]), atol=1e-6, rtol=0)


@fast
@given(hazard_batches())
def test_hazards_masses_hazards_round_trip_where_alive(h: torch.Tensor) -> None:
    back = masses_to_hazards(hazards_to_masses(h))
    R = h.shape[-1]
    for row_h, row_back in zip(h.tolist(), back.tolist()):
        survival_before = 1.0
        for t in range(R - 1):                               # rounds < T
            if survival_before > 0:
                assert row_back[t] == pytest.approx(row_h[t], abs=1e-9, rel=1e-6)
            else:
                assert row_back[t] == 1.0                    # defined as 1 once nothing is left
            survival_before *= 1.0 - row_h[t]
        assert row_back[-1] == 1.0                           # forced exit


@fast
@given(mass_batches())
def test_masses_hazards_masses_round_trip(p: torch.Tensor) -> None:
    h = masses_to_hazards(p)
    assert ((h >= 0) & (h <= 1)).all()
    assert (h[:, -1] == 1).all()
    torch.testing.assert_close(hazards_to_masses(h), p, atol=1e-9, rtol=0)


def test_uniform_over_four_rounds_both_ways() -> None:
    h = torch.tensor([1 / 4, 1 / 3, 1 / 2, 0.77], dtype=F64)   # last value is ignored (forced)
    torch.testing.assert_close(hazards_to_masses(h), torch.full((4,), 0.25, dtype=F64))
    torch.testing.assert_close(
        masses_to_hazards(torch.full((4,), 0.25, dtype=F64)),
        torch.tensor([1 / 4, 1 / 3, 1 / 2, 1.0], dtype=F64),
    )
    # and it is *not* four hazards of 1/4
    p = hazards_to_masses(torch.full((4,), 0.25, dtype=F64))
    assert not torch.allclose(p, torch.full((4,), 0.25, dtype=F64))


@fast
@given(hazard_batches())
def test_cdf_monotone_and_ends_at_one(h: torch.Tensor) -> None:
    cdf = exit_cdf(h)
    assert (cdf[:, 1:] >= cdf[:, :-1]).all()
    assert (cdf[:, -1] == 1).all()
    assert ((cdf >= 0) & (cdf <= 1)).all()
    torch.testing.assert_close(cdf, hazards_to_masses(h).cumsum(-1), atol=1e-9, rtol=0)


def test_single_round_takes_all_mass() -> None:
    assert hazards_to_masses(torch.tensor([[0.3]])).tolist() == [[1.0]]
    assert masses_to_hazards(torch.tensor([[1.0]])).tolist() == [[1.0]]


def test_leading_dims_are_kept() -> None:
    h = torch.rand(2, 5, 4)
    assert hazards_to_masses(h).shape == (2, 5, 4)
    assert exit_cdf(h).shape == (2, 5, 4)
    assert masses_to_hazards(hazards_to_masses(h)).shape == (2, 5, 4)


# -----------------------------------------------------------------------------
# losses


def test_weighted_round_loss_seed_example() -> None:
    losses = torch.tensor([0.8, 0.3])
    assert weighted_round_loss(losses, [0.25, 0.75]).item() == pytest.approx(0.425)
    assert weighted_round_loss(losses, torch.tensor([0.25, 0.75])).item() == pytest.approx(0.425)
    # per token, then averaged
    batch = torch.tensor([[0.8, 0.3], [0.4, 0.2]])
    per_tok = weighted_round_loss(batch, [0.25, 0.75], reduce=False)
    torch.testing.assert_close(per_tok, torch.tensor([0.425, 0.25]))
    assert weighted_round_loss(batch, [0.25, 0.75]).item() == pytest.approx((0.425 + 0.25) / 2)


def test_weighted_round_loss_rejects_bad_weights() -> None:
    with pytest.raises(UserError, match="round weights"):
        weighted_round_loss(torch.tensor([0.8, 0.3]), [1.0])
    with pytest.raises(UserError, match="round weights"):
        weighted_round_loss(torch.tensor([0.8, 0.3]), [1.0, -0.5])


def test_learned_exit_loss_seed_example_beta_zero() -> None:
    losses = torch.tensor([[0.8, 0.3]])
    masses = torch.tensor([[0.25, 0.75]])
    for prior in ("none", "uniform", "geometric"):
        assert learned_exit_loss(losses, masses, beta=0.0, prior=prior).item() == pytest.approx(0.425)


def test_entropy_regulariser_sign() -> None:
    losses = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    spread = torch.full((1, 4), 0.25)
    peaked = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    base = learned_exit_loss(losses, spread, beta=0.0).item()
    # beta > 0 rewards spread-out masses: subtracts beta * ln 4
    assert learned_exit_loss(losses, spread, beta=0.1).item() == pytest.approx(base - 0.1 * math.log(4))
    # a one-hot distribution has zero entropy, so nothing changes
    assert learned_exit_loss(losses, peaked, beta=0.1).item() == pytest.approx(base)
    terms = learned_exit_terms(losses, spread, beta=0.1)
    assert isinstance(terms, LearnedExitTerms)
    assert terms.regulariser.item() < 0
    assert terms.total.item() == pytest.approx(terms.task.item() + terms.regulariser.item())


def test_kl_to_uniform_is_zero_for_uniform_masses_and_positive_otherwise() -> None:
    losses = torch.tensor([[0.5, 0.4, 0.3]])
    uniform = torch.full((1, 3), 1 / 3)
    terms = learned_exit_terms(losses, uniform, beta=1.0, prior="uniform")
    assert terms.regulariser.item() == pytest.approx(0.0, abs=1e-6)
    skewed = torch.tensor([[0.5, 0.5, 0.0]])
    expected = 2 * 0.5 * math.log(0.5 / (1 / 3))        # the zero mass contributes 0
    got = learned_exit_terms(losses, skewed, beta=2.0, prior="uniform").regulariser.item()
    assert got == pytest.approx(2.0 * expected, rel=1e-5)


def test_geometric_prior_sums_to_one_and_is_geometric() -> None:
    for R, lam in [(1, 0.5), (4, 0.5), (8, 0.1), (3, 0.9)]:
        q = geometric_prior(R, lam, dtype=F64)
        assert q.sum().item() == pytest.approx(1.0, abs=1e-12)
        if R > 1:
            torch.testing.assert_close(q[1:] / q[:-1], torch.full((R - 1,), 1 - lam, dtype=F64))
    # KL to the geometric prior is zero exactly at the prior
    q = geometric_prior(4, 0.3)
    reg = learned_exit_terms(torch.zeros(1, 4), q[None], beta=1.0, prior="geometric", geometric_lambda=0.3)
    assert reg.regulariser.item() == pytest.approx(0.0, abs=1e-6)


def test_learned_exit_reduce_false_and_bad_settings() -> None:
    losses, masses = torch.rand(2, 3, 4), hazards_to_masses(torch.rand(2, 3, 4))
    assert learned_exit_loss(losses, masses, 0.1, reduce=False).shape == (2, 3)
    assert learned_exit_loss(losses, masses, 0.1).shape == ()
    with pytest.raises(UserError, match="prior"):
        learned_exit_loss(losses, masses, 0.1, prior="laplace")
    with pytest.raises(UserError, match="beta"):
        learned_exit_loss(losses, masses, -1.0)
    with pytest.raises(UserError, match="geometric_lambda"):
        learned_exit_loss(losses, masses, 0.1, prior="geometric", geometric_lambda=1.5)


def test_gradients_stay_finite_with_saturated_gates() -> None:
    logits = torch.tensor([[-50.0, 0.0, 50.0, 3.0], [50.0, 50.0, -50.0, 0.0]], requires_grad=True)
    masses = hazards_to_masses(torch.sigmoid(logits))
    for prior in ("none", "uniform", "geometric"):
        logits.grad = None
        learned_exit_loss(torch.rand(2, 4), masses, beta=0.1, prior=prior).backward(retain_graph=True)
        assert torch.isfinite(logits.grad).all()


def test_act_mixture_is_a_state_mixture_not_a_loss_mixture() -> None:
    masses = torch.tensor([[0.25, 0.75]])                     # (B=1, R=2)
    states = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])         # (B=1, R=2, D=2)
    torch.testing.assert_close(act_mixture(states, masses), torch.tensor([[0.25, 1.5]]))
    # scalar-per-round form
    torch.testing.assert_close(act_mixture(torch.tensor([[0.8, 0.3]]), masses), torch.tensor([0.425]))
    # loss of the mixed logits differs from the mixed per-round losses
    target = torch.tensor([0])
    mixed_logits = act_mixture(states, masses)
    loss_of_mix = torch.nn.functional.cross_entropy(mixed_logits, target)
    round_losses = torch.stack([torch.nn.functional.cross_entropy(states[:, r], target) for r in range(2)], -1)
    mix_of_losses = learned_exit_loss(round_losses, masses, beta=0.0)
    assert not torch.isclose(loss_of_mix, mix_of_losses)


def test_stage2_gate_loss_by_hand() -> None:
    # one token, three rounds: round 2 helps a lot, round 3 barely (below gamma)
    L = [2.0, 1.5, 1.499]
    lam = [0.2, 0.6, 0.9]                                     # lam[2] is the forced round: unused
    k, gamma = 50.0, 0.005

    def sig(x: float) -> float:
        return 1.0 / (1.0 + math.exp(-x))

    def bce(pred: float, target: float) -> float:
        return -(target * math.log(pred) + (1 - target) * math.log(1 - pred))

    # I_t paired with the gate read after round t-1: continuation prob 1 - lam[t-2]
    w2 = sig(k * (max(0.0, L[0] - L[1]) - gamma))
    w3 = sig(k * (max(0.0, L[1] - L[2]) - gamma))
    expected = (bce(1 - lam[0], w2) + bce(1 - lam[1], w3)) / 2

    losses = torch.tensor([L], dtype=F64)
    hazards = torch.tensor([lam], dtype=F64, requires_grad=True)
    got = stage2_gate_loss(losses, hazards, k=k, gamma=gamma)
    assert got.item() == pytest.approx(expected, rel=1e-9)
    # hazards of length R-1 give the same answer
    assert stage2_gate_loss(losses, hazards[:, :2]).item() == pytest.approx(expected, rel=1e-9)
    got.backward()
    assert hazards.grad[0, 2].item() == 0.0                   # the forced gate is not trained


def test_stage2_gate_loss_clamps_negative_improvement_and_detaches_losses() -> None:
    L = torch.tensor([[1.0, 1.2]], requires_grad=True)        # round 2 made it worse
    hazards = torch.tensor([[0.3, 1.0]])
    w = 1.0 / (1.0 + math.exp(-50.0 * (0.0 - 0.005)))
    expected = -(w * math.log(0.7) + (1 - w) * math.log(0.3))
    got = stage2_gate_loss(L, hazards)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    assert not got.requires_grad                              # the LM losses get no gradient
    assert stage2_gate_loss(torch.tensor([[1.0]]), torch.tensor([[1.0]])).item() == 0.0


# -----------------------------------------------------------------------------
# exit policies


def test_parse_and_str_round_trip() -> None:
    for text in ["fixed:4", "quantile:0.5", "quantile:1.0", "entropy:0.0", "kl:1e-05", "entropy:2.5"]:
        policy = parse_exit_policy(text)
        assert str(policy) == text
        assert parse_exit_policy(str(policy)) == policy
    assert parse_exit_policy(" Fixed : 3 ") == ExitPolicy("fixed", 3)
    assert parse_exit_policy("quantile:1") == ExitPolicy("quantile", 1.0)
    p = parse_exit_policy("kl:0.01", min_rounds=2, exit_in_prefill=True)
    assert (p.min_rounds, p.exit_in_prefill) == (2, True)


@pytest.mark.parametrize(
    "text",
    ["", "x", "fixed", "fixed:", "fixed:0", "fixed:2.5", "fixed:-1", "quantile:0", "quantile:1.5",
     "quantile:abc", "entropy:-0.1", "kl:-1", "kl:nan", "entropy:inf", "ponder:3", "fixed:3:4"],
)
def test_parse_errors(text: str) -> None:
    with pytest.raises(UserError, match="exit policy"):
        parse_exit_policy(text)


def test_parse_error_message_lists_the_choices() -> None:
    with pytest.raises(UserError) as err:
        parse_exit_policy("x")
    assert str(err.value) == "exit policy 'x': expected fixed:R, quantile:Q (0<Q<=1), entropy:TAU or kl:EPS"


def test_bad_min_rounds() -> None:
    with pytest.raises(UserError, match="min_rounds"):
        ExitPolicy("fixed", 2, min_rounds=0)


def _exit_rounds(policy: ExitPolicy, T: int, **per_round: torch.Tensor) -> list[int]:
    """Drive ExitController round by round like the inference loop: each round only the tokens
    still active are passed, with their hazard, and their readout where it asks for one."""
    hazards, logits = per_round.get("hazards"), per_round.get("logits")
    ref = hazards if hazards is not None else logits
    n = ref.shape[0]
    ctl = ExitController(policy, T, n)
    for t in range(1, T + 1):
        ids = ctl.active.nonzero().squeeze(1)
        if ids.numel() == 0:
            break
        stop = ctl.decide(t, ids, hazard=None if hazards is None else hazards[ids, t - 1],
                          logits=logits[ids, t - 1] if logits is not None and ctl.needs_readout(t) else None)
        assert stop.shape == ids.shape
    assert not ctl.active.any()
    return ctl.exit_round.tolist()


def _stops_at(policy: ExitPolicy, t: int, T: int, prefill: bool = False) -> bool:
    """Whether a fixed policy stops a token at round t, rounds 1..t-1 having said no."""
    ctl = ExitController(policy, T, 1, prefill=prefill)
    for r in range(1, t):
        assert not ctl.decide(r).item()
    return bool(ctl.decide(t).item())


def test_fixed_policy() -> None:
    assert _stops_at(ExitPolicy("fixed", 2), 1, 4) is False
    assert _stops_at(ExitPolicy("fixed", 2), 2, 4) is True
    assert first_exit_round(ExitPolicy("fixed", 2), 4).item() == 2
    # R beyond the model's depth: forced out at the last allowed round
    assert first_exit_round(ExitPolicy("fixed", 10), 4).item() == 4


def test_quantile_policy_picks_first_round_with_cdf_at_least_q() -> None:
    hazards = torch.tensor([[0.1, 0.5, 0.9, 0.0]])            # CDF = 0.1, 0.55, 0.955, 1
    assert _exit_rounds(ExitPolicy("quantile", 0.5), 4, hazards=hazards) == [2]
    assert first_exit_round(ExitPolicy("quantile", 0.5), 4, hazards=hazards).tolist() == [2]
    assert first_exit_round(ExitPolicy("quantile", 0.1), 4, hazards=hazards).tolist() == [1]
    assert first_exit_round(ExitPolicy("quantile", 0.96), 4, hazards=hazards).tolist() == [4]
    assert first_exit_round(ExitPolicy("quantile", 1.0), 4, hazards=hazards).tolist() == [4]
    # per token
    two = torch.tensor([[0.1, 0.5, 0.9, 0.0], [0.6, 0.0, 0.0, 0.0]])
    assert first_exit_round(ExitPolicy("quantile", 0.5), 4, hazards=two).tolist() == [2, 1]


def _peaked_logits(peaks: list[float], V: int = 4) -> torch.Tensor:
    """(1, R, V) logits; round r puts logit peaks[r] on token 0 and 0 elsewhere."""
    x = torch.zeros(1, len(peaks), V, dtype=F64)
    x[0, :, 0] = torch.tensor(peaks, dtype=F64)
    return x


def _entropy_by_hand(peak: float, V: int = 4) -> float:
    z = math.exp(peak) + (V - 1)
    probs = [math.exp(peak) / z] + [1 / z] * (V - 1)
    return -sum(p * math.log(p) for p in probs)


def _kl_by_hand(a: float, b: float, V: int = 4) -> float:
    def probs(peak: float) -> list[float]:
        z = math.exp(peak) + (V - 1)
        return [math.exp(peak) / z] + [1 / z] * (V - 1)
    p, q = probs(a), probs(b)
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))


def test_entropy_policy_stops_where_entropy_crosses_tau() -> None:
    peaks = [0.0, 2.0, 4.0, 8.0]
    H = [_entropy_by_hand(x) for x in peaks]                  # strictly decreasing
    logits = _peaked_logits(peaks)
    torch.testing.assert_close(token_entropy(logits)[0], torch.tensor(H, dtype=F64))
    tau = (H[1] + H[2]) / 2
    assert _exit_rounds(ExitPolicy("entropy", tau), 4, logits=logits) == [3]
    assert first_exit_round(ExitPolicy("entropy", tau), 4, logits=logits).tolist() == [3]
    # strict "<": a threshold exactly at round 3's entropy waits for round 4
    assert first_exit_round(ExitPolicy("entropy", H[2]), 4, logits=logits).tolist() == [4]
    # TAU = 0 never exits early; only the forced last round
    assert first_exit_round(ExitPolicy("entropy", 0.0), 4, logits=logits).tolist() == [4]


def test_kl_policy_stops_where_successive_kl_crosses_eps() -> None:
    peaks = [0.0, 3.0, 3.5, 3.6, 3.61]
    kls = [_kl_by_hand(peaks[t], peaks[t - 1]) for t in range(1, 5)]   # rounds 2..5, decreasing
    logits = _peaked_logits(peaks)
    got = [successive_kl(logits[0, t], logits[0, t - 1]).item() for t in range(1, 5)]
    assert got == pytest.approx(kls, rel=1e-9)
    eps = (kls[1] + kls[2]) / 2                               # crossed first at round 4
    assert _exit_rounds(ExitPolicy("kl", eps), 5, logits=logits) == [4]
    # never at round 1, even with identical logits everywhere and a huge EPS
    same = torch.zeros(1, 3, 4)
    ctl = ExitController(ExitPolicy("kl", 100.0), 3, 1)
    assert ctl.needs_readout(1) and ctl.decide(1, logits=same[:, 0]).tolist() == [False]
    assert first_exit_round(ExitPolicy("kl", 100.0), 3, logits=same).tolist() == [2]


def test_min_rounds_and_forced_last_round() -> None:
    hazards = torch.tensor([[0.99, 0.99, 0.99, 0.99]])
    assert first_exit_round(ExitPolicy("quantile", 0.5, min_rounds=3), 4, hazards=hazards).tolist() == [3]
    assert first_exit_round(ExitPolicy("fixed", 1, min_rounds=2), 4).item() == 2
    logits = _peaked_logits([9.0, 9.0, 9.0])
    assert first_exit_round(ExitPolicy("entropy", 10.0, min_rounds=2), 3, logits=logits).tolist() == [2]
    # min_rounds beyond T: the last allowed round still exits
    assert first_exit_round(ExitPolicy("fixed", 1, min_rounds=9), 4).item() == 4
    # at t = T everything exits whatever the policy says
    assert _exit_rounds(ExitPolicy("quantile", 1.0), 4, hazards=torch.zeros(2, 4)) == [4, 4]


def test_prefill_runs_all_rounds_unless_allowed() -> None:
    assert _stops_at(ExitPolicy("fixed", 1), 1, 4, prefill=True) is False
    assert _stops_at(ExitPolicy("fixed", 1), 4, 4, prefill=True) is True
    assert _stops_at(ExitPolicy("fixed", 1, exit_in_prefill=True), 1, 4, prefill=True) is True
    # entropy in a closed prefill reads out only once, at the last round
    assert ExitController(ExitPolicy("entropy", 9.0), 4, 1, prefill=True).read_rounds == {4}


def test_controller_state_across_rounds() -> None:
    """The state the controller carries: the running survival (quantile), only the tokens
    passed are updated, may_exit holds the others to the last round, kl compares with the
    previous round's readout of the same token, and it asks for readouts only where they decide."""
    # quantile: token 0 gets hazards 0.5, 0.5 -> CDF 0.5, 0.75; token 1 gets 0.2, 0.2 -> 0.2, 0.36
    ctl = ExitController(ExitPolicy("quantile", 0.7), 4, 3, may_exit=torch.tensor([True, True, False]))
    assert ctl.needs_hazard and not ctl.read_rounds
    assert ctl.decide(1, torch.tensor([0, 1, 2]), hazard=torch.tensor([0.5, 0.2, 0.99])).tolist() == [False, False, False]
    assert ctl.decide(2, torch.tensor([1, 0, 2]), hazard=torch.tensor([0.2, 0.5, 0.99])).tolist() == [False, True, False]
    torch.testing.assert_close(ctl.survival, torch.tensor([0.25, 0.64, 0.01 * 0.01]))
    assert ctl.active.tolist() == [False, True, True] and ctl.exit_round[0].item() == 2
    # token 2 (CDF 0.9999) may not exit; round 4 forces both remaining ones out
    assert ctl.decide(3, torch.tensor([1, 2]), hazard=torch.tensor([0.6, 0.5])).tolist() == [True, False]  # 0.744
    assert ctl.decide(4, torch.tensor([2]), hazard=torch.tensor([0.5])).tolist() == [True]
    assert ctl.exit_round.tolist() == [2, 3, 4]
    # kl with min_rounds 3 of 5: decisions at 3, 4; readouts at 2, 3, 4 (the round before each) and 5
    kl = ExitController(ExitPolicy("kl", 1e-3, min_rounds=3), 5, 2)
    assert kl.decide_rounds == {3, 4} and kl.read_rounds == {2, 3, 4, 5}
    a, b = _peaked_logits([1.0])[0], _peaked_logits([3.0])[0]                   # (1, V) each
    assert not kl.needs_readout(1) and kl.decide(1).tolist() == [False, False]
    kl.decide(2, logits=torch.cat([a, a]))
    # round 3: token 0 repeats its round-2 distribution (KL 0), token 1 moves (KL > EPS)
    assert kl.decide(3, logits=torch.cat([a, b])).tolist() == [True, False]
    torch.testing.assert_close(kl.logits, torch.cat([a, b]))                    # the exit readouts


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["fixed:3", "quantile:0.5", "entropy:1.2", "kl:0.05"]), min_rounds=st.integers(1, 3),
       starts=st.lists(st.integers(0, 3), min_size=2, max_size=6), seed=st.integers(0, 1000))
def test_one_call_with_each_tokens_round_decides_as_one_call_per_round(kind, min_rounds, starts, seed):
    """Continuous depth batching decides tokens at different rounds in one call (`decide(r=(M,) rounds)`): the
    same stops, exit rounds and state as deciding each round's tokens separately with an int round."""
    from looplm.halting import ExitController, parse_exit_policy
    policy = parse_exit_policy(kind, min_rounds=min_rounds)
    R, n, V = 5, len(starts), 7
    g = torch.Generator().manual_seed(seed)
    hazards = torch.rand(n, R, generator=g)                  # token t's hazard and readout at each round
    logits = torch.randn(n, R, V, generator=g) * 2
    ref, one = ExitController(policy, R, n), ExitController(policy, R, n)
    rounds = [0] * n                                         # rounds each token has run
    for step in range(12):
        live = [t for t in range(n) if step >= starts[t] and ref.active[t] and rounds[t] < R]
        if not live:
            continue
        for t in live:
            rounds[t] += 1
        ids = torch.tensor(live)
        r = torch.tensor([rounds[t] for t in live])
        read = ref.reads[r]
        lg = torch.stack([logits[t, rounds[t] - 1] for t in live])
        h = torch.stack([hazards[t, rounds[t] - 1] for t in live])
        got = one.decide(r, ids, hazard=h, logits=lg if bool(read.any()) else None, read=read)
        want = torch.zeros(len(live), dtype=torch.bool)
        for x in sorted(set(r.tolist())):                    # the reference: one int call per round group
            sel = (r == x).nonzero().squeeze(1)
            want[sel] = ref.decide(x, ids[sel], hazard=h[sel], logits=lg[sel] if ref.needs_readout(x) else None)
        assert torch.equal(got, want)
    assert torch.equal(one.exit_round, ref.exit_round) and torch.equal(one.active, ref.active)
    if ref.logits is not None:
        assert torch.equal(one.logits, ref.logits)
