"""The CPU decoding backend: the model's own blocks, with weights laid out for few-row products.

`PackedOps` is an `Ops` backend (model/looped.py): the block arithmetic is the model's, written once;
this file only changes how `linear` multiplies. Each product's weights (q/k/v together, o,
gate/up together, down, the head, the adapter) are kept in two extra layouts:

    one row      `row_weight`: (in, out) contiguous, or (P, in, out/P) slices, one per thread,
                 so a single row's product reads the matrix on every core (a bmm over slices)
    several rows oneDNN's packed layout (`packed_weight`), 2-3x faster than MKL at 2..256 rows

`mm` picks between them: the packed layout once a product has PACKED_MIN_MACS multiply-adds,
the one-row layout below (small models, a few rows). benchmarks/matmul_rows.py times each path
per matrix and row count (`--crossover` for the threshold). On other devices the backend keeps
one fused matrix per product and multiplies by its transposed view: no copies beyond the fusion.
The eager path (`model.EAGER`) stays the reference: parity is tested at 1e-5.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from ..model.blocks import Ops

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
    return tuple(t[keep] for t in rope) if rope[0].dim() == 4 else rope


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
    if w.device.type != "cpu":
        return w.t()                      # a view: the device's matmul reads the transpose as it is
    if w.dtype != torch.float32:          # bf16/fp16 on a CPU: oneDNN's own layout behind F.linear (`mm`), the
        return w                          # only fast path there (mm/bmm on copies: 10x slower without AMX)
    P = max(p for p in range(1, max(threads, 1) + 1) if out % p == 0)    # slices that divide the outputs
    if P < 2:
        return w.t().contiguous()
    return w.t().reshape(w.shape[1], P, out // P).transpose(0, 1).contiguous()


def mm(x: Tensor, w: _W) -> Tensor:
    """x (..., in) @ W^T -> (..., out). Several rows and at least PACKED_MIN_MACS multiply-adds:
    oneDNN's packed weights (2-3x faster than MKL's sgemm for 2..256 rows on CPU); otherwise a
    plain mm on the (in, out) copy, or a bmm over its per-thread slices (their outputs, laid end
    to end, are each row's outputs in order)."""
    wr, packed = w
    x2 = x.reshape(-1, x.shape[-1])
    if wr.device.type == "cpu" and wr.dtype != torch.float32:     # (out, in) as it is: see row_weight
        return torch.nn.functional.linear(x2, wr).reshape(*x.shape[:-1], -1)
    if wr.device.type == "cpu" and (x2.dtype != torch.float32 or torch.is_autocast_enabled("cpu")):
        # under bf16 autocast (or rows in bf16) against these fp32 layouts: the product in fp32 on the fast paths
        # below, autocast off (it would cast every weight matrix to bf16 at every call: decoding 8x slower);
        # `--dtype bf16` is the way to decode from bf16 weights
        with torch.autocast("cpu", enabled=False):
            return mm(x2.float(), w).to(x2.dtype).reshape(*x.shape[:-1], -1)
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


class PackedOps(Ops):
    """`Ops` with every product's weights pre-laid-out (see the module docstring): the model's blocks,
    run through `model.encode/core_step/readout(..., ops=this)`, with fewer, faster products. The
    layouts are copies, rebuilt when a parameter changes in place or the thread count changes
    (`stale`); inference only (no autograd through the copies)."""

    def __init__(self, model: Any):
        self.m = model
        self._params = list(model.parameters())
        self._versions = [p._version for p in self._params]
        self.threads = torch.get_num_threads()
        self.table: dict[tuple[int, ...], _W] = {}
        # one-column rounds run through these kernels and the rows they held (decode steps: `looplm bench serve`'s
        # mean recurrent batch is rows / rounds, counted where the rounds run)
        self.column_rounds, self.column_round_rows = 0, 0
        with torch.no_grad():
            for group in self.weight_groups(model):
                w = torch.cat([g.detach() for g in group]) if len(group) > 1 else group[0].detach()
                self.table[tuple(id(g) for g in group)] = (row_weight(w, self.threads), packed_weight(w))

    @staticmethod
    def weight_groups(model: Any) -> list[tuple[Tensor, ...]]:
        """The weights each `linear` call of the model's blocks passes, in the same groups."""
        groups: list[tuple[Tensor, ...]] = [(model.head.weight,)]
        if model.adapter is not None:
            groups.append((model.adapter.weight,))
        for blk in [*model.prelude, *model.core, *model.coda]:
            a, f = blk.attn, blk.mlp
            groups += [(a.q.weight, a.k.weight, a.v.weight), (a.o.weight,)]
            if hasattr(f, "gate"):          # dense SwiGLU; an MoE FFN multiplies its experts itself
                groups += [(f.gate.weight, f.up.weight), (f.down.weight,)]
        return groups

    def linear(self, x: Tensor, *weights: Tensor) -> Tensor:
        w = self.table.get(tuple(map(id, weights)))
        return super().linear(x, *weights) if w is None else mm(x, w)

    def stale(self) -> bool:
        """A parameter was modified in place (an optimizer step, load_state_dict) or replaced, or
        the number of torch threads changed (the one-row layout depends on it)."""
        now = list(self.m.parameters())
        return (self.threads != torch.get_num_threads() or len(now) != len(self._params)
                or any(p is not q for p, q in zip(now, self._params))
                or any(p._version != v for p, v in zip(self._params, self._versions)))

    # The engine's chunk calls: the model's own pieces, through this backend.
    def rope(self, start: int, T: int, positions: Tensor | None) -> tuple[Tensor, Tensor]:
        return self.m.rope(start, T, positions)

    def core_step(self, s: Tensor, e: Tensor, r: int | Tensor, rope: tuple[Tensor, Tensor], cache: Any) -> Tensor:
        self._count(s)
        return self.m.core_step(s, e, r, rope, cache, self)

    def routed_step(self, s: Tensor, e: Tensor, r: int, rope: tuple[Tensor, Tensor], cache: Any,
                    weight: Tensor) -> Tensor:
        self._count(s)
        return self.m.routed_step(s, e, r, rope, cache, weight, self)

    def _count(self, s: Tensor) -> None:
        if s.shape[1] == 1:
            self.column_rounds += 1
            self.column_round_rows += s.shape[0]

    def readout(self, s: Tensor, rope: tuple[Tensor, Tensor], cache: Any, r: int, all_positions: bool,
                tops: dict[int, Tensor] | None = None, head: bool = True) -> Tensor | None:
        """Coda, final norm and head; the head on the last column unless all_positions (tops: gets the
        normed top states, as model.readout; head=False: the coda only)."""
        return self.m.readout(s, rope, cache, r, self, last_only=not all_positions, tops=tops, head=head)
