"""Training-free looping's round updates (model.round_update): damped steps and Euler sub-steps, each against
a loop written out by hand over the model's own blocks in float64; round 1 stays the plain core (so an
imported model at one round is the pretrained stack); the cached engine decodes a damped loop exactly as the
whole-sequence forward does and refuses Euler sub-steps; the recipe refuses fields that do not apply."""

from __future__ import annotations

import pytest
import torch

import looplm
from looplm.errors import UserError
from looplm.inference.engine import Engine, SamplingParams

from conftest import greedy_by_full_forward

BASE = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.n_prelude": 1, "model.n_core": 2,
        "model.n_coda": 1, "model.context": 64, "model.injection": "none", "model.init_state": "prelude",
        "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 3, "data.seq_len": 32}


def _model(**over):
    torch.manual_seed(0)
    return looplm.build_model(looplm.load_recipe("quickstart", {**BASE, **over})).double().eval()


def _by_hand(m, idx, rounds, update, eta=1.0, k=1):
    """prelude -> rounds of the core blocks (round 1 plain; later rounds damped or sub-stepped) -> coda -> head."""
    T = idx.shape[1]
    rope = m.rope(0, T)
    x = m.embed(idx)
    for b in m.prelude:
        x = b(x, rope)
    s = x
    for r in range(1, rounds + 1):
        h = s
        for b in m.core:
            if update == "euler" and r > 1:
                for _ in range(k):
                    h = h + (b(h, rope) - h) / k
            else:
                h = b(h, rope)
        s = s + eta * (h - s) if update == "damped" and r > 1 else h
    for b in m.coda:
        s = b(s, rope)
    return m.head(m.final_norm(s))


@pytest.mark.parametrize("update,eta,k", [("damped", 0.3, 1), ("damped", 0.8, 1), ("euler", 1.0, 2),
                                          ("euler", 1.0, 3)])
def test_round_updates_equal_the_loop_by_hand(update, eta, k):
    over = {"model.round_update": update}
    over.update({"model.round_eta": eta} if update == "damped" else {"model.round_substeps": k})
    m = _model(**over)
    idx = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for rounds in (1, 2, 4):
            got = m(idx, rounds=rounds).logits
            want = _by_hand(m, idx, rounds, update, eta, k)
            assert (got - want).abs().max().item() < 1e-10
        # and the update changes the function from round 2 on: not plain repetition
        plain = _by_hand(m, idx, 3, "plain")
        assert (m(idx, rounds=3).logits - plain).abs().max().item() > 1e-4
        assert (m(idx, rounds=1).logits - _by_hand(m, idx, 1, "plain")).abs().max().item() < 1e-10


def test_the_cached_engine_decodes_a_damped_loop_as_the_full_forward():
    m = _model(**{"model.round_update": "damped", "model.round_eta": 0.4}).float()
    prompt = [5, 17, 33, 2, 99, 100, 7]
    got = Engine(m).generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))[0].tokens
    assert got == greedy_by_full_forward(m, prompt, 8)


def test_the_cached_engine_refuses_euler_substeps():
    m = _model(**{"model.round_update": "euler", "model.round_substeps": 2}).float()
    with pytest.raises(UserError, match="euler"):
        Engine(m)


@pytest.mark.parametrize("over,field", [({"model.round_eta": 0.3}, "model.round_eta"),
                                        ({"model.round_update": "damped", "model.round_eta": 0.0}, "model.round_eta"),
                                        ({"model.round_update": "damped", "model.round_eta": 1.5}, "model.round_eta"),
                                        ({"model.round_update": "euler", "model.round_substeps": 1},
                                         "model.round_substeps"),
                                        ({"model.round_update": "damped", "model.round_substeps": 3},
                                         "model.round_substeps")])
def test_fields_that_do_not_apply_or_are_out_of_range_are_refused(over, field):
    with pytest.raises(UserError, match=field.replace(".", r"\.")):
        looplm.load_recipe("quickstart", {**BASE, **over})
