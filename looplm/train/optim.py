"""The optimizer a recipe asks for, and its learning-rate schedule.

optim.optimizer = "adamw": one AdamW; matrices decay, norms, biases and embeddings do not.
optim.optimizer = "muon": torch.optim.Muon on the hidden matrices (every 2-D weight inside a prelude,
core or coda block, and the concat adapter), AdamW on the rest (embeddings, LM head, norms, biases,
routers, gates, 3-D expert weights), as Muon's authors prescribe. The two are stepped as one `Optimizers`
whose param_groups, state_dict and load_state_dict look like one torch optimizer's, so the trainer's
checkpoint (state keyed by parameter name, in param_groups order), gradient clipping and GradScaler
treat both alike. Muon's group carries `lr_ratio` = optim.muon_lr / optim.lr: the schedule scales
both learning rates by the same factor.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..recipe.config import Recipe

HIDDEN_PREFIXES = ("prelude.", "core.", "coda.", "adapter.")
"""Where Muon's matrices live: the blocks' projections and the re-entry adapter (not embed/head)."""


def muon_parameter(name: str, p: torch.Tensor) -> bool:
    """Whether Muon updates this parameter: a 2-D weight of a block or of the adapter."""
    return p.dim() == 2 and name.startswith(HIDDEN_PREFIXES)


class Optimizers:
    """Several torch optimizers stepped as one. param_groups concatenates theirs (the same dicts, so setting a
    group's lr reaches the optimizer that owns it); state_dict numbers the parameters in that order."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Optimizers.step takes no closure")
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": {}, "param_groups": []}
        offset = 0
        for o in self.optimizers:
            sd = o.state_dict()
            out["state"].update({offset + i: v for i, v in sd["state"].items()})
            out["param_groups"] += [{**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in o.param_groups)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        groups = list(state["param_groups"])
        offset = 0
        for o in self.optimizers:
            n = len(o.param_groups)
            own, groups = groups[:n], groups[n:]
            count = sum(len(g["params"]) for g in own)
            ids = range(offset, offset + count)
            o.load_state_dict({"state": {i - offset: state["state"][i] for i in ids if i in state["state"]},
                               "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in own]})
            offset += count


def make_optimizer(model: torch.nn.Module, recipe: Recipe, trainable_only: bool = False):
    """The recipe's optimizer over the model's parameters. named_parameters() yields a shared tensor once, so
    the optimizer sees each shared tensor once. trainable_only: leave out frozen parameters (Stage II freezes
    the LM before the model is wrapped for several processes)."""
    o = recipe.optim
    decay, no_decay, hidden = [], [], []
    for name, p in model.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        if o.optimizer == "muon" and muon_parameter(name, p):
            hidden.append(p)
        else:
            (decay if p.dim() >= 2 and not name.startswith("embed") else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    if o.optimizer != "muon" or not hidden:    # a model without block matrices (the LSTM baseline): AdamW alone
        return adamw
    muon = torch.optim.Muon([{"params": hidden, "lr_ratio": o.muon_lr / o.lr}], lr=o.muon_lr,
                            weight_decay=o.weight_decay, momentum=o.muon_momentum, nesterov=True,
                            adjust_lr_fn=o.muon_adjust_lr)
    return Optimizers(adamw, muon)


def optimizer_record(model: torch.nn.Module, opt) -> dict[str, int]:
    """Parameters each optimizer holds, counted from the optimizer itself (report.json's `optimizer`)."""
    parts = opt.optimizers if isinstance(opt, Optimizers) else (opt,)
    return {type(o).__name__.lower(): sum(p.numel() for g in o.param_groups for p in g["params"]) for o in parts}


def lr_at(step: int, recipe: Recipe) -> float:
    """The schedule's learning rate at `step` (AdamW's; Muon's is this times muon_lr / lr)."""
    o, total = recipe.optim, recipe.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    floor = o.lr * o.min_lr_ratio
    if o.schedule == "constant":
        return o.lr
    if o.schedule == "wsd":
        decay_start = total - int(round(o.decay_fraction * total))
        if step < decay_start:
            return o.lr
        frac = (step - decay_start + 1) / max(1, total - decay_start)
        return o.lr + (floor - o.lr) * frac
    frac = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return floor + (o.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def set_lr(opt, lr: float) -> None:
    """Every group's learning rate for this step: `lr`, times the group's lr_ratio (Muon's) where it has one."""
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)
