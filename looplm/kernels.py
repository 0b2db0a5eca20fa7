"""Fused CPU kernels for cached chunks: the model's forward pass without module calls.

`Kernels` computes exactly what LoopedLM's blocks compute (parity with `model(idx)` is tested at
1e-5), shaped for decoding one column at a time. Each weight matrix is kept in two extra layouts:

    one row      `row_weight`: (in, out) contiguous, or (P, in, out/P) slices, one per thread,
                 so a single row's product reads the matrix on every core (a bmm over slices)
    several rows oneDNN's packed layout (`packed_weight`), 2-3x faster than MKL at 2..256 rows

`mm` picks between them: the packed layout once a product has PACKED_MIN_MACS multiply-adds,
the one-row layout below (small models, a few rows). benchmarks/matmul_rows.py times each path
per matrix and row count (`--crossover` for the threshold).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

PRIMITIVE_CACHE = 128
"""Entries in each of oneDNN's two primitive caches (its own and PyTorch's ideep LRU). oneDNN
keeps every primitive it creates, one per matrix and row count (~0.5 MB for bench-s's matrices
with both caches), in caches of 1024 by default; a server meets a new row count with nearly
every prefill, so `benchmarks/serve_soak.py` saw its memory grow by ~330 MB over 6,000
requests. 128 keep the decode steps' shapes and the recurring prefill chunks' (a miss costs
~1 ms). Set here, before oneDNN first runs in the process, which reads them once; a user's own
`ONEDNN_PRIMITIVE_CACHE_CAPACITY` / `LRU_CACHE_CAPACITY` win."""
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE))
os.environ.setdefault("LRU_CACHE_CAPACITY", str(PRIMITIVE_CACHE))


def rope_rows(rope: Any, keep: Tensor) -> Any:
    """RoPE tables for a subset of rows (shared (T, 1, Dh) tables need no indexing)."""
    cos, sin = rope
    return (cos[keep], sin[keep]) if cos.dim() == 4 else rope


def packed_weight(w: Tensor) -> Tensor | None:
    """W (out, in) in oneDNN's blocked layout (CPU fp32), or None where that is unavailable."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        x = torch.zeros(2, w.shape[1])
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")    # the op works here
        return packed
    except (AttributeError, RuntimeError):
        return None


_W = tuple[Tensor, Tensor | None]    # a matrix for one row (see row_weight) and oneDNN-packed W or None

PACKED_MIN_MACS = 1 << 20
"""Several-row products smaller than this (rows x in x out multiply-adds) use the one-row layout:
oneDNN's packed path costs ~13 us a call whatever the size, a bmm over per-thread slices less
than that below about a million multiply-adds (`python benchmarks/matmul_rows.py --crossover`).
A fixed rule, not a timing, so the same shapes always take the same path (the same numbers)."""


def row_weight(w: Tensor, threads: int) -> Tensor:
    """W (out, in) laid out for one-row products: (in, out) contiguous, or with several threads
    (P, in, out/P) contiguous, one slice of the outputs per thread (P: the most slices, up to the
    thread count, that divide the outputs). A single-row product is bound by reading W; one
    `torch.mm` of a row reads it on one thread, while a `bmm` over P slices reads it on P threads
    (batch-1 decode steps about 1.4x faster with 2 threads on the bench machine)."""
    out = w.shape[0]
    P = max(p for p in range(1, max(threads, 1) + 1) if out % p == 0)    # slices that divide the outputs
    if P < 2 or w.device.type != "cpu":
        return w.t().contiguous()
    return w.t().reshape(w.shape[1], P, out // P).transpose(0, 1).contiguous()


def mm(x: Tensor, w: _W) -> Tensor:
    """x (..., in) @ W^T -> (..., out). Several rows and at least PACKED_MIN_MACS multiply-adds:
    oneDNN's packed weights (2-3x faster than MKL's sgemm for 2..256 rows on CPU); otherwise a
    plain mm on the (in, out) copy, or a bmm over its per-thread slices (their outputs, laid end
    to end, are each row's outputs in order)."""
    wr, packed = w
    x2 = x.reshape(-1, x.shape[-1])
    if packed is not None and x2.shape[0] > 1 and x2.shape[0] * wr.numel() >= PACKED_MIN_MACS:
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, None, "none", [], "")
    elif wr.dim() == 3:
        P = wr.shape[0]
        if x2.shape[0] == 1:
            y = torch.bmm(x2.expand(P, 1, x2.shape[1]), wr)                    # (P, 1, out/P)
        else:
            y = torch.bmm(x2.expand(P, *x2.shape), wr).transpose(0, 1)          # (rows, P, out/P)
    else:
        y = torch.mm(x2, wr)
    return y.reshape(*x.shape[:-1], -1)


class Kernels:
    """The model's forward pass for cached chunks, with fewer, fused operations.

    q/k/v and gate/up are one matmul each, RoPE rotates q and k together with precomputed
    (cos, cos) / (-sin, sin) tables, and there are no module calls. The weight layouts (see the
    module docstring) are two more copies of every matrix, rebuilt when a parameter changes in
    place or the thread count changes (`stale`).
    """

    def __init__(self, model: Any):
        self.m, cfg = model, model.cfg
        self.H, self.Hkv, self.Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.gqa = self.H != self.Hkv
        self._params = list(model.parameters())
        self._versions = [p._version for p in self._params]
        self.threads = torch.get_num_threads()
        with torch.no_grad():
            def t(*ws: Tensor) -> tuple[Tensor, Tensor | None]:
                w = torch.cat(ws)
                return row_weight(w, self.threads), packed_weight(w)

            def fuse(blk: Any) -> tuple:
                a, f = blk.attn, blk.mlp
                norms = (blk.norm1, blk.norm2) + ((blk.post1, blk.post2) if blk.mode == "sandwich" else ())
                return (blk.mode, blk.alpha, t(a.q.weight, a.k.weight, a.v.weight), t(a.o.weight),
                        t(f.gate.weight, f.up.weight), t(f.down.weight), [(n.weight.detach(), n.eps) for n in norms])
            self.prelude = [fuse(b) for b in model.prelude]
            self.core = [fuse(b) for b in model.core]
            self.coda = [fuse(b) for b in model.coda]
            self.head = t(model.head.weight)                                      # (d, V)
            self.cos2 = torch.cat([model.rope_cos, model.rope_cos], -1)           # (L, Dh)
            self.sin2 = torch.cat([-model.rope_sin, model.rope_sin], -1)

    def stale(self) -> bool:
        """A parameter was modified in place (an optimizer step, load_state_dict) or replaced, or
        the number of torch threads changed (the one-row layout depends on it)."""
        now = list(self.m.parameters())
        return (self.threads != torch.get_num_threads() or len(now) != len(self._params)
                or any(p is not q for p, q in zip(now, self._params))
                or any(p._version != v for p, v in zip(self._params, self._versions)))

    def rope(self, start: int, T: int, positions: Tensor | None) -> tuple[Tensor, Tensor]:
        """(T, 1, Dh) tables, or (B, T, 1, Dh) with per-row positions, for (B, T, heads, Dh) tensors."""
        if positions is None:
            return self.cos2[start:start + T, None], self.sin2[start:start + T, None]
        return self.cos2[positions].unsqueeze(2), self.sin2[positions].unsqueeze(2)

    def block(self, w: tuple, x: Tensor, rope: tuple[Tensor, Tensor], cache: Any, slot: tuple) -> Tensor:
        """Block.forward: pre-norm, sandwich or DeepLoop residuals around attention and SwiGLU."""
        mode, alpha, wqkv, wo, wgu, wd, norms = w
        d = (x.shape[-1],)
        if mode == "deeploop":
            x = F.rms_norm(alpha * x + self.attn(x, wqkv, wo, rope, cache, slot), d, *norms[0])
            return F.rms_norm(alpha * x + self.mlp(x, wgu, wd), d, *norms[1])
        if mode == "sandwich":
            x = x + F.rms_norm(self.attn(F.rms_norm(x, d, *norms[0]), wqkv, wo, rope, cache, slot), d, *norms[2])
            return x + F.rms_norm(self.mlp(F.rms_norm(x, d, *norms[1]), wgu, wd), d, *norms[3])
        x = x + self.attn(F.rms_norm(x, d, *norms[0]), wqkv, wo, rope, cache, slot)
        return x + self.mlp(F.rms_norm(x, d, *norms[1]), wgu, wd)

    def attn(self, x: Tensor, wqkv: "_W", wo: "_W", rope: tuple[Tensor, Tensor], cache: Any,
             slot: tuple) -> Tensor:
        B, T, _ = x.shape
        H, Hkv, Dh = self.H, self.Hkv, self.Dh
        qkv = mm(x, wqkv).view(B, T, H + 2 * Hkv, Dh)
        qk, v = qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]
        cos, sin = rope
        x1, x2 = qk.chunk(2, dim=-1)
        qk = qk * cos + torch.cat([x2, x1], dim=-1) * sin                       # RoPE on q and k at once
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)      # (B, H, T, Dh), (B, Hkv, T, Dh)
        k, v, mask = cache.update(slot, k, v.transpose(1, 2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa)
        return mm(y.transpose(1, 2).reshape(B, T, H * Dh), wo)

    @staticmethod
    def mlp(x: Tensor, wgu: "_W", wd: "_W") -> Tensor:
        g, u = mm(x, wgu).chunk(2, dim=-1)
        return mm(F.silu(g) * u, wd)

    def encode(self, idx: Tensor, rope: tuple[Tensor, Tensor], cache: Any) -> Tensor:
        x = self.m.embed(idx)
        for i, w in enumerate(self.prelude):
            x = self.block(w, x, rope, cache, ("prelude", 0, i))
        return x

    def core_step(self, s: Tensor, e: Tensor, r: int, rope: tuple[Tensor, Tensor], cache: Any) -> Tensor:
        """LoopedLM.core_step: inject, the core blocks (round r's own if untied), state norm."""
        m = self.m
        K = m.cfg.n_core
        blocks = self.core[(r - 1) * K: r * K] if m.cfg.untied else self.core
        x = m.inject(s, e)
        for i, w in enumerate(blocks):
            x = self.block(w, x, rope, cache, ("core", r, i))
        return m.state_norm(x) if m.state_norm is not None else x

    def readout(self, s: Tensor, rope: tuple[Tensor, Tensor], cache: Any, r: int, all_positions: bool) -> Tensor:
        """LoopedLM.readout (coda, final norm, head); the head on the last column unless all_positions."""
        for i, w in enumerate(self.coda):
            s = self.block(w, s, rope, cache, ("coda", r, i))
        return mm(self.m.final_norm(s if all_positions else s[:, -1]), self.head)
