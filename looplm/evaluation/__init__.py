"""Evaluation: what a trained run does, measured (the checks, which also train, sit above in looplm/checks/).

rounds.py          held-out loss by rounds (`looplm eval`, the report's val_loss_by_rounds)
early_exit.py      per-token early exit over whole sequences, exit policies and sweeps
cache_policies.py  what each prefill/decode cache policy costs in loss
tasks.py           task scoring: exact match and answer loss by difficulty x rounds
probes.py          linear probes of the loop state
"""
