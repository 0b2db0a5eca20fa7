"""Dense and sparse, looped and untied, at matched training FLOPs: `looplm experiment loopmoe`.

The seeds' Sparse Layers comparison: a dense untied stack (Base), the same blocks looped (Loop),
an untied mixture of experts (MoE) and a looped one (LoopMoE), trained at the same compute. Here
every variant is built from one recipe (fixed R rounds, full backward):

    base     untied: n_core x R distinct dense blocks
    loop     n_core shared dense blocks x R rounds
    moe      untied, each block's FFN E experts of width ffn_hidden / k, top-k
    loopmoe  shared, the same experts routed at every visit

An expert is ffn_hidden / k wide, so a token's active FFN is as wide as the dense one and a
step costs about the same FLOPs in all four (plus the router). The budget is the loop variant's
training FLOPs at the recipe's steps; every variant trains for the number of steps whose FLOPs,
from the same counter the trainer records (model/flops.py: every visit, active experts only),
come closest to it. The table reports what each run's own report.json recorded — stored and
active parameters, steps, training FLOPs, validation loss at R — and, for the looped MoE, the
routing shares at consecutive visits; whatever ordering comes out is reported as it is.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..recipe.config import Recipe, derive_recipe

VARIANTS = ("base", "loop", "moe", "loopmoe")
SMALL = {"model.d_model": 64, "model.n_heads": 2, "model.n_kv_heads": 2, "data.seq_len": 64, "model.context": 64,
         "train.batch_size": 8, "train.steps": 200, "train.log_every": 10, "train.checkpoint_every": 1000,
         "data.max_bytes": 600_000, "train.eval_batches": 8, "depth.rounds": 4}
"""The default size of the comparison (the loopmoe recipe, smaller): four runs of minutes each."""
QUICK = {**SMALL, "model.d_model": 32, "data.seq_len": 16, "model.context": 32, "train.batch_size": 2,
         "train.steps": 3, "train.log_every": 1, "data.max_bytes": 20_000, "train.eval_batches": 1,
         "depth.rounds": 2}


def variant_recipe(base: Recipe, variant: str, experts: int, top_k: int) -> Recipe:
    moe = variant in ("moe", "loopmoe")
    hidden = base.model.ffn_hidden
    over = {"name": f"{base.name}-{variant}", "model.untied": variant in ("base", "moe"), "depth.kind": "fixed",
            "backward.window": "all", "exit.min_rounds": 1,
            "model.moe_experts": experts if moe else 0, "model.moe_top_k": top_k if moe else 2,
            "model.moe_hidden": max(1, hidden // top_k) if moe else 0, "model.ffn_hidden": hidden}
    if not moe:
        over.update({"supervision.moe_balance": 0.01, "supervision.moe_z": 0.001})   # the dense defaults
    return derive_recipe(base.to_dict(), over)


def step_flops(recipe: Recipe) -> float:
    """Training FLOPs of one step of this recipe (fixed depth, full backward, final readout), from
    the counter the trainer uses."""
    from ..model.flops import Visits, prelude_receives_gradient, train_flops_per_token
    m, R = recipe.model, recipe.depth.rounds
    sup_rounds = 1 if recipe.supervision.kind == "final" else R
    visits = Visits(rounds=R, grad_rounds=R, readouts=sup_rounds, grad_readouts=sup_rounds,
                    prelude_grad=prelude_receives_gradient(m, tuple(range(1, R + 1))),
                    gate_grad=recipe.exit.gate)
    tokens = recipe.train.batch_size * recipe.train.grad_accum * recipe.data.seq_len
    return tokens * train_flops_per_token(m, visits, recipe.data.seq_len, recipe.exit.gate)


def run_loopmoe(base: Recipe, out: str | Path, experts: int = 8, top_k: int = 2) -> dict[str, Any]:
    from ..train.trainer import train
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    recipes = {v: variant_recipe(base, v, experts, top_k) for v in VARIANTS}
    budget = step_flops(recipes["loop"]) * base.train.steps
    rows = []
    for v, rec in recipes.items():
        steps = max(1, round(budget / step_flops(rec)))
        rec = derive_recipe(rec.to_dict(), {"train.steps": steps})
        report = train(rec, out / v, quiet=True)
        R = rec.depth.rounds
        row = {"variant": v, "steps": report["steps"], "train_flops": report["train_flops"],
               "params_stored": report["params_stored"], "params_per_token": report["params_per_token_visit"],
               "val_loss": report["val_loss_by_rounds"].get(str(R)), "train_loss_final": report["train_loss_final"],
               "run": str(out / v)}
        routing = report.get("routing")
        if routing and routing["consecutive_visits"] == "measured":
            pairs = [p for layer in routing["layers"].values() for p in layer["consecutive_visits"]]
            row["identical_share"] = statistics.mean(p["identical"] for p in pairs)
            row["disjoint_share"] = statistics.mean(p["disjoint"] for p in pairs)
        rows.append(row)
    order = [r["variant"] for r in sorted(rows, key=lambda r: r["val_loss"])]
    result = {"budget_flops": budget, "experts": experts, "top_k": top_k, "rounds": base.depth.rounds,
              "recipe": base.name, "rows": rows, "val_loss_order": order}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Dense vs sparse, looped vs untied, at matched training FLOPs", "",
             f"Budget {result['budget_flops']:.3e} training FLOPs (the loop variant's at the recipe's steps), "
             f"{result['rounds']} rounds, MoE: top-{result['top_k']} of {result['experts']} experts. FLOPs, parameters "
             "and losses are each run's own report.json.", "",
             "| variant | steps | training FLOPs | vs budget | params stored | params applied per token | "
             "val loss | identical / disjoint experts at consecutive visits |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        share = (f"{r['identical_share']:.2f} / {r['disjoint_share']:.2f}" if "identical_share" in r
                 else "not applicable")
        lines.append(f"| {r['variant']} | {r['steps']} | {r['train_flops']:.3e} | "
                     f"{r['train_flops'] / result['budget_flops']:.3f}x | {r['params_stored']:,} | "
                     f"{r['params_per_token']:,.0f} | {r['val_loss']:.4f} | {share} |")
    lines += ["", "Validation loss, best first: " + " < ".join(result["val_loss_order"]) + "."]
    return "\n".join(lines) + "\n"


def summary_lines(result: dict[str, Any]) -> list[str]:
    return [f"{r['variant']:>8s}: {r['steps']} steps, {r['train_flops']:.3e} FLOPs, stored {r['params_stored']:,}, "
            f"val loss {r['val_loss']:.4f}" for r in result["rows"]] + \
        ["val loss order: " + " < ".join(result["val_loss_order"])]
