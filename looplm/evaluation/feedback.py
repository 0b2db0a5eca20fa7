"""Feedback, evaluated: held-out loss after one, two, three ... parallel passes (model/feedback.py).

Pass 1 is the plain model (the standard prompt mode: no feedback), with the initial-state noise `eval
--rounds` draws for the same batches (rounds.batch_generator), so pass 1 is its loss at the same depth;
pass k fuses pass k-1's top states, shifted by one position, and shares pass 1's initial state (serial
decoding has one per position). After K passes the first K positions of each window hold exactly what serial
decoding with feedback computes, so the loss by passes says how much of feedback's effect K passes
already reach on windows of the evaluation length.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

from ..model.feedback import passes_forward, plain_positions
from ..model.losses import token_losses
from .rounds import batch_generator


@torch.no_grad()
def loss_by_passes(model: Any, batches: Iterable[tuple[Tensor, Tensor]], recipe: Any, eos_id: int | None,
                   passes: int, rounds: int | None = None) -> dict[str, float]:
    """passes k (as a string) -> mean held-out token loss of pass k's readout, k = 1..passes, at `rounds`
    (default the recipe's depth); every pass of a batch is computed once."""
    was = model.training
    model.eval()
    dev = model.embed.weight.device
    totals, n = [0.0] * passes, 0
    rounds = rounds or recipe.depth.rounds
    for x, y in batches:
        x, y = x.to(dev), y.to(dev)
        plain = plain_positions(x, eos_id, recipe.feedback.reset_at_eos)
        outs = passes_forward(model, x, passes, plain, rounds=rounds, generator=batch_generator(n))
        for k, out in enumerate(outs):
            totals[k] += token_losses(out.logits, y).sum().item()       # as evaluate_rounds sums them
        n += y.numel()
    model.train(was)
    return {str(k + 1): totals[k] / max(n, 1) for k in range(passes)}
