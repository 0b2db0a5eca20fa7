"""The transformer block, written once: RoPE (optionally stretched), grouped-query attention (PyTorch SDPA)
with a head width of its own (optional q/k/v biases, QK-norm, softmax scale), a gated FFN (SwiGLU or
GeGLU), RMSNorm; pre-norm, sandwich norm or DeepLoop's scaled residual. The options beyond looplm's own
defaults are the pretrained families' details (Llama, Qwen2/3, Mistral, Gemma 3), so an imported model
runs on these same blocks (interop/hf_import.py).

Every product goes through an `Ops` backend: `EAGER` (plain PyTorch, autograd, any device) is the
reference; inference backends (inference/kernels.py) supply pre-laid-out weights for the same
products. Shapes: x (B, T, d); q (B, H, T, Dh); k, v (B, Hkv, T, Dh).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..recipe.config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> Tensor:
    """(Dh/2,) angular frequency of each rotated pair: base^(-2i/Dh), stretched by model.rope_scaling
    (a local block's tables: `dataclasses.replace(cfg, rope_base=local_rope_base, rope_scaling="none")`)."""
    inv = 1.0 / cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
    if cfg.rope_scaling == "linear":
        return inv / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        # Llama 3.1: wavelengths longer than original/low are stretched by the factor, those shorter
        # than original/high kept (they resolve nearby tokens), a linear blend in between
        wavelength = 2 * math.pi / inv
        blend = ((cfg.rope_original_context / wavelength - cfg.rope_low_freq_factor)
                 / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)).clamp(0, 1)
        return (1 - blend) * inv / cfg.rope_factor + blend * inv
    return inv


def rope_tables(cfg: ModelConfig, length: int) -> tuple[Tensor, Tensor]:
    """(L, Dh) cos and signed sin tables, each frequency twice, so that one multiply-add rotates
    every (x_i, x_{i+Dh/2}) pair: rope(x) = x * cos + swap_halves(x) * sin."""
    inv = rope_frequencies(cfg)
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

    tap: Any = None
    """None, or `tap(slot, x) -> x`: the residual stream after every block visit passes through it, named by
    the visit's cache slot (("prelude", 0, i), ("core", r, i), ("coda", r, i)); recirculation reads and replaces
    it there (inference/recirculation.py, under `tapping`). A tap with a `known(slot)` method may return a
    visit's output instead of the block computing it (None: compute), which then neither runs nor writes its
    cache entries. The model's own pieces are unchanged without one (`LoopedLM.visit`)."""

    def linear(self, x: Tensor, *weights: Tensor) -> Tensor:
        """x (..., in) @ [W1; W2; ...]^T -> (..., out1 + out2 + ...): weights that read the same input
        (q/k/v, gate/up) are one product."""
        return F.linear(x, weights[0] if len(weights) == 1 else torch.cat(weights))

    @contextmanager
    def tapping(self, tap: Any) -> Iterator[None]:
        """Run the block visits inside through `tap` (see `tap`); the previous one is restored after."""
        before, self.tap = self.tap, tap
        try:
            yield
        finally:
            self.tap = before


EAGER = Ops()


def rms_norm(norm: nn.RMSNorm, x: Tensor) -> Tensor:
    """What `norm(x)` computes, without a module call (blocks run thousands of times per decode)."""
    return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        bias = cfg.qkv_bias
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=bias)
        self.k = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.v = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.has_bias = bias      # a plain flag: `self.q.bias` is a Module attribute lookup, once per block visit
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        # every attention path (SDPA here, the caches' `sdpa`) uses SDPA's default 1/sqrt(Dh); another
        # scale is folded into the queries once, so no cache needs to know it
        self.q_scale = cfg.attn_scale * math.sqrt(cfg.head_dim) if cfg.attn_scale else 1.0
        self.local = False        # rotate with the local RoPE tables (model.local_blocks; set by LoopedLM)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: Any = None, slot: Any = None,
                ops: Ops = EAGER) -> Tensor:
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv, self.dh
        qkv = ops.linear(x, self.q.weight, self.k.weight, self.v.weight)
        if self.has_bias:
            qkv = qkv + torch.cat([self.q.bias, self.k.bias, self.v.bias])
        qkv = qkv.view(B, T, H + 2 * Hkv, Dh)
        qk = qkv[:, :, :H + Hkv]
        if self.q_norm is not None:                                            # per head, before RoPE
            qk = torch.cat([rms_norm(self.q_norm, qk[:, :, :H]), rms_norm(self.k_norm, qk[:, :, H:])], dim=2)
        qk = apply_rope(qk, *(rope[2:4] if self.local else rope[:2]))          # q and k rotated at once
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)      # (B, H, T, Dh), (B, Hkv, T, Dh)
        if self.q_scale != 1.0:
            q = q * self.q_scale
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


def gate_activation(cfg: ModelConfig):
    """The gated FFN's nonlinearity on its gate branch: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
    if cfg.activation == "gelu_tanh":
        return lambda g: F.gelu(g, approximate="tanh")
    return F.silu


class SwiGLU(nn.Module):
    """The gated FFN: down(act(gate(x)) * up(x)); act per model.activation (SwiGLU by default)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)
        self.act = gate_activation(cfg)

    def forward(self, x: Tensor, ops: Ops = EAGER) -> Tensor:
        g, u = ops.linear(x, self.gate.weight, self.up.weight).chunk(2, dim=-1)
        return ops.linear(self.act(g) * u, self.down.weight)


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
