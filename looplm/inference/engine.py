"""Cached generation for looped models: prefill, decode, exits, sampling, streaming, speculation.

    engine = Engine(model, tokenizer, GenerationConfig(exit="entropy:1.5", decode_cache="last"))
    for ev in engine.stream(["Hello", "A longer prompt"], SamplingParams(max_new_tokens=32)):
        print(ev.row, repr(ev.text))           # streamed text deltas, one event per token per row
    done = engine.generate(["Hello"], SamplingParams(temperature=0.8, top_p=0.9, seed=1))

How a batch runs. Prompts of different lengths are left-padded into shared cache columns; each
row keeps its own RoPE positions (column - pad) and never attends to its pad columns, so a row's
result does not depend on its batch mates. The prompt is one chunk through prelude -> R rounds
-> coda (`LoopKVCache` stores per-round keys/values); each new token is a chunk of one column.
Rows that have finished (eos, a stop string, their max_new_tokens) are left out of later chunks,
and `DecodeBatch.join` (batch.py) places a new prompt in a free row, right-aligned to the running
rows' column (continuous batching; `Engine.batch` opens one, the server keeps several).

Exit policies (`fixed:R`, `quantile:Q`, `entropy:TAU`, `kl:EPS`) are decided per token after
every round by `halting.ExitController`, the one controller whole-sequence early exit (inference/early_exit.py) and
speculative exit drafts use too; a row that exits stops computing (the remaining rows continue as
a smaller batch), and the rounds each token ran are returned. Tokens that exited early leave
holes in later rounds' history, which the cache fills by copy-forward or masks, as configured
(`missing`); a token's coda entry is its exit-round readout's. `looplm eval --exit` computes
the same function (tested with a coda).

Random initial loop states (Huginn) are drawn from a per-row table indexed by the token's
position and seeded by the request seed, so cached, batched and token-by-token decoding all see
the same noise and one seed reproduces one output.

Self-speculative decoding (`speculative="ROUNDS:K"` or `"exit:K"`, batch 1) drafts shallow and
verifies at full depth through the same chunks (speculative.py).

Layout. `Engine` is the facade; the chunks run in `Runner` (runner.py), which it extends and which imports
none of batch.py, depth.py or speculative.py (they are written against the runner). With
`batching="depth"` a batch is a `DepthBatch` (depth.py): continuous depth batching, each step one round of
every token in flight.

Speed. The model's own blocks run through the `PackedOps` backend (kernels.py): the same
arithmetic as `model(idx)` (parity is tested), with fused q/k/v and gate/up products on
pre-laid-out weights; the cache is written in place and read as views.
Per decoded token the Python loop does one chunk call and one sampling call (sampler.py: per-row
sampling and text); text is decoded only when streaming or when stop strings are set. The
no-cache reference (`inference/reference.py`) uses the same position-indexed noise table
(`model.initial_noise_table`), so parity holds for every initial state.
"""


from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError
from .batch import DecodeBatch
from .contrast import check_contrast, contrast_logits, parse_contrast
from .depth import DepthBatch
from .recirculation import Recirculation
from .runner import ChunkResult, GenerationConfig, Runner
from .sampler import SamplingParams, TokenEvent
from .speculative import SpeculativeRun

__all__ = ["ChunkResult", "Completion", "Engine", "GenerationConfig", "SamplingParams", "TokenEvent", "check_contrast",
           "contrast_logits", "generate_for_run", "parse_contrast"]


@dataclass
class Completion:
    """One row's result (what `Engine.generate` returns, one per prompt)."""

    text: str
    tokens: list[int]
    rounds_used: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list[float] | None = None
    """Each token's log-probability, when its SamplingParams asked (`logprobs`)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token, the likeliest tokens and their log-probabilities (as many as asked)."""
    prompt_logprobs: list[float | None] | None = None
    """Each prompt token's log-probability (None for the first), when asked (`prompt_logprobs`)."""
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """Per prompt token, the likeliest tokens at its position (None for the first), when asked."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Batch timings and counters: prefill_tokens_per_s, decode_tokens_per_s, ttft_s, flops (forward FLOPs
    of every column computed, by phase: model/flops.py), ...; shared by the batch."""



class Engine(Runner):
    """Generation with a static per-round KV cache over a `LoopedLM` (see the module docstring): the public facade
    over the chunk runner (runner.py)."""

    @classmethod
    def from_run(cls, run: Any, config: GenerationConfig | None = None, **overrides: Any) -> "Engine":
        """An engine for a loaded run; the recipe's exit settings are the defaults."""
        ex = run.recipe.exit
        base = dict(exit=ex.policy, min_rounds=ex.min_rounds, exit_in_prefill=ex.exit_in_prefill)
        if config is not None:
            base.update({k: getattr(config, k) for k in config.__dataclass_fields__})
        base.update(overrides)
        given = {**({} if config is None else {"exit": config.exit}), **overrides}
        if base.get("batching") == "static":   # the full-depth baseline: the recipe's exit settings are not it
            base.update({k: v for k, v in (("exit", "fixed"), ("exit_in_prefill", False)) if k not in given})
        return cls(run.model, run.tokenizer, GenerationConfig(**base))

    # -- public API -----------------------------------------------------------------------
    def stream(self, prompts: Sequence[str | Sequence[int]] | str,
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[TokenEvent]:
        """Yield one TokenEvent per generated token per row, as soon as it is sampled."""
        ids, plist = self.prepare(prompts, params)
        return _events(self._open(ids, plist, deltas=True))

    def batch(self, prompts: Sequence[str | Sequence[int]] | str,
              params: SamplingParams | Sequence[SamplingParams] | None = None, *,
              length: int | None = None, capacity: int | None = None,
              prefill_chunk: int | None = None) -> "DecodeBatch | SpeculativeRun":
        """A batch to advance one step at a time: `step()` returns that step's TokenEvents and
        `finished` says when every row is done. A plain engine's DecodeBatch also takes new
        prompts into free rows (`join`): `capacity` rows in all (default: one per prompt) and
        `length` cache columns (default: what these prompts need; more leaves room for prompts
        that join later). `prefill_chunk`: prefill at most this many columns per `step()` (those
        steps return no events), so that a server can advance its other batches in between."""
        ids, plist = self.prepare(prompts, params)
        return self._open(ids, plist, deltas=True, length=length, capacity=capacity, prefill_chunk=prefill_chunk)

    def _open(self, ids: list[list[int]], plist: list[SamplingParams], deltas: bool, length: int | None = None,
              capacity: int | None = None, prefill_chunk: int | None = None) -> "DecodeBatch | SpeculativeRun":
        if self.speculative is not None:
            if len(ids) != 1:
                raise UserError("--speculative decodes one prompt at a time (batch 1)")
            return SpeculativeRun(self, ids, plist, deltas)
        if self.config.batching == "depth":
            return DepthBatch(self, capacity or len(ids), deltas, prompts=(ids, plist), prefill_chunk=prefill_chunk)
        return DecodeBatch(self, ids, plist, deltas, length, capacity, prefill_chunk)

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Generate for every prompt (one batch); one Completion per prompt, in order."""
        ids, plist = self.prepare(prompts, params)
        events = _events(self._open(ids, plist, deltas=False))
        toks: list[list[int]] = [[] for _ in ids]
        rounds: list[list[int]] = [[] for _ in ids]
        texts = [""] * len(ids)
        reasons = ["length"] * len(ids)
        lps: list[list[float]] = [[] for _ in ids]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in ids]
        prompt: dict[int, TokenEvent] = {}                   # each row's first event (prompt_logprobs)
        for ev in events:
            prompt.setdefault(ev.row, ev)
            toks[ev.row].append(ev.token)
            rounds[ev.row].append(ev.rounds)
            texts[ev.row] += ev.text
            if ev.finish_reason:
                reasons[ev.row] = ev.finish_reason
            if ev.logprob is not None:
                lps[ev.row].append(ev.logprob)
                tops[ev.row].append(ev.top_logprobs or [])
        stats = dict(self.last_stats)
        return [Completion(text=texts[b], tokens=toks[b], rounds_used=rounds[b], finish_reason=reasons[b],
                           prompt_tokens=len(ids[b]), stats=stats,
                           logprobs=lps[b] if plist[b].logprobs is not None else None,
                           top_logprobs=tops[b] if plist[b].logprobs is not None else None,
                           prompt_logprobs=prompt[b].prompt_logprobs if b in prompt else None,
                           prompt_top_logprobs=prompt[b].prompt_top_logprobs if b in prompt else None)
                for b in range(len(ids))]

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], top: int = 0, seeds: Sequence[int] | None = None,
                        prompt_mode: str | None = None
                        ) -> list[tuple[list[float | None], list[list[tuple[int, float]] | None]]]:
        """Per prompt: each token's log-probability given the tokens before it and the `top`
        likeliest tokens' at its position (None for the first token), from this engine's prefill
        of the prompts as one batch (`SamplingParams.prompt_logprobs`; `seeds`: each row's random
        initial state, default 0)."""
        ids, plist = self.prepare(list(prompts), [SamplingParams(max_new_tokens=1, seed=sd, prompt_logprobs=top,
                                                                  stop_at_eos=False, prompt_mode=prompt_mode)
                                                   for sd in (seeds or [0] * len(prompts))])
        events = DecodeBatch(self, ids, plist, deltas=False).step()     # batched prefill, even when speculative
        return [(ev.prompt_logprobs or [], ev.prompt_top_logprobs or []) for ev in sorted(events, key=lambda ev: ev.row)]

def _events(run: "DecodeBatch | SpeculativeRun") -> Iterator[TokenEvent]:
    """A batch's events, step after step, until it finishes."""
    while not run.finished:
        yield from run.step()


def generate_for_run(run: Any, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
                     rounds: int | None = None, exit: str | None = None, prefill_cache: str | None = None,
                     decode_cache: str | None = None, missing: str | None = None, speculative: str | None = None,
                     top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                     presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                     stop: Sequence[str] = (), logprobs: int | None = None,
                     logit_bias: dict[int, float] | None = None, prompt_mode: str | None = None,
                     recirculation: Recirculation | None = None,
                     contrast: tuple[int, float] | None = None) -> dict[str, Any]:
    """`looplm generate`: one prompt through the cached engine; the CONTRACT's JSON shape plus details.
    `recirculation` (generate --recirculate, recirculate --prompt): the engine refines each position's history.
    `contrast` (generate --contrast, parsed by `parse_contrast`): LoopCD-style logits (GenerationConfig.contrast)."""
    overrides = {k: v for k, v in dict(rounds=rounds, exit=exit, prefill_cache=prefill_cache,
                                       decode_cache=decode_cache, missing=missing, speculative=speculative,
                                       recirculation=recirculation, contrast=contrast).items() if v is not None}
    engine = Engine.from_run(run, **overrides)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, top_k=top_k,
                            top_p=top_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, logit_bias=logit_bias or {}, stop=tuple(stop),
                            logprobs=logprobs, prompt_mode=prompt_mode)
    out = engine.generate([prompt], params)[0]
    st = out.stats
    result = {"text": out.text, "tokens": out.tokens, "rounds_used": out.rounds_used,
              "prefill_tokens_per_s": st["prefill_tokens_per_s"], "decode_tokens_per_s": st["decode_tokens_per_s"],
              "ttft_s": st["ttft_s"], "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
              "mean_rounds": sum(out.rounds_used) / max(len(out.rounds_used), 1), "max_rounds": engine.rounds,
              "exit": st["exit"], "prefill_cache": st["prefill_cache"], "decode_cache": st["decode_cache"],
              "missing_kv": st["missing"], "cache_bytes": st["cache_bytes"], "prompt_mode": engine.prompt_mode(params)}
    # compute beside the measured speed: the FLOPs of every column the engine computed (model/flops.py,
    # recorded by the chunks that ran them), the prompt's per prompt token and the rest per token
    # decoded after the first (which the prefill's pass produced); under speculation drafts and
    # rejected verifications included
    work, n_dec, P = st["flops"], st["decode_tokens"], out.prompt_tokens
    result["flops"] = dict(work)
    result["flops_per_token"] = {"decode": work["decode"] / n_dec if n_dec else 0.0,
                                 "prefill": work["prefill"] / max(P, 1),
                                 "decode_flops_per_s": work["decode"] / max(st["decode_s"], 1e-9) if n_dec else 0.0}
    if "speculative" in st:
        result["speculative"] = st["speculative"]
    if recirculation is not None:
        import dataclasses
        result["recirculation"] = dataclasses.asdict(recirculation)
    if contrast is not None:
        result["contrast"] = {"round": contrast[0], "beta": contrast[1], "final_round": engine.rounds}
    if out.logprobs is not None:
        result["logprobs"], result["top_logprobs"] = out.logprobs, out.top_logprobs
    return result
