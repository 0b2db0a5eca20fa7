"""Runs and servers for the benchmark scripts: a recipe trained or left untrained in a temp
folder, and a real `looplm serve` process."""

from __future__ import annotations

import contextlib
import os
import tempfile
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import torch

import looplm
from looplm.runs.checkpoint import save_checkpoint, write_text
from looplm.data.tokenizer import ByteTokenizer


def untrained_run(folder: Path, recipe: str = "quickstart") -> Path:
    """The recipe's initial weights saved as a run (speed and serving do not depend on training)."""
    r = looplm.load_recipe(recipe)
    torch.manual_seed(0)
    save_checkpoint(folder, looplm.build_model(r), {"step": 0})
    ByteTokenizer().save(folder / "checkpoint")
    write_text(folder / "recipe.toml", r.to_toml())
    return folder


def trained_run(recipe: str, overrides: dict, prefix: str, log: Callable[..., None]
                ) -> tuple[str, tempfile.TemporaryDirectory]:
    """The recipe trained into a temp folder (its path, and the folder: gone when that is cleaned
    up or collected)."""
    from looplm.train.trainer import train

    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    path = str(Path(tmp.name) / recipe)
    log(f"training {recipe} into {path} ...")
    train(looplm.load_recipe(recipe, overrides), path, quiet=True)
    return path, tmp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(run: Path, log_path: Path, threads: int, *flags: str) -> Iterator[tuple[str, int]]:
    """`looplm serve RUN --port P --threads N FLAGS` on 127.0.0.1 until the block ends: (base URL, pid)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "looplm", "serve", str(run), "--port", str(port),
                                 "--threads", str(threads), *flags], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not come up: see {log_path}")
                time.sleep(0.2)
            yield base, proc.pid
        finally:
            proc.terminate()
            proc.wait(timeout=15)


def extrapolate_on(overrides: dict, out: Path, seeds: str) -> int:
    """`looplm experiment extrapolate` with the built-in `extrapolate` recipe and `overrides`, on seeds
    "0,1,2": the per-seed verdicts on stdout, the wall time on stderr."""
    from looplm.experiments.extrapolate import run_extrapolate, summary_lines

    recipe = looplm.load_recipe("extrapolate", overrides)
    t0 = time.perf_counter()
    result = run_extrapolate(recipe, out, seeds=[int(s) for s in seeds.split(",")])
    print("\n".join(summary_lines(result)))
    print(f"wall time {(time.perf_counter() - t0) / 60:.1f} min", file=sys.stderr)
    return 0
