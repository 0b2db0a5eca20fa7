"""Training on one process vs two (DDP, FSDP2) on this machine, and FSDP2's collectives per step.

    python benchmarks/distributed.py [--steps 30] [--runs 3]

Part 1: the quickstart recipe (batch 16 x 128 tokens, the global batch) trained for --steps steps
in one process and under `torchrun --nproc-per-node 2` with ddp and fsdp (gloo on the CPU), each
--runs times in turn; the median tokens/s from report.json and the final training loss (equal
across the three up to float rounding). On a 2-core machine expect little speed-up: the point is
that the loss is the same.

Part 2 (`--collectives`, run by part 1 under torchrun): one training step of a model with a 2-block
core at 4 rounds, FSDP2 units as `train.parallel = "fsdp"` makes them, counting the all-gathers and
reduce-scatters of each unit in the forward and the backward (from FSDP2's param-group calls).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def collectives() -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg

    import looplm
    from looplm.train.parallel import World, parallelize

    dist.init_process_group("gloo")
    counts: collections.Counter = collections.Counter()
    phase = {"now": "forward"}
    unshard, reduce = pg.FSDPParamGroup.unshard, pg.foreach_reduce

    def counted_unshard(self, *a, **k):
        if not self.is_unsharded and self._all_gather_result is None:
            counts[(phase["now"], "all_gather", self._module_fqn or "root")] += 1
        return unshard(self, *a, **k)

    def counted_reduce(params, *a, **k):
        counts[(phase["now"], "reduce_scatter", params[0]._module_info.module.__class__.__name__)] += 1
        return reduce(params, *a, **k)

    pg.FSDPParamGroup.unshard, pg.foreach_reduce = counted_unshard, counted_reduce
    recipe = looplm.load_recipe("quickstart", {"model.n_core": 2, "model.n_prelude": 1, "model.n_coda": 1,
                                               "depth.kind": "fixed", "depth.rounds": 4, "backward.window": "all"})
    torch.manual_seed(0)
    model = looplm.build_model(recipe)
    parallelize(model, "fsdp", World(dist.get_rank(), dist.get_world_size(), 0, "gloo"))
    x = torch.randint(0, recipe.model.vocab_size, (2, 64))
    out = model(x, 4, generator=torch.Generator().manual_seed(0))
    phase["now"] = "backward"
    out.logits.float().pow(2).mean().backward()
    table = {f"{p} {kind} {unit}": n for (p, kind, unit), n in sorted(counts.items())}
    dist.destroy_process_group()
    return table


def train_once(mode: str, steps: int, out: Path) -> dict:
    sets = ["--set", f"train.steps={steps}", "--set", "train.log_every=10", "--set", f"train.checkpoint_every={steps}",
            "--set", "train.eval_batches=1"]
    if mode == "one":
        cmd = [sys.executable, "-m", "looplm", "train", "--out", str(out), *sets]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "looplm", "train", "--out", str(out), *sets, "--set", f"train.parallel={mode}"]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rep = json.loads((out / "report.json").read_text())
    return {"tokens_per_s": rep["tokens_per_s"], "train_loss_final": rep["train_loss_final"],
            "peak_rss_bytes_per_rank": rep.get("peak_rss_bytes_per_rank")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--collectives", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.collectives:
        table = collectives()
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(table))
        return
    rows: dict[str, list[dict]] = {"one": [], "ddp": [], "fsdp": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for mode in rows:
                rows[mode].append(train_once(mode, args.steps, Path(tmp) / f"{mode}-{i}"))
    result = {mode: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                     "train_loss_final": rs[0]["train_loss_final"],
                     "peak_rss_mib_per_rank": [b / 2**20 for b in rs[0]["peak_rss_bytes_per_rank"] or []]}
              for mode, rs in rows.items()}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           __file__, "--collectives"], check=True, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    result["fsdp_collectives_one_step"] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
