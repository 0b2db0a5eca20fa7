"""ACT's mixture against Ouro's weighted losses, on the ouro-style recipe, over several seeds.

    python benchmarks/act_vs_ouro.py [--seeds 0,1,2] [--out DIR] [--set key=value ...]

Trains `--recipe ouro-style` once per seed with `supervision.kind = "learned_exit"` (Ouro: exit masses
weight the rounds' losses) and once with `"act_mixture"` (ACT: one loss on the mass-weighted mixture of
the rounds' probabilities), same regulariser, same batches per seed, then scores each run with
`looplm eval RUN --rounds 1..R,2R --exit quantile:0.5 --json`: the held-out loss of every single round,
of the exit mixture (the output ACT defines), of the gate's quantile exit (what serving with the gate
computes) and the rounds that exit uses. Prints a markdown table per seed and the means; writes
result.json into --out. The two kinds are "a different computation" on the same masses; this says
which one a user of the gate should train with, on this recipe.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("learned_exit", "act_mixture")


def _looplm(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "looplm", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"looplm {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def run_one(out: Path, kind: str, seed: int, sets: list[str]) -> dict:
    folder = out / f"{kind}-seed{seed}"
    if not (folder / "report.json").exists():
        extra = [a for s in sets for a in ("--set", s)]
        _looplm("train", "--recipe", "ouro-style", "--out", str(folder), "--set", f"supervision.kind={kind}",
                "--set", f"train.seed={seed}", "--set", "train.threads=1", *extra)
    report = json.loads((folder / "report.json").read_text())
    R = report["recipe"]["depth"]["rounds"]
    rounds = ",".join(str(r) for r in [*range(1, R + 1), 2 * R])
    ev = json.loads(_looplm("eval", str(folder), "--rounds", rounds, "--exit", "quantile:0.5", "--json"))
    return {"kind": kind, "seed": seed, "rounds": R,
            "loss_by_rounds": {k: v["loss"] for k, v in ev["rounds"].items()},
            "mixture": ev["exit_mixture"]["loss"], "exit_mean_round": ev["exit_mixture"]["mean_exit_round"],
            "quantile": ev["exit"]["loss"], "quantile_rounds": ev["exit"]["mean_rounds"],
            "train_loss": report["train_loss_final"], "wall_time_s": report["wall_time_s"]}


def markdown(rows: list[dict]) -> str:
    R = rows[0]["rounds"]
    keys = [str(r) for r in [*range(1, R + 1), 2 * R]]
    head = ("| kind | seed | " + " | ".join(f"loss @{k}" for k in keys)
            + " | exit mixture | quantile:0.5 (rounds) | gate's mean round |")
    lines = [head, "|" + "---|" * (len(keys) + 5)]
    groups = {k: [r for r in rows if r["kind"] == k] for k in KINDS}
    for kind, group in groups.items():
        for r in group + ([_mean(group)] if len(group) > 1 else []):
            lines.append(f"| {kind} | {r['seed']} | " + " | ".join(f"{r['loss_by_rounds'][k]:.4f}" for k in keys)
                         + f" | {r['mixture']:.4f} | {r['quantile']:.4f} ({r['quantile_rounds']:.2f}) "
                           f"| {r['exit_mean_round']:.2f} |")
    return "\n".join(lines)


def _mean(group: list[dict]) -> dict:
    m = statistics.fmean
    return {"seed": "mean", "loss_by_rounds": {k: m(g["loss_by_rounds"][k] for g in group)
                                               for k in group[0]["loss_by_rounds"]},
            **{k: m(g[k] for g in group) for k in ("mixture", "quantile", "quantile_rounds", "exit_mean_round")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default="runs/act-vs-ouro")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = [run_one(out, kind, int(s), a.set) for s in a.seeds.split(",") for kind in KINDS]
    (out / "result.json").write_text(json.dumps({"rows": rows, "sets": a.set}, indent=1))
    print(markdown(rows))
    print(f"\n{len(rows)} runs in {time.perf_counter() - t0:.0f} s; result.json in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
