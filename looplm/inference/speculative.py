"""Self-speculative decoding for looped models (batch 1): draft shallow, verify at full depth.

    engine = Engine(model, tokenizer, GenerationConfig(speculative="1:4"))      # or "exit:4" with an --exit policy
    engine.generate(["def f("])[0].stats["speculative"]  # drafted, accepted, acceptance_rate, draft_mean_rounds

A looped model is its own draft model: K tokens are drafted with ROUNDS rounds each, reading the
full-depth history (or, with "exit:K", each draft stops at the round the exit policy picks, its
skipped rounds filled or masked for the next draft like any early exit). Then the pending token
and the K drafts are verified at full depth as one chunk, which overwrites every cache entry the
drafts wrote. After fixed-round drafts, verification starts the drafted columns at round ROUNDS+1
from the drafts' own states: their first rounds read the history plain decoding reads, so they
are plain decoding's. The accepted prefix plus the verifier's own token are kept and the cache is
trimmed to them. Greedy output equals plain full-depth greedy decoding; with temperature,
standard speculative sampling (accept with min(1, p/q), else resample from max(p - q, 0)) keeps
the target distribution (sampler.py). `stats["speculative"]["flops"]` counts every column computed
(model/flops.py DecodeWork): the prompt, each draft at its rounds, each verified column at full
depth, rejected ones included.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .cache import LoopKVCache
from ..model.flops import DecodeWork
from ..model.recurrence import unroll
from .request import RequestState
from .sampler import Sampler, SamplingParams, TokenEvent, token_logprobs

if TYPE_CHECKING:
    from .runner import Runner


class SpeculativeRun:
    """Self-speculative decoding behind DecodeBatch's interface (step, finished); it takes no new rows."""

    def __init__(self, engine: "Runner", ids: list[list[int]], plist: list[SamplingParams], deltas: bool):
        self.steps, self.finished = speculative_events(engine, ids, plist, deltas), False

    def step(self) -> list[TokenEvent]:
        """The tokens of the next verification (the accepted drafts and the verifier's own)."""
        if self.finished:
            return []
        with torch.inference_mode():
            try:
                return next(self.steps)
            except StopIteration:
                self.finished = True
                return []

    def join(self, prompt: Any, params: Any = None) -> None:
        return None

    def cancel(self, row: int) -> None:
        self.finished = True

    def compact(self) -> None:
        return None             # one row: nothing to move


def speculative_events(engine: "Runner", ids: list[list[int]], plist: list[SamplingParams],
                       deltas: bool) -> Iterator[list[TokenEvent]]:
    """One list of TokenEvents per verification (the accepted drafts and the verifier's token)."""
    assert engine.speculative is not None
    engine.kernels()
    draft_rounds, K = engine.speculative
    R, sp, prompt = engine.rounds, plist[0], ids[0]
    dev = next(engine.model.parameters()).device
    P, ctx = len(prompt), engine.cfg.context
    cache = engine.new_cache(1, P + sp.max_new_tokens + K + 1)
    noise = engine.initial_noise(plist, next(engine.model.parameters()))
    sampler = Sampler(plist, ids, engine.cfg.vocab_size, dev)
    req = RequestState.new(sp, engine.tokenizer, deltas)          # the one row's request (request.py)
    eos = getattr(engine.tokenizer, "eos_id", None)
    stats: dict[str, Any] = {"batch": 1, "rounds": R, "exit": f"fixed:{R}",
                             "prefill_cache": engine.config.prefill_cache, "decode_cache": "full",
                             "missing": engine.config.missing, "cache_bytes": cache.nbytes(),
                             "speculative": {"draft_rounds": draft_rounds, "k": K, "drafted": 0, "accepted": 0,
                                             "draft_exit": None if draft_rounds else str(engine.policy)}}
    spec = stats["speculative"]
    engine.last_stats = stats
    draft_round_sum = 0
    work = DecodeWork(engine.cfg)      # every column computed, recorded by the chunks that compute it

    def logprobs(rows: Tensor, toks: list[int]) -> list[Any]:
        """(token logprob, top) of each emitted token from the full-depth logits that chose it."""
        return token_logprobs(rows, toks, [sp.logprobs] * len(toks)) if sp.logprobs is not None else [None] * len(toks)

    t0 = time.perf_counter()
    scored = sp.prompt_logprobs is not None
    logits, _ = engine.run_chunk(torch.tensor([prompt], device=dev), 0, cache, phase="prefill", rounds=R,
                                 noise=noise, all_logits=scored, work=work)
    if scored:                     # column c's logits score the prompt token at c + 1
        got = token_logprobs(logits[0, :-1], prompt[1:], [sp.prompt_logprobs] * (P - 1))
        req.prompt_lp = [None] + [lp for lp, _ in got], [None] + [t for _, t in got]
        logits = logits[:, -1]
    pending = int(sampler(logits)[0])
    emit_lp = logprobs(logits, [pending])
    t1 = time.perf_counter()
    stats.update(prefill_s=t1 - t0, ttft_s=t1 - t0, prefill_tokens_per_s=P / max(t1 - t0, 1e-9))
    emit, col = [pending], P          # emit: tokens to hand out; pending sits at column col
    decode_start, cpu_start = t1, time.process_time()
    while True:
        events = []
        for tok, lp in zip(emit, emit_lp):
            req.sampled(tok, R, lp)
            events.append(req.emit(0, eos))
            if req.done:
                break
            sampler.observe_one(tok)
        reason = req.done
        yield events
        if reason:
            break
        # draft k tokens after `pending` with few rounds, reading the full-depth history
        k = min(K, sp.max_new_tokens - req.n_out - 1, ctx - 1 - col)
        drafts: list[int] = []
        q_list: list[Tensor | None] = []
        trace: list[tuple[Tensor, Tensor]] = []
        tok = pending
        for j in range(k):
            x = torch.tensor([[tok]], device=dev)
            if draft_rounds:
                lg, used = engine.run_chunk(x, col + j, cache, rounds=draft_rounds, noise=noise, commit=False,
                                            trace=trace, work=work, work_phase="draft")
            else:   # the policy's exit; commit fills (or masks) the rounds it skipped for the next draft
                lg, used = engine.run_chunk(x, col + j, cache, noise=noise, work=work, work_phase="draft")
            draft_round_sum += int(used) if isinstance(used, int) else int(used[0])
            tok, q = sampler.pick(lg[0], drafts)
            drafts.append(tok)
            q_list.append(q)
        # verify pending + drafts at full depth (overwriting the drafts' entries): fixed-round
        # drafts already ran rounds 1..d of the first k columns; exit drafts ran different ones
        if draft_rounds and k:
            lg = verify_from_drafts(engine, cache, col, drafts, trace, draft_rounds, noise)
            work.add("verify", col + k, draft_rounds, readouts=0)     # the last draft's first rounds
            for i in range(k + 1):
                work.add("verify", col + i, R - draft_rounds, prelude=False)
        else:
            chunk = torch.tensor([[pending] + drafts], device=dev)
            lg, _ = engine.run_chunk(chunk, col, cache, rounds=R, noise=noise, all_logits=True, work=work,
                                     work_phase="verify")
        accepted, nxt = sampler.verify(lg[0], drafts, q_list)
        spec["drafted"] += k
        spec["accepted"] += accepted
        cache.truncate(col + accepted + 1)
        emit = drafts[:accepted] + [nxt]
        emit_lp = logprobs(lg[0, :accepted + 1], emit)
        pending, col = nxt, col + accepted + 1
    decode_s = time.perf_counter() - decode_start
    n_dec = max(req.n_out - 1, 0)
    spec["acceptance_rate"] = spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0
    spec["draft_mean_rounds"] = draft_round_sum / spec["drafted"] if spec["drafted"] else 0.0
    spec["flops"] = {"prefill": 0.0, "draft": 0.0, "verify": 0.0, **work.by_phase, "attention": work.attention}
    stats["flops"] = {"prefill": spec["flops"]["prefill"], "decode": spec["flops"]["draft"] + spec["flops"]["verify"],
                      "attention": work.attention}
    stats.update(decode_s=decode_s, decode_cpu_s=time.process_time() - cpu_start, decode_tokens=n_dec,
                 decode_tokens_per_s=n_dec / decode_s if n_dec else 0.0)


def verify_from_drafts(engine: "Runner", cache: LoopKVCache, col: int, drafts: list[int],
                       trace: list[tuple[Tensor, Tensor]], d: int, noise: Tensor | None) -> Tensor:
    """Full-depth logits (1, K+1, V) of pending + K drafts at columns col..col+K, reusing what
    the drafts computed: draft j ran the token at column col+j through the prelude and rounds
    1..d reading the same history plain decoding reads, so its prelude output and state after
    round d (`trace`) are plain decoding's. Only the last draft's token (column col+K) runs
    those; then rounds d+1..R and the coda run on all K+1 columns as one chunk."""
    k, R, K = engine.kernels(), engine.rounds, len(drafts)
    last = torch.tensor([[drafts[-1]]], device=trace[0][0].device)
    cache.begin(col + K, 1, "decode")
    rope1, e1, s1 = engine.chunk_inputs(last, col + K, cache, noise, None)
    s1 = unroll(lambda s, r: k.core_step(s, e1, r, rope1, cache), s1, d).state
    e = torch.cat([t[0] for t in trace] + [e1], 1)                          # (1, K+1, d)
    s = torch.cat([t[1] for t in trace] + [s1], 1)
    cache.begin(col, K + 1, "decode")
    rope = k.rope(col, K + 1, None)
    if d < R:
        s = unroll(lambda s, r: k.core_step(s, e, d + r, rope, cache), s, R - d).state
    logits = k.readout(s, rope, cache, R, True)
    cache.commit(R)
    return logits
