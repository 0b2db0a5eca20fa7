"""`looplm serve RUN`: an OpenAI-compatible completions server over the cached engine.

    POST /v1/completions   {"prompt": "...", "max_tokens": 32, "temperature": 0, "stream": false, ...}
    POST /v1/chat/completions  {"messages": [{"role": "user", "content": "..."}], ...}: the messages through
                           the model's chat template (an imported chat model's; data/chat.py), then the same
                           sampling, limits, key and scheduler as a completion; streamed as
                           chat.completion.chunk deltas (the first names the role)
    GET  /v1/models        the one model this server holds, with what every request runs (rounds,
                           exit policy, cache policies, speculation, prefill chunk)
    GET  /tokenizer_info, POST /tokenize, POST /detokenize   the model's tokenizer (vLLM's shapes)
    GET  /health           200 while serving, with the scheduler's running/waiting counts

Requests are validated before anything runs (malformed JSON, wrong types, out-of-range values,
a prompt longer than the limits or the context): the reply is a 4xx with an OpenAI-style
`{"error": {"message", "type", "param", "code"}}` body, and the server keeps serving. More
requests in flight than `max_concurrent` get 429.

Concurrency. A `Scheduler` (inference/scheduler.py) keeps up to `max_batches` engine batches running (each with
its own cache, rows left-padded; each row samples with its own parameters and seeded generator,
so a request's output does not depend on its batch mates) and advances them one decode step
each in turn. A waiting prompt takes a free row of a running batch (each has `max_batch` rows)
when it fits there (continuous batching: its prompt must fit in the columns that batch will
have used when its prefill is done, its tokens in the rest of the context), else it starts a
new batch with other waiting prompts, else it waits. So a short request is not held behind a
long one. A new batch prefills its prompts `prefill_chunk` columns per tick (under the `full`
prefill cache; see DecodeBatch), so a long prompt delays the other batches' next tokens by one
chunk, not the whole prompt; prompts joining a running batch share a budget of `prefill_chunk`
columns per tick of that batch, after its decode step. The server ticks the
scheduler on its event loop between requests (when it was idle, it first waits
`batch_window_ms` for prompts to arrive together), so every torch call happens on that one
thread: once two threads of a process have run torch ops, their CPU thread teams compete and
decoding gets 2.5-3x slower (benchmarks/two_threads.py; a worker thread is fast only while no
other thread touches torch).
Tokens flow back to each request through its own queue as they are sampled, which is what
`stream: true` sends as server-sent events. A row whose client has gone away stops and frees its
place: at the next step for a closed stream, and for a client that was waiting for the whole
response as soon as the server reports its disconnect (a task awaits ASGI's `http.disconnect`).
Each batch's cache holds `max_batch` rows of the whole context (bench-s: 4 MiB a row), allocated
when the batch starts.

With `--speculative` every prompt is a batch of one row (speculation is batch-1), and batches
advance one verification each in turn.

A prompt is text, a list of texts, token ids or a list of token-id lists. `n` gives that many
choices per prompt (choice j samples with seed + j); `logprobs: N` (at most 5) reports each
token's log-probability under the model (raw logits: before the penalty and temperature) and
the N likeliest, in OpenAI's legacy shape (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`; a token that holds part of a character is shown as "bytes:\\xNN"). `echo`
puts the prompt before the completion, with its tokens' log-probabilities when asked (the
first token's is null; they come from the same scheduled, batched and chunked prefill that
chooses the first token: `SamplingParams.prompt_logprobs`), and `max_tokens: 0` with `echo`
scores a prompt without showing a token (its row still samples one, never fed back, so a prompt
may fill the context). With `/tokenizer_info`, `/tokenize` (which reads a literal `<|eos|>` as
the token, as vLLM's does) and `/detokenize` (vLLM's shapes) that is what
lm-evaluation-harness's `local-completions` model needs for loglikelihood tasks.
`presence_penalty`, `frequency_penalty` (on the output's tokens so far) and `logit_bias` are
OpenAI's; `best_of` other than `n` and a non-empty `suffix` are refused, not ignored.
With an API key (`looplm serve --api-key KEY`, or LOOPLM_API_KEY), every path but `/health` (kept
open for load balancers) needs `Authorization: Bearer KEY` (what OpenAI's clients send); a missing
or wrong key gets 401 with `code: "invalid_api_key"` before the body is read (the keys are
compared in constant time), and FastAPI's /docs, /redoc and /openapi.json are off. Binding
beyond loopback without a key prints a warning. Request limits (ServeLimits, each a flag): a body
over `max_body_bytes` gets 413 before it is read in full or parsed (`_Gate`: the key, then the
size, ahead of FastAPI), `max_tokens` and `n` are bounded (`max_n`; prompts x n at most
`max_batch`, counted before any prompt is tokenized), `seed` is a 64-bit integer, `logprobs` at
most 5, `stop` at most 16 strings and `logit_bias` at most 300 tokens (SamplingParams's checks).
What a connection may hold is bounded too: its headers within `header_timeout`, its body within
`body_timeout` (408), at most `max_connections` held (503 beyond), idle for `keep_alive` between
requests (serve_bounds.py, and the body's deadline in `_Gate`).
Extensions beyond OpenAI's fields: `top_k`, `repetition_penalty`, and `rounds_used` per choice.
A request without `seed` samples with a fresh seed, except greedy ones (temperature 0), which use
seed 0, so that a model with a random initial loop state still answers a greedy prompt the same way.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from .errors import UserError
from .inference.engine import Engine, SamplingParams
from .inference.sampler import positions_run
from .inference.scheduler import Row, Scheduler
from .data.tokenizer import EOS_TOKEN, encode_with_eos


MAX_TIMEOUT_S = 3600.0
"""The longest header, body or keep-alive timeout a server takes (an hour: longer is no bound)."""


@dataclass(frozen=True, kw_only=True)
class ServeLimits:
    """What one server accepts; every limit is configurable from `looplm serve`."""

    max_prompt_tokens: int = 0
    """Longest prompt in tokens (0 = the model context: a prompt that fills it can still be scored
    with echo and max_tokens 0, or continued by one token)."""
    max_tokens: int = 512
    """Largest max_tokens a request may ask for (also bounded by the context)."""
    max_n: int = 8
    """Largest n (choices per prompt) a request may ask for; prompts x n is also bounded by
    max_batch, the rows one request may hold."""
    max_body_bytes: int = 1 << 20
    """Largest request body in bytes (larger: 413, refused before it is read in full or parsed).
    1 MiB holds a batch of several thousand-token prompts sent as token ids."""
    max_concurrent: int = 64
    """Prompts in flight (waiting or running) before new requests get 429."""
    max_batch: int = 8
    """Prompts decoded together in one batch."""
    max_batches: int = 4
    """Batches running at once, advanced one decode step each in turn."""
    batch_window_ms: float = 5.0
    """How long an idle server waits for more prompts before starting a batch."""
    prefill_chunk: int = 64
    """Prompt columns a new batch prefills per tick, and joining prompts per tick of the batch
    they join (0 = a whole prompt in one tick): a long prompt then delays the other rows' next
    tokens by one chunk's time, not the prompt's."""
    # What one connection may hold (serve_bounds.py; the body deadline is _Gate's). A client
    # sends its request line and headers in one write, so 10 s is slack for any real network
    # and still frees a trickler's connection quickly; 30 s for the whole body asks 35 KB/s of
    # a 1 MiB body; 1024 connections cost a few MiB of buffers at most (the work is bounded by
    # max_concurrent); 5 s of keep-alive is uvicorn's default, enough for a client's next request.
    header_timeout: float = 10.0
    """Seconds a connection may take to send a request's line and headers, counted from its
    connecting, or on a kept-alive connection from the first byte after its previous response;
    later: closed (with a 408 when part of a request came)."""
    body_timeout: float = 30.0
    """Seconds a request's whole body may take to arrive once its headers are in; later: 408 and
    closed. A total, not a gap between bytes, which a trickle of one byte per gap would defeat."""
    max_connections: int = 1024
    """Connections held at once; a request on a connection beyond them gets 503 and the connection
    is closed (those already held keep being served)."""
    keep_alive: float = 5.0
    """Seconds an idle connection stays open after a response (0 = closed after each response)."""

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 0:
            raise UserError(f"--max-prompt-tokens {self.max_prompt_tokens}: must be >= 0 (0 = the context)")
        for name in ("max_tokens", "max_n", "max_body_bytes", "max_concurrent", "max_batch", "max_batches",
                     "max_connections"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        for name, zero_ok in (("header_timeout", False), ("body_timeout", False), ("keep_alive", True)):
            value = getattr(self, name)               # seconds; nan fails every comparison
            if not ((value >= 0 if zero_ok else value > 0) and value <= MAX_TIMEOUT_S):
                low = "[0" if zero_ok else "(0"
                raise UserError(f"--{name.replace('_', '-')} {value}: must be seconds in {low}, {MAX_TIMEOUT_S:g}]")
        if self.prefill_chunk < 0:
            raise UserError(f"--prefill-chunk {self.prefill_chunk}: must be >= 0 (0 = the whole prompt at once)")
        if not 0 <= self.batch_window_ms <= 10_000:
            raise UserError(f"--batch-window-ms {self.batch_window_ms}: must lie in [0, 10000]")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    prompt: str
    add_special_tokens: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    tokens: list[StrictInt]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool = False
    """A last chunk (before [DONE]) with no choices and the whole request's token counts."""


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions (OpenAI's fields; unknown ones are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    """Text, texts, token ids, or lists of token ids (as lm-evaluation-harness sends them)."""
    max_tokens: StrictInt = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    prompt_mode: str | None = None
    """A feedback model's prompt mode for this request: standard, soft or fused (None: soft for a feedback
    model, standard otherwise); refused where the model has no feedback."""
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    """OpenAI's range (a 64-bit integer); torch's generators take seed + j for choice j."""
    n: StrictInt = Field(1, ge=1)
    """Choices per prompt: at most ServeLimits.max_n, and prompts x n at most max_batch."""
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    """OpenAI's: token id (as a string) -> bias in [-100, 100] added to its logit."""
    best_of: StrictInt | None = None
    """Accepted only as n (or absent): choosing the best of more samples is not done here."""
    suffix: str | None = None
    """Accepted only empty: completions do not insert text before a suffix."""


class ChatRequest(BaseModel):
    """The body of POST /v1/chat/completions (OpenAI's chat fields; unknown ones are ignored, the ones this
    server cannot honour are refused): the messages go through the model's chat template, then the same
    sampling, limits and scheduler as a completion."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    messages: list[Any]
    """[{"role": "system"|"user"|"assistant", "content": text or text parts}], checked by data/chat.py."""
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    """OpenAI's newer name for max_tokens (either; both must agree). Neither: up to the server's limit."""
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: StrictInt = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=5)
    tools: list[Any] | None = None
    """Refused when given: this server calls no tools."""
    response_format: dict[str, Any] | None = None
    """Only {"type": "text"}: no constrained (JSON) decoding here."""


def _prompts(prompt: Any) -> list[Any]:
    """A request's `prompt` as a list of prompts (one text or one list of ids is one prompt)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    return list(prompt)


def _seed(seed: int | None, temperature: float) -> int:
    """A request without a seed: 0 when greedy (same prompt, same answer), else a fresh one."""
    if seed is not None:
        return seed
    return 0 if temperature == 0 else uuid.uuid4().int % 2**31


def _token_text(tokenizer: Any, token: int) -> str:
    """A token as logprobs show it: its text, or "bytes:\\xNN..." when it holds part of a character."""
    piece = tokenizer.decode([token])
    if "\ufffd" in piece and hasattr(tokenizer, "token_bytes"):
        return "bytes:" + "".join(f"\\x{b:02x}" for b in tokenizer.token_bytes(token))
    return piece


class _ClientGone(Exception):
    """The client of a non-streamed request disconnected; its rows are stopped."""


_GONE = object()
"""Put on a non-streamed request's event queue when its client disconnects."""


async def _until_disconnect(receive: Any) -> None:
    """Returns when the client has gone. Once a request's body is read, ASGI's receive() next
    gives `http.disconnect` when the connection closes (the spec's way to learn it, and what
    Starlette's StreamingResponse waits on); polling Request.is_disconnected() instead relies on
    the server answering a receive() that is cancelled before it can wait."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _Choices:
    """The text and logprobs (OpenAI's legacy shape) of a request's choices: with `echo`, the
    prompt first (its log-probabilities come on each row's first event), then the generated
    tokens, whole or as they stream (`text_offset` counts the characters of the choice's text
    before each token)."""

    def __init__(self, tokenizer: Any, prompts: list[list[int]], echo: bool, logprobs: bool):
        self.tok, self.prompts, self.echoing, self.logprobs = tokenizer, prompts, echo, logprobs
        self.so_far = [list(p) if echo else [] for p in prompts]    # tokens shown so far

    def echo(self, i: int, first: Any) -> tuple[str, dict[str, Any] | None]:
        """Choice i's prompt, shown before its tokens (`first`: the row's first event)."""
        return self.tok.decode(self.prompts[i]), self._logprobs(self._prompt_pieces(i, first), [])

    def more(self, i: int, evs: list[Any]) -> tuple[str, dict[str, Any] | None]:
        """Choice i's next streamed tokens."""
        lp = self._logprobs(self._pieces(evs), self.so_far[i])
        self.so_far[i] += [ev.token for ev in evs]
        return "".join(ev.text for ev in evs), lp

    def whole(self, i: int, evs: list[Any], first: Any) -> tuple[str, dict[str, Any] | None]:
        """Choice i in one piece: the echoed prompt (if any) and the generated tokens `evs`."""
        if not self.echoing:
            return "".join(ev.text for ev in evs), self._logprobs(self._pieces(evs), [])
        head = self.tok.decode(self.prompts[i])
        return head + "".join(ev.text for ev in evs), self._logprobs(self._prompt_pieces(i, first) + self._pieces(evs), [])

    def _prompt_pieces(self, i: int, first: Any) -> list[tuple[int, float | None, Any]]:
        ids = self.prompts[i]
        lps = first.prompt_logprobs or [None] * len(ids)
        tops = first.prompt_top_logprobs or [None] * len(ids)
        return list(zip(ids, lps, tops))

    @staticmethod
    def _pieces(evs: list[Any]) -> list[tuple[int, float | None, Any]]:
        return [(ev.token, ev.logprob, ev.top_logprobs or []) for ev in evs]

    def _logprobs(self, pieces: list[tuple[int, float | None, Any]], before: list[int]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        ids = list(before)
        for t, lp, top in pieces:
            out["tokens"].append(_token_text(self.tok, t))
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if top is None else {_token_text(self.tok, a): v for a, v in top})
            out["text_offset"].append(len(self.tok.decode(ids)))
            ids.append(t)
        return out


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> Any:
    from fastapi.responses import JSONResponse
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": kind, "param": param, "code": None}})


API_KEY_ENV = "LOOPLM_API_KEY"
"""The environment variable `looplm serve` reads its API key from when --api-key is absent."""


def check_api_key(key: str, source: str = "--api-key") -> str:
    """An API key as a server requires it: not empty, printable ASCII without spaces (as an HTTP
    header carries it intact); UserError naming `source` otherwise (never echoing the key)."""
    if not key:
        raise UserError(f"{source}: the API key is empty; give a non-empty key, or no key for an open server")
    if not all("!" <= ch <= "~" for ch in key):
        raise UserError(f"{source}: the API key must be printable ASCII without spaces")
    return key


def _unauthorized(message: str, close: bool = False) -> Any:
    from fastapi.responses import JSONResponse
    return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer", **(_CLOSE if close else {})},
                        content={"error": {"message": message, "type": "invalid_request_error", "param": None,
                                           "code": "invalid_api_key"}})


_CLOSE = {"Connection": "close"}
"""Sent with an answer given before the request's body was read: the connection cannot carry
another request until that body is drained, so the server closes it instead."""

OPEN_PATHS = frozenset({"/health"})
"""What an API key leaves open: the health probe, for load balancers that send no key."""


def is_loopback(host: str) -> bool:
    """Whether binding `host` stays on this machine: 127.0.0.0/8, ::1 (also IPv4-mapped) or the
    name localhost. Any other name counts as beyond loopback: it is not resolved here, and
    what it resolves to may change."""
    name = host.strip().strip("[]").rstrip(".")
    if name.lower() == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return False                       # a hostname, or "" (uvicorn: every interface)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped            # ::ffff:127.0.0.1 (not loopback to Python 3.11's check)
    return addr.is_loopback


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning `looplm serve` prints when it binds beyond loopback without an API key; None
    when it does not (loopback only, or a key guards the server)."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"looplm: warning: binding {host or '(every interface)'} beyond loopback without an API key: anyone "
            f"who can reach this port can run the model; set --api-key or {API_KEY_ENV}")


class _Gate:
    """ASGI middleware in front of the FastAPI app: the API key, then the body's size, before any
    route sees the request. FastAPI reads and parses a body before an endpoint's dependencies
    run, so a key checked there would come after reading whatever an unauthenticated client
    sent, and a size limit there would come after buffering it; here a missing or wrong key gets
    401 without the body being read, and a body over the limit 413 as soon as it passes the limit
    (at once when its Content-Length says so; a chunked one is read up to the limit). A body
    that has not arrived whole `body_timeout` seconds after the request reached the app gets 408
    and the connection is closed (the header deadline before it is the HTTP protocol's:
    serve_bounds.py)."""

    def __init__(self, app: Any, *, key: bytes | None, max_body: int, body_timeout: float):
        self.app, self.key, self.max_body, self.body_timeout = app, key, max_body, body_timeout

    def key_error(self, headers: dict[bytes, bytes]) -> str | None:
        """Why this request's Authorization header is refused (None: it carries the key)."""
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            return "missing API key: send the header Authorization: Bearer <key>"
        assert self.key is not None
        return None if hmac.compare_digest(given.strip(), self.key) else "incorrect API key provided"

    def too_large(self, size: int | None, close: bool) -> Any:
        what = f"request body of {size} bytes" if size is not None else "request body"
        return _error(413, f"{what} exceeds this server's limit of {self.max_body} bytes", None,
                      headers=_CLOSE if close else None)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":                   # lifespan (no websocket routes here)
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:          # the first of repeated headers
            headers.setdefault(name.lower(), value)
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        if self.key is not None and scope["path"] not in OPEN_PATHS and (why := self.key_error(headers)):
            await _unauthorized(why, close=has_body)(scope, receive, send)
            return
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():                # uvicorn refuses these itself; other servers may not
                await _error(400, "invalid Content-Length header", None, headers=_CLOSE)(scope, receive, send)
                return
            if int(declared) > self.max_body:
                await self.too_large(int(declared), close=True)(scope, receive, send)
                return
        body, more = bytearray(), True
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        while more:                                   # the whole body, up to the limit and the deadline
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await _error(408, f"request body not complete within {self.body_timeout:g} s (--body-timeout)",
                             None, headers=_CLOSE)(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return                                # nobody is left to answer
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await self.too_large(None, close=more)(scope, receive, send)
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            """The body once, then the server's own messages (a client's disconnect)."""
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


def create_app(engine: Engine, *, model_name: str = "looplm", limits: ServeLimits | None = None,
               api_key: str | None = None) -> Any:
    """The FastAPI app serving `engine` (the caller runs it, e.g. with uvicorn). With `api_key`,
    every endpoint but /health needs `Authorization: Bearer <api_key>`."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse
    from starlette.exceptions import HTTPException

    limits = limits or ServeLimits()
    if engine.tokenizer is None:
        raise ValueError("serving needs an engine with a tokenizer")
    ctx = engine.cfg.context
    max_prompt = limits.max_prompt_tokens or ctx
    created = int(time.time())

    sched = Scheduler(engine, limits)
    wake = asyncio.Event()

    async def decode_loop() -> None:
        """Tick the scheduler between the event loop's other work (requests, streams)."""
        while True:
            if not sched.busy:
                await wake.wait()
                wake.clear()
                await asyncio.sleep(limits.batch_window_ms / 1000)   # let concurrent prompts arrive together
            try:
                sched.tick()
            except Exception as err:   # a bug outside any one batch: fail what is in flight, keep serving
                sched.fail_all(err)
            await asyncio.sleep(0)

    @asynccontextmanager
    async def lifespan(app: Any):
        task = asyncio.create_task(decode_loop())
        yield
        task.cancel()

    # With a key, no interactive docs or schema: a browser's /docs page could not send the key
    # to fetch the schema anyway, and the schema is a map of the server for whoever lacks it.
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="looplm", lifespan=lifespan, **docs)
    app.state.scheduler = sched
    key = None if api_key is None else check_api_key(api_key).encode("ascii")
    app.add_middleware(_Gate, key=key, max_body=limits.max_body_bytes,     # see _Gate for why not a dependency
                       body_timeout=limits.body_timeout)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> Any:
        """Starlette's own errors (unknown path 404, wrong method 405, a body it cannot parse)
        in OpenAI's shape, as every other error here."""
        return _error(exc.status_code, f"{exc.detail} ({request.method} {request.url.path})", None,
                      headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Any:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None              # the request field (not pydantic's union branch)
        if first.get("type") == "json_invalid":
            return _error(400, "request body is not valid JSON", None)
        msg = first.get("msg", "invalid request")
        return _error(400, f"{param}: {msg}" if param else msg, param)

    @app.get("/health")
    async def health() -> Any:
        """Liveness for load balancers and orchestrators: 200 while the server runs."""
        return {"status": "ok", "running_batches": len(sched.running), "waiting": len(sched.waiting),
                "in_flight": sched.in_flight}

    c = engine.config
    loop = {"rounds": engine.rounds, "exit": str(engine.policy), "prefill_cache": c.prefill_cache,
            "decode_cache": c.decode_cache, "missing_kv": c.missing, "speculative": c.speculative,
            "prefill_chunk": limits.prefill_chunk}       # what every request of this server runs

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "looplm", "max_model_len": ctx, "looplm": loop}]}

    def token_ids(prompts: list[Any], max_tokens: int) -> list[list[int]]:
        """The request's prompts (`_prompts`) as token ids: the engine's checks (empty, ids outside
        the vocabulary), then this server's prompt limit, then the context with max_tokens."""
        ids_list = engine.token_ids(prompts)
        for ids in ids_list:
            if len(ids) > max_prompt:
                raise UserError(f"prompt: {len(ids)} tokens exceeds the limit of {max_prompt}")
            if positions_run(len(ids), max_tokens) > ctx:
                raise UserError(f"prompt: {len(ids)} tokens + max_tokens {max_tokens} exceed the model "
                                f"context of {ctx} (positions run: prompt + max_tokens - 1)")
        return ids_list

    def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
        """OpenAI's logit_bias (ids as strings) as {id: bias}; UserError for a key that is not an id
        in the vocabulary (the range of the biases is SamplingParams's check)."""
        out = {}
        for key, value in (bias or {}).items():
            if not key.strip().isdigit() or int(key) >= engine.cfg.vocab_size:
                raise UserError(f"logit_bias: key {key!r} is not a token id in 0..{engine.cfg.vocab_size - 1}")
            out[int(key)] = value
        return out

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Any:
        """What a client that tokenizes through this server needs (lm-evaluation-harness's remote backend)."""
        return {"eos_token": EOS_TOKEN, "eos_token_id": engine.tokenizer.eos_id, "bos_token": None,
                "pad_token": None, "vocab_size": engine.cfg.vocab_size, "model_max_length": ctx,
                "tokenizer_class": type(engine.tokenizer).__name__}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Any:
        ids = encode_with_eos(engine.tokenizer, req.prompt)     # "<|eos|>" is the token, as vLLM's reads it
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        if not all(0 <= t < engine.cfg.vocab_size for t in req.tokens):
            return _error(400, f"tokens: token ids must lie in [0, {engine.cfg.vocab_size})", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    def _busy() -> Any:
        return _error(429, f"server busy: more than {limits.max_concurrent} prompts in flight; retry later",
                      None, "rate_limit_error")

    def start_rows(prompt_of: list[list[int]], params_of: list[SamplingParams], request: Request,
                   stream: bool) -> Any:
        """Submit one row per prompt to the scheduler; the async iterator of (row index, TokenEvent) until
        every row finished (raising the engine's error, or _ClientGone as soon as a client waiting for a
        whole response disconnects; a closed stream ends its generator instead), or None when the server
        is busy. The one path from a request to the scheduler, for completions and chat alike."""
        n_rows = len(prompt_of)
        if not sched.try_reserve(n_rows):
            return None
        events: asyncio.Queue = asyncio.Queue()
        mine = []
        for i in range(n_rows):
            def send(ev: Any, i: int = i) -> None:
                events.put_nowait((i, ev))
            mine.append(Row(ids=prompt_of[i], params=params_of[i], send=send))
            sched.submit(mine[-1])
        wake.set()

        def on_gone(watch: asyncio.Task) -> None:
            if not watch.cancelled():
                watch.exception()            # a receive() that failed: the connection is gone too
                events.put_nowait((-1, _GONE))

        async def rows() -> Any:
            left = n_rows
            watch = None if stream else asyncio.create_task(_until_disconnect(request.receive))
            if watch is not None:
                watch.add_done_callback(on_gone)
            try:
                while left:
                    i, ev = await events.get()
                    if ev is _GONE:
                        raise _ClientGone()
                    if isinstance(ev, Exception):
                        raise ev
                    if ev.finish_reason:
                        left -= 1
                    yield i, ev
            finally:                 # done, or the client went away: the scheduler may stop these rows
                if watch is not None:
                    watch.cancel()
                for r in mine:
                    r.cancelled = True
                sched.release(n_rows)
        return rows()

    def sse(rows: Any, frames: Any, usage_frame: Any, options: StreamOptions | None) -> Any:
        """A streamed reply: each event's frames (`frames(i, ev)` -> JSON objects) as server-sent events, an
        error frame if generation fails, the usage frame when `stream_options.include_usage`, then [DONE]."""
        async def events() -> Any:
            try:
                async for i, ev in rows:
                    for frame in frames(i, ev):
                        yield f"data: {json.dumps(frame)}\n\n"
            except Exception as err:
                yield f"data: {json.dumps({'error': {'message': str(err), 'type': 'server_error'}})}\n\n"
            else:
                if options is not None and options.include_usage:
                    yield f"data: {json.dumps(usage_frame())}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def collect(rows: Any, n_rows: int) -> Any:
        """A whole reply's events per row, or the error response when the client left or generation failed."""
        evs: list[list[Any]] = [[] for _ in range(n_rows)]
        try:
            async for i, ev in rows:
                evs[i].append(ev)
        except _ClientGone:
            return _error(499, "client closed the request", None, "client_closed")     # nobody reads this
        except Exception as err:
            return _error(500, f"generation failed: {err}", None, "server_error")
        return evs

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        if req.model not in (None, model_name):
            return _error(404, f"model {req.model!r} is not served here; this server serves {model_name!r}",
                          "model", "not_found_error")
        if req.max_tokens > limits.max_tokens:
            return _error(400, f"max_tokens: {req.max_tokens} exceeds this server's limit of {limits.max_tokens}",
                          "max_tokens")
        if req.n > limits.max_n:
            return _error(400, f"n: {req.n} exceeds this server's limit of {limits.max_n}", "n")
        if req.max_tokens == 0 and not req.echo:
            return _error(400, "max_tokens: 0 only with echo (to score a prompt)", "max_tokens")
        if req.best_of not in (None, req.n):
            return _error(400, f"best_of: {req.best_of} is not supported (only best_of = n); ask for n samples "
                               "with logprobs and choose among them", "best_of")
        if req.suffix:
            return _error(400, "suffix: insertion (text before a suffix) is not supported", "suffix")
        if req.stream_options is not None and not req.stream:
            return _error(400, "stream_options: only with stream: true", "stream_options")
        seed = _seed(req.seed, req.temperature)
        try:
            bias = logit_bias(req.logit_bias)
            prompts = _prompts(req.prompt)
            if len(prompts) * req.n > limits.max_batch:   # before tokenizing: a long list costs nothing
                raise UserError(f"{'prompt' if req.n == 1 else 'n'}: at most {limits.max_batch} completions in "
                                f"all (prompts x n), asked for {len(prompts) * req.n}")
            ids_list = token_ids(prompts, req.max_tokens)
            params = [SamplingParams(max_new_tokens=max(req.max_tokens, 1), temperature=req.temperature,
                                     top_p=req.top_p, top_k=req.top_k, repetition_penalty=req.repetition_penalty,
                                     presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                     logit_bias=bias, stop=() if req.stop is None else req.stop, seed=seed + j,
                                     logprobs=req.logprobs, prompt_mode=req.prompt_mode,
                                     prompt_logprobs=req.logprobs if req.echo else None)
                      for j in range(req.n)]                 # choice j of a prompt samples with seed + j
            engine.prompt_mode(params[0])                    # a prompt mode this model has
        except UserError as err:
            field = str(err).split(" ")[0].rstrip(":")
            return _error(400, str(err), field)
        n_rows = len(ids_list) * req.n                        # choice i: prompt i // n, sample i % n
        prompt_of = [ids_list[i // req.n] for i in range(n_rows)]
        rid, name = f"cmpl-{uuid.uuid4().hex[:24]}", model_name
        out = _Choices(engine.tokenizer, prompt_of, req.echo, req.logprobs is not None)
        scoring = req.max_tokens == 0          # echo only: each row still samples one token, never shown

        def body(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": name,
                    "choices": choices, **extra}

        n_prompt = sum(map(len, prompt_of))

        def usage(n_out: int) -> dict[str, int]:
            return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
        rows = start_rows(prompt_of, [params[i % req.n] for i in range(n_rows)], request, req.stream)
        if rows is None:
            return _busy()

        if req.stream:
            started, n_out = [False] * n_rows, [0]

            def frames(i: int, ev: Any) -> list[dict[str, Any]]:
                out_frames = []
                if req.echo and not started[i]:             # the prompt, with the first token's figures
                    started[i] = True
                    text, lp = out.echo(i, ev)
                    out_frames.append(body([{"index": i, "text": text, "logprobs": lp,
                                             "finish_reason": "length" if scoring else None}]))
                if not scoring:
                    n_out[0] += 1
                    text, lp = out.more(i, [ev])
                    out_frames.append(body([{"index": i, "text": text, "logprobs": lp,
                                             "finish_reason": ev.finish_reason}]))
                return out_frames
            return sse(rows, frames, lambda: body([], usage=usage(n_out[0])), req.stream_options)

        evs = await collect(rows, n_rows)
        if not isinstance(evs, list):
            return evs
        choices = []
        for i in range(n_rows):
            shown = [] if scoring else evs[i]
            text, lp = out.whole(i, shown, evs[i][0])
            choices.append({"index": i, "text": text, "logprobs": lp,
                            "finish_reason": "length" if scoring else evs[i][-1].finish_reason,
                            "rounds_used": [ev.rounds for ev in shown]})
        return body(choices, usage=usage(0 if scoring else sum(map(len, evs))))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        if req.model not in (None, model_name):
            return _error(404, f"model {req.model!r} is not served here; this server serves {model_name!r}",
                          "model", "not_found_error")
        if req.tools:
            return _error(400, "tools: tool calls are not supported by this server", "tools")
        if req.response_format not in (None, {"type": "text"}):
            return _error(400, "response_format: only {\"type\": \"text\"} (no constrained decoding)",
                          "response_format")
        if req.max_tokens is not None and req.max_completion_tokens not in (None, req.max_tokens):
            return _error(400, "max_completion_tokens: disagrees with max_tokens (send one)", "max_completion_tokens")
        if req.top_logprobs is not None and not req.logprobs:
            return _error(400, "top_logprobs: only with logprobs: true", "top_logprobs")
        if req.n > limits.max_n or req.n > limits.max_batch:
            return _error(400, f"n: {req.n} exceeds this server's limit of {min(limits.max_n, limits.max_batch)}", "n")
        if req.stream_options is not None and not req.stream:
            return _error(400, "stream_options: only with stream: true", "stream_options")
        asked = req.max_tokens or req.max_completion_tokens
        if asked is not None and asked > limits.max_tokens:
            return _error(400, f"max_tokens: {asked} exceeds this server's limit of {limits.max_tokens}", "max_tokens")
        try:
            if not hasattr(engine.tokenizer, "apply_chat"):
                raise UserError("messages: this model has no chat template (its tokenizer is looplm's own); "
                                "use /v1/completions")
            text = engine.tokenizer.apply_chat(req.messages)
            ids = engine.token_ids([text])[0]
            if len(ids) > max_prompt:
                raise UserError(f"messages: {len(ids)} tokens exceeds the limit of {max_prompt}")
            room = ctx - len(ids)           # positions left for the reply (its last token is never fed back)
            max_tokens = asked if asked is not None else min(limits.max_tokens, room + 1)
            if positions_run(len(ids), max_tokens) > ctx:
                raise UserError(f"messages: {len(ids)} tokens + max_tokens {max_tokens} exceed the model "
                                f"context of {ctx}")
            seed = _seed(req.seed, req.temperature)
            bias = logit_bias(req.logit_bias)
            top = req.top_logprobs if req.logprobs else None
            params = [SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                     top_k=req.top_k, repetition_penalty=req.repetition_penalty,
                                     presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                     logit_bias=bias, stop=() if req.stop is None else req.stop, seed=seed + j,
                                     logprobs=(top or 0) if req.logprobs else None)
                      for j in range(req.n)]
        except UserError as err:
            field = str(err).split(" ")[0].rstrip(":").split("[")[0].split(".")[0]
            return _error(400, str(err), field)
        rows = start_rows([ids] * req.n, params, request, req.stream)
        if rows is None:
            return _busy()
        rid, name, n_prompt = f"chatcmpl-{uuid.uuid4().hex[:24]}", model_name, len(ids)

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": name,
                    "choices": choices, **extra}

        def usage(n_out: int) -> dict[str, int]:
            return {"prompt_tokens": n_prompt * req.n, "completion_tokens": n_out,
                    "total_tokens": n_prompt * req.n + n_out}

        def logprobs(evs: list[Any]) -> dict[str, Any] | None:
            """OpenAI's chat shape: per token its text, log-probability, bytes and the likeliest."""
            if not req.logprobs:
                return None
            def entry(t: int, lp: float | None) -> dict[str, Any]:
                piece = _token_text(engine.tokenizer, t)
                raw = engine.tokenizer.token_bytes(t) if hasattr(engine.tokenizer, "token_bytes") else piece.encode()
                return {"token": piece, "logprob": lp, "bytes": list(raw)}
            return {"content": [{**entry(ev.token, ev.logprob),
                                 "top_logprobs": [entry(a, v) for a, v in (ev.top_logprobs or [])]} for ev in evs]}

        if req.stream:
            started, n_out = [False] * req.n, [0]

            def frames(i: int, ev: Any) -> list[dict[str, Any]]:
                delta: dict[str, Any] = {"content": ev.text}
                if not started[i]:        # OpenAI's first delta of a choice names the role
                    started[i] = True
                    delta = {"role": "assistant", **delta}
                n_out[0] += 1
                return [chunk([{"index": i, "delta": delta, "logprobs": logprobs([ev]),
                                "finish_reason": ev.finish_reason}])]
            return sse(rows, frames, lambda: chunk([], usage=usage(n_out[0])), req.stream_options)

        evs = await collect(rows, req.n)
        if not isinstance(evs, list):
            return evs
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(ev.text for ev in e)},
                    "logprobs": logprobs(e), "finish_reason": e[-1].finish_reason,
                    "rounds_used": [ev.rounds for ev in e]} for i, e in enumerate(evs)]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": name,
                "choices": choices, "usage": usage(sum(map(len, evs)))}

    return app


def serve(run_dir: str, *, host: str = "127.0.0.1", port: int = 8000, limits: ServeLimits | None = None,
          engine_options: dict[str, Any] | None = None, log_level: str = "info", device: str = "cpu",
          api_key: str | None = None, dtype: str = "fp32") -> None:
    """Load a run and serve it until interrupted (with `api_key`: only to clients that send it),
    each connection bounded by `limits` (serve_bounds.py)."""
    import sys

    import uvicorn

    from .runs.checkpoint import load_run
    from .serve_bounds import fit_file_limit, uvicorn_options

    limits = limits or ServeLimits()
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: must lie in 0..65535")
    if api_key is not None:
        check_api_key(api_key)
    run = load_run(run_dir, device=device, dtype=dtype)
    engine = Engine.from_run(run, **(engine_options or {}))
    app = create_app(engine, model_name=run.path.resolve().name, limits=limits, api_key=api_key)
    print(f"looplm: serving {run.path} on http://{host}:{port}/v1 (model id {run.path.resolve().name!r}"
          f"{'; API key required' if api_key is not None else ''})", file=sys.stderr)   # never the key itself
    for warning in (exposure_warning(host, api_key), fit_file_limit(limits.max_connections)):
        if warning is not None:
            print(warning, file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level=log_level, **uvicorn_options(limits))
