"""Plain sampling without a cache: the slow reference that cached decoding must match.

Each new token reruns the whole sequence through prelude, every round and coda. A random
initial state comes from the same position-indexed noise table (seeded by --seed) that the
cached engine uses, so the two agree token for token.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..errors import UserError
from ..model.looped import initial_noise_table
from .sampler import positions_run


def sample_next(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) -> (B,) token ids; temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_text(run: Any, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
                  rounds: int | None = None) -> dict[str, Any]:
    model, tok = run.model, run.tokenizer
    rounds = rounds or run.recipe.depth.rounds
    if max_new_tokens < 0:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be >= 0")
    if temperature < 0:
        raise UserError(f"--temperature {temperature}: must be >= 0")
    if rounds < 1:
        raise UserError(f"--rounds {rounds}: must be >= 1")
    ids = tok.encode(prompt)
    if not ids:
        raise UserError("--prompt: must not be empty")
    ctx = model.cfg.context
    if positions_run(len(ids), max_new_tokens) > ctx:
        raise UserError(f"--prompt: {len(ids)} prompt tokens + {max_new_tokens} new tokens exceed the context of {ctx} "
                        "(positions run: prompt + new tokens - 1)")
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    noise = (initial_noise_table(model.cfg, seed)[None].to(device) if model.cfg.init_state == "random"
             else None)                                                                          # (1, ctx, d)

    def forward(seq: torch.Tensor):
        s0 = None if noise is None else noise[:, :seq.shape[1]]
        return model(seq, rounds, initial_state=s0)

    seq = torch.tensor([ids], device=device)
    t0 = time.perf_counter()
    forward(seq)
    prefill_s = time.perf_counter() - t0
    new: list[int] = []
    t1 = time.perf_counter()
    for _ in range(max_new_tokens):
        logits = forward(seq).logits[:, -1]
        nxt = sample_next(logits, temperature, g)
        new.append(int(nxt))
        seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
        if int(nxt) == tok.eos_id:
            break
    decode_s = time.perf_counter() - t1
    return {"text": tok.decode(new), "tokens": new, "rounds_used": [rounds] * len(new),
            "prefill_tokens_per_s": len(ids) / max(prefill_s, 1e-9),
            "decode_tokens_per_s": len(new) / max(decode_s, 1e-9)}
