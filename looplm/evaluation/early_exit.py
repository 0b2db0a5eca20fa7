"""Early exit, evaluated: held-out loss, measured rounds and wall time of exit policies, and sweeps of
their thresholds (`looplm eval --exit/--exit-sweep`).

The pass itself — per-token early exit over whole sequences, where exiting really skips work — is the
inference runtime's (`inference/early_exit.py`: `early_exit`, the function the cached decoder computes);
this module measures it and writes the tables, plots and report sections.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Iterable

import torch
from torch import Tensor

from ..errors import UserError
from ..halting import ExitPolicy, hazards_to_masses, parse_exit_policy, successive_kl, token_entropy
from ..halting.hazards import act_mixture_terms
from ..inference.early_exit import early_exit, resolve_policy
from .rounds import batch_generator      # evaluate_rounds' per-batch noise: fixed:R matches its table



# ---------------------------------------------------------------------------------------
# Evaluation: loss, measured rounds and wall time of a policy; sweeps of thresholds.

@torch.no_grad()
def evaluate_exit(model, batches: Iterable[tuple[Tensor, Tensor]], policy: str | ExitPolicy,
                  rounds: int | None = None, repeats: int = 1, missing: str = "copy_forward") -> dict[str, Any]:
    """Loss of `policy` on `batches` with its measured cost: {"policy", "loss", "ppl", "mean_rounds",
    "max_rounds", "wall_time_s", "rounds_histogram", "rows_computed"}. wall_time_s times the
    early-exit forward passes only (loss arithmetic excluded), summed over batches; with
    repeats > 1 it is the median over that many passes."""
    from ..model.losses import token_losses

    policy = resolve_policy(policy)
    model.eval()
    batches = list(batches)
    loss_sum, rounds_sum, count, scored, wall, rows = 0.0, 0, 0, 0.0, 0.0, 0
    hist = torch.zeros(0, dtype=torch.long)
    budget = None
    for x, y, *rest in batches:
        mask = rest[0] if rest and isinstance(rest[0], Tensor) else None   # task data: answer tokens only
        t0 = time.perf_counter()
        out = early_exit(model, x, policy, rounds, generator=batch_generator(count), missing=missing)
        wall += time.perf_counter() - t0
        budget = out.computed.shape[-1]
        loss_sum += token_losses(out.logits, y, mask).sum().item()
        scored += y.numel() if mask is None else mask.sum().item()
        rounds_sum += int(out.rounds_used.sum())
        rows += out.rows_computed
        hist = _add_hist(hist, out.rounds_used, budget)
        count += y.numel()
    if count == 0:
        raise UserError("evaluation data: no batches to evaluate")
    if repeats > 1:
        wall = time_policies(model, batches, [(policy, rounds)], repeats, missing, first=[wall])[0]
    loss = loss_sum / max(1.0, scored)
    return {"policy": str(policy), "loss": loss, "ppl": math.exp(min(50.0, loss)), "mean_rounds": rounds_sum / count,
            "max_rounds": budget, "wall_time_s": wall,
            "rounds_histogram": {str(r + 1): int(n) for r, n in enumerate(hist.tolist()) if n},
            "rows_computed": rows}


@torch.no_grad()
def time_policies(model, batches: list, policies: list[tuple[str | ExitPolicy, int | None]], repeats: int,
                  missing: str = "copy_forward", first: list[float] | None = None) -> list[float]:
    """Median wall time (s) of each (policy, rounds)'s early-exit passes over all `batches`.
    Within each of the `repeats` passes every policy is timed in turn, so a slow spell of a
    shared machine slows them all alike instead of one policy's whole measurement; `first`:
    already measured passes (one per policy) counted among the repeats."""
    walls = [[w] for w in first] if first is not None else [[] for _ in policies]
    for _ in range(repeats - len(walls[0])):
        for i, (pol, R) in enumerate(policies):
            t0, seen = time.perf_counter(), 0
            for x, *_ in batches:
                early_exit(model, x, pol, R, generator=batch_generator(seen), missing=missing)
                seen += x.numel()
            walls[i].append(time.perf_counter() - t0)
    return [statistics.median(w) for w in walls]


def _add_hist(hist: Tensor, rounds_used: Tensor, R: int) -> Tensor:
    counts = torch.bincount(rounds_used.flatten() - 1, minlength=R)
    if hist.numel() < counts.numel():
        hist = torch.cat([hist, hist.new_zeros(counts.numel() - hist.numel())])
    return hist + counts


@torch.no_grad()
def exit_distribution_depth(model, batches: Iterable[tuple[Tensor, Tensor]], rounds: int) -> float | None:
    """Mean exit round under the gate's exit distribution, E[t] = sum_t t p_t, over tokens at full
    depth `rounds` (masses from the hazards, last round forced). A statistic of the distribution,
    not any policy's measured serving depth; None for a model without a gate."""
    rep = exit_mixture(model, batches, rounds, losses=False)
    return None if rep is None else rep["mean_exit_round"]


@torch.no_grad()
def exit_mixture(model, batches: Iterable[tuple[Tensor, Tensor]], rounds: int,
                 losses: bool = True) -> dict[str, Any] | None:
    """What a gated model outputs when its exit distribution is used as ACT uses it: every round
    1..`rounds` read out and the rounds' next-token probabilities mixed by the exit masses,
    P(y) = sum_t p_t softmax(z_t)[y]. Held-out loss -log P(y) (the task term `supervision.kind =
    "act_mixture"` trains; `halting.act_mixture_terms`), beside the distribution's mean exit round.
    Every round runs for every token: a quality figure, not a saving. None for a model without a gate."""
    from ..model.losses import token_losses
    if model.gate is None:
        return None
    model.eval()
    device = next(model.parameters()).device
    total, depth, count = 0.0, 0.0, 0
    every = tuple(range(1, rounds + 1))
    for x, y in batches:
        x, y = x.to(device), y.to(device)                                    # (B, T) each
        out = model(x, rounds, readout_rounds=every if losses else None, generator=batch_generator(count))
        masses = hazards_to_masses(out.hazards[..., :rounds])                 # (B, T, R)
        depth += (masses * torch.arange(1, rounds + 1, dtype=masses.dtype, device=device)).sum().item()
        if losses:
            per_round = torch.stack([token_losses(out.round_logits[t], y) for t in every], -1)   # (B, T, R)
            total += act_mixture_terms(per_round, masses, beta=0.0, reduce=False).task.sum().item()
        count += y.numel()
    count = max(1, count)
    rep: dict[str, Any] = {"rounds": rounds, "mean_exit_round": depth / count}
    if losses:
        rep.update(loss=total / count, ppl=math.exp(min(50.0, total / count)))
    return rep


SWEEP_KINDS = ("quantile", "entropy", "kl")
_QUANTILES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
_PROBE_LEVELS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def parse_sweep(text: str) -> tuple[str, list[float] | None]:
    """"entropy" or "entropy:0.5,1,2" -> (kind, thresholds or None for the default range)."""
    kind, sep, rest = text.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in SWEEP_KINDS:
        raise UserError(f"--exit-sweep {text!r}: expected one of {', '.join(SWEEP_KINDS)}, "
                        "optionally with thresholds, e.g. entropy:0.5,1,2")
    if not sep:
        return kind, None
    try:
        values = [float(v) for v in rest.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise UserError(f"--exit-sweep {text!r}: thresholds must be comma-separated numbers, e.g. {kind}:0.1,0.5")
    for v in values:
        resolve_policy(f"{kind}:{v}")                                  # validates the range (UserError)
    return kind, values


@torch.no_grad()
def default_thresholds(model, kind: str, batches: list[tuple[Tensor, Tensor]], rounds: int) -> list[float]:
    """A threshold range that spans the model's behaviour. quantile: fixed levels of Q. entropy/kl:
    quantiles of the per-token entropies (or successive KLs) at rounds before the last, measured on
    the first batch, so the sweep runs from "almost nobody exits early" to "almost everybody"."""
    if kind == "quantile":
        return list(_QUANTILES)
    x = batches[0][0]
    out = model(x, rounds, readout_rounds=tuple(range(1, rounds + 1)), generator=batch_generator(0))
    if rounds == 1:
        return [1.0]
    if kind == "entropy":
        vals = torch.cat([token_entropy(out.round_logits[r]).flatten() for r in range(1, rounds)])
    else:
        if rounds == 2:
            vals = successive_kl(out.round_logits[2], out.round_logits[1]).flatten()
        else:
            vals = torch.cat([successive_kl(out.round_logits[r], out.round_logits[r - 1]).flatten()
                              for r in range(2, rounds)])
    levels = torch.quantile(vals.double().clamp_min(0), torch.tensor(_PROBE_LEVELS, dtype=torch.float64))
    raw = sorted({v for v in levels.tolist() if v > 0})
    for digits in (3, 4, 5, 6, 8):   # short numbers, but not so short that distinct levels merge
        picked = sorted({float(f"{v:.{digits}g}") for v in raw})
        if len(picked) == len(raw):
            break
    return picked or [1e-3]


def exit_sweep(model, batches: list[tuple[Tensor, Tensor]], kind: str, rounds: int,
               thresholds: list[float] | None = None, min_rounds: int = 1, repeats: int = 1,
               missing: str = "copy_forward") -> list[dict[str, Any]]:
    """evaluate_exit for each threshold of one policy kind, on the same batches."""
    if kind not in SWEEP_KINDS:
        raise UserError(f"exit sweep kind {kind!r}: expected one of {', '.join(SWEEP_KINDS)}")
    thresholds = thresholds or default_thresholds(model, kind, batches, rounds)
    return [evaluate_exit(model, batches, parse_exit_policy(f"{kind}:{v}", min_rounds=min_rounds), rounds, repeats,
                          missing)
            for v in thresholds]


def fixed_reference(model, batches: list[tuple[Tensor, Tensor]], rounds: int, repeats: int = 1) -> list[dict[str, Any]]:
    """evaluate_exit for fixed:1 .. fixed:rounds: the compute-quality curve without adaptivity."""
    return [evaluate_exit(model, batches, f"fixed:{r}", r, repeats) for r in range(1, rounds + 1)]


def sweep_markdown(kind: str, rows: list[dict[str, Any]], reference: list[dict[str, Any]],
                   distribution_depth: float | None) -> str:
    """The report section: a table of the sweep beside full depth, and the two depth figures."""
    full = reference[-1]
    lines = [f"Exit policy `{kind}` swept over thresholds on the same validation batches. "
             "*Mean rounds used* is measured: the rounds each token actually ran (rounds after its exit "
             "are not computed). *Wall time* is the measured time of the early-exit forward passes "
             f"(median of {TIMING_REPEATS} passes, every policy and fixed depth timed in turn within each pass; "
             "fixed depths run through the same early-exit code).", ""]
    if distribution_depth is not None:
        lines += [f"- exit-distribution mean depth (E[t] under the gate's masses at full depth "
                  f"{full['max_rounds']}): **{distribution_depth:.2f}** rounds — a statistic of the "
                  "distribution, not a serving depth", ""]
    lines += ["| policy | loss | loss vs full depth | mean rounds used | wall time (s) | time vs full depth |",
              "|---|---:|---:|---:|---:|---:|"]
    for row in rows + [dict(full, policy=f"{full['policy']} (full depth)")]:
        lines.append(f"| {row['policy']} | {row['loss']:.4f} | {row['loss'] - full['loss']:+.4f} | "
                     f"{row['mean_rounds']:.2f} | {row['wall_time_s']:.3f} | "
                     f"{row['wall_time_s'] / max(1e-12, full['wall_time_s']):.2f}x |")
    lines += ["", "Fixed depth for comparison: " + ", ".join(
        f"{r['policy']} loss {r['loss']:.4f} in {r['wall_time_s']:.3f} s" for r in reference),
        "", f"![exit sweep {kind}](exit_sweep_{kind}.png)"]
    return "\n".join(lines)


def plot_sweep(path, kind: str, rows: list[dict[str, Any]], reference: list[dict[str, Any]],
               accuracy: bool = False) -> None:
    """Loss against mean rounds used and against measured wall time, policy beside fixed depth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "accuracy" if accuracy else "loss"
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, xkey, xlabel in zip(axes, ("mean_rounds", "wall_time_s"), ("mean rounds used", "measured wall time (s)")):
        ax.plot([r[xkey] for r in reference], [r[key] for r in reference], marker="s", color="gray",
                label="fixed depth 1..R")
        ax.plot([r[xkey] for r in rows], [r[key] for r in rows], marker="o", label=f"{kind} threshold sweep")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"validation {key}")
        ax.legend(fontsize=8)
    fig.suptitle(f"Early exit ({kind}): quality vs compute")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


EXIT_PASS_ROWS = 32
"""`looplm eval --exit/--exit-sweep` without --batch-size time early exit in passes of at least this
many rows (the validation windows regrouped) when the initial state is deterministic, so that the
losses and rounds are exactly those of the recipe's batches; a random initial state keeps the
recipe's batches (its noise is drawn per pass), so fixed:R still equals the rounds table."""

TIMING_REPEATS = 5
"""`looplm eval --exit/--exit-sweep` report the median wall time of this many passes per policy,
the policies (and the fixed depths beside them) timed in turn within each pass (`time_policies`)."""


def cli_policy(text: str, recipe) -> ExitPolicy:
    """`--exit` text with the recipe's exit.min_rounds; plain "fixed" means all depth.rounds rounds."""
    if text.strip().lower() == "fixed":
        text = f"fixed:{recipe.depth.rounds}"
    return parse_exit_policy(text, min_rounds=recipe.exit.min_rounds)


def exit_eval(run, batches: list, policy: str | None = None, sweep: str | None = None,
              data_label: str = "the run's validation split", write: bool = True,
              missing: str = "copy_forward") -> tuple[dict[str, Any], list[str]]:
    """`looplm eval RUN --exit POLICY / --exit-sweep KIND [--missing-kv M]`: the JSON entries and text lines.

    The round budget is the recipe's depth.rounds (fixed:R runs R). missing: how later rounds see a
    token that exited (`cache.MISSING`), as `generate`/`serve --missing-kv` decode. With a sweep, the
    table and exit_sweep_KIND.png go into the run folder and a section into report.md (when write)."""
    recipe, model = run.recipe, run.model
    R = recipe.depth.rounds
    batches = list(batches)
    if not batches:
        raise UserError("evaluation data: no batches to evaluate")
    result: dict[str, Any] = {"pass_rows": max(len(b[0]) for b in batches)}
    early_exit(model, batches[0][0][:1], f"fixed:{R}", R)               # warm-up, not timed
    dist = exit_distribution_depth(model, batches, R)
    dist_text = "no gate" if dist is None else f"{dist:.2f}"
    lines: list[str] = []
    if policy is not None:
        pol = cli_policy(policy, recipe)
        budget = pol.value if pol.kind == "fixed" else R
        row = evaluate_exit(model, batches, pol, budget, missing=missing)
        full = evaluate_exit(model, batches, f"fixed:{budget}", budget)
        row["wall_time_s"], full["wall_time_s"] = time_policies(
            model, batches, [(pol, budget), (f"fixed:{budget}", budget)], TIMING_REPEATS, missing,
            first=[row["wall_time_s"], full["wall_time_s"]])
        row["missing"] = missing
        row["exit_distribution_mean_rounds"] = dist
        row["full_depth"] = {"rounds": budget, "loss": full["loss"], "wall_time_s": full["wall_time_s"]}
        result["exit"] = row
        lines.append(f"exit {row['policy']}: loss {row['loss']:.4f} (full depth {full['loss']:.4f}), "
                     f"mean rounds used {row['mean_rounds']:.2f} of {budget} (exit-distribution mean depth "
                     f"{dist_text}), wall {row['wall_time_s']:.3f} s (full depth {full['wall_time_s']:.3f} s)")
    if sweep is not None:
        kind, thresholds = parse_sweep(sweep)
        rows = exit_sweep(model, batches, kind, R, thresholds, recipe.exit.min_rounds, missing=missing)
        reference = fixed_reference(model, batches, R)
        timed = rows + reference               # every pass of the sweep and the fixed depths, interleaved
        policies = ([(parse_exit_policy(r["policy"], min_rounds=recipe.exit.min_rounds), R) for r in rows]
                    + [(r["policy"], r["max_rounds"]) for r in reference])              # as each was evaluated
        walls = time_policies(model, batches, policies, TIMING_REPEATS, missing,
                              first=[r["wall_time_s"] for r in timed])
        for r, w in zip(timed, walls):
            r["wall_time_s"] = w
        result.update({"sweep": rows, "sweep_kind": kind, "fixed_reference": reference,
                       "exit_distribution_mean_rounds": dist, "missing": missing})
        full = reference[-1]
        lines.append(f"exit sweep {kind} (exit-distribution mean depth {dist_text}; full depth {R}: "
                     f"loss {full['loss']:.4f}, {full['wall_time_s']:.3f} s):")
        lines += [f"  {r['policy']:>18s}: loss {r['loss']:.4f}, mean rounds {r['mean_rounds']:.2f}, "
                  f"wall {r['wall_time_s']:.3f} s ({r['wall_time_s'] / max(1e-12, full['wall_time_s']):.2f}x)"
                  for r in rows]
        if write:
            from ..runs.report import add_section
            png = run.path / f"exit_sweep_{kind}.png"
            plot_sweep(png, kind, rows, reference)
            md = f"Data: {data_label}.\n\n" + sweep_markdown(kind, rows, reference, dist)
            added = add_section(run.path, f"Early exit sweep: {kind}", md,
                                {"exit_sweeps": {kind: {"rows": rows, "fixed_reference": reference,
                                                        "exit_distribution_mean_rounds": dist, "data": data_label}}})
            result["sweep_plot"] = str(png)
            lines.append(f"plot {png}" + ("; section added to report.md" if added else " (run has no report.json)"))
    return result, lines
