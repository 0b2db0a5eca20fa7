"""Reading the container formats of files users hand to looplm: JSON objects and safetensors.

Every file looplm reads may be damaged (cut short by a full disk or an interrupted copy, edited by
hand, another program's file under a familiar name). Each file kind has one reader that checks it
and raises `UserError` naming the file and what is wrong; the readers of the kinds built on JSON
or safetensors (a run's report.json, a prepared folder's manifest, a Hugging Face config.json, a
checkpoint's weights, a recirculation mixer) go through the two functions here for the container,
then check their own fields. Nothing here unpickles.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .errors import UserError


def read_json_object(path: str | Path, what: str = "a JSON object") -> dict[str, Any]:
    """The JSON object in `path`; UserError naming the file when it is missing, unreadable, not JSON or
    not an object. `what`: how the message describes the file that was expected."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: missing (expected {what})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read it as UTF-8 text ({type(err).__name__}); expected {what}") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                        f"expected {what}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: holds a JSON {type(data).__name__}, expected {what}")
    return data


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__


def safetensors_names(path: str | Path) -> tuple[list[str], dict[str, str]]:
    """(tensor names, metadata) of the safetensors file `path`, its header checked: the safetensors
    reader refuses a header that does not cover the file exactly, so a file cut short (or any other
    file under this name) is refused here, naming it, before any tensor is read."""
    from safetensors import safe_open
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: missing (expected a safetensors file)")
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys()), dict(f.metadata() or {})
    except Exception as err:     # SafetensorError (Rust), OSError: a damaged or foreign file
        raise UserError(f"{path}: not a readable safetensors file, or cut short ({_first_line(err)})") from None


def read_safetensors_tensor(path: str | Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors file whose header `safetensors_names` accepted."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)
    except Exception as err:
        raise UserError(f"{path}: tensor {name} is unreadable ({_first_line(err)})") from None


def read_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(every tensor by name, metadata) of a small safetensors file (a mixer), checked as above."""
    names, meta = safetensors_names(path)
    return {n: read_safetensors_tensor(path, n) for n in names}, meta
