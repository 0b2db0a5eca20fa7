"""`looplm lens`: normalised JSD against hand computations, the lens at the last boundary equal
to the model's output, boundaries in the order the model runs them, and the command end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import looplm
from looplm.cli import main
from looplm.evaluation.lens import logit_lens, normalised_jsd


def _log(p):
    return torch.tensor(p, dtype=torch.float64).log()


def test_jsd_by_hand():
    assert normalised_jsd(_log([1.0, 0.0]), _log([0.0, 1.0])).item() == pytest.approx(1.0)
    assert normalised_jsd(_log([0.3, 0.7]), _log([0.3, 0.7])).item() == pytest.approx(0.0, abs=1e-12)
    # p = (1/2, 1/2), q = (1, 0): m = (3/4, 1/4); KL(p||m) = 1/2 ln(4/3), KL(q||m) = ln(4/3)
    want = 0.5 * (0.5 * math.log(4 / 3) + math.log(4 / 3)) / math.log(2)
    assert normalised_jsd(_log([0.5, 0.5]), _log([1.0, 0.0])).item() == pytest.approx(want)


@given(st.lists(st.floats(0.01, 10.0), min_size=2, max_size=6), st.lists(st.floats(0.01, 10.0), min_size=2, max_size=6))
@settings(max_examples=60, deadline=None)
def test_jsd_is_symmetric_bounded_and_matches_the_definition(a, b):
    n = min(len(a), len(b))
    p = torch.tensor(a[:n], dtype=torch.float64)
    q = torch.tensor(b[:n], dtype=torch.float64)
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2
    want = (0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()) / math.log(2)
    got = normalised_jsd(p.log(), q.log())
    assert got.item() == pytest.approx(want.item(), abs=1e-9)
    assert got.item() == pytest.approx(normalised_jsd(q.log(), p.log()).item(), abs=1e-12)
    assert 0.0 <= got.item() <= 1.0


@pytest.mark.parametrize("over", [{}, {"model.n_coda": 0, "model.n_prelude": 0, "model.state_norm": True}])
def test_last_boundary_is_the_model_output_and_boundaries_follow_the_pass(over):
    recipe = looplm.load_recipe("quickstart", {"model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2,
                                               "model.n_core": 2, **over})
    torch.manual_seed(0)
    model = looplm.build_model(recipe).eval()
    with torch.no_grad():                      # blocks that move the state, so boundaries differ
        for p in model.core.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
        if model.state_norm is not None:       # unit weights would make it invisible to the final norm
            model.state_norm.weight.uniform_(0.2, 3.0)
    x = torch.randint(0, 257, (2, 12))
    table = logit_lens(model, [(x, torch.roll(x, -1, 1))], 3)
    rows = table["boundaries"]
    cfg = model.cfg
    assert len(rows) == cfg.n_prelude + 3 * cfg.n_core + cfg.n_coda
    core = [r for r in rows if r["kind"] == "core"]
    assert [(r["round"], r["block"]) for r in core] == [(r, b) for r in (1, 2, 3) for b in range(cfg.n_core)]
    assert [r["round_end"] for r in core] == [b == cfg.n_core - 1 for r in (1, 2, 3) for b in range(cfg.n_core)]
    assert rows[-1]["jsd"] < 1e-6 and rows[-1]["agreement"] == 1.0
    assert rows[0]["jsd"] > 1e-4, "an early boundary of a random model should differ from the output"
    assert table["jsd"] == [r["jsd"] for r in rows] and table["positions"] == x.numel()
    # accuracy counts the true next token: with the output's own top-1 as targets it equals agreement
    top = model(x, 3).logits.argmax(-1)
    again = logit_lens(model, [(x, top)], 3)["boundaries"]
    assert [r["accuracy"] for r in again] == [r["agreement"] for r in again]


def test_lens_command_on_a_run(tmp_path, capsys):
    from looplm.train.trainer import train
    run = tmp_path / "run"
    train(looplm.load_recipe("quickstart", {"model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2,
                                            "train.steps": 3, "data.seq_len": 32, "model.context": 64,
                                            "train.batch_size": 4, "train.eval_batches": 1,
                                            "data.max_bytes": 40_000}), run, quiet=True)
    assert main(["lens", str(run), "--rounds", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rounds"] == 2 and all("jsd" in b for b in out["boundaries"])
    assert (run / "lens.png").is_file() and "Logit lens" in (run / "report.md").read_text()
    assert "not agreement with the true answer" in (run / "report.md").read_text()
    assert main(["lens", str(run), "--rounds", "0"]) == 2


def test_lens_baseline_side_by_side(tmp_path, capsys):
    """`looplm lens RUN --baseline BASE` reads both models out on RUN's tokens: the looped run offers
    its R - 1 round ends, the untied baseline every intermediate layer, each with the numbers the
    lens computes for that model alone on the same batches."""
    from looplm.evaluation.lens import lens_batches
    from looplm.train.trainer import train
    small = {"model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2, "model.n_core": 2, "depth.kind": "fixed",
             "depth.rounds": 3, "train.steps": 2, "data.seq_len": 32, "model.context": 64, "train.batch_size": 4,
             "train.eval_batches": 1, "data.max_bytes": 40_000}
    train(looplm.load_recipe("quickstart", small), tmp_path / "loop", quiet=True)
    train(looplm.load_recipe("quickstart", {**small, "model.untied": True}), tmp_path / "untied", quiet=True)
    assert main(["lens", str(tmp_path / "loop"), "--baseline", str(tmp_path / "untied"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    loop, base = out["runs"]
    assert not loop["untied"] and base["untied"]
    assert [c["label"] for c in loop["exit_candidates"]] == ["round 1 block 2", "round 2 block 2"]
    assert len(base["exit_candidates"]) == base["boundaries"] - 1 == 1 + 3 * 2 + 1 - 1
    run, ref = looplm.load_run(tmp_path / "loop"), looplm.load_run(tmp_path / "untied")
    want = logit_lens(ref.model, lens_batches(run, None), 3)["boundaries"]
    assert [c["jsd"] for c in base["exit_candidates"]] == pytest.approx([r["jsd"] for r in want[:-1]], abs=1e-9)
    assert [c["depth"] for c in base["exit_candidates"]] == pytest.approx([(i + 1) / 8 for i in range(7)])
    assert (tmp_path / "loop" / "lens_compare.png").is_file()
    assert "loop boundaries vs a baseline" in (tmp_path / "loop" / "report.md").read_text()
