"""Peak training memory against forward depth, with a fixed backward window (issue 14/15's bound).

    python benchmarks/window_memory.py [--rounds 4,32] [--window 4] [--batch 16] [--seq 128]
                                       [--activation-checkpointing] [--runs 5]

Each depth runs in its own interpreter, --runs times, depths interleaved: one training step (forward,
backward, AdamW) of the quickstart model at that depth with `backward.window` rounds of gradient, and
the step's own peak RSS above the RSS it started from (looplm.memory.RunMemory: the high-water mark is
reset after the model and optimizer are built). Reported: the median over runs and the spread. Rounds before the window run under no_grad
(model/recurrence.py), so their activations are not kept: the goal is <= 1.3x from 4 to 32 rounds.
--activation-checkpointing also recomputes each core block inside the window in the backward
(train.activation_checkpointing), so the window's activations shrink to the blocks' inputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def one(rounds: int, window: int, batch: int, seq: int, ac: bool = False) -> dict:
    import torch

    from looplm.memory import RunMemory
    from looplm.recipe import load_recipe
    from looplm.model import build_model
    from looplm.train.trainer import Counters, make_optimizer, train_step

    torch.set_num_threads(1)
    recipe = load_recipe("quickstart", overrides={"depth.kind": "fixed", "depth.rounds": rounds,
                                                  "backward.window": min(window, rounds), "train.batch_size": batch,
                                                  "data.seq_len": seq, "exit.min_rounds": 1})
    model = build_model(recipe).train()
    if ac:
        from looplm.train.parallel import checkpoint_core
        checkpoint_core(model)
    opt = make_optimizer(model, recipe)
    x = torch.randint(0, 257, (batch, seq))
    meter = RunMemory()
    loss, out, _ = train_step(model, recipe, x, x, 0, 0, Counters())
    opt.step()
    mem = meter.report()
    assert mem["peak_rss_scope"] == "run", "the RSS high-water mark could not be reset here"
    return {"rounds": rounds, "window": min(window, rounds), "activation_checkpointing": ac,
            "grad_rounds": list(out.grad_rounds), "peak_above_baseline_mib": mem["rss_growth_bytes"] / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", default="4,32")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.window, a.batch, a.seq, a.activation_checkpointing)))
        return
    depths = list(map(int, a.rounds.split(",")))
    mib: dict[int, list[float]] = {r: [] for r in depths}
    for n in range(a.runs):
        for r in depths:                            # interleaved, so a slow moment hits every depth
            cmd = [sys.executable, __file__, "--one", str(r), "--window", str(a.window), "--batch", str(a.batch),
                   "--seq", str(a.seq), *(["--activation-checkpointing"] if a.activation_checkpointing else [])]
            row = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            mib[r].append(row["peak_above_baseline_mib"])
            print(f"run {n + 1}: rounds {r:3d}, window {row['window']}: {mib[r][-1]:.0f} MiB above the step's start",
                  file=sys.stderr)
    rows = [{"rounds": r, "window": min(a.window, r), "activation_checkpointing": a.activation_checkpointing,
             "peak_above_baseline_mib": statistics.median(v), "min_mib": min(v), "max_mib": max(v), "runs": v}
            for r, v in mib.items()]
    ratio = rows[-1]["peak_above_baseline_mib"] / rows[0]["peak_above_baseline_mib"]
    print(json.dumps({"rows": rows, "ratio_last_vs_first": ratio}))

if __name__ == "__main__":
    main()
