"""`looplm bench serve`: the CONTRACT's JSON shape, figures that are what ran, and the FLOP bound against
PyTorch's own FLOP count."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import looplm
from looplm.bench.serve import arrivals, flop_bound, new_tokens_of, parse_rates

from conftest import cli

KEYS = {"batching", "rate", "requests_per_s", "tokens_per_s", "p50_latency_s", "p99_latency_s", "ttft_p50_s",
        "mean_batch_rows", "flop_bound_speedup"}


def test_bench_serve_reports_the_three_batchings_side_by_side(tiny_run, capsys):
    code, out, err = cli(capsys, "bench", "serve", tiny_run, "--exit", "kl:0.05", "--requests", "5",
                         "--new-tokens", "4", "--prompt-tokens", "8", "--max-batch", "2", "--runs", "1",
                         "--rate", "offline,200", "--json")
    assert code == 0, err
    res = json.loads(out)
    rows = res["results"]
    assert [(r["rate"], r["batching"]) for r in rows] == [(rate, b) for rate in ("offline", 200.0)
                                                           for b in ("exit", "static", "depth")]
    R = res["rounds"]
    for r in rows:
        assert KEYS <= set(r)
        assert r["p50_latency_s"] <= r["p99_latency_s"] and r["ttft_p50_s"] <= r["p99_latency_s"]
        assert 1 <= r["mean_batch_rows"] <= 2 and 1 <= r["mean_rounds"] <= R
        tokens = sum(new_tokens_of(5, 4, 0))                 # the trace's tokens, each request its own count
        assert math.isclose(r["requests_per_s"] * tokens / 5, r["tokens_per_s"], rel_tol=1e-9)
    for rate in ("offline", 200.0):
        by = {r["batching"]: r for r in rows if r["rate"] == rate}
        assert by["static"]["mean_rounds"] == R and by["static"]["flop_bound_speedup"] == 1.0
        assert by["static"]["speedup"] == 1.0
        assert by["depth"]["tokens_match_exit"] is True
        assert by["depth"]["mean_rounds"] == by["exit"]["mean_rounds"]      # the same tokens ran the same rounds


def test_the_flop_bound_is_pytorchs_count_of_one_token_at_each_depth():
    m = looplm.build_model(looplm.load_recipe("quickstart", {
        "model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64, "depth.kind": "fixed",
        "depth.rounds": 4, "data.seq_len": 32, "model.n_prelude": 1, "model.n_coda": 1})).eval()

    def flops(r: int) -> int:
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            m(torch.tensor([[5]]), r)
        return fc.get_total_flops()
    for d in (1, 2, 3):
        assert flop_bound(m.cfg, 4, d, 0) == pytest.approx(flops(4) / flops(d), rel=2e-3)
    # the bound is linear in d between rounds: (F0 + R Fr) / (F0 + d Fr)
    inv = [1 / flop_bound(m.cfg, 4, d, 0) for d in (1.0, 1.5, 2.0)]
    assert inv[1] == pytest.approx((inv[0] + inv[2]) / 2)


def test_poisson_arrivals_have_the_rate_asked():
    t = arrivals(50.0, 4000, seed=3)
    gaps = torch.tensor(t).diff()
    assert t[0] == 0.0 and bool((gaps >= 0).all())
    assert gaps.mean().item() == pytest.approx(1 / 50.0, rel=0.05)       # 4000 exponential gaps: sd of mean 1.6%
    assert arrivals(math.inf, 3, 0) == [0.0, 0.0, 0.0]
    assert parse_rates("offline,2.5") == [math.inf, 2.5]
    with pytest.raises(looplm.UserError, match="--rate"):
        parse_rates("0")
