"""Decoding a feedback run in its three prompt modes: decode and prefill tokens/s side by side.

    python benchmarks/feedback_decode.py RUN [--new 64] [--runs 5] [--threads 2]

RUN is a run trained with `[feedback]` (e.g. `looplm train --recipe feedback`). Each repetition
generates --new tokens greedily (end-of-text ignored) from the same prompt in standard (no feedback),
soft (feedback from the prompt's end) and fused (an extra prefill pass) mode, interleaved; the first
repetition warms up untimed; medians of --runs. Run it with the cores to itself.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import looplm
    from looplm.inference import Engine, SamplingParams
    run = looplm.load_run(args.run)
    engine = Engine.from_run(run, exit=f"fixed:{run.recipe.depth.rounds}")
    prompt = run.tokenizer.encode("def main(argv):\n    import os\n    ")
    got: dict[str, list[tuple[float, float]]] = {}
    for rep in range(args.runs + 1):
        for mode in ("standard", "soft", "fused"):
            out = engine.generate([prompt], SamplingParams(max_new_tokens=args.new, stop_at_eos=False,
                                                           prompt_mode=mode))[0]
            if rep:
                got.setdefault(mode, []).append((out.stats["decode_tokens_per_s"], out.stats["prefill_tokens_per_s"]))
    print(f"{args.run}: prompt {len(prompt)} tokens, {args.new} new, {args.threads} threads, median of {args.runs}")
    print("| prompt mode | decode tok/s | prefill tok/s |")
    print("|---|---:|---:|")
    for mode, rows in got.items():
        print(f"| {mode} | {statistics.median(d for d, _ in rows):.0f} | {statistics.median(p for _, p in rows):.0f} |")


if __name__ == "__main__":
    main()
