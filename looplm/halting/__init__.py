"""Halting: when a token stops looping.

hazards.py     exit hazards <-> exit masses <-> CDF, learned-exit losses (Ouro, PonderNet), ACT's
               mixture, the Stage II gate loss: pure tensor maths over a trailing round dimension
controller.py  the inference-time exit policies and the one early-exit controller every path asks
"""

from .controller import ExitController, ExitPolicy, first_exit_round, parse_exit_policy, successive_kl, token_entropy
from .hazards import (LearnedExitTerms, act_mixture, exit_cdf, geometric_prior, hazards_to_masses,
                      learned_exit_loss, learned_exit_terms, masses_to_hazards, stage2_gate_loss,
                      weighted_round_loss)

__all__ = ["ExitController", "ExitPolicy", "LearnedExitTerms", "act_mixture", "exit_cdf", "first_exit_round",
           "geometric_prior", "hazards_to_masses", "learned_exit_loss", "learned_exit_terms", "masses_to_hazards",
           "parse_exit_policy", "stage2_gate_loss", "successive_kl", "token_entropy", "weighted_round_loss"]
