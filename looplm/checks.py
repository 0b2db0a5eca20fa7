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
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from .runs.checkpoint import Run
from .model.looped import LoopedLM, untied_copy

PASS, FAIL, NOT_APPLICABLE = "pass", "fail", "not applicable"
MEASURED, RECORD, NO_KIND = "measured", "record", "not_applicable"
"""How a check knows (CheckResult.kind): MEASURED compares against an independent computation on the
run's model and data; RECORD compares the run's records with each other; NO_KIND: it does not apply."""

STATE_GROWTH_LIMIT = 1.25
"""Largest allowed rms(state at 2x the trained max depth) / rms(state at the trained max depth).
A state that has settled (a fixed point, or a normalised state) gives about 1.0; 1.25 leaves room
for a slow approach to a fixed point but flags any growth like r^p with p >= log2(1.25) = 0.32:
linear growth (each round adds an update that never cancels, 2.0x over the doubled depth) and
random-walk growth (sqrt, 1.41x) both fail. 2.0 would pass exactly linear growth, the failure
seen on quickstart (docs/checks.md has the measured figures)."""


@dataclass
class CheckResult:
    name: str
    passed: bool | None
    """True / False; None when the check does not apply to this run (never counted as passed)."""
    detail: str
    kind: str = ""
    """MEASURED or RECORD, said by every check that ran (no default: a check must say how it knows);
    NO_KIND exactly when passed is None."""

    def __post_init__(self) -> None:
        if self.passed is None:
            self.kind = NO_KIND
            return
        self.passed = bool(self.passed)
        if self.kind not in (MEASURED, RECORD):
            raise ValueError(f"check {self.name}: kind must be {MEASURED!r} or {RECORD!r}, got {self.kind!r}")

    @classmethod
    def not_applicable(cls, name: str, why: str) -> "CheckResult":
        return cls(name, None, f"not applicable: {why}")

    @property
    def status(self) -> str:
        return NOT_APPLICABLE if self.passed is None else PASS if self.passed else FAIL

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "passed": self.passed, "kind": self.kind,
                "detail": self.detail}


def _sample_ids(run: Run, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, run.tokenizer.vocab_size, (2, T), generator=g)
    return ids.to(next(run.model.parameters()).device)


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
                       f"(rounds {rounds_list})", MEASURED)


def check_shared_parameters(run: Run) -> CheckResult:
    from .train.trainer import make_optimizer
    model = copy.deepcopy(run.model)
    opt = make_optimizer(model, run.recipe)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    stored = model.params_stored()
    in_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    ok = len(ids) == len(set(ids)) and in_opt == stored
    return CheckResult("shared_parameters_once", ok,
                       f"{len(model.core)} core blocks stored; optimizer holds {in_opt:,} parameters, "
                       f"stored {stored:,}; duplicates: {len(ids) - len(set(ids))}", MEASURED)


@torch.no_grad()
def check_untied_parity(run: Run) -> CheckResult:
    recipe = run.recipe
    if recipe.model.untied:
        return CheckResult.not_applicable("looped_equals_untied_copies",
                                          "the run is the untied baseline itself; there is no shared core to compare")
    R, K = recipe.depth.rounds, recipe.model.n_core
    untied = untied_copy(run.model, R).eval()
    idx = _sample_ids(run, min(24, recipe.model.context))
    diff = (_logits(run.model, idx, R) - _logits(untied, idx, R)).abs().max().item()
    return CheckResult("looped_equals_untied_copies", diff <= 1e-4,
                       f"max |logit difference| vs an untied stack of {K * R} copied blocks at {R} rounds: {diff:.2e}",
                       MEASURED)


@torch.no_grad()
def check_state_stability(run: Run) -> CheckResult:
    """Run 2x the trained max depth; fail on a non-finite state or logits, or when the state RMS
    grows by more than STATE_GROWTH_LIMIT between the trained max depth and the end."""
    name = "state_stable_past_training_depth"
    if run.recipe.model.mor != "none":
        return CheckResult.not_applicable(name, "a routed loop never runs a token past the depth its router "
                                                f"chose (at most {run.recipe.depth.rounds})")
    if run.recipe.model.untied:
        return CheckResult.not_applicable(name, "the untied baseline has blocks for one depth only; "
                                                "it cannot run past it")
    trained = run.recipe.depth.max_rounds
    R = 2 * trained
    out = run.model(_sample_ids(run, min(24, run.model.cfg.context)), R, collect_stats=True,
                    generator=torch.Generator().manual_seed(0))
    # measured here from the states themselves, not from the model's own stats
    rms = [s.float().pow(2).mean().sqrt().item() for s in out.round_states]       # one per round
    finite = all(torch.isfinite(torch.tensor(rms)).tolist()) and bool(torch.isfinite(out.logits).all())
    at_trained, last = rms[trained - 1], rms[-1]
    growth = last / at_trained if at_trained > 0 else float("inf")
    per_round = growth ** (1 / (R - trained)) if growth < float("inf") else float("inf")
    within = rms[trained - 1] / rms[0] if rms[0] > 0 else float("inf")
    ok = finite and growth <= STATE_GROWTH_LIMIT
    return CheckResult(name, ok,
                       f"state RMS over {R} rounds (2x trained max {trained}): round 1 {rms[0]:.3g}, "
                       f"round {trained} {at_trained:.3g}, round {R} {last:.3g}, max {max(rms):.3g}; "
                       f"growth past the trained depth {growth:.3g}x ({per_round:.3g}x per round; "
                       f"limit {STATE_GROWTH_LIMIT}x); growth over the trained depths (information) {within:.3g}x"
                       + ("" if finite else "; NON-FINITE state or logits"), MEASURED)


def check_flops_count_every_visit(run: Run) -> CheckResult:
    """The trainer's FLOP record for one training step against PyTorch's own FLOP counter on that step:
    every product of every visit (prelude, each round's core blocks, each readout's coda and head,
    and their backward where autograd ran it) must be counted, no more and no less. Attention's term is
    counted separately (the CPU attention kernel is not in PyTorch's counter)."""
    from torch.utils.flop_counter import FlopCounterMode
    from .model.flops import pass_flops, train_flops_per_token
    from .train.trainer import Counters, train_step
    recipe = run.recipe
    R = recipe.depth.rounds
    m = copy.deepcopy(run.model).train()
    for n, p in m.named_parameters():          # the trainer freezes all but the gate in stage II
        p.requires_grad_(recipe.train.stage == 1 or n.startswith("gate."))
    x = _sample_ids(run, min(16, m.cfg.context) + 1)
    counters = Counters()
    with FlopCounterMode(display=False) as fc:
        train_step(m, recipe, x[:, :-1], x[:, 1:], step=0, micro=0, counters=counters, rounds=R,
                   supervision=_training_supervision(recipe, R))
    measured = float(sum(v for k, v in fc.get_flop_counts()["Global"].items() if "mm" in str(k)))
    v, n, T = counters.last_visits, x[:, :-1].numel(), x.shape[1] - 1
    counted = n * pass_flops(m.cfg, v, 0, m.gate is not None)["total"]
    recorded = counters.train_flops == n * train_flops_per_token(m.cfg, v, T, m.gate is not None)
    ok = recorded and abs(counted - measured) <= 1e-6 * max(measured, 1.0)
    return CheckResult("flops_count_every_visit", ok,
                       f"one training step at {R} rounds: products counted {counted:.4e} FLOPs, PyTorch's counter "
                       f"measured {measured:.4e} (visits: {v.rounds} rounds, {v.grad_rounds} in the backward, "
                       f"{v.readouts} readouts, prelude gradient {v.prelude_grad})", MEASURED)


def _training_supervision(recipe, rounds: int):
    """The supervision a training micro-batch of `rounds` rounds uses (train_step's `supervision`)."""
    from .recipe.config import SupervisionConfig
    if recipe.data.task and recipe.data.depth_by_difficulty:
        # taskdata.depth_plan: every round from the example's level on (from 1 at level 1 or with
        # trace targets); the final round is always among them
        return SupervisionConfig(kind="rounds", rounds=tuple(range(1, rounds + 1)))
    return recipe.supervision


def _window_rounds(recipe, rounds: int) -> tuple[int, ...]:
    """The rounds that must receive gradient, from the recipe alone: the last min(window, R) rounds,
    up to the last loss-bearing readout inside them (a loss only on rounds before the window trains
    the readout alone); none in stage II, where the language model is frozen and only the gate
    (reading each state as a constant) trains."""
    from .model.losses import placement
    if recipe.train.stage == 2:
        return ()
    window = recipe.backward.window
    first = 1 if window == "all" else max(1, rounds - window + 1)
    place = placement(_training_supervision(recipe, rounds), rounds)   # learned_exit: every round
    last = max((q for q in place.rounds if q >= first), default=0)
    return tuple(range(first, last + 1))


def measured_grad_rounds(model: LoopedLM, recipe, x: torch.Tensor, rounds: int
                         ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One training step's backward on a copy of `model`, as the trainer runs it (train_step: the
    recipe's supervision placement, stage II's every-round gate loss, the backward window min'd with
    `rounds`, the trainer's trainable parameters). x: (B, T+1) token ids; inputs x[:, :-1], targets
    x[:, 1:].

    Returns (measured, recorded): measured = the rounds whose output state autograd gave a nonzero
    gradient; recorded = `out.grad_rounds`, what the trainer counts into backward_histogram."""
    from .train.trainer import Counters, train_step
    m = copy.deepcopy(model).train()
    trainable = (lambda n: n.startswith("gate.")) if recipe.train.stage == 2 else (lambda n: True)
    for n, p in m.named_parameters():          # the trainer freezes all but the gate in stage II
        p.requires_grad_(trainable(n))
        p.grad = None
    _, out, _ = train_step(m, recipe, x[:, :-1], x[:, 1:], step=0, micro=0, counters=Counters(),
                           collect_stats=True, rounds=rounds, supervision=_training_supervision(recipe, rounds))
    measured = tuple(r for r, s in enumerate(out.round_states, start=1)
                     if s.grad is not None and bool(s.grad.detach().abs().max() > 0))
    return measured, tuple(out.grad_rounds)


def check_backward_window_measured(run: Run) -> CheckResult:
    """Autograd, not the record: at the recipe's min, nominal and max depth, the rounds that receive
    gradient in a training step must be exactly the backward window's rounds (up to the last
    supervised one) and exactly what the trainer records."""
    recipe = run.recipe
    d = recipe.depth
    depths = [d.rounds] if recipe.model.untied else sorted({d.min_rounds, d.rounds, d.max_rounds})
    x = _sample_ids(run, min(16, run.model.cfg.context) + 1)
    parts, ok = [], True
    for R in depths:
        measured, recorded = measured_grad_rounds(run.model, recipe, x, R)
        expected = _window_rounds(recipe, R)
        ok = ok and measured == recorded == expected
        parts.append(f"R={R}: measured {list(measured)}, recorded {list(recorded)}, window says {list(expected)}")
    stage2 = "; stage II: the language model is frozen" if recipe.train.stage == 2 else ""
    return CheckResult("backward_window_measured", ok,
                       f"rounds whose output state received nonzero gradient in one training step "
                       f"(window {recipe.backward.window}, supervision {recipe.supervision.kind}{stage2}): "
                       + "; ".join(parts), MEASURED)


def _imported(run: Run) -> bool:
    """The run was written by `looplm import` and never trained here: it has no training record to check."""
    return (run.path / "import.json").is_file() and not (run.path / "metrics.jsonl").is_file()


IMPORTED = "the run was imported (looplm import), not trained by looplm: no training record"


def check_backward_window(run: Run) -> CheckResult:
    """The record against autograd: for every depth the run trained at (report.json's depth_histogram),
    one tiny training step measures which rounds receive gradient (measured_grad_rounds); counted over
    the depth histogram, those give the backward_histogram autograd implies, which must be the one
    report.json records."""
    name = "backward_window_recorded"
    if _imported(run):
        return CheckResult.not_applicable(name, IMPORTED)
    hist = {int(k): v for k, v in run.report.get("backward_histogram", {}).items()}
    depth = {int(k): v for k, v in run.report.get("depth_histogram", {}).items()}
    if not hist or not depth:
        return CheckResult(name, False, "report.json lacks backward_histogram or depth_histogram", MEASURED)
    x = _sample_ids(run, min(8, run.model.cfg.context) + 1)          # (2, 9): a few tokens per depth
    reached = {R: measured_grad_rounds(run.model, run.recipe, x, R)[0] for R in sorted(depth)}
    implied: Counter = Counter()
    for R, n in depth.items():             # each micro-batch of depth R back-propagates what autograd reached at R
        implied[len(reached[R])] += n
    implied = dict(sorted(implied.items()))
    return CheckResult(name, hist == implied,
                       f"autograd reaches, by trained depth (window {run.recipe.backward.window}): "
                       + ", ".join(f"R={R}: {list(r)}" for R, r in reached.items())
                       + f"; over depth_histogram {dict(sorted(depth.items()))} that implies backward_histogram "
                       f"{implied}; report.json records {dict(sorted(hist.items()))}", MEASURED)


def _masses_by_hand(hazards: list[float]) -> list[float]:
    """One token's exit masses, in Python floats: round r exits with h_r times the chance that no
    earlier round did; the last round takes whatever is left (forced exit), its own hazard unread."""
    masses, survive = [], 1.0
    for h in hazards[:-1]:
        masses.append(h * survive)
        survive *= 1.0 - h
    return masses + [survive]


@torch.no_grad()
def check_exit_masses(run: Run) -> CheckResult:
    """The library's hazards_to_masses against the recurrence written out by hand, in float64, on the
    hazards the run's gate gives in a forward pass at the trained max depth: equal element by element,
    summing to 1, non-negative, the last round's mass the survival left after the others."""
    name = "exit_masses_conserved"
    if run.model.gate is None:
        return CheckResult.not_applicable(name, "the model has no exit gate")
    from .halting import hazards_to_masses
    R = run.recipe.depth.max_rounds
    h = run.model(_sample_ids(run, 16), R).hazards                    # (B, T, R)
    lib = hazards_to_masses(h).double().cpu()                         # (B, T, R), beside the hand's on the CPU
    hand = torch.tensor([_masses_by_hand(row) for row in h.double().reshape(-1, R).tolist()],
                        dtype=torch.float64).reshape(lib.shape)       # (B, T, R)
    diff = (lib - hand).abs().max().item()
    last = (lib[..., -1] - hand[..., -1]).abs().max().item()
    total = (lib.sum(-1) - 1).abs().max().item()
    low = lib.min().item()
    ok = diff <= 1e-5 and total <= 1e-5 and low >= 0
    return CheckResult(name, ok,
                       f"{h.shape[0] * h.shape[1]} tokens x {R} rounds of the gate's hazards: max |library - hand "
                       f"recurrence| {diff:.1e} (last round vs the remaining survival {last:.1e}); max |sum - 1| "
                       f"{total:.1e}; smallest mass {low:.2e}", MEASURED)


@torch.no_grad()
def check_quantile_thresholds(run: Run) -> CheckResult:
    """Early exit by quantile against the cumulative exit mass, recomputed here from the gate's hazards
    the pass recorded: every token stops at the first round (from exit.min_rounds) whose cumulative mass
    1 - prod(1 - h) reaches Q, or at the last round."""
    name = "quantile_exit_matches_cumulative_mass"
    if run.model.gate is None:
        return CheckResult.not_applicable(name, "the model has no exit gate")
    from .inference.early_exit import early_exit
    from .halting import parse_exit_policy
    recipe = run.recipe
    text = recipe.exit.policy if recipe.exit.policy.startswith("quantile") else "quantile:0.5"
    policy = parse_exit_policy(text, min_rounds=recipe.exit.min_rounds)
    R = recipe.depth.rounds
    out = early_exit(run.model, _sample_ids(run, min(32, run.model.cfg.context)), policy, R)
    h = out.hazards.double()                                         # (B, T, R), NaN after a token's exit
    cdf = 1 - torch.cumprod(1 - h.nan_to_num(0.0), -1)
    rounds = torch.arange(1, R + 1, device=h.device)
    reached = (cdf >= policy.value) & (rounds >= policy.min_rounds)
    want = torch.where(reached.any(-1), reached.double().argmax(-1) + 1, torch.full_like(out.rounds_used, R))
    # a token's record reaches its exit round only: the first crossing inside it is its exit
    ok = torch.equal(want.to(out.rounds_used.dtype), out.rounds_used)
    return CheckResult(name, ok, f"{text} (min_rounds {policy.min_rounds}) over {out.rounds_used.numel()} tokens: "
                       f"mean exit round {out.rounds_used.float().mean():.2f} of {R}; "
                       f"{int((want != out.rounds_used).sum())} tokens stop elsewhere than the cumulative mass says",
                       MEASURED)


def check_cache_policies(run: Run) -> CheckResult:
    """Full vs reused caches, prompt and decode judged separately: each sample window's first half is
    prefilled and its second half decoded token by token through the cached engine at the nominal
    depth (evaluation/cache_policies.py). The full cache must give the plain forward pass's loss (it
    computes the same function); every shared policy's measured loss change is reported beside it."""
    from .evaluation.cache_policies import continuation_loss, forward_loss
    from .inference.engine import Engine
    name = "cache_policies_measured"
    if run.model.feedback is not None:
        return CheckResult.not_applicable(name, FEEDBACK_DECODE)
    if run.recipe.model.mor != "none":
        return CheckResult.not_applicable(name, "a Mixture-of-Recursions model decodes with the cache rule it was "
                                                f"trained with ({run.recipe.model.mor_cache}); "
                                                "routed_decode_matches_training compares it with the forward pass")
    R = run.recipe.depth.rounds
    ids = _sample_ids(run, min(24, run.model.cfg.context) + 1)
    batches = [(ids[:, :-1], ids[:, 1:])]

    def loss(prefill: str, decode: str) -> float:
        engine = Engine.from_run(run, prefill_cache=prefill, decode_cache=decode, exit=f"fixed:{R}")
        return continuation_loss(engine, batches)["loss"]
    full, ref = loss("full", "full"), forward_loss(run.model, batches, R)
    parts = [f"prompt {p}: {loss(p, 'full') - full:+.4f}" for p in ("first", "last", "average")]
    parts += [f"decode {p}: {loss('full', p) - full:+.4f}" for p in ("first", "last", "average")]
    return CheckResult(name, abs(full - ref) <= 1e-4,
                       f"full cache {full:.4f} vs plain forward {ref:.4f} at {R} rounds; loss change of each shared "
                       "policy (prompt cache with full decode, then decode cache with full prompt): " + ", ".join(parts),
                       MEASURED)


@torch.no_grad()
def check_state_dependency(run: Run) -> CheckResult:
    """Which state a round carries and what it reads: perturb the state entering round 2, then the
    prelude's output e, and measure round 2's output. It must depend on the state, and on e exactly
    when the recipe injects it (model.injection != "none")."""
    m = run.model
    ids = _sample_ids(run, min(16, m.cfg.context))
    T = ids.shape[1]
    rope = m.rope(0, T)
    e = m.encode(ids, rope)
    s = m.initial_state(e)
    s1 = m.core_step(s, e, 1, rope)
    g = torch.Generator().manual_seed(1)
    base = m.core_step(s1, e, 2, rope)
    d_state = (m.core_step(s1 + 0.1 * torch.randn(s1.shape, generator=g).to(s1), e, 2, rope) - base).abs().max().item()
    d_input = (m.core_step(s1, e + 0.1 * torch.randn(e.shape, generator=g).to(e), 2, rope) - base).abs().max().item()
    injects = m.cfg.injection != "none"
    ok = d_state > 0 and (d_input > 0) == injects
    return CheckResult("state_and_dependency", ok,
                       f"round 2 carries a state of width {s1.shape[-1]} (initial state: {m.cfg.init_state}); its output "
                       f"moves by {d_state:.2e} when the incoming state is perturbed and by {d_input:.2e} when the "
                       f"prelude output is (injection {m.cfg.injection!r}: must {'' if injects else 'not '}depend on it)",
                       MEASURED)


@torch.no_grad()
def check_start_state(run: Run) -> CheckResult:
    """The initial state is what the recipe says, and evaluation is deterministic: the same input twice
    gives the same logits in eval mode; a random initial state is a draw (two generators differ), zeros
    are zeros, a prelude start is the prelude's output."""
    m = run.model.eval()
    ids = _sample_ids(run, min(16, m.cfg.context))
    R = run.recipe.depth.rounds
    twice = (m(ids, R).logits - m(ids, R).logits).abs().max().item()
    e = m.encode(ids, m.rope(0, ids.shape[1]))
    kind = m.cfg.init_state
    if kind == "random":
        a, b = (m(ids, R, generator=torch.Generator().manual_seed(k)).logits for k in (1, 2))
        kind_ok, what = bool((a - b).abs().max() > 0), "fresh noise per generator; a fixed table in eval mode"
    elif kind == "zeros":
        kind_ok, what = bool((m.initial_state(e) == 0).all()), "zeros"
    else:
        kind_ok, what = bool(torch.equal(m.initial_state(e), e)), "the prelude's output"
    return CheckResult("start_state", twice == 0.0 and kind_ok,
                       f"init_state {kind!r} ({what}): {'as described' if kind_ok else 'NOT as described'}; "
                       f"the same input twice in eval mode: max |logit difference| {twice:.1e}", MEASURED)


class _MicroBatch(NamedTuple):
    real: int       # inputs that are data (every one for plain text; a task batch's rows before their padding)
    padded: int     # inputs including the padding (B x T of the batch as the model ran it)
    rounds: int     # forward rounds
    passes: int = 1  # feedback's parallel passes (each runs every round)


def _replay_text(run: Run, indices: list[tuple[int, int]]) -> tuple[list[_MicroBatch], int]:
    """Plain text: the run's own token file through its sampler (windows are a function of seed and
    micro-batch index); depths from the recipe's sampler. Returns (micro-batches, unique tokens)."""
    from .data.text import TokenSampler, open_tokens
    from .train.depth import sample_depth
    from .train.trainer import feedback_plan
    r, accum = run.recipe, run.recipe.train.grad_accum
    sampler = TokenSampler(open_tokens(run.path / "data" / "train.bin"), r.data.seq_len, r.train.batch_size,
                           r.train.seed)
    batches = []
    for step, micro in indices:
        x, _ = sampler.batch(step * accum + micro)                    # (batch_size, seq_len), no padding
        batches.append(_MicroBatch(x.numel(), x.numel(), sample_depth(r.depth, r.train.seed, step, micro),
                                   feedback_plan(r, x, step, micro, run.tokenizer.eos_id)[0]))
    return batches, sampler.unique_tokens()


def _replay_task(run: Run, indices: list[tuple[int, int]]) -> tuple[list[_MicroBatch], int]:
    """Task data: each micro-batch's examples drawn again and tokenized here; a row of n = prompt +
    answer tokens is n - 1 inputs, padded to the batch's longest row; depths from the batch's own
    plan (data.depth_by_difficulty) or the recipe's sampler. Returns (micro-batches, unique tokens of
    the distinct examples)."""
    from .data.taskdata import TaskSampler, TaskSource, format_for_training
    from .train.depth import sample_depth
    r, accum, tok = run.recipe, run.recipe.train.grad_accum, run.tokenizer
    sampler = TaskSampler(TaskSource(r), tok, r)
    distinct: dict[tuple[str, str], int] = {}
    batches = []
    for step, micro in indices:
        index = step * accum + micro
        examples = sampler.examples(index)
        n = [sum(len(tok.encode(t)) for t in format_for_training(ex, r.data.separator)) for ex in examples]
        distinct.update(((ex.prompt, ex.answer), k) for ex, k in zip(examples, n))
        rounds = (sampler.depth_plan(examples[0].difficulty, index)[0] if r.data.depth_by_difficulty
                  else sample_depth(r.depth, r.train.seed, step, micro))
        batches.append(_MicroBatch(sum(n) - len(n), len(n) * (max(n) - 1), rounds))
    return batches, sum(distinct.values())


def check_token_accounting(run: Run) -> CheckResult:
    """The record against a replay of the run's data: every micro-batch the recipe trained (train.steps x
    grad_accum, a resumed run's included: its counters resume with it) is drawn again, its real
    (non-padding) inputs and inputs x rounds counted here, and the sums must be report.json's
    tokens_seen and token_passes; the depths, its depth_histogram; the distinct tokens, its
    unique_tokens (<= train_data_tokens). A stage-II or --init run counts only its own steps, as its
    trainer does (its counters start at zero)."""
    from .errors import UserError
    name = "tokens_vs_token_passes"
    if _imported(run):
        return CheckResult.not_applicable(name, IMPORTED)
    r = run.report
    missing = [k for k in ("tokens_seen", "token_passes", "unique_tokens", "train_data_tokens", "depth_histogram")
               if k not in r]
    if missing:
        return CheckResult(name, False, f"report.json lacks {', '.join(missing)}", MEASURED)
    indices = [(step, micro) for step in range(run.recipe.train.steps) for micro in range(run.recipe.train.grad_accum)]
    try:
        batches, unique = (_replay_task if run.recipe.data.task else _replay_text)(run, indices)
    except UserError as err:
        return CheckResult(name, False, f"cannot replay the run's training data: {err}", MEASURED)
    tokens, passes = sum(b.real for b in batches), sum(b.real * b.rounds * b.passes for b in batches)
    padding = sum(b.padded for b in batches) - tokens
    padded_passes = sum(b.padded * b.rounds * b.passes for b in batches)
    depths = {str(k): v for k, v in sorted(Counter(b.rounds for b in batches).items())}
    ok = (r["tokens_seen"] == tokens and r["token_passes"] == passes and r["depth_histogram"] == depths
          and r["unique_tokens"] == unique and unique <= r["train_data_tokens"])
    fb_note = ""
    if run.recipe.feedback.mode != "none":    # feedback's passes: each micro-batch's drawn again
        hist = {str(k): v for k, v in sorted(Counter(b.passes for b in batches).items())}
        fb_passes = sum(b.real * b.passes for b in batches)
        rec = r.get("feedback", {})
        ok = ok and rec.get("passes_histogram") == hist and rec.get("token_passes") == fb_passes
        fb_note = (f"; feedback passes {hist} ({fb_passes:,} token x passes), report.json "
                   f"{rec.get('passes_histogram')} ({rec.get('token_passes')})")
    stale = (" (that counts the padding: the report predates the trainer leaving padding out)"
             if padding and r["token_passes"] == padded_passes else "")
    return CheckResult(name, ok,
                       f"replayed {len(batches)} micro-batches: {tokens:,} tokens ({padding:,} padding left out), "
                       f"{passes:,} token-passes, depths {depths}, {unique:,} unique tokens; "
                       f"report.json: tokens_seen {r['tokens_seen']:,}, token_passes {r['token_passes']:,}{stale}, "
                       f"depth_histogram {r['depth_histogram']}, unique_tokens {r['unique_tokens']:,} "
                       f"(train_data_tokens {r['train_data_tokens']:,}){fb_note}", MEASURED)


FEEDBACK_DECODE = ("a feedback model's decoding carries each request's top state (feedback.mode); the cache "
                   "policies are measured on plain decoding")


def check_engine_request_reset(run: Run) -> CheckResult:
    """The cached engine keeps no state between requests: a request decoded before and after another
    request (with its own prompt, a different length) gives the same tokens and rounds."""
    from .inference.engine import Engine, SamplingParams
    engine = Engine.from_run(run)
    ids = _sample_ids(run, 12)[0].tolist()
    a, b = ids[:5], ids[5:12]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)

    def once(prompt: list[int]) -> tuple[list[int], list[int]]:
        out = engine.generate([prompt], params)[0]
        return list(out.tokens), list(out.rounds_used)
    first = once(a)
    once(b)
    again = once(a)
    return CheckResult("engine_request_reset", first == again,
                       f"the same request before and after another: tokens {first[0]} then {again[0]}, "
                       f"rounds {first[1]} then {again[1]}", MEASURED)


def check_round_telemetry(run: Run) -> CheckResult:
    """metrics.jsonl carries per-round telemetry at every logged step: state and update RMS for each
    round run, finite; gradient RMS finite inside the backward window and null exactly before it."""
    import json
    import math
    name = "round_telemetry_present"
    if _imported(run):
        return CheckResult.not_applicable(name, IMPORTED)
    path = run.path / "metrics.jsonl"
    if not path.is_file():
        return CheckResult(name, False, "the run has no metrics.jsonl", RECORD)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    bad = []
    for r in rows:
        R = r.get("rounds", [None])[-1]
        st, up, gr = r.get("state_rms"), r.get("update_rms"), r.get("grad_rms")
        if st is None or up is None or gr is None or not (len(st) == len(up) == len(gr) == R):
            bad.append(f"step {r.get('step')}: missing or not one value per round")
            continue
        if not all(math.isfinite(v) for v in st + up):
            bad.append(f"step {r['step']}: non-finite state/update RMS")
        window = r.get("grad_rounds") or []
        if any(v is not None and not math.isfinite(v) for v in gr):
            bad.append(f"step {r['step']}: non-finite gradient RMS")
        elif window and any((v is None) != (i < min(window)) for i, v in enumerate(gr, start=1)):
            bad.append(f"step {r['step']}: gradient RMS present before the backward window or missing inside it")
    return CheckResult(name, bool(rows) and not bad,
                       f"{len(rows)} logged steps, each with state, update and gradient RMS per round"
                       if not bad else "; ".join(bad[:3]), RECORD)


@torch.no_grad()
def check_routed_decode(run: Run) -> CheckResult:
    """Mixture-of-Recursions: the cached engine, decoding a sample one column at a time (every token
    routed, the cache by the trained rule), gives each token the depth and the logits of the full
    forward pass (masks); causal routing means no token's decision may depend on later ones."""
    from .inference.engine import Engine
    name = "routed_decode_matches_training"
    if run.recipe.model.mor == "none":
        return CheckResult.not_applicable(name, "no Mixture-of-Recursions router")
    m = run.model
    ids = _sample_ids(run, min(20, m.cfg.context))[:1]
    full = m(ids)
    engine = Engine.from_run(run)
    engine.kernels()
    cache = engine.new_cache(1, ids.shape[1])
    worst, depths = 0.0, []
    with torch.inference_mode():
        for c in range(ids.shape[1]):
            lg, used = engine.run_chunk(ids[:, c:c + 1], c, cache, phase="decode")
            worst = max(worst, (lg[0] - full.logits[0, c]).abs().max().item())
            depths.append(int(used[0]))
    same = depths == full.rounds_used[0].tolist()
    return CheckResult(name, same and worst <= 1e-3,
                       f"{len(depths)} tokens decoded one at a time under the {m.cfg.mor_cache} cache rule: depths "
                       f"{'equal' if same else 'DIFFER from'} the forward pass's (mean {sum(depths) / len(depths):.2f}); "
                       f"max |logit difference| {worst:.2e}", MEASURED)


# -- full-bandwidth feedback (model/feedback.py): the seeds' traps, measured on the run's own model ----------

NO_FEEDBACK = "the model has no full-bandwidth feedback (feedback.mode = none)"


@torch.no_grad()
def check_feedback_shift(run: Run) -> CheckResult:
    """Pass 2 reads pass 1's top state of the position before, not its own: pass 2's logits against the
    model run on a state built by hand (position t gets pass 1's top at t - 1); the unshifted state (token
    t's own, the cross-token bug) must give different logits."""
    from .model.feedback import passes_forward, plain_positions
    name = "feedback_shift_by_one"
    if run.model.feedback is None:
        return CheckResult.not_applicable(name, NO_FEEDBACK)
    m, x = run.model, _sample_ids(run, min(16, run.model.cfg.context))
    plain = plain_positions(x, run.tokenizer.eos_id, run.recipe.feedback.reset_at_eos)
    first, second = passes_forward(m, x, 2, plain)                # eval mode: the fixed initial state
    hand = torch.zeros_like(first.top)
    for t in range(1, x.shape[1]):
        hand[:, t] = first.top[:, t - 1]
    shifted = (m(x, feedback=(hand, plain)).logits - second.logits).abs().max().item()
    own = (m(x, feedback=(first.top, plain)).logits - second.logits).abs().max().item()
    return CheckResult(name, shifted <= 1e-5 and own > 1e-6,
                       f"pass 2 vs a hand-shifted state: max |logit difference| {shifted:.1e}; vs each token's own "
                       f"state: {own:.1e} (must differ)", MEASURED)


@torch.no_grad()
def check_feedback_start(run: Run) -> CheckResult:
    """The start convention and a plain prefix: positions that read their plain embedding (a window's
    first, after an end-of-text token, inside a plain prefix) give the same output whatever state is
    offered to them; the others' outputs move with it."""
    from .model.feedback import plain_positions
    name = "feedback_start_convention"
    if run.model.feedback is None:
        return CheckResult.not_applicable(name, NO_FEEDBACK)
    m, eos = run.model, run.tokenizer.eos_id
    x = _sample_ids(run, min(16, run.model.cfg.context))
    x[:, 5] = eos
    plain = plain_positions(x, eos, run.recipe.feedback.reset_at_eos, prefix=torch.tensor([3, 0]))
    expected = torch.zeros_like(plain)                   # the convention written out, position by position
    for row in range(x.shape[0]):
        for t in range(x.shape[1]):
            expected[row, t] = (t == 0 or (row == 0 and t < 3)
                                or (run.recipe.feedback.reset_at_eos and int(x[row, t - 1]) == eos))
    if not torch.equal(plain, expected):
        return CheckResult(name, False, f"plain positions {plain.nonzero().tolist()} are not the convention's "
                                        f"{expected.nonzero().tolist()}", MEASURED)
    e = m.embed(x) * m.cfg.embed_scale
    h = torch.randn(*x.shape, m.cfg.d_model, generator=torch.Generator().manual_seed(1)).to(e)
    a, b = m.feedback(e, h, plain), m.feedback(e, h.flip(0), plain)
    held = bool(torch.equal(a[plain], e[plain]) and torch.equal(b[plain], e[plain]))
    moved = bool((a[~plain] - b[~plain]).abs().amax(-1).gt(0).all())
    where = sorted({int(t) for t in plain.nonzero()[:, 1].tolist()})
    return CheckResult(name, held and moved,
                       f"plain positions {where} (window start, prefix of 3 in row 0, after the eos at 5"
                       f"{'' if run.recipe.feedback.reset_at_eos else ': reset_at_eos off'}) read their embedding "
                       f"{'exactly' if held else 'NOT exactly'}; every other position's input "
                       f"{'moves' if moved else 'does NOT move'} with the state", MEASURED)


def check_feedback_loss(run: Run) -> CheckResult:
    """One training step's K-pass loss (the trainer's) against the passes' own cross-entropies recombined
    here: first pass + later_weight x the mean of the later ones."""
    import dataclasses

    import torch.nn.functional as F

    from .model.feedback import passes_forward, plain_positions
    from .recipe.config import FeedbackConfig
    from .train.depth import depth_generator
    from .train.trainer import Counters, train_step
    name = "feedback_pass_loss_composition"
    if run.model.feedback is None:
        return CheckResult.not_applicable(name, NO_FEEDBACK)
    fb = run.recipe.feedback
    recipe = dataclasses.replace(run.recipe, feedback=FeedbackConfig(
        mode=fb.mode, norm=fb.norm, reset_at_eos=fb.reset_at_eos, passes=(0.0, 0.0, 1.0),
        later_weight=fb.later_weight))                             # three passes, no jitter: recomputable
    model = copy.deepcopy(run.model).train()
    model.feedback.jitter = 0.0                                  # as the recipe above: recomputable
    x = _sample_ids(run, min(16, model.cfg.context) + 1)
    x, y = x[:, :-1], x[:, 1:]
    R = recipe.depth.rounds
    loss, _, info = train_step(model, recipe, x, y, recipe.train.steps, 0, Counters(), rounds=R,
                               eos_id=run.tokenizer.eos_id)
    with torch.no_grad():       # the same passes again: the step's initial-state noise (trainer's generator)
        gen = depth_generator(recipe.train.seed + 1, recipe.train.steps, 0)
        outs = passes_forward(model, x, 3, plain_positions(x, run.tokenizer.eos_id, fb.reset_at_eos), rounds=R,
                              generator=gen)
        ce = [F.cross_entropy(o.logits.flatten(0, 1).float(), y.flatten()).item() for o in outs]
    want = ce[0] + fb.later_weight * (ce[1] + ce[2]) / 2
    ok = abs(loss - want) <= 1e-4 * max(1.0, abs(want))
    return CheckResult(name, ok and len(info.get("loss_by_pass", [])) == 3,
                       f"trainer's loss {loss:.5f} over passes {[round(v, 5) for v in info.get('loss_by_pass', [])]}; "
                       f"recomputed {ce[0]:.5f} + {fb.later_weight} x mean({ce[1]:.5f}, {ce[2]:.5f}) = {want:.5f}",
                       MEASURED)


def check_feedback_isolation(run: Run) -> CheckResult:
    """A request's carried state is its own: two requests of different prompt modes in one batch each
    decode what they decode alone, and a request in a row another one used before decodes as in a fresh
    row. Speculative rollback: not applicable (speculation with feedback is refused)."""
    from .inference.engine import Engine, SamplingParams
    name = "feedback_request_isolation"
    if run.model.feedback is None:
        return CheckResult.not_applicable(name, NO_FEEDBACK)
    engine = Engine.from_run(run, exit=f"fixed:{run.recipe.depth.rounds}")
    ids = _sample_ids(run, 12)
    a, b = ids[0, :7].tolist(), ids[1, :9].tolist()
    sp = [SamplingParams(max_new_tokens=5, stop_at_eos=False, prompt_mode=m) for m in ("fused", "soft")]
    together = [c.tokens for c in engine.generate([a, b], sp)]
    alone = [engine.generate([p], s)[0].tokens for p, s in zip((a, b), sp)]
    # a row another request used before: b finishes early in row 0 beside a longer c, then a joins row 0
    c = ids[1, 2:11].tolist()
    batch = engine.batch([b, c], [SamplingParams(max_new_tokens=2, stop_at_eos=False, prompt_mode="soft"),
                                  SamplingParams(max_new_tokens=12, stop_at_eos=False, prompt_mode="soft")])
    while not batch.requests[0].done:
        batch.step()
    joined = batch.join(a, sp[0])
    toks: dict[int, list[int]] = {}
    for ev in joined[1] if joined else []:
        toks.setdefault(ev.row, []).append(ev.token)
    while joined and not batch.finished:
        for ev in batch.step():
            toks.setdefault(ev.row, []).append(ev.token)
    reused = toks.get(joined[0], []) == alone[0] if joined else None
    ok = together == alone and reused is not False
    return CheckResult(name, ok,
                       f"fused and soft rows in one batch {'equal' if together == alone else 'DIFFER from'} each "
                       f"alone; a prompt joining a running batch {'decodes as alone' if reused else 'found no free row' if reused is None else 'DIFFERS from alone'}",
                       MEASURED)


def check_feedback_reorder(run: Run) -> CheckResult:
    """The carried state moves with its request when the batch is reordered: three rows (fused, soft,
    fused), the first ends early, the batch compacts (DecodeBatch.compact, as the server does), and each
    row still decodes what it decodes alone."""
    from .inference.engine import Engine, SamplingParams
    name = "feedback_batch_reorder"
    if run.model.feedback is None:
        return CheckResult.not_applicable(name, NO_FEEDBACK)
    engine = Engine.from_run(run, exit=f"fixed:{run.recipe.depth.rounds}")
    ids = _sample_ids(run, 12)
    prompts = [ids[0, :5].tolist(), ids[1, :9].tolist(), ids[0, 3:10].tolist()]
    sp = [SamplingParams(max_new_tokens=n, stop_at_eos=False, prompt_mode=m)
          for n, m in ((2, "fused"), (6, "soft"), (6, "fused"))]
    alone = [engine.generate([p], s)[0].tokens for p, s in zip(prompts, sp)]
    batch = engine.batch(prompts, sp)
    owner, toks, moved = {0: 0, 1: 1, 2: 2}, {0: [], 1: [], 2: []}, {}
    while not batch.finished:
        for ev in batch.step():
            toks[owner[ev.row]].append(ev.token)
        step_moved = batch.compact()
        if step_moved:
            moved.update({owner[old]: new for old, new in step_moved.items()})
            owner = {step_moved.get(b, b): r for b, r in owner.items()}
    got = [toks[i] for i in range(3)]
    return CheckResult(name, bool(moved) and got == alone,
                       f"after the first row ended the batch {'compacted (requests moved to rows ' + str(moved) + ')' if moved else 'did NOT compact'}; "
                       f"every row {'decodes as alone' if got == alone else 'DIFFERS from alone'}", MEASURED)


# -- recirculation in a frozen model (inference/recirculation.py): the seeds' traps, measured on the run's model --
#
# Each check runs the cached engine under one default setting: d = the first core visit (visit P: the first
# block of round 1, which is visit 0 when the model has no prelude), s = the last core visit (round R's last
# block), alpha RECIRC_ALPHA, beta 1 - alpha, no ramp, the serial schedule. That pair refines the loop's
# first state with its last one, the seeds' "deeper into earlier" through the whole shared core; with a single
# core visit (K = R = 1) the source is the last visit (the coda's) or, without a coda, the destination is the
# prelude's last block. The engine runs at the nominal depth with exit fixed:R (an early-exit recipe's policy
# is replaced: recirculation needs every visit at every position, and the engine refuses exits with it).

RECIRC_ALPHA = 0.5
"""The checks' source weight: strong enough that refined history moves every later position's logits far
beyond rounding (the seeds' calibrated 0.15 moves them too, by less), so "differs" and "equals" are never
confused; the checks measure the schedule, not the setting's quality."""


class _Recirc(NamedTuple):
    name: str
    plain: Any             # the run's engine without recirculation (exit fixed:R, full caches)
    engine: Any            # the same with the default Recirculation
    rc: Any
    d: int
    s: int
    R: int
    where: str             # the setting, for the detail


def _recirculation_pair(cfg: Any, R: int) -> tuple[int, int] | None:
    """(d, s), the checks' default visits (see above); None when the model runs a single visit."""
    from .model.visits import visit_plan
    plan = visit_plan(cfg, R)
    core = [v.index for v in plan if v.part == "core"]
    d, s = core[0], core[-1]
    if s > d:
        return d, s
    if len(plan) - 1 > d:                 # one core visit: the coda's last as the source
        return d, len(plan) - 1
    return (d - 1, d) if d > 0 else None  # ... or, without a coda, the prelude's last as the destination


def _recirculation_setup(run: Run, name: str) -> "_Recirc | CheckResult":
    """The engines a recirculation check measures, or why recirculation cannot run on this run."""
    from .errors import UserError
    from .inference.engine import Engine
    from .inference.recirculation import Recirculation
    from .model.visits import visit_plan
    if run.model.feedback is not None:
        return CheckResult.not_applicable(name, "the model has full-bandwidth feedback: each position carries a second "
                                                "stream of state, and the engine refuses recirculation with it")
    if run.recipe.model.mor != "none":
        return CheckResult.not_applicable(name, "a Mixture-of-Recursions router gives each token its own depth, so the "
                                                "visits differ per token; the engine refuses recirculation with it")
    R = run.recipe.depth.rounds
    pair = _recirculation_pair(run.model.cfg, R)
    if pair is None:
        return CheckResult.not_applicable(name, "the model runs a single block visit: there is no pair d < s to mix")
    d, s = pair
    rc = Recirculation(source=s, dest=d, alpha=RECIRC_ALPHA, schedule="serial")     # the reference schedule
    fixed = dict(exit=f"fixed:{R}", exit_in_prefill=False)      # every visit at every position
    try:
        plain, engine = Engine.from_run(run, **fixed), Engine.from_run(run, **fixed, recirculation=rc)
    except UserError as err:
        return CheckResult.not_applicable(name, f"the engine refuses recirculation on this run: {err}")
    plan = visit_plan(run.model.cfg, R)
    where = f"d = visit {plan[d]}, s = visit {plan[s]}, alpha {rc.alpha}, beta 1 - alpha, {R} rounds"
    return _Recirc(name, plain, engine, rc, d, s, R, where)


def _recirculation_check(name: str) -> Callable[[Callable[[Run, _Recirc], CheckResult]], Callable[[Run], CheckResult]]:
    """A recirculation check: its setup (or not applicable), inference mode, and a schedule that raises (a
    source or destination it never captured, a cache it refuses) reported as a failure, not a crash of
    `looplm check`."""
    import functools

    def wrap(fn: Callable[[Run, _Recirc], CheckResult]) -> Callable[[Run], CheckResult]:
        @functools.wraps(fn)
        def check(run: Run) -> CheckResult:
            rx = _recirculation_setup(run, name)
            if isinstance(rx, CheckResult):
                return rx
            try:
                with torch.inference_mode():
                    return fn(run, rx)
            except (KeyError, IndexError, RuntimeError, ValueError) as err:     # UserError is a ValueError
                return CheckResult(name, False, f"{rx.where}: the schedule raised {type(err).__name__}: {err}",
                                   MEASURED)
        return check
    return wrap


def _by_position(fn: Callable[[int, torch.Tensor], torch.Tensor]) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """A tap that knows its visit by counting block calls in execution order (fn(j, h) at the j-th call),
    not by the slot: the hand schedules' independent way of finding d and s."""
    seen = [0]

    def tap(slot: Any, h: torch.Tensor) -> torch.Tensor:
        seen[0] += 1
        return fn(seen[0] - 1, h)
    return tap


def _mix_by_hand(h_d: torch.Tensor, h_s: torch.Tensor, rc: Any) -> torch.Tensor:
    """The seeds' mix written out (float32 norms): beta h_d + alpha h_s |h_d| / max(|h_s|, eps), per token;
    the checks' setting has no ramp and beta = 1 - alpha at every position."""
    d, s = h_d.float(), h_s.float()
    scaled = s * (torch.linalg.vector_norm(d, dim=-1, keepdim=True)
                  / torch.linalg.vector_norm(s, dim=-1, keepdim=True).clamp_min(rc.eps))
    return ((1.0 - rc.alpha) * d + rc.alpha * scaled).to(h_d.dtype)


def _hand_position(rx: _Recirc, x: torch.Tensor, t: int, cache: Any, stale: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Position t of the serial schedule run by hand on the plain engine's chunks: pass 1 at column t on
    `cache` (the residuals after the d-th and s-th block calls kept), the mix written out, pass 2 at column t
    with the mix in place of the d-th call's output, writing into `cache`, or with stale into a throwaway
    copy of it (later positions then read pass 1's entries). Returns (pass 1's, pass 2's logits), (B, V)."""
    k, col, held = rx.plain.kernels(), x[:, t:t + 1], {}

    def capture(j: int, h: torch.Tensor) -> torch.Tensor:
        if j in (rx.d, rx.s):
            held[j] = h
        return h
    with k.tapping(_by_position(capture)):
        first = rx.plain.chunk(col, t, cache, phase="prefill").logits
    refined = _mix_by_hand(held[rx.d], held[rx.s], rx.rc)
    with k.tapping(_by_position(lambda j, h: refined if j == rx.d else h)):
        second = rx.plain.chunk(col, t, copy.deepcopy(cache) if stale else cache, phase="prefill").logits
    return first, second


class _TapCall(NamedTuple):
    slot: tuple
    h: torch.Tensor          # the residual the tap received (after the block)
    out: torch.Tensor        # what the tap returned: what the next block reads


def _observe_taps(engine: Any) -> list[list[_TapCall]]:
    """Record what the schedule's taps see and return on this engine (one a check built for itself): every
    `tapping` session it opens (two per position under the serial schedule: the ordinary pass's capture, the
    refinement's replace) becomes a list of its block calls in execution order."""
    k = engine.kernels()
    real, sessions = k.tapping, []

    def tapping(tap: Any) -> Any:
        calls: list[_TapCall] = []
        sessions.append(calls)

        def seen(slot: Any, h: torch.Tensor) -> torch.Tensor:
            out = tap(slot, h)
            calls.append(_TapCall(tuple(slot), h.clone(), out.clone()))
            return out
        return real(seen)
    k.tapping = tapping            # on this engine's own kernels only
    return sessions


def _tol(t: torch.Tensor) -> float:
    """What "equal" allows between two runs of the same arithmetic in another order, at t's scale: 1e-5
    relative in float32 (1e-2 in a half type), at least an absolute 1e-5."""
    rel = 1e-5 if t.dtype in (torch.float32, torch.float64) else 1e-2
    return rel * max(1.0, t.detach().abs().max().item())


@_recirculation_check("recirculation_visit_indexing")
def check_recirculation_visit_indexing(run: Run, rx: _Recirc) -> CheckResult:
    """Visits are indexed once, by execution order: in every pass the schedule runs (the ordinary pass and
    the refinement, at each of 3 positions), the block calls number P + R K + C, counted here from the
    model's shape; the j-th call carries the slot of visit j of the plan, and the index functions the
    schedule uses (visit_index of model/visits.py and the one recirculation.py calls) name it j; the
    refinement replaces the output of the d-th call and no other, and the ordinary pass changes none."""
    from .inference import recirculation as rcm
    from .model import visits
    cfg, R, T = run.model.cfg, rx.R, 3
    n = cfg.n_prelude + R * cfg.n_core + cfg.n_coda
    plan = visits.visit_plan(cfg, R)
    sessions = _observe_taps(rx.engine)
    rx.engine.run_chunk(_sample_ids(run, T)[:1], 0, rx.engine.new_cache(1, T), phase="prefill", all_logits=True)
    bad = []
    if [v.index for v in plan] != list(range(n)):
        bad.append(f"the plan lists visits {[v.index for v in plan]}, not 0..{n - 1}")
    if len(sessions) != 2 * T:
        bad.append(f"{len(sessions)} tapped passes for {T} positions (an ordinary pass and a refinement each: {2 * T})")
    for p, calls in enumerate(sessions):
        what = f"position {p // 2} {'refinement' if p % 2 else 'ordinary pass'}"
        if len(calls) != n:
            bad.append(f"{what}: {len(calls)} block calls, not P + R K + C = {n}")
        for j, c in enumerate(calls):
            named = {visits.visit_index(c.slot, cfg, R), rcm.visit_index(c.slot, cfg, R)}
            if named != {j} or j >= len(plan) or plan[j].slot != c.slot:
                bad.append(f"{what}: call {j} carries slot {c.slot}, indexed {sorted(named)}, "
                           f"the plan's visit {j} is {plan[j].slot if j < len(plan) else 'missing'}")
                break
        changed = [j for j, c in enumerate(calls) if not torch.equal(c.h, c.out)]
        if changed != ([rx.d] if p % 2 else []):
            bad.append(f"{what}: calls {changed} had their output replaced (want {[rx.d] if p % 2 else []})")
    P, K, C = cfg.n_prelude, cfg.n_core, cfg.n_coda
    return CheckResult(rx.name, not bad,
                       f"{rx.where}: {T} positions x 2 passes, each {n} block calls (P + R K + C = {P} + {R}x{K} + "
                       f"{C}), call j carrying visit j's slot, the refinement replacing call {rx.d} only"
                       if not bad else f"{rx.where}: {len(bad)} problems, first " + "; ".join(bad[:2]), MEASURED)


@_recirculation_check("recirculation_norm_clamp")
def check_recirculation_norm_clamp(run: Run, rx: _Recirc) -> CheckResult:
    """The mix the schedule calls (recirculation.mix) at its edges, on the run's own residuals after visits d
    and s: a zero source gives finite output equal to beta h_d (a zero norm is clamped to eps, never divided
    by); a source of norm 1e-3 (small, above eps) is scaled to exactly |h_d| per token; one of norm eps / 100
    (below the clamp) is scaled by |h_d| / eps, finite — each against the formula written out here."""
    from .inference import recirculation as rcm
    held: dict[int, torch.Tensor] = {}

    def capture(j: int, h: torch.Tensor) -> torch.Tensor:
        if j in (rx.d, rx.s):
            held[j] = h
        return h
    x = _sample_ids(run, min(8, run.model.cfg.context))
    with rx.plain.kernels().tapping(_by_position(capture)):
        rx.plain.chunk(x, 0, rx.plain.new_cache(*x.shape), phase="prefill")
    h_d, h_s, eps, a = held[rx.d], held[rx.s], rx.rc.eps, rx.rc.alpha
    norm_d = torch.linalg.vector_norm(h_d.float(), dim=-1, keepdim=True)                    # (B, T, 1)
    unit = h_s.float() / torch.linalg.vector_norm(h_s.float(), dim=-1, keepdim=True)
    zero = rcm.mix(h_d, torch.zeros_like(h_s), a, 1.0 - a, eps).float()
    zero_gap = (zero - (1.0 - a) * h_d.float()).abs().max().item() if bool(zero.isfinite().all()) else float("inf")
    small = rcm.mix(h_d, (unit * 1e-3).to(h_s.dtype), 1.0, 0.0, eps).float()                # alpha 1, beta 0: the
    ratio = (torch.linalg.vector_norm(small, dim=-1, keepdim=True) / norm_d - 1).abs().max().item()  # scaled source
    tiny = (unit * eps / 100).to(h_s.dtype)
    under = rcm.mix(h_d, tiny, 1.0, 0.0, eps).float()
    under_gap = ((under - tiny.float() * norm_d / eps).abs().max().item() if bool(under.isfinite().all())
                 else float("inf"))
    tol, rel = _tol(h_d), (1e-5 if h_d.dtype == torch.float32 else 1e-2)
    ok = zero_gap <= tol and ratio <= rel and under_gap <= tol
    return CheckResult(rx.name, ok,
                       f"{rx.where}; on {h_d.shape[0] * h_d.shape[1]} tokens' residuals (inf: an output not "
                       f"finite): a zero source vs beta h_d: max |diff| {zero_gap:.1e}; a source of norm 1e-3 scaled "
                       f"to |h_d| within {ratio:.1e} (relative); a source of norm eps/100 vs |h_d|/eps scaling: max "
                       f"|diff| {under_gap:.1e}", MEASURED)


@_recirculation_check("recirculation_cache_refresh")
def check_recirculation_cache_refresh(run: Run, rx: _Recirc) -> CheckResult:
    """After a position is refined, later positions attend to the refined entries: the engine's logits over a
    sample (one prompt, serial schedule) against the schedule run by hand here (pass 1, the mix written out,
    pass 2 writing into the cache) — equal at every position — and against the same by hand with pass 2
    writing into a throwaway copy of the cache (stale history), which must differ at every position after
    the first (the first has no history: equal in both)."""
    x = _sample_ids(run, min(8, run.model.cfg.context))
    B, T = x.shape
    got = rx.engine.run_chunk(x, 0, rx.engine.new_cache(B, T), phase="prefill", all_logits=True).logits   # (B, T, V)
    fresh, stale = rx.plain.new_cache(B, T), rx.plain.new_cache(B, T)
    want = torch.stack([_hand_position(rx, x, t, fresh)[0] for t in range(T)], 1)
    old = torch.stack([_hand_position(rx, x, t, stale, stale=True)[0] for t in range(T)], 1)
    tol = _tol(want)
    same = (got - want).abs().max().item()
    gaps = (got - old).abs().amax(dim=(0, 2))                                               # (T,)
    first = gaps[0].item()
    later = gaps[1:].min().item() if T > 1 else float("inf")
    ok = same <= tol and first <= tol and later > tol
    return CheckResult(rx.name, ok,
                       f"{rx.where}; {T} positions: the engine vs the schedule by hand, refinement written into the "
                       f"cache: max |logit diff| {same:.1e}; vs refinement into a throwaway copy (stale history): "
                       f"{first:.1e} at position 0, smallest over positions 1..{T - 1} {later:.1e} "
                       f"(must exceed {tol:.0e})", MEASURED)


@_recirculation_check("recirculation_readout_boundary")
def check_recirculation_readout_boundary(run: Run, rx: _Recirc) -> CheckResult:
    """The logits returned at each position are the ordinary pass's given the refined history, not the
    refinement pass's: before the engine runs position t (one column at a time, as decoding does), the plain
    engine's chunk at column t runs on a copy of the engine's cache (columns < t: the recirculated history)
    and must give the returned logits; the refinement pass, run by hand on another copy, must give others."""
    x = _sample_ids(run, min(8, run.model.cfg.context))
    B, T = x.shape
    cache = rx.engine.new_cache(B, T)
    same, apart = 0.0, float("inf")
    tol = 0.0
    for t in range(T):
        ordinary = rx.plain.chunk(x[:, t:t + 1], t, copy.deepcopy(cache), phase="prefill").logits      # (B, V)
        refinement = _hand_position(rx, x, t, copy.deepcopy(cache))[1]
        got = rx.engine.run_chunk(x[:, t:t + 1], t, cache, phase="prefill").logits
        tol = max(tol, _tol(ordinary))
        same = max(same, (got - ordinary).abs().max().item())
        apart = min(apart, (got - refinement).abs().max().item())
    return CheckResult(rx.name, same <= tol and apart > tol,
                       f"{rx.where}; {T} positions decoded one at a time: returned logits vs the ordinary pass on the "
                       f"recirculated history: max |diff| {same:.1e}; vs the refinement pass's: smallest max |diff| "
                       f"{apart:.1e} (must exceed {tol:.0e})", MEASURED)


@_recirculation_check("recirculation_no_cross_token_leak")
def check_recirculation_no_cross_token_leak(run: Run, rx: _Recirc) -> CheckResult:
    """Only position t's own states are mixed into t: the value the refinement puts in place of visit d at
    position t (observed through the engine's own taps) equals the mix written out from the residuals the
    ordinary pass at t had after visits d and s (not those of t - 1: the withdrawn result's leak); and
    changing the tokens from position t on changes no logit before t (the refinement reads no later state)."""
    x = _sample_ids(run, min(8, run.model.cfg.context))
    B, T = x.shape
    sessions = _observe_taps(rx.engine)
    logits = rx.engine.run_chunk(x, 0, rx.engine.new_cache(B, T), phase="prefill", all_logits=True).logits
    if len(sessions) != 2 * T or any(len(c) <= max(rx.d, rx.s) for c in sessions):
        return CheckResult(rx.name, False, f"{rx.where}: {len(sessions)} tapped passes for {T} positions, not an "
                                           "ordinary pass and a refinement each", MEASURED)
    own, prev = 0.0, float("inf")
    for t in range(T):
        first, second = sessions[2 * t], sessions[2 * t + 1]
        used = second[rx.d].out.float()
        want = _mix_by_hand(first[rx.d].h, first[rx.s].h, rx.rc).float()
        own = max(own, (used - want).abs().max().item() / max(1.0, want.abs().max().item()))
        if t:       # what the leak would have used: the source of the position before
            leak = _mix_by_hand(first[rx.d].h, sessions[2 * t - 2][rx.s].h, rx.rc).float()
            prev = min(prev, (used - leak).abs().max().item() / max(1.0, want.abs().max().item()))
    cut = T // 2
    other = x.clone()
    other[:, cut:] = _sample_ids(run, T, seed=1)[:, cut:]
    moved = rx.engine.run_chunk(other, 0, rx.engine.new_cache(B, T), phase="prefill", all_logits=True).logits
    before = (moved[:, :cut] - logits[:, :cut]).abs().max().item()
    after = (moved[:, cut:] - logits[:, cut:]).abs().max().item()
    rel = 1e-5 if logits.dtype == torch.float32 else 1e-2
    ok = own <= rel and prev > rel and before <= 1e-6 and after > 0
    return CheckResult(rx.name, ok,
                       f"{rx.where}; {T} positions: the refined value at d vs the mix of the position's own states "
                       f"(relative max |diff|) {own:.1e}, vs a mix with the previous position's source {prev:.1e} "
                       f"(must differ); changing tokens {cut}.. moves logits before {cut} by {before:.1e} (must be "
                       f"0) and after by {after:.1e}", MEASURED)


@_recirculation_check("recirculation_resume_exact")
def check_recirculation_resume(run: Run, rx: _Recirc) -> CheckResult:
    """The faster exact schedule (resume: the second pass starts after d from the first pass's outputs, no LM
    head) against the reference the other checks measure (serial: the whole model again): the same logits at
    every position of a window, and the blocks that actually ran — counted by forward hooks on the model's
    blocks — are the reference's minus the d + 1 visits per position it supplies."""
    import dataclasses

    from .inference.engine import Engine
    T = 8
    fast = Engine.from_run(run, exit=f"fixed:{rx.R}", exit_in_prefill=False,
                           recirculation=dataclasses.replace(rx.rc, schedule="resume"))
    blocks = [*run.model.prelude, *run.model.core, *run.model.coda]
    x = _sample_ids(run, T)[:1]
    got, calls = {}, [0]
    hooks = [b.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for b in blocks]
    try:
        for name, eng in (("serial", rx.engine), ("resume", fast)):
            calls[0] = 0
            got[name] = (eng.run_chunk(x, 0, eng.new_cache(1, T), phase="prefill", all_logits=True).logits, calls[0])
    finally:
        for h in hooks:
            h.remove()
    n = run.model.cfg.n_prelude + rx.R * run.model.cfg.n_core + run.model.cfg.n_coda                # visits per pass
    diff = (got["serial"][0] - got["resume"][0]).abs().max().item()
    want = (2 * T * n, T * (2 * n - rx.d - 1))
    ok = diff <= 1e-5 and (got["serial"][1], got["resume"][1]) == want
    return CheckResult(rx.name, ok,
                       f"{rx.where}; {T} positions: resume vs serial max |logit diff| {diff:.1e}; blocks run "
                       f"{got['resume'][1]} vs {got['serial'][1]} (want {want[1]} vs {want[0]}: {rx.d + 1} visits and "
                       f"the head per position not recomputed)", MEASURED)


CHECKS: list[Callable[[Run], CheckResult]] = [
    check_causality, check_shared_parameters, check_untied_parity, check_state_stability,
    check_flops_count_every_visit, check_backward_window_measured, check_backward_window, check_exit_masses,
    check_token_accounting, check_engine_request_reset, check_round_telemetry, check_quantile_thresholds,
    check_cache_policies, check_state_dependency, check_start_state, check_routed_decode,
    check_feedback_shift, check_feedback_start, check_feedback_loss, check_feedback_isolation,
    check_feedback_reorder, check_recirculation_visit_indexing, check_recirculation_norm_clamp,
    check_recirculation_cache_refresh, check_recirculation_readout_boundary, check_recirculation_no_cross_token_leak,
    check_recirculation_resume,
]


def run_checks(run: Run) -> list[CheckResult]:
    return [check(run) for check in CHECKS]
