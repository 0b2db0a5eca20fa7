"""DeepLoop's alignment ratio: 1 for orthogonal visit gradients, R for identical ones; the measured
visits of a real model sum to the shared core's gradient; the trainer logs it when asked."""

from __future__ import annotations

import json

import pytest
import torch

import looplm
from looplm.errors import UserError
from looplm.train.alignment import alignment_stats, visit_gradients
from looplm.train.trainer import Counters, train, train_step

TINY = {"model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2, "model.n_core": 2,
        "depth.kind": "fixed", "depth.rounds": 4, "backward.window": 3, "data.seq_len": 16, "model.context": 32,
        "train.batch_size": 2}


@pytest.mark.parametrize("R", [2, 3, 5])
def test_ratio_is_one_for_orthogonal_and_R_for_identical_visits(R):
    eye = torch.eye(R * 3)
    orthogonal = [{"w": eye[r].view(3, R), "b": torch.zeros(2)} for r in range(R)]
    assert alignment_stats(orthogonal)["ratio"] == pytest.approx(1.0)
    assert alignment_stats(orthogonal)["mean_pairwise_cosine"] == pytest.approx(0.0)
    g = {"w": torch.randn(3, R), "b": torch.randn(2)}
    same = alignment_stats([{k: v.clone() for k, v in g.items()} for _ in range(R)])
    assert same["ratio"] == pytest.approx(R) and same["mean_pairwise_cosine"] == pytest.approx(1.0)
    opposite = alignment_stats([g, {k: -v for k, v in g.items()}])
    assert opposite["ratio"] == pytest.approx(0.0, abs=1e-12)


def test_measured_visits_sum_to_the_shared_gradient():
    # a larger initialisation than the default's, whose nearly-identity core makes the visits' gradients
    # nearly identical (ratio ~ R): here they differ, and the ratio lies well inside (1, R)
    recipe = looplm.load_recipe("quickstart", {**TINY, "model.init_std": 0.3})
    torch.manual_seed(0)
    model = looplm.build_model(recipe).train()
    x = torch.randint(0, 257, (2, 16))
    y = torch.roll(x, -1, 1)
    train_step(model, recipe, x, y, 5, 0, Counters(), rounds=4)
    visits, used = visit_gradients(model, recipe, 4, lambda m, rec: train_step(m, rec, x, y, 5, 0, Counters(), rounds=4))
    assert used == [2, 3, 4], "window 3 of 4 rounds: visits 2..4 carry gradient"
    for i, block in enumerate(model.core):
        for n, p in block.named_parameters():
            total = sum(v[f"core.{i}.{n}"] for v in visits)
            torch.testing.assert_close(total, p.grad, rtol=1e-5, atol=1e-8)
    # the ratio by hand: the shared gradient's squared norm (the model's own .grad, not the visits' sum)
    # over the visits' summed squared norms; the cosines from the flattened visits
    stats = alignment_stats(visits)
    shared = sum(p.grad.double().pow(2).sum().item() for p in model.core.parameters())
    flat = [torch.cat([g.double().flatten() for g in v.values()]) for v in visits]
    assert stats["ratio"] == pytest.approx(shared / sum(f.pow(2).sum().item() for f in flat), rel=1e-6)
    cos = [(a @ b / (a.norm() * b.norm())).item() for i, a in enumerate(flat) for b in flat[i + 1:]]
    assert stats["mean_pairwise_cosine"] == pytest.approx(sum(cos) / 3, rel=1e-9)
    assert stats["visit_norms"] == pytest.approx([f.norm().item() for f in flat], rel=1e-12)
    q = model.core[1].attn.q.weight.grad.double()
    assert stats["per_tensor"]["core.1.attn.q.weight"] == pytest.approx(
        q.pow(2).sum().item() / sum(v["core.1.attn.q.weight"].double().pow(2).sum().item() for v in visits), rel=1e-6)


def test_trainer_logs_alignment_when_asked(tmp_path):
    over = {**TINY, "train.steps": 4, "train.log_every": 10, "train.alignment_every": 2, "train.eval_batches": 1,
            "data.max_bytes": 30_000, "depth.kind": "lognormal_poisson", "depth.mean": 3}
    recipe = looplm.load_recipe("quickstart", over)
    train(recipe, tmp_path / "run", quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r.get("alignment") for r in rows}
    assert set(logged) >= {0, 2, 3} and logged[0] and logged[2] and logged[3] is None
    for step in (0, 2):
        a = logged[step]
        assert a["rounds_with_gradient"] == list(range(max(1, a["rounds"] - 2), a["rounds"] + 1))
        assert a["visits"] == len(a["rounds_with_gradient"])
    # step 0 again, by hand: the initial weights, the first batch, the logged depth. The ratio's numerator
    # is the shared core's own gradient there (measured before the optimizer step), its denominator the
    # logged visits' squared norms
    from looplm.data.text import TokenSampler, open_tokens
    torch.manual_seed(recipe.train.seed)
    model = looplm.build_model(recipe).train()
    x, y = TokenSampler(open_tokens(tmp_path / "run" / "data" / "train.bin"), 16, 2, recipe.train.seed).batch(0)
    train_step(model, recipe, x, y, 0, 0, Counters(), rounds=logged[0]["rounds"])
    shared = sum(p.grad.double().pow(2).sum().item() for p in model.core.parameters())
    assert logged[0]["ratio"] == pytest.approx(shared / sum(n * n for n in logged[0]["visit_norms"]), rel=1e-5)


def test_alignment_refused_where_it_cannot_be_measured():
    with pytest.raises(UserError, match="alignment_every"):
        looplm.load_recipe("quickstart", {"train.alignment_every": 5, "train.parallel": "fsdp"})
    with pytest.raises(UserError, match="alignment_every"):
        looplm.load_recipe("quickstart", {"train.alignment_every": 5, "model.untied": True, "depth.kind": "fixed"})


def test_update_ratio_per_shared_tensor_equals_the_weights_change(tmp_path):
    """metrics.jsonl's update_ratio of each core tensor at step 1 = ||W_after - W_before|| / ||W_before||,
    read from the checkpoints on either side of that step; the report plots the per-round telemetry."""
    from safetensors.torch import load_file
    over = {**TINY, "train.steps": 2, "train.log_every": 1, "train.checkpoint_every": 1, "train.eval_batches": 1,
            "data.max_bytes": 30_000}
    recipe = looplm.load_recipe("quickstart", over)
    run = tmp_path / "run"
    train(recipe, run, quiet=True, stop_after=1)
    before = load_file(str(run / "checkpoint" / "model.safetensors"))
    train(recipe, run, quiet=True, resume=True)
    after = load_file(str(run / "checkpoint" / "model.safetensors"))
    row = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1]
    assert row["step"] == 1
    names = [k for k in before if k.startswith("core.")]
    assert sorted(row["update_ratio"]) == sorted(names)
    for k in names:
        want = ((after[k] - before[k]).norm() / before[k].norm()).item()
        assert row["update_ratio"][k] == pytest.approx(want, rel=1e-4, abs=1e-9)
    assert all(v is None or v > 0 for v in row["grad_rms"]) and len(row["state_rms"]) == len(row["update_rms"])
    assert (run / "round_telemetry.png").is_file() and "round_telemetry.png" in (run / "report.md").read_text()
