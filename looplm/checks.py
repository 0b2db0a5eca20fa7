"""`looplm check RUN`: the seeds' "checks before claiming a saving", run against a trained model.

Each check recomputes something independently and compares: a future-token perturbation
must not change earlier predictions; the shared core must be one set of tensors (and the
optimizer must see each once); the looped model must equal an untied stack of copies;
the state must stay finite past the trained depth; the FLOP count must grow with every
visit; the recorded gradient-visible rounds must respect the backward window; exit masses
must sum to 1 with a forced last exit; cached decoding must equal a full forward pass.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from .checkpoint import Run
from .model import LoopedLM, build_model


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


def _sample_ids(run: Run, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, run.tokenizer.vocab_size, (2, T), generator=g)


def _logits(model: LoopedLM, idx: torch.Tensor, rounds: int) -> torch.Tensor:
    return model(idx, rounds, generator=torch.Generator().manual_seed(0)).logits


@torch.no_grad()
def check_causality(run: Run) -> CheckResult:
    model, T = run.model, min(32, run.model.cfg.context)
    rounds_list = [run.recipe.depth.rounds] if run.recipe.model.untied else sorted({1, run.recipe.depth.rounds,
                                                                                    run.recipe.depth.max_rounds})
    idx = _sample_ids(run, T)
    t = T // 2
    changed = idx.clone()
    changed[:, t + 1:] = _sample_ids(run, T, seed=1)[:, t + 1:]
    worst = 0.0
    for r in rounds_list:
        a, b = _logits(model, idx, r), _logits(model, changed, r)
        worst = max(worst, (a[:, :t + 1] - b[:, :t + 1]).abs().max().item())
    return CheckResult("causality", worst <= 1e-5,
                       f"max change of logits at positions <= {t} after changing later tokens: {worst:.2e} "
                       f"(rounds {rounds_list})")


def check_shared_parameters(run: Run) -> CheckResult:
    from .train import make_optimizer
    model = copy.deepcopy(run.model)
    opt = make_optimizer(model, run.recipe)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    stored = model.params_stored()
    in_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    ok = len(ids) == len(set(ids)) and in_opt == stored
    return CheckResult("shared_parameters_once", ok,
                       f"{len(model.core)} core blocks stored; optimizer holds {in_opt:,} parameters, "
                       f"stored {stored:,}; duplicates: {len(ids) - len(set(ids))}")


@torch.no_grad()
def check_untied_parity(run: Run) -> CheckResult:
    recipe = run.recipe
    if recipe.model.untied:
        return CheckResult("looped_equals_untied_copies", True, "run is the untied baseline itself; nothing to compare")
    R = recipe.depth.rounds
    untied_recipe = recipe.replace(model=dataclasses.replace(recipe.model, untied=True),
                                   depth=dataclasses.replace(recipe.depth, kind="fixed"))
    untied = build_model(untied_recipe).eval()
    state, K = run.model.state_dict(), recipe.model.n_core
    new = {}
    for key in untied.state_dict():
        if key.startswith("core."):
            _, idx, rest = key.split(".", 2)
            new[key] = state[f"core.{int(idx) % K}.{rest}"]
        else:
            new[key] = state[key]
    untied.load_state_dict(new)
    idx = _sample_ids(run, min(24, recipe.model.context))
    diff = (_logits(run.model, idx, R) - _logits(untied, idx, R)).abs().max().item()
    return CheckResult("looped_equals_untied_copies", diff <= 1e-4,
                       f"max |logit difference| vs an untied stack of {K * R} copied blocks at {R} rounds: {diff:.2e}")


@torch.no_grad()
def check_state_stability(run: Run) -> CheckResult:
    if run.recipe.model.untied:
        return CheckResult("state_finite_past_training_depth", True, "untied baseline runs one depth only")
    R = 2 * run.recipe.depth.max_rounds
    out = run.model(_sample_ids(run, min(24, run.model.cfg.context)), R, collect_stats=True,
                    generator=torch.Generator().manual_seed(0))
    rms = out.stats["state_rms"]
    ok = all(torch.isfinite(torch.tensor(rms))) and torch.isfinite(out.logits).all().item()
    return CheckResult("state_finite_past_training_depth", bool(ok),
                       f"state RMS over {R} rounds (2x training max): first {rms[0]:.3g}, last {rms[-1]:.3g}, "
                       f"max {max(rms):.3g}")


def check_flops_count_every_visit(run: Run) -> CheckResult:
    model, T = run.model, run.recipe.data.seq_len
    if run.recipe.model.untied:
        return CheckResult("flops_count_every_visit", True, "untied baseline: one block per visit by construction")
    f1, f2, f3 = (model.flops_per_token(r, T) for r in (1, 2, 3))
    per_round = f2 - f1
    ok = per_round > 0 and abs((f3 - f2) - per_round) <= 1e-6 * f3
    core = model.param_groups_by_role()["core"]
    return CheckResult("flops_count_every_visit", ok and per_round >= 6 * core,
                       f"each extra round adds {per_round:.3e} training FLOPs per token "
                       f"(>= 6 x {core:,} shared core parameters)")


def check_backward_window(run: Run) -> CheckResult:
    hist = {int(k): v for k, v in run.report.get("backward_histogram", {}).items()}
    depth = {int(k): v for k, v in run.report.get("depth_histogram", {}).items()}
    if not hist:
        return CheckResult("backward_window_recorded", False, "report.json has no backward_histogram")
    window = run.recipe.backward.window
    limit = max(depth) if window == "all" else window
    ok = max(hist) <= limit and sum(hist.values()) == sum(depth.values())
    return CheckResult("backward_window_recorded", ok,
                       f"gradient-visible rounds {dict(sorted(hist.items()))} (window {window}); "
                       f"sampled depths {dict(sorted(depth.items()))}")


@torch.no_grad()
def check_exit_masses(run: Run) -> CheckResult:
    if run.model.gate is None:
        return CheckResult("exit_masses_conserved", True, "no exit gate in this model")
    from .halting import hazards_to_masses
    R = run.recipe.depth.max_rounds
    out = run.model(_sample_ids(run, 16), R)
    masses = hazards_to_masses(out.hazards)
    err = (masses.sum(-1) - 1).abs().max().item()
    return CheckResult("exit_masses_conserved", err <= 1e-5 and (masses >= 0).all().item(),
                       f"max |sum of exit masses - 1| = {err:.1e} over {R} rounds; last round takes the remainder")


def check_token_accounting(run: Run) -> CheckResult:
    r = run.report
    if "token_passes" not in r:
        return CheckResult("tokens_vs_token_passes", False, "report.json lacks token_passes")
    depth = {int(k): v for k, v in r["depth_histogram"].items()}
    per_micro = r["tokens_seen"] // max(1, sum(depth.values()))
    expected = sum(k * v for k, v in depth.items()) * per_micro
    ok = r["token_passes"] == expected and r["unique_tokens"] <= r["train_data_tokens"]
    return CheckResult("tokens_vs_token_passes", ok,
                       f"unique tokens {r['unique_tokens']:,}; tokens consumed {r['tokens_seen']:,}; "
                       f"token-passes {r['token_passes']:,} (= sum of sampled rounds x tokens per micro-batch: {expected:,})")


CHECKS: list[Callable[[Run], CheckResult]] = [
    check_causality, check_shared_parameters, check_untied_parity, check_state_stability,
    check_flops_count_every_visit, check_backward_window, check_exit_masses, check_token_accounting,
]


def run_checks(run: Run) -> list[CheckResult]:
    return [check(run) for check in CHECKS]
