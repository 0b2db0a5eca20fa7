"""How long a short request waits behind a long one in `looplm serve`'s worker, on bench-s.

    python benchmarks/serve_interleave.py [--threads N] [--trials 5] [--long 200] [--short 8]

A long request (32-token prompt, `--long` new tokens) starts; 20 ms later a short one arrives
(16-token prompt, `--short` new tokens). Three schedules:

    static       one batch of one row (max_batches=1, max_batch=1): the short one waits
    in turn      batches of one row (max_batch=1, max_batches=4): the short one starts its own
                 batch and the two advance one decode step each in turn
    continuous   the defaults (max_batch=8, max_batches=4): the short one takes a free row of
                 the running batch, and the two decode as one batch

Printed: medians over `--trials` of the time from the short request's arrival until each
request's last token. The worker is driven directly (no HTTP), so the figures are the
scheduling alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from looplm.bench import BENCH_S
from looplm.config import load_recipe
from looplm.generation import Engine, SamplingParams
from looplm.model import build_model
from looplm.serve import ServeLimits, _Row, _Worker


SCHEDULES = {"static": dict(max_batches=1, max_batch=1), "in turn": dict(max_batch=1, max_batches=4),
             "continuous": dict(max_batch=8, max_batches=4)}


def trial(engine: Engine, limits: dict, n_long: int, n_short: int) -> tuple[float, float]:
    started, finished = threading.Event(), {}

    def sender(name: str):
        def send(ev) -> None:
            if isinstance(ev, Exception):
                raise ev
            started.set()
            if ev.finish_reason:
                finished[name] = time.perf_counter()
        return send

    worker = _Worker(engine, ServeLimits(batch_window_ms=0, **limits))
    try:
        worker.inbox.put(_Row(ids=list(range(32)), send=sender("long"),
                              params=SamplingParams(max_new_tokens=n_long, stop_at_eos=False)))
        started.wait(60)
        time.sleep(0.02)
        t = time.perf_counter()
        worker.inbox.put(_Row(ids=list(range(1, 17)), send=sender("short"),
                              params=SamplingParams(max_new_tokens=n_short, stop_at_eos=False)))
        deadline = time.monotonic() + 120
        while len(finished) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        worker.stop()
    return (finished["short"] - t) * 1e3, (finished["long"] - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--long", type=int, default=200)
    ap.add_argument("--short", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    engine = Engine(build_model(load_recipe("quickstart", overrides=BENCH_S)).eval(), None)
    print(f"bench-s, {args.threads} thread(s): a {args.short}-token request arriving 20 ms into a "
          f"{args.long}-token one; ms from its arrival, median of {args.trials}")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in SCHEDULES}
    for _ in range(args.trials):               # interleaved, so load from elsewhere hits all alike
        for name, limits in SCHEDULES.items():
            results[name].append(trial(engine, limits, args.long, args.short))
    for name, runs in results.items():
        print(f"{name:>12}: short done after {statistics.median(r[0] for r in runs):6.0f} ms, "
              f"long after {statistics.median(r[1] for r in runs):6.0f} ms")

if __name__ == "__main__":
    main()
