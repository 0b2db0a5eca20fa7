"""Routing statistics of a LoopMoE run: how tokens use the shared experts across visits.

`routing_report(model, batches, rounds)` runs the model on the batches and, per core layer,
pools every visit's expert choices (`LoopOutput.routing`) into `moe.routing_stats`: for each
pair of consecutive visits the share of tokens whose expert sets are identical, disjoint or
partially overlapping; the distinct experts a token used over all visits; each visit's load.
The seeds report, for Sparse Layers' LoopMoE, 4-14% identical and 25-53% disjoint across most
layers. With it, the parameter accounting: experts stored vs applied per visit. An untied MoE
visits each layer once, so it has no consecutive visits ("not applicable").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


@torch.no_grad()
def routing_report(model, batches: list, rounds: int) -> dict[str, Any] | None:
    """The routing section of report.json and `looplm eval` (None for a dense core)."""
    cfg = model.cfg
    if not cfg.moe_experts:
        return None
    from ..model.moe import routing_stats
    model.eval()
    pooled: dict[int, list[list[torch.Tensor]]] = {}
    dev = model.embed.weight.device
    for x, *_ in batches:
        out = model(x.to(dev), rounds)
        for i, visits in out.routing.items():
            pooled.setdefault(i, []).append(visits)
    layers = {}
    for i, per_batch in pooled.items():
        visits = [torch.cat([b[v] for b in per_batch]).cpu() for v in range(len(per_batch[0]))]
        layers[str(i)] = routing_stats(visits, cfg.moe_experts)
    expert = 3 * cfg.d_model * cfg.moe_hidden
    return {"experts": cfg.moe_experts, "top_k": cfg.moe_top_k, "rounds": rounds, "untied": cfg.untied,
            "tokens": int(sum(x.numel() for x, *_ in batches)), "layers": layers,
            "expert_params_stored": len(model.core) * cfg.moe_experts * expert,
            "expert_params_active_per_visit": cfg.n_core * cfg.moe_top_k * expert,
            "consecutive_visits": "not applicable: an untied layer is visited once" if cfg.untied or rounds < 2
            else "measured"}


def routing_markdown(rep: dict[str, Any]) -> str:
    lines = [f"Core FFNs: {rep['experts']} experts, top-{rep['top_k']} token choice, routed afresh at every visit; "
             f"measured on {rep['tokens']:,} validation tokens at {rep['rounds']} rounds. Expert parameters stored: "
             f"{rep['expert_params_stored']:,}; applied per token per round: {rep['expert_params_active_per_visit']:,}.",
             ""]
    if rep["consecutive_visits"] != "measured":
        lines.append(f"Consecutive visits: {rep['consecutive_visits']}.")
    else:
        lines += ["Expert sets of the same token at consecutive visits (shares of tokens; each row sums to 1):", "",
                  "| layer | visits | identical | partial | disjoint |", "|---:|---|---:|---:|---:|"]
        for i, layer in rep["layers"].items():
            for r, pair in enumerate(layer["consecutive_visits"], start=1):
                lines.append(f"| {int(i) + 1} | {r} -> {r + 1} | {pair['identical']:.3f} | {pair['partial']:.3f} | "
                             f"{pair['disjoint']:.3f} |")
    lines += ["", "| layer | distinct experts per token over all visits (mean) | histogram |", "|---:|---:|---|"]
    for i, layer in rep["layers"].items():
        hist = ", ".join(f"{k}: {v}" for k, v in layer["distinct_experts_histogram"].items())
        lines.append(f"| {int(i) + 1} | {layer['distinct_experts_mean']:.2f} | {hist} |")
    lines += ["", "![routing](routing.png)"]
    return "\n".join(lines)


def plot_routing(path: Path, rep: dict[str, Any]) -> None:
    """Left: identical / partial / disjoint shares per layer and visit pair; right: expert load per visit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = rep["layers"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    labels, shares = [], []
    for i, layer in layers.items():
        for r, pair in enumerate(layer["consecutive_visits"], start=1):
            labels.append(f"L{int(i) + 1} {r}->{r + 1}")
            shares.append(pair)
    if shares:
        bottom = [0.0] * len(shares)
        for key, color in (("identical", "tab:green"), ("partial", "tab:orange"), ("disjoint", "tab:red")):
            vals = [s[key] for s in shares]
            ax.bar(range(len(shares)), vals, bottom=bottom, color=color, label=key)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(shares)), labels, rotation=60, fontsize=7)
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no consecutive visits (untied)", ha="center", va="center")
    ax.set_title("expert sets at consecutive visits", fontsize=9)
    grid = [load for layer in layers.values() for load in layer["load"]]
    im = ax2.imshow(grid, aspect="auto", cmap="viridis", vmin=0)
    ax2.set_xlabel("expert")
    ax2.set_ylabel("layer x visit")
    ax2.set_title("share of choices per expert", fontsize=9)
    fig.colorbar(im, ax=ax2, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@torch.no_grad()
def recursions_report(model, batches: list) -> dict[str, Any] | None:
    """Mixture-of-Recursions on the validation batches (None without a router): how many tokens the
    router sends to each depth, the share entering each round (tokens per recursion) and the
    realised capacity (mean depth / R: the share of the R rounds' token-rounds the router spends)."""
    if getattr(model, "mor_router", None) is None:
        return None
    from ..model.recursions import depth_counts
    model.eval()
    R = model.nominal_rounds
    counts = torch.zeros(R, dtype=torch.long)
    dev = model.embed.weight.device
    for x, *_ in batches:
        counts += depth_counts(model(x.to(dev)).routed_depth, R).cpu()
    n = int(counts.sum())
    entering = [int(counts[r - 1:].sum()) / max(n, 1) for r in range(1, R + 1)]
    mean = sum((i + 1) * int(c) for i, c in enumerate(counts)) / max(n, 1)
    rep = {"kind": model.cfg.mor, "cache_rule": model.cfg.mor_cache, "rounds": R, "tokens": n,
           "depth_histogram": {str(i + 1): int(c) for i, c in enumerate(counts)},
           "tokens_per_round": entering, "mean_depth": mean, "realised_capacity": mean / R}
    if model.cfg.mor == "token_choice":
        rep["bias"] = model.mor_bias.tolist()
    else:      # what training kept per round (top-k) beside what the causal decision keeps here
        rep["capacity_schedule"] = list(model.cfg.mor_capacity)
        rep["causal_decision"] = model.cfg.mor_causal
    return rep


def recursions_markdown(rep: dict[str, Any]) -> str:
    rule = {"recursion_wise": "a round attends only to tokens that entered it",
            "shared_first": "a round attends to every earlier token's round-1 keys/values"}[rep["cache_rule"]]
    expert = rep["kind"] == "expert_choice"
    how = ("Expert-choice routing (at inference the causal decision, "
           f"{'the router' if rep.get('causal_decision') == 'aux_loss' else 'an auxiliary router'}: sigmoid > 0.5)"
           if expert else "Token-choice routing")
    lines = [f"{how} over {rep['rounds']} rounds, cache rule `{rep['cache_rule']}` ({rule}); "
             f"measured on {rep['tokens']:,} validation tokens in eval mode. Mean routed depth {rep['mean_depth']:.2f} "
             f"(realised capacity {rep['realised_capacity']:.2f} of the token-rounds of full depth). Training "
             "ran every round on every token under masks (its FLOPs count them all); a decoder skips them.", "",
             "| round | tokens routed to exactly this depth | share of tokens entering this round |"
             + (" trained capacity (top-k) |" if expert else ""),
             "|---:|---:|---:|" + ("---:|" if expert else "")]
    for r in range(1, rep["rounds"] + 1):
        lines.append(f"| {r} | {rep['depth_histogram'][str(r)]:,} | {rep['tokens_per_round'][r - 1]:.3f} |"
                     + (f" {rep['capacity_schedule'][r - 1]:.3f} |" if expert else ""))
    return "\n".join(lines)


def plot_recursions(path: Path, rep: dict[str, Any]) -> None:
    """Share of tokens entering each round (and, for expert choice, the capacity trained with top-k)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    R = rep["rounds"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(range(1, R + 1), rep["tokens_per_round"], label="tokens entering the round (eval)")
    if rep.get("capacity_schedule"):
        ax.plot(range(1, R + 1), rep["capacity_schedule"], "ko--", label="trained capacity (top-k)")
    ax.set_xlabel("round")
    ax.set_ylabel("share of tokens")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Mixture-of-Recursions ({rep['kind']}, {rep['cache_rule']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
