"""Shared fixtures: tiny recipes, models and text folders so tests need no download."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import looplm

# Tiny models run fastest on one thread; more threads only contend (and crawl on a busy machine). The suite
# passes at any count: LOOPLM_TEST_THREADS=2 python -m pytest -q runs it at two.
torch.set_num_threads(int(os.environ.get("LOOPLM_TEST_THREADS", "1")))

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


@torch.no_grad()
def answer_scores(model, tok, examples, rounds: int, separator: bool) -> tuple[float, float]:
    """(exact match, mean answer-token loss) over task examples, scored one example at a time (no
    padding): the logits from the last prompt position on must predict the answer and its newline.
    A model without rounds (the LSTM) returns its logits directly; a looped one runs `rounds` rounds."""
    from looplm.data.tasks import ANSWER_END, SEPARATOR
    from looplm.model.lstm import LSTMLM
    hits, loss, tokens = 0, 0.0, 0
    for ex in examples:
        p = tok.encode(ex.prompt + (SEPARATOR if separator else ""))
        a = torch.tensor(tok.encode(ex.answer + ANSWER_END))
        x = torch.tensor([p + a.tolist()[:-1]])
        out = model(x) if isinstance(model, LSTMLM) else model(x, rounds).logits
        logits = out[0, len(p) - 1:]
        hits += int(torch.equal(logits.argmax(-1), a))
        loss += torch.nn.functional.cross_entropy(logits, a, reduction="sum").item()
        tokens += len(a)
    return hits / len(examples), loss / tokens


def tiny_recipe(**overrides):
    merged = {**TINY, **overrides}
    if merged.get("data.task"):       # task data is as long as its prompts (no data.seq_len) and scored by
        merged.pop("data.seq_len")    # held-out examples (no train.eval_batches)
        merged.pop("train.eval_batches", None)
    return looplm.load_recipe("quickstart", overrides=merged)


def write_corpus(d):
    """A folder of a few small text documents (stand-in corpus) at d, created here."""
    d.mkdir()
    for i in range(6):
        body = "\n".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # line {j}" for j in range(60))
        (d / f"doc{i}.py").write_text(body)
    return d


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The tiniest trained run, shared by the files that only read it (recirculate, contrast): 1 prelude, 3 rounds
    x 2 core blocks, 1 coda block (8 visits), 2 steps; tests write their own outputs elsewhere (--out)."""
    from looplm.train.trainer import train
    root = tmp_path_factory.mktemp("tiny-run")
    train(tiny_recipe(**{"data.path": str(write_corpus(root / "corpus")), "train.steps": 2, "model.init_std": 0.3,
                         "train.checkpoint_every": 2}), root / "run", quiet=True)
    return root / "run"


def cli(capsys, *argv):
    """(exit code, stdout, stderr) of `looplm ARGV` run in this process."""
    from looplm.cli import main
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def text_dir(tmp_path):
    """A folder of a few small text documents (stand-in corpus)."""
    return write_corpus(tmp_path / "corpus")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@contextlib.contextmanager
def uvicorn_in_thread(app, **options):
    """`app` served by uvicorn (with these Config options) in a daemon thread on a free port of 127.0.0.1:
    the port, until the block ends and the server stops."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start within 30 s")
            time.sleep(0.02)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def save_untrained_run(path, overrides=None):
    """A run folder at `path` holding an untrained quickstart model (TINY unless `overrides`) and the byte
    tokenizer: enough for the commands that load a run (serve, generate) when training is beside the point."""
    from looplm.data.tokenizer import ByteTokenizer
    from looplm.runs.checkpoint import save_checkpoint, write_text
    recipe = looplm.load_recipe("quickstart", overrides=TINY if overrides is None else overrides)
    save_checkpoint(path, looplm.build_model(recipe), {"step": 0})
    ByteTokenizer().save(path / "checkpoint")
    write_text(path / "recipe.toml", recipe.to_toml())
    return path


def random_hf_model(cls, cfg):
    """A transformers model of class `cls` and config `cfg`, seed 0, in eval mode, its norms and biases moved away
    from their 1 / 0 initialisation (an import that dropped or misplaced one would otherwise go unseen)."""
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model
