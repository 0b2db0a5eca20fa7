"""The transformer block, written once: RoPE, grouped-query attention (PyTorch SDPA) with a head width of
its own, SwiGLU, RMSNorm; pre-norm, sandwich norm or DeepLoop's scaled residual.

Every product goes through an `Ops` backend: `EAGER` (plain PyTorch, autograd, any device) is the
reference; inference backends (inference/kernels.py) supply pre-laid-out weights for the same
products. Shapes: x (B, T, d); q (B, H, T, Dh); k, v (B, Hkv, T, Dh).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..recipe.config import ModelConfig


def rope_tables(head_dim: int, length: int, base: float) -> tuple[Tensor, Tensor]:
    """(L, Dh) cos and signed sin tables, each frequency twice, so that one multiply-add rotates
    every (x_i, x_{i+Dh/2}) pair: rope(x) = x * cos + swap_halves(x) * sin."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv)  # (L, Dh/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, T, heads, Dh); cos/sin: (T, 1, Dh) or (B, T, 1, Dh) from `LoopedLM.rope`. Rotates each
    pair (first half, second half) by its position's angle, in fp32 (under autocast too)."""
    x1, x2 = x.chunk(2, dim=-1)
    out = x.float() * cos + torch.cat([x2, x1], dim=-1).float() * sin
    return out.type_as(x)


class Ops:
    """How a block multiplies by its weights: the one seam between the block arithmetic (written once,
    below) and a backend. This eager reference is plain PyTorch — autograd, any device — and is what
    the tests compare every backend against; `kernels.PackedOps` overrides `linear` with pre-laid-out
    copies of the same weights for CPU decoding."""

    def linear(self, x: Tensor, *weights: Tensor) -> Tensor:
        """x (..., in) @ [W1; W2; ...]^T -> (..., out1 + out2 + ...): weights that read the same input
        (q/k/v, gate/up) are one product."""
        return F.linear(x, weights[0] if len(weights) == 1 else torch.cat(weights))


EAGER = Ops()


def rms_norm(norm: nn.RMSNorm, x: Tensor) -> Tensor:
    """What `norm(x)` computes, without a module call (blocks run thousands of times per decode)."""
    return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: Any = None, slot: Any = None,
                ops: Ops = EAGER) -> Tensor:
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv, self.dh
        qkv = ops.linear(x, self.q.weight, self.k.weight, self.v.weight).view(B, T, H + 2 * Hkv, Dh)
        qk = apply_rope(qkv[:, :, :H + Hkv], *rope)                            # q and k rotated at once
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)      # (B, H, T, Dh), (B, Hkv, T, Dh)
        v = qkv[:, :, H + Hkv:].transpose(1, 2)                                # (B, Hkv, T, Dh)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
        else:
            # The cache decides what this slot's queries see (its policy, the visibility rule) and
            # how they are grouped into sequences (a whole-sequence early-exit pass packs the tokens
            # still running into one row); it attends with `sdpa`.
            y = cache.attend(slot, q, k, v)                                    # (B, H, T, Dh)
        return ops.linear(y.transpose(1, 2).reshape(B, T, H * Dh), self.o.weight)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """q (B, H, T, Dh) attends to k, v (B, Hkv, S, Dh); mask broadcastable to (B, H, T, S), True = may
    attend, None = every key. The attention every cache runs (`KVCache.attend`)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def round_visibility(query_pos: Tensor, key_ran: Tensor | None, length: int) -> Tensor:
    """The visibility rule of one round's attention over whole sequences: query positions (..., W)
    and, under "mask", whether each of the `length` keys' tokens ran this round (..., length) bool
    (None: every key is there, copy-forward) -> (..., W, length) bool, True = may attend: causal,
    only keys whose token ran the round, and always the query itself (a row is never empty). Used
    by whole-sequence early exit (`SequenceKV`) and the routed training forward
    (`recursions.RoutedVisibility`); the decoder's cache (inference/cache.py) states the same rule per column."""
    keys = torch.arange(length, device=query_pos.device)
    pos = query_pos.unsqueeze(-1)
    seen = keys <= pos
    if key_ran is not None:
        seen = seen & key_ran.unsqueeze(-2)
    return seen | (keys == pos)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: Tensor, ops: Ops = EAGER) -> Tensor:
        g, u = ops.linear(x, self.gate.weight, self.up.weight).chunk(2, dim=-1)
        return ops.linear(F.silu(g) * u, self.down.weight)


class Block(nn.Module):
    """One transformer block; `alpha` scales the skip path (DeepLoop), 1 otherwise; moe: the FFN is a
    mixture of experts (model/moe.py, LoopMoE's core blocks)."""

    def __init__(self, cfg: ModelConfig, alpha: float = 1.0, moe: bool = False):
        super().__init__()
        self.mode = "deeploop" if cfg.residual_scaling == "deeploop" else cfg.norm
        self.alpha = alpha
        if moe:
            from .moe import MoEFFN
        self.attn, self.mlp = Attention(cfg), (MoEFFN(cfg) if moe else SwiGLU(cfg))
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        if self.mode == "sandwich":
            self.post1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
            self.post2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: Any = None, slot: Any = None,
                ops: Ops = EAGER) -> Tensor:
        # the branches' forward methods directly: a module call costs more than a decode step's small ops
        attn = lambda h: self.attn.forward(h, rope, cache, slot, ops)  # noqa: E731
        mlp = lambda h: self.mlp.forward(h, ops)                       # noqa: E731
        if self.mode == "deeploop":  # x <- norm(alpha*x + branch(x)), no inner norm
            x = rms_norm(self.norm1, self.alpha * x + attn(x))
            return rms_norm(self.norm2, self.alpha * x + mlp(x))
        if self.mode == "sandwich":
            x = x + rms_norm(self.post1, attn(rms_norm(self.norm1, x)))
            return x + rms_norm(self.post2, mlp(rms_norm(self.norm2, x)))
        x = x + attn(rms_norm(self.norm1, x))
        return x + mlp(rms_norm(self.norm2, x))
