"""`Runner.score`: the one teacher-forced decode through the engine's chunks, against the whole-sequence
forward pass, and the callers that score through it."""

from __future__ import annotations

import pytest
import torch

import looplm
from looplm.data.tokenizer import ByteTokenizer
from looplm.inference.engine import Engine, GenerationConfig, SamplingParams
from looplm.inference.runner import Runner

TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64, "model.n_prelude": 1,
        "model.n_core": 2, "model.n_coda": 1, "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 3,
        "data.seq_len": 32}


def tiny(**over):
    torch.manual_seed(0)
    return looplm.build_model(looplm.load_recipe("quickstart", {**TINY, **over})).eval().double()


@pytest.mark.parametrize("init", ["prelude", "random"])
@pytest.mark.parametrize("prompt", [0, 5, 12])
def test_teacher_forced_scores_are_the_whole_sequence_forward(init, prompt):
    m = tiny(**{"model.init_state": init})
    eng = Engine(m, ByteTokenizer(), GenerationConfig())
    x = torch.randint(0, 256, (2, 12))
    noise = eng.initial_noise([SamplingParams(seed=0)] * 2, next(m.parameters()))   # the eval table: seed 0
    with torch.no_grad():
        want = m(x).logits                                                          # (2, 12, V), float64
        got, rounds = eng.score(x, prompt, noise=noise, prompt_logits=True)
        after, _ = eng.score(x, prompt, noise=noise)
    assert got.shape == want.shape and rounds.shape == (2, 12 - prompt)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(after, want[:, prompt:], rtol=1e-9, atol=1e-9)
    assert bool((rounds == 3).all())


def test_tokens_that_may_not_exit_run_every_round():
    m = tiny()
    eng = Engine(m, ByteTokenizer(), GenerationConfig(rounds=3, exit="entropy:100"))     # every token may stop at 1
    x = torch.randint(0, 256, (2, 8))
    may = torch.zeros(2, 8, dtype=torch.bool)
    may[0, 4:] = True
    with torch.no_grad():
        logits, rounds = eng.score(x, 0, may_exit=may)
        want = m(x).logits
    assert rounds[1].tolist() == [3] * 8 and rounds[0, :4].tolist() == [3] * 4 and rounds[0, 4:].tolist() == [1] * 4
    torch.testing.assert_close(logits[1], want[1], rtol=1e-9, atol=1e-9)   # row 1 ran at full depth throughout


def test_the_scoring_callers_go_through_it(monkeypatch, tmp_path):
    """Cache-policy sweeps, early exit with a coda, recirculation's held-out loss and LoopCD's evaluation."""
    from looplm.cli import _eval_contrast
    from looplm.evaluation.cache_policies import continuation_loss
    from looplm.evaluation.recirculation import heldout_loss
    from looplm.inference.early_exit import early_exit
    calls = []
    real = Runner.score

    def spy(self, x, *a, **k):
        calls.append(x.shape)
        return real(self, x, *a, **k)
    monkeypatch.setattr(Runner, "score", spy)
    m = tiny().float()
    x = torch.randint(0, 256, (2, 8))
    batches = [(x, torch.randint(0, 256, (2, 8)))]
    eng = Engine(m, ByteTokenizer(), GenerationConfig())
    for run in (lambda: continuation_loss(eng, batches), lambda: heldout_loss(eng, batches),
                lambda: early_exit(m, x, "entropy:3.0"), lambda: _eval_contrast(m, batches, (1, 0.5), 3)):
        before = len(calls)
        run()
        assert len(calls) == before + 1
