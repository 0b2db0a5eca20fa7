"""DeepLoop's alignment of a shared core's per-visit gradients (`train.alignment_every`).

A core block applied R times per forward receives the sum of R gradient contributions, one per
visit: g = sum_r g_r. How large that sum is depends on how the visits' gradients align,

    ratio = ||sum_r g_r||^2 / sum_r ||g_r||^2

which is 1 when the visits are decorrelated (the sum grows like sqrt(R)) and R when they are
identical (coherent: the update grows like R, DeepLoop's Theta(R) regime, the reason for its
1/R^p scaling). The pairwise cosines of the visits' gradients say the same per pair.

Measured exactly, not estimated: the training micro-batch is run again on `untied_copy` of the
model at the same depth, window, noise and loss (round r's blocks are its own copies holding the
same weights, so the function and the total gradient are the training step's), and each copy's
gradient is visit r's contribution. Visits without gradient (before the backward window) are left
out. Cost per measurement: one more forward and backward of the micro-batch, with R copies of the
core in memory (their parameters and gradients); nothing while the measurement is off.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from torch import Tensor


def alignment_stats(visits: list[dict[str, Tensor]]) -> dict[str, Any]:
    """visits[r][name]: visit r's gradient of shared tensor `name` (visits without gradient left out).
    -> {"visits", "ratio", "mean_pairwise_cosine", "per_tensor": {name: ratio}, "visit_norms"}."""
    if not visits:
        return {"visits": 0, "ratio": None, "mean_pairwise_cosine": None, "per_tensor": {}, "visit_norms": []}
    names = list(visits[0])
    per_tensor = {}
    num = den = 0.0
    for n in names:
        gs = [v[n].double() for v in visits]
        total = torch.stack(gs).sum(0).pow(2).sum().item()
        parts = sum(g.pow(2).sum().item() for g in gs)
        per_tensor[n] = total / parts if parts > 0 else None
        num, den = num + total, den + parts
    flat = [torch.cat([v[n].double().flatten() for n in names]) for v in visits]
    cos = [torch.nn.functional.cosine_similarity(a, b, dim=0).item() for a, b in itertools.combinations(flat, 2)]
    return {"visits": len(visits), "ratio": num / den if den > 0 else None,
            "mean_pairwise_cosine": sum(cos) / len(cos) if cos else None,
            "per_tensor": per_tensor, "visit_norms": [f.norm().item() for f in flat]}


def visit_gradients(model, recipe, rounds: int, run_step: Callable[[Any, Any], Any]
                    ) -> tuple[list[dict[str, Tensor]], list[int]]:
    """Each visit's gradient of the shared core tensors for one training micro-batch, measured on an
    untied copy: ([{core tensor name: gradient}] per visit with gradient, those visits' rounds).
    run_step(model, recipe): the trainer's forward and backward of that micro-batch at `rounds`
    rounds, run here on the copy with the training recipe made untied."""
    from ..model.looped import untied_copy

    K = model.cfg.n_core
    copy = untied_copy(model, rounds).train()
    # the training recipe with an untied model (validated at its largest depth; the step's rounds are passed)
    from ..recipe.config import derive_recipe
    fixed = derive_recipe(recipe.to_dict(), {"model.untied": True, "depth.kind": "fixed",
                                             "depth.rounds": recipe.depth.max_rounds, "train.alignment_every": 0},
                          quiet=True)
    run_step(copy, fixed)
    visits, used = [], []
    for r in range(1, rounds + 1):
        blocks = copy.core[(r - 1) * K: r * K]
        params = {f"core.{i}.{n}": p for i, b in enumerate(blocks) for n, p in b.named_parameters()}
        if all(p.grad is None for p in params.values()):
            continue                       # a visit before the backward window
        visits.append({n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()})
        used.append(r)
    return visits, used


def measure_alignment(model, recipe, rounds: int, run_step: Callable[[Any, Any], Any]) -> dict[str, Any]:
    """The metrics.jsonl entry: `alignment_stats` of this micro-batch's visits, and which rounds."""
    visits, used = visit_gradients(model, recipe, rounds, run_step)
    return {**alignment_stats(visits), "rounds_with_gradient": used, "rounds": rounds}
