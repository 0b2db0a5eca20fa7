"""`train.tensorboard = true`: the TensorBoard event files carry metrics.jsonl's numbers, read back with
TensorBoard's own reader; a resumed run's curve has each step once."""

import json
import math

import pytest

pytest.importorskip("tensorboard")

from looplm.runs.tensorboard import scalars          # noqa: E402
from looplm.train.trainer import train                # noqa: E402

from conftest import tiny_recipe                      # noqa: E402


def read_events(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_flatten_rows_by_round_and_name():
    row = {"step": 3, "loss": 2.5, "rounds": [4, 2], "state_rms": [1.0, 2.0], "grad_rms": [None, 0.5],
           "update_ratio": {"core.0.attn": 0.01}, "flag": True, "bad": math.nan, "alignment": {"ratio": 1.5}}
    assert dict(scalars(row)) == {"loss": 2.5, "rounds/0": 4.0, "rounds/1": 2.0, "state_rms/round_1": 1.0,
                                  "state_rms/round_2": 2.0, "grad_rms/round_2": 0.5,
                                  "update_ratio/core.0.attn": 0.01, "alignment/ratio": 1.5}


def test_event_files_equal_metrics_jsonl_and_resume_purges(tmp_path):
    rec = tiny_recipe(**{"train.tensorboard": True, "train.steps": 6, "train.log_every": 1,
                         "train.checkpoint_every": 3, "backward.window": 2, "depth.rounds": 3})
    run = tmp_path / "run"
    train(rec, run, quiet=True, stop_after=5)           # interrupted: steps 0..4 logged, checkpoint at 3
    train(rec, run, resume=True, quiet=True)             # resumes at 3: steps 3, 4 logged again
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    events = read_events(run / "tensorboard")
    for tag in ("loss", "lr", "grad_norm", "state_rms/round_3", "grad_rms/round_3", "update_rms/round_1"):
        assert [s for s, _ in events[tag]] == list(range(6)), tag     # each step once, after the purge
    for r in rows:
        for tag, value in scalars(r):
            got = dict(events[tag])[r["step"]]
            assert got == pytest.approx(value, rel=1e-6, abs=1e-12), (tag, r["step"])
    # rounds before the window get no gradient: no grad_rms curve for round 1 of 3 with window 2
    assert "grad_rms/round_1" not in events and rows[-1]["grad_rms"][0] is None
    report = json.loads((run / "report.json").read_text())
    for r, loss in report["val_loss_by_rounds"].items():
        assert events[f"val_loss/rounds_{r}"] == [(6, pytest.approx(loss, rel=1e-6))]


def test_missing_package_is_refused_before_training(tmp_path, monkeypatch):
    import builtins

    from looplm.errors import UserError
    real = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError(name)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(UserError, match="pip install 'looplm\\[tensorboard\\]'"):
        train(tiny_recipe(**{"train.tensorboard": True}), tmp_path / "run", quiet=True)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
