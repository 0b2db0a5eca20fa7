"""Why `looplm serve` keeps every torch call on one thread: decoding from a second thread.

    python benchmarks/two_threads.py [--threads N] [--runs 5] [--new-tokens 200]

Times bench-s greedy generation of `--new-tokens` tokens (median of `--runs`) on the main
thread, then on a second thread of the same process (after the main thread has run torch ops),
then on the main thread again. With several torch threads, each Python thread that runs torch
gets its own CPU thread team, and the teams compete for the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from looplm.bench.decode import BENCH_S
from looplm.recipe.config import load_recipe
from looplm.inference.engine import Engine, SamplingParams
from looplm.model.looped import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    engine = Engine(build_model(load_recipe("quickstart", overrides=BENCH_S)).eval(), None)
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    prompt = [list(range(32))]

    def timed(out: list[float]) -> None:
        engine.generate(prompt, params)                  # warm-up on this thread
        for _ in range(args.runs):
            t = time.perf_counter()
            engine.generate(prompt, params)
            out.append((time.perf_counter() - t) * 1e3)

    print(f"bench-s, {args.threads} torch thread(s), {args.new_tokens} tokens, median of {args.runs}")
    for where in ("main thread", "second thread", "main thread again"):
        out: list[float] = []
        if where == "second thread":
            th = threading.Thread(target=timed, args=(out,))
            th.start()
            th.join()
        else:
            timed(out)
        print(f"{where:>18}: {statistics.median(out):6.0f} ms")


if __name__ == "__main__":
    main()
