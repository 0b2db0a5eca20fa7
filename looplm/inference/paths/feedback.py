"""Full-bandwidth feedback's decode side (model/feedback.py has the fusion): a `StatePath` for DecodeBatch.

A feedback model's token reads the previous position's top state (after the final norm) fused into its input.
What a request carries (`RequestState.carried`, `after_eos`) is set by the prompt chunk and by every decode step
and read by the next step's inputs. Prompt modes (`SamplingParams.prompt_mode`): standard rows never fuse; soft
rows read the prompt plainly and fuse from its last position on; fused rows run a second prefill pass whose
inputs fuse pass 1's top states shifted by one position, rewriting their cache entries.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class FeedbackPath:
    """Feedback's prompt pass(es), decode inputs and carried state (see the module docstring)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.reset_at_eos = engine.model.feedback_cfg.reset_at_eos

    def prompt(self, batch: Any, idx: Tensor, start: int, rows: Tensor | None, cache_rows: list[int],
               scored: bool) -> tuple[Tensor, Tensor | int]:
        """Pass 1 reads the prompt plainly (standard and soft rows end here); fused rows run a second pass whose
        inputs fuse pass 1's top states shifted by one position. Each soft or fused row carries its last
        position's top state into its first generated token. Returns (logits (rows, T, V), rounds)."""
        from ...model.feedback import plain_positions, shift_states
        e, dev = self.engine, idx.device
        reqs = [batch.requests[b] for b in cache_rows]
        fused = [j for j, r in enumerate(reqs) if r.mode == "fused"]
        tops: list[Tensor] = []
        logits, used = e.run_chunk(idx, start, batch.cache, phase="prefill", noise=batch.noise, rows=rows,
                                   all_logits=scored or bool(fused), work=batch.work, tops=tops)
        top = tops[-1]                                                          # (rows, T, d)
        if fused:
            sel = torch.tensor(fused, device=dev)
            cache_sel = torch.tensor([cache_rows[j] for j in fused], device=dev)
            x = idx[sel]
            # plain: a row's first real column (left padding before it) and, with reset_at_eos, after an eos
            first = (start + torch.arange(x.shape[1], device=dev)) <= batch.cache.pad[cache_sel].unsqueeze(-1)
            plain = plain_positions(x, batch.eos, self.reset_at_eos) | first
            again: list[Tensor] = []
            lg2, _ = e.run_chunk(x, start, batch.cache, phase="prefill", noise=batch.noise, rows=cache_sel,
                                 all_logits=True, work=batch.work, feedback=(shift_states(top[sel]), plain),
                                 tops=again)
            logits, top = logits.clone(), top.clone()
            logits[sel], top[sel] = lg2, again[-1]
        for j, req in enumerate(reqs):
            req.carried = top[j, -1]
            req.after_eos = self.reset_at_eos and batch.eos is not None and int(idx[j, -1]) == batch.eos
        return logits, used

    def inputs(self, batch: Any, rows: list[int]) -> tuple[Tensor, Tensor]:
        """A decode step's feedback for `rows`: each row's carried top state (B', 1, d) and whether it reads its
        plain embedding instead (B', 1): standard rows always, a row with nothing carried, and with
        reset_at_eos the token after an end-of-text token."""
        p = next(self.engine.model.parameters())
        zero = torch.zeros(self.engine.cfg.d_model, device=p.device, dtype=p.dtype)
        reqs = [batch.requests[b] for b in rows]
        h = torch.stack([r.carried if r.carried is not None else zero for r in reqs]).unsqueeze(1)
        plain = torch.tensor([[r.mode == "standard" or r.carried is None or r.after_eos] for r in reqs],
                             device=p.device)
        return h, plain

    def after(self, batch: Any, ran: list[int], rows: list[int], tops: list[Tensor]) -> None:
        """Each sampled row that ran carries this position's top state to its next token."""
        keep = set(rows)
        for j, b in enumerate(ran):
            if b in keep:
                req = batch.requests[b]
                req.carried = tops[-1][j, -1]
                req.after_eos = self.reset_at_eos and batch.eos is not None and req.token == batch.eos
