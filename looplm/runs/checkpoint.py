"""Checkpoints and run folders: weights in safetensors, the rest through weights_only torch.load.

A run folder holds `recipe.toml` (the resolved recipe) and `checkpoint/` with
`model.safetensors`, the tokenizer files and `state.pt` (optimizer, step, counters, sampler
coverage). Nothing here unpickles arbitrary objects.

A checkpoint is whole or absent. `save_checkpoint` writes a complete new folder
`checkpoint.next/` (every file fsynced), then renames `checkpoint/` to `checkpoint.prev/` and
`checkpoint.next/` to `checkpoint/`, then deletes the old one. A kill at any point leaves either
the old folder in place (with a partial `.next` beside it) or both whole folders renamed;
`repair_checkpoint` (run before a resume) finishes or discards the interrupted swap. Single
files (recipe.toml, metrics, the report) are written atomically (temp file, fsync, rename).

Multi-process runs save the same format: rank 0 gathers the full weights and optimizer state
(`torch.distributed.checkpoint.state_dict`) and writes them, so a run trained on N processes
resumes on any number, and `load_run`, eval and serve read it without torch.distributed. The
price is one full copy of the weights and optimizer state in rank 0's host memory at a save
(docs/distributed.md says when sharded DCP checkpoints would be the better choice).

state.pt carries CHECKPOINT_VERSION; loading refuses a newer one. Version 1 keyed the optimizer
state by parameter index; version 2 keys it by parameter name (the same at every world size
and sharding); `optimizer_state_for` reads both. A recipe.toml from an older looplm may lack
fields added since: they take their defaults, each logged and kept on the Run.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_model, save_model

from ..recipe.config import Recipe, dump_toml, filled_defaults, inapplicable, read_recipe_dict, recipe_from_dict
from ..errors import UserError

CHECKPOINT_VERSION = 2
"""Bump when state.pt or model.safetensors change in a way older code would misread.
2: the optimizer state is keyed by parameter name (1: by index)."""

log = logging.getLogger(__name__)


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, model: torch.nn.Module, state: dict[str, Any]) -> None:
    """checkpoint/ replaced whole: the weights of `model` (a plain module), `state` (+ version) and
    the files already in checkpoint/ (tokenizer) go to checkpoint.next/, which is swapped in."""
    import shutil
    run_dir = Path(run_dir)
    ckpt, nxt, prev = (run_dir / n for n in ("checkpoint", "checkpoint.next", "checkpoint.prev"))
    repair_checkpoint(run_dir)
    nxt.mkdir(parents=True)
    if ckpt.is_dir():
        for f in ckpt.iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "state.pt"):
                shutil.copy2(f, nxt / f.name)
    save_model(model, str(nxt / "model.safetensors"))
    torch.save({**state, "version": CHECKPOINT_VERSION}, nxt / "state.pt")
    for f in nxt.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(nxt)
    if ckpt.exists():
        ckpt.rename(prev)
    nxt.rename(ckpt)                  # from here on the new checkpoint is the run's
    _fsync_dir(run_dir)
    if prev.exists():
        shutil.rmtree(prev)


def repair_checkpoint(run_dir: Path) -> None:
    """Finish or discard a checkpoint swap that a kill interrupted (see the module docstring):
    checkpoint.next/ beside checkpoint.prev/ with no checkpoint/ is whole (it was complete before
    the first rename), so it is moved in; a checkpoint.next/ beside checkpoint/ was never finished."""
    import shutil
    run_dir = Path(run_dir)
    ckpt, nxt, prev = (run_dir / n for n in ("checkpoint", "checkpoint.next", "checkpoint.prev"))
    if not ckpt.exists() and prev.exists() and nxt.exists():
        nxt.rename(ckpt)
    if nxt.exists():
        shutil.rmtree(nxt)
    if prev.exists():
        if ckpt.exists():
            shutil.rmtree(prev)
        else:
            prev.rename(ckpt)


def optimizer_state_for(state: dict[str, Any], version: int, names: list[str]) -> dict[str, Any]:
    """The saved optimizer state keyed by parameter name (what `torch.distributed.checkpoint.
    state_dict.set_optimizer_state_dict` takes). names: the optimizer's parameters in order (a
    version-1 checkpoint keyed them by that index)."""
    if version >= 2:
        return state
    def name(i: int) -> str:
        return names[i]
    return {"state": {name(i): v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [name(i) for i in g["params"]]} for g in state["param_groups"]]}


def optimizer_state_by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A name-keyed optimizer state as `torch.optim.Optimizer.load_state_dict` takes it (index-keyed,
    in the order `names` of the optimizer's parameters)."""
    index = {n: i for i, n in enumerate(names)}
    missing = [n for g in state["param_groups"] for n in g["params"] if n not in index]
    if missing:
        raise UserError(f"checkpoint optimizer state names parameters this model lacks: {missing[:3]}")
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def load_state(run_dir: Path, mmap: bool = False) -> dict[str, Any]:
    """RUN/checkpoint/state.pt, refused unless its version is one this code reads. mmap leaves the
    tensors (optimizer moments) on disk until touched, for callers that only need the version."""
    path = Path(run_dir) / "checkpoint" / "state.pt"
    try:
        state = torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except FileNotFoundError:
        raise UserError(f"run {run_dir}: no checkpoint/state.pt (was the run finished?)") from None
    except Exception as err:  # corrupt or not a weights-only file
        raise UserError(f"run {run_dir}: checkpoint/state.pt is unreadable ({type(err).__name__})") from None
    version = state.get("version") if isinstance(state, dict) else None
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise UserError(f"run {run_dir}: checkpoint/state.pt has no valid version ({version!r}); "
                        "it was not written by looplm")
    if version > CHECKPOINT_VERSION:
        raise UserError(f"run {run_dir}: checkpoint version {version} is newer than this looplm reads "
                        f"(up to {CHECKPOINT_VERSION}); upgrade looplm to load it")
    return state


def load_run_recipe(run_dir: Path) -> tuple[Recipe, dict[str, Any]]:
    """RUN/recipe.toml as a Recipe, and the fields it lacked (dotted key -> default filled in),
    each logged as a warning: a run from an older looplm then says what it was assumed to use."""
    data = read_recipe_dict(str(Path(run_dir) / "recipe.toml"))
    for item in inapplicable(data):   # written out by a looplm that did not yet refuse it; never read
        if item.key == "exit.gate":     # its weights are in the checkpoint, but no loss ever trained them
            raise UserError(f"run {run_dir}: recipe.toml has exit.gate = true where {item.message.split(';')[0]}: "
                            "its gate never received gradient (an older looplm trained it so); retrain with "
                            "supervision.kind = \"learned_exit\", or train the gate with looplm train --stage2")
        section, name = item.key.split(".")
        value = data[section].pop(name)
        log.warning(f"run {run_dir}: recipe.toml sets {item.key} = {value!r}, which {item.message.split(';')[0]} "
                    "(nothing read it); using the default")
    try:
        recipe = recipe_from_dict(data)
    except UserError as err:     # a damaged or hand-edited recipe.toml: name the file, not only the field
        raise UserError(f"{Path(run_dir) / 'recipe.toml'}: {err}") from None
    filled = filled_defaults(data, recipe)
    for key, value in filled.items():
        shown = dump_toml({key: list(value) if isinstance(value, tuple) else value}).strip()
        log.warning(f"run {run_dir}: recipe.toml has no {key} (older looplm); using the default {shown}")
    return recipe, filled


def load_weights(run_dir: Path, model: torch.nn.Module, allow_missing: tuple[str, ...] = ()) -> list[str]:
    """Load RUN/checkpoint/model.safetensors into `model`, refusing a damaged file (its header checked
    first: files.safetensors_names) and any mismatch with the recipe. allow_missing: module prefixes
    (`"gate."`, `"adapter."`, ...) that may be absent from the file as a whole: a module the recipe adds to
    the run it starts from (`train --init` switching on concat injection, stage II's exit gate) keeps its
    initialisation. A module the file holds only in part is refused. Returns the prefixes that started fresh."""
    from ..files import safetensors_names
    path = Path(run_dir) / "checkpoint" / "model.safetensors"
    if not path.is_file():
        raise UserError(f"run {run_dir}: missing checkpoint/model.safetensors")
    stored, _ = safetensors_names(path)
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except Exception as err:      # shapes that disagree with the recipe's model
        raise UserError(f"run {run_dir}: checkpoint/model.safetensors does not match the recipe "
                        f"({type(err).__name__}: {str(err).strip().splitlines()[0][:200]})") from None
    fresh = [p for p in allow_missing if any(k.startswith(p) for k in missing)
             and not any(k.startswith(p) for k in stored)]
    missing = [k for k in missing if not k.startswith(tuple(fresh))]
    if missing or unexpected:
        raise UserError(f"run {run_dir}: weights do not match the recipe (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")
    return fresh


def read_report(run_dir: Path) -> dict[str, Any]:
    """RUN/report.json as a dict ({} when the run has none yet: an unfinished or imported run); UserError
    naming it when it is damaged. The one reader of a run's report."""
    from ..files import read_json_object
    path = Path(run_dir) / "report.json"
    if not path.exists():
        return {}
    return read_json_object(path, "a looplm run report")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """RUN/metrics.jsonl's rows ([] when there is none), each a JSON object with an integer "step";
    UserError naming the file and line otherwise. A last line without its newline is one a kill cut
    short while the trainer wrote it: left out (a resumed run logs that step again). The one reader of
    a run's metrics."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read it as UTF-8 text ({type(err).__name__})") from None
    lines = text.split("\n")
    lines.pop()                           # "" after the final newline, or the torn row a kill left
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}, line {n}: not valid JSON ({err.msg}); expected one metrics row per line") from None
        if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
            raise UserError(f"{path}, line {n}: expected a JSON object with an integer \"step\"")
        rows.append(row)
    return rows


@dataclass
class Run:
    """A trained run, loaded: `looplm.load_run(path)`."""

    path: Path
    recipe: Recipe
    model: torch.nn.Module
    tokenizer: Any
    report: dict[str, Any]
    version: int = CHECKPOINT_VERSION
    """The checkpoint format version the run was saved with."""
    filled_defaults: dict[str, Any] = field(default_factory=dict)
    """Recipe fields missing from the run's recipe.toml (written by an older looplm) -> the default used."""


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Inference precisions (`--dtype`): the weights cast once at load; fp32, the weights as trained or imported,
is the default and the exact one."""


def load_run(path: str | Path, device: str | torch.device | None = "cpu", dtype: str = "fp32") -> Run:
    """A run folder, loaded for use: the model in eval mode on `device` (cpu by default; "auto" = cuda
    when available; see device.resolve_device), its weights in `dtype` (DTYPES)."""
    from ..device import resolve_device
    from ..model.looped import build_model
    from ..data.tokenizer import load_tokenizer

    run_dir = Path(path)
    if not run_dir.is_dir():
        raise UserError(f"run {run_dir}: no such folder")
    if not (run_dir / "recipe.toml").is_file():
        raise UserError(f"run {run_dir}: missing recipe.toml (not a looplm run folder)")
    # version first: a newer run's recipe may hold keys this code does not know
    version = load_state(run_dir, mmap=True)["version"]
    recipe, filled = load_run_recipe(run_dir)
    model = build_model(recipe)
    load_weights(run_dir, model)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    model.eval().to(resolve_device(device), DTYPES[dtype])
    tokenizer = load_tokenizer(run_dir / "checkpoint")
    report = read_report(run_dir)
    return Run(path=run_dir, recipe=recipe, model=model, tokenizer=tokenizer, report=report,
               version=version, filled_defaults=filled)
