"""What a cache policy costs in quality: held-out loss through the cached engine (`looplm eval --cache-sweep`).

A policy other than `full` changes the function a cached decoder computes: every round reads one
round's keys/values (or their mean) for the earlier tokens instead of its own (Ouro's first /
last / average reuse). The seeds ask for prompt and decode policies to be judged separately, so
each held-out window is split in two and scored the way generation would run it:

    prompt   the first half, prefilled as one chunk under the prefill policy
    decode   every later token fed one at a time (teacher forcing) under the decode policy;
             the next-token loss of these positions is what is reported

Under full/full this is exactly the plain forward pass on the same positions, which the sweep
checks (`forward_loss`); every other row's difference from it is the policy's price, next to
the core cache it holds. Exit policies apply as in generation (`--exit`, else the recipe's).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..inference.engine import Engine, SamplingParams

# (prefill, decode): each shared policy on one side with full on the other, then on both
SWEEP = [("full", "full"), ("first", "full"), ("last", "full"), ("average", "full"),
         ("full", "first"), ("full", "last"), ("full", "average"),
         ("first", "first"), ("last", "last"), ("average", "average")]


@torch.inference_mode()
def continuation_loss(engine: Engine, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Mean next-token loss of each window's second half, decoded through `engine`'s cache after
    its first half was prefilled; with the core cache bytes and mean rounds the tokens ran."""
    total, count, rounds, core = 0.0, 0, 0.0, 0
    for i, (x, y) in enumerate(batches):                                 # x, y: (B, T)
        B, T = x.shape
        h = T // 2
        noise = engine.initial_noise([SamplingParams(seed=i)] * B, next(engine.model.parameters()))
        core = engine.new_cache(B, T).nbytes()["core"]
        logits, used = engine.score(x, h, noise=noise)               # (B, T - h, V), (B, T - h): teacher-forced
        total += F.cross_entropy(logits.flatten(0, 1).float(), y[:, h:].flatten(), reduction="sum").item()
        rounds += float(used.sum())
        count += used.numel()
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(50.0, loss)), "mean_rounds": rounds / count,
            "core_cache_bytes": core, "tokens": count}


@torch.inference_mode()
def forward_loss(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], rounds: int) -> float:
    """The same positions' loss from a plain forward pass (the same position-indexed initial states)."""
    from ..model.looped import initial_noise_table
    total, count = 0.0, 0
    for i, (x, y) in enumerate(batches):
        B, T = x.shape
        init = None
        if model.cfg.init_state == "random":
            init = initial_noise_table(model.cfg, i)[:T].expand(B, T, -1).to(next(model.parameters()))
        logits = model(x, rounds, initial_state=init).logits[:, T // 2:]
        total += F.cross_entropy(logits.flatten(0, 1).float(), y[:, T // 2:].flatten(), reduction="sum").item()
        count += logits.shape[0] * logits.shape[1]
    return total / count


def cache_sweep(run: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], exit: str | None = None,
                missing: str = "copy_forward") -> tuple[dict[str, Any], list[str]]:
    """`looplm eval --cache-sweep`: one row per (prefill, decode) policy pair; (JSON part, lines).
    missing: what later rounds read for a token that exited under `exit` (copy_forward or mask)."""
    if run.recipe.model.kv_sharing == "first":
        raise UserError("--cache-sweep: this model was trained with model.kv_sharing = first and decodes only under "
                        "cache policy first (the sweep's other policies are not its function)")
    overrides = {"missing": missing} if exit is None else {"exit": exit, "missing": missing}
    rows = []
    for prefill, decode in SWEEP:
        engine = Engine.from_run(run, prefill_cache=prefill, decode_cache=decode, **overrides)
        rows.append({"prefill_cache": prefill, "decode_cache": decode, **continuation_loss(engine, batches)})
    full = rows[0]
    for r in rows:
        r["loss_vs_full"] = r["loss"] - full["loss"]
    engine = Engine.from_run(run, **overrides)
    part: dict[str, Any] = {"exit": str(engine.policy), "rows": rows}
    lines = [f"cache policies (prompt = first half of each window, prefilled; the second half decoded token by "
             f"token and scored; exit {engine.policy}, {full['tokens']} tokens):",
             f"{'prefill':>8} {'decode':>8} {'loss':>8} {'vs full':>8} {'rounds':>7} {'core cache':>11}"]
    lines += [f"{r['prefill_cache']:>8} {r['decode_cache']:>8} {r['loss']:8.4f} {r['loss_vs_full']:+8.4f} "
              f"{r['mean_rounds']:7.2f} {r['core_cache_bytes'] / 2**20:8.2f} MiB" for r in rows]
    if not engine.adaptive:
        ref = forward_loss(run.model, batches, engine.rounds)
        part["forward_loss"] = ref
        lines.append(f"plain forward pass on the same positions: {ref:.4f} (full/full must match it)")
    return {"cache_sweep": part}, lines
