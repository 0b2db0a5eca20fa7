"""Evaluation: what a trained run does, measured.

rounds.py          held-out loss by rounds (`looplm eval`, the report's val_loss_by_rounds)
early_exit.py      per-token early exit over whole sequences, exit policies and sweeps
cache_policies.py  what each prefill/decode cache policy costs in loss
checks.py          the seeds' checks before claiming a saving (`looplm check`)
probes.py          linear probes of the loop state
"""
