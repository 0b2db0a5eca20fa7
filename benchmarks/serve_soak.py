"""Many mixed requests against a real `looplm serve`: errors, answers, memory over time.

    python benchmarks/serve_soak.py [--run RUN] [--waves 8] [--requests 200] [--clients 24] [--threads 2]
                                    [--engine KEY=VALUE ...]

Starts a server on a run (default: the quickstart recipe's untrained weights in a temp folder)
with `--max-batch 8 --max-concurrent 64`, and sends `--waves` waves of `--requests` requests from
`--clients` threads at once. The requests mix what clients send: text and token-id prompts of
1..110 tokens, n 1 or 2, greedy or sampled, logprobs, echo, logit_bias, stop strings, streaming
(a few clients hang up mid-stream), and some made to be refused (a prompt and max_tokens that do
not fit the context: 400). Prompts of different lengths and token counts meet in batches and
join running ones (continuous batching). `--engine` sets what every request runs, on the server
and on the engine it is checked against (repeatable): exit=entropy:5.0, decode_cache=last,
prefill_cache=first, missing=mask, speculative=1:4 (exit=fixed:2 for fewer rounds);
prefill_chunk=8 goes to the server only (chunking does not change what is computed).

Reports per wave: the status codes, requests/s and the server's resident memory; at the end, the
server's /health. Checks: no status but 200, the 400s asked for and 429s (more than 64 in
flight); every refused request was one built to be refused; each greedy one-choice answer that
was read whole equals the same request through the engine alone, in this process. Exits 1 when a
check fails. Not a unit test (minutes, a subprocess, timing-dependent batch mates); a 3,200-request
run found that a batch could take prompts that fit the context each alone but not together.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from _runs import server, untrained_run

import looplm
from looplm.inference.engine import Engine, SamplingParams


def request(i: int, context: int) -> tuple[dict, bool]:
    """Request i of the mix, and whether it was built to be refused (400)."""
    r = random.Random(i)
    length = r.randint(1, 110)
    prompt: str | list[int] = ("def f(x):\n    return x" * 9)[:length] if r.random() < 0.7 \
        else [r.randrange(256) for _ in range(length)]
    too_long = r.random() < 0.05
    max_tokens = context - length + 5 if too_long else r.randint(1, min(40, context - length + 1))
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": r.choice([0, 0, 0.8]), "seed": i,
            "n": r.choice([1, 1, 2]), "stream": r.random() < 0.4}
    if r.random() < 0.3:
        body["logprobs"] = r.randint(0, 3)
        body["echo"] = r.random() < 0.3
    if r.random() < 0.2:
        body["logit_bias"] = {"10": -100, str(r.randrange(256)): r.uniform(-5, 5)}
    if r.random() < 0.2:
        body["stop"] = ["\n\n", "return"]
    return body, too_long


def send(base: str, body: dict, hang_up: bool) -> tuple[int, str | None]:
    """(status, the first choice's text when read whole and not streamed)."""
    if body["stream"]:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as s:
            for k, _ in enumerate(s.iter_lines()):
                if hang_up and k >= 3:
                    break
            return s.status_code, None
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else None


def rss_mib(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a run folder (default: untrained quickstart weights in a temp folder)")
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="exit, prefill_cache, decode_cache, missing, speculative or prefill_chunk")
    args = ap.parse_args()
    config = dict(kv.split("=", 1) for kv in args.engine)
    flags = [f for k, v in config.items() for f in ("--" + ("missing-kv" if k == "missing" else k.replace("_", "-")), v)]
    chunk = config.pop("prefill_chunk", None)
    tmp = tempfile.TemporaryDirectory(prefix="serve_soak_")
    run_dir = Path(args.run) if args.run else untrained_run(Path(tmp.name) / "quickstart")
    run = looplm.load_run(run_dir)
    engine, context = Engine.from_run(run, **config), run.recipe.model.context
    print(f"server flags: {' '.join(flags) or '(none)'}" + (f" (prefill chunk {chunk})" if chunk else ""))
    failures: list[str] = []
    with server(run_dir, Path(tmp.name) / "server.log", args.threads,
                "--max-batch", "8", "--max-concurrent", "64", *flags) as (base, pid):
        for wave in range(args.waves):
            ids = range(wave * args.requests, (wave + 1) * args.requests)
            built = [request(i, context) for i in ids]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                got = list(pool.map(lambda ib: send(base, ib[1][0], ib[0] % 17 == 0), zip(ids, built)))
            seconds = time.perf_counter() - t0
            codes = Counter(code for code, _ in got)
            for i, (body, too_long), (code, text) in zip(ids, built, got):
                if code not in (200, 400, 429) or (code == 400) != too_long:
                    failures.append(f"request {i}: {code} ({'built to be refused' if too_long else 'should fit'})")
                elif code == 200 and text is not None and body["temperature"] == 0 and body["n"] == 1:
                    params = SamplingParams(max_new_tokens=body["max_tokens"], seed=body["seed"],
                                            logit_bias={int(k): v for k, v in body.get("logit_bias", {}).items()},
                                            stop=tuple(body.get("stop", ())))
                    alone = engine.generate([body["prompt"]], params)[0].text
                    prompt = body["prompt"] if isinstance(body["prompt"], str) else run.tokenizer.decode(body["prompt"])
                    if text != (prompt if body.get("echo") else "") + alone:
                        failures.append(f"request {i}: the server's answer differs from the engine alone")
            print(f"wave {wave}: {dict(sorted(codes.items()))}, {args.requests / seconds:5.1f} requests/s, "
                  f"server rss {rss_mib(pid)} MiB", flush=True)
        print("health:", httpx.get(f"{base}/health", timeout=10).json())
    for line in failures[:20]:
        print("FAILED", line)
    print(f"{len(failures)} failed checks")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
