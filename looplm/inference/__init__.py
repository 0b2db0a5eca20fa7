"""Inference: the cached engine and what it is built from.

engine.py       `Engine`: prefill, decode, per-token exits, streaming; its public chunk API
batch.py        continuous batching (rows join and leave a running batch)
speculative.py  self-speculative decoding (shallow drafts verified at full depth)
cache.py        the per-round KV cache, its reuse policies and the visibility rule for exited tokens
kernels.py      the CPU backend of the model's blocks (pre-laid-out weights)
sampler.py      per-row sampling, penalties, log-probabilities, text
reference.py    the uncached reference (`--no-cache`) the engine must match
"""

from .engine import Completion, Engine, GenerationConfig, SamplingParams, TokenEvent

__all__ = ["Completion", "Engine", "GenerationConfig", "SamplingParams", "TokenEvent"]
