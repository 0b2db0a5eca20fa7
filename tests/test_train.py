"""Training end to end on a tiny corpus: run folder, report keys, exact resume, eval and generate."""

import json
import math
import resource
import time
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.cli import main
from looplm.data.text import open_tokens
from looplm.train.depth import sample_depth
from looplm.train.trainer import lr_at, train

from conftest import answer_scores, greedy_by_full_forward, tiny_recipe

REPORT_KEYS = ["recipe", "steps", "unique_tokens", "token_passes", "params_stored", "params_per_token_visit",
               "depth_histogram", "backward_histogram", "loss_placement", "train_loss_final", "val_loss_by_rounds",
               "wall_time_s", "tokens_per_s", "peak_rss_bytes"]

SAMPLED = {"depth.kind": "uniform", "depth.min": 1, "depth.max": 4, "depth.rounds": 2, "backward.window": 2,
           "model.init_state": "random", "model.injection": "concat", "supervision.kind": "rounds",
           "supervision.rounds": (1, 3), "supervision.weights": (0.25, 0.75)}


def losses(run_dir):
    return [json.loads(l)["loss"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


@torch.no_grad()
def val_loss_by_hand(model, run_dir, rounds: int) -> float:
    """Held-out loss of a TINY run at `rounds`, by a plain forward and cross entropy: the first 8 windows
    of 33 tokens of RUN/data/val.bin in batches of 4 (train.eval_batches 2). A random initial state
    draws its noise from a generator seeded by the tokens scored before the batch (as the report does)."""
    val = torch.from_numpy(open_tokens(run_dir / "data" / "val.bin").astype("int64"))
    windows = torch.stack([val[i * 32:i * 32 + 33] for i in range(8)])
    total = 0.0
    for b in range(2):
        x, y = windows[4 * b:4 * b + 4, :-1], windows[4 * b:4 * b + 4, 1:]
        logits = model(x, rounds, generator=torch.Generator().manual_seed(b * 4 * 32)).logits
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
    return total / (8 * 32)


def test_run_folder_and_report(tmp_path, text_dir):
    rec = tiny_recipe(**SAMPLED, **{"data.path": str(text_dir)})
    t0 = time.perf_counter()
    train(rec, tmp_path / "run", quiet=True)
    elapsed = time.perf_counter() - t0
    run = tmp_path / "run"
    for name in ["recipe.toml", "checkpoint/model.safetensors", "checkpoint/state.pt", "metrics.jsonl",
                 "report.json", "report.md", "loss.png", "val_by_rounds.png", "depth_histograms.png"]:
        assert (run / name).is_file(), name
    saved = json.loads((run / "report.json").read_text())
    for key in REPORT_KEYS:
        assert key in saved, key
    assert saved["steps"] == 6
    # the depths: one draw per step from the recipe's sampler; the logged rows (log_every 2, and the
    # last step) show the same draws
    drawn = [sample_depth(rec.depth, rec.train.seed, step) for step in range(6)]
    assert {int(k): v for k, v in saved["depth_histogram"].items()} == Counter(drawn)
    # rounds with gradient: the window's (last 2) rounds up to its last supervised one (1 and 3):
    # depth 1: {1}; 2: {1} (round 2 bears no loss); 3: {2, 3}; 4: {3} (round 4 bears no loss)
    with_gradient = {1: 1, 2: 1, 3: 2, 4: 1}
    assert {int(k): v for k, v in saved["backward_histogram"].items()} == Counter(with_gradient[d] for d in drawn)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rounds"]) for r in rows] == [(s, [drawn[s]]) for s in (0, 2, 4, 5)]
    assert saved["train_loss_final"] == rows[-1]["loss"]   # the mean of the last 10% of 6 steps: the last one
    assert 0 < saved["wall_time_s"] <= elapsed
    assert saved["tokens_per_s"] == pytest.approx(6 * 4 * 32 / saved["wall_time_s"])
    assert 0 < saved["peak_rss_bytes"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    depths = {int(k): v for k, v in saved["depth_histogram"].items()}
    assert saved["token_passes"] == sum(k * v for k, v in depths.items()) * 4 * 32
    assert 0 < saved["unique_tokens"] <= 6 * 4 * 33   # each window covers seq_len + 1 positions (inputs and targets)
    assert list(saved["val_loss_by_rounds"]) == ["1", "2", "4", "8"]  # up to 2x the training maximum
    # the weights the loss carried, per micro-batch: (0.25, 0.75) where round 3 ran, else round 1 alone (1.0)
    place = saved["loss_placement"]
    assert place["kind"] == "rounds" and place["rounds"] == [1, 3]
    assert place["weights"] == pytest.approx([sum(0.25 if d >= 3 else 1.0 for d in drawn) / 6,
                                              sum(0.75 if d >= 3 else 0.0 for d in drawn) / 6])
    md = (run / "report.md").read_text()
    assert "backward window" in md and "last 2 rounds" in md and "NEVER SAMPLED" in md
    assert looplm.load_recipe(str(run / "recipe.toml")) == rec
    # the state file loads without unpickling arbitrary objects
    torch.load(run / "checkpoint/state.pt", weights_only=True)
    # a rebuilt run gives the same validation numbers: its weights were loaded
    again = looplm.load_run(run)
    for r, recorded in saved["val_loss_by_rounds"].items():
        assert val_loss_by_hand(again.model, run, int(r)) == pytest.approx(recorded, rel=1e-5), r
    # every stored tensor once (a shared core is one tensor); per token, the core and the
    # concat-injection adapter apply once per round at the mean training depth
    params = dict(again.model.named_parameters())
    assert saved["params_stored"] == sum(p.numel() for p in params.values())
    per_round = sum(p.numel() for n, p in params.items() if n.startswith(("core.", "adapter.")))
    mean_depth = sum(drawn) / 6
    assert saved["params_per_token_visit"] == pytest.approx(saved["params_stored"] + (mean_depth - 1) * per_round)


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
    run = looplm.load_run(tmp_path / "run")
    assert set(out["rounds"]) == {"1", "2", "3"}
    for r, v in out["rounds"].items():
        assert v["loss"] == pytest.approx(val_loss_by_hand(run.model, tmp_path / "run", int(r)), rel=1e-5), r
        assert v["ppl"] == pytest.approx(math.exp(v["loss"]), rel=1e-9)
    assert main(["generate", str(tmp_path / "run"), "--prompt", "def f", "--max-new-tokens", "5", "--json"]) == 0
    gen = json.loads(capsys.readouterr().out)
    # greedy: each token the argmax of a whole forward over the sequence so far, at the recipe's 3 rounds;
    # fewer than 5 only when the next would be end-of-text
    want = greedy_by_full_forward(run.model, run.tokenizer.encode("def f"), 5)
    n = len(gen["tokens"])
    assert gen["tokens"] == want[:n] and (n == 5 or want[n] == run.tokenizer.eos_id)
    assert gen["text"] == run.tokenizer.decode(gen["tokens"]) and gen["rounds_used"] == [3] * n
    assert gen["prefill_tokens_per_s"] > 0 and gen["decode_tokens_per_s"] > 0
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
    # the prelude's output as the initial state: no noise, so an example scores the same alone
    rec = tiny_recipe(**{"data.task": "parity", "data.difficulty_max": 2, "data.eval_examples": 8,
                         "train.steps": 2, "depth.rounds": 2, "model.init_state": "prelude"})
    train(rec, tmp_path / "run", quiet=True)
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--rounds", "1,2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # every held-out example of every evaluated difficulty, scored here one at a time
    from looplm.data.taskdata import TaskSource
    run = looplm.load_run(tmp_path / "run")
    examples = [ex for exs in TaskSource(run.recipe).eval_sets(8).values() for ex in exs]
    for r in ("1", "2"):
        acc, loss = answer_scores(run.model, run.tokenizer, examples, int(r), run.recipe.data.separator)
        assert out["rounds"][r]["accuracy"] == acc and out["rounds"][r]["loss"] == pytest.approx(loss, rel=1e-5)
    assert main(["eval", str(tmp_path / "run"), "--exit", "fixed:1"]) == 0   # accuracy vs rounds used
    assert "exit fixed:1 (budget 1)" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "run"), "--exit-sweep", "nonsense"]) == 2


def test_a_validation_split_too_short_for_a_window_is_refused_before_training(tmp_path, capsys):
    """40 one-line documents: the training split holds many windows of 32, the validation split none; the
    run is refused before its first step (no folder left), not after training at the report."""
    from looplm.cli import main
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"d{i}.txt").write_text("w%02d abc\n" % i)
    code = main(["train", "--out", str(tmp_path / "r"), "--set", f"data.path={corpus}", "--set", "train.steps=2",
                 "--set", "model.d_model=32", "--set", "model.n_heads=4", "--set", "data.seq_len=32",
                 "--set", "data.val_fraction=0.1"])
    err = capsys.readouterr().err
    assert code == 2 and "validation split holds" in err and "data.seq_len 32" in err
    assert not any(tmp_path.glob("r*"))
