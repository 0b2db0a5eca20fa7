"""Shared fixtures: tiny recipes, models and text folders so tests need no download."""

from __future__ import annotations

import pytest
import torch

import looplm

# Tiny models run fastest on one thread; more threads only contend (and crawl on a busy machine).
torch.set_num_threads(1)

TINY = {
    "model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
    "model.n_prelude": 1, "model.n_core": 2, "model.n_coda": 1,
    "depth.kind": "fixed", "depth.rounds": 3, "backward.window": "all",
    "data.seq_len": 32, "train.batch_size": 4, "train.steps": 6, "train.log_every": 2,
    "train.checkpoint_every": 3, "train.eval_batches": 2, "optim.warmup_steps": 2,
}


@torch.no_grad()
def greedy_by_full_forward(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a whole forward pass over the sequence so far (no cache): the
    reference cached decoding must equal."""
    seq, out = torch.tensor([ids]), []
    for _ in range(n):
        nxt = int(model(seq).logits[0, -1].argmax())
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([[nxt]])], 1)
    return out


def tiny_recipe(**overrides):
    return looplm.load_recipe("quickstart", overrides={**TINY, **overrides})


@pytest.fixture
def text_dir(tmp_path):
    """A folder of a few small text documents (stand-in corpus)."""
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(6):
        body = "\n".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # line {j}" for j in range(60))
        (d / f"doc{i}.py").write_text(body)
    return d


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
