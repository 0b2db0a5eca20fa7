"""What one client can hold open on `looplm serve`: the HTTP protocol uvicorn runs it with.

uvicorn's own settings leave a connection that never completes a request unbounded: its
keep-alive timer starts only once a response is done (and any byte received stops it), and
`limit_concurrency` answers 503 only to a request whose headers have arrived, counting every
open connection and task, so a flood of idle connections turns away the clients already being
served. So `serve()` runs uvicorn with `uvicorn_options(limits)`: uvicorn's h11 protocol (named
explicitly, so whether httptools is installed changes nothing) subclassed with

- a header deadline (`--header-timeout`): a connection's request line and headers must be
  complete within that many seconds of its connecting, or, on a kept-alive connection, of the
  first byte after its previous response (so that `--keep-alive` alone bounds the idle wait
  between requests); else it is closed, after a 408 when part of a request came;
- a connection cap (`--max-connections`): a connection opened while that many are held is
  answered 503 (`Connection: close`) as soon as its request's headers are in, and its own
  header deadline still bounds it when they never come; the connections already held keep
  being served;

plus uvicorn's keep-alive timeout from `--keep-alive` and no WebSocket protocol (the app has no
WebSocket routes, and an upgraded connection would leave this protocol's bounds). The body's
deadline is the ASGI gate's (serve._Gate: 408 and closed).

What this relies on beyond uvicorn's documented Config (`http` taking a protocol class, `ws`,
`timeout_keep_alive`) and asyncio's Protocol methods (`connection_made`, `data_received`,
`connection_lost`, which the subclass extends and calls through): H11Protocol's `conn` (its
`h11.Connection`) and `app` (the ASGI app it runs a request with, read when the request's headers
are in) attributes and its `on_response_complete()` hook, all with these names from uvicorn's
first h11 protocol to 0.55 (the newest released as this is written, and the pinned one); from
h11, the public `Connection.their_state` and `trailing_data`. tests/test_serve_bounds.py
exercises each bound against a real server, so a uvicorn that changes them fails there. Without
the hook, a pipelined request that stalls half-sent would still be closed, by the keep-alive timer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from .serve import ServeLimits, _error

FILE_HEADROOM = 256
"""File descriptors kept beyond --max-connections for everything else (the listening socket,
the run's files, torch's and the logs')."""


def _late_reply(header_timeout: float) -> bytes:
    """The 408 a connection gets whose headers came in part but not in time (written raw: no
    request was parsed for h11 to answer)."""
    body = json.dumps({"error": {"message": f"request headers not complete within {header_timeout:g} s "
                                            "(--header-timeout)", "type": "invalid_request_error",
                                 "param": None, "code": None}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))


def protocol_class(limits: ServeLimits) -> type[asyncio.Protocol]:
    """An HTTP/1.1 protocol class for one uvicorn server, bounded by `limits` (the connections it
    holds are counted per class, so each server needs its own)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    held: set[asyncio.Protocol] = set()          # this server's connections under the cap
    late = _late_reply(limits.header_timeout)
    busy = _error(503, f"server busy: {limits.max_connections} connections open (--max-connections); "
                       "retry later", None, "server_error", headers={"Connection": "close", "Retry-After": "1"})

    class BoundedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with a header deadline and a connection cap (see the module)."""

        _header_timer: asyncio.TimerHandle | None = None
        _transport: asyncio.BaseTransport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            super().connection_made(transport)   # type: ignore[arg-type]
            self._transport = transport
            if len(held) < limits.max_connections:
                held.add(self)
            else:
                self.app = busy                  # what uvicorn runs once this connection's headers are in
            self._start_header_clock()

        def connection_lost(self, exc: Exception | None) -> None:
            held.discard(self)
            self._stop_header_clock()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._start_header_clock()       # the first byte of a kept-alive connection's next request
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._stop_header_clock()        # headers complete (or refused as malformed)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # A pipelined request that came in part while the last response ran: its clock starts now.
            if (self._header_timer is None and self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]
                    and not self._closing()):
                self._start_header_clock()

        def _closing(self) -> bool:
            return self._transport is None or self._transport.is_closing()

        def _start_header_clock(self) -> None:
            self._stop_header_clock()
            self._header_timer = asyncio.get_running_loop().call_later(limits.header_timeout, self._headers_late)

        def _stop_header_clock(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self._closing() or self.conn.their_state is not h11.IDLE:
                return
            assert self._transport is not None
            if self.conn.trailing_data[0]:       # part of a request came: say why it is closed
                self._transport.write(late)  # type: ignore[attr-defined]
            self._transport.close()

    return BoundedH11Protocol


def uvicorn_options(limits: ServeLimits) -> dict[str, Any]:
    """The keyword arguments of `uvicorn.run` / `uvicorn.Config` that apply `limits`' connection
    bounds (the header deadline, the cap, keep-alive; the body deadline is the app's)."""
    return {"http": protocol_class(limits), "ws": "none", "timeout_keep_alive": limits.keep_alive}


def fit_file_limit(max_connections: int) -> str | None:
    """Raise this process's soft limit on open files to hold `max_connections` connections and
    FILE_HEADROOM more (up to the hard limit; never lowered). A warning naming --max-connections
    when the hard limit is too low (beyond it, accepting fails before the cap is reached), else None."""
    try:
        import resource
    except ImportError:                          # not a POSIX system: its own limits apply
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FILE_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft != resource.RLIM_INFINITY and soft < need:
        return (f"looplm: warning: --max-connections {max_connections} needs {need} open files, but this process "
                f"may open {soft} (ulimit -n); connections beyond about {max(soft - FILE_HEADROOM, 0)} will fail "
                "to be accepted instead of getting 503")
    return None
