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


def _label(info: dict[str, Any]) -> str:
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
                rows = [{**info, "label": _label(info)} for info, _ in calls]
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

