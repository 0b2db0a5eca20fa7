"""Full-bandwidth feedback (model/feedback.py): the seeds' traps, measured on the run's own model."""

from __future__ import annotations

import copy

import torch

from ..runs.checkpoint import Run
from .base import MEASURED, CheckResult, _sample_ids


NO_FEEDBACK = "the model has no full-bandwidth feedback (feedback.mode = none)"


@torch.no_grad()
def check_feedback_shift(run: Run) -> CheckResult:
    """Pass 2 reads pass 1's top state of the position before, not its own: pass 2's logits against the
    model run on a state built by hand (position t gets pass 1's top at t - 1); the unshifted state (token
    t's own, the cross-token bug) must give different logits."""
    from ..model.feedback import passes_forward, plain_positions
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
    from ..model.feedback import plain_positions
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

    from ..model.feedback import passes_forward, plain_positions
    from ..recipe.config import FeedbackConfig
    from ..train.depth import depth_generator
    from ..train.trainer import Counters, train_step
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
    from ..inference.engine import Engine, SamplingParams
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
    from ..inference.engine import Engine, SamplingParams
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
