"""A mixture of SwiGLU experts in place of a core block's FFN (`model.moe_experts`): LoopMoE.

Token choice, top-k of E: a linear router on the block's normed input gives each token logits
over the experts; the k largest softmax probabilities pick its experts and, renormalised over
those k, weigh their outputs:

    p = softmax(router(x))                 (N, E)
    experts, w = topk(p, k); w = w / sum(w)
    y = sum_j w_j * expert_{e_j}(x)        each expert a SwiGLU of width moe_hidden

In a looped core the experts are stored once and routed afresh at every visit: the same token
may choose different experts in round 1 and round 2 (`routing_stats` measures how often). Every
call appends a `Routing` record to `trace` while a forward pass collects them
(`LoopedLM.forward`), from which the two auxiliary losses are made, averaged over every visit of
the unrolled depth:

    balance = E * sum_i f_i * P_i   f_i: share of the N*k choices that went to expert i,
                                    P_i: mean router probability of expert i (Switch; 1 when even)
    z       = mean_n logsumexp(logits_n)^2   (router z-loss: keeps the logits small)

Decoding needs nothing special: a token's routing reads only its own state, so the cached engine
runs these same modules (a single token routes exactly as it does inside the full sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..recipe.config import ModelConfig


@dataclass
class Routing:
    """One call of an MoE FFN: which experts each token chose and the router's view."""

    experts: Tensor
    """(N, k) long: the chosen experts of each of the call's N tokens, most probable first."""
    probs: Tensor
    """(N, E) router softmax (differentiable: the balance loss's P_i)."""
    logits: Tensor
    """(N, E) router logits (differentiable: the z-loss)."""


class MoEFFN(nn.Module):
    """Top-k token-choice mixture of E SwiGLU experts (fused gate/up per expert)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from .blocks import gate_activation        # blocks imports this module lazily: no cycle
        self.act = gate_activation(cfg)
        E, h, d = cfg.moe_experts, cfg.moe_hidden, cfg.d_model
        self.n_experts, self.top_k, self.hidden = E, cfg.moe_top_k, h
        self.router = nn.Linear(d, E, bias=False)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * h, d))   # expert e: [gate; up] (2h, d)
        self.down = nn.Parameter(torch.empty(E, d, h))          # expert e: (d, h)
        self.trace: list[Routing] | None = None
        """Set to a list by the forward pass that collects routing (LoopedLM.forward); None = no record."""

    def forward(self, x: Tensor, ops=None) -> Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])                                     # (N, d)
        logits = self.router(xf).float()                                  # (N, E), fp32 under autocast too
        probs = logits.softmax(-1)
        w, experts = probs.topk(self.top_k, dim=-1)                       # (N, k)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        if self.trace is not None:
            self.trace.append(Routing(experts=experts, probs=probs, logits=logits))
        out = torch.zeros_like(xf)
        flat = experts.flatten()                                          # (N*k,) choice j of token n at n*k + j
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        tokens = order // self.top_k                                      # (N*k,) grouped by expert
        start = 0
        for e, n in enumerate(counts):                                    # only the tokens that chose e
            if n == 0:
                continue
            idx = order[start:start + n]
            rows = tokens[start:start + n]
            g, u = F.linear(xf[rows], self.gate_up[e]).chunk(2, dim=-1)   # (n, h) each
            y = F.linear(self.act(g) * u, self.down[e])                   # (n, d)
            out.index_add_(0, rows, y * w.flatten()[idx].unsqueeze(-1))
            start += n
        return out.view(shape)


def load_balance(choices: Tensor, probs: Tensor) -> Tensor:
    """Switch's load-balance loss n * sum_i f_i P_i over n options (experts, or a router's depths):
    f_i the share of `choices` (any shape, values 0..n-1) that went to i, P_i the mean of probs
    (..., n) for i. 1 when the choices and the probabilities are even; n when all go to one."""
    n = probs.shape[-1]
    f = torch.bincount(choices.flatten(), minlength=n).float() / choices.numel()      # (n,) no gradient
    return n * (f * probs.reshape(-1, n).mean(0)).sum()


def z_loss(logits: Tensor) -> Tensor:
    """Router z-loss: mean over rows of logsumexp(logits)^2 (keeps the logits small)."""
    return torch.logsumexp(logits, -1).pow(2).mean()


def moe_losses(records: list[Routing], n_experts: int) -> dict[str, Tensor]:
    """{"balance", "z"}: the two auxiliary losses averaged over `records` (every MoE call of a pass)."""
    return {"balance": torch.stack([load_balance(rec.experts, rec.probs) for rec in records]).mean(),
            "z": torch.stack([z_loss(rec.logits) for rec in records]).mean()}


def routing_stats(visits: list[Tensor], n_experts: int) -> dict:
    """Routing of one core layer over a pass: visits[r] = (N, k) experts of the same N tokens at
    visit r + 1. Per pair of consecutive visits, the share of tokens whose expert sets are
    identical, disjoint or partially overlapping (they sum to 1); over all visits, the number of
    distinct experts each token used (mean and histogram) and each visit's expert load."""
    pairs = []
    onehots = [F.one_hot(v, n_experts).sum(-2).clamp(max=1).bool() for v in visits]     # (N, E) sets
    for a, b in zip(onehots, onehots[1:]):
        common = (a & b).sum(-1)
        k = a.sum(-1)
        identical = (common == k) & (b.sum(-1) == k)
        disjoint = common == 0
        n = float(a.shape[0])
        pairs.append({"identical": identical.sum().item() / n, "disjoint": disjoint.sum().item() / n,
                      "partial": (~identical & ~disjoint).sum().item() / n})
    used = torch.stack(onehots).any(0).sum(-1)                                          # (N,)
    hist = torch.bincount(used, minlength=n_experts + 1)[1:].tolist()
    return {"consecutive_visits": pairs, "distinct_experts_mean": used.float().mean().item(),
            "distinct_experts_histogram": {str(i + 1): int(c) for i, c in enumerate(hist) if c},
            "load": [(torch.bincount(v.flatten(), minlength=n_experts).float() / v.numel()).tolist()
                     for v in visits]}
