"""`looplm bench train`: training-step speed on the matched bench-s configuration, peers in the same run.

bench-s (CONTRACT.md): batch 8 x context 256, fp32, AdamW, loss on the final round, full
backprop. looplm runs 1 prelude + 2 shared core blocks x 3 rounds + 1 coda (8 effective
blocks); `transformers` LlamaForCausalLM has 8 layers of the same shape; x-transformers'
looped TransformerWrapper has 2 layers x 4 loops. All three apply 8 blocks of one shape per
token, so one FLOP count per token (every block visit counted, forward + backward) serves
every row.

Each row runs in its own subprocess (its own peak memory) and the rows are timed in turns,
like `bench decode`. `mfu` is achieved FLOP/s over the peak this machine measured for a large
fp32 matmul at the same thread count (a CPU has no datasheet peak that torch reaches), so it
reads as "fraction of this machine's practical matmul speed".
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from .decode import BENCH_S, QUICK, _RowProcess, answer_row_commands, hf_llama, xt_looped

BATCH, SEQ = 8, 256
PEER_MODULES = {"hf-llama": "transformers", "x-transformers": "x_transformers"}


def _batch(vocab: int, seq: int) -> Any:
    import torch
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (BATCH, seq + 1), generator=g)


def _step_fn(engine: str, quick: bool, device: str = "cpu") -> tuple[Any, Any]:
    """(one optimizer step, model) for an engine; every step is forward, backward and AdamW.
    looplm-compiled is the looplm row with torch.compile applied from outside (looplm.device.compiled)."""
    import torch
    import torch.nn.functional as F

    seq = 64 if quick else SEQ
    if engine in ("looplm", "looplm-compiled"):
        from ..device import compiled
        from ..recipe.config import load_recipe
        from ..model.looped import build_model
        from ..train.trainer import make_optimizer
        recipe = load_recipe("quickstart", overrides={**BENCH_S, **(QUICK if quick else {})})
        torch.manual_seed(0)
        model = build_model(recipe).train().to(device)
        opt = make_optimizer(model, recipe)
        run = compiled(model, engine == "looplm-compiled")
        forward = lambda x: run(x, 3).logits                                      # noqa: E731
    elif engine == "hf-llama":
        model = hf_llama(quick).train().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        forward = lambda x: model(input_ids=x).logits                             # noqa: E731
    else:
        model = xt_looped(quick).train().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        forward = lambda x: model(x, looped_steps=4, looped_pred_all_logits=False)  # noqa: E731
    data = _batch(512 if quick else 4096, seq).to(device)

    def step() -> float:
        logits = forward(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step, model


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()    # kernels run asynchronously: time what finished


def matmul_peak_flops(threads: int, n: int = 1024, reps: int = 5, device: str = "cpu") -> float:
    import torch
    torch.set_num_threads(threads)
    n = n if device == "cpu" else 8192
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times)


def flops_per_token(quick: bool) -> float:
    from ..recipe.config import load_recipe
    from ..model.looped import build_model
    recipe = load_recipe("quickstart", overrides={**BENCH_S, **(QUICK if quick else {})})
    return build_model(recipe).flops_per_token(3, 64 if quick else SEQ)


def bench_train(runs: int = 5, steps: int = 3, threads: int = 1, quick: bool = False,
                peers: bool = True, compile: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Every row of the train benchmark; the CONTRACT's `bench train --json` object. compile adds the
    looplm-compiled row (torch.compile; its compilation is an untimed warm-up, minutes on a small CPU)."""
    import importlib.util

    from ..device import resolve_device
    from ..errors import UserError
    if runs < 1 or steps < 1 or threads < 1:
        raise UserError("--runs, --steps and --threads must be >= 1")
    device = str(resolve_device(device))
    engines = ["looplm"] + (["looplm-compiled"] if compile else []) + (["hf-llama", "x-transformers"] if peers else [])
    seq = 64 if quick else SEQ
    fpt = flops_per_token(quick)
    peak = matmul_peak_flops(threads, device=device)
    rows: dict[str, dict[str, Any]] = {}
    procs: dict[str, _RowProcess] = {}
    timed: dict[str, list[float]] = {}
    try:
        for eng in engines:
            mod = PEER_MODULES.get(eng)
            if mod is not None and importlib.util.find_spec(mod) is None:
                rows[eng] = {"engine": eng, "skipped": True,
                             "note": f"{mod} is not importable; pip install {mod.replace('_', '-')} -c constraints.txt"}
                continue
            procs[eng] = _RowProcess({"engine": eng, "quick": quick, "steps": steps, "device": device}, threads,
                                     "looplm.bench.train")
        for eng, p in list(procs.items()):
            try:
                p.ask("ready")
                timed[eng] = []
            except (RuntimeError, json.JSONDecodeError) as err:
                rows[eng] = {"engine": eng, "skipped": True, "note": f"failed: {err}"}
                p.close()
                del procs[eng]
        for n in range(runs):
            print(f"bench train: timed round {n + 1}/{runs} over {len(procs)} rows", file=sys.stderr)
            for eng, p in procs.items():
                timed[eng].append(p.ask("run")["step_s"])
        for eng, p in procs.items():
            info = p.ask("info")
            step_s = statistics.median(timed[eng])
            tps = BATCH * seq / step_s
            rows[eng] = {"engine": eng, "tokens_per_s": tps, "step_s": step_s, "mfu": tps * fpt / peak,
                         "step_s_runs": [round(t, 4) for t in timed[eng]], **info}
    finally:
        for p in procs.values():
            p.close()
    results = [rows[e] for e in engines if e in rows]
    ratios = {f"{mine}_vs_{r['engine']}": rows[mine]["tokens_per_s"] / r["tokens_per_s"]
              for mine in ("looplm", "looplm-compiled") if "tokens_per_s" in rows.get(mine, {})
              for r in results if not r["engine"].startswith("looplm") and "tokens_per_s" in r}
    if "tokens_per_s" in rows.get("looplm-compiled", {}) and "tokens_per_s" in rows.get("looplm", {}):
        ratios["looplm-compiled_vs_looplm"] = rows["looplm-compiled"]["tokens_per_s"] / rows["looplm"]["tokens_per_s"]
    return {"config": "bench-s" if not quick else "bench-s (quick: d_model 64, context 64)", "batch": BATCH,
            "seq_len": seq, "dtype": "fp32", "optimizer": "AdamW", "threads": threads, "runs": runs, "device": device,
            "steps_per_run": steps, "flops_per_token": fpt, "peak_matmul_flops": peak, "results": results,
            "ratios": ratios}


def train_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"bench train ({result['config']}, batch {result['batch']} x {result['seq_len']}, "
             f"{result['threads']} thread(s), median of {result['runs']})"]
    for r in result["results"]:
        if r.get("skipped"):
            lines.append(f"{r['engine']:15s} skipped: {r['note']}")
        else:
            lines.append(f"{r['engine']:15s} {r['tokens_per_s']:9.0f} tok/s  mfu {100 * r['mfu']:5.1f}%  "
                         f"rss {r['peak_rss_bytes'] / 2**20:6.0f} MiB  params {r['params']:,}")
    lines += [f"{k}: {v:.2f}x" for k, v in result["ratios"].items()]
    return lines


def _row_main(spec_text: str) -> None:
    """A row worker: "run" times `steps` optimizer steps and reports mean seconds per step."""
    import torch
    spec = json.loads(spec_text)
    torch.set_num_threads(spec["threads"])
    device = spec.get("device", "cpu")
    step, model = _step_fn(spec["engine"], spec["quick"], device)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # shared tensors once

    def run_once() -> dict[str, Any]:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(spec["steps"]):
            step()
        _sync(device)
        return {"step_s": (time.perf_counter() - t0) / spec["steps"]}
    answer_row_commands(run_once, lambda: {"params": params})


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--row":
        _row_main(sys.argv[2])
    else:
        print("usage: python -m looplm.bench.train --row JSON (use `looplm bench train`)", file=sys.stderr)
        sys.exit(2)
