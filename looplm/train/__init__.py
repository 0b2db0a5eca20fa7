"""Training: `looplm train` end to end.

trainer.py  the loop: depth draws, backward window, supervised rounds, records, checkpoints, report
depth.py    forward-depth samplers, each a pure function of (seed, step, micro-batch), and the depth curriculum
optim.py    the optimizer (AdamW, or Muon on block matrices beside AdamW) and the learning-rate schedule
"""

from .trainer import train

__all__ = ["train"]
