"""What one decode-time matrix product costs at 1 and 8 rows, per backend, on bench-s's matrices.

    python benchmarks/matmul_rows.py [--threads N] [--repeats 2000] [--crossover]

A bench-s decode step runs 33 products (q/k/v, out, gate/up and down in each of the 8 block
visits, then the LM head). For each of the five matrix shapes and 1 or 8 rows, this times,
hot in cache:

    onednn   the engine's several-row path: oneDNN's packed weights (`_linear_pointwise`)
    mkl-mm   torch.mm against an (in, out) copy (MKL's sgemm)
    split    the engine's one-row path: a bmm over per-thread slices of the outputs

and a 16x16 oneDNN product, whose time is almost all fixed per-call cost (the kernel itself runs
in about a microsecond; `torch.backends.mkldnn.verbose` shows the kernel's own time). The
"step" line adds each column up over the 33 products of one step. Hot-cache figures are a floor:
inside a real step the weights compete for cache with the key/value history
(benchmarks/decode_breakdown.py measures that).

`--crossover` instead times the two paths the engine chooses between at 2..32 rows, on the
matrices of the `quickstart` recipe and of bench-s, and marks where `kernels.PACKED_MIN_MACS`
(rows x in x out) sends each product: oneDNN's fixed per-call cost makes the packed path lose on
small products (a few rows of a small model: batched or speculative decoding of `quickstart`).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from looplm.inference.kernels import PACKED_MIN_MACS, packed_weight, row_weight

# (out, in) of each bench-s matrix and how often a decode step uses it
SHAPES = {"qkv": ((768, 256), 8), "out": ((256, 256), 8), "gate/up": ((1408, 256), 8),
          "down": ((256, 704), 8), "head": ((4096, 256), 1)}


def median_us(fn, repeats: int) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeats // 5):
            fn()
        times.append((time.perf_counter() - t) / (repeats // 5) * 1e6)
    return sorted(times)[2]


def split_mm(x: torch.Tensor, wr: torch.Tensor) -> torch.Tensor:
    """x (rows, in) by the one-row layout: (rows, out) for (in, out), (P, rows, out/P) for slices."""
    if wr.dim() == 2:
        return torch.mm(x, wr)
    return torch.bmm(x.expand(wr.shape[0], *x.shape), wr)


def as_rows(y: torch.Tensor, rows: int) -> torch.Tensor:
    return y.transpose(0, 1).reshape(rows, -1) if y.dim() == 3 else y


# (out, in) of the quickstart recipe's matrices (d_model 128, 4 + 2x2 heads of 32, SwiGLU 352, 257 tokens)
QUICKSTART = {"qkv": (256, 128), "out": (128, 128), "gate/up": (704, 128), "down": (128, 352), "head": (257, 128)}


def crossover(threads: int, repeats: int) -> None:
    """oneDNN packed vs the one-row layout at several rows; '*' marks the engine's choice."""
    print(f"us per product, hot in cache, {threads} thread(s); * = the path kernels.mm takes "
          f"(packed from {PACKED_MIN_MACS:,} multiply-adds)")
    rows_list = (2, 4, 8, 16, 32)
    print(f"{'model':>10} {'matrix':>8} " + " ".join(f"{f'{r} rows':>15}" for r in rows_list))
    with torch.inference_mode():
        for model, shapes in (("quickstart", QUICKSTART), ("bench-s", {k: v for k, (v, _) in SHAPES.items()})):
            for name, (out, inp) in shapes.items():
                w = torch.randn(out, inp)
                packed, wr = packed_weight(w), row_weight(w, threads)
                if packed is None:
                    raise SystemExit("oneDNN packed weights are unavailable here")
                cells = []
                for rows in rows_list:
                    x = torch.randn(rows, inp)
                    a = median_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                                  repeats)
                    b = median_us(lambda: split_mm(x, wr), repeats)
                    packed_chosen = rows * out * inp >= PACKED_MIN_MACS
                    cells.append(f"{a:.0f}{'*' if packed_chosen else ' '}/{b:.0f}{' ' if packed_chosen else '*'}")
                print(f"{model:>10} {name:>8} " + " ".join(f"{c:>15}" for c in cells))
    print("(each cell: oneDNN packed / one-row layout)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--crossover", action="store_true", help="the packed / one-row threshold, 2..32 rows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.crossover:
        crossover(args.threads, args.repeats)
        return
    backends = ("onednn", "mkl-mm", "split")
    print(f"us per product, hot in cache, {args.threads} thread(s), median of 5 x {args.repeats // 5}")
    print(f"{'matrix':>8} {'rows':>4} " + " ".join(f"{b:>8}" for b in backends))
    step = {(rows, b): 0.0 for rows in (1, 8) for b in backends}
    with torch.inference_mode():
        for name, ((out, inp), uses) in SHAPES.items():
            w = torch.randn(out, inp)
            packed, wt, wr = packed_weight(w), w.t().contiguous(), row_weight(w, args.threads)
            if packed is None:
                raise SystemExit("oneDNN packed weights are unavailable here")
            for rows in (1, 8):
                x = torch.randn(rows, inp)
                fns = {"onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                       "mkl-mm": lambda: torch.mm(x, wt),
                       "split": lambda: split_mm(x, wr)}
                for fn in fns.values():
                    torch.testing.assert_close(as_rows(fn(), rows), x @ w.t(), rtol=1e-4, atol=1e-4)
                us = {b: median_us(fn, args.repeats) for b, fn in fns.items()}
                for b in backends:
                    step[rows, b] += uses * us[b]
                print(f"{name:>8} {rows:>4} " + " ".join(f"{us[b]:>8.1f}" for b in backends))
        for rows in (1, 8):
            print(f"{'step':>8} {rows:>4} " + " ".join(f"{step[rows, b]:>8.0f}" for b in backends))
        tiny = torch.randn(16, 16)
        tp, tx = packed_weight(tiny), torch.randn(8, 16)
        fixed = median_us(lambda: torch.ops.mkldnn._linear_pointwise(tx, tp, None, "none", [], ""), args.repeats)
        print(f"oneDNN 16x16 product at 8 rows (its fixed per-call cost): {fixed:.1f} us; x 33 products = "
              f"{33 * fixed:.0f} us per step")


if __name__ == "__main__":
    main()
