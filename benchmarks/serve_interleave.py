"""How `looplm serve`'s worker schedules requests, on bench-s: latency and throughput.

    python benchmarks/serve_interleave.py [--threads N] [--trials 5] [--long 200] [--short 8]
                                          [--requests 24] [--gap-ms 15] [--big-prompt 224]
                                          [--join-prompt 144]

Three schedules of the same worker (parts 1-2):

    one at a time  one batch of one row (max_batches=1, max_batch=1)
    in turn        batches of one row (max_batch=1, max_batches=4), one decode step each in turn
    continuous     the defaults (max_batch=8, max_batches=4): a waiting request takes a free row
                   of a running batch, and rows decode together

1. A long request (32-token prompt, `--long` new tokens) starts; 20 ms later a short one arrives
   (16-token prompt, `--short` new tokens): ms from the short one's arrival until each is done.
2. Load: `--requests` requests arrive `--gap-ms` apart (prompts of 8..32 tokens, 16/64/32/128
   new tokens in turn): the time until all are done, generated tokens per second over it, and
   the median time from a request's arrival to its last token.
3. Chunked prefill (continuous schedule): a stream decodes; 10 ms in, 8 requests with
   `--big-prompt`-token prompts arrive together. The longest gap between two of the stream's
   tokens while they prefill, and their time to first token, with `prefill_chunk` 0 (the whole
   prompt in one tick), 64 (the default), 32 and 16.
4. Chunked joins (continuous schedule): a stream with a (`--join-prompt` + 16)-token prompt
   decodes; 10 ms in, 7 requests with `--join-prompt`-token prompts arrive together and take
   the free rows of its batch (they fit in its columns). The same two figures: the joining
   prompts share one chunk of prefill per tick of that batch (0: each is prefilled whole as it
   joins, all in one tick).

Medians over `--trials`, schedules interleaved. The scheduler is ticked directly, as the server
does between requests (no HTTP), so the figures are the scheduling alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from looplm.bench.decode import BENCH_S
from looplm.recipe.config import load_recipe
from looplm.inference.engine import Engine, SamplingParams
from looplm.model.looped import build_model
from looplm.serve import Scheduler, ServeLimits, _Row


SCHEDULES = {"one at a time": dict(max_batches=1, max_batch=1), "in turn": dict(max_batch=1, max_batches=4),
             "continuous": dict(max_batch=8, max_batches=4)}


def _row(prompt: list[int], new_tokens: int, finished: dict, name: Any) -> _Row:
    def send(ev) -> None:
        if isinstance(ev, Exception):
            raise ev
        if ev.finish_reason:
            finished[name] = time.perf_counter()
    return _Row(ids=prompt, params=SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False), send=send)


def trial(engine: Engine, limits: dict, n_long: int, n_short: int) -> tuple[float, float]:
    """(ms from the short request's arrival until it is done, and until the long one is)."""
    sched, finished = Scheduler(engine, ServeLimits(**limits)), {}
    sched.submit(_row(list(range(32)), n_long, finished, "long"))
    t = time.perf_counter() + 0.02
    while time.perf_counter() < t:           # the long one runs alone for 20 ms
        sched.tick()
    t = time.perf_counter()
    sched.submit(_row(list(range(1, 17)), n_short, finished, "short"))
    while sched.busy:
        sched.tick()
    return (finished["short"] - t) * 1e3, (finished["long"] - t) * 1e3


def load_trial(engine: Engine, limits: dict, n: int, gap_ms: float) -> tuple[float, float, float]:
    """(ms until all n requests are done, generated tokens/s over that time, median ms per request)."""
    sched, finished, arrived = Scheduler(engine, ServeLimits(max_concurrent=n, **limits)), {}, {}
    lengths = [(16, 64, 32, 128)[i % 4] for i in range(n)]
    t0, i = time.perf_counter(), 0
    while i < n or sched.busy:
        now = time.perf_counter()
        while i < n and now >= t0 + i * gap_ms / 1000:          # the requests that have arrived
            arrived[i] = now
            sched.submit(_row([(7 * i + j) % 4096 for j in range(8 + 7 * i % 25)], lengths[i], finished, i))
            i += 1
        if sched.busy:
            sched.tick()
        elif i < n:
            time.sleep(max(0.0, t0 + i * gap_ms / 1000 - time.perf_counter()))
    span = max(finished.values()) - t0
    return span * 1e3, sum(lengths) / span, statistics.median((finished[i] - arrived[i]) * 1e3 for i in range(n))


def stall_trial(engine: Engine, prefill_chunk: int, big: int, n_big: int = 8, stream_prompt: int = 8,
                stream_new: int = 200) -> tuple[float, float]:
    """(longest ms between two tokens of a running stream while `n_big` prompts of `big` tokens
    prefill, their median ms from arrival to first token)."""
    sched = Scheduler(engine, ServeLimits(prefill_chunk=prefill_chunk))
    stamps: list[float] = []
    first: dict[int, float] = {}

    def stream(ev) -> None:
        stamps.append(time.perf_counter())

    def big_row(i: int) -> _Row:
        def send(ev) -> None:
            first.setdefault(i, time.perf_counter())
        return _Row(ids=[(11 * i + j) % 4096 for j in range(big)],
                    params=SamplingParams(max_new_tokens=4, stop_at_eos=False), send=send)
    sched.submit(_Row(ids=[(7 * j) % 4096 for j in range(stream_prompt)],
                      params=SamplingParams(max_new_tokens=stream_new, stop_at_eos=False), send=stream))
    while not stamps:                        # its prefill and first token
        sched.tick()
    t = time.perf_counter() + 0.01
    while time.perf_counter() < t:
        sched.tick()
    arrived = time.perf_counter()
    for i in range(n_big):
        sched.submit(big_row(i))
    while len(first) < n_big:
        sched.tick()
    seen = len(stamps)
    while len(stamps) == seen:               # the stream's next token after theirs: the last gap
        sched.tick()
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > arrived]
    return max(gaps) * 1e3, statistics.median(t - arrived for t in first.values()) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--long", type=int, default=200)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--gap-ms", type=float, default=15.0)
    ap.add_argument("--big-prompt", type=int, default=224)
    ap.add_argument("--join-prompt", type=int, default=144)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    engine = Engine(build_model(load_recipe("quickstart", overrides=BENCH_S)).eval(), None)
    print(f"bench-s, {args.threads} thread(s), median of {args.trials}")
    print(f"1. a {args.short}-token request arriving 20 ms into a {args.long}-token one (ms from its arrival)")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in SCHEDULES}
    for _ in range(args.trials):               # interleaved, so load from elsewhere hits all alike
        for name, limits in SCHEDULES.items():
            results[name].append(trial(engine, limits, args.long, args.short))
    for name, runs in results.items():
        print(f"{name:>14}: short done after {statistics.median(r[0] for r in runs):6.0f} ms, "
              f"long after {statistics.median(r[1] for r in runs):6.0f} ms")
    print(f"2. {args.requests} requests arriving {args.gap_ms:g} ms apart")
    load: dict[str, list[tuple[float, float, float]]] = {name: [] for name in SCHEDULES}
    for _ in range(args.trials):
        for name, limits in SCHEDULES.items():
            load[name].append(load_trial(engine, limits, args.requests, args.gap_ms))
    for name, runs in load.items():
        print(f"{name:>14}: all done after {statistics.median(r[0] for r in runs):6.0f} ms, "
              f"{statistics.median(r[1] for r in runs):6.0f} tok/s, "
              f"median request {statistics.median(r[2] for r in runs):6.0f} ms")
    print(f"3. 8 prompts of {args.big_prompt} tokens arriving while a stream decodes (continuous)")
    stalls: dict[int, list[tuple[float, float]]] = {0: [], 64: [], 32: [], 16: []}
    for _ in range(args.trials):
        for chunk in stalls:
            stalls[chunk].append(stall_trial(engine, chunk, args.big_prompt))
    for chunk, runs in stalls.items():
        print(f"{f'prefill_chunk {chunk}':>17}: longest gap in the stream {statistics.median(r[0] for r in runs):6.1f} ms, "
              f"their first token after {statistics.median(r[1] for r in runs):6.0f} ms")
    print(f"4. 7 prompts of {args.join_prompt} tokens joining the batch of a stream with a "
          f"{args.join_prompt + 16}-token prompt (continuous)")
    joins: dict[int, list[tuple[float, float]]] = {0: [], 64: [], 32: [], 16: []}
    for _ in range(args.trials):
        for chunk in joins:
            joins[chunk].append(stall_trial(engine, chunk, args.join_prompt, n_big=7,
                                            stream_prompt=args.join_prompt + 16, stream_new=90))
    for chunk, runs in joins.items():
        print(f"{f'prefill_chunk {chunk}':>17}: longest gap in the stream {statistics.median(r[0] for r in runs):6.1f} ms, "
              f"their first token after {statistics.median(r[1] for r in runs):6.0f} ms")

if __name__ == "__main__":
    main()
