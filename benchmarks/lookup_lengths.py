"""Does a task run's lookup work on short prompts but not on long ones? Exact match by the number of
unneeded statements a held-out line keeps (issue 42: why fixed-length prompts defeat the recipe).

    python benchmarks/lookup_lengths.py RUN --separator " " [--difficulties 1,2,4,8] [--examples 200]

Each line of the run's own held-out split (its data.task file, split as training split it; difficulties
asked for, the first `--examples` of each) is cut with
data.crop_curriculum's own rule (looplm.data.taskdata.crop_items: the query and every statement naming a
trace entry or the answer stay) to keep 0, 25, 50, 75 or 100% of its other statements, and scored
teacher-forced at rounds = its difficulty (at least 1) and at the run's depth.rounds. A model whose
exact match falls from near 100% at 0% kept to chance at 100% has a lookup that only short prompts reach.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import looplm  # noqa: E402
from looplm.data.taskdata import TaskSource, crop_items  # noqa: E402
from looplm.evaluation.tasks import evaluate_examples  # noqa: E402

KEEP = (0.0, 0.25, 0.5, 0.75, 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--separator", required=True)
    ap.add_argument("--difficulties", default="1,2,4,8")
    ap.add_argument("--examples", type=int, default=200)
    a = ap.parse_args()
    run = looplm.load_run(a.run)
    held = TaskSource(run.recipe).eval_sets(a.examples)                # never trained on
    R = run.recipe.depth.rounds
    table = {}
    for d in (int(x) for x in a.difficulties.split(",")):
        exs = held.get(d, [])
        if not exs or "trace" not in exs[0].meta:
            print(f"difficulty {d}: no held-out lines with a trace", flush=True)
            continue
        for keep in KEEP:
            g = random.Random(0)
            cut = [crop_items(ex, a.separator, keep, g) for ex in exs]
            acc = evaluate_examples(run.model, run.tokenizer, cut, sorted({max(1, d), R}),
                                    separator=run.recipe.data.separator)
            table[(d, keep)] = {r: v["accuracy"] for r, v in acc.items()}
            print(f"difficulty {d} kept {keep:.0%}: " + ", ".join(f"{v:.1%} @ {r}" for r, v in table[(d, keep)].items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
