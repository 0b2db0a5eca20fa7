"""Compute counted over every visit: FLOPs per token of a looped model's forward and backward.

A shared core block stored once runs R times, and each run costs what an untied block costs;
deduplicating reused matrices understates compute. So the count goes by visits:

    block(L)   = 2 * matmul parameters of one block + 4 * n_heads * head_dim * L
                 (the products, then QK^T and AV against L keys; in an MoE core the router and
                 the k chosen experts, not all E: what one token's visit applies)
    forward    = n_prelude * block + R * (n_core * block + adapter + gate) + adapter
                 + (R - 1) * (k - 1) * n_core * block   (Euler sub-steps, k a block's visits a round after the first)
                 + readouts * (n_coda * block + share * head)    head = 2 * d_model * vocab
    backward   = 2 * (prelude if gradient reaches it + G * (n_core * block + adapter) + adapter
                      + gate rounds * gate + readouts with a loss * (n_coda * block + share * head))
                 - adapter if the state entering the window's first round is a constant

adapter: concat injection's [W_s | W_e] [s; e] as W_s s each round (2 d^2) plus W_e e, the same every
round and so computed once a forward (LoopedLM.input_term); its input gradient is skipped where s
carries none. The cached decoder applies the whole 2d x d adapter each round (`decode_flops`, DecodeWork).

R: rounds run; G: rounds inside the backward window up to the last supervised readout (what
autograd reaches, `LoopOutput.grad_rounds`); readouts: supervised rounds read out (each runs the
coda and the head, Ouro's every-round readout pays R of them); share: the tokens whose readouts apply
the head (a masked task loss reads a few positions: `Visits.head_share`). Training attends causally over T
tokens, L = (T + 1) / 2 keys on average; a decoded token at position t attends to t + 1 keys.
`looplm check` compares this count with PyTorch's own FLOP counter on a real forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Visits:
    """What one token's pass ran: rounds, rounds with gradient, readouts, readouts with a loss, and
    whether the gradient reached the prelude."""

    rounds: int
    grad_rounds: int = 0
    readouts: int = 1
    grad_readouts: int = 0
    prelude_grad: bool = False
    gate_grad: bool = False
    router_depths: int = 0
    """Mixture-of-Recursions: the depths the router chooses among (its output width); 0 = rounds."""
    router_lookahead: bool = False
    """Expert-choice decoding: after a token's last round the next round's router still runs (it is what
    says the token stops), unless that was round R."""
    head_share: float = 1.0
    """Share of the tokens at which each readout applies the LM head (a loss's positions, the forward's
    readout_at); the coda runs on every token."""
    later_share: float = 1.0
    """Share of the tokens at which the rounds after the first ran (kv_sharing = first with readout_at runs them
    at the read positions only: LoopOutput.later_positions)."""
    grad_first: bool | None = None
    """Whether round 1 is among the rounds with gradient (`LoopOutput.grad_rounds`); None: when the window
    reaches back to it, the window's rounds ending at the last round."""
    later_keys_factor: float = 1.0
    """Mean keys a query of those later rounds attended to, over the causal mean (T + 1) / 2 of every token's:
    read positions sit late in a row, so their queries see more keys than the average token's."""

    @property
    def rounds_budget(self) -> int:
        return self.router_depths or self.rounds


def block_matmul_params(cfg, core: bool = False) -> int:
    """Multiply-adds per token of one block's products (q, k, v, o, gate, up, down), from the shapes.
    A core block of an MoE core (core=True, model.moe_experts > 0) applies its router (d x E) and
    the k experts each token chose, not all E: active parameters, counted at every visit."""
    d, h, kv, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
    ffn = 3 * d * f
    if core and cfg.moe_experts:
        ffn = d * cfg.moe_experts + cfg.moe_top_k * 3 * d * cfg.moe_hidden
    return d * h * dh + 2 * d * kv * dh + h * dh * d + ffn


def block_flops(cfg, keys: float, core: bool = False) -> float:
    """Forward FLOPs per token of one block attending to `keys` keys (core: see block_matmul_params)."""
    return 2 * block_matmul_params(cfg, core) + 4 * cfg.n_heads * cfg.head_dim * keys


def _pieces(cfg, exit_gate: bool) -> tuple[float, float, float]:
    """(head, adapter, gate) forward FLOPs per token; adapter: one d x d half of concat's adapter."""
    head = 2 * cfg.d_model * cfg.vocab_size
    adapter = 2 * cfg.d_model * cfg.d_model if cfg.injection == "concat" else 0
    gate = 2 * cfg.d_model if exit_gate else 0
    return head, adapter, gate


def pass_flops(cfg, visits: Visits, keys: float, exit_gate: bool = False, input_term_once: bool = True
               ) -> dict[str, float]:
    """{"forward", "backward", "total"} FLOPs per token for one pass with `visits`, each block
    attending to `keys` keys. input_term_once: the pass computes concat's W_e e once for its rounds
    (LoopedLM.forward); False: each round applies the whole adapter (the cached decoder)."""
    blk = block_flops(cfg, keys)
    head, adapter, gate = _pieces(cfg, exit_gate)
    once = adapter if input_term_once else 0.0            # W_e e, once a pass
    core_round = cfg.n_core * block_flops(cfg, keys, core=True) + adapter + (0.0 if input_term_once else adapter)
    # a round after the first, per token of the pass: at the tokens it ran at (Visits.later_share)
    later_round = visits.later_share * (cfg.n_core * block_flops(cfg, keys * visits.later_keys_factor, core=True)
                                        + adapter + (0.0 if input_term_once else adapter))
    readout = cfg.n_coda * blk + head * visits.head_share
    router_fwd, router_bwd = router_flops(cfg, visits)
    fwd = (cfg.n_prelude * blk + router_fwd + min(visits.rounds, 1) * core_round
           + max(visits.rounds - 1, 0) * later_round + visits.rounds * gate + once + visits.readouts * readout)
    # Euler sub-steps (model.round_update = euler): every round after the first visits each core block k times
    k = getattr(cfg, "round_substeps", 1) if getattr(cfg, "round_update", "plain") == "euler" else 1
    substeps = (k - 1) * cfg.n_core * block_flops(cfg, keys, core=True)
    fwd += max(visits.rounds - 1, 0) * substeps
    # W_s s's input gradient is not computed where the state entering the window's first round is a constant
    first_in = int(bool(visits.grad_rounds) and visits.grad_rounds >= visits.rounds if visits.grad_first is None
                   else visits.grad_first)
    skipped = (once * (1.0 if first_in else visits.later_share)
               if visits.grad_rounds and state_enters_constant(cfg, visits) else 0.0)
    bwd = 2 * ((cfg.n_prelude * blk if visits.prelude_grad else 0)
               + first_in * core_round + (visits.grad_rounds - first_in) * later_round
               + (once if visits.grad_rounds else 0.0)
               + (visits.rounds * gate if visits.gate_grad else 0) + visits.grad_readouts * readout
               + min(visits.grad_rounds, max(visits.rounds - 1, 0)) * substeps) + router_bwd - skipped
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd}


def state_enters_constant(cfg, visits: Visits) -> bool:
    """Whether the state entering the backward window's first round carries no gradient: the window
    starts after round 1 (the last grad_rounds rounds have gradient), or round 1 starts from zeros or
    noise rather than the prelude's output."""
    after_first = visits.rounds - visits.grad_rounds + 1 > 1 if visits.grad_first is None else not visits.grad_first
    return after_first or cfg.init_state != "prelude"


def router_flops(cfg, visits: Visits) -> tuple[float, float]:
    """(forward, backward) FLOPs per token of a Mixture-of-Recursions router (0, 0 without one).
    Token choice: one d x R product on the prelude output; its weight scales every routed update, so
    the backward (weights and input) runs whenever any round is in the backward. Expert choice: a
    width-1 product at each round up to R (the round's own router, on the state entering it), its
    backward (weights, and the input where that carries gradient) in the rounds with gradient; an auxiliary router (mor_causal = aux_router) adds one at
    each round after the first, on the detached state (its backward: the weights alone)."""
    kind, d = getattr(cfg, "mor", "none"), cfg.d_model
    if kind == "none":
        return 0.0, 0.0
    if kind == "token_choice":
        f = 2 * d * visits.rounds_budget
        return f, 2 * f if visits.grad_rounds else 0.0
    # rounds with a router; decoding also runs the next round's router to decide that the token stops
    n = min(visits.rounds + visits.router_lookahead, visits.rounds_budget)
    g = min(visits.grad_rounds, n)                                    # the last g of them have gradient
    # the state entering the window's first round is a constant (computed without gradient, or a
    # zeros/random initial state): there the router's backward makes only its weight gradient
    constant_first = g > 0 and state_enters_constant(cfg, Visits(rounds=n, grad_rounds=g))
    fwd, bwd = 2 * d * n, 2 * d * (2 * g - constant_first)
    if cfg.mor_causal == "aux_router":
        fwd += 2 * d * max(0, n - 1)
        bwd += 2 * d * min(g, n - 1)
    return fwd, bwd


def train_flops_per_token(cfg, visits: Visits, seq_len: int, exit_gate: bool = False) -> float:
    """Training FLOPs per token of a micro-batch of length seq_len (causal attention)."""
    return pass_flops(cfg, visits, (seq_len + 1) / 2, exit_gate)["total"]


def decode_flops(cfg, rounds: int, position: int, exit_gate: bool = False, router_depths: int = 0) -> float:
    """Forward FLOPs of decoding one token at `position` (0-based) with `rounds` rounds and one readout
    (router_depths: a Mixture-of-Recursions router's width, the model's nominal rounds)."""
    visits = Visits(rounds=rounds, router_depths=router_depths, router_lookahead=getattr(cfg, "mor", "") == "expert_choice")
    return pass_flops(cfg, visits, position + 1, exit_gate, input_term_once=False)["forward"]


@dataclass
class DecodeWork:
    """Forward FLOPs of every cache column a decoder computed, by phase ("prefill", "decode",
    "draft", "verify", ...): a column a speculative decoder drafts, verifies and throws away is work
    done all the same. `attention` is the part of the total that is QK^T and AV (the rest are the
    weight products, what PyTorch's FLOP counter sees on CPU). `router_depths`: a
    Mixture-of-Recursions router's width (the model's nominal rounds; see `router_flops`).
    `fusion_weights`: full-bandwidth feedback's matrix weights (model/feedback.py), applied once to each
    column that ran the fusion (`add(fused=...)`)."""

    cfg: object
    by_phase: dict[str, float] = field(default_factory=dict)
    attention: float = 0.0
    router_depths: int = 0
    fusion_weights: int = 0

    def add(self, phase: str, position: int, rounds: int, *, prelude: bool = True, readouts: int = 1,
            heads: int | None = None, gate_rounds: int = 0, columns: int = 1, rows: int = 1,
            skip_visits: int = 0, fused: int = 0) -> None:
        """`columns` columns from `position` on (0-based; column t attends to t + 1 keys), each: the
        prelude (prelude), `rounds` rounds of the core (and a Mixture-of-Recursions router's products
        for them), `readouts` passes of the coda and the exit gate at `gate_rounds` rounds; `heads`
        LM-head products over the columns (default one per readout of each column; a chunk's readout
        runs the coda on every column and the head on the last); `rows` batch rows of such columns.
        skip_visits: the first visits (model/visits.py order) were not computed (supplied by a tap:
        recirculation's resumed pass); the rounds' injections still ran. fused: columns (over all rows) that ran
        feedback's fusion (`fusion_weights`; computed for every column given states, plain ones included)."""
        cfg, n = self.cfg, columns
        head, adapter, gate = _pieces(cfg, True)
        router = router_flops(cfg, Visits(rounds=rounds, router_depths=self.router_depths,
                                          router_lookahead=getattr(cfg, "mor", "none") == "expert_choice"))[0]
        P, K = cfg.n_prelude * prelude, cfg.n_core
        skip_p = min(skip_visits, P)
        skip_c = min(max(skip_visits - P, 0), rounds * K)
        skip_k = min(max(skip_visits - P - rounds * K, 0), readouts * cfg.n_coda)
        blocks = P + readouts * cfg.n_coda - skip_p - skip_k
        core_visits = rounds * K - skip_c
        products = (n * (2 * block_matmul_params(cfg) * blocks + core_visits * 2 * block_matmul_params(cfg, True)
                         + rounds * 2 * adapter + gate_rounds * gate + router)
                    + (n * readouts if heads is None else heads) * head)
        fusion = 2 * self.fusion_weights * fused                          # counted over rows already
        keys = n * position + n * (n + 1) // 2                          # the columns' position + 1, summed
        attention = 4 * cfg.n_heads * cfg.head_dim * keys * (blocks + core_visits)
        self.by_phase[phase] = self.by_phase.get(phase, 0.0) + rows * (products + attention) + fusion
        self.attention += rows * attention

    def total(self) -> float:
        return sum(self.by_phase.values())


def prelude_receives_gradient(cfg, grad_rounds: tuple[int, ...] | list[int]) -> bool:
    """The prelude's output enters every round through injection, or only round 1 as its initial state."""
    if not grad_rounds or cfg.n_prelude == 0:
        return False
    return cfg.injection != "none" or (cfg.init_state == "prelude" and 1 in grad_rounds)
