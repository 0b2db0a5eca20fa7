"""What self-speculative decoding buys on a trained model: acceptance, draft depth and speed-up.

    python benchmarks/bench_speculative.py [--run RUN] [--prompts 8] [--prompt-len 32]
                                           [--new-tokens 96] [--runs 3] [--threads 2] [--json]

Without --run it first trains the built-in `quickstart` recipe (the README's main job, about four
minutes on 2 cores) into a temporary folder. Prompts are the first `--prompt-len` tokens of the
run's validation windows (text the model has not trained on). For each setting below it decodes
every prompt greedily, batch 1, and checks the tokens equal plain full-depth decoding (the
contract of speculation); then it reports decode tokens/s (median over `--runs` passes, settings
timed in turns), the speed-up over plain, the acceptance rate and the mean rounds the drafts ran:

    plain                  no drafts (full depth, R rounds, every token)
    ROUNDS:K               K drafts of ROUNDS rounds each
    exit:K POLICY          K drafts that each stop where the exit policy says (entropy and kl read
                           the LM head after every round, which a fixed-round draft does not)

Random weights make these numbers meaningless (every draft agrees or none does); `looplm bench
decode`'s speculative row is a cost check, this is the measurement of the trade.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from _runs import trained_run

import looplm
from looplm.evaluation.rounds import eval_batches_for
from looplm.inference.engine import Engine, SamplingParams

SETTINGS = [("plain", {}), ("1:2", {"speculative": "1:2"}), ("1:4", {"speculative": "1:4"}),
            ("1:8", {"speculative": "1:8"}), ("2:4", {"speculative": "2:4"}),
            ("exit:4 entropy:1.0", {"speculative": "exit:4", "exit": "entropy:1.0"}),
            ("exit:4 entropy:2.0", {"speculative": "exit:4", "exit": "entropy:2.0"}),
            ("exit:4 kl:0.05", {"speculative": "exit:4", "exit": "kl:0.05"})]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", help="a trained run folder (default: train quickstart into a temp folder)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print

    tmp = None
    run_path = args.run
    if run_path is None:                              # about four minutes
        run_path, tmp = trained_run("quickstart", {}, "bench_speculative_", log)
    run = looplm.load_run(run_path)
    windows = torch.cat([x for x, _ in eval_batches_for(run)])
    if len(windows) < args.prompts or windows.shape[1] < args.prompt_len:
        sys.exit(f"run {run_path}: fewer than {args.prompts} validation windows of {args.prompt_len} tokens")
    prompts = [w[:args.prompt_len].tolist() for w in windows[:: max(1, len(windows) // args.prompts)][:args.prompts]]
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    engines = {name: Engine.from_run(run, **cfg) for name, cfg in SETTINGS}
    want = [engines["plain"].generate([q], params)[0].tokens for q in prompts]

    speed: dict[str, list[float]] = {name: [] for name in engines}
    spec: dict[str, dict[str, float]] = {}
    for _ in range(args.runs):
        for name, eng in engines.items():              # settings in turns: drift hits them alike
            secs = tokens = drafted = accepted = draft_rounds = 0.0
            for q, w in zip(prompts, want):
                out = eng.generate([q], params)[0]
                if out.tokens != w:
                    sys.exit(f"{name}: output differs from plain full-depth decoding (a bug)")
                secs += out.stats["decode_s"]
                tokens += out.stats["decode_tokens"]
                if "speculative" in out.stats:
                    s = out.stats["speculative"]
                    drafted += s["drafted"]
                    accepted += s["accepted"]
                    draft_rounds += s["draft_mean_rounds"] * s["drafted"]
            speed[name].append(tokens / secs)
            if drafted:
                spec[name] = {"acceptance_rate": accepted / drafted, "draft_mean_rounds": draft_rounds / drafted}

    plain = statistics.median(speed["plain"])
    rows = [{"setting": name, "decode_tokens_per_s": statistics.median(speed[name]),
             "speedup": statistics.median(speed[name]) / plain, **spec.get(name, {})} for name in engines]
    command = "python benchmarks/bench_speculative.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"run": run_path if tmp is None else "quickstart trained in a temp folder", "rounds": engines["plain"].rounds,
              "prompts": len(prompts), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "runs": args.runs, "threads": args.threads, "rows": rows, "command": command.strip()}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['run']}: R = {result['rounds']}, {len(prompts)} prompts of {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, greedy, batch 1, {args.threads} threads, median of {args.runs}")
    print(f"{'setting':22s} {'tok/s':>7s} {'speed-up':>9s} {'acceptance':>11s} {'draft rounds':>13s}")
    for r in rows:
        acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
        dr = f"{r['draft_mean_rounds']:.2f}" if "draft_mean_rounds" in r else "-"
        print(f"{r['setting']:22s} {r['decode_tokens_per_s']:7.0f} {r['speedup']:8.2f}x {acc:>11s} {dr:>13s}")
    print(f"(every setting's tokens equal plain full-depth decoding; {result['command']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
