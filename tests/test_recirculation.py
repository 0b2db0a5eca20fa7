"""Recirculation (inference/recirculation.py) against independent computations: a hand loop on a
2-block model with its own cache, the base model at alpha = 0, future-token perturbation; and the
bugs it must not have (stale history, token t's state in t + 1's mix), each shown failing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.inference import Engine, GenerationConfig
from looplm.inference.recirculation import Recirculation, mix
from looplm.model.visits import visit_plan

TWO = {"model.d_model": 32, "model.n_heads": 2, "model.context": 32, "model.n_prelude": 1, "model.n_core": 1,
       "model.n_coda": 0, "model.init_std": 0.3, "model.init_state": "zeros", "depth.kind": "fixed",
       "depth.rounds": 1, "backward.window": "all", "exit.min_rounds": 1, "data.seq_len": 32}
LOOPED = {**TWO, "model.n_coda": 1, "depth.rounds": 3}


def build(fields):
    torch.manual_seed(0)
    return looplm.build_model(looplm.load_recipe("quickstart", fields)).eval()


def ids(T=12, seed=0):
    return torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(seed))


def engine_logits(model, rc, x):
    """(T, V) logits of the whole sequence as one prompt through the engine under `rc`."""
    eng = Engine(model, None, GenerationConfig(recirculation=rc))
    cache = eng.new_cache(x.shape[0], x.shape[1])
    with torch.inference_mode():
        return eng.run_chunk(x, 0, cache, phase="prefill", all_logits=True).logits[0]


class HandCache:
    """Keys and values per slot and position, overwritten in place by a second write at a position."""

    def __init__(self):
        self.k, self.v = {}, {}

    def attend(self, slot, q, k, v):
        t = len(self.k.get(slot, [])) if not hasattr(self, "at") else self.at
        ks, vs = self.k.setdefault(slot, []), self.v.setdefault(slot, [])
        if t < len(ks):
            ks[t], vs[t] = k, v
        else:
            ks.append(k)
            vs.append(v)
        return F.scaled_dot_product_attention(q, torch.cat(ks[:t + 1], 2), torch.cat(vs[:t + 1], 2))


def hand_loop(model, x, alpha, beta_one=False, ramp=0):
    """The serial schedule written out for prelude block P, core block C (one round), no coda: s = 1, d = 0."""
    P, C = model.prelude[0], model.core[0]
    cache, out = HandCache(), []
    with torch.no_grad():
        for t in range(x.shape[1]):
            cache.at = t
            rope = model.rope(t, 1)
            e = P(model.embed(x[:, t:t + 1]), rope, cache, ("prelude", 0, 0))                   # visit 0
            c = C(model.inject(torch.zeros_like(e), e), rope, cache, ("core", 1, 0))             # visit 1
            out.append(model.head_logits(c)[0, 0])                                              # the readout
            a = alpha * min(t / ramp, 1.0) if ramp else alpha
            b = 1.0 if beta_one else 1.0 - a
            e2 = b * e + a * c * (e.norm(dim=-1, keepdim=True) / c.norm(dim=-1, keepdim=True))
            C(model.inject(torch.zeros_like(e2), e2), rope, cache, ("core", 1, 0))                # refined entry at t
    return torch.stack(out)


@pytest.mark.parametrize("beta_one,ramp", [(False, 0), (True, 4)])
def test_the_serial_schedule_equals_a_hand_loop_on_a_two_block_model(beta_one, ramp):
    model, x = build(TWO), ids()
    rc = Recirculation(source=1, dest=0, alpha=0.6, beta="one" if beta_one else "complement", ramp=ramp)
    got = engine_logits(model, rc, x)
    want = hand_loop(model, x, 0.6, beta_one, ramp)
    assert (got - want).abs().max() < 1e-4
    plain = hand_loop(model, x, 0.0)
    first = 2 if ramp else 1              # with a ramp alpha_0 = 0: position 1 reads unrefined history
    assert (got[first:] - plain[first:]).abs().amax(-1).min() > 1e-3     # every later position reads refined history
    assert torch.allclose(got[:first], plain[:first], atol=1e-5)


def test_alpha_zero_is_the_base_model_exactly_and_the_visits_are_indexed_once():
    model, x = build(LOOPED), ids()
    plan = visit_plan(model.cfg, 3)
    assert [v.index for v in plan] == list(range(5)) and [v.part for v in plan] == ["prelude", "core", "core",
                                                                                    "core", "coda"]
    assert [v.round for v in plan] == [0, 1, 2, 3, 3]
    base = engine_logits(model, None, x)
    eng, serial = Engine(model, None), []
    cache = eng.new_cache(1, x.shape[1])
    with torch.inference_mode():          # the base model decoded column by column, as the serial schedule runs
        serial = torch.cat([eng.run_chunk(x[:, c:c + 1], c, cache, phase="prefill").logits for c in range(x.shape[1])])
    assert torch.equal(engine_logits(model, Recirculation(source=4, dest=1, alpha=0.0, beta="complement"), x), serial)
    with torch.no_grad():
        assert (model(x).logits[0] - base).abs().max() < 1e-4 and (serial - base).abs().max() < 1e-4
    moved = engine_logits(model, Recirculation(source=3, dest=1, alpha=0.3), x)
    assert (moved - base).abs().max() > 1e-3


def test_no_future_token_reaches_an_earlier_position():
    model = build(LOOPED)
    a, b = ids(12, 0), ids(12, 0)
    b[0, 8:] = (b[0, 8:] + 7) % 256
    rc = Recirculation(source=3, dest=1, alpha=0.5)
    la, lb = engine_logits(model, rc, a), engine_logits(model, rc, b)
    assert torch.equal(la[:8], lb[:8]) and not torch.equal(la[8:], lb[8:])


def test_a_stale_cache_and_a_cross_token_leak_each_fail_the_hand_loop(monkeypatch):
    import looplm.inference.recirculation as recirc
    model, x = build(TWO), ids()
    rc = Recirculation(source=1, dest=0, alpha=0.6, schedule="serial")      # the second pass through `replace`
    want = hand_loop(model, x, 0.6)
    assert (engine_logits(model, rc, x) - want).abs().max() < 1e-4
    with monkeypatch.context() as mp:      # the refinement pass never reaches the cache: later positions read stale entries
        real = Engine.chunk
        mp.setattr(Engine, "chunk", lambda self, *a, **k: SimpleNamespace(logits=None)
                   if self.kernels().tap.__name__ == "replace" else real(self, *a, **k))
        assert (engine_logits(model, rc, x) - want).abs().max() > 1e-3
    with monkeypatch.context() as mp:      # the withdrawn bug: the previous position's deep state mixed into this one
        prev = {}

        def leaky(h_dst, h_src, alpha, beta, eps=1e-6):
            src, prev["s"] = prev.get("s", h_src), h_src
            return mix(h_dst, src, alpha, beta, eps)
        mp.setattr(recirc, "mix", leaky)
        assert (engine_logits(model, rc, x) - want).abs().max() > 1e-3


def test_the_mix_norm_matches_and_clamps_a_zero_source():
    d, s = torch.randn(3, 8), torch.randn(3, 8) * 5
    out = mix(d, s, 1.0, 0.0)
    assert torch.allclose(out.norm(dim=-1), d.norm(dim=-1), atol=1e-5)
    zero = mix(d, torch.zeros(3, 8), 0.5, 0.5)
    assert torch.isfinite(zero).all() and torch.allclose(zero, 0.5 * d)


def test_settings_are_refused_where_they_cannot_apply():
    model = build(LOOPED)
    with pytest.raises(looplm.UserError, match="0 <= d < s"):
        Recirculation(source=1, dest=1)
    with pytest.raises(looplm.UserError, match="visits 0..4"):
        Engine(model, None, GenerationConfig(recirculation=Recirculation(source=5, dest=1)))
    with pytest.raises(looplm.UserError, match="early-exit"):
        Engine(model, None, GenerationConfig(exit="entropy:1.0", recirculation=Recirculation(source=3, dest=1)))
    with pytest.raises(looplm.UserError, match="cache policy"):
        Engine(model, None, GenerationConfig(decode_cache="last", recirculation=Recirculation(source=3, dest=1)))


def test_the_eager_schedule_equals_the_engines_and_a_trained_mixer_leaves_the_model_bit_identical():
    """One schedule, two runners: the differentiable eager passes equal the engine's chunks; the mixer trains
    through the cache writes (its loss falls, gradient reaches it only through refined history) while every
    model weight stays bit-identical."""
    from looplm.model.mixer import AdaptiveMixer
    from looplm.train.mixer import recirculated_logits, train_mixer
    model, x = build(LOOPED), ids()
    rc = Recirculation(source=3, dest=1, alpha=0.4, ramp=3)
    with torch.no_grad():
        eager = recirculated_logits(model, rc, x)[0]
    assert (eager - engine_logits(model, rc, x)).abs().max() < 1e-4
    d = model.cfg.d_model
    assert AdaptiveMixer(d).matrix_weights() == 5 * d * d
    assert [AdaptiveMixer(d, k).matrix_weights() for k in ("conditional_scalar", "constant_vector",
                                                            "constant_scalar")] == [3 * d * d + 2 * d, 0, 0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    windows = torch.randint(0, 256, (8, 9), generator=torch.Generator().manual_seed(3))
    windows[:, 4:] = windows[:, :5]                   # a repeat: refined history can help predict it
    mixer, rec = train_mixer(model, rc, windows, kind="constant_scalar", steps=30, batch=8, lr=0.1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert rec["losses"][-1] < rec["losses"][0]
    a, b = mixer(torch.zeros(1, d), torch.zeros(1, d))
    assert not torch.allclose(a, torch.tensor(0.1)) or not torch.allclose(b, torch.tensor(0.9))


def test_a_saved_mixer_drives_the_engine_as_it_drove_training(tmp_path):
    from looplm.model.mixer import AdaptiveMixer, save_mixer
    from looplm.train.mixer import recirculated_logits
    model, x = build(LOOPED), ids()
    torch.manual_seed(5)
    mixer = AdaptiveMixer(model.cfg.d_model, "conditional_vector")
    with torch.no_grad():
        mixer.net[-1].weight.normal_(0, 0.5)           # away from the initial constant output
    save_mixer(mixer, tmp_path / "m.safetensors")
    rc = Recirculation(source=3, dest=1, alpha=0.4, mixer=str(tmp_path / "m.safetensors"))
    with torch.no_grad():
        want = recirculated_logits(model, rc, x, mixer)[0]
    got = engine_logits(model, rc, x)
    assert (got - want).abs().max() < 1e-4
    assert (got - engine_logits(model, Recirculation(source=3, dest=1, alpha=0.4), x)).abs().max() > 1e-3
    with pytest.raises(looplm.UserError, match="not a mixer for this model"):
        save_mixer(AdaptiveMixer(8), tmp_path / "small.safetensors")
        Engine(model, None, GenerationConfig(recirculation=Recirculation(source=3, dest=1,
                                                                         mixer=str(tmp_path / "small.safetensors"))))


@pytest.mark.parametrize("pair", [(3, 1), (4, 0), (2, 1)])
def test_the_resume_schedule_equals_the_serial_reference_and_skips_the_visits_up_to_d(pair):
    s, d = pair
    model, x = build(LOOPED), ids()
    calls = [0]
    hooks = [b.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
             for b in [*model.prelude, *model.core, *model.coda]]
    got = {}
    for schedule in ("serial", "resume"):
        calls[0] = 0
        got[schedule] = engine_logits(model, Recirculation(source=s, dest=d, alpha=0.4, ramp=2, schedule=schedule), x)
        got[schedule + " calls"] = calls[0]
    for h in hooks:
        h.remove()
    assert (got["serial"] - got["resume"]).abs().max() < 1e-5
    T, n = x.shape[1], 5
    # position 0: alpha_0 = 0 with the ramp, no second pass; then every position's second pass skips d + 1 visits
    assert got["serial calls"] == T * n + (T - 1) * n and got["resume calls"] == T * n + (T - 1) * (n - d - 1)


def test_blockwise_refines_the_prompt_as_one_chunk_and_its_resumed_pass_equals_a_full_one():
    """Blockwise written out on the plain engine: the prompt as one chunk (its visits d and s captured), the
    mix, the whole chunk again with the mix at d (a full second pass); then the next column decoded the
    same way. The engine's blockwise (second pass resumed after d) gives the same logits."""
    from looplm.inference.recirculation import mix as mix_fn
    from looplm.model.visits import visit_index
    model, x = build(LOOPED), ids(10)
    rc = Recirculation(source=3, dest=1, alpha=0.5, schedule="blockwise")
    plain = Engine(model, None)
    k, cache, out = plain.kernels(), plain.new_cache(1, 10), []
    with torch.inference_mode():
        for a, b in ((0, 8), (8, 9), (9, 10)):
            held = {}

            def capture(slot, h):
                held[visit_index(slot, model.cfg, 3)] = h
                return h
            with k.tapping(capture):
                out.append(plain.chunk(x[:, a:b], a, cache, phase="prefill", all_logits=True).logits)
            refined = mix_fn(held[1], held[3], 0.5, 0.5)
            with k.tapping(lambda slot, h: refined if visit_index(slot, model.cfg, 3) == 1 else h):
                plain.chunk(x[:, a:b], a, cache, phase="prefill", all_logits=True)
        eng = Engine(model, None, GenerationConfig(recirculation=rc))
        c2 = eng.new_cache(1, 10)
        got = [eng.run_chunk(x[:, a:b], a, c2, phase="prefill", all_logits=True).logits for a, b in ((0, 8), (8, 9), (9, 10))]
    assert all((g - w).abs().max() < 1e-5 for g, w in zip(got, out))
    assert (out[2] - engine_logits(model, None, x)[None, 9:10]).abs().max() > 1e-3     # it refined something
