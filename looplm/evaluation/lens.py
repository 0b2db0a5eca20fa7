"""The logit lens over a looped model's depth: `looplm lens RUN`.

At every block boundary of one forward pass — each prelude block, each core block at each round,
each coda block — the hidden state is read out through the model's own final norm and LM head
(`LoopedLM.head_logits`, the end of every readout), and compared per position with the model's
final distribution (the output of the full pass):

    jsd          normalised Jensen-Shannon divergence JSD(p_boundary, p_final) / ln 2, in [0, 1]
    converged    share of positions with jsd < 0.5 (the seeds' threshold)
    agreement    top-1 of the boundary equals the final output's top-1
    accuracy     top-1 of the boundary equals the true next token (a different question:
                 agreement with the final output is not agreement with the true answer)

The states are taken where the blocks hand them on (forward hooks on each block module), so the
lens sees exactly the pass the model runs; an untied baseline's boundaries are its layers, which
gives the seeds' comparison of R - 1 loop boundaries against a deep stack's intermediate layers.
On task runs only answer positions count. The heatmap (boundary x position bucket) marks the
round boundaries.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

CONVERGED = 0.5
"""Normalised JSD below which a position counts as converged to the final distribution."""
BUCKETS = 8
"""Position buckets of the heatmap."""


def normalised_jsd(logp: Tensor, logq: Tensor) -> Tensor:
    """JSD(p, q) / ln 2 over the last axis, from log-probabilities (..., V) -> (...), in [0, 1]."""
    m = torch.logsumexp(torch.stack([logp, logq]), 0) - math.log(2.0)          # log((p + q) / 2)
    kl_pm = (logp.exp() * (logp - m)).nan_to_num(0.0).sum(-1)                  # 0 log 0 = 0
    kl_qm = (logq.exp() * (logq - m)).nan_to_num(0.0).sum(-1)
    return ((0.5 * kl_pm + 0.5 * kl_qm) / math.log(2.0)).clamp(0.0, 1.0)


def _boundaries(model) -> tuple[list[Any], list[tuple[dict[str, Any], Tensor]], dict[str, int]]:
    """Register a forward hook on every block; each call appends (label info, output) in order."""
    calls: list[tuple[dict[str, Any], Tensor]] = []
    K = model.cfg.n_core
    counts = {"core": 0}
    handles = []

    def hook(kind: str, index: int):
        def record(_mod, _args, out):
            if kind == "core":
                c = counts["core"]
                counts["core"] += 1
                info = {"kind": "core", "round": c // K + 1, "block": c % K}
                if c % K == K - 1 and model.state_norm is not None:
                    out = model.state_norm(out)    # a round ends in the state the loop carries
            else:
                info = {"kind": kind, "round": None, "block": index}
            calls.append((info, out))
        return record

    for kind, stack in (("prelude", model.prelude), ("core", model.core), ("coda", model.coda)):
        for i, block in enumerate(stack):
            handles.append(block.register_forward_hook(hook(kind, i)))
    return handles, calls, counts


def _label(info: dict[str, Any], untied_core: int = 0) -> str:
    """untied_core: K of an untied baseline, whose core blocks are layers, not rounds."""
    if info["kind"] == "core" and untied_core:
        return f"core layer {(info['round'] - 1) * untied_core + info['block'] + 1}"
    if info["kind"] == "core":
        return f"round {info['round']} block {info['block'] + 1}"
    return f"{info['kind']} {info['block'] + 1}"


@torch.no_grad()
def logit_lens(model, batches: list, rounds: int) -> dict[str, Any]:
    """The lens table over `batches` ((x, y) or (x, y, mask)) at `rounds` rounds."""
    model.eval()
    handles, calls, counts = _boundaries(model)
    rows: list[dict[str, Any]] = []
    sums: list[dict[str, Tensor]] = []
    total = 0
    try:
        for x, y, *rest in batches:
            mask = rest[0] if rest and isinstance(rest[0], Tensor) else torch.ones_like(y, dtype=torch.bool)
            mask = mask.to(x.device)
            calls.clear()
            counts["core"] = 0
            final = model(x, rounds).logits.float().log_softmax(-1)              # (B, T, V)
            top_final = final.argmax(-1)
            T = x.shape[1]
            bucket = (torch.arange(T, device=x.device) * BUCKETS // T).expand_as(mask)
            if not rows:
                untied = model.cfg.n_core if model.cfg.untied else 0
                rows = [{**info, "label": _label(info, untied)} for info, _ in calls]
                sums = [{k: torch.zeros(BUCKETS, dtype=torch.float64) for k in
                         ("jsd", "converged", "agreement", "accuracy", "count")} for _ in calls]
            for (info, h), acc in zip(calls, sums):
                logp = model.head_logits(h).float().log_softmax(-1)
                top = logp.argmax(-1)
                stats = {"jsd": normalised_jsd(logp, final), "agreement": (top == top_final).double(),
                         "accuracy": (top == y).double()}
                stats["converged"] = (stats["jsd"] < CONVERGED).double()
                for k, v in stats.items():
                    acc[k] += torch.zeros(BUCKETS, dtype=torch.float64).index_add_(
                        0, bucket[mask].cpu(), v[mask].double().cpu())
                acc["count"] += torch.bincount(bucket[mask].cpu(), minlength=BUCKETS).double()
            total += int(mask.sum())
    finally:
        for h in handles:
            h.remove()
    for row, acc in zip(rows, sums):
        n = acc["count"].sum().clamp(min=1)
        for k in ("jsd", "converged", "agreement", "accuracy"):
            row[k] = (acc[k].sum() / n).item()
        row["jsd_by_position_bucket"] = (acc["jsd"] / acc["count"].clamp(min=1)).tolist()
        row["round_end"] = row["kind"] == "core" and row["block"] == model.cfg.n_core - 1
    return {"rounds": rounds, "positions": total, "converged_below": CONVERGED, "boundaries": rows,
            "jsd": [r["jsd"] for r in rows],
            "note": "agreement is with the model's own final output, not with the true next token; "
                    "accuracy is against the true next token"}


def plot_lens(path: Path, table: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table["boundaries"]
    grid = [r["jsd_by_position_bucket"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, max(3.0, 0.28 * len(rows) + 1.5)),
                                  gridspec_kw={"width_ratios": [3, 2]})
    im = ax.imshow(grid, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis")
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=7)
    ax.set_xlabel(f"position bucket (of {BUCKETS})")
    ax.set_title("normalised JSD to the final distribution")
    for i, r in enumerate(rows):
        if r["round_end"]:
            ax.axhline(i + 0.5, color="white", lw=0.8)
    fig.colorbar(im, ax=ax, fraction=0.04)
    y = range(len(rows))
    ax2.plot([r["jsd"] for r in rows], y, "o-", label="JSD")
    ax2.plot([r["agreement"] for r in rows], y, "s-", label="top-1 = final output")
    ax2.plot([r["accuracy"] for r in rows], y, "^-", label="top-1 = true token")
    ax2.invert_yaxis()
    ax2.set_yticks([])
    ax2.set_xlim(0, 1)
    ax2.legend(fontsize=7)
    ax2.set_title("agreement is not correctness", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def lens_markdown(table: dict[str, Any]) -> str:
    lines = [f"Logit lens at {table['rounds']} rounds over {table['positions']} positions: the final norm and "
             "LM head at every block boundary, against the model's final output. "
             "Agreement with the final output is not agreement with the true answer (accuracy column).", "",
             "| boundary | JSD / ln 2 | converged (< 0.5) | top-1 = final | top-1 = true token |",
             "|---|---|---|---|---|"]
    for r in table["boundaries"]:
        name = f"**{r['label']}**" if r["round_end"] else r["label"]
        lines.append(f"| {name} | {r['jsd']:.3f} | {r['converged']:.2f} | {r['agreement']:.2f} | {r['accuracy']:.2f} |")
    lines += ["", "![logit lens](lens.png)"]
    return "\n".join(lines)


def lens_batches(run, data: str | None) -> list:
    """Validation batches of a language-model run, or held-out answer batches (x, y, mask) of a task run."""
    recipe = run.recipe
    if recipe.data.task:
        from ..data.taskdata import TaskSource, encode_examples, eval_file_sets
        sets = eval_file_sets(data, recipe) if data else TaskSource(recipe).eval_sets(recipe.data.eval_examples)
        examples = [ex for exs in sets.values() for ex in exs]
        out = []
        for i in range(0, len(examples), recipe.train.batch_size):
            b = encode_examples(run.tokenizer, examples[i:i + recipe.train.batch_size], run.model.cfg.context,
                                recipe.data.separator)
            out.append((b.x, b.y, b.mask))
        return out
    from .rounds import eval_batches_for
    return eval_batches_for(run, data)


def lens_command(run, rounds: int | None, data: str | None) -> tuple[dict[str, Any], str]:
    """`looplm lens RUN`: the table (JSON), the text; lens.png and a report section in the run folder."""
    from ..runs.report import add_section
    R = rounds or run.recipe.depth.rounds
    dev = run.model.embed.weight.device
    batches = [tuple(t.to(dev) for t in b) for b in lens_batches(run, data)]
    table = logit_lens(run.model, batches, R)
    png = Path(run.path) / "lens.png"
    plot_lens(png, table)
    table["plot"] = str(png)
    add_section(run.path, "Logit lens", lens_markdown(table), {"logit_lens": {k: v for k, v in table.items()
                                                                            if k != "plot"}})
    text = [f"logit lens at {R} rounds over {table['positions']} positions (JSD / ln 2 to the final output; "
            "agreement is with the final output, accuracy with the true token):"]
    text += [f"  {r['label']:>18s}{' |' if r['round_end'] else '  '} jsd {r['jsd']:.3f}  converged "
             f"{r['converged']:.2f}  agreement {r['agreement']:.2f}  accuracy {r['accuracy']:.2f}"
             for r in table["boundaries"]]
    text.append(f"plot {png}")
    return table, "\n".join(text)



# ---------------------------------------------------------------------------------------
# Side by side: a looped run's loop boundaries against a baseline's intermediate layers.

def exit_candidates(table: dict[str, Any], untied: bool) -> list[dict[str, Any]]:
    """The boundaries an early exit could read out at, before the last: a looped model's R - 1
    round ends (the seeds' "early loop boundaries"); an untied stack's every intermediate layer.
    Each with `depth`, the share of the pass's blocks applied up to it."""
    rows = table["boundaries"]
    out = []
    for i, r in enumerate(rows[:-1]):
        loop_boundary = r["round_end"] and r["round"] < table["rounds"]
        if untied or loop_boundary:
            out.append({**{k: r[k] for k in ("label", "jsd", "converged", "agreement", "accuracy")},
                        "depth": (i + 1) / len(rows)})
    return out


def _same_tokens(a, b) -> bool:
    """Two tokenizers map every id to the same bytes (so one batch means the same text to both)."""
    ta, tb = a.tokenizer, b.tokenizer
    if ta.vocab_size != tb.vocab_size:
        return False
    return all(ta.token_bytes(i) == tb.token_bytes(i) for i in range(ta.vocab_size))


def plot_compare(path: Path, tables: list[tuple[str, dict[str, Any], list[dict[str, Any]]]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, table, cands in tables:
        rows = table["boundaries"]
        depth = [(i + 1) / len(rows) for i in range(len(rows))]
        for ax, key in zip(axes, ("jsd", "agreement")):
            line, = ax.plot(depth, [r[key] for r in rows], "-", lw=1, label=name)
            ax.plot([c["depth"] for c in cands], [c[key] for c in cands], "o", color=line.get_color(),
                    label=f"{name}: exit candidates ({len(cands)})")
    axes[0].axhline(CONVERGED, color="gray", lw=0.6, ls="--")
    for ax, title in zip(axes, ("normalised JSD to the final output", "top-1 = final output (not correctness)")):
        ax.set_xlabel("share of the pass's blocks applied")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare_command(run, base, rounds: int | None, data: str | None) -> tuple[dict[str, Any], str]:
    """`looplm lens RUN --baseline BASE`: both models on RUN's batches; each one's exit candidates
    (loop boundaries vs intermediate layers) side by side, lens_compare.png and a report section in RUN."""
    from ..errors import UserError
    from ..runs.report import add_section
    if not _same_tokens(run, base):
        raise UserError(f"--baseline {base.path}: its tokenizer differs from {run.path}'s; the lens compares "
                        "the two on the same tokens (train the baseline from the same recipe and data)")
    if bool(run.recipe.data.task) != bool(base.recipe.data.task):
        raise UserError("--baseline: one run is a task run and the other is not; compare runs of the same data")
    R = rounds or run.recipe.depth.rounds
    dev = run.model.embed.weight.device
    batches = [tuple(t.to(dev) for t in b) for b in lens_batches(run, data)]
    context = base.model.cfg.context
    if batches and batches[0][0].shape[1] > context:
        raise UserError(f"--baseline {base.path}: context {context} is shorter than {run.path}'s sequences")
    base.model.to(dev)
    entries = []
    for r, R_r in ((run, R), (base, base.recipe.depth.rounds)):
        table = logit_lens(r.model, batches, R_r)
        cands = exit_candidates(table, r.recipe.model.untied)
        entries.append({"run": str(r.path), "untied": r.recipe.model.untied, "rounds": R_r,
                        "boundaries": len(table["boundaries"]), "exit_candidates": cands,
                        "final_accuracy": table["boundaries"][-1]["accuracy"], "table": table})
    png = Path(run.path) / "lens_compare.png"
    plot_compare(png, [(Path(e["run"]).name + (" (untied)" if e["untied"] else " (looped)"), e["table"],
                        e["exit_candidates"]) for e in entries])
    lines = ["The exits each model offers before its last boundary, read out through its own final norm and LM "
             "head, on the same tokens: a looped model's R - 1 round ends, an untied stack's every intermediate "
             "layer. Agreement is with each model's own final output, not the true answer.", "",
             "| run | exit candidate | depth | JSD / ln 2 | converged (< 0.5) | top-1 = final | top-1 = true token |",
             "|---|---|---:|---:|---:|---:|---:|"]
    text = []
    for e in entries:
        kind = "untied baseline" if e["untied"] else "looped"
        text.append(f"{e['run']} ({kind}, {e['rounds']} rounds, {e['boundaries']} boundaries, "
                    f"{len(e['exit_candidates'])} exit candidates; final accuracy {e['final_accuracy']:.2f}):")
        for c in e["exit_candidates"]:
            lines.append(f"| {Path(e['run']).name} | {c['label']} | {c['depth']:.2f} | {c['jsd']:.3f} | "
                         f"{c['converged']:.2f} | {c['agreement']:.2f} | {c['accuracy']:.2f} |")
            text.append(f"  {c['label']:>18s} depth {c['depth']:.2f}  jsd {c['jsd']:.3f}  converged "
                        f"{c['converged']:.2f}  agreement {c['agreement']:.2f}  accuracy {c['accuracy']:.2f}")
    lines += ["", "![lens comparison](lens_compare.png)"]
    result = {"runs": [{k: v for k, v in e.items() if k != "table"} for e in entries],
              "positions": entries[0]["table"]["positions"], "converged_below": CONVERGED, "plot": str(png)}
    add_section(run.path, "Logit lens: loop boundaries vs a baseline's layers", "\n".join(lines),
                {"logit_lens_compare": {k: v for k, v in result.items() if k != "plot"}})
    text.append(f"plot {png}")
    return result, "\n".join(text)
