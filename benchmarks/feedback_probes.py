"""Feedback on reasoning tasks: answer accuracy with and without a feedback prefill pass, and linear
probes of the answer by round, on the built-in `completion` and `delayed_memory` tasks.

    python benchmarks/feedback_probes.py [--steps 400] [--n 200] [--difficulty 2] [--tasks completion,delayed_memory]

For each task the built-in `feedback` recipe is trained on it (plain for the first half of --steps,
then the pass mixture), into a temporary folder. Then, on --n held-out examples at one difficulty:
- accuracy: greedy answers decoded by the cached engine in each prompt mode — standard (no
  feedback), soft (the prompt read plainly, feedback from its end) and fused (one extra feedback
  prefill pass) — exact match against the task's answer (evaluation/tasks.py `prompt_mode_accuracy`,
  what `looplm eval RUN --prompt-mode standard,soft,fused` reports);
- probes: a linear probe of the answer's first character from the loop state at the last prompt
  position after each round (evaluation/probes.py: fit on one half, tested on the other), from the
  plain pass and from the feedback pass (inputs fused with the plain pass's shifted top states).
Whatever it shows is the measurement; docs/benchmarks.md keeps the table with the command.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


@torch.no_grad()
def states(model, tok, examples, rounds: int, fed: bool) -> torch.Tensor:
    """(rounds, N, d) loop state at each example's last prompt position; fed: from the feedback pass."""
    from looplm.data.taskdata import encode_examples
    from looplm.model.feedback import passes_forward, plain_positions
    model.eval()
    b = encode_examples(tok, examples, model.cfg.context, True)
    x = b.x
    plain = plain_positions(x, tok.eos_id, model.feedback_cfg.reset_at_eos)
    outs = passes_forward(model, x, 2 if fed else 1, plain, rounds=rounds, collect_stats=True)
    pos = torch.tensor(b.prompt_lens) - 1
    rows = torch.arange(len(pos))
    return torch.stack([s[rows, pos] for s in outs[-1].round_states]).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--difficulty", type=int, default=2)
    ap.add_argument("--tasks", default="completion,delayed_memory")
    args = ap.parse_args()

    import looplm
    from looplm.data.taskdata import TaskSource
    from looplm.evaluation.probes import answer_target, probe_by_round
    from looplm.evaluation.tasks import prompt_mode_accuracy
    from looplm.train.trainer import train

    tmp = tempfile.TemporaryDirectory(prefix="feedback-probes-")
    rows = []
    for task in args.tasks.split(","):
        recipe = looplm.load_recipe("feedback", {"data.task": task, "train.steps": args.steps,
                                                 "feedback.mix_from_step": args.steps // 2})
        out = Path(tmp.name) / task
        train(recipe, out, quiet=True)
        run = looplm.load_run(out)
        R = run.recipe.depth.rounds
        examples = TaskSource(run.recipe).eval_sets(args.n, levels=[args.difficulty])[args.difficulty]
        # the same scoring as `looplm eval RUN --prompt-mode standard,soft,fused`
        acc = {m: row[args.difficulty] for m, row in prompt_mode_accuracy(
            run.model, run.tokenizer, {args.difficulty: examples}, ["standard", "soft", "fused"], R,
            separator=run.recipe.data.separator).items()}
        probes = {fed: probe_by_round(states(run.model, run.tokenizer, examples, R, fed), examples, answer_target)
                  for fed in (False, True)}
        rows.append((task, acc, probes))
    print(f"feedback recipe, {args.steps} steps (plain until {args.steps // 2}), {args.n} held-out examples at "
          f"difficulty {args.difficulty}")
    print("| task | accuracy standard | soft | fused | answer probe by round, plain pass | feedback pass |")
    print("|---|---:|---:|---:|---|---|")
    for task, acc, probes in rows:
        fmt = lambda p: " ".join(f"{r}:{v:.2f}" for r, v in p.items())    # noqa: E731
        print(f"| {task} | {acc['standard']:.3f} | {acc['soft']:.3f} | {acc['fused']:.3f} | {fmt(probes[False])} | "
              f"{fmt(probes[True])} |")


if __name__ == "__main__":
    main()
