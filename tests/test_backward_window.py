"""The backward window, measured: what `grad_rounds` and the run's records say received gradient must be
what autograd actually reached, for every loss placement x window, learned exits included.

The independent measurement is an untied copy of the looped model: the same function (one copy of the
shared blocks per round, weights copied), so every round's core computation has parameters of its own.
Round r received gradient exactly when its copy's parameters did, and the shared core's gradient must be
the sum of the copies' gradients (each visit's contribution added into one tensor).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from looplm.recipe.config import ModelConfig, SupervisionConfig
from looplm.model.losses import placement, supervised_loss
from looplm.model.looped import LoopedLM
from looplm.train.trainer import train

from conftest import tiny_recipe

R, K = 4, 2
CFG = ModelConfig(vocab_size=37, d_model=32, n_heads=4, n_kv_heads=2, context=16, n_prelude=1, n_core=K,
                  n_coda=1, init_state="random", injection="concat")

PLACEMENTS = {
    "final": SupervisionConfig(kind="final"),
    "rounds_1_4": SupervisionConfig(kind="rounds", rounds=(1, 4), weights=(0.5, 0.5)),
    "rounds_2_3": SupervisionConfig(kind="rounds", rounds=(2, 3)),
    "every": SupervisionConfig(kind="every"),
    "learned_exit": SupervisionConfig(kind="learned_exit", entropy_beta=0.1),
    "learned_exit_uniform": SupervisionConfig(kind="learned_exit", prior="uniform"),
}


def untied_copy(looped: LoopedLM) -> LoopedLM:
    untied = LoopedLM(dataclasses.replace(looped.cfg, untied=True), rounds=R, exit_gate=looped.gate is not None)
    state = looped.state_dict()
    untied.load_state_dict({k: state[f"core.{int(k.split('.')[1]) % K}.{k.split('.', 2)[2]}"]
                            if k.startswith("core.") else state[k] for k in untied.state_dict()})
    return untied


def loss_of(model, sup, x, y, window):
    place = placement(sup, R)
    out = model(x, R, backward_window=window, readout_rounds=place.rounds, collect_stats=True,
                generator=torch.Generator().manual_seed(3))
    for s in out.round_states:
        if s.requires_grad:
            s.retain_grad()
    loss, _ = supervised_loss(sup, out, y)
    loss.backward()
    return out


@pytest.mark.parametrize("window", [1, 2, 3, None])
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_recorded_rounds_equal_measured_gradients(name, window):
    sup = PLACEMENTS[name]
    torch.manual_seed(0)
    looped = LoopedLM(CFG, rounds=R, exit_gate=sup.kind == "learned_exit")
    if looped.gate is not None:  # a non-trivial gate, so hazards depend on the state
        torch.nn.init.normal_(looped.gate[1].weight, std=0.5)
    untied = untied_copy(looped)
    x, y = torch.randint(0, CFG.vocab_size, (2, 2, 12)).unbind(0)
    out = loss_of(looped, sup, x, y, window)
    ref = loss_of(untied, sup, x, y, window)

    def grad_norm(block) -> float:
        return sum(p.grad.abs().sum().item() for p in block.parameters() if p.grad is not None)

    # which rounds' own blocks received gradient, round by round (the measurement)
    measured = tuple(r for r in range(1, R + 1)
                     if sum(grad_norm(b) for b in untied.core[(r - 1) * K: r * K]) > 0)
    first = 1 if window is None else R - window + 1
    place = placement(sup, R)
    # the window's rounds, up to the last supervised readout inside it
    expected = tuple(r for r in range(first, R + 1) if any(r <= q for q in place.rounds if q >= first))
    assert out.grad_rounds == ref.grad_rounds == expected
    assert measured == out.grad_rounds, f"{name}, window {window}: autograd reached {measured}"
    # the same from the loop states: a round's output gets gradient iff the round is in the window
    by_state = tuple(r for r, s in enumerate(out.round_states, 1) if s.grad is not None and s.grad.abs().sum() > 0)
    assert by_state == out.grad_rounds
    assert all(not s.requires_grad for r, s in enumerate(out.round_states, 1) if r < first)  # ran under no_grad
    # readouts before the window are recorded as training the readout alone
    assert out.readout_only_rounds == tuple(r for r in place.rounds if r < first)
    # the shared core's gradient is the sum of every visit's contribution
    for i in range(K):
        for (n, p), *copies in zip(looped.core[i].named_parameters(),
                                   *(untied.core[r * K + i].parameters() for r in range(R))):
            total = sum((c.grad for c in copies if c.grad is not None), torch.zeros_like(p))
            got = torch.zeros_like(p) if p.grad is None else p.grad
            assert torch.allclose(got, total, atol=1e-6, rtol=1e-4), (name, window, i, n)
    # and everything outside the core gets the same gradient in both
    shared = dict(untied.named_parameters())
    for n, p in looped.named_parameters():
        if not n.startswith("core."):
            assert (p.grad is None) == (shared[n].grad is None), n
            if p.grad is not None:
                assert torch.allclose(p.grad, shared[n].grad, atol=1e-6, rtol=1e-4), (name, window, n)


def test_readout_before_window_still_trains_the_head():
    """A loss on the round-1 readout alone, with a window of the last 2 of 4 rounds: the coda and head
    learn from it; the core and prelude get nothing (the measured 0.117 of issue 14 is now 0)."""
    torch.manual_seed(0)
    model = LoopedLM(CFG, rounds=R)
    x, y = torch.randint(0, CFG.vocab_size, (2, 2, 12)).unbind(0)
    out = model(x, R, backward_window=2, readout_rounds=(1, 4), generator=torch.Generator().manual_seed(1))
    torch.nn.functional.cross_entropy(out.round_logits[1].flatten(0, 1), y.flatten()).backward()
    assert out.readout_only_rounds == (1,) and out.grad_rounds == (3, 4)   # round 4 is read out too
    core = sum(p.grad.abs().sum().item() for p in model.core.parameters() if p.grad is not None)
    prelude = sum(p.grad.abs().sum().item() for p in model.prelude.parameters() if p.grad is not None)
    coda = sum(p.grad.abs().sum().item() for p in model.coda.parameters() if p.grad is not None)
    assert core == 0 and prelude == 0 and coda > 0 and model.head.weight.grad.abs().sum() > 0


def test_nothing_trainable_records_no_gradient_rounds():
    """Under no_grad, or with the language model frozen (Ouro stage II), no round's computation is in
    the graph: the record says so instead of repeating the window."""
    model = LoopedLM(CFG, rounds=R)
    x = torch.randint(0, CFG.vocab_size, (1, 8))
    with torch.no_grad():
        assert model(x, R, backward_window=2).grad_rounds == ()
    model.requires_grad_(False)
    assert model(x, R, backward_window=2).grad_rounds == ()
    assert model(x, R).grad_rounds == ()


def test_trainer_records_the_window(tmp_path, text_dir):
    """The run's report and metrics carry what the step's autograd saw: 2 gradient-visible rounds a step,
    the round-1 readout counted as readout-only, and no gradient RMS for rounds before the window."""
    rec = tiny_recipe(**{"data.path": str(text_dir), "depth.rounds": 4, "backward.window": 2,
                         "supervision.kind": "rounds", "supervision.rounds": (1, 4), "train.log_every": 1})
    report = train(rec, tmp_path / "run", quiet=True)
    assert report["backward_histogram"] == {"2": 6}
    assert report["loss_placement"]["readout_only_round_counts"] == {"1": 6}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["grad_rounds"] == [3, 4]
        assert row["grad_rms"][:2] == [None, None] and all(g > 0 for g in row["grad_rms"][2:])
    md = (tmp_path / "run" / "report.md").read_text()
    assert "trained the readout only" in md and "never the core or prelude" in md


# ---------------------------------------------------------------------------------------
# activation checkpointing per core block: same gradients, and the window's visits really recomputed

def test_activation_checkpointing_recomputes_the_window_with_the_same_gradients():
    import looplm
    from looplm.train.parallel import checkpoint_core
    recipe = looplm.load_recipe("quickstart", {"model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2,
                                               "model.n_core": 2})
    torch.manual_seed(0)
    plain = looplm.build_model(recipe).train()
    ac = looplm.build_model(recipe).train()
    ac.load_state_dict(plain.state_dict())
    checkpoint_core(ac)
    calls = []
    for block in ac.core:   # the attention inside each block runs once per visit and once per recompute
        real = block.attn.forward
        block.attn.forward = lambda *a, _real=real, **k: (calls.append(1), _real(*a, **k))[1]
    x = torch.randint(0, 257, (2, 16))
    grads = []
    for m in (plain, ac):
        out = m(x, 5, backward_window=2, generator=torch.Generator().manual_seed(1))
        n_forward = len(calls)
        out.logits.float().pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7)
    # forward: 5 rounds x 2 blocks; the backward recomputes the 2 window rounds' 2 blocks, no more
    assert n_forward == 10 and len(calls) - n_forward == 4
