"""The run's record: report.json (machine-readable), report.md (the recipe card) and plots.

The recipe card puts each decision in plain words beside what actually happened, so a
reader can rebuild "four rounds" without the code: initial state, forward-depth
distribution, backward window, supervised rounds, cache rule — and the sampled-depth and
gradient-visible histograms, tokens, losses and validation loss by rounds (flagging
depths never sampled in training).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from .checkpoint import read_metrics, read_report, write_text
from ..recipe.config import recipe_from_dict


def describe(recipe_dict: dict[str, Any]) -> list[tuple[str, str]]:
    """(decision, plain words) for the recipe card."""
    r = recipe_from_dict(recipe_dict)
    m, d, b, s = r.model, r.depth, r.backward, r.supervision
    init = {"zeros": "zeros", "prelude": "the prelude output e",
            "random": f"Gaussian noise with std {m.init_state_std} (Huginn), drawn per step"}[m.init_state]
    inject = {"none": "not re-injected (the core sees the input only through the initial state)",
              "add": "added to the state before every round (s + e)",
              "concat": "concatenated with the state and mapped back by a Linear(2d -> d) adapter every round"
                        + (" (started as [I | I]: s + e)" if m.adapter_init == "sum" else
                           " (started as [I | 0]: the state alone, so round 1 is the stack without a loop; "
                           "training learns how much of e re-enters)"),
              "decay": (f"added to the state carried with a learned per-channel factor a in (0, 1) every round "
                        f"(a * s + e; a started at {m.injection_decay_init}), so e no longer piles up round after round")
              }[m.injection]
    if d.kind == "fixed":
        depth = f"fixed at {d.rounds} rounds every step"
    elif d.kind == "uniform":
        depth = f"uniform on {{{d.min}..{d.max}}} rounds, drawn per micro-batch from (seed, step)"
    elif d.kind == "geometric":
        depth = (f"stochastic stopping: from round {d.min} on the loop stops after each round with probability "
                 f"{d.stop_prob}, at the latest after {d.max}; drawn per micro-batch from (seed, step)")
    else:
        depth = (f"log-normal Poisson (Huginn): rate ~ LogNormal(ln {d.mean} - {d.sigma}^2/2, {d.sigma}), "
                 f"rounds = Poisson(rate) + 1, clamped to {d.min}..{d.max}; drawn per micro-batch from (seed, step)")
    if d.kind != "fixed" and d.ramp_fraction:
        depth += (f"; depth curriculum: over the first {d.ramp_fraction:g} of the {r.train.steps} steps the cap "
                  + ("and mean " if d.kind == "lognormal_poisson" else "")
                  + f"grow from {d.min} to their settings ({d.ramp_shape} in the ramp's phase)")
    window = ("full backpropagation through every round" if b.window == "all" else
              f"gradients through only the last {b.window} rounds: earlier rounds run without gradient (their "
              "state is a constant entering the window); a supervised readout or gate hazard at a round before "
              "the window trains only the coda, head and gate, never the core or prelude")
    if r.train.stage == 2:
        sup = "none for the language model (frozen)"
    elif r.data.depth_by_difficulty:
        sup = ("per micro-batch of one difficulty d (data.depth_by_difficulty): "
               + {"trace": "every round from round 1 (trace targets before round d, the answer from d on)",
                  "query_trace": "every round from round 1 (the queried name at round 1, trace targets before "
                                 "round d + 1, the answer from d + 1 on)"}.get(r.data.round_targets,
                                                                               "every round from d on")
               + ", equal weights")
    elif s.kind == "final":
        sup = "next-token loss on the final round only"
    elif s.kind == "rounds":
        sup = (f"losses at rounds {list(s.rounds)} with weights {list(s.round_weights)}, "
               "combined as sum(w*L)/sum(w) over the rounds that ran")
    elif s.kind == "every":
        sup = "equal-weight loss on every round that ran"
    else:
        prior = "an entropy bonus" if s.prior == "none" else f"KL to a {s.prior} prior"
        sup = (f"learned exit distribution (Ouro stage I): sum_t p_t L_t with {prior}, beta = {s.entropy_beta}"
               if s.kind == "learned_exit" else
               f"ACT's mixture: one loss -log sum_t p_t softmax_t(y) on the exit-mass mixture of the rounds' output "
               f"distributions, with {prior}, beta = {s.entropy_beta}")
    if s.fixed_point and r.train.stage == 1:
        sup += (f"; plus {s.fixed_point} x the terminal fixed-point term: the relative state change "
                f"||s_r - s_(r-1)||^2 / ||s_(r-1)||^2 over the last {s.fixed_point_rounds} round(s) of each step "
                "(from round 2), averaged over positions")
    if r.train.stage == 2:
        sup += (f"; STAGE II: LM frozen, only the gate trains on BCE to sigmoid(k(I_t - gamma)), "
                f"k = {r.train.stage2_k}, gamma = {r.train.stage2_gamma}, averaged over tokens and rounds 2..T")
    core = (f"{m.n_core} untied blocks per round x {d.rounds} (baseline, no sharing)" if m.untied
            else f"{m.n_core} shared blocks")
    return [
        ("anatomy", f"{m.n_prelude} prelude -> {core} x R rounds -> {m.n_coda} coda; d_model {m.d_model}, "
                    f"{m.n_heads} query heads / {m.n_kv_heads} KV heads of width {m.head_dim}, SwiGLU {m.ffn_hidden}, "
                    f"{m.norm}-norm, residual scaling {m.residual_scaling}"
                    + (f" (p = {m.deeploop_p})" if m.residual_scaling == "deeploop" else "")),
        ("initial state", init),
        ("state between rounds", "RMS-normalised after every round (model.state_norm)" if m.state_norm
         else "carried as the core leaves it (no normalisation between rounds)"),
        ("input injection", inject),
        ("forward depth", depth),
        ("backward window", window),
        ("loss placement", sup),
        ("optimizer", f"AdamW (lr {r.optim.lr:g})" if r.optim.optimizer == "adamw" else
         f"Muon (lr {r.optim.muon_lr:g}, momentum {r.optim.muon_momentum}, Nesterov, {r.optim.muon_adjust_lr} "
         f"per-matrix scale) on the blocks' and adapter's matrices; AdamW (lr {r.optim.lr:g}) on the rest"),
        ("exit", (("an exit gate (dense + sigmoid of the state each round), trained by "
                   + ("stage II's continuation loss" if r.train.stage == 2 else "the learned-exit loss")
                   + f" (whether it received gradient: under What happened); default policy {r.exit.policy}")
                  if r.exit.gate else f"no exit gate; default policy {r.exit.policy}")),
        ("cache rule", "every core round attends to the earlier tokens' round-1 keys/values and its own round's "
                       "(model.kv_sharing = first), in training and at generation (cache policy first for prompt and "
                       "generated tokens: one core slot, not one per round)" if m.kv_sharing == "first" else
                       "training runs whole sequences without a cache; at generation every round keeps its own "
                       "key/value history unless a cache policy says otherwise"),
    ] + ([("recursions", "Mixture-of-Recursions, expert choice: at round r a router on the state entering it keeps, "
                         f"of each sequence's tokens still running, the top share {list(round(c, 4) for c in m.mor_capacity)} "
                         f"(nested sets) in training, and {m.mor_alpha} x sigmoid(score) scales their updates; at "
                         "inference (and in evaluation) a token continues while "
                         + ("the router's" if m.mor_causal == "aux_loss" else "an auxiliary router's (on the detached "
                            "state)") + f" sigmoid > 0.5, trained towards the top-k choice by BCE x {s.mor_aux}; cache "
                         f"rule {m.mor_cache}; router z-loss x {s.mor_z}; {r.train.mor_warmup_steps} warm-up steps at "
                         "capacity 1")] if m.mor == "expert_choice" else []) + ([("recursions", f"Mixture-of-Recursions, token choice: a router on each token's prelude output picks its "
                         f"depth among 1..{d.rounds} (top-1) and that choice's probability w scales each of its "
                         f"updates, s <- s + w (core(s) - s); cache rule {m.mor_cache} ("
                         + ("a round attends only to tokens that entered it" if m.mor_cache == "recursion_wise" else
                            "a round attends to every earlier token's round-1 keys/values") + "); depth-balance loss x "
                         f"{s.mor_balance}, router z-loss x {s.mor_z}, loss-free bias rate {s.mor_bias_rate}, "
                         f"{r.train.mor_warmup_steps} warm-up steps at full depth")] if m.mor == "token_choice" else []) + ([("mixture of experts", f"each core block's FFN is {m.moe_experts} SwiGLU experts of width {m.moe_hidden}, "
                                 f"top-{m.moe_top_k} token choice (softmax renormalised over the chosen), "
                                 + ("each untied layer its own experts" if m.untied else
                                    "the experts shared across rounds and routed afresh at every visit")
                                 + f"; load-balance loss x {s.moe_balance} and router z-loss x {s.moe_z}, averaged "
                                 "over every visit; prelude and coda dense")] if m.moe_experts else [])


def _hist_line(h: dict[str, int]) -> str:
    total = sum(h.values()) or 1
    return ", ".join(f"{k}: {v} ({100 * v / total:.0f}%)" for k, v in sorted(h.items(), key=lambda kv: int(kv[0])))


def _memory_note(report: dict[str, Any]) -> str:
    """How the peak RSS is scoped (this run's own and what it added, or the whole process's), and the
    accelerator's peak where there is one."""
    note, growth = "", report.get("rss_growth_bytes")
    if report.get("peak_rss_scope") == "run":
        note = " (this run's own" + (f"; {growth / 2**20:.0f} MiB above the RSS it started from"
                                     if growth is not None else "") + ")"
    elif report.get("peak_rss_scope") == "process":
        note = " (the process's peak: the mark could not be reset for this run, so earlier work may be in it)"
    if report.get("peak_device_memory_bytes"):
        note += f", peak device memory {report['peak_device_memory_bytes'] / 2**20:.0f} MiB (this run's own)"
    return note


def _placement_lines(report: dict[str, Any]) -> list[str]:
    """The loss weights and the exit gate as the trainer's record has them (absent from older reports)."""
    place, out = report["loss_placement"], []
    if "weights" in place and place.get("rounds"):
        what = ("the gate's continuation loss, per decision after round" if place["kind"] == "stage2_gate"
                else "loss weight per round")
        out.append(f"- {what} ({place['kind']}; mean per micro-batch, as the loss weighed it): "
                   + ", ".join(f"{r}: {w:.3f}" for r, w in zip(place["rounds"], place["weights"])))
    # depth_safety holds what was measured; the settings beside it come from the recipe, named as such
    safety, rec = report.get("depth_safety", {}), report["recipe"]
    fp = safety.get("fixed_point")
    if fp:
        weight = rec.get("supervision", {}).get("fixed_point", fp.get("weight"))     # older reports recorded it here
        out.append(f"- fixed-point term (recipe weight {weight}): carried by {fp['micro_batches']} micro-batches "
                   + (f"(mean unweighted value {fp['mean_term']:.4g})" if fp["micro_batches"] else
                      "-- NEVER APPLIED: every step ran one round"))
    carry = safety.get("carry")
    if carry:
        start = rec.get("model", {}).get("injection_decay_init", carry.get("start"))
        out.append(f"- decay injection's carry after training (the recipe started it at {start}): min "
                   f"{carry['min']:.3f}, mean {carry['mean']:.3f}, max {carry['max']:.3f}")
    rms, change = safety.get("state_rms_by_rounds"), safety.get("state_change_by_rounds")
    if rms:
        out.append("- loop state on the held-out batches with the final weights, by rounds: RMS "
                   + ", ".join(f"{r}: {v:.4g}" for r, v in rms.items())
                   + ("; relative change ||s_r - s_(r-1)|| / ||s_(r-1)|| "
                      + ", ".join(f"{r}: {v:.2g}" for r, v in change.items()) if change else ""))
    gate = report.get("exit_gate")
    if gate:
        n, total = gate["steps_with_gradient"], gate["steps"]
        out.append(f"- exit gate: received a nonzero gradient in {n} of {total} optimizer steps"
                   + (" -- NEVER TRAINED: its hazards are its initialisation" if n == 0 else ""))
    return out


def render_markdown(report: dict[str, Any], plots: list[str]) -> str:
    rec = report["recipe"]
    lines = [f"# Recipe card: {rec.get('name', 'run')}", "", "## Decisions", ""]
    lines += [f"- **{k}**: {v}" for k, v in describe(rec)]
    lines += ["", "## What happened", "",
              f"- optimizer steps: {report['steps']}",
              *([f"- initialised from run `{report['init_from']}`"
                 + ("; language-model weights frozen (bit-identical), only the exit gate trained"
                    if rec.get("train", {}).get("stage") == 2 else "")
                 + (f"; new modules started from their initialisation: {', '.join(report['init_fresh_modules'])}"
                    if report.get("init_fresh_modules") else "")
                 + ("; the concat adapter came with the weights (model.adapter_init applied to none)"
                    if rec.get("model", {}).get("injection") == "concat"
                    and "adapter." not in report.get("init_fresh_modules", []) else "")]
                if report.get("init_from") else []),
              *([f"- embedding, prelude, coda and head held still (gradients dropped) in the first "
                 f"{report['outer_frozen_steps']} optimizer steps"] if report.get("outer_frozen_steps") else []),
              *([f"- parameters each optimizer held: "
                 + ", ".join(f"{k} {v:,}" for k, v in report["optimizer"].items())] if report.get("optimizer") else []),
              f"- sampled forward rounds (per micro-batch): {_hist_line(report['depth_histogram'])}; "
              f"mean {report['mean_train_rounds']:.2f}",
              f"- gradient-visible rounds: {_hist_line(report['backward_histogram'])}"
              + (f"; supervised readouts before the window (trained the readout only): "
                 f"{_hist_line(report['loss_placement']['readout_only_round_counts'])}"
                 if report['loss_placement'].get('readout_only_round_counts') else ""),
              f"- supervised rounds (count of micro-batches): "
              f"{_hist_line(report['loss_placement']['supervised_round_counts'])}"
              + (f"; {report['loss_placement']['fallback_to_final_steps']} fell back to the final round"
                 if report['loss_placement']['fallback_to_final_steps'] else ""),
              *_placement_lines(report),
              f"- unique training tokens: {report['unique_tokens']:,} of {report['train_data_tokens']:,} available; "
              f"tokens consumed: {report['tokens_seen']:,}; token-passes (tokens x rounds): {report['token_passes']:,}",
              f"- parameters stored: {report['params_stored']:,}; applied per token at the mean depth: "
              f"{report['params_per_token_visit']:,.0f}",
              f"- training FLOPs (every visit counted, backward only through gradient-visible rounds): "
              f"{report['train_flops']:.3e}",
              f"- final training loss (mean of last 10% of steps): {report['train_loss_final']:.4f}",
              f"- wall time {report['wall_time_s']:.1f} s, {report['tokens_per_s']:.0f} tokens/s, "
              f"peak RSS {report['peak_rss_bytes'] / 2**20:.0f} MiB{_memory_note(report)}",
              "", "## Validation loss by rounds", "", "| rounds | loss | trained at this depth? |", "|---:|---:|---|"]
    never = set(report.get("val_rounds_never_trained", []))
    for r, loss in report["val_loss_by_rounds"].items():
        lines.append(f"| {r} | {loss:.4f} | {'NEVER SAMPLED in training' if int(r) in never else 'yes'} |")
    extrap = report.get("val_loss_extrapolation")
    if extrap:
        hist = report.get("depth_histogram", {})
        supervised = report.get("loss_placement", {}).get("supervised_round_counts", {})
        deepest = max((int(k) for k in hist), default=0)
        lines += ["", "## Depth extrapolation", "",
                  f"Validation loss at every depth from 1 to {max(int(r) for r in extrap)} rounds (twice the largest "
                  f"training depth, {deepest}) beside how often training ran each depth as its forward depth and "
                  "supervised its readout. Rounds beyond the deepest training depth never ran in training at all. "
                  "See depth_extrapolation.png.", "",
                  "| rounds | loss | micro-batches with this forward depth | micro-batches supervising this round | |",
                  "|---:|---:|---:|---:|---|"]
        for r, loss in extrap.items():
            beyond = "never run in training" if int(r) > deepest else ""
            lines.append(f"| {r} | {loss:.4f} | {hist.get(str(r), 0)} | {supervised.get(str(r), 0)} | {beyond} |")
    for extra in report.get("sections", []):       # written by whoever measured them (routing, lens, exits)
        lines += ["", f"## {extra['title']}", "", extra["markdown"]]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write_plots(run_dir: Path, report: dict[str, Any]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    rows = read_metrics(run_dir)
    if rows:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
        ax.set_xlabel("step"); ax.set_ylabel("training loss"); ax.set_title("Loss curve")
        fig.tight_layout(); fig.savefig(run_dir / "loss.png", dpi=100); plt.close(fig)
        names.append("loss.png")
    val = report["val_loss_by_rounds"]
    never = set(report.get("val_rounds_never_trained", []))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = [int(k) for k in val]
    ax.plot(xs, list(val.values()), marker="o")
    for x, yv in zip(xs, val.values()):
        if x in never:
            ax.plot([x], [yv], marker="x", color="red", markersize=10)
    ax.set_xscale("log", base=2); ax.set_xlabel("rounds (red x: never sampled in training)")
    ax.set_ylabel("validation loss"); ax.set_title("Validation loss vs rounds")
    fig.tight_layout(); fig.savefig(run_dir / "val_by_rounds.png", dpi=100); plt.close(fig)
    names.append("val_by_rounds.png")
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, title in zip(axes, ("depth_histogram", "backward_histogram"),
                              ("sampled forward rounds", "gradient-visible rounds")):
        h = report[key]
        ax.bar([int(k) for k in h], list(h.values()))
        ax.set_xlabel("rounds"); ax.set_ylabel("micro-batches"); ax.set_title(title)
    fig.tight_layout(); fig.savefig(run_dir / "depth_histograms.png", dpi=100); plt.close(fig)
    names.append("depth_histograms.png")
    if report.get("val_loss_extrapolation"):
        plot_depth_extrapolation(run_dir / "depth_extrapolation.png", report)
        names.append("depth_extrapolation.png")
    if any(r.get("state_rms") for r in rows):
        plot_round_telemetry(run_dir / "round_telemetry.png", rows)
        names.append("round_telemetry.png")
    return names


def plot_round_telemetry(path: Path, rows: list[dict[str, Any]]) -> None:
    """Per-round state, update and gradient RMS at the first, middle and last logged steps (x: round),
    and every shared core tensor's update-to-weight ratio over training (metrics.jsonl)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logged = [r for r in rows if r.get("state_rms")]
    picks = sorted({0, len(logged) // 2, len(logged) - 1})
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.2))
    for ax, key, title in zip(axes, ("state_rms", "update_rms", "grad_rms"),
                              ("state RMS", "update (branch) RMS", "gradient RMS at the state")):
        positive = False
        for i in picks:
            vals = [float("nan") if v is None else v for v in logged[i][key]]
            positive = positive or any(v > 0 for v in vals if v == v)
            ax.plot(range(1, len(vals) + 1), vals, marker="o", label=f"step {logged[i]['step']}")
        ax.set_xlabel("round"); ax.set_title(title)
        if positive:                       # a log axis needs a positive value (Stage II has no gradient RMS)
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    ax = axes[3]
    with_ratio = [r for r in rows if r.get("update_ratio")]
    for name in (with_ratio[0]["update_ratio"] if with_ratio else {}):
        ax.plot([r["step"] for r in with_ratio], [r["update_ratio"][name] for r in with_ratio], lw=0.8)
    if any(v > 0 for r in with_ratio for v in r["update_ratio"].values()):
        ax.set_yscale("log")
    ax.set_xlabel("step"); ax.set_title("update / weight, each shared core tensor")
    fig.suptitle("Per-round telemetry (grad RMS is absent before the backward window)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_depth_extrapolation(path: Path, report: dict[str, Any]) -> None:
    """Validation loss at rounds 1..2x the training maximum above the training depth histogram
    (and the supervised readout rounds), on one rounds axis; rounds beyond the deepest training
    depth, which never ran in training, are shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extrap = {int(k): v for k, v in report["val_loss_extrapolation"].items()}
    hist = {int(k): v for k, v in report["depth_histogram"].items()}
    supervised = {int(k): v for k, v in report.get("loss_placement", {}).get("supervised_round_counts", {}).items()}
    deepest = max(hist, default=0)
    xs = sorted(extrap)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 4.6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    if max(xs) > deepest:
        for ax in (top, bottom):
            ax.axvspan(deepest + 0.5, max(xs) + 0.5, color="red", alpha=0.08, lw=0)
    top.plot(xs, [extrap[x] for x in xs], marker="o")
    top.set_ylabel("validation loss")
    top.set_title("Depth extrapolation (shaded: deeper than any training step)")
    bottom.bar([x - 0.2 for x in hist], list(hist.values()), width=0.4, color="gray", label="forward depth")
    if supervised:
        bottom.bar([x + 0.2 for x in supervised], list(supervised.values()), width=0.4, color="tab:orange",
                   label="readout supervised")
        bottom.legend(fontsize=7)
    bottom.set_xlabel("rounds")
    bottom.set_ylabel("training\nmicro-batches")
    bottom.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(run_dir: Path, report: dict[str, Any],
                 extra_plots: dict[str, Callable[[Path], None]] | None = None) -> None:
    """report.json, the plots and report.md. extra_plots: file name -> what draws it, for plots of
    measurements this package does not make itself (the trainer passes the routing plots), as
    report["sections"] carries their markdown."""
    run_dir = Path(run_dir)
    plots = write_plots(run_dir, report)
    for name, draw in (extra_plots or {}).items():
        draw(run_dir / name)
        plots.append(name)
    write_text(run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    write_text(run_dir / "report.md", render_markdown(report, plots))


PLOT_FILES = ("loss.png", "val_by_rounds.png", "depth_histograms.png", "depth_extrapolation.png", "round_telemetry.png",
              "routing.png", "recursions.png")


def add_section(run_dir: Path, title: str, markdown: str, data: dict[str, Any] | None = None) -> bool:
    """Add (or replace, by title) a section of report.md and merge `data` into report.json, then
    re-render report.md from report.json. Returns False when the run has no report yet."""
    run_dir = Path(run_dir)
    report = read_report(run_dir)
    if not report:
        return False
    sections = [s for s in report.get("sections", []) if s.get("title") != title]
    report["sections"] = sections + [{"title": title, "markdown": markdown}]
    for key, value in (data or {}).items():
        if isinstance(value, dict) and isinstance(report.get(key), dict):
            report[key] = {**report[key], **value}
        else:
            report[key] = value
    write_text(run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    plots = [p for p in PLOT_FILES if (run_dir / p).is_file()]
    write_text(run_dir / "report.md", render_markdown(report, plots))
    return True
