"""`looplm serve` against a real uvicorn process on 127.0.0.1 (a free port, shut down at the end).

Every wait is bounded: the server must come up within 60 s and every request has a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import looplm
from looplm.runs.checkpoint import save_checkpoint, write_text
from looplm.data.tokenizer import ByteTokenizer

TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
        "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 3, "data.seq_len": 32}
MAX_CONCURRENT = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run = tmp_path_factory.mktemp("served")
    recipe = looplm.load_recipe("quickstart", overrides=TINY)
    torch.manual_seed(0)
    save_checkpoint(run, looplm.build_model(recipe), {"step": 0})
    ByteTokenizer().save(run / "checkpoint")
    write_text(run / "recipe.toml", recipe.to_toml())
    port = free_port()
    log = open(run / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "looplm", "serve", str(run), "--port", str(port),
                             "--max-tokens", "40", "--max-prompt-tokens", "48", "--max-batch", "4",
                             "--max-concurrent", str(MAX_CONCURRENT), "--batch-window-ms", "20", "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {(run / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up within 60 s")
            time.sleep(0.2)
        yield {"base": base, "name": run.name}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()


def post(server, body, timeout=60.0):
    return httpx.post(f"{server['base']}/v1/completions", json=body, timeout=timeout)


def test_health(server):
    r = httpx.get(f"{server['base']}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["in_flight"] >= 0


def test_models_lists_the_run(server):
    r = httpx.get(f"{server['base']}/v1/models", timeout=10)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [server["name"]]
    card = r.json()["data"][0]                      # what every request runs: rounds, exit, caches
    assert card["max_model_len"] == 64 and card["looplm"]["rounds"] == 3 and card["looplm"]["exit"] == "fixed:3"
    assert card["looplm"]["prefill_cache"] == card["looplm"]["decode_cache"] == "full"


def test_completion_shape_and_greedy_determinism(server):
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0}
    a, b = post(server, body), post(server, body)
    assert a.status_code == b.status_code == 200
    ja = a.json()
    assert ja["object"] == "text_completion" and ja["choices"][0]["finish_reason"] == "length"
    assert ja["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert len(ja["choices"][0]["rounds_used"]) == 8
    assert ja["choices"][0]["text"] == b.json()["choices"][0]["text"]


def test_streaming_sends_the_same_text_as_events(server):
    body = {"prompt": "stream me", "max_tokens": 10, "temperature": 0, "seed": 7}
    whole = post(server, body).json()["choices"][0]["text"]
    pieces, reasons, done = [], [], False
    with httpx.stream("POST", f"{server['base']}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            choice = json.loads(data)["choices"][0]
            pieces.append(choice["text"])
            reasons.append(choice["finish_reason"])
    assert done and len(pieces) == 10 and reasons[-1] == "length" and reasons[:-1] == [None] * 9
    assert "".join(pieces) == whole
    with httpx.stream("POST", f"{server['base']}/v1/completions", timeout=60,
                      json={**body, "prompt": ["stream me", "ab"], "n": 2, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(len(c["choices"]) == 1 for c in chunks[:-1]) and len(chunks) == 4 * 10 + 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 2 * 9 + 2 * 2,
                                                                   "completion_tokens": 40, "total_tokens": 62}


def test_concurrent_clients_get_their_own_answers(server):
    bodies = [{"prompt": f"prompt number {i}" * (1 + i % 3), "max_tokens": 6 + i, "temperature": 0.8 * (i % 2),
               "seed": i} for i in range(MAX_CONCURRENT)]
    alone = [post(server, b).json()["choices"][0]["text"] for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: post(server, b), bodies))
    assert all(r.status_code == 200 for r in together), [r.text for r in together]
    assert [r.json()["choices"][0]["text"] for r in together] == alone     # batching changes nothing
    assert [r.json()["usage"]["completion_tokens"] for r in together] == [b["max_tokens"] for b in bodies]


def test_logprobs_and_n(server):
    """`logprobs: N` reports each token's log-probability and the N likeliest tokens (OpenAI's
    legacy shape, streamed per token too); `n` returns that many choices per prompt, choice j
    sampled with seed + j, so they equal separate requests with those seeds."""
    body = {"prompt": "The loop", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    r = post(server, body).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    ids = [int(t[8:], 16) if t.startswith("bytes:") else ord(t) for t in lp["tokens"]]     # one byte each here
    assert bytes(ids).decode("utf-8", "replace") == r["choices"][0]["text"]
    assert lp["text_offset"] == [len(bytes(ids[:k]).decode("utf-8", "replace")) for k in range(6)]
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert val <= 0 and len(top) == 2
        assert top[tok] == pytest.approx(val) and val == pytest.approx(max(top.values()))   # greedy: the likeliest
    streamed = []
    with httpx.stream("POST", f"{server['base']}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed == pytest.approx(lp["token_logprobs"])
    assert post(server, {"prompt": "The loop", "max_tokens": 3}).json()["choices"][0]["logprobs"] is None
    sampled = {"prompt": ["ab", "The loop"], "max_tokens": 8, "temperature": 1.0, "seed": 7}
    both = post(server, {**sampled, "n": 2}).json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    assert both["usage"]["prompt_tokens"] == 2 * (2 + 8)
    for i, c in enumerate(both["choices"]):
        alone = post(server, {**sampled, "prompt": sampled["prompt"][i // 2], "seed": 7 + i % 2}).json()
        assert c["text"] == alone["choices"][0]["text"], i


def test_logit_bias_bans_and_forces_tokens(server):
    """OpenAI's logit_bias (token ids as strings): -100 on each greedy token in turn bans it, +100
    on a token forces it; the logprobs reported stay the model's own."""
    body = {"prompt": "The loop", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    first = post(server, body).json()["choices"][0]["logprobs"]["tokens"][0]
    first_id = int(first[8:], 16) if first.startswith("bytes:") else ord(first)
    banned = post(server, {**body, "logit_bias": {str(first_id): -100}}).json()["choices"][0]
    assert banned["logprobs"]["tokens"][0] != first
    forced = post(server, {**body, "logit_bias": {"120": 100}}).json()["choices"][0]
    assert forced["text"] == "xxxx" and all(v < 0 for v in forced["logprobs"]["token_logprobs"])


def test_scoring_a_continuation_as_lm_evaluation_harness_does(server):
    """lm-evaluation-harness's local-completions loglikelihood: tokenize through /tokenize, send
    token ids with echo, logprobs 1 and max_tokens 1, and sum token_logprobs[ctxlen:-1]. That sum
    is the continuation's log-likelihood under a full forward pass of the served model (same
    initial loop state: the noise table of the request's seed)."""
    from looplm.model.looped import initial_noise_table
    from looplm.serve import _token_text

    base = server["base"]
    info = httpx.get(f"{base}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<|eos|>"
    eos = httpx.post(f"{base}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}, timeout=10)
    assert eos.json()["tokens"][0] == info["eos_token_id"] == 256       # how lm-eval finds its end-of-text id
    context = httpx.post(f"{base}/tokenize", json={"prompt": "The loop", "add_special_tokens": False},
                         timeout=10).json()["tokens"]
    whole = httpx.post(f"{base}/tokenize", json={"prompt": "The loop runs"}, timeout=10).json()["tokens"]
    assert httpx.post(f"{base}/detokenize", json={"tokens": whole}, timeout=10).json()["prompt"] == "The loop runs"
    ask = {"model": server["name"], "prompt": [whole], "temperature": 0, "max_tokens": 1, "logprobs": 1,
           "seed": 1234, "echo": True}
    choice = post(server, ask).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith("The loop runs") and len(lp["token_logprobs"]) == len(whole) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][:4] == [0, 1, 2, 3]
    got = sum(lp["token_logprobs"][len(context):-1])
    torch.manual_seed(0)
    model = looplm.build_model(looplm.load_recipe("quickstart", overrides=TINY)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([whole]), initial_state=initial_noise_table(model.cfg, 1234)[None, :len(whole)]).logits
    ref = torch.log_softmax(logits[0], -1)
    assert got == pytest.approx(sum(float(ref[t - 1, whole[t]]) for t in range(len(context), len(whole))), abs=1e-4)
    greedy = [max(top, key=top.get) for top in lp["top_logprobs"][1:]]      # lm-eval's is_greedy reads these
    best = [_token_text(ByteTokenizer(), int(ref[t - 1].argmax())) for t in range(1, len(whole))]
    assert greedy == best + [lp["tokens"][-1]]                              # the generated token: greedy
    scored = post(server, {**ask, "max_tokens": 0}).json()                 # scoring only: nothing generated
    assert scored["choices"][0]["text"] == "The loop runs" and scored["usage"]["completion_tokens"] == 0
    assert scored["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]
    texts = []
    with httpx.stream("POST", f"{base}/v1/completions", json={**ask, "stream": True, "max_tokens": 3}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    assert texts[0] == "The loop runs" and len(texts) == 4                 # the echo, then one chunk a token
    chunks = []
    with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                      json={**ask, "prompt": [whole, context], "max_tokens": 0, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and [c["index"] for c in chunks] == [0, 1]
    assert chunks[0]["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:-1], abs=1e-5)
    assert chunks[1]["text"] == "The loop" and chunks[1]["finish_reason"] == "length"


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": "x" * 49}, 400, "prompt"),
    ({"prompt": "x" * 40, "max_tokens": 30}, 400, "prompt"),
    ({"prompt": "hi", "n": 5}, 400, "n"),                       # 5 completions > --max-batch 4
    ({"prompt": ["a", "b"], "n": 3}, 400, "n"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": "2"}, 400, "logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),      # 0 only with echo
    ({"prompt": [1, 300]}, 400, "prompt"),                        # token ids beyond the vocabulary (257)
    ({"prompt": [[1, 2], []]}, 400, "prompt"),
    ({"prompt": [[1, 2], "ab"]}, 400, "prompt"),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": "x"}, 400, "frequency_penalty"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"257": 1}}, 400, "logit_bias"),     # beyond the vocabulary
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": ["5"]}, 400, "logit_bias"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),    # not streaming
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options"),
    ({"prompt": "hi", "model": "someone-else"}, 404, "model"),
])
def test_bad_requests_get_4xx_with_a_clear_message(server, body, status, param):
    r = post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_malformed_json_and_wrong_shapes(server):
    for raw in ('{"prompt": "hi",', "[1, 2]", "null", "not json"):
        r = httpx.post(f"{server['base']}/v1/completions", content=raw,
                       headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400 and "error" in r.json()


def test_a_too_long_prompt_is_rejected_without_harming_others(server):
    good = {"prompt": "good request", "max_tokens": 12, "temperature": 0}
    want = post(server, good).json()["choices"][0]["text"]
    bad = {"prompt": "y" * 200, "max_tokens": 5}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, server, b) for b in (good, bad, good, bad)]
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200, 400, 200, 400]
    assert all(r.json()["choices"][0]["text"] == want for r in results[::2])
    assert "exceeds" in results[1].json()["error"]["message"]
    assert post(server, good).status_code == 200      # still serving


def test_too_many_requests_get_429_and_the_rest_succeed(server):
    body = {"prompt": "busy busy", "max_tokens": 40, "temperature": 0}
    with ThreadPoolExecutor(3 * MAX_CONCURRENT) as pool:
        results = list(pool.map(lambda _: post(server, body), range(3 * MAX_CONCURRENT)))
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 429} and 200 in codes
    texts = {r.json()["choices"][0]["text"] for r in results if r.status_code == 200}
    assert len(texts) == 1
    for r in results:
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "rate_limit_error"
    assert post(server, {"prompt": "after", "max_tokens": 2}).status_code == 200



def _scheduler(speculative=None, **limits):
    from looplm.inference.engine import Engine, GenerationConfig
    from looplm.inference.scheduler import Scheduler
    from looplm.serve import ServeLimits

    torch.manual_seed(0)
    model = looplm.build_model(looplm.load_recipe("quickstart", overrides={**TINY, "model.context": 128})).eval()
    engine = Engine(model, ByteTokenizer(), GenerationConfig(speculative=speculative))
    return engine, Scheduler(engine, ServeLimits(**limits))


def _submit(sched, log, name, prompt, sp):
    """Queue one prompt whose events are logged as (name, token, last)."""
    from looplm.inference.scheduler import Row as _Row

    def send(ev):
        assert not isinstance(ev, Exception), ev
        log.append((name, ev.token, ev.finish_reason is not None))
    row = _Row(ids=list(prompt), params=sp, send=send)
    sched.submit(row)
    return row


def _run(sched, log, until, limit=1000):
    for _ in range(limit):
        if until():
            return
        sched.tick()
    raise AssertionError("the scheduler did not get there")


def _each_tick_one_token_until_the_first(sched, log, ticks):
    """Over `ticks` ticks "running" gets one token each and "long" its first token at the last."""
    for tick in range(1, ticks + 1):
        before = len(log)
        sched.tick()
        names = [n for n, _, _ in log[before:]]
        assert names.count("running") == 1, tick
        assert names.count("long") == (1 if tick == ticks else 0), tick


def test_a_short_request_is_not_held_behind_a_long_one():
    """With batches of one row, a prompt that arrives while a batch runs starts its own batch,
    advanced in turn with it."""
    from looplm.inference.engine import SamplingParams

    engine, sched = _scheduler(max_batch=1, max_batches=2)
    long_p = SamplingParams(max_new_tokens=100, stop_at_eos=False)
    short_p = SamplingParams(max_new_tokens=3, stop_at_eos=False)
    log: list[tuple[str, int, bool]] = []
    _submit(sched, log, "long", b"a long one", long_p)
    sched.tick()                                       # the long one's prefill and first token
    _submit(sched, log, "short", b"short", short_p)
    _run(sched, log, lambda: not sched.busy)
    assert [name for name, _, last in log if last] == ["short", "long"]
    assert [t for n, t, _ in log if n == "short"] == engine.generate([list(b"short")], short_p)[0].tokens
    assert [t for n, t, _ in log if n == "long"] == engine.generate([list(b"a long one")], long_p)[0].tokens


def test_prompts_that_fit_the_context_alone_but_not_together_start_separate_batches():
    """A new batch left-pads its prompts to the longest, so a long prompt with few tokens and a
    short one with many can each fit the context but not one batch: they go to batches of their
    own (in order), and each gets what the engine gives it alone (this was an error for both)."""
    from looplm.inference.engine import SamplingParams

    engine, sched = _scheduler(max_batch=4, max_batches=2)                 # context 128
    long_prompt, long_p = bytes(range(32, 132)), SamplingParams(max_new_tokens=3, stop_at_eos=False)
    short_prompt, short_p = b"hi", SamplingParams(max_new_tokens=60, stop_at_eos=False)
    log: list[tuple[str, int, bool]] = []
    _submit(sched, log, "long", long_prompt, long_p)
    _submit(sched, log, "short", short_prompt, short_p)
    _submit(sched, log, "short2", short_prompt, short_p)
    sched.tick()
    assert [len(b.rows) for b in sched.running] == [1, 2]                  # not [3]: 100 + 60 - 1 > 128
    _run(sched, log, lambda: not sched.busy)
    for name, prompt, sp in (("long", long_prompt, long_p), ("short", short_prompt, short_p),
                             ("short2", short_prompt, short_p)):
        assert [t for n, t, _ in log if n == name] == engine.generate([list(prompt)], sp)[0].tokens, name


def test_a_long_prompt_is_prefilled_in_chunks_between_the_other_batches_steps():
    """With prefill_chunk=8 a 60-token prompt's new batch takes 8 ticks to its first token, and
    the running batch emits a token at every one of them instead of waiting for the whole prompt."""
    from looplm.inference.engine import SamplingParams

    engine, sched = _scheduler(max_batch=1, max_batches=2, prefill_chunk=8)
    run_p = SamplingParams(max_new_tokens=30, stop_at_eos=False)
    long_prompt, long_p = bytes(range(65, 125)), SamplingParams(max_new_tokens=3, stop_at_eos=False)
    log: list[tuple[str, int, bool]] = []
    _submit(sched, log, "running", b"go", run_p)
    sched.tick()                                       # its prefill and first token
    _submit(sched, log, "long", long_prompt, long_p)
    _each_tick_one_token_until_the_first(sched, log, 8)              # ceil(60 / 8) = 8 chunks
    _run(sched, log, lambda: not sched.busy)
    assert [t for n, t, _ in log if n == "running"] == engine.generate([list(b"go")], run_p)[0].tokens
    assert [t for n, t, _ in log if n == "long"] == engine.generate([list(long_prompt)], long_p)[0].tokens


def test_a_long_prompt_joining_a_running_batch_is_prefilled_in_chunks():
    """A 60-token prompt takes the free row of a batch at column 70 over ceil(60 / 8) = 8 ticks,
    one chunk each, and the running row gets its token at every one of them."""
    from looplm.inference.engine import SamplingParams

    engine, sched = _scheduler(max_batch=2, max_batches=1, prefill_chunk=8)
    run_prompt, run_p = bytes(range(40, 110)), SamplingParams(max_new_tokens=30, stop_at_eos=False)
    long_prompt, long_p = bytes(range(65, 125)), SamplingParams(max_new_tokens=3, stop_at_eos=False)
    log: list[tuple[str, int, bool]] = []
    _submit(sched, log, "running", run_prompt, run_p)
    _run(sched, log, lambda: bool(log))                # its 9 prefill chunks and first token
    _submit(sched, log, "long", long_prompt, long_p)
    _each_tick_one_token_until_the_first(sched, log, 8)
    assert len(sched.running) == 1                     # it joined; no second batch
    _run(sched, log, lambda: not sched.busy)
    assert [t for n, t, _ in log if n == "running"] == engine.generate([list(run_prompt)], run_p)[0].tokens
    assert [t for n, t, _ in log if n == "long"] == engine.generate([list(long_prompt)], long_p)[0].tokens


def test_a_speculative_server_runs_each_request_as_its_own_batch_in_turn():
    """`looplm serve --speculative`: speculation is batch-1, so each prompt gets its own batch;
    they advance one verification each in turn and answer what plain decoding answers."""
    from looplm.inference.engine import Engine, SamplingParams

    engine, sched = _scheduler(speculative="1:3", max_batches=2)
    plain = Engine(engine.model, ByteTokenizer())
    jobs = {"a": (b"hello", SamplingParams(max_new_tokens=12, stop_at_eos=False)),
            "b": (b"The loop", SamplingParams(max_new_tokens=9, temperature=0.8, seed=2, stop_at_eos=False)),
            "c": (b"xy", SamplingParams(max_new_tokens=5, stop_at_eos=False))}
    log: list[tuple[str, int, bool]] = []
    for name, (prompt, sp) in jobs.items():
        _submit(sched, log, name, prompt, sp)
    sched.tick()
    assert len(sched.running) == 2 and len(sched.waiting) == 1       # one row per batch, two batches
    _run(sched, log, lambda: not sched.busy)
    for name in ("a", "c"):                                           # greedy: plain decoding's tokens
        prompt, sp = jobs[name]
        assert [t for n, t, _ in log if n == name] == plain.generate([list(prompt)], sp)[0].tokens, name
    prompt, sp = jobs["b"]                                            # sampled: seeded, as the engine alone
    assert [t for n, t, _ in log if n == "b"] == engine.generate([list(prompt)], sp)[0].tokens


def test_a_row_whose_client_went_away_stops():
    from looplm.inference.engine import SamplingParams

    engine, sched = _scheduler()
    log: list[tuple[str, int, bool]] = []
    gone = _submit(sched, log, "gone", b"gone", SamplingParams(max_new_tokens=50, stop_at_eos=False))
    stay = SamplingParams(max_new_tokens=6, stop_at_eos=False)
    _submit(sched, log, "stay", b"stay", stay)
    sched.tick()                                       # both rows' first tokens
    gone.cancelled = True                              # the client of "gone" reads one token and leaves
    _run(sched, log, lambda: not sched.busy)
    assert [n for n, _, _ in log].count("gone") == 1  # no token computed for a row nobody reads
    assert [t for n, t, _ in log if n == "stay"] == engine.generate([list(b"stay")], stay)[0].tokens


def test_a_new_request_takes_a_free_row_of_a_running_batch():
    """Continuous batching: with room for one batch only, a request that arrives after a short
    batch mate finished joins the running batch instead of waiting for the long row to end."""
    from looplm.inference.engine import SamplingParams

    engine, sched = _scheduler(max_batches=1, max_batch=2)
    jobs = {"long": (b"a long one", SamplingParams(max_new_tokens=100, stop_at_eos=False)),
            "short": (b"short", SamplingParams(max_new_tokens=2, stop_at_eos=False)),
            "late": (b"late", SamplingParams(max_new_tokens=5, temperature=0.9, seed=4, stop_at_eos=False))}
    log: list[tuple[str, int, bool]] = []
    for name in ("long", "short"):
        _submit(sched, log, name, *jobs[name])
    _run(sched, log, lambda: any(n == "short" and last for n, _, last in log))
    _submit(sched, log, "late", *jobs["late"])
    _run(sched, log, lambda: not sched.busy)
    assert len(sched.running) == 0 and [name for name, _, last in log if last] == ["short", "late", "long"]
    for name, (prompt, sp) in jobs.items():
        assert [t for n, t, _ in log if n == name] == engine.generate([list(prompt)], sp)[0].tokens, name


def test_a_client_gone_before_its_whole_response_stops_its_rows():
    """A non-streamed request whose client disconnects 0.1 s in (driven at the ASGI level, the
    receive channel behaving as a server's: after the body it waits, then gives http.disconnect
    when the connection closes): the server notices at once, stops the row instead of generating
    4,000 tokens, releases it, and answers 499 to nobody."""
    import asyncio
    import time as _time

    from looplm.inference.engine import Engine
    from looplm.serve import ServeLimits, create_app

    torch.manual_seed(0)
    model = looplm.build_model(looplm.load_recipe("quickstart", overrides={**TINY, "model.context": 4096})).eval()
    engine = Engine(model, ByteTokenizer())
    chunks = []
    run_chunk = engine.run_chunk
    engine.run_chunk = lambda *a, **k: (chunks.append(1), run_chunk(*a, **k))[1]
    app = create_app(engine, limits=ServeLimits(max_tokens=4000))
    body = json.dumps({"prompt": "hi", "max_tokens": 4000, "temperature": 0}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}

    async def scenario() -> list[dict]:
        sent, t0, delivered = [], _time.monotonic(), []

        async def receive() -> dict:
            if not delivered:
                delivered.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            if _time.monotonic() < t0 + 0.1:              # the client hangs up 0.1 s in; after that
                await asyncio.sleep(t0 + 0.1 - _time.monotonic())   # the disconnect is there at once
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        async with app.router.lifespan_context(app):
            await asyncio.wait_for(app(scope, receive, send), 60)
            for _ in range(100):                          # the scheduler drops the cancelled row
                if not app.state.scheduler.busy:
                    break
                await asyncio.sleep(0.01)
            assert not app.state.scheduler.busy and app.state.scheduler.in_flight == 0
        return sent

    sent = asyncio.run(scenario())
    assert next(m["status"] for m in sent if m["type"] == "http.response.start") == 499
    assert len(chunks) < 2000                              # stopped long before 4,000 tokens


def test_a_prompt_of_the_whole_context_is_scored_in_a_served_batch():
    """`echo` with `max_tokens: 0` scores a prompt as long as the context (the server's batches
    hold the whole context; the one token such a row samples is never fed back), in one request
    with a short prompt; `max_tokens: 1` continues it; 2 is a 400 naming the prompt."""
    import asyncio

    from looplm.inference.engine import Engine
    from looplm.model.looped import initial_noise_table
    from looplm.serve import ServeLimits, _token_text, create_app

    torch.manual_seed(0)
    model = looplm.build_model(looplm.load_recipe("quickstart", overrides=TINY)).eval()
    ctx = model.cfg.context
    ids = [(5 * i) % 90 + 32 for i in range(ctx)]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids]), initial_state=initial_noise_table(model.cfg, 3)[None])
                                .logits[0], -1)
    app = create_app(Engine(model, ByteTokenizer()))                     # the default limit: the context
    ask = {"prompt": [ids, ids[:4]], "echo": True, "logprobs": 1, "temperature": 0, "seed": 3}

    async def scenario() -> list:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return [await c.post("/v1/completions", json={**ask, "max_tokens": n}, timeout=60) for n in (0, 1, 2)]

    scored, continued, refused = asyncio.run(scenario())
    assert scored.status_code == 200 and continued.status_code == 200
    whole, short = scored.json()["choices"]
    assert whole["logprobs"]["token_logprobs"][1:] == pytest.approx([float(ref[t - 1, ids[t]]) for t in range(1, ctx)],
                                                                    abs=1e-4)
    assert short["logprobs"]["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:4], abs=1e-5)
    assert continued.json()["choices"][0]["logprobs"]["tokens"][-1] == _token_text(ByteTokenizer(), int(ref[-1].argmax()))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"


def test_clients_that_leave_mid_stream_do_not_disturb_the_others(server):
    bodies = [{"prompt": f"request {i} " * (1 + i % 3), "max_tokens": 8 + 5 * i, "temperature": 0.7 * (i % 2),
               "seed": i} for i in range(MAX_CONCURRENT)]
    alone = [post(server, b).json()["choices"][0]["text"] for b in bodies]

    def client(i):
        if i % 3 == 0:                              # read two events of a stream, then hang up
            with httpx.stream("POST", f"{server['base']}/v1/completions", json={**bodies[i], "stream": True},
                              timeout=60) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 2:
                        break
            return None
        return post(server, bodies[i]).json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(bodies)) as pool:
        got = list(pool.map(client, range(len(bodies))))
    assert [g for g in got if g is not None] == [a for a, g in zip(alone, got) if g is not None]
    assert post(server, bodies[1]).json()["choices"][0]["text"] == alone[1]      # still serving, same answer


@pytest.mark.parametrize("field, value", [("max_batch", 0), ("max_batches", 0), ("max_tokens", 0),
                                          ("prefill_chunk", -1), ("batch_window_ms", -1.0),
                                          ("max_prompt_tokens", -2), ("max_n", 0), ("max_body_bytes", 0)])
def test_serve_limits_out_of_range_are_user_errors_naming_the_flag(field, value):
    from looplm.errors import UserError
    from looplm.serve import ServeLimits

    with pytest.raises(UserError, match="--" + field.replace("_", "-")):
        ServeLimits(**{field: value})


def test_serve_without_the_serve_extra_says_what_to_install(monkeypatch, capsys):
    """A base install (no fastapi): `looplm serve` exits 2 with one line naming the extra."""
    import builtins
    import sys as _sys

    from looplm.cli import main

    real = builtins.__import__

    def no_fastapi(name, *args, **kwargs):
        if name.split(".")[0] == "fastapi":
            raise ModuleNotFoundError(f"No module named {name!r}", name="fastapi")
        return real(name, *args, **kwargs)

    monkeypatch.delitem(_sys.modules, "looplm.serve", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_fastapi)
    assert main(["serve", "some-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fastapi" in err and "[serve]" in err


def test_an_api_key_guards_every_endpoint_but_health():
    """With `api_key`, /v1/completions, /v1/models and the tokenizer endpoints answer 401 (OpenAI's
    invalid_api_key body) to a missing, wrong or non-Bearer key, before the body is validated and
    without scheduling anything; the right key gets what a server without a key answers."""
    import asyncio

    from looplm.inference.engine import Engine
    from looplm.serve import create_app

    torch.manual_seed(0)
    engine = Engine(looplm.build_model(looplm.load_recipe("quickstart", overrides=TINY)).eval(), ByteTokenizer())
    batches = []
    batch = engine.batch
    engine.batch = lambda *a, **k: (batches.append(1), batch(*a, **k))[1]
    key = "sk-looplm-test-0123"
    ask = {"prompt": "hello", "max_tokens": 6, "temperature": 0}
    calls = [("POST", "/v1/completions", ask), ("GET", "/v1/models", None), ("GET", "/tokenizer_info", None),
             ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [104, 105]})]
    refused = [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {key}"},
               {"Authorization": f"Bearer {key}x"}, {"Authorization": "Bearer"}]

    async def scenario(app, headers, calls) -> list:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return [await (c.request(m, path, content=body, headers={**headers, "Content-Type": "application/json"},
                                         timeout=60) if isinstance(body, bytes) else
                               c.request(m, path, json=body, headers=headers, timeout=60)) for m, path, body in calls]

    guarded = create_app(engine, api_key=key)
    invalid = [("POST", "/v1/completions", {"prompt": 5}), ("POST", "/tokenize", b"{not json")]   # 401 first
    for headers in refused:
        for r in asyncio.run(scenario(guarded, headers, calls + invalid)):
            assert r.status_code == 401, (headers, r.request.url, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert r.json()["error"]["code"] == "invalid_api_key" and key not in r.text
            assert r.headers["www-authenticate"] == "Bearer"
    assert batches == []                                       # nothing was scheduled
    health, = asyncio.run(scenario(guarded, {}, [("GET", "/health", None)]))
    assert health.status_code == 200                           # load balancers need no key
    allowed = asyncio.run(scenario(guarded, {"Authorization": f"Bearer {key}"}, calls + invalid))
    assert [r.status_code for r in allowed] == [200] * len(calls) + [400, 400] and batches
    opened = asyncio.run(scenario(create_app(engine), {}, calls))            # no key: open, as before
    assert [r.status_code for r in opened] == [200] * len(calls)
    assert allowed[0].json()["choices"][0]["text"] == opened[0].json()["choices"][0]["text"]
    def same(r):   # each app stamps its own creation second on its model
        body = r.json()
        for m in body.get("data", []) if isinstance(body, dict) else []:
            m.pop("created", None)
        return body
    assert [same(r) for r in allowed[1:len(calls)]] == [same(r) for r in opened[1:]]


def test_serve_takes_its_api_key_from_the_flag_else_the_environment(monkeypatch, capsys):
    """--api-key, else LOOPLM_API_KEY (the flag wins); neither: no key. An empty key, from either,
    is bad input: exit 2 with one line naming --api-key, and the server does not start."""
    import looplm.serve
    from looplm.cli import main

    started = []
    monkeypatch.setattr(looplm.serve, "serve", lambda run, **kw: started.append(kw["api_key"]))
    monkeypatch.delenv("LOOPLM_API_KEY", raising=False)
    assert main(["serve", "some-run"]) == 0 and started == [None]
    assert main(["serve", "some-run", "--api-key", "from-flag"]) == 0 and started[-1] == "from-flag"
    monkeypatch.setenv("LOOPLM_API_KEY", "from-env")
    assert main(["serve", "some-run"]) == 0 and started[-1] == "from-env"
    assert main(["serve", "some-run", "--api-key", "from-flag"]) == 0 and started[-1] == "from-flag"
    capsys.readouterr()
    for argv, env in [(["--api-key", ""], "from-env"), ([], ""), (["--api-key", "two words"], "from-env")]:
        monkeypatch.setenv("LOOPLM_API_KEY", env)
        assert main(["serve", "some-run", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--api-key" in err and "Traceback" not in err
        assert ("LOOPLM_API_KEY" in err) == (argv == [])
    assert len(started) == 4
