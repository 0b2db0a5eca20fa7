"""Per-token early exit (looplm/inference/early_exit.py, evaluated by looplm/evaluation/early_exit.py) against independent computations.

- thresholds that never trigger give the plain full-depth forward, for every policy;
- a token that exits at round r has nothing computed for rounds > r (the K/V writes, the rows
  the core blocks actually receive);
- the gather-based fast path equals a naive reference that computes every token every round and
  then keeps only the active ones (copy-forward K/V for stopped tokens);
- on a model whose tokens cannot interact, each token's result is its own full-depth readout at
  the round `halting.first_exit_round` picks;
- quantile on a hand-set gate stops at the first round whose CDF reaches Q;
- the loss-placement example (0.25/0.75 on 0.8/0.3 = 0.425) through the real loss code, and masses
  from the model's gate summing to 1;
- `looplm eval --exit/--exit-sweep` end to end on a tiny trained run.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import looplm
from looplm.model.blocks import sdpa
from looplm.evaluation.early_exit import evaluate_exit, parse_sweep
from looplm.inference.early_exit import AdaptiveOutput, early_exit
from looplm.cli import main
from looplm.recipe.config import SupervisionConfig
from looplm.errors import UserError
from looplm.halting import first_exit_round, hazards_to_masses, parse_exit_policy, successive_kl, token_entropy
from looplm.model.losses import supervised_loss

from conftest import tiny_recipe

R = 4


def tiny_model(**overrides):
    """A tiny model with prelude, coda, random initial state and a gate; weights a bit larger than
    the default init so successive rounds differ clearly (KL well above rounding noise)."""
    rec = tiny_recipe(**{"depth.rounds": R, "exit.gate": True, "supervision.kind": "learned_exit", "model.init_std": 0.1,
                         **overrides})
    return looplm.build_model(rec).eval()


def gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def spread_gate(model, scale: float = 3.0) -> None:
    """Hand-set the gate so hazards differ strongly between tokens (some exit at once, some never)."""
    with torch.no_grad():
        model.gate[1].weight.normal_(0, scale, generator=gen(7))
        model.gate[1].bias.zero_()


# ---------------------------------------------------------------------------------------
# parity with the plain forward

@pytest.mark.parametrize("policy", [f"fixed:{R}", "quantile:1.0", "entropy:0", "kl:0"])
@pytest.mark.parametrize("overrides", [{}, {"model.n_prelude": 0, "model.n_coda": 0, "model.injection": "none",
                                            "model.init_state": "prelude"}], ids=["prelude+coda", "whole-stack"])
def test_thresholds_that_never_trigger_equal_full_depth(policy, overrides):
    m = tiny_model(**overrides)
    idx = torch.randint(0, 257, (3, 24))
    full = m(idx, R, generator=gen())
    out = early_exit(m, idx, policy, R, generator=gen())
    assert isinstance(out, AdaptiveOutput)
    assert (out.rounds_used == R).all() and out.computed.all()
    torch.testing.assert_close(out.logits, full.logits, rtol=0, atol=1e-6)
    assert torch.equal(out.logits.argmax(-1), full.logits.argmax(-1))


def test_fixed_r_equals_running_r_rounds():
    m = tiny_model()
    idx = torch.randint(0, 257, (2, 20))
    out = early_exit(m, idx, "fixed:2", R, generator=gen())
    torch.testing.assert_close(out.logits, m(idx, 2, generator=gen()).logits, rtol=0, atol=1e-6)
    assert (out.rounds_used == 2).all() and not out.computed[..., 2:].any()


# ---------------------------------------------------------------------------------------
# no work after exit

def test_exited_token_has_no_computation_after_its_exit_round():
    m = tiny_model()
    spread_gate(m)
    idx = torch.randint(0, 257, (3, 32))
    rows_seen: list[int] = []
    hook = m.core[0].register_forward_pre_hook(lambda mod, args: rows_seen.append(args[0].shape[0] * args[0].shape[1]))
    try:
        out = early_exit(m, idx, "quantile:0.5", R)
    finally:
        hook.remove()
    used = out.rounds_used
    assert used.min() == 1 and used.max() == R, "the hand-set gate should give a mix of exit rounds"
    rounds = torch.arange(1, R + 1)
    # the record: round r computed exactly for tokens with r <= rounds_used
    assert torch.equal(out.computed, rounds <= used.unsqueeze(-1))
    # the K/V writes of every core and coda slot agree: nothing written for a token after its exit
    for (kind, r, _i), written in out.cache.writes.items():
        assert kind == "core", "quantile reads out once after the loop, outside the cache"
        assert torch.equal(written, r <= used), (kind, r)
    # the core really received fewer rows: each round exactly its active tokens (the products carry
    # no padding); rounds nobody reaches are not run at all
    active_per_round = [int((used >= r).sum()) for r in range(1, R + 1) if (used >= r).any()]
    assert rows_seen == active_per_round and sum(rows_seen) == out.rows_computed
    assert rows_seen[0] == idx.numel() and all(n < idx.numel() for n in rows_seen[1:])
    # hazards exist only where the gate ran
    assert torch.equal(~out.hazards.isnan(), out.computed)


def test_entropy_readouts_only_while_active():
    m = tiny_model(**{"model.n_coda": 0})        # the parallel pass (with a coda: column by column)
    idx = torch.randint(0, 257, (2, 24))
    probe = m(idx, R, readout_rounds=(1,), generator=gen()).round_logits[1]
    from looplm.halting import token_entropy
    tau = token_entropy(probe).median().item()
    out = early_exit(m, idx, f"entropy:{tau}", R, generator=gen())
    used = out.rounds_used
    assert used.min() == 1 and used.max() > 1
    rounds = torch.arange(1, R + 1)
    assert torch.equal(out.read_out, rounds <= used.unsqueeze(-1))
    for (kind, r, _i), written in out.cache.writes.items():
        assert torch.equal(written, r <= used), (kind, r)


# ---------------------------------------------------------------------------------------
# against a naive reference: compute everything, keep the active tokens

class NaiveKV:
    """Every token is computed every round; `active` (B, T) says which tokens ran this round. A
    stopped token's core K/V is replaced by its stored one (copy_forward) or masked out (mask)."""

    def __init__(self, missing: str = "copy_forward"):
        self.store: dict = {}
        self.active: torch.Tensor | None = None
        self.missing = missing

    def update(self, slot, k, v):
        kind, _r, i = slot
        T = k.shape[2]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        if kind == "core" and (kind, i) in self.store and self.missing == "copy_forward":
            ks, vs = self.store[(kind, i)]
            keep = self.active[:, None, :, None]
            k, v = torch.where(keep, k, ks), torch.where(keep, v, vs)
        if kind == "core" and self.missing == "mask":
            mask = (mask & self.active[:, None, None, :]) | torch.eye(T, dtype=torch.bool)    # (B, 1, T, T)
        self.store[(kind, i)] = (k, v)
        return k, v, mask

    def attend(self, slot, q, k, v):
        return sdpa(q, *self.update(slot, k, v))


def stops(policy, r, rounds, *, cdf=None, logits=None, prev=None):
    """The exit rule written out by hand: round R always stops, else the policy's threshold."""
    kind, value = policy.split(":")
    value = float(value)
    if r == rounds:
        return torch.ones((cdf if cdf is not None else logits[..., 0]).shape, dtype=torch.bool)
    if kind == "quantile":
        return cdf >= value
    if kind == "entropy":
        return token_entropy(logits) < value
    if r == 1:
        return torch.zeros(logits.shape[:-1], dtype=torch.bool)
    return successive_kl(logits, prev) < value


@torch.no_grad()
def naive_early_exit(model, idx, policy, rounds, generator, missing="copy_forward"):
    """Every token every round, the stopped ones frozen; valid where a token's readout reads
    only itself (no coda) or is taken once from the exit states (quantile)."""
    B, T = idx.shape
    rope = model.rope(0, T)
    e = model.encode(idx, rope)
    s = model.initial_state(e, generator)
    kv = NaiveKV(missing)
    active = torch.ones(B, T, dtype=torch.bool)
    used = torch.zeros(B, T, dtype=torch.long)
    surv, latest, prev = torch.ones(B, T), None, None
    per_round = not policy.startswith("quantile")
    for r in range(1, rounds + 1):
        kv.active = active
        s = torch.where(active.unsqueeze(-1), model.core_step(s, e, r, rope, kv), s)
        used += active
        logits = None
        if per_round:
            logits = model.readout(s, rope)
            latest = logits if latest is None else torch.where(active.unsqueeze(-1), logits, latest)
        if model.gate is not None:
            surv = torch.where(active, surv * (1 - model.hazard(s)), surv)
        stop = stops(policy, r, rounds, cdf=1 - surv, logits=logits, prev=prev)
        prev = logits
        active = active & ~stop
        if not active.any():
            break
    return (latest if per_round else model.readout(s, rope)), used


@torch.no_grad()
def decode_reference(model, idx, policy, rounds, missing):
    """What a cached decoder computes, recomputed from scratch for each position t: the prefix
    0..t runs every round with the earlier tokens active exactly up to the rounds they exited at
    (frozen after, seen by the visibility rule), and token t's readout at round r is the coda
    over the earlier tokens' exit states followed by its own round-r state, i.e. the coda K/V a
    decoder's cache holds for them. O(T^2 R) forward passes; initial state "prelude"."""
    B, T = idx.shape
    exit_round = torch.full((B, T), rounds, dtype=torch.long)
    exit_state = torch.zeros(B, T, model.cfg.d_model)
    logits_out = torch.zeros(B, T, model.cfg.vocab_size)
    for t in range(T):
        n = t + 1
        rope = model.rope(0, n)
        e = model.encode(idx[:, :n], rope)
        s = model.initial_state(e)
        kv = NaiveKV(missing)
        running = torch.ones(B, dtype=torch.bool)                      # token t, per row
        surv, prev = torch.ones(B), None
        for r in range(1, rounds + 1):
            act = torch.arange(1, rounds + 1)[r - 1] <= exit_round[:, :n]    # (B, n) earlier tokens
            act[:, t] = running
            kv.active = act
            s = torch.where(act.unsqueeze(-1), model.core_step(s, e, r, rope, kv), s)
            seen = torch.cat([exit_state[:, :t], s[:, t:n]], 1)         # earlier tokens at their exits
            lg = model.readout(seen, rope)[:, t]                        # (B, V)
            if model.gate is not None:
                surv = surv * (1 - model.hazard(s)[:, t])
            stop = running & stops(policy, r, rounds, cdf=1 - surv, logits=lg, prev=prev)
            exit_round[stop, t] = r
            exit_state[stop, t] = s[stop, t]
            logits_out[stop, t] = lg[stop]
            running = running & ~stop
            prev = lg
            if not running.any():
                break
    return logits_out, exit_round


def probe_policy(m, idx, kind):
    """A threshold at the median of the model's own round-1 entropies / round-2 KLs: some tokens exit."""
    probe = m(idx, R, readout_rounds=(1, 2), generator=gen())
    if kind == "quantile":
        return "quantile:0.5"
    if kind == "entropy":
        return f"entropy:{token_entropy(probe.round_logits[1]).median().item()}"
    return f"kl:{successive_kl(probe.round_logits[2], probe.round_logits[1]).median().item()}"


@pytest.mark.parametrize("missing", ["copy_forward", "mask"])
@pytest.mark.parametrize("layout", ["row-per-sequence", "chunked"])
@pytest.mark.parametrize("kind", ["quantile", "entropy", "kl"])
def test_gathered_pass_equals_naive_reference(kind, layout, missing, monkeypatch):
    """The parallel whole-sequence pass (quantile with a coda; entropy/kl without one) against
    computing every token every round and keeping the active ones."""
    import looplm.inference.early_exit as adaptive
    if layout == "chunked":   # pack active tokens into rows of 4: sequences span several rows
        monkeypatch.setattr(adaptive, "CHUNK_WIDTHS", (4,))
        monkeypatch.setattr(adaptive, "ROW_OVERHEAD", 0)
    else:
        monkeypatch.setattr(adaptive, "CHUNK_WIDTHS", ())
    m = tiny_model(**({} if kind == "quantile" else {"model.n_coda": 0}))
    spread_gate(m)
    idx = torch.randint(0, 257, (3, 28))
    attention_rows: list[int] = []
    build = adaptive.QueryLayout.build
    monkeypatch.setattr(adaptive.QueryLayout, "build",
                        staticmethod(lambda active: attention_rows.append(build(active).shape[0]) or build(active)))
    policy = probe_policy(m, idx, kind)
    ref_logits, ref_used = naive_early_exit(m, idx, policy, R, gen(), missing)
    out = early_exit(m, idx, policy, R, generator=gen(), missing=missing)
    assert ref_used.min() < R, "the policy should stop some tokens early"
    assert (max(attention_rows) > idx.shape[0]) == (layout == "chunked")
    assert torch.equal(out.rounds_used, ref_used)
    torch.testing.assert_close(out.logits, ref_logits, rtol=0, atol=1e-5)
    assert out.rows_computed < idx.numel() * R


@pytest.mark.parametrize("missing", ["copy_forward", "mask"])
@pytest.mark.parametrize("kind", ["quantile", "entropy", "kl"])
def test_eval_exit_equals_token_by_token_decoding_with_a_coda(kind, missing):
    """`looplm eval --exit P` (evaluate_exit / early_exit) and the Engine decoding the same tokens
    one at a time under P (its public chunk API, as DecodeBatch does) give the same rounds per
    token and the same losses on a model with a coda, and both equal the from-scratch decode
    reference above."""
    from looplm.inference.engine import Engine, GenerationConfig
    m = tiny_model(**{"model.init_state": "prelude"})
    spread_gate(m)
    x = torch.randint(0, 257, (2, 14))
    y = torch.randint(0, 257, (2, 14))
    policy = probe_policy(m, x, kind)
    ref_logits, ref_used = decode_reference(m, x, policy, R, missing)
    assert ref_used.min() < R and ref_used.max() > 1, "the policy should give a mix of exit rounds"

    out = early_exit(m, x, policy, R, missing=missing)
    assert torch.equal(out.rounds_used, ref_used)
    torch.testing.assert_close(out.logits, ref_logits, rtol=0, atol=1e-5)
    row = evaluate_exit(m, [(x, y)], policy, R, missing=missing)

    engine = Engine(m, None, GenerationConfig(exit=policy, rounds=R, missing=missing))
    engine.kernels()
    cache = engine.new_cache(2, 14)
    logits, used = [], []
    with torch.inference_mode():
        for c in range(14):
            lg, u = engine.run_chunk(x[:, c:c + 1], c, cache)             # decode chunks of one column
            logits.append(lg)
            used.append(u)
    dec_logits, dec_used = torch.stack(logits, 1), torch.stack(used, 1)
    assert torch.equal(dec_used, ref_used)
    torch.testing.assert_close(dec_logits, ref_logits, rtol=0, atol=1e-5)
    dec_loss = torch.nn.functional.cross_entropy(dec_logits.flatten(0, 1), y.flatten()).item()
    assert math.isclose(row["loss"], dec_loss, rel_tol=1e-5)
    assert row["mean_rounds"] == pytest.approx(dec_used.float().mean().item())


@pytest.mark.parametrize("kind", ["quantile", "entropy", "kl"])
def test_independent_tokens_exit_where_first_exit_round_says(kind):
    """With every attention output projection zeroed, tokens do not interact, so each token's
    early-exit result must be its own plain forward read out at the round the offline rule picks."""
    m = tiny_model(**{"model.init_state": "prelude"})
    spread_gate(m, scale=1.0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("attn.o.weight"):
                p.zero_()
    idx = torch.randint(0, 257, (2, 30))
    full = m(idx, R, readout_rounds=tuple(range(1, R + 1)))
    stacked = torch.stack([full.round_logits[r] for r in range(1, R + 1)], dim=-2)     # (B, T, R, V)
    from looplm.halting import token_entropy
    policy = {"quantile": "quantile:0.6",
              "entropy": f"entropy:{token_entropy(full.round_logits[2]).median().item()}",
              "kl": "kl:1e-3"}[kind]
    p = parse_exit_policy(policy)
    expect = first_exit_round(p, R, hazards=full.hazards, logits=stacked)
    out = early_exit(m, idx, p, R)
    assert torch.equal(out.rounds_used, expect)
    want = stacked.gather(2, (expect - 1)[..., None, None].expand(-1, -1, 1, stacked.shape[-1])).squeeze(2)
    torch.testing.assert_close(out.logits, want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------
# quantile on a constructed gate

@pytest.mark.parametrize("q,expected", [(0.25, 1), (0.5, 1), (0.6, 2), (0.75, 2), (0.8, 3), (0.875, 3),
                                        (0.9, 4), (1.0, 4)])
def test_quantile_picks_first_round_whose_cdf_reaches_q(q, expected):
    """Constant hazard 1/2 (gate weight 0, bias 0): CDF = 1/2, 3/4, 7/8, then the forced round 4."""
    m = tiny_model()
    with torch.no_grad():
        m.gate[1].weight.zero_()
        m.gate[1].bias.zero_()
    idx = torch.randint(0, 257, (2, 16))
    out = early_exit(m, idx, f"quantile:{q}", R, generator=gen())
    assert (out.rounds_used == expected).all()
    torch.testing.assert_close(out.logits, m(idx, expected, generator=gen()).logits, rtol=0, atol=1e-6)


def test_min_rounds_and_prefill():
    m = tiny_model()
    with torch.no_grad():
        m.gate[1].weight.zero_()
        m.gate[1].bias.fill_(10.0)                                      # hazard ~1: exit at once
    idx = torch.randint(0, 257, (1, 12))
    assert (early_exit(m, idx, "quantile:0.5", R).rounds_used == 1).all()
    policy = parse_exit_policy("quantile:0.5", min_rounds=3)
    assert (early_exit(m, idx, policy, R).rounds_used == 3).all()
    # prompt tokens run every round unless the policy allows exiting in prefill
    assert (early_exit(m, idx, "quantile:0.5", R, prefill=True).rounds_used == R).all()
    allow = parse_exit_policy("quantile:0.5", exit_in_prefill=True)
    assert (early_exit(m, idx, allow, R, prefill=True).rounds_used == 1).all()


def test_quantile_without_gate_is_a_user_error():
    m = looplm.build_model(tiny_recipe()).eval()
    with pytest.raises(UserError, match="exit gate"):
        early_exit(m, torch.zeros(1, 4, dtype=torch.long), "quantile:0.5", 3)


def test_parse_sweep():
    assert parse_sweep("entropy") == ("entropy", None)
    assert parse_sweep("kl:0.001,0.01") == ("kl", [0.001, 0.01])
    for bad in ("fixed", "quantile:2", "entropy:a,b", "kl:"):
        with pytest.raises(UserError):
            parse_sweep(bad)


def test_evaluate_exit_fixed_matches_full_loss():
    m = tiny_model()
    batches = [(torch.randint(0, 257, (2, 16)), torch.randint(0, 257, (2, 16))) for _ in range(2)]
    row = evaluate_exit(m, batches, f"fixed:{R}", R)
    from looplm.evaluation.rounds import evaluate_rounds
    assert row["mean_rounds"] == R and row["rounds_histogram"] == {str(R): 64}
    assert math.isclose(row["loss"], evaluate_rounds(m, batches, [R])[R]["loss"], rel_tol=1e-6)
    assert row["wall_time_s"] > 0


# ---------------------------------------------------------------------------------------
# losses and masses through the real code

def logits_with_loss(losses: list[float]) -> torch.Tensor:
    """(1, len, 2) logits whose cross-entropy against target 0 is exactly each given loss."""
    a = torch.tensor([-math.log(math.expm1(x)) for x in losses], dtype=torch.float64)
    return torch.stack([a, torch.zeros_like(a)], dim=-1).unsqueeze(0)


def test_round_weights_combine_losses_not_states():
    """Weights 0.25/0.75 on per-round losses 0.8/0.3 give 0.425 through losses.supervised_loss."""
    cfg = SupervisionConfig(kind="rounds", rounds=(1, 2), weights=(0.25, 0.75))
    l1, l2 = logits_with_loss([0.8]), logits_with_loss([0.3])
    out = SimpleNamespace(rounds=2, round_logits={1: l1, 2: l2})
    targets = torch.zeros(1, 1, dtype=torch.long)
    loss, info = supervised_loss(cfg, out, targets)
    assert math.isclose(loss.item(), 0.425, abs_tol=1e-6)  # token_losses works in float32
    assert info["round_losses"] == pytest.approx({1: 0.8, 2: 0.3})
    # the loss of a weighted average of the round outputs is a different number
    mixed = torch.nn.functional.cross_entropy((0.25 * l1 + 0.75 * l2)[0], targets[0]).item()
    assert abs(mixed - 0.425) > 1e-3


def test_masses_from_the_model_sum_to_one_and_learned_exit_runs():
    m = tiny_model(**{"supervision.kind": "learned_exit"})
    spread_gate(m, scale=1.0)
    idx = torch.randint(0, 257, (2, 16))
    out = m(idx, R, readout_rounds=tuple(range(1, R + 1)))
    assert out.hazards.shape == (2, 16, R)
    masses = hazards_to_masses(out.hazards)
    torch.testing.assert_close(masses.sum(-1), torch.ones(2, 16), rtol=0, atol=1e-6)
    surv = torch.prod(1 - out.hazards[..., :R - 1], dim=-1)
    torch.testing.assert_close(masses[..., -1], surv)                   # the last round takes what is left
    rec = tiny_recipe(**{"depth.rounds": R, "exit.gate": True, "supervision.kind": "learned_exit"})
    loss, info = supervised_loss(rec.supervision, out, torch.randint(0, 257, (2, 16)))
    assert torch.isfinite(loss) and 1 <= info["mean_exit_round"] <= R


# ---------------------------------------------------------------------------------------
# the CLI on a tiny trained run

@pytest.fixture(scope="module")
def gated_run(tmp_path_factory):
    from looplm.train.trainer import train
    root = tmp_path_factory.mktemp("adaptive")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.py").write_text("\n".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}" for j in range(60)))
    # additive injection: the exits the tests below need (tokens leaving at different rounds) were found with it
    rec = tiny_recipe(**{"depth.rounds": R, "exit.gate": True, "supervision.kind": "learned_exit",
                         "supervision.prior": "uniform", "data.path": str(corpus), "model.injection": "add"})
    train(rec, root / "run", quiet=True)
    return root / "run"


def test_eval_exit_json(gated_run, capsys):
    assert main(["eval", str(gated_run), "--rounds", "1,4", "--exit", "quantile:0.5", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    ex = res["exit"]
    assert ex["policy"] == "quantile:0.5" and 1 <= ex["mean_rounds"] <= R
    assert {"loss", "mean_rounds", "wall_time_s", "exit_distribution_mean_rounds", "full_depth"} <= set(ex)
    assert set(res["rounds"]) == {"1", "4"}


def test_eval_batch_size_regroups_the_same_windows(gated_run, capsys):
    """`looplm eval --batch-size N` scores the same validation windows in passes of N rows: the
    same tokens (every window once, in order) and, with a deterministic initial state, the same
    losses by rounds and under an exit policy (a random one draws its noise per pass); a size
    that is not a positive integer is refused."""
    import dataclasses
    import looplm
    from looplm.evaluation.early_exit import evaluate_exit
    from looplm.evaluation.rounds import eval_batches_for, evaluate_rounds
    run = looplm.load_run(gated_run)
    default, regrouped = eval_batches_for(run), eval_batches_for(run, batch_size=5)
    assert len(default[0][0]) != 5 and {len(x) for x, _ in regrouped[:-1]} == {5}
    for i in (0, 1):
        assert torch.equal(torch.cat([b[i] for b in default]), torch.cat([b[i] for b in regrouped]))
    prelude_init = dataclasses.replace(run.recipe.model, init_state="prelude")
    m = looplm.build_model(dataclasses.replace(run.recipe, model=prelude_init)).eval()
    m.load_state_dict(run.model.state_dict())
    a, b = evaluate_rounds(m, default, [1, R]), evaluate_rounds(m, regrouped, [1, R])
    assert all(a[r]["loss"] == pytest.approx(b[r]["loss"], rel=1e-6) for r in (1, R))
    ea, eb = (evaluate_exit(m, bs, "quantile:0.5", R) for bs in (default, regrouped))
    assert ea["loss"] == pytest.approx(eb["loss"], rel=1e-6) and ea["mean_rounds"] == pytest.approx(eb["mean_rounds"])
    assert main(["eval", str(gated_run), "--rounds", "1", "--batch-size", "5", "--json"]) == 0
    assert "1" in json.loads(capsys.readouterr().out)["rounds"]
    assert main(["eval", str(gated_run), "--batch-size", "0"]) == 2
    # early exit is timed in passes of EXIT_PASS_ROWS (here: all 8 windows) when the initial state is
    # deterministic; a random one keeps the recipe's batches of 4
    import shutil
    det = gated_run.parent / "deterministic"
    shutil.copytree(gated_run, det, dirs_exist_ok=True)
    toml = det / "recipe.toml"
    toml.write_text(toml.read_text().replace('init_state = "random"', 'init_state = "prelude"'))
    for path, extra, rows in ((gated_run, [], 4), (det, [], 8), (det, ["--batch-size", "4"], 4)):
        assert main(["eval", str(path), "--exit", "quantile:0.5", "--json", *extra]) == 0
        assert json.loads(capsys.readouterr().out)["pass_rows"] == rows, (path, extra)


def test_eval_exit_missing_kv_is_the_visibility_rule_evaluated(gated_run, capsys):
    """eval --exit P --missing-kv M measures the function generate/serve run under M: the loss equals
    evaluate_exit with that rule, computed here directly, and the two rules differ once tokens exit."""
    import looplm
    from looplm.evaluation.early_exit import evaluate_exit
    from looplm.evaluation.rounds import eval_batches_for
    run = looplm.load_run(gated_run)
    batches = list(eval_batches_for(run))
    by_rule = {}
    for missing in ("copy_forward", "mask"):
        assert main(["eval", str(gated_run), "--rounds", "1", "--exit", "quantile:0.5", "--missing-kv", missing,
                     "--json"]) == 0
        ex = json.loads(capsys.readouterr().out)["exit"]
        ref = evaluate_exit(run.model, batches, "quantile:0.5", R, missing=missing)
        assert ex["missing"] == missing and ex["loss"] == pytest.approx(ref["loss"], abs=1e-6)
        assert ex["mean_rounds"] == pytest.approx(ref["mean_rounds"]) and ex["mean_rounds"] < R
        by_rule[missing] = ex["loss"]
    assert by_rule["copy_forward"] != by_rule["mask"]
    assert main(["eval", str(gated_run), "--missing-kv", "mask"]) == 2          # nothing exits: refused, not ignored
    assert "--exit" in capsys.readouterr().err
    assert main(["eval", str(gated_run), "--exit", "quantile:0.5", "--missing-kv", "hide"]) == 2
    assert "copy_forward, mask" in capsys.readouterr().err


def test_eval_exit_sweep_writes_table_plot_and_report(gated_run, capsys, monkeypatch):
    import looplm.evaluation.early_exit as adaptive
    monkeypatch.setattr(adaptive, "TIMING_REPEATS", 2)       # what is written, not how well it is timed
    assert main(["eval", str(gated_run), "--exit-sweep", "entropy", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["sweep"]) >= 3 and all({"policy", "loss", "mean_rounds", "wall_time_s"} <= set(r) for r in res["sweep"])
    assert [r["policy"] for r in res["fixed_reference"]] == [f"fixed:{r}" for r in range(1, R + 1)]
    assert (gated_run / "exit_sweep_entropy.png").stat().st_size > 0
    report = json.loads((gated_run / "report.json").read_text())
    assert "entropy" in report["exit_sweeps"]
    md = (gated_run / "report.md").read_text()
    assert "## Early exit sweep: entropy" in md and "exit-distribution mean depth" in md
    # a second sweep adds its own section and keeps the first
    assert main(["eval", str(gated_run), "--exit-sweep", "quantile:0.3,0.9"]) == 0
    md = (gated_run / "report.md").read_text()
    assert md.count("## Early exit sweep") == 2
    assert "val_loss_extrapolation" in report and "## Depth extrapolation" in md
    assert list(report["val_loss_extrapolation"]) == [str(r) for r in range(1, 2 * R + 1)]
    assert (gated_run / "depth_extrapolation.png").is_file()


@pytest.mark.parametrize("args,needle", [(["--exit", "quantile:2"], "Q must satisfy"),
                                         (["--exit", "nonsense"], "exit policy"),
                                         (["--exit-sweep", "fixed"], "--exit-sweep")])
def test_eval_exit_bad_input_exits_2(gated_run, capsys, args, needle):
    assert main(["eval", str(gated_run), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


@given(st.lists(st.lists(st.booleans(), min_size=12, max_size=12), min_size=1, max_size=4),
       st.sampled_from([(), (2,), (4, 8)]), st.integers(0, 8))
@settings(max_examples=60, deadline=None)
def test_query_layout_covers_each_active_token_once(rows, widths, overhead):
    """Whatever the width, every active token gets exactly one real query slot, in its own
    sequence, and padding per sequence stays below the row width."""
    import looplm.inference.early_exit as adaptive
    active = torch.tensor(rows)
    if not active.any():
        return
    old = adaptive.CHUNK_WIDTHS, adaptive.ROW_OVERHEAD
    adaptive.CHUNK_WIDTHS, adaptive.ROW_OVERHEAD = widths, overhead
    try:
        lay = adaptive.QueryLayout.build(active)
    finally:
        adaptive.CHUNK_WIDTHS, adaptive.ROW_OVERHEAD = old
    got = sorted(zip(lay.seq.tolist(), lay.pos.tolist()))
    assert got == sorted(map(tuple, active.nonzero().tolist()))
    src = torch.arange(active.shape[0]) if lay.src is None else lay.src
    assert torch.equal(src[lay.bi], lay.seq)
    Bp, W = lay.shape
    if lay.src is not None:
        for b in range(active.shape[0]):
            assert int((src == b).sum()) * W - int(active[b].sum()) < W
    assert torch.equal(lay.rows[lay.bi, lay.ai], lay.pos) and int(lay.valid.sum()) == len(lay.pos)


def test_query_layout_leaves_out_sequences_with_no_running_token():
    """A late round where one sequence of eight still runs 40 tokens: one gathered attention row
    of width 40 (cost 40 + ROW_OVERHEAD), not eight rows of which seven are padding (8 x 40) nor
    chunks of 16 or 32; with every sequence running, one row each and no gather."""
    from looplm.inference.early_exit import QueryLayout
    active = torch.zeros(8, 128, dtype=torch.bool)
    active[5, 2:82:2] = True
    lay = QueryLayout.build(active)
    assert lay.shape == (1, 40) and lay.src.tolist() == [5] and lay.pos.tolist() == list(range(2, 82, 2))
    active[:, 0] = True
    assert QueryLayout.build(active).src is None
