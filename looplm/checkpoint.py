"""Checkpoints and run folders: weights in safetensors, the rest through weights_only torch.load.

A run folder holds `recipe.toml` (the resolved recipe) and `checkpoint/` with
`model.safetensors`, the tokenizer files and `state.pt` (optimizer, step, counters, sampler
coverage). Every file is written atomically (temp file, fsync, rename) so a run killed
mid-write leaves the previous checkpoint intact. Nothing here unpickles arbitrary objects.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_model, save_model

from .config import Recipe, load_recipe
from .errors import UserError

CHECKPOINT_VERSION = 1


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(tmp_path), fsync it, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path: Path, text: str) -> None:
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text))


def save_checkpoint(run_dir: Path, model: torch.nn.Module, state: dict[str, Any]) -> None:
    ckpt = Path(run_dir) / "checkpoint"
    atomic_write(ckpt / "model.safetensors", lambda tmp: save_model(model, tmp))
    state = {**state, "version": CHECKPOINT_VERSION}
    atomic_write(ckpt / "state.pt", lambda tmp: torch.save(state, tmp))


def load_state(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "checkpoint" / "state.pt"
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise UserError(f"run {run_dir}: no checkpoint/state.pt (was the run finished?)") from None
    except Exception as err:  # corrupt or not a weights-only file
        raise UserError(f"run {run_dir}: checkpoint/state.pt is unreadable ({type(err).__name__})") from None


def load_weights(run_dir: Path, model: torch.nn.Module, allow_missing: str | None = None) -> None:
    """Load RUN/checkpoint/model.safetensors into `model`, refusing any mismatch. Parameters whose
    names start with `allow_missing` (the exit gate, when stage II starts from a run without one)
    may be absent and keep their initialisation."""
    path = Path(run_dir) / "checkpoint" / "model.safetensors"
    if not path.is_file():
        raise UserError(f"run {run_dir}: missing checkpoint/model.safetensors")
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except Exception as err:
        raise UserError(f"run {run_dir}: checkpoint/model.safetensors is unreadable or does not match "
                        f"the recipe ({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None
    missing = [k for k in missing if not (allow_missing and k.startswith(allow_missing))]
    if missing or unexpected:
        raise UserError(f"run {run_dir}: weights do not match the recipe (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")


@dataclass
class Run:
    """A trained run, loaded: `looplm.load_run(path)`."""

    path: Path
    recipe: Recipe
    model: torch.nn.Module
    tokenizer: Any
    report: dict[str, Any]


def load_run(path: str | Path) -> Run:
    from .model import build_model
    from .tokenizer import load_tokenizer

    run_dir = Path(path)
    if not run_dir.is_dir():
        raise UserError(f"run {run_dir}: no such folder")
    if not (run_dir / "recipe.toml").is_file():
        raise UserError(f"run {run_dir}: missing recipe.toml (not a looplm run folder)")
    recipe = load_recipe(str(run_dir / "recipe.toml"))
    model = build_model(recipe)
    load_weights(run_dir, model)
    model.eval()
    tokenizer = load_tokenizer(run_dir / "checkpoint")
    report = {}
    if (run_dir / "report.json").is_file():
        try:
            report = json.loads((run_dir / "report.json").read_text())
        except json.JSONDecodeError:
            raise UserError(f"run {run_dir}: report.json is not valid JSON") from None
    return Run(path=run_dir, recipe=recipe, model=model, tokenizer=tokenizer, report=report)
