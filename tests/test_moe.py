"""LoopMoE: the mixture-of-experts FFN in the core against hand computations; routing per visit,
the auxiliary losses, routing statistics, counted FLOPs and cached decoding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import looplm
from looplm.errors import UserError
from looplm.model.moe import Routing, moe_losses, routing_stats

MOE = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64, "model.n_core": 2,
       "depth.kind": "fixed", "depth.rounds": 3, "data.seq_len": 32, "model.moe_experts": 4, "model.moe_top_k": 2,
       "model.moe_hidden": 24, "model.init_std": 0.3, "model.injection": "add"}   # as the loopmoe recipe


def moe_model(**over):
    torch.manual_seed(0)
    return looplm.build_model(looplm.load_recipe("quickstart", {**MOE, **over})).eval()


def test_one_expert_of_one_equals_the_dense_ffn():
    """E = 1, k = 1, an expert as wide as the dense FFN with its weights: the same model."""
    dense = moe_model(**{"model.moe_experts": 0, "model.moe_top_k": 2, "model.moe_hidden": 0})
    moe = moe_model(**{"model.moe_experts": 1, "model.moe_top_k": 1, "model.moe_hidden": 0})
    state = dense.state_dict()
    for i, blk in enumerate(moe.core):
        d = f"core.{i}.mlp."
        state.update({f"{d}gate_up": torch.cat([state.pop(d + "gate.weight"), state.pop(d + "up.weight")])[None],
                      f"{d}down": state.pop(d + "down.weight")[None], f"{d}router.weight": blk.mlp.router.weight})
    moe.load_state_dict(state)
    x = torch.randint(0, 257, (2, 20))
    torch.testing.assert_close(moe(x).logits, dense(x).logits, rtol=0, atol=1e-5)


def test_moe_ffn_equals_a_token_by_token_hand_computation():
    m = moe_model()
    ffn = m.core[0].mlp
    x = torch.randn(3, 7, 32)
    got = ffn(x)
    E, k = ffn.n_experts, ffn.top_k
    want = torch.zeros_like(x)
    for b in range(3):
        for t in range(7):
            xt = x[b, t]
            p = torch.softmax(ffn.router.weight @ xt, -1)
            top = sorted(range(E), key=lambda e: -p[e].item())[:k]
            z = sum(p[e] for e in top)
            for e in top:
                g, u = (ffn.gate_up[e] @ xt).chunk(2)
                want[b, t] += (p[e] / z) * (ffn.down[e] @ (F.silu(g) * u))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_routing_is_recorded_at_every_visit_and_losses_average_them():
    m = moe_model()
    x = torch.randint(0, 257, (2, 16))
    out = m(x, 3)
    assert sorted(out.routing) == [0, 1] and all(len(v) == 3 for v in out.routing.values())
    assert all(v.shape == (32, 2) for vs in out.routing.values() for v in vs)
    assert len(m(x, 5).routing[0]) == 5
    untied = looplm.build_model(looplm.load_recipe("quickstart", {**MOE, "model.untied": True})).eval()
    assert {i: len(v) for i, v in untied(x).routing.items()} == {i: 1 for i in range(6)}
    assert all(mlp.trace is None for mlp in (b.mlp for b in m.core))     # nothing recorded outside a pass
    # the losses are the mean over the 6 visits of each visit's formula, from the FFNs' inputs by hand
    inputs = []

    def spy(mod):   # blocks call mlp.forward directly (no module hooks): wrap it on the instance
        real = mod.forward
        mod.forward = lambda h, ops=None: inputs.append((mod, h)) or real(h, ops)
    for b in m.core:
        spy(b.mlp)
    out = m(x, 3)
    assert len(inputs) == 6
    want_b = want_z = 0.0
    for mod, h in inputs:
        logits = h.reshape(-1, 32) @ mod.router.weight.T
        p, top = logits.softmax(-1), logits.topk(2, -1).indices
        f = torch.bincount(top.flatten(), minlength=4) / top.numel()
        want_b += 4 * (f * p.mean(0)).sum().item() / 6
        want_z += torch.logsumexp(logits, -1).pow(2).mean().item() / 6
    assert torch.equal(out.routing[0][1], inputs[2][0].router(inputs[2][1].reshape(-1, 32)).topk(2, -1).indices)
    assert out.aux_losses["moe_balance"].item() == pytest.approx(want_b, rel=1e-5)
    assert out.aux_losses["moe_z"].item() == pytest.approx(want_z, rel=1e-5)


def test_balance_loss_is_one_when_even_and_z_loss_by_hand():
    E = 4
    even = Routing(experts=torch.tensor([[0, 1], [2, 3]]), probs=torch.full((2, E), 0.25), logits=torch.zeros(2, E))
    losses = moe_losses([even], E)
    assert losses["balance"].item() == pytest.approx(1.0)
    assert losses["z"].item() == pytest.approx(math.log(E) ** 2)
    skew = Routing(experts=torch.tensor([[0, 1], [0, 1]]), probs=torch.tensor([[0.5, 0.5, 0, 0]] * 2),
                   logits=torch.zeros(2, E))
    assert moe_losses([skew], E)["balance"].item() == pytest.approx(4 * (0.5 * 0.5 + 0.5 * 0.5))   # 2: collapsed


def test_routing_stats_on_constructed_visits():
    v1 = torch.tensor([[0, 1], [0, 1], [2, 3], [0, 2]])
    v2 = torch.tensor([[1, 0], [2, 3], [2, 3], [0, 1]])
    st_ = routing_stats([v1, v2], 4)
    assert st_["consecutive_visits"] == [{"identical": 0.5, "disjoint": 0.25, "partial": 0.25}]
    assert st_["distinct_experts_mean"] == pytest.approx((2 + 4 + 2 + 3) / 4)
    assert st_["distinct_experts_histogram"] == {"2": 2, "3": 1, "4": 1}
    assert st_["load"][0] == [3 / 8, 2 / 8, 2 / 8, 1 / 8]


@given(st.integers(2, 6), st.integers(1, 3), st.integers(2, 4), st.integers(0, 10_000))
@settings(max_examples=40, deadline=None)
def test_routing_shares_sum_to_one(E, k, visits, seed):
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    vs = [torch.rand(9, E, generator=g).topk(k, -1).indices for _ in range(visits)]
    out = routing_stats(vs, E)
    for pair in out["consecutive_visits"]:
        assert sum(pair.values()) == pytest.approx(1.0)
    assert k <= out["distinct_experts_mean"] <= min(E, k * visits)
    assert all(sum(load) == pytest.approx(1.0) for load in out["load"])


def test_flops_of_a_two_block_three_round_moe_by_hand_and_by_pytorch():
    """The counter for a 2-block, 3-round LoopMoE against a count written out here, and against
    PyTorch's FLOP counter on a real forward and backward (every product of every visit)."""
    from torch.utils.flop_counter import FlopCounterMode
    from looplm.model.flops import Visits, pass_flops
    m = moe_model(**{"model.n_prelude": 1, "model.n_coda": 1, "model.tie_embeddings": False})
    cfg = m.cfg
    d, V, E, k, h, f = 32, 257, 4, 2, 24, cfg.ffn_hidden
    attn = d * 4 * 8 + 2 * d * 2 * 8 + 4 * 8 * d           # q, k and v (2 kv heads), o
    dense_block = 2 * (attn + 3 * d * f)
    moe_block = 2 * (attn + d * E + k * 3 * d * h)         # router + the k chosen experts
    fwd = dense_block + 3 * 2 * moe_block + dense_block + 2 * d * V
    v = Visits(rounds=3, grad_rounds=3, readouts=1, grad_readouts=1, prelude_grad=True)
    assert pass_flops(cfg, v, 0)["forward"] == fwd
    assert pass_flops(cfg, v, 0)["total"] == 3 * fwd
    m.train()
    x = torch.randint(0, 257, (2, 12))
    with FlopCounterMode(display=False) as fc:
        F.cross_entropy(m(x, 3).logits.flatten(0, 1), x.flatten()).backward()
    measured = sum(val for op, val in fc.get_flop_counts()["Global"].items() if "mm" in str(op))
    assert measured == pytest.approx(x.numel() * 3 * fwd, rel=1e-9)
    stored = m.params_stored()
    per_token = m.params_per_token_visit(3)
    assert stored - per_token != 0
    idle = 2 * (E - k) * 3 * d * h                        # per visit, the experts a token did not use
    dense_core = sum(p.numel() for p in m.core.parameters())
    carry = m.decay.numel() if m.decay is not None else 0   # decay injection's carry: applied every round too
    assert per_token == pytest.approx(stored - dense_core - carry + 3 * (dense_core - idle + carry))


def test_cached_decode_equals_the_full_forward():
    """A token's routing reads only its own state: the engine's cached greedy decode (and its
    self-speculative decode) equals recomputing the whole sequence per token, and a future token
    never changes an earlier one's experts or logits."""
    from looplm.data.tokenizer import ByteTokenizer
    from looplm.inference.engine import Engine, GenerationConfig, SamplingParams
    m = moe_model()
    tok = ByteTokenizer()
    eng = Engine(m, tok, GenerationConfig())
    from conftest import greedy_by_full_forward
    want = greedy_by_full_forward(m, tok.encode("loop the core"), 10)
    got = eng.generate(["loop the core"], SamplingParams(max_new_tokens=10, stop_at_eos=False))[0].tokens
    assert got == want
    spec = Engine(m, tok, GenerationConfig(speculative="1:3")).generate(
        ["loop the core"], SamplingParams(max_new_tokens=10, stop_at_eos=False))[0]
    assert spec.tokens == want and spec.stats["speculative"]["drafted"] > 0     # shallow drafts, verified
    x = torch.randint(0, 257, (1, 16))
    y = x.clone()
    y[0, 10:] = torch.randint(0, 257, (6,))
    a, b = m(x), m(y)
    torch.testing.assert_close(a.logits[:, :10], b.logits[:, :10], rtol=0, atol=1e-6)
    for i in a.routing:
        for ra, rb in zip(a.routing[i], b.routing[i]):
            assert torch.equal(ra[:10], rb[:10])


def test_recipe_refuses_moe_fields_without_experts_and_bad_top_k():
    with pytest.raises(UserError, match="model.moe_top_k"):
        looplm.load_recipe("quickstart", {"model.moe_experts": 2, "model.moe_top_k": 3})
    with pytest.raises(UserError, match="model.moe_top_k.*model.moe_experts = 0"):
        looplm.load_recipe("quickstart", {"model.moe_top_k": 1})
    with pytest.raises(UserError, match="supervision.moe_balance"):
        looplm.load_recipe("quickstart", {"supervision.moe_balance": 0.1})
    assert looplm.load_recipe("quickstart", MOE).model.moe_hidden == 24


def test_training_adds_the_auxiliary_losses():
    """The step's loss is the language-model loss plus moe_balance * balance + moe_z * z, and the
    router receives gradient from the balance loss alone when the LM loss is removed."""
    from looplm.model.losses import supervised_loss
    from looplm.train.trainer import Counters, train_step
    rec = looplm.load_recipe("quickstart", {**MOE, "supervision.moe_balance": 0.5, "supervision.moe_z": 0.1})
    m = looplm.build_model(rec).train()
    x = torch.randint(0, 257, (2, 17))
    torch.manual_seed(1)
    loss, out, info = train_step(m, rec, x[:, :-1], x[:, 1:], step=0, micro=0, counters=Counters(), rounds=3)
    lm, _ = supervised_loss(rec.supervision, out, x[:, 1:])
    want = lm.item() + 0.5 * info["moe_balance"] + 0.1 * info["moe_z"]
    assert loss == pytest.approx(want, rel=1e-5)
    assert info["moe_balance"] == pytest.approx(out.aux_losses["moe_balance"].item())
    m.zero_grad()
    m(x[:, :-1], 3).aux_losses["moe_balance"].backward()
    assert m.core[0].mlp.router.weight.grad.abs().sum() > 0


def test_loopmoe_run_reports_routing_and_decodes_through_the_cli(tmp_path, capsys):
    """A tiny LoopMoE run: the report's routing section is what routing_stats gives on the
    validation batches at the recipe's depth; `looplm eval` prints it; generate decodes."""
    import json

    from looplm.cli import main
    from looplm.evaluation.rounds import eval_batches_for
    from looplm.train.trainer import train
    from conftest import tiny_recipe
    rec = tiny_recipe(**{"model.moe_experts": 4, "model.moe_hidden": 16, "depth.rounds": 3})
    train(rec, tmp_path / "run", quiet=True)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    rep = report["routing"]
    assert rep["experts"] == 4 and rep["rounds"] == 3 and rep["consecutive_visits"] == "measured"
    run = looplm.load_run(tmp_path / "run")
    batches = eval_batches_for(run)
    with torch.no_grad():
        want = {str(i): routing_stats([torch.cat([run.model(x, 3).routing[i][v] for x, _ in batches])
                                       for v in range(3)], 4) for i in range(2)}
    assert rep["layers"] == want and rep["tokens"] == 2 * 4 * 32
    assert "Routing (LoopMoE)" in (tmp_path / "run" / "report.md").read_text()
    assert (tmp_path / "run" / "routing.png").is_file()
    # per token: everything stored once, except that each of the 3 visits applies the core's 2 blocks
    # with their k = 2 chosen experts of 4 (each 3 x 32 x 16), not all 4
    stored = sum(p.numel() for p in run.model.parameters())
    core = sum(p.numel() for p in run.model.core.parameters())
    carry = run.model.decay.numel()          # the quickstart's decay injection: its carry applies every round
    idle = 2 * (4 - 2) * 3 * 32 * 16
    assert report["params_stored"] == stored
    assert report["params_per_token_visit"] == stored - core - carry + 3 * (core - idle + carry)
    assert main(["eval", str(tmp_path / "run"), "--rounds", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["routing"]["layers"] == want
    assert main(["generate", str(tmp_path / "run"), "--prompt", "def ", "--max-new-tokens", "5"]) == 0


def test_early_exit_runs_the_moe_core():
    """fixed:R through the early-exit pass (running tokens packed into one row) equals the plain
    forward, and under a policy that stops tokens early each token's routing is its own."""
    from looplm.inference.early_exit import early_exit
    m = moe_model(**{"model.n_coda": 0})
    x = torch.randint(0, 257, (2, 12))
    torch.testing.assert_close(early_exit(m, x, "fixed:3", 3).logits, m(x, 3).logits, rtol=0, atol=1e-5)
    with torch.no_grad():
        ent = [torch.distributions.Categorical(logits=m(x, r).logits).entropy() for r in (1, 2)]
    tau = float(torch.cat([e.flatten() for e in ent]).median())
    out = early_exit(m, x, f"entropy:{tau}", 3)
    assert out.rounds_used.min() < 3 and out.rounds_used.max() > 1
    # a token whose predecessors all ran at least its rounds saw them as a plain pass at its depth
    # does: its logits are that pass's over its prefix
    checked = 0
    for b in range(2):
        for t in range(12):
            r = int(out.rounds_used[b, t])
            if t == 0 or int(out.rounds_used[b, :t].min()) >= r:
                with torch.no_grad():
                    want = m(x[b:b + 1, :t + 1], r).logits[0, -1]
                torch.testing.assert_close(out.logits[b, t], want, rtol=0, atol=1e-4)
                checked += int(r < 3)
    assert checked > 0, "some early-exited token should be checked"


def measured_step_flops(run) -> float:
    """FLOPs of one training step of a run's recipe: the products of a real forward and backward as
    PyTorch counts them, and by hand the attention its CPU counter leaves out (QK^T and AV against
    (T + 1) / 2 keys on average, at every block visit, forward and twice that backward)."""
    from torch.utils.flop_counter import FlopCounterMode
    from looplm.train.trainer import Counters, train_step
    rec, cfg = run.recipe, run.recipe.model
    B, T = rec.train.batch_size, rec.data.seq_len
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with FlopCounterMode(display=False) as fc:
        train_step(run.model.train(), rec, x, x, 0, 0, Counters())
    products = sum(v for op, v in fc.get_flop_counts()["Global"].items() if "mm" in str(op))
    visits = cfg.n_prelude + cfg.n_core * rec.depth.rounds + cfg.n_coda    # untied: n_core x R blocks once each
    attention = 3 * visits * 4 * cfg.n_heads * cfg.head_dim * (T + 1) / 2 * B * T
    return (products + attention) * rec.train.grad_accum


def test_experiment_loopmoe_quick_matches_flops_from_each_runs_counter(tmp_path, capsys):
    """`looplm experiment loopmoe --quick`: four variants, each trained to the loop variant's FLOP
    budget, checked against FLOPs PyTorch counts on each run's own model; the table's numbers are
    the runs' (steps from metrics.jsonl, stored parameters and validation loss recomputed here); the
    ordering is the measured one."""
    import json

    import torch.nn.functional as F

    from looplm.cli import main
    from looplm.evaluation.rounds import eval_batches_for
    from looplm.experiments.loopmoe import QUICK
    assert main(["experiment", "loopmoe", "--quick", "--out", str(tmp_path / "x"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["variant"]: r for r in res["rows"]}
    assert list(rows) == ["base", "loop", "moe", "loopmoe"]
    runs = {v: looplm.load_run(tmp_path / "x" / v) for v in rows}
    with torch.no_grad():   # validation loss at R by a plain forward and cross entropy, before any step below
        val = {v: [F.cross_entropy(run.model(x, 2).logits.flatten(0, 1), y.flatten()).item()
                   for x, y in eval_batches_for(run)] for v, run in runs.items()}
    per_step = {v: measured_step_flops(run) for v, run in runs.items()}
    budget = QUICK["train.steps"] * per_step["loop"]      # the loop variant at the recipe's steps
    assert res["budget_flops"] == pytest.approx(budget, rel=1e-9)
    for v, r in rows.items():
        rec = runs[v].recipe
        assert rec.model.untied == (v in ("base", "moe")) and (rec.model.moe_experts > 0) == (v in ("moe", "loopmoe"))
        steps = len((tmp_path / "x" / v / "metrics.jsonl").read_text().splitlines())     # one row a step
        assert steps == max(1, round(budget / per_step[v])), v
        assert r["steps"] == steps and r["train_flops"] == pytest.approx(steps * per_step[v], rel=1e-9), v
        assert r["params_stored"] == sum(p.numel() for p in runs[v].model.parameters()), v
        assert len(val[v]) == 1 and r["val_loss"] == pytest.approx(val[v][0], rel=1e-5), v
    assert rows["loop"]["params_stored"] < rows["base"]["params_stored"] < rows["moe"]["params_stored"]
    assert "identical_share" in rows["loopmoe"] and "identical_share" not in rows["moe"]
    assert res["val_loss_order"] == sorted(val, key=lambda v: val[v][0])
    assert "matched training FLOPs" in (tmp_path / "x" / "report.md").read_text()
