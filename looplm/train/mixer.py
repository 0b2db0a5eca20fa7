"""Training recirculation's adaptive mixer through the recurrence, the model frozen.

The loss is the language-modelling loss of the ordinary readouts, which the mixer reaches only through
refined history: position t's logits read the keys and values that earlier positions' refinement wrote.
So the gradient must flow through the schedule's cache writes. `EagerPasses` runs the same `schedule`
(inference/recirculation.py) the engine runs, on the model's eager pieces with a cache whose entries are
kept per position (`PositionCache`): a refinement replaces position t's entry by a new tensor instead of
writing into a buffer, so autograd keeps both and the backward reaches the mixer through every later
position's attention. Nothing of the model requires grad, and only the mixer's parameters are in the
optimizer: the model's weights are bit-identical afterwards (tested).

    mixer, record = train_mixer(model, rc, windows, kind="conditional_vector", steps=100)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..inference.recirculation import Recirculation, schedule
from ..model.blocks import Ops, sdpa
from ..model.mixer import AdaptiveMixer
from ..model.recurrence import unroll


class PositionCache:
    """Keys and values per slot as a list of per-position tensors (B, Hkv, 1, Dh): a write at a position
    that holds one replaces it (the refinement), a write at the next position appends. `col` is the
    position the next pass writes (one column at a time: the serial schedule)."""

    def __init__(self) -> None:
        self.k: dict[tuple, list[Tensor]] = {}
        self.v: dict[tuple, list[Tensor]] = {}
        self.col = 0

    def attend(self, slot: tuple, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ks, vs = self.k.setdefault(slot, []), self.v.setdefault(slot, [])
        if self.col < len(ks):
            ks[self.col], vs[self.col] = k, v
        else:
            ks.append(k)
            vs.append(v)
        end = self.col + 1                             # causal: this position and the ones before it
        return sdpa(q, torch.cat(ks[:end], 2), torch.cat(vs[:end], 2))


class EagerPasses:
    """`schedule`'s passes on the model's eager pieces (loop_inputs, core_step, readout), with autograd."""

    def __init__(self, model: Any, rounds: int):
        self.model, self.rounds, self.ops, self.cache = model, rounds, Ops(), PositionCache()

    def __call__(self, x: Tensor, col: int, tap: Any, skipped: int = 0) -> Tensor | None:
        m, ops, cache = self.model, self.ops, self.cache
        cache.col = col
        with ops.tapping(tap):
            rope, e, s = m.loop_inputs(x, col, None, cache, ops)
            s = unroll(lambda s, r: m.core_step(s, e, r, rope, cache, ops), s, self.rounds).state
            return m.readout(s, rope, cache, self.rounds, ops, head=not skipped)         # (B, 1, V) or None


def recirculated_logits(model: Any, rc: Recirculation, idx: Tensor, mixer: Any = None,
                        rounds: int | None = None) -> Tensor:
    """(B, T, V) readouts of windows idx (B, T) under the serial schedule, differentiable (see above)."""
    R = rounds or model.nominal_rounds
    if rc.schedule == "blockwise":
        raise ValueError("the mixer trains through an exact schedule (resume or serial)")
    pad = torch.zeros(idx.shape[0], dtype=torch.long, device=idx.device)
    return torch.cat(schedule(EagerPasses(model, R), rc, model.cfg, R, idx, 0, pad, mixer), 1)


def train_mixer(model: Any, rc: Recirculation, windows: Tensor, kind: str = "conditional_vector", steps: int = 100,
                batch: int = 4, lr: float = 3e-4, weight_decay: float = 1e-4, seed: int = 0,
                rounds: int | None = None) -> tuple[AdaptiveMixer, dict[str, Any]]:
    """Train an AdaptiveMixer of `kind` on token windows (N, T+1) (inputs and next-token targets), the
    model frozen. Returns the mixer and a record: losses per step, its matrix weights, the steps."""
    mixer = AdaptiveMixer(model.cfg.d_model, kind).to(next(model.parameters()).device)
    was = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    opt = torch.optim.AdamW(mixer.parameters(), lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed)
    losses = []
    try:
        for _ in range(steps):
            rows = torch.randint(0, windows.shape[0], (batch,), generator=g)
            w = windows[rows]
            logits = recirculated_logits(model, rc, w[:, :-1], mixer, rounds)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        for p, r in zip(model.parameters(), was):
            p.requires_grad_(r)
    return mixer, {"kind": kind, "steps": steps, "losses": losses, "matrix_weights": mixer.matrix_weights()}


@torch.no_grad()
def heldout_loss(model: Any, rc: Recirculation | None, windows: Tensor, mixer: Any = None, batch: int = 8) -> float:
    """Mean next-token cross-entropy of windows (N, T+1) under the serial schedule (None: the base model),
    the ordinary readouts scored."""
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        logits = model(w[:, :-1]).logits if rc is None else recirculated_logits(model, rc, w[:, :-1], mixer)
        total += F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten(), reduction="sum").item()
        n += w[:, 1:].numel()
    return total / n


def mixer_ablation(model: Any, rc: Recirculation, train: Tensor, heldout: Tensor, kinds: tuple[str, ...],
                   steps: int = 100, batch: int = 4, lr: float = 3e-4, seed: int = 0) -> dict[str, Any]:
    """The seeds' ablation: each mixer kind trained on `train` windows from the same start (alpha 0.1, beta
    0.9), scored on `heldout` beside the base model and the fixed mix (rc's alpha and beta): held-out loss,
    its change against the base in nats, matrix weights, the training losses' first and last."""
    base, fixed = heldout_loss(model, None, heldout), heldout_loss(model, rc, heldout)
    out: dict[str, Any] = {"base_loss": base, "fixed": {"loss": fixed, "change_nats": fixed - base,
                                                        "alpha": rc.alpha, "beta": rc.beta}, "kinds": {}}
    for kind in kinds:
        mixer, rec = train_mixer(model, rc, train, kind=kind, steps=steps, batch=batch, lr=lr, seed=seed)
        loss = heldout_loss(model, rc, heldout, mixer)
        out["kinds"][kind] = {"loss": loss, "change_nats": loss - base, "matrix_weights": rec["matrix_weights"],
                              "train_loss_first": rec["losses"][0], "train_loss_last": rec["losses"][-1],
                              "steps": steps, "mixer": mixer}
    return out
