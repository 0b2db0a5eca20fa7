"""A long mixed load against a real `looplm serve`: statuses, latency, memory over time, and the
connections clients leave behind.

    python benchmarks/serve_soak.py [--minutes 10] [--run RUN] [--clients 24] [--requests N]
                                    [--hostile 200] [--check 200] [--threads 2]
                                    [--engine KEY=VALUE ...]
                                    [--header-timeout S] [--body-timeout S] [--max-connections N]
                                    [--keep-alive S] [--json]

Starts `looplm serve` on a run (default: the quickstart recipe's untrained weights saved in a temp
folder; serving costs the same trained or not) with `--max-batch 8 --max-concurrent 64` and the
connection bounds given (default: the server's own), then for `--minutes` (or until `--requests`
were sent) `--clients` threads each send one request after another. The requests mix what
clients send: text and token-id prompts of 1..110 tokens, n 1 or 2, greedy or sampled,
logprobs, echo, logit_bias, stop strings, streaming (some clients hang up after 3 lines), whole
responses some clients give up on 0.2 s in, and bodies made to be refused: a prompt and
max_tokens that do not fit the context, invalid JSON, wrong types (400), and bodies over the
1 MiB limit (413). `--engine` sets what every request runs, on the server and on the engine it is
checked against (repeatable): exit=entropy:5.0, decode_cache=last, prefill_cache=first,
missing=mask, speculative=1:4; prefill_chunk=8 goes to the server only.

Meanwhile `--hostile` connections hold what a client can: a quarter send nothing, a quarter
trickle a request's headers (a byte per 0.5 s), a quarter send the headers and part of a body and
stall, a quarter trickle a body; each opens again when the server closes it. When the load ends
they stop opening but hold on to what they have, and once the header and body deadlines (plus 5 s)
have passed the server's open connections are counted: its bounds should have closed every one.

The server's resident memory, its open connections and how long /health takes to answer are
sampled every second (progress every 30 s on stderr). Reports (one JSON object on stdout with
--json): requests by status (a client's own outcome, e.g. "hung up", by name), the count of
5xx, p50/p99 latency of the well-behaved requests answered in full, /health's p50 and most, RSS
at start and end, its most and growth (also since the warm-up: the first minute or quarter of the
run, whichever is shorter, when the first requests fill caches), the most connections the server held, those still open
at the end, and what the hostile connections got (replies, how long the server held each kind
at most). Checks, exit 1 when one fails: no 5xx and no status a request was not built for;
`--check` greedy one-choice answers read whole (spread over the run) equal the same requests
through the engine alone, in this process, after the load; no hostile connection held past its
deadline + 5 s + the most /health took (the event loop's lag: decode steps run on it, and the
deadlines' timers fire after them); no connection open at the end; nothing in flight on
/health at the end. Not a unit test (minutes, a subprocess, timing-dependent batch mates). An
earlier wave-by-wave form of this script found that a batch could take prompts that fit the
context each alone but not together, and oneDNN's primitive caches growing memory
(docs/benchmarks.md#serving-soak).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _runs import server, untrained_run

import looplm
from looplm.inference.engine import Engine, SamplingParams
from looplm.serve import ServeLimits

GOOD = frozenset({200, 429})
"""What a well-formed request may get: its answer, or 429 when 64 prompts are already in flight."""


@dataclass
class Ask:
    """One request of the mix and what it may get."""

    body: dict[str, Any] | None = None
    raw: bytes | None = None               # sent as is instead of `body` (not JSON, or too large)
    expect: frozenset[int | str] = GOOD
    hang_up: bool = False                  # a stream: after 3 lines; a whole response: 0.2 s in


def request(i: int, context: int) -> Ask:
    """Request i of the mix."""
    r = random.Random(i)
    roll = r.random()
    if roll < 0.04:
        return Ask(raw=b'{"prompt": "def f(x):", "max_tokens": ', expect=frozenset({400}))
    if roll < 0.07:
        return Ask(body={"prompt": 5, "max_tokens": "ten", "n": [1]}, expect=frozenset({400}))
    if roll < 0.09:          # over the 1 MiB body limit (413; the server may close before the client is done sending)
        return Ask(raw=json.dumps({"prompt": "x" * (1 << 20), "max_tokens": 1}).encode(),
                   expect=frozenset({413, "error: WriteError", "error: RemoteProtocolError"}))
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
    hang_up = i % 17 == 0 if body["stream"] else i % 23 == 0
    expect = (frozenset({400}) if too_long else GOOD) | ({"hung up"} if hang_up else set())
    return Ask(body=body, expect=expect, hang_up=hang_up)


def send(base: str, ask: Ask) -> tuple[int | str, str | None, float]:
    """(status, or the client's own outcome by name; the first choice's text when read whole and
    not streamed; seconds until the answer was read)."""
    t0 = time.perf_counter()
    url, headers = f"{base}/v1/completions", {"content-type": "application/json"}
    content = ask.raw if ask.raw is not None else json.dumps(ask.body).encode()
    try:
        if ask.body is not None and ask.body.get("stream"):
            with httpx.stream("POST", url, content=content, headers=headers, timeout=300) as s:
                for k, _ in enumerate(s.iter_lines()):
                    if ask.hang_up and k >= 3:
                        break
                return s.status_code, None, time.perf_counter() - t0
        timeout = httpx.Timeout(300, read=0.2) if ask.hang_up else 300
        r = httpx.post(url, content=content, headers=headers, timeout=timeout)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
        return r.status_code, text, time.perf_counter() - t0
    except httpx.ReadTimeout:
        if ask.hang_up:
            return "hung up", None, time.perf_counter() - t0
        return "error: ReadTimeout", None, time.perf_counter() - t0
    except httpx.HTTPError as err:
        return f"error: {type(err).__name__}", None, time.perf_counter() - t0


def rss_mib(pid: int) -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def server_connections(pid: int, port: int) -> int:
    """TCP connections to `port` that process `pid` holds open (Linux /proc; not the listener)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] != "0A" and cols[9] in inodes:
                count += 1                                    # 0A: LISTEN
    return count


class Sampler:
    """The server's RSS (MiB) and open connections every second, and how long /health takes to
    answer (the event loop's lag: a decode step runs on it, and so do the bounds' timers), in a thread."""

    def __init__(self, base: str, pid: int, port: int):
        self.base, self.pid, self.port = base, pid, port
        self.samples: list[tuple[float, float, int]] = []
        self.health_s: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def sample(self) -> tuple[float, float, int]:
        return time.monotonic(), rss_mib(self.pid), server_connections(self.pid, self.port)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as client:
            while not self.stop.is_set():
                self.samples.append(self.sample())
                t0 = time.perf_counter()
                try:
                    client.get("/health")
                    self.health_s.append(time.perf_counter() - t0)
                except httpx.HTTPError:
                    pass
                self.stop.wait(max(0.0, 1.0 - (time.perf_counter() - t0)))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


KINDS = ("silent", "header_trickle", "body_stall", "body_trickle")
HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n")


@dataclass
class Hostile:
    """`n` connections holding what a client can (KINDS in turn), from an asyncio loop in a thread;
    each opens again when the server closes it, until `settle()`."""

    port: int
    n: int
    reopen: bool = True
    held: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    replies: Counter = field(default_factory=Counter)
    open_now: int = 0
    opened: int = 0

    def __post_init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.futures = [asyncio.run_coroutine_threadsafe(self.one(KINDS[j % len(KINDS)]), self.loop)
                        for j in range(self.n)]

    async def one(self, kind: str) -> None:
        while self.reopen:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                self.replies[f"{kind}: connect failed"] += 1
                await asyncio.sleep(1)
                continue
            self.open_now, self.opened = self.open_now + 1, self.opened + 1
            t0 = time.monotonic()
            trickle = {"silent": b"", "header_trickle": HEAD, "body_stall": b"", "body_trickle": b" " * 1000}[kind]
            if kind in ("body_stall", "body_trickle"):
                writer.write(HEAD + (b'{"prompt": "x' if kind == "body_stall" else b""))
            dripping = asyncio.create_task(self.drip(writer, trickle))
            got = b""
            try:
                while chunk := await reader.read(65536):
                    got += chunk
            except OSError:
                pass
            finally:
                dripping.cancel()
                writer.close()
                self.open_now -= 1
            self.held[kind].append(time.monotonic() - t0)
            status = got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/1.1 ") else "closed"
            self.replies[f"{kind}: {status}"] += 1

    @staticmethod
    async def drip(writer: asyncio.StreamWriter, data: bytes) -> None:
        for k in range(len(data)):
            await asyncio.sleep(0.5)
            try:
                writer.write(data[k:k + 1])
            except OSError:
                return

    def settle(self, wait: float) -> int:
        """Open no more; wait up to `wait` s for the server to close the ones held: how many it did not."""
        self.reopen = False
        deadline = time.monotonic() + wait
        while self.open_now and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.open_now

    def close(self) -> None:
        for f in self.futures:
            f.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@dataclass
class Load:
    """Requests 0, 1, 2, ... of the mix from `clients` threads until `seconds` pass or `limit`
    requests were sent: each outcome, whether the request expected it, and the whole answers
    of greedy one-choice requests (to check against the engine)."""

    base: str
    context: int
    clients: int
    seconds: float
    limit: int | None
    codes: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    greedy: list[tuple[int, dict[str, Any], str]] = field(default_factory=list)
    sent: int = 0

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.t0 = time.monotonic()

    def run(self) -> None:
        self.t0 = time.monotonic()
        with ThreadPoolExecutor(self.clients) as pool:
            for f in [pool.submit(self.client) for _ in range(self.clients)]:
                f.result()

    def next_id(self) -> int | None:
        with self.lock:
            if time.monotonic() - self.t0 >= self.seconds or (self.limit is not None and self.sent >= self.limit):
                return None
            self.sent += 1
            return self.sent - 1

    def client(self) -> None:
        while (i := self.next_id()) is not None:
            ask = request(i, self.context)
            code, text, took = send(self.base, ask)
            with self.lock:
                self.codes[code] += 1
                if code not in ask.expect:
                    self.unexpected.append(f"request {i}: {code} (expected one of {sorted(map(str, ask.expect))})")
                body = ask.body
                if code == 200 and body is not None and not ask.hang_up:
                    self.latencies.append(took)
                    if text is not None and body["temperature"] == 0 and body["n"] == 1:
                        self.greedy.append((i, body, text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the load runs (default 10)")
    ap.add_argument("--run", help="a run folder (default: untrained quickstart weights in a temp folder)")
    ap.add_argument("--requests", type=int, help="stop after this many requests, if the minutes have not run out")
    ap.add_argument("--clients", type=int, default=24, help="concurrent well-behaved clients")
    ap.add_argument("--hostile", type=int, default=200, help="connections holding what a client can (0 = none)")
    ap.add_argument("--check", type=int, default=200,
                    help="greedy whole answers checked against the engine alone, spread over the run (default 200)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="exit, prefill_cache, decode_cache, missing, speculative or prefill_chunk")
    ap.add_argument("--header-timeout", type=float, help="the server's (default: its own, 10 s)")
    ap.add_argument("--body-timeout", type=float, help="the server's (default: its own, 30 s)")
    ap.add_argument("--max-connections", type=int, help="the server's (default: its own, 1024)")
    ap.add_argument("--keep-alive", type=float, help="the server's (default: its own, 5 s)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout (progress on stderr)")
    args = ap.parse_args()

    def log(*parts: Any) -> None:
        print(*parts, file=sys.stderr, flush=True)

    config = dict(kv.split("=", 1) for kv in args.engine)
    flags = [f for k, v in config.items() for f in ("--" + ("missing-kv" if k == "missing" else k.replace("_", "-")), v)]
    chunk = config.pop("prefill_chunk", None)
    bounds = {k: getattr(args, k) for k in ("header_timeout", "body_timeout", "max_connections", "keep_alive")
              if getattr(args, k) is not None}
    limits = ServeLimits(**bounds)                       # the server's, with its defaults filled in
    flags += [f for k, v in bounds.items() for f in ("--" + k.replace("_", "-"), str(v))]
    tmp = tempfile.TemporaryDirectory(prefix="serve_soak_")
    run_dir = Path(args.run) if args.run else untrained_run(Path(tmp.name) / "quickstart")
    run = looplm.load_run(run_dir)
    engine, context = Engine.from_run(run, **config), run.recipe.model.context
    log(f"server flags: {' '.join(flags) or '(none)'}" + (f" (prefill chunk {chunk})" if chunk else ""))
    failures: list[str] = []
    with server(run_dir, Path(tmp.name) / "server.log", args.threads,
                "--max-batch", "8", "--max-concurrent", "64", *flags) as (base, pid):
        port = int(base.rsplit(":", 1)[1])
        sampler = Sampler(base, pid, port)
        hostile = Hostile(port, args.hostile) if args.hostile else None
        load = Load(base, context, args.clients, args.minutes * 60, args.requests)
        worker = threading.Thread(target=load.run)
        try:
            worker.start()
            while worker.is_alive():
                worker.join(timeout=30)
                _, rss, conns = sampler.sample()
                done = sum(load.codes.values())
                log(f"{time.monotonic() - load.t0:5.0f} s: {done} requests ({done / (time.monotonic() - load.t0):.1f}/s), "
                    f"{dict(sorted(load.codes.items(), key=str))}, server rss {rss:.0f} MiB, {conns} connections"
                    + (f" ({hostile.open_now} hostile)" if hostile else ""))
            load_s = time.monotonic() - load.t0
            wait = max(limits.header_timeout, limits.body_timeout) + 5
            log(f"load done after {load_s:.0f} s; waiting up to {wait:g} s for the server to close what hostile "
                "connections hold")
            never_closed = hostile.settle(wait) if hostile else 0
            health = httpx.get(f"{base}/health", timeout=10).json()
            sampler.close()                                 # its own kept-alive connection goes too
            time.sleep(max(limits.keep_alive, 0.5) + 1)     # as do the clients' idle kept-alive ones
            still_open = server_connections(pid, port)
            end = sampler.sample()
        finally:
            if hostile:
                hostile.close()
            sampler.close()
    failures += load.unexpected
    step = max(1, len(load.greedy) // max(args.check, 1))
    checked = load.greedy[::step][:args.check]
    log(f"checking {len(checked)} greedy answers against the engine alone ...")
    for i, body, text in checked:
        params = SamplingParams(max_new_tokens=body["max_tokens"], seed=body["seed"],
                                logit_bias={int(k): v for k, v in body.get("logit_bias", {}).items()},
                                stop=tuple(body.get("stop", ())))
        alone = engine.generate([body["prompt"]], params)[0].text
        prompt = body["prompt"] if isinstance(body["prompt"], str) else run.tokenizer.decode(body["prompt"])
        if text != (prompt if body.get("echo") else "") + alone:
            failures.append(f"request {i}: the server's answer differs from the engine alone")
    samples = sampler.samples + [end]
    rss = [s[1] for s in samples]
    warm_at = load.t0 + min(60.0, load_s / 4)          # first requests warm caches up: growth after that is the leak
    warm = next((s[1] for s in samples if s[0] >= warm_at), rss[-1])
    lag = max(sampler.health_s, default=0.0)
    if hostile:             # a timer fires late by as much as the event loop lags (a decode step runs on it)
        deadline = {"silent": limits.header_timeout, "header_trickle": limits.header_timeout,
                    "body_stall": limits.body_timeout, "body_trickle": limits.body_timeout}
        for kind, held in hostile.held.items():
            if held and max(held) > deadline[kind] + lag + 5:
                failures.append(f"a {kind} connection was held {max(held):.1f} s (deadline {deadline[kind]:g} s, "
                                f"the event loop lagging up to {lag:.1f} s)")
    if never_closed:
        failures.append(f"{never_closed} hostile connections still open {wait:g} s after the load")
    if still_open:
        failures.append(f"{still_open} connections open on the server at the end")
    if health.get("in_flight") or health.get("running_batches"):
        failures.append(f"/health at the end: {health}")
    codes = load.codes
    fives = sum(n for code, n in codes.items() if isinstance(code, int) and code >= 500)
    report = {
        "minutes": round(load_s / 60, 2), "clients": args.clients, "hostile": args.hostile,
        "server": {"header_timeout": limits.header_timeout, "body_timeout": limits.body_timeout,
                   "max_connections": limits.max_connections, "keep_alive": limits.keep_alive},
        "requests": {"total": sum(codes.values()), "per_s": round(sum(codes.values()) / load_s, 2),
                     "by_status": {str(k): v for k, v in sorted(codes.items(), key=str)}, "5xx": fives,
                     "checked_against_engine": len(checked)},
        "latency_s": {"count": len(load.latencies), "p50": percentile(load.latencies, 0.5),
                      "p99": percentile(load.latencies, 0.99)},
        "health_latency_s": {"p50": percentile(sampler.health_s, 0.5), "max": lag},
        "rss_mib": {"start": rss[0], "end": rss[-1], "max": max(rss), "growth": rss[-1] - rss[0],
                    "warm": warm, "growth_since_warm": rss[-1] - warm},
        "connections": {"server_max": max(s[2] for s in samples), "still_open_at_end": still_open,
                        "hostile_opened": hostile.opened if hostile else 0,
                        "hostile_never_closed": never_closed,
                        "hostile_replies": dict(sorted(hostile.replies.items())) if hostile else {},
                        "hostile_held_max_s": {k: round(max(v), 2) for k, v in hostile.held.items() if v}
                        if hostile else {}},
        "health_at_end": health, "failures": failures,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
        for line in failures[:20]:
            print("FAILED", line)
        print(f"{len(failures)} failed checks")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
