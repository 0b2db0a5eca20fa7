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


def batch_generator(tokens_before: int) -> torch.Generator:
    """The initial-state generator of one evaluation batch: a CPU generator seeded with the number of target
    tokens scored in the batches before it. A random initial state (model.init_state = "random") is then the
    same noise every time the same batches are scored, and every evaluation that reads out the plain model
    on them draws it so: `eval --rounds` (evaluate_rounds), `--exit`'s fixed:R, feedback's pass 1
    (evaluation/feedback.py), `eval --contrast`'s plain figures (cli._eval_contrast), so their numbers for
    the same function are the same number."""
    return torch.Generator().manual_seed(tokens_before)


@torch.no_grad()
def evaluate_rounds(model, batches, rounds_list: list[int], states: bool = False) -> dict[int, dict[str, float]]:
    """Mean next-token loss and perplexity at each round count, over the same batches.
    One forward at the largest depth reads out every requested round (the logit lens at
    round r equals running exactly r rounds, because later rounds cannot affect earlier ones).
    states: also the loop state after each requested round, from the states themselves: "state_rms"
    (root mean square over every position and feature) and "state_change" (the RMS of s_r - s_(r-1)
    over the RMS of s_(r-1): the relative move round r made; round 1's is from the initial state)."""
    model.eval()
    top = max(rounds_list)
    sums = {r: 0.0 for r in rounds_list}
    sq = {r: [0.0, 0.0, 0.0] for r in rounds_list}      # sum s_r^2, sum (s_r - s_(r-1))^2, sum s_(r-1)^2
    count = elements = 0
    device = model_device(model)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        out = model(x, top, readout_rounds=tuple(rounds_list), generator=batch_generator(count), collect_stats=states)
        for r in rounds_list:
            sums[r] += token_losses(out.round_logits[r], y).sum().item()
        if states:
            s0 = model.loop_inputs(x, generator=batch_generator(count))[2]   # the same initial state
            for r in rounds_list:
                cur = out.round_states[r - 1].float()
                prev = (out.round_states[r - 2] if r > 1 else s0).float()
                sq[r][0] += cur.pow(2).sum().item()
                sq[r][1] += (cur - prev).pow(2).sum().item()
                sq[r][2] += prev.pow(2).sum().item()
            elements += out.round_states[0].numel()
        count += y.numel()
    result = {r: {"loss": sums[r] / count, "ppl": math.exp(min(50.0, sums[r] / count))} for r in rounds_list}
    if states:
        for r in rounds_list:
            result[r]["state_rms"] = math.sqrt(sq[r][0] / elements)
            result[r]["state_change"] = math.sqrt(sq[r][1] / max(sq[r][2], 1e-30))
    return result


def eval_batches_for(run, data_path: str | None = None, max_batches: int | None = None,
                     batch_size: int | None = None):
    """Validation batches for a run: its own held-out split, or text from --data tokenized with its tokenizer.

    The windows are the recipe's (up to train.eval_batches x train.batch_size sequences);
    batch_size only regroups them into passes of that many rows (`looplm eval --batch-size`): the
    same tokens, scored the same (a random initial state draws its noise per pass), and larger
    passes amortise per-call overhead (early exit's partial rounds)."""
    from ..data import text as data_mod
    from ..errors import UserError

    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size: expected a positive integer, got {batch_size}")
    recipe = run.recipe
    n = max_batches or recipe.train.eval_batches
    from ..data.prepared import is_prepared, prepared_eval_tokens
    if is_prepared(data_path):          # `looplm data prepare`'s folder: its held-out split, as tokenized
        tokens = prepared_eval_tokens(data_path, run.tokenizer)
    elif data_path:
        import tempfile
        from pathlib import Path
        docs = data_mod.read_documents(data_path, recipe.data.max_bytes)
        with tempfile.TemporaryDirectory() as tmp:
            tokens = data_mod.encode_to_memmap(docs, run.tokenizer, Path(tmp) / "eval.bin").copy()
    else:
        val_path = run.path / "data" / "val.bin"
        if not val_path.exists():
            raise UserError(f"run {run.path}: missing data/val.bin; pass --data PATH to evaluate on other text")
        tokens = data_mod.open_tokens(val_path)
    batches = data_mod.val_batches(tokens, recipe.data.seq_len, recipe.train.batch_size, n)
    if batch_size is None or batch_size == recipe.train.batch_size:
        return batches
    x, y = (torch.cat(parts) for parts in zip(*batches))                  # (S, T) every window
    return list(zip(x.split(batch_size), y.split(batch_size)))