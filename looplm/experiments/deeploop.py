"""The DeepLoop sweep: `looplm experiment deeploop [--quick] [--out DIR] [--json]`.

DeepLoop scales a looped block's skip path by alpha = (2N)^p and its branch initialisation by
(8N)^-p (N = core blocks x rounds). The seeds report, at R = 3 on GPT-2 small, that exponents
below 0.45 failed, 0.45 was mixed and >= 0.5 trained reliably. This experiment runs the same
question on a small recipe here: every exponent x rounds x seed is one training run (a run
folder under DIR), and every trial is reported, failed ones counted, never dropped:

    converged   every logged training loss finite, and the mean over the last 10% of steps at
                most CONVERGED_FRACTION of the first step's loss
    val_loss    held-out loss at the trained depth (None when it is not finite)
    alignment   the shared core's per-visit gradient alignment ||sum g_r||^2 / sum ||g_r||^2
                (train/alignment.py), measured at the first and the middle step and averaged

Each trial uses the recipe's own data, optimiser and steps; only model.residual_scaling =
"deeploop", model.deeploop_p, depth (fixed R, full backward) and train.seed change.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from ..recipe.config import Recipe, derive_recipe
from ..runs.checkpoint import read_metrics

CONVERGED_FRACTION = 0.9
"""A trial converged when its final training loss is at most this fraction of its first."""
EXPONENTS = (0.0, 0.3, 0.45, 0.5, 0.6)
ROUNDS = (3, 6)
SEEDS = (0, 1)
SMALL = {"model.d_model": 64, "model.n_heads": 2, "model.n_kv_heads": 2, "data.seq_len": 64, "model.context": 64,
         "train.batch_size": 8, "train.steps": 120, "train.log_every": 5, "train.checkpoint_every": 1000,
         "data.max_bytes": 400_000, "train.eval_batches": 4}
"""The default recipe's size for the full sweep (the quickstart recipe, smaller)."""
QUICK = {**SMALL, "model.d_model": 32, "data.seq_len": 16, "model.context": 32, "train.batch_size": 2,
         "train.steps": 4, "train.log_every": 1, "data.max_bytes": 20_000, "train.eval_batches": 1}
QUICK_GRID = ((0.0, 0.5), (2,), (0,))


def trial_recipe(base: Recipe, p: float, rounds: int, seed: int) -> Recipe:
    return derive_recipe(base.to_dict(), {
        "name": f"deeploop-p{p:g}-R{rounds}-s{seed}", "model.residual_scaling": "deeploop", "model.deeploop_p": p,
        "model.norm": "pre", "depth.kind": "fixed", "depth.rounds": rounds, "backward.window": "all",
        "exit.min_rounds": 1, "train.seed": seed, "train.alignment_every": max(1, base.train.steps // 2)})


def run_trial(recipe: Recipe, out: Path) -> dict[str, Any]:
    from ..train.trainer import train
    report = train(recipe, out, quiet=True)
    rows = read_metrics(out)
    losses = [r["loss"] for r in rows]
    R = recipe.depth.rounds
    # held-out loss at the trained depth (the report's depth-extrapolation pass reads every depth)
    val = report["val_loss_by_rounds"].get(str(R), report.get("val_loss_extrapolation", {}).get(str(R)))
    finite = all(math.isfinite(x) for x in losses) and val is not None and math.isfinite(val)
    final = report["train_loss_final"]
    ratios = [r["alignment"]["ratio"] for r in rows if r.get("alignment") and r["alignment"]["ratio"] is not None]
    return {"p": recipe.model.deeploop_p, "rounds": R, "seed": recipe.train.seed,
            "converged": bool(finite and math.isfinite(final) and final <= CONVERGED_FRACTION * losses[0]),
            "first_loss": losses[0], "train_loss_final": final if math.isfinite(final) else None,
            "val_loss": val if val is not None and math.isfinite(val) else None,
            "alignment_ratio": statistics.mean(ratios) if ratios else None, "run": str(out)}


def run_deeploop(base: Recipe, out: str | Path, exponents=EXPONENTS, rounds=ROUNDS, seeds=SEEDS) -> dict[str, Any]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    trials = []
    for p in exponents:
        for R in rounds:
            for seed in seeds:
                # a diverging trial logs non-finite losses and counts as failed; an exception is a bug
                # and stops the sweep rather than passing for a failed trial
                recipe = trial_recipe(base, p, R, seed)
                trials.append(run_trial(recipe, out / recipe.name))
    cells = []
    for p in exponents:
        for R in rounds:
            ts = [t for t in trials if t["p"] == p and t["rounds"] == R]
            ok = [t for t in ts if t["converged"]]
            cells.append({"p": p, "rounds": R, "trials": len(ts), "converged": len(ok), "failed": len(ts) - len(ok),
                          "mean_val_loss_converged": statistics.mean(t["val_loss"] for t in ok) if ok else None,
                          "mean_alignment_ratio": _mean(t["alignment_ratio"] for t in ts)})
    result = {"criterion": f"all logged losses finite and final training loss <= {CONVERGED_FRACTION} x the first",
              "trials": trials, "cells": cells, "failed_trials": sum(not t["converged"] for t in trials),
              "recipe": base.name}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(markdown(result))
    return result


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.mean(vals) if vals else None


def markdown(result: dict[str, Any]) -> str:
    lines = ["# DeepLoop sweep", "", f"Converged: {result['criterion']}. Failed trials: "
             f"{result['failed_trials']} of {len(result['trials'])} (every trial is listed in result.json).", "",
             "| p | rounds | converged / trials | mean val loss (converged) | mean alignment ratio |",
             "|---|---|---|---|---|"]
    for c in result["cells"]:
        val = "—" if c["mean_val_loss_converged"] is None else f"{c['mean_val_loss_converged']:.4f}"
        al = "—" if c["mean_alignment_ratio"] is None else f"{c['mean_alignment_ratio']:.2f}"
        lines.append(f"| {c['p']:g} | {c['rounds']} | {c['converged']} / {c['trials']} | {val} | {al} |")
    return "\n".join(lines) + "\n"


def summary_lines(result: dict[str, Any]) -> list[str]:
    return [f"p={c['p']:g} R={c['rounds']}: {c['converged']}/{c['trials']} converged, val "
            f"{'-' if c['mean_val_loss_converged'] is None else format(c['mean_val_loss_converged'], '.4f')}, "
            f"alignment {'-' if c['mean_alignment_ratio'] is None else format(c['mean_alignment_ratio'], '.2f')}"
            for c in result["cells"]] + [f"failed trials: {result['failed_trials']} of {len(result['trials'])}"]
