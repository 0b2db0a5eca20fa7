"""Where a model runs, and how it is wrapped for speed — applied from outside the model.

The model never chooses a device, a precision or a compiler: the trainer, engine and CLI ask
this module (as torchtitan's parallelize step does), so the eager module stays the reference
that every backend is compared against.

    device = resolve_device("auto")          # cuda when torch sees one, else cpu
    with autocast(device, "bf16"): ...       # mixed precision; weights stay fp32
    scaler = grad_scaler(device, "fp16")     # loss scaling, only for fp16
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from .errors import UserError

DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """A torch.device for `auto`/`cpu`/`cuda`/`cuda:N`/`mps`; a device torch cannot see is bad input."""
    if isinstance(name, torch.device):
        return name
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind = name.split(":", 1)[0]
    if kind not in DEVICES[1:]:
        raise UserError(f"--device {name!r}: expected one of {', '.join(DEVICES)} (or cuda:N)")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: torch sees no CUDA device here (torch {torch.__version__}); use cpu or auto")
    if kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UserError(f"--device {name}: the MPS backend is not available here; use cpu or auto")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r}: not a device name torch understands") from None
    if kind == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (cpu for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def autocast(device: torch.device, precision: str) -> Any:
    """Autocast for the forward pass at `precision` (fp32: no autocast)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """fp16 needs loss scaling (its exponent range underflows small gradients); bf16 and fp32 do not:
    the scaler is then a no-op that passes the loss and step through."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def compiled(model: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    """torch.compile around the model for training (the module itself, and so its state dict, is unchanged)."""
    return torch.compile(model) if enabled else model


def peak_device_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated accelerator memory since start (None on cpu, where peak RSS is the measure)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None
