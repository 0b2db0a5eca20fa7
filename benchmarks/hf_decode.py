"""The same pretrained weights decoded by HF `generate` and by looplm's engine, tokens/s side by side.

    python benchmarks/hf_decode.py [--family llama|qwen3|gemma3] [--batch 1,8] [--prompt 64] [--new 64]
                                   [--runs 3] [--threads 2] [--json]

A Llama-style model looplm did not design (random weights: speed does not depend on them) is built
with transformers and saved, then brought in with `looplm import` at one round, every layer kept, so
both sides compute the same function (tests/test_import.py checks logits and greedy tokens). Each
run times, at every batch size, HF's `model.generate` (greedy, its default dynamic cache, the
attention implementation it picks) and `Engine.generate` on the imported run (greedy, its static
per-round cache), interleaved, each on the same prompts of --prompt random tokens and --new
generated tokens with end-of-text ignored. Reported: generated tokens per second end to end
(prefill included; medians over --runs, spread = max - min), and whether the greedy tokens agree.
Run it with the cores to itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SIZE = dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1)


def build(family: str, folder: Path) -> torch.nn.Module:
    import transformers as t
    cls, cfg = {
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**SIZE)),
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**SIZE, head_dim=64)),
        "gemma3": (t.Gemma3ForCausalLM, t.Gemma3TextConfig(**SIZE, head_dim=64, query_pre_attn_scalar=64,
                                                           layer_types=["full_attention"] * SIZE["num_hidden_layers"])),
    }[family]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.save_pretrained(folder)
    from tokenizers import Tokenizer, models
    vocab = {f"t{i}": i for i in range(SIZE["vocab_size"])}
    t.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
                              bos_token="t0", eos_token="t1").save_pretrained(folder)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="llama", choices=["llama", "qwen3", "gemma3"])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import looplm
    from looplm.inference import Engine, SamplingParams
    from looplm.interop.hf_import import import_hf

    tmp = tempfile.TemporaryDirectory(prefix="hf-decode-")
    hf = build(args.family, Path(tmp.name) / "hf")
    run = looplm.load_run(import_hf(Path(tmp.name) / "hf", Path(tmp.name) / "run"))
    engine = Engine(run.model, run.tokenizer)
    batches = [int(b) for b in args.batch.split(",")]
    g = torch.Generator().manual_seed(0)
    times: dict[tuple[str, int], list[float]] = {}
    agree: dict[int, float] = {}
    for rep in range(args.runs + 1):                      # the first repetition warms both up, untimed
        for b in batches:
            ids = torch.randint(2, SIZE["vocab_size"], (b, args.prompt), generator=g)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0)
            t_hf = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = engine.generate(ids.tolist(), SamplingParams(max_new_tokens=args.new, stop_at_eos=False))
            t_lm = time.perf_counter() - t0
            if rep:
                times.setdefault(("hf", b), []).append(b * args.new / t_hf)
                times.setdefault(("looplm", b), []).append(b * args.new / t_lm)
            hf_tokens = out[:, args.prompt:].tolist()
            agree[b] = sum(x == y for c, row in zip(got, hf_tokens) for x, y in zip(c.tokens, row)) / (b * args.new)

    rows = []
    for b in batches:
        med = {k: statistics.median(times[(k, b)]) for k in ("hf", "looplm")}
        spread = {k: max(times[(k, b)]) - min(times[(k, b)]) for k in ("hf", "looplm")}
        rows.append({"batch": b, "hf_tokens_per_s": med["hf"], "looplm_tokens_per_s": med["looplm"],
                     "hf_spread": spread["hf"], "looplm_spread": spread["looplm"],
                     "ratio": med["looplm"] / med["hf"], "greedy_agreement": agree[b]})
    if args.json:
        print(json.dumps({"family": args.family, "size": SIZE, "prompt": args.prompt, "new": args.new,
                          "runs": args.runs, "threads": args.threads, "rows": rows}, indent=2))
        return
    print(f"{args.family} ({SIZE['num_hidden_layers']} layers, d={SIZE['hidden_size']}, vocab {SIZE['vocab_size']}), "
          f"prompt {args.prompt}, {args.new} new tokens, {args.threads} threads, median of {args.runs}")
    print("| batch | HF generate tok/s | looplm engine tok/s | looplm / HF | greedy tokens agree |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['hf_tokens_per_s']:.1f} ± {r['hf_spread'] / 2:.1f} | "
              f"{r['looplm_tokens_per_s']:.1f} ± {r['looplm_spread'] / 2:.1f} | {r['ratio']:.2f}x | "
              f"{r['greedy_agreement']:.3f} |")


if __name__ == "__main__":
    main()
