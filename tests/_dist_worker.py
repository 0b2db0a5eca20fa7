"""One process of a multi-process test job (launched by tests/test_distributed.py through torchrun).

argv[1]: a JSON file with a list of jobs, each {"out", "overrides", "stop_after"?, "resume"?,
"stage2_of"?, "skew_depth"?}. The process group is made once here (gloo, loopback) and every job
trains through `looplm.train.trainer.train`, which uses it; a job with "skew_depth" makes rank 1
draw one more round than rank 0 and records the lockstep error each rank raised.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


def main() -> None:
    from looplm.recipe.config import load_recipe
    from looplm.train import trainer
    from looplm.train.parallel import LockstepError

    jobs = json.loads(Path(sys.argv[1]).read_text())
    cuda = any(j["overrides"].get("train.device") == "cuda" for j in jobs)
    if cuda:
        import os

        import torch
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    for job in jobs:
        if job.get("stage2_of"):
            recipe = trainer.stage2_recipe(job["stage2_of"], job["overrides"])
        else:
            recipe = load_recipe(job.get("recipe", "quickstart"), job["overrides"])
        if job.get("skew_depth"):
            real = trainer.sample_depth
            trainer.sample_depth = lambda *a, **k: real(*a, **k) + rank
            try:
                trainer.train(recipe, job["out"], quiet=True)
            except LockstepError as err:
                Path(job["out"]).mkdir(parents=True, exist_ok=True)
                (Path(job["out"]) / f"lockstep_rank{rank}.txt").write_text(str(err))
            finally:
                trainer.sample_depth = real
            continue
        trainer.train(recipe, job["out"], quiet=True, resume=job.get("resume", False),
                      stop_after=job.get("stop_after"), init_from=job.get("stage2_of"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
