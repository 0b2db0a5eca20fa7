"""What cache policies cost in held-out loss (`looplm eval --cache-sweep`)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.evaluation.cache_policies import SWEEP, continuation_loss, forward_loss
from looplm.cli import main
from looplm.inference.engine import Engine, GenerationConfig

from conftest import tiny_recipe


def model_and_batches(rounds=3, init="random"):
    torch.manual_seed(0)
    model = looplm.build_model(tiny_recipe(**{"depth.rounds": rounds, "model.init_state": init,
                                              "model.init_std": 0.3})).eval()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        seq = torch.randint(0, 257, (3, 21), generator=g)
        batches.append((seq[:, :-1], seq[:, 1:]))
    return model, batches


@pytest.mark.parametrize("init", ["random", "prelude"])
def test_full_cache_continuation_loss_is_the_forward_pass(init):
    """Prefill half, decode the rest token by token under full caches: the loss of the decoded
    positions is the plain forward pass's, computed here by hand from model(x) logits."""
    model, batches = model_and_batches(init=init)
    got = continuation_loss(Engine(model, None, GenerationConfig()), batches)
    total, n = 0.0, 0
    for i, (x, y) in enumerate(batches):
        init_state = None
        if init == "random":
            init_state = looplm.model.looped.initial_noise_table(model.cfg, i)[:x.shape[1]].expand(x.shape[0], -1, -1)
        with torch.no_grad():
            logits = model(x, 3, initial_state=init_state).logits
        h = x.shape[1] // 2
        total += F.cross_entropy(logits[:, h:].flatten(0, 1), y[:, h:].flatten(), reduction="sum").item()
        n += y[:, h:].numel()
    assert got["tokens"] == n and got["mean_rounds"] == 3
    assert abs(got["loss"] - total / n) < 1e-4
    assert abs(forward_loss(model, batches, 3) - total / n) < 1e-6


def test_shared_policies_change_the_function_and_hold_a_third_of_the_core_cache():
    model, batches = model_and_batches()
    rows = {(p, d): continuation_loss(Engine(model, None, GenerationConfig(prefill_cache=p, decode_cache=d)), batches)
            for p, d in SWEEP}
    full = rows["full", "full"]
    for (p, d), r in rows.items():
        if (p, d) != ("full", "full"):
            assert abs(r["loss"] - full["loss"]) > 1e-4, (p, d)          # a different function
        shared_both = p != "full" and d != "full"
        assert r["core_cache_bytes"] * (3 if shared_both else 1) == full["core_cache_bytes"], (p, d)


def test_with_one_round_every_policy_is_the_full_cache():
    """At one round there is only one round's keys/values to reuse: every pair scores the same."""
    model, batches = model_and_batches(rounds=1)
    losses = [continuation_loss(Engine(model, None, GenerationConfig(rounds=1, prefill_cache=p, decode_cache=d)),
                                batches)["loss"] for p, d in SWEEP]
    assert max(losses) - min(losses) < 1e-5


def test_eval_cache_sweep_cli(tmp_path, text_dir, capsys):
    from looplm.train.trainer import train
    train(tiny_recipe(**{"data.path": str(text_dir)}), tmp_path / "run", quiet=True)
    assert main(["eval", str(tmp_path / "run"), "--rounds", "3", "--cache-sweep", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["cache_sweep"]
    assert [(r["prefill_cache"], r["decode_cache"]) for r in res["rows"]] == SWEEP
    for r in res["rows"]:
        assert {"loss", "ppl", "loss_vs_full", "mean_rounds", "core_cache_bytes", "tokens"} <= set(r)
    assert abs(res["rows"][0]["loss"] - res["forward_loss"]) < 1e-4 and res["exit"] == "fixed:3"
    assert main(["eval", str(tmp_path / "run"), "--cache-sweep", "--exit", "kl:0.05", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["cache_sweep"]
    assert res["exit"] == "kl:0.05" and "forward_loss" not in res
    assert all(1 <= r["mean_rounds"] <= 3 for r in res["rows"])


def test_eval_cache_sweep_on_a_task_run_needs_text(tmp_path, capsys):
    from looplm.train.trainer import train
    train(tiny_recipe(**{"data.task": "chain", "data.difficulty_max": 2}), tmp_path / "task", quiet=True)
    assert main(["eval", str(tmp_path / "task"), "--cache-sweep"]) == 2
    assert "--data" in capsys.readouterr().err
