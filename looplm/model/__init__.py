"""The looped model: what runs, round by round.

blocks.py      the transformer block, written once over an `Ops` backend (EAGER = plain PyTorch)
looped.py      prelude -> shared core x R -> coda -> head; LoopOutput; parameter and FLOP accounting
recurrence.py  `unroll`, the one recurrence (forward depth, backward window, readouts)
losses.py      per-token losses and loss placement (which rounds are supervised, with what weights)
lstm.py        the LSTM baseline of the extrapolation experiment
"""

from .blocks import EAGER, Ops
from .looped import LoopedLM, LoopOutput, build_model, deeploop_scales, initial_noise_table
from .recurrence import Unrolled, unroll

__all__ = ["EAGER", "LoopOutput", "LoopedLM", "Ops", "Unrolled", "build_model", "deeploop_scales",
           "initial_noise_table", "unroll"]
