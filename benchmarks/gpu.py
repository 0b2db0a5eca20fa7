"""Training and decoding on a GPU, in one prepared script: the figures this 2-core CPU machine cannot give.

    python benchmarks/gpu.py [--runs 5] [--quick] [--no-compile] [--out gpu.json]

Runs, on `cuda` (exit 2 when torch sees none):
1. `looplm bench train` on bench-s: looplm eager, looplm under torch.compile and the peers (HF Llama,
   x-transformers) in the same run, tokens/s and MFU against the measured bf16/fp32 matmul peak;
2. `looplm bench decode` on bench-s: batch 1 and 8, prefill/decode tokens/s, TTFT, beside the peers;
3. a short quickstart training on cuda at fp32 and bf16 beside the same run on cpu: the loss sequences
   (fp32 must agree with cpu to rounding) and peak device memory.
Prints one JSON object on stdout (also written to --out), the tables on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from looplm.bench.decode import bench_decode, decode_lines
from looplm.bench.train import bench_train, train_lines
from looplm.recipe.config import load_recipe
from looplm.train.trainer import train


def short_training(device: str, precision: str, steps: int, out: Path) -> dict:
    recipe = load_recipe("quickstart", overrides={"train.steps": steps, "train.log_every": 1,
                                                  "train.device": device, "train.dtype": precision,
                                                  "data.max_bytes": 300_000, "train.eval_batches": 2})
    t0 = time.perf_counter()
    report = train(recipe, out, quiet=True)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"device": device, "precision": precision, "wall_s": time.perf_counter() - t0, "losses": losses,
            "tokens_per_s": report["tokens_per_s"], "peak_device_memory_bytes": report["peak_device_memory_bytes"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the benchmarks' small sizes (a smoke test)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    ap.add_argument("--steps", type=int, default=40, help="steps of the short quickstart trainings")
    ap.add_argument("--out", default="gpu.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: torch sees no CUDA device here", file=sys.stderr)
        return 2
    result: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    result["train"] = bench_train(runs=args.runs, steps=5, threads=4, quick=args.quick,
                                  compile=not args.no_compile, device="cuda")
    print("\n".join(train_lines(result["train"])), file=sys.stderr)
    result["decode"] = bench_decode(runs=args.runs, quick=args.quick, device="cuda")
    print("\n".join(decode_lines(result["decode"])), file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [short_training(d, p, args.steps, Path(tmp) / f"{d}-{p}")
                for d, p in (("cpu", "fp32"), ("cuda", "fp32"), ("cuda", "bf16"))]
    cpu = runs[0]["losses"]
    for r in runs:
        r["max_rel_diff_vs_cpu"] = max(abs(a - b) / a for a, b in zip(cpu, r["losses"]))
        print(f"train {r['device']} {r['precision']}: {r['tokens_per_s']:.0f} tok/s, final loss "
              f"{r['losses'][-1]:.4f}, max |loss - cpu|/loss {r['max_rel_diff_vs_cpu']:.2e}, peak device memory "
              f"{(r['peak_device_memory_bytes'] or 0) / 2**20:.0f} MiB", file=sys.stderr)
    result["short_training"] = runs
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
