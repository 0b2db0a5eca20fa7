"""The loop's own properties, measured on the run: causality, one shared core, parity with an untied
stack, state stability, FLOPs over every visit, the backward window, exit masses, caches, token
accounting, engine resets, telemetry, the start state and routed decoding."""

from __future__ import annotations

import copy
from collections import Counter
from typing import NamedTuple

import torch

from ..model.looped import LoopedLM, untied_copy
from ..runs.checkpoint import Run
from .base import MEASURED, RECORD, STATE_GROWTH_LIMIT, CheckResult, _logits, _sample_ids


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
    from ..train.trainer import make_optimizer
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
    from ..model.flops import pass_flops, train_flops_per_token
    from ..train.trainer import Counters, train_step
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
    from ..recipe.config import SupervisionConfig
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
    from ..model.losses import placement
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
    from ..train.trainer import Counters, train_step
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
    from ..halting import hazards_to_masses
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
    from ..inference.early_exit import early_exit
    from ..halting import parse_exit_policy
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
    from ..evaluation.cache_policies import continuation_loss, forward_loss
    from ..inference.engine import Engine
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
    if run.recipe.model.kv_sharing == "first":    # trained to read round 1's entries: one policy is its function
        got = continuation_loss(Engine.from_run(run, exit=f"fixed:{R}"), batches)["loss"]
        ref = forward_loss(run.model, batches, R)
        return CheckResult(name, abs(got - ref) <= 1e-4,
                           f"trained with model.kv_sharing = first: decoded under cache policy first (prompt and "
                           f"decode, the only policy that is its function) {got:.4f} vs plain forward {ref:.4f} at "
                           f"{R} rounds; other policies are refused, so there is no saving to weigh", MEASURED)

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
    from ..data.text import TokenSampler, open_tokens
    from ..train.depth import sample_depth
    from ..train.trainer import feedback_plan
    r, accum = run.recipe, run.recipe.train.grad_accum
    sampler = TokenSampler(open_tokens(run.path / "data" / "train.bin"), r.data.seq_len, r.train.batch_size,
                           r.train.seed)
    batches = []
    for step, micro in indices:
        x, _ = sampler.batch(step * accum + micro)                    # (batch_size, seq_len), no padding
        rounds = sample_depth(r.depth, r.train.seed, step, micro, r.train.steps)
        batches.append(_MicroBatch(x.numel(), x.numel(), rounds,
                                   feedback_plan(r, x, step, micro, run.tokenizer.eos_id)[0]))
    return batches, sampler.unique_tokens()


def _replay_task(run: Run, indices: list[tuple[int, int]]) -> tuple[list[_MicroBatch], int]:
    """Task data: each micro-batch's examples drawn again and tokenized here; a row of n = prompt +
    answer tokens is n - 1 inputs, padded to the batch's longest row; depths from the batch's own
    plan (data.depth_by_difficulty) or the recipe's sampler. Returns (micro-batches, unique tokens of
    the distinct examples)."""
    from ..data.taskdata import TaskSampler, TaskSource, format_for_training
    from ..train.depth import sample_depth
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
                  else sample_depth(r.depth, r.train.seed, step, micro, r.train.steps))
        batches.append(_MicroBatch(sum(n) - len(n), len(n) * (max(n) - 1), rounds))
    return batches, sum(distinct.values())


def check_token_accounting(run: Run) -> CheckResult:
    """The record against a replay of the run's data: every micro-batch the recipe trained (train.steps x
    grad_accum, a resumed run's included: its counters resume with it) is drawn again, its real
    (non-padding) inputs and inputs x rounds counted here, and the sums must be report.json's
    tokens_seen and token_passes; the depths, its depth_histogram; the distinct tokens, its
    unique_tokens (<= train_data_tokens). A stage-II or --init run counts only its own steps, as its
    trainer does (its counters start at zero)."""
    from ..errors import UserError
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
    from ..inference.engine import Engine, SamplingParams
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
    import math
    name = "round_telemetry_present"
    if _imported(run):
        return CheckResult.not_applicable(name, IMPORTED)
    from ..runs.checkpoint import read_metrics
    if not (run.path / "metrics.jsonl").is_file():
        return CheckResult(name, False, "the run has no metrics.jsonl", RECORD)
    rows = read_metrics(run.path)
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
    from ..inference.engine import Engine
    name = "routed_decode_matches_training"
    if run.recipe.model.mor == "none":
        return CheckResult.not_applicable(name, "no Mixture-of-Recursions router")
    m = run.model
    ids = _sample_ids(run, min(20, m.cfg.context))[:1]
    full = m(ids)
    engine = Engine.from_run(run)
    with torch.inference_mode():
        logits, used = engine.score(ids, 0)                             # (1, T, V), (1, T): one column at a time
    worst = (logits[0] - full.logits[0]).abs().max().item()
    depths = used[0].tolist()
    same = depths == full.rounds_used[0].tolist()
    return CheckResult(name, same and worst <= 1e-3,
                       f"{len(depths)} tokens decoded one at a time under the {m.cfg.mor_cache} cache rule: depths "
                       f"{'equal' if same else 'DIFFER from'} the forward pass's (mean {sum(depths) / len(depths):.2f}); "
                       f"max |logit difference| {worst:.2e}", MEASURED)
