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
"""

from __future__ import annotations

import json
import math
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
    from ..train.trainer import lr_at, make_optimizer

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
            for group in opt.param_groups:
                group["lr"] = lr_at(step, recipe)
            step_loss = 0.0
            for micro in range(accum):
                x, y, opts = sampler.batch(step * accum + micro)
                mask = opts["mask"]
                loss = mean_loss(token_losses(model(x), y, mask), mask)
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


def run_extrapolate(recipe: Recipe, out_dir: str | Path, quiet: bool = False) -> dict[str, Any]:
    """Train the looped model and its baselines, evaluate difficulty x rounds, probe, report.

    With train.threads >= 2 the models train in that many single-threaded worker processes
    (small models use several cores better side by side than through intra-op threads)."""
    t_start = time.perf_counter()
    if not recipe.data.task:
        raise UserError("recipe field data.task: the extrapolate experiment needs task data (e.g. \"chain\")")
    if recipe.model.untied:
        raise UserError("recipe field model.untied: must be false; the experiment builds the untied baselines itself")
    out = Path(out_dir)
    names = ["looped", *recipe.data.baselines]
    if (out / "report.json").exists() or any((out / n / "checkpoint").exists() for n in names):
        raise UserError(f"--out {out}: already holds an experiment; choose another folder")
    source = TaskSource(recipe)  # validates the task dials before anything trains
    tok = ByteTokenizer()
    d = recipe.data
    eval_rounds_max = d.eval_rounds_max or 2 * recipe.depth.max_rounds
    eval_sets = source.eval_sets(d.eval_examples)
    workers = min(recipe.train.threads, len(names)) if recipe.train.threads >= 2 else 1
    # Workers each take a core; evaluation then runs here on one thread (robust on a busy machine).
    torch.set_num_threads(1 if workers > 1 else (recipe.train.threads or torch.get_num_threads()))

    from ..model.looped import build_model

    recipes = {"looped": recipe, **baseline_recipes(recipe), "lstm": recipe}
    lstm_target = build_model(recipe).params_stored()
    # The costliest first, so a pool of workers finishes close together.
    order = sorted(names, key=lambda n: ["untied_same_compute", "looped", "lstm", "untied_same_params"].index(n))
    info: dict[str, dict[str, Any]] = {}
    if workers == 1:
        for name in order:
            _say(f"training {name} ({recipes[name].train.steps} steps)", quiet)
            info[name] = _train_model(name, recipes[name].to_dict(), str(out), quiet, lstm_target)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        _say(f"training {', '.join(order)} in {workers} worker processes of one thread each", quiet)
        one_thread = {n: apply_overrides(recipes[n].to_dict(), {"train.threads": 1}) for n in order}
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_exit_with_parent) as pool:
            futures = {n: pool.submit(_train_model, n, one_thread[n], str(out), True, lstm_target) for n in order}
            for name in order:
                info[name] = futures[name].result()
                _say(f"{name} trained in {info[name]['process_wall_time_s']:.0f} s", quiet)
    info = {n: info[n] for n in names}
    models = {n: _load_model(n, out, recipes[n], info[n]) for n in names}

    _say("evaluating", quiet)
    rounds_for = {"looped": list(range(1, eval_rounds_max + 1)), "lstm": [1],
                  **{n: [recipes[n].depth.rounds] for n in recipes if n.startswith("untied")}}
    tables = {n: accuracy_table(models[n], tok, eval_sets, rounds_for[n], separator=d.separator) for n in names}
    accuracy = {n: {str(dd): {str(r): v["accuracy"] for r, v in row.items()} for dd, row in t.items()}
                for n, t in tables.items()}
    loss = {n: {str(dd): {str(r): v["loss"] for r, v in row.items()} for dd, row in t.items()}
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
    guess = digit_guess_baseline(eval_sets)
    result = {
        "task": d.task,
        "train_difficulty_min": source.train_levels[0],
        "train_difficulty_max": source.train_levels[-1],
        "eval_difficulty_max": source.eval_max,
        "train_rounds": {"min": recipe.depth.min_rounds, "max": recipe.depth.max_rounds},
        "eval_rounds_max": eval_rounds_max,
        "prompt_length": {"items": source.length, "tokens_by_difficulty": {str(k): v for k, v in lengths.items()}},
        "eval_examples_per_difficulty": {str(k): len(v) for k, v in eval_sets.items()},
        "digit_guess_baseline": guess,
        "models": accuracy,
        "answer_loss": loss,
        "model_info": info,
        "probes": probes,
        "recipe": recipe.to_dict(),
        "out": str(out),
        "wall_time_s": time.perf_counter() - t_start,
    }
    plots = write_heatmaps(out, result)
    write_text(out / "report.json", json.dumps(result, indent=2) + "\n")
    write_text(out / "report.md", render_markdown(result, plots))
    return result


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


def write_heatmaps(out: Path, result: dict[str, Any]) -> list[str]:
    """One heatmap per model: difficulty (rows) x rounds (columns) -> exact match."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    dmax, rmax = result["train_difficulty_max"], result["train_rounds"]["max"]
    for model, table in result["models"].items():
        t = _floats(table)
        diffs = sorted(t)
        rounds = sorted({r for row in t.values() for r in row})
        grid = [[t[dd].get(r, math.nan) for r in rounds] for dd in diffs]
        fig, ax = plt.subplots(figsize=(1.2 + 0.45 * len(rounds), 1.0 + 0.4 * len(diffs)))
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
        ax.set_title(f"{model}: exact match ({result['task']})", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.05)
        fig.tight_layout()
        name = f"heatmap_{model}.png"
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        names.append(name)
    return names


def summary_lines(result: dict[str, Any]) -> list[str]:
    """Best accuracy per model at the hardest evaluated difficulty, in words."""
    top = str(result["eval_difficulty_max"])
    lines = []
    for model, table in result["models"].items():
        row = table.get(top, {})
        if row:
            r, acc = max(row.items(), key=lambda kv: (kv[1], -int(kv[0])))
            lines.append(f"{model}: {100 * acc:.1f}% at difficulty {top} (best over rounds; at {r} rounds)")
    return lines


def render_markdown(result: dict[str, Any], plots: list[str]) -> str:
    rec = result["recipe"]
    pl = result["prompt_length"]
    lines = [
        f"# Depth extrapolation: {result['task']}", "",
        f"Recipe `{rec['name']}`. Trained on difficulties {result['train_difficulty_min']}..{result['train_difficulty_max']} "
        f"for {rec['train']['steps']} steps of {rec['train']['batch_size']} examples; the looped model ran "
        f"{result['train_rounds']['min']}..{result['train_rounds']['max']} rounds in training and is evaluated at "
        f"1..{result['eval_rounds_max']} rounds on difficulties up to {result['eval_difficulty_max']}.", "",
        f"Prompt length is a separate dial: every prompt has {pl['items']} items (distractors pad easier "
        "examples), so difficulty never shows in the length. Mean prompt tokens by difficulty: "
        + ", ".join(f"{k}: {v:.0f}" for k, v in pl["tokens_by_difficulty"].items()) + ".", "",
        *(["Round targets: `trace`. Every round was supervised; round r < k of a k-hop training example was "
           "trained to read out the name reached after r hops, the final round and rounds from k on the "
           "answer. The models never saw more than "
           f"{result['train_difficulty_max']} hops; the per-round signal fixes what one round computes (one hop), "
           "so whether more rounds solve longer chains is what the tables below test.", ""]
          if rec["data"].get("round_targets") == "trace" else []),
        "## Summary", "", *[f"- {s}" for s in summary_lines(result)],
        *(["- guessing among the prompt's digits would score: " + ", ".join(
            f"difficulty {k}: {100 * v:.0f}%" for k, v in result["digit_guess_baseline"].items())]
          if result.get("digit_guess_baseline") else []), "",
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
