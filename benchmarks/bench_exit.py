"""Does early exit really save time? Measured wall time of evaluation at ~half depth vs full depth.

    python benchmarks/bench_exit.py [--run RUN] [--kind quantile|entropy|kl] [--repeats 7] [--threads 1]
                                    [--batches 16] [--batch-size 32]

Without --run it first trains the built-in `ouro-style` recipe (whole stack looped, learned exit,
about a minute on one CPU thread) into a temporary folder, then its Ouro stage II (`--stage2-steps`
gate-only steps, as `looplm train --stage2` does; 0 skips it). Then, on the run's validation windows
(`--batches` of the recipe's batch size, regrouped into `--batch-size` sequences; 0 keeps them):

1. finds by bisection the threshold of the chosen policy kind at which the *measured* mean rounds
   used is about half the round budget R (`--target 0.5`);
2. times, interleaved and repeated, (a) the plain full-depth forward `model(x, R)`, (b) the
   early-exit pass at that threshold (`looplm.inference.early_exit.early_exit`), and (c) the plain forward at
   fixed depth round(R/2) (the same average compute without adaptivity);
3. prints medians, the time ratio (target <= 0.6x of full depth) and the quality cost (validation
   loss of each), plus the exact command. `--json` prints one JSON object instead.

Timing covers the forward passes only (not the loss). Use --threads 1 on a shared machine: with
more threads than free cores, small CPU kernels stall on each other and timings scatter widely.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time

import torch
from _runs import trained_run

import looplm
from looplm.inference.early_exit import early_exit
from looplm.evaluation.rounds import eval_batches_for
from looplm.model.losses import token_losses


def mean_rounds(model, batches, policy: str, R: int) -> float:
    used = [early_exit(model, x, policy, R, generator=torch.Generator().manual_seed(0)).rounds_used
            for x, _ in batches]
    return torch.cat([u.flatten() for u in used]).float().mean().item()


def find_threshold(model, batches, kind: str, R: int, target: float, iters: int = 14) -> tuple[float, float]:
    """Bisection on the threshold for mean rounds ~= target*R. Mean rounds falls as entropy/kl
    thresholds rise and rises with the quantile Q."""
    goal = target * R
    if kind == "quantile":
        lo, hi = 1e-4, 1.0                      # Q: low -> early exits
        fmt = lambda v: f"quantile:{v:.6g}"     # noqa: E731
        increasing = True
    else:
        lo, hi = 1e-6, 20.0                     # TAU / EPS in nats (log-space bisection)
        fmt = lambda v: f"{kind}:{v:.6g}"       # noqa: E731
        increasing = False
    best = (None, float("inf"), None)
    for _ in range(iters):
        mid = (lo + hi) / 2 if kind == "quantile" else (lo * hi) ** 0.5
        m = mean_rounds(model, batches, fmt(mid), R)
        if abs(m - goal) < abs(best[1] - goal):
            best = (mid, m, fmt(mid))
        if (m < goal) == increasing:
            lo = mid
        else:
            hi = mid
    return best[2], best[1]


@torch.no_grad()
def loss_of(fn, batches) -> float:
    total, n = 0.0, 0
    for x, y in batches:
        total += token_losses(fn(x), y).sum().item()
        n += y.numel()
    return total / n


def time_once(fn, batches) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) for one pass over the batches."""
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for x, _ in batches:
            fn(x)
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", help="a trained run folder (default: train ouro-style into a temp folder)")
    p.add_argument("--kind", default="quantile", choices=["quantile", "entropy", "kl"])
    p.add_argument("--target", type=float, default=0.5, help="mean rounds used as a fraction of R (default 0.5)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", type=int, default=16, help="validation batches of the recipe's size to take")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per timed batch (0: the recipe's)")
    p.add_argument("--steps", type=int, default=None, help="training steps when no --run is given")
    p.add_argument("--stage2-steps", type=int, default=60, help="gate-only steps after training (no --run; 0 = none)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print

    tmp = None
    run_path = args.run
    if run_path is None:
        overrides = {"train.threads": args.threads, **({"train.steps": args.steps} if args.steps else {})}
        run_path, tmp = trained_run("ouro-style", overrides, "bench_exit_", log)
        if args.stage2_steps:
            from looplm.train.trainer import stage2_recipe, train
            log(f"stage II: {args.stage2_steps} gate-only steps ...")
            stage1, run_path = run_path, run_path + "-stage2"
            train(stage2_recipe(stage1, {"train.steps": args.stage2_steps, "train.threads": args.threads,
                                         "optim.warmup_steps": 5}), run_path, quiet=True, init_from=stage1)
    run = looplm.load_run(run_path)
    model, R = run.model, run.recipe.depth.rounds
    batches = eval_batches_for(run, max_batches=args.batches)
    if args.batch_size:                                          # the same windows, regrouped
        xs, ys = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
        batches = [(xs[i:i + args.batch_size], ys[i:i + args.batch_size]) for i in range(0, len(xs), args.batch_size)]
    half = max(1, round(R * args.target))

    policy, used = find_threshold(model, batches, args.kind, R, args.target)
    log(f"threshold: {policy} -> measured mean rounds {used:.2f} of {R}")

    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    variants = {
        "full": lambda x: model(x, R, generator=gen()).logits,
        "exit": lambda x: early_exit(model, x, policy, R, generator=gen()).logits,
        "fixed_half": lambda x: model(x, half, generator=gen()).logits,
    }
    for fn in variants.values():                                # warm-up
        time_once(fn, batches[:1])
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):                               # interleaved, so drift hits all alike
        for name, fn in variants.items():
            wall, c = time_once(fn, batches)
            times[name].append(wall)
            cpu[name].append(c)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    losses = {k: loss_of(fn, batches) for k, fn in variants.items()}
    tokens = sum(x.numel() for x, _ in batches)
    cmd = "python benchmarks/bench_exit.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    result = {
        "command": cmd.strip(),
        "run": run_path if tmp is None else ("ouro-style trained in a temp folder"
                                             + (f", then {args.stage2_steps} stage-II steps" if args.stage2_steps else "")),
        "threads": args.threads, "rounds_budget": R, "tokens": tokens, "repeats": args.repeats,
        "policy": policy, "mean_rounds_used": used,
        "wall_time_s": {k: v for k, v in med.items()},
        "time_ratio_exit_vs_full": med["exit"] / med["full"],
        "time_ratio_fixed_half_vs_full": med["fixed_half"] / med["full"],
        "cpu_time_s": med_cpu,
        "cpu_ratio_exit_vs_full": med_cpu["exit"] / med_cpu["full"],
        "loss": losses,
        "quality_cost_exit": losses["exit"] - losses["full"],
        "quality_cost_fixed_half": losses["fixed_half"] - losses["full"],
        "all_times_s": times,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"command: {result['command']}")
        print(f"run: {result['run']}; {tokens} tokens in {len(batches)} batches; threads {args.threads}; "
              f"median of {args.repeats}")
        print(f"{'variant':<30s} {'wall (s)':>9s} {'vs full':>8s} {'cpu (s)':>8s} {'vs full':>8s} "
              f"{'mean rounds':>12s} {'loss':>8s}")
        rows = [("full depth, plain forward", "full", R), (f"early exit {policy}", "exit", used),
                (f"fixed depth {half}, plain forward", "fixed_half", half)]
        for label, key, rounds in rows:
            print(f"{label:<30s} {med[key]:9.3f} {med[key] / med['full']:7.2f}x {med_cpu[key]:8.3f} "
                  f"{med_cpu[key] / med_cpu['full']:7.2f}x {rounds:12.2f} {losses[key]:8.4f}")
        print(f"early exit at {used:.2f}/{R} mean rounds: {result['time_ratio_exit_vs_full']:.2f}x the full-depth "
              f"wall time (target <= 0.6x; CPU time {result['cpu_ratio_exit_vs_full']:.2f}x), "
              f"quality cost {result['quality_cost_exit']:+.4f} nats "
              f"(fixed depth {half}: {result['quality_cost_fixed_half']:+.4f})")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
