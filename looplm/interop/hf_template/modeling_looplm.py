"""LoopLM for Hugging Face transformers: a looped (recurrent-depth) language model written out by
`looplm export`. Self-contained: it imports torch and transformers, nothing of looplm.

    e = prelude(embed(tokens) * embed_scale)       untied blocks, run once
    s = initial state                              zeros | e | a fixed N(0, std^2) table by position
    repeat R rounds:  s = core(inject(s, e))       the same K core blocks every round
    logits = head(final_norm(coda(s)))             untied blocks, run once per readout

Per call (forward, or `model.generate(..., rounds=8)`, which passes its extra keywords to every
forward) these override the config's defaults:

    rounds            rounds per token (a fixed depth, or the most an exit policy may run)
    exit_policy       "fixed" (every round), "fixed:R", "quantile:Q" (the exit gate's CDF reaches Q),
                      "entropy:TAU" (next-token entropy below TAU nats) or "kl:EPS" (successive
                      readouts closer than EPS nats)
    exit_min_rounds   never exit before this round
    exit_in_prefill   let prompt tokens exit too (the prompt then runs one column at a time)
    prefill_cache, decode_cache   what a finished prompt / generated token leaves for later tokens:
                      full (every round's keys/values), first, last or average (one entry for all rounds)
    missing_kv        under full, what later rounds read for a token that exited early: copy_forward
                      (its last computed round's entry) or mask (left out)
    init_state_seed   seed of the random initial-state table (init_state = random)

A Mixture-of-Recursions model decides each token's depth itself (its router, causally) and decodes
with the cache rule it was trained with; rounds, exit and cache overrides that would change that are
refused.

The cache is `LoopLMCache`, a transformers `Cache` with one layer per (phase, round, block) slot:
prelude blocks, core block i at round r, coda blocks. `generate` starts without one and takes the one
the first forward returns; a padded batch needs `attention_mask` (left padding: pads are never
attended to, positions count real tokens only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

try:                                         # transformers >= 4.50 keeps generation apart from the base model
    from transformers import GenerationMixin
except ImportError:                          # pragma: no cover
    from transformers.generation import GenerationMixin

from .configuration_looplm import LoopLMConfig

EXIT_KINDS = ("fixed", "quantile", "entropy", "kl")
CACHE_POLICIES = ("full", "first", "last", "average")
MISSING_KV = ("copy_forward", "mask")
# the output's cache field: `cache` (transformers >= 5.3x), `past_key_values` before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass
class LoopLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus `rounds_used` (B, T): the rounds each position ran."""

    rounds_used: torch.LongTensor | None = None


# ---------------------------------------------------------------------------------------------
# Exit policies: when a token stops looping.

class ExitRule:
    """A parsed exit policy: kind ("fixed", "quantile", "entropy", "kl", or "routed" for a
    Mixture-of-Recursions router), its value, the first round it may stop at, and whether prompt
    tokens may stop early."""

    def __init__(self, kind: str, value: float, min_rounds: int = 1, exit_in_prefill: bool = False):
        self.kind, self.value, self.min_rounds, self.exit_in_prefill = kind, value, min_rounds, exit_in_prefill

    def __repr__(self) -> str:
        return f"{self.kind}:{self.value}"


def parse_exit_rule(text: str, min_rounds: int = 1, exit_in_prefill: bool = False) -> ExitRule:
    help_ = "expected fixed:R, quantile:Q (0<Q<=1), entropy:TAU or kl:EPS"
    kind, sep, raw = str(text).strip().partition(":")
    kind, raw = kind.strip().lower(), raw.strip()
    if not sep or kind not in EXIT_KINDS or not raw:
        raise ValueError(f"exit_policy {text!r}: {help_}")
    try:
        value = int(raw) if kind == "fixed" else float(raw)
    except ValueError:
        raise ValueError(f"exit_policy {text!r}: {help_}") from None
    if not math.isfinite(value):
        raise ValueError(f"exit_policy {text!r}: the value must be finite")
    if kind == "fixed" and value < 1:
        raise ValueError(f"exit_policy {text!r}: R must be an integer >= 1")
    if kind == "quantile" and not 0 < value <= 1:
        raise ValueError(f"exit_policy {text!r}: Q must satisfy 0<Q<=1")
    if kind in ("entropy", "kl") and value < 0:
        raise ValueError(f"exit_policy {text!r}: the threshold must be >= 0 (nats)")
    if isinstance(min_rounds, bool) or not isinstance(min_rounds, int) or min_rounds < 1:
        raise ValueError(f"exit_min_rounds {min_rounds!r}: expected an integer >= 1")
    return ExitRule(kind, value, min_rounds, bool(exit_in_prefill))


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def next_token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) entropy in nats of softmax(logits); zero-probability terms count 0."""
    logp = torch.log_softmax(_as_float(logits), dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


def readout_kl(logits: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats of this round's readout p and the previous round's q, (..., V) -> (...)."""
    logp = torch.log_softmax(_as_float(logits), dim=-1)
    logq = torch.log_softmax(_as_float(previous), dim=-1)
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1).clamp_min(0)


class ExitState:
    """The stop decisions of one column of n rows over up to R rounds. After round r the caller
    passes the rows that ran it (`ids`) with the hazards (quantile), readouts (entropy/kl, at
    `read_rounds`) or the router's decision (routed); `decide` says which stop. Round R always
    stops; before min_rounds, or during a prefill the rule keeps closed, nothing does."""

    def __init__(self, rule: ExitRule, R: int, n: int, prefill: bool, device: torch.device):
        self.rule, self.R, self.n = rule, R, n
        decide = set(range(max(1, rule.min_rounds), R)) if (not prefill or rule.exit_in_prefill) else set()
        if rule.kind == "kl":
            decide.discard(1)                    # nothing to compare with after round 1
        self.decide_rounds = decide
        reads: set[int] = set()
        if rule.kind in ("entropy", "kl"):
            reads = decide | {R} | ({r - 1 for r in decide} if rule.kind == "kl" else set())
        self.read_rounds = reads
        self.needs_hazard = rule.kind == "quantile"
        self.survival = torch.ones(n, device=device) if self.needs_hazard else None
        self.depth = torch.full((n,), R, dtype=torch.long, device=device) if rule.kind == "routed" else None
        self.exit_round = torch.full((n,), R, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None          # (n, V) each row's latest readout
        self.read_at = 0

    def decide(self, r: int, ids: torch.Tensor, hazard: torch.Tensor | None = None,
               logits: torch.Tensor | None = None, route_stop: torch.Tensor | None = None) -> torch.Tensor:
        M = ids.shape[0]
        kind = self.rule.kind
        if self.needs_hazard:
            self.survival[ids] = self.survival[ids] * (1.0 - hazard.reshape(M).clamp(0.0, 1.0).to(self.survival.dtype))
        previous = None
        if logits is not None:
            if self.logits is None:
                self.logits = logits.new_zeros(self.n, logits.shape[-1])
            elif kind == "kl" and self.read_at == r - 1:
                previous = self.logits[ids]
            self.logits[ids] = logits
            self.read_at = r
        if r >= self.R:
            stop = torch.ones(M, dtype=torch.bool, device=ids.device)
        elif r not in self.decide_rounds:
            stop = torch.zeros(M, dtype=torch.bool, device=ids.device)
        elif kind == "fixed":
            stop = torch.full((M,), r >= self.rule.value, dtype=torch.bool, device=ids.device)
        elif kind == "routed":
            stop = route_stop.reshape(M) if route_stop is not None else self.depth[ids] <= r
        elif kind == "quantile":
            stop = (1.0 - self.survival[ids]) >= self.rule.value
        elif kind == "entropy":
            stop = next_token_entropy(logits) < self.rule.value
        else:
            stop = (readout_kl(logits, previous) < self.rule.value if previous is not None
                    else torch.zeros(M, dtype=torch.bool, device=ids.device))
        stop = stop.reshape(M)
        self.exit_round[ids[stop]] = r
        return stop


# ---------------------------------------------------------------------------------------------
# The cache: one slot per (phase, round, block).

class LoopLMLayer(DynamicLayer):
    """The keys and values (B, Hkv, L, Dh) of one slot, addressed by column: a chunk's columns are
    allocated when it begins and written in place (a token's coda entry is rewritten by each of its
    readouts, and an exited token's later rounds are filled when its chunk commits)."""

    def grow(self, batch: int, heads: int, length: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        if not self.is_initialized or self.keys is None:
            self.device, self.is_initialized = device, True
            self.keys = torch.zeros(batch, heads, 0, dim, dtype=dtype, device=device)
            self.values = torch.zeros(batch, heads, 0, dim, dtype=dtype, device=device)
        extra = length - self.keys.shape[-2]
        if extra > 0:
            pad = self.keys.new_zeros(self.keys.shape[0], heads, extra, dim)
            self.keys = torch.cat([self.keys, pad], dim=-2)
            self.values = torch.cat([self.values, pad], dim=-2)

    def own(self) -> None:
        """Before an in-place write: under autograd, write into a copy, so that what earlier reads of this
        slot saved for the backward stays as it was (inference writes in place)."""
        if torch.is_grad_enabled():
            self.keys, self.values = self.keys.clone(), self.values.clone()


class LoopLMCache(Cache):
    """Keys and values of a looped model, one `LoopLMLayer` per slot: ("prelude", 0, i), ("core", r, i)
    for rounds r = 1..rounds, ("coda", *, i) (one per coda block: a token's latest readout). A forward
    runs chunks on it: `begin` (columns, phase, the 2-D attention mask), the blocks' `attend`, `select`
    (the rows still computing when tokens exit), `commit` (what finished tokens leave: the phase's
    policy, and under "full" copy-forward or masking for the rounds a token skipped).

    get_seq_length is the number of committed columns; crop, reorder_cache, batch_select_indices and
    batch_repeat_interleave act on every slot and on the per-column records (valid, depth)."""

    def __init__(self, *, batch: int, rounds: int, n_prelude: int, n_core: int, n_coda: int, n_kv_heads: int,
                 head_dim: int, prefill: str = "full", decode: str = "full", missing: str = "copy_forward",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, value, allowed in (("prefill_cache", prefill, CACHE_POLICIES), ("decode_cache", decode, CACHE_POLICIES),
                                     ("missing_kv", missing, MISSING_KV)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: expected one of {', '.join(allowed)}")
        self.slot_index: dict[tuple, int] = {}
        for i in range(n_prelude):
            self.slot_index[("prelude", 0, i)] = len(self.slot_index)
        for r in range(1, rounds + 1):
            for i in range(n_core):
                self.slot_index[("core", r, i)] = len(self.slot_index)
        for i in range(n_coda):
            self.slot_index[("coda", i)] = len(self.slot_index)
        super().__init__(layers=[LoopLMLayer() for _ in self.slot_index])
        self.batch, self.rounds, self.n_core = batch, rounds, n_core
        self.heads, self.head_dim, self.dtype, self.device = n_kv_heads, head_dim, dtype, torch.device(device)
        self.policies = {"prefill": prefill, "decode": decode}
        self.missing = missing
        self.filled = 0
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=self.device)     # (B, L) real tokens
        self.depth = torch.zeros(batch, 0, dtype=torch.long, device=self.device)     # (B, L) rounds run (mask)
        self.holes = False
        self._start, self._T, self._phase = 0, 0, "prefill"
        self._rows: torch.Tensor | None = None
        self._base: torch.Tensor | None = None
        self._round_masks: dict[int, torch.Tensor | None] = {}

    def settings(self) -> tuple:
        return self.rounds, self.policies["prefill"], self.policies["decode"], self.missing

    # -- the chunk protocol -------------------------------------------------------------------
    def begin(self, start: int, T: int, phase: str, attention_mask: torch.Tensor | None) -> None:
        """The next writes are columns [start, start+T) of every row. attention_mask (B, start+T) or
        (B, T): 1 = a real token (left padding: 0 on the pads); None = every new column is real."""
        if start != self.filled:
            raise ValueError(f"LoopLMCache holds {self.filled} columns; a chunk must start there, not at {start}")
        end = start + T
        for layer in self.layers:
            layer.grow(self.batch, self.heads, end, self.head_dim, self.dtype, self.device)
        if self.valid.shape[1] < end:
            extra = end - self.valid.shape[1]
            self.valid = torch.cat([self.valid, self.valid.new_ones(self.batch, extra)], 1)
            self.depth = torch.cat([self.depth, self.depth.new_full((self.batch, extra), self.rounds)], 1)
        if attention_mask is not None:
            m = attention_mask.to(device=self.device).bool()
            if m.shape[1] == end:
                self.valid[:, :end] = m
            elif m.shape[1] == T:
                self.valid[:, start:end] = m
            else:
                raise ValueError(f"attention_mask has {m.shape[1]} columns; expected {end} (past and new) or {T}")
        self._start, self._T, self._phase = start, T, phase
        self._rows, self._round_masks = None, {}
        self.depth[:, start:end] = self.rounds            # the chunk's own columns count as every round
        valid = self.valid[:, :end].view(self.batch, 1, 1, end)
        if T == 1:
            self._base = None if bool(self.valid[:, :end].all()) else valid
        else:
            q = torch.arange(start, end, device=self.device)
            cols = torch.arange(end, device=self.device)
            # causal, real keys only, and always the query itself (a pad query's row is never empty)
            self._base = ((cols[None, :] <= q[:, None]) & valid) | (cols[None, :] == q[:, None])

    def select(self, rows: torch.Tensor | None) -> None:
        """The following writes and reads are these rows' (None = all): rows that exited stop computing."""
        self._rows, self._round_masks = rows, {}

    def _mask(self, kind: str, r: int) -> torch.Tensor | None:
        rows = self._rows
        if kind != "core" or not self.holes:
            return self._base if self._base is None or rows is None else self._base[rows]
        if r not in self._round_masks:
            end = self._start + self._T
            ran = (self.depth[:, :end] >= r).view(self.batch, 1, 1, end)
            m = ran if self._base is None else self._base & ran
            self._round_masks[r] = m if rows is None else m[rows]
        return self._round_masks[r]

    def attend(self, slot: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this chunk's k, v (B', Hkv, T, Dh) into `slot` and attend q (B', H, T, Dh) to what
        the slot holds for columns [0, start+T) under the chunk's mask."""
        kind = slot[0]
        layer = self.layers[self.slot_index[("coda", slot[2]) if kind == "coda" else slot]]
        s, e, rows = self._start, self._start + self._T, self._rows
        layer.own()
        if rows is None:
            layer.keys[:, :, s:e] = k
            layer.values[:, :, s:e] = v
            keys, values = layer.keys[:, :, :e], layer.values[:, :, :e]
        else:
            layer.keys[rows, :, s:e] = k
            layer.values[rows, :, s:e] = v
            keys, values = layer.keys[rows, :, :e], layer.values[rows, :, :e]
        mask = self._mask(kind, slot[1])
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != q.shape[1])

    def commit(self, rounds_used: torch.Tensor | int) -> None:
        """Close the chunk: rounds_used (int, or (B,) per row) is what each row's tokens ran."""
        self._rows = None
        s, e, R = self._start, self._start + self._T, self.rounds
        policy = self.policies[self._phase]
        self.filled = max(self.filled, e)
        if isinstance(rounds_used, int) and rounds_used == R and policy == "full":
            return                              # every slot written: nothing to fill
        used = (torch.full((self.batch,), int(rounds_used)) if isinstance(rounds_used, int)
                else rounds_used.reshape(-1).cpu()).tolist()
        for i in range(self.n_core):
            slots = [self.layers[self.slot_index[("core", r, i)]] for r in range(1, R + 1)]
            for layer in slots:
                layer.own()
            for attr in ("keys", "values"):
                parts = [getattr(layer, attr) for layer in slots]
                for b, n in enumerate(used):
                    if policy == "full":
                        if self.missing == "copy_forward" and n < R:    # later rounds read round n's entry
                            for part in parts[n:]:
                                part[b, :, s:e] = parts[n - 1][b, :, s:e]
                        continue
                    ran = torch.stack([part[b, :, s:e] for part in parts[:n]])
                    kept = ran[0] if policy == "first" else ran[-1] if policy == "last" else ran.mean(0)
                    for part in parts:
                        part[b, :, s:e] = kept
        if policy == "full" and self.missing == "mask":
            for b, n in enumerate(used):
                self.depth[b, s:e] = n
            self.holes = self.holes or any(n < R for n in used)

    # -- the transformers Cache API -----------------------------------------------------------
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.filled

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.filled + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove columns (transformers' convention: a negative count;
        a positive value is the length to keep, as older releases read it)."""
        keep = self.filled + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, self.filled)
        keep = max(keep, 0)
        for layer in self.layers:
            if layer.is_initialized and layer.keys is not None:
                layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
        self.valid, self.depth = self.valid[:, :keep], self.depth[:, :keep]
        self.filled = keep

    def _rows_of(self, index: torch.Tensor) -> None:
        for layer in self.layers:
            if layer.is_initialized and layer.keys is not None:
                layer.keys = layer.keys[index.to(layer.keys.device)]
                layer.values = layer.values[index.to(layer.values.device)]
        self.valid, self.depth = self.valid[index.to(self.device)], self.depth[index.to(self.device)]
        self.batch = self.valid.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows_of(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows_of(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows_of(torch.arange(self.batch, device=self.device).repeat_interleave(repeats))

    def reset(self) -> None:
        for layer in self.layers:
            layer.keys = layer.values = None
            layer.is_initialized = False
        self.valid, self.depth = self.valid[:, :0], self.depth[:, :0]
        self.filled, self.holes = 0, False


# ---------------------------------------------------------------------------------------------
# Blocks: RoPE, grouped-query attention (SDPA), a gated FFN or a mixture of them, RMSNorm.

def rope_frequencies(config: LoopLMConfig) -> torch.Tensor:
    """(Dh/2,) angular frequency of each rotated pair (dimensions i and i + Dh/2)."""
    dh = config.head_dim
    inv = 1.0 / config.rope_base ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh)
    if config.rope_scaling_type == "linear":
        return inv / config.rope_factor
    if config.rope_scaling_type == "llama3":
        # long wavelengths stretched by the factor, short ones kept, a linear blend in between
        wavelength = 2 * math.pi / inv
        mix = ((config.rope_original_context / wavelength - config.rope_low_freq_factor)
               / (config.rope_high_freq_factor - config.rope_low_freq_factor)).clamp(0, 1)
        return (1 - mix) * inv / config.rope_factor + mix * inv
    return inv


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, Dh); cos, sin (B, T, 1, Dh/2). Each pair (x_i, x_{i+Dh/2}) turned by its angle, in fp32."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).type_as(x)


def _rms(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)


def _activation(config: LoopLMConfig):
    if config.activation == "gelu_tanh":
        return lambda g: F.gelu(g, approximate="tanh")
    return F.silu


class LoopLMAttention(nn.Module):
    def __init__(self, config: LoopLMConfig):
        super().__init__()
        d, H, Hkv, Dh = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        self.n_heads, self.n_kv, self.dh = H, Hkv, Dh
        self.q = nn.Linear(d, H * Dh, bias=config.qkv_bias)
        self.k = nn.Linear(d, Hkv * Dh, bias=config.qkv_bias)
        self.v = nn.Linear(d, Hkv * Dh, bias=config.qkv_bias)
        self.o = nn.Linear(H * Dh, d, bias=False)
        self.q_norm = nn.RMSNorm(Dh, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(Dh, eps=config.norm_eps) if config.qk_norm else None
        # the softmax scale, when not SDPA's 1/sqrt(Dh), is folded into the queries
        self.q_scale = config.attn_scale * math.sqrt(Dh) if config.attn_scale else 1.0

    def forward(self, x: torch.Tensor, rope: tuple, cache: LoopLMCache, slot: tuple) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.dh)
        k = self.k(x).view(B, T, self.n_kv, self.dh)
        v = self.v(x).view(B, T, self.n_kv, self.dh)
        if self.q_norm is not None:                       # per head, before the rotation
            q, k = _rms(self.q_norm, q), _rms(self.k_norm, k)
        q, k = rotate(q, *rope).transpose(1, 2), rotate(k, *rope).transpose(1, 2)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        y = cache.attend(slot, q, k, v.transpose(1, 2))   # (B, H, T, Dh)
        return self.o(y.transpose(1, 2).reshape(B, T, self.n_heads * self.dh))


class LoopLMMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU, or GeGLU with activation = gelu_tanh."""

    def __init__(self, config: LoopLMConfig):
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.up = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.down = nn.Linear(config.ffn_hidden, config.d_model, bias=False)
        self.act = _activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


class LoopLMExperts(nn.Module):
    """A token-choice mixture of gated FFN experts (LoopMoE): each token's top-k experts by router
    softmax, their outputs weighted by those probabilities renormalised over the k."""

    def __init__(self, config: LoopLMConfig):
        super().__init__()
        E, h, d = config.moe_experts, config.moe_hidden or config.ffn_hidden, config.d_model
        self.n_experts, self.top_k = E, config.moe_top_k
        self.router = nn.Linear(d, E, bias=False)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * h, d))    # expert e: [gate; up]
        self.down = nn.Parameter(torch.empty(E, d, h))
        self.act = _activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).float().softmax(-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)                     # (N, k)
        weight = (weight / weight.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        picks = chosen.flatten()                                            # choice j of token n at n*k + j
        order = torch.argsort(picks, stable=True)
        counts = torch.bincount(picks, minlength=self.n_experts).tolist()
        at = 0
        for e, n in enumerate(counts):
            if n:
                which = order[at:at + n]
                tokens = which // self.top_k
                g, u = F.linear(flat[tokens], self.gate_up[e]).chunk(2, dim=-1)
                y = F.linear(self.act(g) * u, self.down[e])
                out.index_add_(0, tokens, y * weight.flatten()[which].unsqueeze(-1))
                at += n
        return out.view(x.shape)


class LoopLMBlock(nn.Module):
    """Pre-norm (x + f(norm(x))), sandwich (x + norm(f(norm(x)))) or DeepLoop (norm(alpha*x + f(x)))."""

    def __init__(self, config: LoopLMConfig, alpha: float = 1.0, experts: bool = False):
        super().__init__()
        self.mode = "deeploop" if config.residual_scaling == "deeploop" else config.norm
        self.alpha = alpha
        self.attn = LoopLMAttention(config)
        self.mlp = LoopLMExperts(config) if experts else LoopLMMLP(config)
        self.norm1 = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.norm2 = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        if self.mode == "sandwich":
            self.post1 = nn.RMSNorm(config.d_model, eps=config.norm_eps)
            self.post2 = nn.RMSNorm(config.d_model, eps=config.norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple, cache: LoopLMCache, slot: tuple) -> torch.Tensor:
        if self.mode == "deeploop":
            x = _rms(self.norm1, self.alpha * x + self.attn(x, rope, cache, slot))
            return _rms(self.norm2, self.alpha * x + self.mlp(x))
        if self.mode == "sandwich":
            x = x + _rms(self.post1, self.attn(_rms(self.norm1, x), rope, cache, slot))
            return x + _rms(self.post2, self.mlp(_rms(self.norm2, x)))
        x = x + self.attn(_rms(self.norm1, x), rope, cache, slot)
        return x + self.mlp(_rms(self.norm2, x))


# ---------------------------------------------------------------------------------------------
# The model.

class _Plan:
    """What one call runs: rounds R, the exit rule, the cache settings, the initial-state seed."""

    def __init__(self, R: int, rule: ExitRule, prefill: str, decode: str, missing: str, seed: int):
        self.R, self.rule, self.prefill, self.decode, self.missing, self.seed = R, rule, prefill, decode, missing, seed
        self.adaptive = rule.kind != "fixed"


class LoopLMPreTrainedModel(PreTrainedModel):
    config_class = LoopLMConfig
    base_model_prefix = "looplm"
    _no_split_modules = ["LoopLMBlock"]
    _supports_sdpa = True
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        """For a model built from a config alone (a checkpoint overwrites all of it)."""
        std = 0.02
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, LoopLMExperts):
            nn.init.normal_(module.gate_up, std=std)
            nn.init.normal_(module.down, std=std)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False        # generate starts without a cache; the first forward makes a LoopLMCache


class LoopLMForCausalLM(LoopLMPreTrainedModel, GenerationMixin):
    def __init__(self, config: LoopLMConfig):
        super().__init__(config)
        c = config
        d, K = c.d_model, c.n_core
        N = K * c.nominal_rounds
        self.alpha = (2 * N) ** c.deeploop_p if c.residual_scaling == "deeploop" else 1.0
        self.embed = nn.Embedding(c.vocab_size, d)
        self.prelude = nn.ModuleList(LoopLMBlock(c) for _ in range(c.n_prelude))
        n_core = K * (c.nominal_rounds if c.untied else 1)
        self.core = nn.ModuleList(LoopLMBlock(c, self.alpha, experts=c.moe_experts > 0) for _ in range(n_core))
        self.coda = nn.ModuleList(LoopLMBlock(c) for _ in range(c.n_coda))
        self.adapter = nn.Linear(2 * d, d, bias=False) if c.injection == "concat" else None
        self.decay = nn.Parameter(torch.zeros(d)) if c.injection == "decay" else None   # carry exp(-exp(theta))
        self.state_norm = nn.RMSNorm(d, eps=c.norm_eps) if c.state_norm else None
        self.gate = nn.Sequential(nn.RMSNorm(d, eps=c.norm_eps), nn.Linear(d, 1)) if c.exit_gate else None
        self.mor_router = nn.Linear(d, c.nominal_rounds, bias=False) if c.mor != "none" else None
        self.mor_aux_router = (nn.Linear(d, c.nominal_rounds, bias=False)
                               if c.mor == "expert_choice" and c.mor_causal == "aux_router" else None)
        if c.mor == "token_choice":
            self.register_buffer("mor_bias", torch.zeros(c.nominal_rounds))
        else:
            self.mor_bias = None
        self.final_norm = nn.RMSNorm(d, eps=c.norm_eps)
        self.head = None if c.tie_embeddings else nn.Linear(d, c.vocab_size, bias=False)
        self._tables: dict = {}
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed = value

    # -- per-call settings --------------------------------------------------------------------
    def plan(self, rounds=None, exit_policy=None, exit_min_rounds=None, exit_in_prefill=None, prefill_cache=None,
             decode_cache=None, missing_kv=None, init_state_seed=None) -> _Plan:
        """The config's defaults with this call's overrides, checked as looplm's engine checks them."""
        c = self.config
        if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1):
            raise ValueError(f"rounds {rounds!r}: must be an integer >= 1")
        seed = c.init_state_seed if init_state_seed is None else int(init_state_seed)
        if c.mor != "none":
            want = ({"prefill_cache": "full", "decode_cache": "full", "missing_kv": "mask"}
                    if c.mor_cache == "recursion_wise" else {"prefill_cache": "first", "decode_cache": "first"})
            given = {"prefill_cache": prefill_cache, "decode_cache": decode_cache, "missing_kv": missing_kv}
            for key, value in want.items():
                if given[key] is not None and given[key] != value:
                    raise ValueError(f"{key} {given[key]!r}: this Mixture-of-Recursions model was trained with the "
                                     f"{c.mor_cache} cache rule, which decodes with {key} = {value!r}")
            if (exit_policy is not None and exit_policy.strip() != "fixed") or rounds not in (None, c.nominal_rounds):
                raise ValueError("rounds/exit_policy: a Mixture-of-Recursions model's router decides each token's "
                                 f"depth (1..{c.nominal_rounds}); other exit policies or depths are not its function")
            rule = ExitRule("routed", c.nominal_rounds, 1, True)
            missing = want.get("missing_kv", missing_kv or c.missing_kv)
            return _Plan(c.nominal_rounds, rule, want["prefill_cache"], want["decode_cache"], missing, seed)
        if getattr(c, "kv_sharing", "none") == "first":   # trained reading round 1's keys/values at every round
            for key, given in (("prefill_cache", prefill_cache), ("decode_cache", decode_cache)):
                if given is not None and given != "first":
                    raise ValueError(f"{key} {given!r}: this model was trained with kv_sharing = first (every round "
                                     f"reads round 1's keys/values), which decodes with {key} = 'first'")
            prefill_cache = decode_cache = "first"
        text = (c.exit_policy if exit_policy is None else exit_policy).strip()
        if text == "fixed":
            text = f"fixed:{rounds or c.rounds}"
        rule = parse_exit_rule(text, c.exit_min_rounds if exit_min_rounds is None else exit_min_rounds,
                               c.exit_in_prefill if exit_in_prefill is None else exit_in_prefill)
        if rule.kind == "fixed":
            if rounds is not None and rounds != rule.value:
                raise ValueError(f"rounds {rounds} disagrees with exit_policy {rule}")
            R = int(rule.value)
        else:
            R = rounds or c.rounds
        if c.untied and R != c.nominal_rounds:
            raise ValueError(f"rounds: this untied baseline runs exactly {c.nominal_rounds} rounds, asked {R}")
        if rule.kind == "quantile" and self.gate is None:
            raise ValueError(f"exit_policy {rule}: quantile needs a model trained with an exit gate")
        return _Plan(R, rule, prefill_cache or c.prefill_cache, decode_cache or c.decode_cache,
                     missing_kv or c.missing_kv, seed)

    def new_cache(self, batch: int, plan: _Plan) -> LoopLMCache:
        c, p = self.config, self.embed.weight
        return LoopLMCache(batch=batch, rounds=plan.R, n_prelude=c.n_prelude, n_core=c.n_core, n_coda=c.n_coda,
                           n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, prefill=plan.prefill, decode=plan.decode,
                           missing=plan.missing, dtype=p.dtype, device=p.device)

    # -- pieces -------------------------------------------------------------------------------
    def _table(self, name: str, seed: int = 0) -> torch.Tensor:
        """RoPE angles' cos/sin (context, Dh/2) and the random initial states (context, d) by position,
        computed on first use (not buffers: nothing to load, nothing to initialise on a meta device)."""
        p = self.embed.weight
        key = (name, seed, p.device, p.dtype)
        if key not in self._tables:
            c = self.config
            if name == "noise":      # the same draws as looplm's initial_noise_table(cfg, seed)
                g = torch.Generator().manual_seed(seed)
                table = (torch.randn(c.context, c.d_model, generator=g) * c.init_state_std).to(p.device, p.dtype)
            else:
                angles = torch.outer(torch.arange(c.context, dtype=torch.float32), rope_frequencies(c))
                table = (angles.cos() if name == "cos" else angles.sin()).to(p.device)
            self._tables[key] = table
        return self._tables[key]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._table("cos")[positions].unsqueeze(2), self._table("sin")[positions].unsqueeze(2)

    def _inject(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        kind = self.config.injection
        if kind == "add":
            return s + e
        if kind == "concat":
            return self.adapter(torch.cat([s, e], dim=-1))
        if kind == "decay":
            return torch.exp(-torch.exp(self.decay.float())).to(s.dtype) * s + e
        return s

    def _core_step(self, s, e, r, rope, cache) -> torch.Tensor:
        K = self.config.n_core
        blocks = self.core[(r - 1) * K: r * K] if self.config.untied else self.core
        x = self._inject(s, e)
        for i, block in enumerate(blocks):
            x = block(x, rope, cache, ("core", r, i))
        return _rms(self.state_norm, x) if self.state_norm is not None else x

    def _routed_step(self, s, e, r, rope, cache, weight) -> torch.Tensor:
        return s + weight.unsqueeze(-1) * (self._core_step(s, e, r, rope, cache) - s)

    def _readout(self, s, rope, cache, last_only: bool) -> torch.Tensor:
        for i, block in enumerate(self.coda):
            s = block(s, rope, cache, ("coda", 0, i))
        h = self.final_norm(s[:, -1] if last_only else s)
        return F.linear(h, self.embed.weight if self.head is None else self.head.weight)

    def _hazard(self, s: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(s).squeeze(-1))

    def _expert_choice(self, s: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert-choice routing before round r: (continues (B', T) by the causal decision, weight)."""
        c = self.config
        if r > c.nominal_rounds:
            return torch.zeros(s.shape[:2], dtype=torch.bool, device=s.device), s.new_zeros(s.shape[:2])
        logits = F.linear(s, self.mor_router.weight[r - 1:r]).float().squeeze(-1)
        weight = (c.mor_alpha * torch.sigmoid(logits)).to(s.dtype)
        if r == 1:
            return torch.ones_like(logits, dtype=torch.bool), weight
        decision = logits if self.mor_aux_router is None else \
            F.linear(s, self.mor_aux_router.weight[r - 1:r]).float().squeeze(-1)
        return decision > 0, weight

    def _inputs(self, ids, positions, cache, seed) -> tuple:
        """RoPE tables, prelude output e and initial state s of a chunk (B, T)."""
        rope = self._rope(positions)
        x = self.embed(ids)
        if self.config.embed_scale != 1.0:
            x = x * self.config.embed_scale
        for i, block in enumerate(self.prelude):
            x = block(x, rope, cache, ("prelude", 0, i))
        kind = self.config.init_state
        s = torch.zeros_like(x) if kind == "zeros" else x if kind == "prelude" else self._table("noise", seed)[positions]
        return rope, x, s

    def _fixed_chunk(self, ids, positions, cache, plan, keep: int) -> torch.Tensor:
        """Every token runs R rounds: (B, T', V) logits of the last `keep` columns (0 = all)."""
        rope, e, s = self._inputs(ids, positions, cache, plan.seed)
        for r in range(1, plan.R + 1):
            s = self._core_step(s, e, r, rope, cache)
        for i, block in enumerate(self.coda):
            s = block(s, rope, cache, ("coda", 0, i))
        h = self.final_norm(s if keep == 0 else s[:, -keep:])
        cache.commit(plan.R)
        return F.linear(h, self.embed.weight if self.head is None else self.head.weight)

    def _exit_column(self, ids, positions, cache, plan, phase) -> tuple[torch.Tensor, torch.Tensor]:
        """One column (B, 1); each row stops where the exit rule (or the router) says: (logits (B, V),
        rounds used (B,)). A row's coda entry is its exit-round readout's (the last one written)."""
        rule, R = plan.rule, plan.R
        rope, e, s = self._inputs(ids, positions, cache, plan.seed)
        B = ids.shape[0]
        rows = torch.arange(B, device=ids.device)
        state = ExitState(rule, R, B, phase == "prefill", ids.device)
        out = s.new_zeros(B, self.config.vocab_size)
        weight = route_stop = None
        expert = rule.kind == "routed" and self.config.mor == "expert_choice"
        if rule.kind == "routed" and not expert:        # token choice: depth and weight from e, up front
            probs = self.mor_router(e).float().softmax(-1)
            depth = (probs + self.mor_bias.to(probs.dtype)).argmax(-1)               # (B, 1), 0-based
            weight = probs.gather(-1, depth.unsqueeze(-1)).squeeze(-1).to(e.dtype)
            state.depth[rows] = (depth[:, -1] + 1).clamp(1, R)
        if expert:
            weight = self._expert_choice(s, 1)[1]
        for r in range(1, R + 1):
            s = self._core_step(s, e, r, rope, cache) if weight is None else \
                self._routed_step(s, e, r, rope, cache, weight)
            if expert and r < R:     # who continues into round r + 1, and with what weight
                chosen, weight = self._expert_choice(s, r + 1)
                route_stop = ~chosen[:, -1]
            logits = self._readout(s, rope, cache, True) if r in state.read_rounds else None
            hazard = self._hazard(s)[:, -1] if state.needs_hazard else None
            stop = state.decide(r, rows, hazard=hazard, logits=logits, route_stop=route_stop)
            if bool(stop.any()):
                if logits is None:                       # the rows that stop read out now
                    cache.select(rows[stop])
                    out[rows[stop]] = self._readout(s[stop], (rope[0][stop], rope[1][stop]), cache, True)
                keep = ~stop
                if not bool(keep.any()):
                    break
                rows, s, e, rope = rows[keep], s[keep], e[keep], (rope[0][keep], rope[1][keep])
                weight = None if weight is None else weight[keep]
                cache.select(rows)
        if state.read_rounds:
            out = state.logits
        cache.commit(state.exit_round)
        return out, state.exit_round

    # -- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: LoopLMCache | None = None,
        past_key_values: LoopLMCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        rounds: int | None = None,
        exit_policy: str | None = None,
        exit_min_rounds: int | None = None,
        exit_in_prefill: bool | None = None,
        prefill_cache: str | None = None,
        decode_cache: str | None = None,
        missing_kv: str | None = None,
        init_state_seed: int | None = None,
        **kwargs,
    ) -> LoopLMOutput | tuple:
        """input_ids (B, T) after what `cache` holds. attention_mask (B, past + T), 1 = a real token
        (left padding). Returns logits (B, T, V) (the last `logits_to_keep` columns when > 0), the
        cache (with use_cache) and rounds_used (B, T)."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("LoopLM runs from input_ids (inputs_embeds are not supported)")
        plan = self.plan(rounds, exit_policy, exit_min_rounds, exit_in_prefill, prefill_cache, decode_cache,
                         missing_kv, init_state_seed)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, LoopLMCache):
            if cache.get_seq_length() > 0:
                raise ValueError(f"LoopLM keeps keys and values per round in a LoopLMCache; got a filled "
                                 f"{type(cache).__name__}")
            cache = None                                   # an empty default cache: use ours
        B, T = input_ids.shape
        if cache is None:
            cache = self.new_cache(B, plan)
        elif cache.settings() != (plan.R, plan.prefill, plan.decode, plan.missing) or cache.batch != B:
            raise ValueError(f"this LoopLMCache was made for rounds, prefill, decode, missing_kv = {cache.settings()} "
                             f"and {cache.batch} rows; this call asks {(plan.R, plan.prefill, plan.decode, plan.missing)} "
                             f"and {B} rows: start a new cache")
        start = cache.get_seq_length()
        if start + T > self.config.context:
            raise ValueError(f"{start + T} positions exceed the model context of {self.config.context}")
        phase = "prefill" if start == 0 or T > 1 else "decode"
        if attention_mask is not None:                     # as (B, past + T): 1 = a real token
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B:
                raise ValueError("attention_mask must be (B, past + T): 1 for real tokens, 0 for padding")
            mask = attention_mask.to(input_ids.device).long()
            if mask.shape[1] == T and start:
                mask = torch.cat([cache.valid[:, :start].long().to(mask.device), mask], 1)
            if mask.shape[1] != start + T:
                raise ValueError(f"attention_mask has {attention_mask.shape[1]} columns; expected {start + T} "
                                 f"(the {start} cached and {T} new) or {T}")
        else:
            mask = None
        if position_ids is not None:
            positions = position_ids[..., -T:].to(input_ids.device).expand(B, T)
        else:                                              # count real tokens only (left padding)
            valid = torch.ones(B, start + T, dtype=torch.long, device=input_ids.device)
            if start:
                valid[:, :start] = cache.valid[:, :start].long().to(valid.device)
            if mask is not None:
                valid = mask
            positions = (valid.cumsum(-1) - 1)[:, -T:]
        positions = positions.clamp_min(0)
        if int(positions.max()) >= self.config.context:
            raise ValueError(f"position {int(positions.max())} is beyond the model context of {self.config.context}")
        keep = logits_to_keep if isinstance(logits_to_keep, int) and 0 < logits_to_keep < T else 0
        if plan.adaptive and (phase == "decode" or plan.rule.exit_in_prefill):
            columns, used = [], []
            for c in range(T):                             # token by token, each row exiting on its own
                cache.begin(start + c, 1, phase, None if mask is None else mask[:, :start + c + 1])
                lg, u = self._exit_column(input_ids[:, c:c + 1], positions[:, c:c + 1], cache, plan, phase)
                columns.append(lg)
                used.append(u)
            logits = torch.stack(columns, 1)
            logits = logits[:, -keep:] if keep else logits
            rounds_used = torch.stack(used, 1)
        elif T > 1 and getattr(self.config, "kv_sharing", "none") == "first":
            # inside a chunk the cache attends exactly; this model reads earlier tokens' round-1 entries at every
            # round, which is what a one-column chunk's history holds: run the chunk column by column
            columns = []
            for c in range(T):
                cache.begin(start + c, 1, phase, None if mask is None else mask[:, :start + c + 1])
                columns.append(self._fixed_chunk(input_ids[:, c:c + 1], positions[:, c:c + 1], cache, plan, 0))
            logits = torch.cat(columns, 1)
            logits = logits[:, -keep:] if keep else logits
            rounds_used = torch.full((B, T), plan.R, dtype=torch.long, device=input_ids.device)
        else:
            cache.begin(start, T, phase, mask)
            logits = self._fixed_chunk(input_ids, positions, cache, plan, keep)
            rounds_used = torch.full((B, T), plan.R, dtype=torch.long, device=input_ids.device)
        loss = None
        if labels is not None:
            if keep:
                raise ValueError("labels need the logits of every position (logits_to_keep = 0)")
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        out = LoopLMOutput(loss=loss, logits=logits, rounds_used=rounds_used, **{CACHE_FIELD: cache if use_cache else None})
        return out if return_dict is not False else out.to_tuple()
