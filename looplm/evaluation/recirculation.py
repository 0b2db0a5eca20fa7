"""Recirculation measured (`looplm recirculate`): held-out perplexity through the engine's schedule,
the calibration sweep over (source, destination) visit pairs and alpha, its heatmap and table, and
the blockwise approximation's loss gap to the exact schedule.

Why through the engine: recirculation changes what later positions read from the cache (each
position's refined entries overwrite its ordinary ones before the next position attends), so a
plain forward over the window cannot score it. Every window is one teacher-forced prefill chunk
with every position's logits: the recirculating engine runs it column by column (the exact schedules:
resume, the default, or serial, its reference) or whole (blockwise), the base engine as one ordinary
chunk; the sweep uses resume, the faster exact one. The readout is each position's first pass, as in
generation, so the loss here is the loss of what decoding would emit.

The blockwise schedule runs a whole chunk through both passes at once, so within one chunk every first
pass reads unrefined history: a window scored as one chunk is the base model exactly. It differs only
for the tokens after a refined prompt, so it is compared on that (`schedule_gap`: half of each window
a prompt chunk, the other half decoded one column per chunk and scored, against the exact schedule).

The calibration picks and reports on different text: the held-out windows are split in two disjoint halves
(`split_windows`), the sweep scores every setting on the first (`selection`) and picks the best there, and
the best setting alone is scored again, beside the base model, on the second (`confirmation`): the best of
many settings on the text it was picked on is biased upward, the confirmation is not.

The sign convention is the seeds' (perplexity *reduction*): change = (ppl_base - ppl) / ppl_base x 100,
positive = better, negative = worse; the table, the heatmap and the JSON say so where they show it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import UserError
from ..inference.engine import Engine
from ..inference.recirculation import Recirculation
from ..inference.sampler import SamplingParams
from ..model.losses import token_losses
from ..model.visits import visit_plan
from .rounds import eval_batches_for

ROWS = 64
"""Windows per engine pass: the exact schedules run one column of every row per chunk call, so more
rows share each call's Python overhead (batched rows: inference/recirculation.py)."""

EXACT = "resume"
"""The exact schedule the sweep and the blockwise comparison run: resume (equal to serial, its reference,
as tested in tests/test_recirculation.py, and faster: the second pass starts after d)."""

Windows = list[tuple[Tensor, Tensor]]


def heldout_windows(run: Any, tokens: int = 4096, window: int | None = None, data: str | None = None) -> Windows:
    """`tokens` target tokens (rounded up to whole windows) of held-out text as (x, y) windows of `window`
    columns (default the run's data.seq_len), at most ROWS rows per batch. The text is what `looplm eval` scores
    (`eval_batches_for`: the run's validation split, or --data): its non-overlapping windows of
    data.seq_len from the start, each cut into seq_len // window consecutive windows when smaller."""
    recipe = run.recipe
    if recipe.data.task and not data:
        raise UserError(f"run {run.path}: a task run (data.task = {recipe.data.task}) has no held-out text windows; "
                        "pass --data with a text file or folder")
    seq = recipe.data.seq_len
    width = seq if window is None else window
    if not 1 <= width <= seq:
        raise UserError(f"--window {window}: must lie in 1..{seq} (the run's data.seq_len)")
    if tokens < 1:
        raise UserError(f"--tokens {tokens}: must be a positive integer")
    per = seq // width                                      # windows of `width` in one of eval's windows
    want = math.ceil(tokens / width)
    rows = math.ceil(want / per)
    batches = eval_batches_for(run, data, max_batches=math.ceil(rows / recipe.train.batch_size))
    x, y = (torch.cat(parts)[:rows, :per * width].reshape(-1, width)[:want] for parts in zip(*batches))
    return list(zip(x.split(ROWS), y.split(ROWS)))


def split_windows(windows: Windows) -> tuple[Windows, Windows, int]:
    """The calibration's two disjoint splits of held-out windows: (selection, confirmation, n), selection
    the first n // 2 windows in order and confirmation the rest (whole windows: no token in both), each
    rebatched at most ROWS rows a batch. Fewer than two windows cannot be split: refused."""
    x, y = (torch.cat(parts) for parts in zip(*windows))                      # (N, T) every window, in order
    n = x.shape[0]
    if n < 2:
        raise UserError("--calibrate: needs at least two held-out windows, one to select on and one to confirm on "
                        "(raise --tokens or lower --window)")
    half = n // 2

    def batches(a: Tensor, b: Tensor) -> Windows:
        return list(zip(a.split(ROWS), b.split(ROWS)))
    return batches(x[:half], y[:half]), batches(x[half:], y[half:]), n


def engine_for(run: Any, rc: Recirculation | None = None) -> Engine:
    """The run's engine at its full depth (exit fixed, whatever the recipe's exit policy: held-out loss is
    the full-depth function, and recirculation refuses per-token exits), recirculating with `rc`."""
    return Engine.from_run(run, exit="fixed", exit_in_prefill=False, recirculation=rc)


@torch.inference_mode()
def heldout_loss(engine: Engine, windows: Windows, prompt: int | None = None) -> dict[str, float]:
    """Teacher-forced mean next-token cross-entropy (and perplexity, tokens) of the windows through the
    engine's chunks: each (B, T) window batch is one prefill chunk with every position's logits, which a
    recirculating engine runs by its schedule and the base engine as one chunk. `prompt` (the blockwise
    comparison): each window's first `prompt` columns are one prefill chunk, a prompt, and the rest run one
    column per chunk as decoding runs them; only those later columns are scored. A random initial loop
    state reads the seed-0 noise table in every row, as `model(x)` does in eval mode."""
    engine.kernels()                                # fresh fused kernels, as a generation starts
    total, count = 0.0, 0
    ref = next(engine.model.parameters())
    for x, y in windows:
        x, y = x.to(ref.device), y.to(ref.device)
        B, T = x.shape
        noise = engine.initial_noise([SamplingParams()], ref)
        noise = None if noise is None else noise.expand(B, -1, -1)      # one table, every row (not B copies)
        if prompt is None:                                              # one prefill chunk, every column scored
            logits = engine.score(x, T, noise=noise, prompt_logits=True)[0]                   # (B, T, V)
        else:
            logits = engine.score(x, prompt, noise=noise)[0]                                  # (B, T - prompt, V)
            y = y[:, prompt:]
        total += token_losses(logits, y).sum().item()
        count += y.numel()
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(50.0, loss)), "tokens": count}


def change_pct(base_ppl: float, ppl: float) -> float:
    """Perplexity change in percent, (ppl_base - ppl) / ppl_base x 100: positive = better, negative = worse."""
    return (base_ppl - ppl) / base_ppl * 100.0


def recirculated_loss(run: Any, rc: Recirculation, windows: Windows, base: dict[str, float]) -> dict[str, float]:
    """Held-out loss under `rc`. alpha = 0 is the identity (beta_t = 1 either way: the schedule skips the
    refinement pass), so it is the base model and is not run again: its change is exactly 0."""
    if rc.alpha == 0 and getattr(rc, "mixer", None) is None:      # a learned mixer sets its own alpha
        return dict(base)
    return heldout_loss(engine_for(run, rc), windows)


def schedule_gap(run: Any, rc: Recirculation, windows: Windows) -> dict[str, Any]:
    """The blockwise schedule against the exact one (EXACT) for one setting, where they differ: a whole
    window as one chunk is the base model under blockwise (every first pass reads unrefined history), so
    each window's first half is a prompt chunk and its second half is decoded one column per chunk
    (teacher-forced) and scored, under the base model, the exact schedule and blockwise. gap = blockwise
    loss - exact loss: what the approximate prompt costs the tokens after it (positive = blockwise worse)."""
    T = windows[0][0].shape[1]
    if T < 2:
        raise UserError("--window 1: the blockwise comparison needs a prompt and a token after it (--window >= 2)")
    p = T // 2
    losses = {name: heldout_loss(engine_for(run, r), windows, prompt=p)
              for name, r in (("base", None), ("exact", dataclasses.replace(rc, schedule=EXACT)),
                              ("blockwise", dataclasses.replace(rc, schedule="blockwise")))}
    return {**{k: {"loss": v["loss"], "ppl": v["ppl"]} for k, v in losses.items()},
            "gap": losses["blockwise"]["loss"] - losses["exact"]["loss"], "exact_schedule": EXACT, "prompt": p,
            "scored_tokens": losses["base"]["tokens"],
            "scored": f"columns {p}..{T - 1} of each window, after columns 0..{p - 1} as one prompt chunk"}


def evaluate(run: Any, rc: Recirculation, windows: Windows) -> dict[str, Any]:
    """One setting on held-out windows (`looplm recirculate RUN --s S --d D --alpha A`): the base and the
    recirculated loss and perplexity, the change (percent, positive = better), the tokens scored. Under
    the blockwise schedule every number is `schedule_gap`'s (the tokens after a prompt chunk, where
    blockwise differs from the base model), with the exact schedule's loss and the gap."""
    engine_for(run, rc)                                  # the engine's refusals before any work
    extra: dict[str, Any] = {}
    if rc.schedule == "blockwise":
        gap = schedule_gap(run, rc, windows)
        base, got, tokens = gap["base"], gap["blockwise"], gap["scored_tokens"]
        extra = {k: gap[k] for k in ("exact", "exact_schedule", "gap", "prompt", "scored")}
    else:
        base = heldout_loss(engine_for(run), windows)
        got, tokens = recirculated_loss(run, rc, windows, base), base["tokens"]
    return {"s": rc.source, "d": rc.dest, "alpha": rc.alpha, "beta": rc.beta, "ramp": rc.ramp,
            "schedule": rc.schedule, "rounds": run.model.nominal_rounds, "tokens": tokens,
            "window": windows[0][0].shape[1], "base": {"loss": base["loss"], "ppl": base["ppl"]},
            "recirculated": {"loss": got["loss"], "ppl": got["ppl"]},
            "loss": got["loss"], "base_loss": base["loss"],                  # the CONTRACT's keys
            "change_pct": change_pct(base["ppl"], got["ppl"]),
            "change": "(ppl_base - ppl) / ppl_base x 100: positive = better, negative = worse", **extra}


def every_pair(run: Any) -> list[tuple[int, int]]:
    """Every (s, d) with d < s over the run's visits at its rounds."""
    n = len(visit_plan(run.model.cfg, run.model.nominal_rounds))
    return [(s, d) for s in range(1, n) for d in range(s)]


def calibrate(run: Any, pairs: Sequence[tuple[int, int]], alphas: Sequence[float], windows: Windows,
              beta: str = "complement", ramp: int = 0,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The calibration sweep, picking on one split of the held-out windows and reporting on another
    (`split_windows`). `selection`: the perplexity change (percent, positive = better) of the exact schedule
    (EXACT) at every (s, d) in `pairs` and alpha in `alphas` against the base model on the first half (its
    `cells`), and the best cell. `confirmation`: that best setting and the base model scored on the second,
    disjoint half: the figure to quote. The blockwise schedule's gap at the best setting is measured on the
    confirmation windows too. Every setting is checked against the model before any work (a refusal costs
    nothing)."""
    rounds = run.model.nominal_rounds
    settings = [Recirculation(source=s, dest=d, alpha=a, beta=beta, ramp=ramp, schedule=EXACT)
                for s, d in pairs for a in alphas]
    if not settings:
        raise UserError("--calibrate: no (s, d) pair or no alpha to sweep")
    for rc in settings:
        rc.check(run.model.cfg, rounds)
    engine_for(run, settings[0])            # the engine's refusals (exit policy, feedback, routing), up front
    pick, confirm, n = split_windows(windows)
    base = heldout_loss(engine_for(run), pick)
    cells = []
    for i, rc in enumerate(settings, 1):
        got = recirculated_loss(run, rc, pick, base)
        cells.append({"s": rc.source, "d": rc.dest, "alpha": rc.alpha, "loss": got["loss"], "ppl": got["ppl"],
                      "change_pct": change_pct(base["ppl"], got["ppl"])})
        if progress:
            progress(f"[{i}/{len(settings)}] s {rc.source} -> d {rc.dest}, alpha {rc.alpha:g}: "
                     f"change {cells[-1]['change_pct']:+.3f}% (selection split)")
    best = max(cells, key=lambda c: c["change_pct"])
    best_rc = next(rc for rc, c in zip(settings, cells) if c is best)
    confirm_base = heldout_loss(engine_for(run), confirm)
    confirmed = recirculated_loss(run, best_rc, confirm, confirm_base)
    gap = schedule_gap(run, best_rc, confirm)
    half = n // 2
    return {"selection": {"windows": [0, half], "tokens": base["tokens"],
                          "base": {"loss": base["loss"], "ppl": base["ppl"]}, "cells": cells, "best": best},
            "confirmation": {"windows": [half, n], "tokens": confirm_base["tokens"],
                             "base": {"loss": confirm_base["loss"], "ppl": confirm_base["ppl"]},
                             "best": {"s": best["s"], "d": best["d"], "alpha": best["alpha"],
                                      "loss": confirmed["loss"], "ppl": confirmed["ppl"],
                                      "change_pct": change_pct(confirm_base["ppl"], confirmed["ppl"])}},
            "split": "held-out windows [start, stop) in order: the sweep picks on selection, the pick is scored on "
                     "confirmation (disjoint windows it was not picked on)",
            "window": windows[0][0].shape[1], "rounds": rounds, "beta": beta, "ramp": ramp, "schedule": EXACT,
            "alphas": list(alphas), "pairs": [list(p) for p in pairs],
            "visits": [str(v) for v in visit_plan(run.model.cfg, rounds)],
            "blockwise_gap_at_best": gap,
            "loss": confirmed["loss"], "base_loss": confirm_base["loss"],   # the CONTRACT's keys: the confirmation's
            "change": "(ppl_base - ppl) / ppl_base x 100: positive = better, negative = worse"}


def _grid(table: dict[str, Any], alpha: float) -> tuple[list[int], list[int], list[list[float]]]:
    """(s values, d values, change[s][d] with NaN where no pair was measured) at one alpha."""
    cells = {(c["s"], c["d"]): c["change_pct"] for c in table["selection"]["cells"] if c["alpha"] == alpha}
    ss = sorted({s for s, _ in cells})
    ds = sorted({d for _, d in cells})
    return ss, ds, [[cells.get((s, d), math.nan) for d in ds] for s in ss]


def heatmap(table: dict[str, Any], path: str | Path) -> None:
    """One panel per alpha: source visit s (rows) x destination visit d (columns) -> perplexity change
    (percent), on a diverging colormap centred at 0 (red = worse, blue = better), each cell annotated."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = table["alphas"]
    scale = max((abs(c["change_pct"]) for c in table["selection"]["cells"]), default=0.0) or 1.0   # 0 is white
    grids = [_grid(table, a) for a in alphas]
    cols = max(len(g[1]) for g in grids)
    rows = max(len(g[0]) for g in grids)
    fig, axes = plt.subplots(1, len(alphas), squeeze=False, layout="constrained",     # room for the titles
                             figsize=(len(alphas) * (1.4 + 0.5 * cols) + 1.2, 2.0 + 0.42 * rows))
    im = None
    for ax, a, (ss, ds, grid) in zip(axes[0], alphas, grids):
        ax.set_facecolor("0.85")             # pairs not measured (NaN) grey, apart from a change of 0 (white)
        im = ax.imshow(grid, cmap="RdBu", vmin=-scale, vmax=scale, aspect="auto", origin="lower")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:+.2g}", ha="center", va="center", fontsize=6,      # 2 digits at any scale
                            color="white" if abs(v) > 0.6 * scale else "black")
        ax.set_xticks(range(len(ds)), [str(d) for d in ds])
        ax.set_yticks(range(len(ss)), [str(s) for s in ss])
        ax.set_xlabel("d (destination visit)")
        ax.set_ylabel("s (source visit)")
        ax.set_title(f"alpha {a:g}", fontsize=9)
    fig.colorbar(im, ax=list(axes[0]), fraction=0.03)
    conf = table["confirmation"]
    fig.suptitle(f"perplexity change (%) = (ppl_base - ppl) / ppl_base, negative = worse\nselection split: "
                 f"{table['selection']['tokens']} held-out tokens, {table['rounds']} rounds, beta {table['beta']}, ramp "
                 f"{table['ramp']}; the best on {conf['tokens']} other tokens (confirmation): "
                 f"{conf['best']['change_pct']:+.3g}%", fontsize=9)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def markdown(table: dict[str, Any], run_label: str = "the run", png: str | None = None) -> str:
    """The calibration as a Markdown section: the selection split's table (one row per (s, d), one column per
    alpha, percent change), the best setting there, and its confirmation on the other split."""
    alphas = table["alphas"]
    sel, conf = table["selection"], table["confirmation"]
    by = {(c["s"], c["d"], c["alpha"]): c["change_pct"] for c in sel["cells"]}
    base, best, gap = sel["base"], sel["best"], table["blockwise_gap_at_best"]
    cbase, cbest = conf["base"], conf["best"]
    lines = [f"Recirculation calibration on {run_label}: perplexity change (%) = (ppl_base - ppl) / ppl_base x 100; "
             f"**positive = better, negative = worse**. The held-out windows (of {table['window']} tokens) are split "
             f"in two disjoint halves: the sweep below picks on the **selection** split (windows "
             f"{sel['windows'][0]}..{sel['windows'][1] - 1}, {sel['tokens']} tokens), and the best setting is scored "
             f"again on the **confirmation** split (windows {conf['windows'][0]}..{conf['windows'][1] - 1}, "
             f"{conf['tokens']} tokens) it was not picked on. Selection base: loss {base['loss']:.4f}, perplexity "
             f"{base['ppl']:.3f} at {table['rounds']} rounds; beta {table['beta']}, ramp {table['ramp']}, the exact "
             f"schedule ({table['schedule']}).", "",
             "| s -> d | " + " | ".join(f"alpha {a:g}" for a in alphas) + " |",
             "|---|" + "---:|" * len(alphas)]
    for s, d in (tuple(p) for p in table["pairs"]):
        lines.append(f"| {s} -> {d} | " + " | ".join(f"{by[(s, d, a)]:+.3f}" for a in alphas) + " |")
    verdict = "" if best["change_pct"] > 0 else " (no setting improves on the base model)"
    lines += ["", f"Best on the selection split: s {best['s']} -> d {best['d']} at alpha {best['alpha']:g}: "
                  f"{best['change_pct']:+.3f}% (perplexity {base['ppl']:.3f} -> {best['ppl']:.3f}){verdict}.", "",
              f"Confirmation (the same setting on the other split): loss {cbase['loss']:.5f} -> {cbest['loss']:.5f}, "
              f"perplexity {cbase['ppl']:.3f} -> {cbest['ppl']:.3f}: **{cbest['change_pct']:+.3f}%**.", "",
              f"The blockwise schedule at the best setting, on the confirmation split, scored on {gap['scored']} "
              f"({gap['scored_tokens']} tokens; a whole window in one chunk is the base model under blockwise): loss "
              f"base {gap['base']['loss']:.5f}, exact ({gap['exact_schedule']}) {gap['exact']['loss']:.5f}, blockwise "
              f"{gap['blockwise']['loss']:.5f} (gap blockwise - exact {gap['gap']:+.2e}).",
              "", "Visits: " + "; ".join(table["visits"]) + "."]
    if png:
        lines += ["", f"![recirculation calibration]({png})"]
    return "\n".join(lines)
