"""Compacting a running batch (DecodeBatch.compact, what the server does after a row ends): every
row's output equals the same request decoded alone — its cache entries, pad, initial-state noise,
sampler generator and seen tokens, and a feedback model's carried top state move with it."""

from __future__ import annotations

import pytest
import torch

import looplm
from looplm.inference import Engine, SamplingParams

SMALL = {"model.d_model": 32, "model.n_heads": 2, "model.context": 64, "model.n_prelude": 1, "model.n_core": 1,
         "model.n_coda": 1, "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 2, "backward.window": "all",
         "exit.min_rounds": 1, "data.seq_len": 32}


def model_for(**fields):
    torch.manual_seed(0)
    model = looplm.build_model(looplm.load_recipe("quickstart", {**SMALL, **fields})).eval()
    if model.feedback is not None:
        with torch.no_grad():           # a fusion far from its initialisation, so the carried state matters
            for p in model.feedback.parameters():
                p.add_(torch.randn_like(p) * 0.3)
    return model


PROMPTS = [[5, 17, 99, 3], [40, 41, 42, 43, 44, 45, 46], [7, 8, 200, 9, 1]]


def params(n: int, seed: int, mode: str | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.9, seed=seed, repetition_penalty=1.3,
                          stop_at_eos=False, prompt_mode=mode)


def drive(engine: Engine, plist: list[SamplingParams], late: tuple[list[int], SamplingParams]) -> dict[int, list[int]]:
    """Decode PROMPTS in one batch of 4 rows, compacting after every step and joining `late` once the
    first row has ended; tokens by request (0..2 the prompts, 3 the late one)."""
    batch = engine.batch(PROMPTS, plist, length=engine.cfg.context, capacity=4)
    owner = {b: b for b in range(3)}                  # batch row -> request
    out: dict[int, list[int]] = {i: [] for i in range(4)}
    moved_any = joined = False
    while not batch.finished:
        for ev in batch.step():
            out[owner[ev.row]].append(ev.token)
        moved = batch.compact()
        if moved:
            moved_any = True
            owner = {moved.get(b, b): r for b, r in owner.items()}
            live = [b for b, r in enumerate(batch.requests) if not r.done]
            assert live == list(range(len(live)))      # the running rows sit at the front
        if moved_any and not joined:
            b, events = batch.join(*late)
            owner[b], joined = 3, True
            out[3] += [ev.token for ev in events]
    assert moved_any and joined
    return out


@pytest.mark.parametrize("fields,modes", [
    ({"model.init_state": "random"}, [None] * 4),                  # per-row initial-state noise moves
    ({"feedback.mode": "gate"}, ["fused", "soft", "standard", "fused"]),   # the carried top state moves
])
def test_a_compacted_batch_decodes_each_request_as_it_would_alone(fields, modes):
    engine = Engine(model_for(**fields), None)
    plist = [params(3, 11, modes[0]), params(9, 12, modes[1]), params(7, 13, modes[2])]
    late = ([60, 61, 62], params(4, 14, modes[3]))
    got = drive(engine, plist, late)
    alone = [engine.generate([p], sp)[0].tokens for p, sp in zip(PROMPTS + [late[0]], plist + [late[1]])]
    assert [got[i] for i in range(4)] == alone


def test_the_reorder_check_fails_when_the_carried_state_stays_behind(monkeypatch):
    from looplm import checks
    from looplm.data.tokenizer import ByteTokenizer
    from looplm.inference.batch import DecodeBatch
    from looplm.runs.checkpoint import Run
    recipe = looplm.load_recipe("quickstart", {**SMALL, "feedback.mode": "gate"})
    run = Run(path=None, recipe=recipe, model=model_for(**{"feedback.mode": "gate"}), tokenizer=ByteTokenizer(),
              report={})
    assert checks.check_feedback_reorder(run).passed
    real = DecodeBatch.compact

    def stays(self):           # everything moves but each row keeps the carried state it had
        before = [r.carried for r in self.requests]
        moved = real(self)
        for r, c in zip(self.requests, before):
            r.carried = c
        return moved
    monkeypatch.setattr(DecodeBatch, "compact", stays)
    assert not checks.check_feedback_reorder(run).passed
    plain = Run(path=None, recipe=looplm.load_recipe("quickstart", SMALL), model=model_for(), tokenizer=ByteTokenizer(),
                report={})
    assert checks.check_feedback_reorder(plain).passed is None
