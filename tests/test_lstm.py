"""Tests for looplm.model.lstm: the hand-written cell against a loop written here and torch.nn.LSTM."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from looplm.errors import UserError
from looplm.model.lstm import LSTMLM, copy_to_torch_lstm, lstm_sequence, lstm_step


def random_weights(D: int, H: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(4 * H, H + D, generator=g, dtype=dtype) * 0.5
    b = torch.randn(4 * H, generator=g, dtype=dtype) * 0.5
    return W, b


def reference_loop(x, W, b, h, c):
    """The LSTM equations written out scalar-gate by scalar-gate, independently of lstm.py."""
    H = h.shape[-1]
    hs, cs = [], []
    for t in range(x.shape[0]):
        hx = torch.cat([h, x[t]], dim=1)
        f = torch.sigmoid(hx @ W[0:H].T + b[0:H])
        i = torch.sigmoid(hx @ W[H:2 * H].T + b[H:2 * H])
        g = torch.tanh(hx @ W[2 * H:3 * H].T + b[2 * H:3 * H])
        o = torch.sigmoid(hx @ W[3 * H:].T + b[3 * H:])
        c = f * c + i * g
        h = o * torch.tanh(c)
        hs.append(h)
        cs.append(c)
    return torch.stack(hs), torch.stack(cs), (h, c)


def test_sequence_matches_reference_loop_zero_state():
    T, B, D, H = 7, 3, 5, 4
    W, b = random_weights(D, H)
    x = torch.randn(T, B, D, generator=torch.Generator().manual_seed(1))
    hs, cs, (h, c) = lstm_sequence(x, W, b)
    rhs, rcs, (rh, rc) = reference_loop(x, W, b, torch.zeros(B, H), torch.zeros(B, H))
    assert hs.shape == cs.shape == (T, B, H)
    torch.testing.assert_close(hs, rhs, atol=1e-6, rtol=0)
    torch.testing.assert_close(cs, rcs, atol=1e-6, rtol=0)
    torch.testing.assert_close(h, rh, atol=1e-6, rtol=0)
    torch.testing.assert_close(c, rc, atol=1e-6, rtol=0)
    # the final pair is the last row of the per-step states
    assert torch.equal(h, hs[-1]) and torch.equal(c, cs[-1])


def test_sequence_matches_reference_loop_given_state_and_lstm_step():
    T, B, D, H = 4, 2, 3, 6
    W, b = random_weights(D, H, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, B, D, generator=g)
    h0, c0 = torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)
    hs, cs, (h, c) = lstm_sequence(x, W, b, state=(h0, c0))
    rhs, rcs, _ = reference_loop(x, W, b, h0, c0)
    torch.testing.assert_close(hs, rhs, atol=1e-6, rtol=0)
    torch.testing.assert_close(cs, rcs, atol=1e-6, rtol=0)
    # lstm_step repeated by hand gives the same thing
    sh, sc = h0, c0
    for t in range(T):
        sh, sc = lstm_step(x[t], sh, sc, W, b)
    torch.testing.assert_close(sh, h, atol=1e-6, rtol=0)
    torch.testing.assert_close(sc, c, atol=1e-6, rtol=0)


def test_gate_order_is_f_i_g_o():
    # One unit, no input weights; only the bias picks the gates. Saturate f=0 (forget),
    # i=1, g=tanh(big)=1, o=1 -> c' = 1 regardless of c, h' = tanh(1).
    H, D = 1, 1
    W = torch.zeros(4 * H, H + D)
    b = torch.tensor([-50.0, 50.0, 50.0, 50.0])
    h, c = lstm_step(torch.zeros(1, D), torch.zeros(1, H), torch.full((1, H), 7.0), W, b)
    torch.testing.assert_close(c, torch.ones(1, 1))
    torch.testing.assert_close(h, torch.tanh(torch.ones(1, 1)))


def test_matches_torch_lstm():
    T, B, D, H = 9, 4, 6, 5
    W, b = random_weights(D, H, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, B, D, generator=g)
    h0, c0 = torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)
    ref = copy_to_torch_lstm(W, b)
    for state in (None, (h0, c0)):
        hs, cs, (h, c) = lstm_sequence(x, W, b, state)
        with torch.no_grad():
            out, (th, tc) = ref(x) if state is None else ref(x, (h0[None], c0[None]))
        torch.testing.assert_close(hs, out, atol=1e-6, rtol=0)
        torch.testing.assert_close(h, th[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(c, tc[0], atol=1e-6, rtol=0)


def test_copy_is_independent_of_source():
    W, b = random_weights(2, 3)
    ref = copy_to_torch_lstm(W, b)
    before = ref.weight_ih_l0.detach().clone()
    with torch.no_grad():
        W.add_(1.0)
    assert torch.equal(ref.weight_ih_l0.detach(), before)


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 6), B=st.integers(1, 4), D=st.integers(1, 5), H=st.integers(1, 5),
       seed=st.integers(0, 2**16), with_state=st.booleans())
def test_property_matches_torch_lstm(T, B, D, H, seed, with_state):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(4 * H, H + D, generator=g, dtype=torch.float64)
    b = torch.randn(4 * H, generator=g, dtype=torch.float64)
    x = torch.randn(T, B, D, generator=g, dtype=torch.float64)
    state = (torch.randn(B, H, generator=g, dtype=torch.float64),
             torch.randn(B, H, generator=g, dtype=torch.float64)) if with_state else None
    hs, cs, (h, c) = lstm_sequence(x, W, b, state)
    ref = copy_to_torch_lstm(W, b)
    with torch.no_grad():
        out, (th, tc) = ref(x) if state is None else ref(x, (state[0][None], state[1][None]))
    torch.testing.assert_close(hs, out, atol=1e-6, rtol=0)
    torch.testing.assert_close(h, th[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(c, tc[0], atol=1e-6, rtol=0)


def test_empty_sequence():
    B, D, H = 3, 2, 4
    W, b = random_weights(D, H)
    hs, cs, (h, c) = lstm_sequence(torch.zeros(0, B, D), W, b)
    assert hs.shape == cs.shape == (0, B, H)
    assert torch.equal(h, torch.zeros(B, H)) and torch.equal(c, torch.zeros(B, H))
    h0, c0 = torch.ones(B, H), torch.full((B, H), 2.0)
    _, _, (h, c) = lstm_sequence(torch.zeros(0, B, D), W, b, (h0, c0))
    assert torch.equal(h, h0) and torch.equal(c, c0)


def test_gradients_flow_to_weights_inputs_and_early_steps():
    T, B, D, H = 5, 2, 3, 4
    W, b = random_weights(D, H)
    W.requires_grad_(True)
    b.requires_grad_(True)
    x = torch.randn(T, B, D, requires_grad=True)
    _, _, (h, _) = lstm_sequence(x, W, b)
    h.sum().backward()
    for t in (W, b, x):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    assert W.grad.abs().sum() > 0 and b.grad.abs().sum() > 0
    assert x.grad[0].abs().sum() > 0  # the first step still influences the final state


def test_bad_shapes_raise():
    W, b = random_weights(3, 4)
    with pytest.raises(ValueError, match="W must be"):
        lstm_sequence(torch.zeros(2, 1, 5), W, b)
    with pytest.raises(ValueError, match="b must be"):
        lstm_sequence(torch.zeros(2, 1, 3), W, b[:-1])
    with pytest.raises(ValueError, match="state"):
        lstm_sequence(torch.zeros(2, 1, 3), W, b, (torch.zeros(1, 3), torch.zeros(1, 3)))


def test_lstmlm_shapes_and_training_signal():
    torch.manual_seed(0)
    V, B, T = 11, 3, 7
    model = LSTMLM(V, d_embed=8, hidden=16)
    idx = torch.randint(0, V, (B, T))
    logits = model(idx)
    assert logits.shape == (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), idx.roll(-1, 1).reshape(-1))
    loss.backward()
    names = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert names == {"embed.weight", "W", "b", "head.weight", "head.bias"}
    assert model(torch.zeros(B, 0, dtype=torch.long)).shape == (B, 0, V)


def test_lstmlm_is_causal():
    torch.manual_seed(0)
    model = LSTMLM(5, 4, 6)
    idx = torch.randint(0, 5, (1, 8))
    changed = idx.clone()
    changed[0, 5] = (idx[0, 5] + 1) % 5
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_lstmlm_matches_torch_lstm_with_copied_weights():
    torch.manual_seed(0)
    model = LSTMLM(9, 5, 7)
    idx = torch.randint(0, 9, (2, 6))
    ref = copy_to_torch_lstm(model.W.detach(), model.b.detach())
    with torch.no_grad():
        out, _ = ref(model.embed(idx).transpose(0, 1))
        torch.testing.assert_close(model(idx), model.head(out.transpose(0, 1)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("args", [(0, 4, 4), (10, -1, 4), (10, 4, 2.5), (10, True, 4)])
def test_lstmlm_bad_sizes(args):
    with pytest.raises(UserError):
        LSTMLM(*args)


def test_lstmlm_fused_kernel_equals_the_equations_with_gradients():
    """LSTMLM's fused path (PyTorch's kernel on our parameters) against the equations written out here:
    the same logits, and the same gradients on every parameter."""
    torch.manual_seed(0)
    model = LSTMLM(9, 5, 7)
    with torch.no_grad():
        model.b.normal_()                   # every gate's bias distinct: a mislaid gate block shows
    idx = torch.randint(0, 9, (3, 6))
    target = torch.randn(3, 6, 9)
    assert model.fused
    fused = model(idx)
    (fused * target).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    B, H = idx.shape[0], model.hidden
    hs, _, _ = reference_loop(model.embed(idx).transpose(0, 1), model.W, model.b, torch.zeros(B, H), torch.zeros(B, H))
    ref = model.head(hs.transpose(0, 1))
    (ref * target).sum().backward()
    torch.testing.assert_close(fused, ref, atol=1e-6, rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=1e-5, msg=n)


def test_lstmlm_reads_out_at_positions_only():
    """forward(idx, at=mask): the head at the mask's positions alone — the full logits' rows there
    (row-major order, as the loss gathers its targets), the same masked loss and gradients as
    whole readouts, and the head's product on N positions, not B * T."""
    torch.manual_seed(0)
    model = LSTMLM(11, 5, 7)
    idx = torch.randint(0, 11, (3, 6))
    at = torch.zeros(3, 6, dtype=torch.bool)
    at[0, 4:] = True
    at[2, 1] = True
    full = model(idx)
    (full[at] * torch.arange(11.0)).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        got = model(idx, at=at)
    assert got.shape == (int(at.sum()), 11)
    torch.testing.assert_close(got, full[at], atol=1e-6, rtol=0)
    (got * torch.arange(11.0)).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-6, rtol=1e-6, msg=n)
    with FlopCounterMode(display=False) as whole:
        model(idx)
    skipped = 2 * (at.numel() - int(at.sum())) * model.hidden * 11      # the head's products elsewhere
    assert whole.get_total_flops() - counter.get_total_flops() == skipped
    with pytest.raises(ValueError, match="bool"):
        model(idx, at=at.long())
    with pytest.raises(ValueError, match="mask like idx"):
        model(idx, at=at[:, :3])
