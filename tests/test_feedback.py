"""Full-bandwidth feedback (model/feedback.py) against independent computations: serial decoding written
out position by position, shift by one, the start convention, causality across passes, the seeds'
weight count, the jitter's distribution."""

from __future__ import annotations

import math

import pytest
import torch

import looplm
from looplm.model.feedback import Feedback, passes_forward, plain_positions, shift_states
from looplm.recipe.config import FeedbackConfig

EOS = 256


def tiny(mode: str = "gate", **fields):
    recipe = looplm.load_recipe("quickstart", {
        "model.d_model": 32, "model.n_heads": 2, "model.context": 32, "model.n_prelude": 1, "model.n_core": 1,
        "model.n_coda": 1, "depth.kind": "fixed", "depth.rounds": 2, "backward.window": "all",
        "exit.min_rounds": 1, "data.seq_len": 32, "feedback.mode": mode,
        **{f"feedback.{k}": v for k, v in fields.items()}})
    torch.manual_seed(0)
    model = looplm.build_model(recipe).eval()
    with torch.no_grad():               # a fusion far from its initialisation, so every path matters
        for p in model.feedback.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def ids(B=2, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (B, T), generator=g)
    x[-1, 5] = EOS                      # a document boundary in the last row
    return x


def serial(model, idx, plain):
    """Serial decoding written out: position t's input fuses position t-1's final top state, which
    was computed with its own fused input (each prefix run whole; causal, so its last position is final)."""
    B, T = idx.shape
    H = torch.zeros(B, T, model.cfg.d_model)
    logits = []
    for t in range(T):
        h_prev = torch.zeros(B, t + 1, model.cfg.d_model)
        h_prev[:, 1:] = H[:, :t]
        out = model(idx[:, :t + 1], feedback=(h_prev, plain[:, :t + 1]), keep_top=True)
        H[:, t] = out.top[:, t]
        logits.append(out.logits[:, t])
    return torch.stack(logits, 1)


@pytest.mark.parametrize("mode", ["gate", "add", "concat"])
def test_passes_equal_serial_decoding_once_k_reaches_the_length(mode):
    model = tiny(mode)
    idx = ids()
    plain = plain_positions(idx, EOS, True)
    with torch.no_grad():
        want = serial(model, idx, plain)
        T = idx.shape[1]
        full = passes_forward(model, idx, T, plain)[-1].logits
        assert (full - want).abs().max().item() < 1e-5
        # with K passes only the first K positions are serial's; later ones differ (the test can fail)
        three = passes_forward(model, idx, 3, plain)[-1].logits
        assert (three[:, :3] - want[:, :3]).abs().max().item() < 1e-5
        assert (three[:, 6:] - want[:, 6:]).abs().max().item() > 1e-3


def test_shift_by_one_against_a_hand_loop():
    """Pass 2 reads pass 1's top state of the position before, not its own or a later one's."""
    model = tiny()
    idx = ids()
    plain = plain_positions(idx, EOS, True)
    with torch.no_grad():
        first, second = passes_forward(model, idx, 2, plain)
        h = torch.zeros_like(first.top)
        for t in range(1, idx.shape[1]):                     # written out: position t reads t - 1
            h[:, t] = first.top[:, t - 1]
        assert torch.equal(shift_states(first.top), h)
        assert (model(idx, feedback=(h, plain)).logits - second.logits).abs().max().item() < 1e-6
        own = model(idx, feedback=(first.top, plain)).logits  # no shift: token t's own state (the cross-token bug)
        assert (own - second.logits).abs().max().item() > 1e-3


def test_start_convention_plain_positions_read_the_embedding():
    idx = ids()
    plain = plain_positions(idx, EOS, True)
    assert plain[:, 0].all() and plain[1, 6] and not plain[1, 5] and not plain[0, 6]   # row 1 holds the eos
    assert not plain_positions(idx, EOS, False)[1, 6]
    prefixed = plain_positions(idx, EOS, True, prefix=torch.tensor([4, 0]))
    assert prefixed[0, :4].all() and not prefixed[0, 4] and not prefixed[1, 1]
    model = tiny()
    with torch.no_grad():
        e = model.embed(idx)
        h = torch.randn(*idx.shape, model.cfg.d_model)
        x = model.feedback(e, h, plain)
        assert torch.equal(x[plain], e[plain]) and not torch.allclose(x[~plain], e[~plain])
        # what a plain position reads does not depend on the state offered to it
        h2 = h.clone()
        h2[plain] = torch.randn_like(h2[plain])
        assert torch.equal(model.feedback(e, h2, plain), x)


def test_no_future_token_reaches_an_earlier_position_through_the_passes():
    model = tiny()
    idx = ids()
    changed = idx.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 256
    with torch.no_grad():
        a = passes_forward(model, idx, 3, plain_positions(idx, EOS, True))
        b = passes_forward(model, changed, 3, plain_positions(changed, EOS, True))
        for x, y in zip(a, b):
            assert torch.equal(x.logits[:, :8], y.logits[:, :8])
            assert not torch.equal(x.logits[:, 8:], y.logits[:, 8:])


@pytest.mark.parametrize("mode, weights", [("gate", 2), ("add", 1), ("concat", 2)])
def test_extra_weights_are_the_seeds_count(mode, weights):
    fb = Feedback(1536, FeedbackConfig(mode=mode), 1e-5)
    assert sum(p.numel() for p in fb.parameters()) == weights * 1536 ** 2       # gate: 4,718,592 at d = 1536
    model = tiny(mode)
    assert model.param_groups_by_role()["feedback"] == weights * 32 ** 2


def test_jitter_is_uniform_with_the_asked_std_in_training_only():
    model = tiny(jitter=0.02)
    idx = ids(B=8, T=32)
    plain = torch.zeros_like(idx, dtype=torch.bool)
    with torch.no_grad():
        e = model.embed(idx)
        h = torch.randn(*idx.shape, model.cfg.d_model)
        clean = model.feedback(e, h, plain)
        model.train()
        noise = (model.feedback(e, h, plain, generator=torch.Generator().manual_seed(1)) - clean).flatten()
        model.eval()
    assert torch.equal(model.feedback(e, h, plain), clean)
    bound = 0.02 * math.sqrt(3)
    assert noise.abs().max().item() <= bound + 1e-6
    # uniform on [-a, a]: std a / sqrt(3) = 0.02, and a quarter of the mass in each quarter of the range
    n = noise.numel()
    assert abs(noise.std().item() - 0.02) < 4 * 0.02 / math.sqrt(2 * n) * 3
    quarters = torch.histc(noise, bins=4, min=-bound, max=bound) / n
    assert (quarters - 0.25).abs().max().item() < 4 * math.sqrt(0.25 * 0.75 / n)


def test_feedback_fields_need_a_mode():
    with pytest.raises(looplm.UserError, match="feedback.jitter"):
        looplm.load_recipe("quickstart", {"feedback.jitter": 0.02})
    with pytest.raises(looplm.UserError, match="feedback.passes"):
        looplm.load_recipe("quickstart", {"feedback.mode": "gate", "feedback.passes": [0.5, 0.2]})


def test_k_pass_training_loss_is_the_first_plus_lambda_times_the_mean_of_the_later(monkeypatch):
    """One training step's loss against a hand computation from the passes' own logits."""
    import torch.nn.functional as F

    from looplm.train.trainer import Counters, train_step
    recipe = looplm.load_recipe("quickstart", {
        "model.d_model": 32, "model.n_heads": 2, "model.context": 32, "model.n_prelude": 1, "model.n_core": 1,
        "model.n_coda": 1, "depth.kind": "fixed", "depth.rounds": 2, "backward.window": "all", "exit.min_rounds": 1,
        "model.init_state": "prelude", "data.seq_len": 16, "train.batch_size": 2, "feedback.mode": "gate",
        "feedback.passes": [0, 0, 1],
        "feedback.later_weight": 0.5})
    torch.manual_seed(0)
    model = looplm.build_model(recipe)
    x = ids(2, 16)
    y = torch.roll(x, -1, 1)
    counters = Counters()
    loss, out, info = train_step(model, recipe, x, y, 0, 0, counters, eos_id=EOS)
    model.eval()
    with torch.no_grad():
        outs = passes_forward(model, x, 3, plain_positions(x, EOS, True), rounds=2)
        ce = [F.cross_entropy(o.logits.flatten(0, 1), y.flatten()).item() for o in outs]
    assert info["loss_by_pass"] == pytest.approx(ce, abs=1e-5)
    assert loss == pytest.approx(ce[0] + 0.5 * (ce[1] + ce[2]) / 2, abs=1e-5)
    # every pass is counted: tokens once, token x rounds x passes, the pass histogram
    assert counters.tokens_seen == 32 and counters.token_passes == 32 * 2 * 3
    assert counters.pass_histogram == {3: 1} and counters.feedback_token_passes == 32 * 3
    # the gradient reaches the fusion's weights (through the later passes) and the embedding
    assert model.feedback.up.weight.grad.abs().sum() > 0 and model.feedback.gate.weight.grad.abs().sum() > 0


def test_pass_mixture_is_drawn_per_micro_batch_from_seed_and_step():
    from looplm.train.trainer import feedback_plan
    recipe = looplm.load_recipe("quickstart", {"feedback.mode": "gate", "feedback.passes": [0.75, 0.22, 0.03],
                                               "feedback.mix_from_step": 5, "feedback.prefix_mix": 0.5})
    x = ids(16, 64)
    assert feedback_plan(recipe, x, 4, 0, EOS) == (1, None)                      # plain pre-training first
    draws = [feedback_plan(recipe, x, step, 0, EOS)[0] for step in range(5, 2005)]
    assert draws == [feedback_plan(recipe, x, step, 0, EOS)[0] for step in range(5, 2005)]   # reproducible
    share = [draws.count(k) / len(draws) for k in (1, 2, 3)]
    assert share == pytest.approx([0.75, 0.22, 0.03], abs=0.035)
    plains = [feedback_plan(recipe, x, step, 0, EOS)[1] for step in range(5, 205)]
    prefixed = sum(bool(p[:, 1].any()) for p in plains) / len(plains)          # a plain prefix longer than 1
    assert 0.35 < prefixed < 0.65


@pytest.fixture(scope="module")
def feedback_lm_run(tmp_path_factory):
    """A language-model run with gate feedback, 8 steps (a pass mixture from step 2; lr 0.01, so the fusion has
    moved: two passes score 0.02 nats from one) and a random initial loop state (the quickstart's), so the
    initial-state noise convention is part of what its records say."""
    import looplm.runs.report
    from conftest import tiny_recipe, write_corpus
    from looplm.train.trainer import train
    root = tmp_path_factory.mktemp("feedback-lm")
    recipe = tiny_recipe(**{"data.path": str(write_corpus(root / "corpus")), "train.steps": 8, "optim.lr": 0.01,
                            "feedback.mode": "gate", "feedback.passes": [0.5, 0.3, 0.2], "feedback.mix_from_step": 2})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(looplm.runs.report, "write_plots", lambda run_dir, report: [])     # seconds of matplotlib
        torch.manual_seed(0)            # the weights' initialisation: the same run whichever test builds it
        train(recipe, root / "run", quiet=True)
    return root / "run"


@torch.no_grad()
def hand_loss_by_passes(run, passes: int, rounds: int) -> dict[str, float]:
    """Held-out loss after 1..passes feedback passes, written out in float64 through the model's pieces
    (loop_inputs with the fused input, core_step per round, readout's top state), on the run's held-out
    batches: the initial state drawn here as N(0, std^2) from a CPU generator seeded with the target tokens
    of the batches before (eval --rounds' noise), shared by every pass; pass k reads pass k-1's top states
    shifted by one position; the first position and (reset_at_eos) each token after an end-of-text token
    read their plain embedding."""
    import copy

    import torch.nn.functional as F
    from looplm.evaluation.rounds import eval_batches_for
    model = copy.deepcopy(run.model).double().eval()
    eos, reset = run.tokenizer.eos_id, run.recipe.feedback.reset_at_eos
    totals, count = [0.0] * passes, 0
    for x, y in eval_batches_for(run):
        B, T = x.shape
        s0 = (torch.randn(B, T, model.cfg.d_model, generator=torch.Generator().manual_seed(count))
              * model.cfg.init_state_std).double()
        plain = torch.zeros(B, T, dtype=torch.bool)
        plain[:, 0] = True
        if reset and eos is not None:
            plain[:, 1:] |= x[:, :-1] == eos
        fed = None
        for k in range(passes):
            rope, e, _ = model.loop_inputs(x, initial_state=s0, feedback=fed)
            s = s0
            for r in range(1, rounds + 1):
                s = model.core_step(s, e, r, rope)
            tops: dict = {}
            logits = model.readout(s, rope, r=rounds, tops=tops)
            totals[k] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            top = tops[rounds]
            fed = (torch.cat([torch.zeros_like(top[:, :1]), top[:, :-1]], 1), plain)
        count += y.numel()
    return {str(k + 1): totals[k] / count for k in range(passes)}


def test_loss_by_passes_equals_a_hand_k_pass_loop_and_pass_1_is_eval_rounds(feedback_lm_run, capsys):
    """The report's feedback_val_loss_by_passes and eval --feedback-passes against the float64 hand loop, and
    pass 1 against `eval --rounds` at the same depth: the same number exactly (the same initial-state noise)."""
    import json

    from looplm.cli import main
    run = looplm.load_run(feedback_lm_run)
    R = run.recipe.depth.rounds
    assert run.recipe.model.init_state == "random"
    hand = hand_loss_by_passes(run, 5, R)
    assert abs(hand["2"] - hand["1"]) > 1e-2                         # feedback changes the loss: passes differ
    report = json.loads((feedback_lm_run / "report.json").read_text())
    for k, v in report["feedback_val_loss_by_passes"].items():
        assert v == pytest.approx(hand[k], rel=1e-5, abs=0), k
    assert main(["eval", str(feedback_lm_run), "--rounds", f"1,{R}", "--feedback-passes", "1,2,5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert list(got["feedback_loss_by_passes"]) == ["1", "2", "5"]
    for k, v in got["feedback_loss_by_passes"].items():
        assert v == pytest.approx(hand[k], rel=1e-5, abs=0), k
    assert got["feedback_loss_by_passes"]["1"] == got["rounds"][str(R)]["loss"]       # one noise convention
    assert report["feedback_val_loss_by_passes"]["1"] == report["val_loss_extrapolation"][str(R)]   # every depth 1..2R


def test_a_feedback_run_trains_reports_its_passes_and_generates_in_every_prompt_mode(feedback_lm_run, tmp_path,
                                                                                    capsys, monkeypatch):
    """End to end: the pass mixture trains; the report's pass record equals a replay of the draws
    (looplm check); eval reports loss by passes; generate decodes in all three prompt modes, the plain
    --no-cache reference refuses it; export refuses it by name."""
    import json

    import looplm.runs.report
    from conftest import tiny_recipe
    from looplm.checks import check_token_accounting
    from looplm.cli import main
    from looplm.train.trainer import train
    monkeypatch.setattr(looplm.runs.report, "write_plots", lambda run_dir, report: [])   # seconds of matplotlib
    run_dir = feedback_lm_run
    recipe = looplm.load_run(run_dir).recipe
    report = json.loads((run_dir / "report.json").read_text())
    fb = report["feedback"]
    assert fb["extra_parameters"] == 2 * recipe.model.d_model ** 2
    assert sum(fb["passes_histogram"].values()) == 8 and fb["passes_histogram"].get("1", 0) >= 2
    assert set(report["feedback_val_loss_by_passes"]) == {"1", "2", "3"}
    assert "## Full-bandwidth feedback" in (run_dir / "report.md").read_text()
    run = looplm.load_run(run_dir)
    assert check_token_accounting(run).passed
    from looplm.checks import (check_feedback_isolation, check_feedback_loss, check_feedback_shift,
                               check_feedback_start)
    for check in (check_feedback_shift, check_feedback_start, check_feedback_loss, check_feedback_isolation):
        assert check(run).passed, check(run).detail
    assert main(["eval", str(run_dir), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["feedback_loss_by_passes"]) == {"1", "2", "3"}
    assert main(["eval", str(run_dir), "--cache-sweep"]) == 2          # would measure plain decoding
    assert "full-bandwidth feedback" in capsys.readouterr().err
    task_run = tmp_path / "task"                                                 # --feedback-passes is not ignored
    train(tiny_recipe(**{"data.task": "completion", "train.steps": 2, "feedback.mode": "gate", "model.context": 128}),
          task_run, quiet=True)
    assert main(["eval", str(task_run), "--feedback-passes", "1,2"]) == 2
    assert "task run" in capsys.readouterr().err
    assert "held-out loss by passes" not in (task_run / "report.md").read_text()
    assert main(["eval", str(run_dir), "--cache-sweep"]) == 2
    assert "full-bandwidth feedback" in capsys.readouterr().err
    # lm-eval's model scores with the prompt mode asked: fused = the second pass's logits over the whole text
    import torch.nn.functional as F

    from looplm.lm_eval import LoopLM
    from lm_eval.api.instance import Instance
    req = [Instance(request_type="loglikelihood", doc={}, arguments=("def main(x):", " return x"), idx=0)]
    text = run.tokenizer.encode("def main(x): return x")
    cont = len(run.tokenizer.encode(" return x"))
    with torch.no_grad():
        x = torch.tensor([text])
        outs = passes_forward(run.model, x, 2, plain_positions(x, run.tokenizer.eos_id, True))
        want = {m: F.log_softmax(o.logits[0, :-1].float(), -1)[torch.arange(len(text) - 1), x[0, 1:]][-cont:].sum().item()
                for m, o in zip(("standard", "fused"), outs)}
    for mode in ("standard", "fused"):
        assert LoopLM(run=str(run_dir), prompt_mode=mode).loglikelihood(req)[0][0] == \
            pytest.approx(want[mode], abs=1e-3)
    assert want["standard"] != pytest.approx(want["fused"], abs=1e-3)
    for mode in ("standard", "soft", "fused"):
        assert main(["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "6",
                     "--prompt-mode", mode, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["prompt_mode"] == mode
    assert main(["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "6", "--no-cache"]) == 2
    assert "no full-bandwidth feedback" in capsys.readouterr().err
    assert main(["export", str(run_dir), "--hf", str(tmp_path / "hf")]) == 2
    assert "feedback.mode" in capsys.readouterr().err


def feedback_reference(model, full: torch.Tensor, P: int, mode: str):
    """Serial decoding with feedback written out with whole forwards: (T - P + 1, V) logits at positions
    P-1 .. T-1 of `full` (1, T), the prompt its first P tokens read by `mode`."""
    T, d = full.shape[1], model.cfg.d_model
    plain = plain_positions(full, EOS, True)
    if mode == "standard":
        plain[:] = True
    elif mode == "soft":
        plain[:, :P] = True
    h = torch.zeros(1, T, d)
    if mode == "fused":                        # the prompt's extra pass reads pass 1's shifted top states
        h[:, 1:P] = model(full[:, :P], keep_top=True).top[:, :P - 1]
    rows = []
    for t in range(P - 1, T):
        out = model(full[:, :t + 1], feedback=(h[:, :t + 1], plain[:, :t + 1]), keep_top=True)
        rows.append(out.logits[0, t])
        if t + 1 < T:
            h[:, t + 1] = out.top[:, t]
    return torch.stack(rows)


@pytest.mark.parametrize("mode", ["standard", "soft", "fused"])
def test_engine_decodes_each_prompt_mode_as_serial_feedback_written_out(mode):
    from looplm.inference import Engine, SamplingParams
    model = tiny()
    prompt = ids(1, 9)[0].tolist()
    eng = Engine(model, None)
    sp = SamplingParams(max_new_tokens=8, stop_at_eos=False, logprobs=0, prompt_mode=mode)
    got = eng.generate([prompt], sp)[0]
    full = torch.tensor([prompt + got.tokens[:-1]])
    with torch.no_grad():
        ref = feedback_reference(model, full, len(prompt), mode)
    assert got.tokens == ref.argmax(-1).tolist()
    lp = torch.log_softmax(ref.float(), -1)[torch.arange(len(got.tokens)), got.tokens]
    assert got.logprobs == pytest.approx(lp.tolist(), abs=1e-3)     # the packed kernels' rounding, carried on


def test_rows_of_different_prompt_modes_in_one_batch_each_equal_the_engine_alone():
    from looplm.inference import Engine, SamplingParams
    model = tiny()
    eng = Engine(model, None)
    prompts = [ids(1, 11, seed=1)[0].tolist(), ids(1, 7, seed=2)[0].tolist(), ids(1, 9, seed=3)[0].tolist()]
    params = [SamplingParams(max_new_tokens=6, stop_at_eos=False, prompt_mode=m) for m in ("fused", "soft", "standard")]
    together = eng.generate(prompts, params)
    alone = [eng.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    assert [c.tokens for c in together] == [c.tokens for c in alone]
    assert together[0].tokens != eng.generate([prompts[0]], SamplingParams(max_new_tokens=6, stop_at_eos=False,
                                                                           prompt_mode="standard"))[0].tokens


def test_prompt_modes_are_refused_where_they_do_not_apply():
    from looplm.inference import Engine, GenerationConfig, SamplingParams
    plain = looplm.build_model(looplm.load_recipe("quickstart", {"model.d_model": 32, "model.n_heads": 2}))
    with pytest.raises(looplm.UserError, match="prompt_mode soft"):
        Engine(plain, None).generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, prompt_mode="soft"))
    with pytest.raises(looplm.UserError, match="fixed depth"):
        Engine(tiny(), None, GenerationConfig(exit="entropy:1.0"))


def test_two_concurrent_server_requests_with_different_prompt_modes_each_equal_the_engine_alone():
    import asyncio

    import httpx

    from looplm.data.tokenizer import ByteTokenizer
    from looplm.inference import Engine, SamplingParams
    from looplm.serve import ServeLimits, create_app
    model = tiny()
    engine = Engine(model, ByteTokenizer())
    app = create_app(engine, limits=ServeLimits(batch_window_ms=50))
    asks = [{"prompt": "def main(", "max_tokens": 6, "temperature": 0, "prompt_mode": "fused"},
            {"prompt": "import os", "max_tokens": 6, "temperature": 0, "prompt_mode": "soft"}]

    async def both():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=a, timeout=60) for a in asks))
    got = [r.json()["choices"][0]["text"] for r in asyncio.run(both())]
    alone = [engine.generate([a["prompt"]], SamplingParams(max_new_tokens=6, prompt_mode=a["prompt_mode"],
                                                           stop_at_eos=True))[0].text for a in asks]
    assert got == alone
    plain = looplm.build_model(looplm.load_recipe("quickstart", {"model.d_model": 32, "model.n_heads": 2}))
    from fastapi.testclient import TestClient
    r = TestClient(create_app(Engine(plain, ByteTokenizer()))).post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 2, "prompt_mode": "soft"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_mode"


def test_the_feedback_checks_fail_on_a_broken_implementation(monkeypatch):
    """Each check against its bug: no shift (token t reads its own state), a start convention that fuses
    everywhere, a trainer that drops the later passes' loss, a carried state shared between rows."""

    import looplm.model.feedback as fbm
    import looplm.train.trainer as trainer
    from looplm import checks
    from looplm.data.tokenizer import ByteTokenizer
    from looplm.runs.checkpoint import Run
    recipe = looplm.load_recipe("quickstart", {
        "model.d_model": 32, "model.n_heads": 2, "model.context": 32, "depth.kind": "fixed", "depth.rounds": 2,
        "backward.window": "all", "exit.min_rounds": 1, "data.seq_len": 32, "feedback.mode": "gate"})
    run = Run(path=None, recipe=recipe, model=tiny(), tokenizer=ByteTokenizer(), report={})
    for c in (checks.check_feedback_shift, checks.check_feedback_start, checks.check_feedback_loss,
              checks.check_feedback_isolation):
        assert c(run).passed, c.__name__
    with monkeypatch.context() as mp:
        mp.setattr(fbm, "shift_states", lambda top: top)
        assert not checks.check_feedback_shift(run).passed
    with monkeypatch.context() as mp:
        mp.setattr(fbm, "plain_positions", lambda idx, *a, **k: torch.zeros(idx.shape, dtype=torch.bool))
        assert not checks.check_feedback_start(run).passed
    with monkeypatch.context() as mp:
        mp.setattr(trainer, "feedback_plan", lambda recipe, x, *a, **k: (1, None))
        assert not checks.check_feedback_loss(run).passed
    with monkeypatch.context() as mp:
        from looplm.inference.paths.feedback import FeedbackPath
        real = FeedbackPath.inputs

        def shared(self, batch, rows):   # every row reads the first row's carried state
            h, plain = real(self, batch, rows)
            return h[:1].expand_as(h), plain
        mp.setattr(FeedbackPath, "inputs", shared)
        assert not checks.check_feedback_isolation(run).passed


def test_the_seeds_pass_accounting():
    """75/22/3 % of one-, two- and three-pass micro-batches: 1.28 passes on average; 200B unique tokens
    are then 256B token-passes."""
    fb = FeedbackConfig(mode="gate", passes=(0.75, 0.22, 0.03))
    assert fb.mean_passes == pytest.approx(1.28)
    assert 200e9 * fb.mean_passes == pytest.approx(256e9)


def test_training_flops_count_every_pass_against_pytorchs_counter():
    """Counted FLOPs of a 1-, 2- and 3-pass step against torch's FlopCounterMode: whatever the counter
    leaves out of one pass (the CPU attention kernel), each pass leaves out the same, and nothing else
    differs — the fusion's products in the fed passes included."""
    from torch.utils.flop_counter import FlopCounterMode

    from looplm.train.trainer import Counters, train_step
    gaps = []
    for passes in ([1.0], [0, 1.0], [0, 0, 1.0]):
        r = looplm.load_recipe("quickstart", {
            "model.d_model": 32, "model.n_heads": 2, "model.context": 32, "depth.kind": "fixed", "depth.rounds": 2,
            "backward.window": "all", "exit.min_rounds": 1, "data.seq_len": 16, "train.batch_size": 2,
            "model.init_state": "prelude", "feedback.mode": "gate", "feedback.passes": passes})
        model = looplm.build_model(r)
        x = ids(2, 16)
        counters = Counters()
        with FlopCounterMode(display=False) as fc:
            train_step(model, r, x, torch.roll(x, -1, 1), 0, 0, counters, eos_id=EOS)
        gaps.append(counters.train_flops - fc.get_total_flops())
    assert gaps[1] == pytest.approx(2 * gaps[0]) and gaps[2] == pytest.approx(3 * gaps[0])
