"""Held-out loss by number of rounds (`looplm eval`, and the report's val_loss_by_rounds)."""

from __future__ import annotations

import math

import torch

from ..device import model_device
from ..model.losses import token_losses


def eval_rounds_list(recipe, mean_depth: float) -> list[int]:
    """Rounds 1, 2, 4, ... up to at least twice the training mean depth (and the training maximum)."""
    target = max(2 * mean_depth, recipe.depth.max_rounds)
    rounds, r = [], 1
    while True:
        rounds.append(r)
        if r >= target:
            break
        r *= 2
    if recipe.model.untied:
        return [recipe.depth.rounds]
    return rounds


def extrapolation_rounds(recipe) -> list[int]:
    """Every depth 1 .. 2x the training maximum (the report's depth-extrapolation curve)."""
    if recipe.model.untied:
        return [recipe.depth.rounds]
    return list(range(1, 2 * recipe.depth.max_rounds + 1))


@torch.no_grad()
def evaluate_rounds(model, batches, rounds_list: list[int]) -> dict[int, dict[str, float]]:
    """Mean next-token loss and perplexity at each round count, over the same batches.
    One forward at the largest depth reads out every requested round (the logit lens at
    round r equals running exactly r rounds, because later rounds cannot affect earlier ones)."""
    model.eval()
    top = max(rounds_list)
    sums = {r: 0.0 for r in rounds_list}
    count = 0
    device = model_device(model)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        # A fixed generator makes a random initial state reproducible across evaluations.
        out = model(x, top, readout_rounds=tuple(rounds_list), generator=torch.Generator().manual_seed(count))
        for r in rounds_list:
            sums[r] += token_losses(out.round_logits[r], y).sum().item()
        count += y.numel()
    return {r: {"loss": sums[r] / count, "ppl": math.exp(min(50.0, sums[r] / count))} for r in rounds_list}


def eval_batches_for(run, data_path: str | None = None, max_batches: int | None = None):
    """Validation batches for a run: its own held-out split, or text from --data tokenized with its tokenizer."""
    from ..data import text as data_mod

    recipe = run.recipe
    n = max_batches or recipe.train.eval_batches
    if data_path:
        import tempfile
        from pathlib import Path
        docs = data_mod.read_documents(data_path, recipe.data.max_bytes)
        with tempfile.TemporaryDirectory() as tmp:
            tokens = data_mod.encode_to_memmap(docs, run.tokenizer, Path(tmp) / "eval.bin")
            return data_mod.val_batches(tokens.copy(), recipe.data.seq_len, recipe.train.batch_size, n)
    from ..errors import UserError
    val_path = run.path / "data" / "val.bin"
    if not val_path.exists():
        raise UserError(f"run {run.path}: missing data/val.bin; pass --data PATH to evaluate on other text")
    return data_mod.val_batches(data_mod.open_tokens(val_path), recipe.data.seq_len, recipe.train.batch_size, n)
