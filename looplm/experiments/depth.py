"""Depth safety: `looplm experiment depth [--variants ...] [--quick] [--out DIR] [--json]`.

Does running more rounds than training ran hurt? Each variant is the base recipe (the quickstart's
language model by default) with one depth-safety option switched on, trained on the same data and
seed; each is then read out at every depth from 1 to 4x its deepest training depth (the largest
forward depth any micro-batch ran, from its own depth histogram) over the same held-out batches,
with the loop state's RMS and its relative change per round measured from the states themselves
(evaluation/rounds.evaluate_rounds). Variants:

    plain              the base recipe as it is
    stochastic_stop    depth.kind = geometric: the loop stops after each round with a fixed
                       probability (stochastic stopping), at the base recipe's depth.min/max and
                       mean depth
    state_norm         model.state_norm: the state RMS-normalised after every round
    fixed_point        supervision.fixed_point: the terminal fixed-point term on the final rounds
    state_norm+fixed_point   both
    decay              model.injection = decay: the state carried into each round scaled by a learned
                       per-channel a in (0, 1) (a * s + e instead of s + e)
    additive           model.injection = add (s + e), the quickstart's injection before decay
A variant the base recipe already is (decay or additive) is left out.

The goal line per variant, as stated in the report: validation loss at 2x and at 4x the deepest
training depth at most GOAL_GAP above the variant's best depth, the state RMS at 4x at most
STATE_GROWTH_LIMIT times its RMS at the deepest training depth (`looplm check`'s limit), and the best
loss at most GOAL_GAP above the plain recipe's best.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..recipe.config import Recipe, derive_recipe, recipe_from_dict

GOAL_GAP = 0.01
"""Nats: the most a deeper depth may lose against the best one, and a variant's best against plain's."""
FIXED_POINT_WEIGHT = 1.0
"""supervision.fixed_point in the fixed_point variants."""
FIXED_POINT_ROUNDS = 2
"""supervision.fixed_point_rounds in the fixed_point variants."""
EXTRAPOLATE_FACTOR = 4
"""Depths are read out up to this many times the deepest training depth."""
QUICK = {"model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2, "data.seq_len": 16, "model.context": 32,
         "train.batch_size": 2, "train.steps": 4, "train.log_every": 1, "train.checkpoint_every": 1000,
         "data.max_bytes": 20_000, "train.eval_batches": 1, "optim.warmup_steps": 1, "train.threads": 1}
"""The seconds-long smoke-test size (tests, CI)."""


def variant_overrides(base: Recipe) -> dict[str, dict[str, Any]]:
    """Each variant's changes to the base recipe (the variants the base is not already)."""
    variants = _all_variants(base)
    # a variant the base already is (decay on the decayed quickstart) would only retrain plain
    return {k: v for k, v in variants.items() if k == "plain" or any(base_value(base, f) != x for f, x in v.items())}


def _all_variants(base: Recipe) -> dict[str, dict[str, Any]]:
    d = base.depth
    lo, hi = d.min_rounds, d.max_rounds
    if hi == lo:    # a fixed-depth base: stochastic stopping around it, up to twice as deep
        lo, hi = 1, 2 * d.rounds
    from ..train.depth import expected_depth
    mean = expected_depth(d)
    # geometric from lo: mean lo + (1 - p) / p before the cap, so p = 1 / (mean - lo + 1) keeps the base's mean
    stop = min(1.0, 1.0 / max(1.0, mean - lo + 1))
    fixed_point = {"supervision.fixed_point": FIXED_POINT_WEIGHT, "supervision.fixed_point_rounds": FIXED_POINT_ROUNDS}
    return {
        "plain": {},
        "stochastic_stop": {"depth.kind": "geometric", "depth.min": lo, "depth.max": hi,
                            "depth.rounds": min(max(d.rounds, lo), hi), "depth.stop_prob": round(stop, 4)},
        "state_norm": {"model.state_norm": True},
        "fixed_point": fixed_point,
        "state_norm+fixed_point": {"model.state_norm": True, **fixed_point},
        "decay": {"model.injection": "decay"},
        "additive": {"model.injection": "add"},
    }


def base_value(base: Recipe, field: str) -> Any:
    section, name = field.split(".")
    return getattr(getattr(base, section), name)


def parse_variants(text: str | None, base: Recipe) -> list[str]:
    known = list(variant_overrides(base))
    if text is None:
        return known
    names = [v.strip() for v in text.split(",") if v.strip()]
    for v in names:
        if v not in known:
            why = ("is the base recipe itself (plain runs it)" if v in _all_variants(base)
                   else "is unknown")
            raise UserError(f"--variants: variant {v!r} {why}; allowed: {', '.join(known)}")
    if not names or len(set(names)) != len(names):
        raise UserError("--variants: a comma-separated list of distinct variants, e.g. plain,state_norm")
    if "plain" not in names:    # every comparison is against it
        names.insert(0, "plain")
    return names


def variant_recipe(base: Recipe, name: str) -> Recipe:
    return derive_recipe(base.to_dict(), {"name": f"{base.name}-{name}", **variant_overrides(base)[name]}, quiet=True)


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[depth] {msg}", file=sys.stderr, flush=True)


def _train_variant(recipe_dict: dict[str, Any], out: str, threads: int) -> float:
    """Train one variant into `out` (a top-level function, so a worker process can run it); wall seconds."""
    from ..train.trainer import train
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    train(recipe_from_dict(recipe_dict), out, quiet=True)
    return time.perf_counter() - t0


def profile_run(path: Path, top: int) -> dict[str, Any]:
    """Loss, state RMS and relative state change at every depth 1..top over the run's held-out batches."""
    from ..evaluation.rounds import eval_batches_for, evaluate_rounds
    from ..runs import load_run
    run = load_run(path)
    hist = run.report["depth_histogram"]
    deepest = max(int(k) for k in hist)
    prof = evaluate_rounds(run.model, eval_batches_for(run), list(range(1, top + 1)), states=True)
    return {"deepest_trained": deepest, "depth_histogram": hist, "train_loss_final": run.report["train_loss_final"],
            "train_wall_time_s": run.report["wall_time_s"],
            "loss": {str(r): v["loss"] for r, v in prof.items()},
            "state_rms": {str(r): v["state_rms"] for r, v in prof.items()},
            "state_change": {str(r): v["state_change"] for r, v in prof.items()}}


def summarise(profile: dict[str, Any], plain_best: float | None) -> dict[str, Any]:
    """The goal line of one variant from its profile (plain_best: the plain recipe's best loss)."""
    from ..checks.base import STATE_GROWTH_LIMIT
    loss = {int(r): v for r, v in profile["loss"].items()}
    rms = {int(r): v for r, v in profile["state_rms"].items()}
    D = profile["deepest_trained"]
    best_r = min(loss, key=loss.get)
    best = loss[best_r]
    two, four = loss.get(2 * D), loss.get(EXTRAPOLATE_FACTOR * D)
    growth = rms[EXTRAPOLATE_FACTOR * D] / rms[D] if rms.get(D) else None
    gap2 = None if two is None else two - best
    gap4 = None if four is None else four - best
    vs_plain = None if plain_best is None else best - plain_best
    met = (gap2 is not None and gap2 <= GOAL_GAP and gap4 is not None and gap4 <= GOAL_GAP
           and growth is not None and growth <= STATE_GROWTH_LIMIT and (vs_plain is None or vs_plain <= GOAL_GAP))
    return {"deepest_trained": D, "best_rounds": best_r, "best_loss": best, "loss_at_deepest": loss[D],
            "loss_2x": two, "loss_4x": four, "gap_2x": gap2, "gap_4x": gap4,
            "state_rms_at_deepest": rms[D], "state_rms_4x": rms.get(EXTRAPOLATE_FACTOR * D),
            "state_rms_growth": growth, "state_change_4x": profile["state_change"].get(str(EXTRAPOLATE_FACTOR * D)),
            "best_vs_plain": vs_plain, "goal_met": met}


def run_depth(base: Recipe, out: str | Path, variants: list[str] | None = None, quiet: bool = False) -> dict[str, Any]:
    """Train every variant (in OUT/VARIANT), profile each at depths 1..4x its deepest training depth, and write
    OUT/result.json, OUT/report.md and OUT/depth_safety.png."""
    from ..checks.base import STATE_GROWTH_LIMIT
    from .extrapolate import _exit_with_parent
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    variants = variants or list(variant_overrides(base))
    recipes = {v: variant_recipe(base, v) for v in variants}
    threads = base.train.threads or torch.get_num_threads()
    workers = min(threads, len(variants)) if threads >= 2 else 1
    wall: dict[str, float] = {}
    if workers == 1:
        for v in variants:
            _say(f"training {v}", quiet)
            wall[v] = _train_variant(recipes[v].to_dict(), str(out / v), threads)
    else:   # small models use the cores better side by side than through intra-op threads
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        _say(f"training {', '.join(variants)} in {workers} worker processes of one thread each", quiet)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_exit_with_parent) as pool:
            futures = {v: pool.submit(_train_variant, recipes[v].to_dict(), str(out / v), 1) for v in variants}
            wall = {v: futures[v].result() for v in variants}
    torch.set_num_threads(threads)
    _say("reading out every depth", quiet)
    deepest = {v: max(int(k) for k in json.loads((out / v / "report.json").read_text())["depth_histogram"])
               for v in variants}
    top = EXTRAPOLATE_FACTOR * max(deepest.values())     # one axis for every variant
    profiles = {v: profile_run(out / v, top) for v in variants}
    plain_best = min(profiles["plain"]["loss"].values()) if "plain" in profiles else None
    summary = {v: summarise(profiles[v], None if v == "plain" else plain_best) for v in variants}
    result = {"recipe": base.name, "variants": {v: variant_overrides(base)[v] for v in variants},
              "goal": (f"loss at 2x and 4x the deepest training depth <= {GOAL_GAP} nats above the best depth's; "
                       f"state RMS at 4x <= {STATE_GROWTH_LIMIT} x its RMS at the deepest training depth; best loss "
                       f"<= {GOAL_GAP} nats above plain's"),
              "summary": summary, "profiles": profiles,
              "process_wall_time_s": {v: round(t, 1) for v, t in wall.items()}}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    plots = write_plot(out, result)
    (out / "report.md").write_text(markdown(result, plots))
    return result


def write_plot(out: Path, result: dict[str, Any]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for v, p in result["profiles"].items():
        rounds = [int(r) for r in p["loss"]]
        line, = axes[0].plot(rounds, list(p["loss"].values()), label=v)
        axes[0].axvline(p["deepest_trained"], color=line.get_color(), ls=":", lw=0.8)
        axes[1].plot(rounds, list(p["state_rms"].values()), label=v, color=line.get_color())
        axes[2].plot(rounds, list(p["state_change"].values()), label=v, color=line.get_color())
    for ax, title in zip(axes, ("validation loss (dotted: deepest training depth)", "state RMS",
                                "relative state change per round")):
        ax.set_xlabel("rounds")
        ax.set_title(title)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "depth_safety.png", dpi=90)
    plt.close(fig)
    return ["depth_safety.png"]


def _f(v: float | None, fmt: str = ".4f") -> str:
    return "—" if v is None else format(v, fmt)


def markdown(result: dict[str, Any], plots: list[str]) -> str:
    lines = ["# Depth safety", "", f"Base recipe `{result['recipe']}`; goal: {result['goal']}.", "",
             "| variant | changes | deepest trained | best (rounds) | at deepest | 2x | 4x | gap 2x | gap 4x | "
             "RMS growth deepest→4x | change/round at 4x | best − plain | goal |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for v, s in result["summary"].items():
        changes = ", ".join(f"{k}={val}" for k, val in result["variants"][v].items()) or "—"
        lines.append(f"| {v} | {changes} | {s['deepest_trained']} | {s['best_loss']:.4f} ({s['best_rounds']}) | "
                     f"{s['loss_at_deepest']:.4f} | {_f(s['loss_2x'])} | {_f(s['loss_4x'])} | {_f(s['gap_2x'], '+.4f')} | "
                     f"{_f(s['gap_4x'], '+.4f')} | {_f(s['state_rms_growth'], '.3f')} | "
                     f"{_f(s['state_change_4x'], '.2e')} | {_f(s['best_vs_plain'], '+.4f')} | "
                     f"{'met' if s['goal_met'] else 'not met'} |")
    variants = list(result["profiles"])
    top = max(int(r) for r in result["profiles"][variants[0]]["loss"])
    shown = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, top} & set(range(1, top + 1)))
    for key, title, fmt in (("loss", "Validation loss by rounds", ".4f"), ("state_rms", "State RMS by rounds", ".3f"),
                            ("state_change", "Relative state change of each round", ".2e")):
        lines += ["", f"## {title}", "", "| rounds | " + " | ".join(variants) + " |",
                  "|---:|" + "---:|" * len(variants)]
        for r in shown:
            lines.append(f"| {r} | " + " | ".join(format(result["profiles"][v][key][str(r)], fmt) for v in variants)
                         + " |")
    lines += ["", "Every depth's numbers are in result.json (`profiles`); each variant's run folder holds its "
                  "recipe card."]
    if plots:
        lines += [""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def summary_lines(result: dict[str, Any]) -> list[str]:
    return [f"{v}: best {s['best_loss']:.4f} at {s['best_rounds']} rounds; deepest trained {s['deepest_trained']}; "
            f"gap at 2x {_f(s['gap_2x'], '+.4f')}, at 4x {_f(s['gap_4x'], '+.4f')}; RMS growth "
            f"{_f(s['state_rms_growth'], '.3f')}x; best vs plain {_f(s['best_vs_plain'], '+.4f')}; goal "
            f"{'met' if s['goal_met'] else 'not met'}" for v, s in result["summary"].items()]
