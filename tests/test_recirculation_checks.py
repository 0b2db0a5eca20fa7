"""`looplm check`'s recirculation checks (checks/recirculation.py) on a tiny model: each passes, each fails on its own bug
patched into the schedule (inference/recirculation.py) or the engine, and says not applicable where the
engine cannot recirculate; and the server under recirculation gives each request what the engine gives it
alone."""

from __future__ import annotations

import copy

import pytest
import torch

import looplm
import looplm.inference.recirculation as rcm
from looplm import checks
from looplm.data.tokenizer import ByteTokenizer
from looplm.inference import Engine, GenerationConfig
from looplm.inference.recirculation import Recirculation, mix
from looplm.model import visits
from looplm.runs.checkpoint import Run

# P = 1, K = 2, C = 1 at R = 2: six visits; the checks' default pair is d = 1 (round 1's first block), s = 4
TINY = {"model.d_model": 32, "model.n_heads": 2, "model.context": 32, "model.n_prelude": 1, "model.n_core": 2,
        "model.n_coda": 1, "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 2,
        "backward.window": "all", "exit.min_rounds": 1, "data.seq_len": 32}

RECIRCULATION_CHECKS = [checks.check_recirculation_visit_indexing, checks.check_recirculation_norm_clamp,
                        checks.check_recirculation_cache_refresh, checks.check_recirculation_readout_boundary,
                        checks.check_recirculation_no_cross_token_leak]


def tiny_run(**fields) -> Run:
    recipe = looplm.load_recipe("quickstart", {**TINY, **fields})
    torch.manual_seed(0)
    return Run(path=None, recipe=recipe, model=looplm.build_model(recipe).eval(), tokenizer=ByteTokenizer(), report={})


def test_the_recirculation_checks_pass_on_a_tiny_model():
    run = tiny_run()
    for check in RECIRCULATION_CHECKS:
        result = check(run)
        assert result.status == "pass" and result.kind == "measured", (check.__name__, result.detail)
        assert "d = visit 1: core round 1 block 0, s = visit 4: core round 2 block 1" in result.detail
    names = [c.__name__ for c in checks.CHECKS]
    assert all(c.__name__ in names for c in RECIRCULATION_CHECKS)


@pytest.mark.parametrize("fields,pair", [
    ({"model.untied": True}, "d = visit 1: core round 1 block 0, s = visit 4"),
    ({"model.n_prelude": 0}, "d = visit 0: core round 1 block 0, s = visit 3"),      # no prelude: d is visit 0
    ({"exit.gate": True, "supervision.kind": "learned_exit", "exit.policy": "quantile:0.5"}, "s = visit 4"),
])
def test_runs_the_engine_can_recirculate_are_measured(fields, pair):
    """An untied baseline, a model without a prelude, an early-exit recipe (its engine is built with exit
    fixed:R): the schedule runs, so the checks do."""
    run = tiny_run(**fields)
    for check in (checks.check_recirculation_visit_indexing, checks.check_recirculation_cache_refresh):
        result = check(run)
        assert result.status == "pass", (check.__name__, result.detail)
        assert pair in result.detail


@pytest.mark.parametrize("fields,why", [
    ({"feedback.mode": "gate"}, "full-bandwidth feedback"),
    ({"model.mor": "token_choice"}, "Mixture-of-Recursions"),
    ({"model.n_prelude": 0, "model.n_core": 1, "model.n_coda": 0, "depth.rounds": 1}, "single block visit"),
])
def test_the_checks_say_not_applicable_where_recirculation_cannot_run(fields, why):
    run = tiny_run(**fields)
    for check in RECIRCULATION_CHECKS:
        result = check(run)
        assert result.status == "not applicable" and result.passed is None and why in result.detail, result.detail


def test_each_recirculation_check_fails_on_its_bug(monkeypatch):
    """Each check against its bug: a visit index by another formula, a mix without the norm clamp, refinement
    entries that never reach the cache, the readout taken from the refinement pass, the previous position's
    source mixed into this one."""
    run = tiny_run()
    real_index, real_schedule = visits.visit_index, rcm.schedule

    def block_major(slot, cfg, rounds):          # core visits counted block by block instead of round by round
        part, r, i = slot
        return cfg.n_prelude + i * rounds + (r - 1) if part == "core" else real_index(slot, cfg, rounds)

    def off_by_a_round(slot, cfg, rounds):       # round r counted from 0: d is never found
        part, r, i = slot
        return cfg.n_prelude + r * cfg.n_core + i if part == "core" else real_index(slot, cfg, rounds)
    # block-major agrees on the default pair's two visits (1 and 4), so the schedule itself still runs; the
    # check sees the visits between named wrongly
    assert [block_major(v.slot, run.model.cfg, 2) for v in visits.visit_plan(run.model.cfg, 2)] == [0, 1, 3, 2, 4, 5]
    for wrong in (block_major, off_by_a_round):
        with monkeypatch.context() as mp:
            mp.setattr(rcm, "visit_index", wrong)
            broken = checks.check_recirculation_visit_indexing(run)
            assert broken.status == "fail", broken.detail
    assert "the schedule raised" in broken.detail      # off by a round: a failure said as one, not a crash

    with monkeypatch.context() as mp:                   # |h_s| divided by as it is: a zero source gives NaN
        def unclamped(h_dst, h_src, alpha, beta, eps=1e-6):
            d, s = h_dst.float(), h_src.float()
            scaled = s * (d.norm(dim=-1, keepdim=True) / s.norm(dim=-1, keepdim=True))
            return (beta * d + alpha * scaled).to(h_dst.dtype)
        mp.setattr(rcm, "mix", unclamped)
        broken = checks.check_recirculation_norm_clamp(run)
        assert broken.status == "fail" and "inf" in broken.detail, broken.detail

    with monkeypatch.context() as mp:                   # the refinement pass writes into a throwaway copy
        real_chunk = Engine.chunk

        def into_a_copy(self, idx, start, cache, **kw):
            if getattr(self.kernels().tap, "__name__", "") == "replace":
                cache = copy.deepcopy(cache)
            return real_chunk(self, idx, start, cache, **kw)
        mp.setattr(Engine, "chunk", into_a_copy)
        broken = checks.check_recirculation_cache_refresh(run)
        assert broken.status == "fail", broken.detail

    with monkeypatch.context() as mp:                   # the logits returned are the refinement pass's
        def refinement_readout(run_pass, *args, **kwargs):
            second = []

            def both(x, col, tap):
                out = run_pass(x, col, tap)
                if tap.__name__ == "replace":
                    second.append(out)
                return out
            real_schedule(both, *args, **kwargs)
            return second
        mp.setattr(rcm, "schedule", refinement_readout)
        broken = checks.check_recirculation_readout_boundary(run)
        assert broken.status == "fail", broken.detail

    with monkeypatch.context() as mp:                   # the withdrawn leak: position t - 1's source in t's mix
        held = {}

        def leaky(h_dst, h_src, alpha, beta, eps=1e-6):
            src, held["s"] = held.get("s", h_src), h_src
            return mix(h_dst, src, alpha, beta, eps)
        mp.setattr(rcm, "mix", leaky)
        broken = checks.check_recirculation_no_cross_token_leak(run)
        assert broken.status == "fail", broken.detail

    for check in RECIRCULATION_CHECKS:                  # and nothing stays broken
        assert check(run).passed, check.__name__


def test_two_concurrent_server_requests_with_recirculation_each_equal_the_engine_alone():
    """Two prompts of different lengths in flight together (left padding, per-row positions under a ramp) each
    get what the engine gives them alone; the same request without recirculation gets other log-probabilities."""
    import asyncio

    import httpx

    from looplm.inference import SamplingParams
    from looplm.serve import ServeLimits, create_app
    model = tiny_run().model
    rc = Recirculation(source=4, dest=1, alpha=0.5, ramp=3)
    engine = Engine(model, ByteTokenizer(), GenerationConfig(recirculation=rc))
    asks = [{"prompt": "def main(", "max_tokens": 6, "temperature": 0, "logprobs": 1},
            {"prompt": "import sys, os", "max_tokens": 6, "temperature": 0, "logprobs": 1}]

    async def served(app, requests):
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return [r.json()["choices"][0] for r in
                        await asyncio.gather(*(c.post("/v1/completions", json=a, timeout=60) for a in requests))]
    got = asyncio.run(served(create_app(engine, limits=ServeLimits(batch_window_ms=50)), asks))
    alone = [engine.generate([a["prompt"]], SamplingParams(max_new_tokens=6, stop_at_eos=True, logprobs=1))[0]
             for a in asks]
    assert [g["text"] for g in got] == [a.text for a in alone]
    for g, a in zip(got, alone):
        assert g["logprobs"]["token_logprobs"] == pytest.approx(a.logprobs, abs=1e-5)
    plain = asyncio.run(served(create_app(Engine(model, ByteTokenizer())), asks[:1]))[0]
    gap = max(abs(p - q) for p, q in zip(plain["logprobs"]["token_logprobs"], got[0]["logprobs"]["token_logprobs"]))
    assert gap > 1e-3, gap
