"""Continuous depth batching (inference/depth.py): each request decodes what it decodes alone, while tokens at
different rounds share a step, rows freed mid-loop are refilled, and cancellations happen between rounds."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import looplm
from looplm.data.tokenizer import ByteTokenizer
from looplm.errors import UserError
from looplm.inference.depth import DepthBatch
from looplm.inference.engine import Engine, GenerationConfig, SamplingParams
from looplm.inference.scheduler import Row, Scheduler

TOK = ByteTokenizer()
TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
        "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 3, "data.seq_len": 32}
PROMPTS = ["hello", "a somewhat longer prompt", "xy", "The loop runs", "0123456789", "q", "loop"]
NEW = [5, 12, 3, 8, 10, 7, 4]


def tiny(**overrides):
    torch.manual_seed(0)
    return looplm.build_model(looplm.load_recipe("quickstart", overrides={**TINY, **overrides})).eval()


def params(i: int) -> SamplingParams:
    """Greedy for most requests; one samples at a temperature (its own seeded generator)."""
    return SamplingParams(max_new_tokens=NEW[i], stop_at_eos=False, seed=i, temperature=0.7 if i == 2 else 0.0)


class Watch:
    """Records the rounds of the tokens in flight at every step (the loop state's, before the round runs)."""

    def __init__(self, batch: DepthBatch):
        self.batch, self.rounds = batch, []
        step = batch._round

        def spy():
            self.rounds.append(batch.loop.rounds.tolist())
            return step()
        batch._round = spy


def drive(eng: Engine, capacity: int, chunk: int | None = None, cancel: tuple[int, int] | None = None):
    """All PROMPTS through one DepthBatch of `capacity` rows, joining whenever a row is free; with cancel =
    (request, after tokens) that request is cancelled mid-loop. {request: [(token, rounds)]}, the watch."""
    batch = DepthBatch(eng, capacity, prefill_chunk=chunk)
    watch = Watch(batch)
    got: dict[int, list] = {}
    owner: dict[int, int] = {}
    waiting = list(range(len(PROMPTS)))
    cancelled = None
    while waiting or not batch.finished:
        while waiting:
            placed = batch.join(PROMPTS[waiting[0]], params(waiting[0]))
            if placed is None:
                break
            owner[placed[0]] = waiting[0]
            got[waiting[0]] = []
            waiting.pop(0)
        for ev in batch.step():
            got[owner[ev.row]].append((ev.token, ev.rounds))
        if cancel is not None and cancelled is None and len(got.get(cancel[0], ())) >= cancel[1]:
            row = next(b for b, i in owner.items() if i == cancel[0])
            if batch.loop is not None and row in batch.loop.rows.tolist():     # mid-loop: after some round
                batch.cancel(row)
                cancelled = row
    return got, watch, batch


def alone(eng: Engine, i: int) -> list[tuple[int, int]]:
    out = eng.generate([PROMPTS[i]], params(i))[0]
    return list(zip(out.tokens, out.rounds_used))


CONFIGS = [
    ({}, {"exit": "kl:0.05"}),
    ({"model.init_state": "random"}, {"exit": "kl:0.05", "missing": "mask"}),
    ({}, {"exit": "kl:0.05", "decode_cache": "last"}),
    ({"model.init_state": "random"}, {"exit": "kl:0.05", "decode_cache": "average"}),
    ({}, {"exit": "kl:0.05", "prefill_cache": "first", "decode_cache": "first"}),
    ({}, {"exit": "kl:0.05", "exit_in_prefill": True}),
    ({"exit.gate": True, "supervision.kind": "learned_exit"}, {"exit": "quantile:0.5"}),
    ({"model.round_update": "damped", "model.round_eta": 0.5}, {"exit": "kl:0.05"}),
    ({"model.kv_sharing": "first"}, {"exit": "kl:0.05"}),
    ({}, {}),                                                       # fixed depth: joins still land mid-loop
]


@pytest.mark.parametrize("model_over, config", CONFIGS, ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()))
def test_each_request_decodes_what_it_decodes_alone(model_over, config):
    eng = Engine(tiny(**model_over), TOK, GenerationConfig(rounds=4, batching="depth", **config))
    ref = Engine(eng.model, TOK, GenerationConfig(rounds=4, **config))       # the plain engine, one request
    got, watch, batch = drive(eng, capacity=3)
    for i in range(len(PROMPTS)):
        assert got[i] == alone(ref, i), (config, i)
    assert max(len(r) for r in watch.rounds) == 3                              # every row of the batch was used
    if len({n for v in got.values() for _, n in v[1:]}) > 1:                   # decoded tokens exit at several rounds:
        assert any(len(set(r)) > 1 for r in watch.rounds)                      # tokens at different rounds shared steps


@pytest.mark.parametrize("chunk, exit", [(1, "kl:0.05"), (4, "kl:0.05"), (1, "fixed")])
def test_joining_prompts_prefilled_in_chunks_decode_what_they_decode_alone(chunk, exit):
    eng = Engine(tiny(**{"model.init_state": "random"}), TOK, GenerationConfig(rounds=4, exit=exit, batching="depth"))
    ref = Engine(eng.model, TOK, GenerationConfig(rounds=4, exit=exit))
    got, watch, _ = drive(eng, capacity=3, chunk=chunk)
    assert all(got[i] == alone(ref, i) for i in range(len(PROMPTS)))
    assert any(len(set(r)) > 1 for r in watch.rounds)         # a prompt prefilled over steps enters mid-loop


def test_a_request_cancelled_mid_loop_frees_its_row_and_the_others_are_unchanged():
    eng = Engine(tiny(), TOK, GenerationConfig(rounds=4, exit="kl:0.05", batching="depth"))
    ref = Engine(eng.model, TOK, GenerationConfig(rounds=4, exit="kl:0.05"))
    got, _, batch = drive(eng, capacity=3, cancel=(1, 3))
    assert 3 <= len(got[1]) < NEW[1]                     # it stopped mid-request
    assert got[1] == alone(ref, 1)[:len(got[1])]
    assert all(got[i] == alone(ref, i) for i in range(len(PROMPTS)) if i != 1)
    assert batch.finished and batch.loop is not None and len(batch.loop) == 0


def test_the_server_scheduler_with_depth_batching_equals_each_request_alone():
    """`serve --batching depth`: one batch of max_batch x max_batches rows; requests join at any tick."""
    eng = Engine(tiny(), TOK, GenerationConfig(rounds=4, exit="kl:0.05", batching="depth"))
    ref = Engine(eng.model, TOK, GenerationConfig(rounds=4, exit="kl:0.05"))
    sched = Scheduler(eng, SimpleNamespace(max_batch=2, max_batches=2, prefill_chunk=3, max_concurrent=64))
    got: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    rows = []
    for i in range(len(PROMPTS)):
        rows.append(Row(ids=TOK.encode(PROMPTS[i]), params=params(i), send=lambda ev, i=i: got[i].append(ev.token)))
        sched.submit(rows[-1])
        sched.tick()                                     # one arrival per tick: joins land mid-loop
    ticks = 0
    while sched.busy:
        sched.tick()
        ticks += 1
        assert ticks < 2000
    assert len(sched.running) == 0
    for i in range(len(PROMPTS)):
        assert got[i] == [t for t, _ in alone(ref, i)], i


def test_engine_generate_with_depth_batching_and_its_stats():
    eng = Engine(tiny(), TOK, GenerationConfig(rounds=4, exit="kl:0.05", batching="depth"))
    ref = Engine(eng.model, TOK, GenerationConfig(rounds=4, exit="kl:0.05"))
    sp = SamplingParams(max_new_tokens=6, stop_at_eos=False)
    out = eng.generate(PROMPTS[:4], sp)
    want = ref.generate(PROMPTS[:4], sp)
    assert [o.tokens for o in out] == [w.tokens for w in want]
    assert [o.rounds_used for o in out] == [w.rounds_used for w in want]
    st = out[0].stats
    decoded = sum(len(o.rounds_used) - 1 for o in out)
    assert st["decode_tokens"] == decoded
    assert st["row_rounds"] == sum(sum(o.rounds_used[1:]) for o in out)      # every round a decoded token ran
    assert st["mean_batch_rows"] == st["row_rounds"] / st["loop_steps"]
    # the FLOP record: the same tokens at the same columns for the same rounds as the plain batch's record
    # (its prompts left-padded alike), counted token by token as they leave the loop
    assert st["flops"]["decode"] == pytest.approx(want[0].stats["flops"]["decode"], rel=1e-12)
    assert st["flops"]["prefill"] == pytest.approx(want[0].stats["flops"]["prefill"], rel=1e-12)


def test_the_kernels_count_the_rounds_and_rows_the_model_ran():
    """`bench serve`'s mean recurrent batch: the kernels' count against the model's own core steps."""
    eng = Engine(tiny(), TOK, GenerationConfig(rounds=4, exit="kl:0.05", batching="depth"))
    seen = []
    core = eng.model.core_step

    def spy(s, *a, **k):
        if s.shape[1] == 1:
            seen.append(s.shape[0])
        return core(s, *a, **k)
    eng.model.core_step = spy
    k = eng.kernels()
    before = (k.column_rounds, k.column_round_rows)
    drive(eng, capacity=3)
    assert (k.column_rounds - before[0], k.column_round_rows - before[1]) == (len(seen), sum(seen))


@pytest.mark.parametrize("model_over, config, match", [
    ({}, {"speculative": "1:2"}, "speculative"),
    ({}, {"contrast": (1, 0.5)}, "contrast"),
    ({"model.untied": True}, {}, "untied"),
])
def test_depth_batching_refuses_what_it_cannot_run(model_over, config, match):
    with pytest.raises(UserError, match=f"--batching depth: not available with .*{match}"):
        Engine(tiny(**model_over), TOK, GenerationConfig(batching="depth", **config))


def test_static_batching_is_full_depth_and_refuses_an_exit_policy():
    m = tiny()
    eng = Engine(m, TOK, GenerationConfig(rounds=4, batching="static"))
    out = eng.generate(["hello"], SamplingParams(max_new_tokens=4, stop_at_eos=False))[0]
    assert out.rounds_used == [4] * 4
    with pytest.raises(UserError, match="--batching static runs every token at full depth"):
        Engine(m, TOK, GenerationConfig(rounds=4, exit="kl:0.05", batching="static"))
    assert Counter(out.rounds_used)[4] == 4
