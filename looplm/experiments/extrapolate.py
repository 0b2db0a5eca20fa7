"""`looplm experiment extrapolate`: do more rounds buy harder reasoning than was trained?

One recipe drives the whole experiment (the built-in `extrapolate`): its task data
(`data.task`, training difficulties data.difficulty_min..max, one prompt length for every
difficulty) trains

    looped               the recipe's model: shared core, sampled rounds
    untied_same_params   an untied stack with the looped model's stored parameters: the same
                         blocks, each run once (depth.rounds = 1)
    untied_same_compute  an untied stack with the looped model's compute per token at its
                         largest training depth: n_core x depth.max distinct blocks
    lstm                 (when data.baselines lists it) an LSTM with about the looped model's
                         stored parameters, on the same batches

Every model sees the same batches for the same steps with the same optimizer. Each is
evaluated by exact match on held-out examples of difficulty up to data.eval_difficulty_max
(default 2 x the training maximum) — the looped one at every round count up to
data.eval_rounds_max (default 2 x its largest training depth), the others at their fixed
depth. Prompt length is held fixed across difficulties by distractors and reported apart.
Linear probes on the looped model's state after each round show where in depth the answer
becomes readable. Results: OUT/report.json, OUT/report.md with a table and a heatmap PNG per
model, and one ordinary run folder per model (OUT/looped, ...).

Whether the in-context lookup forms at all depends on the seed (docs/tasks.md: of three seeds
of the additive-injection recipe, one formed it), so one seed's table says little about a recipe. With several
seeds (`--seeds 0,1,2`, the command's default) each seed is the single-seed experiment above in
OUT/seed-S, and OUT holds the aggregate (`aggregate_seeds`): per model and difficulty x rounds
the mean, sample std, min, max and every seed's value, and how many seeds formed the lookup by
one stated criterion (`lookup_verdict`). A seed that did not form it is counted as failed and
stays in every mean: dropping it would report the recipe as more reliable than it is.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..runs.checkpoint import atomic_write, load_run, write_text
from ..recipe.config import Recipe, apply_overrides, derive_recipe, recipe_from_dict
from ..errors import UserError
from ..model.losses import mean_loss, token_losses
from ..data.taskdata import TaskSampler, TaskSource
from ..evaluation.tasks import accuracy_table, markdown_table, prompt_tokens_by_difficulty
from ..data.tokenizer import ByteTokenizer

QUICK_OVERRIDES: dict[str, Any] = {
    # A smoke-test size: every model, the evaluation and the probes run in seconds.
    "model.d_model": 32, "model.n_heads": 2, "depth.max": 4, "depth.rounds": 4,
    "data.difficulty_max": 2, "data.eval_examples": 16, "data.probe_examples": 32,
    "train.steps": 8, "train.batch_size": 16, "train.log_every": 4, "train.checkpoint_every": 100,
    "optim.warmup_steps": 2, "train.threads": 1, "data.task_length": 0, "data.warmup_steps": 2,
}
"""What --quick sets (before any --set)."""

DEFAULT_SEEDS = (0, 1, 2)
"""The command's --seeds default: enough to see whether the lookup forms reliably, not just once."""

LOOKUP_THRESHOLD = 0.9
"""`lookup_verdict`'s default: the looped model's exact match at the largest trained difficulty and
training depth must reach this. A model without the lookup guesses among the prompt's digits
(36% at 4 hops with the built-in recipe: docs/tasks.md) and one with it scores ~100% there (the
seeds that did not form it solved 1 hop and fell to about the guessing level beyond), so 0.9
separates the two with room on both sides. `run_seed` refuses a threshold at or below the guessing level."""


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[extrapolate] {msg}", file=sys.stderr, flush=True)


def baseline_recipes(recipe: Recipe) -> dict[str, Recipe]:
    """The untied baselines' recipes: the looped recipe with an untied core of fixed depth."""
    def untied(rounds: int, label: str) -> Recipe:
        return derive_recipe(recipe.to_dict(), {
            "name": f"{recipe.name}-{label}", "model.untied": True, "depth.kind": "fixed",
            "depth.rounds": rounds, "backward.window": "all", "supervision.kind": "final",
            "supervision.rounds": [], "supervision.weights": [], "exit.gate": False, "exit.policy": "fixed"})
    return {"untied_same_params": untied(1, "untied-same-params"),
            "untied_same_compute": untied(recipe.depth.max_rounds, "untied-same-compute")}


# ---------------------------------------------------------------------------------------
# The LSTM baseline on task data


def lstm_params(vocab: int, d_embed: int, hidden: int) -> int:
    return vocab * d_embed + 4 * hidden * (hidden + d_embed) + 4 * hidden + hidden * vocab + vocab


def lstm_hidden_for(target: int, vocab: int, d_embed: int) -> int:
    """The hidden width whose LSTM has the stored-parameter count closest to `target`."""
    return min(range(1, 4096), key=lambda h: abs(lstm_params(vocab, d_embed, h) - target))


def train_lstm(recipe: Recipe, run_dir: Path, source: TaskSource, target_params: int, quiet: bool = True):
    """Train an LSTMLM on the recipe's task batches with the recipe's optimizer and schedule."""
    from safetensors.torch import save_model

    from ..model.lstm import LSTMLM
    from ..train.optim import lr_at, make_optimizer, set_lr

    tok = ByteTokenizer()
    vocab, d_embed = recipe.model.vocab_size, recipe.model.d_model
    hidden = lstm_hidden_for(target_params, vocab, d_embed)
    torch.manual_seed(recipe.train.seed)
    model = LSTMLM(vocab, d_embed, hidden)
    opt = make_optimizer(model, recipe)
    sampler = TaskSampler(source, tok, recipe)
    run_dir.mkdir(parents=True, exist_ok=True)
    losses, t0, accum = [], time.perf_counter(), recipe.train.grad_accum
    model.train()
    with open(run_dir / "metrics.jsonl", "w") as metrics:
        for step in range(recipe.train.steps):
            set_lr(opt, lr_at(step, recipe))
            step_loss = 0.0
            for micro in range(accum):
                x, y, opts = sampler.batch(step * accum + micro)
                mask = opts["mask"]       # the loss reads the answer positions: the head runs there alone
                loss = mean_loss(token_losses(model(x, at=mask), y[mask]), mask)
                (loss / accum).backward()
                step_loss += loss.item() / accum
            clip = recipe.optim.grad_clip
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(step_loss)
            if step % recipe.train.log_every == 0 or step == recipe.train.steps - 1:
                metrics.write(json.dumps({"step": step, "loss": step_loss}) + "\n")
                _say(f"lstm step {step}/{recipe.train.steps} loss {step_loss:.3f}", quiet)
    wall = time.perf_counter() - t0
    atomic_write(run_dir / "model.safetensors", lambda tmp: save_model(model, tmp))
    tail = losses[-max(1, len(losses) // 10):]
    report = {"model": "lstm", "vocab_size": vocab, "d_embed": d_embed, "hidden": hidden,
              "params_stored": sum(p.numel() for p in model.parameters()), "steps": len(losses),
              "train_loss_final": sum(tail) / len(tail), "wall_time_s": wall}
    write_text(run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    model.eval()
    return model, report


# ---------------------------------------------------------------------------------------
# The experiment


def _exit_with_parent() -> None:
    """Pool worker start-up (Linux): receive SIGTERM when the experiment's process dies, so a killed
    experiment leaves no training workers behind."""
    import ctypes
    import signal
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _train_model(name: str, recipe_dict: dict[str, Any], out: str, quiet: bool, lstm_target: int) -> dict[str, Any]:
    """Train one model of the experiment into OUT/name; returns what the report needs.
    A top-level function, so a worker process can run it."""
    from ..train.trainer import train

    recipe = recipe_from_dict(recipe_dict)
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    t0 = time.perf_counter()
    if name == "lstm":
        _, rep = train_lstm(recipe, Path(out) / name, TaskSource(recipe), lstm_target, quiet)
        return {"params_stored": rep["params_stored"], "hidden": rep["hidden"], "steps": rep["steps"],
                "train_wall_time_s": rep["wall_time_s"], "train_loss_final": rep["train_loss_final"],
                "process_wall_time_s": time.perf_counter() - t0}
    report = train(recipe, Path(out) / name, quiet=quiet)
    m = recipe.model
    return {"params_stored": report["params_stored"], "params_per_token_visit": report["params_per_token_visit"],
            "block_visits_per_token": m.n_prelude + m.n_coda + m.n_core * (
                recipe.depth.rounds if m.untied else report["mean_train_rounds"]),
            "mean_train_rounds": report["mean_train_rounds"], "steps": report["steps"],
            "train_wall_time_s": report["wall_time_s"], "train_loss_final": report["train_loss_final"],
            "process_wall_time_s": time.perf_counter() - t0}


def _load_model(name: str, out: Path, recipe: Recipe, info: dict[str, Any]) -> torch.nn.Module:
    if name != "lstm":
        return load_run(out / name).model
    from safetensors.torch import load_model

    from ..model.lstm import LSTMLM
    model = LSTMLM(recipe.model.vocab_size, recipe.model.d_model, info["hidden"])
    load_model(model, str(out / name / "model.safetensors"))
    return model.eval()


def run_extrapolate(recipe: Recipe, out_dir: str | Path, quiet: bool = False, seeds: list[int] | None = None,
                    lookup_threshold: float = LOOKUP_THRESHOLD) -> dict[str, Any]:
    """The experiment over `seeds` (default: the recipe's train.seed alone).

    One seed is today's single run, written to OUT itself (the layout and keys that scripts and
    the benchmark read). Several run that experiment once per seed into OUT/seed-S, then write
    the aggregate to OUT: report.json (the contract's keys with `models` the per-cell mean, and
    the aggregate under `seeds`), report.md and one heatmap figure per model with a panel per
    seed and one for the mean. Every seed's models train in one pool of workers (costliest
    first), so a core that finishes one seed's last model starts the next seed's instead of
    waiting for the other core; each seed is evaluated as soon as its own models are trained."""
    seeds = check_seeds(list(seeds) if seeds is not None else [recipe.train.seed])
    if not 0 < lookup_threshold <= 1:
        raise UserError(f"--lookup-threshold {lookup_threshold}: must be in (0, 1] (exact match)")
    out = Path(out_dir)
    if len(seeds) == 1:
        return run_seed(seed_recipe(recipe, seeds[0]), out, quiet, lookup_threshold)
    t_start = time.perf_counter()
    names = ["looped", *recipe.data.baselines]
    # Refuse before the first seed trains, not when a later seed's folder turns out to be taken.
    for folder in (out, *(out / f"seed-{s}" for s in seeds)):
        if _holds_experiment(folder, names):
            raise UserError(f"--out {out}: {folder} already holds an experiment; choose another folder")
    plans = [SeedPlan(seed_recipe(recipe, s), out / f"seed-{s}", quiet, lookup_threshold, first=i == 0)
             for i, s in enumerate(seeds)]
    _say(f"{_seed_list(seeds)} into {out}/seed-S", quiet)
    per_seed = {s: plan.evaluate(info) for s, (plan, info) in zip(seeds, train_plans(plans, recipe.train.threads, quiet))}
    first = per_seed[seeds[0]]
    aggregate = aggregate_seeds(per_seed, lookup_threshold)
    # The setting is the recipe's, not the seed's (a built-in task draws its held-out sets from a
    # fixed seed; a JSONL file's split does vary, and each seed's folder keeps its own counts), so
    # the first seed's description of it stands for all; `models` keeps the contract's shape.
    result = {k: first[k] for k in ("task", "train_difficulty_min", "train_difficulty_max", "eval_difficulty_max",
                                     "train_rounds", "eval_rounds_max", "prompt_length",
                                     "eval_examples_per_difficulty", "digit_guess_baseline")}
    result.update({
        "models": {m: {dd: {r: c["mean"] for r, c in row.items()} for dd, row in table.items()}
                   for m, table in aggregate["models"].items()},
        "seeds": aggregate,
        "seed_dirs": {str(s): str(out / f"seed-{s}") for s in seeds},
        "recipe": recipe.to_dict(),
        "out": str(out),
        "wall_time_s": time.perf_counter() - t_start,
    })
    out.mkdir(parents=True, exist_ok=True)
    plots = write_seed_heatmaps(out, result)
    write_text(out / "report.json", json.dumps(result, indent=2) + "\n")
    write_text(out / "report.md", render_seeds_markdown(result, plots))
    return result


def check_seeds(seeds: list[int]) -> list[int]:
    """Seeds as given, refused when empty or repeated: a repeated seed would train the same models
    twice and count them as two independent draws."""
    if not seeds:
        raise UserError("--seeds: give at least one seed, e.g. 0,1,2")
    if len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds {','.join(map(str, seeds))}: a seed is repeated; each must appear once")
    if min(seeds) < 0:
        raise UserError(f"--seeds {','.join(map(str, seeds))}: seeds must be non-negative integers")
    return seeds


def parse_seeds(text: str) -> list[int]:
    """--seeds S1,S2,...: comma-separated non-negative integers, checked by `check_seeds`."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--seeds {text!r}: expected comma-separated non-negative integers, e.g. 0,1,2") from None
    return check_seeds(seeds)


def seed_recipe(recipe: Recipe, seed: int) -> Recipe:
    """The recipe with train.seed = seed: weights, batches, depth draws and the baselines' too."""
    if recipe.train.seed == seed:
        return recipe
    return recipe_from_dict(apply_overrides(recipe.to_dict(), {"train.seed": seed}))


def _holds_experiment(folder: Path, names: list[str]) -> bool:
    return (folder / "report.json").exists() or any((folder / n / "checkpoint").exists() for n in names)


def run_seed(recipe: Recipe, out_dir: str | Path, quiet: bool = False,
             lookup_threshold: float = LOOKUP_THRESHOLD) -> dict[str, Any]:
    """One seed's experiment (the recipe's train.seed): train the looped model and its baselines,
    evaluate difficulty x rounds, probe, report into OUT, with the seed's `lookup_verdict`.

    With train.threads >= 2 the models train in that many single-threaded worker processes
    (small models use several cores better side by side than through intra-op threads)."""
    plan = SeedPlan(recipe, out_dir, quiet, lookup_threshold)
    [(_, info)] = train_plans([plan], recipe.train.threads, quiet)
    return plan.evaluate(info)


COST_ORDER = ("untied_same_compute", "looped", "untied_same_params", "lstm")
"""The models from the costliest to train to the cheapest, so the two cores' last models end close together
(two workers side by side, minutes of one core a seed, docs/tasks.md: the built-in recipe ~15.8, ~10.6, ~3.4,
~1.9 before later rounds ran at the read positions only; drawn format 2 since, 11.4-13.0, 11.2-11.5, 9.0-9.2,
3.4-3.9)."""


class SeedPlan:
    """One seed's experiment, checked and set up before anything trains (the refusals happen here):
    its task source and held-out sets, the models' recipes, and `evaluate` for once they are trained."""

    def __init__(self, recipe: Recipe, out_dir: str | Path, quiet: bool, lookup_threshold: float,
                 first: bool = True):
        self.t_start = time.perf_counter()
        if not recipe.data.task:
            raise UserError("recipe field data.task: the extrapolate experiment needs task data (e.g. \"chain\")")
        if recipe.model.untied:
            raise UserError("recipe field model.untied: must be false; the experiment builds the untied baselines itself")
        self.recipe, self.out, self.quiet, self.threshold = recipe, Path(out_dir), quiet, lookup_threshold
        self.names = ["looped", *recipe.data.baselines]
        if _holds_experiment(self.out, self.names):
            raise UserError(f"--out {self.out}: already holds an experiment; choose another folder")
        self.source = TaskSource(recipe)  # validates the task dials before anything trains
        note = self.source.short_prompt_note(recipe.data)
        if note and first:            # the same for every seed: said once
            _say(f"note: {note}", quiet)
        self.eval_sets = self.source.eval_sets(recipe.data.eval_examples)
        self.guess = digit_guess_baseline(self.eval_sets)
        check_lookup_criterion(lookup_threshold, self.guess, self.source.train_levels[-1], self.eval_sets)

        from ..model.looped import build_model

        self.recipes = {"looped": recipe, **baseline_recipes(recipe), "lstm": recipe}
        self.lstm_target = build_model(recipe).params_stored()

    def jobs(self) -> list[str]:
        """The models to train, costliest first."""
        return sorted(self.names, key=COST_ORDER.index)

    def job(self, name: str, in_worker: bool) -> tuple:
        """`_train_model`'s arguments for `name` (plain data, so a worker process can take them; a
        worker trains on one thread and quietly)."""
        r = self.recipes[name].to_dict()
        if in_worker:
            r = apply_overrides(r, {"train.threads": 1})
        return name, r, str(self.out), self.quiet or in_worker, self.lstm_target

    def evaluate(self, info: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The trained models' tables, probes, report.json, report.md and heatmaps in OUT."""
        recipe, out, quiet, d, tok = self.recipe, self.out, self.quiet, self.recipe.data, ByteTokenizer()
        names, recipes, source, eval_sets = self.names, self.recipes, self.source, self.eval_sets
        eval_rounds_max = d.eval_rounds_max or 2 * recipe.depth.max_rounds
        info = {n: info[n] for n in names}
        models = {n: _load_model(n, out, recipes[n], info[n]) for n in names}

        _say(f"evaluating {out}", quiet)
        rounds_for = {"looped": list(range(1, eval_rounds_max + 1)), "lstm": [1],
                      **{n: [recipes[n].depth.rounds] for n in recipes if n.startswith("untied")}}
        tables = {n: accuracy_table(models[n], tok, eval_sets, rounds_for[n], separator=d.separator) for n in names}
        accuracy = {n: {str(dd): {str(r): v["accuracy"] for r, v in row.items()} for dd, row in t.items()}
                    for n, t in tables.items()}
        loss = {n: {str(dd): {str(r): v["loss"] for r, v in row.items()} for dd, row in t.items()}
                for n, t in tables.items()}
        # each model's accuracies against the chance its answers and prompts allow (evaluation/chance.py)
        from ..evaluation.chance import chance_by_difficulty
        chance = {n: {str(dd): {"chance": row["chance"],
                                "above_chance": {str(r): v["above_chance"] for r, v in row["by_rounds"].items()},
                                "p_value": {str(r): v["p_value"] for r, v in row["by_rounds"].items()}}
                      for dd, row in chance_by_difficulty(
                          eval_sets, {dd: {r: v["accuracy"] for r, v in row.items()} for dd, row in t.items()}).items()}
                  for n, t in tables.items()}

        probes: dict[str, Any] = {}
        if d.probe_examples:
            _say("probing the looped model's state after each round", quiet)
            from ..evaluation.probes import run_probes
            levels = sorted({source.train_levels[-1], source.eval_max})
            raw = run_probes(models["looped"], tok, source, d.probe_examples, levels, eval_rounds_max, d.separator)
            probes = {k: {str(dd): ({str(r): a for r, a in v.items()} if isinstance(v, dict) else v)
                          for dd, v in table.items()} for k, table in raw.items()}

        lengths = prompt_tokens_by_difficulty(tok, eval_sets, d.separator)
        result = {
            "task": d.task,
            "train_difficulty_min": source.train_levels[0],
            "train_difficulty_max": source.train_levels[-1],
            "eval_difficulty_max": source.eval_max,
            "train_rounds": {"min": recipe.depth.min_rounds, "max": recipe.depth.max_rounds},
            "eval_rounds_max": eval_rounds_max,
            "prompt_length": {"items": source.length, "tokens_by_difficulty": {str(k): v for k, v in lengths.items()}},
            "eval_examples_per_difficulty": {str(k): len(v) for k, v in eval_sets.items()},
            "digit_guess_baseline": self.guess,
            "models": accuracy,
            "chance": chance,
            "answer_loss": loss,
            "model_info": info,
            "probes": probes,
            "recipe": recipe.to_dict(),
            "out": str(out),
            # from this seed's set-up to its report: with several seeds in one pool, its models'
            # training shared the cores with the other seeds' (model_info has each model's own time)
            "wall_time_s": time.perf_counter() - self.t_start,
        }
        result["lookup"] = lookup_verdict(result, self.threshold)
        plots = write_heatmaps(out, result)
        write_text(out / "report.json", json.dumps(result, indent=2) + "\n")
        write_text(out / "report.md", render_markdown(result, plots))
        return result


def train_plans(plans: list[SeedPlan], threads: int, quiet: bool = False):
    """Train every plan's models; yield (plan, {model: info}) in the plans' order, each as soon as
    its own models are trained.

    threads >= 2: that many single-threaded worker processes share every plan's models, costliest
    first across all plans (small models use several cores better side by side than through
    intra-op threads); evaluation then runs here on one thread beside them, the last plan's on all
    `threads` (nothing is left to train by then). Otherwise one model after another
    here, with train.threads threads."""
    jobs = [(COST_ORDER.index(n), i, n) for i, p in enumerate(plans) for n in p.jobs()]
    workers = min(threads, len(jobs)) if threads >= 2 else 1
    before = torch.get_num_threads()
    torch.set_num_threads(1 if workers > 1 else (threads or before))
    try:
        yield from _train_plans(plans, jobs, workers, quiet)
    finally:                         # the caller's thread count back
        torch.set_num_threads(before)


def _train_plans(plans: list[SeedPlan], jobs: list[tuple[int, int, str]], workers: int, quiet: bool):
    if workers <= 1:
        for p in plans:
            info = {}
            for name in p.jobs():
                _say(f"training {name} ({p.recipes[name].train.steps} steps) into {p.out}", quiet)
                info[name] = _train_model(*p.job(name, in_worker=False))
            yield p, info
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    _say(f"training {len(jobs)} models in {workers} worker processes of one thread each", quiet)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_exit_with_parent) as pool:
        futures = {(i, n): pool.submit(_train_model, *plans[i].job(n, in_worker=True)) for _, i, n in sorted(jobs)}
        try:
            for i, p in enumerate(plans):
                info = {}
                for name in p.jobs():
                    info[name] = futures[(i, name)].result()
                    _say(f"{p.out / name} trained in {info[name]['process_wall_time_s']:.0f} s", quiet)
                if i == len(plans) - 1:      # every model is trained: the last evaluation has the cores to itself
                    torch.set_num_threads(workers)
                yield p, info
        finally:  # a failed model or evaluation: the queued models are not started
            for f in futures.values():
                f.cancel()


# ---------------------------------------------------------------------------------------
# Seeds: the lookup criterion and the aggregate


def lookup_verdict(result: dict[str, Any], threshold: float = LOOKUP_THRESHOLD) -> dict[str, Any]:
    """Whether one seed's looped model formed the lookup: exact match at the largest TRAINED
    difficulty, at the largest training depth, >= threshold.

    A trained cell, so the verdict is about whether training found the mechanism at all; how far
    it extrapolates is what the tables report, and a seed that learned the lookup but extrapolates
    poorly must not be counted with one that never learned it. The rounds are capped at the
    largest evaluated ones (data.eval_rounds_max may be set below the training depth)."""
    dd = result["train_difficulty_max"]
    r = min(result["train_rounds"]["max"], result["eval_rounds_max"])
    acc = result["models"]["looped"][str(dd)][str(r)]
    cell = (result.get("chance") or {}).get("looped", {}).get(str(dd))
    return {"model": "looped", "difficulty": dd, "rounds": r, "threshold": threshold, "accuracy": acc,
            "digit_guess": (result.get("digit_guess_baseline") or {}).get(str(dd)), "formed": acc >= threshold,
            "chance": None if cell is None else cell["chance"],
            "above_chance": None if cell is None else cell["above_chance"][str(r)]}


def check_lookup_criterion(threshold: float, guess: dict[str, float] | None, difficulty: int,
                           eval_sets: dict[int, list]) -> None:
    """Refuse, before anything trains, a criterion that cannot be judged or that guessing passes."""
    if not eval_sets.get(difficulty):
        raise UserError(f"data.task: no held-out examples at difficulty {difficulty}, the largest trained one, "
                        "where the lookup criterion is judged")
    if guess and threshold <= guess[str(difficulty)]:
        raise UserError(f"--lookup-threshold {threshold}: at or below guessing among the prompt's digits at "
                        f"difficulty {difficulty} ({guess[str(difficulty)]:.3f}); it would count guessing as a lookup")


def criterion_text(lookup: dict[str, Any]) -> str:
    return (f"{lookup['model']} exact match at difficulty {lookup['difficulty']} (the largest trained) and "
            f"{lookup['rounds']} rounds (the largest training depth) >= {100 * lookup['threshold']:.0f}%")


def aggregate_seeds(per_seed: dict[int, dict[str, Any]], threshold: float = LOOKUP_THRESHOLD) -> dict[str, Any]:
    """Several seeds' single-seed results -> the aggregate (a pure function of the tables).

    `models`: model -> difficulty -> rounds -> {mean, std (sample, n - 1; None for one seed), min,
    max, values: {seed: accuracy}}, over every seed; `lookup`: each seed's `lookup_verdict` and how
    many formed the lookup, the failed ones named. Failed seeds stay in every statistic: the
    spread across seeds is the finding, and leaving them out would hide it. Every seed must have
    evaluated the same models and cells (they ran one recipe)."""
    seeds = list(per_seed)
    if not seeds:
        raise ValueError("aggregate_seeds: no seeds")
    shape = {m: {dd: list(row) for dd, row in t.items()} for m, t in per_seed[seeds[0]]["models"].items()}
    for s in seeds[1:]:
        other = {m: {dd: list(row) for dd, row in t.items()} for m, t in per_seed[s]["models"].items()}
        if other != shape:
            raise ValueError(f"aggregate_seeds: seed {s} evaluated other models or cells than seed {seeds[0]}")

    def cell(m: str, dd: str, r: str) -> dict[str, Any]:
        values = [per_seed[s]["models"][m][dd][r] for s in seeds]
        return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
                "min": min(values), "max": max(values), "values": {str(s): v for s, v in zip(seeds, values)}}

    verdicts = {s: lookup_verdict(per_seed[s], threshold) for s in seeds}
    lookup = {k: verdicts[seeds[0]][k] for k in ("model", "difficulty", "rounds", "threshold")}
    lookup.update(criterion=criterion_text(lookup),
                  per_seed={str(s): {k: v[k] for k in ("accuracy", "digit_guess", "formed", "chance", "above_chance")
                                     if k in v and (v[k] is not None or k not in ("chance", "above_chance"))}
                            for s, v in verdicts.items()},
                  at_chance_seeds=[s for s in seeds if verdicts[s].get("above_chance") is False],
                  formed=sum(v["formed"] for v in verdicts.values()), of=len(seeds),
                  failed_seeds=[s for s in seeds if not verdicts[s]["formed"]])
    return {"seeds": seeds,
            "models": {m: {dd: {r: cell(m, dd, r) for r in row} for dd, row in t.items()} for m, t in shape.items()},
            "lookup": lookup}


def digit_guess_baseline(eval_sets: dict[int, list]) -> dict[str, float] | None:
    """Accuracy of guessing uniformly among the distinct digits in each prompt (the shortcut an
    untrained lookup falls into), by difficulty; None unless every answer is one digit."""
    exs = [ex for group in eval_sets.values() for ex in group]
    if not exs or not all(len(ex.answer) == 1 and ex.answer.isdigit() for ex in exs):
        return None
    return {str(dd): sum(1 / max(1, len({c for c in ex.prompt if c.isdigit()})) for ex in group) / len(group)
            for dd, group in eval_sets.items()}


# ---------------------------------------------------------------------------------------
# Report


def _floats(table: dict[str, dict[str, float]]) -> dict[int, dict[int, float]]:
    return {int(dd): {int(r): a for r, a in row.items()} for dd, row in table.items()}


def _draw_heatmap(ax, table: dict[str, dict[str, float]], model: str, result: dict[str, Any], title: str):
    """One panel: difficulty (rows) x rounds (columns) -> exact match, the trained region dashed."""
    t = _floats(table)
    dmax, rmax = result["train_difficulty_max"], result["train_rounds"]["max"]
    diffs = sorted(t)
    rounds = sorted({r for row in t.values() for r in row})
    grid = [[t[dd].get(r, math.nan) for r in rounds] for dd in diffs]
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=7,
                    color="black" if v > 0.6 else "white")
    ax.set_xticks(range(len(rounds)), [str(r) for r in rounds])
    ax.set_yticks(range(len(diffs)), [str(dd) for dd in diffs])
    ax.set_xlabel("rounds" if model == "looped" else "fixed depth (rounds of blocks)")
    ax.set_ylabel("difficulty")
    # the trained region: difficulties <= dmax (and, looped, rounds <= the training max)
    y = diffs.index(dmax) + 0.5 if dmax in diffs else len(diffs) - 0.5
    ax.axhline(y, color="white", linestyle="--", linewidth=1)
    if model == "looped" and rmax in rounds:
        ax.axvline(rounds.index(rmax) + 0.5, color="white", linestyle="--", linewidth=1)
    ax.set_title(title, fontsize=9)
    return im


def _save_panels(path: Path, model: str, result: dict[str, Any], panels: list[tuple[str, dict]]) -> None:
    """One figure of heatmap panels side by side on one colour scale, so seeds compare at a glance."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = _floats(panels[0][1])
    n_rounds, n_diffs = len({r for row in first.values() for r in row}), len(first)
    # at least 2.6 inches a panel: a one-column baseline's axis label must not run into its neighbour's
    fig, axes = plt.subplots(1, len(panels), squeeze=False, layout="constrained",
                             figsize=(len(panels) * max(2.6, 1.2 + 0.45 * n_rounds), 1.0 + 0.4 * n_diffs))
    for ax, (title, table) in zip(axes[0], panels):
        im = _draw_heatmap(ax, table, model, result, title)
    fig.colorbar(im, ax=axes[0].tolist(), fraction=0.05 / len(panels))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_heatmaps(out: Path, result: dict[str, Any]) -> list[str]:
    """One heatmap per model: difficulty (rows) x rounds (columns) -> exact match."""
    names = []
    for model, table in result["models"].items():
        names.append(f"heatmap_{model}.png")
        _save_panels(out / names[-1], model, result, [(f"{model}: exact match ({result['task']})", table)])
    return names


def write_seed_heatmaps(out: Path, result: dict[str, Any]) -> list[str]:
    """Per model one figure: a panel per seed (every seed, a failed one marked, never left out)
    and the mean, from the aggregate under result["seeds"]."""
    agg = result["seeds"]
    failed = set(agg["lookup"]["failed_seeds"])
    names = []
    for model, cells in agg["models"].items():
        def panel(key: str) -> dict[str, dict[str, float]]:
            return {dd: {r: (c["mean"] if key == "mean" else c["values"][key]) for r, c in row.items()}
                    for dd, row in cells.items()}
        panels = [(f"{model}, seed {s}" + (" (no lookup)" if model == "looped" and s in failed else ""), panel(str(s)))
                  for s in agg["seeds"]]
        panels.append((f"{model}, mean of {len(agg['seeds'])} seeds", panel("mean")))
        names.append(f"heatmap_seeds_{model}.png")
        _save_panels(out / names[-1], model, result, panels)
    return names


def _seed_list(seeds: list[int]) -> str:
    return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"


def short_prompts(data: dict[str, Any]) -> str | None:
    """Which curriculum gave training prompts shorter than the longest, from a resolved recipe's data
    section; None when none did (every prompt as the generator pads it, or as the file writes it)."""
    if data.get("crop_curriculum"):
        return f"data.crop_curriculum = {data['crop_curriculum']}"
    if data.get("train_length_min"):
        return f"data.train_length_min = {data['train_length_min']}"
    return None


NO_SHORT_PROMPTS = ("training saw no prompt shorter than its data's (no length or crop curriculum applied); on "
                    "prompts of one length the lookup was not found in our trials: a file of pointer chases with "
                    "traces can set data.crop_curriculum, data.item_separator and data.round_targets = "
                    "\"query_trace\" (docs/tasks.md)")
NO_QUERY_ROUND = ("round 1 had to find the queried name and take the first hop at once (data.round_targets = "
                  "\"trace\"); where the query is not the prompt's last token, or statements are joined by one "
                  "space, the lookup was not found that way in our trials, and data.round_targets = \"query_trace\" "
                  "(round 1 reads out the queried name) found it (docs/tasks.md)")


def failure_hint(data: dict[str, Any] | None) -> str:
    """What a failed lookup's recipe lacked that our trials needed: short prompts, then a round for the query."""
    if data is None:
        return ""
    if short_prompts(data) is None:
        return f"; {NO_SHORT_PROMPTS}"
    return f"; {NO_QUERY_ROUND}" if data.get("round_targets") == "trace" else ""


def lookup_line(result: dict[str, Any]) -> str | None:
    """How many seeds formed the lookup (several seeds), or whether the one seed did; where it failed, what
    its recipe lacked that our trials needed (failure_hint)."""
    hint = failure_hint(result.get("recipe", {}).get("data"))
    if "seeds" in result:
        lk = result["seeds"]["lookup"]
        failed = lk["failed_seeds"]
        at_chance = lk.get("at_chance_seeds") or []
        return (f"{lk['formed']} of {lk['of']} seeds formed the lookup ({lk['criterion']})"
                + (f"; failed: {_seed_list(failed)} (counted, and kept in every mean)" if failed else "")
                + (f"; at chance in that cell (learned nothing measurable there): {_seed_list(at_chance)}"
                   if at_chance else "") + (hint if failed else ""))
    lk = result.get("lookup")
    if lk is None:
        return None
    return (f"the lookup {'formed' if lk['formed'] else 'did not form'}: {100 * lk['accuracy']:.1f}% "
            f"(criterion: {criterion_text(lk)})"
            + (f"; chance {100 * lk['chance']:.0f}%: {'above' if lk['above_chance'] else 'NOT above'} it"
               if lk.get("chance") is not None else "") + ("" if lk["formed"] else hint))


def summary_lines(result: dict[str, Any]) -> list[str]:
    """Best accuracy per model at the hardest evaluated difficulty, in words (with several seeds: the
    best mean and the seeds' range in that cell), and the lookup verdict."""
    top = str(result["eval_difficulty_max"])
    agg = result.get("seeds")
    lines = []
    for model, table in result["models"].items():
        row = table.get(top, {})
        if row:
            r, acc = max(row.items(), key=lambda kv: (kv[1], -int(kv[0])))
            if agg:
                c = agg["models"][model][top][r]
                lines.append(f"{model}: {100 * acc:.1f}% mean of {len(agg['seeds'])} seeds (per seed "
                             f"{100 * c['min']:.1f}..{100 * c['max']:.1f}%) at difficulty {top} "
                             f"(best mean over rounds; at {r} rounds)")
            else:
                lines.append(f"{model}: {100 * acc:.1f}% at difficulty {top} (best over rounds; at {r} rounds)")
    verdict = lookup_line(result)
    return lines + ([verdict] if verdict else [])


def spread_table(cells: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The aggregate's difficulty x rounds cells as Markdown: mean ± sample std [min, max] (%)."""
    rounds = sorted({int(r) for row in cells.values() for r in row})
    lines = ["| difficulty \\ rounds | " + " | ".join(map(str, rounds)) + " |", "|---:|" + "---:|" * len(rounds)]
    for dd in sorted(cells, key=int):
        row = cells[dd]

        def fmt(c: dict[str, Any]) -> str:
            std = "" if c["std"] is None else f" ± {100 * c['std']:.0f}"
            return f"{100 * c['mean']:.0f}{std} [{100 * c['min']:.0f}, {100 * c['max']:.0f}]"
        lines.append(f"| {dd} | " + " | ".join(fmt(row[str(r)]) if str(r) in row else "" for r in rounds) + " |")
    return "\n".join(lines)


def _setting_lines(result: dict[str, Any]) -> list[str]:
    """What was trained and evaluated, in words: one seed's report and the seeds' aggregate share it."""
    rec = result["recipe"]
    pl = result["prompt_length"]
    return [
        f"Recipe `{rec['name']}`. Trained on difficulties {result['train_difficulty_min']}..{result['train_difficulty_max']} "
        f"for {rec['train']['steps']} steps of {rec['train']['batch_size']} examples; the looped model ran "
        f"{result['train_rounds']['min']}..{result['train_rounds']['max']} rounds in training and is evaluated at "
        f"1..{result['eval_rounds_max']} rounds on difficulties up to {result['eval_difficulty_max']}.", "",
        (f"Prompt length is a separate dial: every prompt has {pl['items']} items (distractors pad easier "
         "examples), so difficulty never shows in the length." if pl["items"] is not None else
         "Prompt lengths are the data file's own (a JSONL task has no generator's length dial).")
        + (f" Shorter training prompts: {short_prompts(rec['data'])}." if short_prompts(rec["data"]) else
           " Training prompts were never shortened.")
        + " Mean prompt tokens by difficulty: "
        + ", ".join(f"{k}: {v:.0f}" for k, v in pl["tokens_by_difficulty"].items()) + ".", "",
        *(["Round targets: `trace`. Every round was supervised; round r < k of a k-hop training example was "
           "trained to read out the name reached after r hops, the final round and rounds from k on the "
           "answer. The models never saw more than "
           f"{result['train_difficulty_max']} hops; the per-round signal fixes what one round computes (one hop), "
           "so whether more rounds solve longer chains is what the tables below test.", ""]
          if rec["data"].get("round_targets") == "trace" else []),
        *(["Round targets: `query_trace`. Every round was supervised; round 1 was trained to read out the name the "
           "prompt asks about, round r + 1 of a k-hop training example the name reached after r hops (r < k), and "
           "the final round and rounds from k + 1 on the answer: a k-hop chain needs k + 1 rounds. The models never "
           f"saw more than {result['train_difficulty_max']} hops; whether more rounds solve longer chains is what "
           "the tables below test.", ""]
          if rec["data"].get("round_targets") == "query_trace" else []),
    ]


def _percent(v: float | None) -> str:
    return "" if v is None else f"{100 * v:.0f}"


def _guess_lines(result: dict[str, Any]) -> list[str]:
    guess = result.get("digit_guess_baseline")
    return ["- guessing among the prompt's digits would score: " + ", ".join(
        f"difficulty {k}: {100 * v:.0f}%" for k, v in guess.items())] if guess else []


def render_seeds_markdown(result: dict[str, Any], plots: list[str]) -> str:
    """The seeds' report: the lookup count and per-seed verdicts, then per model the spread table
    and the figure of every seed's heatmap beside the mean."""
    agg = result["seeds"]
    lk = agg["lookup"]
    seeds = agg["seeds"]
    lines = [
        f"# Depth extrapolation over {len(seeds)} seeds: {result['task']}", "",
        f"Seeds (train.seed) {', '.join(map(str, seeds))}: each trained every model on its own batches, "
        "weights and depth draws, and is the single-seed experiment in its folder ("
        + ", ".join(f"[seed-{s}](seed-{s}/report.md)" for s in seeds) + ").", "",
        *_setting_lines(result),
        "## Did the lookup form?", "",
        f"Criterion: {lk['criterion']}. A trained cell, so this asks whether training found the lookup at all; "
        "how far it extrapolates is in the tables below.", "",
        f"**{lk['formed']} of {lk['of']} seeds formed the lookup**"
        + (f"; failed: {_seed_list(lk['failed_seeds'])}. Failed seeds are counted and stay in every "
           "mean, spread and figure below." if lk["failed_seeds"] else "."), "",
        f"| seed | exact match at difficulty {lk['difficulty']}, {lk['rounds']} rounds (%) "
        "| digit guess (%) | formed |",
        "|---:|---:|---:|---|",
        *(f"| {s} | {100 * v['accuracy']:.1f} | {_percent(v['digit_guess'])} | {'yes' if v['formed'] else 'no'} |"
          for s, v in lk["per_seed"].items()), "",
        "## Summary", "", *[f"- {s}" for s in summary_lines(result)], *_guess_lines(result), "",
    ]
    for name, cells in agg["models"].items():
        lines += [f"## {name}: exact match (%), mean ± sample std [min, max] over {len(seeds)} seeds", "",
                  spread_table(cells), ""]
        if f"heatmap_seeds_{name}.png" in plots:
            lines += [f"![heatmap_seeds_{name}.png](heatmap_seeds_{name}.png)", ""]
    lines += ["Every seed's value in every cell is in report.json under `seeds.models`.", ""]
    return "\n".join(lines) + "\n"


def render_markdown(result: dict[str, Any], plots: list[str]) -> str:
    lines = [
        f"# Depth extrapolation: {result['task']}", "",
        *_setting_lines(result),
        "## Summary", "", *[f"- {s}" for s in summary_lines(result)], *_guess_lines(result), "",
        "## Models", "", "| model | stored params | block visits per token | train wall s | final train loss |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, i in result["model_info"].items():
        visits = i.get("block_visits_per_token")
        lines.append(f"| {name} | {i['params_stored']:,} | {f'{visits:.2f}' if visits is not None else '(recurrent)'} "
                     f"| {i['train_wall_time_s']:.0f} | {i['train_loss_final']:.4f} |")
    lines += ["", "untied_same_params runs the looped model's blocks once each; untied_same_compute has "
              "n_core x depth.max distinct blocks, the looped model's compute at its largest training depth; "
              "the LSTM has about the looped model's stored parameters. Each has its own run folder here.", ""]
    for name, table in result["models"].items():
        lines += [f"## {name}: exact match (%)", "", markdown_table(_floats(table)), ""]
        if f"heatmap_{name}.png" in plots:
            lines += [f"![heatmap_{name}.png](heatmap_{name}.png)", ""]
    probes = result.get("probes") or {}
    if probes:
        lines += ["## Probes (looped model)", "",
                  "Linear probe accuracy (%) on the state after each round at the last prompt position "
                  "(fit on half the examples, tested on the other half). `answer`: the answer's first token; "
                  "`hop` (chains): the node reached after min(round, hops) links — one link per round makes it "
                  "readable at every round. Chance (majority answer): "
                  + ", ".join(f"difficulty {k}: {100 * v:.0f}%" for k, v in probes["chance"].items()) + ".", ""]
        for target in [k for k in probes if k != "chance"]:
            lines += [f"### {target}", "", markdown_table(_floats(probes[target])), ""]
    return "\n".join(lines) + "\n"
