"""The capability table (inference/capabilities.py) against what the engine really does, for every pair of
decode features: a pair the table allows decodes (a batch of prompts, to the end, in the batching it names),
a pair it refuses raises the table's message at construction, before any work."""

from __future__ import annotations

import itertools

import pytest
import torch

import looplm
from looplm.data.tokenizer import ByteTokenizer
from looplm.errors import UserError
from looplm.inference import capabilities
from looplm.inference.capabilities import FEATURES, RULES, Decode, refused_pair
from looplm.inference.engine import Engine, GenerationConfig, SamplingParams
from looplm.inference.recirculation import Recirculation

TOK = ByteTokenizer()
BASE = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64, "model.n_prelude": 1,
        "model.n_core": 2, "model.n_coda": 1, "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 3,
        "backward.window": "all", "data.seq_len": 32, "exit.min_rounds": 1}

# Each feature turned on: (recipe overrides, GenerationConfig fields, weight dtype).
SETUP: dict[str, tuple[dict, dict, torch.dtype]] = {
    "early_exit": ({}, {"exit": "kl:0.05"}, torch.float32),
    "quantile_exit": ({"exit.gate": True, "supervision.kind": "learned_exit"}, {"exit": "quantile:0.5"}, torch.float32),
    "exit_in_prefill": ({}, {"exit": "kl:0.05", "exit_in_prefill": True}, torch.float32),
    "missing_mask": ({}, {"missing": "mask"}, torch.float32),
    "prefill_cache": ({}, {"prefill_cache": "last"}, torch.float32),
    "decode_cache": ({}, {"decode_cache": "last"}, torch.float32),
    "speculative": ({}, {"speculative": "1:2"}, torch.float32),
    "speculative_exit": ({}, {"speculative": "exit:2", "exit": "kl:0.05"}, torch.float32),
    "recirculation": ({}, {"recirculation": Recirculation(source=3, dest=1, alpha=0.2)}, torch.float32),
    "contrast": ({}, {"contrast": (1, 0.5)}, torch.float32),
    "feedback": ({"feedback.mode": "gate"}, {}, torch.float32),
    "mor": ({"model.mor": "token_choice", "model.init_state": "prelude"}, {}, torch.float32),
    "kv_sharing": ({"model.kv_sharing": "first"}, {}, torch.float32),
    "untied": ({"model.untied": True}, {}, torch.float32),
    "damped": ({"model.round_update": "damped", "model.round_eta": 0.5}, {}, torch.float32),
    "euler": ({"model.round_update": "euler"}, {}, torch.float32),
    "depth_batching": ({}, {"batching": "depth"}, torch.float32),
    "static_batching": ({}, {"batching": "static"}, torch.float32),
    "half_precision": ({}, {}, torch.bfloat16),
}
# Settings whose values a routed or shared-cache model fixes (engine.py's value rules, not feature pairs): the
# message each pair gets instead of a table rule.
VALUE_RULES = {("mor", "prefill_cache"): "Mixture-of-Recursions model was trained with",
               ("decode_cache", "mor"): "Mixture-of-Recursions model was trained with",
               ("kv_sharing", "prefill_cache"): "model.kv_sharing = first",
               ("decode_cache", "kv_sharing"): "model.kv_sharing = first"}


def test_every_feature_has_a_setup_and_every_rule_names_features():
    names = {f.name for f in FEATURES}
    assert set(SETUP) == names - {"cuda"}
    for rule in RULES:
        assert rule.a in names and (rule.b is None or rule.b in names), rule
    assert capabilities.table_markdown().count("\n") == len(FEATURES) + 1


def merged(a: str, b: str):
    """Both features' setups, or None when they set one setting to two values (alternatives, not a pair)."""
    (ra, ca, da), (rb, cb, db) = SETUP[a], SETUP[b]
    for x, y in ((ra, rb), (ca, cb)):
        if any(k in y and y[k] != v for k, v in x.items()):
            return None
    if da != db:
        return {**ra, **rb}, {**ca, **cb}, torch.bfloat16
    return {**ra, **rb}, {**ca, **cb}, da


def expected(model, config) -> str | None:
    """The first table rule among the features this decode has (the table's own order)."""
    on = set(capabilities.active(Decode.of(model, config)))
    for rule in RULES:
        if rule.a in on and (rule.b is None or rule.b in on):
            if rule.a == "quantile_exit" and model.gate is not None:
                continue
            text = rule.text(Decode.of(model, config))
            if text:
                return text
    return None


PAIRS = list(itertools.combinations(sorted(SETUP), 2))


@pytest.mark.parametrize("a, b", PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_each_pair_decodes_or_is_refused_as_the_table_says(a, b):
    both = merged(a, b)
    if both is None:
        pytest.skip("one setting, two values: alternatives")
    recipe_over, config, dtype = both
    try:
        recipe = looplm.load_recipe("quickstart", {**BASE, **recipe_over})
    except UserError:
        return                     # the recipe refuses this model (its own applicability rules, tested there)
    torch.manual_seed(0)
    model = looplm.build_model(recipe).eval().to(dtype)
    config = GenerationConfig(**config)
    want = expected(model, config)
    value = VALUE_RULES.get((a, b))
    if want is None and value is None:
        eng = Engine(model, TOK, config)
        prompts = ["hello"] if eng.speculative else ["hello", "a longer prompt"]
        out = eng.generate(prompts, SamplingParams(max_new_tokens=3, stop_at_eos=False))
        assert all(len(o.tokens) == 3 for o in out)
        assert [f for f in (a, b) if f in capabilities.active(Decode.of(model, config))] == [a, b]
        if config.batching == "depth":
            assert out[0].stats["batching"] == "depth"
        if config.batching == "static":
            assert all(n == eng.rounds for o in out for n in o.rounds_used)
        return
    with pytest.raises(UserError) as err:
        Engine(model, TOK, config)
    assert (value or want) in str(err.value)
    if value is None and refused_pair(a, b) is None:      # refused by one feature's own rule, not by the pair
        assert any(r.b is None or {r.a, r.b} & {a, b} for r in RULES if r.text(Decode.of(model, config)) == want)


def test_a_refused_pair_is_refused_before_any_work(monkeypatch):
    """The refusal comes from the table at construction: no kernel is built, no cache allocated."""
    from looplm.inference import runner as runner_mod
    built = []
    monkeypatch.setattr(runner_mod, "PackedOps", lambda m: built.append(m))
    model = looplm.build_model(looplm.load_recipe("quickstart", BASE)).eval()
    with pytest.raises(UserError, match="--batching depth: not available with --contrast"):
        Engine(model, TOK, GenerationConfig(batching="depth", contrast=(1, 0.5)))
    assert built == []


def test_the_table_keeps_the_engines_messages():
    """Refusal messages keep their meaning (the words users and the docs quote)."""
    model = looplm.build_model(looplm.load_recipe("quickstart", BASE)).eval()
    cases = [({"speculative": "1:2", "exit": "kl:0.05"}, "--speculative verifies at full depth"),
             ({"speculative": "exit:2"}, "exit drafts stop by an early-exit policy"),
             ({"speculative": "1:2", "decode_cache": "last"}, "--speculative needs --decode-cache full"),
             ({"contrast": (1, 0.5), "exit": "kl:0.05"}, "--contrast: not available with the early-exit policy"),
             ({"exit": "quantile:0.5"}, "quantile needs a model trained with an exit gate"),
             ({"recirculation": Recirculation(source=3, dest=1), "decode_cache": "first"},
              "recirculation: not available with a shared cache policy")]
    for fields, message in cases:
        with pytest.raises(UserError, match=message):
            Engine(model, TOK, GenerationConfig(**fields))


def test_the_docs_show_the_table_as_it_is():
    from pathlib import Path
    docs = (Path(__file__).resolve().parents[1] / "docs" / "inference.md").read_text()
    assert capabilities.table_markdown() in docs, "docs/inference.md: paste capabilities.table_markdown() again"
