"""Continuous depth batching: every loop step runs the batch's tokens at whatever round each is on, and a
slot freed by a token that exited is refilled at once, by the next token of its request or by a new
request's first token.

    batch = DepthBatch(engine, capacity=8)            # or engine.batch(prompts) with GenerationConfig(batching="depth")
    row, _ = batch.join("Hello", SamplingParams(max_new_tokens=32))   # placed; prefilled by the next step
    while not batch.finished:
        events = batch.step()                  # one loop step: events of the tokens that left the loop

Why. Under an early-exit policy the plain decode step (batch.py, `serve --batching exit`) runs every
row's token from round 1 until the deepest has exited; a row that exits early idles in the meantime.
Here a step is one round for every token in flight (`LoopState`, loopstate.py); a token that exits is
read out, sampled and its request's next token enters round 1 at the next step, beside tokens that are
at round 3 or 5. Where a step's cost is flat in the rows it runs (a memory-bound device, or a small
model whose steps are overhead), throughput grows toward (F0 + R Fr) / (F0 + d Fr) of full depth
(F0 the prelude, coda and head of a token, Fr one round, d the mean exit round); where the cost grows
with the rows (a compute-bound CPU) the plain exit batch already skips the exited rows' work.

A step, in this order (one homogeneous pass each, the model's own pieces through the engine's kernels):
0. prompts that joined: prefilled together, left-padded to end at one column (`prefill_chunk` columns per
   step, or whole), through the engine's chunk; each one's first token sampled when its last column ran;
1. entering tokens (a request's next token, sampled at the step before or at its prefill): the prelude at
   their columns, each row's own column and position (`RowColumns`, cache.py); they join the loop state;
2. one round of the core for every token in flight, each at its own round and column;
3. the exit decision (`ExitController`, the one the engine uses, per round group), the readout (coda,
   norm, head) of the tokens that stop, their cache entries closed as the decode policy says
   (`LoopKVCache.finish_rows`: copy-forward or mask depths under full, the kept entry under shared
   policies), sampling, events.

Each request's arithmetic is what it is decoded alone: its prompt in its own row at positions 0..P-1
(left padding is masked, as in every batch), each token's rounds reading the history its own
row holds at that round (the visibility rule of the cache policy and `missing`), its initial-state noise
from its own seed's table. Greedy tokens equal the same request's alone (tests/test_depth_batching.py).

What it refuses (the engine's capability table, capabilities.py): speculation, recirculation,
contrastive decoding, full-bandwidth feedback, Mixture-of-Recursions routers, untied depth and Euler
sub-steps (a step mixes rounds of one tied block) -- each with its reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..halting import ExitController
from .batch import DecodeBatch
from .cache import RowColumns
from .kernels import rope_rows
from .loopstate import LoopState
from .request import JoinProgress, RequestState
from .sampler import Sampler, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from .runner import Runner


@dataclass
class _Group:
    """Joining prompts prefilled together: their rows (n,), the prompts left-padded (n, P), columns done."""

    rows: Tensor
    idx: Tensor
    done: int = 0


class DepthBatch(DecodeBatch):
    """Rows decoded by continuous depth batching (see the module docstring). It shares DecodeBatch's
    per-row machinery (requests, sampler, prompt chunks, events) and replaces its step: requests enter
    with `join` (prefilled at once, columns from 0 in their own row), `step()` runs one loop step, and
    `cancel` frees a row mid-loop. `finished`: no request in it is running (a new `join` starts it again)."""

    def __init__(self, engine: "Runner", capacity: int, deltas: bool = True,
                 prompts: tuple[list[list[int]], list[SamplingParams]] | None = None,
                 prefill_chunk: int | None = None):
        from .capabilities import check_batching
        check_batching(engine, "depth")
        c = engine.config     # what a step cannot run, whatever the table says (the table's test meets these)
        if c.contrast or c.recirculation or c.speculative or engine.feedback or engine.policy.kind == "routed" \
                or engine.cfg.untied:
            raise ValueError("a depth batch runs one tied round per step with plain readouts (capabilities.py)")
        engine.kernels()
        if capacity < 1:
            raise ValueError(f"capacity {capacity}: must be >= 1")
        self.engine, self.deltas = engine, deltas
        ref = next(engine.model.parameters())
        self.device = ref.device
        self.B = self.n_start = capacity
        self.cache = engine.new_cache(capacity, engine.cfg.context, torch.zeros(capacity, dtype=torch.long))
        idle = SamplingParams(max_new_tokens=1)
        self.requests = [RequestState.new(idle, engine.tokenizer, deltas, done=True) for _ in range(capacity)]
        self.noise = engine.initial_noise([idle] * capacity, ref)                 # (B, context, d) or None
        self.sampler = Sampler([idle] * capacity, [[]] * capacity, engine.cfg.vocab_size, ref.device)
        self.eos = getattr(engine.tokenizer, "eos_id", None)
        self.cols = [0] * capacity            # the column of each row's current token
        self.ctl = ExitController(engine.policy, engine.rounds, capacity, device=ref.device)
        self.loop: LoopState | None = None    # the tokens in flight inside the loop
        self.entering: list[int] = []         # rows whose latest sampled token enters the loop at the next step
        self.work = engine.new_work()
        self.path = None                      # no state path runs under depth batching (capabilities.py)
        self.started = True
        self.steps = 0                        # loop steps run
        self.row_rounds = 0                   # rounds computed, summed over the tokens that ran them
        self.row_steps = 0                    # tokens that left the loop (decode tokens)
        self.decode_s = 0.0                   # wall time of the loop steps
        self._cpu_start = time.process_time()
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk {prefill_chunk}: must be >= 1 (or None: one chunk)")
        if prompts and len(prompts[0]) > capacity:
            raise ValueError(f"capacity {capacity}: fewer rows than the {len(prompts[0])} prompts")
        # joining prompts are prefilled together, left-padded to end at one column (a group), `prefill_chunk`
        # columns per step; one chunk reads the earlier columns exactly only under the full prefill cache, so with
        # another prefill policy a group runs whole (as DecodeBatch)
        self.join_chunk = prefill_chunk if prefill_chunk and engine.config.prefill_cache == "full" else None
        self._pending: list[int] = []          # rows placed by `join`, not yet in a prefill group, in join order
        self._group: _Group | None = None      # the prefill group in progress
        self.prefill_s, self.prompt_tokens, self._t0 = 0.0, 0, None
        self.stats: dict[str, Any] = {"batching": "depth", "capacity": capacity, "rounds": engine.rounds,
                                      "exit": str(engine.policy), "prefill_cache": engine.config.prefill_cache,
                                      "decode_cache": engine.config.decode_cache, "missing": engine.config.missing,
                                      "cache_bytes": self.cache.nbytes()}
        engine.last_stats = self.stats
        for ids, sp in zip(*(prompts or ((), ()))):        # `Engine.batch`'s prompts: rows 0..n-1
            self.join(ids, sp)

    @property
    def finished(self) -> bool:
        return all(r.done for r in self.requests)

    @property
    def free_rows(self) -> int:
        return sum(r.done for r in self.requests)

    @property
    def in_flight(self) -> int:
        """Tokens inside the loop now (the recurrent batch of the next step, before entering tokens)."""
        return 0 if self.loop is None else len(self.loop)

    def join(self, prompt: str | Sequence[int], params: SamplingParams | None = None
             ) -> tuple[int, list[TokenEvent]] | None:
        """Place a new request in a free row: (row, []) -- its prompt is prefilled by the next steps, together
        with the other prompts that joined before them (`_prefill_groups`), and its first token comes with the step
        that runs its last prompt columns -- or None when no row is free. Its next token enters the loop at the
        step after its first token."""
        e = self.engine
        (ids,), (sp,) = e.prepare([prompt], params)
        free = [b for b, r in enumerate(self.requests) if r.done]
        if not free:
            return None
        b = free[0]
        if self._t0 is None:
            self._t0 = time.perf_counter()
        with torch.inference_mode():
            if self.noise is not None:
                from ..model.looped import initial_noise_table
                self.noise[b] = initial_noise_table(e.cfg, sp.seed).to(self.noise)
            self.sampler.set_row(b, sp, ids)
            self.requests[b] = req = RequestState.new(sp, e.tokenizer, self.deltas)
            req.mode = e.prompt_mode(sp)
            req.joining = JoinProgress(torch.tensor([ids], dtype=torch.long, device=self.device), 0, 0, [])
        self._pending.append(b)
        return b, []

    def _prefill_groups(self) -> list[TokenEvent]:
        """This step's prompt columns: groups of the joining prompts, each left-padded to end at one column
        (its rows' pads set so: their positions start at 0), `prefill_chunk` columns per step or every group
        whole; the rows whose prompt is complete are sampled and their events returned."""
        budget = self.join_chunk or None
        events: list[TokenEvent] = []
        t0 = time.perf_counter()
        while budget is None or budget > 0:
            if self._group is None:
                if not self._pending:
                    break
                self._group = self._form_group()
            g = self._group
            z = g.idx.shape[1] if budget is None else min(g.idx.shape[1], g.done + budget)
            logits, used = self._run_prompt(g.idx[:, g.done:z], g.done, g.rows)
            if budget is not None:
                budget -= z - g.done
            g.done = z
            if z < g.idx.shape[1]:
                continue
            self._group = None
            rows = g.rows.tolist()
            live = [j for j, b in enumerate(rows) if self.requests[b].joining is not None]   # not cancelled meanwhile
            if not live:
                continue
            if len(live) < len(rows):
                logits = logits[live]
                used = used if isinstance(used, int) else used[live]
            rows = [rows[j] for j in live]
            for b in rows:
                self.requests[b].joining = None
                self.cols[b] = g.idx.shape[1]
                self.prompt_tokens += g.idx.shape[1] - int(self.cache.pad[b])
            self._sampled(logits, used, rows)
            self.stats.setdefault("ttft_s", time.perf_counter() - self._t0)
            events += self._emit(rows)
            self.entering += [b for b in rows if not self.requests[b].done]
        self.prefill_s += time.perf_counter() - t0
        return events

    def _form_group(self) -> "_Group":
        """The next prefill group: pending prompts in join order while the longest and the most new tokens fit the
        context together (each alone fits: `Runner.prepare`), left-padded; their rows' pads set."""
        from .batch import left_padded
        from .sampler import positions_run
        take: list[int] = []
        for b in self._pending:
            cand = take + [b]
            longest = max(self.requests[c].joining.prompt.shape[1] for c in cand)
            most = max(self.requests[c].params.max_new_tokens for c in cand)
            if take and positions_run(longest, most) > self.cache.length:
                break
            take = cand
        self._pending = self._pending[len(take):]
        idx, pad = left_padded([self.requests[b].joining.prompt[0].tolist() for b in take], self.device)
        for b, p in zip(take, pad.tolist()):
            self.cache.set_pad(b, p)
        return _Group(rows=torch.tensor(take, device=self.device), idx=idx)

    def cancel(self, row: int) -> None:
        """Stop a row (its client went away), mid-loop or between tokens: its place is free for `join`."""
        req = self.requests[row]
        if req.done:
            return
        req.done, req.joining, req.prompt_lp, req.prompt_carry = True, None, None, None
        if row in self._pending:
            self._pending.remove(row)
        if row in self.entering:
            self.entering.remove(row)
        if self.loop is not None:
            gone = self.loop.rows == row
            if bool(gone.any()):                 # its rounds so far were computed: they count
                ran = int(self.loop.rounds[gone][0]) - 1
                if ran:
                    self.work.add("decode", self.cols[row], ran, readouts=0, rows=1)
                self.loop = self.loop.keep(~gone)

    def compact(self) -> None:
        """Rows keep their places (each row reads only its own columns): nothing to move."""
        return None

    def step(self) -> list[TokenEvent]:
        """One loop step (see the module docstring): the events of the tokens that left the loop."""
        with torch.inference_mode():
            events = self._prefill_groups() if self._pending or self._group is not None else []
            t0 = time.perf_counter()
            if self.entering:
                self._enter()
            if self.loop is None or len(self.loop) == 0:
                return events
            events += self._round()
            self.decode_s += time.perf_counter() - t0
            return events

    # -- inside ---------------------------------------------------------------------------
    def _enter(self) -> None:
        """The entering tokens' prelude at their own columns; they join the loop at round 1."""
        e, k = self.engine, self.engine._fast or self.engine.kernels()
        rows, self.entering = self.entering, []
        dev = self.device
        toks = torch.tensor([self.requests[b].token for b in rows], dtype=torch.long, device=dev)
        self.sampler.observe(toks, rows)
        r, c = torch.tensor(rows, device=dev), torch.tensor([self.cols[b] for b in rows], device=dev)
        self.cache.start_rows(r, c)
        self.ctl.reset(r)
        pos = c - self.cache.pad[r]                                        # (M,) positions: column - left pad
        s0 = None if self.noise is None else self.noise[r, pos].unsqueeze(1)                    # (M, 1, d)
        rope, x, s = e.model.loop_inputs(toks.view(-1, 1), 0, pos.view(-1, 1), RowColumns(self.cache, r, c), k,
                                         initial_state=s0)
        new = LoopState(r, c, torch.ones_like(r), s, x, rope)
        self.loop = new if self.loop is None else self.loop.merge(new)

    def _round(self) -> list[TokenEvent]:
        """One round for every token in flight; the exit decision; the stopped tokens read out and sampled."""
        e, ctl = self.engine, self.ctl
        k, m = e._fast or e.kernels(), e.model
        L = self.loop
        view = RowColumns(self.cache, L.rows, L.cols, L.rounds)           # every token at its own round and column
        s = k.core_step(L.s, L.e, L.rounds, L.rope, view)                 # (M, 1, d)
        ran = L.rounds                                                     # (M,) the round each token just ran
        L = L.advanced(s)
        self.steps += 1
        self.row_rounds += len(L)
        hazard = m.hazard(s)[:, -1] if ctl.needs_hazard else None          # (M,)
        logits = read = None
        if ctl.read_rounds:        # entropy/kl: the tokens at a read round are read out (coda, head)
            read = ctl.reads[ran]                                          # (M,) bool
            if bool(read.any()):
                sel = read.nonzero().squeeze(1)
                lg = k.readout(s[sel], rope_rows(L.rope, sel), view.subset(sel), 0, False)       # (M', V)
                logits = lg.new_zeros(len(L), lg.shape[-1]).index_copy_(0, sel, lg)
        stop = ctl.decide(ran, L.rows, hazard=hazard, logits=logits, read=read)    # each token at its own round
        if not bool(stop.any()):
            self.loop = L
            return []
        events = self._leave(L, s, stop, ran, view)
        self.loop = L.keep(~stop)
        return events

    def _leave(self, L: LoopState, s: Tensor, stop: Tensor, ran: Tensor, view: RowColumns) -> list[TokenEvent]:
        """Tokens that stopped: their exit-round readout, their cache entries closed, the next token sampled."""
        e, ctl = self.engine, self.ctl
        k = e._fast or e.kernels()
        idx = stop.nonzero().squeeze(1)
        rows, cols, used = L.rows[idx].tolist(), L.cols[idx].tolist(), ran[idx].tolist()
        if ctl.read_rounds:                 # every exit round is a read round: the decision's readout
            logits = ctl.logits[L.rows[idx]]
        else:                               # fixed, quantile: read out now, once
            logits = k.readout(s[idx], rope_rows(L.rope, idx), view.subset(idx), max(used), False)
        self.cache.finish_rows(rows, cols, used)
        reads = ctl.read_rounds
        for c, u in zip(cols, used):        # FLOPs of each token at its column (model/flops.py)
            self.work.add("decode", c, u, readouts=sum(r <= u for r in reads) + (u not in reads),
                          gate_rounds=u if ctl.needs_hazard else 0, rows=1)
        self._sampled(logits, torch.tensor(used), rows)
        self.row_steps += len(rows)
        for b in rows:
            self.cols[b] += 1
        events = self._emit(rows)
        self.entering += [b for b in rows if not self.requests[b].done]
        return events

    def _maybe_finish(self) -> None:
        """The batch's figures, whenever no request is running (a server's batch lives on: they cover its life)."""
        if not self.finished:
            return
        w = self.work
        self.stats["flops"] = {"prefill": 0.0, "decode": 0.0, **w.by_phase, "attention": w.attention}
        decode_s = self.decode_s
        self.stats.update(prefill_s=self.prefill_s, prefill_tokens_per_s=self.prompt_tokens / max(self.prefill_s, 1e-9),
                          decode_s=decode_s, decode_cpu_s=time.process_time() - self._cpu_start,
                          decode_tokens=self.row_steps, loop_steps=self.steps, row_rounds=self.row_rounds,
                          mean_batch_rows=self.row_rounds / max(self.steps, 1),
                          decode_tokens_per_s=self.row_steps / decode_s if decode_s else 0.0)
