"""The server's scheduler: the running engine batches and the prompts waiting for a place.

A `Scheduler` keeps up to `max_batches` batches of the engine running (each with its own cache,
rows left-padded; each row samples with its own parameters and seeded generator, so a request's
output does not depend on its batch mates) and advances them one decode step each in turn. A
waiting prompt takes a free row of a running batch (each has `max_batch` rows) when it fits there
(continuous batching, `DecodeBatch.join`), else it starts a new batch with other waiting prompts,
else it waits. A new batch prefills `prefill_chunk` columns per tick. No threads: whoever owns the
model calls `tick()` (the HTTP server, serve.py, on its event loop: torch calls from two threads
make each other slower). The limits it reads are the server's (`serve.ServeLimits`: max_batch,
max_batches, prefill_chunk, max_concurrent).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from .engine import Engine
from .sampler import SamplingParams, positions_run


@dataclass
class Row:
    """One prompt of one request, as the scheduler sees it."""

    ids: list[int]
    params: SamplingParams
    send: Any          # called with each TokenEvent of the row, or an Exception
    cancelled: bool = False
    """Set by the request when nobody reads the row any more (the client went away)."""


class Scheduler:
    """The running batches and the prompts waiting for a place. No threads: whoever owns the
    model calls `tick()` (the server: on its event loop; see the module docstring for why)."""

    def __init__(self, engine: Engine, limits: Any):
        self.engine, self.limits = engine, limits
        self.waiting: deque[Row] = deque()
        self.running: list[Batch] = []
        self.in_flight = 0

    def try_reserve(self, n: int) -> bool:
        """Count n more prompts in flight, unless that exceeds `max_concurrent`."""
        if self.in_flight + n > self.limits.max_concurrent:
            return False
        self.in_flight += n
        return True

    def release(self, n: int) -> None:
        self.in_flight -= n

    def submit(self, row: Row) -> None:
        self.waiting.append(row)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def tick(self) -> None:
        """Place waiting prompts (a free row of a running batch, else a new batch, else they
        wait), then advance every running batch by one decode step."""
        depth = self.engine.config.batching == "depth"
        # continuous depth batching: one batch of every row the server holds (max_batch x max_batches), each row at
        # its own columns from 0, so any waiting prompt fits any free row
        max_batch = 1 if self.engine.speculative else self.limits.max_batch * (self.limits.max_batches if depth else 1)
        max_batches = 1 if depth else self.limits.max_batches
        while self.waiting:
            if self.waiting[0].cancelled:
                self.waiting.popleft()
            elif any(b.join(self.waiting[0]) for b in self.running):
                self.waiting.popleft()
            elif len(self.running) < max_batches:
                group = [self.waiting.popleft()]
                while len(group) < max_batch and self.waiting and (depth or self._fits(group + [self.waiting[0]])):
                    group.append(self.waiting.popleft())
                self.running.append(Batch(group, self.engine, max_batch, self.limits.prefill_chunk))
            else:
                break
        self.running = [b for b in self.running if b.step()]

    def _fits(self, rows: list[Row]) -> bool:
        """Whether these prompts fit one batch: left-padded to the longest, each row's tokens after
        it, so the longest prompt and the most new tokens must fit the context together (each
        alone was checked when its request came in; those that do not fit wait for the next batch)."""
        return positions_run(max(len(r.ids) for r in rows),
                             max(r.params.max_new_tokens for r in rows)) <= self.engine.cfg.context

    def fail_all(self, err: Exception) -> None:
        """Send `err` to every waiting and running row and drop them."""
        rows = list(self.waiting) + [r for b in self.running for r in b.rows.values()]
        self.waiting.clear()
        self.running = []
        for r in rows:
            r.send(err)


class Batch:
    """One engine batch of the scheduler (its own cache): engine row -> the request row it serves."""

    def __init__(self, rows: list[Row], engine: Engine, capacity: int, prefill_chunk: int = 0):
        self.rows = dict(enumerate(rows))
        try:                     # room for prompts that join later: `capacity` rows, the whole context
            self.run: Any = engine.batch([r.ids for r in rows], [r.params for r in rows],
                                         length=engine.cfg.context, capacity=capacity,
                                         prefill_chunk=prefill_chunk or None)
        except Exception as err:
            self._fail(err)

    def _fail(self, err: Exception) -> None:
        """A bug or an engine error: fail this batch's requests, keep serving."""
        for r in self.rows.values():
            r.send(err)
        self.run = None

    def join(self, row: Row) -> bool:
        """Place a waiting prompt in a free row of this batch; False when none fits it."""
        if self.run is None:
            return False
        try:
            placed = self.run.join(row.ids, row.params)
        except Exception as err:
            row.send(err)
            return True
        if placed is None:
            return False
        b, events = placed
        self.rows[b] = row
        for ev in events:
            row.send(ev)
        return True

    def step(self) -> bool:
        """One decode step of the rows whose clients are still there; False once it is over."""
        if self.run is None:
            return False
        for b, r in self.rows.items():
            if r.cancelled:
                self.run.cancel(b)
        try:
            for ev in self.run.step():
                self.rows[ev.row].send(ev)
                if ev.finish_reason is not None:
                    del self.rows[ev.row]
            moved = self.run.compact() if self.rows else None    # running rows to the front: decode reads views
        except Exception as err:
            self._fail(err)
            return False
        if moved:
            self.rows = {moved.get(b, b): r for b, r in self.rows.items()}
        return not self.run.finished
