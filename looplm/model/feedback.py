"""Full-bandwidth feedback: the previous position's completed top state re-enters at the bottom.

    x_t = fuse(e_t, h_{t-1})        e_t: the token's embedding (B, T, d); h_{t-1}: the previous
                                    position's top state, after the final norm (B, T, d, shifted)
    gate    (W_u h) * sigmoid(W_g e)        the Full-Bandwidth Transformer's fusion, 2 d^2 weights
    add     e + W_u h                       d^2
    concat  W_c [e; h]                      2 d^2

x_t replaces e_t as the model's bottom input, before the prelude; the loop then runs as the recipe
says (feedback enters once per position, not once per round). Positions with no previous state — a
window's first, and the token after an end-of-text token (`feedback.reset_at_eos`) — read their
plain embedding: the start convention (`plain_positions`).

Why h after the final norm: it is the vector the LM head reads, so its scale is fixed by the norm's
weight, whatever the depth. The residual stream before the norm grows with the rounds run (looplm
check measures it), so a fused input built from it would change scale with the test-time depth.

Feedback adds computational access, not information: h_{t-1} is a function of tokens <= t-1, which
position t already attends to. Training computes it with parallel passes (`passes_forward`): pass 1
from the embeddings, pass k from pass k-1's top states shifted by one position; after K passes the
first K positions hold exactly what serial decoding computes. The trainer runs the K passes inside
one model call (`LoopedLM.forward(feedback_passes=K)`), so DDP and FSDP see one forward per backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..recipe.config import FeedbackConfig


class Feedback(nn.Module):
    """The fusion of one position's embedding with the previous position's top state (see above)."""

    def __init__(self, d: int, cfg: FeedbackConfig, eps: float):
        super().__init__()
        self.mode, self.jitter = cfg.mode, cfg.jitter
        if cfg.mode == "concat":
            self.proj = nn.Linear(2 * d, d, bias=False)
        else:
            self.up = nn.Linear(d, d, bias=False)
            self.gate = nn.Linear(d, d, bias=False) if cfg.mode == "gate" else None
        self.norm_in = nn.RMSNorm(d, eps=eps) if cfg.norm else None
        self.norm_out = nn.RMSNorm(d, eps=eps) if cfg.norm else None

    def forward(self, e: Tensor, h: Tensor, plain: Tensor, noise: Tensor | None = None,
                generator: torch.Generator | None = None) -> Tensor:
        """e, h: (B, T, d); plain: (B, T) bool, True where the position reads e as it is. noise: (B, T, d)
        the jitter's U(0, 1) draws, when the caller made them (passes_forward draws a global batch's and
        slices it); None: drawn here from `generator`."""
        h = h.to(e.dtype)
        if self.norm_in is not None:
            h = self.norm_in(h)
        if self.mode == "gate":
            fused = self.up(h) * torch.sigmoid(self.gate(e))
        elif self.mode == "add":
            fused = e + self.up(h)
        else:
            fused = self.proj(torch.cat([e, h], dim=-1))
        if self.norm_out is not None:
            fused = self.norm_out(fused)
        if self.training and self.jitter:    # uniform noise of std `jitter`: U(-a, a) with a = sqrt(3) std
            u = self.uniform(fused.shape, generator, fused.device) if noise is None else noise
            fused = fused + (2 * u.to(fused.dtype) - 1) * (self.jitter * math.sqrt(3))
        return torch.where(plain.unsqueeze(-1), e, fused)

    @staticmethod
    def uniform(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> Tensor:
        """The jitter's U(0, 1) draws, float32 on `device`. A CPU generator (the trainer's) draws on the CPU,
        so every device gets the same numbers from the same seed."""
        cpu = generator is not None and generator.device.type == "cpu"
        return torch.rand(shape, generator=generator, device="cpu" if cpu else device).to(device)


def plain_positions(idx: Tensor, eos_id: int | None, reset_at_eos: bool, prefix: Tensor | None = None) -> Tensor:
    """(B, T) bool: the positions that read their plain embedding: the first of the window, with
    reset_at_eos every token after an end-of-text token, and the first prefix[b] positions of row b
    (a plain prefix: fusion on the suffix only)."""
    plain = torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
    plain[:, 0] = True
    if reset_at_eos and eos_id is not None:
        plain[:, 1:] |= idx[:, :-1] == eos_id
    if prefix is not None:
        plain |= torch.arange(idx.shape[1], device=idx.device) < prefix.to(idx.device).unsqueeze(-1)
    return plain


def shift_states(top: Tensor) -> Tensor:
    """(B, T, d) top states -> what each position reads: position t gets t - 1's (zeros at t = 0,
    which the start convention never reads)."""
    return torch.cat([torch.zeros_like(top[:, :1]), top[:, :-1]], dim=1)


def passes_forward(model: Any, idx: Tensor, passes: int, plain: Tensor, run: Any = None,
                   noise_rows: tuple[int, slice] | None = None, **kwargs: Any) -> list[Any]:
    """The K-pass training forward: one LoopOutput per pass. Pass 1 runs on the embeddings; pass k
    fuses pass k-1's top states, shifted by one position, into the bottom input. Gradients flow
    through the earlier passes (nothing is detached). `run` is what runs one pass (default the model;
    `LoopedLM.forward(feedback_passes=K)` hands its own forward, so the K passes are one model call);
    kwargs go to every pass (rounds, window, readouts, ...).

    The random draws come from kwargs' generator (the trainer's, seeded per micro-batch): the initial
    state once, shared by every pass as serial decoding has one per position, then each fed pass's
    jitter. noise_rows (G, rows): idx is rows `rows` of a global batch of G (one process of several);
    every draw is made for all G rows and sliced, so any world size trains on the same numbers."""
    run = model if run is None else run
    G, keep = noise_rows if noise_rows is not None else (idx.shape[0], slice(None))
    whole = (G, *idx.shape[1:], model.cfg.d_model)                  # (G, T, d): the global batch's draws
    gen = kwargs.get("generator")
    if model.cfg.init_state == "random" and kwargs.get("initial_state") is None and (model.training or gen is not None):
        kwargs["initial_state"] = model.random_state(whole, gen, model.embed.weight.dtype, idx.device)[keep]
    fb = model.feedback
    outs: list[Any] = []
    fed = None
    for k in range(passes):
        out = run(idx, feedback=fed, keep_top=k < passes - 1, **kwargs)
        outs.append(out)
        if k < passes - 1:
            jitter = fb is not None and fb.training and fb.jitter
            noise = Feedback.uniform(whole, gen, idx.device)[keep] if jitter else None           # (B, T, d)
            fed = (shift_states(out.top), plain, noise)
    return outs
