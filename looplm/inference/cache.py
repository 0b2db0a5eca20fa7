"""Static key/value cache for looped models: one slot per (round, core block), plus prelude and coda.

A looped model attends at every round, so a cached decoder needs keys/values per round: the
core block i at round r reads the history written by core block i at round r (Ouro's "one
slot per (loop, layer)"). This module preallocates that storage once, so decoding writes into
it in place and reads views of it; nothing is allocated per token on the common path.

Layout (B rows, L columns, H kv-heads of width Dh; columns are shared by all rows, so a batch of
prompts of different lengths is left-padded and each row keeps its own `pad`, the first column
that belongs to it):

    prelude  (n_prelude, B, H, L, Dh)        written once per token
    core     (S, n_core, B, H, L, Dh)        S = rounds ("full" anywhere) or 1 (shared policies)
    coda     (n_coda, B, H, L, Dh)           the token's final readout; last write wins

Cache policies say what a finished token leaves behind for later tokens, separately for the
prompt (prefill) and for generated tokens (decode):

    full     its own keys/values at every round (exact; the reference)
    first    round 1's keys/values serve every round
    last     the keys/values of the last round it ran serve every round
    average  the mean over the rounds it ran serves every round

Inside one chunk (the whole prompt at prefill, one token at decode) attention is always exact:
at round r the chunk's queries see the chunk's own round-r keys. Only the history differs. With
shared policies on both sides the core cache is 1/R of `full` (`nbytes()` reports it).

Missing entries. Under `full`, a token that exited early (per-token exit policies) has no entry
at the rounds it skipped, yet later tokens run those rounds. `missing` is a recorded choice:

    copy_forward   its latest computed round's entry (same core block) serves later rounds
                   (Huginn's latest-m4 lookup); copied once, when the token finishes
    mask           later rounds leave it out of attention (Huginn's skip)

The choice is fixed at construction and never changed silently.

Mixture-of-Recursions plugs in at the same place: its recursion-wise caching is `full` (each
recursion keeps its own entries, tokens routed out leave holes handled as above) and its
recursive sharing is `first` (the first recursion's entries serve every later one).

The seam with the model is `KVCache` (a typing.Protocol): the model's attention calls
`attend(slot, q, k, v) -> y` and nothing else; `LoopKVCache` here (the decoder's) and
`inference.early_exit.SequenceKV` (whole-sequence early exit) implement it. The chunk
protocol of `LoopKVCache` on top: `begin(start, T, phase, rows)` before a chunk (the rows it holds,
default all: finished rows are left out, and a new prompt can take a finished row's place after
`set_pad`), the model's attention calls `attend`, which writes through `update(slot, k, v) ->
(k_all, v_all, mask)` and attends to what it returns,
`select(rows)` restricts the following updates to a subset of rows (rows that exited stop
computing), and `commit(rounds_used)` closes the chunk (copy-forward or depth bookkeeping,
first/average reduction) for the chunk's rows only. `truncate(filled)` rolls back (speculative
decoding): the columns from `filled` on hold entries of tokens that were rejected, and a chunk
that would read them before they are written again is refused (`begin` raises).

Rows at their own columns and rounds (continuous depth batching, inference/depth.py): `RowColumns`
is a `KVCache` over the same storage for one column per row, where each row writes and reads at its
own column and its core visits at its own round; `finish_rows` is its `commit` (copy-forward, mask
depths, shared-policy reductions), row by row, when a row's token leaves the loop.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..errors import UserError
from ..model.blocks import sdpa

POLICIES = ("full", "first", "last", "average")
MISSING = ("copy_forward", "mask")


@runtime_checkable
class KVCache(Protocol):
    """What a looped model's attention needs from a key/value cache (`Attention.forward` in
    model/blocks.py, the one attention every backend runs, calls exactly this).

    slot: ("prelude", 0, i), ("core", r, i) or ("coda", r, i): block i of that stack at round
    r. q (B', H, T, Dh), k, v (B', Hkv, T, Dh): the block's queries and the keys/values it
    computed for them (RoPE applied). The cache stores k/v and returns the attention output
    (B', H, T, Dh), computed with `blocks.sdpa`: it decides what earlier positions look like
    (its policy, the visibility rule for tokens that stopped) and, for a whole-sequence pass
    over a subset of tokens, how the queries group into sequences. `LoopKVCache.update`
    (write, then return k_all, v_all, mask) is the decoder's half of that.
    """

    def attend(self, slot: tuple[str, int, int], q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ...


def check_policy(policy: str, name: str) -> str:
    if policy not in POLICIES:
        raise UserError(f"{name} {policy!r}: expected one of {', '.join(POLICIES)}")
    return policy


class LoopKVCache:
    """Preallocated per-round key/value storage for `LoopedLM`, a `KVCache` (see the module docstring)."""

    def __init__(self, cfg: Any, *, batch: int, length: int, rounds: int, prefill: str = "full",
                 decode: str = "full", missing: str = "copy_forward", pad: Tensor | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        check_policy(prefill, "prefill cache policy")
        check_policy(decode, "decode cache policy")
        if missing not in MISSING:
            raise UserError(f"missing-entry handling {missing!r}: expected one of {', '.join(MISSING)}")
        if rounds < 1 or batch < 1 or length < 1:
            raise ValueError(f"cache needs rounds, batch and length >= 1, got {rounds}, {batch}, {length}")
        self.batch, self.length, self.rounds = batch, length, rounds
        self.policies = {"prefill": prefill, "decode": decode}
        self.missing = missing
        self.per_round = "full" in (prefill, decode)
        H, Dh = cfg.n_kv_heads, cfg.head_dim
        shape = (batch, H, length, Dh)
        S = rounds if self.per_round else 1

        def alloc(*lead: int) -> Tensor:
            return torch.zeros(*lead, *shape, dtype=dtype, device=device)

        self.k_prelude, self.v_prelude = alloc(cfg.n_prelude), alloc(cfg.n_prelude)
        self.k_core, self.v_core = alloc(S, cfg.n_core), alloc(S, cfg.n_core)
        self.k_coda, self.v_coda = alloc(cfg.n_coda), alloc(cfg.n_coda)
        # slot -> (k, v) views of shape (B, H, L, Dh); the coda slot ignores the round it was read at
        self._views: dict[tuple, tuple[Tensor, Tensor]] = {}
        for i in range(cfg.n_prelude):
            self._views[("prelude", 0, i)] = (self.k_prelude[i], self.v_prelude[i])
        for r in range(rounds + 1):
            for i in range(cfg.n_coda):
                self._views[("coda", r, i)] = (self.k_coda[i], self.v_coda[i])
        for r in range(1, rounds + 1):
            for i in range(cfg.n_core):
                s = r - 1 if self.per_round else 0
                self._views[("core", r, i)] = (self.k_core[s, i], self.v_core[s, i])
        self.n_core = cfg.n_core
        # first column of each row (left padding); pad columns are never attended to by real tokens
        self.pad = torch.zeros(batch, dtype=torch.long, device=device) if pad is None else pad.to(device)
        self._pads = self.pad.tolist()
        self.chunk_padded = any(self._pads)  # whether the current chunk's rows have pad columns
        cols = torch.arange(length, device=device)
        self._valid = (cols[None, :] >= self.pad[:, None]).view(batch, 1, 1, length)   # (B, 1, 1, L)
        # rounds each column's token ran (mask mode only); "in progress" columns count as all rounds
        self.depth = torch.full((batch, length), rounds, dtype=torch.long, device=device)
        self._holes = False
        self.filled = 0                      # columns committed so far
        self.written = 0                     # columns [0, written) hold current entries (truncate lowers it)
        self._start, self._T, self._phase = 0, 0, "prefill"
        self._rows: Tensor | slice | None = None
        self._chunk_rows: list[int] | None = None
        self._base_mask: Tensor | None = None
        self._round_masks: dict[int, Tensor | None] = {}
        self._stash: dict[int, tuple[Tensor, Tensor]] = {}
        self._row_stash: tuple[Tensor, Tensor] | None = None     # RowColumns' shared-policy stash, (B, K, H, Dh)

    # -- accounting -----------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        """Bytes held, by part (the core part is what the policies shrink)."""
        def n(*ts: Tensor) -> int:
            return sum(t.numel() * t.element_size() for t in ts)
        out = {"prelude": n(self.k_prelude, self.v_prelude), "core": n(self.k_core, self.v_core),
               "coda": n(self.k_coda, self.v_coda)}
        out["total"] = sum(out.values())
        return out

    # -- the chunk protocol ---------------------------------------------------------------
    def begin(self, start: int, T: int, phase: str = "decode", rows: Tensor | None = None) -> None:
        """The next updates write columns [start, start+T) for the prompt ("prefill") or generated
        tokens, of these rows (None = all); other rows' entries are left as they are."""
        if start < 0 or start + T > self.length:
            raise ValueError(f"cache holds {self.length} columns; asked to write {start}..{start + T - 1}")
        if start > self.written:
            # its queries would attend to columns written..start-1: entries a truncation gave up
            # (rejected drafts) or never written; refuse rather than read them
            raise RuntimeError(f"cache chunk at column {start} would read columns {self.written}..{start - 1}, "
                               f"which hold no current entries (truncated or never written)")
        self.written = max(self.written, start + T)
        self._start, self._T, self._phase = start, T, phase
        self._rows = _index(rows)
        self._chunk_rows = None if rows is None else rows.tolist()
        self.chunk_padded = any(self._pads[b] for b in (range(self.batch) if rows is None else self._chunk_rows))
        self._round_masks = {}
        self._stash = {}
        if self.missing == "mask":
            self.depth[self._all(rows), start:start + T] = self.rounds
        if T == 1:
            self._base_mask = self._valid[..., :start + 1] if self.chunk_padded else None
        else:
            q = torch.arange(start, start + T, device=self.pad.device)
            kcols = torch.arange(start + T, device=self.pad.device)
            causal = kcols[None, :] <= q[:, None]                              # (T, start+T)
            mask = causal & self._valid[..., :start + T]                       # (B, 1, T, start+T)
            # A pad query sees only itself: never an empty row (an all-masked softmax gives NaN).
            mask = mask | (kcols[None, :] == q[:, None])
            self._base_mask = mask

    def select(self, rows: Tensor | None) -> None:
        """Restrict following updates to these rows (None = all); rows that exited stop computing."""
        self._rows = _index(rows)
        self._round_masks = {}

    @staticmethod
    def _all(rows: Tensor | None) -> Any:
        return slice(None) if rows is None else rows

    def set_pad(self, row: int, pad: int) -> None:
        """Row `row` now starts at column `pad` (a new prompt placed in a finished row's place);
        it never attends to the columns before."""
        self.pad[row] = pad
        self._pads[row] = pad
        self._valid[row] = (torch.arange(self.length, device=self.pad.device) >= pad).view(1, 1, -1)

    def _mask(self, kind: str, r: int) -> Tensor | None:
        if kind != "core" or not self._holes:
            base = self._base_mask
            return base if base is None or self._rows is None else base[self._rows]
        if r not in self._round_masks:
            end = self._start + self._T
            ok = (self.depth[:, :end] >= r).view(self.batch, 1, 1, end)
            base = self._base_mask
            # the chunk's own columns count as all rounds (begin), so no query row ends up empty
            m = ok if base is None else base & ok
            self._round_masks[r] = m if self._rows is None else m[self._rows]
        return self._round_masks[r]

    def attend(self, slot: tuple, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """`KVCache.attend`: write k/v, then q attends to what `update` returns."""
        return sdpa(q, *self.update(slot, k, v))

    def update(self, slot: tuple, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Write this chunk's k/v (B', H, T, Dh) for `slot`; return what its queries attend to."""
        try:
            kb, vb = self._views[slot]
        except KeyError:
            raise ValueError(f"cache has no slot {slot} (allocated for {self.rounds} rounds)") from None
        s, e = self._start, self._start + self._T
        rows = self._rows
        if rows is None:
            kb[:, :, s:e] = k
            vb[:, :, s:e] = v
            k_all, v_all = kb[:, :, :e], vb[:, :, :e]
        else:
            kb[rows, :, s:e] = k
            vb[rows, :, s:e] = v
            k_all, v_all = kb[rows, :, :e], vb[rows, :, :e]
        kind, r, i = slot
        if kind == "core" and not self.per_round:
            self._stash_update(r, i, k, v)
        return k_all, v_all, self._mask(kind, r)

    def _stash_update(self, r: int, i: int, k: Tensor, v: Tensor) -> None:
        """Shared layout: remember round 1 ("first") or the running sum ("average") of this chunk."""
        policy = self.policies[self._phase]
        if policy not in ("first", "average"):
            return
        if i not in self._stash:
            shape = (self.batch, k.shape[1], self._T, k.shape[3])
            self._stash[i] = (torch.zeros(shape, dtype=k.dtype, device=k.device),
                              torch.zeros(shape, dtype=k.dtype, device=k.device))
        sk, sv = self._stash[i]
        rows = slice(None) if self._rows is None else self._rows
        if r == 1:
            sk[rows] = k
            sv[rows] = v
        elif policy == "average":
            sk[rows] += k
            sv[rows] += v

    def commit(self, rounds_used: Tensor | int) -> None:
        """Close the chunk. rounds_used: int or (B,) rounds each row's chunk tokens ran (only the
        chunk's rows, those given to `begin`, are read and filled)."""
        self._rows = None
        s, e, B = self._start, self._start + self._T, self.batch
        R = self.rounds
        policy = self.policies[self._phase]
        self.filled = max(self.filled, e)
        if isinstance(rounds_used, int) and rounds_used == R and policy == "full":
            return    # the common case: every slot was written (and begin() set the depth), nothing to fill
        ru = torch.full((B,), int(rounds_used)) if isinstance(rounds_used, int) else rounds_used.cpu()
        groups = self._row_groups(ru, self._chunk_rows)
        if self.per_round:
            for part in (self.k_core, self.v_core):
                if policy == "full":
                    if self.missing == "copy_forward":
                        for b, n in groups:
                            if n < R:  # rounds n+1..R read round n's entry
                                part[n:, :, b, :, s:e] = part[n - 1, :, b, :, s:e].unsqueeze(0)
                else:
                    for b, n in groups:
                        part[:, :, b, :, s:e] = self._reduce(part[:n, :, b, :, s:e], policy).unsqueeze(0)
            if policy == "full" and self.missing == "mask":
                for b, n in groups:
                    self.depth[b, s:e] = n
                self._holes = self._holes or any(n < R for _, n in groups)
        elif policy in ("first", "average"):
            for i, (sk, sv) in self._stash.items():
                if policy == "average":
                    div = ru.to(sk.device, sk.dtype).view(B, 1, 1, 1)
                    sk, sv = sk / div, sv / div
                for b, _ in groups:
                    self.k_core[0, i, b, :, s:e] = sk[b]
                    self.v_core[0, i, b, :, s:e] = sv[b]
        self._stash = {}

    @staticmethod
    def _row_groups(ru: Tensor, rows: list[int] | None) -> list[tuple[Any, int]]:
        """(row index or slice, rounds) pairs for the chunk's rows (None = all): one group when
        they all ran the same rounds."""
        n = ru.tolist()
        if rows is None and all(x == n[0] for x in n):
            return [(slice(None), n[0])]
        return [(b, n[b]) for b in (range(len(n)) if rows is None else rows)]

    @staticmethod
    def _reduce(per_round: Tensor, policy: str) -> Tensor:
        """(n, ...) entries of the rounds a token ran -> the one entry its policy keeps."""
        if policy == "first":
            return per_round[0]
        if policy == "last":
            return per_round[-1]
        return per_round.mean(0)

    # -- rows at their own columns (RowColumns) ---------------------------------------------------
    def start_rows(self, rows: Tensor, cols: Tensor) -> None:
        """Rows `rows` (M,) begin a token at their columns `cols` (M,) (decode phase): the column counts as
        every round until `finish_rows` says how many it ran."""
        self.written = max(self.written, int(cols.max()) + 1)
        self.filled = max(self.filled, int(cols.max()) + 1)
        self.depth[rows, cols] = self.rounds

    def row_stash(self, i: int, rows: Tensor, rounds: Tensor, k: Tensor, v: Tensor) -> None:
        """Shared layout: core block i's round-1 entry (first) or running sum (average) per row, k, v (M, H, Dh)."""
        policy = self.policies["decode"]
        if policy not in ("first", "average"):
            return
        if self._row_stash is None:
            shape = (self.batch, self.n_core, *k.shape[1:])
            self._row_stash = (torch.zeros(shape, dtype=k.dtype, device=k.device),
                               torch.zeros(shape, dtype=k.dtype, device=k.device))
        sk, sv = self._row_stash
        first = rounds == 1
        sk[rows[first], i], sv[rows[first], i] = k[first], v[first]
        if policy == "average":
            later = ~first
            sk[rows[later], i] += k[later]
            sv[rows[later], i] += v[later]

    def finish_rows(self, rows: list[int], cols: list[int], used: list[int]) -> None:
        """Rows' tokens at their columns left the loop after `used` rounds each: what `commit` does for a
        chunk, per row (decode policy): copy-forward or the mask depth under full, the kept entry otherwise."""
        R, policy = self.rounds, self.policies["decode"]
        for b, c, n in zip(rows, cols, used):
            if self.per_round:
                for part in (self.k_core, self.v_core):
                    if policy == "full":
                        if self.missing == "copy_forward" and n < R:
                            part[n:, :, b, :, c] = part[n - 1, :, b, :, c].unsqueeze(0)
                    else:
                        part[:, :, b, :, c] = self._reduce(part[:n, :, b, :, c], policy).unsqueeze(0)
                if policy == "full" and self.missing == "mask":
                    self.depth[b, c] = n
                    self._holes = self._holes or n < R
            elif policy in ("first", "average"):
                sk, sv = self._row_stash
                div = 1.0 if policy == "first" else float(n)
                self.k_core[0, :, b, :, c] = sk[b] / div
                self.v_core[0, :, b, :, c] = sv[b] / div

    def reorder(self, order: Tensor) -> None:
        """Row b now holds what row order[b] held (a permutation of the rows: the batch compacts its
        running rows, inference/batch.py). In place, so the slots' views stay the storage's."""
        order = order.to(self.pad.device)
        for t in (self.k_prelude, self.v_prelude, self.k_coda, self.v_coda):       # (n, B, H, L, Dh)
            t.copy_(t[:, order])
        for t in (self.k_core, self.v_core):                                       # (S, K, B, H, L, Dh)
            t.copy_(t[:, :, order])
        for t in (self.pad, self._valid, self.depth):                              # (B,), (B, 1, 1, L), (B, L)
            t.copy_(t[order])
        self._pads = self.pad.tolist()

    def truncate(self, filled: int) -> None:
        """Forget columns from `filled` on (speculative rollback): no later chunk may read them
        until a chunk writes them again (`begin` refuses one that starts past `filled`)."""
        if not 0 <= filled <= self.length:
            raise ValueError(f"truncate to {filled} outside 0..{self.length}")
        self.filled = min(self.filled, filled)
        self.written = min(self.written, filled)


class RowColumns:
    """A `KVCache` for one column per row, each row at its own column and round (continuous depth batching).

    rows (M,) cache rows, cols (M,) the column each row's token occupies, rounds (M,) the round each
    row's core visits run (None: a prelude or coda pass). A visit writes row m's k/v at (rows[m],
    cols[m]) of its slot (core: the row's own round's slot under a per-round layout, the one shared
    slot otherwise) and row m attends to its columns pad..cols[m] of that slot; under `missing = mask`
    columns whose token stopped before the row's round are left out (the token's own column counts as
    every round). The history a row reads is exactly what a one-column `begin`/`update` chunk of that
    row alone reads, so a row's result does not depend on which rows, rounds or columns share its step.
    Reading gathers each row's history (a copy of (M, H, max col + 1, Dh) per visit), the price of
    rows at different rounds and columns in one product."""

    def __init__(self, cache: LoopKVCache, rows: Tensor, cols: Tensor, rounds: Tensor | None = None):
        self.c, self.rows, self.cols, self.rounds = cache, rows, cols, rounds
        M, E = rows.shape[0], int(cols.max()) + 1
        kcols = torch.arange(E, device=cols.device)
        self.E = E
        self.mask = (cache._valid[rows, ..., :E] & (kcols[None, :] <= cols[:, None]).view(M, 1, 1, E))  # (M,1,1,E)
        self.core_mask = self.mask
        if rounds is not None and cache.per_round and cache.missing == "mask":
            self.core_mask = self.mask & (cache.depth[rows, :E] >= rounds[:, None]).view(M, 1, 1, E)
        # the core slot each row writes: its round's under the per-round layout, the shared one otherwise; as an
        # index into the core storage seen as (S * n_core * B, H, L, Dh) (index_select reads a row's history
        # 3x faster than indexing three dimensions at once), block i adding i * B
        self.slot = None if rounds is None else (rounds - 1 if cache.per_round else torch.zeros_like(rounds))
        self.flat = None if rounds is None else self.slot * (cache.n_core * cache.batch) + rows

    def subset(self, sel: Tensor) -> "RowColumns":
        """These rows' view for a prelude or coda pass of the rows `sel` (M',): the masks sliced, not rebuilt."""
        out = RowColumns.__new__(RowColumns)
        out.c, out.rows, out.cols, out.rounds, out.E = self.c, self.rows[sel], self.cols[sel], None, self.E
        out.mask = out.core_mask = self.mask[sel]
        out.slot = out.flat = None
        return out

    def attend(self, slot: tuple, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """`KVCache.attend` for one column per row: q, k, v (M, H, 1, Dh)."""
        c, rows, cols, E = self.c, self.rows, self.cols, self.E
        kind, _, i = slot
        if kind == "core":
            if self.flat is None:
                raise ValueError("RowColumns: core visits need each row's round")
            at = self.flat + i * c.batch                                       # (M,) (slot, block, row)
            kb, vb = c.k_core.view(-1, *c.k_core.shape[3:]), c.v_core.view(-1, *c.v_core.shape[3:])
            if not c.per_round:
                c.row_stash(i, rows, self.rounds, k[:, :, 0], v[:, :, 0])
            rows, mask = at, self.core_mask
        else:
            kb, vb = (c.k_prelude[i], c.v_prelude[i]) if kind == "prelude" else (c.k_coda[i], c.v_coda[i])
            mask = self.mask
        kb[rows, :, cols] = k[:, :, 0]
        vb[rows, :, cols] = v[:, :, 0]
        return sdpa(q, kb[:, :, :E].index_select(0, rows), vb[:, :, :E].index_select(0, rows), mask)


def _index(rows: Tensor | None) -> Tensor | slice | None:
    """Rows as an index: a slice when they are consecutive, so that reading them is a view of the
    cache rather than a copy of every key and value they hold."""
    if rows is None or rows.numel() == 0:
        return rows
    ids = rows.tolist()
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return slice(ids[0], ids[0] + len(ids))
    return rows
