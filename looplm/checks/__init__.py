"""`looplm check RUN`: the seeds' "checks before claiming a saving", run against a trained model.

Records must equal reality, so a check never restates the trainer's arithmetic: each compares with
a computation of its own and says how it knows (CheckResult.kind).

measured  against an independent computation on the run's model and data: a future-token
          perturbation must not change earlier predictions; the shared core must be one set of
          tensors (the optimizer seeing each once); the looped model must equal an untied stack of
          copies; the state must stay finite and stop growing past the trained depth; PyTorch's FLOP
          counter must see every visit the trainer counts; autograd must deliver gradient to exactly
          the rounds the backward window names, and over the depths the run trained imply the
          backward_histogram it records; the library's exit masses must equal the hazard recurrence
          written out by hand; the run's data replayed micro-batch by micro-batch must add up to the
          tokens, token-passes and depths it records; caches, early exit, routing, engine resets and
          the start state against the plain forward pass or a recomputation.
record    the run's records consistent with each other (the per-round telemetry of metrics.jsonl).

A check has three outcomes: passed, failed, or not applicable (the property does not exist
in this run, e.g. exit masses without an exit gate; its kind is then "not_applicable"). Not
applicable is never counted as passed; only a failed check makes `looplm check` exit 1.

The checks live by subject: base.py (CheckResult and shared helpers), core.py (the loop's own
properties), feedback.py and recirculation.py (the seeds' traps of those state paths).
"""

from __future__ import annotations

from typing import Callable

from ..runs.checkpoint import Run
from .base import FAIL, MEASURED, NO_KIND, NOT_APPLICABLE, PASS, RECORD, STATE_GROWTH_LIMIT, CheckResult
from .core import (check_backward_window, check_backward_window_measured, check_cache_policies, check_causality,
                   check_engine_request_reset, check_exit_masses, check_flops_count_every_visit,
                   check_quantile_thresholds, check_round_telemetry, check_routed_decode, check_shared_parameters,
                   check_start_state, check_state_dependency, check_state_stability, check_token_accounting,
                   check_untied_parity, measured_grad_rounds)
from .feedback import (check_feedback_isolation, check_feedback_loss, check_feedback_reorder, check_feedback_shift,
                       check_feedback_start)
from .recirculation import (check_recirculation_cache_refresh, check_recirculation_no_cross_token_leak,
                            check_recirculation_norm_clamp, check_recirculation_readout_boundary,
                            check_recirculation_resume, check_recirculation_visit_indexing)
from .tasks import check_task_above_chance

CHECKS: list[Callable[[Run], CheckResult]] = [
    check_causality, check_shared_parameters, check_untied_parity, check_state_stability,
    check_flops_count_every_visit, check_backward_window_measured, check_backward_window, check_exit_masses,
    check_token_accounting, check_engine_request_reset, check_round_telemetry, check_quantile_thresholds,
    check_cache_policies, check_state_dependency, check_start_state, check_routed_decode,
    check_feedback_shift, check_feedback_start, check_feedback_loss, check_feedback_isolation,
    check_feedback_reorder, check_recirculation_visit_indexing, check_recirculation_norm_clamp,
    check_recirculation_cache_refresh, check_recirculation_readout_boundary, check_recirculation_no_cross_token_leak,
    check_recirculation_resume, check_task_above_chance,
]


def run_checks(run: Run) -> list[CheckResult]:
    return [check(run) for check in CHECKS]


__all__ = ["CHECKS", "FAIL", "MEASURED", "NO_KIND", "NOT_APPLICABLE", "PASS", "RECORD", "STATE_GROWTH_LIMIT",
           "CheckResult", "measured_grad_rounds", "run_checks", *(c.__name__ for c in CHECKS)]
