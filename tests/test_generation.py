"""The cached generation engine: batching, exits, sampling, stop strings, streaming, speculation, CLI."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import looplm
from looplm.runs.checkpoint import save_checkpoint, write_text
from looplm.cli import main
from looplm.errors import UserError
from looplm.inference.engine import Engine, GenerationConfig, SamplingParams, TokenEvent
from looplm.data.tokenizer import ByteTokenizer

from conftest import greedy_by_full_forward

# init_std 0.3 spreads the logits, so greedy choices are far from ties
TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
        "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 3, "data.seq_len": 32}
TOK = ByteTokenizer()
PROMPTS = ["hello", "a somewhat longer prompt", "xy", "The loop runs", "0123456789", "q"]


def tiny(**overrides):
    torch.manual_seed(0)
    return looplm.build_model(looplm.load_recipe("quickstart", overrides={**TINY, **overrides})).eval()


@pytest.fixture(scope="module")
def model():
    return tiny()


GREEDY = SamplingParams(max_new_tokens=12, stop_at_eos=False)


@pytest.mark.parametrize("config", [
    {}, {"prefill_cache": "last", "decode_cache": "last"}, {"decode_cache": "average"},
    {"exit": "kl:0.02"}, {"exit": "kl:0.02", "missing": "mask"}, {"exit": "entropy:5.2", "decode_cache": "first"},
])
def test_batched_generation_equals_each_prompt_alone(model, config):
    eng = Engine(model, TOK, GenerationConfig(**config))
    batch = eng.generate(PROMPTS, GREEDY)
    for prompt, got in zip(PROMPTS, batch):
        alone = eng.generate([prompt], GREEDY)[0]
        assert got.tokens == alone.tokens and got.rounds_used == alone.rounds_used, (config, prompt)



@pytest.mark.parametrize("config", [
    {}, {"exit": "kl:0.02", "exit_in_prefill": True}, {"decode_cache": "last", "missing": "mask"},
    {"prefill_cache": "first"},
])
def test_chunked_prefill_equals_one_chunk(model, config):
    """A batch prefilled a few columns per step (the server's other batches run in between)
    decodes what one-chunk prefill decodes; under a shared prefill policy, where chunks would
    read earlier prompt tokens through the policy, the prompt stays one chunk."""
    eng = Engine(model, TOK, GenerationConfig(**config))
    whole = eng.generate(PROMPTS, GREEDY)
    for chunk in (1, 4, 7):
        run = eng.batch(PROMPTS, GREEDY, prefill_chunk=chunk)
        P = run.idx.shape[1]
        quiet, events = 0, []
        while not run.finished:
            evs = run.step()
            quiet += not evs
            events += evs
        parts = -(-P // chunk) if config.get("prefill_cache", "full") == "full" else 1
        assert run.stats["prefill_chunks"] == parts and quiet == parts - 1, (config, chunk)
        for b, want in enumerate(whole):
            got = [e for e in events if e.row == b]
            assert [e.token for e in got] == want.tokens and [e.rounds for e in got] == want.rounds_used, (config, b)


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4), chunk=st.integers(1, 24),
       exits=st.booleans())
def test_any_prefill_chunking_decodes_what_one_chunk_decodes(model, lengths, chunk, exits):
    """Random prompt lengths (left-padded rows) and chunk sizes, with or without per-token exits."""
    eng = Engine(model, TOK, GenerationConfig(**({"exit": "kl:0.02"} if exits else {})))
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    params = SamplingParams(max_new_tokens=5, stop_at_eos=False)
    whole = eng.generate(prompts, params)
    run = eng.batch(prompts, params, prefill_chunk=chunk)
    events = []
    while not run.finished:
        events += run.step()
    assert run.stats["prefill_chunks"] == -(-max(lengths) // chunk)
    for b, want in enumerate(whole):
        got = [e for e in events if e.row == b]
        assert [e.token for e in got] == want.tokens and [e.rounds for e in got] == want.rounds_used


@pytest.mark.parametrize("config, init", [
    ({}, "random"), ({"exit": "kl:0.02"}, "random"), ({"exit": "kl:0.02", "missing": "mask"}, "prelude"),
    ({"prefill_cache": "average", "decode_cache": "first"}, "prelude"),
    ({"exit": "entropy:5.2", "decode_cache": "last"}, "random"),
])
def test_rows_that_finished_are_not_computed_and_the_others_are_unchanged(config, init):
    m = tiny(**{"model.init_state": init})
    eng = Engine(m, TOK, GenerationConfig(**config))
    lengths, temps = [3, 12, 1, 7, 12, 5], [0, 0.8, 0, 0, 0.9, 0]
    params = [SamplingParams(max_new_tokens=n, temperature=t, seed=i, stop_at_eos=False)
              for i, (n, t) in enumerate(zip(lengths, temps))]
    batch = eng.generate(PROMPTS, params)
    assert batch[0].stats["decode_tokens"] == sum(n - 1 for n in lengths)     # one row-step per later token
    for prompt, sp, got in zip(PROMPTS, params, batch):
        alone = eng.generate([prompt], sp)[0]
        assert got.tokens == alone.tokens and got.rounds_used == alone.rounds_used, (config, prompt)



def _drive(batch, waiting, owner, got, on_step=None):
    """Step a batch to the end, joining the waiting (name, prompt, params) in order whenever one fits."""
    while not batch.finished:
        events = batch.step()
        if on_step:
            on_step(events)
        for ev in events:
            got[owner[ev.row]].append(ev.token)
        while waiting:
            name, prompt, sp = waiting[0]
            placed = batch.join(prompt, sp)
            if placed is None:
                break
            row, events = placed
            owner[row] = name
            got[name] += [ev.token for ev in events]
            waiting.pop(0)


@pytest.mark.parametrize("config, init", [
    ({}, "random"), ({"prefill_cache": "last", "decode_cache": "last"}, "prelude"),
    ({"prefill_cache": "average", "decode_cache": "first"}, "random"), ({"exit": "kl:0.02"}, "prelude"),
    ({"exit": "kl:0.02", "missing": "mask"}, "random"), ({"exit": "entropy:5.2", "decode_cache": "last"}, "prelude"),
    ({"exit": "kl:0.02", "exit_in_prefill": True}, "prelude"),
])
def test_prompts_that_join_a_running_batch_equal_each_alone(config, init):
    """Continuous batching: a new prompt takes a free row (one beyond the starting prompts, or a
    finished row's place) in a running batch."""
    eng = Engine(tiny(**{"model.init_state": init}), TOK, GenerationConfig(**config))
    starters = [("a0", "hello", SamplingParams(max_new_tokens=2, stop_at_eos=False)),
                ("a1", "a somewhat longer prompt", SamplingParams(max_new_tokens=30, temperature=0.8, seed=1,
                                                                  stop_at_eos=False)),
                ("a2", "xy", SamplingParams(max_new_tokens=4, stop_at_eos=False))]
    joiners = [("j0", "The loop runs", SamplingParams(max_new_tokens=6, stop_at_eos=False)),
               ("j1", "q", SamplingParams(max_new_tokens=9, temperature=0.7, seed=5, repetition_penalty=1.3,
                                          stop_at_eos=False)),
               ("j2", "0123456789", SamplingParams(max_new_tokens=12, stop=("zz",), stop_at_eos=False))]
    batch = eng.batch([p for _, p, _ in starters], [sp for _, _, sp in starters], length=64, capacity=4)
    owner = {b: name for b, (name, _, _) in enumerate(starters)}
    got: dict[str, list[int]] = {name: [] for name, _, _ in starters + joiners}
    waiting = list(joiners)
    _drive(batch, waiting, owner, got)
    assert not waiting
    for name, prompt, sp in starters + joiners:
        assert got[name] == eng.generate([prompt], sp)[0].tokens, (config, name)


@pytest.mark.parametrize("config", [{}, {"exit": "kl:0.02", "missing": "mask"}, {"exit": "kl:0.02", "exit_in_prefill": True},
                                    {"decode_cache": "average"}])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_a_joining_prompt_prefilled_in_chunks_equals_it_alone(config, chunk):
    """A prompt longer than the prefill chunk joins over several steps; the running rows get a
    token at each of them, and every row decodes what it decodes alone."""
    eng = Engine(tiny(**{"model.init_state": "random"}), TOK, GenerationConfig(**config))
    starters = [("a0", "hello", SamplingParams(max_new_tokens=2, stop_at_eos=False)),
                ("a1", "a somewhat longer prompt", SamplingParams(max_new_tokens=30, temperature=0.8, seed=1,
                                                                  stop_at_eos=False)),
                ("a2", "xy", SamplingParams(max_new_tokens=6, stop_at_eos=False))]
    joiners = [("j0", "The loop runs", SamplingParams(max_new_tokens=6, stop_at_eos=False)),
               ("j1", "q", SamplingParams(max_new_tokens=9, temperature=0.7, seed=5, stop_at_eos=False)),
               ("j2", "0123456789", SamplingParams(max_new_tokens=12, stop_at_eos=False))]
    batch = eng.batch([p for _, p, _ in starters], [sp for _, _, sp in starters], length=64, capacity=4,
                      prefill_chunk=chunk)
    owner = {b: name for b, (name, _, _) in enumerate(starters)}
    got: dict[str, list[int]] = {name: [] for name, _, _ in starters + joiners}
    quiet = []

    def on_step(events):     # while a row joins, every running row still gets its token
        running = [b for b, r in enumerate(batch.requests) if not r.done and r.joining is None]
        quiet.append(bool(batch._joining()) and not events and bool(running))
    _drive(batch, list(joiners), owner, got, on_step)
    assert not any(quiet)
    for name, prompt, sp in starters + joiners:
        assert got[name] == eng.generate([prompt], sp)[0].tokens, (config, chunk, name)


def test_a_joining_prompt_survives_steps_that_run_every_row():
    """Rows 0, 2, 3 running and row 1 joining: not consecutive and more than half, so a decode
    step runs every row, row 1 included, while its prompt is half prefilled. Those throwaway
    entries land on columns its later chunks overwrite."""
    eng = Engine(tiny(), TOK, GenerationConfig())
    long_sp = SamplingParams(max_new_tokens=20, stop_at_eos=False)
    prompts = ["hello there", "ab", "The loop runs", "0123456789"]
    params = [long_sp, SamplingParams(max_new_tokens=1, stop_at_eos=False), long_sp, long_sp]
    batch = eng.batch(prompts, params, length=64, prefill_chunk=2)
    calls = []
    run_chunk = eng.run_chunk

    def spy(idx, start, cache, **kw):
        calls.append((idx.shape[1], kw.get("rows") is None, bool(batch._joining())))
        return run_chunk(idx, start, cache, **kw)
    eng.run_chunk = spy
    owner = {b: str(b) for b in range(4)}
    got = {str(b): [] for b in range(4)} | {"late": []}
    late = ("late", "0123456789ab", SamplingParams(max_new_tokens=5, stop_at_eos=False))
    _drive(batch, [late], owner, got)
    assert owner[1] == "late"
    assert any(T == 1 and every and joining for T, every, joining in calls)
    for b, (prompt, sp) in enumerate(zip(prompts, params)):
        assert got[str(b)] == eng.generate([prompt], sp)[0].tokens, b
    assert got["late"] == eng.generate([late[1]], late[2])[0].tokens


def test_a_joining_prompt_completes_after_the_other_rows_finished():
    """Every running row ends while a prompt is still joining: the steps in between only prefill
    (the column advances as if the rows had run), then the new row decodes alone."""
    eng = Engine(tiny(), TOK, GenerationConfig())
    batch = eng.batch(["a somewhat longer prompt"], SamplingParams(max_new_tokens=3, stop_at_eos=False),
                      capacity=2, length=64, prefill_chunk=2)
    while not batch.started:                             # its own prompt: 12 chunks
        batch.step()
    sp = SamplingParams(max_new_tokens=7, stop_at_eos=False)
    row, events = batch.join("0123456789", sp)          # 5 chunks, one per step
    assert row == 1 and events == []
    got = []
    while not batch.finished:
        got += [ev.token for ev in batch.step() if ev.row == 1]
    assert got == eng.generate(["0123456789"], sp)[0].tokens


@pytest.mark.parametrize("cancel", [None, "j0", "j1"])
def test_joining_prompts_share_one_chunk_of_prefill_per_step(cancel):
    """Three prompts (10, 3 and 9 tokens) join at once with a chunk of 4: each step runs at most
    4 of their columns besides the decode, in the order they joined (4 | 4 | 2+2 | 1+3 | 4 | 2),
    the first token of each comes with its last columns, and a prompt cancelled while it waits
    does not move the others."""
    eng = Engine(tiny(), TOK, GenerationConfig())
    run_sp = SamplingParams(max_new_tokens=14, stop_at_eos=False)
    batch = eng.batch(["a somewhat longer prompt"], run_sp, capacity=4, length=64, prefill_chunk=4)
    first = []
    while not batch.started:
        first += [ev.token for ev in batch.step()]
    joins = {"j0": ("The loop r", SamplingParams(max_new_tokens=5, stop_at_eos=False)),
             "j1": ("abc", SamplingParams(max_new_tokens=6, temperature=0.9, seed=3, stop_at_eos=False)),
             "j2": ("012345678", SamplingParams(max_new_tokens=4, stop_at_eos=False))}
    owner, got = {0: "run"}, {"run": first, **{n: [] for n in joins}}
    for name, (prompt, sp) in joins.items():
        row, events = batch.join(prompt, sp)
        assert events == []
        owner[row] = name
    if cancel:
        batch.cancel(next(b for b, n in owner.items() if n == cancel))
    prefill: list[int] = []
    run_chunk = eng.run_chunk

    def spy(idx, start, cache, **kw):
        if kw.get("phase") == "prefill":
            prefill[-1] += idx.shape[1]
        return run_chunk(idx, start, cache, **kw)
    eng.run_chunk = spy
    firsts = []
    while not batch.finished:
        prefill.append(0)
        events = batch.step()
        firsts.append(sorted(owner[ev.row] for ev in events if ev.row and not got[owner[ev.row]]))
        for ev in events:
            got[owner[ev.row]].append(ev.token)
    want = {None: [4, 4, 4, 4, 4, 2], "j0": [0, 0, 2, 4, 4, 2], "j1": [4, 4, 2, 3, 4, 2]}[cancel]
    assert prefill[:6] == want and not any(prefill[6:])
    done = {None: ["j0", "j1", "j2"], "j0": ["j1", "j2"], "j1": ["j0", "j2"]}[cancel]
    assert [n for step in firsts for n in step] == done
    assert firsts.index(["j2"]) == 5                    # its last columns ran in the sixth step
    for name in done:
        assert got[name] == eng.generate([joins[name][0]], joins[name][1])[0].tokens, name
    assert got["run"] == eng.generate(["a somewhat longer prompt"], run_sp)[0].tokens


@settings(max_examples=10, deadline=None)
@given(starts=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 10)), min_size=1, max_size=3),
       joins=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 8)), min_size=1, max_size=4),
       chunk=st.integers(1, 8), extra=st.integers(0, 2))
def test_any_chunked_joins_decode_what_each_prompt_decodes_alone(model, starts, joins, chunk, extra):
    """Random starting prompts and lengths, prompts joining whenever they fit, any prefill chunk."""
    eng = Engine(model, TOK, GenerationConfig())

    def job(i, n, new):
        return f"p{i}", [(5 * i + 3 * j) % 250 + 1 for j in range(n)], SamplingParams(max_new_tokens=new, stop_at_eos=False)
    starters = [job(i, n, new) for i, (n, new) in enumerate(starts)]
    joiners = [job(10 + i, n, new) for i, (n, new) in enumerate(joins)]
    batch = eng.batch([p for _, p, _ in starters], [sp for _, _, sp in starters], length=64,
                      capacity=len(starters) + extra, prefill_chunk=chunk)
    owner = {b: name for b, (name, _, _) in enumerate(starters)}
    got: dict[str, list[int]] = {name: [] for name, _, _ in starters + joiners}
    waiting = list(joiners)
    _drive(batch, waiting, owner, got)
    for name, prompt, sp in starters + [j for j in joiners if j not in waiting]:
        assert got[name] == eng.generate([prompt], sp)[0].tokens, name


def test_a_prompt_that_does_not_fit_does_not_join(model):
    eng = Engine(model, TOK, GenerationConfig())
    batch = eng.batch(["abcd", "efgh"], [SamplingParams(max_new_tokens=2, stop_at_eos=False),
                                         SamplingParams(max_new_tokens=20, stop_at_eos=False)], length=30)
    assert batch.join("ab", SamplingParams(max_new_tokens=2)) is None          # not started: no free row
    batch.step()
    batch.step()                                                               # row 0 is done, col = 5
    assert batch.join("abcdef", SamplingParams(max_new_tokens=2)) is None      # 6 prompt tokens > 5 columns
    assert batch.join("ab", SamplingParams(max_new_tokens=27)) is None         # 5 + 27 - 1 > 30 columns
    row, events = batch.join("ab", SamplingParams(max_new_tokens=4, stop_at_eos=False))
    assert row == 0 and len(events) == 1
    assert batch.join("c", SamplingParams(max_new_tokens=2)) is None                     # no free row left



def test_a_cancelled_row_stops_and_frees_its_place(model):
    eng = Engine(model, TOK, GenerationConfig())
    sp, late = SamplingParams(max_new_tokens=10, stop_at_eos=False), SamplingParams(max_new_tokens=3, stop_at_eos=False)
    batch = eng.batch(["hello", "ab"], sp)
    got: dict[str, list[int]] = {"hello": [], "ab": [], "xy": []}
    owner = {0: "hello", 1: "ab"}
    for ev in batch.step():
        got[owner[ev.row]].append(ev.token)
    batch.cancel(0)                                           # the client of "hello" went away
    row, events = batch.join("xy", late)
    assert row == 0
    owner[0] = "xy"
    got["xy"] += [ev.token for ev in events]
    while not batch.finished:
        for ev in batch.step():
            got[owner[ev.row]].append(ev.token)
    assert len(got["hello"]) == 1
    assert got["ab"] == eng.generate(["ab"], sp)[0].tokens and got["xy"] == eng.generate(["xy"], late)[0].tokens


def test_cached_greedy_matches_the_no_cache_reference(model):
    """inference/reference.py recomputes the whole sequence per token (deterministic initial state here)."""
    m = tiny(**{"model.init_state": "prelude"})
    eng = Engine(m, TOK, GenerationConfig())
    for prompt in PROMPTS[:3]:
        want = greedy_by_full_forward(m, TOK.encode(prompt), 10)
        assert eng.generate([prompt], SamplingParams(max_new_tokens=10, stop_at_eos=False))[0].tokens == want


def test_logprobs_are_the_models_distribution_at_each_generated_token():
    """Each token's log-probability and the top alternatives equal log-softmax of a full forward
    pass over the prompt and the tokens so far (raw logits: the penalty, temperature and top-k
    shape the choice, not the report), in a batch of prompts of different lengths."""
    m = tiny(**{"model.init_state": "prelude"})
    eng = Engine(m, TOK, GenerationConfig())
    params = [SamplingParams(max_new_tokens=6, logprobs=3, stop_at_eos=False),
              SamplingParams(max_new_tokens=5, temperature=0.9, top_k=5, seed=2, repetition_penalty=1.5, logprobs=0,
                             stop_at_eos=False),
              SamplingParams(max_new_tokens=4, stop_at_eos=False)]
    prompts = ["hello", "a somewhat longer prompt", "xy"]
    out = eng.generate(prompts, params)
    assert out[2].logprobs is None and out[2].top_logprobs is None
    for prompt, sp, got in zip(prompts[:2], params[:2], out[:2]):
        seq = TOK.encode(prompt)
        assert len(got.logprobs) == len(got.tokens) == len(got.top_logprobs)
        for tok, lp, top in zip(got.tokens, got.logprobs, got.top_logprobs):
            with torch.no_grad():
                ref = torch.log_softmax(m(torch.tensor([seq])).logits[0, -1], -1)
            assert abs(lp - float(ref[tok])) < 1e-4
            best = torch.topk(ref, sp.logprobs)
            assert [t for t, _ in top] == best.indices.tolist()
            assert all(abs(v - w) < 1e-4 for (_, v), w in zip(top, best.values.tolist()))
            seq.append(tok)
    events = [ev for ev in eng.stream(prompts, params) if ev.row == 0]      # the events carry the same
    assert [ev.logprob for ev in events] == out[0].logprobs


@pytest.mark.parametrize("config", [{}, {"exit": "entropy:4.5", "exit_in_prefill": True, "decode_cache": "last"}])
def test_prompt_logprobs_are_what_the_prefill_computes(config):
    """Engine.prompt_logprobs (the server's echo): at full depth, log-softmax of a forward pass
    with the seed's initial state; with exits in the prompt, the logits of the column-by-column
    prefill that generation runs (its first token is the argmax of the last column's)."""
    from looplm.model.looped import initial_noise_table

    m = tiny()                                               # random initial state
    eng = Engine(m, TOK, GenerationConfig(**config))
    ids = TOK.encode("a somewhat longer prompt")
    (lps, tops), = eng.prompt_logprobs([ids], top=3, seeds=[5])
    assert lps[0] is None and tops[0] is None and len(lps) == len(tops) == len(ids)
    if not config:
        with torch.no_grad():
            ref = torch.log_softmax(m(torch.tensor([ids]), initial_state=initial_noise_table(m.cfg, 5)[None, :len(ids)])
                                    .logits[0], -1)
        for t in range(1, len(ids)):
            assert abs(lps[t] - float(ref[t - 1, ids[t]])) < 1e-4
            assert [a for a, _ in tops[t]] == torch.topk(ref[t - 1], 3).indices.tolist()
    (longer, _), = eng.prompt_logprobs([ids + [7]], seeds=[5])      # a later token changes nothing before it
    assert longer[1:len(ids)] == pytest.approx(lps[1:], abs=1e-5)
    batch = eng.prompt_logprobs([ids[:5], ids, [9]], top=3, seeds=[1, 5, 2])     # left-padded: the same per row
    assert batch[1][0][1:] == pytest.approx(lps[1:], abs=1e-5) and batch[2] == ([None], [None])
    assert batch[0][0][1:] == pytest.approx(eng.prompt_logprobs([ids[:5]], seeds=[1])[0][0][1:], abs=1e-5)
    first = eng.generate([ids[:-1]], SamplingParams(max_new_tokens=1, seed=5, logprobs=1))[0]
    (tok, val), = first.top_logprobs[0]                               # greedy: the likeliest after ids[:-1]
    assert tok == first.tokens[0] == tops[-1][0][0] and val == pytest.approx(tops[-1][0][1], abs=1e-5)


def test_a_prompt_of_the_whole_context_is_scored_and_continued_by_one_token():
    """The last new token is sampled, never fed back: a prompt + N new tokens run P + N - 1
    positions, and that is what must fit. A prompt of the whole context gets its prompt
    log-probabilities and one token (both a forward pass over it), batched beside a short
    prompt, under speculation too, and through the no-cache reference; one more is refused."""
    from looplm.inference.reference import generate_text

    m = tiny(**{"model.init_state": "prelude"})
    ctx = m.cfg.context
    ids = [(7 * i) % 90 + 32 for i in range(ctx)]                 # printable ASCII: a byte each
    with torch.no_grad():
        ref = torch.log_softmax(m(torch.tensor([ids])).logits[0], -1)                  # (ctx, V)
    want = [None] + [float(ref[t - 1, ids[t]]) for t in range(1, ctx)]
    eng = Engine(m, TOK, GenerationConfig())
    (lps, _), (short, _) = eng.prompt_logprobs([ids, ids[:5]])
    assert lps[1:] == pytest.approx(want[1:], abs=1e-4) and short[1:] == pytest.approx(want[1:5], abs=1e-4)
    one = SamplingParams(max_new_tokens=1, logprobs=0, stop_at_eos=False)
    whole, beside = eng.generate([ids, ids[:ctx - 3]], [one, SamplingParams(max_new_tokens=4, stop_at_eos=False)])
    assert whole.tokens == [int(ref[-1].argmax())] and whole.logprobs == pytest.approx([float(ref[-1].max())], abs=1e-4)
    assert beside.tokens == eng.generate([ids[:ctx - 3]], SamplingParams(max_new_tokens=4, stop_at_eos=False))[0].tokens
    spec = Engine(m, TOK, GenerationConfig(speculative="1:3"))
    assert spec.generate([ids[:ctx - 2]], SamplingParams(max_new_tokens=3, stop_at_eos=False))[0].tokens == \
        eng.generate([ids[:ctx - 2]], SamplingParams(max_new_tokens=3, stop_at_eos=False))[0].tokens
    run = SimpleNamespace(model=m, tokenizer=TOK)                       # what generate_text reads, rounds given
    text = "".join(chr(t) for t in ids[:ctx - 1])
    assert generate_text(run, text, max_new_tokens=2, rounds=3)["tokens"] == \
        eng.generate([TOK.encode(text)], SamplingParams(max_new_tokens=2, stop_at_eos=False))[0].tokens
    with pytest.raises(UserError, match="context"):
        eng.generate([ids], SamplingParams(max_new_tokens=2))
    with pytest.raises(UserError, match="context"):
        generate_text(run, text, max_new_tokens=3, rounds=3)


def test_presence_and_frequency_penalties_match_a_hand_computed_loop():
    """OpenAI's penalties on the output so far: each greedy token is the argmax of the forward
    pass's logits minus presence * [count > 0] minus frequency * count, computed here by hand;
    a row without penalties in the same batch is unaffected, and speculation agrees."""
    m = tiny(**{"model.init_state": "prelude"})
    eng = Engine(m, TOK, GenerationConfig())
    pen = SamplingParams(max_new_tokens=16, presence_penalty=0.7, frequency_penalty=1.3, stop_at_eos=False)
    plain = SamplingParams(max_new_tokens=16, stop_at_eos=False)
    got = eng.generate(["hello", "hello"], [pen, plain])
    for sp, out in zip((pen, plain), got):
        seq, counts = TOK.encode("hello"), torch.zeros(m.cfg.vocab_size)
        want = []
        for _ in range(16):
            with torch.no_grad():
                logits = m(torch.tensor([seq])).logits[0, -1]
            tok = int((logits - sp.presence_penalty * (counts > 0) - sp.frequency_penalty * counts).argmax())
            want.append(tok)
            counts[tok] += 1
            seq.append(tok)
        assert out.tokens == want
    assert got[0].tokens != got[1].tokens                         # the penalties changed something
    spec = Engine(m, TOK, GenerationConfig(speculative="1:3")).generate(["hello"], pen)[0]
    assert spec.tokens == got[0].tokens


def test_logit_bias_is_added_after_the_penalties_as_a_hand_computed_loop():
    """OpenAI's logit_bias: each greedy token is the argmax of the forward pass's logits, minus the
    penalties, plus the bias, computed here by hand; batched beside a row without a bias, in a row
    that joins a running batch, under speculation; the reported logprobs stay the model's."""
    m = tiny(**{"model.init_state": "prelude"})
    eng = Engine(m, TOK, GenerationConfig())
    plain = SamplingParams(max_new_tokens=12, stop_at_eos=False)
    first = eng.generate(["hello"], plain)[0].tokens
    bias = {first[0]: -100.0, first[3]: -3.0, ord("l"): 2.5}
    sp = SamplingParams(max_new_tokens=12, frequency_penalty=0.5, logit_bias=bias, logprobs=0, stop_at_eos=False)
    seq, counts, want, lps = TOK.encode("hello"), torch.zeros(m.cfg.vocab_size), [], []
    add = torch.zeros(m.cfg.vocab_size)
    add[list(bias)] = torch.tensor(list(bias.values()))
    for _ in range(12):
        with torch.no_grad():
            logits = m(torch.tensor([seq])).logits[0, -1]
        tok = int((logits - 0.5 * counts + add).argmax())
        want.append(tok)
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        counts[tok] += 1
        seq.append(tok)
    biased, unbiased = eng.generate(["hello", "hello"], [sp, plain])
    assert biased.tokens == want and unbiased.tokens == first and want[0] != first[0]
    assert biased.logprobs == pytest.approx(lps, abs=1e-4)
    running = SamplingParams(max_new_tokens=30, logit_bias={ord("z"): 1.0}, stop_at_eos=False)    # a bias already
    run = eng.batch(["a somewhat longer prompt"], running, length=60, capacity=2)
    run.step()
    row, events = run.join("hello", sp)
    while not run.finished:
        events += run.step()
    assert [ev.token for ev in events if ev.row == row] == want
    assert Engine(m, TOK, GenerationConfig(speculative="1:3")).generate(["hello"], sp)[0].tokens == want
    assert SamplingParams(logit_bias={5: 1, 2: -1}).logit_bias == ((2, -1.0), (5, 1.0))
    for bad in ({5: 101}, {-1: 0}, {True: 1}, [(1, 1), (1, 2)], {i: 1 for i in range(301)}, [1, 2]):
        with pytest.raises(UserError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(UserError, match="vocabulary"):
        eng.generate(["x"], SamplingParams(logit_bias={m.cfg.vocab_size: 1}))


@pytest.mark.parametrize("config", [{}, {"exit": "kl:0.02", "exit_in_prefill": True}])
def test_prompt_logprobs_arrive_with_the_first_token_however_the_prompt_was_prefilled(config):
    """SamplingParams(prompt_logprobs=N): the prompt's figures ride on the row's first event and
    are the same whether the prompt was prefilled whole, in chunks (left-padded starting rows,
    chunks that cut through the padding), or joined a running batch in chunks; a speculative
    engine reports the same; rows that did not ask get none."""
    eng = Engine(tiny(), TOK, GenerationConfig(**config))
    ask = SamplingParams(max_new_tokens=3, prompt_logprobs=2, seed=3, stop_at_eos=False)
    plain = SamplingParams(max_new_tokens=3, seed=3, stop_at_eos=False)
    prompts = ["a somewhat longer prompt", "xy", "The loop runs"]
    want = {p: eng.prompt_logprobs([TOK.encode(p)], top=2, seeds=[3])[0] for p in prompts + ["0123456789"]}
    batch = eng.batch(prompts, [ask, plain, ask], capacity=4, length=64, prefill_chunk=5)
    firsts: dict[str, TokenEvent] = {}
    owner = {0: prompts[0], 1: prompts[1], 2: prompts[2]}
    while not batch.finished:
        for ev in batch.step():
            firsts.setdefault(owner[ev.row], ev)
        if len(owner) == 3 and batch.started:
            row, _ = batch.join("0123456789", ask)        # 10 tokens in chunks of 5, through a free row
            owner[row] = "0123456789"
    assert firsts["xy"].prompt_logprobs is None and firsts["xy"].prompt_top_logprobs is None
    for p in (prompts[0], prompts[2], "0123456789"):
        got, lps = firsts[p], want[p][0]
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(TOK.encode(p)), p
        assert got.prompt_logprobs[1:] == pytest.approx(lps[1:], abs=1e-5), p
        assert [[t for t, _ in top] for top in got.prompt_top_logprobs[1:]] == \
            [[t for t, _ in top] for top in want[p][1][1:]], p
    done = eng.generate(prompts[:2], [ask, plain])                  # Completion carries them too
    assert done[0].prompt_logprobs[1:] == pytest.approx(want[prompts[0]][0][1:], abs=1e-5)
    assert done[1].prompt_logprobs is None
    if not config:
        spec = Engine(eng.model, TOK, GenerationConfig(speculative="1:2"))
        ev = next(iter(spec.stream([prompts[0]], ask)))
        assert ev.prompt_logprobs[1:] == pytest.approx(want[prompts[0]][0][1:], abs=1e-5)


@pytest.mark.parametrize("spec", ["1:2", "2:3"])
def test_speculative_logprobs_are_plain_decodings(model, spec):
    """Each emitted token's logprob comes from the full-depth logits that chose it (the prefill's
    or the verifier's), which are plain decoding's: the same figures as plain greedy decoding."""
    sp = SamplingParams(max_new_tokens=14, logprobs=2, stop_at_eos=False)
    plain = Engine(model, TOK, GenerationConfig()).generate(["The loop"], sp)[0]
    fast = Engine(model, TOK, GenerationConfig(speculative=spec)).generate(["The loop"], sp)[0]
    assert fast.tokens == plain.tokens and fast.stats["speculative"]["accepted"] > 0
    assert fast.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    assert [[t for t, _ in top] for top in fast.top_logprobs] == [[t for t, _ in top] for top in plain.top_logprobs]
    with pytest.raises(UserError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_exit_policies_really_skip_rounds(model):
    eng = Engine(model, TOK, GenerationConfig(rounds=4, exit="entropy:100"))   # every token may stop at round 1
    calls = []
    real = Engine.run_chunk

    def counting(self, idx, start, cache, **kw):
        orig = cache.update

        def update(slot, k, v):
            calls.append((kw.get("phase", "decode"), slot[0], slot[1]))
            return orig(slot, k, v)
        cache.update = update
        try:
            return real(self, idx, start, cache, **kw)
        finally:
            cache.update = orig
    Engine.run_chunk = counting
    try:
        out = eng.generate(["hello"], SamplingParams(max_new_tokens=6, stop_at_eos=False))[0]
    finally:
        Engine.run_chunk = real
    assert out.rounds_used == [4, 1, 1, 1, 1, 1]     # the prompt runs all rounds (exit_in_prefill off)
    assert {r for phase, kind, r in calls if phase == "decode" and kind == "core"} == {1}
    assert {r for phase, kind, r in calls if phase == "prefill" and kind == "core"} == {1, 2, 3, 4}


def test_min_rounds_and_fixed_depth(model):
    eng = Engine(model, TOK, GenerationConfig(rounds=4, exit="entropy:100", min_rounds=3))
    assert eng.generate(["hi"], SamplingParams(max_new_tokens=4, stop_at_eos=False))[0].rounds_used == [4, 3, 3, 3]
    eng = Engine(model, TOK, GenerationConfig(exit="fixed:5"))
    assert eng.generate(["hi"], SamplingParams(max_new_tokens=3, stop_at_eos=False))[0].rounds_used == [5, 5, 5]
    with pytest.raises(UserError, match="disagrees"):
        Engine(model, TOK, GenerationConfig(exit="fixed:5", rounds=3))


def test_exit_in_prefill_lets_prompt_tokens_exit(model):
    eng = Engine(model, TOK, GenerationConfig(rounds=4, exit="entropy:100", exit_in_prefill=True))
    out = eng.generate(["hello"], SamplingParams(max_new_tokens=3, stop_at_eos=False))[0]
    assert out.rounds_used == [1, 1, 1]


def test_quantile_exit_uses_the_gate():
    m = tiny(**{"exit.gate": True, "supervision.kind": "learned_exit"})          # gate starts at hazard sigmoid(-1) = 0.27 per round
    out = Engine(m, TOK, GenerationConfig(rounds=4, exit="quantile:0.5")).generate(
        ["hello"], SamplingParams(max_new_tokens=4, stop_at_eos=False))[0]
    assert out.rounds_used == [4, 3, 3, 3]   # CDF after 2 rounds 0.47, after 3 rounds 0.61
    with pytest.raises(UserError, match="gate"):
        Engine(tiny(), TOK, GenerationConfig(exit="quantile:0.5"))


@pytest.mark.parametrize("spec", ["1:3", "2:4", "3:2"])
def test_speculative_greedy_equals_plain_greedy(model, spec):
    plain = Engine(model, TOK, GenerationConfig())
    fast = Engine(model, TOK, GenerationConfig(speculative=spec))
    params = SamplingParams(max_new_tokens=20, stop_at_eos=False)
    drafted = accepted = 0
    for prompt in PROMPTS + ["more prompts", "to check", "speculation"]:
        want = plain.generate([prompt], params)[0]
        got = fast.generate([prompt], params)[0]
        assert got.tokens == want.tokens, (spec, prompt)
        drafted += got.stats["speculative"]["drafted"]
        accepted += got.stats["speculative"]["accepted"]
    assert drafted > 0 and 0 <= accepted <= drafted
    if spec == "3:2":      # drafting at full depth agrees with the verifier
        assert accepted == drafted


@pytest.mark.parametrize("d", [1, 2])
def test_verification_reusing_the_drafts_rounds_equals_a_full_depth_chunk(model, d):
    """Verification starts the drafted columns at round d+1 from the drafts' own states; its
    logits equal running pending + drafts through every round as one chunk."""
    import copy

    from looplm.inference.speculative import verify_from_drafts
    eng = Engine(model, TOK, GenerationConfig(rounds=4))
    prompt = torch.tensor([TOK.encode("The loop runs")])
    P, K = prompt.shape[1], 3
    noise = eng.initial_noise([SamplingParams(seed=5)], next(model.parameters()))
    cache = eng.new_cache(1, P + K + 1)
    with torch.inference_mode():
        eng.run_chunk(prompt, 0, cache, phase="prefill", noise=noise)
        toks, trace = [7], []
        for j in range(K):                                  # drafts of d rounds, as speculative_events runs them
            lg, _ = eng.run_chunk(torch.tensor([[toks[-1]]]), P + j, cache, rounds=d, noise=noise, commit=False,
                                  trace=trace)
            toks.append(int(lg[0].argmax()))
        before = copy.deepcopy(cache)
        reused = verify_from_drafts(eng, cache, P, toks[1:], trace, d, noise)
        full, _ = eng.run_chunk(torch.tensor([toks]), P, before, rounds=4, noise=noise, all_logits=True)
    assert reused.shape == full.shape == (1, K + 1, model.cfg.vocab_size)
    assert (reused - full).abs().max().item() < 1e-5
    for part in ("k_core", "v_core", "k_coda", "v_coda", "k_prelude"):       # the same cache afterwards
        assert (getattr(cache, part) - getattr(before, part)).abs().max().item() < 1e-5


@pytest.mark.parametrize("exit, missing, in_prefill", [
    ("kl:0.1", "copy_forward", False), ("kl:0.3", "copy_forward", True), ("kl:0.3", "mask", False)])
def test_speculative_exit_drafts_equal_plain_full_depth_greedy(model, exit, missing, in_prefill):
    """Drafts stop by the exit policy at mixed rounds (the next draft reads the skipped rounds
    filled or masked); verification at full depth makes the output plain 4-round greedy."""
    plain = Engine(model, TOK, GenerationConfig(rounds=4))
    fast = Engine(model, TOK, GenerationConfig(rounds=4, exit=exit, missing=missing, exit_in_prefill=in_prefill,
                                               speculative="exit:4"))
    params = SamplingParams(max_new_tokens=20, stop_at_eos=False)
    drafted = accepted = draft_rounds = 0.0
    for prompt in PROMPTS:
        want = plain.generate([prompt], params)[0]
        got = fast.generate([prompt], params)[0]
        assert got.tokens == want.tokens and got.rounds_used == [4] * 20, (exit, prompt)
        spec = got.stats["speculative"]
        assert spec["draft_rounds"] is None and spec["draft_exit"] == exit and got.stats["exit"] == "fixed:4"
        drafted += spec["drafted"]
        accepted += spec["accepted"]
        draft_rounds += spec["draft_mean_rounds"] * spec["drafted"]
    assert 0 < accepted < drafted
    assert 1 < draft_rounds / drafted < 4        # the drafts did stop at different rounds


@pytest.mark.parametrize("min_rounds", [1, 2])
def test_speculative_exit_drafts_that_always_stop_early_are_fixed_round_drafts(model, min_rounds):
    """entropy:100 stops every draft at its first allowed round: the same drafts, acceptances
    and tokens as drafting with that many rounds."""
    by_exit = Engine(model, TOK, GenerationConfig(speculative="exit:3", exit="entropy:100", min_rounds=min_rounds))
    fixed = Engine(model, TOK, GenerationConfig(speculative=f"{min_rounds}:3"))
    for prompt in PROMPTS[:4]:
        p = SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, stop_at_eos=False)
        a, b = by_exit.generate([prompt], p)[0], fixed.generate([prompt], p)[0]
        assert a.tokens == b.tokens
        sa, sb = a.stats["speculative"], b.stats["speculative"]
        assert (sa["drafted"], sa["accepted"]) == (sb["drafted"], sb["accepted"])
        assert sa["draft_mean_rounds"] == sb["draft_mean_rounds"] == min_rounds


def test_speculative_sampling_is_seeded_and_refuses_what_it_cannot_do(model):
    eng = Engine(model, TOK, GenerationConfig(speculative="1:3"))
    p = SamplingParams(max_new_tokens=15, temperature=0.9, top_p=0.95, seed=4, stop_at_eos=False)
    a, b = eng.generate(["hello"], p)[0], eng.generate(["hello"], p)[0]
    assert a.tokens == b.tokens and len(a.tokens) == 15
    with pytest.raises(UserError, match="batch 1"):
        eng.generate(["a", "b"], p)
    with pytest.raises(UserError, match="decode-cache full"):
        Engine(model, TOK, GenerationConfig(speculative="1:3", decode_cache="last"))
    with pytest.raises(UserError, match="ROUNDS:K"):
        Engine(model, TOK, GenerationConfig(speculative="9:3"))
    with pytest.raises(UserError, match="early-exit policy"):      # exit drafts need a policy to stop by
        Engine(model, TOK, GenerationConfig(speculative="exit:3"))
    with pytest.raises(UserError, match="exit:K"):                 # fixed-round drafts and an exit policy
        Engine(model, TOK, GenerationConfig(speculative="1:3", exit="kl:0.1"))


def test_sampling_options(model):
    eng = Engine(model, TOK, GenerationConfig())
    greedy = eng.generate(["hello"], SamplingParams(max_new_tokens=10, stop_at_eos=False))[0].tokens

    def sample(**kw):
        return eng.generate(["hello"], SamplingParams(max_new_tokens=10, stop_at_eos=False, **kw))[0].tokens
    assert sample(temperature=1.0, seed=1) == sample(temperature=1.0, seed=1)
    assert sample(temperature=1.0, seed=1) != sample(temperature=1.0, seed=2)
    # the seed also picks the random initial loop state, so compare with greedy at the same seed (0)
    assert sample(temperature=1.0, top_k=1) == greedy
    assert sample(temperature=1.0, top_p=1e-6) == greedy
    no_repeat = sample(repetition_penalty=100.0)
    assert len(set(no_repeat)) == len(no_repeat) and not set(no_repeat) & set(TOK.encode("hello"))


def test_batch_rows_sample_independently(model):
    eng = Engine(model, TOK, GenerationConfig())
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s, stop_at_eos=False) for s in (1, 2, 3)]
    batch = eng.generate(["a", "bcd", "efgh"], params)
    for prompt, sp, got in zip(["a", "bcd", "efgh"], params, batch):
        assert eng.generate([prompt], sp)[0].tokens == got.tokens


def test_stop_strings_cut_the_text(model):
    eng = Engine(model, TOK, GenerationConfig())
    full = eng.generate(["The"], SamplingParams(max_new_tokens=40, stop_at_eos=False))[0]
    i = next(i for i, t in enumerate(full.tokens) if 32 <= t < 127 and i > 0)   # an ASCII token
    stop = chr(full.tokens[i])
    cut = eng.generate(["The"], SamplingParams(max_new_tokens=40, stop=(stop,), stop_at_eos=False))[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and full.text.startswith(cut.text)
    assert cut.tokens == full.tokens[:len(cut.tokens)] and len(cut.tokens) <= i + 1


def test_streaming_yields_the_same_text_token_by_token(model):
    eng = Engine(model, TOK, GenerationConfig())
    params = SamplingParams(max_new_tokens=16, stop_at_eos=False)
    events = list(eng.stream(["hello", "ab"], params))
    done = eng.generate(["hello", "ab"], params)
    for row in (0, 1):
        evs = [e for e in events if e.row == row]
        assert [e.token for e in evs] == done[row].tokens
        assert "".join(e.text for e in evs) == done[row].text
        assert evs[-1].finish_reason == "length" and all(e.finish_reason is None for e in evs[:-1])



@pytest.mark.parametrize("spec", [None, "1:3"])
def test_streams_advanced_in_turn_equal_each_alone_and_keep_the_callers_mode(model, spec):
    """The server advances several batches one step each in turn; the caller's code between
    events must not run in the engine's inference mode (it may train or use autograd)."""
    eng = Engine(model, TOK, GenerationConfig(speculative=spec))
    jobs = [(["hello"] if spec else ["hello", "ab"], SamplingParams(max_new_tokens=14, stop_at_eos=False)),
            (["The loop"], SamplingParams(max_new_tokens=9, temperature=0.9, seed=3, stop_at_eos=False))]
    streams = [eng.stream(p, sp) for p, sp in jobs]
    got: list[dict[int, list[int]]] = [{}, {}]
    live = [True, True]
    while any(live):
        for i, stream in enumerate(streams):
            if not live[i]:
                continue
            ev = next(stream, None)
            if ev is None:
                live[i] = False
                continue
            assert not torch.is_inference_mode_enabled()
            got[i].setdefault(ev.row, []).append(ev.token)
    w = torch.ones(2, requires_grad=True)
    (w * 2).sum().backward()                  # autograd works in the caller after the streams
    for (prompts, sp), rows in zip(jobs, got):
        alone = eng.generate(prompts, sp)
        assert [rows[b] for b in range(len(prompts))] == [c.tokens for c in alone]


def _last_state(m, prompt):
    """The coda's output at the prompt's last position (what the head reads for the first new token)."""
    seen = []
    hook = m.final_norm.register_forward_hook(lambda mod, args, out: seen.append(args[0][0, -1]))
    m(torch.tensor([TOK.encode(prompt)]))
    hook.remove()
    return seen[-1]


def test_eos_ends_a_row(model):
    m = tiny(**{"model.tie_embeddings": False})
    with torch.no_grad():   # point eos's head row along both prompts' final readout states
        finals = [m.final_norm(_last_state(m, p)) for p in ("hello", "x")]
        w = sum(f / f.norm() for f in finals)
        m.head.weight[TOK.eos_id] = 100 * w / w.norm()
    out = Engine(m, TOK, GenerationConfig()).generate(["hello", "x"], SamplingParams(max_new_tokens=10))
    assert all(o.tokens == [TOK.eos_id] and o.finish_reason == "stop" and o.text == "" for o in out)


def test_bad_inputs_are_user_errors(model):
    eng = Engine(model, TOK, GenerationConfig())
    with pytest.raises(UserError, match="context"):
        eng.generate(["x" * 60], SamplingParams(max_new_tokens=10))
    with pytest.raises(UserError, match="empty"):
        eng.generate([""], SamplingParams())
    for bad in ({"max_new_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -1},
                {"repetition_penalty": 0}, {"stop": ("",)}):
        with pytest.raises(UserError):
            SamplingParams(**bad)
    for bad in ({"exit": "sometimes"}, {"prefill_cache": "most"}, {"missing": "skip"}, {"rounds": 0}):
        with pytest.raises(UserError):
            Engine(model, TOK, GenerationConfig(**bad))


def test_weights_changed_in_place_are_picked_up(model):
    m = tiny()
    eng = Engine(m, TOK, GenerationConfig())
    before = eng.generate(["hello"], GREEDY)[0].tokens
    with torch.no_grad():
        for p in m.core.parameters():
            p.mul_(-1.0)
    after = eng.generate(["hello"], GREEDY)[0].tokens
    assert after != before
    assert after == Engine(m, TOK, GenerationConfig()).generate(["hello"], GREEDY)[0].tokens


# -- the CLI ------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["prelude", "random"])
def run_dir(tmp_path_factory, request):
    """A run folder; with a random initial state both engines must draw the same position-indexed noise."""
    d = tmp_path_factory.mktemp("run")
    std = {"model.init_state_std": 3.0} if request.param == "random" else {}   # only noise has a std
    recipe = looplm.load_recipe("quickstart", overrides={**TINY, "model.init_state": request.param, **std})
    torch.manual_seed(0)
    save_checkpoint(d, looplm.build_model(recipe), {"step": 0})
    TOK.save(d / "checkpoint")
    write_text(d / "recipe.toml", recipe.to_toml())
    return d


def test_cli_generate_json(run_dir, capsys):
    assert main(["generate", str(run_dir), "--prompt", "hello", "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("text", "tokens", "rounds_used", "prefill_tokens_per_s", "decode_tokens_per_s"):
        assert key in out
    assert len(out["tokens"]) == len(out["rounds_used"]) == 8
    assert main(["generate", str(run_dir), "--prompt", "hello", "--max-new-tokens", "8", "--json", "--no-cache"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert ref["tokens"] == out["tokens"]       # cached decoding matches the slow reference
    assert main(["generate", str(run_dir), "--prompt", "hello", "--max-new-tokens", "8", "--json",
                 "--speculative", "1:3", "--prefill-cache", "last"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert "acceptance_rate" in spec["speculative"]
    assert main(["generate", str(run_dir), "--prompt", "hello", "--max-new-tokens", "8", "--json",
                 "--exit", "kl:0.01", "--decode-cache", "average", "--missing-kv", "mask"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rounds_used"]) == 8
    assert "logprobs" not in out
    assert main(["generate", str(run_dir), "--prompt", "hello", "--max-new-tokens", "8", "--json", "--logprobs", "2"]) == 0
    lp = json.loads(capsys.readouterr().out)
    assert lp["tokens"] == out["tokens"] and len(lp["logprobs"]) == 8
    assert [top[0][0] for top in lp["top_logprobs"]] == out["tokens"]          # greedy: the likeliest token
    assert main(["generate", str(run_dir), "--prompt", "hello", "--max-new-tokens", "8", "--json",
                 "--logit-bias", "120=100", "--logit-bias", f"{out['tokens'][0]}=-100"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [120] * 8                  # forced


@pytest.mark.parametrize("args", [
    ["--decode-cache", "most"], ["--prefill-cache", "x"], ["--exit", "soon"], ["--speculative", "0:1"], ["--speculative", "exit:2"],
    ["--speculative", "1:2", "--exit", "kl:0.1"], ["--max-new-tokens", "500"], ["--temperature", "-1"],
    ["--no-cache", "--top-k", "3"], ["--missing-kv", "skip"], ["--top-p", "2"], ["--logprobs", "21"],
    ["--no-cache", "--logprobs", "1"], ["--logit-bias", "5"], ["--logit-bias", "x=1"], ["--logit-bias", "5=200"],
    ["--logit-bias", "900=1"], ["--no-cache", "--logit-bias", "5=1"],
])
def test_cli_generate_bad_input_exits_2_with_one_line(run_dir, capsys, args):
    assert main(["generate", str(run_dir), "--prompt", "hello", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("looplm: error:")


def test_bench_decode_quick_json(capsys):
    """The benchmark's shape (tiny sizes; the real numbers come from `looplm bench decode`)."""
    assert main(["bench", "decode", "--quick", "--no-peers", "--runs", "1", "--new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["results"] and all(r["engine"] == "looplm" for r in out["results"])
    for r in out["results"]:
        for key in ("batch", "decode_tokens_per_s", "prefill_tokens_per_s", "ttft_s", "peak_rss_bytes"):
            assert key in r
    # compute per decoded token, every column the engine ran: fixed depth 3, the 3 columns 32..34 after
    # the prompt (the first of the 4 tokens comes from the prefill)
    from looplm.bench.decode import BENCH_S, PROMPT_LEN, QUICK
    from looplm.model.flops import decode_flops
    cfg = looplm.load_recipe("quickstart", {**BENCH_S, **QUICK}).model
    want = sum(decode_flops(cfg, 3, PROMPT_LEN + i) for i in range(3)) / 3
    fixed = [r for r in out["results"] if r.get("exit") == "fixed:3" and not r.get("speculative")]
    assert fixed and all(r["decode_flops_per_token"] == pytest.approx(want) for r in fixed)
    assert "looplm_batch8_vs_batch1" in out["ratios"]
    assert out["threads"] == len(os.sched_getaffinity(0))        # the default: every usable core
    assert main(["bench", "decode", "--runs", "0"]) == 2
    assert main(["bench", "decode", "--threads", "-1"]) == 2


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 3])
def test_one_row_weight_layouts_compute_x_times_w_transposed(threads, rows):
    from looplm.inference.kernels import mm, row_weight
    w = torch.randn(96, 40, generator=torch.Generator().manual_seed(threads))
    x = torch.randn(2, rows, 40, generator=torch.Generator().manual_seed(rows))[:1]
    wr = row_weight(w, threads)
    assert wr.shape == ((40, 96) if threads == 1 else (threads, 40, 96 // threads))
    assert torch.allclose(mm(x, (wr, None)), x @ w.t(), atol=1e-5)
    assert row_weight(torch.randn(10, 4), 4).shape == (2, 4, 5)        # 10 outputs split in 2, not 4
    assert row_weight(torch.randn(7, 4), 4).shape == (4, 7)            # 7 do not split


@pytest.mark.parametrize("rows", [2, 4, 64])
def test_several_row_products_take_either_layout_by_size(rows):
    """(out, in) = (512, 256): 2 and 4 rows stay under PACKED_MIN_MACS (the one-row layout),
    64 rows cross it (oneDNN's packed weights); all equal x @ W^T."""
    from looplm.inference.kernels import PACKED_MIN_MACS, mm, packed_weight, row_weight
    w = torch.randn(512, 256, generator=torch.Generator().manual_seed(rows))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    assert (rows * w.numel() >= PACKED_MIN_MACS) == (rows == 64)
    got = mm(x.view(1, rows, 256), (row_weight(w, 2), packed_weight(w)))
    assert got.shape == (1, rows, 512)
    assert torch.allclose(got[0], x @ w.t(), atol=1e-4)


_PRIMITIVES = """
import ctypes, gc, sys
import torch
from looplm.inference import kernels
def rss():
    gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
ws = [(kernels.row_weight(w, 1), kernels.packed_weight(w)) for w in (torch.randn(768, 256), torch.randn(1408, 256))]
kernels.mm(torch.randn(9, 256), ws[0])
before = rss()
for rows in range(16, 316):                    # 300 row counts, as prefills of different lengths bring
    for w in ws:
        kernels.mm(torch.randn(rows, 256), w)
print(rss() - before)
"""


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not os.path.exists("/proc/self/status"),
                    reason="oneDNN's packed path and /proc are needed")
def test_onednn_keeps_a_bounded_number_of_primitives():
    """oneDNN caches one primitive per matrix and row count (~0.5 MB each here, both caches): a
    server's prefills of ever new lengths grew its memory by hundreds of MB at oneDNN's default
    of 1024 entries per cache; inference/kernels.py caps them (kernels.PRIMITIVE_CACHE). 600 new shapes:
    ~50 MB, against ~300 MB with the default capacities (the same script, the user's override)."""
    import subprocess
    import sys

    def grown(**env):
        out = subprocess.run([sys.executable, "-c", _PRIMITIVES], capture_output=True, text=True, check=True,
                             env={k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k} | env)
        return float(out.stdout.strip().splitlines()[-1])

    capped, default = grown(), grown(LRU_CACHE_CAPACITY="1024", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")
    assert capped < 100 < 200 < default, (capped, default)


def test_a_new_thread_count_rebuilds_the_kernels():
    m = tiny()
    eng = Engine(m, TOK, GenerationConfig())
    k = eng.kernels()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if before == 1 else 1)          # another count than the suite's
        assert k.stale() and eng.kernels() is not k
    finally:
        torch.set_num_threads(before)


def test_the_lm_eval_task_example_builds_questions_from_a_runs_held_out_text(run_dir, tmp_path):
    """examples/lm_eval_task.py: the YAML points at the data, and each question's label is the
    context's true continuation in the run's validation text."""
    import shutil
    import subprocess
    import sys

    from looplm.data.text import encode_to_memmap

    run = shutil.copytree(run_dir, tmp_path / "run")       # the fixture's run stays as it is
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(40))
    encode_to_memmap([("val.py", text), ("b.py", "x = 1\n" * 300), ("c.py", "é")], TOK, run / "data" / "val.bin")
    out = tmp_path / "task"
    subprocess.run([sys.executable, "examples/lm_eval_task.py", str(run), "--out", str(out), "--questions", "12",
                    "--doc-chars", "500"], check=True, capture_output=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert str((out / "docs.jsonl").resolve()) in (out / "looplm_val_bpb.yaml").read_text()
    docs = [json.loads(line)["text"] for line in (out / "docs.jsonl").read_text().splitlines()]
    assert docs == [text[:500], ("x = 1\n" * 300)[:500]]              # one a document, cut; blank ones left out
    assert str((out / "data.jsonl").resolve()) in (out / "looplm_next_bytes.yaml").read_text()
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    for r in rows:
        assert len(r["choices"]) == 4 and len(r["context"]) == 60
        assert r["context"] + r["choices"][r["label"]] in text + "x = 1\n" * 300 + " "     # the split's text, ASCII
