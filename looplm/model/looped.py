"""The looped language model: prelude -> shared core x R rounds -> coda -> LM head.

    e = prelude(embed(tokens))                 # untied blocks, run once
    s = initial_state(e)                       # zeros | e | N(0, std^2)   (Huginn)
    repeat R rounds (looplm.unroll):
        s = core(inject(s, e))                 # the same K blocks every round
    logits = head(norm(coda(s)))               # untied blocks, run once per readout

The recurrence itself lives in `recurrence.unroll`, the blocks in `blocks.py`; this file says
what a step is and how the pieces are wired. Every piece takes an `ops` backend (default the
eager reference), so the cached engine runs these same methods with its own weight layouts.
The forward pass returns one `LoopOutput`, which later features extend rather than widening
a tuple.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..recipe.config import ModelConfig
from .blocks import EAGER, Block, Ops, rms_norm, rope_tables
from .recurrence import unroll


@dataclass
class LoopOutput:
    """Everything one forward pass produced."""

    logits: Tensor
    """(B, T, V) readout after the last round that ran; (N, V) with readout_at."""
    rounds: int
    """Rounds computed."""
    round_logits: dict[int, Tensor] = field(default_factory=dict)
    """round -> (B, T, V) readouts at the requested rounds (loss placement, logit lens); (N, V) with readout_at."""
    grad_rounds: tuple[int, ...] = ()
    """Rounds whose computation receives gradient from the readouts asked for (readout_rounds, else the
    final one): the backward window's rounds up to the last of them (see recurrence.unroll)."""
    readout_only_rounds: tuple[int, ...] = ()
    """Read-out rounds before the window: their logits train only the coda and head (and the gate)."""
    state: Tensor | None = None
    """(B, T, d) loop state after the last round."""
    hazards: Tensor | None = None
    """(B, T, R) exit-gate hazards per round, when the model has a gate."""
    rounds_used: Tensor | None = None
    """(B, T) rounds each position actually ran (early exit)."""
    cache: Any = None
    """The key/value cache passed in, after this call's updates."""
    stats: dict[str, list[float]] = field(default_factory=dict)
    """Per-round diagnostics when asked for: state_rms, update_rms."""
    round_states: list[Tensor] = field(default_factory=list)
    """States after each round (kept when collect_stats, for gradient diagnostics); those before the
    backward window do not require grad."""
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    """Auxiliary training losses of routed models, by name: "moe_balance", "moe_z" (LoopMoE, averaged over
    every MoE visit of the pass, model/moe.py); "mor_balance", "mor_z" (token choice) or "mor_aux",
    "mor_z" (expert choice, when a round chose; model/recursions.py). The trainer weighs each by its
    recipe coefficient (`aux_loss_weights`); empty for a dense, unrouted model."""
    routed_depth: Tensor | None = None
    """Mixture-of-Recursions: (B, T) the depth the router chose for each token (rounds_used is what ran:
    the same, except under warm-up's full depth or a shorter `rounds`)."""
    top: Tensor | None = None
    """(B, T, d) the final round's top state after the final norm (what the head reads), when asked
    (keep_top): feedback's h for the next pass (model/feedback.py)."""
    routing: dict[int, list[Tensor]] = field(default_factory=dict)
    """LoopMoE: core block index -> the (B*T, k) experts its tokens chose at each of its visits, in order
    (a shared block: one entry per round; an untied block: one)."""
    earlier_passes: list["LoopOutput"] = field(default_factory=list)
    """Feedback's parallel passes before this one, in order, when one call ran several (forward's
    feedback_passes): pass k's own output at index k - 1; this output is the last pass's."""
    readout_at: Tensor | None = None
    """(B, T) bool, when the forward was asked for logits at some positions only (a loss's mask): logits
    and round_logits are then (N, V), the N True positions in row-major order (`s[readout_at]`)."""
    later_positions: Tensor | None = None
    """(B, K) the positions at which the rounds after the first ran, when they ran at some positions only
    (`LoopedLM.later_positions`: kv_sharing = first with readout_at): each row's read positions in order,
    then unread ones its padding computed; `state` is None then. None: every position ran every round."""


def deeploop_scales(n_core: int, rounds: int, p: float) -> tuple[float, float]:
    """DeepLoop: alpha = (2N)^p on the skip, beta = (8N)^-p on branch init, N = n_core * rounds."""
    n = n_core * rounds
    return (2 * n) ** p, (8 * n) ** (-p)


def initial_noise_table(cfg: ModelConfig, seed: int) -> Tensor:
    """(context, d) random initial loop states indexed by position, for inference with init_state = random:
    one seed gives every position the same noise whether the sequence is run whole, cached or batched."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(cfg.context, cfg.d_model, generator=g) * cfg.init_state_std


class LoopedLM(nn.Module):
    """Prelude -> shared core x rounds -> coda -> head. `rounds` is the nominal depth:
    it sets DeepLoop's N and the untied baseline's block count."""

    def __init__(self, cfg: ModelConfig, rounds: int, exit_gate: bool = False, feedback: Any = None):
        super().__init__()
        self.cfg, self.nominal_rounds, self.feedback_cfg = cfg, rounds, feedback
        d = cfg.d_model
        alpha, beta = (deeploop_scales(cfg.n_core, rounds, cfg.deeploop_p)
                       if cfg.residual_scaling == "deeploop" else (1.0, 1.0))
        self.alpha, self.beta = alpha, beta
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.prelude = nn.ModuleList(Block(cfg) for _ in range(cfg.n_prelude))
        n_core_blocks = cfg.n_core * (rounds if cfg.untied else 1)
        self.core = nn.ModuleList(Block(cfg, alpha, moe=cfg.moe_experts > 0) for _ in range(n_core_blocks))
        self.coda = nn.ModuleList(Block(cfg) for _ in range(cfg.n_coda))
        self.adapter = nn.Linear(2 * d, d, bias=False) if cfg.injection == "concat" else None
        # decay injection's theta (d,): the carry a = exp(-exp(theta)) lies in (0, 1) for every theta
        self.decay = nn.Parameter(torch.empty(d)) if cfg.injection == "decay" else None
        self.state_norm = nn.RMSNorm(d, eps=cfg.norm_eps) if cfg.state_norm else None
        self.gate = nn.Sequential(nn.RMSNorm(d, eps=cfg.norm_eps), nn.Linear(d, 1)) if exit_gate else None
        # Mixture-of-Recursions (model/recursions.py): token choice scores the depths 1..rounds once; expert
        # choice scores each round (column r - 1) on the state entering it
        self.mor_router = nn.Linear(d, rounds, bias=False) if cfg.mor != "none" else None
        self.mor_aux_router = (nn.Linear(d, rounds, bias=False)
                               if cfg.mor == "expert_choice" and cfg.mor_causal == "aux_router" else None)
        # token choice's loss-free balancing bias; saved with the weights (it is part of the routing)
        self.register_buffer("mor_bias", torch.zeros(rounds) if cfg.mor == "token_choice" else None)
        # full-bandwidth feedback (model/feedback.py): the previous position's top state fused into the input
        if feedback is not None and feedback.mode != "none":
            from .feedback import Feedback
            self.feedback = Feedback(d, feedback, cfg.norm_eps)
        else:
            self.feedback = None
        self.final_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(cfg, cfg.context)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.local_rope_base:   # Gemma 3's local blocks: their own RoPE base; `rope` then hands both tables
            import dataclasses
            cos, sin = rope_tables(dataclasses.replace(cfg, rope_base=cfg.local_rope_base, rope_scaling="none"),
                                   cfg.context)
            self.register_buffer("rope_cos_local", cos, persistent=False)
            self.register_buffer("rope_sin_local", sin, persistent=False)
            order = [*self.prelude, *self.core[:cfg.n_core], *self.coda]
            for b in cfg.local_blocks:
                order[b].attn.local = True
            for j, blk in enumerate(self.core):      # an untied core's copies follow their shared block
                blk.attn.local = self.core[j % cfg.n_core].attn.local
        if cfg.init_state == "random":  # eval mode's fixed initial state (seed 0), moved with the model
            self.register_buffer("eval_noise", initial_noise_table(cfg, 0), persistent=False)
        self._init_weights(beta)

    # -- initialisation -------------------------------------------------------------
    def _init_weights(self, beta: float) -> None:
        cfg = self.cfg
        visits = cfg.n_prelude + cfg.n_core * self.nominal_rounds + cfg.n_coda
        seen: set[int] = set()  # a shared tensor is initialised (and beta-scaled) once
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.dim() < 2:
                if name.endswith(("attn.q.bias", "attn.k.bias", "attn.v.bias")):
                    nn.init.zeros_(p)
                continue  # norms keep weight 1; the gate's bias set below
            std = cfg.init_std
            if name.endswith(("attn.o.weight", "mlp.down.weight", "mlp.down")):      # mlp.down: MoE experts
                std = std / math.sqrt(2 * visits)
            nn.init.normal_(p, std=std)
            if beta != 1.0 and name.startswith("core.") and name.endswith(
                    ("attn.v.weight", "attn.o.weight", "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight",
                     "mlp.gate_up", "mlp.down")):
                with torch.no_grad():
                    p.mul_(beta)
        if self.gate is not None:
            nn.init.zeros_(self.gate[1].weight)
            nn.init.constant_(self.gate[1].bias, -1.0)  # start with mass spread over rounds
        if self.feedback is not None and self.feedback.mode == "concat":   # start as the plain embedding
            with torch.no_grad():
                self.feedback.proj.weight.zero_()
                self.feedback.proj.weight[:, :cfg.d_model].copy_(torch.eye(cfg.d_model))
        if self.adapter is not None:  # "sum": start as s + e (like additive injection); "state": as s alone
            with torch.no_grad():
                e_half = torch.eye(cfg.d_model) if cfg.adapter_init == "sum" else torch.zeros(cfg.d_model, cfg.d_model)
                self.adapter.weight.copy_(torch.cat([torch.eye(cfg.d_model), e_half], dim=1))
        if self.decay is not None:    # every channel's carry starts at injection_decay_init
            with torch.no_grad():
                self.decay.fill_(math.log(-math.log(cfg.injection_decay_init)))

    # -- pieces ---------------------------------------------------------------------
    def rope(self, start: int, T: int, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """RoPE tables for (B, T, heads, Dh) tensors: (T, 1, Dh) for positions start..start+T, or
        (B, T, 1, Dh) for per-row positions (B, T) (left-padded batches, gathered active tokens)."""
        tables = [self.rope_cos, self.rope_sin]
        if self.cfg.local_rope_base:                 # (cos, sin, local cos, local sin): each block picks its pair
            tables += [self.rope_cos_local, self.rope_sin_local]
        if positions is None:
            return tuple(t[start:start + T, None] for t in tables)
        return tuple(t[positions].unsqueeze(2) for t in tables)

    def initial_state(self, e: Tensor, generator: torch.Generator | None = None, start: int = 0,
                      positions: Tensor | None = None) -> Tensor:
        """(B, T, d) state before round 1. A random initial state is fresh noise in training or when a
        generator is passed; in eval mode without one it is `initial_noise_table(cfg, 0)` at the tokens'
        positions, so the same input gives the same logits, equal to the engine's at seed 0."""
        kind = self.cfg.init_state
        if kind == "zeros":
            return torch.zeros_like(e)
        if kind == "prelude":
            return e
        if generator is None and not self.training:
            table = self.eval_noise                                                         # (context, d)
            rows = table[start:start + e.shape[1]] if positions is None else table[positions]
            return rows.to(e.dtype).expand_as(e)
        return self.random_state(e.shape, generator, e.dtype, e.device)

    def random_state(self, shape: tuple[int, ...], generator: torch.Generator | None, dtype: torch.dtype,
                     device: torch.device) -> Tensor:
        """Fresh initial-state noise N(0, init_state_std^2) of `shape` (B, T, d). A CPU generator (the
        trainer's, seeded per step) draws the same numbers on every device; several training processes
        draw the whole global batch's and each keeps its rows."""
        if generator is not None and generator.device != torch.device(device):
            return (torch.randn(shape, generator=generator, dtype=dtype) * self.cfg.init_state_std).to(device)
        return torch.randn(shape, generator=generator, device=device, dtype=dtype) * self.cfg.init_state_std

    def inject(self, s: Tensor, e: Tensor, ops: Ops = EAGER, e_term: Tensor | None = None) -> Tensor:
        """The core's input for a round from the state s and the loop input e (B, T, d). e_term: concat's
        e-half product `input_term(e)`, computed once for every round of a forward."""
        kind = self.cfg.injection
        if kind == "add":
            return s + e
        if kind == "concat":       # adapter [W_s | W_e] applied to [s; e]
            if e_term is not None:
                return ops.linear(s, self.adapter.weight[:, :s.shape[-1]]) + e_term
            return ops.linear(torch.cat([s, e], dim=-1), self.adapter.weight)
        if kind == "decay":          # a * s + e: a constant update per round now saturates at (e + u) / (1 - a)
            return self.carry().to(s.dtype) * s + e
        return s

    def input_term(self, e: Tensor) -> Tensor | None:
        """Concat injection's W_e e (B, T, d): the same every round, so a forward computes it once (the
        untied baseline's stack of R blocks would otherwise redo it R times); None for the other kinds."""
        if self.cfg.injection != "concat":
            return None
        return nn.functional.linear(e, self.adapter.weight[:, e.shape[-1]:])

    def carry(self) -> Tensor:
        """Decay injection's per-channel carry a = exp(-exp(theta)) (d,), in float32."""
        return torch.exp(-torch.exp(self.decay.float()))

    @staticmethod
    def visit(block: Block, x: Tensor, rope, cache: Any, slot: tuple, ops: Ops) -> Tensor:
        """One block visit: the block (a module call: FSDP's units hook here), through the backend's tap when
        it has one (`Ops.tap`: it sees the residual after the visit, and with `known` may supply it instead of
        the block computing it)."""
        tap = ops.tap
        if tap is None:
            return block(x, rope, cache, slot, ops)
        known = tap.known(slot) if hasattr(tap, "known") else None
        return tap(slot, block(x, rope, cache, slot, ops) if known is None else known)

    def core_step(self, s: Tensor, e: Tensor, r: int, rope, cache: Any = None, ops: Ops = EAGER,
                  e_term: Tensor | None = None) -> Tensor:
        """One round: inject the input, run the K core blocks (round r picks its own blocks if untied).
        e_term: `input_term(e)` when the caller computed it once for its rounds. r may be a (B,) tensor,
        each row's own round (continuous depth batching: rows at different rounds share the step; the
        cache's slot then carries the tensor, inference/cache.RowColumns), for tied one-visit rounds."""
        cfg, K = self.cfg, self.cfg.n_core
        per_row = isinstance(r, Tensor)
        if per_row and (cfg.untied or cfg.round_update == "euler"):
            raise ValueError("rows at different rounds share a step only in a tied loop of one visit per block")
        blocks = self.core[(r - 1) * K: r * K] if cfg.untied else self.core
        x = self.inject(s, e, ops, e_term)
        k = cfg.round_substeps if cfg.round_update == "euler" and r > 1 else 1
        if k > 1 and cache is not None:
            from ..errors import UserError
            raise UserError("model.round_update = euler visits each core block k times a round; a key/value "
                            "cache holds one entry per visit (cached decoding, early exit with caches): use "
                            "whole-sequence forwards (looplm eval --rounds, generate --no-cache)")
        for i, block in enumerate(blocks):
            if k == 1:
                x = self.visit(block, x, rope, cache, ("core", r, i), ops)
            else:            # k Euler steps of size 1/k along the block's residual update f(x) - x
                for _ in range(k):
                    x = x + (self.visit(block, x, rope, cache, ("core", r, i), ops) - x) / k
        out = rms_norm(self.state_norm, x) if self.state_norm is not None else x
        if cfg.round_update == "damped":                # a step of size eta toward the core's output (after round 1)
            if per_row:
                out = torch.where((r > 1).view(-1, *([1] * (out.dim() - 1))), s + cfg.round_eta * (out - s), out)
            elif r > 1:
                out = s + cfg.round_eta * (out - s)
        return out

    def routed_step(self, s: Tensor, e: Tensor, r: int, rope, cache: Any, weight: Tensor,
                    ops: Ops = EAGER, e_term: Tensor | None = None) -> Tensor:
        """One round of a routed loop for tokens that run it: s + w * (core_step(s) - s), w (B, T) the
        router's weight of each token's depth (model/recursions.py)."""
        new = self.core_step(s, e, r, rope, cache, ops, e_term)
        return s + weight.unsqueeze(-1) * (new - s)

    def route(self, e: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Mixture-of-Recursions: (depth (B, T) in 1..nominal rounds, weight (B, T), router logits (B, T, R))."""
        from .recursions import route
        return route(self.mor_router, self.mor_bias, e)

    def expert_choice(self, s: Tensor, r: int, kept: Tensor, causal: bool, full: bool = False
                      ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor] | None]:
        """Expert-choice Mixture-of-Recursions at round r for tokens s (B, T, d) still kept (B, T):
        (selected (B, T), weights (B, T), the BCE record for rounds after the first or None). Round 1
        (capacity 1) and `full` keep every kept token; in training (causal False) the top capacity_r
        share of each sequence by router logit; at inference the causal decision logit > 0."""
        from .recursions import select_top
        if r > self.nominal_rounds:                  # no router past the trained rounds: every token has stopped
            return torch.zeros_like(kept), torch.zeros(kept.shape, dtype=s.dtype, device=s.device), None
        # round r's router is row r - 1 of the weight: one product of width 1, not all R
        logits = nn.functional.linear(s, self.mor_router.weight[r - 1:r]).float().squeeze(-1)    # (B, T)
        weight = (self.cfg.mor_alpha * torch.sigmoid(logits)).to(s.dtype)
        if r == 1 or full:
            return kept, weight, None
        aux = self.mor_aux_router
        decision = logits if aux is None else \
            nn.functional.linear(s.detach(), aux.weight[r - 1:r]).float().squeeze(-1)
        if causal:
            chosen = kept & (decision > 0)
        else:
            chosen = select_top(logits.detach(), kept, self.cfg.mor_capacity[r - 1])
        return chosen, weight, (decision, chosen, kept)

    def readout(self, s: Tensor, rope, cache: Any = None, r: int = 0, ops: Ops = EAGER,
                last_only: bool = False, tops: dict[int, Tensor] | None = None, head: bool = True,
                at: Tensor | None = None) -> Tensor | None:
        """Coda and LM head applied to a loop state (the logit lens at earlier rounds): (B, T, V), or
        (B, V) at the last position with last_only (a decode step needs no other), or (N, V) at the N
        True positions of `at` (B, T) bool (the coda still runs on every position: it attends). tops: gets
        round -> the top state after the final norm (feedback's h). head=False: the coda only (its cache
        entries are what is wanted: recirculation's refinement pass), None returned."""
        for i, block in enumerate(self.coda):
            s = self.visit(block, s, rope, cache, ("coda", r, i), ops)
        if not head:
            return None
        h = s[:, -1] if last_only else s if at is None else s[at]
        if tops is None:
            return self.head_logits(h, ops)
        tops[r] = self.final_norm(h)
        return ops.linear(tops[r], self.head.weight)

    def head_logits(self, h: Tensor, ops: Ops = EAGER) -> Tensor:
        """Final norm and LM head on a hidden state (..., d) -> (..., V): the end of every readout,
        and the logit lens at any block boundary (evaluation/lens.py)."""
        return ops.linear(self.final_norm(h), self.head.weight)

    def hazard(self, s: Tensor) -> Tensor:
        return torch.sigmoid(self.gate(s).squeeze(-1))  # (B, T)

    def loop_inputs(self, idx: Tensor, start: int = 0, positions: Tensor | None = None, cache: Any = None,
                    ops: Ops = EAGER, generator: torch.Generator | None = None,
                    initial_state: Tensor | None = None, feedback: tuple[Tensor, Tensor] | None = None
                    ) -> tuple[Any, Tensor, Tensor]:
        """What the loop starts from, set up in this one place for the training forward, the engine's
        chunks and whole-sequence early exit: (RoPE tables, prelude output e, initial state s0) for
        tokens idx (B, T) at positions start..start+T, or per-row `positions` (B, T); e and s0 (B, T, d).
        initial_state (B, T, d), when given, replaces the recipe's (the engine's per-request noise
        rows); feedback (h (B, T, d) already shifted, plain (B, T) bool): the previous positions' top
        states fused into the bottom input (model/feedback.py); the prelude writes its entries into `cache`."""
        rope = self.rope(start, idx.shape[1], positions)
        e = self.encode(idx, rope, cache, ops, feedback, generator)                # (B, T, d)
        s0 = (self.initial_state(e, generator, start, positions) if initial_state is None
              else initial_state.to(e.dtype))
        return rope, e, s0

    def encode(self, idx: Tensor, rope, cache: Any = None, ops: Ops = EAGER,
               feedback: tuple[Tensor, Tensor] | None = None, generator: torch.Generator | None = None) -> Tensor:
        x = self.embed(idx)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        if feedback is not None:
            if self.feedback is None:
                raise ValueError("feedback states given to a model without feedback (recipe [feedback] mode none)")
            x = self.feedback(x, *feedback, generator=generator)
        for i, block in enumerate(self.prelude):
            x = self.visit(block, x, rope, cache, ("prelude", 0, i), ops)
        return x

    # -- forward --------------------------------------------------------------------
    def forward(
        self,
        idx: Tensor,
        rounds: int | None = None,
        *,
        backward_window: int | None = None,
        readout_rounds: tuple[int, ...] | None = None,
        cache: Any = None,
        start_pos: int = 0,
        positions: Tensor | None = None,
        generator: torch.Generator | None = None,
        initial_state: Tensor | None = None,
        collect_stats: bool = False,
        full_depth: bool = False,
        feedback: tuple[Tensor, ...] | None = None,
        keep_top: bool = False,
        feedback_passes: int = 1,
        plain: Tensor | None = None,
        noise_rows: tuple[int, slice] | None = None,
        state_loss: bool = False,
        readout_at: Tensor | None = None,
    ) -> LoopOutput:
        """idx: (B, T) token ids. Runs `rounds` rounds (default: the nominal depth).
        initial_state (B, T, d) replaces the recipe's initial state (e.g. rows of initial_noise_table).
        A routed loop (model.mor) runs each token to its routed depth (at most `rounds`); full_depth
        sends every token through every round with weight 1 instead (warm-up). feedback: (h, plain) or
        (h, plain, jitter noise), the previous positions' top states fused into the input
        (model/feedback.py); keep_top: return the final round's top state after the final norm
        (LoopOutput.top).

        feedback_passes K > 1: feedback's K parallel passes (passes_forward) in this one call, plain
        (B, T) bool the positions that read their plain embedding: DDP and FSDP wrap the model's call,
        and need one forward per backward. Returns the last pass's output, the earlier ones in its
        earlier_passes. noise_rows (G, rows): idx is rows `rows` of a global batch of G, whose random
        draws the passes make whole and slice (one process of several computes what one process does).
        state_loss: a loss will read the final rounds' states (supervision.fixed_point): every round's state
        is kept in round_states and the final round counts as loss-bearing (grad_rounds reaches it).
        readout_at: (B, T) bool, the positions a loss reads (its mask): every readout applies the LM head
        there only, and the logits are (N, V) (LoopOutput.readout_at). With a byte vocabulary the head is
        a quarter of a small block's products, and a task's loss reads a few positions a row."""
        if readout_at is not None and (feedback_passes > 1 or keep_top or cache is not None):
            raise ValueError("readout_at is for a whole-sequence forward without cache, kept top state or feedback passes")
        if feedback_passes > 1:
            if plain is None or feedback is not None or keep_top or cache is not None:
                raise ValueError("feedback_passes needs plain (the start convention) and runs whole windows from "
                                 "their embeddings: no feedback, keep_top or cache of its own")
            from .feedback import passes_forward
            # self.forward, not self(...): the passes are inside this call, not new calls DDP or FSDP would see
            outs = passes_forward(self, idx, feedback_passes, plain, run=self.forward, noise_rows=noise_rows,
                                  rounds=rounds, backward_window=backward_window, readout_rounds=readout_rounds,
                                  start_pos=start_pos, positions=positions, generator=generator,
                                  initial_state=initial_state, collect_stats=collect_stats, full_depth=full_depth,
                                  state_loss=state_loss)
            outs[-1].earlier_passes = outs[:-1]
            return outs[-1]
        rounds = self.nominal_rounds if rounds is None else rounds
        if self.cfg.untied and rounds != self.nominal_rounds:
            raise ValueError(f"the untied baseline has blocks for exactly {self.nominal_rounds} rounds, asked {rounds}")
        B, T = idx.shape
        if start_pos + T > self.cfg.context:
            raise ValueError(f"sequence of {start_pos + T} tokens exceeds the model context {self.cfg.context}")
        rope, e, s0 = self.loop_inputs(idx, start_pos, positions, cache, generator=generator,
                                       initial_state=initial_state, feedback=feedback)   # e, s0: (B, T, d)

        wanted = set(readout_rounds or ()) | {rounds}
        core_cache = cache
        if cache is None and self.cfg.kv_sharing == "first":      # later rounds read round 1's keys/values
            from .recursions import RoutedVisibility
            core_cache = RoutedVisibility("shared_first")
        e_term = self.input_term(e)
        # what a round reads besides the state: gathered to the read positions after round 1 when later rounds
        # run there alone (below)
        ins = {"e": e, "rope": rope, "e_term": e_term, "at": readout_at}
        step = lambda s, r: self.core_step(s, ins["e"], r, ins["rope"], core_cache, e_term=ins["e_term"])  # noqa: E731
        later = self.later_positions(readout_at, rounds, cache, collect_stats or state_loss)
        rule = None
        if later is not None:
            pos, read = later                                                              # (B, K) each
            def rule(s: Tensor, r: int) -> Tensor:
                """After round 1 (and its readout): the state and inputs at the read positions only."""
                if r == 1:
                    rows = lambda t: None if t is None else t.gather(1, pos.unsqueeze(-1).expand(-1, -1, t.shape[-1]))  # noqa: E731
                    core_cache.query_pos = pos
                    ins.update(e=rows(e), e_term=rows(e_term), rope=self.rope(0, pos.shape[1], pos), at=read)
                    s = rows(s)                                                            # (B, K, d)
                return s
        routed = None
        if self.mor_router is not None:        # each token runs the rounds its router gives it
            if cache is not None:
                raise ValueError("a routed loop's forward runs whole sequences; decode through the Engine")
            from .recursions import RoutedLoop
            routed = RoutedLoop(self, e, rope, rounds, full_depth, e_term)
            step = routed.step
        moe = [(i, blk.mlp) for i, blk in enumerate(self.core) if hasattr(blk.mlp, "trace")]
        for _, mlp in moe:                     # every visit's routing, for the losses and the statistics
            mlp.trace = []
        try:
            # Each readout runs the coda. With a cache every readout attends to the cached coda history
            # (a one-token decode step has no other); the cache keeps the last write, the final round's.
            tops: dict[int, Tensor] | None = {} if keep_top else None
            run = unroll(step, s0, rounds, backward_window, wanted,
                         readout=lambda s, r: self.readout(s, rope, cache, r, tops=tops, at=ins["at"]),
                         keep_states=self.gate is not None or collect_stats or state_loss,
                         loss_rounds=(*(readout_rounds or (rounds,)), *((rounds,) if state_loss else ())), rule=rule)
        finally:
            traces = [(i, mlp.trace) for i, mlp in moe]
            for _, mlp in moe:                 # recomputation in the backward (checkpointing) records nothing
                mlp.trace = None
        out = LoopOutput(logits=run.readouts[rounds], rounds=run.rounds_run, round_logits=run.readouts,
                         grad_rounds=run.grad_rounds, readout_only_rounds=run.readout_only_rounds,
                         state=run.state if later is None else None, cache=cache,
                         top=tops[rounds] if keep_top else None, readout_at=readout_at,
                         later_positions=None if later is None else later[0])
        if routed is not None:
            routed.record(out)
        if moe:
            from .moe import moe_losses
            losses = moe_losses([rec for _, t in traces for rec in t], self.cfg.moe_experts)
            out.aux_losses.update({f"moe_{k}": v for k, v in losses.items()})
            out.routing = {i: [rec.experts.detach() for rec in t] for i, t in traces}
        if state_loss:
            out.round_states = run.states
        if self.gate is not None:
            # The gate reads each round's state like a readout: before the window the state is a
            # constant, so those hazards train the gate alone.
            out.hazards = torch.stack([self.hazard(s) for s in run.states], dim=-1)   # (B, T, R)
        if collect_stats:
            states = run.states
            out.round_states = states
            prev = [s0] + states[:-1]
            with torch.no_grad():
                out.stats = {
                    "state_rms": [s.float().pow(2).mean().sqrt().item() for s in states],
                    "update_rms": [(s - p).float().pow(2).mean().sqrt().item() for s, p in zip(states, prev)],
                }
        return out

    def later_positions(self, readout_at: Tensor | None, rounds: int, cache: Any, keep_states: bool
                        ) -> tuple[Tensor, Tensor] | None:
        """Where rounds after the first need to run, when not everywhere: under kv_sharing = first a round after
        the first reads the other positions' round-1 keys/values only, so position t's later rounds depend on
        its own state and round 1 alone; with a loss at readout_at's positions and nothing else read of a
        state (no coda attending over them, no gate, no kept states), the other positions' later rounds
        change nothing a loss sees, and are not run. Returns (pos, read), each (B, K), K the most read
        positions in a row: each row's read positions in order, padded with unread ones (computed, never
        read), and whether each is read; None where every position must run every round."""
        cfg = self.cfg
        if (readout_at is None or rounds < 2 or cfg.kv_sharing != "first" or cache is not None or keep_states
                or self.mor_router is not None or cfg.moe_experts or cfg.n_coda or self.gate is not None
                or cfg.round_update == "euler" or not readout_at.any()):
            return None
        counts = readout_at.sum(1)                                                          # (B,)
        K = int(counts.max())
        pos = torch.sort((~readout_at).to(torch.uint8), dim=1, stable=True).indices[:, :K]  # read ones first
        return pos, torch.arange(K, device=pos.device) < counts.unsqueeze(1)

    # -- accounting -----------------------------------------------------------------
    def param_groups_by_role(self) -> dict[str, int]:
        """Stored parameter counts by role, each tensor counted once."""
        roles = {"embed": [self.embed], "prelude": [self.prelude], "core": [self.core],
                 "coda": [self.coda, self.final_norm], "adapter": [self.adapter], "carry": [self.decay], "gate": [self.gate],
                 "router": [self.mor_router, self.mor_aux_router], "feedback": [self.feedback],
                 "state_norm": [self.state_norm], "head": [self.head]}
        seen: set[int] = set()
        counts = {}
        for role, mods in roles.items():
            n = 0
            for m in mods:
                for p in ((m,) if isinstance(m, nn.Parameter) else m.parameters() if m is not None else ()):
                    if id(p) not in seen:
                        seen.add(id(p))
                        n += p.numel()
            counts[role] = n
        return counts

    def params_stored(self) -> int:
        return sum(self.param_groups_by_role().values())

    def params_per_token_visit(self, rounds: float) -> float:
        """Parameters applied to one token over a forward pass at (mean) depth `rounds`.
        Per-round pieces (core, adapter, carry, gate, state norm) count once per round; an untied core
        runs each of its blocks once."""
        c = self.param_groups_by_role()
        per_round = c["adapter"] + c["carry"] + c["gate"] + c["state_norm"]   # feedback's fusion: once per position, in "embed"'s place
        if self.cfg.moe_experts:    # a visit applies the k experts a token chose, not all E
            cfg = self.cfg
            idle = len(self.core) * (cfg.moe_experts - cfg.moe_top_k) * 3 * cfg.d_model * cfg.moe_hidden
            c = {**c, "core": c["core"] - idle}
        core = c["core"] if self.cfg.untied else c["core"] * rounds
        return c["embed"] + c["feedback"] + c["prelude"] + core + per_round * rounds + c["coda"] + c["head"]

    def flops_per_token(self, rounds: float, seq_len: int, backward_rounds: float | None = None) -> float:
        """Training FLOPs per token of a pass with every round in the backward (or backward_rounds of
        them) and one supervised readout (model/flops.py counts every visit)."""
        from .flops import Visits, train_flops_per_token
        b = rounds if backward_rounds is None else backward_rounds
        visits = Visits(rounds=rounds, grad_rounds=b, readouts=1, grad_readouts=1,
                        prelude_grad=bool(b) and self.cfg.n_prelude > 0)
        return train_flops_per_token(self.cfg, visits, seq_len, self.gate is not None)


def untied_copy(model: LoopedLM, rounds: int) -> LoopedLM:
    """The same function as `model` at `rounds` rounds, written as an untied stack: round r has its own
    copies of the K core blocks (block (r-1)*K + i holds core block i's weights), everything else shared
    as is. What a looped model is compared against (`looplm check`), and how the gradient each visit
    of a shared block contributes is measured (train/alignment.py): the copies' gradients are the visits'."""
    import dataclasses
    untied = LoopedLM(dataclasses.replace(model.cfg, untied=True), rounds=rounds, exit_gate=model.gate is not None,
                      feedback=model.feedback_cfg)
    state, K = model.state_dict(), model.cfg.n_core
    untied.load_state_dict({key: state[f"core.{int(key.split('.')[1]) % K}.{key.split('.', 2)[2]}"]
                            if key.startswith("core.") else state[key] for key in untied.state_dict()})
    return untied.to(model.embed.weight.device)


def build_model(recipe: Any) -> LoopedLM:
    """The model a recipe describes (the API's `looplm.build_model`)."""
    return LoopedLM(recipe.model, rounds=recipe.depth.rounds, exit_gate=recipe.exit.gate, feedback=recipe.feedback)
