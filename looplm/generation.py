"""Cached generation for looped models: prefill, decode, exits, sampling, streaming, speculation.

    engine = Engine(model, tokenizer, GenerationConfig(exit="entropy:1.5", decode_cache="last"))
    for ev in engine.stream(["Hello", "A longer prompt"], SamplingParams(max_new_tokens=32)):
        print(ev.row, repr(ev.text))           # streamed text deltas, one event per token per row
    done = engine.generate(["Hello"], SamplingParams(temperature=0.8, top_p=0.9, seed=1))

How a batch runs. Prompts of different lengths are left-padded into shared cache columns; each
row keeps its own RoPE positions (column - pad) and never attends to its pad columns, so a row's
result does not depend on its batch mates. The prompt is one chunk through prelude -> R rounds
-> coda (`LoopKVCache` stores per-round keys/values); each new token is a chunk of one column.

Exit policies (`fixed:R`, `quantile:Q`, `entropy:TAU`, `kl:EPS`, see halting.py) are checked per
token after every round; a row that exits stops computing (the remaining rows continue as a
smaller batch), and the rounds each token ran are returned. Tokens that exited early leave holes
in later rounds' history, which the cache fills by copy-forward or masks, as configured.

Random initial loop states (Huginn) are drawn from a per-row table indexed by the token's
position and seeded by the request seed, so cached, batched and token-by-token decoding all see
the same noise and one seed reproduces one output.

Self-speculative decoding (`speculative="ROUNDS:K"`, batch 1): K tokens are drafted with ROUNDS
rounds reading the full-depth history, then the pending token and the K drafts are verified at
full depth as one chunk, which overwrites every cache entry the drafts wrote. The accepted prefix
plus the verifier's own token are kept and the cache is trimmed to them. Greedy output equals
plain greedy decoding; with temperature, standard speculative sampling (accept with
min(1, p/q), else resample from max(p - q, 0)) keeps the target distribution.

Speed. The model's math runs through `_Kernels`: the same arithmetic as the model's modules
(parity with `model(idx)` is tested) with fused q/k/v and gate/up matmuls, pre-laid-out
weights and no module calls; the cache is written in place and read as views. Per decoded
token the Python loop does one chunk call and one argmax; text is decoded only when streaming
or when stop strings are set. The no-cache reference (`sampling.py`) uses the same
position-indexed noise table (`model.initial_noise_table`), so parity holds for every initial state.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .cache import MISSING, LoopKVCache, check_policy
from .errors import UserError
from .halting import ExitPolicy, parse_exit_policy, should_exit
from .engine import unroll
from .model import initial_noise_table


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples; every field is checked here (UserError names it)."""

    max_new_tokens: int = 64
    """Tokens to generate at most (the eos token and stop strings end earlier)."""
    temperature: float = 0.0
    """0 = greedy; otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Sample only among the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Sample only from the smallest set of tokens whose probability reaches top_p (1 = off)."""
    repetition_penalty: float = 1.0
    """CTRL penalty on tokens already in the prompt or output: positive logits / p, negative * p (1 = off)."""
    stop: tuple[str, ...] = ()
    """Generation ends when the text contains one of these; the text is cut before it."""
    seed: int = 0
    """Seeds sampling and a random initial loop state; the same seed gives the same output."""
    stop_at_eos: bool = True
    """End a row when it emits the tokenizer's eos token."""

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str, value: Any) -> UserError:
            return UserError(f"{name} {value!r}: {allowed}")

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be an integer >= 1", self.max_new_tokens)
        if not _is_num(self.temperature) or not 0 <= self.temperature <= 100:
            raise bad("temperature", "must be a number in [0, 100] (0 = greedy)", self.temperature)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 = off)", self.top_k)
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be a number in (0, 1]", self.top_p)
        if not _is_num(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "must be a number in (0, 100] (1 = off)", self.repetition_penalty)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > 16 or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "must be at most 16 non-empty strings", self.stop)
        object.__setattr__(self, "stop", stop)
        if not _is_int(self.seed):
            raise bad("seed", "must be an integer", self.seed)
        object.__setattr__(self, "temperature", float(self.temperature))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """Engine settings shared by every row of a batch."""

    rounds: int | None = None
    """Most rounds per token (default: the model's nominal depth, or R of an exit policy fixed:R)."""
    exit: str = "fixed"
    """Exit policy: fixed (all rounds), fixed:R, quantile:Q, entropy:TAU or kl:EPS."""
    prefill_cache: str = "full"
    """What prompt tokens leave in the cache: full, first, last or average."""
    decode_cache: str = "full"
    """What generated tokens leave in the cache: full, first, last or average."""
    missing: str = "copy_forward"
    """Under full, what later rounds read for a token that exited early: copy_forward or mask."""
    speculative: str | None = None
    """"ROUNDS:K": draft K tokens with ROUNDS rounds, verify at full depth (batch 1)."""
    min_rounds: int = 1
    """Exit policies never stop before this round."""
    exit_in_prefill: bool = False
    """Let prompt tokens exit early too (the prompt then runs token by token)."""


@dataclass
class TokenEvent:
    """One generated token of one row (what `Engine.stream` yields)."""

    row: int
    token: int
    text: str
    """Text newly safe to show (complete characters, never part of a stop string)."""
    rounds: int
    """Rounds run for this token."""
    finish_reason: str | None = None
    """On the row's last event: "stop" (eos or a stop string) or "length"."""


@dataclass
class Completion:
    """One row's result (what `Engine.generate` returns, one per prompt)."""

    text: str
    tokens: list[int]
    rounds_used: list[int]
    finish_reason: str
    prompt_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)
    """Batch timings and counters: prefill_tokens_per_s, decode_tokens_per_s, ttft_s, ...; shared by the batch."""


class Engine:
    """Generation with a static per-round KV cache over a `LoopedLM` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, config: GenerationConfig | None = None):
        config = config or GenerationConfig()
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.cfg = model.cfg
        check_policy(config.prefill_cache, "--prefill-cache")
        check_policy(config.decode_cache, "--decode-cache")
        if config.missing not in MISSING:
            raise UserError(f"--missing-kv {config.missing!r}: expected one of {', '.join(MISSING)}")
        if config.rounds is not None and (not _is_int(config.rounds) or config.rounds < 1):
            raise UserError(f"--rounds {config.rounds!r}: must be an integer >= 1")
        text = config.exit.strip()
        if text == "fixed":
            text = f"fixed:{config.rounds or model.nominal_rounds}"
        self.policy: ExitPolicy = parse_exit_policy(text, min_rounds=config.min_rounds,
                                                    exit_in_prefill=config.exit_in_prefill)
        if self.policy.kind == "fixed":
            if config.rounds is not None and config.rounds != self.policy.value:
                raise UserError(f"--rounds {config.rounds} disagrees with --exit {self.policy}")
            self.rounds = int(self.policy.value)
        else:
            self.rounds = config.rounds or model.nominal_rounds
        if self.cfg.untied and self.rounds != model.nominal_rounds:
            raise UserError(f"--rounds: this untied baseline runs exactly {model.nominal_rounds} rounds")
        if self.policy.kind == "quantile" and model.gate is None:
            raise UserError(f"--exit {self.policy}: quantile needs a model trained with an exit gate (exit.gate)")
        self.adaptive = self.policy.kind != "fixed"
        self.speculative: tuple[int, int] | None = None
        if config.speculative:
            self.speculative = _parse_speculative(config.speculative, self.rounds)
            if self.adaptive:
                raise UserError(f"--speculative verifies at full depth; it cannot be combined with the early-exit "
                                f"policy {self.policy} (from --exit or the recipe's exit.policy); pass --exit fixed")
            if config.decode_cache != "full":
                raise UserError("--speculative needs --decode-cache full (verification must reproduce plain decoding)")
        self.last_stats: dict[str, Any] = {}
        self._fast: _Kernels | None = None

    @classmethod
    def from_run(cls, run: Any, config: GenerationConfig | None = None, **overrides: Any) -> "Engine":
        """An engine for a loaded run; the recipe's exit settings are the defaults."""
        ex = run.recipe.exit
        base = dict(exit=ex.policy, min_rounds=ex.min_rounds, exit_in_prefill=ex.exit_in_prefill)
        if config is not None:
            base.update({k: getattr(config, k) for k in config.__dataclass_fields__})
        base.update(overrides)
        return cls(run.model, run.tokenizer, GenerationConfig(**base))

    # -- public API -----------------------------------------------------------------------
    def stream(self, prompts: Sequence[str | Sequence[int]] | str,
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[TokenEvent]:
        """Yield one TokenEvent per generated token per row, as soon as it is sampled."""
        ids, plist = self._prepare(prompts, params)
        if self.speculative is not None:
            return self._speculative_events(ids, plist, deltas=True)
        return self._batch_events(ids, plist, deltas=True)

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Generate for every prompt (one batch); one Completion per prompt, in order."""
        ids, plist = self._prepare(prompts, params)
        events = (self._speculative_events(ids, plist, deltas=False) if self.speculative is not None
                  else self._batch_events(ids, plist, deltas=False))
        toks: list[list[int]] = [[] for _ in ids]
        rounds: list[list[int]] = [[] for _ in ids]
        texts = [""] * len(ids)
        reasons = ["length"] * len(ids)
        for ev in events:
            toks[ev.row].append(ev.token)
            rounds[ev.row].append(ev.rounds)
            texts[ev.row] += ev.text
            if ev.finish_reason:
                reasons[ev.row] = ev.finish_reason
        stats = dict(self.last_stats)
        return [Completion(text=texts[b], tokens=toks[b], rounds_used=rounds[b], finish_reason=reasons[b],
                           prompt_tokens=len(ids[b]), stats=stats) for b in range(len(ids))]

    def new_cache(self, batch: int, length: int, pad: Tensor | None = None) -> LoopKVCache:
        c = self.config
        p = next(self.model.parameters())
        return LoopKVCache(self.cfg, batch=batch, length=length, rounds=self.rounds, prefill=c.prefill_cache,
                           decode=c.decode_cache, missing=c.missing, pad=pad, dtype=p.dtype, device=p.device)

    # -- preparation ----------------------------------------------------------------------
    def _prepare(self, prompts: Any, params: Any) -> tuple[list[list[int]], list[SamplingParams]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise UserError("prompt: at least one prompt is needed")
        ids: list[list[int]] = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise UserError("prompt: text prompts need a tokenizer; pass token ids instead")
                p = self.tokenizer.encode(p)
            p = [int(t) for t in p]
            if not p:
                raise UserError("prompt: must not be empty")
            if min(p) < 0 or max(p) >= self.cfg.vocab_size:
                raise UserError(f"prompt: token ids must lie in 0..{self.cfg.vocab_size - 1}")
            ids.append(p)
        params = params or SamplingParams()
        plist = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(ids):
            raise ValueError(f"{len(plist)} SamplingParams for {len(ids)} prompts")
        ctx = self.cfg.context
        for p, sp in zip(ids, plist):
            if len(p) + sp.max_new_tokens > ctx:
                raise UserError(f"prompt: {len(p)} prompt tokens + {sp.max_new_tokens} new tokens exceed "
                                f"the model context of {ctx}")
        if self.speculative is not None and len(ids) != 1:
            raise UserError("--speculative decodes one prompt at a time (batch 1)")
        return ids, plist

    def _noise(self, plist: Sequence[SamplingParams], ref: Tensor) -> Tensor | None:
        """(B, context, d) initial loop states by position, one seeded table per row (random init only)."""
        cfg = self.cfg
        if cfg.init_state != "random":
            return None
        tables = [initial_noise_table(cfg, sp.seed) for sp in plist]
        return torch.stack(tables).to(device=ref.device, dtype=ref.dtype)

    # -- one chunk through the model ------------------------------------------------------
    def run_chunk(self, idx: Tensor, start: int, cache: LoopKVCache, *, phase: str = "decode",
                  rounds: int | None = None, noise: Tensor | None = None, all_logits: bool = False,
                  commit: bool = True) -> tuple[Tensor, Tensor | int]:
        """Run tokens idx (B, T) at cache columns [start, start+T). Returns (logits, rounds_used):
        logits (B, T, V) with all_logits else (B, V) at the last column; rounds_used an int, or (B,)
        when an exit policy decided per row. `rounds` forces a fixed depth (speculative drafts)."""
        m, k = self.model, self._fast or self._kernels()
        B, T = idx.shape
        cache.begin(start, T, phase)
        positions = None
        if cache.padded:
            cols = torch.arange(start, start + T, device=idx.device)
            positions = (cols[None, :] - cache.pad[:, None]).clamp_min(0)       # (B, T)
        rope = k.rope(start, T, positions)
        e = k.encode(idx, rope, cache)                                          # (B, T, d)
        if noise is not None:
            s = noise[:, start:start + T] if positions is None else noise[torch.arange(B)[:, None], positions]
        else:
            s = m.initial_state(e)
        exits = self.adaptive and rounds is None and (phase == "decode" or self.policy.exit_in_prefill)
        if not exits:
            R = rounds or self.rounds
            s = unroll(lambda s, r: k.core_step(s, e, r, rope, cache), s, R).state
            logits = k.readout(s, rope, cache, R, all_logits)
            if commit:
                cache.commit(R)
            return logits, R
        if T != 1:
            raise ValueError("per-token exits run one column at a time")
        logits, used = self._rounds_with_exits(s, e, rope, cache, phase)
        if commit:
            cache.commit(used)
        return logits, used

    def _kernels(self) -> "_Kernels":
        """The fused kernels, rebuilt when a model weight changed in place since they were made
        (checked when a generation starts, not per token)."""
        if self._fast is None or self._fast.stale():
            self._fast = _Kernels(self.model)
        return self._fast

    def _rounds_with_exits(self, s: Tensor, e: Tensor, rope: Any, cache: LoopKVCache,
                           phase: str) -> tuple[Tensor, Tensor]:
        """Run up to R rounds for one column; each row stops at its policy's exit round."""
        m, k, policy, R = self.model, self._fast or self._kernels(), self.policy, self.rounds
        B = s.shape[0]
        rows = torch.arange(B, device=s.device)        # batch rows still computing
        used = torch.full((B,), R, dtype=torch.long)
        out = torch.empty(B, self.cfg.vocab_size, device=s.device, dtype=s.dtype)
        need_logits = policy.kind in ("entropy", "kl")
        prev: Tensor | None = None
        hazards: Tensor | None = None
        for r in range(1, R + 1):
            s = k.core_step(s, e, r, rope, cache)
            logits = k.readout(s, rope, cache, r, False) if need_logits else None         # (B', V)
            if policy.kind == "quantile":
                h = m.hazard(s)[:, -1:]                                               # (B', 1)
                hazards = h if hazards is None else torch.cat([hazards, h], dim=-1)
            stop = should_exit(policy, r, R, hazards_so_far=hazards, logits=logits, prev_logits=prev,
                               prefill=phase == "prefill").reshape(-1).expand(rows.shape[0])
            if bool(stop.any()):
                done = rows[stop]
                if logits is None:  # the exiting rows read out now (their coda entry is this round's)
                    cache.select(done)
                    out[done] = k.readout(s[stop], _rows_of(rope, stop), cache, r, False)
                else:
                    out[done] = logits[stop]
                used[done.cpu()] = r
                keep = ~stop
                if not bool(keep.any()):
                    break
                rows, s, e, rope = rows[keep], s[keep], e[keep], _rows_of(rope, keep)
                prev = None if logits is None else logits[keep]
                hazards = None if hazards is None else hazards[keep]
                cache.select(rows)
            else:
                prev = logits
        return out, used

    # -- batched decoding -----------------------------------------------------------------
    def _batch_events(self, ids: list[list[int]], plist: list[SamplingParams], deltas: bool) -> Iterator[TokenEvent]:
        self._kernels()
        dev = next(self.model.parameters()).device
        B = len(ids)
        P = max(len(p) for p in ids)
        max_new = max(sp.max_new_tokens for sp in plist)
        pad = torch.tensor([P - len(p) for p in ids], dtype=torch.long, device=dev)
        idx = torch.zeros(B, P, dtype=torch.long, device=dev)
        for b, p in enumerate(ids):
            idx[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        cache = self.new_cache(B, P + max_new, pad)
        noise = self._noise(plist, next(self.model.parameters()))
        sampler = _Sampler(plist, ids, self.cfg.vocab_size, dev)
        texts = [_Text(self.tokenizer, sp.stop, deltas) for sp in plist]
        eos = getattr(self.tokenizer, "eos_id", None)
        done = [False] * B
        n_out = [0] * B
        latencies: list[float] = []
        stats: dict[str, Any] = {"batch": B, "rounds": self.rounds, "exit": str(self.policy),
                                 "prefill_cache": self.config.prefill_cache, "decode_cache": self.config.decode_cache,
                                 "missing": self.config.missing, "cache_bytes": cache.nbytes()}
        self.last_stats = stats
        with torch.inference_mode():
            t0 = time.perf_counter()
            if self.adaptive and self.policy.exit_in_prefill:    # prompt tokens may exit: one column at a time
                for c in range(P):
                    logits, used = self.run_chunk(idx[:, c:c + 1], c, cache, phase="prefill", noise=noise)
            else:
                logits, used = self.run_chunk(idx, 0, cache, phase="prefill", noise=noise)
            nxt = sampler(logits)
            t1 = time.perf_counter()
            stats.update(prefill_s=t1 - t0, ttft_s=t1 - t0, prefill_tokens_per_s=sum(map(len, ids)) / max(t1 - t0, 1e-9))
            col, step_start, cpu_start = P, t1, time.process_time()
            while True:
                used_l = [used] * B if isinstance(used, int) else used.tolist()
                nxt_l = nxt.tolist()
                for b in range(B):
                    if done[b]:
                        continue
                    tok = nxt_l[b]
                    n_out[b] += 1
                    reason = None
                    if _is_eos(plist[b], eos, tok):
                        reason = "stop"
                        delta = texts[b].finish()
                    else:
                        delta, hit = texts[b].push(tok)
                        if hit:
                            reason = "stop"
                            delta += texts[b].finish()
                        elif n_out[b] >= plist[b].max_new_tokens:
                            reason = "length"
                            delta += texts[b].finish()
                    done[b] = reason is not None
                    yield TokenEvent(row=b, token=tok, text=delta, rounds=used_l[b], finish_reason=reason)
                if all(done):
                    break
                sampler.observe(nxt)
                logits, used = self.run_chunk(nxt.view(B, 1), col, cache, noise=noise)
                nxt = sampler(logits)
                col += 1
                now = time.perf_counter()
                latencies.append(now - step_start)
                step_start = now
        decode_s = sum(latencies)
        stats.update(decode_s=decode_s, decode_cpu_s=time.process_time() - cpu_start, decode_tokens=B * len(latencies),
                     decode_tokens_per_s=B * len(latencies) / decode_s if latencies else 0.0,
                     token_latencies_s=latencies)

    # -- self-speculative decoding (batch 1) ------------------------------------------------
    def _speculative_events(self, ids: list[list[int]], plist: list[SamplingParams],
                            deltas: bool) -> Iterator[TokenEvent]:
        assert self.speculative is not None
        self._kernels()
        draft_rounds, K = self.speculative
        R, sp, prompt = self.rounds, plist[0], ids[0]
        dev = next(self.model.parameters()).device
        P, ctx = len(prompt), self.cfg.context
        cache = self.new_cache(1, P + sp.max_new_tokens + K + 1)
        noise = self._noise(plist, next(self.model.parameters()))
        sampler = _Sampler(plist, ids, self.cfg.vocab_size, dev)
        text = _Text(self.tokenizer, sp.stop, deltas)
        eos = getattr(self.tokenizer, "eos_id", None)
        stats: dict[str, Any] = {"batch": 1, "rounds": R, "exit": str(self.policy),
                                 "prefill_cache": self.config.prefill_cache, "decode_cache": "full",
                                 "missing": self.config.missing, "cache_bytes": cache.nbytes(),
                                 "speculative": {"draft_rounds": draft_rounds, "k": K, "drafted": 0, "accepted": 0}}
        spec = stats["speculative"]
        self.last_stats = stats
        n_out = 0
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits, _ = self.run_chunk(torch.tensor([prompt], device=dev), 0, cache, phase="prefill", noise=noise)
            pending = int(sampler(logits)[0])
            t1 = time.perf_counter()
            stats.update(prefill_s=t1 - t0, ttft_s=t1 - t0, prefill_tokens_per_s=P / max(t1 - t0, 1e-9))
            emit, col = [pending], P          # emit: tokens to hand out; pending sits at column col
            decode_start, cpu_start = t1, time.process_time()
            while True:
                for tok in emit:
                    n_out += 1
                    reason = None
                    if _is_eos(sp, eos, tok):
                        reason, delta = "stop", text.finish()
                    else:
                        delta, hit = text.push(tok)
                        if hit:
                            reason, delta = "stop", delta + text.finish()
                        elif n_out >= sp.max_new_tokens:
                            reason, delta = "length", delta + text.finish()
                    yield TokenEvent(row=0, token=tok, text=delta, rounds=R, finish_reason=reason)
                    if reason:
                        break
                    sampler.observe_one(tok)
                if reason:
                    break
                # draft k tokens after `pending` with few rounds, reading the full-depth history
                k = min(K, sp.max_new_tokens - n_out - 1, ctx - 1 - col)
                drafts: list[int] = []
                q_list: list[Tensor | None] = []
                tok = pending
                for j in range(k):
                    lg, _ = self.run_chunk(torch.tensor([[tok]], device=dev), col + j, cache, rounds=draft_rounds,
                                           noise=noise, commit=False)
                    tok, q = sampler.pick(lg[0], drafts)
                    drafts.append(tok)
                    q_list.append(q)
                # verify pending + drafts at full depth in one chunk (overwrites the drafts' entries)
                chunk = torch.tensor([[pending] + drafts], device=dev)
                lg, _ = self.run_chunk(chunk, col, cache, noise=noise, all_logits=True)
                accepted, nxt = sampler.verify(lg[0], drafts, q_list)
                spec["drafted"] += k
                spec["accepted"] += accepted
                cache.truncate(col + accepted + 1)
                emit = drafts[:accepted] + [nxt]
                pending, col = nxt, col + accepted + 1
        decode_s = time.perf_counter() - decode_start
        n_dec = max(n_out - 1, 0)
        spec["acceptance_rate"] = spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0
        stats.update(decode_s=decode_s, decode_cpu_s=time.process_time() - cpu_start, decode_tokens=n_dec,
                     decode_tokens_per_s=n_dec / decode_s if n_dec else 0.0)


def _is_eos(sp: SamplingParams, eos: int | None, tok: int) -> bool:
    return sp.stop_at_eos and eos is not None and tok == eos


def _rows_of(rope: Any, keep: Tensor) -> Any:
    """RoPE tables for a subset of rows (shared (T, 1, Dh) tables need no indexing)."""
    cos, sin = rope
    return (cos[keep], sin[keep]) if cos.dim() == 4 else rope


def _packed(w: Tensor) -> Tensor | None:
    """W (out, in) in oneDNN's blocked layout (CPU fp32), or None where that is unavailable."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        x = torch.zeros(2, w.shape[1])
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")    # the op works here
        return packed
    except (AttributeError, RuntimeError):
        return None


_W = tuple[Tensor, Tensor | None]    # a matrix for one row (see _row_weight) and oneDNN-packed W or None


def _row_weight(w: Tensor, threads: int) -> Tensor:
    """W (out, in) laid out for one-row products: (in, out) contiguous, or with several threads
    (P, in, out/P) contiguous, one slice of the outputs per thread (P: the most slices, up to the
    thread count, that divide the outputs). A single-row product is bound by reading W; one
    `torch.mm` of a row reads it on one thread, while a `bmm` over P slices reads it on P threads
    (batch-1 decode steps about 1.4x faster with 2 threads on the bench machine)."""
    out = w.shape[0]
    P = max(p for p in range(1, max(threads, 1) + 1) if out % p == 0)    # slices that divide the outputs
    if P < 2 or w.device.type != "cpu":
        return w.t().contiguous()
    return w.t().reshape(w.shape[1], P, out // P).transpose(0, 1).contiguous()


def _mm(x: Tensor, w: _W) -> Tensor:
    """x (..., in) @ W^T -> (..., out). More rows: oneDNN's packed weights (2-3x faster than MKL's
    sgemm for 2..256 rows on CPU); one row: a plain mm on the (in, out) copy, or a bmm over its
    per-thread slices (their outputs, laid end to end, are the row's outputs in order)."""
    wr, packed = w
    x2 = x.reshape(-1, x.shape[-1])
    if packed is not None and x2.shape[0] > 1:
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, None, "none", [], "")
    elif wr.dim() == 3:
        P = wr.shape[0]
        if x2.shape[0] == 1:
            y = torch.bmm(x2.expand(P, 1, x2.shape[1]), wr)                    # (P, 1, out/P)
        else:
            y = torch.bmm(x2.expand(P, *x2.shape), wr).transpose(0, 1)          # (rows, P, out/P)
    else:
        y = torch.mm(x2, wr)
    return y.reshape(*x.shape[:-1], -1)


class _Kernels:
    """The model's forward pass for cached chunks, with fewer, fused operations.

    The same arithmetic as LoopedLM's blocks (parity with `model(idx)` is tested at 1e-5), in a
    shape suited to decoding one column at a time: q/k/v and gate/up are one matmul each, RoPE
    rotates q and k together with precomputed (cos, cos) / (-sin, sin) tables, and there are no
    module calls. Each matrix is kept in a one-row layout (`_row_weight`: (in, out) contiguous, where
    a plain `x @ W` runs ~20% faster than `F.linear` on CPU, or split by output across threads) and
    in oneDNN's packed layout (several rows: 2-3x faster), so the engine holds two more copies of
    the matrix weights. They are rebuilt when a parameter changes in place or the thread count
    changes.
    """

    def __init__(self, model: Any):
        self.m, cfg = model, model.cfg
        self.H, self.Hkv, self.Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.gqa = self.H != self.Hkv
        self._params = list(model.parameters())
        self._versions = [p._version for p in self._params]
        self.threads = torch.get_num_threads()
        with torch.no_grad():
            def t(*ws: Tensor) -> tuple[Tensor, Tensor | None]:
                w = torch.cat(ws)
                return _row_weight(w, self.threads), _packed(w)

            def fuse(blk: Any) -> tuple:
                a, f = blk.attn, blk.mlp
                norms = (blk.norm1, blk.norm2) + ((blk.post1, blk.post2) if blk.mode == "sandwich" else ())
                return (blk.mode, blk.alpha, t(a.q.weight, a.k.weight, a.v.weight), t(a.o.weight),
                        t(f.gate.weight, f.up.weight), t(f.down.weight), [(n.weight.detach(), n.eps) for n in norms])
            self.prelude = [fuse(b) for b in model.prelude]
            self.core = [fuse(b) for b in model.core]
            self.coda = [fuse(b) for b in model.coda]
            self.head = t(model.head.weight)                                      # (d, V)
            self.cos2 = torch.cat([model.rope_cos, model.rope_cos], -1)           # (L, Dh)
            self.sin2 = torch.cat([-model.rope_sin, model.rope_sin], -1)

    def stale(self) -> bool:
        """A parameter was modified in place (an optimizer step, load_state_dict) or replaced, or
        the number of torch threads changed (the one-row layout depends on it)."""
        now = list(self.m.parameters())
        return (self.threads != torch.get_num_threads() or len(now) != len(self._params)
                or any(p is not q for p, q in zip(now, self._params))
                or any(p._version != v for p, v in zip(self._params, self._versions)))

    def rope(self, start: int, T: int, positions: Tensor | None) -> tuple[Tensor, Tensor]:
        """(T, 1, Dh) tables, or (B, T, 1, Dh) with per-row positions, for (B, T, heads, Dh) tensors."""
        if positions is None:
            return self.cos2[start:start + T, None], self.sin2[start:start + T, None]
        return self.cos2[positions].unsqueeze(2), self.sin2[positions].unsqueeze(2)

    def block(self, w: tuple, x: Tensor, rope: tuple[Tensor, Tensor], cache: Any, slot: tuple) -> Tensor:
        """Block.forward: pre-norm, sandwich or DeepLoop residuals around attention and SwiGLU."""
        mode, alpha, wqkv, wo, wgu, wd, norms = w
        d = (x.shape[-1],)
        if mode == "deeploop":
            x = F.rms_norm(alpha * x + self.attn(x, wqkv, wo, rope, cache, slot), d, *norms[0])
            return F.rms_norm(alpha * x + self.mlp(x, wgu, wd), d, *norms[1])
        if mode == "sandwich":
            x = x + F.rms_norm(self.attn(F.rms_norm(x, d, *norms[0]), wqkv, wo, rope, cache, slot), d, *norms[2])
            return x + F.rms_norm(self.mlp(F.rms_norm(x, d, *norms[1]), wgu, wd), d, *norms[3])
        x = x + self.attn(F.rms_norm(x, d, *norms[0]), wqkv, wo, rope, cache, slot)
        return x + self.mlp(F.rms_norm(x, d, *norms[1]), wgu, wd)

    def attn(self, x: Tensor, wqkv: "_W", wo: "_W", rope: tuple[Tensor, Tensor], cache: Any,
             slot: tuple) -> Tensor:
        B, T, _ = x.shape
        H, Hkv, Dh = self.H, self.Hkv, self.Dh
        qkv = _mm(x, wqkv).view(B, T, H + 2 * Hkv, Dh)
        qk, v = qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]
        cos, sin = rope
        x1, x2 = qk.chunk(2, dim=-1)
        qk = qk * cos + torch.cat([x2, x1], dim=-1) * sin                       # RoPE on q and k at once
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)      # (B, H, T, Dh), (B, Hkv, T, Dh)
        k, v, mask = cache.update(slot, k, v.transpose(1, 2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa)
        return _mm(y.transpose(1, 2).reshape(B, T, H * Dh), wo)

    @staticmethod
    def mlp(x: Tensor, wgu: "_W", wd: "_W") -> Tensor:
        g, u = _mm(x, wgu).chunk(2, dim=-1)
        return _mm(F.silu(g) * u, wd)

    def encode(self, idx: Tensor, rope: tuple[Tensor, Tensor], cache: Any) -> Tensor:
        x = self.m.embed(idx)
        for i, w in enumerate(self.prelude):
            x = self.block(w, x, rope, cache, ("prelude", 0, i))
        return x

    def core_step(self, s: Tensor, e: Tensor, r: int, rope: tuple[Tensor, Tensor], cache: Any) -> Tensor:
        """LoopedLM.core_step: inject, the core blocks (round r's own if untied), state norm."""
        m = self.m
        K = m.cfg.n_core
        blocks = self.core[(r - 1) * K: r * K] if m.cfg.untied else self.core
        x = m.inject(s, e)
        for i, w in enumerate(blocks):
            x = self.block(w, x, rope, cache, ("core", r, i))
        return m.state_norm(x) if m.state_norm is not None else x

    def readout(self, s: Tensor, rope: tuple[Tensor, Tensor], cache: Any, r: int, all_positions: bool) -> Tensor:
        """LoopedLM.readout (coda, final norm, head); the head on the last column unless all_positions."""
        for i, w in enumerate(self.coda):
            s = self.block(w, s, rope, cache, ("coda", r, i))
        return _mm(self.m.final_norm(s if all_positions else s[:, -1]), self.head)


def _parse_speculative(text: str, rounds: int) -> tuple[int, int]:
    msg = f"--speculative {text!r}: expected ROUNDS:K with 1 <= ROUNDS <= {rounds} and 1 <= K <= 32, e.g. 1:4"
    a, sep, b = str(text).partition(":")
    try:
        d, k = int(a), int(b)
    except ValueError:
        raise UserError(msg) from None
    if not sep or not 1 <= d <= rounds or not 1 <= k <= 32:
        raise UserError(msg)
    return d, k


class _Sampler:
    """Per-row sampling: repetition penalty, temperature, top-k, top-p, a seeded generator per row."""

    def __init__(self, plist: list[SamplingParams], prompts: list[list[int]], vocab: int, device: torch.device):
        self.plist, self.V = plist, vocab
        self.gens = [torch.Generator().manual_seed(sp.seed) for sp in plist]
        self.plain = all(sp.greedy and sp.repetition_penalty == 1.0 for sp in plist)
        self.penalised = any(sp.repetition_penalty != 1.0 for sp in plist)
        self.seen: Tensor | None = None
        if self.penalised:
            self.seen = torch.zeros(len(plist), vocab, dtype=torch.bool, device=device)
            for b, p in enumerate(prompts):
                self.seen[b, torch.tensor(p, dtype=torch.long)] = True
            self.penalty = torch.tensor([[sp.repetition_penalty] for sp in plist], device=device)

    def __call__(self, logits: Tensor) -> Tensor:
        """(B, V) -> (B,) next tokens."""
        if self.plain:
            return logits.argmax(-1)
        logits = logits.float()
        if self.seen is not None:
            logits = _penalise(logits, self.seen, self.penalty)
        out = logits.argmax(-1)
        for b, sp in enumerate(self.plist):
            if not sp.greedy:
                probs = _probs(logits[b], sp)
                out[b] = torch.multinomial(probs.cpu(), 1, generator=self.gens[b])[0]
        return out

    def observe(self, tokens: Tensor) -> None:
        if self.seen is not None:
            self.seen[torch.arange(tokens.shape[0]), tokens] = True

    def observe_one(self, tok: int) -> None:
        if self.seen is not None:
            self.seen[0, tok] = True

    # batch-1 helpers for speculative decoding: `extra` are tokens drafted after the committed ones
    def _processed(self, logits: Tensor, extra: list[int]) -> Tensor:
        logits = logits.float()
        if self.seen is not None:
            seen = self.seen[0].clone()
            if extra:
                seen[torch.tensor(extra)] = True
            logits = _penalise(logits[None], seen[None], self.penalty[:1])[0]
        return logits

    def pick(self, logits: Tensor, extra: list[int]) -> tuple[int, Tensor | None]:
        """A draft token and the draft distribution q (None when greedy)."""
        sp = self.plist[0]
        lg = self._processed(logits, extra)
        if sp.greedy:
            return int(lg.argmax()), None
        q = _probs(lg, sp).cpu()
        return int(torch.multinomial(q, 1, generator=self.gens[0])[0]), q

    def verify(self, logits: Tensor, drafts: list[int], qs: list[Tensor | None]) -> tuple[int, int]:
        """logits (k+1, V) at full depth -> (accepted drafts, the verifier's next token)."""
        sp, g = self.plist[0], self.gens[0]
        for j, d in enumerate(drafts):
            lg = self._processed(logits[j], drafts[:j])
            if sp.greedy:
                v = int(lg.argmax())
                if v != d:
                    return j, v
                continue
            p, q = _probs(lg, sp).cpu(), qs[j]
            assert q is not None
            if float(torch.rand((), generator=g)) < min(1.0, float(p[d] / q[d].clamp_min(1e-30))):
                continue
            resid = (p - q).clamp_min(0)
            resid = resid / resid.sum() if float(resid.sum()) > 0 else p
            return j, int(torch.multinomial(resid, 1, generator=g)[0])
        lg = self._processed(logits[len(drafts)], drafts)
        if sp.greedy:
            return len(drafts), int(lg.argmax())
        return len(drafts), int(torch.multinomial(_probs(lg, sp).cpu(), 1, generator=g)[0])


def _penalise(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """CTRL repetition penalty on tokens seen so far: (B, V), (B, V) bool, (B, 1)."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def _probs(logits: Tensor, sp: SamplingParams) -> Tensor:
    """(V,) processed logits -> sampling distribution after temperature, top-k and top-p."""
    lg = logits / sp.temperature
    if 0 < sp.top_k < lg.shape[-1]:
        kth = torch.topk(lg, sp.top_k).values[-1]
        lg = lg.masked_fill(lg < kth, float("-inf"))
    probs = torch.softmax(lg, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p >= sp.top_p            # keep the smallest prefix reaching top_p (at least one)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum()
    return probs


class _Text:
    """Incremental detokenisation for one row: complete characters only, stop strings cut."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], deltas: bool):
        self.tok, self.stops, self.deltas = tokenizer, stops, deltas
        self.ids: list[int] = []
        self.shown = 0          # characters already handed out
        self.final: str | None = None

    def push(self, token: int) -> tuple[str, bool]:
        """Add a token; return (new safe text, whether a stop string ended the row)."""
        self.ids.append(token)
        if self.tok is None or not (self.deltas or self.stops):
            return "", False
        text = self.tok.decode(self.ids)
        if self.stops:
            lo = max(0, self.shown - max(map(len, self.stops)))
            hits = [i for i in (text.find(s, lo) for s in self.stops) if i >= 0]
            if hits:
                self.final = text[:min(hits)]
                delta = self.final[self.shown:] if self.deltas else ""
                self.shown = len(self.final)
                return delta, True
        if not self.deltas:
            return "", False
        safe = len(text)
        while safe > self.shown and text[safe - 1] == "\ufffd":   # maybe a character cut in half
            safe -= 1
        for s in self.stops:                                       # maybe the start of a stop string
            for n in range(min(len(s) - 1, safe - self.shown), 0, -1):
                if text[safe - n:safe] == s[:n]:
                    safe -= n
                    break
        delta = text[self.shown:safe]
        self.shown = safe
        return delta, False

    def finish(self) -> str:
        """The rest of the text (at the end of the row)."""
        if self.tok is None:
            return ""
        text = self.final if self.final is not None else self.tok.decode(self.ids)
        if not self.deltas:
            return text
        delta = text[self.shown:]
        self.shown = len(text)
        return delta


def generate_for_run(run: Any, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
                     rounds: int | None = None, exit: str | None = None, prefill_cache: str | None = None,
                     decode_cache: str | None = None, missing: str | None = None, speculative: str | None = None,
                     top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                     stop: Sequence[str] = ()) -> dict[str, Any]:
    """`looplm generate`: one prompt through the cached engine; the CONTRACT's JSON shape plus details."""
    overrides = {k: v for k, v in dict(rounds=rounds, exit=exit, prefill_cache=prefill_cache,
                                       decode_cache=decode_cache, missing=missing,
                                       speculative=speculative).items() if v is not None}
    engine = Engine.from_run(run, **overrides)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, top_k=top_k,
                            top_p=top_p, repetition_penalty=repetition_penalty, stop=tuple(stop))
    out = engine.generate([prompt], params)[0]
    st = out.stats
    result = {"text": out.text, "tokens": out.tokens, "rounds_used": out.rounds_used,
              "prefill_tokens_per_s": st["prefill_tokens_per_s"], "decode_tokens_per_s": st["decode_tokens_per_s"],
              "ttft_s": st["ttft_s"], "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
              "mean_rounds": sum(out.rounds_used) / max(len(out.rounds_used), 1), "max_rounds": engine.rounds,
              "exit": st["exit"], "prefill_cache": st["prefill_cache"], "decode_cache": st["decode_cache"],
              "missing_kv": st["missing"], "cache_bytes": st["cache_bytes"]}
    if "speculative" in st:
        result["speculative"] = st["speculative"]
    return result
