"""`looplm experiment deeploop --quick`: every trial trained and reported, failures counted."""

from __future__ import annotations

import json
import math

from looplm.cli import main
from looplm.experiments.deeploop import CONVERGED_FRACTION


def test_quick_sweep_runs_and_reports_every_trial(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["experiment", "deeploop", "--quick", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["trials"]) == 2 and {t["p"] for t in result["trials"]} == {0.0, 0.5}
    for t in result["trials"]:
        run = json.loads((out / f"deeploop-p{t['p']:g}-R2-s0" / "report.json").read_text())
        assert run["recipe"]["model"]["residual_scaling"] == "deeploop"
        assert run["recipe"]["model"]["deeploop_p"] == t["p"] and run["recipe"]["depth"]["rounds"] == 2
        losses = [json.loads(line)["loss"] for line in
                  (out / f"deeploop-p{t['p']:g}-R2-s0" / "metrics.jsonl").read_text().splitlines()]
        # the stated criterion, recomputed from the run's own record
        want = all(map(math.isfinite, losses)) and run["train_loss_final"] <= CONVERGED_FRACTION * losses[0]
        assert t["converged"] == want and t["val_loss"] == run["val_loss_extrapolation"]["2"]
        assert t["alignment_ratio"] is not None and 0 < t["alignment_ratio"] <= 2 + 1e-9   # 2 visits
    assert result["failed_trials"] == sum(not t["converged"] for t in result["trials"])
    assert "Failed trials" in (out / "report.md").read_text()
