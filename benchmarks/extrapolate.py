"""The depth-extrapolation goal run (a benchmark, not a test).

    python benchmarks/extrapolate.py [--out DIR] [--set key=value ...]

Runs `looplm experiment extrapolate` with the built-in `extrapolate` recipe (variable chains,
trained on <= 4 hops, evaluated up to 8 hops and 16 rounds, prompts padded to one length),
then prints the accuracy tables, the goal line (looped accuracy at 8 hops, best over rounds
>= 8, target >= 90%) and the time taken: wall clock and CPU time (this process and its
training workers), so a run on a busy machine can still be compared with the 30-minute
budget on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

from looplm.memory import process_peak_rss_bytes
from looplm.recipe.config import load_recipe, parse_override
from looplm.experiments.extrapolate import run_extrapolate
from looplm.evaluation.tasks import markdown_table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=f"runs/extrapolate-goal-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--recipe", default="extrapolate")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    recipe = load_recipe(args.recipe, dict(parse_override(s) for s in args.set))
    t0, c0 = time.perf_counter(), time.process_time()
    result = run_extrapolate(recipe, args.out)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0 + children.ru_utime + children.ru_stime
    for name, table in result["models"].items():
        print(f"\n## {name}: exact match (%)\n")
        print(markdown_table({int(d): {int(r): a for r, a in row.items()} for d, row in table.items()}))
    top = str(result["eval_difficulty_max"])
    rmax = result["train_rounds"]["max"]
    row = result["models"]["looped"][top]
    best_r, best = max(((r, a) for r, a in row.items() if int(r) >= int(top)), key=lambda kv: kv[1])
    goal = {"looped_accuracy_at_max_difficulty": best, "at_rounds": int(best_r),
            "accuracy_by_rounds": row, "target": 0.9, "met": best >= 0.9,
            "wall_time_s": wall, "cpu_time_s": cpu, "cpu_count": os.cpu_count(),
            "torch_threads": recipe.train.threads, "load_average": os.getloadavg(),
            "peak_rss_bytes": process_peak_rss_bytes(),   # every model's training, not the last run's alone
            "out": args.out, "train_rounds_max": rmax}
    print("\n" + json.dumps(goal, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
