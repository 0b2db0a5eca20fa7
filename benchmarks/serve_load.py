"""Continuous depth batching under load on a gated run: `looplm bench serve` plus the step-cost model that says
what the FLOP bound allows on this machine.

    python benchmarks/serve_load.py RUN --exit POLICY [--max-batch 8,16] [--rate offline,R1,R2]
                                        [--requests 64] [--new-tokens 32] [--runs 3] [--threads 2]
                                        [--json OUT.json]

Part 1, for each --max-batch: `looplm bench serve RUN --exit POLICY` (exit, static and depth batching on one
Poisson trace per rate, medians of --runs; see looplm/bench/serve.py).

Part 2, the step costs, timed here on the same run and rows (medians of 200 calls each, after a warm-up):
c(n) one core round of n one-column rows (each at its own round and column: the depth batch's path), P(n)
the prelude of n entering tokens, C(n) the readout (coda, norm, head) of n leaving tokens, fitted as
a + b n over n = 1..2 x max-batch. With them, per decoded token:
    static   (P(B) + R c(B) + C(B)) / B
    depth    (c(B) + P(m) + C(m)) / m,   m = B / d the tokens leaving a step at mean exit round d
and `overhead_bound` = static / depth: the speed-up over static that a depth scheduler with no cost
beyond these calls reaches on this machine once each step's fixed cost is counted (the FLOP bound
counts none); `overhead_share` is the measured speed-up over it. Where every cost is flat in n (a
memory-bound device: a step costs what its weights cost to read) the speed-ups are part 1's count-based
`memory_bound_speedup`, which needs no timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from looplm.bench.serve import bench_serve, parse_rates, serve_lines  # noqa: E402


def step_costs(run_dir: str, exit: str, max_n: int, calls: int = 200) -> dict:
    """Median seconds of a core round, a prelude and a readout at n rows, n = 1, 2, 4, ... 2 x max_n."""
    from looplm.inference.cache import RowColumns
    from looplm.inference.engine import Engine
    from looplm.runs.checkpoint import load_run

    run = load_run(run_dir)
    eng = Engine.from_run(run, exit=exit)
    k, m = eng.kernels(), eng.model
    col = run.recipe.data.seq_len // 2
    out = {"n": [], "core": [], "prelude": [], "readout": []}
    n = 1
    while n <= 2 * max_n:
        cache = eng.new_cache(n, m.cfg.context)
        cache.written = col + 1
        rows, cols = torch.arange(n), torch.full((n,), col)
        rounds = (torch.arange(n) % eng.rounds) + 1                       # rows at different rounds, as in a step
        s, e = torch.randn(n, 1, m.cfg.d_model), torch.randn(n, 1, m.cfg.d_model)
        toks = torch.randint(0, m.cfg.vocab_size, (n, 1))
        rope = m.rope(0, 1, cols.view(-1, 1))

        def timed(fn) -> float:
            for _ in range(20):
                fn()
            ts = []
            for _ in range(calls):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            return statistics.median(ts)
        with torch.inference_mode():
            out["core"].append(timed(lambda: k.core_step(s, e, rounds, rope, RowColumns(cache, rows, cols, rounds))))
            out["prelude"].append(timed(lambda: m.loop_inputs(toks, 0, cols.view(-1, 1), RowColumns(cache, rows, cols),
                                                              k)))
            out["readout"].append(timed(lambda: k.readout(s, rope, RowColumns(cache, rows, cols), 1, False)))
        out["n"].append(n)
        n *= 2
    return out


def fit(ns: list[int], ts: list[float]) -> tuple[float, float]:
    """Least squares a + b n."""
    nm, tm = statistics.fmean(ns), statistics.fmean(ts)
    b = sum((x - nm) * (y - tm) for x, y in zip(ns, ts)) / sum((x - nm) ** 2 for x in ns)
    return tm - b * nm, b


def overhead_bound(costs: dict, B: int, R: int, d: float) -> float:
    """static / depth time per decoded token under the fitted step costs (module docstring)."""
    c, P, C = (fit(costs["n"], costs[k]) for k in ("core", "prelude", "readout"))
    at = lambda ab, n: ab[0] + ab[1] * n  # noqa: E731
    m = B / d
    static = (at(P, B) + R * at(c, B) + at(C, B)) / B
    depth = (at(c, B) + at(P, m) + at(C, m)) / m
    return static / depth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--exit", required=True)
    ap.add_argument("--max-batch", default="8")
    ap.add_argument("--rate", default="offline")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.max_batch.split(",")]
    report = {"run": a.run, "exit": a.exit, "by_batch": []}
    costs = step_costs(a.run, a.exit, max(batches))
    report["step_costs_s"] = costs
    for B in batches:
        res = bench_serve(a.run, rates=parse_rates(a.rate), requests=a.requests, new_tokens=a.new_tokens,
                          max_batch=B, runs=a.runs, exit=a.exit, threads=a.threads)
        for row in res["results"]:
            if row["batching"] == "depth" and "speedup" in row:
                row["overhead_bound"] = overhead_bound(costs, B, res["rounds"], row["mean_rounds"])
                row["overhead_share"] = row["speedup"] / row["overhead_bound"]
        report["by_batch"].append(res)
        print("\n".join(serve_lines(res)))
        for row in res["results"]:
            if "overhead_bound" in row:
                exit_row = next(r for r in res["results"] if r["batching"] == "exit" and r["rate"] == row["rate"])
                print(f"  rate {row['rate']}: depth / exit {row['tokens_per_s'] / exit_row['tokens_per_s']:.2f}x "
                      f"tokens/s, p50 latency {row['p50_latency_s'] / exit_row['p50_latency_s']:.2f}x; "
                      f"overhead bound {row['overhead_bound']:.2f}, share {row['overhead_share']:.2f}")
    print("step costs (ms):", {k: [round(t * 1e3, 3) for t in v] for k, v in costs.items() if k != "n"},
          "at n =", costs["n"])
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
