"""What one client can hold on `looplm serve`: the header deadline (a silent connection, header
bytes trickled, a kept-alive connection's next request trickled, a pipelined one left half-sent),
the body deadline (a stalled and a trickled body: 408), the connection cap (503 beyond it, the
held connections still served), the keep-alive timeout, a well-behaved client beside a few
hundred tricklers, a client that hangs up on a whole response (its rows freed at once), the file
limit raised for the cap, and the flags' validation and their way to uvicorn.

Each server is uvicorn in a thread on a free port of 127.0.0.1 with serve_bounds.uvicorn_options
(what `looplm serve` runs), timeouts short enough for the file to take seconds; clients are raw
sockets, so nothing on the client side completes or times out a request on its own. Every wait
is bounded, generously: the machine may be loaded.
"""

from __future__ import annotations

import http.client
import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import looplm
from looplm.data.tokenizer import ByteTokenizer
from looplm.inference.engine import Engine
from looplm.serve import ServeLimits, create_app
from looplm.serve_bounds import uvicorn_options

from conftest import save_untrained_run, uvicorn_in_thread

TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
        "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 3, "data.seq_len": 32}
ASK = json.dumps({"prompt": "hello", "max_tokens": 3, "temperature": 0}).encode()
SHORT = ServeLimits(header_timeout=0.5, body_timeout=0.6, keep_alive=0.3)
HEADER = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"p" * 100 + b"\r\n\r\n"
"""A request whose headers, one byte per 0.2 s, would take 26 s to send."""


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.manual_seed(0)
    return Engine(looplm.build_model(looplm.load_recipe("quickstart", overrides=TINY)).eval(), ByteTokenizer())


def running(engine: Engine, limits: ServeLimits):
    """The app under uvicorn with `limits`' connection bounds, in a thread: its port."""
    return uvicorn_in_thread(create_app(engine, model_name="tiny", limits=limits), **uvicorn_options(limits))


@pytest.fixture(scope="module")
def short(engine) -> Iterator[int]:
    """A server with a 0.5 s header deadline, a 0.6 s body deadline and 0.3 s of keep-alive."""
    with running(engine, SHORT) as port:
        yield port


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def until_closed(sock: socket.socket, limit: float = 8.0, trickle: bytes = b"", every: float = 0.2
                 ) -> tuple[float | None, bytes, int]:
    """Read `sock` until the server closes it or `limit` s pass, sending `trickle` one byte per
    `every` s meanwhile: (seconds until closed, or None if it stayed open; what the server sent;
    bytes trickled)."""
    t0, got, sent = time.monotonic(), b"", 0
    sock.setblocking(False)
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        next_byte = t0
        while time.monotonic() - t0 < limit:
            if sent < len(trickle) and time.monotonic() >= next_byte:
                try:
                    sock.send(trickle[sent:sent + 1])
                except OSError:                       # closed under us: the read below sees it
                    pass
                sent, next_byte = sent + 1, next_byte + every
            wait = max(0.0, min(next_byte - time.monotonic(), 0.05)) if sent < len(trickle) else 0.05
            if sel.select(wait):
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    return time.monotonic() - t0, got, sent
                got += chunk
    return None, got, sent


def status_of(reply: bytes) -> int | None:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else None


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(short):
    with connect(short) as s:
        closed, got, _ = until_closed(s)
    assert closed is not None, "a silent connection stayed open"
    assert 0.25 <= closed <= 5 and got == b"", (closed, got)      # closed, nothing said (no request came)


def test_headers_trickled_are_closed_at_the_header_timeout_though_bytes_keep_coming(short):
    """One header byte per 0.2 s keeps bytes arriving (no idle gap reaches 0.5 s): the connection
    is still closed 0.5 s after it opened, with a 408, long before the headers would be whole."""
    with connect(short) as s:
        closed, got, sent = until_closed(s, trickle=HEADER)
    assert closed is not None and 0.25 <= closed <= 5, closed
    assert status_of(got) == 408 and b"--header-timeout" in got, got
    assert sent < len(HEADER) // 2


def test_a_kept_alive_connections_next_request_is_held_to_the_header_timeout(short):
    """After a response on a kept-alive connection, the next request's bytes trickled in keep it
    past --keep-alive (0.3 s) but not past --header-timeout (0.5 s) from its first byte."""
    conn = http.client.HTTPConnection("127.0.0.1", short, timeout=10)
    conn.request("GET", "/health")
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("connection") != "close"
    r.read()
    closed, got, sent = until_closed(conn.sock, trickle=HEADER)
    conn.close()
    assert closed is not None and 0.25 <= closed <= 5 and status_of(got) == 408, (closed, got)
    assert sent >= 2                                  # bytes came after keep-alive's 0.3 s would have run out


def test_a_pipelined_request_left_half_sent_is_held_to_the_header_timeout(engine):
    """A whole request and the first half of a next one in one write: the first is answered, and
    the half-sent one is closed at the header deadline (0.5 s), well before keep-alive's 5 s."""
    with running(engine, ServeLimits(header_timeout=0.5, keep_alive=5)) as port, connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + HEADER[:30])
        closed, got, _ = until_closed(s)
    assert closed is not None and closed <= 3, closed
    assert status_of(got) == 200 and got.count(b"HTTP/1.1 ") == 2 and b"408 Request Timeout" in got, got


def test_an_idle_kept_alive_connection_is_closed_after_keep_alive(short):
    conn = http.client.HTTPConnection("127.0.0.1", short, timeout=10)
    conn.request("POST", "/v1/completions", body=ASK, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3
    closed, got, _ = until_closed(conn.sock)
    conn.close()
    assert closed is not None and closed <= 3 and got == b"", (closed, got)


def test_a_stalled_or_trickled_body_gets_408_at_the_body_timeout(short):
    """A body declared as 200 bytes: 20 sent and then nothing, or one byte per 0.1 s (never an
    idle gap, but not whole in time): 408 once 0.6 s have passed since the headers, then closed."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n")
    for first, trickle in ((b'{"prompt": "hello", ', b""), (b"", b" " * 200)):
        with connect(short) as s:
            s.sendall(head + first)
            closed, got, sent = until_closed(s, trickle=trickle, every=0.1)
        assert closed is not None and 0.3 <= closed <= 5, (closed, got)
        assert status_of(got) == 408 and b"--body-timeout" in got and b"connection: close" in got.lower(), got
        assert sent < 100


def test_beyond_max_connections_a_new_connection_gets_503_and_the_held_ones_are_served(engine):
    """With --max-connections 3: three held (one kept alive after a request, two silent), a fourth
    gets 503 at once and is closed; the kept-alive one is still served; once one closes, a new
    connection is served again."""
    with running(engine, ServeLimits(max_connections=3, header_timeout=20, keep_alive=20)) as port:
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        kept.request("GET", "/health")
        assert kept.getresponse().read() and kept.sock is not None
        silent = [connect(port), connect(port)]
        time.sleep(0.2)                               # let the server take them in
        t0 = time.monotonic()
        extra = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        extra.request("GET", "/health")
        r = extra.getresponse()
        body = json.loads(r.read())
        assert r.status == 503 and r.getheader("connection") == "close" and time.monotonic() - t0 < 5
        assert "--max-connections" in body["error"]["message"] and body["error"]["type"] == "server_error"
        extra.close()
        kept.request("GET", "/health")                # unlike uvicorn's limit_concurrency: still served
        assert kept.getresponse().status == 200
        silent.pop().close()
        time.sleep(0.2)                               # the server sees it go
        again = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        again.request("GET", "/health")
        assert again.getresponse().status == 200
        for c in (kept, again, *silent):
            c.close()


class Tricklers:
    """`n` connections, each sending HEADER one byte per 0.2 s from a thread until the server
    closes it (no reconnecting): how long each was held."""

    def __init__(self, port: int, n: int):
        self.t0 = time.monotonic()                    # before the first connects: held counts from here
        self.socks = [connect(port) for _ in range(n)]
        self.held: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for s in self.socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        sent, next_byte = 0, time.monotonic()
        while sel.get_map() and not self.stop.is_set():
            if time.monotonic() >= next_byte and sent < len(HEADER):
                for key in list(sel.get_map().values()):
                    try:
                        key.fileobj.send(HEADER[sent:sent + 1])      # type: ignore[union-attr]
                    except OSError:
                        pass
                sent, next_byte = sent + 1, next_byte + 0.2
            for key, _ in sel.select(0.05):
                try:
                    chunk = key.fileobj.recv(65536)                  # type: ignore[union-attr]
                except OSError:
                    chunk = b""
                if not chunk:
                    sel.unregister(key.fileobj)
                    self.held.append(time.monotonic() - self.t0)
        sel.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for s in self.socks:
            s.close()


def test_a_well_behaved_client_beside_300_tricklers_is_answered(engine):
    """300 connections trickle headers; a client meanwhile gets its completions (each within a
    generous 5 s) and its health checks; then the server closes every trickler at its header
    deadline (4 s), though each kept sending."""
    with running(engine, ServeLimits(header_timeout=4)) as port:
        tricklers = Tricklers(port, 300)
        try:
            answered = 0                                  # while every trickler was still held
            while time.monotonic() - tricklers.t0 < 3 and answered < 5:
                t0 = time.monotonic()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("POST", "/v1/completions", body=ASK, headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3
                conn.request("GET", "/health")
                assert conn.getresponse().status == 200
                conn.close()
                assert time.monotonic() - t0 < 5
                answered += not tricklers.held
            assert answered >= 1
            deadline = time.monotonic() + 15
            while len(tricklers.held) < 300 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(tricklers.held) == 300, f"{300 - len(tricklers.held)} tricklers still held"
            assert min(tricklers.held) >= 3.5, min(tricklers.held)
        finally:
            tricklers.close()


def test_a_client_that_hangs_up_on_a_whole_response_frees_its_rows_at_once():
    """A non-streamed request for 4,000 tokens (about a minute of decoding here) whose client
    closes its socket once the row runs: the server stops the row within a few seconds (it
    awaits ASGI's http.disconnect), so the client holds nothing after it has gone."""
    torch.manual_seed(0)
    model = looplm.build_model(looplm.load_recipe("quickstart", overrides={**TINY, "model.context": 4096})).eval()
    long = Engine(model, ByteTokenizer())
    with running(long, ServeLimits(max_tokens=4000)) as port:
        def in_flight() -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health")
            n = json.loads(conn.getresponse().read())["in_flight"]
            conn.close()
            return n

        never_ends = {str(ByteTokenizer().eos_id): -100}          # no early end-of-text
        ask = json.dumps({"prompt": "hi", "max_tokens": 4000, "temperature": 0, "logit_bias": never_ends}).encode()
        client = connect(port)
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(ask), ask))
        deadline = time.monotonic() + 10
        while in_flight() == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.05)
        client.close()
        gone = time.monotonic()
        while in_flight() and time.monotonic() - gone < 10:
            time.sleep(0.05)
        assert in_flight() == 0 and time.monotonic() - gone < 5, time.monotonic() - gone


@pytest.mark.parametrize("flag,value", [("--header-timeout", "0"), ("--header-timeout", "-1"),
                                        ("--header-timeout", "nan"), ("--body-timeout", "inf"),
                                        ("--body-timeout", "0"), ("--keep-alive", "-0.5"),
                                        ("--keep-alive", "7200"), ("--max-connections", "0")])
def test_bad_bound_values_exit_2_with_one_line(flag, value, tmp_path, capsys):
    from looplm.cli import main

    assert main(["serve", str(tmp_path / "no-run"), flag, value]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err and "Traceback" not in err, err


def test_the_file_limit_is_raised_to_hold_max_connections(monkeypatch):
    """The soft limit on open files is raised to --max-connections + FILE_HEADROOM (never past
    the hard limit, never lowered); a hard limit too low for the cap gets a warning naming the flag."""
    import resource

    from looplm.serve_bounds import FILE_HEADROOM, fit_file_limit

    for soft, hard, cap, set_to, warns in [(1024, 4096, 1024, 1024 + FILE_HEADROOM, False),
                                           (1024, 1100, 1024, 1100, True), (50_000, 90_000, 1024, None, False)]:
        limits = {"now": (soft, hard)}
        monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
        monkeypatch.setattr(resource, "setrlimit", lambda which, v: limits.__setitem__("now", v))
        warning = fit_file_limit(cap)
        assert limits["now"] == ((set_to, hard) if set_to is not None else (soft, hard))
        assert (warning is not None and "--max-connections" in warning) == warns, warning


def test_the_flags_reach_uvicorn_and_the_app(tmp_path, monkeypatch):
    """Through `looplm serve` (a real run; uvicorn.run replaced): the flags' defaults are
    ServeLimits', and the values given reach uvicorn (keep-alive, the bounded h11 protocol chosen
    explicitly, no WebSocket protocol) and the app (the body deadline)."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from looplm.cli import build_parser, main

    args = build_parser().parse_args(["serve", "run"])
    defaults = ServeLimits()
    for name in ("header_timeout", "body_timeout", "max_connections", "keep_alive"):
        assert getattr(args, name) == getattr(defaults, name), name
    save_untrained_run(tmp_path, TINY)
    bound: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: bound.append({"app": app, **kw}))
    monkeypatch.delenv("LOOPLM_API_KEY", raising=False)
    assert main(["serve", str(tmp_path), "--header-timeout", "2.5", "--body-timeout", "7", "--max-connections",
                 "9", "--keep-alive", "0"]) == 0
    (got,) = bound
    assert got["timeout_keep_alive"] == 0 and got["ws"] == "none" and issubclass(got["http"], H11Protocol)
    limits = got["app"].state.scheduler.limits
    assert (limits.header_timeout, limits.body_timeout, limits.max_connections) == (2.5, 7, 9)
