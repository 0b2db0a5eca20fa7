"""Inference: the cached engine and what it is built from.

engine.py       `Engine`: the public facade (from_run, generate, stream, batch, prompt_logprobs)
runner.py       `Runner`: what a decode is set up with, and its chunks (fixed depth, per-token exits)
capabilities.py which decode features combine: one table the engine, CLI and server consult
batch.py        continuous batching (rows join and leave a running batch)
depth.py        continuous depth batching (every step one round of every token in flight, rows refilled)
loopstate.py    the tokens in flight inside the loop, kept between steps
contrast.py     LoopCD-style contrastive logits
paths/          state paths against one protocol (StatePath): feedback.py (full-bandwidth feedback's decode side)
options.py      the decode flags of generate, eval and serve, generated from the typed options
speculative.py  self-speculative decoding (shallow drafts verified at full depth)
cache.py        the per-round KV cache, its reuse policies and the visibility rule for exited tokens
kernels.py      the CPU backend of the model's blocks (pre-laid-out weights)
sampler.py      per-row sampling, penalties, log-probabilities, text
reference.py    the uncached reference (`--no-cache`) the engine must match
"""

from .engine import Completion, Engine, GenerationConfig, SamplingParams, TokenEvent

__all__ = ["Completion", "Engine", "GenerationConfig", "SamplingParams", "TokenEvent"]
