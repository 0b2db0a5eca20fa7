"""The trainer: `looplm train` end to end.

One step = `grad_accum` micro-batches. Each micro-batch draws its forward depth from the
recipe's sampler (a function of seed, step and micro-batch), detaches the state before the
backward window, reads out at the supervised rounds and adds their weighted losses. The
trainer records what actually happened — sampled depths, gradient-visible rounds, unique
tokens and token-passes, per-round diagnostics — and writes the run folder of CONTRACT.md.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..data import prepared
from ..data import text as data_mod
from ..data.sources import open_source
from ..runs.tensorboard import TensorBoardLog, require_tensorboard
from ..runs.checkpoint import (load_state, load_weights, optimizer_state_by_index, optimizer_state_for,
                               read_metrics, repair_checkpoint, save_checkpoint, write_text)
from ..recipe.config import Recipe, SupervisionConfig, load_recipe
from .depth import depth_generator, expected_depth, sample_depth
from .optim import lr_at, make_optimizer, optimizer_record, set_lr
from ..device import autocast, compiled, grad_scaler, resolve_device
from ..errors import UserError
from ..memory import RunMemory
from ..outdir import Staging, is_stale_staging, refuse_foreign, staging_path
from ..evaluation.rounds import eval_rounds_list, evaluate_rounds, extrapolation_rounds
from ..model.losses import fixed_point_term, placement, supervised_loss
from ..model.flops import Visits, prelude_receives_gradient, train_flops_per_token
from ..model.looped import LoopedLM, build_model
from ..model.recursions import depth_counts, update_bias
from ..data.tokenizer import load_tokenizer
from .parallel import (SINGLE, World, all_gather_ints, all_sum, checkpoint_core, close_world, full_tensor, init_world,
                       lockstep, no_sync, parallelize, rank_device, shard)


OUTER_MODULES = ("embed.", "prelude.", "coda.", "final_norm.", "head.")
"""What train.freeze_outer_steps holds still: everything around the loop."""
FRESH_MODULES = ("gate.", "adapter.", "decay.", "state_norm.")
"""Modules `train --init` / `--stage2` may add to the run they start from (the file lacks them whole); which
did is report.json's init_fresh_modules."""


def carry_record(model: torch.nn.Module) -> dict[str, Any]:
    """Decay injection's per-channel carries as training left them (read from the weights; where they
    started is the recipe's model.injection_decay_init, in report.json's recipe)."""
    a = model.carry().detach()       # build_report's model: the plain copy of the final weights, even after FSDP
    return {"min": a.min().item(), "mean": a.mean().item(), "max": a.max().item()}


def depth_safety_record(recipe: Recipe, model: LoopedLM, counters: Counters,
                        profile: dict[int, dict[str, float]] | None) -> dict[str, Any]:
    """report.json's depth_safety: what training and the final weights did to the loop state, measured,
    never the recipe's settings (those are in report.json's recipe). profile: evaluate_rounds(states=True)
    on the held-out batches (None for a task run, which has none): the state's RMS and relative change per
    round, at every depth read out, which is what a state norm, decayed injection or the fixed-point term
    is there to keep bounded. fixed_point: how many micro-batches carried the term and its mean value;
    carry: decay injection's carries as the weights hold them."""
    rec: dict[str, Any] = {}
    if profile is not None:
        rec["state_rms_by_rounds"] = {str(r): v["state_rms"] for r, v in sorted(profile.items())}
        rec["state_change_by_rounds"] = {str(r): v["state_change"] for r, v in sorted(profile.items())}
    if recipe.supervision.fixed_point:
        rec["fixed_point"] = {"micro_batches": counters.fixed_point_micro,
                              "mean_term": counters.fixed_point_sum / max(1, counters.fixed_point_micro)}
    if recipe.model.injection == "decay":
        rec["carry"] = carry_record(model)
    return rec


@dataclass
class Counters:
    """What actually happened over training; saved in the checkpoint for exact resume."""

    depth_histogram: Counter = field(default_factory=Counter)
    backward_histogram: Counter = field(default_factory=Counter)
    supervised_rounds: Counter = field(default_factory=Counter)
    readout_only_rounds: Counter = field(default_factory=Counter)
    """Supervised rounds that lay before the backward window (their loss trained the readout only)."""
    fallback_steps: int = 0
    token_passes: int = 0
    tokens_seen: int = 0
    train_flops: float = 0.0
    losses: list[float] = field(default_factory=list)
    train_time_s: float = 0.0
    supervised_weights: Counter = field(default_factory=Counter)
    """Round -> sum over micro-batches of the weight its loss carried (normalised per micro-batch; the
    mean exit mass under learned_exit; the share of the gate's loss in stage II)."""
    placement_kinds: Counter = field(default_factory=Counter)
    """Index into PLACEMENT_KINDS -> micro-batches that used that loss placement."""
    gate_grad_steps: int = 0
    """Optimizer steps in which some exit-gate parameter received a nonzero gradient."""
    pass_histogram: Counter = field(default_factory=Counter)
    """Feedback: parallel passes -> micro-batches trained with that many (empty without feedback)."""
    feedback_token_passes: int = 0
    """Feedback: real tokens x passes, summed (each pass reads every token once more)."""
    fixed_point_micro: int = 0
    """supervision.fixed_point: micro-batches whose loss carried the term (a one-round step has none)."""
    fixed_point_sum: float = 0.0
    """supervision.fixed_point: the term's value (unweighted) summed over those micro-batches."""
    outer_frozen_steps: int = 0
    """train.freeze_outer_steps: optimizer steps whose embedding/prelude/coda/head gradients were dropped."""
    last_visits: Visits | None = None
    """The block visits of the last micro-batch, as counted into train_flops (not saved)."""

    def to_state(self) -> dict[str, torch.Tensor]:
        def hist(c: Counter) -> torch.Tensor:
            return torch.tensor(sorted(c.items()), dtype=torch.long).reshape(-1, 2)
        return {"depth_histogram": hist(self.depth_histogram), "backward_histogram": hist(self.backward_histogram),
                "supervised_rounds": hist(self.supervised_rounds),
                "readout_only_rounds": hist(self.readout_only_rounds),
                "scalars": torch.tensor([self.fallback_steps, self.token_passes, self.tokens_seen], dtype=torch.long),
                "floats": torch.tensor([self.train_flops, self.train_time_s], dtype=torch.float64),
                "losses": torch.tensor(self.losses, dtype=torch.float64),
                "supervised_weights": torch.tensor(sorted(self.supervised_weights.items()),
                                                   dtype=torch.float64).reshape(-1, 2),
                "placement_kinds": hist(self.placement_kinds),
                "gate_grad_steps": torch.tensor(self.gate_grad_steps, dtype=torch.long),
                "pass_histogram": hist(self.pass_histogram),
                "feedback_token_passes": torch.tensor(self.feedback_token_passes, dtype=torch.long),
                "fixed_point": torch.tensor([self.fixed_point_micro, self.fixed_point_sum], dtype=torch.float64),
                "outer_frozen_steps": torch.tensor(self.outer_frozen_steps, dtype=torch.long)}

    @classmethod
    def from_state(cls, s: dict[str, torch.Tensor]) -> "Counters":
        def hist(t: torch.Tensor) -> Counter:
            return Counter({int(k): int(v) for k, v in t.tolist()})
        fb, tp, ts = s["scalars"].tolist()
        flops, t = s["floats"].tolist()
        # readout_only_rounds is absent from checkpoints written before it was recorded
        readout_only = hist(s["readout_only_rounds"]) if "readout_only_rounds" in s else Counter()
        out = cls(hist(s["depth_histogram"]), hist(s["backward_histogram"]), hist(s["supervised_rounds"]),
                  readout_only, fb, tp, ts, flops, s["losses"].tolist(), t)
        if "supervised_weights" in s:   # absent from checkpoints written before the placement was recorded
            out.supervised_weights = Counter({int(k): v for k, v in s["supervised_weights"].tolist()})
            out.placement_kinds = hist(s["placement_kinds"])
            out.gate_grad_steps = int(s["gate_grad_steps"])
        if "pass_histogram" in s:       # absent from checkpoints written before feedback existed
            out.pass_histogram = hist(s["pass_histogram"])
            out.feedback_token_passes = int(s["feedback_token_passes"])
        if "fixed_point" in s:          # absent from checkpoints written before the term existed
            n, total = s["fixed_point"].tolist()
            out.fixed_point_micro, out.fixed_point_sum = int(n), total
        if "outer_frozen_steps" in s:   # absent from checkpoints written before the field existed
            out.outer_frozen_steps = int(s["outer_frozen_steps"])
        return out


PLACEMENT_KINDS = ("final", "rounds", "every", "learned_exit", "stage2_gate", "act_mixture")
"""The loss placements a micro-batch can use: supervision.kind's five, and stage II's gate loss (new kinds are
appended: saved counters store the index)."""


def prepare_data(recipe: Recipe, run_dir: Path, resume: bool, write: bool = True):
    """Tokenizer + memory-mapped train/val token arrays under RUN/data (reused on resume).
    With data.task: (tokenizer, taskdata.TaskSampler, taskdata.TaskSource) instead. write=False:
    only open what rank 0 wrote (the other processes of a multi-process run)."""
    if recipe.data.task:
        from ..data.taskdata import prepare_task_data
        return prepare_task_data(recipe, run_dir, write=write)
    ddir = run_dir / "data"
    if resume and data_mod.has_tokens(ddir / "train.bin"):     # one file, or a prepared folder's shards
        tok = load_tokenizer(run_dir / "checkpoint")
        return tok, data_mod.open_tokens(ddir / "train.bin"), data_mod.open_tokens(ddir / "val.bin")
    if prepared.is_prepared(recipe.data.path):   # `looplm data prepare` output: its tokens, not the text again
        return prepared.use_prepared(recipe, recipe.data.path, run_dir)
    # any other source is streamed: one pass decides the split, the next ones tokenize each side
    source = open_source(recipe.data.path or None, recipe.data.text_field)
    max_bytes = recipe.data.max_bytes
    split = prepared.split_source(source, max_bytes, recipe.data.val_fraction)
    return prepared.tokenize_splits(recipe.data.tokenizer, recipe.model.vocab_size,
                                    lambda: split.select(source.documents(max_bytes), "train"),
                                    lambda: split.select(source.documents(max_bytes), "val"),
                                    run_dir / "checkpoint", ddir)


def train_step(model: LoopedLM, recipe: Recipe, x: torch.Tensor, y: torch.Tensor, step: int, micro: int,
               counters: Counters, collect_stats: bool = False, mask: torch.Tensor | None = None,
               rounds: int | None = None, supervision=None, round_targets=None, forward=None, scaler=None,
               world: World = SINGLE, rows: slice | None = None, check_lockstep: bool = False,
               valid: torch.Tensor | None = None, eos_id: int | None = None):
    """Forward + backward for one micro-batch; returns (loss value, forward output, loss info).
    rounds / supervision, when given (task data by difficulty), replace the recipe's draws;
    round_targets(r) -> (targets, mask) gives each supervised round its own targets (task traces).
    forward: what runs the model (its DDP or torch.compile wrapper; default the model); scaler: the
    fp16 gradient scaler. world, rows: this process and its rows of the global micro-batch (the
    initial-state noise is drawn for the whole batch and sliced, so every world size computes the
    same thing); check_lockstep: all-gather and compare this micro-batch's depth and window across
    processes (train.lockstep_check). Tensors are moved to the model's device here. The returned loss is this process's
    share of the global mean (sum over processes = the global mean). valid: (B, T) True at real inputs,
    False at padding (task batches, TaskBatch.real_inputs); None: every input is real. Only real
    inputs count as tokens seen and token-passes (the model runs the padding, but it is no data).
    eos_id: the tokenizer's end-of-text id (feedback's start convention after a document boundary).
    With feedback (recipe [feedback]) the micro-batch trains with the passes its mixture draws
    (`feedback_plan`): loss = first pass's + later_weight x the mean of the later passes'."""
    device = model.embed.weight.device
    x, y = x.to(device), y.to(device)
    mask = mask.to(device) if mask is not None else None
    if round_targets is not None:
        targets_at = round_targets
        round_targets = lambda r: tuple(t.to(device) if t is not None else None for t in targets_at(r))  # noqa: E731
    if rounds is None:
        rounds = sample_depth(recipe.depth, recipe.train.seed, step, micro, recipe.train.steps)
    supervision = recipe.supervision if supervision is None else supervision
    window = None if recipe.backward.window == "all" else min(recipe.backward.window, rounds)
    # stage II's gate loss compares every round's readout, whatever the stage-I placement was
    place = placement(SupervisionConfig(kind="every") if recipe.train.stage == 2 else supervision, rounds)
    n_passes, plain = feedback_plan(recipe, x, step, micro, eos_id, rows)
    if world.distributed and check_lockstep:
        lockstep(world, step, micro, rounds, window, n_passes)
    # the noise comes from a CPU generator, so every device draws the same numbers; the generator goes
    # along for the feedback passes' jitter
    gen = depth_generator(recipe.train.seed + 1, step, micro)
    kwargs: dict[str, Any] = {"generator": gen}
    G = recipe.train.batch_size
    if rows is not None and recipe.model.init_state == "random":   # the global batch's noise, our rows
        kwargs["initial_state"] = model.random_state((G, *x.shape[1:], recipe.model.d_model), gen,
                                                    torch.float32, device)[rows]
    warmup = recipe.model.mor != "none" and step < recipe.train.mor_warmup_steps
    if recipe.model.mor != "none":   # Mixture-of-Recursions warm-up: every token at full depth (capacity 1)
        kwargs["full_depth"] = warmup
    if n_passes > 1:     # the K passes run inside one model call: DDP and FSDP see one forward per backward
        kwargs.update(feedback_passes=n_passes, plain=plain, noise_rows=(G, rows) if rows is not None else None)
    fixed_point = recipe.supervision.fixed_point if recipe.train.stage == 1 else 0.0
    if fixed_point:      # the term reads the final rounds' states: keep them, with the final round's gradient
        kwargs["state_loss"] = True
    at = readout_positions(recipe, supervision, place, rounds, mask, round_targets, n_passes)
    if at is not None:
        kwargs["readout_at"] = at
    run = model if forward is None else forward
    with autocast(device, recipe.train.dtype):
        last = run(x, rounds, backward_window=window, readout_rounds=place.rounds, collect_stats=collect_stats,
                   **kwargs)
        outs = [*last.earlier_passes, last]
        out = outs[0]
        if recipe.train.stage == 2:
            loss, info = stage2_loss(model, recipe, out, y, mask)
        else:
            pass_losses = []
            for o in outs:
                pass_loss, pass_info = supervised_loss(supervision, o, y, mask, round_targets)
                if o.aux_losses:           # routed models' auxiliary losses, each by its recipe weight
                    weights = aux_loss_weights(recipe)
                    pass_loss = pass_loss + sum(weights[k] * v for k, v in o.aux_losses.items())
                term = fixed_point_term(o.round_states, recipe.supervision.fixed_point_rounds,
                                        valid.to(device) if valid is not None else None) if fixed_point else None
                if term is not None:       # depth safety: the final rounds' relative state change
                    pass_loss = pass_loss + fixed_point * term
                    pass_info = {**pass_info, "fixed_point_term": term.item()}
                pass_losses.append(pass_loss)
                info = pass_info if o is out else info
            loss = pass_losses[0]
            if n_passes > 1:           # first pass + lambda x mean of the later passes (model/feedback.py)
                later = torch.stack(pass_losses[1:]).mean()
                loss = loss + recipe.feedback.later_weight * later
                info = {**info, "feedback_passes": n_passes, "loss_by_pass": [v.item() for v in pass_losses]}
            if out.aux_losses:
                info = {**info, **{k: v.item() for k, v in out.aux_losses.items()}}
            if out.routed_depth is not None:
                info["mor_mean_depth"] = out.routed_depth.float().mean().item()
                info["mor_full_depth"] = warmup
    if world.size > 1:
        # each process's loss is a mean over its own tokens; weighted by its share of the global
        # batch's scored tokens, the processes' gradients sum (DDP/FSDP average) to the global mean's
        n = float(x.numel() if mask is None else mask.sum().item())
        share = n / (n * world.size if mask is None else all_sum(world, [n])[0])   # equal rows: no collective
        loss = loss * (share * world.size)
        info = {**info, "rank_token_share": share}
    if collect_stats:
        for s in out.round_states:
            if s.requires_grad:
                s.retain_grad()
    scaled = loss / recipe.train.grad_accum
    (scaler.scale(scaled) if scaler is not None else scaled).backward()
    counters.depth_histogram[rounds] += 1
    counters.backward_histogram[len(out.grad_rounds)] += 1
    for r in place.rounds:
        counters.supervised_rounds[r] += 1
    for r, w in info["round_weights"].items():   # what the loss actually weighed, from the loss itself
        counters.supervised_weights[r] += w
    counters.placement_kinds[PLACEMENT_KINDS.index("stage2_gate" if recipe.train.stage == 2 else supervision.kind)] += 1
    for r in out.readout_only_rounds:
        counters.readout_only_rounds[r] += 1
    counters.fallback_steps += int(place.fallback)
    if "fixed_point_term" in info:
        counters.fixed_point_micro += 1
        counters.fixed_point_sum += info["fixed_point_term"]
    real = x.numel() if valid is None else int(valid.sum())
    counters.tokens_seen += real
    counters.token_passes += real * rounds * n_passes      # every pass runs every round
    if recipe.feedback.mode != "none":
        counters.pass_histogram[n_passes] += 1
        counters.feedback_token_passes += real * n_passes
    # every visit that ran: the rounds, the backward over the window, each supervised readout (coda and
    # head, backward where it carries a loss), the prelude's backward where the gradient reaches it
    stage1 = recipe.train.stage == 1
    visits = Visits(rounds=rounds, grad_rounds=len(out.grad_rounds), readouts=len(out.round_logits),
                    grad_readouts=len(place.rounds) if stage1 else 0,
                    head_share=1.0 if at is None else int(at.sum()) / at.numel(),
                    grad_first=1 in out.grad_rounds, **later_visits(out.later_positions, x.shape[1]),
                    prelude_grad=stage1 and prelude_receives_gradient(model.cfg, out.grad_rounds),
                    gate_grad=model.gate is not None and (not stage1 or supervision.kind in ("learned_exit",
                                                                                          "act_mixture")))
    # each pass is a whole forward and backward (the later passes' gradients reach the earlier ones)
    counters.train_flops += n_passes * x.numel() * train_flops_per_token(model.cfg, visits, x.shape[1],
                                                                         model.gate is not None)
    if n_passes > 1:      # the fusion's products in every fed pass: 2 FLOPs a weight forward, 4 backward
        counters.train_flops += (n_passes - 1) * x.numel() * 6 * model.param_groups_by_role()["feedback"]
    counters.last_visits = visits
    return loss.item() / world.size, out, info


def later_visits(later: torch.Tensor | None, T: int) -> dict[str, float]:
    """Visits' later_share and later_keys_factor from the positions rounds after the first ran at
    (LoopOutput.later_positions (B, K); None: every position of T)."""
    if later is None:
        return {}
    return {"later_share": later.shape[1] / T,
            "later_keys_factor": float((later + 1).sum()) / later.numel() / ((T + 1) / 2)}


def readout_positions(recipe: Recipe, supervision, place, rounds: int, mask: torch.Tensor | None,
                      round_targets, n_passes: int) -> torch.Tensor | None:
    """(B, T) bool, the positions any supervised round's loss reads (the answer mask and the trace
    targets' positions), when the step's loss reads only masked positions of per-round readouts: the
    readouts then apply the LM head there alone (LoopedLM.forward's readout_at). None (whole readouts)
    for unmasked data, stage II, the exit-weighted placements and feedback passes."""
    if (mask is None or recipe.train.stage != 1 or n_passes > 1
            or supervision.kind not in ("final", "rounds", "every")):
        return None
    at = mask.bool()
    for r in place.rounds:
        if round_targets is not None and r < rounds:
            m = round_targets(r)[1]
            if m is None:
                return None
            at = at | m.bool()
    return at


def feedback_plan(recipe: Recipe, x: torch.Tensor, step: int, micro: int, eos_id: int | None,
                  rows: slice | None = None) -> tuple[int, torch.Tensor | None]:
    """(passes, plain positions (B, T) or None) of one micro-batch: one plain pass without feedback or
    before feedback.mix_from_step; else the pass count drawn from feedback.passes and, with probability
    feedback.prefix_mix, a plain prefix of random length per row — all from (seed, step, micro), so
    every process draws the same (lockstep) and a resumed run the same as an unbroken one."""
    fb = recipe.feedback
    if fb.mode == "none" or step < fb.mix_from_step:
        return 1, None
    from ..model.feedback import plain_positions
    gen = depth_generator(recipe.train.seed + 3, step, micro)
    passes = int(torch.multinomial(torch.tensor(fb.passes, dtype=torch.float64), 1, generator=gen)) + 1
    prefix = None
    if fb.prefix_mix and float(torch.rand((), generator=gen)) < fb.prefix_mix:
        prefix = torch.randint(1, x.shape[1], (recipe.train.batch_size,), generator=gen)   # the global batch's
        prefix = prefix[rows] if rows is not None else prefix[:x.shape[0]]
    return passes, plain_positions(x, eos_id, fb.reset_at_eos, prefix)


def aux_loss_weights(recipe: Recipe) -> dict[str, float]:
    """The recipe's weight for each auxiliary loss a routed model returns (`LoopOutput.aux_losses`): from
    the recipe's own supervision section, also where a task batch brings its own loss placement."""
    supervision = recipe.supervision
    return {"moe_balance": supervision.moe_balance, "moe_z": supervision.moe_z,
            "mor_balance": supervision.mor_balance, "mor_z": supervision.mor_z, "mor_aux": supervision.mor_aux}


def stage2_loss(model: LoopedLM, recipe: Recipe, out, y: torch.Tensor, mask: torch.Tensor | None):
    """Ouro stage II: only the gate trains, from detached per-token per-round losses."""
    from ..halting import stage2_gate_loss
    from ..model.losses import token_losses
    with torch.no_grad():
        per_round = torch.stack([token_losses(out.round_logits[r], y, mask) for r in range(1, out.rounds + 1)], -1)
    loss = stage2_gate_loss(per_round, out.hazards[..., :out.rounds], k=recipe.train.stage2_k,
                            gamma=recipe.train.stage2_gamma)
    # the BCE averages the R - 1 continue/stop decisions made after rounds 1..R-1
    decisions = range(1, out.rounds)
    return loss, {"gate_loss": loss.item(), "round_weights": {r: 1 / len(decisions) for r in decisions}}


def round_diagnostics(out) -> dict[str, Any]:
    """Per-round state RMS, update RMS and gradient RMS at the state after each round (a log step).
    grad_rms is None (JSON null) for rounds before the backward window: no gradient can reach them."""
    stats = dict(out.stats)
    stats["grad_rms"] = [None if not s.requires_grad else
                         s.grad.float().pow(2).mean().sqrt().item() if s.grad is not None else 0.0
                         for s in out.round_states]
    return stats


def train(recipe: Recipe, out_dir: str | Path, resume: bool = False, quiet: bool = False,
          stop_after: int | None = None, init_from: str | Path | None = None) -> dict[str, Any]:
    """Train `recipe` into `out_dir`; returns the report (an empty dict on ranks other than 0).
    stop_after ends early (tests of resume). init_from: a finished run whose weights (and tokenizer
    and data split) the new run starts from (`looplm train --stage2 RUN`); with train.stage = 2 a
    missing exit gate starts fresh. Under torchrun every process calls this (train.parallel)."""
    device = resolve_device(recipe.train.device)
    world = init_world(recipe.train.parallel, device)
    try:
        return _train(recipe, Path(out_dir), resume, quiet, stop_after, init_from, world,
                      rank_device(device, world))
    finally:
        close_world(world)


def _barrier(world: World) -> None:
    if world.distributed:
        torch.distributed.barrier()


def _train(recipe: Recipe, run_dir: Path, resume: bool, quiet: bool, stop_after: int | None,
           init_from: str | Path | None, world: World, device: torch.device) -> dict[str, Any]:
    # this run's own peak memory (data, training, final evaluation), not earlier runs' in this process
    meter = RunMemory(device)
    if resume:
        if world.main and run_dir.is_dir():
            repair_checkpoint(run_dir)               # finish or discard a swap a kill interrupted
        _barrier(world)
        if not (run_dir / "checkpoint" / "state.pt").is_file():
            hint = (f" (a start interrupted before its first checkpoint left {staging_path(run_dir)}, which holds "
                    "nothing to resume: train without --resume)" if is_stale_staging(staging_path(run_dir)) else "")
            raise UserError(f"--resume: {run_dir} has no checkpoint to resume from{hint}")
        saved = load_recipe(str(run_dir / "recipe.toml"))
        if saved.to_dict() != recipe.to_dict():
            recipe = saved  # the run's own recipe wins; --set on resume would change the experiment
    elif (run_dir / "checkpoint" / "state.pt").exists():
        raise UserError(f"--out {run_dir} already holds a run; pass --resume to continue it or choose another folder")
    else:             # a new run: into an absent or empty folder only, so nothing of anyone's is overwritten
        refuse_foreign(run_dir, "--out", own_kind="a looplm run (continue a run with --resume)")
    if recipe.train.tensorboard:
        require_tensorboard()                        # before any work, not at the first log line
    rows = shard(world, recipe.train.batch_size) if world.size > 1 else None   # this process's share
    _barrier(world)                                  # every process checked the folder before rank 0 writes
    # a new run is built in RUN.partial and moved into place at its first checkpoint, from when on it can be
    # resumed: a start that fails (bad data, bad --init weights, an interrupt before then) leaves nothing
    with Staging(run_dir, "--out", owner=world.main, in_place=resume) as stage:
        return _train_run(recipe, stage, resume, quiet, stop_after, init_from, world, device, meter, rows)


def _train_run(recipe: Recipe, stage: Staging, resume: bool, quiet: bool, stop_after: int | None,
               init_from: str | Path | None, world: World, device: torch.device, meter: RunMemory,
               rows: slice | None) -> dict[str, Any]:
    """The run itself, written into stage.dir (RUN.partial until the first checkpoint moves it to RUN)."""
    run_dir = stage.dir
    if world.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text(run_dir / "recipe.toml", recipe.to_toml())
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)

    if init_from is not None and not resume and world.main:
        _adopt_data(Path(init_from), run_dir)  # same tokenizer and train/val split as the run we start from
    # rank 0 builds the tokenizer and token files; the others open them
    if world.main:
        tok, train_tokens, val_tokens = prepare_data(recipe, run_dir, resume or init_from is not None)
    _barrier(world)
    if not world.main:
        tok, train_tokens, val_tokens = prepare_data(recipe, run_dir, True, write=False)
    seq_len, bs = recipe.data.seq_len, recipe.train.batch_size
    sampler = (train_tokens if recipe.data.task  # task data comes with its own sampler
               else data_mod.TokenSampler(train_tokens, seq_len, bs, recipe.train.seed))
    if not recipe.data.task and len(val_tokens) < seq_len + 1:   # refused now, not after training
        raise UserError(f"data.path {recipe.data.path or '(the embedded corpus)'}: its validation split holds "
                        f"{len(val_tokens)} tokens, and one window of data.seq_len {seq_len} needs {seq_len + 1}; "
                        "use more text, a larger data.val_fraction or a shorter data.seq_len")
    note = val_tokens.short_prompt_note(recipe.data) if recipe.data.task and not resume else None
    if note and not quiet and world.main:
        print(f"note: {note}", file=sys.stderr)
    torch.manual_seed(recipe.train.seed)
    model = build_model(recipe).to(device)      # initialised on the CPU: the same weights on every device and rank
    counters, start, state, fresh = Counters(), 0, None, []
    if resume:
        state = load_state(run_dir)
        load_weights(run_dir, model)             # every process reads the whole weights, before sharding
        sampler.load_state_dict(state["sampler"])
        counters = Counters.from_state(state["counters"])
        start = int(state["step"])
        init_from = state.get("init_from") or None
        fresh = list(state.get("init_fresh_modules", []))
    elif init_from is not None:      # modules the recipe adds to the run it starts from keep their initialisation
        fresh = load_weights(init_from, model, allow_missing=FRESH_MODULES)
    if recipe.train.stage == 2:                  # the LM frozen before DDP/FSDP see which parameters train
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("gate."))
    if recipe.train.activation_checkpointing:
        checkpoint_core(model)
    parallel = recipe.train.parallel
    runner = parallelize(model, parallel, world)
    forward = compiled(runner, recipe.train.compile)
    scaler = grad_scaler(device, recipe.train.dtype)
    opt = make_optimizer(model, recipe, trainable_only=True)
    names = _optimizer_names(model, opt)
    outer = [p for n, p in model.named_parameters() if n.startswith(OUTER_MODULES)]
    if state is not None:
        saved_opt = optimizer_state_for(state["optimizer"], int(state["version"]), names)
        if parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(model, opt, saved_opt, options=StateDictOptions(full_state_dict=True))
        else:
            opt.load_state_dict(optimizer_state_by_index(saved_opt, names))
    if world.main:
        if resume:
            _truncate_metrics(run_dir / "metrics.jsonl", start)
        elif (run_dir / "metrics.jsonl").exists():
            (run_dir / "metrics.jsonl").unlink()
    origin = {"init_from": str(init_from), "init_fresh_modules": fresh} if init_from is not None else {}

    def checkpoint(step: int) -> None:
        # every process takes part in gathering (FSDP); rank 0 writes the whole checkpoint
        nonlocal run_dir
        plain, opt_state = gather_state(model, opt, recipe, parallel, world)
        if world.main:
            save_checkpoint(run_dir, plain, {**origin, "step": step, "optimizer": opt_state,
                                             "sampler": sampler.state_dict(), "counters": counters.to_state(),
                                             "world_size": world.size})
        if not stage.committed:       # the first checkpoint: the run is resumable, so it moves into place
            if tb is not None:
                tb.close()                # its event file is reopened in the moved folder
            stage.commit()
            run_dir = stage.dir
            if tb is not None:
                tb.reopen(run_dir)
        _barrier(world)

    total = recipe.train.steps if stop_after is None else min(recipe.train.steps, stop_after)
    bar = tqdm(range(start, total), initial=start, total=recipe.train.steps, file=sys.stderr,
               disable=quiet or not world.main, desc="train", dynamic_ncols=True)
    model.train()
    metrics = open(run_dir / "metrics.jsonl", "a") if world.main else None
    tb = TensorBoardLog(run_dir, start if resume else None) if recipe.train.tensorboard and world.main else None
    t_window, tok_window = time.perf_counter(), 0
    accum = recipe.train.grad_accum
    for step in bar:
        t0 = time.perf_counter()
        lr = lr_at(step, recipe)
        set_lr(opt, lr)
        align_now = bool(recipe.train.alignment_every) and step % recipe.train.alignment_every == 0
        log_now = step % recipe.train.log_every == 0 or step == total - 1 or align_now
        step_loss, depths, info, out = 0.0, [], {}, None
        routed_counts = []                 # Mixture-of-Recursions: tokens per routed depth, this step
        # what each process counts of its own rows, summed over the processes after the step
        summed = ("tokens_seen", "token_passes", "feedback_token_passes", "train_flops")
        before_counts = [getattr(counters, k) for k in summed]
        for micro in range(accum):
            x, y, *task_opts = sampler.batch(step * accum + micro, rows)  # task: + mask, rounds
            with no_sync(runner, parallel, last=micro == accum - 1):
                loss, out, info = train_step(model, recipe, x, y, step, micro, counters, collect_stats=log_now,
                                             forward=forward, scaler=scaler, world=world, rows=rows,
                                             eos_id=getattr(tok, "eos_id", None),
                                             check_lockstep=recipe.train.lockstep_check == "every"
                                             or (step == start and micro == 0),
                                             **(task_opts[0] if task_opts else {}))
            step_loss += loss / accum
            depths.append(out.rounds)
            if out.routed_depth is not None:
                routed_counts.append(depth_counts(out.routed_depth, recipe.depth.rounds))
            if align_now and micro == 0 and world.main:    # before the optimizer step: this step's weights
                from .alignment import measure_alignment
                opts = {k: v for k, v in (task_opts[0] if task_opts else {}).items() if k != "rounds"}
                alignment = measure_alignment(model, recipe, out.rounds, lambda m, rec: train_step(
                    m, rec, x, y, step, 0, Counters(), rounds=out.rounds, **opts))
            tok_window += x.numel()  # task batches vary in length
        if world.size > 1:   # the step's global loss and the work every process did
            delta = [getattr(counters, k) - b for k, b in zip(summed, before_counts)]
            local_tokens = delta[0]
            step_loss, *delta = all_sum(world, [step_loss, *delta])
            for k, b, d in zip(summed, before_counts, delta):   # all_sum is float64: exact for the counts
                setattr(counters, k, type(b)(b + d))
            tok_window += int(delta[0]) - local_tokens          # tokens/s of the whole job
        if model.gate is not None:   # the recipe card's gate line comes from these steps, not from the recipe
            sums = [full_tensor(p.grad.detach().abs().sum()) for p in model.gate.parameters() if p.grad is not None]
            counters.gate_grad_steps += int(bool(sums) and torch.stack(sums).sum().item() > 0)   # one host sync
        if step < recipe.train.freeze_outer_steps:      # a first phase in which only the loop learns
            for p in outer:
                p.grad = None
            counters.outer_frozen_steps += 1
        clip = recipe.optim.grad_clip
        params = [p for g in opt.param_groups for p in g["params"]]
        scaler.unscale_(opt)        # clip the true gradients (a no-op unless fp16)
        gnorm = full_tensor(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))).item()
        before = [(n, p.detach().clone()) for n, p in model.core.named_parameters()] if log_now else None
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if routed_counts and recipe.supervision.mor_bias_rate > 0:   # loss-free balancing, the same on every rank
            counts = torch.stack(routed_counts).sum(0)
            if world.size > 1:
                counts = torch.tensor(all_sum(world, counts.tolist()))
            update_bias(model.mor_bias, counts, recipe.supervision.mor_bias_rate)
        counters.losses.append(step_loss)
        dt = time.perf_counter() - t0
        counters.train_time_s += dt
        bar.set_postfix(loss=f"{step_loss:.3f}", rounds=",".join(map(str, depths)),
                        tok_s=f"{tok_window / max(1e-9, time.perf_counter() - t_window):.0f}")
        if log_now:
            row = {"step": step, "loss": step_loss, "lr": lr, "rounds": depths, "grad_norm": gnorm,
                   "tokens_per_s": tok_window / max(1e-9, time.perf_counter() - t_window),
                   "grad_rounds": list(out.grad_rounds), **{k: v for k, v in info.items() if k not in ("round_losses", "round_weights")}}
            if "round_losses" in info:
                row["round_losses"] = {str(k): v for k, v in info["round_losses"].items()}
            row.update(round_diagnostics(out))
            if align_now and world.main:
                row["alignment"] = alignment
            with torch.no_grad():   # sharded tensors (FSDP) sum over every process's shard
                sq = [(n, full_tensor((p - b).pow(2).sum()).item(), full_tensor(b.pow(2).sum()).item())
                      for p, (n, b) in zip(model.core.parameters(), before)]
                row["core_update_ratio"] = math.sqrt(sum(d for _, d, _ in sq) / max(sum(w for _, _, w in sq), 1e-30))
                # ||dW|| / ||W|| of every shared core tensor: the update each visit's sum produced
                row["update_ratio"] = {f"core.{n}": math.sqrt(d / max(w, 1e-30)) for n, d, w in sq}
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            if tb is not None:
                tb.write(row)
            t_window, tok_window = time.perf_counter(), 0
        if (step + 1) % recipe.train.checkpoint_every == 0 or step + 1 == total:
            checkpoint(step + 1)
    bar.close()
    if metrics is not None:
        metrics.close()
    mem = meter.report()      # the other ranks' final figures (only rank 0 evaluates)
    peak_rss = all_gather_ints(world, [mem["peak_rss_bytes"], mem["peak_device_memory_bytes"] or 0,
                                       -1 if mem["rss_growth_bytes"] is None else mem["rss_growth_bytes"]])
    if total < recipe.train.steps:
        if tb is not None:
            tb.close()
        return {"steps": total, "stopped_early": True}
    if not world.main:
        return {}

    from ..runs.report import write_report
    plain = model if parallel != "fsdp" else _plain_copy(recipe, run_dir, device)
    report = build_report(recipe, plain, sampler, counters, val_tokens, run_dir, getattr(tok, "eos_id", None))
    report.update(origin)
    report["optimizer"] = optimizer_record(model, opt)
    report["device"] = str(device)
    report["precision"] = recipe.train.dtype
    report["compiled"] = recipe.train.compile
    report["parallel"] = parallel
    report["world_size"] = world.size
    report["global_batch"] = {"sequences_per_step": recipe.train.batch_size * accum,
                              "per_process_micro_batch": recipe.train.batch_size // world.size,
                              "processes": world.size, "grad_accum": accum}
    mem = meter.report()      # after the final evaluation
    report.update(mem)
    peak_rss[0] = [mem["peak_rss_bytes"], mem["peak_device_memory_bytes"] or 0,
                   -1 if mem["rss_growth_bytes"] is None else mem["rss_growth_bytes"]]
    report["peak_rss_bytes_per_rank"] = [r[0] for r in peak_rss]
    report["rss_growth_bytes_per_rank"] = [None if r[2] < 0 else r[2] for r in peak_rss]
    report["peak_device_memory_bytes_per_rank"] = [r[1] or None for r in peak_rss]
    from ..evaluation.routing import plot_recursions, plot_routing
    plots = {name: (lambda path, draw=draw, key=key: draw(path, report[key]))
             for name, draw, key in (("routing.png", plot_routing, "routing"),
                                     ("recursions.png", plot_recursions, "recursions")) if report.get(key)}
    write_report(run_dir, report, plots)
    if tb is not None:
        tb.write({"val_loss": {f"rounds_{r}": v for r, v in report["val_loss_by_rounds"].items()}}, step=total)
        tb.close()
    return report


def _optimizer_names(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters by name, in its order (the index a plain state_dict keys them by)."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for g in opt.param_groups for p in g["params"]]


def gather_state(model: torch.nn.Module, opt: torch.optim.Optimizer, recipe: Recipe, parallel: str,
                 world: World) -> tuple[torch.nn.Module | None, dict[str, Any] | None]:
    """(a plain module holding the whole weights, the optimizer state keyed by parameter name) on
    rank 0, (None, None) elsewhere. With FSDP every process must call it: the shards are gathered
    (`torch.distributed.checkpoint.state_dict`, full state, offloaded to the CPU)."""
    if parallel != "fsdp":
        if not world.main:
            return None, None
        sd = opt.state_dict()
        names = _optimizer_names(model, opt)
        return model, {"state": {names[i]: v for i, v in sd["state"].items()},
                       "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    opt_state = get_optimizer_state_dict(model, opt, options=options)
    if not world.main:
        return None, None
    plain = build_model(recipe)
    plain.load_state_dict(weights)
    return plain, opt_state


def _plain_copy(recipe: Recipe, run_dir: Path, device: torch.device) -> LoopedLM:
    """The run's final weights as a plain module on `device` (what rank 0 evaluates after FSDP)."""
    plain = build_model(recipe)
    load_weights(run_dir, plain)
    return plain.to(device)


def stage2_recipe(run: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """The recipe of `looplm train --stage2 RUN`: RUN's own recipe with train.stage = 2 and an exit
    gate, plus --set overrides (Ouro stage II: the LM frozen, only the gate trains)."""
    from ..recipe.config import derive_recipe, read_recipe_dict
    src = Path(run)
    if not (src / "recipe.toml").is_file() or not (src / "checkpoint" / "model.safetensors").is_file():
        raise UserError(f"--stage2 {src}: not a finished looplm run (needs recipe.toml and checkpoint/model.safetensors)")
    data = read_recipe_dict(str(src / "recipe.toml"))
    data["name"] = f"{data.get('name', 'run')}-stage2"
    # stage-I fields that stage II does not read (its loss placement, ...) go back to their defaults;
    # the run they describe is recorded as init_from
    recipe = derive_recipe(data, {"train.stage": 2, "exit.gate": True, **(overrides or {})})
    if recipe.train.stage != 2:
        raise UserError("--stage2: train.stage must stay 2 (the language model is frozen; only the gate trains)")
    return recipe


def init_recipe(run: str | Path, recipe_path: str | None, overrides: dict[str, Any] | None = None) -> Recipe:
    """The recipe of `looplm train --init RUN`: RUN's recipe (or --recipe's, whose model must take RUN's
    weights) with --set overrides, every training control available; the weights start from RUN's."""
    from ..recipe.config import derive_recipe, read_recipe_dict
    src = Path(run)
    if not (src / "recipe.toml").is_file() or not (src / "checkpoint" / "model.safetensors").is_file():
        raise UserError(f"--init {src}: not a looplm run (needs recipe.toml and checkpoint/model.safetensors)")
    own = read_recipe_dict(str(src / "recipe.toml"))
    data = read_recipe_dict(recipe_path) if recipe_path else own
    if data.get("model") != own.get("model"):      # the weights decide the model (--set may still change it)
        print(f"--init {src}: the model section comes from the run (its weights), not from --recipe",
              file=sys.stderr)
        data = {**data, "model": own["model"]}
    if own.get("data", {}).get("tokenizer") == "pretrained":     # an imported model keeps its own tokenizer
        data = {**data, "data": {**data.get("data", {}), "tokenizer": "pretrained"}}
    return derive_recipe(data, overrides or {})


def _adopt_data(src: Path, run_dir: Path) -> None:
    """Copy a run's tokenizer files and token split into a new run folder."""
    import shutil
    if not (src / "checkpoint").is_dir():
        raise UserError(f"init run {src}: no checkpoint/ folder")
    # checked where they lie, so a refusal names the run's own files rather than their copies
    load_tokenizer(src / "checkpoint")
    for split in ("train", "val"):
        if data_mod.has_tokens(src / "data" / f"{split}.bin"):
            data_mod.open_tokens(src / "data" / f"{split}.bin")
    (run_dir / "checkpoint").mkdir(parents=True, exist_ok=True)
    for f in (src / "checkpoint").iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "state.pt") and not f.name.startswith("."):
            shutil.copy2(f, run_dir / "checkpoint" / f.name)
    if (src / "data").is_dir():   # token files hard-linked where possible: a prepared corpus is not copied
        shutil.copytree(src / "data", run_dir / "data", dirs_exist_ok=True,
                        copy_function=lambda a, b: prepared.link_or_copy(Path(a), Path(b)))


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric rows logged after the checkpoint we resume from (they will be logged again)."""
    if not path.exists():
        return
    rows = [row for row in read_metrics(path.parent) if row["step"] < step]
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def placement_record(counters: Counters) -> dict[str, Any]:
    """Loss placement as the trainer's per-micro-batch record has it: the kinds used (one, unless the
    run mixed them), the rounds whose loss carried weight, and each one's weight averaged over every
    micro-batch (0 where it was not read out; under learned_exit, its mean exit mass). The weights
    sum to 1: each micro-batch's do."""
    kinds = [PLACEMENT_KINDS[k] for k in sorted(counters.placement_kinds)]
    rounds = sorted(r for r, w in counters.supervised_weights.items() if w > 0)
    micro = max(1, sum(counters.placement_kinds.values()))
    return {"kind": kinds[0] if len(kinds) == 1 else kinds, "rounds": rounds,
            "weights": [counters.supervised_weights[r] / micro for r in rounds]}


def build_report(recipe: Recipe, model: LoopedLM, sampler, counters: Counters, val_tokens, run_dir: Path,
                 eos_id: int | None = None) -> dict:
    mean_depth = (sum(k * v for k, v in counters.depth_histogram.items()) / max(1, sum(counters.depth_histogram.values())))
    rounds_list = eval_rounds_list(recipe, mean_depth)
    model.eval()
    task: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    profile = None          # held-out loss, state RMS and change by rounds (language-model runs)
    if recipe.data.task:  # answer-token loss and exact match on held-out examples
        from ..evaluation.tasks import task_report
        task = task_report(model, recipe, sampler, val_tokens, rounds_list)
        val = task.pop("val")
    else:
        batches = data_mod.val_batches(val_tokens, recipe.data.seq_len, recipe.train.batch_size,
                                       recipe.train.eval_batches)
        # one pass reads out every depth 1..2x the training maximum (depth extrapolation) too
        extrap = extrapolation_rounds(recipe)
        profile = evaluate_rounds(model, batches, sorted(set(rounds_list) | set(extrap)), states=True)
        val = {r: profile[r] for r in rounds_list}
        extra = {"val_loss_extrapolation": {str(r): profile[r]["loss"] for r in extrap}}
        sections = []    # report.md's sections for what evaluation measured (runs/ renders, never measures)
        if model.cfg.moe_experts:   # how tokens use the shared experts across visits
            from ..evaluation.routing import routing_markdown, routing_report
            extra["routing"] = routing_report(model, batches, recipe.depth.rounds)
            sections.append({"title": "Routing (LoopMoE)", "markdown": routing_markdown(extra["routing"])})
        if model.cfg.mor != "none":  # the depths the router chose
            from ..evaluation.routing import recursions_markdown, recursions_report
            extra["recursions"] = recursions_report(model, batches)
            sections.append({"title": "Mixture-of-Recursions routing",
                             "markdown": recursions_markdown(extra["recursions"])})
        if sections:
            extra["sections"] = sections
        if model.feedback is not None:   # what feedback does to held-out loss: one, two, three passes
            from ..evaluation.feedback import loss_by_passes
            extra["feedback_val_loss_by_passes"] = loss_by_passes(model, batches, recipe, eos_id,
                                                                  max(3, len(recipe.feedback.passes)))
    if model.feedback is not None:
        n = sum(counters.pass_histogram.values())
        fb = extra["feedback"] = {
            "mode": recipe.feedback.mode, "extra_parameters": model.param_groups_by_role()["feedback"],
            "passes_histogram": {str(k): v for k, v in sorted(counters.pass_histogram.items())},
            "mean_passes": sum(k * v for k, v in counters.pass_histogram.items()) / max(1, n),
            "token_passes": counters.feedback_token_passes,
            "objective": "first pass's loss + later_weight x the mean of the later passes' (a multi-pass "
                         "micro-batch's training loss is about 1 + later_weight times a one-pass one's)"}
        by = extra.get("feedback_val_loss_by_passes", {})
        extra.setdefault("sections", []).append({"title": "Full-bandwidth feedback", "markdown": "\n".join([
            f"- fusion `{fb['mode']}`, {fb['extra_parameters']:,} extra weights; micro-batches by passes "
            f"{fb['passes_histogram']} (mean {fb['mean_passes']:.3f}, plain pre-training before step "
            f"{recipe.feedback.mix_from_step} included); tokens x passes {fb['token_passes']:,}",
            f"- training loss is the objective: {fb['objective']}",
            *(["- held-out loss by passes at the recipe's depth: " + ", ".join(f"{k}: {v:.4f}" for k, v in by.items())]
              if by else [])])})
    tail = counters.losses[-max(1, len(counters.losses) // 10):]
    return {
        "recipe": recipe.to_dict(),
        "steps": len(counters.losses),
        "unique_tokens": sampler.unique_tokens(),
        "tokens_seen": counters.tokens_seen,
        "outer_frozen_steps": counters.outer_frozen_steps,
        "token_passes": counters.token_passes,
        "params_stored": model.params_stored(),
        "params_per_token_visit": model.params_per_token_visit(mean_depth),
        "params_by_role": model.param_groups_by_role(),
        "train_flops": counters.train_flops,
        "mean_train_rounds": mean_depth,
        "expected_train_rounds": expected_depth(recipe.depth, total_steps=recipe.train.steps),
        "depth_histogram": {str(k): v for k, v in sorted(counters.depth_histogram.items())},
        "backward_histogram": {str(k): v for k, v in sorted(counters.backward_histogram.items())},
        "loss_placement": {**placement_record(counters),
                           "supervised_round_counts": {str(k): v for k, v in sorted(counters.supervised_rounds.items())},
                           "readout_only_round_counts": {str(k): v for k, v in sorted(counters.readout_only_rounds.items())},
                           "fallback_to_final_steps": counters.fallback_steps},
        "depth_safety": depth_safety_record(recipe, model, counters, profile),
        **({"exit_gate": {"steps_with_gradient": counters.gate_grad_steps, "steps": len(counters.losses),
                          "parameters": sum(p.numel() for p in model.gate.parameters())}}
           if model.gate is not None else {}),
        "train_loss_final": sum(tail) / len(tail),
        "val_loss_by_rounds": {str(r): v["loss"] for r, v in val.items()},
        "val_rounds_never_trained": [r for r in rounds_list if r not in counters.depth_histogram],
        "wall_time_s": counters.train_time_s,
        "tokens_per_s": counters.tokens_seen / max(1e-9, counters.train_time_s),
        "train_data_tokens": int(len(sampler.tokens)) if not task else task["train_data_tokens"],
        **task,
        **extra,
    }
