"""How fast decode attention reads the key/value history, on bench-s (looplm only).

    python benchmarks/kv_reads.py [--threads N] [--runs 4] [--new-tokens 224]

1. Decode step time by position: greedy decoding of `--new-tokens` after the 32-token prompt at
   batch 1 and 8, each step timed (median over `--runs` generations, the first dropped), averaged
   over 16-column bands. The history a step reads grows by one column per step: 8 cache slots
   x rows x 4 heads x 64 x 4 bytes x (key, value) = 16 KiB per row, so the slope of step time
   against position is what reading one more column costs (per row: its effective bandwidth).
2. The same reads alone: SDPA over 8 slots of (8, 4, L, 64) keys and values (the batch-8
   decode shape, slices of a longer cache as the engine reads them), against `sum()` of the same
   key and value slices (a plain streaming read of the same bytes), in GB/s.

If the slope's bandwidth matches SDPA's alone and both are well below `sum()`'s, the cost of
the history is the attention kernel's read rate, not the data falling out of cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from looplm.bench.decode import BENCH_S, PROMPT_LEN, _prompts
from looplm.recipe.config import load_recipe
from looplm.inference.engine import Engine, GenerationConfig, SamplingParams
from looplm.model.looped import build_model


def step_times(engine: Engine, batch: int, new_tokens: int, runs: int, vocab: int) -> list[float]:
    """Median time of each decode step (s), over `runs` generations after a warm-up."""
    prompts = _prompts(batch, vocab).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
    per_run = []
    for _ in range(runs + 1):
        run = engine.batch(prompts, params)
        run.step()                                              # prefill and the first token
        times = []
        while not run.finished:
            t = time.perf_counter()
            run.step()
            times.append(time.perf_counter() - t)
        per_run.append(times)
    return [statistics.median(r[i] for r in per_run[1:]) for i in range(len(per_run[0]))]


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def read_speeds(threads: int) -> None:
    B, H, Dh, cap, slots = 8, 4, 64, 256, 8
    print(f"\nthe reads alone: 8 slots of ({B}, {H}, L, {Dh}) keys and values, {threads} thread(s), GB/s")
    print(f"{'L':>5} {'SDPA':>7} {'sum()':>7}")
    with torch.inference_mode():
        q = torch.randn(B, H, 1, Dh)
        ks = [torch.randn(B, H, cap, Dh) for _ in range(slots)]
        vs = [torch.randn(B, H, cap, Dh) for _ in range(slots)]
        for L in (32, 96, 160, 256):
            def sdpa():
                for k, v in zip(ks, vs):
                    F.scaled_dot_product_attention(q, k[:, :, :L], v[:, :, :L])

            def plain():
                for k, v in zip(ks, vs):
                    k[:, :, :L].sum()
                    v[:, :, :L].sum()
            nbytes = 2 * slots * B * H * L * Dh * 4
            speed = []
            for fn in (sdpa, plain):
                for _ in range(5):
                    fn()
                ts = []
                for _ in range(30):
                    t = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t)
                speed.append(nbytes / statistics.median(ts) / 1e9)
            print(f"{L:>5} {speed[0]:>7.0f} {speed[1]:>7.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=224)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(load_recipe("quickstart", overrides=BENCH_S)).eval()
    engine = Engine(model, None, GenerationConfig())
    slot_bytes = 8 * model.cfg.n_kv_heads * model.cfg.head_dim * 4 * 2      # one column, one row, all slots
    print(f"bench-s decode step (us) by position, {args.threads} thread(s), median of {args.runs}")
    for batch in (1, 8):
        ts = step_times(engine, batch, args.new_tokens, args.runs, model.cfg.vocab_size)
        cols = [PROMPT_LEN + 1 + i for i in range(len(ts))]
        bands = " ".join(f"{cols[i]}:{statistics.mean(ts[i:i + 16]) * 1e6:.0f}" for i in range(0, len(ts), 16))
        per_col = slope(cols, ts)
        print(f"batch {batch}: {bands}")
        print(f"  +{per_col * 1e6:.2f} us per column of history = {batch * slot_bytes / per_col / 1e9:.0f} GB/s")
    read_speeds(args.threads)


if __name__ == "__main__":
    main()
