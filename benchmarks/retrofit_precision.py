"""The retrofit's training step in fp32 and under bf16 autocast: speed, and loss on the same steps.

    python benchmarks/retrofit_precision.py --exp runs/retrofit [--steps 4] [--json]

From an `experiment retrofit` folder's keep import (EXP/imports/keep, SmolLM2 with its middle span shared)
the retrofit-keep recipe (the experiment's settings, `train.dtype` fp32 or bf16) trains --steps steps twice
from the same weights, on the same batches and the same drawn depths: once in fp32, once with bf16 autocast
(`train.dtype = "bf16"`: fp32 weights and optimizer, bf16 products). Reported per precision: the training loss
at every step, the median seconds per step after the first, and the held-out loss (8 windows of the split) at
rounds 1 and 4 after the steps; and the largest loss difference between the two at the same step. Run it with
the cores to itself: it times steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def run(exp: Path, steps: int, dtype: str) -> dict:
    from looplm.data import text as data_mod
    from looplm.evaluation.rounds import evaluate_rounds
    from looplm.experiments.retrofit import RETROFIT, TRAINING, model_before
    from looplm.train.optim import lr_at, make_optimizer, set_lr
    from looplm.train.trainer import Counters, init_recipe, train_step
    init = exp / "imports" / "keep"
    recipe = init_recipe(init, None, {**TRAINING, **RETROFIT, "train.steps": steps, "train.dtype": dtype,
                                      "optim.warmup_steps": 1})
    model = model_before(recipe, init).train()
    opt = make_optimizer(model, recipe)
    sampler = data_mod.TokenSampler(data_mod.open_tokens(init / "data" / "train.bin"), recipe.data.seq_len,
                                    recipe.train.batch_size, recipe.train.seed)
    losses, times, depths = [], [], []
    for step in range(steps):
        x, y = sampler.batch(step)
        set_lr(opt, lr_at(step, recipe))
        t0 = time.perf_counter()
        loss, out, _ = train_step(model, recipe, x, y, step, 0, Counters())
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], recipe.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        depths.append(out.rounds)
        print(f"{dtype} step {step}: rounds {out.rounds} loss {loss:.4f} {times[-1]:.1f} s", file=sys.stderr, flush=True)
    batches = data_mod.val_batches(data_mod.open_tokens(init / "data" / "val.bin"), recipe.data.seq_len, 4, 2)
    with torch.no_grad():
        held = evaluate_rounds(model, batches, [1, 4])
    return {"dtype": dtype, "losses": losses, "rounds": depths, "s_per_step": statistics.median(times[1:] or times),
            "held_out_loss": {str(r): v["loss"] for r, v in held.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exp", default="runs/retrofit", help="an `experiment retrofit` folder (its imports/keep)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [run(Path(args.exp), args.steps, d) for d in ("fp32", "bf16")]
    fp32, bf16 = rows
    assert fp32["rounds"] == bf16["rounds"]
    result = {"rows": rows, "max_abs_loss_diff": max(abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"])),
              "bf16_speed_vs_fp32": fp32["s_per_step"] / bf16["s_per_step"], "torch": torch.__version__}
    if args.json:
        print(json.dumps(result))
        return
    for r in rows:
        print(f"{r['dtype']:5s} {r['s_per_step']:.1f} s/step  losses {[round(v, 4) for v in r['losses']]}  "
              f"held-out r1 {r['held_out_loss']['1']:.4f} r4 {r['held_out_loss']['4']:.4f}")
    print(f"bf16 speed vs fp32: {result['bf16_speed_vs_fp32']:.2f}x; max |loss diff| {result['max_abs_loss_diff']:.4f}")


if __name__ == "__main__":
    main()
