"""Training: `looplm train` end to end.

trainer.py  the loop: depth draws, backward window, supervised rounds, records, checkpoints, report
depth.py    forward-depth samplers, each a pure function of (seed, step, micro-batch)
"""

from .trainer import train

__all__ = ["train"]
