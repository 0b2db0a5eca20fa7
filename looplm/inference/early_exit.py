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

The runtime lives here beside the engine it mirrors; the compute-quality evaluation built on it
(`evaluate_exit`, `exit_sweep`, `exit_distribution_depth`, `looplm eval --exit/--exit-sweep`) is in
evaluation/early_exit.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UserError
from .cache import MISSING
from ..model.blocks import round_visibility, sdpa
from ..halting import ExitController, ExitPolicy, parse_exit_policy
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
    if model.cfg.n_coda and ctl.read_rounds - {R} or model.cfg.kv_sharing == "first":
        # kv_sharing = first: every round reads earlier tokens' round-1 entries, the engine's cache policy first
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
    """early_exit for readout-deciding policies on a model with a coda, and for a kv_sharing = first model
    (whose rule the engine's cache keeps): the sequence decoded
    one column at a time through the Engine's cached chunks (teacher forcing), with the initial
    states s0 (B, T, d) the whole-sequence pass drew. state and hazards are not recorded."""
    from ..inference.engine import Engine, GenerationConfig

    policy, R = ctl.policy, ctl.rounds
    B, T = idx.shape
    engine = Engine(model, None, GenerationConfig(rounds=R, exit=str(policy), min_rounds=policy.min_rounds,
                                                  exit_in_prefill=policy.exit_in_prefill, missing=missing))
    noise = s0 if model.cfg.init_state == "random" else None           # position-indexed, as the engine's table
    may = None if ctl.may_exit is None else ctl.may_exit.view(B, T)
    cache = engine.new_cache(B, T)
    with torch.inference_mode():
        logits, used = engine.score(idx, 0, noise=noise, phase="prefill" if prefill else "decode", may_exit=may,
                                    cache=cache)
    rounds_used = used.to(idx.device)                                  # (B, T)
    rounds = torch.arange(1, R + 1, device=idx.device)
    computed = rounds <= rounds_used.unsqueeze(-1)                     # (B, T, R)
    reads = torch.tensor([r in ctl.read_rounds for r in range(1, R + 1)], device=idx.device)
    return AdaptiveOutput(logits=logits.clone(), rounds=int(rounds_used.max()),
                          rounds_used=rounds_used, hazards=None, state=None, cache=cache, computed=computed,
                          read_out=computed & reads, rows_computed=int(rounds_used.sum()), policy=policy)
