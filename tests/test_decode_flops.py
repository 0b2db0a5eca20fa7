"""Decoding's FLOP count covers every column computed, against PyTorch's own FLOP counter: under
self-speculative decoding the drafts, the verified columns (rejected ones included) and the prompt;
in plain decoding each column at the rounds it ran, with the readouts (coda + head) and gate
evaluations its exit policy ran, and the prompt's head on the last column only unless it is scored."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import looplm
from looplm.data.tokenizer import ByteTokenizer
from looplm.inference.engine import Engine, GenerationConfig, SamplingParams, generate_for_run
from looplm.model.flops import DecodeWork, decode_flops

# init_std 0.3 spreads the logits (greedy far from ties); one draft round disagrees with four often
# additive injection: the exit patterns the cases below pin come from this untrained model's rounds
TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
        "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 4, "data.seq_len": 32, "model.injection": "add"}


@pytest.mark.parametrize("options", [{"speculative": "1:3"}, {"speculative": "exit:4", "exit": "kl:0.1"}])
def test_speculative_flops_equal_pytorchs_count_of_the_same_call(options):
    recipe = looplm.load_recipe("quickstart", TINY)
    torch.manual_seed(0)
    run = SimpleNamespace(model=looplm.build_model(recipe).eval(), tokenizer=ByteTokenizer(), recipe=recipe)
    with FlopCounterMode(display=False) as fc:
        out = generate_for_run(run, "hello", max_new_tokens=8, **options)
    # the CPU attention kernel is not in PyTorch's counter: every count it has is a weight product
    measured = float(sum(fc.get_flop_counts()["Global"].values()))
    spec, per_token = out["speculative"], out["flops_per_token"]
    assert 0 < spec["accepted"] < spec["drafted"]                  # some drafted columns were thrown away
    P, n_dec = out["prompt_tokens"], len(out["tokens"]) - 1         # the first token comes from the prefill
    reported = per_token["prefill"] * P + per_token["decode"] * n_dec
    assert reported == pytest.approx(spec["flops"]["prefill"] + spec["flops"]["draft"] + spec["flops"]["verify"])
    assert reported - spec["flops"]["attention"] == pytest.approx(measured, rel=1e-9)
    assert per_token["decode_flops_per_s"] == pytest.approx(per_token["decode"] * out["decode_tokens_per_s"])


def test_a_column_costs_what_decoding_its_token_costs():
    cfg = looplm.load_recipe("quickstart", TINY).model
    work = DecodeWork(cfg)
    work.add("decode", 9, 3)
    assert work.total() == pytest.approx(decode_flops(cfg, 3, 9))
    # QK^T and AV of 4 heads of width 8 against 10 keys, in each of 1 prelude + 3 x 2 core + 1 coda block visits
    assert work.attention == pytest.approx(4 * 4 * 8 * 10 * (1 + 3 * 2 + 1))


GATED = {"supervision.kind": "learned_exit", "exit.gate": True}     # hazard sigmoid(-1) = 0.27 per round


def _run(over=None):
    recipe = looplm.load_recipe("quickstart", {**TINY, **(over or {})})
    torch.manual_seed(0)
    return SimpleNamespace(model=looplm.build_model(recipe).eval(), tokenizer=ByteTokenizer(), recipe=recipe)


def _measured(fc) -> float:
    # the CPU attention kernel is not in PyTorch's counter: every count it has is a weight product
    return float(sum(fc.get_flop_counts()["Global"].values()))


@pytest.mark.parametrize("over, options, rounds", [
    ({}, {}, [4] * 6),                                        # fixed depth: one readout, the prompt's head once
    ({}, {"exit": "entropy:4.0"}, [4, 1, 4, 2, 4, 2]),        # a coda and head at every round it checks
    ({}, {"exit": "kl:0.1"}, [4, 3, 3, 3, 2, 3]),
    (GATED, {"exit": "quantile:0.5"}, [4, 3, 3, 3, 3, 3]),    # the gate every round (CDF 0.47 after 2, 0.61 after 3)
    (GATED, {}, [4] * 6),                                     # a gate the fixed depth never evaluates
    ({"exit.policy": "kl:0.1", "exit.exit_in_prefill": True}, {}, [4, 4, 3, 3, 3, 3]),    # prompt columns exit too
    ({"model.mor": "token_choice"}, {}, [2, 4, 4, 4, 4, 2]),  # the router's product on every column
    ({"feedback.mode": "gate"}, {"prompt_mode": "fused"}, [4] * 6),    # the fusion on every column it ran, two
    ({"feedback.mode": "gate"}, {"prompt_mode": "standard"}, [4] * 6),  # prompt passes; discarded fusions count
])
def test_plain_decode_flops_equal_pytorchs_count_of_the_same_call(over, options, rounds):
    run = _run(over)
    with FlopCounterMode(display=False) as fc:
        out = generate_for_run(run, "hello", max_new_tokens=6, **options)
    assert out["rounds_used"] == rounds                                  # the exits the case is about happened
    per_token, work = out["flops_per_token"], out["flops"]
    P, n_dec = out["prompt_tokens"], len(out["tokens"]) - 1              # the first token comes from the prefill
    reported = per_token["prefill"] * P + per_token["decode"] * n_dec
    assert reported == pytest.approx(work["prefill"] + work["decode"])
    assert reported - work["attention"] == pytest.approx(_measured(fc), rel=1e-9)
    assert per_token["decode_flops_per_s"] == pytest.approx(per_token["decode"] * out["decode_tokens_per_s"])


def test_scoring_the_prompt_adds_a_head_per_prompt_column():
    run = _run()
    engine = Engine(run.model, run.tokenizer, GenerationConfig(exit="kl:0.1"))
    cfg, flops = run.model.cfg, {}
    for scored in (None, 2):
        with FlopCounterMode(display=False) as fc:
            out = engine.generate(["hello"], SamplingParams(max_new_tokens=3, prompt_logprobs=scored))[0]
        assert (out.prompt_logprobs is not None) == bool(scored)
        work = flops[scored] = out.stats["flops"]
        assert work["prefill"] + work["decode"] - work["attention"] == pytest.approx(_measured(fc), rel=1e-9)
    # unscored, the prompt's head reads out its last column only; scored, every column
    assert flops[2]["prefill"] - flops[None]["prefill"] == 4 * 2 * cfg.d_model * cfg.vocab_size
    assert flops[2]["decode"] == flops[None]["decode"]


def test_a_batch_counts_every_row_it_ran():
    # rows of different lengths and exits; row 1 stops first, so rows 0 and 2 run as a whole-batch step
    run = _run()
    engine = Engine(run.model, run.tokenizer, GenerationConfig(exit="kl:0.05"))
    params = [SamplingParams(max_new_tokens=n, stop_at_eos=False) for n in (5, 2, 5)]
    with FlopCounterMode(display=False) as fc:
        outs = engine.generate(["hi", "hello", "a longer one"], params)
    assert len({r for o in outs for r in o.rounds_used[1:]}) > 1
    work = outs[0].stats["flops"]
    assert work["prefill"] + work["decode"] - work["attention"] == pytest.approx(_measured(fc), rel=1e-9)
