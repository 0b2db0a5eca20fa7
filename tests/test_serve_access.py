"""Access control and request limits of `looplm serve`: the warning when binding beyond loopback
without a key, the body-size limit (413) and its order after the key (401), the bounds on `n`,
the prompt count and `seed`, the docs closed under a key, and OpenAI's own client against a real
uvicorn server with the key.

Most tests drive the ASGI app directly (counting how often it reads the body); one module
fixture runs uvicorn in a thread on a free port of 127.0.0.1, stopped at the end. Every wait is
bounded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
import torch

import looplm
from looplm.data.tokenizer import ByteTokenizer
from looplm.inference.engine import Engine
from looplm.serve import ServeLimits, create_app, exposure_warning, is_loopback

from conftest import save_untrained_run, uvicorn_in_thread

TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
        "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 3, "data.seq_len": 32}
KEY = "sk-looplm-access-0123"
ASK = {"prompt": "hello", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.manual_seed(0)
    return Engine(looplm.build_model(looplm.load_recipe("quickstart", overrides=TINY)).eval(), ByteTokenizer())


Reply = tuple[int, dict[str, str], Any, int]


@contextmanager
def served(app: Any) -> Iterator[Callable[..., Reply]]:
    """`call(method, path, headers, chunks)` against `app`, every call on one event loop with the
    app's lifespan entered once (the app's scheduler belongs to the loop that first runs it)."""
    with asyncio.Runner() as runner:
        lifespan = app.router.lifespan_context(app)
        runner.run(lifespan.__aenter__())
        try:
            yield lambda *args, **kw: runner.run(_call(app, *args, **kw))
        finally:
            runner.run(lifespan.__aexit__(None, None, None))


async def _call(app: Any, method: str, path: str, headers: dict[str, str] | None = None,
                chunks: list[bytes] | None = None) -> Reply:
    """One request at the ASGI level: its body sent as `chunks` (one http.request message each;
    no Content-Length unless `headers` says one). (status, response headers, JSON body, how
    many times the app read the request's messages)."""
    msgs = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks or [])]
    msgs = msgs or [{"type": "http.request", "body": b"", "more_body": False}]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    reads = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        if reads <= len(msgs):
            return msgs[reads - 1]
        await asyncio.sleep(3600)                 # the client stays: only a disconnect check reads on
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 30)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    got = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], got, json.loads(body), reads


def post_json(call: Callable[..., Reply], path: str, body: Any, headers: dict[str, str] | None = None,
              pad_to: int | None = None, chunk: int = 1000) -> Reply:
    """POST `body` as JSON (padded with spaces to `pad_to` bytes), chunked, no Content-Length."""
    raw = json.dumps(body).encode()
    raw += b" " * ((pad_to or 0) - len(raw))
    return call("POST", path, {"content-type": "application/json", "transfer-encoding": "chunked",
                                    **(headers or {})}, [raw[i:i + chunk] for i in range(0, len(raw), chunk)])


@pytest.fixture
def asgi() -> Iterator[Callable[[Any], Callable[..., Reply]]]:
    """`asgi(app)`: a `call` against app (see `served`), its loop closed at the test's end."""
    with ExitStack() as stack:
        yield lambda app: stack.enter_context(served(app))


def openai_error(status: int, got: Any, param: str | None = None) -> None:
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}, got
    assert got["error"]["type"] == "invalid_request_error" and got["error"]["message"], (status, got)
    assert got["error"]["param"] == param, got


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LocalHost",
                                  "localhost.", "::ffff:127.0.0.1"])
def test_loopback_hosts_need_no_warning(host):
    assert is_loopback(host) and exposure_warning(host, None) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.5", "10.0.0.1", "2001:db8::1",
                                  "::ffff:10.0.0.1", "example.com", "localhost.example.com", "my-localhost"])
def test_binding_beyond_loopback_without_a_key_warns(host):
    """Any address outside 127.0.0.0/8 and ::1, and any name but localhost (names are not
    resolved), is beyond loopback: a warning naming the ways to set a key, unless a key is set."""
    assert not is_loopback(host)
    warning = exposure_warning(host, None)
    assert warning is not None and "--api-key" in warning and "LOOPLM_API_KEY" in warning
    assert len(warning.splitlines()) == 1
    assert exposure_warning(host, KEY) is None


def test_serve_prints_the_warning_and_takes_the_limit_flags(tmp_path, monkeypatch, capsys):
    """Through `looplm serve` (a real run; uvicorn.run replaced): the warning on stderr for
    --host 0.0.0.0 without a key only, and --max-n / --max-body-bytes reach the app's limits."""
    import uvicorn

    from looplm.cli import main

    save_untrained_run(tmp_path, TINY)
    bound: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: bound.append({"app": app, **kw}))
    monkeypatch.delenv("LOOPLM_API_KEY", raising=False)
    for argv, warns in [(["--host", "0.0.0.0"], True), (["--host", "0.0.0.0", "--api-key", KEY], False),
                        ([], False), (["--host", "::1"], False)]:
        assert main(["serve", str(tmp_path), *argv, "--max-n", "3", "--max-body-bytes", "5000"]) == 0
        err = capsys.readouterr().err
        assert ("warning" in err and "beyond loopback" in err) == warns, (argv, err)
        assert KEY not in err
    assert [b["host"] for b in bound] == ["0.0.0.0", "0.0.0.0", "127.0.0.1", "::1"]
    limits = bound[0]["app"].state.scheduler.limits
    assert (limits.max_n, limits.max_body_bytes) == (3, 5000)
    for flag in ("--max-n", "--max-body-bytes"):
        assert main(["serve", str(tmp_path), flag, "0"]) == 2
        assert flag in capsys.readouterr().err


def test_a_body_over_the_limit_gets_413_before_it_is_read_or_parsed(engine, asgi):
    """A declared Content-Length over the limit: 413 without reading anything. A chunked body
    (no Content-Length): read only until it passes the limit. A body of exactly the limit runs;
    one byte more does not. Every endpoint is limited, and the connection is closed after a 413
    that left a body unread."""
    call = asgi(create_app(engine, limits=ServeLimits(max_body_bytes=2048)))
    status, headers, got, reads = call("POST", "/v1/completions",
                                       {"content-type": "application/json", "content-length": str(10**9)})
    assert (status, reads) == (413, 0) and headers["connection"] == "close"
    openai_error(status, got)
    assert "1000000000 bytes" in got["error"]["message"] and "2048" in got["error"]["message"]
    status, headers, got, reads = call("POST", "/v1/completions",
                                       {"content-type": "application/json", "transfer-encoding": "chunked"},
                                       [b"[" * 1000] * 5)
    assert (status, reads) == (413, 3) and headers["connection"] == "close"    # 3000 bytes > 2048: stop there
    openai_error(status, got)
    status, _, got, _ = post_json(call, "/v1/completions", ASK, pad_to=2048)
    assert status == 200 and got["usage"]["completion_tokens"] == 3
    status, _, got, _ = post_json(call, "/v1/completions", ASK, pad_to=2049)
    assert status == 413, got
    status, _, got, _ = post_json(call, "/tokenize", {"prompt": "x" * 3000})
    assert status == 413 and post_json(call, "/tokenize", {"prompt": "x" * 2000})[0] == 200
    status, _, got, _ = call("POST", "/v1/completions", {"content-type": "application/json",
                                                              "content-length": "12abc"}, [b"{}"])
    assert status == 400
    status, _, got, _ = call("POST", "/v1/completions", {"content-type": "application/json"},
                             [b"[" * 2000])                              # too deep for the parser: 400, our shape
    assert status == 400 and "error" in got and "detail" not in got


def test_the_key_is_checked_before_the_body_is_read(engine, asgi):
    """With a key, a request without it gets 401 however large its body claims to be, without a
    byte read (and the connection closed); with the key the size limit applies; /health needs
    neither key nor body."""
    call = asgi(create_app(engine, limits=ServeLimits(max_body_bytes=2048), api_key=KEY))
    huge = {"content-type": "application/json", "content-length": str(10**9)}
    for auth in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"}):
        status, headers, got, reads = call("POST", "/v1/completions", {**huge, **auth})
        assert (status, reads) == (401, 0) and got["error"]["code"] == "invalid_api_key"
        assert headers["connection"] == "close" and headers["www-authenticate"] == "Bearer"
        status, _, got, reads = post_json(call, "/v1/completions", ASK, auth, pad_to=5000)
        assert (status, reads) == (401, 0)
    right = {"authorization": f"Bearer {KEY}"}
    status, _, got, reads = call("POST", "/v1/completions", {**huge, **right})
    assert (status, reads) == (413, 0)
    status, _, got, reads = post_json(call, "/v1/completions", ASK, right, pad_to=5000)
    assert (status, reads) == (413, 3)
    status, _, got, _ = post_json(call, "/v1/completions", ASK, right)
    assert status == 200 and got["usage"]["completion_tokens"] == 3
    status, headers, got, _ = call("GET", "/v1/models")
    assert status == 401 and "connection" not in headers               # no body: the connection may stay
    assert call("GET", "/health")[0] == 200


def test_n_the_prompt_count_and_the_seed_are_bounded(engine, asgi, monkeypatch):
    """n over max_n: 400 naming n. More prompts than a request's rows: 400 naming the prompt,
    refused before any prompt is tokenized. seed outside 64 bits: 400 naming seed (it used to
    fail in torch with a 500); the ends of the range work, with n > 1 past the top."""
    call = asgi(create_app(engine, limits=ServeLimits(max_n=2, max_batch=8)))
    status, _, got, _ = post_json(call, "/v1/completions", {**ASK, "n": 3})
    assert status == 400 and "limit of 2" in got["error"]["message"]
    openai_error(status, got, "n")
    status, _, got, _ = post_json(call, "/v1/completions", {**ASK, "n": 3, "best_of": 3})
    assert status == 400 and got["error"]["param"] == "n"
    status, _, got, _ = post_json(call, "/v1/completions", {**ASK, "n": 2})
    assert status == 200 and len(got["choices"]) == 2
    tokenized: list[int] = []
    token_ids = engine.token_ids
    monkeypatch.setattr(engine, "token_ids", lambda prompts: (tokenized.append(len(prompts)), token_ids(prompts))[1])
    status, _, got, _ = post_json(call, "/v1/completions", {**ASK, "prompt": ["a"] * 100_000})
    assert status == 400 and tokenized == []
    openai_error(status, got, "prompt")
    for seed in (2**63, -(2**63) - 1):
        status, _, got, _ = post_json(call, "/v1/completions", {**ASK, "seed": seed})
        assert status == 400, got
        openai_error(status, got, "seed")
    for seed in (2**63 - 1, -(2**63)):
        status, _, got, _ = post_json(call, "/v1/completions", {**ASK, "seed": seed, "n": 2, "temperature": 1.0})
        assert status == 200 and len(got["choices"]) == 2


def test_with_a_key_the_docs_and_schema_are_closed(engine, asgi):
    """Without a key FastAPI's /docs, /redoc and /openapi.json are served (a local tool); with a
    key they are off: 401 without the key (as every path but /health), 404 with it, and unknown
    paths answer in OpenAI's error shape."""
    open_call, guarded = asgi(create_app(engine)), asgi(create_app(engine, api_key=KEY))
    status, _, schema, _ = open_call("GET", "/openapi.json")
    assert status == 200 and "/v1/completions" in schema["paths"]
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/v1/embeddings"):
        status, _, got, _ = guarded("GET", path)
        assert status == 401 and got["error"]["code"] == "invalid_api_key", path
        status, _, got, _ = guarded("GET", path, {"authorization": f"Bearer {KEY}"})
        assert status == 404, (path, got)
        openai_error(status, got)


@pytest.fixture(scope="module")
def real_server(engine):
    """uvicorn serving the app (key KEY, 4 KiB bodies) in a thread on a free port of 127.0.0.1."""
    app = create_app(engine, model_name="tiny", limits=ServeLimits(max_body_bytes=4096), api_key=KEY)
    with uvicorn_in_thread(app) as port:
        yield f"http://127.0.0.1:{port}"


def test_the_openai_client_works_with_the_key(real_server):
    """OpenAI's Python client, as a user would point it at the server: completions and models with
    the key; AuthenticationError (401, invalid_api_key) with a wrong one."""
    import openai

    client = openai.OpenAI(base_url=f"{real_server}/v1", api_key=KEY, max_retries=0, timeout=30)
    done = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert isinstance(done.choices[0].text, str) and done.usage.completion_tokens == 4
    assert done.choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == ["tiny"]
    wrong = openai.OpenAI(base_url=f"{real_server}/v1", api_key=KEY + "x", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.completions.create(model="tiny", prompt="hello", max_tokens=4)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_body_limits_over_real_http(real_server):
    """Over a real socket: a chunked body (no Content-Length) and a declared one over 4 KiB get
    413; under the limit the request runs; /health answers without a key."""
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    raw = json.dumps({**ASK, "prompt": "x" * 5000}).encode()

    def chunks() -> Any:
        for i in range(0, len(raw), 1000):
            yield raw[i:i + 1000]

    with httpx.Client(base_url=real_server, timeout=30) as c:
        r = c.post("/v1/completions", content=chunks(), headers=auth)
        assert "content-length" not in r.request.headers and r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = c.post("/v1/completions", content=raw, headers=auth)
        assert r.status_code == 413 and "5" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json=ASK, headers=auth)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert c.get("/health").status_code == 200
