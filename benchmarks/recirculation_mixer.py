"""Recirculation's adaptive mixer, the seeds' ablation: constant scalar, conditional scalar, constant
vector and conditional vector coefficients, each trained through the recurrence with the model frozen,
beside the base model and the fixed mix.

    python benchmarks/recirculation_mixer.py RUN --s S --d D [--alpha 0.15] [--steps 100] [--tokens 8192]
                                             [--window 64] [--kinds constant_scalar,...]

Held-out text (what `looplm eval` scores) is cut into windows of --window tokens; the first half trains
the mixers (AdamW, lr 3e-4, weight decay 1e-4, batch 4, the seeds' settings), the second half scores
every row: mean next-token loss of the ordinary readouts under the exact schedule (train/mixer.py,
tested equal to the engine's). Each mixer starts at alpha 0.1, beta 0.9. Whatever it shows is the
measurement; docs/recirculation.md keeps the table with the command.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--s", type=int, required=True)
    ap.add_argument("--d", type=int, required=True)
    ap.add_argument("--alpha", type=float, default=0.15)
    ap.add_argument("--beta", default="complement", choices=("complement", "one"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--kinds", default="constant_scalar,conditional_scalar,constant_vector,conditional_vector")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import looplm
    from looplm.evaluation.recirculation import heldout_windows
    from looplm.inference.recirculation import Recirculation
    from looplm.train.mixer import mixer_ablation
    run = looplm.load_run(args.run)
    rc = Recirculation(source=args.s, dest=args.d, alpha=args.alpha, beta=args.beta)
    rc.check(run.model.cfg, run.model.nominal_rounds)
    x, y = (torch.cat(parts) for parts in zip(*heldout_windows(run, args.tokens, args.window)))
    windows = torch.cat([x, y[:, -1:]], 1)                                  # (N, window + 1)
    half = windows.shape[0] // 2
    t0 = time.perf_counter()
    res = mixer_ablation(run.model.eval(), rc, windows[:half], windows[half:], tuple(args.kinds.split(",")),
                         steps=args.steps)
    elapsed = time.perf_counter() - t0
    d = run.model.cfg.d_model
    scored = windows[half:, 1:].numel()
    print(f"{args.run}: s = {args.s}, d = {args.d}; fixed alpha {args.alpha}, beta {args.beta}; {half} training "
          f"windows of {args.window}, {scored:,} held-out tokens scored; {args.steps} steps each; {elapsed:.0f} s")
    print("| coefficients | matrix weights | held-out loss | change vs base (nats) | perplexity change % |")
    print("|---|---:|---:|---:|---:|")

    def row(name: str, loss: float, weights: str) -> None:
        change = (math.exp(res["base_loss"]) - math.exp(loss)) / math.exp(res["base_loss"]) * 100
        print(f"| {name} | {weights} | {loss:.4f} | {loss - res['base_loss']:+.4f} | {change:+.2f} |")
    row("base model (no recirculation)", res["base_loss"], "0")
    row(f"fixed alpha {args.alpha}", res["fixed"]["loss"], "0")
    for kind, r in res["kinds"].items():
        row(kind, r["loss"], f"{r['matrix_weights']:,} ({r['matrix_weights'] / d ** 2:.1f} d^2)")
    print("perplexity change: positive = better than the base model, negative = worse")
    if args.json:
        print(json.dumps({**res, "kinds": {k: {kk: vv for kk, vv in v.items() if kk != "mixer"}
                                           for k, v in res["kinds"].items()}}, indent=1))


if __name__ == "__main__":
    main()
