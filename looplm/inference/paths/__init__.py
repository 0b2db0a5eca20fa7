"""State paths: decode features that carry state from one position to the next or rewrite what a chunk reads and
returns, each in a module of its own against one protocol (`StatePath`), so that a new path is one module, its
recipe section, its row in the capability table (capabilities.py) and its checks.

    feedback.py      full-bandwidth feedback: the previous position's top state fused into a token's input
    ../contrast.py   LoopCD-style contrastive logits: a second readout round inside the chunk
    ../recirculation.py  recirculation: a chunk's visits refined by a schedule of chunks (`Runner.run_chunk`)

What a path carries per request lives in the request's `RequestState` (request.py), so it is reset when a row
takes a new request (a fresh state), moves with the row when a batch compacts (`DecodeBatch.compact`), and
would roll back with the cache under speculation (refused for the paths that carry state, capabilities.py).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor


class StatePath(Protocol):
    """A path a batch consults around its chunks (batch.py): the prompt chunk, a decode step's inputs, and
    what the step leaves for the next position."""

    def prompt(self, batch: Any, idx: Tensor, start: int, rows: Tensor | None, cache_rows: list[int],
               scored: bool) -> tuple[Tensor, Tensor | int]:
        """Run the prompt chunk idx (rows, T) at `start` and set each row's carried state: (logits (rows, T, V),
        rounds)."""
        ...

    def inputs(self, batch: Any, rows: list[int]) -> Any:
        """What a decode step of these cache rows passes to its chunk (`run_chunk(feedback=...)`)."""
        ...

    def after(self, batch: Any, ran: list[int], rows: list[int], tops: list[Tensor]) -> None:
        """After a decode step that ran cache rows `ran`: the state `rows` (those sampled) carry to their next
        token."""
        ...
