"""Compute counted over every visit: a 2-block, 3-round model counted by hand, and the counter's
products against PyTorch's own FLOP counter on real forward and backward passes (the trainer's
record of each micro-batch included)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import looplm
from looplm.model.flops import Visits, decode_flops, pass_flops, train_flops_per_token
from looplm.train.trainer import Counters, train_step

SMALL = {"model.d_model": 64, "model.n_heads": 2, "model.n_kv_heads": 1, "model.head_dim": 32,
         "model.ffn_hidden": 96, "model.n_core": 2, "model.n_prelude": 1, "model.n_coda": 1,
         "model.vocab_size": 300, "data.seq_len": 16, "model.context": 32}


def test_two_blocks_three_rounds_by_hand():
    cfg = looplm.load_recipe("quickstart", SMALL).model
    # one block's products per token: q 64x64, k and v 64x32 each, o 64x64, gate/up 64x96 each, down 96x64
    mm = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96          # = 30,720 multiply-adds
    assert mm == 30_720
    T = 16
    attn = 4 * 2 * 32 * (T + 1) / 2                               # QK^T and AV: 2 heads of 32, 8.5 keys
    block = 2 * mm + attn
    head = 2 * 64 * 300
    # prelude 1 + 3 rounds x 2 core blocks + one readout (coda 1 + head)
    forward = 1 * block + 3 * 2 * block + (1 * block + head)
    assert train_flops_per_token(cfg, Visits(rounds=3), T) == pytest.approx(forward)
    # full backward: twice the forward of everything the gradient passes through
    full = Visits(rounds=3, grad_rounds=3, readouts=1, grad_readouts=1, prelude_grad=True)
    assert train_flops_per_token(cfg, full, T) == pytest.approx(3 * forward)
    # backward window 1: the prelude and rounds 1-2 run forward only; every round read out (3 readouts)
    win = Visits(rounds=3, grad_rounds=1, readouts=3, grad_readouts=3, prelude_grad=False)
    fwd3 = 1 * block + 6 * block + 3 * (block + head)
    assert train_flops_per_token(cfg, win, T) == pytest.approx(fwd3 + 2 * (2 * block + 3 * (block + head)))
    # decoding the token at position 9 with 2 rounds: every block attends to 10 keys
    b10 = 2 * mm + 4 * 2 * 32 * 10
    assert decode_flops(cfg, 2, 9) == pytest.approx(b10 + 2 * 2 * b10 + b10 + head)


def _measured_mm(fn) -> float:
    with FlopCounterMode(display=False) as fc:
        fn()
    counts = fc.get_flop_counts()["Global"]
    # the CPU attention kernel is not in PyTorch's counter: compare the products
    return float(sum(v for k, v in counts.items() if "mm" in str(k) or "addmm" in str(k)))


# (overrides, backward window, supervision, the visits that run by hand: grad rounds, readouts, prelude gradient)
CASES = [({}, None, "final", 3, 1, True),                    # injection "add": the prelude feeds every round
         ({}, 1, "final", 1, 1, True),
         ({}, 2, "every", 2, 3, True),                       # 3 readouts, each with a loss
         ({"model.injection": "none", "model.init_state": "prelude"}, 2, "final", 2, 1, False),
         ({"model.injection": "none", "model.init_state": "prelude"}, None, "final", 3, 1, True),
         ({"model.injection": "concat"}, 2, "final", 2, 1, True),
         # concat's W_e e once a pass; W_s s's input gradient where the entering state carries one
         ({"model.injection": "concat", "model.init_state": "prelude"}, None, "every", 3, 3, True),
         ({"model.injection": "concat", "model.init_state": "zeros"}, None, "final", 3, 1, True),
         # a routed loop (Mixture-of-Recursions) injects through the same once-a-forward term
         ({"model.injection": "concat", "model.init_state": "prelude", "model.mor": "token_choice"},
          None, "final", 3, 1, True),
         # Euler sub-steps: rounds 2 and 3 visit each core block 3 times (forward and, in the window, backward)
         ({"model.round_update": "euler", "model.round_substeps": 3}, None, "final", 3, 1, True),
         ({"model.round_update": "euler", "model.round_substeps": 2}, 2, "final", 2, 1, True),
         ({"model.round_update": "damped", "model.round_eta": 0.3}, None, "final", 3, 1, True)]


@pytest.mark.parametrize("over,window,sup,grad_rounds,readouts,prelude_grad", CASES)
def test_trainer_record_equals_measured_products(over, window, sup, grad_rounds, readouts, prelude_grad):
    recipe = looplm.load_recipe("quickstart", {**SMALL, **over, "depth.kind": "fixed", "depth.rounds": 3,
                                               "backward.window": window or "all", "supervision.kind": sup})
    torch.manual_seed(0)
    model = looplm.build_model(recipe).train()
    x = torch.randint(0, 300, (2, 16))
    counters = Counters()
    measured = _measured_mm(lambda: train_step(model, recipe, x, x, 0, 0, counters, rounds=3))
    hand = Visits(rounds=3, grad_rounds=grad_rounds, readouts=readouts, grad_readouts=readouts,
                  prelude_grad=prelude_grad)
    # what the hand-listed visits multiply is what PyTorch counted (no keys: products only) ...
    assert pass_flops(model.cfg, hand, 0)["total"] * x.numel() == pytest.approx(measured, rel=1e-9)
    # ... and the trainer recorded exactly those visits (with attention's term)
    assert counters.train_flops == pytest.approx(x.numel() * train_flops_per_token(model.cfg, hand, 16), rel=1e-12)


def test_generate_reports_flops_beside_speed(tmp_path):
    from looplm.inference.engine import generate_for_run
    from looplm.runs.checkpoint import load_run
    from looplm.train.trainer import train
    train(looplm.load_recipe("quickstart", {**SMALL, "model.vocab_size": 300, "train.steps": 1,
                                            "train.batch_size": 2, "train.eval_batches": 1,
                                            "data.max_bytes": 20_000}), tmp_path / "r", quiet=True)
    run = load_run(tmp_path / "r")
    out = generate_for_run(run, "hello", max_new_tokens=4, rounds=2)
    P = out["prompt_tokens"]
    assert P == 5 and out["rounds_used"] == [2, 2, 2, 2]

    def by_hand(rounds, position):
        # prelude 1 + rounds x 2 core blocks + coda 1, each 30,720 multiply-adds of products (above) and
        # QK^T, AV over 2 heads of 32 against position + 1 keys; the head 64 x 300
        return (1 + 2 * rounds + 1) * (2 * 30_720 + 4 * 2 * 32 * (position + 1)) + 2 * 64 * 300
    # the prefill's pass gives the first token; the next 3 come from the columns at positions 5..7
    want = sum(by_hand(2, P + i) for i in range(3)) / 3
    assert out["flops_per_token"]["decode"] == pytest.approx(want, rel=1e-12)
    # the prompt's coda runs on every column, its head on the last only
    prefill = sum(by_hand(2, t) for t in range(P)) - (P - 1) * 2 * 64 * 300
    assert out["flops_per_token"]["prefill"] == pytest.approx(prefill / P, rel=1e-12)
    assert out["flops_per_token"]["decode_flops_per_s"] == pytest.approx(want * out["decode_tokens_per_s"])
    assert pass_flops(run.model.cfg, Visits(rounds=2), 1)["backward"] == 0


def test_task_loss_reads_out_at_its_positions_only(tmp_path, monkeypatch):
    """A masked task step (answer and trace targets) applies the LM head at the loss's positions only:
    the same loss and gradients as whole readouts, and the products PyTorch counts are the recorded ones."""
    import looplm.train.trainer as trainer
    from looplm.data.taskdata import prepare_task_data
    recipe = looplm.load_recipe("extrapolate", {"model.d_model": 32, "model.n_heads": 2, "model.n_coda": 1,
                                                "data.difficulty_max": 3, "data.task_length": 8,
                                                "train.batch_size": 6})
    _, sampler, _ = prepare_task_data(recipe, tmp_path, write=False)
    x, y, opts = sampler.batch(7)
    rounds = opts["rounds"]
    supervised = opts["mask"].clone()
    for r in opts["supervision"].rounds[:-1]:                # the trace targets' positions, by hand
        supervised |= opts["round_targets"](r)[1]

    def step(whole: bool):
        if whole:
            monkeypatch.setattr(trainer, "readout_positions", lambda *a, **k: None)
        torch.manual_seed(0)
        model = looplm.build_model(recipe).train()
        counters = Counters()
        loss = []
        measured = _measured_mm(lambda: loss.append(train_step(model, recipe, x, y, 7, 0, counters, **opts)[0]))
        monkeypatch.undo()
        return loss[0], {n: p.grad for n, p in model.named_parameters()}, counters, measured, model.cfg

    loss, grads, counters, measured, cfg = step(whole=False)
    loss_w, grads_w, counters_w, measured_w, _ = step(whole=True)
    assert loss == pytest.approx(loss_w, rel=1e-5)
    for n, g in grads.items():
        assert torch.allclose(g, grads_w[n], rtol=1e-4, atol=1e-6), n
    share = supervised.sum().item() / supervised.numel()
    assert 0 < share < 0.5 and counters.last_visits.head_share == pytest.approx(share)
    readouts = len(opts["supervision"].rounds)
    hand = Visits(rounds=rounds, grad_rounds=rounds, readouts=readouts, grad_readouts=readouts, prelude_grad=True,
                  head_share=share)
    assert pass_flops(cfg, hand, 0)["total"] * x.numel() == pytest.approx(measured, rel=1e-9)
    # the whole readouts apply the head at every position: 3 x 2 x d x V more per skipped position and readout
    skipped = x.numel() - supervised.sum().item()
    assert measured_w - measured == pytest.approx(readouts * skipped * 3 * 2 * cfg.d_model * cfg.vocab_size, rel=1e-9)
    assert counters.train_flops == pytest.approx(x.numel() * train_flops_per_token(cfg, hand, x.shape[1]), rel=1e-12)


def test_later_rounds_at_the_read_positions_count_what_ran(tmp_path, monkeypatch):
    """kv_sharing = first without a coda (the extrapolate recipe): a masked task step runs rounds after the first at
    the read positions only. The same loss and gradients as every position at every round; PyTorch counts fewer
    products by exactly those positions' rounds (a core block and concat's W_s s, forward and backward: 3x the
    forward's), and the trainer's record is the visits that ran, by hand."""
    from looplm.data.taskdata import prepare_task_data
    from looplm.model.blocks import Block
    from looplm.model.flops import block_matmul_params
    from looplm.model.looped import LoopedLM
    recipe = looplm.load_recipe("extrapolate", {"model.d_model": 32, "model.n_heads": 2, "data.difficulty_max": 3,
                                                "data.task_length": 8, "train.batch_size": 6})
    assert recipe.model.kv_sharing == "first" and recipe.model.n_coda == 0 and recipe.model.injection == "concat"
    _, sampler, _ = prepare_task_data(recipe, tmp_path, write=False)
    x, y, opts = sampler.batch(7)
    rounds, (B, T) = opts["rounds"], x.shape
    read = opts["mask"].bool()
    for r in opts["supervision"].rounds[:-1]:
        read |= opts["round_targets"](r)[1].bool()
    K = int(read.sum(1).max())
    # each row's positions by hand: its read ones, then its first unread ones up to K
    pos = torch.tensor([[t for t in range(T) if read[b, t]] + [t for t in range(T) if not read[b, t]][:K - int(read[b].sum())]
                        for b in range(B)])

    def step(whole: bool):
        if whole:
            monkeypatch.setattr(LoopedLM, "later_positions", lambda *a, **k: None)
        torch.manual_seed(0)
        model = looplm.build_model(recipe).train()
        counters, loss = Counters(), []
        measured = _measured_mm(lambda: loss.append(train_step(model, recipe, x, y, 7, 0, counters, **opts)[0]))
        monkeypatch.undo()
        return loss[0], {n: p.grad for n, p in model.named_parameters()}, counters, measured, model.cfg

    loss, grads, counters, measured, cfg = step(whole=False)
    loss_w, grads_w, counters_w, measured_w, _ = step(whole=True)
    assert rounds >= 2 and K < T
    assert loss == pytest.approx(loss_w, rel=1e-5)
    for n, g in grads.items():
        assert torch.allclose(g, grads_w[n], rtol=1e-4, atol=1e-6), n
    d = cfg.d_model
    per_position_round = 2 * block_matmul_params(cfg) + 2 * d * d
    assert sum(p.numel() for p in Block(cfg).parameters() if p.dim() == 2) == block_matmul_params(cfg)
    assert measured_w - measured == pytest.approx(3 * (rounds - 1) * B * (T - K) * per_position_round, rel=1e-12)
    v = counters.last_visits
    assert v.later_share == pytest.approx(K / T) and counters_w.last_visits.later_share == 1.0
    assert v.later_keys_factor == pytest.approx((pos + 1).double().mean().item() / ((T + 1) / 2))
    assert pass_flops(cfg, v, 0)["total"] * x.numel() == pytest.approx(measured, rel=1e-9)
    assert counters.train_flops == pytest.approx(x.numel() * train_flops_per_token(cfg, v, T), rel=1e-12)
    assert counters.train_flops < counters_w.train_flops
