"""Where a decode step's time goes, at batch 1 and batch 8, on bench-s (looplm only).

    python benchmarks/decode_breakdown.py [--threads N] [--runs 9] [--new-tokens 128]

For each batch size it times greedy decoding four ways in one process: as is, with the
decode-time attention replaced by a stand-in that returns its query (no key/value reads), with
the one-column matrix products (the blocks' and the LM head's) replaced by a preallocated zero
result (no weight reads), and with both. Each figure is the median over `--runs` generations of the mean time per decode step.
The differences say what attention and the matmuls cost *inside* a real step (where they compete
for cache with everything else), which timing them alone does not; "rest" is what is left when
both are gone (norms, RoPE, residuals, cache writes, sampling, Python).

The stand-ins produce meaningless tokens; speed does not depend on them (fixed length, no stop).
This is a diagnostic for engine work, not a peer comparison: that is `looplm bench decode`.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F

import looplm.inference.kernels as kernels
import looplm.model.blocks as blocks
from looplm.bench.decode import BENCH_S, _prompts
from looplm.recipe.config import load_recipe
from looplm.inference.engine import Engine, GenerationConfig, SamplingParams
from looplm.model.looped import build_model


class _Stubs:
    """Switchable stand-ins for the engine's decode attention and one-column matmuls."""

    def __init__(self) -> None:
        self.attention = self.matmul = False
        self._mm, self._zeros = kernels.mm, {}

    def sdpa(self, q, k, v, attn_mask=None, enable_gqa=False):
        if self.attention and q.shape[2] == 1:
            return q.clone()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)

    def mm(self, x, w):
        # one column: (B, 1, in) inside the blocks, (B, in) at the head
        if self.matmul and (x.dim() == 2 or x.shape[-2] == 1):
            wr = w[0]
            out = wr.shape[0] * wr.shape[2] if wr.dim() == 3 else wr.shape[1]
            key = (*x.shape[:-1], out)
            if key not in self._zeros:
                self._zeros[key] = torch.zeros(key, dtype=x.dtype)
            return self._zeros[key]
        return self._mm(x, w)


class _F:
    """torch.nn.functional with scaled_dot_product_attention routed through the stubs (installed as the
    blocks' F: the attention every backend runs lives in model/blocks.py)."""

    def __init__(self, stubs: _Stubs):
        self.scaled_dot_product_attention = stubs.sdpa

    def __getattr__(self, name):
        return getattr(F, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    stubs = _Stubs()
    kernels.mm, blocks.F = stubs.mm, _F(stubs)
    torch.manual_seed(0)
    model = build_model(load_recipe("quickstart", overrides=BENCH_S)).eval()
    engine = Engine(model, None, GenerationConfig())
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    print(f"bench-s decode step (us), {args.threads} thread(s), {args.new_tokens} new tokens, "
          f"median of {args.runs}")
    print(f"{'batch':>5} {'step':>7} {'attention':>10} {'matmuls':>8} {'rest':>6}")
    for batch in (1, 8):
        prompts = _prompts(batch, model.cfg.vocab_size).tolist()
        step = {}
        for attention, matmul in ((False, False), (True, False), (False, True), (True, True)):
            stubs.attention, stubs.matmul = attention, matmul
            engine.generate(prompts, params)                      # warm-up
            times = []
            for _ in range(args.runs):
                st = engine.generate(prompts, params)[0].stats
                times.append(st["decode_s"] / (args.new_tokens - 1) * 1e6)
            step[attention, matmul] = statistics.median(times)
        full = step[False, False]
        print(f"{batch:>5} {full:>7.0f} {full - step[True, False]:>10.0f} {full - step[False, True]:>8.0f} "
              f"{step[True, True]:>6.0f}")


if __name__ == "__main__":
    main()
