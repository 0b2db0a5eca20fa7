"""Per-token early exit over whole sequences, where exiting really skips work.

`early_exit(model, idx, policy)` runs a looped model on (B, T) tokens the way evaluation needs
it and computes what the cached decoder (`Engine`, inference/engine.py) computes token by token:
the same `halting.ExitController` decides after every round which tokens stop, and the same
visibility rule (`cache.MISSING`: copy-forward or mask) says how later rounds see them.

The parallel pass. The next round runs *only on the tokens still active*: they are packed into
one row (1, N), so the core's products, norms, gate and (for entropy/kl) readouts shrink with the
number of tokens left, with no padding; only attention regroups them by sequence (`QueryLayout`:
(B', W) query rows, padding bounded even when one sequence keeps many tokens running). `SequenceKV` holds each position's core K/V from its latest
computed round; queries come only from active tokens, with RoPE at their true positions.
Nothing is computed for a token after its exit round; `computed[b, t, r-1]` records the rounds
whose core step ran for each token, and `rounds_used` is its sum.

Readouts (coda + LM head). A decoder's cache holds one coda entry per token, from the readout
at its exit round, and that is what later tokens' codas attend to. So:
- fixed / quantile: one readout after the loop on every token's exit state, with ordinary
  causal attention in the coda (exactly those entries);
- entropy / kl without a coda (`n_coda = 0`, the Ouro-style stack): the readout is
  head(norm(state)) per token, read out every round a token may exit at (part of its cost);
- entropy / kl with a coda: token t's readout at round r reads earlier tokens' exit readouts,
  which may come from rounds after r, so no round-synchronous pass can compute it; the
  sequence is decoded column by column through the Engine's chunks (`_column_by_column`).

When no token exits early, every round sees all tokens and a full causal mask, and the logits
equal the plain full-depth forward (tests/test_adaptive.py allows 1e-6 for every policy, checks
the parallel pass against a naive compute-everything-then-mask reference, and evaluation
against token-by-token decoding and a from-scratch decode reference, with a coda).

This module also holds the compute-quality evaluation built on it (`evaluate_exit`,
`exit_sweep`, `exit_distribution_depth`) used by `looplm eval --exit/--exit-sweep`.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UserError
from ..inference.cache import MISSING
from ..model.blocks import round_visibility, sdpa
from ..halting import ExitController, ExitPolicy, hazards_to_masses, parse_exit_policy, successive_kl, token_entropy
from ..model.looped import LoopOutput
from ..model.recurrence import unroll


@dataclass
class AdaptiveOutput(LoopOutput):
    """`LoopOutput` of an early-exit pass, plus the record of what was computed.

    logits: (B, T, V) each token's readout at its exit round; rounds: the most rounds any token
    ran; rounds_used: (B, T) rounds each token ran; hazards: (B, T, R) gate outputs where the gate
    ran (NaN after a token's exit, None when the policy needs no gate); state: (B, T, d) each
    token's state at its exit round.
    """

    computed: Tensor | None = None
    """(B, T, R) bool: the core step of round r ran for this token (R = the round budget)."""
    read_out: Tensor | None = None
    """(B, T, R) bool: a per-round readout (coda + head) ran for this token after round r (entropy/kl)."""
    rows_computed: int = 0
    """Token rows the core's products processed, summed over rounds and batch (every token at a full
    round, the running tokens at a partial one: the products carry no padding)."""
    policy: ExitPolicy | None = None
    """The policy that decided."""


CHUNK_WIDTHS = (16, 32, 64)
"""Row widths a partial round's attention may split a sequence's running tokens into (besides the
busiest sequence's count)."""
ROW_OVERHEAD = 32
"""Cost of splitting, in query-token equivalents per attention row: a sequence spread over several
rows has its K/V gathered once per row (one row per sequence reads the buffer as it is). Measured
on the ouro-style run: a (20, 16) layout's gathers cost about twice its attention."""


class QueryLayout:
    """Which tokens a partial round computes, and how its attention groups them into (B', W) rows.

    The block's products, norms and RoPE run on the N running tokens packed into one row (1, N), in
    the order of (seq, pos); only attention needs each token's sequence. Its query row j holds up to
    W running tokens of sequence src[j], at positions rows[j] (in order); slots past a sequence's
    count are padding (valid False, never written back). Token n of the packed row sits in slot
    (bi[n], ai[n]). One row per sequence (src None, W = the busiest sequence's count) attends to the
    K/V buffer as it is; when one sequence keeps many tokens running and the others few, splitting
    the busy ones into chunks of W bounds the attention padding at W - 1 per sequence (`build`).
    """

    def __init__(self, src: Tensor | None, rows: Tensor, valid: Tensor):
        self.src = src                       # (B',) sequence of each row; None = row b is sequence b
        self.rows, self.valid = rows, valid  # (B', W) positions, (B', W) bool
        self.bi, self.ai = valid.nonzero(as_tuple=True)                       # (N,) real query slots
        seq = self.bi if src is None else src[self.bi]
        self.seq, self.pos = seq, rows[self.bi, self.ai]                      # (N,) their tokens
        self.shape = tuple(rows.shape)

    @classmethod
    def build(cls, active: Tensor) -> "QueryLayout":
        """Group active (B, T) bool into attention rows: one per sequence (cost B x the busiest
        count), or rows of width W gathered per sequence (cost rows x (W + ROW_OVERHEAD)) — one
        per sequence that still has running tokens (W = the busiest count; late rounds, where most
        sequences have none) or chunks of a width in CHUNK_WIDTHS below it — whichever attends
        to fewer query slots."""
        B, T = active.shape
        counts = active.sum(1)                                                # (B,)
        maxc = int(counts.max())
        best = (B * maxc, maxc, None)
        widths = [w for w in CHUNK_WIDTHS if w < maxc] + ([maxc] if bool((counts == 0).any()) else [])
        for W in widths:
            n = (counts + W - 1) // W                                          # rows per sequence
            cost = int(n.sum()) * (W + ROW_OVERHEAD)
            if cost < best[0]:
                best = (cost, W, n)
        _, W, n = best
        order = torch.argsort((~active).to(torch.int8), dim=1, stable=True)  # active positions first
        if n is None:                                                         # one row per sequence
            valid = torch.arange(W, device=active.device) < counts.unsqueeze(1)
            return cls(None, torch.where(valid, order[:, :W], 0), valid)
        src = torch.repeat_interleave(torch.arange(B, device=active.device), n)      # (B',)
        chunk = torch.arange(len(src), device=active.device) - (torch.cumsum(n, 0) - n)[src]
        slot = chunk.unsqueeze(1) * W + torch.arange(W, device=active.device)       # (B', W)
        valid = slot < counts[src].unsqueeze(1)
        rows = torch.where(valid, order[src.unsqueeze(1), slot.clamp(max=T - 1)], 0)  # padding: position 0
        return cls(src, rows, valid)


class SequenceKV:
    """Core keys/values for a whole-sequence early-exit pass: a `KVCache` (`attend(slot, q, k, v)`,
    what `Attention.forward` calls).

    One buffer per core block index holds each position's K/V from its latest computed round.
    How a later round sees a token that stopped is the visibility rule (`cache.MISSING`, the
    same choice and meaning as `LoopKVCache`'s): "copy_forward" reads that latest entry,
    "mask" leaves the token out of the round's attention.

    `select(layout, active)` names the queries of the coming calls: None = every token, as
    (B, T) rows; or a `QueryLayout`, whose N running tokens arrive packed as one row (1, N) —
    the block's products, norms and RoPE run on exactly those tokens, no padding. Only
    attention needs each token's sequence: `attend` writes the fresh K/V at the tokens'
    positions, spreads the queries into the layout's (B', W) rows (each against its sequence's
    keys, causal, under the visibility rule), and packs the outputs back into (1, N). The
    first call for a block must select every token (round 1 of a whole-sequence pass does).
    `writes[slot]` records, per slot, which tokens had their K/V computed there: the audit
    trail of which rounds ran for which token. Only the core goes through this cache: with a
    coda, the policies whose readouts decide run column by column through the Engine instead
    (see `early_exit`).
    """

    def __init__(self, batch: int, length: int, device: torch.device | str = "cpu", missing: str = "copy_forward"):
        if missing not in MISSING:
            raise UserError(f"missing-entry handling {missing!r}: expected one of {', '.join(MISSING)}")
        self.B, self.T, self.device, self.missing = batch, length, device, missing
        self._kv: dict[tuple[str, int], tuple[Tensor, Tensor]] = {}   # (kind, i) -> (B, Hkv, T, Dh) x2
        self._layout: QueryLayout | None = None
        self._mask: Tensor | None = None       # (B', 1, W, T) bool, True = may attend (packed queries)
        self.writes: dict[Any, Tensor] = {}    # slot -> (B, T) bool
        self.select(None)

    def select(self, layout: QueryLayout | None, active: Tensor | None = None) -> None:
        """Queries for the next attend() calls: every token (None) or the tokens of `layout`,
        packed (1, N); active (B, T) bool: the tokens still running (needed when layout is given)."""
        self._layout, self._mask = layout, None
        if layout is None:
            return
        ran = None
        if self.missing == "mask":               # stopped tokens drop out of later rounds
            seq = torch.arange(self.B, device=self.device) if layout.src is None else layout.src
            ran = active[seq]                                                 # (B', T)
        self._mask = round_visibility(layout.rows, ran, self.T).unsqueeze(1)  # (B', 1, W, T)

    def attend(self, slot: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) for every token, or (1, ., N, Dh) for the packed
        running tokens -> the attention output in the same layout."""
        kind, _round, i = slot
        if kind != "core":
            raise RuntimeError(f"SequenceKV holds the core only, asked for {slot}")
        key = (kind, i)
        lay = self._layout
        if lay is None:
            # Every token is a query: the fresh K/V are the whole history; they become the buffer as
            # they are (no copy), and the attention is the plain forward's (bit-identical).
            self._kv[key] = (k, v)
            self.writes[slot] = torch.ones(self.B, self.T, dtype=torch.bool, device=k.device)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        if key not in self._kv:
            raise RuntimeError(f"SequenceKV: first call for {key} must select every token")
        kb, vb = self._kv[key]
        kb[lay.seq, :, lay.pos] = k[0].transpose(0, 1)           # (N, Hkv, Dh) at their positions
        vb[lay.seq, :, lay.pos] = v[0].transpose(0, 1)
        written = torch.zeros(self.B, self.T, dtype=torch.bool, device=k.device)
        written[lay.seq, lay.pos] = True
        self.writes[slot] = written
        B2, W = lay.shape
        rows = q.new_zeros(B2, q.shape[1], W, q.shape[3])         # (B', H, W, Dh); padding queries are zero
        rows[lay.bi, :, lay.ai] = q[0].transpose(0, 1)
        if lay.src is not None:                                   # several rows per sequence
            kb, vb = kb[lay.src], vb[lay.src]                      # (B', Hkv, T, Dh)
        y = sdpa(rows, kb, vb, self._mask)                         # (B', H, W, Dh)
        return y[lay.bi, :, lay.ai].transpose(0, 1).unsqueeze(0)  # (1, H, N, Dh)


def resolve_policy(policy: str | ExitPolicy, *, min_rounds: int = 1) -> ExitPolicy:
    """An ExitPolicy from a string ("fixed:R", "quantile:Q", "entropy:TAU", "kl:EPS") or as given."""
    if isinstance(policy, ExitPolicy):
        return policy
    return parse_exit_policy(policy, min_rounds=min_rounds)


def _budget(model, policy: ExitPolicy, rounds: int | None) -> int:
    if rounds is None:
        rounds = policy.value if policy.kind == "fixed" else model.nominal_rounds
    if type(rounds) is not int or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if model.cfg.untied and rounds > model.nominal_rounds:
        raise ValueError(f"the untied baseline has blocks for at most {model.nominal_rounds} rounds, asked {rounds}")
    return rounds


@torch.no_grad()
def early_exit(model, idx: Tensor, policy: str | ExitPolicy, rounds: int | None = None, *,
               prefill: bool = False, generator: torch.Generator | None = None,
               may_exit: Tensor | None = None, missing: str = "copy_forward") -> AdaptiveOutput:
    """Run `model` on idx (B, T) with per-token early exit; rounds after a token's exit are not computed.

    policy:  an ExitPolicy or its string; rounds: the round budget R (default: R of fixed:R, else the
    model's nominal depth). prefill=True means these are prompt tokens: they exit early only if
    policy.exit_in_prefill (evaluation passes prefill=False: exits allowed). generator: the random
    initial state's generator, as for `model(...)`. may_exit (B, T) bool: only these tokens may
    exit before R; the others run every round (task evaluation: the prompt is prefilled at full
    depth, the positions that predict the answer follow the policy). missing: how later rounds
    see a stopped token (`cache.MISSING`), as the Engine's `GenerationConfig.missing`.

    The function computed is the cached decoder's (`Engine`), token for token: a token's core at
    round r sees earlier tokens by the visibility rule, and its coda sees earlier tokens' coda
    K/V as the decoder's cache holds them, i.e. from their exit-round readouts. For fixed and
    quantile that is one causal readout of the exit states after the loop. For entropy and kl
    on a model with a coda, a token's readout at round r reads earlier tokens' exit readouts,
    which may come from rounds after r, so the decisions run position by position: those passes
    decode the sequence column by column through the Engine (teacher forcing), the only way to
    compute that function; without a coda the readout is per token and the pass is parallel.
    """
    policy = resolve_policy(policy)
    R = _budget(model, policy, rounds)
    if policy.kind == "quantile" and model.gate is None:
        raise UserError(f"exit policy {policy}: needs a model with an exit gate (exit.gate = true); "
                        "use entropy:TAU or kl:EPS for a model without one")
    B, T = idx.shape
    if T > model.cfg.context:
        raise ValueError(f"sequence of {T} tokens exceeds the model context {model.cfg.context}")
    device = idx.device
    ctl = ExitController(policy, R, B * T, prefill=prefill, may_exit=may_exit, device=device)
    rope_full, e, s = model.loop_inputs(idx, generator=generator)      # e, s: (B, T, d); the prelude runs once
    if model.cfg.n_coda and ctl.read_rounds - {R}:
        return _column_by_column(model, idx, s, ctl, missing, prefill)
    kv = SequenceKV(B, T, device, missing)
    use_gate = ctl.needs_hazard

    computed = torch.zeros(B, T, R, dtype=torch.bool, device=device)
    read_out = torch.zeros(B, T, R, dtype=torch.bool, device=device)
    hazards = torch.full((B, T, R), math.nan, device=device) if use_gate else None
    # the round just run: its tokens (ids None = all of them in order, else their flat indices), their
    # new states (B, T, d) or packed (1, N, d), and the RoPE tables they ran with
    ran = SimpleNamespace(ids=None, s_new=None, rope=rope_full, rows=0, state=s)

    def step(s: Tensor, r: int) -> Tensor:
        """Round r for the tokens still running, packed when some have stopped; s stays (B, T, d)."""
        active = ctl.active.view(B, T)
        if bool(active.all()):  # every token still running: the plain path, no gathers
            lay, ran.ids, ran.rope, s_in, e_in = None, None, rope_full, s, e
        else:
            lay = QueryLayout.build(active)                             # attention rows (B', W)
            ran.ids = lay.seq * T + lay.pos                             # (N,) the running tokens, flat
            ran.rope = model.rope(0, len(ran.ids), lay.pos.unsqueeze(0))
            s_in = s.view(B * T, -1)[ran.ids].unsqueeze(0)              # (1, N, d): packed, no padding
            e_in = e if model.cfg.injection == "none" else e.view(B * T, -1)[ran.ids].unsqueeze(0)
        kv.select(lay, active)
        ran.rows += B * T if lay is None else len(ran.ids)
        ran.s_new = model.core_step(s_in, e_in, r, ran.rope, kv)        # (B, T, d) or (1, N, d)
        computed[..., r - 1] = active
        return ran.s_new if lay is None else s.view(B * T, -1).index_copy(0, ran.ids, ran.s_new[0]).view(B, T, -1)

    def exits(s: Tensor, r: int) -> Tensor | None:
        """The controller decides for the tokens that ran round r (outputs flattened to (N, ...) in
        their order); None once no token goes on. Every token still active at R has run its last round."""
        ids, h, lg = ran.ids, None, None
        if use_gate:
            h = model.hazard(ran.s_new).flatten(0, 1)                   # (N,)
            hazards[..., r - 1] = h.view(B, T) if ids is None else \
                hazards[..., r - 1].flatten().index_copy(0, ids, h).view(B, T)
        if ctl.needs_readout(r):
            # no coda here (or every token active): each token's readout reads only itself
            lg = model.readout(ran.s_new, ran.rope).flatten(0, 1)       # (N, V)
            read_out[..., r - 1] = computed[..., r - 1]
        ctl.decide(r, ids, hazard=h, logits=lg)
        ran.state = s                                                   # every token's state so far
        return s if bool(ctl.active.any()) else None

    run = unroll(step, s, R, rule=exits)
    s, rounds_run, rows_computed = ran.state, run.rounds_run, ran.rows

    rounds_used = computed.sum(-1)                                     # (B, T)
    if ctl.read_rounds:
        logits = ctl.logits.view(B, T, -1)                             # each token's exit-round readout
    else:
        logits = model.readout(s, rope_full)                           # one readout on every exit state
    return AdaptiveOutput(logits=logits, rounds=rounds_run, rounds_used=rounds_used, hazards=hazards, state=s,
                          cache=kv, computed=computed, read_out=read_out, rows_computed=rows_computed, policy=policy)


def _column_by_column(model, idx: Tensor, s0: Tensor, ctl: ExitController, missing: str,
                      prefill: bool) -> AdaptiveOutput:
    """early_exit for readout-deciding policies on a model with a coda: the sequence decoded
    one column at a time through the Engine's cached chunks (teacher forcing), with the initial
    states s0 (B, T, d) the whole-sequence pass drew. state and hazards are not recorded."""
    from ..inference.engine import Engine, GenerationConfig

    policy, R = ctl.policy, ctl.rounds
    B, T = idx.shape
    engine = Engine(model, None, GenerationConfig(rounds=R, exit=str(policy), min_rounds=policy.min_rounds,
                                                  exit_in_prefill=policy.exit_in_prefill, missing=missing))
    noise = s0 if model.cfg.init_state == "random" else None           # position-indexed, as the engine's table
    cache = engine.new_cache(B, T)
    may = None if ctl.may_exit is None else ctl.may_exit.view(B, T)
    logits, used = [], []
    with torch.inference_mode():
        for c in range(T):
            lg, u = engine.run_chunk(idx[:, c:c + 1], c, cache, phase="prefill" if prefill else "decode",
                                     noise=noise, may_exit=None if may is None else may[:, c])
            logits.append(lg)                                           # (B, V)
            used.append(torch.full((B,), u) if isinstance(u, int) else u)
    rounds_used = torch.stack(used, 1).to(idx.device)                  # (B, T)
    rounds = torch.arange(1, R + 1, device=idx.device)
    computed = rounds <= rounds_used.unsqueeze(-1)                     # (B, T, R)
    reads = torch.tensor([r in ctl.read_rounds for r in range(1, R + 1)], device=idx.device)
    return AdaptiveOutput(logits=torch.stack(logits, 1).clone(), rounds=int(rounds_used.max()),
                          rounds_used=rounds_used, hazards=None, state=None, cache=cache, computed=computed,
                          read_out=computed & reads, rows_computed=int(rounds_used.sum()), policy=policy)


# ---------------------------------------------------------------------------------------
# Evaluation: loss, measured rounds and wall time of a policy; sweeps of thresholds.

def _seeded(count: int) -> torch.Generator:
    # the same per-batch generator as evaluate.evaluate_rounds, so fixed:R matches its table
    return torch.Generator().manual_seed(count)


@torch.no_grad()
def evaluate_exit(model, batches: Iterable[tuple[Tensor, Tensor]], policy: str | ExitPolicy,
                  rounds: int | None = None, repeats: int = 1, missing: str = "copy_forward") -> dict[str, Any]:
    """Loss of `policy` on `batches` with its measured cost: {"policy", "loss", "ppl", "mean_rounds",
    "max_rounds", "wall_time_s", "rounds_histogram", "rows_computed"}. wall_time_s times the
    early-exit forward passes only (loss arithmetic excluded), summed over batches; with
    repeats > 1 it is the median over that many passes."""
    from ..model.losses import token_losses

    policy = resolve_policy(policy)
    model.eval()
    batches = list(batches)
    loss_sum, rounds_sum, count, scored, wall, rows = 0.0, 0, 0, 0.0, 0.0, 0
    hist = torch.zeros(0, dtype=torch.long)
    budget = None
    for x, y, *rest in batches:
        mask = rest[0] if rest and isinstance(rest[0], Tensor) else None   # task data: answer tokens only
        t0 = time.perf_counter()
        out = early_exit(model, x, policy, rounds, generator=_seeded(count), missing=missing)
        wall += time.perf_counter() - t0
        budget = out.computed.shape[-1]
        loss_sum += token_losses(out.logits, y, mask).sum().item()
        scored += y.numel() if mask is None else mask.sum().item()
        rounds_sum += int(out.rounds_used.sum())
        rows += out.rows_computed
        hist = _add_hist(hist, out.rounds_used, budget)
        count += y.numel()
    if count == 0:
        raise UserError("evaluation data: no batches to evaluate")
    if repeats > 1:
        wall = time_policies(model, batches, [(policy, rounds)], repeats, missing, first=[wall])[0]
    loss = loss_sum / max(1.0, scored)
    return {"policy": str(policy), "loss": loss, "ppl": math.exp(min(50.0, loss)), "mean_rounds": rounds_sum / count,
            "max_rounds": budget, "wall_time_s": wall,
            "rounds_histogram": {str(r + 1): int(n) for r, n in enumerate(hist.tolist()) if n},
            "rows_computed": rows}


@torch.no_grad()
def time_policies(model, batches: list, policies: list[tuple[str | ExitPolicy, int | None]], repeats: int,
                  missing: str = "copy_forward", first: list[float] | None = None) -> list[float]:
    """Median wall time (s) of each (policy, rounds)'s early-exit passes over all `batches`.
    Within each of the `repeats` passes every policy is timed in turn, so a slow spell of a
    shared machine slows them all alike instead of one policy's whole measurement; `first`:
    already measured passes (one per policy) counted among the repeats."""
    walls = [[w] for w in first] if first is not None else [[] for _ in policies]
    for _ in range(repeats - len(walls[0])):
        for i, (pol, R) in enumerate(policies):
            t0, seen = time.perf_counter(), 0
            for x, *_ in batches:
                early_exit(model, x, pol, R, generator=_seeded(seen), missing=missing)
                seen += x.numel()
            walls[i].append(time.perf_counter() - t0)
    return [statistics.median(w) for w in walls]


def _add_hist(hist: Tensor, rounds_used: Tensor, R: int) -> Tensor:
    counts = torch.bincount(rounds_used.flatten() - 1, minlength=R)
    if hist.numel() < counts.numel():
        hist = torch.cat([hist, hist.new_zeros(counts.numel() - hist.numel())])
    return hist + counts


@torch.no_grad()
def exit_distribution_depth(model, batches: Iterable[tuple[Tensor, Tensor]], rounds: int) -> float | None:
    """Mean exit round under the gate's exit distribution, E[t] = sum_t t p_t, over tokens at full
    depth `rounds` (masses from the hazards, last round forced). A statistic of the distribution,
    not any policy's measured serving depth; None for a model without a gate."""
    if model.gate is None:
        return None
    total, count = 0.0, 0
    for x, *_ in batches:
        out = model(x, rounds, generator=_seeded(count))
        masses = hazards_to_masses(out.hazards[..., :rounds])         # (B, T, R)
        total += (masses * torch.arange(1, rounds + 1, dtype=masses.dtype)).sum().item()
        count += x.numel()
    return total / max(1, count)


SWEEP_KINDS = ("quantile", "entropy", "kl")
_QUANTILES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
_PROBE_LEVELS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def parse_sweep(text: str) -> tuple[str, list[float] | None]:
    """"entropy" or "entropy:0.5,1,2" -> (kind, thresholds or None for the default range)."""
    kind, sep, rest = text.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in SWEEP_KINDS:
        raise UserError(f"--exit-sweep {text!r}: expected one of {', '.join(SWEEP_KINDS)}, "
                        "optionally with thresholds, e.g. entropy:0.5,1,2")
    if not sep:
        return kind, None
    try:
        values = [float(v) for v in rest.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise UserError(f"--exit-sweep {text!r}: thresholds must be comma-separated numbers, e.g. {kind}:0.1,0.5")
    for v in values:
        resolve_policy(f"{kind}:{v}")                                  # validates the range (UserError)
    return kind, values


@torch.no_grad()
def default_thresholds(model, kind: str, batches: list[tuple[Tensor, Tensor]], rounds: int) -> list[float]:
    """A threshold range that spans the model's behaviour. quantile: fixed levels of Q. entropy/kl:
    quantiles of the per-token entropies (or successive KLs) at rounds before the last, measured on
    the first batch, so the sweep runs from "almost nobody exits early" to "almost everybody"."""
    if kind == "quantile":
        return list(_QUANTILES)
    x = batches[0][0]
    out = model(x, rounds, readout_rounds=tuple(range(1, rounds + 1)), generator=_seeded(0))
    if rounds == 1:
        return [1.0]
    if kind == "entropy":
        vals = torch.cat([token_entropy(out.round_logits[r]).flatten() for r in range(1, rounds)])
    else:
        if rounds == 2:
            vals = successive_kl(out.round_logits[2], out.round_logits[1]).flatten()
        else:
            vals = torch.cat([successive_kl(out.round_logits[r], out.round_logits[r - 1]).flatten()
                              for r in range(2, rounds)])
    levels = torch.quantile(vals.double().clamp_min(0), torch.tensor(_PROBE_LEVELS, dtype=torch.float64))
    raw = sorted({v for v in levels.tolist() if v > 0})
    for digits in (3, 4, 5, 6, 8):   # short numbers, but not so short that distinct levels merge
        picked = sorted({float(f"{v:.{digits}g}") for v in raw})
        if len(picked) == len(raw):
            break
    return picked or [1e-3]


def exit_sweep(model, batches: list[tuple[Tensor, Tensor]], kind: str, rounds: int,
               thresholds: list[float] | None = None, min_rounds: int = 1, repeats: int = 1,
               missing: str = "copy_forward") -> list[dict[str, Any]]:
    """evaluate_exit for each threshold of one policy kind, on the same batches."""
    if kind not in SWEEP_KINDS:
        raise UserError(f"exit sweep kind {kind!r}: expected one of {', '.join(SWEEP_KINDS)}")
    thresholds = thresholds or default_thresholds(model, kind, batches, rounds)
    return [evaluate_exit(model, batches, parse_exit_policy(f"{kind}:{v}", min_rounds=min_rounds), rounds, repeats,
                          missing)
            for v in thresholds]


def fixed_reference(model, batches: list[tuple[Tensor, Tensor]], rounds: int, repeats: int = 1) -> list[dict[str, Any]]:
    """evaluate_exit for fixed:1 .. fixed:rounds: the compute-quality curve without adaptivity."""
    return [evaluate_exit(model, batches, f"fixed:{r}", r, repeats) for r in range(1, rounds + 1)]


def sweep_markdown(kind: str, rows: list[dict[str, Any]], reference: list[dict[str, Any]],
                   distribution_depth: float | None) -> str:
    """The report section: a table of the sweep beside full depth, and the two depth figures."""
    full = reference[-1]
    lines = [f"Exit policy `{kind}` swept over thresholds on the same validation batches. "
             "*Mean rounds used* is measured: the rounds each token actually ran (rounds after its exit "
             "are not computed). *Wall time* is the measured time of the early-exit forward passes "
             f"(median of {TIMING_REPEATS} passes, every policy and fixed depth timed in turn within each pass; "
             "fixed depths run through the same early-exit code).", ""]
    if distribution_depth is not None:
        lines += [f"- exit-distribution mean depth (E[t] under the gate's masses at full depth "
                  f"{full['max_rounds']}): **{distribution_depth:.2f}** rounds — a statistic of the "
                  "distribution, not a serving depth", ""]
    lines += ["| policy | loss | loss vs full depth | mean rounds used | wall time (s) | time vs full depth |",
              "|---|---:|---:|---:|---:|---:|"]
    for row in rows + [dict(full, policy=f"{full['policy']} (full depth)")]:
        lines.append(f"| {row['policy']} | {row['loss']:.4f} | {row['loss'] - full['loss']:+.4f} | "
                     f"{row['mean_rounds']:.2f} | {row['wall_time_s']:.3f} | "
                     f"{row['wall_time_s'] / max(1e-12, full['wall_time_s']):.2f}x |")
    lines += ["", "Fixed depth for comparison: " + ", ".join(
        f"{r['policy']} loss {r['loss']:.4f} in {r['wall_time_s']:.3f} s" for r in reference),
        "", f"![exit sweep {kind}](exit_sweep_{kind}.png)"]
    return "\n".join(lines)


def plot_sweep(path, kind: str, rows: list[dict[str, Any]], reference: list[dict[str, Any]],
               accuracy: bool = False) -> None:
    """Loss against mean rounds used and against measured wall time, policy beside fixed depth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "accuracy" if accuracy else "loss"
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, xkey, xlabel in zip(axes, ("mean_rounds", "wall_time_s"), ("mean rounds used", "measured wall time (s)")):
        ax.plot([r[xkey] for r in reference], [r[key] for r in reference], marker="s", color="gray",
                label="fixed depth 1..R")
        ax.plot([r[xkey] for r in rows], [r[key] for r in rows], marker="o", label=f"{kind} threshold sweep")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"validation {key}")
        ax.legend(fontsize=8)
    fig.suptitle(f"Early exit ({kind}): quality vs compute")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


EXIT_PASS_ROWS = 32
"""`looplm eval --exit/--exit-sweep` without --batch-size time early exit in passes of at least this
many rows (the validation windows regrouped) when the initial state is deterministic, so that the
losses and rounds are exactly those of the recipe's batches; a random initial state keeps the
recipe's batches (its noise is drawn per pass), so fixed:R still equals the rounds table."""

TIMING_REPEATS = 5
"""`looplm eval --exit/--exit-sweep` report the median wall time of this many passes per policy,
the policies (and the fixed depths beside them) timed in turn within each pass (`time_policies`)."""


def cli_policy(text: str, recipe) -> ExitPolicy:
    """`--exit` text with the recipe's exit.min_rounds; plain "fixed" means all depth.rounds rounds."""
    if text.strip().lower() == "fixed":
        text = f"fixed:{recipe.depth.rounds}"
    return parse_exit_policy(text, min_rounds=recipe.exit.min_rounds)


def exit_eval(run, batches: list, policy: str | None = None, sweep: str | None = None,
              data_label: str = "the run's validation split", write: bool = True,
              missing: str = "copy_forward") -> tuple[dict[str, Any], list[str]]:
    """`looplm eval RUN --exit POLICY / --exit-sweep KIND [--missing-kv M]`: the JSON entries and text lines.

    The round budget is the recipe's depth.rounds (fixed:R runs R). missing: how later rounds see a
    token that exited (`cache.MISSING`), as `generate`/`serve --missing-kv` decode. With a sweep, the
    table and exit_sweep_KIND.png go into the run folder and a section into report.md (when write)."""
    recipe, model = run.recipe, run.model
    R = recipe.depth.rounds
    batches = list(batches)
    if not batches:
        raise UserError("evaluation data: no batches to evaluate")
    result: dict[str, Any] = {"pass_rows": max(len(b[0]) for b in batches)}
    early_exit(model, batches[0][0][:1], f"fixed:{R}", R)               # warm-up, not timed
    dist = exit_distribution_depth(model, batches, R)
    dist_text = "no gate" if dist is None else f"{dist:.2f}"
    lines: list[str] = []
    if policy is not None:
        pol = cli_policy(policy, recipe)
        budget = pol.value if pol.kind == "fixed" else R
        row = evaluate_exit(model, batches, pol, budget, missing=missing)
        full = evaluate_exit(model, batches, f"fixed:{budget}", budget)
        row["wall_time_s"], full["wall_time_s"] = time_policies(
            model, batches, [(pol, budget), (f"fixed:{budget}", budget)], TIMING_REPEATS, missing,
            first=[row["wall_time_s"], full["wall_time_s"]])
        row["missing"] = missing
        row["exit_distribution_mean_rounds"] = dist
        row["full_depth"] = {"rounds": budget, "loss": full["loss"], "wall_time_s": full["wall_time_s"]}
        result["exit"] = row
        lines.append(f"exit {row['policy']}: loss {row['loss']:.4f} (full depth {full['loss']:.4f}), "
                     f"mean rounds used {row['mean_rounds']:.2f} of {budget} (exit-distribution mean depth "
                     f"{dist_text}), wall {row['wall_time_s']:.3f} s (full depth {full['wall_time_s']:.3f} s)")
    if sweep is not None:
        kind, thresholds = parse_sweep(sweep)
        rows = exit_sweep(model, batches, kind, R, thresholds, recipe.exit.min_rounds, missing=missing)
        reference = fixed_reference(model, batches, R)
        timed = rows + reference               # every pass of the sweep and the fixed depths, interleaved
        policies = ([(parse_exit_policy(r["policy"], min_rounds=recipe.exit.min_rounds), R) for r in rows]
                    + [(r["policy"], r["max_rounds"]) for r in reference])              # as each was evaluated
        walls = time_policies(model, batches, policies, TIMING_REPEATS, missing,
                              first=[r["wall_time_s"] for r in timed])
        for r, w in zip(timed, walls):
            r["wall_time_s"] = w
        result.update({"sweep": rows, "sweep_kind": kind, "fixed_reference": reference,
                       "exit_distribution_mean_rounds": dist, "missing": missing})
        full = reference[-1]
        lines.append(f"exit sweep {kind} (exit-distribution mean depth {dist_text}; full depth {R}: "
                     f"loss {full['loss']:.4f}, {full['wall_time_s']:.3f} s):")
        lines += [f"  {r['policy']:>18s}: loss {r['loss']:.4f}, mean rounds {r['mean_rounds']:.2f}, "
                  f"wall {r['wall_time_s']:.3f} s ({r['wall_time_s'] / max(1e-12, full['wall_time_s']):.2f}x)"
                  for r in rows]
        if write:
            from ..runs.report import add_section
            png = run.path / f"exit_sweep_{kind}.png"
            plot_sweep(png, kind, rows, reference)
            md = f"Data: {data_label}.\n\n" + sweep_markdown(kind, rows, reference, dist)
            added = add_section(run.path, f"Early exit sweep: {kind}", md,
                                {"exit_sweeps": {kind: {"rows": rows, "fixed_reference": reference,
                                                        "exit_distribution_mean_rounds": dist, "data": data_label}}})
            result["sweep_plot"] = str(png)
            lines.append(f"plot {png}" + ("; section added to report.md" if added else " (run has no report.json)"))
    return result, lines
