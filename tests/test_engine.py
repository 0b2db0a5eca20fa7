"""The recurrence engine against the seeds' scalar example and a hand computation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import looplm


def scalar(window):
    w = torch.tensor(0.5, requires_grad=True)
    e = torch.tensor(1.0)
    run = looplm.unroll(lambda s, r: w * s + e, torch.tensor(0.0), 4, backward_window=window)
    loss = (run.state - 2) ** 2 / 2
    loss.backward()
    return run, loss.item(), w.grad.item()


def test_scalar_example_full_backprop():
    run, loss, grad = scalar(None)
    assert run.state.item() == 1.875
    assert loss == 0.0078125
    assert grad == pytest.approx(-0.34375, abs=1e-12)
    assert run.grad_rounds == (1, 2, 3, 4)


def test_scalar_example_window_after_round_two():
    run, loss, grad = scalar(2)
    assert run.state.item() == 1.875          # forward unchanged
    assert loss == 0.0078125
    assert grad == pytest.approx(-0.3125, abs=1e-12)
    assert run.grad_rounds == (3, 4)


def test_readouts_at_chosen_rounds_match_table():
    run = looplm.unroll(lambda s, r: 0.5 * s + 1.0, 0.0, 4, readout_rounds=[1, 2, 3, 4])
    assert run.readouts == {1: 1.0, 2: 1.5, 3: 1.75, 4: 1.875}   # the zh seed's worked table


@settings(max_examples=40, deadline=None)
@given(w=st.floats(-1.5, 1.5), e=st.floats(-2, 2), rounds=st.integers(1, 7), data=st.data())
def test_window_gradient_equals_hand_computation(w, e, rounds, data):
    """With window B, the state entering round R-B+1 is a constant c; then
    s_R = w^B c + e (1 + w + ... + w^(B-1)) and dL/dw follows by hand."""
    B = data.draw(st.integers(1, rounds))
    target = 0.7
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    et = torch.tensor(e, dtype=torch.float64)
    run = looplm.unroll(lambda s, r: wt * s + et, torch.tensor(0.0, dtype=torch.float64), rounds, backward_window=B)
    loss = (run.state - target) ** 2 / 2
    loss.backward()
    # hand computation
    c = 0.0
    for _ in range(rounds - B):
        c = w * c + e
    s = c
    for _ in range(B):
        s = w * s + e
    ds_dw = B * w ** (B - 1) * c + e * sum(k * w ** (k - 1) for k in range(1, B))
    assert wt.grad.item() == pytest.approx((s - target) * ds_dw, rel=1e-9, abs=1e-9)
    assert run.grad_rounds == tuple(range(rounds - B + 1, rounds + 1))


def test_no_gradient_reaches_state_before_window():
    states = []
    w = torch.tensor(0.9, requires_grad=True)

    def step(s, r):
        s = w * s + 1.0
        s.retain_grad()
        states.append(s)
        return s

    run = looplm.unroll(step, torch.tensor(0.0), 5, backward_window=2)
    run.state.backward()
    assert states[0].grad is None and states[1].grad is None and states[2].grad is None  # before the window
    assert states[3].grad is not None and states[4].grad is not None


def test_should_stop_skips_remaining_rounds():
    calls = []
    run = looplm.unroll(lambda s, r: calls.append(r) or s + 1, 0, 8, should_stop=lambda r, s, k: s >= 3)
    assert calls == [1, 2, 3] and run.rounds_run == 3 and run.state == 3


def test_invalid_rounds():
    with pytest.raises(ValueError):
        looplm.unroll(lambda s, r: s, 0, 0)
