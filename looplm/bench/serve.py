"""`looplm bench serve RUN`: the server's batchings under load, side by side in one run.

The same request trace is served by the server's own scheduler (inference/scheduler.py, as `looplm serve`
runs it, without HTTP) once per batching, `runs` times in turns (exit, static, depth, exit, ...) after one
warm-up each; medians are reported.

Trace. `requests` prompts cut from the run's held-out text (`looplm eval`'s windows, or --data): each a
seeded length between half and all of `prompt_tokens`, each asking for a seeded number of greedy tokens
between a quarter and all of `new_tokens` (requests end at different steps, as real ones do; eos does not
stop them, so every batching decodes the same tokens). Arrivals: a seeded Poisson
process at each `rate` (requests per second; the same arrival times for every batching), or "offline":
every request at time 0. Timing is the wall clock: a request is submitted when the clock passes its
arrival, and its latency counts from its arrival, not from when the scheduler noticed it.

Per (rate, batching), medians over the runs of:
- requests_per_s, tokens_per_s: requests and generated tokens over the makespan (first arrival to last
  token);
- p50_latency_s, p99_latency_s: arrival to last token, per request; ttft_p50_s: arrival to first token;
- mean_batch_rows: the recurrent batch, counted where the rounds run (the kernels' one-column rounds and
  the rows each held);
- mean_rounds: the rounds the decoded tokens ran (the exit distribution this batching realised);
- flop_bound_speedup: (F0 + R Fr) / (F0 + d Fr), F0 the FLOPs of a token's prelude, coda and head, Fr
  one round's, R the largest depth and d `mean_rounds` (model/flops.py at the trace's mean column);
- speedup: tokens_per_s over static's at the same rate (when static ran), and bound_share = speedup /
  flop_bound_speedup;
- tokens_per_round: decoded tokens per one-column round run; over static's, `memory_bound_speedup`: the
  speed-up where a round costs the same whatever its rows (a memory-bound device), from counts, not time;
- tokens_match_exit (depth): every request's tokens equal exit batching's, in every run.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from typing import Any

import torch

from ..errors import UserError

METRICS = ("requests_per_s", "tokens_per_s", "p50_latency_s", "p99_latency_s", "ttft_p50_s", "mean_batch_rows",
           "mean_rounds", "tokens_per_round")


def parse_rates(text: str) -> list[float]:
    """"offline" or positive requests per second, comma-separated (offline = inf: every request at time 0)."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if part == "offline":
            out.append(math.inf)
            continue
        try:
            r = float(part)
        except ValueError:
            r = math.nan
        if not (r > 0 and math.isfinite(r)):
            raise UserError(f"--rate {text!r}: expected comma-separated positive requests per second or offline")
        out.append(r)
    return out


def parse_batchings(text: str) -> list[str]:
    from ..inference.capabilities import BATCHINGS
    got = [b.strip() for b in str(text).split(",") if b.strip()]
    bad = [b for b in got if b not in BATCHINGS]
    if not got or bad or len(set(got)) != len(got):
        raise UserError(f"--batching {text!r}: expected comma-separated, distinct {', '.join(BATCHINGS)}")
    return got


def trace(run: Any, requests: int, prompt_tokens: int, seed: int, data: str | None = None) -> list[list[int]]:
    """`requests` prompts from the run's held-out text: seeded lengths in [prompt_tokens/2, prompt_tokens]."""
    from ..evaluation.recirculation import heldout_windows
    seq = run.recipe.data.seq_len
    if not 1 <= prompt_tokens <= seq:
        raise UserError(f"--prompt-tokens {prompt_tokens}: must lie in 1..{seq} (the run's data.seq_len)")
    windows = heldout_windows(run, tokens=requests * seq, data=data)
    rows = torch.cat([x for x, _ in windows])                        # (N, seq)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, prompt_tokens // 2), prompt_tokens + 1, (requests,), generator=g).tolist()
    return [rows[i % rows.shape[0], :n].tolist() for i, n in enumerate(lengths)]


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Seconds from the start at which each request arrives: a Poisson process at `rate`, or all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    g = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n, dtype=torch.float64).exponential_(rate, generator=g)
    return torch.cumsum(gaps, 0).sub(gaps[0]).tolist()               # the first request at 0


def flop_bound(cfg: Any, rounds: int, mean_rounds: float, column: int) -> float:
    """(F0 + R Fr) / (F0 + d Fr) at cache column `column` (model/flops.py's per-token FLOPs)."""
    from ..model.flops import DecodeWork

    def per_token(r: int) -> float:
        w = DecodeWork(cfg)
        w.add("decode", column, r)
        return w.total()
    f1, f2 = per_token(1), per_token(2)
    fr = f2 - f1
    f0 = f1 - fr
    return (f0 + rounds * fr) / (f0 + mean_rounds * fr)


def new_tokens_of(requests: int, new_tokens: int, seed: int) -> list[int]:
    """Each request's max_new_tokens: seeded in [new_tokens/4, new_tokens], at least 2 (one decoded token: the
    first comes from the prefill, and the batchings differ in the decoded ones)."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(max(2, new_tokens // 4), new_tokens + 1, (requests,), generator=g).tolist()


def serve_trace(engine: Any, prompts: list[list[int]], times: list[float], new_tokens: list[int], max_batch: int
                ) -> dict[str, Any]:
    """Serve the trace with the server's scheduler (one batch of `max_batch` rows); per-request timings."""
    from types import SimpleNamespace

    from ..inference.sampler import SamplingParams
    from ..inference.scheduler import Row, Scheduler

    limits = SimpleNamespace(max_batch=max_batch, max_batches=1, prefill_chunk=0, max_concurrent=len(prompts))
    sched = Scheduler(engine, limits)
    k = engine.kernels()
    rounds0, rows0 = k.column_rounds, k.column_round_rows
    n = len(prompts)
    first = [math.nan] * n
    last = [math.nan] * n
    tokens = [0] * n
    out: list[list[int]] = [[] for _ in range(n)]
    used: list[int] = []
    failed: list[BaseException] = []

    def sender(i: int):
        def send(ev: Any) -> None:
            if isinstance(ev, BaseException):
                failed.append(ev)
                return
            now = time.perf_counter() - t0
            if tokens[i] == 0:
                first[i] = now
            else:
                used.append(ev.rounds)          # decoded tokens' rounds (the first token is the prompt's)
            tokens[i] += 1
            out[i].append(ev.token)
            last[i] = now
        return send

    t0 = time.perf_counter()
    i = 0
    while i < n or sched.busy:
        now = time.perf_counter() - t0
        while i < n and times[i] <= now:
            sched.submit(Row(ids=prompts[i], params=SamplingParams(max_new_tokens=new_tokens[i], stop_at_eos=False),
                             send=sender(i)))
            i += 1
        if sched.busy:
            sched.tick()
        elif i < n:
            time.sleep(max(0.0, times[i] - (time.perf_counter() - t0)))
    if failed:
        raise failed[0]
    span = max(last) - times[0]
    lat = sorted(b - a for a, b in zip(times, last))
    ttft = sorted(f - a for a, f in zip(times, first))
    rounds, rows = k.column_rounds - rounds0, k.column_round_rows - rows0
    decoded = sum(tokens) - n
    return {"requests_per_s": n / span, "tokens_per_s": sum(tokens) / span,
            "p50_latency_s": _quantile(lat, 0.5), "p99_latency_s": _quantile(lat, 0.99),
            "ttft_p50_s": _quantile(ttft, 0.5), "mean_batch_rows": rows / max(rounds, 1),
            "mean_rounds": statistics.fmean(used) if used else float(engine.rounds),
            "tokens_per_round": decoded / max(rounds, 1), "makespan_s": span, "tokens": out}


def _quantile(xs: list[float], q: float) -> float:
    """The q-quantile of sorted xs (linear between neighbours)."""
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bench_serve(run_dir: str, *, batchings: list[str] | None = None, rates: list[float] | None = None,
                requests: int = 64, new_tokens: int = 32, prompt_tokens: int = 32, max_batch: int = 8,
                runs: int = 3, exit: str | None = None, seed: int = 0, threads: int = 0, data: str | None = None,
                device: str | None = "cpu") -> dict[str, Any]:
    """The batchings side by side on one trace per rate (see the module docstring)."""
    from ..inference.capabilities import check_batching
    from ..inference.engine import Engine
    from ..runs.checkpoint import load_run

    batchings = batchings or ["exit", "static", "depth"]
    rates = rates or [math.inf]
    for name, value, low in (("--requests", requests, 1), ("--new-tokens", new_tokens, 2),
                             ("--max-batch", max_batch, 1), ("--runs", runs, 1), ("--threads", threads, 0)):
        if value < low:
            raise UserError(f"{name} {value}: must be >= {low}")
    if threads:
        torch.set_num_threads(threads)
    run = load_run(run_dir, device=device)
    options = {} if exit is None else {"exit": exit}
    R = Engine.from_run(run, **options).rounds                     # the largest depth of the exit policy
    engines = {}
    for b in batchings:                 # static: every token at that depth (the policy does not apply to it)
        eng = Engine.from_run(run, batching=b, **(options if b != "static" else {"exit": "fixed", "rounds": R}))
        check_batching(eng, b)
        engines[b] = eng
    prompts = trace(run, requests, prompt_tokens, seed, data)
    lengths = new_tokens_of(requests, new_tokens, seed)
    ctx = run.recipe.model.context
    if max(map(len, prompts)) + new_tokens - 1 > ctx:
        raise UserError(f"--prompt-tokens {prompt_tokens} + --new-tokens {new_tokens}: exceed the context of {ctx}")
    column = int(statistics.fmean(map(len, prompts)) + new_tokens / 2)
    with torch.inference_mode():
        for b in batchings:                    # warm-up: oneDNN primitives, allocator
            serve_trace(engines[b], prompts[:max_batch], [0.0] * min(max_batch, len(prompts)), [2] * max_batch,
                        max_batch)
    results = []
    for rate in rates:
        times = arrivals(rate, requests, seed)
        trials: dict[str, list[dict[str, Any]]] = {b: [] for b in batchings}
        for _ in range(runs):
            for b in batchings:
                trials[b].append(serve_trace(engines[b], prompts, times, lengths, max_batch))
        rows = {}
        for b in batchings:
            med = {k: statistics.median(t[k] for t in trials[b]) for k in METRICS}
            rows[b] = {"batching": b, "rate": "offline" if math.isinf(rate) else rate, **med,
                       "flop_bound_speedup": flop_bound(run.model.cfg, R, med["mean_rounds"], column),
                       "runs": runs}
        if "exit" in rows:          # the same greedy tokens as exit batching, request by request (every run)
            for b in batchings:
                if b != "static":
                    rows[b]["tokens_match_exit"] = all(t["tokens"] == e["tokens"]
                                                       for t, e in zip(trials[b], trials["exit"]))
        if "static" in rows:
            base = rows["static"]
            for row in rows.values():
                row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
                row["bound_share"] = row["speedup"] / row["flop_bound_speedup"]
                row["memory_bound_speedup"] = row["tokens_per_round"] / base["tokens_per_round"]
        results += list(rows.values())
    return {"run": str(run_dir), "rounds": R, "exit": str(Engine.from_run(run, **options).policy), "requests": requests,
            "new_tokens": new_tokens, "prompt_tokens": prompt_tokens, "max_batch": max_batch, "runs": runs,
            "threads": torch.get_num_threads(), "machine": platform.machine(), "results": results}


def serve_lines(result: dict[str, Any]) -> list[str]:
    """The table `looplm bench serve` prints."""
    lines = [f"{result['run']}: R = {result['rounds']}, exit {result['exit']}, {result['requests']} requests x "
             f"<= {result['new_tokens']} tokens, {result['max_batch']} rows, medians of {result['runs']} runs, "
             f"{result['threads']} threads",
             f"{'rate':>8} {'batching':>8} {'req/s':>7} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7} {'ttft s':>7} "
             f"{'rows':>5} {'rounds':>6} {'speedup':>7} {'bound':>6} {'share':>6} {'mem-bound':>9}"]
    for r in result["results"]:
        rate = r["rate"] if isinstance(r["rate"], str) else f"{r['rate']:g}"
        extra = (f"{r['speedup']:7.2f} {r['flop_bound_speedup']:6.2f} {r['bound_share']:6.2f} "
                 f"{r['memory_bound_speedup']:9.2f}" if "speedup" in r else f"{'':7} {r['flop_bound_speedup']:6.2f}")
        lines.append(f"{rate:>8} {r['batching']:>8} {r['requests_per_s']:7.2f} {r['tokens_per_s']:8.1f} "
                     f"{r['p50_latency_s']:7.3f} {r['p99_latency_s']:7.3f} {r['ttft_p50_s']:7.3f} "
                     f"{r['mean_batch_rows']:5.2f} {r['mean_rounds']:6.2f} {extra}")
    return lines
