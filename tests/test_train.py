"""Training end to end on a tiny corpus: run folder, report keys, exact resume, eval and generate."""

import json

import pytest
import torch

import looplm
from looplm.cli import main
from looplm.train.trainer import lr_at, train

from conftest import tiny_recipe

REPORT_KEYS = ["recipe", "steps", "unique_tokens", "token_passes", "params_stored", "params_per_token_visit",
               "depth_histogram", "backward_histogram", "loss_placement", "train_loss_final", "val_loss_by_rounds",
               "wall_time_s", "tokens_per_s", "peak_rss_bytes"]

SAMPLED = {"depth.kind": "uniform", "depth.min": 1, "depth.max": 4, "depth.rounds": 2, "backward.window": 2,
           "model.init_state": "random", "model.injection": "concat", "supervision.kind": "rounds",
           "supervision.rounds": (1, 3), "supervision.weights": (0.25, 0.75)}


def losses(run_dir):
    return [json.loads(l)["loss"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_folder_and_report(tmp_path, text_dir):
    rec = tiny_recipe(**SAMPLED, **{"data.path": str(text_dir)})
    train(rec, tmp_path / "run", quiet=True)
    run = tmp_path / "run"
    for name in ["recipe.toml", "checkpoint/model.safetensors", "checkpoint/state.pt", "metrics.jsonl",
                 "report.json", "report.md", "loss.png", "val_by_rounds.png", "depth_histograms.png"]:
        assert (run / name).is_file(), name
    saved = json.loads((run / "report.json").read_text())
    for key in REPORT_KEYS:
        assert key in saved, key
    assert saved["steps"] == 6
    assert sum(saved["depth_histogram"].values()) == 6
    assert set(map(int, saved["depth_histogram"])) <= {1, 2, 3, 4}
    assert max(map(int, saved["backward_histogram"])) <= 2            # window of 2
    depths = {int(k): v for k, v in saved["depth_histogram"].items()}
    assert saved["token_passes"] == sum(k * v for k, v in depths.items()) * 4 * 32
    assert 0 < saved["unique_tokens"] <= 6 * 4 * 33   # each window covers seq_len + 1 positions (inputs and targets)
    assert list(saved["val_loss_by_rounds"]) == ["1", "2", "4", "8"]  # up to 2x the training maximum
    assert saved["loss_placement"]["weights"] == [0.25, 0.75]
    md = (run / "report.md").read_text()
    assert "backward window" in md and "last 2 rounds" in md and "NEVER SAMPLED" in md
    assert looplm.load_recipe(str(run / "recipe.toml")) == rec
    # the state file loads without unpickling arbitrary objects
    torch.load(run / "checkpoint/state.pt", weights_only=True)
    # a rebuilt run gives the same validation numbers
    again = looplm.load_run(run)
    assert again.report["params_stored"] == again.model.params_stored()


def test_resume_equals_uninterrupted(tmp_path, text_dir):
    rec = tiny_recipe(**SAMPLED, **{"data.path": str(text_dir), "train.log_every": 1, "train.checkpoint_every": 2})
    train(rec, tmp_path / "full", quiet=True)
    train(rec, tmp_path / "split", quiet=True, stop_after=3)   # checkpoint at step 2; step 3 is redone
    train(rec, tmp_path / "split", resume=True, quiet=True)
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    a = json.loads((tmp_path / "full" / "report.json").read_text())
    b = json.loads((tmp_path / "split" / "report.json").read_text())
    for key in ["depth_histogram", "backward_histogram", "token_passes", "unique_tokens", "train_loss_final"]:
        assert a[key] == b[key], key


def test_refuses_to_overwrite_a_run(tmp_path, text_dir):
    rec = tiny_recipe(**{"data.path": str(text_dir), "train.steps": 1})
    train(rec, tmp_path / "run", quiet=True)
    with pytest.raises(looplm.UserError):
        train(rec, tmp_path / "run", quiet=True)


def test_eval_and_generate_json(tmp_path, text_dir, capsys):
    rec = tiny_recipe(**{"data.path": str(text_dir)})
    train(rec, tmp_path / "run", quiet=True)
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--rounds", "1,2,3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["rounds"]) == {"1", "2", "3"} and all("loss" in v and "ppl" in v for v in out["rounds"].values())
    assert main(["generate", str(tmp_path / "run"), "--prompt", "def f", "--max-new-tokens", "5", "--json"]) == 0
    gen = json.loads(capsys.readouterr().out)
    assert len(gen["tokens"]) <= 5 and len(gen["rounds_used"]) == len(gen["tokens"])
    for key in ["text", "prefill_tokens_per_s", "decode_tokens_per_s"]:
        assert key in gen
    assert main(["eval", str(tmp_path / "run"), "--rounds", "0"]) == 2


def test_bpe_tokenizer_run(tmp_path, text_dir):
    rec = tiny_recipe(**{"data.path": str(text_dir), "data.tokenizer": "bpe", "model.vocab_size": 400,
                         "train.steps": 2})
    train(rec, tmp_path / "run", quiet=True)
    run = looplm.load_run(tmp_path / "run")
    assert run.tokenizer.vocab_size <= 400
    assert run.tokenizer.decode(run.tokenizer.encode("def f(x):")) == "def f(x):"


def test_schedules():
    rec = tiny_recipe(**{"train.steps": 100, "optim.warmup_steps": 10, "optim.lr": 1.0, "optim.min_lr_ratio": 0.1})
    assert lr_at(0, rec) == pytest.approx(0.1) and lr_at(9, rec) == pytest.approx(1.0)
    assert lr_at(99, rec) == pytest.approx(0.1, abs=0.01)
    wsd = tiny_recipe(**{"train.steps": 100, "optim.warmup_steps": 10, "optim.lr": 1.0, "optim.schedule": "wsd",
                         "optim.decay_fraction": 0.2, "optim.min_lr_ratio": 0.0})
    assert lr_at(50, wsd) == 1.0 and lr_at(79, wsd) == 1.0 and lr_at(99, wsd) == pytest.approx(0.0)


def test_bf16_autocast_and_accumulation(tmp_path, text_dir):
    rec = tiny_recipe(**{"data.path": str(text_dir), "train.dtype": "bf16", "train.grad_accum": 2,
                         "train.steps": 2, "depth.kind": "uniform", "depth.min": 1, "depth.max": 3})
    report = train(rec, tmp_path / "run", quiet=True)
    assert sum(report["depth_histogram"].values()) == 4          # one depth draw per micro-batch
    assert report["tokens_seen"] == 2 * 2 * 4 * 32
    weights = looplm.load_run(tmp_path / "run").model.core[0].attn.q.weight
    assert weights.dtype == torch.float32 and torch.isfinite(weights).all()


def test_eval_on_a_task_run_reports_accuracy(tmp_path, capsys):
    rec = tiny_recipe(**{"data.task": "parity", "data.difficulty_max": 2, "data.eval_examples": 8,
                         "train.steps": 2, "depth.rounds": 2})
    train(rec, tmp_path / "run", quiet=True)
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--rounds", "1,2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for r in ("1", "2"):
        assert 0 <= out["rounds"][r]["accuracy"] <= 1 and out["rounds"][r]["loss"] > 0
    assert main(["eval", str(tmp_path / "run"), "--exit", "fixed:1"]) == 0   # accuracy vs rounds used
    assert "exit fixed:1 (budget 1)" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "run"), "--exit-sweep", "nonsense"]) == 2
