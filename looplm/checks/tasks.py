"""A task run that learned nothing says so: its exact match, measured here at its training depth on fresh
held-out examples, against the chance level its answers and prompts allow (evaluation/chance.py)."""

from __future__ import annotations

import torch

from ..runs.checkpoint import Run
from .base import MEASURED, CheckResult

EXAMPLES = 100
"""Held-out examples per difficulty the check scores (at most the recipe's data.eval_examples)."""


@torch.no_grad()
def check_task_above_chance(run: Run) -> CheckResult:
    """Each difficulty the run trained on: exact match at the nominal depth above chance (p < ALPHA, one-sided)."""
    from ..data.taskdata import TaskSource
    from ..evaluation.chance import ALPHA, chance_by_difficulty
    from ..evaluation.tasks import score_task_sets
    name = "task_above_chance"
    recipe = run.recipe
    if not recipe.data.task:
        return CheckResult.not_applicable(name, "a language-model run (no data.task): held-out loss, not exact match")
    source = TaskSource(recipe)
    levels = [d for d in source.train_levels if d in source.eval_levels]
    if not levels:
        return CheckResult.not_applicable(name, "no held-out examples at a trained difficulty")
    sets = source.eval_sets(min(EXAMPLES, recipe.data.eval_examples), levels=levels)
    R = run.model.nominal_rounds
    scores = score_task_sets(run.model.eval(), run.tokenizer, sets, [R], separator=recipe.data.separator)
    acc = {d: {r: v["accuracy"] for r, v in row.items()} for d, row in scores["by_difficulty"].items()}
    table = chance_by_difficulty(sets, acc)
    rows = {d: row["by_rounds"][R] for d, row in table.items()}
    low = [d for d, v in rows.items() if not v["above_chance"]]
    detail = "; ".join(f"difficulty {d}: {100 * v['accuracy']:.0f}% vs chance {100 * table[d]['chance']:.0f}% "
                       f"(p = {v['p_value']:.2g})" for d, v in rows.items())
    head = (f"exact match at {R} rounds on {sum(len(s) for s in sets.values())} held-out examples of the trained "
            f"difficulties, against a guesser among the answers each prompt holds (above: p < {ALPHA:g}): ")
    if len(low) == len(rows):
        head = "LEARNED NOTHING MEASURABLE: " + head
    return CheckResult(name, not low, head + detail, MEASURED)
