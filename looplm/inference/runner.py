"""The chunk runner under the engine: one chunk of columns through prelude -> rounds -> coda on the per-round KV
cache, at a fixed depth or with per-token exits, and what a decode is set up with.

    runner.kernels()                                  once per generation: fresh fused kernels
    cache = runner.new_cache(B, L, pad)               the per-round KV cache (cache.KVCache)
    noise = runner.initial_noise(params, ref)         per-row initial states by position, or None
    logits, used = runner.run_chunk(idx, start, cache, noise=noise, ...)     one chunk, committed

`Runner` validates a `GenerationConfig` against the model (the capability table, capabilities.py, and the
value rules of routed and shared-cache models), holds the exit policy and the kernels, and runs chunks:
`chunk_inputs` (RoPE tables, prelude, initial state), the fixed-depth loop or the exit loop (the one
`ExitController`), readouts, cache commits and the FLOP record. Batches (batch.py, depth.py), speculation
(speculative.py) and recirculation (recirculation.py) are written against this class; `Engine` (engine.py),
the public facade, extends it with from_run, generate, stream, batch and prompt_logprobs, and nothing here
imports them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import capabilities
from ..errors import UserError
from ..halting import ExitController, ExitPolicy, parse_exit_policy
from ..model.flops import DecodeWork
from ..model.looped import initial_noise_table
from ..model.recurrence import unroll
from .cache import MISSING, LoopKVCache, check_policy
from .capabilities import BATCHINGS, Decode
from .contrast import check_contrast, contrast_logits
from .kernels import PackedOps, rope_rows
from .recirculation import Recirculation, recirculated_chunk
from .sampler import SamplingParams, is_int, positions_run

__all__ = ["ChunkResult", "GenerationConfig", "Runner", "parse_speculative"]


def parse_speculative(text: str, rounds: int) -> tuple[int | None, int]:
    """"ROUNDS:K" -> (ROUNDS, K); "exit:K" -> (None, K): drafts stop by the exit policy."""
    msg = (f"--speculative {text!r}: expected ROUNDS:K with 1 <= ROUNDS <= {rounds}, or exit:K (drafts stop by "
           f"the --exit policy), and 1 <= K <= 32, e.g. 1:4")
    a, sep, b = str(text).partition(":")
    try:
        d, k = (None if a.strip() == "exit" else int(a)), int(b)
    except ValueError:
        raise UserError(msg) from None
    if not sep or (d is not None and not 1 <= d <= rounds) or not 1 <= k <= 32:
        raise UserError(msg)
    return d, k


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
    """"ROUNDS:K": draft K tokens with ROUNDS rounds, verify at full depth (batch 1); "exit:K":
    the drafts stop by the exit policy (which then decides nothing else: the output is full-depth)."""
    min_rounds: int = 1
    """Exit policies never stop before this round."""
    exit_in_prefill: bool = False
    """Let prompt tokens exit early too (the prompt then runs token by token)."""
    recirculation: Recirculation | None = None
    """Refine each position's history with a deeper residual (recirculation.py); None: the model as it is."""
    contrast: tuple[int, float] | None = None
    """LoopCD-style decoding, (r, beta): every readout's logits become z_R + beta (z_R - z_r), where z_r is
    the readout (coda, final norm, head: the logit lens) of the state after round r < R and z_R the final
    round's, in float32 before any sampling transform (`contrast_logits`). Fixed depth only; costs one
    more coda and head pass per chunk. None: plain decoding."""
    batching: str = "exit"
    """How decode steps group tokens (capabilities.BATCHINGS): exit (a step runs every row's token until the
    deepest exits), depth (continuous depth batching: one round per step for every token in flight, a row
    whose token exits takes its next one at once; inference/depth.py) or static (every token at full depth)."""


class ChunkResult(NamedTuple):
    """What one chunk (`Engine.run_chunk`) produced; unpacks as (logits, rounds_used)."""

    logits: Tensor
    """(B, T, V) with all_logits, else (B, V) at the chunk's last column."""
    rounds_used: Tensor | int


class Runner:
    """Chunks of a decode over a `LoopedLM` and its per-round cache (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, config: GenerationConfig | None = None):
        config = config or GenerationConfig()
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.given = config                       # as the caller gave it (before a routed/shared model's rules)
        self.cfg = model.cfg
        self.feedback = getattr(model, "feedback", None) is not None     # prompt modes (SamplingParams)
        if config.batching not in BATCHINGS:
            raise UserError(f"--batching {config.batching!r}: expected one of {', '.join(BATCHINGS)}")
        capabilities.check(Decode.of(model, config))   # what combines with what: one table (capabilities.py)
        if getattr(model, "mor_router", None) is not None:
            config = self._routed_config(config, model)
            self.config = config
        elif self.cfg.kv_sharing == "first":
            config = self._shared_config(config)
            self.config = config
        check_policy(config.prefill_cache, "--prefill-cache")
        check_policy(config.decode_cache, "--decode-cache")
        if config.missing not in MISSING:
            raise UserError(f"--missing-kv {config.missing!r}: expected one of {', '.join(MISSING)}")
        if config.rounds is not None and (not is_int(config.rounds) or config.rounds < 1):
            raise UserError(f"--rounds {config.rounds!r}: must be an integer >= 1")
        text = config.exit.strip()
        if text == "fixed":
            text = f"fixed:{config.rounds or model.nominal_rounds}"
        self.policy: ExitPolicy = parse_exit_policy(text, min_rounds=config.min_rounds,
                                                    exit_in_prefill=config.exit_in_prefill)
        if getattr(model, "mor_router", None) is not None:   # the router decides every token's depth
            self.policy = ExitPolicy("routed", model.nominal_rounds, exit_in_prefill=True)
        if self.policy.kind == "fixed":
            if config.rounds is not None and config.rounds != self.policy.value:
                raise UserError(f"--rounds {config.rounds} disagrees with --exit {self.policy}")
            self.rounds = int(self.policy.value)
        else:
            self.rounds = config.rounds or model.nominal_rounds
        if self.cfg.untied and self.rounds != model.nominal_rounds:
            raise UserError(f"--rounds: this untied baseline runs exactly {model.nominal_rounds} rounds")
        self.adaptive = self.policy.kind != "fixed"
        self.speculative: tuple[int | None, int] | None = None    # (draft rounds or None: by the exit policy, K)
        if config.speculative:
            self.speculative = parse_speculative(config.speculative, self.rounds)
        self.mixer: Any = None         # recirculation's learned coefficients (None: its fixed alpha, beta)
        if config.recirculation is not None:
            config.recirculation.check(self.cfg, self.rounds)
            if config.recirculation.mixer is not None:
                from ..model.mixer import load_mixer
                self.mixer = load_mixer(config.recirculation.mixer, self.cfg.d_model).to(
                    next(self.model.parameters()).device)
        if config.contrast is not None:
            check_contrast(config.contrast, self.rounds)
        self.last_stats: dict[str, Any] = {}
        self._fast: PackedOps | None = None


    def prompt_mode(self, sp: SamplingParams) -> str:
        """The request's prompt mode: its own, else soft for a feedback model and standard otherwise."""
        mode = sp.prompt_mode or ("soft" if self.feedback else "standard")
        if mode != "standard" and not self.feedback:
            raise UserError(f"prompt_mode {mode}: this model has no full-bandwidth feedback (feedback.mode = none); "
                            "only standard applies")
        return mode

    @staticmethod
    def _routed_config(config: GenerationConfig, model: Any) -> GenerationConfig:
        """A Mixture-of-Recursions model decodes the function it was trained as: every token (prompt
        included) stops at its routed depth, and the cache follows the trained rule (model.mor_cache):
        recursion_wise = "full" with stopped tokens masked, shared_first = "first". Settings that would
        change that function are refused, not ignored."""
        import dataclasses
        rule = model.cfg.mor_cache
        want = ({"prefill_cache": "full", "decode_cache": "full", "missing": "mask"} if rule == "recursion_wise"
                else {"prefill_cache": "first", "decode_cache": "first"})
        defaults = GenerationConfig()
        for key, value in want.items():
            given = getattr(config, key)
            if given != value and given != getattr(defaults, key):
                raise UserError(f"--{key.replace('_', '-')} {given}: this Mixture-of-Recursions model was trained "
                                f"with the {rule} cache rule, which decodes with {key} = {value}")
        if config.exit.strip() != "fixed" or (config.rounds not in (None, model.nominal_rounds)):
            raise UserError(capabilities.routed_depth(model.nominal_rounds))
        return dataclasses.replace(config, **want, exit_in_prefill=True)

    @staticmethod
    def _shared_config(config: GenerationConfig) -> GenerationConfig:
        """A model trained with model.kv_sharing = first decodes the function it was trained as: every
        token's later rounds read the earlier tokens' round-1 keys/values, which is cache policy first on
        both sides; other policies are refused, not ignored (prompts run column by column: `chunk`)."""
        import dataclasses
        for key in ("prefill_cache", "decode_cache"):
            given = getattr(config, key)
            if given not in ("first", getattr(GenerationConfig(), key)):
                raise UserError(f"--{key.replace('_', '-')} {given}: this model was trained with model.kv_sharing = "
                                f"first (every round reads round 1's keys/values), which decodes with {key} = first")
        return dataclasses.replace(config, prefill_cache="first", decode_cache="first")

    def new_cache(self, batch: int, length: int, pad: Tensor | None = None) -> LoopKVCache:
        c = self.config
        p = next(self.model.parameters())
        return LoopKVCache(self.cfg, batch=batch, length=length, rounds=self.rounds, prefill=c.prefill_cache,
                           decode=c.decode_cache, missing=c.missing, pad=pad, dtype=p.dtype, device=p.device)

    def new_work(self) -> DecodeWork:
        """A record of the FLOPs of every column computed (model/flops.py), for `run_chunk(work=...)`.
        A column counts at its cache column: its attention reads every column before it (a row's
        left pad is masked, not skipped)."""
        fb = getattr(self.model, "feedback", None)
        return DecodeWork(self.cfg, router_depths=self.model.nominal_rounds if self.cfg.mor != "none" else 0,
                          fusion_weights=sum(p.numel() for p in fb.parameters() if p.dim() == 2) if fb is not None else 0)

    # -- preparation ----------------------------------------------------------------------
    def token_ids(self, prompts: Any) -> list[list[int]]:
        """Prompts (a text, texts or lists of token ids) as checked token ids: UserError for an
        empty prompt, text without a tokenizer, or ids outside the vocabulary."""
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
        return ids

    def prepare(self, prompts: Any, params: Any) -> tuple[list[list[int]], list[SamplingParams]]:
        """Checked token ids (`token_ids`) and one SamplingParams per prompt: UserError when a
        prompt plus its max_new_tokens exceed the context or a logit_bias id is out of range."""
        ids = self.token_ids(prompts)
        params = params or SamplingParams()
        plist = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(ids):
            raise ValueError(f"{len(plist)} SamplingParams for {len(ids)} prompts")
        ctx = self.cfg.context
        for p, sp in zip(ids, plist):
            self.prompt_mode(sp)                                   # a mode the model has, before any work
            if sp.logit_bias and sp.logit_bias[-1][0] >= self.cfg.vocab_size:        # sorted: the largest id
                raise UserError(f"logit_bias: token id {sp.logit_bias[-1][0]} is outside the vocabulary "
                                f"(0..{self.cfg.vocab_size - 1})")
            if positions_run(len(p), sp.max_new_tokens) > ctx:
                raise UserError(f"prompt: {len(p)} prompt tokens + {sp.max_new_tokens} new tokens exceed "
                                f"the model context of {ctx} (positions run: prompt + new tokens - 1)")
        return ids, plist

    # -- the chunk API: what DecodeBatch, SpeculativeRun and cache evaluation build on --------
    #
    #   engine.kernels()                                  once per generation: fresh fused kernels
    #   cache = engine.new_cache(B, L, pad)               the per-round KV cache (cache.KVCache)
    #   noise = engine.initial_noise(params, ref)         per-row initial states by position, or None
    #   logits, used = engine.run_chunk(idx, start, cache, noise=noise, ...)     one chunk, committed
    #
    # `chunk_inputs` is the first half of `run_chunk` (after `cache.begin`: RoPE tables, prelude,
    # initial state), for callers that run the rounds themselves (speculative verification).

    def initial_noise(self, plist: Sequence[SamplingParams], ref: Tensor) -> Tensor | None:
        """(B, context, d) initial loop states by position, one table per row seeded by its
        params' seed (random initial state only; None otherwise). Pass it to `run_chunk`."""
        cfg = self.cfg
        if cfg.init_state != "random":
            return None
        tables = [initial_noise_table(cfg, sp.seed) for sp in plist]
        return torch.stack(tables).to(device=ref.device, dtype=ref.dtype)

    def run_chunk(self, idx: Tensor, start: int, cache: LoopKVCache, *, phase: str = "decode",
                  rounds: int | None = None, noise: Tensor | None = None, all_logits: bool = False,
                  commit: bool = True, rows: Tensor | None = None,
                  trace: list[tuple[Tensor, Tensor]] | None = None,
                  may_exit: Tensor | None = None, work: DecodeWork | None = None,
                  work_phase: str | None = None, feedback: tuple[Tensor, Tensor] | None = None,
                  tops: list[Tensor] | None = None) -> ChunkResult:
        """Run tokens idx (B, T) at cache columns [start, start+T) of `cache` (from `new_cache`): `chunk`,
        or under recirculation (config.recirculation) its schedule of chunks (inference/recirculation.py)."""
        rc = self.config.recirculation
        if rc is None:
            return self.chunk(idx, start, cache, phase=phase, rounds=rounds, noise=noise, all_logits=all_logits,
                              commit=commit, rows=rows, trace=trace, may_exit=may_exit, work=work,
                              work_phase=work_phase, feedback=feedback, tops=tops)
        if rounds is not None or not commit or trace is not None or may_exit is not None or feedback or tops is not None \
                or self.adaptive:
            raise ValueError("recirculation runs full-depth committed chunks (capabilities.py refuses the rest)")
        return ChunkResult(*recirculated_chunk(self, rc, idx, start, cache, phase=phase, noise=noise,
                                               all_logits=all_logits, rows=rows, work=work, work_phase=work_phase))

    def chunk(self, idx: Tensor, start: int, cache: LoopKVCache, *, phase: str = "decode",
              rounds: int | None = None, noise: Tensor | None = None, all_logits: bool = False,
              commit: bool = True, rows: Tensor | None = None,
              trace: list[tuple[Tensor, Tensor]] | None = None,
              may_exit: Tensor | None = None, work: DecodeWork | None = None,
              work_phase: str | None = None, feedback: tuple[Tensor, Tensor] | None = None,
              tops: list[Tensor] | None = None, head: bool = True, skipped: int = 0) -> ChunkResult:
        """One chunk: tokens idx (B, T) at cache columns [start, start+T) of `cache`.

        Returns a ChunkResult (logits, rounds_used): logits (B, T, V) with all_logits else (B, V) at
        the last column; rounds_used an int, or (B,) when the exit policy decided per row (decode
        chunks of one column; prefill ones too with exit_in_prefill). `phase`: "prefill" for prompt
        tokens (the prefill cache policy, and no exits unless the policy allows them) or
        "decode". `rounds` forces a fixed depth (speculative drafts). `noise`: the rows' initial
        states from `initial_noise`. `commit=False` leaves the chunk open (a draft that
        verification overwrites). `rows`: the cache rows idx's rows belong to (default all;
        finished rows are left out). `trace` (fixed depth): gets (prelude output, state after
        the last round), both (B, T, d). `may_exit` (B,) bool: only these rows may exit early
        (the others run every round; evaluation of task answers). `work` (from `new_work`): records
        every column this chunk computed, each row's at the rounds, readouts, head products and gate
        evaluations it ran, under `work_phase` (default `phase`). feedback (h (B, T, d), plain (B, T)):
        the previous positions' top states fused into these tokens' input (model/feedback.py); `tops`
        (fixed depth) gets the chunk's top states after the final norm, (B, T, d) with all_logits else
        (B, 1, d): what the next position reads. head=False (fixed depth): no LM head, logits None (a pass
        run for its cache entries); skipped: the first visits the kernels' tap supplied instead of computing
        them (recirculation's resumed pass), left out of `work`."""
        T = idx.shape[1]
        if T > 1 and self.cfg.kv_sharing == "first":
            # Inside a chunk the cache's attention is exact (each round sees the chunk's own keys), but this model
            # reads earlier tokens' round-1 entries at every round: a one-column chunk's history is exactly that.
            if trace is not None or may_exit is not None or feedback is not None or tops is not None or skipped:
                raise ValueError("a kv_sharing = first model runs longer chunks column by column, without "
                                 "trace, may_exit, feedback, tops or skipped visits")
            cols = [self.chunk(idx[:, c:c + 1], start + c, cache, phase=phase, rounds=rounds, noise=noise,
                               all_logits=all_logits, commit=commit, rows=rows, work=work, work_phase=work_phase,
                               head=head and (all_logits or c == T - 1)) for c in range(T)]
            logits = (torch.cat([lg for lg, _ in cols], 1) if all_logits and head else cols[-1].logits)
            return ChunkResult(logits, cols[-1].rounds_used)
        k = self._fast or self.kernels()
        cache.begin(start, T, phase, rows)
        rope, e, s = self.chunk_inputs(idx, start, cache, noise, rows, feedback)
        exits = self.adaptive and rounds is None and (phase == "decode" or self.policy.exit_in_prefill)
        if not exits:
            R = rounds or self.rounds
            top: dict[int, Tensor] | None = {} if tops is not None else None
            # contrastive decoding (config.contrast) reads out at its earlier round too, inside the loop: that
            # readout's coda writes the coda slot, and R's readout, the last, overwrites it with what plain
            # decoding leaves there (cache.py: one coda slot, last write wins; the core never reads it)
            contrast = self.config.contrast if head else None
            if contrast is not None and R != self.rounds:
                raise ValueError("contrastive decoding runs the engine's depth (capabilities.py refuses drafts)")
            reads = (R,) if contrast is None else (contrast[0], R)
            run = unroll(lambda s, r: k.core_step(s, e, r, rope, cache), s, R, readout_rounds=reads,
                         readout=lambda s, r: k.readout(s, rope, cache, r, all_logits, top, head))
            if trace is not None:
                trace.append((e, run.state))
            logits = run.readouts[R]                                # (B, T, V) with all_logits, else (B, V)
            if contrast is not None:
                logits = contrast_logits(logits, run.readouts[contrast[0]], contrast[1])
            if tops is not None:
                tops.append(top[R] if all_logits else top[R].unsqueeze(1))
            if commit:
                cache.commit(R)
            if work is not None:    # the coda runs on every column, the head on the last (on each with all_logits),
                # once per readout
                work.add(work_phase or phase, start, R, columns=T, readouts=len(reads),
                         heads=len(reads) * (T if all_logits else 1) if head else 0,
                         rows=idx.shape[0], skip_visits=skipped,
                         fused=feedback[1].numel() if feedback is not None else 0)   # computed for every column
            return ChunkResult(logits, R)
        if T != 1:
            raise ValueError("per-token exits run one column at a time")
        if feedback is not None or tops is not None:
            raise ValueError("feedback decodes at a fixed depth (capabilities.py)")
        if may_exit is not None and rows is not None:          # the controller counts cache rows
            may_exit = torch.ones(cache.batch, dtype=torch.bool, device=may_exit.device).index_put((rows,), may_exit)
        logits, used, ctl = self._rounds_with_exits(s, e, rope, cache, phase, rows, may_exit)    # (cache rows, ...)
        if commit:
            cache.commit(used)
        if work is not None:    # read out at each read round it reached, else once at its exit round
            reads = ctl.read_rounds
            for u, n in Counter((used if rows is None else used[rows.cpu()]).tolist()).items():
                work.add(work_phase or phase, start, u, readouts=sum(r <= u for r in reads) + (u not in reads),
                         gate_rounds=u if ctl.needs_hazard else 0, rows=n)
        return ChunkResult(logits, used) if rows is None else ChunkResult(logits[rows], used[rows.cpu()])

    def score(self, x: Tensor, prompt: int = 0, *, noise: Tensor | None = None, phase: str = "decode",
              may_exit: Tensor | None = None, prompt_logits: bool = False, cache: LoopKVCache | None = None
              ) -> tuple[Tensor, Tensor]:
        """Teacher-forced decoding of token windows x (B, T) through this runner's chunks: the one loop for every
        caller that scores a sequence as generation computes it (cache-policy sweeps, early-exit evaluation with a
        coda, LoopCD's held-out loss, recirculation's held-out loss, the routed-decode check). x[:, :prompt] is
        one prefill chunk (column by column when prompt tokens may exit: `exit_in_prefill`), then every later
        column a one-column chunk in `phase` ("decode", or "prefill": every token read as a prompt token).

        noise: the rows' initial loop states by position, (B, >= T, d) (`initial_noise`'s seeded tables, or the
        initial states a whole-sequence pass drew: position-indexed either way, so both compute that pass's
        function), None for the model's own. may_exit (B, T) bool: which tokens may exit early. cache: a
        `new_cache(B, >= T)` to fill (the caller reads it afterwards), default a fresh one.

        Returns (logits, rounds): logits (B, T - prompt, V) of the columns after the prompt (with
        prompt_logits (B, T, V): the prompt chunk's every column too), rounds (B, T - prompt) each scored
        column ran."""
        self.kernels()
        B, T = x.shape
        if not 0 <= prompt <= T:
            raise ValueError(f"score: prompt {prompt} outside 0..{T}")
        cache = self.new_cache(B, T) if cache is None else cache
        out: list[Tensor] = []
        used: list[Tensor] = []
        if prompt:
            if self.adaptive and self.policy.exit_in_prefill:     # prompt tokens may exit: one column at a time
                cols = [self.run_chunk(x[:, c:c + 1], c, cache, phase="prefill", noise=noise,
                                       may_exit=None if may_exit is None else may_exit[:, c]) for c in range(prompt)]
                if prompt_logits:
                    out += [lg.unsqueeze(1) for lg, _ in cols]
            else:
                lg, _ = self.run_chunk(x[:, :prompt], 0, cache, phase="prefill", noise=noise, all_logits=prompt_logits)
                if prompt_logits:
                    out.append(lg)
        for c in range(prompt, T):
            lg, u = self.run_chunk(x[:, c:c + 1], c, cache, phase=phase, noise=noise,
                                   may_exit=None if may_exit is None else may_exit[:, c])
            out.append(lg.unsqueeze(1))                                                     # (B, 1, V)
            used.append(torch.full((B,), u) if isinstance(u, int) else u.cpu())
        logits = torch.cat(out, 1) if out else \
            x.new_zeros(B, 0, self.cfg.vocab_size, dtype=next(self.model.parameters()).dtype)
        rounds = torch.stack(used, 1) if used else torch.zeros(B, 0, dtype=torch.long)
        return logits, rounds

    def chunk_inputs(self, idx: Tensor, start: int, cache: LoopKVCache, noise: Tensor | None,
                     rows: Tensor | None, feedback: tuple[Tensor, Tensor] | None = None) -> tuple[Any, Tensor, Tensor]:
        """After `cache.begin(start, T, phase, rows)`: the chunk's RoPE tables, prelude output e
        and initial state s, (B, T, d) each (the prelude writes its cache entries)."""
        B, T = idx.shape
        positions = None
        if cache.chunk_padded:                     # these rows have pad columns: positions per row
            cols = torch.arange(start, start + T, device=idx.device)
            pad = cache.pad if rows is None else cache.pad[rows]
            positions = (cols[None, :] - pad[:, None]).clamp_min(0)             # (B, T)
        s0 = None
        if noise is not None:
            r = torch.arange(B, device=noise.device) if rows is None else rows.to(noise.device)  # (B,) table rows
            s0 = noise[r, start:start + T] if positions is None else noise[r[:, None], positions]  # (B, T, d)
        return self.model.loop_inputs(idx, start, positions, cache, self._fast or self.kernels(), initial_state=s0,
                                      feedback=feedback)

    def kernels(self) -> PackedOps:
        """The fused kernels the chunks run on, rebuilt when a model weight changed in place since
        they were made. Call it when a generation starts: chunks reuse them without the check."""
        if self._fast is None or self._fast.stale():
            self._fast = PackedOps(self.model)
        return self._fast

    def _rounds_with_exits(self, s: Tensor, e: Tensor, rope: Any, cache: LoopKVCache, phase: str,
                           rows: Tensor | None, may_exit: Tensor | None) -> tuple[Tensor, Tensor, ExitController]:
        """Run up to R rounds for one column; each row stops where `ExitController` says. s holds
        the cache rows `rows` (None = all); the results are indexed by cache row: logits
        (cache.batch, V) and rounds used (cache.batch,), R for rows that did not run; and the
        controller (its read rounds: what each row's readouts were).

        A row's coda entry in the cache is its exit-round readout's (the coda slot is one per
        block, the last write wins), which is what later tokens' codas read: entropy/kl rows
        are read out at the controller's read rounds, the last being their exit round; fixed and
        quantile rows are read out once, at their exit round."""
        m, k, policy, R = self.model, self._fast or self.kernels(), self.policy, self.rounds
        n = cache.batch
        ctl = ExitController(policy, R, n, prefill=phase == "prefill", may_exit=may_exit, device=s.device)
        out = torch.zeros(n, self.cfg.vocab_size, device=s.device, dtype=s.dtype)
        # what the rounds read for the rows still computing (cache rows `rows`), compacted as rows stop
        live = SimpleNamespace(rows=torch.arange(n, device=s.device) if rows is None else rows, e=e, rope=rope,
                               weight=None, route_stop=None)
        expert = policy.kind == "routed" and self.cfg.mor == "expert_choice"
        if policy.kind == "routed" and not expert:   # token choice: depth and weight from e, up front
            depth, live.weight, _ = m.route(e)       # (B', 1) each
            ctl.set_depth(live.rows, depth[:, -1])
        every = torch.ones(s.shape[:2], dtype=torch.bool, device=s.device)
        if expert:        # round 1's router on the initial state (every token runs round 1)
            live.weight = m.expert_choice(s, 1, every, True)[1]

        def step(s: Tensor, r: int) -> Tensor:
            if live.weight is None:
                return k.core_step(s, live.e, r, live.rope, cache)
            return k.routed_step(s, live.e, r, live.rope, cache, live.weight)

        def exits(s: Tensor, r: int) -> Tensor | None:
            """The controller decides after round r; stopped rows leave (their readout now, when the
            policy did not read every row out this round); None when no row goes on."""
            if expert and r < R:   # round r + 1's router on the state entering it: who continues, and the weight
                chosen, live.weight, _ = m.expert_choice(s, r + 1, every[:s.shape[0]], True)
                live.route_stop = ~chosen[:, -1]
            logits = k.readout(s, live.rope, cache, r, False) if ctl.needs_readout(r) else None    # (B', V)
            hazard = m.hazard(s)[:, -1] if ctl.needs_hazard else None                          # (B',)
            stop = ctl.decide(r, live.rows, hazard=hazard, logits=logits, route_stop=live.route_stop)  # (B',)
            if not bool(stop.any()):
                return s
            done = live.rows[stop]
            if logits is None:  # the exiting rows read out now (their coda entry is this round's)
                cache.select(done)
                out[done] = k.readout(s[stop], rope_rows(live.rope, stop), cache, r, False)
            keep = ~stop
            if not bool(keep.any()):
                return None
            live.rows, live.e, live.rope = live.rows[keep], live.e[keep], rope_rows(live.rope, keep)
            live.weight = None if live.weight is None else live.weight[keep]
            cache.select(live.rows)
            return s[keep]

        unroll(step, s, R, rule=exits)
        if ctl.read_rounds:
            out = ctl.logits                                    # each row's exit-round readout
        return out, ctl.exit_round.cpu(), ctl
