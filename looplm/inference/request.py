"""One request's state while it is decoded: what belongs to the request, not to the batch it sits in.

A batch (batch.py) holds one `RequestState` per row and speculation (speculative.py) one for its
single row; the server's scheduler hands rows to them (scheduler.py). A row that takes a new
request gets a fresh state, so nothing of the previous request leaks into it — a feedback model's
carried top state included (each row's is its own, indexed by its row in every chunk); the batch-wide
tensors (the KV cache, the rows' initial-state noise tables, the sampler's per-row generators)
are reset by the batch when it places the request. Everything a request emits goes through
`emit`, one rule for both: count the token, extend the text, decide whether the request ends
(eos, a stop string, its max_new_tokens), hand its prompt's log-probabilities out once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .sampler import RowText, SamplingParams, TokenEvent


@dataclass
class JoinProgress:
    """A prompt being prefilled into a running batch in chunks (DecodeBatch's chunked prefill)."""

    prompt: Tensor
    """(1, L) its token ids."""
    start: int
    """The cache column of its first token."""
    done: int
    """Columns prefilled so far."""
    parts: list[tuple[int, int]]
    """(step, columns) still to run; a step is named by the batch's column count after its decode."""


@dataclass
class RequestState:
    """One request's row (see the module docstring)."""

    params: SamplingParams
    text: RowText
    done: bool = False
    """No more events: it ended, or its client went away (a placeholder row starts done)."""
    n_out: int = 0
    """Tokens emitted."""
    token: int = 0
    """The latest sampled token (emitted next, then fed back)."""
    rounds: int = 0
    """Rounds that token's position ran."""
    logprob: tuple[float, list[tuple[int, float]]] | None = None
    """That token's log-probability and the likeliest alternatives, when the params ask."""
    prompt_lp: tuple[list, list] | None = None
    """The prompt's log-probabilities (and top alternatives) so far, when the params ask."""
    prompt_carry: Tensor | None = None
    """(V,) the logits of its last prefilled column: they score the next prompt chunk's first token."""
    joining: JoinProgress | None = None
    """Set while its prompt is prefilled in chunks into a running batch."""
    mode: str = "standard"
    """Its prompt mode (a feedback model's: standard, soft or fused; SamplingParams.prompt_mode)."""
    carried: Tensor | None = None
    """Feedback: (d,) the top state of its last computed position, which its next token's input fuses."""
    after_eos: bool = False
    """Feedback: the token it fed last was end-of-text, so the next position starts plain (reset_at_eos)."""

    @classmethod
    def new(cls, params: SamplingParams, tokenizer: Any, deltas: bool, done: bool = False) -> "RequestState":
        return cls(params=params, text=RowText(tokenizer, params.stop, deltas), done=done)

    def sampled(self, token: int, rounds: int, logprob: tuple[float, list[tuple[int, float]]] | None = None) -> None:
        self.token, self.rounds, self.logprob = token, rounds, logprob

    def emit(self, row: int, eos_id: int | None) -> TokenEvent:
        """The event of the latest sampled token; the request ends on eos (when its params stop there),
        a stop string or its length."""
        sp = self.params
        self.n_out += 1
        eos = sp.stop_at_eos and eos_id is not None and self.token == eos_id
        delta, reason = self.text.add(self.token, eos, self.n_out >= sp.max_new_tokens)
        self.done = reason is not None
        lp = self.logprob if sp.logprobs is not None else None
        plp = None
        if self.n_out == 1:                     # its prompt is done: its figures go out once
            plp, self.prompt_lp, self.prompt_carry = self.prompt_lp, None, None
        return TokenEvent(row=row, token=self.token, text=delta, rounds=self.rounds, finish_reason=reason,
                          logprob=lp[0] if lp else None, top_logprobs=lp[1] if lp else None,
                          prompt_logprobs=plp[0] if plp else None, prompt_top_logprobs=plp[1] if plp else None)
