"""The recipe: every decision a run makes, as typed, frozen, validated config objects.

A recipe is a TOML file with one table per section (`model`, `depth`, `backward`,
`supervision`, `exit`, `data`, `optim`, `train`). Each section maps onto one frozen dataclass
below; every field is documented where it is declared, and illegal values or combinations
are refused at construction with a `UserError` naming the field and what is allowed.
`Recipe.to_dict()` writes every default out, so a saved recipe rebuilds its run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union

from ..errors import UserError

log = logging.getLogger(__name__)


def _check(ok: bool, key: str, allowed: str) -> None:
    if not ok:
        raise UserError(f"recipe field {key}: {allowed}")


# ---------------------------------------------------------------------------------------
# Applicability: one rule for the whole recipe. A field that does not apply to the chosen kind,
# mode or stage must stay at its default; otherwise the recipe is refused, naming the field and
# the field(s) that make it inapplicable. Each field's rule is declared with the field itself
# (`name: type = applies(when(...), default=...)`), so a reader sees it beside the docstring; the enumeration
# test (tests/test_applicability.py) covers every field that declares one.

@dataclass(frozen=True)
class Condition:
    """The field applies only when `test(*values of keys)` holds (keys are dotted recipe keys)."""

    keys: tuple[str, ...]
    test: Any
    text: str
    """What must hold, in words: 'depth.kind is "lognormal_poisson"'."""


def _words(values: tuple) -> str:
    return " or ".join(f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)
                       for v in values)


def when(key: str, *values: Any) -> Condition:
    return Condition((key,), lambda v: v in values, f"{key} is {_words(values)}")


def unless(key: str, *values: Any) -> Condition:
    return Condition((key,), lambda v: v not in values, f"{key} is not {_words(values)}")


def applies(*conditions: Condition, default: Any) -> Any:
    """A dataclass field (of an immutable default) that applies only when every condition holds."""
    return field(default=default, metadata={"applies": conditions})


def _builtin_task(task: str) -> bool:
    from ..data.tasks import TASKS   # late import: data imports the recipe
    return task in TASKS


TASK_DATA = unless("data.task", "")
BUILTIN_TASK = Condition(("data.task",), _builtin_task, "data.task names a built-in task generator")
TEXT_DATA = when("data.task", "")
JSONL_TASK = Condition(("data.task",), lambda t: t != "" and not _builtin_task(t), "data.task names a JSONL file")
LENGTH_DIALS = Condition(("data.task", "data.length_unit"),
                         lambda t, unit: _builtin_task(t) or (t != "" and unit != ""),
                         "data.task names a built-in task generator, or a JSONL file with data.length_unit set")
STAGE_1 = unless("train.stage", 2)
GATE_KINDS = ("learned_exit", "act_mixture")
"""supervision.kind values whose loss reads the exit gate's masses (stage I)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int = 257
    """Embedding rows; must hold the tokenizer's vocabulary (byte tokenizer: 257)."""
    d_model: int = 128
    """Residual stream width."""
    n_heads: int = 4
    """Query heads per attention layer."""
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention); must divide n_heads. 0 = n_heads."""
    head_dim: int = 0
    """Width of one head; its own field, so n_heads*head_dim may differ from d_model. 0 = d_model // n_heads."""
    ffn_hidden: int = 0
    """SwiGLU hidden width. 0 = 8/3 * d_model rounded up to a multiple of 32."""
    context: int = 128
    """Longest sequence the model accepts (RoPE positions, cache length)."""
    n_prelude: int = 1
    """Untied blocks before the loop (their output is the injected input e)."""
    n_core: int = 2
    """Shared blocks run once per round."""
    n_coda: int = 1
    """Untied blocks after the loop, before the LM head."""
    init_state: Literal["zeros", "prelude", "random"] = "prelude"
    """Loop state before round 1: zeros, the prelude output e, or normal noise with std init_state_std (Huginn)."""
    init_state_std: float = applies(when("model.init_state", "random"), default=1.0)
    """Std of the random initial state."""
    injection: Literal["none", "add", "concat", "decay"] = "add"
    """How e re-enters each round: not at all, s + e, Linear(2d -> d) of [s, e] (Huginn's adapter), or
    a * s + e with a learned per-channel carry a = exp(-exp(theta)) in (0, 1) (a stable diagonal, as
    Parcae's): s + e adds e again every round, so the state grows with depth; a carry below 1 bounds it."""
    injection_decay_init: float = applies(when("model.injection", "decay"), default=0.5)
    """The carry a every channel starts at, in (0, 1): the state's memory of earlier rounds."""
    adapter_init: Literal["sum", "state"] = applies(when("model.injection", "concat"), default="sum")
    """How the concat adapter [W_s | W_e] starts: "sum" = [I | I] (the round input s + e, like additive
    injection) or "state" = [I | 0] (the round input is the state alone: with init_state = prelude, round 1
    is exactly the stack without a loop, so a retrofit of a pretrained model starts as that model and
    training learns how much of e re-enters; the zero half still receives gradient dL/dx e^T)."""
    norm: Literal["pre", "sandwich"] = applies(unless("model.residual_scaling", "deeploop"), default="pre")
    """Pre-norm blocks, or sandwich norm (norm before and after each branch, as Huginn). DeepLoop's scaled
    residual replaces the block norms, so with it this stays at "pre"."""
    residual_scaling: Literal["none", "deeploop"] = "none"
    """DeepLoop: x <- norm(alpha*x + branch(x)), alpha=(2N)^p, branch init scaled by beta=(8N)^-p, N = n_core*rounds. Needs norm = "pre"."""
    deeploop_p: float = applies(when("model.residual_scaling", "deeploop"), default=0.5)
    """DeepLoop exponent p (>= 0)."""
    round_update: Literal["plain", "damped", "euler"] = "plain"
    """How a round after the first updates the loop state (round 1 is always the plain core, so an imported
    model at one round stays the pretrained stack): plain s <- core(s); damped s <- s + round_eta (core(s) - s),
    a step of size eta toward the core's output; euler: every core block's residual update split into
    round_substeps Euler sub-steps x <- x + (block(x) - x) / k, the block visited k times (training-free
    looping of a frozen pretrained block, arXiv 2605.23872). Euler runs in whole-sequence forwards (eval,
    train, lm-eval, recirculate); the cached decoder refuses it (its caches hold one entry per visit)."""
    round_eta: float = applies(when("model.round_update", "damped"), default=0.5)
    """Damped step size eta in (0, 1] (1 = plain)."""
    round_substeps: int = applies(when("model.round_update", "euler"), default=2)
    """Euler sub-steps k >= 2 per core block in every round after the first."""
    state_norm: bool = False
    """RMSNorm the loop state after every round (keeps its scale fixed when running more rounds)."""
    tie_embeddings: bool = True
    """Share the token embedding with the LM head."""
    untied: bool = False
    """Baseline: replace the shared core by n_core*depth.rounds distinct blocks (needs depth.kind = fixed)."""
    rope_base: float = 10000.0
    """RoPE frequency base."""
    rope_scaling: Literal["none", "linear", "llama3"] = "none"
    """How RoPE's frequencies are stretched for a longer context (imported models carry their own): none;
    linear = every frequency divided by rope_factor (position interpolation); llama3 = Llama 3.1's rule (low
    frequencies divided by rope_factor, high ones kept, a smooth blend between)."""
    rope_factor: float = applies(unless("model.rope_scaling", "none"), default=8.0)
    """The stretch factor of rope_scaling."""
    rope_low_freq_factor: float = applies(when("model.rope_scaling", "llama3"), default=1.0)
    """llama3: wavelengths above rope_original_context / this are fully stretched."""
    rope_high_freq_factor: float = applies(when("model.rope_scaling", "llama3"), default=4.0)
    """llama3: wavelengths below rope_original_context / this are kept."""
    rope_original_context: int = applies(when("model.rope_scaling", "llama3"), default=8192)
    """llama3: the context the frequencies were trained for before stretching."""
    local_rope_base: float = 0.0
    """The blocks in local_blocks rotate with this RoPE base (no scaling) instead of rope_base: Gemma 3's
    sliding-window layers (10,000 beside its global layers' 1,000,000). 0 = every block uses rope_base."""
    local_blocks: tuple[int, ...] = applies(unless("model.local_rope_base", 0.0), default=())
    """Which blocks use local_rope_base: positions in prelude, then core, then coda order (0-based; an
    untied core's copies follow their shared block)."""
    activation: Literal["silu", "gelu_tanh"] = "silu"
    """The gated FFN's activation: silu (SwiGLU, Llama/Qwen) or gelu_tanh (GeGLU with tanh-approximated GELU, Gemma)."""
    qkv_bias: bool = False
    """Biases on the query/key/value projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head's width on queries and keys, before RoPE (Qwen3, Gemma 3)."""
    attn_scale: float = 0.0
    """Softmax scale of attention scores. 0 = 1/sqrt(head_dim); Gemma sets 1/sqrt(query_pre_attn_scalar)."""
    embed_scale: float = 1.0
    """The token embedding is multiplied by this before the prelude (Gemma: sqrt(d_model))."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Std of weight initialisation; output projections are further scaled by 1/sqrt(2*blocks visited)."""
    moe_experts: int = 0
    """LoopMoE: each core block's FFN is a mixture of this many SwiGLU experts, routed per token at every
    visit (top moe_top_k, softmax renormalised over the chosen; model/moe.py). 0 = the dense SwiGLU.
    Prelude and coda stay dense; with model.untied every untied core block has its own experts."""
    moe_top_k: int = applies(unless("model.moe_experts", 0), default=2)
    """Experts each token uses per visit (token choice); needs moe_experts > 0."""
    moe_hidden: int = applies(unless("model.moe_experts", 0), default=0)
    """Hidden width of one expert. 0 = ffn_hidden (each expert as wide as the dense FFN)."""
    mor: Literal["none", "token_choice", "expert_choice"] = "none"
    """Mixture-of-Recursions (model/recursions.py): token_choice = a router on each token's prelude output picks
    how many of the depth.rounds rounds it runs (top-1), the chosen depth's probability scaling its updates;
    expert_choice = at every round a router on the state keeps the top mor_capacity share of each sequence's
    tokens still running (nested), its sigmoid x mor_alpha scaling their updates."""
    mor_capacity: tuple[float, ...] = applies(when("model.mor", "expert_choice"), default=())
    """expert_choice: the share of a sequence's tokens each round keeps, one per round, starting at 1 and
    non-increasing. Empty = (N - i) / N (1, 2/3, 1/3 at N = 3 rounds)."""
    mor_alpha: float = applies(when("model.mor", "expert_choice"), default=0.1)
    """expert_choice: scale of the router's sigmoid weight on a kept token's update."""
    mor_causal: Literal["aux_loss", "aux_router"] = applies(when("model.mor", "expert_choice"), default="aux_loss")
    """expert_choice at inference, where a top-k over the sequence would read the future: a token continues
    while sigmoid(router logit) > 0.5 (aux_loss: the router itself, trained towards the top-k choice by a BCE
    loss) or while a separate auxiliary router on the detached state says so (aux_router, trained by that loss)."""
    mor_cache: Literal["recursion_wise", "shared_first"] = applies(unless("model.mor", "none"), default="recursion_wise")
    """Which earlier tokens a routed round attends to: recursion_wise = only tokens that entered that round;
    shared_first = every token's round-1 keys/values (and the query's own). Changes the function trained."""
    kv_sharing: Literal["none", "first"] = applies(when("model.mor", "none"), default="none")
    """Which keys/values a core round attends to for earlier tokens: none = that round's own (the plain loop);
    first = round 1's at every round, the query's own entry being its round's (Mixture-of-Recursions' recursive
    sharing, the rule of mor_cache = shared_first without a router). Later rounds then read a memory that stays
    put while every position goes on with its own rounds; it changes the function trained, and the decoder
    keeps one core cache slot instead of one per round (prompt and generated tokens under cache policy
    first). With model.mor, mor_cache says it."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "context"):
            _check(getattr(self, name) >= 1, f"model.{name}", "must be >= 1")
        for name in ("n_prelude", "n_coda"):
            _check(getattr(self, name) >= 0, f"model.{name}", "must be >= 0")
        _check(self.n_core >= 1, "model.n_core", "must be >= 1 (the loop needs a core)")
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _check(self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0,
               "model.n_kv_heads", f"must divide n_heads={self.n_heads}")
        if self.head_dim == 0:
            _check(self.d_model % self.n_heads == 0, "model.head_dim",
                   "set it explicitly when d_model is not a multiple of n_heads")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        _check(self.head_dim >= 2 and self.head_dim % 2 == 0, "model.head_dim", "must be even and >= 2 (RoPE)")
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 32 * math.ceil(8 * self.d_model / 3 / 32))
        _check(self.ffn_hidden >= 1, "model.ffn_hidden", "must be >= 1")
        _check(self.init_state_std >= 0, "model.init_state_std", "must be >= 0")
        _check(self.deeploop_p >= 0 and math.isfinite(self.deeploop_p), "model.deeploop_p", "must be finite and >= 0")
        _check(self.rope_base > 0, "model.rope_base", "must be > 0")
        _check(self.rope_factor >= 1 and math.isfinite(self.rope_factor), "model.rope_factor", "must be finite and >= 1")
        _check(0 < self.rope_low_freq_factor < self.rope_high_freq_factor, "model.rope_low_freq_factor",
               f"must be > 0 and below rope_high_freq_factor = {self.rope_high_freq_factor}")
        _check(self.rope_original_context >= 1, "model.rope_original_context", "must be >= 1")
        _check(self.attn_scale >= 0 and math.isfinite(self.attn_scale), "model.attn_scale",
               "must be finite and >= 0 (0 = 1/sqrt(head_dim))")
        _check(self.embed_scale > 0 and math.isfinite(self.embed_scale), "model.embed_scale", "must be finite and > 0")
        _check(self.local_rope_base >= 0 and math.isfinite(self.local_rope_base), "model.local_rope_base",
               "must be finite and >= 0 (0 = none)")
        n_blocks = self.n_prelude + self.n_core + self.n_coda
        _check(not self.local_rope_base or self.local_blocks, "model.local_rope_base",
               "names blocks in model.local_blocks that use it (with none it would change nothing)")
        _check(all(0 <= b < n_blocks for b in self.local_blocks) and len(set(self.local_blocks)) == len(self.local_blocks),
               "model.local_blocks", f"must be distinct block positions in 0..{n_blocks - 1} (prelude, core, coda)")
        _check(self.norm_eps > 0, "model.norm_eps", "must be > 0")
        _check(self.init_std > 0, "model.init_std", "must be > 0")
        _check(0 < self.injection_decay_init < 1, "model.injection_decay_init", "must lie strictly between 0 and 1")
        _check(0 < self.round_eta <= 1, "model.round_eta", "must lie in (0, 1]")
        _check(self.round_substeps >= 2, "model.round_substeps", "must be >= 2 (1 sub-step is round_update = plain)")
        _check(self.injection != "none" or self.init_state == "prelude", "model.injection",
               'none needs init_state = "prelude" (otherwise the core never sees the input)')
        _check(self.moe_experts >= 0, "model.moe_experts", "must be >= 0 (0 = a dense FFN)")
        if self.moe_experts:
            _check(1 <= self.moe_top_k <= self.moe_experts, "model.moe_top_k",
                   f"must lie in 1..moe_experts = {self.moe_experts}")
            if self.moe_hidden == 0:
                object.__setattr__(self, "moe_hidden", self.ffn_hidden)
            _check(self.moe_hidden >= 1, "model.moe_hidden", "must be >= 1 (0 = ffn_hidden)")
        if self.mor == "expert_choice":
            _check(self.mor_alpha > 0 and math.isfinite(self.mor_alpha), "model.mor_alpha", "must be finite and > 0")
            c = self.mor_capacity
            _check(all(0 < x <= 1 for x in c) and all(a >= b for a, b in zip(c, c[1:])) and (not c or c[0] == 1),
                   "model.mor_capacity", "must start at 1, never increase, and lie in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class DepthConfig:
    kind: Literal["fixed", "uniform", "lognormal_poisson", "geometric"] = "fixed"
    """How many rounds each training step runs: fixed, uniform on {min..max}, Huginn's log-normal Poisson, or
    geometric (stochastic stopping: from round min on, after each round the loop stops with probability
    stop_prob, at the latest after max)."""
    rounds: int = 4
    """Rounds for kind = fixed; also the default rounds at evaluation and generation."""
    min: int = applies(unless("depth.kind", "fixed"), default=1)
    """Smallest sampled depth (uniform; lower clamp for lognormal_poisson)."""
    max: int = applies(unless("depth.kind", "fixed"), default=8)
    """Largest sampled depth (uniform; cap for lognormal_poisson)."""
    mean: float = applies(when("depth.kind", "lognormal_poisson"), default=4.0)
    """Mean depth r-bar of the log-normal Poisson sampler (Huginn: 32)."""
    sigma: float = applies(when("depth.kind", "lognormal_poisson"), default=0.5)
    """Log-normal sigma of the sampler (Huginn: 0.5)."""
    stop_prob: float = applies(when("depth.kind", "geometric"), default=0.25)
    """geometric: the chance of stopping after each round from depth.min on (mean depth min + (1-p)/p before
    the cap at max)."""
    ramp_fraction: float = applies(unless("depth.kind", "fixed"), default=0.0)
    """Depth curriculum: over the first ramp_fraction of train.steps the sampler's depth grows from depth.min
    to its full setting (0 = off): lognormal_poisson's mean and every kind's cap max are interpolated by the
    ramp (max rounded up), so early steps run shallow loops (McLeish et al.'s retrofit schedule)."""
    ramp_shape: Literal["linear", "1-sqrt"] = applies(unless("depth.ramp_fraction", 0.0), default="linear")
    """The ramp's shape in its phase t in [0, 1]: linear t, or 1 - sqrt(1 - t) (slow at first, fastest at the
    end of the ramp)."""

    def __post_init__(self) -> None:
        _check(self.rounds >= 1, "depth.rounds", "must be >= 1")
        _check(self.min >= 1, "depth.min", "must be >= 1")
        _check(self.sigma >= 0, "depth.sigma", "must be >= 0 (a standard deviation)")
        if self.kind != "fixed":
            _check(self.max >= self.min, "depth.max", f"must be >= depth.min={self.min}")
            _check(self.min <= self.rounds <= self.max, "depth.rounds",
                   f"must lie in depth.min..depth.max = {self.min}..{self.max} (it is the default inference depth)")
        if self.kind == "lognormal_poisson":
            _check(self.mean >= 1, "depth.mean", "must be >= 1 (rounds = Poisson(rate) + 1)")
        _check(0 < self.stop_prob <= 1, "depth.stop_prob", "must lie in (0, 1] (a probability of stopping)")
        _check(0 <= self.ramp_fraction <= 1, "depth.ramp_fraction", "must lie in [0, 1] (a share of train.steps)")

    @property
    def max_rounds(self) -> int:
        return self.rounds if self.kind == "fixed" else self.max

    @property
    def min_rounds(self) -> int:
        return self.rounds if self.kind == "fixed" else self.min


@dataclass(frozen=True, kw_only=True)
class BackwardConfig:
    window: Union[int, Literal["all"]] = "all"
    """Gradients pass through only the last `window` rounds, or "all". Earlier rounds run without gradient (the state entering the window is a constant); a supervised readout or gate hazard at a round before the window trains only the coda, head and gate, never the core or prelude. Recorded per step as the rounds autograd reaches."""

    def __post_init__(self) -> None:
        if self.window != "all":
            _check(self.window >= 1, "backward.window", 'must be >= 1 or "all"')


@dataclass(frozen=True, kw_only=True)
class SupervisionConfig:
    kind: Literal["final", "rounds", "every", "learned_exit", "act_mixture"] = applies(
        STAGE_1, unless("data.depth_by_difficulty", True), default="final")
    """Loss placement: final round only; chosen rounds with weights; every round run; learned exit distribution
    (Ouro: exit masses weight the rounds' losses); act_mixture (ACT: one loss on the exit-mass mixture of the
    rounds' output probabilities, with learned_exit's regulariser; needs exit.gate). Stage II trains only the gate on its own loss, and data.depth_by_difficulty supervises every round
    from the example's difficulty on, so neither reads this section's placement fields."""
    rounds: tuple[int, ...] = applies(when("supervision.kind", "rounds"), default=())
    """Rounds read out for kind = rounds (1-based). Rounds beyond a step's sampled depth are skipped that step."""
    weights: tuple[float, ...] = applies(when("supervision.kind", "rounds"), default=())
    """One weight per entry of rounds; empty = equal weights. Losses are combined as sum(w*L)/sum(w)."""
    entropy_beta: float = applies(when("supervision.kind", *GATE_KINDS), default=0.05)
    """learned_exit, act_mixture: weight of the entropy bonus (prior = none) or of KL(p || prior)."""
    prior: Literal["none", "uniform", "geometric"] = applies(when("supervision.kind", *GATE_KINDS), default="none")
    """learned_exit, act_mixture regulariser: entropy bonus (none) or KL to a uniform or geometric prior
    (PonderNet)."""
    geometric_lambda: float = applies(when("supervision.kind", *GATE_KINDS), when("supervision.prior", "geometric"),
                                      default=0.5)
    """Hazard of the geometric prior."""
    moe_balance: float = applies(unless("model.moe_experts", 0), STAGE_1, default=0.01)
    """LoopMoE: weight of the load-balance loss E * sum_i f_i P_i (1 when the experts are used evenly),
    averaged over every MoE visit of the unrolled depth and added to the training loss."""
    moe_z: float = applies(unless("model.moe_experts", 0), STAGE_1, default=0.001)
    """LoopMoE: weight of the router z-loss mean(logsumexp(router logits)^2), averaged the same way."""
    mor_balance: float = applies(when("model.mor", "token_choice"), default=0.01)
    """Mixture-of-Recursions: weight of the depth-balance loss R * sum_i f_i P_i (1 when every depth gets
    the same share of tokens)."""
    mor_z: float = applies(unless("model.mor", "none"), default=0.0)
    """Mixture-of-Recursions: weight of the router z-loss mean(logsumexp(router logits)^2)."""
    mor_bias_rate: float = applies(when("model.mor", "token_choice"), default=0.0)
    """Mixture-of-Recursions loss-free balancing: after every optimizer step each depth's selection bias moves
    by this much towards an even load (0 = off; use with mor_balance = 0 for balancing without a loss)."""
    mor_aux: float = applies(when("model.mor", "expert_choice"), default=0.01)
    """Mixture-of-Recursions, expert choice: weight of the BCE loss that trains the causal decision (the router's
    logits, or the auxiliary router's) towards each round's top-k selection."""
    fixed_point: float = applies(STAGE_1, default=0.0)
    """Depth safety, a terminal fixed-point objective: weight of the state-change term added to the loss,
    the mean over positions and over the last fixed_point_rounds rounds r (r >= 2) of
    ||s_r - s_(r-1)||^2 / (||s_(r-1)||^2 + 1e-6 d), so the state the readout is trained on is one more
    rounds would not move (model/losses.fixed_point_term). 0 = off."""
    fixed_point_rounds: int = applies(unless("supervision.fixed_point", 0.0), default=1)
    """How many of a step's final rounds the fixed-point term reads (a step of R rounds: rounds
    max(2, R - k + 1)..R; a one-round step has no term)."""

    def __post_init__(self) -> None:
        if self.kind == "rounds":
            _check(len(self.rounds) > 0, "supervision.rounds", "must list at least one round when kind = rounds")
        _check(all(r >= 1 for r in self.rounds), "supervision.rounds", "rounds are 1-based and must be >= 1")
        _check(len(set(self.rounds)) == len(self.rounds), "supervision.rounds", "must not repeat a round")
        if self.weights and self.kind == "rounds":
            _check(len(self.weights) == len(self.rounds), "supervision.weights",
                   f"must have one weight per supervised round ({len(self.rounds)}), got {len(self.weights)}")
            _check(all(w >= 0 and math.isfinite(w) for w in self.weights) and sum(self.weights) > 0,
                   "supervision.weights", "must be finite, >= 0, and not all zero")
        _check(self.entropy_beta >= 0, "supervision.entropy_beta", "must be >= 0")
        _check(0 < self.geometric_lambda < 1, "supervision.geometric_lambda", "must lie in (0, 1)")
        _check(self.moe_balance >= 0 and math.isfinite(self.moe_balance), "supervision.moe_balance",
               "must be finite and >= 0")
        _check(self.moe_z >= 0 and math.isfinite(self.moe_z), "supervision.moe_z", "must be finite and >= 0")
        _check(self.fixed_point_rounds >= 1, "supervision.fixed_point_rounds", "must be >= 1")
        for name in ("mor_balance", "mor_z", "mor_bias_rate", "mor_aux", "fixed_point"):
            v = getattr(self, name)
            _check(v >= 0 and math.isfinite(v), f"supervision.{name}", "must be finite and >= 0")

    @property
    def round_weights(self) -> tuple[float, ...]:
        return self.weights or tuple(1.0 for _ in self.rounds)


@dataclass(frozen=True, kw_only=True)
class ExitConfig:
    gate: bool = applies(Condition(("supervision.kind", "train.stage"), lambda kind, stage: kind in GATE_KINDS
                                   or stage == 2, 'supervision.kind is "learned_exit" or "act_mixture" or '
                                   "train.stage is 2 (the only losses that reach the gate)"), default=False)
    """Give the model an exit gate (dense + sigmoid of the state per round). Required by learned_exit, act_mixture
    and stage II,
    the only losses that train it; anywhere else it would stay at its initialisation."""
    policy: str = "fixed"
    """Default inference exit policy: fixed (all rounds), fixed:R, quantile:Q, entropy:TAU or kl:EPS."""
    min_rounds: int = 1
    """Never exit before this round (<= the largest forward depth: depth.rounds, or depth.max when sampled)."""
    exit_in_prefill: bool = False
    """Allow early exit while processing the prompt (Huginn does not by default)."""

    def __post_init__(self) -> None:
        _check(self.min_rounds >= 1, "exit.min_rounds", "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    path: str = applies(TEXT_DATA, default="")
    """Language-model data: a text file or folder of text files, a .jsonl file, a .parquet file or folder of them, a saved datasets folder, or a `looplm data prepare` folder; empty = the embedded corpus (this Python's stdlib source)."""
    text_field: str = applies(TEXT_DATA, unless("data.path", ""), default="text")
    """The JSONL key or the parquet / datasets column holding each document's text; plain text has no fields and refuses another value."""
    task: str = ""
    """A built-in task generator name or a JSONL path of {prompt, answer} lines (see docs/tasks.md)."""
    tokenizer: Literal["byte", "bpe", "pretrained"] = "byte"
    """Byte-level (257 ids), a BPE trained locally on the training split with model.vocab_size ids, or
    pretrained: the tokenizer of the run training starts from (`looplm train --init RUN`, e.g. an imported
    Hugging Face model's own), used as it is."""
    max_bytes: int = applies(TEXT_DATA, default=2_000_000)
    """Read at most this many bytes of text (whole documents)."""
    val_fraction: float = applies(Condition(("data.task",), lambda t: not _builtin_task(t), "data.task is empty or a JSONL file"),
                                  default=0.05)
    """Fraction of documents held out for validation (split by document, never inside one)."""
    seq_len: int = applies(TEXT_DATA, default=128)
    """Training sequence length (<= model.context); task data is as long as its prompts."""
    difficulty_min: int = applies(TASK_DATA, default=1)
    """Task data: smallest training difficulty of a built-in task (hops, overwrites, digits...)."""
    difficulty_max: int = applies(TASK_DATA, default=4)
    """Task data: largest training difficulty of a built-in task."""
    task_length: int = applies(LENGTH_DIALS, default=0)
    """Task data: statements/items per prompt, the same at every difficulty (distractors pad); 0 = the task's default at eval_difficulty_max. A JSONL file (with data.length_unit): the longest training prompt in that unit; 0 = the file's longest."""
    train_length_min: int = applies(LENGTH_DIALS, default=0)
    """Task data: 0 = every training prompt has task_length items; else each micro-batch draws its length uniformly from max(this, the difficulty's minimum)..task_length (evaluation always uses task_length). A JSONL file (with data.length_unit) selects its lines by length instead: 0 = lines of exactly task_length (0: every line); else each micro-batch draws one length uniformly among the difficulty's line lengths in that window and trains on lines of it (evaluation uses every held-out line)."""
    length_unit: Literal["", "tokens", "items"] = applies(JSONL_TASK, default="")
    """Task data, a JSONL file: the unit its prompt lengths are counted in for task_length, train_length_min and length_curriculum: tokens (the prompt's tokens as written) or items (non-blank pieces of the prompt split at data.item_separator); empty = no length dials (prompts used as written)."""
    item_separator: str = applies(JSONL_TASK, Condition(("data.length_unit", "data.crop_curriculum", "data.round_targets"),
                                                        lambda unit, crop, targets: unit == "items" or crop > 0
                                                        or targets == "query_trace",
                                                        'data.length_unit is "items", data.crop_curriculum > 0 or '
                                                        'data.round_targets is "query_trace"'),
                                  default="")
    """Task data, data.length_unit = "items", data.crop_curriculum or data.round_targets = "query_trace": the string between a prompt's statements (e.g. "; " or "\\n"); the last item is the query."""
    warmup_steps: int = applies(TASK_DATA, default=0)
    """Task data: the first this many steps train only difficulty_min, on the shortest prompts when train_length_min is set, so the basic lookup forms where it is easiest to find."""
    curriculum: float = applies(TASK_DATA, default=0.0)
    """Task data: fraction of train.steps, after warmup_steps, over which the largest training difficulty grows from difficulty_min to difficulty_max (0 = all at once)."""
    length_curriculum: float = applies(LENGTH_DIALS, unless("data.train_length_min", 0), default=0.0)
    """Task data: with train_length_min, fraction of train.steps, after warmup_steps, over which the longest training prompt grows from the shortest to task_length (0 = all lengths at once)."""
    crop_curriculum: float = applies(JSONL_TASK, default=0.0)
    """Task data, a JSONL file with "trace" lines: build shorter training prompts from the file's own lines, split into items (statements) at data.item_separator. An item is needed when it is the prompt's last (the query) or a statement the chase follows: for each hop, from the queried name (the one word of the last item another item names) through the trace to the answer, an item naming both ends as whole words (a tree hanging into the chain, or a statement pointing at the answer's value, is not needed); each micro-batch draws q uniformly from [0, progress] and each line keeps round(q x m) of its m other items, in order (warm-up: none), progress growing from 0 to 1 over this fraction of train.steps after warmup_steps (0 = prompts as written). For files of one prompt length, where data.length_curriculum has nothing to grow."""
    separator: bool = applies(TASK_DATA, default=True)
    """Task data: end each prompt with tasks.SEPARATOR before the answer; false reads the answer off the prompt's last token (built-in prompts end with their query), one attention composition fewer to learn."""
    depth_by_difficulty: bool = applies(TASK_DATA, default=False)
    """Task data: each micro-batch holds one difficulty d; its rounds are drawn uniformly from max(d, depth.min)..depth.max (max(d + 1, depth.min) with round_targets = query_trace) and every round from d on is supervised (overrides depth.kind and supervision; an untied model runs its fixed depth)."""
    round_targets: Literal["answer", "trace", "query_trace"] = applies(TASK_DATA, default="answer")
    """Task data: what a supervised round reads out. answer: the answer at every supervised round. trace: a k-step example trains round r < k on its intermediate result after r steps (chain: the name reached after r hops; a JSONL line: its "trace" list; an entry of several tokens is trained as the bag of its tokens, 1/n each) at the position of each of the answer's own tokens (each runs its own loop, and an answer of several tokens is told apart at its later ones; not at the answer's end mark), and rounds from k on (and always the final round run) on the answer; with depth_by_difficulty every round from 1 is supervised. query_trace: as trace, one round later, and round 1 reads out the name the prompt asks about (chain: the queried name; a JSONL line: the one word of its last item, split at data.item_separator, that another item names; where no word is, the one run of its other visible characters that another item names, not run into letters, digits or _, for names written in symbols), so every later round turns the name it holds into the next one; a k-step example needs k + 1 rounds (depth_by_difficulty runs at least that many)."""
    eval_difficulty_max: int = applies(TASK_DATA, default=0)
    """Task data: largest evaluated difficulty; 0 = 2 x difficulty_max."""
    eval_rounds_max: int = applies(TASK_DATA, default=0)
    """Task data: largest evaluated round count; 0 = 2 x the largest training depth."""
    eval_examples: int = applies(TASK_DATA, default=200)
    """Task data: held-out examples per difficulty for exact-match accuracy."""
    probe_examples: int = applies(TASK_DATA, default=1000)
    """Experiment: examples per probed difficulty for the linear probes (half fit, half test); 0 = no probes."""
    baselines: tuple[str, ...] = applies(TASK_DATA, default=("untied_same_params", "untied_same_compute"))
    """Experiment: models trained beside the looped one: untied_same_params, untied_same_compute, lstm."""

    @property
    def traced(self) -> bool:
        """Whether rounds before the answer read out intermediate results (round_targets trace or query_trace)."""
        return self.round_targets in ("trace", "query_trace")

    @property
    def answer_round_offset(self) -> int:
        """Rounds before a k-step example's answer beyond its k - 1 trace entries: 1 with query_trace (round 1
        reads out the queried name), else 0."""
        return 1 if self.round_targets == "query_trace" else 0

    def __post_init__(self) -> None:
        _check(self.max_bytes >= 1000, "data.max_bytes", "must be >= 1000")
        _check(bool(self.text_field), "data.text_field", "must name a key or column (not empty)")
        _check(0 < self.val_fraction < 1, "data.val_fraction", "must lie in (0, 1)")
        _check(self.seq_len >= 2, "data.seq_len", "must be >= 2")
        _check(self.difficulty_min >= 0, "data.difficulty_min", "must be >= 0")
        _check(self.difficulty_max >= self.difficulty_min, "data.difficulty_max",
               f"must be >= data.difficulty_min ({self.difficulty_min})")
        _check(self.task_length >= 0, "data.task_length", "must be >= 0 (0 = the task's default)")
        _check(self.train_length_min >= 0, "data.train_length_min", "must be >= 0 (0 = always task_length)")
        _check(0 <= self.curriculum <= 1, "data.curriculum", "must lie in [0, 1] (a fraction of train.steps)")
        _check(0 <= self.length_curriculum <= 1, "data.length_curriculum", "must lie in [0, 1] (a fraction of train.steps)")
        _check(0 <= self.crop_curriculum <= 1, "data.crop_curriculum", "must lie in [0, 1] (a fraction of train.steps)")
        _check(not self.crop_curriculum or bool(self.item_separator) or not self.task or _builtin_task(self.task),
               "data.item_separator",
               "must be set for data.crop_curriculum (the string between a prompt's statements, e.g. \" \" or \"; \")")
        _check(self.warmup_steps >= 0, "data.warmup_steps", "must be >= 0")
        _check(self.round_targets != "query_trace" or bool(self.item_separator) or not self.task
               or _builtin_task(self.task), "data.item_separator",
               'must be set for data.round_targets = "query_trace" with a JSONL file (the string between a prompt\'s '
               'statements: its last item holds the queried name)')
        _check(self.length_unit != "items" or bool(self.item_separator), "data.item_separator",
               'must name the string between a prompt\'s statements when data.length_unit = "items"')
        _check(self.eval_difficulty_max == 0 or self.eval_difficulty_max >= self.difficulty_min,
               "data.eval_difficulty_max", f"must be 0 (= 2 x difficulty_max) or >= data.difficulty_min ({self.difficulty_min})")
        _check(self.eval_rounds_max >= 0, "data.eval_rounds_max", "must be >= 0 (0 = 2 x the largest training depth)")
        _check(self.eval_examples >= 1, "data.eval_examples", "must be >= 1")
        _check(self.probe_examples == 0 or self.probe_examples >= 4, "data.probe_examples", "must be 0 (off) or >= 4")
        known = ("untied_same_params", "untied_same_compute", "lstm")
        for b in self.baselines:
            _check(b in known, "data.baselines", f"entries must be among {', '.join(known)}; got {b!r}")
        _check(len(set(self.baselines)) == len(self.baselines), "data.baselines", "must not repeat an entry")
        _check(not self.task or self.tokenizer == "byte", "data.tokenizer",
               'must be "byte" when data.task is set (one token per name and digit)')


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    optimizer: Literal["adamw", "muon"] = "adamw"
    """AdamW on every parameter, or Muon (torch.optim.Muon: momentum orthogonalised by Newton-Schulz) on the
    blocks' and the adapter's 2-D weights with AdamW on the rest (embeddings, head, norms, biases, routers,
    gates, 3-D expert weights); report.json's `optimizer` counts what each holds (train/optim.py)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    muon_lr: float = applies(when("optim.optimizer", "muon"), default=0.02)
    """Muon's peak learning rate; the schedule (warmup, decay) scales it as it scales lr."""
    muon_momentum: float = applies(when("optim.optimizer", "muon"), default=0.95)
    """Muon's (Nesterov) momentum."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = applies(when("optim.optimizer", "muon"),
                                                                     default="original")
    """Muon's per-matrix learning-rate scale: sqrt(max(1, rows/cols)) (Keller Jordan's), or 0.2 sqrt(max(rows,
    cols)) so the update's RMS matches AdamW's and AdamW's learning rate carries over (Moonshot's)."""
    min_lr_ratio: float = applies(unless("optim.schedule", "constant"), default=0.1)
    """Final learning rate as a fraction of lr."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Warmup then cosine decay, warmup-stable-decay, or constant after warmup."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    decay_fraction: float = applies(when("optim.schedule", "wsd"), default=0.2)
    """wsd: fraction of steps spent in the final linear decay."""
    weight_decay: float = 0.1
    """AdamW decay on matrices; norms, biases and embeddings get none."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", "must be > 0")
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must lie in [0, 1]")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _check(0 <= self.decay_fraction <= 1, "optim.decay_fraction", "must lie in [0, 1]")
        _check(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1", "betas must lie in [0, 1)")
        _check(self.eps > 0, "optim.eps", "must be > 0")
        _check(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0")
        _check(self.muon_lr > 0, "optim.muon_lr", "must be > 0")
        _check(0 <= self.muon_momentum < 1, "optim.muon_momentum", "must lie in [0, 1)")


FEEDBACK = unless("feedback.mode", "none")


@dataclass(frozen=True, kw_only=True)
class FeedbackConfig:
    mode: Literal["none", "gate", "add", "concat"] = "none"
    """Full-bandwidth feedback (model/feedback.py): the previous position's top state h (after the final norm)
    fused with the token's embedding e into the model's bottom input, before the prelude. gate (the
    Full-Bandwidth Transformer's): (W_u h) * sigmoid(W_g e), 2*d^2 weights; add: e + W_u h, d^2; concat:
    W_c [e; h], 2*d^2. Three different mechanisms, not settings of one. none: no feedback."""
    norm: bool = applies(FEEDBACK, default=False)
    """RMSNorm around the fusion: on h before it enters, and on the fused vector."""
    jitter: float = applies(FEEDBACK, default=0.0)
    """Std of uniform noise added to the fused input in training (0.02 in the Full-Bandwidth Transformer);
    0 = none. Never at evaluation or inference."""
    reset_at_eos: bool = applies(FEEDBACK, default=True)
    """The start convention: a window's first position always reads its plain embedding (there is no previous
    state); with this, so does the token after an end-of-text token (a document never reads the last one's)."""
    passes: tuple[float, ...] = applies(FEEDBACK, default=(0.0, 1.0))
    """Training's pass-count mixture: passes[k - 1] is the share of micro-batches trained with k parallel passes
    (pass 1 from the embeddings, pass k from pass k - 1's top states shifted by one position, gradients kept
    through the earlier passes), drawn per micro-batch from (seed, step). (0.75, 0.22, 0.03): 1.28 passes on
    average. Default: always two."""
    later_weight: float = applies(FEEDBACK, default=1.0)
    """lambda: loss = first pass's loss + lambda * the mean of the later passes' losses."""
    mix_from_step: int = applies(FEEDBACK, default=0)
    """Steps before this train with one plain pass (no feedback): plain pre-training first."""
    prefix_mix: float = applies(FEEDBACK, default=0.0)
    """Share of micro-batches with a plain prefix of random length: fusion on the suffix only (a prompt read
    plainly, then feedback, as the soft prompt mode decodes)."""

    def __post_init__(self) -> None:
        _check(len(self.passes) >= 1 and all(p >= 0 and math.isfinite(p) for p in self.passes)
               and abs(sum(self.passes) - 1) < 1e-6, "feedback.passes",
               "must be shares of 1, 2, 3, ... passes: non-negative, summing to 1")
        _check(self.jitter >= 0 and math.isfinite(self.jitter), "feedback.jitter", "must be finite and >= 0")
        _check(self.later_weight >= 0 and math.isfinite(self.later_weight), "feedback.later_weight",
               "must be finite and >= 0")
        _check(self.mix_from_step >= 0, "feedback.mix_from_step", "must be >= 0")
        _check(0 <= self.prefix_mix <= 1, "feedback.prefix_mix", "must lie in [0, 1]")

    @property
    def mean_passes(self) -> float:
        return sum((k + 1) * p for k, p in enumerate(self.passes))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 16
    """Sequences per micro-batch, over all processes: with N processes each computes batch_size / N of
    them (it must divide), so a recipe means the same global batch at any world size."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (each draws its own depth)."""
    seed: int = 0
    """Seeds weights, data windows and depth draws (depth and data are functions of (seed, step))."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Mixed precision: bf16 or fp16 run the forward pass under autocast on the training device (fp16 with
    a gradient scaler); weights and optimizer stay fp32."""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """Where to train: auto = cuda when available, else cpu (mps only when asked). Recorded in report.json."""
    compile: bool = False
    """Wrap the model in torch.compile for training, from outside the model (the saved weights are the
    plain module's). The first steps of each new depth pay the compilation."""
    parallel: Literal["none", "ddp", "fsdp"] = "none"
    """Several processes (`torchrun --nproc-per-node N -m looplm train`): ddp replicates the model and
    all-reduces gradients; fsdp shards parameters, gradients and optimizer state with FSDP2 (each
    prelude, core and coda block a unit). Applied from outside the model; docs/distributed.md."""
    activation_checkpointing: bool = applies(STAGE_1, default=False)
    """Keep no activations inside core blocks during the forward: each core block visit in the backward
    window is recomputed in the backward (torch.utils.checkpoint, non-reentrant), applied from outside
    the model. Trades about one more core forward per step for memory; the numbers are unchanged."""
    alignment_every: int = applies(STAGE_1, default=0)
    """Every N steps (0 = never), measure DeepLoop's alignment of the shared core's per-visit gradients on
    the step's first micro-batch: ||sum_r g_r||^2 / sum_r ||g_r||^2 (1 decorrelated .. R coherent) and
    the visits' pairwise cosines, into metrics.jsonl. Each measurement costs one more forward and
    backward with R copies of the core (train/alignment.py)."""
    mor_warmup_steps: int = applies(unless("model.mor", "none"), default=0)
    """Mixture-of-Recursions: for this many first steps every token runs every round with weight 1 (the plain
    loop), then the router decides."""
    tensorboard: bool = False
    """Also write every metrics.jsonl row as TensorBoard scalars under RUN/tensorboard/ (the same numbers,
    the same names; runs/tensorboard.py). Needs the tensorboard package: pip install 'looplm[tensorboard]'."""
    lockstep_check: Literal["start", "every"] = applies(unless("train.parallel", "none"), default="start")
    """With several processes: all-gather and compare every rank's forward rounds and backward window
    at the first micro-batch (start) or at every one (every: a debug mode, one small collective each)."""
    log_every: int = 10
    """Steps between metrics.jsonl lines (and progress bar updates)."""
    checkpoint_every: int = 100
    """Steps between checkpoints (one is always written at the end)."""
    eval_batches: int = applies(TEXT_DATA, default=8)
    """Language-model data: validation batches for val_loss_by_rounds (a task run scores data.eval_examples
    held-out examples per difficulty instead)."""
    threads: int = 0
    """torch CPU threads (0 = torch default)."""
    freeze_outer_steps: int = applies(STAGE_1, default=0)
    """For the first N optimizer steps only the loop learns: the embedding, prelude, coda, final norm and LM head
    have their gradients dropped before the step (neither AdamW nor Muon moves or decays them; their backward
    still runs and is counted). A retrofit's first phase, while the shared core and the adapter adapt to
    being looped. report.json's outer_frozen_steps counts the steps that froze them."""
    stage: Literal[1, 2] = 1
    """1: train everything; 2: freeze the LM and train only the exit gate (Ouro stage II)."""
    stage2_k: float = applies(when("train.stage", 2), default=50.0)
    """Stage II: sharpness k of the continuation target sigmoid(k*(I - gamma))."""
    stage2_gamma: float = applies(when("train.stage", 2), default=0.005)
    """Stage II: loss improvement gamma below which continuing is not worth it."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "log_every", "checkpoint_every", "eval_batches"):
            _check(getattr(self, name) >= 1, f"train.{name}", "must be >= 1")
        _check(self.threads >= 0, "train.threads", "must be >= 0")
        _check(self.freeze_outer_steps >= 0, "train.freeze_outer_steps", "must be >= 0")
        _check(self.mor_warmup_steps >= 0, "train.mor_warmup_steps", "must be >= 0")
        _check(self.alignment_every >= 0, "train.alignment_every", "must be >= 0 (0 = never)")
        _check(not (self.alignment_every and self.parallel == "fsdp"), "train.alignment_every",
               "is measured on a whole copy of the model, not with train.parallel = fsdp (use ddp or none)")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str = "custom"
    """A label for reports."""
    model: ModelConfig = field(default_factory=ModelConfig)
    depth: DepthConfig = field(default_factory=DepthConfig)
    backward: BackwardConfig = field(default_factory=BackwardConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    exit: ExitConfig = field(default_factory=ExitConfig)
    data: DataConfig = field(default_factory=DataConfig)
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        """Checks that span sections."""
        for item in inapplicable(self.to_dict()):
            raise UserError(f"recipe field {item.key}: {item.message}")
        max_r = self.depth.max_rounds
        if self.backward.window != "all":
            _check(self.backward.window <= max_r, "backward.window",
                   f"must be <= the largest forward depth ({max_r}) or \"all\"")
        if self.supervision.rounds:
            _check(max(self.supervision.rounds) <= max_r, "supervision.rounds",
                   f"must be <= the largest forward depth ({max_r}); got {max(self.supervision.rounds)}")
        _check(self.exit.min_rounds <= max_r, "exit.min_rounds",
               f"must be <= the largest forward depth ({max_r}); got {self.exit.min_rounds}")
        if self.supervision.kind in GATE_KINDS:
            _check(self.exit.gate, "exit.gate", f"must be true when supervision.kind = {self.supervision.kind}")
        if self.train.stage == 2:
            _check(self.exit.gate, "exit.gate", "must be true for train.stage = 2 (only the gate trains)")
        if self.data.traced:
            t = self.data.round_targets
            _check(bool(self.data.task), "data.round_targets", f'"{t}" needs task data (data.task)')
            _check(self.supervision.kind not in GATE_KINDS and self.train.stage == 1, "data.round_targets",
                   f'"{t}" needs per-round supervision: not supervision.kind = learned_exit or act_mixture or '
                   'train.stage = 2')
        if self.model.mor != "none":
            _check(self.depth.kind == "fixed", "model.mor", "needs depth.kind = fixed (the router picks among "
                   "depth.rounds depths)")
            _check(not self.model.untied, "model.mor", "needs a shared core (model.untied = false)")
            _check(not self.exit.gate and self.exit.policy == "fixed", "model.mor",
                   "decides each token's depth itself: needs exit.gate = false and exit.policy = fixed")
            _check(self.supervision.kind == "final", "model.mor",
                   "reads each token out once, after its routed depth: needs supervision.kind = final")
            _check(not self.train.alignment_every, "train.alignment_every",
                   "measures an unrouted core's visits; not available with model.mor")
            if self.model.mor == "expert_choice":
                R = self.depth.rounds
                if not self.model.mor_capacity:      # MoR's schedule (N - i) / N: 1, 2/3, 1/3 at N = 3
                    capacity = tuple((R - i) / R for i in range(R))
                    object.__setattr__(self, "model", dataclasses.replace(self.model, mor_capacity=capacity))
                _check(len(self.model.mor_capacity) == R, "model.mor_capacity",
                       f"needs one share per round (depth.rounds = {R}), got {len(self.model.mor_capacity)}")
        if self.supervision.kind in GATE_KINDS or self.train.stage == 2:
            # the last round's exit is forced, so at one round no hazard reaches a loss
            _check(max_r >= 2, "exit.gate", "is trained only through the hazards of rounds before the last: "
                   f"learned_exit, act_mixture and stage II need a largest forward depth >= 2 (it is {max_r})")
        if self.feedback.mode != "none":     # what feedback's training does not cover yet: refused, not ignored
            _check(self.train.stage == 1, "feedback.mode", "has no stage II: train.stage = 1")
            _check(not self.train.alignment_every, "train.alignment_every", "measures one pass; not with feedback")
            _check(self.model.kv_sharing == "none", "model.kv_sharing",
                   "first is not implemented with full-bandwidth feedback (its engine decodes whole prompt chunks)")
        if self.optim.optimizer == "muon":
            _check(self.train.parallel != "fsdp", "optim.optimizer", "muon orthogonalises whole matrices; FSDP "
                   'shards them across processes: use train.parallel = "ddp" or "none" with muon')
            _check(self.train.stage == 1, "optim.optimizer", "muon updates block matrices; stage II trains only "
                   'the exit gate: use "adamw"')
        if self.data.depth_by_difficulty:
            _check(not self.depth.ramp_fraction, "depth.ramp_fraction", "ramps the recipe's depth sampler; "
                   "data.depth_by_difficulty draws each micro-batch's rounds from its difficulty instead")
            _check(self.depth.kind in ("fixed", "uniform"), "data.depth_by_difficulty",
                   'draws each micro-batch\'s rounds uniformly (or runs depth.rounds): needs depth.kind = "fixed" '
                   f'or "uniform", not "{self.depth.kind}"')
        if self.model.untied:
            _check(not self.train.alignment_every, "train.alignment_every",
                   "needs a shared core; the untied baseline has one block per visit")
            _check(self.depth.kind == "fixed", "model.untied",
                   "needs depth.kind = fixed (an untied stack has one block per visit)")
        if not self.data.task:     # task data is as long as its prompts (refused beyond the context)
            _check(self.data.seq_len <= self.model.context, "data.seq_len",
                   f"must be <= model.context ({self.model.context})")
        if self.data.tokenizer == "byte":
            _check(self.model.vocab_size >= 257, "model.vocab_size", "must be >= 257 for the byte tokenizer")
        else:
            _check(self.model.vocab_size >= 300, "model.vocab_size", "must be >= 300 for a BPE tokenizer")
        from ..halting import parse_exit_policy  # late import: halting imports nothing from here
        if self.exit.policy != "fixed":
            policy = parse_exit_policy(self.exit.policy)
            if policy.kind == "quantile":
                _check(self.exit.gate, "exit.policy", "quantile needs exit.gate = true")

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())

    def replace(self, **sections: Any) -> "Recipe":
        return dataclasses.replace(self, **sections)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Recipe) if f.name != "name"}


@dataclass(frozen=True)
class Inapplicable:
    key: str
    """The field set away from its default."""
    deciding: tuple[str, ...]
    """The fields whose values make it inapplicable."""
    message: str
    """Which field(s) make it inapplicable, and what would make it apply."""


def section_classes() -> dict[str, type]:
    return {name: cls for name, cls in typing.get_type_hints(Recipe).items() if name != "name"}


def _lookup(data: dict[str, Any], key: str) -> Any:
    section, name = key.split(".")
    return data[section][name]


def inapplicable(data: dict[str, Any]) -> list[Inapplicable]:
    """Every field of a plain recipe dict (`Recipe.to_dict()`, or a partial dict: missing fields are
    their defaults) that is set away from its default where its applicability rule fails."""
    classes = section_classes()
    full = {section: {f.name: _to_plain(_default(f)) for f in dataclasses.fields(cls)}
            for section, cls in classes.items()}
    for section, values in data.items():
        if section in full and isinstance(values, dict):
            full[section].update({k: _to_plain(v) for k, v in values.items() if k in full[section]})
    out = []
    for section, cls in classes.items():
        for f in dataclasses.fields(cls):
            value, default = full[section][f.name], _to_plain(_default(f))
            if value == default:
                continue
            for cond in f.metadata.get("applies", ()):
                seen = [_lookup(full, k) for k in cond.keys]
                if not cond.test(*seen):
                    now = ", ".join(f"{k} = {_words((v,))}" for k, v in zip(cond.keys, seen))
                    out.append(Inapplicable(f"{section}.{f.name}", cond.keys,
                                            f"does not apply with {now}; it applies only when {cond.text}. "
                                            f"Leave it at its default {_words((default,)) if not isinstance(default, list) else default}"))
                    break
    return out


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


# ---------------------------------------------------------------------------------------
# Building configs from plain dicts, with types checked against the annotations.

def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(x) for x in obj]
    return obj


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return value converted to tp, or raise UserError naming key and the allowed type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
    elif origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except UserError:
                continue
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            return tuple(_coerce(v, typing.get_args(tp)[0], key) for v in value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise UserError(f"recipe field {key}: must be {_type_name(tp)}, got {value!r}")


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise UserError(f"unknown recipe key {prefix}{key}; known keys in this section: {', '.join(sorted(names))}")
        kwargs[key] = _coerce(value, hints[key], prefix + key)
    return cls(**kwargs)


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    sections: dict[str, Any] = {}
    for key, value in data.items():
        if key == "name":
            sections["name"] = _coerce(value, str, "name")
        elif key in SECTIONS:
            if not isinstance(value, dict):
                raise UserError(f"recipe section [{key}] must be a table")
            sections[key] = _build(typing.get_type_hints(Recipe)[key], value, key + ".")
        else:
            raise UserError(f"unknown recipe section {key!r}; known: name, {', '.join(SECTIONS)}")
    return Recipe(**sections)


def filled_defaults(data: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """Dotted key -> value in `recipe` of every field the recipe dict `data` does not set (a
    recipe.toml written before the field existed); values are as resolved (n_kv_heads 0 -> n_heads)."""
    out = {} if "name" in data else {"name": recipe.name}
    for section in SECTIONS:
        given = data.get(section, {})
        config = getattr(recipe, section)
        out.update({f"{section}.{f.name}": getattr(config, f.name)
                    for f in dataclasses.fields(config) if f.name not in given})
    return out


# ---------------------------------------------------------------------------------------
# TOML files, built-ins and --set overrides.

def builtin_recipes() -> dict[str, str]:
    """name -> first comment line of each built-in recipe."""
    out = {}
    for entry in sorted(resources.files("looplm.recipe.builtin").iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".toml"):
            first = entry.read_text().splitlines()[0].lstrip("# ").strip()
            out[entry.name[:-5]] = first
    return out


def read_recipe_dict(name_or_path: str) -> dict[str, Any]:
    builtin = resources.files("looplm.recipe.builtin") / f"{name_or_path}.toml"
    if builtin.is_file():
        text, where = builtin.read_text(), f"built-in recipe {name_or_path}"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            known = ", ".join(builtin_recipes())
            raise UserError(f"recipe {name_or_path!r}: no such built-in ({known}) or file")
        try:
            text, where = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"recipe {path}: cannot read ({err})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"recipe {where}: invalid TOML ({err})") from None


def parse_override(text: str) -> tuple[str, Any]:
    """'model.d_model=64' -> ('model.d_model', 64); the value is read as a TOML value, else a string."""
    if "=" not in text:
        raise UserError(f"--set {text!r}: expected key=value, e.g. model.d_model=64")
    key, raw = (s.strip() for s in text.split("=", 1))
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for key, value in overrides.items():
        parts = key.split(".")
        if len(parts) == 1 and parts[0] == "name":
            data["name"] = value
            continue
        if len(parts) != 2 or parts[0] not in SECTIONS:
            raise UserError(f"unknown recipe key {key!r}; use section.field with section in {', '.join(SECTIONS)}")
        data.setdefault(parts[0], {})[parts[1]] = value
    return data


def resolve_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(`base` with dotted overrides applied, notes). A field the base recipe sets that an override
    makes inapplicable (`--set depth.kind=fixed` on a recipe that sets depth.mean) goes back to its
    default, and a note says so, so the resolved recipe never carries a value nothing reads; an
    inapplicable field the overrides set themselves, or one the base recipe contradicts by itself, is
    left for the recipe to refuse."""
    data, notes = apply_overrides(base, overrides), []
    changed = set(overrides)
    while True:
        drop = [item for item in inapplicable(data) if item.key not in overrides
                and item.key.split(".")[1] in data.get(item.key.split(".")[0], {}) and changed & set(item.deciding)]
        if not drop:
            return data, notes
        for item in drop:
            section, name = item.key.split(".")
            value = _toml_value(_to_plain(data[section].pop(name)))
            notes.append(f"recipe: {item.key} = {value} (from the recipe) reset to its default: "
                         + item.message.split(";")[0])
            changed.add(item.key)


def derive_recipe(base: dict[str, Any], overrides: dict[str, Any], quiet: bool = False) -> Recipe:
    """A recipe from a base recipe dict and dotted overrides (`resolve_overrides`), validated; the notes
    of fields reset go to stderr once the recipe is accepted (a refusal stays one line), unless quiet
    (a recipe looplm derives for its own measurement, not one a user asked for)."""
    data, notes = resolve_overrides(base, overrides)
    recipe = recipe_from_dict(data)
    for note in notes if not quiet else ():
        log.warning(note)
    return recipe


EXPERIMENT_ONLY = {"data.probe_examples": "looplm experiment extrapolate",
                   "data.baselines": "looplm experiment extrapolate"}
"""Fields that only an experiment reads (-> the command that does): `looplm train` trains the one model the
recipe describes, so they cannot apply there."""


def single_run_recipe(recipe: Recipe, overrides: dict[str, Any]) -> Recipe:
    """The recipe `looplm train` runs: a field of EXPERIMENT_ONLY the user set with --set is refused; one a
    recipe file sets (the built-in `extrapolate` sets both) goes back to its default with a note, as an
    inapplicable field a recipe carries does (`resolve_overrides`), so the run's recipe.toml records
    nothing it did not use."""
    changes: dict[str, dict[str, Any]] = {}
    for key, command in EXPERIMENT_ONLY.items():
        if key in overrides:
            raise UserError(f"--set {key}: only `{command}` reads it; `looplm train` trains the recipe's one model")
        section, name = key.split(".")
        fld = next(f for f in dataclasses.fields(getattr(recipe, section)) if f.name == name)
        value, default = getattr(getattr(recipe, section), name), _default(fld)
        if value != default:
            log.warning(f"recipe: {key} = {_toml_value(_to_plain(value))} (from the recipe) reset to its default: "
                        f"only `{command}` reads it, not `looplm train`")
            changes.setdefault(section, {})[name] = default
    return dataclasses.replace(recipe, **{sec: dataclasses.replace(getattr(recipe, sec), **kw)
                                          for sec, kw in changes.items()}) if changes else recipe


def load_recipe(name_or_path: str = "quickstart", overrides: dict[str, Any] | None = None) -> Recipe:
    """Load a built-in (by name) or a TOML file (by path), apply dotted overrides, validate."""
    return derive_recipe(read_recipe_dict(name_or_path), overrides or {})


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):   # JSON's escapes (\n, \t, \", \\, \uXXXX) are TOML basic-string escapes too
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def dump_toml(data: dict[str, Any]) -> str:
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, values in data.items():
        if isinstance(values, dict):
            lines.append(f"\n[{section}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
    return "\n".join(lines) + "\n"


def field_docs() -> dict[str, list[tuple[str, str, str, str]]]:
    """section -> [(field, default, docstring, applies when)], read from the attribute docstrings and the
    applicability rules above (for docs/recipe.md)."""
    from ..docstrings import attribute_docs
    out = {}
    for section, cls in typing.get_type_hints(Recipe).items():
        if section == "name":
            continue
        docs = attribute_docs(cls)                  # one line each: they land in table rows
        hints = typing.get_type_hints(cls)
        out[section] = [(f.name, _toml_value(_to_plain(_default(f))), f"{_type_name(hints[f.name])}. {docs.get(f.name, '')}",
                         "; ".join(c.text for c in f.metadata.get("applies", ())) or "always")
                        for f in dataclasses.fields(cls)]
    return out
