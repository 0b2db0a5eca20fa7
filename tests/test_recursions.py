"""Mixture-of-Recursions, token choice: the routed loop against the plain loop and a hand-written
round, both cache rules in training (masks) and in the cached engine, causality, and the losses."""

from __future__ import annotations

import pytest
import torch

import looplm
from looplm.data.tokenizer import ByteTokenizer
from looplm.errors import UserError
from looplm.inference.engine import Engine, GenerationConfig, SamplingParams

MOR = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64, "model.n_core": 2,
       "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 3, "backward.window": "all",
       "data.seq_len": 32, "model.mor": "token_choice", "model.init_state": "prelude"}
TOK = ByteTokenizer()


def mor_model(**over):
    torch.manual_seed(0)
    m = looplm.build_model(looplm.load_recipe("quickstart", {**MOR, **over})).eval()
    with torch.no_grad():              # routers that spread tokens over the depths
        for router in (m.mor_router, m.mor_aux_router):
            if router is not None:
                router.weight.normal_(0, 1.0)
    return m


EXPERT = {"model.mor": "expert_choice"}
KINDS = [{}, EXPERT, {**EXPERT, "model.mor_causal": "aux_router"}]


def plain_twin(m):
    """The same weights without a router: the dense loop."""
    import dataclasses
    plain = looplm.build_model(looplm.load_recipe("quickstart", {**MOR, "model.mor": "none"})).eval()
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("mor_")})
    unrouted = dataclasses.replace(m.cfg, mor="none", mor_capacity=(), mor_alpha=0.1, mor_causal="aux_loss")
    assert unrouted == plain.cfg
    return plain


def test_full_depth_is_the_plain_loop_and_rounds_after_a_tokens_depth_leave_it_alone():
    m = mor_model()
    x = torch.randint(0, 257, (2, 20))
    torch.testing.assert_close(m(x, full_depth=True).logits, plain_twin(m)(x).logits, rtol=0, atol=1e-5)
    out = m(x)
    assert out.rounds_used.min() == 1 and out.rounds_used.max() == 3          # the router spreads depths
    # round 1 by hand: every token runs it, s1 = s0 + w * (core(s0) - s0) with plain causal attention
    with torch.no_grad():
        rope = m.rope(0, 20)
        e = m.encode(x, rope)
        depth, w, _ = m.route(e)
        s1 = e + w.unsqueeze(-1) * (m.core_step(e, e, 1, rope) - e)
        st = m(x, 1)
    torch.testing.assert_close(st.state, s1, rtol=0, atol=1e-6)
    assert torch.equal(st.rounds_used, depth.clamp(max=1))
    # a token whose depth is 1 keeps its round-1 state through rounds 2 and 3
    one = depth == 1
    torch.testing.assert_close(out.state[one], s1[one], rtol=0, atol=1e-6)
    assert not torch.allclose(out.state[~one], s1[~one])


@pytest.mark.parametrize("kind", KINDS, ids=["token", "expert", "expert-aux-router"])
@pytest.mark.parametrize("rule", ["recursion_wise", "shared_first"])
def test_cached_decode_equals_the_full_forward_under_each_cache_rule(rule, kind):
    """The engine (cache policies, one column at a time, every token stopping at its routed depth;
    expert choice by its causal decision) and the full forward in eval mode (masks) compute the same
    function: greedy tokens, per-token rounds and logits by teacher forcing."""
    m = mor_model(**{"model.mor_cache": rule, **kind})
    eng = Engine(m, TOK, GenerationConfig())
    prompt = "the loop decides"
    out = eng.generate([prompt], SamplingParams(max_new_tokens=12, stop_at_eos=False))[0]
    seq = torch.tensor([TOK.encode(prompt) + out.tokens])
    with torch.no_grad():
        full = m(seq[:, :-1])
    P = len(TOK.encode(prompt))
    assert out.tokens == full.logits[0, P - 1:].argmax(-1).tolist()
    assert out.rounds_used == full.rounds_used[0, P - 1:].tolist()
    assert len(set(full.rounds_used[0].tolist())) > 1
    cache = eng.new_cache(1, seq.shape[1])
    eng.kernels()
    with torch.inference_mode():
        for c in range(seq.shape[1] - 1):
            lg, used = eng.run_chunk(seq[:, c:c + 1], c, cache, phase="prefill" if c < P else "decode")
            torch.testing.assert_close(lg[0], full.logits[0, c], rtol=0, atol=2e-4)
            assert int(used[0]) == int(full.rounds_used[0, c])


def test_the_two_cache_rules_are_different_functions_once_tokens_stop():
    a, b = mor_model(), mor_model(**{"model.mor_cache": "shared_first"})
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 257, (2, 20))
    assert not torch.allclose(a(x).logits, b(x).logits, atol=1e-3)
    torch.testing.assert_close(a(x, 1).logits, b(x, 1).logits, rtol=0, atol=1e-6)   # one round: no history


@pytest.mark.parametrize("kind", KINDS, ids=["token", "expert", "expert-aux-router"])
def test_routing_is_causal(kind):
    """At inference no token's depth or logits depend on later tokens (expert choice decides by its
    causal threshold, not the training top-k over the sequence)."""
    m = mor_model(**kind)
    x = torch.randint(0, 257, (1, 24))
    y = x.clone()
    y[0, 12:] = torch.randint(0, 257, (12,))
    a, b = m(x), m(y)
    assert torch.equal(a.rounds_used[:, :12], b.rounds_used[:, :12])
    torch.testing.assert_close(a.logits[:, :12], b.logits[:, :12], rtol=0, atol=1e-6)


def test_balance_loss_by_hand_and_the_bias_update():
    from looplm.model.recursions import depth_counts, mor_losses, update_bias
    depth = torch.tensor([[1, 1, 2, 3]])
    logits = torch.zeros(1, 4, 3)
    got = mor_losses(depth, logits)
    assert got["mor_balance"].item() == pytest.approx(3 * (0.5 + 0.25 + 0.25) / 3)
    assert got["mor_z"].item() == pytest.approx(torch.log(torch.tensor(3.0)).item() ** 2)
    bias = torch.zeros(3)
    update_bias(bias, depth_counts(depth, 3), 0.1)
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.1])


def test_engine_refuses_settings_that_change_the_routed_function():
    m = mor_model()
    for cfg in (GenerationConfig(exit="entropy:1"), GenerationConfig(rounds=2), GenerationConfig(speculative="1:2"),
                GenerationConfig(decode_cache="last")):
        with pytest.raises(UserError):
            Engine(m, TOK, cfg)
    assert Engine(m, TOK, GenerationConfig()).config.missing == "mask"


def test_recipe_validation():
    with pytest.raises(UserError, match="model.mor"):
        looplm.load_recipe("quickstart", {"model.mor": "token_choice"})            # sampled depth
    with pytest.raises(UserError, match="model.mor_cache"):
        looplm.load_recipe("quickstart", {"model.mor_cache": "shared_first"})
    with pytest.raises(UserError, match="train.mor_warmup_steps"):
        looplm.load_recipe("quickstart", {"train.mor_warmup_steps": 5})
    with pytest.raises(UserError, match="model.mor"):
        looplm.load_recipe("quickstart", {**MOR, "exit.gate": True, "supervision.kind": "learned_exit"})


@pytest.mark.parametrize("kind", ["token_choice", "expert_choice"])
def test_a_trained_run_reports_routes_and_checks(tmp_path, capsys, monkeypatch, kind):
    """Train a tiny routed run (warm-up, then the router; token choice with the loss-free bias on):
    the warm-up steps ran every token at full depth, the bias moved as the step's counts say, the
    report and `looplm eval` give the depths the model routes, generate returns them, and `looplm
    check`'s routed-decode check passes — and fails when decoding ignores the router's weights."""
    import json

    from looplm.checks import check_routed_decode
    from looplm.cli import main
    from looplm.train.trainer import train
    from conftest import tiny_recipe
    extra = {"supervision.mor_bias_rate": 0.05} if kind == "token_choice" else {}
    rec = tiny_recipe(**{"model.mor": kind, "model.init_state": "prelude", "backward.window": "all",
                         "train.mor_warmup_steps": 2, "train.log_every": 1, **extra})
    train(rec, tmp_path / "run", quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["mor_full_depth"] for r in rows] == [True, True] + [False] * (len(rows) - 2)
    assert all((r["mor_mean_depth"] == 3) == r["mor_full_depth"] or kind == "token_choice" for r in rows)
    run = looplm.load_run(tmp_path / "run")
    if kind == "token_choice":
        bias = run.model.mor_bias
        assert bias.abs().sum() > 0 and torch.allclose(bias / 0.05, (bias / 0.05).round(), atol=1e-4)
    rep = json.loads((tmp_path / "run" / "report.json").read_text())["recursions"]
    # the depths the loaded model runs on the validation batches (in eval mode), counted here
    from looplm.evaluation.rounds import eval_batches_for
    with torch.no_grad():
        used = torch.cat([run.model(x).rounds_used.flatten() for x, _ in eval_batches_for(run)])
    assert used.numel() == 2 * 4 * 32 and 1 <= int(used.min()) and int(used.max()) <= 3
    mean = used.float().mean().item()

    def same_as_counted(got):
        assert got["tokens"] == used.numel()
        assert got["depth_histogram"] == {str(r): int((used == r).sum()) for r in (1, 2, 3)}
        assert got["tokens_per_round"] == pytest.approx([(used >= r).float().mean().item() for r in (1, 2, 3)])
        assert got["mean_depth"] == pytest.approx(mean) and got["realised_capacity"] == pytest.approx(mean / 3)
    same_as_counted(rep)
    assert (tmp_path / "run" / "recursions.png").is_file()
    assert "## Mixture-of-Recursions routing" in (tmp_path / "run" / "report.md").read_text()
    assert main(["eval", str(tmp_path / "run"), "--rounds", "3", "--json"]) == 0
    same_as_counted(json.loads(capsys.readouterr().out)["recursions"])
    assert main(["eval", str(tmp_path / "run"), "--exit", "entropy:1"]) == 2
    assert main(["generate", str(tmp_path / "run"), "--prompt", "def ", "--max-new-tokens", "4", "--json"]) == 0
    gen = json.loads(capsys.readouterr().out)
    assert len(gen["rounds_used"]) == 4 and gen["exit"] == "routed:3" and 1 <= min(gen["rounds_used"])
    assert check_routed_decode(run).passed
    from looplm.inference import kernels
    monkeypatch.setattr(kernels.PackedOps, "routed_step",
                        lambda self, s, e, r, rope, cache, weight: self.m.core_step(s, e, r, rope, cache, self))
    assert check_routed_decode(run).status == "fail"


def test_the_server_decodes_the_routed_function():
    """`serve` on a routed model: the completion's tokens and per-token rounds are the engine's
    (which equal the forward pass, above), and /v1/models states the routed policy and cache rule."""
    import asyncio

    import httpx

    from looplm.serve import create_app
    m = mor_model()
    want = Engine(m, TOK).generate(["routing"], SamplingParams(max_new_tokens=6, stop_at_eos=False))[0]
    app = create_app(Engine(m, TOK))

    async def scenario():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                done = await c.post("/v1/completions", json={"prompt": "routing", "max_tokens": 6, "temperature": 0},
                                    timeout=60)
                return done, await c.get("/v1/models")
    done, models = asyncio.run(scenario())
    choice = done.json()["choices"][0]
    assert choice["text"] == want.text and choice["rounds_used"] == want.rounds_used
    loop = models.json()["data"][0]["looplm"]
    assert loop["exit"] == "routed:3" and loop["decode_cache"] == "full" and loop["missing_kv"] == "mask"


def test_expert_choice_in_training_keeps_nested_top_k_sets_of_the_capacity():
    """Training mode: round r keeps ceil(capacity_r * T) tokens of each sequence, each a subset of
    the previous round's, the highest router logits among them (checked by hand from the states the
    rounds saw), and the BCE record is the decision against that choice."""
    import math
    m = mor_model(**{**EXPERT, "model.mor_capacity": [1.0, 0.5, 0.25]}).train()
    x = torch.randint(0, 257, (3, 16))
    seen = []
    real = m.expert_choice
    m.expert_choice = lambda s, r, kept, causal, full=False: seen.append((s, r, kept)) or real(s, r, kept, causal, full)
    out = m(x)
    depth = out.rounds_used
    for r, cap in zip((1, 2, 3), (1.0, 0.5, 0.25)):
        assert ((depth >= r).sum(1) == math.ceil(cap * 16)).all()
    for s, r, kept in seen[1:]:
        logits = m.mor_router(s).float()[..., r - 1].masked_fill(~kept, float("-inf"))
        want = logits.topk(math.ceil([1.0, 0.5, 0.25][r - 1] * 16), 1).indices.sort(1).values
        assert torch.equal((depth >= r).nonzero()[:, 1].view(3, -1), want)
    assert set(out.aux_losses) == {"mor_aux", "mor_z"} and out.aux_losses["mor_aux"] > 0


def test_expert_choice_at_capacity_one_with_weight_one_is_the_plain_loop():
    m = mor_model(**{**EXPERT, "model.mor_capacity": [1.0, 1.0, 1.0]}).train()
    x = torch.randint(0, 257, (2, 12))
    assert (m(x).rounds_used == 3).all()
    with torch.no_grad():            # alpha * sigmoid = 1 everywhere: a huge positive router bias
        m.mor_router.weight.zero_()
    import dataclasses
    m.cfg = dataclasses.replace(m.cfg, mor_alpha=2.0)                  # 2 * sigmoid(0) = 1
    torch.testing.assert_close(m(x).logits, plain_twin(m)(x).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("over", [{}, EXPERT, {**EXPERT, "model.mor_causal": "aux_router"},
                                  {**EXPERT, "backward.window": 2}, {"backward.window": 2},
                                  {**EXPERT, "model.init_state": "zeros"}])
def test_router_flops_are_counted_as_pytorch_counts_them(over):
    """The trainer's FLOP counter for a routed training step against PyTorch's FLOP counter: the
    token-choice router once, an expert-choice router per round (and its auxiliary router), their
    backward only where gradient flows."""
    from torch.utils.flop_counter import FlopCounterMode
    from looplm.model.flops import pass_flops
    from looplm.train.trainer import Counters, train_step
    rec = looplm.load_recipe("quickstart", {**MOR, "depth.rounds": 4, **over})
    m = looplm.build_model(rec).train()
    x = torch.randint(0, 257, (2, 17))
    counters = Counters()
    with FlopCounterMode(display=False) as fc:
        train_step(m, rec, x[:, :-1], x[:, 1:], step=0, micro=0, counters=counters, rounds=4)
    measured = sum(v for op, v in fc.get_flop_counts()["Global"].items() if "mm" in str(op))
    assert measured == 32 * pass_flops(m.cfg, counters.last_visits, 0)["total"]


def test_routed_is_not_a_user_exit_policy():
    """"routed" is the router's own decision: a user cannot ask a plain model for it (it would
    silently mean full depth), on the command line or in a recipe."""
    from looplm.halting import parse_exit_policy
    with pytest.raises(UserError, match="exit policy"):
        parse_exit_policy("routed:3")
    with pytest.raises(UserError, match="exit policy"):
        looplm.load_recipe("quickstart", {"exit.policy": "routed:4"})
    with pytest.raises(UserError):
        Engine(plain_twin(mor_model()), TOK, GenerationConfig(exit="routed:3"))
