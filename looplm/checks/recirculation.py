"""Recirculation in a frozen model (inference/recirculation.py): the seeds' traps, measured on the run's model."""

from __future__ import annotations

import copy
from typing import Any, Callable, NamedTuple

import torch

from ..runs.checkpoint import Run
from .base import MEASURED, CheckResult, _sample_ids


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
    from ..model.visits import visit_plan
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
    from ..errors import UserError
    from ..inference.engine import Engine
    from ..inference.recirculation import Recirculation
    from ..model.visits import visit_plan
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
    from ..inference import recirculation as rcm
    from ..model import visits
    cfg, R, T = run.model.cfg, rx.R, 3
    n = cfg.n_prelude + R * cfg.n_core + cfg.n_coda
    plan = visits.visit_plan(cfg, R)
    sessions = _observe_taps(rx.engine)
    rx.engine.score(_sample_ids(run, T)[:1], T, prompt_logits=True)
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
    from ..inference import recirculation as rcm
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
    got = rx.engine.score(x, T, prompt_logits=True)[0]                                   # (B, T, V)
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
    logits = rx.engine.score(x, T, prompt_logits=True)[0]
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
    moved = rx.engine.score(other, T, prompt_logits=True)[0]
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

    from ..inference.engine import Engine
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
            got[name] = (eng.score(x, T, prompt_logits=True)[0], calls[0])
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
