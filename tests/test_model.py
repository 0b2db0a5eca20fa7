"""The looped model against independent computations: untied copies, a hand-unrolled loop, causality."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.model.looped import deeploop_scales
from looplm.train.trainer import make_optimizer

from conftest import tiny_recipe


def copy_into_untied(looped, untied, rounds, K):
    state = looped.state_dict()
    new = {}
    for key, value in untied.state_dict().items():
        if key.startswith("core."):
            idx, rest = key.split(".", 2)[1:]
            new[key] = state[f"core.{int(idx) % K}.{rest}"]
        else:
            new[key] = state[key]
    untied.load_state_dict(new)


@pytest.mark.parametrize("injection,init_state,norm", [("add", "prelude", "pre"), ("concat", "zeros", "sandwich"),
                                                        ("none", "prelude", "pre"), ("add", "zeros", "pre")])
def test_looped_equals_untied_copies(injection, init_state, norm):
    rounds = 3
    rec = tiny_recipe(**{"model.injection": injection, "model.init_state": init_state, "model.norm": norm})
    looped = looplm.build_model(rec).eval()
    untied = looplm.build_model(tiny_recipe(**{"model.injection": injection, "model.init_state": init_state,
                                               "model.norm": norm, "model.untied": True})).eval()
    assert len(untied.core) == rounds * len(looped.core)
    copy_into_untied(looped, untied, rounds, rec.model.n_core)
    idx = torch.randint(0, 257, (2, 20))
    torch.testing.assert_close(looped(idx, rounds).logits, untied(idx, rounds).logits, rtol=0, atol=1e-5)
    assert untied.params_stored() > looped.params_stored()


def test_forward_equals_hand_unrolled_loop():
    rec = tiny_recipe(**{"model.injection": "concat", "model.init_state": "zeros"})
    m = looplm.build_model(rec).eval()
    idx = torch.randint(0, 257, (2, 16))
    T = idx.shape[1]
    rope = m.rope(0, T)
    with torch.no_grad():
        e = m.embed(idx)
        for b in m.prelude:
            e = b(e, rope)
        s = torch.zeros_like(e)
        for _ in range(4):
            x = m.adapter(torch.cat([s, e], -1))
            for b in m.core:
                x = b(x, rope)
            s = m.state_norm(x) if m.state_norm is not None else x
        for b in m.coda:
            s = b(s, rope)
        logits = m.head(m.final_norm(s))
    torch.testing.assert_close(m(idx, 4).logits, logits, rtol=0, atol=1e-6)


def test_attention_matches_eager_reference():
    """SDPA with grouped-query heads and a head width != d_model/n_heads vs a plain softmax computation."""
    rec = tiny_recipe(**{"model.n_heads": 6, "model.n_kv_heads": 2, "model.head_dim": 16})  # 6*16=96 != 32
    m = looplm.build_model(rec).eval()
    attn = m.core[0].attn
    x = torch.randn(2, 10, 32)
    rope = m.rope(0, 10)

    def rotate(t):  # RoPE by hand: pair i with i + Dh/2, rotated by position * base^(-2i/Dh)
        inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
        ang = torch.arange(10, dtype=torch.float32)[:, None] * inv          # (T, Dh/2)
        a, b = t[..., :8], t[..., 8:]
        return torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1)

    q = rotate(attn.q(x).view(2, 10, 6, 16).transpose(1, 2))
    k = rotate(attn.k(x).view(2, 10, 2, 16).transpose(1, 2)).repeat_interleave(3, dim=1)
    v = attn.v(x).view(2, 10, 2, 16).transpose(1, 2).repeat_interleave(3, dim=1)
    scores = q @ k.transpose(-1, -2) / 4.0
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    y = (F.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 10, 96)
    torch.testing.assert_close(attn(x, rope), attn.o(y), rtol=0, atol=1e-5)
    assert attn.q.weight.shape == (96, 32) and attn.k.weight.shape == (32, 32)


MODES = list(itertools.product(["none", "add", "concat"], ["zeros", "prelude", "random"]))


@pytest.mark.parametrize("injection,init_state", [m for m in MODES if not (m[0] == "none" and m[1] != "prelude")])
@pytest.mark.parametrize("rounds", [1, 3, 5])
def test_causality(injection, init_state, rounds):
    rec = tiny_recipe(**{"model.injection": injection, "model.init_state": init_state})
    m = looplm.build_model(rec).eval()
    idx = torch.randint(0, 257, (1, 24))
    t = 11
    changed = idx.clone()
    changed[:, t + 1:] = torch.randint(0, 257, (1, 24 - t - 1))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = m(idx, rounds, generator=g1).logits
    b = m(changed, rounds, generator=g2).logits
    torch.testing.assert_close(a[:, :t + 1], b[:, :t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])


def test_shared_tensors_appear_once_in_optimizer():
    rec = tiny_recipe()
    m = looplm.build_model(rec)
    opt = make_optimizer(m, rec)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == m.params_stored()
    assert m.head.weight is m.embed.weight  # tied embeddings stored once
    # no decay on norms, biases and the embedding
    no_decay = {id(p) for p in opt.param_groups[1]["params"]}
    assert id(m.embed.weight) in no_decay and id(m.final_norm.weight) in no_decay
    assert id(m.core[0].attn.q.weight) not in no_decay


def test_param_accounting():
    rec = tiny_recipe()
    m = looplm.build_model(rec)
    roles = m.param_groups_by_role()
    assert m.params_stored() == sum(p.numel() for p in m.parameters())
    applied = m.params_per_token_visit(4)
    per_round = roles["core"] + roles["adapter"] + roles["carry"] + roles["state_norm"]
    assert roles["carry"] == rec.model.d_model            # the quickstart's decay injection: one carry per channel
    assert applied == pytest.approx(m.params_stored() + 3 * per_round)


def test_deeploop_scales_and_shared_init_once():
    alpha, beta = deeploop_scales(2, 3, 0.5)
    assert alpha == pytest.approx(12 ** 0.5) and beta == pytest.approx(48 ** -0.5)
    torch.manual_seed(0)
    plain = looplm.build_model(tiny_recipe())
    torch.manual_seed(0)
    deep = looplm.build_model(tiny_recipe(**{"model.residual_scaling": "deeploop"}))
    ratio = deep.core[0].mlp.down.weight.std() / plain.core[0].mlp.down.weight.std()
    assert ratio.item() == pytest.approx(beta, rel=0.05)   # scaled once, not once per round
    assert deep.core[0].alpha == pytest.approx(alpha)
    assert deep.core[0].attn.q.weight.std().item() == pytest.approx(plain.core[0].attn.q.weight.std().item(), rel=0.05)
    assert torch.isfinite(deep(torch.randint(0, 257, (1, 8)), 3).logits).all()


def test_readout_rounds_are_logit_lens_of_shorter_runs():
    m = looplm.build_model(tiny_recipe()).eval()
    idx = torch.randint(0, 257, (2, 12))
    out = m(idx, 4, readout_rounds=(1, 2, 4), generator=torch.Generator().manual_seed(1))
    for r in (1, 2):
        short = m(idx, r, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(out.round_logits[r], short.logits, rtol=0, atol=1e-6)


def test_untied_refuses_other_depths():
    m = looplm.build_model(tiny_recipe(**{"model.untied": True}))
    with pytest.raises(ValueError):
        m(torch.zeros(1, 4, dtype=torch.long), 2)


def test_eval_forward_is_deterministic_and_matches_the_engine():
    """A random initial state (Huginn) is fresh noise only in training or with a generator: in eval mode
    the same input gives the same logits, those of the engine's seed-0 noise table at each position."""
    from looplm.model.looped import initial_noise_table
    model = looplm.build_model(tiny_recipe(**{"model.init_state": "random"})).eval()
    idx = torch.randint(0, 257, (2, 10))
    with torch.no_grad():
        a, b = model(idx).logits, model(idx).logits
        table = initial_noise_table(model.cfg, 0)[:10].expand(2, 10, -1)
        ref = model(idx, initial_state=table).logits
        shifted = model(idx[:, 4:], start_pos=4).logits                   # positions 4..9 of the same table
        drawn = model(idx, generator=torch.Generator().manual_seed(5)).logits
    assert torch.equal(a, b) and torch.equal(a, ref)
    assert torch.allclose(shifted, model(idx[:, 4:], start_pos=4,
                                         initial_state=table[:, 4:]).logits, atol=0)
    assert (drawn - a).abs().max() > 1e-3                              # a generator still draws fresh noise
    model.train()
    with torch.no_grad():
        assert (model(idx).logits - model(idx).logits).abs().max() > 1e-3   # training: fresh noise per call
