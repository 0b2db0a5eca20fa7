"""model.kv_sharing = "first": every core round attends to the earlier tokens' round-1 keys/values.

Checked against a per-query hand computation of the rule (a cache written here, not the model's),
against the cached engine decoding one column at a time under cache policy first, and for what
the rule means: a later round of a token cannot see how earlier tokens' states moved after round 1.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import looplm
from looplm.data.tokenizer import ByteTokenizer
from looplm.errors import UserError
from looplm.inference.engine import Engine, GenerationConfig, SamplingParams
from looplm.model.blocks import sdpa

SHARED = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64, "model.n_core": 2,
          "model.n_coda": 1, "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 4,
          "data.seq_len": 32, "model.injection": "concat", "model.kv_sharing": "first"}
TOK = ByteTokenizer()


def model(**over):
    torch.manual_seed(0)
    return looplm.build_model(looplm.load_recipe("quickstart", {**SHARED, **over})).eval()


class HandRule:
    """The rule written per query: at round r > 1, query t reads keys [round-1 keys of 0..t-1, its own round-r
    key] (a loop over t, where the model builds one mask)."""

    def __init__(self):
        self.first = {}

    def attend(self, slot, q, k, v):
        kind, r, i = slot
        if r == 1:
            self.first[i] = (k, v)
        k1, v1 = self.first[i]
        out = []
        for t in range(q.shape[2]):
            keys = torch.cat([k1[:, :, :t], k[:, :, t:t + 1]], 2)
            vals = torch.cat([v1[:, :, :t], v[:, :, t:t + 1]], 2)
            out.append(sdpa(q[:, :, t:t + 1], keys, vals, None))
        return torch.cat(out, 2)


def test_forward_equals_the_rule_by_hand_and_differs_from_the_plain_loop():
    shared = model()
    plain = model(**{"model.kv_sharing": "none"})
    plain.load_state_dict(shared.state_dict())
    x = torch.randint(0, 257, (2, 12))
    with torch.no_grad():
        got = shared(x)
        rope, e, s = plain.loop_inputs(x)
        for r in range(1, 5):
            if r == 1:
                rule = HandRule()
            s = plain.core_step(s, e, r, rope, rule)
        want = plain.readout(s, rope)
        torch.testing.assert_close(got.logits, want, rtol=0, atol=1e-5)
        assert not torch.allclose(got.logits, plain(x).logits, atol=1e-3)
        torch.testing.assert_close(shared(x, 1).logits, plain(x, 1).logits, rtol=0, atol=1e-6)  # one round: no history


def test_later_rounds_of_earlier_tokens_are_invisible():
    """Change what the core does at rounds >= 2 for every token but the last: the last token's final loop
    state is unchanged with sharing (it read only their round-1 entries) and changes without. (The coda
    still reads every earlier token's final state.)"""
    x = torch.randint(0, 257, (1, 10))
    for sharing, same in (("first", True), ("none", False)):
        m = model(**{"model.kv_sharing": sharing})
        with torch.no_grad():
            base = m(x).state[0, -1]
            step = m.core_step

            def nudged(s, e, r, rope, cache=None, ops=None, e_term=None, _step=step):
                out = _step(s, e, r, rope, cache, e_term=e_term) if ops is None else _step(s, e, r, rope, cache, ops, e_term)
                if r >= 2:
                    out = out.clone()
                    out[:, :-1] += 0.5
                return out

            m.core_step = nudged
            moved = m(x).state[0, -1]
        assert torch.allclose(base, moved, atol=1e-5) == same, sharing


@pytest.mark.parametrize("untied", [False, True], ids=["shared-core", "untied"])
def test_cached_decode_equals_the_full_forward(untied):
    """The engine decodes the trained function: cache policy first on both sides, prompt column by column;
    greedy tokens and teacher-forced logits match the full forward; the core cache holds one slot. Untied: the
    extrapolation experiment's same-compute baseline inherits the field (later blocks read block 1's entries)."""
    m = model(**({"model.untied": True, "model.init_state": "prelude"} if untied else {}))
    eng = Engine(m, TOK, GenerationConfig())
    assert (eng.config.prefill_cache, eng.config.decode_cache) == ("first", "first")
    prompt = "rounds read round one"
    out = eng.generate([prompt], SamplingParams(max_new_tokens=10, stop_at_eos=False))[0]
    seq = torch.tensor([TOK.encode(prompt) + out.tokens])
    with torch.no_grad():
        full = m(seq[:, :-1])
    P = len(TOK.encode(prompt))
    assert out.tokens == full.logits[0, P - 1:].argmax(-1).tolist()
    cache = eng.new_cache(1, seq.shape[1])
    with torch.inference_mode():         # a whole prompt as one chunk: every column's logits
        lg = eng.run_chunk(seq[:, :-1], 0, cache, phase="prefill", all_logits=True).logits
    torch.testing.assert_close(lg[0], full.logits[0], rtol=0, atol=2e-4)
    plain = Engine(model(**{"model.kv_sharing": "none"}), TOK, GenerationConfig())
    assert cache.nbytes()["core"] * 4 == plain.new_cache(1, seq.shape[1]).nbytes()["core"]


def test_refusals_name_the_field():
    m = model()
    with pytest.raises(UserError, match="kv_sharing"):
        Engine(m, TOK, GenerationConfig(prefill_cache="full", decode_cache="last"))
    with pytest.raises(UserError, match="kv_sharing"):
        Engine(m, TOK, GenerationConfig(speculative="2:3"))
    with pytest.raises(UserError, match="model.kv_sharing"):
        looplm.load_recipe("quickstart", {"model.kv_sharing": "first", "model.mor": "token_choice",
                                          "depth.kind": "fixed"})
    with pytest.raises(UserError, match="model.kv_sharing"):
        looplm.load_recipe("quickstart", {"model.kv_sharing": "last"})


def test_training_reaches_the_core_through_round_one_keys():
    """Gradient flows into the core from the round-1 keys/values later rounds read (with a window of all)."""
    m = model()
    m.train()
    x = torch.randint(0, 257, (2, 12))
    out = m(x)
    out.logits.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.core.parameters())


def test_whole_sequence_early_exit_keeps_the_rule():
    """early_exit at full depth is the forward (the rule holds there too); an entropy policy runs."""
    from looplm.inference.early_exit import early_exit
    m = model()
    x = torch.randint(0, 257, (2, 10))
    with torch.no_grad():
        full = m(x).logits
    got = early_exit(m, x, "fixed:4")
    torch.testing.assert_close(got.logits, full, rtol=0, atol=2e-4)
    out = early_exit(m, x, "entropy:100")                  # every token exits after its first round
    assert int(out.rounds_used.max()) == 1
    with torch.no_grad():
        torch.testing.assert_close(out.logits, m(x, 1).logits, rtol=0, atol=2e-4)


def test_a_trained_run_decodes_checks_and_says_its_rule(tmp_path, capsys):
    """End to end on a 2-step run: the card states the rule, `looplm check`'s cache check measures the decode
    under first against the forward (and passes), the cache sweep is refused, generate decodes."""
    from looplm.checks.core import check_cache_policies
    from looplm.train.trainer import train
    from conftest import cli, tiny_recipe, write_corpus

    run_dir = tmp_path / "run"
    train(tiny_recipe(**{"data.path": str(write_corpus(tmp_path / "corpus")), "train.steps": 2,
                         "model.init_std": 0.3, "model.kv_sharing": "first", "train.checkpoint_every": 2}),
          run_dir, quiet=True)
    assert "round-1 keys/values and its own round's (model.kv_sharing = first)" in (run_dir / "report.md").read_text()
    run = looplm.load_run(run_dir)
    assert run.model.cfg.kv_sharing == "first"
    result = check_cache_policies(run)
    assert result.passed and "kv_sharing = first" in result.detail
    code, _, err = cli(capsys, "eval", run_dir, "--cache-sweep")
    assert code == 2 and "kv_sharing = first" in err
    code, out, _ = cli(capsys, "generate", run_dir, "--prompt", "def f", "--max-new-tokens", "4")
    assert code == 0


def test_activation_checkpointing_gives_the_same_gradients():
    """Recomputing the core blocks in the backward (train.activation_checkpointing) recomputes round 1's keys
    and values the later rounds read: the gradients are those of the stored graph."""
    import copy
    from looplm.train.parallel import checkpoint_core
    a = model(**{"model.init_state": "prelude"}).train()
    b = copy.deepcopy(a)
    checkpoint_core(b)
    x = torch.randint(0, 257, (2, 16))
    for m in (a, b):
        out = m(x, 4, readout_rounds=(2, 4))
        sum(v.pow(2).mean() for v in out.round_logits.values()).backward()
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_activation_checkpointing_at_the_read_positions_only_gives_the_same_gradients():
    """With later rounds at the read positions only, the recomputed core rounds gather the same positions and
    read the same round-1 keys and values: the gradients equal the stored graph's with every position running
    (float64)."""
    import copy
    from looplm.train.parallel import checkpoint_core
    a = model(**{"model.init_state": "prelude", "model.n_coda": 0}).double().train()
    b = copy.deepcopy(a)
    checkpoint_core(b)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 257, (2, 16), generator=g)
    at = torch.rand(2, 16, generator=g) < 0.3
    at[:, -1] = True
    weight = torch.randn(int(at.sum()), 257, generator=g, dtype=torch.float64)
    for m, run in ((a, lambda **kw: _whole(a, x, 4, **kw)), (b, lambda **kw: b(x, 4, **kw))):
        out = run(readout_rounds=(2, 4), readout_at=at)
        assert (out.later_positions is None) == (m is a)
        sum((lg * weight).sum() for lg in out.round_logits.values()).backward()
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-11, msg=name)


def _whole(m, x, rounds, **kw):
    """The forward with every position running every round (the reference the read-positions forward is held to)."""
    from looplm.model.looped import LoopedLM
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LoopedLM, "later_positions", lambda *a, **k: None)
        return m(x, rounds, **kw)


_MODELS: dict = {}


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_later_rounds_at_the_read_positions_only_equal_every_position(data):
    """With a loss at some positions (readout_at), rounds after the first run there alone: every round's logits,
    and every gradient, equal the forward that runs every position every round (float64), for any mask, backward
    window, injection, initial state, blocks per round and untied stack; what ran is recorded."""
    injection = data.draw(st.sampled_from(["add", "concat", "decay", "none"]), "injection")
    init = data.draw(st.sampled_from(["prelude"] if injection == "none" else ["prelude", "zeros", "random"]), "init")
    n_core, untied = data.draw(st.sampled_from([1, 2]), "n_core"), data.draw(st.booleans(), "untied")
    key = (injection, init, n_core, untied)
    if key not in _MODELS:
        _MODELS[key] = model(**{"model.injection": injection, "model.init_state": init, "model.n_core": n_core,
                                "model.untied": untied, "model.n_coda": 0}).double().train()
    m = _MODELS[key]
    rounds = 4 if untied else data.draw(st.integers(2, 5), "rounds")
    window = data.draw(st.sampled_from([None, *range(1, rounds + 1)]), "window")
    B, T = data.draw(st.integers(1, 3), "B"), data.draw(st.integers(2, 14), "T")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99), "seed"))
    x = torch.randint(0, 257, (B, T), generator=g)
    at = torch.rand(B, T, generator=g) < data.draw(st.sampled_from([0.1, 0.3, 1.0]), "share")
    at[0, data.draw(st.integers(0, T - 1), "t")] = True                   # some position is read
    wanted = tuple(range(1, rounds + 1))
    weight = torch.randn(int(at.sum()), 257, generator=g, dtype=torch.float64)
    got = []
    for run in (lambda **kw: m(x, rounds, **kw), lambda **kw: _whole(m, x, rounds, **kw)):
        m.zero_grad()
        out = run(backward_window=window, readout_rounds=wanted, readout_at=at,
                  generator=torch.Generator().manual_seed(5))
        sum((lg * weight).sum() / r for r, lg in out.round_logits.items()).backward()
        got.append((out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (fast, g_fast), (whole, g_whole) = got
    for r in wanted:
        torch.testing.assert_close(fast.round_logits[r], whole.round_logits[r], rtol=0, atol=1e-12)
    assert g_fast.keys() == g_whole.keys()
    for n in g_whole:
        torch.testing.assert_close(g_fast[n], g_whole[n], rtol=0, atol=1e-11, msg=n)
    counts = at.sum(1)
    assert whole.later_positions is None and whole.state is not None and fast.state is None
    assert fast.later_positions.shape == (B, int(counts.max()))
    for b in range(B):               # each row's read positions in order, then unread ones
        row = fast.later_positions[b].tolist()
        read = at[b].nonzero().flatten().tolist()
        assert row[:len(read)] == read and not at[b, row[len(read):]].any()
    assert fast.grad_rounds == whole.grad_rounds


def test_every_position_runs_where_a_state_is_read_beyond_the_mask():
    """Where something reads more than the mask's positions (a coda attends over every position, stats keep every
    state) or no mask is given, every position runs every round."""
    x = torch.randint(0, 257, (2, 10))
    at = torch.zeros(2, 10, dtype=torch.bool)
    at[:, -1] = True
    assert model(**{"model.n_coda": 1})(x, 3, readout_at=at).later_positions is None
    m = model(**{"model.n_coda": 0})
    assert m(x, 3, readout_at=at).later_positions is not None
    assert m(x, 3, readout_at=at, collect_stats=True).later_positions is None
    assert m(x, 3).later_positions is None and m(x, 1, readout_at=at).later_positions is None
    plain = model(**{"model.n_coda": 0, "model.kv_sharing": "none"})
    assert plain(x, 3, readout_at=at).later_positions is None
