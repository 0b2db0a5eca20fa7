"""A batch of rows decoded together, one step at a time: prefill (chunked or whole), decode,
prompts that join a running batch (continuous batching), rows that finish or are cancelled.

    batch = engine.batch(["Hello", "A longer prompt"], SamplingParams(max_new_tokens=32), capacity=4)
    events = batch.step()                    # prefill: every row's first token
    row, first = batch.join("Hi")            # a new prompt in a free row (or None)
    while not batch.finished:
        events += batch.step()               # one token per running row

The runner (inference/runner.py) runs the chunks through the model and owns the cache layout; this
module decides which rows and columns each step runs, and turns sampled tokens into events.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..model.looped import initial_noise_table
from .paths import StatePath
from .paths.feedback import FeedbackPath
from .request import JoinProgress, RequestState
from .sampler import Sampler, SamplingParams, TokenEvent, positions_run, token_logprobs

if TYPE_CHECKING:
    from .runner import Runner


def left_padded(ids: Sequence[Sequence[int]], device: Any, rows: int | None = None) -> tuple[Tensor, Tensor]:
    """Prompts of different lengths as one (n, P) batch, right-aligned (left-padded with 0), and
    each row's first real column (B,); `rows` > n adds free rows whose first column is P."""
    n, P = len(ids), max(map(len, ids))
    idx = torch.zeros(n, P, dtype=torch.long, device=device)
    for b, p in enumerate(ids):
        idx[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
    pad = [P - len(p) for p in ids] + [P] * ((rows or n) - n)
    return idx, torch.tensor(pad, dtype=torch.long, device=device)


class DecodeBatch:
    """Rows decoded together, one step at a time; a new prompt can take a free row.

    `step()` returns the next token of every running row as TokenEvents (the first call runs the
    prefill); rows that finished (eos, a stop string, their max_new_tokens) are left out of later
    steps. `join(prompt, params)` prefills a new prompt into a free row (a finished one, or one of
    the `capacity` rows beyond the starting prompts), right-aligned so that its prompt ends just
    before the column the running rows write next, and returns the row and its first token's
    events, or None when no row is free or it does not fit (its prompt must fit in the columns so
    far and its tokens in the rest; with chunked prefill, see below). `Engine.stream` drives one
    batch to the end; the server keeps several and lets new requests join them (continuous
    batching). The engine's work runs in inference mode inside each call, never in the caller's
    code.

    Chunked prefill (`prefill_chunk`): the starting prompts are prefilled that many columns per
    step (the earlier steps return no events). Attention is the same as one chunk only under the
    `full` prefill cache (a later chunk reads earlier prompt tokens through the prefill policy;
    one chunk reads them exactly), so with another prefill policy the prompt stays one chunk
    (`stats["prefill_chunks"]` says how many ran). With a chunk, prompts that join are
    prefilled between steps too, within the same budget: each step, after the running rows'
    decode, runs at most `prefill_chunk` columns of joining prompts, in the order they joined
    (a prompt takes what is left of a step's budget and the whole budget of the steps after).
    `join` then only places the prompt and returns no events; its first token comes with the
    step that runs its last columns. Its steps are known when it joins, so the prompt is placed
    to end where the running rows are then: L <= that column is what must fit. While it is
    prefilled, a decode step that runs every row (see `_decode`) writes throwaway entries into its
    row at one column; that column is before its prompt or not yet written (every step from its
    first to its last runs at least one of its columns) and a later part overwrites it.
    """

    def __init__(self, engine: "Runner", ids: list[list[int]], plist: list[SamplingParams], deltas: bool,
                 length: int | None = None, capacity: int | None = None, prefill_chunk: int | None = None):
        engine.kernels()
        self.engine, self.deltas = engine, deltas
        ref = next(engine.model.parameters())
        n, P = len(ids), max(len(p) for p in ids)
        B = capacity or n                                    # rows n..B-1 start free
        need = positions_run(P, max(sp.max_new_tokens for sp in plist))
        if length is not None and not need <= length <= engine.cfg.context:
            raise ValueError(f"cache length {length}: these prompts need {need}..{engine.cfg.context}")
        if B < n:
            raise ValueError(f"capacity {capacity}: fewer rows than the {n} prompts")
        self.B, self.n_start = B, n
        self.idx, pad = left_padded(ids, ref.device, rows=B)                  # (n, P), (B,)
        self.cache = engine.new_cache(B, length or need, pad)
        plist = list(plist) + [SamplingParams(max_new_tokens=1)] * (B - n)         # free rows: placeholders
        # each row's request: its params, text, tokens, prompt figures (request.py); free rows start done
        self.requests = [RequestState.new(sp, engine.tokenizer, deltas, done=b >= n) for b, sp in enumerate(plist)]
        for req in self.requests[:n]:
            req.mode = engine.prompt_mode(req.params)
        self.noise = engine.initial_noise(plist, ref)                                 # (B, context, d) or None
        self.sampler = Sampler(plist, list(ids) + [[]] * (B - n), engine.cfg.vocab_size, ref.device)
        self.eos = getattr(engine.tokenizer, "eos_id", None)
        self.col = P                                         # the column the next decode step writes
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk {prefill_chunk}: must be >= 1 (or None: one chunk)")
        # a feedback model's prompts run whole: the fused pass reads the whole prompt's first-pass top states
        exact = engine.config.prefill_cache == "full" and not engine.feedback
        self.join_chunk = prefill_chunk if prefill_chunk and exact else None   # None: prompts run whole
        self.chunk = self.join_chunk or P                                      # prompt columns per prefill step
        self._join_tail = (0, 0)          # the joining prompts' budget's tail: (step, columns used there)
        self.prefilled, self._prefill_t0, self._prefill_s = 0, 0.0, 0.0    # columns done; first start; compute s
        self.started = False
        self.latencies: list[float] = []
        self.row_steps = 0
        self.stats: dict[str, Any] = {"batch": n, "capacity": B, "rounds": engine.rounds, "exit": str(engine.policy),
                                      "prefill_cache": engine.config.prefill_cache,
                                      "decode_cache": engine.config.decode_cache,
                                      "missing": engine.config.missing, "cache_bytes": self.cache.nbytes()}
        engine.last_stats = self.stats
        self._prompt_tokens = sum(map(len, ids))
        self.work = engine.new_work()                        # every column computed: stats["flops"]
        # the state path this batch's chunks go through (paths/): full-bandwidth feedback, or none
        self.path: StatePath | None = FeedbackPath(engine) if engine.feedback else None

    @property
    def finished(self) -> bool:
        return self.started and all(r.done for r in self.requests)

    def _joining(self) -> list[int]:
        return [b for b, r in enumerate(self.requests) if r.joining is not None]

    def step(self) -> list[TokenEvent]:
        """The next token of every running row (the first call: every row's first token)."""
        if self.finished:
            return []
        with torch.inference_mode():
            if not self.started:
                return self._emit(list(range(self.n_start))) if self._prefill() else []
            rows = [b for b, r in enumerate(self.requests) if not r.done and r.joining is None]
            if rows:
                self._decode(rows)
            else:
                self.col += 1            # only joining rows: their prompts' places assume one column per step
            return self._emit(rows + self._join_chunks())

    def join(self, prompt: str | Sequence[int], params: SamplingParams | None = None
             ) -> tuple[int, list[TokenEvent]] | None:
        """Prefill a new prompt into a free row; (row, its first token's events), or None. With a
        prefill chunk it is only placed here (no events): the next steps prefill it, and its first
        token comes with the step that runs its last columns."""
        e = self.engine
        (ids,), (sp,) = e.prepare([prompt], params)
        free = [b for b, r in enumerate(self.requests) if r.done and r.joining is None]
        if not self.started or self.finished or not free:
            return None
        L = len(ids)
        parts, tail = self._join_parts(L) if self.join_chunk else ([], None)
        first = parts[-1][0] if parts else self.col         # the column of its first decode step
        start = first - L                                    # its prompt ends just before
        if start < 0 or first + sp.max_new_tokens - 1 > self.cache.length:
            return None
        b = free[0]
        with torch.inference_mode():
            self.cache.set_pad(b, start)
            if self.noise is not None:
                self.noise[b] = initial_noise_table(e.cfg, sp.seed).to(self.noise)
            self.sampler.set_row(b, sp, ids)
            self.requests[b] = req = RequestState.new(sp, e.tokenizer, self.deltas)     # nothing of the last one
            req.mode = e.prompt_mode(sp)
            idx = torch.tensor([ids], dtype=torch.long, device=self.idx.device)
            if parts:
                req.joining, self._join_tail = JoinProgress(idx, start, 0, parts), tail
                return b, []
            logits, used = self._run_prompt(idx, start, torch.tensor([b], device=self.idx.device))
            self._sampled(logits, used, [b])
            return b, self._emit([b])

    def cancel(self, row: int) -> None:
        """Stop a row (its client went away): no more events, its place is free for `join`."""
        req = self.requests[row]
        if self.started and not req.done:
            req.done, req.joining, req.prompt_lp, req.prompt_carry = True, None, None, None
            self._maybe_finish()

    def compact(self) -> dict[int, int] | None:
        """Move the running rows (joining ones included) to the front, in order, and the free rows
        after them; None when they are there already, else {old row: new row} of every row that moved.
        Everything of a row moves with it: its cache entries and pad, its initial-state noise, its
        sampler row (generator mid-stream), its RequestState (a feedback model's carried top state
        with it). Rows that finished leave gaps; while the running rows are consecutive a decode step
        reads them as views of the cache, not copies (`_decode`): the server compacts after a row ends.
        Row numbers in later events are the new ones."""
        if not self.started:
            return None
        live = [b for b, r in enumerate(self.requests) if not r.done or r.joining is not None]
        if live == list(range(len(live))):
            return None
        order = live + [b for b in range(self.B) if b not in set(live)]
        with torch.inference_mode():
            self.cache.reorder(torch.tensor(order))
            if self.noise is not None:
                self.noise.copy_(self.noise[torch.tensor(order, device=self.noise.device)])
            self.sampler.reorder(order)
        self.requests = [self.requests[b] for b in order]
        self.stats["compactions"] = self.stats.get("compactions", 0) + 1
        return {old: new for new, old in enumerate(order) if old != new}

    # -- inside ---------------------------------------------------------------------------
    def _run_prompt(self, idx: Tensor, start: int, rows: Tensor | None) -> tuple[Tensor, Tensor | int]:
        """Prompt tokens idx (rows, T) at columns start..start+T: one chunk, or column by column
        when prompt tokens may exit. Returns the last column's logits and rounds used; rows that
        asked for `prompt_logprobs` get this chunk's figures recorded."""
        e = self.engine
        cache_rows = list(range(idx.shape[0])) if rows is None else rows.tolist()
        want = [(j, b) for j, b in enumerate(cache_rows) if self.requests[b].params.prompt_logprobs is not None]
        if self.path is not None:
            logits, used = self.path.prompt(self, idx, start, rows, cache_rows, bool(want))
            if not want:
                return (logits[:, -1] if logits.dim() == 3 else logits), used
        elif not (e.adaptive and e.policy.exit_in_prefill):
            logits, used = e.run_chunk(idx, start, self.cache, phase="prefill", noise=self.noise, rows=rows,
                                       all_logits=bool(want), work=self.work)
            if not want:
                return logits, used
        else:
            cols = [e.run_chunk(idx[:, c:c + 1], start + c, self.cache, phase="prefill", noise=self.noise, rows=rows,
                                work=self.work) for c in range(idx.shape[1])]
            logits, used = torch.stack([lg for lg, _ in cols], 1), cols[-1][1]                # (rows, T, V)
        if want:
            self._record_prompt(want, idx, start, logits)
        return logits[:, -1], used

    def _record_prompt(self, want: list[tuple[int, int]], idx: Tensor, start: int, logits: Tensor) -> None:
        """Prompt log-probabilities of this chunk's columns for the (chunk row j, cache row b)
        pairs that asked: column c's token is scored by column c-1's logits (the previous chunk's
        last for the first column); a row's first column (its pad) gets None."""
        T = idx.shape[1]
        for j, b in want:
            req = self.requests[b]
            pad, top = int(self.cache.pad[b]), req.params.prompt_logprobs
            if req.prompt_lp is None:
                req.prompt_lp = ([], [])
            lps, tops = req.prompt_lp
            if start <= pad < start + T:
                lps.append(None)
                tops.append(None)
            sel = [i for i in range(T) if start + i > pad]
            if sel:
                carry = req.prompt_carry if start > pad else logits[j, 0]                 # (V,); unused at start == pad
                pred = torch.cat([carry[None], logits[j, :-1]])                           # pred[i] scores column start+i
                got = token_logprobs(pred[sel], idx[j, sel].tolist(), [top] * len(sel))
                lps += [lp for lp, _ in got]
                tops += [t for _, t in got]
            req.prompt_carry = logits[j, -1]

    def _join_parts(self, L: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
        """The steps that would prefill a joining prompt of L tokens: [(step, columns)] in the
        budget left after the prompts that joined before it, and the budget's new tail."""
        c = self.join_chunk
        step, used = self._join_tail
        if step <= self.col:
            step, used = self.col + 1, 0                     # the next step, nothing scheduled there
        elif used == c:
            step, used = step + 1, 0
        parts = []
        while L:
            n = min(L, c - used)
            parts.append((step, n))
            L, used = L - n, used + n
            if L:
                step, used = step + 1, 0
        return parts, (step, used)

    def _join_chunks(self) -> list[int]:
        """This step's columns of the joining prompts; the rows whose prompt is now complete, with
        their first token sampled."""
        ready = []
        for b in self._joining():
            req = self.requests[b]
            jp = req.joining
            if jp.parts[0][0] != self.col:
                continue                                     # its turn comes later
            end = jp.done + jp.parts[0][1]
            logits, used = self._run_prompt(jp.prompt[:, jp.done:end], jp.start + jp.done,
                                            torch.tensor([b], device=jp.prompt.device))
            if len(jp.parts) > 1:
                jp.done, jp.parts = end, jp.parts[1:]
                continue
            req.joining = None
            self._sampled(logits, used, [b])
            ready.append(b)
        return ready

    def _prefill(self) -> bool:
        """The next `chunk` prompt columns; True (and every row's first token sampled) after the last."""
        t0 = time.perf_counter()
        rows = None if self.n_start == self.B else torch.arange(self.n_start, device=self.idx.device)
        a, P = self.prefilled, self.idx.shape[1]
        if a == 0:
            self._prefill_t0 = t0
        b = min(P, a + self.chunk)
        logits, used = self._run_prompt(self.idx[:, a:b], a, rows)
        self.prefilled = b
        if b == P:
            self._sampled(logits, used, list(range(self.n_start)))
        t1 = time.perf_counter()
        self._prefill_s += t1 - t0
        if b < P:
            return False
        self.stats.update(prefill_s=self._prefill_s, ttft_s=t1 - self._prefill_t0,
                          prefill_tokens_per_s=self._prompt_tokens / max(self._prefill_s, 1e-9),
                          prefill_chunks=-(-P // self.chunk))
        self.started, self._step_start, self._cpu_start = True, t1, time.process_time()
        return True

    def _decode(self, rows: list[int]) -> None:
        """Feed the running rows' latest tokens at column col. Finished and free rows are left
        out when the running ones are consecutive (the cache is read as views) or at most half
        the batch; otherwise every row runs (reading a scattered subset copies its keys and
        values) and only the running rows are sampled; the others' entries are never read."""
        e, dev = self.engine, self.idx.device
        toks = torch.tensor([self.requests[b].token for b in rows], dtype=torch.long, device=dev)
        self.sampler.observe(toks, rows)
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        path = self.path
        tops: list[Tensor] | None = [] if path is not None else None
        if len(rows) < self.B and (consecutive or 2 * len(rows) <= self.B):
            sel = torch.tensor(rows, device=dev)
            logits, used = e.run_chunk(toks.view(-1, 1), self.col, self.cache, noise=self.noise, rows=sel,
                                       work=self.work, tops=tops,
                                       feedback=path.inputs(self, rows) if path is not None else None)
            ran = rows
        else:
            every = torch.tensor([r.token for r in self.requests], dtype=torch.long, device=dev)
            ran = list(range(self.B))
            logits, used = e.run_chunk(every.view(-1, 1), self.col, self.cache, noise=self.noise, work=self.work,
                                       tops=tops, feedback=path.inputs(self, ran) if path is not None else None)
            if len(rows) < self.B:
                logits = logits[rows]
                used = used if isinstance(used, int) else used[rows]
        if path is not None:      # what the sampled rows carry to their next token
            path.after(self, ran, rows, tops)
        self._sampled(logits, used, rows)
        self.col += 1
        self.row_steps += len(rows)
        now = time.perf_counter()
        self.latencies.append(now - self._step_start)
        self._step_start = now

    def _sampled(self, logits: Tensor, used: Tensor | int, rows: list[int]) -> None:
        """Sample the next token of `rows` from their logits (len(rows), V)."""
        toks = self.sampler(logits, rows).tolist()
        used_l = [used] * len(rows) if isinstance(used, int) else used.tolist()
        want = [j for j, b in enumerate(rows) if self.requests[b].params.logprobs is not None]
        lps: dict[int, Any] = {}
        if want:
            got = token_logprobs(logits[want], [toks[j] for j in want],
                                 [self.requests[rows[j]].params.logprobs for j in want])
            lps = dict(zip(want, got))
        for j, (b, tok, n) in enumerate(zip(rows, toks, used_l)):
            self.requests[b].sampled(tok, n, lps.get(j))

    def _emit(self, rows: list[int]) -> list[TokenEvent]:
        """The events of `rows`' latest tokens (RequestState.emit: a row ends on eos, a stop string or
        its length)."""
        events = [self.requests[b].emit(b, self.eos) for b in rows]
        self._maybe_finish()
        return events

    def _maybe_finish(self) -> None:
        """When every row is done: the decode figures of the batch's stats (`flops`: forward FLOPs of
        every column computed, by phase; the finished rows a whole-batch step runs included)."""
        if all(r.done for r in self.requests):
            w = self.work
            self.stats["flops"] = {"prefill": 0.0, "decode": 0.0, **w.by_phase, "attention": w.attention}
            decode_s = sum(self.latencies)
            self.stats.update(decode_s=decode_s, decode_cpu_s=time.process_time() - self._cpu_start,
                              decode_tokens=self.row_steps, token_latencies_s=self.latencies,
                              decode_tokens_per_s=self.row_steps / decode_s if self.latencies else 0.0)
