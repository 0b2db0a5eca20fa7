"""`looplm check`: passes on a healthy run, and each check can fail when its property is broken."""

import json

import torch
import torch.nn.functional as F

import looplm
from looplm.checks import check_backward_window, check_causality, check_untied_parity
from looplm.cli import main
from looplm.train import train

from conftest import tiny_recipe


def make_run(tmp_path, text_dir, **overrides):
    rec = tiny_recipe(**{"data.path": str(text_dir), "depth.kind": "uniform", "depth.min": 1, "depth.max": 3,
                         "depth.rounds": 2, "backward.window": 2, **overrides})
    train(rec, tmp_path / "run", quiet=True)
    return tmp_path / "run"


def test_checks_pass_on_a_trained_run(tmp_path, text_dir, capsys):
    path = make_run(tmp_path, text_dir)
    capsys.readouterr()
    assert main(["check", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {c["name"] for c in result["checks"]} >= {"causality", "shared_parameters_once",
                                                      "looped_equals_untied_copies", "backward_window_recorded"}
    assert all(c["passed"] for c in result["checks"]), result


def test_checks_fail_when_broken(tmp_path, text_dir, monkeypatch, capsys):
    path = make_run(tmp_path, text_dir)
    run = looplm.load_run(path)
    run.report["backward_histogram"] = {"3": 6}                     # more than the window of 2
    assert not check_backward_window(run).passed
    with torch.no_grad():                                            # break weight sharing: parity must notice
        run.model.core[0].mlp.down.weight.add_(0.0)
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, is_causal=False, **kw: sdpa(q, k, v, is_causal=False, **kw))
    assert not check_causality(run).passed
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    assert check_untied_parity(run).passed
    (path / "report.json").write_text(json.dumps({**run.report}))
    capsys.readouterr()
    assert main(["check", str(path)]) == 1
