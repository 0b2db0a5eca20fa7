"""A golden loss curve: the quickstart recipe, shrunk to a few CPU seconds, must train to the
same per-step losses as when the numbers below were recorded.

Anything that changes training numerics moves the curve: initialisation, the depth sampler,
the backward window, the data windows, the loss, the optimizer or its schedule, gradient
clipping. The recipe keeps quickstart's sampled depth (log-normal Poisson), truncated backward
(window 3) and random initial state, so those paths are covered too. The corpus is written here
(not the default stdlib corpus, which differs between Python versions) and train.threads = 1, so
reductions run in one fixed order: the curve is reproducible run to run and machine to machine
(up to float rounding between CPU kernels, far inside the tolerance).

If a change is MEANT to alter training (a new default, a fixed bug), regenerate the numbers
deliberately and say so in the commit:

    python tests/test_golden.py          # prints GOLDEN = [...]; paste it below

A change that moves the curve without meaning to is what this test is for.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import looplm
from looplm.runs.checkpoint import load_state
from looplm.train.trainer import train

OVERRIDES = {
    "model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
    "data.seq_len": 32, "data.max_bytes": 4000, "train.batch_size": 4, "train.steps": 12,
    "train.log_every": 1, "train.checkpoint_every": 12, "train.eval_batches": 1, "train.threads": 1,
    "optim.warmup_steps": 3,
}

# per-step training losses, recorded with `python tests/test_golden.py` (re-recorded 2026-12-03 when the
# quickstart's default injection became decay)
GOLDEN = [
    5.567439556121826,
    5.508547306060791,
    5.394345283508301,
    5.499203681945801,
    5.529623508453369,
    5.020355224609375,
    5.053889751434326,
    4.815295696258545,
    4.768815040588379,
    4.709052085876465,
    4.687671184539795,
    4.588588714599609,
]
RTOL = 1e-4


def write_corpus(folder: Path) -> Path:
    """Six small deterministic documents of Python-like text (about 1.1 KB each)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        body = "\n".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # line {j}" for j in range(24))
        (folder / f"doc{i}.py").write_text(body)
    return folder


def golden_run(tmp: Path) -> tuple[list[float], list[float]]:
    """Train the shrunk recipe into tmp: (losses from metrics.jsonl, losses kept in the checkpoint)."""
    corpus = write_corpus(tmp / "corpus")
    recipe = looplm.load_recipe("quickstart", overrides={**OVERRIDES, "data.path": str(corpus)})
    threads = torch.get_num_threads()
    try:
        train(recipe, tmp / "run", quiet=True)
    finally:
        torch.set_num_threads(threads)                # train.threads is process-wide; leave it as found
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    state = load_state(tmp / "run")
    return [r["loss"] for r in rows], state["counters"]["losses"].tolist()


def test_the_shrunk_quickstart_recipe_trains_to_the_golden_loss_curve(tmp_path):
    logged, kept = golden_run(tmp_path)
    assert logged == kept                                  # metrics.jsonl and the checkpoint agree
    assert len(GOLDEN) == OVERRIDES["train.steps"]
    for step, (got, want) in enumerate(zip(logged, GOLDEN)):
        assert got == pytest.approx(want, rel=RTOL), f"step {step}: loss {got!r}, golden {want!r}"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        losses, _ = golden_run(Path(d))
    print("GOLDEN = [\n" + "".join(f"    {x!r},\n" for x in losses) + "]", file=sys.stdout)
