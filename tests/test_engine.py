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
        if s.requires_grad:          # rounds before the window run under no_grad: nothing to retain
            s.retain_grad()
        states.append(s)
        return s

    run = looplm.unroll(step, torch.tensor(0.0), 5, backward_window=2)
    run.state.backward()
    assert not any(s.requires_grad for s in states[:3])           # before the window: no graph at all
    assert states[3].grad is not None and states[4].grad is not None
    assert run.grad_rounds == (4, 5)


def test_readout_before_window_trains_only_the_readout():
    """The seeds' example, read out at rounds 2 and 4 with a window of the last 2 rounds. The round-2
    readout lies before the window: its loss must not reach w through rounds 1-2, so dL/dw is the
    truncated round-4 term alone (-0.3125), not that plus (s2 - 2) * ds2/dw = -0.5 * 1."""
    w = torch.tensor(0.5, requires_grad=True)
    c = torch.tensor(1.0, requires_grad=True)          # a readout weight: y = c * s
    run = looplm.unroll(lambda s, r: w * s + 1.0, torch.tensor(0.0), 4, backward_window=2,
                        readout_rounds=(2, 4), readout=lambda s, r: c * s)
    loss = sum((y - 2) ** 2 / 2 for y in run.readouts.values())
    loss.backward()
    assert run.readouts[2].item() == 1.5 and run.readouts[4].item() == 1.875
    assert w.grad.item() == pytest.approx(-0.3125, abs=1e-12)
    # the readout weight still learns from both readouts: (1.5-2)*1.5 + (1.875-2)*1.875
    assert c.grad.item() == pytest.approx(-0.5 * 1.5 - 0.125 * 1.875, abs=1e-12)
    assert run.grad_rounds == (3, 4) and run.readout_only_rounds == (2,)


def test_keep_states():
    run = looplm.unroll(lambda s, r: s + r, 0, 4, keep_states=True)
    assert run.states == [1, 3, 6, 10] and run.state == 10


def test_invalid_rounds():
    with pytest.raises(ValueError):
        looplm.unroll(lambda s, r: s, 0, 0)


def test_a_bf16_model_scores_as_its_full_forward():
    """--dtype bf16: the packed backend multiplies bf16 weights through F.linear as the eager model does (the
    fp32 row layouts are not built for them), so the engine's prefill scores a prompt as the eager bf16 forward
    does, to bf16's rounding, and its first greedy token is the forward's."""
    from looplm.inference.engine import Engine, SamplingParams
    torch.manual_seed(0)
    over = {"model.d_model": 64, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
            "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 2, "backward.window": "all",
            "data.seq_len": 32}
    m = looplm.build_model(looplm.load_recipe("quickstart", overrides=over)).eval().to(torch.bfloat16)
    prompt = [5, 17, 33, 2, 99, 100, 7, 8, 9, 200, 31, 64]
    engine = Engine(m)
    got = torch.tensor(engine.prompt_logprobs([prompt])[0][0][1:])
    with torch.no_grad():
        logp = torch.log_softmax(m(torch.tensor([prompt])).logits.float(), -1)[0]
    want = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (got - want).abs().max().item() < 0.05          # bf16 keeps 8 bits: about 2 significant digits
    first = engine.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0.0))[0].tokens[0]
    assert first == int(logp[-1].argmax())


def test_under_bf16_autocast_the_packed_products_stay_fp32():
    """Under torch.autocast(bf16) the engine's fp32 layouts multiply bf16 rows in fp32 (not every weight
    matrix cast at every call): each product is the fp32 product of the bf16 rows, rounded once to bf16."""
    from looplm.inference.kernels import PackedOps
    torch.manual_seed(0)
    over = {"model.d_model": 64, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
            "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 2, "backward.window": "all",
            "data.seq_len": 32}
    m = looplm.build_model(looplm.load_recipe("quickstart", overrides=over)).eval()
    ops = PackedOps(m)
    w = m.core[0].mlp.down.weight
    for rows in (1, 3, 40):
        x = torch.randn(rows, w.shape[1]).to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = ops.linear(x, w)
        assert got.dtype == torch.bfloat16
        ref = (x.float() @ w.t()).detach()                 # the fp32 product of the bf16 rows
        assert ((got.float() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-6).all()     # one bf16 rounding of it
        with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 rows (a norm's output): the fp32 product itself
            got32 = ops.linear(x.float(), w)
        assert got32.dtype == torch.float32 and torch.allclose(got32, ref, rtol=1e-5, atol=1e-5)
