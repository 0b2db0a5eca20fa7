"""Where a task run's long chains break, round by round, and whether the other positions' drift is why.

    python benchmarks/trace_diagnosis.py RUN [--difficulty 8] [--examples 200] [--freeze 1,2,3,4]

For a looped task run trained with per-round trace targets (data.round_targets = "trace"), on the
held-out examples of one difficulty D read out at D rounds:

- per round r, how often the readout at the answer's first position names the trace's r-th entry (the
  answer at round D), the round each failing example first goes wrong, and what it names instead
  (a name r' hops along the chain: "off r' - r"; a name off the chain: "other");
- the intervention: after round F every position but the answer's first keeps its state (its keys and
  values stop moving), so only the query goes on chasing; exact match at D rounds for each F. If
  accuracy comes back, the lookup was reading entries that drifted as every position went on with its
  own rounds (docs/tasks.md, "Why long chains broke").
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import looplm  # noqa: E402
from looplm.data.taskdata import TaskSource, encode_examples, round_targets  # noqa: E402
from looplm.evaluation.tasks import logits_by_rounds  # noqa: E402


def trace_rounds(run, D: int, n: int) -> dict:
    """Per-round trace accuracy, first failing rounds and the kinds of wrong names, at D rounds."""
    m, tok, rec = run.model, run.tokenizer, run.recipe
    ex = TaskSource(rec).eval_sets(n, levels=[D])[D]
    b = encode_examples(tok, ex, rec.model.context, rec.data.separator)
    rt = round_targets(tok, ex, b, rec.data.task, rec.model.vocab_size)
    B, rows = len(ex), torch.arange(len(ex))
    with torch.no_grad():
        by_round = logits_by_rounds(m, b.x, list(range(1, D + 1)))
    want = torch.cat([rt.trace[:, :D - 1], b.y[rows, rt.first][:, None]], 1)                 # (B, D) names
    got = torch.stack([by_round[r][rows, rt.first].argmax(-1) for r in range(1, D + 1)], 1)  # (B, D)
    ok = got == want
    first_bad, kinds = collections.Counter(), collections.Counter()
    for i in range(B):
        bad = (~ok[i]).nonzero()
        if len(bad) == 0:
            continue
        r = int(bad[0])
        first_bad[r + 1] += 1
        chain = want[i].tolist()
        name = int(got[i, r])
        kinds[f"off {chain.index(name) - r:+d}" if name in chain else "other"] += 1
    return {"examples": B, "round_accuracy": [round(100 * ok[:, r].float().mean().item(), 1) for r in range(D)],
            "first_wrong_round": dict(sorted(first_bad.items())), "wrong_names": dict(kinds.most_common())}


def frozen_accuracy(run, D: int, n: int, freeze: int | None) -> float:
    """Exact match at D rounds when every position but the answer's first keeps its state after round
    `freeze` (None: the model as trained)."""
    m, tok, rec = run.model, run.tokenizer, run.recipe
    ex = TaskSource(rec).eval_sets(n, levels=[D])[D]
    b = encode_examples(tok, ex, rec.model.context, rec.data.separator)
    query = torch.zeros(b.x.shape, dtype=torch.bool)
    query[torch.arange(len(ex)), torch.tensor([p - 1 for p in b.prompt_lens])] = True
    step = m.core_step

    def held(s, e, r, rope, cache=None, *args, **kwargs):
        new = step(s, e, r, rope, cache, *args, **kwargs)
        return torch.where(query[..., None], new, s) if freeze is not None and r > freeze else new

    m.core_step = held
    try:
        with torch.no_grad():
            logits = logits_by_rounds(m, b.x, [D])[D]
    finally:
        del m.core_step
    hit = (logits.argmax(-1) == b.y) | ~b.mask
    return round(100 * hit.all(-1).float().mean().item(), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--difficulty", type=int, default=8)
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--freeze", default="1,2,3,4", help="rounds after which the other positions keep their state")
    args = ap.parse_args()
    run = looplm.load_run(args.run)
    if run.recipe.data.round_targets != "trace":
        raise SystemExit("trace_diagnosis: the run was not trained with data.round_targets = \"trace\"")
    D = args.difficulty
    t = trace_rounds(run, D, args.examples)
    print(f"{args.run}: {t['examples']} held-out examples of difficulty {D}, read out at {D} rounds")
    print("trace accuracy by round (%):", t["round_accuracy"])
    print("first wrong round (count):", t["first_wrong_round"])
    print("what a first wrong round names:", t["wrong_names"])
    print("exact match (%), other positions frozen after round F:")
    for f in [None] + [int(x) for x in args.freeze.split(",") if x]:
        print(f"  F = {'none (as trained)' if f is None else f}: {frozen_accuracy(run, D, args.examples, f)}")


if __name__ == "__main__":
    main()
