"""TensorBoard scalars beside metrics.jsonl (`train.tensorboard = true`).

The trainer writes each metrics.jsonl row here too, flattened into scalars under the same names,
so what TensorBoard plots is exactly what the run folder records: `loss`, `lr`, `grad_norm`,
`tokens_per_s`, the loss terms, `state_rms/round_3`, `update_rms/round_3`, `grad_rms/round_3`
(absent for rounds before the backward window, which receive no gradient), `update_ratio/core.…`,
`alignment/ratio`, `round_losses/4`, …, at the row's step; after training, `val_loss/rounds_R`.
Event files go to RUN/tensorboard/ (`tensorboard --logdir RUN/tensorboard`). Needs the optional
`tensorboard` package (`pip install 'looplm[tensorboard]'`), checked before training starts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

from ..errors import UserError

PER_ROUND = ("state_rms", "update_rms", "grad_rms")
"""metrics.jsonl lists indexed by round (entry i is round i + 1)."""


def require_tensorboard() -> None:
    """Refuse `train.tensorboard = true` up front when the package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise UserError("train.tensorboard = true needs the tensorboard package: "
                        "pip install 'looplm[tensorboard]' (or set train.tensorboard = false)") from None


def scalars(row: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite number in a metrics row, nested names joined by "/"; None,
    booleans, strings and non-finite values are left out."""
    for key, value in row.items():
        if key == "step" and not prefix:
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                yield tag, float(value)
        elif isinstance(value, dict):
            yield from scalars(value, f"{tag}/")
        elif isinstance(value, (list, tuple)):
            name = "round_{}" if key in PER_ROUND and not prefix else "{}"
            offset = 1 if key in PER_ROUND and not prefix else 0
            yield from scalars({name.format(i + offset): v for i, v in enumerate(value)}, f"{tag}/")


class TensorBoardLog:
    """A SummaryWriter on RUN/tensorboard/; `write(row)` logs one metrics.jsonl row at its step.
    resume_step: a resumed run continues from this step, and TensorBoard drops what an
    interrupted run had logged from it on (as metrics.jsonl is truncated there)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        require_tensorboard()
        self.reopen(run_dir, resume_step)

    def reopen(self, run_dir: Path, resume_step: int | None = None) -> None:
        """A new writer on RUN/tensorboard/ (a new run folder moved into place at its first checkpoint:
        the writer reaches its event file by path, so the earlier one is closed before the move)."""
        from torch.utils.tensorboard import SummaryWriter
        self.path = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.path), purge_step=resume_step)

    def write(self, row: dict[str, Any], step: int | None = None) -> None:
        step = row["step"] if step is None else step
        for tag, value in scalars(row):
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
