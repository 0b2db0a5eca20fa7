"""Scoring through `looplm serve` as lm-evaluation-harness does it: requests per second.

    python benchmarks/bench_scoring.py [--run RUN] [--requests 240] [--runs 3] [--threads 2]

lm-evaluation-harness's `local-completions` model scores a continuation by sending the token ids
of context + continuation with `echo: true, logprobs: 1, max_tokens: 1, temperature: 0` and
summing the echoed prompt's log-probabilities; with `--batch_size N` one request carries N
prompts. This starts a real server (uvicorn on 127.0.0.1, `--max-batch 8`) on a run (default:
the quickstart recipe's untrained weights, saved into a temp folder; speed does not depend on
training) and sends `--requests` such prompts (48..112 tokens) one request at a time, with 1 and
with 8 prompts per request, timing each sweep `--runs` times (median). It checks that every
prompt's figures are the same whichever way it was sent.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from _runs import server, untrained_run


def _sweep(client: httpx.Client, base: str, prompts: list[list[int]], per_request: int
           ) -> tuple[float, list[list[float]]]:
    """Seconds to score every prompt, `per_request` prompts a request, and each prompt's logprobs."""
    figures = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), per_request):
        body = {"prompt": prompts[i:i + per_request], "max_tokens": 1, "temperature": 0, "logprobs": 1,
                "echo": True, "seed": 1234}
        r = client.post(f"{base}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        for c in sorted(r.json()["choices"], key=lambda c: c["index"]):
            figures.append(c["logprobs"]["token_logprobs"][1:-1])
    return time.perf_counter() - t0, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a run folder (default: untrained quickstart weights in a temp folder)")
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="bench_scoring_")
    run = Path(args.run) if args.run else untrained_run(Path(tmp.name) / "quickstart")
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(48, 112))] for _ in range(args.requests)]
    with server(run, Path(tmp.name) / "server.log", args.threads, "--max-batch", "8") as (base, _):
        client = httpx.Client()                                        # one connection, as lm-eval keeps
        _sweep(client, base, prompts[:16], 8)                          # warm-up
        times: dict[int, list[float]] = {1: [], 8: []}
        figures: dict[int, list[list[float]]] = {}
        for _ in range(args.runs):                                     # interleaved
            for n in times:
                seconds, figures[n] = _sweep(client, base, prompts, n)
                times[n].append(seconds)
    worst = max(abs(a - b) for x, y in zip(figures[1], figures[8]) for a, b in zip(x, y))
    print(f"{args.requests} prompts of 48..112 tokens, echo + logprobs 1 + max_tokens 1, {args.threads} thread(s), "
          f"median of {args.runs}")
    for n, ts in times.items():
        t = statistics.median(ts)
        print(f"  {n} prompt(s) per request: {t:6.2f} s, {args.requests / t:6.1f} prompts/s")
    print(f"  largest difference between the two ways' log-probabilities: {worst:.1e}")


if __name__ == "__main__":
    main()
