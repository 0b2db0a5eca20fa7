"""The `--no-cache` reference generator (inference/reference.py) and the cached engine against hand loops.

The independent computation is a loop written here: call `model(idx)` on the whole growing
sequence (with the position-indexed random initial state built here from its definition) and
take the argmax, or draw from softmax(logits / T) with a generator seeded by the request seed.
The reference must equal it token for token, and so must the cached Engine (which shares no
code with either). Then "free head width": a model whose n_heads * head_dim is not d_model
(wider and narrower, grouped-query and not) decodes through the cache to the logits and tokens
of full forward passes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from looplm.recipe.config import ModelConfig
from looplm.errors import UserError
from looplm.inference.engine import Engine, GenerationConfig, SamplingParams
from looplm.model.looped import LoopedLM
from looplm.inference.reference import generate_text
from looplm.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
NOMINAL = 3
PROMPTS = ["hello", "The loop runs", "q"]


def tiny(init_state: str = "random", **kw) -> LoopedLM:
    """init_std 0.3 spreads the logits, so argmax choices are far from ties."""
    torch.manual_seed(0)
    fields = dict(vocab_size=257, d_model=32, n_heads=4, n_kv_heads=2, context=64, init_std=0.3,
                  init_state=init_state, init_state_std=1.0)
    return LoopedLM(ModelConfig(**{**fields, **kw}), rounds=NOMINAL).eval()


def as_run(model: LoopedLM) -> SimpleNamespace:
    """What generate_text reads from a loaded run."""
    return SimpleNamespace(model=model, tokenizer=TOK, recipe=SimpleNamespace(depth=SimpleNamespace(rounds=NOMINAL)))


def noise_by_position(model: LoopedLM, seed: int, length: int) -> torch.Tensor | None:
    """(1, length, d) random initial states: row t of a (context, d) N(0, std^2) table seeded by `seed`."""
    cfg = model.cfg
    if cfg.init_state != "random":
        return None
    table = torch.randn(cfg.context, cfg.d_model, generator=torch.Generator().manual_seed(seed))
    return (table * cfg.init_state_std)[None, :length]


@torch.no_grad()
def hand_loop(model: LoopedLM, ids: list[int], n: int, rounds: int, seed: int = 0,
              temperature: float = 0.0) -> tuple[list[int], list[torch.Tensor]]:
    """Tokens and the (V,) logits that chose each: the whole sequence through the model per token."""
    g = torch.Generator().manual_seed(seed)
    seq, toks, logits = list(ids), [], []
    for _ in range(n):
        lg = model(torch.tensor([seq]), rounds, initial_state=noise_by_position(model, seed, len(seq))).logits[0, -1]
        if temperature == 0:
            t = int(lg.argmax())
        else:
            t = int(torch.multinomial(torch.softmax(lg / temperature, -1), 1, generator=g))
        toks.append(t)
        logits.append(lg)
        seq.append(t)
        if t == TOK.eos_id:
            break
    return toks, logits


@pytest.mark.parametrize("init_state, seed, rounds", [      # rounds None: the recipe's depth.rounds
    ("prelude", 0, None), ("random", 0, None), ("random", 7, 1), ("random", 7, 5)])   # 5: past the nominal 3
def test_greedy_reference_and_cached_engine_equal_an_argmax_loop(init_state, seed, rounds):
    model = tiny(init_state)
    eng = Engine(model, TOK, GenerationConfig(rounds=rounds))
    for prompt in PROMPTS[:2]:
        want, _ = hand_loop(model, TOK.encode(prompt), 8, rounds or NOMINAL, seed)
        ref = generate_text(as_run(model), prompt, max_new_tokens=8, seed=seed, rounds=rounds)
        assert ref["tokens"] == want and ref["text"] == TOK.decode(want)
        assert ref["rounds_used"] == [rounds or NOMINAL] * len(want)
        got = eng.generate([prompt], SamplingParams(max_new_tokens=8, seed=seed))[0]
        assert got.tokens == want


@pytest.mark.parametrize("init_state, temperature", [("prelude", 0.7), ("random", 1.5)])
def test_sampled_reference_and_cached_engine_equal_a_hand_computed_draw(init_state, temperature):
    """With temperature, token t is a multinomial draw from softmax(logits / T) by a generator
    seeded with the request's seed and shared across the steps: the reference draws exactly
    that, and so does the cached engine (its Sampler seeds one generator per row the same way)."""
    model = tiny(init_state)
    eng = Engine(model, TOK, GenerationConfig())
    for seed, prompt in ((1, "hello"), (2, "q")):
        want, _ = hand_loop(model, TOK.encode(prompt), 8, NOMINAL, seed, temperature)
        greedy = generate_text(as_run(model), prompt, max_new_tokens=8, seed=seed)["tokens"]
        assert want != greedy                       # the draws are not the argmax in disguise
        ref = generate_text(as_run(model), prompt, max_new_tokens=8, temperature=temperature, seed=seed)
        assert ref["tokens"] == want
        sp = SamplingParams(max_new_tokens=8, temperature=temperature, seed=seed)
        assert eng.generate([prompt], sp)[0].tokens == want


def test_the_reference_stops_after_eos_as_the_loop_does_and_refuses_bad_input():
    """A tokenizer whose eos is a token the greedy loop first emits after a few others: the
    reference (and the engine) emit it and stop there."""
    model = tiny("random")
    free, _ = hand_loop(model, TOK.encode("hello"), 8, NOMINAL, seed=3)
    n = next(i for i in range(1, 7) if free[i] not in free[:i]) + 1      # stop after n tokens
    eos = free[n - 1]

    class EosTok(ByteTokenizer):
        eos_id = eos

    run = SimpleNamespace(model=model, tokenizer=EosTok(), recipe=as_run(model).recipe)
    assert generate_text(run, "hello", max_new_tokens=8, seed=3)["tokens"] == free[:n]
    got = Engine(model, EosTok(), GenerationConfig()).generate(["hello"], SamplingParams(max_new_tokens=8, seed=3))[0]
    assert got.tokens == free[:n] and got.finish_reason == "stop"
    for kw in (dict(max_new_tokens=-1), dict(temperature=-0.5), dict(rounds=0)):
        with pytest.raises(UserError):
            generate_text(as_run(model), "hi", **kw)
    with pytest.raises(UserError, match="context"):                 # 60 + 6 - 1 positions > 64
        generate_text(as_run(model), "x" * 60, max_new_tokens=6)
    assert len(generate_text(as_run(model), "x" * 60, max_new_tokens=5)["tokens"]) == 5   # 64 fit


# -- free head width on the cached path ------------------------------------------------------

WIDE_GQA = dict(d_model=48, n_heads=4, head_dim=16, n_kv_heads=2)       # 4 x 16 = 64 > 48, grouped-query
NARROW_MHA = dict(d_model=48, n_heads=4, head_dim=6, n_kv_heads=4)      # 4 x 6 = 24 < 48, a kv head per head
MQA = dict(d_model=48, n_heads=6, head_dim=10, n_kv_heads=1)            # 60 != 48, one shared kv head


@pytest.mark.parametrize("heads, rounds", [(WIDE_GQA, 1), (WIDE_GQA, 4), (NARROW_MHA, 4), (MQA, 2)],
                         ids=["wide-gqa-1", "wide-gqa-4", "narrow-mha-4", "mqa-2"])
def test_free_head_width_decodes_through_the_cache_as_full_forward_passes(heads, rounds):
    model = tiny("random", **heads)
    assert model.cfg.n_heads * model.cfg.head_dim != model.cfg.d_model
    eng = Engine(model, TOK, GenerationConfig(rounds=rounds))
    # step by step through the cache: every chunk's logits are the full forward pass's
    ids, seed = TOK.encode("free heads"), 5
    noise = noise_by_position(model, seed, model.cfg.context)            # (1, context, d), what run_chunk reads
    cache = eng.new_cache(1, len(ids) + 6)
    with torch.no_grad():
        lg, _ = eng.run_chunk(torch.tensor([ids]), 0, cache, phase="prefill", noise=noise, all_logits=True)
        full = model(torch.tensor([ids]), rounds, initial_state=noise_by_position(model, seed, len(ids))).logits
        torch.testing.assert_close(lg, full, atol=1e-4, rtol=1e-4)                   # (1, T, V) every column
        lg, seq = lg[:, -1], list(ids)
        for _ in range(6):
            seq.append(int(lg[0].argmax()))
            lg, _ = eng.run_chunk(torch.tensor([seq[-1:]]), len(seq) - 1, cache, noise=noise)   # (1, V)
            full = model(torch.tensor([seq]), rounds, initial_state=noise_by_position(model, seed, len(seq))).logits
            torch.testing.assert_close(lg, full[:, -1], atol=1e-4, rtol=1e-4)
    # and through Engine.generate, a batch of prompts of different lengths (left-padded rows)
    sps = [SamplingParams(max_new_tokens=6, seed=s, logprobs=3, stop_at_eos=False) for s in (1, 2, 3)]
    for prompt, sp, got in zip(PROMPTS, sps, eng.generate(PROMPTS, sps)):
        want, logits = hand_loop(model, TOK.encode(prompt), 6, rounds, sp.seed)
        assert got.tokens == want
        for lp, top, lg in zip(got.logprobs, got.top_logprobs, logits):
            ref = torch.log_softmax(lg, -1)
            vals, idx = ref.topk(3)
            assert [t for t, _ in top] == idx.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in top]), vals, atol=1e-4, rtol=0)
            assert abs(lp - float(vals[0])) < 1e-4          # greedy: the chosen token is the top one
