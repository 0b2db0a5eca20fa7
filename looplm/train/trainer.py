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
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..data import text as data_mod
from ..runs.checkpoint import load_state, load_weights, save_checkpoint, write_text
from ..recipe.config import Recipe, SupervisionConfig, load_recipe
from .depth import depth_generator, expected_depth, sample_depth
from ..device import autocast, compiled, grad_scaler, peak_device_memory_bytes, resolve_device
from ..errors import UserError
from ..evaluation.rounds import eval_rounds_list, evaluate_rounds, extrapolation_rounds
from ..model.losses import placement, supervised_loss
from ..model.looped import LoopedLM, build_model
from ..data.tokenizer import build_tokenizer, load_tokenizer


def peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def lr_at(step: int, recipe: Recipe) -> float:
    o, total = recipe.optim, recipe.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    floor = o.lr * o.min_lr_ratio
    if o.schedule == "constant":
        return o.lr
    if o.schedule == "wsd":
        decay_start = total - int(round(o.decay_fraction * total))
        if step < decay_start:
            return o.lr
        frac = (step - decay_start + 1) / max(1, total - decay_start)
        return o.lr + (floor - o.lr) * frac
    frac = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return floor + (o.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def make_optimizer(model: torch.nn.Module, recipe: Recipe, trainable: set[str] | None = None) -> torch.optim.AdamW:
    """AdamW; matrices decay, norms/biases/embeddings do not. named_parameters() yields a shared
    tensor once, so the optimizer sees each shared tensor once."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if trainable is not None and name not in trainable:
            p.requires_grad_(False)
            continue
        (decay if p.dim() >= 2 and not name.startswith("embed") else no_decay).append(p)
    o = recipe.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


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

    def to_state(self) -> dict[str, torch.Tensor]:
        def hist(c: Counter) -> torch.Tensor:
            return torch.tensor(sorted(c.items()), dtype=torch.long).reshape(-1, 2)
        return {"depth_histogram": hist(self.depth_histogram), "backward_histogram": hist(self.backward_histogram),
                "supervised_rounds": hist(self.supervised_rounds),
                "readout_only_rounds": hist(self.readout_only_rounds),
                "scalars": torch.tensor([self.fallback_steps, self.token_passes, self.tokens_seen], dtype=torch.long),
                "floats": torch.tensor([self.train_flops, self.train_time_s], dtype=torch.float64),
                "losses": torch.tensor(self.losses, dtype=torch.float64)}

    @classmethod
    def from_state(cls, s: dict[str, torch.Tensor]) -> "Counters":
        def hist(t: torch.Tensor) -> Counter:
            return Counter({int(k): int(v) for k, v in t.tolist()})
        fb, tp, ts = s["scalars"].tolist()
        flops, t = s["floats"].tolist()
        # readout_only_rounds is absent from checkpoints written before it was recorded
        readout_only = hist(s["readout_only_rounds"]) if "readout_only_rounds" in s else Counter()
        return cls(hist(s["depth_histogram"]), hist(s["backward_histogram"]), hist(s["supervised_rounds"]),
                   readout_only, fb, tp, ts, flops, s["losses"].tolist(), t)


def prepare_data(recipe: Recipe, run_dir: Path, resume: bool):
    """Tokenizer + memory-mapped train/val token arrays under RUN/data (reused on resume).
    With data.task: (tokenizer, taskdata.TaskSampler, taskdata.TaskSource) instead."""
    if recipe.data.task:
        from ..data.taskdata import prepare_task_data
        return prepare_task_data(recipe, run_dir)
    ddir = run_dir / "data"
    if resume and (ddir / "train.bin").exists():
        tok = load_tokenizer(run_dir / "checkpoint")
        return tok, data_mod.open_tokens(ddir / "train.bin"), data_mod.open_tokens(ddir / "val.bin")
    docs = data_mod.read_documents(recipe.data.path or None, recipe.data.max_bytes)
    train_docs, val_docs = data_mod.split_documents(docs, recipe.data.val_fraction)
    tok = build_tokenizer(recipe.data.tokenizer, (t for _, t in train_docs), recipe.model.vocab_size)
    if tok.vocab_size > recipe.model.vocab_size:
        raise UserError(f"model.vocab_size {recipe.model.vocab_size} is smaller than the tokenizer's {tok.vocab_size}")
    tok.save(run_dir / "checkpoint")
    train = data_mod.encode_to_memmap(train_docs, tok, ddir / "train.bin")
    val = data_mod.encode_to_memmap(val_docs, tok, ddir / "val.bin")
    return tok, train, val


def train_step(model: LoopedLM, recipe: Recipe, x: torch.Tensor, y: torch.Tensor, step: int, micro: int,
               counters: Counters, collect_stats: bool = False, mask: torch.Tensor | None = None,
               rounds: int | None = None, supervision=None, round_targets=None, forward=None, scaler=None):
    """Forward + backward for one micro-batch; returns (loss value, forward output, loss info).
    rounds / supervision, when given (task data by difficulty), replace the recipe's draws;
    round_targets(r) -> (targets, mask) gives each supervised round its own targets (task traces).
    forward: what runs the model (a torch.compile wrapper of it; default the model); scaler: the
    fp16 gradient scaler. Tensors are moved to the model's device here."""
    device = model.embed.weight.device
    x, y = x.to(device), y.to(device)
    mask = mask.to(device) if mask is not None else None
    if round_targets is not None:
        targets_at = round_targets
        round_targets = lambda r: tuple(t.to(device) if t is not None else None for t in targets_at(r))  # noqa: E731
    if rounds is None:
        rounds = sample_depth(recipe.depth, recipe.train.seed, step, micro)
    supervision = recipe.supervision if supervision is None else supervision
    window = None if recipe.backward.window == "all" else min(recipe.backward.window, rounds)
    # stage II's gate loss compares every round's readout, whatever the stage-I placement was
    place = placement(SupervisionConfig(kind="every") if recipe.train.stage == 2 else supervision, rounds)
    with autocast(device, recipe.train.dtype):
        # the initial-state noise comes from a CPU generator, so every device draws the same numbers
        out = (model if forward is None else forward)(x, rounds, backward_window=window, readout_rounds=place.rounds,
                                 generator=depth_generator(recipe.train.seed + 1, step, micro),
                                 collect_stats=collect_stats)
        if recipe.train.stage == 2:
            loss, info = stage2_loss(model, recipe, out, y, mask)
        else:
            loss, info = supervised_loss(supervision, out, y, mask, round_targets)
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
    for r in out.readout_only_rounds:
        counters.readout_only_rounds[r] += 1
    counters.fallback_steps += int(place.fallback)
    counters.tokens_seen += x.numel()
    counters.token_passes += x.numel() * rounds
    counters.train_flops += x.numel() * model.flops_per_token(rounds, x.shape[1], len(out.grad_rounds))
    return loss.item(), out, info


def stage2_loss(model: LoopedLM, recipe: Recipe, out, y: torch.Tensor, mask: torch.Tensor | None):
    """Ouro stage II: only the gate trains, from detached per-token per-round losses."""
    from ..halting import stage2_gate_loss
    from ..model.losses import token_losses
    with torch.no_grad():
        per_round = torch.stack([token_losses(out.round_logits[r], y, mask) for r in range(1, out.rounds + 1)], -1)
    loss = stage2_gate_loss(per_round, out.hazards[..., :out.rounds], k=recipe.train.stage2_k,
                            gamma=recipe.train.stage2_gamma)
    return loss, {"gate_loss": loss.item()}


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
    """Train `recipe` into `out_dir`; returns the report. stop_after ends early (tests of resume).
    init_from: a finished run whose weights (and tokenizer and data split) the new run starts from
    (`looplm train --stage2 RUN`); with train.stage = 2 a missing exit gate starts fresh."""
    run_dir = Path(out_dir)
    if resume:
        if not (run_dir / "checkpoint" / "state.pt").is_file():
            raise UserError(f"--resume: {run_dir} has no checkpoint to resume from")
        saved = load_recipe(str(run_dir / "recipe.toml"))
        if saved.to_dict() != recipe.to_dict():
            recipe = saved  # the run's own recipe wins; --set on resume would change the experiment
    elif (run_dir / "checkpoint" / "state.pt").exists():
        raise UserError(f"--out {run_dir} already holds a run; pass --resume to continue it or choose another folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / "recipe.toml", recipe.to_toml())
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)

    if init_from is not None and not resume:
        init_from = Path(init_from)
        _adopt_data(init_from, run_dir)  # same tokenizer and train/val split as the run we start from
    tok, train_tokens, val_tokens = prepare_data(recipe, run_dir, resume or init_from is not None)
    seq_len, bs = recipe.data.seq_len, recipe.train.batch_size
    sampler = (train_tokens if recipe.data.task  # task data comes with its own sampler
               else data_mod.TokenSampler(train_tokens, seq_len, bs, recipe.train.seed))
    torch.manual_seed(recipe.train.seed)
    device = resolve_device(recipe.train.device)
    model = build_model(recipe).to(device)      # initialised on the CPU: the same weights on every device
    forward = compiled(model, recipe.train.compile)
    scaler = grad_scaler(device, recipe.train.dtype)
    trainable = {n for n, _ in model.named_parameters() if n.startswith("gate.")} if recipe.train.stage == 2 else None
    opt = make_optimizer(model, recipe, trainable)
    counters, start = Counters(), 0
    if resume:
        state = load_state(run_dir)
        load_weights(run_dir, model)
        opt.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        counters = Counters.from_state(state["counters"])
        start = int(state["step"])
        _truncate_metrics(run_dir / "metrics.jsonl", start)
    elif (run_dir / "metrics.jsonl").exists():
        (run_dir / "metrics.jsonl").unlink()
    if resume:
        init_from = state.get("init_from") or None
    elif init_from is not None:
        load_weights(init_from, model, allow_missing="gate." if recipe.train.stage == 2 else None)
    origin = {"init_from": str(init_from)} if init_from is not None else {}

    def checkpoint(step: int) -> None:
        save_checkpoint(run_dir, model, {**origin, "step": step, "optimizer": opt.state_dict(),
                                         "sampler": sampler.state_dict(), "counters": counters.to_state()})

    total = recipe.train.steps if stop_after is None else min(recipe.train.steps, stop_after)
    bar = tqdm(range(start, total), initial=start, total=recipe.train.steps, file=sys.stderr,
               disable=quiet, desc="train", dynamic_ncols=True)
    model.train()
    metrics = open(run_dir / "metrics.jsonl", "a")
    t_window, tok_window = time.perf_counter(), 0
    for step in bar:
        t0 = time.perf_counter()
        lr = lr_at(step, recipe)
        for group in opt.param_groups:
            group["lr"] = lr
        log_now = step % recipe.train.log_every == 0 or step == total - 1
        step_loss, depths, info, out = 0.0, [], {}, None
        for micro in range(recipe.train.grad_accum):
            x, y, *task_opts = sampler.batch(step * recipe.train.grad_accum + micro)  # task: + mask, rounds
            loss, out, info = train_step(model, recipe, x, y, step, micro, counters, collect_stats=log_now,
                                         forward=forward, scaler=scaler, **(task_opts[0] if task_opts else {}))
            step_loss += loss / recipe.train.grad_accum
            depths.append(out.rounds)
            tok_window += x.numel()  # task batches vary in length
        clip = recipe.optim.grad_clip
        params = [p for g in opt.param_groups for p in g["params"]]
        scaler.unscale_(opt)        # clip the true gradients (a no-op unless fp16)
        gnorm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")).item()
        before = [p.detach().clone() for p in model.core.parameters()] if log_now else None
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        counters.losses.append(step_loss)
        dt = time.perf_counter() - t0
        counters.train_time_s += dt
        bar.set_postfix(loss=f"{step_loss:.3f}", rounds=",".join(map(str, depths)),
                        tok_s=f"{tok_window / max(1e-9, time.perf_counter() - t_window):.0f}")
        if log_now:
            row = {"step": step, "loss": step_loss, "lr": lr, "rounds": depths, "grad_norm": gnorm,
                   "tokens_per_s": tok_window / max(1e-9, time.perf_counter() - t_window),
                   "grad_rounds": list(out.grad_rounds), **{k: v for k, v in info.items() if k != "round_losses"}}
            if "round_losses" in info:
                row["round_losses"] = {str(k): v for k, v in info["round_losses"].items()}
            row.update(round_diagnostics(out))
            with torch.no_grad():
                num = sum((p - b).pow(2).sum() for p, b in zip(model.core.parameters(), before))
                den = sum(b.pow(2).sum() for b in before)
                row["core_update_ratio"] = math.sqrt(num.item() / max(den.item(), 1e-30))
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            t_window, tok_window = time.perf_counter(), 0
        if (step + 1) % recipe.train.checkpoint_every == 0 or step + 1 == total:
            checkpoint(step + 1)
    bar.close()
    metrics.close()
    if total < recipe.train.steps:
        return {"steps": total, "stopped_early": True}

    from ..runs.report import write_report
    report = build_report(recipe, model, sampler, counters, val_tokens, run_dir)
    report.update(origin)
    report["device"] = str(device)
    report["precision"] = recipe.train.dtype
    report["compiled"] = recipe.train.compile
    report["peak_device_memory_bytes"] = peak_device_memory_bytes(device)
    write_report(run_dir, report)
    return report


def stage2_recipe(run: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """The recipe of `looplm train --stage2 RUN`: RUN's own recipe with train.stage = 2 and an exit
    gate, plus --set overrides (Ouro stage II: the LM frozen, only the gate trains)."""
    from ..recipe.config import apply_overrides, read_recipe_dict, recipe_from_dict
    src = Path(run)
    if not (src / "recipe.toml").is_file() or not (src / "checkpoint" / "model.safetensors").is_file():
        raise UserError(f"--stage2 {src}: not a finished looplm run (needs recipe.toml and checkpoint/model.safetensors)")
    data = read_recipe_dict(str(src / "recipe.toml"))
    data.setdefault("train", {})["stage"] = 2
    data.setdefault("exit", {})["gate"] = True
    data["name"] = f"{data.get('name', 'run')}-stage2"
    recipe = recipe_from_dict(apply_overrides(data, overrides or {}))
    if recipe.train.stage != 2:
        raise UserError("--stage2: train.stage must stay 2 (the language model is frozen; only the gate trains)")
    return recipe


def _adopt_data(src: Path, run_dir: Path) -> None:
    """Copy a run's tokenizer files and token split into a new run folder."""
    import shutil
    if not (src / "checkpoint").is_dir():
        raise UserError(f"init run {src}: no checkpoint/ folder")
    (run_dir / "checkpoint").mkdir(parents=True, exist_ok=True)
    for f in (src / "checkpoint").iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "state.pt") and not f.name.startswith("."):
            shutil.copy2(f, run_dir / "checkpoint" / f.name)
    if (src / "data").is_dir():
        shutil.copytree(src / "data", run_dir / "data", dirs_exist_ok=True)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric rows logged after the checkpoint we resume from (they will be logged again)."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] < step]
    write_text(path, "".join(r + "\n" for r in rows))


def build_report(recipe: Recipe, model: LoopedLM, sampler, counters: Counters, val_tokens, run_dir: Path) -> dict:
    mean_depth = (sum(k * v for k, v in counters.depth_histogram.items()) / max(1, sum(counters.depth_histogram.values())))
    rounds_list = eval_rounds_list(recipe, mean_depth)
    model.eval()
    task: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if recipe.data.task:  # answer-token loss and exact match on held-out examples
        from ..evaluation.tasks import task_report
        task = task_report(model, recipe, sampler, val_tokens, rounds_list)
        val = task.pop("val")
    else:
        batches = data_mod.val_batches(val_tokens, recipe.data.seq_len, recipe.train.batch_size,
                                       recipe.train.eval_batches)
        # one pass reads out every depth 1..2x the training maximum (depth extrapolation) too
        extrap = extrapolation_rounds(recipe)
        val_all = evaluate_rounds(model, batches, sorted(set(rounds_list) | set(extrap)))
        val = {r: val_all[r] for r in rounds_list}
        extra = {"val_loss_extrapolation": {str(r): val_all[r]["loss"] for r in extrap}}
    tail = counters.losses[-max(1, len(counters.losses) // 10):]
    place = recipe.supervision
    return {
        "recipe": recipe.to_dict(),
        "steps": len(counters.losses),
        "unique_tokens": sampler.unique_tokens(),
        "tokens_seen": counters.tokens_seen,
        "token_passes": counters.token_passes,
        "params_stored": model.params_stored(),
        "params_per_token_visit": model.params_per_token_visit(mean_depth),
        "params_by_role": model.param_groups_by_role(),
        "train_flops": counters.train_flops,
        "mean_train_rounds": mean_depth,
        "expected_train_rounds": expected_depth(recipe.depth),
        "depth_histogram": {str(k): v for k, v in sorted(counters.depth_histogram.items())},
        "backward_histogram": {str(k): v for k, v in sorted(counters.backward_histogram.items())},
        "loss_placement": {"kind": place.kind, "rounds": list(place.rounds), "weights": list(place.round_weights),
                           "supervised_round_counts": {str(k): v for k, v in sorted(counters.supervised_rounds.items())},
                           "readout_only_round_counts": {str(k): v for k, v in sorted(counters.readout_only_rounds.items())},
                           "fallback_to_final_steps": counters.fallback_steps},
        "train_loss_final": sum(tail) / len(tail),
        "val_loss_by_rounds": {str(r): v["loss"] for r, v in val.items()},
        "val_rounds_never_trained": [r for r in rounds_list if r not in counters.depth_histogram],
        "wall_time_s": counters.train_time_s,
        "tokens_per_s": counters.tokens_seen / max(1e-9, counters.train_time_s),
        "peak_rss_bytes": peak_rss_bytes(),
        "train_data_tokens": int(len(sampler.tokens)) if not task else task["train_data_tokens"],
        **task,
        **extra,
    }
